//! Lock scripts go up by SHA1 (`EVALSHA`, loaded once per connection), and
//! Redis may lose them (`SCRIPT FLUSH` straight on Redis): the client still
//! gets its command's own reply in its place, never `NOSCRIPT`, and the
//! lock is what it would have been. Checked against a real redis-server.

use crate::support;

use support::locks::*;
use support::{cmd, RawClient};

/// Empties Redis's script cache behind lockgate's back.
async fn flush(r: &mut RawClient) {
    assert_eq!(r.call(&["SCRIPT", "FLUSH"]).await, "+OK\r\n");
}

#[tokio::test]
async fn a_flushed_script_cache_never_reaches_the_client() {
    let (_redis, lg, mut r) = setup("ns", 20_000).await;
    let reruns = || m(&lg.ctx.locks.metrics.noscript_reruns);
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(c.call(&["SETNX", "lock:a", "v"]).await, ":1\r\n");
    assert_eq!(reruns(), 0);

    // Acquisition: loaded on this connection, then flushed.
    flush(&mut r).await;
    assert_eq!(c.call(&["SETNX", "lock:b", "v"]).await, ":1\r\n");
    assert_eq!(reruns(), 1);
    assert_lease(&mut r, "lock:b", 19_000, 20_000).await;
    assert!(owner_of(&mut r, "lock:b").await.is_some(), "owner record");
    // Loaded again since: no rerun, and the held lock answers 0.
    assert_eq!(c.call(&["SETNX", "lock:b", "w"]).await, ":0\r\n");
    assert_eq!(reruns(), 1);
    assert_eq!(get(&mut r, "lock:b").await.as_deref(), Some("v"));

    // Extension and release: each script used (so loaded) on this
    // connection, then flushed.
    assert_eq!(c.call(&["EXPIRE", "lock:b", "40"]).await, ":1\r\n");
    flush(&mut r).await;
    assert_eq!(c.call(&["EXPIRE", "lock:b", "50"]).await, ":1\r\n");
    assert_eq!(reruns(), 2);
    assert_lease(&mut r, "lock:b", 49_000, 50_000).await;
    assert_eq!(c.call(&["DEL", "lock:a"]).await, ":1\r\n");
    flush(&mut r).await;
    assert_eq!(c.call(&["DEL", "lock:b"]).await, ":1\r\n");
    assert!(!exists(&mut r, "lock:b").await);
    assert!(owner_of(&mut r, "lock:b").await.is_none());
    assert_eq!(reruns(), 3);
    lg.stop().await;
}

/// Commands pipelined behind a lock command Redis answered `NOSCRIPT` ran
/// before its rerun (the deliberate difference in docs/behaviour.md: the
/// `GET` finds no lock yet); the replies still come in command order with
/// their own shapes.
#[tokio::test]
async fn pipelined_commands_keep_their_replies_in_order() {
    let (_redis, lg, mut r) = setup("ns", 20_000).await;
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(c.call(&["SETNX", "lock:warm", "v"]).await, ":1\r\n");
    flush(&mut r).await;
    let mut out = Vec::new();
    for args in [
        &["SETNX", "lock:p", "1"][..],
        &["SET", "plain", "x"],
        &["SETNX", "lock:q", "2"],
        &["GET", "lock:p"],
    ] {
        out.extend_from_slice(&cmd(args));
    }
    c.send(&out).await;
    let replies = c.read_raw_frames(4).await;
    assert_eq!(
        String::from_utf8_lossy(&replies),
        ":1\r\n+OK\r\n:1\r\n$-1\r\n"
    );
    assert_eq!(get(&mut r, "lock:p").await.as_deref(), Some("1"));
    assert_eq!(get(&mut r, "lock:q").await.as_deref(), Some("2"));
    assert_lease(&mut r, "lock:p", 19_000, 20_000).await;
    assert_eq!(m(&lg.ctx.locks.metrics.noscript_reruns), 2);
    lg.stop().await;
}

/// The rerun happens in the database the client selected.
#[tokio::test]
async fn a_rerun_keeps_the_clients_database() {
    let (_redis, lg, mut r) = setup("ns", 20_000).await;
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(c.call(&["SELECT", "2"]).await, "+OK\r\n");
    assert_eq!(c.call(&["SETNX", "lock:d", "v"]).await, ":1\r\n");
    flush(&mut r).await;
    assert_eq!(c.call(&["SETNX", "lock:e", "v"]).await, ":1\r\n");
    assert_eq!(m(&lg.ctx.locks.metrics.noscript_reruns), 1);
    assert!(!exists(&mut r, "lock:e").await, "not in database 0");
    assert_eq!(r.call(&["SELECT", "2"]).await, "+OK\r\n");
    assert_eq!(get(&mut r, "lock:e").await.as_deref(), Some("v"));
    assert_lease(&mut r, "lock:e", 19_000, 20_000).await;
    assert!(owner_of(&mut r, "lock:e").await.is_some(), "owner record");
    lg.stop().await;
}

/// `SCRIPT FLUSH` through lockgate: every connection loads its scripts
/// again, so none needs a rerun.
#[tokio::test]
async fn a_flush_through_lockgate_reloads_everywhere() {
    let (_redis, lg, mut r) = setup("ns", 20_000).await;
    let mut c1 = RawClient::connect(lg.addr).await;
    let mut c2 = RawClient::connect(lg.addr).await;
    assert_eq!(c1.call(&["SETNX", "lock:f", "v"]).await, ":1\r\n");
    assert_eq!(c2.call(&["SCRIPT", "FLUSH"]).await, "+OK\r\n");
    assert_eq!(c1.call(&["SETNX", "lock:g", "v"]).await, ":1\r\n");
    assert_eq!(c1.call(&["DEL", "lock:f"]).await, ":1\r\n");
    assert_eq!(m(&lg.ctx.locks.metrics.noscript_reruns), 0);
    assert!(exists(&mut r, "lock:g").await);
    lg.stop().await;
}

/// A RESP3 client gets its null in RESP3 from a rerun too.
#[tokio::test]
async fn a_rerun_answers_resp3_nulls() {
    let (_redis, lg, mut r) = setup("ns", 20_000).await;
    let mut c = RawClient::connect(lg.addr).await;
    let hello = c.call_raw(&["HELLO", "3"]).await;
    assert!(hello.starts_with(b"%"), "HELLO 3");
    assert_eq!(c.call(&["SET", "lock:warm", "v", "NX"]).await, "+OK\r\n");
    // Held by someone lockgate does not know of, so the attempt asks Redis.
    assert_eq!(r.call(&["SET", "lock:h", "v"]).await, "+OK\r\n");
    flush(&mut r).await;
    assert_eq!(c.call(&["SET", "lock:h", "w", "NX"]).await, "_\r\n");
    assert_eq!(m(&lg.ctx.locks.metrics.noscript_reruns), 1);
    assert_eq!(get(&mut r, "lock:h").await.as_deref(), Some("v"));
    lg.stop().await;
}

/// A connection that subscribed sends lock scripts as `EVAL` (Redis
/// refuses `SCRIPT LOAD` while a RESP2 connection is subscribed, unseen):
/// after it unsubscribes, a flush needs no rerun.
#[tokio::test]
async fn a_subscribed_connection_sends_eval() {
    let (_redis, lg, mut r) = setup("ns", 20_000).await;
    let mut c = RawClient::connect(lg.addr).await;
    let confirmed = c.call_raw(&["SUBSCRIBE", "ch"]).await;
    assert!(confirmed.starts_with(b"*3"), "SUBSCRIBE confirmed");
    let refused = c.call(&["SETNX", "lock:s", "v"]).await;
    assert!(
        refused.starts_with("-ERR") && refused.contains("eval"),
        "{refused}"
    );
    let left = c.call_raw(&["UNSUBSCRIBE"]).await;
    assert!(left.starts_with(b"*3"), "UNSUBSCRIBE confirmed");
    assert_eq!(c.call(&["SETNX", "lock:s", "v"]).await, ":1\r\n");
    flush(&mut r).await;
    assert_eq!(c.call(&["SETNX", "lock:t", "v"]).await, ":1\r\n");
    assert_eq!(m(&lg.ctx.locks.metrics.noscript_reruns), 0);
    lg.stop().await;
}
