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

use std::borrow::Cow;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use bytes::Bytes;

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

/// Buckets of the wait-time histogram: bucket 0 holds 0 ms, bucket `i` in
/// `1..=14` holds `[2^(i-1), 2^i - 1]` ms, bucket 15 holds 16384 ms and more.
const WAIT_BUCKETS: usize = 16;

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
    /// Attempts per second since the key was admitted: `attempts` divided
    /// by the seconds since `first_seen`, with at least one second.
    pub rate_per_sec: f64,
    /// When the key was admitted to the sketch.
    pub first_seen: Instant,
    /// When the last event on the key was recorded.
    pub last_seen: Instant,
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
                index: HashMap::with_capacity(capacity),
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

/// The sketch behind the mutex.
#[derive(Debug)]
struct Inner {
    /// The tracked keys; never longer than the capacity.
    slots: Vec<Slot>,
    /// Key → position in `slots`.
    index: HashMap<Bytes, usize>,
    /// Once the sketch is full: a count no slot is below (the minimum at
    /// the last scan; counts only grow, and a replaced slot gets more).
    min_count: u64,
    /// Slots that had `min_count` at the last scan. One whose count has
    /// grown since is stale and skipped; the others are true minima.
    min_slots: Vec<usize>,
    /// Counted events on all keys.
    total: u64,
}

impl Inner {
    fn record(&mut self, key: &[u8], event: Event, now: Instant, capacity: usize) {
        let counts = event.counts();
        if counts {
            self.total = self.total.saturating_add(1);
        }
        let i = match self.index.get(key) {
            Some(&i) => i,
            None if !counts => return,
            None => self.admit(key, now, capacity),
        };
        if let Some(slot) = self.slots.get_mut(i) {
            slot.apply(event, now);
        }
    }

    /// Gives `key` a slot: a free one, or the minimum's, whose count it
    /// inherits as its error. Returns the slot's position.
    fn admit(&mut self, key: &[u8], now: Instant, capacity: usize) -> usize {
        let key = Bytes::copy_from_slice(key);
        if self.slots.len() < capacity {
            let i = self.slots.len();
            self.slots.push(Slot::new(key.clone(), 0, now));
            self.index.insert(key, i);
            return i;
        }
        let i = self.min_slot();
        if let Some(slot) = self.slots.get_mut(i) {
            let inherited = slot.count;
            let old = std::mem::replace(slot, Slot::new(key.clone(), inherited, now));
            self.index.remove(&old.key);
            self.index.insert(key, i);
        }
        i
    }

    /// The position of a slot with the smallest count (the sketch is full).
    fn min_slot(&mut self) -> usize {
        for _ in 0..2 {
            while let Some(i) = self.min_slots.pop() {
                if self.slots.get(i).is_some_and(|s| s.count == self.min_count) {
                    return i;
                }
            }
            self.min_count = self.slots.iter().map(|s| s.count).min().unwrap_or(0);
            let min = self.min_count;
            self.min_slots.extend(
                self.slots
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.count == min)
                    .map(|(i, _)| i),
            );
        }
        // Unreachable: a scan of a non-empty sketch finds its minimum.
        0
    }
}

/// One tracked key.
#[derive(Debug, Clone)]
struct Slot {
    key: Bytes,
    count: u64,
    error: u64,
    attempts: u64,
    acquired: u64,
    absorbed: u64,
    parked: u64,
    hold_ms_last: Option<u64>,
    waits: WaitHistogram,
    first_seen: Instant,
    last_seen: Instant,
}

impl Slot {
    /// A slot for `key` that inherits `inherited` from the key it replaces.
    fn new(key: Bytes, inherited: u64, now: Instant) -> Slot {
        Slot {
            key,
            count: inherited,
            error: inherited,
            attempts: 0,
            acquired: 0,
            absorbed: 0,
            parked: 0,
            hold_ms_last: None,
            waits: WaitHistogram::default(),
            first_seen: now,
            last_seen: now,
        }
    }

    fn apply(&mut self, event: Event, now: Instant) {
        self.last_seen = now;
        match event {
            Event::Attempt => {
                self.count = self.count.saturating_add(1);
                self.attempts = self.attempts.saturating_add(1);
            }
            Event::Absorbed => {
                self.count = self.count.saturating_add(1);
                self.attempts = self.attempts.saturating_add(1);
                self.absorbed = self.absorbed.saturating_add(1);
            }
            Event::Acquired => self.acquired = self.acquired.saturating_add(1),
            Event::Parked => self.parked = self.parked.saturating_add(1),
            Event::Released { held_ms } => self.hold_ms_last = Some(held_ms),
            Event::Waited { wait_ms } => self.waits.add(wait_ms),
        }
    }

    fn report(self, now: Instant) -> HotKey {
        let secs = now.duration_since(self.first_seen).as_secs_f64().max(1.0);
        HotKey {
            rate_per_sec: self.attempts as f64 / secs,
            wait_p99_ms: self.waits.quantile(99),
            key: self.key,
            count: self.count,
            error: self.error,
            attempts: self.attempts,
            acquired: self.acquired,
            absorbed: self.absorbed,
            parked: self.parked,
            hold_ms_last: self.hold_ms_last,
            first_seen: self.first_seen,
            last_seen: self.last_seen,
        }
    }
}

/// Wait times in 16 log2 buckets (see [`WAIT_BUCKETS`]) plus the longest:
/// 72 bytes, enough for a p99 within a factor of two.
#[derive(Debug, Clone, Default)]
struct WaitHistogram {
    buckets: [u32; WAIT_BUCKETS],
    max_ms: u64,
}

impl WaitHistogram {
    fn bucket(ms: u64) -> usize {
        let bits = (u64::BITS - ms.leading_zeros()) as usize;
        bits.min(WAIT_BUCKETS - 1)
    }

    /// The largest wait in bucket `i`, in ms.
    fn upper(i: usize) -> u64 {
        if i + 1 >= WAIT_BUCKETS {
            u64::MAX
        } else {
            (1u64 << i) - 1
        }
    }

    fn add(&mut self, ms: u64) {
        self.max_ms = self.max_ms.max(ms);
        let i = Self::bucket(ms);
        if self.buckets[i] == u32::MAX {
            // Halve everything rather than saturate, so the shape (and the
            // quantiles) survive.
            for b in &mut self.buckets {
                *b /= 2;
            }
        }
        self.buckets[i] += 1;
    }

    /// The `pct`-th percentile (nearest rank) as the upper bound of its
    /// bucket, capped by the longest wait seen; `None` when empty.
    fn quantile(&self, pct: u64) -> Option<u64> {
        let total: u64 = self.buckets.iter().map(|&b| u64::from(b)).sum();
        if total == 0 {
            return None;
        }
        let rank = (total * pct).div_ceil(100).max(1);
        let mut seen = 0u64;
        for (i, &b) in self.buckets.iter().enumerate() {
            seen += u64::from(b);
            if seen >= rank {
                return Some(Self::upper(i).min(self.max_ms));
            }
        }
        Some(self.max_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    const HOT: [&[u8]; 3] = [b"lock:hot:a", b"lock:hot:b", b"lock:hot:c"];

    /// 100k one-off keys with the 3 hot keys' 2,000 attempts each spread
    /// evenly among them. Checks the bound after every record.
    fn storm(hk: &HotKeys) -> Duration {
        let start = Instant::now();
        for i in 0..100_000u32 {
            hk.record(format!("lock:cold:{i}").as_bytes(), Event::Attempt);
            if i % 50 == 0 {
                for h in HOT {
                    hk.record(h, Event::Attempt);
                }
            }
            assert!(hk.len() <= hk.capacity());
        }
        start.elapsed()
    }

    #[test]
    fn capacity_is_ten_per_k_with_a_floor() {
        assert_eq!(HotKeys::new(0).capacity(), 64);
        assert_eq!(HotKeys::new(3).capacity(), 64);
        assert_eq!(HotKeys::new(20).capacity(), 200);
        assert_eq!(HotKeys::new(usize::MAX).capacity(), MAX_CAPACITY);
    }

    #[test]
    fn three_hot_keys_among_100k_cold_ones_come_first() {
        for k in [3, 20] {
            let hk = HotKeys::new(k);
            let took = storm(&hk);
            eprintln!(
                "k={k} capacity={}: 106,000 records in {took:?} ({:.0} ns each, \
                 incl. formatting the key and the len check)",
                hk.capacity(),
                took.as_nanos() as f64 / 106_000.0
            );
            assert_eq!(hk.len(), hk.capacity());
            assert_eq!(hk.total(), 106_000);
            let top = hk.top(3);
            let mut keys: Vec<&[u8]> = top.iter().map(|h| &h.key[..]).collect();
            keys.sort();
            assert_eq!(keys, HOT.to_vec(), "top(3) = {top:?}");
            let bound = hk.total() / hk.capacity() as u64;
            for h in &top {
                // Space-Saving: count - error <= true count <= count.
                assert!(h.count >= 2_000, "{h:?}");
                assert!(h.count - h.error <= 2_000, "{h:?}");
                assert!(h.error <= bound, "{h:?}");
                assert!(h.attempts <= 2_000);
            }
            // Sorted by count, and the cold keys trail the hot ones.
            let all = hk.top(usize::MAX);
            assert_eq!(all.len(), hk.capacity());
            assert!(all.windows(2).all(|w| w[0].count >= w[1].count));
            assert!(all[3..].iter().all(|h| h.count <= bound + 1));
            assert!(all.iter().all(|h| h.error <= bound));
        }
    }

    #[test]
    fn exact_below_capacity_and_ties_by_key() {
        let hk = HotKeys::new(1);
        assert!(hk.is_empty());
        assert!(hk.top(5).is_empty());
        for _ in 0..5 {
            hk.record(b"b", Event::Attempt);
            hk.record(b"a", Event::Absorbed);
        }
        hk.record(b"c", Event::Attempt);
        hk.record(b"a", Event::Acquired);
        hk.record(b"a", Event::Parked);
        hk.record(b"a", Event::Released { held_ms: 42 });
        // Events that carry no hotness do not admit a key.
        hk.record(b"zzz", Event::Acquired);
        hk.record(b"zzz", Event::Waited { wait_ms: 3 });
        assert_eq!(hk.len(), 3);
        let top = hk.top(2);
        assert_eq!(top.len(), 2);
        assert_eq!(&top[0].key[..], b"a");
        assert_eq!(&top[1].key[..], b"b");
        let a = &top[0];
        assert_eq!((a.count, a.error, a.attempts), (5, 0, 5));
        assert_eq!((a.absorbed, a.acquired, a.parked), (5, 1, 1));
        assert_eq!(a.hold_ms_last, Some(42));
        assert_eq!(a.wait_p99_ms, None);
        // Fewer than a second since first seen: divided by one second.
        assert!((a.rate_per_sec - 5.0).abs() < 1e-9);
        assert_eq!(top[1].absorbed, 0);
        assert_eq!(top[1].hold_ms_last, None);
        assert_eq!(hk.top(0).len(), 0);
        assert_eq!(hk.top(10).len(), 3);
    }

    #[test]
    fn replacement_inherits_the_minimum_as_error() {
        let hk = HotKeys::new(0);
        for i in 0..64u32 {
            for _ in 0..=i {
                hk.record(format!("k{i:02}").as_bytes(), Event::Attempt);
            }
        }
        // k00 has the minimum (1): the newcomer takes its slot with error 1.
        hk.record(b"new", Event::Attempt);
        assert_eq!(hk.len(), 64);
        let all = hk.top(64);
        assert!(all.iter().all(|h| &h.key[..] != b"k00"));
        let new = all.iter().find(|h| &h.key[..] == b"new");
        let new = new.map(|h| (h.count, h.error, h.attempts));
        assert_eq!(new, Some((2, 1, 1)));
        // Next the newcomer ties with k01 at 2; one of them goes.
        hk.record(b"newer", Event::Attempt);
        let all = hk.top(64);
        let gone = [&b"new"[..], b"k01"]
            .iter()
            .filter(|k| !all.iter().any(|h| &h.key[..] == **k))
            .count();
        assert_eq!(gone, 1);
        let newer = all.iter().find(|h| &h.key[..] == b"newer");
        assert_eq!(newer.map(|h| (h.count, h.error)), Some((3, 2)));
    }

    #[test]
    fn wait_p99_is_close_for_known_distributions() {
        let hk = HotKeys::new(1);
        hk.record(b"uniform", Event::Attempt);
        hk.record(b"tail", Event::Attempt);
        hk.record(b"mostly_fast", Event::Attempt);
        hk.record(b"huge", Event::Attempt);
        // Uniform 0..=999 ms: true p99 (nearest rank) is 989.
        for ms in 0..1_000 {
            hk.record(b"uniform", Event::Waited { wait_ms: ms });
        }
        // 98% at 5 ms, 2% at 300 ms: p99 is 300.
        for i in 0..1_000 {
            let wait_ms = if i % 50 == 0 || i % 50 == 1 { 300 } else { 5 };
            hk.record(b"tail", Event::Waited { wait_ms });
        }
        // 99.5% at 5 ms: p99 is 5 (bucket 4..=7).
        for i in 0..1_000 {
            let wait_ms = if i % 200 == 0 { 300 } else { 5 };
            hk.record(b"mostly_fast", Event::Waited { wait_ms });
        }
        // Beyond the last bucket: capped by the longest wait.
        for _ in 0..10 {
            hk.record(b"huge", Event::Waited { wait_ms: 60_000 });
        }
        let p99 = |key: &[u8]| {
            hk.top(10)
                .into_iter()
                .find(|h| &h.key[..] == key)
                .and_then(|h| h.wait_p99_ms)
        };
        let uniform = p99(b"uniform").unwrap_or(0);
        assert!((989..=2 * 989).contains(&uniform), "{uniform}");
        assert_eq!(p99(b"tail"), Some(300));
        assert_eq!(p99(b"mostly_fast"), Some(7));
        assert_eq!(p99(b"huge"), Some(60_000));
    }

    #[test]
    fn histogram_buckets_and_halving() {
        assert_eq!(WaitHistogram::bucket(0), 0);
        assert_eq!(WaitHistogram::bucket(1), 1);
        assert_eq!(WaitHistogram::bucket(3), 2);
        assert_eq!(WaitHistogram::bucket(4), 3);
        assert_eq!(WaitHistogram::bucket(16_383), 14);
        assert_eq!(WaitHistogram::bucket(16_384), 15);
        assert_eq!(WaitHistogram::bucket(u64::MAX), 15);
        for i in 1..WAIT_BUCKETS - 1 {
            assert_eq!(WaitHistogram::bucket(WaitHistogram::upper(i)), i);
            assert_eq!(WaitHistogram::bucket(WaitHistogram::upper(i) + 1), i + 1);
        }
        let mut h = WaitHistogram::default();
        h.buckets[3] = u32::MAX;
        h.buckets[9] = 1_000;
        h.add(5);
        assert_eq!(h.buckets[3], u32::MAX / 2 + 1);
        assert_eq!(h.buckets[9], 500);
    }

    #[test]
    fn long_keys_are_shortened_and_stay_distinct() {
        let hk = HotKeys::new(1);
        let a = vec![b'x'; 10_000];
        let mut b = a.clone();
        b[9_999] = b'y';
        hk.record(&a, Event::Attempt);
        hk.record(&a, Event::Attempt);
        hk.record(&b, Event::Attempt);
        let exact = vec![b'z'; MAX_KEY_BYTES];
        hk.record(&exact, Event::Attempt);
        let top = hk.top(3);
        assert_eq!(top.len(), 3);
        assert_eq!(top[0].count, 2);
        assert!(top.iter().all(|h| h.key.len() == MAX_KEY_BYTES));
        assert_ne!(top[0].key, top[1].key);
        assert!(top[0].key.starts_with(&a[..MAX_KEY_BYTES - 20]));
        assert!(top.iter().any(|h| h.key[..] == exact[..]));
    }

    #[test]
    fn four_threads_share_one_sketch() {
        let hk = Arc::new(HotKeys::new(5));
        let threads: Vec<_> = (0..4u32)
            .map(|t| {
                let hk = Arc::clone(&hk);
                std::thread::spawn(move || {
                    for i in 0..25_000u32 {
                        hk.record(format!("lock:{t}:{i}").as_bytes(), Event::Attempt);
                        if i % 25 == 0 {
                            hk.record(b"lock:shared", Event::Absorbed);
                            hk.record(b"lock:shared", Event::Waited { wait_ms: 10 });
                        }
                        if i % 1_000 == 0 {
                            assert!(hk.len() <= hk.capacity());
                            assert!(hk.top(5).len() <= 5);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            assert!(t.join().is_ok());
        }
        assert_eq!(hk.total(), 4 * 25_000 + 4 * 1_000);
        assert!(hk.len() <= hk.capacity());
        let top = hk.top(1);
        assert_eq!(top.len(), 1);
        let h = &top[0];
        assert_eq!(&h.key[..], b"lock:shared");
        assert!(h.count - h.error <= 4_000 && 4_000 <= h.count, "{h:?}");
        assert_eq!(h.wait_p99_ms, Some(10));
    }

    #[test]
    fn shareable_between_tasks() {
        fn is_send_sync<T: Send + Sync>() {}
        is_send_sync::<HotKeys>();
    }
}
