//! Replica acknowledgement of grants made inside a client's `MULTI`
//! (`locks.replicas_ack`, issue 45), against a real primary and replica:
//! `MULTI; SETNX; EXPIRE; EXEC` is answered once the replica holds the
//! lock; with the replica SIGSTOPped the grant is undone and its place in
//! `EXEC`'s array says "not acquired" (or the pattern's error) while the
//! transaction's other commands keep their replies; resumed, granted
//! again; a lost attempt and a discarded transaction ask nothing. A
//! transaction of lock commands only, which a server that refuses
//! scripts runs as lockgate's own operations, waits the same.

use crate::support;

use support::locks::{exists, get, m};
use support::ops::base_config;
use support::passthrough::pipeline;
use support::process::Paused;
use support::resp::cmd;
use support::sentinel::Group;
use support::{Lockgate, RawClient};

/// `MULTI`, `commands`, `EXEC` in one write; `EXEC`'s reply and what
/// follows it (`after` more replies).
async fn transaction(lg: &Lockgate, commands: &[&[&str]], after: &[&[&str]]) -> String {
    let mut request = cmd(&["MULTI"]);
    for c in commands {
        request.extend_from_slice(&cmd(c));
    }
    request.extend_from_slice(&cmd(&["EXEC"]));
    for c in after {
        request.extend_from_slice(&cmd(c));
    }
    let n = commands.len() + 2 + after.len();
    let replies = pipeline(lg.addr, request, None, n).await;
    let text = String::from_utf8(replies).expect("utf-8 replies");
    // +OK for MULTI, +QUEUED for each command, then EXEC's array.
    let queued = "+OK\r\n".to_string() + &"+QUEUED\r\n".repeat(commands.len());
    assert!(text.starts_with(&queued), "{text}");
    text[queued.len()..].to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_inside_multi_wait_for_the_replica_and_are_undone_without_it() {
    let (primary, replica) = Group::pair().await;
    let mut config = base_config(&primary.addr());
    config.locks.replicas_ack = 1;
    config.locks.replicas_ack_timeout_ms = 300;
    config.locks.overrides.push(lockgate::config::LockOverride {
        pattern: "lock:err:*".into(),
        replicas_ack_refusal: Some(lockgate::config::AckRefusal::Error),
        ..Default::default()
    });
    let lg = Lockgate::start_with(config).await;
    let acks = lg.ctx.locks.replica_acks();
    let mut on_replica = RawClient::connect(replica.addr()).await;
    let mut on_primary = RawClient::connect(primary.addr()).await;

    // The incident's shape made atomic, with a plain write between.
    let setnx: &[&str] = &["SETNX", "lock:a", "v1"];
    let expire: &[&str] = &["EXPIRE", "lock:a", "30"];
    let plain: &[&str] = &["SET", "plain", "x"];
    let exec = transaction(&lg, &[setnx, plain, expire], &[&["GET", "plain"]]).await;
    assert_eq!(exec, "*3\r\n:1\r\n+OK\r\n:1\r\n$1\r\nx\r\n");
    // On the replica the moment EXEC is answered.
    assert_eq!(get(&mut on_replica, "lock:a").await.as_deref(), Some("v1"));
    // The grant and the extension, each acknowledged.
    assert_eq!(m(&acks.acknowledged), 2);
    // A lost attempt (the lock is held) asks nothing.
    let exec = transaction(&lg, &[&["SETNX", "lock:a", "v2"]], &[]).await;
    assert_eq!(exec, "*1\r\n:0\r\n");
    assert_eq!(m(&acks.acknowledged), 2);
    // A discarded transaction leaves nothing for the next EXEC.
    let mut app = RawClient::connect(lg.addr).await;
    assert_eq!(app.call_s(&["MULTI"]).await, "+OK\r\n");
    assert_eq!(app.call_s(&["SETNX", "lock:d", "v"]).await, "+QUEUED\r\n");
    assert_eq!(app.call_s(&["DISCARD"]).await, "+OK\r\n");
    assert_eq!(app.call_s(&["MULTI"]).await, "+OK\r\n");
    assert_eq!(app.call_s(&["GET", "plain"]).await, "+QUEUED\r\n");
    assert_eq!(app.call_s(&["EXEC"]).await, "*1\r\n$1\r\nx\r\n");
    assert_eq!(m(&acks.acknowledged) + m(&acks.timeouts), 2);

    // The replica stopped: each grant undone, its place refused, the
    // other commands' replies kept.
    let paused = Paused::stop(replica.pid()).await;
    let incr: &[&str] = &["INCR", "counter"];
    let shapes: &[&[&str]] = &[
        &["SETNX", "lock:b", "v"],
        incr,
        &["SET", "lock:c", "v", "NX", "PX", "30000"],
        &["SETNX", "lock:err:e", "v"],
    ];
    let exec = transaction(&lg, shapes, &[&["GET", "counter"]]).await;
    let (array, after) = exec.split_at(exec.find("$1\r\n1\r\n").expect("GET after EXEC"));
    assert_eq!(after, "$1\r\n1\r\n", "the reply after EXEC in its place");
    let refused = "-ERR lockgate: lock not granted: acknowledged by 0 of 1 replicas within 300 ms";
    assert!(
        array.starts_with("*4\r\n:0\r\n:1\r\n$-1\r\n")
            && array.contains(refused)
            && array.ends_with("(locks.replicas_ack)\r\n"),
        "{array}"
    );
    for key in ["lock:b", "lock:c", "lock:err:e"] {
        assert!(!exists(&mut on_primary, key).await, "{key} not undone");
        let owner = format!("lockgate:owner:{{{key}}}");
        assert!(!exists(&mut on_primary, &owner).await, "{owner} left");
    }
    assert_eq!(m(&acks.undone), 3);
    // Nobody holds them: the next attempt, once the replica is back, wins.
    paused.resume();
    let exec = transaction(&lg, &[&["SETNX", "lock:b", "w"]], &[]).await;
    assert_eq!(exec, "*1\r\n:1\r\n");
    assert_eq!(get(&mut on_replica, "lock:b").await.as_deref(), Some("w"));
    assert_eq!(m(&acks.acknowledged), 3);
    // A release between two grants in one transaction: all learned.
    let grant: &[&str] = &["SETNX", "lock:g", "v"];
    let del: &[&str] = &["DEL", "lock:g"];
    let exec = transaction(&lg, &[grant, del, &["SETNX", "lock:f", "v"]], &[]).await;
    assert_eq!(exec, "*3\r\n:1\r\n:1\r\n:1\r\n");
    assert_eq!(m(&acks.acknowledged), 5);
    let exec = transaction(&lg, &[grant], &[]).await;
    assert_eq!(exec, "*1\r\n:1\r\n", "the release was learned");
    // Never a wait without a bound: the stopped replica's round ended
    // at its timeout.
    assert!(m(&acks.timeouts) >= 3);
    lg.stop().await;
}

/// A transaction of lock commands only: on a server with scripts queued
/// as they are, on one that refuses them carried out by lockgate at
/// `EXEC` (`scripts/noscript-tests.sh` runs it so); either way answered
/// once the replica holds the lock, and undone without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_of_lock_commands_waits_on_any_server() {
    let (primary, replica) = Group::pair().await;
    let mut config = base_config(&primary.addr());
    config.locks.replicas_ack = 1;
    config.locks.replicas_ack_timeout_ms = 300;
    let lg = Lockgate::start_with(config).await;
    let acks = lg.ctx.locks.replica_acks();
    let mut on_replica = RawClient::connect(replica.addr()).await;
    let mut on_primary = RawClient::connect(primary.addr()).await;
    let exec = transaction(
        &lg,
        &[&["SETNX", "lock:a", "v"], &["EXPIRE", "lock:a", "30"]],
        &[],
    )
    .await;
    assert_eq!(exec, "*2\r\n:1\r\n:1\r\n");
    assert_eq!(get(&mut on_replica, "lock:a").await.as_deref(), Some("v"));
    assert_eq!(m(&acks.acknowledged), 2);
    let paused = Paused::stop(replica.pid()).await;
    let exec = transaction(&lg, &[&["SETNX", "lock:b", "v"]], &[]).await;
    assert_eq!(exec, "*1\r\n:0\r\n");
    assert!(!exists(&mut on_primary, "lock:b").await, "not undone");
    assert_eq!(m(&acks.undone), 1);
    paused.resume();
    let exec = transaction(&lg, &[&["SETNX", "lock:b", "v"]], &[]).await;
    assert_eq!(exec, "*1\r\n:1\r\n");
    lg.stop().await;
}
