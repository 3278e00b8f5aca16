//! Multi-key commands split between the quorum and the primary (`DEL`,
//! `UNLINK`, `EXISTS`, `TOUCH`, `MGET` over lock keys and other keys), and
//! transactions on the quorum keeping Redis's all-or-nothing rule, against
//! real redis-server processes (a primary and three masters).

use crate::support;

use lockgate::lock::quorum::MasterState;
use support::int;
use support::locks::{bulk, owner};
use support::quorum::{quorum_config, Cluster, NIL};
use support::resp::call;
use support::{cmd, RawClient};

/// `key` on the primary in database `db`, read over a fresh connection.
async fn primary_in_db(cl: &Cluster, db: &str, args: &[&str]) -> String {
    let mut c = RawClient::connect(cl.primary.addr()).await;
    assert_eq!(call(&mut c, &["SELECT", db]).await, "+OK\r\n");
    call(&mut c, args).await
}

/// True when no master holds `key` nor its owner record.
async fn gone_from_masters(cl: &Cluster, key: &str) -> bool {
    for i in 0..cl.masters.len() {
        if cl.on_master(i, &["EXISTS", key, &owner(key)]).await != ":0\r\n" {
            return false;
        }
    }
    true
}

/// `DEL`/`UNLINK` over lock keys and other keys: the lock keys are released
/// on the quorum (owner-checked), the others deleted on the primary, and
/// the reply is the sum, as Redis would count it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn del_and_unlink_split_between_quorum_and_primary() {
    let cl = Cluster::start(3, |_| {}).await;
    let mut c = cl.client().await;
    assert_eq!(call(&mut c, &["SET", "counter:x", "7"]).await, "+OK\r\n");
    assert_eq!(call(&mut c, &["SETNX", "lock:x", "mine"]).await, ":1\r\n");
    assert_eq!(
        call(&mut c, &["DEL", "lock:x", "counter:x", "counter:none"]).await,
        ":2\r\n"
    );
    assert_eq!(cl.on_primary(&["EXISTS", "counter:x"]).await, ":0\r\n");
    until!("lock:x released on every master", {
        gone_from_masters(&cl, "lock:x").await
    });

    // Another sidecar's lock is not released; the other keys are.
    let masters: Vec<String> = cl.masters.iter().map(|m| m.addr()).collect();
    let mut config = quorum_config(&cl.primary.addr(), &masters);
    config.locks.instance_id = "another-sidecar".to_string();
    let sidecar = support::Lockgate::start_with(config).await;
    let q = sidecar.ctx.locks.quorum().cloned().expect("a quorum");
    until!(
        "the other sidecar's masters up",
        q.masters.iter().all(|m| m.state() == MasterState::Up)
    );
    let mut theirs = RawClient::connect(sidecar.addr).await;
    assert_eq!(
        call(&mut theirs, &["SETNX", "lock:y", "theirs"]).await,
        ":1\r\n"
    );
    assert_eq!(call(&mut c, &["SET", "counter:y", "1"]).await, "+OK\r\n");
    assert_eq!(
        call(&mut c, &["UNLINK", "counter:y", "lock:y"]).await,
        ":1\r\n"
    );
    assert_eq!(cl.on_primary(&["EXISTS", "counter:y"]).await, ":0\r\n");
    for i in 0..3 {
        assert_eq!(cl.on_master(i, &["GET", "lock:y"]).await, bulk("theirs"));
    }
    // Its holder releases it along with keys that do not exist.
    assert_eq!(
        call(&mut theirs, &["UNLINK", "counter:none", "lock:y"]).await,
        ":1\r\n"
    );
    until!("lock:y released on every master", {
        gone_from_masters(&cl, "lock:y").await
    });
    // Never a lock key on the primary.
    assert_eq!(cl.on_primary(&["DBSIZE"]).await, ":0\r\n");
}

/// `EXISTS`, `TOUCH` (sums, repeated keys counted each time) and `MGET`
/// (values in argument order), in RESP2 and RESP3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exists_touch_and_mget_merge_as_redis_would() {
    let cl = Cluster::start(3, |_| {}).await;
    let mut c = cl.client().await;
    assert_eq!(call(&mut c, &["SET", "user:1", "u1"]).await, "+OK\r\n");
    assert_eq!(call(&mut c, &["SET", "user:2", "u2"]).await, "+OK\r\n");
    assert_eq!(call(&mut c, &["SETNX", "lock:a", "held"]).await, ":1\r\n");
    assert_eq!(
        call(
            &mut c,
            &[
                "EXISTS",
                "user:1",
                "lock:a",
                "lock:a",
                "user:none",
                "lock:none",
                "user:1"
            ]
        )
        .await,
        ":4\r\n"
    );
    assert_eq!(
        call(&mut c, &["TOUCH", "lock:a", "user:2", "lock:none"]).await,
        ":2\r\n"
    );
    let expected = format!(
        "*5\r\n{}{}{NIL}{NIL}{}",
        bulk("u1"),
        bulk("held"),
        bulk("u2")
    );
    assert_eq!(
        call(
            &mut c,
            &[
                "MGET",
                "user:1",
                "lock:a",
                "user:none",
                "lock:none",
                "user:2"
            ]
        )
        .await,
        expected
    );
    // Lock keys only.
    assert_eq!(
        call(&mut c, &["MGET", "lock:none", "lock:a"]).await,
        format!("*2\r\n{NIL}{}", bulk("held"))
    );
    // RESP3: the nulls are RESP3 nulls.
    let hello = call(&mut c, &["HELLO", "3"]).await;
    assert!(hello.starts_with('%'), "{hello:?}");
    assert_eq!(
        call(&mut c, &["MGET", "lock:a", "user:none", "user:1"]).await,
        format!("*3\r\n{}_\r\n{}", bulk("held"), bulk("u1"))
    );
    // Nothing was written anywhere it does not belong.
    assert_eq!(cl.on_primary(&["DBSIZE"]).await, ":2\r\n");
    for i in 0..3 {
        assert_eq!(
            cl.on_master(i, &["EXISTS", "user:1", "user:2"]).await,
            ":0\r\n"
        );
    }
}

/// A split command in a pipeline: every reply in command order, the primary
/// part run in its place among the client's other commands and in the
/// database the client selected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_commands_keep_pipeline_order_and_selected_db() {
    let cl = Cluster::start(3, |_| {}).await;
    let mut c = cl.client().await;
    assert_eq!(call(&mut c, &["SELECT", "2"]).await, "+OK\r\n");
    assert_eq!(call(&mut c, &["SETNX", "lock:p", "v"]).await, ":1\r\n");
    let pipeline: &[&[&str]] = &[
        &["SET", "counter:p", "1"],
        &["INCR", "counter:p"],
        &["MGET", "counter:p", "lock:p"],
        &["DEL", "lock:p", "counter:p"],
        &["EXISTS", "counter:p", "lock:p"],
        &["SET", "counter:p", "5"],
        &["MGET", "lock:p", "counter:p"],
        &["SETNX", "lock:q", "w"],
        &["EXISTS", "lock:q", "counter:p", "counter:p", "lock:p"],
        &["GET", "counter:p"],
    ];
    let mut bytes = Vec::new();
    for args in pipeline {
        bytes.extend_from_slice(&cmd(args));
    }
    c.send(&bytes).await;
    let mut replies = Vec::new();
    for _ in pipeline {
        replies.push(String::from_utf8_lossy(&c.read_raw().await).into_owned());
    }
    let expected = [
        "+OK\r\n".to_string(),
        ":2\r\n".to_string(),
        format!("*2\r\n{}{}", bulk("2"), bulk("v")),
        ":2\r\n".to_string(),
        ":0\r\n".to_string(),
        "+OK\r\n".to_string(),
        format!("*2\r\n{NIL}{}", bulk("5")),
        ":1\r\n".to_string(),
        ":3\r\n".to_string(),
        bulk("5"),
    ];
    assert_eq!(replies, expected);
    // The primary part ran in database 2, never in database 0.
    assert_eq!(
        primary_in_db(&cl, "2", &["GET", "counter:p"]).await,
        bulk("5")
    );
    assert_eq!(cl.on_primary(&["DBSIZE"]).await, ":0\r\n");
}

/// What needs atomicity across the two stores is still refused, and
/// changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_store_atomic_commands_stay_refused() {
    let cl = Cluster::start(3, |_| {}).await;
    let mut c = cl.client().await;
    assert_eq!(call(&mut c, &["SET", "user:1", "u"]).await, "+OK\r\n");
    let cases: &[&[&str]] = &[
        &["MSET", "lock:a", "x", "user:1", "y"],
        &["MSETNX", "user:2", "x", "lock:a", "y"],
        &["RENAME", "user:1", "lock:z"],
        &["RENAMENX", "user:1", "lock:z"],
        &["COPY", "user:1", "lock:z"],
        &["SMOVE", "user:s", "lock:z", "m"],
        &["LMOVE", "user:l", "lock:z", "LEFT", "RIGHT"],
        &["RPOPLPUSH", "user:l", "lock:z"],
        &["SUNIONSTORE", "lock:z", "user:s"],
    ];
    assert_eq!(call(&mut c, &["SADD", "user:s", "m"]).await, ":1\r\n");
    assert_eq!(call(&mut c, &["RPUSH", "user:l", "e"]).await, ":1\r\n");
    for args in cases {
        let reply = call(&mut c, args).await;
        assert!(
            reply.starts_with(&format!("-ERR lockgate: {}", args[0])),
            "{args:?}: {reply:?}"
        );
    }
    assert_eq!(
        cl.on_primary(&["EXISTS", "lock:a", "lock:z", "user:2"])
            .await,
        ":0\r\n"
    );
    assert_eq!(cl.on_primary(&["GET", "user:1"]).await, bulk("u"));
    assert_eq!(cl.on_primary(&["SCARD", "user:s"]).await, ":1\r\n");
    assert_eq!(cl.on_primary(&["LLEN", "user:l"]).await, ":1\r\n");
    for i in 0..3 {
        assert_eq!(cl.on_master(i, &["DBSIZE"]).await, ":0\r\n");
    }
}

/// A command refused while queuing aborts the transaction whole, as Redis
/// does for a command it rejects at queue time: `EXEC` answers
/// `-EXECABORT` and nothing queued runs, on either store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_refused_while_queuing_aborts_the_transaction() {
    const ABORT: &str = "-EXECABORT Transaction discarded because of previous errors.\r\n";
    let cl = Cluster::start(3, |_| {}).await;
    let mut c = cl.client().await;
    assert_eq!(call(&mut c, &["SETNX", "lock:x", "mine"]).await, ":1\r\n");
    assert_eq!(call(&mut c, &["SET", "counter:x", "1"]).await, "+OK\r\n");
    // A majority's "yes" answers the client; on a loaded box the third
    // master's write may land moments later, and the check after the
    // aborted EXEC below needs the lock on all three.
    until!("lock:x on every master", {
        let mut all = true;
        for i in 0..3 {
            all &= cl.on_master(i, &["GET", "lock:x"]).await == bulk("mine");
        }
        all
    });

    // Lock commands queued by lockgate.
    assert_eq!(call(&mut c, &["MULTI"]).await, "+OK\r\n");
    let refused = call(&mut c, &["HSET", "lock:x", "f", "v"]).await;
    assert!(refused.starts_with("-ERR lockgate: "), "{refused:?}");
    assert_eq!(call(&mut c, &["DEL", "lock:x"]).await, "+QUEUED\r\n");
    assert_eq!(call(&mut c, &["EXEC"]).await, ABORT);
    for i in 0..3 {
        assert_eq!(cl.on_master(i, &["GET", "lock:x"]).await, bulk("mine"));
    }

    // Commands queued by Redis.
    assert_eq!(call(&mut c, &["MULTI"]).await, "+OK\r\n");
    assert_eq!(call(&mut c, &["INCR", "counter:x"]).await, "+QUEUED\r\n");
    let refused = call(&mut c, &["DEL", "lock:x", "counter:x"]).await;
    assert!(refused.contains("different stores"), "{refused:?}");
    assert_eq!(call(&mut c, &["EXEC"]).await, ABORT);
    assert_eq!(cl.on_primary(&["GET", "counter:x"]).await, bulk("1"));

    // Not left inside a transaction; the next one runs.
    assert_eq!(call(&mut c, &["PING"]).await, "+PONG\r\n");
    assert_eq!(call(&mut c, &["MULTI"]).await, "+OK\r\n");
    assert_eq!(call(&mut c, &["DEL", "lock:x"]).await, "+QUEUED\r\n");
    assert_eq!(call(&mut c, &["EXEC"]).await, "*1\r\n:1\r\n");
    until!("lock:x released", gone_from_masters(&cl, "lock:x").await);
    // DISCARD forgets the error.
    assert_eq!(call(&mut c, &["MULTI"]).await, "+OK\r\n");
    let refused = call(&mut c, &["HSET", "lock:x", "f", "v"]).await;
    assert!(refused.starts_with("-ERR lockgate: "), "{refused:?}");
    assert_eq!(call(&mut c, &["DISCARD"]).await, "+OK\r\n");
    assert_eq!(call(&mut c, &["MULTI"]).await, "+OK\r\n");
    assert_eq!(call(&mut c, &["INCR", "counter:x"]).await, "+QUEUED\r\n");
    assert_eq!(call(&mut c, &["EXEC"]).await, "*1\r\n:2\r\n");
}

/// Reads of lock keys inside a quorum transaction are answered from the
/// quorum at `EXEC`, each in its place in the array; a refused `PERSIST`
/// takes its own place too, so the array has one reply per queued command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_inside_a_quorum_transaction_answer_at_exec() {
    let cl = Cluster::start(3, |_| {}).await;
    let mut c = cl.client().await;
    assert_eq!(
        call(&mut c, &["SET", "lock:r", "mine", "NX", "PX", "20000"]).await,
        "+OK\r\n"
    );
    assert_eq!(call(&mut c, &["MULTI"]).await, "+OK\r\n");
    let queued: &[&[&str]] = &[
        &["GET", "lock:r"],
        &["SETNX", "lock:s", "1"],
        &["EXISTS", "lock:r", "lock:s", "lock:none"],
        &["PEXPIRE", "lock:s", "9000"],
        &["PTTL", "lock:s"],
        &["TTL", "lock:r"],
        &["DEL", "lock:r"],
        &["GET", "lock:r"],
        &["PERSIST", "lock:s"],
    ];
    for args in queued {
        assert_eq!(call(&mut c, args).await, "+QUEUED\r\n", "{args:?}");
    }
    c.send(&cmd(&["EXEC"])).await;
    let exec = String::from_utf8_lossy(&c.read_raw().await).into_owned();
    let lines: Vec<&str> = exec.split("\r\n").collect();
    assert_eq!(lines[0], "*9", "{exec:?}");
    let head = format!("*9\r\n{}:1\r\n:2\r\n:1\r\n", bulk("mine"));
    assert!(exec.starts_with(&head), "{exec:?}");
    let rest = &exec[head.len()..];
    let mut frames = rest.split_inclusive("\r\n");
    let pttl = int(frames.next().unwrap_or_default());
    assert!(pttl > 8_000 && pttl <= 9_000, "PTTL {pttl}: {exec:?}");
    let ttl = int(frames.next().unwrap_or_default());
    assert!(ttl > 15 && ttl <= 20, "TTL {ttl}: {exec:?}");
    assert_eq!(frames.next(), Some(":1\r\n"), "{exec:?}");
    assert_eq!(frames.next(), Some(NIL), "{exec:?}");
    let persist = frames.next().unwrap_or_default();
    assert!(
        persist.starts_with("-ERR lockgate: PERSIST refused"),
        "{exec:?}"
    );
    // It all ran on the quorum.
    for i in 0..3 {
        assert_eq!(cl.on_master(i, &["EXISTS", "lock:r"]).await, ":0\r\n");
        assert_eq!(cl.on_master(i, &["GET", "lock:s"]).await, bulk("1"));
    }
    assert_eq!(cl.on_primary(&["DBSIZE"]).await, ":0\r\n");

    // A PERSIST among commands on the primary stays Redis's to answer.
    assert_eq!(call(&mut c, &["MULTI"]).await, "+OK\r\n");
    assert_eq!(call(&mut c, &["INCR", "counter:n"]).await, "+QUEUED\r\n");
    assert_eq!(call(&mut c, &["PERSIST", "lock:s"]).await, "+QUEUED\r\n");
    let exec = call(&mut c, &["EXEC"]).await;
    assert!(
        exec.starts_with("*2\r\n:1\r\n-ERR lockgate: PERSIST refused"),
        "{exec:?}"
    );
}
