//! The command table: which commands change how a connection's replies flow.
//! Names are matched case-insensitively without allocating; everything not
//! listed is [`CommandKind::Other`] and is forwarded untouched.

/// Longest command name worth classifying; longer names are `Other`.
const MAX_NAME: usize = 16;

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
    /// `SYNC`/`PSYNC`: the connection becomes a replication stream.
    Sync,
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
    /// `WATCH`, `RENAME`, `COPY`… (refused across them); which arguments
    /// are keys.
    MultiKey(MultiKeys),
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
    if name.len() > 12 {
        return 0;
    }
    let mut lower = [0u8; 12];
    for (o, c) in lower.iter_mut().zip(name) {
        *o = c.to_ascii_lowercase();
    }
    let lower = &lower[..name.len()];
    // Length and first byte rule out almost every label without a memcmp
    // call; this runs for every request.
    LABELS
        .iter()
        .position(|l| {
            let l = l.as_bytes();
            l.len() == lower.len() && l.first() == lower.first() && l == lower
        })
        .unwrap_or(0)
}

/// Classifies a command by its name (`arg0`) and, for `CLIENT`, its
/// subcommand and argument.
pub fn classify(name: &[u8], arg1: &[u8], arg2: &[u8]) -> CommandKind {
    let mut upper = [0u8; MAX_NAME];
    let Some(name) = uppercase(name, &mut upper) else {
        return CommandKind::Other;
    };
    match name {
        b"MULTI" => CommandKind::Multi,
        b"EXEC" => CommandKind::Exec,
        b"DISCARD" => CommandKind::Discard,
        b"HELLO" => CommandKind::Hello,
        b"RESET" => CommandKind::Reset,
        b"QUIT" => CommandKind::Quit,
        b"SUBSCRIBE" => CommandKind::Subscribe(SubKind::Subscribe),
        b"PSUBSCRIBE" => CommandKind::Subscribe(SubKind::PSubscribe),
        b"SSUBSCRIBE" => CommandKind::Subscribe(SubKind::SSubscribe),
        b"UNSUBSCRIBE" => CommandKind::Subscribe(SubKind::Unsubscribe),
        b"PUNSUBSCRIBE" => CommandKind::Subscribe(SubKind::PUnsubscribe),
        b"SUNSUBSCRIBE" => CommandKind::Subscribe(SubKind::SUnsubscribe),
        b"MONITOR" => CommandKind::Monitor,
        b"SYNC" | b"PSYNC" => CommandKind::Sync,
        b"SETNX" => CommandKind::SetNx,
        b"SET" => CommandKind::Set,
        b"GETSET" => CommandKind::GetSet,
        b"GETDEL" => CommandKind::GetDel,
        b"GETEX" => CommandKind::GetEx,
        b"DEL" => CommandKind::Del,
        b"UNLINK" => CommandKind::Unlink,
        b"EXPIRE" => CommandKind::Expire("EXPIRE"),
        b"PEXPIRE" => CommandKind::Expire("PEXPIRE"),
        b"EXPIREAT" => CommandKind::Expire("EXPIREAT"),
        b"PEXPIREAT" => CommandKind::Expire("PEXPIREAT"),
        b"PERSIST" => CommandKind::Persist,
        b"LOCKGATE" => CommandKind::Lockgate,
        b"SELECT" => CommandKind::Select,
        b"GET" | b"TTL" | b"PTTL" | b"TYPE" => CommandKind::Read(ReadKeys::First),
        b"EXISTS" => CommandKind::Read(ReadKeys::All),
        b"EVAL" | b"EVALSHA" | b"EVAL_RO" | b"EVALSHA_RO" => CommandKind::Eval,
        b"SCRIPT" => CommandKind::Script,
        b"MGET" | b"TOUCH" | b"WATCH" | b"RENAME" | b"RENAMENX" | b"COPY" => {
            CommandKind::MultiKey(MultiKeys::All)
        }
        b"MSET" | b"MSETNX" => CommandKind::MultiKey(MultiKeys::Pairs),
        b"CLIENT" if arg1.eq_ignore_ascii_case(b"REPLY") => {
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
        _ => CommandKind::Other,
    }
}

/// Uppercases `name` into `buf`; `None` if it is too long to be a known name.
fn uppercase<'a>(name: &[u8], buf: &'a mut [u8; MAX_NAME]) -> Option<&'a [u8]> {
    let out = buf.get_mut(..name.len())?;
    for (o, c) in out.iter_mut().zip(name) {
        *o = c.to_ascii_uppercase();
    }
    Some(out)
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
            classify(b"GET", b"k", b""),
            CommandKind::Read(ReadKeys::First)
        );
        assert_eq!(classify(b"HGET", b"k", b"f"), CommandKind::Other);
        assert_eq!(
            classify(b"pexpireat", b"k", b"1"),
            CommandKind::Expire("PEXPIREAT")
        );
        assert_eq!(classify(b"setnx", b"k", b"v"), CommandKind::SetNx);
        assert_eq!(classify(&[b'A'; 40], b"", b""), CommandKind::Other);
    }
}
