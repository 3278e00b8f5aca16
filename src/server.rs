//! The accept loop: a connection limit, back-off on accept errors, one
//! session task per client, and the drain on shutdown.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::context::ServerContext;
use crate::metrics::ProxyMetrics;
use crate::tls::Stream;

/// Longest pause after repeated accept errors (e.g. out of file descriptors).
const MAX_ACCEPT_BACKOFF: Duration = Duration::from_secs(1);
/// How long a refused client may take to read its error before it is dropped.
const REJECT_WRITE_TIMEOUT: Duration = Duration::from_millis(100);

/// Waits, while guards are configured, for Redis's command table, at most
/// `locks.guard_table_wait_ms`; logs when it is not read by then.
async fn guard_table_read(ctx: &ServerContext) {
    let wait = Duration::from_millis(ctx.in_force().locks.guard_table_wait_ms);
    let table = &ctx.locks.guard_table;
    if !ctx.locks.guards_on() || wait.is_zero() || table.is_read() {
        return;
    }
    if !table.read_within(wait).await {
        tracing::warn!(
            waited_ms = wait.as_millis() as u64,
            "serving clients before Redis's command table is read: commands on guarded data cannot be checked until it is (locks.guard_table_wait_ms)"
        );
    }
}

/// The next client of either listener, and whether it came to the TLS one.
async fn accept(
    plain: &TcpListener,
    tls: Option<&TcpListener>,
) -> (std::io::Result<(TcpStream, std::net::SocketAddr)>, bool) {
    match tls {
        None => (plain.accept().await, false),
        Some(tls) => tokio::select! {
            accepted = plain.accept() => (accepted, false),
            accepted = tls.accept() => (accepted, true),
        },
    }
}

/// Accepts clients on `listener` (and on `tls`, the TLS listener, when
/// given) until `shutdown` fires, then waits up to
/// `proxy.shutdown_grace_ms` for sessions to drain and cuts the rest. TLS
/// handshakes run in each client's own task, so a stalled one holds up
/// nobody else.
pub async fn serve(
    listener: TcpListener,
    tls: Option<TcpListener>,
    ctx: Arc<ServerContext>,
    shutdown: CancellationToken,
) {
    let slots = ctx.client_slots.clone();
    let sessions = TaskTracker::new();
    let force = CancellationToken::new();
    let mut backoff = Duration::from_millis(1);
    // With guards, a command on guarded data cannot be checked before
    // Redis's command table is read: the first clients wait for it in
    // the listen queue (a sidecar's app has no readiness probe in front),
    // at most `locks.guard_table_wait_ms`.
    tokio::select! {
        _ = shutdown.cancelled() => {}
        _ = guard_table_read(&ctx) => {}
    }
    loop {
        // Accepted only with a permit of `upstream.max_connecting`: each is
        // held at most `connect_timeout_ms`, so this waits no longer.
        let opening = match &ctx.opening {
            None => None,
            Some(opening) => match opening.clone().try_acquire_owned() {
                Ok(permit) => Some(permit),
                Err(_) => {
                    ProxyMetrics::inc(&ctx.metrics.connections_held_back);
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        permit = opening.clone().acquire_owned() => permit.ok(),
                    }
                }
            },
        };
        let (accepted, is_tls) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = accept(&listener, tls.as_ref()) => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(pair) => {
                backoff = Duration::from_millis(1);
                pair
            }
            Err(e) => {
                if let Some(more) = ctx.accept_warn.check() {
                    tracing::warn!(error = %e, suppressed = more, "accept failed; backing off");
                }
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(MAX_ACCEPT_BACKOFF);
                continue;
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            ProxyMetrics::inc(&ctx.metrics.connections_rejected);
            // A TLS client could not read a plain-text error: just closed.
            if !is_tls {
                sessions.spawn(reject(stream));
            }
            continue;
        };
        ProxyMetrics::inc(&ctx.metrics.connections_total);
        // The connection's lock records are made at accept, so its birth
        // (the pooled rule) is never later than the client's connect.
        let conn = ctx.locks.conn_locks();
        let ctx = ctx.clone();
        let shutdown = shutdown.clone();
        let force = force.clone();
        sessions.spawn(async move {
            ProxyMetrics::inc(&ctx.metrics.connections_active);
            let serve = async {
                // Nagle only adds latency; lockgate batches writes itself.
                let _ = stream.set_nodelay(true);
                let client = match is_tls {
                    false => Stream::Plain(stream),
                    true => match ctx.tls.accept(stream, peer, &ctx.metrics, &shutdown).await {
                        Some(client) => client,
                        None => return,
                    },
                };
                let session = crate::session::Start {
                    peer,
                    conn,
                    opening,
                };
                crate::session::run(ctx.clone(), client, session, shutdown.clone()).await
            };
            // The forced cut is polled only when it fires, not at every
            // wake of the session.
            crate::session::branches::Until::new(serve, force.cancelled()).await;
            ctx.metrics
                .connections_active
                .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            drop(permit);
        });
    }
    drop(listener);
    drop(tls);
    sessions.close();
    let grace = Duration::from_millis(ctx.config.proxy.shutdown_grace_ms);
    if tokio::time::timeout(grace, sessions.wait()).await.is_err() {
        tracing::warn!(
            remaining = sessions.len(),
            "grace period over; cutting connections"
        );
        force.cancel();
        sessions.wait().await;
    }
}

/// Tells a client over `proxy.max_clients` why it is refused, as Redis does.
async fn reject(mut stream: TcpStream) {
    let _ = tokio::time::timeout(
        REJECT_WRITE_TIMEOUT,
        stream.write_all(b"-ERR max number of clients reached\r\n"),
    )
    .await;
}
