//! The uncontended lock cycle's small scripts (`locks.fast_path`, see
//! "The uncontended cycle" in docs/behaviour.md) against a real redis-server: the
//! same answers and the same owner records as the general scripts, also
//! when the lock key or its owner record changed behind lockgate's back
//! mid-cycle; a contended key leaves the fast path.

use crate::support;

use support::locks::*;
use support::{Lockgate, RawClient};

/// Fast calls so far.
fn fast(lg: &Lockgate) -> u64 {
    m(&lg.ctx.locks.metrics.fast_calls)
}

#[tokio::test]
async fn the_legacy_cycle_runs_fast_and_answers_as_redis() {
    let (_redis, lg, mut r) = setup("a", 20_000).await;
    let mut a = RawClient::connect(lg.addr).await;
    assert_eq!(a.call(&["SETNX", "lock:x", "1"]).await, ":1\r\n");
    let token = owner_of(&mut r, "lock:x").await.expect("owner record");
    assert!(token.starts_with("a:"), "{token}");
    // (`assert_lease` reads the lock and its owner record.)
    assert_lease(&mut r, "lock:x", 19_000, 20_000).await;
    assert_eq!(a.call(&["EXPIRE", "lock:x", "30"]).await, ":1\r\n");
    assert_lease(&mut r, "lock:x", 29_000, 30_000).await;
    assert_eq!(a.call(&["PEXPIRE", "lock:x", "45000"]).await, ":1\r\n");
    assert_lease(&mut r, "lock:x", 44_000, 45_000).await;
    assert_eq!(a.call(&["DEL", "lock:x"]).await, ":1\r\n");
    assert!(!exists(&mut r, "lock:x").await);
    assert!(!exists(&mut r, &owner("lock:x")).await);
    assert_eq!(fast(&lg), 4);
    let l = &lg.ctx.locks.metrics;
    assert_eq!((m(&l.acquired), m(&l.released)), (1, 1));
    // UNLINK too, and a second SETNX by the holder answers 0 as Redis does.
    assert_eq!(a.call(&["SETNX", "lock:x", "1"]).await, ":1\r\n");
    assert_eq!(a.call(&["SETNX", "lock:x", "1"]).await, ":0\r\n");
    assert_eq!(a.call(&["UNLINK", "lock:x"]).await, ":1\r\n");
    assert!(!exists(&mut r, &owner("lock:x")).await);
}

#[tokio::test]
async fn a_release_after_the_lease_ran_out_is_refused_and_counted() {
    let (_redis, lg, mut r) = setup("a", 300).await;
    let mut a = RawClient::connect(lg.addr).await;
    let mut b = RawClient::connect(lg.addr).await;
    assert_eq!(a.call(&["SETNX", "lock:x", "1"]).await, ":1\r\n");
    until!("A's lease to run out", !exists(&mut r, "lock:x").await);
    // B's SET NX PX takes the general path (not a SETNX).
    assert_eq!(
        b.call(&["SET", "lock:x", "1", "NX", "PX", "60000"]).await,
        "+OK\r\n"
    );
    let before = fast(&lg);
    // A still believes it holds the key: the fast release checks its token.
    // (Once: after it A holds nothing, and the pooled rule governs its
    // next command, as on the general path.)
    assert_eq!(a.call(&["DEL", "lock:x"]).await, ":0\r\n");
    assert_eq!(fast(&lg), before + 1, "the release ran fast");
    assert!(exists(&mut r, "lock:x").await);
    assert_lease(&mut r, "lock:x", 50_000, 60_000).await;
    let l = &lg.ctx.locks.metrics;
    assert_eq!(m(&l.release_denied), 1);
    assert_eq!(m(&l.lease_expired_before_release), 1);
}

#[tokio::test]
async fn a_lock_key_deleted_behind_lockgates_back_mid_cycle() {
    let (_redis, lg, mut r) = setup("a", 20_000).await;
    let mut a = RawClient::connect(lg.addr).await;
    // Deleted behind lockgate's back between acquire and release: the
    // owner record outlives it; the release answers 0 as Redis would and
    // takes the record with it.
    assert_eq!(a.call(&["SETNX", "lock:x", "1"]).await, ":1\r\n");
    assert_eq!(r.call(&["DEL", "lock:x"]).await, ":1\r\n");
    assert!(exists(&mut r, &owner("lock:x")).await);
    assert_eq!(a.call(&["DEL", "lock:x"]).await, ":0\r\n");
    assert!(!exists(&mut r, &owner("lock:x")).await);

    // Between acquire and extension: EXPIRE answers 0 and the stale owner
    // record goes.
    assert_eq!(a.call(&["SETNX", "lock:y", "1"]).await, ":1\r\n");
    assert_eq!(r.call(&["DEL", "lock:y"]).await, ":1\r\n");
    assert_eq!(a.call(&["EXPIRE", "lock:y", "30"]).await, ":0\r\n");
    assert!(!exists(&mut r, &owner("lock:y")).await);
    assert_eq!(a.call(&["DEL", "lock:y"]).await, ":0\r\n");

    // A stale owner record left by someone else (the key deleted behind
    // lockgate's back, its record kept): the next SETNX takes the lock
    // and the record becomes the new holder's.
    assert_eq!(
        r.call(&["SET", &owner("lock:z"), "gone:1", "PX", "60000"])
            .await,
        "+OK\r\n"
    );
    assert_eq!(a.call(&["SETNX", "lock:z", "1"]).await, ":1\r\n");
    let token = owner_of(&mut r, "lock:z").await.expect("owner record");
    assert!(token.starts_with("a:"), "{token}");
    assert_lease(&mut r, "lock:z", 19_000, 20_000).await;
    assert_eq!(a.call(&["DEL", "lock:z"]).await, ":1\r\n");
    assert!(fast(&lg) >= 6);
}

#[tokio::test]
async fn a_lock_key_expired_behind_lockgates_back_then_taken_by_another() {
    let (_redis, lg, mut r) = setup("a", 20_000).await;
    let mut a = RawClient::connect(lg.addr).await;
    let mut b = RawClient::connect(lg.addr).await;
    assert_eq!(a.call(&["SETNX", "lock:x", "1"]).await, ":1\r\n");
    // Its lease cut short behind lockgate's back (both keys, as a lease
    // running out does), then B takes the lock with the same value.
    assert_eq!(r.call(&["PEXPIRE", "lock:x", "1"]).await, ":1\r\n");
    assert_eq!(r.call(&["PEXPIRE", &owner("lock:x"), "1"]).await, ":1\r\n");
    until!("the cut lease to end", !exists(&mut r, "lock:x").await);
    // (Absorbed while lockgate still counts A's lease: at most a probe
    // interval.)
    until!(
        "B to take the freed lock",
        b.call(&["SETNX", "lock:x", "1"]).await == ":1\r\n"
    );
    let b_token = owner_of(&mut r, "lock:x").await.expect("B's record");
    // A's extension must not touch B's lock (its release is the test
    // above's).
    let before = fast(&lg);
    assert_eq!(a.call(&["EXPIRE", "lock:x", "1"]).await, ":0\r\n");
    assert_eq!(fast(&lg), before + 1);
    assert_eq!(owner_of(&mut r, "lock:x").await, Some(b_token));
    assert_lease(&mut r, "lock:x", 19_000, 20_000).await;
    assert_eq!(b.call(&["DEL", "lock:x"]).await, ":1\r\n");
    let l = &lg.ctx.locks.metrics;
    assert_eq!(m(&l.extend_denied), 1);
    assert_eq!(m(&l.lease_expired_before_release), 1);
}

#[tokio::test]
async fn a_contended_key_leaves_the_fast_path() {
    let (_redis, lg, mut r) = setup("a", 20_000).await;
    let mut b = RawClient::connect(lg.addr).await;
    // Held by a client straight on Redis: lockgate knows nothing of it.
    assert_eq!(
        r.call(&["SET", "lock:x", "1", "PX", "20000"]).await,
        "+OK\r\n"
    );
    // B's first attempt runs fast and fails: lockgate learns a holder.
    assert_eq!(b.call(&["SETNX", "lock:x", "1"]).await, ":0\r\n");
    assert_eq!(fast(&lg), 1);
    // From now on B's attempts are absorbed or, once per probe interval,
    // take the general script (its queue and fairness): the next one that
    // reaches Redis is not fast.
    let calls = |stats: &str| support::redis::command_calls(stats, "evalsha");
    let before = calls(&r.call(&["INFO", "commandstats"]).await);
    until!("an attempt of B to reach Redis again", {
        assert_eq!(b.call(&["SETNX", "lock:x", "1"]).await, ":0\r\n");
        calls(&r.call(&["INFO", "commandstats"]).await) > before
    });
    assert_eq!(fast(&lg), 1, "a contended key takes the general path");
    // The general script took this instance's place in the key's queue.
    assert!(exists(&mut r, "lockgate:queue:{lock:x}").await);
}

#[tokio::test]
async fn off_every_lock_command_takes_the_general_scripts() {
    let (_redis, lg, mut r) = setup_with("a", 20_000, |c| c.locks.fast_path = false).await;
    let mut a = RawClient::connect(lg.addr).await;
    assert_eq!(a.call(&["SETNX", "lock:x", "1"]).await, ":1\r\n");
    assert_eq!(a.call(&["EXPIRE", "lock:x", "30"]).await, ":1\r\n");
    assert_eq!(a.call(&["DEL", "lock:x"]).await, ":1\r\n");
    assert!(!exists(&mut r, &owner("lock:x")).await);
    assert_eq!(fast(&lg), 0);
}
