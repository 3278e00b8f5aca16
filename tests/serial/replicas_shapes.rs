//! Replica acknowledgement (`locks.replicas_ack = 1`) under the retry
//! storms apps really make, against a real primary and its real replica:
//! redis-py threads each on their own connection, redis-py threads on a
//! LIFO pool, ioredis tasks on one multiplexed connection (the bench's
//! drivers, as `storm_shapes`). Each grant a client was told of was
//! acknowledged by the replica (`lock_replica_acks` at least the
//! acquisitions the driver saw, none timed out on a healthy replica),
//! never two holders, no errors, and the lock went round: the wait for
//! the replica, in front of parked attempts and handoffs, does not stall
//! the storm. The same three in front of a Redis Cluster (3 primaries, a
//! replica each), where the shard's own acker waits for its replica.

use crate::support;
use crate::SERIAL;

use std::net::SocketAddr;

use super::storm_shapes::{drive, int, ioredis_args, node_ready, py_args, python};
use support::cluster::Cluster;
use support::locks::m;
use support::ops::base_config;
use support::resp::direct;
use support::sentinel::Group;
use support::Lockgate;

/// Every shard of `map` has a replica whose link to its primary is up.
async fn in_sync(map: &lockgate::cluster::map::SlotMap) -> bool {
    for s in map.shards() {
        let Some(r) = s.replicas.first() else {
            return false;
        };
        if !(direct(r, &["INFO", "replication"]).await).contains("master_link_status:up") {
            return false;
        }
    }
    true
}

/// What lockgate is in front of.
#[derive(Clone, Copy)]
enum Behind {
    /// A primary and its replica.
    Primary,
    /// A cluster of 3 primaries with a replica each.
    Cluster,
}

async fn acked_storm(
    behind: Behind,
    program: &str,
    script: &str,
    args: impl Fn(SocketAddr) -> Vec<String>,
    min_acquisitions: u64,
) {
    let acked = |c: &mut lockgate::Config| {
        c.locks.replicas_ack = 1;
        c.locks.replicas_ack_timeout_ms = 2_000;
    };
    let (_pair, _cluster, lg) = match behind {
        Behind::Primary => {
            let pair = Group::pair().await;
            let mut config = base_config(&pair.0.addr());
            acked(&mut config);
            let lg = Lockgate::start_with(config).await;
            (Some(pair), None, lg)
        }
        Behind::Cluster => {
            let cluster = Cluster::start(3, 1);
            crate::until!(
                "every shard's replica in sync",
                in_sync(&cluster.map().await).await
            );
            let lg = cluster.lockgate(acked).await;
            (None, Some(cluster), lg)
        }
    };
    let report = drive(program, script, &args(lg.addr)).await;
    let acks = lg.ctx.locks.replica_acks();
    let (acked, timeouts, failures, rounds) = (
        m(&acks.acknowledged),
        m(&acks.timeouts),
        m(&acks.failures),
        m(&acks.rounds),
    );
    eprintln!("{script} {report}: {acked} acknowledged in {rounds} rounds, {timeouts} timeouts, {failures} failures");
    let acquisitions = int(&report, "acquisitions");
    assert!(
        acquisitions >= min_acquisitions,
        "{acquisitions} acquisitions, expected at least {min_acquisitions}: {report}"
    );
    assert_eq!(int(&report, "overlaps"), 0, "two holders: {report}");
    assert_eq!(int(&report, "errors"), 0, "errors: {report}");
    assert!(
        acked >= acquisitions,
        "{acquisitions} acquisitions, {acked} acknowledged: {report}"
    );
    assert_eq!((timeouts, failures), (0, 0), "{report}");
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_py_threads_on_their_own_connections_wait_for_the_replica() {
    let _serial = SERIAL.lock().await;
    acked_storm(
        Behind::Primary,
        &python(),
        "shapes_load.py",
        |lg| py_args("own")(lg, ""),
        5,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_py_threads_on_a_lifo_pool_wait_for_the_replica() {
    let _serial = SERIAL.lock().await;
    acked_storm(
        Behind::Primary,
        &python(),
        "shapes_load.py",
        |lg| py_args("pool")(lg, ""),
        2,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ioredis_tasks_on_one_connection_wait_for_the_replica() {
    let _serial = SERIAL.lock().await;
    node_ready();
    acked_storm(Behind::Primary, "node", "shapes_load.js", ioredis_args, 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_redis_py_threads_on_their_own_connections_wait_for_the_shards_replica() {
    let _serial = SERIAL.lock().await;
    let args = |lg| py_args("own")(lg, "");
    acked_storm(Behind::Cluster, &python(), "shapes_load.py", args, 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_redis_py_threads_on_a_lifo_pool_wait_for_the_shards_replica() {
    let _serial = SERIAL.lock().await;
    let args = |lg| py_args("pool")(lg, "");
    acked_storm(Behind::Cluster, &python(), "shapes_load.py", args, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_ioredis_tasks_on_one_connection_wait_for_the_shards_replica() {
    let _serial = SERIAL.lock().await;
    node_ready();
    acked_storm(Behind::Cluster, "node", "shapes_load.js", ioredis_args, 5).await;
}
