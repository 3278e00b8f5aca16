//! Pass-through fidelity against real redis-server: pipelines, transactions
//! and SELECT. Where it makes sense, the same bytes are sent to a second,
//! identical Redis directly, and the reply streams must be byte-identical.

use crate::support;

use support::passthrough::{pipeline, split_frames};
use support::rng::Rng;
use support::{cmd, show, Lockgate, RawClient, RedisServer};

/// Appends one of a mix of commands over a small shared key space, so that
/// keys change type and replies include errors (`WRONGTYPE`, not an integer,
/// unknown command), nils, empty arrays, integers and bulks. Returns the
/// number of replies it owes (always 1).
fn push_mixed_command(rng: &mut Rng, out: &mut Vec<u8>) -> usize {
    let key = format!("key:{}", rng.below(40));
    let other = format!("key:{}", rng.below(40));
    let r = rng.next();
    let bytes = match rng.below(14) {
        0 => cmd(&["SET", &key, &format!("v{r}")]),
        1 => cmd(&["set", &key, &(r % 100).to_string()]),
        2 | 3 => cmd(&["GET", &key]),
        4 => cmd(&["INCR", &key]),
        5 => cmd(&["incrby", &key, "-3"]),
        6 => cmd(&["LPUSH", &key, &format!("e{}", r % 7)]),
        7 => cmd(&["LRANGE", &key, "0", "3"]),
        8 => cmd(&["DEL", &key, &other]),
        9 => cmd(&["GET", &format!("missing:{}", r % 1000)]),
        10 => cmd(&["MGET", &key, &other, "missing:x"]),
        11 => cmd(&["NOSUCHCMD", &key]),
        12 => cmd(&["LRANGE", &format!("missing:{}", r % 1000), "0", "-1"]),
        // An inline command in the middle of multibulk ones.
        _ => format!("EXISTS {key} {other}\r\n").into_bytes(),
    };
    out.extend_from_slice(&bytes);
    1
}

/// `n` mixed commands and a final `ECHO end-of-pipeline` marker; returns the
/// bytes and the number of replies owed.
fn mixed_pipeline(seed: u64, n: usize) -> (Vec<u8>, usize) {
    let mut rng = Rng::new(seed);
    let mut out = Vec::new();
    let mut replies = 0;
    for _ in 0..n {
        replies += push_mixed_command(&mut rng, &mut out);
    }
    out.extend_from_slice(&cmd(&["ECHO", "end-of-pipeline"]));
    (out, replies + 1)
}

/// Counts the frames of `stream` starting with `prefix`.
fn count_prefix(stream: &[u8], prefix: &[u8]) -> usize {
    split_frames(stream)
        .iter()
        .filter(|f| f.starts_with(prefix))
        .count()
}

/// Asserts two reply streams are identical, showing the first difference.
fn assert_same_stream(via_lockgate: &[u8], direct: &[u8]) {
    if via_lockgate == direct {
        return;
    }
    let a = split_frames(via_lockgate);
    let b = split_frames(direct);
    let i = a
        .iter()
        .zip(&b)
        .position(|(x, y)| x != y)
        .unwrap_or(a.len().min(b.len()));
    panic!(
        "reply streams differ at frame {i} (lockgate {} frames, direct {} frames): lockgate {:?}, direct {:?}",
        a.len(),
        b.len(),
        a.get(i).map(|f| show(f)),
        b.get(i).map(|f| show(f)),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_command_pipeline_in_one_write_is_byte_identical() {
    let redis = RedisServer::start();
    let twin = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let (request, replies) = mixed_pipeline(7, 12_000);
    assert!(replies > 10_000);

    let via = pipeline(lg.addr, request.clone(), None, replies).await;
    let direct = pipeline(twin.addr(), request, None, replies).await;

    // The workload really contains what it claims to.
    assert!(count_prefix(&direct, b"-WRONGTYPE") > 100);
    assert!(count_prefix(&direct, b"-ERR value is not an integer") > 50);
    assert!(count_prefix(&direct, b"-ERR unknown command") > 100);
    assert!(count_prefix(&direct, b"$-1\r\n") > 100);
    assert!(count_prefix(&direct, b"*0\r\n") > 100);
    assert!(direct.ends_with(b"$15\r\nend-of-pipeline\r\n"));
    assert_same_stream(&via, &direct);

    // Both Redis servers ended in the same state too.
    let mut a = RawClient::connect(redis.addr()).await;
    let mut b = RawClient::connect(twin.addr()).await;
    for i in 0..40 {
        let key = format!("key:{i}");
        let dump_a = a.call_raw(&["DUMP", &key]).await;
        let dump_b = b.call_raw(&["DUMP", &key]).await;
        assert_eq!(dump_a, dump_b, "{key} differs after the pipeline");
    }
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipeline_in_tiny_pieces_is_byte_identical() {
    let redis = RedisServer::start();
    let twin = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let (request, replies) = mixed_pipeline(99, 2_000);
    // Pieces of 1 to 7 bytes split headers, CRLFs and bulk payloads
    // everywhere; the client socket has TCP_NODELAY, so each is its own send.
    let mut rng = Rng::new(3);
    let pieces: Vec<usize> = (0..4096).map(|_| 1 + rng.below(7) as usize).collect();

    let via = pipeline(lg.addr, request.clone(), Some(pieces), replies).await;
    let direct = pipeline(twin.addr(), request, None, replies).await;
    assert!(count_prefix(&direct, b"-WRONGTYPE") > 10);
    assert!(count_prefix(&direct, b"$-1\r\n") > 10);
    assert_same_stream(&via, &direct);
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_answered_nothing_keep_the_order() {
    let redis = RedisServer::start();
    let twin = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    // `*0`, `*-1` and blank inline lines get no reply from Redis; they sit
    // between commands that do, in one write.
    let mut request = Vec::new();
    request.extend_from_slice(&cmd(&["SET", "a", "1"]));
    request.extend_from_slice(b"*0\r\n");
    request.extend_from_slice(&cmd(&["GET", "a"]));
    request.extend_from_slice(b"\r\n");
    request.extend_from_slice(b"*-1\r\n");
    request.extend_from_slice(&cmd(&["INCR", "a"]));
    request.extend_from_slice(b"\n*0\r\n*0\r\n");
    request.extend_from_slice(b"GET a\r\n");
    request.extend_from_slice(b"*0\r\n");
    request.extend_from_slice(&cmd(&["ECHO", "end"]));
    let expected: &[u8] = b"+OK\r\n$1\r\n1\r\n:2\r\n$1\r\n2\r\n$3\r\nend\r\n";

    let via = pipeline(lg.addr, request.clone(), None, 5).await;
    let direct = pipeline(twin.addr(), request.clone(), None, 5).await;
    assert_eq!(show(&direct), show(expected), "Redis itself");
    assert_eq!(show(&via), show(expected));

    // The same split so that `*0` and blank lines are whole reads of their
    // own or straddle two reads.
    for pieces in [vec![1], vec![2], vec![3], vec![4, 1], vec![5]] {
        let via = pipeline(lg.addr, request.clone(), Some(pieces.clone()), 5).await;
        assert_eq!(show(&via), show(expected), "pieces {pieces:?}");
    }

    // Many empty commands around every real one, across many writes.
    let mut c = RawClient::connect(lg.addr).await;
    for i in 0..200 {
        let mut req = b"*0\r\n".to_vec();
        req.extend_from_slice(&cmd(&["ECHO", &i.to_string()]));
        req.extend_from_slice(b"*0\r\n\r\n");
        c.send(&req).await;
        let s = i.to_string();
        assert_eq!(
            show(&c.read_raw().await),
            format!("${}\r\n{s}\r\n", s.len())
        );
    }
    // A write holding only `*0` is answered nothing, and the next command is
    // answered normally.
    c.send(b"*0\r\n").await;
    assert_eq!(c.call_raw(&["PING"]).await, b"+PONG\r\n");
    lg.stop().await;
}

/// Runs one connection's commands one at a time, returning every reply.
async fn transcript(addr: impl tokio::net::ToSocketAddrs, commands: &[&[&str]]) -> Vec<Vec<u8>> {
    let mut c = RawClient::connect(addr).await;
    let mut replies = Vec::new();
    for args in commands {
        replies.push(c.call_raw(args).await);
    }
    replies
}

const TRANSACTIONS: &[&[&str]] = &[
    // A normal transaction.
    &["MULTI"],
    &["SET", "tx:a", "1"],
    &["INCR", "tx:a"],
    &["LPUSH", "tx:l", "x", "y"],
    &["GET", "tx:a"],
    &["EXEC"],
    // A runtime error inside EXEC is one element of its array.
    &["MULTI"],
    &["SET", "tx:s", "abc"],
    &["INCR", "tx:s"],
    &["GET", "tx:s"],
    &["EXEC"],
    // DISCARD.
    &["MULTI"],
    &["SET", "tx:d", "1"],
    &["DISCARD"],
    &["GET", "tx:d"],
    &["DISCARD"],
    &["EXEC"],
    // A command refused while queueing aborts the EXEC.
    &["MULTI"],
    &["SET", "tx:e"],
    &["INCR", "tx:e2"],
    &["NOSUCH", "x"],
    &["MULTI"],
    &["EXEC"],
    &["GET", "tx:e2"],
    // An empty transaction.
    &["MULTI"],
    &["EXEC"],
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_exec_discard_execabort_match_redis() {
    let redis = RedisServer::start();
    let twin = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let via = transcript(lg.addr, TRANSACTIONS).await;
    let direct = transcript(twin.addr(), TRANSACTIONS).await;
    for ((args, v), d) in TRANSACTIONS.iter().zip(&via).zip(&direct) {
        assert_eq!(show(v), show(d), "reply to {args:?}");
    }
    let at = |args: &[&str], nth: usize| -> String {
        let i = TRANSACTIONS
            .iter()
            .enumerate()
            .filter(|(_, c)| **c == args)
            .nth(nth)
            .expect("command in list")
            .0;
        show(&via[i])
    };
    assert_eq!(at(&["EXEC"], 0), "*4\r\n+OK\r\n:2\r\n:2\r\n$1\r\n2\r\n");
    assert_eq!(
        at(&["EXEC"], 1),
        "*3\r\n+OK\r\n-ERR value is not an integer or out of range\r\n$3\r\nabc\r\n"
    );
    assert_eq!(at(&["SET", "tx:d", "1"], 0), "+QUEUED\r\n");
    assert_eq!(at(&["DISCARD"], 0), "+OK\r\n");
    assert_eq!(at(&["GET", "tx:d"], 0), "$-1\r\n");
    assert_eq!(at(&["DISCARD"], 1), "-ERR DISCARD without MULTI\r\n");
    assert_eq!(at(&["EXEC"], 2), "-ERR EXEC without MULTI\r\n");
    assert!(at(&["SET", "tx:e"], 0).starts_with("-ERR wrong number of arguments"));
    assert_eq!(at(&["MULTI"], 4), "-ERR MULTI calls can not be nested\r\n");
    assert_eq!(
        at(&["EXEC"], 3),
        "-EXECABORT Transaction discarded because of previous errors.\r\n"
    );
    assert_eq!(at(&["GET", "tx:e2"], 0), "$-1\r\n");
    assert_eq!(at(&["EXEC"], 4), "*0\r\n");

    // The same commands pipelined in one write give the same stream.
    let request: Vec<u8> = TRANSACTIONS.iter().flat_map(|a| cmd(a)).collect();
    let fresh = RedisServer::start();
    let lg2 = Lockgate::start(&fresh.addr()).await;
    let piped = pipeline(lg2.addr, request, None, TRANSACTIONS.len()).await;
    assert_eq!(show(&piped), show(&direct.concat()));
    lg.stop().await;
    lg2.stop().await;
}

/// WATCH on `w` by `a`, a write by `b` in between or not; returns every
/// reply of `a` and `b` in order.
async fn watch_scenario(a_addr: &str, b_addr: &str) -> Vec<Vec<u8>> {
    let mut a = RawClient::connect(a_addr).await;
    let mut b = RawClient::connect(b_addr).await;
    let mut log = Vec::new();
    log.push(a.call_raw(&["SET", "w", "start"]).await);
    // Aborted: another client changes the watched key.
    log.push(a.call_raw(&["WATCH", "w"]).await);
    log.push(a.call_raw(&["GET", "w"]).await);
    log.push(b.call_raw(&["SET", "w", "other"]).await);
    log.push(a.call_raw(&["MULTI"]).await);
    log.push(a.call_raw(&["SET", "w", "mine"]).await);
    log.push(a.call_raw(&["EXEC"]).await);
    log.push(a.call_raw(&["GET", "w"]).await);
    // Not aborted: nobody touches it.
    log.push(a.call_raw(&["WATCH", "w"]).await);
    log.push(a.call_raw(&["MULTI"]).await);
    log.push(a.call_raw(&["SET", "w", "mine"]).await);
    log.push(a.call_raw(&["EXEC"]).await);
    // UNWATCH: a later write by someone else no longer aborts.
    log.push(a.call_raw(&["WATCH", "w"]).await);
    log.push(a.call_raw(&["UNWATCH"]).await);
    log.push(b.call_raw(&["SET", "w", "again"]).await);
    log.push(a.call_raw(&["MULTI"]).await);
    log.push(a.call_raw(&["GET", "w"]).await);
    log.push(a.call_raw(&["EXEC"]).await);
    // WATCH inside MULTI is refused, the transaction still runs.
    log.push(a.call_raw(&["MULTI"]).await);
    log.push(a.call_raw(&["WATCH", "w"]).await);
    log.push(a.call_raw(&["EXEC"]).await);
    log
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_aborts_exec_when_another_client_writes() {
    let redis = RedisServer::start();
    let twin = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let lga = lg.addr.to_string();
    // Both clients through lockgate, and the writer straight on Redis.
    let via = watch_scenario(&lga, &lga).await;
    let via_mixed = watch_scenario(&lga, &redis.addr()).await;
    let direct = watch_scenario(&twin.addr(), &twin.addr()).await;
    let shown = |log: &[Vec<u8>]| log.iter().map(|r| show(r)).collect::<Vec<_>>();
    assert_eq!(shown(&via), shown(&direct));
    assert_eq!(shown(&via_mixed), shown(&direct));
    assert_eq!(
        show(&via[6]),
        "*-1\r\n",
        "EXEC after the watched key changed"
    );
    assert_eq!(show(&via[7]), "$5\r\nother\r\n");
    assert_eq!(show(&via[11]), "*1\r\n+OK\r\n");
    assert_eq!(show(&via[17]), "*1\r\n$5\r\nagain\r\n");
    assert_eq!(show(&via[19]), "-ERR WATCH inside MULTI is not allowed\r\n");
    assert_eq!(show(&via[20]), "*0\r\n");
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn select_is_per_client() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut a = RawClient::connect(lg.addr).await;
    let mut b = RawClient::connect(lg.addr).await;
    assert_eq!(a.call_raw(&["SELECT", "2"]).await, b"+OK\r\n");
    assert_eq!(a.call_raw(&["SET", "sel:k", "in-two"]).await, b"+OK\r\n");
    // B is still in db 0 and sees nothing.
    assert_eq!(b.call_raw(&["GET", "sel:k"]).await, b"$-1\r\n");
    assert_eq!(b.call_raw(&["DBSIZE"]).await, b":0\r\n");
    assert_eq!(b.call_raw(&["SET", "sel:k", "in-zero"]).await, b"+OK\r\n");
    assert_eq!(a.call_raw(&["GET", "sel:k"]).await, b"$6\r\nin-two\r\n");
    assert_eq!(b.call_raw(&["GET", "sel:k"]).await, b"$7\r\nin-zero\r\n");
    // Redis agrees on where each value is.
    let mut direct = RawClient::connect(redis.addr()).await;
    assert_eq!(
        direct.call_raw(&["GET", "sel:k"]).await,
        b"$7\r\nin-zero\r\n"
    );
    assert_eq!(direct.call_raw(&["SELECT", "2"]).await, b"+OK\r\n");
    assert_eq!(
        direct.call_raw(&["GET", "sel:k"]).await,
        b"$6\r\nin-two\r\n"
    );
    // SELECT inside one pipelined write applies from that point on.
    let mut req = cmd(&["SELECT", "3"]);
    req.extend_from_slice(&cmd(&["SET", "sel:k", "in-three"]));
    req.extend_from_slice(&cmd(&["SELECT", "0"]));
    req.extend_from_slice(&cmd(&["GET", "sel:k"]));
    req.extend_from_slice(&cmd(&["SELECT", "99"]));
    b.send(&req).await;
    assert_eq!(
        show(&b.read_raw_frames(5).await),
        "+OK\r\n+OK\r\n+OK\r\n$7\r\nin-zero\r\n-ERR DB index is out of range\r\n"
    );
    assert_eq!(a.call_raw(&["GET", "sel:k"]).await, b"$6\r\nin-two\r\n");
    // A new connection starts in db 0: the upstream connection is not reused.
    drop(a);
    let mut a2 = RawClient::connect(lg.addr).await;
    assert_eq!(a2.call_raw(&["GET", "sel:k"]).await, b"$7\r\nin-zero\r\n");
    lg.stop().await;
}
