//! The lock room: what lockgate does with lock keys. It takes lock
//! operations ([`ops::LockOp`]) and returns the Redis command that carries
//! them out plus what to expect back; it never sees client sockets.
//!
//! # Safety invariants
//!
//! 1. Only keys matching `locks.keys` are ever changed ([`keys`]).
//! 2. A lock key acquired through lockgate never exists without a lease:
//!    acquisition is one `SET NX` with a TTL and its owner record, in one
//!    Lua call ([`crate::script::ACQUIRE`]); `PERSIST` on a lock key is refused;
//!    the EXPIRE family and takeovers keep a lease.
//! 3. A release or extension by a connection that acquired the key acts
//!    only on that exact acquisition (its token); one by a connection that
//!    never acquired it acts only on acquisitions made through this
//!    instance; a key without owner record is plain data and is deleted as
//!    before ([`crate::script::RELEASE`], [`crate::script::EXTEND`]).
//! 4. Replies keep exactly the shape of the client's command.
//!
//! # Layout
//!
//! - [`LockService`]: the only way in; `store`: where the locks live (the
//!   primary, or the quorum), hidden behind it: one call per attempt
//!   ([`LockService::attempt`] → [`Attempt`]), per read, client script,
//!   transaction step and fencing call; the failover hold, the
//!   `locks.require_noeviction` refusal and the acquirer of parked
//!   attempts.
//! - [`keys`] (patterns), [`ops`] (commands → ops), `plan` (ops → script
//!   calls, facts → records), [`fast`] (the uncontended cycle as small
//!   scripts), [`crate::script`] (the Lua, and its typed ARGV),
//!   [`evalsha`] (scripts by SHA1 on clients' connections, a `NOSCRIPT` run
//!   again as `EVAL`), [`txn`] (the scripts as `WATCH`/`MULTI`/`EXEC`
//!   transactions, on a server that refuses scripts), `reply` (the outcome of a lock script's reply, as a
//!   [`ReplyOutcome`]), [`lease`] (tokens, per-connection records).
//! - [`admit`] (an acquisition's fate before Redis: absorbed, delayed,
//!   parked, or on), [`storm`] (retry storms: the contention table,
//!   parking, FIFO handoff; `storm::Key::step` the rules as a state
//!   machine), [`on_behalf`] (acquisitions away from the client's
//!   connection), [`announce`] (wake-ups between instances, see
//!   docs/fleet.md), [`hotkeys`] (the top-K sketch of hot lock keys),
//!   [`conns`] (this instance's connections, for operators), [`operator`]
//!   (who holds and who waits, and an operator's release), [`lapses`]
//!   (the latest leases that ran out before their release), [`guard`]
//!   (guarded writes: a write to data a lock protects, checked with the
//!   write against the owner record).
//! - [`quorum`] (the Redlock quorum in one folder: masters and their
//!   sit-outs, asking them, ops, fencing tokens, clocks, scripts),
//!   [`split`] (per-key commands split between the quorum and the
//!   primary).
//! - [`watchdog`] (renewal, release on disconnect), [`fence`] (the
//!   fencing-token API on one Redis), [`kinds`] (shared, reentrant,
//!   counted and multi-key locks for new code; their operators' view in
//!   `kinds_view`), `all_or_none` (`MSETNX` on lock keys as one
//!   acquisition), [`fence_watch`] (`LOCKGATE WATCH`: a
//!   holder told when its lease is gone), [`failover`] (the hold after a switch
//!   of the primary), [`replicas`] (a grant answered only once the
//!   primary's replicas hold it, `locks.replicas_ack`; the shorter hold
//!   after a switch), [`eviction`] (each store's `maxmemory-policy`, and
//!   what else may lose a lock on the primary), `disputed` (grants
//!   refused in a slot a cluster's nodes disagree about),
//!   `forget` (what a forwarded command changed behind the room's back:
//!   [`Forget`], [`Database`]), [`reconcile`] (owner records made true to
//!   what a client's own script, a lock library's release or extension,
//!   did to its keys), [`wake`] (a library's waiters, blocked on their
//!   signal list, woken when their own wake-up was lost).
//! - [`metrics`] (the room's counters). lockgate's own shared, pipelined
//!   connection to one Redis, which the room calls through, is
//!   [`crate::upstream::node`].

pub(crate) mod admit;
mod all_or_none;
pub(crate) mod announce;
pub mod conns;
mod disputed;
pub(crate) mod evalsha;
pub use evalsha::eval_on;
pub(crate) mod eviction;
pub(crate) mod failover;
pub(crate) mod fast;
pub(crate) mod fence;
pub mod fence_watch;
mod forget;
pub use forget::{Database, Forget};
pub mod guard;
pub(crate) mod hotkeys;
pub(crate) mod keys;
pub mod kinds;
pub(crate) mod kinds_view;
pub mod lapses;
pub(crate) mod lease;
pub(crate) mod metrics;
pub(crate) mod on_behalf;
pub mod operator;
pub mod ops;
mod plan;
pub(crate) mod reconcile;
pub mod replicas;
pub use plan::Queueing;
pub mod quorum;
mod reply;
pub use reply::ReplyOutcome;
pub(crate) mod split;
mod store;
pub use admit::Early;
pub use store::{Attempt, FenceCall, Later, Seat, Store};
pub(crate) mod storm;
pub mod txn;
pub(crate) mod wake;
pub(crate) mod watchdog;

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use dashmap::DashMap;

use crate::config::{Config, LockOverride, Ownership};
use crate::metrics::{ProxyMetrics, RateLimit};
use crate::protocol::encode::LocalReply;
use keys::KeyPatterns;
use lease::{ConnLocks, Tokens};
use metrics::LockMetrics;

/// Prefix of owner records: `lockgate:owner:{key}` (a key with a hash tag
/// of its own: see [`tagged`]).
pub const OWNER_PREFIX: &[u8] = b"lockgate:owner:{";

/// Prefix of a key's cross-instance queue (see [`crate::script::ACQUIRE`]):
/// `lockgate:queue:{key}`, in the owner record's hash slot.
pub const QUEUE_PREFIX: &[u8] = b"lockgate:queue:{";

/// Prefix of the ends of the places in a key's queue:
/// `lockgate:places:{key}`, in the owner record's hash slot.
pub const PLACES_PREFIX: &[u8] = b"lockgate:places:{";

/// The pub/sub channel prefix an instance is woken on when its place in a
/// key's queue comes first: `lockgate:wake:<instance prefix>`, the lock
/// key as the message.
pub const WAKE_PREFIX: &str = "lockgate:wake:";

/// What the writer half must do with the reply to a planned lock command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LockPending {
    /// An acquisition with `token`.
    Acquire {
        /// The lock key.
        key: Bytes,
        /// The token tried.
        token: Bytes,
        /// The value tried (the storm room remembers the values that lost:
        /// `Storm::lost_value`).
        value: Bytes,
        /// What the command answers (its "not acquired", should its grant
        /// not be acknowledged by the replicas: [`replicas`]).
        shape: ops::Shape,
        /// The primary's generation when it was planned, truncated (only
        /// compared): a grant is acknowledged only by that primary's
        /// replicas ([`replicas`]). 32 bits keep the record small.
        primary_at: u32,
        /// If it fails: park it (retry storms), with these settings.
        park: Option<Park>,
        /// Where it ran: the contention table learns only database 0.
        db: Database,
    },
    /// A release of these lock keys.
    Release {
        /// The lock keys.
        keys: Vec<Bytes>,
        /// The parked attempt the release hands the (one) key to, if any.
        handoff: Option<storm::Claim>,
        /// Tokens numbered below this were issued before the release was
        /// planned: only those attempts of the connection does it end (an
        /// attempt pipelined after it is the connection's next).
        upto: u64,
        /// Where it ran: the contention table learns only database 0.
        db: Database,
        /// A release by value (a lock library's release script): the value.
        /// Holdings of other connections acquired with it end with it
        /// (see [`LockService::released_by_value`]).
        by_value: Option<Bytes>,
    },
    /// An extension.
    Extend {
        /// The lock key.
        key: Bytes,
        /// Tokens numbered below this were issued before the extension was
        /// planned: if it finds the lease lapsed, only those attempts are
        /// over (an acquisition pipelined after it is still on its way).
        upto: u64,
        /// Where it ran: the contention table learns only database 0.
        db: Database,
        /// The primary's generation when it was planned, truncated
        /// ([`replicas`]).
        primary_at: u32,
    },
    /// A client script on these lock keys: its reply passes as it is, and
    /// what lockgate knew of the keys is dropped (it may have released them).
    Script {
        /// The lock keys among the script's keys.
        keys: Vec<Bytes>,
        /// The values among the script's arguments that may be a lock's
        /// (see [`reconcile::candidates`]): a lock key found holding one,
        /// with no owner record, was acquired by the script.
        values: Vec<Bytes>,
        /// Where it ran: owner records are reconciled with what it did
        /// only in database 0 ([`reconcile`]), where lockgate's own
        /// connection reads them.
        db: Database,
        /// When it was sent: a "not acquired" answered from what lockgate
        /// knew after then may be stale, as the script may have released
        /// the key before lockgate learned it ([`wake`]).
        sent: std::time::Instant,
    },
    /// A command forwarded as it is that changed lock keys or Redis's
    /// script cache behind the lock room's back (a flush, a rename): its
    /// reply passes as it is and, unless it is an error, what lockgate knew
    /// is dropped as the [`Forget`] says.
    Forget(Forget),
    /// A call rewritten to a fast script ([`fast`]): its reply is read as
    /// that script answers, then learned as the general plan's `then`.
    Fast {
        /// How to read the reply.
        read: fast::Fast,
        /// The general plan's outcome.
        then: Box<LockPending>,
    },
    /// A takeover with `token`.
    Takeover {
        /// The lock key.
        key: Bytes,
        /// The new owner token.
        token: Bytes,
        /// The primary's generation when it was planned, truncated.
        primary_at: u32,
    },
    /// A guarded write ([`guard`]): its reply is the write's, or a refusal.
    Guard(guard::GuardPending),
    /// An `EXEC` whose transaction queued grants the replicas must hold
    /// ([`replicas`]): each with its place in `EXEC`'s array; `slots`, the
    /// commands queued; `then`, what else its reply teaches (a release
    /// inside the transaction).
    InTx {
        /// The grants' places and plans.
        grants: Vec<(u32, LockPending)>,
        /// The commands the transaction queued.
        slots: u32,
        /// Learned from the same reply first.
        then: Option<Box<LockPending>>,
    },
}

/// An acquisition the lock room lets go to Redis
/// ([`LockService::admit`]).
#[derive(Debug, Default)]
pub(crate) struct Go {
    /// If it fails: park it, with these settings.
    pub park: Option<Park>,
    /// The key is known held and only a probe is due: a plain `PTTL` may
    /// stand for the attempt (see [`storm::Admission::Check`]).
    pub check: bool,
}

/// How a failed attempt is parked (see [`storm`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Park {
    /// The client's value.
    pub value: Bytes,
    /// What the client expects back.
    pub shape: ops::Shape,
    /// The lease to acquire with on its behalf, ms.
    pub lease_ms: u64,
    /// How long it may wait, ms.
    pub park_ms: u64,
    /// The key's probe interval, ms.
    pub probe_ms: u64,
}

/// Why a command on lock keys was refused (see
/// [`LockService::count_refusal`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// On a connection whose replies are not counted (MONITOR, replication).
    Raw,
    /// It mixes lock keys with other keys (the quorum).
    Mixed,
}

/// A lock op turned into a Redis command.
#[derive(Debug)]
pub struct Planned {
    /// The script call to send on the client's upstream connection
    /// (`EVALSHA`, or `EVAL` where it must, see [`evalsha`]).
    pub call: evalsha::Call,
    /// What to do with its reply; `None` inside MULTI (reply passed as is).
    pub pending: Option<LockPending>,
}

/// The lock rules that a reload may change: patterns, leases, ownership,
/// per-pattern settings, retry-storm settings.
#[derive(Debug)]
pub struct Rules {
    patterns: KeyPatterns,
    overrides: Vec<(KeyPatterns, LockOverride)>,
    default_lease_ms: u64,
    any: bool,
    fast_path: bool,
    retry: crate::config::RetryConfig,
    failover_delay_ms: Option<u64>,
    eviction_check_ms: u64,
    /// `locks.replicas_ack`, its timeout and refusal.
    replicas_ack: u32,
    replicas_ack_timeout_ms: u64,
    replicas_ack_refusal: crate::config::AckRefusal,
    /// `locks.require_min_replicas`, `locks.require_persistence`,
    /// `locks.require_one_primary`.
    required: eviction::safety::Required,
    /// Some pattern, or all, asks replicas to acknowledge: without any,
    /// a grant looks at no pattern for it.
    replicas_ack_any: bool,
    /// `[[locks.guards]]`, compiled.
    guards: guard::Guards,
}

impl Rules {
    /// `locks.retry.max_attempts_per_sec` in force.
    pub fn max_attempts_per_sec(&self) -> u64 {
        self.retry.max_attempts_per_sec
    }

    /// `locks.retry.spin_window_ms` in force.
    pub fn spin_window_ms(&self) -> u64 {
        self.retry.spin_window_ms
    }

    /// Which keys ask how many replicas to acknowledge their grants: the
    /// global setting and each pattern's.
    fn acks(&self) -> (u32, Vec<(&str, Option<u32>)>) {
        let patterns = (self.overrides.iter())
            .map(|(_, o)| (o.pattern.as_str(), o.replicas_ack))
            .collect();
        (self.replicas_ack, patterns)
    }

    fn new(c: &crate::config::LocksConfig, guards: guard::Guards) -> Rules {
        Rules {
            eviction_check_ms: c.eviction_check_ms,
            guards,
            patterns: KeyPatterns::new(&c.keys),
            overrides: c
                .overrides
                .iter()
                .map(|o| (KeyPatterns::new([&o.pattern]), o.clone()))
                .collect(),
            default_lease_ms: c.default_lease_ms,
            any: c.ownership == Ownership::Any,
            fast_path: c.fast_path,
            retry: c.retry.clone(),
            failover_delay_ms: c.failover_delay_ms,
            required: eviction::safety::Required {
                min_replicas: c.require_min_replicas,
                persistence: c.require_persistence,
                one_primary: c.require_one_primary,
            },
            replicas_ack: c.replicas_ack,
            replicas_ack_timeout_ms: c.replicas_ack_timeout_ms,
            replicas_ack_refusal: c.replicas_ack_refusal,
            replicas_ack_any: c.replicas_ack > 0
                || c.overrides
                    .iter()
                    .any(|o| o.replicas_ack.is_some_and(|n| n > 0)),
        }
    }
}

/// The lock service: the only way into the lock room.
#[derive(Debug)]
pub struct LockService {
    rules: std::sync::RwLock<std::sync::Arc<Rules>>,
    tokens: Tokens,
    max_conn_locks: usize,
    max_unmatched: usize,
    unmatched: DashMap<Bytes, u64, keys::KeyHasher>,
    /// Lock counters.
    pub metrics: LockMetrics,
    /// The script cache's epoch (see [`evalsha`]).
    pub script_epoch: evalsha::Epoch,
    /// The contention table (retry storms).
    pub storm: std::sync::Arc<storm::Storm>,
    /// The hottest lock keys (bounded top-K sketch).
    pub hot: hotkeys::HotKeys,
    /// This instance's client connections, for operators (see [`conns`]).
    pub conns: conns::Conns,
    /// Lock keys watched for library waiters whose wake-up may be lost
    /// (see [`wake`]).
    pub(crate) wake: wake::Watched,
    /// The latest leases that ran out before their holder released or
    /// extended them, for operators (see [`lapses`]).
    pub lapses: lapses::Lapses,
    lapse_warn: RateLimit,
    /// Rate-limits the warning that the server refuses lockgate's scripts.
    scripts_warn: RateLimit,
    unmatched_warn: RateLimit,
    /// How long a release carrying a handoff may take to be answered
    /// (`upstream.connect_timeout_ms`, as lockgate's own calls).
    handoff_within: Duration,
    /// The longest lease this instance has asked the primary for, in ms
    /// (the default failover delay).
    max_lease_ms: std::sync::atomic::AtomicU64,
    /// Where the locks live (see [`Store`]).
    store: Store,
    /// A Redis Cluster is behind lockgate (`[upstream.cluster]`): see
    /// [`LockService::refused_on_cluster`].
    on_cluster: bool,
    /// Guards are configured (see [`LockService::guards_on`]).
    guards_on: std::sync::atomic::AtomicBool,
    /// Some pattern asks for replica acknowledgement (one relaxed load on
    /// every lock reply when none does: [`replicas`]).
    acks_on: std::sync::atomic::AtomicBool,
    /// `locks.require_min_replicas`, `locks.require_persistence` or
    /// `locks.require_one_primary` is on
    /// (one relaxed load on every lock command when neither is).
    safety_on: std::sync::atomic::AtomicBool,
    /// Redis's command table, for guarded writes ([`guard::table`]).
    pub guard_table: guard::table::GuardTable,
    /// Every guard's counters by lock pattern, kept across reloads.
    guard_counts:
        std::sync::Mutex<std::collections::HashMap<String, std::sync::Arc<guard::GuardCounts>>>,
    /// Rate-limits the warning of a guarded write from a non-holder.
    guard_warn: RateLimit,
    /// Client script bodies by SHA1, for guarded `EVALSHA`s (bounded by
    /// [`guard::MAX_SCRIPTS`]).
    guard_scripts: std::sync::Mutex<std::collections::HashMap<String, Bytes>>,
    /// Which client scripts list keys, for their `EVALSHA`s (see
    /// [`forget`]).
    listing_scripts: forget::ListingScripts,
}

/// Interval between two repeats of the same lock warning.
const WARN_INTERVAL: Duration = Duration::from_secs(10);

impl LockService {
    /// The service for a validated configuration, its locks in a store
    /// that reaches nothing ([`Store::offline`]): its rules, plans and
    /// reply handling, without Redis.
    pub fn new(config: &Config) -> LockService {
        LockService::with_store(config, Store::offline(config))
    }

    /// The service for a validated configuration, its locks in `store`.
    pub(crate) fn with_store(config: &Config, store: Store) -> LockService {
        let c = &config.locks;
        let instance = if c.instance_id.is_empty() {
            let port = config.proxy.listen.rsplit(':').next().unwrap_or("0");
            format!("{}:{port}", hostname())
        } else {
            c.instance_id.clone()
        };
        let service = LockService {
            rules: std::sync::RwLock::new(std::sync::Arc::new(Rules::new(
                c,
                guard::Guards::default(),
            ))),
            tokens: Tokens::new(&instance),
            max_conn_locks: c.max_locks_per_connection,
            max_unmatched: c.max_unmatched_prefixes,
            unmatched: DashMap::with_hasher(keys::KeyHasher::new()),
            metrics: LockMetrics::default(),
            script_epoch: evalsha::Epoch::default(),
            storm: std::sync::Arc::new(storm::Storm::new(&c.retry)),
            hot: hotkeys::HotKeys::new(config.admin.hot_keys),
            conns: conns::Conns::default(),
            wake: wake::Watched::new(&c.wake),
            lapses: lapses::Lapses::new(config.admin.recent_lapses),
            lapse_warn: RateLimit::new(WARN_INTERVAL),
            scripts_warn: RateLimit::new(WARN_INTERVAL),
            unmatched_warn: RateLimit::new(WARN_INTERVAL),
            handoff_within: Duration::from_millis(config.upstream.connect_timeout_ms),
            max_lease_ms: std::sync::atomic::AtomicU64::new(0),
            store,
            on_cluster: config.upstream.cluster.enabled(),
            guards_on: std::sync::atomic::AtomicBool::new(false),
            acks_on: std::sync::atomic::AtomicBool::new(false),
            safety_on: std::sync::atomic::AtomicBool::new(false),
            guard_table: guard::table::GuardTable::default(),
            guard_counts: std::sync::Mutex::new(std::collections::HashMap::new()),
            guard_warn: RateLimit::new(WARN_INTERVAL),
            guard_scripts: std::sync::Mutex::new(std::collections::HashMap::new()),
            listing_scripts: forget::ListingScripts::default(),
        };
        service.reload(config);
        service
    }

    /// In front of a Redis Cluster that holds the locks (no quorum), the
    /// refusal of a lock command on `keys` that cannot be served there
    /// (`None`: served, one Redis, or the quorum's masters hold them):
    /// a key whose owner record cannot be in its hash slot
    /// ([`own_keys_in_slot`]: a `}` with no hash tag before it), or a
    /// cluster that refuses scripts (lock transactions are not carried to
    /// a cluster's nodes). Refused, never passed on unprotected.
    pub(crate) fn refused_on_cluster<'a>(
        &self,
        mut keys: impl Iterator<Item = &'a [u8]>,
    ) -> Option<LocalReply> {
        // With the quorum the locks live on its masters, not the cluster.
        if !self.on_cluster || self.quorum().is_some() {
            return None;
        }
        let why = if self.store.primary.scriptless() {
            "the cluster's nodes refuse scripts, and lock transactions are not served on a cluster"
        } else if keys.any(|k| !own_keys_in_slot(k)) {
            "lockgate's own keys for this lock key cannot be in its hash slot (a '}' with no hash tag before it)"
        } else {
            return None;
        };
        ProxyMetrics::inc(&self.metrics.refused_on_cluster);
        Some(LocalReply::err(format!(
            "lockgate: lock refused in front of a Redis Cluster: {why}; the command was not sent (docs/cluster.md)"
        )))
    }

    /// The rules in force now.
    pub(crate) fn rules(&self) -> std::sync::Arc<Rules> {
        crate::sync::read(&self.rules).clone()
    }

    /// Puts the lock rules of `config` in force (hot reload). Commands
    /// routed from now on see them; acquisitions already made keep theirs.
    pub fn reload(&self, config: &Config) {
        let guards = self.compile_guards(&config.locks);
        let on = !guards.is_empty();
        let new = std::sync::Arc::new(Rules::new(&config.locks, guards));
        // Grants made under other acknowledgement settings were not
        // acknowledged as these ask (`replicas::switch`).
        if self.rules().acks() != new.acks() {
            self.store().replicas.acks_changed();
        }
        let relaxed = std::sync::atomic::Ordering::Relaxed;
        self.acks_on.store(new.replicas_ack_any, relaxed);
        self.store()
            .replicas
            .set_fsync(config.locks.replicas_ack_fsync);
        let safety = new.required.any();
        self.safety_on.store(safety, relaxed);
        *crate::sync::write(&self.rules) = new;
        self.guards_on
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// `locks.eviction_check_ms` in force, as a duration.
    pub(crate) fn eviction_interval(&self) -> Duration {
        Duration::from_millis(self.rules().eviction_check_ms.max(10))
    }

    /// True when `key` is a lock key.
    pub fn is_lock_key(&self, key: &[u8]) -> bool {
        // On the path of every SET and DEL: read in place, no Arc clone.
        crate::sync::read(&self.rules).patterns.matches(key)
    }

    /// The per-pattern settings for `key`, if any.
    pub(crate) fn override_for(&self, key: &[u8]) -> Option<LockOverride> {
        self.rules()
            .overrides
            .iter()
            .find(|(p, _)| p.matches(key))
            .map(|(_, o)| o.clone())
    }

    /// The lease for `key` in milliseconds.
    pub(crate) fn lease_ms(&self, key: &[u8]) -> u64 {
        match self.override_for(key) {
            Some(o) if o.lease_ms > 0 => o.lease_ms,
            _ => self.rules().default_lease_ms,
        }
    }

    /// (probe interval, park time) in ms for `key`: the pattern's own, or
    /// `locks.retry`'s.
    pub(crate) fn retry_for(&self, key: &[u8]) -> (u64, u64) {
        let o = self.override_for(key);
        let retry = &self.rules().retry;
        (
            o.as_ref()
                .and_then(|o| o.probe_interval_ms)
                .unwrap_or(retry.probe_interval_ms),
            o.and_then(|o| o.park_ms).unwrap_or(retry.park_ms),
        )
    }

    /// Fairness across instances for `key`: (bound, a place's life in the
    /// key's queue) in ms, as the scripts take them. The bound is
    /// `locks.retry.max_local_preference_ms` (0: off); the life
    /// `max(locks.retry.queue_ttl_ms, 3 × probe interval)` (the script
    /// multiplies it by the place's rank, up to 64), as every instance
    /// renews its place once per a third of its life (the first in the
    /// queue at its next probe then, the others once per
    /// [`LockService::behind_ms`]).
    pub(crate) fn fairness_for(&self, key: &[u8]) -> (u64, u64) {
        let retry = &self.rules().retry;
        let (probe_ms, _) = self.retry_for(key);
        let ttl = retry.queue_ttl_ms.max(probe_ms.saturating_mul(3));
        (retry.max_local_preference_ms, ttl)
    }

    /// How often an instance second in `key`'s queue renews its place (asks
    /// the store again) while no wake-up comes, ms: a third of the place's
    /// life, so one lost renewal does not cost the place; one further back
    /// renews [`LockService::behind_ms`], rank times this.
    pub(crate) fn renew_ms(&self, key: &[u8]) -> u64 {
        (self.fairness_for(key).1 / 3).max(1)
    }

    /// How long an attempt on `key` that the store found behind another
    /// instance waits for its wake-up before asking again, ms: `scale`
    /// (the [`crate::script::ACQUIRE_BEHIND_FACT`], its place's rank, 1 to 64)
    /// renewal intervals; 0 when not behind.
    pub(crate) fn behind_ms(&self, key: &[u8], scale: i64) -> u64 {
        match scale {
            s if s <= 0 => 0,
            s => self.renew_ms(key).saturating_mul(s.min(64) as u64),
        }
    }

    /// True when some pattern has the watchdog on.
    pub(crate) fn has_watchdog(&self) -> bool {
        self.rules().overrides.iter().any(|(_, o)| o.watchdog)
    }

    /// True when some pattern releases its locks on disconnect.
    pub(crate) fn has_release_on_disconnect(&self) -> bool {
        self.rules()
            .overrides
            .iter()
            .any(|(_, o)| o.release_on_disconnect)
    }

    /// How often the watchdog looks for locks to renew: a third of the
    /// shortest watchdog lease, at least 10 ms.
    pub(crate) fn tick_ms(&self) -> u64 {
        let rules = self.rules();
        rules
            .overrides
            .iter()
            .filter(|(_, o)| o.watchdog)
            .map(|(_, o)| {
                if o.lease_ms > 0 {
                    o.lease_ms
                } else {
                    rules.default_lease_ms
                }
            })
            .min()
            .unwrap_or(rules.default_lease_ms)
            .div_ceil(3)
            .max(10)
    }

    /// `instance_id:`, the prefix of this instance's tokens.
    pub fn instance_prefix(&self) -> &str {
        self.tokens.prefix()
    }

    /// A new acquisition token of this instance.
    pub(crate) fn next_token(&self) -> Bytes {
        self.tokens.next()
    }

    /// A fresh per-connection record table.
    pub(crate) fn conn_locks(&self) -> ConnLocks {
        ConnLocks::opened(self.max_conn_locks, self.tokens.issued())
    }

    /// A client connection closed: the places it kept in contention queues
    /// between two attempts go, or they would hold newcomers back for a
    /// client that is gone (for up to `max(park_ms, probe_interval_ms)`).
    /// Its attempts still parked are answered by their dropped channels.
    pub(crate) fn connection_closed(&self, conn: &std::sync::Mutex<ConnLocks>) {
        let (id, keys) = {
            let c = crate::sync::lock(conn);
            (c.id, c.keys().cloned().collect::<Vec<_>>())
        };
        for key in keys {
            self.storm.leave(&key, id);
        }
    }

    /// Counts a SETNX / SET NX on a key outside `locks.keys`, by prefix.
    pub(crate) fn note_unmatched(&self, key: &[u8]) {
        ProxyMetrics::inc(&self.metrics.unmatched_setnx);
        let prefix = match memchr::memrchr(b':', key) {
            Some(i) => &key[..i],
            None => key,
        };
        if let Some(mut n) = self.unmatched.get_mut(prefix) {
            *n += 1;
        } else if self.unmatched.len() < self.max_unmatched {
            *self
                .unmatched
                .entry(Bytes::copy_from_slice(prefix))
                .or_insert(0) += 1;
        } else {
            ProxyMetrics::inc(&self.metrics.unmatched_overflow);
        }
        if let Some(more) = self.unmatched_warn.check() {
            tracing::warn!(
                prefix = %String::from_utf8_lossy(prefix),
                suppressed = more,
                "SETNX on a key outside locks.keys passed through untouched; add its prefix to locks.keys if it is a lock (LOCKGATE UNMATCHED lists them)"
            );
        }
    }

    /// The most frequent unmatched prefixes, most first.
    pub(crate) fn unmatched_top(&self, n: usize) -> Vec<(Bytes, u64)> {
        let mut all: Vec<(Bytes, u64)> = self
            .unmatched
            .iter()
            .map(|e| (e.key().clone(), *e.value()))
            .collect();
        all.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        all.truncate(n);
        all
    }

    /// Counts a command on lock keys refused for `why`.
    pub(crate) fn count_refusal(&self, why: Refusal) {
        ProxyMetrics::inc(match why {
            Refusal::Raw => &self.metrics.raw_refused,
            Refusal::Mixed => &self.metrics.mixed_refused,
        });
    }

    /// `conn` is releasing `keys`: its own attempts parked on them leave
    /// the queue (a holder releasing does not wait for itself).
    pub(crate) fn releasing(&self, keys: &[Bytes], conn: lease::ConnId) {
        for key in keys {
            self.storm.leave(key, conn);
        }
    }

    /// What lockgate knew of `key` (held until when) is dropped: a client
    /// script ran on it and may have released it.
    pub(crate) fn released(&self, key: &[u8]) {
        self.storm.released(key);
    }

    /// The refusal of `PERSIST` on a lock key.
    pub(crate) fn refuse_persist(&self, key: &[u8]) -> LocalReply {
        ProxyMetrics::inc(&self.metrics.persist_refused);
        LocalReply::err(format!(
            "lockgate: PERSIST refused on lock key '{}': a lock without a lease never expires if its holder dies",
            String::from_utf8_lossy(key)
        ))
    }
}

/// Splits a lock script's `{reply, facts…}` into the client's reply bytes
/// and the facts. Anything else (a script error, say) is the client's reply
/// as it is, with no facts.
pub fn split_reply(frame: &[u8]) -> (&[u8], Vec<i64>) {
    let whole = (frame, Vec::new());
    if frame.first() != Some(&b'*') {
        return whole;
    }
    let Some(nl) = memchr::memchr(b'\n', frame) else {
        return whole;
    };
    let body = &frame[nl + 1..];
    let mut scanner = crate::protocol::reply::ReplyScanner::new();
    let Ok((len, Some(_))) = scanner.advance(body) else {
        return whole;
    };
    let mut facts = Vec::new();
    for line in body[len..].split(|&c| c == b'\n') {
        if let Some(digits) = line.strip_prefix(b":").and_then(|l| l.strip_suffix(b"\r")) {
            if let Some(n) = crate::protocol::request::parse_int(digits) {
                facts.push(n);
            }
        }
    }
    (&body[..len], facts)
}

/// `lockgate:owner:{key}`.
pub fn owner_key(key: &[u8]) -> Bytes {
    tagged(OWNER_PREFIX, key)
}

/// `lockgate:queue:{key}`.
pub fn queue_key(key: &[u8]) -> Bytes {
    tagged(QUEUE_PREFIX, key)
}

/// `lockgate:places:{key}`.
pub fn places_key(key: &[u8]) -> Bytes {
    tagged(PLACES_PREFIX, key)
}

/// Whether lockgate's own keys for `key` are in its hash slot: always
/// but for a key with a `}` and no hash tag (`a}b`, whose names' tag
/// would end at that `}`) and the empty key. Locks on such keys are
/// refused in front of a cluster.
pub(crate) fn own_keys_in_slot(key: &[u8]) -> bool {
    use crate::cluster::slot::key_slot;
    key_slot(&owner_key(key)) == key_slot(key)
}

/// `prefix` (ending in `:{`), `key`, `}`: a name in `key`'s hash slot, so
/// that on a Redis Cluster a lock script's keys are all on the lock key's
/// node. A key with a hash tag of its own (`lock:{order}:1`) would take
/// the name out of its slot (the name's tag would be `lock:{order`): it
/// is named `prefix@{tag}key` instead (`lockgate:owner@{order}lock:{order}:1`),
/// in the key's slot, with a prefix no untagged key's name has, so two
/// keys never share a name.
pub(crate) fn tagged(prefix: &[u8], key: &[u8]) -> Bytes {
    let tag = crate::cluster::slot::hashed_part(key);
    let mut k = BytesMut::with_capacity(prefix.len() + tag.len() + key.len() + 3);
    if tag.len() == key.len() {
        k.extend_from_slice(prefix);
        k.extend_from_slice(key);
        k.extend_from_slice(b"}");
    } else {
        k.extend_from_slice(&prefix[..prefix.len() - 2]);
        k.extend_from_slice(b"@{");
        k.extend_from_slice(tag);
        k.extend_from_slice(b"}");
        k.extend_from_slice(key);
    }
    k.freeze()
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "lockgate".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::slot::key_slot;

    /// lockgate's own keys for a lock are in the lock key's hash slot,
    /// with or without a hash tag of its own, and no two keys share one.
    #[test]
    fn own_keys_live_in_the_lock_keys_slot_and_never_collide() {
        let keys: &[&[u8]] = &[
            b"lock:order:1",
            b"lock:{order}:1",
            b"{order}",
            b"order",
            b"{t}",
            b"t}{t",
            b"t",
            b"lock:{}:x",
            b"redisson_lock__channel:{name}",
            b"{a}{b}",
            b"",
        ];
        let mut names = std::collections::HashSet::new();
        for key in keys {
            // A `}` with no hash tag before it, or nothing at all.
            let odd = [&b""[..], b"t}{t", b"lock:{}:x"].contains(key);
            assert_eq!(own_keys_in_slot(key), !odd, "{key:?}");
            for name in [
                owner_key(key),
                queue_key(key),
                places_key(key),
                fence::counter_key(key),
            ] {
                if !odd {
                    assert_eq!(key_slot(&name), key_slot(key), "{name:?} for {key:?}");
                }
                assert!(names.insert(name.clone()), "{name:?} twice");
            }
        }
        assert_eq!(&owner_key(b"lock:1")[..], b"lockgate:owner:{lock:1}");
        assert_eq!(
            &owner_key(b"lock:{order}:1")[..],
            b"lockgate:owner@{order}lock:{order}:1"
        );
    }
}
