//! One client connection: its own upstream connection to the primary (or,
//! with `proxy.upstream = "shared"`, a stream over a shared one that moves
//! to its own when a command needs it: `crate::upstream::shared`, used
//! through the same halves), and two halves joined in one task. The reader half ([`reader`]) reads client
//! bytes, has its dispatcher decide each command and forwards the client's
//! own bytes; the writer half ([`writer`]) copies Redis's replies back,
//! counting frames so lockgate's own replies land in command order. They
//! talk through a bounded channel of [`pending::Pending`] entries.
//!
//! While the primary cannot be reached, the session answers each command
//! `-ERR lockgate: upstream … unavailable (…)` and tries again at most every
//! `upstream.reconnect_interval_ms`; once connected, it carries on with
//! the commands not yet answered.
//!
//! # Layout
//!
//! - [`reader`]: reads client bytes, hands each read batch to the
//!   dispatcher and forwards what it returns; the idle and
//!   partial-request timeouts.
//! - `dispatch`: the session's dispatcher (parser, the router's view, the
//!   scripts its connection loaded, a quorum transaction's queue): asks the
//!   router once per command and carries the answer out, with the lock
//!   room's one call per lock command; tested with bytes, no sockets.
//! - `carry`: what one batch carries out (`Routed`: the pieces that go
//!   upstream, the writer's entries, work deferred in order);
//!   `quorum_transaction` and `quorum_split`: a transaction lockgate queued
//!   on the quorum, run at `EXEC`, and a command split between the quorum
//!   and the primary.
//! - [`writer`]: copies replies back in order and writes lockgate's own
//!   between them (generic over its streams, tested over in-memory pipes;
//!   `writer::replies` its bookkeeping without I/O, `writer::client` its
//!   writes to the client, bounded by `proxy.client_write_timeout_ms` and
//!   `proxy.max_client_output_bytes`); hands lock scripts' replies to the
//!   lock room through [`writer::LockReplies`].
//! - [`pending`]: what the two halves tell each other; [`jobs`]: a
//!   session's deferred work, run in command order.
//! - [`activity`]: what the writer last wrote, whether the client is
//!   exempt from idling, and the reader's word that the client is gone.
//! - `detached`: serves a client while the primary is unreachable;
//!   [`linger`]: closes a client after a protocol error without a reset.
//! - [`opening`]: the session's permit of `upstream.max_connecting`,
//!   held until its upstream connection answers (bounded in time).
//! - `branches`: a waker per part of the session (reader, writer, job
//!   runner, watchdog, primary watcher, shutdown), so its poll loop polls
//!   only the parts woken; the reader's stop flag.

pub mod activity;
pub(crate) mod branches;
mod carry;
mod detached;
mod dispatch;
pub mod jobs;
pub mod linger;
pub mod opening;
pub mod pending;
mod quorum_split;
mod quorum_transaction;
pub mod reader;
pub mod writer;

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::{pin, Pin};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use bytes::BytesMut;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::context::ServerContext;
use crate::error::ErrorSource;
use crate::lock::evalsha::Rerun;
use crate::lock::lease::ConnLocks;
use crate::lock::watchdog;
use crate::lock::{LockPending, ReplyOutcome};
use crate::metrics::ProxyMetrics;
use crate::protocol::ProtocolError;
use crate::tls::Stream;
use crate::upstream::shared::DedicatedGuard;
use reader::ReaderEnd;
use writer::WriterEnd;

/// Why a session failed.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// Reading from or writing to the client failed.
    #[error("client i/o: {0}")]
    ClientIo(io::Error),
    /// Reading from or writing to Redis failed.
    #[error("upstream i/o: {0}")]
    UpstreamIo(io::Error),
    /// Redis sent a malformed reply.
    #[error(transparent)]
    Protocol(ProtocolError),
    /// A write to the client made no progress for this many milliseconds
    /// (`proxy.client_write_timeout_ms`): the client does not read.
    #[error("client did not read its replies for {0} ms")]
    ClientWriteTimeout(u64),
    /// More than this many bytes of replies waited for a client that does
    /// not read fast enough (`proxy.max_client_output_bytes`).
    #[error("more than {0} bytes of replies waited for the client")]
    ClientOutputLimit(u64),
}

impl SessionError {
    /// Whose fault it is (labels the error metric).
    pub fn source_kind(&self) -> ErrorSource {
        match self {
            SessionError::ClientIo(_)
            | SessionError::ClientWriteTimeout(_)
            | SessionError::ClientOutputLimit(_) => ErrorSource::Client,
            SessionError::UpstreamIo(_) => ErrorSource::Upstream,
            SessionError::Protocol(e) => e.source_kind(),
        }
    }
}

/// What the accept loop hands a session.
#[derive(Debug)]
pub struct Start {
    /// The client's address.
    pub peer: SocketAddr,
    /// The connection's lock records, made when it was accepted.
    pub conn: ConnLocks,
    /// Its permit of `upstream.max_connecting` (`None`: no bound).
    pub opening: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// Serves one client until it or Redis closes, or shutdown drains it.
pub async fn run(
    ctx: Arc<ServerContext>,
    client: Stream,
    start: Start,
    shutdown: CancellationToken,
) {
    let span = tracing::info_span!("conn", peer = %start.peer);
    async move {
        tracing::debug!("client connected");
        serve(&ctx, client, start, &shutdown).await;
        tracing::debug!("client disconnected");
    }
    .instrument(span)
    .await
}

/// At the end of a session, on every path out of it (also when it is
/// dropped at shutdown): its connection's kept places in contention
/// queues go ([`crate::lock::LockService::connection_closed`]), and it is
/// no longer listed for operators.
struct LeaveQueues<'a> {
    ctx: &'a ServerContext,
    conn: &'a Mutex<ConnLocks>,
}

impl Drop for LeaveQueues<'_> {
    fn drop(&mut self) {
        self.ctx.locks.connection_closed(self.conn);
        let id = crate::sync::lock(self.conn).id;
        self.ctx.locks.conns.remove(id);
    }
}

/// The parts of a session's poll loop, by their index in its
/// [`branches::Branches`]: each has a waker of its own, and `woken` has
/// bit `1 << index` set for each part whose waker fired.
mod branch {
    /// The reader half.
    pub const READER: usize = 0;
    /// The writer half.
    pub const WRITER: usize = 1;
    /// The job runner.
    pub const RUNNER: usize = 2;
    /// The watchdog (renewals; its end closes the session).
    pub const WATCHDOG: usize = 3;
    /// The primary watcher (a Sentinel switch closes the session).
    pub const PRIMARY: usize = 4;
    /// Shutdown (sets the reader's stop flag).
    pub const SHUTDOWN: usize = 5;
    /// How many.
    pub const COUNT: usize = 6;

    /// The bit of branch `i` in `Branches::woken`.
    pub const fn bit(i: usize) -> u32 {
        1 << i
    }
}

async fn serve(
    ctx: &Arc<ServerContext>,
    mut client: Stream,
    start: Start,
    shutdown: &CancellationToken,
) {
    let Start {
        peer,
        conn,
        opening,
    } = start;
    let mut buf = BytesMut::with_capacity(ctx.config.proxy.read_chunk_bytes);
    // Held from the accept, through the connect, until the upstream
    // answers (`opening`).
    let bound = Duration::from_millis(ctx.config.upstream.connect_timeout_ms);
    let mut opening = opening.map(|permit| opening::Opening::new(permit, bound));
    let (mut upstream, generation) = match ctx.connect_upstream().await {
        Ok(stream) => stream,
        Err(err) => {
            // Not connected: nothing of Redis's listen queue is taken.
            opening = None;
            match detached::serve(ctx, &mut client, &mut buf, err, shutdown).await {
                Some(stream) => stream,
                None => return,
            }
        }
    };
    // Counted while it lives (a shared-mode stream counts its own when the
    // session moves to a dedicated connection).
    let own_connection = upstream.is_direct();
    let _dedicated = own_connection.then(|| DedicatedGuard::new(&ctx.upstream_conns));
    let (mut client_r, mut client_w) = client.split();
    let (mut up_r, mut up_w) = upstream.split();
    let (tx, rx) = mpsc::channel(ctx.config.proxy.max_inflight_batches);
    let conn = Arc::new(Mutex::new(conn));
    // Listed for operators (`LOCKGATE LOCKS`, `WAITERS`) while it lives.
    ctx.locks.conns.add(&conn, peer.to_string());
    let _leave = LeaveQueues { ctx, conn: &conn };
    // Made first: the reader's stop flag wakes the reader's branch.
    let branches = branches::Branches::new(branch::COUNT);
    let reader_stop = branches::Stop::new(branches.waker(branch::READER));
    let writer_done = CancellationToken::new();
    let (job_queue, runner) = jobs::queue(ctx.config.proxy.max_inflight_batches);
    let activity = activity::Activity::new();
    let reader = async {
        let links = reader::Links {
            tx,
            conn: &conn,
            jobs: job_queue,
            stop: &reader_stop,
            activity: &activity,
        };
        reader::read_loop(ctx, &mut buf, &mut client_r, &mut up_w, links).await
    };
    let writer = async {
        let locks = SessionLocks { ctx, conn: &conn };
        let setup = writer_setup(ctx, &locks, &activity, opening, own_connection);
        let end = writer::write_loop(setup, &mut client_w, &mut up_r, rx).await;
        reader_stop.stop();
        writer_done.cancel();
        end
    };
    let runner = runner.run(&writer_done);
    let watchdog = async {
        if ctx.locks.has_watchdog() {
            watchdog::run(&ctx.locks, &conn).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    let primary_changed = ctx.primary_addr.changed_from(generation);
    // Shutdown stops the reader through its flag (polled only when
    // shutdown fires).
    let shutdown_seen = shutdown.cancelled();
    // In a block, so the branches (and their borrows of the sockets) are
    // gone before the lingering close below.
    let ends = {
        let parts = Parts {
            reader: pin!(reader),
            writer: pin!(writer),
            runner: pin!(runner),
            watchdog: pin!(watchdog),
            primary_changed: pin!(primary_changed),
            shutdown_seen: pin!(shutdown_seen),
        };
        run_branches(ctx, &branches, &reader_stop, parts).await
    };
    let Some((read_end, write_end)) = ends else {
        return;
    };
    if ctx.locks.has_release_on_disconnect() {
        watchdog::release_on_disconnect(&ctx.locks, &conn).await;
    }
    if matches!(read_end, ReaderEnd::Protocol | ReaderEnd::PartialRequest) {
        linger::linger(&mut client_r, &mut client_w, shutdown).await;
    }
    account(ctx, &read_end, write_end, &activity);
}

/// A session's six branches (see [`branch`]), pinned where `serve` made
/// them.
struct Parts<'p, R, W, N, D, P, S> {
    reader: Pin<&'p mut R>,
    writer: Pin<&'p mut W>,
    runner: Pin<&'p mut N>,
    watchdog: Pin<&'p mut D>,
    primary_changed: Pin<&'p mut P>,
    shutdown_seen: Pin<&'p mut S>,
}

/// One poll loop over the six branches, each polled only when its own
/// waker fired (see `branches`): the reader, the writer and the job runner
/// all run to their end (`Some` of the halves' ends); the watchdog ending
/// (its lock lost) or the primary being replaced (Sentinel) closes the
/// session (`None`). After a failover the client reconnects, as after a
/// failover of a Redis it talked to directly (SELECT, subscriptions and
/// MULTI cannot silently move); shutdown sets the reader's stop flag.
async fn run_branches<R, W, N, D, P, S>(
    ctx: &ServerContext,
    branches: &branches::Branches,
    reader_stop: &branches::Stop,
    mut parts: Parts<'_, R, W, N, D, P, S>,
) -> Option<(ReaderEnd, WriterEnd)>
where
    R: Future<Output = ReaderEnd>,
    W: Future<Output = WriterEnd>,
    N: Future,
    D: Future,
    P: Future,
    S: Future,
{
    let (mut read_end, mut write_end, mut ran, mut stopping) = (None, None, false, false);
    std::future::poll_fn(|cx| {
        let woken = branches.woken(cx);
        let polled = |i: usize| woken & branch::bit(i) != 0;
        if polled(branch::SHUTDOWN)
            && !stopping
            && (parts.shutdown_seen.as_mut())
                .poll(&mut branches.context(branch::SHUTDOWN))
                .is_ready()
        {
            stopping = true;
            reader_stop.stop();
        }
        if polled(branch::READER) && read_end.is_none() {
            let cx = &mut branches.context(branch::READER);
            if let Poll::Ready(end) = parts.reader.as_mut().poll(cx) {
                read_end = Some(end);
            }
        }
        if polled(branch::WRITER) && write_end.is_none() {
            let cx = &mut branches.context(branch::WRITER);
            if let Poll::Ready(end) = parts.writer.as_mut().poll(cx) {
                write_end = Some(end);
            }
        }
        if polled(branch::RUNNER) && !ran {
            ran = (parts.runner.as_mut())
                .poll(&mut branches.context(branch::RUNNER))
                .is_ready();
        }
        if ran && read_end.is_some() && write_end.is_some() {
            return Poll::Ready(read_end.take().zip(write_end.take()));
        }
        if polled(branch::WATCHDOG)
            && (parts.watchdog.as_mut())
                .poll(&mut branches.context(branch::WATCHDOG))
                .is_ready()
        {
            return Poll::Ready(None);
        }
        if polled(branch::PRIMARY)
            && (parts.primary_changed.as_mut())
                .poll(&mut branches.context(branch::PRIMARY))
                .is_ready()
        {
            ProxyMetrics::inc(&ctx.primary_addr.metrics.sessions_closed);
            return Poll::Ready(None);
        }
        Poll::Pending
    })
    .await
}

/// What the writer half works with, from the configuration.
fn writer_setup<'a>(
    ctx: &'a ServerContext,
    locks: &'a SessionLocks<'a>,
    activity: &'a activity::Activity,
    opening: Option<opening::Opening>,
    own_connection: bool,
) -> writer::Setup<'a, SessionLocks<'a>> {
    let proxy = &ctx.config.proxy;
    writer::Setup {
        chunk: proxy.read_chunk_bytes,
        grace: Duration::from_millis(proxy.shutdown_grace_ms),
        metrics: &ctx.metrics,
        locks,
        activity,
        write_timeout: proxy.write_timeout(),
        max_output: proxy.max_client_output_bytes as usize,
        opening,
        // Twice the bound on shared and cluster connections, whose lanes
        // give a silent connection up at the bound itself and answer in
        // place: this is their sessions' backstop (a session moved to a
        // connection of its own, a lock command behind a command the lane
        // does not watch).
        lock_reply_timeout: (ctx.config.upstream.lock_reply_timeout()).map(|bound| {
            if own_connection {
                bound
            } else {
                bound * 2
            }
        }),
    }
}

/// Counts and logs how a session ended: the reader's and the writer's
/// ends, a client gone with replies owed, its first command's pipeline
/// never sent.
fn account(
    ctx: &ServerContext,
    read_end: &ReaderEnd,
    write_end: WriterEnd,
    activity: &activity::Activity,
) {
    match read_end {
        ReaderEnd::Failed(e) => {
            ctx.metrics.error(e.source_kind());
            tracing::debug!(error = %e, "reader ended");
        }
        ReaderEnd::Gone => ctx.metrics.error(ErrorSource::Client),
        _ => {}
    }
    // The client went while replies were owed (a reset seen by the reader,
    // or a write that failed): the session ends now, and with it the
    // upstream connection, so Redis frees the connection and what it holds
    // for it.
    let gone = matches!(
        write_end,
        WriterEnd::ClientGone | WriterEnd::Failed(SessionError::ClientIo(_))
    );
    if gone {
        ProxyMetrics::inc(&ctx.metrics.clients_gone);
        tracing::debug!("client gone with replies owed; session ended");
    }
    // Its first command went alone and the client was gone by its reply:
    // the rest of its pipeline never went to Redis.
    if (gone || matches!(read_end, ReaderEnd::Gone)) && activity.is_first_alone() {
        ProxyMetrics::inc(&ctx.metrics.clients_gone_unserved);
    }
    match write_end {
        WriterEnd::UpstreamClosed { owed: true } => {
            ProxyMetrics::inc(&ctx.metrics.upstream_dropped);
            ctx.metrics.error(ErrorSource::Upstream);
            if let Some(more) = ctx.upstream_warn.check() {
                tracing::warn!(
                    suppressed = more,
                    "upstream closed the connection with replies owed; closing the client"
                );
            }
        }
        WriterEnd::LockReplyTimeout => {
            ctx.metrics.error(ErrorSource::Upstream);
            if let Some(more) = ctx.upstream_warn.check() {
                tracing::warn!(
                    suppressed = more,
                    "upstream sent nothing while a lock command's reply was owed \
                     (upstream.lock_reply_timeout_ms); closing the client"
                );
            }
        }
        WriterEnd::Failed(e) => {
            ctx.metrics.error(e.source_kind());
            if e.source_kind() == ErrorSource::Upstream {
                if let Some(more) = ctx.upstream_warn.check() {
                    tracing::warn!(error = %e, suppressed = more, "upstream failed; closing the client");
                }
            } else {
                tracing::debug!(error = %e, "writer ended");
            }
        }
        _ => {}
    }
}

/// The lock room as one session's writer sees it: the outcome of a lock
/// script's reply, for this connection.
struct SessionLocks<'a> {
    ctx: &'a Arc<ServerContext>,
    conn: &'a Arc<Mutex<ConnLocks>>,
}

impl writer::LockReplies for SessionLocks<'_> {
    fn on_reply(
        &self,
        pending: LockPending,
        rerun: Option<Rerun>,
        frame: bytes::Bytes,
        behind: bool,
    ) -> ReplyOutcome {
        self.ctx
            .locks
            .outcome(pending, rerun, frame, self.conn, behind)
    }
}
