//! What the reader half tells the writer half about each command it sent,
//! so the writer can attribute Redis's replies and slot lockgate's own
//! replies into the right place. Entries are sent before the command's bytes
//! go upstream, so a reply never arrives ahead of its entry.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::command::SubKind;
use crate::lock::evalsha::Rerun;
use crate::lock::LockPending;
use crate::protocol::encode::LocalReply;
use crate::router::Expect;

/// A reply lockgate is still working out (a fencing `LOCK … WAIT`, later a
/// quorum call); the writer holds every later reply back until it is ready.
/// With a gate (`.1`), the work waits until the writer reaches this entry,
/// that is until Redis has answered every command sent before it: a lock
/// transaction on the same Redis (see [`crate::lock::txn`]) must not run
/// ahead of them.
#[derive(Debug)]
pub struct Deferred(
    pub tokio::sync::oneshot::Receiver<LocalReply>,
    pub Option<tokio::sync::oneshot::Sender<()>>,
);

impl PartialEq for Deferred {
    fn eq(&self, _: &Deferred) -> bool {
        false
    }
}

/// Where the reply of Redis to a command lockgate sent in a client
/// command's place goes instead of the client: the primary's part of a
/// split command, merged with the quorum's part before the client sees it.
#[derive(Debug)]
pub struct Feed(pub tokio::sync::oneshot::Sender<bytes::Bytes>);

impl PartialEq for Feed {
    fn eq(&self, _: &Feed) -> bool {
        false
    }
}

/// A command sent that may free lock keys (a release, an extension, a
/// flush, a client script on lock keys, a transaction with any of them),
/// not answered yet: counted in its connection's count while it lives, and
/// dropped by the writer once the lock room has learned its reply (or with
/// the session). While the count is above 0 the connection's attempts are
/// not answered from what lockgate knows (see
/// [`crate::lock::Seat::settled`]): Redis runs that command first.
#[derive(Debug)]
pub struct InFlight(Arc<AtomicU32>);

impl InFlight {
    /// One more in `count`, until dropped.
    pub fn new(count: &Arc<AtomicU32>) -> InFlight {
        count.fetch_add(1, Ordering::AcqRel);
        InFlight(count.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl PartialEq for InFlight {
    fn eq(&self, _: &InFlight) -> bool {
        true
    }
}

/// One step of the reply stream, in command order.
#[derive(Debug, PartialEq)]
pub enum Pending {
    /// This many replies from Redis, forwarded as they are.
    Upstream(u32),
    /// One reply from Redis to a command it may hold back (`BLPOP`, …),
    /// forwarded as it is.
    Blocking,
    /// One reply from Redis to `HELLO`: a map (`%`) means RESP3 from now on.
    Hello,
    /// One reply from Redis to `RESET` (`+RESET`): RESP2 and counted replies
    /// from now on.
    Reset,
    /// A reply lockgate makes, written once everything before it is.
    Local(LocalReply),
    /// A reply lockgate is still working out.
    Deferred(Deferred),
    /// One reply from Redis to a lock script: `{client reply, facts…}`;
    /// the writer passes the client reply on and the facts to the lock room.
    /// With a [`Rerun`] when it went up as `EVALSHA` (Redis may answer
    /// `NOSCRIPT`, see [`crate::lock::evalsha`]), and an [`InFlight`]
    /// when the command may free lock keys. Boxed: the three are over 192
    /// bytes, and every entry is moved twice on its way to the writer (a
    /// `memcpy` call each), plain replies' too.
    Lock(Box<(LockPending, Option<Rerun>, Option<InFlight>)>),
    /// Stop counting replies: copy bytes until a `Reset`.
    EnterRaw,
    /// A subscription command's confirmations (see
    /// [`crate::router::Expect::Subscription`]): `args` channels named,
    /// `left` confirmations still owed once the first one came.
    Sub {
        /// Which command.
        kind: SubKind,
        /// Channels (or patterns) it named.
        args: u32,
        /// Confirmations still owed, known once the first arrives (an
        /// unsubscribe naming nothing gets one per member of its set).
        left: Option<u64>,
    },
    /// A reply lockgate worked out for a command whose reply the client
    /// suppressed (`CLIENT REPLY OFF|SKIP`): awaited in its place, so
    /// order holds, and dropped.
    Silent(Deferred),
    /// Close the client connection once everything before it is written.
    Close,
    /// A `RESET` lockgate sent itself as a barrier while replies were not
    /// counted: everything Redis sends before its `+RESET` is the client's,
    /// the `+RESET` itself is swallowed.
    Barrier,
    /// One reply from Redis to a command lockgate sent itself (the
    /// `DISCARD` that replaces the `EXEC` of a quorum transaction): dropped.
    Swallow,
    /// One reply from Redis, handed to the [`Feed`] instead of the client
    /// (a [`Pending::Deferred`] entry behind it gives the client its reply).
    Feed(Feed),
    /// The client half-closed and lockgate passed that on to Redis, which
    /// answers what it has read and then closes: the session ends at the
    /// upstream's EOF, not at an empty queue.
    ClientEof,
}

/// What the reader half sends the writer half for one read batch: its
/// entries in command order. Inline for one or two entries (what almost
/// every batch has), so a batch allocates nothing.
pub type Entries = smallvec::SmallVec<[Pending; 2]>;

/// The entries of one read batch, with consecutive forwarded replies merged.
#[derive(Debug, Default)]
pub struct Batch {
    /// Entries in command order.
    pub entries: Entries,
    /// The command being recorded gets no reply (`CLIENT REPLY OFF|SKIP`):
    /// Redis sends none, and lockgate writes none in its place.
    pub silent: bool,
}

impl Batch {
    /// Records a forwarded command expecting `expect`.
    #[inline]
    pub fn record(&mut self, expect: Expect) {
        if self.silent && expect != Expect::Reset {
            return;
        }
        match expect {
            Expect::Nothing => {}
            Expect::One => self.ones(1),
            Expect::Hello => self.entries.push(Pending::Hello),
            Expect::Blocking => self.entries.push(Pending::Blocking),
            Expect::Reset => self.entries.push(Pending::Reset),
            Expect::EnterRaw => self.entries.push(Pending::EnterRaw),
            Expect::Subscription(kind, args) => self.entries.push(Pending::Sub {
                kind,
                args,
                left: None,
            }),
        }
    }

    /// Records `n` forwarded commands expecting one reply each, in one
    /// step: the router's plain forwards are counted in a local and
    /// recorded once per run (a look at the last entry per command cost
    /// about 30 instructions, at -P16 a tenth of lockgate's own work on
    /// a GET). Never while silent: these are counted replies (`record`
    /// returns before this for a silent command).
    #[inline]
    pub fn ones(&mut self, n: u32) {
        if n == 0 {
            return;
        }
        debug_assert!(!self.silent);
        if let Some(Pending::Upstream(m)) = self.entries.last_mut() {
            *m += n;
        } else {
            self.entries.push(Pending::Upstream(n));
        }
    }

    /// Records a lock script whose reply carries facts (`rerun`: it went
    /// up as `EVALSHA`). Silent: Redis sends no reply, so there are no
    /// facts to learn.
    pub fn lock(&mut self, pending: LockPending, rerun: Option<Rerun>) {
        self.lock_freeing(pending, rerun, None);
    }

    /// [`Batch::lock`] for a command that may free lock keys, counted in
    /// flight until its reply is learned. Silent, it is counted in nothing
    /// (no reply says when it ran): the caller sees to that. Returns
    /// whether it was recorded.
    pub fn lock_freeing(
        &mut self,
        pending: LockPending,
        rerun: Option<Rerun>,
        freeing: Option<InFlight>,
    ) -> bool {
        if self.silent {
            return false;
        }
        (self.entries).push(Pending::Lock(Box::new((pending, rerun, freeing))));
        true
    }

    /// Records a reply that will be ready later.
    pub fn deferred(&mut self, rx: tokio::sync::oneshot::Receiver<LocalReply>) {
        self.gated(rx, None);
    }

    /// Records a reply that will be ready later, from work that starts
    /// once `gate` fires (see [`Deferred`]).
    pub fn gated(
        &mut self,
        rx: tokio::sync::oneshot::Receiver<LocalReply>,
        gate: Option<tokio::sync::oneshot::Sender<()>>,
    ) {
        if self.silent {
            self.entries.push(Pending::Silent(Deferred(rx, gate)));
        } else {
            self.entries.push(Pending::Deferred(Deferred(rx, gate)));
        }
    }

    /// Records a reply lockgate makes itself.
    pub fn local(&mut self, reply: LocalReply) {
        if !self.silent {
            self.entries.push(Pending::Local(reply));
        }
    }

    /// Records that the connection closes after what came before.
    pub fn close(&mut self) {
        self.entries.push(Pending::Close);
    }

    /// Records a reply of Redis the client must not see.
    pub fn swallow(&mut self) {
        self.entries.push(Pending::Swallow);
    }

    /// Records a reply of Redis handed to `feed` (see [`Pending::Feed`]).
    pub fn feed(&mut self, feed: tokio::sync::oneshot::Sender<bytes::Bytes>) {
        self.entries.push(Pending::Feed(Feed(feed)));
    }

    /// Records a barrier `RESET` sent by lockgate (see [`Pending::Barrier`]).
    pub fn barrier(&mut self) {
        self.entries.push(Pending::Barrier);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_replies_merge() {
        let mut b = Batch::default();
        b.record(Expect::One);
        b.record(Expect::One);
        b.record(Expect::Nothing);
        b.record(Expect::Hello);
        b.record(Expect::One);
        assert_eq!(
            &b.entries[..],
            &[Pending::Upstream(2), Pending::Hello, Pending::Upstream(1)][..]
        );
    }

    #[test]
    fn a_run_of_ones_merges_with_what_is_before_it() {
        let mut b = Batch::default();
        b.ones(0);
        assert!(b.entries.is_empty());
        b.ones(3);
        b.record(Expect::One);
        b.ones(2);
        b.record(Expect::Hello);
        b.ones(4);
        assert_eq!(
            &b.entries[..],
            &[Pending::Upstream(6), Pending::Hello, Pending::Upstream(4)][..]
        );
    }
}
