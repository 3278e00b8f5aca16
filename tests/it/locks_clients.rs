//! Real lock clients through lockgate: unmodified redis-py `Lock` (RESP2
//! and RESP3), and a hand-written compare-and-delete Lua release. Lock keys
//! are taken over on acquisition, but the client's value is never changed,
//! so client scripts that compare it keep working.

use crate::support;

use std::net::SocketAddr;
use std::time::Duration;

use support::locks::{m, pttl};
use support::{Lockgate, RawClient, RedisServer};

/// The compare-and-delete release every Redis lock tutorial uses.
const RELEASE: &str = r#"if redis.call("get",KEYS[1]) == ARGV[1] then return redis.call("del",KEYS[1]) else return 0 end"#;

/// Longest the redis-py script may run.
const SCRIPT_WAIT: Duration = Duration::from_secs(60);

/// Runs `tests/py/redis_py_lock.py` against lockgate and fails with its
/// output unless it exits 0. A missing `python3` or redis-py is a failure,
/// never a skip (set PYTHON to a Python 3 with redis-py 8).
async fn run_redis_py(lg: SocketAddr, protocol: u8, prefix: &str) {
    let args = [
        lg.ip().to_string(),
        lg.port().to_string(),
        protocol.to_string(),
        prefix.to_string(),
    ];
    let out = support::python("redis_py_lock.py", &args, SCRIPT_WAIT).await;
    assert!(
        out.contains("checks passed"),
        "script said nothing about its checks:\n{out}"
    );
}

/// Unmodified redis-py `Lock` in RESP `protocol`, on keys under `prefix`.
async fn redis_py_lock(protocol: u8, prefix: &str) {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    run_redis_py(lg.addr, protocol, prefix).await;
    // The acquisitions really went through the lock layer.
    let l = &lg.ctx.locks.metrics;
    assert!(m(&l.acquired) >= 5, "acquired = {}", m(&l.acquired));
    assert!(m(&l.contended) >= 2, "contended = {}", m(&l.contended));
    lg.stop().await;
}

#[tokio::test]
async fn redis_py_lock_resp2() {
    redis_py_lock(2, "lock:py2").await;
}

#[tokio::test]
async fn redis_py_lock_resp3() {
    redis_py_lock(3, "lock:py3").await;
}

/// A raw EVAL compare-and-delete through lockgate sees the client's own
/// value: a wrong value deletes nothing, the right one releases.
#[tokio::test]
async fn raw_eval_release_sees_the_clients_value() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut c = RawClient::connect(lg.addr).await;
    // RESP3, so that a missing key reads `_` (the harness decodes RESP3).
    let mut direct = RawClient::connect(redis.addr()).await;
    direct.call_raw(&["HELLO", "3"]).await;

    assert_eq!(
        c.call_raw(&["SET", "lock:raw", "tok-1", "NX", "PX", "5000"])
            .await,
        b"+OK\r\n"
    );
    // Lockgate took it over (owner record) but kept the value.
    assert_eq!(
        direct.call_raw(&["GET", "lock:raw"]).await,
        b"$5\r\ntok-1\r\n"
    );
    assert_eq!(c.call_raw(&["GET", "lock:raw"]).await, b"$5\r\ntok-1\r\n");
    let owner_pttl = pttl(&mut direct, "lockgate:owner:{lock:raw}").await;
    assert!(
        owner_pttl > 0 && owner_pttl <= 5000,
        "owner record PTTL {owner_pttl}"
    );

    // Not the holder's value: nothing deleted.
    assert_eq!(
        c.call_raw(&["EVAL", RELEASE, "1", "lock:raw", "tok-2"])
            .await,
        b":0\r\n"
    );
    assert_eq!(direct.call_raw(&["EXISTS", "lock:raw"]).await, b":1\r\n");
    // The holder's value: released.
    assert_eq!(
        c.call_raw(&["EVAL", RELEASE, "1", "lock:raw", "tok-1"])
            .await,
        b":1\r\n"
    );
    assert_eq!(direct.call_raw(&["EXISTS", "lock:raw"]).await, b":0\r\n");

    // The same through EVALSHA.
    let sha = c.call_raw(&["SCRIPT", "LOAD", RELEASE]).await;
    let sha = String::from_utf8(sha).expect("utf-8");
    let sha = sha.lines().nth(1).expect("bulk sha").to_string();
    assert_eq!(c.call_raw(&["SETNX", "lock:raw", "tok-3"]).await, b":1\r\n");
    assert_eq!(
        c.call_raw(&["EVALSHA", &sha, "1", "lock:raw", "tok-1"])
            .await,
        b":0\r\n"
    );
    assert_eq!(
        direct.call_raw(&["GET", "lock:raw"]).await,
        b"$5\r\ntok-3\r\n"
    );
    assert_eq!(
        c.call_raw(&["EVALSHA", &sha, "1", "lock:raw", "tok-3"])
            .await,
        b":1\r\n"
    );
    assert_eq!(direct.call_raw(&["EXISTS", "lock:raw"]).await, b":0\r\n");

    // A second client acquires after the script release.
    let mut other = RawClient::connect(lg.addr).await;
    assert_eq!(
        other.call_raw(&["SETNX", "lock:raw", "tok-4"]).await,
        b":1\r\n"
    );
    assert_eq!(
        direct.call_raw(&["GET", "lock:raw"]).await,
        b"$5\r\ntok-4\r\n"
    );
    lg.stop().await;
}

/// Under `HELLO 3`, lock acquisitions answer exactly what Redis answers
/// for the same command (a lost `SET NX` is RESP3 null, not a boolean).
#[tokio::test]
async fn resp3_acquire_replies_have_redis_shapes() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut holder = RawClient::connect(lg.addr).await;
    let mut loser = RawClient::connect(lg.addr).await;
    let mut direct = RawClient::connect(redis.addr()).await;
    for c in [&mut holder, &mut loser, &mut direct] {
        c.call_raw(&["HELLO", "3"]).await;
    }
    // What Redis itself answers, on a key lockgate does not take over.
    let won = [
        direct
            .call_raw(&["SET", "plain:a", "v", "NX", "PX", "5000"])
            .await,
        direct.call_raw(&["SETNX", "plain:b", "v"]).await,
    ];
    let lost = [
        direct
            .call_raw(&["SET", "plain:a", "v", "NX", "PX", "5000"])
            .await,
        direct.call_raw(&["SETNX", "plain:b", "v"]).await,
        direct.call_raw(&["SET", "plain:a", "w", "NX", "GET"]).await,
    ];
    assert_eq!(
        holder
            .call_raw(&["SET", "lock:r3a", "v", "NX", "PX", "5000"])
            .await,
        won[0]
    );
    assert_eq!(holder.call_raw(&["SETNX", "lock:r3b", "v"]).await, won[1]);
    assert_eq!(
        loser
            .call_raw(&["SET", "lock:r3a", "v", "NX", "PX", "5000"])
            .await,
        lost[0],
        "lost SET NX PX"
    );
    assert_eq!(
        loser.call_raw(&["SETNX", "lock:r3b", "v"]).await,
        lost[1],
        "lost SETNX"
    );
    assert_eq!(
        loser.call_raw(&["SET", "lock:r3a", "w", "NX", "GET"]).await,
        lost[2],
        "lost SET NX GET"
    );
    lg.stop().await;
}
