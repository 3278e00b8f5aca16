//! Connection state through lockgate against a real Redis 7.0: AUTH with
//! requirepass and ACL users, HELLO 3 / RESP3 replies and push frames
//! (client tracking), HELLO 2, CLIENT SETNAME/GETNAME/SETINFO/ID, RESET and
//! QUIT. Where Redis's own bytes are the reference, a direct connection to the
//! same Redis gives them.

use crate::support;

use lockgate::metrics::ProxyMetrics;
use redis_protocol::resp3::types::OwnedFrame;
use support::resilience::{client_list, decode3};
use support::{cmd, show, Lockgate, RawClient, RedisServer, WAIT};

const WRONGPASS: &[u8] = b"-WRONGPASS invalid username-password pair or user is disabled.\r\n";
const INVALIDATE_K: &[u8] = b">2\r\n$10\r\ninvalidate\r\n*1\r\n$1\r\nk\r\n";

#[tokio::test]
async fn requirepass_noauth_before_ok_after() {
    let redis = RedisServer::start_with(&["--requirepass", "pw"]);
    let lg = Lockgate::start(&redis.addr()).await;
    let mut c = RawClient::connect(lg.addr).await;
    let mut d = RawClient::connect(redis.addr()).await;

    let before = c.call_raw(&["GET", "k"]).await;
    assert!(before.starts_with(b"-NOAUTH"), "got {}", show(&before));
    assert_eq!(
        before,
        d.call_raw(&["GET", "k"]).await,
        "NOAUTH as Redis says it"
    );

    // A wrong password: Redis's own error, byte for byte, and still no access.
    let wrong = c.call_raw(&["AUTH", "nope"]).await;
    assert_eq!(wrong, WRONGPASS, "got {}", show(&wrong));
    assert_eq!(wrong, d.call_raw(&["AUTH", "nope"]).await);
    let wrong_user = c.call_raw(&["AUTH", "nobody", "pw"]).await;
    assert_eq!(wrong_user, d.call_raw(&["AUTH", "nobody", "pw"]).await);
    let still = c.call_raw(&["PING"]).await;
    assert!(still.starts_with(b"-NOAUTH"), "got {}", show(&still));

    assert_eq!(c.call_raw(&["AUTH", "pw"]).await, b"+OK\r\n");
    assert_eq!(c.call_raw(&["SET", "k", "v"]).await, b"+OK\r\n");
    assert_eq!(c.call_raw(&["GET", "k"]).await, b"$1\r\nv\r\n");
    assert_eq!(d.call_raw(&["AUTH", "pw"]).await, b"+OK\r\n");
    assert_eq!(d.call_raw(&["GET", "k"]).await, b"$1\r\nv\r\n", "on Redis");

    // Authentication is per connection: a second client starts without it.
    let mut c2 = RawClient::connect(lg.addr).await;
    let other = c2.call_raw(&["GET", "k"]).await;
    assert!(other.starts_with(b"-NOAUTH"), "got {}", show(&other));

    // HELLO with AUTH in one go, switching to RESP3.
    let mut c3 = RawClient::connect(lg.addr).await;
    let hello = c3.call_raw(&["HELLO", "3", "AUTH", "default", "pw"]).await;
    assert!(hello.starts_with(b"%"), "HELLO 3 AUTH: {}", show(&hello));
    assert_eq!(c3.call_raw(&["GET", "nokey"]).await, b"_\r\n");
    let bad_hello = c3.call_raw(&["HELLO", "3", "AUTH", "default", "bad"]).await;
    assert_eq!(bad_hello, WRONGPASS, "got {}", show(&bad_hello));
    lg.stop().await;
}

#[tokio::test]
async fn acl_user_auth_and_permissions() {
    let redis = RedisServer::start_with(&["--requirepass", "pw"]);
    let lg = Lockgate::start(&redis.addr()).await;
    let mut admin = RawClient::connect(lg.addr).await;
    assert_eq!(admin.call_raw(&["AUTH", "pw"]).await, b"+OK\r\n");
    let setuser = admin
        .call_raw(&["ACL", "SETUSER", "alice", "on", ">alicepw", "~*", "+@all"])
        .await;
    assert_eq!(setuser, b"+OK\r\n", "got {}", show(&setuser));
    let setuser = admin
        .call_raw(&["ACL", "SETUSER", "bob", "on", ">bobpw", "~bob:*", "+get"])
        .await;
    assert_eq!(setuser, b"+OK\r\n", "got {}", show(&setuser));

    let mut d = RawClient::connect(redis.addr()).await;
    let mut c = RawClient::connect(lg.addr).await;
    let wrong = c.call_raw(&["AUTH", "alice", "pw"]).await;
    assert_eq!(wrong, WRONGPASS, "got {}", show(&wrong));
    assert_eq!(wrong, d.call_raw(&["AUTH", "alice", "pw"]).await);
    assert_eq!(c.call_raw(&["AUTH", "alice", "alicepw"]).await, b"+OK\r\n");
    assert_eq!(c.call_raw(&["ACL", "WHOAMI"]).await, b"$5\r\nalice\r\n");
    assert_eq!(c.call_raw(&["SET", "a:k", "1"]).await, b"+OK\r\n");

    // A restricted user gets Redis's own NOPERM errors, byte for byte.
    let mut b = RawClient::connect(lg.addr).await;
    assert_eq!(b.call_raw(&["AUTH", "bob", "bobpw"]).await, b"+OK\r\n");
    assert_eq!(d.call_raw(&["AUTH", "bob", "bobpw"]).await, b"+OK\r\n");
    assert_eq!(b.call_raw(&["GET", "bob:x"]).await, b"$-1\r\n");
    for args in [&["GET", "a:k"][..], &["SET", "bob:x", "1"][..]] {
        let via = b.call_raw(args).await;
        assert!(via.starts_with(b"-NOPERM"), "{args:?}: {}", show(&via));
        assert_eq!(via, d.call_raw(args).await, "{args:?}");
    }
    lg.stop().await;
}

#[tokio::test]
async fn hello_3_gives_resp3_replies_and_hello_2_goes_back() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(c.call_raw(&["HSET", "h", "f", "v"]).await, b":1\r\n");
    assert_eq!(
        c.call_raw(&["HGETALL", "h"]).await,
        b"*2\r\n$1\r\nf\r\n$1\r\nv\r\n"
    );

    let hello = decode3(&c.call_raw(&["HELLO", "3"]).await);
    let OwnedFrame::Map { data, .. } = &hello else {
        panic!("HELLO 3 is not a map: {hello:?}");
    };
    let proto = data
        .iter()
        .find(|(k, _)| matches!(k, OwnedFrame::BlobString { data, .. } if data == b"proto"))
        .map(|(_, v)| v.clone());
    assert!(
        matches!(proto, Some(OwnedFrame::Number { data: 3, .. })),
        "proto in {hello:?}"
    );

    assert_eq!(
        c.call_raw(&["HGETALL", "h"]).await,
        b"%1\r\n$1\r\nf\r\n$1\r\nv\r\n"
    );
    assert_eq!(c.call_raw(&["GET", "nokey"]).await, b"_\r\n");
    assert_eq!(c.call_raw(&["HGET", "h", "nofield"]).await, b"_\r\n");
    assert_eq!(
        c.call_raw(&["SMEMBERS", "noset"]).await,
        b"~0\r\n",
        "sets are `~` in RESP3"
    );

    let back = c.call_raw(&["HELLO", "2"]).await;
    assert!(back.starts_with(b"*14\r\n"), "HELLO 2: {}", show(&back));
    assert_eq!(
        c.call_raw(&["HGETALL", "h"]).await,
        b"*2\r\n$1\r\nf\r\n$1\r\nv\r\n"
    );
    assert_eq!(c.call_raw(&["GET", "nokey"]).await, b"$-1\r\n");

    // An unsupported protocol version is Redis's error, and nothing changes.
    let mut d = RawClient::connect(redis.addr()).await;
    let bad = c.call_raw(&["HELLO", "4"]).await;
    assert!(bad.starts_with(b"-NOPROTO"), "got {}", show(&bad));
    assert_eq!(bad, d.call_raw(&["HELLO", "4"]).await);
    assert_eq!(c.call_raw(&["GET", "nokey"]).await, b"$-1\r\n");
    lg.stop().await;
}

/// Sets `c` up as a RESP3 connection with client tracking on, tracking `k`.
async fn tracked(c: &mut RawClient) {
    let hello = c.call_raw(&["HELLO", "3"]).await;
    assert!(hello.starts_with(b"%"), "HELLO 3: {}", show(&hello));
    assert_eq!(c.call_raw(&["CLIENT", "TRACKING", "ON"]).await, b"+OK\r\n");
    let got = c.call_raw(&["GET", "k"]).await;
    assert!(
        got.starts_with(b"$") || got == b"_\r\n",
        "GET k: {}",
        show(&got)
    );
}

#[tokio::test]
async fn tracking_invalidation_push_arrives_in_order() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut direct = RawClient::connect(redis.addr()).await;
    assert_eq!(direct.call_raw(&["SET", "k", "v1"]).await, b"+OK\r\n");

    let mut c = RawClient::connect(lg.addr).await;
    tracked(&mut c).await;

    // Another client (itself through lockgate) changes the key.
    let mut other = RawClient::connect(lg.addr).await;
    assert_eq!(other.call_raw(&["SET", "k", "v2"]).await, b"+OK\r\n");
    // The push was sent by Redis before the PING was: push, then PONG.
    c.send(&cmd(&["PING"])).await;
    let push = decode3(&c.read_raw().await);
    assert!(
        matches!(&push, OwnedFrame::Push { data, .. } if data.len() == 2),
        "expected an invalidation push, got {push:?}"
    );
    assert_eq!(c.read_raw().await, b"+PONG\r\n", "the PONG still comes");
    assert_eq!(c.call_raw(&["GET", "k"]).await, b"$2\r\nv2\r\n");

    // Invalidation caused by the connection itself lands between replies of a
    // pipeline; lockgate's own reply (a protocol error) must come after the
    // replies Redis sent, exactly as Redis orders them on a direct connection.
    let pipeline = [
        cmd(&["SET", "k", "v3"]),
        cmd(&["PING"]),
        b"*1\r\n*1\r\n".to_vec(),
    ]
    .concat();
    c.send(&pipeline).await;
    let via = c.frames_to_close().await;

    let mut d = RawClient::connect(redis.addr()).await;
    tracked(&mut d).await;
    d.send(&pipeline).await;
    let reference = d.frames_to_close().await;
    assert_eq!(
        reference,
        vec![
            "+OK\r\n".to_string(),
            show(INVALIDATE_K),
            "+PONG\r\n".to_string(),
            "-ERR Protocol error: expected '$', got '*'\r\n".to_string(),
        ],
        "Redis 7.0's own order (reference)"
    );
    assert_eq!(via, reference, "through lockgate");
    lg.stop().await;
}

#[tokio::test]
async fn tracking_push_between_pipelined_replies() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut c = RawClient::connect(lg.addr).await;
    tracked(&mut c).await;
    // GET k tracks, SET k invalidates (push), GET k tracks again, PING.
    c.send(
        &[
            cmd(&["SET", "k", "a"]),
            cmd(&["GET", "k"]),
            cmd(&["SET", "k", "b"]),
            cmd(&["PING"]),
        ]
        .concat(),
    )
    .await;
    let mut frames = Vec::new();
    for _ in 0..6 {
        frames.push(show(&c.read_raw().await));
    }
    assert_eq!(
        frames,
        vec![
            "+OK\r\n",
            show(INVALIDATE_K).as_str(),
            "$1\r\na\r\n",
            "+OK\r\n",
            show(INVALIDATE_K).as_str(),
            "+PONG\r\n"
        ]
    );
    assert_eq!(
        ProxyMetrics::get(&lg.ctx.metrics.unexpected_replies),
        0,
        "push frames are not replies"
    );
    lg.stop().await;
}

/// A push Redis sends before the point where lockgate answers a malformed
/// request itself must still reach the client, ahead of the error, as it does
/// on a direct connection.
#[tokio::test]
async fn push_before_a_protocol_error_is_delivered() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let pipeline = [cmd(&["SET", "k", "v3"]), b"*1\r\n*1\r\n".to_vec()].concat();
    let expected = vec![
        "+OK\r\n".to_string(),
        show(INVALIDATE_K),
        "-ERR Protocol error: expected '$', got '*'\r\n".to_string(),
    ];
    for (name, addr) in [("Redis", redis.addr()), ("lockgate", lg.addr.to_string())] {
        let mut c = RawClient::connect(addr.as_str()).await;
        tracked(&mut c).await;
        c.send(&pipeline).await;
        assert_eq!(c.frames_to_close().await, expected, "{name}");
    }
    lg.stop().await;
}

#[tokio::test]
async fn client_setname_getname_setinfo_id() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut c = RawClient::connect(lg.addr).await;
    let mut d = RawClient::connect(redis.addr()).await;

    // CLIENT ID through lockgate is the id of lockgate's upstream connection.
    let id = c.call_raw(&["CLIENT", "ID"]).await;
    assert!(id.starts_with(b":"), "got {}", show(&id));
    let id: u64 = show(&id[1..id.len() - 2]).parse().expect("an integer id");

    assert_eq!(
        c.call_raw(&["CLIENT", "GETNAME"]).await,
        d.call_raw(&["CLIENT", "GETNAME"]).await
    );
    assert_eq!(c.call_raw(&["CLIENT", "GETNAME"]).await, b"$-1\r\n");
    assert_eq!(
        c.call_raw(&["CLIENT", "SETNAME", "app-1"]).await,
        b"+OK\r\n"
    );
    assert_eq!(c.call_raw(&["CLIENT", "GETNAME"]).await, b"$5\r\napp-1\r\n");
    let bad = c.call_raw(&["CLIENT", "SETNAME", "has space"]).await;
    assert!(bad.starts_with(b"-ERR"), "got {}", show(&bad));
    assert_eq!(bad, d.call_raw(&["CLIENT", "SETNAME", "has space"]).await);

    // Redis sees the name on the connection with that id.
    let lines = client_list(&redis.addr(), None).await;
    let mine = lines
        .iter()
        .find(|l| l.starts_with(&format!("id={id} ")))
        .unwrap_or_else(|| panic!("no connection id={id} on Redis: {lines:?}"));
    assert!(mine.contains(" name=app-1 "), "{mine}");
    let info = show(&c.call_raw(&["CLIENT", "INFO"]).await);
    assert!(info.contains(&format!("id={id} ")), "{info}");

    // CLIENT SETINFO does not exist in 7.0: lockgate passes Redis's error on.
    for args in [
        &["CLIENT", "SETINFO", "lib-name", "lockgate-test"][..],
        &["CLIENT", "SETINFO", "lib-ver", "1.0"][..],
    ] {
        let via = c.call_raw(args).await;
        let reference = d.call_raw(args).await;
        assert!(reference.starts_with(b"-ERR"), "{}", show(&reference));
        assert_eq!(show(&via), show(&reference), "{args:?}");
    }
    assert_eq!(c.call_raw(&["PING"]).await, b"+PONG\r\n");
    lg.stop().await;
}

#[tokio::test]
async fn reset_restores_a_fresh_connection() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(c.call_raw(&["HSET", "h", "f", "v"]).await, b":1\r\n");
    let hello = c.call_raw(&["HELLO", "3"]).await;
    assert!(hello.starts_with(b"%"), "{}", show(&hello));
    assert_eq!(c.call_raw(&["SELECT", "3"]).await, b"+OK\r\n");
    assert_eq!(c.call_raw(&["CLIENT", "SETNAME", "x"]).await, b"+OK\r\n");
    assert_eq!(c.call_raw(&["MULTI"]).await, b"+OK\r\n");
    assert_eq!(c.call_raw(&["PING"]).await, b"+QUEUED\r\n");

    assert_eq!(c.call_raw(&["RESET"]).await, b"+RESET\r\n");
    assert_eq!(
        c.call_raw(&["HGETALL", "h"]).await,
        b"*2\r\n$1\r\nf\r\n$1\r\nv\r\n",
        "RESP2 and db 0 again"
    );
    assert_eq!(c.call_raw(&["CLIENT", "GETNAME"]).await, b"$-1\r\n");
    assert_eq!(c.call_raw(&["EXEC"]).await, b"-ERR EXEC without MULTI\r\n");

    // RESET also leaves subscribed mode.
    assert_eq!(
        c.call_raw(&["SUBSCRIBE", "ch"]).await,
        b"*3\r\n$9\r\nsubscribe\r\n$2\r\nch\r\n:1\r\n"
    );
    assert_eq!(c.call_raw(&["RESET"]).await, b"+RESET\r\n");
    assert_eq!(
        c.call_raw(&["PING"]).await,
        b"+PONG\r\n",
        "not the pub/sub PONG"
    );
    let mut pubr = RawClient::connect(redis.addr()).await;
    assert_eq!(pubr.call_raw(&["PUBLISH", "ch", "m"]).await, b":0\r\n");
    lg.stop().await;
}

/// In subscribed mode replies are not counted; the `+RESET` reply is where
/// counting starts again, so a protocol error pipelined after `RESET` and
/// `PING` must come after their replies, as on Redis.
#[tokio::test]
async fn reset_in_subscribed_mode_then_protocol_error_keeps_order() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let pipeline = [cmd(&["RESET"]), cmd(&["PING"]), b"*x\r\n".to_vec()].concat();
    let expected = vec![
        "+RESET\r\n",
        "+PONG\r\n",
        "-ERR Protocol error: invalid multibulk length\r\n",
    ];
    let mut conns = [
        ("Redis", RawClient::connect(redis.addr()).await),
        ("lockgate", RawClient::connect(lg.addr).await),
    ];
    for (name, c) in conns.iter_mut() {
        assert_eq!(
            c.call_raw(&["SUBSCRIBE", "ch"]).await,
            b"*3\r\n$9\r\nsubscribe\r\n$2\r\nch\r\n:1\r\n",
            "{name}"
        );
        let mut pubr = RawClient::connect(redis.addr()).await;
        until!(
            "the earlier subscriber to be gone",
            RawClient::connect(redis.addr())
                .await
                .call_raw(&["PUBSUB", "NUMSUB", "ch"])
                .await
                == b"*2\r\n$2\r\nch\r\n:1\r\n"
        );
        assert_eq!(
            pubr.call_raw(&["PUBLISH", "ch", "m"]).await,
            b":1\r\n",
            "{name}"
        );
        assert_eq!(
            c.read_raw().await,
            b"*3\r\n$7\r\nmessage\r\n$2\r\nch\r\n$1\r\nm\r\n",
            "{name}"
        );
        c.send(&pipeline).await;
        assert_eq!(c.frames_to_close().await, expected, "{name}");
    }
    lg.stop().await;
}

#[tokio::test]
async fn quit_replies_ok_then_closes() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(c.call_raw(&["PING"]).await, b"+PONG\r\n");
    assert_eq!(c.call_raw(&["QUIT"]).await, b"+OK\r\n");
    assert!(c.closed_within(WAIT).await, "closed after QUIT");
    until!(
        "lockgate's upstream connection to go",
        client_list(&redis.addr(), None).await.is_empty()
    );
    assert_eq!(ProxyMetrics::get(&lg.ctx.metrics.upstream_dropped), 0);

    // Inline QUIT too.
    let mut c = RawClient::connect(lg.addr).await;
    c.send(b"QUIT\r\n").await;
    assert_eq!(c.read_raw().await, b"+OK\r\n");
    assert!(c.closed_within(WAIT).await, "closed after inline QUIT");
    lg.stop().await;
}

#[tokio::test]
async fn pipelined_quit_matches_redis() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let pipeline = [
        cmd(&["SET", "before", "1"]),
        cmd(&["QUIT"]),
        cmd(&["SET", "after", "1"]),
    ]
    .concat();
    let reference = support::resilience::exchange_to_close(redis.addr(), &pipeline).await;
    assert_eq!(reference, b"+OK\r\n+OK\r\n", "Redis itself");
    let mut d = RawClient::connect(redis.addr()).await;
    assert_eq!(d.call_raw(&["DEL", "before", "after"]).await, b":1\r\n");

    let via = support::resilience::exchange_to_close(lg.addr, &pipeline).await;
    assert_eq!(show(&via), show(&reference));
    assert_eq!(d.call_raw(&["EXISTS", "before"]).await, b":1\r\n");
    assert_eq!(
        d.call_raw(&["EXISTS", "after"]).await,
        b":0\r\n",
        "nothing after QUIT runs"
    );
    // Redis closing after QUIT is the client's wish, not a lost upstream.
    until!(
        "the session to end",
        ProxyMetrics::get(&lg.ctx.metrics.connections_active) == 0
    );
    assert_eq!(
        ProxyMetrics::get(&lg.ctx.metrics.upstream_dropped),
        0,
        "a QUIT followed by pipelined commands was counted as an upstream drop"
    );
    assert_eq!(ProxyMetrics::get(&lg.ctx.metrics.errors_upstream), 0);
    lg.stop().await;
}
