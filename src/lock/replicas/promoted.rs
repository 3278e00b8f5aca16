//! In front of a Redis Cluster: after a shard's failover, which
//! acquisitions of its slots the failover hold may let through at once,
//! the shard's counterpart of [`super::switch`].
//!
//! A shard's acker sets a marker key whose slot is one of the shard's
//! ([`super::shards`]), after the grants each round covers, so the
//! replica promoted in that shard's place, which serves the same slots,
//! holds the marker too. The first acquisition of a promoted node's
//! slots that asks after the failover starts one check of that node
//! (`GET` of each marker it serves): it is vouched for when, for every
//! acknowledged grant of this instance whose lease still runs and whose
//! slot it serves, the marker that acknowledged it is on that node with
//! at least its round ([`super::switch::needs`]). A grant of its slots
//! acknowledged through a marker it does not serve (a slot migrated
//! since) refutes it. Then [`super::switch::unheld`] rules as after a
//! Sentinel switch, the promotion's time as the switch's.
//!
//! Bounded: one check per promoted node the cluster's map still names
//! (its shards).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::switch::{needs, Vouch};
use crate::cluster::slot::key_slot;
use crate::sync;
use crate::upstream::cluster::ClusterPool;

/// The check after each shard's failover: by promoted node, when it was
/// promoted and what the check concluded.
#[derive(Debug, Default)]
pub(super) struct Checks(Mutex<HashMap<String, (Instant, Vouch)>>);

impl Checks {
    /// The check's state for `node` promoted `at`, and whether the caller
    /// must start it (the first to ask); checks of nodes `cluster` no
    /// longer names promoted are dropped.
    fn vouch_for(&self, cluster: &ClusterPool, node: &str, at: Instant) -> (Vouch, bool) {
        let mut checks = sync::lock(&self.0);
        if let Some((when, vouch)) = checks.get(node) {
            if *when == at {
                return (*vouch, false);
            }
        }
        checks.retain(|n, (when, _)| cluster.promoted_at(n) == Some(*when));
        checks.insert(node.to_string(), (at, Vouch::Pending));
        (Vouch::Pending, true)
    }

    /// Records the check's conclusion for `node` promoted `at`.
    fn concluded(&self, node: &str, at: Instant, vouch: Vouch) {
        let mut checks = sync::lock(&self.0);
        if let Some((when, v)) = checks.get_mut(node) {
            if *when == at {
                *v = vouch;
            }
        }
    }
}

impl crate::lock::LockService {
    /// While a shard's failover hold runs: whether an acquisition of
    /// `key` goes on all the same ([`super::switch::unheld`]); counted. The first to ask
    /// after the failover starts the check of the promoted node (bounded:
    /// twice `upstream.connect_timeout_ms`), and the hold applies until it
    /// concludes.
    pub(crate) fn unheld_after_promotion(&self, cluster: &Arc<ClusterPool>, key: &[u8]) -> bool {
        if self.ack_rule(key).is_none() {
            return false;
        }
        let Some(map) = cluster.map() else {
            return false;
        };
        let Some(node) = map.shard_of_key(key).map(|s| s.primary.clone()) else {
            return false;
        };
        let Some(at) = cluster.promoted_at(&node) else {
            return false;
        };
        let store = self.store();
        let replicas = &store.replicas;
        let (vouch, start) = replicas.shard_checks.vouch_for(cluster, &node, at);
        if start {
            let serves = |slot: u16| map.shard_of_slot(slot).is_some_and(|s| s.primary == node);
            let needed = {
                let recent = sync::lock(&replicas.recent);
                needs(&recent, Instant::now(), serves, |m| serves(key_slot(m)))
            };
            let (r, on, within) = (replicas.clone(), store.primary.clone(), store.timeout() * 2);
            tokio::spawn(async move {
                let vouch = r.check(&on, needed, within).await;
                r.shard_checks.concluded(&node, at, vouch);
            });
        }
        replicas.let_through(vouch, at, self.failover_delay())
    }
}
