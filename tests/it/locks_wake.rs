//! A lock library's waiter whose wake-up is lost (`lock::wake`):
//! python-redis-lock's waiter blocks on the lock's signal list until the
//! holder's release pushes to it, and a holder that never releases (a
//! crashed worker; its lease ran out) pushes nothing; Redisson's waiter
//! waits for its lock channel's message up to the lease left, and a
//! message lost leaves it there. Through lockgate each still wakes, within
//! one or two `probe_interval_ms` of the lock being free; with the watch
//! off it sleeps on, as it would on Redis.

use std::net::SocketAddr;
use std::time::Duration;

use crate::support;

use support::locks::m;
use support::{python, Lockgate, RedisServer};

/// What `tests/py/redis_lock_wake.py` printed.
struct Waited {
    /// Waiters that got the lock in time.
    acquired: usize,
    /// When each did, seconds after they began waiting.
    waited_s: Vec<f64>,
}

/// Runs the python-redis-lock holder and `waiters` waiters against `lg`
/// on lock `name`, in connection shape `shape` ("own" or "pool"), giving
/// them `wait_s` seconds.
async fn holder_and_waiters(
    lg: SocketAddr,
    name: &str,
    wait_s: f64,
    shape: &str,
    waiters: usize,
) -> Waited {
    let args = [
        lg.ip().to_string(),
        lg.port().to_string(),
        name.to_string(),
        wait_s.to_string(),
        shape.to_string(),
        waiters.to_string(),
    ];
    let limit = Duration::from_secs_f64(wait_s + 30.0);
    let out = python("redis_lock_wake.py", &args, limit).await;
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON line");
    let waited_s = (v["waited_s"].as_array().expect("waited_s").iter())
        .map(|t| t.as_f64().expect("seconds"))
        .collect();
    Waited {
        acquired: v["acquired"].as_u64().expect("acquired") as usize,
        waited_s,
    }
}

fn config(redis: &RedisServer, watch: bool) -> lockgate::Config {
    let mut c = lockgate::Config::default();
    c.upstream.addr = redis.addr();
    // A lock taken without expiry lasts this long through lockgate.
    c.locks.default_lease_ms = 1_000;
    c.locks.retry.probe_interval_ms = 100;
    if !watch {
        c.locks.wake.max_keys = 0;
    }
    c
}

/// The holder's lease (1 s) ran out, then one probe at most (0.1 s): the
/// first waiter wakes then, well within the 20 s they were given on a
/// loaded box, and each one's release wakes the next.
async fn woken_in(shape: &str, waiters: usize) {
    let redis = RedisServer::start();
    let lg = Lockgate::start_with(config(&redis, true)).await;
    let name = format!("wake:{shape}");
    let w = holder_and_waiters(lg.addr, &name, 20.0, shape, waiters).await;
    assert_eq!(w.acquired, waiters, "woken: {:?}", w.waited_s);
    eprintln!("{shape}: woken after {:?} s", w.waited_s);
    let first = w.waited_s[0];
    assert!((0.8..8.0).contains(&first), "first woken after {first} s");
    let pushes = m(&lg.ctx.locks.metrics.wake_pushes);
    assert!(pushes >= 1, "lock_wake_pushes = {pushes}");
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_wake_up_never_comes_is_woken_once_the_lease_ran_out() {
    woken_in("own", 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_sharing_a_pool_are_woken_too() {
    woken_in("pool", 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_watch_off_the_waiter_sleeps_on() {
    let redis = RedisServer::start();
    let lg = Lockgate::start_with(config(&redis, false)).await;
    // The lease ran out after 1 s; the waiter is still asleep at 3 s.
    let w = holder_and_waiters(lg.addr, "wake:off", 3.0, "own", 1).await;
    assert_eq!(
        w.acquired, 0,
        "woken after {:?} s with nothing to wake it",
        w.waited_s
    );
    assert_eq!(m(&lg.ctx.locks.metrics.wake_pushes), 0);
    lg.stop().await;
}

/// Redisson's wire (`tests/py/redisson_wake.py`): a waiter subscribed to
/// `redisson_lock__channel:{<key>}` whose lock went without its unlock
/// message, against a 30 s lease, given `wait_s`: when it acquired.
async fn redisson_waiter(lg: SocketAddr, key: &str, wait_s: f64) -> f64 {
    let args = [
        lg.ip().to_string(),
        lg.port().to_string(),
        key.to_string(),
        wait_s.to_string(),
    ];
    let out = python("redisson_wake.py", &args, Duration::from_secs(60)).await;
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON line");
    assert_eq!(v["acquired"], true, "{out}");
    v["waited_s"].as_f64().expect("waited_s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redisson_waiter_whose_unlock_message_was_lost_is_woken() {
    let redis = RedisServer::start();
    let lg = Lockgate::start_with(config(&redis, true)).await;
    // Free for a whole probe interval with a subscriber: published within
    // two intervals (0.2 s), not at the lease's end (30 s) nor at the
    // waiter's budget (5 s).
    let woken = redisson_waiter(lg.addr, "lock:redisson:on", 5.0).await;
    eprintln!("redisson: woken after {woken:.3} s");
    assert!(woken < 2.5, "woken after {woken} s");
    assert!(m(&lg.ctx.locks.metrics.wake_pushes) >= 1);
    lg.stop().await;

    // With the watch off it waits out its budget.
    let lg = Lockgate::start_with(config(&redis, false)).await;
    let slept = redisson_waiter(lg.addr, "lock:redisson:off", 3.0).await;
    assert!(
        slept >= 2.9,
        "woken after {slept} s with nothing to wake it"
    );
    lg.stop().await;
}

/// A connection blocked on a lock's signal list after losing it is listed
/// by `LOCKGATE WAITERS` (`waits` `BLPOP <list>`, no position: its library
/// decides), with its name and wait, until it tries for the key again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_blocked_on_the_signal_list_is_listed_until_it_tries_again() {
    use support::ops::{base_config, call, Ops};
    let redis = RedisServer::start();
    let lg = Ops::start(base_config(&redis.addr())).await;
    let (mut holder, mut waiter, mut admin) =
        (lg.client().await, lg.client().await, lg.client().await);
    assert_eq!(
        waiter.call_s(&["CLIENT", "SETNAME", "waiter-1"]).await,
        "+OK\r\n"
    );
    let (key, list) = ("lock:listed", "lock-signal:listed");
    assert_eq!(
        holder.call_s(&["SET", key, "h", "NX", "EX", "30"]).await,
        "+OK\r\n"
    );
    assert_eq!(
        waiter.call_s(&["SET", key, "w", "NX", "EX", "30"]).await,
        "$-1\r\n"
    );
    waiter.send(&support::cmd(&["BLPOP", list, "0"])).await;
    let listed = || async {
        let mut admin = lg.client().await;
        call(&mut admin, &["LOCKGATE", "WAITERS", key]).await
    };
    crate::until!("the waiter listed", !listed().await.items().is_empty());
    let rows = call(&mut admin, &["LOCKGATE", "WAITERS", key]).await;
    let row = rows.items()[0].clone();
    assert_eq!(row.field("client_name").text(), "waiter-1", "{rows}");
    assert_eq!(row.field("waits").text(), format!("BLPOP {list}"), "{rows}");
    assert!(row.field("waited_ms").int() >= 0, "{rows}");
    assert_eq!(row.field("position").to_string(), "nil", "{rows}");
    // The holder releases as the library does (delete, then push): the
    // waiter wakes and tries again, and is no longer listed.
    assert_eq!(holder.call_s(&["DEL", key]).await, ":1\r\n");
    assert_eq!(holder.call_s(&["LPUSH", list, "1"]).await, ":1\r\n");
    let woken = waiter.read_s().await;
    assert!(woken.contains(list), "{woken:?}");
    assert_eq!(
        waiter.call_s(&["SET", key, "w", "NX", "EX", "30"]).await,
        "+OK\r\n"
    );
    assert!(listed().await.items().is_empty());
    lg.stop().await;
}

/// python-redis-lock's release, as its script does it: the lock deleted,
/// one wake-up pushed to its signal list, lapsing after 1 s.
const RELEASE: &str = "redis.call('del', KEYS[1]) \
     redis.call('lpush', KEYS[2], 1) redis.call('pexpire', KEYS[2], 1000) return 0";

/// Waits until Redis holds `n` clients' `cmd` back: blocked, or paused
/// under `CLIENT PAUSE` (both `flags=b`).
async fn until_blocked(direct: &mut support::RawClient, cmd: &str, n: usize) {
    let wanted = format!("cmd={cmd} ");
    crate::until!(format!("{n} {cmd} held back"), {
        let list = direct.call_s(&["CLIENT", "LIST"]).await;
        let held = list
            .lines()
            .filter(|l| l.contains(" flags=b ") && l.contains(&wanted));
        held.count() == n
    });
}

/// Redis, lockgate in front of it with the probe at 60 s (so only what is
/// tested can wake a waiter in time), a connection straight to Redis and
/// three through lockgate.
async fn slow_probe() -> (
    RedisServer,
    Lockgate,
    support::RawClient,
    [support::RawClient; 3],
) {
    use support::RawClient;
    let redis = RedisServer::start();
    let mut c = config(&redis, true);
    c.locks.retry.probe_interval_ms = 60_000;
    c.locks.default_lease_ms = 30_000;
    let lg = Lockgate::start_with(c).await;
    let direct = RawClient::connect(redis.addr()).await;
    let clients = [
        RawClient::connect(lg.addr).await,
        RawClient::connect(lg.addr).await,
        RawClient::connect(lg.addr).await,
    ];
    (redis, lg, direct, clients)
}

/// `SET key who NX PX 30000` on `c`: its reply.
async fn set_nx(c: &mut support::RawClient, key: &str, who: &str) -> String {
    c.call_s(&["SET", key, who, "NX", "PX", "30000"]).await
}

/// The release is lockgate's to learn only from its script's reply: an
/// attempt answered "held" from what lockgate knew while the script was
/// on its way was told so of a lock already free. Its caller, a
/// library's waiter, blocks again for a wake-up the release pushed and
/// another waiter took (in python-redis-lock's `test_no_overlap` it was
/// the same waiter), and with the probe interval at 60 s nothing else
/// pushes for a minute. Here Redis holds the release back (`CLIENT PAUSE
/// WRITE`) while the attempt is absorbed, so the order is certain: the
/// release's reply makes lockgate look at once, and the waiter wakes. A
/// release with no such answer in between looks at nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_told_held_while_the_release_was_on_its_way_is_woken_at_once() {
    let (_redis, lg, mut direct, [mut holder, mut first, mut told]) = slow_probe().await;
    let (key, list) = ("lock:told", "lock-signal:told");
    let rechecks = || m(&lg.ctx.locks.metrics.wake_rechecks);
    let release = ["EVAL", RELEASE, "2", key, list];

    // Round 1, the control: the holder's release, nothing answered in
    // between. The waiter blocked first takes its wake-up.
    assert_eq!(set_nx(&mut holder, key, "h").await, "+OK\r\n");
    assert_eq!(set_nx(&mut first, key, "f").await, "$-1\r\n");
    first.send(&support::cmd(&["BLPOP", list, "0"])).await;
    until_blocked(&mut direct, "blpop", 1).await;
    assert_eq!(holder.call_s(&release).await, ":0\r\n");
    assert!(first.read_s().await.contains(list));
    assert_eq!(rechecks(), 0, "a release with no refusal in between");
    assert_eq!(
        direct.call_s(&["EXISTS", list]).await,
        ":0\r\n",
        "nothing pushed"
    );

    // Round 2: the same, but the release is held back in Redis while
    // another waiter's attempt is answered "held" by lockgate.
    assert_eq!(set_nx(&mut first, key, "f").await, "+OK\r\n");
    assert_eq!(set_nx(&mut holder, key, "h").await, "$-1\r\n");
    holder.send(&support::cmd(&["BLPOP", list, "0"])).await;
    until_blocked(&mut direct, "blpop", 1).await;
    assert_eq!(
        direct.call_s(&["CLIENT", "PAUSE", "20000", "WRITE"]).await,
        "+OK\r\n"
    );
    first.send(&support::cmd(&release)).await;
    until_blocked(&mut direct, "eval", 1).await;
    let absorbed = m(&lg.ctx.locks.storm.metrics.absorbed);
    assert_eq!(set_nx(&mut told, key, "t").await, "$-1\r\n");
    assert!(
        m(&lg.ctx.locks.storm.metrics.absorbed) > absorbed,
        "answered by lockgate"
    );
    told.send(&support::cmd(&["BLPOP", list, "0"])).await;
    // Blocked (held back) before the release runs: lockgate saw it go to
    // sleep on a lock it knew held, which alone asks for no look.
    until_blocked(&mut direct, "blpop", 2).await;
    assert_eq!(rechecks(), 0);
    assert_eq!(direct.call_s(&["CLIENT", "UNPAUSE"]).await, "+OK\r\n");
    assert_eq!(first.read_s().await, ":0\r\n");
    // The waiter blocked first took the release's own wake-up.
    assert!(holder.read_s().await.contains(list));
    // The one told "held" is woken by lockgate's, well before a probe.
    let woken = told.try_read_raw(Duration::from_secs(20)).await;
    let woken = woken.map(|w| support::show(&w));
    assert!(
        woken.as_deref().is_some_and(|w| w.contains(list)),
        "{woken:?}"
    );
    assert_eq!(rechecks(), 1);
    // Counted once Redis answered the push, which may be after the waiter
    // was woken by it.
    crate::until!(
        "the push counted",
        m(&lg.ctx.locks.metrics.wake_pushes) == 1
    );
    // Both woken, the first in line takes the lock.
    assert_eq!(set_nx(&mut holder, key, "h").await, "+OK\r\n");
    lg.stop().await;
}

/// A spinner whose park ended keeps its place at the front of the key's
/// queue for max(park, probe) (60 s here), so the lock waits for its next
/// attempt rather than going to a younger caller. A library's waiter that
/// then blocks on its signal list makes no next attempt until woken: its
/// place is dropped when it blocks, and another caller takes the lock
/// once it is free (in python-redis-lock's `test_no_overlap`, a minute's
/// stall one run in ten before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_blocked_on_its_list_keeps_no_place_in_the_queue() {
    let (_redis, lg, mut direct, [mut holder, mut sleeper, mut other]) = slow_probe().await;
    let (key, list) = ("lock:kept", "lock-signal:kept");
    let storm = &lg.ctx.locks.storm.metrics;
    assert_eq!(set_nx(&mut holder, key, "h").await, "+OK\r\n");
    // Two attempts in a row: the second parks, and its park ends.
    assert_eq!(set_nx(&mut sleeper, key, "s").await, "$-1\r\n");
    assert_eq!(set_nx(&mut sleeper, key, "s").await, "$-1\r\n");
    assert_eq!(m(&storm.park_timeouts), 1, "parked, then answered");
    sleeper.send(&support::cmd(&["BLPOP", list, "0"])).await;
    until_blocked(&mut direct, "blpop", 1).await;
    // The holder releases without a push (its own `DEL`): the sleeper
    // sleeps on, and the lock is the next caller's.
    assert_eq!(holder.call_s(&["DEL", key]).await, ":1\r\n");
    assert_eq!(set_nx(&mut other, key, "o").await, "+OK\r\n");
    lg.stop().await;
}
