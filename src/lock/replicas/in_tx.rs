//! Grants made inside a client's `MULTI` (`MULTI; SETNX k v; EXPIRE k t;
//! EXEC`, the incident's app's shape made atomic). Their scripts are
//! queued as `EVAL` and answer the bare reply inside `EXEC`'s array, so a
//! grant is read there, at the place the router counted for it
//! (`SessionView::tx_slots`), and `EXEC` is answered once the replicas
//! hold every grant in it. One not acknowledged is undone by its own
//! token and its place answered as outside a transaction: the command's
//! "not acquired", or the error (`locks.replicas_ack_refusal`).
//!
//! Should `EXEC`'s array not have one element per command counted (a
//! server queuing differently than the router counts), no place can be
//! trusted: every recorded grant is taken as made, and if any is not
//! acknowledged all are undone and `EXEC` is answered with the error.
//! `EXECABORT` or a nil array (a watched key changed): nothing ran,
//! nothing waits.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::oneshot;

use super::gate::Won;
use super::Grant;
use crate::lock::lease::ConnLocks;
use crate::lock::ops::Shape;
use crate::lock::txn::resp;
use crate::lock::{Database, LockPending, LockService, ReplyOutcome};
use crate::protocol::encode::LocalReply;

/// Most grants one transaction may queue for acknowledgement: past it
/// the acquisition is refused in its place (`lock_replica_ack_full`).
pub const MAX_IN_TX: usize = 1_024;

/// The refusal of an acquisition past [`MAX_IN_TX`] in one transaction.
pub const TOO_MANY: &str =
    "lockgate: too many lock grants in one transaction for the replicas to acknowledge (at most 1024, locks.replicas_ack)";

/// The grant `pending` (planned inside `MULTI`) made, read from its
/// place in `EXEC`'s array (`None`: the place is unknown, so it is taken
/// as made; an undo is by its own token, never another owner's lock).
/// A lease is not in the bare reply: it is remembered for `lease_ms`,
/// the longest any lock keeps (`locks.failover_delay_ms`).
pub(crate) fn won_in_tx(
    pending: &LockPending,
    element: Option<&[u8]>,
    lease_ms: u64,
) -> Option<Won> {
    let is = |yes: &[&[u8]]| element.is_none_or(|e| yes.contains(&e));
    let made = match pending {
        LockPending::Acquire { shape, .. } => is(match shape {
            Shape::SetNx => &[b":1\r\n"],
            Shape::Set => &[b"+OK\r\n"],
            Shape::SetGet => &[b"$-1\r\n", b"_\r\n"],
        }),
        LockPending::Takeover { .. } => !element.is_some_and(|e| e.starts_with(b"-")),
        LockPending::Extend { .. } => is(&[b":1\r\n"]),
        _ => false,
    };
    made.then(|| Won::planned(pending, lease_ms)).flatten()
}

impl LockService {
    /// Whether `pending`, planned inside `MULTI`, may make a grant whose
    /// pattern asks for replica acknowledgement (kept for its `EXEC`).
    pub(crate) fn acked_in_tx(&self, pending: &LockPending) -> bool {
        let key = match pending {
            LockPending::Acquire {
                key,
                db: Database::Zero,
                ..
            }
            | LockPending::Extend {
                key,
                db: Database::Zero,
                ..
            }
            | LockPending::Takeover { key, .. } => key,
            _ => return false,
        };
        self.ack_rule(key).is_some()
    }

    /// `EXEC`'s reply `frame`, for a transaction of `slots` commands that
    /// queued `grants` (each at its place): answered once the replicas
    /// hold each grant made, the ones not acknowledged undone and their
    /// places answered with their refusal.
    pub(crate) fn exec_acked(
        &self,
        grants: Vec<(u32, LockPending)>,
        slots: u32,
        frame: Bytes,
        conn: &Arc<Mutex<ConnLocks>>,
    ) -> ReplyOutcome {
        let Some(elements) = resp::elements(&frame) else {
            return ReplyOutcome::Reply(frame);
        };
        let exact = elements.len() == slots as usize;
        let lease_ms = self.failover_delay().as_millis() as u64;
        let mut waits = Vec::new();
        for (slot, pending) in grants {
            let element = (elements.get(slot as usize)).filter(|_| exact);
            let Some(won) = won_in_tx(&pending, element.map(|e| &e[..]), lease_ms) else {
                continue;
            };
            let Some(rule) = self.ack_rule(&won.key) else {
                continue;
            };
            let conn = Some(conn.clone());
            waits.push((slot as usize, Grant { won, conn, rule }));
        }
        if waits.is_empty() {
            return ReplyOutcome::Reply(frame);
        }
        let settler = self.settler();
        let (tx, rx) = oneshot::channel();
        // Bounded as a single grant's wait: every grant joins the same
        // rounds, and each undo is one call.
        tokio::spawn(async move {
            let settled = waits.into_iter().map(|(slot, grant)| {
                let settler = &settler;
                async move { (slot, settler.settle(grant, LocalReply::Null).await) }
            });
            let settled = futures_util::future::join_all(settled).await;
            let _ = tx.send(answer(elements, exact, frame, settled));
        });
        ReplyOutcome::Parked(rx)
    }
}

/// `EXEC`'s answer once each grant in it is `settled` (its place, and
/// `Err` of its refusal when not acknowledged): the array with those
/// places replaced; when the places were not `exact`, the reply as it
/// came if all were acknowledged, else the first refusal as an error.
fn answer(
    elements: Vec<Bytes>,
    exact: bool,
    frame: Bytes,
    settled: Vec<(usize, Result<LocalReply, LocalReply>)>,
) -> LocalReply {
    if !exact {
        return match settled.into_iter().find_map(|(_, r)| r.err()) {
            None => LocalReply::Raw(frame),
            Some(LocalReply::Error(e)) => LocalReply::Error(e),
            Some(_) => LocalReply::err(
                "lockgate: lock not granted: the replicas did not acknowledge it; the transaction ran and its lock grants were undone (locks.replicas_ack)",
            ),
        };
    }
    let mut out: Vec<LocalReply> = elements.into_iter().map(LocalReply::Raw).collect();
    for (slot, r) in settled {
        if let (Err(no), Some(place)) = (r, out.get_mut(slot)) {
            *place = no;
        }
    }
    LocalReply::Array(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acquire(shape: Shape, db: Database) -> LockPending {
        LockPending::Acquire {
            key: Bytes::from_static(b"lock:a"),
            token: Bytes::from_static(b"t"),
            value: Bytes::from_static(b"v"),
            shape,
            primary_at: 7,
            park: None,
            db,
        }
    }

    /// What, the planned grant, its place in `EXEC`'s array, and the
    /// grant read (`Some(undo)`) or none.
    type Case = (
        &'static str,
        LockPending,
        Option<&'static [u8]>,
        Option<bool>,
    );

    #[test]
    fn a_grant_is_read_at_its_place() {
        let z = Database::Zero;
        let extend = LockPending::Extend {
            key: Bytes::from_static(b"lock:a"),
            upto: 1,
            db: z,
            primary_at: 7,
        };
        let cases: &[Case] = &[
            (
                "SETNX won",
                acquire(Shape::SetNx, z),
                Some(b":1\r\n"),
                Some(true),
            ),
            (
                "SETNX lost",
                acquire(Shape::SetNx, z),
                Some(b":0\r\n"),
                None,
            ),
            (
                "SET NX won",
                acquire(Shape::Set, z),
                Some(b"+OK\r\n"),
                Some(true),
            ),
            (
                "SET NX lost",
                acquire(Shape::Set, z),
                Some(b"$-1\r\n"),
                None,
            ),
            (
                "SET NX GET won",
                acquire(Shape::SetGet, z),
                Some(b"_\r\n"),
                Some(true),
            ),
            (
                "SET NX GET lost",
                acquire(Shape::SetGet, z),
                Some(b"$1\r\nx\r\n"),
                None,
            ),
            (
                "an error",
                acquire(Shape::SetNx, z),
                Some(b"-ERR x\r\n"),
                None,
            ),
            ("place unknown", acquire(Shape::Set, z), None, Some(true)),
            (
                "database 1",
                acquire(Shape::SetNx, Database::Other),
                Some(b":1\r\n"),
                None,
            ),
            ("extended", extend.clone(), Some(b":1\r\n"), Some(false)),
            ("not extended", extend, Some(b":0\r\n"), None),
        ];
        for (what, pending, element, want) in cases {
            let won = won_in_tx(pending, *element, 500);
            assert_eq!(won.as_ref().map(|w| w.undo), *want, "{what}");
            if let Some(w) = won {
                assert_eq!((w.primary_at, w.lease_ms), (7, 500), "{what}");
            }
        }
    }

    #[test]
    fn refused_places_are_replaced_and_the_rest_kept() {
        let el = |s: &'static [u8]| Bytes::from_static(s);
        let elements = vec![el(b":1\r\n"), el(b":1\r\n"), el(b"+OK\r\n")];
        let frame = el(b"*3\r\n:1\r\n:1\r\n+OK\r\n");
        let settled = vec![(0, Err(LocalReply::Integer(0))), (2, Ok(LocalReply::Null))];
        let got = answer(elements.clone(), true, frame.clone(), settled);
        let want = LocalReply::Array(vec![
            LocalReply::Integer(0),
            LocalReply::Raw(el(b":1\r\n")),
            LocalReply::Raw(el(b"+OK\r\n")),
        ]);
        assert_eq!(got, want);
        let all_ok = vec![(0, Ok(LocalReply::Null))];
        let got = answer(elements.clone(), false, frame.clone(), all_ok);
        assert_eq!(got, LocalReply::Raw(frame.clone()));
        let refused = vec![(0, Err(LocalReply::Integer(0)))];
        let LocalReply::Error(e) = answer(elements, false, frame, refused) else {
            panic!("an error when the places are unknown");
        };
        assert!(e.starts_with(b"ERR lockgate: lock not granted"));
    }
}
