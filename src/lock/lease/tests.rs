//! The lease records' unit tests.

use super::*;

use std::time::Duration;

#[test]
fn tokens_grow_and_carry_the_instance() {
    let t = Tokens::new("host:6380");
    let (a, b) = (t.next(), t.next());
    assert!(a.starts_with(b"host:6380:"));
    assert_ne!(a, b);
}

#[test]
fn table_is_bounded() {
    let mut c = ConnLocks::new(2);
    for k in ["a", "b", "c"] {
        c.attempt(
            Bytes::from(k),
            Bytes::from("t"),
            Bytes::new(),
            Standing::Held,
            10,
        );
    }
    assert_eq!(c.len(), 2);
    assert_eq!(c.evicted, 1);
    assert!(c.get(b"a").is_none());
}

#[test]
fn a_full_table_drops_the_record_given_longest_ago() {
    let mut c = ConnLocks::new(2);
    let k = |s: &'static str| Bytes::from(s);
    c.attempt(k("a"), k("ta"), Bytes::new(), Standing::Trying, 10);
    c.attempt(k("b"), k("tb"), Bytes::new(), Standing::Trying, 10);
    // Held since now: newer than b's.
    c.settle(b"a", b"ta", Standing::Held, None);
    c.attempt(k("c"), k("tc"), Bytes::new(), Standing::Trying, 10);
    assert!(c.get(b"b").is_none() && c.get(b"a").is_some());
    for i in 0..1000u32 {
        c.attempt(
            Bytes::from(i.to_string()),
            k("t"),
            Bytes::new(),
            Standing::Held,
            10,
        );
    }
    assert_eq!((c.len(), c.evicted), (2, 1001));
    assert!(c.order.len() <= 2 * 2 + 64 + 1);
}

#[test]
fn settle_only_matches_the_same_token() {
    let mut c = ConnLocks::new(4);
    c.attempt(
        Bytes::from("k"),
        Bytes::from("t1"),
        Bytes::new(),
        Standing::Trying,
        10,
    );
    c.settle(b"k", b"t0", Standing::Held, None);
    assert_eq!(c.get(b"k").map(|a| a.standing), Some(Standing::Trying));
    c.settle(b"k", b"t1", Standing::Lost, None);
    assert_eq!(c.get(b"k").map(|a| a.standing), Some(Standing::Lost));
}

/// Two re-entrant attempts pipelined by a holder whose lock was deleted
/// behind lockgate's back: the first wins, the second loses. The
/// connection holds by the first one's token, so its extension passes the
/// owner check (found by the differential test once such attempts went to
/// Redis instead of being absorbed).
#[test]
fn an_earlier_pipelined_attempt_that_won_holds_the_key() {
    let mut c = ConnLocks::new(8);
    let key = Bytes::from_static(b"lock:a");
    let v = Bytes::from_static(b"v");
    c.attempt(
        key.clone(),
        Bytes::from_static(b"t:1"),
        v.clone(),
        Standing::Trying,
        1000,
    );
    c.settle(&key, b"t:1", Standing::Held, None);
    c.attempt(
        key.clone(),
        Bytes::from_static(b"t:2"),
        v.clone(),
        Standing::Trying,
        1000,
    );
    c.attempt(
        key.clone(),
        Bytes::from_static(b"t:3"),
        v.clone(),
        Standing::Trying,
        1000,
    );
    c.settle(&key, b"t:2", Standing::Held, Some(2000));
    c.settle(&key, b"t:3", Standing::Lost, None);
    let a = c.get(&key).expect("record");
    assert_eq!(a.standing, Standing::Held);
    assert_eq!(&a.token[..], b"t:2");
    assert_eq!(a.lease_ms, 2000);
    assert!(a.retry.is_none());
}

/// `SETNX` then `GETSET` pipelined, the `SETNX` answered after the
/// takeover was recorded: the takeover ran later on Redis and its token is
/// the owner record's, so the `SETNX` that won does not take the record
/// back (found by the differential test, seed 466929453: a `MULTI` with a
/// re-entrant `SETNX` and an `EXPIRE` then carried the older token and the
/// `EXPIRE` was refused).
#[test]
fn a_takeover_pipelined_after_an_attempt_keeps_the_record() {
    let mut c = ConnLocks::new(8);
    let key = Bytes::from_static(b"lock:a");
    c.attempt(
        key.clone(),
        Bytes::from_static(b"t:1"),
        Bytes::from_static(b"v"),
        Standing::Trying,
        1000,
    );
    c.took_over(key.clone(), Bytes::from_static(b"t:2"), 1000);
    c.settle(&key, b"t:1", Standing::Held, None);
    let a = c.get(&key).expect("record");
    assert_eq!(a.standing, Standing::Held);
    assert_eq!(&a.token[..], b"t:2", "the takeover holds");
    assert!(a.takeover);
    assert!(a.unsettled.is_empty(), "the earlier attempt is settled");
    assert_eq!(c.attempt_tokens(&key).0, Bytes::from_static(b"t:2"));
}

#[test]
fn a_holder_that_ran_a_script_on_its_lock_spins_from_its_second_attempt_after_it() {
    let window = std::time::Duration::from_secs(1);
    let mut c = ConnLocks::new(4);
    let k = Bytes::from_static(b"lock:a");
    c.attempt(
        k.clone(),
        Bytes::from("t1"),
        Bytes::new(),
        Standing::Held,
        10,
    );
    let held_since = c.first_try(&k).expect("a record");
    c.lost(k.clone(), Bytes::from("t2"), Bytes::new());
    assert!(!c.spinning(&k, window), "a holder's own attempt is no spin");
    std::thread::sleep(std::time::Duration::from_millis(2));
    // The compare-and-delete release, acknowledged.
    c.scripted(&k);
    let a = c.get(&k).expect("still on record");
    assert_eq!(
        a.standing,
        Standing::Held,
        "the owner record decides, not this"
    );
    assert!(a.first_try > held_since, "a new run of attempts");
    assert!(!c.spinning(&k, window), "its first attempt after is a try");
    c.lost(k.clone(), Bytes::from("t3"), Bytes::new());
    assert!(c.spinning(&k, window), "the next one spins: it may park");
    assert!(
        !c.spinning(&k, std::time::Duration::ZERO),
        "not past the window"
    );
    // Held again: a new holding, no longer after a script.
    c.attempt(
        k.clone(),
        Bytes::from("t4"),
        Bytes::new(),
        Standing::Trying,
        10,
    );
    c.settle(&k, b"t4", Standing::Held, None);
    assert_eq!(c.get(&k).and_then(|a| a.after_script), None);
    // A loser's record is a spinner's as before; a script leaves it be.
    let mut d = ConnLocks::new(4);
    d.lost(k.clone(), Bytes::from("u1"), Bytes::new());
    d.lost(k.clone(), Bytes::from("u2"), Bytes::new());
    assert!(d.spinning(&k, window));
    d.scripted(&k);
    assert_eq!(d.get(&k).and_then(|a| a.after_script), None);
}

/// `Acquisition::lapsed` as a table of `now`: a holding's lease runs out
/// at `since + lease_ms`, or at its last extension's end if later; a
/// lease of unknown length and a record not held never lapse.
#[test]
fn a_holding_lapses_when_its_lease_runs_out_by_this_clock() {
    let t0 = Instant::now();
    let ms = Duration::from_millis;
    let record = |standing, lease_ms, extended: Option<u64>| Acquisition {
        token: Bytes::from_static(b"t:1"),
        standing,
        since: t0,
        lease_ms,
        value: Bytes::new(),
        first_try: t0,
        last_try: t0,
        retry: None,
        unsettled: Vec::new(),
        takeover: false,
        after_script: None,
        extended_until: extended.map(|e| t0 + ms(e)),
    };
    // standing, lease, extended to, now, lapsed at (ms after t0)
    type Row = (Standing, u64, Option<u64>, u64, Option<u64>);
    let rows: [Row; 8] = [
        (Standing::Held, 1000, None, 999, None),
        (Standing::Held, 1000, None, 1000, Some(1000)),
        (Standing::Held, 1000, None, 5000, Some(1000)),
        (Standing::Held, 1000, Some(3000), 2000, None),
        (Standing::Held, 1000, Some(3000), 3000, Some(3000)),
        // An extension that shortened the lease does not end it sooner.
        (Standing::Held, 1000, Some(500), 800, None),
        (Standing::Held, 0, None, 60_000, None),
        (Standing::Lost, 1000, None, 5000, None),
    ];
    for (standing, lease, extended, now, want) in rows {
        let a = record(standing, lease, extended);
        let got = a.lapsed(t0 + ms(now));
        assert_eq!(
            got,
            want.map(|w| t0 + ms(w)),
            "{standing:?} lease {lease} extended {extended:?} at {now}"
        );
    }
}

/// A connection whose release never reached Redis stays the holder on
/// record; once its lease ran out, its next attempts are a loser's spin
/// (it parks and takes its place in line from when the lease ran out),
/// where before they counted as a holder's re-entrant ones for good. An
/// extension through it keeps it the holder.
#[test]
fn a_holder_whose_lease_ran_out_spins_like_a_loser() {
    let mut c = ConnLocks::new(4);
    let key = Bytes::from_static(b"lock:k");
    c.attempt(
        key.clone(),
        Bytes::from_static(b"t:1"),
        Bytes::new(),
        Standing::Held,
        1000,
    );
    let window = Duration::from_millis(100);
    // Its own attempt while the lease runs: a holder's.
    assert!(c
        .lost(key.clone(), Bytes::from_static(b"t:2"), Bytes::new())
        .is_some());
    assert!(!c.spinning(&key, window));
    // The lease ran out 1 s ago (the record's clock moved back by 2 s).
    let back = Duration::from_secs(2);
    let a = c.map.get_mut(&key).expect("the record");
    a.since -= back;
    a.first_try -= back * 2;
    a.last_try -= back;
    let before = Instant::now();
    c.lost(key.clone(), Bytes::from_static(b"t:3"), Bytes::new());
    assert!(
        c.spinning(&key, window),
        "a loser's spin once the lease ran out"
    );
    let began = c.first_try(&key).expect("a record");
    assert!(
        began >= before,
        "its run began at its first attempt after the lapse"
    );
    c.lost(key.clone(), Bytes::from_static(b"t:3b"), Bytes::new());
    assert_eq!(c.first_try(&key), Some(began), "and goes on from there");
    assert_eq!(c.get(&key).map(|a| a.standing), Some(Standing::Held));
    // An extension through it: the holder's again.
    c.extended(&key, 5000);
    c.lost(key.clone(), Bytes::from_static(b"t:4"), Bytes::new());
    assert!(!c.spinning(&key, window));
}

/// A client script released the key: the holding it names ends, its record
/// stays as a lost one (the connection's kept places are still found when
/// it closes); an attempt already on its way takes the record over; a
/// holding by another token, or none, is left alone.
#[test]
fn a_script_release_ends_the_holding_it_names_and_keeps_the_record() {
    let k = |s: &'static str| Bytes::from(s);
    let mut c = ConnLocks::new(4);
    c.attempt(k("a"), k("t1"), k("v1"), Standing::Trying, 10);
    c.settle(b"a", b"t1", Standing::Held, None);
    assert!(c.script_released(b"a", b"t0").is_none(), "another token");
    assert!(c.script_released(b"b", b"t1").is_none(), "no record");
    let ended = c.script_released(b"a", b"t1").map(|e| e.token);
    assert_eq!(ended.as_deref(), Some(&b"t1"[..]));
    assert_eq!(c.get(b"a").map(|a| a.standing), Some(Standing::Lost));
    assert!(c.script_released(b"a", b"t1").is_none(), "ended once");

    // Held by t2, a re-entrant t3 on its way when the script's release is
    // learned: t3 is the record's now, and its reply settles it.
    c.attempt(k("a"), k("t2"), k("v2"), Standing::Trying, 10);
    c.settle(b"a", b"t2", Standing::Held, None);
    c.attempt(k("a"), k("t3"), k("v3"), Standing::Trying, 10);
    assert!(c.get(b"a").is_some_and(|a| a.retry.is_some()));
    assert!(c.script_released(b"a", b"t2").is_some());
    let a = c
        .get(b"a")
        .map(|a| (a.token.clone(), a.value.clone(), a.standing));
    assert_eq!(a, Some((k("t3"), k("v3"), Standing::Trying)));
    c.settle(b"a", b"t3", Standing::Held, None);
    assert_eq!(c.get(b"a").map(|a| a.standing), Some(Standing::Held));
}
