//! The words of the lock API for new code (`LOCKGATE LOCK | ACQUIRE |
//! UNLOCK | EXTEND | WATCH`), parsed into what is asked ([`Ask`]) before
//! anything is done: pure, table-tested. A `LOCK`'s keys are the
//! arguments before its lease, which is the first number followed by an
//! option or the end (a key may be a number; a key named `WAIT`, `SHARED`
//! or `OWNER` after a number is read as the option).

use std::time::Duration;

use bytes::Bytes;

use crate::lock::fence::Waiting;
use crate::lock::kinds::{Kind, KindCall};
use crate::lock::lease::ConnId;
use crate::lock::FenceCall;

/// Longest `WAIT` (and `WATCH … TIMEOUT`) a call may ask for.
pub const MAX_WAIT: Duration = Duration::from_secs(60);

/// Most keys one multi-key `LOCK` may name: it is one atomic step on
/// Redis, so its length bounds how long Redis is busy with it.
pub const MAX_KEYS: usize = 64;

/// One call of the lock API, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ask {
    /// `LOCK key… ttl-ms [WAIT ms] [SHARED] [OWNER id]`.
    Lock {
        /// One key, or every key of a multi-key lock.
        keys: Vec<Bytes>,
        /// The lease, ms.
        ttl_ms: u64,
        /// How long to keep trying.
        wait: Duration,
        /// A read lock.
        shared: bool,
        /// The reentrant owner.
        owner: Option<Bytes>,
    },
    /// `ACQUIRE key permits ttl-ms [WAIT ms] [OWNER id]`.
    Acquire {
        /// The semaphore's key.
        key: Bytes,
        /// How many holders it allows.
        permits: u64,
        /// The permit's lease, ms.
        ttl_ms: u64,
        /// How long to keep trying.
        wait: Duration,
        /// The reentrant owner.
        owner: Option<Bytes>,
    },
    /// `UNLOCK key token`.
    Unlock {
        /// The key.
        key: Bytes,
        /// The grant's token.
        token: Bytes,
    },
    /// `EXTEND key token ttl-ms`.
    Extend {
        /// The key.
        key: Bytes,
        /// The grant's token.
        token: Bytes,
        /// The new lease, ms.
        ttl_ms: u64,
    },
    /// `WATCH key token [TIMEOUT ms]`.
    Watch {
        /// The key.
        key: Bytes,
        /// The grant's token.
        token: Bytes,
        /// The longest wait.
        timeout: Duration,
    },
}

/// The usage line of `sub`, for its error.
fn usage(sub: &[u8]) -> &'static str {
    match sub {
        b"LOCK" => "LOCK key [key ...] ttl-ms [WAIT ms] [SHARED] [OWNER id]",
        b"ACQUIRE" => "ACQUIRE key permits ttl-ms [WAIT ms] [OWNER id]",
        b"UNLOCK" => "UNLOCK key token",
        b"EXTEND" => "EXTEND key token ttl-ms",
        _ => "WATCH key token [TIMEOUT ms]",
    }
}

fn number(arg: &[u8]) -> Option<u64> {
    std::str::from_utf8(arg).ok()?.parse().ok()
}

fn is_option(arg: &[u8]) -> bool {
    [&b"WAIT"[..], b"SHARED", b"OWNER"]
        .iter()
        .any(|o| arg.eq_ignore_ascii_case(o))
}

/// `WAIT ms`, `SHARED` and `OWNER id` in any order, each at most once:
/// (wait, shared, owner), or `None` for anything else.
fn options(rest: &[&[u8]]) -> Option<(Duration, bool, Option<Bytes>)> {
    let (mut wait, mut shared, mut owner) = (None, false, None);
    let mut i = 0;
    while i < rest.len() {
        let word = rest[i].to_ascii_uppercase();
        match word.as_slice() {
            b"WAIT" if wait.is_none() => {
                wait = Some(Duration::from_millis(number(rest.get(i + 1)?)?).min(MAX_WAIT));
                i += 2;
            }
            b"SHARED" if !shared => {
                shared = true;
                i += 1;
            }
            b"OWNER" if owner.is_none() => {
                let id = rest.get(i + 1).filter(|id| !id.is_empty())?;
                owner = Some(Bytes::copy_from_slice(id));
                i += 2;
            }
            _ => return None,
        }
    }
    Some((wait.unwrap_or(Duration::ZERO), shared, owner))
}

/// Why a call is not asked: its words are not the command's, or they ask
/// for more than is served. Its text is the error the client gets.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadCall {
    /// Not the command's words: its usage.
    #[error("lockgate: usage: LOCKGATE {0}")]
    Usage(&'static str),
    /// Well formed, but not served as asked.
    #[error("lockgate: {0}")]
    Refused(&'static str),
}

/// Parses `args` (`LOCKGATE`, the subcommand, its arguments).
pub fn parse(args: &[&[u8]]) -> Result<Ask, BadCall> {
    let sub = args
        .get(1)
        .map(|s| s.to_ascii_uppercase())
        .unwrap_or_default();
    let bad = || BadCall::Usage(usage(&sub));
    let rest = args.get(2..).unwrap_or_default();
    let key = || Bytes::copy_from_slice(rest[0]);
    match sub.as_slice() {
        b"LOCK" => {
            // The lease: the first number (after a key) followed by an
            // option or the end.
            let at = (1..rest.len())
                .find(|&i| {
                    number(rest[i]).is_some() && rest.get(i + 1).is_none_or(|a| is_option(a))
                })
                .ok_or_else(bad)?;
            let ttl_ms = number(rest[at]).filter(|&t| t > 0).ok_or_else(bad)?;
            let (wait, shared, owner) = options(&rest[at + 1..]).ok_or_else(bad)?;
            let keys: Vec<Bytes> = rest[..at]
                .iter()
                .map(|k| Bytes::copy_from_slice(k))
                .collect();
            if keys.len() > 1 {
                if shared || owner.is_some() {
                    return Err(bad());
                }
                if keys.len() > MAX_KEYS {
                    return Err(BadCall::Refused("a multi-key LOCK names at most 64 keys"));
                }
                let mut sorted = keys.clone();
                sorted.sort();
                sorted.dedup();
                if sorted.len() != keys.len() {
                    return Err(BadCall::Refused("a multi-key LOCK names each key once"));
                }
            }
            Ok(Ask::Lock {
                keys,
                ttl_ms,
                wait,
                shared,
                owner,
            })
        }
        b"ACQUIRE" => {
            if rest.len() < 3 {
                return Err(bad());
            }
            let permits = number(rest[1]).filter(|&p| p > 0).ok_or_else(bad)?;
            let ttl_ms = number(rest[2]).filter(|&t| t > 0).ok_or_else(bad)?;
            let (wait, shared, owner) = options(&rest[3..]).ok_or_else(bad)?;
            if shared {
                return Err(bad());
            }
            Ok(Ask::Acquire {
                key: key(),
                permits,
                ttl_ms,
                wait,
                owner,
            })
        }
        b"UNLOCK" if rest.len() == 2 => Ok(Ask::Unlock {
            key: key(),
            token: Bytes::copy_from_slice(rest[1]),
        }),
        b"EXTEND" if rest.len() == 3 => {
            let ttl_ms = number(rest[2]).filter(|&t| t > 0).ok_or_else(bad)?;
            Ok(Ask::Extend {
                key: key(),
                token: Bytes::copy_from_slice(rest[1]),
                ttl_ms,
            })
        }
        b"WATCH" if rest.len() == 2 || rest.len() == 4 => {
            let timeout = match rest.get(2) {
                None => MAX_WAIT.as_millis() as u64,
                Some(word) if word.eq_ignore_ascii_case(b"TIMEOUT") => {
                    number(rest[3]).ok_or_else(bad)?
                }
                Some(_) => return Err(bad()),
            };
            Ok(Ask::Watch {
                key: key(),
                token: Bytes::copy_from_slice(rest[1]),
                timeout: Duration::from_millis(timeout).min(MAX_WAIT),
            })
        }
        _ => Err(bad()),
    }
}

impl Ask {
    /// The keys it names (for the cluster's refusals).
    pub fn keys(&self) -> Vec<&[u8]> {
        match self {
            Ask::Lock { keys, .. } => keys.iter().map(|k| &k[..]).collect(),
            Ask::Acquire { key, .. }
            | Ask::Unlock { key, .. }
            | Ask::Extend { key, .. }
            | Ask::Watch { key, .. } => vec![&key[..]],
        }
    }

    /// The lock room's call for it, from `caller`'s connection.
    pub fn call(self, caller: ConnId) -> FenceCall {
        let waiting = |key: Bytes, wait| Waiting { key, caller, wait };
        match self {
            Ask::Lock {
                mut keys,
                ttl_ms,
                wait,
                shared,
                owner,
            } => {
                if keys.len() > 1 {
                    let at = waiting(keys[0].clone(), wait);
                    return FenceCall::Multi { keys, at, ttl_ms };
                }
                let at = waiting(keys.remove(0), wait);
                match (shared, owner) {
                    (false, None) => FenceCall::Lock { at, ttl_ms },
                    (shared, owner) => FenceCall::Kind(KindCall {
                        at,
                        ttl_ms,
                        kind: if shared {
                            Kind::Shared
                        } else {
                            Kind::Exclusive
                        },
                        owner,
                    }),
                }
            }
            Ask::Acquire {
                key,
                permits,
                ttl_ms,
                wait,
                owner,
            } => FenceCall::Kind(KindCall {
                at: waiting(key, wait),
                ttl_ms,
                kind: Kind::Permits(permits),
                owner,
            }),
            Ask::Unlock { key, token } => FenceCall::Unlock { key, token },
            Ask::Extend { key, token, ttl_ms } => FenceCall::Extend { key, token, ttl_ms },
            Ask::Watch {
                key,
                token,
                timeout,
            } => FenceCall::Watch {
                key,
                token,
                timeout,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(line: &str) -> Result<Ask, BadCall> {
        let words: Vec<&[u8]> = line.split(' ').map(str::as_bytes).collect();
        parse(&words)
    }

    fn b(s: &str) -> Bytes {
        Bytes::copy_from_slice(s.as_bytes())
    }

    fn lock(keys: &[&str], ttl_ms: u64, wait_ms: u64, shared: bool, owner: Option<&str>) -> Ask {
        Ask::Lock {
            keys: keys.iter().map(|k| b(k)).collect(),
            ttl_ms,
            wait: Duration::from_millis(wait_ms),
            shared,
            owner: owner.map(b),
        }
    }

    #[test]
    fn lock_calls_as_written() {
        let table = [
            ("LOCKGATE LOCK a 100", Ok(lock(&["a"], 100, 0, false, None))),
            (
                "LOCKGATE lock a 100 wait 5",
                Ok(lock(&["a"], 100, 5, false, None)),
            ),
            (
                "LOCKGATE LOCK a 100 SHARED",
                Ok(lock(&["a"], 100, 0, true, None)),
            ),
            (
                "LOCKGATE LOCK a 100 OWNER t1 SHARED WAIT 7",
                Ok(lock(&["a"], 100, 7, true, Some("t1"))),
            ),
            (
                "LOCKGATE LOCK a b 100",
                Ok(lock(&["a", "b"], 100, 0, false, None)),
            ),
            (
                "LOCKGATE LOCK 5 6 100 WAIT 1",
                Ok(lock(&["5", "6"], 100, 1, false, None)),
            ),
            // A key named as an option, before any number, is a key.
            (
                "LOCKGATE LOCK WAIT 100",
                Ok(lock(&["WAIT"], 100, 0, false, None)),
            ),
            // The longest wait is a minute.
            (
                "LOCKGATE LOCK a 100 WAIT 999999",
                Ok(lock(&["a"], 100, 60_000, false, None)),
            ),
        ];
        for (line, want) in table {
            assert_eq!(ask(line), want, "{line}");
        }
    }

    #[test]
    fn malformed_lock_calls_get_their_usage_or_why() {
        let usage = Err(BadCall::Usage(usage(b"LOCK")));
        for line in [
            "LOCKGATE LOCK",
            "LOCKGATE LOCK a",
            "LOCKGATE LOCK a 0",
            "LOCKGATE LOCK a 100 WAIT",
            "LOCKGATE LOCK a 100 WAIT x",
            "LOCKGATE LOCK a 100 WAIT 1 WAIT 2",
            "LOCKGATE LOCK a 100 OWNER",
            "LOCKGATE LOCK a 100 SHARED SHARED",
            "LOCKGATE LOCK a b 100 SHARED",
            "LOCKGATE LOCK a b 100 OWNER o",
        ] {
            assert_eq!(ask(line), usage, "{line}");
        }
        assert_eq!(
            ask("LOCKGATE LOCK a b a 100"),
            Err(BadCall::Refused("a multi-key LOCK names each key once"))
        );
        let many = (0..=MAX_KEYS).map(|i| format!("k{i}")).collect::<Vec<_>>();
        let err = ask(&format!("LOCKGATE LOCK {} 100", many.join(" "))).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("lockgate: a multi-key LOCK names at most {MAX_KEYS} keys")
        );
    }

    #[test]
    fn semaphore_and_token_calls() {
        assert_eq!(
            ask("LOCKGATE ACQUIRE s 3 100 WAIT 5 OWNER me"),
            Ok(Ask::Acquire {
                key: b("s"),
                permits: 3,
                ttl_ms: 100,
                wait: Duration::from_millis(5),
                owner: Some(b("me")),
            })
        );
        for line in [
            "LOCKGATE ACQUIRE s 0 100",
            "LOCKGATE ACQUIRE s 3",
            "LOCKGATE ACQUIRE s 3 100 SHARED",
        ] {
            assert_eq!(ask(line), Err(BadCall::Usage(usage(b"ACQUIRE"))), "{line}");
        }
        assert_eq!(
            ask("LOCKGATE UNLOCK a 17"),
            Ok(Ask::Unlock {
                key: b("a"),
                token: b("17")
            })
        );
        assert!(ask("LOCKGATE EXTEND a 17 0").is_err());
        assert_eq!(
            ask("LOCKGATE WATCH a 17 TIMEOUT 5"),
            Ok(Ask::Watch {
                key: b("a"),
                token: b("17"),
                timeout: Duration::from_millis(5)
            })
        );
        assert!(ask("LOCKGATE WATCH a 17 LATER 5").is_err());
    }
}
