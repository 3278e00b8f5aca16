//! Guarded writes (`[[locks.guards]]`, `docs/guarded-writes.md`): a write
//! to data a lock protects is applied only while the writing connection
//! holds that lock, checked in Redis in the same atomic step as the write.
//!
//! A lease makes a lock expire; it cannot stop a holder paused past its
//! lease from writing after the next holder took over. lockgate sees both
//! the lock commands and the writes, and the data lives in the same Redis:
//! a write (by Redis's own `COMMAND` flags, [`table`]) to a key matching a
//! guard's data pattern ([`pattern`]) goes up as [`crate::script::GUARD`]
//! instead of itself: the script reads the lock's owner record, applies
//! the owner rule every release applies (this connection's acquisition,
//! or by the pooled rule one this instance made since the connection
//! opened), and runs the write (or not) in the same call.
//!
//! The route is decided by [`LockService::guard_route`] (the router's one
//! call), the call built by [`LockService::guard_call`] (the session's),
//! and the reply read by [`LockService::guard_reply`] (the writer's): the
//! client gets the write's own reply, or `-ERR lockgate: write refused: …`.
//!
//! Layout: this file (the guards, their counters, which writes are
//! guarded and how), [`pattern`] (the patterns, pure), [`table`] (Redis's
//! command table), [`call`] (the scripts and their replies), [`record`]
//! (guard records on the primary with the quorum).

mod call;
pub mod pattern;
pub mod record;
pub mod table;

pub use call::{wrapped, GuardPending, Stood, MAX_SCRIPTS};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;

use super::keys::KeyPatterns;
use super::LockService;
use crate::config::{invalid, Config, ConfigError, GuardConfig, GuardMode, UnlockedWriters};
use crate::metrics::ProxyMetrics;
use pattern::{Pattern, PatternError};

/// `[[locks.guards]]` of `config`, checked as the lock room will compile
/// them: each compiles ([`Guards::compile`]); in front of a cluster each
/// data pattern carries its lock's hash tag. Part of
/// `crate::context::validate`.
pub fn validate(config: &Config) -> Result<(), ConfigError> {
    if config.locks.guards.is_empty() {
        return Ok(());
    }
    let patterns = KeyPatterns::new(&config.locks.keys);
    let guards = Guards::compile(&config.locks.guards, &patterns)
        .map_err(|e| invalid("locks.guards", &e.0))?;
    // With the quorum the locks are not on the cluster: the guard
    // records are, in the lock key's slot.
    if config.upstream.cluster.enabled() {
        guards
            .check_slots()
            .map_err(|e| invalid("locks.guards", &e.0))?;
    }
    Ok(())
}
/// One compiled guard.
#[derive(Debug, Clone)]
pub struct Guard {
    /// The lock key pattern.
    pub lock: Pattern,
    /// The data key patterns.
    pub data: Vec<Pattern>,
    /// Refuse late writes (`mode = "refuse"`).
    pub refuse_late: bool,
    /// Refuse writes from connections that never took the lock
    /// (`mode = "refuse"` and `unlocked_writers = "refuse"`).
    pub refuse_unlocked: bool,
    /// The counters of this guard (by its lock pattern).
    pub counts: Arc<GuardCounts>,
}

/// The guards in force: part of the reloadable lock rules.
#[derive(Debug, Clone, Default)]
pub struct Guards {
    guards: Vec<Guard>,
    /// The literal starts of every data pattern; `None` when some pattern
    /// starts with a named part (every key may match).
    prefixes: Option<Vec<Vec<u8>>>,
}

/// What happened to guarded writes under one guard, counted once per
/// write and guard (see `docs/guarded-writes.md`, "Counters").
#[derive(Debug, Default)]
pub struct GuardCounts {
    /// Applied: the connection held the lock.
    pub applied: AtomicU64,
    /// Refused (`mode = "refuse"`), or not checkable and refused.
    pub refused: AtomicU64,
    /// Applied in `report` mode although the connection's lock was lost.
    pub reported_late: AtomicU64,
    /// Applied from a connection that never took the lock.
    pub unlocked_writer: AtomicU64,
    /// Passed in `report` mode without a check lockgate could make exactly
    /// (inside `MULTI`, a script, a server that refuses scripts).
    pub unchecked: AtomicU64,
}

impl GuardCounts {
    /// (name, value) of every counter, in the order the docs list them.
    pub fn each(&self) -> [(&'static str, u64); 5] {
        let v = |c: &AtomicU64| c.load(Ordering::Relaxed);
        [
            ("applied", v(&self.applied)),
            ("refused", v(&self.refused)),
            ("reported_late", v(&self.reported_late)),
            ("unlocked_writer", v(&self.unlocked_writer)),
            ("unchecked", v(&self.unchecked)),
        ]
    }
}

impl Guards {
    /// Compiles `configs`, refusing what could not be guarded exactly
    /// (each error says which guard and why): a lock pattern without a
    /// named part or naming no lock key (`lock_keys`), a data pattern
    /// with a name its lock lacks, two guards' data patterns that could
    /// match one key. `counts`: each guard's counters, by lock pattern
    /// (kept across reloads).
    pub fn compile(
        configs: &[GuardConfig],
        lock_keys: &KeyPatterns,
    ) -> Result<Guards, PatternError> {
        Guards::compile_with(configs, lock_keys, |_| Arc::default())
    }

    fn compile_with(
        configs: &[GuardConfig],
        lock_keys: &KeyPatterns,
        mut counts: impl FnMut(&str) -> Arc<GuardCounts>,
    ) -> Result<Guards, PatternError> {
        let e = |s: String| PatternError(s);
        if configs.len() > crate::config::MAX_GUARDS {
            return Err(e(format!(
                "at most {} guards ({} given)",
                crate::config::MAX_GUARDS,
                configs.len()
            )));
        }
        let mut guards: Vec<Guard> = Vec::new();
        for c in configs {
            let lock = Pattern::parse(&c.lock, false)?;
            let names: Vec<&str> = lock.names().collect();
            if names.is_empty() {
                return Err(e(format!(
                    "lock `{}` has no named part: every data key would guard one lock",
                    c.lock
                )));
            }
            if (1..names.len()).any(|i| names[..i].contains(&names[i])) {
                return Err(e(format!("lock `{}` names a part twice", c.lock)));
            }
            let sample: Vec<(&str, &[u8])> = names.iter().map(|n| (*n, &b"x"[..])).collect();
            match lock.render(&sample) {
                Some(k) if lock_keys.matches(&k) => {}
                _ => {
                    return Err(e(format!(
                        "lock `{}` does not name lock keys (locks.keys): its writes could not be checked against an owner record",
                        c.lock
                    )))
                }
            }
            if c.data.is_empty() {
                return Err(e(format!("lock `{}` guards no data", c.lock)));
            }
            let mut data = Vec::new();
            for d in &c.data {
                let p = Pattern::parse(d, true)?;
                if let Some(n) = p.names().find(|n| !names.contains(n)) {
                    return Err(e(format!(
                        "data `{d}` names `{{{n}}}`, which lock `{}` does not have",
                        c.lock
                    )));
                }
                if lock_keys.matches(p.prefix()) && p.names().next().is_none() {
                    return Err(e(format!("data `{d}` is a lock key pattern")));
                }
                data.push(p);
            }
            for other in &guards {
                for a in &data {
                    if let Some(b) = other.data.iter().find(|b| a.overlaps(b)) {
                        return Err(e(format!(
                            "data `{}` (lock `{}`) and data `{}` (lock `{}`) could match the same key",
                            a.text, c.lock, b.text, other.lock.text
                        )));
                    }
                }
            }
            let refuse_late = c.mode == GuardMode::Refuse;
            guards.push(Guard {
                counts: counts(&c.lock),
                lock,
                data,
                refuse_late,
                refuse_unlocked: refuse_late && c.unlocked_writers == UnlockedWriters::Refuse,
            });
        }
        let prefixes = (guards.iter().flat_map(|g| &g.data))
            .map(|p| (!p.prefix().is_empty()).then(|| p.prefix().to_vec()))
            .collect();
        Ok(Guards { guards, prefixes })
    }

    /// In front of a Redis Cluster: every data pattern must carry its
    /// lock's hash tag, so that a guarded key, its lock's owner record and
    /// the check share one slot (one node, one atomic step).
    pub fn check_slots(&self) -> Result<(), PatternError> {
        for g in &self.guards {
            let Some(tag) = g.lock.hash_tag() else {
                return Err(PatternError(format!(
                    "lock `{}` has no hash tag of named parts (`lock:{{{{{{id}}}}}}`): in front of a Redis Cluster its data could live on another node than its owner record",
                    g.lock.text
                )));
            };
            if let Some(d) = g.data.iter().find(|d| d.hash_tag().as_ref() != Some(&tag)) {
                return Err(PatternError(format!(
                    "data `{}` does not carry the hash tag of lock `{}`: in front of a Redis Cluster its keys could live on another node than the lock's owner record, and no step could check one and write the other",
                    d.text, g.lock.text
                )));
            }
        }
        Ok(())
    }

    /// True when no guard is configured.
    pub fn is_empty(&self) -> bool {
        self.guards.is_empty()
    }

    /// The guards.
    pub fn all(&self) -> &[Guard] {
        &self.guards
    }

    /// Whether any of `args` could be a guarded key (cheap: a literal
    /// start per data pattern); false is certain.
    #[inline]
    pub fn may_touch(&self, args: impl Iterator<Item = impl AsRef<[u8]>>) -> bool {
        match &self.prefixes {
            None => !self.guards.is_empty(),
            Some(prefixes) => {
                let mut args = args;
                args.any(|a| prefixes.iter().any(|p| a.as_ref().starts_with(p)))
            }
        }
    }

    /// Whether `key` is the lock of some guard.
    pub fn guards_lock(&self, key: &[u8]) -> bool {
        let mut bound = Vec::new();
        self.guards.iter().any(|g| {
            bound.clear();
            g.lock.matches(key, &mut bound)
        })
    }

    /// The guard whose data patterns match `key`, and the lock key it
    /// maps to.
    pub fn lock_of(&self, key: &[u8]) -> Option<(&Guard, Bytes)> {
        let mut bound = Vec::new();
        for g in &self.guards {
            for p in &g.data {
                if p.matches(key, &mut bound) {
                    return g.lock.render(&bound).map(|lock| (g, lock));
                }
            }
        }
        None
    }
}

/// One lock a guarded write is checked against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuardedLock {
    /// The lock key.
    pub lock: Bytes,
    /// The guarded key written that maps to it (the first, for messages).
    pub data: Bytes,
    /// Refuse if this connection's lock was lost.
    pub refuse_late: bool,
    /// Refuse if this connection never took it.
    pub refuse_unlocked: bool,
    /// The guard's counters.
    pub counts: CountsRef,
}

/// A guard's counters, compared by identity (routes are compared in
/// tests).
#[derive(Debug, Clone)]
pub struct CountsRef(pub Arc<GuardCounts>);

impl PartialEq for CountsRef {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for CountsRef {}

/// What becomes of a write to guarded keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Guarded {
    /// Checked in Redis with the write ([`LockService::guard_call`]).
    Check(Vec<GuardedLock>),
    /// Not checkable exactly, in `report` mode: forwarded as it is and
    /// counted `unchecked`.
    Unchecked(Vec<GuardedLock>),
    /// Not checkable exactly, in `refuse` mode: refused with this message
    /// and counted `refused`.
    Refuse(Vec<GuardedLock>, String),
    /// Inside `MULTI`: queued by Redis as it is, and noted; the `EXEC`
    /// then runs the whole transaction as one checked script.
    InTx(Vec<GuardedLock>),
    /// A client script (`EVAL`, or `EVALSHA` of a body lockgate has seen)
    /// whose declared keys are guarded: run as one script that checks
    /// the locks and then runs the client's body, unchanged, with its own
    /// keys and arguments ([`LockService::guard_script_call`]).
    Script(Vec<GuardedLock>, Bytes),
    /// An `EVALSHA` on guarded keys of a body lockgate has not seen, in
    /// refuse mode: answered `NOSCRIPT`, so the client sends the body
    /// (`EVAL`, or `SCRIPT LOAD` then `EVALSHA`), which can be checked.
    NoScript,
    /// The `EXEC` of a transaction with guarded writes: Redis's queue is
    /// discarded and the transaction runs as one script that checks every
    /// lock first ([`crate::script::GUARD_TX`]): applied whole or
    /// refused whole.
    Exec,
}

/// Why a guarded write could not be checked exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Uncheckable {
    /// A transaction under `WATCH`: run as a script, what was watched
    /// would not be checked.
    Watched,
    /// A transaction longer than lockgate keeps to run it as a script.
    TooLong,
    /// A client script or function.
    Script,
    /// Redis's command table is not loaded yet.
    NoTable,
    /// The command's keys cannot all be found from its key specification.
    Keys,
    /// It writes lock keys and guarded keys in one command.
    MixesLocks,
    /// The server refuses scripts.
    Scriptless,
}

impl Uncheckable {
    fn says(self, name: &str) -> String {
        match self {
            Uncheckable::Watched => format!("a transaction with guarded writes under {name} cannot be checked exactly (the transaction was discarded)"),
            Uncheckable::TooLong => format!("a transaction with guarded writes longer than {name} cannot be checked (the transaction was discarded)"),
            Uncheckable::Script => format!("{name} on a guarded key runs code lockgate cannot check with its writes (a function, a script lockgate has not seen, or a script inside MULTI)"),
            Uncheckable::NoTable => format!("cannot tell yet whether {name} writes a guarded key (Redis's command table is not loaded)"),
            Uncheckable::Keys => format!("cannot tell which keys {name} writes"),
            Uncheckable::MixesLocks => format!("{name} writes a lock key and a guarded key together"),
            Uncheckable::Scriptless => format!("{name} on a guarded key cannot be checked: the server refuses scripts"),
        }
    }
}

impl LockService {
    /// True when guards are configured (one atomic load: what every
    /// command not on a guarded key pays).
    #[inline]
    pub fn guards_on(&self) -> bool {
        self.guards_on.load(Ordering::Relaxed)
    }

    /// Whether the command `args` could write a guarded key (cheap; false
    /// is certain): the router's shortcut asks it first.
    #[inline]
    pub fn may_guard(&self, args: impl Iterator<Item = impl AsRef<[u8]>>) -> bool {
        self.guards_on() && crate::sync::read(&self.rules).guards.may_touch(args)
    }

    /// What becomes of the command `args` (name first) if it writes
    /// guarded keys; `None` when it does not (or guards are off). A write
    /// is known by Redis's own `COMMAND` flags; a client script or
    /// function (`EVAL*`, `FCALL`, not their `_RO` forms) by its declared
    /// keys.
    pub fn guard_route(&self, args: &[&[u8]], in_multi: bool) -> Option<Guarded> {
        if !self.may_guard(args.iter().skip(1)) {
            return None;
        }
        let rules = self.rules();
        let name =
            String::from_utf8_lossy(args.first().copied().unwrap_or_default()).to_uppercase();
        // Every argument that could be a guarded key (before the table
        // says which are keys): what an uncheckable command is held to.
        // Lock keys are never guarded data: lock commands keep their rules.
        let data = |k: &&[u8]| !rules.patterns.matches(k);
        let touched = |rules: &super::Rules| -> Vec<GuardedLock> {
            guarded_locks(&rules.guards, args.iter().skip(1).copied().filter(data))
        };
        let table = self.guard_table.get();
        let script = matches!(name.as_str(), "EVAL" | "EVALSHA" | "FCALL");
        let write = match table.writes(args) {
            _ if script => true,
            Some(w) => w,
            None if table.is_empty() => {
                let locks = touched(&rules);
                return (!locks.is_empty())
                    .then(|| uncheckable(locks, Uncheckable::NoTable, &name));
            }
            // Unknown to the server: it will say so.
            None => return None,
        };
        if !write {
            return None;
        }
        let keys = match table.keys(args) {
            Ok(keys) => keys,
            Err(_) => {
                let locks = touched(&rules);
                return (!locks.is_empty()).then(|| uncheckable(locks, Uncheckable::Keys, &name));
            }
        };
        let locks = guarded_locks(&rules.guards, keys.iter().copied().filter(data));
        if locks.is_empty() {
            return None;
        }
        let body = match name.as_str() {
            "EVAL" => Some(Bytes::copy_from_slice(args[1])),
            "EVALSHA" => self.script_body(args[1]),
            _ => None,
        };
        // A script that declares it writes nothing.
        if body.as_deref().is_some_and(read_only) {
            return None;
        }
        let why = if keys.iter().any(|k| rules.patterns.matches(k)) {
            Some(Uncheckable::MixesLocks)
        } else if self.scriptless() {
            Some(Uncheckable::Scriptless)
        } else if script && (in_multi || body.is_none()) {
            Some(Uncheckable::Script)
        } else {
            None
        };
        let refuses = locks.iter().any(|l| l.refuse_late);
        Some(match (why, body) {
            (Some(Uncheckable::Script), None) if name == "EVALSHA" && !in_multi && refuses => {
                Guarded::NoScript
            }
            (Some(why), _) => uncheckable(locks, why, &name),
            (None, Some(body)) => Guarded::Script(locks, body),
            (None, None) if in_multi => Guarded::InTx(locks),
            (None, None) => Guarded::Check(locks),
        })
    }

    /// Counts `guarded` as carried out without a check: unchecked
    /// (forwarded) or refused.
    pub(crate) fn count_uncheckable(&self, guarded: &Guarded) {
        let (locks, refused) = match guarded {
            Guarded::Check(_)
            | Guarded::InTx(_)
            | Guarded::Script(..)
            | Guarded::NoScript
            | Guarded::Exec => return,
            Guarded::Unchecked(l) => (l, false),
            Guarded::Refuse(l, _) => (l, true),
        };
        for l in locks {
            let c = &l.counts.0;
            ProxyMetrics::inc(if refused { &c.refused } else { &c.unchecked });
        }
    }

    /// The counters of every guard in force: (lock pattern, mode, counts).
    pub fn guard_counts(&self) -> Vec<(String, &'static str, Arc<GuardCounts>)> {
        let rules = self.rules();
        (rules.guards.all().iter())
            .map(|g| {
                let mode = if g.refuse_late { "refuse" } else { "report" };
                (g.lock.text.clone(), mode, g.counts.clone())
            })
            .collect()
    }

    /// The counters for the guard with lock pattern `lock`, kept across
    /// reloads (bounded: at most `MAX_GUARDS` patterns are ever remembered
    /// past the ones in force).
    pub(crate) fn counts_for(&self, lock: &str) -> Arc<GuardCounts> {
        let mut all = crate::sync::lock(&self.guard_counts);
        if let Some(c) = all.get(lock) {
            return c.clone();
        }
        if all.len() >= 2 * crate::config::MAX_GUARDS {
            all.clear();
        }
        let c = Arc::new(GuardCounts::default());
        all.insert(lock.to_string(), c.clone());
        c
    }

    /// The guards of `config` compiled with this service's counters.
    pub(crate) fn compile_guards(&self, config: &crate::config::LocksConfig) -> Guards {
        let patterns = KeyPatterns::new(&config.keys);
        Guards::compile_with(&config.guards, &patterns, |lock| self.counts_for(lock))
            .unwrap_or_default()
    }
}

/// Whether a script body declares it writes nothing (`#!lua
/// flags=no-writes`).
fn read_only(body: &[u8]) -> bool {
    let first = body.split(|&c| c == b'\n').next().unwrap_or_default();
    first.starts_with(b"#!") && memchr::memmem::find(first, b"no-writes").is_some()
}

/// The locks of the guarded keys among `keys`, one per lock key (its first
/// guarded key named).
fn guarded_locks<'a>(guards: &Guards, keys: impl Iterator<Item = &'a [u8]>) -> Vec<GuardedLock> {
    let mut locks: Vec<GuardedLock> = Vec::new();
    for key in keys {
        if let Some((g, lock)) = guards.lock_of(key) {
            if locks.iter().any(|l| l.lock == lock) {
                continue;
            }
            locks.push(GuardedLock {
                lock,
                data: Bytes::copy_from_slice(key),
                refuse_late: g.refuse_late,
                refuse_unlocked: g.refuse_unlocked,
                counts: CountsRef(g.counts.clone()),
            });
        }
    }
    locks
}

/// An uncheckable write to `locks`: refused if any of its guards refuses
/// late writes, else forwarded unchecked.
pub(crate) fn uncheckable(locks: Vec<GuardedLock>, why: Uncheckable, name: &str) -> Guarded {
    match locks.iter().any(|l| l.refuse_late) {
        true => {
            let text = format!("lockgate: write refused: {}", why.says(name));
            Guarded::Refuse(locks, text)
        }
        false => Guarded::Unchecked(locks),
    }
}

#[cfg(test)]
mod tests;
