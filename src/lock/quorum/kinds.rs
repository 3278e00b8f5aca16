//! Shared, reentrant and counted locks and multi-key locks on the quorum
//! (see [`crate::lock::kinds`] for one Redis): a grant is taken on the
//! masters under an instance token, reporting each master's counter and
//! clock; with enough "yes" votes its token is worked out as an exclusive
//! fencing lock's is ([`super::fence::fence_token`]) and committed on
//! the masters that voted; otherwise what was taken is undone.
//!
//! Enough votes: more than (N + clock_faults) / 2, as for any lock; for
//! one of `P` permits of a semaphore also more than N·P/(P+1) masters
//! ([`permit_votes`]), because with a plain majority P+1 holders could
//! each hold a different majority without any master counting more
//! than P of them (three masters, two permits: {1,2}, {2,3}, {1,3}).
//!
//! A shared holder and an exclusive one never both hold a majority (two
//! majorities share a master, which refuses the second), so readers and
//! writers exclude each other as on one Redis.

use std::time::{Duration, Instant};

use bytes::Bytes;

use super::{integer, Quorum};
use crate::lock::fence::{integers, next_try, until_freed, Tried, Waiting, WAIT_STEP};
use crate::lock::kinds::{book, queued_book, writer_wait, Kind, KindCall, KindTry};
use crate::lock::LockService;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;
use crate::script::qkinds;

/// Where [`qkinds::QKIND_TAKE`]'s reply carries an owner's committed token
/// (an entry again), 0 for a new holder.
const REENTRY_FACT: usize = 4;

/// "Yes" votes one of `permits` permits needs among `masters`: at least
/// `needed` (the quorum's own), and more than masters·permits/(permits+1),
/// so that `permits + 1` holders cannot each hold their votes without
/// some master counting more than `permits` of them. Pure.
pub fn permit_votes(masters: usize, permits: u64, needed: usize) -> usize {
    let (m, p) = (masters as u128, u128::from(permits));
    let over = (m * p / (p + 1) + 1) as usize;
    needed.max(over).min(masters)
}

/// The token each key of a multi-key grant gets: one more than the larger
/// of the key's largest counter among the voters (`counters[i][k]`) and
/// their median clock (`clocks`, µs). Pure.
pub fn multi_tokens(counters: &[Vec<i64>], clocks: &[i64], keys: usize) -> Vec<i64> {
    let mut sorted = clocks.to_vec();
    sorted.sort_unstable();
    let clock = match sorted.len() {
        0 => 0,
        n => sorted[(n - 1) / 2],
    };
    (0..keys)
        .map(|k| {
            let counter = (counters.iter())
                .filter_map(|c| c.get(k).copied())
                .max()
                .unwrap_or(0);
            counter.max(clock) + 1
        })
        .collect()
}

/// The first error among `replies` that at least `votes` of them share
/// (the key is held as another kind, say): the call's answer.
fn agreed_error(replies: &[Bytes], votes: usize) -> Option<LocalReply> {
    let errors: Vec<&Bytes> = replies
        .iter()
        .filter(|r| r.first() == Some(&b'-'))
        .collect();
    let first = errors.first()?;
    (errors.iter().filter(|e| e == &first).count() >= votes).then(|| {
        LocalReply::Error(Bytes::copy_from_slice(
            first.strip_prefix(b"-").unwrap_or(first).trim_ascii_end(),
        ))
    })
}

impl LockService {
    /// `LOCKGATE LOCK … SHARED | OWNER` and `LOCKGATE ACQUIRE` on the
    /// quorum: tries until granted or the wait has passed, in line with
    /// this instance's other waits on the key.
    pub(crate) async fn quorum_kind_lock(&self, q: &Quorum, call: KindCall) -> LocalReply {
        let args = &KindTry::new(self, &call);
        let KindCall {
            at,
            ttl_ms,
            kind,
            owner,
        } = call;
        let key = &at.key;
        let votes = match kind {
            Kind::Permits(n) => permit_votes(q.masters.len(), n, q.votes_needed()),
            _ => q.votes_needed(),
        };
        let undo_keys = &queued_book(key);
        let owner = &owner.unwrap_or_default();
        let try_once = move |deadline: Instant| async move {
            let eligible = q.eligible();
            if eligible.len() < votes {
                ProxyMetrics::inc(&self.metrics.quorum_failures);
                return Tried::Answer(q.loss_reply(LocalReply::Null));
            }
            let (started, instance_token) = (Instant::now(), self.next_token());
            let waits = writer_wait(kind == Kind::Exclusive, deadline);
            let (token, prefix) = (Some(&instance_token[..]), self.instance_prefix());
            let take = args.command(
                qkinds::QKIND_TAKE,
                key,
                &undo_keys.each(),
                &waits,
                token,
                prefix,
            );
            let answers = q
                .ballot(&eligible, &take.into(), 3, integers, |_, _| false)
                .await;
            let facts = |i: usize| integers(&answers.replies[i]);
            let reentered: Vec<i64> = (answers.yes_facts.iter())
                .map(|f| f.get(REENTRY_FACT).copied().unwrap_or(0))
                .collect();
            let mut granted = None;
            if answers.yes >= votes && reentered.iter().all(|&t| t == 0) {
                let takers: Vec<usize> = (0..answers.replies.len())
                    .filter(|&i| facts(i).first() == Some(&1))
                    .collect();
                let token = super::fence::fence_token(&takers, &answers.yes_facts, facts);
                let token_s = token.to_string();
                let commit = crate::lock::eval_on(
                    qkinds::QKIND_COMMIT,
                    key,
                    &book(key).each(),
                    &[&instance_token, token_s.as_bytes(), owner],
                );
                let committed = q.ask(&answers.yes_from, &commit.into(), |_| false).await;
                let ok = (committed.replies.iter())
                    .filter(|r| integer(r) == Some(1))
                    .count();
                if ok >= votes {
                    granted = Some(token);
                }
            } else if answers.yes >= votes && reentered.iter().all(|&t| t == reentered[0]) {
                // An owner's entry again on every voter, one holding.
                granted = Some(reentered[0]);
            }
            let validity = q.validity_ms(ttl_ms, started.elapsed());
            if let Some(token) = granted.filter(|_| validity > 0) {
                q.granted(ttl_ms);
                self.storm.line_answered(key, Some(ttl_ms));
                self.count_grant(kind, reentered.first().is_some_and(|&t| t > 0));
                return Tried::Answer(LocalReply::Array(vec![
                    LocalReply::Integer(token),
                    LocalReply::Integer(validity),
                ]));
            }
            // Undone wherever it was taken: new holders by the instance
            // token, entries again by their token (one entry each).
            let undo = crate::lock::eval_on(
                qkinds::QKIND_UNDO,
                key,
                &undo_keys.each(),
                &[&instance_token],
            );
            q.ask_all(&undo.into()).await;
            for (m, &t) in answers.yes_from.iter().zip(&reentered) {
                if t > 0 {
                    let again = crate::lock::kinds::unlock_command(key, t.to_string().as_bytes());
                    q.ask(std::slice::from_ref(m), &again.into(), |_| false)
                        .await;
                }
            }
            if let Some(err) = agreed_error(&answers.replies, votes) {
                return Tried::Answer(err);
            }
            if q.lost_quorum(answers.yes, answers.replies.len(), eligible.len()) {
                ProxyMetrics::inc(&self.metrics.quorum_failures);
                if Instant::now() >= deadline {
                    return Tried::Answer(q.late_reply(answers.replies.len(), LocalReply::Null));
                }
                return Tried::Soon;
            }
            ProxyMetrics::inc(&self.metrics.contended);
            self.storm.line_answered(key, None);
            let held_ms = (answers.replies.iter())
                .filter_map(|r| integers(r).get(1).copied())
                .filter(|&p| p > 0)
                .min();
            Tried::Again(next_try(held_ms, false))
        };
        self.in_line(&at, try_once).await
    }

    /// `LOCKGATE LOCK k1 k2 … ttl-ms [WAIT ms]` on the quorum: every key
    /// or none on each master, granted with enough votes, each key's token
    /// committed as an exclusive fencing lock's (`QFENCE_COMMIT`).
    pub(crate) async fn quorum_multi_lock(
        &self,
        q: &Quorum,
        keys: Vec<Bytes>,
        at: Waiting,
        ttl_ms: u64,
    ) -> LocalReply {
        let Waiting { caller, wait, .. } = at;
        let deadline = Instant::now() + wait;
        let place = self.fence_place(&at.key, caller);
        let votes = q.votes_needed();
        let named: Vec<[Bytes; 4]> = (keys.iter())
            .map(|k| {
                [
                    k.clone(),
                    crate::lock::owner_key(k),
                    crate::lock::fence::counter_key(k),
                    crate::lock::kinds::writers_key(k),
                ]
            })
            .collect();
        let flat: Vec<&[u8]> = named.iter().flatten().map(|k| &k[..]).collect();
        let (ttl, waiter) = (ttl_ms.to_string(), self.waiter(caller));
        loop {
            ProxyMetrics::inc(&self.metrics.attempts);
            let eligible = q.eligible();
            if eligible.len() < votes {
                ProxyMetrics::inc(&self.metrics.quorum_failures);
                return q.loss_reply(LocalReply::Null);
            }
            let (started, instance_token) = (Instant::now(), self.next_token());
            let waits = writer_wait(true, deadline);
            let take = crate::lock::evalsha::eval_keys(
                qkinds::QMULTI_TAKE,
                &flat,
                &[
                    ttl.as_bytes(),
                    &instance_token,
                    waits.as_bytes(),
                    waiter.as_bytes(),
                ],
            );
            let answers = q
                .ballot(&eligible, &take.into(), 3, integers, |_, _| false)
                .await;
            let mut granted = None;
            if answers.yes >= votes {
                let counters: Vec<Vec<i64>> = (answers.yes_facts.iter())
                    .map(|f| f.get(4..).unwrap_or_default().to_vec())
                    .collect();
                let clocks: Vec<i64> = (answers.yes_facts.iter())
                    .filter_map(|f| f.get(3).copied())
                    .collect();
                let tokens = multi_tokens(&counters, &clocks, keys.len());
                let mut committed = true;
                for (k, t) in keys.iter().zip(&tokens) {
                    let t = t.to_string();
                    let commit = crate::lock::eval_on(
                        crate::script::QFENCE_COMMIT,
                        k,
                        &[&crate::lock::fence::counter_key(k)],
                        &[&instance_token, t.as_bytes()],
                    );
                    let done = q.ask(&answers.yes_from, &commit.into(), |_| false).await;
                    let ok = (done.replies.iter())
                        .filter(|r| integer(r) == Some(1))
                        .count();
                    committed &= ok >= votes;
                }
                if committed {
                    granted = Some(tokens);
                }
            }
            let validity = q.validity_ms(ttl_ms, started.elapsed());
            if let Some(tokens) = granted.filter(|_| validity > 0) {
                q.granted(ttl_ms);
                ProxyMetrics::inc(&self.metrics.acquired);
                ProxyMetrics::inc(&self.metrics.multi_grants);
                let tokens = tokens.into_iter().map(LocalReply::Integer).collect();
                return LocalReply::Array(vec![
                    LocalReply::Array(tokens),
                    LocalReply::Integer(validity),
                ]);
            }
            for k in &keys {
                let undo = crate::lock::evalsha::eval_queued(
                    crate::script::RELEASE_TOKEN,
                    k,
                    &[&instance_token, b""],
                );
                q.ask_all(&undo.into()).await;
            }
            if q.lost_quorum(answers.yes, answers.replies.len(), eligible.len()) {
                ProxyMetrics::inc(&self.metrics.quorum_failures);
                if Instant::now() >= deadline {
                    return q.late_reply(answers.replies.len(), LocalReply::Null);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
            ProxyMetrics::inc(&self.metrics.contended);
            let now = Instant::now();
            if now >= deadline {
                return LocalReply::Null;
            }
            // Partly taken by two callers at once, both undone: a step each
            // (not the same one) before the next try.
            let step = WAIT_STEP
                .mul_f64(0.5 + f64::from(instance_token.last().copied().unwrap_or(0) % 8) / 8.0);
            until_freed(place.as_ref(), step.min(deadline - now)).await;
        }
    }
}

/// Keys as the scripts take them.
trait Each {
    fn each(&self) -> Vec<&[u8]>;
}

impl<const N: usize> Each for [Bytes; N] {
    fn each(&self) -> Vec<&[u8]> {
        self.iter().map(|k| &k[..]).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permits_need_more_votes_than_a_majority_as_they_grow() {
        // (masters, permits, the quorum's own) → votes.
        let table = [
            (3, 1, 2, 2),
            (3, 2, 2, 3),
            (5, 1, 3, 3),
            (5, 2, 3, 4),
            (5, 3, 3, 4),
            (5, 4, 3, 5),
            (5, 100, 3, 5),
            (1, 7, 1, 1),
            (5, 1, 4, 4),
        ];
        for (m, p, needed, want) in table {
            assert_eq!(permit_votes(m, p, needed), want, "{m} masters, {p} permits");
        }
        // Never P+1 holders: (P+1)·votes > M·P, so some master would
        // count more than P of them.
        for m in 1..=9usize {
            for p in 1..=12u64 {
                let v = permit_votes(m, p, m / 2 + 1) as u64;
                assert!((p + 1) * v > m as u64 * p, "{m} masters, {p} permits: {v}");
            }
        }
    }

    #[test]
    fn multi_key_tokens_are_above_each_keys_counter_and_the_median_clock() {
        let counters = [vec![5, 900], vec![7, 0], vec![0, 0]];
        assert_eq!(multi_tokens(&counters, &[100, 300, 200], 2), vec![201, 901]);
        assert_eq!(multi_tokens(&[], &[], 1), vec![1]);
    }
}
