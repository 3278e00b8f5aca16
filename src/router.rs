//! The router: a pure function from a parsed command and the session's view
//! of its connection to a [`Route`]. It decides, it does nothing; the session
//! carries the decision out. Commands on lock keys become lock operations
//! for [`crate::lock`]; everything else is forwarded untouched. A lock
//! library's release or acquisition script is a lock operation too
//! ([`library`]); with the lock quorum some routes differ (`quorum`).

use crate::command::{CommandKind, MultiKeys, ReplyMode, SubKind};
use crate::config::AdminConfig;
use crate::lock::guard::Guarded;
use crate::lock::ops::{self, LockOp};
use crate::lock::split::Split;
use crate::lock::Forget;
use crate::lock::LockService;
use crate::protocol::request::RequestParser;

pub(crate) mod library;
mod pairs;
mod quorum;
use quorum::quorum_route;

/// How many replies Redis will send for a forwarded command, as far as the
/// session must know to keep lockgate's own replies in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Exactly one reply.
    One,
    /// No reply (`*0`, a blank inline line).
    Nothing,
    /// One reply, whose type tells whether the connection now speaks RESP3.
    Hello,
    /// From this command on, replies cannot be counted (MONITOR,
    /// replication): bytes are copied as they come until a `RESET`
    /// resynchronises the stream.
    EnterRaw,
    /// A subscription command with this many arguments after its name: one
    /// confirmation per argument (or per channel of its set when there are
    /// none), or one error; published messages in between are not replies.
    Subscription(SubKind, u32),
    /// One reply that Redis may hold back (a blocking command): what a
    /// client's half-close does not wait for.
    Blocking,
    /// `RESET`: one reply; afterwards the connection speaks RESP2 again, and
    /// if replies were not being counted, its `+RESET` reply marks where
    /// counting starts again.
    Reset,
}

/// What to do with one command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// Send the client's own bytes to the primary.
    Forward(Expect),
    /// `SETNX`/`SET … NX` on a key outside `locks.keys`: forwarded
    /// untouched, and counted by key prefix.
    ForwardUnmatched,
    /// A command that changes lock keys or Redis's script cache behind the
    /// lock room's back (`FLUSHDB`, `FLUSHALL`, `SWAPDB`, `RENAME`,
    /// `RENAMENX`, `COPY`, `MOVE` of or onto lock keys, `SCRIPT FLUSH`, the
    /// `EXEC` of a transaction with one; see [`SessionView::forget_at_exec`]):
    /// the client's bytes go to the primary as for `Forward`, and what the
    /// lock room knew is dropped as the [`Forget`] says once Redis
    /// acknowledges it. Where no reply can be matched to it (`Expect::Nothing`
    /// while replies are not counted, a reply silenced by `CLIENT REPLY`),
    /// it is dropped when sent; inside `MULTI`, at the `EXEC`.
    ForwardForget(Forget, Expect),
    /// A lock operation, carried out by [`crate::lock::LockService`].
    Lock(LockOp),
    /// `PERSIST` on a lock key: refused (a lock without a lease is the
    /// incident lockgate exists to prevent).
    RefusePersist,
    /// A `LOCKGATE …` admin command, answered by lockgate.
    Admin,
    /// A read of lock keys, answered by the quorum's majority.
    QuorumRead,
    /// A client script on lock keys only, run on every master.
    QuorumEval,
    /// A per-key command over lock keys (and maybe other keys): the lock
    /// keys on the quorum, the others on the primary, answers merged.
    QuorumSplit(Split),
    /// A write to guarded data keys (`[[locks.guards]]`): checked in Redis
    /// with the write, forwarded unchecked (`report` mode), or refused
    /// (see [`crate::lock::guard`]).
    Guarded(Guarded),
    /// Refused with this message (`-ERR lockgate: …`): e.g. a command that
    /// mixes lock keys with other keys while they live on different stores.
    Refuse(String),
    /// A `LOCKGATE` command answered with this error, whole (`NOPERM …`
    /// before `LOCKGATE AUTH`, `WRONGPASS …` for a wrong password).
    Deny(&'static str),
    /// Inside `MULTI` with lock keys on the quorum: a command lockgate
    /// queues itself (answering `+QUEUED`) and runs at `EXEC`, as Redis
    /// cannot queue what does not go to the primary.
    Queue(Queued),
    /// `MSETNX` naming lock keys: every key or none, each lock key with
    /// a lease and an owner record (see [`pairs`]); its key/value pairs.
    AcquireAll(Vec<(bytes::Bytes, bytes::Bytes)>),
    /// `EXEC` of a transaction with a command refused while queuing: Redis's
    /// side is discarded and nothing runs (`EXECABORT`).
    ExecAbort,
    /// `EXEC` of a transaction with commands lockgate queued: Redis's side
    /// is discarded and they run in order, unless `mixed` (the transaction
    /// also queued commands on the primary: refused whole, the two stores
    /// cannot commit together).
    ExecQueued {
        /// Commands were also queued on the primary.
        mixed: bool,
    },
}

/// One command of a transaction that lockgate runs on the quorum at `EXEC`
/// (see [`Route::Queue`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Queued {
    /// A lock operation.
    Op(LockOp),
    /// A read of lock keys (`GET`, `EXISTS`, `TTL`…), as sent.
    Read(bytes::Bytes),
    /// `MGET`/`TOUCH` of lock keys only.
    Split(Split),
    /// `PERSIST` of this lock key, refused: an error in its slot, as Redis
    /// gives a command failing inside `EXEC`.
    RefusedPersist(bytes::Bytes),
}

/// What the router knows of a transaction while lock keys live on the
/// quorum (kept in [`SessionView`], reset at `MULTI`, `EXEC`, `DISCARD`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TxView {
    /// lockgate queued commands of its own ([`Route::Queue`]).
    pub queued: bool,
    /// Commands went to Redis's queue on the primary.
    pub primary: bool,
    /// A command was refused while queuing: `EXEC` runs nothing (Redis's
    /// rule for a command rejected at queue time).
    pub failed: bool,
    /// A guarded write was queued: `EXEC` runs the transaction as one
    /// checked script ([`Guarded::Exec`]).
    pub guarded: bool,
    /// A write lockgate cannot check was passed into the queue (report
    /// mode): `EXEC` goes as it is.
    pub unchecked: bool,
}

/// What the router knows about the connection (kept by the session).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SessionView {
    /// Replies are not being counted (see [`Expect::EnterRaw`]).
    pub raw: bool,
    /// Inside `MULTI`: Redis queues commands and answers `+QUEUED`.
    pub in_multi: bool,
    /// `QUIT` was sent: Redis answers it, closes, and answers nothing after.
    pub quit: bool,
    /// The database `SELECT`ed (as sent; `u64::MAX` if unreadable).
    pub db: u64,
    /// `LOCKGATE` commands allowed (no admin password, or `LOCKGATE AUTH`
    /// given on this connection).
    pub admin_ok: bool,
    /// `CLIENT REPLY` mode: Redis answers nothing while `Off`, nor the
    /// next command after `Skip`, and lockgate writes nothing in their place.
    pub replies: ReplyMode,
    /// The transaction as lockgate queues it, with lock keys on the quorum.
    pub tx: TxView,
    /// Inside `MULTI`, a command was queued whose route is
    /// [`Route::ForwardForget`]: it runs at `EXEC`, so the `EXEC` forgets
    /// ([`Forget::Everything`]) once Redis answers it.
    pub forget_at_exec: bool,
    /// `WATCH` was sent and not yet ended (`EXEC`, `DISCARD`, `UNWATCH`,
    /// `RESET`); followed only while guards are configured: a guarded
    /// transaction under `WATCH` cannot be run as a script.
    pub watching: bool,
    /// Inside `MULTI`: the commands queued so far, so the place in `EXEC`'s
    /// array of the next one (a lock grant inside the transaction is
    /// found there to be acknowledged by the replicas: `locks.replicas_ack`).
    pub tx_slots: u32,
}

impl SessionView {
    /// True when the reply to a command of `kind` is suppressed by
    /// `CLIENT REPLY OFF|SKIP`: nothing is written for it.
    pub fn silent(&self, kind: CommandKind) -> bool {
        match self.replies {
            ReplyMode::On => false,
            ReplyMode::Skip => true,
            ReplyMode::Off => kind != CommandKind::ClientReply(ReplyMode::On),
        }
    }
}

/// The refusal of a lock command on a connection whose replies cannot be
/// counted: passing it on would leave the lock unprotected.
pub const RAW_REFUSAL: &str = "lockgate: lock commands are refused on a connection in MONITOR or replication mode (RESET first): their replies cannot be matched there";

/// The arguments of the command being routed (name first).
#[derive(Debug, Clone, Copy)]
pub struct CommandArgs<'a> {
    parser: &'a RequestParser,
    buf: &'a [u8],
}

impl<'a> CommandArgs<'a> {
    /// The arguments of the request `parser` just parsed from `buf`.
    pub fn new(parser: &'a RequestParser, buf: &'a [u8]) -> CommandArgs<'a> {
        CommandArgs { parser, buf }
    }

    /// Number of arguments, name included.
    pub fn len(&self) -> usize {
        self.parser.argc()
    }

    /// True when there are no arguments.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Argument `i` (empty when out of range).
    pub fn get(&self, i: usize) -> &'a [u8] {
        self.parser.arg(self.buf, i)
    }

    /// All arguments.
    pub fn all(&self) -> Vec<&'a [u8]> {
        (0..self.len()).map(|i| self.get(i)).collect()
    }
}

/// The router's one answer for a command: what becomes of it, and what it
/// changes in the session.
#[derive(Debug)]
pub enum Fate<'a> {
    /// Forwarded as it is, one reply expected, the session's view left as
    /// it is: the common case, decided without building a route (see
    /// [`forwards_plainly`]).
    Plain,
    /// Anything else.
    Routed(Decision<'a>),
}

/// A command's route and what it changes in the session.
#[derive(Debug)]
pub struct Decision<'a> {
    /// What to do with the command.
    pub route: Route,
    /// The session's view once the command is carried out (its database,
    /// `LOCKGATE AUTH`, `MULTI`, reply mode, the transaction…); the
    /// command itself is carried out in the view before it.
    pub next: SessionView,
    /// A client script body the lock room is told of
    /// ([`LockService::script_seen`]): `EVAL`'s, or `SCRIPT LOAD`'s (then
    /// `true`).
    pub script: Option<(&'a [u8], bool)>,
}

/// Decides one non-empty command of kind `kind` in the session's `view`:
/// its route, by where `locks` keeps the lock keys; the admin gate, by
/// `admin`; the view after it. The one question a session asks the router
/// per command.
pub fn decide<'a>(
    kind: CommandKind,
    args: CommandArgs<'a>,
    view: &SessionView,
    locks: &LockService,
    admin: &AdminConfig,
) -> Fate<'a> {
    // Where the lock keys live, asked once per command.
    let quorum = locks.on_masters();
    if plainly(kind, args, view, locks, quorum) {
        return Fate::Plain;
    }
    let route = route_on(kind, args, view, locks, quorum);
    let mut next = view.after(kind, &route);
    let arg1 = args.get(1);
    match kind {
        CommandKind::Lockgate
            if arg1.eq_ignore_ascii_case(b"AUTH") && args.get(2) == admin.password.as_bytes() =>
        {
            next.admin_ok = true;
        }
        CommandKind::MultiKey(_) | CommandKind::Other if locks.guards_on() && !view.in_multi => {
            let name = args.get(0);
            if name.eq_ignore_ascii_case(b"WATCH") {
                next.watching = true;
            } else if name.eq_ignore_ascii_case(b"UNWATCH") {
                next.watching = false;
            }
        }
        CommandKind::Select => {
            next.db = std::str::from_utf8(arg1)
                .ok()
                .and_then(|d| d.parse().ok())
                .unwrap_or(u64::MAX);
        }
        _ => {}
    }
    let route = match route {
        Route::Admin => gate(arg1, &next, admin),
        // Not while replies are not counted: lockgate writes no reply of
        // its own there (the fuzzer found `EXEC` aborted on a MONITOR
        // connection, with a swallowed reply that would never come).
        // On one Redis that refuses scripts lock commands are queued by
        // lockgate too (in database 0: lockgate's transactions run there),
        // and every transaction is followed, so a refusal detected in the
        // middle of one still sees what went to Redis's queue before.
        route if !view.raw && (quorum || view.in_multi || kind == CommandKind::Multi) => {
            let queue = match quorum {
                true => quorum::Queue::Quorum,
                false if view.db == 0 && locks.scriptless() => quorum::Queue::Scriptless,
                false => quorum::Queue::Off,
            };
            // A read of lock keys only is queued with the lock commands
            // (it sees what they did, in order).
            let route = match route {
                Route::Forward(_)
                    if queue == quorum::Queue::Scriptless
                        && view.in_multi
                        && matches!(kind, CommandKind::Read(_))
                        && quorum::quorum_route(kind, args, view, locks)
                            == Some(Route::QuorumRead) =>
                {
                    Route::QuorumRead
                }
                route => route,
            };
            quorum::transaction(kind, route, args, view, &mut next, queue)
        }
        route => route,
    };
    let script = match kind {
        CommandKind::Eval if args.get(0).eq_ignore_ascii_case(b"EVAL") => Some((arg1, false)),
        CommandKind::Script if arg1.eq_ignore_ascii_case(b"LOAD") => Some((args.get(2), true)),
        _ => None,
    };
    Fate::Routed(Decision {
        route,
        next,
        script,
    })
}

/// The admin gate of a `LOCKGATE` command whose subcommand is `sub`, in
/// the view after it (`admin_ok` already set by a right `LOCKGATE AUTH`):
/// passed on to Redis when `admin.resp_commands` is off, denied before
/// `LOCKGATE AUTH` or for a wrong password, else answered by lockgate.
fn gate(sub: &[u8], next: &SessionView, admin: &AdminConfig) -> Route {
    let auth = sub.eq_ignore_ascii_case(b"AUTH");
    match next.admin_ok {
        _ if !admin.resp_commands => Route::Forward(Expect::One),
        false if !auth => Route::Deny("NOPERM lockgate: LOCKGATE AUTH <password> required first"),
        false => Route::Deny("WRONGPASS lockgate: invalid LOCKGATE password"),
        true => Route::Admin,
    }
}

/// The common case of [`route`], decided without building a [`Route`]:
/// true only when `route` would return `Route::Forward(Expect::One)` and
/// [`SessionView::after`] would leave `view` as it is, so the session can
/// forward the client's bytes and count one reply at once. Every command
/// passing through asks this first (callgrind: routing a plain `GET` by
/// [`route`] cost about 150 instructions more). False is no answer: the
/// command then goes to [`route`]. With the quorum, any command may touch
/// a lock key there, so it is always false.
#[inline]
pub fn forwards_plainly(
    kind: CommandKind,
    args: CommandArgs<'_>,
    view: &SessionView,
    locks: &LockService,
) -> bool {
    plainly(kind, args, view, locks, locks.on_masters())
}

/// [`forwards_plainly`] with lock keys on the quorum or not.
#[inline]
fn plainly(
    kind: CommandKind,
    args: CommandArgs<'_>,
    view: &SessionView,
    locks: &LockService,
    quorum: bool,
) -> bool {
    // Inside MULTI every command is routed: the transaction's view counts
    // what went to Redis's queue (see `quorum::transaction`).
    if quorum || view.raw || view.quit || view.in_multi || view.replies != ReplyMode::On {
        return false;
    }
    // A command on a key that may be guarded data takes the full look, as
    // does (UN)WATCH, which a guarded transaction must know of.
    if locks.guards_on()
        && (locks.may_guard((1..args.len()).map(|i| args.get(i))) || watch(args.get(0)))
    {
        return false;
    }
    match kind {
        CommandKind::MultiKey(MultiKeys::Pairs) => !pairs::names_lock_key(args, locks),
        CommandKind::Other | CommandKind::Read(_) | CommandKind::MultiKey(_) => true,
        // Options (`NX`, a lease) need the full look; a bare SET only its key.
        CommandKind::Set => args.len() == 3 && !locks.is_lock_key(args.get(1)),
        CommandKind::Relocate(n) => relocated(n, args, locks).next().is_none(),
        _ => false,
    }
}

/// Whether `name` is `WATCH` or `UNWATCH`.
fn watch(name: &[u8]) -> bool {
    name.eq_ignore_ascii_case(b"WATCH") || name.eq_ignore_ascii_case(b"UNWATCH")
}

/// Whether a command of `kind` may be a write to guarded data: not one
/// that ends or begins a transaction, an admin command, or a subscription.
fn guardable(kind: CommandKind) -> bool {
    !matches!(
        kind,
        CommandKind::Multi
            | CommandKind::Exec
            | CommandKind::Discard
            | CommandKind::Reset
            | CommandKind::Quit
            | CommandKind::Lockgate
            | CommandKind::Subscribe(_)
            | CommandKind::Monitor
            | CommandKind::Sync
            | CommandKind::Hello
    )
}

/// The lock keys among the first `n` arguments after the name of a
/// [`CommandKind::Relocate`] command (its keys).
fn relocated<'a>(
    n: u8,
    args: CommandArgs<'a>,
    locks: &'a LockService,
) -> impl Iterator<Item = &'a [u8]> + 'a {
    (1..=usize::from(n).min(args.len().saturating_sub(1)))
        .map(move |i| args.get(i))
        .filter(|k| locks.is_lock_key(k))
}

/// Decides the route of one non-empty command of kind `kind`, by where
/// `locks` keeps the lock keys (the primary, or the lock masters).
pub fn route(
    kind: CommandKind,
    args: CommandArgs<'_>,
    view: &SessionView,
    locks: &LockService,
) -> Route {
    route_on(kind, args, view, locks, locks.on_masters())
}

/// [`route`] with lock keys on the quorum or not.
fn route_on(
    kind: CommandKind,
    args: CommandArgs<'_>,
    view: &SessionView,
    locks: &LockService,
    quorum: bool,
) -> Route {
    if kind == CommandKind::Reset {
        return Route::Forward(Expect::Reset);
    }
    if view.quit {
        return Route::Forward(Expect::Nothing);
    }
    if view.raw {
        // Replies are not counted: what Redis answers passes as it comes,
        // and a lock command is refused rather than passed on unprotected.
        let counted = SessionView {
            raw: false,
            ..*view
        };
        return match route_on(kind, args, &counted, locks, quorum) {
            Route::Forward(_) | Route::ForwardUnmatched => Route::Forward(Expect::Nothing),
            Route::ForwardForget(forget, _) => Route::ForwardForget(forget, Expect::Nothing),
            Route::Admin => Route::Admin,
            // Nothing to check in report mode; a check's reply could not
            // be matched.
            Route::Guarded(Guarded::Unchecked(_)) => Route::Forward(Expect::Nothing),
            _ => Route::Refuse(RAW_REFUSAL.to_string()),
        };
    }
    let key = args.get(1);
    let lock_key = || args.len() > 1 && locks.is_lock_key(key);
    let lock_op = |op: Option<LockOp>| op.map_or(Route::Forward(Expect::One), Route::Lock);
    if quorum {
        if let Some(route) = quorum_route(kind, args, view, locks) {
            return route;
        }
    } else if kind == CommandKind::MultiKey(MultiKeys::Pairs) {
        if let Some(route) = pairs::route(args, view, locks) {
            return route;
        }
    }
    // The cheap look first: the arguments are gathered only for a command
    // that may touch guarded data (with the quorum every command comes here).
    if guardable(kind) && locks.may_guard((1..args.len()).map(|i| args.get(i))) {
        if let Some(guarded) = locks.guard_route(&args.all(), view.in_multi) {
            return Route::Guarded(guarded);
        }
    }
    match kind {
        CommandKind::Subscribe(sub) if !view.in_multi => Route::Forward(Expect::Subscription(
            sub,
            u32::try_from(args.len().saturating_sub(1)).unwrap_or(u32::MAX),
        )),
        CommandKind::ClientReply(ReplyMode::Off | ReplyMode::Skip) if !view.in_multi => {
            Route::Forward(Expect::Nothing)
        }
        CommandKind::Monitor | CommandKind::Sync if !view.in_multi => {
            Route::Forward(Expect::EnterRaw)
        }
        CommandKind::Hello if !view.in_multi => Route::Forward(Expect::Hello),
        CommandKind::Blocking if !view.in_multi => Route::Forward(Expect::Blocking),
        CommandKind::Lockgate if !view.in_multi => Route::Admin,
        CommandKind::Exec if view.in_multi && view.forget_at_exec => {
            Route::ForwardForget(Forget::Everything, Expect::One)
        }
        // With the quorum, lock keys live on the masters, which a client's
        // command never reaches: a flush empties the primary only, and
        // what lockgate knows of the masters' keys stays true.
        CommandKind::Flush if !quorum => Route::ForwardForget(Forget::Database, Expect::One),
        // With the quorum, one on a lock key was refused above.
        CommandKind::Relocate(n) if !quorum => {
            let keys: Vec<bytes::Bytes> = relocated(n, args, locks)
                .map(bytes::Bytes::copy_from_slice)
                .collect();
            match keys.is_empty() {
                true => Route::Forward(Expect::One),
                false => Route::ForwardForget(Forget::Keys(keys), Expect::One),
            }
        }
        CommandKind::Script if crate::lock::evalsha::is_flush(args.get(0), key) => {
            Route::ForwardForget(Forget::Scripts, Expect::One)
        }
        // A client script that lists keys may change lock keys it does not
        // name (python-redis-lock's `reset_all` deletes every `lock:*`):
        // the whole view is dropped once it ran. With the quorum, lock keys
        // live on the masters, which a client's script never reaches.
        CommandKind::Eval if !quorum => {
            // A lock library's release or acquisition script, carried out
            // as a release or an acquisition.
            if let Some(op) = library::lock_op(args, locks) {
                return Route::Lock(op);
            }
            match locks.script_lists_keys(args.get(0), key) {
                true => Route::ForwardForget(Forget::Database, Expect::One),
                false => Route::Forward(Expect::One),
            }
        }
        CommandKind::SetNx if args.len() == 3 => {
            if lock_key() {
                lock_op(ops::parse_setnx(&args.all()))
            } else {
                Route::ForwardUnmatched
            }
        }
        CommandKind::Set if args.len() >= 3 => {
            if lock_key() {
                lock_op(ops::parse_set(&args.all()))
            } else if (3..args.len()).any(|i| args.get(i).eq_ignore_ascii_case(b"NX")) {
                Route::ForwardUnmatched
            } else {
                Route::Forward(Expect::One)
            }
        }
        CommandKind::GetSet | CommandKind::GetDel | CommandKind::GetEx if lock_key() => {
            let name = match kind {
                CommandKind::GetSet => "GETSET",
                CommandKind::GetDel => "GETDEL",
                _ => "GETEX",
            };
            lock_op(ops::keyed(&args.all(), name, false))
        }
        CommandKind::Expire(name) if lock_key() => lock_op(ops::keyed(&args.all(), name, true)),
        CommandKind::Persist if args.len() == 2 && lock_key() => Route::RefusePersist,
        CommandKind::Del | CommandKind::Unlink if args.len() > 1 => {
            let keys = &args.all()[1..];
            if !keys.iter().any(|k| locks.is_lock_key(k)) {
                return Route::Forward(Expect::One);
            }
            let (lock_keys, plain): (Vec<&[u8]>, Vec<&[u8]>) =
                keys.iter().partition(|k| locks.is_lock_key(k));
            Route::Lock(LockOp::Release {
                lock_keys: lock_keys
                    .iter()
                    .map(|k| bytes::Bytes::copy_from_slice(k))
                    .collect(),
                plain: plain
                    .iter()
                    .map(|k| bytes::Bytes::copy_from_slice(k))
                    .collect(),
                unlink: kind == CommandKind::Unlink,
                by_value: None,
            })
        }
        _ => Route::Forward(Expect::One),
    }
}

impl SessionView {
    /// The view after a command of `kind` was routed to `route`.
    pub fn after(self, kind: CommandKind, route: &Route) -> SessionView {
        let mut next = self;
        match route {
            Route::Forward(Expect::EnterRaw) => next.raw = true,
            Route::Forward(Expect::Reset) => next.raw = false,
            _ => {}
        }
        if !self.in_multi {
            next.replies = match kind {
                CommandKind::ClientReply(mode) => mode,
                CommandKind::Reset => ReplyMode::On,
                // A skip lasts for one command.
                _ if self.replies == ReplyMode::Skip => ReplyMode::On,
                _ => self.replies,
            };
        }
        match kind {
            CommandKind::Multi => next.in_multi = true,
            CommandKind::Quit if !self.in_multi => next.quit = true,
            CommandKind::Exec | CommandKind::Discard => {
                next.in_multi = false;
                next.forget_at_exec = false;
                next.watching = false;
            }
            CommandKind::Reset => {
                next.in_multi = false;
                next.forget_at_exec = false;
                next.watching = false;
                next.db = 0;
            }
            // Queued: it runs at EXEC, which forgets then.
            _ if self.in_multi && matches!(route, Route::ForwardForget(..)) => {
                next.forget_at_exec = true;
            }
            _ => {}
        }
        // Every command inside MULTI takes one place in EXEC's array, a
        // refused one too (its error is queued in its place, see the
        // session's `refuse`); a nested MULTI takes none.
        next.tx_slots = match kind {
            _ if !self.in_multi => 0,
            CommandKind::Multi => self.tx_slots,
            CommandKind::Exec | CommandKind::Discard | CommandKind::Reset => 0,
            _ => self.tx_slots.saturating_add(1),
        };
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::classify;
    use crate::config::Config;
    use crate::protocol::request::RequestLimits;

    /// `line` parsed as one inline command: the parser and the bytes it
    /// read, for [`CommandArgs::new`].
    pub(super) fn parsed(line: &str) -> (RequestParser, String) {
        let mut p = RequestParser::new(RequestLimits {
            max_bulk_bytes: 1 << 20,
            max_multibulk_len: 64,
            max_inline_bytes: 1024,
            max_request_bytes: 1 << 20,
        });
        let buf = format!("{line}\r\n");
        p.parse(buf.as_bytes()).unwrap().unwrap();
        (p, buf)
    }

    fn routed(line: &str, view: &SessionView) -> Route {
        let locks = LockService::new(&Config::default());
        let (p, buf) = parsed(line);
        let args = CommandArgs::new(&p, buf.as_bytes());
        let kind = classify(args.get(0), args.get(1), args.get(2));
        route(kind, args, view, &locks)
    }

    /// A lock room whose lock keys live on three lock masters (offline).
    pub(super) fn on_masters() -> LockService {
        let mut config = Config::default();
        config.locks.quorum.masters = ["a:1", "b:1", "c:1"].map(String::from).to_vec();
        LockService::new(&config)
    }

    /// The session's one question, command after command: each line's
    /// route (shown short) as the view the previous decision handed back
    /// makes it, on one Redis and on the quorum, with an admin password.
    #[test]
    fn decide_carries_the_view_from_command_to_command() {
        let admin = AdminConfig {
            password: "pw".to_string(),
            ..AdminConfig::default()
        };
        let run = |locks: &LockService, lines: &[(&str, &str)]| {
            let mut view = SessionView::default();
            for (line, want) in lines {
                let (p, buf) = parsed(line);
                let args = CommandArgs::new(&p, buf.as_bytes());
                let kind = classify(args.get(0), args.get(1), args.get(2));
                let got = match decide(kind, args, &view, locks, &admin) {
                    Fate::Plain => "plain".to_string(),
                    Fate::Routed(d) => {
                        view = d.next;
                        match d.route {
                            Route::Forward(e) => format!("forward {e:?}"),
                            Route::Lock(_) => "lock".to_string(),
                            Route::Deny(m) => m.split(' ').next().unwrap_or("").to_string(),
                            Route::Queue(_) => "queue".to_string(),
                            Route::ExecQueued { mixed } => format!("exec queued, mixed {mixed}"),
                            r => format!("{r:?}"),
                        }
                    }
                };
                assert_eq!(got, *want, "{line}");
            }
            view
        };
        let one = LockService::new(&Config::default());
        let view = run(
            &one,
            &[
                ("GET a", "plain"),
                ("LOCKGATE STATS", "NOPERM"),
                ("LOCKGATE AUTH nope", "WRONGPASS"),
                ("LOCKGATE AUTH pw", "Admin"),
                ("LOCKGATE STATS", "Admin"),
                ("SELECT 2", "forward One"),
                ("MULTI", "forward One"),
                ("SETNX lock:a 1", "lock"),
                ("EXEC", "forward One"),
                ("GET a", "plain"),
            ],
        );
        assert!(view.admin_ok && !view.in_multi);
        assert_eq!(view.db, 2);
        let masters = on_masters();
        let view = run(
            &masters,
            &[
                ("MULTI", "forward One"),
                ("SETNX lock:a 1", "queue"),
                ("GET lock:a", "queue"),
                ("PERSIST lock:a", "queue"),
                ("SET user:1 x", "forward One"),
                ("EXEC", "exec queued, mixed true"),
                ("MULTI", "forward One"),
                ("HSET lock:a f v", "Refuse(\"lockgate: HSET is not supported on lock keys with the lock quorum\")"),
                ("EXEC", "ExecAbort"),
                ("MONITOR", "forward EnterRaw"),
                ("MULTI", "forward Nothing"),
                ("SETNX lock:a 1", "Refuse(\"lockgate: lock commands are refused on a connection in MONITOR or replication mode (RESET first): their replies cannot be matched there\")"),
                ("EXEC", "forward Nothing"),
            ],
        );
        assert!(view.raw && !view.tx.queued);
    }

    #[test]
    fn subscriptions_are_counted_and_keep_lock_handling() {
        let v = SessionView::default();
        let r = routed("SUBSCRIBE a b", &v);
        assert_eq!(
            r,
            Route::Forward(Expect::Subscription(SubKind::Subscribe, 2))
        );
        let v = v.after(CommandKind::Subscribe(SubKind::Subscribe), &r);
        assert!(!v.raw);
        assert!(matches!(
            routed("SETNX lock:a 1", &v),
            Route::Lock(LockOp::Acquire { .. })
        ));
    }

    #[test]
    fn monitor_goes_raw_and_refuses_lock_commands_until_reset() {
        let v = SessionView::default();
        let r = routed("MONITOR", &v);
        assert_eq!(r, Route::Forward(Expect::EnterRaw));
        let v = v.after(CommandKind::Monitor, &r);
        assert_eq!(
            routed("SETNX lock:a 1", &v),
            Route::Refuse(RAW_REFUSAL.to_string())
        );
        assert_eq!(routed("GET user:1", &v), Route::Forward(Expect::Nothing));
        let r = routed("RESET", &v);
        assert_eq!(r, Route::Forward(Expect::Reset));
        assert_eq!(v.after(CommandKind::Reset, &r), SessionView::default());
    }

    #[test]
    fn client_reply_off_skip_on() {
        let on = SessionView::default();
        let kind = |mode| CommandKind::ClientReply(mode);
        let off = on.after(kind(ReplyMode::Off), &Route::Forward(Expect::Nothing));
        assert!(off.silent(CommandKind::Other));
        assert!(!off.silent(kind(ReplyMode::On)));
        let skip = on.after(kind(ReplyMode::Skip), &Route::Forward(Expect::Nothing));
        assert!(skip.silent(CommandKind::Other));
        let after = skip.after(CommandKind::Other, &Route::Forward(Expect::One));
        assert_eq!(after.replies, ReplyMode::On);
        let back = off.after(kind(ReplyMode::On), &Route::Forward(Expect::One));
        assert!(!back.silent(CommandKind::Other));
    }

    #[test]
    fn lock_keys_only() {
        let v = SessionView::default();
        assert!(matches!(
            routed("SETNX lock:a 1", &v),
            Route::Lock(LockOp::Acquire { .. })
        ));
        assert_eq!(routed("SETNX user:1:visits 0", &v), Route::ForwardUnmatched);
        assert_eq!(routed("SET user:1 x NX", &v), Route::ForwardUnmatched);
        assert_eq!(routed("SET user:1 x", &v), Route::Forward(Expect::One));
        assert_eq!(routed("PERSIST lock:a", &v), Route::RefusePersist);
        assert_eq!(routed("PERSIST user:1", &v), Route::Forward(Expect::One));
        assert_eq!(routed("DEL a b", &v), Route::Forward(Expect::One));
        match routed("DEL a lock:b", &v) {
            Route::Lock(LockOp::Release {
                lock_keys,
                plain,
                unlink: false,
                by_value: None,
            }) => {
                assert_eq!((lock_keys.len(), plain.len()), (1, 1))
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            routed("PEXPIRE lock:a 10", &v),
            Route::Lock(LockOp::Extend {
                command: "PEXPIRE",
                ..
            })
        ));
        assert_eq!(routed("LOCKGATE UNMATCHED", &v), Route::Admin);
    }

    /// `forwards_plainly` is a shortcut of `route`, never a different
    /// answer: over every listed command name, with lock and plain keys,
    /// options and argument counts, in every session state, a yes from it
    /// is `route`'s `Forward(One)` with the view left as it is.
    #[test]
    fn forwarding_plainly_is_what_route_decides() {
        // And a store with a guard (its command table read): a command
        // on guarded data, or (UN)WATCH, is never forwarded plainly.
        let guarded = {
            let mut c = Config::default();
            c.locks.guards = vec![crate::config::GuardConfig {
                lock: "lock:{id}".to_string(),
                data: vec!["order:{id}".to_string()],
                mode: crate::config::GuardMode::Refuse,
                unlocked_writers: crate::config::UnlockedWriters::Allow,
            }];
            let l = LockService::new(&c);
            l.guard_table.set(crate::cluster::route::tests::table());
            l
        };
        let stores = [LockService::new(&Config::default()), on_masters(), guarded];
        let names = "GET get SET sEt SETNX GETSET GETDEL GETEX DEL UNLINK EXPIRE PEXPIRE \
            PERSIST EXISTS MGET MSET TOUCH EVAL EVALSHA SCRIPT CLIENT SELECT LOCKGATE MULTI EXEC \
            DISCARD QUIT RESET HELLO MONITOR SUBSCRIBE BLPOP HSET INCR PING FLUSHDB FLUSHALL \
            SWAPDB MOVE RENAME renamenx COPY WATCH UNWATCH";
        let words = [
            "lock:a", "user:1", "NX", "PX", "10", "REPLY", "OFF", "FLUSH", "order:1",
        ];
        let mut views = Vec::new();
        for bits in 0..64u8 {
            for replies in [ReplyMode::On, ReplyMode::Off, ReplyMode::Skip] {
                views.push(SessionView {
                    raw: bits & 1 != 0,
                    in_multi: bits & 2 != 0,
                    quit: bits & 4 != 0,
                    admin_ok: bits & 8 != 0,
                    forget_at_exec: bits & 16 != 0,
                    db: u64::from(bits >> 5),
                    replies,
                    ..SessionView::default()
                });
            }
        }
        let mut yes = 0;
        for name in names.split_whitespace() {
            for argc in 0..4 {
                for first in 0..words.len() {
                    let mut line = name.to_string();
                    for i in 0..argc {
                        line.push(' ');
                        line.push_str(words[(first + i) % words.len()]);
                    }
                    let (p, buf) = parsed(&line);
                    let args = CommandArgs::new(&p, buf.as_bytes());
                    let kind = classify(args.get(0), args.get(1), args.get(2));
                    for view in &views {
                        for locks in &stores {
                            if !forwards_plainly(kind, args, view, locks) {
                                continue;
                            }
                            yes += 1;
                            assert!(!locks.on_masters(), "{line}");
                            let r = route(kind, args, view, locks);
                            assert_eq!(r, Route::Forward(Expect::One), "{line} {view:?}");
                            assert_eq!(view.after(kind, &r), *view, "{line} {view:?}");
                        }
                    }
                }
            }
        }
        // The shortcut is taken (GET, HSET, bare SET on plain keys…).
        assert!(yes > 1000, "{yes}");
    }

    /// Commands that change lock keys or the script cache behind the lock
    /// room's back are forwarded with what to forget; the same commands on
    /// other keys, or with the quorum (whose masters they never reach), are
    /// plain forwards.
    #[test]
    fn what_changes_lock_keys_is_forgotten() {
        let v = SessionView::default();
        let keys = |ks: &[&'static str]| {
            Forget::Keys(
                ks.iter()
                    .map(|k| bytes::Bytes::from_static(k.as_bytes()))
                    .collect(),
            )
        };
        let forget = |f| Route::ForwardForget(f, Expect::One);
        for line in ["FLUSHDB", "flushall ASYNC", "FLUSHALL SYNC", "SWAPDB 0 1"] {
            assert_eq!(routed(line, &v), forget(Forget::Database), "{line}");
        }
        assert_eq!(
            routed("RENAME lock:a user:1", &v),
            forget(keys(&["lock:a"]))
        );
        assert_eq!(
            routed("RENAMENX user:1 lock:b", &v),
            forget(keys(&["lock:b"]))
        );
        assert_eq!(
            routed("COPY lock:a lock:b DB 1 REPLACE", &v),
            forget(keys(&["lock:a", "lock:b"]))
        );
        assert_eq!(routed("MOVE lock:a 1", &v), forget(keys(&["lock:a"])));
        assert_eq!(routed("SCRIPT FLUSH ASYNC", &v), forget(Forget::Scripts));
        // A client script that lists keys may delete lock keys it was not
        // given (python-redis-lock's reset_all).
        assert_eq!(
            routed("EVAL return(redis.call('KEYS','lock:*')) 0", &v),
            forget(Forget::Database)
        );
        for line in [
            "RENAME a b",
            "COPY a b DB 1",
            "MOVE a 1",
            "SCRIPT LOAD x",
            "FUNCTION FLUSH",
            "EVAL return(redis.call('GET','keys')) 0",
        ] {
            assert_eq!(routed(line, &v), Route::Forward(Expect::One), "{line}");
        }
        // While replies are not counted, still forgotten (when sent).
        let raw = SessionView { raw: true, ..v };
        assert_eq!(
            routed("FLUSHDB", &raw),
            Route::ForwardForget(Forget::Database, Expect::Nothing)
        );
        // With the quorum: flushes reach the primary only; a lock key
        // renamed, copied or moved is refused as before.
        let locks = on_masters();
        let quorum = |line: &str| {
            let (p, buf) = parsed(line);
            let args = CommandArgs::new(&p, buf.as_bytes());
            let kind = classify(args.get(0), args.get(1), args.get(2));
            route(kind, args, &v, &locks)
        };
        assert_eq!(quorum("FLUSHALL"), Route::Forward(Expect::One));
        assert_eq!(quorum("SWAPDB 0 1"), Route::Forward(Expect::One));
        assert!(matches!(quorum("MOVE lock:a 1"), Route::Refuse(_)));
        assert!(matches!(quorum("RENAME lock:a lock:b"), Route::Refuse(_)));
        assert_eq!(quorum("RENAME a b"), Route::Forward(Expect::One));
        assert_eq!(quorum("SCRIPT FLUSH"), forget(Forget::Scripts));
    }

    /// Inside `MULTI` a forgetting command is queued: the transaction's
    /// `EXEC` forgets everything; `DISCARD` and `RESET` forget nothing.
    #[test]
    fn a_transaction_forgets_at_its_exec() {
        let multi = SessionView::default().after(CommandKind::Multi, &Route::Forward(Expect::One));
        assert_eq!(routed("EXEC", &multi), Route::Forward(Expect::One));
        let r = routed("FLUSHDB", &multi);
        let queued = multi.after(CommandKind::Flush, &r);
        assert!(queued.forget_at_exec);
        // A nested MULTI (an error) keeps the transaction as it is.
        assert_eq!(
            queued.after(CommandKind::Multi, &Route::Forward(Expect::One)),
            queued
        );
        let exec = routed("EXEC", &queued);
        assert_eq!(exec, Route::ForwardForget(Forget::Everything, Expect::One));
        let done = queued.after(CommandKind::Exec, &exec);
        assert_eq!(done, SessionView::default());
        for end in [CommandKind::Discard, CommandKind::Reset] {
            let r = Route::Forward(Expect::One);
            assert_eq!(queued.after(end, &r), SessionView::default(), "{end:?}");
        }
        // Plain keys: nothing to forget at EXEC.
        let r = routed("RENAME a b", &multi);
        assert!(!multi.after(CommandKind::Relocate(2), &r).forget_at_exec);
    }

    #[test]
    fn multi_tracking() {
        let v = SessionView::default().after(CommandKind::Multi, &Route::Forward(Expect::One));
        assert!(v.in_multi);
        assert_eq!(routed("HELLO 3", &v), Route::Forward(Expect::One));
        assert!(
            !v.after(CommandKind::Exec, &Route::Forward(Expect::One))
                .in_multi
        );
    }
}
