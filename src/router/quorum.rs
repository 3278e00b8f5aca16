//! Routes that differ when lock keys live on the lock quorum: a command
//! cannot act on a lock key on the primary, where the lock does not live,
//! so lock keys go to the quorum, per-key commands are split between the
//! two stores, and what needs both stores at once is refused.

use super::{CommandArgs, Queued, Route, SessionView, TxView};
use crate::command::{CommandKind, MultiKeys, ReadKeys};
use crate::lock::guard::Guarded;
use crate::lock::split::{self, Split};
use crate::lock::LockService;

/// Commands whose first argument is not a key (a channel, a subcommand, a
/// count…): a lock-key-looking first argument means nothing for them.
const NOT_KEY_FIRST: &[&[u8]] = &[
    b"PUBLISH",
    b"SPUBLISH",
    b"CLIENT",
    b"CONFIG",
    b"SCRIPT",
    b"FUNCTION",
    b"OBJECT",
    b"MEMORY",
    b"DEBUG",
    b"ACL",
    b"COMMAND",
    b"CLUSTER",
    b"XREAD",
    b"XREADGROUP",
    b"XGROUP",
    b"XINFO",
    b"KEYS",
    b"SCAN",
    b"ECHO",
    b"PING",
    b"AUTH",
    b"INFO",
    b"FCALL",
    b"FCALL_RO",
    b"PUBSUB",
    b"SLOWLOG",
    b"LATENCY",
    b"WAIT",
    b"BITOP",
    b"LMPOP",
    b"ZMPOP",
    b"BLMPOP",
    b"BZMPOP",
    b"SINTERCARD",
    b"ZINTERCARD",
    b"ZUNION",
    b"ZINTER",
    b"ZDIFF",
    b"MIGRATE",
];

/// Where a command goes when lock keys live on the quorum, if that differs
/// from the single-Redis route.
pub(super) fn quorum_route(
    kind: CommandKind,
    args: CommandArgs<'_>,
    view: &SessionView,
    locks: &LockService,
) -> Option<Route> {
    let keys: Vec<&[u8]> = match kind {
        CommandKind::Read(ReadKeys::All)
        | CommandKind::MultiKey(MultiKeys::All)
        | CommandKind::Del
        | CommandKind::Unlink => (1..args.len()).map(|i| args.get(i)).collect(),
        CommandKind::MultiKey(MultiKeys::Pairs) => {
            (1..args.len()).step_by(2).map(|i| args.get(i)).collect()
        }
        CommandKind::Eval => {
            let n = std::str::from_utf8(args.get(2))
                .ok()?
                .parse::<usize>()
                .ok()?;
            (3..(3 + n).min(args.len())).map(|i| args.get(i)).collect()
        }
        CommandKind::Relocate(n) => (1..=usize::from(n).min(args.len().saturating_sub(1)))
            .map(|i| args.get(i))
            .collect(),
        CommandKind::Read(ReadKeys::First) => vec![args.get(1)],
        CommandKind::SetNx
        | CommandKind::Set
        | CommandKind::GetSet
        | CommandKind::GetDel
        | CommandKind::GetEx
        | CommandKind::Expire(_) => vec![args.get(1)],
        CommandKind::Other => match split::cross_keys(&args.all()) {
            Some(keys) => keys,
            None if args.len() > 1 && locks.is_lock_key(args.get(1)) => {
                let name = args.get(0).to_ascii_uppercase();
                if NOT_KEY_FIRST.contains(&name.as_slice()) {
                    return None;
                }
                vec![args.get(1)]
            }
            None => return None,
        },
        _ => return None,
    };
    let locked: Vec<&[u8]> = keys
        .iter()
        .copied()
        .filter(|k| locks.is_lock_key(k))
        .collect();
    if locked.is_empty() {
        return None;
    }
    let name = String::from_utf8_lossy(args.get(0)).to_uppercase();
    let mixed = locked.len() < keys.len();
    if let Some(split) = Split::new(args.get(0), &keys, |k| locks.is_lock_key(k)) {
        // Inside MULTI a split would run half the transaction elsewhere:
        // refused below (the transaction then aborts whole). DEL/UNLINK and
        // EXISTS of lock keys only are the quorum release and read.
        let split_ok = match kind {
            CommandKind::MultiKey(_) => !mixed || !view.in_multi,
            _ => mixed && !view.in_multi,
        };
        if split_ok {
            return Some(Route::QuorumSplit(split));
        }
    }
    if mixed {
        let shown: Vec<String> = locked
            .iter()
            .map(|k| String::from_utf8_lossy(k).into_owned())
            .collect();
        return Some(Route::Refuse(format!(
            "lockgate: {name} mixes lock keys ({}) with other keys; they live on different stores",
            shown.join(", ")
        )));
    }
    // Reads are queued by lockgate and answered from the quorum at EXEC;
    // a script cannot be (it may act on its keys as it reads them).
    if view.in_multi && kind == CommandKind::Eval {
        return Some(Route::Refuse(format!(
            "lockgate: {name} on lock keys inside MULTI is not supported with the lock quorum"
        )));
    }
    match kind {
        CommandKind::Read(_) => Some(Route::QuorumRead),
        // A lock library's script lockgate carries out is a lock operation
        // on the quorum as on one Redis.
        CommandKind::Eval => {
            Some(super::library::lock_op(args, locks).map_or(Route::QuorumEval, Route::Lock))
        }
        // Any other command on a lock key would act on the primary, where
        // the lock does not live.
        CommandKind::MultiKey(_) | CommandKind::Relocate(_) | CommandKind::Other => {
            Some(Route::Refuse(format!(
                "lockgate: {name} is not supported on lock keys with the lock quorum"
            )))
        }
        _ => None,
    }
}

/// Who queues a transaction's lock commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Queue {
    /// Redis (in its own transaction, as scripts); lockgate only follows
    /// what went there.
    Off,
    /// lockgate: lock keys live on the quorum.
    Quorum,
    /// lockgate: the primary refuses scripts (database 0).
    Scriptless,
}

/// What a transaction means with lock keys on the quorum: Redis cannot
/// queue lock commands (they do not go to the primary), so inside `MULTI`
/// lockgate queues them itself ([`Route::Queue`]) and runs them at `EXEC`
/// ([`Route::ExecQueued`]); a command refused while queuing aborts the
/// `EXEC` ([`Route::ExecAbort`]). The same on one Redis that refuses
/// scripts, where lockgate's lock transactions cannot run inside the
/// client's (`queue_locks`; otherwise lock commands go to Redis's queue
/// and only what went there is counted). `route` is the command's route
/// in `view`; `next` (the view after it) learns what was queued where.
pub(super) fn transaction(
    kind: CommandKind,
    route: Route,
    args: CommandArgs<'_>,
    view: &SessionView,
    next: &mut SessionView,
    queue: Queue,
) -> Route {
    let queue_locks = queue != Queue::Off;
    let tx = view.tx;
    let queued = match (kind, &route) {
        (CommandKind::Multi, _) if !view.in_multi => {
            next.tx = TxView::default();
            return route;
        }
        (CommandKind::Discard, _) => {
            next.tx = TxView::default();
            return route;
        }
        (CommandKind::Exec, _) if view.in_multi && tx.failed => {
            next.tx = TxView::default();
            return Route::ExecAbort;
        }
        (CommandKind::Exec, _) if view.in_multi && tx.queued => {
            next.tx = TxView::default();
            return Route::ExecQueued { mixed: tx.primary };
        }
        // Guarded writes were queued: checked with the whole transaction.
        (CommandKind::Exec, _) if view.in_multi && tx.guarded && !tx.unchecked => {
            next.tx = TxView::default();
            return Route::Guarded(Guarded::Exec);
        }
        _ if !view.in_multi => return route,
        (_, Route::Lock(op)) if queue_locks => Queued::Op(op.clone()),
        (_, Route::QuorumRead) => Queued::Read(crate::protocol::encode::command(&args.all())),
        (_, Route::QuorumSplit(split)) => Queued::Split(split.clone()),
        // A refused PERSIST joins the side the transaction is on: the
        // quorum's, once lockgate queues commands, else Redis's (the error
        // in its slot of Redis's own EXEC array, as a script, which a
        // server that refuses scripts would refuse: lockgate's there).
        (_, Route::RefusePersist) if tx.queued || queue == Queue::Scriptless => {
            Queued::RefusedPersist(bytes::Bytes::copy_from_slice(args.get(1)))
        }
        (_, Route::Guarded(Guarded::InTx(_))) => {
            next.tx.primary = true;
            next.tx.guarded = true;
            return route;
        }
        (_, Route::Guarded(Guarded::Unchecked(_))) => {
            next.tx.primary = true;
            next.tx.unchecked = true;
            return route;
        }
        (
            _,
            Route::RefusePersist | Route::Forward(_) | Route::ForwardForget(..) | Route::Lock(_),
        ) => {
            next.tx.primary = true;
            return route;
        }
        // A guarded write that cannot be checked with the transaction, in
        // refuse mode: refused while queuing, so EXEC runs nothing (never
        // a transaction applied in part).
        (_, Route::Guarded(_)) => {
            next.tx.failed = true;
            return route;
        }
        // Answered as refused; EXEC then aborts (on one Redis too, as
        // Redis aborts a transaction with a command it refused queuing:
        // `MSETNX` on lock keys inside MULTI).
        (_, Route::Refuse(_)) => {
            next.tx.failed = true;
            return route;
        }
        _ => return route,
    };
    next.tx.queued = true;
    Route::Queue(queued)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::classify;
    use crate::config::Config;

    fn routed(line: &str, in_multi: bool) -> Option<Route> {
        let locks = LockService::new(&Config::default());
        let (p, buf) = crate::router::tests::parsed(line);
        let args = CommandArgs::new(&p, buf.as_bytes());
        let kind = classify(args.get(0), args.get(1), args.get(2));
        let view = SessionView {
            in_multi,
            ..SessionView::default()
        };
        quorum_route(kind, args, &view, &locks)
    }

    fn refused(route: Option<Route>) -> bool {
        matches!(route, Some(Route::Refuse(_)))
    }

    #[test]
    fn per_key_commands_split_outside_transactions() {
        for line in [
            "DEL lock:a user:1",
            "unlink user:1 lock:a",
            "EXISTS user:1 lock:a lock:a",
            "TOUCH lock:a user:1",
            "MGET user:1 lock:a",
            "MGET lock:a lock:b",
        ] {
            assert!(
                matches!(routed(line, false), Some(Route::QuorumSplit(_))),
                "{line}"
            );
        }
        // Lock keys only: the quorum release and read as before.
        assert_eq!(routed("DEL lock:a lock:b", false), None);
        assert_eq!(routed("EXISTS lock:a", false), Some(Route::QuorumRead));
        // Inside MULTI a mix would run half the transaction elsewhere.
        assert!(refused(routed("DEL lock:a user:1", true)));
        assert!(matches!(
            routed("MGET lock:a lock:b", true),
            Some(Route::QuorumSplit(_))
        ));
        assert_eq!(routed("GET lock:a", true), Some(Route::QuorumRead));
        assert!(refused(routed("EVAL x 1 lock:a", true)));
    }

    #[test]
    fn cross_store_atomic_commands_are_refused() {
        for line in [
            "MSET lock:a 1 user:1 2",
            "RENAME user:1 lock:a",
            "SMOVE user:s lock:a m",
            "SUNIONSTORE lock:a user:s",
            "HSET lock:a f v",
        ] {
            assert!(refused(routed(line, false)), "{line}");
        }
        assert_eq!(routed("HSET user:1 f lock:a", false), None);
        assert_eq!(routed("PUBLISH lock:a hi", false), None);
    }
}
