//! One pipelined connection's serving loop, as every lane runs it (a
//! shared connection to the primary, a cluster node's shared or own
//! lane): the jobs queued for it go out in batches, one write each; what
//! each reply is owed to waits in one FIFO, in write order; what is read
//! goes to the lane's own splitter, which hands whole replies on; a lock
//! command unanswered too long gives the connection up
//! ([`crate::upstream::stall`]); and when the connection ends, everything
//! still owed on it is answered in place.
//!
//! What differs between lanes is what a job is and where its replies go
//! ([`Lane`]); the connection, its order and its failure are the same, and
//! live here once. Connecting, reconnecting and the back-off stay with
//! each lane's `run`, which decides what a queued job gets while the
//! connection is down.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::sync;
use crate::upstream::stall;

/// What one kind of lane carries over a [`serve`]d connection.
pub(crate) trait Lane {
    /// What arrives on the lane's queue.
    type Job: Send;
    /// What waits in the FIFO for replies, one per job written.
    type Owed;
    /// The reading side's own state (a reply scanner), kept past the
    /// connection's end: what it was in the middle of decides how the
    /// owed replies are answered ([`Lane::lost`]).
    type Reader;

    /// Appends `job`'s commands to `out` and what its replies are owed to
    /// onto `fifo` (nothing, for a job that gets none).
    fn queue(&self, job: Self::Job, out: &mut BytesMut, fifo: &mut VecDeque<Self::Owed>);

    /// A write of `jobs` jobs is about to go out (counted where the lane
    /// counts).
    fn wrote(&self, _jobs: usize) {}

    /// Hands what `buf` completes to the owed at the front of `fifo`,
    /// leaving in `buf` only what is not handed on yet. A reply may ask
    /// for a job to be written again (a script's body after `-NOSCRIPT`):
    /// pushed on `again`, it goes out next, ahead of the queue. `Err(why)`:
    /// the connection is given up (a reply nobody is owed, a malformed
    /// one).
    fn split(
        &self,
        reader: &mut Self::Reader,
        buf: &mut BytesMut,
        fifo: &mut VecDeque<Self::Owed>,
        again: &mut Vec<Self::Job>,
    ) -> Result<(), String>;

    /// Waits until the lane may read again after a split (a session that
    /// holds too many replies taking some); meanwhile Redis holds what is
    /// behind. No wait by default.
    fn room(&self, _reader: &mut Self::Reader) -> impl Future<Output = ()> + Send {
        std::future::ready(())
    }

    /// Whether, of what `fifo` owes, a lock command waits unanswered (the
    /// stall watch's question, asked only on a stall).
    fn lock_call_waits(&self, fifo: &VecDeque<Self::Owed>) -> bool;

    /// The connection stalled with a lock command waiting (counted where
    /// the lane counts).
    fn stalled(&self) {}

    /// The connection ended (`why`; `None`: shutting down): every reply
    /// still owed in `owed` is answered in place.
    fn lost(&self, reader: &Self::Reader, owed: VecDeque<Self::Owed>, why: Option<&str>);
}

/// The bounds of one connection's loop.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Most jobs taken off the queue for one write.
    pub per_write: usize,
    /// Bytes read at a time (`proxy.read_chunk_bytes`).
    pub read_chunk: usize,
    /// How long a lock command may wait without a byte of reply
    /// (`upstream.lock_reply_timeout_ms`); `None`: no bound.
    pub lock_reply_timeout: Option<Duration>,
}

/// Serves one connection (`r`, `w`) for `lane` until it fails
/// (`Some(why)`), `stop` is cancelled or every sender of `rx` is gone
/// (`None`), or `ends` is ready (`Some` of what it says: the primary
/// changed). `held`: jobs taken off the queue while connecting, written
/// first. Whatever is still owed when it ends goes to [`Lane::lost`].
#[allow(clippy::too_many_arguments)]
pub(crate) async fn serve<L, R, W>(
    lane: &L,
    reader: &mut L::Reader,
    (mut r, mut w): (R, W),
    rx: &mut mpsc::Receiver<L::Job>,
    held: Vec<L::Job>,
    limits: Limits,
    stop: &CancellationToken,
    ends: impl Future<Output = String>,
) -> Option<String>
where
    L: Lane,
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let fifo = Mutex::new(VecDeque::<L::Owed>::new());
    // Bytes of reply read so far, and whether reads wait for a lane's
    // room: what the stall watch calls progress.
    let progress = AtomicU64::new(0);
    let held_for_room = AtomicBool::new(false);
    // Jobs a reply asked to write again: at most one per job written, so
    // bounded by what the queue and the FIFO hold.
    let (again_tx, mut again_rx) = mpsc::unbounded_channel::<L::Job>();
    let writes = async {
        let mut jobs = held;
        jobs.reserve(limits.per_write);
        let mut out = BytesMut::new();
        loop {
            while let Ok(job) = again_rx.try_recv() {
                jobs.push(job);
            }
            if jobs.is_empty() {
                tokio::select! {
                    biased;
                    Some(job) = again_rx.recv() => jobs.push(job),
                    n = rx.recv_many(&mut jobs, limits.per_write) => if n == 0 {
                        return None;
                    },
                }
            }
            lane.wrote(jobs.len());
            {
                let mut fifo = sync::lock(&fifo);
                for job in jobs.drain(..) {
                    lane.queue(job, &mut out, &mut fifo);
                }
            }
            let written = async {
                w.write_all(&out).await?;
                w.flush().await
            };
            if let Err(e) = written.await {
                return Some(format!("write failed: {e}"));
            }
            out.clear();
        }
    };
    let reads = async {
        let mut buf = BytesMut::with_capacity(limits.read_chunk);
        let mut again = Vec::new();
        loop {
            buf.reserve(limits.read_chunk);
            match r.read_buf(&mut buf).await {
                Ok(0) => return "closed by the server".to_string(),
                Ok(n) => {
                    progress.fetch_add(n as u64, Ordering::Relaxed);
                }
                Err(e) => return format!("read failed: {e}"),
            }
            let split = lane.split(reader, &mut buf, &mut sync::lock(&fifo), &mut again);
            if let Err(why) = split {
                return why;
            }
            for job in again.drain(..) {
                // The writer lives as long as this loop does.
                let _ = again_tx.send(job);
            }
            held_for_room.store(true, Ordering::Relaxed);
            lane.room(reader).await;
            held_for_room.store(false, Ordering::Relaxed);
        }
    };
    // A read held for a lane's room is not the server's silence.
    let watch = stall::watch(limits.lock_reply_timeout, |watch, now, limit| {
        let fifo = sync::lock(&fifo);
        let owed = !fifo.is_empty() && !held_for_room.load(Ordering::Relaxed);
        let read = progress.load(Ordering::Relaxed);
        let stalled = watch.step(now, read, owed, limit) && lane.lock_call_waits(&fifo);
        if stalled {
            lane.stalled();
        }
        stalled
    });
    // The select consumes the loops: `reader` is free again after it.
    let why = tokio::select! {
        _ = stop.cancelled() => None,
        why = writes => why,
        why = reads => Some(why),
        why = watch => Some(why),
        why = ends => Some(why),
    };
    let owed = std::mem::take(&mut *sync::lock(&fifo));
    lane.lost(reader, owed, why.as_deref());
    why
}

#[cfg(test)]
mod tests;
