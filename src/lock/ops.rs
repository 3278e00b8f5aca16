//! Lock operations: what a client command on a lock key means, parsed from
//! its arguments. Pure; anything that does not parse cleanly is left to
//! Redis (passed through), which then answers with its own error.

use bytes::Bytes;

/// The lease a lock is acquired with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ttl {
    /// The configured lease for the key (`default_lease_ms` or an override).
    Default,
    /// The client's own: `EX`, `PX`, `EXAT` or `PXAT` with its value.
    Given(&'static str, Bytes),
}

/// What the client expects back from an acquisition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// `SETNX`: `:1` / `:0`.
    SetNx,
    /// `SET … NX`: `+OK` / nil.
    Set,
    /// `SET … NX GET`: the old value / nil.
    SetGet,
}

impl Shape {
    /// The name the acquire script knows the shape by.
    pub fn as_str(self) -> &'static str {
        match self {
            Shape::SetNx => "setnx",
            Shape::Set => "set",
            Shape::SetGet => "setget",
        }
    }
}

/// One operation on lock keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LockOp {
    /// `SETNX k v`, `SET k v NX …`: atomic lease + owner record.
    Acquire {
        /// The lock key.
        key: Bytes,
        /// The client's value, stored unchanged.
        value: Bytes,
        /// The lease.
        ttl: Ttl,
        /// The reply shape.
        shape: Shape,
    },
    /// `DEL`/`UNLINK`: owner-checked for lock keys, plain for the others.
    Release {
        /// Lock keys, each owner-checked.
        lock_keys: Vec<Bytes>,
        /// Ordinary keys of the same command, deleted as usual.
        plain: Vec<Bytes>,
        /// `UNLINK` rather than `DEL`.
        unlink: bool,
        /// A release by value, not by owner: a lock library's own release
        /// script that lockgate carries out itself (one lock key, no plain
        /// keys; see [`crate::router::library`]). The key is deleted, or
        /// handed to a parked attempt, only while it still holds this
        /// value, whoever's connection asks, as the library's script
        /// would; the reply is the script's (1 released, 0 not).
        by_value: Option<Bytes>,
    },
    /// `EXPIRE`/`PEXPIRE`/`EXPIREAT`/`PEXPIREAT k …`: owner-checked, the lock
    /// and owner record move together.
    Extend {
        /// The lock key.
        key: Bytes,
        /// The command name, uppercase.
        command: &'static str,
        /// Its arguments after the key.
        args: Vec<Bytes>,
    },
    /// `GETSET`, `SET` without NX, `GETDEL`, `GETEX`: the value and owner
    /// record change together, the lease is kept.
    Takeover {
        /// The lock key.
        key: Bytes,
        /// The command name, uppercase.
        command: &'static str,
        /// Its arguments after the key.
        args: Vec<Bytes>,
    },
}

impl LockOp {
    /// The lock keys it acts on.
    pub fn lock_keys(&self) -> impl Iterator<Item = &[u8]> {
        let (one, many): (Option<&Bytes>, &[Bytes]) = match self {
            LockOp::Acquire { key, .. }
            | LockOp::Extend { key, .. }
            | LockOp::Takeover { key, .. } => (Some(key), &[]),
            LockOp::Release { lock_keys, .. } => (None, lock_keys),
        };
        one.into_iter().chain(many).map(|k| &k[..])
    }
}

/// The options of `SET key value [opts…]`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SetOptions<'a> {
    /// `NX`.
    pub nx: bool,
    /// `XX`.
    pub xx: bool,
    /// `GET`.
    pub get: bool,
    /// `KEEPTTL`.
    pub keepttl: bool,
    /// The expiry option (`EX`, `PX`, `EXAT`, `PXAT`) and its value.
    pub ttl: Option<(&'static str, &'a [u8])>,
}

/// Reads `opts`, the arguments of `SET` after the value, as Redis reads
/// them; `None` for an option it does not know or a combination it
/// refuses.
pub fn set_options<'a>(opts: &[&'a [u8]]) -> Option<SetOptions<'a>> {
    let mut o = SetOptions::default();
    let mut i = 0;
    while i < opts.len() {
        let opt = opts[i].to_ascii_uppercase();
        match opt.as_slice() {
            b"NX" => o.nx = true,
            b"XX" => o.xx = true,
            b"GET" => o.get = true,
            b"KEEPTTL" => o.keepttl = true,
            b"EX" | b"PX" | b"EXAT" | b"PXAT" => {
                let kind = match opt.as_slice() {
                    b"EX" => "EX",
                    b"PX" => "PX",
                    b"EXAT" => "EXAT",
                    _ => "PXAT",
                };
                // Redis refuses two different expiries but takes the same
                // one twice (the last wins): refusing it here would pass the
                // command to Redis, which would set the lock unprotected.
                if o.ttl.is_some_and(|(seen, _)| seen != kind) {
                    return None;
                }
                o.ttl = Some((kind, opts.get(i + 1)?));
                i += 1;
            }
            _ => return None,
        }
        i += 1;
    }
    if (o.nx && o.xx) || (o.keepttl && o.ttl.is_some()) {
        return None;
    }
    Some(o)
}

/// Parses the options of `SET key value [opts…]` on a lock key.
pub fn parse_set(args: &[&[u8]]) -> Option<LockOp> {
    let (key, value) = (args.get(1)?, args.get(2)?);
    let SetOptions { nx, get, ttl, .. } = set_options(&args[3..])?;
    if !nx {
        return Some(LockOp::Takeover {
            key: Bytes::copy_from_slice(key),
            command: "SET",
            args: args[2..]
                .iter()
                .map(|a| Bytes::copy_from_slice(a))
                .collect(),
        });
    }
    Some(LockOp::Acquire {
        key: Bytes::copy_from_slice(key),
        value: Bytes::copy_from_slice(value),
        ttl: match ttl {
            Some((kind, v)) => Ttl::Given(kind, Bytes::copy_from_slice(v)),
            None => Ttl::Default,
        },
        shape: if get { Shape::SetGet } else { Shape::Set },
    })
}

/// `SETNX key value`.
pub fn parse_setnx(args: &[&[u8]]) -> Option<LockOp> {
    if args.len() != 3 {
        return None;
    }
    Some(LockOp::Acquire {
        key: Bytes::copy_from_slice(args[1]),
        value: Bytes::copy_from_slice(args[2]),
        ttl: Ttl::Default,
        shape: Shape::SetNx,
    })
}

/// A command whose first argument is the key, kept whole (`command` is the
/// uppercase name), as an extension or a takeover.
pub fn keyed(args: &[&[u8]], command: &'static str, extend: bool) -> Option<LockOp> {
    let key = Bytes::copy_from_slice(args.get(1)?);
    let rest = args[2..]
        .iter()
        .map(|a| Bytes::copy_from_slice(a))
        .collect();
    Some(if extend {
        LockOp::Extend {
            key,
            command,
            args: rest,
        }
    } else {
        LockOp::Takeover {
            key,
            command,
            args: rest,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> Vec<&[u8]> {
        s.split(' ').map(|w| w.as_bytes()).collect()
    }

    #[test]
    fn set_variants() {
        match parse_set(&a("SET k v nx px 500")) {
            Some(LockOp::Acquire {
                ttl: Ttl::Given("PX", v),
                shape: Shape::Set,
                ..
            }) => {
                assert_eq!(&v[..], b"500")
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            parse_set(&a("SET k v NX GET")),
            Some(LockOp::Acquire {
                ttl: Ttl::Default,
                shape: Shape::SetGet,
                ..
            })
        ));
        assert!(matches!(
            parse_set(&a("SET k v")),
            Some(LockOp::Takeover { command: "SET", .. })
        ));
        assert_eq!(parse_set(&a("SET k v NX XX")), None);
        assert_eq!(parse_set(&a("SET k v NX EX 1 PX 2")), None);
        assert_eq!(parse_set(&a("SET k v NX EX")), None);
        assert_eq!(parse_set(&a("SET k v BOGUS")), None);
    }

    /// Found writing the `lock_ops` fuzz target's reference: Redis 7
    /// answers `+OK` to `SET k v NX PX 100000 PX 200000` (PTTL then 200000),
    /// so lockgate must take it as an acquisition too, with the last value;
    /// it used to pass it through, and the lock was set without owner
    /// record.
    #[test]
    fn a_repeated_expiry_is_an_acquisition_with_the_last_value() {
        match parse_set(&a("SET k v NX PX 100000 px 200000")) {
            Some(LockOp::Acquire {
                ttl: Ttl::Given("PX", v),
                ..
            }) => assert_eq!(&v[..], b"200000"),
            other => panic!("{other:?}"),
        }
        assert_eq!(parse_set(&a("SET k v NX PX 1 EX 2")), None);
        assert_eq!(parse_set(&a("SET k v NX PX 1 KEEPTTL")), None);
    }

    #[test]
    fn setnx_arity() {
        assert!(parse_setnx(&a("SETNX k v")).is_some());
        assert!(parse_setnx(&a("SETNX k")).is_none());
    }
}
