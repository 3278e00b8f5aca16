//! Multi-key commands whose keys span slots, split per slot and merged
//! back into the reply one Redis would give, where that reply can be
//! rebuilt exactly: `DEL`, `UNLINK`, `EXISTS`, `TOUCH` (the sum of the
//! parts' counts), `MGET` (the values in argument order), `MSET` (`OK`
//! once every part is; not atomic across slots, as on a cluster's own
//! clients). Also client scripts known to act on each of their keys alone
//! ([`PER_KEY_SCRIPTS`]: Redisson's batched lock renewal, whose keys span
//! slots when Redisson thinks it talks to one Redis), by `EVAL` or
//! `EVALSHA`: one script call per slot, with each key's own argument, the
//! per-key answers back in key order. Anything else across slots is Redis
//! Cluster's own `CROSSSLOT` error. Pure: which keys go in which part, and
//! the merge.

use std::sync::OnceLock;

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

/// Client scripts whose every key is read and written alone, with
/// `ARGV[1]` shared and `ARGV[i + 1]` its `i`-th key's own, answering an
/// array of one value per key in key order: split per slot exactly.
/// Recognised by their exact text (`EVAL`) or its SHA1 (`EVALSHA`).
pub const PER_KEY_SCRIPTS: &[&str] = &[
    // Redisson 3.4x `org.redisson.renewal.LockTask`: the watchdog renews
    // every lock of a client in one call (by slot only when Redisson
    // itself sees a cluster).
    "local result = {} for i = 1, #KEYS, 1 do if (redis.call('hexists', KEYS[i], ARGV[i + 1]) == 1) then redis.call('pexpire', KEYS[i], ARGV[1]); table.insert(result, 1); else table.insert(result, 0); end; end; return result;",
];

/// Whether `script` (`EVAL`'s text, or `EVALSHA`'s digest when `sha`) is
/// one of [`PER_KEY_SCRIPTS`].
fn per_key(script: &[u8], sha: bool) -> bool {
    static SHAS: OnceLock<Vec<String>> = OnceLock::new();
    if !sha {
        return PER_KEY_SCRIPTS.iter().any(|s| s.as_bytes() == script);
    }
    let shas = SHAS.get_or_init(|| {
        (PER_KEY_SCRIPTS.iter())
            .map(|s| sha1_smol::Sha1::from(s).digest().to_string())
            .collect()
    });
    shas.iter()
        .any(|s| s.as_bytes().eq_ignore_ascii_case(script))
}

/// The keys' positions grouped by slot, slots in the order their first
/// key came; `None` when they are all in one slot.
fn by_slot<'a>(keys: impl Iterator<Item = &'a [u8]>) -> Option<Vec<(u16, Vec<usize>)>> {
    let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
    for (i, key) in keys.enumerate() {
        let slot = key_slot(key);
        match groups.iter_mut().find(|g| g.0 == slot) {
            Some(group) => group.1.push(i),
            None => groups.push((slot, vec![i])),
        }
    }
    (groups.len() >= 2).then_some(groups)
}

/// One part per slot group, its command built from its keys' positions.
fn parts(groups: Vec<(u16, Vec<usize>)>, build: impl Fn(&[usize]) -> Bytes) -> Vec<Part> {
    (groups.into_iter())
        .map(|(slot, positions)| Part {
            slot,
            command: build(&positions),
            positions,
        })
        .collect()
}

/// A per-key script's call split per slot (see [`PER_KEY_SCRIPTS`]):
/// `EVAL script n k1…kn shared a1…an`.
fn split_script(name: &[u8], args: &[&[u8]]) -> Option<Split> {
    let (script, n) = (args.get(1)?, args.get(2)?);
    if !per_key(script, name == b"EVALSHA") {
        return None;
    }
    let n: usize = std::str::from_utf8(n).ok()?.parse().ok()?;
    // Keys, the shared argument, one argument per key: nothing else.
    if n == 0 || args.len() != 3 + n + 1 + n {
        return None;
    }
    let (keys, shared, own) = (&args[3..3 + n], args[3 + n], &args[4 + n..]);
    let parts = parts(by_slot(keys.iter().copied())?, |positions| {
        let count = positions.len().to_string();
        let mut all: Vec<&[u8]> = vec![name, script, count.as_bytes()];
        all.extend(positions.iter().map(|&i| keys[i]));
        all.push(shared);
        all.extend(positions.iter().map(|&i| own[i]));
        encode::command(&all)
    });
    Some(Split {
        merge: Merge::Values,
        parts,
        keys: n,
    })
}

/// The split of `args` (name first) per slot, if it is a command that can
/// be split and its keys span slots; `None` otherwise (one slot: send it
/// whole; another command across slots: [`CROSSSLOT`]).
pub fn split(args: &[&[u8]]) -> Option<Split> {
    let name = args.first()?.to_ascii_uppercase();
    if matches!(name.as_slice(), b"EVAL" | b"EVALSHA") {
        return split_script(&name, args);
    }
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
    let parts = parts(by_slot(rest.chunks(stride).map(|g| g[0]))?, |positions| {
        let mut all: Vec<&[u8]> = vec![&name];
        for &i in positions {
            all.extend_from_slice(&rest[i * stride..(i + 1) * stride]);
        }
        encode::command(&all)
    });
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
    fn a_per_key_script_is_split_with_each_keys_argument() {
        let script = PER_KEY_SCRIPTS[0];
        // foo 12182, bar 5061, {foo}x 12182.
        let args: [&[u8]; 10] = [
            b"eval",
            script.as_bytes(),
            b"3",
            b"foo",
            b"bar",
            b"{foo}x",
            b"30000",
            b"id:1",
            b"id:2",
            b"id:3",
        ];
        let s = split(&args).expect("split");
        assert_eq!(s.parts.len(), 2);
        assert_eq!(s.parts[0].positions, [0, 2]);
        let first: [&[u8]; 7] = [
            b"EVAL",
            script.as_bytes(),
            b"2",
            b"foo",
            b"{foo}x",
            b"30000",
            b"id:1",
        ];
        let mut want = first.to_vec();
        want.push(b"id:3");
        assert_eq!(&s.parts[0].command[..], &encode::command(&want)[..]);
        let merged = s.merge(&[
            LocalReply::Array(vec![LocalReply::Integer(1), LocalReply::Integer(0)]),
            LocalReply::Array(vec![LocalReply::Integer(1)]),
        ]);
        let want = [1, 1, 0].map(LocalReply::Integer).to_vec();
        assert_eq!(merged, LocalReply::Array(want));
        // By its digest too.
        let sha = sha1_smol::Sha1::from(script).digest().to_string();
        let mut by_sha = args;
        by_sha[0] = b"EVALSHA";
        by_sha[1] = sha.as_bytes();
        let s = split(&by_sha).expect("split by SHA1");
        assert!(s.parts[1].command.starts_with(b"*6\r\n$7\r\nEVALSHA\r\n"));
        // Another script, a wrong shape, one slot: not split.
        let mut other = args;
        other[1] = b"return redis.call('del', KEYS[1])";
        assert_eq!(split(&other), None);
        assert_eq!(split(&args[..9]), None, "an argument short");
        let one: [&[u8]; 6] = [b"EVAL", script.as_bytes(), b"1", b"foo", b"1", b"a"];
        assert_eq!(split(&one), None);
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
