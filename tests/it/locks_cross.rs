//! Two apps on one lock name during a migration: one legacy (`SETNX` +
//! `EXPIRE` … `DEL`), one on a lock library (redis-py's `Lock`: `SET NX
//! PX`, its own release script). Through lockgate both are string locks
//! taken over alike, so they never hold the key together. A hash lock
//! (Redisson's shape: `HINCRBY` of its holder field in a script) against
//! a string lock clashes as on Redis: the same `WRONGTYPE` error, the same
//! "not acquired". A hash lock taken by its script is held through
//! lockgate (adopted once the script ran: `lock::reconcile`).

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

/// Redisson's unlock as its documentation describes it: one entry of the
/// holder's count off, the lease renewed while entries remain, else the
/// lock deleted and its channel told. KEYS: lock, channel; ARGV: the
/// unlock message, lease ms, holder field.
const HASH_UNLOCK: &str = "
if (redis.call('hexists', KEYS[1], ARGV[3]) == 0) then return nil end
local counter = redis.call('hincrby', KEYS[1], ARGV[3], -1)
if (counter > 0) then redis.call('pexpire', KEYS[1], ARGV[2]) return 0 end
redis.call('del', KEYS[1])
redis.call('publish', KEYS[2], ARGV[1])
return 1";

/// A hash lock taken by its library's script (Redisson's shape: a holder
/// field `uuid:thread` with its count) is held through lockgate: adopted
/// with an owner record once its script ran, its holder named in
/// `LOCKGATE LOCKS`, kept through a re-entry and a partial unlock, and
/// over when the last unlock deletes it. A legacy `SETNX` meanwhile finds
/// it taken, as on Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hash_lock_taken_by_its_script_is_held_through_lockgate() {
    use support::ops::{base_config, call, Ops};
    let redis = RedisServer::start();
    let lg = Ops::start(base_config(&redis.addr())).await;
    let (mut app, mut legacy, mut admin) =
        (lg.client().await, lg.client().await, lg.client().await);
    assert_eq!(
        app.call_s(&["CLIENT", "SETNAME", "redisson-app"]).await,
        "+OK\r\n"
    );
    let (key, channel) = ("lock:hash:held", "redisson_lock__channel:{lock:hash:held}");
    let field = "8743c9c0-0795-4907-87fd-6c719a6b4586:1";
    let adopted = || support::locks::m(&lg.ctx.locks.metrics.script_adoptions);
    // Taken, then entered again.
    for _ in 0..2 {
        let reply = app
            .call_s(&["EVAL", HASH_LOCK, "1", key, "30000", field])
            .await;
        assert_eq!(reply, "$-1\r\n");
    }
    crate::until!("the hash lock adopted", adopted() == 1);
    let listed = call(&mut admin, &["LOCKGATE", "LOCKS", key]).await;
    let row = listed
        .items()
        .iter()
        .find(|r| r.field("key").text() == key)
        .cloned();
    let row = row.unwrap_or_else(|| panic!("no LOCKS row for {key}: {listed}"));
    assert_eq!(row.field("holder").text(), "this instance", "{row}");
    assert_eq!(row.field("client_name").text(), "redisson-app", "{row}");
    assert!(
        !row.to_string().contains(field),
        "the holder field shown: {row}"
    );
    assert_eq!(legacy.call_s(&["SETNX", key, "legacy"]).await, ":0\r\n");
    // One unlock of two entries keeps it; the second deletes it.
    let unlock = ["EVAL", HASH_UNLOCK, "2", key, channel, "0", "30000", field];
    let reconciles = || support::locks::m(&lg.ctx.locks.metrics.script_reconciles);
    let before = reconciles();
    assert_eq!(app.call_s(&unlock).await, ":0\r\n");
    crate::until!("the partial unlock reconciled", reconciles() > before);
    assert_eq!(
        call(&mut admin, &["LOCKGATE", "LOCKS", key])
            .await
            .items()
            .len(),
        1
    );
    assert_eq!(app.call_s(&unlock).await, ":1\r\n");
    crate::until!(
        "the holding to end",
        call(&mut admin, &["LOCKGATE", "LOCKS", "lock:hash:*"])
            .await
            .items()
            .is_empty()
    );
    let owner = support::resp::direct(
        &redis.addr(),
        &["EXISTS", "lockgate:owner:{lock:hash:held}"],
    )
    .await;
    assert_eq!(owner, ":0\r\n", "the owner record went with the key");
    assert_eq!(adopted(), 1);
    lg.stop().await;
}

/// A shared hash lock (Redisson's read lock's shape: a `mode` field and a
/// field per holder with its count): the first holder's script is
/// adopted; when it leaves while another still holds the key, its holding
/// ends and its owner record goes, and the remaining holder's next script
/// is adopted for it; the last one leaving deletes the key and ends its
/// holding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_hash_lock_passes_from_holder_to_holder() {
    use support::ops::{base_config, Ops};
    const READ_LOCK: &str = "
local mode = redis.call('hget', KEYS[1], 'mode')
if mode == false or mode == 'read' then
  redis.call('hset', KEYS[1], 'mode', 'read')
  redis.call('hincrby', KEYS[1], ARGV[2], 1)
  redis.call('pexpire', KEYS[1], ARGV[1])
  return nil
end
return redis.call('pttl', KEYS[1])";
    const READ_UNLOCK: &str = "
if redis.call('hexists', KEYS[1], ARGV[1]) == 0 then return nil end
if redis.call('hincrby', KEYS[1], ARGV[1], -1) == 0 then redis.call('hdel', KEYS[1], ARGV[1]) end
if redis.call('hlen', KEYS[1]) == 1 then redis.call('del', KEYS[1]) return 1 end
return 0";
    let redis = RedisServer::start();
    let lg = Ops::start(base_config(&redis.addr())).await;
    let (mut a, mut b, mut admin) = (lg.client().await, lg.client().await, lg.client().await);
    assert_eq!(
        a.call_s(&["CLIENT", "SETNAME", "reader-a"]).await,
        "+OK\r\n"
    );
    assert_eq!(
        b.call_s(&["CLIENT", "SETNAME", "reader-b"]).await,
        "+OK\r\n"
    );
    let key = "lock:shared:rw";
    let (fa, fb) = ("11111111-aaaa:1", "22222222-bbbb:1");
    let metric = |c: &std::sync::atomic::AtomicU64| support::locks::m(c);
    let m = &lg.ctx.locks.metrics;
    let lock = |field: &'static str| ["EVAL", READ_LOCK, "1", key, "30000", field];
    let unlock = |field: &'static str| ["EVAL", READ_UNLOCK, "1", key, field];
    assert_eq!(a.call_s(&lock(fa)).await, "$-1\r\n");
    crate::until!("reader a adopted", metric(&m.script_adoptions) == 1);
    let before = metric(&m.script_reconciles);
    assert_eq!(b.call_s(&lock(fb)).await, "$-1\r\n");
    crate::until!(
        "reader b's lock reconciled",
        metric(&m.script_reconciles) > before
    );
    assert_eq!(
        metric(&m.script_adoptions),
        1,
        "b shares a's key, held by a's record"
    );
    assert_eq!(holder(&mut admin, key).await.as_deref(), Some("reader-a"));
    // a leaves; b still holds the key.
    assert_eq!(a.call_s(&unlock(fa)).await, ":0\r\n");
    crate::until!(
        "a's holding to end",
        holder(&mut admin, key).await.as_deref() != Some("reader-a")
    );
    let owner = support::resp::direct(
        &redis.addr(),
        &["EXISTS", "lockgate:owner:{lock:shared:rw}"],
    )
    .await;
    assert_eq!(owner, ":0\r\n", "a's owner record went with its holding");
    // b enters again: adopted for b now.
    assert_eq!(b.call_s(&lock(fb)).await, "$-1\r\n");
    crate::until!("reader b adopted", metric(&m.script_adoptions) == 2);
    assert_eq!(holder(&mut admin, key).await.as_deref(), Some("reader-b"));
    assert_eq!(b.call_s(&unlock(fb)).await, ":0\r\n");
    assert_eq!(b.call_s(&unlock(fb)).await, ":1\r\n");
    crate::until!(
        "b's holding to end",
        holder(&mut admin, key).await.is_none()
    );
    lg.stop().await;
}

/// The client name of the connection `LOCKGATE LOCKS` names holding `key`
/// (`None`: no row).
async fn holder(admin: &mut RawClient, key: &str) -> Option<String> {
    let rows = support::ops::call(admin, &["LOCKGATE", "LOCKS", key]).await;
    rows.items()
        .first()
        .map(|r| r.field("client_name").text().to_string())
}
