//! Replica acknowledgement in front of a Redis Cluster: each shard's
//! primary holds the grants of its slots, and `WAIT` counts the replicas
//! of the node it is sent to, so each shard has its own acker, on a
//! connection of lockgate's own to that primary (opened at its first
//! grant), with its own marker key, whose hash tag lands in one of the
//! shard's slots (the marker's `SET` must run on that node, before the
//! `WAIT`). A grant waits on the acker of the shard serving its key in the
//! slot map in force; a change of the map while it waits (a failover, a
//! slot moved) fails it, and it is undone, as a switch of a Sentinel's
//! primary does.
//!
//! Bounded: at most [`MAX_SHARDS`] ackers; a new one drops those whose
//! node no longer serves slots.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::acker::{self, Generation};
use super::{AckError, AckMetrics, MAX_WAITING};
use crate::cluster::slot::key_slot;
use crate::sync;
use crate::upstream::cluster::ClusterPool;
use crate::upstream::node::{Node, NodeConfig};

/// Most shards with an acker at once.
pub const MAX_SHARDS: usize = 1_024;

/// A shard acker's queue and its marker key.
pub(super) type Queue = (mpsc::Sender<acker::Waiter>, Bytes);

/// The shards' ackers, by primary address.
#[derive(Debug, Default)]
pub(super) struct Shards {
    ackers: Mutex<HashMap<String, Queue>>,
}

/// What starting a shard's acker takes from its lock room.
pub(super) struct Start<'a> {
    /// How to reach a node (credentials, TLS, timeout); its address is
    /// replaced by the shard's.
    pub node: &'a NodeConfig,
    /// The marker key's hash tag base (this run's).
    pub run: &'a str,
    /// `locks.replicas_ack_fsync` in force (rounds ask `WAITAOF`).
    pub fsync: Arc<std::sync::atomic::AtomicBool>,
    /// The lock room's round numbers ([`acker::Asks::rounds`]).
    pub rounds: Arc<std::sync::atomic::AtomicU64>,
    /// How much longer than its wait a round's calls may take.
    pub slack: std::time::Duration,
    /// The lock room's acknowledgement counters.
    pub metrics: Arc<AckMetrics>,
    /// The acker ends with it.
    pub stop: CancellationToken,
}

impl Shards {
    /// The queue of the acker of the shard serving `key` in `cluster`'s
    /// map in force, started on first use, and its marker key.
    pub fn queue(
        &self,
        cluster: &Arc<ClusterPool>,
        key: &[u8],
        start: Start<'_>,
    ) -> Result<Queue, AckError> {
        let no_map = || AckError::Upstream("no slot map serves the lock's slot".into());
        let shard = cluster.primary_of(key).ok_or_else(no_map)?;
        let mut ackers = sync::lock(&self.ackers);
        if let Some(queue) = ackers.get(&shard) {
            return Ok(queue.clone());
        }
        let map = cluster.map().ok_or_else(no_map)?;
        if ackers.len() >= MAX_SHARDS {
            ackers.retain(|addr, _| map.shards().iter().any(|s| &s.primary == addr));
        }
        if ackers.len() >= MAX_SHARDS {
            return Err(AckError::Full);
        }
        let on_shard = |tag: &str| {
            let slot = key_slot(format!("{{{tag}}}").as_bytes());
            map.shard_of_slot(slot).is_some_and(|s| s.primary == shard)
        };
        // About as many tries as there are shards: bounded by the slots.
        let tag = (0..=u16::MAX)
            .map(|n| format!("{}-{n}", start.run))
            .find(|t| on_shard(t))
            .ok_or_else(no_map)?;
        let config = NodeConfig {
            addr: shard.clone(),
            follow: None,
            observer: None,
            ..start.node.clone()
        };
        let (tx, rx) = mpsc::channel(MAX_WAITING);
        let conn = Node::spawn(config, start.stop.clone());
        let marker = Bytes::from(format!("lockgate:acked:{{{tag}}}"));
        let asks = acker::Asks {
            marker: marker.clone(),
            fsync: start.fsync,
            slack: start.slack,
            rounds: start.rounds,
        };
        let generation = Generation::Cluster(cluster.clone());
        tokio::spawn(acker::run(
            conn,
            asks,
            generation,
            rx,
            start.metrics,
            start.stop,
        ));
        ackers.insert(shard, (tx.clone(), marker.clone()));
        Ok((tx, marker))
    }
}
