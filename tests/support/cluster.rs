//! A real Redis Cluster per test: redis-server processes with
//! `--cluster-enabled yes` on free loopback ports, joined by
//! `redis-cli --cluster create`, killed on drop; and a plain client of
//! it that follows `MOVED` ([`ClusterClient`]), to check lockgate against.

use std::collections::{BTreeSet, HashMap};
use std::process::Command;
use std::time::{Duration, Instant};

use lockgate::cluster::map::SlotMap;
use lockgate::Config;

use crate::support::resp::Resp;
use crate::support::{Lockgate, RawClient, RedisServer};

/// A running cluster: its nodes, primaries and replicas as
/// `redis-cli --cluster create` arranged them.
pub struct Cluster {
    /// Every node.
    pub nodes: Vec<RedisServer>,
    /// The nodes' `requirepass` (empty: none).
    password: String,
}

impl Cluster {
    /// `masters` primaries with `replicas` replicas each, every slot
    /// served, every node reporting `cluster_state:ok`.
    pub fn start(masters: usize, replicas: usize) -> Cluster {
        Cluster::start_secured(masters, replicas, "")
    }

    /// As [`Cluster::start`], every node requiring `password` (empty:
    /// none) of its clients and of its replicas.
    pub fn start_secured(masters: usize, replicas: usize, password: &str) -> Cluster {
        let nodes: Vec<RedisServer> = (0..masters * (1 + replicas))
            .map(|_| {
                let mut args = vec!["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"];
                if !password.is_empty() {
                    args.extend(["--requirepass", password, "--masterauth", password]);
                }
                RedisServer::start_with(&args)
            })
            .collect();
        let addrs: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
        let out = Command::new("redis-cli")
            .args(Cluster::auth_args(password))
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
        let cluster = Cluster {
            nodes,
            password: password.to_string(),
        };
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
                .args(Cluster::auth_args(&self.password))
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

    /// `redis-cli`'s arguments for `password` (none for none).
    fn auth_args(password: &str) -> Vec<String> {
        match password {
            "" => Vec::new(),
            p => vec!["--no-auth-warning".into(), "-a".into(), p.into()],
        }
    }

    /// `127.0.0.1:PORT` of the first node.
    pub fn seed(&self) -> String {
        self.nodes[0].addr()
    }

    /// lockgate in front of this cluster (its configuration `tune`d),
    /// once it has read the slot map and the nodes' key specifications.
    pub async fn lockgate(&self, tune: impl FnOnce(&mut Config)) -> Lockgate {
        let mut config = Config::default();
        config.upstream.cluster.seeds = vec![self.seed()];
        tune(&mut config);
        let lg = Lockgate::start_with(config).await;
        let pool = lg.ctx.cluster.clone().expect("a cluster pool");
        crate::until!("the slot map and key specs", pool.ready());
        lg
    }

    /// The slot map as the first node gives it now.
    pub async fn map(&self) -> SlotMap {
        let mut c = RawClient::connect(&self.seed()).await;
        SlotMap::from_slots(&c.call_raw(&["CLUSTER", "SLOTS"]).await, &self.seed())
            .expect("CLUSTER SLOTS")
    }

    /// The primaries that serve `keys`.
    pub async fn primaries_of(&self, keys: &[&str]) -> BTreeSet<String> {
        let map = self.map().await;
        (keys.iter())
            .map(|k| {
                let shard = map.shard_of_key(k.as_bytes()).expect("served");
                shard.primary.clone()
            })
            .collect()
    }
}

/// A test's own connection to a cluster, lockgate nowhere: each command
/// goes to the first node and, when it answers `MOVED`, to the node named
/// (so the test needs none of lockgate's slot arithmetic to check it).
pub struct ClusterClient {
    seed: String,
    nodes: HashMap<String, RawClient>,
}

impl ClusterClient {
    /// Connects to `cluster`'s first node.
    pub fn new(cluster: &Cluster) -> ClusterClient {
        ClusterClient {
            seed: cluster.seed(),
            nodes: HashMap::new(),
        }
    }

    /// The connection to `addr`, opened on first use.
    async fn node(&mut self, addr: &str) -> &mut RawClient {
        if !self.nodes.contains_key(addr) {
            let c = RawClient::connect(addr).await;
            self.nodes.insert(addr.to_string(), c);
        }
        self.nodes.get_mut(addr).expect("just opened")
    }

    /// One command's raw reply from the node that serves its key.
    pub async fn call_bin(&mut self, args: &[&[u8]]) -> Vec<u8> {
        let mut addr = self.seed.clone();
        for _ in 0..5 {
            let reply = self.node(&addr).await.call_bin(args).await;
            match reply.strip_prefix(b"-MOVED ") {
                Some(rest) => {
                    let text = String::from_utf8_lossy(rest);
                    addr = text
                        .split_whitespace()
                        .nth(1)
                        .expect("MOVED slot HOST:PORT")
                        .to_string();
                }
                None => return reply,
            }
        }
        panic!("{args:?}: redirected more than 5 times");
    }

    /// The primaries the first node knows, as `HOST:PORT`.
    pub async fn primaries(&mut self) -> Vec<String> {
        let seed = self.seed.clone();
        let raw = self.node(&seed).await.call_raw(&["CLUSTER", "NODES"]).await;
        let text = String::from_utf8_lossy(&raw).to_string();
        text.lines()
            .filter(|l| l.contains("master") && !l.contains("fail"))
            .filter_map(|l| l.split_whitespace().nth(1))
            .map(|a| a.split('@').next().unwrap_or(a).to_string())
            .collect()
    }

    /// One command's raw reply from every primary, in `primaries` order.
    pub async fn on_every_primary(&mut self, args: &[&[u8]]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        for p in self.primaries().await {
            out.push(self.node(&p).await.call_bin(args).await);
        }
        out
    }
}

/// `args` on the primary that `map` says serves `key`, asked directly:
/// that node and its reply.
pub async fn on_node_of(map: &SlotMap, key: &str, args: &[&str]) -> (String, Resp) {
    let node = map
        .shard_of_key(key.as_bytes())
        .expect("served")
        .primary
        .clone();
    let reply = RawClient::connect(&node).await.call_raw(args).await;
    (node, Resp::parse(&reply))
}

/// Runs a client of another language against lockgate at `lg`:
/// `program script HOST PORT`, which must exit 0 and print `ok` (within
/// 120 s); what it printed is shown otherwise.
pub async fn run_client(program: &str, script: &str, lg: std::net::SocketAddr, ok: &str) {
    let mut command = Command::new(program);
    command
        .arg(script)
        .arg(lg.ip().to_string())
        .arg(lg.port().to_string());
    let out = crate::support::run_limited_async(command, None, Duration::from_secs(120)).await;
    let stdout = crate::support::show(&out.stdout);
    assert!(
        out.status.success() && stdout.contains(ok),
        "{program} {script} through lockgate failed ({}).\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        crate::support::show(&out.stderr)
    );
}
