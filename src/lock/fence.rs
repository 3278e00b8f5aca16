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

impl LockService {
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
        let Waiting { key, caller, wait } = at;
        let deadline = Instant::now() + wait;
        let place = self.fence_place(&key, caller);
        let Some(_first) = first_in_line(place.as_ref(), deadline).await else {
            ProxyMetrics::inc(&self.metrics.contended);
            return self.fence_ran_out(place.as_ref());
        };
        self.granting(ttl_ms);
        let counter = counter_key(&key);
        let (queue, places) = (super::queue_key(&key), super::places_key(&key));
        let ttl = ttl_ms.to_string();
        let (bound, life) = self.fairness_for(&key);
        let (bound, life) = (bound.to_string(), life.to_string());
        // A caller that waits holds new shared holders back while it does
        // (see `script::kinds`).
        let writers = super::kinds::writers_key(&key);
        let waiter = match wait.is_zero() {
            true => String::new(),
            false => self.waiter(caller),
        };
        loop {
            if let Err(ran_out) = self.fence_turn(&key, place.as_ref(), deadline).await {
                return ran_out;
            }
            ProxyMetrics::inc(&self.metrics.attempts);
            let started = Instant::now();
            let primary_at = self.primary_at();
            let instance_token = self.next_token();
            let waits = super::kinds::writer_wait(!wait.is_zero(), deadline);
            let cmd = super::eval_on(
                script::FENCE_LOCK,
                &key,
                &[&counter, &queue, &places, &writers],
                &[
                    ttl.as_bytes(),
                    &instance_token,
                    self.instance_prefix().as_bytes(),
                    bound.as_bytes(),
                    life.as_bytes(),
                    waits.as_bytes(),
                    waiter.as_bytes(),
                ],
            );
            let reply = match node.call(cmd, timeout).await {
                Ok(reply) => reply,
                Err(e) => return LocalReply::err(format!("lockgate: {e}")),
            };
            if let Some(err) = node_error(&reply) {
                return err;
            }
            let facts = integers(&reply);
            let (token, pttl, yielded) = (
                facts.first().copied().unwrap_or(0),
                facts.get(1).copied().unwrap_or(0),
                facts.get(2).copied().unwrap_or(0) == 1,
            );
            if token > 0 {
                // Answered only once the replicas hold it (undone if they
                // do not in time); its validity counts the wait.
                if let Err(refused) = self
                    .fence_acknowledged(&key, &instance_token, primary_at, ttl_ms)
                    .await
                {
                    self.storm.line_answered(&key, None);
                    return refused;
                }
                if let Some(validity) = validity(ttl_ms, started) {
                    ProxyMetrics::inc(&self.metrics.acquired);
                    self.storm.line_answered(&key, Some(ttl_ms));
                    return LocalReply::Array(vec![
                        LocalReply::Integer(token),
                        LocalReply::Integer(validity),
                    ]);
                }
                // Too slow to be useful: give it back.
                let _ = self
                    .fence_unlock(node, key.clone(), Bytes::from(token.to_string()), timeout)
                    .await;
            } else {
                ProxyMetrics::inc(&self.metrics.contended);
                self.storm.line_answered(&key, None);
                if yielded {
                    ProxyMetrics::inc(&self.metrics.fairness_yields);
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return self.fence_ran_out(place.as_ref());
            }
            // Yielded on a free lock: the head's turn, not a lease to wait out.
            let step = match yielded {
                true => WAIT_STEP,
                false => WAIT_STEP.min(Duration::from_millis(pttl.max(1) as u64)),
            };
            until_freed(place.as_ref(), step.min(deadline - now)).await;
        }
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
