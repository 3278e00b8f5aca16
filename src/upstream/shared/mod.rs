//! `proxy.upstream = "shared"`: sessions' plain commands travel over a few
//! connections to the primary that all sessions share
//! (`proxy.shared_upstream_connections`), so Redis reads many clients'
//! commands in one system call, as behind twemproxy, but with fidelity.
//!
//! A session gets a [`SharedStream`] where it would get a socket of its
//! own, and uses it the same way (split, write whole commands, read
//! replies). The stream's write side looks at each command it is given
//! ([`crate::command::connection::needs_own_connection`]): plain ones go, in batches,
//! to the session's shared connection (a [`lane`]), which writes many
//! sessions' batches at once and hands each reply back to the session
//! owed it, in order (an [`inbox`] per session). At the first command that
//! needs connection state (`MULTI`, `WATCH`, blocking commands, pub/sub,
//! `SELECT` of another database, `AUTH`, `HELLO`, `CLIENT`, a script of
//! its own, …) the stream stops sending to the shared connection, waits
//! until every reply owed there is in (not at all when none is), takes a
//! warm spare dedicated connection (`spare`, `proxy.shared_spare_connections`;
//! opens one as `dedicated` mode would when none is ready), and passes
//! everything through it from then on, for good (`stream`). Replies keep
//! their order throughout.
//!
//! While a `CLIENT PAUSE` seen going to Redis through this instance is in
//! force, every session that sends a command moves too (`PauseHint`), so
//! that each paused client is held on its own connection, as directly.
//!
//! What cannot be carried over: `WAIT`/`WAITAOF` after commands went over
//! the shared connection (they would not wait for those writes) are
//! refused with `-ERR lockgate: …` (docs/behaviour.md).

mod inbox;
mod lane;
mod spare;
mod stream;

pub(crate) use stream::framing_parser;
pub use stream::{SharedRead, SharedStream, SharedWrite};

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio_util::sync::{CancellationToken, PollSender};

use crate::command::connection::{OwnReason, Pause};
use crate::config::Config;
use crate::metrics::{counters, RateLimit};
use crate::protocol::encode;
use crate::tls::Stream;
use crate::upstream::primary::Current;
use crate::upstream::{Connector, Primary, UpstreamError};
use inbox::Inbox;
use spare::Spares;

/// The name shared connections give themselves (`CLIENT LIST`).
pub const SHARED_NAME: &str = "lockgate-shared";

counters! {
    /// Counters of the sessions' upstream connections (both modes).
    pub struct UpstreamConnMetrics {
        /// Sessions' own (dedicated) connections to the primary open now.
        dedicated_open: Gauge "dedicated_upstream_connections", "Sessions' own (dedicated) upstream connections open now";
        /// Shared connections to the primary open now.
        shared_open: Gauge "shared_upstream_connections", "Shared upstream connections open now";
        /// Shared connections opened (the first ones and every reconnection).
        shared_connects: Counter "shared_upstream_connects", "Shared upstream connections opened";
        /// Attempts to open a shared connection that failed.
        shared_connect_errors: Counter "shared_upstream_connect_errors", "Attempts to open a shared upstream connection that failed";
        /// Shared connections lost (closed, failed, or the primary changed).
        shared_lost: Counter "shared_upstream_lost", "Shared upstream connections lost";
        /// Replies answered upstream-unavailable because a shared connection was lost or down.
        shared_error_replies: Counter "shared_upstream_error_replies", "Replies answered upstream-unavailable for a lost or down shared connection";
        /// Malformed or unowed replies on a shared connection (it is dropped).
        shared_bad_replies: Counter "shared_upstream_bad_replies", "Malformed or unowed replies on a shared connection";
        /// Shared connections given up because a lock command went
        /// unanswered past `upstream.lock_reply_timeout_ms` (counted in
        /// `shared_lost` too).
        shared_lock_reply_timeouts: Counter "shared_upstream_lock_reply_timeouts", "Shared upstream connections given up because a lock command went unanswered past upstream.lock_reply_timeout_ms";
        /// Batches of commands sent over shared connections.
        shared_batches: Counter "shared_upstream_batches", "Batches of session commands sent over shared connections";
        /// Writes to shared connections (batches per write: how much they coalesce).
        shared_writes: Counter "shared_upstream_writes", "Writes to shared upstream connections";
        /// Times a session waited because its shared connection's queue was full.
        shared_queue_full: Counter "shared_queue_full", "Times a session waited for room in a shared connection's queue (proxy.shared_upstream_queue_batches)";
        /// Clients closed: past proxy.shared_session_reply_bytes, they took nothing for proxy.shared_reply_stall_ms.
        shared_session_output_limit: Counter "shared_session_output_limit", "Clients closed: more than proxy.shared_session_reply_bytes of replies waited for them and they took none for proxy.shared_reply_stall_ms";
        /// Warm spare dedicated connections open now (proxy.shared_spare_connections).
        spare_open: Gauge "shared_spare_connections", "Warm spare dedicated upstream connections open now (proxy.shared_spare_connections)";
        /// Moves that found no spare ready and connected then.
        spare_misses: Counter "shared_spare_misses", "Sessions that moved to a dedicated connection with no spare ready (they connected then)";
        /// Spares dropped: closed while idle, or opened to a primary since replaced.
        spare_dropped: Counter "shared_spare_dropped", "Spare upstream connections dropped: closed while idle, or to a primary since replaced";
        /// Sessions that could not open their dedicated connection when moving (the client is closed).
        moves_failed: Counter "shared_moves_failed", "Sessions closed: their dedicated connection could not be opened when they moved";
        /// WAIT/WAITAOF refused after commands went over a shared connection.
        wait_refused: Counter "shared_wait_refused", "WAIT/WAITAOF refused after commands went over a shared connection";
        /// Sessions moved at MULTI or WATCH.
        moved_transaction: Counter "shared_sessions_moved_transaction", "Sessions moved to a dedicated connection at MULTI or WATCH";
        /// Sessions moved at a blocking command.
        moved_blocking: Counter "shared_sessions_moved_blocking", "Sessions moved to a dedicated connection at a blocking command";
        /// Sessions moved at WAIT or WAITAOF (nothing sent shared before).
        moved_wait: Counter "shared_sessions_moved_wait", "Sessions moved to a dedicated connection at WAIT or WAITAOF";
        /// Sessions moved at a subscription command.
        moved_pubsub: Counter "shared_sessions_moved_pubsub", "Sessions moved to a dedicated connection at a (un)subscription command";
        /// Sessions moved at MONITOR or a replication command.
        moved_stream: Counter "shared_sessions_moved_stream", "Sessions moved to a dedicated connection at MONITOR, SYNC, PSYNC or REPLCONF";
        /// Sessions moved at SELECT of another database.
        moved_select: Counter "shared_sessions_moved_select", "Sessions moved to a dedicated connection at SELECT of a database other than 0";
        /// Sessions moved at AUTH, HELLO or RESET.
        moved_identity: Counter "shared_sessions_moved_identity", "Sessions moved to a dedicated connection at AUTH, HELLO or RESET";
        /// Sessions moved at a CLIENT command.
        moved_client: Counter "shared_sessions_moved_client", "Sessions moved to a dedicated connection at a CLIENT command";
        /// Sessions moved at READONLY, READWRITE or ASKING.
        moved_cluster: Counter "shared_sessions_moved_cluster", "Sessions moved to a dedicated connection at READONLY, READWRITE or ASKING";
        /// Sessions moved at QUIT.
        moved_quit: Counter "shared_sessions_moved_quit", "Sessions moved to a dedicated connection at QUIT";
        /// Sessions moved at SCRIPT KILL, FUNCTION KILL or SHUTDOWN.
        moved_kill: Counter "shared_sessions_moved_kill", "Sessions moved to a dedicated connection at SCRIPT KILL, FUNCTION KILL or SHUTDOWN";
        /// Sessions moved at a script or function of their own.
        moved_script: Counter "shared_sessions_moved_script", "Sessions moved to a dedicated connection at a script or function of their own (EVAL, EVALSHA, FCALL and their _RO forms; not lockgate's lock scripts)";
        /// Sessions moved at DEBUG.
        moved_debug: Counter "shared_sessions_moved_debug", "Sessions moved to a dedicated connection at DEBUG";
        /// Sessions moved at a command sent while a CLIENT PAUSE seen through lockgate was in force.
        moved_paused: Counter "shared_sessions_moved_paused", "Sessions moved to a dedicated connection at a command sent while a CLIENT PAUSE seen through this instance was in force";
    }
}

impl UpstreamConnMetrics {
    /// The counter of sessions moved for `reason`.
    pub fn moved(&self, reason: OwnReason) -> &std::sync::atomic::AtomicU64 {
        match reason {
            OwnReason::Transaction => &self.moved_transaction,
            OwnReason::Blocking => &self.moved_blocking,
            OwnReason::Wait => &self.moved_wait,
            OwnReason::PubSub => &self.moved_pubsub,
            OwnReason::Stream => &self.moved_stream,
            OwnReason::Select => &self.moved_select,
            OwnReason::Identity => &self.moved_identity,
            OwnReason::Client => &self.moved_client,
            OwnReason::Cluster => &self.moved_cluster,
            OwnReason::Quit => &self.moved_quit,
            OwnReason::Kill => &self.moved_kill,
            OwnReason::Script => &self.moved_script,
            OwnReason::Debug => &self.moved_debug,
            OwnReason::Paused => &self.moved_paused,
        }
    }
}

/// Counts one dedicated connection open while it lives.
#[derive(Debug)]
pub struct DedicatedGuard(Arc<UpstreamConnMetrics>);

impl DedicatedGuard {
    /// Counts one more dedicated connection open.
    pub fn new(metrics: &Arc<UpstreamConnMetrics>) -> DedicatedGuard {
        metrics.dedicated_open.fetch_add(1, Ordering::Relaxed);
        DedicatedGuard(metrics.clone())
    }
}

impl Drop for DedicatedGuard {
    fn drop(&mut self) {
        self.0.dedicated_open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Commands one session sends over its shared connection in one go.
struct Batch {
    /// Whole commands, as the session wrote them.
    bytes: Bytes,
    /// Replies they get (blank lines and `*0` get none).
    replies: u64,
    /// Where the replies go.
    inbox: Arc<Inbox>,
    /// The session's first batch with replies (it may bring a connection
    /// attempt forward, as a new dedicated session connects at once).
    first: bool,
}

/// What the pool's connections and the sessions' moves share.
struct Common {
    primary: Arc<Primary>,
    connector: Connector,
    connect_timeout: Duration,
    reconnect_interval: Duration,
    master_name: String,
    read_chunk: usize,
    reply_limit: usize,
    /// `proxy.shared_reply_stall_ms`.
    reply_stall: Duration,
    /// `upstream.lock_reply_timeout_ms` (`None`: no bound).
    lock_reply_timeout: Option<Duration>,
    metrics: Arc<UpstreamConnMetrics>,
    warn: RateLimit,
    /// Warm connections for sessions that move.
    spares: Spares,
    /// The `CLIENT PAUSE` in force, as far as this instance saw one.
    pause: PauseHint,
}

/// The end of the `CLIENT PAUSE` last seen going to Redis through this
/// instance (on any session's dedicated connection), so that every session
/// sending a command before it ends moves to a connection of its own
/// (`OwnReason::Paused`): Redis holds a paused client's commands on its
/// connection, and a shared connection's other clients would wait behind
/// them, reads too. A hint with bounded staleness: it lasts at most the
/// pause's own timeout, `CLIENT UNPAUSE` seen here ends it, and a pause
/// it misses (sent straight to Redis, or by `FAILOVER`) only holds the
/// shared connections' commands until it ends, as it holds any client's.
/// How much sooner than the pause itself the pause hint ends, in ms.
const PAUSE_MARGIN_MS: u64 = 2;

#[derive(Debug)]
struct PauseHint {
    /// The clock's zero.
    epoch: Instant,
    /// When the pause ends, in ms since `epoch`; 0: no pause.
    until_ms: AtomicU64,
}

impl PauseHint {
    fn new() -> PauseHint {
        PauseHint {
            epoch: Instant::now(),
            until_ms: AtomicU64::new(0),
        }
    }

    /// Never 0 (which stands for no pause).
    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .saturating_add(1)
    }

    /// Follows a pause or unpause on its way to Redis. Redis keeps the
    /// later end of two pauses, and so does the hint. It ends
    /// [`PAUSE_MARGIN_MS`] before the pause would from now: Redis starts
    /// its own clock later (when the command arrives) but rounds it to the
    /// millisecond, and the hint must not outlast the pause.
    fn saw(&self, pause: Pause) {
        match pause {
            Pause::For(ms) => {
                let until = self
                    .now_ms()
                    .saturating_add(ms.saturating_sub(PAUSE_MARGIN_MS));
                self.until_ms.fetch_max(until, Ordering::Relaxed);
            }
            Pause::Lifted => self.until_ms.store(0, Ordering::Relaxed),
        }
    }

    /// Whether a pause seen here is in force now.
    fn in_force(&self) -> bool {
        let until = self.until_ms.load(Ordering::Relaxed);
        // Read the clock only while a pause was seen.
        until != 0 && crate::command::connection::paused(until, self.now_ms())
    }
}

impl Common {
    /// A connection to the primary `current`; a shared one is named
    /// [`SHARED_NAME`] (a refusal of the name, e.g. before `AUTH` on a
    /// Redis with a password, is no failure).
    async fn open(&self, current: &Current, shared: bool) -> Result<Stream, UpstreamError> {
        let Some(addr) = &current.addr else {
            return Err(UpstreamError::NoPrimary {
                master: self.master_name.clone(),
            });
        };
        let mut stream = self.connector.connect(addr, self.connect_timeout).await?;
        if shared {
            let setname = encode::command(&[b"CLIENT", b"SETNAME", SHARED_NAME.as_bytes()]);
            crate::upstream::node::open::request(&mut stream, &setname, self.connect_timeout)
                .await
                .map_err(|reason| UpstreamError::Io {
                    addr: addr.to_string(),
                    reason,
                })?;
        }
        Ok(stream)
    }

    #[cfg(test)]
    fn for_tests() -> Common {
        let config = Config::default();
        let tls = Arc::new(crate::tls::TlsStore::new(&config));
        Common {
            primary: Primary::fixed("127.0.0.1:1"),
            connector: Connector::new(tls, crate::tls::Side::Upstream),
            connect_timeout: Duration::from_millis(100),
            reconnect_interval: Duration::from_millis(100),
            master_name: String::new(),
            read_chunk: 4096,
            reply_limit: 1 << 20,
            reply_stall: Duration::from_millis(100),
            lock_reply_timeout: None,
            metrics: Arc::default(),
            warn: RateLimit::new(Duration::from_secs(10)),
            spares: Spares::new(0),
            pause: PauseHint::new(),
        }
    }
}

/// The shared connections to the primary, and the way sessions get a
/// [`SharedStream`] on one of them.
pub struct SharedPool {
    common: Arc<Common>,
    lanes: Vec<mpsc::Sender<Batch>>,
    next: AtomicUsize,
}

impl std::fmt::Debug for SharedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedPool")
            .field("lanes", &self.lanes.len())
            .finish()
    }
}

impl SharedPool {
    /// Starts `proxy.shared_upstream_connections` connection tasks to the
    /// primary in force (following it through Sentinel), and the task
    /// keeping `proxy.shared_spare_connections` spares, each stopping
    /// with `stop`. Must run inside a Tokio runtime.
    pub fn start(
        config: &Config,
        connector: Connector,
        primary: Arc<Primary>,
        metrics: Arc<UpstreamConnMetrics>,
        stop: &CancellationToken,
    ) -> Arc<SharedPool> {
        let common = Arc::new(Common {
            primary,
            connector,
            connect_timeout: Duration::from_millis(config.upstream.connect_timeout_ms),
            reconnect_interval: Duration::from_millis(config.upstream.reconnect_interval_ms),
            master_name: config.upstream.sentinel.master_name.clone(),
            read_chunk: config.proxy.read_chunk_bytes,
            reply_limit: usize::try_from(config.proxy.shared_session_reply_bytes)
                .unwrap_or(usize::MAX),
            reply_stall: Duration::from_millis(config.proxy.shared_reply_stall_ms),
            lock_reply_timeout: config.upstream.lock_reply_timeout(),
            metrics,
            warn: RateLimit::new(Duration::from_secs(10)),
            spares: Spares::new(config.proxy.shared_spare_connections),
            pause: PauseHint::new(),
        });
        if config.proxy.shared_spare_connections > 0 {
            tokio::spawn(spare::run(common.clone(), stop.clone()));
        }
        let lanes = (0..config.proxy.shared_upstream_connections)
            .map(|_| {
                let (tx, rx) = mpsc::channel(config.proxy.shared_upstream_queue_batches);
                tokio::spawn(lane::run(common.clone(), rx, stop.clone()));
                tx
            })
            .collect();
        Arc::new(SharedPool {
            common,
            lanes,
            next: AtomicUsize::new(0),
        })
    }

    /// A stream for one new session, on the next shared connection in turn.
    pub fn session(&self) -> SharedStream {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.lanes.len();
        SharedStream::new(self.common.clone(), PollSender::new(self.lanes[i].clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pause_hint_keeps_the_later_end_and_an_unpause_ends_it() {
        let hint = PauseHint::new();
        assert!(!hint.in_force(), "none seen");
        hint.saw(Pause::For(60_000));
        assert!(hint.in_force());
        // A shorter pause after a longer one: Redis keeps the longer.
        hint.saw(Pause::For(0));
        assert!(hint.in_force());
        hint.saw(Pause::Lifted);
        assert!(!hint.in_force());
        // A pause of 0 ms is over at once.
        hint.saw(Pause::For(0));
        assert!(!hint.in_force());
    }

    #[test]
    fn pauses_are_spotted_in_what_a_moved_session_writes() {
        let common = Common::for_tests();
        let mut parser = stream::framing_parser();
        let mut bytes = encode::command(&[b"SET", b"k", b"pause"]).to_vec();
        stream::observe_pauses(&common, &mut parser, &bytes);
        assert!(!common.pause.in_force(), "a value that spells pause");
        bytes.extend_from_slice(&encode::command(&[b"client", b"Pause", b"60000", b"WRITE"]));
        stream::observe_pauses(&common, &mut parser, &bytes);
        assert!(common.pause.in_force(), "after another command");
        stream::observe_pauses(&common, &mut parser, b"CLIENT UNPAUSE\r\n");
        assert!(!common.pause.in_force(), "inline");
    }
}
