//! The built `lockgate` binary: `--check` exit codes and messages, `--help`,
//! and a graceful SIGTERM with a blocked command in flight against a real
//! Redis.

use crate::support;

use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use support::resilience::wait_blocked;
use support::{cmd, free_port, run_limited, show, RawClient, RedisServer, WAIT};

const BIN: &str = env!("CARGO_BIN_EXE_lockgate");
/// Exit code for an invalid configuration (EX_USAGE).
const EXIT_CONFIG: i32 = 64;

fn lockgate(args: &[&str]) -> std::process::Output {
    run_limited(Command::new(BIN).args(args), WAIT)
}

fn shipped_config() -> String {
    format!("{}/config/lockgate.toml", env!("CARGO_MANIFEST_DIR"))
}

/// Writes `text` to a config file in `dir`.
fn config_file(dir: &Path, text: &str) -> String {
    let path = dir.join("lockgate.toml");
    std::fs::write(&path, text).expect("write config");
    path.display().to_string()
}

fn check(config_text: &str, extra: &[&str]) -> std::process::Output {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = config_file(dir.path(), config_text);
    let mut args = vec!["--config", path.as_str(), "--check"];
    args.extend_from_slice(extra);
    lockgate(&args)
}

#[test]
fn check_accepts_the_shipped_config() {
    let out = lockgate(&["--config", &shipped_config(), "--check"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "stdout: {}\nstderr: {}",
        show(&out.stdout),
        show(&out.stderr)
    );
    assert!(show(&out.stdout).contains("valid"), "{}", show(&out.stdout));
    // Defaults alone are valid too.
    assert_eq!(lockgate(&["--check"]).status.code(), Some(0));
}

#[test]
fn check_refuses_a_bad_value_naming_the_key() {
    let out = check("[proxy]\nmax_clients = 0\n", &[]);
    assert_eq!(
        out.status.code(),
        Some(EXIT_CONFIG),
        "{}",
        show(&out.stderr)
    );
    let err = show(&out.stderr);
    assert!(err.contains("proxy.max_clients"), "stderr: {err}");

    let out = check("[upstream]\nconnect_timeout_ms = 0\n", &[]);
    assert_eq!(out.status.code(), Some(EXIT_CONFIG));
    assert!(
        show(&out.stderr).contains("upstream.connect_timeout_ms"),
        "stderr: {}",
        show(&out.stderr)
    );

    let out = check("[upstream]\nlock_reply_timeout_ms = 20\n", &[]);
    assert_eq!(out.status.code(), Some(EXIT_CONFIG));
    assert!(
        show(&out.stderr).contains("upstream.lock_reply_timeout_ms"),
        "stderr: {}",
        show(&out.stderr)
    );
}

#[test]
fn check_refuses_an_unknown_key_naming_it() {
    let out = check("[proxy]\nlisen = \"127.0.0.1:1\"\n", &[]);
    assert_eq!(
        out.status.code(),
        Some(EXIT_CONFIG),
        "{}",
        show(&out.stderr)
    );
    assert!(show(&out.stderr).contains("lisen"), "{}", show(&out.stderr));

    let out = check("[proxyy]\nlisten = \"127.0.0.1:1\"\n", &[]);
    assert_eq!(out.status.code(), Some(EXIT_CONFIG));
    assert!(
        show(&out.stderr).contains("proxyy"),
        "{}",
        show(&out.stderr)
    );
}

#[test]
fn check_refuses_bad_flags_and_missing_files() {
    let out = check("", &["--listen", "not-an-address"]);
    assert_eq!(out.status.code(), Some(EXIT_CONFIG));
    assert!(
        show(&out.stderr).contains("proxy.listen"),
        "{}",
        show(&out.stderr)
    );
    let missing = "/nonexistent/lockgate-test.toml";
    let out = lockgate(&["--config", missing, "--check"]);
    assert_eq!(out.status.code(), Some(EXIT_CONFIG));
    assert!(show(&out.stderr).contains(missing), "{}", show(&out.stderr));
    // Flags override a valid file: the file's own listen is fine, the flag's is not.
    let out = lockgate(&["--config", &shipped_config(), "--listen", "x:y", "--check"]);
    assert_eq!(out.status.code(), Some(EXIT_CONFIG));
}

/// `[upstream.cluster]` and `--upstream-cluster`: valid seeds pass, and
/// every bound and exclusion is refused naming the key.
#[test]
fn check_validates_the_cluster_section() {
    let ok = lockgate(&[
        "--upstream-cluster",
        "127.0.0.1:7000,127.0.0.1:7001",
        "--check",
    ]);
    assert_eq!(ok.status.code(), Some(0), "{}", show(&ok.stderr));
    // The lock quorum beside a cluster: the locks on the masters.
    let with_quorum = check(
        "",
        &[
            "--upstream-cluster",
            "h:7000",
            "--lock-masters",
            "a:1,b:2,c:3",
        ],
    );
    assert_eq!(
        with_quorum.status.code(),
        Some(0),
        "{}",
        show(&with_quorum.stderr)
    );
    for (text, extra, key) in [
        (
            "[upstream.cluster]\nseeds = [\"nohostport\"]\n",
            &[][..],
            "upstream.cluster.seeds",
        ),
        (
            "[upstream.cluster]\nseeds = [\"h:1\"]\nmax_redirects = 0\n",
            &[][..],
            "upstream.cluster.max_redirects",
        ),
        (
            "[upstream.cluster]\nrefresh_interval_ms = 100\nrefresh_min_gap_ms = 200\n",
            &[][..],
            "upstream.cluster.refresh_min_gap_ms",
        ),
        (
            "[upstream.sentinel]\nmaster_name = \"m\"\naddrs = [\"h:26379\"]\n",
            &["--upstream-cluster", "h:7000"][..],
            "upstream.cluster.seeds",
        ),
    ] {
        let out = check(text, extra);
        assert_eq!(out.status.code(), Some(EXIT_CONFIG), "{text} {extra:?}");
        assert!(
            show(&out.stderr).contains(key),
            "{key}: {}",
            show(&out.stderr)
        );
    }
}

#[test]
fn help_names_every_flag() {
    let out = lockgate(&["--help"]);
    assert_eq!(out.status.code(), Some(0));
    let text = show(&out.stdout);
    for flag in [
        "--config",
        "--listen",
        "--upstream",
        "--upstream-cluster",
        "--check",
    ] {
        assert!(text.contains(flag), "--help lacks {flag}:\n{text}");
    }
}

/// Kills the child on drop so a failing test leaves no process behind.
struct Running {
    child: Child,
}

impl Running {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Polls until the process exits or `limit` passes.
    async fn exit_within(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn connectable(addr: &str) -> bool {
    matches!(
        tokio::time::timeout(
            Duration::from_millis(500),
            tokio::net::TcpStream::connect(addr)
        )
        .await,
        Ok(Ok(_))
    )
}

#[tokio::test]
async fn sigterm_drains_in_flight_replies_and_exits_0() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let grace = Duration::from_millis(4000);
    let path = config_file(
        dir.path(),
        &format!("[proxy]\nshutdown_grace_ms = {}\n", grace.as_millis()),
    );
    let listen = format!("127.0.0.1:{}", free_port());
    let log = std::fs::File::create(dir.path().join("lockgate.log")).expect("log file");
    let child = Command::new(BIN)
        .args(["--config", &path, "--listen", &listen])
        // The default admin port may be taken by another process here.
        .args(["--admin-listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--upstream", &redis.addr()])
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("spawn lockgate");
    let mut proc = Running { child };
    let log_text = || std::fs::read_to_string(dir.path().join("lockgate.log")).unwrap_or_default();

    let started = Instant::now();
    while !connectable(&listen).await {
        assert!(
            proc.child.try_wait().expect("try_wait").is_none(),
            "lockgate exited early:\n{}",
            log_text()
        );
        assert!(started.elapsed() < WAIT, "lockgate never listened");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let mut idle = RawClient::connect(listen.as_str()).await;
    assert_eq!(idle.call_s(&["PING"]).await, "+PONG\r\n");
    let mut blocked = RawClient::connect(listen.as_str()).await;
    let sent = Instant::now();
    blocked.send(&cmd(&["BLPOP", "nokey", "1"])).await;
    wait_blocked(&redis.addr(), "blpop").await;

    let term = Instant::now();
    let status = Command::new("kill")
        .args(["-TERM", &proc.pid().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -TERM failed");

    // No new connections once the signal is handled.
    let mut refused_at = None;
    while term.elapsed() < Duration::from_millis(900) {
        if !connectable(&listen).await {
            refused_at = Some(term.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        refused_at.is_some(),
        "still accepting connections 900 ms after SIGTERM"
    );
    // The in-flight BLPOP still gets its reply (nil after its 1 s timeout),
    // then the connection is closed.
    assert_eq!(
        show(&blocked.read_raw().await),
        "*-1\r\n",
        "the in-flight reply"
    );
    assert!(
        sent.elapsed() >= Duration::from_millis(900),
        "the BLPOP reply came before its 1 s timeout: {:?}",
        sent.elapsed()
    );
    assert!(blocked.closed_within(WAIT).await, "closed after the drain");
    assert!(idle.closed_within(WAIT).await, "idle client closed");

    let status = proc
        .exit_within(grace + Duration::from_millis(1500))
        .await
        .unwrap_or_else(|| panic!("no exit within grace + 1.5 s:\n{}", log_text()));
    assert_eq!(status.code(), Some(0), "exit status; log:\n{}", log_text());
    assert!(
        term.elapsed() < grace,
        "waited the whole grace period ({:?}) though everything had drained",
        term.elapsed()
    );
}
