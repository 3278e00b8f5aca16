//! The table and its driver task under `tokio::time::pause()`, with a
//! scripted in-memory acquirer (see the module above for why that is not a
//! mock of Redis).

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::super::{Acquirer, Admission, Ask, Storm, Tried};
use super::{anyone, ask, conn};
use crate::config::RetryConfig;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;

/// Answers acquisitions from a script, each after `delay`, and records
/// who asked when. An empty script answers "held for 10 s".
struct Fake {
    script: Mutex<VecDeque<(bool, i64)>>,
    calls: Mutex<Vec<(String, Instant)>>,
    delay: Duration,
    stop: CancellationToken,
}

impl Fake {
    fn new(script: &[(bool, i64)], delay_ms: u64) -> Arc<Fake> {
        Arc::new(Fake {
            script: Mutex::new(script.iter().copied().collect()),
            calls: Mutex::new(Vec::new()),
            delay: Duration::from_millis(delay_ms),
            stop: CancellationToken::new(),
        })
    }

    /// The values acquired for, in order, and when (ms after `t0`).
    fn calls(&self, t0: Instant) -> Vec<(String, u64)> {
        crate::sync::lock(&self.calls)
            .iter()
            .map(|(v, at)| (v.clone(), at.duration_since(t0).as_millis() as u64))
            .collect()
    }
}

impl Acquirer for Fake {
    fn acquire(&self, ask: Ask) -> Pin<Box<dyn Future<Output = Tried> + Send + '_>> {
        Box::pin(async move {
            let value = String::from_utf8_lossy(&ask.value).into_owned();
            crate::sync::lock(&self.calls).push((value, Instant::now()));
            tokio::time::sleep(self.delay).await;
            let (acquired, pttl) = crate::sync::lock(&self.script)
                .pop_front()
                .unwrap_or((false, 10_000));
            Tried {
                acquired,
                pttl,
                behind_ms: 0,
            }
        })
    }

    fn stopped(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(self.stop.cancelled())
    }
}

fn storm(f: impl FnOnce(&mut RetryConfig)) -> Arc<Storm> {
    let mut config = RetryConfig::default();
    f(&mut config);
    Arc::new(Storm::new(&config))
}

/// Parks a new connection's attempt on `lock:a` with `value`, first made
/// `since_ms` after `base`.
fn park(
    storm: &Arc<Storm>,
    fake: &Arc<Fake>,
    value: &str,
    since: std::time::Instant,
    park_ms: u64,
    probe_ms: u64,
) -> Option<oneshot::Receiver<LocalReply>> {
    let acquirer: Arc<dyn Acquirer> = fake.clone();
    storm.park(
        acquirer,
        ask("lock:a", value, &conn()),
        since,
        park_ms,
        probe_ms,
    )
}

async fn run_for(ms: u64) {
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

const GOT: LocalReply = LocalReply::Integer(1);
const NOT: LocalReply = LocalReply::Integer(0);

/// Three spinners parked out of order get the lock in the order of their
/// first attempts, one release at a time.
#[tokio::test(start_paused = true)]
async fn handoffs_go_oldest_first() {
    let storm = storm(|_| {});
    let fake = Fake::new(&[(true, 0), (true, 0), (true, 0)], 1);
    let t0 = Instant::now();
    let base = std::time::Instant::now();
    storm.learn(b"lock:a", false, 60_000);
    let mut c = park(
        &storm,
        &fake,
        "c",
        base + Duration::from_millis(3),
        60_000,
        0,
    )
    .expect("parked");
    let mut a = park(
        &storm,
        &fake,
        "a",
        base + Duration::from_millis(1),
        60_000,
        0,
    )
    .expect("parked");
    let mut b = park(
        &storm,
        &fake,
        "b",
        base + Duration::from_millis(2),
        60_000,
        0,
    )
    .expect("parked");
    run_for(100).await;
    assert!(
        fake.calls(t0).is_empty(),
        "held, no probe interval: nobody asks"
    );
    for (rx, rest) in [(&mut a, 2), (&mut b, 1), (&mut c, 0)] {
        storm.released(b"lock:a");
        run_for(10).await;
        assert_eq!(rx.try_recv().ok(), Some(GOT));
        assert_eq!(storm.waiting(b"lock:a"), rest);
    }
    let order: Vec<String> = fake.calls(t0).into_iter().map(|(v, _)| v).collect();
    assert_eq!(order, ["a", "b", "c"]);
    assert_eq!(ProxyMetrics::get(&storm.metrics.handoffs), 3);
}

/// A storm of attempts on a held key: one goes to Redis per probe
/// interval, the rest are absorbed and counted.
#[tokio::test(start_paused = true)]
async fn spinning_attempts_are_absorbed() {
    let storm = storm(|_| {});
    assert_eq!(storm.admit(b"lock:a", 100, anyone()), Admission::Probe);
    storm.learn(b"lock:a", false, 5_000);
    let mut probes = 1;
    for _ in 1..500 {
        run_for(1).await;
        if storm.admit(b"lock:a", 100, anyone()) == Admission::Probe {
            probes += 1;
            storm.learn(b"lock:a", false, 5_000);
        }
    }
    assert_eq!(probes, 5, "one per 100 ms over 500 ms");
    assert_eq!(ProxyMetrics::get(&storm.metrics.absorbed), 495);
}

/// While attempts are parked the driver asks Redis every probe interval,
/// also when this instance believes it holds the lock itself (it may have
/// been freed behind its back).
#[tokio::test(start_paused = true)]
async fn probes_every_interval_whatever_the_view() {
    let storm = storm(|_| {});
    let fake = Fake::new(&[], 0);
    let t0 = Instant::now();
    storm.learn(b"lock:a", true, 60_000);
    let _rx = park(&storm, &fake, "v", std::time::Instant::now(), 5_000, 100).expect("parked");
    run_for(1_050).await;
    let times: Vec<u64> = fake.calls(t0).into_iter().map(|(_, at)| at).collect();
    assert_eq!(times, (1..=10).map(|i| i * 100).collect::<Vec<_>>());
}

/// A waiter whose connection goes away while the driver acquires for it:
/// the lock it got is not passed on behind its lease; the next waiter gets
/// it when that lease runs out.
#[tokio::test(start_paused = true)]
async fn waiter_leaving_mid_handoff() {
    let storm = storm(|_| {});
    let fake = Fake::new(&[(true, 0), (true, 0)], 50);
    let t0 = Instant::now();
    let base = std::time::Instant::now();
    storm.learn(b"lock:a", false, 60_000);
    let first = park(&storm, &fake, "first", base, 60_000, 0).expect("parked");
    let mut second = park(
        &storm,
        &fake,
        "second",
        base + Duration::from_millis(1),
        60_000,
        0,
    )
    .expect("parked");
    storm.released(b"lock:a");
    run_for(10).await;
    assert_eq!(fake.calls(t0), [("first".to_string(), 0)]);
    drop(first);
    run_for(100).await;
    assert_eq!(ProxyMetrics::get(&storm.metrics.handoffs), 1);
    assert!(second.try_recv().is_err(), "not passed on");
    assert_eq!(storm.holder(b"lock:a"), Some("this instance"));
    // The lease (1 s, from 50 ms) runs out; the second is served then.
    run_for(1_000).await;
    assert_eq!(second.try_recv().ok(), Some(GOT));
    let calls = fake.calls(t0);
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[1], ("second".to_string(), 1_050));
}

/// The bounds: a full queue and a full table refuse, and count it.
#[tokio::test(start_paused = true)]
async fn bounds_are_counted() {
    let storm = storm(|c| {
        c.max_waiters_per_key = 2;
        c.max_keys = 2;
    });
    let fake = Fake::new(&[], 0);
    let base = std::time::Instant::now();
    storm.learn(b"lock:a", false, 60_000);
    let _a = park(&storm, &fake, "a", base, 60_000, 0).expect("parked");
    let _b = park(&storm, &fake, "b", base, 60_000, 0).expect("parked");
    assert!(park(&storm, &fake, "c", base, 60_000, 0).is_none());
    assert_eq!(ProxyMetrics::get(&storm.metrics.waiters_rejected), 1);
    assert_eq!(storm.waiting(b"lock:a"), 2);

    assert_eq!(storm.admit(b"lock:b", 100, anyone()), Admission::Probe);
    storm.learn(b"lock:b", false, 60_000);
    assert_eq!(storm.len(), 2);
    // Both keys busy: a third is not tracked (its attempts go to Redis).
    for _ in 0..3 {
        assert_eq!(storm.admit(b"lock:c", 100, anyone()), Admission::Probe);
    }
    assert_eq!(ProxyMetrics::get(&storm.metrics.untracked), 3);
    assert_eq!(storm.len(), 2);
    // A search in vain just before lock:b's lease ends...
    run_for(59_999).await;
    storm.admit(b"lock:d", 100, anyone());
    assert_eq!(ProxyMetrics::get(&storm.metrics.untracked), 4);
    // ...is not repeated for EVICT_RETRY, though lock:b is idle now...
    run_for(2).await;
    storm.admit(b"lock:c", 100, anyone());
    assert_eq!(ProxyMetrics::get(&storm.metrics.untracked), 5);
    assert_eq!(ProxyMetrics::get(&storm.metrics.evictions), 0);
    // ...and after it, lock:b gives its room to lock:c.
    run_for(10).await;
    storm.admit(b"lock:c", 100, anyone());
    assert_eq!(ProxyMetrics::get(&storm.metrics.evictions), 1);
    assert_eq!(storm.len(), 2);
}

/// Fairness across instances (`max_local_preference_ms`, decided by the
/// acquisition script): a yield comes back as "not acquired, no lease"
/// (PTTL −2). The driver does not spin on it: it asks again once per probe
/// interval, and the attempt stays parked until it gets the lock.
#[tokio::test(start_paused = true)]
async fn fairness_yield_waits_a_probe_interval() {
    let storm = storm(|_| {});
    let fake = Fake::new(&[(false, -2), (false, -2), (false, -2), (true, 0)], 0);
    let t0 = Instant::now();
    let mut rx = park(&storm, &fake, "v", std::time::Instant::now(), 5_000, 100).expect("parked");
    run_for(250).await;
    assert!(rx.try_recv().is_err(), "still parked after two yields");
    run_for(100).await;
    assert_eq!(rx.try_recv().ok(), Some(GOT));
    let times: Vec<u64> = fake.calls(t0).into_iter().map(|(_, at)| at).collect();
    assert_eq!(times, [0, 100, 200, 300]);
}

/// A park that ends is answered "not acquired" and keeps its place for
/// max(park, probe): a younger spinner that parks meanwhile queues behind
/// it, and the older one, back in its place, gets the lock first.
#[tokio::test(start_paused = true)]
async fn a_spinner_keeps_its_turn_between_attempts() {
    let storm = storm(|_| {});
    let fake = Fake::new(&[(true, 0), (true, 0)], 0);
    let base = std::time::Instant::now();
    storm.learn(b"lock:a", false, 60_000);
    let old = conn();
    let acquirer: Arc<dyn Acquirer> = fake.clone();
    let mut first = storm
        .park(acquirer.clone(), ask("lock:a", "old", &old), base, 200, 0)
        .expect("parked");
    run_for(201).await;
    assert_eq!(first.try_recv().ok(), Some(NOT));
    assert_eq!(ProxyMetrics::get(&storm.metrics.park_timeouts), 1);
    let mut young = park(
        &storm,
        &fake,
        "young",
        base + Duration::from_millis(201),
        5_000,
        0,
    )
    .expect("parked");
    run_for(50).await;
    let mut again = storm
        .park(acquirer, ask("lock:a", "old again", &old), base, 5_000, 0)
        .expect("parked");
    storm.released(b"lock:a");
    run_for(10).await;
    assert_eq!(again.try_recv().ok(), Some(GOT));
    assert!(young.try_recv().is_err());
}

/// Stopping lockgate answers every parked attempt "not acquired".
#[tokio::test(start_paused = true)]
async fn stop_answers_parked_attempts() {
    let storm = storm(|_| {});
    let fake = Fake::new(&[], 0);
    storm.learn(b"lock:a", false, 60_000);
    let base = std::time::Instant::now();
    let mut a = park(&storm, &fake, "a", base, 60_000, 0).expect("parked");
    let mut b = park(&storm, &fake, "b", base, 60_000, 0).expect("parked");
    fake.stop.cancel();
    run_for(1).await;
    assert_eq!(
        (a.try_recv().ok(), b.try_recv().ok()),
        (Some(NOT), Some(NOT))
    );
    assert_eq!(storm.waiting(b"lock:a"), 0);
}

/// The values of lost attempts a key remembers: a release by one is
/// answered without Redis only while the key is known held, until an
/// attempt with it wins; at most `max_lost_values_per_key`, the oldest
/// dropped;
/// nothing for a key not tracked or an empty value.
#[tokio::test]
async fn lost_values_are_remembered_while_the_key_is_held() {
    use bytes::Bytes;
    let config = RetryConfig {
        max_lost_values_per_key: 8,
        ..RetryConfig::default()
    };
    let storm = Storm::new(&config);
    let v = |s: &str| Bytes::copy_from_slice(s.as_bytes());
    // Not tracked: nothing remembered.
    storm.lost_value(b"lock:none", &v("a"));
    assert!(!storm.lost_while_held(b"lock:none", b"a"));
    assert_eq!(storm.admit(b"lock:a", 100, anyone()), Admission::Probe);
    storm.lost_value(b"lock:a", &v("a"));
    storm.lost_value(b"lock:a", &Bytes::new());
    // Not known held yet: a release may find it free or anyone's.
    assert!(!storm.lost_while_held(b"lock:a", b"a"));
    storm.learn(b"lock:a", false, 60_000);
    // (value, remembered as lost while held)
    let table: &[(&str, bool)] = &[("a", true), ("b", false), ("", false)];
    for (value, want) in table {
        assert_eq!(
            storm.lost_while_held(b"lock:a", value.as_bytes()),
            *want,
            "{value:?}"
        );
    }
    // An attempt with it won: a release by it is real.
    storm.won_value(b"lock:a", b"a");
    assert!(!storm.lost_while_held(b"lock:a", b"a"));
    // Bounded: the oldest goes first.
    for i in 0..=8 {
        storm.lost_value(b"lock:a", &v(&format!("v{i}")));
    }
    assert!(!storm.lost_while_held(b"lock:a", b"v0"));
    assert!(storm.lost_while_held(b"lock:a", b"v1"));
    assert_eq!(ProxyMetrics::get(&storm.metrics.lost_values_dropped), 1);
    // Released: the key is not known held, nothing is answered.
    storm.released(b"lock:a");
    assert!(!storm.lost_while_held(b"lock:a", b"v1"));
}
