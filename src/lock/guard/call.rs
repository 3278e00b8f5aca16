//! The scripts a guarded write runs as (a write, a whole transaction, a
//! client script behind the check), built for the session
//! ([`LockService::guard_call`], [`LockService::guard_tx_call`],
//! [`LockService::guard_script_call`]), and their replies read for the
//! writer ([`LockService::guard_reply`]): the client's reply, or the
//! refusal naming the lock and why.

use std::time::Instant;

use bytes::Bytes;

use super::record;
use super::{GuardedLock, LockService};
use crate::lock::evalsha::Call;
use crate::lock::lease::{ConnLocks, Standing};
use crate::lock::{owner_key, LockPending};
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;
use crate::script::Script;

/// How a guarded write came out for one lock, as [`crate::script::GUARD`]
/// reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stood {
    /// Held by this connection's acquisition (or the pooled rule's).
    Held,
    /// This connection held it; the owner record is gone.
    Ended,
    /// This connection held it; another acquisition owns it now.
    Taken,
    /// This connection never took it; nobody holds it.
    NeverFree,
    /// This connection never took it; someone else holds it.
    NeverHeld,
}

impl Stood {
    fn from_fact(n: i64) -> Stood {
        match n {
            0 => Stood::Held,
            1 => Stood::Ended,
            2 => Stood::Taken,
            3 => Stood::NeverFree,
            _ => Stood::NeverHeld,
        }
    }

    fn late(self) -> bool {
        matches!(self, Stood::Ended | Stood::Taken)
    }
}

/// What the writer needs to read a guarded write's reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuardPending {
    /// The locks checked, in the script's order.
    pub locks: Vec<GuardedLock>,
    /// When each lock's lease ended or ends by this connection's record
    /// (`None`: it holds no record of it).
    pub lease_ends: Vec<Option<Instant>>,
    /// A whole transaction (its refusal says it was discarded).
    pub tx: bool,
}

impl LockService {
    /// The script call that carries out the guarded write `args` against
    /// `locks` for the connection `conn`, and what its reply needs.
    pub(crate) fn guard_call(
        &self,
        locks: Vec<GuardedLock>,
        args: &[&[u8]],
        conn: &ConnLocks,
    ) -> (Call, LockPending) {
        let (mut keys, mut argv, lease_ends) = self.check_argv(&locks, conn);
        // The write's keys declared too: on a cluster, in the records' slot.
        self.declare(&mut keys, args);
        argv.extend(args.iter().map(|a| Bytes::copy_from_slice(a)));
        let call = call(Script::Guard, &keys, &argv);
        (call, pending(locks, lease_ends, false))
    }

    /// The script call that runs a transaction's `commands` (each its
    /// arguments, name first) as one step once `locks` are checked, for
    /// the connection `conn` ([`crate::script::GUARD_TX`]).
    pub(crate) fn guard_tx_call(
        &self,
        locks: Vec<GuardedLock>,
        commands: &[Vec<Bytes>],
        conn: &ConnLocks,
    ) -> (Call, LockPending) {
        let (mut keys, mut argv, lease_ends) = self.check_argv(&locks, conn);
        argv.push(Bytes::from(commands.len().to_string()));
        for c in commands {
            let args: Vec<&[u8]> = c.iter().map(|a| &a[..]).collect();
            self.declare(&mut keys, &args);
            argv.push(Bytes::from(c.len().to_string()));
            argv.extend(c.iter().cloned());
        }
        let call = call(Script::GuardTx, &keys, &argv);
        (call, pending(locks, lease_ends, true))
    }

    /// The `EVAL` that runs the client script `args` (`EVAL`/`EVALSHA`,
    /// its `body`) once `locks` are checked for `conn`: lockgate's keys and
    /// arguments go first and are taken off `KEYS` and `ARGV` before the
    /// client's body runs, unchanged, inside a function (see
    /// [`wrapped`]).
    pub(crate) fn guard_script_call(
        &self,
        locks: Vec<GuardedLock>,
        body: &[u8],
        args: &[&[u8]],
        conn: &ConnLocks,
    ) -> (Bytes, LockPending) {
        let (owners, check, lease_ends) = self.check_argv(&locks, conn);
        let n: usize = std::str::from_utf8(args.get(2).copied().unwrap_or_default())
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        let wrapped = wrapped(body);
        let numkeys = (owners.len() + n).to_string();
        let mut command: Vec<&[u8]> = vec![b"EVAL", &wrapped, numkeys.as_bytes()];
        command.extend(owners.iter().map(|k| &k[..]));
        command.extend(args.iter().skip(3).take(n).copied());
        command.extend(check.iter().map(|a| &a[..]));
        command.extend(args.iter().skip(3 + n).copied());
        let command = crate::protocol::encode::command(&command);
        (command, pending(locks, lease_ends, false))
    }

    /// Remembers a client script body (`EVAL`, `SCRIPT LOAD`) while guards
    /// are configured, so an `EVALSHA` of it can be guarded; bounded (the
    /// table is emptied when full).
    pub(crate) fn remember_script(&self, body: &[u8]) {
        if !self.guards_on() {
            return;
        }
        let sha = sha1_smol::Sha1::from(body).digest().to_string();
        let mut bodies = crate::sync::lock(&self.guard_scripts);
        if bodies.len() >= MAX_SCRIPTS {
            bodies.clear();
        }
        bodies.insert(sha, Bytes::copy_from_slice(body));
    }

    /// The body of the script `sha`, if seen.
    pub(super) fn script_body(&self, sha: &[u8]) -> Option<Bytes> {
        let sha = String::from_utf8_lossy(sha).to_ascii_lowercase();
        crate::sync::lock(&self.guard_scripts).get(&sha).cloned()
    }

    /// Adds the keys of the command `args` to `keys` (once each), as the
    /// command table finds them.
    fn declare(&self, keys: &mut Vec<Bytes>, args: &[&[u8]]) {
        if let Ok(found) = self.guard_table.get().keys(args) {
            for k in found {
                if !keys.iter().any(|have| &have[..] == k) {
                    keys.push(Bytes::copy_from_slice(k));
                }
            }
        }
    }

    /// What the guard scripts check `locks` with for `conn`: the owner
    /// records (KEYS), the ARGV up to the write, and when each lease ends
    /// by the connection's record.
    fn check_argv(
        &self,
        locks: &[GuardedLock],
        conn: &ConnLocks,
    ) -> (Vec<Bytes>, Vec<Bytes>, Vec<Option<Instant>>) {
        // With the quorum the owner record is on the masters: the guard
        // record on the primary stands for it (see [`record`]).
        let quorum = self.on_masters();
        let owners = (locks.iter())
            .map(|l| match quorum {
                true => record::guard_key(&l.lock),
                false => owner_key(&l.lock),
            })
            .collect();
        let mut argv = vec![
            Bytes::from_static(b"1"),
            Bytes::from(locks.len().to_string()),
            Bytes::copy_from_slice(self.instance_prefix().as_bytes()),
            Bytes::from(conn.born.to_string()),
        ];
        let mut lease_ends = Vec::with_capacity(locks.len());
        let flag = |b: bool| Bytes::from_static(if b { b"1" } else { b"0" });
        for l in locks {
            let record = conn.get(&l.lock);
            // Held (acquired or taken over): its token; an attempt not
            // settled yet may also be the owner's.
            let tok = record
                .filter(|a| a.standing == Standing::Held)
                .map(|a| a.token.clone())
                .unwrap_or_default();
            let (_, alt) = conn.attempt_tokens(&l.lock);
            lease_ends.push(
                record
                    .filter(|a| a.lease_ms > 0)
                    .map(|a| a.since + std::time::Duration::from_millis(a.lease_ms)),
            );
            argv.extend([tok, alt, flag(l.refuse_late), flag(l.refuse_unlocked)]);
        }
        (owners, argv, lease_ends)
    }

    /// The client's reply to a guarded write whose script answered
    /// `frame`, counted per guard; a refusal names the first lock that
    /// refused it and why.
    pub(crate) fn guard_reply(&self, pending: GuardPending, frame: Bytes) -> Bytes {
        let (reply, facts) = crate::lock::split_reply(&frame);
        // Not the script's answer (an error from Redis): the client's, whole.
        if facts.len() != 1 + pending.locks.len() {
            return frame;
        }
        let applied = facts[0] == 1;
        let standings: Vec<Stood> = facts[1..].iter().map(|&n| Stood::from_fact(n)).collect();
        let mut refusal = None;
        for ((l, s), end) in pending
            .locks
            .iter()
            .zip(&standings)
            .zip(&pending.lease_ends)
        {
            let c = &l.counts.0;
            let refuses = (s.late() && l.refuse_late)
                || (matches!(s, Stood::NeverFree | Stood::NeverHeld) && l.refuse_unlocked);
            // A refused write counts under the guards that refused it.
            let counter = match s {
                _ if !applied && refuses => &c.refused,
                _ if !applied => continue,
                Stood::Held => &c.applied,
                Stood::Ended | Stood::Taken => &c.reported_late,
                Stood::NeverFree | Stood::NeverHeld => &c.unlocked_writer,
            };
            ProxyMetrics::inc(counter);
            if *s != Stood::Held {
                self.warn_guarded(l, *s, applied);
            }
            if refuses && refusal.is_none() {
                let text = refused_because(l, *s, *end);
                refusal = Some(match pending.tx {
                    true => format!("{text}; the transaction was discarded"),
                    false => text,
                });
            }
        }
        match (applied, refusal) {
            (true, _) => frame.slice_ref(reply),
            (false, Some(text)) => LocalReply::err(text).to_bytes(false),
            (false, None) => LocalReply::err("lockgate: write refused").to_bytes(false),
        }
    }

    /// Logs a guarded write that was not its holder's (rate-limited; the
    /// keys, never values or tokens).
    fn warn_guarded(&self, l: &GuardedLock, s: Stood, applied: bool) {
        if let Some(more) = self.guard_warn.check() {
            tracing::warn!(
                lock = %String::from_utf8_lossy(&l.lock),
                key = %String::from_utf8_lossy(&l.data),
                standing = ?s,
                applied,
                suppressed = more,
                "guarded write from a connection that does not hold the lock"
            );
        }
    }
}

/// Most client script bodies remembered for guarded `EVALSHA`s.
pub const MAX_SCRIPTS: usize = 256;

/// The client's script `body` behind the lock check: its shebang line
/// first if it has one, then the check
/// ([`crate::script::GUARD_SCRIPT_HEAD`]), then the body inside a
/// function, whose reply is returned as `{reply, 1, standings…}`.
pub fn wrapped(body: &[u8]) -> Bytes {
    let (shebang, rest) = match body.starts_with(b"#!") {
        true => match memchr::memchr(b'\n', body) {
            Some(nl) => body.split_at(nl + 1),
            None => (body, &b""[..]),
        },
        false => (&b""[..], body),
    };
    let mut out = Vec::with_capacity(body.len() + 1024);
    out.extend_from_slice(shebang);
    if !shebang.is_empty() && !shebang.ends_with(b"\n") {
        out.push(b'\n');
    }
    out.extend_from_slice(crate::script::GUARD_SCRIPT_HEAD.as_bytes());
    out.extend_from_slice(rest);
    out.extend_from_slice(crate::script::GUARD_SCRIPT_TAIL.as_bytes());
    Bytes::from(out)
}

/// What the writer reads a guard script's reply with.
fn pending(locks: Vec<GuardedLock>, lease_ends: Vec<Option<Instant>>, tx: bool) -> LockPending {
    LockPending::Guard(GuardPending {
        locks,
        lease_ends,
        tx,
    })
}

/// A call of `script` with owned keys and arguments.
fn call(script: Script, keys: &[Bytes], argv: &[Bytes]) -> Call {
    let keys: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    let argv: Vec<&[u8]> = argv.iter().map(|a| &a[..]).collect();
    Call::new(script, &keys, &argv)
}

/// The refusal of a write under `l`, which stood `s`; `end`: when this
/// connection's lease ended, by its record.
fn refused_because(l: &GuardedLock, s: Stood, end: Option<Instant>) -> String {
    let lock = String::from_utf8_lossy(&l.lock);
    let why = match s {
        // By this connection's record the lease has not run out: released
        // (by an operator, a pooled connection) or lost with its store.
        Stood::Ended => match end.map(|e| Instant::now().checked_duration_since(e)) {
            Some(Some(ago)) => format!("lease ended {:.1} s ago", ago.as_secs_f64()),
            Some(None) => "released before its lease ended".to_string(),
            None => "its lease ended".to_string(),
        },
        Stood::Taken => "another holder has it now".to_string(),
        Stood::NeverFree => return format!(
            "lockgate: write refused: {} is guarded by {lock}, which this connection does not hold (nobody holds it)",
            String::from_utf8_lossy(&l.data)
        ),
        Stood::NeverHeld | Stood::Held => return format!(
            "lockgate: write refused: {} is guarded by {lock}, which this connection does not hold (another holder has it)",
            String::from_utf8_lossy(&l.data)
        ),
    };
    format!("lockgate: write refused: {lock} is no longer held by this connection ({why})")
}
