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

use tracing::Instrument;

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
        .route("/locks/release", axum::routing::post(release))
        .route("/", get(|| async { Html(STATUS_PAGE) }))
        .with_state(ctx);
    let app = app.into_make_service_with_connect_info::<std::net::SocketAddr>();
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

/// The page's locks table: `LOCKGATE LOCKS`'s rows (the 20 most
/// contended), as JSON.
async fn lock_rows(ctx: &Arc<ServerContext>) -> Vec<serde_json::Value> {
    let rows = ctx
        .locks
        .lock_rows(bytes::Bytes::from_static(b"*"), 20)
        .await;
    rows.into_iter()
        .map(|r| {
            serde_json::json!({
                "key": String::from_utf8_lossy(&r.key),
                "acquisition": r.acquisition,
                "holder": r.holder.as_str(),
                "client_addr": r.client.as_ref().map(|c| c.addr.clone()),
                "client_name": r.client.as_ref().map(|c| String::from_utf8_lossy(&c.name).into_owned()),
                "held_ms": r.held_ms,
                "lease_left_ms": r.lease_left_ms,
                "waiters": r.waiters,
                "oldest_wait_ms": r.oldest_wait_ms,
                "kind": r.kind,
                "holders": r.holders,
                "entries": r.entries,
                "writers_waiting": r.writers_waiting,
            })
        })
        .collect()
}

/// The page's release button: `LOCKGATE RELEASE` over HTTP.
#[derive(Debug, serde::Deserialize)]
struct ReleaseRequest {
    key: String,
    acquisition: String,
    /// `admin.password` (needed when one is set).
    #[serde(default)]
    password: String,
}

/// `POST /locks/release` with a JSON body `{key, acquisition, password}`:
/// what `LOCKGATE RELEASE` does, behind the same password (403 without
/// it). A JSON body only: a page of another origin cannot send one
/// without the browser asking first, which this listener never allows.
/// 200 released; 409 not released (the acquisition no longer holds the
/// lock), with the reason; 400 a bad request; 503 the store failed.
async fn release(
    State(ctx): State<Arc<ServerContext>>,
    axum::extract::ConnectInfo(peer): axum::extract::ConnectInfo<std::net::SocketAddr>,
    axum::Json(req): axum::Json<ReleaseRequest>,
) -> Response {
    let text = |reply: crate::protocol::encode::LocalReply| match reply {
        crate::protocol::encode::LocalReply::Error(e) => String::from_utf8_lossy(&e).into_owned(),
        other => format!("{other:?}"),
    };
    let password = &ctx.config.admin.password;
    if !password.is_empty() && !crate::admin::password_matches(password, &req.password) {
        tracing::warn!(%peer, "status page release refused: wrong admin password");
        let body = serde_json::json!({"error": "WRONGPASS lockgate: invalid LOCKGATE password"});
        return (StatusCode::FORBIDDEN, axum::Json(body)).into_response();
    }
    let checked =
        crate::admin::release_request(&ctx, req.key.as_bytes(), req.acquisition.as_bytes());
    let (key, acquisition) = match checked {
        Ok(checked) => checked,
        Err(e) => {
            let body = serde_json::json!({"error": text(e)});
            return (StatusCode::BAD_REQUEST, axum::Json(body)).into_response();
        }
    };
    let span = tracing::info_span!("http", %peer);
    let outcome = crate::admin::release_outcome(&ctx.locks, key, acquisition, "status page")
        .instrument(span)
        .await;
    match outcome {
        Ok(()) => (
            StatusCode::OK,
            axum::Json(serde_json::json!({"released": true})),
        )
            .into_response(),
        Err(e) => {
            let e = text(e);
            let code = match e.contains("not released") {
                true => StatusCode::CONFLICT,
                false => StatusCode::SERVICE_UNAVAILABLE,
            };
            (code, axum::Json(serde_json::json!({"error": e}))).into_response()
        }
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
    // Connected, but a call timed out and nothing was answered since (the
    // periodic check asks every `locks.eviction_check_ms`): a hung Redis
    // or a silent path, which a connection's state does not show.
    if ctx.primary.state.silent.load(Ordering::Relaxed) {
        return Some(format!(
            "upstream {addr} not answering (a call timed out, nothing answered since)"
        ));
    }
    // `locks.require_noeviction` on a primary that may evict lock keys: no
    // lock can be served, as without a quorum of masters.
    if !ctx.locks.on_masters() {
        let memory = &ctx.primary_memory;
        if let Some(why) = ctx.eviction.refused_because(Some(&addr), memory) {
            return Some(why.trim_start_matches("lockgate: ").to_string());
        }
        if let Some(why) = ctx.locks.safety_refused_because() {
            return Some(why.trim_start_matches("lockgate: ").to_string());
        }
    }
    if ctx.locks.guards_on() && !ctx.locks.guard_table.is_read() {
        return Some(
            "guarded writes: Redis's command table is not read yet (commands on guarded data cannot be checked)"
                .to_string(),
        );
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

/// `/status.json`'s query: `since` (Unix ms) asks only for the history
/// samples newer than it (the page asks for all once, then for the new).
#[derive(Debug, serde::Deserialize)]
struct StatusQuery {
    since: Option<u64>,
}

async fn status(
    State(ctx): State<Arc<ServerContext>>,
    axum::extract::Query(query): axum::extract::Query<StatusQuery>,
) -> Response {
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
        // The rates of the last interval: right from the page's first
        // paint, and the same figures as its charts' last point.
        "latest": ctx.history.latest(),
        "history": ctx.history.since(query.since.unwrap_or(0)),
        "history_interval_ms": ctx.history.interval.as_millis() as u64,
        "history_capacity": ctx.history.capacity(),
        "locks": lock_rows(&ctx).await,
        "lapses": crate::admin::views::lapses_json(&ctx),
        "masters": masters,
        "guards": ctx.locks.guard_counts().iter().map(|(lock, mode, counts)| {
            let mut row = serde_json::json!({"lock": lock, "mode": mode});
            for (outcome, n) in counts.each() {
                row[outcome] = n.into();
            }
            row
        }).collect::<Vec<_>>(),
        "primary": crate::admin::views::primary_json(&ctx),
        "cluster_nodes": ctx.cluster.iter().flat_map(|c| c.nodes(ctx.locks.failover_delay())).map(|n| serde_json::json!({
            "addr": n.addr,
            "slots": n.slots,
            "replicas": n.replicas,
            "up": n.up,
            "held_ms": n.held_ms,
            "disputes": n.disputes,
        })).collect::<Vec<_>>(),
        "cluster_disputes": ctx.cluster.iter().flat_map(|c| c.disputes()).map(|d| d.describe()).collect::<Vec<_>>(),
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}
