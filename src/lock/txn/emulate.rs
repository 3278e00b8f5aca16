//! Each lock script, carried out as an optimistic transaction: `WATCH` its
//! keys, read what the script reads, decide in Rust what the script
//! decides, then write what it writes between `MULTI` and `EXEC`, which
//! Redis runs only if no watched key changed since the `WATCH` (else the
//! transaction is tried again). The reply is what the script would have
//! answered, byte for byte in RESP2, so the lock room learns it as it
//! learns a script's ([`crate::lock::split_reply`]).
//!
//! The cross-instance queue (`lockgate:queue:{key}`) is not kept: it lives
//! in the scripts' atomic steps, and on a server without scripts no
//! instance can write it. Acquisitions neither join nor yield; a release
//! wakes nobody by the queue (waiters on other instances probe, see
//! docs/faults.md, "Scripts refused").

use bytes::Bytes;

use super::resp::{self, as_bulk, as_int, as_simple, cmd, err, facts, int, is_err, NIL, OK};
use crate::lock::ops::set_options;
use crate::script::Script;

/// What a transaction's reads decided.
#[derive(Debug, PartialEq, Eq)]
pub enum Decision {
    /// The script's reply; nothing is written.
    Answer(Bytes),
    /// These commands, between `MULTI` and `EXEC`; `memo` carries what the
    /// reads decided to [`Job::finish`].
    Write {
        /// The writes.
        commands: Vec<Bytes>,
        /// What the reads decided, for the reply.
        memo: Vec<i64>,
    },
}

/// One script call: which script, its keys and its arguments.
#[derive(Debug, Clone)]
pub struct Job {
    /// The script.
    pub kind: Script,
    /// `KEYS`.
    pub keys: Vec<Bytes>,
    /// `ARGV`.
    pub argv: Vec<Bytes>,
}

impl Job {
    fn k(&self, i: usize) -> &[u8] {
        self.keys.get(i).map_or(&b""[..], |k| &k[..])
    }

    fn a(&self, i: usize) -> &[u8] {
        self.argv.get(i).map_or(&b""[..], |a| &a[..])
    }

    /// The keys to `WATCH`: the lock keys and owner records (and the fence
    /// counter) whose reads decide.
    pub fn watch(&self) -> Vec<Bytes> {
        match self.kind {
            Script::Pass | Script::Error | Script::Guard | Script::GuardTx | Script::Reconcile => {
                Vec::new()
            }
            Script::Release => {
                let n = self.n();
                (0..n)
                    .flat_map(|i| [self.keys[4 * i].clone(), self.keys[4 * i + 1].clone()])
                    .collect()
            }
            Script::FenceLock => self.keys.iter().take(3).cloned().collect(),
            _ => self.keys.iter().take(2).cloned().collect(),
        }
    }

    /// Lock keys in a release: `n`, bounded by the keys given.
    fn n(&self) -> usize {
        let n = std::str::from_utf8(self.a(1))
            .ok()
            .and_then(|s| s.parse::<usize>().ok())
            .unwrap_or(0);
        n.min(self.keys.len() / 4)
    }

    /// The reads, sent right after the `WATCH`.
    pub fn reads(&self) -> Vec<Bytes> {
        let (lock, owner) = (self.k(0), self.k(1));
        match self.kind {
            Script::Acquire => {
                let mut r = vec![cmd(&[b"EXISTS", lock]), cmd(&[b"PTTL", lock])];
                if self.a(5) == b"setget" {
                    r.push(cmd(&[b"GET", lock]));
                }
                r
            }
            Script::Release => (0..self.n())
                .map(|i| cmd(&[b"GET", &self.keys[4 * i + 1]]))
                .collect(),
            Script::ReleaseHandoff => vec![cmd(&[b"GET", owner]), cmd(&[b"TYPE", lock])],
            Script::Extend | Script::ExtendFast => {
                vec![cmd(&[b"GET", owner]), cmd(&[b"EXISTS", lock])]
            }
            Script::Takeover => vec![
                cmd(&[b"PTTL", lock]),
                cmd(&[b"PEXPIRETIME", lock]),
                cmd(&[b"TYPE", lock]),
            ],
            Script::ReleaseFast => vec![cmd(&[b"GET", owner])],
            Script::Renew => vec![
                cmd(&[b"GET", owner]),
                cmd(&[b"GET", lock]),
                cmd(&[b"PTTL", lock]),
                cmd(&[b"PEXPIRETIME", lock]),
            ],
            Script::ReleaseToken => vec![cmd(&[b"GET", owner]), cmd(&[b"GET", lock])],
            Script::FenceLock => vec![
                cmd(&[b"EXISTS", lock]),
                cmd(&[b"PTTL", lock]),
                cmd(&[b"GET", self.k(2)]),
                cmd(&[b"TIME"]),
            ],
            Script::FenceUnlock | Script::FenceExtend => vec![cmd(&[b"GET", lock])],
            Script::Pass | Script::Error | Script::Guard | Script::GuardTx | Script::Reconcile => {
                Vec::new()
            }
        }
    }

    /// A release by value (a lock library's release script, which
    /// lockgate carries out itself only where scripts run: see
    /// `crate::router::library`).
    fn by_value(&self) -> bool {
        match self.kind {
            Script::Release => self.a(3) == b"value",
            Script::ReleaseHandoff => self.a(2) == b"value",
            Script::ReleaseFast => self.argv.len() > 2,
            _ => false,
        }
    }

    /// What the script decides from `reads` (one reply per [`Job::reads`]).
    pub fn decide(&self, reads: &[Bytes]) -> Decision {
        // Never planned on a server that refuses scripts: the library's
        // own script could not have run there either. Said, should one
        // come (the server turned scriptless since), rather than checked
        // by the owner record instead of the value.
        if self.by_value() {
            return Decision::Answer(err(
                "ERR lockgate: a lock library's release script cannot run on a server that refuses scripts",
            ));
        }
        // A read the script makes with `redis.call` fails the script.
        if let Some(e) = reads.iter().find(|r| is_err(r)) {
            if !(self.kind == Script::Acquire && self.a(5) == b"setget") {
                return Decision::Answer(e.clone());
            }
        }
        match self.kind {
            Script::Acquire => self.acquire(reads),
            Script::Release => self.release(reads),
            Script::ReleaseHandoff => self.handoff(reads),
            Script::Extend => self.extend(reads),
            Script::Takeover => self.takeover(reads),
            Script::ReleaseFast => self.release_fast(reads),
            Script::ExtendFast => self.extend_fast(reads),
            Script::Renew => self.renew(reads),
            Script::ReleaseToken => self.release_token(reads),
            Script::FenceLock => self.fence_lock(reads),
            Script::FenceUnlock => self.fence_unlock(reads),
            Script::FenceExtend => self.fence_extend(reads),
            Script::Pass => Decision::Answer(int(0)),
            // Never planned on a server that refuses scripts
            // (`crate::lock::guard::Uncheckable::Scriptless`); said, should
            // one come, rather than written unchecked.
            Script::Guard | Script::GuardTx => Decision::Answer(err(
                "ERR lockgate: a guarded write cannot be checked on a server that refuses scripts",
            )),
            // Never sent to a server that refuses scripts: no client
            // script runs there to reconcile (`crate::lock::reconcile`).
            Script::Reconcile => Decision::Answer(err(
                "ERR lockgate: no client script runs on a server that refuses scripts",
            )),
            Script::Error => {
                Decision::Answer(Bytes::from([&b"-"[..], self.a(0), b"\r\n"].concat()))
            }
        }
    }

    /// The script's reply, from what the reads decided (`memo`) and
    /// `EXEC`'s replies, one per write.
    pub fn finish(&self, memo: &[i64], done: &[Bytes]) -> Bytes {
        let first = done
            .first()
            .cloned()
            .unwrap_or_else(|| Bytes::from_static(NIL));
        let m = |i: usize| memo.get(i).copied().unwrap_or(0);
        let n_at = |i: usize| done.get(i).and_then(|r| as_int(r)).unwrap_or(0);
        match self.kind {
            Script::Acquire => {
                if is_err(&first) {
                    return first;
                }
                let pttl = match self.a(3) {
                    b"PX" => parse(self.a(4)),
                    b"EX" => parse(self.a(4)).saturating_mul(1000),
                    _ => n_at(2),
                };
                let reply = match self.a(5) {
                    b"setnx" => int(1),
                    b"set" => Bytes::from_static(OK),
                    _ => Bytes::from_static(NIL),
                };
                match self.a(0) {
                    b"3" => int(1),
                    b"0" => reply,
                    _ => facts(reply, &[1, pttl, 0, 0, 0, 0]),
                }
            }
            Script::Release => {
                // memo: per lock key written, 1 with its owner record, 0
                // without; then denied, lapsed, stale, plain keys (1/0).
                let written = memo.len().saturating_sub(4);
                let (denied, lapsed, stale, plain) =
                    (m(written), m(written + 1), m(written + 2), m(written + 3));
                let (mut total, mut released, mut freed) = (0, 0, 0);
                for (i, &with_owner) in memo[..written].iter().enumerate() {
                    let d = n_at(i) - with_owner;
                    match with_owner {
                        1 => released += d,
                        _ => freed += d,
                    }
                    total += d;
                }
                if plain == 1 {
                    total += n_at(written);
                }
                match self.a(0) {
                    b"1" => facts(
                        int(total),
                        &[released, denied, lapsed, 0, stale, 0, 0, freed],
                    ),
                    _ => int(total),
                }
            }
            Script::ReleaseHandoff => {
                // memo: handed over (1) or deleted (0), owner record, lapsed, stale.
                let (handed, owner, lapsed, stale) = (m(0), m(1), m(2), m(3));
                let d = match handed {
                    1 => i64::from(as_bulk(&first).is_some_and(|b| b.is_some())),
                    _ => n_at(0) - owner,
                };
                let released = if owner == 1 { d } else { 0 };
                match self.a(0) {
                    b"1" => facts(int(d), &[released, 0, lapsed, handed, stale, 0, 0, 0]),
                    _ => int(d),
                }
            }
            Script::Extend => {
                if is_err(&first) {
                    return first;
                }
                let pttl = done.last().and_then(|r| as_int(r)).unwrap_or(-2);
                match self.a(0) {
                    b"1" => facts(first, &[1, m(0), pttl, m(1)]),
                    _ => first,
                }
            }
            Script::Takeover => {
                if is_err(&first) || m(0) == 0 {
                    return first;
                }
                let after = done.last().and_then(|r| as_int(r)).unwrap_or(-2);
                match self.a(0) {
                    b"1" => facts(first, &[after]),
                    _ => first,
                }
            }
            Script::ReleaseFast => int(n_at(0) - 1),
            Script::ExtendFast => first,
            Script::Renew | Script::ReleaseToken | Script::FenceUnlock | Script::FenceExtend => {
                int(m(0))
            }
            Script::FenceLock => resp::array(&[int(m(0)), int(0)]),
            Script::Pass | Script::Error | Script::Guard | Script::GuardTx | Script::Reconcile => {
                int(0)
            }
        }
    }

    fn facts_or(&self, reply: Bytes, rest: &[i64]) -> Bytes {
        match self.a(0) {
            b"0" => reply,
            _ => facts(reply, rest),
        }
    }

    fn acquire(&self, reads: &[Bytes]) -> Decision {
        let (lock, owner) = (self.k(0), self.k(1));
        let old = reads
            .get(2)
            .cloned()
            .unwrap_or_else(|| Bytes::from_static(NIL));
        // `GET` of a lock key that is not a string: the script returns
        // that error before trying.
        if is_err(&old) {
            return Decision::Answer(old);
        }
        if self.a(0) == b"2" {
            return Decision::Answer(err(
                "ERR lockgate: the quorum's acquisition needs scripts on its masters",
            ));
        }
        let (kind, ttl) = (self.a(3), self.a(4));
        if let Some(e) = set_ttl_error(kind, ttl, "set") {
            return Decision::Answer(e);
        }
        let exists = reads.first().and_then(|r| as_int(r)).unwrap_or(1) == 1;
        if exists {
            let pttl = reads.get(1).and_then(|r| as_int(r)).unwrap_or(-2);
            let reply = match self.a(5) {
                b"setnx" => int(0),
                b"set" => Bytes::from_static(NIL),
                _ => old,
            };
            return Decision::Answer(self.facts_or(reply, &[0, pttl, 0, 0, 0, 0]));
        }
        let mut commands = vec![
            cmd(&[b"SET", lock, self.a(1), kind, ttl]),
            cmd(&[b"SET", owner, self.a(2), kind, ttl]),
        ];
        if kind != b"PX" && kind != b"EX" {
            commands.push(cmd(&[b"PTTL", lock]));
        }
        Decision::Write {
            commands,
            memo: Vec::new(),
        }
    }

    fn release(&self, reads: &[Bytes]) -> Decision {
        let n = self.n();
        let (verb, any, prefix, born) = (self.a(2), self.a(3) == b"any", self.a(4), self.a(5));
        let mut commands = Vec::new();
        let mut memo = Vec::new();
        let (mut denied, mut lapsed, mut stale) = (0, 0, 0);
        let mut seen: Vec<&[u8]> = Vec::new();
        let mut gone: Vec<&[u8]> = Vec::new();
        for i in 0..n {
            let (key, rec) = (&self.keys[4 * i][..], &self.keys[4 * i + 1][..]);
            let again = seen.contains(&key);
            seen.push(key);
            let tok = if again { &b""[..] } else { self.a(6 + i) };
            let alt = self.a(6 + n + i);
            let owner = match gone.contains(&key) {
                true => None,
                false => reads.get(i).and_then(|r| as_bulk(r)).flatten(),
            };
            let (allowed, lapse, young) = allows(owner, tok, alt, prefix, any, born);
            lapsed += lapse;
            stale += young;
            if !allowed {
                denied += 1;
                continue;
            }
            match owner {
                Some(_) => {
                    commands.push(cmd(&[verb, key, rec]));
                    memo.push(1);
                }
                None => {
                    commands.push(cmd(&[verb, key]));
                    memo.push(0);
                }
            }
            gone.push(key);
        }
        let plain: Vec<&[u8]> = self.keys[4 * n..].iter().map(|k| &k[..]).collect();
        if !plain.is_empty() {
            let mut args: Vec<&[u8]> = vec![verb];
            args.extend(plain);
            commands.push(cmd(&args));
        }
        if commands.is_empty() {
            return Decision::Answer(
                self.facts_or(int(0), &[0, denied, lapsed, 0, stale, 0, 0, 0]),
            );
        }
        let has_plain = i64::from(self.keys.len() > 4 * n);
        memo.extend([denied, lapsed, stale, has_plain]);
        Decision::Write { commands, memo }
    }

    fn handoff(&self, reads: &[Bytes]) -> Decision {
        let (lock, rec) = (self.k(0), self.k(1));
        let owner = reads.first().and_then(|r| as_bulk(r)).flatten();
        let (allowed, lapsed, stale) = allows(
            owner,
            self.a(4),
            self.a(8),
            self.a(3),
            self.a(2) == b"any",
            self.a(9),
        );
        if !allowed {
            return Decision::Answer(self.facts_or(int(0), &[0, 1, lapsed, 0, stale, 0, 0, 0]));
        }
        let with_owner = i64::from(owner.is_some());
        let kind = reads.get(1).and_then(|r| as_simple(r)).unwrap_or(b"none");
        if kind == b"string" || kind == b"none" {
            let (value, token, lease) = (self.a(5), self.a(6), self.a(7));
            return Decision::Write {
                commands: vec![
                    cmd(&[b"SET", lock, value, b"PX", lease, b"GET"]),
                    cmd(&[b"SET", rec, token, b"PX", lease]),
                ],
                memo: vec![1, with_owner, lapsed, stale],
            };
        }
        // Not a string: deleted as `DEL` would, not handed.
        let verb = self.a(1);
        let commands = match owner {
            Some(_) => vec![cmd(&[verb, lock, rec])],
            None => vec![cmd(&[verb, lock])],
        };
        Decision::Write {
            commands,
            memo: vec![0, with_owner, lapsed, stale],
        }
    }

    fn extend(&self, reads: &[Bytes]) -> Decision {
        let (lock, rec) = (self.k(0), self.k(1));
        let owner = reads.first().and_then(|r| as_bulk(r)).flatten();
        let (allowed, lapsed, stale) = allows(
            owner,
            self.a(3),
            self.a(4),
            self.a(2),
            self.a(1) == b"any",
            self.a(5),
        );
        if !allowed {
            return Decision::Answer(self.facts_or(int(0), &[0, lapsed, -3, stale]));
        }
        let exists = reads.get(1).and_then(|r| as_int(r)) == Some(1);
        let verb = self.a(6);
        let rest: Vec<&[u8]> = self.argv.iter().skip(7).map(|a| &a[..]).collect();
        let on = |key: &[u8]| {
            let mut args = vec![verb, key];
            args.extend(&rest);
            cmd(&args)
        };
        // The owner record moves as the lock does: the same command on
        // both (they carry the same expiry, written together), or, the
        // lock gone behind lockgate's back, the record goes too.
        let mut commands = vec![on(lock)];
        match (owner.is_some(), exists) {
            (true, true) => commands.push(on(rec)),
            (true, false) => commands.push(cmd(&[b"DEL", rec])),
            _ => {}
        }
        commands.push(cmd(&[b"PTTL", lock]));
        Decision::Write {
            commands,
            memo: vec![lapsed, stale],
        }
    }

    fn takeover(&self, reads: &[Bytes]) -> Decision {
        let (lock, rec, token) = (self.k(0), self.k(1), self.a(1));
        let before = reads.first().and_then(|r| as_int(r)).unwrap_or(-2);
        let at = reads.get(1).and_then(|r| as_int(r)).unwrap_or(-2);
        let string = matches!(
            reads.get(2).and_then(|r| as_simple(r)),
            Some(b"string") | Some(b"none")
        );
        let args: Vec<&[u8]> = self.argv.iter().skip(3).map(|a| &a[..]).collect();
        let mut command: Vec<&[u8]> = vec![args.first().copied().unwrap_or(b"")];
        command.push(lock);
        command.extend(args.iter().skip(1));
        let client = cmd(&command);
        let after = match takeover_after(&args, before, string) {
            Ok(after) => after,
            // Redis refuses it and changes nothing: its own error.
            Err(Refused::ByRedis) => {
                return Decision::Write {
                    commands: vec![client],
                    memo: vec![0],
                }
            }
            Err(Refused::Here(e)) => return Decision::Answer(e),
        };
        let default = self.a(2);
        let at_s = at.to_string();
        let mut commands = vec![client];
        match after {
            After::Persist | After::Keep if before > 0 && at > 0 => {
                if after == After::Persist {
                    commands.push(cmd(&[b"PEXPIREAT", lock, at_s.as_bytes()]));
                }
                commands.push(cmd(&[b"SET", rec, token, b"PXAT", at_s.as_bytes()]));
            }
            After::Persist | After::Keep => {
                commands.push(cmd(&[b"PEXPIRE", lock, default]));
                commands.push(cmd(&[b"SET", rec, token, b"PX", default]));
            }
            After::Ttl(kind, n) => commands.push(cmd(&[b"SET", rec, token, kind, n])),
            After::Gone => commands.push(cmd(&[b"DEL", rec])),
        }
        commands.push(cmd(&[b"PTTL", lock]));
        Decision::Write {
            commands,
            memo: vec![1],
        }
    }

    fn owner_is_token(&self, reads: &[Bytes]) -> bool {
        reads.first().and_then(|r| as_bulk(r)).flatten() == Some(self.a(0))
    }

    fn release_fast(&self, reads: &[Bytes]) -> Decision {
        if !self.owner_is_token(reads) {
            return Decision::Answer(int(-1));
        }
        Decision::Write {
            commands: vec![cmd(&[self.a(1), self.k(0), self.k(1)])],
            memo: Vec::new(),
        }
    }

    fn extend_fast(&self, reads: &[Bytes]) -> Decision {
        if !self.owner_is_token(reads) {
            return Decision::Answer(int(-1));
        }
        let (verb, amount) = (self.a(1), self.a(2));
        let exists = reads.get(1).and_then(|r| as_int(r)) == Some(1);
        let follow = match exists {
            true => cmd(&[verb, self.k(1), amount]),
            false => cmd(&[b"DEL", self.k(1)]),
        };
        Decision::Write {
            commands: vec![cmd(&[verb, self.k(0), amount]), follow],
            memo: Vec::new(),
        }
    }

    /// The watchdog's check: the owner record holds this token and the
    /// lock the value acquired with it (`''`: not checked).
    fn still_held(&self, reads: &[Bytes]) -> Held {
        if !self.owner_is_token(reads) {
            return Held::NotOurs;
        }
        match reads.get(1).and_then(|r| as_bulk(r)).flatten() {
            Some(v) if self.a(2).is_empty() || v == self.a(2) => Held::Yes,
            _ => Held::RecordLeft,
        }
    }

    fn renew(&self, reads: &[Bytes]) -> Decision {
        let (lock, rec) = (self.k(0), self.k(1));
        match self.still_held(reads) {
            Held::NotOurs => return Decision::Answer(int(0)),
            Held::RecordLeft => return written(vec![cmd(&[b"DEL", rec])], 0),
            Held::Yes => {}
        }
        let lease = parse(self.a(1));
        let pttl = reads.get(2).and_then(|r| as_int(r)).unwrap_or(-2);
        let at = reads.get(3).and_then(|r| as_int(r)).unwrap_or(-2);
        if pttl < lease || at <= 0 {
            let l = self.a(1);
            return written(
                vec![cmd(&[b"PEXPIRE", lock, l]), cmd(&[b"PEXPIRE", rec, l])],
                1,
            );
        }
        let at = at.to_string();
        written(vec![cmd(&[b"PEXPIREAT", rec, at.as_bytes()])], 1)
    }

    fn release_token(&self, reads: &[Bytes]) -> Decision {
        let (lock, rec) = (self.k(0), self.k(1));
        match self.still_held(reads) {
            Held::NotOurs => Decision::Answer(int(0)),
            Held::RecordLeft => written(vec![cmd(&[b"DEL", rec])], 0),
            Held::Yes => written(vec![cmd(&[b"DEL", lock, rec])], 1),
        }
    }

    fn fence_lock(&self, reads: &[Bytes]) -> Decision {
        let (lock, rec, counter) = (self.k(0), self.k(1), self.k(2));
        if reads.first().and_then(|r| as_int(r)) == Some(1) {
            let pttl = reads.get(1).and_then(|r| as_int(r)).unwrap_or(-2);
            return Decision::Answer(resp::array(&[int(0), int(pttl)]));
        }
        let counter_was = reads
            .get(2)
            .and_then(|r| as_bulk(r))
            .flatten()
            .map_or(0, parse);
        let Some(us) = reads.get(3).and_then(time_us) else {
            return Decision::Answer(err("ERR lockgate: TIME unreadable"));
        };
        let t = counter_was.max(us).saturating_add(1);
        let s = t.to_string();
        let ttl = self.a(0);
        written(
            vec![
                cmd(&[b"SET", counter, s.as_bytes()]),
                cmd(&[b"SET", lock, s.as_bytes(), b"PX", ttl]),
                cmd(&[b"SET", rec, self.a(1), b"PX", ttl]),
            ],
            t,
        )
    }

    fn fence_unlock(&self, reads: &[Bytes]) -> Decision {
        if !self.owner_is_token(reads) {
            return Decision::Answer(int(0));
        }
        written(vec![cmd(&[b"DEL", self.k(0), self.k(1)])], 1)
    }

    fn fence_extend(&self, reads: &[Bytes]) -> Decision {
        if !self.owner_is_token(reads) {
            return Decision::Answer(int(0));
        }
        let ttl = self.a(1);
        written(
            vec![
                cmd(&[b"PEXPIRE", self.k(0), ttl]),
                cmd(&[b"PEXPIRE", self.k(1), ttl]),
            ],
            1,
        )
    }
}

/// What the watchdog's check ([`RENEW`](crate::script::RENEW),
/// [`RELEASE_TOKEN`](crate::script::RELEASE_TOKEN)) found.
enum Held {
    /// The owner record and the lock are this acquisition's.
    Yes,
    /// The owner record is not this token's: nothing is touched.
    NotOurs,
    /// The record is, but the lock is gone or another value (released
    /// by a script of the client's): the record left behind goes.
    RecordLeft,
}

/// Writes whose reply is the integer `n` (memo'd).
fn written(commands: Vec<Bytes>, n: i64) -> Decision {
    Decision::Write {
        commands,
        memo: vec![n],
    }
}

/// A decimal of ours, 0 when unreadable (as the scripts' `tonumber(…) or 0`).
fn parse(s: &[u8]) -> i64 {
    std::str::from_utf8(s)
        .ok()
        .and_then(|s| s.parse::<i64>().ok())
        .unwrap_or(0)
}

/// `TIME`'s reply in µs since the epoch.
fn time_us(reply: &Bytes) -> Option<i64> {
    let parts = resp::elements(reply)?;
    let secs = parse(as_bulk(parts.first()?)??);
    let micros = parse(as_bulk(parts.get(1)?)??);
    secs.checked_mul(1_000_000)?.checked_add(micros)
}

/// The owner check of the scripts (`allows` in [`crate::script`]'s
/// `owner_check!`): (allowed, lapsed, stale).
pub fn allows(
    owner: Option<&[u8]>,
    tok: &[u8],
    alt: &[u8],
    prefix: &[u8],
    any: bool,
    born: &[u8],
) -> (bool, i64, i64) {
    if any {
        return (true, 0, 0);
    }
    let Some(owner) = owner else {
        return match tok.is_empty() {
            true => (true, 0, 0),
            false => (false, 1, 0),
        };
    };
    if !tok.is_empty() {
        let mine =
            owner == tok || (!alt.is_empty() && alt.split(|&c| c == b'\n').any(|a| a == owner));
        return match mine {
            true => (true, 0, 0),
            false => (false, 1, 0),
        };
    }
    if !owner.starts_with(prefix) {
        return (false, 0, 0);
    }
    match parse(&owner[prefix.len()..]) >= parse(born) {
        true => (true, 0, 0),
        false => (false, 0, 1),
    }
}

/// The error Redis gives `SET`/`GETEX` (`command`) for an expiry option
/// `kind` with value `ttl`, if any (Redis 7's checks, in its words).
pub fn set_ttl_error(kind: &[u8], ttl: &[u8], command: &str) -> Option<Bytes> {
    let Some(n) = crate::protocol::request::string2ll(ttl) else {
        return Some(err("ERR value is not an integer or out of range"));
    };
    let seconds = kind.eq_ignore_ascii_case(b"EX") || kind.eq_ignore_ascii_case(b"EXAT");
    let relative = kind.eq_ignore_ascii_case(b"EX") || kind.eq_ignore_ascii_case(b"PX");
    let ms = match seconds {
        true => n.checked_mul(1000),
        false => Some(n),
    };
    let too_far = match (ms, relative) {
        (None, _) => true,
        (Some(ms), true) => ms > i64::MAX - crate::lock::quorum::now_unix_ms() as i64,
        _ => false,
    };
    if n <= 0 || too_far {
        return Some(err(&format!(
            "ERR invalid expire time in '{command}' command"
        )));
    }
    None
}

/// Why a takeover is not carried out as written.
#[derive(Debug)]
pub(super) enum Refused {
    /// Redis refuses it without changing anything (a key of another
    /// type): sent alone, its error is the reply.
    ByRedis,
    /// Refused here with this error (what Redis would say, or that it
    /// cannot be done exactly).
    Here(Bytes),
}

/// The lock key's expiry after a takeover's command, before the lease is
/// restored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum After<'a> {
    /// None (the command removed it).
    Persist,
    /// Unchanged.
    Keep,
    /// Set by the command's own option.
    Ttl(&'a [u8], &'a [u8]),
    /// The key is gone.
    Gone,
}

/// What a takeover's command (`args`: name, then its arguments after the
/// key) leaves of the key's expiry, from the key's PTTL `before` and
/// whether it is a string (or absent).
pub(super) fn takeover_after<'a>(
    args: &[&'a [u8]],
    before: i64,
    string: bool,
) -> Result<After<'a>, Refused> {
    let name = args
        .first()
        .map(|n| n.to_ascii_uppercase())
        .unwrap_or_default();
    let exists = before != -2;
    let unexact = || {
        Refused::Here(err(
            "ERR lockgate: lock command refused: it cannot be carried out exactly without scripts",
        ))
    };
    match name.as_slice() {
        b"GETSET" if args.len() == 2 => match string {
            true => Ok(After::Persist),
            false => Err(Refused::ByRedis),
        },
        b"GETDEL" if args.len() == 1 => match string {
            true => Ok(After::Gone),
            false => Err(Refused::ByRedis),
        },
        b"GETEX" => {
            if !string {
                return Err(Refused::ByRedis);
            }
            let after = match args.len() {
                1 => After::Keep,
                2 if args[1].eq_ignore_ascii_case(b"PERSIST") => After::Persist,
                3 => {
                    let kind = expiry_kind(args[1]).ok_or_else(unexact)?;
                    if let Some(e) = set_ttl_error(kind, args[2], "getex") {
                        return Err(Refused::Here(e));
                    }
                    After::Ttl(kind, args[2])
                }
                _ => return Err(unexact()),
            };
            Ok(if exists { after } else { After::Gone })
        }
        b"SET" if args.len() >= 2 => {
            // NX makes it an acquisition, never a takeover.
            let o = set_options(&args[2..])
                .filter(|o| !o.nx)
                .ok_or_else(unexact)?;
            let (xx, get, keep) = (o.xx, o.get, o.keepttl);
            let ttl = o.ttl.map(|(kind, n)| (kind.as_bytes(), n));
            if let Some((kind, n)) = ttl {
                if let Some(e) = set_ttl_error(kind, n, "set") {
                    return Err(Refused::Here(e));
                }
            }
            if get && !string {
                return Err(Refused::ByRedis);
            }
            if xx && !exists {
                return Ok(After::Gone);
            }
            Ok(match (ttl, keep) {
                (Some((kind, n)), _) => After::Ttl(kind, n),
                (None, true) if exists => After::Keep,
                _ => After::Persist,
            })
        }
        _ => Err(unexact()),
    }
}

/// The expiry option `opt` names, spelled as the scripts pass it.
fn expiry_kind(opt: &[u8]) -> Option<&'static [u8]> {
    [&b"EX"[..], b"PX", b"EXAT", b"PXAT"]
        .into_iter()
        .find(|k| opt.eq_ignore_ascii_case(k))
}
