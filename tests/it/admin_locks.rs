//! The on-call person's view of one lock (docs/operations.md, "Who holds a
//! lock, who waits, and a guarded release"): `LOCKGATE LOCKS` names the
//! acquisition, the holder and its connection, `LOCKGATE WAITERS` the
//! attempts parked in hand-on order, and `LOCKGATE RELEASE key
//! acquisition` frees the lock only while that acquisition still holds it,
//! handing it to the oldest waiter. Against real redis-servers, through
//! one and two lockgates and a quorum of three lock masters.

use crate::support;

use support::ops::{base_config, call, Ops};
use support::resp::Resp;
use support::{cmd, show, RawClient, RedisServer};

const LEASE_MS: u64 = 30_000;

/// lockgate in front of `redis` as instance `id`: 30 s leases, parked
/// attempts waiting up to 10 s.
async fn start(
    redis: &RedisServer,
    id: &str,
    tweak: impl FnOnce(&mut lockgate::config::Config),
) -> Ops {
    let mut c = base_config(&redis.addr());
    c.locks.instance_id = id.to_string();
    c.locks.default_lease_ms = LEASE_MS;
    c.locks.retry.park_ms = 10_000;
    tweak(&mut c);
    Ops::start(c).await
}

/// A client that named itself `name`.
async fn named(lg: &Ops, name: &str) -> RawClient {
    let mut c = lg.client().await;
    assert_eq!(c.call_s(&["CLIENT", "SETNAME", name]).await, "+OK\r\n");
    c
}

/// The `LOCKS` row of `key` (panics without one).
async fn row(admin: &mut RawClient, key: &str) -> Resp {
    let rows = call(admin, &["LOCKGATE", "LOCKS", key]).await;
    let found = rows
        .items()
        .iter()
        .find(|r| r.field("key").text() == key)
        .cloned();
    found.unwrap_or_else(|| panic!("no LOCKS row for {key}: {rows}"))
}

/// Sends `SETNX key value` without waiting, and waits until lockgate
/// has `n` attempts parked on `key`.
async fn park(lg: &Ops, c: &mut RawClient, key: &str, value: &str, n: usize) {
    c.send(&cmd(&["SETNX", key, value])).await;
    crate::until!(
        "the attempt to be parked",
        lg.ctx.locks.storm.waiting(key.as_bytes()) == n
    );
}

fn stat(c: &std::sync::atomic::AtomicU64) -> u64 {
    c.load(std::sync::atomic::Ordering::Relaxed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_and_waiters_name_the_holder_and_the_queue() {
    let redis = RedisServer::start();
    let lg = start(&redis, "view-a", |_| {}).await;
    let mut holder = named(&lg, "holder-a").await;
    let mut first = named(&lg, "waiter-1").await;
    let mut second = named(&lg, "waiter-2").await;
    let mut admin = lg.client().await;
    let key = "lock:order:1";
    assert_eq!(holder.call_s(&["SETNX", key, "h"]).await, ":1\r\n");
    // Each waiter's first try is answered at once; its next one parks.
    assert_eq!(first.call_s(&["SETNX", key, "w1"]).await, ":0\r\n");
    park(&lg, &mut first, key, "w1", 1).await;
    assert_eq!(second.call_s(&["SETNX", key, "w2"]).await, ":0\r\n");
    park(&lg, &mut second, key, "w2", 2).await;

    let r = row(&mut admin, key).await;
    assert_eq!(r.fields(), support::ops::LOCK_FIELDS);
    let acquisition = r.field("acquisition").text().to_string();
    assert_eq!(acquisition.len(), 16, "{r}");
    assert!(acquisition.bytes().all(|b| b.is_ascii_hexdigit()), "{r}");
    assert_eq!(r.field("holder").text(), "this instance");
    assert_eq!(r.field("client_name").text(), "holder-a");
    assert!(
        r.field("client_addr").text().starts_with("127.0.0.1:"),
        "{r}"
    );
    assert!(r.field("held_ms").int() >= 0, "{r}");
    let left = r.field("lease_left_ms").int();
    assert!(left > 0 && left <= LEASE_MS as i64, "{r}");
    assert_eq!(r.field("waiters").int(), 2);
    assert!(r.field("oldest_wait_ms").int() >= 0, "{r}");
    // The acquisition is not the token: the owner record in Redis holds
    // the token, and neither it nor the value appears in the reply.
    let owner = support::resp::direct(
        &redis.addr(),
        &["GET", &format!("lockgate:owner:{{{key}}}")],
    )
    .await;
    let token = owner
        .split("\r\n")
        .nth(1)
        .expect("an owner record")
        .to_string();
    assert!(token.starts_with("view-a:"), "{owner}");
    assert!(!r.to_string().contains(&token), "the token shown: {r}");

    // WAITERS: the parked attempts, the first to be handed the lock first.
    let w = call(&mut admin, &["LOCKGATE", "WAITERS", key]).await;
    let names: Vec<&str> = w
        .items()
        .iter()
        .map(|r| r.field("client_name").text())
        .collect();
    assert_eq!(names, ["waiter-1", "waiter-2"], "{w}");
    let positions: Vec<i64> = w
        .items()
        .iter()
        .map(|r| r.field("position").int())
        .collect();
    assert_eq!(positions, [1, 2]);
    let waited: Vec<i64> = w
        .items()
        .iter()
        .map(|r| r.field("waited_ms").int())
        .collect();
    assert!(waited[0] >= waited[1], "the first waited longest: {w}");
    assert_eq!(
        call(&mut admin, &["LOCKGATE", "WAITERS", "lock:none"]).await,
        Resp::Array(Some(vec![]))
    );

    // Under RESP3: the same row as a map, an unknown value as null.
    let mut three = lg.client().await;
    assert_eq!(three.call_raw(&["HELLO", "3"]).await[0], b'%');
    let raw = three.call_raw(&["LOCKGATE", "LOCKS", key]).await;
    assert!(raw.starts_with(b"*1\r\n%13\r\n"), "{}", show(&raw));
    let free = "lock:order:free";
    assert_eq!(three.call_s(&["SETNX", free, "x"]).await, ":1\r\n");
    drop(three);
    // Its connection gone (no release on disconnect): still held, by
    // this instance, with no connection to name.
    crate::until!("the closed connection to leave the registry", {
        let r = row(&mut admin, free).await;
        r.field("client_addr").text().is_empty()
    });
    let r = row(&mut admin, free).await;
    assert_eq!(r.field("holder").text(), "this instance");
    assert_eq!(r.field("held_ms"), &Resp::Bulk(None), "{r}");

    // Release by the holder: the first waiter is handed the lock.
    assert_eq!(holder.call_s(&["DEL", key]).await, ":1\r\n");
    assert_eq!(show(&first.read_raw().await), ":1\r\n");
    let r = row(&mut admin, key).await;
    assert_eq!(r.field("client_name").text(), "waiter-1");
    assert_ne!(r.field("acquisition").text(), acquisition);
    assert_eq!(r.field("waiters").int(), 1);
    drop(second);
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guarded_release_frees_only_the_acquisition_seen() {
    let redis = RedisServer::start();
    let lg = start(&redis, "rel-a", |c| c.admin.password = "pw".into()).await;
    let mut holder = named(&lg, "stuck").await;
    let mut waiter = named(&lg, "next").await;
    let mut admin = lg.client().await;
    let key = "lock:stuck:1";
    // Without the admin password: refused.
    let r = admin
        .call_s(&["LOCKGATE", "RELEASE", key, "0123456789abcdef"])
        .await;
    assert!(r.starts_with("-NOPERM"), "{r}");
    assert_eq!(admin.call_s(&["LOCKGATE", "AUTH", "pw"]).await, "+OK\r\n");

    assert_eq!(holder.call_s(&["SETNX", key, "h"]).await, ":1\r\n");
    assert_eq!(waiter.call_s(&["SETNX", key, "w"]).await, ":0\r\n");
    park(&lg, &mut waiter, key, "w", 1).await;
    let seen = row(&mut admin, key)
        .await
        .field("acquisition")
        .text()
        .to_string();

    // Bad requests say what is wrong and release nothing.
    for (args, want) in [
        (
            vec!["LOCKGATE", "RELEASE", key],
            "usage: LOCKGATE RELEASE key acquisition",
        ),
        (
            vec!["LOCKGATE", "RELEASE", key, "xyz"],
            "an acquisition is 16 hex digits",
        ),
        (
            vec!["LOCKGATE", "RELEASE", "user:1", &seen],
            "'user:1' is not a lock key",
        ),
    ] {
        let r = admin.call_s(&args).await;
        assert!(
            r.starts_with("-ERR lockgate: ") && r.contains(want),
            "{args:?}: {r}"
        );
    }

    // The acquisition seen still holds it: freed and handed to the waiter.
    let l = &lg.ctx.locks.metrics;
    assert_eq!(
        admin
            .call_s(&["LOCKGATE", "RELEASE", key, &seen.to_uppercase()])
            .await,
        ":1\r\n"
    );
    assert_eq!(
        show(&waiter.read_raw().await),
        ":1\r\n",
        "handed to the waiter"
    );
    assert_eq!(stat(&l.operator_released), 1);
    let now = row(&mut admin, key).await;
    assert_eq!(now.field("client_name").text(), "next", "{now}");
    let theirs = now.field("acquisition").text().to_string();
    assert_ne!(theirs, seen);

    // The same release again: the operator saw an acquisition that no
    // longer holds it, and is told so; the new holder keeps it.
    let r = admin.call_s(&["LOCKGATE", "RELEASE", key, &seen]).await;
    assert!(
        r.starts_with(&format!("-ERR lockgate: not released: {key} is no longer held by acquisition {seen} (another acquisition holds it now")),
        "{r}"
    );
    assert_eq!(
        support::resp::direct(&redis.addr(), &["GET", key]).await,
        "$1\r\nw\r\n"
    );
    assert_eq!(stat(&l.operator_release_stale), 1);
    // The old holder's own release is refused: its lease is gone.
    assert_eq!(holder.call_s(&["DEL", key]).await, ":0\r\n");
    assert_eq!(stat(&l.lease_expired_before_release), 1, "told as a lapse");
    // Released by its holder, then asked again: nobody holds it.
    assert_eq!(waiter.call_s(&["DEL", key]).await, ":1\r\n");
    let r = admin.call_s(&["LOCKGATE", "RELEASE", key, &theirs]).await;
    assert!(r.contains("(nobody holds it now"), "{r}");
    assert_eq!(stat(&l.operator_release_stale), 2);
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_instances_holder_is_read_from_redis_and_released() {
    let redis = RedisServer::start();
    let a = start(&redis, "inst-a", |_| {}).await;
    let b = start(&redis, "inst-b", |_| {}).await;
    let mut holder = named(&a, "on-a").await;
    let mut waiter = b.client().await;
    let mut admin = b.client().await;
    let key = "lock:shared:1";
    assert_eq!(holder.call_s(&["SETNX", key, "a"]).await, ":1\r\n");
    assert_eq!(waiter.call_s(&["SETNX", key, "b"]).await, ":0\r\n");
    park(&b, &mut waiter, key, "b", 1).await;
    let mut admin_a = a.client().await;
    let on_a = row(&mut admin_a, key).await;
    let on_b = row(&mut admin, key).await;
    assert_eq!(on_b.field("holder").text(), "another instance");
    assert_eq!(
        on_b.field("acquisition"),
        on_a.field("acquisition"),
        "the same acquisition seen from both"
    );
    assert_eq!(
        on_b.field("client_addr").text(),
        "",
        "B does not know A's connection"
    );
    assert_eq!(on_b.field("waiters").int(), 1);
    assert_eq!(on_a.field("client_name").text(), "on-a");
    // Released from B: B's parked attempt gets the lock.
    let acq = on_b.field("acquisition").text().to_string();
    assert_eq!(
        admin.call_s(&["LOCKGATE", "RELEASE", key, &acq]).await,
        ":1\r\n"
    );
    assert_eq!(show(&waiter.read_raw().await), ":1\r\n");
    let r = row(&mut admin_a, key).await;
    assert_eq!(
        r.field("holder").text(),
        "another instance",
        "seen from A now: {r}"
    );
    // A key set straight on Redis: held outside lockgate, no acquisition.
    let raw = "lock:raw:1";
    support::resp::direct(&redis.addr(), &["SET", raw, "x", "PX", "60000"]).await;
    assert_eq!(waiter.call_s(&["SETNX", raw, "b"]).await, ":0\r\n");
    let r = row(&mut admin, raw).await;
    assert_eq!(r.field("holder").text(), "outside lockgate", "{r}");
    assert_eq!(r.field("acquisition").text(), "");
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guarded_release_on_the_quorum_frees_every_master() {
    let primary = RedisServer::start();
    let masters: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let lg = start(&primary, "q-a", |c| {
        c.locks.quorum.masters = masters.iter().map(|m| m.addr()).collect();
        c.locks.quorum.rejoin_delay_ms = 300;
        c.locks.quorum.node_timeout_ms = 1_000;
    })
    .await;
    let q = lg.ctx.locks.quorum().expect("a quorum").clone();
    crate::until!(
        "every master up",
        q.masters
            .iter()
            .all(|m| m.state() == lockgate::lock::quorum::MasterState::Up)
    );
    let mut holder = named(&lg, "q-holder").await;
    let mut admin = lg.client().await;
    // MASTERS: a record per master, the same fields under RESP2 and RESP3.
    let two = call(&mut admin, &["LOCKGATE", "MASTERS"]).await;
    let mut resp3 = lg.client().await;
    assert_eq!(resp3.call_raw(&["HELLO", "3"]).await[0], b'%');
    let raw = resp3.call_raw(&["LOCKGATE", "MASTERS"]).await;
    assert!(raw.starts_with(b"*3\r\n%7\r\n"), "{}", show(&raw));
    let three = Resp::parse(&raw);
    for (a, b) in two.items().iter().zip(three.items()) {
        assert_eq!(a.fields(), b.fields());
        assert_eq!(a.field("addr"), b.field("addr"));
        assert_eq!(a.field("state").text(), "up");
    }
    let key = "lock:q:1";
    assert_eq!(holder.call_s(&["SETNX", key, "h"]).await, ":1\r\n");
    let r = row(&mut admin, key).await;
    assert_eq!(r.field("holder").text(), "this instance");
    assert_eq!(r.field("client_name").text(), "q-holder");
    let acq = r.field("acquisition").text().to_string();
    assert_eq!(
        admin.call_s(&["LOCKGATE", "RELEASE", key, &acq]).await,
        ":1\r\n"
    );
    for m in &masters {
        assert_eq!(
            support::resp::direct(&m.addr(), &["EXISTS", key]).await,
            ":0\r\n",
            "{}",
            m.addr()
        );
    }
    assert_eq!(holder.call_s(&["SETNX", key, "again"]).await, ":1\r\n");
    lg.stop().await;
}
