//! The outcome of a lock script's reply, decided in the lock room: the
//! facts are learned ([`LockService::complete`]), a handoff the release
//! made is settled, and a failed attempt that may wait is parked. The
//! session's writer only hands the reply over and writes what it is told.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::oneshot;

use super::lease::ConnLocks;
use super::storm::{Acquirer, Ask};
use super::{split_reply, LockPending, LockService, Park};
use crate::protocol::encode::LocalReply;
use crate::sync;

/// What the client gets for a lock script's reply.
#[derive(Debug)]
pub enum ReplyOutcome {
    /// These bytes, now: the client's reply with its command's shape.
    Reply(Bytes),
    /// A failed attempt was parked: its reply comes when the lock is
    /// handed to it or its wait ends, and every later reply waits for it.
    Parked(oneshot::Receiver<LocalReply>),
}

impl LockService {
    /// Learns the outcome of `frame`, Redis's whole reply to the script
    /// planned for `pending` on `conn`'s behalf, and says what the client
    /// gets. `acquirer` acquires for a parked attempt when the lock frees.
    pub fn on_reply(
        &self,
        pending: LockPending,
        frame: Bytes,
        conn: &Arc<Mutex<ConnLocks>>,
        acquirer: &dyn Fn() -> Arc<dyn Acquirer>,
    ) -> ReplyOutcome {
        let (reply, facts) = match pending {
            // A client script's reply is the client's, whole.
            LockPending::Script { .. } => (frame.clone(), Vec::new()),
            _ => {
                let (reply, facts) = split_reply(&frame);
                (frame.slice_ref(reply), facts)
            }
        };
        let park = failed_attempt(&pending, &facts);
        let handed = self.complete(pending, &facts, &mut sync::lock(conn));
        // The release gave the lock to a parked attempt of another
        // connection: settled with this one unlocked.
        if let Some(handed) = handed {
            self.finish_handoff(handed);
        }
        match park.and_then(|(key, park)| self.park(acquirer(), key, park, conn)) {
            Some(rx) => ReplyOutcome::Parked(rx),
            None => ReplyOutcome::Reply(reply),
        }
    }

    /// Parks an attempt of `conn` on `key` until the lock is handed to it
    /// or `park.park_ms` passes; `None` when it cannot wait (the
    /// connection has no attempt on the key, or the storm room refuses).
    pub fn park(
        &self,
        acquirer: Arc<dyn Acquirer>,
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
        self.storm
            .park(acquirer, ask, since, park.park_ms, park.probe_ms)
    }
}

/// The key and park settings of a failed acquisition that may be parked.
fn failed_attempt(pending: &LockPending, facts: &[i64]) -> Option<(Bytes, Park)> {
    match pending {
        LockPending::Acquire {
            key,
            park: Some(park),
            ..
        } if facts.first() == Some(&0) => Some((key.clone(), park.clone())),
        _ => None,
    }
}
