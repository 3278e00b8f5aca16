//! The vocabulary of a key's state machine ([`super::key::Key::step`]):
//! the [`Event`]s that happen to a key, and the [`Action`]s the table and
//! the driver carry out in answer.

use std::time::Duration;

use bytes::Bytes;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::key::{Timing, Waiter};
use super::{Admission, Ask, Claim};
use crate::lock::lease::ConnId;
use crate::lock::ops::Shape;
use crate::protocol::encode::LocalReply;

/// Something that happened to a key.
pub(super) enum Event {
    /// A client's attempt arrives, with the key's probe interval (0: every
    /// attempt goes to Redis).
    Attempt {
        /// Probe interval, ms.
        probe_ms: u64,
        /// The connection making it.
        owner: ConnId,
    },
    /// A client's attempt was answered: acquired for `ms` of lease, or
    /// held by someone else for `ms` more (`-1`: a key without lease).
    Learned {
        /// Acquired.
        acquired: bool,
        /// The lease or the holder's PTTL, ms.
        ms: i64,
        /// Not acquired, and another instance is first in the key's queue
        /// in the store: wait this long (ms) for the wake-up before asking
        /// again (0: this instance is first, or there is no queue).
        behind_ms: u64,
    },
    /// A failed attempt took or renewed this instance's place in the key's
    /// queue in the store, for `life_ms`.
    Placed {
        /// The place's life, ms.
        life_ms: u64,
    },
    /// The holder moved its lease: `pttl_ms` left (`-2`: the key is gone).
    Extended {
        /// What is left of the lease, ms.
        pttl_ms: i64,
    },
    /// A client's attempt ended without an outcome (an error, a lost
    /// quorum).
    Unprobed,
    /// Connection `owner` released the key: the place it kept goes.
    Left {
        /// The connection.
        owner: ConnId,
    },
    /// The lock was released (through this instance, or announced).
    Released,
    /// The lock was released and this instance's first fencing wait in
    /// line, which came before every attempt waiting here, asks for it
    /// now: the others wait for its answer as for a client's attempt on
    /// its way (until [`Event::Learned`], or a probe interval).
    Lined,
    /// Released through this instance, and another instance first in the
    /// store's queue was woken for it: this one waits behind it.
    Yielded {
        /// How long to wait for the wake-up before asking again, ms.
        behind_ms: u64,
    },
    /// An attempt parks.
    Park {
        /// A fresh waiter id, used if it takes a new place.
        id: u64,
        /// Its first attempt on the key.
        since: std::time::Instant,
        /// Where its answer goes.
        reply: oneshot::Sender<LocalReply>,
        /// What to acquire for it.
        ask: Ask,
        /// Its timing (starts the driver with it, if none runs).
        timing: Timing,
    },
    /// A release is about to be sent and may carry a handoff.
    Claim {
        /// The owner token the handed-over attempt gets.
        token: Bytes,
        /// How long the release may take to be answered.
        within: Duration,
    },
    /// The release carrying `claim` gave the lock to its waiter.
    HandedOver {
        /// The claim it carried.
        claim: Claim,
    },
    /// The release carrying the claim on waiter `id` did not release.
    Unclaimed {
        /// The claimed waiter.
        id: u64,
    },
    /// Connection `owner` sent more behind its parked attempt: answer it
    /// "not acquired" now (keeping its place), unless the lock is being
    /// taken for it this moment, whose answer decides.
    Hurry {
        /// The connection.
        owner: ConnId,
    },
    /// An attempt of connection `owner`, one seen carrying several callers
    /// (a pool's or a multiplexed connection, which never parks), lost
    /// again: it takes or keeps a place in the queue, ordered by `since`
    /// (its run's first attempt) and kept for `keep` past this attempt,
    /// so the connection's callers take their turn against parked
    /// attempts and fencing waits although none of them parks.
    Spun {
        /// A fresh waiter id, used if it takes a new place.
        id: u64,
        /// The connection.
        owner: ConnId,
        /// The connection's first attempt of its run on the key.
        since: std::time::Instant,
        /// How long the place lasts without another attempt.
        keep: Duration,
        /// What the place stands for (never acquired for: not parked).
        ask: Ask,
    },
    /// The wake-up channel was (re)subscribed: wake-ups may have been
    /// lost, so nothing is known to be ahead of this instance any more.
    Resubscribed,
    /// The driver looks at the key: woken, or its timer fired.
    Tick,
    /// The driver's acquisition ended.
    Acquired(Acquisition),
    /// lockgate stops.
    Stopped,
}

/// The end of the driver's acquisition for waiter `id`: acquired with
/// `lease_ms`, or not, with the holder's `pttl` (0: a lease ending now;
/// < 0: no holder with a lease, as after an outage or a fairness yield).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Acquisition {
    /// The waiter acquired for.
    pub(super) id: u64,
    /// Acquired.
    pub(super) acquired: bool,
    /// The holder's PTTL when not acquired, ms.
    pub(super) pttl: i64,
    /// The lease asked for, ms.
    pub(super) lease_ms: u64,
    /// As [`Event::Learned`]'s: behind another instance for this long.
    pub(super) behind_ms: u64,
}

/// A counter the table increments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Tally {
    /// An attempt answered without Redis.
    Absorbed,
    /// An attempt parked.
    Parked,
    /// A parked attempt handed the lock.
    Handoff,
    /// A parked attempt answered "not acquired" at its park's end.
    ParkTimeout,
    /// An attempt not parked: the key's queue was full.
    WaiterRejected,
    /// A parked attempt answered early: its connection sent more.
    Hurried,
}

/// Something the caller of [`super::key::Key::step`] carries out.
pub(super) enum Action {
    /// The attempt's admission ([`Event::Attempt`]).
    Admit(Admission),
    /// Count this.
    Count(Tally),
    /// Answer parked waiter `id` "acquired" or not.
    Answer {
        /// The waiter.
        id: u64,
        /// Its reply channel.
        reply: oneshot::Sender<LocalReply>,
        /// Its reply's shape.
        shape: Shape,
        /// Acquired.
        acquired: bool,
    },
    /// The driver acquired for waiter `id`, which left the queue: answer it
    /// "acquired" if it still waits (`reply`), else its lease runs out.
    Handoff {
        /// The waiter.
        id: u64,
        /// Its reply channel, if it was still parked.
        reply: Option<oneshot::Sender<LocalReply>>,
        /// Its reply's shape.
        shape: Shape,
    },
    /// The queue was full: the attempt is not parked.
    Rejected,
    /// A parked attempt was answered early ([`Event::Hurry`]).
    Cut,
    /// Start a driver for the key (none runs).
    StartDriver,
    /// Wake the driver, if one waits.
    Wake,
    /// Acquire for waiter `id` now.
    Acquire {
        /// The waiter.
        id: u64,
        /// What to acquire.
        ask: Ask,
    },
    /// Sleep until then (or a wake).
    SleepUntil(Instant),
    /// The driver ends: nothing waits.
    Exit,
    /// The front waiter is claimed for a release.
    Claimed(Claim),
    /// The release's handoff took the waiter out of the queue.
    HandedOver {
        /// The waiter taken.
        waiter: Waiter,
    },
}
