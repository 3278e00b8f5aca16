//! Lock grants in front of a Redis Cluster whose nodes disagree about the
//! lock's slot ([`crate::upstream::cluster::Dispute`]): with
//! `locks.require_one_primary`, refused (counted in `lock_safety_refused`,
//! logged rate-limited) while the dispute is named, as a second primary
//! of a Sentinel set is; releases always pass. Served again at the first
//! check that finds the nodes agreeing.

use std::sync::atomic::Ordering;

use super::LockService;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;

impl LockService {
    /// The refusal of a lock grant on `key` while the cluster's nodes
    /// disagree about its slot (`None`: served; off unless
    /// `locks.require_one_primary`, one relaxed load then).
    pub(crate) fn refused_for_dispute(&self, key: &[u8]) -> Option<LocalReply> {
        if !self.safety_on.load(Ordering::Relaxed) || self.quorum().is_some() {
            return None;
        }
        let cluster = self.store.primary.cluster.as_ref()?;
        if !self.rules().required.one_primary {
            return None;
        }
        let dispute = cluster.disputed(key)?;
        let text = format!(
            "lockgate: locks refused on slot {}: the cluster's nodes disagree about who serves it ({}) (locks.require_one_primary)",
            crate::cluster::slot::key_slot(key),
            dispute.describe()
        );
        ProxyMetrics::inc(&self.store.eviction().metrics.safety_refused);
        if let Some(more) = self.store.primary_memory.safety.refuse_warn.check() {
            tracing::warn!(reason = %text, suppressed = more, "lock command refused");
        }
        Some(LocalReply::err(text))
    }
}
