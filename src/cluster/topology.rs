//! Reading a cluster's slot map from its nodes: each seed in turn, on a
//! connection of lockgate's own (timeout, credentials and TLS as for the
//! primary), `CLUSTER SHARDS`, or `CLUSTER SLOTS` on a server that does
//! not know `SHARDS` (before Redis 7); and when to read it again, a rule
//! of time alone ([`refresh_due`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::map::SlotMap;
use crate::config::Config;
use crate::protocol::encode;
use crate::tls::{Side, TlsStore};
use crate::upstream::node::{handshake, request, NodeConfig};
use crate::upstream::Connector;

/// Why no slot map could be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    /// Upstream: no seed answered with a slot map; each seed's reason.
    #[error("no cluster node gave its slot map ({0})")]
    Unreachable(String),
}

/// The slot map of the first of `seeds` (`HOST:PORT`) that gives one,
/// connecting as `config` says for the upstream (timeout, credentials,
/// TLS), and the address it came from.
pub async fn fetch(config: &Config, seeds: &[String]) -> Result<(SlotMap, String), TopologyError> {
    let connector = Connector::new(Arc::new(TlsStore::new(config)), Side::Upstream);
    let template = NodeConfig::for_addr(config, &config.upstream.addr, connector);
    fetch_from(&template, seeds).await
}

/// [`fetch`], connecting as `template` says.
pub(crate) async fn fetch_from(
    template: &NodeConfig,
    seeds: &[String],
) -> Result<(SlotMap, String), TopologyError> {
    let mut why = Vec::new();
    for seed in seeds {
        let config = NodeConfig {
            addr: seed.clone(),
            ..template.clone()
        };
        match fetch_one(&config).await {
            Ok(map) => return Ok((map, seed.clone())),
            Err(e) => why.push(format!("{seed}: {e}")),
        }
    }
    Err(TopologyError::Unreachable(why.join("; ")))
}

async fn fetch_one(config: &NodeConfig) -> Result<SlotMap, String> {
    let mut stream = handshake(config).await?;
    let timeout = config.connect_timeout;
    let shards = request(
        &mut stream,
        &encode::command(&[b"CLUSTER", b"SHARDS"]),
        timeout,
    )
    .await?;
    if !unknown_subcommand(&shards) {
        return SlotMap::from_shards(&shards, &config.addr).map_err(|e| e.to_string());
    }
    let slots = request(
        &mut stream,
        &encode::command(&[b"CLUSTER", b"SLOTS"]),
        timeout,
    )
    .await?;
    SlotMap::from_slots(&slots, &config.addr).map_err(|e| e.to_string())
}

/// Whether `reply` is a server's refusal of a `CLUSTER` subcommand it does
/// not know (`CLUSTER SHARDS` before Redis 7).
fn unknown_subcommand(reply: &[u8]) -> bool {
    reply.first() == Some(&b'-')
        && memchr::memmem::find(&reply.to_ascii_lowercase(), b"unknown subcommand").is_some()
}

/// Whether the slot map read at `last` is to be read again at `now`: every
/// `interval`, or at once after a redirection (`redirected`: a node
/// answered `MOVED`), but never twice within `min_gap` (a storm of
/// redirections reads it once per gap).
pub fn refresh_due(
    last: Instant,
    now: Instant,
    interval: Duration,
    min_gap: Duration,
    redirected: bool,
) -> bool {
    let since = now.saturating_duration_since(last);
    since >= min_gap && (redirected || since >= interval)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_map_is_read_again_on_time_or_after_a_redirection_not_faster() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        // (ms since the last read, redirected) → due, with an interval of
        // 5 000 ms and a gap of 100 ms.
        for (since, redirected, due) in [
            (0, false, false),
            (0, true, false),
            (99, true, false),
            (100, true, true),
            (4_999, false, false),
            (5_000, false, true),
            (60_000, true, true),
        ] {
            assert_eq!(
                refresh_due(t0, t0 + ms(since), ms(5_000), ms(100), redirected),
                due,
                "{since} ms, redirected {redirected}"
            );
        }
        // A clock read before the last refresh is no time at all.
        assert!(!refresh_due(t0 + ms(10), t0, ms(5_000), ms(100), true));
    }

    #[test]
    fn an_unknown_subcommand_is_told_from_other_errors() {
        assert!(unknown_subcommand(
            b"-ERR Unknown subcommand or wrong number of arguments for 'SHARDS'. Try CLUSTER HELP.\r\n"
        ));
        assert!(unknown_subcommand(
            b"-ERR unknown subcommand 'shards'. Try CLUSTER HELP.\r\n"
        ));
        assert!(!unknown_subcommand(
            b"-ERR This instance has cluster support disabled\r\n"
        ));
        assert!(!unknown_subcommand(b"*0\r\n"));
    }
}
