//! What lockgate forwards and Redis acknowledges moves its view of lock
//! keys (docs/behaviour.md, "How stale the local view may be"): after a
//! flush, a `SWAPDB`, a `MOVE`, a `RENAME`/`RENAMENX`/`COPY` of or onto a
//! lock key sent through lockgate, another connection's attempt right after
//! gets Redis's answer, not one from what lockgate knew before; a lock in
//! another database (`SELECT`) neither answers nor hands over attempts in
//! database 0; `SCRIPT FLUSH` makes every connection load the lock scripts
//! again once Redis ran it; a client script that lists keys drops the
//! whole view. Against real redis-servers.
//!
//! The probe interval is a minute, longer than any test: a key known held
//! is answered from the view for the whole test unless something drops it,
//! so a stale answer cannot be hidden by a probe that happened to fall in
//! between (each test first checks that the view is what answers).

use crate::support;

use support::locks::*;
use support::quorum::{Cluster, NIL};
use support::{cmd, eventually, Lockgate, RawClient, RedisServer};

const PROBE_MS: u64 = 60_000;
const OK: &str = "+OK\r\n";

/// A fresh Redis, lockgate in front of it (30 s leases, a probe interval
/// of a minute, `park_ms` 50 as by default) and a connection straight to
/// Redis.
async fn start(park_ms: u64) -> (RedisServer, Lockgate, RawClient) {
    setup_with("view", 30_000, |c| {
        c.locks.retry.probe_interval_ms = PROBE_MS;
        c.locks.retry.park_ms = park_ms;
    })
    .await
}

/// Attempts answered from lockgate's view so far.
fn absorbed(lg: &Lockgate) -> u64 {
    m(&lg.ctx.locks.storm.metrics.absorbed)
}

/// Commands whose acknowledgement dropped the view so far.
fn forgets(lg: &Lockgate) -> u64 {
    m(&lg.ctx.locks.metrics.view_forgets)
}

/// Connection `a` acquires `key` through lockgate, then `b`'s attempt is
/// answered "not acquired" from the view (counted as absorbed): what the
/// test then checks is that view.
async fn held_in_view(lg: &Lockgate, a: &mut RawClient, b: &mut RawClient, key: &str) {
    assert_eq!(a.call(&["SETNX", key, "a"]).await, ":1\r\n", "{key}");
    let before = absorbed(lg);
    assert_eq!(b.call(&["SET", key, "b", "NX"]).await, NIL, "{key}");
    assert_eq!(absorbed(lg), before + 1, "{key}: answered from the view");
}

/// `b`'s attempt on `key`, which Redis no longer has, acquires it: the
/// reply is Redis's and the value is `b`'s.
async fn acquires(b: &mut RawClient, r: &mut RawClient, key: &str, after: &str) {
    assert!(!exists(r, key).await, "{after}: {key} is gone on Redis");
    assert_eq!(
        b.call(&["SET", key, "b", "NX"]).await,
        OK,
        "{after}: an attempt on {key} right after gets Redis's answer"
    );
    assert_eq!(get(r, key).await.as_deref(), Some("b"), "{after}");
}

/// Every flush and `SWAPDB` through lockgate frees the locks it held in
/// its view: the next attempt on another connection acquires.
#[tokio::test]
async fn a_flush_through_lockgate_frees_what_its_view_held() {
    let cases: &[&[&str]] = &[
        &["FLUSHDB"],
        &["FLUSHDB", "ASYNC"],
        &["flushdb", "SYNC"],
        &["FLUSHALL"],
        &["FLUSHALL", "ASYNC"],
        &["FLUSHALL", "SYNC"],
        &["SWAPDB", "0", "1"],
    ];
    for flush in cases {
        let what = flush.join(" ");
        let (_redis, lg, mut r) = start(50).await;
        let (mut a, mut b) = (
            RawClient::connect(lg.addr).await,
            RawClient::connect(lg.addr).await,
        );
        held_in_view(&lg, &mut a, &mut b, "lock:x").await;
        held_in_view(&lg, &mut a, &mut b, "lock:y").await;
        assert_eq!(a.call(flush).await, OK, "{what}");
        acquires(&mut b, &mut r, "lock:x", &what).await;
        acquires(&mut b, &mut r, "lock:y", &what).await;
        assert_eq!(forgets(&lg), 1, "{what}");
        lg.stop().await;
    }
}

/// A value leaving a lock key (`RENAME`, `RENAMENX`, `MOVE` to another
/// database, `RENAME` onto another lock key) frees it at once; the key it
/// went to, if a lock key, is held, as on Redis.
#[tokio::test]
async fn a_lock_key_renamed_or_moved_away_is_free_at_once() {
    let cases: &[(&[&str], Option<&str>)] = &[
        (&["RENAME", "lock:x", "user:1"], None),
        (&["RENAMENX", "lock:x", "user:1"], None),
        (&["MOVE", "lock:x", "1"], None),
        (&["RENAME", "lock:x", "lock:y"], Some("lock:y")),
    ];
    for (command, to) in cases {
        let what = command.join(" ");
        let (_redis, lg, mut r) = start(50).await;
        let (mut a, mut b) = (
            RawClient::connect(lg.addr).await,
            RawClient::connect(lg.addr).await,
        );
        held_in_view(&lg, &mut a, &mut b, "lock:x").await;
        let reply = a.call(command).await;
        assert!(reply == OK || reply == ":1\r\n", "{what}: {reply}");
        acquires(&mut b, &mut r, "lock:x", &what).await;
        if let Some(to) = to {
            assert_eq!(b.call(&["SET", to, "b", "NX"]).await, NIL, "{what}");
            assert_eq!(get(&mut r, to).await.as_deref(), Some("a"), "{what}");
        }
        lg.stop().await;
    }
}

/// A client script that lists keys (`KEYS` or `SCAN`) may delete lock
/// keys it was not given (python-redis-lock's `reset_all`): once it ran,
/// sent with `EVAL` or loaded and sent with `EVALSHA`, the next attempt on
/// another connection gets Redis's answer. A script that names the key
/// only among its arguments is not read: the view stays (noticed within
/// the probe interval, as any change made behind lockgate's back).
#[tokio::test]
async fn a_script_that_lists_keys_frees_what_its_view_held() {
    const RESET: &str = "local n = 0 for _, k in ipairs(redis.call('KEYS', 'lock:*')) do \
                         n = n + redis.call('DEL', k) end return n";
    const SCAN: &str = "local r = redis.pcall( \"scan\", 0, 'MATCH', 'lock:*', 'COUNT', 1000) \
                        for _, k in ipairs(r[2]) do redis.call('del', k) end return #r[2]";
    for (way, body) in [("EVAL", RESET), ("EVALSHA", SCAN)] {
        let (_redis, lg, mut r) = start(50).await;
        let (mut a, mut b) = (
            RawClient::connect(lg.addr).await,
            RawClient::connect(lg.addr).await,
        );
        held_in_view(&lg, &mut a, &mut b, "lock:x").await;
        held_in_view(&lg, &mut a, &mut b, "lock:y").await;
        let reply = if way == "EVAL" {
            a.call(&["EVAL", body, "0"]).await
        } else {
            let loaded = a.call(&["SCRIPT", "LOAD", body]).await;
            let sha = loaded.lines().nth(1).expect("a SHA1").to_string();
            a.call(&["EVALSHA", &sha, "0"]).await
        };
        assert_eq!(reply, ":2\r\n", "{way}");
        acquires(&mut b, &mut r, "lock:x", way).await;
        acquires(&mut b, &mut r, "lock:y", way).await;
        assert_eq!(forgets(&lg), 1, "{way}");
        lg.stop().await;
    }
    let (_redis, lg, mut r) = start(50).await;
    let (mut a, mut b) = (
        RawClient::connect(lg.addr).await,
        RawClient::connect(lg.addr).await,
    );
    held_in_view(&lg, &mut a, &mut b, "lock:x").await;
    let by_name = "return redis.call('DEL', ARGV[1])";
    assert_eq!(a.call(&["EVAL", by_name, "0", "lock:x"]).await, ":1\r\n");
    assert!(!exists(&mut r, "lock:x").await);
    assert_eq!(
        b.call(&["SET", "lock:x", "b", "NX"]).await,
        NIL,
        "the view stays"
    );
    assert_eq!(forgets(&lg), 0);
    lg.stop().await;
}

/// A value arriving at a lock key (`RENAME`, `COPY … REPLACE`, `COPY …
/// DB 0 REPLACE` from another database) brings its own short expiry: once
/// it ran out on Redis, the next attempt acquires, though the view had
/// the lock held for 30 s.
#[tokio::test]
async fn a_short_value_renamed_or_copied_onto_a_lock_key_ends_when_redis_says() {
    let cases: &[(&str, &[&str])] = &[
        ("0", &["RENAME", "tmp", "lock:x"]),
        ("0", &["COPY", "tmp", "lock:x", "REPLACE"]),
        ("1", &["COPY", "tmp", "lock:x", "DB", "0", "REPLACE"]),
    ];
    for (db, command) in cases {
        let what = format!("{} (in db {db})", command.join(" "));
        let (_redis, lg, mut r) = start(50).await;
        let (mut a, mut b) = (
            RawClient::connect(lg.addr).await,
            RawClient::connect(lg.addr).await,
        );
        held_in_view(&lg, &mut a, &mut b, "lock:x").await;
        let mut c = RawClient::connect(lg.addr).await;
        assert_eq!(c.call(&["SELECT", db]).await, OK);
        assert_eq!(c.call(&["SET", "tmp", "t", "PX", "300"]).await, OK);
        let reply = c.call(command).await;
        assert!(reply == OK || reply == ":1\r\n", "{what}: {reply}");
        let lease = pttl(&mut r, "lock:x").await;
        assert!((1..=300).contains(&lease), "{what}: PTTL {lease}");
        until_gone(&mut r, "lock:x").await;
        acquires(&mut b, &mut r, "lock:x", &what).await;
        lg.stop().await;
    }
}

/// A lock key copied elsewhere stays held where it was: the attempt after
/// the copy is refused, as by Redis.
#[tokio::test]
async fn a_lock_key_copied_away_stays_held() {
    for command in [
        &["COPY", "lock:x", "user:1"][..],
        &["COPY", "lock:x", "lock:y", "DB", "1"],
    ] {
        let what = command.join(" ");
        let (_redis, lg, mut r) = start(50).await;
        let (mut a, mut b) = (
            RawClient::connect(lg.addr).await,
            RawClient::connect(lg.addr).await,
        );
        held_in_view(&lg, &mut a, &mut b, "lock:x").await;
        assert_eq!(a.call(command).await, ":1\r\n", "{what}");
        assert_eq!(b.call(&["SET", "lock:x", "b", "NX"]).await, NIL, "{what}");
        assert_eq!(get(&mut r, "lock:x").await.as_deref(), Some("a"), "{what}");
        lg.stop().await;
    }
}

/// A flush queued in a transaction frees the locks at its `EXEC`; one
/// discarded frees nothing.
#[tokio::test]
async fn a_flush_in_a_transaction_frees_them_at_its_exec() {
    let (_redis, lg, mut r) = start(50).await;
    let (mut a, mut b) = (
        RawClient::connect(lg.addr).await,
        RawClient::connect(lg.addr).await,
    );
    held_in_view(&lg, &mut a, &mut b, "lock:x").await;
    assert_eq!(a.call(&["MULTI"]).await, OK);
    assert_eq!(a.call(&["FLUSHDB"]).await, "+QUEUED\r\n");
    assert_eq!(a.call(&["DISCARD"]).await, OK);
    assert_eq!(
        b.call(&["SET", "lock:x", "b", "NX"]).await,
        NIL,
        "discarded"
    );
    assert_eq!(get(&mut r, "lock:x").await.as_deref(), Some("a"));

    assert_eq!(a.call(&["MULTI"]).await, OK);
    assert_eq!(a.call(&["FLUSHDB"]).await, "+QUEUED\r\n");
    assert_eq!(a.call(&["PING"]).await, "+QUEUED\r\n");
    assert_eq!(a.call(&["EXEC"]).await, "*2\r\n+OK\r\n+PONG\r\n");
    acquires(&mut b, &mut r, "lock:x", "MULTI FLUSHDB EXEC").await;
    lg.stop().await;
}

/// A flush sent while `CLIENT REPLY OFF` (no reply to wait for) frees them
/// too, from when it was sent.
#[tokio::test]
async fn an_unanswered_flush_frees_them_too() {
    let (_redis, lg, mut r) = start(50).await;
    let (mut a, mut c) = (
        RawClient::connect(lg.addr).await,
        RawClient::connect(lg.addr).await,
    );
    held_in_view(&lg, &mut a, &mut c, "lock:z").await;
    a.send(&cmd(&["CLIENT", "REPLY", "OFF"])).await;
    a.send(&cmd(&["FLUSHALL"])).await;
    assert_eq!(a.call(&["CLIENT", "REPLY", "ON"]).await, OK);
    acquires(&mut c, &mut r, "lock:z", "FLUSHALL under CLIENT REPLY OFF").await;
    lg.stop().await;
}

/// A lock in database 1 says nothing of database 0: an attempt there on
/// the same key acquires it, free there.
#[tokio::test]
async fn a_lock_in_another_database_answers_nothing_in_database_0() {
    let (_redis, lg, mut r) = start(50).await;
    let mut other = RawClient::connect(lg.addr).await;
    assert_eq!(other.call(&["SELECT", "1"]).await, OK);
    assert_eq!(other.call(&["SETNX", "lock:s", "one"]).await, ":1\r\n");
    assert_eq!(other.call(&["SETNX", "lock:s", "two"]).await, ":0\r\n");
    let mut b = RawClient::connect(lg.addr).await;
    acquires(&mut b, &mut r, "lock:s", "SETNX in db 1").await;
    // And the other way round: held in db 0, free in db 1.
    assert_eq!(other.call(&["SETNX", "lock:t", "one"]).await, ":1\r\n");
    assert_eq!(other.call(&["DEL", "lock:t"]).await, ":1\r\n");
    let mut c = RawClient::connect(lg.addr).await;
    held_in_view(&lg, &mut b, &mut c, "lock:t").await;
    assert_eq!(other.call(&["SETNX", "lock:t", "two"]).await, ":1\r\n");
    lg.stop().await;
}

/// A release in database 1 does not hand the key to an attempt parked in
/// database 0 while its holder still holds it there: that would answer
/// "acquired" to a second holder (and acquire in database 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_in_another_database_hands_nothing_over_in_database_0() {
    let (_redis, lg, mut r) = start(1_000).await;
    let mut other = RawClient::connect(lg.addr).await;
    assert_eq!(other.call(&["SELECT", "1"]).await, OK);
    // `holder` holds lock:h in db 0; `waiter` spins on it and parks.
    let (mut holder, mut waiter) = (
        RawClient::connect(lg.addr).await,
        RawClient::connect(lg.addr).await,
    );
    held_in_view(&lg, &mut holder, &mut waiter, "lock:h").await;
    let storm = lg.ctx.locks.storm.clone();
    let parked = tokio::spawn(async move { waiter.call(&["SETNX", "lock:h", "w"]).await });
    eventually("the waiter to park", || storm.waiting(b"lock:h") == 1).await;
    // The same key taken and released in db 1 while the waiter waits.
    assert_eq!(other.call(&["SETNX", "lock:h", "one"]).await, ":1\r\n");
    assert_eq!(other.call(&["DEL", "lock:h"]).await, ":1\r\n");
    let reply = parked.await.expect("waiter task");
    assert_eq!(reply, ":0\r\n", "the parked attempt: db 0's lock:h is held");
    assert_eq!(get(&mut r, "lock:h").await.as_deref(), Some("a"));
    assert_eq!(r.call(&["SELECT", "1"]).await, OK);
    assert!(!exists(&mut r, "lock:h").await, "nothing acquired in db 1");
    lg.stop().await;
}

/// `SCRIPT FLUSH` through lockgate, also queued in a transaction: once
/// Redis ran it, a lock command on another connection loads its script
/// again rather than running into `NOSCRIPT` (whose rerun would let the
/// `GET` pipelined behind it run first and find nothing).
#[tokio::test]
async fn a_script_flush_through_lockgate_makes_connections_load_again() {
    let (_redis, lg, _r) = start(50).await;
    let reruns = || m(&lg.ctx.locks.metrics.noscript_reruns);
    let (mut a, mut b) = (
        RawClient::connect(lg.addr).await,
        RawClient::connect(lg.addr).await,
    );
    let pipelined = |key: &str| {
        let mut bytes = cmd(&["SETNX", key, "v"]);
        bytes.extend(cmd(&["GET", key]));
        bytes
    };
    assert_eq!(b.call(&["SETNX", "lock:s0", "v"]).await, ":1\r\n");
    assert_eq!(a.call(&["SCRIPT", "FLUSH"]).await, OK);
    b.send(&pipelined("lock:s1")).await;
    assert_eq!(b.reply().await, ":1\r\n");
    assert_eq!(
        b.reply().await,
        "$1\r\nv\r\n",
        "in order after SCRIPT FLUSH"
    );

    // Queued: the flush runs at EXEC, after b loaded its script again.
    assert_eq!(a.call(&["MULTI"]).await, OK);
    assert_eq!(a.call(&["SCRIPT", "FLUSH"]).await, "+QUEUED\r\n");
    assert_eq!(b.call(&["SETNX", "lock:s2", "v"]).await, ":1\r\n");
    assert_eq!(a.call(&["EXEC"]).await, "*1\r\n+OK\r\n");
    b.send(&pipelined("lock:s3")).await;
    assert_eq!(b.reply().await, ":1\r\n");
    assert_eq!(b.reply().await, "$1\r\nv\r\n", "in order after EXEC");
    assert_eq!(reruns(), 0, "no lock script ran into NOSCRIPT");
    lg.stop().await;
}

/// With the lock quorum, lock keys live on the masters, which a client's
/// flush never reaches: it empties the primary, the locks stay held on the
/// masters, and what lockgate knows of them stays true (nothing dropped).
/// `MOVE`/`RENAME` of a lock key stay refused.
#[tokio::test]
async fn with_the_quorum_a_flush_empties_the_primary_and_keeps_the_locks() {
    let cluster = Cluster::start(3, |c| c.locks.retry.probe_interval_ms = PROBE_MS).await;
    let (mut a, mut b) = (cluster.client().await, cluster.client().await);
    assert_eq!(a.call(&["SETNX", "lock:q", "a"]).await, ":1\r\n");
    assert_eq!(a.call(&["SET", "user:1", "x"]).await, OK);
    for flush in [&["FLUSHALL"][..], &["FLUSHDB"], &["SWAPDB", "0", "1"]] {
        assert_eq!(a.call(flush).await, OK);
        assert_eq!(cluster.on_primary(&["EXISTS", "user:1"]).await, ":0\r\n");
        assert_eq!(b.call(&["SETNX", "lock:q", "b"]).await, ":0\r\n");
        for i in 0..3 {
            assert_eq!(
                cluster.on_master(i, &["GET", "lock:q"]).await,
                "$1\r\na\r\n"
            );
        }
    }
    assert_eq!(m(&cluster.lg.ctx.locks.metrics.view_forgets), 0);
    for command in [
        &["MOVE", "lock:q", "1"][..],
        &["RENAME", "lock:q", "user:2"],
    ] {
        let reply = a.call(command).await;
        assert!(reply.starts_with("-ERR lockgate: "), "{command:?}: {reply}");
    }
    cluster.lg.stop().await;
}
