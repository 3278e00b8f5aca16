//! The `[locks]` part of the configuration: which keys are locks, their
//! leases and owners, per-pattern settings, the quorum and retry storms.

use serde::{Deserialize, Serialize};

/// Lock keys: which keys lockgate takes over, with what lease, and who may
/// release them. Only keys matching `keys` are ever changed by lockgate.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LocksConfig {
    /// Glob patterns (Redis `KEYS` syntax) of lock keys. A `SETNX` on any
    /// other key passes through untouched (it may be "set a default if
    /// missing" on real data) and is counted by prefix.
    pub keys: Vec<String>,
    /// Lease given to a lock acquired without a TTL (`SETNX`, `SET … NX`),
    /// in milliseconds.
    pub default_lease_ms: u64,
    /// Who may release or extend a lock: `"instance"` (the connection that
    /// acquired it, or any connection of this instance for an acquisition
    /// made through this instance) or `"any"` (legacy: no owner check).
    pub ownership: Ownership,
    /// This sidecar's identity in owner records; must differ between
    /// sidecars. Empty: the hostname and the listen port (`host:6380`).
    pub instance_id: String,
    /// Most lock keys remembered per client connection (the oldest record
    /// is dropped past it, and counted).
    pub max_locks_per_connection: usize,
    /// Most distinct key prefixes counted for `SETNX` outside `keys`.
    pub max_unmatched_prefixes: usize,
    /// Most calls queued on one of lockgate's own connections (to the
    /// primary or a lock master); one more fails at once as overloaded.
    pub max_queued_calls: usize,
    /// Per-pattern settings; the first whose pattern matches a key applies.
    pub overrides: Vec<LockOverride>,
    /// Lock keys on N independent masters with the Redlock quorum; without
    /// masters, lock keys live on the primary.
    pub quorum: QuorumConfig,
    /// Retry storms: how spinning acquisitions are absorbed and parked.
    pub retry: RetryConfig,
    /// Lock libraries' waiters woken when their own wake-up was lost
    /// (`[locks.wake]`, `lock::wake`).
    pub wake: WakeConfig,
    /// After the primary changed (a Sentinel failover), how long
    /// acquisitions of lock keys on the primary are answered "not acquired"
    /// (ms): a lock granted on the old primary may not have reached the new
    /// one. Absent: the longest lease this instance has granted, never less
    /// than `default_lease_ms`. 0: off. Not used with the quorum.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failover_delay_ms: Option<u64>,
    /// Replicas that must hold an acquisition, a takeover or an extension
    /// before its client is told it succeeded (`WAIT`): a lock granted on
    /// a primary that dies before any replica has it is granted again by
    /// the promoted replica. 0: off. Not acknowledged within
    /// `replicas_ack_timeout_ms`, an acquisition or takeover is undone by
    /// its own token and the client told it failed
    /// (`replicas_ack_refusal`). Per pattern in `[[locks.overrides]]`.
    /// One primary (with or without Sentinel), or in front of a cluster
    /// the shard serving the lock's slot; refused with the quorum, whose
    /// masters have no replicas to wait for. Reloadable. At most
    /// `MAX_REPLICAS_ACK`.
    pub replicas_ack: u32,
    /// Longest wait for `replicas_ack` replicas, ms (Redisson's
    /// `slavesSyncTimeout` is 1000). 1 to `MAX_REPLICAS_ACK_TIMEOUT_MS`.
    pub replicas_ack_timeout_ms: u64,
    /// What a client whose acquisition the replicas did not acknowledge
    /// in time gets: `"not_acquired"` (the command's own "not acquired":
    /// `:0`, nil; `SET … NX GET` and a takeover, which have none, get the
    /// error) or `"error"` (`-ERR lockgate: … not acknowledged by …`).
    pub replicas_ack_refusal: AckRefusal,
    /// Ask for the fsync too (`WAITAOF 1 N timeout` in place of `WAIT`,
    /// Redis 7.2 and Valkey): a grant counts as acknowledged only once
    /// the primary's own append-only file and `replicas_ack` replicas'
    /// have it on disk, so a power loss of the whole set keeps it. Needs
    /// `appendonly yes` on the primary and the replicas; a server without
    /// `WAITAOF` or without an append-only file fails every grant as not
    /// acknowledged (the error names why). A replica reports its fsync
    /// with its periodic acknowledgement: a grant may wait up to a second,
    /// so set `replicas_ack_timeout_ms` well above 1000. Reloadable.
    pub replicas_ack_fsync: bool,
    /// Refuse to serve locks where Redis may evict them: while the
    /// primary's `maxmemory-policy` is not `noeviction`, lock acquisitions,
    /// extensions and takeovers on it are answered `-ERR lockgate: locks
    /// refused: maxmemory-policy is … (locks.require_noeviction)` (releases
    /// pass); with the quorum, a master whose policy is not `noeviction`
    /// sits out acquisitions, and one seen evicting keys sits out the
    /// rejoin delay. Ordinary commands always pass. false: only warn.
    /// Reloadable; the policy is read again every `eviction_check_ms`, so a
    /// fixed policy serves locks again without a restart.
    pub require_noeviction: bool,
    /// Refuse lock grants (acquisitions, extensions, takeovers, `LOCKGATE
    /// LOCK`) on a primary that has replicas and no `min-replicas-to-write`
    /// (a primary cut off from its replicas keeps granting what a failover
    /// on their side does not know), or whose replication could not be
    /// read: `-ERR lockgate: locks refused: …
    /// (locks.require_min_replicas)`. Read with the policy; served again
    /// at the first reading that says otherwise. Not used with the quorum.
    /// false: only shown and warned about. Reloadable.
    pub require_min_replicas: bool,
    /// Refuse lock grants on a primary without an append-only file
    /// (`appendonly no`: a restart loses the latest writes, held locks
    /// among them), or whose persistence could not be read: `-ERR
    /// lockgate: locks refused: … (locks.require_persistence)`. Whatever
    /// this says, a primary seen restarting (another `run_id` at its
    /// address) holds acquisitions for `failover_delay_ms`: an append-only
    /// file fsynced every second may lose a second's locks. Not used with
    /// the quorum. Reloadable.
    pub require_persistence: bool,
    /// Refuse lock grants while a primary lockgate followed before a
    /// switch still answers `ROLE` as a primary (a split brain, or a
    /// demoted primary not yet reconfigured: two nodes of the set accept
    /// writes, and a lock granted on one is unknown to the other): `-ERR
    /// lockgate: locks refused on the primary …: the former primary …
    /// still accepts writes (locks.require_one_primary)`; and while a
    /// replica of the primary accepts writes (`replica-read-only no`: its
    /// writes never reach the primary). Asked every `eviction_check_ms`;
    /// served again once it answers as a replica (read-only), or has been
    /// unreachable for 10 minutes. Not used with the quorum. false: only
    /// shown and warned about. Reloadable.
    pub require_one_primary: bool,
    /// How often lockgate reads `maxmemory-policy` and `evicted_keys` of
    /// the primary and of each lock master (ms; one round trip per Redis),
    /// besides at every (re)connection. At least 10.
    pub eviction_check_ms: u64,
    /// Run the uncontended lock cycle with small scripts (`SETNX` on a key
    /// this instance has not seen contended, the release and relative
    /// `EXPIRE` of a lock the connection holds): the same owner check in
    /// the same atomic step, at about a third of Redis's CPU per cycle
    /// (`docs/performance.md`). false: every lock command runs the general
    /// scripts. Reloadable.
    pub fast_path: bool,
    /// On a server that refuses scripts, most connections of lockgate's
    /// own open at once for lock transactions (`WATCH` … `EXEC`, one
    /// transaction per connection at a time); one more waits for a free
    /// one up to `upstream.connect_timeout_ms`, then fails (counted in
    /// `lock_transaction_failures`). 1–1024; opened only when needed.
    pub transaction_connections: usize,
    /// How many times a lock transaction is tried when a watched key
    /// changed between its read and its `EXEC` (another client wrote the
    /// lock); after the last, the command fails with an error and is
    /// counted. 1–1000.
    pub transaction_retries: u32,
    /// Guarded writes (`[[locks.guards]]`): which data each lock protects,
    /// so that a write to it from a holder whose lease ran out is refused
    /// or reported (`docs/guarded-writes.md`). Reloadable; at most
    /// `MAX_GUARDS`.
    pub guards: Vec<GuardConfig>,
    /// With guards configured at start, how long lockgate waits for
    /// Redis's command table (which tells a write from a read) before it
    /// accepts clients, ms: until it is read, a command on guarded data
    /// cannot be checked (refused in `refuse` mode), and a sidecar's app
    /// talks to localhost with no readiness probe in between. Past it,
    /// clients are served and such commands refused until the table is
    /// read; `/readyz` says not ready meanwhile. 0: do not wait. At most
    /// `MAX_GUARD_TABLE_WAIT_MS`.
    pub guard_table_wait_ms: u64,
}

/// Most `locks.guard_table_wait_ms`.
pub const MAX_GUARD_TABLE_WAIT_MS: u64 = 60_000;

/// Most `locks.replicas_ack` (Redis's own `WAIT` takes any number; a
/// primary with more replicas than this is unusual).
pub const MAX_REPLICAS_ACK: u32 = 64;

/// Most `locks.replicas_ack_timeout_ms`.
pub const MAX_REPLICAS_ACK_TIMEOUT_MS: u64 = 60_000;

/// What an acquisition the replicas did not acknowledge in time answers
/// (`locks.replicas_ack_refusal`).
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum AckRefusal {
    /// The command's "not acquired" reply (`:0`, nil), where it has one.
    #[default]
    NotAcquired,
    /// `-ERR lockgate: … not acknowledged by N replicas within T ms`.
    Error,
}

/// Library waiters' wake-ups (`[locks.wake]`): a lock library whose
/// waiters block on a list (python-redis-lock: `BLPOP lock-signal:<name>`)
/// or listen on a channel (Redisson: `redisson_lock__channel:{<name>}`)
/// after a failed attempt sleeps until the holder's release wakes it; a
/// holder that crashed, or whose lease ran out, or a message lost, wakes
/// nobody. lockgate watches such keys and sends the wake-up itself once
/// the lock is free (`lock::wake`).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct WakeConfig {
    /// Lock keys watched at once for waiters blocked on their signal list;
    /// one more is not watched (counted in `lock_wake_keys_full`). 0: off.
    pub max_keys: usize,
    /// How long a key stays watched after a waiter last blocked on its
    /// list, ms, when the wait asked no shorter timeout (`BLPOP … 0` waits
    /// for ever). At least 1000.
    pub listen_max_ms: u64,
    /// Life of the wake-up lockgate pushes, ms (python-redis-lock's
    /// `signal_expire` default): a push nobody took lapses, as the
    /// library's own does. At least 1.
    pub signal_expire_ms: u64,
    /// Connections listed as blocked on one watched key's signal list
    /// (`LOCKGATE WAITERS`); one more is not listed (counted in
    /// `lock_wake_listeners_full`), though it is woken all the same.
    pub max_listeners: usize,
}

impl Default for WakeConfig {
    fn default() -> Self {
        WakeConfig {
            max_keys: 1_024,
            listen_max_ms: 300_000,
            signal_expire_ms: 1_000,
            max_listeners: 64,
        }
    }
}

/// Retry-storm control (`[locks.retry]`): while a lock is known held, spin
/// loops cost Redis almost nothing and the lock is handed over in order.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct RetryConfig {
    /// At most one upstream attempt per key per this interval (ms) while
    /// the key is known held; other attempts are answered "not acquired"
    /// locally. 0: off (every attempt goes upstream).
    pub probe_interval_ms: u64,
    /// How long a failed attempt may wait (ms) for the lock to be released
    /// and handed to it, oldest first; it is answered at once when its
    /// connection sends anything behind it (a pool's or a multiplexed
    /// connection), and such a connection is not parked for
    /// `spin_window_ms`. 0: off (answer at once).
    pub park_ms: u64,
    /// Only a connection evidently spinning on a key is parked: its
    /// previous attempt on the key came less than this long ago (ms). An
    /// isolated try-lock (cron de-duplication, "only one instance runs
    /// this") is answered at once, as by Redis.
    pub spin_window_ms: u64,
    /// Most lock keys tracked at once (the least recently used idle entry
    /// is dropped past it, counted).
    pub max_keys: usize,
    /// Most attempts parked on one key; more are answered at once.
    pub max_waiters_per_key: usize,
    /// Most values of lost attempts one tracked key remembers (8 bytes
    /// each, a hash), so that a lock library's release by such a value
    /// (pottery's clean-up after an attempt it lost) is answered without
    /// Redis; the oldest is dropped past it (counted). 0: off.
    pub max_lost_values_per_key: usize,
    /// One connection attempting one key more often than this per second
    /// gets its "not acquired" replies delayed (smoothing), cut short when
    /// it sends more behind them. 0: off.
    pub max_attempts_per_sec: u64,
    /// Fairness across instances sharing a lock store, in milliseconds:
    /// an instance keeps a lock among its own clients for at most this
    /// divided by the instances waiting for it (its turn), and once the
    /// instance first in the key's queue has waited longer than this, no
    /// other instance acquires the lock or hands it to its own parked
    /// attempts (the store's script refuses, `lock_fairness_yields`) until
    /// that instance has had it. Without it a release hands the lock to
    /// the releasing instance's own waiters first, and another instance's
    /// clients can wait without bound. 0: off (the yield only: failed attempts still take their
    /// places in the key's queue, which decides whom a release wakes);
    /// otherwise at least 10.
    pub max_local_preference_ms: u64,
    /// How long an instance's place in a key's cross-instance queue (in the
    /// lock store) lasts without renewal, ms, times the place's rank (1 to
    /// 64). Every instance renews its place once per a third of its life:
    /// the first in the queue at the probe then due (its other probes of
    /// the held lock are one `PTTL`, and while the holder acquired through
    /// it, it renews none), the others, which wait for their wake-up
    /// instead of probing, then: a waiting instance costs the store one
    /// small script per `rank × this / 3`. A killed sidecar is passed over
    /// at the next release (nobody receives its wake-up); a hung one once
    /// its place, cut to this by the wake-up, lapses and the instance
    /// behind it renews. At least 300, and taken as at least 3 ×
    /// `probe_interval_ms` (of the key's pattern).
    pub queue_ttl_ms: u64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            probe_interval_ms: 100,
            park_ms: 50,
            spin_window_ms: 1_000,
            max_keys: 100_000,
            max_waiters_per_key: 10_000,
            max_lost_values_per_key: 256,
            max_attempts_per_sec: 1_000,
            max_local_preference_ms: 500,
            queue_ttl_ms: 2_000,
        }
    }
}

/// The Redlock quorum (`[locks.quorum]`).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct QuorumConfig {
    /// Lock masters (`HOST:PORT`), independent Redis servers; empty: no
    /// quorum. At least 3; odd recommended (an even N needs N/2+1).
    pub masters: Vec<String>,
    /// Longest wait for one master's answer, in milliseconds; a master that
    /// does not answer in time counts as "no".
    pub node_timeout_ms: u64,
    /// Clock drift allowance, as a fraction of the lease:
    /// validity = lease − elapsed − (lease × drift + 2 ms).
    pub clock_drift_factor: f64,
    /// How long a master that restarted (new run_id) or was unreachable sits
    /// out acquisitions, in milliseconds; one lockgate first sees less than
    /// this after it started sits out the rest. 0: the longest lease
    /// lockgate has granted, never less than `default_lease_ms`. Fencing
    /// tokens assume most voters' clocks are within half of it of true
    /// time (`docs/quorum.md`).
    pub rejoin_delay_ms: u64,
    /// When fewer than a majority of masters can take part in an
    /// acquisition: `"error"` (reply an error) or `"not_acquired"`.
    pub on_quorum_loss: QuorumLoss,
    /// Largest step of one master's clock between two of lockgate's
    /// readings of it (`TIME`, in every acquisition and once a second) that
    /// is not taken for a jump, in milliseconds. A master whose clock jumps
    /// further sits out acquisitions like a restarted one. 0:
    /// `clock_drift_factor × default_lease_ms + 5 ms`.
    pub max_clock_step_ms: u64,
    /// Masters whose clocks may be wrong at once without a lock being
    /// handed out twice: an acquisition needs "yes" from more than
    /// (N + clock_faults) / 2 masters. 0: a plain majority. Less than N.
    pub clock_faults: usize,
    /// TLS to the lock masters (`[locks.quorum.tls]`, the keys of
    /// `[upstream.tls]`); absent: `[upstream.tls]` applies.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<super::ClientTlsConfig>,
}

impl Default for QuorumConfig {
    fn default() -> Self {
        QuorumConfig {
            masters: Vec::new(),
            node_timeout_ms: 50,
            clock_drift_factor: 0.01,
            rejoin_delay_ms: 0,
            on_quorum_loss: QuorumLoss::Error,
            max_clock_step_ms: 0,
            clock_faults: 0,
            tls: None,
        }
    }
}

/// What an acquisition answers without a quorum of masters.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum QuorumLoss {
    /// `-ERR lockgate: lock quorum unavailable (…)`.
    Error,
    /// The command's "not acquired" reply (`:0`, nil).
    NotAcquired,
}

impl Default for LocksConfig {
    fn default() -> Self {
        LocksConfig {
            keys: [
                "lock:*",
                "lock_*",
                "locks:*",
                "*:lock",
                "*:lock:*",
                "*_lock",
                "*:locks:*",
                "mutex:*",
                "*:mutex",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
            default_lease_ms: 30_000,
            ownership: Ownership::Instance,
            instance_id: String::new(),
            max_locks_per_connection: 1_024,
            max_unmatched_prefixes: 1_000,
            max_queued_calls: 10_000,
            overrides: Vec::new(),
            quorum: QuorumConfig::default(),
            retry: RetryConfig::default(),
            wake: WakeConfig::default(),
            failover_delay_ms: None,
            replicas_ack: 0,
            replicas_ack_timeout_ms: 1_000,
            replicas_ack_refusal: AckRefusal::NotAcquired,
            replicas_ack_fsync: false,
            require_noeviction: false,
            require_min_replicas: false,
            require_persistence: false,
            require_one_primary: false,
            eviction_check_ms: 1_000,
            fast_path: true,
            transaction_connections: 8,
            transaction_retries: 16,
            guards: Vec::new(),
            guard_table_wait_ms: 5_000,
        }
    }
}

/// Who may release or extend a lock (see `LocksConfig::ownership`).
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Ownership {
    /// Owner-checked release (the default).
    Instance,
    /// No owner check: plain `DEL`, legacy behaviour.
    Any,
}

/// Settings for lock keys matching one pattern (`[[locks.overrides]]`).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LockOverride {
    /// Glob pattern; should also match one of `locks.keys` to have effect.
    pub pattern: String,
    /// Lease for these keys in milliseconds (0: `default_lease_ms`).
    pub lease_ms: u64,
    /// Renew the lease every lease/3 while the acquiring connection is open
    /// and the lock not released (Redisson's watchdog).
    pub watchdog: bool,
    /// Longest the watchdog keeps a lock alive, in milliseconds.
    pub max_hold_ms: u64,
    /// Release the lock as soon as the acquiring connection closes
    /// (ZooKeeper's ephemeral nodes).
    pub release_on_disconnect: bool,
    /// `locks.retry.probe_interval_ms` for these keys (unset: the global).
    pub probe_interval_ms: Option<u64>,
    /// `locks.retry.park_ms` for these keys (unset: the global).
    pub park_ms: Option<u64>,
    /// `locks.replicas_ack` for these keys (unset: the global; 0: off).
    pub replicas_ack: Option<u32>,
    /// `locks.replicas_ack_timeout_ms` for these keys (unset: the global).
    pub replicas_ack_timeout_ms: Option<u64>,
    /// `locks.replicas_ack_refusal` for these keys (unset: the global).
    pub replicas_ack_refusal: Option<AckRefusal>,
}

impl Default for LockOverride {
    fn default() -> Self {
        LockOverride {
            pattern: String::new(),
            lease_ms: 0,
            watchdog: false,
            max_hold_ms: 300_000,
            release_on_disconnect: false,
            probe_interval_ms: None,
            park_ms: None,
            replicas_ack: None,
            replicas_ack_timeout_ms: None,
            replicas_ack_refusal: None,
        }
    }
}

/// One guard (`[[locks.guards]]`): the data keys a lock protects. A write
/// (by Redis's own command flags) to a key matching `data` is applied only
/// while the lock `lock` names, with the same named parts, is held by the
/// writing connection's acquisition (or, by the pooled rule, one this
/// instance made since the connection opened), checked atomically with
/// the write in Redis.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct GuardConfig {
    /// The lock key pattern, with named parts: `lock:order:{id}`. `{{` and
    /// `}}` are literal braces; no `*`. Must name lock keys (`locks.keys`).
    pub lock: String,
    /// The data key patterns it guards: `["order:{id}", "order:{id}:*"]`.
    /// Every named part appears in `lock`; a `*` may only end a pattern; a
    /// pattern that could match a key another guard's pattern matches is
    /// refused.
    pub data: Vec<String>,
    /// What a write from a holder whose lock is lost gets: `"report"`
    /// (applied, counted and logged: learn first) or `"refuse"` (not
    /// applied: `-ERR lockgate: write refused: …`).
    #[serde(default)]
    pub mode: GuardMode,
    /// Writes from connections that never took the lock (and are not
    /// covered by the pooled rule): `"allow"` (applied, counted as
    /// `unlocked_writer`) or `"refuse"` (refused in `refuse` mode, reported
    /// in `report` mode).
    #[serde(default)]
    pub unlocked_writers: UnlockedWriters,
}

/// Most `[[locks.guards]]`.
pub const MAX_GUARDS: usize = 64;

/// What a guarded write from a holder whose lock is lost gets.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum GuardMode {
    /// Applied, counted (`reported_late`) and logged (rate-limited).
    #[default]
    Report,
    /// Refused with an error naming the lock and why.
    Refuse,
}

/// What a guarded write from a connection that never took the lock gets.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum UnlockedWriters {
    /// Applied and counted.
    #[default]
    Allow,
    /// Refused (in `refuse` mode).
    Refuse,
}
