//! Counters of the proxy room, and `counters!`, the one way a room
//! declares counters. Plain atomics, cheap enough for the hot path; read by
//! `/metrics` and `LOCKGATE STATS` through the same table. Every limit hit
//! and every error is counted here.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::ErrorSource;

/// What a [`Counter`] is to Prometheus.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up; exported with a `_total` suffix.
    Counter,
    /// Goes up and down (connections open now).
    Gauge,
    /// A time, kept as ms since the Unix epoch (`LOCKGATE STATS` shows
    /// that); exported as a gauge in seconds, Prometheus's base unit
    /// (a `_timestamp_seconds` name).
    TimestampMs,
}

/// One counter as `/metrics` and `LOCKGATE STATS` both show it: the one
/// row both read, so neither can miss a counter the other has.
#[derive(Debug, Clone, Copy)]
pub struct Counter<'a> {
    /// The Prometheus name after the `lockgate_` prefix (counters get
    /// `_total` appended by the encoder).
    pub name: &'static str,
    /// The name in `LOCKGATE STATS` (the Prometheus name unless an older
    /// STATS name is kept).
    pub stats_name: &'static str,
    /// The Prometheus help text.
    pub help: &'static str,
    /// Counter or gauge.
    pub kind: Kind,
    /// The live value.
    pub value: &'a AtomicU64,
}

/// Defines a set of counters in one place: the struct of atomics the hot
/// path increments, and `counters()`, the table `/metrics` and `LOCKGATE
/// STATS` walk. A counter declared here is exported and shown; there is no
/// other list to forget. Fields that are not plain counters (histograms,
/// per-command arrays) go in the `other` block with their initial value.
///
/// Each counter line reads `field: Kind "prometheus_name", "help";`, with
/// `as "stats_name"` after the Prometheus name where STATS keeps an older
/// name.
macro_rules! counters {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $(
                $(#[$fmeta:meta])*
                $field:ident: $kind:ident $metric:literal $(as $stats:literal)?, $help:literal;
            )*
        }
        $(
            other {
                $(
                    $(#[$ometa:meta])*
                    $ofield:ident: $oty:ty = $oinit:expr;
                )*
            }
        )?
    ) => {
        $(#[$meta])*
        #[derive(Debug)]
        $vis struct $name {
            $(
                $(#[$fmeta])*
                pub $field: ::std::sync::atomic::AtomicU64,
            )*
            $($(
                $(#[$ometa])*
                pub $ofield: $oty,
            )*)?
        }

        impl Default for $name {
            fn default() -> Self {
                $name {
                    $($field: ::std::sync::atomic::AtomicU64::new(0),)*
                    $($($ofield: $oinit,)*)?
                }
            }
        }

        impl $name {
            /// Every counter of this set, as `/metrics` exports it and
            /// `LOCKGATE STATS` shows it.
            pub fn counters(&self) -> Vec<$crate::metrics::Counter<'_>> {
                vec![$(
                    $crate::metrics::Counter {
                        name: $metric,
                        stats_name: $crate::metrics::counters!(@stats $metric $(, $stats)?),
                        help: $help,
                        kind: $crate::metrics::Kind::$kind,
                        value: &self.$field,
                    },
                )*]
            }
        }
    };
    (@stats $metric:literal) => { $metric };
    (@stats $metric:literal, $stats:literal) => { $stats };
}
pub(crate) use counters;

counters! {
    /// Counters for client connections and pass-through traffic.
    pub struct ProxyMetrics {
        /// Client connections open now.
        connections_active: Gauge "connections_active", "Client connections open now";
        /// Client connections accepted.
        connections_total: Counter "connections" as "connections_total",
            "Client connections accepted";
        /// Connections refused because `proxy.max_clients` was reached.
        connections_rejected: Counter "connections_rejected", "Connections refused at max_clients";
        /// Accepts that waited because `upstream.max_connecting` sessions'
        /// upstream connections had not answered yet.
        connections_held_back: Counter "connections_held_back",
            "Accepts that waited for upstream.max_connecting";
        /// Requests read from clients (multibulk and inline). Per command:
        /// the `commands` family.
        commands_total: Counter "requests" as "commands_total",
            "Requests read from clients (per command: lockgate_commands_total)";
        /// Bytes read from clients.
        client_bytes_in: Counter "client_bytes_in", "Bytes read from clients";
        /// Bytes written to clients.
        client_bytes_out: Counter "client_bytes_out", "Bytes written to clients";
        /// Malformed or oversize client requests (answered `-ERR Protocol error`).
        protocol_errors: Counter "protocol_errors", "Malformed or oversize client requests";
        /// Failed connection attempts to the primary.
        upstream_connect_errors: Counter "upstream_connect_errors",
            "Failed connections to the primary";
        /// Commands answered `-ERR lockgate: upstream … unavailable`.
        upstream_unavailable_replies: Counter "upstream_unavailable_replies",
            "Commands answered upstream-unavailable";
        /// Upstream connections lost while replies were owed.
        upstream_dropped: Counter "upstream_dropped",
            "Upstream connections lost with replies owed";
        /// Sessions ended because their own connection to the primary sent
        /// nothing for `upstream.lock_reply_timeout_ms` while a lock
        /// command's reply was owed.
        lock_reply_timeouts: Counter "upstream_lock_reply_timeouts",
            "Sessions ended because the primary sent nothing for upstream.lock_reply_timeout_ms while a lock command's reply was owed";
        /// Malformed replies from the primary.
        upstream_bad_replies: Counter "upstream_bad_replies", "Malformed replies from the primary";
        /// Replies from the primary that matched no pending command.
        unexpected_replies: Counter "unexpected_replies",
            "Replies from the primary that matched no pending command";
        /// Sessions that switched to uncounted (raw) replies: MONITOR, replication.
        raw_sessions: Counter "raw_sessions",
            "Sessions that entered uncounted replies (MONITOR, replication)";
        /// Sessions cut because owed replies did not arrive within the grace period.
        drain_timeouts: Counter "drain_timeouts",
            "Sessions cut because owed replies did not arrive within the grace period";
        /// Clients closed after `proxy.client_idle_timeout_ms` without a
        /// byte either way (neither subscribed, in MONITOR nor waiting for a reply).
        clients_closed_idle: Counter "clients_closed_idle",
            "Clients closed after proxy.client_idle_timeout_ms idle";
        /// Clients closed because a request's frame was not complete within
        /// `proxy.partial_request_timeout_ms` of its first byte (trickling).
        clients_closed_partial_request: Counter "clients_closed_partial_request",
            "Clients closed with a request not completed within proxy.partial_request_timeout_ms";
        /// Clients closed (with their upstream connections) because a write
        /// to them made no progress for `proxy.client_write_timeout_ms`.
        clients_closed_write_timeout: Counter "clients_closed_write_timeout",
            "Clients closed because a write to them stalled for proxy.client_write_timeout_ms";
        /// Clients closed (with their upstream connections) because more
        /// than `proxy.max_client_output_bytes` of replies waited for them.
        clients_closed_output_limit: Counter "clients_closed_output_limit",
            "Clients closed with more than proxy.max_client_output_bytes of replies waiting";
        /// Sessions ended at once because their client was gone with
        /// replies still owed: its connection reset (seen by a read, also
        /// after a half-close) or a write to it failed. The upstream
        /// connection closes with the session.
        clients_gone: Counter "clients_gone",
            "Sessions ended at once because the client reset or a write to it failed, with replies owed";
        /// Clients found gone before their pipeline went to Redis: their
        /// FIN was in when lockgate first read them (accepted from the
        /// listen queue after they closed), the first command went alone,
        /// and its reply's write was reset; the rest was never sent.
        clients_gone_unserved: Counter "clients_gone_unserved",
            "Clients found gone after their first command: accepted after they closed, the rest of their pipeline never sent to Redis";
        /// TLS handshakes completed on the TLS listener.
        tls_handshakes: Counter "tls_handshakes",
            "TLS handshakes completed on the TLS listener";
        /// TLS handshakes on the TLS listener that failed (not TLS, no or a
        /// bad client certificate, a protocol error, closed midway).
        tls_handshake_failures: Counter "tls_handshake_failures",
            "TLS handshakes on the TLS listener that failed";
        /// TLS handshakes not finished within `proxy.tls.handshake_timeout_ms`.
        tls_handshake_timeouts: Counter "tls_handshake_timeouts",
            "TLS handshakes not finished within proxy.tls.handshake_timeout_ms";
        /// Errors by source: client, upstream, internal.
        errors_client: Counter "errors_client", "Errors caused by clients";
        /// See `errors_client`.
        errors_upstream: Counter "errors_upstream", "Errors caused by Redis or the network to it";
        /// See `errors_client`.
        errors_internal: Counter "errors_internal", "Errors inside lockgate";
    }
    other {
        /// Commands by name, indexed like [`crate::command::LABELS`]
        /// (exported as the labelled `commands` family).
        commands: CommandCounts = CommandCounts::default();
    }
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
