//! Multi-key commands split between the two stores of a quorum setup: the
//! lock keys on the lock masters, the other keys on the primary. Only
//! commands whose meaning is per key can be split (`DEL`, `UNLINK`,
//! `EXISTS`, `TOUCH`, `MGET`): each part runs on its own store and the two
//! answers merge into the reply Redis would have given for the whole. This
//! module is pure: which key goes where, and how the answers merge.

use bytes::Bytes;

use super::quorum::integer;
use super::quorum::ops::as_local;
use crate::protocol::encode::{self, LocalReply};

/// How the answers of the two parts become the client's one reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Merge {
    /// `DEL`, `UNLINK`, `EXISTS`, `TOUCH`: the sum of the two counts.
    Sum,
    /// `MGET`: the values, in argument order.
    Values,
}

/// A command split between the quorum and the primary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    /// The command's name, uppercase (`DEL`, `UNLINK`, `EXISTS`, `TOUCH`,
    /// `MGET`).
    pub name: &'static str,
    /// Every key in argument order; `true` for a lock key.
    pub keys: Vec<(bool, Bytes)>,
}

/// Why an answer could not be merged.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SplitError {
    /// The primary's reply does not have the shape the command has.
    #[error("lockgate: unexpected reply from the primary to the {0} part")]
    PrimaryShape(&'static str),
    /// The quorum's answer does not have the shape the command has.
    #[error("lockgate: unexpected answer from the lock masters to the {0} part")]
    QuorumShape(&'static str),
}

impl Split {
    /// The split of command `name` over `keys`, if it has a per-key meaning.
    /// `is_lock` tells lock keys from the others.
    pub fn new(name: &[u8], keys: &[&[u8]], is_lock: impl Fn(&[u8]) -> bool) -> Option<Split> {
        let name = ["DEL", "UNLINK", "EXISTS", "TOUCH", "MGET"]
            .into_iter()
            .find(|n| n.as_bytes().eq_ignore_ascii_case(name))?;
        let keys = keys
            .iter()
            .map(|k| (is_lock(k), Bytes::copy_from_slice(k)))
            .collect();
        Some(Split { name, keys })
    }

    /// How the two answers merge.
    pub fn merge_kind(&self) -> Merge {
        match self.name {
            "MGET" => Merge::Values,
            _ => Merge::Sum,
        }
    }

    /// The lock keys, in argument order (repeats kept: `EXISTS` counts
    /// them each time).
    pub fn lock_keys(&self) -> Vec<Bytes> {
        self.keys
            .iter()
            .filter(|(lock, _)| *lock)
            .map(|(_, k)| k.clone())
            .collect()
    }

    /// True when some keys live on the primary.
    pub fn has_plain(&self) -> bool {
        self.keys.iter().any(|(lock, _)| !lock)
    }

    /// The command for the primary's part (the same command over the other
    /// keys), if there are any.
    pub fn primary_command(&self) -> Option<Bytes> {
        let mut args: Vec<&[u8]> = vec![self.name.as_bytes()];
        args.extend(
            self.keys
                .iter()
                .filter(|(lock, _)| !lock)
                .map(|(_, k)| &k[..]),
        );
        (args.len() > 1).then(|| encode::command(&args))
    }

    /// The client's reply from the primary's reply frame (`None`: no
    /// primary part) and the quorum's answer (a count for [`Merge::Sum`],
    /// an array of the lock keys' values for [`Merge::Values`]). An error
    /// from either store is the reply.
    pub fn merge(&self, primary: Option<&[u8]>, quorum: LocalReply) -> LocalReply {
        if let Some(frame) = primary {
            if frame.first() == Some(&b'-') {
                return as_local(frame);
            }
        }
        if let LocalReply::Error(_) = quorum {
            return quorum;
        }
        let merged = match self.merge_kind() {
            Merge::Sum => self.sum(primary, &quorum),
            Merge::Values => self.values(primary, quorum),
        };
        merged.unwrap_or_else(LocalReply::err)
    }

    fn sum(&self, primary: Option<&[u8]>, quorum: &LocalReply) -> Result<LocalReply, SplitError> {
        let plain = match primary {
            Some(frame) => integer(frame).ok_or(SplitError::PrimaryShape(self.name))?,
            None => 0,
        };
        let LocalReply::Integer(locked) = quorum else {
            return Err(SplitError::QuorumShape(self.name));
        };
        Ok(LocalReply::Integer(plain + locked))
    }

    fn values(&self, primary: Option<&[u8]>, quorum: LocalReply) -> Result<LocalReply, SplitError> {
        let plain = match primary {
            Some(frame) => array_items(frame).ok_or(SplitError::PrimaryShape(self.name))?,
            None => Vec::new(),
        };
        let LocalReply::Array(locked) = quorum else {
            return Err(SplitError::QuorumShape(self.name));
        };
        let (mut plain, mut locked) = (plain.into_iter(), locked.into_iter());
        self.keys
            .iter()
            .map(|(lock, _)| match lock {
                true => locked.next().ok_or(SplitError::QuorumShape(self.name)),
                false => plain.next().ok_or(SplitError::PrimaryShape(self.name)),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(LocalReply::Array)
    }
}

/// Commands that act on several keys at once, atomically, with keys past
/// the first argument (`args`: name first). With the quorum they cannot
/// span the two stores; returns their keys so a lock key among them is
/// seen (a lock key as destination would otherwise be written on the
/// primary, where no lock read ever looks).
pub fn cross_keys<'a>(args: &[&'a [u8]]) -> Option<Vec<&'a [u8]>> {
    const TWO_KEYS: &[&str] = &[
        "SMOVE",
        "LMOVE",
        "BLMOVE",
        "RPOPLPUSH",
        "BRPOPLPUSH",
        "ZRANGESTORE",
        "GEOSEARCHSTORE",
    ];
    const ALL_KEYS: &[&str] = &[
        "SINTERSTORE",
        "SUNIONSTORE",
        "SDIFFSTORE",
        "SINTER",
        "SUNION",
        "SDIFF",
        "PFMERGE",
        "PFCOUNT",
    ];
    let name = args.first()?;
    let is = |list: &[&str]| list.iter().any(|n| n.as_bytes().eq_ignore_ascii_case(name));
    let keys = if is(TWO_KEYS) {
        args.get(1..3.min(args.len()))?
    } else if is(ALL_KEYS) {
        args.get(1..)?
    } else {
        return None;
    };
    Some(keys.to_vec())
}

/// The items of an array of bulk strings and nulls (an `MGET` reply), each
/// as a reply lockgate writes; `None` for anything else.
fn array_items(frame: &[u8]) -> Option<Vec<LocalReply>> {
    let (header, mut rest) = line(frame.strip_prefix(b"*")?)?;
    let n: usize = std::str::from_utf8(header).ok()?.parse().ok()?;
    let mut items = Vec::with_capacity(n);
    for _ in 0..n {
        match rest.first()? {
            b'_' => {
                rest = line(&rest[1..])?.1;
                items.push(LocalReply::Null);
            }
            b'$' => {
                let (len, after) = line(&rest[1..])?;
                if len == b"-1" {
                    items.push(LocalReply::Null);
                    rest = after;
                    continue;
                }
                let len: usize = std::str::from_utf8(len).ok()?.parse().ok()?;
                let body = after.get(..len)?;
                items.push(LocalReply::Bulk(Bytes::copy_from_slice(body)));
                rest = after.get(len..)?.strip_prefix(b"\r\n")?;
            }
            _ => return None,
        }
    }
    rest.is_empty().then_some(items)
}

/// The text before the first CRLF, and what follows it.
fn line(buf: &[u8]) -> Option<(&[u8], &[u8])> {
    let end = memchr::memmem::find(buf, b"\r\n")?;
    Some((&buf[..end], &buf[end + 2..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(name: &str, keys: &[&str]) -> Split {
        let keys: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        Split::new(name.as_bytes(), &keys, |k| k.starts_with(b"lock:")).unwrap()
    }

    #[test]
    fn only_per_key_commands_split() {
        assert!(Split::new(b"rename", &[b"a", b"lock:b"], |_| true).is_none());
        let s = split("del", &["a", "lock:b", "c", "lock:b"]);
        assert_eq!(s.name, "DEL");
        assert_eq!(s.lock_keys().len(), 2);
        assert_eq!(
            s.primary_command(),
            Some(encode::command(&[b"DEL", b"a", b"c"]))
        );
        assert_eq!(split("MGET", &["lock:a"]).primary_command(), None);
    }

    #[test]
    fn counts_add_up() {
        let s = split("EXISTS", &["a", "lock:b", "lock:b"]);
        assert_eq!(
            s.merge(Some(b":1\r\n"), LocalReply::Integer(2)),
            LocalReply::Integer(3)
        );
        let err = LocalReply::err("lockgate: lock quorum unavailable");
        assert_eq!(s.merge(Some(b":1\r\n"), err.clone()), err);
        assert_eq!(
            s.merge(Some(b"-READONLY x\r\n"), LocalReply::Integer(2)),
            LocalReply::Error(Bytes::from_static(b"READONLY x"))
        );
    }

    #[test]
    fn values_in_argument_order() {
        let s = split("MGET", &["a", "lock:b", "c", "lock:d"]);
        let quorum = LocalReply::Array(vec![
            LocalReply::Raw(Bytes::from_static(b"$1\r\nB\r\n")),
            LocalReply::Null,
        ]);
        assert_eq!(
            s.merge(Some(b"*2\r\n$1\r\nA\r\n_\r\n"), quorum),
            LocalReply::Array(vec![
                LocalReply::Bulk(Bytes::from_static(b"A")),
                LocalReply::Raw(Bytes::from_static(b"$1\r\nB\r\n")),
                LocalReply::Null,
                LocalReply::Null,
            ])
        );
        assert!(matches!(
            s.merge(Some(b"*1\r\n$-1\r\n"), LocalReply::Array(vec![])),
            LocalReply::Error(_)
        ));
        assert_eq!(array_items(b"*1\r\n$2\r\na\r\n"), None);
    }

    #[test]
    fn atomic_commands_name_their_keys() {
        let args: [&[u8]; 4] = [b"smove", b"src", b"lock:d", b"m"];
        assert_eq!(cross_keys(&args), Some(vec![&b"src"[..], b"lock:d"]));
        let args: [&[u8]; 3] = [b"SUNIONSTORE", b"lock:d", b"s"];
        assert_eq!(cross_keys(&args).map(|k| k.len()), Some(2));
        assert_eq!(cross_keys(&[b"HSET", b"k", b"f", b"v"]), None);
    }
}
