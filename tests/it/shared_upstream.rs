//! `proxy.upstream = "shared"` against a real redis-server: many clients'
//! commands over one shared connection, each client getting its own
//! replies in order; every command that needs connection state moving its
//! session to a dedicated connection with the order kept; a shared
//! connection killed on Redis answering exactly the replies owed with
//! errors, then coming back; lock keys still protected.

use crate::support;

use std::sync::atomic::Ordering;

use lockgate::config::UpstreamMode;
use lockgate::Config;
use support::locks::fence_token;
use support::passthrough::wait_blocked_clients;
use support::{cmd, encode, show, Lockgate, RawClient, RedisServer};

/// lockgate in shared mode with `connections` shared connections.
async fn shared(redis: &RedisServer, connections: usize) -> Lockgate {
    let mut config = Config::default();
    config.upstream.addr = redis.addr();
    config.proxy.upstream = UpstreamMode::Shared;
    config.proxy.shared_upstream_connections = connections;
    Lockgate::start_with(config).await
}

/// Redis's `CLIENT LIST` lines, as seen on a direct connection.
async fn client_list(redis: &RedisServer) -> Vec<String> {
    let mut c = RawClient::connect(redis.addr()).await;
    let raw = c.call_raw(&["CLIENT", "LIST"]).await;
    let text = support::resp::Resp::parse(&raw).text().to_string();
    text.lines().map(str::to_string).collect()
}

/// Waits until Redis lists `n` shared connections; their lines.
async fn shared_conns(redis: &RedisServer, n: usize) -> Vec<String> {
    let mut lines: Vec<String>;
    crate::until!(format!("{n} shared connections (have {})", lines.len()), {
        lines = (client_list(redis).await.into_iter())
            .filter(|l| l.contains("name=lockgate-shared"))
            .collect();
        lines.len() == n
    });
    lines
}

/// A `CLIENT LIST` line of a spare dedicated connection: unnamed, and no
/// command ever ran on it.
fn is_spare(line: &str) -> bool {
    field(line, "name").is_empty() && field(line, "cmd") == "NULL"
}

/// Waits until lockgate has `n` spares ready and Redis lists `n` of them;
/// their ids. The shared connections must be open and named first: a
/// shared connection opened but not yet through its `CLIENT SETNAME` is
/// unnamed and idle as a spare is, and was once counted as one while a
/// spare was still in Redis's accept queue (a clean-clone CI here). The
/// same ids must be listed twice in a row: another short connection of
/// lockgate's own, accepted but not yet through its first command, looks
/// like a spare too, and once stood in for a spare still in the accept
/// queue (a clean-clone CI again: "a spare taken").
async fn spares_ready(lg: &Lockgate, redis: &RedisServer, n: usize) -> Vec<String> {
    let gauge = &lg.ctx.upstream_conns.spare_open;
    let shared_open = &lg.ctx.upstream_conns.shared_open;
    let mut ids: Vec<String> = Vec::new();
    let mut before: Vec<String>;
    crate::until!(format!("{n} spares (have {})", ids.len()), {
        let lines = client_list(redis).await;
        let named = (lines.iter())
            .filter(|l| l.contains("name=lockgate-shared"))
            .count() as u64;
        before = std::mem::take(&mut ids);
        ids = (lines.iter())
            .filter(|l| is_spare(l))
            .map(|l| field(l, "id").to_string())
            .collect();
        let shared = shared_open.load(Ordering::Relaxed);
        shared > 0
            && named == shared
            && ids.len() == n
            && ids == before
            && gauge.load(Ordering::Relaxed) == n as u64
    });
    ids
}

fn field<'a>(line: &'a str, name: &str) -> &'a str {
    (line.split(' '))
        .find_map(|kv| kv.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
        .unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_clients_get_their_own_replies_in_order_over_one_connection() {
    let redis = RedisServer::start();
    let lg = shared(&redis, 1).await;
    let mut tasks = Vec::new();
    for client in 0..50u32 {
        let addr = lg.addr;
        tasks.push(tokio::spawn(async move {
            let mut c = RawClient::connect(addr).await;
            for round in 0..4u32 {
                // Values from a few bytes to 200 KB, so replies span reads
                // and interleave with other clients' at every size.
                let size = [3usize, 1_000, 40_000, 200_000][(client + round) as usize % 4];
                let value: Vec<u8> = (0..size)
                    .map(|i| b'a' + ((i as u32 + client) % 26) as u8)
                    .collect();
                let key = format!("k:{client}:{round}");
                let mut req = Vec::new();
                let mut want = Vec::new();
                for i in 0..10u32 {
                    req.extend(encode(&[b"SET", key.as_bytes(), &value]));
                    want.extend_from_slice(b"+OK\r\n");
                    req.extend(encode(&[b"GET", key.as_bytes()]));
                    want.extend(format!("${}\r\n", value.len()).as_bytes());
                    want.extend_from_slice(&value);
                    want.extend_from_slice(b"\r\n");
                    req.extend(encode(&[b"INCR", format!("n:{client}").as_bytes()]));
                    want.extend(format!(":{}\r\n", round * 10 + i + 1).as_bytes());
                }
                c.send(&req).await;
                let got = c.read_exact_bytes(want.len()).await;
                assert!(got == want, "client {client} round {round}: replies differ");
            }
        }));
    }
    for t in tasks {
        t.await.expect("client task");
    }
    // All of it over one connection: Redis lists one shared connection and
    // no other besides lockgate's own and this test's.
    let list = client_list(&redis).await;
    let shared_lines = list
        .iter()
        .filter(|l| l.contains("name=lockgate-shared"))
        .count();
    let others = (list.iter())
        .filter(|l| !l.contains("name=lockgate-shared") && !l.contains("name=lockgate-internal"))
        .filter(|l| !is_spare(l))
        .count();
    assert_eq!(shared_lines, 1, "{list:#?}");
    assert_eq!(others, 1, "only this CLIENT LIST's connection: {list:#?}");
    let m = &lg.ctx.upstream_conns;
    assert_eq!(m.shared_open.load(Ordering::Relaxed), 1);
    assert_eq!(m.dedicated_open.load(Ordering::Relaxed), 0);
    assert!(m.shared_batches.load(Ordering::Relaxed) >= 200);
    lg.stop().await;
}

/// One client's pipeline around a command that moves it, replies compared
/// byte for byte, and the move counted for its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stateful_commands_move_the_session_with_its_order_kept() {
    let redis = RedisServer::start();
    let lg = shared(&redis, 2).await;
    let m = lg.ctx.upstream_conns.clone();
    let cases: [(&[&[&str]], &str, &std::sync::atomic::AtomicU64); 6] = [
        (
            &[&["SET", "a", "1"], &["MULTI"], &["INCR", "a"], &["EXEC"], &["GET", "a"]],
            "+OK\r\n+OK\r\n+QUEUED\r\n*1\r\n:2\r\n$1\r\n2\r\n",
            &m.moved_transaction,
        ),
        (
            &[&["SET", "w", "1"], &["WATCH", "w"], &["MULTI"], &["SET", "w", "2"], &["EXEC"]],
            "+OK\r\n+OK\r\n+OK\r\n+QUEUED\r\n*1\r\n+OK\r\n",
            &m.moved_transaction,
        ),
        (
            &[&["SET", "s", "db0"], &["SELECT", "3"], &["SET", "s", "db3"], &["GET", "s"]],
            "+OK\r\n+OK\r\n+OK\r\n$3\r\ndb3\r\n",
            &m.moved_select,
        ),
        (
            &[&["PING"], &["CLIENT", "SETNAME", "mine"], &["CLIENT", "GETNAME"], &["PING"]],
            "+PONG\r\n+OK\r\n$4\r\nmine\r\n+PONG\r\n",
            &m.moved_client,
        ),
        (
            &[&["SET", "h", "x"], &["AUTH", "nopass"], &["GET", "h"]],
            "+OK\r\n-ERR AUTH <password> called without any password configured for the default user. Are you sure your configuration is correct?\r\n$1\r\nx\r\n",
            &m.moved_identity,
        ),
        (
            &[&["SET", "q", "v"], &["BLPOP", "nothing", "0.05"], &["GET", "q"]],
            "+OK\r\n*-1\r\n$1\r\nv\r\n",
            &m.moved_blocking,
        ),
    ];
    // Kept open, so each moved session's dedicated connection stays counted.
    let mut moved = Vec::new();
    for (i, (commands, want, counter)) in cases.into_iter().enumerate() {
        let before = counter.load(Ordering::Relaxed);
        let mut c = RawClient::connect(lg.addr).await;
        let req: Vec<u8> = commands.iter().flat_map(|args| cmd(args)).collect();
        c.send(&req).await;
        let got = c.read_raw_frames(commands.len()).await;
        assert_eq!(show(&got), want, "case {i}");
        assert_eq!(
            counter.load(Ordering::Relaxed),
            before + 1,
            "case {i}: counted"
        );
        assert_eq!(
            m.dedicated_open.load(Ordering::Relaxed),
            i as u64 + 1,
            "case {i}"
        );
        // Moved for good: the next command is on the dedicated connection.
        if i == 2 {
            assert_eq!(c.call_raw(&["GET", "s"]).await, b"$3\r\ndb3\r\n");
            let mut other = RawClient::connect(lg.addr).await;
            assert_eq!(other.call_raw(&["GET", "s"]).await, b"$3\r\ndb0\r\n");
        }
        if i == 3 {
            let named = client_list(&redis).await;
            assert!(
                named.iter().any(|l| field(l, "name") == "mine"),
                "{named:#?}"
            );
        }
        moved.push(c);
    }
    // HELLO 3: the session speaks RESP3 on its own connection; the shared
    // ones stay RESP2 for everyone else.
    let mut c = RawClient::connect(lg.addr).await;
    c.send(&[cmd(&["SET", "r", "1"]), cmd(&["HELLO", "3"])].concat())
        .await;
    let got = c.read_raw_frames(2).await;
    assert!(got.starts_with(b"+OK\r\n%"), "{}", show(&got));
    assert_eq!(c.call_raw(&["HGETALL", "nohash"]).await, b"%0\r\n");
    let mut other = RawClient::connect(lg.addr).await;
    assert_eq!(other.call_raw(&["HGETALL", "nohash"]).await, b"*0\r\n");
    assert_eq!(m.moved_identity.load(Ordering::Relaxed), 2);
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_pubsub_and_monitor_sessions_do_not_hold_up_the_others() {
    let redis = RedisServer::start();
    let lg = shared(&redis, 1).await;
    let mut blocked = RawClient::connect(lg.addr).await;
    blocked.send(&cmd(&["BLPOP", "jobs", "0"])).await;
    wait_blocked_clients(&redis.addr(), 1).await;
    let mut sub = RawClient::connect(lg.addr).await;
    assert_eq!(
        show(&sub.call_raw(&["SUBSCRIBE", "news"]).await),
        "*3\r\n$9\r\nsubscribe\r\n$4\r\nnews\r\n:1\r\n"
    );
    let mut monitor = RawClient::connect(lg.addr).await;
    assert_eq!(monitor.call_raw(&["MONITOR"]).await, b"+OK\r\n");
    let mut other = RawClient::connect(lg.addr).await;
    assert_eq!(other.call_raw(&["SET", "x", "1"]).await, b"+OK\r\n");
    assert_eq!(other.call_raw(&["PUBLISH", "news", "hi"]).await, b":1\r\n");
    assert_eq!(
        show(&sub.read_raw_frames(1).await),
        "*3\r\n$7\r\nmessage\r\n$4\r\nnews\r\n$2\r\nhi\r\n"
    );
    let seen = show(&monitor.read_raw_frames(1).await);
    assert!(seen.contains("\"SET\" \"x\" \"1\""), "{seen}");
    assert_eq!(other.call_raw(&["LPUSH", "jobs", "j1"]).await, b":1\r\n");
    assert_eq!(
        show(&blocked.read_raw_frames(1).await),
        "*2\r\n$4\r\njobs\r\n$2\r\nj1\r\n"
    );
    let m = &lg.ctx.upstream_conns;
    assert_eq!(m.moved_blocking.load(Ordering::Relaxed), 1);
    assert_eq!(m.moved_pubsub.load(Ordering::Relaxed), 1);
    assert_eq!(m.moved_stream.load(Ordering::Relaxed), 1);
    assert_eq!(m.dedicated_open.load(Ordering::Relaxed), 3);
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_after_shared_writes_is_refused_and_first_wait_moves() {
    let redis = RedisServer::start();
    let lg = shared(&redis, 1).await;
    let mut c = RawClient::connect(lg.addr).await;
    c.send(
        &[
            cmd(&["SET", "k", "v"]),
            cmd(&["WAIT", "0", "0"]),
            cmd(&["GET", "k"]),
        ]
        .concat(),
    )
    .await;
    let got = show(&c.read_raw_frames(3).await);
    assert!(
        got.starts_with("+OK\r\n-ERR lockgate: WAIT and WAITAOF cannot wait for writes sent over a shared upstream connection")
            && got.ends_with("$1\r\nv\r\n"),
        "{got}"
    );
    let m = &lg.ctx.upstream_conns;
    assert_eq!(m.wait_refused.load(Ordering::Relaxed), 1);
    assert_eq!(
        m.dedicated_open.load(Ordering::Relaxed),
        0,
        "refused, not moved"
    );
    let mut first = RawClient::connect(lg.addr).await;
    assert_eq!(first.call_raw(&["WAIT", "0", "0"]).await, b":0\r\n");
    assert_eq!(m.moved_wait.load(Ordering::Relaxed), 1);
    lg.stop().await;
}

/// The shared connection killed on Redis while a client's write is held
/// (`CLIENT PAUSE WRITE`): the reply already in arrives, the two owed get
/// the upstream error in their places, and the next command succeeds on
/// the reconnected shared connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_shared_connection_answers_exactly_the_owed_replies_then_comes_back() {
    let redis = RedisServer::start();
    let lg = shared(&redis, 1).await;
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(c.call_raw(&["PING"]).await, b"+PONG\r\n");
    let lines = shared_conns(&redis, 1).await;
    let id = field(&lines[0], "id").to_string();
    let mut admin = RawClient::connect(redis.addr()).await;
    assert_eq!(
        admin.call_raw(&["CLIENT", "PAUSE", "10000", "WRITE"]).await,
        b"+OK\r\n"
    );
    c.send(
        &[
            cmd(&["GET", "x"]),
            cmd(&["SET", "x", "1"]),
            cmd(&["GET", "x"]),
        ]
        .concat(),
    )
    .await;
    assert_eq!(c.read_raw_frames(1).await, b"$-1\r\n");
    // The SET is held by the pause: wait until Redis shows it blocked.
    crate::until!("the shared connection's SET held by the pause", {
        client_list(&redis)
            .await
            .iter()
            .any(|l| field(l, "id") == id && field(l, "cmd") == "set")
    });
    assert_eq!(
        admin.call_raw(&["CLIENT", "KILL", "ID", &id]).await,
        b":1\r\n"
    );
    let got = show(&c.read_raw_frames(2).await);
    let error = format!(
        "-ERR lockgate: upstream {} unavailable (shared connection lost: closed by the server)\r\n",
        redis.addr()
    );
    assert_eq!(got, format!("{error}{error}"));
    assert_eq!(admin.call_raw(&["CLIENT", "UNPAUSE"]).await, b"+OK\r\n");
    // Back without a restart: the next commands go over a new connection.
    assert_eq!(c.call_raw(&["SET", "x", "2"]).await, b"+OK\r\n");
    assert_eq!(c.call_raw(&["GET", "x"]).await, b"$1\r\n2\r\n");
    let m = &lg.ctx.upstream_conns;
    assert_eq!(m.shared_error_replies.load(Ordering::Relaxed), 2);
    assert_eq!(m.shared_lost.load(Ordering::Relaxed), 1);
    assert_eq!(m.shared_connects.load(Ordering::Relaxed), 2);
    let again = shared_conns(&redis, 1).await;
    assert_ne!(field(&again[0], "id"), id);
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_keys_keep_their_protection_in_shared_mode() {
    let redis = RedisServer::start();
    let lg = shared(&redis, 1).await;
    let mut a = RawClient::connect(lg.addr).await;
    let mut b = RawClient::connect(lg.addr).await;
    assert_eq!(a.call_raw(&["SETNX", "lock:job", "a"]).await, b":1\r\n");
    assert_eq!(b.call_raw(&["SETNX", "lock:job", "b"]).await, b":0\r\n");
    // A lease was put on it, though the app set none.
    let pttl = support::resp::direct(&redis.addr(), &["PTTL", "lock:job"]).await;
    let pttl: i64 = pttl.trim().trim_start_matches(':').parse().unwrap_or(-1);
    assert!(pttl > 0, "pttl {pttl}");
    // With its owner record, written with it by the lock script.
    let owner =
        support::resp::direct(&redis.addr(), &["EXISTS", "lockgate:owner:{lock:job}"]).await;
    assert_eq!(owner, ":1\r\n");
    assert_eq!(a.call_raw(&["DEL", "lock:job"]).await, b":1\r\n");
    assert_eq!(b.call_raw(&["SETNX", "lock:job", "b"]).await, b":1\r\n");
    // lockgate's own lock scripts (SCRIPT LOAD, EVALSHA) stayed shared,
    // where a client's own script moves it.
    let m = &lg.ctx.upstream_conns;
    assert_eq!(m.dedicated_open.load(Ordering::Relaxed), 0);
    assert_eq!(m.moved_script.load(Ordering::Relaxed), 0);
    assert_eq!(a.call_raw(&["EVAL", "return 7", "0"]).await, b":7\r\n");
    assert_eq!(m.moved_script.load(Ordering::Relaxed), 1);
    lg.stop().await;
}

/// Fencing locks in shared mode: `LOCKGATE LOCK` (a try, then a `WAIT`
/// served by the release), `EXTEND` and `UNLOCK` run as lockgate's own
/// scripts on the shared connection, as a plain `SETNX` does: no session
/// moves to a connection of its own (a `WAIT` is lockgate's, not Redis's
/// blocking command) and Redis sees no connection but the shared one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_locks_stay_on_the_shared_connection() {
    let redis = RedisServer::start();
    let lg = shared(&redis, 1).await;
    let mut a = RawClient::connect(lg.addr).await;
    let mut b = RawClient::connect(lg.addr).await;
    let lock = ["LOCKGATE", "LOCK", "lock:fence", "5000"];
    let first = a.call_s(&lock).await;
    let t1 = fence_token(&first).expect("a token");
    // Held: a try is refused at once.
    assert_eq!(fence_token(&b.call_s(&lock).await), None, "held by a");
    let extended = a
        .call_s(&["LOCKGATE", "EXTEND", "lock:fence", &t1, "5000"])
        .await;
    assert_eq!(extended, ":1\r\n");
    // b waits; a's release hands the lock to it, with a greater token.
    let waiting = tokio::spawn(async move {
        let r = b
            .call_s(&["LOCKGATE", "LOCK", "lock:fence", "5000", "WAIT", "10000"])
            .await;
        (b, r)
    });
    crate::until!("b's WAIT is in line", {
        lg.ctx.locks.storm.lines.waits(b"lock:fence")
    });
    let unlocked = a.call_s(&["LOCKGATE", "UNLOCK", "lock:fence", &t1]).await;
    assert_eq!(unlocked, ":1\r\n");
    let (_b, second) = tokio::time::timeout(std::time::Duration::from_secs(10), waiting)
        .await
        .expect("b is served within its WAIT")
        .expect("b's task");
    let t2 = fence_token(&second).expect("b's token");
    assert!(
        t2.parse::<i64>().unwrap() > t1.parse::<i64>().unwrap(),
        "tokens grow: {t1} then {t2}"
    );
    let m = &lg.ctx.upstream_conns;
    assert_eq!(m.dedicated_open.load(Ordering::Relaxed), 0);
    assert_eq!(m.moved_blocking.load(Ordering::Relaxed), 0);
    assert_eq!(m.moved_script.load(Ordering::Relaxed), 0);
    let lockgates: Vec<String> = (client_list(&redis).await.into_iter())
        .filter(|l| !l.contains("cmd=client|list"))
        .filter(|l| !field(l, "name").starts_with("lockgate-internal"))
        .collect();
    assert!(
        lockgates
            .iter()
            .all(|l| field(l, "name") == "lockgate-shared" || is_spare(l)),
        "only the shared connection ran commands: {lockgates:#?}"
    );
    lg.stop().await;
}

/// A blank line gets no reply from Redis, and none is waited for (Redis's
/// own suite: "Handle an empty query").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blank_line_is_owed_nothing() {
    let redis = RedisServer::start();
    let lg = shared(&redis, 1).await;
    let mut c = RawClient::connect(lg.addr).await;
    c.send(b"\r\n").await;
    assert_eq!(c.call_raw(&["PING"]).await, b"+PONG\r\n");
    c.send(b"*0\r\n\r\n").await;
    assert_eq!(c.call_raw(&["PING"]).await, b"+PONG\r\n");
    lg.stop().await;
}

/// Redis's suite, "Timedout read-only scripts can be killed by SCRIPT
/// KILL": a client's script past `busy-reply-threshold`, and another
/// client on the same (one) shared connection gets `-BUSY` for its `PING`
/// and kills the script, as directly; the script's client moved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_script_leaves_the_other_clients_busy_replies_and_script_kill() {
    let redis = RedisServer::start();
    let threshold = ["CONFIG", "SET", "busy-reply-threshold", "50"];
    assert_eq!(
        support::resp::direct(&redis.addr(), &threshold).await,
        "+OK\r\n"
    );
    let lg = shared(&redis, 1).await;
    let mut rd = RawClient::connect(lg.addr).await;
    assert_eq!(rd.call_raw(&["SET", "k", "v"]).await, b"+OK\r\n");
    let spin = "local i = 0 while true do i = i + 1 end";
    rd.send(&cmd(&["EVAL", spin, "0"])).await;
    crate::until!("the script busy", {
        (support::resp::direct(&redis.addr(), &["PING"]).await).starts_with("-BUSY")
    });
    let mut r = RawClient::connect(lg.addr).await;
    let busy = show(&r.call_raw(&["PING"]).await);
    assert!(busy.starts_with("-BUSY"), "{busy}");
    assert_eq!(r.call_raw(&["SCRIPT", "KILL"]).await, b"+OK\r\n");
    let killed = show(&rd.read_raw().await);
    assert!(killed.contains("killed by user"), "{killed}");
    assert_eq!(r.call_raw(&["PING"]).await, b"+PONG\r\n");
    assert_eq!(rd.call_raw(&["GET", "k"]).await, b"$1\r\nv\r\n");
    let m = &lg.ctx.upstream_conns;
    assert_eq!(m.moved_script.load(Ordering::Relaxed), 1);
    assert_eq!(m.moved_kill.load(Ordering::Relaxed), 1);
    lg.stop().await;
}

/// A relay to a Redis whose every new connection reaches it `delay`
/// after it was opened: a Redis across a network (or behind a TLS
/// handshake), where a new connection costs time before its first command
/// runs. Stops when dropped.
struct SlowConnects {
    addr: String,
    task: tokio::task::JoinHandle<()>,
}

impl SlowConnects {
    async fn start(redis: &RedisServer, delay: std::time::Duration) -> SlowConnects {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let to = redis.addr();
        let task = tokio::spawn(async move {
            while let Ok((mut near, _)) = listener.accept().await {
                let to = to.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    if let Ok(mut far) = tokio::net::TcpStream::connect(&to).await {
                        let _ = tokio::io::copy_bidirectional(&mut near, &mut far).await;
                    }
                });
            }
        });
        SlowConnects { addr, task }
    }
}

impl Drop for SlowConnects {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Redis's suite, "Blocking XREADGROUP: flushed DB": a new client's first
/// command blocks (it moves), and another client's write sent after it
/// must find it blocked, as directly. `LPUSH` then `LPOP` in one
/// pipeline: a blocked `BLPOP` takes the element first and `LPOP` finds
/// none; had the `BLPOP` come after, `LPOP` would take it. Redis 100 ms
/// of connecting away, the clients 20 ms apart: a move that connected
/// then was overtaken in every round; one taking a spare is not (the
/// bound leaves room for a loaded machine's stalls). The clients run on a
/// thread of their own, as the suite's client is a process of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_clients_blocking_command_is_not_overtaken_by_another_clients_write() {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::time::Duration;
    const ROUNDS: usize = 20;
    const GAP: Duration = Duration::from_millis(20);
    let redis = RedisServer::start();
    let relay = SlowConnects::start(&redis, Duration::from_millis(100)).await;
    let mut config = Config::default();
    config.upstream.addr = relay.addr.clone();
    config.proxy.upstream = UpstreamMode::Shared;
    config.proxy.shared_upstream_connections = 1;
    let lg = Lockgate::start_with(config).await;
    let m = lg.ctx.upstream_conns.clone();
    let connect = |addr: std::net::SocketAddr| {
        let s = TcpStream::connect(addr).expect("connect");
        s.set_nodelay(true).expect("nodelay");
        s.set_read_timeout(Some(support::WAIT)).expect("timeout");
        s
    };
    let started = &lg.ctx.metrics.connections_active;
    let mut other = connect(lg.addr);
    crate::until!("the other session started", {
        started.load(Ordering::Relaxed) == 1
    });
    // Kept open, so the count of clients only grows.
    let mut clients = Vec::new();
    let mut overtaken = Vec::new();
    for round in 0..ROUNDS {
        spares_ready(&lg, &redis, 2).await;
        let rd = connect(lg.addr);
        crate::until!("the session started", {
            started.load(Ordering::Relaxed) == round as u64 + 2
        });
        let key = format!("q:{round}");
        let blpop = cmd(&["BLPOP", &key, "0"]);
        let push_pop = [cmd(&["LPUSH", &key, "a"]), cmd(&["LPOP", &key])].concat();
        let (rd, back, got) = tokio::task::spawn_blocking(move || {
            let (mut rd, mut other) = (rd, other);
            rd.write_all(&blpop).expect("write");
            std::thread::sleep(GAP);
            other.write_all(&push_pop).expect("write");
            // ":1" then "$-1" (found blocked) or "$1 a" (overtaken).
            let mut got = Vec::new();
            while !(got.ends_with(b"$-1\r\n") || got.ends_with(b"\na\r\n")) {
                let mut chunk = [0u8; 64];
                let n = other.read(&mut chunk).expect("read");
                assert!(n > 0, "closed");
                got.extend_from_slice(&chunk[..n]);
            }
            (rd, other, got)
        })
        .await
        .expect("client thread");
        other = back;
        match show(&got).as_str() {
            ":1\r\n$-1\r\n" => {}
            ":1\r\n$1\r\na\r\n" => overtaken.push(round),
            got => panic!("round {round}: {got}"),
        }
        clients.push(rd);
    }
    assert!(
        overtaken.len() <= 2,
        "BLPOP overtaken in rounds {overtaken:?} of {ROUNDS}"
    );
    assert_eq!(m.moved_blocking.load(Ordering::Relaxed), ROUNDS as u64);
    assert_eq!(m.spare_misses.load(Ordering::Relaxed), 0);
    drop(clients);
    lg.stop().await;
}

/// Spares: replaced when taken; one killed on Redis dropped, and reopened
/// at the next move; all dropped when the primary changes and opened to
/// the new one, which a move then reaches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spares_are_replaced_when_taken_dropped_when_killed_and_follow_the_primary() {
    let (a, b) = (RedisServer::start(), RedisServer::start());
    let lg = shared(&a, 1).await;
    let m = lg.ctx.upstream_conns.clone();
    let first = spares_ready(&lg, &a, 2).await;
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(c.call_raw(&["CLIENT", "SETNAME", "x"]).await, b"+OK\r\n");
    let named = client_list(&a).await;
    let x = (named.iter())
        .find(|l| field(l, "name") == "x")
        .expect("x on a");
    assert!(first.contains(&field(x, "id").to_string()), "a spare taken");
    let second = spares_ready(&lg, &a, 2).await;
    assert_eq!(m.spare_misses.load(Ordering::Relaxed), 0);
    // A spare closed while idle is dropped, and reopened only at the next
    // move (Redis closing idle connections is not fought).
    let mut admin = RawClient::connect(a.addr()).await;
    let kill = ["CLIENT", "KILL", "ID", second[0].as_str()];
    assert_eq!(admin.call_raw(&kill).await, b":1\r\n");
    let left = spares_ready(&lg, &a, 1).await;
    assert_eq!(m.spare_dropped.load(Ordering::Relaxed), 1);
    assert_eq!(left, [second[1].clone()]);
    let mut z = RawClient::connect(lg.addr).await;
    assert_eq!(z.call_raw(&["CLIENT", "SETNAME", "z"]).await, b"+OK\r\n");
    let third = spares_ready(&lg, &a, 2).await;
    assert!(!third.contains(&second[1]), "the last one taken: {third:?}");
    assert_eq!(m.spare_misses.load(Ordering::Relaxed), 0);
    // The primary changes: the spares on a are closed, two open on b.
    lg.ctx.primary_addr.confirm(&b.addr());
    spares_ready(&lg, &b, 2).await;
    crate::until!("no spare left on a", {
        !client_list(&a).await.iter().any(|l| is_spare(l))
    });
    let mut d = RawClient::connect(lg.addr).await;
    assert_eq!(d.call_raw(&["CLIENT", "SETNAME", "y"]).await, b"+OK\r\n");
    let on_b = client_list(&b).await;
    assert!(on_b.iter().any(|l| field(l, "name") == "y"), "{on_b:#?}");
    assert_eq!(m.spare_misses.load(Ordering::Relaxed), 0);
    lg.stop().await;
    crate::until!("the spares closed at shutdown", {
        m.spare_open.load(Ordering::Relaxed) == 0
            && !client_list(&b).await.iter().any(|l| is_spare(l))
    });
}

/// Redis's suite, `unit/pause`: "multiple clients can be queued up and
/// unblocked" counts three paused writers as three blocked clients. On one
/// shared connection the first paused write held the other two, and every
/// other client's reads, behind it; while a `CLIENT PAUSE` seen through
/// lockgate is in force each client that sends a command moves to a
/// connection of its own, held alone as directly, and a reader is not
/// held at all. `CLIENT UNPAUSE` ends it; a pause that ran out ends it
/// too, and clients share again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_pause_holds_each_paused_client_on_its_own_connection() {
    let redis = RedisServer::start();
    let lg = shared(&redis, 1).await;
    let m = &lg.ctx.upstream_conns;
    let mut reader = RawClient::connect(lg.addr).await;
    assert_eq!(reader.call_raw(&["SET", "x", "1"]).await, b"+OK\r\n");
    let mut admin = RawClient::connect(lg.addr).await;
    assert_eq!(
        admin.call_raw(&["CLIENT", "PAUSE", "60000", "WRITE"]).await,
        b"+OK\r\n"
    );
    let mut writers = Vec::new();
    for _ in 0..3 {
        let mut w = RawClient::connect(lg.addr).await;
        w.send(&cmd(&["SET", "FOO", "BAR"])).await;
        writers.push(w);
    }
    wait_blocked_clients(&redis.addr(), 3).await;
    // A read on the shared connection's client is answered during the
    // write pause (it moved; it would wait behind the writes otherwise).
    assert_eq!(reader.call_raw(&["GET", "x"]).await, b"$1\r\n1\r\n");
    assert_eq!(m.moved_paused.load(Ordering::Relaxed), 4);
    assert_eq!(admin.call_raw(&["CLIENT", "UNPAUSE"]).await, b"+OK\r\n");
    for w in &mut writers {
        assert_eq!(w.read_raw().await, b"+OK\r\n");
    }
    let mut after = RawClient::connect(lg.addr).await;
    assert_eq!(after.call_raw(&["SET", "y", "1"]).await, b"+OK\r\n");
    assert_eq!(
        m.moved_paused.load(Ordering::Relaxed),
        4,
        "unpaused: shares"
    );

    // A pause that runs out: its paused writer is answered after Redis
    // ended it, and lockgate's hint (started before Redis's pause) ended
    // before; the next client shares.
    assert_eq!(
        admin.call_raw(&["CLIENT", "PAUSE", "300", "WRITE"]).await,
        b"+OK\r\n"
    );
    let mut held = RawClient::connect(lg.addr).await;
    assert_eq!(held.call_raw(&["SET", "z", "1"]).await, b"+OK\r\n");
    assert_eq!(m.moved_paused.load(Ordering::Relaxed), 5);
    let mut later = RawClient::connect(lg.addr).await;
    assert_eq!(later.call_raw(&["SET", "z", "2"]).await, b"+OK\r\n");
    assert_eq!(m.moved_paused.load(Ordering::Relaxed), 5, "run out: shares");
    lg.stop().await;
}

/// A shared connection that is down reconnects as a session's own
/// connection would (`faults::reconnect_attempts_wait_for_the_interval` in
/// dedicated mode): a new client's first command brings an attempt at
/// once, another client's waits for `upstream.reconnect_interval_ms`
/// since the last attempt and is answered with its error before that.
/// Before, every command waited out the back-off (up to 1 s) after Redis
/// came back, answered with errors while `/readyz` said ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_down_shared_connection_reconnects_as_a_sessions_own_would() {
    let mut redis = RedisServer::start();
    let addr = redis.addr();
    redis.stop();
    let mut config = Config::default();
    config.upstream.addr = addr.clone();
    config.upstream.reconnect_interval_ms = 600_000;
    config.proxy.upstream = UpstreamMode::Shared;
    config.proxy.shared_upstream_connections = 1;
    config.proxy.shared_spare_connections = 0;
    let lg = Lockgate::start_with(config).await;
    let m = &lg.ctx.upstream_conns;
    let errors = || m.shared_connect_errors.load(Ordering::Relaxed);
    crate::until!("the first attempt fails", errors() == 1);
    let refused = format!("-ERR lockgate: upstream {addr} unavailable (connection refused)\r\n");
    let mut c = RawClient::connect(lg.addr).await;
    // A new client's first command: an attempt of its own (counted once
    // its error is answered).
    assert_eq!(show(&c.call_raw(&["PING"]).await), refused);
    crate::until!("the second attempt", errors() == 2);
    // The connection's task answers one batch after another: an attempt
    // for the first of these would be counted before the last is answered.
    for _ in 0..4 {
        assert_eq!(show(&c.call_raw(&["PING"]).await), refused);
    }
    assert_eq!(errors(), 2, "one attempt per interval, not one per command");
    tokio::task::block_in_place(|| redis.restart());
    assert_eq!(show(&c.call_raw(&["PING"]).await), refused);
    assert_eq!(errors(), 2, "the interval has not passed");
    // A new client connects at once, and the connection is everyone's.
    let mut fresh = RawClient::connect(lg.addr).await;
    assert_eq!(fresh.call_raw(&["PING"]).await, b"+PONG\r\n");
    assert_eq!(c.call_raw(&["PING"]).await, b"+PONG\r\n");
    assert_eq!(m.shared_connects.load(Ordering::Relaxed), 1);
    lg.stop().await;
}

/// A reply larger than `proxy.shared_session_reply_bytes` reaches a client
/// that reads it (the shared connection reads no more until the client has
/// taken half of what waits for it); before, the client was closed as soon
/// as the reply passed the bound (`passthrough_payloads`' 100 MB value, in
/// shared mode). A client that stops reading holds its shared connection's
/// other clients for `proxy.shared_reply_stall_ms` at most: then it is
/// closed, counted, and the others are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_larger_than_the_bound_reaches_its_reader_and_a_stalled_client_is_cut() {
    const BIG: usize = 32 << 20;
    let redis = RedisServer::start();
    let mut direct = RawClient::connect(redis.addr()).await;
    let value = "v".repeat(BIG);
    assert_eq!(direct.call_raw(&["SET", "big", &value]).await, b"+OK\r\n");
    let mut config = Config::default();
    config.upstream.addr = redis.addr();
    config.proxy.upstream = UpstreamMode::Shared;
    config.proxy.shared_upstream_connections = 1;
    config.proxy.shared_session_reply_bytes = 256 << 10;
    config.proxy.shared_reply_stall_ms = 300;
    let lg = Lockgate::start_with(config).await;
    let cut = &lg.ctx.upstream_conns.shared_session_output_limit;

    let mut reader = RawClient::connect(lg.addr).await;
    let reply = reader.call_raw(&["GET", "big"]).await;
    assert_eq!(reply.len(), BIG + format!("${BIG}\r\n\r\n").len());
    assert!(reply.starts_with(format!("${BIG}\r\nvvv").as_bytes()));
    assert_eq!(cut.load(Ordering::Relaxed), 0);

    // 32 MiB is more than the sockets between lockgate and the client
    // hold: a client that does not read stops taking.
    let mut stalled = RawClient::connect(lg.addr).await;
    stalled.send(&cmd(&["GET", "big"])).await;
    // Its reply has begun (so the next client's command is behind it on
    // the shared connection); then it reads no more.
    let head = stalled.read_exact_bytes(16).await;
    assert!(head.starts_with(format!("${BIG}\r\n").as_bytes()));
    let mut other = RawClient::connect(lg.addr).await;
    assert_eq!(other.call_raw(&["PING"]).await, b"+PONG\r\n");
    assert_eq!(cut.load(Ordering::Relaxed), 1);
    assert!(
        stalled.closed_within(support::WAIT).await,
        "the stalled client is closed"
    );
    assert_eq!(
        reader.call_raw(&["STRLEN", "big"]).await,
        format!(":{BIG}\r\n").as_bytes()
    );
    lg.stop().await;
}

/// `CLIENT SETINFO`, which client libraries send on connecting (Jedis 5,
/// redis-py 5+ over RESP2), keeps the client on its shared connection and
/// gets Redis's own reply there (Redis 7.0 has no `SETINFO`: its error).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_setinfo_stays_shared_with_redis_reply() {
    let redis = RedisServer::start();
    let lg = shared(&redis, 1).await;
    let setinfo = ["CLIENT", "SETINFO", "LIB-NAME", "lockgate-test"];
    let mut direct = RawClient::connect(redis.addr()).await;
    let want = direct.call_raw(&setinfo).await;
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(show(&c.call_raw(&setinfo).await), show(&want));
    assert_eq!(c.call_raw(&["SET", "k", "v"]).await, b"+OK\r\n");
    let m = &lg.ctx.upstream_conns;
    assert_eq!(m.moved_client.load(Ordering::Relaxed), 0, "not moved");
    assert_eq!(m.dedicated_open.load(Ordering::Relaxed), 0);
    lg.stop().await;
}
