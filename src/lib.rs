//! lockgate: a Redis sidecar proxy that makes the unsafe locks of legacy
//! apps safe with zero code change.
//!
//! An app points its Redis client at lockgate instead of Redis. lockgate
//! speaks RESP, passes every ordinary command through byte for byte on a
//! dedicated upstream connection per client, and takes over commands on
//! lock keys: a bare `SETNX` becomes an atomic lease with an owner record,
//! and releases and extensions are owner-checked. What an app sees, and
//! where lockgate differs from Redis on purpose, is in `docs/behaviour.md`
//! and the README; what holds under pauses, restarts, clock steps and
//! several instances is in `docs/faults.md` (the quorum's restarts and
//! fencing in `docs/quorum.md`, clocks in `docs/clocks.md`); TLS on both
//! sides in `docs/tls.md`; following a primary through Redis Sentinel, and
//! what locks keep across its failover, in `docs/sentinel.md`; what it
//! costs next to HAProxy and Redis, and where the time goes, in
//! `docs/performance.md`.
//!
//! # Layout
//!
//! - [`config`]: the serde configuration tree, defaults, `validate()`.
//! - [`error`]: [`error::ErrorSource`], the client/upstream/internal tag
//!   every module's error enum carries.
//! - [`shutdown`]: SIGTERM/SIGINT → graceful drain.
//! - [`context`]: [`context::ServerContext`], what sessions, the admin and
//!   the HTTP side share, and the reload of the configuration file.
//! - [`server`]: accept loop, `max_clients`, accept back-off, session
//!   spawning, drain with a grace period.
//! - [`loops`]: `--threads N`: more event loops, one current-thread runtime
//!   per thread, each accepting on its own `SO_REUSEPORT` listener.
//! - [`session`]: one client. [`session::reader`] reads and routes commands
//!   and forwards the client's bytes; [`session::writer`] copies replies
//!   back in order and writes lockgate's own replies between them (generic
//!   over its streams, tested over in-memory pipes; `writer::replies` is
//!   its bookkeeping without I/O, `writer::client` its writes to the
//!   client, bounded by `proxy.client_write_timeout_ms`, and the replies it
//!   reads ahead meanwhile up to `proxy.max_client_output_bytes`), and hands lock
//!   scripts' replies to the lock room through
//!   [`session::writer::LockReplies`]; the reader also enforces the idle
//!   and partial-request timeouts, with [`session::activity`] (what the
//!   writer last wrote, whether the client is exempt from idling, and the
//!   reader's word that the client is gone: a reset, also after its
//!   half-close, ends the writer at once);
//!   `session::detached` serves a client while the primary is
//!   unreachable (the same client timeouts); [`session::linger`] closes a
//!   client after a protocol error without a reset (FIN, then its input
//!   drained, bounded);
//!   `session::branches` gives each part of a session (reader, writer,
//!   job runner, watchdog, primary watcher, shutdown) a waker of its own,
//!   so the session's poll loop polls only the parts that were woken, and
//!   the reader's stop flag (`Stop`: set by the writer's end or shutdown,
//!   checked with a plain load);
//!   [`session::pending`] is what the two halves tell each other;
//!   [`session::jobs`] runs a session's deferred work in command order;
//!   [`session::carry`] carries out the routes of one read batch (what
//!   goes upstream, what the writer must expect);
//!   [`session::parking`] carries out the lock room's decision on an
//!   attempt ([`lock::LockService::admit`]) with the session's acquirer;
//!   [`session::quorum_transaction`] and [`session::quorum_split`] carry out
//!   transactions and split commands on the quorum.
//! - [`protocol`]: pure RESP framing, no I/O: [`protocol::request`] (client
//!   commands, multibulk and inline, limits checked on headers),
//!   [`protocol::reply`] (resumable frame scanner for RESP2/RESP3 replies;
//!   its property test against `redis-protocol` is `reply_props`;
//!   [`protocol::reply::simple_frames`] counts a run of plain replies in
//!   one pass for the writer),
//!   [`protocol::encode`] (replies lockgate writes).
//! - [`command`]: the command table (which commands change the reply flow,
//!   which can touch locks); `command::names` folds a name into an integer
//!   once, for both the kind and the metrics label.
//! - [`router`]: pure `(command, session view, lock patterns) → Route`:
//!   forward, lock operation, refusal, or admin; [`router::forwards_plainly`]
//!   is its shortcut for the common case (a command forwarded as it is,
//!   one reply, the session unchanged), asked first for every command.
//! - [`lock`]: the lock room, which never sees sockets: [`lock::keys`]
//!   (patterns), [`lock::ops`] (commands → ops), [`lock::script`] (the Lua),
//!   [`lock::evalsha`] (scripts by SHA1 on clients' connections: loaded
//!   once per connection, a `NOSCRIPT` run again as `EVAL` on lockgate's
//!   own connection),
//!   [`lock::lease`] (tokens, per-connection records), [`lock::watchdog`]
//!   (renewal, release on disconnect over lockgate's own connection),
//!   [`lock::node`] (lockgate's own shared, pipelined connection to one
//!   Redis; on a lock master its calls go by SHA1 and a `NOSCRIPT` is
//!   sent again as `EVAL` by the connection itself; `node::open`: connect,
//!   authenticate, read `run_id`, uptime and eviction policy, load the lock
//!   scripts), [`lock::eviction`] (each lock store's `maxmemory-policy` and
//!   `evicted_keys`, read as a connection opens and periodically; shown,
//!   warned about, and with `locks.require_noeviction` locks refused on an
//!   evicting primary and an evicting master sat out), [`lock::fence`] (the fencing-token API on one Redis),
//!   [`lock::quorum`] (the Redlock quorum in one folder: majority merges
//!   and the availability errors; `quorum::master`: one master and its
//!   sit-outs after a restart, a reconnection, a clock jump or evictions;
//!   `quorum::ask`: one command to the masters in parallel, the wait ended
//!   once the answer is known; [`lock::quorum::ops`]: Redlock acquisition
//!   and the other ops; [`lock::quorum::fence`]: fencing tokens, never
//!   below the median clock of their voters, so no counter is copied to a
//!   returning master; [`lock::quorum::clock`]: the masters' clocks, a
//!   master whose clock jumps sits out, its vote uncounted, and the
//!   stricter `clock_faults` quorum; [`lock::quorum::scripts`]: client
//!   script bodies remembered for masters that answer `NOSCRIPT`, `SCRIPT
//!   LOAD` on every master),
//!   [`lock::split`] (per-key commands split between the quorum and the
//!   primary: which key goes where, how the answers merge),
//!   [`lock::admit`] (an acquisition's fate before Redis: on to Redis,
//!   absorbed, delayed or parked; counted and fed to the hot keys),
//!   [`lock::storm`] (retry storms: the contention table, probe cap,
//!   parking and FIFO handoff; `storm::key`: one key's rules as a state
//!   machine, `Key::step(event, now)` → actions, with `storm::event` its
//!   events and actions; `storm::driver`: the task that carries them out
//!   for a key with parked attempts; `storm::handoff`: a release through
//!   this instance handing the lock to the oldest parked attempt in the
//!   same script; `storm::tests`: the rules step by step and the driver
//!   under paused time with a scripted acquirer), [`lock::failover`] (the failover delay of acquisitions after the
//!   primary changed), [`lock::announce`] (wake-ups between instances:
//!   each subscribes to its own channel `lockgate:wake:<prefix>`, a
//!   release wakes the head of the key's queue in the store, see
//!   docs/fleet.md),
//!   [`lock::metrics`] (the lock room's counters and the quorum's sit-out
//!   counters, declared with `counters!`), [`lock::hotkeys`] (the bounded
//!   top-K sketch of hot lock keys the lock room feeds; `hotkeys::sketch`:
//!   its slots and histograms),
//!   [`lock::LockService`] (plan an op, learn its outcome; states the
//!   safety invariants); `lock::reply`: [`lock::LockService::on_reply`],
//!   the outcome of a lock script's reply (facts learned, a handoff
//!   settled, a failed attempt parked) as a [`lock::ReplyOutcome`];
//!   [`lock::on_behalf`] (acquisitions away from the client's own
//!   connection: a quorum attempt that may wait for a handoff, a parked
//!   attempt's driver acquiring for its waiter); `lock::forget`: what a
//!   command forwarded as it is changed behind the lock room's back (a
//!   flush, a rename of a lock key, `SCRIPT FLUSH`: a [`lock::Forget`] the
//!   router names), dropped from its view once Redis acknowledged it, and
//!   the database a lock command ran in ([`lock::Database`]: the view
//!   describes database 0).
//! - [`admin`]: `LOCKGATE …` over RESP: the dispatch, counters, the
//!   fencing API (`LOCK | UNLOCK | EXTEND`); [`views`]: `HOTKEYS`, `LOCKS`,
//!   `MASTERS`, `CONFIG`, `RELOAD`.
//! - [`http`]: the operators' HTTP side (`/metrics`, `/healthz`, `/readyz`,
//!   the status page); [`exposition`]: Prometheus text from every room's
//!   counters.
//! - [`sentinel`]: [`sentinel::Primary`], which Redis is the primary now
//!   (fixed, or followed through Redis Sentinel by [`sentinel::follow`]:
//!   `get-master-addr-by-name` confirmed by `ROLE`, `+switch-master`, a
//!   periodic re-check), its switches, and the failover delay of lock
//!   acquisitions after one.
//! - [`upstream`]: [`upstream::Connector`], the one way lockgate connects
//!   to Redis (sessions, its own connections, the masters): a timeout,
//!   TLS when configured, a precise error.
//! - [`tls`]: rustls configurations from the PEM files (checked at
//!   validation), the reloadable [`tls::TlsStore`], the TLS listener's
//!   bounded handshake and its counters; [`tls::stream`]: a connection
//!   that is plain TCP or TLS, and its halves (TLS's share the session
//!   and still reach the socket, to see a reset after a half-close).
//! - [`metrics`]: the proxy's counters, `counters!` (how every room
//!   declares its counters once, for `/metrics` and `STATS` alike) and the
//!   rate limit for repeated warnings.
//! - [`sync`]: the one policy for a poisoned std lock (recover the value).
//!
//! The tests (`tests/`) run against real `redis-server` processes; every
//! helper shared by test files is in one tree, `tests/support/` (its
//! `mod.rs` lists the modules).
//!
//! # The path of a command
//!
//! client bytes → [`session::reader`] asks [`protocol::request`] where the
//! command ends → [`command::lookup`] (kind and label) →
//! [`router::forwards_plainly`], else [`router::route`] → the reader
//! sends a [`session::pending::Pending`] entry to the writer half, then the
//! client's own bytes to Redis (one write per read batch) → Redis replies →
//! [`session::writer`] finds frame ends with [`protocol::reply`], matches
//! them to entries, and copies the bytes to the client, with lockgate's own
//! replies (errors, admin answers) written in their place in the order.
//!
//! A command on a lock key takes the same road with one detour: the router
//! returns [`router::Route::Lock`], [`lock::LockService::plan`] turns it into
//! a script call ([`lock::evalsha`]: `EVALSHA`, after `SCRIPT LOAD` the
//! first time on a connection) that goes up the client's own connection in the command's
//! place (so order costs nothing), and the writer hands the script's
//! `{reply, facts}` answer to [`lock::LockService::on_reply`]: the lock
//! room learns the facts ([`lock::LockService::complete`]), settles a
//! handoff the release made, or parks a failed attempt, and tells the
//! writer what to write: the reply with exactly the original command's
//! shape, now, or (parked) later in its place. The writer decides nothing
//! about locks.
//!
//! With a lock quorum, lock commands cannot ride the client's connection:
//! the reader spawns the quorum operation and queues a
//! [`session::pending::Pending::Deferred`] entry; the writer holds every
//! later reply back until that one is ready, and the reader sends nothing
//! after it upstream until it is done, so replies and effects keep
//! pipeline order. Fencing calls (`LOCKGATE LOCK`) take the same road.
//!
//! Replies that are not one per command are counted too: a subscription
//! command is settled by its confirmations ([`session::pending::Pending::Sub`];
//! published messages pass between replies), and `CLIENT REPLY OFF|SKIP`
//! is followed by the reader ([`router::SessionView::silent`]). Only
//! `MONITOR` and replication copy bytes uncounted, and there a lock command
//! is refused ([`router::RAW_REFUSAL`]).
//!
//! Everything runs on one event loop by default (`--threads 1`), so
//! commands of different connections reach Redis in the order they
//! arrived, as through a byte copier.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod admin;
pub mod command;
pub mod config;
pub mod context;
pub mod error;
pub mod exposition;
pub mod http;
pub mod lock;
pub mod loops;
pub mod metrics;
pub mod protocol;
pub mod router;
pub mod sentinel;
pub mod server;
pub mod session;
pub mod shutdown;
pub mod sync;
pub mod tls;
pub mod upstream;
pub mod views;

use std::future::Future;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use config::Config;
pub use context::ServerContext;

/// Serves clients on `listener` with `config` (already validated) until
/// `shutdown` completes, then drains within `proxy.shutdown_grace_ms`.
/// Tests bind the listener on port 0 and call this directly.
pub async fn run(config: Config, listener: TcpListener, shutdown: impl Future<Output = ()>) {
    run_with(Arc::new(ServerContext::new(config)), listener, shutdown).await
}

/// Like [`run`], with a context the caller keeps (to read its metrics).
pub async fn run_with(
    ctx: Arc<ServerContext>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) {
    run_with_admin(ctx, listener, None, shutdown).await
}

/// Like [`run_with`], also serving the operators' HTTP endpoints on
/// `admin` (see [`http`]).
pub async fn run_with_admin(
    ctx: Arc<ServerContext>,
    listener: TcpListener,
    admin: Option<TcpListener>,
    shutdown: impl Future<Output = ()>,
) {
    run_with_tls(ctx, listener, None, admin, shutdown).await
}

/// Like [`run_with_admin`], also serving TLS clients on `tls` (the
/// `proxy.tls.listen` listener; see [`tls`]).
pub async fn run_with_tls(
    ctx: Arc<ServerContext>,
    listener: TcpListener,
    tls: Option<TcpListener>,
    admin: Option<TcpListener>,
    shutdown: impl Future<Output = ()>,
) {
    run_loops(ctx, listener, tls, admin, shutdown, Vec::new()).await
}

/// [`run_with_tls`], plus one more event loop on its own thread for each
/// entry of `extra` (`--threads N`, see [`loops`]); returns once every
/// loop has drained.
pub async fn run_loops(
    ctx: Arc<ServerContext>,
    listener: TcpListener,
    tls: Option<TcpListener>,
    admin: Option<TcpListener>,
    shutdown: impl Future<Output = ()>,
    extra: Vec<loops::LoopListeners>,
) {
    if let Some(admin) = admin {
        tokio::spawn(http::serve(admin, ctx.clone(), ctx.stop.clone()));
    }
    let token = CancellationToken::new();
    let watcher = {
        let token = token.clone();
        async move {
            tokio::select! {
                _ = shutdown => token.cancel(),
                _ = token.cancelled() => {}
            }
        }
    };
    let others = loops::spawn(extra, &ctx, &token);
    let stop = ctx.stop.clone();
    let serve = async {
        server::serve(listener, tls, ctx, token.clone()).await;
        token.cancel();
        for done in others {
            let _ = done.await;
        }
        stop.cancel();
    };
    tokio::join!(serve, watcher);
}
