//! `[upstream.cluster]`: a Redis Cluster behind lockgate instead of one
//! primary (see `docs/cluster.md`).

use serde::{Deserialize, Serialize};

use super::{invalid, positive, ConfigError};

/// Most redirections one command follows, at most (`max_redirects`).
pub const MAX_REDIRECTS: u32 = 16;

/// Smallest `lock_reply_timeout_ms` other than 0 (off): below a scheduler
/// hiccup on a loaded host, healthy connections would be taken for lost.
pub const MIN_LOCK_REPLY_TIMEOUT_MS: u64 = 50;

/// A Redis Cluster behind lockgate (`[upstream.cluster]`).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// Nodes to read the slot map from first (`HOST:PORT`), asked in
    /// order; later the nodes of the last map are asked too. Empty: not a
    /// cluster (`upstream.addr` or `[upstream.sentinel]` is the primary).
    /// Also `--upstream-cluster HOST:PORT,…`.
    pub seeds: Vec<String>,
    /// How often the slot map is read again without a redirection, in
    /// milliseconds: a change lockgate was not redirected by (a new node,
    /// a failover nobody sent a command through) is seen within this.
    pub refresh_interval_ms: u64,
    /// The least time between two readings of the slot map, in
    /// milliseconds: a storm of `MOVED` replies reads it once per gap.
    pub refresh_min_gap_ms: u64,
    /// Most redirections (`MOVED`, `ASK`) one command follows before its
    /// client is answered with the last one as an error (1 to 16).
    pub max_redirects: u32,
    /// Longest a node's connection may go without a byte of reply while a
    /// lock command (lockgate's own script call for `SETNX`, `SET … NX`,
    /// a release) waits on it, in milliseconds; past it the connection is
    /// taken for lost: every reply owed on it is answered `-ERR lockgate:
    /// upstream … unavailable (connection lost: …)` and it is opened
    /// again. A node that accepts and never answers (a blackholed path)
    /// would otherwise hold lock commands for as long as it lasts
    /// (docs/faults.md, "Partitions"). 0: no bound, as on a plain
    /// connection; otherwise at least 50.
    pub lock_reply_timeout_ms: u64,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            seeds: Vec::new(),
            refresh_interval_ms: 5_000,
            refresh_min_gap_ms: 100,
            max_redirects: 5,
            lock_reply_timeout_ms: 2_000,
        }
    }
}

impl ClusterConfig {
    /// True when a cluster is behind lockgate.
    pub fn enabled(&self) -> bool {
        !self.seeds.is_empty()
    }

    /// Checks the section; errors name the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self
            .seeds
            .iter()
            .any(|a| a.trim().is_empty() || !a.contains(':'))
        {
            return Err(invalid(
                "upstream.cluster.seeds",
                "expected HOST:PORT entries",
            ));
        }
        positive(
            "upstream.cluster.refresh_interval_ms",
            self.refresh_interval_ms,
        )?;
        positive(
            "upstream.cluster.refresh_min_gap_ms",
            self.refresh_min_gap_ms,
        )?;
        if self.refresh_min_gap_ms > self.refresh_interval_ms {
            return Err(invalid(
                "upstream.cluster.refresh_min_gap_ms",
                "must not exceed upstream.cluster.refresh_interval_ms",
            ));
        }
        if !(1..=MAX_REDIRECTS).contains(&self.max_redirects) {
            return Err(invalid(
                "upstream.cluster.max_redirects",
                &format!("must be 1 to {MAX_REDIRECTS}"),
            ));
        }
        if (1..MIN_LOCK_REPLY_TIMEOUT_MS).contains(&self.lock_reply_timeout_ms) {
            return Err(invalid(
                "upstream.cluster.lock_reply_timeout_ms",
                &format!("must be 0 (no bound) or at least {MIN_LOCK_REPLY_TIMEOUT_MS}"),
            ));
        }
        Ok(())
    }

    /// `lock_reply_timeout_ms` as a duration; `None` when off.
    pub fn lock_reply_timeout(&self) -> Option<std::time::Duration> {
        (self.lock_reply_timeout_ms > 0)
            .then(|| std::time::Duration::from_millis(self.lock_reply_timeout_ms))
    }
}
