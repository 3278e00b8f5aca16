//! `LOCKGATE …` admin commands over RESP, answered by lockgate itself.

use bytes::Bytes;

use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;
use crate::router::CommandArgs;
use crate::server::ServerContext;

/// Default number of rows of list answers.
const DEFAULT_ROWS: usize = 20;

/// Answers one `LOCKGATE` command.
pub fn handle(ctx: &ServerContext, args: CommandArgs<'_>) -> LocalReply {
    let sub = args.get(1).to_ascii_uppercase();
    match sub.as_slice() {
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
                        LocalReply::Array(vec![
                            LocalReply::Bulk(prefix),
                            LocalReply::Integer(count as i64),
                        ])
                    })
                    .collect(),
            )
        }
        b"STATS" => stats(ctx),
        _ => LocalReply::err(format!(
            "lockgate: unknown LOCKGATE subcommand '{}'; try STATS or UNMATCHED [n]",
            String::from_utf8_lossy(args.get(1))
        )),
    }
}

fn rows(arg: &[u8]) -> Result<usize, LocalReply> {
    if arg.is_empty() {
        return Ok(DEFAULT_ROWS);
    }
    std::str::from_utf8(arg)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| LocalReply::err("value is not an integer or out of range"))
}

/// Counters as a flat array of name, value pairs.
fn stats(ctx: &ServerContext) -> LocalReply {
    let p = &ctx.metrics;
    let l = &ctx.locks.metrics;
    let rows: [(&str, &std::sync::atomic::AtomicU64); 16] = [
        ("connections_active", &p.connections_active),
        ("connections_total", &p.connections_total),
        ("commands_total", &p.commands_total),
        ("protocol_errors", &p.protocol_errors),
        ("upstream_connect_errors", &p.upstream_connect_errors),
        ("lock_attempts", &l.attempts),
        ("lock_acquired", &l.acquired),
        ("lock_contended", &l.contended),
        ("lock_released", &l.released),
        ("lock_release_denied", &l.release_denied),
        ("lock_extend_denied", &l.extend_denied),
        (
            "lock_lease_expired_before_release",
            &l.lease_expired_before_release,
        ),
        ("lock_takeovers", &l.takeovers),
        ("lock_persist_refused", &l.persist_refused),
        ("lock_unmatched_setnx", &l.unmatched_setnx),
        ("lock_watchdog_renewals", &l.watchdog_renewals),
    ];
    let mut out = Vec::with_capacity(rows.len() * 2);
    for (name, counter) in rows {
        out.push(LocalReply::Bulk(Bytes::from_static(name.as_bytes())));
        out.push(LocalReply::Integer(ProxyMetrics::get(counter) as i64));
    }
    LocalReply::Array(out)
}
