//! node-redlock (npm `redlock` 5.0.0-beta.2, `tests/js/redlock_outcomes.js`)
//! against one Redis, straight and through lockgate: its multi-key acquire
//! and extend scripts pass through as client scripts (a one-key
//! acquisition and its releases are lockgate's own, `router::library`),
//! and every outcome an app sees is the same either way (a request
//! overlapping a held key fails whole, a legacy `SETNX` on a key it holds
//! loses, a release after the lease ran out finds nothing, automatic
//! extension keeps a long section's lease, four retrying clients on two
//! keys never overlap), with the contending clients on connections of
//! their own and on one multiplexed connection. Through lockgate the owner
//! records are reconciled after each client script on lock keys
//! (docs/locks.md).

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

/// A script of node-redlock's, as the installed package has it
/// (`tests/js/node_modules/redlock`, `const NAME = \`…\`;`).
fn redlock_script(name: &str) -> String {
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/js/node_modules/redlock/dist/cjs/index.js");
    let source = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (scripts/setup.sh installs tests/js)",
            path.display()
        )
    });
    let start = format!("const {name} = `");
    let from = source
        .find(&start)
        .unwrap_or_else(|| panic!("no {name} in {}", path.display()))
        + start.len();
    let len = source[from..].find('`').expect("the script's end");
    source[from..from + len].to_string()
}

/// node-redlock's acquisition is its own script (`SET key value PX ms` for
/// each key): through lockgate the keys it took are adopted, given owner
/// records and held by its connection, so `LOCKGATE LOCKS` names the holder,
/// a `DEL` from a connection opened after it is refused as for any lock
/// taken through lockgate, and the library's own release ends the holding. A key its
/// script did not take (its value is not the script's) is not adopted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_redlocks_acquisition_is_held_through_lockgate() {
    use support::ops::{base_config, call, Ops};
    let (acquire, release) = (
        redlock_script("ACQUIRE_SCRIPT"),
        redlock_script("RELEASE_SCRIPT"),
    );
    let redis = RedisServer::start();
    let lg = Ops::start(base_config(&redis.addr())).await;
    let mut app = lg.client().await;
    assert_eq!(
        app.call_s(&["CLIENT", "SETNAME", "redlock-app"]).await,
        "+OK\r\n"
    );
    let mut admin = lg.client().await;
    let value = "0123456789abcdef0123456789abcdef";
    let keys = ["lock:rl:h1", "lock:rl:h2"];
    let reply = app
        .call_s(&["EVAL", &acquire, "2", keys[0], keys[1], value, "20000"])
        .await;
    assert_eq!(reply, ":2\r\n");
    let adopted = || support::locks::m(&lg.ctx.locks.metrics.script_adoptions);
    crate::until!("both keys adopted", adopted() == 2);
    for key in keys {
        let rows = call(&mut admin, &["LOCKGATE", "LOCKS", key]).await;
        let row = rows
            .items()
            .iter()
            .find(|r| r.field("key").text() == key)
            .cloned();
        let row = row.unwrap_or_else(|| panic!("no LOCKS row for {key}: {rows}"));
        assert_eq!(row.field("holder").text(), "this instance", "{row}");
        assert_eq!(row.field("client_name").text(), "redlock-app", "{row}");
        assert_eq!(row.field("acquisition").text().len(), 16, "{row}");
        assert!(!row.to_string().contains(value), "the value shown: {row}");
        let left = row.field("lease_left_ms").int();
        assert!(left > 0 && left <= 20_000, "{row}");
    }
    // A connection opened after the acquisition may not release it (as
    // for any lock taken through lockgate); the holder's library releases.
    let mut late = lg.client().await;
    assert_eq!(late.call_s(&["DEL", keys[0]]).await, ":0\r\n");
    let released = app
        .call_s(&["EVAL", &release, "2", keys[0], keys[1], value])
        .await;
    assert_eq!(released, ":2\r\n");
    crate::until!(
        "the holdings to end",
        call(&mut admin, &["LOCKGATE", "LOCKS", "lock:rl:*"])
            .await
            .items()
            .is_empty()
    );
    let owner =
        support::resp::direct(&redis.addr(), &["EXISTS", "lockgate:owner:{lock:rl:h1}"]).await;
    assert_eq!(owner, ":0\r\n", "the owner record went with the key");
    // A key set with another value, then touched by the script (which
    // finds it taken), is not the script's. (Two keys: for one, the
    // script is an acquisition of lockgate's, `locks_library_release.rs`.)
    support::resp::direct(
        &redis.addr(),
        &["SET", "lock:rl:h3", "someone-elses-value", "PX", "20000"],
    )
    .await;
    let reconciles = || support::locks::m(&lg.ctx.locks.metrics.script_reconciles);
    let before = reconciles();
    let reply = app
        .call_s(&[
            "EVAL",
            &acquire,
            "2",
            "lock:rl:h3",
            "lock:rl:h4",
            value,
            "20000",
        ])
        .await;
    assert_eq!(reply, ":0\r\n");
    crate::until!("the acquisition reconciled", reconciles() > before);
    assert_eq!(adopted(), 2);
    // Its release, carried out by lockgate (by value), releases nothing.
    let carried = || support::locks::m(&lg.ctx.locks.metrics.library_releases);
    let before = carried();
    assert_eq!(
        app.call_s(&["EVAL", &release, "1", "lock:rl:h3", value])
            .await,
        ":0\r\n"
    );
    assert_eq!(carried(), before + 1);
    let owner =
        support::resp::direct(&redis.addr(), &["EXISTS", "lockgate:owner:{lock:rl:h3}"]).await;
    assert_eq!(owner, ":0\r\n");
    lg.stop().await;
}
