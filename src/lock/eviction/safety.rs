//! Beside its eviction policy, what a lock store's readings say about how
//! safely it keeps locks across a crash and a failover (issue 45, "unsafe
//! upstreams named"), read with the policy at every (re)connection and
//! every `locks.eviction_check_ms` (`INFO replication`, `INFO
//! persistence`):
//!
//! - **replicas without `min-replicas-to-write`**: a primary cut off from
//!   its replicas keeps granting locks that a failover on the other side
//!   of the cut does not know;
//! - **no append-only file**: a restart loses every lock it held;
//! - **restarted**: the same Redis (address) came back with another
//!   `run_id`. Without an append-only file its locks are gone; with one
//!   fsynced every second (the default) the last second's may be; their
//!   holders do not know. Acquisitions on it are held for
//!   `locks.failover_delay_ms` as after a switch of the primary (the
//!   Redlock article's "delayed restart"), counted with the switch's.
//!
//! Beside these, the set's other writable nodes, asked on connections of
//! their own: a former primary still answering as one
//! ([`super::formers`], `second_primary`) and a replica that accepts
//! writes ([`super::writable`], `writable_replica`); both refused by
//! `locks.require_one_primary`.
//!
//! Each is shown (`LOCKGATE PRIMARY`, `/status.json`, the gauge
//! `upstream_unsafe{role,node,signal}`) and logged (rate-limited);
//! `locks.require_min_replicas` and `locks.require_persistence` refuse
//! lock grants on such a primary as `locks.require_noeviction` does,
//! served again once a reading says otherwise, or once the key is off.
//! [`restarted`] is the restart rule, a pure function of two readings.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::metrics::RateLimit;
use crate::sync;
use crate::upstream::node::report::Safety;

/// What one run of a node was last read as: its address and `run_id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    /// `HOST:PORT`.
    pub addr: Arc<str>,
    /// `INFO server`'s `run_id`.
    pub run_id: String,
}

/// Whether a reading of `addr` in run `run_id` is a restart of `before`:
/// the same address, another run. The first reading, another address (a
/// switch), the same run or an unreadable `run_id` is none. Whatever its
/// persistence, a restart may have lost locks (an append-only file fsynced
/// every second loses up to a second's writes), so every one is held.
pub fn restarted(before: Option<&Run>, addr: &str, run_id: &str) -> bool {
    before.is_some_and(|b| &*b.addr == addr && b.run_id != run_id && !run_id.is_empty())
}

/// One node's safety readings and restarts.
#[derive(Debug)]
pub struct SafetyState {
    reading: Mutex<Option<Safety>>,
    run: Mutex<Option<Run>>,
    /// When it last restarted.
    lost_at: Mutex<Option<Instant>>,
    /// It ever restarted while lockgate watched (one relaxed load on every
    /// acquisition until then).
    ever_restarted: AtomicBool,
    /// Restarts seen (another `run_id` at the same address).
    pub restarts: AtomicU64,
    warn: RateLimit,
    /// Limits the warning of a refused lock command.
    pub refuse_warn: RateLimit,
    /// The primaries it followed before, watched until they stop
    /// accepting writes ([`super::formers`]).
    pub formers: super::formers::Formers,
    /// Its replicas, and those that accept writes ([`super::writable`]).
    pub writable: super::writable::Writable,
}

impl Default for SafetyState {
    fn default() -> SafetyState {
        SafetyState {
            reading: Mutex::new(None),
            run: Mutex::new(None),
            lost_at: Mutex::new(None),
            ever_restarted: AtomicBool::new(false),
            restarts: AtomicU64::new(0),
            warn: RateLimit::new(Duration::from_secs(60)),
            refuse_warn: RateLimit::new(Duration::from_secs(10)),
            formers: super::formers::Formers::default(),
            writable: super::writable::Writable::default(),
        }
    }
}

impl SafetyState {
    /// Takes note of a reading of the node at `addr` in run `run_id`
    /// (`safety`: `None` when unreadable); `locks`: it holds lock keys (its
    /// risks are logged).
    pub fn learn(&self, addr: &Arc<str>, run_id: &str, safety: Option<Safety>, locks: bool) {
        let mut run = sync::lock(&self.run);
        // A switch: the node followed before is watched from now on.
        if let Some(before) = run.as_ref().filter(|b| locks && b.addr != *addr) {
            self.formers.switched(&before.addr, addr);
        }
        if restarted(run.as_ref(), addr, run_id) {
            self.restarts.fetch_add(1, Ordering::Relaxed);
            if locks {
                *sync::lock(&self.lost_at) = Some(Instant::now());
                self.ever_restarted.store(true, Ordering::Relaxed);
                tracing::warn!(
                    node = &**addr,
                    "Redis restarted: locks it held may be gone; acquisitions on it are held for locks.failover_delay_ms"
                );
            }
        }
        *run = Some(Run {
            addr: addr.clone(),
            run_id: run_id.to_string(),
        });
        drop(run);
        *sync::lock(&self.reading) = safety;
        let Some(s) = safety.filter(|_| locks) else {
            return;
        };
        let signals = signals(Some(s));
        if !signals.is_empty() {
            if let Some(more) = self.warn.check() {
                tracing::warn!(
                    node = &**addr,
                    signals = %signals.join(","),
                    suppressed = more,
                    "the Redis holding the locks may lose them (see locks.require_min_replicas, locks.require_persistence)"
                );
            }
        }
    }

    /// The latest reading (`None`: not read, or refused).
    pub fn reading(&self) -> Option<Safety> {
        *sync::lock(&self.reading)
    }

    /// How much of a hold of `delay` is left since the node last restarted
    /// (`None`: none, or it is over).
    pub fn restart_hold_left(&self, delay: Duration) -> Option<Duration> {
        let at = (*sync::lock(&self.lost_at))?;
        delay.checked_sub(at.elapsed()).filter(|d| !d.is_zero())
    }

    /// [`SafetyState::restart_hold_left`] of the hold `delay` gives, asked
    /// only once the node ever restarted (the acquisitions' path).
    pub fn restart_hold_left_fast(&self, delay: impl FnOnce() -> Duration) -> Option<Duration> {
        if !self.ever_restarted.load(Ordering::Relaxed) {
            return None;
        }
        self.restart_hold_left(delay())
    }

    /// The risks in force: [`signals`] of the latest reading, and
    /// `restarted` while the hold of `delay` after a restart runs.
    pub fn named(&self, delay: Duration) -> Vec<&'static str> {
        let mut out = signals(self.reading());
        if self.restart_hold_left(delay).is_some() {
            out.push("restarted");
        }
        if !self.formers.still_primaries().is_empty() {
            out.push("second_primary");
        }
        if !self.writable.writable().is_empty() {
            out.push("writable_replica");
        }
        out
    }
}

/// The risks a reading names: `replicas_without_min_replicas_to_write`,
/// `no_aof`. None for an unread node.
pub fn signals(safety: Option<Safety>) -> Vec<&'static str> {
    let Some(s) = safety else {
        return Vec::new();
    };
    let mut out = Vec::new();
    if s.master && s.replicas > 0 && !s.min_replicas {
        out.push("replicas_without_min_replicas_to_write");
    }
    if !s.aof {
        out.push("no_aof");
    }
    out
}

/// What the `locks.require_*` options ask of the primary's set.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Required {
    /// `locks.require_min_replicas`.
    pub min_replicas: bool,
    /// `locks.require_persistence`.
    pub persistence: bool,
    /// `locks.require_one_primary`.
    pub one_primary: bool,
}

impl Required {
    /// Any of them asked.
    pub fn any(self) -> bool {
        self.min_replicas || self.persistence || self.one_primary
    }
}

/// Why lock grants on the primary at `primary` are refused, by what is
/// `required`, given its latest `reading` (`None`: not read, or refused:
/// nothing says it is safe), the former primaries that still answer as
/// primaries (`others`) and its replicas that accept writes (`writable`):
/// the error text without `ERR `, `None` when nothing refuses.
pub fn refused_because(
    required: Required,
    reading: Option<Safety>,
    others: &[Arc<str>],
    writable: &[Arc<str>],
    primary: &str,
) -> Option<String> {
    if let (true, Some(other)) = (required.one_primary, others.first()) {
        return Some(format!(
            "lockgate: locks refused on the primary {primary}: the former primary {other} still accepts writes (locks.require_one_primary)"
        ));
    }
    if let (true, Some(replica)) = (required.one_primary, writable.first()) {
        return Some(format!(
            "lockgate: locks refused on the primary {primary}: its replica {replica} accepts writes, replica-read-only no (locks.require_one_primary)"
        ));
    }
    let (min_replicas, persistence) = (required.min_replicas, required.persistence);
    let unread = "its replication and persistence could not be read";
    let why = match reading {
        None if min_replicas => (unread, "locks.require_min_replicas"),
        None if persistence => (unread, "locks.require_persistence"),
        Some(s) if min_replicas && s.master && s.replicas > 0 && !s.min_replicas => (
            "it has replicas and no min-replicas-to-write",
            "locks.require_min_replicas",
        ),
        Some(s) if persistence && !s.aof => {
            ("it has no append-only file", "locks.require_persistence")
        }
        _ => return None,
    };
    Some(format!(
        "lockgate: locks refused on the primary {primary}: {} ({})",
        why.0, why.1
    ))
}

/// Every signal [`SafetyState::named`] may name, for the gauge.
pub const SIGNALS: [&str; 5] = [
    "replicas_without_min_replicas_to_write",
    "no_aof",
    "restarted",
    "second_primary",
    "writable_replica",
];

#[cfg(test)]
mod tests {
    use super::*;

    fn run(addr: &str, id: &str) -> Run {
        Run {
            addr: Arc::from(addr),
            run_id: id.to_string(),
        }
    }

    #[test]
    fn a_restart_is_the_same_address_in_another_run() {
        let a = "127.0.0.1:1";
        #[rustfmt::skip]
        let cases = [
            ("first reading", None, a, "r1", false),
            ("same run", Some(run(a, "r1")), a, "r1", false),
            ("another address: a switch", Some(run(a, "r1")), "127.0.0.1:2", "r2", false),
            ("restarted", Some(run(a, "r1")), a, "r2", true),
            ("run_id unreadable", Some(run(a, "r1")), a, "", false),
        ];
        for (what, before, addr, id, want) in cases {
            assert_eq!(restarted(before.as_ref(), addr, id), want, "{what}");
        }
    }

    /// A primary's reading.
    fn s(replicas: u64, min_replicas: bool, aof: bool) -> Option<Safety> {
        Some(Safety {
            master: true,
            replicas,
            min_replicas,
            aof,
        })
    }

    #[test]
    fn signals_name_what_may_lose_locks() {
        assert_eq!(
            signals(s(1, false, false)),
            ["replicas_without_min_replicas_to_write", "no_aof"]
        );
        assert_eq!(signals(s(1, true, true)), Vec::<&str>::new());
        assert_eq!(
            signals(s(0, false, true)),
            Vec::<&str>::new(),
            "no replicas"
        );
        assert_eq!(signals(None), Vec::<&str>::new());
    }

    #[test]
    fn each_requirement_refuses_what_it_names() {
        let p = "127.0.0.1:1";
        #[rustfmt::skip]
        let cases = [
            ("off", false, false, s(1, false, false), None),
            ("replicas, none required", true, false, s(1, false, true), Some("it has replicas and no min-replicas-to-write (locks.require_min_replicas)")),
            ("replicas, required", true, false, s(1, true, true), None),
            ("no replicas", true, false, s(0, false, true), None),
            ("no AOF", false, true, s(0, false, false), Some("it has no append-only file (locks.require_persistence)")),
            ("AOF", false, true, s(0, false, true), None),
            ("unread", true, false, None, Some("its replication and persistence could not be read (locks.require_min_replicas)")),
        ];
        for (what, min, persist, reading, want) in cases {
            let required = Required {
                min_replicas: min,
                persistence: persist,
                one_primary: false,
            };
            let got = refused_because(required, reading, &[], &[], p);
            let want = want.map(|w| format!("lockgate: locks refused on the primary {p}: {w}"));
            assert_eq!(got, want, "{what}");
        }
        // A former primary still accepting writes: refused only when asked.
        let other: Vec<Arc<str>> = vec![Arc::from("127.0.0.1:2")];
        let one = Required {
            one_primary: true,
            ..Required::default()
        };
        let got = refused_because(one, s(1, true, true), &other, &[], p);
        let want = "lockgate: locks refused on the primary 127.0.0.1:1: the former primary 127.0.0.1:2 still accepts writes (locks.require_one_primary)";
        assert_eq!(got.as_deref(), Some(want));
        assert_eq!(refused_because(one, s(1, true, true), &[], &[], p), None);
        assert_eq!(
            refused_because(Required::default(), None, &other, &other, p),
            None
        );
        // A replica accepting writes: the same.
        let got = refused_because(one, s(1, true, true), &[], &other, p);
        let want = "lockgate: locks refused on the primary 127.0.0.1:1: its replica 127.0.0.1:2 accepts writes, replica-read-only no (locks.require_one_primary)";
        assert_eq!(got.as_deref(), Some(want));
    }

    #[test]
    fn a_restart_holds_for_the_delay() {
        let st = SafetyState::default();
        let a: Arc<str> = Arc::from("127.0.0.1:1");
        let no_aof = Safety {
            master: true,
            replicas: 0,
            min_replicas: false,
            aof: false,
        };
        st.learn(&a, "r1", Some(no_aof), true);
        assert!(st.restart_hold_left(Duration::from_secs(5)).is_none());
        st.learn(&a, "r2", Some(no_aof), true);
        assert!(st.restart_hold_left(Duration::from_secs(5)).is_some());
        assert_eq!(st.restarts.load(Ordering::Relaxed), 1);
        assert!(st.named(Duration::from_secs(5)).contains(&"restarted"));
        assert!(st.restart_hold_left(Duration::ZERO).is_none(), "0: off");
    }
}
