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
use support::failover_load::{overlaps, refused_ms, worker, History};
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
    let histories: Vec<History> = keys.iter().map(|_| History::default()).collect();
    let mut tasks = Vec::new();
    for (k, key) in keys.iter().enumerate() {
        for w in 0..WORKERS {
            let history = histories[k].clone();
            let id = k * WORKERS + w;
            tasks.push(tokio::spawn(worker(
                lg.addr, key, id, LEASE_MS, until, history,
            )));
        }
    }
    tokio::time::sleep(killed_at.saturating_duration_since(Instant::now())).await;
    let killed = Instant::now();
    let before: Vec<usize> = (histories.iter())
        .map(|h| h.lock().expect("history").len())
        .collect();
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
    let mut refused = Vec::new();
    for (k, key) in keys.iter().enumerate() {
        let history = histories[k].lock().expect("history").clone();
        let bad = overlaps(&history, Duration::from_millis(LEASE_MS));
        assert!(
            bad.is_empty(),
            "{key}: two holders at once: {:?}",
            &bad[..1]
        );
        assert!(
            before[k] > 10,
            "{key}: only {} grants before the kill",
            before[k]
        );
        let ms = refused_ms(&history, killed);
        println!(
            "{key}: {} grants before the kill, {} after; refused {ms:?} ms after the kill (failover_delay_ms {HOLD_MS})",
            before[k],
            history.len() - before[k],
        );
        refused.push(ms);
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average: {}", load.trim());
    let (Some(ack_ms), Some(plain_ms)) = (refused[0], refused[1]) else {
        panic!("a key never granted after the kill: {refused:?}");
    };
    assert!(
        plain_ms >= HOLD_MS,
        "the plain key granted within the hold: {plain_ms} ms"
    );
    assert!(
        ack_ms + 1_000 < plain_ms,
        "the acknowledged key refused {ack_ms} ms, the plain one {plain_ms} ms"
    );
    assert!(m(&acks.unheld) > 0, "no acquisition skipped the hold");
    assert!(m(&pool.metrics().failovers) >= 1, "no failover seen");
    // The promoted replica holds the shard acker's marker: what vouched.
    let markers = direct(&promoted, &["KEYS", "lockgate:acked:*"]).await;
    assert!(markers.starts_with("*1\r\n"), "markers there: {markers:?}");
    lg.stop().await;
}
