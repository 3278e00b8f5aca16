//! The shipped Grafana dashboard (`docker/grafana/dashboards/lockgate.json`)
//! and alert rules (`docker/alerts.yml`) name only metrics that lockgate
//! exports: every expression in them is read, every `lockgate_…` name in
//! it is looked up on a live `/metrics` of lockgate in front of a primary
//! and a quorum of three lock masters (so the per-master families exist).

use std::collections::BTreeSet;

use crate::support;

use support::ops::{base_config, Ops};
use support::RedisServer;

/// The file at `path` in the repository.
fn repo_file(path: &str) -> String {
    let full = format!("{}/{path}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{full}: {e}"))
}

/// Every `"expr"` string anywhere in the dashboard's JSON.
fn dashboard_exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr", serde_json::Value::String(e)) => out.push(e.clone()),
                    _ => dashboard_exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|i| dashboard_exprs(i, out)),
        _ => {}
    }
}

/// Every `expr:` of the alert rules (one line each, as the file keeps them).
fn alert_exprs(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.trim_start().strip_prefix("expr:"))
        .map(|e| e.trim().to_string())
        .collect()
}

/// The `lockgate_…` metric names in a PromQL expression.
fn names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(at) = expr[i..].find("lockgate_") {
        let start = i + at;
        let before = start.checked_sub(1).map(|b| bytes[b]);
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        // Not part of a longer word (a label value, `job="lockgate_x"`).
        if !before.is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'"') {
            out.push(expr[start..end].to_string());
        }
        i = end;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_and_alerts_use_exists() {
    let dashboard: serde_json::Value =
        serde_json::from_str(&repo_file("docker/grafana/dashboards/lockgate.json"))
            .expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    dashboard_exprs(&dashboard, &mut exprs);
    assert!(exprs.len() >= 10, "dashboard expressions: {exprs:?}");
    let alerts = alert_exprs(&repo_file("docker/alerts.yml"));
    assert_eq!(alerts.len(), 6, "alert rules: {alerts:?}");
    // The alerts the operators asked for, each on its own metric.
    for want in [
        "lockgate_master_up",
        "lockgate_lock_lease_expired_before_release_total",
        "lockgate_lock_release_denied_total",
        "lockgate_lock_oldest_wait_seconds",
        "lockgate_upstream_maxmemory_policy",
        "lockgate_guarded_writes_total",
    ] {
        assert!(
            alerts.iter().any(|e| names(e).iter().any(|n| n == want)),
            "no alert on {want}: {alerts:?}"
        );
    }
    exprs.extend(alerts);
    let used: BTreeSet<String> = exprs.iter().flat_map(|e| names(e)).collect();
    assert!(used.len() >= 10, "{used:?}");

    let primary = RedisServer::start();
    let masters: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let mut c = base_config(&primary.addr());
    c.locks.quorum.masters = masters.iter().map(|m| m.addr()).collect();
    c.locks.quorum.rejoin_delay_ms = 300;
    c.locks.quorum.node_timeout_ms = 1_000;
    let lg = Ops::start(c).await;
    let m = lg.metrics().await;
    // Names a sample carries, and the families declared (a family with no
    // sample yet, e.g. the hot keys before any attempt, still counts: its
    // samples get the suffixes of its type).
    let mut exported: BTreeSet<String> = m.samples.iter().map(|s| s.name.clone()).collect();
    for line in m.text.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut parts = rest.split(' ');
        let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
            continue;
        };
        let suffixes: &[&str] = match kind {
            "counter" => &["_total"],
            "histogram" => &["_bucket", "_sum", "_count"],
            _ => &[""],
        };
        for s in suffixes {
            exported.insert(format!("{name}{s}"));
        }
    }
    let missing: Vec<&String> = used.iter().filter(|n| !exported.contains(*n)).collect();
    assert!(
        missing.is_empty(),
        "the dashboard or alerts use metrics /metrics lacks: {missing:?}"
    );
    // The oldest-wait gauge reads 0 while nothing is parked.
    assert_eq!(m.value("lockgate_lock_oldest_wait_seconds", &[]), 0.0);
    lg.stop().await;
}

#[test]
fn names_are_read_from_promql() {
    assert_eq!(
        names(r#"sum(rate(lockgate_lock_absorbed_total{instance=~"$i"}[1m])) / lockgate_x"#),
        ["lockgate_lock_absorbed_total", "lockgate_x"]
    );
    assert_eq!(names(r#"up{job="lockgate_y"}"#), Vec::<String>::new());
    assert_eq!(
        names("histogram_quantile(0.5, sum by (le) (rate(lockgate_lock_wait_seconds_bucket[5m])))"),
        ["lockgate_lock_wait_seconds_bucket"]
    );
}
