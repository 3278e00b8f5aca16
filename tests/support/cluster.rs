//! A real Redis Cluster per test: redis-server processes with
//! `--cluster-enabled yes` on free loopback ports, joined by
//! `redis-cli --cluster create`, killed on drop.

use std::process::Command;
use std::time::{Duration, Instant};

use crate::support::RedisServer;

/// A running cluster: its nodes, primaries and replicas as
/// `redis-cli --cluster create` arranged them.
pub struct Cluster {
    /// Every node.
    pub nodes: Vec<RedisServer>,
}

impl Cluster {
    /// `masters` primaries with `replicas` replicas each, every slot
    /// served, every node reporting `cluster_state:ok`.
    pub fn start(masters: usize, replicas: usize) -> Cluster {
        let nodes: Vec<RedisServer> = (0..masters * (1 + replicas))
            .map(|_| {
                RedisServer::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-node-timeout",
                    "2000",
                ])
            })
            .collect();
        let addrs: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = Cluster { nodes };
        for node in &cluster.nodes {
            cluster.until_ok(node.port);
        }
        cluster
    }

    /// Waits (up to 30 s) until the node on `port` says `cluster_state:ok`
    /// and knows every node.
    fn until_ok(&self, port: u16) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = Command::new("redis-cli")
                .args(["-p", &port.to_string(), "CLUSTER", "INFO"])
                .output()
                .expect("run redis-cli");
            let info = String::from_utf8_lossy(&out.stdout);
            let known = format!("cluster_known_nodes:{}", self.nodes.len());
            if info.contains("cluster_state:ok") && info.contains(&known) {
                return;
            }
            assert!(Instant::now() < deadline, "node {port}: {info}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `127.0.0.1:PORT` of the first node.
    pub fn seed(&self) -> String {
        self.nodes[0].addr()
    }
}
