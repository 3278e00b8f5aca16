//! Locks on a server that refuses scripts (`EVAL`, `EVALSHA`, `FUNCTION`
//! and `FCALL` renamed away, or an ACL without them): every lock
//! operation is carried out as a `WATCH`/`MULTI`/`EXEC` transaction on
//! lockgate's own connections (`src/lock/txn/`), with the scripts'
//! guarantees. Against real redis-server and valkey-server processes.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use crate::support;

use lockgate::config::LockOverride;
use support::locks::*;
use support::{cmd, Lockgate, RawClient, RedisServer};

/// A redis-server that refuses scripts (`EVAL`, `EVALSHA`, `FUNCTION`
/// and `FCALL` renamed away, as some managed services do).
fn without_scripts() -> RedisServer {
    RedisServer::start_with(&support::redis::NO_SCRIPTS)
}

/// On a server that refuses scripts, lock commands are carried out as
/// `WATCH`/`MULTI`/`EXEC` transactions with every guarantee of the
/// scripts: the lease and the owner record written together, the release
/// and the extension owner-checked, a lock deleted behind lockgate's back
/// repaired by the next acquisition. Detected as lockgate's own
/// connection opens: no command is refused.
#[tokio::test]
async fn a_server_without_scripts_gets_locks_as_transactions() {
    let redis = without_scripts();
    let lg = Lockgate::start_with(support::locks::config(&redis.addr(), "a", 20_000)).await;
    let mut c = RawClient::connect(lg.addr).await;
    let mut r = RawClient::connect(redis.addr()).await;
    assert_eq!(c.call(&["SET", "data:x", "1"]).await, "+OK\r\n");
    assert_eq!(c.call(&["SETNX", "lock:x", "1"]).await, ":1\r\n");
    // Opened after the acquisition: not the connection that made it
    // (the pooled rule), so it may not release it.
    let mut c2 = RawClient::connect(lg.addr).await;
    assert_lease(&mut r, "lock:x", 19_000, 20_000).await;
    let token = owner_of(&mut r, "lock:x").await.expect("owner record");
    assert!(token.starts_with("a:"), "{token}");
    assert_within(
        "owner record's lease",
        pttl(&mut r, &owner("lock:x")).await,
        19_000,
        20_000,
    );
    // Held: another connection neither acquires nor releases it.
    assert_eq!(c2.call(&["SETNX", "lock:x", "2"]).await, ":0\r\n");
    assert_eq!(c2.call(&["DEL", "lock:x"]).await, ":0\r\n");
    assert_eq!(c2.call(&["EXPIRE", "lock:x", "100"]).await, ":0\r\n");
    assert_eq!(get(&mut r, "lock:x").await.as_deref(), Some("1"));
    // The holder extends it: the owner record moves with it.
    assert_eq!(c.call(&["EXPIRE", "lock:x", "40"]).await, ":1\r\n");
    assert_lease(&mut r, "lock:x", 39_000, 40_000).await;
    assert_within(
        "owner record's lease",
        pttl(&mut r, &owner("lock:x")).await,
        39_000,
        40_000,
    );
    // And releases it, with a plain key in the same DEL.
    assert_eq!(c.call(&["DEL", "lock:x", "data:x"]).await, ":2\r\n");
    assert!(!exists(&mut r, "lock:x").await);
    assert!(owner_of(&mut r, "lock:x").await.is_none());
    // SET NX PX and SET NX GET keep their shapes.
    assert_eq!(
        c.call(&["SET", "lock:y", "v", "NX", "PX", "5000"]).await,
        "+OK\r\n"
    );
    assert_lease(&mut r, "lock:y", 4_000, 5_000).await;
    assert_eq!(c2.call(&["SET", "lock:y", "w", "NX"]).await, "$-1\r\n");
    assert_eq!(
        c2.call(&["SET", "lock:y", "w", "NX", "GET"]).await,
        "$1\r\nv\r\n"
    );
    let refused = c2.call(&["SET", "lock:z", "w", "NX", "PX", "0"]).await;
    assert_eq!(refused, "-ERR invalid expire time in 'set' command\r\n");
    assert!(!exists(&mut r, "lock:z").await);

    // Deleted behind lockgate's back, mid-cycle: the owner record left
    // behind does not hold the next acquirer off (through another
    // instance, which knows nothing of the key), and the first holder's
    // late release does not free the second's lock.
    let lg2 = Lockgate::start_with(support::locks::config(&redis.addr(), "b", 20_000)).await;
    let mut other = RawClient::connect(lg2.addr).await;
    assert_eq!(c.call(&["SETNX", "lock:d", "1"]).await, ":1\r\n");
    assert_eq!(r.call(&["DEL", "lock:d"]).await, ":1\r\n");
    assert!(owner_of(&mut r, "lock:d").await.is_some());
    assert_eq!(other.call(&["SETNX", "lock:d", "2"]).await, ":1\r\n");
    assert!(owner_of(&mut r, "lock:d")
        .await
        .is_some_and(|o| o.starts_with("b:")));
    assert_eq!(c.call(&["DEL", "lock:d"]).await, ":0\r\n");
    assert_eq!(get(&mut r, "lock:d").await.as_deref(), Some("2"));
    assert_eq!(other.call(&["DEL", "lock:d"]).await, ":1\r\n");
    // Its lease cut short behind lockgate's back (both keys, as a lease
    // running out does), the lock taken through the other instance: the
    // first holder's extension touches nothing.
    assert_eq!(c.call(&["SETNX", "lock:e", "1"]).await, ":1\r\n");
    assert_eq!(r.call(&["PEXPIRE", "lock:e", "1"]).await, ":1\r\n");
    assert_eq!(r.call(&["PEXPIRE", &owner("lock:e"), "1"]).await, ":1\r\n");
    until!("the cut lease to end", !exists(&mut r, "lock:e").await);
    assert_eq!(other.call(&["SETNX", "lock:e", "2"]).await, ":1\r\n");
    let denied = m(&lg.ctx.locks.metrics.extend_denied);
    assert_eq!(c.call(&["EXPIRE", "lock:e", "100"]).await, ":0\r\n");
    assert!(owner_of(&mut r, "lock:e")
        .await
        .is_some_and(|o| o.starts_with("b:")));
    assert_lease(&mut r, "lock:e", 19_000, 20_000).await;
    assert_eq!(m(&lg.ctx.locks.metrics.extend_denied), denied + 1);
    lg2.stop().await;

    let txn = &lg.ctx.locks.transactions().expect("transactions").metrics;
    assert!(m(&txn.runs) >= 8, "{}", m(&txn.runs));
    assert_eq!(m(&txn.failures), 0);
    assert_eq!(m(&lg.ctx.locks.metrics.scripts_refused), 0);
    lg.stop().await;
}

/// lockgate found that the server refuses scripts.
fn scriptless(lg: &Lockgate) -> bool {
    lg.ctx.locks.transactions().is_some_and(|t| t.scriptless())
}

/// The lock transaction runs where the client's command was: after every
/// command the client sent before it (a `GET` of the lock pipelined ahead
/// sees no lock), before every command after it.
#[tokio::test]
async fn pipelined_lock_commands_keep_their_place() {
    let redis = without_scripts();
    let lg = Lockgate::start_with(support::locks::config(&redis.addr(), "a", 20_000)).await;
    // Before lockgate's own connection has seen the server, a lock command
    // goes as a script, and its transaction runs in its place after the
    // refusal, behind what was pipelined after it (a rerun, as after
    // `NOSCRIPT`): this test is about what follows the detection.
    until!("the server seen without scripts", scriptless(&lg));
    let mut c = RawClient::connect(lg.addr).await;
    let mut out = Vec::new();
    for args in [
        &["GET", "lock:o"][..],
        &["SETNX", "lock:o", "v"],
        &["GET", "lock:o"],
        &["SET", "plain", "x"],
        &["DEL", "lock:o"],
        &["GET", "lock:o"],
        &["SETNX", "lock:o", "w"],
        &["PTTL", "lock:o"],
    ] {
        out.extend_from_slice(&cmd(args));
    }
    c.send(&out).await;
    let replies = String::from_utf8_lossy(&c.read_raw_frames(8).await).to_string();
    let want = "$-1\r\n:1\r\n$1\r\nv\r\n+OK\r\n:1\r\n$-1\r\n:1\r\n:";
    assert!(replies.starts_with(want), "{replies:?}");
    lg.stop().await;
}

/// An ACL that denies scripts is not visible as lockgate's own connection
/// opens (`EVALSHA` is known): the first lock command Redis refuses is
/// carried out as a transaction in its place, and every later one goes
/// as a transaction at once.
#[tokio::test]
async fn an_acl_without_scripts_is_found_at_the_first_refusal() {
    let redis = RedisServer::start();
    let mut r = RawClient::connect(redis.addr()).await;
    let acl = [
        "ACL",
        "SETUSER",
        "app",
        "on",
        ">pw",
        "~*",
        "&*",
        "+@all",
        "-@scripting",
    ];
    assert_eq!(r.call(&acl).await, "+OK\r\n");
    let mut config = support::locks::config(&redis.addr(), "a", 20_000);
    config.upstream.username = "app".to_string();
    config.upstream.password = "pw".to_string();
    let lg = Lockgate::start_with(config).await;
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(c.call(&["AUTH", "app", "pw"]).await, "+OK\r\n");
    let refused = c.call(&["EVAL", "return 1", "0"]).await;
    assert!(refused.starts_with("-NOPERM"), "{refused}");
    assert_eq!(c.call(&["SETNX", "lock:acl", "1"]).await, ":1\r\n");
    assert_lease(&mut r, "lock:acl", 19_000, 20_000).await;
    assert!(owner_of(&mut r, "lock:acl").await.is_some(), "owner record");
    assert_eq!(c.call(&["EXPIRE", "lock:acl", "30"]).await, ":1\r\n");
    assert_lease(&mut r, "lock:acl", 29_000, 30_000).await;
    assert_eq!(c.call(&["DEL", "lock:acl"]).await, ":1\r\n");
    assert!(!exists(&mut r, "lock:acl").await);
    assert!(owner_of(&mut r, "lock:acl").await.is_none());
    let txn = lg.ctx.locks.transactions().expect("transactions");
    assert!(txn.scriptless());
    assert!(m(&txn.metrics.runs) >= 3);
    assert_eq!(m(&lg.ctx.locks.metrics.scripts_refused), 0);

    // The way back, without a restart: scripts granted, and once
    // lockgate's own connection to the primary has opened again (cut
    // here) it finds `EVALSHA` known, and lock commands go as scripts.
    let up = || {
        let s = &lg.ctx.primary.state;
        (
            s.up.load(Ordering::Relaxed),
            s.connects.load(Ordering::Relaxed),
        )
    };
    let connects = up().1;
    assert_eq!(
        r.call(&["ACL", "SETUSER", "app", "+@scripting"]).await,
        "+OK\r\n"
    );
    let killed = r.call(&["CLIENT", "KILL", "USER", "app"]).await;
    assert!(killed.starts_with(':'), "{killed}");
    until!("lockgate's own connection back", {
        let (is_up, n) = up();
        is_up && n > connects
    });
    until!("scripts again", !txn.scriptless());
    let runs = m(&txn.metrics.runs);
    let evalsha =
        |stats: &[u8]| support::redis::command_calls(&String::from_utf8_lossy(stats), "evalsha");
    let before = evalsha(&r.call_raw(&["INFO", "commandstats"]).await);
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(c.call(&["AUTH", "app", "pw"]).await, "+OK\r\n");
    assert_eq!(c.call(&["SETNX", "lock:acl", "2"]).await, ":1\r\n");
    assert_eq!(c.call(&["DEL", "lock:acl"]).await, ":1\r\n");
    assert!(evalsha(&r.call_raw(&["INFO", "commandstats"]).await) > before);
    assert_eq!(m(&txn.metrics.runs), runs, "no transaction");
    lg.stop().await;
}

/// Valkey 9.1 without scripts: the same cycle (its `MSETEX` is not used
/// then: every lock operation is a transaction).
#[tokio::test]
async fn valkey_without_scripts_gets_locks_as_transactions() {
    let valkey = RedisServer::start_valkey(&support::redis::NO_SCRIPTS);
    let lg = Lockgate::start_with(support::locks::config(&valkey.addr(), "a", 20_000)).await;
    let mut c = RawClient::connect(lg.addr).await;
    let mut r = RawClient::connect(valkey.addr()).await;
    assert_eq!(c.call(&["SETNX", "lock:v", "1"]).await, ":1\r\n");
    assert_lease(&mut r, "lock:v", 19_000, 20_000).await;
    assert!(owner_of(&mut r, "lock:v").await.is_some(), "owner record");
    assert_eq!(c.call(&["EXPIRE", "lock:v", "30"]).await, ":1\r\n");
    assert_eq!(c.call(&["DEL", "lock:v"]).await, ":1\r\n");
    assert!(!exists(&mut r, "lock:v").await);
    assert!(owner_of(&mut r, "lock:v").await.is_none());
    assert_eq!(m(&lg.ctx.locks.metrics.native_calls), 0);
    lg.stop().await;
}

/// Two lockgates, eight clients each racing on one key: the transactions
/// conflict and are tried again, and no two clients ever hold the lock at
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_clients_never_hold_the_lock_together() {
    let redis = without_scripts();
    let quick = |c: &mut lockgate::Config| {
        c.locks.retry.park_ms = 0;
        c.locks.retry.probe_interval_ms = 1;
    };
    let mut configs = Vec::new();
    for id in ["a", "b"] {
        let mut c = support::locks::config(&redis.addr(), id, 5_000);
        quick(&mut c);
        configs.push(Lockgate::start_with(c).await);
    }
    let inside = Arc::new(AtomicI64::new(0));
    let acquired = Arc::new(AtomicI64::new(0));
    let mut tasks = Vec::new();
    for i in 0..16 {
        let addr = configs[i % 2].addr;
        let (inside, acquired) = (inside.clone(), acquired.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = RawClient::connect(addr).await;
            let mut mine = 0;
            while mine < 5 {
                if c.call(&["SETNX", "lock:race", &i.to_string()]).await != ":1\r\n" {
                    continue;
                }
                assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                assert_eq!(c.call(&["INCR", "race:count"]).await.as_bytes()[0], b':');
                inside.fetch_sub(1, Ordering::SeqCst);
                assert_eq!(c.call(&["DEL", "lock:race"]).await, ":1\r\n");
                mine += 1;
                acquired.fetch_add(1, Ordering::SeqCst);
            }
        }));
    }
    for t in tasks {
        t.await.expect("client");
    }
    assert_eq!(acquired.load(Ordering::SeqCst), 80);
    let mut r = RawClient::connect(redis.addr()).await;
    assert_eq!(get(&mut r, "race:count").await.as_deref(), Some("80"));
    for lg in &configs {
        let t = &lg.ctx.locks.transactions().expect("transactions").metrics;
        assert_eq!(m(&t.failures), 0);
    }
    for lg in configs {
        lg.stop().await;
    }
}

/// A parked attempt is handed the lock by the holder's release, in the
/// release's own transaction; a holder that disconnects releases its
/// lock; the watchdog renews a lease; a takeover keeps the lease and moves
/// the owner record; the fencing API hands out growing tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handoff_disconnect_watchdog_takeover_and_fencing() {
    let redis = without_scripts();
    let mut config = support::locks::config(&redis.addr(), "a", 20_000);
    config.locks.retry.park_ms = 5_000;
    config.locks.overrides = vec![
        LockOverride {
            pattern: "lock:wd:*".into(),
            lease_ms: 300,
            watchdog: true,
            max_hold_ms: 60_000,
            ..Default::default()
        },
        LockOverride {
            pattern: "lock:gone".into(),
            release_on_disconnect: true,
            ..Default::default()
        },
    ];
    let lg = Lockgate::start_with(config).await;
    let mut r = RawClient::connect(redis.addr()).await;

    // Handoff.
    let mut holder = RawClient::connect(lg.addr).await;
    let mut waiter = RawClient::connect(lg.addr).await;
    assert_eq!(holder.call(&["SETNX", "lock:h", "1"]).await, ":1\r\n");
    assert_eq!(waiter.call(&["SETNX", "lock:h", "2"]).await, ":0\r\n");
    waiter.send(&cmd(&["SETNX", "lock:h", "2"])).await;
    until!(
        "the second attempt to park",
        m(&lg.ctx.locks.storm.metrics.parked) >= 1
    );
    assert_eq!(holder.call(&["DEL", "lock:h"]).await, ":1\r\n");
    assert_eq!(waiter.read_raw_frames(1).await, b":1\r\n");
    assert_eq!(get(&mut r, "lock:h").await.as_deref(), Some("2"));
    assert_lease(&mut r, "lock:h", 19_000, 20_000).await;
    assert_eq!(waiter.call(&["DEL", "lock:h"]).await, ":1\r\n");

    // Release on disconnect.
    assert_eq!(holder.call(&["SETNX", "lock:gone", "1"]).await, ":1\r\n");
    drop(holder);
    until_gone(&mut r, "lock:gone").await;
    assert!(owner_of(&mut r, "lock:gone").await.is_none());

    // The watchdog keeps a 300 ms lease alive past several leases.
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(c.call(&["SETNX", "lock:wd:1", "1"]).await, ":1\r\n");
    until!(
        "three renewals",
        m(&lg.ctx.locks.metrics.watchdog_renewals) >= 3
    );
    assert!(exists(&mut r, "lock:wd:1").await);
    assert_eq!(c.call(&["DEL", "lock:wd:1"]).await, ":1\r\n");

    // A takeover by the holder: the old value back, the lease kept, the
    // owner record's deadline the lock's.
    assert_eq!(
        c.call(&["SET", "lock:t", "1", "NX", "PX", "8000"]).await,
        "+OK\r\n"
    );
    assert_eq!(c.call(&["GETSET", "lock:t", "2"]).await, "$1\r\n1\r\n");
    assert_lease(&mut r, "lock:t", 7_000, 8_000).await;
    let lock_at = r.call_s(&["PEXPIRETIME", "lock:t"]).await;
    let owner_at = r.call_s(&["PEXPIRETIME", &owner("lock:t")]).await;
    assert_eq!(lock_at, owner_at);

    // Fencing tokens.
    let first = c.call(&["LOCKGATE", "LOCK", "fenced", "5000"]).await;
    assert!(first.starts_with("*2\r\n:"), "{first}");
    let token: i64 = first[5..].split("\r\n").next().unwrap().parse().unwrap();
    let unlock = c
        .call(&["LOCKGATE", "UNLOCK", "fenced", &token.to_string()])
        .await;
    assert_eq!(unlock, ":1\r\n");
    let second = c.call(&["LOCKGATE", "LOCK", "fenced", "5000"]).await;
    let next: i64 = second[5..].split("\r\n").next().unwrap().parse().unwrap();
    assert!(next > token, "{next} after {token}");
    lg.stop().await;
}

/// Inside `MULTI` lockgate queues lock commands itself and carries them
/// out at `EXEC`, in order, their replies `EXEC`'s array (the legacy
/// `MULTI` / `SETNX` / `EXPIRE` / `EXEC`); Redis's own (empty)
/// transaction runs first, so a key the client watched that changed makes
/// `EXEC` answer nil and nothing runs. A transaction that also holds other
/// commands is refused whole: nothing of it is written, never the lock
/// without its protection (docs/faults.md, "Scripts refused").
#[tokio::test]
async fn lock_commands_inside_multi_run_at_exec_and_mixed_transactions_abort() {
    let redis = without_scripts();
    let lg = Lockgate::start_with(support::locks::config(&redis.addr(), "a", 20_000)).await;
    until!("the server seen without scripts", scriptless(&lg));
    let mut c = RawClient::connect(lg.addr).await;
    let mut r = RawClient::connect(redis.addr()).await;
    assert_eq!(c.call(&["MULTI"]).await, "+OK\r\n");
    assert_eq!(c.call(&["SETNX", "lock:m", "1"]).await, "+QUEUED\r\n");
    assert_eq!(c.call(&["EXPIRE", "lock:m", "40"]).await, "+QUEUED\r\n");
    assert_eq!(c.call(&["EXEC"]).await, "*2\r\n:1\r\n:1\r\n");
    assert_lease(&mut r, "lock:m", 39_000, 40_000).await;
    assert_within(
        "owner record's lease",
        pttl(&mut r, &owner("lock:m")).await,
        39_000,
        40_000,
    );
    // Another instance's holder cannot take it in its transaction.
    let lg2 = Lockgate::start_with(support::locks::config(&redis.addr(), "b", 20_000)).await;
    until!("the second instance seen without scripts", scriptless(&lg2));
    let mut other = RawClient::connect(lg2.addr).await;
    assert_eq!(other.call(&["MULTI"]).await, "+OK\r\n");
    assert_eq!(other.call(&["SETNX", "lock:m", "2"]).await, "+QUEUED\r\n");
    assert_eq!(other.call(&["DEL", "lock:m"]).await, "+QUEUED\r\n");
    assert_eq!(other.call(&["EXEC"]).await, "*2\r\n:0\r\n:0\r\n");
    assert_eq!(get(&mut r, "lock:m").await.as_deref(), Some("1"));

    // WATCH decides.
    assert_eq!(c.call(&["WATCH", "data:w"]).await, "+OK\r\n");
    assert_eq!(r.call(&["SET", "data:w", "changed"]).await, "+OK\r\n");
    assert_eq!(c.call(&["MULTI"]).await, "+OK\r\n");
    assert_eq!(c.call(&["DEL", "lock:m"]).await, "+QUEUED\r\n");
    assert_eq!(c.call(&["EXEC"]).await, "*-1\r\n");
    assert!(exists(&mut r, "lock:m").await, "nothing ran");

    // Mixed: refused whole.
    assert_eq!(c.call(&["MULTI"]).await, "+OK\r\n");
    assert_eq!(c.call(&["SET", "data:m", "1"]).await, "+QUEUED\r\n");
    assert_eq!(c.call(&["DEL", "lock:m"]).await, "+QUEUED\r\n");
    let exec = c.call(&["EXEC"]).await;
    assert!(
        exec.starts_with("-EXECABORT lockgate: the server refuses scripts"),
        "{exec}"
    );
    assert!(!exists(&mut r, "data:m").await);
    assert!(exists(&mut r, "lock:m").await);
    assert_eq!(c.call(&["DEL", "lock:m"]).await, ":1\r\n");
    lg2.stop().await;
    lg.stop().await;
}

/// A restarted Redis closed lockgate's idle transaction connections: the
/// first lock command after it finds one dead, and is carried out on a
/// fresh connection, not answered an error (reads change nothing, so
/// they are sent again; a lost `EXEC` is never resent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_redis_costs_no_lock_command_an_error() {
    let mut redis = without_scripts();
    let mut config = support::locks::config(&redis.addr(), "a", 20_000);
    // No hold after the restart (tests/it/upstream_safety.rs has it).
    config.locks.failover_delay_ms = Some(0);
    let lg = Lockgate::start_with(config).await;
    until!("the server seen without scripts", scriptless(&lg));
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(c.call(&["SETNX", "lock:r", "1"]).await, ":1\r\n");
    assert_eq!(c.call(&["DEL", "lock:r"]).await, ":1\r\n");
    redis.restart();
    // Until lockgate's own connection has seen the restarted server again
    // (scripts refused still), then a session of its own to it.
    until!(
        "lockgate's own connection back",
        lg.ctx
            .primary
            .state
            .up
            .load(std::sync::atomic::Ordering::Relaxed)
            && lg
                .ctx
                .primary
                .state
                .connects
                .load(std::sync::atomic::Ordering::Relaxed)
                >= 2
    );
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(c.call(&["SETNX", "lock:r", "2"]).await, ":1\r\n");
    assert_eq!(c.call(&["DEL", "lock:r"]).await, ":1\r\n");
    let txn = &lg.ctx.locks.transactions().expect("transactions").metrics;
    assert_eq!(m(&txn.failures), 0);
    lg.stop().await;
}

/// On a server that refuses scripts a guarded write cannot be checked with
/// the write: refused in refuse mode (never passed unguarded), passed and
/// counted `unchecked` in report mode.
#[tokio::test]
async fn a_server_without_scripts_cannot_check_guarded_writes() {
    use lockgate::config::{GuardMode, UnlockedWriters};
    for (mode, want) in [
        (GuardMode::Refuse, "-ERR lockgate: write refused: SET on a guarded key cannot be checked: the server refuses scripts\r\n"),
        (GuardMode::Report, "+OK\r\n"),
    ] {
        let redis = RedisServer::start_with(&support::redis::NO_SCRIPTS);
        let mut c = support::locks::config(&redis.addr(), "a", 30_000);
        c.locks.guards = vec![crate::guarded_writes::orders(mode, UnlockedWriters::Allow)];
        let lg = Lockgate::start_with(c).await;
        until!(
            "the command table and the scripts' refusal",
            !lg.ctx.locks.guard_table.get().is_empty() && lg.ctx.locks.scriptless()
        );
        let mut a = RawClient::connect(lg.addr).await;
        assert_eq!(a.call(&["SETNX", "lock:order:1", "a"]).await, ":1\r\n");
        assert_eq!(a.call(&["SET", "order:1", "x"]).await, want, "{mode:?}");
        let [applied, refused, _, _, unchecked] = crate::guarded_writes::counts(&lg);
        assert_eq!((applied, refused + unchecked), (0, 1), "{mode:?}");
    }
}
