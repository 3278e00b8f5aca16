//! What an on-call person does to locks through `LOCKGATE` (see
//! `crate::admin::views` for the replies): see who holds each contended or held
//! lock and who waits ([`LockService::lock_rows`],
//! [`LockService::waiter_rows`]), and free one acquisition that is stuck
//! ([`LockService::release_acquisition`]).
//!
//! Who holds a lock is read from its owner record in the store, as the
//! scripts decide it (the rule of docs/behaviour.md: what lockgate
//! remembers is a hint); what this instance remembers adds the
//! connection, how long it has held, and the attempts parked here.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::conns::{acquisition_id, Client, ACQUISITION_HEX};
use super::LockService;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;
use crate::script;

/// Longest wait for one read or release in the store.
const CALL_TIMEOUT: Duration = Duration::from_secs(1);

/// Who holds a lock, by its owner record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    /// An acquisition made through this instance.
    ThisInstance,
    /// An acquisition made through another lockgate instance.
    AnotherInstance,
    /// The key exists without an owner record: set straight on Redis.
    OutsideLockgate,
    /// The key does not exist (attempts are still parked here).
    Nobody,
    /// Shared, reentrant or counted holders (see [`crate::lock::kinds`]):
    /// the row's `kind` and counts say which and how many.
    Holders,
    /// The store did not answer.
    Unknown,
}

impl Holder {
    /// As shown to operators.
    pub fn as_str(self) -> &'static str {
        match self {
            Holder::ThisInstance => "this instance",
            Holder::AnotherInstance => "another instance",
            Holder::OutsideLockgate => "outside lockgate",
            Holder::Nobody => "nobody",
            Holder::Holders => "holders",
            Holder::Unknown => "unknown",
        }
    }
}

/// One row of `LOCKGATE LOCKS`.
#[derive(Debug, Clone)]
pub struct LockRow {
    /// The lock key.
    pub key: Bytes,
    /// The acquisition holding it ([`acquisition_id`]; empty: none).
    pub acquisition: String,
    /// Who.
    pub holder: Holder,
    /// The connection, when one of this instance's holds it.
    pub client: Option<Client>,
    /// Since it was acquired, ms, when this instance's connection holds it.
    pub held_ms: Option<u64>,
    /// The key's remaining lease in the store, ms.
    pub lease_left_ms: Option<u64>,
    /// Attempts parked here.
    pub waiters: usize,
    /// How long the attempt parked longest has waited, ms.
    pub oldest_wait_ms: Option<u64>,
    /// `exclusive` (one holder, by its owner record), `shared`, `owned`
    /// (an owner's reentrant exclusive lock) or `permits`; empty when
    /// nobody holds it or the store did not answer.
    pub kind: &'static str,
    /// Holders of a shared, owned or counted lock.
    pub holders: Option<u64>,
    /// Their entries (reentrant counts summed).
    pub entries: Option<u64>,
    /// Exclusive callers waiting, holding new readers back.
    pub writers_waiting: Option<u64>,
}

/// One row of `LOCKGATE WAITERS key`, in the order the lock will be
/// handed on.
#[derive(Debug, Clone)]
pub struct WaiterRow {
    /// The connection (`None`: it closed while parked).
    pub client: Option<Client>,
    /// Since its connection first tried, ms.
    pub waited_ms: u64,
}

/// What `LOCKGATE RELEASE` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Released {
    /// Freed (on this many lock stores: 1, or the masters that held it).
    Freed(usize),
    /// The acquisition no longer holds the lock: nobody does now.
    Free,
    /// The acquisition no longer holds the lock: another does (or took
    /// it between the read and the release).
    Other,
}

/// The acquisition id in `arg`, lower-cased, if it is one.
pub fn parse_acquisition(arg: &[u8]) -> Option<String> {
    let ok = arg.len() == ACQUISITION_HEX && arg.iter().all(u8::is_ascii_hexdigit);
    ok.then(|| String::from_utf8_lossy(arg).to_ascii_lowercase())
}

impl LockRow {
    /// A row for `key` with nothing known yet: the store says who holds it.
    fn unknown(key: Bytes) -> LockRow {
        LockRow {
            key,
            acquisition: String::new(),
            holder: Holder::Unknown,
            client: None,
            held_ms: None,
            lease_left_ms: None,
            waiters: 0,
            oldest_wait_ms: None,
            kind: "",
            holders: None,
            entries: None,
            writers_waiting: None,
        }
    }
}

impl LockService {
    /// `key`'s owner record and its lease left (ms), from the store: the
    /// quorum's majority (`None` where the masters disagree), else the
    /// primary or the key's node.
    async fn owner_of(&self, key: &[u8]) -> Result<(Option<Bytes>, Option<u64>), ()> {
        let get = crate::protocol::encode::command(&[b"GET", &super::owner_key(key)]);
        let pttl = crate::protocol::encode::command(&[b"PTTL", key]);
        let (owner, ttl) = match self.quorum() {
            Some(q) => {
                let (get, pttl) = (get.into(), pttl.into());
                let (owners, ttls) = tokio::join!(q.ask_agreed(&get), q.ask_all(&pttl));
                let owner =
                    super::quorum::majority_identical(&owners.replies, q.majority()).cloned();
                let ttl = (ttls.replies.iter())
                    .filter_map(|r| super::quorum::integer(r))
                    .filter(|&t| t >= 0)
                    .min();
                (owner.ok_or(())?, ttl)
            }
            None => {
                let primary = &self.store().primary;
                let (owner, ttl) = tokio::join!(
                    primary.call(get, CALL_TIMEOUT),
                    primary.call(pttl, CALL_TIMEOUT)
                );
                let ttl = ttl.ok().and_then(|r| super::quorum::integer(&r));
                (owner.map_err(|_| ())?, ttl.filter(|&t| t >= 0))
            }
        };
        if owner.first() == Some(&b'-') {
            return Err(());
        }
        let owner = super::txn::resp::as_bulk(&owner).flatten();
        Ok((
            owner.map(Bytes::copy_from_slice),
            ttl.and_then(|t| u64::try_from(t).ok()),
        ))
    }

    /// `LOCKGATE LOCKS`: the lock keys matching `pattern` that this
    /// instance knows are held or has attempts parked on, and those its
    /// connections hold, the most contended first (waiters, then the
    /// oldest wait), at most `max`; each holder read from the store.
    pub async fn lock_rows(self: &Arc<Self>, pattern: Bytes, max: usize) -> Vec<LockRow> {
        let glob = |k: &[u8]| super::keys::glob_match(&pattern, k);
        let mut rows: Vec<LockRow> = (self.storm.contended(&pattern, max))
            .into_iter()
            .map(|c| LockRow {
                lease_left_ms: c.lease_left_ms,
                waiters: c.parked,
                oldest_wait_ms: c.oldest_wait.map(|d| d.as_millis() as u64),
                ..LockRow::unknown(c.key)
            })
            .collect();
        // A connection's record may be stale (its lease ended, an operator
        // released it): which one holds the lock is the owner record's
        // to say, below.
        let holds = self.conns.holds(glob, max);
        for h in &holds {
            if rows.len() >= max {
                break;
            }
            if !rows.iter().any(|r| r.key == h.key) {
                rows.push(LockRow::unknown(h.key.clone()));
            }
        }
        // Calls of the lock API waiting in line here count as waiters.
        for (key, n) in self.lined(glob, max) {
            match rows.iter().position(|r| r.key == key) {
                Some(i) => rows[i].waiters += n,
                None if rows.len() < max => rows.push(LockRow {
                    waiters: n,
                    ..LockRow::unknown(key)
                }),
                None => {}
            }
        }

        rows.sort_by(|a, b| {
            (b.waiters.cmp(&a.waiters))
                .then(b.oldest_wait_ms.cmp(&a.oldest_wait_ms))
                .then(a.key.cmp(&b.key))
        });
        // One key asked by name is read from the store even when this
        // instance knows nothing of it (a shared lock taken elsewhere),
        // and listed if anybody holds it.
        let exact = !pattern
            .iter()
            .any(|c| matches!(c, b'*' | b'?' | b'[' | b'\\'));
        let asked = (exact && max > 0 && !rows.iter().any(|r| r.key == pattern)).then(|| {
            rows.push(LockRow::unknown(pattern.clone()));
            rows.len() - 1
        });
        // The owner records: who holds each, as the store says.
        let reads = rows.iter().map(|r| self.owner_of(&r.key));
        let owners = futures_util::future::join_all(reads).await;
        let prefix = self.instance_prefix().as_bytes();
        let now = Instant::now();
        for (row, owner) in rows.iter_mut().zip(owners) {
            let Ok((owner, ttl)) = owner else { continue };
            row.lease_left_ms = ttl.or(row.lease_left_ms);
            (row.holder, row.acquisition) = match (&owner, ttl) {
                (Some(token), _) if token.starts_with(prefix) => {
                    (Holder::ThisInstance, acquisition_id(token))
                }
                (Some(token), _) => (Holder::AnotherInstance, acquisition_id(token)),
                (None, Some(_)) => (Holder::OutsideLockgate, String::new()),
                (None, None) => (Holder::Nobody, String::new()),
            };
            if matches!(row.holder, Holder::ThisInstance | Holder::AnotherInstance) {
                row.kind = "exclusive";
            }
            let mine =
                (holds.iter()).find(|h| h.key == row.key && h.acquisition == row.acquisition);
            if let Some(h) = mine.filter(|_| !row.acquisition.is_empty()) {
                row.client = Some(h.client.clone());
                row.held_ms = Some(now.saturating_duration_since(h.since).as_millis() as u64);
            }
        }
        if let Some(i) = asked.filter(|&i| rows[i].holder == Holder::Nobody) {
            rows.remove(i);
        }
        // A key without owner record may hold the holders' mark.
        let marked: Vec<usize> = (0..rows.len())
            .filter(|&i| rows[i].holder == Holder::OutsideLockgate)
            .collect();
        let reads = marked.iter().map(|&i| self.kind_facts(&rows[i].key));
        let facts = futures_util::future::join_all(reads).await;
        for (i, f) in marked.into_iter().zip(facts) {
            let (row, Some(f)) = (&mut rows[i], f) else {
                continue;
            };
            row.holder = Holder::Holders;
            row.kind = f.kind;
            row.holders = Some(f.holders);
            row.entries = Some(f.entries);
            row.writers_waiting = Some(f.writers_waiting);
        }
        rows
    }

    /// `LOCKGATE WAITERS key`: the attempts parked here on `key`, in the
    /// order the lock will be handed on.
    pub fn waiter_rows(&self, key: &[u8]) -> Vec<WaiterRow> {
        let now = std::time::Instant::now();
        (self.storm.parked_on(key).into_iter())
            .map(|(id, since)| WaiterRow {
                client: self.conns.client(id),
                waited_ms: now.saturating_duration_since(since).as_millis() as u64,
            })
            .collect()
    }

    /// `LOCKGATE RELEASE key acquisition`: frees `key` only if
    /// `acquisition` still holds it, waking the key's queue and this
    /// instance's parked attempts as a release does. The owner record is
    /// read, its token checked against `acquisition` here, and the lock
    /// released by that exact token with the release-by-token script
    /// ([`script::RELEASE_TOKEN`], also carried out as a transaction on a
    /// server that refuses scripts): a lock handed on in between is not
    /// freed. Counted; logged by the caller.
    pub async fn release_acquisition(
        self: &Arc<Self>,
        key: Bytes,
        acquisition: String,
    ) -> Result<Released, LocalReply> {
        let failed =
            |why: &str| LocalReply::err(format!("lockgate: LOCKGATE RELEASE failed: {why}"));
        let (owner, _) = (self.owner_of(&key).await)
            .map_err(|()| failed("the store did not answer who holds the lock"))?;
        let outcome = match owner {
            None => Released::Free,
            Some(token) if acquisition_id(&token) != acquisition => Released::Other,
            Some(token) => {
                let call = super::evalsha::eval_queued(script::RELEASE_TOKEN, &key, &[&token, b""]);
                let replies: Vec<Bytes> = match self.quorum() {
                    Some(q) => q.ask_all(&call.into()).await.replies,
                    None => {
                        let reply = self.store().primary.call(call, CALL_TIMEOUT).await;
                        vec![reply.map_err(|e| failed(&e.to_string()))?]
                    }
                };
                if let Some(e) = replies.iter().find(|r| r.first() == Some(&b'-')) {
                    let text = String::from_utf8_lossy(&e[1..]).trim_end().to_string();
                    return Err(failed(&format!("the store answered: {text}")));
                }
                let freed = (replies.iter())
                    .filter(|r| super::quorum::integer(r) == Some(1))
                    .count();
                if freed > 0 && self.keeps_guard_record(&key) {
                    self.guard_record_released(&key, &token).await;
                }
                match freed {
                    0 => Released::Other,
                    n => Released::Freed(n),
                }
            }
        };
        match outcome {
            Released::Freed(_) => {
                ProxyMetrics::inc(&self.metrics.operator_released);
                // This instance's parked attempts try at once (the store
                // woke only the queue's head).
                self.storm.released(&key);
            }
            _ => ProxyMetrics::inc(&self.metrics.operator_release_stale),
        }
        Ok(outcome)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acquisition_ids_are_sixteen_hex_digits() {
        let table: &[(&[u8], Option<&str>)] = &[
            (b"a9993e364706816a", Some("a9993e364706816a")),
            (b"A9993E364706816A", Some("a9993e364706816a")),
            (b"a9993e364706816", None),
            (b"a9993e364706816ab", None),
            (b"a9993e36470681xz", None),
            (b"", None),
        ];
        for (arg, want) in table {
            assert_eq!(parse_acquisition(arg).as_deref(), *want, "{arg:?}");
        }
    }
}
