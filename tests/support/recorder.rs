//! A recording client for the fault tests that send their lock commands one
//! at a time (also `LOCKGATE LOCK … SHARED` and `LOCKGATE ACQUIRE`, whose
//! holders may overlap as their kinds allow) (the quorum's master faults, `tests/it/quorum_faults.rs`; the
//! partitions around one lockgate and a cluster node cut off,
//! `tests/it/partitions.rs`, `tests/it/cluster_partition.rs`): every
//! acquisition (`SETNX`, `SET … NX`, `LOCKGATE LOCK`) is recorded as an
//! attempt and, when granted, as a section held until its `DEL` (or its
//! end as the test knows it, [`Recorder::ended`]); the test declares the
//! spans in which it left fewer than a majority of the masters able to
//! grant, or nothing able to grant one key (its node cut off, a failover's
//! hold); and [`Recorder::judge`] hands each lock key's
//! history to the one checker ([`super::history::judge`]): never a grant
//! asked and answered without a majority, never two valid holders, every
//! run of attempts granted within the bound outside those spans.
//!
//! The checker judges one lock per history, so each key gets its own.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::history::{judge, Attempt, Kind, Outcome, Records, Release, Section};
use super::resp::RawClient;

/// lockgate's `default_lease_ms`: the lease of a bare `SETNX`.
const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// The recorder: one history per lock key, timed from one epoch.
pub struct Recorder {
    epoch: Instant,
    keys: BTreeMap<String, Records>,
    /// Sections granted and not released yet, by key.
    open: BTreeMap<String, Section>,
    /// `(from, to, why)` declared by the test, for every key.
    no_majority: Vec<(Duration, Duration, String)>,
    /// A no-majority span begun and not ended yet.
    lost_since: Option<(Duration, String)>,
    /// `(from, to, why)` declared by the test for one key only (its
    /// cluster node cut off, say), and those begun and not ended yet.
    key_spans: BTreeMap<String, Vec<(Duration, Duration, String)>>,
    key_lost: BTreeMap<String, (Duration, String)>,
    /// Every run of attempts must be granted within this, outside the
    /// spans.
    acquire_within: Duration,
    client: usize,
    next_id: u64,
    grants: usize,
}

impl Recorder {
    /// An empty record, from now; each run of attempts must end in a grant
    /// within `acquire_within` outside the no-majority spans.
    pub fn new(acquire_within: Duration) -> Recorder {
        Recorder {
            epoch: Instant::now(),
            keys: BTreeMap::new(),
            open: BTreeMap::new(),
            no_majority: Vec::new(),
            lost_since: None,
            key_spans: BTreeMap::new(),
            key_lost: BTreeMap::new(),
            acquire_within,
            client: 0,
            next_id: 1,
            grants: 0,
        }
    }

    /// The same epoch, for another client (its own worker number).
    pub fn for_client(&self, client: usize) -> Recorder {
        Recorder {
            epoch: self.epoch,
            client,
            next_id: client as u64 * 1_000_000 + 1,
            ..Recorder::new(self.acquire_within)
        }
    }

    fn t(&self) -> Duration {
        self.epoch.elapsed()
    }

    /// From now, fewer than a majority of the masters can grant (`why`).
    pub fn majority_lost(&mut self, why: &str) {
        if self.lost_since.is_none() {
            self.lost_since = Some((self.t(), why.to_string()));
        }
    }

    /// From now, nothing can grant `key` (`why`: its node cut off, say):
    /// as [`Recorder::majority_lost`], for that key only.
    pub fn cannot_grant(&mut self, key: &str, why: &str) {
        let t = self.t();
        (self.key_lost)
            .entry(key.to_string())
            .or_insert_with(|| (t, why.to_string()));
    }

    /// Nothing can grant `key` from `from` to `to` (`why`): a span the test
    /// knows in advance (a hold of a known length).
    pub fn cannot_grant_between(&mut self, key: &str, from: Instant, to: Instant, why: &str) {
        let at = |i: Instant| i.saturating_duration_since(self.epoch);
        let span = (at(from), at(to), why.to_string());
        self.key_spans
            .entry(key.to_string())
            .or_default()
            .push(span);
    }

    /// From now, `key` can be granted again.
    pub fn can_grant(&mut self, key: &str) {
        let t = self.t();
        if let Some((from, why)) = self.key_lost.remove(key) {
            let spans = self.key_spans.entry(key.to_string()).or_default();
            spans.push((from, t, why));
        }
    }

    /// `key`'s section, if one is open, ended now without a `DEL` seen
    /// here: lockgate released it (`release_on_disconnect`), or its
    /// holder left; a later grant is judged against this end.
    pub fn ended(&mut self, key: &str) {
        let t = self.t();
        if let Some(mut s) = self.open.remove(key) {
            s.released = Some(t.min(s.valid_until));
            self.records(key).sections.push(s);
        }
    }

    /// `key`'s open section was granted with this lease (a lock override's),
    /// not the default one a bare `SETNX` or `SET … NX` gets.
    pub fn leased(&mut self, key: &str, lease: Duration) {
        if let Some(s) = self.open.get_mut(key) {
            let drift = lease / 100 + Duration::from_millis(2);
            s.valid_until = s.sent + lease.saturating_sub(drift);
        }
    }

    /// From now, a majority can grant again.
    pub fn majority_back(&mut self) {
        if let Some((from, why)) = self.lost_since.take() {
            let to = self.t();
            self.no_majority.push((from, to, why));
        }
    }

    /// Sends `args` on `c` and records it if it acquires or releases a
    /// lock; returns the reply as [`super::resp::call`] does.
    pub async fn call(&mut self, c: &mut RawClient, args: &[&str]) -> String {
        let sent = self.t();
        let reply = super::resp::call(c, args).await;
        let answered = self.t();
        let upper: Vec<String> = args.iter().map(|a| a.to_ascii_uppercase()).collect();
        let word = |i: usize| upper.get(i).map(String::as_str);
        let acquiring = match word(0) {
            Some("SETNX") => Some((Kind::Legacy, DEFAULT_LEASE, None)),
            Some("SET") if upper.iter().any(|a| a == "NX") => {
                let lease = (upper.iter().position(|a| a == "PX"))
                    .and_then(|i| args.get(i + 1))
                    .and_then(|ms| ms.parse().ok())
                    .map_or(DEFAULT_LEASE, Duration::from_millis);
                Some((Kind::SetNx, lease, None))
            }
            // One key: `LOCK key ttl [WAIT ms] [SHARED]`, `ACQUIRE key
            // permits ttl [WAIT ms]`.
            Some("LOCKGATE") if matches!(word(1), Some("LOCK") | Some("ACQUIRE")) => {
                let permits = (word(1) == Some("ACQUIRE"))
                    .then(|| args.get(3).and_then(|p| p.parse::<usize>().ok()))
                    .flatten();
                let lease_at = if permits.is_some() { 4 } else { 3 };
                let lease = args.get(lease_at).and_then(|ms| ms.parse().ok());
                let wait = (upper.iter().position(|a| a == "WAIT"))
                    .and_then(|i| args.get(i + 1))
                    .and_then(|ms| ms.parse().ok())
                    .map(Duration::from_millis);
                let kind = match permits {
                    Some(p) => {
                        let key = args.get(2).copied().unwrap_or_default();
                        self.records(key).permits = Some(p);
                        Kind::Permit
                    }
                    None if upper.iter().any(|a| a == "SHARED") => Kind::Shared,
                    None => Kind::Fence,
                };
                Some((kind, Duration::from_millis(lease.unwrap_or(0)), wait))
            }
            _ => None,
        };
        let key = args.get(1).copied().unwrap_or_default();
        let key = match word(0) {
            Some("LOCKGATE") => args.get(2).copied().unwrap_or_default(),
            _ => key,
        }
        .to_string();
        if let Some((kind, lease, wait)) = acquiring {
            let outcome = match reply.as_str() {
                ":1\r\n" | "+OK\r\n" => Outcome::Granted,
                r if kind >= Kind::Fence && r.starts_with("*2\r\n") => Outcome::Granted,
                ":0\r\n" | "$-1\r\n" | "_\r\n" | "*-1\r\n" => Outcome::NotAcquired,
                other => Outcome::Failed(other.trim_end().to_string()),
            };
            if outcome == Outcome::Granted {
                self.grants += 1;
                // Redlock's validity: the lease less 1% drift and 2 ms.
                let drift = lease / 100 + Duration::from_millis(2);
                let token = (kind >= Kind::Fence)
                    .then(|| reply.split("\r\n").nth(1))
                    .flatten()
                    .and_then(|l| l.strip_prefix(':'))
                    .and_then(|n| n.parse().ok());
                let section = Section {
                    id: self.next_id,
                    client: self.client,
                    kind,
                    lg: 0,
                    token,
                    sent,
                    start: answered,
                    valid_until: sent + lease.saturating_sub(drift),
                    released: None,
                    paused: false,
                    write_done: None,
                    exposed: None,
                };
                self.next_id += 1;
                if let Some(earlier) = self.open.insert(key.clone(), section) {
                    self.records(&key).sections.push(earlier);
                }
            }
            let client = self.client;
            self.records(&key).attempts.push(Attempt {
                client,
                lg: 0,
                sent,
                answered,
                wait,
                outcome,
            });
        } else if matches!(word(0), Some("DEL") | Some("UNLINK")) || word(1) == Some("UNLOCK") {
            let key = match word(0) {
                Some("LOCKGATE") => args.get(2).copied().unwrap_or_default().to_string(),
                _ => key,
            };
            if let Some(mut s) = self.open.remove(&key) {
                s.released = Some(sent);
                let release = Release {
                    t: sent,
                    section: s.id,
                    acquiring_conn: true,
                    conn_opened: Some(Duration::ZERO),
                    answered,
                    late: sent > s.valid_until,
                    result: reply.trim_end().to_string(),
                };
                let r = self.records(&key);
                r.releases.push(release);
                r.sections.push(s);
            }
        }
        reply
    }

    fn records(&mut self, key: &str) -> &mut Records {
        self.keys.entry(key.to_string()).or_default()
    }

    /// Adds another client's record (same epoch, [`Recorder::for_client`]).
    pub fn merge(&mut self, other: Recorder) {
        let Recorder {
            keys,
            open,
            no_majority,
            key_spans,
            grants,
            ..
        } = other;
        for (key, spans) in key_spans {
            self.key_spans.entry(key).or_default().extend(spans);
        }
        for (key, r) in keys {
            let mine = self.records(&key);
            mine.permits = mine.permits.or(r.permits);
            mine.attempts.extend(r.attempts);
            mine.sections.extend(r.sections);
            mine.releases.extend(r.releases);
        }
        for (key, s) in open {
            self.records(&key).sections.push(s);
        }
        self.no_majority.extend(no_majority);
        self.grants += grants;
    }

    /// Judges every key's history (a span still open ends now): fails the
    /// test on any safety or liveness failure, or with fewer than
    /// `min_grants` grants in all. Returns the number of grants.
    pub fn judge(mut self, what: &str, min_grants: usize) -> usize {
        self.majority_back();
        let lost: Vec<String> = self.key_lost.keys().cloned().collect();
        for key in lost {
            self.can_grant(&key);
        }
        let open = std::mem::take(&mut self.open);
        for (key, s) in open {
            self.records(&key).sections.push(s);
        }
        let (spans, within) = (self.no_majority.clone(), self.acquire_within);
        let mut attempts = 0;
        for (key, r) in self.keys.iter_mut() {
            r.no_majority = spans.clone();
            r.no_majority
                .extend(self.key_spans.get(key).into_iter().flatten().cloned());
            r.acquire_within = Some(within);
            attempts += r.attempts.len();
            let v = judge(r);
            assert!(
                v.clean() && v.live(),
                "{what}: the checker on {key}: {}",
                v.first(5)
            );
        }
        println!(
            "{what}: {} keys, {attempts} attempts, {} grants, {} no-majority spans, {} spans \
             of single keys: checked",
            self.keys.len(),
            self.grants,
            spans.len(),
            self.key_spans.values().map(Vec::len).sum::<usize>()
        );
        assert!(
            self.grants >= min_grants,
            "{what}: {} grants, at least {min_grants} expected",
            self.grants
        );
        self.grants
    }
}
