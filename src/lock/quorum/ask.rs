//! How the quorum asks its masters: one command to several masters in
//! parallel, each answer bounded by the node timeout, the wait ended as
//! soon as the answer is known. Every command is queued to every master
//! before any answer is awaited, so a master whose answer is not waited
//! for still gets it.

use std::sync::Arc;

use bytes::Bytes;
use futures_util::stream::{FuturesUnordered, StreamExt};

use super::{Answers, Master, Quorum};
use crate::upstream::node::Request;

impl Quorum {
    /// Sends `command` to every master in `to` in parallel and collects the
    /// answers that come within the node timeout. `enough` is asked after
    /// each answer and may end the wait early (a majority known); the
    /// command was queued to every master before the first answer is
    /// awaited, so it still reaches those whose answers are not waited for.
    pub async fn ask(
        &self,
        to: &[Arc<Master>],
        command: &Request,
        mut enough: impl FnMut(&[Bytes]) -> bool,
    ) -> Answers {
        let timeout = self.node_timeout();
        let mut pending: FuturesUnordered<_> = to
            .iter()
            .map(|m| m.node.send(command.clone(), timeout))
            .collect();
        let mut answers = Answers {
            replies: Vec::with_capacity(to.len()),
            asked: to.len(),
        };
        while let Some(result) = pending.next().await {
            if let Ok(reply) = result {
                answers.replies.push(reply);
                if enough(&answers.replies) {
                    break;
                }
            }
        }
        answers
    }

    /// Sends `command` to all masters (including those sitting out).
    pub async fn ask_all(&self, command: &Request) -> Answers {
        let all = self.masters.clone();
        self.ask(&all, command, |_| false).await
    }

    /// Sends `command` to all masters and waits until a majority gave the
    /// same reply byte for byte (or every answer is in, or the node
    /// timeout). The masters not waited for still get the command, and
    /// this lockgate's later commands reach each master after it (one
    /// pipelined connection per master).
    // What the majority merges make of these answers is what they would
    // make of every master's: with `majority` replies alike, fewer than a
    // majority can differ, so the majority-identical reply, and per
    // position the `majority`-th largest integer (`majority_integer`), are
    // that reply's.
    pub async fn ask_agreed(&self, command: &Request) -> Answers {
        let all = self.masters.clone();
        let majority = self.majority();
        self.ask(&all, command, |replies| agreed(replies, majority))
            .await
    }
}

/// Whether the latest of `replies` makes `majority` of them alike (the
/// earlier ones were checked as they came).
fn agreed(replies: &[Bytes], majority: usize) -> bool {
    match replies.split_last() {
        Some((last, rest)) => rest.iter().filter(|r| *r == last).count() + 1 >= majority,
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lock::quorum::{majority_identical, majority_integer};

    fn r(s: &'static str) -> Bytes {
        Bytes::from_static(s.as_bytes())
    }

    #[test]
    fn a_majority_alike_ends_the_wait() {
        assert!(!agreed(&[], 3));
        assert!(!agreed(&[r(":1\r\n"), r(":0\r\n"), r(":1\r\n")], 3));
        assert!(agreed(
            &[r(":1\r\n"), r(":0\r\n"), r(":1\r\n"), r(":1\r\n")],
            3
        ));
        assert!(agreed(&[r(":0\r\n"), r(":0\r\n")], 2));
    }

    #[test]
    fn the_merges_of_an_agreed_majority_are_those_of_every_answer() {
        // Whatever the masters not waited for answer, the merges agree.
        let seen = [r(":2\r\n"), r(":0\r\n"), r(":2\r\n"), r(":2\r\n")];
        assert!(agreed(&seen, 3));
        for late in [":0\r\n", ":2\r\n", ":9\r\n"] {
            let mut all = seen.to_vec();
            all.push(Bytes::from_static(late.as_bytes()));
            assert_eq!(majority_identical(&seen, 3), majority_identical(&all, 3));
            let ints = |v: &[Bytes]| -> Vec<i64> {
                v.iter()
                    .filter_map(|b| crate::lock::quorum::integer(b))
                    .collect()
            };
            assert_eq!(
                majority_integer(&ints(&seen), 3),
                majority_integer(&ints(&all), 3)
            );
        }
    }
}
