//! Redis Sentinel on loopback: a primary, a replica and three real
//! `redis-server --sentinel` processes, each with its own generated
//! configuration in a temporary directory, killed by PID on drop. Short
//! `down-after-milliseconds` and `failover-timeout` so failovers take
//! seconds. Used by `tests/it/sentinel.rs`.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lockgate::Config;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::resp::{call, direct};
use super::{free_port, RawClient, RedisServer, WAIT};

/// The master name the sentinels monitor.
pub const MASTER: &str = "lgmaster";

/// One `redis-server --sentinel`, killed on drop.
pub struct Sentinel {
    /// Its port on 127.0.0.1.
    pub port: u16,
    child: Option<Child>,
    _dir: tempfile::TempDir,
}

impl Sentinel {
    /// Starts a sentinel monitoring `MASTER` at `master` with `quorum`.
    pub fn start(master: &str, quorum: u32, down_after_ms: u64) -> Sentinel {
        Sentinel::start_with(master, quorum, down_after_ms, "")
    }

    /// As [`Sentinel::start`], with `extra` lines in its configuration
    /// (e.g. `sentinel auth-user …`).
    pub fn start_with(master: &str, quorum: u32, down_after_ms: u64, extra: &str) -> Sentinel {
        let (host, port) = master.rsplit_once(':').expect("HOST:PORT");
        for _ in 0..5 {
            let dir = tempfile::tempdir().expect("tempdir");
            let port_s = free_port();
            let conf = dir.path().join("sentinel.conf");
            let text = format!(
                "port {port_s}\nbind 127.0.0.1\ndir {dir}\n\
                 sentinel resolve-hostnames no\nsentinel announce-ip 127.0.0.1\n\
                 sentinel monitor {MASTER} {host} {port} {quorum}\n\
                 sentinel down-after-milliseconds {MASTER} {down_after_ms}\n\
                 sentinel failover-timeout {MASTER} 5000\n\
                 sentinel parallel-syncs {MASTER} 1\n{extra}",
                dir = dir.path().display()
            );
            std::fs::write(&conf, text).expect("write sentinel.conf");
            let child = Command::new("redis-server")
                .arg(&conf)
                .arg("--sentinel")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn redis-server --sentinel");
            let mut s = Sentinel {
                port: port_s,
                child: Some(child),
                _dir: dir,
            };
            if s.answers() {
                return s;
            }
            s.stop();
        }
        panic!("redis-server --sentinel did not start on any of 5 ports");
    }

    fn answers(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Some(c) = self.child.as_mut() {
                if c.try_wait().ok().flatten().is_some() {
                    return false;
                }
            }
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Kills it (SIGKILL, by PID) and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A primary, its replica and three sentinels (quorum 2).
pub struct Group {
    /// The primary at the start.
    pub primary: RedisServer,
    /// Its replica at the start.
    pub replica: RedisServer,
    /// The sentinels.
    pub sentinels: Vec<Sentinel>,
}

impl Group {
    /// Starts the primary and the replica, waits until the replica is in
    /// sync, starts the sentinels and waits until each knows the replica
    /// and the other two sentinels (a failover needs both).
    pub async fn start() -> Group {
        let (primary, replica) = Group::pair().await;
        Group::with_sentinels(primary, replica, "").await
    }

    /// Three sentinels (quorum 2, `down-after-milliseconds` 500, `extra`
    /// lines in their configuration) over `primary` and its `replica`,
    /// once each knows the replica and the other two.
    pub async fn with_sentinels(primary: RedisServer, replica: RedisServer, extra: &str) -> Group {
        let sentinels = (0..3)
            .map(|_| Sentinel::start_with(&primary.addr(), 2, 500, extra))
            .collect();
        let group = Group {
            primary,
            replica,
            sentinels,
        };
        group.until_sentinels_know_each_other().await;
        group
    }

    /// A primary and a replica in sync, no sentinels.
    pub async fn pair() -> (RedisServer, RedisServer) {
        let primary = RedisServer::start();
        let replica =
            RedisServer::start_with(&["--replicaof", "127.0.0.1", &primary.port.to_string()]);
        crate::until!(
            "the replica to be in sync",
            direct(&replica.addr(), &["INFO", "replication"])
                .await
                .contains("master_link_status:up")
        );
        (primary, replica)
    }

    /// The sentinels' addresses.
    pub fn addrs(&self) -> Vec<String> {
        self.sentinels.iter().map(|s| s.addr()).collect()
    }

    /// Waits until every sentinel lists the replica and two other sentinels.
    pub async fn until_sentinels_know_each_other(&self) {
        for s in &self.sentinels {
            let addr = s.addr();
            // Sentinels find each other by hello messages every 2 s.
            let deadline = Instant::now() + 2 * WAIT;
            loop {
                let peers = direct(&addr, &["SENTINEL", "SENTINELS", MASTER]).await;
                let replicas = direct(&addr, &["SENTINEL", "REPLICAS", MASTER]).await;
                if peers.matches("runid").count() >= 2 && replicas.contains("name") {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "sentinel {addr} did not find its peers: {peers}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    /// `ROLE` of the Redis at `addr`: its first element, or "" when it
    /// does not answer.
    pub async fn role(addr: &str) -> String {
        match try_call(addr, &["ROLE"], Duration::from_millis(500)).await {
            Some(r) => r.split("\r\n").nth(2).unwrap_or_default().to_string(),
            None => String::new(),
        }
    }
}

/// A lockgate configuration following `MASTER` through `sentinels`.
pub fn sentinel_config(sentinels: &[String]) -> Config {
    let mut c = Config::default();
    c.upstream.addr = "127.0.0.1:1".to_string();
    c.upstream.connect_timeout_ms = 500;
    c.upstream.reconnect_interval_ms = 50;
    c.upstream.sentinel.master_name = MASTER.to_string();
    c.upstream.sentinel.addrs = sentinels.to_vec();
    c.upstream.sentinel.recheck_interval_ms = 1_000;
    c.proxy.shutdown_grace_ms = 300;
    c.locks.instance_id = "sentinel-test".to_string();
    c
}

/// One command on a fresh connection to `addr`, within `within`: the
/// first reply line(s) as text (`+OK\r\n`, `:1\r\n`, `$1\r\nx\r\n`,
/// `-ERR …`), or `None` when the connection fails, closes or is too slow.
/// For probes during a failover, where connections are expected to fail.
pub async fn try_call(addr: &str, args: &[&str], within: Duration) -> Option<String> {
    let io = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        s.write_all(&super::cmd(args)).await.ok()?;
        let mut buf = Vec::new();
        loop {
            if let Some(n) = super::frame_len(&buf) {
                return Some(String::from_utf8_lossy(&buf[..n]).into_owned());
            }
            let mut chunk = [0u8; 4096];
            let n = s.read(&mut chunk).await.ok()?;
            if n == 0 {
                return None;
            }
            buf.extend_from_slice(&chunk[..n]);
        }
    };
    tokio::time::timeout(within, io).await.ok().flatten()
}

/// The field `name` of `LOCKGATE PRIMARY` (field/value pairs), as text.
pub async fn primary_field(c: &mut RawClient, name: &str) -> String {
    let raw = call(c, &["LOCKGATE", "PRIMARY"]).await;
    let lines: Vec<&str> = raw.split("\r\n").collect();
    let at = lines
        .iter()
        .position(|l| *l == name)
        .unwrap_or_else(|| panic!("no {name} in LOCKGATE PRIMARY: {raw}"));
    lines[at + 1..]
        .iter()
        .find(|l| !l.starts_with('$'))
        .map(|l| l.trim_start_matches(':').to_string())
        .unwrap_or_default()
}

/// A primary with two replicas in sync and three sentinels, and lockgate
/// following them with `locks.failover_delay_ms = hold_ms`, keys under
/// `lock:ack:` asking one replica's acknowledgement within 300 ms, ready
/// (`/readyz`): the group, its second replica, lockgate and when it
/// started (acknowledgement is in force since then).
pub async fn acked_with_two_replicas(
    hold_ms: u64,
) -> (Group, RedisServer, super::Lockgate, Instant) {
    let (primary, replica) = Group::pair().await;
    let port = primary.port.to_string();
    let second = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
    crate::until!(
        "the second replica in sync",
        direct(&second.addr(), &["INFO", "replication"])
            .await
            .contains("master_link_status:up")
    );
    let group = Group::with_sentinels(primary, replica, "").await;
    let mut config = sentinel_config(&group.addrs());
    config.locks.failover_delay_ms = Some(hold_ms);
    config.locks.replicas_ack_timeout_ms = 300;
    config.locks.overrides.push(lockgate::config::LockOverride {
        pattern: "lock:ack:*".into(),
        replicas_ack: Some(1),
        ..Default::default()
    });
    let started = Instant::now();
    let lg = super::Lockgate::start_with(config).await;
    crate::until!(
        "lockgate to be ready",
        lockgate::http::not_ready(&lg.ctx).is_none()
    );
    (group, second, lg, started)
}
