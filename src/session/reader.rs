//! The client → Redis half of a session: read client bytes, find each
//! command, route it, tell the writer half what to expect, and forward the
//! client's own bytes in one write per read batch.

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::pending::{Batch, Pending};
use super::SessionError;
use crate::command;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;
use crate::protocol::request::{RequestKind, RequestParser};
use crate::router::{self, Route, SessionView};
use crate::server::ServerContext;

/// How the reader half ended.
#[derive(Debug)]
pub enum ReaderEnd {
    /// The client closed its side.
    Eof,
    /// Shutdown or the writer half ended first.
    Cancelled,
    /// A malformed request was answered and the connection is to close.
    Protocol,
    /// Reading the client or writing Redis failed.
    Failed(SessionError),
}

/// Reads, routes and forwards client commands until the client closes, the
/// session is cancelled, or a request is malformed. `buf` may already hold
/// bytes read before the upstream connection existed.
pub async fn read_loop(
    ctx: &ServerContext,
    buf: &mut BytesMut,
    client: &mut ReadHalf<'_>,
    upstream: &mut WriteHalf<'_>,
    tx: mpsc::Sender<Vec<Pending>>,
    cancel: &CancellationToken,
) -> ReaderEnd {
    let chunk = ctx.config.proxy.read_chunk_bytes;
    let mut parser = RequestParser::new(ctx.limits());
    let mut view = SessionView::default();
    loop {
        if buf.is_empty() || buf.len() < parser.needed() {
            let want = parser.needed().saturating_sub(buf.len()).max(chunk);
            buf.reserve(want);
            let read = tokio::select! {
                biased;
                _ = cancel.cancelled() => return ReaderEnd::Cancelled,
                read = client.read_buf(buf) => read,
            };
            match read {
                Ok(0) => return ReaderEnd::Eof,
                Ok(n) => ProxyMetrics::add(&ctx.metrics.client_bytes_in, n as u64),
                Err(e) => return ReaderEnd::Failed(SessionError::ClientIo(e)),
            }
            if buf.len() < parser.needed() {
                continue;
            }
        }
        let (batch, used, failed) = route_batch(ctx, &mut parser, &mut view, buf);
        let forward: Bytes = buf.split_to(used).freeze();
        if !batch.entries.is_empty() {
            let sent = tokio::select! {
                biased;
                _ = cancel.cancelled() => return ReaderEnd::Cancelled,
                sent = tx.send(batch.entries) => sent,
            };
            if sent.is_err() {
                return ReaderEnd::Cancelled;
            }
        }
        if !forward.is_empty() {
            let written = tokio::select! {
                biased;
                _ = cancel.cancelled() => return ReaderEnd::Cancelled,
                written = upstream.write_all(&forward) => written,
            };
            if let Err(e) = written {
                return ReaderEnd::Failed(SessionError::UpstreamIo(e));
            }
        }
        if failed {
            return ReaderEnd::Protocol;
        }
    }
}

/// Parses every complete request in `buf` and routes it. Returns the batch
/// of entries, how many bytes from the front are to be forwarded, and
/// whether a malformed request ended the batch (its error and a close are
/// then the batch's last entries).
fn route_batch(
    ctx: &ServerContext,
    parser: &mut RequestParser,
    view: &mut SessionView,
    buf: &[u8],
) -> (Batch, usize, bool) {
    let mut batch = Batch::default();
    let mut pos = 0;
    let mut commands = 0u64;
    loop {
        let rest = &buf[pos..];
        match parser.parse(rest) {
            Ok(None) => break,
            Ok(Some(req)) => {
                pos += req.len;
                if req.kind == RequestKind::Empty {
                    continue;
                }
                commands += 1;
                let kind = command::classify(
                    parser.arg(rest, 0),
                    parser.arg(rest, 1),
                    parser.arg(rest, 2),
                );
                let Route::Forward(expect) = router::route(kind, view);
                *view = view.after(kind, expect);
                batch.expect(expect);
            }
            Err(e) => {
                ProxyMetrics::inc(&ctx.metrics.protocol_errors);
                ctx.metrics.error(e.source_kind());
                tracing::debug!(error = %e, "malformed request; closing");
                batch.local(LocalReply::err(&e));
                batch.close();
                ProxyMetrics::add(&ctx.metrics.commands_total, commands);
                return (batch, pos, true);
            }
        }
    }
    ProxyMetrics::add(&ctx.metrics.commands_total, commands);
    (batch, pos, false)
}
