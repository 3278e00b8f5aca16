//! Helpers shared by the lock-layer tests (the `locks*` tests): a config
//! builder, reading state straight from Redis, and assertions on leases.
//! Waits use the harness's `until!`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::support::{cmd, Lockgate, RawClient, RedisServer};

/// Replies as text (`\r\n` kept), so assertions compare and print them as
/// strings. Frames are read by `RawClient::read_raw`, which understands RESP2
/// nils (`$-1`, `*-1`) as well as every RESP3 type.
#[allow(async_fn_in_trait)]
pub trait Call {
    /// Reads one whole reply as text, within `WAIT`.
    async fn reply(&mut self) -> String;
    /// Sends a command and reads its reply as text.
    async fn call(&mut self, args: &[&str]) -> String;
}

impl Call for RawClient {
    async fn reply(&mut self) -> String {
        String::from_utf8(self.read_raw().await).expect("an ASCII reply")
    }

    async fn call(&mut self, args: &[&str]) -> String {
        self.send(&cmd(args)).await;
        self.reply().await
    }
}

/// A config in front of `redis` with instance id `instance` and a default
/// lease of `lease_ms`.
pub fn config(redis: &str, instance: &str, lease_ms: u64) -> lockgate::Config {
    let mut c = lockgate::Config::default();
    c.upstream.addr = redis.to_string();
    c.locks.default_lease_ms = lease_ms;
    c.locks.instance_id = instance.to_string();
    c
}

/// A fresh Redis, lockgate in front of it with [`config`]`(redis, instance,
/// lease_ms)`, and a connection straight to that Redis. Bind the server to a
/// name (`_redis` when unused), never `_`: dropping it stops Redis.
pub async fn setup(instance: &str, lease_ms: u64) -> (RedisServer, Lockgate, RawClient) {
    setup_with(instance, lease_ms, |_| {}).await
}

/// [`setup`] with the config changed by `adjust` before lockgate starts.
pub async fn setup_with(
    instance: &str,
    lease_ms: u64,
    adjust: impl FnOnce(&mut lockgate::Config),
) -> (RedisServer, Lockgate, RawClient) {
    let redis = RedisServer::start();
    let mut c = config(&redis.addr(), instance, lease_ms);
    adjust(&mut c);
    let lg = Lockgate::start_with(c).await;
    let r = RawClient::connect(redis.addr()).await;
    (redis, lg, r)
}

/// The owner record of lock key `key`.
pub fn owner(key: &str) -> String {
    format!("lockgate:owner:{{{key}}}")
}

/// Reads a counter.
pub fn m(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

/// Now, Unix seconds.
pub fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// Now, Unix milliseconds.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

use crate::support::int;

/// Sends `args` and returns its integer reply.
pub async fn int_of(c: &mut RawClient, args: &[&str]) -> i64 {
    int(&c.call(args).await)
}

/// `PTTL key` (-2 missing, -1 no TTL).
pub async fn pttl(c: &mut RawClient, key: &str) -> i64 {
    int_of(c, &["PTTL", key]).await
}

/// `EXISTS key` as a bool.
pub async fn exists(c: &mut RawClient, key: &str) -> bool {
    int_of(c, &["EXISTS", key]).await == 1
}

/// `GET key` as a string (None for nil).
pub async fn get(c: &mut RawClient, key: &str) -> Option<String> {
    let text = c.call(&["GET", key]).await;
    if text == "$-1\r\n" || text == "_\r\n" {
        return None;
    }
    let body = text
        .strip_prefix('$')
        .and_then(|t| t.split_once("\r\n"))
        .map(|(_, rest)| rest)
        .and_then(|rest| rest.strip_suffix("\r\n"))
        .unwrap_or_else(|| panic!("expected a bulk reply, got {text:?}"));
    Some(body.to_string())
}

/// The owner token stored for lock key `key` (None when no record).
pub async fn owner_of(c: &mut RawClient, key: &str) -> Option<String> {
    get(c, &owner(key)).await
}

/// A `$len\r\nvalue\r\n` bulk reply.
pub fn bulk(value: &str) -> String {
    format!("${}\r\n{value}\r\n", value.len())
}

/// Asserts `lo < value <= hi`.
pub fn assert_within(what: &str, value: i64, lo: i64, hi: i64) {
    assert!(
        value > lo && value <= hi,
        "{what}: {value} not in ({lo}, {hi}]"
    );
}

/// Scheduling slack allowed below a lower TTL bound (shared, loaded CI).
pub const SLACK_MS: i64 = 2_000;

/// Asserts the lock `key` and its owner record both have a PTTL in
/// `(lo - SLACK_MS, hi]` on Redis.
pub async fn assert_lease(r: &mut RawClient, key: &str, lo: i64, hi: i64) {
    let lo = lo - SLACK_MS;
    let lock = pttl(r, key).await;
    let rec = pttl(r, &owner(key)).await;
    assert_within(&format!("PTTL {key}"), lock, lo, hi);
    assert_within(&format!("PTTL {}", owner(key)), rec, lo, hi);
}

/// Waits until `key` is gone from Redis (its lease ran out), within `WAIT`.
pub async fn until_gone(r: &mut RawClient, key: &str) {
    crate::until!(format!("{key} to expire"), !exists(r, key).await);
}

/// The compare-and-delete release of `SET k uuid NX PX` lock libraries.
pub const COMPARE_AND_DELETE: &str =
    "if redis.call('get',KEYS[1]) == ARGV[1] then return redis.call('del',KEYS[1]) else return 0 end";

/// `FAIRNESS_SECS` (else `default`): how long the fairness workloads run.
pub fn fairness_secs(default: u64) -> u64 {
    std::env::var("FAIRNESS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// A `LOCKGATE LOCK` reply: `*2 :token :validity` → the token; nil →
/// `None`; anything else fails the test.
pub fn fence_token(reply: &str) -> Option<String> {
    if reply == "$-1\r\n" || reply == "_\r\n" {
        return None;
    }
    let mut lines = reply.split("\r\n");
    assert_eq!(lines.next(), Some("*2"), "a LOCKGATE LOCK reply: {reply:?}");
    let t = lines.next().and_then(|l| l.strip_prefix(':'));
    Some(
        t.unwrap_or_else(|| panic!("a token in {reply:?}"))
            .to_string(),
    )
}
