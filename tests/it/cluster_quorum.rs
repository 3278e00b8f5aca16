//! The lock quorum (`[locks.quorum]`) with the data on a real Redis
//! Cluster (`[upstream.cluster]`): lock keys and their owner records live
//! on the quorum's masters and never on the cluster; every other key is
//! routed by slot to the cluster's node that serves it and never reaches a
//! master. Pipelines and transactions that mix them keep their order, and
//! two lockgates in front of the same cluster and masters never let two
//! clients into one section. Checked on every node and master directly.

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lockgate::lock::quorum::MasterState;
use support::cluster::{on_node_of, Cluster};
use support::locks::owner;
use support::resp::Resp;
use support::{Lockgate, RawClient, RedisServer};

/// A Redis Cluster for the data, three standalone masters for the locks.
struct World {
    cluster: Cluster,
    masters: Vec<RedisServer>,
}

impl World {
    fn start() -> World {
        World {
            cluster: Cluster::start(3, 0),
            masters: (0..3).map(|_| RedisServer::start()).collect(),
        }
    }

    /// lockgate `id` in front of both, once it has the slot map and every
    /// master up.
    async fn lockgate(&self, id: &str) -> Lockgate {
        let masters = self.masters.iter().map(|m| m.addr()).collect();
        let lg = self
            .cluster
            .lockgate(|c| {
                c.locks.instance_id = id.to_string();
                c.locks.quorum.masters = masters;
                c.locks.quorum.rejoin_delay_ms = 300;
            })
            .await;
        let quorum = lg.ctx.locks.quorum().expect("a quorum").clone();
        for i in 0..3 {
            crate::until!("master up", quorum.masters[i].state() == MasterState::Up);
        }
        lg
    }

    /// `args` on the cluster node that serves `key`.
    async fn on_node(&self, key: &str, args: &[&str]) -> Resp {
        on_node_of(&self.cluster.map().await, key, args).await.1
    }

    /// `args` on master `i`.
    async fn on_master(&self, i: usize, args: &[&str]) -> Resp {
        call(&mut RawClient::connect(self.masters[i].addr()).await, args).await
    }

    /// Keys on the whole cluster.
    async fn cluster_keys(&self) -> Vec<String> {
        let mut all = Vec::new();
        for node in &self.cluster.nodes {
            let keys = call(&mut RawClient::connect(node.addr()).await, &["KEYS", "*"]).await;
            all.extend(keys.items().iter().map(|k| k.text().to_string()));
        }
        all.sort();
        all
    }
}

async fn call(c: &mut RawClient, args: &[&str]) -> Resp {
    Resp::parse(&c.call_raw(args).await)
}

fn ok() -> Resp {
    Resp::Status("OK".into())
}

fn bulk(v: &str) -> Resp {
    Resp::Bulk(Some(v.as_bytes().to_vec()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_keys_on_the_masters_data_on_the_cluster() {
    let w = World::start();
    let lg = w.lockgate("a").await;
    let mut c = RawClient::connect(lg.addr).await;
    // Data over every shard.
    let data: Vec<String> = (0..30).map(|i| format!("order:{i}")).collect();
    for k in &data {
        assert_eq!(call(&mut c, &["SET", k, k]).await, ok());
    }
    // The legacy lock pattern, on keys that would be on every shard.
    let locks: Vec<String> = (0..12).map(|i| format!("lock:order:{i}")).collect();
    for k in &locks {
        assert_eq!(call(&mut c, &["SETNX", k, "me"]).await, Resp::Int(1), "{k}");
        assert_eq!(
            call(&mut c, &["EXPIRE", k, "30"]).await,
            Resp::Int(1),
            "{k}"
        );
    }
    // A pipeline mixing both, one write: replies in order.
    let mut bytes = Vec::new();
    for args in [
        vec!["GET", "order:3"],
        vec!["SETNX", "lock:order:0", "again"],
        vec!["SET", "lock:order:99", "v", "NX", "PX", "30000"],
        vec!["GET", "order:17"],
        vec!["DEL", "lock:order:99"],
        vec!["INCR", "counter:{order:3}"],
    ] {
        bytes.extend(support::cmd(&args));
    }
    c.send(&bytes).await;
    let raw = c.read_raw_frames(6).await;
    let mut pos = 0;
    let replies: Vec<Resp> = (0..6).map(|_| Resp::decode(&raw, &mut pos)).collect();
    assert_eq!(
        replies,
        vec![
            bulk("order:3"),
            Resp::Int(0),
            ok(),
            bulk("order:17"),
            Resp::Int(1),
            Resp::Int(1)
        ]
    );
    // The legacy SETNX + EXPIRE in one MULTI, and a transaction of data
    // keys in one slot.
    for (args, want) in [
        (vec!["MULTI"], ok()),
        (vec!["SETNX", "lock:tx", "t"], Resp::Status("QUEUED".into())),
        (
            vec!["EXPIRE", "lock:tx", "30"],
            Resp::Status("QUEUED".into()),
        ),
    ] {
        assert_eq!(call(&mut c, &args).await, want, "{args:?}");
    }
    let exec = call(&mut c, &["EXEC"]).await;
    assert_eq!(exec.items(), &[Resp::Int(1), Resp::Int(1)], "{exec}");
    call(&mut c, &["MULTI"]).await;
    call(&mut c, &["SET", "{cart}:a", "1"]).await;
    call(&mut c, &["INCR", "{cart}:n"]).await;
    let exec = call(&mut c, &["EXEC"]).await;
    assert_eq!(exec.items(), &[ok(), Resp::Int(1)], "{exec}");

    // Every lock key and its owner record on every master, with a lease.
    for i in 0..3 {
        for k in locks.iter().chain([&"lock:tx".to_string()]) {
            let want = if k == "lock:tx" { "t" } else { "me" };
            assert_eq!(
                w.on_master(i, &["GET", k]).await,
                bulk(want),
                "{k} on master {i}"
            );
            let pttl = w.on_master(i, &["PTTL", &owner(k)]).await.int();
            assert!(pttl > 20_000, "{k}'s owner record on master {i}: {pttl}");
        }
    }
    // The data on the node serving it, nothing of the locks on the cluster.
    for k in &data {
        assert_eq!(w.on_node(k, &["GET", k]).await, bulk(k), "{k}");
    }
    let on_cluster = w.cluster_keys().await;
    assert!(
        on_cluster.iter().all(|k| !k.contains("lock")),
        "lock keys or records on the cluster: {on_cluster:?}"
    );
    assert_eq!(on_cluster.len(), data.len() + 3, "{on_cluster:?}");
    // And no data on a master.
    for i in 0..3 {
        let n = w
            .on_master(i, &["EXISTS", "order:3", "{cart}:a", "counter:{order:3}"])
            .await;
        assert_eq!(n, Resp::Int(0), "data on master {i}");
    }
    // The owner-checked release: a stranger's DEL is refused, the owner's
    // frees the lock on every master.
    let mut stranger = RawClient::connect(lg.addr).await;
    assert_eq!(
        call(&mut stranger, &["DEL", "lock:order:1"]).await,
        Resp::Int(0)
    );
    assert_eq!(call(&mut c, &["DEL", "lock:order:1"]).await, Resp::Int(1));
    for i in 0..3 {
        assert_eq!(
            w.on_master(i, &["EXISTS", "lock:order:1"]).await,
            Resp::Int(0)
        );
    }
    lg.stop().await;
}

/// Eight clients through two lockgates, the legacy pattern on one key:
/// never two inside, and every client gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_lockgates_never_let_two_clients_in() {
    let w = World::start();
    let gates = [w.lockgate("a").await, w.lockgate("b").await];
    let inside = Arc::new(AtomicUsize::new(0));
    let entered = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for n in 0..8 {
        let addr = gates[n % 2].addr;
        let (inside, entered) = (inside.clone(), entered.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = RawClient::connect(addr).await;
            let me = format!("client-{n}");
            for _ in 0..3 {
                loop {
                    if call(&mut c, &["SETNX", "lock:shared", &me]).await == Resp::Int(1) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                call(&mut c, &["EXPIRE", "lock:shared", "10"]).await;
                assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two inside");
                // The section writes data on the cluster.
                call(&mut c, &["INCR", "sections"]).await;
                tokio::time::sleep(Duration::from_millis(10)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                entered.fetch_add(1, Ordering::SeqCst);
                assert_eq!(call(&mut c, &["DEL", "lock:shared"]).await, Resp::Int(1));
            }
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("every client done within 60 s")
            .expect("no client failed");
    }
    assert_eq!(entered.load(Ordering::SeqCst), 24);
    assert_eq!(
        w.on_node("sections", &["GET", "sections"]).await,
        bulk("24")
    );
    for g in gates {
        g.stop().await;
    }
}
