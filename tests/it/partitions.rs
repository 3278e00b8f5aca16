//! Partitions around one lockgate, through a relay (`tests/support/relay.rs`):
//! cut from its clients while they hold locks (release on disconnect when
//! the path closes; the watchdog's bound when it only goes silent).
//! What each promises: docs/faults.md, "Partitions".

use crate::support;

use std::time::{Duration, Instant};

use lockgate::config::LockOverride;
use lockgate::Config;
use support::recorder::Recorder;
use support::relay::{Mode, Relay};
use support::{Lockgate, RawClient, RedisServer};

fn config(primary: &str) -> Config {
    let mut c = Config::default();
    c.upstream.addr = primary.to_string();
    c.upstream.connect_timeout_ms = 500;
    c.upstream.reconnect_interval_ms = 50;
    c.proxy.shutdown_grace_ms = 300;
    c
}

/// Tries `SET key v NX` through `c` until it is granted (recorded in
/// `rec`); how long it took.
async fn take(
    rec: &mut Recorder,
    c: &mut RawClient,
    key: &str,
    v: &str,
    within: Duration,
) -> Duration {
    let start = Instant::now();
    loop {
        if rec.call(c, &["SET", key, v, "NX"]).await == "+OK\r\n" {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < within,
            "{key} not granted within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A holder whose path to lockgate is cut (both sides see the close) has
/// its lock released at once (`release_on_disconnect`); one whose path goes
/// silent (nothing closes, as in a partition) keeps it only while the
/// watchdog may renew it (`max_hold_ms`), then the lease runs out; when the
/// path heals, the old holder's late release takes nothing from the new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lockgate_cut_from_its_clients_frees_or_bounds_their_locks() {
    let redis = RedisServer::start();
    let mut c = config(&redis.addr());
    c.locks.overrides = vec![LockOverride {
        pattern: "lock:eph:*".to_string(),
        lease_ms: 600,
        watchdog: true,
        max_hold_ms: 1_500,
        release_on_disconnect: true,
        ..LockOverride::default()
    }];
    let lg = Lockgate::start_with(c).await;
    let mut rival = RawClient::connect(lg.addr).await;
    // Every lock command recorded and judged by the checker at the end.
    let mut rec = Recorder::new(Duration::from_secs(8));
    let (mut rec_a, mut rec_b) = (rec.for_client(1), rec.for_client(2));
    let lease = Duration::from_millis(600);

    // Cut: the close reaches lockgate, which releases at once.
    let cut = Relay::start(lg.addr).await;
    let mut a = RawClient::connect(cut.addr).await;
    let took = rec_a.call(&mut a, &["SET", "lock:eph:1", "a", "NX"]).await;
    assert_eq!(took, "+OK\r\n");
    rec_a.leased("lock:eph:1", lease);
    assert_eq!(
        rec.call(&mut rival, &["SET", "lock:eph:1", "r", "NX"])
            .await,
        "$-1\r\n"
    );
    cut.set(Mode::Cut);
    // The holder's section ends with its connection (release on
    // disconnect), as far as it can know.
    rec_a.ended("lock:eph:1");
    let freed = take(
        &mut rec,
        &mut rival,
        "lock:eph:1",
        "r",
        Duration::from_secs(5),
    )
    .await;
    println!("cut holder: lock free {freed:?} after the cut");
    assert!(
        freed < Duration::from_secs(2),
        "release on disconnect took {freed:?}"
    );

    // Silent: lockgate sees nothing; the watchdog renews until max_hold_ms.
    let silent = Relay::start(lg.addr).await;
    let mut b = RawClient::connect(silent.addr).await;
    let took = rec_b.call(&mut b, &["SET", "lock:eph:2", "b", "NX"]).await;
    assert_eq!(took, "+OK\r\n");
    // What the holder may rely on: the lease (the watchdog's renewals are
    // lockgate's, bounded below).
    rec_b.leased("lock:eph:2", lease);
    let held_at = Instant::now();
    silent.set(Mode::Blackhole);
    let freed = take(
        &mut rec,
        &mut rival,
        "lock:eph:2",
        "r",
        Duration::from_secs(8),
    )
    .await;
    let since = held_at.elapsed();
    println!("silent holder: lock free {since:?} after it was taken");
    assert!(
        since >= Duration::from_millis(1_200),
        "the watchdog kept the lock alive past its lease ({since:?}, took {freed:?})"
    );
    assert!(
        since < Duration::from_millis(1_500 + 600 + 2_000),
        "bounded by max_hold_ms + lease: {since:?}"
    );
    // Healed: the old holder's late release takes nothing.
    silent.heal();
    assert_eq!(rec_b.call(&mut b, &["DEL", "lock:eph:2"]).await, ":0\r\n");
    rec.merge(rec_a);
    rec.merge(rec_b);
    rec.judge("a lockgate cut from its clients", 4);
    let mut direct = RawClient::connect(redis.addr()).await;
    assert_eq!(
        support::locks::get(&mut direct, "lock:eph:2")
            .await
            .as_deref(),
        Some("r")
    );
    lg.stop().await;
}

/// lockgate ↔ primary blackholed (accepted, never answered): lockgate's own
/// calls (a fencing lock) fail within their timeout with an error that says
/// so, and once the path heals the same session's commands are answered,
/// without a restart. What was sent meanwhile may still take effect when
/// it arrives, as a command to a Redis that was slow: the timed-out lock
/// attempt holds the lock for its lease, and a `WAIT` gets it after.
/// `/readyz` says not ready while the primary is silent (df57308: ready
/// throughout, as the connection stayed open) and ready after the heal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_primary_gives_bounded_errors_and_comes_back_without_a_restart() {
    let redis = RedisServer::start();
    let path = Relay::to(&redis.addr()).await;
    let lg = Lockgate::start_with_admin(config(&path.host_port())).await;
    let admin = lg.admin.expect("an admin listener");
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(c.call_s(&["SET", "k", "v"]).await, "+OK\r\n");
    until!(
        "/readyz ready",
        support::ops::http_get(admin, "/readyz").await.status == 200
    );
    path.set(Mode::Blackhole);
    let asked = Instant::now();
    let reply = c.call_s(&["LOCKGATE", "LOCK", "lock:f", "1000"]).await;
    let took = asked.elapsed();
    println!("blackholed primary: {reply:?} after {took:?}");
    assert!(reply.starts_with("-ERR lockgate:"), "{reply}");
    assert!(
        took < Duration::from_secs(4),
        "answered within the call's timeout: {took:?}"
    );
    until!("/readyz not ready while the primary is silent", {
        let r = support::ops::http_get(admin, "/readyz").await;
        r.status == 503 && r.body.contains("not answering")
    });
    path.heal();
    until!(
        "/readyz ready after the heal",
        support::ops::http_get(admin, "/readyz").await.status == 200
    );
    assert_eq!(c.call_s(&["GET", "k"]).await, "$1\r\nv\r\n");
    let granted = c
        .call_s(&["LOCKGATE", "LOCK", "lock:f", "1000", "WAIT", "5000"])
        .await;
    assert!(granted.starts_with("*2\r\n"), "{granted}");
    lg.stop().await;
}

/// The primary blackholed under `proxy.upstream = "shared"`: lock commands
/// on the shared connections (`SETNX`, `SET NX PX`, a holder's `DEL`) are
/// answered `-ERR lockgate: upstream … unavailable` within
/// `upstream.lock_reply_timeout_ms` (500 ms here) and the connect timeout,
/// on a session opened before the blackhole and on one opened during it,
/// a `GET` pipelined behind a `SETNX` answered after it, in order; the
/// shared connection given up is counted; after the heal the same sessions
/// are served again without a restart and the lock is still its holder's
/// (what was sent into the blackhole and arrives late takes nothing).
/// Before `lock_reply_timeout_ms` (474e944) they waited as long as the
/// path was silent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_primary_answers_lock_commands_on_shared_connections_in_bounded_time() {
    let redis = RedisServer::start();
    let path = Relay::to(&redis.addr()).await;
    let mut config = config(&path.host_port());
    config.proxy.upstream = lockgate::config::UpstreamMode::Shared;
    config.upstream.lock_reply_timeout_ms = 500;
    config.locks.retry.probe_interval_ms = 0;
    config.locks.retry.park_ms = 0;
    let lg = Lockgate::start_with(config).await;
    let mut rec = Recorder::new(Duration::from_secs(10));
    let mut rec_holder = rec.for_client(1);
    let (mut rec_before, mut rec_during) = (rec.for_client(2), rec.for_client(3));
    let mut before = RawClient::connect(lg.addr).await;
    assert_eq!(before.call_s(&["SET", "k", "v"]).await, "+OK\r\n");
    let mut holder = RawClient::connect(lg.addr).await;
    let take = ["SET", "lock:held", "h", "NX", "PX", "60000"];
    assert_eq!(rec_holder.call(&mut holder, &take).await, "+OK\r\n");

    path.set(Mode::Blackhole);
    for key in ["lock:held", "lock:free"] {
        rec.cannot_grant(key, "the primary blackholed");
    }
    let is_error = |r: &str| r.starts_with("-ERR lockgate: upstream ") && r.contains("unavailable");
    let asked = Instant::now();
    let pipeline = [
        support::resp::cmd(&["SETNX", "lock:free", "b"]),
        support::resp::cmd(&["GET", "k"]),
    ]
    .concat();
    before.send(&pipeline).await;
    let replies = tokio::time::timeout(BOUND, async {
        [before.read_s().await, before.read_s().await]
    })
    .await
    .unwrap_or_else(|_| panic!("a pipelined SETNX + GET unanswered after {BOUND:?}"));
    let mut latencies = vec![asked.elapsed()];
    assert!(replies.iter().all(|r| is_error(r)), "{replies:?}");
    let mut during = RawClient::connect(lg.addr).await;
    for (who, c, rec) in [
        ("before", &mut before, &mut rec_before),
        ("during", &mut during, &mut rec_during),
    ] {
        for attempt in [
            vec!["SETNX", "lock:free", "o"],
            vec!["SET", "lock:free", "o", "NX", "PX", "5000"],
        ] {
            let asked = Instant::now();
            let reply = tokio::time::timeout(BOUND, rec.call(c, &attempt))
                .await
                .unwrap_or_else(|_| panic!("{attempt:?} ({who}) unanswered after {BOUND:?}"));
            latencies.push(asked.elapsed());
            assert!(is_error(&reply), "{attempt:?} ({who}): {reply:?}");
        }
    }
    let released = tokio::time::timeout(BOUND, rec_holder.call(&mut holder, &["DEL", "lock:held"]))
        .await
        .unwrap_or_else(|_| panic!("the holder's DEL unanswered after {BOUND:?}"));
    assert!(is_error(&released), "the holder's DEL: {released:?}");
    let text = lockgate::exposition::render(&lg.ctx).expect("metrics");
    let given_up = support::ops::Metrics::parse(&text)
        .value("lockgate_shared_upstream_lock_reply_timeouts_total", &[]);
    assert!(given_up >= 1.0, "no shared connection given up counted");

    path.heal();
    let healed = Instant::now();
    for c in [&mut before, &mut during] {
        until!(
            "served after the heal",
            c.call_s(&["GET", "k"]).await == "$1\r\nv\r\n"
        );
    }
    let served_after = healed.elapsed();
    // The holder's release sent into the blackhole may have reached Redis
    // late: the lock is the holder's or free, never another's.
    let now = support::resp::direct(&redis.addr(), &["GET", "lock:held"]).await;
    assert!(now == "$1\r\nh\r\n" || now == "$-1\r\n", "{now:?}");
    for key in ["lock:held", "lock:free"] {
        rec.can_grant(key);
    }
    let _ = holder.call_s(&["DEL", "lock:held"]).await;
    let granted = rec_during
        .call(&mut during, &["SETNX", "lock:held", "o"])
        .await;
    assert_eq!(granted, ":1\r\n");
    for other in [rec_holder, rec_before, rec_during] {
        rec.merge(other);
    }
    rec.judge("primary blackholed (shared)", 2);
    latencies.sort();
    println!(
        "primary blackholed (shared): lock commands answered with errors after {:.0}–{:.0} ms \
         ({} asked, lock_reply_timeout_ms 500, connect_timeout_ms 500), {given_up} shared \
         connections given up; served again {} ms after the heal",
        latencies[0].as_secs_f64() * 1000.0,
        latencies[latencies.len() - 1].as_secs_f64() * 1000.0,
        latencies.len(),
        served_after.as_millis()
    );
    lg.stop().await;
}

/// How long a lock command on a blackholed path may take to be answered:
/// the lock reply timeout, the connect timeout (500 ms each here) and a
/// loaded box's margin.
const BOUND: Duration = Duration::from_secs(5);

/// The primary blackholed, sessions on connections of their own (the
/// default): a session whose lock command Redis leaves unanswered for
/// `upstream.lock_reply_timeout_ms` (500 ms here) is closed, as when Redis
/// drops a connection with replies owed (nothing in their place could keep
/// the order: a `GET` pipelined behind the `SETNX` goes with it), on a
/// session opened before the blackhole and on one opened during it, and
/// counted; a session with no lock command owed stays open; after the heal
/// new sessions are served and the lock is still its holder's or free,
/// never another's. Before `lock_reply_timeout_ms` (474e944) the sessions
/// waited as long as the path was silent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_primary_closes_sessions_whose_lock_command_it_leaves_unanswered() {
    let redis = RedisServer::start();
    let path = Relay::to(&redis.addr()).await;
    let mut config = config(&path.host_port());
    config.upstream.lock_reply_timeout_ms = 500;
    config.locks.retry.probe_interval_ms = 0;
    config.locks.retry.park_ms = 0;
    let lg = Lockgate::start_with(config).await;
    let mut before = RawClient::connect(lg.addr).await;
    assert_eq!(before.call_s(&["SET", "k", "v"]).await, "+OK\r\n");
    let mut holder = RawClient::connect(lg.addr).await;
    let take = ["SET", "lock:held", "h", "NX", "PX", "60000"];
    assert_eq!(holder.call_s(&take).await, "+OK\r\n");
    let mut idle = RawClient::connect(lg.addr).await;
    assert_eq!(idle.call_s(&["PING"]).await, "+PONG\r\n");

    path.set(Mode::Blackhole);
    let mut during = RawClient::connect(lg.addr).await;
    let mut latencies = Vec::new();
    for (who, c, pipeline) in [
        (
            "before",
            &mut before,
            [
                support::resp::cmd(&["SETNX", "lock:free", "b"]),
                support::resp::cmd(&["GET", "k"]),
            ]
            .concat(),
        ),
        (
            "during",
            &mut during,
            support::resp::cmd(&["SET", "lock:free", "o", "NX", "PX", "5000"]),
        ),
    ] {
        let asked = Instant::now();
        c.send(&pipeline).await;
        assert!(
            c.closed_within(BOUND).await,
            "the session opened {who} the blackhole still open after {BOUND:?}"
        );
        latencies.push(asked.elapsed());
        assert!(c.buffered().is_empty(), "{who}: {:?}", c.buffered());
    }
    let text = lockgate::exposition::render(&lg.ctx).expect("metrics");
    let closed = support::ops::Metrics::parse(&text)
        .value("lockgate_upstream_lock_reply_timeouts_total", &[]);
    assert_eq!(closed, 2.0, "sessions closed for a lock reply, counted");

    path.heal();
    // The session with nothing owed was left alone.
    assert_eq!(idle.call_s(&["GET", "k"]).await, "$1\r\nv\r\n");
    let mut after = RawClient::connect(lg.addr).await;
    assert_eq!(after.call_s(&["GET", "k"]).await, "$1\r\nv\r\n");
    assert_eq!(after.call_s(&["SETNX", "lock:held", "o"]).await, ":0\r\n");
    assert_eq!(holder.call_s(&["DEL", "lock:held"]).await, ":1\r\n");
    assert_eq!(after.call_s(&["SETNX", "lock:held", "o"]).await, ":1\r\n");
    println!(
        "primary blackholed (dedicated): sessions with a lock command owed closed after {:.0} ms \
         (opened before) and {:.0} ms (opened during), lock_reply_timeout_ms 500",
        latencies[0].as_secs_f64() * 1000.0,
        latencies[1].as_secs_f64() * 1000.0,
    );
    lg.stop().await;
}
