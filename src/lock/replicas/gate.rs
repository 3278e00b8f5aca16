//! Where grants meet replica acknowledgement: which pattern asks for it,
//! and a grant's reply held until the replicas answer.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::oneshot;

use super::{settle, AckRule, Grant};
use crate::lock::lease::ConnLocks;
use crate::lock::ops::Shape;
use crate::lock::{Database, LockPending, LockService};
use crate::protocol::encode::LocalReply;

/// A grant a reply just made, before the replicas are asked: its key,
/// owner token, value (`''`: not checked at its undo) and the command's
/// "not acquired" (`None`: it has none, the refusal is the error). An
/// extension is one too, never undone (the lock was its holder's before).
pub(crate) struct Won {
    /// Undone if not acknowledged (an acquisition, a takeover); an
    /// extension is only answered as refused.
    pub undo: bool,
    /// The primary's generation when the grant was planned, truncated.
    pub primary_at: u32,
    /// Its lease as granted, ms: once acknowledged it is remembered for
    /// as long (`Replicas::remember`).
    pub lease_ms: u64,
    /// The lock key.
    pub key: Bytes,
    /// The owner token its record holds (empty for an extension).
    pub token: Bytes,
    /// The value the key holds (`''`: not checked at the undo).
    pub value: Bytes,
    /// The command's "not acquired" (`None`: the refusal is the error).
    pub no: Option<LocalReply>,
}

impl Won {
    /// The grant `pending`'s reply made, by its `facts`: a won
    /// acquisition, a takeover that left a lease or an extension that
    /// moved one, in database 0 (an undo runs on lockgate's own
    /// connection, which reads database 0; elsewhere nothing is asked).
    pub(crate) fn of(pending: &LockPending, facts: &[i64]) -> Option<Won> {
        let plan = match pending {
            LockPending::Fast { then, .. } => then,
            p => p,
        };
        let first = facts.first().copied();
        // The lease each kind's facts carry, when it granted one.
        let lease = match plan {
            LockPending::Acquire { .. } if first == Some(1) => facts.get(1),
            LockPending::Takeover { .. } if first.is_some_and(|p| p > 0) => facts.first(),
            // Facts: allowed, lapsed, PTTL after; `:0` is "not extended".
            LockPending::Extend { .. }
                if first == Some(1) && facts.get(2).is_some_and(|&p| p > 0) =>
            {
                facts.get(2)
            }
            _ => return None,
        };
        Won::planned(plan, lease.copied().unwrap_or(0).max(0) as u64)
    }

    /// The grant `pending` plans, once made, with a lease of `lease_ms`:
    /// an acquisition or a takeover (undone if not acknowledged) or an
    /// extension (answered `:0`), in database 0; `None` for another plan.
    pub(crate) fn planned(pending: &LockPending, lease_ms: u64) -> Option<Won> {
        let won = |undo, primary_at: &u32, key: &Bytes, token: &Bytes, value: &Bytes, no| Won {
            undo,
            primary_at: *primary_at,
            lease_ms,
            key: key.clone(),
            token: token.clone(),
            value: value.clone(),
            no,
        };
        let none = Bytes::new();
        match pending {
            LockPending::Acquire {
                key,
                token,
                value,
                shape,
                primary_at,
                db: Database::Zero,
                ..
            } => Some(won(
                true,
                primary_at,
                key,
                token,
                value,
                not_acquired(*shape),
            )),
            LockPending::Takeover {
                key,
                token,
                primary_at,
            } => Some(won(true, primary_at, key, token, &none, None)),
            LockPending::Extend {
                key,
                primary_at,
                db: Database::Zero,
                ..
            } => Some(won(
                false,
                primary_at,
                key,
                &none,
                &none,
                Some(LocalReply::Integer(0)),
            )),
            _ => None,
        }
    }
}

/// An acquisition's "not acquired" in `shape`; `SET … NX GET` has none (a
/// nil is its "acquired").
pub(crate) fn not_acquired(shape: Shape) -> Option<LocalReply> {
    match shape {
        Shape::SetGet => None,
        s => Some(crate::lock::storm::shaped(s, false)),
    }
}

/// What [`settle`] takes from a lock room ([`LockService::settler`]).
pub(crate) struct Settler {
    replicas: Arc<super::Replicas>,
    primary: crate::lock::txn::OnPrimary,
    storm: Arc<crate::lock::storm::Storm>,
    timeout: Duration,
}

impl Settler {
    /// [`settle`] of `grant`: `Ok(yes)` once acknowledged, else `Err` of
    /// its refusal, the grant undone.
    pub(crate) async fn settle(
        &self,
        grant: Grant,
        yes: LocalReply,
    ) -> Result<LocalReply, LocalReply> {
        let Settler {
            replicas,
            primary,
            storm,
            timeout,
        } = self;
        settle(replicas, primary, storm, grant, yes, *timeout).await
    }
}

impl LockService {
    /// The primary's generation now (a grant planned now is acknowledged
    /// only by this primary's replicas); in front of a cluster, the slot
    /// map's.
    pub(crate) fn primary_at(&self) -> u32 {
        let store = self.store();
        match &store.primary.cluster {
            Some(cluster) => cluster.map_generation() as u32,
            None => super::generation(store.primary_addr()),
        }
    }

    /// What replica acknowledgement did (`lock_replica_ack_*`).
    pub fn replica_acks(&self) -> &super::AckMetrics {
        &self.store().replicas.metrics
    }

    /// Whether any pattern asks for replica acknowledgement: without, a
    /// grant is answered as it comes (the hot path looks no further).
    pub(crate) fn acks_asked(&self) -> bool {
        self.acks_on.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// [`LockService::primary_at`] when a grant may wait for the replicas,
    /// else 0 (never read).
    pub(crate) fn primary_at_if_acked(&self) -> u32 {
        match self.acks_asked() {
            true => self.primary_at(),
            false => 0,
        }
    }

    /// Waits for the acknowledgement of `won`, a grant recorded on
    /// `conn` that a lock room's own call made (a parked attempt's
    /// driver): true once acknowledged or when its pattern asks none;
    /// false when it was not, and was undone.
    pub(crate) async fn acknowledged(&self, won: Won, conn: &Arc<Mutex<ConnLocks>>) -> bool {
        let Some(rule) = self.ack_rule(&won.key) else {
            return true;
        };
        let grant = Grant {
            won,
            conn: Some(conn.clone()),
            rule,
        };
        self.settle_here(grant).await.is_ok()
    }

    /// `LOCKGATE LOCK`'s grant of `key`, whose owner record holds
    /// `instance_token`, planned in the primary's generation `primary_at`,
    /// for `lease_ms`: `Ok` once the replicas its pattern asks for hold it
    /// (or it asks none), else `Err` of the refusal (always the error: the
    /// caller asked for a token), the grant undone.
    pub(crate) async fn fence_acknowledged(
        &self,
        key: &Bytes,
        instance_token: &Bytes,
        primary_at: u32,
        lease_ms: u64,
    ) -> Result<(), LocalReply> {
        let Some(rule) = self.ack_rule(key) else {
            return Ok(());
        };
        let won = Won {
            undo: true,
            primary_at,
            lease_ms,
            key: key.clone(),
            token: instance_token.clone(),
            value: Bytes::new(),
            no: None,
        };
        let grant = Grant {
            won,
            conn: None,
            rule,
        };
        self.settle_here(grant).await.map(|_| ())
    }

    /// [`settle`] of `grant` through this lock room's store.
    async fn settle_here(&self, grant: Grant) -> Result<LocalReply, LocalReply> {
        self.settler().settle(grant, LocalReply::Null).await
    }

    /// What settling a grant takes from this lock room, owned, for a task
    /// that answers the grant's client later.
    pub(crate) fn settler(&self) -> Settler {
        let store = self.store();
        Settler {
            replicas: store.replicas.clone(),
            primary: store.primary.clone(),
            storm: self.storm.clone(),
            timeout: store.timeout(),
        }
    }

    /// The acknowledgement `key`'s pattern asks of the primary's replicas,
    /// if any (`locks.replicas_ack`, per pattern in `[[locks.overrides]]`).
    pub(crate) fn ack_rule(&self, key: &[u8]) -> Option<AckRule> {
        let rules = self.rules();
        if !rules.replicas_ack_any {
            return None;
        }
        let o = (rules.overrides.iter())
            .find(|(p, _)| p.matches(key))
            .map(|(_, o)| o);
        let replicas = o.and_then(|o| o.replicas_ack).unwrap_or(rules.replicas_ack);
        let timeout_ms =
            (o.and_then(|o| o.replicas_ack_timeout_ms)).unwrap_or(rules.replicas_ack_timeout_ms);
        let refusal =
            (o.and_then(|o| o.replicas_ack_refusal)).unwrap_or(rules.replicas_ack_refusal);
        (replicas > 0).then(|| AckRule {
            replicas,
            timeout: Duration::from_millis(timeout_ms),
            refusal,
        })
    }

    /// `won`, a grant recorded on `conn`, if its pattern asks for replica
    /// acknowledgement: its client's reply (`yes` once acknowledged) comes
    /// on the receiver; `Err(yes)` when it asks none.
    pub(crate) fn gate(
        &self,
        won: Won,
        conn: &Arc<Mutex<ConnLocks>>,
        yes: LocalReply,
    ) -> Result<oneshot::Receiver<LocalReply>, LocalReply> {
        let Some(rule) = self.ack_rule(&won.key) else {
            return Err(yes);
        };
        let settler = self.settler();
        let grant = Grant {
            won,
            conn: Some(conn.clone()),
            rule,
        };
        let (tx, rx) = oneshot::channel();
        // Bounded without a watch on the drain: the acker ends with it,
        // and the grant is then undone as unacknowledged.
        tokio::spawn(async move {
            let reply = settler.settle(grant, yes).await;
            let _ = tx.send(reply.unwrap_or_else(|no| no));
        });
        Ok(rx)
    }
}
