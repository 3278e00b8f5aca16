//! Cluster clients of other languages, unchanged, through lockgate in front
//! of a real Redis Cluster (`[upstream.cluster]`): Node.js's ioredis, both
//! its `Redis.Cluster` (told of one node, lockgate, serving every slot) and
//! its plain `Redis` (one Redis, cross-slot commands split by lockgate).
//! The script is `tests/js/ioredis_cluster.js`; ioredis is installed in
//! `tests/js/node_modules` by `scripts/setup.sh`. redis-py's cluster client:
//! `cluster_routing.rs`.

use crate::support;

use std::path::Path;

use lockgate::config::UpstreamMode;
use support::cluster::{on_node_of, run_client, Cluster};
use support::resp::Resp;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ioredis_works_through_lockgate_in_front_of_a_cluster() {
    let js = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/js");
    assert!(
        Path::new(js).join("node_modules/ioredis").is_dir(),
        "ioredis is not installed in {js}/node_modules: run scripts/setup.sh \
         (or `npm ci` in tests/js)"
    );
    let cluster = Cluster::start(3, 0);
    let lg = cluster
        .lockgate(|c| c.proxy.upstream = UpstreamMode::Shared)
        .await;
    let script = format!("{js}/ioredis_cluster.js");
    run_client("node", &script, lg.addr, "ioredis cluster OK").await;
    // The keys are on the nodes that serve them, asked directly.
    let map = cluster.map().await;
    for i in [3, 88, 150, 199] {
        let key = format!("js:c:{i}");
        let (node, value) = on_node_of(&map, &key, &["GET", &key]).await;
        assert_eq!(
            value,
            Resp::Bulk(Some(i.to_string().into_bytes())),
            "{key} on {node}"
        );
    }
    lg.stop().await;
}
