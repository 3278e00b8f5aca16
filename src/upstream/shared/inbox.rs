//! One session's replies from a shared connection: an ordered queue of
//! reply bytes that the shared connection's task fills and the session's
//! read side drains, with the count of replies still owed to it. The one
//! place the two meet; a std lock held for a copy, never across an await.
//!
//! The bytes are in reply order for the session: the shared connection
//! answers in the order the session's commands were written there, and a
//! session moves to a dedicated connection only once nothing is owed, so
//! the dedicated connection's replies (read after the queue is empty)
//! come after every shared one.

use std::collections::VecDeque;
use std::io;
use std::sync::Mutex;
use std::task::{Context, Poll, Waker};

use bytes::{Buf, Bytes};
use tokio::io::{ReadBuf, ReadHalf};

use crate::sync;
use crate::tls::Stream;

/// One session's reply queue (see the module doc).
#[derive(Debug)]
pub(crate) struct Inbox {
    state: Mutex<State>,
    /// `proxy.shared_session_reply_bytes`: past it the shared connection
    /// reads no more until the session has taken half of it.
    limit: usize,
}

#[derive(Debug, Default)]
struct State {
    chunks: VecDeque<Bytes>,
    /// Bytes in `chunks`.
    bytes: usize,
    /// Replies owed by a shared connection: written there, not yet all in.
    owed: u64,
    /// Bytes the read side has taken, ever (its progress).
    taken: u64,
    read_waker: Option<Waker>,
    write_waker: Option<Waker>,
    /// The shared connection's task, waiting for room ([`Inbox::poll_drained`]).
    lane_waker: Option<Waker>,
    /// The dedicated connection's reading half, once the session moved;
    /// taken by the read side when `chunks` is empty.
    dedicated: Option<ReadHalf<Stream>>,
    /// Set: the read side fails with this (after a connection died in the
    /// middle of one of its replies, a failed move, the reply limit).
    failed: Option<String>,
    /// The write side was shut down: end of stream once nothing is owed.
    shut: bool,
    /// The read side is gone: deliveries are dropped.
    gone: bool,
}

/// What the read side found.
pub(super) enum Take {
    /// Bytes were copied into the buffer.
    Copied,
    /// The session moved: read this from now on.
    Dedicated(ReadHalf<Stream>),
    /// End of stream (the write side shut down, nothing owed).
    Eof,
    /// The stream failed.
    Failed(io::Error),
    /// Nothing yet; the read side's waker is kept.
    Waiting,
}

/// What a delivery did.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Delivered {
    /// Queued (or dropped: the session is gone).
    Queued,
    /// Queued, and more than the limit now waits for the session: the
    /// shared connection reads no more until the session has taken it
    /// down to half ([`Inbox::poll_drained`]), so one reply larger than
    /// the limit reaches a client that reads it.
    Full,
}

impl Inbox {
    /// An empty queue holding about `limit` bytes at most.
    pub(super) fn new(limit: usize) -> Inbox {
        Inbox {
            state: Mutex::new(State::default()),
            limit,
        }
    }

    /// The write side is about to send `n` commands that each get one
    /// reply over a shared connection (before they are sent, so a reply
    /// never finds nothing owed).
    pub(super) fn owe(&self, n: u64) {
        sync::lock(&self.state).owed += n;
    }

    /// Replies owed by a shared connection now.
    #[cfg(test)]
    pub(super) fn owed(&self) -> u64 {
        sync::lock(&self.state).owed
    }

    /// `bytes` from a shared connection for this session, ending `frames`
    /// whole replies (the last may still be incomplete).
    pub(super) fn deliver(&self, bytes: Bytes, frames: u64) -> Delivered {
        let mut s = sync::lock(&self.state);
        s.owed = s.owed.saturating_sub(frames);
        if s.gone || s.failed.is_some() {
            return Delivered::Queued;
        }
        s.bytes += bytes.len();
        s.chunks.push_back(bytes);
        wake(&mut s.read_waker);
        if s.owed == 0 {
            wake(&mut s.write_waker);
        }
        match s.bytes > self.limit {
            true => Delivered::Full,
            false => Delivered::Queued,
        }
    }

    /// The `n` replies owed from here on will never come: each is answered
    /// with `error` (one whole reply line), in their place.
    pub(super) fn answer_owed(&self, n: u64, error: &Bytes) {
        let mut s = sync::lock(&self.state);
        s.owed = s.owed.saturating_sub(n);
        if !s.gone && s.failed.is_none() {
            for _ in 0..n {
                s.bytes += error.len();
                s.chunks.push_back(error.clone());
            }
        }
        wake(&mut s.read_waker);
        wake(&mut s.write_waker);
    }

    /// A reply of lockgate's own in the place of one command, after every
    /// reply owed so far (the write side calls it once nothing is owed).
    pub(super) fn local(&self, reply: Bytes) {
        let mut s = sync::lock(&self.state);
        s.bytes += reply.len();
        s.chunks.push_back(reply);
        wake(&mut s.read_waker);
    }

    /// The stream cannot go on: the read side fails with `why` (the
    /// session closes its client, as when a dedicated connection dies in
    /// the middle of a reply). Nothing is owed any more.
    pub(super) fn fail(&self, why: String) {
        let mut s = sync::lock(&self.state);
        s.owed = 0;
        s.failed.get_or_insert(why);
        s.chunks.clear();
        s.bytes = 0;
        wake(&mut s.read_waker);
        wake(&mut s.write_waker);
        wake(&mut s.lane_waker);
    }

    /// The session moved: its replies come from `read` after the queue.
    pub(super) fn install_dedicated(&self, read: ReadHalf<Stream>) {
        let mut s = sync::lock(&self.state);
        s.dedicated = Some(read);
        wake(&mut s.read_waker);
    }

    /// The write side shut down: end of stream after what is owed.
    pub(super) fn shut(&self) {
        let mut s = sync::lock(&self.state);
        s.shut = true;
        wake(&mut s.read_waker);
    }

    /// The read side is gone.
    pub(super) fn drop_reader(&self) {
        let mut s = sync::lock(&self.state);
        s.gone = true;
        s.chunks.clear();
        s.bytes = 0;
        wake(&mut s.write_waker);
        wake(&mut s.lane_waker);
    }

    /// Ready once at most half the limit waits for the session (or it
    /// failed, or is gone): a shared connection that delivered
    /// [`Delivered::Full`] reads on then. Keeps the connection task's waker.
    pub(super) fn poll_drained(&self, cx: &mut Context<'_>) -> Poll<()> {
        let mut s = sync::lock(&self.state);
        if s.bytes <= self.limit / 2 || s.gone || s.failed.is_some() {
            return Poll::Ready(());
        }
        s.lane_waker = Some(cx.waker().clone());
        Poll::Pending
    }

    /// Bytes the read side has taken so far (to tell a client that reads
    /// slowly from one that stopped).
    pub(super) fn taken(&self) -> u64 {
        sync::lock(&self.state).taken
    }

    /// Ready once nothing is owed (keeps the write side's waker).
    pub(super) fn poll_settled(&self, cx: &mut Context<'_>) -> Poll<()> {
        let mut s = sync::lock(&self.state);
        if s.owed == 0 || s.gone || s.failed.is_some() {
            return Poll::Ready(());
        }
        s.write_waker = Some(cx.waker().clone());
        Poll::Pending
    }

    /// Ready while at most half the limit waits for the session (the
    /// write side's back-pressure; keeps its waker).
    pub(super) fn poll_room(&self, cx: &mut Context<'_>) -> Poll<bool> {
        let mut s = sync::lock(&self.state);
        if s.bytes <= self.limit / 2 {
            return Poll::Ready(true);
        }
        s.write_waker = Some(cx.waker().clone());
        Poll::Pending
    }

    /// The read side: copies what is queued into `buf`, or says what else.
    pub(super) fn take(&self, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Take {
        let mut s = sync::lock(&self.state);
        if let Some(why) = &s.failed {
            return Take::Failed(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                why.clone(),
            ));
        }
        if !s.chunks.is_empty() {
            let before = s.bytes;
            while buf.remaining() > 0 {
                let Some(chunk) = s.chunks.front_mut() else {
                    break;
                };
                let n = chunk.len().min(buf.remaining());
                buf.put_slice(&chunk[..n]);
                chunk.advance(n);
                if chunk.is_empty() {
                    s.chunks.pop_front();
                }
                s.bytes -= n;
            }
            s.taken += (before - s.bytes) as u64;
            if before > self.limit / 2 && s.bytes <= self.limit / 2 {
                wake(&mut s.write_waker);
                wake(&mut s.lane_waker);
            }
            return Take::Copied;
        }
        if s.owed == 0 {
            if let Some(read) = s.dedicated.take() {
                return Take::Dedicated(read);
            }
            if s.shut {
                return Take::Eof;
            }
        }
        s.read_waker = Some(cx.waker().clone());
        Take::Waiting
    }
}

fn wake(waker: &mut Option<Waker>) {
    if let Some(w) = waker.take() {
        w.wake();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(inbox: &Inbox) -> (Vec<u8>, &'static str) {
        let mut cx = Context::from_waker(Waker::noop());
        let mut out = Vec::new();
        loop {
            let mut space = [0u8; 3];
            let mut buf = ReadBuf::new(&mut space);
            match inbox.take(&mut cx, &mut buf) {
                Take::Copied => out.extend_from_slice(buf.filled()),
                Take::Dedicated(_) => return (out, "dedicated"),
                Take::Eof => return (out, "eof"),
                Take::Failed(_) => return (out, "failed"),
                Take::Waiting => return (out, "waiting"),
            }
        }
    }

    #[test]
    fn replies_then_errors_for_what_was_owed_then_the_end() {
        let inbox = Inbox::new(1024);
        inbox.owe(3);
        inbox.deliver(Bytes::from_static(b"+OK\r\n$3\r\nfo"), 1);
        assert_eq!(inbox.owed(), 2);
        inbox.deliver(Bytes::from_static(b"o\r\n"), 1);
        let err = Bytes::from_static(b"-ERR lockgate: gone\r\n");
        inbox.answer_owed(1, &err);
        inbox.shut();
        let (bytes, end) = read_all(&inbox);
        assert_eq!(bytes, b"+OK\r\n$3\r\nfoo\r\n-ERR lockgate: gone\r\n");
        assert_eq!(end, "eof");
    }

    #[test]
    fn no_end_of_stream_while_replies_are_owed() {
        let inbox = Inbox::new(1024);
        inbox.owe(1);
        inbox.shut();
        assert_eq!(read_all(&inbox).1, "waiting");
        inbox.deliver(Bytes::from_static(b":1\r\n"), 1);
        assert_eq!(read_all(&inbox), (b":1\r\n".to_vec(), "eof"));
    }

    #[test]
    fn past_the_limit_the_connection_waits_until_half_is_taken() {
        let inbox = Inbox::new(8);
        inbox.owe(2);
        assert_eq!(
            inbox.deliver(Bytes::from_static(b"+OK\r\n"), 1),
            Delivered::Queued
        );
        assert_eq!(
            inbox.deliver(Bytes::from_static(b"$4\r\nabcd\r\n"), 1),
            Delivered::Full
        );
        let mut cx = Context::from_waker(Waker::noop());
        assert!(inbox.poll_drained(&mut cx).is_pending(), "15 bytes wait");
        assert_eq!(inbox.taken(), 0);
        assert_eq!(
            read_all(&inbox),
            (b"+OK\r\n$4\r\nabcd\r\n".to_vec(), "waiting")
        );
        assert_eq!(inbox.taken(), 15);
        assert!(inbox.poll_drained(&mut cx).is_ready(), "all taken");
        // A session that stopped reading is failed by the connection task:
        // it holds nothing and lets the connection read on.
        inbox.owe(1);
        inbox.deliver(Bytes::from_static(b"$9\r\nabcdefghi\r\n"), 1);
        assert!(inbox.poll_drained(&mut cx).is_pending());
        inbox.fail("stalled".to_string());
        assert!(inbox.poll_drained(&mut cx).is_ready());
        assert_eq!(read_all(&inbox), (Vec::new(), "failed"));
    }
}
