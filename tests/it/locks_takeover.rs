//! Takeovers (GETSET, SET without NX, GETDEL, GETEX on a lock key), release
//! inside WATCH/MULTI, and the GETSET-timestamp lock recipe of the redis.io
//! SETNX page, end to end through lockgate against a real redis-server.

use crate::support;

use support::locks::*;
use support::{Lockgate, RawClient, RedisServer};

#[tokio::test]
async fn getset_takes_the_lock_over_and_keeps_the_lease() {
    let (_redis, lg, mut r) = setup("a", 20_000).await;
    let mut h = RawClient::connect(lg.addr).await;
    let mut t = RawClient::connect(lg.addr).await;

    assert_eq!(
        h.call(&["SET", "lock:t", "v1", "NX", "PX", "60000"]).await,
        "+OK\r\n"
    );
    let before = owner_of(&mut r, "lock:t")
        .await
        .expect("holder's owner record");
    assert_eq!(t.call(&["GETSET", "lock:t", "v2"]).await, bulk("v1"));
    assert_eq!(get(&mut r, "lock:t").await.as_deref(), Some("v2"));
    let after = owner_of(&mut r, "lock:t")
        .await
        .expect("taker's owner record");
    assert_ne!(before, after);
    assert!(after.starts_with("a:"), "{after}");
    // Lease kept: neither removed (GETSET alone would) nor reset to default.
    assert_lease(&mut r, "lock:t", 50_000, 60_000).await;
    assert_eq!(m(&lg.ctx.locks.metrics.takeovers), 1);

    // The lock is now the taker's: the old holder cannot release it.
    assert_eq!(h.call(&["DEL", "lock:t"]).await, ":0\r\n");
    assert_eq!(get(&mut r, "lock:t").await.as_deref(), Some("v2"));
    assert_eq!(t.call(&["DEL", "lock:t"]).await, ":1\r\n");
    assert!(!exists(&mut r, "lock:t").await);
    assert!(!exists(&mut r, &owner("lock:t")).await);
}

#[tokio::test]
async fn set_without_nx_gives_a_lease_and_getdel_getex_keep_the_record_right() {
    let (_redis, lg, mut r) = setup("a", 20_000).await;
    let mut c = RawClient::connect(lg.addr).await;

    // No TTL before: the default lease, and an owner record.
    assert_eq!(r.call(&["SET", "lock:plain", "x"]).await, "+OK\r\n");
    assert_eq!(pttl(&mut r, "lock:plain").await, -1);
    assert_eq!(c.call(&["SET", "lock:plain", "y"]).await, "+OK\r\n");
    assert_eq!(get(&mut r, "lock:plain").await.as_deref(), Some("y"));
    assert_lease(&mut r, "lock:plain", 19_000, 20_000).await;
    let token = owner_of(&mut r, "lock:plain").await.expect("owner record");
    assert!(token.starts_with("a:"), "{token}");
    // A TTL given with SET is the client's; KEEPTTL keeps it.
    assert_eq!(
        c.call(&["SET", "lock:plain", "z", "EX", "50"]).await,
        "+OK\r\n"
    );
    assert_lease(&mut r, "lock:plain", 49_000, 50_000).await;
    assert_eq!(
        c.call(&["SET", "lock:plain", "k", "KEEPTTL"]).await,
        "+OK\r\n"
    );
    assert_lease(&mut r, "lock:plain", 48_000, 50_000).await;
    // SET … GET on a lock key answers the old value.
    assert_eq!(c.call(&["SET", "lock:plain", "g", "GET"]).await, bulk("k"));
    assert_lease(&mut r, "lock:plain", 47_000, 50_000).await;
    // GETSET on a missing lock key: nil, and a default lease.
    assert_eq!(c.call(&["GETSET", "lock:new", "n"]).await, "$-1\r\n");
    assert_lease(&mut r, "lock:new", 19_000, 20_000).await;

    // GETEX: PERSIST cannot strip the lease; EX moves both keys.
    assert_eq!(c.call(&["GETEX", "lock:plain", "PERSIST"]).await, bulk("g"));
    assert_lease(&mut r, "lock:plain", 46_000, 50_000).await;
    assert_eq!(
        c.call(&["GETEX", "lock:plain", "EX", "90"]).await,
        bulk("g")
    );
    assert_lease(&mut r, "lock:plain", 89_000, 90_000).await;

    // GETDEL removes the lock and its owner record.
    assert_eq!(c.call(&["GETDEL", "lock:plain"]).await, bulk("g"));
    assert!(!exists(&mut r, "lock:plain").await);
    assert!(!exists(&mut r, &owner("lock:plain")).await);
    assert_eq!(c.call(&["GETDEL", "lock:plain"]).await, "$-1\r\n");
    assert!(!exists(&mut r, &owner("lock:plain")).await);
}

#[tokio::test]
async fn owner_releases_inside_watch_multi() {
    let (_redis, lg, mut r) = setup("a", 20_000).await;
    let mut c = RawClient::connect(lg.addr).await;

    assert_eq!(c.call(&["SETNX", "lock:w", "me"]).await, ":1\r\n");
    assert_eq!(c.call(&["WATCH", "lock:w"]).await, "+OK\r\n");
    assert_eq!(c.call(&["GET", "lock:w"]).await, bulk("me"));
    assert_eq!(c.call(&["MULTI"]).await, "+OK\r\n");
    assert_eq!(c.call(&["DEL", "lock:w"]).await, "+QUEUED\r\n");
    assert_eq!(c.call(&["EXEC"]).await, "*1\r\n:1\r\n");
    assert!(!exists(&mut r, "lock:w").await);
    assert!(!exists(&mut r, &owner("lock:w")).await);

    // WATCH still aborts when the lock changes under it.
    assert_eq!(c.call(&["SETNX", "lock:w", "me"]).await, ":1\r\n");
    assert_eq!(c.call(&["WATCH", "lock:w"]).await, "+OK\r\n");
    assert_eq!(
        r.call(&["SET", "lock:w", "other", "KEEPTTL"]).await,
        "+OK\r\n"
    );
    assert_eq!(c.call(&["MULTI"]).await, "+OK\r\n");
    assert_eq!(c.call(&["DEL", "lock:w"]).await, "+QUEUED\r\n");
    assert_eq!(c.call(&["EXEC"]).await, "*-1\r\n");
    assert_eq!(get(&mut r, "lock:w").await.as_deref(), Some("other"));
}

/// [`setup`] for the GETSET recipe, whose lock key is `lock.foo`.
async fn recipe_setup() -> (RedisServer, Lockgate, RawClient) {
    setup_with("a", 60_000, |c| c.locks.keys.push("lock.*".into())).await
}

/// The GETSET recipe of https://redis.io/commands/setnx (lock.foo holding
/// an expiry Unix timestamp), one contender.
#[tokio::test]
async fn getset_timestamp_recipe_works_end_to_end() {
    let (_redis, lg, mut r) = recipe_setup().await;
    let mut c1 = RawClient::connect(lg.addr).await;
    let mut c2 = RawClient::connect(lg.addr).await;

    // C1 took the lock and "crashed": its timestamp is in the past.
    let stale = (now_s() - 10).to_string();
    assert_eq!(c1.call(&["SETNX", "lock.foo", &stale]).await, ":1\r\n");
    let c1_token = owner_of(&mut r, "lock.foo").await.expect("owner record");
    drop(c1);

    let fresh = (now_s() + 61).to_string();
    assert_eq!(c2.call(&["SETNX", "lock.foo", &fresh]).await, ":0\r\n");
    let seen = get(&mut c2, "lock.foo").await.expect("a timestamp");
    assert!(seen.parse::<u64>().unwrap() < now_s(), "expired");
    assert_eq!(c2.call(&["GETSET", "lock.foo", &fresh]).await, bulk(&seen));
    // The old value was the expired one: C2 has the lock.
    assert_eq!(
        get(&mut r, "lock.foo").await.as_deref(),
        Some(fresh.as_str())
    );
    let c2_token = owner_of(&mut r, "lock.foo").await.expect("owner record");
    assert_ne!(c1_token, c2_token);
    assert_lease(&mut r, "lock.foo", 50_000, 60_000).await;

    // Before DEL the recipe checks its timestamp is still in the future.
    let mine = get(&mut c2, "lock.foo").await.expect("my timestamp");
    assert!(mine.parse::<u64>().unwrap() > now_s());
    assert_eq!(c2.call(&["DEL", "lock.foo"]).await, ":1\r\n");
    assert!(!exists(&mut r, "lock.foo").await);
    assert!(!exists(&mut r, &owner("lock.foo")).await);
}

/// The same recipe with the race it was written for: C3 also saw the stale
/// timestamp and does its GETSET just after C2. C3 gets C2's (future)
/// timestamp back, so it knows it lost; C2 holds the lock and must still be
/// able to release it, as on plain Redis.
#[tokio::test]
async fn getset_timestamp_recipe_losing_getset_does_not_steal_the_release() {
    let (_redis, lg, mut r) = recipe_setup().await;
    let mut c1 = RawClient::connect(lg.addr).await;
    let mut c2 = RawClient::connect(lg.addr).await;
    let mut c3 = RawClient::connect(lg.addr).await;

    let stale = (now_s() - 10).to_string();
    assert_eq!(c1.call(&["SETNX", "lock.foo", &stale]).await, ":1\r\n");
    drop(c1);
    let t2 = (now_s() + 61).to_string();
    let t3 = (now_s() + 62).to_string();
    assert_eq!(c2.call(&["SETNX", "lock.foo", &t2]).await, ":0\r\n");
    assert_eq!(c3.call(&["SETNX", "lock.foo", &t3]).await, ":0\r\n");
    assert_eq!(c2.call(&["GETSET", "lock.foo", &t2]).await, bulk(&stale));
    // C3 gets a timestamp in the future back: not acquired, it backs off.
    assert_eq!(c3.call(&["GETSET", "lock.foo", &t3]).await, bulk(&t2));

    // C2, the holder, finishes and releases.
    assert_eq!(
        c2.call(&["DEL", "lock.foo"]).await,
        ":1\r\n",
        "the holder's DEL was refused after a loser's GETSET (owner record: {:?})",
        owner_of(&mut r, "lock.foo").await
    );
    assert!(!exists(&mut r, "lock.foo").await);
}
