//! Keyspace-wide commands on a cluster: what lockgate will do with a
//! command that names no key but acts on the whole keyspace, and how the
//! primaries' answers merge into the one reply a single Redis would give.
//! `DBSIZE` sums, `KEYS` concatenates, `FLUSHALL`/`FLUSHDB` reach every
//! primary (`OK` once all are), `SCRIPT LOAD`/`FLUSH` and `FUNCTION`'s
//! changes reach every primary (the first answer); `SELECT` of another
//! database and `SWAPDB`
//! are refused as a cluster refuses them. `SCAN` has its own cursor
//! ([`super::scan`]). Pure.

use crate::protocol::encode::LocalReply;

/// Where a keyspace-wide command goes, and how its answers merge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fanout {
    /// To every primary; the integers summed (`DBSIZE`).
    Sum,
    /// To every primary; the arrays concatenated (`KEYS`).
    Concat,
    /// To every primary; `OK` once all are (`FLUSHALL`, `FLUSHDB`).
    AllOk,
    /// To every primary, which all answer alike; the first answer
    /// (`SCRIPT LOAD`/`FLUSH`, `FUNCTION LOAD`/`DELETE`/`FLUSH`/`RESTORE`:
    /// a script loaded on one node only would be `NOSCRIPT` on the others).
    Same,
    /// Refused, in a cluster's own words.
    Refuse(&'static str),
}

/// The fan-out of `args` (name first), if it is a keyspace-wide command
/// lockgate spreads or refuses; `None` for any other.
pub fn fanout(args: &[&[u8]]) -> Option<Fanout> {
    let name = args.first()?.to_ascii_uppercase();
    Some(match name.as_slice() {
        b"DBSIZE" if args.len() == 1 => Fanout::Sum,
        b"KEYS" if args.len() == 2 => Fanout::Concat,
        b"FLUSHALL" | b"FLUSHDB" => Fanout::AllOk,
        b"SCRIPT" if args.len() >= 2 => match args[1].to_ascii_uppercase().as_slice() {
            b"LOAD" | b"FLUSH" => Fanout::Same,
            _ => return None,
        },
        b"FUNCTION" if args.len() >= 2 => match args[1].to_ascii_uppercase().as_slice() {
            b"LOAD" | b"DELETE" | b"FLUSH" | b"RESTORE" => Fanout::Same,
            _ => return None,
        },
        b"SELECT" if args.get(1).is_some_and(|d| *d != b"0") => {
            Fanout::Refuse("ERR SELECT is not allowed in cluster mode")
        }
        b"SWAPDB" => Fanout::Refuse("ERR SWAPDB is not allowed in cluster mode"),
        _ => return None,
    })
}

impl Fanout {
    /// The client's reply from every primary's reply: the first error if
    /// any failed, else the merge.
    pub fn merge(&self, replies: Vec<LocalReply>) -> LocalReply {
        if let Some(e) = replies.iter().find(|r| matches!(r, LocalReply::Error(_))) {
            return e.clone();
        }
        let unexpected = || LocalReply::err("lockgate: unexpected reply from a primary");
        match self {
            Fanout::Sum => {
                let mut sum = 0;
                for r in &replies {
                    let LocalReply::Integer(n) = r else {
                        return unexpected();
                    };
                    sum += n;
                }
                LocalReply::Integer(sum)
            }
            Fanout::Concat => {
                let mut all = Vec::new();
                for r in replies {
                    let LocalReply::Array(items) = r else {
                        return unexpected();
                    };
                    all.extend(items);
                }
                LocalReply::Array(all)
            }
            Fanout::AllOk => LocalReply::Status("OK"),
            Fanout::Same => replies.into_iter().next().unwrap_or_else(unexpected),
            Fanout::Refuse(text) => LocalReply::Error(bytes::Bytes::from_static(text.as_bytes())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keyspace_wide_commands_fan_out_and_merge() {
        assert_eq!(fanout(&[b"dbsize"]), Some(Fanout::Sum));
        assert_eq!(fanout(&[b"KEYS", b"*"]), Some(Fanout::Concat));
        assert_eq!(fanout(&[b"FLUSHALL", b"ASYNC"]), Some(Fanout::AllOk));
        assert_eq!(
            fanout(&[b"SELECT", b"0"]),
            None,
            "database 0 is the cluster's"
        );
        assert!(matches!(
            fanout(&[b"SELECT", b"1"]),
            Some(Fanout::Refuse(_))
        ));
        assert_eq!(fanout(&[b"GET", b"k"]), None);
        assert_eq!(
            fanout(&[b"script", b"load", b"return 1"]),
            Some(Fanout::Same)
        );
        assert_eq!(fanout(&[b"FUNCTION", b"FLUSH"]), Some(Fanout::Same));
        assert_eq!(fanout(&[b"SCRIPT", b"EXISTS", b"x"]), None);
        let sha = LocalReply::Bulk(bytes::Bytes::from_static(b"e0e1"));
        assert_eq!(Fanout::Same.merge(vec![sha.clone(), sha.clone()]), sha);
        assert_eq!(
            Fanout::Sum.merge(vec![LocalReply::Integer(2), LocalReply::Integer(3)]),
            LocalReply::Integer(5)
        );
        let e = LocalReply::err("x");
        assert_eq!(
            Fanout::AllOk.merge(vec![LocalReply::Status("OK"), e.clone()]),
            e
        );
        assert_eq!(
            Fanout::Sum.merge(vec![LocalReply::Null]),
            LocalReply::err("lockgate: unexpected reply from a primary")
        );
    }
}
