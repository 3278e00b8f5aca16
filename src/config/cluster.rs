//! `[upstream.cluster]`: a Redis Cluster behind lockgate instead of one
//! primary (see `docs/cluster.md`).

use serde::{Deserialize, Serialize};

use super::{invalid, positive, ConfigError};

/// Most redirections one command follows, at most (`max_redirects`).
pub const MAX_REDIRECTS: u32 = 16;

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
    /// How often every node lockgate knows is asked its own slot map and
    /// the answers compared, in milliseconds: slots two nodes name
    /// different primaries for, twice in a row, are named disputed and,
    /// with `locks.require_one_primary`, refused lock grants
    /// (docs/cluster.md). One short connection per node per check (at
    /// most 64 nodes; past it counted in `cluster_views_unasked`), from
    /// every lockgate, hence the default as the map's own re-reading's.
    /// 0: off; else at least 10.
    pub views_check_ms: u64,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            seeds: Vec::new(),
            refresh_interval_ms: 5_000,
            refresh_min_gap_ms: 100,
            max_redirects: 5,
            views_check_ms: 5_000,
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
        if (1..10).contains(&self.views_check_ms) {
            return Err(invalid(
                "upstream.cluster.views_check_ms",
                "must be 0 (off) or at least 10",
            ));
        }
        if !(1..=MAX_REDIRECTS).contains(&self.max_redirects) {
            return Err(invalid(
                "upstream.cluster.max_redirects",
                &format!("must be 1 to {MAX_REDIRECTS}"),
            ));
        }
        Ok(())
    }
}
