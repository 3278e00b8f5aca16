//! The periodic eviction check: every `locks.eviction_check_ms`, each node
//! lockgate keeps a connection to (the primary, and every lock master) is asked
//! its policy and `evicted_keys` on lockgate's own pipelined connection:
//! two commands queued together (`CONFIG GET maxmemory-policy`, or `INFO
//! memory` where CONFIG was refused, and `INFO stats`), one round trip per
//! node per interval, all nodes in parallel, each bounded by the
//! connection timeout. A node that is down is skipped (its next connection
//! reads the policy as it opens). The check is what lets a fixed policy
//! serve locks again without a restart. In the same interval the
//! primary's former primaries are asked their role ([`super::formers`]),
//! and its replicas whether they accept writes ([`super::writable`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{Eviction, Memory};
use crate::metrics::ProxyMetrics;
use crate::sync;
use crate::upstream::node::report::{
    config_get, info_memory, info_persistence, info_replication, info_stats, Sample,
};
use crate::upstream::node::{Node, NodeConfig};

/// Where the primary's former primaries are asked from: connections
/// made as this says (credentials, TLS, timeout), their answers kept in
/// this memory's [`super::safety::SafetyState::formers`].
pub type FormersOf = (NodeConfig, Arc<Memory>);

/// Starts the check of `nodes`, each with the memory its readings go to
/// (each call bounded by `timeout`), and of the `formers`; it stops with
/// `stop`.
pub fn spawn(
    nodes: Vec<(Node, Arc<Memory>)>,
    formers: Option<FormersOf>,
    eviction: Arc<Eviction>,
    timeout: Duration,
    stop: CancellationToken,
) {
    tokio::spawn(async move {
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = run(&nodes, formers.as_ref(), &eviction, timeout) => {}
        }
    });
}

async fn run(
    nodes: &[(Node, Arc<Memory>)],
    formers: Option<&FormersOf>,
    eviction: &Eviction,
    timeout: Duration,
) {
    loop {
        tokio::time::sleep(eviction.check_interval()).await;
        let checks = (nodes.iter()).map(|(n, memory)| check(n, memory, eviction, timeout));
        let formers = async {
            if let Some((template, memory)) = formers {
                tokio::join!(
                    check_formers(template, memory),
                    check_replicas(template, memory)
                );
            }
        };
        tokio::join!(futures_util::future::join_all(checks), formers);
    }
}

/// Asks the primary's replicas whether they accept writes
/// ([`super::writable`]), all in parallel, each bounded by the connect
/// timeout per step; logs (rate-limited) one that does.
async fn check_replicas(template: &NodeConfig, memory: &Memory) {
    let writable = &memory.safety.writable;
    let addrs = writable.addrs();
    let asked = addrs.iter().map(|a| super::writable::ask(template, a));
    let answers = futures_util::future::join_all(asked).await;
    writable.answered(&addrs, &answers);
    if let Some(replica) = writable.writable().first() {
        if let Some(more) = writable.warn.check() {
            tracing::warn!(
                replica = &**replica,
                suppressed = more,
                "a replica of the primary accepts writes (replica-read-only no): a lock key written there is unknown to the primary (see locks.require_one_primary)"
            );
        }
    }
}

/// Asks each former primary in `memory` its role, all in parallel, each
/// bounded by the connect timeout per step; logs (rate-limited) one that
/// still accepts writes.
async fn check_formers(template: &NodeConfig, memory: &Memory) {
    let formers = &memory.safety.formers;
    let addrs = formers.addrs();
    if addrs.is_empty() {
        return;
    }
    let asked = addrs.iter().map(|a| super::formers::ask(template, a));
    let answers = futures_util::future::join_all(asked).await;
    let now = std::time::Instant::now();
    for (addr, answer) in addrs.iter().zip(answers) {
        formers.answered(addr, answer, now);
    }
    if let Some(other) = formers.still_primaries().first() {
        if let Some(more) = formers.warn.check() {
            tracing::warn!(
                former = &**other,
                suppressed = more,
                "a former primary still accepts writes: two nodes of the set are primaries, and a lock granted on one is unknown to the other (see locks.require_one_primary)"
            );
        }
    }
}

/// Reads `node` once and takes note of what it said in `memory`; a
/// reading that straddles a reconnection is dropped (it may be another
/// Redis's).
pub async fn check(node: &Node, memory: &Memory, eviction: &Eviction, timeout: Duration) {
    let state = &node.state;
    if !state.up.load(Ordering::Relaxed) {
        return;
    }
    let connects = state.connects.load(Ordering::Relaxed);
    let by_info = memory.config_refused();
    let first = match by_info {
        true => info_memory(),
        false => config_get(),
    };
    // Both queued before either is awaited: one round trip.
    let first = node.send(first.into(), timeout);
    let stats = node.send(info_stats().into(), timeout);
    let replication = node.send(info_replication().into(), timeout);
    let persistence = node.send(info_persistence().into(), timeout);
    let (first, stats, replication, persistence) =
        tokio::join!(first, stats, replication, persistence);
    let (Ok(first), Ok(stats), Ok(replication), Ok(persistence)) =
        (first, stats, replication, persistence)
    else {
        ProxyMetrics::inc(&eviction.metrics.check_failures);
        return;
    };
    let mut sample = match by_info {
        true => Sample::from_replies(None, Some(&first), &stats),
        false => Sample::from_replies(Some(&first), None, &stats),
    };
    if sample.config_refused {
        // Found refused just now: INFO memory at once, and from now on.
        match node.call(info_memory(), timeout).await {
            Ok(memory) => sample = Sample::from_replies(Some(&first), Some(&memory), &stats),
            Err(_) => {
                ProxyMetrics::inc(&eviction.metrics.check_failures);
                return;
            }
        }
    }
    let unasked = &eviction.metrics.replicas_unasked;
    memory.safety.writable.listed(&replication, unasked);
    let sample = sample.with_safety(&replication, &persistence);
    let run_id = sync::lock(&state.run_id).clone();
    // Dropped if another connection opened meanwhile: its own reading,
    // made as it opened, is the one in force.
    memory.checked(connects, &run_id, &sample);
}
