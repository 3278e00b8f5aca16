//! A session while the primary cannot be reached: every command is
//! answered `-ERR lockgate: upstream … unavailable (…)` at once, a new
//! connection is tried at most every `upstream.reconnect_interval_ms`, and
//! the client timeouts hold as in an attached session (idle, partial
//! request, write).

use std::time::Duration;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::context::ServerContext;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;
use crate::protocol::request::{RequestKind, RequestParser};
use crate::tls::Stream;
use crate::upstream::stream::SessionStream;
use crate::upstream::UpstreamError;

/// Serves a client while the primary is unreachable: every command gets the
/// connection error, and a new attempt is made when a command arrives at
/// least `reconnect_interval_ms` after the last one. Returns the upstream
/// and its primary's generation once connected (with `buf` holding only
/// unanswered bytes), or `None` when the client is gone.
pub(super) async fn serve(
    ctx: &ServerContext,
    client: &mut Stream,
    buf: &mut BytesMut,
    mut err: UpstreamError,
    shutdown: &CancellationToken,
) -> Option<(SessionStream, u64)> {
    let interval = Duration::from_millis(ctx.config.upstream.reconnect_interval_ms);
    let mut next_try = Instant::now() + interval;
    let mut parser = RequestParser::new(ctx.limits());
    let mut out = BytesMut::new();
    let proxy = &ctx.config.proxy;
    let mut last_read = Instant::now();
    let mut partial_since = None;
    loop {
        match parser.parse(buf) {
            Ok(Some(_)) | Err(_) => {}
            Ok(None) => {
                if buf.is_empty() {
                    partial_since = None;
                } else if partial_since.is_none() {
                    partial_since = Some(last_read);
                }
                // Every command is answered at once here: idle means no
                // read for the whole period.
                let idle_at = proxy.idle_timeout().map(|idle| last_read + idle);
                let partial_at = partial_since
                    .zip(proxy.partial_request_timeout())
                    .map(|(t, d)| t + d);
                let timer = match (idle_at, partial_at) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                buf.reserve(proxy.read_chunk_bytes);
                let read = tokio::select! {
                    _ = shutdown.cancelled() => return None,
                    read = client.read_buf(buf) => read,
                    _ = async {
                        if let Some(at) = timer {
                            tokio::time::sleep_until(at).await;
                        }
                    }, if timer.is_some() => {
                        expired(ctx, client, partial_at).await;
                        return None;
                    }
                };
                match read {
                    Ok(0) | Err(_) => return None,
                    Ok(n) => {
                        last_read = Instant::now();
                        ProxyMetrics::add(&ctx.metrics.client_bytes_in, n as u64);
                    }
                }
                continue;
            }
        }
        if Instant::now() >= next_try {
            match ctx.connect_upstream().await {
                Ok(stream) => return Some(stream),
                Err(e) => err = e,
            }
            next_try = Instant::now() + interval;
        }
        let mut closing = false;
        loop {
            match parser.parse(buf) {
                Ok(Some(req)) => {
                    buf.advance(req.len);
                    partial_since = None;
                    if req.kind != RequestKind::Empty {
                        ProxyMetrics::inc(&ctx.metrics.commands_total);
                        ProxyMetrics::inc(&ctx.metrics.upstream_unavailable_replies);
                        LocalReply::err(format!("lockgate: {err}")).encode(false, &mut out);
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    ProxyMetrics::inc(&ctx.metrics.protocol_errors);
                    ctx.metrics.error(e.source_kind());
                    LocalReply::err(&e).encode(false, &mut out);
                    closing = true;
                    break;
                }
            }
        }
        if !write_bounded(ctx, client, &out).await || closing {
            return None;
        }
        ProxyMetrics::add(&ctx.metrics.client_bytes_out, out.len() as u64);
        out.clear();
    }
}

/// A client timer of a detached session fired: the partial-request one
/// (its deadline `partial_at`, answered as in an attached session) or the
/// idle one (closed silently). Counted.
async fn expired(ctx: &ServerContext, client: &mut Stream, partial_at: Option<Instant>) {
    let proxy = &ctx.config.proxy;
    match (partial_at, proxy.partial_request_timeout()) {
        (Some(at), Some(limit)) if Instant::now() >= at => {
            ProxyMetrics::inc(&ctx.metrics.clients_closed_partial_request);
            let mut out = BytesMut::new();
            LocalReply::err(format!(
                "Protocol error: request not completed within {} ms",
                limit.as_millis()
            ))
            .encode(false, &mut out);
            write_bounded(ctx, client, &out).await;
        }
        _ => ProxyMetrics::inc(&ctx.metrics.clients_closed_idle),
    }
}

/// Writes `out` to the client within `proxy.client_write_timeout_ms` (as
/// the writer half does); false when the client is to be dropped.
async fn write_bounded(ctx: &ServerContext, client: &mut Stream, out: &[u8]) -> bool {
    let written = async {
        client.write_all(out).await?;
        client.flush().await
    };
    let written = match ctx.config.proxy.write_timeout() {
        None => written.await,
        Some(limit) => match tokio::time::timeout(limit, written).await {
            Ok(written) => written,
            Err(_) => {
                ProxyMetrics::inc(&ctx.metrics.clients_closed_write_timeout);
                return false;
            }
        },
    };
    if written.is_err() {
        return false;
    }
    ProxyMetrics::add(&ctx.metrics.client_bytes_out, out.len() as u64);
    true
}
