//! The chaos test's pieces (`tests/serial/quorum_chaos.rs`): lockgate as a
//! subprocess that can be killed, restarted and stopped ([`LockgateProc`]),
//! a client connection whose failures are values, not panics ([`Conn`]),
//! the fault loop ([`faults`]), the client workers ([`clients`]), what
//! they record and how it is judged ([`checks`], the harness's one checker
//! over histories, `tests/support/history.rs`), and an opt-in recorder
//! of the masters' `MONITOR` streams for post-mortems ([`monitor`]).

#![allow(dead_code)]

/// The one checker over histories, shared with the other fault tests.
pub use crate::support::history as checks;
pub mod clients;
pub mod faults;
pub mod monitor;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::{cmd, frame_len, free_port};

/// The built binary, run as a subprocess so a test can SIGKILL it.
const BIN: &str = env!("CARGO_BIN_EXE_lockgate");

/// One client connection; every failure (refused, reset, EOF, timeout) is
/// an `Err` the caller counts, as an app's client library would raise it.
pub struct Conn {
    stream: TcpStream,
    buf: BytesMut,
    /// When it connected (the pooled rule compares it to acquisitions).
    pub opened: Instant,
    /// When it was last used (the pool drops idle connections).
    pub used: Instant,
}

impl Conn {
    /// Connects to `addr` within a second.
    pub async fn connect(addr: SocketAddr) -> Result<Conn, String> {
        let stream = tokio::time::timeout(Duration::from_secs(1), TcpStream::connect(addr))
            .await
            .map_err(|_| "connect timed out".to_string())?
            .map_err(|e| format!("connect: {e}"))?;
        let _ = stream.set_nodelay(true);
        let now = Instant::now();
        Ok(Conn {
            stream,
            buf: BytesMut::new(),
            opened: now,
            used: now,
        })
    }

    /// Sends `args` and reads one whole reply within `wait`.
    pub async fn call(&mut self, args: &[&str], wait: Duration) -> Result<Vec<u8>, String> {
        self.used = Instant::now();
        self.stream
            .write_all(&cmd(args))
            .await
            .map_err(|e| format!("write: {e}"))?;
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if let Some(len) = frame_len(&self.buf) {
                self.used = Instant::now();
                return Ok(self.buf.split_to(len).to_vec());
            }
            self.buf.reserve(4096);
            match tokio::time::timeout_at(deadline, self.stream.read_buf(&mut self.buf)).await {
                Err(_) => return Err("reply timed out".to_string()),
                Ok(Ok(0)) => return Err("connection closed".to_string()),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(format!("read: {e}")),
            }
        }
    }
}

/// The raw reply as text, trimmed, for messages.
pub fn text(raw: &[u8]) -> String {
    String::from_utf8_lossy(raw).trim().replace("\r\n", " ")
}

/// The integers of a reply (`:n` lines), in order.
pub fn ints(raw: &[u8]) -> Vec<i64> {
    String::from_utf8_lossy(raw)
        .split("\r\n")
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|n| n.parse().ok())
        .collect()
}

/// The payload of a bulk reply, `None` for nil or anything else.
pub fn bulk(raw: &[u8]) -> Option<String> {
    let t = String::from_utf8_lossy(raw);
    let (head, rest) = t.strip_prefix('$')?.split_once("\r\n")?;
    let n: usize = head.parse().ok()?;
    rest.get(..n).map(str::to_string)
}

/// lockgate as a subprocess on a fixed port (kept across restarts, so
/// clients reconnect to the same address as to a restarted sidecar).
pub struct LockgateProc {
    /// `lg0`, `lg1`: its instance id too.
    pub name: String,
    /// Where clients connect.
    pub addr: SocketAddr,
    config: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    _dir: tempfile::TempDir,
}

/// Starts `lg0` and `lg1` in front of `primary` with `masters` as their
/// quorum, and waits until both count every master up (masters started
/// moments ago sit out their rejoin delay first).
pub async fn two_lockgates(primary: &str, masters: &[String], t: &Tuning) -> Vec<LockgateProc> {
    let mut lgs = Vec::new();
    for k in 0..2 {
        lgs.push(LockgateProc::start(&format!("lg{k}"), primary, masters, t).await);
    }
    for lg in &lgs {
        lg.all_up(masters.len()).await;
    }
    lgs
}

/// The configuration every instance runs with (lease and rejoin delay as
/// the test's plan says; the node timeout generous for a loaded machine).
pub fn config_text(name: &str, port: u16, primary: &str, masters: &[String], p: &Tuning) -> String {
    let masters: Vec<String> = masters.iter().map(|m| format!("{m:?}")).collect();
    format!(
        "[proxy]\nlisten = \"127.0.0.1:{port}\"\nshutdown_grace_ms = 300\n\
         [upstream]\naddr = \"{primary}\"\nconnect_timeout_ms = 1000\nreconnect_interval_ms = 50\n\
         [admin]\nlisten = \"\"\n[log]\nfilter = \"warn\"\n\
         [locks]\nkeys = [\"lock:*\"]\ndefault_lease_ms = {}\ninstance_id = \"{name}\"\n\
         [locks.quorum]\nmasters = [{}]\nnode_timeout_ms = {}\nrejoin_delay_ms = {}\n",
        p.lease_ms,
        masters.join(", "),
        p.node_timeout_ms,
        p.rejoin_ms
    )
}

/// What every lockgate instance and client of a run agree on.
#[derive(Debug, Clone, Copy)]
pub struct Tuning {
    /// Every lease (SETNX's default lease, `PX`, `LOCKGATE LOCK`), ms.
    pub lease_ms: u64,
    /// How long a returning master sits out, ms (≥ the lease).
    pub rejoin_ms: u64,
    /// lockgate's per-master timeout, ms.
    pub node_timeout_ms: u64,
    /// What a client subtracts from its lease for drift, ms (generous: the
    /// machine is loaded and shared).
    pub drift_ms: u64,
}

impl LockgateProc {
    /// Starts `name` on a free port and waits until it answers PING.
    pub async fn start(name: &str, primary: &str, masters: &[String], p: &Tuning) -> LockgateProc {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let config = dir.path().join("lockgate.toml");
        std::fs::write(&config, config_text(name, port, primary, masters, p)).expect("config");
        let mut lg = LockgateProc {
            name: name.to_string(),
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            config,
            log: dir.path().join("lockgate.log"),
            child: None,
            _dir: dir,
        };
        lg.spawn().await;
        lg
    }

    async fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log file");
        let child = Command::new(BIN)
            .arg("--config")
            .arg(&self.config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn lockgate");
        self.child = Some(child);
        let deadline = Instant::now() + crate::support::WAIT;
        loop {
            if let Ok(mut c) = Conn::connect(self.addr).await {
                if let Ok(r) = c.call(&["PING"], Duration::from_secs(1)).await {
                    if r == b"+PONG\r\n" {
                        return;
                    }
                }
            }
            assert!(
                self.exited().is_none(),
                "{} exited at start:\n{}",
                self.name,
                self.log_tail()
            );
            assert!(
                Instant::now() < deadline,
                "{} never answered PING",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Its PID while it runs.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("lockgate runs").id()
    }

    /// SIGKILL, and wait for it to exit.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and configuration.
    pub async fn restart(&mut self) {
        self.kill();
        self.spawn().await;
    }

    /// Its exit status if it exited by itself (a crash: the test fails).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// The last lines lockgate logged (warnings and errors).
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// Waits until this instance counts all `n` masters `up` (masters
    /// started moments ago sit out first).
    pub async fn all_up(&self, n: usize) {
        let deadline = Instant::now() + crate::support::WAIT;
        loop {
            let states = self
                .masters(Duration::from_secs(1))
                .await
                .unwrap_or_default();
            if states.len() == n && states.iter().all(|s| s == "up") {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{} never counted every master: {states:?}",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Each master's state as this instance reports it (`LOCKGATE
    /// MASTERS`): "up", "sitting out" or "down", in configuration order;
    /// `None` when it does not answer within `wait`.
    pub async fn masters(&self, wait: Duration) -> Option<Vec<String>> {
        let mut c = Conn::connect(self.addr).await.ok()?;
        let raw = c.call(&["LOCKGATE", "MASTERS"], wait).await.ok()?;
        let states: Vec<String> = String::from_utf8_lossy(&raw)
            .split("\r\n")
            .map(|l| l.trim_start_matches('+'))
            .filter(|l| matches!(*l, "up" | "sitting out" | "down"))
            .map(str::to_string)
            .collect();
        Some(states)
    }
}

impl Drop for LockgateProc {
    fn drop(&mut self) {
        if let Some(child) = &self.child {
            // A stopped process ignores nothing but SIGKILL; resume it anyway
            // so nothing is left stopped if the kill raced.
            let _ = Command::new("kill")
                .args(["-CONT", &child.id().to_string()])
                .status();
        }
        self.kill();
    }
}
