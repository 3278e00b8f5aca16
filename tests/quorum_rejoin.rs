//! Masters returning to the quorum, against real redis-server processes:
//! fencing tokens keep increasing across a rolling restart of empty masters
//! (the counters are copied to a returning master before it votes), and a
//! master restarted moments before lockgate starts sits out like one that
//! restarts while lockgate runs. Deterministic: no randomness.

mod support;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use lockgate::lock::quorum::MasterState;
use support::locks::bulk;
use support::quorum::{quorum_config, Cluster};
use support::resp::{call, direct};
use support::{until_uptime, Lockgate, RawClient, RedisServer};

const REJOIN_MS: u64 = 300;

fn sitting_out(s: &MasterState) -> bool {
    matches!(s, MasterState::SittingOut(_))
}

/// `LOCKGATE LOCK key ttl` that must acquire: the token.
async fn acquire(c: &mut RawClient, key: &str) -> i64 {
    let reply = call(c, &["LOCKGATE", "LOCK", key, "5000"]).await;
    let parts: Vec<&str> = reply.split("\r\n").collect();
    match parts.as_slice() {
        ["*2", t, v, ""] if t.starts_with(':') && v.starts_with(':') => t[1..]
            .parse()
            .unwrap_or_else(|_| panic!("token in {reply:?}")),
        _ => panic!("LOCKGATE LOCK {key}: {reply:?}, expected a token"),
    }
}

/// Acquires and releases `key`; returns the token.
async fn lock_unlock(c: &mut RawClient, key: &str) -> i64 {
    let token = acquire(c, key).await;
    let unlocked = call(c, &["LOCKGATE", "UNLOCK", key, &token.to_string()]).await;
    assert_eq!(unlocked, ":1\r\n", "LOCKGATE UNLOCK {key} {token}");
    token
}

fn counter(key: &str) -> String {
    format!("lockgate:fence:{{{key}}}")
}

/// MSET of `n` counters `lockgate:fence:{bulk:i}` = 1000 + i on `addr`.
async fn fill(addr: &str, n: usize) {
    let pairs: Vec<(String, String)> = (0..n)
        .map(|i| (counter(&format!("bulk:{i}")), (1000 + i).to_string()))
        .collect();
    let mut args = vec!["MSET"];
    for (k, v) in &pairs {
        args.push(k);
        args.push(v);
    }
    assert_eq!(direct(addr, &args).await, "+OK\r\n");
}

/// Masters restarted empty two at a time, in turn (never more than 2 of 5
/// without their data): m4+m2, m0+m1, m3+m2. A key locked before and only
/// after the rolling restart must get a larger token although every master
/// lost its counter at some point; a key locked between the rounds (while
/// two masters sit out) gets strictly increasing tokens throughout. Fails
/// without the copy: the token after 390 was 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_keep_increasing_across_a_rolling_restart() {
    let mut cl = Cluster::start(5, |c| c.locks.quorum.rejoin_delay_ms = REJOIN_MS).await;
    let mut c = cl.client().await;
    // A history: the idle key's counter at 389 on every master, and more
    // counters than one SCAN page; then token 390 through LOCKGATE LOCK.
    const BULK: usize = 1_100;
    for i in 0..5 {
        let addr = cl.masters[i].addr();
        assert_eq!(
            direct(&addr, &["SET", &counter("fence:idle"), "389"]).await,
            "+OK\r\n"
        );
        fill(&addr, BULK).await;
    }
    let mut idle = vec![lock_unlock(&mut c, "fence:idle").await];
    assert_eq!(idle, [390], "the idle key's first token");
    let mut busy = vec![lock_unlock(&mut c, "fence:busy").await];

    let r = cl.quorum().rejoin.clone();
    let (copied_before, copies_before, restarts_before) = (
        r.counters_copied.load(Ordering::Relaxed),
        r.copies.load(Ordering::Relaxed),
        r.sit_outs_restarted.load(Ordering::Relaxed),
    );
    // What the returning masters held once they voted, checked after the
    // tokens so that a failure shows the tokens first.
    let mut held = Vec::new();
    let last = format!("bulk:{}", BULK - 1);
    for (round, pair) in [[4, 2], [0, 1], [3, 2]].into_iter().enumerate() {
        // Both down together, then back empty.
        tokio::task::block_in_place(|| {
            for i in pair {
                cl.masters[i].stop();
            }
            for i in pair {
                cl.masters[i].restart();
            }
        });
        for i in pair {
            cl.wait_state(i, "SittingOut", sitting_out).await;
            assert_eq!(
                cl.on_master(i, &["EXISTS", &counter("fence:idle")]).await,
                ":0\r\n",
                "round {round}: master {i} restarted empty"
            );
        }
        // The three others acquire meanwhile.
        busy.push(lock_unlock(&mut c, "fence:busy").await);
        for i in pair {
            cl.wait_state(i, "Up", |s| *s == MasterState::Up).await;
            let idle_counter = cl.on_master(i, &["GET", &counter("fence:idle")]).await;
            let last_counter = cl.on_master(i, &["GET", &counter(&last)]).await;
            held.push((round, i, idle_counter, last_counter));
        }
        busy.push(lock_unlock(&mut c, "fence:busy").await);
    }
    // Every master lost the idle key's counter once; it is taken again.
    idle.push(lock_unlock(&mut c, "fence:idle").await);
    busy.push(lock_unlock(&mut c, "fence:busy").await);
    for (key, tokens) in [("fence:idle", &idle), ("fence:busy", &busy)] {
        assert!(
            tokens.windows(2).all(|w| w[0] < w[1]),
            "tokens of {key}, each must exceed all before: {tokens:?}"
        );
    }
    for (round, i, idle_counter, last_counter) in &held {
        // It votes only with the counters of the others, past the first
        // SCAN page too.
        assert_eq!(
            (idle_counter.as_str(), last_counter.as_str()),
            (
                bulk("390").as_str(),
                bulk(&(1000 + BULK - 1).to_string()).as_str()
            ),
            "round {round}: counters on master {i} once it voted"
        );
    }
    let copied = r.counters_copied.load(Ordering::Relaxed) - copied_before;
    // Six returns, each given every counter (the bulk ones and idle; busy
    // too once it exists on the sources).
    assert!(copied >= 6 * (BULK as u64 + 1), "counters copied: {copied}");
    // Six returns at least (a dropped connection adds a return).
    let copies = r.copies.load(Ordering::Relaxed) - copies_before;
    let restarts = r.sit_outs_restarted.load(Ordering::Relaxed) - restarts_before;
    assert!(
        copies >= 6 && restarts == 6,
        "copies {copies}, restarts {restarts}"
    );
    let stats = call(&mut c, &["LOCKGATE", "STATS"]).await;
    for name in ["lock_fence_copies", "lock_quorum_sit_outs_restarted"] {
        assert!(stats.contains(name), "{name} in LOCKGATE STATS: {stats:?}");
    }
}

/// A master restarted empty just before lockgate starts must not be taken
/// as it is: it sits out the rest of the rejoin delay and gets the fence
/// counters first. Here a lock lives on master 0 only (master 2, which
/// held it too, lost it): an acquisition that needs master 2's vote is not
/// granted, while masters 0 and 1, which have run for longer than the
/// delay, count at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_restarted_just_before_lockgate_starts_sits_out() {
    const DELAY_S: u64 = 3;
    let primary = RedisServer::start();
    let mut masters: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let addrs: Vec<String> = masters.iter().map(|m| m.addr()).collect();
    // Reported uptime is rounded down and may be a second more than the
    // time run: DELAY_S + 1 reported is old enough to be trusted.
    for a in &addrs[..2] {
        until_uptime(a, DELAY_S + 1).await;
        assert_eq!(
            direct(a, &["SET", &counter("fence:k"), "41"]).await,
            "+OK\r\n"
        );
    }
    // Another client holds lock:held on exactly masters 0 and 2, a bare
    // majority; master 2 then restarts empty.
    for a in [&addrs[0], &addrs[2]] {
        assert_eq!(
            direct(a, &["SET", "lock:held", "other", "PX", "60000"]).await,
            "+OK\r\n"
        );
    }
    tokio::task::block_in_place(|| masters[2].restart());
    let mut config = quorum_config(&primary.addr(), &addrs);
    config.locks.quorum.rejoin_delay_ms = DELAY_S * 1000;
    let started = Instant::now();
    let lg = Lockgate::start_with(config).await;
    let q = lg.ctx.quorum.clone().expect("quorum");
    let mut c = RawClient::connect(lg.addr).await;

    // lockgate connects all three: 0 and 1 count.
    support::eventually("masters 0 and 1 up, master 2 connected", || {
        q.masters[..2].iter().all(|m| m.state() == MasterState::Up)
            && q.masters[2].state() != MasterState::Down
    })
    .await;
    // Master 1 and master 2 (which lost it) would grant lock:held a
    // second time: refused, as master 2 does not count.
    assert_eq!(
        call(&mut c, &["SETNX", "lock:held", "mine"]).await,
        ":0\r\n",
        "lock:held, held on masters 0 and 2 before master 2 restarted"
    );
    // It sits out the rest of the rejoin delay, for operators to see.
    let s = q.masters[2].state();
    assert!(
        matches!(s, MasterState::SittingOut(left) if left > Duration::from_millis(500)),
        "master 2, restarted just before lockgate started: {s:?}"
    );
    let masters_view = call(&mut c, &["LOCKGATE", "MASTERS"]).await;
    assert!(
        masters_view.contains("$11\r\nsitting out\r\n"),
        "LOCKGATE MASTERS: {masters_view:?}"
    );
    assert_eq!(q.rejoin.sit_outs_young.load(Ordering::Relaxed), 1);
    // A free key: masters 0 and 1 are a majority.
    assert_eq!(
        call(&mut c, &["SETNX", "lock:free", "mine"]).await,
        ":1\r\n"
    );
    let s = q.masters[2].state();
    assert!(
        sitting_out(&s),
        "master 2 rejoined after {:?}, before the checks ended: {s:?} (a host this \
         slow cannot run this test)",
        started.elapsed()
    );
    assert_eq!(
        direct(&addrs[2], &["EXISTS", "lock:held", "lock:free"]).await,
        ":0\r\n",
        "master 2 was asked while sitting out"
    );

    // Once it counts, it holds the counters and the next token follows.
    support::eventually("master 2 rejoined", || {
        q.masters[2].state() == MasterState::Up
    })
    .await;
    // Its uptime (0 s) is taken as no time run: the whole delay from when
    // lockgate read it.
    assert!(
        started.elapsed() >= Duration::from_secs(DELAY_S),
        "master 2 rejoined after {:?}",
        started.elapsed()
    );
    assert_eq!(
        direct(&addrs[2], &["GET", &counter("fence:k")]).await,
        bulk("41")
    );
    assert_eq!(lock_unlock(&mut c, "fence:k").await, 42);
    lg.stop().await;
}

/// A master that only lost its connection (the same process, `run_id`
/// unchanged) kept its counters: it sits out its delay and votes again
/// without a copy. Two of three at once: were a copy asked of them, no
/// majority of the others could give it and they would never rejoin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn masters_that_only_lost_their_connection_rejoin_without_a_copy() {
    let cl = Cluster::start(3, |c| c.locks.quorum.rejoin_delay_ms = REJOIN_MS).await;
    let mut c = cl.client().await;
    let first = lock_unlock(&mut c, "fence:blip").await;
    let r = cl.quorum().rejoin.clone();
    let copies = r.copies.load(Ordering::Relaxed);
    let reconnects = r.sit_outs_reconnected.load(Ordering::Relaxed);
    for i in [0, 1] {
        // Every client but this one: lockgate's connections.
        let killed = cl.on_master(i, &["CLIENT", "KILL", "TYPE", "normal"]).await;
        assert_ne!(killed, ":0\r\n", "master {i}: {killed:?}");
    }
    for i in [0, 1] {
        cl.wait_state(i, "SittingOut", sitting_out).await;
    }
    for i in [0, 1] {
        cl.wait_state(i, "Up", |s| *s == MasterState::Up).await;
    }
    assert_eq!(r.copies.load(Ordering::Relaxed), copies, "copies");
    assert!(r.sit_outs_reconnected.load(Ordering::Relaxed) >= reconnects + 2);
    let mut c = cl.client().await;
    assert!(lock_unlock(&mut c, "fence:blip").await > first);
}
