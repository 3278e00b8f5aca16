//! Lock libraries' scripts that lockgate carries out itself
//! (`router::library`) with the Redlock quorum, as on one Redis:
//! node-redlock's one-key acquisition is a quorum acquisition (the key and
//! its owner record on every master, never on the primary), and a
//! library's release is a release by value on every master, answered by
//! the majority, ending the holding wherever it was made. Neither script
//! reaches a master as a script. Checked on each master directly.
//!
//! A library whose release script also touches a key that is not a lock
//! key (python-redis-lock's signal list, Redisson's channel) cannot run
//! it atomically across the two stores: refused as any such script is,
//! with nothing changed on either.

use crate::support;

use support::locks::{bulk, m, owner};
use support::quorum::Cluster;
use support::resp::call;

/// node-redlock 5's acquisition script's SHA1 (its body: tests/js).
const REDLOCK_ACQUIRE: &str = "96da70f7716f27d278a5218544df37fd8b0a5e4c";
/// redis-py's `Lock` release script's SHA1.
const REDIS_PY_RELEASE: &str = "c3f8721cbb97f72bc19e972846bd7aaf91901658";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn library_scripts_are_lock_operations_on_the_quorum() {
    let cl = Cluster::start(3, |_| {}).await;
    let (mut a, mut b) = (cl.client().await, cl.client().await);
    let mut admin = cl.client().await;
    let key = "lock:ql:a";
    // Acquired by EVALSHA of a script no master ever loaded.
    let acquire = |token: &'static str| ["EVALSHA", REDLOCK_ACQUIRE, "1", key, token, "20000"];
    assert_eq!(call(&mut a, &acquire("tok-1")).await, ":1\r\n");
    for i in 0..3 {
        assert_eq!(
            cl.on_master(i, &["GET", key]).await,
            bulk("tok-1"),
            "master {i}"
        );
        let has_owner = cl.on_master(i, &["EXISTS", &owner(key)]).await;
        assert_eq!(has_owner, ":1\r\n", "master {i}");
    }
    assert_eq!(cl.on_primary(&["EXISTS", key]).await, ":0\r\n");
    // Held: another's acquisition fails, as the script's would.
    assert_eq!(call(&mut b, &acquire("tok-2")).await, ":0\r\n");
    let listed = call(&mut admin, &["LOCKGATE", "LOCKS", key]).await;
    assert!(listed.contains(key), "held: {listed:?}");
    // Released by value from another connection (a pool's): the wrong
    // token releases nothing, the right one the key and its owner record
    // on every master, and the holding made on `a` ends.
    let release = |token: &'static str| ["EVALSHA", REDIS_PY_RELEASE, "1", key, token];
    assert_eq!(call(&mut b, &release("tok-2")).await, ":0\r\n");
    assert_eq!(cl.on_master(0, &["GET", key]).await, bulk("tok-1"));
    assert_eq!(call(&mut b, &release("tok-1")).await, ":1\r\n");
    for i in 0..3 {
        let left = cl.on_master(i, &["EXISTS", key, &owner(key)]).await;
        assert_eq!(left, ":0\r\n", "master {i}");
        for sha in [REDLOCK_ACQUIRE, REDIS_PY_RELEASE] {
            let loaded = cl.on_master(i, &["SCRIPT", "EXISTS", sha]).await;
            assert_eq!(loaded, "*1\r\n:0\r\n", "master {i}");
        }
    }
    let listed = call(&mut admin, &["LOCKGATE", "LOCKS", key]).await;
    assert!(!listed.contains(key), "released: {listed:?}");
    assert_eq!(m(&cl.lg.ctx.locks.metrics.library_releases), 2);
    // Free again: taken by the other.
    assert_eq!(call(&mut b, &acquire("tok-2")).await, ":1\r\n");
}

/// python-redis-lock's release (`UNLOCK_SCRIPT`, its keys the lock and its
/// signal list) spans both stores on the quorum: refused with a clear
/// error, the lock still held on the masters and no signal pushed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_that_also_signals_a_list_is_refused_on_the_quorum() {
    const UNLOCK: &str = "\n    if redis.call(\"get\", KEYS[1]) ~= ARGV[1] then\n        return 1\n    else\n        redis.call(\"del\", KEYS[2])\n        redis.call(\"lpush\", KEYS[2], 1)\n        redis.call(\"pexpire\", KEYS[2], ARGV[2])\n        redis.call(\"del\", KEYS[1])\n        return 0\n    end\n";
    let cl = Cluster::start(3, |_| {}).await;
    let mut c = cl.client().await;
    let (key, signal) = ("lock:ql:p", "lock-signal:ql:p");
    let set = call(&mut c, &["SET", key, "id-1", "NX", "EX", "20"]).await;
    assert_eq!(set, "+OK\r\n");
    let refused = call(&mut c, &["EVAL", UNLOCK, "2", key, signal, "id-1", "1000"]).await;
    assert!(
        refused.starts_with("-ERR lockgate: EVAL mixes lock keys (lock:ql:p) with other keys"),
        "{refused:?}"
    );
    for i in 0..3 {
        assert_eq!(
            cl.on_master(i, &["GET", key]).await,
            bulk("id-1"),
            "master {i}"
        );
    }
    assert_eq!(cl.on_primary(&["EXISTS", signal]).await, ":0\r\n");
}
