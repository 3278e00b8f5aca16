//! The stream a session gets in shared mode: written and read as its own
//! socket would be. The write side ([`SharedWrite`]) frames what it is
//! given (whole commands; the start of an unfinished one waits for the
//! rest; the commands the dispatcher framed already, handed on as
//! [`Frames`], are not parsed again), sends plain commands to the session's shared connection, and at
//! the first command that needs a connection of its own moves the session
//! to a dedicated one: it stops sending, waits until nothing is owed on
//! the shared connection (not at all when nothing is), takes a warm spare
//! connection ([`super::spare`]) or opens one, and passes everything
//! through it from then on. The read side ([`SharedRead`])
//! reads the session's replies from its inbox, then, once moved and the
//! inbox is empty, from the dedicated connection.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::{Buf, BytesMut};
use smallvec::SmallVec;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf, ReadHalf, WriteHalf};
use tokio_util::sync::PollSender;
use tokio_util::task::AbortOnDropHandle;

use super::inbox::{Inbox, Take};
use super::{Batch, Common, DedicatedGuard};
use crate::command::connection::{needs_own_connection, OwnReason};
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;
use crate::protocol::frames::Frames;
use crate::protocol::request::{RequestKind, RequestLimits, RequestParser};
use crate::tls::Stream;
use crate::upstream::UpstreamError;

/// Both halves of a session's stream in shared mode.
#[derive(Debug)]
pub struct SharedStream {
    /// Replies.
    pub read: SharedRead,
    /// Commands.
    pub write: SharedWrite,
}

impl SharedStream {
    pub(super) fn new(common: Arc<Common>, lane: PollSender<Batch>) -> SharedStream {
        let inbox = Arc::new(Inbox::new(common.reply_limit));
        SharedStream {
            read: SharedRead {
                inbox: inbox.clone(),
                dedicated: None,
            },
            write: SharedWrite {
                common,
                lane,
                inbox,
                pending: BytesMut::new(),
                parser: framing_parser(),
                scanned: 0,
                hints: Frames::default(),
                next: None,
                replies: 0,
                sent_shared: false,
                waiting_for_room: false,
                state: State::Shared,
                _dedicated: None,
            },
        }
    }
}

/// A parser that only frames commands: the session's bytes were read and
/// checked by its dispatcher (and lockgate's own frames are well formed),
/// so its limits are none (halved: the parser adds one to the inline
/// limit).
pub(crate) fn framing_parser() -> RequestParser {
    RequestParser::new(RequestLimits {
        max_bulk_bytes: u64::MAX / 2,
        max_multibulk_len: u64::MAX / 2,
        max_inline_bytes: usize::MAX / 2,
        max_request_bytes: u64::MAX / 2,
    })
}

/// The reading half: the session's replies, in order.
#[derive(Debug)]
pub struct SharedRead {
    inbox: Arc<Inbox>,
    dedicated: Option<ReadHalf<Stream>>,
}

impl Drop for SharedRead {
    fn drop(&mut self) {
        self.inbox.drop_reader();
    }
}

impl AsyncRead for SharedRead {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(read) = &mut this.dedicated {
            return Pin::new(read).poll_read(cx, buf);
        }
        match this.inbox.take(cx, buf) {
            Take::Copied | Take::Eof => Poll::Ready(Ok(())),
            Take::Failed(e) => Poll::Ready(Err(e)),
            Take::Waiting => Poll::Pending,
            Take::Dedicated(read) => Pin::new(this.dedicated.insert(read)).poll_read(cx, buf),
        }
    }
}

/// The dedicated connection being opened: a task of its own (bounded by
/// `upstream.connect_timeout_ms`), aborted if the session ends first.
type Opening = AbortOnDropHandle<Result<Stream, UpstreamError>>;

/// Where the write side is.
enum State {
    /// Commands go to the shared connection.
    Shared,
    /// A command needing its own connection is first in `pending`: waiting
    /// for what is owed on the shared connection.
    Moving(OwnReason),
    /// Opening the dedicated connection (no spare was ready).
    Opening(Opening),
    /// Everything goes to the dedicated connection.
    Dedicated(WriteHalf<Stream>),
    /// The move failed; the session is closing.
    Failed,
}

/// The writing half: commands, sent as the module doc says.
pub struct SharedWrite {
    common: Arc<Common>,
    lane: PollSender<Batch>,
    inbox: Arc<Inbox>,
    /// Bytes written to the stream not yet sent anywhere.
    pending: BytesMut,
    parser: RequestParser,
    /// Bytes at the front of `pending` framed as commands that may share.
    scanned: usize,
    /// The commands in `pending` after `scanned` as the dispatcher framed
    /// them: `parser` frames only what comes after.
    hints: Frames,
    /// Frames for the next write ([`SharedWrite::frames`]).
    next: Option<Frames>,
    /// Replies those commands get.
    replies: u64,
    /// Commands went over the shared connection (`WAIT` cannot follow).
    sent_shared: bool,
    /// The queue-full wait is counted once per wait.
    waiting_for_room: bool,
    state: State,
    _dedicated: Option<DedicatedGuard>,
}

impl std::fmt::Debug for SharedWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedWrite")
            .field("pending", &self.pending.len())
            .field("sent_shared", &self.sent_shared)
            .finish()
    }
}

impl SharedWrite {
    /// What the dispatcher framed of the next write (see
    /// [`crate::protocol::frames`]).
    pub(crate) fn frames(&mut self, frames: Frames) {
        self.next = Some(frames);
    }

    /// Takes the frames of the next write, `written`, if they line up:
    /// everything after `scanned` in `pending` is framed too.
    fn take_frames(&mut self, written: usize) {
        if let Some(frames) = self.next.take() {
            let after_scanned = self.pending.len() - self.scanned;
            self.hints.follow_with(frames, after_scanned, written);
        }
    }

    /// Sends what `pending` holds as far as it can: Ready once only the
    /// start of an unfinished command (shared) or nothing (dedicated) is
    /// left.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            match &mut self.state {
                State::Shared => {
                    let own = self.frame()?;
                    if self.scanned > 0 {
                        ready!(self.poll_send(cx))?;
                    }
                    match own {
                        Some(reason) => self.state = State::Moving(reason),
                        None => return Poll::Ready(Ok(())),
                    }
                }
                State::Moving(reason) => {
                    let reason = *reason;
                    ready!(self.inbox.poll_settled(cx));
                    if reason == OwnReason::Wait && self.sent_shared {
                        self.refuse_wait()?;
                        self.state = State::Shared;
                        continue;
                    }
                    ProxyMetrics::inc(self.common.metrics.moved(reason));
                    let current = self.common.primary.current();
                    let spares = &self.common.spares;
                    if let Some(spare) = spares.take(current.generation, &self.common.metrics) {
                        self.dedicate(spare);
                        continue;
                    }
                    let common = self.common.clone();
                    self.state = State::Opening(AbortOnDropHandle::new(tokio::spawn(async move {
                        common.open(&current, false).await
                    })));
                }
                State::Opening(opening) => match ready!(Pin::new(opening).poll(cx)) {
                    Ok(Ok(stream)) => self.dedicate(stream),
                    Ok(Err(e)) => self.move_failed(e.to_string())?,
                    Err(e) => self.move_failed(e.to_string())?,
                },
                State::Dedicated(write) => {
                    // Written as they come.
                    self.hints.clear();
                    while !self.pending.is_empty() {
                        let n = ready!(Pin::new(&mut *write).poll_write(cx, &self.pending))?;
                        if n == 0 {
                            return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                        }
                        observe_pauses(&self.common, &mut self.parser, &self.pending[..n]);
                        self.pending.advance(n);
                    }
                    return Poll::Ready(Ok(()));
                }
                State::Failed => return Poll::Ready(Err(io::ErrorKind::NotConnected.into())),
            }
        }
    }

    /// The session's connection of its own from now on: its replies are
    /// read from it after the inbox's, its commands written to it.
    fn dedicate(&mut self, stream: Stream) {
        let (read, write) = tokio::io::split(stream);
        self._dedicated = Some(DedicatedGuard::new(&self.common.metrics));
        self.inbox.install_dedicated(read);
        self.state = State::Dedicated(write);
    }

    /// The dedicated connection could not be opened: the session ends
    /// (its client is closed, as when its own connection fails).
    fn move_failed(&mut self, reason: String) -> io::Result<()> {
        ProxyMetrics::inc(&self.common.metrics.moves_failed);
        let why = format!("moving to a dedicated connection: {reason}");
        self.inbox.fail(why.clone());
        self.state = State::Failed;
        Err(io::Error::new(io::ErrorKind::NotConnected, why))
    }

    /// Frames the commands after `scanned` that may share; stops at the
    /// first that needs a connection of its own (returned) or the end of
    /// the whole commands.
    fn frame(&mut self) -> io::Result<Option<OwnReason>> {
        while self.scanned < self.pending.len() {
            let rest = &self.pending[self.scanned..];
            if let Some(f) = self.hints.front() {
                // Framed by the dispatcher already.
                if let Some(reason) = self.may_share(&f.args(rest)) {
                    return Ok(Some(reason));
                }
                self.replies += 1;
                self.scanned += f.len;
                self.hints.pop(f.len);
                continue;
            }
            let request = match self.parser.parse(rest) {
                Ok(Some(request)) => request,
                Ok(None) => return Ok(None),
                Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e.to_string())),
            };
            if request.kind != RequestKind::Empty {
                let args: SmallVec<[&[u8]; 8]> = (0..self.parser.argc())
                    .map(|i| self.parser.arg(rest, i))
                    .collect();
                if let Some(reason) = self.may_share(&args) {
                    return Ok(Some(reason));
                }
                self.replies += 1;
            }
            self.scanned += request.len;
        }
        Ok(None)
    }

    /// Why the command `args` cannot go over the shared connection, if it
    /// cannot.
    fn may_share(&self, args: &[&[u8]]) -> Option<OwnReason> {
        if let Some(reason) = needs_own_connection(args) {
            return Some(reason);
        }
        self.common.pause.in_force().then_some(OwnReason::Paused)
    }

    /// Sends the framed commands to the shared connection, once the
    /// session has room for their replies and the connection's queue has
    /// room for the batch.
    fn poll_send(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.inbox.poll_room(cx));
        if self.lane.poll_reserve(cx).is_pending() {
            if !self.waiting_for_room {
                self.waiting_for_room = true;
                ProxyMetrics::inc(&self.common.metrics.shared_queue_full);
            }
            return Poll::Pending;
        }
        self.waiting_for_room = false;
        let batch = Batch {
            bytes: self.pending.split_to(self.scanned).freeze(),
            replies: self.replies,
            inbox: self.inbox.clone(),
            first: !self.sent_shared,
        };
        self.inbox.owe(batch.replies);
        self.sent_shared |= batch.replies > 0;
        self.scanned = 0;
        self.replies = 0;
        if self.lane.send_item(batch).is_err() {
            // The pool is gone (shutdown): nothing will answer.
            self.inbox
                .fail("the shared connections stopped".to_string());
            return Poll::Ready(Err(io::ErrorKind::NotConnected.into()));
        }
        Poll::Ready(Ok(()))
    }

    /// `WAIT`/`WAITAOF` at the front of `pending`, after commands went over
    /// the shared connection: a dedicated connection's `WAIT` would not
    /// wait for them. Answered with an error in its place.
    fn refuse_wait(&mut self) -> io::Result<()> {
        let len = match self.parser.parse(&self.pending) {
            Ok(Some(request)) => request.len,
            _ => return Err(io::ErrorKind::InvalidData.into()),
        };
        self.hints.pop(len);
        self.pending.advance(len);
        ProxyMetrics::inc(&self.common.metrics.wait_refused);
        let mut reply = BytesMut::new();
        LocalReply::err(WAIT_REFUSED).encode(false, &mut reply);
        self.inbox.local(reply.freeze());
        Ok(())
    }
}

/// The error a `WAIT`/`WAITAOF` after shared writes is answered with.
const WAIT_REFUSED: &str = "lockgate: WAIT and WAITAOF cannot wait for writes sent over a shared \
     upstream connection (proxy.upstream = \"shared\"); use proxy.upstream = \"dedicated\"";

/// Follows the `CLIENT PAUSE`/`UNPAUSE` among commands a moved session
/// sent to its dedicated connection (a session moves at any `CLIENT`
/// command, so they go there). Only bytes that spell "pause" in some case
/// are framed; framing starts at the write's first byte, which is a
/// command's start but after a partial write, when what it finds is not
/// trusted to be whole: a pause missed or misread is what the hint's
/// bounds allow (`PauseHint`).
pub(super) fn observe_pauses(common: &Common, parser: &mut RequestParser, bytes: &[u8]) {
    if !spells_pause(bytes) {
        return;
    }
    let mut at = 0;
    while at < bytes.len() {
        let rest = &bytes[at..];
        let Ok(Some(request)) = parser.parse(rest) else {
            return;
        };
        if request.kind != RequestKind::Empty && parser.argc() >= 2 {
            let args: SmallVec<[&[u8]; 4]> = (0..parser.argc().min(3))
                .map(|i| parser.arg(rest, i))
                .collect();
            if let Some(pause) = crate::command::connection::pause_of(&args) {
                common.pause.saw(pause);
            }
        }
        at += request.len;
    }
}

/// Whether `bytes` hold "pause" in any case (`CLIENT PAUSE`, `UNPAUSE`).
fn spells_pause(bytes: &[u8]) -> bool {
    memchr::memchr2_iter(b'p', b'P', bytes).any(|i| {
        bytes
            .get(i + 1..i + 5)
            .is_some_and(|rest| rest.eq_ignore_ascii_case(b"ause"))
    })
}

impl AsyncWrite for SharedWrite {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        if let State::Dedicated(write) = &mut this.state {
            let n = ready!(Pin::new(write).poll_write(cx, buf))?;
            observe_pauses(&this.common, &mut this.parser, &buf[..n]);
            return Poll::Ready(Ok(n));
        }
        // Taken whole; sent by the flush that follows (or the next write).
        this.take_frames(buf.len());
        this.pending.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        match &mut this.state {
            State::Dedicated(write) => Pin::new(write).poll_flush(cx),
            _ => Poll::Ready(Ok(())),
        }
    }

    /// The client's half-close: what is whole is sent; the read side ends
    /// once every reply owed is in (a dedicated connection is shut down
    /// as a session's own is).
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        match &mut this.state {
            State::Dedicated(write) => Pin::new(write).poll_shutdown(cx),
            _ => {
                this.inbox.shut();
                Poll::Ready(Ok(()))
            }
        }
    }
}

#[cfg(test)]
mod tests;
