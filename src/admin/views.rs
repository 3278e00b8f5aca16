//! The operators' views over RESP: `LOCKGATE HOTKEYS [n]`, `LOCKS
//! [pattern]`, `MASTERS`, `PRIMARY`, `NODES`, `CONFIG`, `RELOAD` (see
//! [`crate::admin`] for the dispatch and [`crate::http`] for the same
//! facts over HTTP).
//!
//! Every reply describes itself: a thing is a record of named fields (a
//! map under RESP3, field/value pairs under RESP2, as Redis answers
//! `CONFIG GET` or `CLUSTER SHARDS`), and a list is an array of records,
//! so a person at `redis-cli` reads what each number is, and a script
//! looks fields up by name rather than by place.

use bytes::Bytes;

use super::AdminReply;
use crate::context::ServerContext;
use crate::lock::conns::Client;
use crate::lock::operator::LockRow;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;

/// Most rows `LOCKGATE LOCKS` answers.
const MAX_LOCK_ROWS: usize = 1_000;

/// Rows `LOCKGATE LOCKS` answers when not told.
const DEFAULT_LOCK_ROWS: usize = 100;

fn bulk(s: impl Into<Bytes>) -> LocalReply {
    LocalReply::Bulk(s.into())
}

fn text(s: &str) -> LocalReply {
    LocalReply::Bulk(Bytes::copy_from_slice(s.as_bytes()))
}

fn int(n: u64) -> LocalReply {
    LocalReply::Integer(i64::try_from(n).unwrap_or(i64::MAX))
}

/// A record: named fields, in this order (see the module doc).
pub fn record(fields: Vec<(&'static str, LocalReply)>) -> LocalReply {
    LocalReply::Map(
        fields
            .into_iter()
            .map(|(name, value)| (LocalReply::Bulk(Bytes::from_static(name.as_bytes())), value))
            .collect(),
    )
}

/// `HOTKEYS [n]`: the hottest lock keys, hottest first, a record each:
/// `key`, `attempts` (Space-Saving estimate: never below the truth),
/// `attempts_per_sec` (decimal text), `acquired`, `absorbed` (attempts
/// answered without Redis), `parked` (attempts waiting here now),
/// `holder` (`this instance`, `another client`, `-`: none known).
pub fn hotkeys(ctx: &ServerContext, n: usize) -> LocalReply {
    LocalReply::Array(
        ctx.locks
            .hot
            .top(n)
            .into_iter()
            .map(|h| {
                let holder = ctx.locks.storm.holder(&h.key).unwrap_or("-");
                let parked = ctx.locks.storm.waiting(&h.key) as u64;
                record(vec![
                    ("key", bulk(h.key.clone())),
                    ("attempts", int(h.count)),
                    ("attempts_per_sec", text(&format!("{:.1}", h.rate_per_sec))),
                    ("acquired", int(h.acquired)),
                    ("absorbed", int(h.absorbed)),
                    ("parked", int(parked)),
                    ("holder", text(holder)),
                ])
            })
            .collect(),
    )
}

/// `LOCKS [pattern [count]]`: who holds each lock key matching `pattern`
/// (default `*`) that this instance knows held or has attempts parked
/// on, or that one of its connections holds, the most contended first, at
/// most `count` (default 100, at most 1 000): a record each (see
/// [`lock_row`]). The holders are read from the store, so the answer comes
/// once they are in.
pub fn locks(ctx: &ServerContext, pattern: &[u8], count: &[u8]) -> AdminReply {
    let pattern = Bytes::copy_from_slice(if pattern.is_empty() { b"*" } else { pattern });
    let max = match super::rows_or(count, DEFAULT_LOCK_ROWS) {
        Ok(n) => n.min(MAX_LOCK_ROWS),
        Err(e) => return AdminReply::Now(e),
    };
    let locks = ctx.locks.clone();
    AdminReply::Later(Box::pin(async move {
        let rows = locks.lock_rows(pattern, max).await;
        LocalReply::Array(rows.into_iter().map(lock_row).collect())
    }))
}

/// An integer, or null where there is nothing to say.
fn or_null(v: Option<u64>) -> LocalReply {
    v.map_or(LocalReply::Null, int)
}

/// A connection's `client_addr` and `client_name` fields (empty for
/// none: another instance's, or closed).
fn client_fields(client: Option<&Client>) -> (LocalReply, LocalReply) {
    match client {
        Some(c) => (text(&c.addr), bulk(c.name.clone())),
        None => (text(""), text("")),
    }
}

/// One row of `LOCKS`: `key`, `acquisition` (what `LOCKGATE RELEASE`
/// takes; empty when the key has no owner record), `holder` (`this
/// instance`, `another instance`, `outside lockgate`: the key exists
/// without an owner record, `nobody`, `unknown`: the store did not
/// answer), `client_addr` and `client_name` (when a connection of this
/// instance holds it; empty otherwise), `held_ms` (since that connection
/// acquired it; null otherwise), `lease_left_ms` (the key's PTTL in the
/// store; null: no lease known), `waiters` (attempts parked here),
/// `oldest_wait_ms` (how long the first of them has waited since its
/// connection first tried; null: none), `kind` (`exclusive`, `shared`,
/// `owned`, `permits`; empty: not held, or unknown), `holders`,
/// `entries` and `writers_waiting` (of a shared, owned or counted lock;
/// null otherwise). Holder `holders`: shared, owned or counted holders.
/// A pattern without wildcards (one key) lists that key always.
pub fn lock_row(r: LockRow) -> LocalReply {
    let (addr, name) = client_fields(r.client.as_ref());
    record(vec![
        ("key", bulk(r.key)),
        ("acquisition", text(&r.acquisition)),
        ("holder", text(r.holder.as_str())),
        ("client_addr", addr),
        ("client_name", name),
        ("held_ms", or_null(r.held_ms)),
        ("lease_left_ms", or_null(r.lease_left_ms)),
        ("waiters", int(r.waiters as u64)),
        ("oldest_wait_ms", or_null(r.oldest_wait_ms)),
        ("kind", text(r.kind)),
        ("holders", or_null(r.holders)),
        ("entries", or_null(r.entries)),
        ("writers_waiting", or_null(r.writers_waiting)),
    ])
}

/// `WAITERS key`: the attempts parked on this instance for `key`, in the
/// order the lock will be handed on, a record each: `position` (1 first),
/// `client_addr`, `client_name`, `waited_ms` (since its connection first
/// tried), `waits` (`parked`); then the connections blocked on the key's
/// lock-library signal list (python-redis-lock's `BLPOP`, see
/// `lock::wake`), the longest waiting first, `position` null (the library
/// decides who goes next) and `waits` `BLPOP <list>`.
pub fn waiters(ctx: &ServerContext, key: &[u8]) -> LocalReply {
    if key.is_empty() {
        return LocalReply::err("lockgate: usage: LOCKGATE WAITERS key");
    }
    let row = |position: LocalReply, client: Option<&Client>, waited_ms: u64, waits: &str| {
        let (addr, name) = client_fields(client);
        record(vec![
            ("position", position),
            ("client_addr", addr),
            ("client_name", name),
            ("waited_ms", int(waited_ms)),
            ("waits", text(waits)),
        ])
    };
    let parked = (ctx.locks.waiter_rows(key).into_iter().enumerate())
        .map(|(i, w)| row(int(i as u64 + 1), w.client.as_ref(), w.waited_ms, "parked"));
    let blocked = ctx.locks.listener_rows(key).into_iter().map(|l| {
        let waits = format!("BLPOP {}", String::from_utf8_lossy(&l.list));
        row(LocalReply::Null, Some(&l.client), l.waited_ms, &waits)
    });
    LocalReply::Array(parked.chain(blocked).collect())
}

/// `LAPSES [n]`: the latest leases that ran out before their holder
/// released or extended them, newest first (see
/// [`crate::lock::lapses`]): key, client, how long it was held, its lease,
/// the overrun, what found it, when.
pub fn lapses(ctx: &ServerContext, n: usize) -> LocalReply {
    LocalReply::Array(
        (ctx.locks.lapses.recent().into_iter().take(n))
            .map(|l| {
                let (addr, name) = client_fields(l.client.as_ref());
                record(vec![
                    ("key", LocalReply::Bulk(l.key)),
                    ("client_addr", addr),
                    ("client_name", name),
                    ("held_ms", int(l.held_ms)),
                    ("lease_ms", int(l.lease_ms)),
                    ("overrun_ms", int(l.overrun_ms)),
                    ("found_by", text(l.during)),
                    ("at_unix_ms", int(l.at_unix_ms)),
                ])
            })
            .collect(),
    )
}

/// The latest lapses as the status page shows them (`/status.json`
/// `lapses`), newest first.
pub fn lapses_json(ctx: &ServerContext) -> Vec<serde_json::Value> {
    (ctx.locks.lapses.recent().into_iter())
        .map(|l| {
            let client = l.client.as_ref();
            serde_json::json!({
                "key": String::from_utf8_lossy(&l.key),
                "client_addr": client.map(|c| c.addr.clone()),
                "client_name": client.map(|c| String::from_utf8_lossy(&c.name).into_owned()),
                "held_ms": l.held_ms,
                "lease_ms": l.lease_ms,
                "overrun_ms": l.overrun_ms,
                "found_by": l.during,
                "at_unix_ms": l.at_unix_ms,
            })
        })
        .collect()
}

/// The primary's `maxmemory-policy` by name, as read from the primary in
/// force (`unknown`: not read from it yet, or unreadable).
pub fn primary_policy(ctx: &ServerContext) -> String {
    let reading = ctx.primary_memory.reading();
    match (reading, ctx.primary_addr.addr()) {
        (Some(r), Some(p)) if r.addr == p => r.policy.name().to_string(),
        _ => "unknown".to_string(),
    }
}

/// Why locks on the primary are refused now (`locks.require_noeviction`),
/// or "" (without refusing or counting anything).
fn primary_refused(ctx: &ServerContext) -> String {
    if ctx.locks.on_masters() {
        return String::new();
    }
    let addr = ctx.primary_addr.addr();
    (ctx.eviction)
        .refused_because(addr.as_deref(), &ctx.primary_memory)
        .or_else(|| ctx.locks.safety_refused_because())
        .unwrap_or_default()
}

/// `NODES`: in front of a Redis Cluster, each primary of the slot map in
/// force, a record each: `addr`, `slots` (ranges), `replicas`, `state`
/// (`up` or `down`: lockgate's last connection attempt), and
/// `failover_hold_ms` (how long its slots' lock acquisitions are still
/// held back after a failover promoted it; 0: not), and `disputes` (the
/// slot ranges its nodes disagree about that it is party to,
/// [`crate::upstream::cluster::Dispute`]). Empty in front of one primary.
pub fn nodes(ctx: &ServerContext) -> LocalReply {
    let Some(cluster) = &ctx.cluster else {
        return LocalReply::Array(Vec::new());
    };
    LocalReply::Array(
        cluster
            .nodes(ctx.locks.failover_delay())
            .into_iter()
            .map(|n| {
                record(vec![
                    ("addr", text(&n.addr)),
                    ("slots", text(&n.slots)),
                    ("replicas", text(&n.replicas)),
                    ("state", text(if n.up { "up" } else { "down" })),
                    ("failover_hold_ms", int(n.held_ms)),
                    ("disputes", text(&n.disputes)),
                ])
            })
            .collect(),
    )
}

/// `MASTERS`: each lock master, a record each: `addr`, `state` (`up`,
/// `sitting out`, `down`), `rejoins_in_ms` (0 where it waits for its
/// policy), `sits_out_because` (empty unless it does),
/// `maxmemory_policy` (by name), `evicted_keys` (keys it was seen
/// evicting).
pub fn masters(ctx: &ServerContext) -> LocalReply {
    let Some(q) = ctx.locks.quorum() else {
        return LocalReply::Array(Vec::new());
    };
    LocalReply::Array(
        q.masters
            .iter()
            .map(|m| {
                let (state, left, why) = m.shown();
                let memory = &m.memory;
                record(vec![
                    ("addr", text(m.node.addr())),
                    ("state", text(state)),
                    ("rejoins_in_ms", int(left)),
                    ("sits_out_because", text(&why)),
                    ("maxmemory_policy", text(&memory.policy_name())),
                    ("evicted_keys", int(ProxyMetrics::get(&memory.evicted))),
                    ("unsafe", text(&master_risks(ctx, memory).join(","))),
                ])
            })
            .collect(),
    )
}

/// What may lose a lock master's locks ([`crate::lock::eviction::safety`]):
/// its restart is its sit-out's, so not named here.
fn master_risks(ctx: &ServerContext, memory: &crate::lock::eviction::Memory) -> Vec<&'static str> {
    let mut named = memory.safety.named(ctx.locks.failover_delay());
    named.retain(|s| *s != "restarted");
    named
}

/// `PRIMARY`: the primary in force and its switches, a record: `addr` (empty: none confirmed), `followed` (`sentinel` or
/// `fixed`), `switches`, `last_switch_from`, `last_switch_to`,
/// `last_switch_unix_ms` (empty / 0: none), `failover_hold_ms` (what is left
/// of `locks.failover_delay_ms`, rounded up), `maxmemory_policy` (by name,
/// `unknown` until read from the primary in force), `evicted_keys` (keys
/// lockgate saw it evict), `locks_refused` (why, with
/// `locks.require_noeviction`; empty: served).
pub fn primary(ctx: &ServerContext) -> LocalReply {
    let p = &ctx.primary_addr;
    let safety = ctx.primary_memory.safety.reading();
    let last = p.last_switch().filter(|_| p.switches() > 0);
    let hold = match ctx.locks.quorum() {
        Some(_) => 0,
        None => p
            .hold_left(ctx.locks.failover_delay())
            // Rounded up: 0 only once the hold is over (a truncated 0
            // with a fraction of a millisecond left still refused locks).
            .map_or(0, |d| d.as_micros().div_ceil(1000) as i64),
    };
    record(vec![
        ("addr", text(p.addr().as_deref().unwrap_or(""))),
        (
            "followed",
            text(if p.followed { "sentinel" } else { "fixed" }),
        ),
        ("switches", LocalReply::Integer(p.switches() as i64)),
        (
            "last_switch_from",
            text(last.as_ref().and_then(|l| l.from.as_deref()).unwrap_or("")),
        ),
        ("last_switch_to", text(last.as_ref().map_or("", |l| &*l.to))),
        (
            "last_switch_unix_ms",
            LocalReply::Integer(last.as_ref().map_or(0, |l| l.at_unix_ms as i64)),
        ),
        ("failover_hold_ms", LocalReply::Integer(hold)),
        ("maxmemory_policy", text(&primary_policy(ctx))),
        (
            "evicted_keys",
            LocalReply::Integer(ProxyMetrics::get(&ctx.primary_memory.evicted) as i64),
        ),
        ("locks_refused", text(&primary_refused(ctx))),
        (
            "replicas",
            safety.map_or(LocalReply::Integer(-1), |s| {
                LocalReply::Integer(s.replicas as i64)
            }),
        ),
        (
            "min_replicas_to_write",
            text(yes_no(safety.map(|s| s.min_replicas))),
        ),
        ("aof", text(yes_no(safety.map(|s| s.aof)))),
        (
            "restarts",
            LocalReply::Integer(
                ctx.primary_memory
                    .safety
                    .restarts
                    .load(std::sync::atomic::Ordering::Relaxed) as i64,
            ),
        ),
        ("second_primaries", text(&second_primaries(ctx).join(","))),
        ("writable_replicas", text(&writable_replicas(ctx).join(","))),
        ("unsafe", text(&unsafe_signals(ctx).join(","))),
    ])
}

/// The primaries lockgate followed before a switch that still answer as
/// primaries ([`crate::lock::eviction::formers`]).
fn second_primaries(ctx: &ServerContext) -> Vec<String> {
    let formers = &ctx.primary_memory.safety.formers;
    (formers.still_primaries().iter())
        .map(|a| a.to_string())
        .collect()
}

/// The primary's replicas that accept writes
/// ([`crate::lock::eviction::writable`]).
fn writable_replicas(ctx: &ServerContext) -> Vec<String> {
    let writable = ctx.primary_memory.safety.writable.writable();
    writable.iter().map(|a| a.to_string()).collect()
}

/// `yes`, `no`, or `unknown` (not read).
fn yes_no(v: Option<bool>) -> &'static str {
    match v {
        Some(true) => "yes",
        Some(false) => "no",
        None => "unknown",
    }
}

/// The risks the primary holding the locks shows now
/// ([`crate::lock::eviction::safety`]); none with the quorum.
fn unsafe_signals(ctx: &ServerContext) -> Vec<&'static str> {
    if ctx.locks.on_masters() {
        return Vec::new();
    }
    ctx.primary_memory.safety.named(ctx.locks.failover_delay())
}

/// The primary for `/status.json`: the same facts as `LOCKGATE PRIMARY`.
pub fn primary_json(ctx: &ServerContext) -> serde_json::Value {
    let p = &ctx.primary_addr;
    let last = p.last_switch().filter(|_| p.switches() > 0);
    serde_json::json!({
        "addr": p.addr().as_deref().unwrap_or(""),
        "followed": if p.followed { "sentinel" } else { "fixed" },
        "switches": p.switches(),
        "last_switch": last.map(|l| serde_json::json!({
            "from": l.from.as_deref().unwrap_or(""),
            "to": &*l.to,
            "at_unix_ms": l.at_unix_ms,
        })),
        "maxmemory_policy": primary_policy(ctx),
        "evicted_keys": ProxyMetrics::get(&ctx.primary_memory.evicted),
        "locks_refused": primary_refused(ctx),
        "replicas": ctx.primary_memory.safety.reading().map(|s| s.replicas),
        "min_replicas_to_write": yes_no(ctx.primary_memory.safety.reading().map(|s| s.min_replicas)),
        "aof": yes_no(ctx.primary_memory.safety.reading().map(|s| s.aof)),
        "second_primaries": second_primaries(ctx),
        "writable_replicas": writable_replicas(ctx),
        "unsafe": unsafe_signals(ctx),
    })
}

/// `CONFIG [pattern]`: the configuration in force, secrets masked, as a
/// record of its keys by their dotted names (`proxy.listen`; an array of
/// tables by index, `locks.patterns.0.pattern`), those matching the glob
/// `pattern` (default `*`), in name order, each value as its TOML text without quotes
/// around strings, as Redis's `CONFIG GET` answers. `CONFIG TOML`: the
/// whole configuration as one TOML document (what `--config` reads).
pub fn config(ctx: &ServerContext, pattern: &[u8]) -> LocalReply {
    let shown = ctx.in_force().masked();
    if pattern.eq_ignore_ascii_case(b"TOML") {
        return text(&shown.to_toml());
    }
    let pattern: &[u8] = if pattern.is_empty() { b"*" } else { pattern };
    let table = match toml::Table::try_from(&shown) {
        Ok(t) => t,
        Err(e) => {
            return LocalReply::err(format!(
                "lockgate: the configuration in force cannot be shown ({e})"
            ))
        }
    };
    let mut pairs = Vec::new();
    flatten("", &toml::Value::Table(table), &mut pairs);
    LocalReply::Map(
        pairs
            .into_iter()
            .filter(|(k, _)| crate::lock::keys::glob_match(pattern, k.as_bytes()))
            .map(|(k, v)| (text(&k), text(&v)))
            .collect(),
    )
}

/// The leaves of `value` under `prefix`, by dotted name (a table's keys
/// in name order).
fn flatten(prefix: &str, value: &toml::Value, out: &mut Vec<(String, String)>) {
    let name = |k: &str| match prefix {
        "" => k.to_string(),
        p => format!("{p}.{k}"),
    };
    match value {
        toml::Value::Table(t) => {
            for (k, v) in t {
                flatten(&name(k), v, out);
            }
        }
        toml::Value::Array(items) if items.iter().any(|i| i.is_table()) => {
            for (i, v) in items.iter().enumerate() {
                flatten(&name(&i.to_string()), v, out);
            }
        }
        toml::Value::String(s) => out.push((prefix.to_string(), s.clone())),
        other => out.push((prefix.to_string(), other.to_string())),
    }
}

/// `RELOAD`: re-read the configuration file (as SIGHUP does).
pub fn reload(ctx: &ServerContext) -> LocalReply {
    match ctx.reload() {
        Ok(what) => {
            tracing::info!(outcome = %what, "LOCKGATE RELOAD: configuration reloaded");
            text(&what)
        }
        Err(e) => {
            tracing::warn!(error = %e, "LOCKGATE RELOAD: new configuration refused; the old one stays");
            LocalReply::err(format!(
                "lockgate: reload refused, old configuration kept: {e}"
            ))
        }
    }
}
