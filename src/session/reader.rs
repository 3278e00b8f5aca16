//! The client → Redis half of a session: read client bytes, find each
//! command, route it, tell the writer half what to expect, and forward the
//! client's own bytes in one write per read batch.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::jobs::Jobs;
use super::parking::{self, Early};
use super::pending::{Batch, Pending};
use super::SessionError;
use crate::admin;
use crate::command;
use crate::lock::lease::ConnLocks;
use crate::lock::script;
use crate::lock::LockPending;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::{self, LocalReply};
use crate::protocol::request::{RequestKind, RequestParser};
use crate::router::{self, CommandArgs, Expect, Route, SessionView};
use crate::server::ServerContext;

/// Most script bodies remembered for masters that lost them.
const MAX_REMEMBERED_SCRIPTS: usize = 10_000;

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
    client: &mut ReadHalf<'_>,
    upstream: &mut WriteHalf<'_>,
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
    let mut quorum_tx = QuorumTx::default();
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
        let routed = route_batch(ctx, &mut parser, &mut view, conn, &mut quorum_tx, jobs, buf);
        let (batch, failed) = (routed.batch, routed.failed);
        let forward = routed.pieces.assemble(buf.split_to(routed.used).freeze());
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

/// What goes upstream for one read batch: ranges of the client's own
/// bytes, and commands lockgate wrote in place of lock commands.
#[derive(Debug, Default)]
struct Pieces(Vec<Piece>);

#[derive(Debug)]
enum Piece {
    Client(Range<usize>),
    Own(Bytes),
}

impl Pieces {
    fn client(&mut self, range: Range<usize>) {
        if let Some(Piece::Client(last)) = self.0.last_mut() {
            if last.end == range.start {
                last.end = range.end;
                return;
            }
        }
        self.0.push(Piece::Client(range));
    }

    fn own(&mut self, bytes: Bytes) {
        self.0.push(Piece::Own(bytes));
    }

    /// The bytes to write upstream, given the batch's client bytes. The
    /// common case (only client bytes, contiguous) is zero-copy.
    fn assemble(self, client: Bytes) -> Bytes {
        match self.0.as_slice() {
            [] => Bytes::new(),
            [Piece::Client(r)] => client.slice(r.clone()),
            pieces => {
                let mut out = BytesMut::new();
                for p in pieces {
                    match p {
                        Piece::Client(r) => out.extend_from_slice(&client[r.clone()]),
                        Piece::Own(b) => out.extend_from_slice(b),
                    }
                }
                out.freeze()
            }
        }
    }
}

/// One read batch, routed.
struct Routed {
    /// Where work with deferred replies is queued.
    jobs: Jobs,
    /// The command being routed is the last one read so far.
    last: bool,
    batch: Batch,
    pieces: Pieces,
    /// Bytes consumed from the front of the read buffer.
    used: usize,
    /// A malformed request ended the batch (its error and a close are the
    /// batch's last entries).
    failed: bool,
}

impl Routed {
    /// Queues `work`; its reply takes the command's place in the order.
    fn defer(&mut self, work: admin::Work) {
        match self.jobs.defer(work) {
            Ok(rx) => self.batch.deferred(rx),
            Err(reply) => self.batch.local(reply),
        }
    }
}

/// Parses every complete request in `buf` and routes it.
fn route_batch(
    ctx: &Arc<ServerContext>,
    parser: &mut RequestParser,
    view: &mut SessionView,
    conn: &Arc<Mutex<ConnLocks>>,
    tx: &mut QuorumTx,
    jobs: &Jobs,
    buf: &[u8],
) -> Routed {
    let mut out = Routed {
        jobs: jobs.clone(),
        last: false,
        batch: Batch::default(),
        pieces: Pieces::default(),
        used: 0,
        failed: false,
    };
    let mut commands = 0u64;
    loop {
        let pos = out.used;
        let rest = &buf[pos..];
        match parser.parse(rest) {
            Ok(None) => break,
            Ok(Some(req)) => {
                out.used += req.len;
                let whole = pos..pos + req.len;
                if req.kind == RequestKind::Empty {
                    out.pieces.client(whole);
                    continue;
                }
                commands += 1;
                let args = CommandArgs::new(parser, rest);
                ProxyMetrics::inc(&ctx.metrics.commands[command::label_index(args.get(0))]);
                let kind = command::classify(args.get(0), args.get(1), args.get(2));
                let route = router::route(kind, args, view, &ctx.locks, ctx.quorum.is_some());
                remember_script(ctx, kind, args);
                if kind == command::CommandKind::Lockgate
                    && args.get(1).eq_ignore_ascii_case(b"AUTH")
                    && args.get(2) == ctx.config.admin.password.as_bytes()
                {
                    view.admin_ok = true;
                }
                if kind == command::CommandKind::Select {
                    view.db = std::str::from_utf8(args.get(1))
                        .ok()
                        .and_then(|d| d.parse().ok())
                        .unwrap_or(u64::MAX);
                }
                // Only a command the client waits on (nothing pipelined
                // behind it) may be parked: parking a pipelined attempt
                // would hold every reply behind it.
                out.last = out.used == buf.len();
                if !quorum_transaction(ctx, kind, &route, view, conn, tx, whole.clone(), &mut out) {
                    carry_out(ctx, &route, args, view, conn, whole, &mut out);
                }
                *view = view.after(kind, &route);
            }
            Err(e) => {
                ProxyMetrics::inc(&ctx.metrics.protocol_errors);
                ctx.metrics.error(e.source_kind());
                tracing::debug!(error = %e, "malformed request; closing");
                if view.raw {
                    // Replies are not counted, so the error would jump ahead
                    // of replies still on their way; a RESET marks where they
                    // end (the connection is closing anyway).
                    out.pieces.own(encode::command(&[b"RESET"]));
                    out.batch.barrier();
                }
                out.batch.local(LocalReply::err(&e));
                out.batch.close();
                out.failed = true;
                break;
            }
        }
    }
    ProxyMetrics::add(&ctx.metrics.commands_total, commands);
    out
}

/// For an `EVALSHA` on the quorum: the same call as `EVAL` with the body
/// lockgate has seen, for masters that answer `NOSCRIPT`.
fn eval_fallback(q: &crate::lock::quorum::Quorum, args: CommandArgs<'_>) -> Option<bytes::Bytes> {
    let name = args.get(0).to_ascii_uppercase();
    if !name.starts_with(b"EVALSHA") {
        return None;
    }
    let sha = String::from_utf8_lossy(args.get(1)).to_ascii_lowercase();
    let body = q.scripts.get(&sha)?.clone();
    let mut all = args.all();
    all[0] = if name == b"EVALSHA_RO" {
        b"EVAL_RO"
    } else {
        b"EVAL"
    };
    all[1] = &body;
    Some(encode::command(&all))
}

/// Remembers script bodies (`EVAL`, `SCRIPT LOAD`) for the quorum, and
/// loads `SCRIPT LOAD`ed ones on every master as well.
fn remember_script(ctx: &Arc<ServerContext>, kind: command::CommandKind, args: CommandArgs<'_>) {
    let Some(q) = &ctx.quorum else { return };
    let body = match kind {
        command::CommandKind::Eval if args.get(0).eq_ignore_ascii_case(b"EVAL") => args.get(1),
        command::CommandKind::Script if args.get(1).eq_ignore_ascii_case(b"LOAD") => args.get(2),
        _ => return,
    };
    let sha = sha1_smol::Sha1::from(body).digest().to_string();
    if q.scripts.len() < MAX_REMEMBERED_SCRIPTS || q.scripts.contains_key(&sha) {
        q.scripts.insert(sha, bytes::Bytes::copy_from_slice(body));
    }
    if kind == command::CommandKind::Script {
        let load = encode::command(&[b"SCRIPT", b"LOAD", body]);
        let q = q.clone();
        let stop = ctx.stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = q.ask_all(&load) => {}
                _ = stop.cancelled() => {}
            }
        });
    }
}

/// A transaction's lock operations while lock keys live on the quorum:
/// Redis cannot queue them (they do not go to the primary), so lockgate
/// answers `+QUEUED` and runs them itself at `EXEC`.
#[derive(Debug, Default)]
pub struct QuorumTx {
    ops: Vec<crate::lock::ops::LockOp>,
    /// Commands queued on the primary in the same transaction.
    primary: usize,
}

/// Handles what a transaction means under the quorum; true when the
/// command was dealt with here (the caller then does nothing more).
#[allow(clippy::too_many_arguments)]
fn quorum_transaction(
    ctx: &Arc<ServerContext>,
    kind: command::CommandKind,
    route: &Route,
    view: &SessionView,
    conn: &Arc<Mutex<ConnLocks>>,
    tx: &mut QuorumTx,
    whole: Range<usize>,
    out: &mut Routed,
) -> bool {
    if ctx.quorum.is_none() {
        return false;
    }
    match (kind, route) {
        (command::CommandKind::Multi, _) if !view.in_multi => {
            *tx = QuorumTx::default();
            false
        }
        (command::CommandKind::Discard, _) => {
            *tx = QuorumTx::default();
            false
        }
        (command::CommandKind::Exec, _) if view.in_multi && !tx.ops.is_empty() => {
            // Redis holds an empty (or ordinary) transaction: drop it there.
            let _ = whole;
            out.pieces.own(encode::command(&[b"DISCARD"]));
            out.batch.swallow();
            let taken = std::mem::take(tx);
            if taken.primary > 0 {
                ProxyMetrics::inc(&ctx.locks.metrics.mixed_refused);
                out.batch.local(LocalReply::Error(bytes::Bytes::from_static(
                    b"EXECABORT lockgate: the transaction mixes lock keys with other keys; they live on different stores",
                )));
                return true;
            }
            let (ctx2, conn) = (ctx.clone(), conn.clone());
            out.defer(Box::pin(async move {
                let Some(q) = &ctx2.quorum else {
                    return LocalReply::err("lockgate: internal error (no quorum)");
                };
                let mut replies = Vec::with_capacity(taken.ops.len());
                for op in taken.ops {
                    replies.push(ctx2.locks.on_quorum(q, op, conn.clone()).await);
                }
                LocalReply::Array(replies)
            }));
            true
        }
        (_, Route::Lock(op)) if view.in_multi => {
            tx.ops.push(op.clone());
            out.batch.local(LocalReply::Status("QUEUED"));
            true
        }
        (command::CommandKind::Exec, _) => false,
        (_, Route::Forward(_)) if view.in_multi => {
            tx.primary += 1;
            false
        }
        _ => false,
    }
}

/// Carries out one routing decision for the command at `whole` in the buffer.
fn carry_out(
    ctx: &Arc<ServerContext>,
    route: &Route,
    args: CommandArgs<'_>,
    view: &SessionView,
    conn: &Arc<Mutex<ConnLocks>>,
    whole: Range<usize>,
    out: &mut Routed,
) {
    match route {
        Route::Forward(expect) => {
            out.pieces.client(whole);
            out.batch.expect(*expect);
        }
        Route::ForwardUnmatched => {
            ctx.locks.note_unmatched(args.get(1));
            out.pieces.client(whole);
            out.batch.expect(Expect::One);
        }
        Route::Lock(op) if ctx.quorum.is_some() => {
            let park = match parking::admit(ctx, op, conn, !view.in_multi, out.last) {
                Early::Now(reply) => return out.batch.local(reply),
                Early::Delayed(reply, wait) => {
                    return out.defer(Box::pin(async move {
                        tokio::time::sleep(wait).await;
                        reply
                    }))
                }
                Early::Parked(rx) => return out.batch.deferred(rx),
                Early::Probe(park) => park,
            };
            let (ctx2, conn, op) = (ctx.clone(), conn.clone(), op.clone());
            out.defer(Box::pin(parking::quorum_attempt(ctx2, op, conn, park)));
        }
        Route::Lock(op) => {
            let tracked = !view.in_multi && view.db == 0;
            let park = match parking::admit(ctx, op, conn, tracked, out.last) {
                Early::Now(reply) => return out.batch.local(reply),
                Early::Delayed(reply, wait) => {
                    return out.defer(Box::pin(async move {
                        tokio::time::sleep(wait).await;
                        reply
                    }))
                }
                Early::Parked(rx) => return out.batch.deferred(rx),
                Early::Probe(park) => park,
            };
            let planned = match conn.lock() {
                Ok(mut c) => ctx.locks.plan(op.clone(), &mut c, view.in_multi),
                Err(_) => {
                    ctx.metrics.error(crate::error::ErrorSource::Internal);
                    out.batch.local(LocalReply::err(
                        "lockgate: internal error (lock table poisoned)",
                    ));
                    return;
                }
            };
            out.pieces.own(planned.command);
            match planned.pending {
                Some(LockPending::Acquire { key, token, .. }) => {
                    out.batch.lock(LockPending::Acquire { key, token, park })
                }
                Some(p) => out.batch.lock(p),
                None => out.batch.expect(Expect::One),
            }
        }
        Route::RefusePersist => {
            let reply = ctx.locks.refuse_persist(args.get(1));
            if view.in_multi {
                // Inside MULTI the refusal must take the command's slot in
                // the EXEC array, so Redis itself answers it.
                let LocalReply::Error(text) = &reply else {
                    return;
                };
                out.pieces.own(encode::command(&[
                    b"EVAL",
                    script::ERROR.as_bytes(),
                    b"0",
                    text,
                ]));
                out.batch.expect(Expect::One);
            } else {
                out.batch.local(reply);
            }
        }
        Route::QuorumRead | Route::QuorumEval => {
            let command = encode::command(&args.all());
            let fallback = match route {
                Route::QuorumEval => ctx.quorum.as_ref().and_then(|q| eval_fallback(q, args)),
                _ => None,
            };
            let (ctx2, eval) = (ctx.clone(), matches!(route, Route::QuorumEval));
            out.defer(Box::pin(async move {
                match &ctx2.quorum {
                    Some(q) if eval => ctx2.locks.quorum_eval(q, command, fallback).await,
                    Some(q) => ctx2.locks.quorum_read(q, command).await,
                    None => LocalReply::err("lockgate: internal error (no quorum)"),
                }
            }));
        }
        Route::Refuse(message) => {
            ProxyMetrics::inc(&ctx.locks.metrics.mixed_refused);
            out.batch.local(LocalReply::err(message));
        }
        Route::Admin if !ctx.config.admin.resp_commands => {
            out.pieces.client(whole);
            out.batch.expect(Expect::One);
        }
        Route::Admin if !view.admin_ok && !args.get(1).eq_ignore_ascii_case(b"AUTH") => {
            out.batch.local(LocalReply::Error(bytes::Bytes::from_static(
                b"NOPERM lockgate: LOCKGATE AUTH <password> required first",
            )));
        }
        Route::Admin if args.get(1).eq_ignore_ascii_case(b"AUTH") && !view.admin_ok => {
            out.batch.local(LocalReply::Error(bytes::Bytes::from_static(
                b"WRONGPASS lockgate: invalid LOCKGATE password",
            )));
        }
        Route::Admin => match admin::handle(ctx, args) {
            admin::AdminReply::Now(reply) => out.batch.local(reply),
            admin::AdminReply::Later(work) => out.defer(work),
        },
    }
}
