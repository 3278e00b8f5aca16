//! Redis Cluster's slot map as lockgate reads it, against a real cluster
//! (3 primaries, a replica each): `CLUSTER SLOTS` and `CLUSTER SHARDS`
//! give the same map, every key's slot is the one the cluster computes,
//! and the node the map names for a key serves it (no `MOVED`). A lock
//! key's owner record lands on the lock's node (for a key without a hash
//! tag of its own).

use crate::support;

use lockgate::cluster::map::SlotMap;
use lockgate::cluster::slot::key_slot;
use lockgate::cluster::topology;
use support::cluster::Cluster;
use support::RawClient;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slot_map_names_the_node_that_serves_each_key() {
    let cluster = Cluster::start(3, 1);
    let seed = cluster.seed();
    let mut c = RawClient::connect(&seed).await;
    let slots = c.call_raw(&["CLUSTER", "SLOTS"]).await;
    let shards = c.call_raw(&["CLUSTER", "SHARDS"]).await;
    let by_slots = SlotMap::from_slots(&slots, &seed).expect("CLUSTER SLOTS");
    let by_shards = SlotMap::from_shards(&shards, &seed).expect("CLUSTER SHARDS");
    // The same primary for every slot (replicas show in CLUSTER SLOTS only
    // once the seed has heard of their replication, seconds later).
    let primary = |m: &SlotMap, s: u16| m.shard_of_slot(s).map(|x| x.primary.clone());
    assert!((0..16_384).all(|s| primary(&by_slots, s) == primary(&by_shards, s)));
    assert_eq!(by_slots.unserved(), 0);
    assert_eq!(by_slots.shards().len(), 3);

    let mut keys: Vec<String> = (0..200).map(|i| format!("user:{i}")).collect();
    keys.extend((0..50).map(|i| format!("{{order:{i}}}:items")));
    keys.extend((0..50).map(|i| format!("lock:order:{i}")));
    for key in &keys {
        let slot = c.call_s(&["CLUSTER", "KEYSLOT", key]).await;
        assert_eq!(slot, format!(":{}\r\n", key_slot(key.as_bytes())), "{key}");
        let shard = by_slots.shard_of_key(key.as_bytes()).expect("served");
        let mut node = RawClient::connect(&shard.primary).await;
        assert_eq!(
            node.call_s(&["SET", key, "v"]).await,
            "+OK\r\n",
            "{key} on {}",
            shard.primary
        );
        // lockgate's own keys for a lock live in the lock key's slot
        // (lockgate names them `lockgate:owner:{key}`; a key with a hash
        // tag of its own does not yet: docs/cluster.md).
        if !key.contains('{') {
            let owner = lockgate::lock::owner_key(key.as_bytes());
            assert_eq!(key_slot(&owner), key_slot(key.as_bytes()), "{key}");
        }
    }
}

/// The map is read from the first seed that answers (a dead one first is
/// passed over, and said), and read again it follows a slot moved to
/// another primary: the new owner serves the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_map_is_read_from_any_seed_and_follows_a_moved_slot() {
    let cluster = Cluster::start(3, 0);
    let config = lockgate::Config::default();
    let dead = format!("127.0.0.1:{}", support::redis::free_port());
    let seeds = vec![dead.clone(), cluster.seed()];
    let (map, from) = topology::fetch(&config, &seeds).await.expect("a map");
    assert_eq!(from, cluster.seed());
    assert_eq!(map.unserved(), 0);
    let err = topology::fetch(&config, std::slice::from_ref(&dead))
        .await
        .unwrap_err();
    assert!(err.to_string().contains(&dead), "{err}");

    // Move the (empty) slot of "foo" to another primary, on every node.
    let slot = key_slot(b"foo");
    let owner = map.shard_of_slot(slot).expect("served").primary.clone();
    let target = (map.shards().iter())
        .find(|s| s.primary != owner)
        .expect("another primary")
        .primary
        .clone();
    let mut t = RawClient::connect(&target).await;
    let id = t.call_s(&["CLUSTER", "MYID"]).await;
    let id = id.lines().nth(1).expect("an id").to_string();
    for node in &cluster.nodes {
        let mut n = RawClient::connect(node.addr()).await;
        let set = n
            .call_s(&["CLUSTER", "SETSLOT", &slot.to_string(), "NODE", &id])
            .await;
        assert_eq!(set, "+OK\r\n", "{}", node.addr());
    }
    let (moved, _) = topology::fetch(&config, std::slice::from_ref(&owner))
        .await
        .expect("a map");
    assert_eq!(moved.shard_of_slot(slot).expect("served").primary, target);
    assert_eq!(t.call_s(&["SET", "foo", "1"]).await, "+OK\r\n");
    let mut o = RawClient::connect(&owner).await;
    let redirected = o.call_s(&["GET", "foo"]).await;
    assert_eq!(
        lockgate::cluster::redirect::redirect(redirected.as_bytes(), &owner)
            .map(|r| (r.ask, r.slot, r.addr)),
        Some((false, slot, target.clone())),
        "{redirected}"
    );
}
