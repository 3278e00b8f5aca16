//! The EXPIRE family and PERSIST on lock keys, and the SETNX → EXPIRE pair
//! (separate, pipelined, in MULTI) through lockgate against a real
//! redis-server. TTLs are read on Redis directly.

use crate::support;

use support::locks::*;
use support::{cmd, RawClient};

const REFUSED: &str = "-ERR lockgate: PERSIST refused on lock key 'lock:e'";

#[tokio::test]
async fn expire_family_moves_lock_and_owner_record_together() {
    let (_redis, lg, mut r) = setup("a", 20_000).await;
    let mut c = RawClient::connect(lg.addr).await;

    assert_eq!(c.call(&["SETNX", "lock:e", "v"]).await, ":1\r\n");
    let token = owner_of(&mut r, "lock:e").await;
    assert_eq!(c.call(&["EXPIRE", "lock:e", "100"]).await, ":1\r\n");
    assert_lease(&mut r, "lock:e", 99_000, 100_000).await;
    assert_eq!(c.call(&["PEXPIRE", "lock:e", "200000"]).await, ":1\r\n");
    assert_lease(&mut r, "lock:e", 199_000, 200_000).await;
    let at = (now_s() + 300).to_string();
    assert_eq!(c.call(&["EXPIREAT", "lock:e", &at]).await, ":1\r\n");
    assert_lease(&mut r, "lock:e", 298_000, 300_000).await;
    let at = (now_ms() + 400_000).to_string();
    assert_eq!(c.call(&["PEXPIREAT", "lock:e", &at]).await, ":1\r\n");
    assert_lease(&mut r, "lock:e", 399_000, 400_000).await;
    // Options are Redis's: GT with a shorter TTL changes nothing.
    assert_eq!(c.call(&["EXPIRE", "lock:e", "10", "GT"]).await, ":0\r\n");
    assert_lease(&mut r, "lock:e", 398_000, 400_000).await;
    // Shortening works too, and both keys follow.
    assert_eq!(c.call(&["pexpire", "lock:e", "50000"]).await, ":1\r\n");
    assert_lease(&mut r, "lock:e", 49_000, 50_000).await;
    assert_eq!(owner_of(&mut r, "lock:e").await, token);
    assert_eq!(get(&mut r, "lock:e").await.as_deref(), Some("v"));
    assert_eq!(m(&lg.ctx.locks.metrics.extend_denied), 0);

    // EXPIRE to the past deletes the lock, and its owner record with it.
    assert_eq!(c.call(&["PEXPIREAT", "lock:e", "1"]).await, ":1\r\n");
    assert!(!exists(&mut r, "lock:e").await);
    assert!(!exists(&mut r, &owner("lock:e")).await);
}

#[tokio::test]
async fn persist_on_a_lock_key_is_refused_also_inside_multi() {
    let (_redis, lg, mut r) = setup("a", 20_000).await;
    let mut c = RawClient::connect(lg.addr).await;

    assert_eq!(c.call(&["SETNX", "lock:e", "v"]).await, ":1\r\n");
    let refused = c.call(&["PERSIST", "lock:e"]).await;
    assert!(refused.starts_with(REFUSED), "{}", refused);
    assert!(refused.ends_with("\r\n") && !refused[..refused.len() - 2].contains('\n'));
    assert_lease(&mut r, "lock:e", 18_000, 20_000).await;

    // Inside MULTI the refusal takes PERSIST's slot in the EXEC array.
    assert_eq!(c.call(&["MULTI"]).await, "+OK\r\n");
    assert_eq!(c.call(&["SET", "plain", "1"]).await, "+QUEUED\r\n");
    assert_eq!(c.call(&["PERSIST", "lock:e"]).await, "+QUEUED\r\n");
    assert_eq!(c.call(&["GET", "plain"]).await, "+QUEUED\r\n");
    let exec = c.call(&["EXEC"]).await;
    let text = exec;
    let rest = text
        .strip_prefix("*3\r\n+OK\r\n")
        .unwrap_or_else(|| panic!("{text:?}"));
    assert!(rest.starts_with(REFUSED), "{text:?}");
    assert!(rest.ends_with("\r\n$1\r\n1\r\n"), "{text:?}");
    assert_lease(&mut r, "lock:e", 17_000, 20_000).await;
    assert_eq!(m(&lg.ctx.locks.metrics.persist_refused), 2);

    // PERSIST on an ordinary key is Redis's.
    assert_eq!(
        r.call(&["SET", "user:1", "x", "EX", "100"]).await,
        "+OK\r\n"
    );
    assert_eq!(c.call(&["PERSIST", "user:1"]).await, ":1\r\n");
    assert_eq!(int_of(&mut r, &["TTL", "user:1"]).await, -1);
}

/// Sends MULTI, `SETNX key val`, `EXPIRE key secs`, EXEC in one write and
/// returns the EXEC reply after checking the others.
async fn multi_setnx_expire(c: &mut RawClient, key: &str, val: &str, secs: &str) -> String {
    let mut out = cmd(&["MULTI"]);
    out.extend(cmd(&["SETNX", key, val]));
    out.extend(cmd(&["EXPIRE", key, secs]));
    out.extend(cmd(&["EXEC"]));
    c.send(&out).await;
    assert_eq!(c.reply().await, "+OK\r\n");
    assert_eq!(c.reply().await, "+QUEUED\r\n");
    assert_eq!(c.reply().await, "+QUEUED\r\n");
    c.reply().await
}

#[tokio::test]
async fn setnx_expire_in_multi_loser_does_not_touch_the_holders_lease() {
    let (_redis, lg, mut r) = setup("a", 20_000).await;
    let mut holder = RawClient::connect(lg.addr).await;
    let mut loser = RawClient::connect(lg.addr).await;

    let exec = multi_setnx_expire(&mut holder, "lock:m", "v", "7").await;
    assert_eq!(exec, "*2\r\n:1\r\n:1\r\n");
    assert_lease(&mut r, "lock:m", 6_000, 7_000).await;
    let token = owner_of(&mut r, "lock:m").await.expect("owner record");
    assert!(token.starts_with("a:"), "{token}");

    let exec = multi_setnx_expire(&mut loser, "lock:m", "w", "100").await;
    assert_eq!(exec, "*2\r\n:0\r\n:0\r\n");
    assert_lease(&mut r, "lock:m", 5_000, 7_000).await;
    assert_eq!(get(&mut r, "lock:m").await.as_deref(), Some("v"));
    assert_eq!(owner_of(&mut r, "lock:m").await, Some(token));

    // The other way round: the holder's 100 s survives a loser's 7 s.
    let exec = multi_setnx_expire(&mut holder, "lock:m2", "v", "100").await;
    assert_eq!(exec, "*2\r\n:1\r\n:1\r\n");
    let exec = multi_setnx_expire(&mut loser, "lock:m2", "w", "7").await;
    assert_eq!(exec, "*2\r\n:0\r\n:0\r\n");
    assert_lease(&mut r, "lock:m2", 98_000, 100_000).await;
}

#[tokio::test]
async fn setnx_expire_pipelined_and_separate_behave_the_same() {
    let (_redis, lg, mut r) = setup("a", 20_000).await;
    let mut holder = RawClient::connect(lg.addr).await;
    let mut loser = RawClient::connect(lg.addr).await;

    // Pipelined: both commands in one write.
    let pair = |key: &str, val: &str, secs: &str| {
        let mut out = cmd(&["SETNX", key, val]);
        out.extend(cmd(&["EXPIRE", key, secs]));
        out
    };
    holder.send(&pair("lock:p", "v", "7")).await;
    assert_eq!(holder.reply().await, ":1\r\n");
    assert_eq!(holder.reply().await, ":1\r\n");
    assert_lease(&mut r, "lock:p", 6_000, 7_000).await;
    loser.send(&pair("lock:p", "w", "100")).await;
    assert_eq!(loser.reply().await, ":0\r\n");
    assert_eq!(loser.reply().await, ":0\r\n");
    assert_lease(&mut r, "lock:p", 5_000, 7_000).await;
    assert_eq!(get(&mut r, "lock:p").await.as_deref(), Some("v"));

    // Separate commands: right after SETNX the key already has its lease.
    assert_eq!(holder.call(&["SETNX", "lock:s", "v"]).await, ":1\r\n");
    assert_lease(&mut r, "lock:s", 19_000, 20_000).await;
    assert_eq!(holder.call(&["EXPIRE", "lock:s", "7"]).await, ":1\r\n");
    assert_lease(&mut r, "lock:s", 6_000, 7_000).await;
    assert_eq!(loser.call(&["SETNX", "lock:s", "w"]).await, ":0\r\n");
    assert_eq!(loser.call(&["EXPIRE", "lock:s", "100"]).await, ":0\r\n");
    assert_lease(&mut r, "lock:s", 5_000, 7_000).await;
    assert_eq!(get(&mut r, "lock:s").await.as_deref(), Some("v"));

    let l = &lg.ctx.locks.metrics;
    assert_eq!(
        (m(&l.acquired), m(&l.contended), m(&l.extend_denied)),
        (2, 2, 2)
    );
    // A refused extension by a connection that lost is not a lapsed lease.
    assert_eq!(m(&l.lease_expired_before_release), 0);
}

#[tokio::test]
async fn a_crash_between_setnx_and_expire_leaves_a_lock_that_expires() {
    let (_redis, lg, mut r) = setup("a", 300).await;
    let mut app = RawClient::connect(lg.addr).await;
    assert_eq!(app.call(&["SETNX", "lock:crash", "v"]).await, ":1\r\n");
    drop(app); // the process dies before its EXPIRE
               // A lease, never "no TTL" (-1); -2 if it already ran out.
    let left = pttl(&mut r, "lock:crash").await;
    assert!(
        left == -2 || (0 < left && left <= 300),
        "PTTL lock:crash: {left}"
    );
    until!("lock:crash to expire", !exists(&mut r, "lock:crash").await);
    assert!(!exists(&mut r, &owner("lock:crash")).await);
    let mut other = RawClient::connect(lg.addr).await;
    assert_eq!(other.call(&["SETNX", "lock:crash", "w"]).await, ":1\r\n");
}

#[tokio::test]
async fn an_owner_whose_lease_lapsed_cannot_extend_the_next_holder() {
    let (_redis, lg, mut r) = setup("a", 300).await;
    let mut a = RawClient::connect(lg.addr).await;
    let mut b = RawClient::connect(lg.addr).await;

    assert_eq!(a.call(&["SETNX", "lock:x", "va"]).await, ":1\r\n");
    until!("lock:x to expire", !exists(&mut r, "lock:x").await);
    assert_eq!(
        b.call(&["SET", "lock:x", "vb", "NX", "PX", "60000"]).await,
        "+OK\r\n"
    );
    assert_eq!(a.call(&["EXPIRE", "lock:x", "5"]).await, ":0\r\n");
    assert_lease(&mut r, "lock:x", 55_000, 60_000).await;
    let l = &lg.ctx.locks.metrics;
    assert_eq!(
        (m(&l.extend_denied), m(&l.lease_expired_before_release)),
        (1, 1)
    );
    assert_eq!(b.call(&["PEXPIRE", "lock:x", "90000"]).await, ":1\r\n");
    assert_lease(&mut r, "lock:x", 89_000, 90_000).await;
}

/// A holder's `EXPIRE` that finds its lease lapsed, with an acquisition
/// pipelined behind it on the key now free: the acquisition is the
/// connection's, so its next extension passes the owner check, as on Redis
/// (found by the differential test, seed 332985417: the lapsed extension
/// dropped the whole record, the acquisition behind it among it).
#[tokio::test]
async fn an_acquisition_pipelined_behind_a_lapsed_extension_is_kept() {
    let (_redis, lg, mut r) = setup("a", 300).await;
    let mut a = RawClient::connect(lg.addr).await;

    assert_eq!(a.call(&["SETNX", "lock:p", "v1"]).await, ":1\r\n");
    until!("lock:p to expire", !exists(&mut r, "lock:p").await);
    let mut pipeline = cmd(&["EXPIRE", "lock:p", "1"]);
    pipeline.extend(cmd(&["SET", "lock:p", "v2", "NX"]));
    a.send(&pipeline).await;
    assert_eq!(a.read_raw_frames(2).await, b":0\r\n+OK\r\n");
    let l = &lg.ctx.locks.metrics;
    assert_eq!(m(&l.lease_expired_before_release), 1);
    // A re-entrant attempt refused: the connection still holds the key.
    assert_eq!(a.call(&["SETNX", "lock:p", "v3"]).await, ":0\r\n");
    assert_eq!(a.call(&["PEXPIRE", "lock:p", "60000"]).await, ":1\r\n");
    assert_lease(&mut r, "lock:p", 59_000, 60_000).await;
    assert_eq!(a.call(&["DEL", "lock:p"]).await, ":1\r\n");
}
