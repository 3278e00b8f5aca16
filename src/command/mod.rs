//! The command table: which commands change how a connection's replies flow.
//! Names are matched case-insensitively without allocating; everything not
//! listed is [`CommandKind::Other`] and is forwarded untouched.

pub mod connection;
mod names;

/// What a command does to the connection's reply stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommandKind {
    /// `MULTI`: later commands are queued (`+QUEUED`).
    Multi,
    /// `EXEC`: ends the transaction.
    Exec,
    /// `DISCARD`: ends the transaction.
    Discard,
    /// `HELLO`: may switch the connection to RESP3.
    Hello,
    /// `RESET`: back to a fresh connection (RESP2, db 0, no subscriptions).
    Reset,
    /// `QUIT`: Redis replies `+OK` and closes.
    Quit,
    /// A (P|S)(UN)SUBSCRIBE: one confirmation per channel instead of one
    /// reply, and published messages between replies.
    Subscribe(SubKind),
    /// `MONITOR`: Redis streams every command from then on.
    Monitor,
    /// `CLIENT REPLY ON|OFF|SKIP`: replies suppressed or back on.
    ClientReply(ReplyMode),
    /// `CLIENT SETNAME name`: forwarded as any command; the name is noted
    /// for operators (`LOCKGATE LOCKS`, `WAITERS`).
    ClientSetName,
    /// `SYNC`/`PSYNC`: the connection becomes a replication stream.
    Sync,
    /// A command Redis may hold unanswered until data arrives or time
    /// passes (`BLPOP`, `XREAD … BLOCK`, `WAIT`, …): a client that
    /// half-closes while one is pending expects Redis to drop it.
    Blocking,
    /// `SETNX key value`.
    SetNx,
    /// `SET key value [options]`.
    Set,
    /// `GETSET key value`.
    GetSet,
    /// `GETDEL key`.
    GetDel,
    /// `GETEX key [options]`.
    GetEx,
    /// `DEL key…`.
    Del,
    /// `UNLINK key…`.
    Unlink,
    /// `EXPIRE`, `PEXPIRE`, `EXPIREAT`, `PEXPIREAT key …`; the uppercase name.
    Expire(&'static str),
    /// `PERSIST key`.
    Persist,
    /// `LOCKGATE …`: lockgate's own admin commands.
    Lockgate,
    /// `SELECT db`.
    Select,
    /// Reads the quorum answers for lock keys: `GET`, `EXISTS`, `TTL`,
    /// `PTTL`, `TYPE`; which arguments are keys.
    Read(ReadKeys),
    /// `EVAL`, `EVALSHA` (and `_RO`): keys follow `numkeys`.
    Eval,
    /// `SCRIPT …` (`LOAD` bodies are remembered for the quorum).
    Script,
    /// Commands over several keys whose keys the quorum routes must see:
    /// `MGET`, `TOUCH` (split between the stores), `MSET`, `MSETNX`,
    /// `WATCH` (refused across them); which arguments are keys.
    MultiKey(MultiKeys),
    /// `FLUSHDB`, `FLUSHALL`, `SWAPDB`: every key of a database changes at
    /// once, lock keys too, behind the lock room's back.
    Flush,
    /// A value leaves a key or arrives at one, in this database or another:
    /// `RENAME`, `RENAMENX`, `COPY src dst …` (the first 2 arguments are
    /// keys), `MOVE key db` (the first 1). Refused across the stores with
    /// the quorum, like [`CommandKind::MultiKey`].
    Relocate(u8),
    /// Anything else: one request, one reply.
    Other,
}

/// Which arguments of a [`CommandKind::MultiKey`] are keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MultiKeys {
    /// Every argument (`MGET`, `TOUCH`, `WATCH`, …).
    All,
    /// The first of each key/value pair (`MSET`, `MSETNX`).
    Pairs,
}

/// Which arguments of a [`CommandKind::Read`] are keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadKeys {
    /// Only the first (`GET`, `TTL`, `PTTL`, `TYPE`).
    First,
    /// Every argument (`EXISTS`).
    All,
}

/// Which subscription command: its confirmations carry this name, and it
/// adds to or removes from one of three sets (channels, patterns, shard
/// channels).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubKind {
    /// `SUBSCRIBE`.
    Subscribe,
    /// `PSUBSCRIBE`.
    PSubscribe,
    /// `SSUBSCRIBE`.
    SSubscribe,
    /// `UNSUBSCRIBE`.
    Unsubscribe,
    /// `PUNSUBSCRIBE`.
    PUnsubscribe,
    /// `SUNSUBSCRIBE`.
    SUnsubscribe,
}

impl SubKind {
    /// The name Redis puts first in this command's confirmations.
    pub fn confirmation(self) -> &'static [u8] {
        match self {
            SubKind::Subscribe => b"subscribe",
            SubKind::PSubscribe => b"psubscribe",
            SubKind::SSubscribe => b"ssubscribe",
            SubKind::Unsubscribe => b"unsubscribe",
            SubKind::PUnsubscribe => b"punsubscribe",
            SubKind::SUnsubscribe => b"sunsubscribe",
        }
    }

    /// The kind whose confirmations are named `name`, if any.
    pub fn from_confirmation(name: &[u8]) -> Option<SubKind> {
        [
            SubKind::Subscribe,
            SubKind::PSubscribe,
            SubKind::SSubscribe,
            SubKind::Unsubscribe,
            SubKind::PUnsubscribe,
            SubKind::SUnsubscribe,
        ]
        .into_iter()
        .find(|k| k.confirmation() == name)
    }

    /// The set it acts on: 0 channels, 1 patterns, 2 shard channels.
    pub fn set(self) -> usize {
        match self {
            SubKind::Subscribe | SubKind::Unsubscribe => 0,
            SubKind::PSubscribe | SubKind::PUnsubscribe => 1,
            SubKind::SSubscribe | SubKind::SUnsubscribe => 2,
        }
    }

    /// True for the subscribing half.
    pub fn adds(self) -> bool {
        matches!(
            self,
            SubKind::Subscribe | SubKind::PSubscribe | SubKind::SSubscribe
        )
    }
}

/// `CLIENT REPLY` modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReplyMode {
    /// Every command is answered (the default).
    #[default]
    On,
    /// No command is answered until `CLIENT REPLY ON`.
    Off,
    /// The next command is not answered.
    Skip,
}

/// Command names counted one by one in `lockgate_commands_total`; every
/// other name counts as `other`, so the label set stays bounded.
pub const LABELS: &[&str] = &[
    "other",
    "get",
    "set",
    "setnx",
    "del",
    "unlink",
    "expire",
    "pexpire",
    "ttl",
    "pttl",
    "exists",
    "getset",
    "incr",
    "decr",
    "mget",
    "mset",
    "hget",
    "hset",
    "hgetall",
    "lpush",
    "rpush",
    "lpop",
    "rpop",
    "blpop",
    "brpop",
    "sadd",
    "zadd",
    "publish",
    "subscribe",
    "eval",
    "evalsha",
    "multi",
    "exec",
    "watch",
    "ping",
    "select",
    "auth",
    "hello",
    "client",
    "lockgate",
];

/// Index of `name` in [`LABELS`] (0: other). Case-insensitive.
pub fn label_index(name: &[u8]) -> usize {
    names::label_of(names::key(name))
}

/// Classifies a command by its name (`arg0`) and, for `CLIENT`, its
/// subcommand and argument.
pub fn classify(name: &[u8], arg1: &[u8], arg2: &[u8]) -> CommandKind {
    classify_key(names::key(name), arg1, arg2)
}

/// A command name folded to one integer, alike for names equal but for
/// ASCII case; 0 for an empty name or one over 15 bytes. A table of
/// commands keyed by it is looked up without lowercasing or hashing the
/// bytes (see [`crate::cluster::keys::KeyTable`]).
pub fn folded(name: &[u8]) -> u128 {
    names::key(name)
}

/// [`classify`] and [`label_index`] at once, the name folded once: what
/// every request passing through needs.
// Inlined into the dispatcher's loop, where the compiler had put it by
// itself until this round's changes elsewhere in the crate moved it out
// of line (callgrind, dedicated `SET -P 16`: 1 345 instructions per
// request before, 1 406 out of line, 1 356 inlined again).
#[inline(always)]
pub fn lookup(name: &[u8], arg1: &[u8], arg2: &[u8]) -> (CommandKind, usize) {
    let key = names::key(name);
    (classify_key(key, arg1, arg2), names::label_of(key))
}

#[inline(always)]
fn classify_key(folded: u128, arg1: &[u8], arg2: &[u8]) -> CommandKind {
    use names::*;
    match folded {
        MULTI => CommandKind::Multi,
        EXEC => CommandKind::Exec,
        DISCARD => CommandKind::Discard,
        HELLO => CommandKind::Hello,
        RESET => CommandKind::Reset,
        QUIT => CommandKind::Quit,
        SUBSCRIBE => CommandKind::Subscribe(SubKind::Subscribe),
        PSUBSCRIBE => CommandKind::Subscribe(SubKind::PSubscribe),
        SSUBSCRIBE => CommandKind::Subscribe(SubKind::SSubscribe),
        UNSUBSCRIBE => CommandKind::Subscribe(SubKind::Unsubscribe),
        PUNSUBSCRIBE => CommandKind::Subscribe(SubKind::PUnsubscribe),
        SUNSUBSCRIBE => CommandKind::Subscribe(SubKind::SUnsubscribe),
        MONITOR => CommandKind::Monitor,
        SYNC | PSYNC => CommandKind::Sync,
        BLPOP | BRPOP | BRPOPLPUSH | BLMOVE | BLMPOP | BZPOPMIN | BZPOPMAX | BZMPOP | XREAD
        | XREADGROUP | WAIT | WAITAOF => CommandKind::Blocking,
        SETNX => CommandKind::SetNx,
        SET => CommandKind::Set,
        GETSET => CommandKind::GetSet,
        GETDEL => CommandKind::GetDel,
        GETEX => CommandKind::GetEx,
        DEL => CommandKind::Del,
        UNLINK => CommandKind::Unlink,
        EXPIRE => CommandKind::Expire("EXPIRE"),
        PEXPIRE => CommandKind::Expire("PEXPIRE"),
        EXPIREAT => CommandKind::Expire("EXPIREAT"),
        PEXPIREAT => CommandKind::Expire("PEXPIREAT"),
        PERSIST => CommandKind::Persist,
        LOCKGATE => CommandKind::Lockgate,
        SELECT => CommandKind::Select,
        GET | TTL | PTTL | TYPE => CommandKind::Read(ReadKeys::First),
        EXISTS => CommandKind::Read(ReadKeys::All),
        EVAL | EVALSHA | EVAL_RO | EVALSHA_RO => CommandKind::Eval,
        SCRIPT => CommandKind::Script,
        MGET | TOUCH | WATCH => CommandKind::MultiKey(MultiKeys::All),
        RENAME | RENAMENX | COPY => CommandKind::Relocate(2),
        MOVE => CommandKind::Relocate(1),
        FLUSHDB | FLUSHALL | SWAPDB => CommandKind::Flush,
        MSET | MSETNX => CommandKind::MultiKey(MultiKeys::Pairs),
        CLIENT if arg1.eq_ignore_ascii_case(b"REPLY") => {
            if arg2.eq_ignore_ascii_case(b"OFF") {
                CommandKind::ClientReply(ReplyMode::Off)
            } else if arg2.eq_ignore_ascii_case(b"SKIP") {
                CommandKind::ClientReply(ReplyMode::Skip)
            } else if arg2.eq_ignore_ascii_case(b"ON") {
                CommandKind::ClientReply(ReplyMode::On)
            } else {
                CommandKind::Other
            }
        }
        CLIENT if arg1.eq_ignore_ascii_case(b"SETNAME") => CommandKind::ClientSetName,
        _ => CommandKind::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_case_insensitive() {
        assert_eq!(classify(b"mUlTi", b"", b""), CommandKind::Multi);
        assert_eq!(
            classify(b"psubscribe", b"a*", b""),
            CommandKind::Subscribe(SubKind::PSubscribe)
        );
        assert_eq!(
            classify(b"client", b"reply", b"skip"),
            CommandKind::ClientReply(ReplyMode::Skip)
        );
        assert_eq!(
            classify(b"CLIENT", b"REPLY", b"ON"),
            CommandKind::ClientReply(ReplyMode::On)
        );
        assert_eq!(classify(b"CLIENT", b"REPLY", b"X"), CommandKind::Other);
        assert_eq!(
            classify(b"client", b"setname", b"w1"),
            CommandKind::ClientSetName
        );
        assert_eq!(classify(b"CLIENT", b"GETNAME", b""), CommandKind::Other);
        assert_eq!(
            classify(b"GET", b"k", b""),
            CommandKind::Read(ReadKeys::First)
        );
        assert_eq!(classify(b"HGET", b"k", b"f"), CommandKind::Other);
        assert_eq!(
            classify(b"pexpireat", b"k", b"1"),
            CommandKind::Expire("PEXPIREAT")
        );
        assert_eq!(classify(b"setnx", b"k", b"v"), CommandKind::SetNx);
        assert_eq!(classify(b"flushall", b"ASYNC", b""), CommandKind::Flush);
        assert_eq!(classify(b"SWAPDB", b"0", b"1"), CommandKind::Flush);
        assert_eq!(classify(b"renamenx", b"a", b"b"), CommandKind::Relocate(2));
        assert_eq!(classify(b"MOVE", b"a", b"1"), CommandKind::Relocate(1));
        assert_eq!(classify(&[b'A'; 40], b"", b""), CommandKind::Other);
    }
}
