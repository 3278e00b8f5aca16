//! What may lose a lock on the primary, named and, where asked, refused
//! (issue 45, "unsafe upstreams named"), against real `redis-server`s:
//! replicas without `min-replicas-to-write` and no append-only file shown
//! by `LOCKGATE PRIMARY`, `/metrics` and `/status.json`, refused with
//! `locks.require_min_replicas` / `locks.require_persistence`, and served
//! again, without a restart, once `CONFIG SET` fixes each; a primary
//! restarted (another `run_id` at its address) holds acquisitions for
//! `locks.failover_delay_ms`, then grants them; a replica that accepts
//! writes (`replica-read-only no`) named and, with
//! `locks.require_one_primary`, refused until it is read-only again.

use crate::support;

use std::time::{Duration, Instant};

use support::locks::m;
use support::ops::{base_config, Ops};
use support::sentinel::Group;
use support::{RawClient, RedisServer};

async fn primary_field(c: &mut RawClient, name: &str) -> String {
    support::sentinel::primary_field(c, name).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_risk_is_named_refused_and_served_again_once_fixed() {
    let (primary, _replica) = Group::pair().await;
    let mut config = base_config(&primary.addr());
    config.locks.eviction_check_ms = 50;
    config.locks.require_min_replicas = true;
    config.locks.require_persistence = true;
    let lg = Ops::start(config).await;
    let mut app = lg.client().await;
    let mut admin = lg.client().await;
    let mut direct = RawClient::connect(primary.addr()).await;
    until!(
        "the primary's replication read",
        primary_field(&mut admin, "replicas").await == "1"
    );
    assert_eq!(
        primary_field(&mut admin, "min_replicas_to_write").await,
        "no"
    );
    assert_eq!(primary_field(&mut admin, "aof").await, "no");
    assert_eq!(
        primary_field(&mut admin, "unsafe").await,
        "replicas_without_min_replicas_to_write,no_aof"
    );
    let metrics = lg.metrics().await;
    let node = primary.addr();
    for (signal, want) in [
        ("replicas_without_min_replicas_to_write", 1.0),
        ("no_aof", 1.0),
        ("restarted", 0.0),
    ] {
        let labels = [
            ("role", "primary"),
            ("node", node.as_str()),
            ("signal", signal),
        ];
        let got = metrics.value("lockgate_upstream_unsafe", &labels);
        assert_eq!(got, want, "{signal}");
    }
    let refused = app.call_s(&["SETNX", "lock:s", "v"]).await;
    assert_eq!(
        refused,
        format!(
            "-ERR lockgate: locks refused on the primary {}: it has replicas and no min-replicas-to-write (locks.require_min_replicas)\r\n",
            primary.addr()
        )
    );
    assert_eq!(m(&lg.ctx.eviction.metrics.safety_refused), 1);
    let status = lg.status_json().await;
    assert_eq!(status["primary"]["aof"], "no", "{status}");
    // Each fixed on the Redis: the next reading serves locks again.
    let fix = ["CONFIG", "SET", "min-replicas-to-write", "1"];
    assert_eq!(direct.call_s(&fix).await, "+OK\r\n");
    until!(
        "min-replicas-to-write read",
        primary_field(&mut admin, "min_replicas_to_write").await == "yes"
    );
    let refused = app.call_s(&["SETNX", "lock:s", "v"]).await;
    assert!(
        refused.ends_with("it has no append-only file (locks.require_persistence)\r\n"),
        "{refused}"
    );
    assert_eq!(
        direct.call_s(&["CONFIG", "SET", "appendonly", "yes"]).await,
        "+OK\r\n"
    );
    until!(
        "the append-only file read",
        primary_field(&mut admin, "aof").await == "yes"
    );
    assert_eq!(app.call_s(&["SETNX", "lock:s", "v"]).await, ":1\r\n");
    assert_eq!(primary_field(&mut admin, "unsafe").await, "");
    // Releases always pass.
    assert_eq!(app.call_s(&["DEL", "lock:s"]).await, ":1\r\n");
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_accepting_writes_is_named_and_refused_until_read_only() {
    let (primary, replica) = Group::pair().await;
    let mut config = base_config(&primary.addr());
    config.locks.eviction_check_ms = 50;
    config.locks.require_one_primary = true;
    let lg = Ops::start(config).await;
    let mut app = lg.client().await;
    let mut admin = lg.client().await;
    let mut at_replica = RawClient::connect(replica.addr()).await;
    until!(
        "the primary's replication read",
        primary_field(&mut admin, "replicas").await == "1"
    );
    assert_eq!(app.call_s(&["SETNX", "lock:w", "v"]).await, ":1\r\n");
    assert_eq!(primary_field(&mut admin, "writable_replicas").await, "");
    // The replica takes writes: a second node of the set accepts them.
    let writable = ["CONFIG", "SET", "replica-read-only", "no"];
    assert_eq!(at_replica.call_s(&writable).await, "+OK\r\n");
    until!(
        "the writable replica named",
        primary_field(&mut admin, "writable_replicas").await == replica.addr()
    );
    assert!(
        (primary_field(&mut admin, "unsafe").await).contains("writable_replica"),
        "not in unsafe"
    );
    let labels = [
        ("role", "primary"),
        ("node", &primary.addr()),
        ("signal", "writable_replica"),
    ];
    assert_eq!(
        lg.metrics()
            .await
            .value("lockgate_upstream_unsafe", &labels),
        1.0
    );
    let status = lg.status_json().await;
    assert_eq!(
        status["primary"]["writable_replicas"][0],
        replica.addr().as_str(),
        "{status}"
    );
    assert_eq!(
        app.call_s(&["SETNX", "lock:w2", "v"]).await,
        format!(
            "-ERR lockgate: locks refused on the primary {}: its replica {} accepts writes, replica-read-only no (locks.require_one_primary)\r\n",
            primary.addr(),
            replica.addr()
        )
    );
    // Releases always pass.
    assert_eq!(app.call_s(&["DEL", "lock:w"]).await, ":1\r\n");
    // Read-only again: served at the next check, no restart.
    let fixed = ["CONFIG", "SET", "replica-read-only", "yes"];
    assert_eq!(at_replica.call_s(&fixed).await, "+OK\r\n");
    until!(
        "the replica read-only again",
        primary_field(&mut admin, "writable_replicas")
            .await
            .is_empty()
    );
    assert_eq!(app.call_s(&["SETNX", "lock:w2", "v"]).await, ":1\r\n");
    assert!(!(primary_field(&mut admin, "unsafe").await).contains("writable_replica"));
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_primary_holds_acquisitions_for_the_delay() {
    let mut redis = RedisServer::start();
    let mut config = base_config(&redis.addr());
    config.locks.failover_delay_ms = Some(1_500);
    let lg = Ops::start(config).await;
    let mut app = lg.client().await;
    let set = app
        .call_s(&["SET", "lock:r", "h", "NX", "PX", "60000"])
        .await;
    assert_eq!(set, "+OK\r\n");
    // lockgate's own connection must have read the first run: a restart
    // is another run_id at the same address, and on a loaded box that
    // connection may open after the client's (CI failed here once).
    let memory = &lg.ctx.primary_memory;
    until!("the first run read", memory.reading().is_some());
    // Restarted empty: the lock is gone, its holder does not know.
    tokio::task::block_in_place(|| redis.restart());
    let safety = &lg.ctx.primary_memory.safety;
    until!(
        "the restart seen",
        safety.restarts.load(std::sync::atomic::Ordering::Relaxed) == 1
    );
    let restarted = Instant::now();
    let mut app = lg.client().await;
    assert_eq!(
        app.call_s(&["SETNX", "lock:r", "o"]).await,
        ":0\r\n",
        "granted again at once"
    );
    let mut admin = lg.client().await;
    assert_eq!(primary_field(&mut admin, "restarts").await, "1");
    assert!(primary_field(&mut admin, "unsafe")
        .await
        .contains("restarted"));
    let refused = &lg.ctx.primary_addr.metrics.failover_refused;
    assert!(m(refused) >= 1);
    let deadline = Instant::now() + Duration::from_secs(10);
    while app.call_s(&["SETNX", "lock:r", "o"]).await != ":1\r\n" {
        assert!(Instant::now() < deadline, "never granted after the hold");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let held = restarted.elapsed();
    println!(
        "acquisitions held {} ms after the restart was seen (failover_delay_ms 1500)",
        held.as_millis()
    );
    assert!(held >= Duration::from_millis(1_000), "held only {held:?}");
    assert!(!primary_field(&mut admin, "unsafe")
        .await
        .contains("restarted"));
    lg.stop().await;
}
