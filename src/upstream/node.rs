//! A shared, pipelined connection from lockgate to one Redis node (the
//! primary for lockgate's own lock calls, or one lock master of the quorum).
//! Lock commands are short, so all clients share one connection per node:
//! requests are written in order and replies matched in order. The
//! connection is re-established with back-off; every call is bounded by a
//! timeout, and a node that does not answer in time is simply a "no".
//!
//! It knows nothing of locks: the scripts a connection loads as it opens
//! are given ([`NodeConfig::scripts`]), what the node reports about itself
//! then ([`report`]) goes to whoever asked ([`Observer`]), and the
//! exchanges before pipelining (`handshake`, `request`) and a
//! subscription (`messages`) serve the lock room and the Sentinel
//! follower alike.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::protocol::reply::ReplyScanner;
use crate::sync;
use crate::tls::Stream;
use crate::upstream::backoff::{self, Backoff};
use crate::upstream::link;
use crate::upstream::{Connector, Primary};

pub(crate) mod open;
pub mod report;
mod subscribe;

use open::open;
pub(crate) use open::{connect_authenticated, handshake, request, FrameReader};
pub use report::Report;
pub(crate) use subscribe::messages;

/// `CLIENT SETNAME` of lockgate's own connections.
pub const INTERNAL_NAME: &str = "lockgate-internal";

/// Why a call to a node failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodeError {
    /// No answer within the call's timeout (a hung or slow node).
    #[error("node {0} timed out")]
    Timeout(String),
    /// The node is not connected (down, refusing, or reconnecting).
    #[error("node {0} unavailable")]
    Down(String),
    /// Too many calls already queued for this node.
    #[error("node {0} overloaded (queue full)")]
    Busy(String),
}

/// One command for a node, and what to send in its place if the node
/// answers `-NOSCRIPT` (it ran nothing): an `EVALSHA` and the same call as
/// `EVAL`. lockgate's lock scripts go to the quorum's masters this way
/// (`crate::lock::evalsha::Call::request`), so a master reads and hashes a
/// 40-byte name per call instead of a 2–3 KiB body; every master's
/// connection loads them when it opens ([`NodeConfig::scripts`]), so only
/// a `SCRIPT FLUSH` on the master makes their fallback go out. A client's `EVALSHA` on lock keys goes the
/// same way, with the body lockgate has seen. The fallback goes out from
/// the connection task itself, at once, whether or not the caller still
/// waits (a quorum that stopped waiting still runs the call on every
/// master); it is written after whatever was queued before the `NOSCRIPT`
/// came back, the one place where a master may run this lockgate's calls
/// out of their order. Counted in `lock_quorum_noscript_reruns`.
#[derive(Debug, Clone)]
pub struct Request {
    /// The command.
    pub command: Bytes,
    /// Sent instead after a `-NOSCRIPT` answer, once (the rerun has none).
    pub fallback: Option<Bytes>,
}

impl From<Bytes> for Request {
    fn from(command: Bytes) -> Request {
        Request {
            command,
            fallback: None,
        }
    }
}

struct Call {
    request: Request,
    reply: oneshot::Sender<Bytes>,
}

/// What is known about a node's connection, for health and rejoin.
#[derive(Debug, Default)]
pub struct NodeState {
    /// Connected now.
    pub up: AtomicBool,
    /// Times a connection was (re-)established.
    pub connects: AtomicU64,
    /// Calls that timed out.
    pub timeouts: AtomicU64,
    /// A call timed out and no reply has been read since: the connection
    /// is open but the node does not answer (a hung Redis, a silent
    /// network path). Cleared by the next reply or connection.
    pub silent: AtomicBool,
    /// Calls refused because the node was down or overloaded.
    pub failures: AtomicU64,
    /// The node's `run_id` as of the latest connection.
    pub run_id: Mutex<String>,
    /// As of the latest connection: when `INFO server` was read and the
    /// `uptime_in_seconds` it reported (`None`: not reported), so a node
    /// that restarted moments before lockgate first saw it can be told
    /// from one that has run for long.
    pub uptime: Mutex<Option<(Instant, u64)>>,
}

/// Told what a node reports about itself ([`Report`]) as each connection
/// to it opens, before the connection counts ([`NodeState::connects`],
/// [`NodeState::up`]): nobody sees the connection without what it
/// reported (a lock master's eviction policy decides its vote). The lock
/// room's eviction state of a node is one (`crate::lock::eviction::Memory`).
pub trait Observer: Send + Sync + std::fmt::Debug {
    /// Connection number `connection` (the count of connections made,
    /// this one included) to `addr` opened, and the node said `report`.
    fn connected(&self, connection: u64, addr: &str, report: &Report);
}

/// Several observers of one node, told in order.
#[derive(Debug)]
pub struct Observers(pub Vec<Arc<dyn Observer>>);

impl Observer for Observers {
    fn connected(&self, connection: u64, addr: &str, report: &Report) {
        for o in &self.0 {
            o.connected(connection, addr, report);
        }
    }
}

/// A handle to one node; cheap to clone.
#[derive(Clone)]
pub struct Node {
    addr: Arc<str>,
    calls: mpsc::Sender<Call>,
    /// Connection state, shared with the connection task.
    pub state: Arc<NodeState>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node").field("addr", &self.addr).finish()
    }
}

/// How to reach and authenticate with a node.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// `HOST:PORT`.
    pub addr: String,
    /// Connect timeout.
    pub connect_timeout: Duration,
    /// Optional ACL user.
    pub username: String,
    /// Optional password (empty: no AUTH).
    pub password: String,
    /// Most calls queued for the node at once.
    pub max_queued: usize,
    /// Plain TCP or TLS, as configured for this kind of node.
    pub connector: Connector,
    /// Set for the primary: connect to the primary in force instead of
    /// `addr`, and reconnect when it changes (Sentinel).
    pub follow: Option<Arc<Primary>>,
    /// The script bodies loaded (`SCRIPT LOAD`) as each connection opens,
    /// so calls sent as `EVALSHA` with an `EVAL` fallback (see [`Request`])
    /// find them: every lock script for the quorum's masters; none for the
    /// primary, whose sessions load what they use, and where a `NOSCRIPT`
    /// reruns as `EVAL`, which caches the script for the next `EVALSHA`.
    pub scripts: &'static [&'static str],
    /// Counts the calls sent again as `EVAL` after `-NOSCRIPT` (see
    /// [`Request`]); shared by the quorum's masters.
    pub noscript_reruns: Option<Arc<AtomicU64>>,
    /// Told what the node reports as each connection opens (see
    /// [`Observer`]).
    pub observer: Option<Arc<dyn Observer>>,
}

impl NodeConfig {
    /// lockgate's own connection settings for `addr`, from the upstream's
    /// timeout and credentials, connecting through `connector`.
    pub fn for_addr(
        config: &crate::config::Config,
        addr: &str,
        connector: Connector,
    ) -> NodeConfig {
        NodeConfig {
            addr: addr.to_string(),
            connect_timeout: Duration::from_millis(config.upstream.connect_timeout_ms),
            username: config.upstream.username.clone(),
            password: config.upstream.password.clone(),
            max_queued: config.locks.max_queued_calls,
            connector,
            follow: None,
            scripts: &[],
            noscript_reruns: None,
            observer: None,
        }
    }

    /// The same settings, following `primary` (see [`NodeConfig::follow`]).
    pub fn following(self, primary: &Arc<Primary>) -> NodeConfig {
        NodeConfig {
            follow: Some(primary.clone()),
            ..self
        }
    }

    /// The settings for the next connection: `addr` as configured, or the
    /// primary in force (waiting until one is confirmed) with its
    /// generation.
    pub(crate) async fn resolve(&self) -> (NodeConfig, Option<u64>) {
        match &self.follow {
            None => (self.clone(), None),
            Some(primary) => {
                let current = primary.confirmed().await;
                let addr = current.addr.as_deref().unwrap_or_default().to_string();
                (
                    NodeConfig {
                        addr,
                        ..self.clone()
                    },
                    Some(current.generation),
                )
            }
        }
    }

    /// Resolves when the primary of `generation` is replaced; never for
    /// a node that does not follow the primary.
    pub(crate) async fn replaced(&self, generation: Option<u64>) {
        match (&self.follow, generation) {
            (Some(primary), Some(g)) => primary.changed_from(g).await,
            _ => std::future::pending().await,
        }
    }
}

impl Node {
    /// Starts the connection task for `config`; it stops when `shutdown`
    /// is cancelled. Must be called inside a Tokio runtime.
    pub fn spawn(config: NodeConfig, shutdown: CancellationToken) -> Node {
        let (tx, rx) = mpsc::channel(config.max_queued.max(1));
        let state = Arc::new(NodeState::default());
        let node = Node {
            addr: Arc::from(config.addr.as_str()),
            calls: tx,
            state: state.clone(),
        };
        tokio::spawn(async move {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = connection_loop(config, rx, state) => {}
            }
        });
        node
    }

    /// A node at `addr` that is never connected: every call to it fails at
    /// once (`busy`). For a lock room looked at without Redis (see
    /// [`crate::lock::Store::offline`]).
    pub fn detached(addr: &str) -> Node {
        let (tx, _) = mpsc::channel(1);
        Node {
            addr: Arc::from(addr),
            calls: tx,
            state: Arc::new(NodeState::default()),
        }
    }

    /// The node's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Sends one command and waits up to `timeout` for its raw reply.
    pub async fn call(&self, command: Bytes, timeout: Duration) -> Result<Bytes, NodeError> {
        self.send(command.into(), timeout).await
    }

    /// Queues one command now, before anything is awaited, and returns the
    /// wait (up to `timeout`) for its raw reply. The command goes to the
    /// node even if the wait is dropped unfinished: a quorum that stops
    /// waiting once a majority answered still releases on every master.
    pub fn send(
        &self,
        request: Request,
        timeout: Duration,
    ) -> impl std::future::Future<Output = Result<Bytes, NodeError>> + Send + 'static {
        let queued = self.queue(request);
        let (state, addr) = (self.state.clone(), self.addr.clone());
        async move {
            match tokio::time::timeout(timeout, queued?).await {
                Ok(Ok(bytes)) => Ok(bytes),
                Ok(Err(_)) => Err(NodeError::Down(addr.to_string())),
                Err(_) => {
                    state.timeouts.fetch_add(1, Ordering::Relaxed);
                    state.silent.store(true, Ordering::Relaxed);
                    Err(NodeError::Timeout(addr.to_string()))
                }
            }
        }
    }

    /// Hands `request` to the connection task; the receiver gets its reply.
    fn queue(&self, request: Request) -> Result<oneshot::Receiver<Bytes>, NodeError> {
        // Known down: fail at once (a quorum answers as soon as a majority
        // is known). Before the first connection, calls wait in the queue.
        if !self.state.up.load(Ordering::Relaxed) && self.state.connects.load(Ordering::Relaxed) > 0
        {
            self.state.failures.fetch_add(1, Ordering::Relaxed);
            return Err(NodeError::Down(self.addr.to_string()));
        }
        let (reply, rx) = oneshot::channel();
        if self.calls.try_send(Call { request, reply }).is_err() {
            self.state.failures.fetch_add(1, Ordering::Relaxed);
            return Err(NodeError::Busy(self.addr.to_string()));
        }
        Ok(rx)
    }
}

async fn connection_loop(
    config: NodeConfig,
    mut calls: mpsc::Receiver<Call>,
    state: Arc<NodeState>,
) {
    let mut backoff = Backoff::new(backoff::OWN_FIRST);
    loop {
        let (now, generation) = config.resolve().await;
        match open(&now).await {
            Ok(opened) => {
                backoff.reset();
                // All known before the connection counts, so nobody sees
                // it without them (a master's policy decides its vote).
                let connection = state.connects.load(Ordering::Relaxed) + 1;
                if let Some(observer) = &config.observer {
                    observer.connected(connection, &now.addr, &opened.report);
                }
                *sync::lock(&state.run_id) = opened.report.run_id;
                *sync::lock(&state.uptime) = opened.report.uptime;
                let stream = opened.stream;
                state.connects.fetch_add(1, Ordering::Relaxed);
                state.silent.store(false, Ordering::Relaxed);
                state.up.store(true, Ordering::Relaxed);
                tokio::select! {
                    _ = serve(stream, &mut calls, config.noscript_reruns.as_deref(), &state.silent) => {}
                    _ = config.replaced(generation) => backoff.at_once(),
                }
                state.up.store(false, Ordering::Relaxed);
                tracing::debug!(node = %now.addr, "lock node connection lost");
            }
            Err(e) => tracing::debug!(node = %now.addr, error = %e, "lock node unreachable"),
        }
        // Calls queued while down fail at once rather than wait.
        while let Ok(call) = calls.try_recv() {
            drop(call);
        }
        tokio::time::sleep(backoff.next()).await;
    }
}

/// Pipelines calls over one connection until it fails.
async fn serve(
    mut stream: Stream,
    calls: &mut mpsc::Receiver<Call>,
    reruns: Option<&AtomicU64>,
    silent: &AtomicBool,
) {
    let lane = NodeLane { reruns, silent };
    let limits = link::Limits {
        per_write: CALLS_PER_WRITE,
        read_chunk: 16 * 1024,
        // Every call is bounded by its caller's timeout instead.
        lock_reply_timeout: None,
    };
    let mut reader = Scan {
        scanner: ReplyScanner::new(),
        pos: 0,
    };
    // Shutdown ends the whole task (`Node::spawn`), this loop with it.
    let stop = CancellationToken::new();
    let never = std::future::pending::<String>();
    let halves = stream.split();
    link::serve(
        &lane,
        &mut reader,
        halves,
        calls,
        Vec::new(),
        limits,
        &stop,
        never,
    )
    .await;
}

/// Most calls taken off the queue for one write.
const CALLS_PER_WRITE: usize = 256;

/// A node's connection, as [`link::serve`] runs it: each call written
/// waits for its reply, with its fallback.
struct NodeLane<'a> {
    reruns: Option<&'a AtomicU64>,
    silent: &'a AtomicBool,
}

/// The reading side: `pos`, scanned so far; the current frame starts at
/// the buffer's start.
struct Scan {
    scanner: ReplyScanner,
    pos: usize,
}

/// A call written, waiting for its reply.
struct Waiting {
    reply: oneshot::Sender<Bytes>,
    fallback: Option<Bytes>,
}

impl link::Lane for NodeLane<'_> {
    type Job = Call;
    type Owed = Waiting;
    type Reader = Scan;

    fn queue(&self, call: Call, out: &mut BytesMut, fifo: &mut VecDeque<Waiting>) {
        out.extend_from_slice(&call.request.command);
        fifo.push_back(Waiting {
            reply: call.reply,
            fallback: call.request.fallback,
        });
    }

    fn split(
        &self,
        s: &mut Scan,
        buf: &mut BytesMut,
        fifo: &mut VecDeque<Waiting>,
        again: &mut Vec<Call>,
    ) -> Result<(), String> {
        let mut start = 0;
        loop {
            let Ok((used, end)) = s.scanner.advance(&buf[s.pos..]) else {
                return Err("a malformed reply".to_string());
            };
            s.pos += used;
            match end {
                Some(end) if end.kind == crate::protocol::reply::FrameKind::Reply => {
                    let frame = &buf[start..s.pos];
                    start = s.pos;
                    let Some(waiting) = fifo.pop_front() else {
                        continue;
                    };
                    match waiting.fallback {
                        Some(command) if frame.starts_with(b"-NOSCRIPT") => {
                            if let Some(n) = self.reruns {
                                n.fetch_add(1, Ordering::Relaxed);
                            }
                            let request = Request::from(command);
                            let reply = waiting.reply;
                            again.push(Call { request, reply });
                        }
                        _ => {
                            self.silent.store(false, Ordering::Relaxed);
                            let _ = waiting.reply.send(Bytes::copy_from_slice(frame));
                        }
                    }
                }
                Some(_) => start = s.pos,
                None => break,
            }
        }
        // Keep only the unfinished frame's bytes; the scanner keeps its
        // place inside it.
        let _ = buf.split_to(start);
        s.pos -= start;
        Ok(())
    }

    fn lock_call_waits(&self, _: &VecDeque<Waiting>) -> bool {
        // No stall watch here (see `serve`).
        false
    }

    fn lost(&self, _: &Scan, _: VecDeque<Waiting>, _: Option<&str>) {
        // Dropped: each caller sees its reply's sender gone at once.
    }
}
