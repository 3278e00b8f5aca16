//! Lock safety when a holder comes back late: a release without a token
//! cannot be told apart from a pooled holder's, so lockgate lets a
//! connection release (or extend) this instance's acquisitions only when
//! they were made after the connection opened. A holder whose pool
//! reconnected while it was paused past its lease cannot delete the next
//! holder's lock; its release waits for the lease instead. Against real
//! redis-server processes, with lockgate restarted in between too.

use crate::support;

use support::locks::{config, get, m, until_gone, Call};
use support::{Lockgate, RawClient, RedisServer};

/// Holder A acquires, is paused past its lease, B acquires, and A's late
/// DEL arrives on a connection its pool opened after that: refused, and
/// B's lock and owner record stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_release_on_a_reconnected_pool_connection_is_refused() {
    let redis = RedisServer::start();
    let lg = Lockgate::start_with(config(&redis.addr(), "safety", 30_000)).await;
    let mut r = RawClient::connect(redis.addr()).await;

    let mut a = RawClient::connect(lg.addr).await;
    assert_eq!(
        a.call(&["SET", "lock:late", "a", "NX", "PX", "200"]).await,
        "+OK\r\n"
    );
    until_gone(&mut r, "lock:late").await;
    drop(a);
    let mut b = RawClient::connect(lg.addr).await;
    assert_eq!(b.call(&["SETNX", "lock:late", "b"]).await, ":1\r\n");

    let mut a_again = RawClient::connect(lg.addr).await;
    assert_eq!(a_again.call(&["DEL", "lock:late"]).await, ":0\r\n");
    assert_eq!(a_again.call(&["EXPIRE", "lock:late", "1"]).await, ":0\r\n");
    assert_eq!(get(&mut r, "lock:late").await.as_deref(), Some("b"));
    assert_eq!(m(&lg.ctx.locks.metrics.stale_conn_denied), 2);
    // B's own release is its own, not a lapse.
    assert_eq!(b.call(&["DEL", "lock:late"]).await, ":1\r\n");
    assert_eq!(m(&lg.ctx.locks.metrics.lease_expired_before_release), 0);
}

/// The pooled rule keeps working where it is safe: a connection that was
/// open when another connection of the pool acquired may release it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_connection_open_before_the_acquisition_may_release_it() {
    let redis = RedisServer::start();
    let lg = Lockgate::start_with(config(&redis.addr(), "safety", 30_000)).await;
    let mut releaser = RawClient::connect(lg.addr).await;
    assert_eq!(releaser.call(&["PING"]).await, "+PONG\r\n");
    let mut acquirer = RawClient::connect(lg.addr).await;
    assert_eq!(acquirer.call(&["SETNX", "lock:pool", "x"]).await, ":1\r\n");
    assert_eq!(
        releaser.call(&["EXPIRE", "lock:pool", "60"]).await,
        ":1\r\n"
    );
    assert_eq!(releaser.call(&["DEL", "lock:pool"]).await, ":1\r\n");
}

/// The same across a restart of lockgate (same instance id): A acquired
/// through the old process, B through the new one; A's late DEL through
/// the new one is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_release_after_lockgate_restarted_is_refused() {
    let redis = RedisServer::start();
    let mut r = RawClient::connect(redis.addr()).await;
    let old = Lockgate::start_with(config(&redis.addr(), "safety", 30_000)).await;
    let mut a = RawClient::connect(old.addr).await;
    assert_eq!(
        a.call(&["SET", "lock:restart", "a", "NX", "PX", "200"])
            .await,
        "+OK\r\n"
    );
    drop(a);
    old.stop().await;
    let new = Lockgate::start_with(config(&redis.addr(), "safety", 30_000)).await;
    until_gone(&mut r, "lock:restart").await;
    let mut b = RawClient::connect(new.addr).await;
    assert_eq!(b.call(&["SETNX", "lock:restart", "b"]).await, ":1\r\n");
    let mut a_again = RawClient::connect(new.addr).await;
    assert_eq!(a_again.call(&["DEL", "lock:restart"]).await, ":0\r\n");
    assert_eq!(get(&mut r, "lock:restart").await.as_deref(), Some("b"));
}
