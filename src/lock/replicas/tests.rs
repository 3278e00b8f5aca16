//! [`judge`] as a table: what a round tells a waiter.

use std::time::{Duration, Instant};

use super::*;

fn round(acked: Result<i64, &str>, now: Instant) -> Round {
    Round {
        acked: acked.map_err(str::to_string),
        before: 7,
        after: 7,
        now,
    }
}

#[test]
fn a_round_judges_each_waiter() {
    let t0 = Instant::now();
    let later = t0 + Duration::from_millis(100);
    let refused = "ERR WAIT cannot be used with replica instances";
    #[rustfmt::skip]
    let cases: Vec<(&str, Round, u32, u32, Instant, Verdict)> = vec![
        ("enough replicas", round(Ok(2), t0), 2, 7, later, Verdict::Done(Ok(()))),
        ("more than enough", round(Ok(3), t0), 1, 7, later, Verdict::Done(Ok(()))),
        ("too few, time left: the next round", round(Ok(1), t0), 2, 7, later, Verdict::Wait),
        ("too few, time up", round(Ok(1), later), 2, 7, later,
            Verdict::Done(Err(AckError::Timeout { got: 1, wanted: 2, timeout_ms: 0 }))),
        ("none at all, time up", round(Ok(0), later + Duration::from_millis(1)), 1, 7, later,
            Verdict::Done(Err(AckError::Timeout { got: 0, wanted: 1, timeout_ms: 0 }))),
        ("planned under an earlier primary", round(Ok(2), t0), 1, 6, later,
            Verdict::Done(Err(AckError::Moved))),
        ("not asked, time left: asked again", round(Err(refused), t0), 1, 7, later, Verdict::Wait),
        ("not asked, time up", round(Err(refused), later), 1, 7, later,
            Verdict::Done(Err(AckError::Upstream(refused.into())))),
    ];
    for (what, r, replicas, generation, deadline, want) in cases {
        assert_eq!(judge(&r, replicas, generation, deadline), want, "{what}");
    }
}

#[test]
fn a_switch_during_the_round_fails_every_waiter() {
    let t0 = Instant::now();
    let mut r = round(Ok(2), t0);
    r.after = 8;
    let got = judge(&r, 1, 7, t0 + Duration::from_secs(1));
    assert_eq!(got, Verdict::Done(Err(AckError::Moved)));
}
