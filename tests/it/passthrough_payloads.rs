//! Pass-through of payloads and command forms, against real redis-server:
//! scripts and functions, inline commands, binary keys and values, and a
//! 100 MB value.

use crate::support;

use support::passthrough::{pipeline, Fnv};
use support::rng::Rng;
use support::{cmd, encode, show, Lockgate, RawClient, RedisServer};

const SCRIPT: &str = "return {KEYS[1], ARGV[1], redis.call('INCR', KEYS[1])}";
const LIBRARY: &str =
    "#!lua name=mylib\nredis.register_function('f', function(keys, args) return 1 end)";
const LIBRARY2: &str = "#!lua name=lib2\n\
    redis.register_function('echo2', function(keys, args) return {keys[1], args[1], redis.call('GET', keys[1])} end)\n\
    redis.register_function{function_name='ro', callback=function(keys, args) return redis.call('GET', keys[1]) end, flags={'no-writes'}}";

/// Script and function commands, run one by one on one connection.
async fn scripting_scenario(addr: &str) -> Vec<Vec<u8>> {
    let mut c = RawClient::connect(addr).await;
    let mut log = Vec::new();
    log.push(c.call_raw(&["EVAL", SCRIPT, "1", "cnt", "x"]).await);
    log.push(c.call_raw(&["EVAL", "return nil", "0"]).await);
    log.push(
        c.call_raw(&["EVAL", "return redis.status_reply('FINE')", "0"])
            .await,
    );
    log.push(
        c.call_raw(&["EVAL", "return {1, {2, {3, 'deep'}}, false}", "0"])
            .await,
    );
    log.push(
        c.call_raw(&["EVAL", "return redis.error_reply('MYERR oops')", "0"])
            .await,
    );
    log.push(
        c.call_raw(&["EVAL", "return redis.call('INCR', KEYS[1])", "1", "s"])
            .await,
    );
    log.push(c.call_raw(&["SET", "s", "text"]).await);
    log.push(
        c.call_raw(&["EVAL", "return redis.call('INCR', KEYS[1])", "1", "s"])
            .await,
    );
    let sha = c.call_raw(&["SCRIPT", "LOAD", SCRIPT]).await;
    log.push(sha.clone());
    let sha = show(&sha[5..45]);
    log.push(c.call_raw(&["EVALSHA", &sha, "1", "cnt", "y"]).await);
    log.push(c.call_raw(&["SCRIPT", "EXISTS", &sha, "0000"]).await);
    log.push(c.call_raw(&["EVALSHA", &"0".repeat(40), "0"]).await);
    log.push(c.call_raw(&["FUNCTION", "LOAD", LIBRARY]).await);
    log.push(c.call_raw(&["FCALL", "f", "0"]).await);
    log.push(c.call_raw(&["FUNCTION", "LOAD", LIBRARY]).await);
    log.push(c.call_raw(&["FUNCTION", "LOAD", "REPLACE", LIBRARY]).await);
    log.push(c.call_raw(&["FUNCTION", "LOAD", LIBRARY2]).await);
    log.push(c.call_raw(&["FCALL", "echo2", "1", "s", "arg"]).await);
    log.push(c.call_raw(&["FCALL_RO", "ro", "1", "s"]).await);
    log.push(c.call_raw(&["FCALL_RO", "f", "0"]).await);
    log.push(c.call_raw(&["FCALL", "nosuch", "0"]).await);
    // Scripts inside a transaction.
    log.push(c.call_raw(&["MULTI"]).await);
    log.push(c.call_raw(&["EVALSHA", &sha, "1", "cnt", "z"]).await);
    log.push(c.call_raw(&["FCALL", "f", "0"]).await);
    log.push(c.call_raw(&["EXEC"]).await);
    log.push(c.call_raw(&["FUNCTION", "DELETE", "mylib"]).await);
    log.push(c.call_raw(&["FCALL", "f", "0"]).await);
    log
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eval_evalsha_script_load_and_functions_match_redis() {
    let redis = RedisServer::start();
    let twin = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let via = scripting_scenario(&lg.addr.to_string()).await;
    let direct = scripting_scenario(&twin.addr()).await;
    assert_eq!(via.len(), direct.len());
    for (i, (v, d)) in via.iter().zip(&direct).enumerate() {
        assert_eq!(show(v), show(d), "reply {i}");
    }
    let s = |i: usize| show(&via[i]);
    assert_eq!(s(0), "*3\r\n$3\r\ncnt\r\n$1\r\nx\r\n:1\r\n");
    assert_eq!(s(1), "$-1\r\n");
    assert_eq!(s(2), "+FINE\r\n");
    assert_eq!(
        s(3),
        "*3\r\n:1\r\n*2\r\n:2\r\n*2\r\n:3\r\n$4\r\ndeep\r\n$-1\r\n"
    );
    assert_eq!(s(4), "-MYERR oops\r\n");
    assert_eq!(s(5), ":1\r\n");
    assert!(s(7).starts_with("-ERR value is not an integer"), "{}", s(7));
    assert!(s(8).starts_with("$40\r\n"));
    assert_eq!(s(9), "*3\r\n$3\r\ncnt\r\n$1\r\ny\r\n:2\r\n");
    assert_eq!(s(10), "*2\r\n:1\r\n:0\r\n");
    assert!(s(11).starts_with("-NOSCRIPT"), "{}", s(11));
    assert_eq!(s(12), "$5\r\nmylib\r\n");
    assert_eq!(s(13), ":1\r\n");
    assert!(
        s(14).starts_with("-ERR Library 'mylib' already exists"),
        "{}",
        s(14)
    );
    assert_eq!(s(15), "$5\r\nmylib\r\n");
    assert_eq!(s(17), "*3\r\n$1\r\ns\r\n$3\r\narg\r\n$4\r\ntext\r\n");
    assert_eq!(s(18), "$4\r\ntext\r\n");
    assert_eq!(s(24), "*2\r\n*3\r\n$3\r\ncnt\r\n$1\r\nz\r\n:3\r\n:1\r\n");
    assert_eq!(s(25), "+OK\r\n");
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_commands_over_a_raw_socket() {
    let redis = RedisServer::start();
    let twin = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut c = RawClient::connect(lg.addr).await;
    c.send(b"PING\r\n").await;
    assert_eq!(c.read_raw().await, b"+PONG\r\n");
    c.send(b"SET k \"a b\"\r\n").await;
    assert_eq!(c.read_raw().await, b"+OK\r\n");
    // A blank line gets no reply: the next frame answers GET.
    c.send(b"\r\n").await;
    c.send(b"GET k\r\n").await;
    assert_eq!(c.read_raw().await, b"$3\r\na b\r\n");
    // Escapes in double quotes, single quotes, bare LF line ends, and a
    // line split across writes.
    c.send(b"SET k2 \"x\\r\\ny\\x00z\\\"\"\n").await;
    assert_eq!(c.read_raw().await, b"+OK\r\n");
    assert_eq!(c.call_raw(&["GET", "k2"]).await, b"$7\r\nx\r\ny\0z\"\r\n");
    c.send(b"SET k3 'it\\'s'\r").await;
    c.send(b"\n  get   k3  \r\n").await;
    assert_eq!(show(&c.read_raw_frames(2).await), "+OK\r\n$4\r\nit's\r\n");
    c.send(b"ECHO ").await;
    c.send(b"split").await;
    c.send(b"\r\n").await;
    assert_eq!(c.read_raw().await, b"$5\r\nsplit\r\n");

    // The whole thing in one write, compared with Redis byte for byte.
    let request: &[u8] = b"PING\r\nSET k \"a b\"\r\n\r\n\nGET k\r\n\
        SET k2 \"x\\r\\ny\\x00z\"\r\nGET k2\r\n   \r\nECHO 'q \"w\" e'\r\n\
        INCR k\r\nNOSUCH a b\r\nDEL k k2\r\nPING\r\n";
    let via = pipeline(lg.addr, request.to_vec(), None, 10).await;
    let direct = pipeline(twin.addr(), request.to_vec(), None, 10).await;
    assert_eq!(show(&via), show(&direct));
    assert!(via.starts_with(b"+PONG\r\n+OK\r\n$3\r\na b\r\n+OK\r\n$6\r\nx\r\ny\0z\r\n"));
    assert!(via.ends_with(b":2\r\n+PONG\r\n"));
    // Unbalanced quotes: Redis's error, then the connection closes.
    let mut bad = RawClient::connect(lg.addr).await;
    bad.send(b"PING\r\nSET k \"open\r\n").await;
    assert_eq!(
        show(&bad.read_to_eof().await),
        "+PONG\r\n-ERR Protocol error: unbalanced quotes in request\r\n"
    );
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_keys_and_values_with_crlf_and_nul() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut c = RawClient::connect(lg.addr).await;
    let key: &[u8] = b"bin\r\nkey\0with*2\r\n$3\r\n";
    // A value that looks like RESP frames and like lockgate's own `+RESET`.
    let value: &[u8] = b"*1\r\n$3\r\nfoo\r\n\0\r\n+RESET\r\n-ERR x\r\n\r\n\n\r";
    assert_eq!(c.call_bin(&[b"SET", key, value]).await, b"+OK\r\n");
    let mut expected = format!("${}\r\n", value.len()).into_bytes();
    expected.extend_from_slice(value);
    expected.extend_from_slice(b"\r\n");
    assert_eq!(c.call_bin(&[b"GET", key]).await, expected);
    // Redis stored exactly those bytes under exactly that key.
    let mut direct = RawClient::connect(redis.addr()).await;
    assert_eq!(direct.call_bin(&[b"GET", key]).await, expected);
    assert_eq!(
        direct.call_bin(&[b"STRLEN", key]).await,
        format!(":{}\r\n", value.len()).into_bytes()
    );
    // Every byte value, as key suffix and value, pipelined in one write.
    let mut request = Vec::new();
    for b in 0..=255u8 {
        let k = [b"k".as_slice(), &[b]].concat();
        request.extend_from_slice(&encode(&[b"SET", &k, &[b, b'\r', b'\n', b]]));
    }
    for b in 0..=255u8 {
        let k = [b"k".as_slice(), &[b]].concat();
        request.extend_from_slice(&encode(&[b"GET", &k]));
    }
    let replies = pipeline(lg.addr, request, None, 512).await;
    let mut want = b"+OK\r\n".repeat(256);
    for b in 0..=255u8 {
        want.extend_from_slice(b"$4\r\n");
        want.extend_from_slice(&[b, b'\r', b'\n', b]);
        want.extend_from_slice(b"\r\n");
    }
    assert_eq!(replies, want);
    // Empty key and empty value.
    assert_eq!(c.call_bin(&[b"SET", b"", b""]).await, b"+OK\r\n");
    assert_eq!(c.call_bin(&[b"GET", b""]).await, b"$0\r\n\r\n");
    lg.stop().await;
}

const BIG: u64 = 100 * 1024 * 1024;
const PIECE: usize = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_megabyte_value_round_trips() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut c = RawClient::connect(lg.addr).await;
    // Stream the SET in 1 MB pieces, hashing what is sent.
    let mut rng = Rng::new(0xb16);
    let mut sent = Fnv::default();
    c.send(format!("*3\r\n$3\r\nSET\r\n$3\r\nbig\r\n${BIG}\r\n").as_bytes())
        .await;
    let mut piece = vec![0u8; PIECE];
    let mut left = BIG;
    while left > 0 {
        let n = left.min(PIECE as u64) as usize;
        rng.fill(&mut piece[..n]);
        sent.write(&piece[..n]);
        c.send(&piece[..n]).await;
        left -= n as u64;
    }
    c.send(b"\r\n").await;
    assert_eq!(c.read_raw().await, b"+OK\r\n");
    drop(piece);

    // GET it back through lockgate, hashing as it streams in, followed by a
    // small command to show the stream is still in step afterwards.
    let mut req = cmd(&["GET", "big"]);
    req.extend_from_slice(&cmd(&["ECHO", "after"]));
    c.send(&req).await;
    let header = format!("${BIG}\r\n");
    assert_eq!(show(&c.read_exact_bytes(header.len()).await), header);
    let mut got = Fnv::default();
    c.stream_bytes(BIG, |b| got.write(b)).await;
    assert_eq!(c.read_exact_bytes(2).await, b"\r\n");
    assert_eq!(got.finish(), sent.finish(), "GET through lockgate");
    assert_eq!(c.read_raw().await, b"$5\r\nafter\r\n");

    // Redis holds the same value.
    let mut direct = RawClient::connect(redis.addr()).await;
    assert_eq!(
        show(&direct.call_raw(&["STRLEN", "big"]).await),
        format!(":{BIG}\r\n")
    );
    direct.send(&cmd(&["GETRANGE", "big", "-16", "-1"])).await;
    let tail = direct.read_raw().await;
    let mut rng = Rng::new(0xb16);
    let mut last = vec![0u8; PIECE];
    for _ in 0..BIG / PIECE as u64 {
        rng.fill(&mut last);
    }
    assert_eq!(&tail[5..21], &last[PIECE - 16..]);
    assert_eq!(c.call_raw(&["DEL", "big"]).await, b":1\r\n");
    lg.stop().await;
}
