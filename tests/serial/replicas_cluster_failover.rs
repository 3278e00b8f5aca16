//! A cluster shard's failover under load, with replica acknowledgement on
//! one pattern (issue 45): three primaries with two replicas each (real
//! processes, `--cluster-node-timeout 2000`); clients on their own
//! connections take and release two locks of one shard through lockgate
//! without pause, one whose pattern asks `replicas_ack = 1` and one whose
//! pattern does not; the shard's primary is SIGKILLed while they run, one
//! of its replicas is elected in its place and the other follows it.
//! Judged over the whole history: never two holders of a key; and how long
//! each key was refused after the kill, before (the plain key: the whole
//! `locks.failover_delay_ms` after lockgate saw the promotion) and after
//! acknowledgement (the acknowledged key: once the promoted replica holds
//! the shard acker's marker, docs/cluster.md "Replica acknowledgement").
//! The figures are printed.

use std::time::{Duration, Instant};

use crate::support;
use support::cluster::Cluster;
use support::failover_load;
use support::locks::m;
use support::resp::direct;

/// `locks.failover_delay_ms`.
const HOLD_MS: u64 = 6_000;
/// Each grant's lease: longer than the election (so the check of the
/// promoted replica has live grants to vouch for), within the hold.
const LEASE_MS: u64 = 5_000;
/// Workers per key.
const WORKERS: usize = 3;
/// How long the load runs at least before the kill.
const BEFORE_KILL: Duration = Duration::from_secs(3);
/// How long the load runs after the kill.
const AFTER_KILL: Duration = Duration::from_secs(15);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_failover_under_load_never_makes_two_holders_and_acknowledged_keys_come_back_first()
{
    let _serial = crate::SERIAL.lock().await;
    let mut cluster = Cluster::start(3, 2);
    let started = Instant::now();
    let lg = cluster
        .lockgate(|c| {
            c.locks.failover_delay_ms = Some(HOLD_MS);
            c.locks.replicas_ack_timeout_ms = 300;
            c.locks.overrides.push(lockgate::config::LockOverride {
                pattern: "lock:ack:*".into(),
                replicas_ack: Some(1),
                ..Default::default()
            });
        })
        .await;
    // Both keys in one slot of a shard whose primary is not the seed.
    let seed = cluster.seed();
    crate::until!(
        "every shard's two replicas in the map",
        (cluster.map().await.shards().iter()).all(|s| s.replicas.len() == 2)
    );
    let map = cluster.map().await;
    let tag = (0..1000)
        .map(|i| format!("t{i}"))
        .find(|t| {
            let key = format!("lock:ack:{{{t}}}");
            map.shard_of_key(key.as_bytes())
                .is_some_and(|s| s.primary != seed && s.replicas.len() == 2)
        })
        .expect("a shard with two replicas away from the seed");
    let keys: [&'static str; 2] = [
        format!("lock:ack:{{{tag}}}").leak(),
        format!("lock:plain:{{{tag}}}").leak(),
    ];
    let shard = map
        .shard_of_key(keys[0].as_bytes())
        .expect("served")
        .clone();
    for r in &shard.replicas {
        let info = || direct(r, &["INFO", "replication"]);
        crate::until!(
            "the replica in sync",
            info().await.contains("master_link_status:up")
        );
    }
    // Acknowledgement in force for the whole delay before the promotion,
    // and the load running for a while before the kill.
    let killed_at =
        (started + Duration::from_millis(HOLD_MS + 300)).max(Instant::now() + BEFORE_KILL);
    let until = killed_at + AFTER_KILL;
    let (histories, tasks) = failover_load::spawn(lg.addr, &keys, WORKERS, LEASE_MS, until);
    tokio::time::sleep(killed_at.saturating_duration_since(Instant::now())).await;
    let killed = Instant::now();
    let before = failover_load::counts(&histories);
    (cluster.nodes.iter_mut())
        .find(|n| n.addr() == shard.primary)
        .expect("the shard's primary")
        .stop();
    for t in tasks {
        t.await.expect("a worker panicked");
    }
    let pool = lg.ctx.cluster.clone().expect("a cluster pool");
    let promoted = pool.primary_of(keys[0].as_bytes()).expect("served");
    assert!(
        shard.replicas.contains(&promoted),
        "{promoted} serves the shard, not one of its replicas {:?}",
        shard.replicas
    );
    let acks = lg.ctx.locks.replica_acks();
    failover_load::judge(&keys, &histories, &before, killed, LEASE_MS, HOLD_MS);
    assert!(m(&acks.unheld) > 0, "no acquisition skipped the hold");
    assert!(m(&pool.metrics().failovers) >= 1, "no failover seen");
    // The promoted replica holds the shard acker's marker: what vouched.
    let markers = direct(&promoted, &["KEYS", "lockgate:acked:*"]).await;
    assert!(markers.starts_with("*1\r\n"), "markers there: {markers:?}");
    lg.stop().await;
}
