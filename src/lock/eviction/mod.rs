//! Lock keys and Redis's eviction. A lock is only as safe as its key: under
//! a `maxmemory-policy` that evicts, a Redis short of memory may delete a
//! lock key while it is held, and the next `SET NX` grants it to a second
//! holder. `noeviction` keeps every key (writes fail instead); `volatile-*`
//! evicts keys with a TTL, and every lock key and owner record has its
//! lease; `allkeys-*` evicts any key, fence counters included.
//!
//! lockgate reads the policy of every Redis it keeps a connection of its own
//! to (the primary, and each lock master) on that connection: when it opens
//! (so a new primary after a Sentinel switch is read before anything else is
//! asked of it) and every `locks.eviction_check_ms` after, with `INFO
//! stats`' `evicted_keys` ([`watch`]). The connection reads the replies
//! ([`crate::upstream::node::report`]); what they mean for locks is here,
//! in each node's [`Memory`]. The primary beside a quorum holds no lock
//! key: its policy is shown, never warned about or refused. `CONFIG GET
//! maxmemory-policy` first; where `CONFIG` is renamed or refused (managed Redis), `INFO
//! memory`'s `maxmemory_policy`; where both are refused, the policy is
//! `unknown`. A policy that may evict lock keys is logged (at each change,
//! and again at most once a minute), shown by name (`/metrics`' gauge
//! `upstream_maxmemory_policy`, `LOCKGATE PRIMARY`, `LOCKGATE MASTERS`, the
//! status page), and growth of `evicted_keys` is counted per node
//! (`upstream_evicted_keys_total`) and logged.
//!
//! With `locks.require_noeviction = true` ([`Eviction`]): lock acquisitions,
//! extensions and takeovers on a primary whose policy is not `noeviction`
//! are refused with an error that names the policy (releases pass: a lock
//! held can always be given back), and a lock master whose policy is not
//! `noeviction` sits out acquisitions (see [`crate::lock::quorum`]). The
//! policy is read again at every check, so `CONFIG SET maxmemory-policy
//! noeviction` on the Redis serves locks again within one check interval,
//! without a restart; turning the key off with a reload does too.
//!
//! The same readings carry the primary's replication and persistence, and
//! its restarts: [`safety`] (what else may lose a lock there).

pub mod formers;
pub mod safety;
pub mod watch;
pub mod writable;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::config::Config;
use crate::metrics::{counters, ProxyMetrics, RateLimit};
use crate::protocol::encode::LocalReply;
use crate::sync;
use crate::upstream::node::report::{Report, Sample};
use crate::upstream::node::Observer;

/// How often an unchanged policy that may evict lock keys is logged again.
const POLICY_WARN_INTERVAL: Duration = Duration::from_secs(60);
/// How often growth of `evicted_keys` (or a refusal) is logged again.
const WARN_INTERVAL: Duration = Duration::from_secs(10);

/// A Redis `maxmemory-policy`, as it bears on lock keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Policy {
    /// `noeviction`: no key is ever evicted (writes fail instead). The one
    /// policy under which a held lock key stays until its lease ends.
    NoEviction,
    /// `volatile-lru`, `-lfu`, `-random`, `-ttl`: evicts keys with a TTL,
    /// and every lock key and owner record has its lease.
    Volatile(Box<str>),
    /// `allkeys-lru`, `-lfu`, `-random`: evicts any key, lock keys, owner
    /// records and fence counters alike.
    AllKeys(Box<str>),
    /// A name lockgate does not know (a newer Redis): taken as evicting.
    Other(Box<str>),
    /// Neither `CONFIG GET` nor `INFO memory` told it.
    Unknown,
}

impl Policy {
    /// The policy called `name` by Redis.
    pub fn from_name(name: &str) -> Policy {
        let name = name.trim();
        match name {
            "noeviction" => Policy::NoEviction,
            n if n.starts_with("volatile-") => Policy::Volatile(n.into()),
            n if n.starts_with("allkeys-") => Policy::AllKeys(n.into()),
            "" => Policy::Unknown,
            n => Policy::Other(n.into()),
        }
    }

    /// Its name as Redis spells it; `unknown` when it could not be read.
    pub fn name(&self) -> &str {
        match self {
            Policy::NoEviction => "noeviction",
            Policy::Volatile(n) | Policy::AllKeys(n) | Policy::Other(n) => n,
            Policy::Unknown => "unknown",
        }
    }

    /// Whether a held lock key stays until its lease ends (`noeviction`).
    pub fn keeps_locks(&self) -> bool {
        *self == Policy::NoEviction
    }

    /// Why this policy may lose a held lock, for the logs.
    pub fn risk(&self) -> &'static str {
        match self {
            Policy::NoEviction => "keeps every key",
            Policy::Volatile(_) => "evicts keys with a TTL, and every lock key has its lease",
            Policy::AllKeys(_) => "evicts any key: lock keys, owner records, fence counters",
            Policy::Other(_) => "is not one lockgate knows, taken as evicting",
            Policy::Unknown => {
                "could not be read (CONFIG GET and INFO memory refused): lockgate cannot tell"
            }
        }
    }
}

/// Which of lockgate's own connections a node is, for the logs and labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Role {
    /// The primary, where lock keys live without a quorum.
    #[default]
    Primary,
    /// The primary beside a quorum: it holds no lock key, so its policy
    /// is shown but never warned about.
    PrimaryBesideQuorum,
    /// A lock master of the quorum.
    Master,
}

impl Role {
    /// `primary` or `master`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Primary | Role::PrimaryBesideQuorum => "primary",
            Role::Master => "master",
        }
    }

    /// Whether lock keys live on the node.
    pub fn holds_locks(self) -> bool {
        self != Role::PrimaryBesideQuorum
    }
}

/// The policy as last read from a node's current connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reading {
    /// The Redis it was read from (`HOST:PORT`): for a followed primary,
    /// the primary of that connection.
    pub addr: Arc<str>,
    /// What it said.
    pub policy: Policy,
}

/// What lockgate knows of one node's eviction: its policy and how many
/// keys it was seen evicting. Kept beside lockgate's own connection to the
/// node ([`crate::context::ServerContext::primary_memory`], each
/// [`crate::lock::quorum::Master`]'s), told what the node reports as each
/// connection opens (its [`Observer`]) and by the periodic [`watch`].
#[derive(Debug)]
pub struct Memory {
    role: Mutex<Role>,
    /// The policy in force and the connection (`NodeState::connects`) it
    /// was read on.
    reading: Mutex<Option<(u64, Reading)>>,
    /// `evicted_keys` as last read, with the `run_id` it counts for.
    last_evicted: Mutex<Option<(String, u64)>>,
    /// Growth of `evicted_keys` seen since lockgate started (a counter:
    /// `upstream_evicted_keys_total`). Written before the policy of the
    /// same reading, so a reader that sees the policy sees the growth too.
    pub evicted: AtomicU64,
    /// `CONFIG GET` was refused on this node: ask `INFO memory` instead.
    config_refused: AtomicBool,
    /// Its replication and persistence, and its restarts ([`safety`]).
    pub safety: safety::SafetyState,
    policy_warn: RateLimit,
    evicted_warn: RateLimit,
}

impl Default for Memory {
    fn default() -> Memory {
        Memory {
            role: Mutex::new(Role::default()),
            reading: Mutex::new(None),
            last_evicted: Mutex::new(None),
            evicted: AtomicU64::new(0),
            config_refused: AtomicBool::new(false),
            safety: safety::SafetyState::default(),
            policy_warn: RateLimit::new(POLICY_WARN_INTERVAL),
            evicted_warn: RateLimit::new(WARN_INTERVAL),
        }
    }
}

impl Memory {
    /// The memory of a node in `role`, nothing read yet.
    pub fn new(role: Role) -> Memory {
        let memory = Memory::default();
        memory.set_role(role);
        memory
    }

    /// Names the node's role in its logs.
    pub fn set_role(&self, role: Role) {
        *sync::lock(&self.role) = role;
    }

    /// The node's role.
    pub fn role(&self) -> Role {
        *sync::lock(&self.role)
    }

    /// The policy as last read (`None`: not read yet).
    pub fn reading(&self) -> Option<Reading> {
        sync::lock(&self.reading).as_ref().map(|(_, r)| r.clone())
    }

    /// The policy's name as shown to operators: `unknown` until read.
    pub fn policy_name(&self) -> String {
        sync::lock(&self.reading)
            .as_ref()
            .map_or("unknown", |(_, r)| r.policy.name())
            .to_string()
    }

    /// Whether `CONFIG GET` was refused here (the checks ask `INFO memory`).
    pub fn config_refused(&self) -> bool {
        self.config_refused.load(Ordering::Relaxed)
    }

    /// Takes note of the reading made as connection number `connection`
    /// to `addr` opened: counts the growth of `evicted_keys` since the last
    /// reading of the same run (`run_id`), then puts the policy in force,
    /// logging it when it may evict lock keys.
    pub fn opened(&self, connection: u64, addr: &str, run_id: &str, sample: &Sample) {
        let mut reading = sync::lock(&self.reading);
        self.learn(&mut reading, connection, Arc::from(addr), run_id, sample);
    }

    /// Takes note of a periodic reading made on connection number
    /// `connection`; dropped (false) when that is no longer the connection
    /// the policy in force was read on (it may be another Redis's).
    pub fn checked(&self, connection: u64, run_id: &str, sample: &Sample) -> bool {
        let mut reading = sync::lock(&self.reading);
        let addr = match reading.as_ref() {
            Some((c, r)) if *c == connection => r.addr.clone(),
            _ => return false,
        };
        self.learn(&mut reading, connection, addr, run_id, sample);
        true
    }

    /// Counts the growth of `evicted_keys` since the last reading of the
    /// same run (`run_id`: a restarted Redis counts from 0 again), then
    /// puts the policy in force, logging a policy that may evict lock keys
    /// (at a change, else at most once a minute) and any growth (at most
    /// every 10 s). Never logs a key.
    fn learn(
        &self,
        reading: &mut Option<(u64, Reading)>,
        connection: u64,
        addr: Arc<str>,
        run_id: &str,
        sample: &Sample,
    ) {
        if sample.config_refused {
            self.config_refused.store(true, Ordering::Relaxed);
        }
        let role = self.role();
        self.safety
            .learn(&addr, run_id, sample.safety, role.holds_locks());
        let grew = sample.evicted_keys.and_then(|now| {
            let mut last = sync::lock(&self.last_evicted);
            let before = last.replace((run_id.to_string(), now));
            match before {
                Some((run, then)) if run == run_id && now > then => Some(now - then),
                _ => None,
            }
        });
        // Before the policy: whoever sees this reading's policy sees its
        // growth too (the quorum sits a master out on both).
        if let Some(n) = grew {
            self.evicted.fetch_add(n, Ordering::Relaxed);
        }
        let policy = (sample.policy.as_deref()).map_or(Policy::Unknown, Policy::from_name);
        let new = Reading {
            addr,
            policy: policy.clone(),
        };
        let changed = reading.as_ref().map(|(_, r)| r) != Some(&new);
        let addr = new.addr.clone();
        *reading = Some((connection, new));
        if !role.holds_locks() {
            // Shown, not warned about: its evictions are its data's.
        } else if !policy.keeps_locks() {
            let repeat = self.policy_warn.check();
            if changed || repeat.is_some() {
                tracing::warn!(
                    node = &*addr,
                    role = role.as_str(),
                    policy = policy.name(),
                    risk = policy.risk(),
                    "Redis's maxmemory-policy may evict lock keys while they are held: set maxmemory-policy noeviction there (see locks.require_noeviction)"
                );
            }
        } else if changed {
            tracing::info!(
                node = &*addr,
                role = role.as_str(),
                policy = policy.name(),
                "Redis's maxmemory-policy keeps lock keys"
            );
        }
        if let Some(n) = grew.filter(|_| role.holds_locks()) {
            if let Some(more) = self.evicted_warn.check() {
                tracing::warn!(
                    node = &*addr,
                    role = role.as_str(),
                    policy = policy.name(),
                    evicted = n,
                    evicted_seen = self.evicted.load(Ordering::Relaxed),
                    suppressed = more,
                    "Redis evicted keys: a held lock key may have been among them"
                );
            }
        }
    }
}

impl Observer for Memory {
    /// The reading made as the connection opened (see [`Memory::opened`]).
    fn connected(&self, connection: u64, addr: &str, report: &Report) {
        self.opened(connection, addr, &report.run_id, &report.memory);
    }
}

counters! {
    /// Counters of the eviction checks.
    pub struct EvictionMetrics {
        /// Lock commands refused on a primary whose policy may evict them.
        refused: Counter "lock_eviction_refused",
            "Lock commands refused: the primary's maxmemory-policy may evict lock keys (locks.require_noeviction)";
        /// Lock commands refused by `locks.require_min_replicas`,
        /// `locks.require_persistence` or `locks.require_one_primary`
        /// ([`safety`]).
        safety_refused: Counter "lock_safety_refused",
            "Lock commands refused: the primary has replicas and no min-replicas-to-write (locks.require_min_replicas), no append-only file (locks.require_persistence), or another node of its set accepts writes (locks.require_one_primary)";
        /// Reads of a node's policy and `evicted_keys` that failed.
        check_failures: Counter "upstream_eviction_check_failures",
            "Periodic reads of a Redis's maxmemory-policy and evicted_keys that got no answer";
        /// Replicas of the primary not asked whether they accept writes:
        /// more than `writable::MAX_ASKED` listed ([`writable`]).
        replicas_unasked: Counter "upstream_replicas_unasked",
            "Replicas of the primary not asked whether they accept writes (more than 16 listed), per check";
    }
}

/// The eviction rules in force (`locks.require_noeviction`,
/// `locks.eviction_check_ms`; both reloadable) and their counters; shared
/// by the sessions, the quorum's masters and the [`watch`].
#[derive(Debug)]
pub struct Eviction {
    require: AtomicBool,
    check_ms: AtomicU64,
    /// Counters (exported with the others).
    pub metrics: EvictionMetrics,
    refuse_warn: RateLimit,
}

impl Eviction {
    /// The rules of a validated `config`.
    pub fn new(config: &Config) -> Eviction {
        let e = Eviction {
            require: AtomicBool::new(false),
            check_ms: AtomicU64::new(0),
            metrics: EvictionMetrics::default(),
            refuse_warn: RateLimit::new(WARN_INTERVAL),
        };
        e.reload(config);
        e
    }

    /// Puts the rules of `config` in force.
    pub fn reload(&self, config: &Config) {
        let l = &config.locks;
        self.require.store(l.require_noeviction, Ordering::Relaxed);
        self.check_ms.store(l.eviction_check_ms, Ordering::Relaxed);
    }

    /// `locks.require_noeviction` in force.
    pub fn required(&self) -> bool {
        self.require.load(Ordering::Relaxed)
    }

    /// `locks.eviction_check_ms` in force.
    pub fn check_interval(&self) -> Duration {
        Duration::from_millis(self.check_ms.load(Ordering::Relaxed).max(1))
    }

    /// Whether a lock master with `memory` sits out acquisitions for its
    /// policy: `locks.require_noeviction` is on and the policy read is not
    /// `noeviction`. Not read yet is not refused here: a master is read as
    /// its connection opens, before it counts as up, so one without a
    /// reading is down.
    pub fn master_refused(&self, memory: &Memory) -> bool {
        self.required()
            && (sync::lock(&memory.reading).as_ref()).is_some_and(|(_, r)| !r.policy.keeps_locks())
    }

    /// With `locks.require_noeviction`, why locks on the primary at
    /// `primary` (`None`: none confirmed), whose connection knows `memory`,
    /// are refused (the error text without `ERR `): `None` when the policy
    /// read from that primary is `noeviction`, or the key is off.
    pub fn refused_because(&self, primary: Option<&str>, memory: &Memory) -> Option<String> {
        if !self.required() {
            return None;
        }
        let reading = memory.reading();
        Some(match (&reading, primary) {
            (Some(r), Some(p)) if &*r.addr == p && r.policy.keeps_locks() => return None,
            (Some(r), Some(p)) if &*r.addr == p && r.policy == Policy::Unknown => format!(
                "lockgate: locks refused: maxmemory-policy is unknown on the primary {p} (CONFIG GET and INFO memory refused) (locks.require_noeviction)"
            ),
            (Some(r), Some(p)) if &*r.addr == p => format!(
                "lockgate: locks refused: maxmemory-policy is {} on the primary {p} (locks.require_noeviction)",
                r.policy.name()
            ),
            (_, Some(p)) => format!(
                "lockgate: locks refused: maxmemory-policy of the primary {p} not read yet (locks.require_noeviction)"
            ),
            (_, None) => "lockgate: locks refused: no primary confirmed, its maxmemory-policy unknown (locks.require_noeviction)".to_string(),
        })
    }

    /// [`Eviction::refused_because`] as the error a lock command gets;
    /// counted (`lock_eviction_refused`) and logged (rate-limited).
    pub fn refusal(&self, primary: Option<&str>, memory: &Memory) -> Option<LocalReply> {
        let text = self.refused_because(primary, memory)?;
        ProxyMetrics::inc(&self.metrics.refused);
        if let Some(more) = self.refuse_warn.check() {
            tracing::warn!(
                primary = primary.unwrap_or(""),
                policy = memory.policy_name(),
                suppressed = more,
                "lock command refused: the primary's maxmemory-policy may evict lock keys (locks.require_noeviction)"
            );
        }
        Some(LocalReply::err(text))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(policy: &str, evicted: Option<u64>) -> Sample {
        Sample {
            policy: Some(policy.to_string()),
            evicted_keys: evicted,
            config_refused: false,
            safety: None,
        }
    }

    #[test]
    fn policies_are_told_apart_by_what_they_evict() {
        assert!(Policy::from_name("noeviction").keeps_locks());
        for name in [
            "volatile-lru",
            "volatile-lfu",
            "volatile-random",
            "volatile-ttl",
            "allkeys-lru",
            "allkeys-lfu",
            "allkeys-random",
            "some-future-policy",
        ] {
            let p = Policy::from_name(name);
            assert!(!p.keeps_locks(), "{name}");
            assert_eq!(p.name(), name);
        }
        assert_eq!(
            Policy::from_name("volatile-ttl"),
            Policy::Volatile("volatile-ttl".into())
        );
        assert_eq!(Policy::from_name(""), Policy::Unknown);
        assert_eq!(Policy::Unknown.name(), "unknown");
    }

    #[test]
    fn evicted_keys_growth_counts_within_one_run_only() {
        let m = Memory::default();
        m.opened(1, "a:1", "run1", &sample("allkeys-lru", Some(5)));
        assert_eq!(
            m.evicted.load(Ordering::Relaxed),
            0,
            "a first reading is a baseline"
        );
        m.opened(1, "a:1", "run1", &sample("allkeys-lru", Some(12)));
        assert_eq!(m.evicted.load(Ordering::Relaxed), 7);
        m.opened(1, "a:1", "run1", &sample("allkeys-lru", None));
        m.opened(1, "a:1", "run1", &sample("allkeys-lru", Some(12)));
        assert_eq!(m.evicted.load(Ordering::Relaxed), 7, "no growth");
        // A restart counts from 0 again: a new baseline, not a loss.
        m.opened(2, "a:1", "run2", &sample("allkeys-lru", Some(3)));
        assert_eq!(m.evicted.load(Ordering::Relaxed), 7);
        assert!(m.checked(2, "run2", &sample("allkeys-lru", Some(4))));
        assert_eq!(m.evicted.load(Ordering::Relaxed), 8);
        // A check made on connection 1, answered after connection 2 opened.
        assert!(!m.checked(1, "run1", &sample("noeviction", Some(100))));
        assert_eq!(m.policy_name(), "allkeys-lru");
        assert_eq!(m.evicted.load(Ordering::Relaxed), 8);
    }

    #[test]
    fn the_primary_is_refused_until_its_own_policy_reads_noeviction() {
        let mut config = Config::default();
        let e = Eviction::new(&config);
        let m = Memory::default();
        assert!(e.refusal(Some("a:1"), &m).is_none(), "off by default");
        config.locks.require_noeviction = true;
        e.reload(&config);
        let text = |r: Option<LocalReply>| match r {
            Some(LocalReply::Error(b)) => String::from_utf8_lossy(&b).into_owned(),
            other => panic!("not refused: {other:?}"),
        };
        assert!(text(e.refusal(Some("a:1"), &m)).contains("not read yet"));
        m.opened(1, "a:1", "r", &sample("allkeys-lru", Some(0)));
        assert_eq!(
            text(e.refusal(Some("a:1"), &m)),
            "ERR lockgate: locks refused: maxmemory-policy is allkeys-lru on the primary a:1 (locks.require_noeviction)"
        );
        m.opened(1, "a:1", "r", &sample("noeviction", Some(0)));
        assert!(e.refusal(Some("a:1"), &m).is_none());
        // A new primary (Sentinel): what the old one said does not count.
        assert!(text(e.refusal(Some("b:2"), &m)).contains("not read yet"));
        m.opened(1, "a:1", "r", &sample("", None));
        assert!(text(e.refusal(Some("a:1"), &m)).contains("unknown"));
        assert_eq!(ProxyMetrics::get(&e.metrics.refused), 4);
        assert!(e.master_refused(&m));
        m.opened(1, "a:1", "r", &sample("noeviction", None));
        assert!(!e.master_refused(&m));
        assert!(!e.master_refused(&Memory::default()), "not read: down");
    }
}
