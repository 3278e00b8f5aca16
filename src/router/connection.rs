//! Which commands need a connection of their own, for
//! `proxy.upstream = "shared"` (see `crate::upstream::shared`): a command
//! whose effect or reply depends on state Redis keeps per connection, or
//! that holds its connection, cannot travel over a connection that other
//! clients share. Pure: the arguments in, the reason out; the shared
//! stream carries the decision out (the session moves to a dedicated
//! connection, for good).
//!
//! Everything else is one command, one reply, no connection state: safe to
//! interleave with other clients' commands on one connection.

/// Why a command needs a connection of its own; labels the move counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnReason {
    /// `MULTI`, `WATCH`: a transaction and its watched keys belong to the
    /// connection.
    Transaction,
    /// A command that holds its connection until data comes (`BLPOP`,
    /// `XREAD … BLOCK`, …).
    Blocking,
    /// `WAIT`, `WAITAOF`: they wait for the connection's own earlier writes.
    Wait,
    /// `SUBSCRIBE` and its kin: pushes, and replies not one per command.
    PubSub,
    /// `MONITOR`, `SYNC`, `PSYNC`, `REPLCONF`: a stream of bytes, not replies.
    Stream,
    /// `SELECT` of a database other than 0.
    Select,
    /// `AUTH`, `HELLO`, `RESET`: the connection's user or protocol.
    Identity,
    /// `CLIENT …`: the connection's name, id, reply mode, tracking, …
    Client,
    /// `READONLY`, `READWRITE`, `ASKING`: cluster flags of the connection.
    Cluster,
    /// `QUIT`: Redis closes the connection after its reply.
    Quit,
    /// `SCRIPT KILL`, `FUNCTION KILL`, `SHUTDOWN`: they must reach Redis
    /// while a script runs, and a shared connection may be the one
    /// waiting for that script.
    Kill,
}

impl OwnReason {
    /// Every reason, in the order of [`OwnReason::index`].
    pub const ALL: [OwnReason; 11] = [
        OwnReason::Transaction,
        OwnReason::Blocking,
        OwnReason::Wait,
        OwnReason::PubSub,
        OwnReason::Stream,
        OwnReason::Select,
        OwnReason::Identity,
        OwnReason::Client,
        OwnReason::Cluster,
        OwnReason::Quit,
        OwnReason::Kill,
    ];

    /// Its position in [`OwnReason::ALL`] (for a counter per reason).
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Whether a command (its arguments, name first, as sent to Redis) needs a
/// connection of its own, and why; `None`: it may share one. `SELECT 0` may
/// share (a session on a shared connection is in database 0); `XREAD` and
/// `XREADGROUP` only with `BLOCK`.
pub fn needs_own_connection(args: &[&[u8]]) -> Option<OwnReason> {
    let name = args.first()?;
    // The longest name below is 12 bytes: longer ones are none of them,
    // told without a copy (undermoon's classifier: upper-case on the stack).
    let mut upper = [0u8; 12];
    let upper = upper.get_mut(..name.len())?;
    for (u, c) in upper.iter_mut().zip(name.iter()) {
        *u = c.to_ascii_uppercase();
    }
    let reason = match &*upper {
        b"MULTI" | b"WATCH" => OwnReason::Transaction,
        b"BLPOP" | b"BRPOP" | b"BRPOPLPUSH" | b"BLMOVE" | b"BLMPOP" | b"BZPOPMIN" | b"BZPOPMAX"
        | b"BZMPOP" => OwnReason::Blocking,
        b"XREAD" | b"XREADGROUP" => return xread_blocks(args),
        b"WAIT" | b"WAITAOF" => OwnReason::Wait,
        // Outside subscribed mode the unsubscribing ones still answer one
        // frame per channel named (or one for none): not one per command.
        b"SUBSCRIBE" | b"PSUBSCRIBE" | b"SSUBSCRIBE" | b"UNSUBSCRIBE" | b"PUNSUBSCRIBE"
        | b"SUNSUBSCRIBE" => OwnReason::PubSub,
        b"MONITOR" | b"SYNC" | b"PSYNC" | b"REPLCONF" => OwnReason::Stream,
        b"SELECT" => match args.get(1) {
            Some(db) if *db == b"0" => return None,
            _ => OwnReason::Select,
        },
        b"AUTH" | b"HELLO" | b"RESET" => OwnReason::Identity,
        b"CLIENT" => OwnReason::Client,
        b"READONLY" | b"READWRITE" | b"ASKING" => OwnReason::Cluster,
        b"QUIT" => OwnReason::Quit,
        b"SHUTDOWN" => OwnReason::Kill,
        b"SCRIPT" | b"FUNCTION" => match args.get(1) {
            Some(sub) if sub.eq_ignore_ascii_case(b"KILL") => OwnReason::Kill,
            _ => return None,
        },
        _ => return None,
    };
    Some(reason)
}

/// `XREAD`/`XREADGROUP` block only with a `BLOCK` option before `STREAMS`
/// (after it every argument is a key or an id).
fn xread_blocks(args: &[&[u8]]) -> Option<OwnReason> {
    for arg in args.iter().skip(1) {
        if arg.eq_ignore_ascii_case(b"STREAMS") {
            return None;
        }
        if arg.eq_ignore_ascii_case(b"BLOCK") {
            return Some(OwnReason::Blocking);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decide(line: &str) -> Option<OwnReason> {
        let args: Vec<&[u8]> = line.split(' ').map(str::as_bytes).collect();
        needs_own_connection(&args)
    }

    #[test]
    fn connection_scoped_commands_need_their_own_connection() {
        use OwnReason::*;
        let table = [
            ("MULTI", Some(Transaction)),
            ("watch k", Some(Transaction)),
            ("BLPOP q 0", Some(Blocking)),
            ("brpop q 1", Some(Blocking)),
            ("BRPOPLPUSH a b 0", Some(Blocking)),
            ("BLMOVE a b LEFT RIGHT 0", Some(Blocking)),
            ("BLMPOP 0 1 a LEFT", Some(Blocking)),
            ("BZPOPMIN z 0", Some(Blocking)),
            ("bzpopmax z 0", Some(Blocking)),
            ("BZMPOP 0 1 z MIN", Some(Blocking)),
            ("XREAD BLOCK 0 STREAMS s $", Some(Blocking)),
            ("XREADGROUP GROUP g c BLOCK 10 STREAMS s >", Some(Blocking)),
            ("WAIT 1 0", Some(Wait)),
            ("WAITAOF 1 0 0", Some(Wait)),
            ("SUBSCRIBE c", Some(PubSub)),
            ("PSUBSCRIBE c*", Some(PubSub)),
            ("SSUBSCRIBE c", Some(PubSub)),
            ("UNSUBSCRIBE", Some(PubSub)),
            ("PUNSUBSCRIBE", Some(PubSub)),
            ("SUNSUBSCRIBE", Some(PubSub)),
            ("MONITOR", Some(Stream)),
            ("SYNC", Some(Stream)),
            ("PSYNC ? -1", Some(Stream)),
            ("REPLCONF listening-port 1", Some(Stream)),
            ("SELECT 3", Some(Select)),
            ("SELECT 00", Some(Select)),
            ("SELECT", Some(Select)),
            ("AUTH pw", Some(Identity)),
            ("HELLO 3", Some(Identity)),
            ("hello", Some(Identity)),
            ("RESET", Some(Identity)),
            ("CLIENT SETNAME x", Some(Client)),
            ("client getname", Some(Client)),
            ("CLIENT ID", Some(Client)),
            ("CLIENT TRACKING on", Some(Client)),
            ("CLIENT REPLY OFF", Some(Client)),
            ("CLIENT NO-EVICT on", Some(Client)),
            ("READONLY", Some(Cluster)),
            ("READWRITE", Some(Cluster)),
            ("ASKING", Some(Cluster)),
            ("QUIT", Some(Quit)),
            ("SCRIPT KILL", Some(Kill)),
            ("function kill", Some(Kill)),
            ("SHUTDOWN NOSAVE", Some(Kill)),
        ];
        for (line, want) in table {
            assert_eq!(decide(line), want, "{line}");
        }
    }

    #[test]
    fn plain_commands_may_share() {
        for line in [
            "SET k v",
            "GET k",
            "SELECT 0",
            "XREAD STREAMS s 0",
            "XREAD COUNT 1 STREAMS BLOCK 0",
            "XREADGROUP GROUP g c STREAMS s >",
            "EVALSHA abc 1 lock:a",
            "SCRIPT LOAD x",
            "FUNCTION LIST",
            "EXEC",
            "DISCARD",
            "UNWATCH",
            "PING",
            "PUBLISH c m",
            "BITCOUNT k",
            "CLUSTER INFO",
            "SETNX lock:a 1",
        ] {
            assert_eq!(decide(line), None, "{line}");
        }
    }

    #[test]
    fn every_reason_has_its_index() {
        for (i, r) in OwnReason::ALL.iter().enumerate() {
            assert_eq!(r.index(), i);
        }
    }
}
