//! The guard rules without Redis: compiling (what `--check` refuses),
//! which keys a command writes under which lock, and how each way a write
//! can come out is counted and answered.

use std::time::Instant;

use super::*;
use crate::config::{Config, GuardConfig};
use crate::lock::lease::Standing as Lease;
use crate::lock::LockPending;

fn guard(lock: &str, data: &[&str], mode: GuardMode, unlocked: UnlockedWriters) -> GuardConfig {
    GuardConfig {
        lock: lock.to_string(),
        data: data.iter().map(|d| d.to_string()).collect(),
        mode,
        unlocked_writers: unlocked,
    }
}

fn orders(mode: GuardMode) -> GuardConfig {
    guard(
        "lock:order:{id}",
        &["order:{id}", "order:{id}:*"],
        mode,
        UnlockedWriters::Allow,
    )
}

fn compiled(guards: &[GuardConfig]) -> Result<Guards, String> {
    let keys = KeyPatterns::new(&Config::default().locks.keys);
    Guards::compile(guards, &keys).map_err(|e| e.0)
}

#[test]
fn compiling_refuses_what_could_not_be_guarded_exactly() {
    use GuardMode::Report;
    use UnlockedWriters::Allow;
    for (guards, why) in [
        (vec![guard("lock:order", &["order:1"], Report, Allow)], "no named part"),
        (vec![guard("order:{id}", &["o:{id}"], Report, Allow)], "does not name lock keys"),
        (vec![guard("lock:{id}:{id}", &["o:{id}"], Report, Allow)], "names a part twice"),
        (vec![guard("lock:o:{id}", &[], Report, Allow)], "guards no data"),
        (vec![guard("lock:o:{id}", &["o:{oid}"], Report, Allow)], "which lock `lock:o:{id}` does not have"),
        (vec![guard("lock:o:{id}", &["o:*:x"], Report, Allow)], "may only end"),
        (
            vec![orders(Report), guard("lock:item:{id}", &["order:{id}:items"], Report, Allow)],
            "data `order:{id}:items` (lock `lock:item:{id}`) and data `order:{id}:*` (lock `lock:order:{id}`) could match the same key",
        ),
    ] {
        let e = compiled(&guards).unwrap_err();
        assert!(e.contains(why), "{e}");
    }
    let many: Vec<GuardConfig> = (0..=crate::config::MAX_GUARDS)
        .map(|i| {
            guard(
                &format!("lock:{i}:{{id}}"),
                &[&format!("d{i}:{{id}}")],
                Report,
                Allow,
            )
        })
        .collect();
    assert!(compiled(&many).unwrap_err().contains("at most"));
    let ok = compiled(&[
        orders(Report),
        guard("lock:user:{u}", &["user:{u}"], Report, Allow),
    ])
    .unwrap();
    assert_eq!(ok.all().len(), 2);
}

#[test]
fn a_data_key_maps_to_its_lock_and_the_shortcut_never_misses_it() {
    let g = compiled(&[orders(GuardMode::Refuse)]).unwrap();
    for (key, lock) in [
        ("order:42", Some("lock:order:42")),
        ("order:42:items", Some("lock:order:42")),
        ("order:", None),
        ("orders:42", None),
        ("user:1", None),
    ] {
        let got = g.lock_of(key.as_bytes()).map(|(_, l)| l);
        assert_eq!(got.as_deref(), lock.map(str::as_bytes), "{key}");
        if lock.is_some() {
            assert!(g.may_touch([key].iter()), "{key}");
        }
    }
    assert!(!g.may_touch(["user:1", "x"].iter()));
}

/// A config with the order guard in `mode`, its service, and a command
/// table that flags SET, DEL, MSET writes and GET a read.
fn service(mode: GuardMode, unlocked: UnlockedWriters) -> LockService {
    let mut config = Config::default();
    config.locks.guards = vec![guard(
        "lock:order:{id}",
        &["order:{id}", "order:{id}:*"],
        mode,
        unlocked,
    )];
    let locks = LockService::new(&config);
    locks.guard_table.set(crate::cluster::route::tests::table());
    locks
}

#[test]
fn writes_are_routed_by_the_servers_flags_and_keys() {
    let locks = service(GuardMode::Refuse, UnlockedWriters::Allow);
    let route = |line: &str, multi: bool| {
        let args: Vec<&[u8]> = line.split(' ').map(str::as_bytes).collect();
        locks.guard_route(&args, multi)
    };
    let checked = |r: Option<Guarded>| -> Vec<String> {
        match r {
            Some(Guarded::Check(l)) => l
                .iter()
                .map(|l| String::from_utf8_lossy(&l.lock).into_owned())
                .collect(),
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(checked(route("SET order:42 v", false)), ["lock:order:42"]);
    assert_eq!(
        checked(route(
            "MSET user:1 a order:1:x b order:2 c order:1 d",
            false
        )),
        ["lock:order:1", "lock:order:2"]
    );
    assert_eq!(route("GET order:42", false), None);
    assert_eq!(route("SET user:1 v", false), None);
    // The value is not a key.
    assert_eq!(route("SET user:1 order:42", false), None);
    // A data pattern that lock keys also match: lock commands keep their
    // rules (a lock key is never guarded data).
    let wide = {
        let mut c = Config::default();
        c.locks.guards = vec![guard(
            "lock:order:{id}",
            &["{id}:*"],
            GuardMode::Refuse,
            UnlockedWriters::Refuse,
        )];
        let l = LockService::new(&c);
        l.guard_table.set(crate::cluster::route::tests::table());
        l
    };
    for line in ["SET lock:order:1 v", "DEL lock:order:1"] {
        let args: Vec<&[u8]> = line.split(' ').map(str::as_bytes).collect();
        assert_eq!(wide.guard_route(&args, false), None, "{line}");
    }
    // Inside MULTI: noted, checked with the whole transaction at EXEC.
    assert!(matches!(route("SET order:1 v", true), Some(Guarded::InTx(l)) if l.len() == 1));
    for (line, multi, why) in [
        ("EVAL x 1 order:1", true, "runs code"),
        (
            "DEL lock:order:1 order:1",
            false,
            "writes a lock key and a guarded key",
        ),
    ] {
        match route(line, multi) {
            Some(Guarded::Refuse(_, text)) => assert!(text.contains(why), "{line}: {text}"),
            other => panic!("{line}: {other:?}"),
        }
    }
    // Report mode: passed, to be counted.
    let report = service(GuardMode::Report, UnlockedWriters::Allow);
    let args: Vec<&[u8]> = vec![b"EVAL", b"x", b"1", b"order:1"];
    assert!(matches!(
        report.guard_route(&args, true),
        Some(Guarded::Unchecked(_))
    ));
    // No table yet: every argument that could be guarded counts.
    let fresh = {
        let mut c = Config::default();
        c.locks.guards = vec![orders(GuardMode::Refuse)];
        LockService::new(&c)
    };
    match fresh.guard_route(&[b"GETX", b"order:1"], false) {
        Some(Guarded::Refuse(_, text)) => assert!(text.contains("not loaded"), "{text}"),
        other => panic!("{other:?}"),
    }
}

/// The script's reply for `standings` (applied or not), read for a write
/// planned on a connection that holds `lock:order:1` with a lease that
/// ended 1.5 s ago.
fn answered(
    locks: &LockService,
    applied: bool,
    standing: i64,
) -> (String, [(&'static str, u64); 5]) {
    let mut conn = locks.conn_locks();
    let since = Instant::now() - std::time::Duration::from_millis(2_500);
    conn.attempt(
        Bytes::from_static(b"lock:order:1"),
        Bytes::from_static(b"a:1"),
        Bytes::new(),
        Lease::Held,
        1_000,
    );
    if let Some(a) = conn.get(b"lock:order:1").cloned() {
        assert_eq!(a.standing, Lease::Held);
    }
    let args: Vec<&[u8]> = vec![b"SET", b"order:1", b"v"];
    let Some(Guarded::Check(checked)) = locks.guard_route(&args, false) else {
        panic!("not checked");
    };
    let (_, pending) = locks.guard_call(checked, &args, &conn);
    let LockPending::Guard(mut pending) = pending else {
        panic!("not a guard");
    };
    pending.lease_ends = vec![Some(since + std::time::Duration::from_millis(1_000))];
    let frame = match applied {
        true => format!("*3\r\n+OK\r\n:1\r\n:{standing}\r\n"),
        false => format!("*3\r\n:0\r\n:0\r\n:{standing}\r\n"),
    };
    let reply = locks.guard_reply(pending, Bytes::from(frame));
    let counts = locks.guard_counts()[0].2.each();
    (String::from_utf8_lossy(&reply).into_owned(), counts)
}

#[test]
fn each_outcome_is_answered_and_counted_once() {
    let refuse = service(GuardMode::Refuse, UnlockedWriters::Refuse);
    let (reply, _) = answered(&refuse, true, 0);
    assert_eq!(reply, "+OK\r\n");
    let (reply, _) = answered(&refuse, false, 1);
    assert!(
        reply.starts_with("-ERR lockgate: write refused: lock:order:1 is no longer held by this connection (lease ended 1."),
        "{reply}"
    );
    let (reply, _) = answered(&refuse, false, 2);
    assert!(reply.contains("another holder has it now"), "{reply}");
    let (reply, counts) = answered(&refuse, false, 3);
    assert!(reply.contains("order:1 is guarded by lock:order:1, which this connection does not hold (nobody holds it)"), "{reply}");
    assert_eq!(
        counts,
        [
            ("applied", 1),
            ("refused", 3),
            ("reported_late", 0),
            ("unlocked_writer", 0),
            ("unchecked", 0)
        ]
    );
    let report = service(GuardMode::Report, UnlockedWriters::Allow);
    for standing in [0, 1, 2, 3, 4] {
        assert_eq!(answered(&report, true, standing).0, "+OK\r\n");
    }
    let counts = report.guard_counts()[0].2.each();
    assert_eq!(
        counts,
        [
            ("applied", 1),
            ("refused", 0),
            ("reported_late", 2),
            ("unlocked_writer", 2),
            ("unchecked", 0)
        ]
    );
    // Redis's own error (not the script's answer) passes whole.
    let args: Vec<&[u8]> = vec![b"SET", b"order:1", b"v"];
    let Some(Guarded::Check(checked)) = report.guard_route(&args, false) else {
        panic!("not checked");
    };
    let (_, LockPending::Guard(pending)) = report.guard_call(checked, &args, &report.conn_locks())
    else {
        panic!("not a guard");
    };
    let err = Bytes::from_static(b"-ERR max memory\r\n");
    assert_eq!(report.guard_reply(pending, err.clone()), err);
}

#[test]
fn counters_outlive_a_reload_that_keeps_the_guard() {
    let locks = service(GuardMode::Report, UnlockedWriters::Allow);
    answered(&locks, true, 0);
    let mut config = Config::default();
    config.locks.guards = vec![orders(GuardMode::Refuse)];
    locks.reload(&config);
    assert_eq!(locks.guard_counts()[0].2.each()[0], ("applied", 1));
    config.locks.guards.clear();
    locks.reload(&config);
    assert!(!locks.guards_on());
    assert!(locks.guard_counts().is_empty());
}

/// `--check` (`Config::validate`) names what it refuses: a bad guard, and
/// the stores guarded writes are not served on yet.
#[test]
fn validation_names_the_guard_and_the_reason() {
    let mut c = Config::default();
    c.locks.guards = vec![
        orders(GuardMode::Refuse),
        guard(
            "lock:item:{id}",
            &["order:{id}:*"],
            GuardMode::Report,
            UnlockedWriters::Allow,
        ),
    ];
    let e = check(&c).unwrap_err().to_string();
    assert!(
        e.contains("locks.guards") && e.contains("could match the same key"),
        "{e}"
    );
    c.locks.guards.truncate(1);
    assert!(check(&c).is_ok());
    c.locks.quorum.masters = ["a:1", "b:1", "c:1"].map(String::from).to_vec();
    assert!(check(&c).is_ok());
    c.upstream.cluster.seeds = vec!["127.0.0.1:7000".to_string()];
    c.locks.quorum.masters.clear();
    // In front of a cluster a guard's data keeps its lock's hash tag.
    let e = check(&c).unwrap_err().to_string();
    assert!(e.contains("lock `lock:order:{id}` has no hash tag"), "{e}");
    let tagged = |data: &str| {
        guard(
            "lock:order:{{{id}}}",
            &["order:{{{id}}}", data],
            GuardMode::Refuse,
            UnlockedWriters::Allow,
        )
    };
    c.locks.guards = vec![tagged("order:{{{id}}}:*")];
    assert!(check(&c).is_ok(), "{:?}", check(&c));
    c.locks.guards = vec![tagged("order:{id}:items")];
    let e = check(&c).unwrap_err().to_string();
    assert!(
        e.contains(
            "data `order:{id}:items` does not carry the hash tag of lock `lock:order:{{{id}}}`"
        ),
        "{e}"
    );
    // From TOML, as an operator writes it.
    let text = "[[locks.guards]]\nlock = \"lock:order:{id}\"\ndata = [\"order:{id}\", \"order:{id}:*\"]\nmode = \"refuse\"\nunlocked_writers = \"refuse\"\n";
    let parsed = Config::from_toml(text).unwrap();
    assert_eq!(parsed.locks.guards[0].mode, GuardMode::Refuse);
    assert_eq!(
        parsed.locks.guards[0].unlocked_writers,
        UnlockedWriters::Refuse
    );
    assert!(check(&parsed).is_ok());
}

/// What `crate::context::validate` checks of the guards: the values, then
/// the patterns compiled.
fn check(c: &Config) -> Result<(), crate::config::ConfigError> {
    c.validate()?;
    super::validate(c)
}
