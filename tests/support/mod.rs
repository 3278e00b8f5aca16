//! Test harness: real `redis-server` processes on free loopback ports, and
//! lockgate itself in-process on port 0. Everything started here is stopped
//! by PID when its handle drops. No mocks of Redis.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use lockgate::{Config, ServerContext};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Longest any single wait in a test may take.
pub const WAIT: Duration = Duration::from_secs(10);

/// A real redis-server on a free loopback port, killed on drop.
pub struct RedisServer {
    /// Its port on 127.0.0.1.
    pub port: u16,
    args: Vec<String>,
    env: Vec<(String, String)>,
    child: Option<Child>,
    dir: tempfile::TempDir,
}

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
        let args: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        for _ in 0..5 {
            let mut server = RedisServer {
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
        panic!("redis-server did not start on any of 5 ports (is it installed?)");
    }

    fn spawn(&mut self) -> bool {
        let child = Command::new("redis-server")
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
            .expect("spawn redis-server");
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

/// lockgate running in this process on a port-0 listener.
pub struct Lockgate {
    /// Where clients connect.
    pub addr: SocketAddr,
    /// The operators' HTTP listener, when started with one.
    pub admin: Option<SocketAddr>,
    /// The TLS listener, when started with one.
    pub tls: Option<SocketAddr>,
    /// The shared context (metrics).
    pub ctx: Arc<ServerContext>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Lockgate {
    /// lockgate with default config in front of `upstream`.
    pub async fn start(upstream: &str) -> Lockgate {
        let mut config = Config::default();
        config.upstream.addr = upstream.to_string();
        Lockgate::start_with(config).await
    }

    /// lockgate with `config` (its listen address is ignored: port 0).
    pub async fn start_with(config: Config) -> Lockgate {
        Lockgate::start_inner(config, false, false).await
    }

    /// [`Lockgate::start_with`], also serving TLS clients on a port-0
    /// listener (its address in [`Lockgate::tls`]; `proxy.tls` must name
    /// the certificate files, and its `listen` is ignored).
    pub async fn start_with_tls(config: Config) -> Lockgate {
        Lockgate::start_inner(config, false, true).await
    }

    /// [`Lockgate::start_with`], also serving the operators' HTTP endpoints
    /// on a port-0 listener (its address in [`Lockgate::admin`]).
    pub async fn start_with_admin(config: Config) -> Lockgate {
        Lockgate::start_inner(config, true, false).await
    }

    async fn start_inner(config: Config, with_admin: bool, with_tls: bool) -> Lockgate {
        config.validate().expect("valid test config");
        let tls_listener = match with_tls {
            true => Some(TcpListener::bind("127.0.0.1:0").await.expect("bind tls")),
            false => None,
        };
        let tls = tls_listener
            .as_ref()
            .map(|l| l.local_addr().expect("tls addr"));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let admin_listener = match with_admin {
            true => Some(TcpListener::bind("127.0.0.1:0").await.expect("bind admin")),
            false => None,
        };
        let admin = admin_listener
            .as_ref()
            .map(|l| l.local_addr().expect("admin addr"));
        let ctx = Arc::new(ServerContext::new(config));
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(lockgate::run_with_tls(
            ctx.clone(),
            listener,
            tls_listener,
            admin_listener,
            async {
                let _ = rx.await;
            },
        ));
        Lockgate {
            addr,
            admin,
            tls,
            ctx,
            stop: Some(tx),
            task: Some(task),
        }
    }

    /// Signals shutdown and waits (bounded) until `run` returned.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            tokio::time::timeout(WAIT, task)
                .await
                .expect("lockgate stops in time")
                .expect("lockgate task");
        }
    }
}

impl Drop for Lockgate {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
        // Stops the admin listener and lockgate's own connections.
        self.ctx.stop.cancel();
    }
}

/// The one raw test client: writes raw bytes and reads whole RESP2/RESP3
/// frames (RESP2 nils `$-1`/`*-1` included) as raw bytes, framed by
/// [`frame_len`]. Every wait is bounded by [`WAIT`] or the caller's limit.
pub struct RawClient {
    /// The socket.
    pub stream: TcpStream,
    buf: BytesMut,
}

/// Encodes a command as a RESP multibulk.
pub fn encode(args: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// Encodes a command given as strings.
pub fn cmd(args: &[&str]) -> Vec<u8> {
    let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
    encode(&args)
}

/// Shows a byte string readably in assertion messages.
pub fn show(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

impl RawClient {
    /// Connects to `addr` (within [`WAIT`]).
    pub async fn connect(addr: impl tokio::net::ToSocketAddrs) -> RawClient {
        let stream = tokio::time::timeout(WAIT, TcpStream::connect(addr))
            .await
            .expect("connect in time")
            .expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        RawClient {
            stream,
            buf: BytesMut::new(),
        }
    }

    /// Writes raw bytes.
    pub async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.expect("write");
    }

    /// Reads one whole frame and returns its raw bytes (within [`WAIT`]).
    pub async fn read_raw(&mut self) -> Vec<u8> {
        match self.try_read_raw(WAIT).await {
            Some(frame) => frame,
            None => panic!(
                "no whole reply within {WAIT:?} (or EOF); buffered: {:?}",
                show(&self.buf[..self.buf.len().min(200)])
            ),
        }
    }

    /// Reads one whole frame, or `None` on timeout or EOF. Panics on a read
    /// error, so a reset is never taken for "no reply".
    pub async fn try_read_raw(&mut self, wait: Duration) -> Option<Vec<u8>> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if let Some(len) = frame_len(&self.buf) {
                return Some(self.buf.split_to(len).to_vec());
            }
            self.buf.reserve(16 * 1024);
            let read = tokio::time::timeout_at(deadline, self.stream.read_buf(&mut self.buf)).await;
            match read {
                Ok(Ok(0)) | Err(_) => return None,
                Ok(Ok(_)) => {}
                Ok(Err(e)) => panic!("read: {e}"),
            }
        }
    }

    /// Reads `n` whole frames (each within [`WAIT`]), concatenated as they
    /// came.
    pub async fn read_raw_frames(&mut self, n: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for _ in 0..n {
            out.extend_from_slice(&self.read_raw().await);
        }
        out
    }

    /// Reads one whole frame as text (`\r\n` kept); panics unless it is
    /// UTF-8.
    pub async fn read_s(&mut self) -> String {
        let raw = self.read_raw().await;
        String::from_utf8(raw)
            .unwrap_or_else(|e| panic!("not a UTF-8 reply: {:?}", show(e.as_bytes())))
    }

    /// Sends a command given as strings and reads its raw reply.
    pub async fn call_raw(&mut self, args: &[&str]) -> Vec<u8> {
        self.send(&cmd(args)).await;
        self.read_raw().await
    }

    /// Sends a command given as byte strings and reads its raw reply.
    pub async fn call_bin(&mut self, args: &[&[u8]]) -> Vec<u8> {
        self.send(&encode(args)).await;
        self.read_raw().await
    }

    /// Sends a command and reads its reply as text (see [`Self::read_s`]).
    pub async fn call_s(&mut self, args: &[&str]) -> String {
        self.send(&cmd(args)).await;
        self.read_s().await
    }

    /// Reads exactly `n` bytes of raw stream (for byte-for-byte comparisons).
    pub async fn read_exact_bytes(&mut self, n: usize) -> Vec<u8> {
        while self.buf.len() < n {
            let read = tokio::time::timeout(WAIT, self.stream.read_buf(&mut self.buf))
                .await
                .expect("bytes in time")
                .expect("read");
            assert!(read > 0, "EOF after {} of {n} bytes", self.buf.len());
        }
        self.buf.split_to(n).to_vec()
    }

    /// Feeds the next `n` raw bytes of the stream to `sink` as they arrive,
    /// without holding them all (for replies of hundreds of MB).
    pub async fn stream_bytes(&mut self, mut n: u64, mut sink: impl FnMut(&[u8])) {
        loop {
            let take = n.min(self.buf.len() as u64) as usize;
            sink(&self.buf[..take]);
            self.buf.advance(take);
            n -= take as u64;
            if n == 0 {
                return;
            }
            self.buf.reserve(1 << 20);
            let read = tokio::time::timeout(WAIT, self.stream.read_buf(&mut self.buf))
                .await
                .expect("bytes in time")
                .expect("read");
            assert!(read > 0, "EOF with {n} bytes still to come");
        }
    }

    /// Bytes already read but not yet returned.
    pub fn buffered(&self) -> &[u8] {
        &self.buf
    }

    /// Reads the stream until the server closes it (EOF, or a reset after
    /// the last bytes) within [`WAIT`]; returns everything not yet returned.
    pub async fn read_to_eof(&mut self) -> Vec<u8> {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            match tokio::time::timeout_at(deadline, self.stream.read_buf(&mut self.buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return self.buf.split().to_vec(),
                Ok(Ok(_)) => {}
                Err(_) => panic!(
                    "connection not closed within {WAIT:?}; got {:?}",
                    show(&self.buf)
                ),
            }
        }
    }

    /// Reads whole frames (as text) until the server closes the connection
    /// (EOF, or a reset after the last bytes); panics if it stays open and
    /// silent for [`WAIT`] or leaves a partial frame.
    pub async fn frames_to_close(&mut self) -> Vec<String> {
        let mut frames = Vec::new();
        let mut deadline = tokio::time::Instant::now() + WAIT;
        loop {
            if let Some(len) = frame_len(&self.buf) {
                frames.push(show(&self.buf.split_to(len)));
                deadline = tokio::time::Instant::now() + WAIT;
                continue;
            }
            match tokio::time::timeout_at(deadline, self.stream.read_buf(&mut self.buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break,
                Ok(Ok(_)) => {}
                Err(_) => panic!(
                    "connection neither closed nor sent anything for {WAIT:?}; frames so far: {frames:?}"
                ),
            }
        }
        assert!(
            self.buf.is_empty(),
            "partial frame before the close: {:?} (frames: {frames:?})",
            show(&self.buf)
        );
        frames
    }

    /// Waits until the server closes the connection (true) or `wait` passes.
    pub async fn closed_within(&mut self, wait: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            match tokio::time::timeout_at(deadline, self.stream.read_buf(&mut self.buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => continue,
                Err(_) => return false,
            }
        }
    }
}

/// Length of the complete RESP frame at the front of `buf`, or `None` while it
/// is incomplete. Panics on bytes that are not RESP, so a corrupted stream
/// fails the test where it happens.
pub fn frame_len(buf: &[u8]) -> Option<usize> {
    // Iterative, with a count of element slots still to fill, so a reply
    // nested thousands deep (a Lua script's) needs no stack.
    let (mut pos, mut left) = (0usize, 1u64);
    while left > 0 {
        let type_byte = *buf.get(pos)?;
        let rest = buf.get(pos + 1..)?;
        let line_len = rest.windows(2).position(|w| w == b"\r\n")?;
        let line = &rest[..line_len];
        let next = pos + 1 + line_len + 2;
        let number = || -> i64 {
            std::str::from_utf8(line)
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| panic!("bad RESP length {:?}", String::from_utf8_lossy(line)))
        };
        match type_byte {
            b'+' | b'-' | b':' | b'_' | b',' | b'#' | b'(' => {
                pos = next;
                left -= 1;
            }
            b'$' | b'!' | b'=' => {
                let n = number();
                pos = next;
                if n >= 0 {
                    let end = next + n as usize + 2;
                    if buf.len() < end {
                        return None;
                    }
                    assert_eq!(
                        &buf[end - 2..end],
                        b"\r\n",
                        "bulk payload not followed by CRLF"
                    );
                    pos = end;
                }
                left -= 1;
            }
            b'*' | b'~' | b'>' | b'%' | b'|' => {
                let n = number();
                pos = next;
                let count = if matches!(type_byte, b'%' | b'|') {
                    2 * n.max(0) as u64
                } else {
                    n.max(0) as u64
                };
                if type_byte == b'|' {
                    // An attribute is followed by the element it annotates,
                    // whose slot stays open.
                    left += count;
                } else {
                    left = left + count - 1;
                }
            }
            other => panic!(
                "not RESP: type byte {:?} in {:?}",
                char::from(other),
                String::from_utf8_lossy(&buf[pos..buf.len().min(pos + 64)])
            ),
        }
    }
    Some(pos)
}

/// Runs `command` to completion with its output captured; kills it and
/// panics if it takes longer than `limit`. Blocking: async tests use
/// [`run_limited_async`].
pub fn run_limited(command: &mut Command, limit: Duration) -> Output {
    run_limited_with_input(command, None, limit)
}

/// [`run_limited`] with `input` written to the command's stdin (then
/// closed); without input stdin is empty.
pub fn run_limited_with_input(
    command: &mut Command,
    input: Option<&[u8]>,
    limit: Duration,
) -> Output {
    let what = format!("{command:?}");
    let stdin = if input.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    };
    let mut child = command
        .stdin(stdin)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
    let mut out_pipe = child.stdout.take().expect("stdout");
    let mut err_pipe = child.stderr.take().expect("stderr");
    let out_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out_pipe.read_to_end(&mut v);
        v
    });
    let err_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err_pipe.read_to_end(&mut v);
        v
    });
    if let Some(bytes) = input {
        // Dropped at the end of this block: the command sees EOF.
        let mut stdin = child.stdin.take().expect("stdin");
        stdin.write_all(bytes).expect("write stdin");
    }
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            let stdout = out_reader.join().unwrap_or_default();
            let stderr = err_reader.join().unwrap_or_default();
            panic!(
                "{what} did not finish within {limit:?}\nstdout:\n{}\nstderr:\n{}",
                show(&stdout),
                show(&stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Output {
        status,
        stdout: out_reader.join().unwrap_or_default(),
        stderr: err_reader.join().unwrap_or_default(),
    }
}

/// [`run_limited_with_input`] on a blocking thread, so lockgate, which runs
/// on the test's own runtime, keeps serving the command meanwhile.
pub async fn run_limited_async(
    mut command: Command,
    input: Option<Vec<u8>>,
    limit: Duration,
) -> Output {
    tokio::task::spawn_blocking(move || {
        run_limited_with_input(&mut command, input.as_deref(), limit)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// The tests' one bounded poll: checks `$cond` every 10 ms until it holds,
/// and fails the test with "timed out waiting for {$what}" once [`WAIT`] has
/// passed. `$cond` is any `bool` expression; it may `.await` and borrow
/// locals mutably, e.g. `until!("lock:x to expire", !exists(&mut r,
/// "lock:x").await)`. `$what` is only evaluated for the failure message.
#[macro_export]
macro_rules! until {
    ($what:expr, $cond:expr $(,)?) => {{
        let deadline = std::time::Instant::now() + $crate::support::WAIT;
        while !$cond {
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for {}",
                $what
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }};
}

/// [`until!`] with a plain closure as the check.
pub async fn eventually<F: FnMut() -> bool>(what: &str, mut check: F) {
    crate::until!(what, check());
}

/// The value of an integer reply `:N\r\n` as text; anything else fails the
/// test.
#[allow(dead_code)]
pub fn int(reply: &str) -> i64 {
    reply
        .strip_prefix(':')
        .and_then(|r| r.strip_suffix("\r\n"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("not an integer reply: {reply:?}"))
}

/// Polls `INFO server` on the Redis at `addr` every 50 ms until its
/// reported `uptime_in_seconds` is at least `secs` (within [`WAIT`]).
#[allow(dead_code)]
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
