//! What one read batch carries out ([`Routed`]): what goes upstream (the
//! client's own bytes, and commands lockgate writes in place of lock
//! commands, as [`Pieces`]) and what the writer half must expect (a
//! [`Batch`] of pending entries), with work lockgate does itself queued
//! in command order. Filled by [`super::dispatch::Dispatch::batch`].

use super::jobs::Jobs;
use super::pending::Batch;
use crate::admin;
use crate::lock::lease::Hurry;
use crate::lock::Early;
use crate::protocol::encode::LocalReply;
use crate::protocol::frames::Frames;
use bytes::{Bytes, BytesMut};
use std::ops::Range;
use std::sync::Arc;

/// What goes upstream for one read batch: ranges of the client's own
/// bytes, and commands lockgate wrote in place of lock commands. Almost
/// every batch is one run of the client's bytes, kept in `first` without
/// a `Vec` (an allocation and a free per batch, one per command at
/// `-P 1`); everything after it, in order, in `more`.
#[derive(Debug, Default)]
pub(super) struct Pieces {
    first: Option<Range<usize>>,
    more: Vec<Piece>,
}

#[derive(Debug)]
enum Piece {
    Client(Range<usize>),
    Own(Bytes),
}

impl Pieces {
    pub(super) fn client(&mut self, range: Range<usize>) {
        let last = match self.more.last_mut() {
            Some(Piece::Client(last)) => Some(last),
            Some(Piece::Own(_)) => None,
            None if self.first.is_none() => {
                self.first = Some(range);
                return;
            }
            None => self.first.as_mut(),
        };
        match last {
            Some(last) if last.end == range.start => last.end = range.end,
            _ => self.more.push(Piece::Client(range)),
        }
    }

    pub(super) fn own(&mut self, bytes: Bytes) {
        self.more.push(Piece::Own(bytes));
    }

    /// The bytes to write upstream, given the batch's client bytes. The
    /// common case (only client bytes, contiguous) is zero-copy.
    pub(super) fn assemble(self, client: Bytes) -> Bytes {
        match (self.first, self.more.is_empty()) {
            (None, true) => Bytes::new(),
            (Some(r), true) => client.slice(r),
            (first, false) => {
                let mut out = BytesMut::new();
                if let Some(r) = first {
                    out.extend_from_slice(&client[r]);
                }
                for p in &self.more {
                    match p {
                        Piece::Client(r) => out.extend_from_slice(&client[r.clone()]),
                        Piece::Own(b) => out.extend_from_slice(b),
                    }
                }
                out.freeze()
            }
        }
    }
}

/// One read batch, routed.
pub(super) struct Routed {
    /// Where work with deferred replies is queued.
    pub(super) jobs: Jobs,
    /// The command being routed is the last one read so far.
    pub(super) last: bool,
    pub(super) batch: Batch,
    pub(super) pieces: Pieces,
    /// The plain commands at the front of what goes upstream, as parsed
    /// (see [`super::dispatch::Dispatch::keep_frames`]).
    pub(super) frames: Frames,
    /// Bytes consumed from the front of the read buffer.
    pub(super) used: usize,
    /// A malformed request ended the batch (its error and a close are the
    /// batch's last entries).
    pub(super) failed: bool,
    /// The batch ends with work lockgate does itself (a quorum operation,
    /// a fencing call): nothing after it goes upstream before it is done,
    /// so effects keep pipeline order (see [`Routed::defer`]).
    pub(super) hold: Option<tokio::sync::oneshot::Receiver<()>>,
}

impl Routed {
    /// An empty batch whose deferred work goes to `jobs`.
    pub(super) fn new(jobs: Jobs) -> Routed {
        Routed {
            jobs,
            last: false,
            batch: Batch::default(),
            pieces: Pieces::default(),
            frames: Frames::default(),
            used: 0,
            failed: false,
            hold: None,
        }
    }

    /// Takes an attempt answered before Redis (see
    /// [`crate::lock::LockService::attempt`]): now, later, or parked. A
    /// smoothed reply ends early when the connection sends more (`hurry`).
    pub(super) fn early(&mut self, early: Early, hurry: &Arc<Hurry>) {
        match early {
            Early::Now(reply) => self.batch.local(reply),
            Early::Delayed(reply, wait) => self.defer_reply(Box::pin(hurry.delay(reply, wait))),
            Early::Parked(rx) => self.batch.deferred(rx),
        }
    }

    /// Queues `work`, which acts on a store (a quorum operation, a fencing
    /// call); its reply takes the command's place in the order, and the
    /// batch ends with it: commands after it are routed and sent upstream
    /// only once it is done, as Redis would run them after it.
    pub(super) fn defer(&mut self, work: admin::Work) {
        self.defer_gated(work, None);
    }

    /// As [`Routed::defer`], for `work` on the same Redis as the client's
    /// connection (a lock transaction on a server that refuses scripts):
    /// it starts only once Redis has answered every command sent before
    /// it, as Redis would have run it after them.
    pub(super) fn defer_after(&mut self, work: admin::Work) {
        let (open, gate) = tokio::sync::oneshot::channel::<()>();
        let work: admin::Work = Box::pin(async move {
            // The writer ended without reaching it: nobody waits for it.
            if gate.await.is_err() {
                return LocalReply::err("lockgate: connection closed");
            }
            work.await
        });
        self.defer_gated(work, Some(open));
    }

    /// [`Routed::defer`], the writer opening `gate` when it reaches the
    /// reply's place.
    fn defer_gated(&mut self, work: admin::Work, gate: Option<tokio::sync::oneshot::Sender<()>>) {
        let (done, hold) = tokio::sync::oneshot::channel();
        self.hold = Some(hold);
        let work: admin::Work = Box::pin(async move {
            let reply = work.await;
            let _ = done.send(());
            reply
        });
        match self.jobs.defer(work) {
            Ok(rx) => self.batch.gated(rx, gate),
            Err(reply) => self.batch.local(reply),
        }
    }

    /// Queues `work` that only makes a reply; it takes the command's place
    /// in the order.
    fn defer_reply(&mut self, work: admin::Work) {
        match self.jobs.defer(work) {
            Ok(rx) => self.batch.deferred(rx),
            Err(reply) => self.batch.local(reply),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assembled(steps: &[Result<Range<usize>, &'static [u8]>]) -> Bytes {
        let mut pieces = Pieces::default();
        for step in steps {
            match step {
                Ok(range) => pieces.client(range.clone()),
                Err(own) => pieces.own(Bytes::from_static(own)),
            }
        }
        pieces.assemble(Bytes::from_static(b"0123456789abcdef"))
    }

    /// Client runs merge when they touch, commands of lockgate's own keep
    /// their place between them, and a command answered locally leaves a
    /// gap in the client's bytes.
    #[test]
    fn pieces_assemble_in_order() {
        assert_eq!(assembled(&[]), Bytes::new());
        assert_eq!(assembled(&[Ok(0..4), Ok(4..8)]), &b"01234567"[..]);
        assert_eq!(assembled(&[Ok(0..2), Ok(5..7)]), &b"0156"[..]);
        assert_eq!(assembled(&[Err(b"X"), Ok(0..2)]), &b"X01"[..]);
        assert_eq!(
            assembled(&[Ok(0..2), Err(b"X"), Ok(2..4), Ok(4..6), Err(b"Y")]),
            &b"01X2345Y"[..]
        );
        assert_eq!(assembled(&[Ok(0..2), Ok(3..4), Ok(4..5)]), &b"0134"[..]);
    }
}
