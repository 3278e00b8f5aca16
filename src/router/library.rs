//! Lock libraries' own scripts that lockgate carries out itself.
//!
//! A library releases its lock with a script of its own: "delete the key if
//! its value is my token". Passed on as it came, the script runs, then
//! lockgate reconciles its owner records with what it did
//! ([`crate::lock::reconcile`]) and wakes the key's waiters, who try
//! again: three calls to Redis per acquisition in a library's retry storm
//! (docs/performance.md). Recognised, the release is a lock operation
//! ([`LockOp::Release`] by value): one call that deletes the key and its
//! owner record together, or hands the lock, in the same step, to the
//! oldest attempt parked on it, as a legacy `DEL` does.
//!
//! node-redlock also acquires with a script ("if no key exists, set each
//! to my token with this lease"). Passed on, each of its retries reaches
//! Redis and the key is adopted only after it (`lock::reconcile`).
//! Recognised for one key, it is a [`LockOp::Acquire`], a `SETNX` with a
//! lease: retries of a held key are absorbed or parked and handed the
//! lock like any spinning `SETNX`.
//!
//! A script is recognised by its exact body (its SHA1, which `EVALSHA`
//! names and `EVAL`'s body hashes to), never by its text looking alike:
//! an exact body's effect is known. What lockgate runs instead does what
//! the body does, on the same keys and arguments, with the same reply:
//!
//! | library | script | keys, arguments | body does | reply | lockgate runs |
//! |---|---|---|---|---|---|
//! | redis-py `Lock` | release | 1; token | `GET` the key; equal to `ARGV[1]`: `DEL` it | 1 deleted, 0 not | a release by value |
//! | pottery `Redlock` | release | the same | the same | the same | the same |
//! | node-redlock | release | 1 or more; token | the same for each key | how many were deleted | the same |
//! | node-redlock | acquire | 1; token, lease ms | `EXISTS` the key; absent: `SET` it to `ARGV[1]` `PX` `ARGV[2]` | 1 set, 0 not | `SETNX` with a lease (`SET … NX PX`) |
//!
//! A key that is not a string fails a release with `WRONGTYPE`, as the
//! body's `GET` fails; an acquisition finds it existing, as `EXISTS` does.
//! Only when every key is a lock key, the arguments are as above (a
//! lease Redis takes) and the lock store runs scripts (one Redis, a
//! cluster's nodes, or the quorum's masters, where it runs on each and
//! the majority answers; `router::quorum`); else the script passes on as
//! any client script does. The script itself never reaches Redis, so
//! there it is not loaded (`SCRIPT EXISTS` says 0 unless the client loaded
//! it), and an `EVALSHA` of it never fails with `NOSCRIPT`
//! (docs/behaviour.md).

use bytes::Bytes;

use super::CommandArgs;
use crate::lock::ops::{LockOp, Shape, Ttl};
use crate::lock::LockService;

/// What a recognised script does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Does {
    /// Deletes each key still holding `ARGV[1]`; `one_key`: it takes one
    /// key only (else one or more).
    Release { one_key: bool },
    /// Sets each key to `ARGV[1]` with a lease of `ARGV[2]` ms if none of
    /// them exists; answers how many it set (0 or all).
    Acquire,
}

/// One library script lockgate recognises.
struct Known {
    /// SHA1 of its body, lowercase hex.
    sha: &'static [u8; 40],
    /// Its body's length in bytes: an `EVAL`'s body is hashed only when
    /// its length is one of these.
    len: usize,
    /// What it does.
    does: Does,
}

/// The scripts recognised (their bodies are checked against the
/// installed libraries' in `tests/it/locks_library_release.rs`).
const KNOWN: [Known; 4] = [
    // redis-py 4 to 8, `Lock.LUA_RELEASE_SCRIPT`.
    Known {
        sha: b"c3f8721cbb97f72bc19e972846bd7aaf91901658",
        len: 185,
        does: Does::Release { one_key: true },
    },
    // pottery 3, `Redlock._release_script`.
    Known {
        sha: b"a4aada0b36710970eedaaaeec4a6b7d8c78c4f80",
        len: 199,
        does: Does::Release { one_key: true },
    },
    // node-redlock 5, `RELEASE_SCRIPT`.
    Known {
        sha: b"e4612211c9f8f51c257e26e056b0a654b3187242",
        len: 274,
        does: Does::Release { one_key: false },
    },
    // node-redlock 5, `ACQUIRE_SCRIPT`.
    Known {
        sha: b"96da70f7716f27d278a5218544df37fd8b0a5e4c",
        len: 338,
        does: Does::Acquire,
    },
];

/// The lock operation `args` (an `EVAL`-family command, name first, on
/// one Redis) asks for, if it is a recognised library's script on lock
/// keys (see the module doc).
pub(super) fn lock_op(args: CommandArgs<'_>, locks: &LockService) -> Option<LockOp> {
    let name = args.get(0);
    let by_sha = if name.eq_ignore_ascii_case(b"EVALSHA") {
        true
    } else if name.eq_ignore_ascii_case(b"EVAL") {
        false
    } else {
        return None;
    };
    let n: usize = std::str::from_utf8(args.get(2)).ok()?.parse().ok()?;
    if n == 0 || args.len() < 3 + n {
        return None;
    }
    let known = known(args.get(1), by_sha)?;
    let keys: Vec<&[u8]> = (3..3 + n).map(|i| args.get(i)).collect();
    if !keys.iter().all(|k| locks.is_lock_key(k)) || locks.scriptless() {
        return None;
    }
    let argv: Vec<&[u8]> = (3 + n..args.len()).map(|i| args.get(i)).collect();
    match (known.does, argv.as_slice()) {
        // The keys, then exactly one argument: the library's token.
        (Does::Release { one_key }, [value]) if n == 1 || !one_key => Some(LockOp::Release {
            lock_keys: keys.iter().map(|k| Bytes::copy_from_slice(k)).collect(),
            plain: Vec::new(),
            unlink: false,
            by_value: Some(Bytes::copy_from_slice(value)),
        }),
        // One key (several are taken all or none, which one acquisition
        // is not), the token and a lease Redis's `SET … PX` takes. Its
        // `EXISTS` then `SET … PX` is `SET … NX PX`, and its 1 or 0 is
        // `SETNX`'s reply.
        (Does::Acquire, [value, ms]) if n == 1 && positive_ms(ms) => Some(LockOp::Acquire {
            key: Bytes::copy_from_slice(keys[0]),
            value: Bytes::copy_from_slice(value),
            ttl: Ttl::Given("PX", Bytes::copy_from_slice(ms)),
            shape: Shape::SetNx,
        }),
        _ => None,
    }
}

/// `ms` is an integer Redis's `SET … PX` takes as a lease: no sign, no
/// leading zero (Redis's `string2ll` refuses it), at least 1, and far
/// from overflowing once added to the clock. Anything else passes on, and
/// Redis answers the script's error as it would.
fn positive_ms(ms: &[u8]) -> bool {
    matches!(ms.first(), Some(b'1'..=b'9')) && ms.len() <= 15 && ms.iter().all(u8::is_ascii_digit)
}

/// The known script `body_or_sha` is (an `EVALSHA`'s SHA1 in any case, or
/// an `EVAL`'s body).
fn known(body_or_sha: &[u8], by_sha: bool) -> Option<&'static Known> {
    if by_sha {
        return KNOWN
            .iter()
            .find(|k| body_or_sha.eq_ignore_ascii_case(&k.sha[..]));
    }
    if !KNOWN.iter().any(|k| k.len == body_or_sha.len()) {
        return None;
    }
    let sha = sha1_smol::Sha1::from(body_or_sha).digest().to_string();
    KNOWN
        .iter()
        .find(|k| k.len == body_or_sha.len() && sha.as_bytes() == &k.sha[..])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::router::tests::parsed;

    const REDIS_PY: &str = "\n        local token = redis.call('get', KEYS[1])\n        if not token or token ~= ARGV[1] then\n            return 0\n        end\n        redis.call('del', KEYS[1])\n        return 1\n    ";

    fn recognised(line: &str, locks: &LockService) -> Option<LockOp> {
        let (p, buf) = parsed(line);
        lock_op(CommandArgs::new(&p, buf.as_bytes()), locks)
    }

    #[test]
    fn each_known_length_and_sha_agree_for_redis_py() {
        assert_eq!(REDIS_PY.len(), KNOWN[0].len);
        let sha = sha1_smol::Sha1::from(REDIS_PY).digest().to_string();
        assert_eq!(sha.as_bytes(), &KNOWN[0].sha[..]);
        assert!(known(REDIS_PY.as_bytes(), false).is_some());
        assert!(known(&REDIS_PY.as_bytes()[1..], false).is_none());
    }

    /// What is recognised and what passes on, as a table.
    #[test]
    fn only_a_known_release_of_lock_keys_with_one_argument() {
        let locks = LockService::new(&Config::default());
        let py = "c3f8721cbb97f72bc19e972846bd7aaf91901658";
        let node = "e4612211c9f8f51c257e26e056b0a654b3187242";
        let cases: &[(String, Option<(usize, &str)>)] = &[
            (format!("EVALSHA {py} 1 lock:a tok"), Some((1, "tok"))),
            (
                format!("evalsha {} 1 lock:a tok", py.to_uppercase()),
                Some((1, "tok")),
            ),
            (format!("EVALSHA {py} 1 user:a tok"), None),
            (format!("EVALSHA {py} 1 lock:a tok extra"), None),
            (format!("EVALSHA {py} 1 lock:a"), None),
            (format!("EVALSHA {py} 2 lock:a lock:b tok"), None),
            (format!("EVALSHA {py} 0 tok"), None),
            (format!("EVALSHA {py} x lock:a tok"), None),
            (format!("EVALSHA_RO {py} 1 lock:a tok"), None),
            (
                format!("EVALSHA {node} 2 lock:a lock:b tok"),
                Some((2, "tok")),
            ),
            (format!("EVALSHA {node} 2 lock:a user:b tok"), None),
            (format!("EVALSHA {} 1 lock:a tok", "0".repeat(40)), None),
        ];
        for (line, want) in cases {
            let got = recognised(line, &locks).map(|op| match op {
                LockOp::Release {
                    lock_keys,
                    plain,
                    unlink: false,
                    by_value: Some(v),
                } if plain.is_empty() => {
                    (lock_keys.len(), String::from_utf8_lossy(&v).into_owned())
                }
                other => panic!("{line}: {other:?}"),
            });
            let want = want.map(|(n, v)| (n, v.to_string()));
            assert_eq!(got, want, "{line}");
        }
    }

    /// node-redlock's acquisition: one key, its token and a lease Redis
    /// takes; anything else passes on.
    #[test]
    fn only_a_one_key_acquisition_with_a_lease_redis_takes() {
        let locks = LockService::new(&Config::default());
        let acq = "96da70f7716f27d278a5218544df37fd8b0a5e4c";
        // (line, the key, token and lease ms it acquires with, if any)
        type Case = (String, Option<(&'static str, &'static str, &'static str)>);
        let cases: &[Case] = &[
            (
                format!("EVALSHA {acq} 1 lock:a tok 30000"),
                Some(("lock:a", "tok", "30000")),
            ),
            (
                format!("EVALSHA {acq} 1 lock:a tok 1"),
                Some(("lock:a", "tok", "1")),
            ),
            (format!("EVALSHA {acq} 1 user:a tok 30000"), None),
            (format!("EVALSHA {acq} 2 lock:a lock:b tok 30000"), None),
            (format!("EVALSHA {acq} 1 lock:a tok"), None),
            (format!("EVALSHA {acq} 1 lock:a tok 30000 x"), None),
            (format!("EVALSHA {acq} 1 lock:a tok 0"), None),
            (format!("EVALSHA {acq} 1 lock:a tok 030"), None),
            (format!("EVALSHA {acq} 1 lock:a tok -5"), None),
            (format!("EVALSHA {acq} 1 lock:a tok +5"), None),
            (format!("EVALSHA {acq} 1 lock:a tok 1.5"), None),
            (format!("EVALSHA {acq} 1 lock:a tok 1000000000000000"), None),
            (
                format!("EVALSHA {acq} 1 lock:a tok 999999999999999"),
                Some(("lock:a", "tok", "999999999999999")),
            ),
        ];
        for (line, want) in cases {
            let got = recognised(line, &locks).map(|op| match op {
                LockOp::Acquire {
                    key,
                    value,
                    ttl: Ttl::Given("PX", ms),
                    shape: Shape::SetNx,
                } => [key, value, ms].map(|b| String::from_utf8_lossy(&b).into_owned()),
                other => panic!("{line}: {other:?}"),
            });
            let want = want.map(|(k, v, ms)| [k, v, ms].map(str::to_string));
            assert_eq!(got, want, "{line}");
        }
    }
}
