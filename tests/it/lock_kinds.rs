//! Shared, reentrant and counted locks and multi-key locks (`LOCKGATE LOCK
//! … SHARED | OWNER`, `LOCKGATE ACQUIRE`, `LOCKGATE LOCK k1 k2 …`) on one
//! Redis and on a cluster (see `support::kinds` for the scenarios), and
//! what each store refuses, saying so.

use crate::support;

use support::cluster::Cluster;
use support::kinds::{self, Api};
use support::resp::Resp;
use support::{Lockgate, RedisServer};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_on_one_redis() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    kinds::readers_and_writers(lg.addr, "rw").await;
    kinds::reentrant_counts(lg.addr, "re").await;
    kinds::permits_with_dying_holders(lg.addr, "sem").await;
    kinds::multi_key_all_or_none(lg.addr, ["m1", "m2", "m3"]).await;
    // What Redis holds while readers do: the mark, with the longest
    // reader's lease.
    let mut c = Api::connect(lg.addr).await;
    let (t, _) = (c.lock("rw", 10_000, &["SHARED"]).await).expect("a reader");
    let mut direct = support::RawClient::connect(redis.addr()).await;
    let value = Resp::parse(&direct.call_raw(&["GET", "rw"]).await);
    assert_eq!(value.text(), "lockgate:held");
    let pttl = Resp::parse(&direct.call_raw(&["PTTL", "rw"]).await).int();
    assert!((9_000..=10_000).contains(&pttl), "pttl {pttl}");
    assert_eq!(c.unlock("rw", t).await, 1);
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_on_a_cluster_and_multi_key_in_one_slot() {
    let cluster = Cluster::start(3, 0);
    let lg = cluster.lockgate(|_| {}).await;
    kinds::readers_and_writers(lg.addr, "{c}rw").await;
    kinds::reentrant_counts(lg.addr, "{c}re").await;
    kinds::permits_with_dying_holders(lg.addr, "{c}sem").await;
    kinds::multi_key_all_or_none(lg.addr, ["{m}1", "{m}2", "{m}3"]).await;
    let mut c = Api::connect(lg.addr).await;
    let crossed = c.call(&["LOCKGATE", "LOCK", "a", "b", "1000"]).await;
    assert!(
        matches!(&crossed, Resp::Error(e) if e.starts_with("CROSSSLOT")),
        "{crossed}"
    );
    assert_eq!(c.call(&["EXISTS", "a"]).await.int(), 0);
    lg.stop().await;
}
