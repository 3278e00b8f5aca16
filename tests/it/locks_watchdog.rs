//! Lease renewal and release on disconnect, against a real Redis: what the
//! key on Redis does while the acquiring connection lives and after it
//! closes. Keeping a lock alive is a property over time, so those checks
//! watch the key for a few leases (bounded, short); every other wait polls
//! for the event itself.

use crate::support;

use std::time::{Duration, Instant};

use lockgate::config::LockOverride;
use lockgate::Config;
use support::locks::{int_of, m, owner, pttl};
use support::{show, Lockgate, RawClient, RedisServer};

/// The watchdog lease of these tests.
const LEASE: Duration = Duration::from_millis(300);
/// Slack for scheduling on a loaded 2-core machine.
const MARGIN: Duration = Duration::from_millis(700);
/// Poll interval when watching keys on Redis.
const POLL: Duration = Duration::from_millis(20);

fn config(redis: &RedisServer, overrides: Vec<LockOverride>) -> Config {
    let mut c = Config::default();
    c.upstream.addr = redis.addr();
    c.locks.overrides = overrides;
    c
}

fn watchdog(max_hold_ms: u64) -> LockOverride {
    LockOverride {
        pattern: "lock:wd:*".into(),
        lease_ms: LEASE.as_millis() as u64,
        watchdog: true,
        max_hold_ms,
        ..Default::default()
    }
}

/// A fresh Redis, lockgate in front of it with `overrides`, and a
/// connection straight to that Redis in RESP3 (a missing key is then `_`,
/// not RESP2's `$-1`). Bind the server to a name, never `_`: dropping it
/// stops Redis.
async fn start(overrides: Vec<LockOverride>) -> (RedisServer, Lockgate, RawClient) {
    start_with(overrides, |_| {}).await
}

/// [`start`] with the config changed by `adjust` before lockgate starts.
async fn start_with(
    overrides: Vec<LockOverride>,
    adjust: impl FnOnce(&mut Config),
) -> (RedisServer, Lockgate, RawClient) {
    let redis = RedisServer::start();
    let mut c = config(&redis, overrides);
    adjust(&mut c);
    let lg = Lockgate::start_with(c).await;
    let mut direct = RawClient::connect(redis.addr()).await;
    let hello = direct.call_raw(&["HELLO", "3"]).await;
    assert!(hello.starts_with(b"%"), "HELLO 3: {hello:?}");
    (redis, lg, direct)
}

/// Polls Redis until none of `keys` exists; panics if that takes longer
/// than `within` after `since`. Returns when they were seen gone.
async fn gone_within(
    direct: &mut RawClient,
    keys: &[&str],
    since: Instant,
    within: Duration,
) -> Duration {
    loop {
        let mut args = vec!["EXISTS"];
        args.extend_from_slice(keys);
        let left = int_of(direct, &args).await;
        let elapsed = since.elapsed();
        if left == 0 {
            return elapsed;
        }
        assert!(
            elapsed <= within,
            "{keys:?} still exist ({left}) {elapsed:?} after the start, expected gone within {within:?}"
        );
        tokio::time::sleep(POLL).await;
    }
}

/// Watches `keys` on Redis for `span`: each must keep a positive PTTL the
/// whole time. Returns how many times they were looked at.
async fn stay_alive(direct: &mut RawClient, keys: &[&str], span: Duration) -> u32 {
    let start = Instant::now();
    let mut looks = 0;
    while start.elapsed() < span {
        for key in keys {
            let t = pttl(direct, key).await;
            assert!(
                t > 0,
                "{key} lost its lease {:?} in: PTTL {t}",
                start.elapsed()
            );
            assert!(
                t <= LEASE.as_millis() as i64,
                "{key} PTTL {t} above the lease"
            );
        }
        looks += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    looks
}

/// While the acquiring connection is open, the watchdog keeps a 300 ms
/// lock alive for four leases; once it closes, the lock expires within
/// about one lease (no release on disconnect for this pattern).
#[tokio::test]
async fn watchdog_renews_while_the_connection_lives() {
    let (_redis, lg, mut direct) = start(vec![watchdog(2_000)]).await;
    let mut holder = RawClient::connect(lg.addr).await;

    assert_eq!(
        holder.call_raw(&["SETNX", "lock:wd:1", "me"]).await,
        b":1\r\n"
    );
    let first = pttl(&mut direct, "lock:wd:1").await;
    assert!(
        first > 0 && first <= 300,
        "acquired with the 300 ms lease, PTTL {first}"
    );

    let looks = stay_alive(&mut direct, &["lock:wd:1", &owner("lock:wd:1")], 4 * LEASE).await;
    assert!(looks >= 4, "looked only {looks} times");
    assert_eq!(
        show(&direct.call_raw(&["GET", "lock:wd:1"]).await),
        "$2\r\nme\r\n",
        "value untouched"
    );
    let renewals = m(&lg.ctx.locks.metrics.watchdog_renewals);
    // Every lease/3 over 1.2 s: about 12; at least one per lease.
    assert!(renewals >= 4, "watchdog_renewals = {renewals}");
    // Long past its first lease, the renewed holder is still the holder
    // to lockgate: its re-entrant attempts, one right after the other,
    // are answered as Redis answers them and never parked (a holding
    // whose lease ran out by lockgate's clock would spin like a loser's).
    for _ in 0..2 {
        let again = holder.call_raw(&["SETNX", "lock:wd:1", "me"]).await;
        assert_eq!(again, b":0\r\n");
    }
    assert_eq!(
        m(&lg.ctx.locks.storm.metrics.parked),
        0,
        "the holder parked"
    );

    drop(holder);
    let closed = Instant::now();
    let keys = ["lock:wd:1", &owner("lock:wd:1")];
    let after = gone_within(&mut direct, &keys, closed, LEASE + MARGIN).await;
    eprintln!("expired {after:?} after disconnect");
    let settled = m(&lg.ctx.locks.metrics.watchdog_renewals);
    // Nothing renews it any more: it stays gone.
    tokio::time::sleep(LEASE).await;
    assert_eq!(direct.call_raw(&["EXISTS", "lock:wd:1"]).await, b":0\r\n");
    assert_eq!(
        m(&lg.ctx.locks.metrics.watchdog_renewals),
        settled,
        "renewals after the disconnect"
    );
    assert_eq!(m(&lg.ctx.locks.metrics.released_on_disconnect), 0);
    lg.stop().await;
}

/// `max_hold_ms` bounds the watchdog: with 700 ms the lock expires by
/// about 700 ms + one lease although its connection stays open, and not
/// before it outlived its first lease (the watchdog did run).
#[tokio::test]
async fn watchdog_stops_at_max_hold() {
    let (_redis, lg, mut direct) = start(vec![watchdog(700)]).await;
    let mut holder = RawClient::connect(lg.addr).await;

    let sent = Instant::now();
    assert_eq!(
        holder.call_raw(&["SETNX", "lock:wd:max", "me"]).await,
        b":1\r\n"
    );
    let keys = ["lock:wd:max", &owner("lock:wd:max")];
    let lived = gone_within(
        &mut direct,
        &keys,
        sent,
        Duration::from_millis(700) + LEASE + MARGIN,
    )
    .await;
    assert!(
        lived >= Duration::from_millis(700),
        "expired after {lived:?}: the watchdog should have renewed it until ~700 ms"
    );
    assert!(m(&lg.ctx.locks.metrics.watchdog_renewals) > 0);
    // The connection is still open and served.
    assert_eq!(holder.call_raw(&["PING"]).await, b"+PONG\r\n");
    // And the watchdog leaves it alone from now on.
    let settled = m(&lg.ctx.locks.metrics.watchdog_renewals);
    tokio::time::sleep(LEASE).await;
    assert_eq!(
        m(&lg.ctx.locks.metrics.watchdog_renewals),
        settled,
        "renewals past max_hold"
    );
    lg.stop().await;
}

/// A lock its owner released with DEL is not renewed: the key and its
/// owner record stay gone, and a value someone else sets later directly
/// on Redis keeps its own short TTL.
#[tokio::test]
async fn released_lock_is_not_renewed() {
    let (_redis, lg, mut direct) = start(vec![watchdog(5_000)]).await;
    let mut holder = RawClient::connect(lg.addr).await;
    let renewals = &lg.ctx.locks.metrics.watchdog_renewals;

    assert_eq!(
        holder.call_raw(&["SETNX", "lock:wd:rel", "me"]).await,
        b":1\r\n"
    );
    until!("a first renewal", m(renewals) >= 1);
    assert_eq!(holder.call_raw(&["DEL", "lock:wd:rel"]).await, b":1\r\n");
    let owner_key = owner("lock:wd:rel");
    assert_eq!(
        direct
            .call_raw(&["EXISTS", "lock:wd:rel", &owner_key])
            .await,
        b":0\r\n"
    );
    let at_release = m(renewals);

    // Someone sets the key again behind lockgate's back, with 200 ms.
    assert_eq!(
        direct
            .call_raw(&["SET", "lock:wd:rel", "other", "PX", "200"])
            .await,
        b"+OK\r\n"
    );
    let set = Instant::now();
    let lived = gone_within(
        &mut direct,
        &["lock:wd:rel"],
        set,
        Duration::from_millis(200) + MARGIN,
    )
    .await;
    eprintln!("foreign value lived {lived:?}");
    // Two more leases: still gone, no owner record, no renewal.
    let start = Instant::now();
    while start.elapsed() < 2 * LEASE {
        assert_eq!(
            direct
                .call_raw(&["EXISTS", "lock:wd:rel", &owner_key])
                .await,
            b":0\r\n"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // At most one renewal already in flight when the DEL ran.
    let now = m(renewals);
    assert!(
        now <= at_release + 1,
        "renewals went on after the release: {at_release} -> {now}"
    );
    assert_eq!(m(&lg.ctx.locks.metrics.released), 1);
    lg.stop().await;
}

fn ephemeral() -> LockOverride {
    LockOverride {
        pattern: "lock:eph:*".into(),
        lease_ms: 30_000,
        release_on_disconnect: true,
        ..Default::default()
    }
}

/// Waits until lockgate has served `total` connections and exactly
/// `active` are still open: a closed session has run its release on
/// disconnect by then.
async fn sessions_settle(lg: &Lockgate, total: u64, active: u64) {
    let metrics = &lg.ctx.metrics;
    until!(
        format!("{active} of {total} sessions left"),
        m(&metrics.connections_total) >= total && m(&metrics.connections_active) == active
    );
}

/// `release_on_disconnect`: closing the acquiring connection deletes the
/// lock and its owner record at once, long before the 30 s lease.
#[tokio::test]
async fn release_on_disconnect_frees_the_lock() {
    let (_redis, lg, mut direct) = start(vec![ephemeral()]).await;
    let mut holder = RawClient::connect(lg.addr).await;

    assert_eq!(
        holder.call_raw(&["SETNX", "lock:eph:1", "me"]).await,
        b":1\r\n"
    );
    let owner_key = owner("lock:eph:1");
    let lease = pttl(&mut direct, "lock:eph:1").await;
    assert!(lease > 29_000, "30 s lease, PTTL {lease}");
    assert_eq!(
        direct.call_raw(&["EXISTS", "lock:eph:1", &owner_key]).await,
        b":2\r\n"
    );
    assert_eq!(m(&lg.ctx.locks.metrics.released_on_disconnect), 0);

    drop(holder);
    let closed = Instant::now();
    let took = gone_within(
        &mut direct,
        &["lock:eph:1", &owner_key],
        closed,
        Duration::from_secs(3),
    )
    .await;
    eprintln!("released {took:?} after disconnect");
    sessions_settle(&lg, 1, 0).await;
    assert_eq!(m(&lg.ctx.locks.metrics.released_on_disconnect), 1);

    // Free for the next client at once.
    let mut next = RawClient::connect(lg.addr).await;
    assert_eq!(
        next.call_raw(&["SETNX", "lock:eph:1", "next"]).await,
        b":1\r\n"
    );
    lg.stop().await;
}

/// A connection whose lock lapsed and was re-acquired by another
/// connection does not release the new holder's lock when it closes.
#[tokio::test]
async fn release_on_disconnect_spares_the_next_holder() {
    let (_redis, lg, mut direct) = start(vec![ephemeral()]).await;
    let mut a = RawClient::connect(lg.addr).await;
    let owner_key = owner("lock:eph:2");

    // A takes it with a short lease of its own, which runs out.
    assert_eq!(
        a.call_raw(&["SET", "lock:eph:2", "a", "NX", "PX", "200"])
            .await,
        b"+OK\r\n"
    );
    gone_within(
        &mut direct,
        &["lock:eph:2", &owner_key],
        Instant::now(),
        Duration::from_millis(200) + MARGIN,
    )
    .await;
    // B takes it over through lockgate.
    let mut b = RawClient::connect(lg.addr).await;
    assert_eq!(b.call_raw(&["SETNX", "lock:eph:2", "b"]).await, b":1\r\n");
    let b_token = direct.call_raw(&["GET", &owner_key]).await;

    drop(a);
    sessions_settle(&lg, 2, 1).await;
    assert_eq!(
        show(&direct.call_raw(&["GET", "lock:eph:2"]).await),
        "$1\r\nb\r\n",
        "B's lock survives A's close"
    );
    assert_eq!(
        show(&direct.call_raw(&["GET", &owner_key]).await),
        show(&b_token),
        "B's owner record survives"
    );
    let left = pttl(&mut direct, "lock:eph:2").await;
    assert!(left > 29_000, "B's lease untouched, PTTL {left}");
    assert_eq!(m(&lg.ctx.locks.metrics.released_on_disconnect), 0);

    // B's own close releases it.
    drop(b);
    gone_within(
        &mut direct,
        &["lock:eph:2", &owner_key],
        Instant::now(),
        Duration::from_secs(3),
    )
    .await;
    sessions_settle(&lg, 2, 0).await;
    assert_eq!(m(&lg.ctx.locks.metrics.released_on_disconnect), 1);
    lg.stop().await;
}

/// A lock key without a watchdog simply expires after `default_lease_ms`,
/// even with the watchdog running for other patterns and the holder's
/// connection open.
#[tokio::test]
async fn plain_lock_expires_after_its_lease() {
    let (_redis, lg, mut direct) =
        start_with(vec![watchdog(5_000)], |c| c.locks.default_lease_ms = 300).await;
    let mut holder = RawClient::connect(lg.addr).await;

    let sent = Instant::now();
    assert_eq!(
        holder.call_raw(&["SETNX", "lock:plain", "me"]).await,
        b":1\r\n"
    );
    let t = pttl(&mut direct, "lock:plain").await;
    assert!(t > 0 && t <= 300, "default lease 300 ms, PTTL {t}");
    let keys = ["lock:plain", &owner("lock:plain")];
    let lived = gone_within(&mut direct, &keys, sent, LEASE + MARGIN).await;
    eprintln!("plain lock lived {lived:?}");
    assert_eq!(m(&lg.ctx.locks.metrics.watchdog_renewals), 0);
    assert_eq!(holder.call_raw(&["PING"]).await, b"+PONG\r\n");
    lg.stop().await;
}

/// The compare-and-delete release of redis-py and most tutorials, run by
/// the client itself (passed through untouched).
const LUA_RELEASE: &str = r#"if redis.call("get",KEYS[1]) == ARGV[1] then return redis.call("del",KEYS[1]) else return 0 end"#;

/// A client that asked for its own lease (`PX 3000`) on a watchdog key
/// keeps at least that lease while connected: the watchdog may lengthen
/// it, never cut it to its 300 ms lease and then stop at `max_hold_ms`
/// (700 ms) with the holder still inside its critical section.
#[tokio::test]
async fn watchdog_never_shortens_the_clients_own_lease() {
    let (_redis, lg, mut direct) = start(vec![watchdog(700)]).await;
    let mut holder = RawClient::connect(lg.addr).await;

    let sent = Instant::now();
    assert_eq!(
        holder
            .call_raw(&["SET", "lock:wd:px", "me", "NX", "PX", "3000"])
            .await,
        b"+OK\r\n"
    );
    // Watch it for half its own lease (five watchdog leases, past max_hold).
    while sent.elapsed() < Duration::from_millis(1_500) {
        let t = pttl(&mut direct, "lock:wd:px").await;
        assert!(
            t > 0,
            "the client's 3000 ms lock is gone {:?} after SET NX PX 3000, its connection open (PTTL {t})",
            sent.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(holder.call_raw(&["DEL", "lock:wd:px"]).await, b":1\r\n");
    lg.stop().await;
}

/// A Lua acquire, as lock libraries that acquire by script send it
/// (passed through untouched, so lockgate writes no owner record).
const LUA_ACQUIRE: &str = r#"return redis.call("set",KEYS[1],ARGV[1],"NX","PX",ARGV[2])"#;

/// A watchdog lock released by the client's own Lua script (redis-py's
/// `release`) is not renewed afterwards: the next holder, who acquired it
/// with its own Lua script through lockgate with a 200 ms lease, keeps
/// that lease, and the released lock's owner record expires.
#[tokio::test]
async fn lua_released_watchdog_lock_is_not_renewed() {
    let (_redis, lg, mut direct) = start(vec![watchdog(5_000)]).await;
    let mut holder = RawClient::connect(lg.addr).await;
    let mut next = RawClient::connect(lg.addr).await;
    let renewals = &lg.ctx.locks.metrics.watchdog_renewals;
    let owner_key = owner("lock:wd:lua");

    assert_eq!(
        holder.call_raw(&["SETNX", "lock:wd:lua", "me"]).await,
        b":1\r\n"
    );
    until!("a first renewal", m(renewals) >= 1);
    assert_eq!(
        holder
            .call_raw(&["EVAL", LUA_RELEASE, "1", "lock:wd:lua", "me"])
            .await,
        b":1\r\n"
    );
    assert_eq!(direct.call_raw(&["EXISTS", "lock:wd:lua"]).await, b":0\r\n");

    assert_eq!(
        next.call_raw(&["EVAL", LUA_ACQUIRE, "1", "lock:wd:lua", "next", "200"])
            .await,
        b"+OK\r\n"
    );
    let lived = gone_within(
        &mut direct,
        &["lock:wd:lua"],
        Instant::now(),
        Duration::from_millis(200) + MARGIN,
    )
    .await;
    eprintln!("the next holder's 200 ms lock lived {lived:?}");
    // The released lock's owner record is not kept alive either.
    gone_within(&mut direct, &[&owner_key], Instant::now(), LEASE + MARGIN).await;
    lg.stop().await;
}

/// `release_on_disconnect` after the holder released by its own Lua script
/// and another client acquired with its own Lua script through lockgate:
/// the first connection's close must not delete the next holder's lock.
#[tokio::test]
async fn release_on_disconnect_spares_a_lock_taken_after_a_lua_release() {
    let (_redis, lg, mut direct) = start(vec![ephemeral()]).await;
    let mut a = RawClient::connect(lg.addr).await;
    let mut b = RawClient::connect(lg.addr).await;

    assert_eq!(a.call_raw(&["SETNX", "lock:eph:3", "a"]).await, b":1\r\n");
    assert_eq!(
        a.call_raw(&["EVAL", LUA_RELEASE, "1", "lock:eph:3", "a"])
            .await,
        b":1\r\n"
    );
    assert_eq!(
        b.call_raw(&["EVAL", LUA_ACQUIRE, "1", "lock:eph:3", "b", "30000"])
            .await,
        b"+OK\r\n"
    );

    drop(a);
    sessions_settle(&lg, 2, 1).await;
    assert_eq!(
        show(&direct.call_raw(&["GET", "lock:eph:3"]).await),
        "$1\r\nb\r\n",
        "B's lock was deleted when A closed (released_on_disconnect = {})",
        m(&lg.ctx.locks.metrics.released_on_disconnect)
    );
    assert_eq!(m(&lg.ctx.locks.metrics.released_on_disconnect), 0);
    lg.stop().await;
}

/// A watchdog lock that lapsed (here: deleted on Redis, as a stall longer
/// than the lease would) and was taken by another connection is renewed
/// only by its new holder: once that one closes, it expires, although the
/// first holder's connection is still open.
#[tokio::test]
async fn lapsed_watchdog_lock_is_renewed_only_by_its_new_holder() {
    let (_redis, lg, mut direct) = start(vec![watchdog(5_000)]).await;
    let mut a = RawClient::connect(lg.addr).await;
    let renewals = &lg.ctx.locks.metrics.watchdog_renewals;
    let owner_key = owner("lock:wd:t");

    assert_eq!(a.call_raw(&["SETNX", "lock:wd:t", "a"]).await, b":1\r\n");
    until!("a first renewal", m(renewals) >= 1);
    assert_eq!(
        direct.call_raw(&["DEL", "lock:wd:t", &owner_key]).await,
        b":2\r\n"
    );
    let mut b = RawClient::connect(lg.addr).await;
    assert_eq!(b.call_raw(&["SETNX", "lock:wd:t", "b"]).await, b":1\r\n");
    // B's watchdog keeps it; A's must not (it is no longer A's).
    let renewed = m(renewals);
    until!("B's renewals", m(renewals) >= renewed + 2);
    assert_eq!(
        show(&direct.call_raw(&["GET", "lock:wd:t"]).await),
        "$1\r\nb\r\n"
    );

    drop(b);
    let lived = gone_within(
        &mut direct,
        &["lock:wd:t", &owner_key],
        Instant::now(),
        LEASE + MARGIN,
    )
    .await;
    eprintln!("B's lock expired {lived:?} after B closed");
    assert_eq!(a.call_raw(&["PING"]).await, b"+PONG\r\n");
    lg.stop().await;
}
