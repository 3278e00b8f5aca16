//! Retry storms. For each contended lock key lockgate keeps what it last
//! learned (held until when, when it last asked Redis) and the attempts
//! parked on it. While a key is known held, at most one attempt per
//! `probe_interval` goes to Redis; the others are answered "not acquired"
//! locally, or parked for up to `park_ms`: when the lock is released (by
//! this instance, announced by another on `lockgate:released`, or its lease
//! running out), lockgate acquires it for the oldest parked attempt (FIFO
//! by first attempt) and answers it "acquired".
//!
//! Answering "not acquired" early is always safe for mutual exclusion;
//! every "acquired" is a real acquisition on Redis (or the quorum).
//!
//! On one Redis, a release through this instance may carry the handoff
//! itself (`handoff`): the releasing connection's script gives the lock
//! straight to the oldest parked attempt, one round trip for both.

mod handoff;

pub use handoff::{Claim, HandedOver};

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use dashmap::DashMap;
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

use super::lease::{ConnId, ConnLocks};
use super::ops::Shape;
use crate::config::RetryConfig;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;

/// The pub/sub channel releases are announced on.
pub const RELEASED_CHANNEL: &str = "lockgate:released";

crate::metrics::counters! {
    /// Counters of the storm room.
    pub struct StormMetrics {
        /// Attempts answered without asking Redis (the key was known held).
        absorbed: Counter "lock_absorbed", "Attempts answered without asking Redis (known held)";
        /// Attempts parked to wait for a release.
        parked: Counter "lock_parked", "Attempts parked to wait for a release";
        /// Parked attempts that got the lock (handed over).
        handoffs: Counter "lock_handoffs", "Parked attempts handed the lock";
        /// Parked attempts answered "not acquired" when their park time ended.
        park_timeouts: Counter "lock_park_timeouts", "Parked attempts whose park time ended";
        /// Attempts not parked because the key's queue was full.
        waiters_rejected: Counter "lock_waiters_rejected",
            "Attempts not parked because the key's queue was full";
        /// Idle keys dropped from the table because it was full.
        evictions: Counter "lock_storm_evictions", "Contention-table keys dropped (table full)";
        /// Keys not tracked because the table was full of busy keys.
        untracked: Counter "lock_untracked",
            "Lock keys not tracked because the contention table was full of busy keys";
        /// Release announcements received.
        announcements: Counter "lock_release_announcements",
            "Releases announced by any instance";
        /// Replies delayed because one connection hammered one key.
        smoothed: Counter "lock_smoothed", "Replies delayed for hammering one key";
    }
}

/// What a parked attempt needs to be acquired on its behalf.
#[derive(Debug, Clone)]
pub struct Ask {
    /// The lock key.
    pub key: Bytes,
    /// The client's value.
    pub value: Bytes,
    /// What the client expects back.
    pub shape: Shape,
    /// The lease to acquire with, ms.
    pub lease_ms: u64,
    /// The client connection's lock records (the acquisition is its).
    pub conn: Arc<Mutex<ConnLocks>>,
    /// The client connection (its [`ConnLocks::id`]).
    pub conn_id: ConnId,
}

/// The reply for an attempt by `shape`: acquired or not.
pub fn shaped(shape: Shape, acquired: bool) -> LocalReply {
    match (shape, acquired) {
        (Shape::SetNx, true) => LocalReply::Integer(1),
        (Shape::SetNx, false) => LocalReply::Integer(0),
        (Shape::Set, true) => LocalReply::Status("OK"),
        // SET … NX GET answers the old value: none when it was free.
        _ => LocalReply::Null,
    }
}

/// A place in a key's queue: a parked attempt (with a reply channel), or,
/// after its park time ended, a place kept for the same connection's next
/// attempt for a while, so a spin loop keeps its turn between attempts.
struct Waiter {
    id: u64,
    /// The connection: one place per connection.
    owner: ConnId,
    since: std::time::Instant,
    /// Parked until (live), or the place is kept until (reserved).
    deadline: Instant,
    /// `Some` while parked.
    reply: Option<oneshot::Sender<LocalReply>>,
    ask: Ask,
}

impl Waiter {
    fn live(&self) -> bool {
        self.reply.is_some()
    }
}

#[derive(Default)]
struct KeyInner {
    held_until: Option<Instant>,
    last_probe: Option<Instant>,
    /// A client's attempt went to Redis then and is not answered yet.
    probing: Option<Instant>,
    /// The driver's last attempt failed without learning a holder (an
    /// outage, a key without lease): no new attempt before then.
    backoff_until: Option<Instant>,
    waiters: VecDeque<Waiter>,
    driving: bool,
    /// The driver is acquiring for the front attempt right now.
    busy: bool,
    /// A release carrying a handoff to this waiter (its id) is on its way,
    /// answered by then: the waiter is neither timed out nor tried for
    /// until the release's answer.
    handing: Option<(u64, Instant)>,
    /// The holder last learned acquired through this instance.
    ours: bool,
    /// Counts releases seen, so an answer that was on its way while a
    /// release arrived does not overwrite it with a stale "held".
    releases: u64,
}

/// One tracked key.
#[derive(Default)]
pub struct KeyState {
    inner: Mutex<KeyInner>,
    wake: Notify,
}

/// The contention table.
pub struct Storm {
    table: DashMap<Bytes, Arc<KeyState>>,
    config: RetryConfig,
    next_id: AtomicU64,
    /// Counters.
    pub metrics: StormMetrics,
}

impl std::fmt::Debug for Storm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Storm")
            .field("keys", &self.table.len())
            .finish()
    }
}

/// What to do with an acquisition attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Ask Redis (nothing known, or a probe is due).
    Probe,
    /// The key is known held and was probed recently: answer locally.
    Absorb,
}

/// What the handoff driver needs from the rest of lockgate: acquire a lock
/// for a parked attempt, on the primary or the quorum.
pub trait Acquirer: Send + Sync + 'static {
    /// Acquires for `ask`; returns (acquired, remaining lease of the holder
    /// in ms when not acquired).
    fn acquire(
        &self,
        ask: Ask,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = (bool, i64)> + Send + '_>>;
    /// Completes when lockgate stops.
    fn stopped(&self) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>>;
}

impl Storm {
    /// A table with `config`'s limits.
    pub fn new(config: &RetryConfig) -> Storm {
        Storm {
            table: DashMap::new(),
            config: config.clone(),
            next_id: AtomicU64::new(1),
            metrics: StormMetrics::default(),
        }
    }

    fn state(&self, key: &[u8], create: bool) -> Option<Arc<KeyState>> {
        if let Some(s) = self.table.get(key) {
            return Some(s.clone());
        }
        if !create {
            return None;
        }
        if self.table.len() >= self.config.max_keys && !self.evict_one() {
            ProxyMetrics::inc(&self.metrics.untracked);
            return None;
        }
        Some(
            self.table
                .entry(Bytes::copy_from_slice(key))
                .or_default()
                .clone(),
        )
    }

    /// Drops one idle key (no waiters, no driver, lease over).
    fn evict_one(&self) -> bool {
        let now = Instant::now();
        let idle = self.table.iter().take(64).find_map(|e| {
            let inner = e.value().inner.lock().ok()?;
            let over = inner.held_until.is_none_or(|u| u <= now);
            (inner.waiters.is_empty() && !inner.driving && over).then(|| e.key().clone())
        });
        match idle {
            Some(key) => {
                self.table.remove(&key);
                ProxyMetrics::inc(&self.metrics.evictions);
                true
            }
            None => false,
        }
    }

    /// Decides whether an attempt on `key` goes to Redis.
    pub fn admit(&self, key: &[u8], probe_ms: u64) -> Admission {
        if probe_ms == 0 {
            return Admission::Probe;
        }
        let Some(state) = self.state(key, true) else {
            return Admission::Probe;
        };
        let Ok(mut inner) = state.inner.lock() else {
            return Admission::Probe;
        };
        let now = Instant::now();
        let interval = Duration::from_millis(probe_ms);
        let held = inner.held_until.is_some_and(|u| u > now);
        let probed = inner
            .last_probe
            .is_some_and(|p| now.duration_since(p) < interval);
        // While one attempt is on its way, another cannot win: either it
        // takes the lock or the lock is held. (A storm's first wave would
        // otherwise all go to Redis before the first answer.)
        let in_flight = inner
            .probing
            .is_some_and(|p| now.duration_since(p) < interval);
        // Attempts queue behind those already waiting (FIFO; the driver
        // asks Redis on the queue's behalf), also behind a spinner between
        // two attempts, whose place is kept for at most max(park, probe):
        // only evident spinners have places (a try-lock is never parked),
        // so no lone attempt leaves a place behind it.
        if (held && probed) || in_flight || !inner.waiters.is_empty() {
            ProxyMetrics::inc(&self.metrics.absorbed);
            return Admission::Absorb;
        }
        inner.last_probe = Some(now);
        inner.probing = Some(now);
        Admission::Probe
    }

    /// Learns the outcome of an attempt that went to Redis: held by us for
    /// `lease_ms`, or by someone else for `pttl_ms` more.
    pub fn learn(&self, key: &[u8], acquired: bool, ms: i64) {
        let Some(state) = self.state(key, true) else {
            return;
        };
        let now = Instant::now();
        if let Ok(mut inner) = state.inner.lock() {
            inner.probing = None;
            // A "held" answer to a probe sent before the latest release
            // (no probe admitted since) is stale: the release wins.
            if !acquired && inner.releases > 0 && inner.last_probe.is_none() {
                return;
            }
            // A failed probe does not tell who holds it: keep what we knew
            // while that lease lasts.
            let ours_before = inner.ours && inner.held_until.is_some_and(|u| u > now);
            inner.last_probe = Some(now);
            inner.held_until = match ms {
                ms if ms > 0 => Some(now + Duration::from_millis(ms as u64)),
                // Refused by a key without lease (the incident: SETNX whose
                // EXPIRE never came): held until the next probe says
                // otherwise, so a spin loop on it is absorbed too.
                -1 if !acquired => {
                    Some(now + Duration::from_millis(self.config.probe_interval_ms.max(1)))
                }
                _ => None,
            };
            inner.ours = acquired || ours_before;
        };
        // A driver waiting for this answer goes on.
        state.wake.notify_one();
    }

    /// The holder of `key` moved its lease through this instance (`EXPIRE`
    /// family): `pttl_ms` is what is left of it now (`-2`: the key is gone).
    pub fn extended(&self, key: &[u8], pttl_ms: i64) {
        if pttl_ms == -2 {
            self.released(key);
            return;
        }
        let Some(state) = self.state(key, false) else {
            return;
        };
        if let Ok(mut inner) = state.inner.lock() {
            let now = Instant::now();
            if pttl_ms > 0 {
                inner.held_until = Some(now + Duration::from_millis(pttl_ms as u64));
            }
        }
        // A driver waiting for the old deadline looks again.
        state.wake.notify_one();
    }

    /// An attempt on `key` ended without an outcome to learn (an error, a
    /// lost quorum): later attempts go to Redis again, to see the error.
    pub fn unprobe(&self, key: &[u8]) {
        if let Some(state) = self.state(key, false) {
            if let Ok(mut inner) = state.inner.lock() {
                inner.probing = None;
            }
            state.wake.notify_one();
        }
    }

    /// The connection `owner` releases `key`:
    /// it is not waiting for it any more, so the place it kept in the
    /// key's queue between two attempts goes (it would hold newcomers
    /// back for nobody).
    pub fn leave(&self, key: &[u8], owner: ConnId) {
        if let Some(state) = self.state(key, false) {
            if let Ok(mut inner) = state.inner.lock() {
                inner.waiters.retain(|w| w.live() || w.owner != owner);
            }
        }
    }

    /// The lock on `key` was released: wake its parked attempts.
    pub fn released(&self, key: &[u8]) {
        if let Some(state) = self.state(key, false) {
            if let Ok(mut inner) = state.inner.lock() {
                inner.held_until = None;
                inner.last_probe = None;
                inner.backoff_until = None;
                inner.releases += 1;
            }
            state.wake.notify_one();
        }
    }

    /// A release announced on `lockgate:released` (maybe by another
    /// instance).
    pub fn announced(&self, key: &[u8]) {
        ProxyMetrics::inc(&self.metrics.announcements);
        self.released(key);
    }

    /// Parks an attempt that did not get the lock, first made at `since`,
    /// for `park_ms`; the reply (acquired or not) comes on the channel.
    /// `None`: not parked (the queue is full); answer at once.
    pub fn park(
        self: &Arc<Self>,
        acquirer: Arc<dyn Acquirer>,
        ask: Ask,
        since: std::time::Instant,
        park_ms: u64,
        probe_ms: u64,
    ) -> Option<oneshot::Receiver<LocalReply>> {
        let state = self.state(&ask.key, true)?;
        let (tx, rx) = oneshot::channel();
        let key = ask.key.clone();
        let owner = ask.conn_id;
        let start_driver = {
            let mut inner = state.inner.lock().ok()?;
            let deadline = Instant::now() + Duration::from_millis(park_ms);
            if let Some(place) = inner.waiters.iter_mut().find(|w| w.owner == owner) {
                // Back in its kept place. If an earlier attempt of the same
                // connection is still parked there, it is answered now.
                if let Some(earlier) = place.reply.take() {
                    ProxyMetrics::inc(&self.metrics.park_timeouts);
                    let _ = earlier.send(shaped(place.ask.shape, false));
                }
                place.reply = Some(tx);
                place.deadline = deadline;
                place.ask = ask;
            } else {
                if inner.waiters.len() >= self.config.max_waiters_per_key {
                    ProxyMetrics::inc(&self.metrics.waiters_rejected);
                    return None;
                }
                let waiter = Waiter {
                    id: self.next_id.fetch_add(1, Ordering::Relaxed),
                    owner,
                    since,
                    deadline,
                    reply: Some(tx),
                    ask,
                };
                let at = inner.waiters.partition_point(|w| w.since <= since);
                inner.waiters.insert(at, waiter);
            }
            let start = !inner.driving;
            inner.driving = true;
            start
        };
        ProxyMetrics::inc(&self.metrics.parked);
        if start_driver {
            let storm = self.clone();
            tokio::spawn(async move { storm.drive(acquirer, key, state, park_ms, probe_ms).await });
        } else {
            state.wake.notify_one();
        }
        Some(rx)
    }

    /// Hands the lock on `key` to its queued attempts, oldest first, until
    /// none is left. A parked attempt whose time ends is answered "not
    /// acquired" and keeps its place for `max(park, probe)` ms, so the
    /// lock waits for the oldest spinner's next attempt rather than going
    /// to a younger one.
    async fn drive(
        self: Arc<Self>,
        acquirer: Arc<dyn Acquirer>,
        key: Bytes,
        state: Arc<KeyState>,
        park_ms: u64,
        probe_ms: u64,
    ) {
        let keep = Duration::from_millis(park_ms.max(probe_ms).max(1));
        loop {
            let now = Instant::now();
            let (attempt, wake_at) = {
                let Ok(mut inner) = state.inner.lock() else {
                    return;
                };
                handoff::expire_claim(&mut inner, now);
                let claimed = inner.handing.map(|(id, _)| id);
                for w in inner
                    .waiters
                    .iter_mut()
                    .filter(|w| w.live() && Some(w.id) != claimed && w.deadline <= now)
                {
                    ProxyMetrics::inc(&self.metrics.park_timeouts);
                    if let Some(reply) = w.reply.take() {
                        let _ = reply.send(shaped(w.ask.shape, false));
                    }
                    w.deadline = now + keep;
                }
                inner.waiters.retain(|w| w.live() || w.deadline > now);
                if inner.waiters.is_empty() {
                    inner.driving = false;
                    return;
                }
                // A client's attempt on its way will take the lock or learn
                // who holds it: wait for its answer.
                let in_flight = inner
                    .probing
                    .filter(|p| now.duration_since(*p) < Duration::from_millis(probe_ms.max(1)));
                let free = inner.held_until.is_none_or(|u| u <= now)
                    && in_flight.is_none()
                    && inner.backoff_until.is_none_or(|b| b <= now);
                // What this instance knows is a hint: a lock held through
                // it may still be freed behind its back (deleted directly,
                // its lease shortened by another app or instance), so the
                // queue asks Redis at least once per probe interval
                // whoever holds it.
                let probe_due = probe_ms > 0
                    && inner
                        .last_probe
                        .is_none_or(|p| now.duration_since(p) >= Duration::from_millis(probe_ms));
                let front = inner
                    .waiters
                    .front()
                    .filter(|w| w.live())
                    .map(|w| (w.id, w.ask.clone()));
                let attempt = front.filter(|_| (free || probe_due) && inner.handing.is_none());
                if attempt.is_some() {
                    inner.last_probe = Some(now);
                    inner.busy = true;
                }
                let mut wake_at = inner
                    .waiters
                    .iter()
                    .map(|w| w.deadline)
                    .min()
                    .unwrap_or(now);
                if let Some(u) = inner.held_until.filter(|&u| u > now) {
                    wake_at = wake_at.min(u);
                }
                if let Some(p) = inner.last_probe.filter(|_| probe_ms > 0) {
                    wake_at = wake_at.min(p + Duration::from_millis(probe_ms));
                }
                if let Some((_, h)) = inner.handing {
                    wake_at = wake_at.min(h);
                }
                if let Some(p) = in_flight {
                    wake_at = wake_at.min(p + Duration::from_millis(probe_ms.max(1)));
                }
                if let Some(b) = inner.backoff_until.filter(|&b| b > now) {
                    wake_at = wake_at.min(b);
                }
                (attempt, wake_at.max(now + Duration::from_millis(1)))
            };
            if let Some((id, ask)) = attempt {
                let lease = ask.lease_ms;
                let releases_before = state.inner.lock().map(|i| i.releases).unwrap_or(0);
                let (acquired, pttl) = acquirer.acquire(ask).await;
                let Ok(mut inner) = state.inner.lock() else {
                    return;
                };
                let now = Instant::now();
                inner.busy = false;
                let released_meanwhile = inner.releases != releases_before;
                if acquired {
                    inner.held_until = Some(now + Duration::from_millis(lease));
                    inner.ours = true;
                    if let Some(at) = inner.waiters.iter().position(|w| w.id == id) {
                        if let Some(w) = inner.waiters.remove(at) {
                            ProxyMetrics::inc(&self.metrics.handoffs);
                            let delivered =
                                w.reply.map(|r| r.send(shaped(w.ask.shape, true)).is_ok());
                            if delivered != Some(true) {
                                // Its park ended (or it went away) while the
                                // lock was being taken for it: the lease
                                // runs out unless it releases.
                                tracing::debug!(key = %String::from_utf8_lossy(&key), "handoff to an attempt no longer waiting");
                            }
                        }
                    }
                } else if !released_meanwhile {
                    inner.held_until = (pttl > 0).then(|| now + Duration::from_millis(pttl as u64));
                    // Refused, but nobody holds it with a lease: asking
                    // again at once would only spin.
                    inner.backoff_until = (pttl <= 0)
                        .then(|| now + Duration::from_millis(probe_ms.max(park_ms).max(1)));
                }
                continue;
            }
            tokio::select! {
                _ = state.wake.notified() => {}
                _ = tokio::time::sleep_until(wake_at) => {}
                _ = acquirer.stopped() => {
                    if let Ok(mut inner) = state.inner.lock() {
                        for w in inner.waiters.drain(..) {
                            if let Some(reply) = w.reply {
                                let _ = reply.send(shaped(w.ask.shape, false));
                            }
                        }
                        inner.driving = false;
                    }
                    return;
                }
            }
        }
    }

    /// Keys this instance knows are held, matching `pattern` (a glob),
    /// at most `max`: (key, holder, remaining lease ms, parked attempts).
    pub fn held(&self, pattern: &[u8], max: usize) -> Vec<(Bytes, &'static str, u64, usize)> {
        let now = Instant::now();
        let mut out = Vec::new();
        for e in self.table.iter() {
            if out.len() >= max {
                break;
            }
            if !super::keys::glob_match(pattern, e.key()) {
                continue;
            }
            let Ok(inner) = e.value().inner.lock() else {
                continue;
            };
            if let Some(until) = inner.held_until.filter(|&u| u > now) {
                let holder = if inner.ours {
                    "this instance"
                } else {
                    "another client"
                };
                let parked = inner.waiters.iter().filter(|w| w.live()).count();
                out.push((
                    e.key().clone(),
                    holder,
                    until.duration_since(now).as_millis() as u64,
                    parked,
                ));
            }
        }
        out
    }

    /// Attempts parked on `key` now.
    pub fn waiting(&self, key: &[u8]) -> usize {
        self.state(key, false)
            .and_then(|s| {
                s.inner
                    .lock()
                    .ok()
                    .map(|i| i.waiters.iter().filter(|w| w.live()).count())
            })
            .unwrap_or(0)
    }

    /// Who holds `key` as last learned: this instance, another client, or
    /// nobody known.
    pub fn holder(&self, key: &[u8]) -> Option<&'static str> {
        let state = self.state(key, false)?;
        let inner = state.inner.lock().ok()?;
        let held = inner.held_until.is_some_and(|u| u > Instant::now());
        held.then_some(if inner.ours {
            "this instance"
        } else {
            "another client"
        })
    }

    /// Keys tracked now.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// True when no key is tracked.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }
}
