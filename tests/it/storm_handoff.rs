//! Handoffs that ride on a release (retry storms on one Redis): a `DEL`
//! through lockgate of a lock that attempts are parked on gives the lock
//! to the oldest of them in the same script, so the lock is never free in
//! between, nothing is announced, and one round trip does both. Checked on
//! a real redis-server: its keys, owner records and `INFO commandstats`.

use crate::support;

use std::time::Duration;

use support::locks::{get, m, owner, pttl, setup_with, Call};
use support::redis::command_calls;
use support::{eventually, RawClient};

/// Calls of `name` on Redis since the last `CONFIG RESETSTAT`.
async fn calls(r: &mut RawClient, name: &str) -> u64 {
    command_calls(&r.call(&["INFO", "commandstats"]).await, name)
}

/// Lock scripts run on Redis since the last `CONFIG RESETSTAT`: `EVAL`
/// (lockgate's own connection) and `EVALSHA` (clients' connections).
async fn script_calls(r: &mut RawClient) -> u64 {
    calls(r, "eval").await + calls(r, "evalsha").await
}

/// The holder's `DEL` hands the lock to the parked `SETNX` of another
/// connection: one `EVAL` for both, no `PUBLISH`, the waiter's value and
/// owner record in place with its lease, and the waiter releases it as its
/// own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_hands_the_lock_to_the_parked_attempt_in_one_step() {
    // Known held and probed: the waiter's attempt is parked, not sent.
    let (_redis, lg, mut r) = setup_with("handoff", 30_000, |c| {
        c.locks.retry.park_ms = 5_000;
        c.locks.retry.probe_interval_ms = 10_000;
    })
    .await;
    let mut holder = RawClient::connect(lg.addr).await;
    let mut waiter = RawClient::connect(lg.addr).await;
    assert_eq!(holder.call(&["SETNX", "lock:h", "one"]).await, ":1\r\n");
    assert_eq!(r.call(&["CONFIG", "RESETSTAT"]).await, "+OK\r\n");

    let storm = lg.ctx.locks.storm.clone();
    let handoffs = m(&storm.metrics.handoffs);
    // A first attempt is a try-lock, answered at once; the next, moments
    // later, is a spinner's and parks.
    assert_eq!(waiter.call(&["SETNX", "lock:h", "two"]).await, ":0\r\n");
    let parked = tokio::spawn(async move {
        let reply = waiter.call(&["SETNX", "lock:h", "two"]).await;
        (waiter, reply)
    });
    eventually("the waiter to park", || storm.waiting(b"lock:h") == 1).await;
    assert_eq!(holder.call(&["DEL", "lock:h"]).await, ":1\r\n");
    let (mut waiter, reply) = tokio::time::timeout(Duration::from_secs(5), parked)
        .await
        .expect("the waiter answered")
        .expect("waiter task");
    assert_eq!(reply, ":1\r\n", "the parked SETNX acquired");

    assert_eq!(get(&mut r, "lock:h").await.as_deref(), Some("two"));
    let lease = pttl(&mut r, "lock:h").await;
    assert!(
        (29_000..=30_000).contains(&lease),
        "the waiter's lease: {lease}"
    );
    let record = pttl(&mut r, &owner("lock:h")).await;
    assert!(
        (29_000..=30_000).contains(&record),
        "its owner record's: {record}"
    );
    // The parked attempt was answered without asking Redis; the release
    // did the handoff: one script, nothing announced, nothing deleted.
    assert_eq!(
        script_calls(&mut r).await,
        1,
        "EVALs since the holder acquired"
    );
    assert_eq!(calls(&mut r, "publish").await, 0, "PUBLISH");
    assert_eq!(calls(&mut r, "del").await, 0, "DEL inside the script");
    assert_eq!(m(&lg.ctx.locks.storm.metrics.handoffs) - handoffs, 1);

    // The waiter holds it under its own token: its release goes through.
    assert_eq!(waiter.call(&["DEL", "lock:h"]).await, ":1\r\n");
    assert_eq!(
        r.call(&["EXISTS", "lock:h", &owner("lock:h")]).await,
        ":0\r\n"
    );
    lg.stop().await;
}

/// A release that is refused (the lock is another instance's) hands
/// nothing over: the parked attempt keeps waiting and is answered "not
/// acquired" when its park time ends; the lock is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_release_hands_nothing_over() {
    let (_redis, lg, mut r) = setup_with("handoff", 30_000, |c| {
        c.locks.retry.park_ms = 400;
    })
    .await;
    for (k, v) in [
        ("lock:o", "theirs"),
        (owner("lock:o").as_str(), "elsewhere:7"),
    ] {
        assert_eq!(r.call(&["SET", k, v, "PX", "30000"]).await, "+OK\r\n");
    }
    let mut stranger = RawClient::connect(lg.addr).await;
    let mut waiter = RawClient::connect(lg.addr).await;
    let storm = lg.ctx.locks.storm.clone();
    assert_eq!(waiter.call(&["SETNX", "lock:o", "mine"]).await, ":0\r\n");
    let parked = tokio::spawn(async move { waiter.call(&["SETNX", "lock:o", "mine"]).await });
    eventually("the waiter to park", || storm.waiting(b"lock:o") == 1).await;
    assert_eq!(stranger.call(&["DEL", "lock:o"]).await, ":0\r\n");
    assert_eq!(
        lg.ctx.locks.storm.waiting(b"lock:o"),
        1,
        "still parked after the refused release"
    );
    let reply = tokio::time::timeout(Duration::from_secs(5), parked)
        .await
        .expect("the waiter answered")
        .expect("waiter task");
    assert_eq!(reply, ":0\r\n");
    assert_eq!(get(&mut r, "lock:o").await.as_deref(), Some("theirs"));
    assert_eq!(
        r.call(&["GET", &owner("lock:o")]).await,
        "$11\r\nelsewhere:7\r\n"
    );
    lg.stop().await;
}

/// The first wave of a storm on a key nobody knows yet: while the first
/// attempt is on its way, the others wait for its answer instead of all
/// going to Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storms_first_wave_sends_one_attempt_not_one_per_client() {
    let (redis, lg, mut r) = setup_with("handoff", 30_000, |_| {}).await;
    let mut holder = RawClient::connect(redis.addr()).await;
    // Held behind lockgate's back, so lockgate knows nothing of it.
    assert_eq!(
        holder.call(&["SET", "lock:w", "x", "PX", "30000"]).await,
        "+OK\r\n"
    );
    let mut clients = Vec::new();
    for _ in 0..20 {
        clients.push(RawClient::connect(lg.addr).await);
    }
    assert_eq!(r.call(&["CONFIG", "RESETSTAT"]).await, "+OK\r\n");
    // All 20 attempts leave together, as one pipelined write each.
    for c in clients.iter_mut() {
        c.send(&support::cmd(&["SETNX", "lock:w", "y"])).await;
    }
    for c in clients.iter_mut() {
        assert_eq!(c.reply().await, ":0\r\n");
    }
    let evals = script_calls(&mut r).await;
    assert!(
        (1..=3).contains(&evals),
        "{evals} EVALs for a first wave of 20 attempts"
    );
    lg.stop().await;
}

/// The incident itself: a lock key left without lease (its `EXPIRE` never
/// came). Spinning on it through lockgate, with parking on and off, costs
/// Redis about one attempt per probe interval, not one per spin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_without_lease_is_probed_once_per_interval() {
    for park_ms in [50, 0] {
        let (_redis, lg, mut r) = setup_with("handoff", 30_000, |c| {
            c.locks.retry.park_ms = park_ms;
        })
        .await;
        assert_eq!(r.call(&["SET", "lock:stuck", "x"]).await, "+OK\r\n");
        let mut spinner = RawClient::connect(lg.addr).await;
        assert_eq!(r.call(&["CONFIG", "RESETSTAT"]).await, "+OK\r\n");
        let started = std::time::Instant::now();
        let mut attempts = 0u64;
        while started.elapsed() < Duration::from_millis(600) {
            assert_eq!(spinner.call(&["SETNX", "lock:stuck", "y"]).await, ":0\r\n");
            attempts += 1;
        }
        let elapsed_ms = started.elapsed().as_millis() as u64;
        let evals = script_calls(&mut r).await;
        let bound = elapsed_ms / 100 + 3;
        assert!(
            evals <= bound,
            "park_ms {park_ms}: {evals} EVALs for {attempts} attempts in {elapsed_ms} ms \
             (bound {bound})"
        );
        assert!(attempts > evals, "park_ms {park_ms}: nothing was absorbed");
        assert_eq!(get(&mut r, "lock:stuck").await.as_deref(), Some("x"));
        lg.stop().await;
    }
}

/// A spinner whose connection closes leaves no place in the key's queue
/// behind it: a newcomer is not held back for a client that is gone (found
/// by the differential test, seed 572840741: a `SET NX` on a free lock got
/// nil while a closed spinner's kept place lasted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_spinners_place_does_not_hold_newcomers_back() {
    // A probe interval of 3 s keeps a spinner's place for 3 s after its
    // park ends: long enough that the check below cannot pass by timing.
    let (_redis, lg, mut r) = setup_with("handoff", 30_000, |c| {
        c.locks.retry.park_ms = 50;
        c.locks.retry.probe_interval_ms = 3_000;
    })
    .await;
    let open = || m(&lg.ctx.metrics.connections_active);
    assert_eq!(r.call(&["SET", "lock:gone", "x"]).await, "+OK\r\n");
    let mut other = RawClient::connect(lg.addr).await;
    until!("one session", open() == 1);
    let mut spinner = RawClient::connect(lg.addr).await;
    until!("two sessions", open() == 2);
    assert_eq!(spinner.call(&["SETNX", "lock:gone", "y"]).await, ":0\r\n");
    // Moments later: parked, answered when its park ends, its place kept.
    assert_eq!(spinner.call(&["SETNX", "lock:gone", "y"]).await, ":0\r\n");
    assert_eq!(m(&lg.ctx.locks.storm.metrics.park_timeouts), 1);
    drop(spinner);
    until!("the spinner's session to end", open() == 1);
    assert_eq!(other.call(&["DEL", "lock:gone"]).await, ":1\r\n");
    assert_eq!(
        other.call(&["SET", "lock:gone", "z", "NX"]).await,
        "+OK\r\n",
        "held back behind a closed connection's place"
    );
    lg.stop().await;
}

/// A holder whose release never reached Redis (here: it never sent one)
/// and whose lease ran out is a loser like any other once it asks again:
/// its attempts park and take their place in line from its first attempt
/// after the lapse, behind a spinner that was waiting before it. Before,
/// lockgate took that connection for the holder for good: its attempts
/// were answered at once and never parked, so while anyone else waited it
/// could not be served (tests/serial/quorum_recovery.rs, seeds 4 and 9).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_lease_ran_out_waits_its_turn_as_a_loser() {
    let (_redis, lg, mut r) = setup_with("lapse", 300, |c| {
        c.locks.retry.park_ms = 5_000;
        c.locks.retry.probe_interval_ms = 10_000;
    })
    .await;
    let mut stale = RawClient::connect(lg.addr).await;
    let mut holder = RawClient::connect(lg.addr).await;
    let mut waiter = RawClient::connect(lg.addr).await;
    assert_eq!(stale.call(&["SETNX", "lock:lapse", "s"]).await, ":1\r\n");
    // Its lease runs out on Redis; lockgate is told nothing. Its view of
    // the lease ends a little later than Redis's (counted from the reply):
    // until then a lone SETNX is answered from the view (`:0`), as a
    // clean-clone CI found when it asked at once.
    let storm = lg.ctx.locks.storm.clone();
    crate::until!(
        "the stale lease to run out, on Redis and in lockgate's view",
        r.call(&["EXISTS", "lock:lapse"]).await == ":0\r\n"
            && storm.holder(b"lock:lapse").is_none()
    );
    assert_eq!(holder.call(&["SETNX", "lock:lapse", "h"]).await, ":1\r\n");
    assert_eq!(holder.call(&["EXPIRE", "lock:lapse", "30"]).await, ":1\r\n");
    // The waiter spins first: its second attempt parks.
    assert_eq!(waiter.call(&["SETNX", "lock:lapse", "w"]).await, ":0\r\n");
    let waiting = tokio::spawn(async move {
        let reply = waiter.call(&["SETNX", "lock:lapse", "w"]).await;
        (waiter, reply)
    });
    eventually("the waiter to park", || storm.waiting(b"lock:lapse") == 1).await;
    // Then the stale holder spins: its second attempt parks behind it.
    assert_eq!(stale.call(&["SETNX", "lock:lapse", "s"]).await, ":0\r\n");
    let stale_waits = tokio::spawn(async move {
        let reply = stale.call(&["SETNX", "lock:lapse", "s"]).await;
        (stale, reply)
    });
    eventually("the stale holder to park", || {
        storm.waiting(b"lock:lapse") == 2
    })
    .await;
    let within = Duration::from_secs(5);
    assert_eq!(holder.call(&["DEL", "lock:lapse"]).await, ":1\r\n");
    let (mut waiter, reply) = tokio::time::timeout(within, waiting)
        .await
        .expect("the waiter answered")
        .expect("waiter task");
    assert_eq!(reply, ":1\r\n", "the first in line acquired");
    assert_eq!(get(&mut r, "lock:lapse").await.as_deref(), Some("w"));
    assert_eq!(waiter.call(&["DEL", "lock:lapse"]).await, ":1\r\n");
    let (_stale, reply) = tokio::time::timeout(within, stale_waits)
        .await
        .expect("the stale holder answered")
        .expect("stale task");
    assert_eq!(reply, ":1\r\n", "the stale holder acquired in its turn");
    assert_eq!(get(&mut r, "lock:lapse").await.as_deref(), Some("s"));
    lg.stop().await;
}
