//! One session's dispatcher: everything the session knows about its
//! connection that decides what a command becomes (the parser, the
//! router's view, the lock scripts the connection has loaded, a quorum
//! transaction's queue, the connection's lock records and its deferred
//! work). [`Dispatch::batch`] parses every complete command of a read
//! batch, asks the router once per command ([`router::decide`]) and
//! carries the answer out: what goes upstream and what the writer half
//! must expect ([`Routed`]). No socket is touched here: the reader sends
//! and writes what it gets, and the tests drive it with bytes.

use std::ops::Range;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use super::carry::Routed;
use super::jobs::Jobs;
use super::pending::InFlight;
use crate::admin;
use crate::command::{self, CommandKind};
use crate::context::ServerContext;
use crate::lock::evalsha::{self, Loaded, Rerun};
use crate::lock::guard::{self, Guarded, GuardedLock, Uncheckable};
use crate::lock::lease::{ConnLocks, Hurry};
use crate::lock::ops::LockOp;
use crate::lock::{Attempt, Forget, LockPending, Refusal, Seat};
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::{self, LocalReply};
use crate::protocol::request::{RequestKind, RequestParser};
use crate::router::{self, CommandArgs, Decision, Expect, Fate, Queued, Route, SessionView};
use crate::script;

/// One session's dispatcher (see the module doc).
pub struct Dispatch {
    parser: RequestParser,
    /// The same context as the carrier's, read while it changes.
    ctx: Arc<ServerContext>,
    carrier: Carrier,
    /// Route one command per batch ([`Dispatch::one_at_a_time`]).
    one: bool,
    /// Hand the upstream what the parse found ([`Dispatch::keep_frames`]).
    frames: bool,
}

/// What carries a decision out: the session's state besides the parser
/// (kept apart so a command's arguments, which borrow the parser, can be
/// read while it changes).
struct Carrier {
    ctx: Arc<ServerContext>,
    view: SessionView,
    /// The lock scripts the upstream connection has loaded (see
    /// [`crate::lock::evalsha`]).
    scripts: Loaded,
    /// A quorum transaction's commands queued by lockgate, run at `EXEC`
    /// (non-empty exactly while `view.tx.queued`).
    queued: Vec<Queued>,
    conn: Arc<Mutex<ConnLocks>>,
    jobs: Jobs,
    /// With guards configured, the transaction being queued (see
    /// [`GuardedTx`]).
    tx: GuardedTx,
    /// The connection's word that something of its own waits (see
    /// [`Hurry`]): a smoothed reply listens on it.
    hurry: Arc<Hurry>,
    /// Commands sent that may free lock keys and whose replies the lock
    /// room has not learned yet (see [`InFlight`]).
    freeing: Arc<AtomicU32>,
    /// Such a command went with its reply silenced (`CLIENT REPLY
    /// OFF|SKIP`) or unmatched (`MONITOR`): nothing says when it ran, so
    /// the connection's attempts are never answered from the view again.
    blind: bool,
    /// The key of an acquisition sent to Redis, outside `MULTI`, after the
    /// last command that may free lock keys while that was unanswered, and
    /// its count in flight (1 until its reply is learned): attempts on the
    /// key behind it fail (see [`Seat::ahead`]). Dropped at the next such
    /// command.
    ahead: Option<(Bytes, Arc<AtomicU32>)>,
    /// Inside `MULTI`: the lock keys the queued commands may free (lock
    /// commands other than acquisitions, client scripts on lock keys), at
    /// most [`MAX_TX_LOCK_KEYS`]; `EXEC` frees them, counted in flight.
    tx_frees: TxFrees,
    /// Inside `MULTI`: the grants queued that the replicas must hold, each
    /// at its place in `EXEC`'s array (`locks.replicas_ack`), at most
    /// [`crate::lock::replicas::in_tx::MAX_IN_TX`]; `EXEC`'s reply waits
    /// for them.
    tx_acks: Vec<(u32, LockPending)>,
}

/// What a transaction being queued may free, for its `EXEC`.
#[derive(Debug, Default, PartialEq, Eq)]
enum TxFrees {
    /// Nothing: its `EXEC` is an ordinary command.
    #[default]
    Nothing,
    /// These lock keys: its `EXEC` drops what the lock room knew of them.
    Keys(Vec<Bytes>),
    /// More than [`MAX_TX_LOCK_KEYS`]: its `EXEC` drops the whole view.
    Many,
}

/// Most lock keys of one transaction kept by name for its `EXEC`.
const MAX_TX_LOCK_KEYS: usize = 64;

/// A transaction as lockgate keeps it while guards are configured: a copy
/// of every command queued since `MULTI` (Redis queues them too), so that
/// an `EXEC` with guarded writes can run it as one checked script
/// ([`Guarded::Exec`]). Bounded: past [`MAX_TX_BYTES`] or
/// [`MAX_TX_COMMANDS`] it is not kept, and such an `EXEC` cannot be
/// checked.
#[derive(Debug, Default)]
struct GuardedTx {
    commands: Vec<Vec<Bytes>>,
    bytes: usize,
    locks: Vec<GuardedLock>,
    /// Too long to keep.
    long: bool,
    /// A command Redis refuses to queue (unknown, wrong arity): its `EXEC`
    /// aborts, so it goes to Redis as it is.
    dirty: bool,
}

/// Most bytes of a guarded transaction kept to run it as a script.
pub const MAX_TX_BYTES: usize = 1 << 20;
/// Most commands of a guarded transaction kept to run it as a script.
pub const MAX_TX_COMMANDS: usize = 1_000;

impl Dispatch {
    /// The dispatcher of a new session: `conn` its lock records, `jobs`
    /// where its deferred work goes.
    pub fn new(ctx: Arc<ServerContext>, conn: Arc<Mutex<ConnLocks>>, jobs: Jobs) -> Dispatch {
        let view = SessionView {
            admin_ok: ctx.config.admin.password.is_empty(),
            ..SessionView::default()
        };
        let hurry = crate::sync::lock(&conn).hurry.clone();
        Dispatch {
            parser: RequestParser::new(ctx.limits()),
            ctx: ctx.clone(),
            carrier: Carrier {
                ctx,
                view,
                scripts: Loaded::default(),
                queued: Vec::new(),
                conn,
                jobs,
                tx: GuardedTx::default(),
                hurry,
                freeing: Arc::default(),
                blind: false,
                ahead: None,
                tx_frees: TxFrees::Nothing,
                tx_acks: Vec::new(),
            },
            one: false,
            frames: false,
        }
    }

    /// While `on`, each batch's [`Routed::frames`] describes its plain
    /// commands at the front of what goes upstream, for an upstream that
    /// would frame them again (shared connections, a cluster); a session's
    /// own connection needs none, and then nothing is recorded.
    pub fn keep_frames(&mut self, on: bool) {
        self.frames = on;
    }

    /// While `on`, [`Dispatch::batch`] stops after one command: the rest
    /// of the buffer waits for the next batch (a client that may have
    /// gone, see `reader`).
    pub fn one_at_a_time(&mut self, on: bool) {
        self.one = on;
    }

    /// Bytes the request being parsed needs before it can be routed.
    pub fn needed(&self) -> usize {
        self.parser.needed()
    }

    /// Replies are not being counted (MONITOR, replication).
    pub fn raw(&self) -> bool {
        self.carrier.view.raw
    }

    /// Parses every complete request in `buf`, decides and carries out
    /// each; stops after a command whose work lockgate does itself (what
    /// follows waits for it, see [`Routed::hold`]) or a malformed request.
    pub fn batch(&mut self, buf: &[u8]) -> Routed {
        let ctx = &self.ctx;
        let mut out = Routed::new(self.carrier.jobs.clone());
        let mut commands = 0u64;
        // Plain forwards not yet recorded: one entry per run (see
        // `Batch::ones`); recorded before anything else is.
        let mut plain = 0u32;
        // Frames describe the front of what goes upstream: recorded until
        // the first command that is not forwarded as it is.
        let mut framing = self.frames;
        loop {
            if self.one && commands > 0 {
                break;
            }
            let pos = out.used;
            let rest = &buf[pos..];
            match self.parser.parse(rest) {
                Ok(None) => break,
                Ok(Some(req)) => {
                    out.used += req.len;
                    let whole = pos..pos + req.len;
                    if req.kind == RequestKind::Empty {
                        framing = false;
                        out.pieces.client(whole);
                        continue;
                    }
                    commands += 1;
                    let args = CommandArgs::new(&self.parser, rest);
                    let (kind, label) = command::lookup(args.get(0), args.get(1), args.get(2));
                    ProxyMetrics::inc(&ctx.metrics.commands[label]);
                    let view = &self.carrier.view;
                    let decision =
                        match router::decide(kind, args, view, &ctx.locks, &ctx.config.admin) {
                            Fate::Plain => {
                                if framing {
                                    framing = match self.parser.arg_ranges() {
                                        Some(args) => out.frames.push(req.len, args),
                                        None => false,
                                    };
                                }
                                out.pieces.client(whole);
                                plain += 1;
                                continue;
                            }
                            Fate::Routed(decision) => decision,
                        };
                    framing = false;
                    out.batch.ones(std::mem::take(&mut plain));
                    // Only a command the client waits on (nothing pipelined
                    // behind it) may be parked: parking a pipelined attempt
                    // would hold every reply behind it.
                    out.last = out.used == buf.len();
                    self.carrier
                        .carry_out(kind, decision, args, whole, &mut out);
                    if out.hold.is_some() {
                        break;
                    }
                }
                Err(e) => {
                    out.batch.ones(std::mem::take(&mut plain));
                    ProxyMetrics::inc(&ctx.metrics.protocol_errors);
                    ctx.metrics.error(e.source_kind());
                    tracing::debug!(error = %e, "malformed request; closing");
                    if self.carrier.view.raw {
                        // Replies are not counted, so the error would jump
                        // ahead of replies still on their way; a RESET marks
                        // where they end (the connection is closing anyway).
                        out.pieces.own(encode::command(&[b"RESET"]));
                        out.batch.barrier();
                    }
                    out.batch.local(LocalReply::err(&e));
                    out.batch.close();
                    out.failed = true;
                    break;
                }
            }
        }
        out.batch.ones(plain);
        ProxyMetrics::add(&ctx.metrics.commands_total, commands);
        out
    }
}

/// The name a `CLIENT SETNAME name` or `HELLO … SETNAME name` gives the
/// connection.
fn client_name(kind: CommandKind, args: CommandArgs<'_>) -> Option<&[u8]> {
    match kind {
        CommandKind::ClientSetName if args.len() == 3 => Some(args.get(2)),
        CommandKind::Hello => (2..args.len())
            .find(|&i| args.get(i).eq_ignore_ascii_case(b"SETNAME"))
            .filter(|&i| i + 1 < args.len())
            .map(|i| args.get(i + 1)),
        _ => None,
    }
}

impl Carrier {
    /// Carries out the router's `decision` for the command of `kind` at
    /// `whole` in the buffer, then moves to the view after it.
    fn carry_out(
        &mut self,
        kind: CommandKind,
        decision: Decision<'_>,
        args: CommandArgs<'_>,
        whole: Range<usize>,
        out: &mut Routed,
    ) {
        let Decision {
            route,
            next,
            script,
        } = decision;
        if let Some((body, load)) = script {
            self.ctx.locks.script_seen(body, load);
        }
        out.batch.silent = self.view.silent(kind);
        if self.view.in_multi && self.ctx.locks.guards_on() {
            self.keep(kind, args);
        }
        self.route(kind, route, args, whole, out);
        out.batch.silent = false;
        self.view = next;
        if !self.view.tx.queued {
            self.queued.clear();
        }
        if !self.view.in_multi {
            self.tx = GuardedTx::default();
            self.tx_frees = TxFrees::Nothing;
            self.tx_acks.clear();
        }
    }

    /// Carries out `route` in the view before the command.
    fn route(
        &mut self,
        kind: CommandKind,
        route: Route,
        args: CommandArgs<'_>,
        whole: Range<usize>,
        out: &mut Routed,
    ) {
        let ctx = &self.ctx;
        match route {
            Route::Forward(expect) => {
                if expect == Expect::EnterRaw {
                    ProxyMetrics::inc(&ctx.metrics.raw_sessions);
                }
                if matches!(expect, Expect::Subscription(..)) {
                    self.scripts.subscribed();
                }
                // A lock library's waiters subscribing to its lock's channel.
                if kind == CommandKind::Subscribe(crate::command::SubKind::Subscribe) {
                    let channels = (1..args.len()).map(|i| args.get(i));
                    self.ctx.locks.subscribed_to(channels);
                }
                // A lock library's waiter blocking on its signal list.
                if kind == CommandKind::Blocking && args.len() == 3 {
                    let sent = [args.get(0), args.get(1), args.get(2)];
                    self.ctx.locks.listening(&self.conn, &sent);
                }
                if let Some(name) = client_name(kind, args) {
                    // Shown to operators beside the locks it holds.
                    let id = crate::sync::lock(&self.conn).id;
                    ctx.locks.conns.named(id, name);
                }
                out.pieces.client(whole);
                // A client script may release or extend its lock keys
                // (redis-py, Redisson release with Lua): what the storm
                // room knows of them is dropped once it has run.
                if let Some(keys) = script_keys(ctx, kind, args, expect) {
                    self.queued_frees(keys.iter());
                    let db = crate::lock::Database::of(self.view.db);
                    let values = crate::lock::reconcile::candidates(&args.all());
                    let sent = std::time::Instant::now();
                    let pending = LockPending::Script {
                        keys,
                        values,
                        db,
                        sent,
                    };
                    self.record_freeing(pending, None, true, out);
                    return;
                }
                // A transaction whose commands may free lock keys: its
                // EXEC runs them.
                if kind == CommandKind::Exec && expect == Expect::One {
                    let pending = match std::mem::take(&mut self.tx_frees) {
                        TxFrees::Nothing => None,
                        TxFrees::Keys(keys) => Some(LockPending::Script {
                            keys,
                            values: Vec::new(),
                            db: crate::lock::Database::of(self.view.db),
                            sent: std::time::Instant::now(),
                        }),
                        TxFrees::Many => Some(LockPending::Forget(crate::lock::Forget::Database)),
                    };
                    if let Some(pending) = self.with_tx_acks(pending) {
                        self.record_freeing(pending, None, true, out);
                        return;
                    }
                }
                out.batch.record(expect)
            }
            Route::ForwardForget(what, expect) => self.forget(kind, what, expect, whole, out),
            Route::ForwardUnmatched => {
                ctx.locks.note_unmatched(args.get(1));
                out.pieces.client(whole);
                out.batch.record(Expect::One);
            }
            Route::Lock(op) => self.lock(&op, out),
            Route::AcquireAll(pairs) => {
                out.defer_after(ctx.locks.acquire_all(pairs, self.view.db));
            }
            Route::Guarded(guarded) => self.guarded(guarded, args, whole, out),
            Route::RefusePersist => {
                let reply = ctx.locks.refuse_persist(args.get(1));
                self.refuse(reply, out)
            }
            Route::QuorumRead => {
                let (locks, command) = (ctx.locks.clone(), encode::command(&args.all()));
                out.defer(Box::pin(async move { locks.read(command).await }));
            }
            Route::QuorumEval => out.defer(ctx.locks.eval(&args.all(), self.conn.clone())),
            Route::QuorumSplit(split) => {
                super::quorum_split::carry_out(ctx, &split, &self.conn, out)
            }
            Route::Refuse(message) => {
                ctx.locks
                    .count_refusal(match message == router::RAW_REFUSAL {
                        true => Refusal::Raw,
                        false => Refusal::Mixed,
                    });
                out.batch.local(LocalReply::err(message));
            }
            Route::Deny(message) => out
                .batch
                .local(LocalReply::Error(Bytes::from_static(message.as_bytes()))),
            Route::Admin => match admin::handle(ctx, args, crate::sync::lock(&self.conn).id) {
                admin::AdminReply::Now(reply) => out.batch.local(reply),
                admin::AdminReply::Later(work) => out.defer(work),
            },
            Route::Queue(queued) => {
                self.queued.push(queued);
                out.batch.local(LocalReply::Status("QUEUED"));
            }
            Route::ExecAbort => super::quorum_transaction::abort(out),
            Route::ExecQueued { mixed } => {
                let queued = std::mem::take(&mut self.queued);
                super::quorum_transaction::exec(ctx, &self.conn, queued, mixed, out);
            }
        }
    }

    /// A command forwarded as it is that changes lock keys or the script
    /// cache behind the lock room's back: what the lock room knew is
    /// dropped once Redis acknowledged it.
    fn forget(
        &mut self,
        kind: CommandKind,
        what: Forget,
        expect: Expect,
        whole: Range<usize>,
        out: &mut Routed,
    ) {
        out.pieces.client(whole);
        if what == Forget::Scripts {
            // Also when sent: no connection sends EVALSHA into a flush on
            // its way. A load that still reaches Redis before the flush is
            // redone once Redis acknowledges it.
            self.ctx.locks.script_epoch.flushed();
        }
        // Queued in a transaction: it runs at EXEC, which forgets then
        // (see `SessionView::forget_at_exec`).
        let queued = self.view.in_multi && kind != CommandKind::Exec;
        // What it drops may be freed lock keys (not Redis's script cache).
        let frees = what != Forget::Scripts;
        match expect {
            _ if queued => out.batch.record(expect),
            Expect::One if !out.batch.silent => {
                self.tx_frees = TxFrees::Nothing;
                let pending = LockPending::Forget(what);
                let pending = match kind {
                    CommandKind::Exec => self.tx_acked(pending),
                    _ => pending,
                };
                self.record_freeing(pending, None, frees, out);
            }
            // No reply will be matched to it: dropped now, before Redis
            // runs it (a probe in between may learn the old state again,
            // bounded by probe_interval_ms as any change made behind
            // lockgate's back).
            _ => {
                self.ctx.locks.forget(&what);
                self.blind |= frees;
                out.batch.record(expect);
            }
        }
    }

    /// A lock command: the lock room's one answer for the attempt, carried
    /// out.
    fn lock(&mut self, op: &LockOp, out: &mut Routed) {
        // Anything but an acquisition may free its key (GETDEL, EXPIRE 0).
        let frees = !matches!(op, LockOp::Acquire { .. });
        let settled = self.settled();
        let acquire = match op {
            LockOp::Acquire { key, .. } => Some(key),
            _ => None,
        };
        let ahead = match (&self.ahead, acquire) {
            (Some((key, n)), Some(k)) => key == k && n.load(Ordering::Acquire) > 0,
            _ => false,
        };
        let seat = Seat {
            conn: &self.conn,
            in_multi: self.view.in_multi,
            db: self.view.db,
            last: out.last,
            settled,
            ahead,
            silent: out.batch.silent,
        };
        let attempt = self.ctx.locks.attempt(op, seat);
        // An acquisition that reaches Redis behind a freeing command not
        // answered yet: later ones on its key, behind it, fail, until its
        // reply is learned.
        let sent = matches!(
            attempt,
            Attempt::OnConnection { .. } | Attempt::Native { .. }
        );
        let mut guard = None;
        if let (Some(key), true, false, false) = (acquire, sent, settled, self.view.in_multi) {
            let count = Arc::new(AtomicU32::new(0));
            guard = Some(InFlight::new(&count));
            self.ahead = Some((key.clone(), count));
        }
        match attempt {
            Attempt::Refused(reply) => self.refuse(reply, out),
            Attempt::Early(early) => out.early(early, &self.hurry),
            Attempt::Held(Ok(reply)) => out.batch.local(reply),
            Attempt::Held(Err(command)) => {
                out.pieces.own(command);
                out.batch.record(Expect::One);
            }
            Attempt::OnConnection { call, pending } => {
                let rerun = self.by_sha(call, out);
                self.record_lock(pending, rerun, frees, guard, out);
            }
            // Inside MULTI: EVAL (a NOSCRIPT in EXEC's array could not be
            // run again in its place).
            Attempt::Queued { call, acked } => {
                if let Some(acked) = acked {
                    if self.tx_acks.len() >= crate::lock::replicas::in_tx::MAX_IN_TX {
                        ProxyMetrics::inc(&self.ctx.locks.replica_acks().full);
                        let text = crate::lock::replicas::in_tx::TOO_MANY;
                        return self.refuse(LocalReply::err(text), out);
                    }
                    self.tx_acks.push((self.view.tx_slots, acked));
                }
                out.pieces.own(call.eval());
                out.batch.record(Expect::One);
                if frees {
                    self.queued_frees(op.lock_keys());
                }
            }
            Attempt::Away(work) => out.defer(work),
            Attempt::Transaction(work) => out.defer_after(work),
            // Its fallback runs in the client's database should the native
            // command not decide (see `LockService::native_missed`).
            Attempt::Native {
                command,
                pending,
                fallback,
            } => {
                out.pieces.own(command);
                let rerun = Rerun {
                    call: fallback,
                    db: self.view.db,
                    epoch: self.ctx.locks.script_epoch.now(),
                };
                self.record_lock(pending, Some(rerun), frees, guard, out);
            }
        }
    }

    /// Whether nothing sent on the connection that may free lock keys
    /// waits for its reply (see [`Seat::settled`]).
    fn settled(&self) -> bool {
        !self.blind && self.freeing.load(Ordering::Acquire) == 0
    }

    /// Records a lock reply to learn; when the command may free lock keys
    /// (`frees`), counted in flight until it is learned, or, with its
    /// reply silenced, the connection's view of it blind from now on.
    fn record_freeing(
        &mut self,
        pending: LockPending,
        rerun: Option<Rerun>,
        frees: bool,
        out: &mut Routed,
    ) {
        self.record_lock(pending, rerun, frees, None, out);
    }

    /// [`Carrier::record_freeing`], or, for an acquisition, counted in
    /// flight by `guard` (see `Carrier::ahead`).
    fn record_lock(
        &mut self,
        pending: LockPending,
        rerun: Option<Rerun>,
        frees: bool,
        guard: Option<InFlight>,
        out: &mut Routed,
    ) {
        if frees {
            self.ahead = None;
        }
        let guard = match frees {
            true => Some(InFlight::new(&self.freeing)),
            false => guard,
        };
        if !out.batch.lock_freeing(pending, rerun, guard) && frees {
            self.blind = true;
        }
    }

    /// Inside `MULTI`, `keys` may be freed at the `EXEC` (see
    /// [`TxFrees`]); outside, nothing to note.
    fn queued_frees(&mut self, keys: impl Iterator<Item = impl AsRef<[u8]>>) {
        if !self.view.in_multi {
            return;
        }
        for key in keys {
            let key = key.as_ref();
            let listed = match &mut self.tx_frees {
                TxFrees::Many => return,
                TxFrees::Nothing => {
                    self.tx_frees = TxFrees::Keys(Vec::new());
                    match &mut self.tx_frees {
                        TxFrees::Keys(list) => list,
                        _ => return,
                    }
                }
                TxFrees::Keys(list) => list,
            };
            if listed.iter().any(|k| &k[..] == key) {
                continue;
            }
            if listed.len() >= MAX_TX_LOCK_KEYS {
                self.tx_frees = TxFrees::Many;
                return;
            }
            listed.push(Bytes::copy_from_slice(key));
        }
    }

    /// Keeps a copy of a command queued in a transaction (see
    /// [`GuardedTx`]), and notes one Redis will refuse to queue.
    fn keep(&mut self, kind: CommandKind, args: CommandArgs<'_>) {
        if matches!(
            kind,
            CommandKind::Exec | CommandKind::Discard | CommandKind::Multi | CommandKind::Reset
        ) {
            return;
        }
        let all = args.all();
        let table = self.ctx.locks.guard_table.get();
        if !table.is_empty() && !table.accepts(&all) {
            self.tx.dirty = true;
        }
        let tx = &mut self.tx;
        tx.bytes += all.iter().map(|a| a.len()).sum::<usize>();
        if tx.long || tx.bytes > MAX_TX_BYTES || tx.commands.len() >= MAX_TX_COMMANDS {
            tx.long = true;
            tx.commands.clear();
            return;
        }
        tx.commands
            .push(all.iter().map(|a| Bytes::copy_from_slice(a)).collect());
    }

    /// The `EXEC` of a transaction with guarded writes: run as one script
    /// that checks every lock first, after Redis's queue is discarded; as
    /// it is when Redis will abort it anyway; refused (or, in report mode,
    /// passed and counted) when it cannot be checked exactly: under
    /// `WATCH`, or too long to keep.
    fn guarded_exec(&mut self, whole: Range<usize>, out: &mut Routed) {
        let tx = std::mem::take(&mut self.tx);
        let locks = &self.ctx.locks;
        if tx.dirty {
            out.pieces.client(whole);
            out.batch.record(Expect::One);
            return;
        }
        let why = match (self.view.watching, tx.long) {
            (true, _) => Some((Uncheckable::Watched, "WATCH".to_string())),
            (_, true) => Some((
                Uncheckable::TooLong,
                format!("{MAX_TX_COMMANDS} commands or {MAX_TX_BYTES} bytes"),
            )),
            _ => None,
        };
        if let Some((why, name)) = why {
            let guarded = guard::uncheckable(tx.locks, why, &name);
            locks.count_uncheckable(&guarded);
            match guarded {
                Guarded::Refuse(_, text) => {
                    super::quorum_transaction::discard(out);
                    out.batch.local(LocalReply::err(text));
                }
                _ => {
                    out.pieces.client(whole);
                    out.batch.record(Expect::One);
                }
            }
            return;
        }
        super::quorum_transaction::discard(out);
        let (call, pending) =
            locks.guard_tx_call(tx.locks, &tx.commands, &crate::sync::lock(&self.conn));
        let rerun = self.by_sha(call, out);
        let frees = std::mem::take(&mut self.tx_frees) != TxFrees::Nothing;
        let pending = self.tx_acked(pending);
        self.record_freeing(pending, rerun, frees, out);
    }

    /// `then`, what `EXEC`'s reply teaches otherwise, with the grants the
    /// transaction queued for the replicas to acknowledge, if any.
    fn with_tx_acks(&mut self, then: Option<LockPending>) -> Option<LockPending> {
        match then {
            Some(then) => Some(self.tx_acked(then)),
            None if self.tx_acks.is_empty() => None,
            None => Some(LockPending::InTx {
                grants: std::mem::take(&mut self.tx_acks),
                slots: self.view.tx_slots,
                then: None,
            }),
        }
    }

    /// [`Self::with_tx_acks`] of a reply that teaches `then` anyway.
    fn tx_acked(&mut self, then: LockPending) -> LockPending {
        if self.tx_acks.is_empty() {
            return then;
        }
        LockPending::InTx {
            grants: std::mem::take(&mut self.tx_acks),
            slots: self.view.tx_slots,
            then: Some(Box::new(then)),
        }
    }

    /// A write to guarded data: checked with the write in one script call
    /// on the client's connection (the writer reads its reply with
    /// [`crate::lock::LockService::guard_reply`]), forwarded unchecked, or
    /// refused (inside `MULTI` the refusal aborts the `EXEC`, see
    /// [`router::Route::Guarded`]).
    fn guarded(
        &mut self,
        guarded: Guarded,
        args: CommandArgs<'_>,
        whole: Range<usize>,
        out: &mut Routed,
    ) {
        let locks = &self.ctx.locks;
        locks.count_uncheckable(&guarded);
        match guarded {
            Guarded::Check(checked) => {
                let (call, pending) =
                    locks.guard_call(checked, &args.all(), &crate::sync::lock(&self.conn));
                let rerun = self.by_sha(call, out);
                out.batch.lock(pending, rerun);
            }
            Guarded::Unchecked(_) => {
                out.pieces.client(whole);
                out.batch.record(Expect::One);
            }
            Guarded::Refuse(_, text) => out.batch.local(LocalReply::err(text)),
            Guarded::InTx(checked) => {
                for l in checked {
                    if !self.tx.locks.iter().any(|k| k.lock == l.lock) {
                        self.tx.locks.push(l);
                    }
                }
                out.pieces.client(whole);
                out.batch.record(Expect::One);
            }
            Guarded::Script(checked, body) => {
                let (command, pending) = locks.guard_script_call(
                    checked,
                    &body,
                    &args.all(),
                    &crate::sync::lock(&self.conn),
                );
                out.pieces.own(command);
                out.batch.lock(pending, None);
            }
            Guarded::NoScript => out.batch.local(LocalReply::Error(Bytes::from_static(
                b"NOSCRIPT No matching script. Please use EVAL.",
            ))),
            Guarded::Exec => self.guarded_exec(whole, out),
        }
    }

    /// Puts `call` in the batch as `EVALSHA`, after `SCRIPT LOAD` the first
    /// time on this connection (its reply swallowed), and returns what to
    /// rerun it with if Redis lost the script; as `EVAL` where a reply is
    /// skipped (`CLIENT REPLY`: a load would take the skip), the database
    /// is unknown (a rerun could not find it) or the connection subscribed
    /// (see [`evalsha::Loaded::subscribed`]). See [`crate::lock::evalsha`].
    fn by_sha(&mut self, call: evalsha::Call, out: &mut Routed) -> Option<Rerun> {
        let db = self.view.db;
        if out.batch.silent || db == u64::MAX || !self.scripts.by_sha() {
            out.pieces.own(call.eval());
            return None;
        }
        let epoch = self.ctx.locks.script_epoch.now();
        if self.scripts.load_first(call.script(), epoch) {
            out.pieces.own(call.load());
            out.batch.swallow();
        }
        out.pieces.own(call.evalsha());
        Some(Rerun { call, db, epoch })
    }

    /// Answers a refused command with `reply`, an error; inside MULTI the
    /// refusal must take the command's slot in the EXEC array, so Redis
    /// itself answers it (a script that returns the error).
    fn refuse(&self, reply: LocalReply, out: &mut Routed) {
        match (&reply, self.view.in_multi) {
            (LocalReply::Error(text), true) => {
                out.pieces.own(encode::command(&[
                    b"EVAL",
                    script::ERROR.as_bytes(),
                    b"0",
                    text,
                ]));
                out.batch.record(Expect::One);
            }
            _ => out.batch.local(reply),
        }
    }
}

/// The lock keys of a client script forwarded as it is (`EVAL`/`EVALSHA`,
/// one reply expected), if any.
#[inline]
fn script_keys(
    ctx: &ServerContext,
    kind: CommandKind,
    args: CommandArgs<'_>,
    expect: Expect,
) -> Option<Vec<Bytes>> {
    // Every command forwarded comes here: its kind is known already, and
    // only a script goes on to the search.
    if expect != Expect::One || kind != CommandKind::Eval {
        return None;
    }
    ctx.locks.script_lock_keys(&args.all())
}

#[cfg(test)]
mod tests;
