//! Locks through lockgate in front of a real Redis Cluster: the legacy
//! `SETNX`/`EXPIRE`/`DEL` pattern on keys spread over every shard (each
//! lock leased on the node that serves it, its owner record beside it, in
//! its slot, hash tags included), owner-checked release and extension,
//! the hand-off from one lockgate to another woken by the release
//! announcement, fencing tokens, and mutual exclusion under contention
//! through two lockgates.

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockgate::cluster::slot::key_slot;
use support::cluster::{on_node_of, Cluster};
use support::resp::Resp;
use support::RawClient;

async fn call(c: &mut RawClient, args: &[&str]) -> Resp {
    Resp::parse(&c.call_raw(args).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_locks_on_every_shard_are_leased_and_owner_checked() {
    let cluster = Cluster::start(3, 1);
    let lg = cluster.lockgate(|_| {}).await;
    let map = cluster.map().await;
    let mut keys: Vec<String> = (0..24).map(|i| format!("lock:order:{i}")).collect();
    keys.extend((0..6).map(|i| format!("lock:{{cart}}:{i}")));
    let mut nodes = std::collections::BTreeSet::new();
    for key in &keys {
        let mut owner = RawClient::connect(lg.addr).await;
        assert_eq!(
            call(&mut owner, &["SETNX", key, "me"]).await,
            Resp::Int(1),
            "{key}"
        );
        // A connection opened after the acquisition is not its pool's
        // (docs/locks.md): it may neither take, extend nor release it.
        let mut other = RawClient::connect(lg.addr).await;
        assert_eq!(
            call(&mut other, &["SETNX", key, "them"]).await,
            Resp::Int(0),
            "{key}"
        );
        assert_eq!(
            call(&mut owner, &["EXPIRE", key, "30"]).await,
            Resp::Int(1),
            "{key}"
        );
        // On the node that serves the key: the lock with its lease (a bare
        // SETNX is leased at once), and its owner record beside it.
        let node = &map.shard_of_key(key.as_bytes()).expect("served").primary;
        nodes.insert(node.clone());
        let mut n = RawClient::connect(node).await;
        let pttl = call(&mut n, &["PTTL", key]).await;
        assert!(
            matches!(pttl, Resp::Int(t) if t > 20_000),
            "{key}: {pttl:?}"
        );
        let owner_record =
            String::from_utf8(lockgate::lock::owner_key(key.as_bytes()).to_vec()).expect("utf-8");
        assert_eq!(key_slot(owner_record.as_bytes()), key_slot(key.as_bytes()));
        assert_eq!(
            call(&mut n, &["EXISTS", &owner_record]).await,
            Resp::Int(1),
            "{owner_record}"
        );
        assert_eq!(
            call(&mut other, &["EXPIRE", key, "1"]).await,
            Resp::Int(0),
            "{key}"
        );
        assert_eq!(call(&mut other, &["DEL", key]).await, Resp::Int(0), "{key}");
        assert_eq!(call(&mut owner, &["DEL", key]).await, Resp::Int(1), "{key}");
        assert_eq!(
            call(&mut n, &["EXISTS", key, &owner_record]).await,
            Resp::Int(0),
            "{key}"
        );
    }
    assert_eq!(nodes.len(), 3, "locks on every shard");
    // A key whose owner record cannot share its slot: refused, not sent.
    let mut c = RawClient::connect(lg.addr).await;
    let refused = call(&mut c, &["SETNX", "lock:a}b", "me"]).await;
    assert!(
        matches!(&refused, Resp::Error(e) if e.contains("cannot be in its hash slot")),
        "{refused:?}"
    );
    assert_eq!(call(&mut c, &["EXISTS", "lock:a}b"]).await, Resp::Int(0));
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_through_one_lockgate_hands_over_on_another() {
    let cluster = Cluster::start(3, 0);
    let a = cluster.lockgate(|_| {}).await;
    // B would probe only every 5 s: only the release announcement can
    // wake its parked spinner sooner.
    let b = cluster
        .lockgate(|c| c.locks.retry.probe_interval_ms = 5_000)
        .await;
    let mut holder = RawClient::connect(a.addr).await;
    assert_eq!(
        call(&mut holder, &["SETNX", "lock:h", "a"]).await,
        Resp::Int(1)
    );
    assert_eq!(
        call(&mut holder, &["EXPIRE", "lock:h", "30"]).await,
        Resp::Int(1)
    );
    let addr = b.addr;
    let spinner = tokio::spawn(async move {
        let mut c = RawClient::connect(addr).await;
        let deadline = Instant::now() + Duration::from_secs(8);
        while Instant::now() < deadline {
            if call(&mut c, &["SETNX", "lock:h", "b"]).await == Resp::Int(1) {
                return Some(Instant::now());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        None
    });
    // The spinner is parked on B once it has failed a few times.
    crate::until!("B's spinner to be parked", {
        b.ctx.locks.storm.metrics.parked.load(Ordering::Relaxed) > 0
    });
    let released = Instant::now();
    assert_eq!(call(&mut holder, &["DEL", "lock:h"]).await, Resp::Int(1));
    let won = spinner
        .await
        .expect("spinner")
        .expect("B's spinner acquired");
    let took = won.duration_since(released);
    assert!(took < Duration::from_secs(2), "handed over after {took:?}");
    let node = cluster
        .map()
        .await
        .shard_of_key(b"lock:h")
        .expect("served")
        .primary
        .clone();
    let mut n = RawClient::connect(&node).await;
    assert_eq!(
        call(&mut n, &["GET", "lock:h"]).await,
        Resp::Bulk(Some(b"b".to_vec()))
    );
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_grow_and_sections_never_overlap_through_two_lockgates() {
    let cluster = Cluster::start(3, 0);
    let lgs = [
        cluster.lockgate(|_| {}).await,
        cluster.lockgate(|_| {}).await,
    ];
    let mut c = RawClient::connect(lgs[0].addr).await;
    for key in ["lock:f:1", "lock:f:2", "lock:{f}:3"] {
        let mut last = 0;
        for _ in 0..3 {
            let got = call(&mut c, &["LOCKGATE", "LOCK", key, "5000"]).await;
            let token = got.items()[0].int();
            assert!(token > last, "{key}: {token} after {last}");
            last = token;
            let unlocked = call(&mut c, &["LOCKGATE", "UNLOCK", key, &token.to_string()]).await;
            assert_eq!(unlocked, Resp::Int(1), "{key}");
        }
    }
    // Eight clients, four through each lockgate, take one lock in turn:
    // inside, each checks nobody else is.
    let inside = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for w in 0..8 {
        let addr = lgs[w % 2].addr;
        let (inside, overlaps) = (inside.clone(), overlaps.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = RawClient::connect(addr).await;
            let deadline = Instant::now() + Duration::from_millis(1_500);
            let mut sections = 0;
            while Instant::now() < deadline {
                let me = format!("w{w}");
                if call(&mut c, &["SET", "lock:x", &me, "NX", "PX", "2000"]).await
                    != Resp::Status("OK".into())
                {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    continue;
                }
                if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                    overlaps.fetch_add(1, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(3)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                assert_eq!(call(&mut c, &["DEL", "lock:x"]).await, Resp::Int(1), "{me}");
                sections += 1;
            }
            sections
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.expect("worker");
    }
    assert_eq!(overlaps.load(Ordering::SeqCst), 0);
    assert!(total >= 8, "{total} sections");
    for lg in lgs {
        lg.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_shard_failover_only_its_acquisitions_are_held_back() {
    let cluster = Cluster::start(3, 1);
    let lg = cluster
        .lockgate(|c| {
            c.locks.failover_delay_ms = Some(3_000);
            c.upstream.cluster.refresh_interval_ms = 200;
        })
        .await;
    let pool = lg.ctx.cluster.clone().expect("a cluster pool");
    // The shard of `lock:fo`, once lockgate's map names its replica.
    let shard = || {
        pool.map()
            .and_then(|m| m.shard_of_key(b"lock:fo").cloned())
            .filter(|s| !s.replicas.is_empty())
    };
    crate::until!("the shard's replica in the map", shard().is_some());
    let before = shard().expect("a shard");
    let replica = before.replicas[0].clone();
    let other_key = (0..1_000)
        .map(|i| format!("lock:other:{i}"))
        .find(|k| {
            pool.map()
                .and_then(|m| m.shard_of_key(k.as_bytes()).map(|s| s.primary.clone()))
                .is_some_and(|p| p != before.primary)
        })
        .expect("a key on another shard");
    let mut r = RawClient::connect(&replica).await;
    // A manual failover needs the replica's link to its primary up.
    crate::until!("the replica's link up", {
        let info = call(&mut r, &["INFO", "replication"]).await;
        info.text().contains("master_link_status:up")
    });
    assert_eq!(
        call(&mut r, &["CLUSTER", "FAILOVER"]).await,
        Resp::Status("OK".into())
    );
    crate::until!("lockgate to follow the failover", {
        pool.map()
            .and_then(|m| m.shard_of_key(b"lock:fo").map(|s| s.primary.clone()))
            == Some(replica.clone())
    });
    let held_at = Instant::now();
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(
        call(&mut c, &["SETNX", "lock:fo", "x"]).await,
        Resp::Int(0),
        "held back"
    );
    assert_eq!(
        call(&mut c, &["SETNX", &other_key, "x"]).await,
        Resp::Int(1),
        "other shards are not"
    );
    let mut n = RawClient::connect(&replica).await;
    assert_eq!(call(&mut n, &["EXISTS", "lock:fo"]).await, Resp::Int(0));
    let metrics = pool.metrics();
    assert!(metrics.failovers.load(Ordering::Relaxed) >= 1);
    assert!(metrics.failover_held.load(Ordering::Relaxed) >= 1);
    // Past the delay, acquisitions there go on.
    crate::until!("the failover delay to end", {
        call(&mut c, &["SETNX", "lock:fo", "x"]).await == Resp::Int(1)
    });
    assert!(
        held_at.elapsed() < Duration::from_millis(3_000 + 3_000),
        "{:?}",
        held_at.elapsed()
    );
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watchdog_and_release_on_disconnect_reach_the_keys_node() {
    let cluster = Cluster::start(3, 0);
    let lg = cluster
        .lockgate(|c| {
            c.locks.overrides = vec![
                lockgate::config::LockOverride {
                    pattern: "lock:wd:*".to_string(),
                    lease_ms: 1_000,
                    watchdog: true,
                    max_hold_ms: 10_000,
                    ..Default::default()
                },
                lockgate::config::LockOverride {
                    pattern: "lock:eph:*".to_string(),
                    lease_ms: 30_000,
                    release_on_disconnect: true,
                    ..Default::default()
                },
            ];
        })
        .await;
    let map = cluster.map().await;
    let node_of = |key: &str| {
        map.shard_of_key(key.as_bytes())
            .expect("served")
            .primary
            .clone()
    };
    let mut holder = RawClient::connect(lg.addr).await;
    let keys: Vec<String> = (0..6).map(|i| format!("lock:wd:{i}")).collect();
    for key in &keys {
        assert_eq!(call(&mut holder, &["SETNX", key, "me"]).await, Resp::Int(1));
    }
    // Twice the 1 s lease later every lock is still there: the watchdog
    // renewed each on its own node (every third of the lease).
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    for key in &keys {
        let mut n = RawClient::connect(&node_of(key)).await;
        let pttl = call(&mut n, &["PTTL", key]).await;
        assert!(matches!(pttl, Resp::Int(t) if t > 0), "{key}: {pttl:?}");
    }
    assert!(
        lg.ctx
            .locks
            .metrics
            .watchdog_renewals
            .load(Ordering::Relaxed)
            >= 6
    );
    // A connection's ephemeral locks go when it does, on every node.
    let eph: Vec<String> = (0..6).map(|i| format!("lock:eph:{i}")).collect();
    let mut c = RawClient::connect(lg.addr).await;
    for key in &eph {
        assert_eq!(call(&mut c, &["SETNX", key, "me"]).await, Resp::Int(1));
    }
    drop(c);
    for key in &eph {
        let mut n = RawClient::connect(&node_of(key)).await;
        crate::until!(format!("{key} released on disconnect"), {
            call(&mut n, &["EXISTS", key]).await == Resp::Int(0)
        });
    }
    lg.stop().await;
}

/// Redisson's hash lock on keys of every shard, then its watchdog's
/// batched renewal (one script for every lock of the client, as Redisson
/// sends it when it thinks it talks to one Redis): split per slot, each
/// lock renewed on its node, the per-lock answers back in key order; by
/// `EVAL` and by `EVALSHA` after `SCRIPT LOAD`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redissons_batched_renewal_is_split_by_slot() {
    const LOCK: &str = "if (redis.call('exists', KEYS[1]) == 0) then redis.call('hincrby', KEYS[1], ARGV[2], 1); redis.call('pexpire', KEYS[1], ARGV[1]); return nil; end; return redis.call('pttl', KEYS[1]);";
    let renew = lockgate::cluster::split::PER_KEY_SCRIPTS[0];
    let cluster = Cluster::start(3, 0);
    let lg = cluster.lockgate(|_| {}).await;
    let map = cluster.map().await;
    let mut c = RawClient::connect(lg.addr).await;
    let keys: Vec<String> = (0..9).map(|i| format!("lock:redisson:{i}")).collect();
    let names: Vec<&str> = keys.iter().map(String::as_str).collect();
    let nodes = cluster.primaries_of(&names).await;
    assert_eq!(nodes.len(), 3, "the locks are on every primary");
    // Held: all but the last, whose name's field is another client's.
    for (i, key) in keys.iter().enumerate() {
        let me = if i == 8 { "other:1" } else { "me:1" };
        let got = call(&mut c, &["EVAL", LOCK, "1", key, "10000", me]).await;
        assert_eq!(got, Resp::Bulk(None), "{key}");
    }
    let mut args: Vec<&str> = vec!["EVAL", renew, "9"];
    args.extend(keys.iter().map(String::as_str));
    args.push("60000");
    args.extend(std::iter::repeat_n("me:1", 9));
    let want = Resp::Array(Some((0..9).map(|i| Resp::Int((i < 8) as i64)).collect()));
    assert_eq!(call(&mut c, &args).await, want);
    for (i, key) in keys.iter().enumerate() {
        let (node, pttl) = on_node_of(&map, key, &["PTTL", key]).await;
        let pttl = pttl.int();
        assert_eq!(
            pttl > 10_000,
            i < 8,
            "{key} renewed on {node} iff held: {pttl}"
        );
    }
    // By digest, once loaded (on every primary).
    let sha = call(&mut c, &["SCRIPT", "LOAD", renew]).await;
    args[0] = "EVALSHA";
    args[1] = sha.text();
    assert_eq!(call(&mut c, &args).await, want);
    lg.stop().await;
}

/// `LOCKGATE LOCKS` reads each lock's owner record from the node that
/// serves it, and `LOCKGATE RELEASE` frees it there (one slot: the lock,
/// its owner record and its queue), on every shard, hash tags included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_sees_and_releases_locks_on_every_shard() {
    let cluster = Cluster::start(3, 0);
    let lg = cluster.lockgate(|_| {}).await;
    let map = cluster.map().await;
    let mut keys: Vec<String> = (0..9).map(|i| format!("lock:op:{i}")).collect();
    keys.push("lock:op:{cart}:1".to_string());
    let mut holder = RawClient::connect(lg.addr).await;
    assert_eq!(
        call(&mut holder, &["CLIENT", "SETNAME", "op-holder"]).await,
        Resp::Status("OK".into())
    );
    // Kept by lockgate (the nodes' connections are shared).
    assert_eq!(
        call(&mut holder, &["CLIENT", "GETNAME"]).await,
        Resp::Bulk(Some(b"op-holder".to_vec()))
    );
    let mut nodes = std::collections::BTreeSet::new();
    for key in &keys {
        assert_eq!(
            call(&mut holder, &["SETNX", key, "h"]).await,
            Resp::Int(1),
            "{key}"
        );
        nodes.insert(
            map.shard_of_key(key.as_bytes())
                .expect("served")
                .primary
                .clone(),
        );
    }
    assert_eq!(nodes.len(), 3, "the keys span every shard");
    let mut admin = RawClient::connect(lg.addr).await;
    // NODES: a record per primary; under RESP3 (HELLO answered by
    // lockgate here) each is a map.
    let mut resp3 = RawClient::connect(lg.addr).await;
    assert_eq!(resp3.call_raw(&["HELLO", "3"]).await[0], b'%');
    let raw = resp3.call_raw(&["LOCKGATE", "NODES"]).await;
    assert!(
        raw.starts_with(b"*3\r\n%6\r\n"),
        "{}",
        String::from_utf8_lossy(&raw)
    );
    let two = call(&mut admin, &["LOCKGATE", "NODES"]).await;
    for (a, b) in two.items().iter().zip(Resp::parse(&raw).items()) {
        assert_eq!(
            a.fields(),
            [
                "addr",
                "slots",
                "replicas",
                "state",
                "failover_hold_ms",
                "disputes"
            ]
        );
        assert_eq!(a, b, "the same record in both protocols");
    }
    let rows = call(&mut admin, &["LOCKGATE", "LOCKS", "lock:op:*"]).await;
    assert_eq!(rows.items().len(), keys.len(), "{rows}");
    for r in rows.items() {
        let key = r.field("key").text().to_string();
        assert_eq!(r.field("holder").text(), "this instance", "{r}");
        assert_eq!(r.field("client_name").text(), "op-holder", "{r}");
        assert!(
            matches!(r.field("lease_left_ms"), Resp::Int(t) if *t > 0),
            "{r}"
        );
        let acquisition = r.field("acquisition").text().to_string();
        let released = call(&mut admin, &["LOCKGATE", "RELEASE", &key, &acquisition]).await;
        assert_eq!(released, Resp::Int(1), "{key}");
        let node = &map.shard_of_key(key.as_bytes()).expect("served").primary;
        let mut n = RawClient::connect(node).await;
        assert_eq!(
            call(&mut n, &["EXISTS", &key]).await,
            Resp::Int(0),
            "{key} on {node}"
        );
    }
    // Every lock free again: the next holder takes each at once.
    let mut next = RawClient::connect(lg.addr).await;
    for key in &keys {
        assert_eq!(
            call(&mut next, &["SETNX", key, "n"]).await,
            Resp::Int(1),
            "{key}"
        );
    }
    lg.stop().await;
}

/// Guarded writes in front of a cluster: a guard's data keeps its lock's
/// hash tag, so each guarded write is checked on the node that serves both
/// (its owner record and its data), in one step; plain writes, a
/// transaction run whole and a client script, across shards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarded_writes_are_checked_on_the_node_of_their_slot() {
    use lockgate::config::{GuardConfig, GuardMode, UnlockedWriters};
    let cluster = Cluster::start(3, 0);
    let lg = cluster
        .lockgate(|c| {
            c.locks.default_lease_ms = 30_000;
            c.locks.guards = vec![GuardConfig {
                lock: "lock:order:{{{id}}}".to_string(),
                data: vec!["order:{{{id}}}".to_string(), "order:{{{id}}}:*".to_string()],
                mode: GuardMode::Refuse,
                unlocked_writers: UnlockedWriters::Refuse,
            }];
        })
        .await;
    crate::until!(
        "the command table",
        !lg.ctx.locks.guard_table.get().is_empty()
    );
    let map = cluster.map().await;
    let mut nodes = std::collections::BTreeSet::new();
    for id in 0..12 {
        let (lock, data, items) = (
            format!("lock:order:{{{id}}}"),
            format!("order:{{{id}}}"),
            format!("order:{{{id}}}:items"),
        );
        let mut a = RawClient::connect(lg.addr).await;
        let refused = call(&mut a, &["SET", &data, "early"]).await;
        assert!(
            matches!(&refused, Resp::Error(e) if e.contains("which this connection does not hold")),
            "{refused:?}"
        );
        assert_eq!(call(&mut a, &["SETNX", &lock, "a"]).await, Resp::Int(1));
        assert_eq!(
            call(&mut a, &["SET", &data, "a"]).await,
            Resp::Status("OK".into())
        );
        assert_eq!(call(&mut a, &["MULTI"]).await, Resp::Status("OK".into()));
        assert_eq!(
            call(&mut a, &["RPUSH", &items, "x"]).await,
            Resp::Status("QUEUED".into())
        );
        assert_eq!(
            call(&mut a, &["SET", &data, "b"]).await,
            Resp::Status("QUEUED".into())
        );
        assert_eq!(
            call(&mut a, &["EXEC"]).await,
            Resp::Array(Some(vec![Resp::Int(1), Resp::Status("OK".into())]))
        );
        assert_eq!(
            call(
                &mut a,
                &[
                    "EVAL",
                    "return redis.call('APPEND', KEYS[1], 'c')",
                    "1",
                    &data
                ]
            )
            .await,
            Resp::Int(2)
        );
        let (node, value) = on_node_of(&map, &data, &["GET", &data]).await;
        assert_eq!(value, Resp::Bulk(Some(b"bc".to_vec())), "{data}");
        nodes.insert(node);
        // The lease runs out (lock and owner record, as they expire
        // together): the holder's next write is refused.
        let owner = String::from_utf8(lockgate::lock::owner_key(lock.as_bytes()).to_vec()).unwrap();
        for key in [&lock, &owner] {
            let (_, set) = on_node_of(&map, key, &["PEXPIRE", key, "1"]).await;
            assert_eq!(set, Resp::Int(1), "{key}");
        }
        crate::until!("the lease to end", {
            on_node_of(&map, &owner, &["EXISTS", &lock, &owner]).await.1 == Resp::Int(0)
        });
        let late = call(&mut a, &["SET", &data, "late"]).await;
        assert!(
            matches!(&late, Resp::Error(e) if e.contains("is no longer held by this connection")),
            "{late:?}"
        );
    }
    assert_eq!(nodes.len(), 3, "every shard served guarded data");
}

/// A lock library's release script (redis-py's `Lock`), carried out by
/// lockgate as a release by value (`router::library`), reaches the node
/// that serves the key, as a `DEL` would: keys on every shard released
/// with their owner records, a wrong token releasing nothing, and the
/// library's script never loaded anywhere. So does node-redlock's
/// acquisition script, an acquisition of lockgate's there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_library_release_reaches_the_keys_node() {
    const RELEASE: &str = "\n        local token = redis.call('get', KEYS[1])\n        if not token or token ~= ARGV[1] then\n            return 0\n        end\n        redis.call('del', KEYS[1])\n        return 1\n    ";
    // node-redlock 5's acquisition script's SHA1 (its body: tests/js).
    const REDLOCK_ACQUIRE: &str = "96da70f7716f27d278a5218544df37fd8b0a5e4c";
    let cluster = Cluster::start(3, 1);
    let lg = cluster.lockgate(|_| {}).await;
    let map = cluster.map().await;
    let mut c = RawClient::connect(lg.addr).await;
    let sha = sha1_smol::Sha1::from(RELEASE).digest().to_string();
    let mut nodes = std::collections::BTreeSet::new();
    for i in 0..12 {
        let key = format!("lock:lib:{i}");
        // Half acquired by node-redlock's acquisition script (an
        // acquisition of lockgate's, `router::library`).
        if i % 2 == 0 {
            let acquired = call(
                &mut c,
                &["EVALSHA", REDLOCK_ACQUIRE, "1", &key, "tok", "30000"],
            )
            .await;
            assert_eq!(acquired, Resp::Int(1), "{key}");
        } else {
            let set = call(&mut c, &["SET", &key, "tok", "NX", "PX", "30000"]).await;
            assert_eq!(set, Resp::Status("OK".into()), "{key}");
        }
        let node = &map.shard_of_key(key.as_bytes()).expect("served").primary;
        let mut n = RawClient::connect(node).await;
        let owner = format!("lockgate:owner:{{{key}}}");
        assert_eq!(call(&mut n, &["EXISTS", &key, &owner]).await, Resp::Int(2));
        let wrong = call(&mut c, &["EVALSHA", &sha, "1", &key, "nope"]).await;
        assert_eq!(wrong, Resp::Int(0), "{key}");
        let right = call(&mut c, &["EVALSHA", &sha, "1", &key, "tok"]).await;
        assert_eq!(right, Resp::Int(1), "{key}");
        nodes.insert(node.clone());
        assert_eq!(call(&mut n, &["EXISTS", &key, &owner]).await, Resp::Int(0));
        let loaded = call(&mut n, &["SCRIPT", "EXISTS", &sha]).await;
        assert_eq!(loaded, Resp::Array(Some(vec![Resp::Int(0)])), "{key}");
    }
    assert_eq!(nodes.len(), 3, "keys on every shard");
    assert_eq!(
        lg.ctx
            .locks
            .metrics
            .library_releases
            .load(Ordering::Relaxed),
        24
    );
    lg.stop().await;
}
