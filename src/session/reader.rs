//! The client → Redis half of a session: read client bytes, find each
//! command, route it, tell the writer half what to expect, and forward the
//! client's own bytes in one write per read batch.

use std::sync::{Arc, Mutex};

use super::activity::{Activity, IdleCheck};
use super::branches::{Stop, Stopped};
use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::dispatch::Dispatch;
use super::jobs::Jobs;
use super::pending::{Entries, Pending};
use super::SessionError;
use crate::context::ServerContext;
use crate::lock::lease::{ConnLocks, Hurry};
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;
use crate::tls::ReadPart;
use crate::upstream::stream::SessionWrite;

/// How long the rest of a pipeline waits for its first command's reply
/// when the client's FIN was already in at the session's first read.
///
/// A client accepted from the listen queue after it closed (the issue's
/// burst: 8 clients in a loop, each pipelining 200 `GET`s of a 200 kB
/// value and closing, left hundreds queued behind a busy Redis) would cost
/// Redis its whole pipeline for replies nobody reads. So its first command
/// goes alone; once the reply is written, a reset of the socket (on
/// loopback in by the time the write returns) says it is gone, and the
/// rest is never sent. A client that only half-closed and still reads
/// gets every reply, its first one a round trip ahead of the rest; past
/// this bound (a first command that answers nothing, `CLIENT REPLY OFF`,
/// or a slow one) the rest goes on as any pipeline does.
pub const FIRST_REPLY: std::time::Duration = std::time::Duration::from_millis(100);

/// How the reader half ended.
#[derive(Debug)]
pub enum ReaderEnd {
    /// The client closed its side.
    Eof,
    /// Shutdown or the writer half ended first.
    Cancelled,
    /// A malformed request was answered and the connection is to close.
    Protocol,
    /// Nothing passed either way for `proxy.client_idle_timeout_ms`.
    Idle,
    /// A request was not complete within `proxy.partial_request_timeout_ms`.
    PartialRequest,
    /// The client's connection was reset, or reading it failed (also after
    /// its half-close): no reply can reach it any more, so the writer half
    /// stops at once instead of waiting for the replies owed.
    Gone,
    /// Writing Redis failed.
    Failed(SessionError),
}

/// What the reader half shares with the rest of its session.
pub struct Links<'a> {
    /// Entries for the writer half.
    pub tx: mpsc::Sender<Entries>,
    /// The connection's lock records.
    pub conn: &'a Arc<Mutex<ConnLocks>>,
    /// Where deferred work goes.
    pub jobs: Jobs,
    /// Stops the reader (shutdown, or the writer half ended); polled from
    /// the reader's own branch only (see `session::branches::Stop`).
    pub stop: &'a Stop,
    /// What the writer half did last, for the idle timeout.
    pub activity: &'a Activity,
}

/// What woke the reader while it waited for client bytes.
enum Wake {
    Read(std::io::Result<usize>),
    Timer,
}

/// The reader's two client timers: idle (`proxy.client_idle_timeout_ms`)
/// and an incomplete request (`proxy.partial_request_timeout_ms`).
struct Timers {
    idle: Option<std::time::Duration>,
    partial: Option<std::time::Duration>,
    last_read: Instant,
    /// When to look at the idle state next.
    idle_at: Option<Instant>,
    /// When the first byte of the incomplete request in the buffer came.
    partial_since: Option<Instant>,
}

impl Timers {
    fn new(ctx: &ServerContext) -> Timers {
        let now = Instant::now();
        let idle = ctx.config.proxy.idle_timeout();
        Timers {
            idle,
            partial: ctx.config.proxy.partial_request_timeout(),
            last_read: now,
            idle_at: idle.map(|d| now + d),
            partial_since: None,
        }
    }

    /// Client bytes came. Only the idle timer needs the time of every
    /// read; without it no clock is read here (the hot path).
    fn read(&mut self) {
        if let Some(idle) = self.idle {
            self.last_read = Instant::now();
            self.idle_at = Some(self.last_read + idle);
        }
    }

    fn partial_deadline(&self) -> Option<Instant> {
        Some(self.partial_since? + self.partial?)
    }

    fn next(&self) -> Option<Instant> {
        match (self.idle_at, self.partial_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// Reads, routes and forwards client commands until the client closes, the
/// session is cancelled, or a request is malformed. `buf` may already hold
/// bytes read before the upstream connection existed.
pub async fn read_loop(
    ctx: &Arc<ServerContext>,
    buf: &mut BytesMut,
    client: &mut ReadPart<'_>,
    upstream: &mut SessionWrite<'_>,
    links: Links<'_>,
) -> ReaderEnd {
    let Links {
        tx,
        conn,
        jobs,
        stop,
        activity,
    } = links;
    let mut dispatch = Dispatch::new(ctx.clone(), conn.clone(), jobs.clone());
    dispatch.keep_frames(upstream.wants_frames());
    let mut r = Reader {
        ctx,
        client,
        upstream,
        tx,
        conn,
        activity,
        hurry: crate::sync::lock(conn).hurry.clone(),
        // A plain load at every await (see `Stop`): a cancellation token's
        // wait took two locks per poll, about four polls per read batch.
        cancelled: stop.stopped(),
        timers: Timers::new(ctx),
        chunk: ctx.config.proxy.read_chunk_bytes,
    };
    // Until the session's first batch is routed (see `probe`).
    let mut fresh = true;
    loop {
        if buf.is_empty() || buf.len() < dispatch.needed() {
            match r.fill(buf, &dispatch).await {
                Fill::Ready => {}
                Fill::More => continue,
                Fill::End(end) => return end,
            }
        }
        // More from the client: what of its own waits in front of it (an
        // attempt parked, a smoothed reply) is answered now, so it holds
        // up no other caller's command (pooled and multiplexed
        // connections). Before routing: an attempt this batch parks waits
        // for what comes after it.
        r.hurry_up();
        let probe = std::mem::take(&mut fresh) && r.client.read_closed();
        if probe {
            dispatch.one_at_a_time(true);
            r.activity.first_alone(true);
            r.activity.watch_write();
        }
        let routed = dispatch.batch(buf);
        let (batch, failed) = (routed.batch, routed.failed);
        if routed.used > 0 {
            r.timers.partial_since = None;
        }
        let forward = routed.pieces.assemble(buf.split_to(routed.used).freeze());
        if !routed.frames.is_empty() {
            r.upstream.frames(routed.frames);
        }
        if let Some(end) = r.pass_on(batch.entries, forward).await {
            return end;
        }
        if failed {
            return ReaderEnd::Protocol;
        }
        if probe {
            dispatch.one_at_a_time(false);
            if let Some(end) = r.first_reply().await {
                return end;
            }
            r.activity.first_alone(false);
        }
        if let Some(hold) = routed.hold {
            if let Some(end) = r.until_done(hold, buf).await {
                return end;
            }
        }
    }
}

/// What the reader's loop works with between batches.
struct Reader<'s, 'c, 'u> {
    ctx: &'s Arc<ServerContext>,
    client: &'s mut ReadPart<'c>,
    upstream: &'s mut SessionWrite<'u>,
    tx: mpsc::Sender<Entries>,
    conn: &'s Arc<Mutex<ConnLocks>>,
    activity: &'s Activity,
    hurry: Arc<Hurry>,
    cancelled: Stopped<'s>,
    timers: Timers,
    chunk: usize,
}

/// What [`Reader::fill`] found.
enum Fill {
    /// Enough bytes for the dispatcher.
    Ready,
    /// Not yet (a timer moved on, or a request is still incomplete).
    More,
    /// The reader ends.
    End(ReaderEnd),
}

impl Reader<'_, '_, '_> {
    /// A command that came answers the connection's own waits in front of
    /// it (see `read_loop`).
    fn hurry_up(&self) {
        if self.hurry.take() {
            self.ctx.locks.hurry(self.conn);
        }
    }

    /// Waits for client bytes (or a client timer) while `buf` holds less
    /// than the dispatcher needs.
    async fn fill(&mut self, buf: &mut BytesMut, dispatch: &Dispatch) -> Fill {
        // Bytes left over are the start of a request still incomplete: its
        // clock starts when the reader first waits for the rest (lockgate's
        // own waits since the read do not count against it).
        if buf.is_empty() {
            self.timers.partial_since = None;
        } else if self.timers.partial_since.is_none() && self.timers.partial.is_some() {
            self.timers.partial_since = Some(Instant::now());
        }
        let want = dispatch.needed().saturating_sub(buf.len()).max(self.chunk);
        buf.reserve(want);
        let timer = self.timers.next();
        // The read goes first: a read that is ready ends the select before
        // the stop check. A stop is still seen within tokio's cooperative
        // budget: after 128 ready reads in one poll the read yields Pending
        // once. The client timers come last: bytes that are there win over
        // a deadline.
        let wake = tokio::select! {
            biased;
            read = self.client.read_buf(buf) => Wake::Read(read),
            _ = &mut self.cancelled => return Fill::End(ReaderEnd::Cancelled),
            // In a block, so the timer is made only when one is set.
            _ = async {
                if let Some(at) = timer {
                    tokio::time::sleep_until(at).await;
                }
            }, if timer.is_some() => Wake::Timer,
        };
        let read = match wake {
            Wake::Read(read) => read,
            Wake::Timer => {
                let (ctx, activity, tx) = (self.ctx, self.activity, &self.tx);
                return match expired(ctx, &mut self.timers, activity, tx, dispatch.raw()).await {
                    Some(end) => Fill::End(end),
                    None => Fill::More,
                };
            }
        };
        match read {
            Ok(0) => return Fill::End(self.half_closed().await),
            Ok(n) => {
                self.timers.read();
                ProxyMetrics::add(&self.ctx.metrics.client_bytes_in, n as u64);
            }
            Err(e) => {
                tracing::debug!(error = %e, "reading the client failed");
                self.activity.client_gone();
                return Fill::End(ReaderEnd::Gone);
            }
        }
        match buf.len() < dispatch.needed() {
            true => Fill::More,
            false => Fill::Ready,
        }
    }

    /// The client's FIN came.
    async fn half_closed(&mut self) -> ReaderEnd {
        // Pass the half-close on: Redis answers what it has read, frees the
        // connection (unblocking a BLPOP without popping, as if the client
        // had gone), and closes. Not before the replies owed ahead of a
        // blocking command are in: Redis drops what it has not sent yet
        // when it sees the close.
        let eof = smallvec::smallvec![Pending::ClientEof];
        if self.tx.send(eof).await.is_err() {
            return ReaderEnd::Cancelled;
        }
        // Cancelled meanwhile (shutdown, or the writer ended): the close
        // goes on at once, as it did before this wait, or the writer would
        // wait for Redis's close until the grace period ran out. A FIN
        // alone may be a half-close of a client that still reads, so the
        // replies owed are still written; a reset after it says the client
        // is gone, and the session ends now (Redis may be slow to answer,
        // and until it does the writer has nothing to write that could
        // fail).
        let waited = tokio::select! {
            biased;
            _ = &mut self.cancelled => ReaderEnd::Cancelled,
            () = self.activity.until_close_may_pass() => ReaderEnd::Eof,
            () = self.client.reset() => ReaderEnd::Gone,
        };
        if let ReaderEnd::Gone = waited {
            tracing::debug!("client reset after its half-close");
            self.activity.client_gone();
            return waited;
        }
        let _ = self.upstream.shutdown().await;
        waited
    }

    /// Tells the writer half what to expect of a routed batch, then
    /// forwards the client's own bytes of it in one write.
    async fn pass_on(&mut self, entries: Entries, forward: bytes::Bytes) -> Option<ReaderEnd> {
        if !entries.is_empty() {
            // The channel almost always has room: try without building the
            // waiting future first.
            let sent = match self.tx.try_send(entries) {
                Ok(()) => Ok(()),
                Err(mpsc::error::TrySendError::Closed(_)) => return Some(ReaderEnd::Cancelled),
                Err(mpsc::error::TrySendError::Full(entries)) => {
                    let sent = tokio::select! {
                        biased;
                        _ = &mut self.cancelled => return Some(ReaderEnd::Cancelled),
                        sent = self.tx.send(entries) => sent,
                    };
                    // The writer ran meanwhile and may have parked a failed
                    // attempt before these entries reached it: they are
                    // behind it. (This batch parks nothing itself: an
                    // attempt parks at routing only on a connection with
                    // nothing else on its way, and then the channel is
                    // not full.)
                    self.hurry_up();
                    sent
                }
            };
            if sent.is_err() {
                return Some(ReaderEnd::Cancelled);
            }
        }
        if !forward.is_empty() {
            let upstream = &mut *self.upstream;
            let written = tokio::select! {
                biased;
                _ = &mut self.cancelled => return Some(ReaderEnd::Cancelled),
                written = async {
                    upstream.write_all(&forward).await?;
                    upstream.flush().await
                } => written,
            };
            if let Err(e) = written {
                return Some(ReaderEnd::Failed(SessionError::UpstreamIo(e)));
            }
        }
        None
    }

    /// The session's first batch went alone (see [`FIRST_REPLY`]): waits
    /// for its reply to be written, and says whether the client is gone.
    async fn first_reply(&mut self) -> Option<ReaderEnd> {
        let gone = tokio::select! {
            biased;
            _ = &mut self.cancelled => return Some(ReaderEnd::Cancelled),
            () = self.client.reset() => true,
            () = self.activity.until_written() => self.client.failed_now(),
            () = tokio::time::sleep(FIRST_REPLY) => false,
        };
        if !gone {
            return None;
        }
        // Counted where the session ends (also when the writer found it
        // gone first, ending the session before this).
        tracing::debug!("client gone before its pipeline was sent");
        self.activity.client_gone();
        Some(ReaderEnd::Gone)
    }

    /// Work lockgate does itself ends the batch: what follows it waits
    /// until it is done (or the session ends). A legacy attempt may wait
    /// for a handoff in it (the quorum's, or a server's without scripts):
    /// while nothing else was read behind it, a read is watched for too,
    /// and what comes answers that attempt at once.
    async fn until_done(
        &mut self,
        mut hold: oneshot::Receiver<()>,
        buf: &mut BytesMut,
    ) -> Option<ReaderEnd> {
        if buf.is_empty() {
            buf.reserve(self.chunk);
            let read = tokio::select! {
                biased;
                _ = &mut self.cancelled => return Some(ReaderEnd::Cancelled),
                _ = &mut hold => return None,
                read = self.client.read_buf(buf) => read,
            };
            match read {
                Ok(n) if n > 0 => {
                    self.timers.read();
                    ProxyMetrics::add(&self.ctx.metrics.client_bytes_in, n as u64);
                    self.hurry_up();
                }
                // Its end is seen by the next read, once the work is done,
                // as it would have been.
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!(error = %e, "reading the client failed");
                    self.activity.client_gone();
                    return Some(ReaderEnd::Gone);
                }
            }
        }
        tokio::select! {
            biased;
            _ = &mut self.cancelled => Some(ReaderEnd::Cancelled),
            _ = hold => None,
        }
    }
}

/// A client timer fired: the reader's end if the client is to be closed
/// (counted), or `None` to carry on (the idle timer moved on).
async fn expired(
    ctx: &ServerContext,
    timers: &mut Timers,
    activity: &Activity,
    tx: &mpsc::Sender<Entries>,
    raw: bool,
) -> Option<ReaderEnd> {
    let now = Instant::now();
    if let (Some(at), Some(limit)) = (timers.partial_deadline(), timers.partial) {
        if now >= at {
            ProxyMetrics::inc(&ctx.metrics.clients_closed_partial_request);
            tracing::debug!(
                limit_ms = limit.as_millis() as u64,
                "request not completed in time; closing"
            );
            // Unlike Redis, which waits for ever: say why, then close. On a
            // connection whose replies are not counted (MONITOR) the error
            // could land among replies still on their way: just close.
            let mut entries = Entries::new();
            if !raw {
                entries.push(Pending::Local(LocalReply::err(format!(
                    "Protocol error: request not completed within {} ms",
                    limit.as_millis()
                ))));
            }
            entries.push(Pending::Close);
            let _ = tx.send(entries).await;
            return Some(ReaderEnd::PartialRequest);
        }
    }
    if let (Some(at), Some(idle)) = (timers.idle_at, timers.idle) {
        if now >= at {
            match activity.check(now, timers.last_read, idle) {
                IdleCheck::Close => {
                    // As Redis: closed without a word.
                    ProxyMetrics::inc(&ctx.metrics.clients_closed_idle);
                    tracing::debug!(idle_ms = idle.as_millis() as u64, "client idle; closing");
                    return Some(ReaderEnd::Idle);
                }
                IdleCheck::Until(next) => timers.idle_at = Some(next),
            }
        }
    }
    None
}
