//! The operators' views over RESP: `LOCKGATE HOTKEYS [n]`, `LOCKS
//! [pattern]`, `MASTERS`, `PRIMARY`, `CONFIG`, `RELOAD` (see [`crate::admin`] for the
//! dispatch and [`crate::http`] for the same facts over HTTP).

use bytes::Bytes;

use crate::context::ServerContext;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;

/// Most rows `LOCKGATE LOCKS` answers.
const MAX_LOCK_ROWS: usize = 1_000;

fn bulk(s: impl Into<Bytes>) -> LocalReply {
    LocalReply::Bulk(s.into())
}

fn text(s: &str) -> LocalReply {
    LocalReply::Bulk(Bytes::copy_from_slice(s.as_bytes()))
}

/// `HOTKEYS [n]`: the hottest lock keys, one array each: key, attempts
/// (estimate), attempts/s, acquired, absorbed, parked now, holder.
pub fn hotkeys(ctx: &ServerContext, n: usize) -> LocalReply {
    LocalReply::Array(
        ctx.locks
            .hot
            .top(n)
            .into_iter()
            .map(|h| {
                let holder = ctx.locks.storm.holder(&h.key).unwrap_or("-");
                LocalReply::Array(vec![
                    bulk(h.key.clone()),
                    LocalReply::Integer(h.count as i64),
                    text(&format!("{:.1}", h.rate_per_sec)),
                    LocalReply::Integer(h.acquired as i64),
                    LocalReply::Integer(h.absorbed as i64),
                    LocalReply::Integer(ctx.locks.storm.waiting(&h.key) as i64),
                    text(holder),
                ])
            })
            .collect(),
    )
}

/// `LOCKS [pattern]`: what this instance knows is held: key, holder,
/// remaining lease ms, parked attempts.
pub fn locks(ctx: &ServerContext, pattern: &[u8]) -> LocalReply {
    let pattern: &[u8] = if pattern.is_empty() { b"*" } else { pattern };
    LocalReply::Array(
        ctx.locks
            .storm
            .held(pattern, MAX_LOCK_ROWS)
            .into_iter()
            .map(|(key, holder, ttl, parked)| {
                LocalReply::Array(vec![
                    bulk(key),
                    text(holder),
                    LocalReply::Integer(ttl as i64),
                    LocalReply::Integer(parked as i64),
                ])
            })
            .collect(),
    )
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
        .unwrap_or_default()
}

/// `NODES`: in front of a Redis Cluster, each primary of the slot map in
/// force: address, slot ranges, replicas, `up` or `down` (lockgate's last
/// connection attempt), and ms its slots' lock acquisitions are still held
/// back after a failover promoted it (0: not). Empty in front of one
/// primary.
pub fn nodes(ctx: &ServerContext) -> LocalReply {
    let Some(cluster) = &ctx.cluster else {
        return LocalReply::Array(Vec::new());
    };
    LocalReply::Array(
        cluster
            .nodes(ctx.locks.failover_delay())
            .into_iter()
            .map(|n| {
                LocalReply::Array(vec![
                    text(&n.addr),
                    text(&n.slots),
                    text(&n.replicas),
                    text(if n.up { "up" } else { "down" }),
                    LocalReply::Integer(n.held_ms as i64),
                ])
            })
            .collect(),
    )
}

/// `MASTERS`: each lock master: address, state, ms until it rejoins (0
/// where it waits for its policy), why it sits out (empty unless it
/// does), its `maxmemory-policy` by name, and the keys it was seen
/// evicting.
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
                LocalReply::Array(vec![
                    text(m.node.addr()),
                    text(state),
                    LocalReply::Integer(left as i64),
                    text(&why),
                    text(&memory.policy_name()),
                    LocalReply::Integer(ProxyMetrics::get(&memory.evicted) as i64),
                ])
            })
            .collect(),
    )
}

/// `PRIMARY`: the primary in force and its switches, as field/value
/// pairs: `addr` (empty: none confirmed), `followed` (`sentinel` or
/// `fixed`), `switches`, `last_switch_from`, `last_switch_to`,
/// `last_switch_unix_ms` (empty / 0: none), `failover_hold_ms` (what is left
/// of `locks.failover_delay_ms`, rounded up), `maxmemory_policy` (by name,
/// `unknown` until read from the primary in force), `evicted_keys` (keys
/// lockgate saw it evict), `locks_refused` (why, with
/// `locks.require_noeviction`; empty: served).
pub fn primary(ctx: &ServerContext) -> LocalReply {
    let p = &ctx.primary_addr;
    let last = p.last_switch().filter(|_| p.switches() > 0);
    let hold = match ctx.locks.quorum() {
        Some(_) => 0,
        None => p
            .hold_left(ctx.locks.failover_delay())
            // Rounded up: 0 only once the hold is over (a truncated 0
            // with a fraction of a millisecond left still refused locks).
            .map_or(0, |d| d.as_micros().div_ceil(1000) as i64),
    };
    let pairs: Vec<(&str, LocalReply)> = vec![
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
    ];
    LocalReply::Array(pairs.into_iter().flat_map(|(k, v)| [text(k), v]).collect())
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
    })
}

/// `CONFIG`: the configuration in force as TOML, secrets masked.
pub fn config(ctx: &ServerContext) -> LocalReply {
    text(&ctx.in_force().to_masked_toml())
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
