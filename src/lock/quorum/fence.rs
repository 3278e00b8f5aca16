//! The fencing-token API on the quorum (see [`crate::lock::fence`] for one
//! Redis): a token is read from and written back to the same majority, and
//! any two majorities overlap, so tokens only grow, also when a minority of
//! masters restarts empty.

use std::time::Instant;

use bytes::Bytes;

use super::{integer, Quorum};
use crate::lock::fence::{next_try, FenceTry, Tried, Waiting};
use crate::lock::LockService;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;
use crate::script;

impl LockService {
    /// `LOCKGATE LOCK` on the quorum: take the lock on a majority under an
    /// instance token while reading their token counters and clocks, then
    /// write the token ([`fence_token`]) as the lock's value and counter on
    /// that majority before answering `[token, validity-ms]`. Tries until
    /// `wait` has passed.
    pub(crate) async fn quorum_fence_lock(
        &self,
        q: &Quorum,
        at: Waiting,
        ttl_ms: u64,
    ) -> LocalReply {
        // As on one Redis: in line, first come first served among this
        // instance's fencing waits, and against its other attempts on the
        // key in arrival order, a `WAIT` that ran out counting from its
        // connection's first (see `fence_defers`, `storm::lines`).
        let key = &at.key;
        // A place in each master's queue, so other instances' turns yield
        // to this one's as to its parked attempts.
        let args = &FenceTry::new(self, &at, ttl_ms);
        // More than (N + clock_faults) / 2: a plain majority by default.
        let majority = q.votes_needed();
        let waits_long = !at.wait.is_zero();
        let try_once = move |deadline: Instant| async move {
            let eligible = q.eligible();
            if eligible.len() < majority {
                ProxyMetrics::inc(&self.metrics.quorum_failures);
                return Tried::Answer(q.loss_reply(LocalReply::Null));
            }
            let instance_token = self.next_token();
            let started = Instant::now();
            let waits = crate::lock::kinds::writer_wait(waits_long, deadline);
            let prefix = self.instance_prefix();
            let take = args.command(script::QFENCE_ACQUIRE, key, &instance_token, prefix, &waits);
            let facts = |r: &[u8]| crate::lock::fence::integers(r);
            // A master whose clock jumped takes no part (see `clock`); its
            // counter is still read, as a higher one is never unsafe.
            let answers = q
                .ballot(
                    &eligible,
                    &take.into(),
                    script::QFENCE_CLOCK_FACT,
                    facts,
                    |_, _| false,
                )
                .await;
            let takers: Vec<usize> = (0..answers.replies.len())
                .filter(|&i| facts(&answers.replies[i]).first() == Some(&1))
                .collect();
            let mut acquired = None;
            if answers.yes >= majority {
                let token =
                    fence_token(&takers, &answers.yes_facts, |i| facts(&answers.replies[i]));
                let token_s = token.to_string();
                let commit = crate::lock::eval_on(
                    script::QFENCE_COMMIT,
                    key,
                    &[&crate::lock::fence::counter_key(key)],
                    &[&instance_token, token_s.as_bytes()],
                );
                // Only on the masters whose vote counted.
                let committed = q.ask(&answers.yes_from, &commit.into(), |_| false).await;
                let ok = committed
                    .replies
                    .iter()
                    .filter(|r| integer(r) == Some(1))
                    .count();
                let validity = q.validity_ms(ttl_ms, started.elapsed());
                if ok >= majority && validity > 0 {
                    acquired = Some((token, validity));
                }
            }
            if let Some((token, validity)) = acquired {
                q.granted(ttl_ms);
                self.storm.line_answered(key, Some(ttl_ms));
                ProxyMetrics::inc(&self.metrics.acquired);
                return Tried::Answer(LocalReply::Array(vec![
                    LocalReply::Integer(token),
                    LocalReply::Integer(validity),
                ]));
            }
            let undo = crate::lock::evalsha::eval_queued(
                script::RELEASE_TOKEN,
                key,
                &[&instance_token, b""],
            );
            q.ask_all(&undo.into()).await;
            if q.lost_quorum(answers.yes, answers.replies.len(), eligible.len()) {
                // Up, but too few answered in time: try again while WAIT
                // lasts, else say so (not "masters down").
                ProxyMetrics::inc(&self.metrics.quorum_failures);
                if Instant::now() >= deadline {
                    return Tried::Answer(q.late_reply(answers.replies.len(), LocalReply::Null));
                }
                return Tried::Soon;
            }
            ProxyMetrics::inc(&self.metrics.contended);
            self.storm.line_answered(key, None);
            let held_ms = answers
                .replies
                .iter()
                .filter_map(|r| facts(r).get(1).copied())
                .filter(|&p| p > 0)
                .min();
            // Yielded to another instance's turn (fact 4): wait for its
            // end or this instance's wake-up, do not spin on a free lock.
            let yielded = answers.replies.iter().any(|r| facts(r).get(4) == Some(&1));
            if yielded {
                ProxyMetrics::inc(&self.metrics.fairness_yields);
            }
            Tried::Again(next_try(held_ms, yielded))
        };
        self.in_line(&at, try_once).await
    }

    /// `LOCKGATE UNLOCK`/`EXTEND` on the quorum: the script on every master,
    /// 1 iff a majority did it.
    pub(crate) async fn quorum_fence_simple(&self, q: &Quorum, command: Bytes) -> LocalReply {
        // A majority alike decides "1 iff a majority did it" as every
        // answer would.
        let answers = q.ask_agreed(&command.into()).await;
        if answers.replies.len() < q.majority() {
            return q.no_quorum(answers.replies.len());
        }
        let done = answers
            .replies
            .iter()
            .filter(|r| integer(r) == Some(1))
            .count();
        LocalReply::Integer(i64::from(done >= q.majority()))
    }
}

/// The token of a quorum acquisition: one more than the larger of the
/// largest counter any taker reported (`takers`: indices of replies that
/// took the lock, read by `facts`) and the median clock (µs; the lower one
/// of an even count) among the masters whose "yes" counted (`counted`:
/// their facts). The counter keeps tokens growing while a majority keeps
/// its data; the clock keeps them growing when every counter was lost,
/// because a master that lost them sat out the rejoin delay since
/// (`docs/quorum.md`). The median, not the largest: one master whose clock
/// runs ahead (stepped forward, and trusted again after its sit-out) must
/// not carry tokens into the future, where a later loss of the counters
/// would leave the next token below it.
pub fn fence_token(
    takers: &[usize],
    counted: &[Vec<i64>],
    facts: impl Fn(usize) -> Vec<i64>,
) -> i64 {
    let counter = takers
        .iter()
        .filter_map(|&i| facts(i).get(2).copied())
        .max()
        .unwrap_or(0);
    let mut clocks: Vec<i64> = counted
        .iter()
        .filter_map(|f| f.get(script::QFENCE_CLOCK_FACT).copied())
        .collect();
    clocks.sort_unstable();
    let clock = match clocks.len() {
        0 => 0,
        n => clocks[(n - 1) / 2],
    };
    counter.max(clock) + 1
}

#[cfg(test)]
mod tests {
    use super::fence_token;

    #[test]
    fn a_token_is_above_every_counter_and_the_median_counted_clock() {
        // facts: {taken, pttl, counter, clock}
        let replies = [
            vec![1, 0, 7, 1_000],
            vec![1, 0, 9, 1_005],
            vec![0, 40, 0, 9_999],
        ];
        let facts = |i: usize| replies[i].clone();
        // Counters lost (0): the median clock of the voters + 1.
        let lost = [
            vec![1, 0, 0, 2_000],
            vec![1, 0, 0, 2_004],
            vec![1, 0, 0, 2_001],
        ];
        assert_eq!(fence_token(&[], &lost, |_| vec![]), 2_002);
        // One clock 60 s ahead among three (or five) voters is outvoted.
        let ahead = [
            vec![1, 0, 0, 2_000],
            vec![1, 0, 0, 62_000_000],
            vec![1, 0, 0, 2_003],
        ];
        assert_eq!(fence_token(&[], &ahead, |_| vec![]), 2_004);
        // An even count takes the lower median.
        assert_eq!(fence_token(&[], &lost[..2], |_| vec![]), 2_001);
        // A counter above the clocks wins (tokens issued faster than 1 µs
        // apart, or the voters' clocks behind).
        assert_eq!(
            fence_token(&[0, 1], &[replies[0].clone()], facts),
            1_001,
            "the clock counted is 1 000, the counters 7 and 9"
        );
        let high = [vec![1, 0, 5_000, 1_000]];
        assert_eq!(fence_token(&[0], &high, |_| high[0].clone()), 5_001);
        // A refusing master's clock is not a counted one.
        assert_eq!(fence_token(&[0], &[], facts), 8);
    }
}
