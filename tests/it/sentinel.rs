//! Following the primary through Redis Sentinel, against real processes: a
//! primary, a replica and three `redis-server --sentinel` (tests/support/
//! sentinel.rs). Start-up discovery confirmed with ROLE and `/readyz` before
//! it; a planned failover (`SENTINEL FAILOVER`) and a SIGKILLed primary,
//! each followed within a bound the test measures and prints; sessions on
//! the old primary closed; a lock held before the failover not granted
//! again before `locks.failover_delay_ms`, then granted; with the quorum,
//! lock acquisitions untouched by the primary's failover. Each test has its
//! own processes, so they run in parallel.

use crate::support;
use lockgate::config::UpstreamMode;

use std::time::{Duration, Instant};

use lockgate::Config;
use support::ops::http_get;
use support::resp::{call, direct};
use support::sentinel::{primary_field, sentinel_config, try_call, Group, Sentinel, MASTER};
use support::{Lockgate, RawClient, RedisServer, WAIT};

/// Longest a followed failover may take in these tests: Sentinel itself
/// needs `down-after-milliseconds` (500) plus an election and a promotion.
const FOLLOW_BOUND: Duration = Duration::from_secs(20);

async fn until_ready(lg: &Lockgate) {
    until!(
        "lockgate to be ready",
        lockgate::http::not_ready(&lg.ctx).is_none()
    );
}

/// Polls until a write through lockgate lands on `new`: `new` answers ROLE
/// master, a fresh value SET through lockgate, read directly on `new`, is
/// there (a write that went to the old primary never reaches the promoted
/// one). Returns the time since `since`.
async fn until_writes_land(lg: &Lockgate, new: &str, since: Instant) -> Duration {
    let lg = lg.addr.to_string();
    let probe = Duration::from_millis(500);
    for n in 0u64.. {
        let value = format!("v{n}");
        if Group::role(new).await == "master"
            && try_call(&lg, &["SET", "follow:probe", &value], probe)
                .await
                .as_deref()
                == Some("+OK\r\n")
            && try_call(new, &["GET", "follow:probe"], probe).await
                == Some(format!("${}\r\n{value}\r\n", value.len()))
        {
            return since.elapsed();
        }
        assert!(
            since.elapsed() < FOLLOW_BOUND,
            "writes through lockgate did not reach the promoted {new} within {FOLLOW_BOUND:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    unreachable!()
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split(' ').take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

#[tokio::test]
async fn the_sentinels_answer_is_used_only_once_role_confirms_it() {
    role_confirms(UpstreamMode::Dedicated).await;
}

/// The same with `proxy.upstream = "shared"`, and a reconnect interval
/// longer than the test: the shared connection opens when the primary is
/// confirmed, not at its next back-off attempt.
#[tokio::test]
async fn the_shared_connection_opens_once_role_confirms_the_primary() {
    role_confirms(UpstreamMode::Shared).await;
}

async fn role_confirms(mode: UpstreamMode) {
    let (primary, replica) = Group::pair().await;
    // One sentinel names the replica as the master; one address is dead.
    // A long down-after keeps the sentinel from acting during the test.
    let sentinel = Sentinel::start(&replica.addr(), 1, 60_000);
    let dead = format!("127.0.0.1:{}", support::free_port());
    let mut config = sentinel_config(&[dead, sentinel.addr()]);
    config.upstream.sentinel.recheck_interval_ms = 100;
    config.proxy.upstream = mode;
    if mode == UpstreamMode::Shared {
        config.upstream.reconnect_interval_ms = 600_000;
        config.proxy.shared_upstream_connections = 1;
    }
    let lg = Lockgate::start_with_admin(config).await;
    let admin = lg.admin.expect("admin listener");
    let errors = |lg: &Lockgate| {
        lockgate::metrics::ProxyMetrics::get(&lg.ctx.primary_addr.metrics.sentinel_errors)
    };
    // Two rounds of checks asked both sentinels (the dead one fails).
    until!("two rounds of sentinel checks", errors(&lg) >= 2);
    let ready = http_get(admin, "/readyz").await;
    assert_eq!(ready.status, 503, "{}", ready.body);
    assert!(
        ready.body.contains("no primary confirmed"),
        "{}",
        ready.body
    );
    let mut c = RawClient::connect(lg.addr).await;
    let reply = call(&mut c, &["SET", "k", "v"]).await;
    assert!(
        reply.starts_with("-ERR lockgate: upstream unavailable (no primary confirmed"),
        "{reply}"
    );
    // A session without a primary answers every command so (LOCKGATE
    // too); the status page says none is confirmed.
    let status = http_get(admin, "/status.json").await;
    assert!(status.body.contains(r#""addr":"""#), "{}", status.body);

    // Now the sentinel names the real primary: confirmed by ROLE, in force.
    assert_eq!(
        direct(&sentinel.addr(), &["SENTINEL", "REMOVE", MASTER]).await,
        "+OK\r\n"
    );
    let port = primary.port.to_string();
    let monitor = ["SENTINEL", "MONITOR", MASTER, "127.0.0.1", &port, "1"];
    assert_eq!(direct(&sentinel.addr(), &monitor).await, "+OK\r\n");
    until!(
        "/readyz to answer 200",
        http_get(admin, "/readyz").await.status == 200
    );
    if mode == UpstreamMode::Shared {
        let connects = &lg.ctx.upstream_conns.shared_connects;
        until!(
            "the shared connection to open",
            connects.load(std::sync::atomic::Ordering::Relaxed) == 1
        );
    }
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(primary_field(&mut c, "addr").await, primary.addr());
    assert_eq!(primary_field(&mut c, "switches").await, "0");
    assert_eq!(call(&mut c, &["SET", "k", "through"]).await, "+OK\r\n");
    assert_eq!(
        direct(&primary.addr(), &["GET", "k"]).await,
        "$7\r\nthrough\r\n"
    );
    let status = http_get(admin, "/status.json").await;
    assert!(status.body.contains(&primary.addr()), "{}", status.body);
    lg.stop().await;
}

#[tokio::test]
async fn a_planned_failover_is_followed_and_locks_wait_out_the_delay() {
    let group = Group::start().await;
    let mut config = sentinel_config(&group.addrs());
    // The default failover delay is the longest lease granted: 6 s below,
    // more than the 2 s default lease.
    config.locks.default_lease_ms = 2_000;
    // Every attempt goes to the lock room's rules, none is absorbed as
    // "known held": a "not acquired" below is the failover delay's.
    config.locks.retry.probe_interval_ms = 0;
    config.locks.retry.park_ms = 0;
    let lg = Lockgate::start_with(config).await;
    until_ready(&lg).await;
    let (old, new) = (group.primary.addr(), group.replica.addr());
    let mut holder = RawClient::connect(lg.addr).await;
    assert_eq!(
        call(&mut holder, &["SET", "lock:held", "h", "NX", "PX", "6000"]).await,
        "+OK\r\n"
    );
    let mut session = RawClient::connect(lg.addr).await;
    assert_eq!(call(&mut session, &["SELECT", "1"]).await, "+OK\r\n");
    let mut fencer = RawClient::connect(lg.addr).await;
    let fenced = call(&mut fencer, &["LOCKGATE", "LOCK", "lock:fenced", "6000"]).await;
    let token = fenced
        .split("\r\n")
        .nth(1)
        .expect("a token")
        .trim_start_matches(':')
        .to_string();
    // Replicated before the failover (WAIT: one replica acknowledged).
    assert_eq!(direct(&old, &["WAIT", "1", "5000"]).await, ":1\r\n");

    let started = Instant::now();
    let sentinel = group.sentinels[0].addr();
    assert_eq!(
        direct(&sentinel, &["SENTINEL", "FAILOVER", MASTER]).await,
        "+OK\r\n"
    );
    let followed = until_writes_land(&lg, &new, started).await;
    println!(
        "planned failover (SENTINEL FAILOVER): writes through lockgate land on the promoted replica after {} ms (load {})",
        followed.as_millis(),
        load()
    );
    // Sessions on the old primary were closed.
    assert!(
        session.closed_within(WAIT).await,
        "a session on the old primary stays open"
    );
    assert!(
        holder.closed_within(WAIT).await,
        "the holder's session stays open"
    );

    // Replication is asynchronous: pretend the lock never reached the new
    // primary, as after an unlucky failover.
    direct(&new, &["DEL", "lock:held", "lockgate:owner:{lock:held}"]).await;
    let mut other = RawClient::connect(lg.addr).await;
    assert_eq!(primary_field(&mut other, "addr").await, new);
    assert_eq!(primary_field(&mut other, "switches").await, "1");
    assert_eq!(primary_field(&mut other, "last_switch_from").await, old);
    let hold: u64 = primary_field(&mut other, "failover_hold_ms")
        .await
        .parse()
        .expect("ms");
    assert!(
        hold > 1_000 && hold <= 6_000,
        "failover hold left: {hold} ms"
    );
    assert_eq!(
        call(&mut other, &["SETNX", "lock:held", "o"]).await,
        ":0\r\n"
    );
    assert_eq!(
        call(&mut other, &["SET", "lock:fresh", "o", "NX"]).await,
        "$-1\r\n"
    );
    let refused =
        lockgate::metrics::ProxyMetrics::get(&lg.ctx.primary_addr.metrics.failover_refused);
    assert_eq!(refused, 2, "both attempts refused by the failover delay");
    assert_eq!(
        call(&mut other, &["LOCKGATE", "LOCK", "lock:fenced2", "1000"]).await,
        "$-1\r\n",
        "fencing acquisitions are held too"
    );
    // Releases keep working (over lockgate's own connection, which followed).
    assert_eq!(
        call(&mut other, &["LOCKGATE", "UNLOCK", "lock:fenced", &token]).await,
        ":1\r\n"
    );
    let stats = call(&mut other, &["LOCKGATE", "STATS"]).await;
    assert!(stats.contains("primary_switches"), "{stats}");
    // Still held just before the delay ends; granted once it has.
    until!("the failover delay to be nearly over", {
        let left: u64 = primary_field(&mut other, "failover_hold_ms")
            .await
            .parse()
            .expect("ms");
        left < 500
    });
    let left: u64 = primary_field(&mut other, "failover_hold_ms")
        .await
        .parse()
        .expect("ms");
    if left > 0 {
        assert_eq!(
            call(&mut other, &["SETNX", "lock:held", "o"]).await,
            ":0\r\n"
        );
    }
    until!(
        "the failover delay to end",
        primary_field(&mut other, "failover_hold_ms").await == "0"
    );
    assert_eq!(
        call(&mut other, &["SETNX", "lock:held", "o"]).await,
        ":1\r\n"
    );
    assert_eq!(direct(&new, &["GET", "lock:held"]).await, "$1\r\no\r\n");
    lg.stop().await;
}

#[tokio::test]
async fn a_killed_primary_is_followed() {
    let mut group = Group::start().await;
    let mut config = sentinel_config(&group.addrs());
    config.locks.failover_delay_ms = Some(0);
    let lg = Lockgate::start_with(config).await;
    until_ready(&lg).await;
    let new = group.replica.addr();
    let mut session = RawClient::connect(lg.addr).await;
    assert_eq!(call(&mut session, &["SET", "before", "1"]).await, "+OK\r\n");
    direct(&group.primary.addr(), &["WAIT", "1", "5000"]).await;
    let channel = format!("lockgate:wake:{}", lg.ctx.locks.instance_prefix());
    let numsub = ["PUBSUB", "NUMSUB", channel.as_str()];
    assert!(direct(&new, &numsub).await.ends_with(":0\r\n"));
    let started = Instant::now();
    group.primary.stop();
    let followed = until_writes_land(&lg, &new, started).await;
    println!(
        "unplanned failover (primary SIGKILLed, down-after-milliseconds 500): writes through lockgate land on the promoted replica after {} ms (load {})",
        followed.as_millis(),
        load()
    );
    assert!(
        session.closed_within(WAIT).await,
        "a session on the dead primary stays open"
    );
    // lockgate's own connection and the wake-up subscription followed.
    until_ready(&lg).await;
    until!(
        "the wake-up channel to be subscribed on the new primary",
        direct(&new, &numsub).await.ends_with(":1\r\n")
    );
    // LOCKGATE LOCK runs on lockgate's own connection (failover delay off
    // here: 0).
    let mut fencer = RawClient::connect(lg.addr).await;
    let fenced = call(&mut fencer, &["LOCKGATE", "LOCK", "lock:after", "5000"]).await;
    assert!(fenced.starts_with("*2\r\n:"), "{fenced}");
    assert_eq!(direct(&new, &["EXISTS", "lock:after"]).await, ":1\r\n");
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(call(&mut c, &["GET", "before"]).await, "$1\r\n1\r\n");
    assert_eq!(primary_field(&mut c, "addr").await, new);
    lg.stop().await;
}

#[tokio::test]
async fn with_the_quorum_lock_acquisitions_ignore_the_primarys_failover() {
    let group = Group::start().await;
    let masters: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let mut config: Config = sentinel_config(&group.addrs());
    config.locks.quorum.masters = masters.iter().map(|m| m.addr()).collect();
    config.locks.quorum.rejoin_delay_ms = 300;
    config.locks.retry.probe_interval_ms = 0;
    config.locks.retry.park_ms = 0;
    let lg = Lockgate::start_with(config).await;
    until_ready(&lg).await;
    let mut a = RawClient::connect(lg.addr).await;
    assert_eq!(call(&mut a, &["SETNX", "lock:q", "a"]).await, ":1\r\n");
    let started = Instant::now();
    let sentinel = group.sentinels[0].addr();
    assert_eq!(
        direct(&sentinel, &["SENTINEL", "FAILOVER", MASTER]).await,
        "+OK\r\n"
    );
    let followed = until_writes_land(&lg, &group.replica.addr(), started).await;
    println!(
        "planned failover with the quorum: followed after {} ms",
        followed.as_millis()
    );
    let mut b = RawClient::connect(lg.addr).await;
    // The lock lives on the masters: still held, and a free one is granted
    // at once, with no failover delay.
    assert_eq!(call(&mut b, &["SETNX", "lock:q", "b"]).await, ":0\r\n");
    assert_eq!(call(&mut b, &["SETNX", "lock:other", "b"]).await, ":1\r\n");
    assert_eq!(primary_field(&mut b, "switches").await, "1");
    assert_eq!(primary_field(&mut b, "failover_hold_ms").await, "0");
    let refused =
        lockgate::metrics::ProxyMetrics::get(&lg.ctx.primary_addr.metrics.failover_refused);
    assert_eq!(refused, 0);
    lg.stop().await;
}
