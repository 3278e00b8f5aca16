//! The Redlock quorum of lock keys against real redis-server masters: the
//! 2^N matrix of masters already held by another owner (N = 3, 4, 5), the
//! majority merge of reads, client scripts on every master (with the
//! NOSCRIPT fallback), refusals of commands and transactions that mix lock
//! keys with other keys, and which store each kind of key ends up on. Every outcome is
//! checked on each master (and the primary) directly.
//!
//! Faults (killed, restarted and paused masters) are in `quorum_faults.rs`.

use crate::support;

use std::sync::atomic::Ordering;

use support::int;
use support::locks::{bulk, owner};
use support::quorum::{Cluster, NIL};
use support::redis::command_calls;
use support::resp::call;

/// One case of the matrix: the masters in `held` hold `key` for another
/// owner; `form` is `SETNX` or `SET NX PX`. Checks lockgate's answer and
/// every master, then cleans up.
async fn matrix_case(cl: &Cluster, c: &mut support::RawClient, n: usize, mask: u32, setnx: bool) {
    let held: Vec<usize> = (0..n).filter(|i| mask & (1 << i) != 0).collect();
    let form = if setnx { "setnx" } else { "set-nx-px" };
    let key = format!("lock:matrix{n}:{mask}:{form}");
    let case = format!("N={n}, key held by another owner on masters {held:?}, {form}");
    for &i in &held {
        assert_eq!(
            cl.on_master(i, &["SET", &key, "other-owner", "PX", "30000"])
                .await,
            "+OK\r\n"
        );
    }
    let majority = n / 2 + 1;
    let acquirable = n - held.len() >= majority;
    let (yes, no) = if setnx {
        (":1\r\n", ":0\r\n")
    } else {
        ("+OK\r\n", NIL)
    };
    let reply = if setnx {
        call(c, &["SETNX", &key, "mine"]).await
    } else {
        call(c, &["SET", &key, "mine", "NX", "PX", "30000"]).await
    };
    assert_eq!(
        reply,
        if acquirable { yes } else { no },
        "{case}: acquired iff the free masters are a majority"
    );

    let own = owner(&key);
    for i in 0..n {
        if held.contains(&i) {
            // The other owner's lock is untouched: value, lease, no record.
            assert_eq!(
                cl.on_master(i, &["GET", &key]).await,
                bulk("other-owner"),
                "{case}: master {i}"
            );
            let pttl = int(&cl.on_master(i, &["PTTL", &key]).await);
            assert!(
                pttl > 20_000 && pttl <= 30_000,
                "{case}: master {i} lease {pttl}"
            );
            assert_eq!(
                cl.on_master(i, &["EXISTS", &own]).await,
                ":0\r\n",
                "{case}: owner record on held master {i}"
            );
        } else if acquirable {
            // Every free master holds it (some may answer after the client
            // got its reply: a majority is enough to answer).
            until!(
                format!("{case}: free master {i} to hold the lock"),
                cl.on_master(i, &["GET", &key]).await == bulk("mine")
            );
            let pttl = int(&cl.on_master(i, &["PTTL", &key]).await);
            assert!(
                pttl > 0 && pttl <= 30_000,
                "{case}: master {i} lease {pttl}"
            );
            let rec = cl.on_master(i, &["PTTL", &own]).await;
            assert!(int(&rec) > 0, "{case}: owner record on master {i}: {rec}");
        } else {
            // Released on every master before the client was answered.
            assert_eq!(
                cl.on_master(i, &["EXISTS", &key, &own]).await,
                ":0\r\n",
                "{case}: leftover lock key or owner record on free master {i}"
            );
        }
    }

    if acquirable {
        assert_eq!(call(c, &["DEL", &key]).await, ":1\r\n", "{case}: release");
        for i in 0..n {
            if held.contains(&i) {
                assert_eq!(
                    cl.on_master(i, &["GET", &key]).await,
                    bulk("other-owner"),
                    "{case}: release touched the other owner's lock on {i}"
                );
            } else {
                // Answered once a majority agreed: a master not waited for
                // may still be running its release.
                until!(
                    format!("{case}: master {i} after release"),
                    cl.on_master(i, &["EXISTS", &key, &own]).await == ":0\r\n"
                );
            }
        }
    }
    for &i in &held {
        cl.on_master(i, &["DEL", &key]).await;
    }
    // A failed attempt leaves its instance's place in the key's queue
    // (it expires by itself): the only keys allowed to remain.
    let (queue, places) = (
        format!("lockgate:queue:{{{key}}}"),
        format!("lockgate:places:{{{key}}}"),
    );
    for i in 0..n {
        cl.on_master(i, &["DEL", &queue, &places]).await;
    }
    for i in 0..n {
        assert_eq!(
            cl.on_master(i, &["DBSIZE"]).await,
            ":0\r\n",
            "{case}: master {i} not clean after the case"
        );
    }
}

/// Every subset of masters held by another owner, with SETNX and SET NX PX.
async fn matrix(n: usize) {
    let cl = Cluster::start(n, |_| {}).await;
    let mut c = cl.client().await;
    let metrics = &cl.lg.ctx.locks.metrics;
    let failures = metrics.quorum_failures.load(Ordering::Relaxed);
    for mask in 0..(1u32 << n) {
        for setnx in [true, false] {
            matrix_case(&cl, &mut c, n, mask, setnx).await;
        }
    }
    assert_eq!(call(&mut c, &["PING"]).await, "+PONG\r\n");
    assert_eq!(
        metrics.quorum_failures.load(Ordering::Relaxed),
        failures,
        "every master was up: contention is not a quorum failure"
    );
    // Ordinary keys were never involved.
    assert_eq!(cl.on_primary(&["DBSIZE"]).await, ":0\r\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matrix_of_held_masters_n5() {
    matrix(5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matrix_of_held_masters_n3() {
    matrix(3).await;
}

/// Even N is allowed (majority N/2+1 = 3 of 4): a lock held by another
/// owner is "not acquired", never a quorum error, even when the "no"
/// answers come in first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matrix_of_held_masters_n4() {
    matrix(4).await;
}

/// GET, EXISTS, TYPE, TTL and PTTL on lock keys: the majority's answer,
/// TTLs the smallest within the majority; no majority alike is an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_take_the_majority_answer() {
    let cl = Cluster::start(5, |_| {}).await;
    let mut c = cl.client().await;
    assert_eq!(
        call(&mut c, &["SET", "lock:r", "v1", "NX", "PX", "20000"]).await,
        "+OK\r\n"
    );
    for i in 0..5 {
        until!(
            format!("master {i} to hold lock:r"),
            cl.on_master(i, &["GET", "lock:r"]).await == bulk("v1")
        );
    }

    // One, then two masters hold a different value: the majority's wins.
    for i in [0, 1] {
        cl.on_master(i, &["SET", "lock:r", "intruder", "PX", "20000"])
            .await;
        assert_eq!(call(&mut c, &["GET", "lock:r"]).await, bulk("v1"));
        assert_eq!(call(&mut c, &["EXISTS", "lock:r"]).await, ":1\r\n");
        assert_eq!(call(&mut c, &["TYPE", "lock:r"]).await, "+string\r\n");
    }
    // Three: now "intruder" is the majority's.
    cl.on_master(2, &["SET", "lock:r", "intruder", "PX", "20000"])
        .await;
    assert_eq!(call(&mut c, &["GET", "lock:r"]).await, bulk("intruder"));
    // a a b b c: no majority alike.
    cl.on_master(4, &["SET", "lock:r", "third", "PX", "20000"])
        .await;
    cl.on_master(2, &["SET", "lock:r", "v1", "PX", "20000"])
        .await;
    let reply = call(&mut c, &["GET", "lock:r"]).await;
    assert!(
        reply.starts_with("-ERR lockgate: lock masters disagree"),
        "{reply:?}"
    );

    // The key on 3 of 5 masters exists; on 2 of 5 it does not.
    cl.on_master(4, &["DEL", "lock:r"]).await;
    cl.on_master(3, &["DEL", "lock:r"]).await;
    assert_eq!(call(&mut c, &["EXISTS", "lock:r"]).await, ":1\r\n");
    cl.on_master(2, &["DEL", "lock:r"]).await;
    assert_eq!(call(&mut c, &["EXISTS", "lock:r"]).await, ":0\r\n");
    assert_eq!(call(&mut c, &["GET", "lock:r"]).await, NIL);
    assert_eq!(call(&mut c, &["PTTL", "lock:r"]).await, ":-2\r\n");
    assert_eq!(call(&mut c, &["TYPE", "lock:r"]).await, "+none\r\n");

    // Leases 9 s, 8 s, 7 s, 6 s, 5 s: the smallest within the majority is
    // the third largest, 7 s.
    for i in 0..5 {
        let px = (9_000 - 1_000 * i).to_string();
        cl.on_master(i, &["SET", "lock:t", "x", "PX", &px]).await;
    }
    let pttl = int(&call(&mut c, &["PTTL", "lock:t"]).await);
    assert!(pttl > 6_000 && pttl <= 7_000, "PTTL {pttl}");
    let ttl = int(&call(&mut c, &["TTL", "lock:t"]).await);
    assert!(ttl == 7 || ttl == 6, "TTL {ttl}");
    // Missing on two masters: still the third largest of those that hold it.
    for (i, px) in [(0, "9000"), (1, "8000"), (3, "7000")] {
        cl.on_master(i, &["SET", "lock:t2", "x", "PX", px]).await;
    }
    let pttl = int(&call(&mut c, &["PTTL", "lock:t2"]).await);
    assert!(pttl > 6_000 && pttl <= 7_000, "PTTL {pttl}");
    // Several keys: the count a majority reports at least.
    assert_eq!(
        call(&mut c, &["EXISTS", "lock:t", "lock:t2", "lock:none"]).await,
        ":2\r\n"
    );
}

/// A body that sets KEYS[1] to ARGV[1] with a lease of ARGV[2] ms.
const SET_SCRIPT: &str = "return redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])";

/// EVAL with lock keys runs on every master; EVALSHA after SCRIPT LOAD
/// through lockgate works; after SCRIPT FLUSH on one master (and on all of
/// them), EVALSHA still works: lockgate re-sends the body it has seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_on_lock_keys_run_on_every_master() {
    let cl = Cluster::start(5, |_| {}).await;
    let mut c = cl.client().await;
    let on_all = |key: &'static str, value: &'static str| {
        let cl = &cl;
        async move {
            for i in 0..5 {
                assert_eq!(
                    cl.on_master(i, &["GET", key]).await,
                    bulk(value),
                    "{key} on master {i}"
                );
            }
        }
    };

    assert_eq!(
        call(&mut c, &["EVAL", SET_SCRIPT, "1", "lock:e1", "a", "20000"]).await,
        "+OK\r\n"
    );
    on_all("lock:e1", "a").await;
    assert_eq!(
        cl.on_primary(&["EXISTS", "lock:e1"]).await,
        ":0\r\n",
        "a script on lock keys ran on the primary"
    );

    // Idempotent (SET … PX): the NOSCRIPT fallback is checked here for its
    // outcome; evalsha_fallback_runs_the_script_once_per_master checks
    // that a non-idempotent script is not run twice.
    let body =
        "redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return redis.call('GET', KEYS[1])";
    let loaded = call(&mut c, &["SCRIPT", "LOAD", body]).await;
    let sha = loaded
        .strip_prefix("$40\r\n")
        .and_then(|s| s.strip_suffix("\r\n"))
        .unwrap_or_else(|| panic!("SCRIPT LOAD reply {loaded:?}"))
        .to_string();
    assert_eq!(
        call(&mut c, &["EVALSHA", &sha, "1", "lock:e2", "b", "20000"]).await,
        bulk("b")
    );
    on_all("lock:e2", "b").await;

    // Every master knows the script now (loaded by lockgate or re-sent).
    for i in 0..5 {
        assert_eq!(
            cl.on_master(i, &["SCRIPT", "EXISTS", &sha]).await,
            "*1\r\n:1\r\n",
            "master {i}"
        );
    }
    assert_eq!(cl.on_master(0, &["SCRIPT", "FLUSH"]).await, "+OK\r\n");
    assert_eq!(
        call(&mut c, &["EVALSHA", &sha, "1", "lock:e3", "c", "20000"]).await,
        bulk("c")
    );
    on_all("lock:e3", "c").await;
    // Flushed everywhere (also the primary): still works.
    for i in 0..5 {
        cl.on_master(i, &["SCRIPT", "FLUSH"]).await;
    }
    cl.on_primary(&["SCRIPT", "FLUSH"]).await;
    assert_eq!(
        call(&mut c, &["EVALSHA", &sha, "1", "lock:e4", "e", "20000"]).await,
        bulk("e")
    );
    on_all("lock:e4", "e").await;
    assert_eq!(call(&mut c, &["PING"]).await, "+PONG\r\n");
}

/// A Redisson-style reentrant lock script (a hash whose field counts the
/// holder's entries) must run exactly once on each master, also when one
/// master lost its script cache: re-sending it as EVAL must not run it a
/// second time on the masters that had already run it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evalsha_fallback_runs_the_script_once_per_master() {
    let cl = Cluster::start(5, |_| {}).await;
    let mut c = cl.client().await;
    let body = "if redis.call('exists', KEYS[1]) == 0 or redis.call('hexists', KEYS[1], ARGV[2]) == 1 then \
                local n = redis.call('hincrby', KEYS[1], ARGV[2], 1); \
                redis.call('pexpire', KEYS[1], ARGV[1]); return n end; \
                return redis.call('pttl', KEYS[1])";
    let loaded = call(&mut c, &["SCRIPT", "LOAD", body]).await;
    let sha = loaded
        .strip_prefix("$40\r\n")
        .and_then(|s| s.strip_suffix("\r\n"))
        .unwrap_or_else(|| panic!("SCRIPT LOAD reply {loaded:?}"))
        .to_string();
    for i in 0..5 {
        until!(
            format!("SCRIPT LOAD forwarded to master {i}"),
            cl.on_master(i, &["SCRIPT", "EXISTS", &sha]).await == "*1\r\n:1\r\n"
        );
    }

    // All masters have it: one entry.
    assert_eq!(
        call(
            &mut c,
            &["EVALSHA", &sha, "1", "lock:h1", "20000", "holder"]
        )
        .await,
        ":1\r\n"
    );
    for i in 0..5 {
        assert_eq!(
            cl.on_master(i, &["HGET", "lock:h1", "holder"]).await,
            bulk("1"),
            "lock:h1 on master {i}"
        );
    }

    // Master 0 lost its scripts: it answers NOSCRIPT, the others run it.
    cl.on_master(0, &["SCRIPT", "FLUSH"]).await;
    let reply = call(
        &mut c,
        &["EVALSHA", &sha, "1", "lock:h2", "20000", "holder"],
    )
    .await;
    let mut counts = Vec::new();
    for i in 0..5 {
        counts.push(cl.on_master(i, &["HGET", "lock:h2", "holder"]).await);
    }
    assert_eq!(
        (reply.as_str(), counts.clone()),
        (":1\r\n", vec![bulk("1"); 5]),
        "one EVALSHA must enter the reentrant lock once on every master \
         (reply, hold count per master)"
    );
    // Master 0's rerun, and no other: every master is waited for.
    assert_eq!(cl.quorum().noscript_reruns.load(Ordering::Relaxed), 1);
}

/// lockgate's lock scripts reach the masters as `EVALSHA` (loaded when
/// each connection opens), not as a 2-3 KiB `EVAL` body per call; a master
/// whose script cache was flushed answers `NOSCRIPT`, which lockgate runs
/// again there as `EVAL`: the client sees its own reply, and every master
/// ends up as if nothing had been flushed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_scripts_go_by_sha_and_survive_a_flushed_master() {
    let cl = Cluster::start(3, |_| {}).await;
    let reruns = || cl.quorum().noscript_reruns.load(Ordering::Relaxed);
    let mut c = cl.client().await;
    for i in 0..3 {
        assert_eq!(cl.on_master(i, &["CONFIG", "RESETSTAT"]).await, "+OK\r\n");
    }
    assert_eq!(call(&mut c, &["SETNX", "lock:sha1", "v"]).await, ":1\r\n");
    assert_eq!(call(&mut c, &["DEL", "lock:sha1"]).await, ":1\r\n");
    for i in 0..3 {
        // A master not waited for may still be running its share.
        until!(
            format!("acquisition and release on master {i} by EVALSHA"),
            command_calls(&cl.on_master(i, &["INFO", "commandstats"]).await, "evalsha") == 2
        );
        let stats = cl.on_master(i, &["INFO", "commandstats"]).await;
        assert_eq!(command_calls(&stats, "eval"), 0, "master {i}: {stats}");
    }
    assert_eq!(reruns(), 0);

    // Master 0 forgets every script: the acquisition and the release each
    // get one NOSCRIPT there, and run again as EVAL.
    assert_eq!(cl.on_master(0, &["SCRIPT", "FLUSH"]).await, "+OK\r\n");
    assert_eq!(call(&mut c, &["SETNX", "lock:sha2", "v"]).await, ":1\r\n");
    for i in 0..3 {
        until!(
            format!("lock:sha2 held on master {i}"),
            cl.on_master(i, &["GET", "lock:sha2"]).await == bulk("v")
        );
        let record = cl.on_master(i, &["EXISTS", &owner("lock:sha2")]).await;
        assert_eq!(record, ":1\r\n", "owner record on master {i}");
    }
    until!("the acquisition's rerun counted", reruns() == 1);
    assert_eq!(call(&mut c, &["DEL", "lock:sha2"]).await, ":1\r\n");
    for i in 0..3 {
        until!(
            format!("lock:sha2 released on master {i}"),
            cl.on_master(i, &["EXISTS", "lock:sha2"]).await == ":0\r\n"
        );
    }
    until!("the release's rerun counted", reruns() == 2);
}

/// Commands mixing lock keys with other keys that would need atomicity
/// across the two stores are refused, naming the lock keys, and change
/// nothing on either store. (Per-key commands such as `DEL` or `MGET` are
/// split instead: `quorum_split.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_commands_are_refused() {
    let cl = Cluster::start(3, |_| {}).await;
    let mut c = cl.client().await;
    assert_eq!(call(&mut c, &["SET", "user:1", "u"]).await, "+OK\r\n");
    assert_eq!(call(&mut c, &["SETNX", "lock:a", "mine"]).await, ":1\r\n");
    let refused = |name: &str, keys: &str| {
        format!(
            "-ERR lockgate: {name} mixes lock keys ({keys}) with other keys; they live on different stores\r\n"
        )
    };
    let before = cl
        .lg
        .ctx
        .locks
        .metrics
        .mixed_refused
        .load(Ordering::Relaxed);
    let cases: Vec<(Vec<&str>, String)> = vec![
        (
            vec!["MSET", "lock:a", "x", "user:1", "y"],
            refused("MSET", "lock:a"),
        ),
        (
            vec![
                "EVAL",
                "return redis.call('DEL', KEYS[1], KEYS[2])",
                "2",
                "lock:a",
                "user:1",
            ],
            refused("EVAL", "lock:a"),
        ),
        (
            vec!["RENAME", "user:1", "lock:z"],
            refused("RENAME", "lock:z"),
        ),
    ];
    let count = cases.len() as u64;
    for (args, expected) in cases {
        assert_eq!(call(&mut c, &args).await, expected, "{args:?}");
    }
    assert_eq!(
        cl.lg
            .ctx
            .locks
            .metrics
            .mixed_refused
            .load(Ordering::Relaxed)
            - before,
        count
    );
    // Nothing changed anywhere; the connection still works.
    assert_eq!(cl.on_primary(&["GET", "user:1"]).await, bulk("u"));
    assert_eq!(cl.on_primary(&["EXISTS", "lock:z"]).await, ":0\r\n");
    for i in 0..3 {
        assert_eq!(cl.on_master(i, &["GET", "lock:a"]).await, bulk("mine"));
        assert_eq!(
            cl.on_master(i, &["EXISTS", "user:1", "lock:z"]).await,
            ":0\r\n"
        );
    }
    assert_eq!(call(&mut c, &["GET", "user:1"]).await, bulk("u"));
    assert_eq!(call(&mut c, &["GET", "lock:a"]).await, bulk("mine"));
}

/// Transactions under the quorum: lock commands inside MULTI are queued by
/// lockgate and run on the quorum at EXEC; a transaction that mixes lock keys
/// with other keys (in either order) is aborted as a whole with EXECABORT,
/// and nothing of it runs on either store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_mixing_lock_and_plain_keys_are_aborted_whole() {
    let cl = Cluster::start(3, |_| {}).await;
    let mut c = cl.client().await;
    let orders: [[&[&str]; 2]; 2] = [
        [&["SET", "user:m", "x"], &["SETNX", "lock:m", "1"]],
        [&["SETNX", "lock:m", "1"], &["SET", "user:m", "x"]],
    ];
    for order in orders {
        assert_eq!(call(&mut c, &["MULTI"]).await, "+OK\r\n");
        for args in order {
            assert_eq!(call(&mut c, args).await, "+QUEUED\r\n", "{args:?}");
        }
        let exec = call(&mut c, &["EXEC"]).await;
        assert!(
            exec.starts_with("-EXECABORT lockgate: ") && exec.contains("mixes lock keys"),
            "{order:?}: {exec:?}"
        );
        assert_eq!(
            cl.on_primary(&["EXISTS", "user:m", "lock:m"]).await,
            ":0\r\n",
            "{order:?}: half the transaction ran on the primary"
        );
        for i in 0..3 {
            assert_eq!(
                cl.on_master(i, &["EXISTS", "lock:m", &owner("lock:m")])
                    .await,
                ":0\r\n",
                "{order:?}: half the transaction ran on master {i}"
            );
        }
        // Not left inside a transaction.
        assert_eq!(call(&mut c, &["PING"]).await, "+PONG\r\n");
    }

    // Only lock keys: the SETNX + PEXPIRE idiom runs on the quorum at EXEC.
    assert_eq!(call(&mut c, &["MULTI"]).await, "+OK\r\n");
    assert_eq!(call(&mut c, &["SETNX", "lock:t", "1"]).await, "+QUEUED\r\n");
    assert_eq!(
        call(&mut c, &["PEXPIRE", "lock:t", "5000"]).await,
        "+QUEUED\r\n"
    );
    assert_eq!(call(&mut c, &["EXEC"]).await, "*2\r\n:1\r\n:1\r\n");
    for i in 0..3 {
        assert_eq!(cl.on_master(i, &["GET", "lock:t"]).await, bulk("1"));
        let pttl = int(&cl.on_master(i, &["PTTL", "lock:t"]).await);
        assert!(pttl > 0 && pttl <= 5_000, "lease on master {i}: {pttl}");
    }
    assert_eq!(cl.on_primary(&["DBSIZE"]).await, ":0\r\n");
}

/// Ordinary keys go to the primary and never to the masters; lock keys,
/// whatever lock command wrote them, live on the masters and never on the
/// primary (nor do owner records).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordinary_keys_on_the_primary_lock_keys_on_the_masters() {
    let cl = Cluster::start(3, |_| {}).await;
    let mut c = cl.client().await;
    assert_eq!(call(&mut c, &["SET", "user:1", "x"]).await, "+OK\r\n");
    assert_eq!(call(&mut c, &["SETNX", "user:2", "y"]).await, ":1\r\n");
    assert_eq!(
        call(&mut c, &["SET", "user:3", "z", "NX", "PX", "20000"]).await,
        "+OK\r\n"
    );
    assert_eq!(call(&mut c, &["GET", "user:1"]).await, bulk("x"));
    assert_eq!(call(&mut c, &["DEL", "user:2"]).await, ":1\r\n");
    assert_eq!(
        call(&mut c, &["MGET", "user:1", "user:3"]).await,
        "*2\r\n$1\r\nx\r\n$1\r\nz\r\n"
    );
    // Ordinary keys: on the primary with their exact values and no lease.
    assert_eq!(cl.on_primary(&["GET", "user:1"]).await, bulk("x"));
    assert_eq!(cl.on_primary(&["TTL", "user:1"]).await, ":-1\r\n");
    assert_eq!(cl.on_primary(&["GET", "user:3"]).await, bulk("z"));
    assert_eq!(cl.on_primary(&["EXISTS", "user:2"]).await, ":0\r\n");

    // Lock keys through every lock command.
    let steps: &[(&[&str], &str)] = &[
        (&["SETNX", "lock:p", "a"], ":1\r\n"),
        (&["SET", "lock:q", "b", "NX", "PX", "20000"], "+OK\r\n"),
        (&["PEXPIRE", "lock:p", "25000"], ":1\r\n"),
        (&["SET", "lock:s", "c", "PX", "20000"], "+OK\r\n"),
        (&["GETSET", "lock:s", "d"], "$1\r\nc\r\n"),
        (
            &["EVAL", SET_SCRIPT, "1", "lock:e", "f", "20000"],
            "+OK\r\n",
        ),
        (&["DEL", "lock:q"], ":1\r\n"),
        (&["SETNX", "app:job:lock", "g"], ":1\r\n"),
    ];
    for (args, expected) in steps {
        assert_eq!(call(&mut c, args).await, *expected, "{args:?}");
    }
    for i in 0..3 {
        for (key, value) in [
            ("lock:p", "a"),
            ("lock:s", "d"),
            ("lock:e", "f"),
            ("app:job:lock", "g"),
        ] {
            assert_eq!(
                cl.on_master(i, &["GET", key]).await,
                bulk(value),
                "{key} on master {i}"
            );
        }
        assert_eq!(
            cl.on_master(i, &["EXISTS", "lock:q", "user:1", "user:3"])
                .await,
            ":0\r\n",
            "master {i}"
        );
        let pttl = int(&cl.on_master(i, &["PTTL", "lock:p"]).await);
        assert!(pttl > 20_000, "PEXPIRE reached master {i}: {pttl}");
        assert!(
            int(&cl.on_master(i, &["PTTL", &owner("lock:p")]).await) > 0,
            "owner record on master {i}"
        );
    }
    // Only user:1 and user:3 on the primary: no lock key, no owner record.
    assert_eq!(
        cl.on_primary(&["DBSIZE"]).await,
        ":2\r\n",
        "{:?}",
        cl.on_primary(&["KEYS", "*"]).await
    );
    assert_eq!(
        cl.on_primary(&["EXISTS", "user:1", "user:3"]).await,
        ":2\r\n"
    );
}

/// Writes to lock keys other than the lock commands lockgate takes over
/// (SETEX, PSETEX, INCR, HSET, APPEND, SETRANGE, LPUSH): with the quorum,
/// lock keys live on the masters, so none of these may create a lock key on
/// the primary where no lock read would ever see it. Refused or sent to the
/// masters are both fine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_writes_never_put_lock_keys_on_the_primary() {
    let cl = Cluster::start(3, |_| {}).await;
    let mut c = cl.client().await;
    let writes: &[&[&str]] = &[
        &["SETEX", "lock:w1", "20", "v"],
        &["PSETEX", "lock:w2", "20000", "v"],
        &["INCR", "lock:w3"],
        &["HSET", "lock:w4", "holder", "1"],
        &["APPEND", "lock:w5", "v"],
        &["SETRANGE", "lock:w6", "0", "v"],
        &["LPUSH", "lock:w7", "v"],
    ];
    let mut leaked = Vec::new();
    for args in writes {
        let reply = call(&mut c, args).await;
        if cl.on_primary(&["EXISTS", args[1]]).await != ":0\r\n" {
            leaked.push(format!("{} {} -> {}", args[0], args[1], reply.trim_end()));
        }
    }
    assert!(
        leaked.is_empty(),
        "lock keys written on the primary with the quorum on: {leaked:?}"
    );
}
