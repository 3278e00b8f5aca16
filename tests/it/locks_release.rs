//! Owner-checked DEL/UNLINK of lock keys through lockgate against a real
//! redis-server ("Who may release" in docs/behaviour.md): the acquiring connection
//! releases only its own acquisition, other connections only this
//! instance's, keys without owner record are plain data.

use crate::support;

use support::locks::*;
use support::{Lockgate, RawClient, RedisServer};

/// A acquires with a 300 ms lease, the lease runs out, B acquires with a
/// long TTL; A's `verb` must not delete B's lock, and a connection C that
/// never acquired the key may.
async fn lapsed_owner_cannot_release_next_holder(verb: &str) {
    let (_redis, lg, mut r) = setup("a", 300).await;
    let mut a = RawClient::connect(lg.addr).await;
    let mut b = RawClient::connect(lg.addr).await;
    let mut c = RawClient::connect(lg.addr).await;

    assert_eq!(a.call(&["SETNX", "lock:x", "va"]).await, ":1\r\n");
    until!("A's lease to run out", !exists(&mut r, "lock:x").await);
    assert!(!exists(&mut r, &owner("lock:x")).await);
    assert_eq!(
        b.call(&["SET", "lock:x", "vb", "NX", "PX", "60000"]).await,
        "+OK\r\n"
    );
    let b_token = owner_of(&mut r, "lock:x").await.expect("B's owner record");

    assert_eq!(a.call(&[verb, "lock:x"]).await, ":0\r\n");
    assert_eq!(get(&mut r, "lock:x").await.as_deref(), Some("vb"));
    assert_eq!(owner_of(&mut r, "lock:x").await.as_ref(), Some(&b_token));
    assert_lease(&mut r, "lock:x", 50_000, 60_000).await;
    let l = &lg.ctx.locks.metrics;
    assert_eq!(m(&l.release_denied), 1);
    assert_eq!(m(&l.lease_expired_before_release), 1);
    assert_eq!(m(&l.released), 0);

    // C never acquired lock:x; B's acquisition was made through this instance.
    assert_eq!(c.call(&[verb, "lock:x"]).await, ":1\r\n");
    assert!(!exists(&mut r, "lock:x").await);
    assert!(!exists(&mut r, &owner("lock:x")).await);
    assert_eq!((m(&l.released), m(&l.release_denied)), (1, 1));
    // B now finds nothing to release.
    assert_eq!(b.call(&[verb, "lock:x"]).await, ":0\r\n");
}

#[tokio::test]
async fn del_by_a_lapsed_owner_is_refused() {
    lapsed_owner_cannot_release_next_holder("DEL").await;
}

#[tokio::test]
async fn unlink_by_a_lapsed_owner_is_refused() {
    lapsed_owner_cannot_release_next_holder("UNLINK").await;
}

#[tokio::test]
async fn the_owner_releases_its_own_lock() {
    let (_redis, lg, mut r) = setup("a", 20_000).await;
    let mut a = RawClient::connect(lg.addr).await;
    for verb in ["DEL", "unlink"] {
        assert_eq!(a.call(&["SETNX", "lock:o", "v"]).await, ":1\r\n");
        assert_eq!(a.call(&[verb, "lock:o"]).await, ":1\r\n");
        assert!(!exists(&mut r, "lock:o").await);
        assert!(!exists(&mut r, &owner("lock:o")).await);
        assert_eq!(a.call(&[verb, "lock:o"]).await, ":0\r\n");
    }
    let l = &lg.ctx.locks.metrics;
    assert_eq!((m(&l.released), m(&l.release_denied)), (2, 0));
    assert_eq!(m(&l.lease_expired_before_release), 0);
}

#[tokio::test]
async fn another_instances_lock_is_not_released_by_a_stranger() {
    let redis = RedisServer::start();
    let lga = Lockgate::start_with(config(&redis.addr(), "a", 60_000)).await;
    let lgb = Lockgate::start_with(config(&redis.addr(), "b", 60_000)).await;
    let mut r = RawClient::connect(redis.addr()).await;
    let mut b1 = RawClient::connect(lgb.addr).await;
    let mut a1 = RawClient::connect(lga.addr).await;
    let mut b2 = RawClient::connect(lgb.addr).await;
    // b2 is open before b1 acquires (the pooled rule).
    assert_eq!(b2.call(&["PING"]).await, "+PONG\r\n");

    assert_eq!(b1.call(&["SETNX", "lock:two", "v"]).await, ":1\r\n");
    let token = owner_of(&mut r, "lock:two").await.expect("owner record");
    assert!(token.starts_with("b:"), "{token}");

    for verb in ["DEL", "UNLINK"] {
        assert_eq!(a1.call(&[verb, "lock:two"]).await, ":0\r\n");
    }
    assert_eq!(a1.call(&["EXPIRE", "lock:two", "5"]).await, ":0\r\n");
    assert_eq!(get(&mut r, "lock:two").await.as_deref(), Some("v"));
    assert_eq!(owner_of(&mut r, "lock:two").await.as_ref(), Some(&token));
    assert_lease(&mut r, "lock:two", 50_000, 60_000).await;
    let la = &lga.ctx.locks.metrics;
    assert_eq!((m(&la.release_denied), m(&la.extend_denied)), (2, 1));
    // A stranger is not a lapsed owner.
    assert_eq!(m(&la.lease_expired_before_release), 0);

    // Mixed with ordinary keys: those are deleted, the lock is not.
    assert_eq!(
        r.call(&["MSET", "user:3", "x", "user:4", "y"]).await,
        "+OK\r\n"
    );
    assert_eq!(
        a1.call(&["DEL", "lock:two", "user:3", "user:4"]).await,
        ":2\r\n"
    );
    assert_eq!(
        int_of(&mut r, &["EXISTS", "lock:two", "user:3", "user:4"]).await,
        1
    );

    // A stranger on the acquiring instance may release it.
    assert_eq!(b2.call(&["DEL", "lock:two"]).await, ":1\r\n");
    assert!(!exists(&mut r, "lock:two").await);
    assert!(!exists(&mut r, &owner("lock:two")).await);
    assert_eq!(m(&lgb.ctx.locks.metrics.released), 1);
}

#[tokio::test]
async fn keys_without_owner_record_and_mixed_del() {
    let (_redis, lg, mut r) = setup("a", 20_000).await;
    let mut c = RawClient::connect(lg.addr).await;

    // Set directly on Redis: plain data, deleted as before.
    assert_eq!(r.call(&["SET", "lock:raw", "x"]).await, "+OK\r\n");
    assert_eq!(c.call(&["DEL", "lock:raw"]).await, ":1\r\n");
    assert!(!exists(&mut r, "lock:raw").await);
    assert_eq!(r.call(&["SET", "lock:raw", "x"]).await, "+OK\r\n");
    assert_eq!(c.call(&["UNLINK", "lock:raw"]).await, ":1\r\n");
    assert!(!exists(&mut r, "lock:raw").await);

    // One DEL mixing an own lock, a raw lock key, ordinary keys and a
    // missing key: the sum.
    assert_eq!(c.call(&["SETNX", "lock:mx", "v"]).await, ":1\r\n");
    assert_eq!(
        r.call(&["MSET", "user:1", "a", "user:2", "b", "x:lock", "r"])
            .await,
        "+OK\r\n"
    );
    let reply = c
        .call(&[
            "DEL",
            "user:1",
            "lock:mx",
            "user:2",
            "x:lock",
            "lock:none",
            "user:none",
        ])
        .await;
    assert_eq!(reply, ":4\r\n");
    assert_eq!(
        int_of(
            &mut r,
            &[
                "EXISTS",
                "user:1",
                "lock:mx",
                "user:2",
                "x:lock",
                &owner("lock:mx")
            ]
        )
        .await,
        0
    );
    assert_eq!(int_of(&mut r, &["DBSIZE"]).await, 0);
    assert_eq!(m(&lg.ctx.locks.metrics.released), 1);
}

#[tokio::test]
async fn ownership_any_deletes_anyones_lock() {
    let redis = RedisServer::start();
    let lgb = Lockgate::start_with(config(&redis.addr(), "b", 60_000)).await;
    let mut any = config(&redis.addr(), "c", 60_000);
    any.locks.ownership = lockgate::config::Ownership::Any;
    let lgc = Lockgate::start_with(any).await;
    let mut r = RawClient::connect(redis.addr()).await;
    let mut b1 = RawClient::connect(lgb.addr).await;
    let mut c1 = RawClient::connect(lgc.addr).await;

    assert_eq!(b1.call(&["SETNX", "lock:any", "v"]).await, ":1\r\n");
    assert_eq!(c1.call(&["PEXPIRE", "lock:any", "90000"]).await, ":1\r\n");
    assert_lease(&mut r, "lock:any", 89_000, 90_000).await;
    assert_eq!(c1.call(&["DEL", "lock:any"]).await, ":1\r\n");
    assert!(!exists(&mut r, "lock:any").await);
    assert!(!exists(&mut r, &owner("lock:any")).await);

    // A lapsed owner under `any` deletes the next holder's lock (legacy).
    assert_eq!(
        c1.call(&["SET", "lock:any", "c", "NX", "PX", "300"]).await,
        "+OK\r\n"
    );
    until!("the lease to run out", !exists(&mut r, "lock:any").await);
    assert_eq!(b1.call(&["SETNX", "lock:any", "b"]).await, ":1\r\n");
    assert_eq!(c1.call(&["UNLINK", "lock:any"]).await, ":1\r\n");
    assert!(!exists(&mut r, "lock:any").await);
    assert_eq!(m(&lgc.ctx.locks.metrics.release_denied), 0);
}

/// Connection pools: a thread acquires on one pooled connection and
/// releases (or extends) on another, which may have tried the same key
/// earlier and lost. That connection never acquired the key, so (docs/behaviour.md,
/// "Who may release") it may act on an acquisition made through this
/// instance.
async fn pooled_connection_that_lost(lost_in_multi: bool, args: &[&str]) {
    let (_redis, lg, mut r) = setup("a", 60_000).await;
    let mut y = RawClient::connect(lg.addr).await;
    let mut x = RawClient::connect(lg.addr).await;
    // The pool's connections are open before the acquisition.
    assert_eq!(x.call(&["PING"]).await, "+PONG\r\n");

    assert_eq!(y.call(&["SETNX", "lock:pool", "t1"]).await, ":1\r\n");
    // Another thread spun on x and lost.
    if lost_in_multi {
        assert_eq!(x.call(&["MULTI"]).await, "+OK\r\n");
        assert_eq!(x.call(&["SETNX", "lock:pool", "t2"]).await, "+QUEUED\r\n");
        assert_eq!(x.call(&["EXPIRE", "lock:pool", "10"]).await, "+QUEUED\r\n");
        assert_eq!(x.call(&["EXEC"]).await, "*2\r\n:0\r\n:0\r\n");
    } else {
        assert_eq!(x.call(&["SETNX", "lock:pool", "t2"]).await, ":0\r\n");
    }
    // The holder's thread now gets x from the pool.
    assert_eq!(
        x.call(args).await,
        ":1\r\n",
        "{args:?} on a connection that only lost an attempt on the key was refused"
    );
    match args[0] {
        "DEL" => assert!(!exists(&mut r, "lock:pool").await),
        _ => assert_lease(&mut r, "lock:pool", 89_000, 90_000).await,
    }
    let l = &lg.ctx.locks.metrics;
    assert_eq!((m(&l.release_denied), m(&l.extend_denied)), (0, 0));
}

#[tokio::test]
async fn a_pooled_connection_that_lost_may_release_the_holders_lock() {
    pooled_connection_that_lost(false, &["DEL", "lock:pool"]).await;
}

/// Releasing is allowed after a lost attempt (pooled apps), but extending
/// is not: a client whose SETNX lost must not extend the
/// holder's lease, in the pipelined, MULTI and separate-command forms alike.
#[tokio::test]
async fn a_connection_that_lost_may_not_extend_the_holders_lock() {
    let (_redis, lg, mut r) = setup("a", 60_000).await;
    let mut y = RawClient::connect(lg.addr).await;
    let mut x = RawClient::connect(lg.addr).await;
    assert_eq!(y.call(&["SETNX", "lock:pool", "t1"]).await, ":1\r\n");
    assert_eq!(x.call(&["SETNX", "lock:pool", "t2"]).await, ":0\r\n");
    assert_eq!(x.call(&["PEXPIRE", "lock:pool", "90000"]).await, ":0\r\n");
    assert_lease(&mut r, "lock:pool", 55_000, 60_000).await;
    assert_eq!(m(&lg.ctx.locks.metrics.extend_denied), 1);
    assert_eq!(m(&lg.ctx.locks.metrics.lease_expired_before_release), 0);
}

#[tokio::test]
async fn a_connection_that_lost_in_multi_may_release_the_holders_lock() {
    pooled_connection_that_lost(true, &["DEL", "lock:pool"]).await;
}

/// `DEL k k` deletes k once, as on Redis; it is neither a denial nor a
/// lapsed lease.
#[tokio::test]
async fn del_naming_an_own_lock_twice_is_not_a_denial() {
    let (_redis, lg, mut r) = setup("a", 60_000).await;
    let mut c = RawClient::connect(lg.addr).await;
    let l = &lg.ctx.locks.metrics;

    assert_eq!(c.call(&["SETNX", "lock:d", "v"]).await, ":1\r\n");
    assert_eq!(c.call(&["DEL", "lock:d", "lock:d"]).await, ":1\r\n");
    assert!(!exists(&mut r, "lock:d").await);
    assert!(!exists(&mut r, &owner("lock:d")).await);
    assert_eq!(m(&l.released), 1);
    assert_eq!(
        (m(&l.release_denied), m(&l.lease_expired_before_release)),
        (0, 0),
        "(release_denied, lease_expired_before_release) after DEL lock:d lock:d by its owner"
    );
}

/// A second DEL pipelined behind the owner's release finds nothing, as
/// the same two DELs sent one by one do: no denial either way.
#[tokio::test]
async fn a_pipelined_second_del_of_a_released_lock_is_not_a_denial() {
    let redis = RedisServer::start();
    let lg = Lockgate::start_with(config(&redis.addr(), "a", 60_000)).await;
    let mut c = RawClient::connect(lg.addr).await;
    let l = &lg.ctx.locks.metrics;

    assert_eq!(c.call(&["SETNX", "lock:d", "v"]).await, ":1\r\n");
    assert_eq!(c.call(&["DEL", "lock:d"]).await, ":1\r\n");
    assert_eq!(c.call(&["DEL", "lock:d"]).await, ":0\r\n");
    assert_eq!((m(&l.released), m(&l.release_denied)), (1, 0));

    let mut out = support::cmd(&["SETNX", "lock:d", "v"]);
    out.extend(support::cmd(&["DEL", "lock:d"]));
    out.extend(support::cmd(&["DEL", "lock:d"]));
    c.send(&out).await;
    assert_eq!(c.reply().await, ":1\r\n");
    assert_eq!(c.reply().await, ":1\r\n");
    assert_eq!(c.reply().await, ":0\r\n");
    assert_eq!(m(&l.released), 2);
    assert_eq!(
        m(&l.release_denied),
        0,
        "release_denied after a pipelined second DEL of an already released lock"
    );
}
