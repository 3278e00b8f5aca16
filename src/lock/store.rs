//! Where the locks live, hidden from everyone outside the lock room: the
//! primary the sessions talk to, or the Redlock quorum of lock masters.
//! A session makes one call for an attempt whatever the store
//! ([`LockService::attempt`]) and gets back what to carry out
//! ([`Attempt`]); reads, client scripts, transactions and the fencing API
//! are one call each too. The failover hold of acquisitions after a switch
//! of the primary, the `locks.require_noeviction` refusal and the
//! [`Acquirer`] a parked attempt's driver acquires through live here, with
//! the store they are about.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::join_all;
use tokio_util::sync::CancellationToken;

use super::admit::Early;
use super::eviction::{Eviction, Memory};
use super::fast::Natives;
use super::lease::ConnLocks;
use super::metrics::RejoinMetrics;
use super::ops::LockOp;
use super::quorum::Quorum;
use super::replicas::Replicas;
use super::split::{Merge, Split};
use super::storm::{Acquirer, Ask, Tried};
use super::txn::{OnPrimary, TxnMetrics};
use super::{evalsha, Database, LockPending, LockService, Queueing};
use crate::metrics::{Counter, Kind, ProxyMetrics};
use crate::protocol::encode::{self, LocalReply};
use crate::sync;
use crate::upstream::node::{Node, NodeConfig};
use crate::upstream::Primary;

/// A reply lockgate makes away from the client's connection; it takes the
/// command's place in the order.
pub type Later = Pin<Box<dyn Future<Output = LocalReply> + Send + 'static>>;

/// The store of the locks: lockgate's own connection to the primary, and
/// the lock masters when lock keys live on a quorum.
#[derive(Debug)]
pub struct Store {
    /// lockgate's own shared connection to the primary (the watchdog,
    /// release on disconnect, a parked attempt's driver, a `NOSCRIPT`
    /// rerun, the fencing API on one Redis), its scripts carried out as
    /// transactions when the server refuses scripts ([`super::txn`]).
    pub primary: OnPrimary,
    /// The primary's eviction policy as its connection reads it.
    pub primary_memory: Arc<Memory>,
    /// Which Redis is the primary now, for the failover hold.
    primary_addr: Arc<Primary>,
    /// `locks.require_noeviction` and the eviction counters.
    eviction: Arc<Eviction>,
    /// The lock masters, when lock keys live on a quorum.
    quorum: Option<Arc<Quorum>>,
    /// Cancelled when lockgate has drained: parked waits end.
    stop: CancellationToken,
    /// How long lockgate's own calls may take (`upstream.connect_timeout_ms`).
    timeout: Duration,
    /// What the primary offers besides scripts, as lockgate's own
    /// connection to it last saw.
    pub(crate) natives: Arc<Natives>,
    /// Grants answered once the primary's replicas hold them
    /// (`locks.replicas_ack`).
    pub replicas: Arc<Replicas>,
}

impl Store {
    /// How long lockgate's own calls may take
    /// (`upstream.connect_timeout_ms`).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Which Redis is the primary now (the failover hold's clock).
    pub fn primary_addr(&self) -> &Arc<Primary> {
        &self.primary_addr
    }

    /// `locks.require_noeviction` in force and the eviction counters.
    pub fn eviction(&self) -> &Arc<Eviction> {
        &self.eviction
    }

    /// Cancelled once lockgate has drained.
    pub fn stop(&self) -> &CancellationToken {
        &self.stop
    }

    /// Resolves once lockgate has drained (waits end then).
    pub fn stopped(&self) -> tokio_util::sync::WaitForCancellationFuture<'_> {
        self.stop.cancelled()
    }

    /// The store of a running server.
    pub fn new(
        primary: OnPrimary,
        primary_memory: Arc<Memory>,
        primary_addr: Arc<Primary>,
        eviction: Arc<Eviction>,
        quorum: Option<Arc<Quorum>>,
        stop: CancellationToken,
        timeout: Duration,
    ) -> Store {
        Store {
            primary,
            primary_memory,
            replicas: Arc::new(Replicas::new(
                None,
                primary_addr.clone(),
                stop.clone(),
                timeout,
            )),
            primary_addr,
            eviction,
            quorum,
            stop,
            timeout,
            natives: Arc::new(Natives::default()),
        }
    }

    /// The store `config` describes, reaching nothing: the primary at
    /// `upstream.addr` and the masters of `locks.quorum`, never connected
    /// (every call fails at once). For a lock room whose rules, routes,
    /// plans and replies are looked at without Redis (unit tests,
    /// [`LockService::new`]).
    pub fn offline(config: &crate::config::Config) -> Store {
        let eviction = Arc::new(Eviction::new(config));
        let primary_addr = Primary::fixed(&config.upstream.addr);
        let stop = CancellationToken::new();
        let timeout = Duration::from_millis(config.upstream.connect_timeout_ms);
        Store {
            replicas: Arc::new(Replicas::new(
                None,
                primary_addr.clone(),
                stop.clone(),
                timeout,
            )),
            primary: OnPrimary::new(Node::detached(&config.upstream.addr), None),
            primary_memory: Arc::new(Memory::default()),
            primary_addr,
            quorum: Quorum::offline(config, &eviction),
            eviction,
            stop,
            timeout,
            natives: Arc::new(Natives::default()),
        }
    }

    /// This store, its primary's natives read by `natives` (the observer
    /// of lockgate's own connection to the primary).
    pub fn with_natives(self, natives: Arc<Natives>) -> Store {
        Store { natives, ..self }
    }

    /// This store, asking the primary's replicas to acknowledge grants
    /// (`locks.replicas_ack`) over a connection of its own that `node`
    /// makes, opened on first use.
    pub fn with_replicas(self, node: NodeConfig) -> Store {
        let replicas = Replicas::new(
            Some(node),
            self.primary_addr.clone(),
            self.stop.clone(),
            self.timeout,
        );
        Store {
            replicas: Arc::new(replicas),
            ..self
        }
    }
}

/// Where an attempt comes from, as the session knows it.
#[derive(Debug, Clone, Copy)]
pub struct Seat<'a> {
    /// The connection's lock records.
    pub conn: &'a Arc<Mutex<ConnLocks>>,
    /// Inside `MULTI`: Redis must queue the command.
    pub in_multi: bool,
    /// The database `SELECT`ed (`u64::MAX`: unreadable).
    pub db: u64,
    /// Nothing is pipelined behind it: it may wait (park).
    pub last: bool,
    /// Nothing the connection sent before it that may free lock keys (a
    /// release, an extension, a takeover, a flush or rename, a client
    /// script on lock keys, a transaction with any of them) waits for its
    /// reply: what lockgate knows of the key does not predate something
    /// Redis will run first, so the attempt may be answered from it.
    pub settled: bool,
    /// Not settled, but an acquisition of the same key was sent after the
    /// last command that may free lock keys, outside `MULTI`, and is not
    /// answered yet: Redis runs it before this one, which therefore fails
    /// (see [`LockService::behind_attempt`]).
    pub ahead: bool,
    /// Its reply is suppressed (`CLIENT REPLY OFF|SKIP`): no outcome is
    /// read, so nothing may depend on one (a native call's fallback).
    pub silent: bool,
}

/// What the session carries out for one lock command
/// ([`LockService::attempt`]).
pub enum Attempt {
    /// Refused with this error (`locks.require_noeviction`); inside
    /// `MULTI` it must take the command's slot in `EXEC`'s array.
    Refused(LocalReply),
    /// Answered before Redis: now, after a delay, or once parked.
    Early(Early),
    /// Answered "not acquired" while acquisitions are held after a switch
    /// of the primary: this reply now, or (inside `MULTI`) this command
    /// sent in the attempt's place, answered by Redis in `EXEC`'s array.
    Held(Result<LocalReply, Bytes>),
    /// A script call sent on the client's own connection, and what the
    /// writer does with its reply.
    OnConnection {
        /// The script call.
        call: evalsha::Call,
        /// What to do with its reply.
        pending: LockPending,
    },
    /// Inside `MULTI` on one Redis: the script call, sent as `EVAL` (a
    /// `NOSCRIPT` in `EXEC`'s array could not be rerun in its place), its
    /// reply passed as it is; `acked`: the grant it may make at `EXEC`,
    /// which the replicas must hold before `EXEC` is answered
    /// (`locks.replicas_ack`, [`LockService::exec_acked`]).
    Queued {
        /// The script call.
        call: evalsha::Call,
        /// The grant to acknowledge, if its pattern asks.
        acked: Option<LockPending>,
    },
    /// Carried out by lockgate away from the client's connection (on the
    /// quorum); the reply takes the command's place, and nothing after it
    /// goes upstream before it is done.
    Away(Later),
    /// Carried out by lockgate on the primary as a transaction of its own
    /// (the server refuses scripts, see [`super::txn`]): as `Away`, but it
    /// starts only once Redis has answered every command the client sent
    /// before it, since it acts on the same Redis.
    Transaction(Later),
    /// A native command sent on the client's own connection instead of a
    /// script (see [`super::fast`]): when Redis answers it could not decide
    /// (`MSETEX` found a key, or the server refused the command), the
    /// `fallback` script runs again in its place, as after `NOSCRIPT`.
    Native {
        /// The command, in RESP.
        command: Bytes,
        /// What to do with its reply.
        pending: LockPending,
        /// The general script's call.
        fallback: evalsha::Call,
    },
}

impl std::fmt::Debug for Attempt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Attempt::Refused(r) => f.debug_tuple("Refused").field(r).finish(),
            Attempt::Early(e) => f.debug_tuple("Early").field(e).finish(),
            Attempt::Held(h) => f.debug_tuple("Held").field(h).finish(),
            Attempt::OnConnection { call, pending } => (f.debug_struct("OnConnection"))
                .field("call", call)
                .field("pending", pending)
                .finish(),
            Attempt::Queued { call, acked } => (f.debug_struct("Queued"))
                .field("call", call)
                .field("acked", acked)
                .finish(),
            Attempt::Away(_) => f.write_str("Away(..)"),
            Attempt::Transaction(_) => f.write_str("Transaction(..)"),
            Attempt::Native { pending, .. } => (f.debug_struct("Native"))
                .field("pending", pending)
                .finish_non_exhaustive(),
        }
    }
}

/// A call of the fencing-token API (`LOCKGATE LOCK | UNLOCK | EXTEND`).
#[derive(Debug, Clone)]
pub enum FenceCall {
    /// Take the key for `ttl_ms`, trying for up to the wait.
    Lock {
        /// The key, the caller's connection, how long to keep trying.
        at: crate::lock::fence::Waiting,
        /// The lease, ms.
        ttl_ms: u64,
    },
    /// Release `key` if `token` still holds it.
    Unlock {
        /// The lock key.
        key: Bytes,
        /// The fencing token.
        token: Bytes,
    },
    /// Wait until `key` no longer holds `token`, at most `timeout`.
    Watch {
        /// The lock key.
        key: Bytes,
        /// The fencing token.
        token: Bytes,
        /// The longest wait.
        timeout: std::time::Duration,
    },
    /// Take a shared, reentrant or counted grant of one key (see
    /// [`crate::lock::kinds`]).
    Kind(crate::lock::kinds::KindCall),
    /// Take every key or none, each an exclusive lock with its own token.
    Multi {
        /// The keys, at least two, none twice.
        keys: Vec<Bytes>,
        /// The first key, the caller's connection, how long to keep trying.
        at: crate::lock::fence::Waiting,
        /// The lease, ms.
        ttl_ms: u64,
    },
    /// Extend `key` to `ttl_ms` if `token` still holds it.
    Extend {
        /// The lock key.
        key: Bytes,
        /// The fencing token.
        token: Bytes,
        /// The new lease, ms.
        ttl_ms: u64,
    },
}

impl LockService {
    /// True when lock keys live on the lock masters, not on the primary:
    /// what the router routes by (a client's command never reaches the
    /// masters) and the operators' views show.
    pub(crate) fn on_masters(&self) -> bool {
        self.store.quorum.is_some()
    }

    /// The lock masters, for the operators' read-only views (`LOCKGATE
    /// MASTERS`, the status page, `/metrics`, `/readyz`).
    pub fn quorum(&self) -> Option<&Arc<Quorum>> {
        self.store.quorum.as_ref()
    }

    /// The primary refuses scripts, as last seen: lock operations run as
    /// transactions of lockgate's own ([`super::txn`]), and inside `MULTI`
    /// lockgate queues them itself (the router asks).
    pub fn scriptless(&self) -> bool {
        self.store.quorum.is_none() && self.store.primary.scriptless()
    }

    /// Lock operations as transactions on a server that refuses scripts
    /// (`None`: a store that reaches nothing), for its counters.
    pub fn transactions(&self) -> Option<&Arc<super::txn::Transactions>> {
        self.store.primary.txn.as_ref()
    }

    /// The lock room's counters and its store's, in the order `/metrics`
    /// exports them: the room's, the storm room's, the eviction checks',
    /// the quorum's sit-out counters, clock jumps and `NOSCRIPT` reruns (0
    /// without a quorum, so dashboards see one set).
    pub(crate) fn each_counter(&self, mut f: impl FnMut(Counter<'_>)) {
        static NO_QUORUM: AtomicU64 = AtomicU64::new(0);
        let no_rejoin = RejoinMetrics::default();
        let no_txn = TxnMetrics::default();
        let q = self.store.quorum.as_deref();
        let txn = self.store.primary.txn.as_deref();
        let rooms = [
            self.metrics.counters(),
            self.storm.metrics.counters(),
            self.store.eviction.metrics.counters(),
            q.map_or(&no_rejoin, |q| &*q.rejoin).counters(),
            txn.map_or(&no_txn, |t| &t.metrics).counters(),
            self.store.replicas.metrics.counters(),
        ];
        rooms.into_iter().flatten().for_each(&mut f);
        f(Counter {
            name: "lock_quorum_clock_jumps",
            stats_name: "lock_quorum_clock_jumps",
            help: "Lock master clock jumps seen (the master sat out acquisitions)",
            kind: Kind::Counter,
            value: q.map_or(&NO_QUORUM, |q| &q.clock.jumps),
        });
        f(Counter {
            name: "lock_quorum_noscript_reruns",
            stats_name: "lock_quorum_noscript_reruns",
            help: "Scripts a lock master answered NOSCRIPT, run again there as EVAL",
            kind: Kind::Counter,
            value: q.map_or(&NO_QUORUM, |q| &*q.noscript_reruns),
        });
    }

    /// Whether acquisitions go as `MSETEX` now: the primary's server has
    /// it, as lockgate's own connection to it last saw (see
    /// [`super::fast::Natives`]).
    pub fn native_msetex(&self) -> bool {
        self.store.natives.msetex()
    }

    /// The store (lockgate's own connection to the primary).
    pub(crate) fn store(&self) -> &Store {
        &self.store
    }

    /// The one call a session makes for a lock command `op`, whatever the
    /// store: refused (eviction), answered early (absorbed, delayed,
    /// parked), held after a failover, planned onto the client's own
    /// connection, or carried out away from it on the quorum.
    pub(crate) fn attempt(self: &Arc<Self>, op: &LockOp, seat: Seat<'_>) -> Attempt {
        let attempt = self.attempt_on_store(op, seat);
        let sent = !matches!(
            attempt,
            Attempt::Refused(_) | Attempt::Early(_) | Attempt::Held(_)
        );
        if sent && matches!(op, LockOp::Acquire { .. }) {
            crate::metrics::ProxyMetrics::inc(&self.metrics.attempts_sent);
        }
        attempt
    }

    /// [`Self::attempt`], uncounted.
    fn attempt_on_store(self: &Arc<Self>, op: &LockOp, seat: Seat<'_>) -> Attempt {
        if let Some(reply) = self.refused_on_cluster(op.lock_keys()) {
            return Attempt::Refused(reply);
        }
        // `locks.require_noeviction`: no lease granted or extended on a
        // primary that may evict it (one relaxed load when off).
        if let Some(reply) = self.refused_for_eviction(op) {
            return Attempt::Refused(reply);
        }
        // Nodes of the cluster disagreeing about the lock's slot
        // (`locks.require_one_primary`; releases pass).
        if !matches!(op, LockOp::Release { .. }) {
            let mut keys = op.lock_keys();
            if let Some(reply) = keys.find_map(|k| self.refused_for_dispute(k)) {
                return Attempt::Refused(reply);
            }
        }
        let acquirer = || -> Arc<dyn Acquirer> { self.clone() };
        if seat.ahead && !seat.in_multi {
            if let Some(early) = self.behind_attempt(op, seat.conn) {
                return Attempt::Early(early);
            }
        }
        if let Some(q) = &self.store.quorum {
            let tracked = !seat.in_multi && seat.settled;
            let park = match self.admit(op, seat.conn, tracked, seat.last, acquirer) {
                Ok(go) => go.park,
                Err(early) => return Attempt::Early(early),
            };
            let (me, q, op, conn) = (self.clone(), q.clone(), op.clone(), seat.conn.clone());
            return Attempt::Away(Box::pin(async move {
                me.quorum_attempt(&q, op, conn, park, me.clone()).await
            }));
        }
        if let LockOp::Acquire { key, shape, .. } = op {
            if self.held_after_failover(key) {
                return Attempt::Held(super::failover::held_answer(*shape, seat.in_multi));
            }
        }
        if let LockOp::Release { lock_keys, .. } = op {
            self.releasing(lock_keys, sync::lock(seat.conn).id);
        }
        // The contention table describes database 0 only.
        let db = Database::of(seat.db);
        let tracked = !seat.in_multi && db == Database::Zero && seat.settled;
        let (park, check) = match self.admit(op, seat.conn, tracked, seat.last, acquirer) {
            Ok(go) => (go.park, go.check),
            Err(early) => return Attempt::Early(early),
        };
        let queueing = match seat.in_multi {
            true => Queueing::InMulti,
            false => Queueing::Now,
        };
        // On a server that refuses scripts the general plan runs as a
        // transaction away from the connection (see `super::txn`).
        let scriptless = self.store.primary.scriptless();
        // A native call (and a plain probe) needs its outcome read (its
        // fallback) and a database to run the fallback in.
        let native = !seat.silent && seat.db != u64::MAX;
        // A probe of a lock known held as a plain PTTL (not in front of a
        // cluster, whose connections route lockgate's own commands apart).
        // Only with nothing pipelined behind it: should the lock be free,
        // the acquisition runs in its place on lockgate's own connection,
        // and commands sent behind it would run first.
        let check =
            check && native && seat.last && !scriptless && self.store.primary.cluster.is_none();
        let (planned, fast) = {
            let mut conn = sync::lock(seat.conn);
            // Seen before planning: planning records the attempt.
            let fast = match queueing {
                Queueing::Now if !scriptless && !check => self.fast_path(op, &conn, native),
                _ => None,
            };
            let compact = matches!(fast, Some(super::fast::Before::Acquire));
            (
                self.plan_on_primary(op.clone(), &mut conn, queueing, db, compact),
                fast,
            )
        };
        let mut pending = planned.pending;
        // The acquisition's park settings, every other field as planned.
        if let Some(LockPending::Acquire { park: p, .. }) = &mut pending {
            *p = park;
        }
        let planned = super::Planned {
            call: planned.call,
            pending,
        };
        if seat.in_multi {
            let acked = (planned.pending).filter(|p| self.acked_in_tx(p));
            return Attempt::Queued {
                call: planned.call,
                acked,
            };
        }
        if scriptless {
            return self.as_transaction(planned, seat);
        }
        let planned = match check {
            true => match self.check(op, planned) {
                Ok(attempt) => return attempt,
                Err(planned) => *planned,
            },
            false => planned,
        };
        let planned = match fast {
            Some(super::fast::Before::Native) => match self.native(op, planned) {
                Ok(attempt) => return attempt,
                Err(planned) => *planned,
            },
            Some(before) => self.fast(op, before, planned),
            None => planned,
        };
        match planned.pending {
            Some(pending) => Attempt::OnConnection {
                call: planned.call,
                pending,
            },
            // Planned without an outcome to read: only inside MULTI.
            None => Attempt::Queued {
                call: planned.call,
                acked: None,
            },
        }
    }

    /// `planned` carried out as a transaction on lockgate's own connections
    /// in the client's database, away from the client's connection: the
    /// server refuses scripts ([`super::txn`]). Learned as the script's
    /// reply would be; a parked attempt waits for its handoff, never past
    /// the server's drain.
    fn as_transaction(self: &Arc<Self>, planned: super::Planned, seat: Seat<'_>) -> Attempt {
        if seat.db == u64::MAX {
            return Attempt::Refused(LocalReply::err(
                "lockgate: lock command refused: the connection's database is unknown, and the server refuses scripts",
            ));
        }
        let (me, conn, db) = (self.clone(), seat.conn.clone(), seat.db);
        let command = planned.call.evalsha();
        Attempt::Transaction(Box::pin(async move {
            let store = me.store();
            let acquirer = || -> Arc<dyn Acquirer> { me.clone() };
            let run = async {
                let frame = store.primary.transaction(command, db, store.timeout).await;
                match (frame, planned.pending) {
                    (Ok(frame), Some(p)) => me.own_outcome(p, frame, &conn, acquirer).await,
                    (Ok(frame), None) => evalsha::own_reply(frame),
                    (Err(e), pending) => {
                        let text = format!("ERR lockgate: lock transaction failed: {e}");
                        // Nothing learned: settled as after an error.
                        if let Some(p) = pending {
                            let frame =
                                LocalReply::Error(Bytes::from(text.clone())).to_bytes(false);
                            let _ = me.on_reply(p, frame, &conn, acquirer);
                        }
                        LocalReply::Error(Bytes::from(text))
                    }
                }
            };
            tokio::select! {
                reply = run => reply,
                _ = store.stopped() => LocalReply::err("lockgate: shutting down"),
            }
        }))
    }

    /// A lock operation carried out by lockgate for a client, away from its
    /// connection (a transaction's lock commands run at `EXEC` on the
    /// quorum); on one Redis, through lockgate's own connection.
    pub(crate) async fn run(
        self: &Arc<Self>,
        op: LockOp,
        conn: Arc<Mutex<ConnLocks>>,
    ) -> LocalReply {
        match &self.store.quorum {
            Some(q) => self.on_quorum(q, op, conn).await,
            None => {
                let planned = self.plan(op, &mut sync::lock(&conn), Queueing::Now);
                let Some(pending) = planned.pending else {
                    return LocalReply::err("lockgate: internal error (no outcome planned)");
                };
                let request = planned.call.request();
                match self.store.primary.send(request, self.store.timeout).await {
                    Ok(frame) => {
                        let acquirer = || -> Arc<dyn Acquirer> { self.clone() };
                        self.own_outcome(pending, frame, &conn, acquirer).await
                    }
                    Err(e) => LocalReply::err(format!("lockgate: {e}")),
                }
            }
        }
    }

    /// A read of lock keys (`GET`, `EXISTS`, `TTL`…) answered by the store:
    /// the quorum's majority; on one Redis, its own answer.
    pub(crate) async fn read(&self, command: Bytes) -> LocalReply {
        match &self.store.quorum {
            Some(q) => self.quorum_read(q, command).await,
            None => self.on_primary(command).await,
        }
    }

    /// A client script on lock keys only (`args` as sent, `EVAL`/`EVALSHA`
    /// first), run where the locks live (on the quorum: on every master,
    /// by its body where a master lost it); what this instance knew of
    /// its lock keys is dropped once it has run (it may release them), and
    /// the records of `conn` (the connection that sent it) follow (see
    /// [`super::lease::ConnLocks::scripted`]).
    pub(crate) fn eval(
        self: &Arc<Self>,
        args: &[&[u8]],
        conn: Arc<std::sync::Mutex<super::lease::ConnLocks>>,
    ) -> Later {
        let command = encode::command(args);
        let fallback = self
            .store
            .quorum
            .as_ref()
            .and_then(|q| q.eval_fallback(args));
        let touched = self.script_lock_keys(args).unwrap_or_default();
        let me = self.clone();
        Box::pin(async move {
            let reply = match &me.store.quorum {
                Some(q) => me.quorum_eval(q, command, fallback).await,
                None => me.on_primary(command).await,
            };
            for key in &touched {
                me.released(key);
                crate::sync::lock(&conn).scripted(key);
            }
            reply
        })
    }

    /// The lock keys among the keys of the `EVAL`-family command `args`
    /// (name first), if any.
    pub(crate) fn script_lock_keys(&self, args: &[&[u8]]) -> Option<Vec<Bytes>> {
        let n: usize = std::str::from_utf8(args.get(2)?).ok()?.parse().ok()?;
        let keys: Vec<Bytes> = (args.iter().skip(3).take(n))
            .filter(|k| self.is_lock_key(k))
            .map(|k| Bytes::copy_from_slice(k))
            .collect();
        (!keys.is_empty()).then_some(keys)
    }

    /// A script body a client sent (`EVAL`, or `SCRIPT LOAD` when `load`):
    /// remembered for lock masters that lost it, and a `SCRIPT LOAD`ed body
    /// loaded on every master (see [`crate::lock::quorum::scripts`]); with
    /// guards, remembered for a guarded `EVALSHA`
    /// ([`LockService::remember_script`]). On one Redis, nothing else to
    /// do: the client's own connection carries it.
    pub(crate) fn script_seen(&self, body: &[u8], load: bool) {
        self.remember_script(body);
        if !self.listing_scripts.seen(body) {
            crate::metrics::ProxyMetrics::inc(&self.metrics.listing_scripts_full);
        }
        let Some(q) = &self.store.quorum else { return };
        q.remember_script(body);
        if load {
            q.load_script_everywhere(body, &self.store.stop);
        }
    }

    /// The lock keys' part of a command split between the store and the
    /// primary: the owner-checked release of the lock keys (`DEL`,
    /// `UNLINK`), their count (`EXISTS`, `TOUCH`), or their values, one
    /// read per key (`MGET`).
    pub(crate) async fn split_part(
        self: &Arc<Self>,
        split: &Split,
        conn: Arc<Mutex<ConnLocks>>,
    ) -> LocalReply {
        let keys = split.lock_keys();
        match (split.name, split.merge_kind()) {
            ("DEL" | "UNLINK", _) => {
                let op = LockOp::Release {
                    lock_keys: keys,
                    plain: Vec::new(),
                    unlink: split.name == "UNLINK",
                    by_value: None,
                };
                self.run(op, conn).await
            }
            (_, Merge::Sum) => {
                let mut args: Vec<&[u8]> = vec![split.name.as_bytes()];
                args.extend(keys.iter().map(|k| &k[..]));
                self.read(encode::command(&args)).await
            }
            (_, Merge::Values) => {
                let reads = keys
                    .iter()
                    .map(|k| self.read(encode::command(&[b"GET", &k[..]])));
                let mut values = Vec::with_capacity(keys.len());
                for value in join_all(reads).await {
                    match value {
                        // MGET answers nil for a key holding another type.
                        LocalReply::Error(e) if e.starts_with(b"WRONGTYPE") => {
                            values.push(LocalReply::Null)
                        }
                        LocalReply::Error(e) => return LocalReply::Error(e),
                        v => values.push(v),
                    }
                }
                LocalReply::Array(values)
            }
        }
    }

    /// The fencing-token API (`LOCKGATE LOCK | UNLOCK | EXTEND`) where the
    /// locks live; on one Redis, held after a failover and refused on an
    /// evicting primary as any acquisition.
    pub(crate) async fn fence(&self, call: FenceCall) -> LocalReply {
        let timeout = self.store.timeout;
        let node = &self.store.primary;
        match (call, &self.store.quorum) {
            // Read where the locks live, whichever store.
            (
                FenceCall::Watch {
                    key,
                    token,
                    timeout,
                },
                _,
            ) => self.fence_watch(key, token, timeout).await,
            (FenceCall::Kind(call), _) => self.fence_kind(call).await,
            (FenceCall::Multi { keys, at, ttl_ms }, _) => self.fence_multi(keys, at, ttl_ms).await,
            (FenceCall::Lock { at, ttl_ms }, Some(q)) => {
                self.quorum_fence_lock(q, at, ttl_ms).await
            }
            // Every kind of grant's release and extension.
            (FenceCall::Unlock { key, token }, Some(q)) => {
                let reply = self
                    .quorum_fence_simple(q, crate::lock::kinds::unlock_command(&key, &token))
                    .await;
                if reply == LocalReply::Integer(1) {
                    self.released(&key);
                }
                reply
            }
            (FenceCall::Extend { key, token, ttl_ms }, Some(q)) => {
                let extend = crate::lock::kinds::extend_command(&key, &token, ttl_ms);
                self.quorum_fence_simple(q, extend).await
            }
            (FenceCall::Lock { at, .. }, None) if self.held_after_failover(&at.key) => {
                LocalReply::Null
            }
            (FenceCall::Lock { at, ttl_ms }, None) => {
                match (self.eviction_refusal()).or_else(|| self.refused_for_dispute(&at.key)) {
                    Some(refused) => refused,
                    None => self.fence_lock(node, at, ttl_ms, timeout).await,
                }
            }
            // The release and extension of every kind of grant.
            (FenceCall::Unlock { key, token }, None) => {
                self.kind_unlock(node, key, token, timeout).await
            }
            (FenceCall::Extend { key, token, ttl_ms }, None) => {
                match (self.eviction_refusal()).or_else(|| self.refused_for_dispute(&key)) {
                    Some(refused) => refused,
                    None => self.kind_extend(node, key, token, ttl_ms, timeout).await,
                }
            }
        }
    }

    /// With `locks.require_noeviction` and no quorum, the refusal of a lock
    /// command that would grant or extend a lease on a primary whose
    /// `maxmemory-policy` (as read from the primary in force) is not
    /// `noeviction`; releases are never refused. Counted and logged.
    fn refused_for_eviction(&self, op: &LockOp) -> Option<LocalReply> {
        if matches!(op, LockOp::Release { .. }) {
            return None;
        }
        // One relaxed load each on the path of every lock command when off.
        if self.store.eviction.required() {
            return self.eviction_refusal();
        }
        if !self.safety_on.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        self.safety_refusal()
    }

    /// With `locks.require_noeviction` and no quorum, the refusal of any
    /// lease on the primary in force, unless its `maxmemory-policy` reads
    /// `noeviction` (see [`crate::lock::eviction::Eviction::refusal`]).
    pub(crate) fn eviction_refusal(&self) -> Option<LocalReply> {
        let store = &self.store;
        if !store.eviction.required() || store.quorum.is_some() {
            return None;
        }
        let primary = store.primary_addr.addr();
        store
            .eviction
            .refusal(primary.as_deref(), &store.primary_memory)
            .or_else(|| self.safety_refusal())
    }

    /// With `locks.require_min_replicas`, `locks.require_persistence` or
    /// `locks.require_one_primary` and no quorum, the refusal of any lease
    /// on the primary in force, unless its latest reading satisfies them
    /// ([`super::eviction::safety::refused_because`]); counted, logged
    /// (rate-limited).
    fn safety_refusal(&self) -> Option<LocalReply> {
        let text = self.safety_refused_because()?;
        let store = &self.store;
        ProxyMetrics::inc(&store.eviction.metrics.safety_refused);
        if let Some(more) = store.primary_memory.safety.refuse_warn.check() {
            tracing::warn!(reason = %text, suppressed = more, "lock command refused");
        }
        Some(LocalReply::err(text))
    }

    /// Why lock grants on the primary are refused by
    /// `locks.require_min_replicas` / `_persistence` / `_one_primary` now
    /// (`None`: they are not, or the locks live on the quorum).
    pub fn safety_refused_because(&self) -> Option<String> {
        let rules = self.rules();
        let store = &self.store;
        if !rules.required.any() || store.quorum.is_some() {
            return None;
        }
        let primary = store.primary_addr.addr();
        let safety = &store.primary_memory.safety;
        super::eviction::safety::refused_because(
            rules.required,
            safety.reading(),
            &safety.formers.still_primaries(),
            &safety.writable.writable(),
            primary.as_deref().unwrap_or("(none)"),
        )
    }

    /// While acquisitions on the primary are held after a switch of the
    /// primary (`locks.failover_delay_ms`; never with the quorum, whose
    /// masters hold the locks): counts one refused acquisition of `key`,
    /// logs it (rate-limited), and returns true.
    pub(crate) fn held_after_failover(&self, key: &[u8]) -> bool {
        let store = &self.store;
        if store.quorum.is_some() {
            return false;
        }
        if let Some(cluster) = &store.primary.cluster {
            let Some(left) = cluster.hold_left(key, self.failover_delay()) else {
                return false;
            };
            // Acknowledged by the shard's replica, and the promoted one
            // vouched for: nothing to hold (`replicas::promoted`).
            if self.unheld_after_promotion(cluster, key) {
                return false;
            }
            let why = "lock acquisition answered 'not acquired': the shard's replica was promoted, and a lock granted on the old primary may not have been replicated (locks.failover_delay_ms)";
            return self.held_back(&cluster.metrics().failover_held, key, left, why);
        }
        let refused = &store.primary_addr.metrics.failover_refused;
        // The primary restarted: its locks may be gone, as after a
        // failover to a replica that lacked them.
        let restart = &store.primary_memory.safety;
        if let Some(left) = restart.restart_hold_left_fast(|| self.failover_delay()) {
            let why = "lock acquisition answered 'not acquired': the primary restarted, and the locks it held may be gone (locks.failover_delay_ms)";
            return self.held_back(refused, key, left, why);
        }
        let Some(left) = store.primary_addr.hold_left(self.failover_delay()) else {
            return false;
        };
        // Acknowledged by the replicas, and the promoted one vouched for:
        // nothing to hold (`replicas::switch`).
        if self.unheld_after_switch(key) {
            return false;
        }
        let why = "lock acquisition answered 'not acquired': the primary changed, and a lock granted on the old one may not have been replicated (locks.failover_delay_ms)";
        self.held_back(refused, key, left, why)
    }

    /// Counts in `counter` one acquisition of `key` held back, `left` of
    /// its hold to go, and logs `why` (rate-limited): true.
    fn held_back(&self, counter: &AtomicU64, key: &[u8], left: Duration, why: &str) -> bool {
        ProxyMetrics::inc(counter);
        if let Some(more) = self.store.primary_addr.warn.check() {
            tracing::warn!(
                key = %String::from_utf8_lossy(key),
                left_ms = left.as_millis() as u64,
                suppressed = more,
                "{why}"
            );
        }
        true
    }

    /// `command` on lockgate's own connection to the primary, its reply as
    /// it came (an error in it included).
    async fn on_primary(&self, command: Bytes) -> LocalReply {
        match self.store.primary.call(command, self.store.timeout).await {
            Ok(reply) => LocalReply::Raw(reply),
            Err(e) => LocalReply::err(format!("lockgate: {e}")),
        }
    }
}

impl Acquirer for LockService {
    fn acquire(&self, ask: Ask) -> Pin<Box<dyn Future<Output = Tried> + Send + '_>> {
        Box::pin(async move {
            // After a switch of the primary, no acquisition on its behalf
            // either (`locks.failover_delay_ms`; never with the quorum).
            if self.held_after_failover(&ask.key) {
                return Tried::FAILED;
            }
            // Nor on a primary that may evict the lock
            // (`locks.require_noeviction`), nor in a slot the cluster's
            // nodes disagree about: tried again at the next probe.
            if self.eviction_refusal().is_some() || self.refused_for_dispute(&ask.key).is_some() {
                return Tried::FAILED;
            }
            let store = &self.store;
            self.acquire_on_behalf(store.quorum.as_deref(), &store.primary, store.timeout, ask)
                .await
        })
    }

    fn stopped(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(self.store.stop.cancelled())
    }
}
