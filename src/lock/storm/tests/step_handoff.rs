//! The key's state machine around handoffs carried by releases (claims)
//! and around leaving: claims, handovers, a waiter gone mid-handoff, stop.

use bytes::Bytes;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::super::event::{Action, Event, Tally};
use super::super::key::{Key, Turn};
use super::super::Claim;
use super::step::{acquire_for, answered, ms, park, sleep_until, tallies, LIMITS, TIMING};
use super::{ask, conn};

/// A release carrying a handoff claims the front waiter: no claim while
/// the driver acquires; while claimed the waiter is neither timed out nor
/// tried for; the release's answer hands it over, or the claim lapses.
#[test]
fn claims_and_handovers() {
    let base = std::time::Instant::now();
    let t0 = Instant::now();
    let claim_at = |key: &mut Key, at: u64| {
        let event = Event::Claim {
            token: Bytes::from_static(b"t"),
            within: ms(50),
        };
        key.step(event, t0 + ms(at), LIMITS)
            .into_iter()
            .find_map(|a| match a {
                Action::Claimed(c) => Some(c),
                _ => None,
            })
    };
    let mut key = Key::default();
    let (_rx, _) = park(&mut key, 1, "v", base, 0, t0);
    assert_eq!(acquire_for(&key.step(Event::Tick, t0, LIMITS)), Some(1));
    assert_eq!(claim_at(&mut key, 1), None, "the driver is acquiring");

    let mut key = Key::default();
    let (_rx, _) = park(&mut key, 1, "v", base, 0, t0);
    key.view.held_until = Some(t0 + ms(10_000));
    key.view.last_probe = Some(t0 + ms(190));
    let claim = claim_at(&mut key, 190).expect("front claimed");
    assert_eq!(
        (claim.id, &claim.value[..], claim.lease_ms),
        (1, &b"v"[..], 1_000)
    );
    assert_eq!(claim_at(&mut key, 191), None, "one claim at a time");
    let during = key.step(Event::Tick, t0 + ms(210), LIMITS);
    assert!(
        answered(&during).is_empty(),
        "a claimed waiter is not timed out"
    );
    assert_eq!(acquire_for(&during), None);
    // The claimed waiter's own deadline has passed, so the driver looks
    // again every millisecond until the claim is settled or lapses (as it
    // did before the state machine was extracted).
    assert_eq!(sleep_until(&during), Some(t0 + ms(211)));
    let lapsed = key.step(Event::Tick, t0 + ms(240), LIMITS);
    assert_eq!(answered(&lapsed), [(1, false)], "lapsed: its park is over");

    let mut key = Key::default();
    let (_rx, _) = park(&mut key, 1, "v", base, 0, t0);
    let claim = claim_at(&mut key, 5).expect("front claimed");
    let handed = key.step(Event::HandedOver { claim }, t0 + ms(8), LIMITS);
    assert!(handed
        .iter()
        .any(|a| matches!(a, Action::HandedOver { waiter } if waiter.id == 1)));
    assert_eq!(tallies(&handed), [Tally::Handoff]);
    assert_eq!(key.view.held_until, Some(t0 + ms(1_008)));
    assert_eq!(key.turn, Turn::Waiting);
    assert!(key.waiters.is_empty());
}

/// A waiter that left while a release carried the lock to it (its
/// connection closed, or it released its kept place): the handoff finds
/// nobody, and the view still says this instance holds the lock, as the
/// release's script gave it away.
#[test]
fn waiter_gone_mid_handoff() {
    let base = std::time::Instant::now();
    let t0 = Instant::now();
    let mut key = Key::default();
    let c = conn();
    let (tx, _rx) = oneshot::channel();
    let event = Event::Park {
        id: 1,
        since: base,
        reply: tx,
        ask: ask("lock:a", "v", &c),
        timing: TIMING,
    };
    key.step(event, t0, LIMITS);
    let claim = Claim {
        id: 1,
        token: Bytes::from_static(b"t"),
        value: Bytes::from_static(b"v"),
        lease_ms: 500,
    };
    assert!(matches!(
        key.step(
            Event::Claim {
                token: claim.token.clone(),
                within: ms(50)
            },
            t0,
            LIMITS
        )[..],
        [Action::Claimed(_)]
    ));
    // The claim lapses and the park ends; then the connection leaves.
    key.step(Event::Tick, t0 + ms(250), LIMITS);
    key.step(
        Event::Left {
            owner: crate::sync::lock(&c).id,
        },
        t0 + ms(260),
        LIMITS,
    );
    assert!(key.waiters.is_empty());
    let late = key.step(Event::HandedOver { claim }, t0 + ms(270), LIMITS);
    assert!(tallies(&late).is_empty(), "no handoff counted");
    assert_eq!(
        key.holder(t0 + ms(271)).map(|(who, _)| who),
        Some("this instance")
    );
}

/// Stopping answers every parked attempt "not acquired" and ends the
/// driver.
#[test]
fn stop_answers_everyone() {
    let base = std::time::Instant::now();
    let t0 = Instant::now();
    let mut key = Key::default();
    let _a = park(&mut key, 1, "a", base, 0, t0);
    let _b = park(&mut key, 2, "b", base, 1, t0);
    let out = key.step(Event::Stopped, t0, LIMITS);
    assert_eq!(answered(&out), [(1, false), (2, false)]);
    assert!(out.iter().any(|a| matches!(a, Action::Exit)));
    assert_eq!(key.turn, Turn::Off);
}
