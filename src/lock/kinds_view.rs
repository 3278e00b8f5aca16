//! What operators see of shared, reentrant and counted locks (`LOCKGATE
//! LOCKS`, the status page): the holders as Redis keeps them
//! ([`crate::script::kinds::KIND_READ`]), read for each listed key whose
//! value is the holders' mark, and the keys whose callers wait in this
//! instance's lines.

use bytes::Bytes;

use super::fence::integers;
use super::kinds::{expiry_key, holders_key, writers_key};
use super::LockService;
use crate::script::kinds::KIND_READ;

/// A key's holders as the store keeps them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KindFacts {
    /// `shared`, `owned` (an owner's exclusive lock) or `permits`.
    pub kind: &'static str,
    /// Live holders.
    pub holders: u64,
    /// Their entries (reentrant counts summed).
    pub entries: u64,
    /// Exclusive callers waiting (they hold new readers back).
    pub writers_waiting: u64,
}

/// The facts of a [`KIND_READ`] reply; `None` when the key is not held by
/// such holders (or the reply is not the script's).
pub fn facts_of(reply: &[u8]) -> Option<KindFacts> {
    let f = integers(reply);
    let kind = match f.first()? {
        1 => "shared",
        2 => "owned",
        3 => "permits",
        _ => return None,
    };
    let n = |i: usize| f.get(i).map_or(0, |&v| v.max(0) as u64);
    Some(KindFacts {
        kind,
        holders: n(1),
        entries: n(2),
        writers_waiting: n(3),
    })
}

/// Of the masters' facts, the ones at least `majority` of them agree on
/// holders at least as many as: the largest such count (what a majority
/// still holds), with the kind of the fullest reply. Pure.
pub fn majority_facts(mut all: Vec<KindFacts>, majority: usize) -> Option<KindFacts> {
    all.sort_by_key(|f| std::cmp::Reverse(f.holders));
    all.get(majority.checked_sub(1)?).copied()
}

impl LockService {
    /// `key`'s holders as the store keeps them, if the key is held by
    /// shared, reentrant or counted holders; `None` otherwise or when the
    /// store did not answer.
    pub(crate) async fn kind_facts(&self, key: &[u8]) -> Option<KindFacts> {
        let (holders, expiry, writers) = (holders_key(key), expiry_key(key), writers_key(key));
        let keys: [&[u8]; 4] = [key, &holders, &expiry, &writers];
        let read = super::evalsha::eval_keys(KIND_READ, &keys, &[]);
        match self.quorum() {
            Some(q) => {
                let answers = q.ask_all(&read.into()).await;
                let all = answers.replies.iter().filter_map(|r| facts_of(r)).collect();
                majority_facts(all, q.majority())
            }
            None => {
                let reply = (self.store().primary)
                    .call(read, std::time::Duration::from_secs(1))
                    .await
                    .ok()?;
                facts_of(&reply)
            }
        }
    }

    /// The keys matching `glob` whose callers wait in this instance's
    /// lines (`LOCKGATE LOCK … WAIT`, `ACQUIRE … WAIT`), with how many, at
    /// most `max`.
    pub(crate) fn lined(&self, glob: impl Fn(&[u8]) -> bool, max: usize) -> Vec<(Bytes, usize)> {
        self.storm.lines.waiting(glob, max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn facts_of_a_read() {
        let shared = facts_of(b"*4\r\n:1\r\n:3\r\n:4\r\n:1\r\n").unwrap();
        assert_eq!(
            shared,
            KindFacts {
                kind: "shared",
                holders: 3,
                entries: 4,
                writers_waiting: 1
            }
        );
        assert_eq!(facts_of(b"*4\r\n:0\r\n:0\r\n:0\r\n:0\r\n"), None);
        assert_eq!(facts_of(b"-ERR x\r\n"), None);
    }

    #[test]
    fn the_holders_a_majority_of_masters_keep() {
        let f = |holders| KindFacts {
            kind: "permits",
            holders,
            entries: holders,
            writers_waiting: 0,
        };
        assert_eq!(majority_facts(vec![f(2), f(3), f(1)], 2), Some(f(2)));
        assert_eq!(majority_facts(vec![f(2)], 2), None);
        assert_eq!(majority_facts(vec![], 0), None);
    }
}
