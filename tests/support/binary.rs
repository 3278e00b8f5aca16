//! The lockgate binary as a child process, for what only the binary does
//! (its runtime layout, `--threads`, signals, its log), and a blocking
//! line-at-a-time RESP connection to talk to it; [`Captured`]: the binary
//! with its output collected.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{cmd, free_port, WAIT};

const BIN: &str = env!("CARGO_BIN_EXE_lockgate");

/// The running binary; killed and reaped on drop, so a failing test leaves
/// no process behind.
pub struct Running(pub Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts lockgate with `args` (plus `--listen` on a free port and no admin
/// listener) and waits, bounded, until it accepts. Returns it and the
/// address it listens on.
pub fn start(args: &[&str]) -> (Running, String) {
    let listen = format!("127.0.0.1:{}", free_port());
    let mut child = Running(
        Command::new(BIN)
            .args(args)
            .args(["--listen", &listen, "--admin-listen", ""])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn lockgate"),
    );
    let started = Instant::now();
    while TcpStream::connect(&listen).is_err() {
        assert!(
            child.0.try_wait().expect("try_wait").is_none(),
            "lockgate exited early"
        );
        assert!(started.elapsed() < WAIT, "lockgate never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    (child, listen)
}

/// A blocking connection that reads replies a line at a time: enough for
/// replies that are not arrays.
pub struct Conn {
    /// The write side.
    pub w: TcpStream,
    /// The read side.
    pub r: BufReader<TcpStream>,
}

impl Conn {
    /// Connects, with no Nagle delay and reads bounded by [`WAIT`].
    pub fn open(addr: &str) -> Conn {
        let w = TcpStream::connect(addr).expect("connect");
        w.set_nodelay(true).expect("nodelay");
        w.set_read_timeout(Some(WAIT)).expect("timeout");
        let r = BufReader::new(w.try_clone().expect("clone"));
        Conn { w, r }
    }

    /// Sends one command without reading.
    pub fn send(&mut self, args: &[&str]) {
        self.w.write_all(&cmd(args)).expect("write");
    }

    /// One reply that is not an array, as text (a bulk's payload alone).
    pub fn read(&mut self) -> String {
        let mut line = String::new();
        self.r.read_line(&mut line).expect("read reply");
        if let Some(len) = line.strip_prefix('$') {
            if len.trim() != "-1" {
                line.clear();
                self.r.read_line(&mut line).expect("read bulk");
            }
        }
        line.trim_end().to_string()
    }

    /// Sends one command and reads its reply.
    pub fn call(&mut self, args: &[&str]) -> String {
        self.send(args);
        self.read()
    }
}

/// The built binary, its output collected; killed on drop.
pub struct Captured {
    /// The process.
    pub child: Child,
    output: Arc<Mutex<String>>,
}

impl Captured {
    /// Starts the binary with `args`, `RUST_LOG` unset and `NO_COLOR`.
    pub fn spawn(args: &[&str]) -> Captured {
        let mut child = Command::new(BIN)
            .args(args)
            .env_remove("RUST_LOG")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn lockgate");
        let output: Arc<Mutex<String>> = Arc::default();
        let pipes: [Box<dyn std::io::Read + Send>; 2] = [
            Box::new(child.stdout.take().expect("stdout")),
            Box::new(child.stderr.take().expect("stderr")),
        ];
        for mut pipe in pipes {
            let output = output.clone();
            std::thread::spawn(move || {
                use std::io::Read;
                let mut chunk = [0u8; 4096];
                while let Ok(n) = pipe.read(&mut chunk) {
                    if n == 0 {
                        return;
                    }
                    output
                        .lock()
                        .expect("output")
                        .push_str(&String::from_utf8_lossy(&chunk[..n]));
                }
            });
        }
        Captured { child, output }
    }

    /// Everything it printed so far (stdout and stderr).
    pub fn output(&self) -> String {
        self.output.lock().expect("output").clone()
    }

    /// Waits until the output contains `text` `n` times.
    pub async fn until_logged(&mut self, text: &str, n: usize) {
        let deadline = Instant::now() + WAIT;
        while self.output().matches(text).count() < n {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                panic!(
                    "lockgate exited ({status}) before logging {text:?}:\n{}",
                    self.output()
                );
            }
            assert!(
                Instant::now() < deadline,
                "lockgate never logged {text:?} ({n} times); output:\n{}",
                self.output()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Sends it `sig` (`-HUP`, say) with kill(1).
    pub fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {sig}");
    }
}

impl Drop for Captured {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
