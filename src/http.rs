//! The operators' HTTP side: `/metrics` (Prometheus text), `/healthz`
//! (the process is alive), `/readyz` (the primary and the lock quorum are
//! reachable; 503 with the reason otherwise), `/status.json` and a status
//! page `/` that a person reads in five seconds and that refreshes itself.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::context::ServerContext;
use crate::exposition;
use crate::metrics::ProxyMetrics;

/// The status page: no external assets (many data centres have no
/// internet); it polls `/status.json` every second.
const STATUS_PAGE: &str = include_str!("status.html");

/// Serves the admin endpoints on `listener` until `stop`.
pub async fn serve(listener: TcpListener, ctx: Arc<ServerContext>, stop: CancellationToken) {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/status.json", get(status))
        .route("/", get(|| async { Html(STATUS_PAGE) }))
        .with_state(ctx);
    let result = axum::serve(listener, app)
        .with_graceful_shutdown(async move { stop.cancelled().await })
        .await;
    if let Err(e) = result {
        tracing::warn!(error = %e, "admin HTTP listener stopped");
    }
}

async fn metrics(State(ctx): State<Arc<ServerContext>>) -> Response {
    match exposition::render(&ctx) {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding metrics failed: {e}\n"),
        )
            .into_response(),
    }
}

/// Why lockgate is not ready, if it is not.
pub fn not_ready(ctx: &ServerContext) -> Option<String> {
    if let Some(cluster) = &ctx.cluster {
        // The cluster's primaries are the ones to reach (lockgate's own
        // connection to the first seed is not: that node may have been
        // failed over and stay down).
        return cluster.not_ready();
    }
    let Some(addr) = ctx.primary_addr.addr() else {
        return Some(format!(
            "no primary confirmed by the sentinels for master `{}`",
            ctx.config.upstream.sentinel.master_name
        ));
    };
    if !ctx.primary.state.up.load(Ordering::Relaxed) {
        return Some(format!("upstream {addr} unreachable"));
    }
    // `locks.require_noeviction` on a primary that may evict lock keys: no
    // lock can be served, as without a quorum of masters.
    if !ctx.locks.on_masters() {
        let memory = &ctx.primary_memory;
        if let Some(why) = ctx.eviction.refused_because(Some(&addr), memory) {
            return Some(why.trim_start_matches("lockgate: ").to_string());
        }
    }
    if let Some(q) = ctx.locks.quorum() {
        let up = q.eligible().len();
        // Ready when an acquisition can succeed (clock_faults asks more).
        if up < q.votes_needed() {
            return Some(format!("lock quorum unavailable: {}", q.availability()));
        }
    }
    None
}

async fn readyz(State(ctx): State<Arc<ServerContext>>) -> Response {
    match not_ready(&ctx) {
        None => (StatusCode::OK, "ready\n").into_response(),
        Some(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        )
            .into_response(),
    }
}

async fn status(State(ctx): State<Arc<ServerContext>>) -> Response {
    let p = &ctx.metrics;
    let hot: Vec<serde_json::Value> = ctx
        .locks
        .hot
        .top(ctx.config.admin.hot_keys)
        .into_iter()
        .map(|h| {
            serde_json::json!({
                "key": String::from_utf8_lossy(&h.key),
                "attempts": h.attempts,
                "acquired": h.acquired,
                "absorbed": h.absorbed,
                "parked": h.parked,
                "rate_per_sec": h.rate_per_sec,
                "hold_ms_last": h.hold_ms_last,
                "wait_p99_ms": h.wait_p99_ms,
                "parked_now": ctx.locks.storm.waiting(&h.key),
                "holder": ctx.locks.storm.holder(&h.key),
            })
        })
        .collect();
    let masters: Vec<serde_json::Value> = (ctx.locks.quorum().into_iter())
        .flat_map(|q| q.masters.iter())
        .map(|m| {
            let (state, left, why) = m.shown();
            let memory = &m.memory;
            serde_json::json!({
                "addr": m.node.addr(),
                "state": state,
                "rejoin_in_ms": left,
                "sitting_out_because": why,
                "maxmemory_policy": memory.policy_name(),
                "evicted_keys": ProxyMetrics::get(&memory.evicted),
            })
        })
        .collect();
    let body = serde_json::json!({
        "ready": not_ready(&ctx).unwrap_or_else(|| "ready".to_string()),
        "instance": ctx.locks.instance_prefix().trim_end_matches(':'),
        "connections": ProxyMetrics::get(&p.connections_active),
        "commands_total": ProxyMetrics::get(&p.commands_total),
        "lock_attempts_total": ProxyMetrics::get(&ctx.locks.metrics.attempts),
        "lock_absorbed_total": ProxyMetrics::get(&ctx.locks.storm.metrics.absorbed),
        "hot_keys": hot,
        "masters": masters,
        "primary": crate::views::primary_json(&ctx),
        "cluster_nodes": ctx.cluster.iter().flat_map(|c| c.nodes(ctx.locks.failover_delay())).map(|n| serde_json::json!({
            "addr": n.addr,
            "slots": n.slots,
            "replicas": n.replicas,
            "up": n.up,
            "held_ms": n.held_ms,
        })).collect::<Vec<_>>(),
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}
