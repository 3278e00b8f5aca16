//! Multi-key commands whose keys span slots, split per slot and merged
//! back into the reply one Redis would give, where that reply can be
//! rebuilt exactly: `DEL`, `UNLINK`, `EXISTS`, `TOUCH` (the sum of the
//! parts' counts), `MGET` (the values in argument order), `MSET` (`OK`
//! once every part is; not atomic across slots, as on a cluster's own
//! clients). Anything else across slots is Redis Cluster's own
//! `CROSSSLOT` error. Pure: which keys go in which part, and the merge.

use bytes::Bytes;

use super::slot::key_slot;
use crate::protocol::encode::{self, LocalReply};

/// Redis Cluster's refusal of a command whose keys span slots.
pub const CROSSSLOT: &str = "CROSSSLOT Keys in request don't hash to the same slot";

/// How the parts' replies become the client's one reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Merge {
    /// The sum of the parts' integers.
    Sum,
    /// The parts' values, back in argument order.
    Values,
    /// `OK` once every part answered `OK`.
    AllOk,
}

/// One slot's part of a split command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// The slot.
    pub slot: u16,
    /// The command for it, in RESP.
    pub command: Bytes,
    /// Where each of its keys stood among the command's keys.
    pub positions: Vec<usize>,
}

/// A command split per slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    /// How the replies merge.
    pub merge: Merge,
    /// One part per slot, in the order their first key appeared.
    pub parts: Vec<Part>,
    /// How many keys the command named.
    pub keys: usize,
}

/// The split of `args` (name first) per slot, if it is a command that can
/// be split and its keys span slots; `None` otherwise (one slot: send it
/// whole; another command across slots: [`CROSSSLOT`]).
pub fn split(args: &[&[u8]]) -> Option<Split> {
    let name = args.first()?.to_ascii_uppercase();
    let (merge, stride) = match name.as_slice() {
        b"DEL" | b"UNLINK" | b"EXISTS" | b"TOUCH" => (Merge::Sum, 1),
        b"MGET" => (Merge::Values, 1),
        b"MSET" => (Merge::AllOk, 2),
        _ => return None,
    };
    let rest = &args[1..];
    if rest.is_empty() || rest.len() % stride != 0 {
        return None;
    }
    // Per slot: its arguments and its keys' positions.
    type Gathered<'a> = (u16, Vec<&'a [u8]>, Vec<usize>);
    let mut parts: Vec<Gathered> = Vec::new();
    for (i, group) in rest.chunks(stride).enumerate() {
        let slot = key_slot(group[0]);
        match parts.iter_mut().find(|p| p.0 == slot) {
            Some(part) => {
                part.1.extend_from_slice(group);
                part.2.push(i);
            }
            None => parts.push((slot, group.to_vec(), vec![i])),
        }
    }
    if parts.len() < 2 {
        return None;
    }
    let parts = parts
        .into_iter()
        .map(|(slot, part_args, positions)| {
            let mut all: Vec<&[u8]> = vec![&name];
            all.extend(part_args);
            Part {
                slot,
                command: encode::command(&all),
                positions,
            }
        })
        .collect();
    Some(Split {
        merge,
        parts,
        keys: rest.len() / stride,
    })
}

impl Split {
    /// The client's reply from each part's reply (in [`Split::parts`]
    /// order): the first error if any part failed, else the merge.
    pub fn merge(&self, replies: &[LocalReply]) -> LocalReply {
        if let Some(e) = replies.iter().find(|r| matches!(r, LocalReply::Error(_))) {
            return e.clone();
        }
        if replies.len() != self.parts.len() {
            return LocalReply::err("lockgate: a part of a split command went unanswered");
        }
        match self.merge {
            Merge::Sum => {
                let mut sum = 0;
                for r in replies {
                    let LocalReply::Integer(n) = r else {
                        return LocalReply::err("lockgate: unexpected reply to a split command");
                    };
                    sum += n;
                }
                LocalReply::Integer(sum)
            }
            Merge::AllOk => LocalReply::Status("OK"),
            Merge::Values => {
                let mut out = vec![LocalReply::Null; self.keys];
                for (part, reply) in self.parts.iter().zip(replies) {
                    let LocalReply::Array(values) = reply else {
                        return LocalReply::err("lockgate: unexpected reply to a split command");
                    };
                    if values.len() != part.positions.len() {
                        return LocalReply::err("lockgate: unexpected reply to a split command");
                    }
                    for (&at, v) in part.positions.iter().zip(values) {
                        out[at] = v.clone();
                    }
                }
                LocalReply::Array(out)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &str) -> LocalReply {
        LocalReply::Bulk(Bytes::copy_from_slice(s.as_bytes()))
    }

    #[test]
    fn keys_go_to_their_slots_and_answers_merge_in_order() {
        // foo 12182, bar 5061, {foo}x 12182.
        let s = split(&[b"MGET", b"foo", b"bar", b"{foo}x"]).expect("split");
        assert_eq!(s.merge, Merge::Values);
        assert_eq!(s.parts.len(), 2);
        assert_eq!(s.parts[0].slot, 12_182);
        assert_eq!(s.parts[0].positions, [0, 2]);
        assert_eq!(
            &s.parts[1].command[..],
            &encode::command(&[b"MGET", b"bar"])[..]
        );
        let merged = s.merge(&[
            LocalReply::Array(vec![b("1"), LocalReply::Null]),
            LocalReply::Array(vec![b("2")]),
        ]);
        assert_eq!(
            merged,
            LocalReply::Array(vec![b("1"), b("2"), LocalReply::Null])
        );

        let del = split(&[b"del", b"foo", b"bar"]).expect("split");
        assert_eq!(
            del.merge(&[LocalReply::Integer(1), LocalReply::Integer(0)]),
            LocalReply::Integer(1)
        );
        let mset = split(&[b"MSET", b"foo", b"1", b"bar", b"2"]).expect("split");
        assert_eq!(
            &mset.parts[1].command[..],
            &encode::command(&[b"MSET", b"bar", b"2"])[..]
        );
        assert_eq!(
            mset.merge(&[LocalReply::Status("OK"), LocalReply::Status("OK")]),
            LocalReply::Status("OK")
        );
        let failed = LocalReply::err("x");
        assert_eq!(
            mset.merge(&[LocalReply::Status("OK"), failed.clone()]),
            failed
        );
    }

    #[test]
    fn one_slot_or_another_command_is_not_split() {
        assert_eq!(split(&[b"MGET", b"{u}a", b"{u}b"]), None);
        assert_eq!(split(&[b"SUNION", b"foo", b"bar"]), None);
        assert_eq!(
            split(&[b"MSET", b"foo", b"1", b"bar"]),
            None,
            "odd MSET: Redis's error"
        );
        assert_eq!(split(&[b"DEL"]), None);
    }
}
