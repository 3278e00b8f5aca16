//! The dispatcher driven with bytes, no sockets: a context whose lock
//! store reaches nothing ([`ServerContext::offline`]), on one Redis or on
//! three lock masters. Each case gives the commands a client sends in one
//! read and checks what goes upstream (as commands) and what the writer
//! half is told to expect, in order.

use super::*;
use crate::config::Config;
use crate::protocol::request::RequestLimits;
use crate::session::jobs::{self, Runner};
use crate::session::pending::Pending;

/// A session's dispatcher over an offline context.
struct Fixture {
    dispatch: Dispatch,
    ctx: Arc<ServerContext>,
    // Kept: its end of the job queue stays open (nothing runs the jobs).
    _runner: Runner,
}

/// What one read batch became.
#[derive(Debug)]
struct Seen {
    /// The commands sent upstream, each as its name and its keys (a lock
    /// script: its name and the key it locks).
    up: Vec<String>,
    /// What the writer half was told, one word per entry.
    told: Vec<String>,
    /// The batch ended with work lockgate does itself.
    held: bool,
    /// A malformed request ended it.
    failed: bool,
}

fn fixture(config: Config) -> Fixture {
    let ctx = Arc::new(ServerContext::offline(config));
    let conn = Arc::new(Mutex::new(ctx.locks.conn_locks()));
    let (jobs, runner) = jobs::queue(16);
    Fixture {
        dispatch: Dispatch::new(ctx.clone(), conn, jobs),
        ctx,
        _runner: runner,
    }
}

/// A configuration with lock keys on three lock masters (never reached).
fn on_masters() -> Config {
    let mut config = Config::default();
    config.locks.quorum.masters = ["a:1", "b:1", "c:1"].map(String::from).to_vec();
    config
}

impl Fixture {
    /// Sends `lines` (commands, arguments split at spaces) in one read.
    fn send(&mut self, lines: &[&str]) -> Seen {
        let mut buf = Vec::new();
        for line in lines {
            let args: Vec<&[u8]> = line.split(' ').map(str::as_bytes).collect();
            buf.extend_from_slice(&encode::command(&args));
        }
        let routed = self.dispatch.batch(&buf);
        // A batch that ends with lockgate's own work leaves the rest for
        // the next batch, once that work is done.
        if routed.hold.is_none() {
            assert_eq!(routed.used, buf.len(), "every complete request is consumed");
        }
        let up = routed
            .pieces
            .assemble(Bytes::copy_from_slice(&buf[..routed.used]));
        Seen {
            up: commands(&up),
            told: routed.batch.entries.iter().map(told).collect(),
            held: routed.hold.is_some(),
            failed: routed.failed,
        }
    }
}

/// The commands in `bytes`, each shown as its name and keys: a script call
/// (`EVAL`, `EVALSHA`) as its name and its first key, `SCRIPT LOAD` bare.
fn commands(bytes: &[u8]) -> Vec<String> {
    let mut parser = RequestParser::new(RequestLimits {
        max_bulk_bytes: 1 << 20,
        max_multibulk_len: 1 << 10,
        max_inline_bytes: 1 << 10,
        max_request_bytes: 1 << 20,
    });
    let mut out = Vec::new();
    let mut rest = bytes;
    while let Some(req) = parser.parse(rest).expect("lockgate sends valid RESP") {
        let args: Vec<String> = (0..parser.argc())
            .map(|i| String::from_utf8_lossy(parser.arg(rest, i)).into_owned())
            .collect();
        out.push(match args[0].to_ascii_uppercase().as_str() {
            "SCRIPT" => format!("SCRIPT {}", args[1]),
            name @ ("EVAL" | "EVALSHA") if args.len() > 3 && args[2] != "0" => {
                format!("{name} {}", args[3])
            }
            name @ ("EVAL" | "EVALSHA") => name.to_string(),
            _ => args.join(" "),
        });
        rest = &rest[req.len..];
    }
    out
}

/// One entry for the writer half, as a word (a local reply: its RESP2
/// bytes).
fn told(p: &Pending) -> String {
    match p {
        Pending::Upstream(n) => format!("upstream {n}"),
        Pending::Local(reply) => {
            let bytes = reply.to_bytes(false);
            String::from_utf8_lossy(bytes.trim_ascii_end()).into_owned()
        }
        Pending::Deferred(_) => "deferred".into(),
        Pending::Silent(_) => "silent".into(),
        Pending::Lock(lock) => {
            let (fast, pending) = match &lock.0 {
                LockPending::Fast { then, .. } => ("fast ", &**then),
                p => ("", p),
            };
            let what = match pending {
                LockPending::Acquire { db, park, .. } => {
                    let rerun = if lock.1.is_some() { " by sha" } else { "" };
                    let park = if park.is_some() { " parkable" } else { "" };
                    format!("acquire in {db:?}{park}{rerun}")
                }
                LockPending::Release { keys, .. } => format!("release {}", keys.len()),
                LockPending::Script { keys, .. } => format!("script on {}", keys.len()),
                LockPending::Forget(what) => format!("forget {what:?}"),
                other => format!("{other:?}"),
            };
            format!("{fast}{what}")
        }
        Pending::Swallow => "swallow".into(),
        Pending::Close => "close".into(),
        Pending::Hello => "hello".into(),
        other => format!("{other:?}"),
    }
}

/// Plain commands go up as the client sent them, one run of replies; a
/// bare SETNX on a lock key becomes the acquisition script, loaded once
/// per connection and then called by SHA1.
#[test]
fn plain_commands_pass_and_a_lock_key_is_leased() {
    let mut f = fixture(Config::default());
    let seen = f.send(&["GET a", "SET b 1", "PING"]);
    assert_eq!(seen.up, ["GET a", "SET b 1", "PING"]);
    assert_eq!(seen.told, ["upstream 3"]);
    let seen = f.send(&["GET a", "SETNX lock:a 1"]);
    assert_eq!(seen.up, ["GET a", "SCRIPT LOAD", "EVALSHA lock:a"]);
    assert_eq!(
        seen.told,
        ["upstream 1", "swallow", "fast acquire in Zero by sha"]
    );
    let seen = f.send(&["SETNX lock:b 1", "DEL lock:b"]);
    assert_eq!(seen.up, ["EVALSHA lock:b", "SCRIPT LOAD", "EVALSHA lock:b"]);
    assert_eq!(
        seen.told,
        ["fast acquire in Zero by sha", "swallow", "release 1"],
        "the release script is loaded the first time too"
    );
    assert!(!seen.held && !seen.failed);
}

/// What the router's answer carries into the session: the database a
/// `SELECT` picks (the contention table learns database 0 only), `MULTI`
/// (a lock command goes as `EVAL`, answered in `EXEC`'s array), and
/// `CLIENT REPLY OFF` (nothing is written for the command).
#[test]
fn the_view_after_each_command_is_the_routers() {
    let mut f = fixture(Config::default());
    let seen = f.send(&["SELECT 3", "SETNX lock:a 1"]);
    assert_eq!(seen.up, ["SELECT 3", "SCRIPT LOAD", "EVALSHA lock:a"]);
    assert_eq!(
        seen.told,
        ["upstream 1", "swallow", "fast acquire in Other by sha"]
    );
    let seen = f.send(&[
        "SELECT 0",
        "MULTI",
        "SETNX lock:a 1",
        "PERSIST lock:a",
        "EXEC",
    ]);
    assert_eq!(
        seen.up,
        ["SELECT 0", "MULTI", "EVAL lock:a", "EVAL", "EXEC"],
        "inside MULTI a refusal is Redis's error in its slot"
    );
    assert_eq!(seen.told, ["upstream 5"]);
    let seen = f.send(&["CLIENT REPLY OFF", "SETNX lock:c 1", "CLIENT REPLY ON"]);
    assert_eq!(
        seen.up,
        ["CLIENT REPLY OFF", "EVAL lock:c", "CLIENT REPLY ON"]
    );
    assert_eq!(seen.told, ["upstream 1"]);
}

/// `LOCKGATE` commands behind the admin password: refused before
/// `LOCKGATE AUTH`, a wrong password refused, the right one accepted for
/// the rest of the connection.
#[test]
fn the_admin_gate_follows_lockgate_auth() {
    let mut config = Config::default();
    config.admin.password = "s3cret".into();
    let mut f = fixture(config);
    let seen = f.send(&[
        "LOCKGATE UNMATCHED",
        "LOCKGATE AUTH wrong",
        "LOCKGATE AUTH s3cret",
        "LOCKGATE UNMATCHED",
    ]);
    assert!(seen.up.is_empty(), "{seen:?}");
    assert_eq!(
        seen.told,
        [
            "-NOPERM lockgate: LOCKGATE AUTH <password> required first",
            "-WRONGPASS lockgate: invalid LOCKGATE password",
            "+OK",
            "*0",
        ]
    );
}

/// With lock keys on the quorum, a lock command is carried out away from
/// the client's connection, and what the client pipelined after it waits
/// for it; a script body sent with `EVAL` is remembered for masters that
/// lose it (a `SCRIPT LOAD`ed one is also loaded on every master: a
/// task, so this test runs in a runtime).
#[tokio::test]
async fn on_the_quorum_a_lock_command_holds_the_batch() {
    let mut f = fixture(on_masters());
    let seen = f.send(&["GET a", "DEL lock:a", "GET b"]);
    assert_eq!(seen.up, ["GET a"], "GET b waits for the release");
    let rest = f.send(&["GET b"]);
    assert_eq!(rest.up, ["GET b"]);
    assert_eq!(seen.told, ["upstream 1", "deferred"]);
    assert!(seen.held);
    let q = f.ctx.locks.quorum().expect("on masters").clone();
    assert!(q.scripts.is_empty());
    let seen = f.send(&["EVAL return(1) 0", "SCRIPT LOAD return(2)"]);
    assert_eq!(seen.up, ["EVAL", "SCRIPT LOAD"]);
    assert_eq!(q.scripts.len(), 2, "both bodies remembered");
}

/// A transaction on the quorum: lock commands queued by lockgate and run
/// at `EXEC` in place of Redis's (discarded) transaction; one that also
/// queued commands on the primary is refused whole; one with a command
/// refused while queuing aborts.
#[test]
fn a_quorum_transaction_is_queued_by_lockgate() {
    let mut f = fixture(on_masters());
    let seen = f.send(&["MULTI", "SETNX lock:a 1", "GET lock:a", "EXEC"]);
    assert_eq!(seen.up, ["MULTI", "DISCARD"]);
    assert_eq!(
        seen.told,
        ["upstream 1", "+QUEUED", "+QUEUED", "swallow", "deferred"]
    );
    assert!(seen.held);
    let seen = f.send(&["MULTI", "SET user:1 x", "SETNX lock:a 1", "EXEC"]);
    assert_eq!(seen.up, ["MULTI", "SET user:1 x", "DISCARD"]);
    assert_eq!(seen.told[..2], ["upstream 2", "+QUEUED"]);
    assert!(seen.told[3].starts_with("-EXECABORT lockgate: the transaction mixes"));
    let seen = f.send(&["MULTI", "HSET lock:a f v", "SETNX lock:a 1", "EXEC"]);
    assert_eq!(seen.up, ["MULTI", "DISCARD"]);
    assert!(seen.told[1].starts_with("-ERR lockgate: HSET is not supported"));
    assert_eq!(
        seen.told[4],
        "-EXECABORT Transaction discarded because of previous errors."
    );
    // Nothing queued is left over for the next transaction.
    let seen = f.send(&["MULTI", "SET user:2 y", "EXEC"]);
    assert_eq!(seen.up, ["MULTI", "SET user:2 y", "EXEC"]);
    assert_eq!(seen.told, ["upstream 3"]);
}

/// A malformed request ends the batch with Redis's kind of error and a
/// close, after what came before it.
#[test]
fn a_malformed_request_closes_after_its_error() {
    let mut f = fixture(Config::default());
    let routed = f.dispatch.batch(b"*1\r\n$4\r\nPING\r\n*1\r\n$x\r\n");
    assert!(routed.failed);
    let told: Vec<String> = routed.batch.entries.iter().map(told).collect();
    assert_eq!(told.len(), 3, "{told:?}");
    assert_eq!(told[0], "upstream 1");
    assert!(told[1].starts_with("-ERR Protocol error"), "{told:?}");
    assert_eq!(told[2], "close");
}

/// On a connection whose replies are not counted (MONITOR), a transaction
/// is Redis's alone even with lock keys on the quorum: lockgate queues
/// nothing and, at `EXEC`, sends no `DISCARD` whose reply it would wait to
/// swallow (the router fuzzer's find); the lock command is refused there.
#[test]
fn a_raw_connection_keeps_its_transaction_on_redis() {
    let mut f = fixture(on_masters());
    let seen = f.send(&["MONITOR", "MULTI", "SETNX lock:a 1", "EXEC"]);
    assert_eq!(seen.up, ["MONITOR", "MULTI", "EXEC"], "{seen:?}");
    assert!(!seen.told.iter().any(|t| t == "swallow"), "{seen:?}");
    assert!(
        seen.told
            .iter()
            .any(|t| t.starts_with("-ERR lockgate: lock commands are refused")),
        "{seen:?}"
    );
}

/// The frames handed upstream describe the plain commands at the front of
/// what goes there, and stop at the first command lockgate rewrites; none
/// are kept unless asked for.
#[test]
fn frames_describe_the_plain_commands_in_front() {
    let mut f = fixture(Config::default());
    let encode_all = |lines: &[&str]| {
        let mut buf = Vec::new();
        for line in lines {
            let args: Vec<&[u8]> = line.split(' ').map(str::as_bytes).collect();
            buf.extend_from_slice(&encode::command(&args));
        }
        buf
    };
    let buf = encode_all(&["GET a", "SET b 1", "SETNX lock:a 1", "GET c"]);
    assert!(f.dispatch.batch(&buf).frames.is_empty(), "not asked for");
    f.dispatch.keep_frames(true);
    let mut routed = f.dispatch.batch(&buf);
    let up = routed
        .pieces
        .assemble(Bytes::copy_from_slice(&buf[..routed.used]));
    let plain = encode_all(&["GET a", "SET b 1"]);
    assert_eq!(routed.frames.bytes(), plain.len(), "the two plain ones");
    let mut names = Vec::new();
    let mut at = 0;
    while let Some(frame) = routed.frames.front() {
        let args: Vec<&[u8]> = (0..frame.argc()).map(|i| frame.arg(&up[at..], i)).collect();
        names.push(args.join(&b' '));
        at += frame.len;
        routed.frames.pop(frame.len);
    }
    assert_eq!(names, [b"GET a".to_vec(), b"SET b 1".to_vec()]);
    // An inline command is not framed, nor anything after it.
    let mut inline = b"GET a\r\n".to_vec();
    inline.extend(encode_all(&["GET b"]));
    assert!(f.dispatch.batch(&inline).frames.is_empty(), "inline");
}
