//! Two apps on one lock name during a migration: one legacy (`SETNX` +
//! `EXPIRE` … `DEL`), one on a lock library (redis-py's `Lock`: `SET NX
//! PX`, its own release script). Through lockgate both are string locks
//! taken over alike, so they never hold the key together. A hash lock
//! (Redisson's shape: `HINCRBY` of its holder field in a script) against
//! a string lock clashes as on Redis: the same `WRONGTYPE` error, the same
//! "not acquired".

use std::time::Duration;

use crate::support;

use support::{python, Lockgate, RawClient, RedisServer};

/// Redisson's `tryLock` script as its documentation gives it (shared with
/// `tests/py/redisson_wake.py`).
const HASH_LOCK: &str = include_str!("../py/redisson_try_lock.lua");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_legacy_app_and_a_library_app_never_hold_one_lock_together() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let args = [
        lg.addr.ip().to_string(),
        lg.addr.port().to_string(),
        "lock:cross:one".to_string(),
        "2".to_string(),
    ];
    let out = python("cross_library.py", &args, Duration::from_secs(60)).await;
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON line");
    assert_eq!(v["overlaps"], 0, "two holders at once: {out}");
    let (legacy, library) = (v["legacy"].as_u64(), v["library"].as_u64());
    assert!(legacy >= Some(10), "legacy acquisitions: {out}");
    assert!(library >= Some(10), "library acquisitions: {out}");
    lg.stop().await;
}

#[tokio::test]
async fn a_hash_lock_against_a_string_lock_clashes_as_on_redis() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    for (side, addr) in [("direct", redis.addr()), ("lockgate", lg.addr.to_string())] {
        let mut c = RawClient::connect(addr.as_str()).await;
        let (string, hash) = (
            format!("lock:clash:s:{side}"),
            format!("lock:clash:h:{side}"),
        );
        // A string lock held: the hash lock's script meets the wrong type.
        assert_eq!(c.call_s(&["SETNX", &string, "legacy"]).await, ":1\r\n");
        let reply = c
            .call_s(&["EVAL", HASH_LOCK, "1", &string, "30000", "uuid:1"])
            .await;
        assert!(reply.starts_with("-WRONGTYPE"), "{side}: {reply:?}");
        // A hash lock held: a legacy SETNX finds the key taken.
        let taken = c
            .call_s(&["EVAL", HASH_LOCK, "1", &hash, "30000", "uuid:1"])
            .await;
        assert_eq!(taken, "$-1\r\n", "{side}: the hash lock taken");
        assert_eq!(
            c.call_s(&["SETNX", &hash, "legacy"]).await,
            ":0\r\n",
            "{side}"
        );
        let set = c.call_s(&["SET", &hash, "v", "NX", "PX", "1000"]).await;
        assert_eq!(set, "$-1\r\n", "{side}");
        assert_eq!(c.call_s(&["TYPE", &hash]).await, "+hash\r\n", "{side}");
    }
    lg.stop().await;
}
