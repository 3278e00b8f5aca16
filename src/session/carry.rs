//! Carrying out the routes of one read batch: parse every complete command,
//! route it, and collect what goes upstream (the client's own bytes, or
//! commands lockgate writes in place of lock commands) and what the writer half must expect.

use super::jobs::Jobs;
use super::pending::Batch;
use super::quorum_transaction::{quorum_transaction, remember_script, QuorumTransaction};
use crate::admin;
use crate::command;
use crate::context::ServerContext;
use crate::lock::evalsha::{self, Rerun};
use crate::lock::lease::ConnLocks;
use crate::lock::ops::LockOp;
use crate::lock::script;
use crate::lock::{Attempt, Early, Forget, LockPending, Seat};
use crate::lock::Refusal;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::{self, LocalReply};
use crate::protocol::request::{RequestKind, RequestParser};
use crate::router::{self, CommandArgs, Expect, Route, SessionView};
use bytes::{Bytes, BytesMut};
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// What goes upstream for one read batch: ranges of the client's own
/// bytes, and commands lockgate wrote in place of lock commands. Almost
/// every batch is one run of the client's bytes, kept in `first` without
/// a `Vec` (an allocation and a free per batch, one per command at
/// `-P 1`); everything after it, in order, in `more`.
#[derive(Debug, Default)]
pub(super) struct Pieces {
    first: Option<Range<usize>>,
    more: Vec<Piece>,
}

#[derive(Debug)]
enum Piece {
    Client(Range<usize>),
    Own(Bytes),
}

impl Pieces {
    pub(super) fn client(&mut self, range: Range<usize>) {
        let last = match self.more.last_mut() {
            Some(Piece::Client(last)) => Some(last),
            Some(Piece::Own(_)) => None,
            None if self.first.is_none() => {
                self.first = Some(range);
                return;
            }
            None => self.first.as_mut(),
        };
        match last {
            Some(last) if last.end == range.start => last.end = range.end,
            _ => self.more.push(Piece::Client(range)),
        }
    }

    pub(super) fn own(&mut self, bytes: Bytes) {
        self.more.push(Piece::Own(bytes));
    }

    /// The bytes to write upstream, given the batch's client bytes. The
    /// common case (only client bytes, contiguous) is zero-copy.
    pub(super) fn assemble(self, client: Bytes) -> Bytes {
        match (self.first, self.more.is_empty()) {
            (None, true) => Bytes::new(),
            (Some(r), true) => client.slice(r),
            (first, false) => {
                let mut out = BytesMut::new();
                if let Some(r) = first {
                    out.extend_from_slice(&client[r]);
                }
                for p in &self.more {
                    match p {
                        Piece::Client(r) => out.extend_from_slice(&client[r.clone()]),
                        Piece::Own(b) => out.extend_from_slice(b),
                    }
                }
                out.freeze()
            }
        }
    }
}

/// One read batch, routed.
pub(super) struct Routed {
    /// Where work with deferred replies is queued.
    pub(super) jobs: Jobs,
    /// The command being routed is the last one read so far.
    pub(super) last: bool,
    pub(super) batch: Batch,
    pub(super) pieces: Pieces,
    /// Bytes consumed from the front of the read buffer.
    pub(super) used: usize,
    /// A malformed request ended the batch (its error and a close are the
    /// batch's last entries).
    pub(super) failed: bool,
    /// The batch ends with work lockgate does itself (a quorum operation,
    /// a fencing call): nothing after it goes upstream before it is done,
    /// so effects keep pipeline order (see [`Routed::defer`]).
    pub(super) hold: Option<tokio::sync::oneshot::Receiver<()>>,
    /// Lock keys released earlier in this batch, on one Redis.
    pub(super) released: Vec<Bytes>,
}

impl Routed {
    /// Takes an attempt answered before Redis (see
    /// [`crate::lock::LockService::attempt`]): now, later, or parked.
    fn early(&mut self, early: Early) {
        match early {
            Early::Now(reply) => self.batch.local(reply),
            Early::Delayed(reply, wait) => self.defer_reply(Box::pin(async move {
                tokio::time::sleep(wait).await;
                reply
            })),
            Early::Parked(rx) => self.batch.deferred(rx),
        }
    }

    /// Queues `work`, which acts on a store (a quorum operation, a fencing
    /// call); its reply takes the command's place in the order, and the
    /// batch ends with it: commands after it are routed and sent upstream
    /// only once it is done, as Redis would run them after it.
    pub(super) fn defer(&mut self, work: admin::Work) {
        let (done, hold) = tokio::sync::oneshot::channel();
        self.hold = Some(hold);
        self.defer_reply(Box::pin(async move {
            let reply = work.await;
            let _ = done.send(());
            reply
        }));
    }

    /// Queues `work` that only makes a reply; it takes the command's place
    /// in the order.
    fn defer_reply(&mut self, work: admin::Work) {
        match self.jobs.defer(work) {
            Ok(rx) => self.batch.deferred(rx),
            Err(reply) => self.batch.local(reply),
        }
    }
}

/// Parses every complete request in `buf` and routes it.
pub(super) fn route_batch(
    ctx: &Arc<ServerContext>,
    parser: &mut RequestParser,
    view: &mut SessionView,
    conn: &Arc<Mutex<ConnLocks>>,
    tx: &mut QuorumTransaction,
    jobs: &Jobs,
    buf: &[u8],
) -> Routed {
    let mut out = Routed {
        jobs: jobs.clone(),
        last: false,
        batch: Batch::default(),
        pieces: Pieces::default(),
        used: 0,
        failed: false,
        hold: None,
        released: Vec::new(),
    };
    let mut commands = 0u64;
    // Plain forwards not yet recorded: one entry per run (see `Batch::ones`);
    // recorded before anything else is.
    let mut plain = 0u32;
    loop {
        let pos = out.used;
        let rest = &buf[pos..];
        match parser.parse(rest) {
            Ok(None) => break,
            Ok(Some(req)) => {
                out.used += req.len;
                let whole = pos..pos + req.len;
                if req.kind == RequestKind::Empty {
                    out.pieces.client(whole);
                    continue;
                }
                commands += 1;
                let args = CommandArgs::new(parser, rest);
                // Each argument lookup is a checked slice: the name and
                // the first argument are looked up once.
                let (name, arg1) = (args.get(0), args.get(1));
                let (kind, label) = command::lookup(name, arg1, args.get(2));
                ProxyMetrics::inc(&ctx.metrics.commands[label]);
                if router::forwards_plainly(kind, args, view, &ctx.locks) {
                    out.pieces.client(whole);
                    plain += 1;
                    continue;
                }
                out.batch.ones(std::mem::take(&mut plain));
                let route = router::route(kind, args, view, &ctx.locks);
                remember_script(ctx, kind, args);
                if kind == command::CommandKind::Lockgate
                    && arg1.eq_ignore_ascii_case(b"AUTH")
                    && args.get(2) == ctx.config.admin.password.as_bytes()
                {
                    view.admin_ok = true;
                }
                if kind == command::CommandKind::Select {
                    view.db = std::str::from_utf8(arg1)
                        .ok()
                        .and_then(|d| d.parse().ok())
                        .unwrap_or(u64::MAX);
                }
                // Only a command the client waits on (nothing pipelined
                // behind it) may be parked: parking a pipelined attempt
                // would hold every reply behind it.
                out.last = out.used == buf.len();
                out.batch.silent = view.silent(kind);
                if !quorum_transaction(ctx, kind, &route, view, conn, tx, args, &mut out) {
                    carry_out(ctx, kind, &route, args, view, conn, whole, &mut out);
                }
                out.batch.silent = false;
                *view = view.after(kind, &route);
                if out.hold.is_some() {
                    break;
                }
            }
            Err(e) => {
                out.batch.ones(std::mem::take(&mut plain));
                ProxyMetrics::inc(&ctx.metrics.protocol_errors);
                ctx.metrics.error(e.source_kind());
                tracing::debug!(error = %e, "malformed request; closing");
                if view.raw {
                    // Replies are not counted, so the error would jump ahead
                    // of replies still on their way; a RESET marks where they
                    // end (the connection is closing anyway).
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

/// The lock keys of a client script (`EVAL`/`EVALSHA`, `kind`
/// [`command::CommandKind::Eval`]), on either store: it may release or
/// extend them (redis-py, Redisson release with Lua), so what the storm
/// room knows about them is dropped once it has run.
#[inline]
fn script_lock_keys(
    ctx: &ServerContext,
    kind: command::CommandKind,
    args: CommandArgs<'_>,
    expect: Expect,
) -> Option<Vec<bytes::Bytes>> {
    // Every command passing through comes here: its kind is known already,
    // and only a script goes on to the search.
    if expect != Expect::One || kind != command::CommandKind::Eval {
        return None;
    }
    eval_lock_keys(ctx, args)
}

/// The lock keys among the keys of the `EVAL`-family command `args`.
fn eval_lock_keys(ctx: &ServerContext, args: CommandArgs<'_>) -> Option<Vec<bytes::Bytes>> {
    let n: usize = std::str::from_utf8(args.get(2)).ok()?.parse().ok()?;
    let keys: Vec<bytes::Bytes> = (3..(3 + n).min(args.len()))
        .map(|i| args.get(i))
        .filter(|k| ctx.locks.is_lock_key(k))
        .map(bytes::Bytes::copy_from_slice)
        .collect();
    (!keys.is_empty()).then_some(keys)
}

/// Puts `call` in the batch as `EVALSHA`, after `SCRIPT LOAD` the first
/// time on this connection (its reply swallowed), and returns what to
/// rerun it with if Redis lost the script; as `EVAL` where a reply is
/// skipped (`CLIENT REPLY`: a load would take the skip), the database is
/// unknown (a rerun could not find it) or the connection subscribed (see
/// [`evalsha::Loaded::subscribed`]). See [`crate::lock::evalsha`].
fn by_sha(
    ctx: &ServerContext,
    view: &mut SessionView,
    call: evalsha::Call,
    out: &mut Routed,
) -> Option<Rerun> {
    if out.batch.silent || view.db == u64::MAX || !view.scripts.by_sha() {
        out.pieces.own(call.eval());
        return None;
    }
    let epoch = ctx.locks.script_epoch.now();
    if view.scripts.load_first(call.script(), epoch) {
        out.pieces.own(call.load());
        out.batch.swallow();
    }
    out.pieces.own(call.evalsha());
    Some(Rerun {
        call,
        db: view.db,
        epoch,
    })
}

/// Answers a refused command with `reply`, an error; inside MULTI the
/// refusal must take the command's slot in the EXEC array, so Redis itself
/// answers it (a script that returns the error).
fn refuse(reply: LocalReply, view: &SessionView, out: &mut Routed) {
    match (&reply, view.in_multi) {
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

/// Carries out one routing decision for the command (of `kind`) at `whole`
/// in the buffer.
#[allow(clippy::too_many_arguments)]
fn carry_out(
    ctx: &Arc<ServerContext>,
    kind: command::CommandKind,
    route: &Route,
    args: CommandArgs<'_>,
    view: &mut SessionView,
    conn: &Arc<Mutex<ConnLocks>>,
    whole: Range<usize>,
    out: &mut Routed,
) {
    match route {
        Route::Forward(expect) => {
            if *expect == Expect::EnterRaw {
                ProxyMetrics::inc(&ctx.metrics.raw_sessions);
            }
            if matches!(expect, Expect::Subscription(..)) {
                view.scripts.subscribed();
            }
            out.pieces.client(whole);
            match script_lock_keys(ctx, kind, args, *expect).filter(|_| !ctx.locks.on_masters()) {
                Some(keys) => out.batch.lock(LockPending::Script { keys }, None),
                None => out.batch.record(*expect),
            }
        }
        Route::ForwardForget(what, expect) => {
            out.pieces.client(whole);
            if *what == Forget::Scripts {
                // Also when sent: no connection sends EVALSHA into a flush
                // on its way. A load that still reaches Redis before the
                // flush is redone once Redis acknowledges it.
                ctx.locks.script_epoch.flushed();
            }
            // Queued in a transaction: it runs at EXEC, which forgets then
            // (see `SessionView::forget_at_exec`).
            let queued = view.in_multi && kind != command::CommandKind::Exec;
            match expect {
                _ if queued => out.batch.record(*expect),
                Expect::One if !out.batch.silent => {
                    out.batch.lock(LockPending::Forget(what.clone()), None)
                }
                // No reply will be matched to it: dropped now, before Redis
                // runs it (a probe in between may learn the old state
                // again, bounded by probe_interval_ms as any change made
                // behind lockgate's back).
                _ => {
                    ctx.locks.forget(what);
                    out.batch.record(*expect);
                }
            }
        }
        Route::ForwardUnmatched => {
            ctx.locks.note_unmatched(args.get(1));
            out.pieces.client(whole);
            out.batch.record(Expect::One);
        }
        Route::Lock(op) => {
            let after_release =
                matches!(op, LockOp::Acquire { key, .. } if out.released.contains(key));
            if let LockOp::Release { lock_keys, .. } = op {
                out.released.extend(lock_keys.iter().cloned());
            }
            let seat = Seat {
                conn,
                in_multi: view.in_multi,
                db: view.db,
                last: out.last,
                after_release,
            };
            match ctx.locks.attempt(op, seat) {
                Attempt::Refused(reply) => refuse(reply, view, out),
                Attempt::Early(early) => out.early(early),
                Attempt::Held(Ok(reply)) => out.batch.local(reply),
                Attempt::Held(Err(command)) => {
                    out.pieces.own(command);
                    out.batch.record(Expect::One);
                }
                // Inside MULTI: EVAL (a NOSCRIPT in EXEC's array could not
                // be run again in its place).
                Attempt::OnConnection {
                    call,
                    pending: None,
                } => {
                    out.pieces.own(call.eval());
                    out.batch.record(Expect::One);
                }
                Attempt::OnConnection {
                    call,
                    pending: Some(pending),
                } => {
                    let rerun = by_sha(ctx, view, call, out);
                    out.batch.lock(pending, rerun);
                }
                Attempt::Away(work) => out.defer(work),
            }
        }
        Route::RefusePersist => refuse(ctx.locks.refuse_persist(args.get(1)), view, out),
        Route::QuorumRead => {
            let (locks, command) = (ctx.locks.clone(), encode::command(&args.all()));
            out.defer(Box::pin(async move { locks.read(command).await }));
        }
        Route::QuorumEval => out.defer(ctx.locks.eval(&args.all())),
        Route::QuorumSplit(split) => super::quorum_split::carry_out(ctx, split, conn, out),
        Route::Refuse(message) => {
            ctx.locks
                .count_refusal(match *message == router::RAW_REFUSAL {
                    true => Refusal::Raw,
                    false => Refusal::Mixed,
                });
            out.batch.local(LocalReply::err(message));
        }
        Route::Admin if !ctx.config.admin.resp_commands => {
            out.pieces.client(whole);
            out.batch.record(Expect::One);
        }
        Route::Admin if !view.admin_ok && !args.get(1).eq_ignore_ascii_case(b"AUTH") => {
            out.batch.local(LocalReply::Error(bytes::Bytes::from_static(
                b"NOPERM lockgate: LOCKGATE AUTH <password> required first",
            )));
        }
        Route::Admin if args.get(1).eq_ignore_ascii_case(b"AUTH") && !view.admin_ok => {
            out.batch.local(LocalReply::Error(bytes::Bytes::from_static(
                b"WRONGPASS lockgate: invalid LOCKGATE password",
            )));
        }
        Route::Admin => match admin::handle(ctx, args) {
            admin::AdminReply::Now(reply) => out.batch.local(reply),
            admin::AdminReply::Later(work) => out.defer(work),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assembled(steps: &[Result<Range<usize>, &'static [u8]>]) -> Bytes {
        let mut pieces = Pieces::default();
        for step in steps {
            match step {
                Ok(range) => pieces.client(range.clone()),
                Err(own) => pieces.own(Bytes::from_static(own)),
            }
        }
        pieces.assemble(Bytes::from_static(b"0123456789abcdef"))
    }

    /// Client runs merge when they touch, commands of lockgate's own keep
    /// their place between them, and a command answered locally leaves a
    /// gap in the client's bytes.
    #[test]
    fn pieces_assemble_in_order() {
        assert_eq!(assembled(&[]), Bytes::new());
        assert_eq!(assembled(&[Ok(0..4), Ok(4..8)]), &b"01234567"[..]);
        assert_eq!(assembled(&[Ok(0..2), Ok(5..7)]), &b"0156"[..]);
        assert_eq!(assembled(&[Err(b"X"), Ok(0..2)]), &b"X01"[..]);
        assert_eq!(
            assembled(&[Ok(0..2), Err(b"X"), Ok(2..4), Ok(4..6), Err(b"Y")]),
            &b"01X2345Y"[..]
        );
        assert_eq!(assembled(&[Ok(0..2), Ok(3..4), Ok(4..5)]), &b"0134"[..]);
    }
}
