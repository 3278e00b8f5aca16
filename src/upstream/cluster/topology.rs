//! Reading a cluster's slot map from its nodes: each seed in turn, on a
//! connection of lockgate's own (timeout, credentials and TLS as for the
//! primary), `CLUSTER SHARDS`, or `CLUSTER SLOTS` on a server that does
//! not know `SHARDS` (before Redis 7). When to read it again is
//! [`crate::cluster::topology`]'s pure rule.

use std::sync::Arc;

use crate::cluster::map::SlotMap;
use crate::cluster::topology::unknown_subcommand;
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

/// The map the node `config` reaches answers (`CLUSTER SHARDS`, or
/// `CLUSTER SLOTS` where it has none).
pub(crate) async fn fetch_one(config: &NodeConfig) -> Result<SlotMap, String> {
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
