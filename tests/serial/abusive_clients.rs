//! Slow and abusive clients against a real Redis: idle connections
//! (`proxy.client_idle_timeout_ms`, with Redis's exemptions), requests
//! trickled a byte at a time (`proxy.partial_request_timeout_ms`), clients
//! that never read their replies (`proxy.client_write_timeout_ms`: lockgate
//! stays small, Redis's buffer is freed; `proxy.max_client_output_bytes`:
//! lockgate holds a bounded amount instead), and connection churn (nothing
//! outlives its client: sessions, upstream connections, descriptors).
//!
//! lockgate runs in the test's process, so its memory and descriptors are
//! read from `/proc/self`; the clients' share of them is small and closed
//! before the checks that count.

use crate::support;
use crate::SERIAL;

use std::time::{Duration, Instant};

use support::abusive::{config, connected_clients, get, named, omem, on_redis, open_fds, rss};
use support::resp::direct;
use support::{cmd, show, Lockgate, RawClient, RedisServer, WAIT};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn idle_client_is_closed_silently_unless_redis_would_keep_it() {
    let _serial = SERIAL.lock().await;
    let redis = RedisServer::start();
    let mut cfg = config(&redis.addr());
    cfg.proxy.client_idle_timeout_ms = 300;
    let lg = Lockgate::start_with(cfg).await;

    // The exempt ones first, so they have been quiet for longer than the
    // idle one once it is closed: subscribed, MONITOR, blocked in BLPOP.
    let mut sub = named(lg.addr, "sub").await;
    sub.send(&cmd(&["SUBSCRIBE", "news"])).await;
    assert!(show(&sub.read_raw().await).contains("subscribe"));
    let mut monitor = named(lg.addr, "monitor").await;
    assert_eq!(monitor.call_raw(&["MONITOR"]).await, b"+OK\r\n");
    let mut blocked = named(lg.addr, "blocked").await;
    let blpop_sent = Instant::now();
    blocked.send(&cmd(&["BLPOP", "nothing", "2"])).await;

    let mut idle = named(lg.addr, "idle").await;
    let quiet_since = Instant::now();
    assert!(idle.closed_within(WAIT).await, "the idle client stays open");
    let quiet = quiet_since.elapsed();
    assert!(
        quiet >= Duration::from_millis(300),
        "closed after {quiet:?}"
    );
    assert!(
        idle.buffered().is_empty(),
        "Redis closes silently; got {:?}",
        show(idle.buffered())
    );
    assert_eq!(get(&lg.ctx.metrics.clients_closed_idle), 1);
    until!(
        "its upstream connection to close",
        !on_redis(&redis.addr(), "idle").await
    );

    // The exempt ones are still served.
    assert_eq!(
        direct(&redis.addr(), &["PUBLISH", "news", "hi"]).await,
        ":1\r\n"
    );
    assert!(show(&sub.read_raw().await).contains("hi"));
    // MONITOR shows every command since: read on to the PUBLISH.
    until!(
        "MONITOR to show the PUBLISH",
        show(&monitor.read_raw().await).contains("PUBLISH")
    );
    assert_eq!(blocked.read_raw().await, b"*-1\r\n");
    assert!(blpop_sent.elapsed() >= Duration::from_secs(2));
    // After its reply the blocked client's idle period starts afresh.
    assert!(blocked.closed_within(WAIT).await);
    assert_eq!(get(&lg.ctx.metrics.clients_closed_idle), 2);
    assert!(on_redis(&redis.addr(), "sub").await);
    lg.stop().await;
}

#[tokio::test]
async fn trickled_request_is_cut_and_never_reaches_redis() {
    let _serial = SERIAL.lock().await;
    let redis = RedisServer::start();
    let mut cfg = config(&redis.addr());
    cfg.proxy.partial_request_timeout_ms = 500;
    let lg = Lockgate::start_with(cfg).await;

    // A request split with a pause well inside the limit is served.
    let mut ok = RawClient::connect(lg.addr).await;
    ok.send(b"*1\r\n$4\r\nPI").await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    ok.send(b"NG\r\n").await;
    assert_eq!(ok.read_raw().await, b"+PONG\r\n");

    // One byte every 100 ms: the 39-byte GET would take about 4 s.
    let frame = cmd(&["GET", "aaaaaaaaaaaaaaaaaaaa"]);
    let (head, rest) = frame.split_at(11);
    let stream = tokio::net::TcpStream::connect(lg.addr)
        .await
        .expect("connect");
    stream.set_nodelay(true).expect("nodelay");
    let (mut r, mut w) = stream.into_split();
    let started = Instant::now();
    w.write_all(head).await.expect("write");
    let rest = rest.to_vec();
    let trickle = tokio::spawn(async move {
        for byte in rest {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if w.write_all(&[byte]).await.is_err() {
                return;
            }
        }
    });
    let mut got = Vec::new();
    tokio::time::timeout(WAIT, r.read_to_end(&mut got))
        .await
        .expect("closed in time")
        .ok();
    let took = started.elapsed();
    trickle.abort();
    assert_eq!(
        show(&got),
        "-ERR Protocol error: request not completed within 500 ms\r\n"
    );
    assert!(took >= Duration::from_millis(500), "cut after {took:?}");
    assert!(
        took < Duration::from_millis(500) + WAIT / 2,
        "cut after {took:?}"
    );
    assert_eq!(get(&lg.ctx.metrics.clients_closed_partial_request), 1);
    let stats = direct(&redis.addr(), &["INFO", "commandstats"]).await;
    assert!(
        !stats.contains("cmdstat_get:"),
        "a GET reached Redis: {stats}"
    );
    lg.stop().await;
}

/// After a partial-request timeout the close lingers, as after a protocol
/// error: the client's replies owed (4 MiB, more than the socket buffers
/// hold while it reads slowly) and the error all arrive, though it went on
/// sending after the cut. Closing with its late bytes unread would make
/// the kernel reset the connection and drop what was not delivered yet.
#[tokio::test]
async fn replies_and_the_error_arrive_whole_when_the_trickle_goes_on_after_the_cut() {
    let _serial = SERIAL.lock().await;
    let redis = RedisServer::start();
    let mut cfg = config(&redis.addr());
    cfg.proxy.partial_request_timeout_ms = 300;
    let lg = Lockgate::start_with(cfg).await;
    let big = vec![b'v'; 1 << 20];
    let mut setter = RawClient::connect(lg.addr).await;
    assert_eq!(setter.call_bin(&[b"SET", b"big", &big]).await, b"+OK\r\n");

    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("rcvbuf");
    let stream = socket.connect(lg.addr).await.expect("connect");
    stream.set_nodelay(true).expect("nodelay");
    let (mut r, mut w) = stream.into_split();
    let mut head = Vec::new();
    for _ in 0..4 {
        head.extend(cmd(&["GET", "big"]));
    }
    // A bulk of 100 bytes that never comes whole in time.
    head.extend(b"*1\r\n$100\r\n");
    w.write_all(&head).await.expect("write");
    let cut_at = Instant::now() + WAIT;
    while get(&lg.ctx.metrics.clients_closed_partial_request) == 0 {
        assert!(Instant::now() < cut_at, "never cut");
        if w.write_all(b"x").await.is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Bytes sent after the cut, which lockgate's reader no longer reads.
    for _ in 0..3 {
        w.write_all(b"x").await.expect("write after the cut");
    }
    let mut got = Vec::new();
    let read = tokio::time::timeout(WAIT, r.read_to_end(&mut got))
        .await
        .expect("closed in time");
    let mut want = Vec::new();
    for _ in 0..4 {
        want.extend(format!("${}\r\n", big.len()).into_bytes());
        want.extend(&big);
        want.extend(b"\r\n");
    }
    want.extend(b"-ERR Protocol error: request not completed within 300 ms\r\n");
    assert!(
        read.is_ok() && got == want,
        "{read:?}: got {} bytes of {}; the end: {}",
        got.len(),
        want.len(),
        show(&got[got.len().saturating_sub(80)..])
    );
    lg.stop().await;
}

#[tokio::test]
async fn client_that_never_reads_is_cut_and_redis_frees_its_buffer() {
    let _serial = SERIAL.lock().await;
    const VALUE: usize = 1 << 20;
    const GETS: usize = 100;
    let redis = RedisServer::start();
    let mut cfg = config(&redis.addr());
    cfg.proxy.client_write_timeout_ms = 2_000;
    let lg = Lockgate::start_with(cfg).await;
    let mut setter = RawClient::connect(redis.addr()).await;
    let value = vec![b'v'; VALUE];
    let set = setter.call_bin(&[b"SET", b"big", &value]).await;
    assert_eq!(set, b"+OK\r\n");
    drop((setter, value));

    let rss_before = rss();
    let mut c = named(lg.addr, "stalled").await;
    let mut pipeline = Vec::new();
    for _ in 0..GETS {
        pipeline.extend(cmd(&["GET", "big"]));
    }
    let sent = Instant::now();
    c.send(&pipeline).await;
    // Redis holds what lockgate does not take: its output buffer for the
    // connection grows well past what the sockets hold.
    let mut peak = 0;
    until!("Redis to buffer the replies", {
        peak = peak.max(omem(&redis.addr(), "stalled").await.unwrap_or(0));
        peak > 32 << 20
    });
    let lockgate_grew = rss().saturating_sub(rss_before);
    until!(
        "the stalled client to be cut",
        get(&lg.ctx.metrics.clients_closed_write_timeout) == 1
    );
    let cut_after = sent.elapsed();
    until!(
        "Redis to drop the connection and its buffer",
        !on_redis(&redis.addr(), "stalled").await
    );
    until!(
        "the session to end",
        get(&lg.ctx.metrics.connections_active) == 0
    );
    let lockgate_grew = lockgate_grew.max(rss().saturating_sub(rss_before));
    eprintln!(
        "Redis buffered {} MiB for the client; lockgate grew {} MiB; cut after {cut_after:?}",
        peak >> 20,
        lockgate_grew >> 20
    );
    assert!(
        cut_after >= Duration::from_secs(2),
        "cut after {cut_after:?}"
    );
    assert!(
        lockgate_grew < 16 << 20,
        "lockgate grew {lockgate_grew} bytes for a client that does not read"
    );
    // The client got a prefix of its replies, then the close.
    let mut got = Vec::new();
    let _ = tokio::time::timeout(WAIT, c.stream.read_to_end(&mut got)).await;
    assert!(got.len() < GETS * VALUE, "got every reply: {}", got.len());
    lg.stop().await;
}

#[tokio::test]
async fn with_an_output_bound_the_client_is_cut_and_redis_freed_at_once() {
    const VALUE: usize = 1 << 20;
    const GETS: usize = 100;
    const BOUND: u64 = 8 << 20;
    let _serial = SERIAL.lock().await;
    let redis = RedisServer::start();
    let mut cfg = config(&redis.addr());
    cfg.proxy.client_write_timeout_ms = 0;
    cfg.proxy.max_client_output_bytes = BOUND;
    let lg = Lockgate::start_with(cfg).await;
    let mut setter = RawClient::connect(redis.addr()).await;
    let set = setter.call_bin(&[b"SET", b"big", &vec![b'v'; VALUE]]).await;
    assert_eq!(set, b"+OK\r\n");
    drop(setter);

    let rss_before = rss();
    let mut c = named(lg.addr, "stalled").await;
    let mut pipeline = Vec::new();
    for _ in 0..GETS {
        pipeline.extend(cmd(&["GET", "big"]));
    }
    let mut redis_peak = 0;
    let sent = Instant::now();
    c.send(&pipeline).await;
    until!("the client to be cut at the output bound", {
        redis_peak = redis_peak.max(omem(&redis.addr(), "stalled").await.unwrap_or(0));
        get(&lg.ctx.metrics.clients_closed_output_limit) == 1
    });
    let lockgate_grew = rss().saturating_sub(rss_before);
    until!(
        "Redis to drop the connection and its buffer",
        !on_redis(&redis.addr(), "stalled").await
    );
    let freed_after = sent.elapsed();
    // Redis builds the replies to every request of one read before it
    // writes any, so its peak is the whole burst's replies whatever
    // lockgate does; what the bound changes is how long Redis holds them:
    // until lockgate has read the bound's worth, not a write timeout.
    eprintln!(
        "output bound {} MiB: Redis peaked at {} MiB and freed it after {freed_after:?}; lockgate grew {} MiB",
        BOUND >> 20,
        redis_peak >> 20,
        lockgate_grew >> 20
    );
    assert!(
        freed_after < WAIT / 2,
        "Redis held the replies for {freed_after:?}"
    );
    assert!(
        lockgate_grew < 4 * BOUND,
        "lockgate grew {lockgate_grew} bytes"
    );
    assert_eq!(get(&lg.ctx.metrics.clients_closed_write_timeout), 0);
    lg.stop().await;
}

#[tokio::test]
async fn replies_read_ahead_for_a_slow_reader_arrive_whole_and_in_order() {
    const VALUE: usize = 256 << 10;
    let _serial = SERIAL.lock().await;
    let redis = RedisServer::start();
    let mut cfg = config(&redis.addr());
    cfg.proxy.max_client_output_bytes = 64 << 20;
    let lg = Lockgate::start_with(cfg).await;
    let value = vec![b'v'; VALUE];
    let mut setter = RawClient::connect(redis.addr()).await;
    assert_eq!(setter.call_bin(&[b"SET", b"big", &value]).await, b"+OK\r\n");
    drop(setter);

    // Redis's replies, lockgate's own (a refused LOCKGATE subcommand) and
    // small ones between big ones, read back slowly in small pieces.
    let mut c = RawClient::connect(lg.addr).await;
    let refusal = c.call_raw(&["LOCKGATE", "NOPE"]).await;
    assert!(
        refusal.starts_with(b"-ERR lockgate: unknown"),
        "{}",
        show(&refusal)
    );
    let mut pipeline = Vec::new();
    let mut want: Vec<u8> = Vec::new();
    for i in 0..40 {
        pipeline.extend(cmd(&["GET", "big"]));
        want.extend(format!("${VALUE}\r\n").as_bytes());
        want.extend(&value);
        want.extend(b"\r\n");
        let echo = format!("e{i}");
        pipeline.extend(cmd(&["ECHO", &echo]));
        want.extend(format!("${}\r\n{echo}\r\n", echo.len()).as_bytes());
        if i % 10 == 0 {
            pipeline.extend(cmd(&["LOCKGATE", "NOPE"]));
            want.extend(&refusal);
        }
    }
    c.send(&pipeline).await;
    let mut got: Vec<u8> = Vec::new();
    let mut piece = vec![0u8; 64 << 10];
    while got.len() < want.len() {
        let n = tokio::time::timeout(WAIT, c.stream.read(&mut piece))
            .await
            .expect("replies keep coming")
            .expect("read");
        assert!(n > 0, "closed after {} bytes", got.len());
        got.extend(&piece[..n]);
        // Slower than Redis: lockgate reads ahead meanwhile.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(got == want, "replies out of order or damaged");
    assert_eq!(get(&lg.ctx.metrics.clients_closed_output_limit), 0);
    lg.stop().await;
}

#[tokio::test]
async fn the_client_timeouts_hold_while_the_primary_is_unreachable() {
    let _serial = SERIAL.lock().await;
    let down = format!("127.0.0.1:{}", support::free_port());
    let mut cfg = config(&down);
    cfg.upstream.connect_timeout_ms = 200;
    // Whichever runs out first closes: the partial request's is shorter.
    cfg.proxy.client_idle_timeout_ms = 300;
    cfg.proxy.partial_request_timeout_ms = 100;
    let lg = Lockgate::start_with(cfg).await;

    let mut idle = RawClient::connect(lg.addr).await;
    let ping = show(&idle.call_raw(&["PING"]).await);
    assert!(ping.contains("unavailable"), "{ping}");
    assert!(idle.closed_within(WAIT).await, "the idle client stays open");
    assert_eq!(get(&lg.ctx.metrics.clients_closed_idle), 1);

    let mut trickler = RawClient::connect(lg.addr).await;
    trickler.send(b"*1\r\n$4\r\nPI").await;
    let frames = trickler.frames_to_close().await;
    assert_eq!(
        frames,
        ["-ERR Protocol error: request not completed within 100 ms\r\n"]
    );
    assert_eq!(get(&lg.ctx.metrics.clients_closed_partial_request), 1);
    assert_eq!(get(&lg.ctx.metrics.clients_closed_idle), 1);
    lg.stop().await;
}

/// One churning connection of kind `kind % 3`: connect, PING, close;
/// connect and close without a byte; connect, half a frame, close.
async fn churn_once(addr: std::net::SocketAddr, kind: usize) {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    match kind % 3 {
        0 => {
            s.write_all(b"*1\r\n$4\r\nPING\r\n").await.expect("write");
            let mut pong = [0u8; 7];
            s.read_exact(&mut pong).await.expect("PONG");
            assert_eq!(&pong, b"+PONG\r\n");
        }
        1 => {}
        _ => s.write_all(b"*2\r\n$3\r\nGE").await.expect("write"),
    }
}

#[tokio::test]
async fn connection_churn_leaves_nothing_behind() {
    let _serial = SERIAL.lock().await;
    const CONNECTIONS: usize = 3_000;
    const AT_ONCE: usize = 16;
    let redis = RedisServer::start();
    let lg = Lockgate::start_with(config(&redis.addr())).await;
    // Warm up (lockgate's own connections, if any, are made by now).
    let mut warm = RawClient::connect(lg.addr).await;
    assert_eq!(warm.call_raw(&["PING"]).await, b"+PONG\r\n");
    drop(warm);
    until!(
        "the warm-up session to end",
        get(&lg.ctx.metrics.connections_active) == 0
    );
    let redis_baseline = connected_clients(&redis.addr()).await;
    let fds_baseline = open_fds();

    let started = Instant::now();
    let workers: Vec<_> = (0..AT_ONCE)
        .map(|w| {
            let addr = lg.addr;
            tokio::spawn(async move {
                for i in (w..CONNECTIONS).step_by(AT_ONCE) {
                    churn_once(addr, i).await;
                }
            })
        })
        .collect();
    for w in workers {
        w.await.expect("churn worker");
    }
    let took = started.elapsed();
    eprintln!(
        "churn: {CONNECTIONS} connections in {took:?} ({:.0}/s), {AT_ONCE} at a time",
        CONNECTIONS as f64 / took.as_secs_f64()
    );
    assert_eq!(
        get(&lg.ctx.metrics.connections_total),
        CONNECTIONS as u64 + 1
    );

    until!(
        "connections_active to return to 0",
        get(&lg.ctx.metrics.connections_active) == 0
    );
    until!(
        "Redis's connected_clients to return to its baseline",
        connected_clients(&redis.addr()).await == redis_baseline
    );
    until!(
        "descriptors to return to the baseline",
        open_fds() <= fds_baseline
    );
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(c.call_raw(&["PING"]).await, b"+PONG\r\n");
    lg.stop().await;
}
