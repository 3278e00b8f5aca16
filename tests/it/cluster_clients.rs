//! Cluster clients of other languages, unchanged, through lockgate in front
//! of a real Redis Cluster (`[upstream.cluster]`): Node.js's ioredis, both
//! its `Redis.Cluster` (told of one node, lockgate, serving every slot) and
//! its plain `Redis` (one Redis, cross-slot commands split by lockgate).
//! The script is `tests/js/ioredis_cluster.js`; ioredis is installed in
//! `tests/js/node_modules` by `scripts/setup.sh`. redis-py's cluster client:
//! `cluster_routing.rs`.

use crate::support;

use std::path::Path;
use std::time::Duration;

use lockgate::config::UpstreamMode;
use support::cluster::Cluster;
use support::resp::Resp;
use support::RawClient;

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
    let mut command = std::process::Command::new("node");
    command
        .arg(format!("{js}/ioredis_cluster.js"))
        .arg(lg.addr.ip().to_string())
        .arg(lg.addr.port().to_string());
    let out = support::run_limited_async(command, None, Duration::from_secs(120)).await;
    let stdout = support::show(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("ioredis cluster OK"),
        "ioredis through lockgate failed ({}).\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        support::show(&out.stderr)
    );
    // The keys are on the nodes that serve them, asked directly.
    let map = cluster.map().await;
    for i in [3, 88, 150, 199] {
        let key = format!("js:c:{i}");
        let node = &map.shard_of_key(key.as_bytes()).expect("served").primary;
        let mut n = RawClient::connect(node).await;
        assert_eq!(
            Resp::parse(&n.call_raw(&["GET", &key]).await),
            Resp::Bulk(Some(i.to_string().into_bytes())),
            "{key} on {node}"
        );
    }
    lg.stop().await;
}
