//! `LOCKGATE …` commands over RESP, answered by lockgate itself: the
//! operators' counters (`STATS`, `UNMATCHED [n]`), their views
//! ([`crate::admin::views`]), `HELP`, and the lock API for new code
//! ([`crate::admin::fencing`]: `LOCK`, `ACQUIRE`, `UNLOCK`, `EXTEND`,
//! `WATCH`). Replies are records of named fields (see [`crate::admin::views`]).

pub mod fencing;
pub mod views;

use std::sync::Arc;

use bytes::Bytes;

use crate::context::ServerContext;
use crate::lock::conns::ACQUISITION_HEX;
use crate::lock::lease::ConnId;
use crate::lock::operator::{parse_acquisition, Released};
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;
use crate::router::CommandArgs;
use tracing::Instrument;

/// Default number of rows of list answers.
const DEFAULT_ROWS: usize = 20;

/// Work whose reply lockgate writes once it is done (see
/// `session::jobs`): it runs after the session's earlier such work.
pub type Work = crate::lock::Later;

/// An admin answer: ready now, or work to do first.
pub enum AdminReply {
    /// The reply.
    Now(LocalReply),
    /// The reply, once this work is done.
    Later(Work),
}

/// Answers one `LOCKGATE` command.
/// `caller`: the connection it came on (a fencing wait keeps its place in
/// time across its `WAIT`s per connection).
pub fn handle(ctx: &Arc<ServerContext>, args: CommandArgs<'_>, caller: ConnId) -> AdminReply {
    let sub = args.get(1).to_ascii_uppercase();
    match sub.as_slice() {
        b"LOCK" | b"ACQUIRE" | b"UNLOCK" | b"EXTEND" | b"WATCH" => lock_api(ctx, args, caller),
        b"LOCKS" => views::locks(ctx, args.get(2), args.get(3)),
        b"RELEASE" => release(ctx, args),
        _ => AdminReply::Now(counters(ctx, &sub, args)),
    }
}

/// `RELEASE key acquisition`: an operator frees a stuck lock, only if
/// `acquisition` (as `LOCKS` showed it) still holds it. Logged with the
/// connection that asked (the session's span) and counted.
fn release(ctx: &Arc<ServerContext>, args: CommandArgs<'_>) -> AdminReply {
    if args.len() != 4 {
        let usage = "lockgate: usage: LOCKGATE RELEASE key acquisition";
        return AdminReply::Now(LocalReply::err(usage));
    }
    let (key, acquisition) = match release_request(ctx, args.get(2), args.get(3)) {
        Ok(checked) => checked,
        Err(e) => return AdminReply::Now(e),
    };
    let locks = ctx.locks.clone();
    let work = async move {
        match release_outcome(&locks, key, acquisition, "LOCKGATE RELEASE").await {
            Ok(()) => LocalReply::Integer(1),
            Err(e) => e,
        }
    };
    AdminReply::Later(Box::pin(work.in_current_span()))
}

/// Whether `given` is the admin password `want`, compared in time that
/// depends only on the lengths (the status page's release button).
pub fn password_matches(want: &str, given: &str) -> bool {
    let (w, g) = (want.as_bytes(), given.as_bytes());
    let differ = (w.iter().zip(g)).fold(0u8, |acc, (a, b)| acc | (a ^ b));
    w.len() == g.len() && differ == 0
}

/// Checks an operator's release of `key`'s `acquisition` before anything
/// is done: a lock key, served where the locks live, an acquisition id.
pub fn release_request(
    ctx: &ServerContext,
    key: &[u8],
    acquisition: &[u8],
) -> Result<(Bytes, String), LocalReply> {
    if !ctx.locks.is_lock_key(key) {
        return Err(LocalReply::err(format!(
            "lockgate: '{}' is not a lock key (locks.keys); only a lock's acquisition can be released",
            String::from_utf8_lossy(key)
        )));
    }
    if let Some(refused) = ctx.locks.refused_on_cluster([key].into_iter()) {
        return Err(refused);
    }
    let Some(acquisition) = parse_acquisition(acquisition) else {
        return Err(LocalReply::err(format!(
            "lockgate: an acquisition is {ACQUISITION_HEX} hex digits, as LOCKGATE LOCKS shows it"
        )));
    };
    Ok((Bytes::copy_from_slice(key), acquisition))
}

/// Carries out a checked release ([`release_request`]), logs it (`via`:
/// how it was asked; the asking connection is in the caller's span) and
/// says why nothing was released, if nothing was.
pub async fn release_outcome(
    locks: &Arc<crate::lock::LockService>,
    key: Bytes,
    acquisition: String,
    via: &str,
) -> Result<(), LocalReply> {
    let shown = String::from_utf8_lossy(&key).into_owned();
    let outcome = locks.release_acquisition(key, acquisition.clone()).await?;
    let who = match outcome {
        Released::Freed(stores) => {
            tracing::warn!(key = %shown, %acquisition, stores, via, "lock released by an operator");
            return Ok(());
        }
        Released::Free => "nobody",
        Released::Other => "another acquisition",
    };
    tracing::warn!(key = %shown, %acquisition, holder = who, via, "operator's release: nothing released, the acquisition no longer holds the lock");
    Err(LocalReply::err(format!(
        "lockgate: not released: {shown} is no longer held by acquisition {acquisition} ({who} holds it now; see LOCKGATE LOCKS)"
    )))
}

fn counters(ctx: &ServerContext, sub: &[u8], args: CommandArgs<'_>) -> LocalReply {
    match sub {
        b"UNMATCHED" => {
            let n = match rows(args.get(2)) {
                Ok(n) => n,
                Err(e) => return e,
            };
            LocalReply::Array(
                ctx.locks
                    .unmatched_top(n)
                    .into_iter()
                    .map(|(prefix, count)| {
                        views::record(vec![
                            ("prefix", LocalReply::Bulk(prefix)),
                            ("commands", LocalReply::Integer(count as i64)),
                        ])
                    })
                    .collect(),
            )
        }
        b"STATS" => stats(ctx),
        b"HOTKEYS" => match rows(args.get(2)) {
            Ok(n) => views::hotkeys(ctx, n),
            Err(e) => e,
        },
        b"WAITERS" => views::waiters(ctx, args.get(2)),
        b"LAPSES" => match rows(args.get(2)) {
            Ok(n) => views::lapses(ctx, n),
            Err(e) => e,
        },
        b"MASTERS" => views::masters(ctx),
        b"PRIMARY" => views::primary(ctx),
        b"NODES" => views::nodes(ctx),
        b"CONFIG" => views::config(ctx, args.get(2)),
        b"HELP" => help(),
        b"RELOAD" => views::reload(ctx),
        b"AUTH" => LocalReply::Status("OK"),
        _ => LocalReply::err(format!(
            "lockgate: unknown LOCKGATE subcommand '{}'; try LOCKGATE HELP",
            String::from_utf8_lossy(args.get(1))
        )),
    }
}

/// `HELP`: every subcommand and what it answers, a line each (as Redis's
/// `CONFIG HELP` and its kin answer).
fn help() -> LocalReply {
    const LINES: &[&str] = &[
        "LOCKGATE <subcommand> [<arg> ...]. Subcommands are:",
        "STATS",
        "    Every counter /metrics exports, by name.",
        "HOTKEYS [<count>]",
        "    The hottest lock keys (default 20): key, attempts, attempts_per_sec, acquired, absorbed, parked, holder.",
        "LOCKS [<pattern> [<count>]]",
        "    Who holds each held or contended lock key, the most contended first (default 100): key, acquisition, holder, client_addr, client_name, held_ms, lease_left_ms, waiters, oldest_wait_ms.",
        "WAITERS <key>",
        "    The attempts parked here on a key, in hand-on order, then the connections blocked on its lock library's signal list: position, client_addr, client_name, waited_ms, waits.",
        "LAPSES [<count>]",
        "    The latest leases that ran out before their holder released or extended them, newest first (default 20, at most admin.recent_lapses kept): key, client_addr, client_name, held_ms, lease_ms, overrun_ms, found_by, at_unix_ms.",
        "RELEASE <key> <acquisition>",
        "    Free a stuck lock, only if that acquisition (as LOCKS shows it) still holds it.",
        "MASTERS",
        "    Each lock master of the quorum: addr, state, rejoins_in_ms, sits_out_because, maxmemory_policy, evicted_keys, unsafe.",
        "PRIMARY",
        "    The primary in force and its switches.",
        "NODES",
        "    In front of a Redis Cluster, each primary: addr, slots, replicas, state, failover_hold_ms, disputes.",
        "UNMATCHED [<count>]",
        "    Key prefixes of SETNX-like commands no lock pattern matched: prefix, commands.",
        "CONFIG [<pattern>|TOML]",
        "    The configuration in force (secrets masked) by dotted key, or as one TOML document.",
        "RELOAD",
        "    Re-read the configuration file, as SIGHUP does.",
        "AUTH <password>",
        "    Allow LOCKGATE commands on this connection (admin.password).",
        "LOCK <key> <ttl-ms> [WAIT <ms>] [SHARED] [OWNER <id>]",
        "    Take a lock with a fencing token: exclusive, or SHARED with other readers; OWNER makes it reentrant for that owner.",
        "LOCK <key> <key> ... <ttl-ms> [WAIT <ms>]",
        "    Take every key or none, each exclusive with its own token.",
        "ACQUIRE <key> <permits> <ttl-ms> [WAIT <ms>] [OWNER <id>]",
        "    Take one of a semaphore's permits, with its own lease and token.",
        "UNLOCK <key> <token>",
        "    Release what LOCK or ACQUIRE granted (one entry of a reentrant grant).",
        "EXTEND <key> <token> <ttl-ms>",
        "    Extend what LOCK or ACQUIRE granted.",
        "WATCH <key> <token> [TIMEOUT <ms>]",
        "    Wait until a lock taken with LOCK no longer holds its token: 1, or nil at the timeout (at most 60000).",
        "HELP",
        "    This text.",
    ];
    LocalReply::Array(LINES.iter().map(|l| LocalReply::Status(l)).collect())
}

/// Parses a call of the lock API and starts the task that answers it.
fn lock_api(ctx: &Arc<ServerContext>, args: CommandArgs<'_>, caller: ConnId) -> AdminReply {
    let ask = match fencing::parse(&args.all()) {
        Ok(ask) => ask,
        Err(bad) => return AdminReply::Now(LocalReply::err(bad.to_string())),
    };
    if let Some(refused) = ctx.locks.refused_on_cluster(ask.keys().into_iter()) {
        return AdminReply::Now(refused);
    }
    let locks = ctx.locks.clone();
    let call = ask.call(caller);
    AdminReply::Later(Box::pin(async move { locks.fence(call).await }))
}

/// A row count argument: `DEFAULT_ROWS` when absent.
fn rows(arg: &[u8]) -> Result<usize, LocalReply> {
    rows_or(arg, DEFAULT_ROWS)
}

/// A row count argument: `default` when absent, Redis's integer error when
/// not a count.
pub(crate) fn rows_or(arg: &[u8], default: usize) -> Result<usize, LocalReply> {
    if arg.is_empty() {
        return Ok(default);
    }
    std::str::from_utf8(arg)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| LocalReply::err("value is not an integer or out of range"))
}

/// Counters as a record of name and value: every counter `/metrics`
/// exports (see [`ServerContext::each_counter`]).
pub(crate) fn stats(ctx: &ServerContext) -> LocalReply {
    let mut out = Vec::new();
    ctx.each_counter(|c| {
        out.push((
            LocalReply::Bulk(Bytes::from_static(c.stats_name.as_bytes())),
            LocalReply::Integer(ProxyMetrics::get(c.value) as i64),
        ));
    });
    LocalReply::Map(out)
}
