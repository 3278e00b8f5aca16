//! The status page's memory: what lockgate did over the last minutes
//! (`admin.history_seconds`, 15 by default), one sample per
//! `admin.history_interval_ms`, in a ring of bounded size. A task reads the
//! counters at each tick ([`Totals`]); [`step`] turns two readings into
//! one [`Sample`] of rates (a pure function of the two readings and their
//! times, tested as a table); `/status.json` serves the samples, so the
//! page draws the last 15 minutes on first paint and its rates are right
//! from the start.
//!
//! Cost: one tick reads some atomics and walks the contention table once
//! (for the oldest wait), whether or not anyone looks; memory is
//! `capacity` samples of a few dozen bytes (15 min at 2 s: 450 samples,
//! about 40 KiB).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use tokio_util::sync::CancellationToken;

use crate::lock::metrics::{wait_bound_ms, WAIT_BOUNDS};
use crate::lock::quorum::MasterState;
use crate::lock::LockService;
use crate::metrics::ProxyMetrics;
use crate::sync;

/// The counters as read at one tick.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Totals {
    /// Client acquisition attempts on lock keys, ever.
    pub attempts: u64,
    /// Acquisition attempts sent to the store, ever.
    pub sent: u64,
    /// Attempts answered without the store, ever.
    pub absorbed: u64,
    /// Acquisitions, ever.
    pub acquired: u64,
    /// Client commands, ever.
    pub commands: u64,
    /// Waits per bucket, ever (see [`crate::lock::metrics::WaitBuckets`]).
    pub waits: [u64; WAIT_BOUNDS + 1],
    /// Client connections open now.
    pub connections: u64,
    /// The attempt parked longest has waited this long, ms (0: none).
    pub oldest_wait_ms: u64,
    /// Lock masters voting, sitting out, down now (all 0 without a quorum).
    pub masters: [u32; 3],
}

/// One interval of history.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sample {
    /// The end of the interval, Unix ms.
    pub at_ms: u64,
    /// Client lock attempts per second.
    pub attempts_per_sec: f64,
    /// Attempts sent to the store per second.
    pub sent_per_sec: f64,
    /// Attempts absorbed per second.
    pub absorbed_per_sec: f64,
    /// Acquisitions per second.
    pub acquired_per_sec: f64,
    /// Client commands per second (pass-through and locks).
    pub ops_per_sec: f64,
    /// The median wait of the interval's acquisitions, ms: the upper bound
    /// of its bucket (`None`: none acquired after a wait).
    pub wait_p50_ms: Option<f64>,
    /// Their 99th percentile, ms, likewise.
    pub wait_p99_ms: Option<f64>,
    /// The oldest wait at the tick, ms.
    pub oldest_wait_ms: u64,
    /// Connections open at the tick.
    pub connections: u64,
    /// Lock masters voting at the tick.
    pub masters_up: u32,
    /// Lock masters sitting out at the tick.
    pub masters_sitting_out: u32,
    /// Lock masters down at the tick.
    pub masters_down: u32,
}

/// The quantile `q` (0..1) of the waits counted in `delta` per bucket:
/// the upper bound of the bucket it falls in, ms (`None`: no wait; the
/// last bucket, unbounded, reads as twice the largest bound).
fn quantile(delta: &[u64; WAIT_BOUNDS + 1], q: f64) -> Option<f64> {
    let total: u64 = delta.iter().sum();
    if total == 0 {
        return None;
    }
    let rank = ((total as f64) * q).ceil().max(1.0) as u64;
    let mut seen = 0;
    for (i, n) in delta.iter().enumerate() {
        seen += n;
        if seen >= rank {
            return Some(wait_bound_ms(i).unwrap_or(2.0 * 2f64.powi(WAIT_BOUNDS as i32 - 1)));
        }
    }
    None
}

/// The sample of the interval from `before` (read at `t0_ms`) to `now`
/// (read at `t1_ms`). A counter that went backwards (it cannot, but a
/// reading is not trusted to be monotonic) counts as 0; an interval of 0
/// ms as 1.
pub fn step(t0_ms: u64, before: &Totals, t1_ms: u64, now: &Totals) -> Sample {
    let secs = (t1_ms.saturating_sub(t0_ms)).max(1) as f64 / 1000.0;
    let rate = |a: u64, b: u64| b.saturating_sub(a) as f64 / secs;
    let waits: [u64; WAIT_BOUNDS + 1] =
        std::array::from_fn(|i| now.waits[i].saturating_sub(before.waits[i]));
    Sample {
        at_ms: t1_ms,
        attempts_per_sec: rate(before.attempts, now.attempts),
        sent_per_sec: rate(before.sent, now.sent),
        absorbed_per_sec: rate(before.absorbed, now.absorbed),
        acquired_per_sec: rate(before.acquired, now.acquired),
        ops_per_sec: rate(before.commands, now.commands),
        wait_p50_ms: quantile(&waits, 0.5),
        wait_p99_ms: quantile(&waits, 0.99),
        oldest_wait_ms: now.oldest_wait_ms,
        connections: now.connections,
        masters_up: now.masters[0],
        masters_sitting_out: now.masters[1],
        masters_down: now.masters[2],
    }
}

/// The ring of samples and the last reading.
#[derive(Debug)]
pub struct History {
    inner: Mutex<Ring>,
    capacity: usize,
    /// Between two ticks.
    pub interval: Duration,
}

#[derive(Debug, Default)]
struct Ring {
    samples: VecDeque<Sample>,
    last: Option<(u64, Totals)>,
}

/// Now, Unix ms.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl History {
    /// A ring for `seconds` of history at one sample per `interval_ms`
    /// (validated: see `config`).
    pub fn new(seconds: u64, interval_ms: u64) -> History {
        let interval_ms = interval_ms.max(1);
        History {
            inner: Mutex::default(),
            capacity: (seconds.saturating_mul(1000) / interval_ms).max(1) as usize,
            interval: Duration::from_millis(interval_ms),
        }
    }

    /// Most samples kept.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Records the reading `now` taken at `at_ms`: a sample from the last
    /// reading (none for the first), the oldest dropped past capacity.
    pub fn record(&self, at_ms: u64, now: Totals) {
        let mut ring = sync::lock(&self.inner);
        if let Some((t0, before)) = &ring.last {
            let sample = step(*t0, before, at_ms, &now);
            if ring.samples.len() >= self.capacity {
                ring.samples.pop_front();
            }
            ring.samples.push_back(sample);
        }
        ring.last = Some((at_ms, now));
    }

    /// The samples that end after `after_ms`, oldest first.
    pub fn since(&self, after_ms: u64) -> Vec<Sample> {
        let ring = sync::lock(&self.inner);
        (ring.samples.iter())
            .filter(|s| s.at_ms > after_ms)
            .cloned()
            .collect()
    }

    /// The latest sample.
    pub fn latest(&self) -> Option<Sample> {
        sync::lock(&self.inner).samples.back().cloned()
    }
}

/// The counters now, of the lock room and the proxy.
pub fn read(locks: &LockService, metrics: &ProxyMetrics) -> Totals {
    let l = &locks.metrics;
    let mut masters = [0u32; 3];
    if let Some(q) = locks.quorum() {
        for m in &q.masters {
            let i = match m.state() {
                MasterState::Up => 0,
                MasterState::Down => 2,
                _ => 1,
            };
            masters[i] += 1;
        }
    }
    Totals {
        attempts: ProxyMetrics::get(&l.attempts),
        sent: ProxyMetrics::get(&l.attempts_sent),
        absorbed: ProxyMetrics::get(&locks.storm.metrics.absorbed),
        acquired: ProxyMetrics::get(&l.acquired),
        commands: ProxyMetrics::get(&metrics.commands_total),
        waits: l.wait_buckets.snapshot(),
        connections: ProxyMetrics::get(&metrics.connections_active),
        oldest_wait_ms: locks.storm.oldest_wait().as_millis() as u64,
        masters,
    }
}

/// Samples `read` into `history` every interval until `stop`.
pub async fn run(history: &History, read: impl Fn() -> Totals, stop: &CancellationToken) {
    history.record(unix_ms(), read());
    let mut tick = tokio::time::interval(history.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => history.record(unix_ms(), read()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn totals(attempts: u64, sent: u64, waits: &[(usize, u64)]) -> Totals {
        let mut t = Totals {
            attempts,
            sent,
            ..Totals::default()
        };
        for &(i, n) in waits {
            t.waits[i] = n;
        }
        t
    }

    #[test]
    fn a_sample_is_the_rates_between_two_readings() {
        // (t0, before, t1, now) → (attempts/s, sent/s, p50, p99)
        let table = [
            // 1000 attempts in 2 s, 10 sent: the storm absorbed.
            (
                0,
                totals(0, 0, &[]),
                2_000,
                totals(1000, 10, &[]),
                (500.0, 5.0, None, None),
            ),
            // A counter that went backwards counts as 0.
            (
                0,
                totals(50, 5, &[]),
                1_000,
                totals(40, 5, &[]),
                (0.0, 0.0, None, None),
            ),
            // 0 ms between readings counts as 1 ms.
            (
                7,
                totals(0, 0, &[]),
                7,
                totals(1, 0, &[]),
                (1000.0, 0.0, None, None),
            ),
            // 99 waits ≤ 1 ms and one ≤ 64 ms: p50 1 ms, p99 1 ms.
            (
                0,
                totals(0, 0, &[]),
                1_000,
                totals(0, 0, &[(0, 99), (6, 1)]),
                (0.0, 0.0, Some(1.0), Some(1.0)),
            ),
            // 98 and 2: p99 falls in the slow bucket.
            (
                0,
                totals(0, 0, &[]),
                1_000,
                totals(0, 0, &[(0, 98), (6, 2)]),
                (0.0, 0.0, Some(1.0), Some(64.0)),
            ),
            // Only the interval's waits count, not earlier ones.
            (
                0,
                totals(0, 0, &[(0, 1000)]),
                1_000,
                totals(0, 0, &[(0, 1000), (10, 3)]),
                (0.0, 0.0, Some(1024.0), Some(1024.0)),
            ),
            // Past the last bound: twice the largest bound.
            (
                0,
                totals(0, 0, &[]),
                1_000,
                totals(0, 0, &[(WAIT_BOUNDS, 1)]),
                (0.0, 0.0, Some(65536.0), Some(65536.0)),
            ),
        ];
        for (t0, before, t1, now, want) in table {
            let s = step(t0, &before, t1, &now);
            let got = (
                s.attempts_per_sec,
                s.sent_per_sec,
                s.wait_p50_ms,
                s.wait_p99_ms,
            );
            assert_eq!(got, want, "{t0} {before:?} → {t1} {now:?}");
            assert_eq!(s.at_ms, t1);
        }
    }

    #[test]
    fn the_ring_keeps_its_capacity_and_serves_what_is_newer() {
        let h = History::new(10, 2_000);
        assert_eq!(h.capacity(), 5);
        assert!(h.latest().is_none());
        for i in 0..=8u64 {
            h.record(i * 2_000, totals(i * 10, i, &[]));
        }
        let all = h.since(0);
        assert_eq!(all.len(), 5, "bounded");
        assert_eq!(all[0].at_ms, 8_000);
        assert_eq!(h.latest().map(|s| s.at_ms), Some(16_000));
        assert_eq!(h.since(12_000).len(), 2);
        assert!(all.iter().all(|s| s.attempts_per_sec == 5.0));
    }
}
