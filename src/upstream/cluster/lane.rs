//! One connection to one cluster node and its task. Sessions send it
//! [`Job`]s (whole commands of one session, in its order); it writes many
//! jobs at once, reads the replies one frame at a time, and hands each job
//! its replies ([`Part`]s) when the last is in. A reply that redirects
//! (`MOVED`, `ASK`) is not handed on: that command goes again to the node
//! named ([`super::Common::redirect`]), and its part is the answer from
//! there ([`Part::Later`]), in its place.
//!
//! Shared lanes (one or more per node, every session's plain commands)
//! and a session's own lanes (its blocking commands, scripts and
//! transactions) run the same task; a session's own lane ends with it.
//! When the connection dies, every reply owed on it is answered
//! `-ERR lockgate: upstream … unavailable (…)` in its place, and it is
//! opened again: at once for a job that arrives once
//! `upstream.reconnect_interval_ms` has passed since the last attempt,
//! the last attempt's error for one that arrives sooner, as a session's
//! own connection reconnects; a shared lane also tries again by itself,
//! backing off to 1 s, so a node's state is known without traffic. A
//! connection that goes `upstream.lock_reply_timeout_ms` without a
//! byte while a lock command waits on it is given up the same way
//! ([`crate::upstream::stall`]).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use futures_util::task::AtomicWaker;

use bytes::{Buf, Bytes, BytesMut};
use smallvec::SmallVec;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::Common;
use crate::cluster::redirect::redirect;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;
use crate::protocol::reply::{simple_frames, FrameKind, ReplyScanner};
use crate::upstream::backoff::Backoff;
use crate::upstream::link;
use crate::upstream::stall::lock_call_waits;

/// Most jobs taken off the queue for one write.
const JOBS_PER_WRITE: usize = 256;

/// One reply, several in a row, or where one will come from.
#[derive(Debug)]
pub(crate) enum Part {
    /// A whole reply.
    Reply(Bytes),
    /// Whole replies that came one after another, in one buffer.
    Run(Run),
    /// The replies of a command sent again elsewhere (redirected).
    Later(oneshot::Receiver<Vec<Part>>),
}

/// Consecutive whole replies of one job, as read: handed on as one
/// buffer rather than a buffer per reply (`perf` at `-P 16`: splitting
/// and dropping one buffer per reply was 3 % of lockgate's CPU).
#[derive(Debug)]
pub(crate) struct Run {
    /// The replies.
    pub bytes: Bytes,
    /// Where each reply ends in `bytes`.
    pub ends: SmallVec<[u32; 16]>,
    /// The next reply not handed on yet.
    pub next: usize,
    /// How far into `bytes` has been handed on.
    pub pos: usize,
}

impl Run {
    /// Each reply on its own.
    pub(crate) fn replies(&self) -> impl Iterator<Item = Bytes> + '_ {
        let starts = std::iter::once(0).chain(self.ends.iter().map(|&e| e as usize));
        (starts.zip(self.ends.iter()))
            .map(|(start, &end)| self.bytes.slice(start..end as usize))
            .skip(self.next)
    }
}

/// A job's commands.
pub(crate) type Commands = SmallVec<[Bytes; 4]>;

/// Commands of one session for one node, and where their replies go.
#[derive(Debug)]
pub(crate) struct Job {
    /// Whole commands, in RESP, one reply each.
    pub commands: Commands,
    /// Replies dropped at the front (`ASKING`'s before a command sent
    /// after `ASK`; what lockgate answered itself of a held transaction;
    /// a `DISCARD` of its own).
    pub skip_front: usize,
    /// Redirections are followed: the job is a session's plain commands.
    /// Otherwise (a transaction's, a blocking command's, on the session's
    /// own connection) a redirection becomes `-TRYAGAIN`: it cannot be
    /// sent elsewhere without what came before it on that connection.
    pub follow: bool,
    /// Redirections followed so far.
    pub hops: u32,
    /// Where the replies go, all at once.
    pub done: oneshot::Sender<Vec<Part>>,
    /// The session's count of jobs owed on this kind of lane, taken down
    /// when this one is answered, or dropped unanswered however that
    /// happens (see [`Owed`], [`Ticket`]).
    pub owed: Option<Ticket>,
    /// The session's reply bytes waiting for it, grown by this job's when
    /// it is answered (see [`Unread`]; `None`: the replies go to a merge or
    /// to the lock room, not to a session's read side).
    pub unread: Option<Arc<Unread>>,
}

/// Reply bytes a session's jobs were answered with that its read side has
/// not taken yet: grown by the lanes as they answer, taken down by the
/// read side as it takes the replies. Past half of
/// `proxy.shared_session_reply_bytes` the session sends no more commands
/// until its client has read them down (back-pressure, as with shared
/// connections to one Redis), so a client that stops reading holds a
/// bounded amount of lockgate's memory.
#[derive(Debug, Default)]
pub(crate) struct Unread {
    bytes: AtomicU64,
    /// Bytes the read side has taken in all (a client that reads slowly
    /// is told from one that stopped).
    taken: AtomicU64,
    waker: AtomicWaker,
}

impl Unread {
    /// `parts` came in for the session.
    pub(crate) fn add(&self, parts: &[Part]) {
        self.bytes.fetch_add(bytes_of(parts), Ordering::AcqRel);
    }

    /// The read side took `parts`.
    pub(crate) fn take(&self, parts: &[Part]) {
        let n = bytes_of(parts);
        // Never below 0: a count gone wrong must not hold the session
        // back for good.
        let _ = (self.bytes).fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
            Some(b.saturating_sub(n))
        });
        self.taken.fetch_add(n, Ordering::AcqRel);
        self.waker.wake();
    }

    /// Bytes taken in all.
    pub(crate) fn taken(&self) -> u64 {
        self.taken.load(Ordering::Acquire)
    }

    /// Ready while at most `half` bytes wait for the read side.
    pub(crate) fn poll_room(&self, cx: &mut Context<'_>, half: u64) -> Poll<()> {
        if self.bytes.load(Ordering::Acquire) <= half {
            return Poll::Ready(());
        }
        self.waker.register(cx.waker());
        match self.bytes.load(Ordering::Acquire) <= half {
            true => Poll::Ready(()),
            false => Poll::Pending,
        }
    }
}

/// The reply bytes in `parts` (a redirected command's come with its own
/// job).
fn bytes_of(parts: &[Part]) -> u64 {
    (parts.iter())
        .map(|p| match p {
            Part::Reply(b) => b.len() as u64,
            Part::Run(run) => (run.bytes.len() - run.pos) as u64,
            Part::Later(_) => 0,
        })
        .sum()
}

/// Jobs a session sent to one kind of lane (shared, or its own) not
/// answered yet: before a command goes to the other kind, the session
/// waits until none is, so that two connections to one node never run a
/// session's commands out of order.
#[derive(Debug, Default)]
pub(crate) struct Owed {
    n: AtomicU64,
    waker: AtomicWaker,
}

impl Owed {
    /// One more job sent: owed until the ticket is dropped.
    pub(crate) fn add(self: &Arc<Self>) -> Ticket {
        self.n.fetch_add(1, Ordering::AcqRel);
        Ticket(self.clone())
    }

    fn done(&self) {
        if self.n.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.waker.wake();
        }
    }

    /// Ready once no job is owed.
    pub(crate) fn poll_none(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.n.load(Ordering::Acquire) == 0 {
            return Poll::Ready(());
        }
        self.waker.register(cx.waker());
        match self.n.load(Ordering::Acquire) {
            0 => Poll::Ready(()),
            _ => Poll::Pending,
        }
    }
}

/// One job counted in an [`Owed`]: dropping it gives the count back.
/// A job can end unanswered in more ways than one (a lane's queue full,
/// a lane gone with jobs in its queue, a session gone), and a count left
/// up would hold the session's next switch of lane kind for good; tying
/// the count to the job's life leaves no such way.
#[derive(Debug)]
pub(crate) struct Ticket(Arc<Owed>);

impl Drop for Ticket {
    fn drop(&mut self) {
        self.0.done();
    }
}

impl Job {
    /// A job for `commands`, following redirections or not.
    pub(crate) fn new(commands: Commands, follow: bool) -> (Job, oneshot::Receiver<Vec<Part>>) {
        let (done, rx) = oneshot::channel();
        let job = Job {
            commands,
            skip_front: 0,
            follow,
            hops: 0,
            done,
            owed: None,
            unread: None,
        };
        (job, rx)
    }

    /// Hands the replies on, and counts the job answered.
    pub(super) fn finish(self, parts: Vec<Part>) {
        if let Some(unread) = &self.unread {
            unread.add(&parts);
        }
        let _ = self.done.send(parts);
        // The ticket, dropped here, counts the job answered.
    }

    /// The job was not sent after all (its lane's queue full or gone): it
    /// is no longer owed, or the count would hold the session's next
    /// switch of lane kind for good.
    pub(crate) fn unsent(&mut self) {
        self.owed = None;
    }

    /// The command at `i`.
    fn command(&self, i: usize) -> Bytes {
        self.commands[i].clone()
    }
}

/// A job written, its replies coming in.
struct InFlight {
    job: Job,
    /// Replies read so far.
    read: usize,
    parts: Vec<Part>,
}

impl InFlight {
    /// The commands whose replies are still owed, oldest first.
    fn owed(&self) -> impl Iterator<Item = &Bytes> {
        self.job.commands.iter().skip(self.read)
    }

    /// The reply owed for every command not answered yet: `error`.
    fn fail(mut self, error: &Bytes) {
        for i in self.read..self.job.commands.len() {
            if i >= self.job.skip_front {
                self.parts.push(Part::Reply(error.clone()));
            }
        }
        self.job.finish(self.parts);
    }
}

/// The reply that stands for one a connection will never give.
pub(crate) fn error_line(text: &str) -> Bytes {
    let mut out = BytesMut::new();
    LocalReply::err(format!("lockgate: {text}")).encode(false, &mut out);
    out.freeze()
}

/// Every reply owed to `job` is `error` (counted).
fn answer(common: &Common, job: Job, error: &Bytes) {
    ProxyMetrics::add(&common.metrics.error_replies, job.commands.len() as u64);
    InFlight {
        job,
        read: 0,
        parts: Vec::new(),
    }
    .fail(error);
}

/// Runs one connection to `addr` until `stop`, or until every sender of
/// `rx` is gone: connects, serves, reconnects (see the module doc).
/// `shared`: a shared lane (named so in `CLIENT LIST`, counted as such).
pub(super) async fn run(
    common: Arc<Common>,
    addr: Arc<str>,
    mut rx: mpsc::Receiver<Job>,
    stop: CancellationToken,
    (shared, resp3): (bool, bool),
) {
    let interval = common.reconnect_interval;
    let mut held: Vec<Job> = Vec::new();
    // A shared lane tries again at once after a loss, and then while the
    // node stays down (backing off to `backoff::MAX`), without waiting for
    // a command: whether the node is up is what `/readyz` and `LOCKGATE
    // NODES` say, and it comes back on its own.
    let mut again = false;
    let mut backoff = Backoff::new(interval);
    loop {
        if held.is_empty() && !again {
            // Connect only once there is something to send.
            tokio::select! {
                _ = stop.cancelled() => return,
                job = rx.recv() => match job {
                    Some(job) => held.push(job),
                    None => return,
                },
            }
        }
        again = false;
        let connected = tokio::select! {
            _ = stop.cancelled() => return,
            c = common.open(&addr, shared, resp3) => c,
        };
        let error = match connected {
            Ok(stream) => {
                backoff.reset();
                if shared {
                    common.node_state(&addr, true);
                }
                ProxyMetrics::inc(&common.metrics.node_connects);
                let open = match shared {
                    true => &common.metrics.shared_open,
                    false => &common.metrics.own_open,
                };
                ProxyMetrics::inc(open);
                let jobs = std::mem::take(&mut held);
                let lost = serve(&common, (&addr, resp3), stream, &mut rx, jobs, &stop).await;
                open.fetch_sub(1, Ordering::Relaxed);
                let Some(why) = lost else { return };
                ProxyMetrics::inc(&common.metrics.node_lost);
                if let Some(more) = common.warn.check() {
                    tracing::warn!(node = %addr, error = %why, suppressed = more, "cluster node connection lost");
                }
                // The node may have failed over: the map says where its
                // slots went.
                common.refresh_soon();
                again = shared;
                continue;
            }
            // A failed connect names the node already (`upstream …
            // unavailable (…)`); a refused handshake (`AUTH`) does not.
            Err(e) if e.contains(&*addr) => error_line(&e),
            Err(e) => error_line(&format!("upstream {addr} unavailable ({e})")),
        };
        ProxyMetrics::inc(&common.metrics.node_connect_errors);
        if shared {
            common.node_state(&addr, false);
        }
        common.refresh_soon();
        for job in held.drain(..) {
            answer(&common, job, &error);
        }
        let tried = Instant::now();
        let retry = tokio::time::sleep(backoff.next());
        tokio::pin!(retry);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = &mut retry, if shared => {
                    again = true;
                    break;
                }
                job = rx.recv() => match job {
                    Some(job) if tried.elapsed() >= interval => {
                        held.push(job);
                        break;
                    }
                    Some(job) => answer(&common, job, &error),
                    None => return,
                },
            }
        }
    }
}

/// Serves one connection until it fails (`Some(reason)`), `stop`, or no
/// sender is left (`None`). Replies still owed when it fails are answered
/// in place.
async fn serve(
    common: &Arc<Common>,
    (addr, resp3): (&Arc<str>, bool),
    mut stream: crate::tls::Stream,
    rx: &mut mpsc::Receiver<Job>,
    held: Vec<Job>,
    stop: &CancellationToken,
) -> Option<String> {
    let lane = NodeLane {
        common,
        addr,
        resp3,
    };
    let limits = link::Limits {
        per_write: JOBS_PER_WRITE,
        read_chunk: common.read_chunk,
        lock_reply_timeout: common.lock_reply_timeout,
    };
    let mut reader = Reader {
        scanner: ReplyScanner::new(),
        scanned: 0,
        run: SmallVec::new(),
    };
    let halves = stream.split();
    let never = std::future::pending::<String>();
    link::serve(&lane, &mut reader, halves, rx, held, limits, stop, never).await
}

/// A cluster node's lane, as [`link::serve`] runs it.
struct NodeLane<'a> {
    common: &'a Arc<Common>,
    addr: &'a str,
    resp3: bool,
}

/// The reading side of a node's lane.
struct Reader {
    scanner: ReplyScanner,
    /// Bytes at `buf`'s start scanned so far.
    scanned: usize,
    /// The front job's replies read and not handed on: they start at
    /// `buf`'s start, each ends where `run` says.
    run: SmallVec<[u32; 16]>,
}

impl link::Lane for NodeLane<'_> {
    type Job = Job;
    type Owed = InFlight;
    type Reader = Reader;

    fn queue(&self, job: Job, out: &mut BytesMut, fifo: &mut VecDeque<InFlight>) {
        for command in &job.commands {
            out.extend_from_slice(command);
        }
        fifo.push_back(InFlight {
            job,
            read: 0,
            parts: Vec::new(),
        });
    }

    fn split(
        &self,
        reader: &mut Reader,
        buf: &mut BytesMut,
        fifo: &mut VecDeque<InFlight>,
        _: &mut Vec<Job>,
    ) -> Result<(), String> {
        loop {
            // A plain reply (a line, a bulk string) whole at a frame's
            // start is taken in one pass, without the scanner's
            // bookkeeping (callgrind, `SET -P 16`: the scanner was about
            // 140 instructions per reply); anything else is scanned.
            let simple = match reader.scanner.at_boundary() {
                true => simple_frames(&buf[reader.scanned..], 1).0,
                false => 0,
            };
            if simple > 0 {
                reader.scanned += simple;
            } else {
                let (used, end) = match reader.scanner.advance(&buf[reader.scanned..]) {
                    Ok(step) => step,
                    Err(_) => return Err("a malformed reply".to_string()),
                };
                reader.scanned += used;
                let Some(end) = end else { break };
                if end.kind != FrameKind::Reply {
                    return Err("a push or attribute frame".to_string());
                }
            }
            let to = (self.addr, self.resp3);
            match deliver(
                self.common,
                to,
                fifo,
                (buf, &mut reader.run),
                reader.scanned,
            ) {
                Ok(taken) => reader.scanned -= taken,
                Err(why) => {
                    ProxyMetrics::inc(&self.common.metrics.bad_replies);
                    return Err(why.to_string());
                }
            }
        }
        // What this read completed goes on now; the rest of the job's
        // replies follow in another run.
        if let Some(front) = fifo.front_mut() {
            reader.scanned -= front.take_run(buf, &mut reader.run);
        }
        Ok(())
    }

    fn lock_call_waits(&self, fifo: &VecDeque<InFlight>) -> bool {
        lock_call_waits(fifo.iter().flat_map(InFlight::owed).map(|c| (&c[..], 0)))
    }

    fn stalled(&self) {
        ProxyMetrics::inc(&self.common.metrics.lock_reply_timeouts);
    }

    fn lost(&self, _: &Reader, owed: VecDeque<InFlight>, why: Option<&str>) {
        let error = error_line(&format!(
            "upstream {} unavailable (connection lost: {})",
            self.addr,
            why.unwrap_or("shutting down")
        ));
        for flight in owed {
            ProxyMetrics::add(
                &self.common.metrics.error_replies,
                (flight.job.commands.len() - flight.read) as u64,
            );
            flight.fail(&error);
        }
    }
}

impl InFlight {
    /// Hands the replies of `run` (at `buf`'s start) on as one part;
    /// returns the bytes taken off `buf`.
    fn take_run(&mut self, buf: &mut BytesMut, run: &mut SmallVec<[u32; 16]>) -> usize {
        let Some(&end) = run.last() else { return 0 };
        self.parts.push(Part::Run(Run {
            bytes: buf.split_to(end as usize).freeze(),
            ends: std::mem::take(run),
            next: 0,
            pos: 0,
        }));
        end as usize
    }
}

/// Gives the reply that ends at `end` in `buf` to the job at the front of
/// `fifo` (after the run of replies before it, which start at `buf`'s
/// start): into the run, or on its own when it redirects or is dropped.
/// Redirections are followed or turned into `-TRYAGAIN` (see
/// [`Job::follow`]). Returns the bytes taken off `buf`.
fn deliver(
    common: &Arc<Common>,
    (addr, resp3): (&str, bool),
    fifo: &mut VecDeque<InFlight>,
    (buf, run): (&mut BytesMut, &mut SmallVec<[u32; 16]>),
    end: usize,
) -> Result<usize, &'static str> {
    let Some(front) = fifo.front_mut() else {
        return Err("a reply no command was owed");
    };
    let i = front.read;
    front.read += 1;
    let total = front.job.commands.len();
    let start = run.last().map_or(0, |&e| e as usize);
    let mut taken = 0;
    if i < front.job.skip_front {
        // Dropped: the front replies come before any kept one.
        taken += front.take_run(buf, run);
        buf.advance(end - taken);
        taken = end;
    } else if buf.get(start) == Some(&b'-') {
        // An error stands alone: it may redirect.
        taken += front.take_run(buf, run);
        let frame = buf.split_to(end - taken).freeze();
        taken = end;
        let part = match redirect(&frame, addr) {
            Some(to) if front.job.follow && front.job.hops < common.max_redirects => {
                let hops = front.job.hops + 1;
                let unread = front.job.unread.clone();
                common.redirect(front.job.command(i), to, (hops, unread), resp3)
            }
            Some(to) => {
                ProxyMetrics::inc(&common.metrics.redirects_refused);
                Part::Reply(try_again(&to, front.job.follow))
            }
            None => Part::Reply(frame),
        };
        front.parts.push(part);
    } else {
        let at = u32::try_from(end).map_err(|_| "a reply past 4 GiB")?;
        run.push(at);
    }
    if front.read == total {
        taken += front.take_run(buf, run);
        if let Some(done) = fifo.pop_front() {
            done.job.finish(done.parts);
        }
    }
    Ok(taken)
}

/// The error for a redirection lockgate does not follow.
fn try_again(to: &crate::cluster::redirect::Redirect, follow: bool) -> Bytes {
    let why = match follow {
        true => "redirected too many times (upstream.cluster.max_redirects)",
        false => "moved while on a connection of this client's own (a transaction, a blocking command, a script)",
    };
    let mut out = BytesMut::new();
    LocalReply::Error(Bytes::from(format!(
        "TRYAGAIN lockgate: slot {} {why}; last sent to {}",
        to.slot, to.addr
    )))
    .encode(false, &mut out);
    out.freeze()
}
