//! Lock keys and Redis's eviction (`docs/faults.md`, "Eviction"): lockgate
//! reads each lock store's `maxmemory-policy` and `evicted_keys` on its own
//! connections, names the policy everywhere an operator looks, warns where
//! lock keys may be evicted, and with `locks.require_noeviction` refuses to
//! serve locks there until the policy reads `noeviction` again. Against
//! real redis-servers started with the policies under test.

use crate::support;

use std::time::{Duration, Instant};

use lockgate::lock::quorum::{MasterState, SitOut};
use lockgate::metrics::ProxyMetrics;
use support::binary::Captured;
use support::ops::{base_config, call, Ops};
use support::quorum::Cluster;
use support::resp::direct;
use support::sentinel::{sentinel_config, Group, Sentinel, MASTER};
use support::{free_port, Lockgate, RawClient, RedisServer};

/// How often the tests' lockgate reads the policies again.
const CHECK_MS: u64 = 50;

/// Longest a fixed policy may take to serve locks again: one check
/// interval, with room for a loaded 2-core host.
const SERVED_AGAIN_WITHIN: Duration = Duration::from_secs(3);

/// The field `name` of `LOCKGATE PRIMARY` (field/value pairs), as text.
async fn primary_field(c: &mut RawClient, name: &str) -> String {
    let reply = call(c, &["LOCKGATE", "PRIMARY"]).await;
    let items = reply.items();
    let at = (items.iter().step_by(2))
        .position(|f| f.text() == name)
        .unwrap_or_else(|| panic!("no {name} in LOCKGATE PRIMARY: {reply}"));
    match &items[2 * at + 1] {
        support::resp::Resp::Int(n) => n.to_string(),
        other => other.text().to_string(),
    }
}

/// Polls `LOCKGATE PRIMARY`'s `name` until it is `want` (within [`WAIT`]).
async fn until_primary_field(c: &mut RawClient, name: &str, want: &str) {
    until!(
        format!("LOCKGATE PRIMARY {name} to be {want}"),
        primary_field(c, name).await == want
    );
}

/// A redis-server whose `maxmemory-policy` is `policy`.
fn redis_with_policy(policy: &str) -> RedisServer {
    RedisServer::start_with(&["--maxmemory-policy", policy])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_primary_is_named_everywhere_and_locks_are_still_served() {
    let redis = redis_with_policy("allkeys-lru");
    let addr = redis.addr();
    let lg = Ops::start(base_config(&addr)).await;
    let mut c = lg.client().await;
    until_primary_field(&mut c, "maxmemory_policy", "allkeys-lru").await;
    assert_eq!(primary_field(&mut c, "locks_refused").await, "");
    let m = lg.metrics().await;
    let labels = [("role", "primary"), ("node", addr.as_str())];
    let policy = [labels[0], labels[1], ("policy", "allkeys-lru")];
    assert_eq!(m.value("lockgate_upstream_maxmemory_policy", &policy), 1.0);
    assert_eq!(m.series("lockgate_upstream_maxmemory_policy").len(), 1);
    assert_eq!(
        m.value("lockgate_upstream_evicted_keys_total", &labels),
        0.0
    );
    let s = lg.status_json().await;
    assert_eq!(s["primary"]["maxmemory_policy"], "allkeys-lru", "{s}");
    // Off by default: a warning, not a refusal.
    assert_eq!(c.call_s(&["SETNX", "lock:evict:a", "1"]).await, ":1\r\n");
    assert_eq!(lg.get("/readyz").await.status, 200);

    // A policy changed at run time is seen within a check (1 s default).
    assert_eq!(
        direct(&addr, &["CONFIG", "SET", "maxmemory-policy", "noeviction"]).await,
        "+OK\r\n"
    );
    until_primary_field(&mut c, "maxmemory_policy", "noeviction").await;
    let m = lg.metrics().await;
    let policy = [labels[0], labels[1], ("policy", "noeviction")];
    assert_eq!(m.value("lockgate_upstream_maxmemory_policy", &policy), 1.0);
}

/// The warning, as the binary logs it: the policy by name, the node, no key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_warns_of_a_policy_that_may_evict_lock_keys() {
    let redis = redis_with_policy("volatile-lru");
    let listen = format!("127.0.0.1:{}", free_port());
    let mut bin = Captured::spawn(&[
        "--listen",
        &listen,
        "--upstream",
        &redis.addr(),
        "--admin-listen",
        "",
    ]);
    bin.until_logged("maxmemory-policy may evict lock keys", 1)
        .await;
    let out = bin.output();
    let line = (out.lines())
        .find(|l| l.contains("maxmemory-policy may evict lock keys"))
        .expect("the warning");
    for field in [
        "WARN",
        &format!("node=\"{}\"", redis.addr()),
        "role=\"primary\"",
        "policy=\"volatile-lru\"",
        "every lock key has its lease",
    ] {
        assert!(line.contains(field), "{field} missing from {line}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_noeviction_refuses_lock_leases_until_the_policy_is_fixed() {
    let redis = redis_with_policy("allkeys-lru");
    let addr = redis.addr();
    let mut config = base_config(&addr);
    config.locks.require_noeviction = true;
    config.locks.eviction_check_ms = CHECK_MS;
    let lg = Ops::start(config).await;
    let mut c = lg.client().await;
    until_primary_field(&mut c, "maxmemory_policy", "allkeys-lru").await;
    let refused = format!(
        "-ERR lockgate: locks refused: maxmemory-policy is allkeys-lru on the primary {addr} (locks.require_noeviction)\r\n"
    );
    assert_eq!(c.call_s(&["SETNX", "lock:evict:r", "1"]).await, refused);
    assert_eq!(
        c.call_s(&["SET", "lock:evict:r", "1", "NX", "PX", "5000"])
            .await,
        refused
    );
    assert_eq!(
        c.call_s(&["PEXPIRE", "lock:evict:r", "5000"]).await,
        refused
    );
    assert_eq!(c.call_s(&["GETSET", "lock:evict:r", "2"]).await, refused);
    assert_eq!(
        c.call_s(&["LOCKGATE", "LOCK", "lock:evict:f", "5000"])
            .await,
        refused
    );
    // Nothing reached Redis.
    assert_eq!(direct(&addr, &["EXISTS", "lock:evict:r"]).await, ":0\r\n");
    // Ordinary commands pass; a release passes (a lock can be given back).
    assert_eq!(c.call_s(&["SET", "plain", "v"]).await, "+OK\r\n");
    assert_eq!(c.call_s(&["GET", "plain"]).await, "$1\r\nv\r\n");
    assert_eq!(c.call_s(&["SETNX", "plain:nx", "v"]).await, ":1\r\n");
    assert_eq!(c.call_s(&["DEL", "lock:evict:r"]).await, ":0\r\n");
    // Inside MULTI the refusal takes the command's place in EXEC.
    assert_eq!(c.call_s(&["MULTI"]).await, "+OK\r\n");
    assert_eq!(
        c.call_s(&["SETNX", "lock:evict:m", "1"]).await,
        "+QUEUED\r\n"
    );
    assert_eq!(c.call_s(&["INCR", "counter"]).await, "+QUEUED\r\n");
    assert_eq!(c.call_s(&["EXEC"]).await, format!("*2\r\n{refused}:1\r\n"));
    assert_eq!(
        primary_field(&mut c, "locks_refused").await,
        refused[5..refused.len() - 2]
    );
    let counted = ProxyMetrics::get(&lg.ctx.eviction.metrics.refused);
    assert_eq!(counted, 6, "every refusal counted");
    assert_eq!(
        lg.metrics()
            .await
            .int("lockgate_lock_eviction_refused_total"),
        6
    );
    let ready = lg.get("/readyz").await;
    assert_eq!(ready.status, 503);
    assert!(
        ready.body.contains("maxmemory-policy is allkeys-lru"),
        "{}",
        ready.body
    );

    // Fixed on the Redis: served again within a check, no restart.
    assert_eq!(
        direct(&addr, &["CONFIG", "SET", "maxmemory-policy", "noeviction"]).await,
        "+OK\r\n"
    );
    let fixed = Instant::now();
    loop {
        let reply = c.call_s(&["SETNX", "lock:evict:r", "1"]).await;
        if reply == ":1\r\n" {
            break;
        }
        assert_eq!(reply, refused);
        assert!(fixed.elapsed() < SERVED_AGAIN_WITHIN, "still refused");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    println!(
        "locks served again {} ms after CONFIG SET maxmemory-policy noeviction (check every {CHECK_MS} ms)",
        fixed.elapsed().as_millis()
    );
    assert_eq!(direct(&addr, &["GET", "lock:evict:r"]).await, "$1\r\n1\r\n");
    assert_eq!(primary_field(&mut c, "locks_refused").await, "");
    assert_eq!(lg.get("/readyz").await.status, 200);

    // And refused again at the next unsafe policy, without a reconnection.
    direct(
        &addr,
        &["CONFIG", "SET", "maxmemory-policy", "volatile-ttl"],
    )
    .await;
    until!(
        "locks refused under volatile-ttl",
        c.call_s(&["SETNX", "lock:evict:v", "1"])
            .await
            .contains("volatile-ttl")
    );
    assert_eq!(
        lg.ctx
            .primary
            .state
            .connects
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renamed_config_is_read_from_info_memory_and_a_refused_one_is_unknown() {
    // CONFIG renamed away, as managed Redis does: INFO memory tells.
    let renamed = RedisServer::start_with(&[
        "--maxmemory-policy",
        "volatile-random",
        "--rename-command",
        "CONFIG",
        "",
    ]);
    assert!(
        direct(&renamed.addr(), &["CONFIG", "GET", "maxmemory-policy"])
            .await
            .starts_with("-ERR unknown command")
    );
    let lg = Lockgate::start(&renamed.addr()).await;
    let mut c = RawClient::connect(lg.addr).await;
    until_primary_field(&mut c, "maxmemory_policy", "volatile-random").await;
    assert!(lg.ctx.primary_memory.config_refused());
    lg.stop().await;

    // An ACL that refuses CONFIG and INFO: unknown, and with
    // require_noeviction locks are refused saying so.
    let redis = RedisServer::start();
    let acl = [
        "ACL", "SETUSER", "lg", "on", ">pw", "~*", "&*", "+@all", "-config", "-info",
    ];
    assert_eq!(direct(&redis.addr(), &acl).await, "+OK\r\n");
    let mut config = base_config(&redis.addr());
    config.upstream.username = "lg".to_string();
    config.upstream.password = "pw".to_string();
    config.locks.require_noeviction = true;
    let lg = Lockgate::start_with(config).await;
    until!(
        "lockgate's own connection to read the policy",
        lg.ctx.primary_memory.reading().is_some()
    );
    assert_eq!(lg.ctx.primary_memory.policy_name(), "unknown");
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(c.call_s(&["AUTH", "lg", "pw"]).await, "+OK\r\n");
    assert_eq!(
        c.call_s(&["SETNX", "lock:evict:u", "1"]).await,
        format!(
            "-ERR lockgate: locks refused: maxmemory-policy is unknown on the primary {} (CONFIG GET and INFO memory refused) (locks.require_noeviction)\r\n",
            redis.addr()
        )
    );
    assert_eq!(c.call_s(&["SET", "k", "v"]).await, "+OK\r\n");
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_that_may_evict_sits_out_until_it_reads_noeviction() {
    let mut cl = Cluster::start(3, |c| {
        c.locks.require_noeviction = true;
        c.locks.eviction_check_ms = CHECK_MS;
        c.locks.retry.probe_interval_ms = 0;
    })
    .await;
    let evicting = cl.masters[2].addr();
    let set = |p: &'static str| ["CONFIG", "SET", "maxmemory-policy", p];
    assert_eq!(cl.on_master(2, &set("allkeys-lru")).await, "+OK\r\n");
    cl.wait_state(2, "sitting out", |s| {
        *s == MasterState::SittingOut(Duration::ZERO, SitOut::Evicting)
    })
    .await;
    let master = &cl.quorum().masters[2];
    assert_eq!(
        master.sit_out_reason().as_deref(),
        Some("maxmemory-policy allkeys-lru")
    );
    let mut c = cl.client().await;
    let masters = call(&mut c, &["LOCKGATE", "MASTERS"]).await;
    let row = &masters.items()[2];
    assert_eq!(
        (
            row.field("addr").text(),
            row.field("state").text(),
            row.field("sits_out_because").text(),
            row.field("maxmemory_policy").text()
        ),
        (
            evicting.as_str(),
            "sitting out",
            "maxmemory-policy allkeys-lru",
            "allkeys-lru"
        ),
        "{masters}"
    );
    // Two of three vote: locks are served, and never on the evicting one.
    assert_eq!(c.call_s(&["SETNX", "lock:q:a", "1"]).await, ":1\r\n");
    assert_eq!(cl.on_master(0, &["EXISTS", "lock:q:a"]).await, ":1\r\n");
    assert_eq!(cl.on_master(2, &["EXISTS", "lock:q:a"]).await, ":0\r\n");
    let sat = ProxyMetrics::get(&cl.quorum().rejoin.sit_outs_evicting);
    assert_eq!(sat, 1);

    // With master 0 down the evicting one would be needed: no quorum.
    cl.masters[0].stop();
    cl.wait_state(0, "Down", |s| *s == MasterState::Down).await;
    assert_eq!(
        c.call_s(&["SETNX", "lock:q:b", "1"]).await,
        "-ERR lockgate: lock quorum unavailable: 1 of 3 masters vote, 1 sit out \
         (maxmemory-policy allkeys-lru), 1 down\r\n"
    );
    assert_eq!(cl.on_master(2, &["EXISTS", "lock:q:b"]).await, ":0\r\n");
    // Fixed: it votes again within a check (it evicted nothing, so no
    // rejoin delay), and the lock is granted by masters 1 and 2.
    assert_eq!(cl.on_master(2, &set("noeviction")).await, "+OK\r\n");
    let fixed = Instant::now();
    cl.wait_state(2, "Up", |s| *s == MasterState::Up).await;
    assert!(fixed.elapsed() < SERVED_AGAIN_WITHIN);
    until!(
        "lock:q:b granted by masters 1 and 2",
        c.call_s(&["SETNX", "lock:q:b", "1"]).await == ":1\r\n"
    );
    println!(
        "the master voted again {} ms after CONFIG SET maxmemory-policy noeviction",
        fixed.elapsed().as_millis()
    );
    assert_eq!(cl.on_master(2, &["EXISTS", "lock:q:b"]).await, ":1\r\n");
}

/// Fills the Redis at `addr` under `allkeys-random` and a `maxmemory` just
/// above what it uses, directly (not through lockgate), until it evicts;
/// returns its `evicted_keys` then.
async fn make_it_evict(addr: &str) -> u64 {
    let mut r = RawClient::connect(addr).await;
    let field = |text: &str, name: &str| -> u64 {
        (text.lines())
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    };
    let used = field(&r.call_s(&["INFO", "memory"]).await, "used_memory:");
    let limit = (used + 512 * 1024).to_string();
    for (k, v) in [
        ("maxmemory", limit.as_str()),
        ("maxmemory-policy", "allkeys-random"),
    ] {
        assert_eq!(r.call_s(&["CONFIG", "SET", k, v]).await, "+OK\r\n");
    }
    let value = "x".repeat(16 * 1024);
    for i in 0..256 {
        let key = format!("fill:{i}");
        assert_eq!(r.call_s(&["SET", &key, &value]).await, "+OK\r\n");
    }
    let evicted = field(&r.call_s(&["INFO", "stats"]).await, "evicted_keys:");
    assert!(evicted > 0, "4 MiB into 512 KiB evicted nothing");
    evicted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_seen_evicting_sits_out_the_rejoin_delay() {
    const REJOIN_MS: u64 = 2_000;
    let cl = Cluster::start(3, |c| {
        c.locks.require_noeviction = true;
        c.locks.eviction_check_ms = CHECK_MS;
        c.locks.quorum.rejoin_delay_ms = REJOIN_MS;
    })
    .await;
    let addr = cl.masters[2].addr();
    make_it_evict(&addr).await;
    let set = |p: &'static str| ["CONFIG", "SET", "maxmemory-policy", p];
    assert_eq!(cl.on_master(2, &set("noeviction")).await, "+OK\r\n");
    let fixed = Instant::now();
    let memory = &cl.quorum().masters[2].memory;
    until!(
        "lockgate to read noeviction and the evictions",
        memory.policy_name() == "noeviction" && ProxyMetrics::get(&memory.evicted) > 0
    );
    // Its policy is safe now, but a held lock key may have been evicted:
    // it sits out until every lease it may have lost has ended.
    let MasterState::SittingOut(left, SitOut::Evicted) = cl.state(2) else {
        panic!("master 2 votes at once: {:?}", cl.state(2));
    };
    assert!(left > Duration::from_millis(REJOIN_MS / 2), "{left:?} left");
    assert_eq!(cl.quorum().masters[2].sit_out_reason(), None);
    assert!(ProxyMetrics::get(&cl.quorum().rejoin.sit_outs_evicted) >= 1);
    cl.wait_state(2, "Up", |s| *s == MasterState::Up).await;
    let back = fixed.elapsed();
    println!(
        "a master seen evicting voted again {} ms after the fix",
        back.as_millis()
    );
    assert!(back >= Duration::from_millis(REJOIN_MS / 2), "{back:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_keys_growth_is_counted_per_node() {
    let redis = redis_with_policy("allkeys-random");
    let addr = redis.addr();
    let mut config = base_config(&addr);
    config.locks.eviction_check_ms = CHECK_MS;
    let lg = Ops::start(config).await;
    let mut c = lg.client().await;
    until_primary_field(&mut c, "maxmemory_policy", "allkeys-random").await;
    let evicted = make_it_evict(&addr).await;
    until!(
        format!("lockgate to count {evicted} evicted keys"),
        primary_field(&mut c, "evicted_keys").await == evicted.to_string()
    );
    let m = lg.metrics().await;
    let labels = [("role", "primary"), ("node", addr.as_str())];
    assert_eq!(
        m.value("lockgate_upstream_evicted_keys_total", &labels),
        evicted as f64
    );
    assert_eq!(lg.status_json().await["primary"]["evicted_keys"], evicted);
}

/// Behind Sentinel, the policy is the primary in force's: a new primary's
/// is read as lockgate's connection follows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_primary_behind_sentinel_has_its_policy_read() {
    let (primary, replica) = Group::pair().await;
    assert_eq!(
        direct(
            &replica.addr(),
            &["CONFIG", "SET", "maxmemory-policy", "allkeys-lfu"]
        )
        .await,
        "+OK\r\n"
    );
    // One sentinel that never acts by itself (a long down-after).
    let sentinel = Sentinel::start(&primary.addr(), 1, 60_000);
    let mut config = sentinel_config(&[sentinel.addr()]);
    config.upstream.sentinel.recheck_interval_ms = 100;
    config.locks.require_noeviction = true;
    config.locks.eviction_check_ms = 60_000;
    let lg = Lockgate::start_with(config).await;
    let confirmed = |want: String| {
        let p = lg.ctx.primary_addr.clone();
        move || p.addr().as_deref() == Some(want.as_str())
    };
    until!("the primary confirmed", confirmed(primary.addr())());
    let mut c = RawClient::connect(lg.addr).await;
    until_primary_field(&mut c, "maxmemory_policy", "noeviction").await;
    assert_eq!(c.call_s(&["SETNX", "lock:s:a", "1"]).await, ":1\r\n");

    // The replica becomes the primary the sentinel names.
    assert_eq!(
        direct(&replica.addr(), &["REPLICAOF", "NO", "ONE"]).await,
        "+OK\r\n"
    );
    assert_eq!(
        direct(&sentinel.addr(), &["SENTINEL", "REMOVE", MASTER]).await,
        "+OK\r\n"
    );
    let port = replica.port.to_string();
    let monitor = ["SENTINEL", "MONITOR", MASTER, "127.0.0.1", &port, "1"];
    assert_eq!(direct(&sentinel.addr(), &monitor).await, "+OK\r\n");
    until!("the replica confirmed", confirmed(replica.addr())());
    let mut c = RawClient::connect(lg.addr).await;
    // Read as the connection opened (the periodic check is a minute away).
    until_primary_field(&mut c, "maxmemory_policy", "allkeys-lfu").await;
    let reply = c.call_s(&["SETNX", "lock:s:b", "1"]).await;
    assert_eq!(
        reply,
        format!(
            "-ERR lockgate: locks refused: maxmemory-policy is allkeys-lfu on the primary {} (locks.require_noeviction)\r\n",
            replica.addr()
        )
    );
    lg.stop().await;
}
