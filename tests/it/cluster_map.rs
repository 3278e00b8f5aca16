//! Redis Cluster's slot map as lockgate reads it, against a real cluster
//! (3 primaries, a replica each): `CLUSTER SLOTS` and `CLUSTER SHARDS`
//! give the same map, every key's slot is the one the cluster computes,
//! and the node the map names for a key serves it (no `MOVED`). A lock
//! key's owner record lands on the lock's node (for a key without a hash
//! tag of its own).

use crate::support;

use lockgate::cluster::fanout;
use lockgate::cluster::keys::{slot_of, CrossSlot, KeyTable, KeysError};
use lockgate::cluster::map::SlotMap;
use lockgate::cluster::scan;
use lockgate::cluster::slot::key_slot;
use lockgate::cluster::split;
use lockgate::protocol::encode::LocalReply;
use lockgate::topology;
use redis_protocol::resp2::types::OwnedFrame;
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

/// The keys lockgate finds from the server's own key specifications are
/// the keys the server finds (`COMMAND GETKEYS`), for commands of every
/// shape: a fixed position, pairs, a count in an argument, after a
/// keyword, subcommands; and a command whose keys the specs cannot all
/// give is said so, not guessed. On Redis 7.0 and Valkey 9.1.
#[tokio::test]
async fn keys_are_found_as_the_server_finds_them() {
    let redis = support::RedisServer::start();
    keys_as_on(&redis.addr()).await;
    let valkey = support::RedisServer::start_valkey(&[]);
    keys_as_on(&valkey.addr()).await;
}

async fn keys_as_on(addr: &str) {
    let mut r = RawClient::connect(addr).await;
    let table = KeyTable::from_command(&r.call_raw(&["COMMAND"]).await).expect("COMMAND");
    assert!(table.len() > 200, "{} commands", table.len());
    let commands: &[&[&str]] = &[
        &["GET", "k"],
        &["SET", "k", "v", "EX", "10", "GET"],
        &["MSET", "a", "1", "b", "2", "c", "3"],
        &["MGET", "a", "b", "c"],
        &["DEL", "a", "b"],
        &["EVAL", "return 1", "2", "k1", "k2", "arg"],
        &[
            "EVALSHA",
            "0000000000000000000000000000000000000000",
            "1",
            "k1",
        ],
        &["ZUNIONSTORE", "dst", "2", "s1", "s2", "WEIGHTS", "1", "2"],
        &["XREAD", "COUNT", "2", "STREAMS", "s1", "s2", "0", "0"],
        &["XREADGROUP", "GROUP", "g", "c", "STREAMS", "s1", ">"],
        &["XGROUP", "CREATE", "s", "g", "$"],
        &["OBJECT", "ENCODING", "k"],
        &["LMOVE", "a", "b", "LEFT", "RIGHT"],
        &["BLMPOP", "0", "2", "l1", "l2", "LEFT"],
        &["SINTERCARD", "2", "a", "b", "LIMIT", "1"],
        &["RENAME", "a", "b"],
        &[
            "GEOSEARCHSTORE",
            "d",
            "s",
            "FROMLONLAT",
            "0",
            "0",
            "BYRADIUS",
            "1",
            "km",
        ],
        &["BITOP", "AND", "d", "a", "b"],
        &["PING"],
        &["PUBLISH", "ch", "m"],
    ];
    for args in commands {
        let ours = table.keys(&args.iter().map(|a| a.as_bytes()).collect::<Vec<_>>());
        let mut getkeys = vec!["COMMAND", "GETKEYS"];
        getkeys.extend_from_slice(args);
        let theirs = r.call_raw(&getkeys).await;
        let theirs: Vec<Vec<u8>> = match redis_protocol::resp2::decode::decode(&theirs) {
            Ok(Some((OwnedFrame::Array(keys), _))) => keys
                .into_iter()
                .map(|k| match k {
                    OwnedFrame::BulkString(b) => b,
                    other => panic!("{other:?}"),
                })
                .collect(),
            // "The command has no key arguments"
            Ok(Some((OwnedFrame::Error(_), _))) => Vec::new(),
            other => panic!("{args:?}: {other:?}"),
        };
        let ours: Vec<Vec<u8>> = ours
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
            .into_iter()
            .map(|k| k.to_vec())
            .collect();
        assert_eq!(ours, theirs, "{args:?} on {addr}");
    }
    // The router's slot, found for one-key commands without walking the
    // specs, is the slot of the keys the walk finds; names in any case.
    let mut routed: Vec<Vec<&[u8]>> = commands
        .iter()
        .map(|args| args.iter().map(|a| a.as_bytes()).collect())
        .collect();
    routed.push(vec![b"get", b"k"]);
    routed.push(vec![b"sEt", b"{k}x", b"v"]);
    routed.push(vec![b"GET"]);
    routed.push(vec![b"INCR", b"counter"]);
    for args in &routed {
        let walked = match table.routing_args(args) {
            Ok(keys) => slot_of(&keys).map_err(|CrossSlot| None),
            Err(e) => Err(Some(e)),
        };
        assert_eq!(table.routing_slot(args), walked, "{args:?} on {addr}");
    }
    assert_eq!(
        table.routing_slot(&[b"sEt", b"{k}x", b"v"]),
        Ok(Some(key_slot(b"k")))
    );
    // SORT's BY and GET name keys the specs cannot give.
    let sort: Vec<&[u8]> = vec![b"SORT", b"k", b"BY", b"w_*"];
    assert_eq!(table.keys(&sort), Err(KeysError::Incomplete));
    let unknown: Vec<&[u8]> = vec![b"NOSUCH", b"k"];
    assert!(matches!(table.keys(&unknown), Err(KeysError::Unknown(_))));
    let short: Vec<&[u8]> = vec![b"ZUNIONSTORE", b"d", b"3", b"a"];
    assert_eq!(table.keys(&short), Err(KeysError::Syntax));
    // A shard channel is no key, but it is what routes the command.
    let spublish: Vec<&[u8]> = vec![b"SPUBLISH", b"ch", b"m"];
    assert_eq!(table.keys(&spublish), Ok(vec![]));
    assert_eq!(table.routing_args(&spublish), Ok(vec![&b"ch"[..]]));
    let ssub: Vec<&[u8]> = vec![b"SSUBSCRIBE", b"c1", b"c2"];
    assert_eq!(table.routing_args(&ssub), Ok(vec![&b"c1"[..], b"c2"]));
    assert_eq!(slot_of(&[b"{o}1", b"{o}2"]), Ok(Some(key_slot(b"o"))));
    assert_eq!(slot_of(&[b"a", b"b"]), Err(CrossSlot));
}

/// A cluster of three primaries and its slot map.
async fn three_primaries() -> (Cluster, SlotMap) {
    let cluster = Cluster::start(3, 0);
    let (map, _) = topology::fetch(&lockgate::Config::default(), &[cluster.seed()])
        .await
        .expect("a map");
    (cluster, map)
}

/// A reply as a `LocalReply`, to merge and compare.
fn local(raw: &[u8]) -> LocalReply {
    fn of(f: OwnedFrame) -> LocalReply {
        match f {
            OwnedFrame::SimpleString(s) if s == b"OK" => LocalReply::Status("OK"),
            OwnedFrame::SimpleString(s) | OwnedFrame::BulkString(s) => LocalReply::Bulk(s.into()),
            OwnedFrame::Error(e) => LocalReply::Error(e.into_bytes().into()),
            OwnedFrame::Integer(n) => LocalReply::Integer(n),
            OwnedFrame::Array(items) => LocalReply::Array(items.into_iter().map(of).collect()),
            OwnedFrame::Null => LocalReply::Null,
        }
    }
    match redis_protocol::resp2::decode::decode(raw) {
        Ok(Some((f, _))) => of(f),
        other => panic!("{other:?}"),
    }
}

/// Multi-key commands across slots, split per slot, each part sent to the
/// primary the map names, merged: the same replies one Redis gives to the
/// whole commands, in the same sequence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_commands_answer_as_one_redis_does() {
    let (_cluster, map) = three_primaries().await;
    let single = support::RedisServer::start();
    let mut one = RawClient::connect(single.addr()).await;
    let steps: &[&[&str]] = &[
        &["MSET", "a", "1", "b", "2", "c", "3", "{a}x", "4"],
        &["MGET", "a", "b", "nope", "c", "{a}x"],
        &["EXISTS", "a", "b", "nope", "a"],
        &["TOUCH", "c", "nope", "b"],
        &["DEL", "a", "nope", "{a}x"],
        &["MGET", "a", "b", "{a}x"],
        &["UNLINK", "b", "c"],
        &["EXISTS", "b", "c"],
    ];
    for args in steps {
        let bytes: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        let s = split::split(&bytes).unwrap_or_else(|| panic!("{args:?} spans slots"));
        let mut replies = Vec::new();
        for part in &s.parts {
            let node = &map.shard_of_slot(part.slot).expect("served").primary;
            let mut n = RawClient::connect(node).await;
            n.send(&part.command).await;
            replies.push(local(&n.read_raw_frames(1).await));
        }
        let direct = local(&one.call_raw(args).await);
        assert_eq!(s.merge(&replies), direct, "{args:?}");
    }
    let not: Vec<&[u8]> = vec![b"SUNIONSTORE", b"a", b"b"];
    assert_eq!(split::split(&not), None);
    assert!(split::CROSSSLOT.starts_with("CROSSSLOT "));
}

/// `SCAN` walked over every primary with the composed cursor returns
/// every key of the cluster, and ends at cursor 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scan_walks_every_primary_with_one_cursor() {
    let (_cluster, map) = three_primaries().await;
    let mut primaries: Vec<String> = map.shards().iter().map(|s| s.primary.clone()).collect();
    primaries.sort();
    let mut written = std::collections::BTreeSet::new();
    for i in 0..300 {
        let key = format!("scan:{i}");
        let node = &map.shard_of_key(key.as_bytes()).expect("served").primary;
        let mut n = RawClient::connect(node).await;
        assert_eq!(n.call_s(&["SET", &key, "v"]).await, "+OK\r\n");
        written.insert(key);
    }
    let mut seen = std::collections::BTreeSet::new();
    let mut cursor = 0u64;
    let mut rounds = 0;
    loop {
        rounds += 1;
        assert!(rounds < 1_000, "the walk ends");
        let at = scan::place(cursor, primaries.len()).expect("a cursor of ours");
        let mut n = RawClient::connect(&primaries[at.primary]).await;
        let reply = n
            .call_raw(&["SCAN", &at.cursor.to_string(), "COUNT", "20"])
            .await;
        let Ok(Some((OwnedFrame::Array(parts), _))) = redis_protocol::resp2::decode::decode(&reply)
        else {
            panic!("SCAN reply");
        };
        let (OwnedFrame::BulkString(next), OwnedFrame::Array(keys)) = (&parts[0], &parts[1]) else {
            panic!("SCAN reply shape");
        };
        for k in keys {
            if let OwnedFrame::BulkString(k) = k {
                seen.insert(String::from_utf8_lossy(k).into_owned());
            }
        }
        let next: u64 = std::str::from_utf8(next).unwrap().parse().unwrap();
        cursor = scan::next_cursor(at.primary, next, primaries.len()).expect("carried");
        if cursor == 0 {
            break;
        }
    }
    assert_eq!(seen, written);
}

/// Keyspace-wide commands over every primary merge into what one Redis
/// answers for the same keys, and the refusals are a cluster node's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyspace_wide_commands_merge_as_one_redis_answers() {
    let (cluster, map) = three_primaries().await;
    let single = support::RedisServer::start();
    let mut one = RawClient::connect(single.addr()).await;
    for i in 0..50 {
        let key = format!("wide:{i}");
        let node = &map.shard_of_key(key.as_bytes()).expect("served").primary;
        let mut n = RawClient::connect(node).await;
        assert_eq!(n.call_s(&["SET", &key, "v"]).await, "+OK\r\n");
        assert_eq!(one.call_s(&["SET", &key, "v"]).await, "+OK\r\n");
    }
    let sorted = |r: LocalReply| match r {
        LocalReply::Array(mut items) => {
            items.sort_by_key(|i| format!("{i:?}"));
            LocalReply::Array(items)
        }
        other => other,
    };
    for args in [
        &["DBSIZE"][..],
        &["KEYS", "wide:*"],
        &["FLUSHALL"],
        &["DBSIZE"],
    ] {
        let bytes: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        let f = fanout::fanout(&bytes).expect("keyspace-wide");
        let mut replies = Vec::new();
        for shard in map.shards() {
            let mut n = RawClient::connect(&shard.primary).await;
            replies.push(local(&n.call_raw(args).await));
        }
        let direct = local(&one.call_raw(args).await);
        assert_eq!(sorted(f.merge(replies)), sorted(direct), "{args:?}");
    }
    let mut node = RawClient::connect(cluster.seed()).await;
    for args in [&["SELECT", "1"][..], &["SWAPDB", "0", "1"]] {
        let bytes: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        let f = fanout::fanout(&bytes).expect("refused");
        assert_eq!(
            f.merge(Vec::new()),
            local(&node.call_raw(args).await),
            "{args:?}"
        );
    }
}
