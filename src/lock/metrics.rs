//! Counters of the lock room.

use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};

use crate::metrics::counters;

/// Histogram buckets for lock waits and holds: 1 ms to ~33 s, doubling.
fn buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.001, 2.0, WAIT_BOUNDS as u16)
}

/// Finite bucket bounds of the wait and hold histograms.
pub const WAIT_BOUNDS: usize = 16;

/// The upper bound of wait bucket `i`, in ms (`None`: the last, unbounded).
pub fn wait_bound_ms(i: usize) -> Option<f64> {
    (i < WAIT_BOUNDS).then(|| 2f64.powi(i as i32))
}

/// Lock waits counted per bucket of [`buckets`] (and one past the last),
/// as plain atomics a reader can take at any time.
#[derive(Debug, Default)]
pub struct WaitBuckets {
    counts: [std::sync::atomic::AtomicU64; WAIT_BOUNDS + 1],
}

impl WaitBuckets {
    /// Counts one wait of `ms` milliseconds.
    pub fn observe_ms(&self, ms: f64) {
        let i = (0..WAIT_BOUNDS)
            .find(|&i| wait_bound_ms(i).is_some_and(|b| ms <= b))
            .unwrap_or(WAIT_BOUNDS);
        self.counts[i].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Every bucket's count now (not cumulative).
    pub fn snapshot(&self) -> [u64; WAIT_BOUNDS + 1] {
        std::array::from_fn(|i| self.counts[i].load(std::sync::atomic::Ordering::Relaxed))
    }
}

counters! {
    /// What happened to lock keys. Every refusal and every safety signal counts.
    pub struct LockMetrics {
        /// Acquisition attempts on lock keys (SETNX, SET NX).
        attempts: Counter "lock_attempts", "Acquisition attempts on lock keys";
        /// Acquisition attempts lockgate sent to the store: the clients'
        /// attempts not answered early (absorbed, parked, refused, held),
        /// and the calls parked attempts' drivers made. Against
        /// `lock_attempts`: the storm absorbed.
        attempts_sent: Counter "lock_attempts_sent",
            "Acquisition attempts sent to the store (client attempts not answered early, and parked attempts' driver calls)";
        /// Attempts that acquired.
        acquired: Counter "lock_acquired", "Attempts that acquired";
        /// Shared (read) locks granted (`LOCKGATE LOCK … SHARED`).
        shared_grants: Counter "lock_shared_grants", "Shared (read) locks granted";
        /// Exclusive locks granted to an owner (`LOCKGATE LOCK … OWNER`).
        owned_grants: Counter "lock_owned_grants", "Exclusive locks granted to an owner (reentrant)";
        /// Semaphore permits granted (`LOCKGATE ACQUIRE`).
        permit_grants: Counter "lock_permit_grants", "Semaphore permits granted";
        /// An owner's entries again into what it holds (reentrant counts up).
        reentries: Counter "lock_reentries", "An owner's entries again into a lock or permit it holds";
        /// Multi-key locks granted, every key (`LOCKGATE LOCK k1 k2 …`).
        multi_grants: Counter "lock_multi_grants", "Multi-key locks granted (every key)";
        /// `MSETNX` on lock keys that acquired every key.
        msetnx_grants: Counter "lock_msetnx_grants", "MSETNX on lock keys that acquired every key";
        /// Attempts that found the key held.
        contended: Counter "lock_contended", "Attempts that found the lock held";
        /// Lock commands refused in front of a Redis Cluster (not served there yet).
        refused_on_cluster: Counter "lock_refused_on_cluster", "Lock commands refused in front of a Redis Cluster: a lock key whose records cannot share its hash slot, or nodes that refuse scripts";
        /// Guard records (guarded writes with the quorum) the primary did
        /// not take: that holder's guarded writes are refused until it
        /// acquires again.
        guard_record_failures: Counter "lock_guard_record_failures", "Guard records on the primary not written (guarded writes with the quorum)";
        /// Lock keys released by an owner-checked DEL/UNLINK.
        released: Counter "lock_released", "Locks released by an owner-checked DEL";
        /// DEL/UNLINK on a lock key refused: not the owner.
        release_denied: Counter "lock_release_denied", "Releases refused: not the owner";
        /// EXPIRE-family on a lock key refused: not the owner.
        extend_denied: Counter "lock_extend_denied", "Extensions refused: not the owner";
        /// The acquirer released or extended and found its lease had run out
        /// (the key gone or someone else's): its critical section outlived the
        /// lease. A safety warning.
        lease_expired_before_release: Counter "lock_lease_expired_before_release",
            "Holder found its lease gone at release: critical section outlived the lease";
        /// GETSET / SET / GETDEL / GETEX on a lock key (takeovers).
        takeovers: Counter "lock_takeovers", "GETSET/SET/GETDEL/GETEX on lock keys";
        /// PERSIST on a lock key, refused.
        persist_refused: Counter "lock_persist_refused", "PERSIST on lock keys, refused";
        /// SETNX / SET NX on keys outside `locks.keys`, passed through.
        unmatched_setnx: Counter "lock_unmatched_setnx",
            "SETNX on keys outside locks.keys, passed through";
        /// Unmatched prefixes not counted because the table was full.
        unmatched_overflow: Counter "lock_unmatched_overflow",
            "Unmatched SETNX prefixes not counted because the table was full";
        /// Per-connection lock records dropped because the table was full.
        conn_table_evictions: Counter "lock_table_evictions",
            "Per-connection lock records dropped (table full)";
        /// Lock commands the server refused because it refuses scripts
        /// (`EVAL`/`EVALSHA` renamed away, or an ACL without them).
        scripts_refused: Counter "lock_scripts_refused",
            "Lock commands refused: the server refuses lockgate's scripts (EVAL/EVALSHA renamed or denied)";
        /// Acquisitions sent as a native command (`MSETEX`).
        native_calls: Counter "lock_native_calls",
            "Acquisitions sent as a native command (MSETEX) instead of a script";
        /// Native acquisitions run again as the general script: `MSETEX`
        /// found a key (held, or a stale owner record), or the server
        /// refused it.
        native_reruns: Counter "lock_native_reruns",
            "Native acquisitions run again as the general script (a key found, or the command refused)";
        /// Probes of a lock known held sent as a plain `PTTL` in an
        /// attempt's place (a retry storm's cost to Redis: one command).
        checks: Counter "lock_checks",
            "Probes of a lock known held sent as a plain PTTL instead of the acquisition script";
        /// Those that found the lock free: the acquisition ran in the
        /// attempt's place on lockgate's own connection.
        check_reruns: Counter "lock_check_reruns",
            "Plain probes that found the lock free, the acquisition run in their place";
        /// Lock commands run as a fast script (see `locks.fast_path`).
        fast_calls: Counter "lock_fast_calls",
            "Lock commands run as a fast script (uncontended cycle, locks.fast_path)";
        /// Lock commands inside MULTI (outcome not observed by lockgate).
        in_transaction: Counter "lock_in_transaction",
            "Lock commands inside MULTI (outcome not observed by lockgate)";
        /// Watchdog renewals that extended a lease.
        watchdog_renewals: Counter "lock_watchdog_renewals", "Lease renewals by the watchdog";
        /// Locks released because their connection closed.
        released_on_disconnect: Counter "lock_released_on_disconnect",
            "Locks released because their connection closed";
        /// Locks an operator released (`LOCKGATE RELEASE`).
        operator_released: Counter "lock_operator_released",
            "Locks an operator released with LOCKGATE RELEASE";
        /// `LOCKGATE RELEASE` that released nothing: the acquisition the
        /// operator named no longer held the lock.
        operator_release_stale: Counter "lock_operator_release_stale",
            "LOCKGATE RELEASE of an acquisition that no longer held the lock";
        /// Quorum operations that failed for want of a majority of masters.
        quorum_failures: Counter "lock_quorum_failures",
            "Operations without a majority of masters";
        /// Commands refused because they mix lock keys with other keys (quorum).
        mixed_refused: Counter "lock_mixed_refused",
            "Commands refused for mixing lock and other keys";
        /// Lock commands refused on a connection whose replies cannot be
        /// counted (MONITOR, replication): never passed on unprotected.
        raw_refused: Counter "lock_raw_refused",
            "Lock commands refused on a connection in MONITOR or replication mode";
        /// Releases and extensions refused because the acquisition predates
        /// the connection asking (a holder's late release after its pool
        /// reconnected: the pooled rule).
        stale_conn_denied: Counter "lock_stale_conn_denied",
            "Releases and extensions refused because the acquisition predates the connection";
        /// Acquisitions and handoffs held back because another instance has
        /// waited for the lock longer than `max_local_preference_ms`.
        fairness_yields: Counter "lock_fairness_yields",
            "Acquisitions and handoffs held back for another instance waiting past max_local_preference_ms";
        /// Places in a key's cross-instance queue dropped by this
        /// instance's scripts because their instance stopped renewing them
        /// (it died, or stopped waiting without passing its turn).
        queue_places_lapsed: Counter "lock_queue_places_lapsed",
            "Places in a key's cross-instance queue dropped because their instance stopped renewing them";
        /// Lock scripts Redis answered `NOSCRIPT` (its script cache was
        /// flushed) and lockgate ran again as `EVAL` on its own connection:
        /// commands the client pipelined after them ran first.
        noscript_reruns: Counter "lock_noscript_reruns",
            "Lock scripts run again after NOSCRIPT (Redis's script cache was flushed)";
        /// Commands forwarded as they are that changed lock keys or the
        /// script cache behind the lock room's back (`FLUSHDB`, `FLUSHALL`,
        /// `SWAPDB`, `RENAME`/`RENAMENX`/`COPY`/`MOVE` of or onto lock keys,
        /// `SCRIPT FLUSH`, a client script that lists keys, a transaction
        /// with one): what lockgate knew of
        /// them was dropped once Redis acknowledged it.
        view_forgets: Counter "lock_view_forgets",
            "Forwarded commands that changed lock keys or scripts behind lockgate (flushes, SWAPDB, RENAME, COPY, MOVE, SCRIPT FLUSH, a script listing keys): its view of them dropped";
        /// Key-listing client scripts not remembered because
        /// `forget::MAX_LISTING_SCRIPTS` were already: an `EVALSHA` of one
        /// leaves the view as it was.
        listing_scripts_full: Counter "lock_listing_scripts_full",
            "Key-listing client scripts not remembered (the table of them was full): their EVALSHA leaves lockgate's view stale up to probe_interval_ms";
        /// Owner-record reconciliations after a client's own script on
        /// lock keys, done (whatever they found; `LockService::reconcile`).
        script_reconciles: Counter "lock_script_reconciles",
            "Owner-record reconciliations done after a client's own script on lock keys, whatever they found";
        /// Owner records dropped after a client's own script deleted their
        /// lock key (a lock library's release, see `LockService::reconcile`).
        script_releases: Counter "lock_script_releases",
            "Owner records dropped after a client's own script (a lock library's release) deleted their lock key";
        /// Owner records whose expiry followed the lease a client's own
        /// script gave their lock key (a lock library's extension).
        script_extensions: Counter "lock_script_extensions",
            "Owner records whose expiry followed the lease a client's own script (a lock library's extension) gave their lock key";
        /// Lock keys a client's own script acquired (a lease, no owner
        /// record, a value or hash field the script was given), given an
        /// owner record and held by its connection (`LockService::reconcile`).
        script_adoptions: Counter "lock_script_adoptions",
            "Lock keys a client's own script acquired (node-redlock's multi-key acquisition), given an owner record and held by its connection";
        /// A lock library's release script carried out by lockgate as a
        /// release by value (`crate::router::library`): one call instead
        /// of the script and a reconciliation, and a handoff to a parked
        /// attempt in the same step.
        library_releases: Counter "lock_library_releases",
            "Lock libraries' release scripts (redis-py, pottery, node-redlock) carried out by lockgate as a release by value";
        /// Of those, answered 0 without Redis: the value was the one the
        /// connection's latest attempt on the key lost with, and the key
        /// is still known held (pottery's clean-up after a lost attempt).
        library_releases_answered: Counter "lock_library_releases_answered",
            "Lock libraries' releases by value answered 0 without Redis: the value of the connection's own attempt that just lost, the key still known held";
        /// Reconciliations after a client's script that failed (the store
        /// did not answer in time, or refused): the owner record keeps
        /// its own expiry.
        script_reconcile_failures: Counter "lock_script_reconcile_failures",
            "Owner-record reconciliations after a client's script that failed (store down, timed out or refusing); the record keeps its own expiry";
        /// Wake-ups lockgate pushed to a lock library's signal list: the
        /// key was free, its list empty, a waiter blocked on it (`wake`).
        wake_pushes: Counter "lock_wake_pushes",
            "Wake-ups pushed to a lock library's signal list whose lock was free and list empty (a lost wake-up)";
        /// Watched keys looked at out of turn: a client's script released
        /// one while an attempt on it was answered "not acquired" from
        /// what lockgate knew, which may have been stale (`wake`).
        wake_rechecks: Counter "lock_wake_rechecks",
            "Watched lock keys looked at at once: released by a client's script while an attempt on them was answered not acquired from a possibly stale view";
        /// Keys not watched for library waiters because
        /// `locks.wake.max_keys` were watched already.
        wake_keys_full: Counter "lock_wake_keys_full",
            "Lock keys not watched for library waiters: locks.wake.max_keys were already";
        /// Connections not listed as waiting on a watched key because
        /// `locks.wake.max_listeners` were already (they are woken all the
        /// same).
        wake_listeners_full: Counter "lock_wake_listeners_full",
            "Connections blocked on a watched key's signal list not listed in LOCKGATE WAITERS: locks.wake.max_listeners were already";
    }
    other {
        /// Seconds from a connection's first attempt on a lock to acquiring it.
        wait_seconds: Histogram = Histogram::new(buckets());
        /// The same waits in the same buckets, readable (the status page's
        /// history takes each interval's quantiles from their growth).
        wait_buckets: WaitBuckets = WaitBuckets::default();
        /// Seconds a lock was held, from acquisition to an owner's release.
        hold_seconds: Histogram = Histogram::new(buckets());
    }
}

counters! {
    /// The quorum's rejoin counters: sit-outs by reason (clock jumps are
    /// counted by the clock watch, `lock_quorum_clock_jumps`). Zero
    /// without a quorum.
    pub struct RejoinMetrics {
        /// Sit-outs of a master that restarted (new `run_id`).
        sit_outs_restarted: Counter "lock_quorum_sit_outs_restarted",
            "Lock master sit-outs after a restart (new run_id)";
        /// Sit-outs of a master that reconnected with the same `run_id`.
        sit_outs_reconnected: Counter "lock_quorum_sit_outs_reconnected",
            "Lock master sit-outs after a reconnection (same run_id)";
        /// Sit-outs of a master lockgate first saw less than the rejoin delay
        /// after it started.
        sit_outs_young: Counter "lock_quorum_sit_outs_young",
            "Lock master sit-outs at first sight, started less than the rejoin delay before";
        /// Sit-outs of a master whose `maxmemory-policy` may evict lock
        /// keys (`locks.require_noeviction`), until it reads `noeviction`.
        sit_outs_evicting: Counter "lock_quorum_sit_outs_evicting",
            "Lock master sit-outs for a maxmemory-policy that may evict lock keys (locks.require_noeviction)";
        /// Sit-outs of the rejoin delay of a master seen evicting keys
        /// (`locks.require_noeviction`).
        sit_outs_evicted: Counter "lock_quorum_sit_outs_evicted",
            "Lock master sit-outs of the rejoin delay after it evicted keys (locks.require_noeviction)";
    }
}
