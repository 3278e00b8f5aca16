//! One lock master's wall clock jumps forward while lockgate runs (real
//! redis-server processes, one under libfaketime with its offset read from
//! a file): Redis expires that master's keys early, and without clock
//! tracking the master votes "yes" for a second client while the first
//! one's validity lasts. With it, lockgate sees the step in the master's
//! `TIME` (in the vote itself, or in its once-a-second reading), does not
//! count the vote and sits the master out. Also: steady clocks are never
//! taken for jumps, and `clock_faults` asks for more votes.

use crate::support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use lockgate::lock::quorum::MasterState;
use lockgate::Config;
use support::locks::bulk;
use support::quorum::fake_clock::FakeClock;
use support::quorum::{Cluster, NIL};
use support::redis::command_calls;
use support::resp::call;
use support::RedisServer;

/// The master whose clock jumps.
const JUMPER: usize = 2;

/// Settings that keep every attempt going to the masters: no local "not
/// acquired" from the contention table, no parking, a node timeout a
/// loaded box meets.
fn tweak(c: &mut Config) {
    c.locks.retry.probe_interval_ms = 0;
    c.locks.retry.park_ms = 0;
    c.locks.quorum.node_timeout_ms = 500;
}

/// Five masters, the third with a fake clock, lockgate in front.
async fn cluster(clock: &FakeClock, more: impl FnOnce(&mut Config)) -> Cluster {
    let masters: Vec<RedisServer> = (0..5)
        .map(|i| match i {
            JUMPER => clock.start_redis(),
            _ => RedisServer::start(),
        })
        .collect();
    Cluster::start_on(masters, |c| {
        tweak(c);
        more(c);
    })
    .await
}

fn jumps(cl: &Cluster) -> u64 {
    cl.quorum().clock.jumps.load(Ordering::Relaxed)
}

/// The scripts (`EVALSHA`, `EVAL`) masters 3 and 4 have run.
async fn scripts_on_3_and_4(cl: &Cluster) -> [u64; 2] {
    let mut run = [0; 2];
    for (n, i) in [3, 4].into_iter().enumerate() {
        let stats = cl.on_master(i, &["INFO", "commandstats"]).await;
        run[n] = command_calls(&stats, "evalsha") + command_calls(&stats, "eval");
    }
    run
}

/// The other owner lets go of `key` on masters 3 and 4, once they have run
/// the attempt made since `before` (their [`scripts_on_3_and_4`] then). A
/// majority's "yes" answers the client before every master has run its
/// attempt: on a loaded box masters 3 and 4 may run it moments later, and
/// after the `DEL` it would take them.
async fn other_lets_go(cl: &Cluster, key: &str, before: [u64; 2]) {
    until!("the attempt run on masters 3 and 4", {
        let now = scripts_on_3_and_4(cl).await;
        now[0] > before[0] && now[1] > before[1]
    });
    for i in [3, 4] {
        assert_eq!(cl.on_master(i, &["DEL", key]).await, ":1\r\n");
    }
}

/// Client A holds `key` on exactly masters 0, 1 and 2 (3 and 4 are held by
/// another owner during A's attempt, who then lets go), so A's lock rests
/// on the jumping master's vote.
async fn hold_on_three(cl: &Cluster, key: &str, value: &str) -> support::RawClient {
    for i in [3, 4] {
        assert_eq!(
            cl.on_master(i, &["SET", key, "other", "PX", "60000"]).await,
            "+OK\r\n"
        );
    }
    let before = scripts_on_3_and_4(cl).await;
    let mut a = cl.client().await;
    assert_eq!(
        call(&mut a, &["SET", key, value, "NX", "PX", "20000"]).await,
        "+OK\r\n"
    );
    for i in 0..3 {
        assert_eq!(
            cl.on_master(i, &["GET", key]).await,
            bulk(value),
            "master {i}"
        );
    }
    other_lets_go(cl, key, before).await;
    a
}

/// The double grant: A holds the lock with 20 s of lease; master 2's clock
/// jumps 60 s ahead and drops it; B asks at once and gets "yes" from 2, 3
/// and 4 — a majority — unless the vote of 2 is not counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_whose_clock_jumps_cannot_grant_a_held_lock_again() {
    let clock = FakeClock::new();
    let cl = cluster(&clock, |_| {}).await;
    let key = "lock:clock";
    let _a = hold_on_three(&cl, key, "A").await;
    assert_eq!(jumps(&cl), 0);

    clock.set_offset_secs(60);
    assert_eq!(
        cl.on_master(JUMPER, &["GET", key]).await,
        NIL,
        "the jumping master expired A's lock by its clock"
    );
    let mut b = cl.client().await;
    let reply = call(&mut b, &["SET", key, "B", "NX", "PX", "20000"]).await;
    assert_eq!(
        reply, NIL,
        "B was granted the lock A holds for ~20 s more (votes of masters 2, 3, 4)"
    );
    for i in 0..2 {
        assert_eq!(
            cl.on_master(i, &["GET", key]).await,
            bulk("A"),
            "master {i}"
        );
    }
    for i in [3, 4] {
        assert_eq!(
            cl.on_master(i, &["GET", key]).await,
            NIL,
            "B's attempt undone on {i}"
        );
    }
    assert_eq!(jumps(&cl), 1);
    assert!(matches!(cl.state(JUMPER), MasterState::SittingOut(..)));
    for i in [0, 1, 3, 4] {
        assert_eq!(cl.state(i), MasterState::Up, "master {i}");
    }
}

/// The fencing API votes the same way: `LOCKGATE LOCK` by B after the jump
/// finds the lock held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_does_not_count_a_master_whose_clock_jumped() {
    let clock = FakeClock::new();
    let cl = cluster(&clock, |_| {}).await;
    let key = "lock:fclock";
    for i in [3, 4] {
        cl.on_master(i, &["SET", key, "other", "PX", "60000"]).await;
    }
    let before = scripts_on_3_and_4(&cl).await;
    let mut a = cl.client().await;
    let taken = call(&mut a, &["LOCKGATE", "LOCK", key, "20000"]).await;
    assert!(taken.starts_with("*2\r\n:"), "A's fencing lock: {taken:?}");
    other_lets_go(&cl, key, before).await;
    clock.set_offset_secs(60);
    assert_eq!(cl.on_master(JUMPER, &["GET", key]).await, NIL);
    let mut b = cl.client().await;
    assert_eq!(call(&mut b, &["LOCKGATE", "LOCK", key, "20000"]).await, NIL);
    assert_eq!(jumps(&cl), 1);
}

/// Without any acquisition, the once-a-second reading sees the step and
/// sits the master out; before it, steady clocks under a stream of
/// acquisitions never count as jumps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readings_between_votes_see_the_jump_and_steady_clocks_never_jump() {
    let clock = FakeClock::new();
    let cl = cluster(&clock, |_| {}).await;
    let mut c = cl.client().await;
    for n in 0..30 {
        let key = format!("lock:steady{n}");
        assert_eq!(
            call(&mut c, &["SET", &key, "v", "NX", "PX", "5000"]).await,
            "+OK\r\n"
        );
        assert_eq!(call(&mut c, &["DEL", &key]).await, ":1\r\n");
    }
    // Two readings of every master at least.
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    assert_eq!(jumps(&cl), 0, "a steady clock was taken for a jump");
    for i in 0..5 {
        assert_eq!(cl.state(i), MasterState::Up, "master {i}");
    }

    clock.set_offset_secs(60);
    cl.wait_state(JUMPER, "sitting out", |s| {
        matches!(s, MasterState::SittingOut(..))
    })
    .await;
    assert_eq!(jumps(&cl), 1);
    // The other four still make a quorum.
    assert_eq!(
        call(&mut c, &["SET", "lock:after", "v", "NX", "PX", "5000"]).await,
        "+OK\r\n"
    );
    assert_eq!(
        cl.on_master(JUMPER, &["EXISTS", "lock:after"]).await,
        ":0\r\n"
    );
    let stats = call(&mut c, &["LOCKGATE", "STATS"]).await;
    assert!(
        stats.contains("$23\r\nlock_quorum_clock_jumps\r\n:1\r\n"),
        "{stats:?}"
    );
}

/// `clock_faults = 1` with 5 masters: an acquisition needs 4 "yes" votes,
/// so 3 free masters are not enough, 4 are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clock_faults_ask_for_more_than_n_plus_k_over_two() {
    let masters: Vec<RedisServer> = (0..5).map(|_| RedisServer::start()).collect();
    let cl = Cluster::start_on(masters, |c| {
        tweak(c);
        c.locks.quorum.clock_faults = 1;
    })
    .await;
    assert_eq!(cl.quorum().votes_needed(), 4);
    let mut c = cl.client().await;
    for i in [3, 4] {
        cl.on_master(i, &["SET", "lock:k3", "other", "PX", "60000"])
            .await;
    }
    assert_eq!(
        call(&mut c, &["SET", "lock:k3", "v", "NX", "PX", "5000"]).await,
        NIL,
        "3 of 5 is not more than (5 + 1) / 2"
    );
    for i in 0..3 {
        assert_eq!(cl.on_master(i, &["EXISTS", "lock:k3"]).await, ":0\r\n");
    }
    cl.on_master(4, &["SET", "lock:k4", "other", "PX", "60000"])
        .await;
    assert_eq!(
        call(&mut c, &["SET", "lock:k4", "v", "NX", "PX", "5000"]).await,
        "+OK\r\n"
    );
}
