//! Replica acknowledgement in front of a Redis Cluster (issue 45): three
//! primaries with a replica each (real processes); a grant is answered
//! once the replica of the shard serving its slot holds it (read there at
//! once, `READONLY`); with that replica SIGSTOPped, grants in its slots
//! are undone and refused while grants in the other shards' slots are
//! acknowledged as before; resumed, granted again with no restart.

use crate::support;

use support::cluster::Cluster;
use support::locks::m;
use support::process::Paused;
use support::resp::direct;
use support::RawClient;

/// A key under `lock:` whose slot another shard than `not`'s serves.
fn key_elsewhere(map: &lockgate::cluster::map::SlotMap, not: &str) -> String {
    (0..1000)
        .map(|i| format!("lock:other:{i}"))
        .find(|k| {
            map.shard_of_key(k.as_bytes())
                .is_some_and(|s| s.primary != not)
        })
        .expect("a key on another shard")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_shards_replica_acknowledges_the_grants_of_its_slots() {
    let cluster = Cluster::start(3, 1);
    let lg = cluster
        .lockgate(|c| {
            c.locks.replicas_ack = 1;
            c.locks.replicas_ack_timeout_ms = 300;
        })
        .await;
    let acks = lg.ctx.locks.replica_acks();
    // Every replica in the map and in sync with its primary.
    crate::until!(
        "every shard's replica",
        cluster
            .map()
            .await
            .shards()
            .iter()
            .all(|s| !s.replicas.is_empty())
    );
    let map = cluster.map().await;
    for s in map.shards() {
        let info = || direct(&s.primary, &["INFO", "replication"]);
        crate::until!("the replica in sync", info().await.contains("state=online"));
    }
    let shard = map.shard_of_key(b"lock:{s}:a").expect("served").clone();
    let replica = shard.replicas.first().expect("a replica").clone();
    let mut app = RawClient::connect(lg.addr).await;

    assert_eq!(app.call_s(&["SETNX", "lock:{s}:a", "v"]).await, ":1\r\n");
    // On the shard's replica the moment the client has its answer.
    let mut on_replica = RawClient::connect(&replica).await;
    assert_eq!(on_replica.call_s(&["READONLY"]).await, "+OK\r\n");
    assert_eq!(
        on_replica.call_s(&["GET", "lock:{s}:a"]).await,
        "$1\r\nv\r\n"
    );
    assert_eq!(m(&acks.acknowledged), 1);

    // That shard's replica stopped: its grants are undone and refused,
    // the other shards' are acknowledged as before.
    let pid = (cluster.nodes.iter())
        .find(|n| n.addr() == replica)
        .expect("the replica's process")
        .pid();
    let paused = Paused::stop(pid).await;
    let set = ["SET", "lock:{s}:b", "v", "NX", "PX", "30000"];
    assert_eq!(app.call_s(&set).await, "$-1\r\n");
    assert_eq!(
        direct(&shard.primary, &["EXISTS", "lock:{s}:b"]).await,
        ":0\r\n"
    );
    assert_eq!((m(&acks.timeouts), m(&acks.undone)), (1, 1));
    let other = key_elsewhere(&map, &shard.primary);
    assert_eq!(app.call_s(&["SETNX", &other, "v"]).await, ":1\r\n");
    assert_eq!(m(&acks.acknowledged), 2);
    // Back: granted again, no restart.
    paused.resume();
    assert_eq!(app.call_s(&set).await, "+OK\r\n");
    assert_eq!(m(&acks.acknowledged), 3);
    lg.stop().await;
}
