//! Faults against a real Redis 7.0: the upstream down, restarted, hanging on
//! connect, or killed under a blocked command; malformed client RESP (each
//! case answered with Redis's own wording, then closed); `max_clients`; and a
//! client that hangs up mid-pipeline leaving nothing behind.

use crate::support;

use std::time::{Duration, Instant};

use lockgate::metrics::ProxyMetrics;
use lockgate::Config;
use support::passthrough::wait_blocked_clients;
use support::resilience::{client_list, exchange_to_close, wait_blocked, Blackhole};
use support::resp::direct;
use support::{cmd, show, Lockgate, RawClient, RedisServer, WAIT};
use tokio::io::AsyncWriteExt;

/// Slack for scheduling on a loaded 2-core machine.
const MARGIN: Duration = Duration::from_millis(1000);

fn config(upstream: &str) -> Config {
    let mut c = Config::default();
    c.upstream.addr = upstream.to_string();
    c.upstream.connect_timeout_ms = 500;
    c.upstream.reconnect_interval_ms = 100;
    c.proxy.shutdown_grace_ms = 300;
    c
}

fn refused(addr: &str) -> String {
    format!("-ERR lockgate: upstream {addr} unavailable (connection refused)\r\n")
}

/// `took` is at least `from` and less than `to` + [`MARGIN`].
fn took_between(took: Duration, from: Duration, to: Duration, what: &str) {
    assert!(
        took >= from && took < to + MARGIN,
        "{what}: took {took:?}, expected {from:?} to {to:?} (+ {MARGIN:?})"
    );
}

fn get(counter: &std::sync::atomic::AtomicU64) -> u64 {
    ProxyMetrics::get(counter)
}

#[tokio::test]
async fn upstream_down_then_the_same_connection_recovers_after_restart() {
    let mut redis = RedisServer::start();
    let addr = redis.addr();
    redis.stop();
    let mut cfg = config(&addr);
    cfg.upstream.reconnect_interval_ms = 200;
    let lg = Lockgate::start_with(cfg).await;
    let m = &lg.ctx.metrics;

    let started = Instant::now();
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(c.call_s(&["PING"]).await, refused(&addr));
    assert!(
        started.elapsed() < Duration::from_millis(500) + MARGIN,
        "error took {:?}",
        started.elapsed()
    );
    // Each command of a pipeline gets its own error, inline ones too.
    c.send(
        &[
            cmd(&["GET", "k"]),
            b"PING\r\n".to_vec(),
            cmd(&["ECHO", "x"]),
        ]
        .concat(),
    )
    .await;
    for i in 0..3 {
        assert_eq!(show(&c.read_raw().await), refused(&addr), "reply {i}");
    }
    // Other clients are answered as well, not queued behind the first.
    let mut c2 = RawClient::connect(lg.addr).await;
    assert_eq!(c2.call_s(&["PING"]).await, refused(&addr));
    assert!(get(&m.upstream_unavailable_replies) >= 5);
    assert!(get(&m.upstream_connect_errors) >= 2);

    redis.restart();
    let restarted = Instant::now();
    let mut tries = 0;
    loop {
        let reply = c.call_s(&["PING"]).await;
        if reply == "+PONG\r\n" {
            break;
        }
        assert_eq!(reply, refused(&addr), "while reconnecting");
        tries += 1;
        assert!(
            restarted.elapsed() < WAIT,
            "the same connection did not recover after {tries} tries"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        restarted.elapsed() < Duration::from_millis(200) + MARGIN,
        "recovery took {:?}, reconnect_interval_ms is 200",
        restarted.elapsed()
    );
    assert_eq!(c.call_s(&["SET", "k", "v"]).await, "+OK\r\n");
    assert_eq!(c.call_s(&["GET", "k"]).await, "$1\r\nv\r\n");
    assert_eq!(
        direct(&addr, &["GET", "k"]).await,
        "$1\r\nv\r\n",
        "on Redis"
    );
    until!(
        "the second client to recover",
        c2.call_s(&["PING"]).await == "+PONG\r\n"
    );
    lg.stop().await;
}

#[tokio::test]
async fn reconnect_attempts_wait_for_the_interval() {
    let mut redis = RedisServer::start();
    let addr = redis.addr();
    redis.stop();
    let mut cfg = config(&addr);
    cfg.upstream.reconnect_interval_ms = 600_000;
    let lg = Lockgate::start_with(cfg).await;
    let mut c = RawClient::connect(lg.addr).await;
    for _ in 0..5 {
        assert_eq!(c.call_s(&["PING"]).await, refused(&addr));
    }
    assert_eq!(
        get(&lg.ctx.metrics.upstream_connect_errors),
        1,
        "one attempt per reconnect interval, not one per command"
    );
    redis.restart();
    // The interval has not passed: still the error, without a new attempt.
    assert_eq!(c.call_s(&["PING"]).await, refused(&addr));
    assert_eq!(get(&lg.ctx.metrics.upstream_connect_errors), 1);
    // A new client connects at once.
    let mut fresh = RawClient::connect(lg.addr).await;
    assert_eq!(fresh.call_s(&["PING"]).await, "+PONG\r\n");
    lg.stop().await;
}

#[tokio::test]
async fn upstream_connect_timeout_is_reported_per_client_in_parallel() {
    let hole = Blackhole::new().await;
    let mut cfg = config(&hole.addr);
    cfg.upstream.connect_timeout_ms = 1000;
    let lg = Lockgate::start_with(cfg).await;
    let expected = format!(
        "-ERR lockgate: upstream {} unavailable (connect timed out after 1000 ms)\r\n",
        hole.addr
    );
    let started = Instant::now();
    let mut clients = Vec::new();
    for _ in 0..3 {
        let mut c = RawClient::connect(lg.addr).await;
        c.send(&cmd(&["PING"])).await;
        clients.push(c);
    }
    // All three sessions wait on their connects at the same time.
    until!(
        "three sessions",
        get(&lg.ctx.metrics.connections_active) == 3
    );
    for c in clients.iter_mut() {
        assert_eq!(show(&c.read_raw().await), expected);
    }
    took_between(
        started.elapsed(),
        Duration::from_millis(900),
        Duration::from_millis(1000),
        "three clients' errors, after the 1 s timeout once, not one after another",
    );
    lg.stop().await;
}

#[tokio::test]
async fn upstream_killed_under_a_blocked_command_closes_the_client() {
    let mut redis = RedisServer::start();
    let addr = redis.addr();
    let lg = Lockgate::start_with(config(&addr)).await;
    let mut c = RawClient::connect(lg.addr).await;
    c.send(&cmd(&["BLPOP", "nokey", "0"])).await;
    wait_blocked(&addr, "blpop").await;
    let mut bystander = RawClient::connect(lg.addr).await;
    assert_eq!(bystander.call_s(&["PING"]).await, "+PONG\r\n");

    redis.stop();
    let frames = c.frames_to_close().await;
    assert!(
        frames.iter().all(|f| f.starts_with('-')),
        "no made-up reply to BLPOP: {frames:?}"
    );
    until!(
        "upstream_dropped to count the lost reply",
        get(&lg.ctx.metrics.upstream_dropped) == 1
    );
    // The idle client owed nothing, but its Redis connection is gone too:
    // it is disconnected, as a direct client of the dead Redis would be.
    assert!(bystander.closed_within(WAIT).await, "idle client closed");
    assert_eq!(get(&lg.ctx.metrics.upstream_dropped), 1, "it owed nothing");
    let mut fresh = RawClient::connect(lg.addr).await;
    assert_eq!(fresh.call_s(&["PING"]).await, refused(&addr));
    lg.stop().await;
}

/// One malformed request: what is sent, what must come back before the
/// close, and whether Redis (started with the same limits) answers the same.
struct Case {
    name: &'static str,
    bytes: Vec<u8>,
    reply: String,
    same_on_redis: bool,
}

fn case(name: &'static str, bytes: &[u8], reply: &str, same_on_redis: bool) -> Case {
    Case {
        name,
        bytes: bytes.to_vec(),
        reply: reply.to_string(),
        same_on_redis,
    }
}

#[tokio::test]
async fn malformed_requests_get_redis_errors_and_are_closed() {
    let redis = RedisServer::start_with(&["--proto-max-bulk-len", "1048576"]);
    let mut cfg = config(&redis.addr());
    cfg.limits.max_bulk_bytes = 1_048_576;
    cfg.limits.max_multibulk_len = 16;
    cfg.limits.max_inline_bytes = 256;
    let lg = Lockgate::start_with(cfg).await;

    let perr = |what: &str| format!("-ERR Protocol error: {what}\r\n");
    let cases = vec![
        case(
            "nested multibulk",
            b"*1\r\n*1\r\n",
            &perr("expected '$', got '*'"),
            true,
        ),
        case(
            "integer inside multibulk",
            b"*2\r\n$3\r\nGET\r\n:1\r\n",
            &perr("expected '$', got ':'"),
            true,
        ),
        case(
            "non-numeric multibulk length",
            b"*x\r\n",
            &perr("invalid multibulk length"),
            true,
        ),
        case(
            "multibulk length over INT_MAX",
            b"*2147483648\r\n",
            &perr("invalid multibulk length"),
            true,
        ),
        case(
            "multibulk over limits.max_multibulk_len (16)",
            b"*17\r\n",
            &perr("invalid multibulk length"),
            false,
        ),
        case(
            "negative bulk length",
            b"*1\r\n$-5\r\n",
            &perr("invalid bulk length"),
            true,
        ),
        case(
            "non-numeric bulk length",
            b"*1\r\n$abc\r\n",
            &perr("invalid bulk length"),
            true,
        ),
        // Only the header is sent: the refusal must not wait for the payload.
        case(
            "bulk over limits.max_bulk_bytes, header only",
            b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1048577\r\n",
            &perr("invalid bulk length"),
            true,
        ),
        case(
            "inline line over limits.max_inline_bytes (256), no newline yet",
            &[b'A'; 300],
            &perr("too big inline request"),
            false,
        ),
        case(
            "inline line over Redis's 64 KiB",
            &[b'A'; 70 * 1024],
            &perr("too big inline request"),
            true,
        ),
        case(
            "unbalanced double quote",
            b"SET k \"v\r\n",
            &perr("unbalanced quotes in request"),
            true,
        ),
        case(
            "closing quote not followed by a space",
            b"GET \"k\"x\r\n",
            &perr("unbalanced quotes in request"),
            true,
        ),
        case(
            "unbalanced single quote",
            b"GET 'k\r\n",
            &perr("unbalanced quotes in request"),
            true,
        ),
        // Redis 7.0 itself skips the two bytes after a bulk unchecked, so
        // there is no Redis wording to compare with; lockgate refuses it.
        case(
            "bulk data not followed by CRLF",
            b"*1\r\n$4\r\nPINGxx",
            &perr("expected CRLF"),
            false,
        ),
        case(
            "valid commands before the malformed one are answered first",
            b"*1\r\n$4\r\nPING\r\nPING\r\n*x\r\n",
            &format!("+PONG\r\n+PONG\r\n{}", perr("invalid multibulk length")),
            true,
        ),
    ];

    let mut bystander = RawClient::connect(lg.addr).await;
    for (i, case) in cases.iter().enumerate() {
        let before = get(&lg.ctx.metrics.protocol_errors);
        let via = exchange_to_close(lg.addr, &case.bytes).await;
        assert_eq!(show(&via), case.reply, "{}: through lockgate", case.name);
        if case.same_on_redis {
            let reference = exchange_to_close(redis.addr(), &case.bytes).await;
            assert_eq!(show(&reference), case.reply, "{}: Redis itself", case.name);
        }
        assert_eq!(
            get(&lg.ctx.metrics.protocol_errors),
            before + 1,
            "{}: protocol_errors counts it",
            case.name
        );
        // The proxy keeps serving everyone else.
        assert_eq!(
            bystander.call_s(&["PING"]).await,
            "+PONG\r\n",
            "{}",
            case.name
        );
        let mut next = RawClient::connect(lg.addr).await;
        assert_eq!(
            next.call_s(&["ECHO", &i.to_string()]).await,
            format!("${}\r\n{i}\r\n", i.to_string().len()),
            "{}",
            case.name
        );
    }
    assert_eq!(
        get(&lg.ctx.metrics.protocol_errors),
        cases.len() as u64,
        "every case counted once"
    );
    lg.stop().await;
}

#[tokio::test]
async fn over_max_clients_is_refused_until_one_leaves() {
    let redis = RedisServer::start();
    let mut cfg = config(&redis.addr());
    cfg.proxy.max_clients = 2;
    let lg = Lockgate::start_with(cfg).await;
    let mut a = RawClient::connect(lg.addr).await;
    let mut b = RawClient::connect(lg.addr).await;
    assert_eq!(a.call_s(&["PING"]).await, "+PONG\r\n");
    assert_eq!(b.call_s(&["PING"]).await, "+PONG\r\n");

    let mut third = RawClient::connect(lg.addr).await;
    assert_eq!(
        third.frames_to_close().await,
        vec!["-ERR max number of clients reached\r\n"]
    );
    assert_eq!(get(&lg.ctx.metrics.connections_rejected), 1);
    // The two admitted clients are unaffected.
    assert_eq!(a.call_s(&["PING"]).await, "+PONG\r\n");

    drop(b);
    until!(
        "the session of the client that left to end",
        get(&lg.ctx.metrics.connections_active) == 1
    );
    let mut fourth = RawClient::connect(lg.addr).await;
    assert_eq!(fourth.call_s(&["PING"]).await, "+PONG\r\n");
    assert_eq!(get(&lg.ctx.metrics.connections_rejected), 1);
    // Full again.
    let mut fifth = RawClient::connect(lg.addr).await;
    assert_eq!(
        fifth.frames_to_close().await,
        vec!["-ERR max number of clients reached\r\n"]
    );
    lg.stop().await;
}

#[tokio::test]
async fn client_hanging_up_mid_pipeline_leaves_nothing_behind() {
    let redis = RedisServer::start();
    let addr = redis.addr();
    let lg = Lockgate::start_with(config(&addr)).await;
    let m = &lg.ctx.metrics;

    let mut pipeline = Vec::new();
    for i in 0..600 {
        pipeline.extend(cmd(&["SET", &format!("key:{i}"), "v"]));
    }
    pipeline.extend(cmd(&["BLPOP", "nokey", "0"]));
    for _ in 0..399 {
        pipeline.extend(cmd(&["INCR", "after-blpop"]));
    }
    let mut s = tokio::net::TcpStream::connect(lg.addr)
        .await
        .expect("connect");
    s.write_all(&pipeline).await.expect("write pipeline");
    wait_blocked(&addr, "blpop").await;
    assert_eq!(get(&m.connections_active), 1);
    assert_eq!(
        client_list(&addr, None).await.len(),
        1,
        "lockgate's upstream"
    );

    drop(s);
    let dropped = Instant::now();
    until!(
        "connections_active to return to 0",
        get(&m.connections_active) == 0
    );
    assert!(
        dropped.elapsed() < Duration::from_millis(300) + MARGIN,
        "the session outlived shutdown_grace_ms (300): {:?}",
        dropped.elapsed()
    );
    until!(
        "no lockgate-made connection left on Redis",
        client_list(&addr, None).await.is_empty()
    );
    assert_eq!(direct(&addr, &["EXISTS", "key:599"]).await, ":1\r\n");
    assert_eq!(
        direct(&addr, &["GET", "after-blpop"]).await,
        "$-1\r\n",
        "commands behind the BLPOP never ran"
    );
    // lockgate still works.
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(c.call_s(&["PING"]).await, "+PONG\r\n");
    lg.stop().await;
}

/// A client that sends its last commands and half-closes (shuts down its
/// write side, as `cmd | nc` or a client's graceful close does) still gets
/// the replies Redis sends for them, also while its replies are not counted
/// (subscribed mode) — as on a direct connection to Redis.
#[tokio::test]
async fn half_closed_client_still_gets_its_replies() {
    let redis = RedisServer::start();
    let lg = Lockgate::start_with(config(&redis.addr())).await;
    let cases: Vec<(&str, Vec<Vec<u8>>)> = vec![
        ("counted replies", vec![cmd(&["PING"]), cmd(&["GET", "k"])]),
        ("subscribed, PING", vec![cmd(&["PING"])]),
        ("subscribed, UNSUBSCRIBE", vec![cmd(&["UNSUBSCRIBE", "ch"])]),
        (
            "subscribed, RESET then PING",
            vec![cmd(&["RESET"]), cmd(&["PING"])],
        ),
        // Redis drops a blocked command when its client hangs up: the
        // half-close reaches Redis once the replies owed ahead of the
        // blocking command are in, not after its reply, which never comes.
        (
            "a blocking command last",
            vec![cmd(&["BLPOP", "nokey", "0"])],
        ),
        (
            "replies owed, then a blocking command",
            vec![
                cmd(&["PING"]),
                cmd(&["GET", "k"]),
                cmd(&["BLPOP", "nokey", "0"]),
            ],
        ),
    ];
    for (name, commands) in cases {
        let mut got = Vec::new();
        for addr in [redis.addr(), lg.addr.to_string()] {
            let mut c = RawClient::connect(addr.as_str()).await;
            if name.starts_with("subscribed") {
                assert_eq!(
                    c.call_raw(&["SUBSCRIBE", "ch"]).await,
                    b"*3\r\n$9\r\nsubscribe\r\n$2\r\nch\r\n:1\r\n"
                );
            }
            c.send(&commands.concat()).await;
            c.stream.shutdown().await.expect("half-close");
            got.push(c.frames_to_close().await);
        }
        assert!(
            !got[0].is_empty() || name.starts_with("a blocking"),
            "{name}: Redis answers"
        );
        assert_eq!(got[1], got[0], "{name}: lockgate vs Redis");
        wait_blocked_clients(&redis.addr(), 0).await;
    }
    lg.stop().await;
}

/// Shutdown while the writer is stuck writing to a client that does not
/// read (a 32 MB reply, more than the sockets hold): the writer's own
/// drain deadline cannot end a write in progress, so the server's forced
/// cut around every session ends it once `shutdown_grace_ms` is over (the
/// write timeout, 60 s by default, would be far later). Without the cut,
/// the stop would wait for the write timeout.
#[tokio::test]
async fn shutdown_cuts_a_session_stuck_writing_after_the_grace_period() {
    let redis = RedisServer::start();
    let addr = redis.addr();
    assert_eq!(
        direct(&addr, &["SETRANGE", "big", "33554431", "x"]).await,
        ":33554432\r\n"
    );
    let lg = Lockgate::start_with(config(&addr)).await;
    let mut stuck = tokio::net::TcpStream::connect(lg.addr)
        .await
        .expect("connect");
    stuck
        .write_all(&cmd(&["GET", "big"]))
        .await
        .expect("write GET");
    // Bytes at the client: the writer has started its write, which
    // cannot finish while the client does not read.
    tokio::time::timeout(WAIT, stuck.readable())
        .await
        .expect("the reply to start coming")
        .expect("readable");

    let stopping = Instant::now();
    lg.stop().await;
    took_between(
        stopping.elapsed(),
        Duration::from_millis(300),
        Duration::from_millis(300),
        "the stop, cut at the end of the grace period",
    );
    drop(stuck);
}
