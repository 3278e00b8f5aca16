//! Legacy lock code sees what Redis would show it. Each test runs the same
//! commands against a real redis-server directly and through lockgate, and
//! checks that the replies agree wherever lockgate does not differ on
//! purpose: a holder may move its own lease, a lock freed on Redis by any
//! path is acquired through lockgate within one probe interval, a try-lock
//! is answered at once, deeply nested replies pass, pub/sub leaves lock
//! handling on, and replies keep pipeline order around `LOCKGATE` commands.

use crate::support;

use std::time::{Duration, Instant};

use support::locks::{m, pttl, setup_with, Call};
use support::{cmd, RawClient, RedisServer};

/// The probe interval the staleness tests run with, ms.
const PROBE_MS: u64 = 100;

/// Runs `commands` one after another on a fresh connection to `addr` and
/// returns the replies.
async fn run(addr: impl tokio::net::ToSocketAddrs, commands: &[&[&str]]) -> Vec<String> {
    let mut c = RawClient::connect(addr).await;
    let mut out = Vec::new();
    for args in commands {
        out.push(c.call(args).await);
    }
    out
}

/// A holder whose re-entrant `SETNX` answered 0 still holds the lock and
/// may move its lease, as on Redis; a connection whose attempt lost may not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_holder_moves_its_own_lease_after_a_reentrant_setnx() {
    let (redis, lg, mut r) = setup_with("behaviour", 30_000, |_| {}).await;
    let direct = RedisServer::start();
    let script: &[&[&str]] = &[
        &["SETNX", "lock:re", "1"],
        &["SETNX", "lock:re", "1"],
        &["EXPIRE", "lock:re", "120"],
    ];
    let want = run(direct.addr(), script).await;
    assert_eq!(want, [":1\r\n", ":0\r\n", ":1\r\n"]);
    assert_eq!(run(lg.addr, script).await, want);
    let lease = pttl(&mut r, "lock:re").await;
    assert!(lease > 110_000, "the holder's 120 s lease: PTTL {lease}");

    // Another connection's attempt lost: its EXPIRE must not move the
    // holder's lease (deliberate: on Redis it would).
    let mut loser = RawClient::connect(lg.addr).await;
    assert_eq!(loser.call(&["SETNX", "lock:re", "2"]).await, ":0\r\n");
    assert_eq!(loser.call(&["EXPIRE", "lock:re", "1"]).await, ":0\r\n");
    assert!(pttl(&mut r, "lock:re").await > 110_000);
    drop(redis);
}

/// The same inside a transaction: a takeover (`SET`) then a re-entrant
/// `SETNX` and the holder's `EXPIRE`, answered as Redis answers them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_holder_moves_its_lease_inside_multi() {
    let (_redis, lg, mut r) = setup_with("behaviour", 30_000, |_| {}).await;
    let direct = RedisServer::start();
    let script: &[&[&str]] = &[
        &["MULTI"],
        &["SET", "lock:tx", "a"],
        &["GET", "lock:tx"],
        &["SETNX", "lock:tx", "b"],
        &["EXPIRE", "lock:tx", "5"],
        &["EXEC"],
    ];
    let want = run(direct.addr(), script).await;
    assert_eq!(
        want.last().map(String::as_str),
        Some("*4\r\n+OK\r\n$1\r\na\r\n:0\r\n:1\r\n")
    );
    assert_eq!(run(lg.addr, script).await, want);
    let lease = pttl(&mut r, "lock:tx").await;
    assert!((1..=5_000).contains(&lease), "EXPIRE 5 applied: {lease}");
}

/// Spins `SETNX key` through `addr` every few ms until it answers 1;
/// returns when that happened.
async fn acquire_by_spinning(addr: std::net::SocketAddr, key: &str) -> Instant {
    let mut c = RawClient::connect(addr).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        match c.call(&["SETNX", key, "next"]).await.as_str() {
            ":1\r\n" => return Instant::now(),
            ":0\r\n" => tokio::time::sleep(Duration::from_millis(5)).await,
            other => panic!("SETNX answered {other:?}"),
        }
    }
    panic!("{key} was not acquired within 10 s");
}

/// How late after `freed_at` an acquisition may come: one probe interval
/// and a round trip, with room for scheduling on two shared cores.
fn bound() -> Duration {
    Duration::from_millis(PROBE_MS + 150)
}

/// A holder shortens its lease (`EXPIRE k 1`) and dies without DEL: Redis
/// frees the key after 1 s, and a spinner through lockgate gets it within
/// one probe interval of that, not after the 30 s default lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_shortened_by_its_holder_frees_the_lock_in_time() {
    let (_redis, lg, _r) = setup_with("behaviour", 30_000, |c| {
        c.locks.retry.probe_interval_ms = PROBE_MS;
    })
    .await;
    let mut holder = RawClient::connect(lg.addr).await;
    assert_eq!(holder.call(&["SETNX", "lock:short", "h"]).await, ":1\r\n");
    let spinner = tokio::spawn(acquire_by_spinning(lg.addr, "lock:short"));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(holder.call(&["EXPIRE", "lock:short", "1"]).await, ":1\r\n");
    let freed_at = Instant::now() + Duration::from_secs(1);
    drop(holder);
    let won = spinner.await.expect("spinner");
    let late = won.saturating_duration_since(freed_at);
    eprintln!("acquired {late:?} after the shortened lease ran out");
    assert!(late <= bound(), "acquired {late:?} after the key was free");
}

/// The lock is freed behind lockgate's back (deleted, or its lease cut,
/// directly on Redis): a spinner through lockgate gets it within one probe
/// interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_freed_directly_on_redis_is_acquired_in_time() {
    for how in ["DEL", "PEXPIRE"] {
        let (_redis, lg, mut r) = setup_with("behaviour", 30_000, |c| {
            c.locks.retry.probe_interval_ms = PROBE_MS;
        })
        .await;
        let mut holder = RawClient::connect(lg.addr).await;
        assert_eq!(holder.call(&["SETNX", "lock:gone", "h"]).await, ":1\r\n");
        let spinner = tokio::spawn(acquire_by_spinning(lg.addr, "lock:gone"));
        // Let the spinner settle into absorbed and parked attempts.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let freed_at = match how {
            "DEL" => {
                assert_eq!(r.call(&["DEL", "lock:gone"]).await, ":1\r\n");
                Instant::now()
            }
            _ => {
                assert_eq!(r.call(&["PEXPIRE", "lock:gone", "200"]).await, ":1\r\n");
                Instant::now() + Duration::from_millis(200)
            }
        };
        let won = spinner.await.expect("spinner");
        let late = won.saturating_duration_since(freed_at);
        eprintln!("{how} on Redis: acquired {late:?} after the key was free");
        assert!(
            late <= bound(),
            "{how}: acquired {late:?} after it was free"
        );
    }
}

/// An app that tries once and skips the work when the lock is held (cron
/// de-duplication) gets its `0` at once, not after a park: parking is for
/// connections evidently spinning on the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_try_lock_on_a_held_key_is_answered_at_once() {
    let (_redis, lg, _r) = setup_with("behaviour", 30_000, |c| {
        c.locks.retry.park_ms = 500;
    })
    .await;
    let mut holder = RawClient::connect(lg.addr).await;
    assert_eq!(holder.call(&["SETNX", "lock:cron", "h"]).await, ":1\r\n");
    let storm = &lg.ctx.locks.storm.metrics;
    let parked = m(&storm.parked);
    let mut slowest = Duration::ZERO;
    for _ in 0..10 {
        let mut c = RawClient::connect(lg.addr).await;
        let started = Instant::now();
        assert_eq!(c.call(&["SETNX", "lock:cron", "me"]).await, ":0\r\n");
        slowest = slowest.max(started.elapsed());
    }
    assert_eq!(m(&storm.parked), parked, "a try-lock was parked");
    // A park would take 500 ms; a direct answer takes a round trip.
    assert!(slowest < Duration::from_millis(250), "slowest {slowest:?}");

    // A spinner (its previous attempt moments ago) is parked.
    let mut spinner = RawClient::connect(lg.addr).await;
    assert_eq!(spinner.call(&["SETNX", "lock:cron", "s"]).await, ":0\r\n");
    assert_eq!(spinner.call(&["SETNX", "lock:cron", "s"]).await, ":0\r\n");
    assert!(m(&storm.parked) > parked, "the spinner was not parked");
}

/// A Lua script returning thousands of nested arrays: the client gets
/// exactly Redis's bytes and its connection carries on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deeply_nested_replies_pass_through() {
    let (redis, lg, _r) = setup_with("behaviour", 30_000, |_| {}).await;
    let eval = cmd(&[
        "EVAL",
        "local a = {}; local b = {a}; a[1] = b; return a",
        "0",
    ]);
    let mut direct = RawClient::connect(redis.addr()).await;
    direct.send(&eval).await;
    let want = direct.read_raw().await;
    assert!(
        want.len() > 10_000,
        "Redis nested {} bytes deep",
        want.len()
    );
    let mut c = RawClient::connect(lg.addr).await;
    c.send(&eval).await;
    assert_eq!(c.read_raw().await, want);
    assert_eq!(c.call(&["PING"]).await, "+PONG\r\n");
}

/// Sends `commands` in one write to `addr` and reads `replies` frames back,
/// concatenated.
async fn pipelined(
    addr: impl tokio::net::ToSocketAddrs,
    commands: &[&[&str]],
    replies: usize,
) -> String {
    let mut c = RawClient::connect(addr).await;
    pipelined_on(&mut c, commands, replies).await
}

/// [`pipelined`] on an open connection.
async fn pipelined_on(c: &mut RawClient, commands: &[&[&str]], replies: usize) -> String {
    let bytes: Vec<u8> = commands.iter().flat_map(|args| cmd(args)).collect();
    c.send(&bytes).await;
    support::show(&c.read_raw_frames(replies).await)
}

/// `redis`'s address as a socket address.
fn redis_addr(redis: &RedisServer) -> std::net::SocketAddr {
    redis.addr().parse().expect("a socket address")
}

/// After `SUBSCRIBE` and `UNSUBSCRIBE`, a `SETNX` on a lock key still gets
/// its lease (pooled clients reuse such connections): pub/sub replies are
/// counted, not copied blindly, in RESP2 and RESP3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_handling_stays_on_after_pub_sub() {
    let (redis, lg, mut r) = setup_with("behaviour", 30_000, |_| {}).await;
    let direct = RedisServer::start();
    for hello in ["2", "3"] {
        let key = format!("lock:after-sub-{hello}");
        // Unsubscribing names channels where more than one is left, as
        // Redis's order among them is its hash table's.
        let script: &[&[&str]] = &[
            &["SUBSCRIBE", "a", "b"],
            &["PSUBSCRIBE", "p*"],
            &["UNSUBSCRIBE", "b"],
            &["UNSUBSCRIBE"],
            &["PUNSUBSCRIBE"],
            &["PING"],
            &["SETNX", &key, "1"],
        ];
        // 2 + 1 + 1 + 1 + 1 confirmations, PING, SETNX.
        let mut replies = Vec::new();
        for addr in [redis_addr(&direct), lg.addr] {
            let mut c = RawClient::connect(addr).await;
            c.call(&["HELLO", hello]).await;
            replies.push(pipelined_on(&mut c, script, 8).await);
        }
        let want = &replies[0];
        assert_eq!(&replies[1], want, "HELLO {hello}");
        assert!(want.ends_with(":1\r\n"), "{want}");
        let lease = pttl(&mut r, &key).await;
        assert!(lease > 25_000, "HELLO {hello}: lease {lease}");
    }

    // RESP3 while subscribed: ordinary commands run, pushes pass in order,
    // and a lock command is a lock command.
    let mut c = RawClient::connect(lg.addr).await;
    assert!(c.call(&["HELLO", "3"]).await.starts_with('%'));
    c.send(&cmd(&["SUBSCRIBE", "news"])).await;
    assert!(support::show(&c.read_raw().await).contains("subscribe"));
    assert_eq!(r.call(&["PUBLISH", "news", "hi"]).await, ":1\r\n");
    assert!(support::show(&c.read_raw().await).contains("message"));
    assert_eq!(c.call(&["SETNX", "lock:resp3-sub", "1"]).await, ":1\r\n");
    assert!(pttl(&mut r, "lock:resp3-sub").await > 25_000);
    drop(redis);
}

/// `CLIENT REPLY OFF`: Redis answers nothing and neither does lockgate,
/// yet a lock command is still a protected lock; `ON` brings replies back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_reply_off_keeps_locks_protected() {
    let (_redis, lg, mut r) = setup_with("behaviour", 30_000, |_| {}).await;
    let direct = RedisServer::start();
    let script: &[&[&str]] = &[
        &["CLIENT", "REPLY", "OFF"],
        &["SETNX", "lock:quiet", "1"],
        &["PERSIST", "lock:quiet"],
        &["CLIENT", "REPLY", "SKIP"],
        &["GET", "lock:quiet"],
        &["CLIENT", "REPLY", "ON"],
        &["CLIENT", "REPLY", "SKIP"],
        &["GET", "lock:quiet"],
        &["GET", "lock:quiet"],
    ];
    let want = pipelined(direct.addr(), script, 2).await;
    assert_eq!(want, "+OK\r\n$1\r\n1\r\n");
    assert_eq!(pipelined(lg.addr, script, 2).await, want);
    let lease = pttl(&mut r, "lock:quiet").await;
    assert!(lease > 25_000, "the silent SETNX got its lease: {lease}");
}

/// `MONITOR` streams what Redis runs and its replies cannot be counted: a
/// lock command there is refused with a clear error, never passed on bare.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_command_in_monitor_mode_is_refused() {
    let (_redis, lg, mut r) = setup_with("behaviour", 30_000, |_| {}).await;
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(c.call(&["MONITOR"]).await, "+OK\r\n");
    c.send(&cmd(&["SETNX", "lock:mon", "1"])).await;
    // The monitor stream (lockgate's own connections' commands among it)
    // comes as it comes; the refusal is among it.
    let mut reply = c.reply().await;
    for _ in 0..20 {
        if !reply.starts_with('+') {
            break;
        }
        reply = c.reply().await;
    }
    assert!(
        reply.starts_with("-ERR lockgate: lock commands are refused"),
        "{reply}"
    );
    assert_eq!(r.call(&["EXISTS", "lock:mon"]).await, ":0\r\n");
    assert_eq!(m(&lg.ctx.locks.metrics.raw_refused), 1);
}

/// A command pipelined after `LOCKGATE LOCK` runs after it: its effects
/// and its reply follow pipeline order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_after_a_fencing_lock_run_after_it() {
    let (_redis, lg, _r) = setup_with("behaviour", 30_000, |_| {}).await;
    let mut c = RawClient::connect(lg.addr).await;
    for i in 0..20 {
        let key = format!("lock:fenced:{i}");
        let mut bytes = cmd(&["LOCKGATE", "LOCK", &key, "5000"]);
        bytes.extend(cmd(&["EXISTS", &key]));
        bytes.extend(cmd(&["PTTL", &key]));
        c.send(&bytes).await;
        let locked = support::show(&c.read_raw().await);
        assert!(locked.starts_with("*2\r\n:"), "{locked}");
        assert_eq!(c.reply().await, ":1\r\n", "EXISTS ran before LOCK ({i})");
        let left = support::int(&c.reply().await);
        assert!((1..=5_000).contains(&left), "PTTL {left} ({i})");
    }
}

/// A holder releases and at once acquires again in one pipeline, while
/// another client's attempt taught lockgate the key is held: Redis answers
/// the new attempt from the released key, and so does lockgate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_and_reacquire_in_one_pipeline_answers_as_redis() {
    let (_redis, lg, _r) = setup_with("behaviour", 30_000, |_| {}).await;
    let direct = RedisServer::start();
    let script: &[&[&str]] = &[
        &["DEL", "lock:again"],
        &["SET", "lock:again", "h2", "NX", "PX", "5000"],
        &["PING"],
    ];
    let mut replies = Vec::new();
    for addr in [redis_addr(&direct), lg.addr] {
        let mut holder = RawClient::connect(addr).await;
        assert_eq!(holder.call(&["SETNX", "lock:again", "h"]).await, ":1\r\n");
        let mut other = RawClient::connect(addr).await;
        assert_eq!(other.call(&["SETNX", "lock:again", "o"]).await, ":0\r\n");
        replies.push(pipelined_on(&mut holder, script, 3).await);
    }
    assert_eq!(replies[0], ":1\r\n+OK\r\n+PONG\r\n");
    assert_eq!(replies[1], replies[0]);
}
