//! `router::decide` over requests parsed from the input, with a session view
//! built from the first input bytes and carried from command to command as
//! the decision's view after it, as the session does; lock keys on one
//! Redis or (a flag bit) on three lock masters. Checked, besides "no panic":
//! - a `RESET` is always forwarded as a reset; after `QUIT` nothing else is
//!   answered; on a raw (MONITOR) connection only forwarding, admin and the
//!   raw refusal are possible;
//! - a lock operation comes only from a lock command on lock keys, with the
//!   key of the command: `Acquire` from SETNX/SET, `Extend` from the EXPIRE
//!   family, `Takeover` from SET/GETSET/GETDEL/GETEX, `Release` from
//!   DEL/UNLINK, splitting its keys exactly into lock and plain keys;
//! - `Admin` only for `LOCKGATE`, `RefusePersist` only for `PERSIST` on a
//!   lock key, `ForwardUnmatched` only for SETNX/SET on another key, a
//!   subscription counts its arguments, and the quorum routes only appear
//!   in quorum mode (a transaction's queued commands and its `EXEC` only
//!   inside `MULTI`); `Deny` only for `LOCKGATE`; the common case
//!   (`Fate::Plain`) leaves the view as it is;
//! - what is forgotten comes only from a command that changes it: the
//!   database from FLUSHDB/FLUSHALL/SWAPDB and the keys from
//!   RENAME/RENAMENX/COPY/MOVE (lock keys among the command's keys), both
//!   only on one Redis; the scripts from SCRIPT FLUSH; everything only from
//!   the EXEC of a transaction that queued one of these.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lockgate::command::{classify, CommandKind, ReplyMode};
use lockgate::config::{Config, GuardConfig, GuardMode, UnlockedWriters};
use lockgate::lock::guard::Guarded;
use lockgate::lock::ops::LockOp;
use lockgate::lock::{Forget, LockService};
use lockgate::protocol::request::{RequestKind, RequestLimits, RequestParser};
use lockgate::router::{decide, CommandArgs, Expect, Fate, Route, SessionView, RAW_REFUSAL};

fn view(b: u8, db: u8) -> SessionView {
    SessionView {
        raw: b & 1 != 0,
        in_multi: b & 2 != 0,
        quit: b & 4 != 0,
        admin_ok: b & 8 != 0,
        replies: match (b >> 4) & 3 {
            0 => ReplyMode::On,
            1 => ReplyMode::Off,
            _ => ReplyMode::Skip,
        },
        db: u64::from(db),
        forget_at_exec: b & 0x80 != 0,
        ..SessionView::default()
    }
}

fn check(
    kind: CommandKind,
    args: &CommandArgs<'_>,
    v: &SessionView,
    locks: &LockService,
    quorum: bool,
    r: &Route,
) {
    let name = args.get(0).to_ascii_uppercase();
    let name = name.as_slice();
    let key = args.get(1);
    if kind == CommandKind::Reset {
        assert_eq!(*r, Route::Forward(Expect::Reset));
        return;
    }
    if v.quit {
        assert_eq!(*r, Route::Forward(Expect::Nothing));
        return;
    }
    if v.raw {
        assert!(
            matches!(
                r,
                Route::Forward(Expect::Nothing)
                    | Route::ForwardForget(_, Expect::Nothing)
                    | Route::Admin
                    | Route::Deny(_)
            ) || *r == Route::Refuse(RAW_REFUSAL.to_string()),
            "raw: {r:?}"
        );
        return;
    }
    match r {
        Route::Lock(op) => match op {
            // node-redlock's acquisition script, for one key, is one.
            LockOp::Acquire { key: k, .. } if matches!(name, b"EVAL" | b"EVALSHA") => {
                assert_eq!(args.get(2), b"1");
                assert_eq!(&k[..], args.get(3));
                assert!(locks.is_lock_key(k));
            }
            LockOp::Acquire { key: k, .. } => {
                assert!(name == b"SETNX" || name == b"SET", "{name:?}");
                assert_eq!(&k[..], key);
                assert!(locks.is_lock_key(key));
            }
            LockOp::Extend {
                key: k, command, ..
            } => {
                assert!(matches!(
                    name,
                    b"EXPIRE" | b"PEXPIRE" | b"EXPIREAT" | b"PEXPIREAT"
                ));
                assert_eq!(command.as_bytes(), name);
                assert_eq!(&k[..], key);
                assert!(locks.is_lock_key(key));
            }
            LockOp::Takeover {
                key: k, command, ..
            } => {
                assert!(matches!(name, b"SET" | b"GETSET" | b"GETDEL" | b"GETEX"));
                assert_eq!(command.as_bytes(), name);
                assert_eq!(&k[..], key);
                assert!(locks.is_lock_key(key));
            }
            // A lock library's release script, carried out by value.
            LockOp::Release {
                lock_keys,
                plain,
                unlink,
                by_value: Some(_),
            } => {
                assert!(matches!(name, b"EVAL" | b"EVALSHA"));
                assert!(!*unlink && plain.is_empty() && !lock_keys.is_empty());
                assert!(lock_keys.iter().all(|k| locks.is_lock_key(k)));
            }
            LockOp::Release {
                lock_keys,
                plain,
                unlink,
                by_value: None,
            } => {
                assert!(matches!(name, b"DEL" | b"UNLINK"));
                assert_eq!(*unlink, name == b"UNLINK");
                assert!(!lock_keys.is_empty());
                assert!(lock_keys.iter().all(|k| locks.is_lock_key(k)));
                assert!(plain.iter().all(|k| !locks.is_lock_key(k)));
                assert_eq!(lock_keys.len() + plain.len(), args.len() - 1);
            }
        },
        Route::Admin | Route::Deny(_) => assert_eq!(name, b"LOCKGATE"),
        Route::Queue(_) => assert!(quorum && v.in_multi),
        // A transaction with a command refused while queuing: on the
        // quorum, a guarded write lockgate could not check (refuse mode),
        // or any refusal (`MSETNX` on lock keys).
        Route::ExecAbort => {
            assert!(v.tx.failed && v.in_multi && name == b"EXEC", "{name:?}")
        }
        Route::ExecQueued { .. } => {
            assert!(quorum && v.in_multi && name == b"EXEC", "{name:?}")
        }
        Route::RefusePersist => {
            assert_eq!(name, b"PERSIST");
            assert!(locks.is_lock_key(key));
        }
        Route::ForwardUnmatched => {
            assert!(name == b"SETNX" || name == b"SET", "{name:?}");
            assert!(!locks.is_lock_key(key));
        }
        Route::Forward(Expect::Subscription(_, n)) => {
            assert_eq!(*n as usize, args.len() - 1);
        }
        Route::QuorumRead | Route::QuorumEval | Route::QuorumSplit(_) => assert!(quorum),
        Route::Refuse(msg) => assert!(!msg.is_empty()),
        // `MSETNX` naming a lock key, as one acquisition.
        Route::AcquireAll(pairs) => {
            assert_eq!(name, b"MSETNX");
            assert!(!quorum && !v.in_multi);
            assert_eq!(pairs.len() * 2, args.len() - 1);
            assert!(pairs.iter().any(|(k, _)| locks.is_lock_key(k)));
        }
        Route::ForwardForget(what, expect) => {
            assert_eq!(*expect, Expect::One);
            match what {
                Forget::Database => {
                    assert!(matches!(name, b"FLUSHDB" | b"FLUSHALL" | b"SWAPDB"));
                    assert!(!quorum);
                }
                Forget::Keys(keys) => {
                    assert!(matches!(name, b"RENAME" | b"RENAMENX" | b"COPY" | b"MOVE"));
                    assert!(!quorum && !keys.is_empty());
                    let named = if name == b"MOVE" { 1 } else { 2 };
                    for k in keys {
                        assert!(locks.is_lock_key(k));
                        assert!((1..=named).any(|i| args.get(i) == &k[..]));
                    }
                }
                Forget::Scripts => {
                    assert_eq!(name, b"SCRIPT");
                    assert!(key.eq_ignore_ascii_case(b"FLUSH"));
                }
                Forget::Everything => {
                    assert_eq!(name, b"EXEC");
                    assert!(v.in_multi && v.forget_at_exec);
                }
            }
        }
        Route::Guarded(g) => {
            assert!(locks.guards_on(), "{r:?}");
            // No command table here (no Redis): a command whose arguments
            // may be guarded keys cannot be told a read from a write, so
            // it is refused in refuse mode, never passed unchecked.
            assert!(
                matches!(g, Guarded::Refuse(l, msg) if !l.is_empty() && msg.contains("write refused")),
                "{g:?}"
            );
        }
        Route::Forward(_) => {}
    }
}

fuzz_target!(|input: &[u8]| {
    let [flags, db, rest @ ..] = input else {
        return;
    };
    let quorum = flags & 0x40 != 0;
    let mut config = Config::default();
    config.admin.password = "pw".to_string();
    if quorum {
        config.locks.quorum.masters = ["a:1", "b:1", "c:1"].map(String::from).to_vec();
    }
    // The top bit of the database byte: a guard on `order:` data.
    if db & 0x80 != 0 {
        config.locks.guards = vec![GuardConfig {
            lock: "lock:{id}".to_string(),
            data: vec!["order:{id}".to_string(), "order:{id}:*".to_string()],
            mode: GuardMode::Refuse,
            unlocked_writers: UnlockedWriters::Allow,
        }];
    }
    let locks = LockService::new(&config);
    let mut v = view(*flags, db & 0x7f);
    let mut p = RequestParser::new(RequestLimits {
        max_bulk_bytes: 1 << 16,
        max_multibulk_len: 64,
        max_inline_bytes: 1 << 12,
        max_request_bytes: 1 << 18,
    });
    let mut at = 0;
    while let Ok(Some(req)) = p.parse(&rest[at..]) {
        let buf = &rest[at..];
        if req.kind != RequestKind::Empty {
            let args = CommandArgs::new(&p, buf);
            let kind = classify(args.get(0), args.get(1), args.get(2));
            match decide(kind, args, &v, &locks, &config.admin) {
                Fate::Plain => check(
                    kind,
                    &args,
                    &v,
                    &locks,
                    quorum,
                    &Route::Forward(Expect::One),
                ),
                Fate::Routed(d) => {
                    check(kind, &args, &v, &locks, quorum, &d.route);
                    v = d.next;
                }
            }
        }
        at += req.len;
    }
});
