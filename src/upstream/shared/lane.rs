//! One shared connection to the primary and its task: batches of many
//! sessions' commands go out in one write, replies come back split by
//! session, in order ([`Splitter`]: a FIFO of who is owed how many).
//!
//! The connection is opened as a session's dedicated one is (plain
//! connect, TLS when configured; nothing sent but `CLIENT SETNAME`, so
//! operators can tell it in `CLIENT LIST`). When it dies, every reply
//! owed on it is answered `-ERR lockgate: upstream … unavailable (…)`
//! in its place (a session in the middle of a reply is closed instead,
//! as a dedicated connection's client would be), and it is opened again
//! with back-off; batches that arrive meanwhile are answered the same way,
//! or bring the next attempt forward as a session's own connection would
//! reconnect ([`run`]). A connection that goes
//! `upstream.lock_reply_timeout_ms` without a byte while a lock command
//! waits on it is given up the same way ([`crate::upstream::stall`]).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::inbox::{Delivered, Inbox};
use super::{Batch, Common};
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;
use crate::protocol::reply::{simple_frames, FrameKind, ReplyScanner};
use crate::tls::Stream;
use crate::upstream::backoff::Backoff;
use crate::upstream::link;
use crate::upstream::primary::Current;
use crate::upstream::stall::lock_call_waits;
use crate::upstream::UpstreamError;

/// Most batches taken off the queue for one write.
const BATCHES_PER_WRITE: usize = 256;

/// Replies owed to one session by the connection, in write order.
struct Owed {
    inbox: Arc<Inbox>,
    left: u64,
    /// The batch's commands and how many replies it gets in all: what the
    /// stall watch reads ([`crate::upstream::stall`]).
    commands: Bytes,
    replies: u64,
}

impl Owed {
    /// The batch's commands and how many of them are answered already.
    fn unanswered(&self) -> (&[u8], u64) {
        (&self.commands[..], self.replies - self.left)
    }
}

/// Runs one shared connection until `stop`: connects, serves, reconnects.
///
/// While the connection is down, attempts back off from
/// `upstream.reconnect_interval_ms` to [`crate::upstream::backoff::MAX`] while nobody needs
/// it, and a batch that needs it is served as a session's own connection
/// would serve it: a new session's first batch is held and brings the
/// attempt at once (a new dedicated session connects at once), another
/// does so once an interval has passed since the last attempt (a
/// dedicated session reconnects at most once per interval) and is answered
/// with the last attempt's error before that. Batches that arrive during a
/// failed attempt get its error. A change of the primary (a Sentinel
/// confirming one) brings the attempt at once.
pub(super) async fn run(
    common: Arc<Common>,
    mut rx: mpsc::Receiver<Batch>,
    stop: CancellationToken,
) {
    let first = common.reconnect_interval;
    let mut backoff = Backoff::new(first);
    let mut held: Vec<Batch> = Vec::new();
    loop {
        let current = common.primary.current();
        let connected = tokio::select! {
            _ = stop.cancelled() => return,
            c = common.open(&current, true) => c,
        };
        let err = match connected {
            Ok(stream) => {
                backoff.reset();
                ProxyMetrics::inc(&common.metrics.shared_connects);
                ProxyMetrics::inc(&common.metrics.shared_open);
                let held = std::mem::take(&mut held);
                let lost = serve(&common, stream, &mut rx, held, &current, &stop).await;
                common.metrics.shared_open.fetch_sub(1, Ordering::Relaxed);
                let Some(err) = lost else { return };
                ProxyMetrics::inc(&common.metrics.shared_lost);
                if let Some(more) = common.warn.check() {
                    tracing::warn!(error = %err, suppressed = more, "shared upstream connection lost; reconnecting");
                }
                // Straight back: a connection killed by an operator or
                // a failover comes back at once; a refused one backs off.
                continue;
            }
            Err(err) => err,
        };
        let error = error_line(&err);
        for b in held.drain(..) {
            answer(&common, b.inbox, b.replies, &error);
        }
        // Batches that arrived during the attempt waited for it: its error,
        // as each of their sessions' own attempts would have given.
        while let Ok(b) = rx.try_recv() {
            answer(&common, b.inbox, b.replies, &error);
        }
        // Counted once every batch it answers is answered: a batch that
        // arrives after the count meets the rules below.
        ProxyMetrics::inc(&common.metrics.shared_connect_errors);
        let tried = Instant::now();
        let wake = tokio::time::sleep(backoff.next());
        tokio::pin!(wake);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = &mut wake => break,
                _ = common.primary.changed_from(current.generation) => {
                    backoff.reset();
                    break;
                }
                batch = rx.recv() => match batch {
                    Some(b) if b.first || tried.elapsed() >= first => {
                        held.push(b);
                        break;
                    }
                    Some(b) => answer(&common, b.inbox, b.replies, &error),
                    None => return,
                },
            }
        }
    }
}

/// The reply that stands for one a connection will never give.
fn error_line(err: &UpstreamError) -> Bytes {
    let mut out = BytesMut::new();
    LocalReply::err(format!("lockgate: {err}")).encode(false, &mut out);
    out.freeze()
}

fn answer(common: &Common, inbox: Arc<Inbox>, n: u64, error: &Bytes) {
    ProxyMetrics::add(&common.metrics.shared_error_replies, n);
    inbox.answer_owed(n, error);
}

/// Serves one connection until it fails (`Some(reason)`), `stop` or the
/// pool closing (`None`). Replies still owed when it ends are answered in
/// place.
async fn serve(
    common: &Common,
    mut stream: Stream,
    rx: &mut mpsc::Receiver<Batch>,
    held: Vec<Batch>,
    current: &Current,
    stop: &CancellationToken,
) -> Option<UpstreamError> {
    let lane = Shared {
        common,
        addr: current.addr.as_deref().unwrap_or("(none)"),
    };
    let limits = link::Limits {
        per_write: BATCHES_PER_WRITE,
        read_chunk: common.read_chunk,
        lock_reply_timeout: common.lock_reply_timeout,
    };
    let changed = async {
        common.primary.changed_from(current.generation).await;
        "the primary changed".to_string()
    };
    let mut reader = Reader {
        splitter: Splitter::new(),
        full: Vec::new(),
    };
    let halves = stream.split();
    let why = link::serve(&lane, &mut reader, halves, rx, held, limits, stop, changed).await;
    why.map(|why| lane.error(Some(&why)))
}

/// A shared connection to the primary, as [`link::serve`] runs it.
struct Shared<'a> {
    common: &'a Common,
    addr: &'a str,
}

/// The reading side of a shared connection.
struct Reader {
    splitter: Splitter,
    /// Sessions the last split left holding more than their limit.
    full: Vec<Arc<Inbox>>,
}

impl Shared<'_> {
    /// What the connection's end (`why`; `None`: shutting down) is, as
    /// sessions read it.
    fn error(&self, why: Option<&str>) -> UpstreamError {
        UpstreamError::Io {
            addr: self.addr.to_string(),
            reason: format!("shared connection lost: {}", why.unwrap_or("shutting down")),
        }
    }
}

impl link::Lane for Shared<'_> {
    type Job = Batch;
    type Owed = Owed;
    type Reader = Reader;

    fn queue(&self, b: Batch, out: &mut BytesMut, fifo: &mut VecDeque<Owed>) {
        out.extend_from_slice(&b.bytes);
        if b.replies > 0 {
            fifo.push_back(Owed {
                inbox: b.inbox,
                left: b.replies,
                commands: b.bytes,
                replies: b.replies,
            });
        }
    }

    fn wrote(&self, jobs: usize) {
        ProxyMetrics::add(&self.common.metrics.shared_batches, jobs as u64);
        ProxyMetrics::inc(&self.common.metrics.shared_writes);
    }

    fn split(
        &self,
        reader: &mut Reader,
        buf: &mut BytesMut,
        fifo: &mut VecDeque<Owed>,
        _: &mut Vec<Batch>,
    ) -> Result<(), String> {
        let split = reader.splitter.split(buf, fifo, &mut reader.full);
        split.map_err(|why| {
            ProxyMetrics::inc(&self.common.metrics.shared_bad_replies);
            why.to_string()
        })
    }

    async fn room(&self, reader: &mut Reader) {
        for inbox in reader.full.drain(..) {
            wait_for_room(self.common, &inbox).await;
        }
    }

    fn lock_call_waits(&self, fifo: &VecDeque<Owed>) -> bool {
        lock_call_waits(fifo.iter().map(Owed::unanswered))
    }

    fn stalled(&self) {
        ProxyMetrics::inc(&self.common.metrics.shared_lock_reply_timeouts);
    }

    fn lost(&self, reader: &Reader, owed: VecDeque<Owed>, why: Option<&str>) {
        let err = self.error(why);
        let error = error_line(&err);
        for (i, owed) in owed.into_iter().enumerate() {
            if i == 0 && !reader.splitter.scanner.at_boundary() {
                // Part of a reply went to the session already: no error
                // can stand in its place.
                owed.inbox.fail(err.to_string());
            } else {
                answer(self.common, owed.inbox, owed.left, &error);
            }
        }
    }
}

/// Waits until a session that holds more replies than its limit
/// (`proxy.shared_session_reply_bytes`) has taken them down to half:
/// meanwhile this connection reads nothing more (the replies behind are
/// behind that session's in the connection's order anyway), and Redis
/// holds them. A session whose client took nothing for
/// `proxy.shared_reply_stall_ms` is failed (its client closed, counted in
/// `shared_session_output_limit`) and the connection reads on: one client
/// that stopped reading holds the others on its connection that long at
/// most.
async fn wait_for_room(common: &Common, inbox: &Inbox) {
    loop {
        let before = inbox.taken();
        let drained = std::future::poll_fn(|cx| inbox.poll_drained(cx));
        if tokio::time::timeout(common.reply_stall, drained)
            .await
            .is_ok()
        {
            return;
        }
        if inbox.taken() == before {
            ProxyMetrics::inc(&common.metrics.shared_session_output_limit);
            inbox.fail(format!(
                "more than {} bytes of replies waited for the client, which took none for {} ms",
                common.reply_limit,
                common.reply_stall.as_millis()
            ));
            return;
        }
    }
}

/// Splits a shared connection's replies among the sessions owed them.
pub(super) struct Splitter {
    scanner: ReplyScanner,
    /// Bytes at the front of the buffer already scanned, not yet handed on.
    scanned: usize,
}

impl Splitter {
    pub(super) fn new() -> Splitter {
        Splitter {
            scanner: ReplyScanner::new(),
            scanned: 0,
        }
    }

    /// Hands the whole replies in `buf` (and the start of an unfinished
    /// one) to the sessions at the front of `fifo`, in order; leaves only
    /// bytes not yet scanned (an incomplete header) in `buf`. An error: a
    /// reply nobody is owed, a push frame, or a malformed reply: the
    /// connection is dropped.
    ///
    /// Sessions that now hold more replies than their limit are pushed on
    /// `full`: the connection reads no more until each has room.
    fn split(
        &mut self,
        buf: &mut BytesMut,
        fifo: &mut VecDeque<Owed>,
        full: &mut Vec<Arc<Inbox>>,
    ) -> Result<(), &'static str> {
        loop {
            let Some(front) = fifo.front_mut() else {
                return match buf.is_empty() {
                    true => Ok(()),
                    false => Err("a reply no command was owed"),
                };
            };
            let mut frames = 0u64;
            while frames < front.left && self.scanned < buf.len() {
                if self.scanner.at_boundary() {
                    let max = usize::try_from(front.left - frames).unwrap_or(usize::MAX);
                    let (len, n) = simple_frames(&buf[self.scanned..], max);
                    self.scanned += len;
                    frames += n as u64;
                    if n > 0 {
                        continue;
                    }
                }
                let (used, end) = (self.scanner)
                    .advance(&buf[self.scanned..])
                    .map_err(|_| "a malformed reply")?;
                self.scanned += used;
                match end {
                    Some(end) if end.kind != FrameKind::Reply => {
                        return Err("a push or attribute frame on a shared connection")
                    }
                    Some(_) => frames += 1,
                    None => break,
                }
            }
            if self.scanned > 0 {
                let bytes = buf.split_to(self.scanned).freeze();
                self.scanned = 0;
                if front.inbox.deliver(bytes, frames) == Delivered::Full {
                    full.push(front.inbox.clone());
                }
                front.left -= frames;
            }
            if front.left > 0 {
                return Ok(());
            }
            fifo.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owed(inbox: &Arc<Inbox>, n: u64) -> Owed {
        inbox.owe(n);
        Owed {
            inbox: inbox.clone(),
            left: n,
            commands: Bytes::new(),
            replies: n,
        }
    }

    /// Every cut of a stream of replies for three sessions gives each its
    /// own bytes, whole and in order.
    #[test]
    fn replies_reach_their_sessions_at_every_cut() {
        let mut full = Vec::new();
        let a_bytes: &[u8] = b"+OK\r\n$5\r\nhello\r\n";
        let b_bytes: &[u8] = b"*2\r\n$1\r\nx\r\n:7\r\n";
        let c_bytes: &[u8] = b"-ERR no\r\n$-1\r\n:1\r\n";
        let all = [a_bytes, b_bytes, c_bytes].concat();
        for cut in 1..all.len() {
            let (a, b, c) = (
                Arc::new(Inbox::new(1 << 20)),
                Arc::new(Inbox::new(1 << 20)),
                Arc::new(Inbox::new(1 << 20)),
            );
            let mut fifo = VecDeque::from([owed(&a, 2), owed(&b, 1), owed(&c, 3)]);
            let mut splitter = Splitter::new();
            let mut buf = BytesMut::new();
            for piece in all.chunks(cut) {
                buf.extend_from_slice(piece);
                splitter.split(&mut buf, &mut fifo, &mut full).unwrap();
            }
            assert!(fifo.is_empty(), "cut {cut}");
            assert!(full.is_empty(), "cut {cut}");
            for (inbox, want) in [(&a, a_bytes), (&b, b_bytes), (&c, c_bytes)] {
                assert_eq!(inbox.owed(), 0, "cut {cut}");
                inbox.shut();
                assert_eq!(drain(inbox), want, "cut {cut}");
            }
        }
    }

    #[test]
    fn a_reply_nobody_is_owed_drops_the_connection() {
        let mut full = Vec::new();
        let mut fifo = VecDeque::new();
        let mut buf = BytesMut::from(&b"+OK\r\n"[..]);
        assert!(Splitter::new()
            .split(&mut buf, &mut fifo, &mut full)
            .is_err());
        let inbox = Arc::new(Inbox::new(1024));
        let mut fifo = VecDeque::from([owed(&inbox, 1)]);
        let mut buf = BytesMut::from(&b">2\r\n+a\r\n+b\r\n"[..]);
        assert!(Splitter::new()
            .split(&mut buf, &mut fifo, &mut full)
            .is_err());
    }

    fn drain(inbox: &Inbox) -> Vec<u8> {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut out = Vec::new();
        loop {
            let mut space = [0u8; 64];
            let mut buf = tokio::io::ReadBuf::new(&mut space);
            match inbox.take(&mut cx, &mut buf) {
                super::super::inbox::Take::Copied => out.extend_from_slice(buf.filled()),
                _ => return out,
            }
        }
    }
}
