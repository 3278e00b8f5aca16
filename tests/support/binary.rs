//! The lockgate binary as a child process, for what only the binary does
//! (its runtime layout, `--threads`, signals), and a blocking line-at-a-time
//! RESP connection to talk to it.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
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
