//! A lock library's retry loop absorbed like a `SETNX` storm: redis-py's
//! `Lock` polling every millisecond from eight threads, one connection
//! each, on one key. Through lockgate a poll of a held lock is parked and
//! handed the lock in turn, so the loops stop polling; what Redis
//! still runs per acquisition is the acquisition, the library's own
//! release script and lockgate's reconciliation after it. (Redis's CPU
//! per acquisition against the same storm straight on Redis is a
//! benchmark figure: `bench/library_storm.py`.)

use std::time::Duration;

use crate::support;

use support::locks::m;
use support::{python, Lockgate, RedisServer};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_py_lock_polls_are_absorbed() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let (rhost, rport) = redis
        .addr()
        .rsplit_once(':')
        .map(|(h, p)| (h.to_string(), p.to_string()))
        .expect("host:port");
    let args = [
        lg.addr.ip().to_string(),
        lg.addr.port().to_string(),
        rhost,
        rport,
        "lock:storm:py".to_string(),
        "8".to_string(),
        "2".to_string(),
    ];
    let out = python("redis_py_storm.py", &args, Duration::from_secs(60)).await;
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON line");
    let acquisitions = v["acquisitions"].as_u64().expect("acquisitions");
    assert!(
        acquisitions >= 20,
        "only {acquisitions} acquisitions in 2 s"
    );

    let l = &lg.ctx.locks.metrics;
    let (sent, parked) = (m(&l.attempts_sent), m(&lg.ctx.locks.storm.metrics.parked));
    let per = |n: u64| n as f64 / acquisitions as f64;
    // The threads' polls of a held lock were parked and handed the lock
    // in turn (so they stopped polling) ...
    assert!(per(parked) >= 0.5, "{parked} parked for {acquisitions}");
    // ... and about one attempt per acquisition reached Redis.
    assert!(per(sent) <= 1.5, "{sent} attempts sent for {acquisitions}");
    // Redis ran three commands per acquisition (and their scripts' own
    // calls: `total_commands_processed` counts them too), the polls none.
    let commands = per(v["calls"].as_u64().expect("calls"));
    assert!(commands <= 16.0, "{commands} commands per acquisition");
    // Every release by the library's script was followed.
    crate::until!(
        "every library release reconciled",
        m(&l.script_reconciles) >= acquisitions
    );
    lg.stop().await;
}
