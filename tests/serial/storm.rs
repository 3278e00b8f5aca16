//! Retry storms (docs/behaviour.md, "Parking and fairness") against real
//! redis-server: legacy `SETNX` spin loops on a held lock key are absorbed
//! (at most one upstream probe per key per `probe_interval_ms`), parked up
//! to `park_ms`, and handed the lock oldest first when it is released
//! through lockgate, through another lockgate instance (which wakes the
//! instance first in the key's queue on `lockgate:wake:<prefix>`) or by
//! its lease running out. Every `:1` is checked
//! against Redis itself; upstream cost is read from `INFO commandstats`
//! (lockgate sends lock operations as `EVAL`).

use crate::support;
use crate::SERIAL;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lockgate::config::LockOverride;
use lockgate::Config;
use support::int;
use support::locks::{config, get, m, pttl, setup_with, Call};
use support::{cmd, Lockgate, RawClient, RedisServer, WAIT};
use tokio::sync::{oneshot, Barrier};
use tokio::task::JoinHandle;

/// The defaults the bounds below are written against.
const PROBE_MS: u64 = 100;
const PARK_MS: u64 = 50;

// The tests measure upstream command counts and handoff latencies on two
// shared cores; two storms at once would measure each other: each takes
// `SERIAL` (tests/serial/main.rs) first.

/// A fresh Redis, lockgate in front of it (instance `storm`, 30 s default
/// lease, `tweak` applied), and a connection straight to Redis.
async fn start(tweak: impl FnOnce(&mut Config)) -> (RedisServer, Lockgate, RawClient) {
    // The bounds in this file are written against the documented defaults.
    let retry = Config::default().locks.retry;
    assert_eq!(
        (retry.probe_interval_ms, retry.park_ms),
        (PROBE_MS, PARK_MS)
    );
    setup_with("storm", 30_000, tweak).await
}

/// Calls of `EVAL`/`EVALSHA` on Redis since the last `CONFIG RESETSTAT`:
/// every lock operation lockgate sends upstream (clients' attempts, probes
/// and handoffs) is one of them.
async fn upstream_evals(r: &mut RawClient) -> u64 {
    let info = r.call(&["INFO", "commandstats"]).await;
    ["cmdstat_eval:calls=", "cmdstat_evalsha:calls="]
        .iter()
        .map(|prefix| {
            info.lines()
                .find_map(|l| l.strip_prefix(prefix))
                .map(|rest| {
                    rest.split(',')
                        .next()
                        .and_then(|n| n.parse::<u64>().ok())
                        .unwrap_or_else(|| panic!("bad commandstats line {rest:?}"))
                })
                .unwrap_or(0)
        })
        .sum()
}

/// `CONFIG RESETSTAT` on Redis directly.
async fn reset_stats(r: &mut RawClient) {
    assert_eq!(r.call(&["CONFIG", "RESETSTAT"]).await, "+OK\r\n");
}

/// What one spin loop saw.
#[derive(Debug)]
struct Spun {
    /// `SETNX` commands sent (each answered before the next).
    attempts: u64,
    /// When its `:1` came, if it did.
    won_at: Option<Instant>,
}

/// The legacy spin loop: `SETNX key value`, the next one as soon as the
/// reply is in, no sleep, until `:1` or `stop_at`. `first` is told when the
/// loop has its place in the key's queue: once its second reply came (a
/// first attempt is answered at once, as a try-lock; the next one, moments
/// later, is a spinner's and is parked). Any reply other than `:0`/`:1`
/// fails the test.
async fn spin(
    c: &mut RawClient,
    key: &str,
    value: &str,
    stop_at: Instant,
    first: Option<oneshot::Sender<()>>,
) -> Spun {
    poll(c, key, value, stop_at, first, Duration::ZERO).await
}

/// [`spin`] with a `pause` between a `:0` and the next attempt (the
/// polling loop with a sleep of the Redis lock recipes).
async fn poll(
    c: &mut RawClient,
    key: &str,
    value: &str,
    stop_at: Instant,
    mut first: Option<oneshot::Sender<()>>,
    pause: Duration,
) -> Spun {
    let mut attempts = 0;
    while Instant::now() < stop_at {
        if attempts > 0 && !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
        let reply = c.call(&["SETNX", key, value]).await;
        attempts += 1;
        if attempts >= 2 || reply != ":0\r\n" {
            if let Some(tx) = first.take() {
                let _ = tx.send(());
            }
        }
        match reply.as_str() {
            ":1\r\n" => {
                return Spun {
                    attempts,
                    won_at: Some(Instant::now()),
                }
            }
            ":0\r\n" => {}
            other => panic!("SETNX {key} {value} through lockgate answered {other:?}"),
        }
    }
    Spun {
        attempts,
        won_at: None,
    }
}

/// Awaits a spawned task within [`WAIT`], re-raising its panic as is.
async fn join<T>(task: JoinHandle<T>, what: &str) -> T {
    match tokio::time::timeout(WAIT, task).await {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => std::panic::resume_unwind(e.into_panic()),
        Err(_) => panic!("{what} did not finish within {WAIT:?}"),
    }
}

/// `n` spin loops on `key` through `lg`, started together, each for `run`
/// (none may acquire: the key is held throughout). Returns the total
/// attempts.
async fn storm(lg: &Lockgate, key: &str, n: usize, run: Duration) -> u64 {
    Storm::ready(lg, key, n, run).await.go(None).await.0
}

/// Spin loops connected and waiting for the signal to start.
struct Storm {
    go: Arc<Barrier>,
    tasks: Vec<JoinHandle<u64>>,
}

impl Storm {
    /// `n` spin loops on `key` through `lg`, each to run for `run` once
    /// started; returns when every one is connected (its upstream
    /// connection up) and waiting.
    async fn ready(lg: &Lockgate, key: &str, n: usize, run: Duration) -> Storm {
        let ready = Arc::new(Barrier::new(n + 1));
        let go = Arc::new(Barrier::new(n + 1));
        let mut tasks = Vec::new();
        for i in 0..n {
            let (addr, key) = (lg.addr, key.to_string());
            let (ready, go) = (ready.clone(), go.clone());
            tasks.push(tokio::spawn(async move {
                let mut c = RawClient::connect(addr).await;
                assert_eq!(c.call(&["PING"]).await, "+PONG\r\n");
                ready.wait().await;
                go.wait().await;
                let stop_at = Instant::now() + run;
                let spun = spin(&mut c, &key, &format!("s{i}"), stop_at, None).await;
                assert!(
                    spun.won_at.is_none(),
                    "spinner {i} acquired {key}, which was held all along"
                );
                spun.attempts
            }));
        }
        tokio::time::timeout(WAIT, ready.wait())
            .await
            .expect("spinners connected in time");
        Storm { go, tasks }
    }

    /// Starts the loops and waits for them to end; returns the total
    /// attempts and, with `sample`, [`upstream_evals`] read on `sample.0`
    /// once `sample.1` has passed since the start (a measurement point).
    async fn go(self, sample: Option<(&mut RawClient, Duration)>) -> (u64, Option<u64>) {
        self.go.wait().await;
        let mut sampled = None;
        if let Some((r, at)) = sample {
            tokio::time::sleep(at).await;
            sampled = Some(upstream_evals(r).await);
        }
        let mut attempts = 0;
        for t in self.tasks {
            attempts += join(t, "a spinner").await;
        }
        (attempts, sampled)
    }
}

/// Ten loops (`pause` between attempts) start one after another on a held
/// key, each only once the previous one's second attempt has been answered
/// (parked and timed out: its place in the queue exists); each winner
/// holds 20 ms and releases. Checks they acquired in the order they
/// started.
async fn fifo(pause: Duration) {
    let (redis, lg, _r) = start(|_| {}).await;
    let mut holder = RawClient::connect(lg.addr).await;
    assert_eq!(holder.call(&["SETNX", "lock:f", "h"]).await, ":1\r\n");

    let order = Arc::new(Mutex::new(Vec::new()));
    let stop_at = Instant::now() + Duration::from_secs(12);
    let mut tasks = Vec::new();
    for i in 0..10usize {
        let (tx, rx) = oneshot::channel();
        let (addr, redis_addr, order) = (lg.addr, redis.addr(), order.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = RawClient::connect(addr).await;
            let mut r = RawClient::connect(redis_addr).await;
            let value = format!("c{i}");
            let spun = poll(&mut c, "lock:f", &value, stop_at, Some(tx), pause).await;
            assert!(
                spun.won_at.is_some(),
                "spinner {i} never acquired lock:f ({} attempts); order so far {:?}",
                spun.attempts,
                order.lock().unwrap()
            );
            order.lock().unwrap().push(i);
            assert_eq!(
                get(&mut r, "lock:f").await.as_deref(),
                Some(value.as_str()),
                "spinner {i} was answered :1 but Redis holds another value"
            );
            // The critical section (workload, not synchronisation).
            tokio::time::sleep(Duration::from_millis(20)).await;
            assert_eq!(c.call(&["DEL", "lock:f"]).await, ":1\r\n", "spinner {i}");
        }));
        tokio::time::timeout(WAIT, rx)
            .await
            .unwrap_or_else(|_| panic!("spinner {i} was not parked in time"))
            .expect("spinner alive");
    }
    let s = &lg.ctx.locks.storm.metrics;
    // Every spinner's second attempt was parked; all but the first were
    // absorbed (the first probed Redis, which taught lockgate the key is held).
    assert!(m(&s.parked) >= 10, "parked = {}", m(&s.parked));
    assert!(m(&s.absorbed) >= 9, "absorbed = {}", m(&s.absorbed));
    assert!(order.lock().unwrap().is_empty(), "acquired while held");

    assert_eq!(holder.call(&["DEL", "lock:f"]).await, ":1\r\n");
    for (i, t) in tasks.into_iter().enumerate() {
        join(t, &format!("spinner {i}")).await;
    }
    assert_eq!(
        *order.lock().unwrap(),
        (0..10).collect::<Vec<_>>(),
        "acquisition order ({pause:?} between attempts)"
    );
    // Each acquisition was a real one on Redis: the holder's and one per
    // spinner. Most are handoffs from the parking room; a poller whose turn
    // came while it was between attempts (its place kept) acquires with
    // its own next attempt, which goes to Redis.
    assert_eq!(m(&lg.ctx.locks.metrics.acquired), 11);
    assert!(
        (1..=10).contains(&m(&s.handoffs)),
        "handoffs = {}",
        m(&s.handoffs)
    );
}

/// 1. FIFO: ten spin loops (no sleep) start in a known order on a held
///    key; on release they acquire in that order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spinners_acquire_in_the_order_they_started() {
    let _one = SERIAL.lock().await;
    fifo(Duration::ZERO).await;
}

/// 1b. The same with 20 ms between attempts (a polling loop with a
///     sleep): at a release the oldest loop is often between two
///     attempts, and keeps its place (for max(park, probe) = 100 ms) rather
///     than losing the lock to a younger one that happens to be parked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pollers_keep_their_place_between_attempts() {
    let _one = SERIAL.lock().await;
    fifo(Duration::from_millis(20)).await;
}

/// 2. Absorption: 100 spin loops for 2 s on a held key. Upstream sees at
///    most one probe per probe interval (plus a small margin), while the
///    loops made thousands of attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_spinners_cost_redis_one_probe_per_interval() {
    let _one = SERIAL.lock().await;
    let (_redis, lg, mut r) = start(|_| {}).await;
    let mut holder = RawClient::connect(lg.addr).await;
    assert_eq!(holder.call(&["SETNX", "lock:a", "h"]).await, ":1\r\n");

    let run = Duration::from_secs(2);
    let early_at = Duration::from_millis(300);
    let spinners = Storm::ready(&lg, "lock:a", 100, run).await;
    reset_stats(&mut r).await;
    let checks = m(&lg.ctx.locks.metrics.checks);
    let (attempts, early) = spinners.go(Some((&mut r, early_at))).await;
    let early = early.expect("sampled");
    // Script calls, and the probes of the held lock sent as one plain PTTL
    // each (`lock_checks`).
    let evals = upstream_evals(&mut r).await + m(&lg.ctx.locks.metrics.checks) - checks;
    eprintln!("100 spinners, {run:?}: {attempts} attempts, {evals} EVALs or PTTL probes upstream ({early} EVALs in the first {early_at:?})");

    // 2000 ms / 100 ms = 20 probes. Margin 10: a probe or two around the
    // start (a probe due as the loops start) and after the loops stop (the
    // handoff driver keeps their places max(park, probe) ms), with room to
    // spare on two shared cores; far below one probe per spinner.
    let bound = run.as_millis() as u64 / PROBE_MS + 10;
    assert!(
        evals <= bound,
        "{evals} EVALs or probes reached Redis for {attempts} attempts in {run:?} (at most {bound}); \
         {early} EVALs in the first {early_at:?}, {} after that",
        evals - early.min(evals),
    );
    // Each attempt is parked up to 50 ms: 100 loops × 2 s / 50 ms ≈ 4000.
    assert!(attempts >= 2_000, "only {attempts} attempts");
    let s = &lg.ctx.locks.storm.metrics;
    assert!(
        m(&s.absorbed) + evals >= attempts,
        "absorbed {} + upstream {evals} < attempts {attempts}",
        m(&s.absorbed)
    );
    assert_eq!(get(&mut r, "lock:a").await.as_deref(), Some("h"));
}

/// 2b. The start of a storm, made deterministic: the holder acquired
///     through lockgate (so lockgate knows the key is held), then 50 spin
///     loops start while Redis is slow to answer (`CLIENT PAUSE 300`, as
///     under the incident's load). Their first attempts must not all go
///     upstream: over 1 s at most 1 s / probe_interval + a few probes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_starting_on_a_slow_redis_is_absorbed_too() {
    let _one = SERIAL.lock().await;
    let (_redis, lg, mut r) = start(|_| {}).await;
    let mut holder = RawClient::connect(lg.addr).await;
    assert_eq!(holder.call(&["SETNX", "lock:b", "h"]).await, ":1\r\n");
    let run = Duration::from_secs(1);
    let spinners = Storm::ready(&lg, "lock:b", 50, run).await;
    reset_stats(&mut r).await;
    assert_eq!(r.call(&["CLIENT", "PAUSE", "300", "ALL"]).await, "+OK\r\n");
    let (attempts, _) = spinners.go(None).await;
    let evals = upstream_evals(&mut r).await;
    eprintln!(
        "50 spinners on a paused Redis, {run:?}: {attempts} attempts, {evals} EVALs upstream"
    );
    let bound = run.as_millis() as u64 / PROBE_MS + 5;
    assert!(
        evals <= bound,
        "{evals} EVALs reached Redis for {attempts} attempts of 50 spin loops in {run:?} \
         (at most {bound}) on a key lockgate itself had acquired"
    );
    assert_eq!(get(&mut r, "lock:b").await.as_deref(), Some("h"));
}

/// How many of `instances` have subscribed to their wake-up channels
/// (`lockgate:wake:<instance_id>:`), PUBSUB NUMSUB on Redis directly.
async fn subscribers(r: &mut RawClient, instances: &[&str]) -> i64 {
    let mut n = 0;
    for id in instances {
        let channel = format!("lockgate:wake:{id}:");
        let reply = r.call(&["PUBSUB", "NUMSUB", &channel]).await;
        let last = reply.trim_end().rsplit("\r\n").next().unwrap_or_default();
        n += int(&format!("{last}\r\n"));
    }
    n
}

/// Two instances on one Redis; the holder acquires and releases through
/// A, a spin loop waits on B (B's `probe_ms`). Returns B and the time from
/// the release to the waiter's `:1`.
async fn handoff_across_instances(b_probe_ms: u64) -> Duration {
    let redis = RedisServer::start();
    let a = Lockgate::start_with(config(&redis.addr(), "inst-a", 30_000)).await;
    let mut cb = config(&redis.addr(), "inst-b", 30_000);
    cb.locks.retry.probe_interval_ms = b_probe_ms;
    let b = Lockgate::start_with(cb).await;
    let mut r = RawClient::connect(redis.addr()).await;
    until!(
        "both instances to subscribe to their wake-up channels",
        subscribers(&mut r, &["inst-a", "inst-b"]).await == 2
    );

    let mut holder = RawClient::connect(a.addr).await;
    assert_eq!(holder.call(&["SETNX", "lock:x", "h"]).await, ":1\r\n");
    let (tx, rx) = oneshot::channel();
    let b_addr = b.addr;
    let waiter = tokio::spawn(async move {
        let mut c = RawClient::connect(b_addr).await;
        let stop_at = Instant::now() + Duration::from_secs(10);
        spin(&mut c, "lock:x", "w", stop_at, Some(tx)).await
    });
    tokio::time::timeout(WAIT, rx)
        .await
        .expect("the waiter parked on B")
        .expect("waiter alive");
    let sb = &b.ctx.locks.storm.metrics;
    assert!(m(&sb.parked) >= 1, "the waiter was never parked on B");
    assert_eq!(m(&sb.wakeups), 0, "nothing was released yet");

    let released = Instant::now();
    assert_eq!(holder.call(&["DEL", "lock:x"]).await, ":1\r\n");
    let spun = join(waiter, "the waiter on B").await;
    let won_at = spun.won_at.expect("the waiter on B acquired lock:x");
    assert_eq!(get(&mut r, "lock:x").await.as_deref(), Some("w"));
    assert!(m(&sb.wakeups) >= 1, "B heard no release announcement");
    // The waiter got it by a handoff or by its own next attempt, which the
    // announcement let through to Redis: the callers bound how soon.
    won_at.saturating_duration_since(released)
}

/// 3. Cross-instance handoff: a release through A reaches a waiter parked
///    on B within park_ms + probe_interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_through_one_instance_hands_over_on_another() {
    let _one = SERIAL.lock().await;
    let latency = handoff_across_instances(PROBE_MS).await;
    eprintln!("handoff A → B: {latency:?}");
    // Margin 50 ms: scheduling on two shared cores.
    let bound = Duration::from_millis(PARK_MS + PROBE_MS + 50);
    assert!(
        latency <= bound,
        "handoff took {latency:?} (at most {bound:?})"
    );
}

/// 3b. The announcement is what wakes B: with a 5 s probe interval on B,
///     a probe could not find the release for seconds, yet the handoff
///     still comes within about one park time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_announcement_wakes_the_other_instance_before_its_next_probe() {
    let _one = SERIAL.lock().await;
    let latency = handoff_across_instances(5_000).await;
    eprintln!("handoff A → B (B probes every 5 s): {latency:?}");
    let bound = Duration::from_millis(PARK_MS + 100);
    assert!(
        latency <= bound,
        "handoff took {latency:?} (at most {bound:?})"
    );
}

/// A holder takes `lock:e` for 300 ms through lockgate (probe interval
/// `probe_ms`) and never releases; a spin loop waits. Returns how long
/// after the holder's `SET` the spin loop was answered `:1`, checking that
/// Redis held its value then and that the lock was handed over.
async fn lease_expiry_handoff(probe_ms: u64) -> Duration {
    let (redis, lg, mut r) = start(|c| c.locks.retry.probe_interval_ms = probe_ms).await;
    let mut holder = RawClient::connect(lg.addr).await;
    let set_at = Instant::now();
    assert_eq!(
        holder
            .call(&["SET", "lock:e", "h", "NX", "PX", "300"])
            .await,
        "+OK\r\n"
    );
    let (addr, redis_addr) = (lg.addr, redis.addr());
    let spinner = tokio::spawn(async move {
        let mut c = RawClient::connect(addr).await;
        let mut r = RawClient::connect(redis_addr).await;
        let stop_at = Instant::now() + Duration::from_secs(5);
        let spun = spin(&mut c, "lock:e", "s", stop_at, None).await;
        // Read at once: the key's value on Redis when `:1` came.
        let value = get(&mut r, "lock:e").await;
        (spun, value)
    });
    let (spun, value) = join(spinner, "the spinner").await;
    let won_at = spun.won_at.expect("the spinner acquired lock:e");
    assert_eq!(
        value.as_deref(),
        Some("s"),
        "`:1` but Redis holds {value:?}"
    );
    let after = won_at.duration_since(set_at);
    eprintln!("lease 300 ms, probe {probe_ms} ms: acquired {after:?} after SET");
    assert!(
        after >= Duration::from_millis(300),
        "acquired {after:?} after a 300 ms lease was taken"
    );
    assert!(
        pttl(&mut r, "lock:e").await > 0,
        "the handed-over lock has a lease"
    );
    let s = &lg.ctx.locks.storm.metrics;
    assert!(m(&s.handoffs) >= 1, "not handed over by the parking room");
    drop(holder);
    after
}

/// 4. Lease expiry: a holder takes the lock for 300 ms and never releases;
///    a parked spin loop gets it shortly after the lease ran out, not
///    before: when it is answered `:1`, Redis holds its value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_lease_is_handed_to_the_parked_spinner() {
    let _one = SERIAL.lock().await;
    let after = lease_expiry_handoff(PROBE_MS).await;
    // Lease end + park + probe, margin 50 ms.
    let bound = Duration::from_millis(300 + PARK_MS + PROBE_MS + 50);
    assert!(
        after <= bound,
        "acquired {after:?} after SET (at most {bound:?})"
    );
}

/// 4b. It is the known deadline that hands it over, not the next probe:
///     with a 2 s probe interval the handoff still comes right after 300 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_lease_is_handed_over_at_its_deadline_not_at_the_next_probe() {
    let _one = SERIAL.lock().await;
    let after = lease_expiry_handoff(2_000).await;
    let bound = Duration::from_millis(300 + PARK_MS + 50);
    assert!(
        after <= bound,
        "acquired {after:?} after SET (at most {bound:?})"
    );
}

/// 5a. `probe_interval_ms = 0`: every attempt reaches Redis (parking
///     stays on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_interval_zero_sends_every_attempt_upstream() {
    let _one = SERIAL.lock().await;
    let (_redis, lg, mut r) = start(|c| c.locks.retry.probe_interval_ms = 0).await;
    let mut holder = RawClient::connect(lg.addr).await;
    assert_eq!(holder.call(&["SETNX", "lock:p", "h"]).await, ":1\r\n");
    reset_stats(&mut r).await;
    let attempts = storm(&lg, "lock:p", 10, Duration::from_secs(1)).await;
    let evals = upstream_evals(&mut r).await;
    eprintln!("probe 0: {attempts} attempts, {evals} EVALs upstream");
    assert!(
        (attempts..=attempts + 2).contains(&evals),
        "{evals} EVALs upstream for {attempts} attempts"
    );
    let s = &lg.ctx.locks.storm.metrics;
    assert_eq!(m(&s.absorbed), 0);
    assert!(m(&s.parked) > 0, "parking was switched off too");
}

/// 5b. `park_ms = 0`: nothing is parked (absorption stays on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn park_zero_parks_nothing() {
    let _one = SERIAL.lock().await;
    let (_redis, lg, mut r) = start(|c| c.locks.retry.park_ms = 0).await;
    let mut holder = RawClient::connect(lg.addr).await;
    assert_eq!(holder.call(&["SETNX", "lock:q", "h"]).await, ":1\r\n");
    reset_stats(&mut r).await;
    let run = Duration::from_secs(1);
    let attempts = storm(&lg, "lock:q", 10, run).await;
    let evals = upstream_evals(&mut r).await;
    eprintln!("park 0: {attempts} attempts, {evals} EVALs upstream");
    let s = &lg.ctx.locks.storm.metrics;
    assert_eq!((m(&s.parked), m(&s.handoffs)), (0, 0));
    // Unparked loops spin at full speed.
    assert!(attempts >= 1_000, "only {attempts} attempts");
    assert!(m(&s.absorbed) > 0);
    let bound = run.as_millis() as u64 / PROBE_MS + 10;
    assert!(evals <= bound, "{evals} EVALs for {attempts} attempts");
}

/// 5c. Both switches per key pattern: `lock:np:*` parks nothing,
///     `lock:nq:*` sends every attempt upstream, other keys keep the
///     defaults.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn park_and_probe_switch_off_per_pattern() {
    let _one = SERIAL.lock().await;
    let (_redis, lg, mut r) = start(|c| {
        c.locks.overrides = vec![
            LockOverride {
                pattern: "lock:np:*".to_string(),
                park_ms: Some(0),
                ..LockOverride::default()
            },
            LockOverride {
                pattern: "lock:nq:*".to_string(),
                probe_interval_ms: Some(0),
                ..LockOverride::default()
            },
        ]
    })
    .await;
    let mut holder = RawClient::connect(lg.addr).await;
    for key in ["lock:np:k", "lock:nq:k", "lock:d:k"] {
        assert_eq!(holder.call(&["SETNX", key, "h"]).await, ":1\r\n");
    }
    let s = &lg.ctx.locks.storm.metrics;
    let run = Duration::from_millis(500);
    let bound = run.as_millis() as u64 / PROBE_MS + 10;

    reset_stats(&mut r).await;
    let (parked, absorbed) = (m(&s.parked), m(&s.absorbed));
    let attempts = storm(&lg, "lock:np:k", 5, run).await;
    let evals = upstream_evals(&mut r).await;
    eprintln!("lock:np:k: {attempts} attempts, {evals} EVALs upstream");
    assert_eq!(m(&s.parked), parked, "lock:np:* has park_ms = 0");
    assert!(m(&s.absorbed) > absorbed, "lock:np:* still absorbs");
    assert!(
        evals <= bound,
        "lock:np:k: {evals} EVALs for {attempts} attempts"
    );

    reset_stats(&mut r).await;
    let (parked, absorbed) = (m(&s.parked), m(&s.absorbed));
    let attempts = storm(&lg, "lock:nq:k", 5, run).await;
    let evals = upstream_evals(&mut r).await;
    eprintln!("lock:nq:k: {attempts} attempts, {evals} EVALs upstream");
    assert!(
        (attempts..=attempts + 2).contains(&evals),
        "lock:nq:k (probe_interval_ms = 0): {evals} EVALs for {attempts} attempts"
    );
    assert_eq!(m(&s.absorbed), absorbed, "lock:nq:* absorbs nothing");
    assert!(m(&s.parked) > parked, "lock:nq:* still parks");

    reset_stats(&mut r).await;
    let (parked, absorbed) = (m(&s.parked), m(&s.absorbed));
    let attempts = storm(&lg, "lock:d:k", 5, run).await;
    let evals = upstream_evals(&mut r).await;
    eprintln!("lock:d:k: {attempts} attempts, {evals} EVALs upstream");
    assert!(m(&s.parked) > parked, "the default key parks");
    assert!(m(&s.absorbed) > absorbed, "the default key absorbs");
    assert!(
        evals <= bound,
        "lock:d:k: {evals} EVALs for {attempts} attempts"
    );
}

/// Where the safety check reads the lock's value: the Redis stores that
/// must hold it for a `:1` to be real.
#[derive(Clone)]
struct Stores {
    addrs: Vec<String>,
}

impl Stores {
    /// How many stores hold `value` under `key` now.
    async fn holding(&self, conns: &mut [RawClient], key: &str, value: &str) -> usize {
        let mut n = 0;
        for c in conns.iter_mut() {
            if get(c, key).await.as_deref() == Some(value) {
                n += 1;
            }
        }
        n
    }
}

/// 8 clients × `rounds` acquisitions of one key through `addr`: nobody else
/// is ever inside the critical section, and at each `:1` a majority of
/// `stores` hold the client's value. Returns the acquisitions.
async fn exclusive_rounds(addr: std::net::SocketAddr, stores: Stores, rounds: usize) -> u64 {
    let inside = Arc::new(AtomicBool::new(false));
    let overlaps = Arc::new(AtomicU64::new(0));
    let stop_at = Instant::now() + Duration::from_secs(12);
    let mut tasks = Vec::new();
    for i in 0..8 {
        let (inside, overlaps, stores) = (inside.clone(), overlaps.clone(), stores.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = RawClient::connect(addr).await;
            let mut direct = Vec::new();
            for a in &stores.addrs {
                direct.push(RawClient::connect(a.as_str()).await);
            }
            let majority = stores.addrs.len() / 2 + 1;
            for n in 0..rounds {
                let value = format!("c{i}-{n}");
                let spun = spin(&mut c, "lock:s", &value, stop_at, None).await;
                assert!(
                    spun.won_at.is_some(),
                    "client {i} stuck at round {n} ({} attempts)",
                    spun.attempts
                );
                if inside.swap(true, Ordering::SeqCst) {
                    overlaps.fetch_add(1, Ordering::SeqCst);
                }
                let holding = stores.holding(&mut direct, "lock:s", &value).await;
                assert!(
                    holding >= majority,
                    "client {i} round {n}: `:1` but only {holding} of {} stores hold {value}",
                    stores.addrs.len()
                );
                inside.store(false, Ordering::SeqCst);
                assert_eq!(
                    c.call(&["DEL", "lock:s"]).await,
                    ":1\r\n",
                    "client {i} round {n}: release"
                );
            }
        }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        join(t, &format!("client {i}")).await;
    }
    assert_eq!(overlaps.load(Ordering::SeqCst), 0, "two holders at once");
    8 * rounds as u64
}

/// 6. No safety regression with parking on: 8 clients × 200 acquisitions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parking_keeps_mutual_exclusion() {
    let _one = SERIAL.lock().await;
    let (redis, lg, _r) = start(|_| {}).await;
    let stores = Stores {
        addrs: vec![redis.addr()],
    };
    let acquisitions = exclusive_rounds(lg.addr, stores, 200).await;
    // Every acquisition lockgate made was delivered to a client as `:1`.
    assert_eq!(m(&lg.ctx.locks.metrics.acquired), acquisitions);
    let s = &lg.ctx.locks.storm.metrics;
    assert!(m(&s.handoffs) > 0, "parking was not exercised");
}

/// 6b. The same under the quorum (3 masters): each `:1` is held on a
///     majority of masters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parking_keeps_mutual_exclusion_under_the_quorum() {
    let _one = SERIAL.lock().await;
    let cl = support::quorum::Cluster::start(3, |_| {}).await;
    let stores = Stores {
        addrs: cl.masters.iter().map(|s| s.addr()).collect(),
    };
    exclusive_rounds(cl.lg.addr, stores, 100).await;
    let s = &cl.lg.ctx.locks.storm.metrics;
    assert!(m(&s.handoffs) > 0, "parking was not exercised");
}

/// 200 `SETNX` on a held key in one write through lockgate with
/// `max_attempts_per_sec = rate`: all `:0`; returns how long the replies
/// took and how many of the attempts were parked.
async fn pipelined_on_a_held_key(rate: u64) -> (Duration, u64) {
    let (_redis, lg, mut r) = start(|c| c.locks.retry.max_attempts_per_sec = rate).await;
    let mut holder = RawClient::connect(lg.addr).await;
    assert_eq!(holder.call(&["SETNX", "lock:held", "h"]).await, ":1\r\n");
    let mut c = RawClient::connect(lg.addr).await;
    // Lockgate learns the key is held (this one is parked, then `:0`).
    assert_eq!(c.call(&["SETNX", "lock:held", "x"]).await, ":0\r\n");

    let s = &lg.ctx.locks.storm.metrics;
    let (parked, absorbed) = (m(&s.parked), m(&s.absorbed));
    let one = cmd(&["SETNX", "lock:held", "x"]);
    let batch: Vec<u8> = one.iter().copied().cycle().take(one.len() * 200).collect();
    let sent = Instant::now();
    c.send(&batch).await;
    for i in 0..200 {
        assert_eq!(c.reply().await, ":0\r\n", "reply {i}");
    }
    let took = sent.elapsed();
    let more = m(&s.parked) - parked;
    eprintln!("200 pipelined, max_attempts_per_sec {rate}: {took:?}, {more} parked");
    assert!(m(&s.absorbed) > absorbed, "the batch was not absorbed");
    assert_eq!(get(&mut r, "lock:held").await.as_deref(), Some("h"));
    (took, more)
}

/// 7. Pipelined attempts are not parked: 200 `SETNX` on a held key in one
///    write come back as 200 `:0` quickly. Only the last of a read (the
///    command the client waits on) may be parked; parked one by one they
///    would take 200 × 50 ms = 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_attempts_are_not_parked() {
    let _one = SERIAL.lock().await;
    // Smoothing off: only parking could delay them.
    let (took, parked) = pipelined_on_a_held_key(0).await;
    // One parked (the batch's last command); 2 allows the batch arriving
    // in two reads.
    assert!(
        parked <= 2,
        "{parked} of 200 pipelined attempts were parked"
    );
    let bound = Duration::from_millis(10 * PARK_MS);
    assert!(
        took < bound,
        "200 pipelined replies took {took:?} (at most {bound:?})"
    );

    // Defaults: smoothing paces one connection's attempts on one key to
    // max_attempts_per_sec (1000/s, so ≥ 200 ms here), still no parking.
    let (took, parked) = pipelined_on_a_held_key(1_000).await;
    assert!(
        parked <= 2,
        "{parked} of 200 pipelined attempts were parked"
    );
    let bound = Duration::from_millis(40 * PARK_MS);
    assert!(
        took < bound,
        "200 pipelined replies took {took:?} (at most {bound:?})"
    );
}

/// 7b. Attempts pipelined across reads (a client that does not wait
///     between writes, e.g. one multiplexing callers over a connection):
///     the first is the last of its read, so it is parked; the second
///     arrives while it is. Each gets its own `:0`, in order, never an
///     error. Both ways in: parked at once (`lock:m`, which lockgate knows
///     is held: it acquired it), and parked after Redis refused it
///     (`lock:m2`, held by a client of Redis itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_pipelined_across_reads_each_get_their_reply() {
    let _one = SERIAL.lock().await;
    let (_redis, lg, mut r) = start(|_| {}).await;
    let mut holder = RawClient::connect(lg.addr).await;
    assert_eq!(holder.call(&["SETNX", "lock:m", "h"]).await, ":1\r\n");
    assert_eq!(
        r.call(&["SET", "lock:m2", "h", "PX", "30000"]).await,
        "+OK\r\n"
    );
    let s = &lg.ctx.locks.storm.metrics;
    let mut seen = Vec::new();
    for key in ["lock:m", "lock:m2"] {
        let mut c = RawClient::connect(lg.addr).await;
        // A first attempt is a try-lock, answered at once; the ones right
        // after it are a spinner's.
        assert_eq!(c.call(&["SETNX", key, "a0"]).await, ":0\r\n");
        let parked = m(&s.parked);
        c.send(&cmd(&["SETNX", key, "a"])).await;
        until!(
            format!("the first attempt on {key} to be parked"),
            m(&s.parked) > parked
        );
        c.send(&cmd(&["SETNX", key, "b"])).await;
        seen.push((key, [c.reply().await, c.reply().await]));
        assert_eq!(get(&mut r, key).await.as_deref(), Some("h"));
        // The connection still works.
        assert_eq!(c.call(&["PING"]).await, "+PONG\r\n");
    }
    assert_eq!(
        seen,
        [
            ("lock:m", [":0\r\n".to_string(), ":0\r\n".to_string()]),
            ("lock:m2", [":0\r\n".to_string(), ":0\r\n".to_string()]),
        ],
        "replies to two attempts sent in two writes"
    );
}

/// 8. Transactions are untouched: inside MULTI a lock attempt on a held
///    key is queued by Redis (not absorbed or parked), and EXEC answers
///    as Redis would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_are_not_absorbed() {
    let _one = SERIAL.lock().await;
    let (_redis, lg, mut r) = start(|_| {}).await;
    let mut holder = RawClient::connect(lg.addr).await;
    assert_eq!(holder.call(&["SETNX", "lock:held", "h"]).await, ":1\r\n");
    // The key is known held and probed: an attempt outside MULTI would be
    // absorbed now.
    let mut other = RawClient::connect(lg.addr).await;
    assert_eq!(other.call(&["SETNX", "lock:held", "y"]).await, ":0\r\n");

    let s = &lg.ctx.locks.storm.metrics;
    let mut c = RawClient::connect(lg.addr).await;
    for pipelined in [false, true] {
        let (parked, absorbed) = (m(&s.parked), m(&s.absorbed));
        let commands: [&[&str]; 4] = [
            &["MULTI"],
            &["SETNX", "lock:held", "x"],
            &["EXPIRE", "lock:held", "5"],
            &["EXEC"],
        ];
        let mut replies = String::new();
        if pipelined {
            let batch: Vec<u8> = commands.iter().flat_map(|a| cmd(a)).collect();
            c.send(&batch).await;
            for _ in 0..4 {
                replies.push_str(&c.reply().await);
            }
        } else {
            for a in commands {
                replies.push_str(&c.call(a).await);
            }
        }
        assert_eq!(
            replies, "+OK\r\n+QUEUED\r\n+QUEUED\r\n*2\r\n:0\r\n:0\r\n",
            "pipelined: {pipelined}"
        );
        assert_eq!(
            (m(&s.parked), m(&s.absorbed)),
            (parked, absorbed),
            "pipelined: {pipelined}"
        );
    }
    assert_eq!(get(&mut r, "lock:held").await.as_deref(), Some("h"));
    let left = pttl(&mut r, "lock:held").await;
    assert!(left > 5_000, "the holder's lease was moved: PTTL {left}");
}
