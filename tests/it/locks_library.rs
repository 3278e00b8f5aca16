//! A lock library's own scripts on lock keys (redis-py's `Lock`,
//! python-redis-lock, pottery, node-redlock release and extend with Lua
//! that knows nothing of owner records): once one has run, the key's owner
//! record follows what it did (`lock::reconcile`). A key the script
//! deleted takes its owner record with it; a key its holder's script
//! extended carries its owner record along, so the owner check keeps
//! guarding it for the whole lease the library asked. In the three
//! connection shapes apps have: one connection per thread, a LIFO pool
//! (the script on another connection than the acquisition), one
//! multiplexed connection.

use crate::support;

use support::locks::{exists, m, pttl, COMPARE_AND_DELETE};
use support::resp::cmd;
use support::{Lockgate, RawClient, RedisServer};

/// redis-py's `Lock.LUA_EXTEND_SCRIPT` (8.x): `ARGV[3] == "0"` adds
/// `ARGV[2]` ms to the lease left, else sets it.
const EXTEND: &str = r#"
local token = redis.call('get', KEYS[1])
if not token or token ~= ARGV[1] then
    return 0
end
local expiration = redis.call('pttl', KEYS[1])
if not expiration then
    expiration = 0
end
if expiration < 0 then
    return 0
end
local newttl = ARGV[2]
if ARGV[3] == "0" then
    newttl = ARGV[2] + expiration
end
if tonumber(newttl) <= 0 then
    return 1
end
redis.call('pexpire', KEYS[1], newttl)
return 1
"#;

/// Sends `commands` in one write and reads one reply for each: tasks
/// sharing one connection, as ioredis and Lettuce send them.
async fn pipeline(c: &mut RawClient, commands: &[&[&str]]) -> Vec<Vec<u8>> {
    let bytes: Vec<u8> = commands.iter().flat_map(|a| cmd(a)).collect();
    c.send(&bytes).await;
    let mut replies = Vec::new();
    for _ in commands {
        replies.push(c.read_raw().await);
    }
    replies
}

fn owner(key: &str) -> String {
    format!("lockgate:owner:{{{key}}}")
}

/// Connections of this lockgate that hold `key` by its own records.
fn held_here(lg: &Lockgate, key: &str) -> usize {
    lg.ctx.locks.conns.holds(|k| k == key.as_bytes(), 8).len()
}

/// `lockgate_lock_hold_seconds_count` as `/metrics` shows it.
fn hold_count(lg: &Lockgate) -> u64 {
    let text = lockgate::exposition::render(&lg.ctx).expect("metrics render");
    let line = text
        .lines()
        .find(|l| l.starts_with("lockgate_lock_hold_seconds_count"))
        .expect("a hold count line");
    line.rsplit(' ')
        .next()
        .and_then(|v| v.parse().ok())
        .expect("a count")
}

async fn acquire(c: &mut RawClient, key: &str, token: &str, px: &str) {
    assert_eq!(
        c.call_raw(&["SET", key, token, "NX", "PX", px]).await,
        b"+OK\r\n",
        "{key} acquired"
    );
}

#[tokio::test]
async fn a_library_release_script_takes_the_owner_record_with_it() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut direct = RawClient::connect(redis.addr()).await;
    let metrics = &lg.ctx.locks.metrics;

    // One connection per thread: acquired and released on it.
    let mut own = RawClient::connect(lg.addr).await;
    acquire(&mut own, "lock:lib:own", "t1", "30000").await;
    assert!(exists(&mut direct, &owner("lock:lib:own")).await);
    assert_eq!(held_here(&lg, "lock:lib:own"), 1, "held through lockgate");
    let holds = hold_count(&lg);
    assert_eq!(
        own.call_raw(&["EVAL", COMPARE_AND_DELETE, "1", "lock:lib:own", "t1"])
            .await,
        b":1\r\n"
    );
    crate::until!(
        "the owner record to go with its key",
        !exists(&mut direct, &owner("lock:lib:own")).await
    );
    // The holding is over here too: no longer listed, its hold counted.
    crate::until!(
        "the connection's record of the holding to end",
        held_here(&lg, "lock:lib:own") == 0
    );
    assert_eq!(hold_count(&lg), holds + 1, "lock_hold_seconds counted it");
    let hot = lg.ctx.locks.hot.top(16);
    let own_hot = hot.iter().find(|h| &h.key[..] == b"lock:lib:own");
    assert!(own_hot.is_some_and(|h| h.hold_ms_last.is_some()));
    // Acquired again on the same connection after the library's release:
    // a fresh holding, not a spin of the last.
    acquire(&mut own, "lock:lib:own", "t1b", "30000").await;
    assert_eq!(held_here(&lg, "lock:lib:own"), 1);
    assert_eq!(
        own.call_raw(&["EVAL", COMPARE_AND_DELETE, "1", "lock:lib:own", "t1b"])
            .await,
        b":1\r\n"
    );
    crate::until!(
        "the second holding to end",
        held_here(&lg, "lock:lib:own") == 0
    );

    // A LIFO pool: acquired on one connection, released by the library on
    // another.
    let mut a = RawClient::connect(lg.addr).await;
    let mut b = RawClient::connect(lg.addr).await;
    acquire(&mut a, "lock:lib:pool", "t2", "30000").await;
    assert_eq!(
        b.call_raw(&["EVAL", COMPARE_AND_DELETE, "1", "lock:lib:pool", "t2"])
            .await,
        b":1\r\n"
    );
    crate::until!(
        "the pooled release's owner record to go",
        !exists(&mut direct, &owner("lock:lib:pool")).await
    );

    // One multiplexed connection: two tasks' acquisitions and releases
    // interleaved in one pipeline.
    let mut mux = RawClient::connect(lg.addr).await;
    let replies = pipeline(
        &mut mux,
        &[
            &["SET", "lock:lib:m1", "t3", "NX", "PX", "30000"],
            &["SET", "lock:lib:m2", "t4", "NX", "PX", "30000"],
            &["EVAL", COMPARE_AND_DELETE, "1", "lock:lib:m1", "t3"],
            &["EVAL", COMPARE_AND_DELETE, "1", "lock:lib:m2", "wrong"],
        ],
    )
    .await;
    let want: [&[u8]; 4] = [b"+OK\r\n", b"+OK\r\n", b":1\r\n", b":0\r\n"];
    assert_eq!(replies, want.map(|r| r.to_vec()));
    crate::until!(
        "m1's owner record to go",
        !exists(&mut direct, &owner("lock:lib:m1")).await
    );
    // m2's release was refused by the library's own check: still held,
    // its record kept.
    crate::until!("five reconciliations", m(&metrics.script_reconciles) >= 5);
    assert!(exists(&mut direct, "lock:lib:m2").await);
    assert!(exists(&mut direct, &owner("lock:lib:m2")).await);
    assert_eq!(m(&metrics.script_releases), 4);
    assert_eq!(held_here(&lg, "lock:lib:m2"), 1, "m2 still held");
    lg.stop().await;
}

#[tokio::test]
async fn a_library_extension_carries_the_owner_record_along() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut direct = RawClient::connect(redis.addr()).await;
    let metrics = &lg.ctx.locks.metrics;

    // One connection per thread: redis-py's `extend(30)` on a 1 s lease.
    let mut own = RawClient::connect(lg.addr).await;
    acquire(&mut own, "lock:lib:ext", "t1", "1000").await;
    assert_eq!(
        own.call_raw(&["EVAL", EXTEND, "1", "lock:lib:ext", "t1", "30000", "0"])
            .await,
        b":1\r\n"
    );
    crate::until!(
        "the owner record to follow the new lease",
        pttl(&mut direct, &owner("lock:lib:ext")).await > 20_000
    );
    assert_eq!(m(&metrics.script_extensions), 1);
    // redis-py's `reacquire()` (the lease set, here shorter): followed too.
    assert_eq!(
        own.call_raw(&["EVAL", EXTEND, "1", "lock:lib:ext", "t1", "5000", "1"])
            .await,
        b":1\r\n"
    );
    crate::until!(
        "the owner record to follow the shorter lease",
        pttl(&mut direct, &owner("lock:lib:ext")).await <= 5000
    );

    // One multiplexed connection: the same, pipelined with other traffic.
    let mut mux = RawClient::connect(lg.addr).await;
    let replies = pipeline(
        &mut mux,
        &[
            &["SET", "lock:lib:mx", "t2", "NX", "PX", "1000"],
            &["SET", "plain:x", "1"],
            &["EVAL", EXTEND, "1", "lock:lib:mx", "t2", "30000", "0"],
        ],
    )
    .await;
    assert_eq!(replies[2], b":1\r\n");
    crate::until!(
        "the multiplexed owner record to follow",
        pttl(&mut direct, &owner("lock:lib:mx")).await > 20_000
    );

    // A LIFO pool: extended by the library on another connection than the
    // acquisition's. That connection holds no record of it, so which
    // acquisition the key now belongs to is not known here: the owner
    // record keeps its own expiry (docs/locks.md, "Lock libraries").
    let mut a = RawClient::connect(lg.addr).await;
    let mut b = RawClient::connect(lg.addr).await;
    acquire(&mut a, "lock:lib:px", "t3", "1000").await;
    let before = m(&metrics.script_reconciles);
    assert_eq!(
        b.call_raw(&["EVAL", EXTEND, "1", "lock:lib:px", "t3", "30000", "0"])
            .await,
        b":1\r\n"
    );
    crate::until!("the reconciliation", m(&metrics.script_reconciles) > before);
    assert!(pttl(&mut direct, &owner("lock:lib:px")).await <= 1000);
    assert!(pttl(&mut direct, "lock:lib:px").await > 20_000);
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_front_of_a_cluster_each_owner_record_follows_on_its_node() {
    use support::cluster::Cluster;
    let cluster = Cluster::start(3, 0);
    let lg = cluster.lockgate(|_| {}).await;
    let map = cluster.map().await;
    let mut c = RawClient::connect(lg.addr).await;
    // Keys on different shards: each reconciliation goes to the node that
    // serves the key (and its owner record, in the same slot).
    let keys: Vec<String> = (0..6).map(|i| format!("lock:lib:c{i}")).collect();
    for key in &keys {
        acquire(&mut c, key, "t", "1000").await;
        assert_eq!(
            c.call_raw(&["EVAL", EXTEND, "1", key, "t", "30000", "0"])
                .await,
            b":1\r\n"
        );
    }
    let mut nodes = std::collections::BTreeSet::new();
    for key in &keys {
        let node = &map.shard_of_key(key.as_bytes()).expect("served").primary;
        nodes.insert(node.clone());
        let mut n = RawClient::connect(node).await;
        crate::until!(
            format!("{key}'s owner record to follow on its node"),
            pttl(&mut n, &owner(key)).await > 20_000
        );
        assert_eq!(
            c.call_raw(&["EVAL", COMPARE_AND_DELETE, "1", key, "t"])
                .await,
            b":1\r\n"
        );
        crate::until!(
            format!("{key}'s owner record to go on its node"),
            !exists(&mut n, &owner(key)).await
        );
    }
    assert!(nodes.len() >= 2, "the keys spread over shards: {nodes:?}");
    lg.stop().await;
}

/// redsync's shape (Go; its registry is not reachable here, so the
/// library itself is not run): `SET NX PX` to acquire, a compare-and-delete
/// release answering `DEL`'s count, `-1` when the key is gone and `0` when
/// another holds it, and a compare-and-`PEXPIRE` extension, written after
/// that documented behaviour. Every reply as straight on Redis, and the
/// owner record follows: carried along by the extension, gone with the
/// release.
#[tokio::test]
async fn redsyncs_shape_is_followed_and_answered_as_on_redis() {
    const RELEASE: &str = "local v = redis.call('GET', KEYS[1]) \
        if v == ARGV[1] then return redis.call('DEL', KEYS[1]) \
        elseif v == false then return -1 else return 0 end";
    const TOUCH: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
        return redis.call('PEXPIRE', KEYS[1], ARGV[2]) else return 0 end";
    let calls = |key: &'static str| -> [Vec<&'static str>; 7] {
        [
            vec!["SET", key, "r1", "NX", "PX", "5000"],
            vec!["EVAL", TOUCH, "1", key, "r2", "60000"],
            vec!["EVAL", TOUCH, "1", key, "r1", "60000"],
            vec!["EVAL", RELEASE, "1", key, "r2"],
            vec!["EVAL", RELEASE, "1", key, "r1"],
            vec!["EVAL", RELEASE, "1", key, "r1"],
            vec!["EXISTS", key],
        ]
    };
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut direct = RawClient::connect(redis.addr()).await;
    let mut straight = Vec::new();
    for args in calls("lock:rs:direct") {
        straight.push(direct.call_raw(&args).await);
    }
    let want: [&[u8]; 7] = [
        b"+OK\r\n", b":0\r\n", b":1\r\n", b":0\r\n", b":1\r\n", b":-1\r\n", b":0\r\n",
    ];
    assert_eq!(straight, want.map(<[u8]>::to_vec));
    // Through lockgate, checking the owner record on the way.
    let key = "lock:rs:lg";
    let mut c = RawClient::connect(lg.addr).await;
    let mut through = Vec::new();
    for (i, args) in calls(key).into_iter().enumerate() {
        through.push(c.call_raw(&args).await);
        match i {
            2 => crate::until!(
                "the owner record carried along",
                pttl(&mut direct, &owner(key)).await > 30_000
            ),
            4 => crate::until!(
                "the owner record gone with the key",
                !exists(&mut direct, &owner(key)).await
            ),
            _ => {}
        }
    }
    assert_eq!(through, straight);
    lg.stop().await;
}
