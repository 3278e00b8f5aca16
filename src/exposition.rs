//! Prometheus exposition: the counters every room keeps (plain atomics on
//! the hot path, declared once with their names in each room's
//! `counters!` table, the same table `LOCKGATE STATS` walks) are read at
//! scrape time by a collector and encoded with `prometheus-client`,
//! together with the lock wait and hold histograms, the per-command and
//! per-master families and the hot keys.
//! Label sets are bounded: commands by a fixed table, lock keys only for
//! the top-K hot keys, masters by configuration.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::command;
use crate::context::ServerContext;
use crate::lock::hotkeys::{HotKey, Spread};
use crate::lock::quorum::MasterState;
use crate::metrics::{Kind, ProxyMetrics};

/// The whole `/metrics` text.
pub fn render(ctx: &Arc<ServerContext>) -> Result<String, std::fmt::Error> {
    let mut registry = Registry::with_prefix("lockgate");
    registry.register(
        "lock_wait_seconds",
        "Time from a connection's first attempt on a lock to acquiring it",
        ctx.locks.metrics.wait_seconds.clone(),
    );
    registry.register(
        "lock_hold_seconds",
        "Time a lock was held, from acquisition to release",
        ctx.locks.metrics.hold_seconds.clone(),
    );
    registry.register_collector(Box::new(Counters(ctx.clone())));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry)?;
    Ok(text)
}

/// Each hot key's waits and holds, as histograms labelled by key: for
/// every lock, a legacy `SETNX` or a library's `SET NX PX` alike, where
/// `lock_wait_seconds` and `lock_hold_seconds` sum them all. Only the
/// top-K keys (`admin.hot_keys`) have series, so the label set is bounded;
/// each counts since its key entered the sketch (see `lock::hotkeys`).
fn hot_histograms(hot: &[HotKey], e: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
    type Family = (&'static str, &'static str, fn(&HotKey) -> &Spread);
    let families: [Family; 2] = [
        (
            "lock_key_wait_seconds",
            "Time from a connection's first attempt on a hot lock key to acquiring it, by key (top-K keys, ms resolution)",
            |h| &h.waits,
        ),
        (
            "lock_key_hold_seconds",
            "Time a hot lock key was held, acquisition to release, by key (top-K keys, ms resolution)",
            |h| &h.holds,
        ),
    ];
    for (name, help, spread) in families {
        let mut fam = e.encode_descriptor(name, help, None, MetricType::Histogram)?;
        for h in hot {
            let key = String::from_utf8_lossy(&h.key).into_owned();
            let labels = [("key", key.as_str())];
            let s = spread(h);
            let sum = s.sum_ms as f64 / 1000.0;
            fam.encode_family(&labels)?
                .encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                    sum,
                    s.count(),
                    &s.bounds(),
                    None,
                )?;
        }
    }
    Ok(())
}

/// Reads the rooms' counters at scrape time.
struct Counters(Arc<ServerContext>);

impl std::fmt::Debug for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Counters")
    }
}

fn counter(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    v: &AtomicU64,
) -> Result<(), std::fmt::Error> {
    let m = e.encode_descriptor(name, help, None, MetricType::Counter)?;
    ConstCounter::new(ProxyMetrics::get(v)).encode(m)
}

fn gauge(e: &mut DescriptorEncoder, name: &str, help: &str, v: i64) -> Result<(), std::fmt::Error> {
    let m = e.encode_descriptor(name, help, None, MetricType::Gauge)?;
    ConstGauge::new(v).encode(m)
}

impl Collector for Counters {
    fn encode(&self, mut e: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let ctx = &self.0;
        let p = &ctx.metrics;
        let mut walked = Ok(());
        ctx.each_counter(|c| {
            if walked.is_ok() {
                walked = match c.kind {
                    Kind::Counter => counter(&mut e, c.name, c.help, c.value),
                    Kind::Gauge => gauge(&mut e, c.name, c.help, ProxyMetrics::get(c.value) as i64),
                    Kind::TimestampMs => e
                        .encode_descriptor(c.name, c.help, None, MetricType::Gauge)
                        .and_then(|m| {
                            ConstGauge::new(ProxyMetrics::get(c.value) as f64 / 1000.0).encode(m)
                        }),
                };
            }
        });
        walked?;
        {
            let mut fam = e.encode_descriptor(
                "commands",
                "Client commands by name (bounded set)",
                None,
                MetricType::Counter,
            )?;
            for (i, name) in command::LABELS.iter().enumerate() {
                let n = ProxyMetrics::get(&p.commands[i]);
                if n > 0 {
                    let labels = [("command", *name)];
                    ConstCounter::new(n).encode(fam.encode_family(&labels)?)?;
                }
            }
        }
        gauge(
            &mut e,
            "tasks_alive",
            "Tokio tasks alive, summed over every event loop",
            ctx.tasks_alive() as i64,
        )?;
        {
            let m = e.encode_descriptor(
                "lock_oldest_wait_seconds",
                "How long the attempt parked longest on this instance has waited since its connection first tried (0: none parked)",
                None,
                MetricType::Gauge,
            )?;
            ConstGauge::new(ctx.locks.storm.oldest_wait().as_secs_f64()).encode(m)?;
        }
        gauge(
            &mut e,
            "lock_tracked_keys",
            "Lock keys in the contention table",
            ctx.locks.storm.len() as i64,
        )?;
        {
            let hot = ctx.locks.hot.top(ctx.config.admin.hot_keys);
            let mut fam = e.encode_descriptor(
                "hot_lock_attempts",
                "Attempts on the hottest lock keys (top-K estimate)",
                None,
                MetricType::Counter,
            )?;
            for h in &hot {
                let key = String::from_utf8_lossy(&h.key).into_owned();
                let labels = [("key", key.as_str())];
                ConstCounter::new(h.count).encode(fam.encode_family(&labels)?)?;
            }
            hot_histograms(&hot, &mut e)?;
        }
        eviction_families(ctx, &mut e)?;
        guard_families(ctx, &mut e)?;
        if let Some(q) = ctx.locks.quorum() {
            let mut up = e.encode_descriptor(
                "master_up",
                "Lock master connected and taking part (1) or not (0)",
                None,
                MetricType::Gauge,
            )?;
            for m in &q.masters {
                let v = i64::from(m.state() == MasterState::Up);
                let labels = [("master", m.node.addr())];
                ConstGauge::new(v).encode(up.encode_family(&labels)?)?;
            }
            let mut state = e.encode_descriptor(
                "master_state",
                "Lock master state: 1 for the state it is in",
                None,
                MetricType::Gauge,
            )?;
            for m in &q.masters {
                let now = match m.state() {
                    MasterState::Up => "up",
                    MasterState::SittingOut(..) => "sitting_out",
                    MasterState::Down => "down",
                };
                for s in ["up", "sitting_out", "down"] {
                    let labels = [("master", m.node.addr()), ("state", s)];
                    ConstGauge::new(i64::from(s == now)).encode(state.encode_family(&labels)?)?;
                }
            }
            let mut rejoin = e.encode_descriptor(
                "master_rejoin_seconds",
                "Seconds until a returning master counts again",
                None,
                MetricType::Gauge,
            )?;
            for m in &q.masters {
                let left = match m.state() {
                    MasterState::SittingOut(d, _) => d.as_secs_f64(),
                    _ => 0.0,
                };
                let labels = [("master", m.node.addr())];
                ConstGauge::new(left).encode(rejoin.encode_family(&labels)?)?;
            }
            let mut errors = e.encode_descriptor(
                "master_errors",
                "Calls to a lock master that timed out or failed",
                None,
                MetricType::Counter,
            )?;
            for m in &q.masters {
                let st = &m.node.state;
                let n = ProxyMetrics::get(&st.timeouts) + ProxyMetrics::get(&st.failures);
                let labels = [("master", m.node.addr())];
                ConstCounter::new(n).encode(errors.encode_family(&labels)?)?;
            }
        }
        if let Some(cluster) = &ctx.cluster {
            cluster_families(&cluster.nodes(ctx.locks.failover_delay()), &mut e)?;
        }
        Ok(())
    }
}

/// In front of a Redis Cluster, per primary of the slot map in force
/// (one series each, bounded by the cluster's size): whether lockgate
/// reaches it, and how long its slots' lock acquisitions are still held
/// back after a failover promoted it.
fn cluster_families(
    nodes: &[crate::upstream::cluster::NodeView],
    e: &mut DescriptorEncoder,
) -> Result<(), std::fmt::Error> {
    let mut up = e.encode_descriptor(
        "cluster_node_up",
        "Cluster primary reachable by lockgate (1) or not (0)",
        None,
        MetricType::Gauge,
    )?;
    for n in nodes {
        let labels = [("node", n.addr.as_str())];
        ConstGauge::new(i64::from(n.up)).encode(up.encode_family(&labels)?)?;
    }
    let mut hold = e.encode_descriptor(
        "cluster_node_failover_hold_seconds",
        "Seconds a promoted cluster primary's lock acquisitions are still held back (0: none)",
        None,
        MetricType::Gauge,
    )?;
    for n in nodes {
        let labels = [("node", n.addr.as_str())];
        ConstGauge::new(n.held_ms as f64 / 1000.0).encode(hold.encode_family(&labels)?)?;
    }
    Ok(())
}

/// Guarded writes (`[[locks.guards]]`) by guard (its lock pattern) and
/// outcome; declared without samples when no guard is configured, so
/// dashboards and alerts on it always find the family.
fn guard_families(ctx: &ServerContext, e: &mut DescriptorEncoder) -> std::fmt::Result {
    let guards = ctx.locks.guard_counts();
    let mut fam = e.encode_descriptor(
        "guarded_writes",
        "Writes to guarded data by guard and outcome (applied, refused, reported_late, unlocked_writer, unchecked)",
        None,
        MetricType::Counter,
    )?;
    for (lock, _, counts) in &guards {
        for (outcome, n) in counts.each() {
            let labels = [("guard", lock.as_str()), ("outcome", outcome)];
            ConstCounter::new(n).encode(fam.encode_family(&labels)?)?;
        }
    }
    Ok(())
}

/// Where lock keys live (the primary, or each lock master): its
/// `maxmemory-policy` by name (one series per node, the policy as a label,
/// `unknown` until read) and the growth of its `evicted_keys` lockgate saw.
fn eviction_families(ctx: &ServerContext, e: &mut DescriptorEncoder) -> std::fmt::Result {
    let primary_addr = match ctx.primary_memory.reading() {
        Some(r) => r.addr.to_string(),
        None => (ctx.primary_addr.addr())
            .map_or_else(|| ctx.primary.addr().to_string(), |a| a.to_string()),
    };
    let mut nodes: Vec<(&str, String, String, u64)> = Vec::new();
    match ctx.locks.quorum() {
        None => nodes.push((
            "primary",
            primary_addr,
            crate::admin::views::primary_policy(ctx),
            ProxyMetrics::get(&ctx.primary_memory.evicted),
        )),
        Some(q) => nodes.extend(q.masters.iter().map(|m| {
            let memory = &m.memory;
            (
                "master",
                m.node.addr().to_string(),
                memory.policy_name(),
                ProxyMetrics::get(&memory.evicted),
            )
        })),
    }
    let mut policy = e.encode_descriptor(
        "upstream_maxmemory_policy",
        "maxmemory-policy of each Redis holding lock keys, 1 for the policy it has (lock keys are safe only under noeviction)",
        None,
        MetricType::Gauge,
    )?;
    for (role, node, name, _) in &nodes {
        let labels = [
            ("role", *role),
            ("node", node.as_str()),
            ("policy", name.as_str()),
        ];
        ConstGauge::new(1).encode(policy.encode_family(&labels)?)?;
    }
    let mut evicted = e.encode_descriptor(
        "upstream_evicted_keys",
        "Keys each Redis holding lock keys evicted while lockgate watched (growth of INFO stats evicted_keys)",
        None,
        MetricType::Counter,
    )?;
    for (role, node, _, n) in &nodes {
        let labels = [("role", *role), ("node", node.as_str())];
        ConstCounter::new(*n).encode(evicted.encode_family(&labels)?)?;
    }
    // The risks to the locks of each Redis holding them
    // (`lock::eviction::safety`): one series per signal, 1 while it holds.
    use crate::lock::eviction::safety::SIGNALS;
    let delay = ctx.locks.failover_delay();
    let holders: Vec<(&str, String, Vec<&str>)> = match ctx.locks.quorum() {
        None => vec![(
            "primary",
            nodes[0].1.clone(),
            ctx.primary_memory.safety.named(delay),
        )],
        // A master's restart is its sit-out's (docs/quorum.md), not a hold.
        Some(q) => (q.masters.iter())
            .map(|m| {
                let mut named = m.memory.safety.named(delay);
                named.retain(|s| *s != "restarted");
                ("master", m.node.addr().to_string(), named)
            })
            .collect(),
    };
    let mut unsafe_ = e.encode_descriptor(
        "upstream_unsafe",
        "Risks each Redis holding the locks shows, 1 while each holds: replicas_without_min_replicas_to_write, no_aof, restarted (acquisitions held for locks.failover_delay_ms), second_primary (a former primary still accepts writes), writable_replica (a replica accepts writes: replica-read-only no)",
        None,
        MetricType::Gauge,
    )?;
    for (role, node, named) in &holders {
        for signal in SIGNALS {
            let labels = [("role", *role), ("node", node.as_str()), ("signal", signal)];
            let on = i64::from(named.contains(&signal));
            ConstGauge::new(on).encode(unsafe_.encode_family(&labels)?)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::protocol::encode::LocalReply;

    /// Families `/metrics` has that are not plain counters and so are not
    /// in `LOCKGATE STATS`: histograms, labelled families, values computed
    /// at scrape time.
    const NOT_COUNTERS: &[&str] = &[
        "lockgate_lock_wait_seconds",
        "lockgate_lock_hold_seconds",
        "lockgate_commands",
        "lockgate_lock_tracked_keys",
        "lockgate_lock_oldest_wait_seconds",
        "lockgate_cluster_node_up",
        "lockgate_cluster_node_failover_hold_seconds",
        "lockgate_tasks_alive",
        "lockgate_hot_lock_attempts",
        "lockgate_lock_key_wait_seconds",
        "lockgate_lock_key_hold_seconds",
        "lockgate_upstream_maxmemory_policy",
        "lockgate_upstream_evicted_keys",
        "lockgate_upstream_unsafe",
        "lockgate_guarded_writes",
    ];

    /// Every counter is both exported and in `LOCKGATE STATS`, under the
    /// names the table gives: a counter added to one side only fails here.
    #[tokio::test]
    async fn every_counter_is_exported_and_in_stats() {
        let mut config = crate::Config::default();
        config.upstream.addr = "127.0.0.1:1".to_string();
        let ctx = Arc::new(ServerContext::new(config));
        let mut table = Vec::new();
        ctx.each_counter(|c| table.push((c.name, c.stats_name)));
        ctx.stop.cancel();

        let exported: BTreeSet<String> = render(&ctx)
            .expect("renders")
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next())
            .filter(|name| !NOT_COUNTERS.contains(name))
            .map(str::to_string)
            .collect();
        let want: BTreeSet<String> = table.iter().map(|(n, _)| format!("lockgate_{n}")).collect();
        assert_eq!(exported, want, "/metrics vs the counter tables");
        assert_eq!(want.len(), table.len(), "a Prometheus name used twice");

        let LocalReply::Map(stats) = crate::admin::stats(&ctx) else {
            panic!("STATS is not a record");
        };
        let shown: Vec<String> = stats
            .iter()
            .map(|(r, _)| match r {
                LocalReply::Bulk(b) => String::from_utf8_lossy(b).into_owned(),
                other => panic!("STATS name {other:?}"),
            })
            .collect();
        let want: Vec<String> = table.iter().map(|(_, s)| s.to_string()).collect();
        assert_eq!(shown, want, "LOCKGATE STATS vs the counter tables");
        let unique: BTreeSet<&String> = shown.iter().collect();
        assert_eq!(unique.len(), shown.len(), "a STATS name used twice");
        // The counters that once were counted but never exported.
        for name in [
            "unexpected_replies",
            "drain_timeouts",
            "lock_in_transaction",
            "lock_unmatched_overflow",
            "lock_waiters_rejected",
            "lock_untracked",
        ] {
            assert!(unique.contains(&name.to_string()), "{name} not in STATS");
        }
    }
}
