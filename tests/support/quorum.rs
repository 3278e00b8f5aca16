//! Shared by `tests/quorum.rs` and `tests/quorum_faults.rs`: a primary and
//! N lock masters (real redis-server processes), lockgate in front of them
//! with `locks.quorum.masters` set, and helpers that look at each master
//! directly.

#![allow(dead_code)]

pub mod fake_clock;

use std::sync::Arc;
use std::time::{Duration, Instant};

use lockgate::lock::quorum::{MasterState, Quorum};
use lockgate::Config;

use crate::support::{Lockgate, RawClient, RedisServer, WAIT};

/// A primary, N lock masters and one lockgate in front of them.
pub struct Cluster {
    /// Where ordinary keys live.
    pub primary: RedisServer,
    /// The lock masters, in configuration order.
    pub masters: Vec<RedisServer>,
    /// lockgate, in-process.
    pub lg: Lockgate,
}

/// lockgate's configuration for `primary` and `masters` (the quorum
/// defaults: node_timeout_ms 50, clock_drift_factor 0.01).
pub fn quorum_config(primary: &str, masters: &[String]) -> Config {
    let mut c = Config::default();
    c.upstream.addr = primary.to_string();
    c.upstream.connect_timeout_ms = 1_000;
    c.upstream.reconnect_interval_ms = 50;
    c.proxy.shutdown_grace_ms = 300;
    c.locks.instance_id = "quorum-test".to_string();
    c.locks.quorum.masters = masters.to_vec();
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
        let lg = Lockgate::start_with(config).await;
        let cluster = Cluster {
            primary,
            masters,
            lg,
        };
        for i in 0..n {
            cluster.wait_state(i, "Up", |s| *s == MasterState::Up).await;
        }
        cluster
    }

    /// The quorum lockgate runs.
    pub fn quorum(&self) -> &Arc<Quorum> {
        self.lg.ctx.quorum.as_ref().expect("lockgate runs a quorum")
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

/// The raw reply as text (`\r\n` kept).
pub fn text(raw: &[u8]) -> String {
    String::from_utf8_lossy(raw).into_owned()
}

/// Sends a command and reads its reply as text.
pub async fn call(c: &mut RawClient, args: &[&str]) -> String {
    text(&c.call_raw(args).await)
}

/// `args` on the Redis at `addr`, over a fresh connection.
pub async fn direct(addr: &str, args: &[&str]) -> String {
    let mut c = RawClient::connect(addr).await;
    call(&mut c, args).await
}

/// A bulk string reply.
pub fn bulk(s: &str) -> String {
    format!("${}\r\n{s}\r\n", s.len())
}

/// The RESP2 nil.
pub const NIL: &str = "$-1\r\n";

/// `lockgate:owner:{key}`.
pub fn owner(key: &str) -> String {
    format!("lockgate:owner:{{{key}}}")
}

/// The value of an integer reply (one helper for every test crate).
#[allow(unused_imports)]
pub use crate::support::int;

/// Sends `sig` (`-STOP`, `-CONT`, …) to `pid`.
pub fn signal(pid: u32, sig: &str) {
    let status = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill {sig} {pid}");
}

/// The state letter of `pid` in `/proc/PID/stat` (`T` when stopped).
pub fn proc_state(pid: u32) -> char {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit(')')
        .next()
        .and_then(|rest| rest.trim_start().chars().next())
        .unwrap_or('?')
}

/// A redis-server stopped with SIGSTOP; SIGCONT when dropped, so a failing
/// test never leaves a stopped process behind.
pub struct Paused(pub u32);

impl Paused {
    /// Stops `pid` and waits until the kernel reports it stopped.
    pub async fn stop(pid: u32) -> Paused {
        signal(pid, "-STOP");
        let paused = Paused(pid);
        crate::support::eventually("redis-server stopped", || proc_state(pid) == 'T').await;
        paused
    }

    /// Resumes it now.
    pub fn resume(self) {}
}

impl Drop for Paused {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-CONT", &self.0.to_string()])
            .status();
    }
}

/// The `p`-th percentile (0..=100) of `samples`, nearest rank.
pub fn percentile(samples: &[Duration], p: usize) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort();
    let rank = (p * sorted.len()).div_ceil(100).max(1);
    sorted[rank - 1]
}
