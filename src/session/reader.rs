//! The client → Redis half of a session: read client bytes, find each
//! command, route it, tell the writer half what to expect, and forward the
//! client's own bytes in one write per read batch.

use std::sync::{Arc, Mutex};

use super::activity::{Activity, IdleCheck};
use super::branches::Stop;
use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::dispatch::Dispatch;
use super::jobs::Jobs;
use super::pending::{Entries, Pending};
use super::SessionError;
use crate::context::ServerContext;
use crate::lock::lease::ConnLocks;
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
    let jobs = &jobs;
    let chunk = ctx.config.proxy.read_chunk_bytes;
    let mut dispatch = Dispatch::new(ctx.clone(), conn.clone(), jobs.clone());
    let hurry = crate::sync::lock(conn).hurry.clone();
    // A plain load at every await (see `Stop`): a cancellation token's wait
    // took two locks per poll, about four polls per read batch.
    let mut cancelled = stop.stopped();
    let mut timers = Timers::new(ctx);
    // Until the session's first batch is routed (see `probe`).
    let mut fresh = true;
    loop {
        if buf.is_empty() || buf.len() < dispatch.needed() {
            // Bytes left over are the start of a request still incomplete:
            // its clock starts when the reader first waits for the rest
            // (lockgate's own waits since the read do not count against it).
            if buf.is_empty() {
                timers.partial_since = None;
            } else if timers.partial_since.is_none() && timers.partial.is_some() {
                timers.partial_since = Some(Instant::now());
            }
            let want = dispatch.needed().saturating_sub(buf.len()).max(chunk);
            buf.reserve(want);
            let timer = timers.next();
            // The read goes first: a read that is ready ends the select
            // before the stop check. A stop is still seen within tokio's
            // cooperative budget: after 128 ready reads in one poll the
            // read yields Pending once. The client timers come last: bytes
            // that are there win over a deadline.
            let wake = tokio::select! {
                biased;
                read = client.read_buf(buf) => Wake::Read(read),
                _ = &mut cancelled => return ReaderEnd::Cancelled,
                // In a block, so the timer is made only when one is set.
                _ = async {
                    if let Some(at) = timer {
                        tokio::time::sleep_until(at).await;
                    }
                }, if timer.is_some() => Wake::Timer,
            };
            let read = match wake {
                Wake::Read(read) => read,
                Wake::Timer => match expired(ctx, &mut timers, activity, &tx, dispatch.raw()).await
                {
                    Some(end) => return end,
                    None => continue,
                },
            };
            match read {
                Ok(0) => {
                    // Pass the half-close on: Redis answers what it has read,
                    // frees the connection (unblocking a BLPOP without popping,
                    // as if the client had gone), and closes. Not before the
                    // replies owed ahead of a blocking command are in: Redis
                    // drops what it has not sent yet when it sees the close.
                    if tx
                        .send(smallvec::smallvec![Pending::ClientEof])
                        .await
                        .is_err()
                    {
                        return ReaderEnd::Cancelled;
                    }
                    // Cancelled meanwhile (shutdown, or the writer ended):
                    // the close goes on at once, as it did before this
                    // wait, or the writer would wait for Redis's close
                    // until the grace period ran out. A FIN alone may be a
                    // half-close of a client that still reads, so the
                    // replies owed are still written; a reset after it
                    // says the client is gone, and the session ends now
                    // (Redis may be slow to answer, and until it does the
                    // writer has nothing to write that could fail).
                    let waited = tokio::select! {
                        biased;
                        _ = &mut cancelled => ReaderEnd::Cancelled,
                        () = activity.until_close_may_pass() => ReaderEnd::Eof,
                        () = client.reset() => ReaderEnd::Gone,
                    };
                    if let ReaderEnd::Gone = waited {
                        tracing::debug!("client reset after its half-close");
                        activity.client_gone();
                        return waited;
                    }
                    let _ = upstream.shutdown().await;
                    return waited;
                }
                Ok(n) => {
                    timers.read();
                    ProxyMetrics::add(&ctx.metrics.client_bytes_in, n as u64);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "reading the client failed");
                    activity.client_gone();
                    return ReaderEnd::Gone;
                }
            }
            if buf.len() < dispatch.needed() {
                continue;
            }
        }
        // More from the client: what of its own waits in front of it (an
        // attempt parked, a smoothed reply) is answered now, so it holds
        // up no other caller's command (pooled and multiplexed
        // connections). Before routing: an attempt this batch parks waits
        // for what comes after it.
        if hurry.take() {
            ctx.locks.hurry(conn);
        }
        let probe = std::mem::take(&mut fresh) && client.read_closed();
        if probe {
            dispatch.one_at_a_time(true);
            activity.first_alone(true);
            activity.watch_write();
        }
        let routed = dispatch.batch(buf);
        let (batch, failed) = (routed.batch, routed.failed);
        if routed.used > 0 {
            timers.partial_since = None;
        }
        let forward = routed.pieces.assemble(buf.split_to(routed.used).freeze());
        let routed = routed.hold;
        if !batch.entries.is_empty() {
            // The channel almost always has room: try without building the
            // waiting future first.
            let sent = match tx.try_send(batch.entries) {
                Ok(()) => Ok(()),
                Err(mpsc::error::TrySendError::Closed(_)) => return ReaderEnd::Cancelled,
                Err(mpsc::error::TrySendError::Full(entries)) => {
                    let sent = tokio::select! {
                        biased;
                        _ = &mut cancelled => return ReaderEnd::Cancelled,
                        sent = tx.send(entries) => sent,
                    };
                    // The writer ran meanwhile and may have parked a failed
                    // attempt before these entries reached it: they are
                    // behind it. (This batch parks nothing itself: an
                    // attempt parks at routing only on a connection with
                    // nothing else on its way, and then the channel is
                    // not full.)
                    if hurry.take() {
                        ctx.locks.hurry(conn);
                    }
                    sent
                }
            };
            if sent.is_err() {
                return ReaderEnd::Cancelled;
            }
        }
        if !forward.is_empty() {
            let written = tokio::select! {
                biased;
                _ = &mut cancelled => return ReaderEnd::Cancelled,
                written = async {
                    upstream.write_all(&forward).await?;
                    upstream.flush().await
                } => written,
            };
            if let Err(e) = written {
                return ReaderEnd::Failed(SessionError::UpstreamIo(e));
            }
        }
        if failed {
            return ReaderEnd::Protocol;
        }
        if probe {
            dispatch.one_at_a_time(false);
            let gone = tokio::select! {
                biased;
                _ = &mut cancelled => return ReaderEnd::Cancelled,
                () = client.reset() => true,
                () = activity.until_written() => client.failed_now(),
                () = tokio::time::sleep(FIRST_REPLY) => false,
            };
            if gone {
                // Counted where the session ends (also when the writer
                // found it gone first, ending the session before this).
                tracing::debug!("client gone before its pipeline was sent");
                activity.client_gone();
                return ReaderEnd::Gone;
            }
            activity.first_alone(false);
        }
        if let Some(mut hold) = routed {
            // Work lockgate does itself ends the batch: what follows it
            // waits until it is done (or the session ends). A legacy
            // attempt may wait for a handoff in it (the quorum's, or a
            // server's without scripts): while nothing else was read
            // behind it, a read is watched for too, and what comes
            // answers that attempt at once.
            if buf.is_empty() {
                buf.reserve(chunk);
                let read = tokio::select! {
                    biased;
                    _ = &mut cancelled => return ReaderEnd::Cancelled,
                    _ = &mut hold => None,
                    read = client.read_buf(buf) => Some(read),
                };
                match read {
                    None => continue,
                    Some(Ok(n)) if n > 0 => {
                        timers.read();
                        ProxyMetrics::add(&ctx.metrics.client_bytes_in, n as u64);
                        if hurry.take() {
                            ctx.locks.hurry(conn);
                        }
                    }
                    // Its end is seen by the next read, once the work is
                    // done, as it would have been.
                    Some(Ok(_)) => {}
                    Some(Err(e)) => {
                        tracing::debug!(error = %e, "reading the client failed");
                        activity.client_gone();
                        return ReaderEnd::Gone;
                    }
                }
            }
            tokio::select! {
                biased;
                _ = &mut cancelled => return ReaderEnd::Cancelled,
                _ = hold => {}
            }
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
