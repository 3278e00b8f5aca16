//! Where a command's keys are, as the server itself describes them: the
//! key specifications of `COMMAND` (Redis 7, Valkey), read once from a
//! node, so a command is routed by its keys without a list built into
//! lockgate (the cluster proxies that keep one refuse what is not on it).
//! The search is Redis's own (`getKeysUsingKeySpecs` in `db.c`): a spec
//! begins at an argument index or after a keyword, then takes a range or a
//! count given by an argument. A spec the server marks `incomplete` (the
//! keys of `SORT … BY`, `MIGRATE … KEYS`) cannot be followed here.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use redis_protocol::resp2::types::OwnedFrame;

use super::slot::key_slot;
use crate::command::folded;

/// Why a command's keys could not be found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeysError {
    /// Upstream: the `COMMAND` reply could not be read.
    #[error("unreadable COMMAND reply: {0}")]
    Reply(&'static str),
    /// Client: a command the server did not describe.
    #[error("unknown command '{0}'")]
    Unknown(String),
    /// Client: its arguments do not hold the keys its spec says (a
    /// syntax error the server will report).
    #[error("the arguments do not match the command's key specification")]
    Syntax,
    /// Client: its keys cannot all be found from its specification.
    #[error("the command's keys cannot all be found from its key specification")]
    Incomplete,
}

/// The keys a command names are in more than one slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CrossSlot;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Begin {
    Index(i64),
    Keyword { keyword: Vec<u8>, startfrom: i64 },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Find {
    Range {
        lastkey: i64,
        keystep: i64,
        limit: i64,
    },
    Keynum {
        keynumidx: i64,
        firstkey: i64,
        keystep: i64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Spec {
    begin: Begin,
    find: Find,
    incomplete: bool,
    not_key: bool,
}

#[derive(Debug, Clone, Default)]
struct Entry {
    specs: Vec<Spec>,
    /// A container (`XGROUP`, `OBJECT`…): its subcommands have the specs.
    container: bool,
    /// A spec could not be read (a new kind): keys unknown.
    unreadable: bool,
    /// The server flags it `write` (guarded writes, see
    /// [`crate::lock::guard`]).
    write: bool,
    /// Its arity: the exact number of arguments (name included), or at
    /// least minus this when negative.
    arity: i64,
    /// Its one key is its first argument (`GET`, `SET`, most commands):
    /// routed without walking the specification.
    one_key: bool,
}

/// Every command's key specifications, by name (`name` or
/// `name|subcommand`). Looked up once per command routed: a name of up to
/// 15 bytes (all of Redis's commands) by its folded form
/// ([`crate::command::folded`], one `u128`), any other by its
/// lowercase bytes; hashed with aHash, not SipHash (the names are the
/// server's own, not a client's choice). Callgrind, `SET -P 16` in front
/// of a cluster: lowercasing the name and hashing its bytes was 182
/// instructions per command routed.
#[derive(Debug, Clone, Default)]
pub struct KeyTable {
    folded: HashMap<u128, Entry, BuildHasherDefault<FoldedHasher>>,
    commands: ahash::AHashMap<Vec<u8>, Entry>,
}

/// Hashes a folded name with one multiply. The table is the server's and
/// fixed once read; a client chooses only what it looks up, which walks at
/// most the table's own probe chains. Callgrind, `SET -P 16` in front of
/// a cluster: aHash's look-up of the `u128` was about 120 instructions
/// per command routed.
#[derive(Debug, Default)]
struct FoldedHasher(u64);

impl Hasher for FoldedHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(FOLD);
        }
    }

    fn write_u128(&mut self, v: u128) {
        self.0 = ((v as u64) ^ ((v >> 64) as u64).rotate_left(29)).wrapping_mul(FOLD);
    }

    fn finish(&self) -> u64 {
        // The multiply's high bits are its best: folded into the low ones
        // the table indexes by.
        self.0 ^ (self.0 >> 32)
    }
}

/// An odd constant with well-spread bits (2^64 / φ).
const FOLD: u64 = 0x9E37_79B9_7F4A_7C15;

impl KeyTable {
    /// The table `COMMAND` (RESP2 `reply`) describes.
    pub fn from_command(reply: &[u8]) -> Result<KeyTable, KeysError> {
        let frame = match redis_protocol::resp2::decode::decode(reply) {
            Ok(Some((frame, _))) => frame,
            _ => return Err(KeysError::Reply("not a whole RESP2 reply")),
        };
        let mut table = KeyTable::default();
        for command in array(frame)? {
            table.add(command)?;
        }
        Ok(table)
    }

    fn add(&mut self, command: OwnedFrame) -> Result<(), KeysError> {
        let parts = array(command)?;
        let name = parts
            .first()
            .map(text)
            .unwrap_or_default()
            .to_ascii_lowercase();
        let mut entry = Entry::default();
        if let Some(OwnedFrame::Integer(arity)) = parts.get(1) {
            entry.arity = *arity;
        }
        if let Some(OwnedFrame::Array(flags)) = parts.get(2) {
            entry.write = flags.iter().any(|f| text(f).eq_ignore_ascii_case("write"));
        }
        if let Some(OwnedFrame::Array(specs)) = parts.get(8) {
            for spec in specs {
                match read_spec(spec) {
                    Some(s) => entry.specs.push(s),
                    None => entry.unreadable = true,
                }
            }
        }
        entry.one_key = !entry.unreadable
            && matches!(
                &entry.specs[..],
                [Spec {
                    begin: Begin::Index(1),
                    find: Find::Range {
                        lastkey: 0,
                        keystep: 1,
                        limit: 0
                    },
                    incomplete: false,
                    ..
                }]
            );
        if let Some(OwnedFrame::Array(subs)) = parts.get(9) {
            entry.container = !subs.is_empty();
            for sub in subs {
                self.add(sub.clone())?;
            }
        }
        match folded(name.as_bytes()) {
            0 => self.commands.insert(name.into_bytes(), entry),
            key => self.folded.insert(key, entry),
        };
        Ok(())
    }

    /// The number of commands and subcommands described.
    pub fn len(&self) -> usize {
        self.folded.len() + self.commands.len()
    }

    /// True when nothing is described.
    pub fn is_empty(&self) -> bool {
        self.folded.is_empty() && self.commands.is_empty()
    }

    /// The keys of the command `args` (its name first), in the order the
    /// server would list them (`COMMAND GETKEYS`).
    pub fn keys<'a>(&self, args: &[&'a [u8]]) -> Result<Vec<&'a [u8]>, KeysError> {
        self.find(args, false)
    }

    /// What decides the node of the command `args`: its keys and the
    /// arguments the server hashes to a slot without calling them keys
    /// (`not_key`: the shard channels of `SPUBLISH`, `SSUBSCRIBE`).
    pub fn routing_args<'a>(&self, args: &[&'a [u8]]) -> Result<Vec<&'a [u8]>, KeysError> {
        self.find(args, true)
    }

    /// The one slot of the keys (and, for routing, the `not_key`
    /// arguments) of the command `args`: `Ok(None)` for none, `Err(None)`
    /// when they span slots, `Err(Some(_))` when they cannot be found.
    /// What a router asks per command: no list is built.
    pub fn routing_slot(&self, args: &[&[u8]]) -> Result<Option<u16>, Option<KeysError>> {
        let entry = self.resolved(args).map_err(Some)?;
        if entry.one_key {
            // What `each_key` finds for its one spec, without the walk
            // (callgrind, `SET -P 16`: the walk was about 200 instructions
            // per command routed).
            return match args.get(1) {
                Some(key) => Ok(Some(key_slot(key))),
                None => Err(Some(KeysError::Syntax)),
            };
        }
        let mut slot = None;
        let mut cross = false;
        each_key(entry, args, true, |k| {
            let s = key_slot(k);
            match slot {
                None => slot = Some(s),
                Some(first) if first != s => cross = true,
                Some(_) => {}
            }
        })
        .map_err(Some)?;
        match cross {
            true => Err(None),
            false => Ok(slot),
        }
    }

    /// Whether the server flags the command `args` (its name first; a
    /// container's subcommand by its second argument) `write`; `None` for
    /// a command it did not describe.
    pub fn writes(&self, args: &[&[u8]]) -> Option<bool> {
        self.resolved(args).ok().map(|e| e.write)
    }

    /// Whether the server would queue the command `args` in a `MULTI`:
    /// a command it describes, with a number of arguments its arity
    /// allows (what Redis checks before queuing; a refusal there makes
    /// `EXEC` abort).
    pub fn accepts(&self, args: &[&[u8]]) -> bool {
        let n = args.len() as i64;
        self.resolved(args)
            .is_ok_and(|e| (e.arity >= 0 && n == e.arity) || (e.arity < 0 && n >= -e.arity))
    }

    /// The entry of the command `args`: a container's subcommand's.
    fn resolved(&self, args: &[&[u8]]) -> Result<&Entry, KeysError> {
        let name = args.first().copied().unwrap_or_default();
        let unknown = || KeysError::Unknown(String::from_utf8_lossy(name).to_ascii_lowercase());
        let entry = self.entry(name).ok_or_else(unknown)?;
        if !entry.container {
            return Ok(entry);
        }
        let mut full = name.to_ascii_lowercase();
        full.push(b'|');
        full.extend(
            args.get(1)
                .map(|s| s.to_ascii_lowercase())
                .unwrap_or_default(),
        );
        self.entry(&full).ok_or_else(unknown)
    }

    fn find<'a>(&self, args: &[&'a [u8]], not_keys: bool) -> Result<Vec<&'a [u8]>, KeysError> {
        let mut keys = Vec::new();
        self.each_key(args, not_keys, |k| keys.push(k))?;
        Ok(keys)
    }

    /// The entry of a name, any case, looked up without allocating for
    /// names of up to 15 bytes.
    fn entry(&self, name: &[u8]) -> Option<&Entry> {
        match folded(name) {
            0 => self.commands.get(&name.to_ascii_lowercase()[..]),
            key => self.folded.get(&key),
        }
    }

    fn each_key<'a>(
        &self,
        args: &[&'a [u8]],
        not_keys: bool,
        f: impl FnMut(&'a [u8]),
    ) -> Result<(), KeysError> {
        each_key(self.resolved(args)?, args, not_keys, f)
    }
}

/// Calls `f` with each key of the command `args` that `entry` describes
/// (and its `not_key` arguments when `not_keys`).
fn each_key<'a>(
    entry: &Entry,
    args: &[&'a [u8]],
    not_keys: bool,
    mut f: impl FnMut(&'a [u8]),
) -> Result<(), KeysError> {
    if entry.unreadable {
        return Err(KeysError::Incomplete);
    }
    let argc = args.len() as i64;
    for spec in entry.specs.iter().filter(|s| not_keys || !s.not_key) {
        if spec.incomplete {
            return Err(KeysError::Incomplete);
        }
        let Some(first) = begin(&spec.begin, args) else {
            continue;
        };
        let (first, last, step) = range(&spec.find, first, args)?;
        if last >= argc || last < first || first >= argc {
            return Err(KeysError::Syntax);
        }
        let mut i = first;
        while i <= last {
            f(args[i as usize]);
            i += step.max(1);
        }
    }
    Ok(())
}

/// Where a spec's keys begin (`None`: its keyword is absent: no keys).
fn begin(begin: &Begin, args: &[&[u8]]) -> Option<i64> {
    let argc = args.len() as i64;
    match begin {
        Begin::Index(i) => Some(*i),
        Begin::Keyword { keyword, startfrom } => {
            let (start, end) = match *startfrom > 0 {
                true => (*startfrom, argc - 1),
                false => (argc + startfrom, 1),
            };
            let mut i = start;
            loop {
                if i >= argc || i < 1 {
                    return None;
                }
                if args[i as usize].eq_ignore_ascii_case(keyword) {
                    return Some(i + 1);
                }
                if i == end {
                    return None;
                }
                i += if start <= end { 1 } else { -1 };
            }
        }
    }
}

/// A spec's first and last key index and step, from where it begins.
fn range(find: &Find, first: i64, args: &[&[u8]]) -> Result<(i64, i64, i64), KeysError> {
    let argc = args.len() as i64;
    match *find {
        Find::Range {
            lastkey,
            keystep,
            limit,
        } => {
            let last = match (lastkey >= 0, limit) {
                (true, _) => first + lastkey,
                (false, 0) => argc + lastkey,
                (false, limit) => first + ((argc - first) / limit + lastkey),
            };
            Ok((first, last, keystep))
        }
        Find::Keynum {
            keynumidx,
            firstkey,
            keystep,
        } => {
            let at = first + keynumidx;
            if keynumidx >= argc - first || at < 0 {
                return Err(KeysError::Syntax);
            }
            let n = crate::protocol::request::string2ll(args[at as usize])
                .filter(|&n| n >= 0)
                .ok_or(KeysError::Syntax)?;
            let first = first + firstkey;
            Ok((first, first + (n - 1) * keystep.max(1), keystep))
        }
    }
}

/// The one slot of `keys` (`None`: no keys), or [`CrossSlot`].
pub fn slot_of(keys: &[&[u8]]) -> Result<Option<u16>, CrossSlot> {
    let mut slots = keys.iter().map(|k| key_slot(k));
    let Some(first) = slots.next() else {
        return Ok(None);
    };
    match slots.all(|s| s == first) {
        true => Ok(Some(first)),
        false => Err(CrossSlot),
    }
}

fn array(frame: OwnedFrame) -> Result<Vec<OwnedFrame>, KeysError> {
    match frame {
        OwnedFrame::Array(items) => Ok(items),
        _ => Err(KeysError::Reply("an array expected")),
    }
}

fn text(frame: &OwnedFrame) -> String {
    match frame {
        OwnedFrame::BulkString(b) | OwnedFrame::SimpleString(b) => {
            String::from_utf8_lossy(b).into_owned()
        }
        _ => String::new(),
    }
}

/// A flat `name, value, …` array's field `name`.
fn field<'a>(items: &'a [OwnedFrame], name: &str) -> Option<&'a OwnedFrame> {
    items
        .chunks(2)
        .find(|pair| pair.first().map(text).as_deref() == Some(name))
        .and_then(|pair| pair.get(1))
}

fn int_field(items: &[OwnedFrame], name: &str) -> Option<i64> {
    match field(items, name)? {
        OwnedFrame::Integer(n) => Some(*n),
        _ => None,
    }
}

fn items(frame: Option<&OwnedFrame>) -> &[OwnedFrame] {
    match frame {
        Some(OwnedFrame::Array(items)) => items,
        _ => &[],
    }
}

/// One key specification (a flat map), or `None` for a kind not known.
fn read_spec(spec: &OwnedFrame) -> Option<Spec> {
    let spec = items(Some(spec));
    let flags: Vec<String> = items(field(spec, "flags")).iter().map(text).collect();
    let has = |f: &str| flags.iter().any(|x| x.eq_ignore_ascii_case(f));
    let bs = items(field(spec, "begin_search"));
    let bs_spec = items(field(bs, "spec"));
    let begin = match field(bs, "type").map(text).as_deref() {
        Some("index") => Begin::Index(int_field(bs_spec, "index")?),
        Some("keyword") => Begin::Keyword {
            keyword: field(bs_spec, "keyword").map(text)?.into_bytes(),
            startfrom: int_field(bs_spec, "startfrom")?,
        },
        _ => return None,
    };
    let fk = items(field(spec, "find_keys"));
    let fk_spec = items(field(fk, "spec"));
    let find = match field(fk, "type").map(text).as_deref() {
        Some("range") => Find::Range {
            lastkey: int_field(fk_spec, "lastkey")?,
            keystep: int_field(fk_spec, "keystep")?,
            limit: int_field(fk_spec, "limit")?,
        },
        Some("keynum") => Find::Keynum {
            keynumidx: int_field(fk_spec, "keynumidx")?,
            firstkey: int_field(fk_spec, "firstkey")?,
            keystep: int_field(fk_spec, "keystep")?,
        },
        _ => return None,
    };
    Some(Spec {
        begin,
        find,
        incomplete: has("incomplete"),
        not_key: has("not_key"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_of_keys() {
        assert_eq!(slot_of(&[]), Ok(None));
        assert_eq!(slot_of(&[b"foo"]), Ok(Some(12_182)));
        assert_eq!(slot_of(&[b"{u}a", b"{u}b"]), Ok(Some(key_slot(b"u"))));
        assert_eq!(slot_of(&[b"foo", b"bar"]), Err(CrossSlot));
    }

    /// The searches of Redis's key specs, on hand-made specs.
    #[test]
    fn begin_and_find_as_redis_does() {
        let args: Vec<&[u8]> = vec![
            b"XREAD", b"COUNT", b"2", b"STREAMS", b"s1", b"s2", b"0", b"0",
        ];
        let kw = Begin::Keyword {
            keyword: b"STREAMS".to_vec(),
            startfrom: 1,
        };
        assert_eq!(begin(&kw, &args), Some(4));
        let half = Find::Range {
            lastkey: -1,
            keystep: 1,
            limit: 2,
        };
        assert_eq!(range(&half, 4, &args), Ok((4, 5, 1)));
        let none: Vec<&[u8]> = vec![b"XREAD", b"COUNT", b"2"];
        assert_eq!(begin(&kw, &none), None);
        let zu: Vec<&[u8]> = vec![
            b"ZUNIONSTORE",
            b"d",
            b"2",
            b"a",
            b"b",
            b"WEIGHTS",
            b"1",
            b"2",
        ];
        let num = Find::Keynum {
            keynumidx: 0,
            firstkey: 1,
            keystep: 1,
        };
        assert_eq!(range(&num, 2, &zu), Ok((3, 4, 1)));
        let bad: Vec<&[u8]> = vec![b"ZUNIONSTORE", b"d", b"x"];
        assert_eq!(range(&num, 2, &bad), Err(KeysError::Syntax));
    }
}
