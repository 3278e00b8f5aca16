//! Lock operations on the quorum. The commands are the same Lua as on one
//! Redis ([`LockService::plan`]); what differs is that they go to every
//! master and the answer is merged: an acquisition stands only with a
//! majority and positive validity (else it is released everywhere), other
//! operations take the majority's answer.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;

use super::{integer, majority_identical, majority_integer, now_unix_ms, Quorum};
use crate::lock::lease::{ConnLocks, Standing};
use crate::lock::ops::{LockOp, Shape, Ttl};
use crate::lock::{split_reply, LockPending, LockService};
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;
use crate::script;
use crate::sync;
use crate::upstream::node::Request;

/// A master's reply as a reply lockgate writes: nulls become the client's
/// protocol's null, errors and integers keep their meaning, the rest passes
/// as bytes.
pub fn as_local(reply: &[u8]) -> LocalReply {
    match reply {
        b"$-1\r\n" | b"*-1\r\n" | b"_\r\n" => LocalReply::Null,
        [b'-', rest @ ..] => LocalReply::Error(Bytes::copy_from_slice(rest.trim_ascii_end())),
        _ => match integer(reply) {
            Some(n) => LocalReply::Integer(n),
            None => LocalReply::Raw(Bytes::copy_from_slice(reply)),
        },
    }
}

/// What an acquisition on the quorum came to.
#[derive(Debug)]
pub struct Outcome {
    /// The client's reply.
    pub reply: LocalReply,
    /// Acquired (by a majority, with validity left).
    pub acquired: bool,
    /// The lease granted (acquired) or the holder's remaining lease, ms.
    pub pttl: i64,
    /// Not acquired, and a majority of the masters have another instance
    /// first in the key's queue: how long to wait for the wake-up, ms (0:
    /// not behind).
    pub behind_ms: u64,
}

impl Outcome {
    fn failed(reply: LocalReply) -> Outcome {
        Outcome {
            reply,
            acquired: false,
            pttl: -3,
            behind_ms: 0,
        }
    }
}

/// The lease in ms a TTL option stands for now, or an error reply.
pub fn lease_of(ttl: &Ttl, default_ms: u64) -> Result<u64, LocalReply> {
    let Ttl::Given(kind, v) = ttl else {
        return Ok(default_ms);
    };
    let n = std::str::from_utf8(v)
        .ok()
        .and_then(|s| s.parse::<i64>().ok())
        .ok_or_else(|| LocalReply::err("value is not an integer or out of range"))?;
    let now = now_unix_ms() as i64;
    let ms = match *kind {
        "EX" => n.saturating_mul(1000),
        "PX" => n,
        "EXAT" => n.saturating_mul(1000) - now,
        _ => n - now,
    };
    if ms <= 0 {
        return Err(LocalReply::err("invalid expire time in 'set' command"));
    }
    Ok(ms as u64)
}

fn not_acquired(shape: Shape) -> LocalReply {
    match shape {
        Shape::SetNx => LocalReply::Integer(0),
        _ => LocalReply::Null,
    }
}

impl LockService {
    /// Carries out `op` on the quorum for a client connection whose records
    /// are `conn`, and returns the client's reply.
    pub(crate) async fn on_quorum(
        &self,
        q: &Quorum,
        op: LockOp,
        conn: Arc<Mutex<ConnLocks>>,
    ) -> LocalReply {
        if let LockOp::Acquire {
            key, ttl, shape, ..
        } = &op
        {
            let lease = match lease_of(ttl, self.lease_ms(key)) {
                Ok(ms) => ms,
                Err(reply) => return reply,
            };
            return self
                .quorum_acquire(q, op.clone(), *shape, lease, conn, false)
                .await
                .reply;
        }
        // What guard records must follow, read before the plan changes the
        // connection's records.
        let follow = self.guard_follow(&op, &sync::lock(&conn));
        let planned = self.plan(op, &mut sync::lock(&conn), crate::lock::Queueing::Now);
        let Some(pending) = planned.pending else {
            return LocalReply::err("lockgate: internal error (no outcome planned)");
        };
        // Answered once a majority agrees: the masters not waited for
        // still run it (see `Quorum::ask_agreed`).
        let answers = q.ask_agreed(&planned.call.request()).await;
        if answers.replies.len() < q.majority() {
            return q.no_quorum(answers.replies.len());
        }
        let split: Vec<(&[u8], Vec<i64>)> =
            answers.replies.iter().map(|r| split_reply(r)).collect();
        let facts = merge_facts(&split, q.majority());
        let reply = match &pending {
            LockPending::Takeover { .. } => {
                let replies: Vec<Bytes> = split
                    .iter()
                    .map(|(r, _)| Bytes::copy_from_slice(r))
                    .collect();
                match majority_identical(&replies, q.majority()) {
                    Some(r) => as_local(r),
                    None => {
                        LocalReply::err("lockgate: lock masters disagree on the takeover's reply")
                    }
                }
            }
            _ => {
                let ints: Vec<i64> = split.iter().filter_map(|(r, _)| integer(r)).collect();
                match majority_integer(&ints, q.majority()) {
                    Some(n) => LocalReply::Integer(n),
                    None => match split.first() {
                        Some((r, _)) if r.first() == Some(&b'-') => as_local(r),
                        _ => q.no_quorum(ints.len()),
                    },
                }
            }
        };
        let took = match &pending {
            LockPending::Takeover { token, .. } => Some(token.clone()),
            _ => None,
        };
        let by_value = crate::lock::reply::by_value_elsewhere(&pending, &facts, &sync::lock(&conn));
        self.complete(pending, &facts, &mut sync::lock(&conn));
        // A library's release sent on another connection than the one
        // that acquired (a pool's): that one's holding ends too.
        if let Some((keys, value, upto)) = by_value {
            self.released_by_value(&keys, &value, upto);
        }
        if let Some(follow) = follow {
            self.guard_records_follow(follow, &reply, took).await;
        }
        reply
    }

    /// Redlock acquisition: the acquire script on every eligible master in
    /// parallel; acquired iff a majority said yes and validity is positive,
    /// else released on every master before answering.
    pub(crate) async fn quorum_acquire(
        &self,
        q: &Quorum,
        op: LockOp,
        shape: Shape,
        lease_ms: u64,
        conn: Arc<Mutex<ConnLocks>>,
        handoff: bool,
    ) -> Outcome {
        let LockOp::Acquire { key, value, .. } = &op else {
            return Outcome::failed(LocalReply::err(
                "lockgate: internal error (not an acquisition)",
            ));
        };
        let (key, value) = (key.clone(), value.clone());
        let eligible = q.eligible();
        if eligible.len() < q.votes_needed() {
            ProxyMetrics::inc(&self.metrics.quorum_failures);
            // A lost quorum, not a holder: the next attempt asks the
            // masters again (and sees the same answer).
            self.storm.unprobe(&key);
            return Outcome::failed(q.loss_reply(not_acquired(shape)));
        }
        let planned = self.plan_on_quorum(op, &mut sync::lock(&conn), !handoff);
        let Some(LockPending::Acquire { token, .. }) = planned.pending.clone() else {
            return Outcome::failed(LocalReply::err(
                "lockgate: internal error (no acquisition planned)",
            ));
        };
        // More than (N + clock_faults) / 2: a plain majority by default.
        let (n, majority) = (q.masters.len(), q.votes_needed());
        let started = Instant::now();
        // A "yes" from a master whose clock jumped does not count (its
        // holder's key may have expired early there): see `clock`.
        let answers = q
            .ballot(
                &eligible,
                &planned.call.request(),
                script::ACQUIRE_CLOCK_FACT,
                |r| split_reply(r).1,
                |y, answered| y >= majority || answered - y + (n - eligible.len()) > n - majority,
            )
            .await;
        let granted = answers.yes;
        let dropped: i64 = (answers.replies.iter())
            .filter_map(|r| split_reply(r).1.get(script::ACQUIRE_DROPPED_FACT).copied())
            .sum();
        ProxyMetrics::add(&self.metrics.queue_places_lapsed, dropped.max(0) as u64);
        let validity = q.validity_ms(lease_ms, started.elapsed());
        if granted >= majority && validity > 0 {
            q.granted(lease_ms);
            if let Some(pending) = planned.pending {
                self.complete(pending, &[1, lease_ms as i64], &mut sync::lock(&conn));
            }
            // Guarded data on the primary: its record, valid no longer than
            // the lock, before the holder hears it holds it.
            if self.keeps_guard_record(&key) {
                let ms = q.validity_ms(lease_ms, started.elapsed());
                if ms > 0 {
                    self.guard_record_acquired(&key, &token, ms as u64).await;
                }
            }
            return Outcome {
                reply: crate::lock::storm::shaped(shape, true),
                acquired: true,
                pttl: lease_ms as i64,
                behind_ms: 0,
            };
        }
        // Not acquired: undo it everywhere, also where the answer was late.
        let undo =
            crate::lock::evalsha::eval_queued(script::RELEASE_TOKEN, &key, &[&token, &value]);
        q.ask_all(&undo.into()).await;
        sync::lock(&conn).settle(&key, &token, Standing::Lost, None);
        if q.lost_quorum(granted, answers.replies.len(), eligible.len()) {
            ProxyMetrics::inc(&self.metrics.quorum_failures);
            // Enough masters were up, but too few answered in time.
            self.storm.unprobe(&key);
            return Outcome::failed(q.late_reply(answers.replies.len(), not_acquired(shape)));
        }
        ProxyMetrics::inc(&self.metrics.contended);
        // Masters that held this instance back for a longer waiter
        // elsewhere: counted once per attempt.
        if answers
            .replies
            .iter()
            .any(|r| split_reply(r).1.get(script::ACQUIRE_YIELD_FACT) == Some(&1))
        {
            ProxyMetrics::inc(&self.metrics.fairness_yields);
        }
        // The holder's remaining lease, as the majority of "no"s sees it.
        let pttls: Vec<i64> = answers
            .replies
            .iter()
            .map(|r| split_reply(r).1)
            .filter(|f| f.first() == Some(&0))
            .filter_map(|f| f.get(1).copied())
            .collect();
        let pttl = pttls.iter().copied().min().unwrap_or(-3);
        // Behind another instance on a majority: wait for the wake-up (one
        // per master that frees the lock) instead of probing.
        let scales: Vec<i64> = (answers.replies.iter())
            .filter_map(|r| split_reply(r).1.get(script::ACQUIRE_BEHIND_FACT).copied())
            .filter(|&s| s > 0)
            .collect();
        let scale = match scales.len() >= majority {
            true => scales.iter().copied().min().unwrap_or(0),
            false => 0,
        };
        let behind_ms = self.behind_ms(&key, scale);
        self.storm.learned(&key, false, pttl, behind_ms);
        let reply = match shape {
            Shape::SetGet => {
                let olds: Vec<Bytes> = answers
                    .replies
                    .iter()
                    .filter(|r| split_reply(r).1.first() == Some(&0))
                    .map(|r| Bytes::copy_from_slice(split_reply(r).0))
                    .collect();
                olds.first()
                    .map(|o| as_local(o))
                    .unwrap_or(LocalReply::Null)
            }
            _ => not_acquired(shape),
        };
        Outcome {
            reply,
            acquired: false,
            pttl,
            behind_ms,
        }
    }

    /// A read (`GET`, `EXISTS`, `TTL`, `PTTL`, `TYPE`) of lock keys: the
    /// majority's answer; integers (TTLs) the smallest within the majority.
    pub(crate) async fn quorum_read(&self, q: &Quorum, command: Bytes) -> LocalReply {
        let answers = q.ask_agreed(&command.into()).await;
        merge_replies(q, &answers.replies)
    }

    /// A client script whose keys are all lock keys, run on every master;
    /// a master that lost the script (an `EVALSHA` answered `NOSCRIPT`)
    /// runs `fallback`, the same call as `EVAL` with the body lockgate has
    /// seen, so it runs exactly once everywhere (see [`Request`]).
    pub(crate) async fn quorum_eval(
        &self,
        q: &Quorum,
        command: Bytes,
        fallback: Option<Bytes>,
    ) -> LocalReply {
        let answers = q.ask_all(&Request { command, fallback }).await;
        merge_replies(q, &answers.replies)
    }
}

/// Facts merged per position by the majority rule.
fn merge_facts(split: &[(&[u8], Vec<i64>)], majority: usize) -> Vec<i64> {
    let width = split.iter().map(|(_, f)| f.len()).max().unwrap_or(0);
    (0..width)
        .map(|i| {
            let column: Vec<i64> = split
                .iter()
                .filter_map(|(_, f)| f.get(i).copied())
                .collect();
            majority_integer(&column, majority).unwrap_or(0)
        })
        .collect()
}

/// The majority-identical reply; for integers that differ, the smallest
/// within the majority; otherwise an error naming the disagreement.
fn merge_replies(q: &Quorum, replies: &[Bytes]) -> LocalReply {
    if replies.len() < q.majority() {
        return q.no_quorum(replies.len());
    }
    if let Some(r) = majority_identical(replies, q.majority()) {
        return as_local(r);
    }
    let ints: Vec<i64> = replies.iter().filter_map(|r| integer(r)).collect();
    if let Some(n) = majority_integer(&ints, q.majority()) {
        return LocalReply::Integer(n);
    }
    LocalReply::err(format!(
        "lockgate: lock masters disagree ({} answers, no majority alike)",
        replies.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn master_replies_become_local_replies() {
        assert_eq!(as_local(b"$-1\r\n"), LocalReply::Null);
        assert_eq!(as_local(b":7\r\n"), LocalReply::Integer(7));
        assert_eq!(
            as_local(b"-ERR x\r\n"),
            LocalReply::Error(Bytes::from_static(b"ERR x"))
        );
        assert_eq!(
            as_local(b"$1\r\na\r\n"),
            LocalReply::Raw(Bytes::from_static(b"$1\r\na\r\n"))
        );
    }

    #[test]
    fn leases_from_options() {
        assert_eq!(lease_of(&Ttl::Default, 30), Ok(30));
        assert_eq!(
            lease_of(&Ttl::Given("EX", Bytes::from_static(b"2")), 30),
            Ok(2000)
        );
        assert!(lease_of(&Ttl::Given("PX", Bytes::from_static(b"x")), 30).is_err());
        assert!(lease_of(&Ttl::Given("PX", Bytes::from_static(b"0")), 30).is_err());
    }
}
