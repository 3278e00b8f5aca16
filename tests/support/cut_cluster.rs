//! A real Redis Cluster whose bus a test can cut for one node: every
//! node's cluster bus is reached through a relay (its
//! `cluster-announce-bus-port`), and the node that can be cut connects
//! out from `127.0.0.2` (`bind-source-addr`), so the other nodes' relays
//! can refuse it alone. Cut off both ways, it keeps its own view of the
//! slots while the others change theirs: the only way found to make two
//! real nodes disagree about a slot for as long as a test needs (within
//! `cluster-node-timeout`, 20 s here, nobody marks it failed).
//!
//! Built by hand (`CLUSTER ADDSLOTSRANGE`, `MEET` with the relay's bus
//! port, `REPLICATE`), not by `redis-cli --cluster create`, whose `MEET`s
//! would reach the buses directly and keep those links past a cut.

use std::net::IpAddr;

use crate::support::relay::{Mode, Relay};
use crate::support::resp::direct;
use crate::support::RedisServer;

/// The address the node that can be cut connects out from.
pub const CUT_SOURCE: &str = "127.0.0.2";

/// Three primaries (nodes 0, 1, 2) and a replica of node 1 (node 3);
/// node 1 is the one that can be cut.
pub struct CutCluster {
    /// Every node.
    pub nodes: Vec<RedisServer>,
    /// Each node's bus relay.
    pub relays: Vec<Relay>,
    /// Each node's `CLUSTER MYID`.
    pub ids: Vec<String>,
}

/// The text of a bulk reply (`$n\r\n…\r\n`).
fn bulk(reply: &str) -> String {
    reply.split("\r\n").nth(1).unwrap_or_default().to_string()
}

impl CutCluster {
    /// Started, every slot served, the replica in sync.
    pub async fn start() -> CutCluster {
        let args = [
            "--cluster-enabled",
            "yes",
            "--cluster-node-timeout",
            "20000",
            "--cluster-require-full-coverage",
            "no",
            "--cluster-announce-ip",
            "127.0.0.1",
        ];
        let nodes: Vec<RedisServer> = (0..4).map(|_| RedisServer::start_with(&args)).collect();
        let mut relays = Vec::new();
        for n in &nodes {
            relays.push(Relay::to(&format!("127.0.0.1:{}", n.port + 10_000)).await);
        }
        let mut ids = Vec::new();
        for (n, r) in nodes.iter().zip(&relays) {
            let port = r.addr.port().to_string();
            let set = ["CONFIG", "SET", "cluster-announce-bus-port", &port];
            assert_eq!(direct(&n.addr(), &set).await, "+OK\r\n");
            ids.push(bulk(&direct(&n.addr(), &["CLUSTER", "MYID"]).await));
        }
        // Each node's config epoch set before they meet, the replica's the
        // highest: its takeover then claims the slots with an epoch above
        // its primary's, which the others must see to follow it (epochs
        // left to collide and settle may leave it equal, and nobody
        // follows).
        for (n, epoch) in nodes.iter().zip(["1", "2", "3", "4"]) {
            let set = ["CLUSTER", "SET-CONFIG-EPOCH", epoch];
            assert_eq!(direct(&n.addr(), &set).await, "+OK\r\n");
        }
        let source = ["CONFIG", "SET", "bind-source-addr", CUT_SOURCE];
        assert_eq!(direct(&nodes[1].addr(), &source).await, "+OK\r\n");
        for (n, (from, to)) in nodes.iter().zip([(0, 5460), (5461, 10922), (10923, 16383)]) {
            let (from, to) = (from.to_string(), to.to_string());
            let add = ["CLUSTER", "ADDSLOTSRANGE", &from, &to];
            assert_eq!(direct(&n.addr(), &add).await, "+OK\r\n");
        }
        for (n, r) in nodes.iter().zip(&relays).skip(1) {
            let (port, bus) = (n.port.to_string(), r.addr.port().to_string());
            let meet = ["CLUSTER", "MEET", "127.0.0.1", &port, &bus];
            assert_eq!(direct(&nodes[0].addr(), &meet).await, "+OK\r\n");
        }
        for n in &nodes {
            crate::until!("every node known", {
                let info = direct(&n.addr(), &["CLUSTER", "INFO"]).await;
                info.contains("cluster_known_nodes:4") && info.contains("cluster_state:ok")
            });
        }
        let replicate = ["CLUSTER", "REPLICATE", &ids[1]];
        assert_eq!(direct(&nodes[3].addr(), &replicate).await, "+OK\r\n");
        crate::until!(
            "the replica in sync",
            direct(&nodes[3].addr(), &["INFO", "replication"])
                .await
                .contains("master_link_status:up")
        );
        let cluster = CutCluster { nodes, relays, ids };
        for n in &cluster.nodes {
            crate::until!("the replica known everywhere", {
                let slots = direct(&n.addr(), &["CLUSTER", "SLOTS"]).await;
                slots.contains(&cluster.ids[3])
            });
        }
        cluster
    }

    /// `127.0.0.1:PORT` of node `i`.
    pub fn addr(&self, i: usize) -> String {
        self.nodes[i].addr()
    }

    /// Cuts node 1 off the bus both ways: its own relay closes every
    /// connection, and the others' refuse what it opens.
    pub fn cut(&self) {
        let ip: IpAddr = CUT_SOURCE.parse().expect("an address");
        self.relays[1].set(Mode::Cut);
        for (i, r) in self.relays.iter().enumerate() {
            if i != 1 {
                r.refuse_from(Some(ip));
            }
        }
    }

    /// Heals what [`CutCluster::cut`] cut.
    pub fn heal(&self) {
        self.relays[1].heal();
        for r in &self.relays {
            r.refuse_from(None);
        }
    }

    /// Waits (up to 30 s: gossip on a loaded box) until node `i` says
    /// node `owner` serves `slot`; fails with every node's `CLUSTER
    /// NODES`.
    pub async fn until_owner(&self, i: usize, slot: u16, owner: usize, what: &str) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while self.owner_by(i, slot).await != self.addr(owner) {
            if std::time::Instant::now() > deadline {
                let mut views = String::new();
                for n in 0..self.nodes.len() {
                    let nodes = direct(&self.addr(n), &["CLUSTER", "NODES"]).await;
                    views.push_str(&format!("node {n}:\n{nodes}\n"));
                }
                panic!("timed out waiting for {what}:\n{views}");
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// Who node `i` says serves `slot` (its `CLUSTER SHARDS`-free
    /// answer: the port in `CLUSTER NODES`' line whose ranges hold it).
    pub async fn owner_by(&self, i: usize, slot: u16) -> String {
        let nodes = direct(&self.addr(i), &["CLUSTER", "NODES"]).await;
        for line in nodes.lines() {
            let f: Vec<&str> = line.split(' ').collect();
            if f.len() < 9 || !f[2].contains("master") {
                continue;
            }
            let holds = f[8..].iter().any(|r| {
                let (a, b) = r.split_once('-').unwrap_or((r, r));
                let (a, b) = (a.parse::<u16>(), b.parse::<u16>());
                matches!((a, b), (Ok(a), Ok(b)) if a <= slot && slot <= b)
            });
            if holds {
                return f[1].split('@').next().unwrap_or_default().to_string();
            }
        }
        String::new()
    }
}
