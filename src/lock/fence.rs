//! The fencing-token API for new code: `LOCKGATE LOCK key ttl-ms [WAIT ms]`
//! → `[token, validity-ms]` or nil, `LOCKGATE UNLOCK key token`,
//! `LOCKGATE EXTEND key token ttl-ms`. Tokens are strictly increasing per
//! key, so storage can refuse a write from a paused ex-holder whose token
//! is older than one it has seen.

use std::time::{Duration, Instant};

use bytes::Bytes;

use super::lease::ConnId;
use super::storm::lines::Place;
use super::txn::OnPrimary;
use super::LockService;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;
use crate::script;

/// Drift allowance of a lease, as Redlock computes validity.
const CLOCK_DRIFT_FACTOR: f64 = 0.01;
/// Longest pause between two attempts of a `LOCK … WAIT`.
pub(crate) const WAIT_STEP: Duration = Duration::from_millis(25);

/// `lockgate:fence:{key}`: the key's token counter, in its hash slot
/// (see [`super::tagged`]).
pub fn counter_key(key: &[u8]) -> Bytes {
    super::tagged(b"lockgate:fence:{", key)
}

/// `EVAL FENCE_UNLOCK` for `key` and `token`.
pub fn unlock_command(key: &[u8], token: &[u8]) -> Bytes {
    super::evalsha::eval_queued(script::FENCE_UNLOCK, key, &[token])
}

/// `EVAL FENCE_EXTEND` for `key`, `token` and a new lease.
pub fn extend_command(key: &[u8], token: &[u8], ttl_ms: u64) -> Bytes {
    let ttl = ttl_ms.to_string();
    super::eval_on(script::FENCE_EXTEND, key, &[], &[token, ttl.as_bytes()])
}

/// The integers of a reply (`:n` lines), in order.
pub fn integers(reply: &[u8]) -> Vec<i64> {
    reply
        .split(|&c| c == b'\n')
        .filter_map(|l| l.strip_prefix(b":").and_then(|l| l.strip_suffix(b"\r")))
        .filter_map(crate::protocol::request::parse_int)
        .collect()
}

/// Waits to be first in `place`'s line until `deadline` (passes at once
/// without a place); `None` when the deadline came first. A caller with
/// no `WAIT` is still let through when nobody is ahead: the lock is
/// tried once.
pub(crate) async fn first_in_line<'a>(
    place: Option<&'a Place<'_>>,
    deadline: Instant,
) -> Option<Option<tokio::sync::MutexGuard<'a, ()>>> {
    let Some(place) = place else {
        return Some(None);
    };
    // `timeout_at` polls the wait once before it looks at the clock.
    tokio::time::timeout_at(deadline.into(), place.first())
        .await
        .ok()
        .map(Some)
}

/// Waits `step`, or less when the lock may be free (see
/// [`super::storm::lines::Lines::free`]).
pub(crate) async fn until_freed(place: Option<&Place<'_>>, step: Duration) {
    match place {
        Some(place) => {
            let _ = tokio::time::timeout(step, place.freed()).await;
        }
        None => tokio::time::sleep(step).await,
    }
}

/// A fencing wait: the key, the connection it came on (its place in the
/// key's line is kept across its `WAIT`s, see [`super::storm::lines`]) and
/// how long it may wait.
#[derive(Debug, Clone)]
pub struct Waiting {
    /// The lock key.
    pub key: Bytes,
    /// The caller's connection.
    pub caller: ConnId,
    /// How long to keep trying.
    pub wait: Duration,
}

/// What one try of a wait in line ([`LockService::in_line`]) came to.
pub(crate) enum Tried {
    /// The caller's answer: granted, refused for good, or an error.
    Answer(LocalReply),
    /// Not granted: tried again after this long, or sooner at a release
    /// through this instance, while the wait lasts.
    Again(Duration),
    /// The store could not decide in time (a quorum not reached): tried
    /// again in [`SOON`].
    Soon,
}

/// The pause before trying again after a store that could not decide.
const SOON: Duration = Duration::from_millis(5);

/// The pause before the next try of a wait that found the lock held for
/// `pttl_ms` more (`None`: no lease learned), or that yielded a free
/// lock to the head of the store's queue (its turn, not a lease to wait
/// out): at most [`WAIT_STEP`], at least 1 ms.
pub(crate) fn next_try(pttl_ms: Option<i64>, yielded: bool) -> Duration {
    match (yielded, pttl_ms) {
        (true, _) => WAIT_STEP,
        (false, Some(ms)) => WAIT_STEP.min(Duration::from_millis(ms.max(1) as u64)),
        (false, None) => Duration::from_millis(1),
    }
}

/// What every try of an exclusive fencing lock on a key sends besides
/// its script, instance token and writer hold ([`script::FENCE_LOCK`] on
/// one Redis, [`script::QFENCE_ACQUIRE`] on each master of the quorum:
/// the same keys and arguments).
pub(crate) struct FenceTry {
    /// The key's counter, queue, places in it, and waiting writers.
    keys: [Bytes; 4],
    /// The lease, ms.
    ttl: String,
    /// The queue's fairness bound and a place's life
    /// ([`LockService::fairness_for`]).
    bound: String,
    life: String,
    /// This caller among the waiting writers (empty: it does not wait).
    waiter: String,
}

impl FenceTry {
    /// The arguments of `at`'s tries for a lease of `ttl_ms`.
    pub(crate) fn new(locks: &LockService, at: &Waiting, ttl_ms: u64) -> FenceTry {
        let key = &at.key;
        let (bound, life) = locks.fairness_for(key);
        FenceTry {
            // A caller that waits holds new shared holders back while it
            // does (see `script::kinds`).
            keys: [
                counter_key(key),
                super::queue_key(key),
                super::places_key(key),
                super::kinds::writers_key(key),
            ],
            ttl: ttl_ms.to_string(),
            bound: bound.to_string(),
            life: life.to_string(),
            waiter: match at.wait.is_zero() {
                true => String::new(),
                false => locks.waiter(at.caller),
            },
        }
    }

    /// `script` on `key` for one try under `token` by the instance whose
    /// prefix is `prefix`, holding readers back as `waits` says
    /// ([`super::kinds::writer_wait`]).
    pub(crate) fn command(
        &self,
        script: &str,
        key: &[u8],
        token: &[u8],
        prefix: &str,
        waits: &str,
    ) -> Bytes {
        let [counter, queue, places, writers] = &self.keys;
        super::eval_on(
            script,
            key,
            &[counter, queue, places, writers],
            &[
                self.ttl.as_bytes(),
                token,
                prefix.as_bytes(),
                self.bound.as_bytes(),
                self.life.as_bytes(),
                waits.as_bytes(),
                self.waiter.as_bytes(),
            ],
        )
    }
}

/// `cmd` on `node` within `timeout`: the integers of its reply, or the
/// caller's answer when there are none to read (lockgate's error, or the
/// node's as `error` reads it: [`node_error`], or the kinds' own, which
/// says a server refusing scripts does not serve them).
pub(crate) async fn node_facts(
    node: &OnPrimary,
    cmd: Bytes,
    timeout: Duration,
    error: fn(&[u8]) -> Option<LocalReply>,
) -> Result<Vec<i64>, LocalReply> {
    let reply = match node.call(cmd, timeout).await {
        Ok(reply) => reply,
        Err(e) => return Err(LocalReply::err(format!("lockgate: {e}"))),
    };
    match error(&reply) {
        Some(err) => Err(err),
        None => Ok(integers(&reply)),
    }
}

impl LockService {
    /// A wait in `at.key`'s line (`LOCKGATE LOCK … WAIT`, every kind, on
    /// one Redis or the quorum): first come first served among this
    /// instance's waits on the key ([`super::storm::lines`]), its turn
    /// given to an older attempt of this instance's ([`Self::fence_turn`]),
    /// `try_once(deadline)` at each turn until it answers or the wait has
    /// passed ("not acquired", the wait kept for the connection's next).
    /// The one loop every kind of wait shares; each try is its own.
    pub(crate) async fn in_line<F, T>(&self, at: &Waiting, mut try_once: F) -> LocalReply
    where
        F: FnMut(Instant) -> T,
        T: std::future::Future<Output = Tried>,
    {
        let deadline = Instant::now() + at.wait;
        let place = self.fence_place(&at.key, at.caller);
        let Some(_first) = first_in_line(place.as_ref(), deadline).await else {
            ProxyMetrics::inc(&self.metrics.contended);
            return self.fence_ran_out(place.as_ref());
        };
        loop {
            if let Err(ran_out) = self.fence_turn(&at.key, place.as_ref(), deadline).await {
                return ran_out;
            }
            ProxyMetrics::inc(&self.metrics.attempts);
            let step = match try_once(deadline).await {
                Tried::Answer(reply) => return reply,
                Tried::Soon => {
                    tokio::time::sleep(SOON).await;
                    continue;
                }
                Tried::Again(step) => step,
            };
            let now = Instant::now();
            if now >= deadline {
                return self.fence_ran_out(place.as_ref());
            }
            until_freed(place.as_ref(), step.min(deadline - now)).await;
        }
    }

    /// A fencing wait that did not get the lock by its deadline: "not
    /// acquired", its wait kept for its connection's next `WAIT` (see
    /// [`super::storm::lines`]).
    pub(crate) fn fence_ran_out(&self, place: Option<&Place<'_>>) -> LocalReply {
        if place.is_some_and(|p| !p.ran_out()) {
            ProxyMetrics::inc(&self.storm.metrics.unkept);
        }
        LocalReply::Null
    }

    /// Whether the first in `key`'s line must let an attempt of this
    /// instance that waits on the key since before it go first (parked, or
    /// a spinner between attempts): it then does not ask the store, so a
    /// lock freed for that attempt is not taken out of its turn. Bounded:
    /// a parked attempt is served or answered within `park_ms`, a
    /// spinner's place is kept only between its attempts.
    fn fence_defers(&self, key: &[u8], place: Option<&Place<'_>>) -> bool {
        place.is_some_and(|p| self.storm.waits_since_before(key, p.since(), p.owner()))
    }

    /// Waits while the first in line defers (see
    /// [`LockService::fence_defers`]), for a release or a step at a time:
    /// `Ok` to ask the store now, `Err` with the reply once `deadline`
    /// passed meanwhile.
    pub(crate) async fn fence_turn(
        &self,
        key: &[u8],
        place: Option<&Place<'_>>,
        deadline: Instant,
    ) -> Result<(), LocalReply> {
        while self.fence_defers(key, place) {
            let now = Instant::now();
            if now >= deadline {
                return Err(self.fence_ran_out(place));
            }
            until_freed(place, WAIT_STEP.min(deadline - now)).await;
        }
        Ok(())
    }
}

/// `[token, validity]`'s validity for a grant made `started` ago with a
/// `ttl_ms` lease, as Redlock computes it; `None` when no useful time is
/// left of it.
pub(crate) fn validity(ttl_ms: u64, started: Instant) -> Option<i64> {
    let elapsed = started.elapsed().as_millis() as i64;
    let drift = (ttl_ms as f64 * CLOCK_DRIFT_FACTOR) as i64 + 2;
    Some(ttl_ms as i64 - elapsed - drift).filter(|&v| v > 0)
}

/// An error reply from Redis as the client's error.
pub(crate) fn node_error(reply: &[u8]) -> Option<LocalReply> {
    reply.first().filter(|&&c| c == b'-').map(|_| {
        LocalReply::Error(Bytes::copy_from_slice(
            reply.strip_prefix(b"-").unwrap_or(reply).trim_ascii_end(),
        ))
    })
}

impl LockService {
    /// `LOCKGATE LOCK`: tries until acquired or `wait` has passed, first
    /// come first served among this instance's callers (see
    /// [`super::storm::lines`]), in turns with other instances (the key's
    /// queue in the store).
    pub(crate) async fn fence_lock(
        &self,
        node: &OnPrimary,
        at: Waiting,
        ttl_ms: u64,
        timeout: Duration,
    ) -> LocalReply {
        let key = &at.key;
        let args = &FenceTry::new(self, &at, ttl_ms);
        let waits_long = !at.wait.is_zero();
        let try_once = move |deadline: Instant| async move {
            self.granting(ttl_ms);
            let started = Instant::now();
            let primary_at = self.primary_at();
            let instance_token = self.next_token();
            let waits = super::kinds::writer_wait(waits_long, deadline);
            let prefix = self.instance_prefix();
            let cmd = args.command(script::FENCE_LOCK, key, &instance_token, prefix, &waits);
            let facts = match node_facts(node, cmd, timeout, node_error).await {
                Ok(facts) => facts,
                Err(answer) => return Tried::Answer(answer),
            };
            let (token, pttl, yielded) = (
                facts.first().copied().unwrap_or(0),
                facts.get(1).copied().unwrap_or(0),
                facts.get(2).copied().unwrap_or(0) == 1,
            );
            if token > 0 {
                // Answered only once the replicas hold it (undone if they
                // do not in time); its validity counts the wait.
                if let Err(refused) = self
                    .fence_acknowledged(key, &instance_token, primary_at, ttl_ms)
                    .await
                {
                    self.storm.line_answered(key, None);
                    return Tried::Answer(refused);
                }
                if let Some(validity) = validity(ttl_ms, started) {
                    ProxyMetrics::inc(&self.metrics.acquired);
                    self.storm.line_answered(key, Some(ttl_ms));
                    return Tried::Answer(LocalReply::Array(vec![
                        LocalReply::Integer(token),
                        LocalReply::Integer(validity),
                    ]));
                }
                // Too slow to be useful: give it back.
                let token = Bytes::from(token.to_string());
                let _ = self.fence_unlock(node, key.clone(), token, timeout).await;
            } else {
                ProxyMetrics::inc(&self.metrics.contended);
                self.storm.line_answered(key, None);
                if yielded {
                    ProxyMetrics::inc(&self.metrics.fairness_yields);
                }
            }
            Tried::Again(next_try(Some(pttl), yielded))
        };
        self.in_line(&at, try_once).await
    }

    /// A place in `key`'s line of fencing waits; none (counted) when the
    /// line table is full: that caller waits as before lines, polling.
    pub(crate) fn fence_place(&self, key: &Bytes, caller: ConnId) -> Option<Place<'_>> {
        let place = self.storm.lines.join(key, caller);
        if place.is_none() {
            ProxyMetrics::inc(&self.storm.metrics.unlined);
        }
        place
    }

    /// `LOCKGATE UNLOCK`: 1 if this token held the lock and released it.
    pub(crate) async fn fence_unlock(
        &self,
        node: &OnPrimary,
        key: Bytes,
        token: Bytes,
        timeout: Duration,
    ) -> LocalReply {
        let reply = self
            .fence_simple(node, unlock_command(&key, &token), timeout, false)
            .await;
        // Released here: this instance's own view of the key follows at
        // once (the store wakes only the queue's head, maybe another one).
        if reply == LocalReply::Integer(1) {
            self.storm.released(&key);
        }
        reply
    }

    /// `LOCKGATE EXTEND`: 1 if this token still held the lock and it was
    /// extended; an expired lock is never brought back.
    pub(crate) async fn fence_extend(
        &self,
        node: &OnPrimary,
        key: Bytes,
        token: Bytes,
        ttl_ms: u64,
        timeout: Duration,
    ) -> LocalReply {
        self.fence_simple(node, extend_command(&key, &token, ttl_ms), timeout, true)
            .await
    }

    async fn fence_simple(
        &self,
        node: &OnPrimary,
        cmd: Bytes,
        timeout: Duration,
        extend: bool,
    ) -> LocalReply {
        match node.call(cmd, timeout).await {
            Ok(reply) => {
                if let Some(err) = node_error(&reply) {
                    return err;
                }
                let n = integers(&reply).first().copied().unwrap_or(0);
                let counter = match (extend, n) {
                    (false, 1) => &self.metrics.released,
                    (false, _) => &self.metrics.release_denied,
                    (true, 0) => &self.metrics.extend_denied,
                    (true, _) => return LocalReply::Integer(n),
                };
                ProxyMetrics::inc(counter);
                LocalReply::Integer(n)
            }
            Err(e) => LocalReply::err(format!("lockgate: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_of_a_reply() {
        assert_eq!(integers(b"*2\r\n:7\r\n:-2\r\n"), vec![7, -2]);
        assert_eq!(integers(b":1\r\n"), vec![1]);
    }
}
