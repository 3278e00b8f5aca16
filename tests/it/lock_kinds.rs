//! Shared, reentrant and counted locks and multi-key locks (`LOCKGATE LOCK
//! … SHARED | OWNER`, `LOCKGATE ACQUIRE`, `LOCKGATE LOCK k1 k2 …`) on one
//! Redis and on a cluster (see `support::kinds` for the scenarios), and
//! what each store refuses, saying so.

use crate::support;

use support::cluster::Cluster;
use support::kinds::{self, Api};
use support::resp::Resp;
use support::{Lockgate, RedisServer};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_on_one_redis() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    kinds::readers_and_writers(lg.addr, "rw", &[]).await;
    kinds::reentrant_counts(lg.addr, "re").await;
    kinds::permits_with_dying_holders(lg.addr, "sem").await;
    kinds::multi_key_all_or_none(lg.addr, ["m1", "m2", "m3"]).await;
    // What Redis holds while readers do: the mark, with the longest
    // reader's lease.
    let mut c = Api::connect(lg.addr).await;
    let (t, _) = (c.lock("rw", 10_000, &["SHARED"]).await).expect("a reader");
    let mut direct = support::RawClient::connect(redis.addr()).await;
    let value = Resp::parse(&direct.call_raw(&["GET", "rw"]).await);
    assert_eq!(value.text(), "lockgate:held");
    let pttl = Resp::parse(&direct.call_raw(&["PTTL", "rw"]).await).int();
    assert!((9_000..=10_000).contains(&pttl), "pttl {pttl}");
    // A writer that gave up leaves its wait behind it only for a while:
    // the waiting writers' set expires with its last waiter.
    let mut w = Api::connect(lg.addr).await;
    assert_eq!(w.lock("rw", 1_000, &["WAIT", "100"]).await, None);
    let writers = String::from_utf8(lockgate::lock::kinds::writers_key(b"rw").to_vec()).unwrap();
    let left = Resp::parse(&direct.call_raw(&["PTTL", &writers]).await).int();
    assert!(
        (1..=1_000).contains(&left),
        "the writers' set expires: pttl {left}"
    );
    assert_eq!(c.unlock("rw", t).await, 1);
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_on_a_cluster_and_multi_key_in_one_slot() {
    let cluster = Cluster::start(3, 0);
    let lg = cluster.lockgate(|_| {}).await;
    kinds::readers_and_writers(lg.addr, "{c}rw", &[]).await;
    kinds::reentrant_counts(lg.addr, "{c}re").await;
    kinds::permits_with_dying_holders(lg.addr, "{c}sem").await;
    kinds::multi_key_all_or_none(lg.addr, ["{m}1", "{m}2", "{m}3"]).await;
    let mut c = Api::connect(lg.addr).await;
    let crossed = c.call(&["LOCKGATE", "LOCK", "a", "b", "1000"]).await;
    assert!(
        matches!(&crossed, Resp::Error(e) if e.starts_with("CROSSSLOT")),
        "{crossed}"
    );
    assert_eq!(c.call(&["EXISTS", "a"]).await.int(), 0);
    // MSETNX of lock keys in one slot: leased on the slot's node.
    let msetnx = ["MSETNX", "lock:{c}1", "a", "lock:{c}2", "b"];
    assert_eq!(c.call(&msetnx).await.int(), 1);
    assert!(c.call(&["PTTL", "lock:{c}2"]).await.int() > 0);
    assert_eq!(c.call(&msetnx).await.int(), 0);
    assert_eq!(c.call(&["DEL", "lock:{c}1", "lock:{c}2"]).await.int(), 2);
    let crossed = c.call(&["MSETNX", "lock:x", "a", "lock:y", "b"]).await;
    assert!(
        matches!(&crossed, Resp::Error(e) if e.starts_with("CROSSSLOT")),
        "{crossed}"
    );
    lg.stop().await;
}

/// On the quorum, with lock keys (so lockgate reads them from the
/// masters); a semaphore of two permits needs all three masters' votes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_on_the_quorum() {
    let q = support::quorum::Cluster::start(3, |_| {}).await;
    let masters: Vec<String> = q.masters.iter().map(|m| m.addr()).collect();
    let addr = q.lg.addr;
    kinds::readers_and_writers(addr, "lock:rw", &masters).await;
    kinds::reentrant_counts(addr, "lock:re").await;
    kinds::permits_with_dying_holders(addr, "lock:sem").await;
    kinds::multi_key_all_or_none(addr, ["lock:m1", "lock:m2", "lock:m3"]).await;
    // Each master holds the readers (the mark on the lock key).
    let mut c = Api::connect(addr).await;
    let (t, _) = (c.lock("lock:rw", 10_000, &["SHARED"]).await).expect("a reader");
    for m in &masters {
        let value = support::resp::direct(m, &["GET", "lock:rw"]).await;
        assert_eq!(value, "$13\r\nlockgate:held\r\n", "on {m}");
    }
    assert_eq!(c.unlock("lock:rw", t).await, 1);
}

/// `MSETNX` naming lock keys is one all-or-none acquisition: each lock key
/// with its lease and owner record (passed on, it set them with no lease
/// at all), plain keys as `MSETNX` sets them; released by `DEL` from the
/// connection that took them, refused from one opened since; `MSET` over
/// a lock key is refused; inside `MULTI` the transaction aborts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn msetnx_on_lock_keys_is_an_all_or_none_acquisition() {
    use support::locks::{owner_of, pttl};
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let lease = lockgate::Config::default().locks.default_lease_ms as i64;
    let mut c = Api::connect(lg.addr).await;
    // A pooled connection, open before and taking nothing: the pooled
    // rule lets it release what another connection of the pool took.
    let mut pooled = Api::connect(lg.addr).await;
    let mut direct = support::RawClient::connect(redis.addr()).await;
    let msetnx = ["MSETNX", "lock:m1", "a", "lock:m2", "b", "plain:m", "c"];
    assert_eq!(c.call(&msetnx).await.int(), 1);
    for key in ["lock:m1", "lock:m2"] {
        let left = pttl(&mut direct, key).await;
        assert!(left > 0 && left <= lease, "{key}: pttl {left}");
        assert!(
            owner_of(&mut direct, key).await.is_some(),
            "{key}: an owner record"
        );
    }
    assert_eq!(
        pttl(&mut direct, "plain:m").await,
        -1,
        "a plain key as MSETNX sets it"
    );
    assert_eq!(
        c.call(&["GET", "lock:m1"]).await.text(),
        "a",
        "the client's value"
    );
    // None or all: a held key leaves the free one untouched.
    assert_eq!(
        c.call(&["MSETNX", "lock:m3", "x", "lock:m1", "y"])
            .await
            .int(),
        0
    );
    assert_eq!(c.call(&["EXISTS", "lock:m3"]).await.int(), 0);
    assert_eq!(
        c.call(&["SETNX", "lock:m2", "z"]).await.int(),
        0,
        "held for SETNX too"
    );
    // A connection opened since may not release them; the taker may.
    let mut later = Api::connect(lg.addr).await;
    assert_eq!(later.call(&["DEL", "lock:m1"]).await.int(), 0);
    assert_eq!(c.call(&["DEL", "lock:m1", "lock:m2"]).await.int(), 2);
    assert_eq!(
        direct
            .call_raw(&["EXISTS", "lockgate:owner:{lock:m1}"])
            .await,
        b":0\r\n"
    );
    assert_eq!(
        c.call(&["MSETNX", "lock:m5", "x", "lock:m6", "y"])
            .await
            .int(),
        1
    );
    assert_eq!(pooled.call(&["DEL", "lock:m5", "lock:m6"]).await.int(), 2);
    // MSET would overwrite a lock and drop its lease.
    let mset = c.call(&["MSET", "lock:m1", "x", "plain:n", "y"]).await;
    assert!(
        matches!(&mset, Resp::Error(e) if e.contains("drop their leases")),
        "{mset}"
    );
    assert_eq!(
        c.call(&["EXISTS", "lock:m1", "plain:n"]).await.int(),
        0,
        "nothing set"
    );
    // Inside MULTI it cannot be: the transaction aborts whole.
    assert_eq!(c.call(&["MULTI"]).await, Resp::Status("OK".into()));
    let queued = c.call(&["MSETNX", "lock:t", "1"]).await;
    assert!(
        matches!(&queued, Resp::Error(e) if e.contains("inside MULTI")),
        "{queued}"
    );
    let exec = c.call(&["EXEC"]).await;
    assert!(
        matches!(&exec, Resp::Error(e) if e.starts_with("EXECABORT")),
        "{exec}"
    );
    assert_eq!(c.call(&["EXISTS", "lock:t"]).await.int(), 0);
    // In another database, there.
    assert_eq!(c.call(&["SELECT", "3"]).await, Resp::Status("OK".into()));
    assert_eq!(c.call(&["MSETNX", "lock:d", "1"]).await.int(), 1);
    assert_eq!(direct.call_raw(&["SELECT", "3"]).await, b"+OK\r\n");
    let left = pttl(&mut direct, "lock:d").await;
    assert!(left > 0, "leased in database 3: {left}");
    // Pipelined behind a release, it sees the release (as Redis would).
    let mut p = support::RawClient::connect(lg.addr).await;
    assert_eq!(
        p.call_raw(&["SET", "lock:p", "v", "NX", "PX", "10000"])
            .await,
        b"+OK\r\n"
    );
    let mut batch = support::cmd(&["DEL", "lock:p"]);
    batch.extend(support::cmd(&["MSETNX", "lock:p", "w", "lock:q", "w"]));
    p.send(&batch).await;
    assert_eq!(p.read_raw_frames(2).await, b":1\r\n:1\r\n");
    lg.stop().await;
}

/// On a server that refuses scripts the kinds are refused, saying why,
/// and so is `MSETNX` on lock keys (never passed on unprotected); the
/// exclusive lock, its release and extension go on as transactions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_scripts_the_kinds_and_msetnx_are_refused_saying_so() {
    let redis = RedisServer::start_with(&support::redis::NO_SCRIPTS);
    let lg = Lockgate::start(&redis.addr()).await;
    let mut c = Api::connect(lg.addr).await;
    for args in [
        &["LOCKGATE", "LOCK", "k", "1000", "SHARED"][..],
        &["LOCKGATE", "LOCK", "k", "1000", "OWNER", "o"],
        &["LOCKGATE", "ACQUIRE", "k", "2", "1000"],
        &["LOCKGATE", "LOCK", "k", "k2", "1000"],
    ] {
        let reply = c.call(args).await;
        assert!(
            matches!(&reply, Resp::Error(e) if e.contains("need scripts")),
            "{args:?}: {reply}"
        );
    }
    let reply = c.call(&["MSETNX", "lock:a", "1", "lock:b", "2"]).await;
    assert!(
        matches!(&reply, Resp::Error(e) if e.contains("refuses scripts") || e.contains("need scripts")),
        "{reply}"
    );
    assert_eq!(c.call(&["EXISTS", "lock:a", "lock:b"]).await.int(), 0);
    let (t, _) = (c.lock("k", 10_000, &[]).await).expect("an exclusive lock");
    assert_eq!(c.extend("k", t, 20_000).await, 1);
    assert_eq!(c.unlock("k", t).await, 1);
    lg.stop().await;
}

/// `LOCKGATE LOCKS` shows shared holders, an owner's entries, permits in
/// use and the writers waiting (a key asked by name is always read); the
/// grants are counted per kind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_see_holders_entries_permits_and_waiting_writers() {
    use support::locks::m;
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut c = Api::connect(lg.addr).await;
    let row = |reply: Resp| reply.items().first().cloned().expect("one row");
    let mut readers = Vec::new();
    for _ in 0..2 {
        let (t, _) = (c.lock("lock:shared", 10_000, &["SHARED"]).await).expect("a reader");
        readers.push(t);
    }
    // A writer waits (in this instance's line): counted as a waiter, and
    // as a writer holding readers back (the row is read in several steps:
    // both are awaited).
    let mut w = Api::connect(lg.addr).await;
    let writer = tokio::spawn(async move {
        let got = w.lock("lock:shared", 1_000, &["WAIT", "20000"]).await;
        (w, got)
    });
    let mut seen = None;
    let deadline = std::time::Instant::now() + support::WAIT;
    while seen.is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "no writer seen waiting"
        );
        let r = row(c.call(&["LOCKGATE", "LOCKS", "lock:shared"]).await);
        if r.field("writers_waiting") == &Resp::Int(1) && r.field("waiters") == &Resp::Int(1) {
            seen = Some(r);
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let r = seen.expect("a row");
    assert_eq!(r.field("holder").text(), "holders", "{r}");
    assert_eq!(r.field("kind").text(), "shared", "{r}");
    assert_eq!(r.field("holders").int(), 2, "{r}");
    assert_eq!(r.field("entries").int(), 2, "{r}");
    assert_eq!(r.field("waiters").int(), 1, "{r}");
    assert!(r.field("lease_left_ms").int() > 9_000, "{r}");
    // Permits in use, an owner's entries.
    c.acquire("lock:sem", 3, 10_000, &[])
        .await
        .expect("a permit");
    for _ in 0..3 {
        c.lock("lock:own", 10_000, &["OWNER", "o"])
            .await
            .expect("an entry");
    }
    let r = row(c.call(&["LOCKGATE", "LOCKS", "lock:sem"]).await);
    assert_eq!(
        (r.field("kind").text(), r.field("holders").int()),
        ("permits", 1),
        "{r}"
    );
    let r = row(c.call(&["LOCKGATE", "LOCKS", "lock:own"]).await);
    assert_eq!(r.field("kind").text(), "owned", "{r}");
    assert_eq!(
        (r.field("holders").int(), r.field("entries").int()),
        (1, 3),
        "{r}"
    );
    // A plain exclusive one by its owner record.
    let (t, _) = (c.lock("lock:x", 10_000, &[]).await).expect("exclusive");
    let r = row(c.call(&["LOCKGATE", "LOCKS", "lock:x"]).await);
    assert_eq!(r.field("kind").text(), "exclusive", "{r}");
    assert_eq!(r.field("holders"), &Resp::Bulk(None), "{r}");
    assert_eq!(c.unlock("lock:x", t).await, 1);
    let metrics = &lg.ctx.locks.metrics;
    assert_eq!(m(&metrics.shared_grants), 2);
    assert_eq!(m(&metrics.permit_grants), 1);
    assert_eq!((m(&metrics.owned_grants), m(&metrics.reentries)), (1, 2));
    // The readers leave: the writer has its turn.
    for t in readers {
        assert_eq!(c.unlock("lock:shared", t).await, 1);
    }
    let (_, got) = writer.await.expect("writer task");
    assert!(got.is_some(), "the writer had its turn");
    lg.stop().await;
}

/// The Python example (`examples/lockgate_locks.py`, Redisson's
/// RReadWriteLock and RPermitExpirableSemaphore shapes) with threads, as
/// an app uses it, through lockgate on one Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_example_reads_writes_and_counts_with_threads() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let args = [
        lg.addr.ip().to_string(),
        lg.addr.port().to_string(),
        "lock:py".to_string(),
    ];
    let wait = std::time::Duration::from_secs(60);
    let out = support::python("lockgate_locks_example.py", &args, wait).await;
    assert!(out.contains("checks passed"), "{out}");
    let metrics = &lg.ctx.locks.metrics;
    assert!(support::locks::m(&metrics.shared_grants) >= 20);
    assert!(support::locks::m(&metrics.permit_grants) >= 20);
    lg.stop().await;
}

/// One multiplexed connection (Lettuce, StackExchange.Redis, ioredis):
/// every kind of call pipelined between ordinary commands is answered in
/// order, and a token releases its grant from any connection (a LIFO
/// pool hands the taker's connection on; the token is what counts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_multiplexed_connection_gets_every_answer_in_order() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut c = support::RawClient::connect(lg.addr).await;
    let calls: [&[&str]; 9] = [
        &["LOCKGATE", "LOCK", "lock:mx", "10000", "SHARED"],
        &["SET", "plain:mx", "1"],
        &["LOCKGATE", "LOCK", "lock:mx", "10000", "SHARED"],
        &["LOCKGATE", "LOCK", "lock:mx", "10000"],
        &["LOCKGATE", "ACQUIRE", "lock:ms", "1", "10000"],
        &["LOCKGATE", "ACQUIRE", "lock:ms", "1", "10000"],
        &["LOCKGATE", "LOCK", "lock:m1", "lock:m2", "10000"],
        &["MSETNX", "lock:m3", "a", "lock:m4", "b"],
        &["GET", "plain:mx"],
    ];
    let batch: Vec<u8> = calls.iter().flat_map(|a| support::cmd(a)).collect();
    c.send(&batch).await;
    let raw = c.read_raw_frames(calls.len()).await;
    let mut pos = 0;
    let replies: Vec<Resp> = (0..calls.len())
        .map(|_| Resp::decode(&raw, &mut pos))
        .collect();
    let token = |r: &Resp| r.items()[0].int();
    let (r1, r2) = (token(&replies[0]), token(&replies[2]));
    assert!(r2 > r1, "{replies:?}");
    assert_eq!(replies[1], Resp::Status("OK".into()));
    assert_eq!(replies[3], Resp::Bulk(None), "a writer beside readers");
    let permit = token(&replies[4]);
    assert_eq!(replies[5], Resp::Bulk(None), "one permit");
    let multi: Vec<i64> = replies[6].items()[0]
        .items()
        .iter()
        .map(Resp::int)
        .collect();
    assert_eq!(multi.len(), 2);
    assert_eq!(replies[7], Resp::Int(1));
    assert_eq!(replies[8], Resp::Bulk(Some(b"1".to_vec())));
    // Released from another connection by their tokens.
    let mut other = Api::connect(lg.addr).await;
    assert_eq!(other.unlock("lock:mx", r1).await, 1);
    assert_eq!(other.unlock("lock:mx", r2).await, 1);
    assert_eq!(other.unlock("lock:ms", permit).await, 1);
    assert_eq!(other.unlock("lock:m1", multi[0]).await, 1);
    assert_eq!(other.unlock("lock:m2", multi[1]).await, 1);
    assert_eq!(
        other
            .call(&["EXISTS", "lock:mx", "lock:ms", "lock:m1"])
            .await
            .int(),
        0
    );
    lg.stop().await;
}

/// A server that starts refusing scripts after lockgate connected (an ACL
/// changed at run time): the first kinds call learns it from its own
/// reply, and is refused saying so, not with the server's bare `NOPERM`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_refusing_scripts_since_a_moment_ago_is_said_so_by_the_reply() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut c = Api::connect(lg.addr).await;
    let acl = ["ACL", "SETUSER", "default", "-eval", "-evalsha"];
    let set = support::resp::direct(&redis.addr(), &acl).await;
    assert!(set.starts_with("+OK"), "{set}");
    for args in [
        &["LOCKGATE", "LOCK", "k", "1000", "SHARED"][..],
        &["LOCKGATE", "LOCK", "k", "k2", "1000"],
    ] {
        let reply = c.call(args).await;
        assert!(
            matches!(&reply, Resp::Error(e) if e.contains("need scripts")),
            "{args:?}: {reply}"
        );
    }
    lg.stop().await;
}
