//! Shared, reentrant and counted locks, and multi-key locks, for new code:
//! `LOCKGATE LOCK key ttl-ms [WAIT ms] [SHARED] [OWNER id]`, `LOCKGATE
//! ACQUIRE key permits ttl-ms [WAIT ms] [OWNER id]` and `LOCKGATE LOCK k1
//! k2 … ttl-ms [WAIT ms]`; `LOCKGATE UNLOCK | EXTEND key token` serve a
//! grant of every kind. Who holds a key is decided in Redis, inside one
//! script per call ([`crate::script::kinds`]); this module only waits its
//! turn, as an exclusive `LOCKGATE LOCK` does ([`super::fence`]): in the
//! key's line of this instance, first come first served, a step or a
//! release at a time.
//!
//! Served on one Redis and on a cluster (a multi-key lock in one slot);
//! refused, saying so, on the quorum, on a server that refuses scripts
//! and for a key whose pattern asks replicas to acknowledge grants.

use std::time::{Duration, Instant};

use bytes::Bytes;

use super::fence::{
    integers, next_try, node_facts, until_freed, validity, Tried, Waiting, WAIT_STEP,
};
use super::txn::OnPrimary;
use super::LockService;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;
use crate::script::kinds as lua;

/// Longest an exclusive caller's wait holds new shared holders back
/// without trying again: a caller that died blocks readers this long at
/// most.
const WRITER_WAIT: Duration = Duration::from_secs(1);

/// What a grant is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A read lock: many holders, no exclusive one.
    Shared,
    /// An exclusive lock held through the holders' record (`OWNER`).
    Exclusive,
    /// One of this many permits of a counting semaphore.
    Permits(u64),
}

impl Kind {
    /// The kind's letter in the holders' record.
    pub(crate) fn code(self) -> &'static [u8] {
        match self {
            Kind::Shared => b"r",
            Kind::Exclusive => b"w",
            Kind::Permits(_) => b"s",
        }
    }
}

/// A call of [`crate::script::kinds::KIND_LOCK`]: who waits, for what.
#[derive(Debug, Clone)]
pub struct KindCall {
    /// The key, the caller's connection, how long to keep trying.
    pub at: Waiting,
    /// The lease, ms.
    pub ttl_ms: u64,
    /// What kind of grant.
    pub kind: Kind,
    /// The reentrant owner (`OWNER id`); none: every grant its own.
    pub owner: Option<Bytes>,
}

/// What every try of a [`KindCall`] sends besides its script, keys,
/// writer hold and (on the quorum) instance token ([`lua::KIND_LOCK`] on
/// one Redis, [`crate::script::qkinds::QKIND_TAKE`] on each master: the
/// same arguments, the quorum's with the token).
pub(crate) struct KindTry {
    code: &'static [u8],
    ttl: String,
    owner: Bytes,
    permits: String,
    waiter: String,
    bound: String,
    life: String,
}

impl KindTry {
    /// The arguments of `call`'s tries.
    pub(crate) fn new(locks: &LockService, call: &KindCall) -> KindTry {
        let (bound, life) = locks.fairness_for(&call.at.key);
        KindTry {
            code: call.kind.code(),
            ttl: call.ttl_ms.to_string(),
            owner: call.owner.clone().unwrap_or_default(),
            permits: match call.kind {
                Kind::Permits(n) => n.to_string(),
                _ => "0".to_string(),
            },
            waiter: locks.waiter(call.at.caller),
            bound: bound.to_string(),
            life: life.to_string(),
        }
    }

    /// `script` on `key` and `keys` for one try by the instance whose
    /// prefix is `prefix`, holding readers back as `waits` says
    /// ([`writer_wait`]), under `token` where the script takes one.
    pub(crate) fn command(
        &self,
        script: &str,
        key: &[u8],
        keys: &[&[u8]],
        waits: &str,
        token: Option<&[u8]>,
        prefix: &str,
    ) -> Bytes {
        let mut argv: Vec<&[u8]> = vec![
            self.code,
            self.ttl.as_bytes(),
            &self.owner,
            self.permits.as_bytes(),
            waits.as_bytes(),
            self.waiter.as_bytes(),
        ];
        argv.extend(token);
        argv.extend([
            prefix.as_bytes(),
            self.bound.as_bytes(),
            self.life.as_bytes(),
        ]);
        super::eval_on(script, key, keys, &argv)
    }
}

/// `lockgate:holders:{key}` (see [`crate::script::kinds`]).
pub fn holders_key(key: &[u8]) -> Bytes {
    super::tagged(b"lockgate:holders:{", key)
}

/// `lockgate:expiry:{key}`.
pub fn expiry_key(key: &[u8]) -> Bytes {
    super::tagged(b"lockgate:expiry:{", key)
}

/// `lockgate:writers:{key}`.
pub fn writers_key(key: &[u8]) -> Bytes {
    super::tagged(b"lockgate:writers:{", key)
}

/// The four keys after lock and owner record every kinds script takes:
/// counter, holders, expiry, writers.
pub(crate) fn book(key: &[u8]) -> [Bytes; 4] {
    [
        super::fence::counter_key(key),
        holders_key(key),
        expiry_key(key),
        writers_key(key),
    ]
}

/// `EVAL KIND_UNLOCK` of `token`'s grant of `key` (any kind).
pub(crate) fn unlock_command(key: &[u8], token: &[u8]) -> Bytes {
    let keys = queued_book(key);
    let keys: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    super::eval_on(lua::KIND_UNLOCK, key, &keys, &[token])
}

/// The keys after lock and owner record of [`lua::KIND_UNLOCK`] and
/// [`crate::script::qkinds::QKIND_UNDO`]: [`book`]'s, queue, places.
pub(crate) fn queued_book(key: &[u8]) -> [Bytes; 6] {
    let [counter, holders, expiry, writers] = book(key);
    let (queue, places) = (super::queue_key(key), super::places_key(key));
    [counter, holders, expiry, writers, queue, places]
}

/// `EVAL KIND_EXTEND` of `token`'s grant of `key` to `ttl_ms` from now.
pub(crate) fn extend_command(key: &[u8], token: &[u8], ttl_ms: u64) -> Bytes {
    let ttl = ttl_ms.to_string();
    let [counter, holders, expiry, writers] = book(key);
    super::eval_on(
        lua::KIND_EXTEND,
        key,
        &[&counter, &holders, &expiry, &writers],
        &[token, ttl.as_bytes()],
    )
}

/// What a client is told when the server refuses lockgate's scripts.
pub(crate) const SCRIPTS_REFUSED: &str =
    "lockgate: shared, counted and multi-key locks need scripts, and this server refuses them; see docs/locks.md";

/// An error reply from Redis as the client's error; a server refusing the
/// script is told as [`SCRIPTS_REFUSED`] (it may refuse before lockgate
/// knew it would).
pub(crate) fn node_error(reply: &[u8]) -> Option<LocalReply> {
    if super::txn::refuses_scripts(reply) {
        return Some(LocalReply::err(SCRIPTS_REFUSED));
    }
    super::fence::node_error(reply)
}

/// How long an exclusive caller still waits, as the scripts take it: `0`
/// when it does not wait (it holds no reader back).
pub(crate) fn writer_wait(exclusive: bool, deadline: Instant) -> String {
    let left = deadline.saturating_duration_since(Instant::now());
    match exclusive && !left.is_zero() {
        true => (left + WAIT_STEP).min(WRITER_WAIT).as_millis().to_string(),
        false => "0".to_string(),
    }
}

impl LockService {
    /// Why a shared, counted or multi-key call cannot be served by this
    /// store, if it cannot (see the module doc).
    pub(crate) fn kinds_refused(&self, node: &OnPrimary, keys: &[Bytes]) -> Option<LocalReply> {
        let why = if self.on_masters() {
            return None;
        } else if node.scriptless() {
            return Some(LocalReply::err(SCRIPTS_REFUSED));
        } else if keys.iter().any(|k| self.ack_rule(k).is_some()) {
            "shared, counted and multi-key locks are not acknowledged by replicas (locks.replicas_ack) yet"
        } else if node.cluster.is_some() && !same_slot(keys) {
            // Redis Cluster's own refusal, code and words.
            return Some(LocalReply::Error(Bytes::from_static(
                b"CROSSSLOT Keys in request don't hash to the same slot",
            )));
        } else {
            return None;
        };
        Some(LocalReply::err(format!(
            "lockgate: {why}; see docs/locks.md"
        )))
    }

    /// A shared, reentrant or counted grant where the locks live, held
    /// after a failover and refused as any acquisition is.
    pub(crate) async fn fence_kind(&self, call: KindCall) -> LocalReply {
        let node = &self.store().primary;
        let keys = [call.at.key.clone()];
        if let Some(refused) = self.grant_refused(node, &keys) {
            return refused;
        }
        match self.quorum() {
            Some(q) => self.quorum_kind_lock(q, call).await,
            None => self.kind_lock(node, call, self.store().timeout()).await,
        }
    }

    /// A multi-key lock where the locks live (see [`LockService::multi_lock`]).
    pub(crate) async fn fence_multi(
        &self,
        keys: Vec<Bytes>,
        at: Waiting,
        ttl_ms: u64,
    ) -> LocalReply {
        let node = &self.store().primary;
        if let Some(refused) = self.grant_refused(node, &keys) {
            return refused;
        }
        match self.quorum() {
            Some(q) => self.quorum_multi_lock(q, keys, at, ttl_ms).await,
            None => (self.multi_lock(node, keys, at, ttl_ms, self.store().timeout())).await,
        }
    }

    /// Why a grant of `keys` of these kinds is not tried now: the store
    /// does not serve them, a failover's hold (nil, as a held lock
    /// answers), an evicting primary or a disputed slot.
    fn grant_refused(&self, node: &OnPrimary, keys: &[Bytes]) -> Option<LocalReply> {
        if let Some(refused) = self.kinds_refused(node, keys) {
            return Some(refused);
        }
        if keys.iter().any(|k| self.held_after_failover(k)) {
            return Some(LocalReply::Null);
        }
        (self.eviction_refusal()).or_else(|| keys.iter().find_map(|k| self.refused_for_dispute(k)))
    }

    /// Counts a grant of `kind`: an entry again (`again`) or a new one.
    pub(crate) fn count_grant(&self, kind: Kind, again: bool) {
        ProxyMetrics::inc(&self.metrics.acquired);
        let counter = match (again, kind) {
            (true, _) => &self.metrics.reentries,
            (false, Kind::Shared) => &self.metrics.shared_grants,
            (false, Kind::Exclusive) => &self.metrics.owned_grants,
            (false, Kind::Permits(_)) => &self.metrics.permit_grants,
        };
        ProxyMetrics::inc(counter);
    }

    /// This caller's id in a key's waiting writers.
    pub(crate) fn waiter(&self, caller: super::lease::ConnId) -> String {
        format!("{}{caller:?}", self.instance_prefix())
    }

    /// `LOCKGATE LOCK … SHARED | OWNER` and `LOCKGATE ACQUIRE`: tries
    /// until granted or the wait has passed, in line with this instance's
    /// other waits on the key; `[token, validity-ms]` or nil.
    pub(crate) async fn kind_lock(
        &self,
        node: &OnPrimary,
        call: KindCall,
        timeout: Duration,
    ) -> LocalReply {
        let args = &KindTry::new(self, &call);
        let KindCall {
            at, ttl_ms, kind, ..
        } = call;
        let key = &at.key;
        let keys = queued_book(key);
        let keys: &Vec<&[u8]> = &keys.iter().map(|k| &k[..]).collect();
        let try_once = move |deadline: Instant| async move {
            self.granting(ttl_ms);
            let started = Instant::now();
            let waits = writer_wait(kind == Kind::Exclusive, deadline);
            let prefix = self.instance_prefix();
            let cmd = args.command(lua::KIND_LOCK, key, keys, &waits, None, prefix);
            let facts = match node_facts(node, cmd, timeout, node_error).await {
                Ok(facts) => facts,
                Err(answer) => return Tried::Answer(answer),
            };
            let (token, pttl) = (
                facts.first().copied().unwrap_or(0),
                facts.get(1).copied().unwrap_or(0),
            );
            if token > 0 {
                self.count_grant(kind, pttl > 1);
                self.storm.line_answered(key, Some(ttl_ms));
                return Tried::Answer(match validity(ttl_ms, started) {
                    Some(v) => {
                        LocalReply::Array(vec![LocalReply::Integer(token), LocalReply::Integer(v)])
                    }
                    // Too slow to be useful: give this entry back.
                    None => {
                        let token = Bytes::from(token.to_string());
                        let _ = self.kind_unlock(node, key.clone(), token, timeout).await;
                        LocalReply::Null
                    }
                });
            }
            ProxyMetrics::inc(&self.metrics.contended);
            self.storm.line_answered(key, None);
            Tried::Again(next_try(Some(pttl), false))
        };
        self.in_line(&at, try_once).await
    }

    /// `LOCKGATE LOCK k1 k2 … ttl-ms [WAIT ms]`: every key or none, in one
    /// atomic step per try (two such calls on overlapping keys never each
    /// hold a part), until the wait has passed; `[[token…], validity-ms]`
    /// or nil. Tries every [`WAIT_STEP`] or at a release through this
    /// instance of its first key.
    pub(crate) async fn multi_lock(
        &self,
        node: &OnPrimary,
        keys: Vec<Bytes>,
        at: Waiting,
        ttl_ms: u64,
        timeout: Duration,
    ) -> LocalReply {
        let Waiting { caller, wait, .. } = at;
        let deadline = Instant::now() + wait;
        let place = self.fence_place(&at.key, caller);
        self.granting(ttl_ms);
        let named: Vec<[Bytes; 4]> = (keys.iter())
            .map(|k| {
                [
                    k.clone(),
                    super::owner_key(k),
                    super::fence::counter_key(k),
                    writers_key(k),
                ]
            })
            .collect();
        let ttl = ttl_ms.to_string();
        let waiter = self.waiter(caller);
        loop {
            ProxyMetrics::inc(&self.metrics.attempts);
            let started = Instant::now();
            let instance_token = self.next_token();
            let waits = writer_wait(true, deadline);
            let mut args: Vec<&[u8]> = vec![b"EVAL", lua::MULTI_LOCK.as_bytes()];
            let numkeys = (named.len() * 4).to_string();
            args.push(numkeys.as_bytes());
            args.extend(named.iter().flatten().map(|k| &k[..]));
            args.extend([
                ttl.as_bytes(),
                &instance_token[..],
                waits.as_bytes(),
                waiter.as_bytes(),
            ]);
            let cmd = crate::protocol::encode::command(&args);
            let facts = match node_facts(node, cmd, timeout, node_error).await {
                Ok(facts) => facts,
                Err(answer) => return answer,
            };
            if facts.len() == keys.len() && facts.iter().all(|&t| t > 0) {
                ProxyMetrics::inc(&self.metrics.acquired);
                ProxyMetrics::inc(&self.metrics.multi_grants);
                if let Some(v) = validity(ttl_ms, started) {
                    let tokens = facts.into_iter().map(LocalReply::Integer).collect();
                    return LocalReply::Array(vec![
                        LocalReply::Array(tokens),
                        LocalReply::Integer(v),
                    ]);
                }
                for (k, t) in keys.iter().zip(facts) {
                    let token = Bytes::from(t.to_string());
                    let _ = self.kind_unlock(node, k.clone(), token, timeout).await;
                }
                return LocalReply::Null;
            }
            ProxyMetrics::inc(&self.metrics.contended);
            let now = Instant::now();
            if now >= deadline {
                return LocalReply::Null;
            }
            let step = next_try(Some(facts.get(1).copied().unwrap_or(0)), false);
            until_freed(place.as_ref(), step.min(deadline - now)).await;
        }
    }

    /// `LOCKGATE UNLOCK` where kinds are served: 1 if `token` held `key`
    /// (an exclusive lock, or an entry of a shared, reentrant or counted
    /// one) and that entry was released.
    pub(crate) async fn kind_unlock(
        &self,
        node: &OnPrimary,
        key: Bytes,
        token: Bytes,
        timeout: Duration,
    ) -> LocalReply {
        let cmd = unlock_command(&key, &token);
        match self.kind_simple(node, cmd, timeout, false).await {
            Some(reply) => {
                if reply == LocalReply::Integer(1) {
                    self.storm.released(&key);
                }
                reply
            }
            // No kinds without scripts: the exclusive lock's own release,
            // which the server runs as a transaction.
            None => self.fence_unlock(node, key, token, timeout).await,
        }
    }

    /// `LOCKGATE EXTEND` where kinds are served: 1 if `token` still held
    /// `key` and its lease is now `ttl_ms` from now.
    pub(crate) async fn kind_extend(
        &self,
        node: &OnPrimary,
        key: Bytes,
        token: Bytes,
        ttl_ms: u64,
        timeout: Duration,
    ) -> LocalReply {
        let cmd = extend_command(&key, &token, ttl_ms);
        match self.kind_simple(node, cmd, timeout, true).await {
            Some(reply) => reply,
            None => (self.fence_extend(node, key, token, ttl_ms, timeout)).await,
        }
    }

    /// A release or extension's reply, counted; `None` when the server
    /// refuses scripts (then no kind but the exclusive one exists there).
    async fn kind_simple(
        &self,
        node: &OnPrimary,
        cmd: Bytes,
        timeout: Duration,
        extend: bool,
    ) -> Option<LocalReply> {
        if node.scriptless() {
            return None;
        }
        let reply = match node.call(cmd, timeout).await {
            Ok(reply) => reply,
            Err(e) => return Some(LocalReply::err(format!("lockgate: {e}"))),
        };
        if super::txn::refuses_scripts(&reply) {
            return None;
        }
        if let Some(err) = node_error(&reply) {
            return Some(err);
        }
        let n = integers(&reply).first().copied().unwrap_or(0);
        let counter = match (extend, n) {
            (false, 1) => &self.metrics.released,
            (false, _) => &self.metrics.release_denied,
            (true, 0) => &self.metrics.extend_denied,
            (true, _) => return Some(LocalReply::Integer(n)),
        };
        ProxyMetrics::inc(counter);
        Some(LocalReply::Integer(n))
    }
}

/// Whether every key is in one hash slot (one key always is).
pub(crate) fn same_slot(keys: &[Bytes]) -> bool {
    use crate::cluster::slot::key_slot;
    let mut slots = keys.iter().map(|k| key_slot(k));
    let first = slots.next();
    slots.all(|s| Some(s) == first)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_writer_holds_readers_back_only_while_it_waits_and_a_second_at_most() {
        let now = Instant::now();
        assert_eq!(writer_wait(false, now + Duration::from_secs(5)), "0");
        assert_eq!(writer_wait(true, now), "0");
        assert_eq!(writer_wait(true, now + Duration::from_secs(5)), "1000");
        let short: u64 = writer_wait(true, now + Duration::from_millis(100))
            .parse()
            .unwrap();
        assert!((25..=125).contains(&short), "{short}");
    }

    #[test]
    fn keys_in_one_slot() {
        let k = |s: &str| Bytes::copy_from_slice(s.as_bytes());
        assert!(same_slot(&[k("a")]));
        assert!(same_slot(&[k("{o}1"), k("{o}2")]));
        assert!(!same_slot(&[k("a"), k("b")]));
    }

    #[test]
    fn kinds_keys_share_the_lock_keys_slot() {
        use crate::cluster::slot::key_slot;
        for key in [&b"lock:a"[..], b"lock:{order}:1"] {
            for k in book(key) {
                assert_eq!(key_slot(&k), key_slot(key));
            }
        }
    }
}
