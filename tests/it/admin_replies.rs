//! `LOCKGATE` replies describe themselves (docs/operations.md, "The
//! `LOCKGATE` commands"): each thing is a record of named fields, a map
//! under RESP3 and field/value pairs under RESP2, and a list is an array
//! of records. Every admin command is asked on a RESP2 and on a RESP3
//! connection through lockgate in front of a real Redis, and the two
//! replies are compared field by field.

use crate::support;

use support::ops::{base_config, call, Ops};
use support::resp::Resp;
use support::{RawClient, RedisServer};

/// A connection that said `HELLO 3` (passed to Redis, which switched it).
async fn resp3(lg: &Ops) -> RawClient {
    let mut c = lg.client().await;
    let hello = c.call_raw(&["HELLO", "3"]).await;
    assert_eq!(hello[0], b'%', "HELLO 3 answered with a map");
    c
}

/// The type byte of the first record in `raw`: the reply itself for a
/// record, its first element for an array of records.
fn record_type(raw: &[u8], list: bool) -> u8 {
    if !list {
        return raw[0];
    }
    assert_eq!(raw[0], b'*', "a list is an array: {}", support::show(raw));
    let first = raw.windows(2).position(|w| w == b"\r\n").expect("a header") + 2;
    raw[first]
}

/// A command, whether it answers a list of records, the fields every
/// record has, and the fields whose values must agree between the two
/// calls.
type Case<'a> = (&'a [&'a str], bool, &'a [&'a str], &'a [&'a str]);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_admin_reply_is_a_record_in_both_protocols() {
    let redis = RedisServer::start();
    let lg = Ops::start(base_config(&redis.addr())).await;
    let mut two = lg.client().await;
    let mut three = resp3(&lg).await;
    // Something to show: two locks held here, one of them hot, and a
    // SETNX on a key no pattern matches.
    assert_eq!(two.call_s(&["SETNX", "lock:admin:a", "1"]).await, ":1\r\n");
    assert_eq!(two.call_s(&["SETNX", "lock:admin:b", "1"]).await, ":1\r\n");
    for _ in 0..3 {
        assert_eq!(
            three.call_s(&["SETNX", "lock:admin:a", "2"]).await,
            ":0\r\n"
        );
    }
    assert_eq!(two.call_s(&["SETNX", "plain:admin", "1"]).await, ":1\r\n");

    let cases: &[Case] = &[
        (
            &["LOCKGATE", "HOTKEYS", "5"],
            true,
            &support::ops::HOTKEY_FIELDS,
            &["key", "acquired", "holder"],
        ),
        (
            &["LOCKGATE", "LOCKS", "lock:admin:*"],
            true,
            &support::ops::LOCK_FIELDS,
            &["key", "acquisition", "holder", "client_addr", "waiters"],
        ),
        (
            &["LOCKGATE", "UNMATCHED"],
            true,
            &["prefix", "commands"],
            &["prefix", "commands"],
        ),
        (
            &["LOCKGATE", "PRIMARY"],
            false,
            &[
                "addr",
                "followed",
                "switches",
                "last_switch_from",
                "last_switch_to",
                "last_switch_unix_ms",
                "failover_hold_ms",
                "maxmemory_policy",
                "evicted_keys",
                "locks_refused",
                "replicas",
                "min_replicas_to_write",
                "aof",
                "restarts",
                "second_primaries",
                "writable_replicas",
                "unsafe",
            ],
            &["addr", "followed", "switches", "maxmemory_policy"],
        ),
        (
            &["LOCKGATE", "CONFIG", "upstream.*"],
            false,
            &["upstream.addr", "upstream.reconnect_interval_ms"],
            &["upstream.addr", "upstream.reconnect_interval_ms"],
        ),
    ];
    for (args, list, fields, same) in cases {
        let raw2 = two.call_raw(args).await;
        let raw3 = three.call_raw(args).await;
        let what = args.join(" ");
        assert_eq!(record_type(&raw2, *list), b'*', "{what} under RESP2");
        assert_eq!(record_type(&raw3, *list), b'%', "{what} under RESP3");
        let (r2, r3) = (Resp::parse(&raw2), Resp::parse(&raw3));
        let (rows2, rows3) = match list {
            true => (r2.items().to_vec(), r3.items().to_vec()),
            false => (vec![r2.clone()], vec![r3.clone()]),
        };
        assert!(!rows2.is_empty(), "{what}: something to show");
        assert_eq!(rows2.len(), rows3.len(), "{what}: {r2} / {r3}");
        for (a, b) in rows2.iter().zip(&rows3) {
            assert_eq!(a.fields(), b.fields(), "{what}: the same fields in both");
            for f in *fields {
                a.field(f);
            }
            if !*list && args[1] == "CONFIG" {
                continue;
            }
            if *list || args[1] == "PRIMARY" {
                assert_eq!(a.fields(), *fields, "{what}: exactly these fields");
            }
            for f in *same {
                assert_eq!(a.field(f), b.field(f), "{what}: field {f}");
            }
        }
    }
    // The rows themselves.
    let locks = call(&mut two, &["LOCKGATE", "LOCKS", "lock:admin:*"]).await;
    let mut keys: Vec<&str> = locks
        .items()
        .iter()
        .map(|r| r.field("key").text())
        .collect();
    keys.sort();
    assert_eq!(keys, ["lock:admin:a", "lock:admin:b"]);
    let hot = call(&mut two, &["LOCKGATE", "HOTKEYS", "1"]).await;
    assert_eq!(hot.items()[0].field("key").text(), "lock:admin:a");
    assert_eq!(hot.items()[0].field("attempts").int(), 4);
    let unmatched = call(&mut two, &["LOCKGATE", "UNMATCHED"]).await;
    assert_eq!(unmatched.items()[0].field("prefix").text(), "plain");
    assert_eq!(unmatched.items()[0].field("commands").int(), 1);
    let primary = call(&mut two, &["LOCKGATE", "PRIMARY"]).await;
    assert_eq!(primary.field("addr").text(), redis.addr());

    // STATS: every counter by name, the same names in both; the counter
    // of commands lockgate answered moves between the two calls, so only
    // names are compared, and one value that cannot move.
    let raw2 = two.call_raw(&["LOCKGATE", "STATS"]).await;
    let raw3 = three.call_raw(&["LOCKGATE", "STATS"]).await;
    assert_eq!((raw2[0], raw3[0]), (b'*', b'%'), "STATS: pairs, then a map");
    let (s2, s3) = (Resp::parse(&raw2), Resp::parse(&raw3));
    assert_eq!(s2.fields(), s3.fields());
    assert!(s2.fields().len() > 20, "{s2}");
    assert_eq!(s2.field("lock_acquired"), s3.field("lock_acquired"));
    assert_eq!(s2.field("lock_acquired").int(), 2);

    // NODES and MASTERS: empty lists in front of one Redis without a
    // quorum (their records are checked where they have rows:
    // cluster_routing, ops).
    for sub in ["NODES", "MASTERS"] {
        assert_eq!(two.call_s(&["LOCKGATE", sub]).await, "*0\r\n", "{sub}");
        assert_eq!(three.call_s(&["LOCKGATE", sub]).await, "*0\r\n", "{sub}");
    }

    // HELP: a line per subcommand and what it answers, in both.
    let help = call(&mut two, &["LOCKGATE", "HELP"]).await;
    let lines: Vec<&str> = help.items().iter().map(|l| l.text()).collect();
    for sub in [
        "STATS",
        "HOTKEYS",
        "LOCKS",
        "MASTERS",
        "PRIMARY",
        "NODES",
        "UNMATCHED",
        "CONFIG",
        "RELOAD",
        "AUTH",
        "LOCK",
        "UNLOCK",
        "EXTEND",
        "HELP",
    ] {
        assert!(
            lines.iter().any(|l| l.starts_with(sub)),
            "HELP lacks {sub}: {lines:?}"
        );
    }
    let help3 = three.call_raw(&["LOCKGATE", "HELP"]).await;
    assert_eq!(
        help3,
        two.call_raw(&["LOCKGATE", "HELP"]).await,
        "HELP alike"
    );
    let unknown = two.call_s(&["LOCKGATE", "FROB"]).await;
    assert!(unknown.contains("try LOCKGATE HELP"), "{unknown}");
    lg.stop().await;
}
