//! Acquisitions the lock room makes for a client away from the client's
//! own upstream connection: an attempt on the quorum that may wait for a
//! handoff, and a parked attempt's driver acquiring for its waiter. Both
//! decide the outcome from the owner record in Redis (the same scripts as
//! any acquisition) and record it on the client connection's lock records.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::lease::ConnLocks;
use super::ops::{LockOp, Ttl};
use super::quorum::Quorum;
use super::replicas::Won;
use super::storm::{Acquirer, Ask, Tried};
use super::txn::OnPrimary;
use super::{split_reply, LockService, Park};
use crate::protocol::encode::{self, LocalReply};
use crate::script;
use crate::sync;

impl LockService {
    /// An operation on the quorum from a client's session. An acquisition
    /// refused while the lock is held waits for a handoff when `park` says
    /// it may (its driver acquires through `acquirer`); anything else is
    /// answered by the quorum at once.
    pub(crate) async fn quorum_attempt(
        &self,
        q: &Quorum,
        op: LockOp,
        conn: Arc<Mutex<ConnLocks>>,
        park: Option<Park>,
        acquirer: Arc<dyn Acquirer>,
    ) -> LocalReply {
        let (LockOp::Acquire { key, shape, .. }, Some(park)) = (&op, park) else {
            return self.on_quorum(q, op, conn).await;
        };
        let (key, shape) = (key.clone(), *shape);
        let outcome = self
            .quorum_acquire(q, op.clone(), shape, park.lease_ms, conn.clone(), false)
            .await;
        if outcome.acquired || outcome.pttl <= 0 {
            return outcome.reply;
        }
        match self.park(key, park, &conn, acquirer) {
            Some(rx) => rx.await.unwrap_or(outcome.reply),
            None => outcome.reply,
        }
    }

    /// A parked attempt's driver acquiring for its waiter, on the quorum
    /// when there is one, else through `primary` (bounded by `timeout`,
    /// as `EVALSHA`, rerun as `EVAL` if Redis lost the script).
    /// A failed call counts as not acquired with no lease known.
    pub(crate) async fn acquire_on_behalf(
        &self,
        quorum: Option<&Quorum>,
        primary: &OnPrimary,
        timeout: Duration,
        ask: Ask,
    ) -> Tried {
        let lease = ask.lease_ms;
        crate::metrics::ProxyMetrics::inc(&self.metrics.attempts_sent);
        let op = LockOp::Acquire {
            key: ask.key.clone(),
            value: ask.value.clone(),
            ttl: Ttl::Given("PX", bytes::Bytes::from(lease.to_string())),
            shape: ask.shape,
        };
        if let Some(q) = quorum {
            let out = self
                .quorum_acquire(q, op, ask.shape, lease, ask.conn, true)
                .await;
            return Tried {
                acquired: out.acquired,
                pttl: out.pttl,
                behind_ms: out.behind_ms,
            };
        }
        // A probe of a lock known held: a plain PTTL says whether it still
        // is; the acquisition goes only if it is free (one more round trip
        // then, none while it is held).
        if ask.check && primary.cluster.is_none() && !primary.scriptless() {
            crate::metrics::ProxyMetrics::inc(&self.metrics.checks);
            let look = encode::command(&[b"PTTL", &ask.key]);
            let reply = primary.call(look, timeout).await;
            match reply.as_deref().ok().and_then(super::txn::resp::as_int) {
                Some(-2) => crate::metrics::ProxyMetrics::inc(&self.metrics.check_reruns),
                Some(pttl) => {
                    self.storm.learned(&ask.key, false, pttl, 0);
                    return Tried {
                        acquired: false,
                        pttl,
                        behind_ms: 0,
                    };
                }
                None => return Tried::FAILED,
            }
        }
        let planned = self.plan_for_handoff(op, &mut sync::lock(&ask.conn));
        let Some(pending) = planned.pending else {
            return Tried::FAILED;
        };
        match primary.send(planned.call.request(), timeout).await {
            Ok(reply) => {
                let (_, facts) = split_reply(&reply);
                // Won: answered only once the replicas hold it (undone if
                // they do not in time).
                let won = match self.acks_asked() {
                    true => Won::of(&pending, &facts),
                    false => None,
                };
                self.complete(pending, &facts, &mut sync::lock(&ask.conn));
                // An error reply carries no facts: nothing learned.
                let Some(&pttl) = facts.get(1) else {
                    return Tried::FAILED;
                };
                let scale = facts.get(script::ACQUIRE_BEHIND_FACT).copied();
                if let Some(won) = won {
                    if !self.acknowledged(won, &ask.conn).await {
                        return Tried::FAILED;
                    }
                }
                Tried {
                    acquired: facts.first() == Some(&1),
                    pttl,
                    behind_ms: self.behind_ms(&ask.key, scale.unwrap_or(0)),
                }
            }
            Err(_) => Tried::FAILED,
        }
    }
}
