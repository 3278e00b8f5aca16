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

/// An operation on the quorum from this session (see
/// [`crate::lock::LockService::quorum_attempt`]); a parked attempt's driver
/// acquires through `ctx`.
pub async fn quorum_attempt(
    ctx: Arc<ServerContext>,
    op: LockOp,
    conn: Arc<Mutex<ConnLocks>>,
    park: Option<Park>,
) -> LocalReply {
    let Some(q) = ctx.quorum.clone() else {
        return LocalReply::err("lockgate: internal error (no quorum)");
    };
    ctx.locks
        .quorum_attempt(&q, op, conn, park, ctx.clone())
        .await
}
