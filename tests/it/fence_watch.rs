//! `LOCKGATE WATCH key token [TIMEOUT ms]` (issue 45: a holder told its
//! lease is gone), against a real Redis and three real lock masters: it
//! returns `:1` when the lease runs out, when another connection releases
//! the lock, at once for a token that does not hold it, and nil at its
//! timeout while the lock is still held; on the quorum, once a majority of
//! masters no longer hold the token.

use crate::support;

use std::time::{Duration, Instant};

use lockgate::Config;
use support::quorum::Cluster;
use support::resp::call;
use support::{Lockgate, RawClient, RedisServer};

fn config(redis: &str) -> Config {
    let mut c = Config::default();
    c.upstream.addr = redis.to_string();
    c.proxy.shutdown_grace_ms = 300;
    c
}

/// `LOCKGATE LOCK key ttl`: the token.
async fn lock(c: &mut RawClient, key: &str, ttl: &str) -> String {
    let reply = call(c, &["LOCKGATE", "LOCK", key, ttl]).await;
    support::locks::fence_token(&reply).unwrap_or_else(|| panic!("{reply}"))
}

async fn watch(c: &mut RawClient, key: &str, token: &str, timeout_ms: &str) -> (String, Duration) {
    let started = Instant::now();
    let reply = call(c, &["LOCKGATE", "WATCH", key, token, "TIMEOUT", timeout_ms]).await;
    (reply, started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_returns_when_the_lease_is_gone_and_not_before() {
    let redis = RedisServer::start();
    let lg = Lockgate::start_with(config(&redis.addr())).await;
    let mut holder = RawClient::connect(lg.addr).await;
    let mut watcher = RawClient::connect(lg.addr).await;
    // Held through the timeout: nil.
    let token = lock(&mut holder, "lock:w", "10000").await;
    let (reply, took) = watch(&mut watcher, "lock:w", &token, "300").await;
    assert_eq!(reply, "$-1\r\n");
    assert!(took >= Duration::from_millis(300), "{took:?}");
    // Released by another connection: told within a step.
    let release = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut other = RawClient::connect(lg.addr).await;
        call(&mut other, &["LOCKGATE", "UNLOCK", "lock:w", &token]).await
    };
    let ((reply, took), released) =
        tokio::join!(watch(&mut watcher, "lock:w", &token, "5000"), release);
    assert_eq!(released, ":1\r\n");
    assert_eq!(reply, ":1\r\n");
    assert!(took < Duration::from_secs(3), "{took:?}");
    // The lease runs out: told after it, not before.
    let token = lock(&mut holder, "lock:w", "400").await;
    let (reply, took) = watch(&mut watcher, "lock:w", &token, "5000").await;
    assert_eq!(reply, ":1\r\n");
    assert!(
        took >= Duration::from_millis(300),
        "told before the lease ran out: {took:?}"
    );
    // Taken by the next holder: the old token is gone at once.
    let next = lock(&mut holder, "lock:w", "10000").await;
    assert_ne!(next, token);
    let (reply, took) = watch(&mut watcher, "lock:w", &token, "5000").await;
    assert_eq!(reply, ":1\r\n");
    assert!(took < Duration::from_secs(1), "{took:?}");
    let usage = call(&mut watcher, &["LOCKGATE", "WATCH", "lock:w"]).await;
    assert!(
        usage.starts_with("-ERR lockgate: usage: LOCKGATE WATCH"),
        "{usage}"
    );
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_quorum_a_watch_returns_once_a_majority_lost_the_token() {
    let q = Cluster::start(3, |_| {}).await;
    let mut holder = q.client().await;
    let mut watcher = q.client().await;
    let token = lock(&mut holder, "lock:qw", "10000").await;
    let (reply, _) = watch(&mut watcher, "lock:qw", &token, "200").await;
    assert_eq!(reply, "$-1\r\n", "held on every master");
    // One master loses it: a majority still holds it.
    assert_eq!(q.on_master(0, &["DEL", "lock:qw"]).await, ":1\r\n");
    let (reply, _) = watch(&mut watcher, "lock:qw", &token, "200").await;
    assert_eq!(reply, "$-1\r\n", "a majority still holds it");
    // A second: the lock is gone.
    assert_eq!(q.on_master(1, &["DEL", "lock:qw"]).await, ":1\r\n");
    let (reply, took) = watch(&mut watcher, "lock:qw", &token, "5000").await;
    assert_eq!(reply, ":1\r\n");
    assert!(took < Duration::from_secs(1), "{took:?}");
}
