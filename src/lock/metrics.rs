//! Counters of the lock room.

use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};

/// What happened to lock keys. Every refusal and every safety signal counts.
#[derive(Debug)]
pub struct LockMetrics {
    /// Seconds from a connection's first attempt on a lock to acquiring it.
    pub wait_seconds: Histogram,
    /// Seconds a lock was held, from acquisition to an owner's release.
    pub hold_seconds: Histogram,
    /// Acquisition attempts on lock keys (SETNX, SET NX).
    pub attempts: AtomicU64,
    /// Attempts that acquired.
    pub acquired: AtomicU64,
    /// Attempts that found the key held.
    pub contended: AtomicU64,
    /// Lock keys released by an owner-checked DEL/UNLINK.
    pub released: AtomicU64,
    /// DEL/UNLINK on a lock key refused: not the owner.
    pub release_denied: AtomicU64,
    /// EXPIRE-family on a lock key refused: not the owner.
    pub extend_denied: AtomicU64,
    /// The acquirer released or extended and found its lease had run out
    /// (the key gone or someone else's): its critical section outlived the
    /// lease. A safety warning.
    pub lease_expired_before_release: AtomicU64,
    /// GETSET / SET / GETDEL / GETEX on a lock key (takeovers).
    pub takeovers: AtomicU64,
    /// PERSIST on a lock key, refused.
    pub persist_refused: AtomicU64,
    /// SETNX / SET NX on keys outside `locks.keys`, passed through.
    pub unmatched_setnx: AtomicU64,
    /// Unmatched prefixes not counted because the table was full.
    pub unmatched_overflow: AtomicU64,
    /// Per-connection lock records dropped because the table was full.
    pub conn_table_evictions: AtomicU64,
    /// Lock commands inside MULTI (outcome not observed by lockgate).
    pub in_transaction: AtomicU64,
    /// Watchdog renewals that extended a lease.
    pub watchdog_renewals: AtomicU64,
    /// Locks released because their connection closed.
    pub released_on_disconnect: AtomicU64,
    /// Quorum operations that failed for want of a majority of masters.
    pub quorum_failures: AtomicU64,
    /// Commands refused because they mix lock keys with other keys (quorum).
    pub mixed_refused: AtomicU64,
    /// Lock commands refused on a connection whose replies cannot be
    /// counted (MONITOR, replication): never passed on unprotected.
    pub raw_refused: AtomicU64,
    /// Releases and extensions refused because the acquisition predates
    /// the connection asking (a holder's late release after its pool
    /// reconnected: the pooled rule).
    pub stale_conn_denied: AtomicU64,
    /// Acquisitions and handoffs held back because another instance has
    /// waited for the lock longer than `max_local_preference_ms`.
    pub fairness_yields: AtomicU64,
}

impl Default for LockMetrics {
    fn default() -> Self {
        // 1 ms to ~33 s, doubling.
        let buckets = || exponential_buckets(0.001, 2.0, 16);
        LockMetrics {
            wait_seconds: Histogram::new(buckets()),
            hold_seconds: Histogram::new(buckets()),
            attempts: AtomicU64::default(),
            acquired: AtomicU64::default(),
            contended: AtomicU64::default(),
            released: AtomicU64::default(),
            release_denied: AtomicU64::default(),
            extend_denied: AtomicU64::default(),
            lease_expired_before_release: AtomicU64::default(),
            takeovers: AtomicU64::default(),
            persist_refused: AtomicU64::default(),
            unmatched_setnx: AtomicU64::default(),
            unmatched_overflow: AtomicU64::default(),
            conn_table_evictions: AtomicU64::default(),
            in_transaction: AtomicU64::default(),
            watchdog_renewals: AtomicU64::default(),
            released_on_disconnect: AtomicU64::default(),
            quorum_failures: AtomicU64::default(),
            mixed_refused: AtomicU64::default(),
            raw_refused: AtomicU64::default(),
            stale_conn_denied: AtomicU64::default(),
            fairness_yields: AtomicU64::default(),
        }
    }
}

/// The quorum's rejoin counters: fence counters copied to returning
/// masters, and sit-outs by reason (clock jumps are counted by the clock
/// watch, `lock_quorum_clock_jumps`). Zero without a quorum.
#[derive(Debug, Default)]
pub struct RejoinMetrics {
    /// Fence counters raised on a returning master by a copy.
    pub counters_copied: AtomicU64,
    /// Copy rounds that admitted a master (it holds the counters again).
    pub copies: AtomicU64,
    /// Copy rounds that failed (the master keeps sitting out; retried).
    pub copy_failures: AtomicU64,
    /// Sit-outs of a master that restarted (new `run_id`).
    pub sit_outs_restarted: AtomicU64,
    /// Sit-outs of a master that reconnected with the same `run_id`.
    pub sit_outs_reconnected: AtomicU64,
    /// Sit-outs of a master lockgate first saw less than the rejoin delay
    /// after it started.
    pub sit_outs_young: AtomicU64,
}
