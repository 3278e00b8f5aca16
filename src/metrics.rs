//! Counters of the proxy room. Plain atomics, cheap enough for the hot path;
//! read by the admin side. Every limit hit and every error is counted here.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::ErrorSource;

/// Counters for client connections and pass-through traffic.
#[derive(Debug, Default)]
pub struct ProxyMetrics {
    /// Client connections accepted.
    pub connections_total: AtomicU64,
    /// Client connections open now.
    pub connections_active: AtomicU64,
    /// Connections refused because `proxy.max_clients` was reached.
    pub connections_rejected: AtomicU64,
    /// Requests read from clients (multibulk and inline).
    pub commands_total: AtomicU64,
    /// Bytes read from clients.
    pub client_bytes_in: AtomicU64,
    /// Bytes written to clients.
    pub client_bytes_out: AtomicU64,
    /// Malformed or oversize client requests (answered `-ERR Protocol error`).
    pub protocol_errors: AtomicU64,
    /// Failed connection attempts to the primary.
    pub upstream_connect_errors: AtomicU64,
    /// Commands answered `-ERR lockgate: upstream … unavailable`.
    pub upstream_unavailable_replies: AtomicU64,
    /// Upstream connections lost while replies were owed.
    pub upstream_dropped: AtomicU64,
    /// Malformed replies from the primary.
    pub upstream_bad_replies: AtomicU64,
    /// Replies from the primary that matched no pending command.
    pub unexpected_replies: AtomicU64,
    /// Sessions that switched to uncounted (raw) replies: MONITOR, replication.
    pub raw_sessions: AtomicU64,
    /// Sessions cut because owed replies did not arrive within the grace period.
    pub drain_timeouts: AtomicU64,
    /// TLS handshakes completed on the TLS listener.
    pub tls_handshakes: AtomicU64,
    /// TLS handshakes on the TLS listener that failed (not TLS, no or a
    /// bad client certificate, a protocol error, closed midway).
    pub tls_handshake_failures: AtomicU64,
    /// TLS handshakes not finished within `proxy.tls.handshake_timeout_ms`.
    pub tls_handshake_timeouts: AtomicU64,
    /// Errors by source: client, upstream, internal.
    pub errors_client: AtomicU64,
    /// See `errors_client`.
    pub errors_upstream: AtomicU64,
    /// See `errors_client`.
    pub errors_internal: AtomicU64,
    /// Commands by name, indexed like [`crate::command::LABELS`].
    pub commands: CommandCounts,
}

/// One counter per [`crate::command::LABELS`] entry.
#[derive(Debug)]
pub struct CommandCounts(pub [AtomicU64; crate::command::LABELS.len()]);

impl Default for CommandCounts {
    fn default() -> Self {
        CommandCounts(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

impl std::ops::Index<usize> for CommandCounts {
    type Output = AtomicU64;
    fn index(&self, i: usize) -> &AtomicU64 {
        self.0.get(i).unwrap_or(&self.0[0])
    }
}

impl ProxyMetrics {
    /// Adds one to `counter`.
    pub fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Adds `n` to `counter`.
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Counts one error of `source`.
    pub fn error(&self, source: ErrorSource) {
        Self::inc(match source {
            ErrorSource::Client => &self.errors_client,
            ErrorSource::Upstream => &self.errors_upstream,
            ErrorSource::Internal => &self.errors_internal,
        });
    }

    /// Reads a counter.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// Lets one log line per `interval` through, so a problem that repeats on
/// every request is logged once per interval with a count of the rest.
#[derive(Debug)]
pub struct RateLimit {
    start: Instant,
    interval_ms: u64,
    next_ms: AtomicU64,
    suppressed: AtomicU64,
}

impl RateLimit {
    /// A limiter allowing one event per `interval`.
    pub fn new(interval: Duration) -> RateLimit {
        RateLimit {
            start: Instant::now(),
            interval_ms: interval.as_millis() as u64,
            next_ms: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(n)` when this event may be logged (`n` = events suppressed since
    /// the last one logged), `None` when it should be dropped.
    pub fn check(&self) -> Option<u64> {
        let now = self.start.elapsed().as_millis() as u64;
        let next = self.next_ms.load(Ordering::Relaxed);
        if now >= next
            && self
                .next_ms
                .compare_exchange(
                    next,
                    now + self.interval_ms,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_limit_lets_one_through_per_interval() {
        let r = RateLimit::new(Duration::from_secs(3600));
        assert_eq!(r.check(), Some(0));
        assert_eq!(r.check(), None);
        assert_eq!(r.check(), None);
        let r = RateLimit::new(Duration::ZERO);
        assert_eq!(r.check(), Some(0));
        assert_eq!(r.check(), Some(0));
    }
}
