//! A key behind another instance in the store's queue: it waits for its
//! wake-up (a release through any instance wakes the queue's head alone)
//! and asks the store again only when its renewal is due, one step at a
//! time with made-up times.

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::super::event::{Acquisition, Event};
use super::super::key::{Key, Timing};
use super::super::Admission;
use super::step::{acquire_for, admission, ms, sleep_until, LIMITS};
use super::{anyone, ask, conn};

/// Probe interval of these tests, ms, and how long "behind" lasts.
const PROBE_MS: u64 = 100;
const RENEW_MS: u64 = 600;

fn attempt(key: &mut Key, now: Instant) -> Option<Admission> {
    let event = Event::Attempt {
        probe_ms: PROBE_MS,
        owner: anyone(),
    };
    admission(&key.step(event, now, LIMITS))
}

/// What each answer and event does to the admission of later attempts:
/// a table of (what happened after a first failed probe at 0 ms, the
/// attempt's time, the admission expected). The answer said the lock is
/// held for 5 s more; "behind" means another instance is first in the
/// store's queue, to be renewed after 600 ms.
#[test]
fn behind_another_instance_attempts_wait_for_the_wake_up_or_the_renewal() {
    enum Then {
        Nothing,
        Released,
        Resubscribed,
    }
    struct Row {
        name: &'static str,
        behind_ms: u64,
        then: Then,
        at: u64,
        expect: Admission,
    }
    let rows = [
        Row {
            name: "first in the queue: probes each probe interval",
            behind_ms: 0,
            then: Then::Nothing,
            at: 102,
            expect: Admission::Probe,
        },
        Row {
            name: "behind: not at the next probe interval",
            behind_ms: RENEW_MS,
            then: Then::Nothing,
            at: 102,
            expect: Admission::Absorb,
        },
        Row {
            name: "behind: not just before the renewal",
            behind_ms: RENEW_MS,
            then: Then::Nothing,
            at: 600,
            expect: Admission::Absorb,
        },
        Row {
            name: "behind: the renewal is due",
            behind_ms: RENEW_MS,
            then: Then::Nothing,
            at: 602,
            expect: Admission::Probe,
        },
        Row {
            name: "behind, then woken: at once",
            behind_ms: RENEW_MS,
            then: Then::Released,
            at: 51,
            expect: Admission::Probe,
        },
        Row {
            name: "behind, then the wake-up channel came back: wake-ups may be lost, asks",
            behind_ms: RENEW_MS,
            then: Then::Resubscribed,
            at: 102,
            expect: Admission::Probe,
        },
        Row {
            name: "first in the queue, the channel came back: still within the probe interval",
            behind_ms: 0,
            then: Then::Resubscribed,
            at: 51,
            expect: Admission::Absorb,
        },
    ];
    for row in rows {
        let t0 = Instant::now();
        let mut key = Key::default();
        assert_eq!(
            attempt(&mut key, t0),
            Some(Admission::Probe),
            "{}",
            row.name
        );
        let learned = Event::Learned {
            acquired: false,
            ms: 5_000,
            behind_ms: row.behind_ms,
        };
        key.step(learned, t0 + ms(1), LIMITS);
        match row.then {
            Then::Nothing => {}
            Then::Released => drop(key.step(Event::Released, t0 + ms(50), LIMITS)),
            Then::Resubscribed => drop(key.step(Event::Resubscribed, t0 + ms(50), LIMITS)),
        }
        assert_eq!(
            attempt(&mut key, t0 + ms(row.at)),
            Some(row.expect),
            "{}",
            row.name
        );
    }
}

/// An acquisition clears "behind": the holder is nobody's follower.
#[test]
fn an_acquisition_is_never_behind() {
    let t0 = Instant::now();
    let mut key = Key::default();
    let learned = Event::Learned {
        acquired: true,
        ms: 1_000,
        behind_ms: RENEW_MS,
    };
    key.step(learned, t0, LIMITS);
    assert_eq!(key.view.behind_until, None);
}

/// The driver of a key behind another instance sleeps until the renewal
/// (not the probe interval, not the holder's lease), acquires at once when
/// woken, and an answer that was on its way while the wake-up came does
/// not put it behind again.
#[test]
fn the_driver_behind_sleeps_until_the_renewal_or_the_wake_up() {
    let base = std::time::Instant::now();
    let t0 = Instant::now();
    let timing = Timing {
        park_ms: 10_000,
        probe_ms: PROBE_MS,
    };
    let start = |key: &mut Key| {
        let c = conn();
        let (tx, rx) = oneshot::channel();
        let park = Event::Park {
            id: 1,
            since: base,
            reply: tx,
            ask: ask("lock:a", "v", &c),
            timing,
        };
        key.step(park, t0, LIMITS);
        assert_eq!(acquire_for(&key.step(Event::Tick, t0, LIMITS)), Some(1));
        rx
    };
    let failed_behind = || {
        Event::Acquired(Acquisition {
            id: 1,
            acquired: false,
            pttl: 5_000,
            lease_ms: 1_000,
            behind_ms: RENEW_MS,
        })
    };

    let mut key = Key::default();
    let _rx = start(&mut key);
    key.step(failed_behind(), t0 + ms(5), LIMITS);
    let sleep = sleep_until(&key.step(Event::Tick, t0 + ms(6), LIMITS));
    assert_eq!(
        sleep,
        Some(t0 + ms(5 + RENEW_MS)),
        "sleeps until the renewal"
    );
    let at = t0 + ms(5 + RENEW_MS);
    assert_eq!(
        acquire_for(&key.step(Event::Tick, at, LIMITS)),
        Some(1),
        "renews its place when due"
    );

    let mut key = Key::default();
    let _rx = start(&mut key);
    key.step(failed_behind(), t0 + ms(5), LIMITS);
    key.step(Event::Released, t0 + ms(50), LIMITS);
    assert_eq!(
        acquire_for(&key.step(Event::Tick, t0 + ms(50), LIMITS)),
        Some(1),
        "woken: acquires at once"
    );

    let mut key = Key::default();
    let _rx = start(&mut key);
    key.step(Event::Released, t0 + ms(2), LIMITS);
    key.step(failed_behind(), t0 + ms(5), LIMITS);
    assert_eq!(
        key.view.behind_until, None,
        "the wake-up came while the answer was on its way: not behind"
    );
}
