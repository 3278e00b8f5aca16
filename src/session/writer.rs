//! The Redis → client half of a session: copy Redis's replies to the client
//! as they come, counting top-level frames so that lockgate's own replies
//! (entries from the reader half) land exactly between the right two.
//!
//! The loop is generic over its streams (plain TCP, TLS, or an in-memory
//! pipe in the tests) and knows nothing of the lock room: a lock script's
//! reply goes to a [`LockReplies`], which says what to write. The
//! bookkeeping without I/O is in `replies`.

mod client;
mod replies;
#[cfg(test)]
mod tests;

use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::activity::Activity;
use super::opening::Opening;
use super::pending::{Entries, Pending};
use super::SessionError;
use crate::lock::evalsha::Rerun;
use crate::lock::{LockPending, ReplyOutcome};
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;
use crate::protocol::reply::{simple_frames, FrameEnd, FrameKind};
use crate::upstream::stall::Watch;
use client::Client;
use replies::{FrameClass, Replies};

/// How the writer half ended.
#[derive(Debug)]
pub enum WriterEnd {
    /// The reader ended and every owed reply was written.
    Drained,
    /// A `Close` entry was reached (after a protocol error).
    Closed,
    /// Redis sent nothing for `upstream.lock_reply_timeout_ms` while a lock
    /// command's reply was owed (a blackholed path, a hung server): the
    /// session ends, as when Redis drops the connection with replies owed.
    LockReplyTimeout,
    /// Redis closed the connection; `owed` tells whether replies were missing.
    UpstreamClosed {
        /// Replies were still owed to the client.
        owed: bool,
    },
    /// The reader found the client gone (its connection reset) while
    /// replies were still owed: they are dropped, nothing can reach it
    /// (the outcome of a lock command on its way is still read, within
    /// the grace period).
    ClientGone,
    /// The reader ended but owed replies did not come within the grace period.
    DrainTimeout,
    /// Writing the client or reading Redis failed.
    Failed(SessionError),
}

/// Where the writer hands a lock script's reply (a [`Pending::Lock`]
/// entry's): the lock room learns the outcome and says what the client
/// gets. The session's implementation is [`crate::lock::LockService::on_reply`]
/// for its connection; tests give a fake, so the writer runs without one.
pub trait LockReplies {
    /// The outcome of `frame`, Redis's whole reply to the script planned
    /// for `pending` (`rerun`: how to run it again if Redis lost it).
    /// `behind`: the client has sent more since, waiting behind this reply
    /// (a failed attempt must not be parked in front of it).
    fn on_reply(
        &self,
        pending: LockPending,
        rerun: Option<Rerun>,
        frame: Bytes,
        behind: bool,
    ) -> ReplyOutcome;
}

/// What the writer half works with besides its streams and entries.
pub struct Setup<'a, L> {
    /// Bytes read from Redis at a time (`proxy.read_chunk_bytes`).
    pub chunk: usize,
    /// How long owed replies may take once the reader ended
    /// (`proxy.shutdown_grace_ms`).
    pub grace: Duration,
    /// The proxy's counters (bytes out, unexpected replies, …).
    pub metrics: &'a ProxyMetrics,
    /// Where lock scripts' replies go.
    pub locks: &'a L,
    /// Where the writer records its writes and whether the client is exempt
    /// from the idle timeout.
    pub activity: &'a Activity,
    /// A write to the client making no progress this long ends the session
    /// (`proxy.client_write_timeout_ms`); `None`: no limit.
    pub write_timeout: Option<Duration>,
    /// Most bytes of replies read ahead from Redis while a write to the
    /// client waits (`proxy.max_client_output_bytes`); 0: none.
    pub max_output: usize,
    /// The session's permit of `upstream.max_connecting`, given back at
    /// Redis's first bytes or its bound ([`super::opening`]).
    pub opening: Option<Opening>,
    /// How long Redis may send nothing while a lock command's reply is
    /// owed before the session ends (`upstream.lock_reply_timeout_ms`;
    /// twice that on shared and cluster connections, whose lanes answer in
    /// place at the bound, see `crate::upstream::stall`); `None`: no bound.
    pub lock_reply_timeout: Option<Duration>,
}

/// Copies replies to the client until the session is over (see [`WriterEnd`]).
/// Generic over the streams, so plain TCP pays no indirection.
pub async fn write_loop<W, R, L>(
    setup: Setup<'_, L>,
    client: &mut W,
    upstream: &mut R,
    mut rx: mpsc::Receiver<Entries>,
) -> WriterEnd
where
    W: AsyncWrite + Unpin,
    R: AsyncRead + Unpin,
    L: LockReplies,
{
    let (chunk, metrics, activity) = (setup.chunk, setup.metrics, setup.activity);
    let mut opening = setup.opening;
    let client = &mut Client {
        stream: client,
        upstream,
        metrics,
        locks: setup.locks,
        activity,
        write_timeout: setup.write_timeout,
        max_output: setup.max_output,
        ahead: BytesMut::new(),
        upstream_end: None,
        discard: false,
    };
    let mut st = Replies::new();
    let mut buf = BytesMut::with_capacity(chunk);
    let mut run = Run {
        reader_done: false,
        upstream_eof: false,
        gone: false,
        deadline: Instant::now(),
    };
    // Bytes read from Redis: the stall watch's progress.
    let mut read_bytes = 0u64;
    let mut stall = setup.lock_reply_timeout.map(Stall::new);
    loop {
        // Nothing after a deferred reply may be written before it.
        let closing = st.deferred.is_none() && st.settle();
        if let Err(e) = client.flush_out(&mut st.out).await {
            return WriterEnd::Failed(e);
        }
        if closing {
            return WriterEnd::Closed;
        }
        st.start_deferred();
        if let Some(end) = run.end(&st, activity) {
            return end;
        }
        if buf.capacity() - buf.len() < chunk / 4 {
            buf.reserve(chunk);
        }
        // While a deferred reply is awaited, later replies wait in `buf`;
        // stop reading Redis once that holds a few chunks (back-pressure).
        let read_upstream = !run.upstream_eof && (!st.blocked || buf.len() < chunk * 4);
        // Replies read ahead while a write waited come before anything
        // Redis sends now, and so does the end of Redis's side seen then.
        let before = buf.len();
        if read_upstream && client.take_ahead(&mut buf) {
            // Redis's bytes too, read while a write to the client waited:
            // progress for the stall watch.
            read_bytes += buf.len().saturating_sub(before) as u64;
            if let Some(end) = forward_or_end(client, &mut buf, &mut st, &mut rx).await {
                return end;
            }
            continue;
        }
        if read_upstream {
            match client.upstream_end.take() {
                Some(Ok(())) => match upstream_closed(&mut st, &mut rx, &mut run.upstream_eof) {
                    Some(end) => return end,
                    None => continue,
                },
                Some(Err(e)) => return WriterEnd::Failed(SessionError::UpstreamIo(e)),
                None => {}
            }
        }
        let release_at = opening.as_ref().map(|o| o.release_at(st.owes_upstream()));
        let watching = (stall.as_mut()).is_some_and(|s| s.watching(!st.queue.is_empty()));
        let (reader_done, deadline) = (run.reader_done, run.deadline);
        // Each branch is the loop's last statement: falling out of one is
        // going round again.
        tokio::select! {
            biased;
            ready = async { st.deferred.as_mut()?.await.ok() }, if st.deferred.is_some() => {
                if let Some(end) = deferred_done(client, &mut buf, &mut st, &mut rx, ready).await {
                    return end;
                }
            }
            msg = rx.recv(), if !reader_done => match msg {
                Some(entries) => st.accept(entries),
                None => {
                    if let Some(end) = run.reader_ended(&st, activity, setup.grace) {
                        return end;
                    }
                    if run.gone {
                        client.discard = true;
                    }
                }
            },
            read = client.upstream.read_buf(&mut buf), if read_upstream => {
                // Redis answered (or closed): the connection left its
                // listen queue.
                opening = None;
                match read {
                    Ok(0) => {
                        if let Some(end) = upstream_closed(&mut st, &mut rx, &mut run.upstream_eof) {
                            return end;
                        }
                    }
                    Ok(n) => {
                        read_bytes += n as u64;
                        if let Some(end) = forward_or_end(client, &mut buf, &mut st, &mut rx).await {
                            return end;
                        }
                    }
                    Err(e) => return WriterEnd::Failed(SessionError::UpstreamIo(e)),
                }
            }
            _ = async {
                if let Some(s) = &mut stall {
                    s.tick.tick().await;
                }
            }, if watching => {
                let owed = st.awaits_lock_reply();
                if stall.as_mut().is_some_and(|s| s.stalled(read_bytes, owed)) {
                    ProxyMetrics::inc(&metrics.lock_reply_timeouts);
                    return WriterEnd::LockReplyTimeout;
                }
            }
            // The permit's bound, or nothing owed: given back (looked at
            // again if a reply became owed meanwhile).
            _ = async { tokio::time::sleep_until(release_at.unwrap_or(deadline)).await }, if release_at.is_some() => {
                if opening.as_ref().is_some_and(|o| o.release_at(st.owes_upstream()) <= Instant::now()) {
                    opening = None;
                }
            }
            // In a block, so the timer is made only once it is polled: a
            // disabled branch's expression is still evaluated, and making a
            // Sleep looks up the runtime, on every reply.
            _ = async { tokio::time::sleep_until(deadline).await }, if reader_done => {
                ProxyMetrics::inc(&metrics.drain_timeouts);
                return match run.gone {
                    true => WriterEnd::ClientGone,
                    false => WriterEnd::DrainTimeout,
                };
            }
        }
    }
}

/// The stall watch (see [`Setup::lock_reply_timeout`]): the bytes read
/// from Redis, looked at every quarter of the bound while replies are
/// owed, armed afresh each time they start to be.
struct Stall {
    limit: Duration,
    tick: tokio::time::Interval,
    armed: Option<Watch>,
}

impl Stall {
    fn new(limit: Duration) -> Stall {
        let mut tick = tokio::time::interval(crate::upstream::stall::look_every(limit));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Stall {
            limit,
            tick,
            armed: None,
        }
    }

    /// Whether to look at all: only while replies are owed (`owed_any`);
    /// with none, disarmed.
    fn watching(&mut self, owed_any: bool) -> bool {
        if !owed_any {
            self.armed = None;
        }
        owed_any
    }

    /// One look: Redis sent nothing (`read_bytes` did not move) for the
    /// bound while a lock command's reply was owed (`owed`).
    fn stalled(&mut self, read_bytes: u64, owed: bool) -> bool {
        let now = std::time::Instant::now();
        let watch = self.armed.get_or_insert_with(|| Watch::new(now));
        watch.step(now, read_bytes, owed, self.limit)
    }
}

/// Where the writer's loop stands besides its replies.
struct Run {
    /// The reader half ended (every entry it sent is in).
    reader_done: bool,
    /// Redis closed after a client's half-close: what it sent is all there
    /// is, but replies lockgate makes itself may still be owed before it.
    upstream_eof: bool,
    /// The client is gone, and the writer reads on, writing nothing, only
    /// for the outcome of a lock command.
    gone: bool,
    /// Once the reader ended: until when owed replies may come.
    deadline: Instant,
}

impl Run {
    /// Whether the loop ends now; also tells `activity` whether the client
    /// is exempt from the idle timeout and whether its close may pass.
    fn end(&self, st: &Replies, activity: &Activity) -> Option<WriterEnd> {
        if self.upstream_eof && st.deferred.is_none() {
            return Some(WriterEnd::Drained);
        }
        // Waiting for a reply (a blocking command), subscribed or in
        // MONITOR: never idle, as on Redis.
        activity.set_exempt(
            st.raw
                || st.subs != [0; 3]
                || st.deferred.is_some()
                || !st.queue.is_empty()
                || !st.scanner.at_boundary(),
        );
        if st.await_eof && !st.owes_upstream() {
            activity.close_may_pass();
        }
        if self.gone && !st.owes_lock_outcome() {
            return Some(WriterEnd::ClientGone);
        }
        if self.reader_done && !st.await_eof && !st.owes_client() {
            return Some(WriterEnd::Drained);
        }
        None
    }

    /// The reader half ended: owed replies have `grace` from now, and a
    /// client found gone is owed nothing but a lock command's outcome.
    fn reader_ended(
        &mut self,
        st: &Replies,
        activity: &Activity,
        grace: Duration,
    ) -> Option<WriterEnd> {
        self.reader_done = true;
        self.deadline = Instant::now() + grace;
        // The reader sets the flag before it ends, and every entry it sent
        // is in by now.
        if activity.is_client_gone() {
            if !st.owes_client() {
                return Some(WriterEnd::Drained);
            }
            // A lock command's outcome on its way is still read (it
            // decides what is released at the close, with
            // `release_on_disconnect`); nothing else is waited for.
            if !st.owes_lock_outcome() {
                return Some(WriterEnd::ClientGone);
            }
            self.gone = true;
        }
        None
    }
}

/// The deferred reply at the front came (`None`: its sender was dropped):
/// written, then lockgate's own replies right behind it, then what of
/// Redis's waited in `buf`.
async fn deferred_done<W, R, L>(
    client: &mut Client<'_, '_, W, R, L>,
    buf: &mut BytesMut,
    st: &mut Replies,
    rx: &mut mpsc::Receiver<Entries>,
    ready: Option<LocalReply>,
) -> Option<WriterEnd>
where
    W: AsyncWrite + Unpin,
    R: AsyncRead + Unpin,
    L: LockReplies,
{
    st.deferred = None;
    st.blocked = false;
    if !std::mem::take(&mut st.deferred_silent) {
        ready
            .unwrap_or_else(|| LocalReply::err("lockgate: internal error (reply lost)"))
            .encode(st.resp3, &mut st.out);
    }
    // Replies of lockgate's own right behind it go next, before any
    // buffered reply from Redis is matched.
    if st.settle() {
        return Some(match client.flush_out(&mut st.out).await {
            Ok(()) => WriterEnd::Closed,
            Err(e) => WriterEnd::Failed(e),
        });
    }
    let next_deferred =
        (st.queue.front()).is_some_and(|p| matches!(p, Pending::Deferred(_) | Pending::Silent(_)));
    if next_deferred || buf.is_empty() {
        return None;
    }
    forward_or_end(client, buf, st, rx).await
}

/// How the writer ends when Redis closed its side: `None` when the client
/// half-closed first and the loop goes on until no reply of its own is owed.
fn upstream_closed(
    st: &mut Replies,
    rx: &mut mpsc::Receiver<Entries>,
    upstream_eof: &mut bool,
) -> Option<WriterEnd> {
    while let Ok(entries) = rx.try_recv() {
        st.accept(entries);
    }
    if st.await_eof {
        // Replies buffered behind a reply of lockgate's own go out once it
        // is ready: the write loop ends when none is owed.
        *upstream_eof = true;
        return None;
    }
    let owed = st.raw || st.queue.iter().any(|p| !matches!(p, Pending::Local(_)));
    Some(WriterEnd::UpstreamClosed { owed })
}

/// Where a captured frame goes (`captured`, read whole while the front of
/// the queue needed it: a confirmation, a message, a reply set aside or
/// fed to lockgate, a `RESET`'s, a lock script's): into the client's
/// output, to the lock room, or nowhere.
fn place_captured<L: LockReplies>(
    locks: &L,
    st: &mut Replies,
    rx: &mut mpsc::Receiver<Entries>,
    captured: Vec<u8>,
    end: &FrameEnd,
) {
    let aside = matches!(st.queue.front(), Some(Pending::Swallow | Pending::Feed(_)));
    if st.frame == FrameClass::Confirm {
        st.confirmed(&captured);
        st.out.extend_from_slice(&captured);
    } else if st.frame == FrameClass::Message {
        // Published while a lock reply was awaited: the client's.
        st.out.extend_from_slice(&captured);
    } else if aside && end.kind == FrameKind::Reply {
        if let Some(Pending::Feed(feed)) = st.queue.pop_front() {
            let _ = feed.0.send(captured.into());
        }
    } else if aside {
        st.out.extend_from_slice(&captured);
    } else if st.queue.front() == Some(&Pending::Barrier) {
        if end.is(b"+RESET\r\n") {
            st.queue.pop_front();
            st.raw = false;
            st.resp3 = false;
            st.subs = [0; 3];
        } else {
            st.out.extend_from_slice(&captured);
        }
    } else if end.kind == FrameKind::Reply {
        if let Some(Pending::Lock(entry)) = st.queue.pop_front() {
            let (pending, rerun, freeing) = *entry;
            // Whatever the client sent since is behind this reply
            // (entries go to the writer before their commands go
            // upstream): a failed attempt must not wait in front
            // of it.
            while let Ok(entries) = rx.try_recv() {
                st.accept(entries);
            }
            let behind = !st.queue.is_empty();
            let outcome = locks.on_reply(pending, rerun, captured.into(), behind);
            // Learned: the connection's attempts may be answered
            // from the view again.
            drop(freeing);
            match outcome {
                // A failed attempt waits for a handoff instead, or
                // a lost script for its rerun.
                ReplyOutcome::Parked(rx) | ReplyOutcome::Rerun(rx) => {
                    st.deferred = Some(rx);
                    st.blocked = true;
                }
                ReplyOutcome::Reply(reply) => st.out.extend_from_slice(&reply),
                ReplyOutcome::Local(reply) => reply.encode(st.resp3, &mut st.out),
            }
        }
    } else {
        // A push frame ahead of the lock reply: pass it on as is.
        st.out.extend_from_slice(&captured);
    }
}

/// [`forward`], as the write loop's end if it ends there: `Closed` at a
/// `Close` entry, `Failed` on an error, `None` to go on.
async fn forward_or_end<W: AsyncWrite + Unpin, R: AsyncRead + Unpin, L: LockReplies>(
    client: &mut Client<'_, '_, W, R, L>,
    buf: &mut BytesMut,
    st: &mut Replies,
    rx: &mut mpsc::Receiver<Entries>,
) -> Option<WriterEnd> {
    match forward(client, buf, st, rx).await {
        Ok(true) => Some(WriterEnd::Closed),
        Ok(false) => None,
        Err(e) => Some(WriterEnd::Failed(e)),
    }
}

/// Forwards the complete frames in `buf` (and any partial bulk payload),
/// interleaving local replies where they belong and unwrapping lock-script
/// replies. Returns true when a `Close` entry was reached.
async fn forward<W: AsyncWrite + Unpin, R: AsyncRead + Unpin, L: LockReplies>(
    client: &mut Client<'_, '_, W, R, L>,
    buf: &mut BytesMut,
    st: &mut Replies,
    rx: &mut mpsc::Receiver<Entries>,
) -> Result<bool, SessionError> {
    let mut pos = 0;
    // Local replies rendered before the first frame (a deferred reply that
    // just became ready) go first.
    client.flush_out(&mut st.out).await?;
    loop {
        if st.scanner.at_boundary() && st.capture.is_none() {
            if st.blocked
                || matches!(
                    st.queue.front(),
                    Some(Pending::Deferred(_) | Pending::Silent(_))
                )
            {
                break;
            }
            if st.queue.is_empty() {
                // Entries are sent before their commands go upstream, so the
                // entry for the next reply is already in the channel.
                while let Ok(entries) = rx.try_recv() {
                    st.accept(entries);
                }
                // Taken only now (the replies were read ahead while the
                // client was slow), they may start with a reply of
                // lockgate's own, which goes before the next frame; one
                // still being worked out stops the pass at the loop's top.
                if st.front_is_local() {
                    if local_replies_next(client, buf, &mut pos, st).await? {
                        return Ok(true);
                    }
                    continue;
                }
            }
            // A run of plain replies (most of a pipeline's) is counted in
            // one pass: one-line replies and bulk strings are replies to
            // the entry at the front whatever else holds (a published
            // message or a confirmation is an array or a push).
            let run = st.plain_run();
            if run > 0 {
                let (used, frames) = simple_frames(&buf[pos..], run);
                if frames > 0 {
                    pos += used;
                    st.counted(frames);
                    continue;
                }
            }
            st.frame = FrameClass::Other;
            if !st.raw && st.peeks() {
                match st.classify(&buf[pos..]) {
                    Some(class) => st.frame = class,
                    None => break,
                }
            }
            if st.frame == FrameClass::Confirm || st.captures_next() {
                client.write(&buf[..pos]).await?;
                buf.advance(pos);
                pos = 0;
                st.capture = Some(Vec::new());
            }
        }
        let (used, end) = match st.scanner.advance(&buf[pos..]) {
            Ok(step) => step,
            Err(e) => {
                ProxyMetrics::inc(&client.metrics.upstream_bad_replies);
                return Err(SessionError::Protocol(e));
            }
        };
        if let Some(capture) = st.capture.as_mut() {
            capture.extend_from_slice(&buf[..used]);
            buf.advance(used);
        } else {
            pos += used;
        }
        let Some(end) = end else { break };
        if let Some(captured) = st.capture.take() {
            place_captured(client.locks, st, rx, captured, &end);
            let closing = st.deferred.is_none() && st.settle();
            client.flush_out(&mut st.out).await?;
            if closing {
                return Ok(true);
            }
            continue;
        }
        if end.kind != FrameKind::Reply || st.frame == FrameClass::Message {
            continue;
        }
        st.attribute(client.metrics, &end);
        if st.front_is_local() {
            let ahead = pos + st.pushes_ahead(&buf[pos..]);
            while pos < ahead {
                match st.scanner.advance(&buf[pos..ahead]) {
                    Ok((used, _)) if used > 0 => pos += used,
                    _ => break,
                }
            }
            if local_replies_next(client, buf, &mut pos, st).await? {
                return Ok(true);
            }
        }
    }
    if pos > 0 {
        client.write(&buf[..pos]).await?;
        buf.advance(pos);
    }
    Ok(false)
}

/// Writes the frames scanned so far (`buf[..pos]`), then lockgate's own
/// replies at the front of the queue, which come next in the order.
/// Returns true when a `Close` entry was reached.
async fn local_replies_next<W: AsyncWrite + Unpin, R: AsyncRead + Unpin, L: LockReplies>(
    client: &mut Client<'_, '_, W, R, L>,
    buf: &mut BytesMut,
    pos: &mut usize,
    st: &mut Replies,
) -> Result<bool, SessionError> {
    if *pos > 0 {
        client.write(&buf[..*pos]).await?;
        buf.advance(*pos);
        *pos = 0;
    }
    let closing = st.settle();
    client.flush_out(&mut st.out).await?;
    Ok(closing)
}
