//! The fencing-token API (`LOCKGATE LOCK key ttl-ms [WAIT ms]`,
//! `LOCKGATE UNLOCK key token`, `LOCKGATE EXTEND key token ttl-ms`) against a
//! real redis-server: tokens from the per-key counter `lockgate:fence:{key}`
//! strictly increase (also across lockgate restarts), the lock's value on
//! Redis is the token, WAIT retries until released or timed out, a reply
//! lockgate works out on its own task keeps its place in the pipeline (RESP2
//! and RESP3), stale tokens release and extend nothing, usage errors leave
//! the connection usable, and a primary that is down or hung gets an error,
//! not a hang. Every outcome is also checked on Redis directly.
//!
//! All tests run on a multi-threaded runtime, as lockgate's binary does, so
//! the tasks that answer `LOCKGATE` commands are scheduled as in production.

use crate::support;

use std::time::{Duration, Instant};

use lockgate::Config;
use support::locks::{assert_within, exists, get, m, owner, pttl, until_gone};
use support::process::{proc_state, signal};
use support::resp::{call, text};
use support::{cmd, Lockgate, RawClient, RedisServer, WAIT};

/// Slack for scheduling on a loaded 2-core machine.
const MARGIN: Duration = Duration::from_millis(1000);

fn config(redis: &str) -> Config {
    let mut c = Config::default();
    c.upstream.addr = redis.to_string();
    c.upstream.connect_timeout_ms = 1_000;
    c.upstream.reconnect_interval_ms = 50;
    c.proxy.shutdown_grace_ms = 300;
    c
}

/// Parses a `LOCKGATE LOCK` reply: `Some((token, validity))` for
/// `*2 :token :validity`, `None` for a nil (`$-1` or `_`); anything else
/// fails the test.
fn lock_reply(reply: &str) -> Option<(i64, i64)> {
    if reply == "$-1\r\n" || reply == "_\r\n" {
        return None;
    }
    let parts: Vec<&str> = reply.split("\r\n").collect();
    match parts.as_slice() {
        ["*2", t, v, ""] if t.starts_with(':') && v.starts_with(':') => {
            let t = t[1..]
                .parse()
                .unwrap_or_else(|_| panic!("token in {reply:?}"));
            let v = v[1..]
                .parse()
                .unwrap_or_else(|_| panic!("validity in {reply:?}"));
            Some((t, v))
        }
        _ => panic!("not a LOCKGATE LOCK reply: {reply:?}"),
    }
}

/// `LOCKGATE LOCK key ttl [WAIT wait]`, parsed.
async fn lock(c: &mut RawClient, key: &str, ttl: u64, wait: Option<u64>) -> Option<(i64, i64)> {
    let ttl = ttl.to_string();
    let reply = match wait {
        None => call(c, &["LOCKGATE", "LOCK", key, &ttl]).await,
        Some(w) => call(c, &["LOCKGATE", "LOCK", key, &ttl, "WAIT", &w.to_string()]).await,
    };
    lock_reply(&reply)
}

/// `LOCKGATE LOCK` that must acquire: the token.
async fn acquire(c: &mut RawClient, key: &str, ttl: u64) -> i64 {
    lock(c, key, ttl, None)
        .await
        .unwrap_or_else(|| panic!("LOCKGATE LOCK {key} {ttl}: nil, expected a token"))
        .0
}

async fn unlock(c: &mut RawClient, key: &str, token: i64) -> String {
    call(c, &["LOCKGATE", "UNLOCK", key, &token.to_string()]).await
}

async fn extend(c: &mut RawClient, key: &str, token: i64, ttl: u64) -> String {
    call(
        c,
        &[
            "LOCKGATE",
            "EXTEND",
            key,
            &token.to_string(),
            &ttl.to_string(),
        ],
    )
    .await
}

fn counter(key: &str) -> String {
    format!("lockgate:fence:{{{key}}}")
}

fn usage_error(reply: &str) -> bool {
    reply.starts_with("-ERR lockgate: usage: LOCKGATE ") && reply.ends_with("\r\n")
}

// ---------------------------------------------------------------------------
// 1. Tokens, validity, the value and lease on Redis, no-WAIT contention.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_start_above_the_clock_and_strictly_increase() {
    let redis = RedisServer::start();
    let lg = Lockgate::start_with(config(&redis.addr())).await;
    let mut r = RawClient::connect(redis.addr()).await;
    let mut a = RawClient::connect(lg.addr).await;
    let mut b = RawClient::connect(lg.addr).await;
    let ttl = 5_000u64;

    // A token is above Redis's clock in µs (so it keeps growing when the
    // counter is lost) and above the counter.
    let time = call(&mut r, &["TIME"]).await;
    let secs: i64 = time
        .split("\r\n")
        .nth(2)
        .and_then(|s| s.parse().ok())
        .expect("TIME");
    let mut last = secs * 1_000_000;
    for round in 1..=3 {
        let (token, validity) = lock(&mut a, "fk", ttl, None)
            .await
            .expect("free lock acquired");
        assert!(token > last, "round {round}: token {token} after {last}");
        assert!(
            token < last + 60_000_000,
            "round {round}: token {token} a minute past {last}"
        );
        last = token;
        assert!(
            validity <= ttl as i64 && validity > ttl as i64 - 100,
            "validity {validity} for ttl {ttl}"
        );
        // On Redis: the value is the token, with a lease of ≈ ttl, and the
        // counter is at the token.
        assert_eq!(get(&mut r, "fk").await, Some(token.to_string()));
        assert_within(
            "PTTL fk",
            pttl(&mut r, "fk").await,
            ttl as i64 - 1_000,
            ttl as i64,
        );
        assert_eq!(get(&mut r, &counter("fk")).await, Some(token.to_string()));
        assert_eq!(
            pttl(&mut r, &counter("fk")).await,
            -1,
            "counter never expires"
        );

        // Held: a second LOCK without WAIT is nil at once, from either
        // connection, and changes nothing on Redis.
        for c in [&mut a, &mut b] {
            let started = Instant::now();
            assert_eq!(
                lock(c, "fk", ttl, None).await,
                None,
                "held lock given twice"
            );
            assert!(
                started.elapsed() < MARGIN,
                "a LOCK without WAIT took {:?}",
                started.elapsed()
            );
        }
        assert_eq!(get(&mut r, "fk").await, Some(token.to_string()));
        assert_eq!(get(&mut r, &counter("fk")).await, Some(token.to_string()));

        assert_eq!(unlock(&mut a, "fk", token).await, ":1\r\n");
        assert!(!exists(&mut r, "fk").await, "UNLOCK left the key on Redis");
        assert!(
            !exists(&mut r, &owner("fk")).await,
            "UNLOCK left the owner record"
        );
    }

    // Another key has its own counter.
    let other = acquire(&mut b, "fk2", 2_000).await;
    assert!(
        other > last,
        "fk2's token {other} after fk's {last}: the clock"
    );
    assert_eq!(get(&mut r, &counter("fk2")).await, Some(other.to_string()));
    assert_eq!(get(&mut r, &counter("fk")).await, Some(last.to_string()));
}

// ---------------------------------------------------------------------------
// 2. WAIT.

/// B's `LOCK … WAIT` is known to be in flight once lockgate counted a
/// contended attempt after B sent it: its first try already found the lock
/// held, so it is inside the retry loop. (INFO commandstats' EVAL count would
/// say only that some script ran — A's own calls and the denial look alike —
/// while `lock_contended` moves only on a refused attempt, and nothing else
/// contends here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_acquires_once_the_holder_unlocks() {
    let redis = RedisServer::start();
    let lg = Lockgate::start_with(config(&redis.addr())).await;
    let mut r = RawClient::connect(redis.addr()).await;
    let mut a = RawClient::connect(lg.addr).await;
    let mut b = RawClient::connect(lg.addr).await;

    let ta = acquire(&mut a, "wk", 10_000).await;
    let contended = m(&lg.ctx.locks.metrics.contended);
    let started = Instant::now();
    b.send(&cmd(&["LOCKGATE", "LOCK", "wk", "5000", "WAIT", "2000"]))
        .await;
    support::eventually("B's LOCK to be refused once and waiting", || {
        m(&lg.ctx.locks.metrics.contended) > contended
    })
    .await;
    // Still held by A, and B has no answer yet.
    assert_eq!(get(&mut r, "wk").await, Some(ta.to_string()));
    assert_eq!(
        b.try_read_raw(Duration::from_millis(50))
            .await
            .map(|x| text(&x)),
        None,
        "B answered while A still held the lock"
    );

    assert_eq!(unlock(&mut a, "wk", ta).await, ":1\r\n");
    let reply = text(&b.read_raw().await);
    let elapsed = started.elapsed();
    let (tb, validity) = lock_reply(&reply).expect("B acquires once A unlocked, within WAIT");
    assert!(tb > ta, "B's token {tb} not above A's {ta}");
    assert!(
        elapsed < Duration::from_millis(2_000),
        "B answered after {elapsed:?}, beyond its WAIT"
    );
    assert!(validity <= 5_000 && validity > 4_000, "validity {validity}");
    assert_eq!(get(&mut r, "wk").await, Some(tb.to_string()));
    assert_within("PTTL wk", pttl(&mut r, "wk").await, 4_000, 5_000);
    // A's old token releases nothing now.
    assert_eq!(unlock(&mut a, "wk", ta).await, ":0\r\n");
    assert_eq!(get(&mut r, "wk").await, Some(tb.to_string()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_acquires_when_the_holders_lease_runs_out() {
    let redis = RedisServer::start();
    let lg = Lockgate::start_with(config(&redis.addr())).await;
    let mut r = RawClient::connect(redis.addr()).await;
    let mut a = RawClient::connect(lg.addr).await;
    let mut b = RawClient::connect(lg.addr).await;

    let ta = acquire(&mut a, "lk", 300).await;
    let started = Instant::now();
    let (tb, _) = lock(&mut b, "lk", 5_000, Some(3_000))
        .await
        .expect("B acquires once A's 300 ms lease ran out");
    let elapsed = started.elapsed();
    assert!(tb > ta, "B's token {tb} not above A's {ta}");
    assert!(elapsed < Duration::from_millis(3_000), "{elapsed:?}");
    assert_eq!(get(&mut r, "lk").await, Some(tb.to_string()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_without_release_ends_in_nil_after_the_wait() {
    let redis = RedisServer::start();
    let lg = Lockgate::start_with(config(&redis.addr())).await;
    let mut r = RawClient::connect(redis.addr()).await;
    let mut a = RawClient::connect(lg.addr).await;
    let mut b = RawClient::connect(lg.addr).await;

    let ta = acquire(&mut a, "nk", 10_000).await;
    for wait in [300u64, 800] {
        let started = Instant::now();
        let reply = lock(&mut b, "nk", 5_000, Some(wait)).await;
        let elapsed = started.elapsed();
        assert_eq!(reply, None, "lock given while held");
        assert!(
            elapsed >= Duration::from_millis(wait - 10),
            "WAIT {wait} gave up after {elapsed:?}"
        );
        assert!(
            elapsed < Duration::from_millis(wait) + MARGIN,
            "WAIT {wait} answered after {elapsed:?}"
        );
    }
    // A's lock untouched, and the refused attempts took no token.
    assert_eq!(get(&mut r, "nk").await, Some(ta.to_string()));
    assert_eq!(get(&mut r, &counter("nk")).await, Some(ta.to_string()));
    assert!(pttl(&mut r, "nk").await > 8_000);
}

// ---------------------------------------------------------------------------
// 3. Pipeline order with deferred replies.

/// Sends `SET a 1`, a `LOCK … WAIT 300` on a held key, `GET a`, `PING` in
/// one write and checks the replies come in exactly that order, with the
/// nil (`nil`) in its place, and that the later replies were held back.
async fn deferred_nil_in_order(c: &mut RawClient, nil: &str) {
    let mut batch = cmd(&["SET", "a", "1"]);
    batch.extend(cmd(&["LOCKGATE", "LOCK", "ok", "1000", "WAIT", "300"]));
    batch.extend(cmd(&["GET", "a"]));
    batch.extend(cmd(&["PING"]));
    let started = Instant::now();
    c.send(&batch).await;
    let mut replies = Vec::new();
    for _ in 0..4 {
        replies.push(text(&c.read_raw().await));
    }
    let elapsed = started.elapsed();
    assert_eq!(replies, ["+OK\r\n", nil, "$1\r\n1\r\n", "+PONG\r\n"]);
    // GET's reply came only after the deferred nil, ≈ 300 ms later.
    assert!(
        elapsed >= Duration::from_millis(290),
        "replies after {elapsed:?}: the nil was not deferred"
    );
    assert!(elapsed < Duration::from_millis(300) + MARGIN, "{elapsed:?}");
    assert_eq!(
        c.try_read_raw(Duration::from_millis(100))
            .await
            .map(|x| text(&x)),
        None,
        "an extra reply"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deferred_nil_keeps_pipeline_order_resp2() {
    let redis = RedisServer::start();
    let lg = Lockgate::start_with(config(&redis.addr())).await;
    let mut r = RawClient::connect(redis.addr()).await;
    let mut holder = RawClient::connect(lg.addr).await;
    let mut c = RawClient::connect(lg.addr).await;
    let t = acquire(&mut holder, "ok", 10_000).await;

    deferred_nil_in_order(&mut c, "$-1\r\n").await;
    assert_eq!(get(&mut r, "a").await.as_deref(), Some("1"));
    assert_eq!(get(&mut r, "ok").await, Some(t.to_string()));
    // The connection carries on normally.
    assert_eq!(call(&mut c, &["PING"]).await, "+PONG\r\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deferred_nil_keeps_pipeline_order_resp3() {
    let redis = RedisServer::start();
    let lg = Lockgate::start_with(config(&redis.addr())).await;
    let mut r = RawClient::connect(redis.addr()).await;
    let mut holder = RawClient::connect(lg.addr).await;
    let mut c = RawClient::connect(lg.addr).await;
    let t = acquire(&mut holder, "ok", 10_000).await;

    let hello = c.call_raw(&["HELLO", "3"]).await;
    assert!(hello.starts_with(b"%"), "HELLO 3: {}", text(&hello));
    deferred_nil_in_order(&mut c, "_\r\n").await;
    assert_eq!(get(&mut r, "ok").await, Some(t.to_string()));

    // In RESP3 a granted lock is still `*2 :token :validity`.
    let reply = call(&mut c, &["LOCKGATE", "LOCK", "ok3", "2000"]).await;
    assert!(reply.starts_with("*2\r\n:"), "{reply:?}");
    let (t3, _) = lock_reply(&reply).expect("free lock");
    assert_eq!(get(&mut r, "ok3").await, Some(t3.to_string()));
    // A nil without WAIT is `_` too.
    assert_eq!(
        call(&mut c, &["LOCKGATE", "LOCK", "ok3", "2000"]).await,
        "_\r\n"
    );
}

/// The shape of each reply, for order checks that print short.
fn shapes(replies: &[String]) -> Vec<&'static str> {
    replies
        .iter()
        .map(|x| match x.as_bytes()[0] {
            b'$' if x == "$-1\r\n" => "nil",
            b'$' => "bulk",
            b'-' if usage_error(x) => "usage error",
            b'-' => "error",
            b'*' => "array",
            b'+' => "simple",
            _ => "other",
        })
        .collect()
}

/// Sends `batch` in one write and reads `n` replies.
async fn exchange(c: &mut RawClient, batch: &[u8], n: usize) -> Vec<String> {
    c.send(batch).await;
    let mut replies = Vec::new();
    for _ in 0..n {
        replies.push(text(&c.read_raw().await));
    }
    replies
}

/// A reply lockgate makes at once (a usage error, `LOCKGATE STATS`) right
/// after a deferred one keeps its place too. Two cases, one write each:
/// (a) `LOCK … WAIT 300` on a held key, a usage error, `GET a`,
/// `LOCKGATE STATS`, `PING` — the deferred reply is still being worked out
/// when the usage error is due; (b) `SET a 1`, a `LOCK` granted at once, a
/// usage error, `GET a` — the deferred reply is ready while GET's reply
/// already waits behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_reply_after_a_deferred_one_keeps_its_place() {
    let redis = RedisServer::start();
    let lg = Lockgate::start_with(config(&redis.addr())).await;
    let mut r = RawClient::connect(redis.addr()).await;
    let mut holder = RawClient::connect(lg.addr).await;
    acquire(&mut holder, "ok", 10_000).await;
    assert_eq!(call(&mut r, &["SET", "a", "1"]).await, "+OK\r\n");

    let mut c = RawClient::connect(lg.addr).await;
    let mut batch = cmd(&["LOCKGATE", "LOCK", "ok", "1000", "WAIT", "300"]);
    batch.extend(cmd(&["LOCKGATE", "UNLOCK", "ok"]));
    batch.extend(cmd(&["GET", "a"]));
    batch.extend(cmd(&["LOCKGATE", "STATS"]));
    batch.extend(cmd(&["PING"]));
    let waiting = exchange(&mut c, &batch, 5).await;

    let mut c = RawClient::connect(lg.addr).await;
    let mut batch = cmd(&["SET", "a", "1"]);
    batch.extend(cmd(&["LOCKGATE", "LOCK", "free", "1000"]));
    batch.extend(cmd(&["LOCKGATE", "EXTEND", "free", "1"]));
    batch.extend(cmd(&["GET", "a"]));
    let ready = exchange(&mut c, &batch, 4).await;

    assert_eq!(
        (shapes(&waiting), shapes(&ready)),
        (
            vec!["nil", "usage error", "bulk", "array", "simple"],
            vec!["simple", "array", "usage error", "bulk"]
        ),
        "replies out of order: (a) {waiting:?} (b) {ready:?}"
    );
    assert_eq!(waiting[2], "$1\r\n1\r\n");
    assert_eq!(waiting[4], "+PONG\r\n");
    assert_eq!(ready[3], "$1\r\n1\r\n");
}

const PAIRS: usize = 200;

/// A counter far above any clock in µs (year 2223), so the next token is
/// known before the lock is taken: [`NEXT_TOKEN`].
const HIGH_COUNTER: i64 = 8_000_000_000_000_000;
const NEXT_TOKEN: i64 = HIGH_COUNTER + 1;

/// One write: for each i, `LOCKGATE LOCK p{i} 5000`, `GET g{i}`,
/// `LOCKGATE UNLOCK p{i} NEXT_TOKEN`, `GET g{i}` (each key's counter set to
/// [`HIGH_COUNTER`] first). Returns the replies, checked for order: every
/// GET answers its own key between the right lock replies.
async fn pipelined_pairs(c: &mut RawClient, r: &mut RawClient) -> Vec<String> {
    for i in 0..PAIRS {
        assert_eq!(
            call(r, &["SET", &format!("g{i}"), &format!("v{i}")]).await,
            "+OK\r\n"
        );
        let high = HIGH_COUNTER.to_string();
        let set = call(r, &["SET", &counter(&format!("p{i}")), &high]).await;
        assert_eq!(set, "+OK\r\n");
    }
    let next = NEXT_TOKEN.to_string();
    let mut batch = Vec::new();
    for i in 0..PAIRS {
        let (p, g) = (format!("p{i}"), format!("g{i}"));
        batch.extend(cmd(&["LOCKGATE", "LOCK", &p, "5000"]));
        batch.extend(cmd(&["GET", &g]));
        batch.extend(cmd(&["LOCKGATE", "UNLOCK", &p, &next]));
        batch.extend(cmd(&["GET", &g]));
    }
    c.send(&batch).await;
    let mut unlocks = Vec::new();
    for i in 0..PAIRS {
        let value = format!("${}\r\nv{i}\r\n", format!("v{i}").len());
        let l = text(&c.read_raw().await);
        let (token, validity) =
            lock_reply(&l).unwrap_or_else(|| panic!("pair {i}: LOCK p{i} on a fresh key was nil"));
        assert_eq!(
            token, NEXT_TOKEN,
            "pair {i}: the token after p{i}'s counter"
        );
        assert!(
            validity > 0 && validity <= 5_000,
            "pair {i}: validity {validity}"
        );
        assert_eq!(text(&c.read_raw().await), value, "pair {i}: GET after LOCK");
        let u = text(&c.read_raw().await);
        assert!(
            u == ":1\r\n" || u == ":0\r\n",
            "pair {i}: UNLOCK reply {u:?}"
        );
        unlocks.push(u);
        assert_eq!(
            text(&c.read_raw().await),
            value,
            "pair {i}: GET after UNLOCK"
        );
    }
    assert_eq!(
        c.try_read_raw(Duration::from_millis(100))
            .await
            .map(|x| text(&x)),
        None,
        "an extra reply"
    );
    assert_eq!(call(c, &["PING"]).await, "+PONG\r\n");
    unlocks
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_lock_unlock_pairs_keep_reply_order() {
    let redis = RedisServer::start();
    let lg = Lockgate::start_with(config(&redis.addr())).await;
    let mut r = RawClient::connect(redis.addr()).await;
    let mut c = RawClient::connect(lg.addr).await;
    pipelined_pairs(&mut c, &mut r).await;
    // Every LOCK really ran on Redis: each counter is at the token.
    for i in (0..PAIRS).step_by(37) {
        assert_eq!(
            get(&mut r, &counter(&format!("p{i}"))).await,
            Some(NEXT_TOKEN.to_string())
        );
    }
}

/// On Redis, pipelined commands run in the order sent; a client pipelining
/// `LOCK p 5000` then `UNLOCK p <the next token>` expects the UNLOCK to find
/// the lock and release it. Lockgate answers each on a task of its own, so
/// this checks that the tasks also reach Redis in command order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_unlock_runs_after_its_lock() {
    let redis = RedisServer::start();
    let lg = Lockgate::start_with(config(&redis.addr())).await;
    let mut r = RawClient::connect(redis.addr()).await;
    let mut c = RawClient::connect(lg.addr).await;
    let unlocks = pipelined_pairs(&mut c, &mut r).await;
    let refused: Vec<usize> = (0..PAIRS).filter(|&i| unlocks[i] != ":1\r\n").collect();
    let mut left = Vec::new();
    for i in 0..PAIRS {
        if exists(&mut r, &format!("p{i}")).await {
            left.push(i);
        }
    }
    assert!(
        refused.is_empty() && left.is_empty(),
        "pipelined UNLOCK ran before its LOCK: {} of {PAIRS} UNLOCKs answered :0 (first: {:?}), \
         {} locks still held on Redis (first: {:?})",
        refused.len(),
        &refused[..refused.len().min(8)],
        left.len(),
        &left[..left.len().min(8)]
    );
}

// ---------------------------------------------------------------------------
// 4. Stale tokens, EXTEND.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_token_releases_and_extends_nothing() {
    let redis = RedisServer::start();
    let lg = Lockgate::start_with(config(&redis.addr())).await;
    let mut r = RawClient::connect(redis.addr()).await;
    let mut a = RawClient::connect(lg.addr).await;
    let mut b = RawClient::connect(lg.addr).await;

    let t1 = acquire(&mut a, "sk", 150).await;
    until_gone(&mut r, "sk").await;
    let t2 = acquire(&mut b, "sk", 10_000).await;
    assert!(t2 > t1, "token {t2} after {t1}");

    // A's old token: UNLOCK and EXTEND refused, B's lock as it was.
    assert_eq!(unlock(&mut a, "sk", t1).await, ":0\r\n");
    assert_eq!(get(&mut r, "sk").await, Some(t2.to_string()));
    let before = pttl(&mut r, "sk").await;
    assert!(before > 8_000, "PTTL {before}");
    assert_eq!(extend(&mut a, "sk", t1, 60_000).await, ":0\r\n");
    let after = pttl(&mut r, "sk").await;
    assert!(
        after <= before,
        "stale EXTEND moved PTTL {before} → {after}"
    );
    assert_eq!(get(&mut r, "sk").await, Some(t2.to_string()));
    // A token never issued, too.
    assert_eq!(unlock(&mut a, "sk", t2 + 1).await, ":0\r\n");
    assert_eq!(get(&mut r, "sk").await, Some(t2.to_string()));

    // B's own token releases it.
    assert_eq!(unlock(&mut b, "sk", t2).await, ":1\r\n");
    assert!(!exists(&mut r, "sk").await);
    assert_eq!(unlock(&mut b, "sk", t2).await, ":0\r\n", "released twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extend_with_the_current_token_renews_the_lease() {
    let redis = RedisServer::start();
    let lg = Lockgate::start_with(config(&redis.addr())).await;
    let mut r = RawClient::connect(redis.addr()).await;
    let mut a = RawClient::connect(lg.addr).await;

    let t = acquire(&mut a, "ek", 2_000).await;
    assert!(pttl(&mut r, "ek").await <= 2_000);
    assert_eq!(extend(&mut a, "ek", t, 20_000).await, ":1\r\n");
    assert_within("PTTL ek", pttl(&mut r, "ek").await, 19_000, 20_000);
    assert_eq!(
        get(&mut r, "ek").await,
        Some(t.to_string()),
        "EXTEND kept the token"
    );
    // Shorter works too: EXTEND sets the lease.
    assert_eq!(extend(&mut a, "ek", t, 3_000).await, ":1\r\n");
    assert_within("PTTL ek", pttl(&mut r, "ek").await, 2_000, 3_000);
    // Still held by t: nobody else gets it.
    assert_eq!(lock(&mut a, "ek", 1_000, None).await, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extend_after_expiry_does_not_resurrect() {
    let redis = RedisServer::start();
    let lg = Lockgate::start_with(config(&redis.addr())).await;
    let mut r = RawClient::connect(redis.addr()).await;
    let mut a = RawClient::connect(lg.addr).await;

    let t = acquire(&mut a, "xk", 150).await;
    until_gone(&mut r, "xk").await;
    assert_eq!(extend(&mut a, "xk", t, 20_000).await, ":0\r\n");
    assert!(
        !exists(&mut r, "xk").await,
        "EXTEND brought an expired lock back"
    );
    assert_eq!(get(&mut r, "xk").await, None);
    assert!(
        !exists(&mut r, &owner("xk")).await,
        "owner record came back"
    );
    // The lock is free for the next holder, with a larger token.
    assert!(acquire(&mut a, "xk", 1_000).await > t);
}

// ---------------------------------------------------------------------------
// 5. Across lockgate restarts.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_increasing_across_lockgate_restarts() {
    let redis = RedisServer::start();
    let mut r = RawClient::connect(redis.addr()).await;
    let mut last = 0;
    for round in 0..3 {
        let lg = Lockgate::start_with(config(&redis.addr())).await;
        let mut c = RawClient::connect(lg.addr).await;
        for _ in 0..2 {
            let t = acquire(&mut c, "rk", 5_000).await;
            assert!(t > last, "round {round}: token {t} after {last}");
            assert_eq!(get(&mut r, "rk").await, Some(t.to_string()));
            assert_eq!(unlock(&mut c, "rk", t).await, ":1\r\n");
            last = t;
        }
        drop(c);
        lg.stop().await;
    }
    assert_eq!(get(&mut r, &counter("rk")).await, Some(last.to_string()));
}

// ---------------------------------------------------------------------------
// 6. Usage errors.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_errors_leave_the_connection_usable() {
    let redis = RedisServer::start();
    let lg = Lockgate::start_with(config(&redis.addr())).await;
    let mut r = RawClient::connect(redis.addr()).await;
    let mut c = RawClient::connect(lg.addr).await;
    let bad: &[&[&str]] = &[
        &["LOCKGATE", "LOCK", "uk"],
        &["LOCKGATE", "LOCK", "uk", "abc"],
        &["LOCKGATE", "LOCK", "uk", "0"],
        &["LOCKGATE", "LOCK", "uk", "-5"],
        &["LOCKGATE", "LOCK", "uk", "1000", "WAIT"],
        &["LOCKGATE", "LOCK", "uk", "1000", "WAIT", "x"],
        // Not an option, and no lease after it (with one, it would name
        // three keys: `LOCK k1 k2 k3 ttl`).
        &["LOCKGATE", "LOCK", "uk", "1000", "NOWAIT"],
        &["LOCKGATE", "LOCK", "uk", "1000", "SHARED", "SHARED"],
        &["LOCKGATE", "LOCK", "uk", "uk2", "1000", "OWNER", "o"],
        &["LOCKGATE", "ACQUIRE", "uk", "0", "1000"],
        &["LOCKGATE", "UNLOCK", "uk"],
        &["LOCKGATE", "UNLOCK", "uk", "1", "2"],
        &["LOCKGATE", "EXTEND", "uk", "1"],
        &["LOCKGATE", "EXTEND", "uk", "1", "abc"],
        &["LOCKGATE", "EXTEND", "uk", "1", "0"],
    ];
    for args in bad {
        let reply = call(&mut c, args).await;
        assert!(usage_error(&reply), "{args:?}: {reply:?}");
        assert_eq!(call(&mut c, &["PING"]).await, "+PONG\r\n", "after {args:?}");
    }
    // Pipelined between ordinary commands, they keep their place.
    let mut batch = cmd(&["SET", "u", "1"]);
    batch.extend(cmd(&["LOCKGATE", "LOCK", "uk"]));
    batch.extend(cmd(&["LOCKGATE", "EXTEND", "uk", "1"]));
    batch.extend(cmd(&["GET", "u"]));
    batch.extend(cmd(&["LOCKGATE", "LOCK", "uk", "1000"]));
    c.send(&batch).await;
    let mut replies = Vec::new();
    for _ in 0..5 {
        replies.push(text(&c.read_raw().await));
    }
    assert_eq!(replies[0], "+OK\r\n", "{replies:?}");
    assert!(usage_error(&replies[1]), "{replies:?}");
    assert!(usage_error(&replies[2]), "{replies:?}");
    assert_eq!(replies[3], "$1\r\n1\r\n", "{replies:?}");
    let token = lock_reply(&replies[4]).map(|x| x.0.to_string());
    assert!(token.is_some(), "{replies:?}");
    // The bad commands touched nothing: only the good LOCK made a counter.
    assert_eq!(get(&mut r, &counter("uk")).await, token);
    assert_eq!(get(&mut r, "uk").await, token);
}

// ---------------------------------------------------------------------------
// 7. The primary down or hung.

/// An `-ERR lockgate: …` error line.
fn lockgate_error(reply: &str) -> bool {
    reply.starts_with("-ERR lockgate: ") && reply.ends_with("\r\n")
}

/// Sends `LOCKGATE LOCK key 1000` on fresh connections until one is granted
/// (every other answer must be a lockgate error), bounded by `WAIT`.
async fn until_lock_works(lg: &Lockgate, key: &str) -> i64 {
    let deadline = Instant::now() + WAIT;
    let mut c = RawClient::connect(lg.addr).await;
    loop {
        c.send(&cmd(&["LOCKGATE", "LOCK", key, "1000"])).await;
        match c.try_read_raw(MARGIN * 3).await.map(|x| text(&x)) {
            Some(reply) if reply.starts_with('*') => {
                return lock_reply(&reply).expect("granted").0;
            }
            Some(reply) => assert!(lockgate_error(&reply), "while recovering: {reply:?}"),
            // The session ended (its upstream went away): start another.
            None => c = RawClient::connect(lg.addr).await,
        }
        assert!(
            Instant::now() < deadline,
            "LOCKGATE LOCK never worked again"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn primary_down_answers_an_error_then_recovers() {
    let mut redis = RedisServer::start();
    let mut config = config(&redis.addr());
    // No hold after the restart (tests/it/upstream_safety.rs has it):
    // tokens across it are this test's.
    config.locks.failover_delay_ms = Some(0);
    let lg = Lockgate::start_with(config).await;
    let mut c = RawClient::connect(lg.addr).await;
    let before = acquire(&mut c, "dk", 1_000).await;
    drop(c);

    redis.stop();
    for key in ["dk", "dk2"] {
        let mut c = RawClient::connect(lg.addr).await;
        let started = Instant::now();
        c.send(&cmd(&["LOCKGATE", "LOCK", key, "1000"])).await;
        let reply = c
            .try_read_raw(Duration::from_millis(1_000) + MARGIN)
            .await
            .map(|x| text(&x));
        let elapsed = started.elapsed();
        let reply = reply.unwrap_or_else(|| {
            panic!("no answer to LOCKGATE LOCK {key} within {elapsed:?} with Redis down")
        });
        assert!(lockgate_error(&reply), "{reply:?}");
        // Also WAIT does not turn into a hang.
        let started = Instant::now();
        c.send(&cmd(&["LOCKGATE", "LOCK", key, "1000", "WAIT", "500"]))
            .await;
        let reply = c
            .try_read_raw(Duration::from_millis(1_500) + MARGIN)
            .await
            .map(|x| text(&x))
            .unwrap_or_else(|| panic!("no answer to LOCK … WAIT after {:?}", started.elapsed()));
        assert!(lockgate_error(&reply), "{reply:?}");
    }

    redis.restart();
    // Redis restarted empty: its counters are gone, and a token is still
    // above every earlier one (Redis's clock moved on).
    let t = until_lock_works(&lg, "dk").await;
    assert!(t > before, "token {t} after a restart, {before} before");
    let mut r = RawClient::connect(redis.addr()).await;
    assert_eq!(get(&mut r, "dk").await, Some(t.to_string()));
}

/// A primary that accepts connections but does not answer (stopped with
/// SIGSTOP): the LOCK's call times out after `connect_timeout_ms` and the
/// client gets an error, not a hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_primary_answers_an_error_in_bounded_time() {
    let redis = RedisServer::start();
    let lg = Lockgate::start_with(config(&redis.addr())).await;
    let mut c = RawClient::connect(lg.addr).await;
    let before = acquire(&mut c, "hk0", 1_000).await;
    let pid = redis.pid();

    signal(pid, "-STOP");
    support::eventually("redis-server stopped", || proc_state(pid) == 'T').await;
    let started = Instant::now();
    c.send(&cmd(&["LOCKGATE", "LOCK", "hk", "1000"])).await;
    let reply = c.try_read_raw(Duration::from_millis(1_000) + MARGIN).await;
    let elapsed = started.elapsed();
    signal(pid, "-CONT");
    let reply = reply
        .map(|x| text(&x))
        .unwrap_or_else(|| panic!("no answer within {elapsed:?} from a hung primary"));
    assert!(lockgate_error(&reply), "{reply:?}");
    assert!(
        elapsed >= Duration::from_millis(900),
        "timed out after {elapsed:?}, before connect_timeout_ms"
    );

    // Works again once Redis answers.
    let t = until_lock_works(&lg, "hk2").await;
    assert!(t > before, "token {t}, {before} before");
    let mut r = RawClient::connect(redis.addr()).await;
    assert_eq!(get(&mut r, "hk2").await, Some(t.to_string()));
}
