//! The sketch behind [`super::HotKeys`]'s mutex: the slots, the index of keys to
//! slots, the Space-Saving replacement of the minimum, and each slot's
//! counters and wait histogram. Nothing here locks; [`super::HotKeys`] does.

use crate::lock::keys::KeyHasher;
use std::collections::HashMap;
use std::time::Instant;

use bytes::Bytes;

use super::{Event, HotKey, Spread, WAIT_BUCKETS};

/// The sketch behind the mutex.
#[derive(Debug)]
pub(super) struct Inner {
    /// The tracked keys; never longer than the capacity.
    pub(super) slots: Vec<Slot>,
    /// Key → position in `slots`.
    pub(super) index: HashMap<Bytes, usize, KeyHasher>,
    /// Once the sketch is full: a count no slot is below (the minimum at
    /// the last scan; counts only grow, and a replaced slot gets more).
    pub(super) min_count: u64,
    /// Slots that had `min_count` at the last scan. One whose count has
    /// grown since is stale and skipped; the others are true minima.
    pub(super) min_slots: Vec<usize>,
    /// Counted events on all keys.
    pub(super) total: u64,
}

impl Inner {
    pub(super) fn record(&mut self, key: &[u8], event: Event, now: Instant, capacity: usize) {
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
pub(super) struct Slot {
    pub(super) key: Bytes,
    pub(super) count: u64,
    error: u64,
    attempts: u64,
    acquired: u64,
    absorbed: u64,
    parked: u64,
    hold_ms_last: Option<u64>,
    waits: MsHistogram,
    holds: MsHistogram,
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
            waits: MsHistogram::default(),
            holds: MsHistogram::default(),
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
            Event::Released { held_ms } => {
                self.hold_ms_last = Some(held_ms);
                self.holds.add(held_ms);
            }
            Event::Waited { wait_ms } => self.waits.add(wait_ms),
        }
    }

    pub(super) fn report(self, now: Instant) -> HotKey {
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
            waits: self.waits.spread(),
            holds: self.holds.spread(),
            first_seen: self.first_seen,
            last_seen: self.last_seen,
        }
    }
}

/// Times (waits, holds) in 16 log2 buckets of whole milliseconds (see
/// [`WAIT_BUCKETS`]), their sum and the longest: 80 bytes, enough for a
/// p99 within a factor of two.
#[derive(Debug, Clone, Default)]
pub(super) struct MsHistogram {
    pub(super) buckets: [u32; WAIT_BUCKETS],
    sum_ms: u64,
    max_ms: u64,
}

impl MsHistogram {
    pub(super) fn bucket(ms: u64) -> usize {
        let bits = (u64::BITS - ms.leading_zeros()) as usize;
        bits.min(WAIT_BUCKETS - 1)
    }

    /// The largest wait in bucket `i`, in ms.
    pub(super) fn upper(i: usize) -> u64 {
        if i + 1 >= WAIT_BUCKETS {
            u64::MAX
        } else {
            (1u64 << i) - 1
        }
    }

    pub(super) fn add(&mut self, ms: u64) {
        self.max_ms = self.max_ms.max(ms);
        let i = Self::bucket(ms);
        if self.buckets[i] == u32::MAX {
            // Halve everything rather than saturate, so the shape (and the
            // quantiles) survive; a scraper sees it as a counter reset.
            for b in &mut self.buckets {
                *b /= 2;
            }
            self.sum_ms /= 2;
        }
        self.sum_ms = self.sum_ms.saturating_add(ms);
        self.buckets[i] += 1;
    }

    /// What `/metrics` shows of it.
    fn spread(&self) -> Spread {
        Spread {
            buckets: self.buckets.map(u64::from),
            sum_ms: self.sum_ms,
        }
    }

    /// The `pct`-th percentile (nearest rank) as the upper bound of its
    /// bucket, capped by the longest wait seen; `None` when empty.
    pub(super) fn quantile(&self, pct: u64) -> Option<u64> {
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
