//! An attempt is not its connection (docs/behaviour.md, "Pooled and
//! multiplexed clients"), step by step on raw connections against a real
//! Redis: the holder's own connection is answered from the view; a
//! connection's attempts behind its own release in a pipeline go to Redis
//! (and those behind that one fail at once, as Redis would run them);
//! nothing parked or smoothed waits in front of a command sent behind it;
//! a probe of a lock known held is one plain `PTTL`, and one that finds
//! the lock freed behind lockgate's back still acquires. Real clients in
//! each shape are `tests/serial/storm_shapes.rs`.

use crate::support;

use std::time::{Duration, Instant};

use support::locks::{m, setup_with, Call};
use support::{cmd, RawClient};

/// `name`'s calls on Redis since the last `CONFIG RESETSTAT`.
async fn calls(r: &mut RawClient, name: &str) -> u64 {
    let info = r.call(&["INFO", "commandstats"]).await;
    let prefix = format!("cmdstat_{name}:calls=");
    info.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

/// Script calls lockgate sent since the last reset.
async fn scripts(r: &mut RawClient) -> u64 {
    calls(r, "evalsha").await + calls(r, "eval").await
}

/// The holder's connection, lent by a pool to the next thread or shared by
/// a multiplexed client, is answered "not acquired" from the view while
/// the lock is known held: no script reaches Redis, and the holder still
/// holds (its `DEL` releases).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_holders_connection_is_answered_from_the_view() {
    let (_redis, lg, mut r) = setup_with("shapes", 30_000, |c| {
        c.locks.retry.max_attempts_per_sec = 0;
    })
    .await;
    let mut holder = RawClient::connect(lg.addr).await;
    assert_eq!(holder.call(&["SETNX", "lock:own", "h"]).await, ":1\r\n");
    r.call(&["CONFIG", "RESETSTAT"]).await;
    for _ in 0..50 {
        assert_eq!(holder.call(&["SETNX", "lock:own", "x"]).await, ":0\r\n");
        assert_eq!(
            holder
                .call(&["SET", "lock:own", "x", "NX", "PX", "5000"])
                .await,
            "$-1\r\n"
        );
    }
    // Within a probe interval of the acquisition: not even a probe.
    assert_eq!(
        scripts(&mut r).await,
        0,
        "the holder's attempts went to Redis"
    );
    assert_eq!(r.call(&["GET", "lock:own"]).await, "$1\r\nh\r\n");
    assert_eq!(holder.call(&["DEL", "lock:own"]).await, ":1\r\n");
    lg.stop().await;
}

/// In one pipeline: release, then two attempts. Redis runs the release
/// first, so the first attempt goes to Redis and acquires; the second runs
/// after it on Redis and fails, and is answered so at once. As Redis:
/// `1, 1, 0`; one acquisition script for the two attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_behind_a_release_in_a_pipeline_answer_as_redis() {
    let (_redis, lg, mut r) = setup_with("shapes", 30_000, |_| {}).await;
    let mut holder = RawClient::connect(lg.addr).await;
    assert_eq!(holder.call(&["SETNX", "lock:pipe", "h"]).await, ":1\r\n");
    r.call(&["CONFIG", "RESETSTAT"]).await;
    let bytes: Vec<u8> = [
        cmd(&["DEL", "lock:pipe"]),
        cmd(&["SETNX", "lock:pipe", "a"]),
        cmd(&["SETNX", "lock:pipe", "b"]),
    ]
    .concat();
    holder.send(&bytes).await;
    let replies = support::show(&holder.read_raw_frames(3).await);
    assert_eq!(replies, ":1\r\n:1\r\n:0\r\n");
    assert_eq!(r.call(&["GET", "lock:pipe"]).await, "$1\r\na\r\n");
    // The release and the first attempt.
    assert_eq!(scripts(&mut r).await, 2);
    lg.stop().await;
}

/// A release inside a transaction: its `EXEC` frees the key, so an
/// attempt pipelined behind the `EXEC` goes to Redis and acquires, as on
/// Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_behind_a_transaction_that_releases_answers_as_redis() {
    let (_redis, lg, _r) = setup_with("shapes", 30_000, |_| {}).await;
    let mut holder = RawClient::connect(lg.addr).await;
    assert_eq!(holder.call(&["SETNX", "lock:tx", "h"]).await, ":1\r\n");
    // Another connection teaches the view the key is held.
    let mut other = RawClient::connect(lg.addr).await;
    assert_eq!(other.call(&["SETNX", "lock:tx", "o"]).await, ":0\r\n");
    let bytes: Vec<u8> = [
        cmd(&["MULTI"]),
        cmd(&["DEL", "lock:tx"]),
        cmd(&["EXEC"]),
        cmd(&["SETNX", "lock:tx", "again"]),
    ]
    .concat();
    holder.send(&bytes).await;
    let replies = support::show(&holder.read_raw_frames(4).await);
    assert_eq!(replies, "+OK\r\n+QUEUED\r\n*1\r\n:1\r\n:1\r\n");
    lg.stop().await;
}

/// A spinner's parked attempt is answered "not acquired" as soon as its
/// connection sends anything behind it (a pool lent it on, or a
/// multiplexed client's other task wrote): the command behind it does not
/// wait for the park (here 5 s). From then on the connection is taken to
/// carry several callers and its attempts are not parked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_attempt_never_holds_up_the_command_behind_it() {
    let (_redis, lg, _r) = setup_with("shapes", 30_000, |c| {
        c.locks.retry.park_ms = 5_000;
    })
    .await;
    let mut holder = RawClient::connect(lg.addr).await;
    assert_eq!(holder.call(&["SETNX", "lock:hol", "h"]).await, ":1\r\n");
    let mut shared = RawClient::connect(lg.addr).await;
    assert_eq!(shared.call(&["SETNX", "lock:hol", "a"]).await, ":0\r\n");
    let storm = &lg.ctx.locks.storm.metrics;
    let parked = m(&storm.parked);
    // Its second attempt in a row parks.
    shared.send(&cmd(&["SETNX", "lock:hol", "a"])).await;
    crate::until!("the spinner's attempt to park", m(&storm.parked) > parked);
    let started = Instant::now();
    shared.send(&cmd(&["SET", "data:hol", "v"])).await;
    let replies = support::show(&shared.read_raw_frames(2).await);
    assert_eq!(replies, ":0\r\n+OK\r\n");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the command behind the park waited {:?}",
        started.elapsed()
    );
    assert_eq!(m(&storm.hurried), 1);
    // Seen carrying several callers: answered at once, not parked.
    let parked = m(&storm.parked);
    let started = Instant::now();
    assert_eq!(shared.call(&["SETNX", "lock:hol", "a"]).await, ":0\r\n");
    assert_eq!(shared.call(&["SETNX", "lock:hol", "a"]).await, ":0\r\n");
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(m(&storm.parked), parked);
    lg.stop().await;
}

/// A smoothed reply (a connection hammering one key faster than
/// `max_attempts_per_sec`) ends as soon as its connection sends more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_smoothed_reply_never_holds_up_the_command_behind_it() {
    let (_redis, lg, _r) = setup_with("shapes", 30_000, |c| {
        c.locks.retry.max_attempts_per_sec = 1;
        c.locks.retry.park_ms = 0;
    })
    .await;
    let mut holder = RawClient::connect(lg.addr).await;
    assert_eq!(holder.call(&["SETNX", "lock:smooth", "h"]).await, ":1\r\n");
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(c.call(&["SETNX", "lock:smooth", "a"]).await, ":0\r\n");
    let storm = &lg.ctx.locks.storm.metrics;
    let smoothed = m(&storm.smoothed);
    // Answered up to a second later (smoothing)…
    c.send(&cmd(&["SETNX", "lock:smooth", "a"])).await;
    crate::until!("the attempt to be smoothed", m(&storm.smoothed) > smoothed);
    // …unless something comes behind it.
    let started = Instant::now();
    c.send(&cmd(&["PING"])).await;
    assert_eq!(
        support::show(&c.read_raw_frames(2).await),
        ":0\r\n+PONG\r\n"
    );
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "the PING behind the smoothed reply waited {:?}",
        started.elapsed()
    );
    lg.stop().await;
}

/// While the lock is known held, the probe that is due is one plain `PTTL`
/// (a fraction of a script call); when the lock was freed behind
/// lockgate's back, that probe's attempt still acquires, as on Redis (the
/// acquisition runs in its place), within a probe interval of the release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_of_a_held_lock_is_one_pttl_and_a_freed_lock_is_still_taken() {
    let (_redis, lg, mut r) = setup_with("shapes", 30_000, |_| {}).await;
    let mut holder = RawClient::connect(lg.addr).await;
    assert_eq!(holder.call(&["SETNX", "lock:probe", "h"]).await, ":1\r\n");
    r.call(&["CONFIG", "RESETSTAT"]).await;
    let checks = m(&lg.ctx.locks.metrics.checks);
    let mut other = RawClient::connect(lg.addr).await;
    let started = Instant::now();
    while m(&lg.ctx.locks.metrics.checks) - checks < 3 {
        assert!(started.elapsed() < Duration::from_secs(10), "no probes");
        assert_eq!(other.call(&["SETNX", "lock:probe", "o"]).await, ":0\r\n");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let probes = m(&lg.ctx.locks.metrics.checks) - checks;
    // At most one per probe interval (100 ms).
    let most = started.elapsed().as_millis() as u64 / 100 + 1;
    assert!(
        probes <= most,
        "{probes} plain probes in {:?}",
        started.elapsed()
    );
    assert_eq!(scripts(&mut r).await, 0, "a probe went as a script");
    assert_eq!(calls(&mut r, "pttl").await, probes);
    // Freed behind lockgate's back: the next due probe finds it free, and
    // its attempt acquires.
    r.call(&["DEL", "lock:probe", "lockgate:owner:{lock:probe}"])
        .await;
    let freed = Instant::now();
    let reruns = m(&lg.ctx.locks.metrics.check_reruns);
    loop {
        let reply = other.call(&["SETNX", "lock:probe", "o"]).await;
        if reply == ":1\r\n" {
            break;
        }
        assert_eq!(reply, ":0\r\n");
        assert!(freed.elapsed() < Duration::from_secs(2), "never acquired");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        freed.elapsed() < Duration::from_millis(1_000),
        "{:?}",
        freed.elapsed()
    );
    assert!(m(&lg.ctx.locks.metrics.check_reruns) > reruns);
    assert_eq!(r.call(&["GET", "lock:probe"]).await, "$1\r\no\r\n");
    lg.stop().await;
}
