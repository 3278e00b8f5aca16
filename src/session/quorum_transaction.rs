//! What the quorum changes in a session: transactions of lock commands
//! queued and run by lockgate at `EXEC`, and the script bodies the client
//! sends, passed to the quorum for masters that lost them.

use super::carry::Routed;
use crate::command;
use crate::context::ServerContext;
use crate::lock::lease::ConnLocks;
use crate::lock::ops::LockOp;
use crate::lock::split::Split;
use crate::lock::Refusal;
use crate::protocol::encode::{self, LocalReply};
use crate::router::{CommandArgs, Route, SessionView};
use bytes::Bytes;
use std::sync::{Arc, Mutex};

/// Tells the quorum about script bodies the client sends (`EVAL`,
/// `SCRIPT LOAD`), for masters that lost them; a `SCRIPT LOAD`ed body is
/// also loaded on every master (see [`crate::lock::quorum::scripts`]).
pub(super) fn remember_script(
    ctx: &Arc<ServerContext>,
    kind: command::CommandKind,
    args: CommandArgs<'_>,
) {
    let body = match kind {
        command::CommandKind::Eval if args.get(0).eq_ignore_ascii_case(b"EVAL") => args.get(1),
        command::CommandKind::Script if args.get(1).eq_ignore_ascii_case(b"LOAD") => args.get(2),
        _ => return,
    };
    ctx.locks
        .script_seen(body, kind == command::CommandKind::Script);
}

/// A transaction's lock operations while lock keys live on the quorum:
/// Redis cannot queue them (they do not go to the primary), so lockgate
/// answers `+QUEUED` and runs them itself at `EXEC`.
#[derive(Debug, Default)]
pub struct QuorumTransaction {
    queued: Vec<Queued>,
    /// Commands queued on the primary in the same transaction.
    primary: usize,
    /// A command was refused while queuing: `EXEC` runs nothing (Redis's
    /// rule for a command rejected at queue time).
    failed: bool,
}

/// One command of a transaction that lockgate runs on the quorum at `EXEC`.
#[derive(Debug)]
enum Queued {
    /// A lock operation.
    Op(LockOp),
    /// A read of lock keys (`GET`, `EXISTS`, `TTL`…), as sent.
    Read(Bytes),
    /// `MGET`/`TOUCH` of lock keys only.
    Split(Split),
    /// A reply known at queue time (a refused `PERSIST` after lock
    /// commands: an error in its slot, as Redis gives a command failing
    /// inside `EXEC`).
    Reply(LocalReply),
}

/// What `EXEC` answers after a command was refused while queuing: Redis's
/// own words for it.
const EXECABORT: &[u8] = b"EXECABORT Transaction discarded because of previous errors.";

/// Handles what a transaction means under the quorum; true when the
/// command was dealt with here (the caller then does nothing more).
#[allow(clippy::too_many_arguments)]
pub(super) fn quorum_transaction(
    ctx: &Arc<ServerContext>,
    kind: command::CommandKind,
    route: &Route,
    view: &SessionView,
    conn: &Arc<Mutex<ConnLocks>>,
    tx: &mut QuorumTransaction,
    args: CommandArgs<'_>,
    out: &mut Routed,
) -> bool {
    if !ctx.locks.on_masters() {
        return false;
    }
    let queued = match (kind, route) {
        (command::CommandKind::Multi, _) if !view.in_multi => {
            *tx = QuorumTransaction::default();
            return false;
        }
        (command::CommandKind::Discard, _) => {
            *tx = QuorumTransaction::default();
            return false;
        }
        (command::CommandKind::Exec, _) if view.in_multi && tx.failed => {
            // Redis holds the rest of the transaction: drop it there.
            *tx = QuorumTransaction::default();
            out.pieces.own(encode::command(&[b"DISCARD"]));
            out.batch.swallow();
            out.batch
                .local(LocalReply::Error(Bytes::from_static(EXECABORT)));
            return true;
        }
        (command::CommandKind::Exec, _) if view.in_multi && !tx.queued.is_empty() => {
            exec_on_quorum(ctx, conn, std::mem::take(tx), out);
            return true;
        }
        (_, Route::Lock(op)) if view.in_multi => Queued::Op(op.clone()),
        (_, Route::QuorumRead) if view.in_multi => Queued::Read(encode::command(&args.all())),
        (_, Route::QuorumSplit(split)) if view.in_multi => Queued::Split(split.clone()),
        // A refused PERSIST joins the side the transaction is on: the
        // quorum's, once lockgate queues commands, else Redis's (the error
        // in its slot of Redis's own EXEC array).
        (_, Route::RefusePersist) if view.in_multi && !tx.queued.is_empty() => {
            Queued::Reply(ctx.locks.refuse_persist(args.get(1)))
        }
        (_, Route::RefusePersist) if view.in_multi => {
            tx.primary += 1;
            return false;
        }
        (_, Route::Refuse(_)) if view.in_multi => {
            // The caller answers the refusal; EXEC then aborts.
            tx.failed = true;
            return false;
        }
        (_, Route::Forward(_) | Route::ForwardForget(..)) if view.in_multi => {
            tx.primary += 1;
            return false;
        }
        _ => return false,
    };
    tx.queued.push(queued);
    out.batch.local(LocalReply::Status("QUEUED"));
    true
}

/// `EXEC` of a transaction with commands queued by lockgate: Redis's side
/// is discarded; the queued commands run on the quorum in order, unless the
/// transaction also has commands on the primary (refused whole: the two
/// stores cannot commit together).
fn exec_on_quorum(
    ctx: &Arc<ServerContext>,
    conn: &Arc<Mutex<ConnLocks>>,
    taken: QuorumTransaction,
    out: &mut Routed,
) {
    // Redis holds an empty (or ordinary) transaction: drop it there.
    out.pieces.own(encode::command(&[b"DISCARD"]));
    out.batch.swallow();
    if taken.primary > 0 {
        ctx.locks.count_refusal(Refusal::Mixed);
        out.batch.local(LocalReply::Error(Bytes::from_static(
            b"EXECABORT lockgate: the transaction mixes lock keys with other keys; they live on different stores",
        )));
        return;
    }
    let (locks, conn) = (ctx.locks.clone(), conn.clone());
    out.defer(Box::pin(async move {
        let mut replies = Vec::with_capacity(taken.queued.len());
        for queued in taken.queued {
            replies.push(match queued {
                Queued::Op(op) => locks.run(op, conn.clone()).await,
                Queued::Read(command) => locks.read(command).await,
                Queued::Split(split) => {
                    let part = locks.split_part(&split, conn.clone()).await;
                    split.merge(None, part)
                }
                Queued::Reply(reply) => reply,
            });
        }
        LocalReply::Array(replies)
    }));
}
