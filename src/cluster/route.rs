//! Where one client command goes when a cluster is behind lockgate: a
//! rule of the command's arguments, the nodes' key specifications and the
//! facade alone ([`route`]), table-tested. Which node serves a slot is the
//! slot map's to say, at the moment the command is sent
//! (`crate::upstream::cluster`); this only says by which slot, or how
//! else.

use super::facade::Facade;
use super::fanout::{fanout, Fanout};
use super::keys::{slot_of, KeyTable, KeysError};
use super::slot::SLOTS;
use super::split::{split, Split, CROSSSLOT};
use crate::command::connection::{needs_own_connection, OwnReason};
use crate::protocol::encode::LocalReply;

/// Where a command goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dest {
    /// Over the shared connection of the node serving this slot (`None`:
    /// no keys: any node).
    Node(Option<u16>),
    /// Over a connection of the session's own to the node serving this
    /// slot: a blocking command or a client's script, which would hold a
    /// shared connection's other clients behind it.
    Own(Option<u16>),
    /// Split per slot; the parts' replies merged into one.
    Split(Split),
    /// To every primary; their replies merged into one.
    Fanout(Fanout),
    /// `SCAN`: one primary after another, the cursor saying which.
    Scan,
    /// A transaction command, kept in one slot ([`super::tx`]).
    Tx(TxCommand),
    /// A subscription: from it on, the session passes through to this
    /// slot's node (`None`: any node: the cluster broadcasts `PUBLISH`).
    Subscribe(Option<u16>),
    /// Answered by lockgate with this reply.
    Local(LocalReply),
    /// `QUIT`: `+OK`, then the end of the replies.
    Quit,
    /// `HELLO [protover] [SETNAME name]`, answered by lockgate: the
    /// protocol from now on (`None`: the one in use).
    Hello(Option<u8>),
    /// `AUTH [user] pass`, or `HELLO … AUTH user pass`: checked against
    /// lockgate's own credentials ([`super::auth`]).
    Auth(Auth),
    /// `CLIENT SETNAME name` (`Some`) or `CLIENT GETNAME` (`None`):
    /// answered by lockgate, which keeps the session's name (its
    /// connections to the nodes are shared, named by lockgate).
    ClientName(Option<bytes::Bytes>),
}

/// A client's credentials, and the `HELLO` they came with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Auth {
    /// The user named (`None`: `AUTH pass`, the default user).
    pub user: Option<Vec<u8>>,
    /// The password.
    pub pass: Vec<u8>,
    /// Came with `HELLO` of this protocol: its answer follows once the
    /// credentials are checked.
    pub hello: Option<u8>,
}

/// The transaction commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxCommand {
    /// `MULTI`.
    Multi,
    /// `EXEC`.
    Exec,
    /// `DISCARD`.
    Discard,
    /// `WATCH` of keys in this slot (`Err`: they span slots; `Ok(None)`:
    /// no keys, a syntax error the node reports).
    Watch(Result<Option<u16>, ()>),
    /// `UNWATCH`.
    Unwatch,
}

/// Why a command is not served in front of a cluster (yet), in the
/// client's error.
fn not_served(what: &str, why: &str) -> LocalReply {
    LocalReply::err(format!(
        "lockgate: {what} is not served in front of a cluster: {why} (docs/cluster.md)"
    ))
}

/// The route of the command `args` (its name first, non-empty).
pub fn route(args: &[&[u8]], keys: &KeyTable, facade: &Facade) -> Dest {
    let Some(name) = args.first() else {
        return Dest::Node(None);
    };
    // Upper-cased on the stack: the names below are at most 8 bytes, and
    // this runs for every command.
    let mut buf = [0u8; 8];
    if let Some(upper) = buf.get_mut(..name.len()) {
        for (u, c) in upper.iter_mut().zip(name.iter()) {
            *u = c.to_ascii_uppercase();
        }
        match &*upper {
            b"CLUSTER" => return cluster(args, facade),
            b"READONLY" | b"ASKING" => return Dest::Local(LocalReply::Status("OK")),
            b"QUIT" => return Dest::Quit,
            b"MULTI" => return Dest::Tx(TxCommand::Multi),
            b"EXEC" => return Dest::Tx(TxCommand::Exec),
            b"DISCARD" => return Dest::Tx(TxCommand::Discard),
            b"UNWATCH" => return Dest::Tx(TxCommand::Unwatch),
            b"WATCH" => {
                let slot = slot_of(&args[1..]).map_err(|_| ());
                return Dest::Tx(TxCommand::Watch(slot));
            }
            b"SCAN" => return Dest::Scan,
            b"HELLO" => return hello(args),
            b"CLIENT" => {
                if let Some(dest) = client_name(args) {
                    return dest;
                }
            }
            b"AUTH" => return auth(args),
            b"DBSIZE" | b"KEYS" | b"FLUSHALL" | b"FLUSHDB" | b"SELECT" | b"SWAPDB" | b"SCRIPT"
            | b"FUNCTION" => match fanout(args) {
                Some(Fanout::Refuse(text)) => {
                    return Dest::Local(LocalReply::Error(bytes::Bytes::from_static(
                        text.as_bytes(),
                    )))
                }
                Some(f) => return Dest::Fanout(f),
                None => {}
            },
            _ => {}
        }
    } else if name.eq_ignore_ascii_case(b"READWRITE") {
        return Dest::Local(LocalReply::Status("OK"));
    }
    let slot = || match keys.routing_slot(args) {
        Ok(s) => Ok(s),
        Err(None) => Err(()),
        // The node says what is wrong with it (an unknown command, an
        // argument short), as directly.
        Err(Some(KeysError::Unknown(_) | KeysError::Syntax | KeysError::Reply(_))) => Ok(None),
        Err(Some(KeysError::Incomplete)) => Err(()),
    };
    match needs_own_connection(args) {
        None | Some(OwnReason::Paused) => {}
        Some(reason @ (OwnReason::Blocking | OwnReason::Script)) => {
            return match slot() {
                Ok(s) => Dest::Own(s),
                // A script known to act on each key alone is split.
                Err(()) => match (reason == OwnReason::Script).then(|| split(args)).flatten() {
                    Some(parts) => Dest::Split(parts),
                    None => Dest::Local(LocalReply::Error(CROSSSLOT.into())),
                },
            };
        }
        Some(OwnReason::PubSub) => {
            return match slot() {
                Ok(s) => Dest::Subscribe(s),
                Err(()) => Dest::Local(LocalReply::Error(CROSSSLOT.into())),
            }
        }
        Some(reason) => return Dest::Local(refusal(reason, &name.to_ascii_uppercase())),
    }
    match slot() {
        Ok(s) => Dest::Node(s),
        Err(()) => match split(args) {
            Some(parts) => Dest::Split(parts),
            None => Dest::Local(LocalReply::Error(CROSSSLOT.into())),
        },
    }
}

/// `CLIENT SETNAME name` and `CLIENT GETNAME`, checked as Redis checks
/// them; `None` for every other `CLIENT` subcommand.
fn client_name(args: &[&[u8]]) -> Option<Dest> {
    let sub = args.get(1)?;
    if sub.eq_ignore_ascii_case(b"GETNAME") {
        return Some(match args.len() {
            2 => Dest::ClientName(None),
            _ => Dest::Local(arity("client|getname")),
        });
    }
    if !sub.eq_ignore_ascii_case(b"SETNAME") {
        return None;
    }
    let [_, _, name] = args else {
        return Some(Dest::Local(arity("client|setname")));
    };
    // Redis: no spaces, newlines or other characters outside '!'..'~'.
    if name.iter().any(|&c| !(b'!'..=b'~').contains(&c)) {
        return Some(Dest::Local(LocalReply::err(
            "Client names cannot contain spaces, newlines or special characters.",
        )));
    }
    Some(Dest::ClientName(Some(bytes::Bytes::copy_from_slice(name))))
}

/// Redis's error for a wrong number of arguments.
fn arity(name: &str) -> LocalReply {
    LocalReply::err(format!("wrong number of arguments for '{name}' command"))
}

/// `HELLO [protover [AUTH user pass] [SETNAME name]]`: answered by
/// lockgate, which speaks the protocol asked to the nodes on connections
/// of that protocol; with `AUTH`, once the credentials are checked
/// ([`Dest::Auth`]). The name is not kept (the connections it would name
/// are shared).
fn hello(args: &[&[u8]]) -> Dest {
    let Some(version) = args.get(1) else {
        return Dest::Hello(None);
    };
    let version = match std::str::from_utf8(version)
        .ok()
        .and_then(|v| v.parse::<i64>().ok())
    {
        Some(v) => v,
        None => {
            return Dest::Local(LocalReply::err(
                "Protocol version is not an integer or out of range",
            ))
        }
    };
    if !(2..=3).contains(&version) {
        return Dest::Local(LocalReply::Error(bytes::Bytes::from_static(
            b"NOPROTO sorry, this protocol version is not supported.",
        )));
    }
    let mut rest = args[2..].iter();
    let mut credentials = None;
    while let Some(option) = rest.next() {
        if option.eq_ignore_ascii_case(b"AUTH") {
            match (rest.next(), rest.next()) {
                (Some(user), Some(pass)) => credentials = Some((user.to_vec(), pass.to_vec())),
                _ => return Dest::Local(LocalReply::err("Syntax error in HELLO option 'AUTH'")),
            }
            continue;
        }
        if !(option.eq_ignore_ascii_case(b"SETNAME") && rest.next().is_some()) {
            return Dest::Local(LocalReply::err(format!(
                "Syntax error in HELLO option '{}'",
                String::from_utf8_lossy(option)
            )));
        }
    }
    match credentials {
        Some((user, pass)) => Dest::Auth(Auth {
            user: Some(user),
            pass,
            hello: Some(version as u8),
        }),
        None => Dest::Hello(Some(version as u8)),
    }
}

/// `AUTH pass` or `AUTH user pass`.
fn auth(args: &[&[u8]]) -> Dest {
    let (user, pass) = match args {
        [_, pass] => (None, pass),
        [_, user, pass] => (Some(user.to_vec()), pass),
        [_] => {
            return Dest::Local(LocalReply::err(
                "wrong number of arguments for 'auth' command",
            ))
        }
        _ => return Dest::Local(LocalReply::err("syntax error")),
    };
    Dest::Auth(Auth {
        user,
        pass: pass.to_vec(),
        hello: None,
    })
}

/// `CLUSTER …`: the facade's answer, or by the slot it names, or refused.
fn cluster(args: &[&[u8]], facade: &Facade) -> Dest {
    if let Some(reply) = facade.cluster(&args[1..]) {
        return Dest::Local(reply);
    }
    let sub = args
        .get(1)
        .map(|s| s.to_ascii_uppercase())
        .unwrap_or_default();
    match sub.as_slice() {
        b"COUNTKEYSINSLOT" | b"GETKEYSINSLOT" => {
            let slot = args
                .get(2)
                .and_then(|s| std::str::from_utf8(s).ok())
                .and_then(|s| s.parse::<u16>().ok())
                .filter(|&s| s < SLOTS);
            match slot {
                Some(s) => Dest::Node(Some(s)),
                None => Dest::Local(LocalReply::err("Invalid slot")),
            }
        }
        _ => Dest::Local(not_served(
            &format!("CLUSTER {}", String::from_utf8_lossy(&sub)),
            "lockgate answers as a cluster of one node; ask the nodes behind it directly",
        )),
    }
}

/// The error for a command needing connection state lockgate does not
/// carry in front of a cluster.
fn refusal(reason: OwnReason, name: &[u8]) -> LocalReply {
    let name = String::from_utf8_lossy(name);
    let why = match reason {
        OwnReason::Identity => {
            "lockgate speaks RESP2 to the nodes as upstream.username on connections it shares"
        }
        OwnReason::Client => "the connection it would describe is one lockgate shares",
        OwnReason::Wait => "it would wait for one node's replicas only",
        OwnReason::Stream => "it would follow one node only",
        OwnReason::Kill | OwnReason::Debug => "send it to the node concerned directly",
        // SELECT of another database: the fan-out's refusal comes first.
        _ => "it needs a connection state lockgate does not carry there",
    };
    not_served(&name, why)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::cluster::slot::key_slot;

    /// A key table with the commands the rows use, as Redis 7 describes
    /// them (`COMMAND INFO`'s key specs, cut to what matters).
    pub(crate) fn table() -> KeyTable {
        // One-key commands at index 1, keys to the end (MGET, DEL), and
        // every other key (MSET); BLPOP's keys before its timeout; EVAL's
        // by its numkeys; SPUBLISH's channel as a not-key.
        let spec = |begin: i64, last: i64, step: i64, flags: &str| {
            format!(
                "*6\r\n$5\r\nflags\r\n*1\r\n+{flags}\r\n$12\r\nbegin_search\r\n*4\r\n$4\r\ntype\r\n$5\r\nindex\r\n$4\r\nspec\r\n*2\r\n$5\r\nindex\r\n:{begin}\r\n$9\r\nfind_keys\r\n*4\r\n$4\r\ntype\r\n$5\r\nrange\r\n$4\r\nspec\r\n*6\r\n$7\r\nlastkey\r\n:{last}\r\n$7\r\nkeystep\r\n:{step}\r\n$5\r\nlimit\r\n:0\r\n"
            )
        };
        let keynum = "*6\r\n$5\r\nflags\r\n*1\r\n+RW\r\n$12\r\nbegin_search\r\n*4\r\n$4\r\ntype\r\n$5\r\nindex\r\n$4\r\nspec\r\n*2\r\n$5\r\nindex\r\n:2\r\n$9\r\nfind_keys\r\n*4\r\n$4\r\ntype\r\n$6\r\nkeynum\r\n$4\r\nspec\r\n*6\r\n$9\r\nkeynumidx\r\n:0\r\n$8\r\nfirstkey\r\n:1\r\n$7\r\nkeystep\r\n:1\r\n".to_string();
        // Flagged `write` when a spec is RW (what guarded writes read).
        let command = |name: &str, specs: &[String]| {
            let flags = match specs.iter().any(|s| s.contains("+RW")) {
                true => "*1\r\n+write\r\n",
                false => "*0\r\n",
            };
            format!(
                "*10\r\n${}\r\n{name}\r\n:-2\r\n{flags}:1\r\n:1\r\n:1\r\n*0\r\n*0\r\n*{}\r\n{}*0\r\n",
                name.len(),
                specs.len(),
                specs.concat()
            )
        };
        let rows = [
            command("get", &[spec(1, 0, 1, "RO")]),
            command("set", &[spec(1, 0, 1, "RW")]),
            command("mget", &[spec(1, -1, 1, "RO")]),
            command("del", &[spec(1, -1, 1, "RW")]),
            command("mset", &[spec(1, -1, 2, "RW")]),
            command("lmove", &[spec(1, 0, 1, "RW"), spec(2, 0, 1, "RW")]),
            command("blpop", &[spec(1, -2, 1, "RW")]),
            command("eval", std::slice::from_ref(&keynum)),
            command("spublish", &[spec(1, 0, 1, "NOT_KEY")]),
            command("ssubscribe", &[spec(1, -1, 1, "NOT_KEY")]),
            command("subscribe", &[]),
            command("ping", &[]),
            command("publish", &[]),
        ];
        let reply = format!("*{}\r\n{}", rows.len(), rows.concat());
        KeyTable::from_command(reply.as_bytes()).expect("a key table")
    }

    fn facade() -> Facade {
        Facade::new("t", "127.0.0.1", 7000)
    }

    #[test]
    fn commands_go_by_their_keys_slot_or_are_answered_here() {
        let keys = table();
        let f = facade();
        let s = |k: &str| Some(key_slot(k.as_bytes()));
        let crossslot = Dest::Local(LocalReply::Error(CROSSSLOT.into()));
        // (command, where it goes)
        let rows: Vec<(&str, Dest)> = vec![
            ("GET a", Dest::Node(s("a"))),
            ("set {u}1 v", Dest::Node(s("u"))),
            ("PING", Dest::Node(None)),
            ("PUBLISH ch m", Dest::Node(None)),
            ("NOSUCH x y", Dest::Node(None)),
            ("GET", Dest::Node(None)),
            ("MGET {u}a {u}b", Dest::Node(s("u"))),
            ("LMOVE a b LEFT LEFT", crossslot.clone()),
            ("LMOVE {t}a {t}b LEFT LEFT", Dest::Node(s("t"))),
            ("SPUBLISH ch m", Dest::Node(s("ch"))),
            ("BLPOP q 0", Dest::Own(s("q"))),
            ("BLPOP a b 0", crossslot.clone()),
            ("EVAL x 1 k", Dest::Own(s("k"))),
            ("EVAL x 0", Dest::Own(None)),
            ("SUBSCRIBE a b", Dest::Subscribe(None)),
            ("SSUBSCRIBE ch", Dest::Subscribe(s("ch"))),
            ("MULTI", Dest::Tx(TxCommand::Multi)),
            ("exec", Dest::Tx(TxCommand::Exec)),
            ("WATCH a", Dest::Tx(TxCommand::Watch(Ok(s("a"))))),
            ("WATCH a b", Dest::Tx(TxCommand::Watch(Err(())))),
            ("SCAN 0", Dest::Scan),
            ("DBSIZE", Dest::Fanout(Fanout::Sum)),
            ("SCRIPT LOAD x", Dest::Fanout(Fanout::Same)),
            (
                "CLUSTER KEYSLOT a",
                Dest::Local(LocalReply::Integer(15_495)),
            ),
            ("CLUSTER COUNTKEYSINSLOT 7", Dest::Node(Some(7))),
            (
                "CLUSTER COUNTKEYSINSLOT 16384",
                Dest::Local(LocalReply::err("Invalid slot")),
            ),
            ("READONLY", Dest::Local(LocalReply::Status("OK"))),
            ("QUIT", Dest::Quit),
            (
                "SELECT 1",
                Dest::Local(LocalReply::Error(
                    "ERR SELECT is not allowed in cluster mode".into(),
                )),
            ),
            ("SELECT 0", Dest::Node(None)),
            ("CLIENT SETINFO LIB-NAME x", Dest::Node(None)),
            ("HELLO", Dest::Hello(None)),
            ("HELLO 3", Dest::Hello(Some(3))),
            ("hello 2 SETNAME app", Dest::Hello(Some(2))),
            (
                "HELLO 4",
                Dest::Local(LocalReply::Error(
                    "NOPROTO sorry, this protocol version is not supported.".into(),
                )),
            ),
        ];
        for (line, want) in rows {
            let args: Vec<&[u8]> = line.split(' ').map(str::as_bytes).collect();
            assert_eq!(route(&args, &keys, &f), want, "{line}");
        }
        // Across slots: split where the reply can be rebuilt.
        let args: Vec<&[u8]> = vec![b"MGET", b"a", b"b"];
        assert!(matches!(route(&args, &keys, &f), Dest::Split(_)));
        let args: Vec<&[u8]> = vec![b"DEL", b"a", b"b"];
        assert!(matches!(route(&args, &keys, &f), Dest::Split(_)));
        // Connection state lockgate does not carry: refused, saying so.
        for line in ["CLIENT KILL ID 1", "WAIT 1 0", "MONITOR"] {
            let args: Vec<&[u8]> = line.split(' ').map(str::as_bytes).collect();
            let Dest::Local(LocalReply::Error(text)) = route(&args, &keys, &f) else {
                panic!("{line}: refused");
            };
            let text = String::from_utf8_lossy(&text).into_owned();
            assert!(text.starts_with("ERR lockgate: "), "{line}: {text}");
            assert!(text.contains("docs/cluster.md"), "{line}: {text}");
        }
    }

    #[test]
    fn a_clients_name_is_kept_by_lockgate() {
        let keys = KeyTable::default();
        let f = Facade::new("127.0.0.1:6380", "id", 1);
        let dest = |line: &str| {
            let words: Vec<&[u8]> = line.split(' ').map(str::as_bytes).collect();
            route(&words, &keys, &f)
        };
        let err = |text: &str| Dest::Local(LocalReply::err(text));
        let table = [
            ("CLIENT SETNAME w1", Dest::ClientName(Some("w1".into()))),
            ("client setname w1", Dest::ClientName(Some("w1".into()))),
            ("CLIENT GETNAME", Dest::ClientName(None)),
            (
                "CLIENT SETNAME",
                err("wrong number of arguments for 'client|setname' command"),
            ),
            (
                "CLIENT GETNAME x",
                err("wrong number of arguments for 'client|getname' command"),
            ),
        ];
        for (line, want) in table {
            assert_eq!(dest(line), want, "{line}");
        }
        let words: Vec<&[u8]> = vec![b"CLIENT", b"SETNAME", b"a b"];
        assert_eq!(
            route(&words, &keys, &f),
            err("Client names cannot contain spaces, newlines or special characters.")
        );
    }

    #[test]
    fn auth_and_hello_auth_carry_the_credentials() {
        let keys = KeyTable::default();
        let f = Facade::new("127.0.0.1:6380", "id", 1);
        let dest = |line: &str| {
            let words: Vec<&[u8]> = line.split(' ').map(str::as_bytes).collect();
            route(&words, &keys, &f)
        };
        let auth = |user: Option<&str>, pass: &str, hello| {
            Dest::Auth(Auth {
                user: user.map(|u| u.as_bytes().to_vec()),
                pass: pass.as_bytes().to_vec(),
                hello,
            })
        };
        assert_eq!(dest("AUTH pw"), auth(None, "pw", None));
        assert_eq!(dest("auth app pw"), auth(Some("app"), "pw", None));
        assert_eq!(
            dest("HELLO 3 AUTH app pw SETNAME n"),
            auth(Some("app"), "pw", Some(3))
        );
        assert!(matches!(dest("AUTH"), Dest::Local(LocalReply::Error(_))));
        assert!(matches!(
            dest("AUTH a b c"),
            Dest::Local(LocalReply::Error(_))
        ));
        assert!(matches!(
            dest("HELLO 3 AUTH app"),
            Dest::Local(LocalReply::Error(_))
        ));
    }
}
