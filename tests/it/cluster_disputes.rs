//! Two nodes of a Redis Cluster that disagree about a slot (issue 45,
//! "unsafe upstreams named"): three primaries and a replica of the second
//! (real processes, every cluster bus through a relay,
//! `tests/support/cut_cluster.rs`); the second primary is cut off the bus
//! both ways and its replica takes over (`CLUSTER FAILOVER TAKEOVER`), so
//! the cut primary still claims its slots while the others name the
//! promoted replica. lockgate names the disputed slots (`LOCKGATE NODES`
//! `disputes`, `/status.json`, the gauge), refuses lock grants there with
//! `locks.require_one_primary` while granting elsewhere, and serves them
//! again, without a restart, once the heal tells the cut node.

use crate::support;
use support::cut_cluster::CutCluster;
use support::locks::m;
use support::ops::Ops;
use support::resp::{direct, Resp};
use support::RawClient;

use lockgate::cluster::slot::key_slot;

/// A lock key whose slot lies in `first..=last`.
fn key_in(first: u16, last: u16, prefix: &str) -> String {
    (0..100_000)
        .map(|i| format!("lock:{prefix}:{i}"))
        .find(|k| (first..=last).contains(&key_slot(k.as_bytes())))
        .expect("a key in the range")
}

/// Each primary's `disputes` in `LOCKGATE NODES`, joined.
async fn disputes(admin: &mut RawClient) -> String {
    let nodes = Resp::parse(&admin.call_raw(&["LOCKGATE", "NODES"]).await);
    (nodes.items().iter())
        .map(|n| n.field("disputes").text().to_string())
        .filter(|d| !d.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_two_nodes_claim_is_named_and_refused_until_they_agree() {
    let cluster = CutCluster::start().await;
    let mut config = lockgate::Config::default();
    config.upstream.cluster.seeds = vec![cluster.addr(0)];
    config.upstream.cluster.views_check_ms = 100;
    config.upstream.cluster.refresh_interval_ms = 200;
    config.locks.require_one_primary = true;
    config.locks.failover_delay_ms = Some(0);
    let lg = Ops::start(config).await;
    let pool = lg.ctx.cluster.clone().expect("a cluster pool");
    crate::until!("the slot map and key specs", pool.ready());
    let mut app = lg.client().await;
    let mut admin = lg.client().await;
    let (cut_key, other_key) = (key_in(5461, 10922, "cut"), key_in(0, 5460, "other"));
    assert_eq!(app.call_s(&["SETNX", &cut_key, "v"]).await, ":1\r\n");
    assert_eq!(disputes(&mut admin).await, "");

    cluster.cut();
    let takeover = ["CLUSTER", "FAILOVER", "TAKEOVER"];
    assert_eq!(direct(&cluster.addr(3), &takeover).await, "+OK\r\n");
    cluster
        .until_owner(0, 6000, 3, "the others follow the takeover")
        .await;
    let took_over = std::time::Instant::now();
    crate::until!("the dispute named", !disputes(&mut admin).await.is_empty());
    let named_after = took_over.elapsed();
    let named = disputes(&mut admin).await;
    let (cut, promoted) = (cluster.addr(1), cluster.addr(3));
    assert!(
        named.starts_with("5461-10922: ") && named.contains(&format!("{cut} says {cut}")),
        "{named}"
    );
    assert!(named.contains(&format!("says {promoted}")), "{named}");
    assert_eq!(
        cluster.owner_by(1, 6000).await,
        cut,
        "the cut node still claims it"
    );
    assert_eq!(m(&pool.metrics().disputed), 5462);
    let status = lg.status_json().await;
    assert!(
        status["cluster_disputes"][0]
            .as_str()
            .is_some_and(|d| d.starts_with("5461-10922")),
        "{status}"
    );
    let fresh = key_in(5461, 10922, "fresh");
    let refused = app.call_s(&["SET", &fresh, "v", "NX", "PX", "10000"]).await;
    assert!(
        refused.starts_with(&format!(
            "-ERR lockgate: locks refused on slot {}: the cluster's nodes disagree about who serves it (5461-10922: ",
            key_slot(fresh.as_bytes())
        )) && refused.ends_with("(locks.require_one_primary)\r\n"),
        "{refused}"
    );
    assert_eq!(app.call_s(&["SETNX", &other_key, "v"]).await, ":1\r\n");
    // Releases always pass: the lock taken before the cut, on the
    // promoted replica now.
    assert_eq!(app.call_s(&["DEL", &cut_key]).await, ":1\r\n");

    // Healed: the cut node learns of the takeover, the nodes agree.
    cluster.heal();
    let healed = std::time::Instant::now();
    cluster
        .until_owner(1, 6000, 3, "the cut node follows")
        .await;
    crate::until!("the dispute cleared", disputes(&mut admin).await.is_empty());
    println!(
        "named {} ms after the takeover, cleared {} ms after the heal",
        named_after.as_millis(),
        healed.elapsed().as_millis()
    );
    assert_eq!(m(&pool.metrics().disputed), 0);
    let granted = app.call_s(&["SET", &fresh, "v", "NX", "PX", "10000"]).await;
    assert_eq!(granted, "+OK\r\n");
    lg.stop().await;
}
