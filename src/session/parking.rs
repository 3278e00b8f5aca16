//! Where a session meets the retry-storm room ([`crate::lock::storm`]): an
//! attempt on a key known held is absorbed (answered, or parked, without
//! asking Redis), and an attempt Redis refused may be parked until the lock
//! is handed to it.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::oneshot;

use crate::context::ServerContext;
use crate::lock::lease::ConnLocks;
use crate::lock::ops::{LockOp, Shape};
use crate::lock::storm::{shaped, Admission, Ask};
use crate::lock::Park;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;
use crate::sync;

/// What became of an attempt before it reached Redis.
pub enum Early {
    /// Go to Redis; if it fails, park it with these settings.
    Probe(Option<Park>),
    /// Answered without Redis: now, or once parked.
    Now(LocalReply),
    /// Parked: the reply comes later.
    Parked(oneshot::Receiver<LocalReply>),
    /// Answered without Redis, after this delay (smoothing).
    Delayed(LocalReply, std::time::Duration),
}

/// Decides an acquisition before it goes upstream. `tracked`: lockgate may
/// answer for the connection (not inside MULTI, where Redis must queue the
/// command; database 0, which the contention table describes). `parkable`:
/// also nothing is pipelined behind it, so it may wait.
pub fn admit(
    ctx: &Arc<ServerContext>,
    op: &LockOp,
    conn: &Arc<Mutex<ConnLocks>>,
    tracked: bool,
    parkable: bool,
) -> Early {
    let LockOp::Acquire {
        key,
        value,
        ttl,
        shape,
    } = op
    else {
        return Early::Probe(None);
    };
    if !tracked || *shape == Shape::SetGet {
        return Early::Probe(None);
    }
    let (probe_ms, park_ms) = ctx.locks.retry_for(key);
    let Ok(lease_ms) = crate::lock::quorum_ops::lease_of(ttl, ctx.locks.lease_ms(key)) else {
        return Early::Probe(None);
    };
    let park = Park {
        value: value.clone(),
        shape: *shape,
        lease_ms,
        park_ms,
        probe_ms,
    };
    // Parking is for spin loops: only a connection whose previous attempt
    // on the key came moments ago waits. A try-lock is answered at once,
    // and a holder's own re-entrant attempt never waits for itself.
    let spinning = sync::lock(conn).get(key).is_some_and(|a| {
        a.standing != crate::lock::lease::Standing::Held
            && a.last_try.elapsed().as_millis() < u128::from(ctx.locks.rules().spin_window_ms())
    });
    let park_ms = if parkable && spinning { park_ms } else { 0 };
    match ctx.locks.storm.admit(key, probe_ms) {
        Admission::Probe => Early::Probe((park_ms > 0).then_some(Park { park_ms, ..park })),
        Admission::Absorb => {
            // An attempt on a held key, answered without asking Redis.
            ProxyMetrics::inc(&ctx.locks.metrics.attempts);
            ProxyMetrics::inc(&ctx.locks.metrics.contended);
            ctx.locks.hot.record(key, crate::hotkeys::Event::Absorbed);
            // Recorded as lost, so an EXPIRE that follows cannot move the
            // holder's lease.
            let token = ctx.locks.next_token();
            let since_last = sync::lock(conn).lost(key.clone(), token);
            if park_ms > 0 {
                if let Some(rx) = park_it(ctx, key.clone(), park, conn) {
                    ctx.locks.hot.record(key, crate::hotkeys::Event::Parked);
                    return Early::Parked(rx);
                }
            }
            // Smoothing: a connection hammering one key faster than
            // max_attempts_per_sec waits out the rest of its interval.
            let rate = ctx.locks.rules().max_attempts_per_sec();
            let interval = std::time::Duration::from_micros(1_000_000 / rate.max(1));
            match since_last {
                Some(gap) if rate > 0 && gap < interval => {
                    ProxyMetrics::inc(&ctx.locks.storm.metrics.smoothed);
                    Early::Delayed(shaped(*shape, false), interval - gap)
                }
                _ => Early::Now(shaped(*shape, false)),
            }
        }
    }
}

fn park_it(
    ctx: &Arc<ServerContext>,
    key: Bytes,
    park: Park,
    conn: &Arc<Mutex<ConnLocks>>,
) -> Option<oneshot::Receiver<LocalReply>> {
    let (since, conn_id) = {
        let c = sync::lock(conn);
        (c.first_try(&key)?, c.id)
    };
    let ask = Ask {
        key,
        value: park.value,
        shape: park.shape,
        lease_ms: park.lease_ms,
        conn: conn.clone(),
        conn_id,
    };
    let acquirer: Arc<dyn crate::lock::storm::Acquirer> = ctx.clone();
    ctx.locks
        .storm
        .park(acquirer, ask, since, park.park_ms, park.probe_ms)
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
    match park_it(&ctx, key, park, &conn) {
        Some(rx) => rx.await.unwrap_or(outcome.reply),
        None => outcome.reply,
    }
}
