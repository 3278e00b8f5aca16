//! Replica acknowledgement (`locks.replicas_ack`, issue 45), against a
//! real primary and its real replica (`redis-server --replicaof`): a
//! grant is answered only once the replica holds it (read back on the
//! replica at once); a replica that does not answer (SIGSTOPped) gets
//! the grant undone by its own token and the client told "not acquired"
//! or the error its pattern asks, then, resumed, locks are granted again
//! with no restart; a parked attempt handed the lock, and `LOCKGATE LOCK`,
//! wait for the replica too; pipelined replies keep their order, on
//! dedicated and on shared upstream connections; and, with three
//! sentinels, the primary killed right after an acknowledged acquisition:
//! the promoted replica has the lock (`docs/sentinel.md`).

use crate::support;

use std::time::{Duration, Instant};

use lockgate::config::{AckRefusal, LockOverride, UpstreamMode};
use lockgate::Config;
use support::locks::{exists, get, m};
use support::ops::base_config;
use support::passthrough::pipeline;
use support::process::Paused;
use support::resp::cmd;
use support::sentinel::Group;
use support::{Lockgate, RawClient, RedisServer};

/// `locks.replicas_ack = 1` within `timeout_ms`; keys under `lock:err:`
/// refused with the error instead.
fn acked(primary: &RedisServer, timeout_ms: u64) -> Config {
    let mut c = base_config(&primary.addr());
    c.locks.replicas_ack = 1;
    c.locks.replicas_ack_timeout_ms = timeout_ms;
    c.locks.overrides.push(LockOverride {
        pattern: "lock:err:*".into(),
        replicas_ack_refusal: Some(AckRefusal::Error),
        ..LockOverride::default()
    });
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_is_answered_once_the_replica_holds_it() {
    answered_once_held(UpstreamMode::Dedicated).await;
}

/// The same with `proxy.upstream = "shared"`: sessions' commands share
/// upstream connections, the acker still has its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_is_answered_once_the_replica_holds_it_on_shared_connections() {
    answered_once_held(UpstreamMode::Shared).await;
}

async fn answered_once_held(mode: UpstreamMode) {
    let (primary, replica) = Group::pair().await;
    let mut config = acked(&primary, 5_000);
    config.proxy.upstream = mode;
    let lg = Lockgate::start_with(config).await;
    let acks = lg.ctx.locks.replica_acks();
    let mut app = RawClient::connect(lg.addr).await;
    let mut on_replica = RawClient::connect(replica.addr()).await;
    let owner = "lockgate:owner:{lock:a}";
    for (i, (args, want)) in [
        (vec!["SETNX", "lock:a", "v1"], ":1\r\n"),
        (vec!["SET", "lock:b", "v2", "NX", "PX", "10000"], "+OK\r\n"),
        (
            vec!["SET", "lock:c", "v3", "NX", "PX", "10000", "GET"],
            "$-1\r\n",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        assert_eq!(app.call_s(&args).await, want, "{args:?}");
        // Read on the replica the moment the client has its answer.
        let key = args[1];
        let value = args[2];
        assert_eq!(
            get(&mut on_replica, key).await.as_deref(),
            Some(value),
            "{key}"
        );
        assert_eq!(m(&acks.acknowledged), i as u64 + 1);
    }
    assert!(exists(&mut on_replica, owner).await, "the owner record too");
    // A held lock is refused as before, and asks nothing.
    assert_eq!(app.call_s(&["SETNX", "lock:a", "x"]).await, ":0\r\n");
    assert_eq!(m(&acks.acknowledged), 3);
    // Pipelined behind a grant, replies keep their order.
    let request = [
        cmd(&["SETNX", "lock:p", "1"]),
        cmd(&["SET", "plain", "x"]),
        cmd(&["GET", "plain"]),
        cmd(&["DEL", "lock:p"]),
    ]
    .concat();
    let replies = pipeline(lg.addr, request, None, 4).await;
    assert_eq!(replies, b":1\r\n+OK\r\n$1\r\nx\r\n:1\r\n");
    assert_eq!(m(&acks.acknowledged), 4);
    assert_eq!(m(&acks.timeouts) + m(&acks.failures), 0);
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_does_not_answer_gets_the_grant_undone_and_the_client_told() {
    let (primary, replica) = Group::pair().await;
    let lg = Lockgate::start_with(acked(&primary, 300)).await;
    let acks = lg.ctx.locks.replica_acks();
    let mut app = RawClient::connect(lg.addr).await;
    let mut on_primary = RawClient::connect(primary.addr()).await;
    assert_eq!(app.call_s(&["SETNX", "lock:e", "v"]).await, ":1\r\n");
    let paused = Paused::stop(replica.pid()).await;
    // An extension the replica does not hold: told "not extended" (the
    // lock stays its holder's, and is not undone).
    assert_eq!(app.call_s(&["PEXPIRE", "lock:e", "20000"]).await, ":0\r\n");
    assert!(exists(&mut on_primary, "lock:e").await);
    let timeouts = m(&acks.timeouts);
    assert_eq!((timeouts, m(&acks.undone)), (1, 0));
    let started = Instant::now();
    assert_eq!(app.call_s(&["SETNX", "lock:t", "v"]).await, ":0\r\n");
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "answered before the timeout: {:?}",
        started.elapsed()
    );
    assert!(!exists(&mut on_primary, "lock:t").await, "not undone");
    assert!(!exists(&mut on_primary, "lockgate:owner:{lock:t}").await);
    assert_eq!((m(&acks.timeouts), m(&acks.undone)), (2, 1));
    // Each shape's refusal: nil, the error where "not acquired" is none,
    // and the error a pattern asks for.
    let set = app
        .call_s(&["SET", "lock:t", "v", "NX", "PX", "5000"])
        .await;
    assert_eq!(set, "$-1\r\n");
    let get = app
        .call_s(&["SET", "lock:t", "v", "NX", "PX", "5000", "GET"])
        .await;
    assert!(
        get.starts_with(
            "-ERR lockgate: lock not granted: acknowledged by 0 of 1 replicas within 300 ms"
        ),
        "{get}"
    );
    let err = app.call_s(&["SETNX", "lock:err:x", "v"]).await;
    assert!(err.starts_with("-ERR lockgate: lock not granted:"), "{err}");
    assert!(err.ends_with("(locks.replicas_ack)\r\n"), "{err}");
    assert_eq!((m(&acks.timeouts), m(&acks.undone)), (5, 4));
    assert!(!exists(&mut on_primary, "lock:t").await);
    // Not held by the client: its connection's records say so.
    let held = lg.ctx.locks.conns.holds(|k| k.starts_with(b"lock:t"), 10);
    assert!(held.is_empty(), "a refused grant still listed: {held:?}");
    // The replica back: granted again, no restart.
    paused.resume();
    assert_eq!(app.call_s(&["SETNX", "lock:t", "v"]).await, ":1\r\n");
    assert_eq!(app.call_s(&["PEXPIRE", "lock:e", "20000"]).await, ":1\r\n");
    assert_eq!(m(&acks.acknowledged), 3);
    lg.stop().await;
}

/// A parked attempt handed the lock by the holder's release is answered
/// only once the replica holds it; with the replica stopped it is told
/// "not acquired" and nobody holds the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_attempt_handed_the_lock_waits_for_the_replica_too() {
    let (primary, replica) = Group::pair().await;
    let mut config = acked(&primary, 300);
    config.locks.retry.park_ms = 10_000;
    config.locks.retry.max_attempts_per_sec = 0;
    let lg = Lockgate::start_with(config).await;
    let acks = lg.ctx.locks.replica_acks();
    let storm = &lg.ctx.locks.storm.metrics;
    let mut on_primary = RawClient::connect(primary.addr()).await;
    let mut on_replica = RawClient::connect(replica.addr()).await;
    let mut holder = RawClient::connect(lg.addr).await;
    let mut waiter = RawClient::connect(lg.addr).await;
    for (round, stopped) in [(1u64, false), (2, true)] {
        let key = format!("lock:h{round}");
        assert_eq!(holder.call_s(&["SETNX", &key, "holder"]).await, ":1\r\n");
        // A spinning waiter: its second attempt parks.
        assert_eq!(waiter.call_s(&["SETNX", &key, "waiter"]).await, ":0\r\n");
        let parked = m(&storm.parked);
        waiter.send(&cmd(&["SETNX", &key, "waiter"])).await;
        crate::until!("the attempt parked", m(&storm.parked) > parked);
        let paused = match stopped {
            true => Some(Paused::stop(replica.pid()).await),
            false => None,
        };
        assert_eq!(holder.call_s(&["DEL", &key]).await, ":1\r\n");
        let answer = waiter.read_s().await;
        match paused {
            None => {
                assert_eq!(answer, ":1\r\n");
                let held = get(&mut on_replica, &key).await;
                assert_eq!(
                    held.as_deref(),
                    Some("waiter"),
                    "not on the replica when answered"
                );
                assert_eq!(waiter.call_s(&["DEL", &key]).await, ":1\r\n");
            }
            Some(paused) => {
                assert_eq!(
                    answer, ":0\r\n",
                    "handed a lock the replica never acknowledged"
                );
                assert!(
                    !exists(&mut on_primary, &key).await,
                    "the handoff not undone"
                );
                assert_eq!(m(&acks.undone), 1);
                paused.resume();
            }
        }
        assert_eq!(m(&storm.handoffs), round, "the release handed it over");
    }
    // Back: the waiter's next attempt is granted.
    assert_eq!(
        waiter.call_s(&["SETNX", "lock:h2", "waiter"]).await,
        ":1\r\n"
    );
    lg.stop().await;
}

/// `LOCKGATE LOCK` waits for the replica before it answers its token; not
/// acknowledged, it answers the error and the lock is given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fencing_lock_waits_for_the_replica() {
    let (primary, replica) = Group::pair().await;
    let lg = Lockgate::start_with(acked(&primary, 300)).await;
    let acks = lg.ctx.locks.replica_acks();
    let mut app = RawClient::connect(lg.addr).await;
    let mut on_primary = RawClient::connect(primary.addr()).await;
    let mut on_replica = RawClient::connect(replica.addr()).await;
    let reply = app.call_s(&["LOCKGATE", "LOCK", "lock:f", "10000"]).await;
    let token = support::locks::fence_token(&reply).unwrap_or_else(|| panic!("{reply}"));
    assert_eq!(
        get(&mut on_replica, "lock:f").await.as_deref(),
        Some(token.as_str())
    );
    assert_eq!(m(&acks.acknowledged), 1);
    let unlock = app.call_s(&["LOCKGATE", "UNLOCK", "lock:f", &token]).await;
    assert_eq!(unlock, ":1\r\n");
    let paused = Paused::stop(replica.pid()).await;
    let reply = app.call_s(&["LOCKGATE", "LOCK", "lock:f", "10000"]).await;
    assert!(
        reply.starts_with(
            "-ERR lockgate: lock not granted: acknowledged by 0 of 1 replicas within 300 ms"
        ),
        "{reply}"
    );
    assert!(!exists(&mut on_primary, "lock:f").await, "not given back");
    assert_eq!(m(&acks.undone), 1);
    paused.resume();
    let reply = app.call_s(&["LOCKGATE", "LOCK", "lock:f", "10000"]).await;
    assert!(support::locks::fence_token(&reply).is_some(), "{reply}");
    lg.stop().await;
}

/// A primary killed right after an acknowledged acquisition: Sentinel
/// promotes the replica, which holds the lock, so nobody is granted it
/// again, with the failover delay off (`locks.failover_delay_ms = 0`: the
/// acknowledgement alone protects it). The promoted primary has no replica
/// left: grants are refused (not acknowledged) until the old primary comes
/// back as its replica, then served again with no restart of lockgate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acknowledged_lock_survives_its_primarys_death() {
    let mut group = Group::start().await;
    let mut config = support::sentinel::sentinel_config(&group.addrs());
    config.locks.failover_delay_ms = Some(0);
    config.locks.replicas_ack = 1;
    config.locks.replicas_ack_timeout_ms = 300;
    let lg = Lockgate::start_with(config).await;
    until!(
        "lockgate to be ready",
        lockgate::http::not_ready(&lg.ctx).is_none()
    );
    let acks = lg.ctx.locks.replica_acks();
    let new = group.replica.addr();
    let mut holder = RawClient::connect(lg.addr).await;
    assert_eq!(
        holder
            .call_s(&["SET", "lock:f", "h", "NX", "PX", "60000"])
            .await,
        "+OK\r\n"
    );
    // Killed the moment the holder is answered.
    group.primary.stop();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut other = loop {
        let primary = lg.ctx.primary_addr.addr();
        if primary.as_deref() == Some(new.as_str()) && Group::role(&new).await == "master" {
            break RawClient::connect(lg.addr).await;
        }
        assert!(Instant::now() < deadline, "the failover was not followed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let mut on_new = RawClient::connect(&new).await;
    assert_eq!(
        get(&mut on_new, "lock:f").await.as_deref(),
        Some("h"),
        "lost in the failover"
    );
    assert!(exists(&mut on_new, "lockgate:owner:{lock:f}").await);
    // No second holder.
    assert_eq!(other.call_s(&["SETNX", "lock:f", "o"]).await, ":0\r\n");
    // No replica left: a grant is not acknowledged, and undone. Counted
    // as timed out, or (the first grant after the switch) as a failure
    // when the acker moved to the new primary after the grant was planned
    // (a clean-clone CI run saw the second).
    let unacked = || m(&acks.timeouts) + m(&acks.failures);
    let before = unacked();
    assert_eq!(other.call_s(&["SETNX", "lock:g", "o"]).await, ":0\r\n");
    assert_eq!(unacked(), before + 1);
    assert!(!exists(&mut on_new, "lock:g").await);
    // The old primary back, made the new one's replica by Sentinel: served.
    group.primary.restart();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !direct_info(&new).await.contains("connected_slaves:1") {
        assert!(
            Instant::now() < deadline,
            "the old primary never rejoined as a replica"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if other.call_s(&["SETNX", "lock:g", "o"]).await == ":1\r\n" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "grants still refused with a replica back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    lg.stop().await;
}

async fn direct_info(addr: &str) -> String {
    support::resp::direct(addr, &["INFO", "replication"]).await
}

/// How long after a killed primary acquisitions are refused when the
/// promoted replica cannot be vouched for (its marker deleted before the
/// first acquisition asks): every key waits out the delay
/// (`locks.failover_delay_ms` = 6 s), acknowledged or not; the lock
/// acknowledged before the failover is granted to nobody else. The
/// vouched case, under load, is `tests/serial/replicas_failover.rs`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_replica_that_cannot_be_vouched_for_holds_every_key() {
    let (ack_ms, _) = hold_after_kill_unvouched().await;
    assert!(
        ack_ms >= HOLD_MS,
        "acknowledged keys refused only {ack_ms} ms"
    );
}

const HOLD_MS: u64 = 6_000;

/// Kills the primary of two replicas and deletes the promoted replica's
/// marker before any acquisition; returns how long (ms, from the kill)
/// an acknowledged key and a plain key were refused.
async fn hold_after_kill_unvouched() -> (u64, u64) {
    let (mut group, second, lg, started) =
        support::sentinel::acked_with_two_replicas(HOLD_MS).await;
    let acks = lg.ctx.locks.replica_acks();
    let mut holder = RawClient::connect(lg.addr).await;
    let held = holder
        .call_s(&["SET", "lock:ack:held", "h", "NX", "PX", "60000"])
        .await;
    assert_eq!(held, "+OK\r\n");
    // Acknowledgement in force for the whole delay before the switch.
    let since = started + Duration::from_millis(HOLD_MS + 200);
    tokio::time::sleep(since.saturating_duration_since(Instant::now())).await;
    let killed = Instant::now();
    group.primary.stop();
    let replicas = [group.replica.addr(), second.addr()];
    let deadline = killed + Duration::from_secs(30);
    let new = loop {
        let followed = lg.ctx.primary_addr.addr().map(|a| a.to_string());
        if let Some(new) = followed.filter(|a| replicas.contains(a)) {
            if Group::role(&new).await == "master" {
                break new;
            }
        }
        assert!(Instant::now() < deadline, "the failover was not followed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut on_new = RawClient::connect(&new).await;
    {
        let markers = on_new.call_s(&["KEYS", "lockgate:acked:*"]).await;
        let marker = markers
            .lines()
            .nth(2)
            .expect("a marker on the promoted replica")
            .to_string();
        assert_eq!(on_new.call_s(&["DEL", &marker]).await, ":1\r\n");
    }
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(
        c.call_s(&["SETNX", "lock:ack:held", "o"]).await,
        ":0\r\n",
        "a second holder"
    );
    let (mut ack_ms, mut plain_ms) = (None, None);
    while ack_ms.is_none() || plain_ms.is_none() {
        assert!(
            Instant::now() < killed + Duration::from_secs(40),
            "never granted"
        );
        for (key, got) in [
            ("lock:ack:new", &mut ack_ms),
            ("lock:plain:new", &mut plain_ms),
        ] {
            if got.is_none() && c.call_s(&["SETNX", key, "o"]).await == ":1\r\n" {
                *got = Some(killed.elapsed().as_millis() as u64);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (ack_ms, plain_ms) = (ack_ms.unwrap_or_default(), plain_ms.unwrap_or_default());
    println!(
        "refused after the primary was killed (failover_delay_ms {HOLD_MS}, not vouched for): acknowledged keys {ack_ms} ms, others {plain_ms} ms"
    );
    assert!(
        plain_ms >= HOLD_MS,
        "plain keys granted within the hold: {plain_ms} ms"
    );
    assert_eq!(
        get(&mut on_new, "lock:ack:held").await.as_deref(),
        Some("h")
    );
    assert_eq!(m(&acks.unheld), 0);
    lg.stop().await;
    (ack_ms, plain_ms)
}

/// `locks.replicas_ack_fsync`: rounds ask `WAITAOF 1 N` (Valkey 9.1, a
/// primary and a replica each with an append-only file fsynced always): a grant is
/// answered once both have it on disk; with the primary's append-only
/// file turned off, a grant fails, the error naming why, and is undone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_fsync_a_grant_waits_for_the_disks() {
    // Fsynced at every write; even so a replica reports its fsync only
    // with its next acknowledgement, up to a second later
    // (docs/sentinel.md): the timeout is 2 s.
    let aof = ["--appendonly", "yes", "--appendfsync", "always"];
    let primary = RedisServer::start_valkey(&aof);
    let port = primary.port.to_string();
    let follow = ["--replicaof", "127.0.0.1", &port];
    let _replica = RedisServer::start_valkey(&[&aof[..], &follow[..]].concat());
    // In sync, and its own append-only file rewritten after the sync (it
    // reports no fsync before): a write is then fsynced on both.
    let mut direct = RawClient::connect(primary.addr()).await;
    crate::until!("the replica to fsync what it replicates", {
        direct.call_s(&["SET", "probe", "1"]).await;
        direct.call_s(&["WAITAOF", "1", "1", "100"]).await == "*2\r\n:1\r\n:1\r\n"
    });
    let mut config = acked(&primary, 2_000);
    config.locks.replicas_ack_fsync = true;
    let lg = Lockgate::start_with(config).await;
    let acks = lg.ctx.locks.replica_acks();
    let mut app = RawClient::connect(lg.addr).await;
    let mut on_primary = RawClient::connect(primary.addr()).await;
    assert_eq!(app.call_s(&["SETNX", "lock:a", "v"]).await, ":1\r\n");
    assert_eq!(m(&acks.acknowledged), 1);
    let stats = on_primary.call_s(&["INFO", "commandstats"]).await;
    assert!(
        stats.contains("cmdstat_waitaof:calls="),
        "no WAITAOF: {stats}"
    );
    let off = ["CONFIG", "SET", "appendonly", "no"];
    assert_eq!(on_primary.call_s(&off).await, "+OK\r\n");
    let refused = app.call_s(&["SETNX", "lock:err:b", "v"]).await;
    assert!(
        refused.starts_with("-ERR lockgate: lock not granted: the primary could not be asked for its replicas (ERR WAITAOF"),
        "{refused}"
    );
    assert!(!exists(&mut on_primary, "lock:err:b").await, "not undone");
    assert_eq!((m(&acks.failures), m(&acks.undone)), (1, 1));
    lg.stop().await;
}
