//! Partitions around one lockgate, through a relay (`tests/support/relay.rs`):
//! cut from its clients while they hold locks (release on disconnect when
//! the path closes; the watchdog's bound when it only goes silent).
//! What each promises: docs/faults.md, "Partitions".

use crate::support;

use std::time::{Duration, Instant};

use lockgate::config::LockOverride;
use lockgate::Config;
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

/// Tries `SET key v NX` through `c` until it is granted; how long it took.
async fn take(c: &mut RawClient, key: &str, v: &str, within: Duration) -> Duration {
    let start = Instant::now();
    loop {
        if c.call_s(&["SET", key, v, "NX"]).await == "+OK\r\n" {
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

    // Cut: the close reaches lockgate, which releases at once.
    let cut = Relay::start(lg.addr).await;
    let mut a = RawClient::connect(cut.addr).await;
    assert_eq!(a.call_s(&["SET", "lock:eph:1", "a", "NX"]).await, "+OK\r\n");
    assert_eq!(
        rival.call_s(&["SET", "lock:eph:1", "r", "NX"]).await,
        "$-1\r\n"
    );
    cut.set(Mode::Cut);
    let freed = take(&mut rival, "lock:eph:1", "r", Duration::from_secs(5)).await;
    println!("cut holder: lock free {freed:?} after the cut");
    assert!(
        freed < Duration::from_secs(2),
        "release on disconnect took {freed:?}"
    );

    // Silent: lockgate sees nothing; the watchdog renews until max_hold_ms.
    let silent = Relay::start(lg.addr).await;
    let mut b = RawClient::connect(silent.addr).await;
    assert_eq!(b.call_s(&["SET", "lock:eph:2", "b", "NX"]).await, "+OK\r\n");
    let held_at = Instant::now();
    silent.set(Mode::Blackhole);
    let freed = take(&mut rival, "lock:eph:2", "r", Duration::from_secs(8)).await;
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
    assert_eq!(b.call_s(&["DEL", "lock:eph:2"]).await, ":0\r\n");
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
