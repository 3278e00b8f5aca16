//! Prometheus exposition: the counters every room keeps (plain atomics on
//! the hot path) are read at scrape time by a collector and encoded with
//! `prometheus-client`, together with the lock wait and hold histograms.
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
use crate::lock::quorum::MasterState;
use crate::metrics::ProxyMetrics;

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
        gauge(
            &mut e,
            "connections_active",
            "Client connections open now",
            ProxyMetrics::get(&p.connections_active) as i64,
        )?;
        let proxy: [(&str, &str, &AtomicU64); 13] = [
            (
                "connections",
                "Client connections accepted",
                &p.connections_total,
            ),
            (
                "connections_rejected",
                "Connections refused at max_clients",
                &p.connections_rejected,
            ),
            (
                "client_bytes_in",
                "Bytes read from clients",
                &p.client_bytes_in,
            ),
            (
                "client_bytes_out",
                "Bytes written to clients",
                &p.client_bytes_out,
            ),
            (
                "protocol_errors",
                "Malformed or oversize client requests",
                &p.protocol_errors,
            ),
            (
                "upstream_connect_errors",
                "Failed connections to the primary",
                &p.upstream_connect_errors,
            ),
            (
                "upstream_unavailable_replies",
                "Commands answered upstream-unavailable",
                &p.upstream_unavailable_replies,
            ),
            (
                "upstream_dropped",
                "Upstream connections lost with replies owed",
                &p.upstream_dropped,
            ),
            (
                "upstream_bad_replies",
                "Malformed replies from the primary",
                &p.upstream_bad_replies,
            ),
            (
                "raw_sessions",
                "Sessions that entered uncounted replies (MONITOR, replication)",
                &p.raw_sessions,
            ),
            (
                "errors_client",
                "Errors caused by clients",
                &p.errors_client,
            ),
            (
                "errors_upstream",
                "Errors caused by Redis or the network to it",
                &p.errors_upstream,
            ),
            (
                "errors_internal",
                "Errors inside lockgate",
                &p.errors_internal,
            ),
        ];
        for (name, help, v) in proxy {
            counter(&mut e, name, help, v)?;
        }
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
        let l = &ctx.locks.metrics;
        let s = &ctx.locks.storm.metrics;
        let locks: [(&str, &str, &AtomicU64); 24] = [
            (
                "lock_attempts",
                "Acquisition attempts on lock keys",
                &l.attempts,
            ),
            ("lock_acquired", "Attempts that acquired", &l.acquired),
            (
                "lock_contended",
                "Attempts that found the lock held",
                &l.contended,
            ),
            (
                "lock_absorbed",
                "Attempts answered without asking Redis (known held)",
                &s.absorbed,
            ),
            (
                "lock_parked",
                "Attempts parked to wait for a release",
                &s.parked,
            ),
            (
                "lock_handoffs",
                "Parked attempts handed the lock",
                &s.handoffs,
            ),
            (
                "lock_park_timeouts",
                "Parked attempts whose park time ended",
                &s.park_timeouts,
            ),
            (
                "lock_smoothed",
                "Replies delayed for hammering one key",
                &s.smoothed,
            ),
            (
                "lock_release_announcements",
                "Releases announced by any instance",
                &s.announcements,
            ),
            (
                "lock_released",
                "Locks released by an owner-checked DEL",
                &l.released,
            ),
            (
                "lock_release_denied",
                "Releases refused: not the owner",
                &l.release_denied,
            ),
            (
                "lock_extend_denied",
                "Extensions refused: not the owner",
                &l.extend_denied,
            ),
            (
                "lock_lease_expired_before_release",
                "Holder found its lease gone at release: critical section outlived the lease",
                &l.lease_expired_before_release,
            ),
            (
                "lock_takeovers",
                "GETSET/SET/GETDEL/GETEX on lock keys",
                &l.takeovers,
            ),
            (
                "lock_persist_refused",
                "PERSIST on lock keys, refused",
                &l.persist_refused,
            ),
            (
                "lock_unmatched_setnx",
                "SETNX on keys outside locks.keys, passed through",
                &l.unmatched_setnx,
            ),
            (
                "lock_quorum_failures",
                "Operations without a majority of masters",
                &l.quorum_failures,
            ),
            (
                "lock_mixed_refused",
                "Commands refused for mixing lock and other keys",
                &l.mixed_refused,
            ),
            (
                "lock_stale_conn_denied",
                "Releases and extensions refused because the acquisition predates the connection",
                &l.stale_conn_denied,
            ),
            (
                "lock_raw_refused",
                "Lock commands refused on a connection in MONITOR or replication mode",
                &l.raw_refused,
            ),
            (
                "lock_watchdog_renewals",
                "Lease renewals by the watchdog",
                &l.watchdog_renewals,
            ),
            (
                "lock_released_on_disconnect",
                "Locks released because their connection closed",
                &l.released_on_disconnect,
            ),
            (
                "lock_table_evictions",
                "Per-connection lock records dropped (table full)",
                &l.conn_table_evictions,
            ),
            (
                "lock_storm_evictions",
                "Contention-table keys dropped (table full)",
                &s.evictions,
            ),
        ];
        for (name, help, v) in locks {
            counter(&mut e, name, help, v)?;
        }
        // Exported without a quorum too (as 0), so dashboards see one set.
        let no_jumps = AtomicU64::new(0);
        counter(
            &mut e,
            "lock_quorum_clock_jumps",
            "Lock master clock jumps seen (the master sat out acquisitions)",
            ctx.quorum.as_ref().map_or(&no_jumps, |q| &q.clock.jumps),
        )?;
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
        }
        if let Some(q) = &ctx.quorum {
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
                    MasterState::SittingOut(_) => "sitting_out",
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
                    MasterState::SittingOut(d) => d.as_secs_f64(),
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
        Ok(())
    }
}
