//! Where a session meets the retry-storm room: the lock room decides
//! ([`crate::lock::LockService::admit`]: absorbed, parked, delayed, or on
//! to Redis) and this module carries the decision's pieces that need the
//! session's context (the acquirer a parked attempt's driver uses, the
//! quorum).

use std::sync::{Arc, Mutex};

use crate::context::ServerContext;
use crate::lock::lease::ConnLocks;
use crate::lock::ops::LockOp;
use crate::lock::Park;
use crate::protocol::encode::LocalReply;

pub use crate::lock::admit::Early;

/// Decides an acquisition before it goes upstream (see
/// [`crate::lock::LockService::admit`]); a parked attempt's driver acquires
/// through `ctx`.
pub fn admit(
    ctx: &Arc<ServerContext>,
    op: &LockOp,
    conn: &Arc<Mutex<ConnLocks>>,
    tracked: bool,
    parkable: bool,
) -> Early {
    ctx.locks.admit(op, conn, tracked, parkable, || ctx.clone())
}

/// An acquisition on the quorum that may wait for a handoff if refused.
pub async fn quorum_attempt(
    ctx: Arc<ServerContext>,
    op: LockOp,
    conn: Arc<Mutex<ConnLocks>>,
    park: Option<Park>,
) -> LocalReply {
    let Some(q) = ctx.quorum.clone() else {
        return LocalReply::err("lockgate: internal error (no quorum)");
    };
    let (LockOp::Acquire { key, shape, .. }, Some(park)) = (&op, park) else {
        return ctx.locks.on_quorum(&q, op, conn).await;
    };
    let (key, shape) = (key.clone(), *shape);
    let outcome = ctx
        .locks
        .quorum_acquire(&q, op.clone(), shape, park.lease_ms, conn.clone(), false)
        .await;
    if outcome.acquired || outcome.pttl <= 0 {
        return outcome.reply;
    }
    match ctx.locks.park(key, park, &conn, ctx.clone()) {
        Some(rx) => rx.await.unwrap_or(outcome.reply),
        None => outcome.reply,
    }
}
