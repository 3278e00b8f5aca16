//! A session pinned to one node by its subscriptions, and back.
//!
//! A `SUBSCRIBE` (or `PSUBSCRIBE`, `SSUBSCRIBE`, an unsubscribing command)
//! gives the session a connection of its own to one node, and from then on
//! its commands go there as written and the node's frames come back as
//! read: messages arrive whenever the node sends them. The write side
//! ([`PinnedWrite`]) still frames each command to follow the session's
//! subscriptions ([`Subscriptions`]); when a command leaves none, it tells
//! the read side ([`PinnedRead`]) how many frames with a count of 0 come up
//! to the last one, sends it, and holds what follows until the read side
//! has passed that frame. Then the pinned connection closes and the session
//! is routed by slot again, so a client that unsubscribes and goes on with
//! `GET`s on the same connection never sees a redirection.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use smallvec::SmallVec;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf, ReadHalf, WriteHalf};
use tokio::sync::oneshot;

use super::Common;
use crate::cluster::subs::Subscriptions;
use crate::protocol::reply::{FrameEnd, ReplyScanner};
use crate::protocol::request::RequestParser;
use crate::tls::Stream;

/// Bytes read from a pinned connection at a time.
const READ_CHUNK: usize = 16 * 1024;

/// Counts a pinned connection open while it lives.
struct PinGuard(Arc<Common>);

impl Drop for PinGuard {
    fn drop(&mut self) {
        self.0.metrics.own_open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The two halves of a pinned connection, `stream` to one node.
pub(super) fn pin(common: Arc<Common>, stream: Stream) -> (PinnedRead, PinnedWrite) {
    let (read, write) = tokio::io::split(stream);
    common.metrics.own_open.fetch_add(1, Ordering::Relaxed);
    let end = Arc::new(AtomicU64::new(0));
    let (over, done) = oneshot::channel();
    let read = PinnedRead {
        read,
        scanner: ReplyScanner::new(),
        buf: BytesMut::new(),
        tail: [0; 4],
        zeros: 0,
        end: end.clone(),
        over: Some(over),
    };
    let write = PinnedWrite {
        write,
        _guard: PinGuard(common),
        subs: Subscriptions::default(),
        zeros: 0,
        end,
        done,
        ready: 0,
        ending: false,
    };
    (read, write)
}

/// The reading half of a pinned connection.
pub(super) struct PinnedRead {
    read: ReadHalf<Stream>,
    scanner: ReplyScanner,
    /// The start of a frame header not complete yet.
    buf: BytesMut,
    /// The last 4 bytes passed on.
    tail: [u8; 4],
    /// Frames with a count of 0 seen.
    zeros: u64,
    /// The write side's count of such frames up to the last one (0: not
    /// known yet).
    end: Arc<AtomicU64>,
    /// Told once the last one is passed.
    over: Option<oneshot::Sender<()>>,
}

/// What a pinned connection gave.
pub(super) enum Read {
    /// Bytes for the client; `true` once the pin is over (they end with
    /// the frame that ended subscribed mode).
    Bytes(Bytes, bool),
    /// The node closed the connection.
    Eof,
}

impl PinnedRead {
    /// The next bytes for the client.
    pub(super) fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Read>> {
        loop {
            // Zeroed room (no `unsafe` for uninitialised bytes: a
            // subscription's traffic is not a hot path).
            let had = self.buf.len();
            self.buf.resize(had + READ_CHUNK, 0);
            let mut room = ReadBuf::new(&mut self.buf[had..]);
            let polled = Pin::new(&mut self.read).poll_read(cx, &mut room);
            let n = room.filled().len();
            self.buf.truncate(had + n);
            ready!(polled)?;
            if n == 0 {
                return Poll::Ready(Ok(Read::Eof));
            }
            let data = self.buf.split().freeze();
            let mut pos = 0;
            while pos < data.len() {
                let (used, end) = self
                    .scanner
                    .advance(&data[pos..])
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
                pos += used;
                let Some(frame) = end else {
                    // An incomplete header waits for more bytes.
                    break;
                };
                if ends_subscriptions(&frame, last4(self.tail, &data[..pos])) {
                    self.zeros += 1;
                    if self.zeros == self.end.load(Ordering::Acquire) {
                        if let Some(over) = self.over.take() {
                            let _ = over.send(());
                        }
                        // Nothing follows: the write side holds the
                        // session's next commands until now.
                        return Poll::Ready(Ok(Read::Bytes(data.slice(..pos), true)));
                    }
                }
            }
            self.tail = last4(self.tail, &data[..pos]);
            self.buf.extend_from_slice(&data[pos..]);
            if pos > 0 {
                return Poll::Ready(Ok(Read::Bytes(data.slice(..pos), false)));
            }
        }
    }
}

/// The last 4 bytes of the stream once `more` follows what ended in
/// `tail`.
fn last4(tail: [u8; 4], more: &[u8]) -> [u8; 4] {
    let mut out = [0; 4];
    let k = more.len().min(4);
    out[..4 - k].copy_from_slice(&tail[k..]);
    out[4 - k..].copy_from_slice(&more[more.len() - k..]);
    out
}

/// Whether `frame`, ending in `last`, is an `unsubscribe`, `punsubscribe`
/// or `sunsubscribe` frame carrying a count of 0 (RESP2 array or RESP3
/// push: `*3\r\n$11\r\nunsubscribe\r\n…:0\r\n`).
fn ends_subscriptions(frame: &FrameEnd, last: [u8; 4]) -> bool {
    let head = &frame.head;
    matches!(&head[..4], b"*3\r\n" | b">3\r\n")
        && matches!(&head[4..], b"$11\r" | b"$12\r")
        && &last == b":0\r\n"
}

/// The writing half of a pinned connection.
pub(super) struct PinnedWrite {
    write: WriteHalf<Stream>,
    _guard: PinGuard,
    subs: Subscriptions,
    /// Frames with a count of 0 the commands sent will be answered with.
    zeros: u64,
    end: Arc<AtomicU64>,
    done: oneshot::Receiver<()>,
    /// Bytes at the front of the session's pending ones that are whole
    /// commands on their way.
    ready: usize,
    /// The command that leaves no subscription is sent: wait for `done`.
    ending: bool,
}

impl PinnedWrite {
    /// Sends the whole commands at the front of `pending`. Ready(`true`)
    /// once the session has no subscription left and the node's answer to
    /// that is read: the pin is over, the rest of `pending` is routed.
    pub(super) fn poll_send(
        &mut self,
        cx: &mut Context<'_>,
        pending: &mut BytesMut,
        parser: &mut RequestParser,
    ) -> Poll<io::Result<bool>> {
        loop {
            while self.ready > 0 {
                let n = ready!(Pin::new(&mut self.write).poll_write(cx, &pending[..self.ready]))?;
                if n == 0 {
                    return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                }
                pending.advance(n);
                self.ready -= n;
            }
            if self.ending {
                // Sent for certain (a TLS stream may hold bytes until a
                // flush), then the read side's word.
                ready!(Pin::new(&mut self.write).poll_flush(cx))?;
                return match ready!(Pin::new(&mut self.done).poll(cx)) {
                    Ok(()) => Poll::Ready(Ok(true)),
                    Err(_) => Poll::Ready(Err(io::ErrorKind::NotConnected.into())),
                };
            }
            let request = match parser.parse(pending) {
                Ok(Some(request)) => request,
                Ok(None) => return Poll::Ready(Ok(false)),
                Err(e) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        e.to_string(),
                    )))
                }
            };
            let applied = {
                let args: SmallVec<[&[u8]; 8]> =
                    (0..parser.argc()).map(|i| parser.arg(pending, i)).collect();
                self.subs.apply(&args)
            };
            self.zeros += applied.zero_frames;
            if applied.family && applied.left == 0 {
                // Known before the command is sent, so before its answer
                // can be read.
                self.end.store(self.zeros, Ordering::Release);
                self.ending = true;
            }
            self.ready = request.len;
        }
    }

    /// Flushes the connection.
    pub(super) fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.write).poll_flush(cx)
    }

    /// Half-closes the connection.
    pub(super) fn poll_shutdown(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.write).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_four_bytes_carry_over_reads() {
        assert_eq!(&last4(*b"abcd", b"ef"), b"cdef");
        assert_eq!(&last4(*b"abcd", b""), b"abcd");
        assert_eq!(&last4(*b"abcd", b"0123456"), b"3456");
    }

    #[test]
    fn frames_that_end_subscriptions() {
        let frame = |bytes: &[u8]| {
            let mut s = ReplyScanner::new();
            let (used, end) = s.advance(bytes).expect("a frame");
            assert_eq!(used, bytes.len());
            (end.expect("whole"), last4([0; 4], bytes))
        };
        let table: &[(&[u8], bool)] = &[
            (b"*3\r\n$11\r\nunsubscribe\r\n$1\r\na\r\n:0\r\n", true),
            (b">3\r\n$12\r\npunsubscribe\r\n$2\r\np*\r\n:0\r\n", true),
            (b"*3\r\n$12\r\nsunsubscribe\r\n$-1\r\n:0\r\n", true),
            (b"*3\r\n$11\r\nunsubscribe\r\n$1\r\na\r\n:10\r\n", false),
            (b"*3\r\n$11\r\nunsubscribe\r\n$1\r\na\r\n:1\r\n", false),
            (b"*3\r\n$7\r\nmessage\r\n$1\r\na\r\n$2\r\n:0\r\n", false),
            (b"*3\r\n$9\r\nsubscribe\r\n$1\r\na\r\n:1\r\n", false),
            (b":0\r\n", false),
        ];
        for (bytes, want) in table {
            let (end, last) = frame(bytes);
            assert_eq!(
                ends_subscriptions(&end, last),
                *want,
                "{}",
                String::from_utf8_lossy(bytes)
            );
        }
    }
}
