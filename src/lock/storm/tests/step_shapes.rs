//! The rules for the connections apps really have, one step at a time with
//! made-up times: a probe of a lock known held is a plain look
//! (`Admission::Check`) when nothing renews this instance's place in the
//! key's queue; a parked attempt is answered at once when its connection
//! sends more behind it (`Event::Hurry`), keeping its place, unless the
//! lock is being taken for it at that moment.

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::super::event::{Action, Event, Tally};
use super::super::key::{Key, Turn};
use super::super::Admission;
use super::step::{acquire_for, admission, answered, ms, tallies, LIMITS, TIMING};
use super::{anyone, ask, conn};

/// Which probes are a plain look: a table of what the key knows (held,
/// through this instance or not, this instance's place renewed or not)
/// with a probe due (last one 150 ms ago, 100 ms interval).
#[test]
fn a_probe_of_a_lock_known_held_is_a_check_when_no_place_needs_renewing() {
    struct Row {
        name: &'static str,
        held: bool,
        ours: bool,
        placed_ms: Option<u64>,
        expect: Admission,
    }
    let rows = [
        Row {
            name: "held elsewhere, place fresh",
            held: true,
            ours: false,
            placed_ms: Some(300),
            expect: Admission::Check,
        },
        Row {
            name: "held elsewhere, place due for renewal",
            held: true,
            ours: false,
            placed_ms: Some(0),
            expect: Admission::Probe,
        },
        Row {
            name: "held elsewhere, no place known",
            held: true,
            ours: false,
            placed_ms: None,
            expect: Admission::Probe,
        },
        Row {
            name: "held through this instance: its release decides",
            held: true,
            ours: true,
            placed_ms: None,
            expect: Admission::Check,
        },
        Row {
            name: "not known held: the attempt may acquire",
            held: false,
            ours: true,
            placed_ms: Some(300),
            expect: Admission::Probe,
        },
    ];
    for row in rows {
        let now = Instant::now() + ms(1_000);
        let mut key = Key::default();
        key.view.held_until = row.held.then(|| now + ms(5_000));
        key.view.ours = row.ours;
        key.view.last_probe = Some(now - ms(150));
        key.view.placed_until = row.placed_ms.map(|p| now + ms(p));
        let actions = key.step(
            Event::Attempt {
                probe_ms: 100,
                owner: anyone(),
            },
            now,
            LIMITS,
        );
        assert_eq!(admission(&actions), Some(row.expect), "{}", row.name);
    }
}

/// A failed attempt's place lasts a third of its life without renewal;
/// an acquisition (which leaves the queue), a release (which woke the
/// head or passed the turn on) and a resubscription (a head nobody
/// listened for lost its place) all drop it.
#[test]
fn a_place_is_fresh_for_a_third_of_its_life() {
    let t0 = Instant::now();
    let placed = |key: &mut Key| key.step(Event::Placed { life_ms: 2_000 }, t0, LIMITS);
    let mut key = Key::default();
    placed(&mut key);
    assert!(key.placed(t0 + ms(665)));
    assert!(!key.placed(t0 + ms(666)));
    for (name, event) in [
        ("released", Event::Released),
        ("resubscribed", Event::Resubscribed),
        (
            "acquired",
            Event::Learned {
                acquired: true,
                ms: 1_000,
                behind_ms: 0,
            },
        ),
    ] {
        let mut key = Key::default();
        placed(&mut key);
        key.step(event, t0 + ms(1), LIMITS);
        assert!(!key.placed(t0 + ms(2)), "{name}: the place is still fresh");
    }
    key.step(Event::Placed { life_ms: 0 }, t0, LIMITS);
    assert!(!key.placed(t0), "a failed attempt that took no place");
}

/// The driver's probe of a lock known held is a check too; once the lease
/// is over (or nothing is known held) it acquires.
#[test]
fn the_drivers_probe_of_a_held_lock_is_a_check() {
    let t0 = Instant::now();
    let base = std::time::Instant::now();
    let mut key = Key::default();
    let c = conn();
    let (tx, _rx) = oneshot::channel();
    key.step(
        Event::Park {
            id: 1,
            since: base,
            reply: tx,
            ask: ask("lock:a", "v", &c),
            timing: TIMING,
        },
        t0,
        LIMITS,
    );
    key.view.held_until = Some(t0 + ms(500));
    key.view.ours = true;
    key.view.last_probe = Some(t0);
    let check = |actions: &[Action]| {
        actions.iter().find_map(|a| match a {
            Action::Acquire { ask, .. } => Some(ask.check),
            _ => None,
        })
    };
    let probe = key.step(Event::Tick, t0 + ms(100), LIMITS);
    assert_eq!(acquire_for(&probe), Some(1));
    assert_eq!(check(&probe), Some(true), "known held: a plain look");
    key.turn = Turn::Waiting;
    key.view.held_until = None;
    let free = key.step(Event::Tick, t0 + ms(101), LIMITS);
    assert_eq!(check(&free), Some(false), "not known held: it acquires");
}

/// More from the connection behind its parked attempt: the attempt is
/// answered "not acquired" now, counted, and keeps its place (its next
/// attempt takes it back, first try unchanged). Not while the lock is
/// being taken for it (acquired by the driver, or handed by a release on
/// its way): that answer comes within a round trip and decides. Another
/// connection's hurry touches nothing.
#[test]
fn a_hurried_park_is_answered_now_and_keeps_its_place() {
    let t0 = Instant::now();
    let base = std::time::Instant::now();
    let c = conn();
    let owner = crate::sync::lock(&c).id;
    let parked = |key: &mut Key, id: u64, at: Instant| {
        let (tx, rx) = oneshot::channel();
        let actions = key.step(
            Event::Park {
                id,
                since: base,
                reply: tx,
                ask: ask("lock:a", "v", &c),
                timing: TIMING,
            },
            at,
            LIMITS,
        );
        (rx, actions)
    };
    let mut key = Key::default();
    let (mut rx, _) = parked(&mut key, 1, t0);
    let other = key.step(Event::Hurry { owner: anyone() }, t0 + ms(1), LIMITS);
    assert!(answered(&other).is_empty(), "another connection's hurry");
    let hurried = key.step(Event::Hurry { owner }, t0 + ms(2), LIMITS);
    assert_eq!(answered(&hurried), vec![(1, false)]);
    assert_eq!(tallies(&hurried), vec![Tally::Hurried]);
    assert!(hurried.iter().any(|a| matches!(a, Action::Cut)));
    assert!(
        rx.try_recv().is_err(),
        "answered through the action, not yet sent"
    );
    assert_eq!(key.waiters.len(), 1, "its place is kept");
    assert!(!key.waiters[0].live());
    assert_eq!(key.waiters[0].deadline, t0 + ms(2) + ms(200));
    // Its next attempt parks in the same place.
    let (_rx, again) = parked(&mut key, 2, t0 + ms(3));
    assert_eq!(tallies(&again), vec![Tally::Parked]);
    assert_eq!(key.waiters.len(), 1);
    assert_eq!(key.waiters[0].id, 1);
    assert!(key.waiters[0].live());
    // Being acquired for, or handed the lock: not answered.
    for turn in [
        Turn::Acquiring { id: 1, releases: 0 },
        Turn::Handing {
            id: 1,
            until: t0 + ms(500),
        },
    ] {
        key.turn = turn;
        let busy = key.step(Event::Hurry { owner }, t0 + ms(4), LIMITS);
        assert!(answered(&busy).is_empty(), "{turn:?}");
        assert!(key.waiters[0].live(), "{turn:?}");
    }
}

/// A caller that spins without ever parking (a multiplexed connection's
/// tasks) still counts as waiting here for a while after its attempt: a
/// wake-up for the key then keeps the turn (its next attempt takes the
/// lock) instead of passing it on.
#[test]
fn a_recent_attempt_counts_as_waiting() {
    let t0 = Instant::now();
    let mut key = Key::default();
    assert!(!key.attempted_within(t0, ms(100)));
    key.step(
        Event::Attempt {
            probe_ms: 100,
            owner: anyone(),
        },
        t0,
        LIMITS,
    );
    assert!(key.attempted_within(t0 + ms(99), ms(100)));
    assert!(!key.attempted_within(t0 + ms(100), ms(100)));
}

/// A shared connection's lost attempts ([`Event::Spun`]) take a place by
/// their run's first attempt, among parked attempts, without parking; a
/// later attempt of the same connection only extends it; it counts as
/// waiting (a fencing wait that came later defers to it) until it lapses,
/// and then drops without a driver, at the next attempt on the key. While
/// it is at the front its owner's attempt asks Redis and the others are
/// absorbed; a full queue takes no place (counted).
#[test]
fn a_shared_connections_spin_keeps_a_place_that_lapses() {
    let t0 = Instant::now();
    let base = std::time::Instant::now();
    let shared = conn();
    let owner = crate::sync::lock(&shared).id;
    let later = conn();
    let spun = |key: &mut Key, id: u64, since: std::time::Instant, at: Instant| {
        key.step(
            Event::Spun {
                id,
                owner,
                since,
                keep: ms(100),
                ask: ask("lock:a", "v", &shared),
            },
            at,
            LIMITS,
        )
    };
    // A parked attempt that came after the shared connection's first.
    let mut key = Key::default();
    let (tx, _rx) = oneshot::channel();
    key.step(
        Event::Park {
            id: 1,
            since: base + ms(10),
            reply: tx,
            ask: ask("lock:a", "late", &later),
            timing: TIMING,
        },
        t0,
        LIMITS,
    );
    let first = spun(&mut key, 2, base, t0 + ms(1));
    assert!(tallies(&first).is_empty());
    assert_eq!(key.waiters.len(), 2);
    assert_eq!((key.waiters[0].id, key.waiters[0].live()), (2, false));
    assert_eq!(
        key.oldest_waiting(t0 + ms(1), None),
        Some(base),
        "it came first"
    );
    assert_eq!(
        key.oldest_waiting(t0 + ms(1), Some(owner)),
        Some(base + ms(10)),
        "its own connection's place left out"
    );
    // Again 60 ms later: the same place, kept 100 ms from then.
    spun(&mut key, 3, base + ms(60), t0 + ms(60));
    assert_eq!(key.waiters.len(), 2);
    assert_eq!(key.waiters[0].since, base, "first attempt unchanged");
    assert_eq!(key.waiters[0].deadline, t0 + ms(160));
    // Its owner asks Redis; the parked one's connection waits behind it.
    let lone = |key: &mut Key, who, at| {
        admission(&key.step(
            Event::Attempt {
                probe_ms: 100,
                owner: who,
            },
            at,
            LIMITS,
        ))
    };
    assert_eq!(lone(&mut key, owner, t0 + ms(61)), Some(Admission::Probe));
    key.view.probing = None;
    let behind = crate::sync::lock(&later).id;
    assert_eq!(lone(&mut key, behind, t0 + ms(62)), Some(Admission::Absorb));
    // Lapsed: it no longer counts, and the next attempt drops it.
    assert_eq!(key.oldest_waiting(t0 + ms(160), None), Some(base + ms(10)));
    key.turn = Turn::Off;
    key.waiters.retain(|w| !w.live());
    assert!(!key.idle(t0 + ms(159)), "kept");
    assert!(key.idle(t0 + ms(160)), "lapsed: nothing waits");
    lone(&mut key, behind, t0 + ms(161));
    assert!(key.waiters.is_empty(), "dropped at the next attempt");
    // A full queue takes no place.
    let mut full = Key::default();
    let mut kept = Vec::new();
    for i in 0..LIMITS.max_waiters {
        let (tx, rx) = oneshot::channel();
        kept.push(rx);
        full.step(
            Event::Park {
                id: 10 + i as u64,
                since: base,
                reply: tx,
                ask: ask("lock:a", "w", &conn()),
                timing: TIMING,
            },
            t0,
            LIMITS,
        );
    }
    let refused = spun(&mut full, 99, base, t0 + ms(1));
    assert_eq!(tallies(&refused), vec![Tally::WaiterRejected]);
    assert!(full.waiters.iter().all(|w| w.id != 99));
}
