//! One contended key's state machine, without sockets, tasks or clocks.
//! [`Key::step`] takes an [`Event`] (an attempt arrives, an answer or a
//! release is seen, an attempt parks, the driver's timer fires…) and the
//! time, changes the key, and returns the [`Action`]s the caller carries
//! out: answer a parked attempt, acquire for the front of the queue, sleep
//! until a time, start the driver. The table ([`super::Storm`]) and the
//! driver ([`super::driver`]) only feed events in and carry actions out, so
//! every rule of the storm room is here, and the unit tests drive it with
//! made-up times.

use std::collections::VecDeque;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::event::{Acquisition, Action, Event, Tally};
use super::{Admission, Ask, Claim};
use crate::lock::lease::ConnId;
use crate::protocol::encode::LocalReply;

/// A place in a key's queue: a parked attempt (with a reply channel), or,
/// after its park time ended, a place kept for the same connection's next
/// attempt for a while, so a spin loop keeps its turn between attempts.
pub(super) struct Waiter {
    pub(super) id: u64,
    /// The connection: one place per connection.
    pub(super) owner: ConnId,
    /// The connection's first attempt: the queue's order (FIFO).
    pub(super) since: std::time::Instant,
    /// Parked until (live), or the place is kept until (reserved).
    pub(super) deadline: Instant,
    /// `Some` while parked.
    pub(super) reply: Option<oneshot::Sender<LocalReply>>,
    pub(super) ask: Ask,
}

impl Waiter {
    /// A parked attempt, as opposed to a place kept between attempts.
    pub(super) fn live(&self) -> bool {
        self.reply.is_some()
    }

    /// Answers the parked attempt "not acquired" (counted as `tally`) and
    /// keeps its place until `until`; false if it was not parked.
    fn unpark(&mut self, tally: Tally, until: Instant, out: &mut Vec<Action>) -> bool {
        self.deadline = until;
        let Some(reply) = self.reply.take() else {
            return false;
        };
        out.push(Action::Count(tally));
        out.push(Action::Answer {
            id: self.id,
            reply,
            shape: self.ask.shape,
            acquired: false,
        });
        true
    }
}

/// Whose turn it is to act on the key's queue. One of these at a time:
/// a claim is refused while the driver acquires, and the driver does not
/// acquire while a release carries a claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) enum Turn {
    /// No driver runs: nothing is parked on the key.
    #[default]
    Off,
    /// A driver runs and waits: for a release, a probe time, a deadline.
    Waiting,
    /// The driver is acquiring for waiter `id`; `releases` is
    /// [`View::releases`] when it asked, so an answer overtaken by a
    /// release is not taken for the latest news.
    Acquiring {
        /// The waiter acquired for.
        id: u64,
        /// Releases seen when the acquisition started.
        releases: u64,
    },
    /// A release carrying a handoff to waiter `id` is on its way, answered
    /// by `until`: the waiter is neither timed out nor tried for until the
    /// release's answer (or `until`, if the answer never comes).
    Handing {
        /// The claimed waiter.
        id: u64,
        /// When the claim lapses.
        until: Instant,
    },
}

/// What this instance last learned of the key's holder: a hint, refreshed
/// at least once per probe interval while attempts wait.
#[derive(Debug, Default)]
pub(super) struct View {
    /// Held until then, as last learned.
    pub(super) held_until: Option<Instant>,
    /// When an attempt last went to Redis (by a client or the driver).
    pub(super) last_probe: Option<Instant>,
    /// A client's attempt went to Redis then and is not answered yet.
    pub(super) probing: Option<Instant>,
    /// The driver's last attempt failed without learning a holder (an
    /// outage, a key without lease, a fairness yield): no new attempt
    /// before then.
    pub(super) backoff_until: Option<Instant>,
    /// Another instance was first in the key's queue in the store at the
    /// last answer: attempts here wait for its wake-up (a release wakes
    /// only the queue's head) and ask again no sooner than then, so the
    /// instances behind cost the store one renewal per interval, not one
    /// probe each per probe interval.
    pub(super) behind_until: Option<Instant>,
    /// This instance's place in the key's queue in the store was renewed
    /// less than a third of its life ago, until then: a probe of the held
    /// lock renews nothing before it (the probe is one `PTTL`), and the
    /// place still has two thirds of its life when it is renewed.
    pub(super) placed_until: Option<Instant>,
    /// The holder last learned acquired through this instance.
    pub(super) ours: bool,
    /// Counts releases seen, so an answer that was on its way while a
    /// release arrived does not overwrite it with a stale "held".
    pub(super) releases: u64,
    /// An attempt was last answered "not acquired" from this view then
    /// (absorbed, or its park ended or was cut). A release sent to Redis
    /// before it and seen here after it may have made that answer stale
    /// ([`super::Storm::refused_since`]).
    pub(super) refused_at: Option<Instant>,
}

/// The driver's settings, from the attempt that started it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Timing {
    /// How long an attempt stays parked, ms.
    pub(super) park_ms: u64,
    /// The key's probe interval, ms.
    pub(super) probe_ms: u64,
}

/// Until when an answer that said "behind another instance for `ms`"
/// keeps this one from asking (`None`: not behind).
fn behind(now: Instant, ms: u64) -> Option<Instant> {
    (ms > 0).then(|| now + Duration::from_millis(ms))
}

/// The table-wide settings a key's steps need.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    /// Most places in one key's queue.
    pub(super) max_waiters: usize,
    /// `locks.retry.probe_interval_ms`: how long a key refused without a
    /// lease counts as held.
    pub(super) probe_interval_ms: u64,
}

/// One tracked key: what is known of its holder, its queue, whose turn.
#[derive(Default)]
pub(super) struct Key {
    pub(super) view: View,
    pub(super) waiters: VecDeque<Waiter>,
    pub(super) turn: Turn,
    pub(super) timing: Timing,
    /// When a client's attempt on the key last arrived here.
    pub(super) last_attempt: Option<Instant>,
    /// The values (hashed) of the latest attempts here that lost, newest
    /// last, at most `locks.retry.max_lost_values_per_key`; a value leaves
    /// once an attempt with it wins. See [`super::Storm::lost_value`].
    pub(super) lost_values: VecDeque<u64>,
}

impl Key {
    /// Applies `event` at `now`; returns what to do.
    pub(super) fn step(&mut self, event: Event, now: Instant, limits: Limits) -> Vec<Action> {
        let mut out = Vec::new();
        match event {
            Event::Attempt { probe_ms, owner } => {
                self.last_attempt = Some(now);
                // Places kept for connections that never park lapse here
                // too: no driver need run to drop them.
                if self.turn == Turn::Off {
                    self.waiters.retain(|w| w.live() || w.deadline > now);
                }
                let admission = self.admit(probe_ms, owner, now);
                if admission == Admission::Absorb {
                    out.push(Action::Count(Tally::Absorbed));
                }
                out.push(Action::Admit(admission));
            }
            Event::Learned {
                acquired,
                ms,
                behind_ms,
            } => self.learn(acquired, ms, behind_ms, now, limits, &mut out),
            Event::Placed { life_ms } => {
                self.view.placed_until =
                    (life_ms > 0).then(|| now + Duration::from_millis(life_ms / 3));
            }
            Event::Extended { pttl_ms: -2 } => self.release(&mut out),
            Event::Extended { pttl_ms } => {
                if pttl_ms > 0 {
                    self.view.held_until = Some(now + Duration::from_millis(pttl_ms as u64));
                }
                // A driver waiting for the old deadline looks again.
                out.push(Action::Wake);
            }
            Event::Unprobed => {
                self.view.probing = None;
                out.push(Action::Wake);
            }
            Event::Left { owner } => self.waiters.retain(|w| w.live() || w.owner != owner),
            Event::Released => self.release(&mut out),
            Event::Lined => {
                self.release(&mut out);
                self.view.last_probe = Some(now);
                self.view.probing = Some(now);
            }
            Event::Yielded { behind_ms } => {
                self.release(&mut out);
                self.view.behind_until = behind(now, behind_ms);
            }
            Event::Park {
                id,
                since,
                reply,
                ask,
                timing,
            } => self.park(id, since, reply, ask, timing, now, limits, &mut out),
            Event::Claim { token, within } => self.claim(token, within, now, &mut out),
            Event::HandedOver { claim } => self.hand_over(claim, now, &mut out),
            Event::Unclaimed { id } => {
                if matches!(self.turn, Turn::Handing { id: claimed, .. } if claimed == id) {
                    self.turn = Turn::Waiting;
                }
                out.push(Action::Wake);
            }
            Event::Hurry { owner } => self.hurry(owner, now, &mut out),
            Event::Spun {
                id,
                owner,
                since,
                keep,
                ask,
            } => self.spun(id, owner, since, now + keep, ask, limits, &mut out),
            Event::Resubscribed => {
                // A head nobody listened for lost its place meanwhile.
                self.view.placed_until = None;
                if self.view.behind_until.take().is_some() {
                    out.push(Action::Wake);
                }
            }
            Event::Tick => self.tick(now, &mut out),
            Event::Acquired(done) => self.acquired(done, now, &mut out),
            Event::Stopped => {
                for w in self.waiters.drain(..) {
                    if let Some(reply) = w.reply {
                        out.push(Action::Answer {
                            id: w.id,
                            reply,
                            shape: w.ask.shape,
                            acquired: false,
                        });
                    }
                }
                self.turn = Turn::Off;
                out.push(Action::Exit);
            }
        }
        let refused = |a: &Action| {
            matches!(
                a,
                Action::Count(
                    Tally::Absorbed | Tally::ParkTimeout | Tally::Hurried | Tally::WaiterRejected
                )
            )
        };
        if out.iter().any(refused) {
            self.view.refused_at = Some(now);
        }
        out
    }

    /// Whether the key can leave the table: nothing parked or kept, no
    /// driver, no lease known to run.
    pub(super) fn idle(&self, now: Instant) -> bool {
        let over = self.view.held_until.is_none_or(|u| u <= now);
        !self.waiting(now) && self.turn == Turn::Off && over
    }

    /// Nothing says the key is contended at `now`: no attempt parked or
    /// kept in its queue here, no driver, not behind another instance in
    /// the store's queue, no back-off, and no holder but this instance
    /// known. An attempt on a quiet key may take the fast script (see
    /// `LockService::fast_path`): a hint, so a key contended only
    /// elsewhere is quiet here until the store's queue says otherwise.
    pub(super) fn quiet(&self, now: Instant) -> bool {
        let v = &self.view;
        let passed = |t: Option<Instant>| t.is_none_or(|t| t <= now);
        !self.waiting(now)
            && self.turn == Turn::Off
            && passed(v.behind_until)
            && passed(v.backoff_until)
            && (v.ours || passed(v.held_until))
    }

    /// Whether a client's attempt arrived within `window` of `now`: a
    /// caller still spinning here, parked or not.
    pub(super) fn attempted_within(&self, now: Instant, window: Duration) -> bool {
        self.last_attempt
            .is_some_and(|t| now.saturating_duration_since(t) < window)
    }

    /// Whether this instance's place in the key's queue needs no renewal
    /// at `now` (see [`View::placed_until`]).
    pub(super) fn placed(&self, now: Instant) -> bool {
        self.view.placed_until.is_some_and(|u| u > now)
    }

    /// Who holds the key as last learned, and until when; `None` when no
    /// lease is known to run.
    pub(super) fn holder(&self, now: Instant) -> Option<(&'static str, Instant)> {
        let (ours, until) = self.held(now)?;
        let who = match ours {
            true => "this instance",
            false => "another client",
        };
        Some((who, until))
    }

    /// Whether the lock is known held now, by this instance (true) or
    /// another, and until when.
    pub(super) fn held(&self, now: Instant) -> Option<(bool, Instant)> {
        let until = self.view.held_until.filter(|&u| u > now)?;
        Some((self.view.ours, until))
    }

    /// Attempts parked now (kept places not counted).
    pub(super) fn parked(&self) -> usize {
        self.waiters.iter().filter(|w| w.live()).count()
    }

    /// The attempts parked, in queue order: connection, first try.
    pub(super) fn parked_list(&self) -> Vec<(ConnId, std::time::Instant)> {
        (self.waiters.iter())
            .filter(|w| w.live())
            .map(|w| (w.owner, w.since))
            .collect()
    }

    /// Since when the front of the queue waits at `now`, leaving out
    /// connection `except`'s place: a parked attempt, or a place kept
    /// between a spinner's attempts and not lapsed (the queue is in the
    /// order of first attempts).
    pub(super) fn oldest_waiting(
        &self,
        now: Instant,
        except: Option<ConnId>,
    ) -> Option<std::time::Instant> {
        (self.waiters.iter())
            .filter(|w| Some(w.owner) != except)
            .find(|w| w.live() || w.deadline > now)
            .map(|w| w.since)
    }

    /// Whether anything waits at `now`: a parked attempt or a kept place
    /// not lapsed (a place kept for a connection that never parks lapses
    /// without a driver to drop it).
    fn waiting(&self, now: Instant) -> bool {
        self.waiters.iter().any(|w| w.live() || w.deadline > now)
    }

    /// When the connection parked here longest first tried, if any is
    /// parked.
    pub(super) fn oldest_parked(&self) -> Option<std::time::Instant> {
        self.waiters
            .iter()
            .filter(|w| w.live())
            .map(|w| w.since)
            .min()
    }

    fn admit(&mut self, probe_ms: u64, owner: ConnId, now: Instant) -> Admission {
        if probe_ms == 0 {
            return Admission::Probe;
        }
        let interval = Duration::from_millis(probe_ms);
        let view = &mut self.view;
        let held = view.held_until.is_some_and(|u| u > now);
        let probed = view
            .last_probe
            .is_some_and(|p| now.duration_since(p) < interval);
        // While one attempt is on its way, another cannot win: either it
        // takes the lock or the lock is held. (A storm's first wave would
        // otherwise all go to Redis before the first answer.)
        let in_flight = view
            .probing
            .is_some_and(|p| now.duration_since(p) < interval);
        // Attempts queue behind those already waiting (FIFO; the driver
        // asks Redis on the queue's behalf), also behind a spinner between
        // two attempts, whose place is kept for at most max(park, probe):
        // only evident spinners have places (a try-lock is never parked),
        // so no lone attempt leaves a place behind it. The spinner whose
        // kept place is at the front is behind nobody: its attempt is the
        // one the queue waits for (the driver acquires only for a parked
        // attempt), so it asks Redis; absorbing it would refuse a free
        // lock to the very attempt whose turn it is, and one that cannot
        // park (pipelined) would be answered "not acquired" for nothing.
        let queued_ahead = self
            .waiters
            .front()
            .is_some_and(|w| w.live() || w.owner != owner);
        // That spinner waits out the driver's back-off, as the driver
        // does, after an attempt refused without a holder learned (a key
        // without lease, an outage): else it would ask Redis on every
        // attempt in between. Nobody else is held back by a back-off.
        let backing_off = !self.waiters.is_empty()
            && !queued_ahead
            && view.backoff_until.is_some_and(|b| b > now);
        // Another instance is first in the store's queue: its turn comes
        // before any attempt of this one (the release wakes it), until
        // this instance is woken or its renewal is due.
        let behind = view.behind_until.is_some_and(|b| b > now);
        if ((held || backing_off) && probed) || in_flight || queued_ahead || behind {
            return Admission::Absorb;
        }
        view.last_probe = Some(now);
        view.probing = Some(now);
        match held && self.placed_or_ours(now) {
            true => Admission::Check,
            false => Admission::Probe,
        }
    }

    /// Whether a probe of the held lock needs not renew this instance's
    /// place in the key's queue: it was renewed recently, or the holder
    /// acquired through this instance, whose own release decides what
    /// comes next (a handoff here, or the wake-up of the queue's head), so
    /// no other instance's release has this one to wake. (A lock taken
    /// behind this instance's back meanwhile is found by the probes.)
    fn placed_or_ours(&self, now: Instant) -> bool {
        self.view.ours || self.placed(now)
    }

    fn learn(
        &mut self,
        acquired: bool,
        ms: i64,
        behind_ms: u64,
        now: Instant,
        limits: Limits,
        out: &mut Vec<Action>,
    ) {
        let view = &mut self.view;
        view.probing = None;
        // A "held" answer to a probe sent before the latest release (no
        // probe admitted since) is stale: the release wins.
        if !acquired && view.releases > 0 && view.last_probe.is_none() {
            return;
        }
        // A failed probe does not tell who holds it: keep what we knew
        // while that lease lasts.
        let ours_before = view.ours && view.held_until.is_some_and(|u| u > now);
        view.last_probe = Some(now);
        view.held_until = match ms {
            ms if ms > 0 => Some(now + Duration::from_millis(ms as u64)),
            // Refused by a key without lease (the incident: SETNX whose
            // EXPIRE never came): held until the next probe says
            // otherwise, so a spin loop on it is absorbed too.
            -1 if !acquired => Some(now + Duration::from_millis(limits.probe_interval_ms.max(1))),
            _ => None,
        };
        view.ours = acquired || ours_before;
        view.behind_until = behind(now, if acquired { 0 } else { behind_ms });
        if acquired {
            // An acquisition leaves the queue.
            view.placed_until = None;
        }
        // A driver waiting for this answer goes on.
        out.push(Action::Wake);
    }

    fn release(&mut self, out: &mut Vec<Action>) {
        let view = &mut self.view;
        view.held_until = None;
        view.last_probe = None;
        view.backoff_until = None;
        // Woken (or released here): nobody is known ahead any more.
        view.behind_until = None;
        // The release woke the queue's head, or this instance passed its
        // turn on: its place is renewed by its next failed attempt.
        view.placed_until = None;
        view.releases += 1;
        out.push(Action::Wake);
    }

    #[allow(clippy::too_many_arguments)]
    fn park(
        &mut self,
        id: u64,
        since: std::time::Instant,
        reply: oneshot::Sender<LocalReply>,
        ask: Ask,
        timing: Timing,
        now: Instant,
        limits: Limits,
        out: &mut Vec<Action>,
    ) {
        let deadline = now + Duration::from_millis(timing.park_ms);
        let owner = ask.conn_id;
        if let Some(place) = self.waiters.iter_mut().find(|w| w.owner == owner) {
            // Back in its kept place. If an earlier attempt of the same
            // connection is still parked there, it is answered now.
            if let Some(earlier) = place.reply.take() {
                out.push(Action::Count(Tally::ParkTimeout));
                out.push(Action::Answer {
                    id: place.id,
                    reply: earlier,
                    shape: place.ask.shape,
                    acquired: false,
                });
            }
            place.reply = Some(reply);
            place.deadline = deadline;
            place.ask = ask;
        } else {
            if self.waiters.len() >= limits.max_waiters {
                out.push(Action::Count(Tally::WaiterRejected));
                out.push(Action::Rejected);
                return;
            }
            let waiter = Waiter {
                id,
                owner,
                since,
                deadline,
                reply: Some(reply),
                ask,
            };
            let at = self.waiters.partition_point(|w| w.since <= since);
            self.waiters.insert(at, waiter);
        }
        out.push(Action::Count(Tally::Parked));
        if self.turn == Turn::Off {
            self.turn = Turn::Waiting;
            self.timing = timing;
            out.push(Action::StartDriver);
        } else {
            out.push(Action::Wake);
        }
    }

    /// Answers `owner`'s parked attempt "not acquired" now and keeps its
    /// place (as at its park's end), unless the driver acquires for it or
    /// a release hands it the lock at this moment: that answer comes
    /// within a round trip and decides.
    fn hurry(&mut self, owner: ConnId, now: Instant, out: &mut Vec<Action>) {
        let busy = match self.turn {
            Turn::Acquiring { id, .. } | Turn::Handing { id, .. } => Some(id),
            Turn::Off | Turn::Waiting => None,
        };
        let Timing { park_ms, probe_ms } = self.timing;
        let keep = Duration::from_millis(park_ms.max(probe_ms).max(1));
        let mine = |w: &&mut Waiter| w.live() && w.owner == owner && Some(w.id) != busy;
        for w in self.waiters.iter_mut().filter(mine) {
            if w.unpark(Tally::Hurried, now + keep, out) {
                out.push(Action::Cut);
            }
        }
    }

    /// A shared connection's attempt lost again ([`Event::Spun`]): its
    /// place is kept until `until` (taken at `since`'s rank if it had
    /// none; a parked attempt of its own keeps its park). A full queue
    /// takes no place, counted as a rejected park.
    #[allow(clippy::too_many_arguments)]
    fn spun(
        &mut self,
        id: u64,
        owner: ConnId,
        since: std::time::Instant,
        until: Instant,
        ask: Ask,
        limits: Limits,
        out: &mut Vec<Action>,
    ) {
        if let Some(place) = self.waiters.iter_mut().find(|w| w.owner == owner) {
            if !place.live() {
                place.deadline = place.deadline.max(until);
            }
            return;
        }
        if self.waiters.len() >= limits.max_waiters {
            out.push(Action::Count(Tally::WaiterRejected));
            return;
        }
        let at = self.waiters.partition_point(|w| w.since <= since);
        let waiter = Waiter {
            id,
            owner,
            since,
            deadline: until,
            reply: None,
            ask,
        };
        self.waiters.insert(at, waiter);
        // A driver waiting on a parked attempt behind it looks again (it
        // does not acquire past a kept place at the front).
        if self.turn != Turn::Off {
            out.push(Action::Wake);
        }
    }

    fn claim(&mut self, token: Bytes, within: Duration, now: Instant, out: &mut Vec<Action>) {
        if self.turn != Turn::Waiting {
            return;
        }
        let Some(front) = self.waiters.front().filter(|w| w.live()) else {
            return;
        };
        let claim = Claim {
            id: front.id,
            token,
            value: front.ask.value.clone(),
            lease_ms: front.ask.lease_ms,
        };
        self.turn = Turn::Handing {
            id: claim.id,
            until: now + within,
        };
        out.push(Action::Claimed(claim));
    }

    fn hand_over(&mut self, claim: Claim, now: Instant, out: &mut Vec<Action>) {
        if matches!(self.turn, Turn::Handing { id, .. } if id == claim.id) {
            self.turn = Turn::Waiting;
        }
        self.view.held_until = Some(now + Duration::from_millis(claim.lease_ms));
        self.view.ours = true;
        self.view.last_probe = Some(now);
        let Some(at) = self.waiters.iter().position(|w| w.id == claim.id) else {
            return;
        };
        if let Some(waiter) = self.waiters.remove(at) {
            out.push(Action::Count(Tally::Handoff));
            out.push(Action::HandedOver { waiter });
        }
    }

    /// The driver's look at the key: ends parks whose time is up, then
    /// acquires for the front of the queue if the lock may be free (or a
    /// probe is due), else says until when to sleep.
    fn tick(&mut self, now: Instant, out: &mut Vec<Action>) {
        let Timing { park_ms, probe_ms } = self.timing;
        let keep = Duration::from_millis(park_ms.max(probe_ms).max(1));
        if matches!(self.turn, Turn::Handing { until, .. } if until <= now) {
            // The release carrying the claim never answered.
            self.turn = Turn::Waiting;
        }
        let claimed = match self.turn {
            Turn::Handing { id, .. } => Some(id),
            _ => None,
        };
        // A parked attempt whose time ends is answered "not acquired" and
        // keeps its place for max(park, probe), so the lock waits for the
        // oldest spinner's next attempt rather than going to a younger one.
        for w in self
            .waiters
            .iter_mut()
            .filter(|w| w.live() && Some(w.id) != claimed && w.deadline <= now)
        {
            w.unpark(Tally::ParkTimeout, now + keep, out);
        }
        self.waiters.retain(|w| w.live() || w.deadline > now);
        if self.waiters.is_empty() {
            self.turn = Turn::Off;
            out.push(Action::Exit);
            return;
        }
        let view = &self.view;
        // A client's attempt on its way will take the lock or learn who
        // holds it: wait for its answer.
        let in_flight = view
            .probing
            .filter(|p| now.duration_since(*p) < Duration::from_millis(probe_ms.max(1)));
        let behind = view.behind_until.filter(|&b| b > now);
        let free = view.held_until.is_none_or(|u| u <= now)
            && in_flight.is_none()
            && view.backoff_until.is_none_or(|b| b <= now)
            && behind.is_none();
        // What this instance knows is a hint: a lock held through it may
        // still be freed behind its back (deleted directly, its lease
        // shortened by another app or instance), so the queue asks Redis
        // at least once per probe interval whoever holds it; behind another
        // instance in the store's queue, once its renewal is due (the
        // release wakes the head; a lost wake-up costs one renewal).
        let probe_due = behind.is_none()
            && probe_ms > 0
            && view
                .last_probe
                .is_none_or(|p| now.duration_since(p) >= Duration::from_millis(probe_ms));
        let front = self.waiters.front().filter(|w| w.live());
        if let (Some(w), true, Turn::Waiting) = (front, free || probe_due, self.turn) {
            let (id, mut ask) = (w.id, w.ask.clone());
            // Known held, only the probe is due: a plain look first.
            ask.check =
                !free && view.held_until.is_some_and(|u| u > now) && self.placed_or_ours(now);
            self.view.last_probe = Some(now);
            self.turn = Turn::Acquiring {
                id,
                releases: self.view.releases,
            };
            out.push(Action::Acquire { id, ask });
            return;
        }
        let mut wake_at = self.waiters.iter().map(|w| w.deadline).min().unwrap_or(now);
        if let Some(u) = view.held_until.filter(|&u| u > now) {
            wake_at = wake_at.min(u);
        }
        match behind {
            Some(b) => wake_at = wake_at.min(b),
            None => {
                if let Some(p) = view.last_probe.filter(|_| probe_ms > 0) {
                    wake_at = wake_at.min(p + Duration::from_millis(probe_ms));
                }
            }
        }
        if let Turn::Handing { until, .. } = self.turn {
            wake_at = wake_at.min(until);
        }
        if let Some(p) = in_flight {
            wake_at = wake_at.min(p + Duration::from_millis(probe_ms.max(1)));
        }
        if let Some(b) = view.backoff_until.filter(|&b| b > now) {
            wake_at = wake_at.min(b);
        }
        out.push(Action::SleepUntil(
            wake_at.max(now + Duration::from_millis(1)),
        ));
    }

    fn acquired(&mut self, done: Acquisition, now: Instant, out: &mut Vec<Action>) {
        let Acquisition {
            id,
            acquired,
            pttl,
            lease_ms,
            behind_ms,
        } = done;
        let released_meanwhile = match self.turn {
            Turn::Acquiring { releases, .. } => {
                self.turn = Turn::Waiting;
                self.view.releases != releases
            }
            _ => false,
        };
        let Timing { park_ms, probe_ms } = self.timing;
        self.view.behind_until = match released_meanwhile {
            // Woken while asking: the answer's "behind" is older news.
            true => None,
            false => behind(now, if acquired { 0 } else { behind_ms }),
        };
        if acquired {
            self.view.held_until = Some(now + Duration::from_millis(lease_ms));
            self.view.ours = true;
            self.view.placed_until = None;
            if let Some(at) = self.waiters.iter().position(|w| w.id == id) {
                if let Some(w) = self.waiters.remove(at) {
                    out.push(Action::Count(Tally::Handoff));
                    out.push(Action::Handoff {
                        id,
                        reply: w.reply,
                        shape: w.ask.shape,
                    });
                }
            }
        } else if !released_meanwhile {
            // PTTL 0 is a lease ending within the millisecond (Redis's
            // cached clock a little behind lockgate's deadline for it):
            // held until then, and asked again at once, not backed off.
            self.view.held_until =
                (pttl >= 0).then(|| now + Duration::from_millis(pttl.max(1) as u64));
            // Refused, but nobody holds it with a lease: asking again at
            // once would only spin.
            self.view.backoff_until =
                (pttl < 0).then(|| now + Duration::from_millis(probe_ms.max(park_ms).max(1)));
        }
    }
}
