//! Helpers shared by the lock-layer tests (`tests/locks*.rs`): a config
//! builder, reading state straight from Redis, and a bounded async poll.

#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::support::{cmd, RawClient};

/// Polls the async condition `$cond` every 10 ms until it holds; fails the
/// test after `support::WAIT`.
#[macro_export]
macro_rules! until {
    ($what:expr, $cond:expr) => {{
        let deadline = std::time::Instant::now() + $crate::support::WAIT;
        loop {
            if $cond {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for {}",
                $what
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }};
}

/// Reading replies frame by frame with the RESP headers, so RESP2 nils
/// (`$-1`, `*-1`) are read too (`RawClient::read_raw` decodes with the RESP3
/// decoder, which takes `$-1` for a streamed string and fails).
#[allow(async_fn_in_trait)]
pub trait Call {
    /// Reads one whole reply (RESP2 or RESP3) as raw bytes, within `WAIT`.
    async fn reply_raw(&mut self) -> Vec<u8>;
    /// Reads one whole reply as text (`\r\n` kept), so failures print it.
    async fn reply(&mut self) -> String {
        String::from_utf8(self.reply_raw().await).expect("an ASCII reply")
    }
    /// Sends a command and reads its reply as text.
    async fn call(&mut self, args: &[&str]) -> String;
}

impl Call for RawClient {
    async fn reply_raw(&mut self) -> Vec<u8> {
        let mut out = Vec::new();
        let mut frames = 1usize;
        while frames > 0 {
            frames -= 1;
            let start = out.len();
            while !out.ends_with(b"\r\n") || out.len() - start < 3 {
                out.extend(self.read_exact_bytes(1).await);
            }
            let line = String::from_utf8_lossy(&out[start + 1..out.len() - 2]).into_owned();
            let n = || -> i64 {
                line.parse().unwrap_or_else(|_| {
                    panic!(
                        "bad RESP header {:?}",
                        String::from_utf8_lossy(&out[start..])
                    )
                })
            };
            match out[start] {
                b'$' | b'=' | b'!' if n() >= 0 => {
                    let body = self.read_exact_bytes(n() as usize + 2).await;
                    out.extend(body);
                }
                b'*' | b'~' | b'>' if n() > 0 => frames += n() as usize,
                b'%' if n() > 0 => frames += 2 * n() as usize,
                b'|' => frames += 2 * n() as usize + 1,
                _ => {}
            }
        }
        out
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

/// The value of an integer reply `:N\r\n` (panics on anything else).
pub fn int(text: &str) -> i64 {
    text.strip_prefix(':')
        .and_then(|t| t.strip_suffix("\r\n"))
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("expected an integer reply, got {text:?}"))
}

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
