//! Carrying out a transaction lockgate queued itself while lock keys live
//! on the quorum (the router decides: [`crate::router::Route::Queue`],
//! [`crate::router::Route::ExecQueued`], [`crate::router::Route::ExecAbort`]):
//! at `EXEC`, Redis's side of the transaction is discarded and the queued
//! commands run on the quorum, in order, their replies `EXEC`'s array.

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
    // Redis holds an empty (or ordinary) transaction: drop it there.
    discard(out);
    if mixed {
        ctx.locks.count_refusal(Refusal::Mixed);
        out.batch
            .local(LocalReply::Error(Bytes::from_static(MIXED)));
        return;
    }
    let (locks, conn) = (ctx.locks.clone(), conn.clone());
    out.defer(Box::pin(async move {
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
fn discard(out: &mut Routed) {
    out.pieces.own(encode::command(&[b"DISCARD"]));
    out.batch.swallow();
}
