//! Per-key wait and hold histograms on `/metrics`
//! (`lock_key_wait_seconds{key}`, `lock_key_hold_seconds{key}`): for a
//! legacy `SETNX`/`DEL` lock and for a library's `SET NX PX` released by
//! its own compare-and-delete script alike, counted beside the totals
//! (`lock_wait_seconds`, `lock_hold_seconds`), readable by Prometheus's
//! own parser.

use std::time::{Duration, Instant};

use crate::support;

use support::locks::COMPARE_AND_DELETE;
use support::ops::{base_config, python_parse, Metrics, Ops};
use support::WAIT;

const WAIT_H: &str = "lockgate_lock_key_wait_seconds";
const HOLD_H: &str = "lockgate_lock_key_hold_seconds";

/// `name`'s `_count` for `key`, and its `+Inf` bucket, which must agree.
fn count(m: &Metrics, name: &str, key: &str) -> f64 {
    let n = m
        .get(&format!("{name}_count"), &[("key", key)])
        .unwrap_or(0.0);
    let inf = m
        .get(&format!("{name}_bucket"), &[("key", key), ("le", "+Inf")])
        .unwrap_or(0.0);
    assert_eq!(n, inf, "{name}{{key={key}}}: count and +Inf bucket");
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_hot_key_has_its_wait_and_hold_histograms() {
    let redis = support::RedisServer::start();
    let lg = Ops::start(base_config(&redis.addr())).await;
    let mut holder = lg.client().await;
    let mut waiter = lg.client().await;

    // Legacy: acquired, held ~30 ms, released by DEL.
    assert_eq!(
        holder.call_s(&["SETNX", "lock:h:legacy", "1"]).await,
        ":1\r\n"
    );
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert_eq!(holder.call_s(&["DEL", "lock:h:legacy"]).await, ":1\r\n");

    // A library: the holder takes it, the waiter tries and loses, the
    // holder's own script releases it, the waiter then acquires (its wait
    // counted from its first try) and releases by script too.
    let set = |v: &'static str| ["SET", "lock:h:lib", v, "NX", "PX", "30000"];
    assert_eq!(holder.call_s(&set("a")).await, "+OK\r\n");
    assert_eq!(waiter.call_s(&set("b")).await, "$-1\r\n");
    let release = |v: &'static str| ["EVAL", COMPARE_AND_DELETE, "1", "lock:h:lib", v];
    assert_eq!(holder.call_s(&release("a")).await, ":1\r\n");
    assert_eq!(waiter.call_s(&set("b")).await, "+OK\r\n");
    assert_eq!(waiter.call_s(&release("b")).await, ":1\r\n");

    // The library's releases are learned in the background: both holds
    // are counted once they are.
    let deadline = Instant::now() + WAIT;
    let m = loop {
        let m = lg.metrics().await;
        if count(&m, HOLD_H, "lock:h:lib") >= 2.0 || Instant::now() > deadline {
            break m;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    assert_eq!(count(&m, HOLD_H, "lock:h:legacy"), 1.0);
    assert_eq!(count(&m, HOLD_H, "lock:h:lib"), 2.0);
    assert_eq!(count(&m, WAIT_H, "lock:h:legacy"), 1.0);
    assert_eq!(count(&m, WAIT_H, "lock:h:lib"), 2.0);
    // The legacy hold took at least 30 ms: its sum says so, and it is in
    // no bucket below 32 ms (le="0.032" is the first that may hold it).
    let held = m.value(&format!("{HOLD_H}_sum"), &[("key", "lock:h:legacy")]);
    assert!((0.03..10.0).contains(&held), "legacy hold {held} s");
    let under_16ms = m.value(
        &format!("{HOLD_H}_bucket"),
        &[("key", "lock:h:legacy"), ("le", "0.016")],
    );
    assert_eq!(under_16ms, 0.0);
    // The totals count every lock, these keys among them.
    assert!(m.value("lockgate_lock_hold_seconds_count", &[]) >= 3.0);

    let py = python_parse(&m.text).await;
    let hist: Vec<_> = (py.prometheus.iter())
        .filter(|s| s.family == "lockgate_lock_key_hold_seconds")
        .collect();
    assert!(hist.iter().all(|s| s.kind == "histogram"), "{hist:?}");
    assert!(hist
        .iter()
        .any(|s| s.labels.get("key").map(|k| &k[..]) == Some("lock:h:lib")));
    lg.stop().await;
}
