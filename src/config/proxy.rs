//! `[proxy]`: the client-facing side, and the limits that keep slow and
//! abusive clients from holding lockgate's (and Redis's) resources.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{invalid, parse_addr, positive, ConfigError, ListenerTlsConfig};

/// Smallest client timeout other than 0 (off), in milliseconds: below a
/// scheduler hiccup on a loaded host a timeout would close healthy clients.
pub const MIN_CLIENT_TIMEOUT_MS: u64 = 10;

/// The client-facing side: where to listen and how many clients to serve.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ProxyConfig {
    /// Address apps connect to instead of Redis (`HOST:PORT`).
    pub listen: String,
    /// Most client connections served at once; one more is answered
    /// `-ERR max number of clients reached` and closed (Redis's `maxclients`).
    /// Bounds, among others, idle connections that never send.
    pub max_clients: usize,
    /// On SIGTERM/SIGINT: how long in-flight replies may take to drain before
    /// the remaining connections are cut, in milliseconds. Also bounds how long
    /// a session waits for replies owed to a client that has hung up.
    pub shutdown_grace_ms: u64,
    /// Bytes read from a socket at a time (one read buffer per direction per
    /// client). Larger batches fewer syscalls under pipelining.
    pub read_chunk_bytes: usize,
    /// Most read batches of one client in flight towards Redis whose replies
    /// have not come back yet; past it lockgate stops reading that client
    /// (back-pressure) instead of queueing without bound. Bounds the requests
    /// (at most this many reads of `read_chunk_bytes`) waiting at Redis for
    /// one client, not the size of their replies.
    pub max_inflight_batches: usize,
    /// A client that sends nothing and is written nothing for this long is
    /// closed silently, as Redis's `timeout` does, in milliseconds; 0: never
    /// (Redis's `timeout 0`, the default). Exempt, as on Redis: a client
    /// subscribed (pub/sub), in `MONITOR`, or waiting for a reply (a
    /// blocking command such as `BLPOP`).
    pub client_idle_timeout_ms: u64,
    /// A request whose first byte has arrived must be complete within this
    /// long, in milliseconds, or the client is answered `-ERR Protocol
    /// error: request not completed within N ms` and closed: a client that
    /// trickles a frame a byte at a time holds a connection slot and its
    /// upstream connection for no more than this. 0: no limit (as Redis).
    /// A larger request must arrive at `limits.max_request_bytes` / this
    /// rate at least: raise it for big uploads over slow links.
    pub partial_request_timeout_ms: u64,
    /// A write to a client that makes no progress for this long closes the
    /// client and its upstream connection, in milliseconds; 0: never. While
    /// a client does not read, lockgate stops reading its replies from
    /// Redis, so they pile up in Redis's output buffer (unbounded by
    /// default there); this bounds how long they may.
    pub client_write_timeout_ms: u64,
    /// Most bytes of replies lockgate holds for one client that does not
    /// read them as fast as Redis sends; past it the client and its upstream
    /// connection are closed (as Redis's `client-output-buffer-limit`
    /// hard limit). Set, lockgate keeps reading Redis while a write to the
    /// client waits, so Redis holds next to nothing for that connection.
    /// 0 (default, as Redis's `normal 0 0 0`): none; lockgate stops reading
    /// Redis instead and Redis holds the replies, for at most
    /// `client_write_timeout_ms` without progress.
    pub max_client_output_bytes: u64,
    /// How sessions reach the primary: `"dedicated"` (one upstream
    /// connection per client, as a byte copier) or `"shared"` (clients'
    /// plain commands travel over `shared_upstream_connections` shared
    /// connections; a client that needs connection state, `MULTI`, `WATCH`,
    /// a blocking command, pub/sub, `SELECT` of another database, `AUTH`,
    /// `HELLO`, `CLIENT`…, is moved to a connection of its own at that
    /// command, for good; see `crate::upstream::shared`). Also `--upstream-mode`.
    pub upstream: UpstreamMode,
    /// Shared connections to the primary with `upstream = "shared"` (1–64);
    /// each session stays on one, chosen in turn as it connects.
    pub shared_upstream_connections: usize,
    /// Most batches of commands (one per client read) waiting to be written
    /// on one shared connection; past it the sessions sending there wait
    /// (back-pressure), counted in `shared_queue_full`.
    pub shared_upstream_queue_batches: usize,
    /// Most bytes of replies from a shared connection waiting for one
    /// session (a client that does not read, or reads slowly; a reply
    /// larger than this still reaches a client that reads it). Past half
    /// of it the session sends no more commands (back-pressure); past all
    /// of it the shared connection reads no more until the client has
    /// taken half of it (Redis holds the rest, as it would for the client).
    /// In front of a cluster (either mode), past half of it the session
    /// sends no more commands until its client reads.
    pub shared_session_reply_bytes: u64,
    /// How long, in ms, a shared connection waits for a client that holds
    /// more than `shared_session_reply_bytes` of replies and takes none of
    /// them; then the client is closed, counted in
    /// `shared_session_output_limit`, and the connection reads on. The
    /// longest one client that stopped reading holds the others on its
    /// shared connection (1 to 60 000). In front of a cluster: a session
    /// past half of `shared_session_reply_bytes` whose client takes
    /// nothing for this long while sending more is closed, counted in
    /// `cluster_session_output_limit`.
    pub shared_reply_stall_ms: u64,
    /// Warm spare dedicated connections to the primary kept open with
    /// `upstream = "shared"` (0–64; 0: none): a session that moves to a
    /// connection of its own takes one at once instead of connecting
    /// then, so its command reaches Redis as soon as it would have on a
    /// connection of its own from the start (Redis's suite: a blocking
    /// command, then another client's write that must come after it). A
    /// taken spare is replaced in the background; spares are dropped when
    /// the primary changes. Counted: `shared_spare_connections`,
    /// `shared_spare_misses`.
    pub shared_spare_connections: usize,
    /// The TLS listener beside the plain one (`[proxy.tls]`).
    pub tls: ListenerTlsConfig,
}

/// How sessions reach the primary (`proxy.upstream`).
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum UpstreamMode {
    /// One upstream connection per client (the default).
    #[default]
    Dedicated,
    /// A few shared connections; a client needing connection state is
    /// moved to a dedicated one.
    Shared,
}

/// Most shared upstream connections (`proxy.shared_upstream_connections`).
pub const MAX_SHARED_UPSTREAM_CONNECTIONS: usize = 64;

/// Longest `proxy.shared_reply_stall_ms`: a minute, as long as a shared
/// connection's other clients may wait behind one that stopped reading.
pub const MAX_SHARED_REPLY_STALL_MS: u64 = 60_000;

/// Most spare dedicated connections (`proxy.shared_spare_connections`).
pub const MAX_SHARED_SPARE_CONNECTIONS: usize = 64;

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            listen: "127.0.0.1:6380".to_string(),
            max_clients: 10_000,
            shutdown_grace_ms: 5_000,
            read_chunk_bytes: 64 * 1024,
            max_inflight_batches: 1_024,
            client_idle_timeout_ms: 0,
            partial_request_timeout_ms: 30_000,
            client_write_timeout_ms: 60_000,
            max_client_output_bytes: 0,
            upstream: UpstreamMode::Dedicated,
            shared_upstream_connections: 2,
            shared_upstream_queue_batches: 4_096,
            shared_session_reply_bytes: 64 * 1024 * 1024,
            shared_reply_stall_ms: 1_000,
            shared_spare_connections: 2,
            tls: ListenerTlsConfig::default(),
        }
    }
}

impl ProxyConfig {
    /// Checks the `[proxy]` values other than TLS.
    pub fn validate(&self) -> Result<(), ConfigError> {
        parse_addr("proxy.listen", &self.listen)?;
        positive("proxy.max_clients", self.max_clients as u64)?;
        positive("proxy.read_chunk_bytes", self.read_chunk_bytes as u64)?;
        positive(
            "proxy.max_inflight_batches",
            self.max_inflight_batches as u64,
        )?;
        for (key, value) in [
            ("proxy.client_idle_timeout_ms", self.client_idle_timeout_ms),
            (
                "proxy.partial_request_timeout_ms",
                self.partial_request_timeout_ms,
            ),
            (
                "proxy.client_write_timeout_ms",
                self.client_write_timeout_ms,
            ),
        ] {
            if value > 0 && value < MIN_CLIENT_TIMEOUT_MS {
                return Err(invalid(
                    key,
                    &format!("must be 0 (off) or at least {MIN_CLIENT_TIMEOUT_MS}"),
                ));
            }
        }
        let output = self.max_client_output_bytes;
        if output > 0 && output < self.read_chunk_bytes as u64 {
            return Err(invalid(
                "proxy.max_client_output_bytes",
                "must be 0 (none) or at least proxy.read_chunk_bytes",
            ));
        }
        let shared = self.shared_upstream_connections;
        if shared == 0 || shared > MAX_SHARED_UPSTREAM_CONNECTIONS {
            return Err(invalid(
                "proxy.shared_upstream_connections",
                &format!("must be 1 to {MAX_SHARED_UPSTREAM_CONNECTIONS}"),
            ));
        }
        positive(
            "proxy.shared_upstream_queue_batches",
            self.shared_upstream_queue_batches as u64,
        )?;
        if self.shared_spare_connections > MAX_SHARED_SPARE_CONNECTIONS {
            return Err(invalid(
                "proxy.shared_spare_connections",
                &format!("must be 0 (none) to {MAX_SHARED_SPARE_CONNECTIONS}"),
            ));
        }
        if !(1..=MAX_SHARED_REPLY_STALL_MS).contains(&self.shared_reply_stall_ms) {
            return Err(invalid(
                "proxy.shared_reply_stall_ms",
                &format!("must be 1 to {MAX_SHARED_REPLY_STALL_MS}"),
            ));
        }
        if self.shared_session_reply_bytes < 2 * self.read_chunk_bytes as u64 {
            return Err(invalid(
                "proxy.shared_session_reply_bytes",
                "must be at least twice proxy.read_chunk_bytes",
            ));
        }
        Ok(())
    }

    /// `client_idle_timeout_ms` as a duration; `None` when off.
    pub fn idle_timeout(&self) -> Option<Duration> {
        millis(self.client_idle_timeout_ms)
    }

    /// `partial_request_timeout_ms` as a duration; `None` when off.
    pub fn partial_request_timeout(&self) -> Option<Duration> {
        millis(self.partial_request_timeout_ms)
    }

    /// `client_write_timeout_ms` as a duration; `None` when off.
    pub fn write_timeout(&self) -> Option<Duration> {
        millis(self.client_write_timeout_ms)
    }
}

fn millis(ms: u64) -> Option<Duration> {
    (ms > 0).then(|| Duration::from_millis(ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_timeouts_are_off_or_above_the_minimum() {
        let mut p = ProxyConfig {
            client_idle_timeout_ms: 0,
            ..ProxyConfig::default()
        };
        p.validate().unwrap();
        assert_eq!(p.idle_timeout(), None);
        p.partial_request_timeout_ms = MIN_CLIENT_TIMEOUT_MS;
        p.validate().unwrap();
        p.client_write_timeout_ms = MIN_CLIENT_TIMEOUT_MS - 1;
        let err = p.validate().unwrap_err();
        assert!(
            err.to_string().contains("proxy.client_write_timeout_ms"),
            "{err}"
        );
    }

    #[test]
    fn shared_upstream_keys_are_bounded() {
        let ok = ProxyConfig {
            upstream: UpstreamMode::Shared,
            ..ProxyConfig::default()
        };
        ok.validate().unwrap();
        ProxyConfig {
            shared_spare_connections: 0,
            ..ok.clone()
        }
        .validate()
        .unwrap();
        for (bad, key) in [
            (
                ProxyConfig {
                    shared_upstream_connections: 0,
                    ..ok.clone()
                },
                "proxy.shared_upstream_connections",
            ),
            (
                ProxyConfig {
                    shared_upstream_connections: MAX_SHARED_UPSTREAM_CONNECTIONS + 1,
                    ..ok.clone()
                },
                "proxy.shared_upstream_connections",
            ),
            (
                ProxyConfig {
                    shared_upstream_queue_batches: 0,
                    ..ok.clone()
                },
                "proxy.shared_upstream_queue_batches",
            ),
            (
                ProxyConfig {
                    shared_session_reply_bytes: ok.read_chunk_bytes as u64,
                    ..ok.clone()
                },
                "proxy.shared_session_reply_bytes",
            ),
            (
                ProxyConfig {
                    shared_reply_stall_ms: 0,
                    ..ok.clone()
                },
                "proxy.shared_reply_stall_ms",
            ),
            (
                ProxyConfig {
                    shared_reply_stall_ms: MAX_SHARED_REPLY_STALL_MS + 1,
                    ..ok.clone()
                },
                "proxy.shared_reply_stall_ms",
            ),
            (
                ProxyConfig {
                    shared_spare_connections: MAX_SHARED_SPARE_CONNECTIONS + 1,
                    ..ok.clone()
                },
                "proxy.shared_spare_connections",
            ),
        ] {
            let err = bad.validate().unwrap_err();
            assert!(err.to_string().contains(key), "{err}");
        }
        let parsed: ProxyConfig = toml::from_str("upstream = \"shared\"").unwrap();
        assert_eq!(parsed.upstream, UpstreamMode::Shared);
        assert!(toml::from_str::<ProxyConfig>("upstream = \"pooled\"").is_err());
    }
}
