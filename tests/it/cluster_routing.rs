//! lockgate in front of a real Redis Cluster (`[upstream.cluster]`), as
//! an unchanged app talks to it: keyed commands reach the node that
//! serves their slot, multi-key commands across slots are split and
//! merged, keyspace-wide ones reach every primary, transactions stay in
//! one slot as a cluster keeps them, blocking commands and subscriptions
//! work, a slot migrated under a pipeline loses and reorders nothing, a
//! node down fails only its slots. In both upstream modes where it
//! matters. Locks: `cluster_locks.rs`.

use crate::support;

use std::collections::BTreeSet;
use std::time::Duration;

use lockgate::cluster::map::SlotMap;
use lockgate::cluster::slot::key_slot;
use lockgate::config::UpstreamMode;
use lockgate::Config;
use support::cluster::{on_node_of, run_client, Cluster};
use support::resp::Resp;
use support::{cmd, Lockgate, RawClient};

async fn call(c: &mut RawClient, args: &[&str]) -> Resp {
    Resp::parse(&c.call_raw(args).await)
}

/// Sends every command in one write and reads as many replies.
async fn pipeline(c: &mut RawClient, commands: &[Vec<String>]) -> Vec<Resp> {
    pipeline_frames(c, commands, 0).await
}

/// As [`pipeline`], reading `extra` frames more than commands.
async fn pipeline_frames(c: &mut RawClient, commands: &[Vec<String>], extra: usize) -> Vec<Resp> {
    let mut bytes = Vec::new();
    for command in commands {
        let args: Vec<&str> = command.iter().map(String::as_str).collect();
        bytes.extend(cmd(&args));
    }
    c.send(&bytes).await;
    let n = commands.len() + extra;
    let raw = c.read_raw_frames(n).await;
    let mut pos = 0;
    (0..n).map(|_| Resp::decode(&raw, &mut pos)).collect()
}

fn words(line: &str) -> Vec<String> {
    line.split(' ').map(str::to_string).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_multi_key_and_keyspace_commands_reach_every_primary() {
    let cluster = Cluster::start(3, 1);
    for mode in [UpstreamMode::Shared, UpstreamMode::Dedicated] {
        keyed_multi_key_and_keyspace(&cluster, mode).await;
    }
}

async fn keyed_multi_key_and_keyspace(cluster: &Cluster, mode: UpstreamMode) {
    let lg = cluster.lockgate(|c| c.proxy.upstream = mode).await;
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(call(&mut c, &["FLUSHALL"]).await, Resp::Status("OK".into()));
    let keys: Vec<String> = (0..300).map(|i| format!("k:{i}")).collect();
    let sets: Vec<Vec<String>> = keys
        .iter()
        .map(|k| words(&format!("SET {k} v-{k}")))
        .collect();
    for reply in pipeline(&mut c, &sets).await {
        assert_eq!(reply, Resp::Status("OK".into()), "{mode:?}");
    }
    // Each key is on the node that serves its slot (asked directly: no
    // redirection), and every primary got some.
    let map = cluster.map().await;
    let mut per_node = std::collections::HashMap::new();
    for key in keys.iter().step_by(7) {
        let (node, value) = on_node_of(&map, key, &["GET", key]).await;
        assert_eq!(
            value,
            Resp::Bulk(Some(format!("v-{key}").into_bytes())),
            "{key} on {node}"
        );
        *per_node.entry(node).or_insert(0) += 1;
    }
    assert_eq!(per_node.len(), 3, "{per_node:?}");

    // Across slots: split and merged in argument order.
    let mget = call(&mut c, &["MGET", "k:1", "nokey", "k:2", "k:299"]).await;
    assert_eq!(
        mget,
        Resp::Array(Some(vec![
            Resp::Bulk(Some(b"v-k:1".to_vec())),
            Resp::Bulk(None),
            Resp::Bulk(Some(b"v-k:2".to_vec())),
            Resp::Bulk(Some(b"v-k:299".to_vec())),
        ]))
    );
    let exists = call(&mut c, &["EXISTS", "k:3", "k:4", "k:4", "nokey"]).await;
    assert_eq!(exists, Resp::Int(3));
    assert_eq!(
        call(&mut c, &["MSET", "m:a", "1", "m:b", "2", "m:c", "3"]).await,
        Resp::Status("OK".into())
    );
    let got = call(&mut c, &["MGET", "m:a", "m:b", "m:c"]).await;
    let got: Vec<&str> = got.items().iter().map(Resp::text).collect();
    assert_eq!(got, ["1", "2", "3"]);
    assert_eq!(
        call(&mut c, &["DEL", "m:a", "m:b", "m:c", "nokey"]).await,
        Resp::Int(3)
    );
    // A command whose keys span slots and cannot be split: as a cluster.
    assert_eq!(
        call(&mut c, &["RENAME", "k:1", "k:2"]).await,
        Resp::Error("CROSSSLOT Keys in request don't hash to the same slot".into())
    );
    assert_eq!(
        call(&mut c, &["RENAME", "{t}a", "{t}b"]).await,
        Resp::Error("ERR no such key".into()),
        "same slot: the node's own answer"
    );

    // Keyspace-wide: summed, merged, walked.
    assert_eq!(call(&mut c, &["DBSIZE"]).await, Resp::Int(300));
    let all: BTreeSet<String> = keys.iter().cloned().collect();
    let listed: BTreeSet<String> = call(&mut c, &["KEYS", "k:*"])
        .await
        .items()
        .iter()
        .map(|k| k.text().to_string())
        .collect();
    assert_eq!(listed, all);
    let mut cursor = "0".to_string();
    let mut walked = BTreeSet::new();
    let mut calls = 0;
    loop {
        let reply = call(&mut c, &["SCAN", &cursor, "COUNT", "40"]).await;
        let items = reply.items();
        cursor = items[0].text().to_string();
        walked.extend(items[1].items().iter().map(|k| k.text().to_string()));
        calls += 1;
        assert!(calls < 200, "the walk ends");
        if cursor == "0" {
            break;
        }
    }
    assert_eq!(walked, all, "SCAN visits every key of every primary");
    assert!(
        call(&mut c, &["SCAN", "99999999999999999999"]).await
            == Resp::Error("ERR invalid cursor".into())
    );
    let sha = call(&mut c, &["SCRIPT", "LOAD", "return KEYS[1]"]).await;
    for key in ["k:1", "k:2", "k:3"] {
        assert_eq!(
            call(&mut c, &["EVALSHA", sha.text(), "1", key]).await,
            Resp::Bulk(Some(key.as_bytes().to_vec())),
            "the script is loaded on every primary"
        );
    }

    // A cluster-aware client sees one node, lockgate, serving every slot.
    let slots = c.call_raw(&["CLUSTER", "SLOTS"]).await;
    let seen = SlotMap::from_slots(&slots, "x:1").expect("CLUSTER SLOTS");
    assert_eq!(seen.unserved(), 0);
    assert_eq!(seen.shards().len(), 1);
    assert_eq!(seen.shards()[0].primary, lg.addr.to_string());
    assert_eq!(
        call(&mut c, &["CLUSTER", "KEYSLOT", "k:1"]).await,
        Resp::Int(i64::from(key_slot(b"k:1")))
    );
    assert_eq!(call(&mut c, &["READONLY"]).await, Resp::Status("OK".into()));

    assert_eq!(call(&mut c, &["FLUSHALL"]).await, Resp::Status("OK".into()));
    assert_eq!(call(&mut c, &["DBSIZE"]).await, Resp::Int(0));
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_stay_in_one_slot_as_on_a_cluster() {
    let cluster = Cluster::start(3, 0);
    let lg = cluster
        .lockgate(|c| c.proxy.upstream = UpstreamMode::Shared)
        .await;
    let mut c = RawClient::connect(lg.addr).await;
    let ok = || Resp::Status("OK".into());
    let queued = || Resp::Status("QUEUED".into());
    // One slot: carried out on its node, whole.
    let replies = pipeline(
        &mut c,
        &[
            words("MULTI"),
            words("SET {t}a 1"),
            words("INCR {t}a"),
            words("EXEC"),
        ],
    )
    .await;
    assert_eq!(
        replies,
        [
            ok(),
            queued(),
            queued(),
            Resp::Array(Some(vec![ok(), Resp::Int(2)]))
        ]
    );
    // Keyless commands before the first key ride with it.
    let replies = pipeline(
        &mut c,
        &[
            words("MULTI"),
            words("PING"),
            words("INCR {t}a"),
            words("EXEC"),
        ],
    )
    .await;
    assert_eq!(
        replies[3],
        Resp::Array(Some(vec![Resp::Status("PONG".into()), Resp::Int(3)]))
    );
    // A key in another slot: refused as queued, and EXEC aborts; nothing
    // of it ran.
    let replies = pipeline(
        &mut c,
        &[
            words("MULTI"),
            words("SET x 1"),
            words("SET y 2"),
            words("EXEC"),
            words("GET x"),
        ],
    )
    .await;
    assert_eq!(
        replies,
        [
            ok(),
            queued(),
            Resp::Error("CROSSSLOT Keys in request don't hash to the same slot".into()),
            Resp::Error("EXECABORT Transaction discarded because of previous errors.".into()),
            Resp::Bulk(None),
        ]
    );
    // WATCH decides: a change by another client makes EXEC fail (nil).
    assert_eq!(call(&mut c, &["WATCH", "w"]).await, ok());
    let mut other = RawClient::connect(lg.addr).await;
    assert_eq!(call(&mut other, &["SET", "w", "theirs"]).await, ok());
    let replies = pipeline(
        &mut c,
        &[words("MULTI"), words("SET w mine"), words("EXEC")],
    )
    .await;
    assert_eq!(replies[2], Resp::Array(None), "{replies:?}");
    assert_eq!(
        call(&mut c, &["GET", "w"]).await,
        Resp::Bulk(Some(b"theirs".to_vec()))
    );
    // Unwatched, it applies.
    assert_eq!(call(&mut c, &["WATCH", "w"]).await, ok());
    let replies = pipeline(
        &mut c,
        &[words("MULTI"), words("SET w mine"), words("EXEC")],
    )
    .await;
    assert_eq!(replies[2], Resp::Array(Some(vec![ok()])));
    // A client that waits for each reply (redis-cli) is answered at once.
    for (line, want) in [
        ("MULTI", ok()),
        ("PING", queued()),
        ("DISCARD", ok()),
        ("GET w", Resp::Bulk(Some(b"mine".to_vec()))),
    ] {
        assert_eq!(
            call(
                &mut c,
                &words(line).iter().map(String::as_str).collect::<Vec<_>>()
            )
            .await,
            want,
            "{line}"
        );
    }
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_commands_and_subscriptions_hold_no_one_else() {
    let cluster = Cluster::start(3, 0);
    let lg = cluster
        .lockgate(|c| c.proxy.upstream = UpstreamMode::Shared)
        .await;
    let mut blocked = RawClient::connect(lg.addr).await;
    blocked.send(&cmd(&["BLPOP", "queue", "10"])).await;
    let mut sub = RawClient::connect(lg.addr).await;
    let subscribed = call(&mut sub, &["SUBSCRIBE", "news"]).await;
    assert_eq!(subscribed.items()[0].text(), "subscribe");
    // The shared connections still serve everyone else, on every node.
    let mut c = RawClient::connect(lg.addr).await;
    for i in 0..30 {
        let key = format!("free:{i}");
        assert_eq!(
            call(&mut c, &["SET", &key, "1"]).await,
            Resp::Status("OK".into())
        );
    }
    assert_eq!(call(&mut c, &["RPUSH", "queue", "job"]).await, Resp::Int(1));
    let got = Resp::parse(&blocked.read_raw().await);
    assert_eq!(got.items()[1].text(), "job");
    // The blocked client goes on afterwards, in order.
    assert_eq!(
        call(&mut blocked, &["GET", "free:1"]).await,
        Resp::Bulk(Some(b"1".to_vec()))
    );
    // A message published through lockgate reaches the subscriber (the
    // cluster carries it to every node).
    call(&mut c, &["PUBLISH", "news", "hello"]).await;
    let message = Resp::parse(&sub.read_raw().await);
    assert_eq!(message.items()[2].text(), "hello");
    lg.stop().await;
}

/// A client that unsubscribes from everything is an ordinary connection
/// again: its next commands reach every slot's node (no `MOVED`), in both
/// protocols, also when they come in the same write as the unsubscribe.
/// A shard channel still subscribed keeps it subscribed (the `unsubscribe`
/// frame's count of 0 counts channels and patterns only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_unsubscribes_from_everything_is_routed_again() {
    let cluster = Cluster::start(3, 0);
    let lg = cluster
        .lockgate(|c| c.proxy.upstream = UpstreamMode::Shared)
        .await;
    let mut c = RawClient::connect(lg.addr).await;
    let keys: Vec<String> = (0..30).map(|i| format!("after:{i}")).collect();
    let sets: Vec<Vec<String>> = keys
        .iter()
        .map(|k| vec!["SET".into(), k.clone(), k.clone()])
        .collect();
    assert!(pipeline(&mut c, &sets)
        .await
        .iter()
        .all(|r| *r == Resp::Status("OK".into())));
    let gets = |prefix: Vec<Vec<String>>| {
        let mut all = prefix;
        all.extend(keys.iter().map(|k| vec!["GET".into(), k.clone()]));
        all
    };
    let check = |replies: &[Resp], skip: usize, what: &str| {
        for (k, r) in keys.iter().zip(&replies[skip..]) {
            assert_eq!(
                *r,
                Resp::Bulk(Some(k.clone().into_bytes())),
                "{what}: GET {k}"
            );
        }
    };
    for resp3 in [false, true] {
        let mut sub = RawClient::connect(lg.addr).await;
        if resp3 {
            sub.call_raw(&["HELLO", "3"]).await;
        }
        let mut p = RawClient::connect(lg.addr).await;
        let subscribed = call(&mut sub, &["SUBSCRIBE", "news", "sports"]).await;
        assert_eq!(subscribed.items()[0].text(), "subscribe");
        sub.read_raw().await; // the second channel's confirmation
        call(&mut p, &["PUBLISH", "news", "hello"]).await;
        assert_eq!(
            Resp::parse(&sub.read_raw().await).items()[2].text(),
            "hello"
        );
        // One write: the last unsubscribe (a frame per channel) and 30
        // GETs for every node.
        let replies = pipeline_frames(&mut sub, &gets(vec![words("UNSUBSCRIBE")]), 1).await;
        assert_eq!(replies[0].items()[0].text(), "unsubscribe", "resp3 {resp3}");
        let (first, second) = (&replies[0].items()[2], &replies[1].items()[2]);
        assert_eq!(
            (first, second),
            (&Resp::Int(1), &Resp::Int(0)),
            "resp3 {resp3}"
        );
        check(&replies, 2, &format!("resp3 {resp3}, same write"));
        // And once more, the next subscription on a fresh pin.
        call(&mut sub, &["PSUBSCRIBE", "n*"]).await;
        call(&mut sub, &["PUNSUBSCRIBE", "n*"]).await;
        check(
            &pipeline(&mut sub, &gets(vec![])).await,
            0,
            "after PSUBSCRIBE",
        );
    }
    // A shard channel left: still subscribed until it goes too.
    let mut sub = RawClient::connect(lg.addr).await;
    call(&mut sub, &["SSUBSCRIBE", "{after:3}shard"]).await;
    call(&mut sub, &["SUBSCRIBE", "news"]).await;
    let unsub = call(&mut sub, &["UNSUBSCRIBE", "news"]).await;
    assert_eq!(unsub.items()[2], Resp::Int(0));
    let refused = call(&mut sub, &["GET", "after:3"]).await;
    assert!(matches!(refused, Resp::Error(_)), "{refused}");
    call(&mut sub, &["SUNSUBSCRIBE"]).await;
    check(
        &pipeline(&mut sub, &gets(vec![])).await,
        0,
        "after SUNSUBSCRIBE",
    );
    // No connection of a subscription is left open.
    let pool = lg.ctx.cluster.clone().expect("a cluster pool");
    crate::until!(
        "the pinned connections closed",
        pool.metrics()
            .own_open
            .load(std::sync::atomic::Ordering::Relaxed)
            == 0
    );
    lg.stop().await;
}

/// A shard failed over (`CLUSTER FAILOVER` on its replica) while a client
/// pipelines `INCR`s on keys of every shard: every reply is the right
/// count, in order (the old primary's `MOVED`s followed to the new one),
/// and no increment is lost or doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_failed_over_under_pipelines_loses_and_reorders_nothing() {
    let cluster = Cluster::start(3, 1);
    let lg = cluster
        .lockgate(|c| {
            c.proxy.upstream = UpstreamMode::Shared;
            c.upstream.cluster.refresh_interval_ms = 200;
        })
        .await;
    let pool = lg.ctx.cluster.clone().expect("a cluster pool");
    let keys: Vec<String> = (0..30).map(|i| format!("fo:n:{i}")).collect();
    let names: Vec<&str> = keys.iter().map(String::as_str).collect();
    assert_eq!(cluster.primaries_of(&names).await.len(), 3);
    // The replicas are in the map once they have attached.
    let replica_of = |m: Option<std::sync::Arc<SlotMap>>| {
        m.and_then(|m| {
            m.shard_of_key(b"fo:n:0")
                .and_then(|s| s.replicas.first().cloned())
        })
    };
    crate::until!(
        "the shard's replica in the map",
        replica_of(pool.map()).is_some()
    );
    let replica = replica_of(pool.map()).expect("a replica");
    let mut r = RawClient::connect(&replica).await;
    crate::until!("the replica's link up", {
        let info = call(&mut r, &["INFO", "replication"]).await;
        info.text().contains("master_link_status:up")
    });
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let client = {
        let (addr, keys, stop) = (lg.addr, keys.clone(), stop.clone());
        tokio::spawn(async move {
            let mut c = RawClient::connect(addr).await;
            let incrs: Vec<Vec<String>> = keys
                .iter()
                .map(|k| vec!["INCR".into(), k.clone()])
                .collect();
            let mut round = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                round += 1;
                let replies = pipeline(&mut c, &incrs).await;
                for (k, reply) in keys.iter().zip(&replies) {
                    assert_eq!(*reply, Resp::Int(round), "INCR {k} in round {round}");
                }
            }
            round
        })
    };
    // Some rounds before, the failover, some rounds after lockgate has
    // the new map.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        call(&mut r, &["CLUSTER", "FAILOVER"]).await,
        Resp::Status("OK".into())
    );
    crate::until!("lockgate to follow the failover", {
        pool.map().and_then(|m| {
            m.shard_of_key(keys[0].as_bytes())
                .map(|s| s.primary.clone())
        }) == Some(replica.clone())
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let rounds = tokio::time::timeout(Duration::from_secs(30), client)
        .await
        .expect("the client ends")
        .expect("every reply right");
    assert!(rounds > 3, "{rounds} rounds");
    // Every increment once, on the node serving the key now.
    let map = cluster.map().await;
    for k in &keys {
        let (node, v) = on_node_of(&map, k, &["GET", k]).await;
        let want = Resp::Bulk(Some(rounds.to_string().into_bytes()));
        assert_eq!(v, want, "{k} on {node}");
    }
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_migrated_under_a_pipeline_loses_and_reorders_nothing() {
    let cluster = Cluster::start(3, 0);
    let lg = cluster
        .lockgate(|c| c.proxy.upstream = UpstreamMode::Shared)
        .await;
    let map = cluster.map().await;
    let slot = key_slot(b"mig");
    let source = map.shard_of_slot(slot).expect("served").primary.clone();
    let target = (map.shards().iter())
        .find(|s| s.primary != source)
        .expect("another primary")
        .primary
        .clone();
    let mut c = RawClient::connect(lg.addr).await;
    let fill: Vec<Vec<String>> = (0..200)
        .map(|i| words(&format!("SET {{mig}}:{i} {i}")))
        .collect();
    pipeline(&mut c, &fill).await;
    let id = |addr: String| async move {
        let mut n = RawClient::connect(&addr).await;
        let reply = call(&mut n, &["CLUSTER", "MYID"]).await;
        reply.text().to_string()
    };
    let (source_id, target_id) = (id(source.clone()).await, id(target.clone()).await);

    // The slot starts moving: a key not on the source any more (the
    // counter, new) is asked for on the target (`ASK`).
    let mut src = RawClient::connect(&source).await;
    let mut tgt = RawClient::connect(&target).await;
    let s = slot.to_string();
    assert_eq!(
        call(
            &mut tgt,
            &["CLUSTER", "SETSLOT", &s, "IMPORTING", &source_id]
        )
        .await,
        Resp::Status("OK".into())
    );
    assert_eq!(
        call(
            &mut src,
            &["CLUSTER", "SETSLOT", &s, "MIGRATING", &target_id]
        )
        .await,
        Resp::Status("OK".into())
    );
    // A client counts on one key of the slot and reads the others, in
    // pipelines, while the slot moves.
    let addr = lg.addr;
    let counting = tokio::spawn(async move {
        let mut c = RawClient::connect(addr).await;
        let mut expected = 0;
        for round in 0..60 {
            let mut commands = Vec::new();
            for i in 0..20 {
                commands.push(words("INCR {mig}:counter"));
                commands.push(words(&format!("GET {{mig}}:{}", (round * 20 + i) % 200)));
            }
            let replies = pipeline(&mut c, &commands).await;
            for (i, pair) in replies.chunks(2).enumerate() {
                expected += 1;
                assert_eq!(pair[0], Resp::Int(expected), "round {round}: {pair:?}");
                let n = (round * 20 + i) % 200;
                assert_eq!(
                    pair[1],
                    Resp::Bulk(Some(n.to_string().into_bytes())),
                    "round {round}"
                );
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        expected
    });
    let (host, port) = target.rsplit_once(':').expect("HOST:PORT");
    loop {
        let keys = call(&mut src, &["CLUSTER", "GETKEYSINSLOT", &s, "7"]).await;
        let keys: Vec<String> = keys.items().iter().map(|k| k.text().to_string()).collect();
        if keys.is_empty() {
            break;
        }
        let mut args = vec!["MIGRATE", host, port, "", "0", "5000", "KEYS"];
        args.extend(keys.iter().map(String::as_str));
        let moved = call(&mut src, &args).await;
        assert!(matches!(moved, Resp::Status(_)), "{moved:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for node in &cluster.nodes {
        let mut n = RawClient::connect(node.addr()).await;
        let set = call(&mut n, &["CLUSTER", "SETSLOT", &s, "NODE", &target_id]).await;
        assert_eq!(set, Resp::Status("OK".into()), "{}", node.addr());
    }
    let counted = counting.await.expect("the counting client");
    assert_eq!(counted, 1_200);
    let mut t = RawClient::connect(&target).await;
    assert_eq!(
        call(&mut t, &["GET", "{mig}:counter"]).await,
        Resp::Bulk(Some(b"1200".to_vec()))
    );
    let metrics = lg.ctx.cluster.as_ref().expect("pool").metrics();
    let followed = metrics.moved.load(std::sync::atomic::Ordering::Relaxed)
        + metrics.ask.load(std::sync::atomic::Ordering::Relaxed);
    // The counter is new to the target from its first INCR (`ASK` while
    // the slot migrates; `MOVED` if the move was done first): followed.
    assert!(followed > 0, "no redirection followed");
    // After the move the map is read again and commands go straight to
    // the new owner.
    let mut c2 = RawClient::connect(lg.addr).await;
    assert_eq!(
        call(&mut c2, &["GET", "{mig}:7"]).await,
        Resp::Bulk(Some(b"7".to_vec()))
    );
    crate::until!("the map to follow the moved slot", {
        lg.ctx
            .cluster
            .as_ref()
            .expect("pool")
            .map()
            .and_then(|m| m.shard_of_slot(slot).map(|s| s.primary.clone()))
            == Some(target.clone())
    });
    println!("cluster_routing: redirections followed during the move: {followed}");
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_down_fails_its_slots_only() {
    let mut cluster = Cluster::start(3, 0);
    let lg = cluster
        .lockgate(|c| c.proxy.upstream = UpstreamMode::Shared)
        .await;
    let mut c = RawClient::connect(lg.addr).await;
    let map = cluster.map().await;
    let down = cluster.nodes[1].addr();
    let key_on = |node: &str| {
        (0..10_000)
            .map(|i| format!("key:{i}"))
            .find(|k| map.shard_of_key(k.as_bytes()).map(|s| s.primary.as_str()) == Some(node))
            .expect("a key on the node")
    };
    let (dead_key, live_key) = (key_on(&down), key_on(&cluster.nodes[0].addr()));
    assert_eq!(
        call(&mut c, &["SET", &dead_key, "1"]).await,
        Resp::Status("OK".into())
    );
    assert_eq!(
        call(&mut c, &["SET", &live_key, "1"]).await,
        Resp::Status("OK".into())
    );
    assert_eq!(lockgate::http::not_ready(&lg.ctx), None);
    let nodes = call(&mut c, &["LOCKGATE", "NODES"]).await;
    assert_eq!(nodes.items().len(), 3, "{nodes}");
    for row in nodes.items() {
        assert_eq!(row.field("state").text(), "up", "{row}");
    }
    tokio::task::block_in_place(|| cluster.nodes[1].stop());
    let reply = call(&mut c, &["GET", &dead_key]).await;
    let Resp::Error(text) = reply else {
        panic!("an error for a key on the node down: {reply:?}");
    };
    assert!(text.contains(&down), "names the node: {text}");
    assert_eq!(
        call(&mut c, &["SET", &live_key, "2"]).await,
        Resp::Status("OK".into())
    );
    assert_eq!(
        call(&mut c, &["GET", &live_key]).await,
        Resp::Bulk(Some(b"2".to_vec()))
    );
    // Not ready: a primary is unreachable; LOCKGATE NODES says which.
    crate::until!("/readyz to name the node down", {
        lockgate::http::not_ready(&lg.ctx).is_some_and(|why| why.contains(&down))
    });
    let nodes = call(&mut c, &["LOCKGATE", "NODES"]).await;
    let row = (nodes.items().iter())
        .find(|r| r.field("addr").text() == down)
        .expect("the node down listed");
    assert_eq!(row.field("state").text(), "down", "{row}");
    // And /metrics, one labelled series per primary.
    let text = lockgate::exposition::render(&lg.ctx).expect("metrics");
    let m = support::ops::Metrics::parse(&text);
    for n in nodes.items() {
        let addr = n.field("addr").text();
        let want = if addr == down { 0.0 } else { 1.0 };
        assert_eq!(
            m.value("lockgate_cluster_node_up", &[("node", addr)]),
            want,
            "{addr}"
        );
    }
    lg.stop().await;
}

/// redis-py's `RedisCluster` and `redis-cli -c`, unmodified: they ask
/// lockgate for the cluster's layout, see one node serving every slot, and
/// work through it (their writes land on the nodes that serve the keys).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_aware_clients_work_through_lockgate() {
    let cluster = Cluster::start(3, 0);
    let lg = cluster
        .lockgate(|c| c.proxy.upstream = UpstreamMode::Shared)
        .await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/py/redis_py_cluster.py");
    run_client("python3", script, lg.addr, "redis-py cluster OK").await;
    let map = cluster.map().await;
    for i in [2, 77, 199] {
        let key = format!("py:c:{i}");
        let (node, value) = on_node_of(&map, &key, &["GET", &key]).await;
        assert_eq!(
            value,
            Resp::Bulk(Some(i.to_string().into_bytes())),
            "{key} on {node}"
        );
    }
    let port = lg.addr.port().to_string();
    let mut cli = std::process::Command::new("redis-cli");
    cli.args(["-c", "-p", &port, "SET", "cli:key", "v"]);
    let out = support::run_limited_async(cli, None, Duration::from_secs(10)).await;
    assert_eq!(support::show(&out.stdout).trim(), "OK");
    let mut cli = std::process::Command::new("redis-cli");
    cli.args(["-c", "-p", &port, "GET", "cli:key"]);
    let out = support::run_limited_async(cli, None, Duration::from_secs(10)).await;
    assert_eq!(support::show(&out.stdout).trim(), "v");
    lg.stop().await;
}

/// `GET`s the cluster's nodes have run, all together.
async fn gets_run(cluster: &Cluster) -> u64 {
    let mut total = 0;
    for node in &cluster.nodes {
        let mut c = RawClient::connect(node.addr()).await;
        let stats = call(&mut c, &["INFO", "commandstats"]).await;
        total += support::redis::command_calls(stats.text(), "get");
    }
    total
}

/// Sends `c` two `GET`s of `keys` per write, each write once the nodes
/// have run the last (counted from `base`), until they do not within 1 s
/// (or 100 writes): the GETs sent, and whether lockgate held them back.
async fn send_until_held(
    c: &mut RawClient,
    cluster: &Cluster,
    keys: &[String],
    base: u64,
) -> (u64, bool) {
    let mut sent = 0u64;
    for i in 0..100 {
        let (a, b) = (&keys[i % keys.len()], &keys[(i + 1) % keys.len()]);
        let mut bytes = cmd(&["GET", a]);
        bytes.extend(cmd(&["GET", b]));
        c.send(&bytes).await;
        sent += 2;
        let deadline = std::time::Instant::now() + Duration::from_secs(1);
        while gets_run(cluster).await - base < sent && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if gets_run(cluster).await - base < sent {
            return (sent, true);
        }
    }
    (sent, false)
}

/// A client that pipelines and stops reading holds a bounded amount of
/// lockgate's memory: past half of `proxy.shared_session_reply_bytes`
/// waiting for it, lockgate sends no more of its commands until it reads
/// (then every reply comes, right and in order); one that takes none for
/// `proxy.shared_reply_stall_ms` is closed, counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_holds_a_bounded_amount() {
    const VALUE: usize = 256 * 1024;
    let cluster = Cluster::start(3, 0);
    let lg = cluster
        .lockgate(|c| {
            c.proxy.upstream = UpstreamMode::Shared;
            c.proxy.shared_session_reply_bytes = 2 * 1024 * 1024;
            c.proxy.shared_reply_stall_ms = 60_000;
        })
        .await;
    let value = "v".repeat(VALUE);
    let keys: Vec<String> = (0..6).map(|i| format!("big:{i}")).collect();
    let mut setter = RawClient::connect(lg.addr).await;
    for k in &keys {
        assert_eq!(
            call(&mut setter, &["SET", k, &value]).await,
            Resp::Status("OK".into())
        );
    }
    let base = gets_run(&cluster).await;
    // One write of two GETs at a time, each awaited on the nodes, until
    // lockgate holds them back.
    let mut c = RawClient::connect(lg.addr).await;
    let (sent, blocked) = send_until_held(&mut c, &cluster, &keys, base).await;
    let run = gets_run(&cluster).await - base;
    assert!(
        blocked,
        "lockgate forwarded all {sent} GETs of a client that reads nothing"
    );
    // Half the limit in lockgate, the rest in the kernel's socket buffers
    // towards the client (a few MiB on loopback): far from the 200 GETs
    // (50 MiB) a client reading nothing would otherwise have run.
    assert!(
        run <= 64,
        "{run} GETs of {} KiB run for a client reading nothing",
        VALUE / 1024
    );
    // It reads: every reply, in order, and the rest goes on.
    for i in 0..sent as usize {
        let reply = c.read_raw().await;
        assert_eq!(reply.len(), VALUE + 11, "reply {i}");
    }
    assert_eq!(gets_run(&cluster).await - base, sent);
    lg.stop().await;

    // A client that takes nothing for the stall: closed, counted.
    let lg = cluster
        .lockgate(|c| {
            c.proxy.upstream = UpstreamMode::Shared;
            c.proxy.shared_session_reply_bytes = 2 * 1024 * 1024;
            c.proxy.shared_reply_stall_ms = 300;
        })
        .await;
    let mut c = RawClient::connect(lg.addr).await;
    let base = gets_run(&cluster).await;
    let (_, blocked) = send_until_held(&mut c, &cluster, &keys, base).await;
    assert!(blocked, "held back");
    let pool = lg.ctx.cluster.clone().expect("a cluster pool");
    crate::until!(
        "the client closed for taking nothing",
        pool.metrics()
            .output_limit
            .load(std::sync::atomic::Ordering::Relaxed)
            == 1
    );
    lg.stop().await;
}

/// A client's `AUTH` in front of a cluster whose nodes require a
/// password: lockgate's own credentials (`upstream.password`) are
/// accepted, with `HELLO 3 AUTH` too; a wrong password is refused as a
/// node refuses it; another user is refused with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_auth_with_lockgates_credentials_is_accepted() {
    let cluster = Cluster::start_secured(3, 0, "s3cret");
    let lg = cluster
        .lockgate(|c| {
            c.proxy.upstream = UpstreamMode::Shared;
            c.upstream.password = "s3cret".into();
        })
        .await;
    let ok = Resp::Status("OK".into());
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(call(&mut c, &["AUTH", "s3cret"]).await, ok);
    assert_eq!(call(&mut c, &["AUTH", "default", "s3cret"]).await, ok);
    let mut node = RawClient::connect(cluster.seed()).await;
    assert_eq!(
        call(&mut c, &["AUTH", "wrong"]).await,
        call(&mut node, &["AUTH", "wrong"]).await,
        "a wrong password, as a node answers it"
    );
    let other = call(&mut c, &["AUTH", "app", "pw"]).await;
    assert!(
        matches!(&other, Resp::Error(e) if e.starts_with("ERR lockgate: AUTH as 'app'")),
        "{other}"
    );
    // The session goes on, on every node.
    for i in 0..20 {
        let key = format!("auth:{i}");
        assert_eq!(call(&mut c, &["SET", &key, "v"]).await, ok);
    }
    let mut h = RawClient::connect(lg.addr).await;
    let hello = h
        .call_raw(&["HELLO", "3", "AUTH", "default", "s3cret"])
        .await;
    assert!(hello.starts_with(b"%7\r\n"), "{}", support::show(&hello));
    assert_eq!(h.call_s(&["GET", "auth:7"]).await, "$1\r\nv\r\n");
    let refused = h
        .call_raw(&["HELLO", "3", "AUTH", "default", "wrong"])
        .await;
    assert!(
        refused.starts_with(b"-WRONGPASS"),
        "{}",
        support::show(&refused)
    );
    lg.stop().await;
}

/// `HELLO 3` (redis-py 8 sends it on connecting): answered by lockgate,
/// and the session's replies are RESP3 from then on, merged ones too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resp3_session_gets_resp3_replies_from_every_node() {
    let cluster = Cluster::start(3, 0);
    let lg = cluster
        .lockgate(|c| c.proxy.upstream = UpstreamMode::Shared)
        .await;
    let mut c = RawClient::connect(lg.addr).await;
    let hello = c.call_raw(&["HELLO", "3"]).await;
    assert!(hello.starts_with(b"%7\r\n"), "{}", support::show(&hello));
    assert!(support::show(&hello).contains("proto"));
    assert_eq!(c.call_s(&["SET", "r3:a", "1"]).await, "+OK\r\n");
    assert_eq!(
        c.call_s(&["GET", "r3:missing"]).await,
        "_\r\n",
        "a node's RESP3 null"
    );
    assert_eq!(
        c.call_s(&["MGET", "r3:a", "r3:missing", "r3:b"]).await,
        "*3\r\n$1\r\n1\r\n_\r\n_\r\n",
        "merged in RESP3"
    );
    assert_eq!(c.call_s(&["HSET", "r3:h", "f", "v"]).await, ":1\r\n");
    assert_eq!(
        c.call_s(&["HGETALL", "r3:h"]).await,
        "%1\r\n$1\r\nf\r\n$1\r\nv\r\n",
        "a map from the node"
    );
    let shards = c.call_raw(&["CLUSTER", "SHARDS"]).await;
    assert!(
        shards.starts_with(b"*1\r\n%2\r\n"),
        "{}",
        support::show(&shards)
    );
    // Back to RESP2.
    let hello = c.call_raw(&["HELLO", "2"]).await;
    assert!(hello.starts_with(b"*14\r\n"), "{}", support::show(&hello));
    assert_eq!(c.call_s(&["GET", "r3:missing"]).await, "$-1\r\n");
    assert!(c
        .call_s(&["HELLO", "3", "AUTH", "u", "p"])
        .await
        .starts_with("-ERR lockgate: "));
    lg.stop().await;
}

/// The first seed's primary killed: the cluster fails it over to its
/// replica, and lockgate follows without a restart: the slots it served
/// take writes again through lockgate and `/readyz` says ready, though
/// the seed it started from stays down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_primary_is_followed_to_its_replica_without_a_restart() {
    let mut cluster = Cluster::start(3, 1);
    let mut config = Config::default();
    config.upstream.cluster.seeds = cluster.nodes.iter().map(|n| n.addr()).collect();
    config.upstream.cluster.refresh_interval_ms = 200;
    let lg = Lockgate::start_with(config).await;
    let pool = lg.ctx.cluster.clone().expect("a cluster pool");
    crate::until!("the slot map and key specs", pool.ready());
    let seed = cluster.seed();
    let map = cluster.map().await;
    let key = (0..10_000)
        .map(|i| format!("fo:{i}"))
        .find(|k| map.shard_of_key(k.as_bytes()).map(|s| s.primary.as_str()) == Some(seed.as_str()))
        .expect("a key on the seed");
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(
        call(&mut c, &["SET", &key, "1"]).await,
        Resp::Status("OK".into())
    );
    // A replica fails over only when its link to the primary was up
    // lately (cluster-replica-validity-factor): wait for it.
    let replica = || {
        pool.map().and_then(|m| {
            m.shard_of_key(key.as_bytes())
                .and_then(|s| s.replicas.first().cloned())
        })
    };
    crate::until!("the seed's replica in the map", replica().is_some());
    let mut r = RawClient::connect(&replica().expect("a replica")).await;
    crate::until!("the replica's link up", {
        let info = call(&mut r, &["INFO", "replication"]).await;
        info.text().contains("master_link_status:up")
    });
    tokio::task::block_in_place(|| cluster.nodes[0].stop());
    // The cluster notices after cluster-node-timeout (2 s) and elects the
    // replica; lockgate reads the new map on its own.
    let deadline = std::time::Instant::now() + Duration::from_secs(40);
    loop {
        let reply = call(&mut c, &["SET", &key, "2"]).await;
        if reply == Resp::Status("OK".into()) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no failover followed: {reply:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let now = pool
        .map()
        .and_then(|m| m.shard_of_key(key.as_bytes()).map(|s| s.primary.clone()));
    assert!(
        now.is_some_and(|p| p != seed),
        "the key's slot has a new primary"
    );
    crate::until!(
        "/readyz ready again",
        lockgate::http::not_ready(&lg.ctx).is_none()
    );
    assert_eq!(
        call(&mut c, &["GET", &key]).await,
        Resp::Bulk(Some(b"2".to_vec()))
    );
    lg.stop().await;
}
