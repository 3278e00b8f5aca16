//! The key's state machine, one step at a time, with made-up times.

use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::super::event::{Acquisition, Action, Event, Tally};
use super::super::key::{Key, Limits, Timing, Turn};
use super::super::Admission;
use super::{anyone, ask, conn};
use crate::protocol::encode::LocalReply;

pub(super) const LIMITS: Limits = Limits {
    max_waiters: 3,
    probe_interval_ms: 100,
};

pub(super) const TIMING: Timing = Timing {
    park_ms: 200,
    probe_ms: 100,
};

pub(super) fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Parks a new connection's attempt with value `value`, first made
/// `since_ms` after `base`; returns its reply channel and the actions.
pub(super) fn park(
    key: &mut Key,
    id: u64,
    value: &str,
    base: std::time::Instant,
    since_ms: u64,
    now: Instant,
) -> (oneshot::Receiver<LocalReply>, Vec<Action>) {
    let c = conn();
    let (tx, rx) = oneshot::channel();
    let event = Event::Park {
        id,
        since: base + ms(since_ms),
        reply: tx,
        ask: ask("lock:a", value, &c),
        timing: TIMING,
    };
    (rx, key.step(event, now, LIMITS))
}

pub(super) fn tallies(actions: &[Action]) -> Vec<Tally> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Count(t) => Some(*t),
            _ => None,
        })
        .collect()
}

pub(super) fn admission(actions: &[Action]) -> Option<Admission> {
    actions.iter().find_map(|a| match a {
        Action::Admit(x) => Some(*x),
        _ => None,
    })
}

pub(super) fn acquire_for(actions: &[Action]) -> Option<u64> {
    actions.iter().find_map(|a| match a {
        Action::Acquire { id, .. } => Some(*id),
        _ => None,
    })
}

pub(super) fn sleep_until(actions: &[Action]) -> Option<Instant> {
    actions.iter().find_map(|a| match a {
        Action::SleepUntil(t) => Some(*t),
        _ => None,
    })
}

pub(super) fn answered(actions: &[Action]) -> Vec<(u64, bool)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Answer { id, acquired, .. } => Some((*id, *acquired)),
            _ => None,
        })
        .collect()
}

/// Which attempts go to Redis: a table of what the key knows (held for
/// how long, probed and in flight how long ago, anything queued) and the
/// admission expected `at` ms later with a 100 ms probe interval.
#[test]
fn admission_follows_the_view() {
    struct Row {
        name: &'static str,
        held_ms: Option<u64>,
        probed_ago: Option<u64>,
        in_flight_ago: Option<u64>,
        queued: bool,
        probe_ms: u64,
        expect: Admission,
    }
    let rows = [
        Row {
            name: "nothing known",
            held_ms: None,
            probed_ago: None,
            in_flight_ago: None,
            queued: false,
            probe_ms: 100,
            expect: Admission::Probe,
        },
        Row {
            name: "held, probed just now",
            held_ms: Some(500),
            probed_ago: Some(10),
            in_flight_ago: None,
            queued: false,
            probe_ms: 100,
            expect: Admission::Absorb,
        },
        Row {
            name: "held, probe due",
            held_ms: Some(500),
            probed_ago: Some(100),
            in_flight_ago: None,
            queued: false,
            probe_ms: 100,
            expect: Admission::Probe,
        },
        Row {
            name: "lease over",
            held_ms: Some(0),
            probed_ago: Some(10),
            in_flight_ago: None,
            queued: false,
            probe_ms: 100,
            expect: Admission::Probe,
        },
        Row {
            name: "an attempt on its way",
            held_ms: None,
            probed_ago: None,
            in_flight_ago: Some(50),
            queued: false,
            probe_ms: 100,
            expect: Admission::Absorb,
        },
        Row {
            name: "an attempt lost on its way",
            held_ms: None,
            probed_ago: None,
            in_flight_ago: Some(100),
            queued: false,
            probe_ms: 100,
            expect: Admission::Probe,
        },
        Row {
            name: "attempts queued",
            held_ms: None,
            probed_ago: None,
            in_flight_ago: None,
            queued: true,
            probe_ms: 100,
            expect: Admission::Absorb,
        },
        Row {
            name: "absorption off",
            held_ms: Some(500),
            probed_ago: Some(10),
            in_flight_ago: None,
            queued: true,
            probe_ms: 0,
            expect: Admission::Probe,
        },
    ];
    let base = std::time::Instant::now();
    for row in rows {
        let t0 = Instant::now();
        let now = t0 + ms(1_000);
        let mut key = Key::default();
        key.view.held_until = row.held_ms.map(|h| now + ms(h));
        key.view.last_probe = row.probed_ago.map(|p| now - ms(p));
        key.view.probing = row.in_flight_ago.map(|p| now - ms(p));
        if row.queued {
            let _ = park(&mut key, 1, "v", base, 0, t0);
        }
        let actions = key.step(
            Event::Attempt {
                probe_ms: row.probe_ms,
                owner: anyone(),
            },
            now,
            LIMITS,
        );
        assert_eq!(admission(&actions), Some(row.expect), "{}", row.name);
        let counted = tallies(&actions).contains(&Tally::Absorbed);
        assert_eq!(
            counted,
            row.expect == Admission::Absorb,
            "{}: counted",
            row.name
        );
        if row.expect == Admission::Probe && row.probe_ms > 0 {
            assert_eq!(
                key.view.probing,
                Some(now),
                "{}: marked in flight",
                row.name
            );
        }
    }
}

/// A spin loop's attempts: the first goes to Redis, every other one until
/// its answer and then within the probe interval is absorbed, and the next
/// goes once the interval is over.
#[test]
fn spinning_attempts_are_absorbed_between_probes() {
    let t0 = Instant::now();
    let mut key = Key::default();
    let attempt = |key: &mut Key, at: u64| {
        admission(&key.step(
            Event::Attempt {
                probe_ms: 100,
                owner: anyone(),
            },
            t0 + ms(at),
            LIMITS,
        ))
    };
    assert_eq!(attempt(&mut key, 0), Some(Admission::Probe));
    assert_eq!(
        attempt(&mut key, 1),
        Some(Admission::Absorb),
        "first answer not in yet"
    );
    key.step(
        Event::Learned {
            acquired: false,
            ms: 5_000,
            behind_ms: 0,
        },
        t0 + ms(2),
        LIMITS,
    );
    for at in 3..102 {
        assert_eq!(attempt(&mut key, at), Some(Admission::Absorb), "at {at} ms");
    }
    assert_eq!(attempt(&mut key, 102), Some(Admission::Probe));
}

/// What an answer teaches: who holds it and until when; a "held" answer
/// overtaken by a release is stale and ignored.
#[test]
fn answers_set_the_view() {
    let t0 = Instant::now();
    // (acquired, ms) → (held for ms, ours)
    let rows: [(bool, i64, Option<u64>, bool); 5] = [
        (true, 1_000, Some(1_000), true),
        (false, 300, Some(300), false),
        (false, -1, Some(LIMITS.probe_interval_ms), false),
        (false, -2, None, false),
        (false, 0, None, false),
    ];
    for (acquired, got, held, ours) in rows {
        let mut key = Key::default();
        let actions = key.step(
            Event::Learned {
                acquired,
                ms: got,
                behind_ms: 0,
            },
            t0,
            LIMITS,
        );
        assert_eq!(
            key.view.held_until,
            held.map(|h| t0 + ms(h)),
            "({acquired}, {got})"
        );
        assert_eq!(key.view.ours, ours, "({acquired}, {got})");
        assert!(matches!(actions[..], [Action::Wake]));
    }
    let mut key = Key::default();
    key.step(
        Event::Attempt {
            probe_ms: 100,
            owner: anyone(),
        },
        t0,
        LIMITS,
    );
    key.step(Event::Released, t0 + ms(1), LIMITS);
    let actions = key.step(
        Event::Learned {
            acquired: false,
            ms: 900,
            behind_ms: 0,
        },
        t0 + ms(2),
        LIMITS,
    );
    assert_eq!(
        key.view.held_until, None,
        "the release wins over the stale answer"
    );
    assert!(actions.is_empty());
}

/// Parked attempts queue by their first attempt, whatever order they
/// park in; the first park starts the driver, later ones wake it.
#[test]
fn queue_is_ordered_by_first_attempt() {
    let base = std::time::Instant::now();
    let now = Instant::now();
    let mut key = Key::default();
    let (_c, first) = park(&mut key, 3, "c", base, 30, now);
    assert!(first.iter().any(|a| matches!(a, Action::StartDriver)));
    assert_eq!(key.turn, Turn::Waiting);
    let (_a, later) = park(&mut key, 1, "a", base, 10, now);
    assert!(later.iter().any(|a| matches!(a, Action::Wake)));
    assert!(!later.iter().any(|a| matches!(a, Action::StartDriver)));
    let (_b, _) = park(&mut key, 2, "b", base, 20, now);
    let order: Vec<u64> = key.waiters.iter().map(|w| w.id).collect();
    assert_eq!(order, [1, 2, 3]);
    assert_eq!(tallies(&later), [Tally::Parked]);
}

/// A full queue refuses the attempt, counted; a connection already in
/// the queue takes its own place back even then, and its earlier parked
/// attempt is answered "not acquired".
#[test]
fn queue_bound_is_counted() {
    let base = std::time::Instant::now();
    let now = Instant::now();
    let mut key = Key::default();
    let c = conn();
    let mut rxs = Vec::new();
    for id in 1..=3 {
        let (tx, rx) = oneshot::channel();
        let who = if id == 1 { c.clone() } else { conn() };
        let event = Event::Park {
            id,
            since: base + ms(id),
            reply: tx,
            ask: ask("lock:a", "v", &who),
            timing: TIMING,
        };
        key.step(event, now, LIMITS);
        rxs.push(rx);
    }
    let (_rx, over) = park(&mut key, 4, "late", base, 9, now);
    assert_eq!(tallies(&over), [Tally::WaiterRejected]);
    assert!(over.iter().any(|a| matches!(a, Action::Rejected)));
    assert_eq!(key.waiters.len(), 3);
    let (tx, _again) = oneshot::channel();
    let event = Event::Park {
        id: 5,
        since: base + ms(50),
        reply: tx,
        ask: ask("lock:a", "again", &c),
        timing: TIMING,
    };
    let back = key.step(event, now, LIMITS);
    assert_eq!(
        answered(&back),
        [(1, false)],
        "the earlier attempt is answered"
    );
    assert_eq!(tallies(&back), [Tally::ParkTimeout, Tally::Parked]);
    assert_eq!(
        key.waiters.front().map(|w| &w.ask.value[..]),
        Some(&b"again"[..])
    );
}

/// The driver's look at the key: acquire for the front when the lock may
/// be free or a probe is due, whoever holds it; else sleep until the
/// first thing due.
#[test]
fn tick_acquires_when_free_or_probe_due() {
    let base = std::time::Instant::now();
    let t0 = Instant::now();
    // (held for ms, last probe ms ago, ours) → acquire (None), or sleep ms
    type Row = (Option<u64>, Option<u64>, bool, Option<u64>);
    let rows: [Row; 5] = [
        (None, None, false, None),
        (Some(500), Some(10), false, Some(90)),
        (Some(500), Some(10), true, Some(90)),
        (Some(500), Some(100), true, None),
        (Some(40), Some(10), false, Some(40)),
    ];
    for (held, probed, ours, sleep) in rows {
        let mut key = Key::default();
        let (_rx, _) = park(&mut key, 1, "v", base, 0, t0);
        key.view.held_until = held.map(|h| t0 + ms(h));
        key.view.last_probe = probed.map(|p| t0 - ms(p));
        key.view.ours = ours;
        let actions = key.step(Event::Tick, t0, LIMITS);
        let row = format!("{held:?} {probed:?} {ours}");
        match sleep {
            None => {
                assert_eq!(acquire_for(&actions), Some(1), "{row}");
                assert_eq!(key.turn, Turn::Acquiring { id: 1, releases: 0 }, "{row}");
                assert_eq!(key.view.last_probe, Some(t0), "{row}");
            }
            Some(s) => {
                assert_eq!(acquire_for(&actions), None, "{row}");
                assert_eq!(sleep_until(&actions), Some(t0 + ms(s)), "{row}");
            }
        }
    }
}

/// A park that ends is answered "not acquired", counted, and keeps its
/// place for max(park, probe); when that runs out too the queue empties
/// and the driver ends.
#[test]
fn park_end_keeps_the_place_then_exits() {
    let base = std::time::Instant::now();
    let t0 = Instant::now();
    let mut key = Key::default();
    let (mut rx, _) = park(&mut key, 1, "v", base, 0, t0);
    key.view.held_until = Some(t0 + ms(10_000));
    key.view.last_probe = Some(t0 + ms(150));
    let at_end = key.step(Event::Tick, t0 + ms(200), LIMITS);
    assert_eq!(answered(&at_end), [(1, false)]);
    assert_eq!(tallies(&at_end), [Tally::ParkTimeout]);
    assert!(rx.try_recv().is_err(), "the answer is the caller's to send");
    assert_eq!(key.waiters.len(), 1, "place kept");
    assert_eq!(key.parked(), 0);
    let kept = key.step(Event::Tick, t0 + ms(399), LIMITS);
    assert!(!kept.iter().any(|a| matches!(a, Action::Exit)));
    let gone = key.step(Event::Tick, t0 + ms(400), LIMITS);
    assert!(gone.iter().any(|a| matches!(a, Action::Exit)));
    assert_eq!(key.turn, Turn::Off);
    assert!(key.idle(t0 + ms(10_001)));
}

/// The spinner whose kept place is at the front of the queue is behind
/// nobody: once the lock is free its own next attempt goes to Redis (one
/// pipelined, which cannot park, was answered "not acquired" for a free
/// lock: the differential test, seed 416058946), while any other
/// connection's, also a younger spinner's with its own place, is absorbed.
#[test]
fn the_front_spinners_own_attempt_asks_redis() {
    let base = std::time::Instant::now();
    let t0 = Instant::now();
    let mut key = Key::default();
    let (front, young) = (conn(), conn());
    let id_of = |c: &std::sync::Arc<std::sync::Mutex<crate::lock::lease::ConnLocks>>| {
        crate::sync::lock(c).id
    };
    for (id, c, since) in [(1, &front, 0), (2, &young, 1)] {
        let event = Event::Park {
            id,
            since: base + ms(since),
            reply: oneshot::channel().0,
            ask: ask("lock:a", "v", c),
            timing: TIMING,
        };
        key.step(event, t0, LIMITS);
    }
    key.view.held_until = Some(t0 + ms(10_000));
    key.view.last_probe = Some(t0 + ms(150));
    let at_end = key.step(Event::Tick, t0 + ms(200), LIMITS);
    assert_eq!(answered(&at_end).len(), 2, "both parks ended");
    assert_eq!(key.waiters.len(), 2, "both places kept");
    key.step(Event::Released, t0 + ms(201), LIMITS);
    let attempt = |key: &mut Key, owner, at| {
        admission(&key.step(
            Event::Attempt {
                probe_ms: 100,
                owner,
            },
            t0 + ms(at),
            LIMITS,
        ))
    };
    let turns = [
        (anyone(), 202, Admission::Absorb, "a newcomer"),
        (id_of(&young), 203, Admission::Absorb, "the younger spinner"),
        (id_of(&front), 204, Admission::Probe, "the front spinner"),
        (
            id_of(&young),
            205,
            Admission::Absorb,
            "nobody wins while it is on its way",
        ),
    ];
    for (owner, at, want, who) in turns {
        assert_eq!(attempt(&mut key, owner, at), Some(want), "{who}");
    }
    assert_eq!(
        key.view.probing,
        Some(t0 + ms(204)),
        "the front spinner's attempt in flight"
    );
    // The driver was refused without learning a holder (a key without
    // lease): back-off. The front spinner's attempts wait it out too, or
    // each would ask Redis (tests/it/storm_handoff.rs: the incident's key).
    key.view.probing = None;
    key.view.backoff_until = Some(t0 + ms(400));
    key.view.last_probe = Some(t0 + ms(250));
    for (at, want, when) in [
        (300, Admission::Absorb, "backing off"),
        (400, Admission::Probe, "back-off over"),
    ] {
        assert_eq!(attempt(&mut key, id_of(&front), at), Some(want), "{when}");
    }
}

/// A back-off holds back only the front spinner's own attempts: with no
/// queue on the key, an attempt goes to Redis (`tests/it/sentinel.rs`: the
/// first attempt after a failover hold ended was refused while the
/// driver's back-off from the hold still ran).
#[test]
fn a_back_off_alone_holds_nobody_back() {
    let t0 = Instant::now();
    let mut key = Key::default();
    key.view.backoff_until = Some(t0 + ms(100));
    key.view.last_probe = Some(t0);
    let attempt = Event::Attempt {
        probe_ms: 100,
        owner: anyone(),
    };
    let actions = key.step(attempt, t0 + ms(10), LIMITS);
    assert_eq!(admission(&actions), Some(Admission::Probe));
}

/// What the driver's acquisition teaches: acquired hands the lock to the
/// waiter; refused with a holder's lease waits for it; refused without a
/// lease (an outage, a fairness yield) backs off; a release that came
/// meanwhile wins over a stale refusal.
#[test]
fn acquisition_outcomes() {
    let base = std::time::Instant::now();
    let t0 = Instant::now();
    let start = |key: &mut Key| {
        let (rx, _) = park(key, 1, "v", base, 0, t0);
        let _ = park(key, 2, "w", base, 1, t0);
        assert_eq!(acquire_for(&key.step(Event::Tick, t0, LIMITS)), Some(1));
        rx
    };
    let done = |acquired, pttl| {
        Event::Acquired(Acquisition {
            id: 1,
            acquired,
            pttl,
            lease_ms: 700,
            behind_ms: 0,
        })
    };

    let mut key = Key::default();
    let _rx = start(&mut key);
    let won = key.step(done(true, 0), t0 + ms(5), LIMITS);
    assert_eq!(tallies(&won), [Tally::Handoff]);
    assert!(won.iter().any(|a| matches!(
        a,
        Action::Handoff {
            id: 1,
            reply: Some(_),
            ..
        }
    )));
    assert_eq!(key.view.held_until, Some(t0 + ms(705)));
    assert!(key.view.ours);
    assert_eq!(key.waiters.front().map(|w| w.id), Some(2));
    assert_eq!(key.turn, Turn::Waiting);

    let mut key = Key::default();
    let _rx = start(&mut key);
    key.step(done(false, 300), t0 + ms(5), LIMITS);
    assert_eq!(key.view.held_until, Some(t0 + ms(305)));
    assert_eq!(key.view.backoff_until, None);

    // PTTL 0: the lease ends within the millisecond (Redis's clock a
    // little behind ours): asked again at once, not at the next probe.
    let mut key = Key::default();
    let _rx = start(&mut key);
    key.step(done(false, 0), t0 + ms(5), LIMITS);
    assert_eq!(key.view.held_until, Some(t0 + ms(6)));
    assert_eq!(key.view.backoff_until, None);
    assert_eq!(
        acquire_for(&key.step(Event::Tick, t0 + ms(6), LIMITS)),
        Some(1)
    );

    let mut key = Key::default();
    let _rx = start(&mut key);
    key.step(done(false, -2), t0 + ms(5), LIMITS);
    assert_eq!(key.view.held_until, None);
    assert_eq!(key.view.backoff_until, Some(t0 + ms(205)));
    // Not free (backing off): the next try is the probe, one interval on.
    let next = key.step(Event::Tick, t0 + ms(6), LIMITS);
    assert_eq!(sleep_until(&next), Some(t0 + ms(100)));
    assert_eq!(
        acquire_for(&key.step(Event::Tick, t0 + ms(100), LIMITS)),
        Some(1)
    );

    let mut key = Key::default();
    let _rx = start(&mut key);
    key.step(Event::Released, t0 + ms(3), LIMITS);
    key.step(done(false, 900), t0 + ms(5), LIMITS);
    assert_eq!(key.view.held_until, None, "the release wins");
}

/// A release that goes to the first fencing wait in line (it came before
/// every attempt parked here): the lock is free, but neither the driver nor
/// a spinner asks while the wait's attempt is on its way; its grant is
/// learned (held, ours), its "not acquired" lets the others ask again,
/// and a probe interval bounds the wait if no answer comes.
#[test]
fn a_release_lined_for_a_fencing_wait_holds_the_others_back_until_its_answer() {
    let base = std::time::Instant::now();
    let t0 = Instant::now();
    // (answer at ms: granted for ms / not acquired / none) → the driver
    // at t0 + 5: acquires, or sleeps until
    type Row = (Option<Option<u64>>, u64, Option<u64>);
    let rows: [Row; 3] = [
        // Granted for 500 ms: held (ours) until then, the probe due at 105.
        (Some(Some(500)), 5, Some(105)),
        // Not acquired: the others ask at once.
        (Some(None), 5, None),
        // No answer: they wait out the probe interval from the release.
        (None, 5, Some(100)),
    ];
    for (answer, at, sleep) in rows {
        let mut key = Key::default();
        let (_rx, _) = park(&mut key, 1, "v", base, 0, t0);
        key.view.held_until = Some(t0 + ms(300));
        let actions = key.step(Event::Lined, t0, LIMITS);
        assert!(actions.iter().any(|a| matches!(a, Action::Wake)));
        assert!(key.view.held_until.is_none(), "released");
        let tick = key.step(Event::Tick, t0, LIMITS);
        assert_eq!(acquire_for(&tick), None, "{answer:?}: the wait's turn");
        let spinner = key.step(
            Event::Attempt {
                probe_ms: 100,
                owner: anyone(),
            },
            t0 + ms(1),
            LIMITS,
        );
        assert_eq!(admission(&spinner), Some(Admission::Absorb), "{answer:?}");
        let now = t0 + ms(at);
        match answer {
            Some(Some(lease)) => {
                let learned = Event::Learned {
                    acquired: true,
                    ms: lease as i64,
                    behind_ms: 0,
                };
                key.step(learned, now, LIMITS);
                assert!(key.view.ours);
            }
            Some(None) => {
                key.step(Event::Unprobed, now, LIMITS);
            }
            None => {}
        }
        let tick = key.step(Event::Tick, now, LIMITS);
        match sleep {
            None => assert_eq!(acquire_for(&tick), Some(1), "{answer:?}"),
            Some(s) => {
                assert_eq!(acquire_for(&tick), None, "{answer:?}");
                assert_eq!(sleep_until(&tick), Some(t0 + ms(s)), "{answer:?}");
            }
        }
    }
}

/// When an attempt was last answered "not acquired" from the view: an
/// absorbed attempt and a park's end set it; an attempt sent to Redis, an
/// answer learned and a release do not. A client's script that released
/// the key, sent before it, may have made that answer stale
/// (`Storm::refused_since`).
#[test]
fn refusals_from_the_view_are_timed() {
    let base = std::time::Instant::now();
    let t0 = Instant::now();
    let mut key = Key::default();
    let event = |what: &str| match what {
        "attempt" => Event::Attempt {
            probe_ms: 100,
            owner: anyone(),
        },
        "held" => Event::Learned {
            acquired: false,
            ms: 5_000,
            behind_ms: 0,
        },
        "released" => Event::Released,
        _ => Event::Tick,
    };
    // (event, at ms) → refused_at after it, ms (None: never refused).
    let table = [
        ("attempt", 0, None),
        ("held", 1, None),
        ("attempt", 2, Some(2)),
        ("attempt", 5, Some(5)),
        ("released", 6, Some(5)),
        ("attempt", 7, Some(5)),
        ("held", 8, Some(5)),
        ("tick", 9, Some(5)),
    ];
    for (what, at, want) in table {
        key.step(event(what), t0 + ms(at), LIMITS);
        let got = (key.view.refused_at).map(|r| r.duration_since(t0).as_millis() as u64);
        assert_eq!(got, want, "{what} at {at} ms");
    }
    // A park that ends unanswered is a refusal too.
    let mut key = Key::default();
    let _ = park(&mut key, 1, "v", base, 0, t0);
    key.view.held_until = Some(t0 + ms(10_000));
    key.view.last_probe = Some(t0 + ms(150));
    key.step(Event::Tick, t0 + ms(200), LIMITS);
    assert_eq!(key.view.refused_at, Some(t0 + ms(200)));
}
