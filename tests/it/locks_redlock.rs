//! node-redlock (npm `redlock` 5.0.0-beta.2, `tests/js/redlock_outcomes.js`)
//! against one Redis, straight and through lockgate: its multi-key acquire,
//! extend and release scripts pass through as client scripts, and every
//! outcome an app sees is the same either way (a request overlapping a held
//! key fails whole, a legacy `SETNX` on a key it holds loses, a release
//! after the lease ran out finds nothing, automatic extension keeps a long
//! section's lease, four retrying clients on two keys never overlap),
//! with the contending clients on connections of their own and on one
//! multiplexed connection. Through lockgate the owner records are
//! reconciled after each script on lock keys (docs/locks.md).

use std::time::Duration;

use crate::support;

use support::{node, Lockgate, RedisServer};

/// The driver's outcomes against `addr`, as JSON.
async fn outcomes(addr: std::net::SocketAddr, shape: &str) -> serde_json::Value {
    let args = [
        addr.ip().to_string(),
        addr.port().to_string(),
        shape.to_string(),
    ];
    let out = node("redlock_outcomes.js", &args, Duration::from_secs(90)).await;
    assert!(out.contains("redlock OK"), "{out}");
    let line = out.lines().next().unwrap_or_default();
    serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {out}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_redlock_sees_through_lockgate_what_it_sees_on_redis() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let direct_addr: std::net::SocketAddr = redis.addr().parse().expect("an address");
    for shape in ["own", "multiplexed"] {
        let direct = outcomes(direct_addr, shape).await;
        assert_eq!(direct["overlaps"], 0, "{shape}: {direct}");
        assert_eq!(direct["sections"], 60, "{shape}: {direct}");
        let before = support::locks::m(&lg.ctx.locks.metrics.script_reconciles);
        let gated = outcomes(lg.addr, shape).await;
        assert_eq!(
            gated, direct,
            "{shape}: through lockgate, then straight on Redis"
        );
        // Its acquisitions, extensions and releases are scripts on lock
        // keys: the owner records were made true to each.
        let reconciled = support::locks::m(&lg.ctx.locks.metrics.script_reconciles) - before;
        assert!(reconciled >= 60, "{shape}: {reconciled} reconciliations");
    }
    lg.stop().await;
}
