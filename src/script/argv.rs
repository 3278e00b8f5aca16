//! The ARGV of the scripts a lock operation plans (`LockService::plan`),
//! slot by slot, next to the Lua that reads them. A struct's fields are the
//! fixed slots in the order the script reads them (`ARGV[1]` first); a
//! script that takes a variable tail (tokens, a command's arguments) has it
//! after them. The test below reads every script's body and checks that it
//! reads exactly the slots its struct writes, so a slot moved on one side
//! only fails the build's tests, not a client at run time.

use bytes::Bytes;

/// [`super::ACQUIRE`]'s ARGV.
#[derive(Debug, Clone, Copy)]
pub struct AcquireArgv<'a> {
    /// `"1"` facts, `"0"` inside `MULTI`, `"2"` facts and the clock.
    pub info: &'a [u8],
    /// The client's value.
    pub value: &'a [u8],
    /// The acquisition token for the owner record.
    pub token: &'a [u8],
    /// `PX`, `EX`, `PXAT` or `EXAT`.
    pub ttl_kind: &'a [u8],
    /// The lease in that unit.
    pub ttl: &'a [u8],
    /// The reply's shape: `setnx`, `set` or `setget`.
    pub shape: &'a [u8],
    /// This instance's prefix (`id:`).
    pub prefix: &'a [u8],
    /// The fairness bound, ms (`0`: off).
    pub bound_ms: &'a [u8],
    /// A place's life in the key's queue, ms (`0`: no queue).
    pub place_ms: &'a [u8],
    /// `1`: a failed attempt takes or renews this instance's place in the
    /// queue; `0`: the place is fresh, renew nothing.
    pub renew: &'a [u8],
}

/// Slots [`AcquireArgv`] fills.
const ACQUIRE_SLOTS: usize = 10;

impl<'a> AcquireArgv<'a> {
    /// Slots it fills.
    pub const SLOTS: usize = ACQUIRE_SLOTS;

    /// The slots, `ARGV[1]` first.
    pub fn slots(&self) -> [&'a [u8]; ACQUIRE_SLOTS] {
        [
            self.info,
            self.value,
            self.token,
            self.ttl_kind,
            self.ttl,
            self.shape,
            self.prefix,
            self.bound_ms,
            self.place_ms,
            self.renew,
        ]
    }
}

/// [`super::RELEASE`]'s fixed ARGV; n tokens and n lists of unsettled
/// attempts follow ([`ReleaseArgv::with`]).
#[derive(Debug, Clone, Copy)]
pub struct ReleaseArgv<'a> {
    /// `"1"` facts, `"0"` inside `MULTI`.
    pub info: &'a [u8],
    /// How many lock keys (n).
    pub n: &'a [u8],
    /// `DEL` or `UNLINK`.
    pub verb: &'a [u8],
    /// `instance` or `any`.
    pub ownership: &'a [u8],
    /// This instance's prefix (`id:`).
    pub prefix: &'a [u8],
    /// The connection's birth (the pooled rule).
    pub born: &'a [u8],
}

impl<'a> ReleaseArgv<'a> {
    /// Fixed slots, before the tail.
    pub const FIXED: usize = 6;

    /// The whole ARGV: the fixed slots, then `tokens`, then `alts` (one of
    /// each per lock key, in the keys' order).
    pub fn with(&self, tokens: &'a [Bytes], alts: &'a [Bytes]) -> Vec<&'a [u8]> {
        let mut argv = vec![
            self.info,
            self.n,
            self.verb,
            self.ownership,
            self.prefix,
            self.born,
        ];
        argv.extend(tokens.iter().map(|t| &t[..]));
        argv.extend(alts.iter().map(|t| &t[..]));
        argv
    }
}

/// [`super::RELEASE_HANDOFF`]'s ARGV.
#[derive(Debug, Clone, Copy)]
pub struct ReleaseHandoffArgv<'a> {
    /// `"1"` facts, `"0"` inside `MULTI`.
    pub info: &'a [u8],
    /// `DEL` or `UNLINK`.
    pub verb: &'a [u8],
    /// `instance` or `any`.
    pub ownership: &'a [u8],
    /// This instance's prefix (`id:`).
    pub prefix: &'a [u8],
    /// The releasing connection's token (`''`: it never acquired).
    pub token: &'a [u8],
    /// The next holder's value.
    pub next_value: &'a [u8],
    /// The next holder's token.
    pub next_token: &'a [u8],
    /// The next holder's lease, ms.
    pub next_lease_ms: &'a [u8],
    /// The releasing connection's unsettled attempts.
    pub alt: &'a [u8],
    /// The connection's birth (the pooled rule).
    pub born: &'a [u8],
    /// The fairness bound, ms (`0`: off).
    pub bound_ms: &'a [u8],
    /// A place's life in the key's queue, ms.
    pub place_ms: &'a [u8],
}

/// Slots [`ReleaseHandoffArgv`] fills.
const RELEASE_HANDOFF_SLOTS: usize = 12;

impl<'a> ReleaseHandoffArgv<'a> {
    /// Slots it fills.
    pub const SLOTS: usize = RELEASE_HANDOFF_SLOTS;

    /// The slots, `ARGV[1]` first.
    pub fn slots(&self) -> [&'a [u8]; RELEASE_HANDOFF_SLOTS] {
        [
            self.info,
            self.verb,
            self.ownership,
            self.prefix,
            self.token,
            self.next_value,
            self.next_token,
            self.next_lease_ms,
            self.alt,
            self.born,
            self.bound_ms,
            self.place_ms,
        ]
    }
}

/// [`super::EXTEND`]'s fixed ARGV; the command's arguments after the key
/// follow ([`ExtendArgv::with`]).
#[derive(Debug, Clone, Copy)]
pub struct ExtendArgv<'a> {
    /// `"1"` facts, `"0"` inside `MULTI`.
    pub info: &'a [u8],
    /// `instance` or `any`.
    pub ownership: &'a [u8],
    /// This instance's prefix (`id:`).
    pub prefix: &'a [u8],
    /// The connection's token (`''`: it never acquired).
    pub token: &'a [u8],
    /// Its unsettled attempts.
    pub alt: &'a [u8],
    /// The connection's birth (the pooled rule).
    pub born: &'a [u8],
    /// The command, uppercase (`EXPIRE`, `PEXPIRE`, …).
    pub command: &'a [u8],
}

impl<'a> ExtendArgv<'a> {
    /// Fixed slots, before the tail.
    pub const FIXED: usize = 7;

    /// The whole ARGV: the fixed slots, then `args`.
    pub fn with(&self, args: &'a [Bytes]) -> Vec<&'a [u8]> {
        let mut argv = vec![
            self.info,
            self.ownership,
            self.prefix,
            self.token,
            self.alt,
            self.born,
            self.command,
        ];
        argv.extend(args.iter().map(|a| &a[..]));
        argv
    }
}

/// [`super::TAKEOVER`]'s fixed ARGV; the command's arguments after the
/// key follow ([`TakeoverArgv::with`]).
#[derive(Debug, Clone, Copy)]
pub struct TakeoverArgv<'a> {
    /// `"1"` facts, `"0"` inside `MULTI`.
    pub info: &'a [u8],
    /// The token for the owner record.
    pub token: &'a [u8],
    /// The default lease, ms.
    pub lease_ms: &'a [u8],
    /// The command, uppercase.
    pub command: &'a [u8],
}

impl<'a> TakeoverArgv<'a> {
    /// Fixed slots, before the tail.
    pub const FIXED: usize = 4;

    /// The whole ARGV: the fixed slots, then `args`.
    pub fn with(&self, args: &'a [Bytes]) -> Vec<&'a [u8]> {
        let mut argv = vec![self.info, self.token, self.lease_ms, self.command];
        argv.extend(args.iter().map(|a| &a[..]));
        argv
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// The `n` of every `ARGV[n]` the body reads with a literal index.
    fn literal_slots(body: &str) -> BTreeSet<usize> {
        body.split("ARGV[")
            .skip(1)
            .filter_map(|rest| {
                let rest = rest.trim_start();
                let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                let after = rest[digits.len()..].trim_start();
                (!digits.is_empty() && after.starts_with(']'))
                    .then(|| digits.parse().ok())
                    .flatten()
            })
            .collect()
    }

    /// Where the body starts reading a variable tail: `k + 1` for
    /// `ARGV[k + i]` (i from 1), `k` for `unpack(ARGV, k)`.
    fn tail_starts(body: &str) -> BTreeSet<usize> {
        let indexed = body.split("ARGV[").skip(1).filter_map(|rest| {
            let rest = rest.trim_start();
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            let after = rest[digits.len()..].trim_start();
            after
                .starts_with('+')
                .then(|| digits.parse::<usize>().ok().map(|k| k + 1))
                .flatten()
        });
        let unpacked = body.split("unpack(ARGV,").skip(1).filter_map(|rest| {
            let digits: String = rest
                .trim_start()
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            digits.parse().ok()
        });
        indexed.chain(unpacked).collect()
    }

    fn upto(n: usize) -> BTreeSet<usize> {
        (1..=n).collect()
    }

    #[test]
    fn every_script_reads_exactly_the_slots_its_argv_writes() {
        use crate::script::{ACQUIRE, EXTEND, RELEASE, RELEASE_HANDOFF, TAKEOVER};
        // Fixed-size ARGV: every slot read, nothing beyond.
        for (name, body, slots) in [
            ("ACQUIRE", ACQUIRE, AcquireArgv::SLOTS),
            (
                "RELEASE_HANDOFF",
                RELEASE_HANDOFF,
                ReleaseHandoffArgv::SLOTS,
            ),
        ] {
            assert_eq!(literal_slots(body), upto(slots), "{name}");
            assert!(tail_starts(body).is_empty(), "{name} reads a tail");
        }
        // Fixed slots then a tail: every fixed slot read, the tail read
        // from the slot after them. EXTEND also reads the first of its
        // command's arguments by name (EXPIRE's amount).
        for (name, body, fixed, first_of_tail_read) in [
            ("RELEASE", RELEASE, ReleaseArgv::FIXED, false),
            ("EXTEND", EXTEND, ExtendArgv::FIXED, true),
            ("TAKEOVER", TAKEOVER, TakeoverArgv::FIXED, false),
        ] {
            let mut want = upto(fixed);
            if first_of_tail_read {
                want.insert(fixed + 1);
            }
            assert_eq!(literal_slots(body), want, "{name}");
            let starts = tail_starts(body);
            assert!(
                !starts.is_empty() && starts.iter().all(|&s| s == fixed + 1),
                "{name} reads its tail from {starts:?}, its ARGV puts it at {}",
                fixed + 1
            );
        }
    }

    #[test]
    fn the_parser_sees_what_a_moved_slot_would_change() {
        let body = "local a = ARGV[1] local b = ARGV[ 3 ] local t = ARGV[6 + i] \
                    redis.call(x, unpack(ARGV, 8))";
        assert_eq!(literal_slots(body), [1, 3].into_iter().collect());
        assert_eq!(tail_starts(body), [7, 8].into_iter().collect());
    }

    #[test]
    fn tails_follow_the_fixed_slots() {
        let tokens = [Bytes::from_static(b"t1"), Bytes::from_static(b"t2")];
        let alts = [Bytes::from_static(b"a1"), Bytes::from_static(b"")];
        let r = ReleaseArgv {
            info: b"1",
            n: b"2",
            verb: b"DEL",
            ownership: b"instance",
            prefix: b"p:",
            born: b"7",
        };
        let argv = r.with(&tokens, &alts);
        assert_eq!(argv.len(), ReleaseArgv::FIXED + 4);
        assert_eq!(&argv[ReleaseArgv::FIXED..], [&b"t1"[..], b"t2", b"a1", b""]);
        let args = [Bytes::from_static(b"100")];
        let e = ExtendArgv {
            info: b"1",
            ownership: b"any",
            prefix: b"p:",
            token: b"",
            alt: b"",
            born: b"0",
            command: b"PEXPIRE",
        };
        assert_eq!(e.with(&args)[ExtendArgv::FIXED], b"100");
    }
}
