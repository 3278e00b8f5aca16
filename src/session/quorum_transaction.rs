//! Carrying out a transaction lockgate queued itself while lock keys live
//! on the quorum, or on one Redis that refuses scripts (the router
//! decides: [`crate::router::Route::Queue`],
//! [`crate::router::Route::ExecQueued`], [`crate::router::Route::ExecAbort`]):
//! at `EXEC` the queued commands run where the locks live, in order, their
//! replies `EXEC`'s array. On the quorum Redis's side of the transaction
//! is discarded; on one Redis it is executed first (it is empty), so a
//! `WATCH` the client made decides whether anything runs.

use std::sync::{Arc, Mutex};

use bytes::Bytes;

use super::carry::Routed;
use crate::context::ServerContext;
use crate::lock::lease::ConnLocks;
use crate::lock::Refusal;
use crate::protocol::encode::{self, LocalReply};
use crate::router::Queued;

/// What `EXEC` answers after a command was refused while queuing: Redis's
/// own words for it.
const EXECABORT: &[u8] = b"EXECABORT Transaction discarded because of previous errors.";

/// What `EXEC` answers when the transaction queued commands on both stores.
const MIXED: &[u8] =
    b"EXECABORT lockgate: the transaction mixes lock keys with other keys; they live on different stores";

/// What `EXEC` answers on a server that refuses scripts when the
/// transaction has lock commands and others.
const MIXED_SCRIPTLESS: &[u8] =
    b"EXECABORT lockgate: the server refuses scripts, so a transaction with lock commands may hold only lock commands";

/// `EXEC` after a command was refused while queuing: Redis holds the rest
/// of the transaction, dropped there; nothing runs.
pub(super) fn abort(out: &mut Routed) {
    discard(out);
    out.batch
        .local(LocalReply::Error(Bytes::from_static(EXECABORT)));
}

/// `EXEC` of a transaction with commands lockgate `queued`: Redis's side
/// is discarded; the queued commands run on the quorum in order, unless
/// the transaction also has commands on the primary (`mixed`: refused
/// whole, the two stores cannot commit together).
pub(super) fn exec(
    ctx: &ServerContext,
    conn: &Arc<Mutex<ConnLocks>>,
    queued: Vec<Queued>,
    mixed: bool,
    out: &mut Routed,
) {
    let quorum = ctx.locks.on_masters();
    if mixed {
        // Redis holds an ordinary transaction: dropped there.
        discard(out);
        ctx.locks.count_refusal(Refusal::Mixed);
        let text = if quorum { MIXED } else { MIXED_SCRIPTLESS };
        out.batch.local(LocalReply::Error(Bytes::from_static(text)));
        return;
    }
    // On one Redis its (empty) transaction runs first: nil when a key the
    // client watched changed, and then nothing runs.
    let watched = match quorum {
        true => {
            discard(out);
            None
        }
        false => {
            let (fed, redis_exec) = tokio::sync::oneshot::channel::<Bytes>();
            out.pieces.own(encode::command(&[b"EXEC"]));
            out.batch.feed(fed);
            Some(redis_exec)
        }
    };
    let (locks, conn) = (ctx.locks.clone(), conn.clone());
    out.defer(Box::pin(async move {
        if let Some(redis_exec) = watched {
            match redis_exec.await {
                Ok(exec) if exec.starts_with(b"*0\r\n") => {}
                // Nil (a watched key changed), or an error: Redis's answer.
                Ok(exec) => return LocalReply::Raw(exec),
                Err(_) => return LocalReply::err("lockgate: internal error (reply lost)"),
            }
        }
        let mut replies = Vec::with_capacity(queued.len());
        for queued in queued {
            replies.push(match queued {
                Queued::Op(op) => locks.run(op, conn.clone()).await,
                Queued::Read(command) => locks.read(command).await,
                Queued::Split(split) => {
                    let part = locks.split_part(&split, conn.clone()).await;
                    split.merge(None, part)
                }
                Queued::RefusedPersist(key) => locks.refuse_persist(&key),
            });
        }
        LocalReply::Array(replies)
    }));
}

/// Redis's side of the transaction, dropped: `DISCARD`, its reply swallowed.
pub(super) fn discard(out: &mut Routed) {
    out.pieces.own(encode::command(&[b"DISCARD"]));
    out.batch.swallow();
}
