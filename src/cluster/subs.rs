//! A session's subscriptions, followed from its commands alone, so the
//! session can leave the node its subscriptions pinned it to once it has
//! none left (docs/cluster.md, "Command by command").
//!
//! In front of a cluster a `SUBSCRIBE` pins the session to one node's
//! connection; when the client unsubscribes from everything it is an
//! ordinary connection again and its next `GET` may be for any slot. The
//! read side cannot tell the end by reading replies alone (a count of 0 in
//! an `unsubscribe` frame only means "no channels or patterns"; shard
//! channels are counted apart), but Redis's counts follow from the
//! commands exactly: each unsubscribing command answers one frame per
//! channel named (one for none, or one per member of the set when it names
//! none), carrying the count after it. So the write side follows the three
//! sets and knows how many frames with a count of 0 come before the one
//! that ends subscribed mode; the read side counts those frames.
//! A rule of commands alone, table-tested ([`Subscriptions::apply`]).

use std::collections::HashSet;

/// The channels, patterns and shard channels a session is subscribed to,
/// as its commands left them.
#[derive(Debug, Default)]
pub struct Subscriptions {
    channels: HashSet<Box<[u8]>>,
    patterns: HashSet<Box<[u8]>>,
    shard: HashSet<Box<[u8]>>,
}

/// What one command did to the subscriptions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    /// Frames of its reply that carry a count of 0 (`unsubscribe`,
    /// `punsubscribe`, `sunsubscribe` frames only: a subscribing frame
    /// counts at least its own channel).
    pub zero_frames: u64,
    /// Whether it was a subscription command at all.
    pub family: bool,
    /// Channels, patterns and shard channels left after it.
    pub left: usize,
}

/// Which set a command works on, and whether it adds.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Set {
    Channels,
    Patterns,
    Shard,
}

impl Subscriptions {
    /// Applies the command `args` (its name in any case) and says what it
    /// did: see [`Applied`].
    pub fn apply(&mut self, args: &[&[u8]]) -> Applied {
        let mut applied = Applied {
            zero_frames: 0,
            family: false,
            left: self.total(),
        };
        let Some(name) = args.first() else {
            return applied;
        };
        let is = |n: &[u8]| name.eq_ignore_ascii_case(n);
        let (set, add) = if is(b"SUBSCRIBE") {
            (Set::Channels, true)
        } else if is(b"PSUBSCRIBE") {
            (Set::Patterns, true)
        } else if is(b"SSUBSCRIBE") {
            (Set::Shard, true)
        } else if is(b"UNSUBSCRIBE") {
            (Set::Channels, false)
        } else if is(b"PUNSUBSCRIBE") {
            (Set::Patterns, false)
        } else if is(b"SUNSUBSCRIBE") {
            (Set::Shard, false)
        } else {
            return applied;
        };
        applied.family = true;
        let names = &args[1..];
        if add {
            // Redis refuses a subscribing command naming nothing (arity):
            // nothing changes.
            for n in names {
                self.set(set).insert(Box::from(*n));
            }
        } else if names.is_empty() {
            // One frame per member, the count falling to what the other
            // sets hold; one frame when there is no member.
            self.set(set).clear();
            if self.count(set) == 0 {
                applied.zero_frames = 1;
            }
        } else {
            for n in names {
                self.set(set).remove(*n);
                if self.count(set) == 0 {
                    applied.zero_frames += 1;
                }
            }
        }
        applied.left = self.total();
        applied
    }

    /// Channels, patterns and shard channels subscribed to.
    pub fn total(&self) -> usize {
        self.channels.len() + self.patterns.len() + self.shard.len()
    }

    fn set(&mut self, set: Set) -> &mut HashSet<Box<[u8]>> {
        match set {
            Set::Channels => &mut self.channels,
            Set::Patterns => &mut self.patterns,
            Set::Shard => &mut self.shard,
        }
    }

    /// The count a frame of this set's commands carries: channels and
    /// patterns together, shard channels apart (as Redis 7 counts them).
    fn count(&self, set: Set) -> usize {
        match set {
            Set::Channels | Set::Patterns => self.channels.len() + self.patterns.len(),
            Set::Shard => self.shard.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Commands in order, each with (zero frames, subscriptions left).
    #[test]
    fn counts_follow_redis() {
        let table: &[(&[&str], (u64, usize))] = &[
            (&["GET", "k"], (0, 0)),
            (&["UNSUBSCRIBE"], (1, 0)),
            (&["unsubscribe", "x", "y"], (2, 0)),
            (&["SUBSCRIBE", "a", "b", "a"], (0, 2)),
            (&["PSUBSCRIBE", "p*"], (0, 3)),
            (&["UNSUBSCRIBE", "a"], (0, 2)),
            (&["UNSUBSCRIBE"], (0, 1)),
            (&["SSUBSCRIBE", "s"], (0, 2)),
            // The pattern's frame counts 0 (channels and patterns only)
            // though a shard channel is left.
            (&["PUNSUBSCRIBE", "p*", "q*"], (2, 1)),
            (&["SUNSUBSCRIBE", "nope"], (0, 1)),
            (&["SUNSUBSCRIBE"], (1, 0)),
            (&["SUBSCRIBE", "c"], (0, 1)),
            (&["UNSUBSCRIBE", "c", "c"], (2, 0)),
        ];
        let mut subs = Subscriptions::default();
        for (i, (command, (zeros, left))) in table.iter().enumerate() {
            let args: Vec<&[u8]> = command.iter().map(|a| a.as_bytes()).collect();
            let a = subs.apply(&args);
            assert_eq!(
                (a.zero_frames, a.left),
                (*zeros, *left),
                "row {i}: {command:?}"
            );
            assert_eq!(a.family, i > 0, "row {i}");
        }
    }
}
