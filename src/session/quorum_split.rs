//! Carrying out a command split between the quorum and the primary
//! ([`crate::lock::split`]).
//!
//! The primary's part goes up the client's own connection, in the client
//! command's place: it runs after every command the client sent before and
//! before every command it sends after, in the database the client
//! `SELECT`ed, as the user it authenticated as. (lockgate's own connection
//! to the primary would have none of that: it is shared, in database 0, and
//! its commands race the client's.) The writer hands that part's reply to a
//! [`Feed`](super::pending::Feed) instead of the client. The quorum's part
//! is a job of the session's runner, so it keeps its order among the
//! session's other quorum operations. A deferred entry right behind the
//! feed gives the client the merged reply in the command's place.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::oneshot;

use super::carry::Routed;
use crate::context::ServerContext;
use crate::lock::lease::ConnLocks;
use crate::lock::split::Split;
use crate::protocol::encode::LocalReply;

/// Sends the primary's part of `split` (if any) in the command's place and
/// queues the quorum's part; the merged reply takes the command's place in
/// the order.
pub(super) fn carry_out(
    ctx: &Arc<ServerContext>,
    split: &Split,
    conn: &Arc<Mutex<ConnLocks>>,
    out: &mut Routed,
) {
    let (locks, conn2, part) = (ctx.locks.clone(), conn.clone(), split.clone());
    let quorum = Box::pin(async move { locks.split_part(&part, conn2).await });
    let Some(primary) = split.primary_command() else {
        let split = split.clone();
        out.defer(Box::pin(async move { split.merge(None, quorum.await) }));
        return;
    };
    let quorum = match out.jobs.defer(quorum) {
        Ok(rx) => rx,
        // Too much in flight: refused whole, the primary's part unsent.
        Err(reply) => return out.batch.local(reply),
    };
    let (fed, primary_reply) = oneshot::channel::<Bytes>();
    let (merged, reply) = oneshot::channel();
    let split = split.clone();
    // Ends once both parts are in, or when either side is gone (the
    // session ended: its writer and job runner drop their ends).
    tokio::spawn(async move {
        let (primary_reply, quorum) = tokio::join!(primary_reply, quorum);
        let reply = match (primary_reply, quorum) {
            (Ok(p), Ok(q)) => split.merge(Some(&p), q),
            _ => LocalReply::err("lockgate: internal error (a part of the reply was lost)"),
        };
        let _ = merged.send(reply);
    });
    out.pieces.own(primary);
    out.batch.feed(fed);
    out.batch.deferred(reply);
}
