//! What the quorum changes in a session: transactions of lock commands
//! queued and run by lockgate at `EXEC`, and script bodies remembered for
//! masters that lost them.

use super::routing::Routed;
use crate::command;
use crate::lock::lease::ConnLocks;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::{self, LocalReply};
use crate::router::{CommandArgs, Route, SessionView};
use crate::server::ServerContext;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// Most script bodies remembered for masters that lost them.
const MAX_REMEMBERED_SCRIPTS: usize = 10_000;

/// For an `EVALSHA` on the quorum: the same call as `EVAL` with the body
/// lockgate has seen, for masters that answer `NOSCRIPT`.
pub(super) fn eval_fallback(
    q: &crate::lock::quorum::Quorum,
    args: CommandArgs<'_>,
) -> Option<bytes::Bytes> {
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
pub(super) fn remember_script(
    ctx: &Arc<ServerContext>,
    kind: command::CommandKind,
    args: CommandArgs<'_>,
) {
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
pub(super) fn quorum_transaction(
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
