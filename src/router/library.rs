//! Lock libraries' release scripts that lockgate carries out itself.
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
//! A script is recognised by its exact body (its SHA1, which `EVALSHA`
//! names and `EVAL`'s body hashes to), never by its text looking alike:
//! an exact body's effect is known. What lockgate runs instead does what
//! the body does, on the same keys and argument, with the same reply:
//!
//! | library | keys | body does | reply |
//! |---|---|---|---|
//! | redis-py `Lock` | 1 | `GET` the key; equal to `ARGV[1]`: `DEL` it | 1 deleted, 0 not |
//! | pottery `Redlock` | 1 | the same | the same |
//! | node-redlock | 1 or more | the same for each key | how many were deleted |
//!
//! A key that is not a string fails with `WRONGTYPE`, as the body's `GET`
//! fails. Only when every key is a lock key, exactly one argument follows
//! them, the locks live on one Redis (not the quorum) and that server runs
//! scripts; else the script passes on as any client script does. The
//! script itself
//! never reaches Redis, so there it is not loaded (`SCRIPT EXISTS` says 0
//! unless the client loaded it), and an `EVALSHA` of it never fails with
//! `NOSCRIPT` (docs/behaviour.md).

use bytes::Bytes;

use super::CommandArgs;
use crate::lock::ops::LockOp;
use crate::lock::LockService;

/// One release script lockgate recognises.
struct Known {
    /// SHA1 of its body, lowercase hex.
    sha: &'static [u8; 40],
    /// Its body's length in bytes: an `EVAL`'s body is hashed only when
    /// its length is one of these.
    len: usize,
    /// It takes one key only (else one or more).
    one_key: bool,
}

/// The release scripts recognised (their bodies are checked against the
/// installed libraries' in `tests/it/locks_library_release.rs`).
const KNOWN: [Known; 3] = [
    // redis-py 4 to 8, `Lock.LUA_RELEASE_SCRIPT`.
    Known {
        sha: b"c3f8721cbb97f72bc19e972846bd7aaf91901658",
        len: 185,
        one_key: true,
    },
    // pottery 3, `Redlock._release_script`.
    Known {
        sha: b"a4aada0b36710970eedaaaeec4a6b7d8c78c4f80",
        len: 199,
        one_key: true,
    },
    // node-redlock 5, `RELEASE_SCRIPT`.
    Known {
        sha: b"e4612211c9f8f51c257e26e056b0a654b3187242",
        len: 274,
        one_key: false,
    },
];

/// The release `args` (an `EVAL`-family command, name first, on one
/// Redis) asks for, if it is a recognised library's release
/// script on lock keys (see the module doc).
pub(super) fn release(args: CommandArgs<'_>, locks: &LockService) -> Option<LockOp> {
    let name = args.get(0);
    let by_sha = if name.eq_ignore_ascii_case(b"EVALSHA") {
        true
    } else if name.eq_ignore_ascii_case(b"EVAL") {
        false
    } else {
        return None;
    };
    let n: usize = std::str::from_utf8(args.get(2)).ok()?.parse().ok()?;
    // The keys, then exactly one argument: the library's token.
    if n == 0 || args.len() != 3 + n + 1 {
        return None;
    }
    let known = known(args.get(1), by_sha)?;
    if known.one_key && n != 1 {
        return None;
    }
    let keys: Vec<&[u8]> = (3..3 + n).map(|i| args.get(i)).collect();
    if !keys.iter().all(|k| locks.is_lock_key(k)) || locks.scriptless() {
        return None;
    }
    Some(LockOp::Release {
        lock_keys: keys.iter().map(|k| Bytes::copy_from_slice(k)).collect(),
        plain: Vec::new(),
        unlink: false,
        by_value: Some(Bytes::copy_from_slice(args.get(3 + n))),
    })
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
        release(CommandArgs::new(&p, buf.as_bytes()), locks)
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
}
