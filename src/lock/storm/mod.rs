//! Retry storms. For each contended lock key lockgate keeps what it last
//! learned (held until when, when it last asked Redis) and the attempts
//! parked on it. While a key is known held, at most one attempt per
//! `probe_interval` goes to Redis; the others are answered "not acquired"
//! locally, or parked for up to `park_ms`: when the lock is released (by
//! this instance, or by another, which wakes this one on
//! `lockgate:wake:<prefix>` when this one is first in the key's queue in
//! the store, or its lease running out), lockgate acquires it for the
//! oldest parked attempt (FIFO by first attempt) and answers it
//! "acquired". Behind another instance in the store's queue, this one does
//! not probe: it waits for its wake-up, renewing its place once per
//! `scale × queue_ttl_ms / 3`, scale its rank up to 64 (see
//! [`crate::script::ACQUIRE`]).
//!
//! Answering "not acquired" early is always safe for mutual exclusion;
//! every "acquired" is a real acquisition on Redis (or the quorum).
//!
//! On one Redis, a release through this instance may carry the handoff
//! itself (`handoff`): the releasing connection's script gives the lock
//! straight to the oldest parked attempt, one round trip for both.

mod driver;
mod event;
mod handoff;
mod key;
pub mod lines;
#[cfg(test)]
mod tests;

pub use handoff::{Claim, HandedOver};

use crate::lock::keys::KeyHasher;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use dashmap::DashMap;
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

use super::lease::{ConnId, ConnLocks};
use super::ops::Shape;
use crate::config::RetryConfig;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;
use crate::sync;
use event::{Action, Event, Tally};
use key::{Key, Limits, Timing};

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
        /// Wake-ups received: this instance's place came first in a key's
        /// queue in the store when its lock was freed.
        wakeups: Counter "lock_wakeups",
            "Wake-ups received: this instance came first in a key's queue when the lock was freed";
        /// Wake-ups for keys nothing waits on here any more: the turn was
        /// passed on (the place left, the next instance woken).
        passes: Counter "lock_wakeups_passed",
            "Wake-ups passed on: nothing waited on the key here any more";
        /// Replies delayed because one connection hammered one key.
        smoothed: Counter "lock_smoothed", "Replies delayed for hammering one key";
        /// Parked attempts answered early because their connection sent
        /// more behind them (a pooled or multiplexed connection): a
        /// parked attempt never holds up another caller's command.
        hurried: Counter "lock_parks_cut",
            "Parked attempts answered at once because their connection sent more behind them";
        /// Fencing waits (`LOCKGATE LOCK … WAIT`) that found the line
        /// table full (`max_keys` keys): they poll on their own, unordered.
        unlined: Counter "lock_fence_unlined",
            "Fencing waits that found the line table full and waited unordered";
        /// Fencing waits that ran out and found the table of kept waits
        /// full (`max_keys`): their connection's next `WAIT` counts from
        /// itself.
        unkept: Counter "lock_fence_unkept",
            "Fencing waits that ran out with the table of kept waits full";
        /// Lost attempts' values a key forgot because it remembered
        /// `max_lost_values_per_key` already: a release by one goes to Redis.
        lost_values_dropped: Counter "lock_lost_values_dropped",
            "Lost attempts' values a key forgot (max_lost_values_per_key reached); a release by one goes to Redis";
    }
}

/// Whether anything waits on a key this instance was woken for
/// ([`Storm::announced`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Announced {
    /// Something is parked or keeps its place: this instance takes its
    /// turn.
    Waits,
    /// Nothing parked, but a caller tried moments ago (one that never
    /// parks): its next attempt takes the turn if it comes within this
    /// long; if none does, pass the turn on then.
    Unless(std::time::Duration),
    /// Nothing waits: pass the turn on now.
    Pass,
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
    /// Set by the driver for a probe of a lock known held with this
    /// instance's place fresh (see [`Admission::Check`]): a plain `PTTL`
    /// first, the acquisition only if the lock turns out free.
    pub check: bool,
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

/// One tracked key.
#[derive(Default)]
pub struct KeyState {
    inner: Mutex<Key>,
    wake: Notify,
}

/// The contention table.
pub struct Storm {
    table: DashMap<Bytes, Arc<KeyState>, KeyHasher>,
    config: RetryConfig,
    next_id: AtomicU64,
    /// When a search for an idle key to drop last found none: the next
    /// search waits [`EVICT_RETRY`], so a table full of busy keys costs one
    /// search per interval, not one per new key.
    evict_miss: Mutex<Option<Instant>>,
    /// Counters.
    pub metrics: StormMetrics,
    /// Hashes lost attempts' values (`lost_values`), keyed at random per
    /// process so no client can aim a collision.
    lost_hasher: std::collections::hash_map::RandomState,
    /// Fencing waits in line per key (`LOCKGATE LOCK … WAIT`), at most
    /// `max_keys` keys.
    pub lines: lines::Lines,
}

/// How long a table found full of busy keys is not searched again (see
/// `Storm::evict_miss`): keys first seen meanwhile go untracked, counted in
/// `lock_untracked`, as they would after a search that found nothing.
const EVICT_RETRY: std::time::Duration = std::time::Duration::from_millis(10);

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
    /// A probe is due on a key known held, and this instance's place in the
    /// key's queue needs no renewal: whether it is still held is all the
    /// probe can learn, and a plain `PTTL` tells (the acquisition runs
    /// only if the lock turns out free).
    Check,
}

/// What an acquisition for a parked attempt found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tried {
    /// Acquired.
    pub acquired: bool,
    /// The holder's remaining lease when not acquired, ms (0: ending
    /// now; < 0: none known, as after an error).
    pub pttl: i64,
    /// Not acquired and another instance is first in the key's queue in
    /// the store: how long (ms) to wait for the wake-up before asking
    /// again (0: not behind).
    pub behind_ms: u64,
}

impl Tried {
    /// No answer (an error, a refusal before Redis): not acquired, no
    /// holder known, so the driver backs off rather than spin.
    pub const FAILED: Tried = Tried {
        acquired: false,
        pttl: -3,
        behind_ms: 0,
    };
}

/// What the handoff driver needs from the rest of lockgate: acquire a lock
/// for a parked attempt, on the primary or the quorum.
pub trait Acquirer: Send + Sync + 'static {
    /// Acquires for `ask`.
    fn acquire(
        &self,
        ask: Ask,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Tried> + Send + '_>>;
    /// Completes when lockgate stops.
    fn stopped(&self) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>>;
}

/// One key of [`Storm::contended`].
#[derive(Debug, Clone)]
pub struct Contended {
    /// The lock key.
    pub key: Bytes,
    /// What is left of the holder's lease as last learned, ms (`None`:
    /// not known held; attempts are parked).
    pub lease_left_ms: Option<u64>,
    /// Attempts parked here.
    pub parked: usize,
    /// How long the attempt parked longest has waited since its
    /// connection first tried.
    pub oldest_wait: Option<std::time::Duration>,
}

impl Storm {
    /// A table with `config`'s limits.
    pub fn new(config: &RetryConfig) -> Storm {
        Storm {
            table: DashMap::with_hasher(KeyHasher::new()),
            config: config.clone(),
            next_id: AtomicU64::new(1),
            evict_miss: Mutex::new(None),
            metrics: StormMetrics::default(),
            lost_hasher: std::collections::hash_map::RandomState::new(),
            lines: lines::Lines::new(
                config.max_keys,
                std::time::Duration::from_millis(config.spin_window_ms),
            ),
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
        if sync::lock(&self.evict_miss).is_some_and(|at| now < at + EVICT_RETRY) {
            return false;
        }
        let idle = self.table.iter().take(64).find_map(|e| {
            let inner = sync::lock(&e.value().inner);
            inner.idle(now).then(|| e.key().clone())
        });
        match idle {
            Some(key) => {
                self.table.remove(&key);
                ProxyMetrics::inc(&self.metrics.evictions);
                true
            }
            None => {
                *sync::lock(&self.evict_miss) = Some(now);
                false
            }
        }
    }

    /// Steps `state`'s machine with `event` at `now`, then counts, wakes
    /// and answers as its actions say; returns the actions left for the
    /// caller. `None` if the key's lock is poisoned.
    fn on(&self, state: &KeyState, event: Event, now: Instant) -> Option<Vec<Action>> {
        let limits = Limits {
            max_waiters: self.config.max_waiters_per_key,
            probe_interval_ms: self.config.probe_interval_ms,
        };
        let actions = sync::lock(&state.inner).step(event, now, limits);
        let mut left = Vec::new();
        for action in actions {
            match action {
                Action::Count(tally) => ProxyMetrics::inc(match tally {
                    Tally::Absorbed => &self.metrics.absorbed,
                    Tally::Parked => &self.metrics.parked,
                    Tally::Handoff => &self.metrics.handoffs,
                    Tally::ParkTimeout => &self.metrics.park_timeouts,
                    Tally::WaiterRejected => &self.metrics.waiters_rejected,
                    Tally::Hurried => &self.metrics.hurried,
                }),
                Action::Wake => state.wake.notify_one(),
                Action::Answer {
                    id,
                    reply,
                    shape,
                    acquired,
                } => {
                    if reply.send(shaped(shape, acquired)).is_err() {
                        tracing::trace!(waiter = id, "parked attempt gone before its answer");
                    }
                }
                other => left.push(other),
            }
        }
        Some(left)
    }

    /// Steps `key`'s machine with `event` now, if the key is tracked (or,
    /// with `create`, can be).
    fn on_key(&self, key: &[u8], create: bool, event: Event) -> Option<Vec<Action>> {
        let state = self.state(key, create)?;
        self.on(&state, event, Instant::now())
    }

    /// Decides whether an attempt on `key` by connection `owner` goes to
    /// Redis.
    pub fn admit(&self, key: &[u8], probe_ms: u64, owner: ConnId) -> Admission {
        if probe_ms == 0 {
            return Admission::Probe;
        }
        let actions = self.on_key(key, true, Event::Attempt { probe_ms, owner });
        actions
            .into_iter()
            .flatten()
            .find_map(|a| match a {
                Action::Admit(admission) => Some(admission),
                _ => None,
            })
            .unwrap_or(Admission::Probe)
    }

    /// Learns the outcome of an attempt that went to Redis: held by us for
    /// `lease_ms`, or by someone else for `pttl_ms` more.
    pub fn learn(&self, key: &[u8], acquired: bool, ms: i64) {
        self.learned(key, acquired, ms, 0);
    }

    /// [`Storm::learn`], where the store also said whether another instance
    /// is first in the key's queue: `behind_ms` > 0, attempts here wait
    /// that long for the wake-up before asking again.
    pub fn learned(&self, key: &[u8], acquired: bool, ms: i64, behind_ms: u64) {
        let event = Event::Learned {
            acquired,
            ms,
            behind_ms,
        };
        self.on_key(key, true, event);
    }

    /// A failed attempt on `key` took or renewed this instance's place in
    /// the key's queue in the store for `life_ms` (0: it took none).
    pub fn placed(&self, key: &[u8], life_ms: u64) {
        if life_ms > 0 {
            self.on_key(key, false, Event::Placed { life_ms });
        }
    }

    /// Whether an attempt on `key` needs not renew this instance's place in
    /// the key's queue in the store (the probe of a held lock is then one
    /// `PTTL`): it was renewed recently, or the lock is known held through
    /// this instance (see `Key::placed_or_ours`); false for an untracked
    /// key.
    pub fn place_fresh(&self, key: &[u8]) -> bool {
        let now = Instant::now();
        self.state(key, false).is_some_and(|s| {
            let k = sync::lock(&s.inner);
            k.placed(now) || k.held(now).is_some_and(|(ours, _)| ours)
        })
    }

    /// The holder of `key` moved its lease through this instance (`EXPIRE`
    /// family): `pttl_ms` is what is left of it now (`-2`: the key is gone).
    pub fn extended(&self, key: &[u8], pttl_ms: i64) {
        self.on_key(key, false, Event::Extended { pttl_ms });
    }

    /// An attempt on `key` ended without an outcome to learn (an error, a
    /// lost quorum): later attempts go to Redis again, to see the error.
    pub fn unprobe(&self, key: &[u8]) {
        self.on_key(key, false, Event::Unprobed);
    }

    /// The connection `owner` releases `key`:
    /// it is not waiting for it any more, so the place it kept in the
    /// key's queue between two attempts goes (it would hold newcomers
    /// back for nobody).
    pub fn leave(&self, key: &[u8], owner: ConnId) {
        self.on_key(key, false, Event::Left { owner });
    }

    /// Connection `owner` sent more behind its attempt parked on `key`:
    /// it is answered "not acquired" now, its place kept (see
    /// [`super::LockService::hurry`]). Returns whether one was parked.
    pub fn hurry(&self, key: &[u8], owner: ConnId) -> bool {
        let actions = self.on_key(key, false, Event::Hurry { owner });
        actions
            .into_iter()
            .flatten()
            .any(|a| matches!(a, Action::Cut))
    }

    /// An attempt of `ask.conn_id`, a connection seen carrying several
    /// callers (which never parks), lost again on `ask.key`: its place in
    /// the key's queue, from `since` (its run's first attempt), is kept
    /// `keep` past now, so fencing waits and parked attempts that came
    /// after it let it go first (see [`Event::Spun`]). Bounded: the place
    /// lapses `keep` after the connection's last attempt.
    pub fn spun(&self, ask: Ask, since: std::time::Instant, keep: std::time::Duration) {
        let Some(state) = self.state(&ask.key, false) else {
            return;
        };
        let event = Event::Spun {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            owner: ask.conn_id,
            since,
            keep,
            ask,
        };
        self.on(&state, event, Instant::now());
    }

    /// The lock on `key` was released: wake its parked attempts, or the
    /// first fencing wait in its line when it came before all of them.
    pub fn released(&self, key: &[u8]) {
        // Served in arrival order: the release is the first fencing wait's
        // when it came before every attempt waiting here, else theirs. A
        // fencing wait woken beside the parked attempts' driver would win
        // nearly every race (tests/serial/quorum_chaos.rs: 15 `SET NX`
        // acquisitions against 429), and the driver or a spinner asking
        // beside the fencing wait would take its turn: they wait for its
        // answer ([`Storm::line_answered`]).
        if self.fence_first(key) {
            self.lines.free(key);
            self.on_key(key, false, Event::Lined);
            return;
        }
        self.on_key(key, false, Event::Released);
    }

    /// A fencing wait's attempt on `key` was answered: acquired for
    /// `Some(ms)`, or not (`None`). Attempts here that waited for its
    /// answer ([`Event::Lined`]) learn the holder, or go on asking (a "not
    /// acquired" may be older than a release meanwhile, so it teaches
    /// nothing). Only a key tracked here: a fencing wait alone adds none.
    pub fn line_answered(&self, key: &[u8], acquired_ms: Option<u64>) {
        let event = match acquired_ms {
            Some(ms) => Event::Learned {
                acquired: true,
                ms: ms as i64,
                behind_ms: 0,
            },
            None => Event::Unprobed,
        };
        if !self.table.is_empty() {
            self.on_key(key, false, event);
        }
    }

    /// Every tracked key changed behind this instance's back (a flush, a
    /// `SWAPDB` acknowledged by Redis): what it knew of each is dropped and
    /// their parked attempts are woken, as by a release of each (O(keys),
    /// at most `max_keys`, once per such command).
    pub fn forget_all(&self) {
        let now = Instant::now();
        for e in self.table.iter() {
            self.on(e.value(), Event::Released, now);
        }
    }

    /// The lock on `key` was released through this instance and given to
    /// another instance first in the store's queue: this one's attempts
    /// wait behind it (for their wake-up, or `behind_ms`).
    pub fn yielded(&self, key: &[u8], behind_ms: u64) {
        self.on_key(key, false, Event::Yielded { behind_ms });
    }

    /// A wake-up on this instance's channel (`lockgate:wake:<prefix>`):
    /// its place came first in `key`'s queue when the lock was freed, by a
    /// release through any instance. Says whether anything waits on the
    /// key here: a parked attempt or a kept place (the turn is taken), an
    /// attempt within `probe_interval_ms` but none parked (a
    /// multiplexed connection's callers spin without ever parking: their
    /// next attempt takes the turn, if it comes within that window), or
    /// nothing (the caller passes the turn on, [`crate::script::PASS`],
    /// counted).
    pub fn announced(&self, key: &[u8]) -> Announced {
        ProxyMetrics::inc(&self.metrics.wakeups);
        let now = Instant::now();
        let window = self.spin_keep();
        let found = self.state(key, false).map(|s| {
            let k = sync::lock(&s.inner);
            (!k.waiters.is_empty(), k.attempted_within(now, window))
        });
        // A fencing wait in line takes the turn (told by the release).
        let lined = !self.lines.is_empty() && self.lines.waits(key);
        self.released(key);
        if lined {
            return Announced::Waits;
        }
        match found {
            Some((true, _)) => Announced::Waits,
            Some((false, true)) => Announced::Unless(window),
            _ => {
                ProxyMetrics::inc(&self.metrics.passes);
                Announced::Pass
            }
        }
    }

    /// Whether the first fencing wait in `key`'s line came before every
    /// attempt waiting on it here (parked, or a spinner's place kept
    /// between its attempts): it goes first (a release wakes it, and hands
    /// the lock to no parked attempt). Fencing waits and other attempts
    /// are so served in the order they came, whichever command they use.
    /// Comparing with parked attempts alone let fencing waits take nearly
    /// every turn from `SET NX` spinners, which are answered between
    /// probes rather than parked (tests/serial/quorum_chaos.rs: 19 `SET
    /// NX` acquisitions against 312).
    pub(crate) fn fence_first(&self, key: &[u8]) -> bool {
        if self.lines.is_empty() {
            return false;
        }
        self.lines
            .head(key)
            .is_some_and(|(since, owner)| !self.waits_since_before(key, since, owner))
    }

    /// Whether an attempt of another connection than `own` waits on `key`
    /// here (parked, or a spinner's place kept between its attempts) since
    /// before `since`: the first fencing wait in line, on `own`, lets it go
    /// first (see [`crate::lock::LockService::fence_defers`]). Its own
    /// connection's place does not count: on a multiplexed connection that
    /// spinner's next attempt waits behind this `WAIT`, so deferring to it
    /// would only wait for the place to lapse.
    pub(crate) fn waits_since_before(
        &self,
        key: &[u8],
        since: std::time::Instant,
        own: ConnId,
    ) -> bool {
        self.state(key, false)
            .and_then(|s| sync::lock(&s.inner).oldest_waiting(Instant::now(), Some(own)))
            .is_some_and(|oldest| oldest < since)
    }

    /// Whether an attempt on `key` was answered "not acquired" from what
    /// this instance knew at or after `since`. A client's script that
    /// released the key, sent at `since` and seen only now, may have
    /// made that answer stale: its caller was told "held" of a lock
    /// already free in Redis (`LockService::complete`).
    pub fn refused_since(&self, key: &[u8], since: std::time::Instant) -> bool {
        let since = Instant::from_std(since);
        self.state(key, false).is_some_and(|s| {
            sync::lock(&s.inner)
                .view
                .refused_at
                .is_some_and(|r| r >= since)
        })
    }

    /// Whether this instance knows `key` held now (by the lease it last
    /// learned); false for an untracked key.
    pub fn known_held(&self, key: &[u8]) -> bool {
        let now = Instant::now();
        self.state(key, false)
            .is_some_and(|s| sync::lock(&s.inner).held(now).is_some())
    }

    /// After [`Announced::Unless`]: whether an attempt on `key` came
    /// within `window` (else the caller passes the turn on, counted).
    pub fn attempted_since_wakeup(&self, key: &[u8], window: std::time::Duration) -> bool {
        let came = self
            .state(key, false)
            .is_some_and(|s| sync::lock(&s.inner).attempted_within(Instant::now(), window));
        if !came {
            ProxyMetrics::inc(&self.metrics.passes);
        }
        came
    }

    /// How long an attempt counts as a caller still spinning here without
    /// parking: `probe_interval_ms` (a multiplexed connection's callers
    /// try again within microseconds; a lone try-lock must not hold the
    /// fleet's turn longer than a probe interval).
    fn spin_keep(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.config.probe_interval_ms.max(1))
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
        let event = Event::Park {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            since,
            reply: tx,
            ask,
            timing: Timing { park_ms, probe_ms },
        };
        let mut parked = true;
        for action in self.on(&state, event, Instant::now())? {
            match action {
                Action::Rejected => parked = false,
                Action::StartDriver => {
                    let (storm, state) = (self.clone(), state.clone());
                    let (key, acquirer) = (key.clone(), acquirer.clone());
                    tokio::spawn(async move { storm.drive(acquirer, key, state).await });
                }
                _ => {}
            }
        }
        parked.then_some(rx)
    }

    /// Keys this instance knows are held or has attempts parked on,
    /// matching `pattern` (a glob), at most `max`.
    pub fn contended(&self, pattern: &[u8], max: usize) -> Vec<Contended> {
        let now = Instant::now();
        let mut out = Vec::new();
        for e in self.table.iter() {
            if out.len() >= max {
                break;
            }
            if !super::keys::glob_match(pattern, e.key()) {
                continue;
            }
            let inner = sync::lock(&e.value().inner);
            let holder = inner.held(now);
            let parked = inner.parked();
            if holder.is_none() && parked == 0 {
                continue;
            }
            out.push(Contended {
                key: e.key().clone(),
                lease_left_ms: holder
                    .map(|(_, until)| until.duration_since(now).as_millis() as u64),
                parked,
                oldest_wait: inner
                    .oldest_parked()
                    .map(|since| std::time::Instant::now().saturating_duration_since(since)),
            });
        }
        out
    }

    /// The attempts parked here on `key`, in the order they will be handed
    /// the lock: each connection and when it first tried.
    pub fn parked_on(&self, key: &[u8]) -> Vec<(ConnId, std::time::Instant)> {
        self.state(key, false)
            .map(|s| sync::lock(&s.inner).parked_list())
            .unwrap_or_default()
    }

    /// This instance's wake-up channel was (re)subscribed: a wake-up sent
    /// while it was down is lost, so every key with attempts waiting here
    /// stops waiting for one and asks the store at once (O(keys), once per
    /// reconnection).
    pub fn resubscribed(&self) {
        let now = Instant::now();
        for e in self.table.iter() {
            self.on(e.value(), Event::Resubscribed, now);
        }
    }

    /// Attempts parked on `key` now.
    pub fn waiting(&self, key: &[u8]) -> usize {
        self.state(key, false)
            .map(|s| sync::lock(&s.inner).parked())
            .unwrap_or(0)
    }

    /// Whether nothing here says `key` is contended (see `Key::quiet`);
    /// an untracked key is quiet.
    pub fn quiet(&self, key: &[u8]) -> bool {
        self.state(key, false)
            .is_none_or(|state| sync::lock(&state.inner).quiet(Instant::now()))
    }

    /// An attempt with `value` on `key` lost (answered here or by Redis):
    /// remembered (hashed) for a release by that value that may follow
    /// (pottery's clean-up after a lost attempt), at most
    /// `max_lost_values_per_key` per tracked key, the oldest dropped
    /// (counted). Nothing for a key not tracked or an empty value.
    pub fn lost_value(&self, key: &[u8], value: &[u8]) {
        let most = self.config.max_lost_values_per_key;
        if value.is_empty() || most == 0 {
            return;
        }
        let Some(state) = self.state(key, false) else {
            return;
        };
        let hash = self.lost_hasher.hash_one(value);
        let mut inner = sync::lock(&state.inner);
        let lost = &mut inner.lost_values;
        if !lost.contains(&hash) {
            if lost.len() >= most {
                lost.pop_front();
                ProxyMetrics::inc(&self.metrics.lost_values_dropped);
            }
            lost.push_back(hash);
        }
    }

    /// An attempt with `value` on `key` won: a release by it is real.
    /// Called for every acquisition: nothing is hashed for a key that
    /// remembers no lost value (an uncontended one).
    pub fn won_value(&self, key: &[u8], value: &[u8]) {
        let Some(state) = self.state(key, false) else {
            return;
        };
        let mut inner = sync::lock(&state.inner);
        if !inner.lost_values.is_empty() {
            let hash = self.lost_hasher.hash_one(value);
            inner.lost_values.retain(|&h| h != hash);
        }
    }

    /// The latest attempt with `value` on `key` here lost, none with it
    /// won since, and the key is known held now (by anyone): a release by
    /// `value` would find another value there. (Two values with one 64-bit
    /// hash would be taken for each other: a 2^-64 chance per pair.)
    pub fn lost_while_held(&self, key: &[u8], value: &[u8]) -> bool {
        let Some(state) = self.state(key, false) else {
            return false;
        };
        let hash = self.lost_hasher.hash_one(value);
        let inner = sync::lock(&state.inner);
        inner.held(Instant::now()).is_some() && inner.lost_values.contains(&hash)
    }

    /// Who holds `key` as last learned: this instance, another client, or
    /// nobody known.
    pub fn holder(&self, key: &[u8]) -> Option<&'static str> {
        let state = self.state(key, false)?;
        let inner = sync::lock(&state.inner);
        inner.holder(Instant::now()).map(|(who, _)| who)
    }

    /// How long the attempt parked longest on this instance has waited
    /// since its connection first tried (zero: none is parked). O(keys
    /// tracked): for a scrape, not for the hot path.
    pub fn oldest_wait(&self) -> std::time::Duration {
        let now = std::time::Instant::now();
        (self.table.iter())
            .filter_map(|e| sync::lock(&e.value().inner).oldest_parked())
            .map(|since| now.saturating_duration_since(since))
            .max()
            .unwrap_or_default()
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
