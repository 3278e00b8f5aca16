//! Configuration: one serde tree, every key with a default and a doc comment.
//!
//! The file is TOML (`config/lockgate.toml` documents every key); command-line
//! flags override it. [`Config::validate`] runs before any port is bound, and
//! `lockgate --check` runs only that and exits (0 valid, 64 invalid).

use std::net::SocketAddr;
use std::path::Path;

use serde::{Deserialize, Serialize};

mod cluster;
mod locks;
mod proxy;
mod sentinel;
mod tls;
pub use cluster::{ClusterConfig, MAX_REDIRECTS};
pub use locks::{
    AckRefusal, GuardConfig, GuardMode, LockOverride, LocksConfig, Ownership, QuorumConfig,
    QuorumLoss, RetryConfig, UnlockedWriters, WakeConfig, MAX_GUARDS,
};
pub use proxy::{
    ProxyConfig, UpstreamMode, MAX_SHARED_UPSTREAM_CONNECTIONS, MIN_CLIENT_TIMEOUT_MS,
};
pub use sentinel::{SentinelConfig, SENTINEL_TLS_KEYS};
pub use tls::{
    ClientTlsConfig, ClientTlsKeys, ListenerTlsConfig, QUORUM_TLS_KEYS, UPSTREAM_TLS_KEYS,
};

/// Everything lockgate can be told. Sections mirror `config/lockgate.toml`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// The client-facing RESP listener.
    pub proxy: ProxyConfig,
    /// The primary Redis every ordinary command goes to.
    pub upstream: UpstreamConfig,
    /// Protocol limits applied to client input before it is buffered.
    pub limits: LimitsConfig,
    /// Which keys are locks and how they are leased and released.
    pub locks: LocksConfig,
    /// The operators' side: HTTP endpoints and `LOCKGATE` commands.
    pub admin: AdminConfig,
    /// Logging.
    pub log: LogConfig,
}

/// Logging (`[log]`).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// `tracing` filter directives, e.g. `info` or `lockgate=debug`;
    /// `RUST_LOG`, when set, wins at start-up. Changes on reload.
    pub filter: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            filter: "info".to_string(),
        }
    }
}

/// The operators' side (`[admin]`).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AdminConfig {
    /// HTTP listener for `/metrics`, `/healthz`, `/readyz` and the status
    /// page `/` (`HOST:PORT`); empty: no HTTP listener. Also `--admin-listen`.
    pub listen: String,
    /// Answer `LOCKGATE …` commands over RESP. Off: they pass to Redis
    /// (which refuses them as unknown).
    pub resp_commands: bool,
    /// If set, a connection must send `LOCKGATE AUTH <password>` before any
    /// other `LOCKGATE` command. Shown masked by `LOCKGATE CONFIG`.
    pub password: String,
    /// How many hottest lock keys are reported (K of the top-K sketch).
    pub hot_keys: usize,
    /// How many of the latest leases that ran out before their holder
    /// released or extended them are kept for the status page and
    /// `LOCKGATE LAPSES` (key, client, overrun); 0: none.
    pub recent_lapses: usize,
    /// How far back the status page's charts go, in seconds (the
    /// history's span; with `history_interval_ms`, its size in samples).
    pub history_seconds: u64,
    /// Between two samples of the status page's history, in ms.
    pub history_interval_ms: u64,
}

/// Most samples the status page's history may keep
/// (`admin.history_seconds` over `admin.history_interval_ms`).
pub const MAX_HISTORY_SAMPLES: u64 = 10_000;

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: "127.0.0.1:9480".to_string(),
            resp_commands: true,
            password: String::new(),
            hot_keys: 20,
            recent_lapses: 32,
            history_seconds: 900,
            history_interval_ms: 2_000,
        }
    }
}

/// The primary Redis: one upstream connection per client connection, so every
/// stateful command (SELECT, MULTI, SUBSCRIBE, AUTH, …) behaves as on Redis.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct UpstreamConfig {
    /// Address of the primary Redis (`HOST:PORT`).
    pub addr: String,
    /// Longest wait for a TCP connection to the primary, in milliseconds; a
    /// client whose upstream cannot be reached in time gets
    /// `-ERR lockgate: upstream … unavailable (…)` for its commands.
    pub connect_timeout_ms: u64,
    /// While the primary is unreachable, the least time between two connection
    /// attempts for one client, in milliseconds; commands in between are
    /// answered with the same error at once instead of waiting again.
    pub reconnect_interval_ms: u64,
    /// At most this many client sessions whose dedicated upstream
    /// connection has been asked something and has not answered yet, and
    /// at most `connect_timeout_ms` each; while that many are open, new
    /// clients wait in lockgate's listen queue, as they would in Redis's.
    /// Redis answers a connection only once it has accepted it: without a
    /// bound, a burst of short-lived clients that lockgate accepts faster
    /// than Redis does overflows Redis's listen queue (its `tcp-backlog`,
    /// 511), every connection past it fails its connect, and the rest wait
    /// for Redis for seconds, with their sessions, after their clients
    /// left (docs/operations.md, "Abusive clients"). 0: no bound. Unused in
    /// shared mode and in front of a cluster.
    pub max_connecting: usize,
    /// Longest a connection lockgate pipelines many commands on (a
    /// cluster node's, a shared one to the primary with `proxy.upstream =
    /// "shared"`) may go without a byte of reply while a lock command
    /// (lockgate's own script call for a `SETNX`, `SET … NX`, a release, or
    /// the `SCRIPT LOAD` before one) waits on it, in milliseconds; past it
    /// the connection is given up: every reply owed on it is answered
    /// `-ERR lockgate: upstream … unavailable (… a lock command unanswered
    /// for N ms)` and it is opened again. A server behind a blackholed path
    /// accepts and never answers: without it lock commands would wait as
    /// long as the path is silent (docs/faults.md, "Partitions"). 0: no
    /// bound; otherwise at least [`MIN_LOCK_REPLY_TIMEOUT_MS`].
    pub lock_reply_timeout_ms: u64,
    /// ACL user for lockgate's own connections to the primary (lease
    /// renewal, release on disconnect). Client connections always use the
    /// client's own `AUTH`. Empty: no user (the `default` user).
    pub username: String,
    /// Password for lockgate's own connections. Empty: no `AUTH`.
    pub password: String,
    /// TLS to the primary, for client sessions and lockgate's own
    /// connections (`[upstream.tls]`); also to the lock masters unless
    /// `[locks.quorum.tls]` is given.
    pub tls: ClientTlsConfig,
    /// Follow the primary through Redis Sentinel (`[upstream.sentinel]`);
    /// `upstream.addr` is then unused.
    pub sentinel: SentinelConfig,
    /// A Redis Cluster behind lockgate (`[upstream.cluster]`): commands
    /// routed by hash slot to the node that serves them; `upstream.addr`
    /// is then unused. Exclusive with `[upstream.sentinel]`.
    pub cluster: ClusterConfig,
}

impl UpstreamConfig {
    /// `lock_reply_timeout_ms` as a duration; `None` when off.
    pub fn lock_reply_timeout(&self) -> Option<std::time::Duration> {
        (self.lock_reply_timeout_ms > 0)
            .then(|| std::time::Duration::from_millis(self.lock_reply_timeout_ms))
    }
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        UpstreamConfig {
            addr: "127.0.0.1:6379".to_string(),
            connect_timeout_ms: 1_000,
            reconnect_interval_ms: 100,
            max_connecting: 128,
            lock_reply_timeout_ms: 2_000,
            username: String::new(),
            password: String::new(),
            tls: ClientTlsConfig::default(),
            sentinel: SentinelConfig::default(),
            cluster: ClusterConfig::default(),
        }
    }
}

/// Limits on client input, checked on headers before the payload is buffered.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Largest bulk string argument, in bytes (Redis's `proto-max-bulk-len`).
    pub max_bulk_bytes: u64,
    /// Most arguments in one command (the `*N` header).
    pub max_multibulk_len: u64,
    /// Largest inline command line, in bytes (Redis: 64 KiB).
    pub max_inline_bytes: usize,
    /// Largest whole command (all arguments and headers), in bytes: bounds the
    /// read buffer of one client (Redis's `client-query-buffer-limit`).
    pub max_request_bytes: u64,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_bulk_bytes: 512 * 1024 * 1024,
            max_multibulk_len: 1024 * 1024,
            max_inline_bytes: 64 * 1024,
            max_request_bytes: 1024 * 1024 * 1024,
        }
    }
}

/// Why a configuration was refused; always names the offending key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The path given with `--config`.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is not valid TOML or has an unknown key or a wrong type.
    #[error("invalid config file {path}: {message}")]
    Parse {
        /// The path given with `--config`.
        path: String,
        /// The TOML error, which names the key and line.
        message: String,
    },
    /// A value is out of its allowed range.
    #[error("invalid value for `{key}`: {reason}")]
    Invalid {
        /// Dotted key, e.g. `proxy.listen`.
        key: &'static str,
        /// What is wrong and what is allowed.
        reason: String,
    },
}

impl Config {
    /// Reads and parses a TOML file; missing keys take their defaults.
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Config::from_toml(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse {
                path: path.display().to_string(),
                message,
            },
            other => other,
        })
    }

    /// Parses TOML text; missing keys take their defaults. Does not validate.
    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: "<text>".to_string(),
            message: e.to_string(),
        })
    }

    /// The configuration with its passwords masked (`LOCKGATE CONFIG`).
    pub fn masked(&self) -> Config {
        let mut shown = self.clone();
        for secret in [
            &mut shown.upstream.password,
            &mut shown.upstream.sentinel.password,
            &mut shown.admin.password,
        ] {
            if !secret.is_empty() {
                *secret = "********".to_string();
            }
        }
        shown
    }

    /// The configuration as a TOML document (`LOCKGATE CONFIG TOML`).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| format!("# cannot render: {e}"))
    }

    /// Checks every value that the configuration alone can tell, run
    /// before any port is bound. What needs the parts that use a value,
    /// the guards' patterns (the lock room compiles them) and the TLS
    /// files (read by `crate::tls`), is checked by
    /// `crate::context::validate`, which runs this first: the one check
    /// `lockgate --check`, start-up and a reload make.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.proxy.validate()?;
        if self.upstream.addr.trim().is_empty() || !self.upstream.addr.contains(':') {
            return Err(invalid("upstream.addr", "expected HOST:PORT"));
        }
        positive(
            "upstream.connect_timeout_ms",
            self.upstream.connect_timeout_ms,
        )?;
        if (1..MIN_LOCK_REPLY_TIMEOUT_MS).contains(&self.upstream.lock_reply_timeout_ms) {
            return Err(invalid(
                "upstream.lock_reply_timeout_ms",
                &format!("must be 0 (no bound) or at least {MIN_LOCK_REPLY_TIMEOUT_MS}"),
            ));
        }
        if self.upstream.max_connecting > MAX_CONNECTING {
            return Err(invalid(
                "upstream.max_connecting",
                &format!("must be at most {MAX_CONNECTING} (0: no bound)"),
            ));
        }
        self.upstream.sentinel.validate()?;
        self.upstream.cluster.validate()?;
        if self.upstream.cluster.enabled() && self.upstream.sentinel.enabled() {
            return Err(invalid(
                "upstream.cluster.seeds",
                "a cluster and [upstream.sentinel] exclude each other: a cluster \
                 fails its shards over itself",
            ));
        }
        positive("limits.max_bulk_bytes", self.limits.max_bulk_bytes)?;
        positive("limits.max_multibulk_len", self.limits.max_multibulk_len)?;
        if self.limits.max_inline_bytes < 16 {
            return Err(invalid("limits.max_inline_bytes", "must be at least 16"));
        }
        positive("locks.default_lease_ms", self.locks.default_lease_ms)?;
        if !self.admin.listen.is_empty() {
            parse_addr("admin.listen", &self.admin.listen)?;
        }
        positive("admin.hot_keys", self.admin.hot_keys as u64)?;
        if self.admin.history_interval_ms < 100 {
            return Err(invalid("admin.history_interval_ms", "must be at least 100"));
        }
        let samples =
            self.admin.history_seconds.saturating_mul(1000) / self.admin.history_interval_ms;
        if !(1..=MAX_HISTORY_SAMPLES).contains(&samples) {
            return Err(invalid(
                "admin.history_seconds",
                &format!(
                    "with admin.history_interval_ms = {}, must make 1 to {MAX_HISTORY_SAMPLES} samples (it makes {samples})",
                    self.admin.history_interval_ms
                ),
            ));
        }
        positive("locks.max_queued_calls", self.locks.max_queued_calls as u64)?;
        let conns = self.locks.transaction_connections;
        if !(1..=MAX_TRANSACTION_CONNECTIONS).contains(&conns) {
            return Err(invalid(
                "locks.transaction_connections",
                &format!("must be 1 to {MAX_TRANSACTION_CONNECTIONS}"),
            ));
        }
        if !(1..=MAX_TRANSACTION_RETRIES).contains(&self.locks.transaction_retries) {
            return Err(invalid(
                "locks.transaction_retries",
                &format!("must be 1 to {MAX_TRANSACTION_RETRIES}"),
            ));
        }
        if self.locks.guard_table_wait_ms > locks::MAX_GUARD_TABLE_WAIT_MS {
            return Err(invalid(
                "locks.guard_table_wait_ms",
                &format!("must be at most {}", locks::MAX_GUARD_TABLE_WAIT_MS),
            ));
        }
        if self.locks.eviction_check_ms < MIN_EVICTION_CHECK_MS {
            return Err(invalid(
                "locks.eviction_check_ms",
                &format!("must be at least {MIN_EVICTION_CHECK_MS}"),
            ));
        }
        let q = &self.locks.quorum;
        if !q.masters.is_empty() && q.masters.len() < 3 {
            return Err(invalid(
                "locks.quorum.masters",
                "needs at least 3 masters (or none)",
            ));
        }
        if q.masters.iter().any(|m| !m.contains(':')) {
            return Err(invalid(
                "locks.quorum.masters",
                "expected HOST:PORT entries",
            ));
        }
        positive("locks.quorum.node_timeout_ms", q.node_timeout_ms)?;
        if q.clock_faults > 0 && q.clock_faults >= q.masters.len() {
            // More than (N + k) / 2 "yes" votes must be possible at all.
            return Err(invalid(
                "locks.quorum.clock_faults",
                &format!(
                    "must be less than the number of masters ({}), so that more than (N + clock_faults) / 2 of them can agree",
                    q.masters.len()
                ),
            ));
        }
        positive("locks.retry.max_keys", self.locks.retry.max_keys as u64)?;
        if self.locks.wake.listen_max_ms < 1_000 {
            return Err(invalid("locks.wake.listen_max_ms", "must be at least 1000"));
        }
        positive(
            "locks.wake.signal_expire_ms",
            self.locks.wake.signal_expire_ms,
        )?;
        // Below a few round trips the bound would take the lock from the
        // releasing instance at nearly every release: no handoff left.
        let preference = self.locks.retry.max_local_preference_ms;
        if preference > 0 && preference < MIN_LOCAL_PREFERENCE_MS {
            return Err(invalid(
                "locks.retry.max_local_preference_ms",
                &format!("must be 0 (off) or at least {MIN_LOCAL_PREFERENCE_MS}"),
            ));
        }
        if self.locks.retry.queue_ttl_ms < MIN_QUEUE_TTL_MS {
            return Err(invalid(
                "locks.retry.queue_ttl_ms",
                &format!("must be at least {MIN_QUEUE_TTL_MS}"),
            ));
        }
        if !(0.0..0.5).contains(&q.clock_drift_factor) {
            return Err(invalid(
                "locks.quorum.clock_drift_factor",
                "must be in [0, 0.5)",
            ));
        }
        positive(
            "locks.max_locks_per_connection",
            self.locks.max_locks_per_connection as u64,
        )?;
        if self.locks.keys.iter().any(|k| k.is_empty()) {
            return Err(invalid("locks.keys", "patterns must not be empty"));
        }
        if self.locks.instance_id.contains(char::is_whitespace) {
            return Err(invalid("locks.instance_id", "must not contain white space"));
        }
        self.validate_replicas_ack()?;
        for o in &self.locks.overrides {
            if o.pattern.is_empty() {
                return Err(invalid("locks.overrides.pattern", "must not be empty"));
            }
            if o.watchdog && o.max_hold_ms == 0 {
                return Err(invalid(
                    "locks.overrides.max_hold_ms",
                    "must be > 0 with watchdog",
                ));
            }
        }
        if self.limits.max_request_bytes < self.limits.max_bulk_bytes {
            return Err(invalid(
                "limits.max_request_bytes",
                "must be at least limits.max_bulk_bytes",
            ));
        }
        self.validate_tls()
    }

    /// `locks.replicas_ack` and its timeout, globally and per pattern:
    /// within bounds, and only where there are replicas to wait for (one
    /// primary or a cluster's shards, not the quorum's masters).
    fn validate_replicas_ack(&self) -> Result<(), ConfigError> {
        let l = &self.locks;
        let per_pattern = l.overrides.iter().map(|o| {
            (
                o.replicas_ack.unwrap_or(l.replicas_ack),
                o.replicas_ack_timeout_ms
                    .unwrap_or(l.replicas_ack_timeout_ms),
            )
        });
        let mut on = false;
        for (n, timeout_ms) in
            std::iter::once((l.replicas_ack, l.replicas_ack_timeout_ms)).chain(per_pattern)
        {
            if n > locks::MAX_REPLICAS_ACK {
                let why = format!("must be at most {}", locks::MAX_REPLICAS_ACK);
                return Err(invalid("locks.replicas_ack", &why));
            }
            if !(1..=locks::MAX_REPLICAS_ACK_TIMEOUT_MS).contains(&timeout_ms) {
                let why = format!("must be 1 to {}", locks::MAX_REPLICAS_ACK_TIMEOUT_MS);
                return Err(invalid("locks.replicas_ack_timeout_ms", &why));
            }
            on |= n > 0;
        }
        if on && !l.quorum.masters.is_empty() {
            return Err(invalid(
                "locks.replicas_ack",
                "the quorum's masters are independent servers with no replicas to wait for: \
                 leave it 0 with locks.quorum.masters",
            ));
        }
        Ok(())
    }

    /// The TLS sections' addresses and timeouts (the files themselves are
    /// read by `crate::tls::load`, from `crate::context::validate`).
    fn validate_tls(&self) -> Result<(), ConfigError> {
        let t = &self.proxy.tls;
        if !t.listen.is_empty() {
            parse_addr("proxy.tls.listen", &t.listen)?;
            if t.listen == self.proxy.listen {
                return Err(invalid("proxy.tls.listen", "must differ from proxy.listen"));
            }
        }
        positive("proxy.tls.handshake_timeout_ms", t.handshake_timeout_ms)
    }
}

/// A value refused: `key` names it, `reason` says why.
pub fn invalid(key: &'static str, reason: &str) -> ConfigError {
    ConfigError::Invalid {
        key,
        reason: reason.to_string(),
    }
}

/// Most `locks.transaction_connections`: each is a connection to Redis.
pub const MAX_TRANSACTION_CONNECTIONS: usize = 1024;

/// Most `upstream.max_connecting` (a semaphore's permits; more than any
/// listen queue holds).
pub const MAX_CONNECTING: usize = 65_536;

/// Smallest `upstream.lock_reply_timeout_ms` other than 0 (off): below a
/// scheduler hiccup on a loaded host, healthy connections would be given
/// up.
pub const MIN_LOCK_REPLY_TIMEOUT_MS: u64 = 50;

/// Most `locks.transaction_retries`.
pub const MAX_TRANSACTION_RETRIES: u32 = 1000;

/// Smallest `locks.eviction_check_ms`: each check is a round trip to every
/// Redis lockgate keeps locks on.
const MIN_EVICTION_CHECK_MS: u64 = 10;

/// Smallest `locks.retry.queue_ttl_ms`: a third of it is how often a
/// waiting instance renews its place, which must take a few round trips.
pub const MIN_QUEUE_TTL_MS: u64 = 300;

/// Smallest `locks.retry.max_local_preference_ms` other than 0 (off).
pub const MIN_LOCAL_PREFERENCE_MS: u64 = 10;

fn positive(key: &'static str, value: u64) -> Result<(), ConfigError> {
    if value == 0 {
        return Err(invalid(key, "must be greater than 0"));
    }
    Ok(())
}

fn parse_addr(key: &'static str, value: &str) -> Result<SocketAddr, ConfigError> {
    value.parse().map_err(|_| ConfigError::Invalid {
        key,
        reason: format!("`{value}` is not an IP:PORT socket address"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        Config::default().validate().unwrap();
    }

    #[test]
    fn unknown_key_is_refused_by_name() {
        let err = Config::from_toml("[proxy]\nlisen = \"x\"\n").unwrap_err();
        assert!(err.to_string().contains("lisen"), "{err}");
    }

    #[test]
    fn bad_value_names_the_key() {
        let cfg = Config::from_toml("[proxy]\nmax_clients = 0\n").unwrap();
        let err = cfg.validate().unwrap_err();
        assert!(err.to_string().contains("proxy.max_clients"), "{err}");
    }

    #[test]
    fn clock_faults_must_leave_a_quorum() {
        let mut cfg = Config::default();
        cfg.locks.quorum.masters = ["a:1", "b:1", "c:1"].map(String::from).to_vec();
        cfg.locks.quorum.clock_faults = 2;
        cfg.validate().unwrap();
        cfg.locks.quorum.clock_faults = 3;
        let err = cfg.validate().unwrap_err();
        assert!(
            err.to_string().contains("locks.quorum.clock_faults"),
            "{err}"
        );
        cfg.locks.quorum.masters.clear();
        assert!(cfg.validate().is_err(), "clock_faults without masters");
    }

    #[test]
    fn local_preference_is_off_or_a_few_round_trips() {
        let mut cfg = Config::default();
        for ok in [0, MIN_LOCAL_PREFERENCE_MS, 500] {
            cfg.locks.retry.max_local_preference_ms = ok;
            cfg.validate().unwrap();
        }
        cfg.locks.retry.max_local_preference_ms = MIN_LOCAL_PREFERENCE_MS - 1;
        let err = cfg.validate().unwrap_err();
        assert!(
            err.to_string()
                .contains("locks.retry.max_local_preference_ms"),
            "{err}"
        );
    }

    #[test]
    fn a_queue_place_lasts_a_few_round_trips() {
        let mut cfg = Config::default();
        cfg.locks.retry.queue_ttl_ms = MIN_QUEUE_TTL_MS;
        cfg.validate().unwrap();
        cfg.locks.retry.queue_ttl_ms = MIN_QUEUE_TTL_MS - 1;
        let err = cfg.validate().unwrap_err();
        assert!(
            err.to_string().contains("locks.retry.queue_ttl_ms"),
            "{err}"
        );
    }

    #[test]
    fn eviction_checks_are_at_most_a_hundred_a_second() {
        let mut cfg = Config::default();
        cfg.locks.require_noeviction = true;
        cfg.locks.eviction_check_ms = MIN_EVICTION_CHECK_MS;
        cfg.validate().unwrap();
        cfg.locks.eviction_check_ms = 0;
        let err = cfg.validate().unwrap_err();
        assert!(err.to_string().contains("locks.eviction_check_ms"), "{err}");
    }

    #[test]
    fn replicas_ack_is_bounded_and_only_where_there_are_replicas() {
        let mut cfg = Config::default();
        cfg.locks.replicas_ack = 2;
        cfg.validate().unwrap();
        let refused = |cfg: &Config, what: &str| {
            let err = cfg.validate().unwrap_err().to_string();
            assert!(err.contains(what), "{err}");
        };
        let mut c = cfg.clone();
        c.locks.replicas_ack_timeout_ms = 0;
        refused(&c, "locks.replicas_ack_timeout_ms");
        let mut c = cfg.clone();
        c.locks.replicas_ack = locks::MAX_REPLICAS_ACK + 1;
        refused(&c, "locks.replicas_ack");
        let mut c = cfg.clone();
        c.locks.quorum.masters = vec!["a:1".into(), "b:1".into(), "c:1".into()];
        refused(&c, "no replicas to wait for");
        // In front of a cluster: each shard's replicas.
        let mut c = cfg.clone();
        c.upstream.cluster.seeds = vec!["a:1".into()];
        c.validate().unwrap();
        // Asked by one pattern only, the same.
        let mut c = Config::default();
        c.locks.quorum.masters = vec!["a:1".into(), "b:1".into(), "c:1".into()];
        c.validate().unwrap();
        c.locks.overrides.push(LockOverride {
            pattern: "lock:x:*".into(),
            replicas_ack: Some(1),
            ..LockOverride::default()
        });
        refused(&c, "no replicas to wait for");
        let mut c = Config::default();
        c.locks.overrides.push(LockOverride {
            pattern: "lock:x:*".into(),
            replicas_ack_timeout_ms: Some(locks::MAX_REPLICAS_ACK_TIMEOUT_MS + 1),
            ..LockOverride::default()
        });
        refused(&c, "locks.replicas_ack_timeout_ms");
    }

    #[test]
    fn shipped_file_matches_defaults() {
        let text = include_str!("../../config/lockgate.toml");
        let cfg = Config::from_toml(text).unwrap();
        assert_eq!(cfg, Config::default());
    }
}
