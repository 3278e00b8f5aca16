//! The quorum tests' cluster (the `quorum*` tests, the storm tests on a
//! quorum): a primary and N lock masters (real redis-server processes),
//! lockgate in front of them with `locks.quorum.masters` set, and helpers
//! that look at each master directly.

pub mod fake_clock;

use std::sync::Arc;
use std::time::{Duration, Instant};

use lockgate::lock::quorum::{MasterState, Quorum};
use lockgate::Config;

use crate::support::resp::direct;
use crate::support::{Lockgate, RawClient, RedisServer, WAIT};

/// A primary, N lock masters and one lockgate in front of them.
pub struct Cluster {
    /// Where ordinary keys live.
    pub primary: RedisServer,
    /// The lock masters, in configuration order.
    pub masters: Vec<RedisServer>,
    /// lockgate, in-process.
    pub lg: Lockgate,
    /// The configuration lockgate was started with.
    pub config: Config,
}

/// lockgate's configuration for `primary` and `masters` (the quorum
/// defaults: node_timeout_ms 50, clock_drift_factor 0.01), with a rejoin
/// delay of 300 ms: the masters are started moments before lockgate, so
/// lockgate makes them sit out the rest of the rejoin delay (30 s by
/// default) before they count.
pub fn quorum_config(primary: &str, masters: &[String]) -> Config {
    let mut c = Config::default();
    c.upstream.addr = primary.to_string();
    c.upstream.connect_timeout_ms = 1_000;
    c.upstream.reconnect_interval_ms = 50;
    c.proxy.shutdown_grace_ms = 300;
    c.locks.instance_id = "quorum-test".to_string();
    c.locks.quorum.masters = masters.to_vec();
    c.locks.quorum.rejoin_delay_ms = 300;
    c
}

impl Cluster {
    /// Starts a primary and `n` masters, then lockgate with the quorum
    /// configuration changed by `tweak`, and waits until lockgate has every
    /// master connected.
    pub async fn start(n: usize, tweak: impl FnOnce(&mut Config)) -> Cluster {
        let masters: Vec<RedisServer> = (0..n).map(|_| RedisServer::start()).collect();
        Cluster::start_on(masters, tweak).await
    }

    /// [`Cluster::start`] with masters the test started itself (one with
    /// a fake clock, say).
    pub async fn start_on(masters: Vec<RedisServer>, tweak: impl FnOnce(&mut Config)) -> Cluster {
        let n = masters.len();
        let primary = RedisServer::start();
        let addrs: Vec<String> = masters.iter().map(|m| m.addr()).collect();
        let mut config = quorum_config(&primary.addr(), &addrs);
        tweak(&mut config);
        let lg = Lockgate::start_with(config.clone()).await;
        let cluster = Cluster {
            primary,
            masters,
            lg,
            config,
        };
        for i in 0..n {
            cluster.wait_state(i, "Up", |s| *s == MasterState::Up).await;
        }
        cluster
    }

    /// Replaces lockgate with a new one on the same configuration (clients
    /// must connect again), and waits until it has connected the masters
    /// `running`.
    pub async fn restart_lockgate(&mut self, running: &[usize]) {
        let new = Lockgate::start_with(self.config.clone()).await;
        std::mem::replace(&mut self.lg, new).stop().await;
        for &i in running {
            self.wait_state(i, "connected", |s| *s != MasterState::Down)
                .await;
        }
    }

    /// The quorum lockgate runs.
    pub fn quorum(&self) -> &Arc<Quorum> {
        self.lg.ctx.locks.quorum().expect("lockgate runs a quorum")
    }

    /// What lockgate thinks of master `i` now.
    pub fn state(&self, i: usize) -> MasterState {
        self.quorum().masters[i].state()
    }

    /// Polls master `i`'s state every 2 ms until `pred` holds (within
    /// [`WAIT`]); returns the state seen.
    pub async fn wait_state(
        &self,
        i: usize,
        what: &str,
        pred: impl Fn(&MasterState) -> bool,
    ) -> MasterState {
        let deadline = Instant::now() + WAIT;
        loop {
            let s = self.state(i);
            if pred(&s) {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "master {i} never became {what} (still {s:?})"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// A client of lockgate.
    pub async fn client(&self) -> RawClient {
        RawClient::connect(self.lg.addr).await
    }

    /// `args` on master `i` directly.
    pub async fn on_master(&self, i: usize, args: &[&str]) -> String {
        direct(&self.masters[i].addr(), args).await
    }

    /// `args` on the primary directly.
    pub async fn on_primary(&self, args: &[&str]) -> String {
        direct(&self.primary.addr(), args).await
    }
}

/// The RESP2 nil.
pub const NIL: &str = "$-1\r\n";

/// The `p`-th percentile (0..=100) of `samples`, nearest rank.
pub fn percentile(samples: &[Duration], p: usize) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort();
    let rank = (p * sorted.len()).div_ceil(100).max(1);
    sorted[rank - 1]
}
