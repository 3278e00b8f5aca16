//! The Redis → client half of a session: copy Redis's replies to the client
//! as they come, counting top-level frames so that lockgate's own replies
//! (entries from the reader half) land exactly between the right two.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::pending::Pending;
use super::SessionError;
use crate::context::ServerContext;
use crate::lock::lease::ConnLocks;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;
use crate::protocol::reply::{FrameEnd, FrameKind, ReplyScanner};
use crate::sync;
use crate::tls::stream::{ReadPart, WritePart};

/// How the writer half ended.
#[derive(Debug)]
pub enum WriterEnd {
    /// The reader ended and every owed reply was written.
    Drained,
    /// A `Close` entry was reached (after a protocol error).
    Closed,
    /// Redis closed the connection; `owed` tells whether replies were missing.
    UpstreamClosed {
        /// Replies were still owed to the client.
        owed: bool,
    },
    /// The reader ended but owed replies did not come within the grace period.
    DrainTimeout,
    /// Writing the client or reading Redis failed.
    Failed(SessionError),
}

/// The writer half's state: the entries not yet settled and the stream mode.
struct Replies {
    queue: VecDeque<Pending>,
    scanner: ReplyScanner,
    resp3: bool,
    raw: bool,
    out: BytesMut,
    /// The lock-script (or barrier) reply being collected, if one is.
    capture: Option<Vec<u8>>,
    /// The client half-closed and Redis was told: end at the upstream's EOF.
    await_eof: bool,
    /// A deferred reply is awaited: later frames stay in the buffer.
    blocked: bool,
    /// The deferred reply at the front, once everything before it is out.
    deferred: Option<tokio::sync::oneshot::Receiver<LocalReply>>,
    /// The deferred reply is for a command whose reply the client
    /// suppressed: awaited, then dropped.
    deferred_silent: bool,
    /// Subscriptions in force: channels, patterns, shard channels, as the
    /// confirmations Redis sent so far count them.
    subs: [u64; 3],
    /// What the frame being scanned is, as its first element tells.
    frame: FrameClass,
}

/// What a top-level frame is, when the session must look inside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FrameClass {
    /// Anything else: a reply, or a push as the scanner reports it.
    Other,
    /// A published message (`message`, `pmessage`, `smessage`): not a reply
    /// to any command, in RESP2 as in RESP3.
    Message,
    /// A subscription confirmation, for the `Sub` entry at the front.
    Confirm,
}

/// What the first element of the frame at the front of a buffer says.
enum Peek<'a> {
    /// Not enough bytes yet.
    More,
    /// An array or push whose first element is this bulk string.
    Name(&'a [u8]),
    /// Anything else.
    Other,
}

/// Reads the first element of an array (`*`) or push (`>`) frame, if it
/// is a short bulk string (the longest name looked for has 12 bytes).
fn peek_name(buf: &[u8]) -> Peek<'_> {
    let line = |from: usize| -> Option<usize> {
        let window = buf.get(from..)?;
        memchr::memchr(b'\n', &window[..window.len().min(24)]).map(|nl| from + nl + 1)
    };
    match buf.first() {
        None => return Peek::More,
        Some(b'*' | b'>') => {}
        Some(_) => return Peek::Other,
    }
    let Some(after_header) = line(0) else {
        return if buf.len() < 24 {
            Peek::More
        } else {
            Peek::Other
        };
    };
    match buf.get(after_header) {
        None => return Peek::More,
        Some(b'$') => {}
        Some(_) => return Peek::Other,
    }
    let Some(after_len) = line(after_header) else {
        return if buf.len() < after_header + 24 {
            Peek::More
        } else {
            Peek::Other
        };
    };
    let digits = &buf[after_header + 1..after_len.saturating_sub(2).max(after_header + 1)];
    let Some(n) = crate::protocol::request::parse_int(digits).filter(|n| (0..=12).contains(n))
    else {
        return Peek::Other;
    };
    match buf.get(after_len..after_len + n as usize) {
        Some(name) => Peek::Name(name),
        None => Peek::More,
    }
}

/// The subscription count a confirmation ends with (`…:N\r\n`).
fn confirmation_count(frame: &[u8]) -> Option<u64> {
    let body = frame.strip_suffix(b"\r\n")?;
    let at = memchr::memmem::rfind(body, b"\r\n:")?;
    crate::protocol::request::parse_int(&body[at + 3..]).and_then(|n| u64::try_from(n).ok())
}

/// Copies replies to the client until the session is over (see [`WriterEnd`]).
pub async fn write_loop(
    ctx: &Arc<ServerContext>,
    client: &mut WritePart<'_>,
    upstream: &mut ReadPart<'_>,
    mut rx: mpsc::Receiver<Vec<Pending>>,
    conn: &Arc<Mutex<ConnLocks>>,
) -> WriterEnd {
    let chunk = ctx.config.proxy.read_chunk_bytes;
    let grace = Duration::from_millis(ctx.config.proxy.shutdown_grace_ms);
    let mut st = Replies {
        queue: VecDeque::new(),
        scanner: ReplyScanner::new(),
        resp3: false,
        raw: false,
        out: BytesMut::new(),
        capture: None,
        await_eof: false,
        blocked: false,
        deferred: None,
        deferred_silent: false,
        subs: [0; 3],
        frame: FrameClass::Other,
    };
    let mut buf = BytesMut::with_capacity(chunk);
    let mut reader_done = false;
    let mut deadline = Instant::now();
    loop {
        // Nothing after a deferred reply may be written before it.
        let closing = st.deferred.is_none() && st.settle();
        if let Err(e) = flush_out(ctx, client, &mut st.out).await {
            return WriterEnd::Failed(e);
        }
        if closing {
            return WriterEnd::Closed;
        }
        if st.deferred.is_none()
            && st.scanner.at_boundary()
            && st.capture.is_none()
            && matches!(
                st.queue.front(),
                Some(Pending::Deferred(_) | Pending::Silent(_))
            )
        {
            match st.queue.pop_front() {
                Some(Pending::Deferred(d)) => {
                    st.deferred = Some(d.0);
                    st.deferred_silent = false;
                }
                Some(Pending::Silent(d)) => {
                    st.deferred = Some(d.0);
                    st.deferred_silent = true;
                }
                _ => {}
            }
        }
        st.blocked = st.deferred.is_some();
        if reader_done
            && st.deferred.is_none()
            && !st.await_eof
            && st.queue.is_empty()
            && st.scanner.at_boundary()
            && st.capture.is_none()
        {
            return WriterEnd::Drained;
        }
        if buf.capacity() - buf.len() < chunk / 4 {
            buf.reserve(chunk);
        }
        // While a deferred reply is awaited, later replies wait in `buf`;
        // stop reading Redis once that holds a few chunks (back-pressure).
        let read_upstream = !st.blocked || buf.len() < chunk * 4;
        tokio::select! {
            biased;
            ready = async { st.deferred.as_mut()?.await.ok() }, if st.deferred.is_some() => {
                st.deferred = None;
                st.blocked = false;
                if !std::mem::take(&mut st.deferred_silent) {
                    ready
                        .unwrap_or_else(|| LocalReply::err("lockgate: internal error (reply lost)"))
                        .encode(st.resp3, &mut st.out);
                }
                // Replies of lockgate's own right behind it go next, before
                // any buffered reply from Redis is matched.
                if st.settle() {
                    return match flush_out(ctx, client, &mut st.out).await {
                        Ok(()) => WriterEnd::Closed,
                        Err(e) => WriterEnd::Failed(e),
                    };
                }
                if st.queue.front().is_some_and(|p| matches!(p, Pending::Deferred(_) | Pending::Silent(_))) {
                    continue;
                }
                if !buf.is_empty() {
                    match forward(ctx, client, &mut buf, &mut st, &mut rx, conn).await {
                        Ok(true) => return WriterEnd::Closed,
                        Ok(false) => {}
                        Err(e) => return WriterEnd::Failed(e),
                    }
                }
            }
            msg = rx.recv(), if !reader_done => match msg {
                Some(entries) => st.accept(entries),
                None => {
                    reader_done = true;
                    deadline = Instant::now() + grace;
                }
            },
            read = upstream.read_buf(&mut buf), if read_upstream => match read {
                Ok(0) => {
                    while let Ok(entries) = rx.try_recv() {
                        st.accept(entries);
                    }
                    if st.await_eof {
                        return WriterEnd::Drained;
                    }
                    let owed = st.raw || st.queue.iter().any(|p| !matches!(p, Pending::Local(_)));
                    return WriterEnd::UpstreamClosed { owed };
                }
                Ok(_) => match forward(ctx, client, &mut buf, &mut st, &mut rx, conn).await {
                    Ok(true) => return WriterEnd::Closed,
                    Ok(false) => {}
                    Err(e) => return WriterEnd::Failed(e),
                },
                Err(e) => return WriterEnd::Failed(SessionError::UpstreamIo(e)),
            },
            _ = tokio::time::sleep_until(deadline), if reader_done => {
                ProxyMetrics::inc(&ctx.metrics.drain_timeouts);
                return WriterEnd::DrainTimeout;
            }
        }
    }
}

impl Replies {
    /// Takes a batch of entries from the reader half.
    fn accept(&mut self, entries: Vec<Pending>) {
        for entry in entries {
            if entry == Pending::ClientEof {
                self.await_eof = true;
            } else {
                self.queue.push_back(entry);
            }
        }
    }

    /// True when the next frame must be collected rather than forwarded: a
    /// lock script's `{reply, facts}`, or anything while a barrier `RESET`
    /// is awaited.
    fn captures_next(&self) -> bool {
        match self.queue.front() {
            Some(Pending::Lock(_)) => !self.raw,
            Some(Pending::Barrier | Pending::Swallow | Pending::Feed(_)) => true,
            _ => false,
        }
    }

    /// The frame after a reply that is followed by a local entry: push
    /// frames already buffered belong before lockgate's reply, as Redis sent
    /// them before it read the next command. Returns the bytes they take.
    fn pushes_ahead(&self, buf: &[u8]) -> usize {
        let mut scanner = self.scanner.clone();
        let mut pos = 0;
        while let Ok((used, Some(end))) = scanner.advance(&buf[pos..]) {
            if end.kind == FrameKind::Reply {
                break;
            }
            pos += used;
        }
        pos
    }
    /// Handles the entries at the front that need no bytes from Redis:
    /// renders local replies into `out`, switches to raw mode. Returns true
    /// when a `Close` entry is reached.
    fn settle(&mut self) -> bool {
        // Mid-frame (while replies are not counted), nothing of lockgate's
        // may be written into Redis's bytes.
        if !self.scanner.at_boundary() {
            return false;
        }
        loop {
            match self.queue.front() {
                Some(Pending::Local(reply)) => {
                    reply.encode(self.resp3, &mut self.out);
                }
                Some(Pending::EnterRaw) => self.raw = true,
                Some(Pending::Upstream(0)) => {}
                Some(Pending::Close) => return true,
                _ => return false,
            }
            self.queue.pop_front();
        }
    }

    /// Attributes one finished reply frame to the entry it answers.
    fn attribute(&mut self, ctx: &ServerContext, end: &FrameEnd) {
        if self.raw {
            if self.queue.front() == Some(&Pending::Reset) && end.is(b"+RESET\r\n") {
                self.queue.pop_front();
                self.raw = false;
                self.resp3 = false;
                self.subs = [0; 3];
            }
            return;
        }
        match self.queue.front_mut() {
            Some(Pending::Upstream(n)) => {
                *n -= 1;
                if *n > 0 {
                    return;
                }
            }
            Some(Pending::Hello) => match end.type_byte {
                b'%' => self.resp3 = true,
                b'*' => self.resp3 = false,
                _ => {}
            },
            Some(Pending::Reset) => {
                self.resp3 = false;
                self.subs = [0; 3];
            }
            Some(Pending::Lock(_)) => {
                // Only in raw mode is a lock reply not captured; pass it on.
            }
            Some(Pending::Sub { .. }) => {
                // Not a confirmation (those are captured): an error, which
                // answers the whole command.
            }
            _ => {
                // A reply nobody asked for: pass it on, count it, keep going.
                ProxyMetrics::inc(&ctx.metrics.unexpected_replies);
                return;
            }
        }
        self.queue.pop_front();
    }

    /// True when the front entry is written by lockgate, not Redis.
    fn front_is_local(&self) -> bool {
        matches!(
            self.queue.front(),
            Some(
                Pending::Local(_)
                    | Pending::EnterRaw
                    | Pending::Close
                    | Pending::Deferred(_)
                    | Pending::Silent(_)
            )
        )
    }

    /// True when the next frame's first element must be read: it may be a
    /// confirmation for the `Sub` entry at the front, or (RESP2, while
    /// subscribed) a published message, which is no reply.
    fn peeks(&self) -> bool {
        matches!(self.queue.front(), Some(Pending::Sub { .. }))
            || (!self.resp3 && self.subs.iter().any(|&n| n > 0))
    }

    /// Classifies the frame starting `buf`; `None` until enough of it is in.
    fn classify(&self, buf: &[u8]) -> Option<FrameClass> {
        let name = match peek_name(buf) {
            Peek::More => return None,
            Peek::Other => return Some(FrameClass::Other),
            Peek::Name(name) => name,
        };
        if matches!(name, b"message" | b"pmessage" | b"smessage")
            && (buf[0] == b'>' || self.subs.iter().any(|&n| n > 0))
        {
            return Some(FrameClass::Message);
        }
        let confirms = match self.queue.front() {
            Some(Pending::Sub { kind, .. }) => kind.confirmation() == name,
            _ => false,
        };
        Some(if confirms {
            FrameClass::Confirm
        } else {
            FrameClass::Other
        })
    }

    /// A confirmation for the `Sub` entry at the front: counts it and the
    /// subscriptions it reports, and settles the entry once all came.
    fn confirmed(&mut self, frame: &[u8]) {
        let Some(Pending::Sub { kind, args, left }) = self.queue.front_mut() else {
            return;
        };
        let (kind, set) = (*kind, kind.set());
        let owed = left.get_or_insert_with(|| match *args {
            0 => self.subs[set].max(1),
            n => u64::from(n),
        });
        *owed = owed.saturating_sub(1);
        let done = *owed == 0;
        if let Some(count) = confirmation_count(frame) {
            if set == 2 {
                self.subs[2] = count;
            } else {
                // The count is channels and patterns together: the change
                // tells whether this one was new (or gone).
                let total = self.subs[0] + self.subs[1];
                if kind.adds() && count > total {
                    self.subs[set] += count - total;
                } else if !kind.adds() && count < total {
                    self.subs[set] = self.subs[set].saturating_sub(total - count);
                }
            }
        }
        if done {
            self.queue.pop_front();
        }
    }
}

/// Forwards the complete frames in `buf` (and any partial bulk payload),
/// interleaving local replies where they belong and unwrapping lock-script
/// replies. Returns true when a `Close` entry was reached.
async fn forward(
    ctx: &Arc<ServerContext>,
    client: &mut WritePart<'_>,
    buf: &mut BytesMut,
    st: &mut Replies,
    rx: &mut mpsc::Receiver<Vec<Pending>>,
    conn: &Arc<Mutex<ConnLocks>>,
) -> Result<bool, SessionError> {
    let mut pos = 0;
    // Local replies rendered before the first frame (a deferred reply that
    // just became ready) go first.
    flush_out(ctx, client, &mut st.out).await?;
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
            }
            st.frame = FrameClass::Other;
            if !st.raw && st.peeks() {
                match st.classify(&buf[pos..]) {
                    Some(class) => st.frame = class,
                    None => break,
                }
            }
            if st.frame == FrameClass::Confirm || st.captures_next() {
                write_client(ctx, client, &buf[..pos]).await?;
                buf.advance(pos);
                pos = 0;
                st.capture = Some(Vec::new());
            }
        }
        let (used, end) = match st.scanner.advance(&buf[pos..]) {
            Ok(step) => step,
            Err(e) => {
                ProxyMetrics::inc(&ctx.metrics.upstream_bad_replies);
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
                if let Some(Pending::Lock(pending)) = st.queue.pop_front() {
                    let (reply, facts) = match pending {
                        // A client script's reply is the client's, whole.
                        crate::lock::LockPending::Script { .. } => (&captured[..], Vec::new()),
                        _ => crate::lock::split_reply(&captured),
                    };
                    let park = super::parking::after_failure(&pending, &facts);
                    let handed = ctx.locks.complete(pending, &facts, &mut sync::lock(conn));
                    // The release gave the lock to a parked attempt of
                    // another connection: settled with this one unlocked.
                    if let Some(handed) = handed {
                        ctx.locks.finish_handoff(handed);
                    }
                    match park.and_then(|p| super::parking::park(ctx, p, conn)) {
                        // A failed attempt waits for a handoff instead.
                        Some(rx) => {
                            st.deferred = Some(rx);
                            st.blocked = true;
                        }
                        None => st.out.extend_from_slice(reply),
                    }
                }
            } else {
                // A push frame ahead of the lock reply: pass it on as is.
                st.out.extend_from_slice(&captured);
            }
            let closing = st.deferred.is_none() && st.settle();
            flush_out(ctx, client, &mut st.out).await?;
            if closing {
                return Ok(true);
            }
            continue;
        }
        if end.kind != FrameKind::Reply || st.frame == FrameClass::Message {
            continue;
        }
        st.attribute(ctx, &end);
        if st.front_is_local() {
            let ahead = pos + st.pushes_ahead(&buf[pos..]);
            while pos < ahead {
                match st.scanner.advance(&buf[pos..ahead]) {
                    Ok((used, _)) if used > 0 => pos += used,
                    _ => break,
                }
            }
            write_client(ctx, client, &buf[..pos]).await?;
            buf.advance(pos);
            pos = 0;
            let closing = st.settle();
            flush_out(ctx, client, &mut st.out).await?;
            if closing {
                return Ok(true);
            }
        }
    }
    if pos > 0 {
        write_client(ctx, client, &buf[..pos]).await?;
        buf.advance(pos);
    }
    Ok(false)
}

async fn flush_out(
    ctx: &ServerContext,
    client: &mut WritePart<'_>,
    out: &mut BytesMut,
) -> Result<(), SessionError> {
    if out.is_empty() {
        return Ok(());
    }
    write_client(ctx, client, out).await?;
    out.clear();
    Ok(())
}

async fn write_client(
    ctx: &ServerContext,
    client: &mut WritePart<'_>,
    bytes: &[u8],
) -> Result<(), SessionError> {
    client
        .write_all(bytes)
        .await
        .map_err(SessionError::ClientIo)?;
    client.flush().await.map_err(SessionError::ClientIo)?;
    ProxyMetrics::add(&ctx.metrics.client_bytes_out, bytes.len() as u64);
    Ok(())
}
