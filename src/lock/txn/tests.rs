//! The scripts' decisions, as transactions make them: tables.

use bytes::Bytes;

use super::emulate::*;
use super::*;
use crate::lock::evalsha::Call;

use crate::lock::txn::resp::{cmd, int};
use crate::script::{self, Script};

fn b(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

fn job(kind: Script, keys: &[&str], argv: &[&str]) -> Job {
    Job {
        kind,
        keys: keys.iter().map(|k| b(k)).collect(),
        argv: argv.iter().map(|a| b(a)).collect(),
    }
}

#[test]
fn the_owner_check_is_the_scripts() {
    // (owner, tok, alt, prefix, any, born) → (allowed, lapsed, stale)
    type Row<'a> = (
        Option<&'a str>,
        &'a str,
        &'a str,
        bool,
        &'a str,
        (bool, i64, i64),
    );
    let rows: [Row; 10] = [
        (Some("a:5"), "", "", true, "9", (true, 0, 0)),
        (None, "", "", false, "1", (true, 0, 0)),
        (None, "a:5", "", false, "1", (false, 1, 0)),
        (Some("a:5"), "a:5", "", false, "1", (true, 0, 0)),
        (Some("a:6"), "a:5", "", false, "1", (false, 1, 0)),
        (Some("a:6"), "a:5", "a:7\na:6", false, "1", (true, 0, 0)),
        (Some("a:6"), "a:5", "a:66", false, "1", (false, 1, 0)),
        (Some("b:9"), "", "", false, "1", (false, 0, 0)),
        (Some("a:9"), "", "", false, "9", (true, 0, 0)),
        (Some("a:8"), "", "", false, "9", (false, 0, 1)),
    ];
    for (owner, tok, alt, any, born, want) in rows {
        let got = allows(
            owner.map(str::as_bytes),
            tok.as_bytes(),
            alt.as_bytes(),
            b"a:",
            any,
            born.as_bytes(),
        );
        assert_eq!(got, want, "{owner:?} {tok} {alt:?} {any} {born}");
    }
}

#[test]
fn every_script_is_known_by_body_and_by_sha() {
    // A guarded write is never planned on a server that refuses scripts
    // (crate::lock::guard::Uncheckable::Scriptless), nor a reconciliation
    // (crate::lock::reconcile).
    for script in (Script::all().into_iter())
        .filter(|s| !matches!(s, Script::Guard | Script::GuardTx | Script::Reconcile))
    {
        let call = Call::new(script, &[b"lock:a", b"o"], &[b"1"]);
        let (by_sha, _) = job_of(&call.evalsha(), 0).expect("EVALSHA");
        let (by_body, db) = job_of(&call.eval_in(3), 0).expect("EVAL in db 3");
        assert_eq!(by_sha.kind, by_body.kind);
        assert_eq!(db, 3);
        assert_eq!(by_body.keys, vec![b("lock:a"), b("o")]);
        assert_eq!(by_body.argv, vec![b("1")]);
    }
    let renew = crate::lock::eval_on(script::RENEW, b"lock:a", &[], &[b"t", b"10", b""]);
    assert_eq!(job_of(&renew, 0).map(|(j, _)| j.kind), Some(Script::Renew));
    assert!(job_of(&cmd(&[b"EVAL", b"return 1", b"0"]), 0).is_none());
    assert!(job_of(&cmd(&[b"GET", b"k"]), 0).is_none());
}

const ACQUIRE_ARGV: [&str; 9] = ["1", "v", "a:1", "PX", "5000", "setnx", "a:", "0", "0"];

#[test]
fn an_acquisition_writes_the_lock_and_its_owner_record_or_reports_the_holder() {
    let j = job(Script::Acquire, &["lock:a", "o", "q", "p"], &ACQUIRE_ARGV);
    assert_eq!(j.watch(), vec![b("lock:a"), b("o")]);
    let free = [int(0), int(-2)];
    let Decision::Write { commands, .. } = j.decide(&free) else {
        panic!("a free lock is written");
    };
    assert_eq!(
        commands,
        vec![
            cmd(&[b"SET", b"lock:a", b"v", b"PX", b"5000"]),
            cmd(&[b"SET", b"o", b"a:1", b"PX", b"5000"]),
        ]
    );
    let ok = Bytes::from_static(b"+OK\r\n");
    assert_eq!(
        &j.finish(&[], &[ok.clone(), ok])[..],
        b"*7\r\n:1\r\n:1\r\n:5000\r\n:0\r\n:0\r\n:0\r\n:0\r\n"
    );
    let held = [int(1), int(1234)];
    assert_eq!(
        j.decide(&held),
        Decision::Answer(Bytes::from_static(
            b"*7\r\n:0\r\n:0\r\n:1234\r\n:0\r\n:0\r\n:0\r\n:0\r\n"
        ))
    );
    // A bad lease is Redis's own error, before anything is written.
    let mut bad = ACQUIRE_ARGV;
    bad[4] = "0";
    let j = job(Script::Acquire, &["lock:a", "o"], &bad);
    assert_eq!(
        j.decide(&free),
        Decision::Answer(b("-ERR invalid expire time in 'set' command\r\n"))
    );
    bad[4] = "x";
    let j = job(Script::Acquire, &["lock:a", "o"], &bad);
    assert_eq!(
        j.decide(&free),
        Decision::Answer(b("-ERR value is not an integer or out of range\r\n"))
    );
}

#[test]
fn a_release_deletes_what_its_owner_check_allows() {
    // Two lock keys (the second not this connection's), one plain key.
    let keys = [
        "lock:a", "oa", "qa", "pa", "lock:b", "ob", "qb", "pb", "plain",
    ];
    let argv = ["1", "2", "DEL", "instance", "a:", "1", "a:1", "a:2", "", ""];
    let j = job(Script::Release, &keys, &argv);
    let reads = [b("$3\r\na:1\r\n"), b("$3\r\nb:7\r\n")];
    let Decision::Write { commands, memo } = j.decide(&reads) else {
        panic!("the first key and the plain one are deleted");
    };
    assert_eq!(
        commands,
        vec![cmd(&[b"DEL", b"lock:a", b"oa"]), cmd(&[b"DEL", b"plain"])]
    );
    // Lock and record deleted (2), the plain key (1): 2 deleted, 1
    // released, 1 denied, and the holder's token lapsed on lock:b.
    assert_eq!(
        &j.finish(&memo, &[int(2), int(1)])[..],
        b"*9\r\n:2\r\n:1\r\n:1\r\n:1\r\n:0\r\n:0\r\n:0\r\n:0\r\n:0\r\n"
    );
    // The same key twice: the second is this connection's no more.
    let keys = ["lock:a", "oa", "qa", "pa", "lock:a", "oa", "qa", "pa"];
    let argv = ["0", "2", "DEL", "instance", "a:", "1", "a:1", "a:1", "", ""];
    let j = job(Script::Release, &keys, &argv);
    let reads = [b("$3\r\na:1\r\n"), b("$3\r\na:1\r\n")];
    let Decision::Write { commands, memo } = j.decide(&reads) else {
        panic!("written");
    };
    assert_eq!(
        commands,
        vec![cmd(&[b"DEL", b"lock:a", b"oa"]), cmd(&[b"DEL", b"lock:a"])]
    );
    assert_eq!(&j.finish(&memo, &[int(2), int(0)])[..], b":1\r\n");
}

#[test]
fn a_takeover_keeps_or_restores_the_lease_and_moves_the_owner_record() {
    // (command, PTTL before, string?) → what the key's expiry becomes.
    let ok = |a: After<'static>| Some(a);
    type Row<'a> = (&'a [&'a [u8]], i64, bool, Option<After<'static>>);
    let rows: [Row; 11] = [
        (&[b"GETSET", b"v"], 500, true, ok(After::Persist)),
        (&[b"GETSET", b"v"], 500, false, None),
        (&[b"GETDEL"], 500, true, ok(After::Gone)),
        (&[b"GETEX"], 500, true, ok(After::Keep)),
        (&[b"GETEX"], -2, true, ok(After::Gone)),
        (&[b"GETEX", b"persist"], 500, true, ok(After::Persist)),
        (
            &[b"GETEX", b"px", b"9"],
            500,
            true,
            ok(After::Ttl(b"PX", b"9")),
        ),
        (&[b"SET", b"v"], 500, true, ok(After::Persist)),
        (&[b"SET", b"v", b"KEEPTTL"], 500, true, ok(After::Keep)),
        (
            &[b"SET", b"v", b"XX", b"EX", b"3"],
            -2,
            true,
            ok(After::Gone),
        ),
        (
            &[b"SET", b"v", b"GET", b"EX", b"3"],
            500,
            true,
            ok(After::Ttl(b"EX", b"3")),
        ),
    ];
    for (args, before, string, want) in rows {
        let got = takeover_after(args, before, string).ok();
        assert_eq!(got, want, "{args:?} {before} {string}");
    }
    let refused = |args: &[&[u8]]| match takeover_after(args, 500, true) {
        Err(Refused::Here(e)) => String::from_utf8_lossy(&e).to_string(),
        other => panic!("{args:?}: {other:?}"),
    };
    assert!(refused(&[b"SET", b"v", b"EX", b"0"]).contains("invalid expire time in 'set'"));
    assert!(refused(&[b"GETEX", b"EX", b"x"]).contains("not an integer"));
    assert!(refused(&[b"SET", b"v", b"KEEPTTL", b"PX", b"5"]).contains("exactly"));

    // GETSET on a lock with 500 ms left, expiring at 1000: the lock gets
    // its deadline back and the owner record the same one.
    let j = job(
        Script::Takeover,
        &["lock:a", "o"],
        &["1", "a:3", "30000", "GETSET", "v"],
    );
    let reads = [int(500), int(1000), b("+string\r\n")];
    let Decision::Write { commands, .. } = j.decide(&reads) else {
        panic!("written");
    };
    assert_eq!(
        commands,
        vec![
            cmd(&[b"GETSET", b"lock:a", b"v"]),
            cmd(&[b"PEXPIREAT", b"lock:a", b"1000"]),
            cmd(&[b"SET", b"o", b"a:3", b"PXAT", b"1000"]),
            cmd(&[b"PTTL", b"lock:a"]),
        ]
    );
}

#[test]
fn the_watchdog_renews_only_its_own_lock_and_never_shortens_it() {
    let j = job(Script::Renew, &["lock:a", "o"], &["a:1", "3000", "v"]);
    let read = |owner: &str, value: &str, pttl: i64| {
        [
            b(owner),
            b(value),
            int(pttl),
            int(if pttl > 0 { 99_000 } else { pttl }),
        ]
    };
    assert_eq!(
        j.decide(&read("$3\r\nb:1\r\n", "$1\r\nv\r\n", 100)),
        Decision::Answer(int(0))
    );
    assert_eq!(
        j.decide(&read("$3\r\na:1\r\n", "$1\r\nw\r\n", 100)),
        Decision::Write {
            commands: vec![cmd(&[b"DEL", b"o"])],
            memo: vec![0]
        }
    );
    assert_eq!(
        j.decide(&read("$3\r\na:1\r\n", "$1\r\nv\r\n", 100)),
        Decision::Write {
            commands: vec![
                cmd(&[b"PEXPIRE", b"lock:a", b"3000"]),
                cmd(&[b"PEXPIRE", b"o", b"3000"])
            ],
            memo: vec![1]
        }
    );
    assert_eq!(
        j.decide(&read("$3\r\na:1\r\n", "$1\r\nv\r\n", 9000)),
        Decision::Write {
            commands: vec![cmd(&[b"PEXPIREAT", b"o", b"99000"])],
            memo: vec![1]
        }
    );
}

#[test]
fn a_release_by_value_is_refused_not_checked_by_the_owner_record() {
    // A lock library's release script, carried out by lockgate only where
    // scripts run: should a server have turned scriptless since, the
    // transaction says so rather than check the owner record instead.
    let lock = ["lock:a", "oa", "qa", "pa"];
    let release = ["1", "1", "DEL", "value", "a:", "1", "tok", ""];
    let handoff = [
        "1", "DEL", "value", "a:", "tok", "v2", "a:2", "1000", "", "1", "0", "0",
    ];
    let jobs = [
        job(Script::Release, &lock, &release),
        job(Script::ReleaseHandoff, &lock, &handoff),
        job(Script::ReleaseFast, &lock, &["a:1", "DEL", "tok"]),
    ];
    for j in jobs {
        let Decision::Answer(reply) = j.decide(&[b("$3\r\na:1\r\n"), b("+string\r\n")]) else {
            panic!("{:?} written", j.kind);
        };
        assert!(reply.starts_with(b"-ERR lockgate: a lock library's release script"));
    }
    // By owner, as before.
    let j = job(Script::ReleaseFast, &lock, &["a:1", "DEL"]);
    assert!(matches!(
        j.decide(&[b("$3\r\na:1\r\n")]),
        Decision::Write { .. }
    ));
}
