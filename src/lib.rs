//! lockgate: a Redis sidecar proxy that makes the unsafe locks of legacy
//! apps safe with zero code change.
//!
//! An app points its Redis client at lockgate instead of Redis. lockgate
//! speaks RESP, passes every ordinary command through byte for byte on a
//! dedicated upstream connection per client (or over a few shared ones,
//! `proxy.upstream = "shared"`: [`upstream::shared`]), and takes over commands on
//! lock keys: a bare `SETNX` becomes an atomic lease with an owner record,
//! and releases and extensions are owner-checked. What an app sees, and
//! where lockgate differs from Redis on purpose, is in `docs/behaviour.md`
//! (what lock keys get, in `docs/locks.md`); what holds under pauses, restarts, clock steps and
//! several instances is in `docs/faults.md` (the quorum's restarts and
//! fencing in `docs/quorum.md`, clocks in `docs/clocks.md`); TLS on both
//! sides in `docs/tls.md`; following a primary through Redis Sentinel, and
//! what locks keep across its failover, in `docs/sentinel.md`; a Redis
//! Cluster behind lockgate in `docs/cluster.md`; what it
//! costs next to HAProxy and Redis, and where the time goes, in
//! `docs/performance.md`; writes to the data a lock protects, refused or
//! counted once the writer's lease ended, in `docs/guarded-writes.md`.
//!
//! # Layout
//!
//! One line per top-level module; each module's own doc has its detail.
//!
//! - [`config`]: the configuration tree, its defaults and `validate()`.
//! - [`error`]: [`error::ErrorSource`], the client/upstream/internal tag.
//! - [`shutdown`]: SIGTERM/SIGINT → graceful drain.
//! - [`context`]: [`context::ServerContext`], what every part shares.
//! - [`server`]: the accept loop, `max_clients`, the drain.
//! - [`loops`]: `--threads N`, one event loop per thread.
//! - [`session`]: one client: reader, dispatcher, writer, deferred jobs.
//! - [`protocol`]: RESP framing, pure, no I/O.
//! - [`command`]: the command table (reply flow, lock relevance, names) and
//!   which commands need a connection of their own ([`command::connection`]).
//! - [`script`]: lockgate's own Lua, one registry: names, bodies, SHA1s,
//!   `ARGV` slots, and which script calls are lockgate's.
//! - [`router`]: pure `(command, session view, lock room) → Fate`, once.
//! - [`lock`]: the lock room (never sees sockets) and the store it hides.
//! - [`admin`]: `LOCKGATE …` over RESP, and its read-only views
//!   ([`admin::views`]).
//! - [`http`]: `/metrics`, `/healthz`, `/readyz`, the status page;
//!   [`history`]: its last minutes, sampled.
//! - [`exposition`]: Prometheus text from every room's counters.
//! - [`sentinel`]: following the primary through Redis Sentinel.
//! - [`cluster`]: Redis Cluster's hash slots, slot map, redirections and
//!   where each command goes (pure).
//! - [`upstream`]: `Connector`, one shared connection per Redis, the primary,
//!   the sessions' shared connections (`proxy.upstream = "shared"`), and
//!   the connections to a cluster's nodes (`[upstream.cluster]`), all
//!   pipelined by one loop (`upstream::link`); a session's upstream is one
//!   of these three ([`upstream::stream`]).
//! - [`tls`]: rustls configurations, reloads, plain-or-TLS streams.
//! - [`metrics`]: the proxy's counters, `counters!`, warning rate limits.
//! - [`sync`]: the one policy for a poisoned std lock.
//!
//! The tests (`tests/`) run against real `redis-server` processes; every
//! helper shared by test files is in one tree, `tests/support/` (its
//! `mod.rs` lists the modules).
//!
//! # The path of a command
//!
//! client bytes → [`session::reader`] hands the read batch to the session's
//! dispatcher (`session::dispatch`), which asks [`protocol::request`] where
//! each command ends, [`command::lookup`] its kind and label, and
//! [`router::decide`] its fate, once: [`router::Fate::Plain`] for the
//! common case, else a route with the session view after it → the reader
//! sends the batch's [`session::pending::Pending`] entries to the writer
//! half, then the client's own bytes to Redis (one write per read batch;
//! in front of shared connections or a cluster, with the
//! [`protocol::frames`] the dispatcher's parse found, so the stream frames
//! and routes the plain commands without parsing them again)
//! → Redis replies →
//! [`session::writer`] finds frame ends with [`protocol::reply`], matches
//! them to entries, and copies the bytes to the client, with lockgate's own
//! replies (errors, admin answers) written in their place in the order.
//!
//! A command on a lock key takes the same road with one detour: the router
//! returns [`router::Route::Lock`], and the dispatcher makes one call to
//! the lock room whatever store holds the locks
//! ([`lock::LockService::attempt`]), which answers it early (absorbed,
//! parked), or plans a script call ([`lock::evalsha`]: `EVALSHA`, after
//! `SCRIPT LOAD` the first time on a connection) that goes up the client's
//! own connection in the command's place (so order costs nothing), and
//! the writer hands the script's `{reply, facts}` answer to
//! [`lock::LockService::outcome`]: the lock
//! room learns the facts ([`lock::LockService::complete`]), settles a
//! handoff the release made, or parks a failed attempt, and tells the
//! writer what to write: the reply with exactly the original command's
//! shape, now, or (parked) later in its place. The writer decides nothing
//! about locks.
//!
//! With a lock quorum, lock commands cannot ride the client's connection:
//! the lock room's answer is work done away from it
//! ([`lock::Attempt::Away`]), and the dispatcher queues it with a
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
// The modules only the crate uses are `pub(crate)`, and the docs link into
// them: they are built with `--document-private-items` (the crate's readers
// are its developers), where such links resolve.
#![allow(rustdoc::private_intra_doc_links)]

pub(crate) mod admin;
pub mod cluster;
pub mod command;
pub mod config;
pub mod context;
pub(crate) mod error;
pub mod exposition;
pub mod history;
pub mod http;
pub mod lock;
pub mod loops;
pub mod metrics;
pub mod protocol;
pub mod router;
pub mod script;
pub(crate) mod sentinel;
pub(crate) mod server;
pub(crate) mod session;
pub mod shutdown;
pub mod sync;
pub(crate) mod tls;
pub(crate) mod upstream;

use std::future::Future;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use config::Config;
pub use context::ServerContext;
/// Reading a cluster's slot map from its seeds, for the tests and tools
/// that check it against a real cluster ([`upstream::cluster::topology`]).
pub use upstream::cluster::topology;

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
        let c = ctx.clone();
        tokio::spawn(async move {
            let read = || history::read(&c.locks, &c.metrics);
            history::run(&c.history, read, &c.stop).await
        });
    }
    if let (Some(cluster), Ok(addr)) = (&ctx.cluster, listener.local_addr()) {
        // Cluster-aware clients are told to come here.
        cluster.set_listen(addr, ctx.locks.instance_prefix());
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
