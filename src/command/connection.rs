//! Which commands need a connection of their own, for
//! `proxy.upstream = "shared"` (see `crate::upstream::shared`) and the
//! cluster lanes (`crate::cluster::route`): a command
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
    /// (not `CLIENT SETINFO`, which shares: see [`needs_own_connection`]).
    Client,
    /// `READONLY`, `READWRITE`, `ASKING`: cluster flags of the connection.
    Cluster,
    /// `QUIT`: Redis closes the connection after its reply.
    Quit,
    /// `SCRIPT KILL`, `FUNCTION KILL`, `SHUTDOWN`: they must reach Redis
    /// while a script runs, and a shared connection may be the one
    /// waiting for that script.
    Kill,
    /// A client's own script or function (`EVAL`, `EVALSHA`, `EVAL_RO`,
    /// `EVALSHA_RO`, `FCALL`, `FCALL_RO`): while one runs past
    /// `busy-reply-threshold` Redis answers other connections `-BUSY` and
    /// takes `SCRIPT KILL`, but the commands queued behind it on its own
    /// connection wait. Not lockgate's own lock scripts (short; see
    /// [`needs_own_connection`]).
    Script,
    /// `DEBUG`: while `DEBUG RELOAD` or `LOADAOF` loads, Redis answers
    /// other connections `-LOADING`, not the ones queued behind it; an
    /// operator's command, moved whole.
    Debug,
    /// Any command while a `CLIENT PAUSE` seen through this instance is in
    /// force ([`Pause`]): Redis holds a paused client's commands on its
    /// connection, and on a shared one every other client's behind them;
    /// on a connection of its own each client is held alone, as directly.
    Paused,
}

impl OwnReason {
    /// Every reason, in the order of [`OwnReason::index`].
    pub const ALL: [OwnReason; 14] = [
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
        OwnReason::Script,
        OwnReason::Debug,
        OwnReason::Paused,
    ];

    /// Its position in [`OwnReason::ALL`] (for a counter per reason).
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Whether a command (its arguments, name first, as sent to Redis) needs a
/// connection of its own, and why; `None`: it may share one. `SELECT 0` may
/// share (a session on a shared connection is in database 0); `XREAD` and
/// `XREADGROUP` only with `BLOCK`. `EVAL`/`EVALSHA` of lockgate's own lock
/// scripts (which it writes into the session's stream for lock commands,
/// told by body or SHA1: `crate::script::is_own_call`) share: they are
/// short, and moving them would take every lock user off the shared
/// connections.
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
        // `SETINFO` names the client library for `CLIENT LIST`: on a
        // shared connection it names that connection (cosmetic), and
        // moving at it would move every client whose library sends it
        // on connecting (Jedis 5, redis-py 5+ over RESP2).
        b"CLIENT" => match args.get(1) {
            Some(sub) if sub.eq_ignore_ascii_case(b"SETINFO") => return None,
            _ => OwnReason::Client,
        },
        b"READONLY" | b"READWRITE" | b"ASKING" => OwnReason::Cluster,
        b"QUIT" => OwnReason::Quit,
        b"SHUTDOWN" => OwnReason::Kill,
        verb @ (b"EVAL" | b"EVALSHA") => match args.get(1) {
            Some(first) if crate::script::is_own_call(verb == b"EVALSHA", first) => return None,
            _ => OwnReason::Script,
        },
        b"EVAL_RO" | b"EVALSHA_RO" | b"FCALL" | b"FCALL_RO" => OwnReason::Script,
        b"DEBUG" => OwnReason::Debug,
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

/// A `CLIENT PAUSE` or `CLIENT UNPAUSE` on its way to Redis, as the
/// shared pool follows it: a pause makes every client that sends a command
/// before it ends move to a connection of its own ([`OwnReason::Paused`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pause {
    /// `CLIENT PAUSE <ms> [WRITE|ALL]`: in force for `ms` milliseconds
    /// (either mode: a paused write holds a shared connection's reads too).
    For(u64),
    /// `CLIENT UNPAUSE`: no longer.
    Lifted,
}

/// The pause a command (its arguments, name first) starts or lifts; `None`
/// for every other command, and for a `CLIENT PAUSE` whose timeout is not
/// a whole number (Redis refuses it).
pub fn pause_of(args: &[&[u8]]) -> Option<Pause> {
    let (name, sub) = (args.first()?, args.get(1)?);
    if !name.eq_ignore_ascii_case(b"CLIENT") {
        return None;
    }
    if sub.eq_ignore_ascii_case(b"UNPAUSE") {
        return Some(Pause::Lifted);
    }
    if !sub.eq_ignore_ascii_case(b"PAUSE") {
        return None;
    }
    // Read as Redis reads the timeout (a negative one it refuses).
    let ms = crate::protocol::request::string2ll(args.get(2)?)?;
    Some(Pause::For(u64::try_from(ms).ok()?))
}

/// Whether a pause that ends at `until_ms` (0: none seen, or lifted) is in
/// force at `now_ms` (both on one monotonic clock, in ms).
pub fn paused(until_ms: u64, now_ms: u64) -> bool {
    until_ms != 0 && now_ms < until_ms
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
            ("EVAL return 0", Some(Script)),
            ("eval return 1 0", Some(Script)),
            (
                "EVALSHA e0e1f9fabfc9d4800c877a703b823ac0578ff8db 0",
                Some(Script),
            ),
            ("EVALSHA", Some(Script)),
            ("EVAL_RO return 1 0", Some(Script)),
            (
                "evalsha_ro e0e1f9fabfc9d4800c877a703b823ac0578ff8db 0",
                Some(Script),
            ),
            ("FCALL f 0", Some(Script)),
            ("fcall_ro f 0", Some(Script)),
            ("DEBUG SLEEP 1", Some(Debug)),
            ("debug reload", Some(Debug)),
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
            "CLIENT SETINFO LIB-NAME redis-py",
            "client setinfo lib-ver 5.0.1",
        ] {
            assert_eq!(decide(line), None, "{line}");
        }
    }

    /// The scripts lockgate writes for lock commands stay shared, by SHA1
    /// or by body, in any case of the name.
    #[test]
    fn lockgate_own_lock_scripts_may_share() {
        use crate::script::Script;
        for s in Script::all() {
            let (sha, body) = (s.sha().as_bytes(), s.body().as_bytes());
            for args in [
                [
                    &b"EVALSHA"[..],
                    sha,
                    b"2",
                    b"lock:a",
                    b"lockgate:owner:{lock:a}",
                ],
                [&b"evalsha"[..], sha, b"1", b"lock:a", b"x"],
                [
                    &b"EVAL"[..],
                    body,
                    b"2",
                    b"lock:a",
                    b"lockgate:owner:{lock:a}",
                ],
            ] {
                assert_eq!(needs_own_connection(&args), None, "{s:?}");
            }
            // Read-only variants are never lockgate's.
            let ro: [&[u8]; 3] = [b"EVALSHA_RO", sha, b"0"];
            assert_eq!(needs_own_connection(&ro), Some(OwnReason::Script));
        }
        let refusal: [&[u8]; 4] = [
            b"EVAL",
            crate::script::ERROR.as_bytes(),
            b"0",
            b"ERR lockgate: refused",
        ];
        assert_eq!(needs_own_connection(&refusal), None);
    }

    #[test]
    fn every_reason_has_its_index() {
        for (i, r) in OwnReason::ALL.iter().enumerate() {
            assert_eq!(r.index(), i);
        }
    }

    #[test]
    fn pauses_are_read_from_client_pause_and_unpause() {
        let of = |line: &str| {
            let args: Vec<&[u8]> = line.split(' ').map(str::as_bytes).collect();
            pause_of(&args)
        };
        let table = [
            ("CLIENT PAUSE 1000", Some(Pause::For(1000))),
            ("client pause 50 WRITE", Some(Pause::For(50))),
            ("CLIENT PAUSE 0 ALL", Some(Pause::For(0))),
            ("CLIENT UNPAUSE", Some(Pause::Lifted)),
            ("client unpause", Some(Pause::Lifted)),
            ("CLIENT PAUSE", None),
            ("CLIENT PAUSE -1", None),
            ("CLIENT PAUSE soon", None),
            ("CLIENT PAUSE 050", None),
            ("CLIENT SETNAME pause", None),
            ("PAUSE 100", None),
            ("CLIENT", None),
        ];
        for (line, want) in table {
            assert_eq!(of(line), want, "{line}");
        }
    }

    #[test]
    fn a_pause_is_in_force_until_its_end() {
        // (until, now, in force)
        let table = [
            (0, 0, false),
            (0, 5_000, false),
            (1_000, 999, true),
            (1_000, 1_000, false),
            (1_000, 1_001, false),
            (u64::MAX, 1, true),
        ];
        for (until, now, want) in table {
            assert_eq!(paused(until, now), want, "until {until} now {now}");
        }
    }
}
