//! Lock acquisition through lockgate against a real redis-server: SETNX and
//! SET … NX become one atomic lease + owner record, reply shapes unchanged;
//! SETNX on ordinary keys passes through untouched and is counted; errors
//! keep their shape; pipelines keep their order. State is checked on Redis
//! directly, not only through lockgate.

use crate::support;

use support::locks::*;
use support::{cmd, RawClient};

#[tokio::test]
async fn setnx_is_one_eval_with_lease_and_owner_record() {
    // Every attempt goes to Redis here (no storm absorption), so each is
    // seen as its one Lua call.
    let (_redis, lg, mut r) =
        setup_with("a", 20_000, |c| c.locks.retry.probe_interval_ms = 0).await;
    let mut c1 = RawClient::connect(lg.addr).await;
    let mut c2 = RawClient::connect(lg.addr).await;
    // Both upstream connections exist before the counters are reset.
    assert_eq!(c1.call(&["PING"]).await, "+PONG\r\n");
    assert_eq!(c2.call(&["PING"]).await, "+PONG\r\n");
    assert_eq!(r.call(&["CONFIG", "RESETSTAT"]).await, "+OK\r\n");

    assert_eq!(c1.call(&["SETNX", "lock:a", "v1"]).await, ":1\r\n");
    let token = owner_of(&mut r, "lock:a")
        .await
        .expect("owner record after SETNX");
    assert_eq!(c2.call(&["SETNX", "lock:a", "v2"]).await, ":0\r\n");

    // One Lua call per acquisition attempt (by SHA1, each connection
    // loading the script once), no SETNX and no separate EXPIRE. The
    // loser's script reads only the lock's PTTL: the holder acquired
    // through this instance, whose own release decides who is next, so
    // its place in the key's queue needs no renewal.
    let stats = r.call(&["INFO", "commandstats"]).await;
    assert!(stats.contains("cmdstat_evalsha:calls=2,"), "{stats}");
    assert!(stats.contains("cmdstat_script|load:calls=2,"), "{stats}");
    assert!(!stats.contains("cmdstat_eval:"), "{stats}");
    assert!(stats.contains("cmdstat_pttl:calls=1,"), "{stats}");
    for absent in ["cmdstat_setnx", "cmdstat_expire:", "cmdstat_pexpire:"] {
        assert!(!stats.contains(absent), "{absent} in {stats}");
    }

    // The client's own value, a lease, and an owner record of this instance.
    assert_eq!(get(&mut r, "lock:a").await.as_deref(), Some("v1"));
    assert_eq!(c2.call(&["GET", "lock:a"]).await, bulk("v1"));
    assert_lease(&mut r, "lock:a", 19_000, 20_000).await;
    let seq = token
        .strip_prefix("a:")
        .unwrap_or_else(|| panic!("token {token:?} lacks 'a:'"));
    assert!(seq.parse::<u64>().is_ok(), "token {token:?}");
    // The loser changed nothing.
    assert_eq!(owner_of(&mut r, "lock:a").await, Some(token));

    let l = &lg.ctx.locks.metrics;
    assert_eq!((m(&l.attempts), m(&l.acquired), m(&l.contended)), (2, 1, 1));
}

#[tokio::test]
async fn set_nx_reply_shapes_resp2_and_resp3() {
    let (_redis, lg, mut r) = setup("a", 20_000).await;
    let mut c1 = RawClient::connect(lg.addr).await;
    let mut c2 = RawClient::connect(lg.addr).await;

    assert_eq!(c1.call(&["SET", "lock:s", "v", "NX"]).await, "+OK\r\n");
    assert_eq!(c2.call(&["SET", "lock:s", "w", "nx"]).await, "$-1\r\n");
    assert_eq!(get(&mut r, "lock:s").await.as_deref(), Some("v"));
    assert_lease(&mut r, "lock:s", 19_000, 20_000).await;

    // RESP3: nil is `_`, and SETNX keeps its integers.
    let mut c3 = RawClient::connect(lg.addr).await;
    let hello = c3.call(&["HELLO", "3"]).await;
    assert_eq!(hello.chars().next(), Some('%'), "{}", hello);
    assert_eq!(c3.call(&["SET", "lock:s", "x", "NX"]).await, "_\r\n");
    assert_eq!(c3.call(&["SETNX", "lock:s", "x"]).await, ":0\r\n");
    assert_eq!(c3.call(&["SET", "lock:s3", "x", "NX"]).await, "+OK\r\n");
    assert_eq!(
        c3.call(&["SET", "lock:s3", "y", "NX", "GET"]).await,
        bulk("x")
    );
    assert_eq!(
        c3.call(&["SET", "lock:s4", "y", "NX", "GET"]).await,
        "_\r\n"
    );
    assert_eq!(get(&mut r, "lock:s").await.as_deref(), Some("v"));
    assert_lease(&mut r, "lock:s3", 19_000, 20_000).await;
    assert_lease(&mut r, "lock:s4", 19_000, 20_000).await;
}

/// Inside MULTI the lock script is queued by Redis; the EXEC array holds
/// exactly what SET NX / SETNX / SET NX GET would have answered.
#[tokio::test]
async fn acquisitions_inside_multi_keep_their_exec_slots() {
    let (_redis, lg, mut r) = setup("a", 20_000).await;
    let mut h = RawClient::connect(lg.addr).await;
    assert_eq!(h.call(&["SETNX", "lock:held", "h"]).await, ":1\r\n");

    for (resp3, nil) in [(false, "$-1\r\n"), (true, "_\r\n")] {
        let mut c = RawClient::connect(lg.addr).await;
        if resp3 {
            assert!(c.call(&["HELLO", "3"]).await.starts_with('%'));
        }
        let fresh = format!("lock:fresh{resp3}");
        let mut out = cmd(&["MULTI"]);
        out.extend(cmd(&["SET", "lock:held", "z", "NX"]));
        out.extend(cmd(&["SETNX", "lock:held", "z"]));
        out.extend(cmd(&["SET", "lock:held", "z", "NX", "GET"]));
        out.extend(cmd(&["SET", &fresh, "v", "NX", "GET"]));
        out.extend(cmd(&["SET", &fresh, "w", "NX"]));
        out.extend(cmd(&["EXEC"]));
        c.send(&out).await;
        assert_eq!(c.reply().await, "+OK\r\n");
        for _ in 0..5 {
            assert_eq!(c.reply().await, "+QUEUED\r\n");
        }
        let want = format!("*5\r\n{nil}:0\r\n{}{nil}{nil}", bulk("h"));
        assert_eq!(c.reply().await, want, "resp3: {resp3}");
        assert_eq!(get(&mut r, &fresh).await.as_deref(), Some("v"));
        assert_lease(&mut r, &fresh, 19_000, 20_000).await;
    }
    assert_eq!(get(&mut r, "lock:held").await.as_deref(), Some("h"));
}

#[tokio::test]
async fn set_nx_keeps_the_clients_own_ttl() {
    let (_redis, lg, mut r) = setup("a", 20_000).await;
    let mut c = RawClient::connect(lg.addr).await;

    let ok = "+OK\r\n";
    assert_eq!(
        c.call(&["SET", "lock:px", "v", "NX", "PX", "5000"]).await,
        ok
    );
    assert_lease(&mut r, "lock:px", 4_000, 5_000).await;
    assert_eq!(c.call(&["SET", "lock:ex", "v", "NX", "EX", "7"]).await, ok);
    assert_lease(&mut r, "lock:ex", 6_000, 7_000).await;
    let exat = (now_s() + 9).to_string();
    assert_eq!(
        c.call(&["SET", "lock:exat", "v", "NX", "EXAT", &exat])
            .await,
        ok
    );
    assert_lease(&mut r, "lock:exat", 7_000, 9_000).await;
    let pxat = (now_ms() + 11_000).to_string();
    assert_eq!(
        c.call(&["SET", "lock:pxat", "v", "NX", "PXAT", &pxat])
            .await,
        ok
    );
    assert_lease(&mut r, "lock:pxat", 10_000, 11_000).await;
    // A second attempt with a TTL changes nothing.
    assert_eq!(
        c.call(&["SET", "lock:px", "w", "NX", "EX", "100"]).await,
        "$-1\r\n"
    );
    assert_lease(&mut r, "lock:px", 3_000, 5_000).await;
    assert_eq!(get(&mut r, "lock:px").await.as_deref(), Some("v"));
}

#[tokio::test]
async fn set_nx_get_returns_nil_then_the_old_value() {
    let (_redis, lg, mut r) = setup("a", 20_000).await;
    let mut c1 = RawClient::connect(lg.addr).await;
    let mut c2 = RawClient::connect(lg.addr).await;

    assert_eq!(
        c1.call(&["SET", "lock:g", "v1", "NX", "GET"]).await,
        "$-1\r\n"
    );
    assert_eq!(get(&mut r, "lock:g").await.as_deref(), Some("v1"));
    assert_lease(&mut r, "lock:g", 19_000, 20_000).await;
    let token = owner_of(&mut r, "lock:g").await;
    assert_eq!(
        c2.call(&["SET", "lock:g", "v2", "NX", "GET"]).await,
        bulk("v1")
    );
    assert_eq!(get(&mut r, "lock:g").await.as_deref(), Some("v1"));
    assert_eq!(owner_of(&mut r, "lock:g").await, token);
    let l = &lg.ctx.locks.metrics;
    assert_eq!((m(&l.acquired), m(&l.contended)), (1, 1));
}

#[tokio::test]
async fn setnx_on_ordinary_keys_passes_through_and_is_counted() {
    let (_redis, lg, mut r) = setup("a", 300).await;
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(c.call(&["PING"]).await, "+PONG\r\n");
    assert_eq!(r.call(&["CONFIG", "RESETSTAT"]).await, "+OK\r\n");

    assert_eq!(c.call(&["SETNX", "user:1:visits", "0"]).await, ":1\r\n");
    assert_eq!(c.call(&["SETNX", "user:1:visits", "5"]).await, ":0\r\n");
    assert_eq!(c.call(&["SET", "user:1:name", "x", "NX"]).await, "+OK\r\n");
    assert_eq!(c.call(&["SETNX", "session", "s"]).await, ":1\r\n");

    assert_eq!(int_of(&mut r, &["TTL", "user:1:visits"]).await, -1);
    assert_eq!(int_of(&mut r, &["TTL", "user:1:name"]).await, -1);
    assert_eq!(get(&mut r, "user:1:visits").await.as_deref(), Some("0"));
    assert!(!exists(&mut r, &owner("user:1:visits")).await);
    let stats = r.call(&["INFO", "commandstats"]).await;
    assert!(stats.contains("cmdstat_setnx:calls=3,"), "{stats}");
    assert!(!stats.contains("cmdstat_eval"), "{stats}");

    // Records of prefix and count, as field/value pairs under RESP2.
    let want = format!(
        "*2\r\n*4\r\n$6\r\nprefix\r\n$6\r\nuser:1\r\n$8\r\ncommands\r\n:3\r\n\
         *4\r\n$6\r\nprefix\r\n{}$8\r\ncommands\r\n:1\r\n",
        bulk("session")
    );
    assert_eq!(c.call(&["LOCKGATE", "UNMATCHED"]).await, want);
    let l = &lg.ctx.locks.metrics;
    assert_eq!((m(&l.unmatched_setnx), m(&l.attempts)), (4, 0));
}

#[tokio::test]
async fn errors_from_redis_keep_their_shape() {
    let (_redis, lg, mut r) = setup("a", 20_000).await;
    let mut c = RawClient::connect(lg.addr).await;

    // A lock key holding a hash: SETNX / SET NX answer as Redis would.
    assert_eq!(int_of(&mut r, &["HSET", "lock:h", "f", "v"]).await, 1);
    assert_eq!(c.call(&["SETNX", "lock:h", "v"]).await, ":0\r\n");
    assert_eq!(c.call(&["SET", "lock:h", "v", "NX"]).await, "$-1\r\n");
    assert_eq!(r.call(&["TYPE", "lock:h"]).await, "+hash\r\n");
    assert!(!exists(&mut r, &owner("lock:h")).await);
    let direct = r.call(&["SET", "lock:h", "v", "NX", "GET"]).await;
    assert!(direct.starts_with("-WRONGTYPE"), "{direct}");
    let via = c.call(&["SET", "lock:h", "v", "NX", "GET"]).await;
    assert!(via.starts_with("-WRONGTYPE"), "{via}");

    // A bad TTL: an error reply in time, the key untouched, the connection usable.
    let direct = r
        .call(&["SET", "lock:k", "v", "NX", "PX", "notanumber"])
        .await;
    let via = c
        .call(&["SET", "lock:k", "v", "NX", "PX", "notanumber"])
        .await;
    assert!(direct.starts_with("-ERR"), "{direct}");
    assert!(via.starts_with("-ERR"), "{via}");
    assert!(
        via.contains("not an integer"),
        "lockgate: {via:?}, redis: {direct:?}"
    );
    assert!(!exists(&mut r, "lock:k").await);
    assert!(!exists(&mut r, &owner("lock:k")).await);
    assert_eq!(c.call(&["PING"]).await, "+PONG\r\n");
    assert_eq!(c.call(&["SETNX", "lock:k", "v"]).await, ":1\r\n");
    assert_lease(&mut r, "lock:k", 19_000, 20_000).await;
}

#[tokio::test]
async fn pipelines_mixing_lock_and_ordinary_commands_keep_order() {
    let (_redis, lg, mut r) = setup("a", 20_000).await;
    let mut holder = RawClient::connect(lg.addr).await;
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(holder.call(&["SETNX", "lock:held", "h"]).await, ":1\r\n");

    const N: usize = 1000;
    let mut out = Vec::new();
    let mut want = Vec::new();
    for i in 0..N {
        let (i, key) = (i.to_string(), format!("lock:{i}"));
        out.extend(cmd(&["SET", "a", &i]));
        out.extend(cmd(&["SETNX", &key, "v"]));
        out.extend(cmd(&["SETNX", "lock:held", "x"]));
        out.extend(cmd(&["GET", "a"]));
        out.extend(cmd(&["DEL", &key]));
        out.extend(cmd(&["DEL", &key]));
        want.extend_from_slice(b"+OK\r\n:1\r\n:0\r\n");
        want.extend(bulk(&i).into_bytes());
        want.extend_from_slice(b":1\r\n:0\r\n");
    }
    c.send(&out).await;
    let got = c.read_exact_bytes(want.len()).await;
    if got != want {
        let at = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
        let from = at.saturating_sub(40);
        panic!(
            "replies differ at byte {at}: got {:?}, want {:?}",
            String::from_utf8_lossy(&got[from..(at + 40).min(got.len())]),
            String::from_utf8_lossy(&want[from..(at + 40).min(want.len())])
        );
    }
    assert_eq!(c.call(&["PING"]).await, "+PONG\r\n");

    // Only `a`, the held lock and its owner record are left on Redis,
    // besides this instance's place in the held lock's queue while it lasts
    // (it expires by itself); the released keys' queues are gone.
    let keys = r.call(&["KEYS", "*"]).await;
    let mut keys: Vec<&str> = (keys.split("\r\n"))
        .filter(|l| !l.is_empty() && !l.starts_with(['*', '$']))
        .filter(|k| !k.ends_with(":{lock:held}") || k.starts_with("lockgate:owner:"))
        .collect();
    keys.sort_unstable();
    assert_eq!(keys, ["a", "lock:held", "lockgate:owner:{lock:held}"]);
    assert_eq!(get(&mut r, "a").await, Some((N - 1).to_string()));
    assert_eq!(get(&mut r, "lock:held").await.as_deref(), Some("h"));
    let l = &lg.ctx.locks.metrics;
    assert_eq!(m(&l.acquired), N as u64 + 1);
    assert_eq!(m(&l.contended), N as u64);
    assert_eq!(m(&l.released), N as u64);
}
