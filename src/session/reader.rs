//! The client → Redis half of a session: read client bytes, find each
//! command, route it, tell the writer half what to expect, and forward the
//! client's own bytes in one write per read batch.

use std::sync::{Arc, Mutex};

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::carry::route_batch;
use super::jobs::Jobs;
use super::pending::Pending;
use super::quorum_transaction::QuorumTransaction;
use super::SessionError;
use crate::context::ServerContext;
use crate::lock::lease::ConnLocks;
use crate::metrics::ProxyMetrics;
use crate::protocol::request::RequestParser;
use crate::router::SessionView;
use crate::tls::stream::{ReadPart, WritePart};

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

/// What the reader half shares with the rest of its session.
pub struct Links<'a> {
    /// Entries for the writer half.
    pub tx: mpsc::Sender<Vec<Pending>>,
    /// The connection's lock records.
    pub conn: &'a Arc<Mutex<ConnLocks>>,
    /// Where deferred work goes.
    pub jobs: Jobs,
    /// Stops the reader (shutdown, or the writer half ended).
    pub cancel: &'a CancellationToken,
}

/// Reads, routes and forwards client commands until the client closes, the
/// session is cancelled, or a request is malformed. `buf` may already hold
/// bytes read before the upstream connection existed.
pub async fn read_loop(
    ctx: &Arc<ServerContext>,
    buf: &mut BytesMut,
    client: &mut ReadPart<'_>,
    upstream: &mut WritePart<'_>,
    links: Links<'_>,
) -> ReaderEnd {
    let Links {
        tx,
        conn,
        jobs,
        cancel,
    } = links;
    let jobs = &jobs;
    let chunk = ctx.config.proxy.read_chunk_bytes;
    let mut parser = RequestParser::new(ctx.limits());
    let mut view = SessionView {
        admin_ok: ctx.config.admin.password.is_empty(),
        ..SessionView::default()
    };
    let mut quorum_transaction = QuorumTransaction::default();
    // One cancellation future for the whole loop: made afresh at every
    // await it registered and unregistered a waiter (a lock and a list
    // splice) three times per command, measurable at -P1.
    let cancelled = cancel.cancelled();
    tokio::pin!(cancelled);
    loop {
        if buf.is_empty() || buf.len() < parser.needed() {
            let want = parser.needed().saturating_sub(buf.len()).max(chunk);
            buf.reserve(want);
            // The read goes first: a cancellation check takes a mutex, and
            // a read that is ready ends the select before it. Cancellation is
            // still seen within tokio's cooperative budget: after 128 ready
            // reads in one poll the read yields Pending once.
            let read = tokio::select! {
                biased;
                read = client.read_buf(buf) => read,
                _ = &mut cancelled => return ReaderEnd::Cancelled,
            };
            match read {
                Ok(0) => {
                    // Pass the half-close on: Redis answers what it has read,
                    // frees the connection (unblocking a BLPOP without popping,
                    // as if the client had gone), and closes.
                    let _ = tx.send(vec![Pending::ClientEof]).await;
                    let _ = upstream.shutdown().await;
                    return ReaderEnd::Eof;
                }
                Ok(n) => ProxyMetrics::add(&ctx.metrics.client_bytes_in, n as u64),
                Err(e) => return ReaderEnd::Failed(SessionError::ClientIo(e)),
            }
            if buf.len() < parser.needed() {
                continue;
            }
        }
        let routed = route_batch(
            ctx,
            &mut parser,
            &mut view,
            conn,
            &mut quorum_transaction,
            jobs,
            buf,
        );
        let (batch, failed) = (routed.batch, routed.failed);
        let forward = routed.pieces.assemble(buf.split_to(routed.used).freeze());
        let routed = routed.hold;
        if !batch.entries.is_empty() {
            // The channel almost always has room: try without building the
            // waiting future first.
            let sent = match tx.try_send(batch.entries) {
                Ok(()) => Ok(()),
                Err(mpsc::error::TrySendError::Closed(_)) => return ReaderEnd::Cancelled,
                Err(mpsc::error::TrySendError::Full(entries)) => tokio::select! {
                    biased;
                    _ = &mut cancelled => return ReaderEnd::Cancelled,
                    sent = tx.send(entries) => sent,
                },
            };
            if sent.is_err() {
                return ReaderEnd::Cancelled;
            }
        }
        if !forward.is_empty() {
            let written = tokio::select! {
                biased;
                _ = &mut cancelled => return ReaderEnd::Cancelled,
                written = async {
                    upstream.write_all(&forward).await?;
                    upstream.flush().await
                } => written,
            };
            if let Err(e) = written {
                return ReaderEnd::Failed(SessionError::UpstreamIo(e));
            }
        }
        if failed {
            return ReaderEnd::Protocol;
        }
        if let Some(hold) = routed {
            // Work lockgate does itself ends the batch: what follows it
            // waits until it is done (or the session ends).
            tokio::select! {
                biased;
                _ = &mut cancelled => return ReaderEnd::Cancelled,
                _ = hold => {}
            }
        }
    }
}
