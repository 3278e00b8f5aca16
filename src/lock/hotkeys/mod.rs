//! The hottest lock keys, with bounded memory: a Space-Saving heavy-hitter
//! sketch (Metwally, Agrawal, El Abbadi, "Efficient Computation of Frequent
//! and Top-k Elements in Data Streams", ICDT 2005).
//!
//! Operators need the top-K lock keys by attempts however many distinct
//! keys appear: a service that locks `order:<id>` can touch millions of
//! keys a day, and one Prometheus series per key would sink both lockgate's
//! memory and the Prometheus server. The sketch keeps at most
//! [`HotKeys::capacity`] keys. When an untracked key arrives and the sketch
//! is full, the key with the smallest count is replaced, and the newcomer
//! inherits that count (plus one) as an overestimate, with the inherited
//! part recorded as its `error`. For `N` counted events and `m` slots this
//! guarantees, for every tracked key:
//!
//! - `count - error <= true count <= count`;
//! - `error <= N / m`;
//! - every key whose true count exceeds `N / m` is tracked.
//!
//! Next to the Space-Saving count each tracked key carries plain counters
//! (attempts, acquired, absorbed, parked), its last hold time and a
//! 16-bucket log2 histogram of its wait times. Those are exact since the
//! key was last admitted to the sketch, so they are lower bounds of the
//! lifetime totals (a key that was replaced and came back starts again).
//!
//! Memory is bounded by the capacity: the slot vector and the index are
//! allocated once at their full size, each slot is about 200 bytes plus its
//! key, and keys longer than [`MAX_KEY_BYTES`] are stored shortened (see
//! there), so a client sending huge keys cannot grow the sketch either.
//!
//! One `std::sync::Mutex` guards the sketch. It is never held across an
//! `.await` (no method here is async) and the critical sections are short:
//! a hash lookup and a few additions for [`HotKeys::record`]; an O(capacity)
//! selection without allocation for [`HotKeys::top`].

use crate::lock::keys::KeyHasher;
use std::borrow::Cow;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use bytes::Bytes;

mod sketch;
#[cfg(test)]
mod tests;

use sketch::{Inner, Slot};

/// Keys longer than this many bytes are stored as their first
/// `MAX_KEY_BYTES - 20` bytes, then `...#` and 16 hex digits of a 64-bit
/// hash of the whole key, exactly `MAX_KEY_BYTES` bytes in all. Distinct
/// long keys stay distinct (up to a hash collision) and the label stays
/// readable, while no key can make a slot bigger than this. Lock keys are
/// short in practice; this is a guard against misuse, not a common path.
pub const MAX_KEY_BYTES: usize = 256;

/// The fewest slots a sketch has, whatever K is (see [`HotKeys::new`]).
pub const MIN_CAPACITY: usize = 64;

/// Slots per reported key (see [`HotKeys::new`]).
pub const SLOTS_PER_K: usize = 10;

/// The most slots a sketch has, whatever K is: 65,536 slots are about
/// 13 MB with 200-byte keys, and a K above 6,553 makes no sense for a
/// status page or for Prometheus label cardinality anyway.
pub const MAX_CAPACITY: usize = 1 << 16;

/// Buckets of the wait- and hold-time histograms: bucket 0 holds 0 ms, bucket `i` in
/// `1..=14` holds `[2^(i-1), 2^i - 1]` ms, bucket 15 holds 16384 ms and more.
pub const WAIT_BUCKETS: usize = 16;

/// Something that happened on a lock key, as reported to [`HotKeys::record`].
///
/// Hotness (the Space-Saving count) is the number of acquisition attempts:
/// [`Event::Attempt`] and [`Event::Absorbed`] count one each, every other
/// event counts zero. Record exactly one of the two per client attempt (an
/// attempt either went to Redis or was absorbed), as lockgate's own
/// `lock_attempts` counter counts both kinds once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// An acquisition attempt (SETNX, SET NX) that went to Redis or the
    /// quorum. Counts toward hotness.
    Attempt,
    /// An attempt that acquired the lock (directly or by a handoff to a
    /// parked attempt). Does not count toward hotness: its attempt did.
    Acquired,
    /// An attempt answered locally because the key was known held (the
    /// storm room absorbed it). Counts toward hotness and as an attempt.
    Absorbed,
    /// An attempt parked to wait for the key's release. Does not count
    /// toward hotness: its attempt did.
    Parked,
    /// The holder released the key after holding it `held_ms` milliseconds.
    Released {
        /// How long the lock was held, in milliseconds.
        held_ms: u64,
    },
    /// An attempt waited `wait_ms` milliseconds before it got its answer
    /// (parked until a handoff or a timeout).
    Waited {
        /// How long the attempt waited, in milliseconds.
        wait_ms: u64,
    },
}

impl Event {
    /// Whether the event counts toward hotness (the Space-Saving count).
    fn counts(self) -> bool {
        matches!(self, Event::Attempt | Event::Absorbed)
    }
}

/// One tracked key as reported by [`HotKeys::top`].
#[derive(Debug, Clone, PartialEq)]
pub struct HotKey {
    /// The lock key (shortened if longer than [`MAX_KEY_BYTES`]).
    pub key: Bytes,
    /// Space-Saving estimate of the key's attempts: never below the true
    /// count, and at most `error` above it.
    pub count: u64,
    /// How much of `count` may be someone else's: the count the key
    /// inherited when it replaced another. `count - error` is a lower bound
    /// of the true count.
    pub error: u64,
    /// Attempts (Attempt and Absorbed events) since the key was admitted.
    pub attempts: u64,
    /// Attempts that acquired, since the key was admitted.
    pub acquired: u64,
    /// Attempts answered locally (absorbed), since the key was admitted.
    pub absorbed: u64,
    /// Attempts parked to wait for a release, since the key was admitted.
    pub parked: u64,
    /// How long the last release held the lock, in milliseconds; `None`
    /// until a release was seen.
    pub hold_ms_last: Option<u64>,
    /// The 99th percentile of wait times in milliseconds, from a log2
    /// histogram: an upper bound at most about twice the true value (and
    /// never above the longest wait seen); `None` until a wait was seen.
    pub wait_p99_ms: Option<u64>,
    /// Its waits to acquire since it was admitted (what `wait_p99_ms` is
    /// read from): `/metrics`' `lock_key_wait_seconds{key}`.
    pub waits: Spread,
    /// How long it was held, each release since it was admitted:
    /// `/metrics`' `lock_key_hold_seconds{key}`.
    pub holds: Spread,
    /// Attempts per second since the key was admitted: `attempts` divided
    /// by the seconds since `first_seen`, with at least one second.
    pub rate_per_sec: f64,
    /// When the key was admitted to the sketch.
    pub first_seen: Instant,
    /// When the last event on the key was recorded.
    pub last_seen: Instant,
}

/// One hot key's times (its waits, or its holds) as a histogram:
/// [`WAIT_BUCKETS`] log2 buckets of whole milliseconds, `buckets[i]`
/// counting those of `i` significant bits (under 1 ms, 1 ms, 2–3 ms, 4–7
/// ms… the last one everything from 16.384 s up), and their sum.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Spread {
    /// How many times fell in each bucket (not cumulative).
    pub buckets: [u64; WAIT_BUCKETS],
    /// Their sum, in whole milliseconds.
    pub sum_ms: u64,
}

impl Spread {
    /// How many times in all.
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// Each bucket's upper bound in seconds with its own count, as a
    /// Prometheus histogram lists them: a time of `ms` whole milliseconds
    /// is under `2^i` ms in bucket `i`, the last one unbounded
    /// (`f64::MAX`, encoded `+Inf`).
    pub fn bounds(&self) -> Vec<(f64, u64)> {
        let last = WAIT_BUCKETS - 1;
        (self.buckets.iter().enumerate())
            .map(|(i, &n)| match i {
                i if i == last => (f64::MAX, n),
                i => ((1u64 << i) as f64 / 1000.0, n),
            })
            .collect()
    }
}

/// The top-K hottest lock keys in bounded memory: a Space-Saving sketch
/// (see the module documentation) safe to share between tasks and threads.
#[derive(Debug)]
pub struct HotKeys {
    capacity: usize,
    inner: Mutex<Inner>,
}

impl HotKeys {
    /// A sketch meant to report the `k` hottest keys, with
    /// `max(10 * k, 64)` slots (at most [`MAX_CAPACITY`]). Both the slot
    /// vector and the index are allocated at that size here, once.
    ///
    /// Why ten slots per reported key: Space-Saving overestimates a count
    /// by at most `N / m` for `N` attempts and `m` slots, and only keys
    /// above `N / m` are sure to be kept. With `m = 10 k` a key must carry
    /// about a tenth of an average top-K key's share to be certain of its
    /// place, and the counts of the reported K are precise enough to order
    /// them under the skewed (Zipf-like) traffic of lock keys. Why at least
    /// 64: with a small K (1 to 6) the floor gives room to ride out bursts
    /// of one-off keys without dropping a warm key between two of its
    /// attempts. 64 slots cost about 16 KB, so the floor is free.
    pub fn new(k: usize) -> HotKeys {
        let capacity = k
            .saturating_mul(SLOTS_PER_K)
            .clamp(MIN_CAPACITY, MAX_CAPACITY);
        HotKeys {
            capacity,
            inner: Mutex::new(Inner {
                slots: Vec::with_capacity(capacity),
                index: HashMap::with_capacity_and_hasher(capacity, KeyHasher::new()),
                min_count: 0,
                min_slots: Vec::with_capacity(capacity),
                total: 0,
            }),
        }
    }

    /// Records `event` on `key`.
    ///
    /// An attempt on an untracked key admits it, replacing the key with the
    /// smallest count when the sketch is full. Other events on an untracked
    /// key are dropped: they carry no hotness, and letting them admit a key
    /// would evict one for nothing.
    ///
    /// Cost: a hash lookup; on admission into a full sketch, the minimum is
    /// taken from a list of minimal slots refreshed by an O(capacity) scan
    /// only when it runs out, so the scan is amortized over many
    /// replacements when many cold keys arrive (the common case).
    pub fn record(&self, key: &[u8], event: Event) {
        let now = Instant::now();
        let key = stored_key(key);
        self.lock().record(&key, event, now, self.capacity);
    }

    /// The `n` keys with the highest counts, highest first (ties by key,
    /// bytewise ascending). At most [`HotKeys::len`] keys.
    pub fn top(&self, n: usize) -> Vec<HotKey> {
        if n == 0 {
            return Vec::new();
        }
        let mut order: Vec<usize> = Vec::with_capacity(self.capacity);
        let mut picked: Vec<Slot> = {
            let inner = self.lock();
            let slots = &inner.slots;
            order.extend(0..slots.len());
            let by_heat = |a: &usize, b: &usize| hotter(&slots[*a], &slots[*b]);
            if n < order.len() {
                order.select_nth_unstable_by(n - 1, by_heat);
                order.truncate(n);
            }
            order.iter().map(|&i| slots[i].clone()).collect()
        };
        picked.sort_unstable_by(hotter);
        let now = Instant::now();
        picked.into_iter().map(|s| s.report(now)).collect()
    }

    /// How many keys are tracked now (at most [`HotKeys::capacity`]).
    pub fn len(&self) -> usize {
        self.lock().slots.len()
    }

    /// Whether no key is tracked yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most keys the sketch tracks: `max(10 * k, 64)`, at most
    /// [`MAX_CAPACITY`].
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Attempts recorded (Attempt and Absorbed events) on all keys, tracked
    /// or not: the `N` of the bound `error <= N / capacity`.
    pub fn total(&self) -> u64 {
        self.lock().total
    }

    /// The sketch, even if a thread panicked while holding the lock: the
    /// sketch's invariants hold between any two statements that could
    /// panic, and losing the hot-key view would help no one.
    fn lock(&self) -> MutexGuard<'_, Inner> {
        crate::sync::lock(&self.inner)
    }
}

/// Orders slots hottest first: count descending, then key ascending.
fn hotter(a: &Slot, b: &Slot) -> std::cmp::Ordering {
    b.count.cmp(&a.count).then_with(|| a.key.cmp(&b.key))
}

/// `key` as stored: itself, or shortened as [`MAX_KEY_BYTES`] describes.
fn stored_key(key: &[u8]) -> Cow<'_, [u8]> {
    if key.len() <= MAX_KEY_BYTES {
        return Cow::Borrowed(key);
    }
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut hasher);
    let mut short = Vec::with_capacity(MAX_KEY_BYTES);
    short.extend_from_slice(&key[..MAX_KEY_BYTES - 20]);
    short.extend_from_slice(format!("...#{:016x}", hasher.finish()).as_bytes());
    Cow::Owned(short)
}
