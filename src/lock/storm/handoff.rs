//! Handoffs that ride on a release. When a connection of this instance
//! releases a lock that attempts are parked on, its release script also
//! acquires the lock for the oldest parked attempt ([`crate::script::RELEASE_HANDOFF`]):
//! one round trip to Redis, and no moment when the lock is free for a
//! spinner elsewhere to grab out of turn. The attempt is claimed while the
//! release is on its way ([`Storm::claim`]), so the driver neither times it
//! out nor acquires for it twice; the release's answer settles the claim
//! ([`Storm::hand_over`] or [`Storm::unclaim`]). A claim whose answer never
//! comes (the releasing connection died) lapses, and the driver carries on.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::oneshot;

use super::event::{Action, Event};
use super::{shaped, Storm};
use crate::lock::lease::ConnLocks;
use crate::lock::ops::Shape;
use crate::protocol::encode::LocalReply;

/// A parked attempt a release will hand the lock to, as the release's
/// plan records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// The parked attempt (the storm's waiter id).
    pub id: u64,
    /// The owner token it acquires with.
    pub token: Bytes,
    /// Its value.
    pub value: Bytes,
    /// Its lease, ms.
    pub lease_ms: u64,
}

/// A handoff that happened: what the new holder's connection must record
/// and the reply it is waiting for. Settled by the caller once it holds no
/// other connection's lock table ([`crate::lock::LockService::finish_handoff`]).
#[derive(Debug)]
pub struct HandedOver {
    /// The lock key.
    pub key: Bytes,
    /// The claim the release carried.
    pub claim: Claim,
    /// What the attempt expects back.
    pub shape: Shape,
    /// The new holder's lock records.
    pub conn: Arc<Mutex<ConnLocks>>,
    /// Its parked reply.
    pub reply: Option<oneshot::Sender<LocalReply>>,
}

impl HandedOver {
    /// Answers the new holder "acquired"; false if it stopped waiting.
    pub fn deliver(self) -> bool {
        self.reply
            .map(|r| r.send(shaped(self.shape, true)).is_ok())
            .unwrap_or(false)
    }
}

impl Storm {
    /// Claims the oldest parked attempt on `key` for a release about to be
    /// sent, for at most `within` (how long the release may take to be
    /// answered). `None` when nothing is parked, the front of the queue is
    /// a kept place (its connection is between attempts), or the driver is
    /// acquiring for it already. `token` is the attempt's new owner token.
    pub fn claim(&self, key: &[u8], token: Bytes, within: Duration) -> Option<Claim> {
        // A fencing wait came first: the release frees the lock for it.
        if self.fence_first(key) {
            return None;
        }
        let actions = self.on_key(key, false, Event::Claim { token, within })?;
        actions.into_iter().find_map(|a| match a {
            Action::Claimed(claim) => Some(claim),
            _ => None,
        })
    }

    /// The release carrying `claim` gave the lock to it: the key is held by
    /// this instance for the claim's lease, and the attempt leaves the
    /// queue. `None` if the claim had lapsed and its attempt is gone.
    pub fn hand_over(&self, key: &[u8], claim: Claim) -> Option<HandedOver> {
        let event = Event::HandedOver {
            claim: claim.clone(),
        };
        let actions = self.on_key(key, false, event)?;
        actions.into_iter().find_map(|a| match a {
            Action::HandedOver { waiter } => Some(HandedOver {
                key: Bytes::copy_from_slice(key),
                claim: claim.clone(),
                shape: waiter.ask.shape,
                conn: waiter.ask.conn,
                reply: waiter.reply,
            }),
            _ => None,
        })
    }

    /// The release carrying a claim did not release (refused, or its lease
    /// had lapsed): the attempt waits on as before.
    pub fn unclaim(&self, key: &[u8], claim: &Claim) {
        self.on_key(key, false, Event::Unclaimed { id: claim.id });
    }
}
