//! The tests' one harness: real `redis-server` processes on free loopback
//! ports, lockgate itself in-process on port 0, the raw RESP client, and
//! the helpers of each test area. Everything started here is stopped by
//! PID when its handle drops. No mocks of Redis.
//!
//! Both test binaries (`tests/it/`, `tests/serial/`) say `mod support;`
//! in their `main.rs`; each test module uses what it needs:
//!
//! - [`redis`]: [`RedisServer`], [`free_port`], [`until_uptime`],
//!   [`redis::command_calls`] (`INFO commandstats`).
//! - [`proxy`]: [`Lockgate`], lockgate (the proxy under test) in the test's process.
//! - [`resp`]: [`RawClient`], [`cmd`], [`encode`], [`frame_len`] (the one
//!   RESP frame scanner), [`show`].
//! - [`binary`]: the lockgate binary as a child process ([`binary::start`]),
//!   with its output collected ([`binary::Captured`]), and a blocking
//!   line-reading connection ([`binary::Conn`]).
//! - [`process`]: child processes with bounded run times, signals,
//!   [`process::Paused`] (a SIGSTOPped process, resumed on drop).
//! - [`rng`]: the one seeded generator.
//! - [`locks`]: lock-key helpers (owner records, leases, counters).
//! - [`quorum`]: [`quorum::Cluster`], lockgate over several lock masters.
//! - [`passthrough`]: pipelines and frame splitting for byte-for-byte checks.
//! - [`resilience`]: CLIENT LIST, blocked clients, a black-hole upstream.
//! - [`relay`]: a fault-injecting TCP relay (pass, blackhole, delay, cut,
//!   half-close) to partition real processes.
//! - [`history`]: what fault tests record (sections, releases, attempts,
//!   faults, the heal) and the one checker that judges it;
//!   [`recorder`]: a client that records its lock commands for it.
//! - [`abusive`]: for the abusive-client tests: named upstream connections,
//!   Redis's output buffers and client count, this process's memory and
//!   descriptors.
//! - [`ops`]: the operators' side: HTTP, /metrics parsing, the Python
//!   Prometheus parsers.
//! - [`browser`]: headless Chromium for the status page.
//! - [`sentinel`]: a primary, a replica and three `redis-server --sentinel`.
//! - [`tls`]: certificates made with rcgen, a redis-server with only a TLS
//!   port, a TLS client.

// Each test binary uses a different part of the harness.
#![allow(dead_code)]

pub mod abusive;
pub mod binary;
pub mod browser;
pub mod cluster;
pub mod cut_cluster;
pub mod failover_load;
pub mod history;
pub mod kinds;
pub mod locks;
pub mod ops;
pub mod passthrough;
pub mod process;
pub mod proxy;
pub mod quorum;
pub mod recorder;
pub mod redis;
pub mod relay;
pub mod resilience;
pub mod resp;
pub mod rng;
pub mod sentinel;
pub mod tls;

use std::time::Duration;

// The harness's core, at `support::`; not every test binary uses all of it.
#[allow(unused_imports)]
pub use self::{
    process::{node, python, run_limited, run_limited_async, run_limited_with_input},
    proxy::Lockgate,
    redis::{free_port, until_uptime, RedisServer},
    resp::{cmd, encode, frame_len, show, RawClient},
};

/// Longest any single wait in a test may take.
pub const WAIT: Duration = Duration::from_secs(10);

/// The tests' one bounded poll: checks `$cond` every 10 ms until it holds,
/// and fails the test with "timed out waiting for {$what}" once [`WAIT`] has
/// passed. `$cond` is any `bool` expression; it may `.await` and borrow
/// locals mutably, e.g. `until!("lock:x to expire", !exists(&mut r,
/// "lock:x").await)`. `$what` is only evaluated for the failure message.
#[macro_export]
macro_rules! until {
    ($what:expr, $cond:expr $(,)?) => {{
        let deadline = std::time::Instant::now() + $crate::support::WAIT;
        while !$cond {
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for {}",
                $what
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }};
}

/// [`until!`] with a plain closure as the check.
pub async fn eventually<F: FnMut() -> bool>(what: &str, mut check: F) {
    crate::until!(what, check());
}

/// The value of an integer reply `:N\r\n` as text; anything else fails the
/// test.
pub fn int(reply: &str) -> i64 {
    reply
        .strip_prefix(':')
        .and_then(|r| r.strip_suffix("\r\n"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("not an integer reply: {reply:?}"))
}
