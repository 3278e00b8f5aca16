//! `[upstream.sentinel]`: follow a primary through Redis Sentinel instead
//! of a fixed `upstream.addr` (see `docs/sentinel.md`).

use serde::{Deserialize, Serialize};

use super::{invalid, positive, ClientTlsConfig, ClientTlsKeys, ConfigError};

/// Following the primary through Redis Sentinel (`[upstream.sentinel]`).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SentinelConfig {
    /// The master's name as the sentinels know it. Set: the primary is the
    /// address the sentinels give for it (confirmed with `ROLE`), and
    /// `upstream.addr` is not used. Empty: no Sentinel.
    pub master_name: String,
    /// The sentinels (`HOST:PORT`), all asked at each check; every reachable one is
    /// subscribed to for `+switch-master`.
    pub addrs: Vec<String>,
    /// ACL user for the sentinels (the primary's credentials stay in
    /// `[upstream]`). Empty: none.
    pub username: String,
    /// Password for the sentinels. Empty: no `AUTH`. Shown masked.
    pub password: String,
    /// How often the sentinels are asked again even without a
    /// `+switch-master` message, in milliseconds: a missed message costs at
    /// most this long.
    pub recheck_interval_ms: u64,
    /// TLS to the sentinels (`[upstream.sentinel.tls]`, the keys of
    /// `[upstream.tls]`). Absent: `[upstream.tls]` applies.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<ClientTlsConfig>,
}

impl Default for SentinelConfig {
    fn default() -> Self {
        SentinelConfig {
            master_name: String::new(),
            addrs: Vec::new(),
            username: String::new(),
            password: String::new(),
            recheck_interval_ms: 1_000,
            tls: None,
        }
    }
}

impl SentinelConfig {
    /// True when the primary is followed through the sentinels.
    pub fn enabled(&self) -> bool {
        !self.master_name.is_empty()
    }

    /// Checks the section; errors name the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !self.enabled() {
            if !self.addrs.is_empty() {
                return Err(invalid(
                    "upstream.sentinel.master_name",
                    "required when upstream.sentinel.addrs is set",
                ));
            }
            return Ok(());
        }
        if self.master_name.contains(char::is_whitespace) {
            return Err(invalid(
                "upstream.sentinel.master_name",
                "must not contain white space",
            ));
        }
        if self.addrs.is_empty() {
            return Err(invalid(
                "upstream.sentinel.addrs",
                "at least one sentinel (HOST:PORT) is needed with master_name",
            ));
        }
        if self
            .addrs
            .iter()
            .any(|a| a.trim().is_empty() || !a.contains(':'))
        {
            return Err(invalid(
                "upstream.sentinel.addrs",
                "expected HOST:PORT entries",
            ));
        }
        positive(
            "upstream.sentinel.recheck_interval_ms",
            self.recheck_interval_ms,
        )
    }
}

/// The keys of `[upstream.sentinel.tls]`.
pub const SENTINEL_TLS_KEYS: ClientTlsKeys = ClientTlsKeys {
    ca_file: "upstream.sentinel.tls.ca_file",
    cert_file: "upstream.sentinel.tls.cert_file",
    key_file: "upstream.sentinel.tls.key_file",
    server_name: "upstream.sentinel.tls.server_name",
};

#[cfg(test)]
mod tests {
    use crate::config::{Config, ConfigError};

    fn key_of(config: &Config) -> Option<&'static str> {
        match config.validate() {
            Err(ConfigError::Invalid { key, .. }) => Some(key),
            _ => None,
        }
    }

    #[test]
    fn the_sentinel_section_is_checked_before_anything_starts() {
        let mut c = Config::default();
        assert_eq!(key_of(&c), None);
        c.upstream.sentinel.addrs = vec!["127.0.0.1:26379".to_string()];
        assert_eq!(key_of(&c), Some("upstream.sentinel.master_name"));
        c.upstream.sentinel.master_name = "m".to_string();
        assert_eq!(key_of(&c), None);
        c.upstream.sentinel.addrs = vec!["nowhere".to_string()];
        assert_eq!(key_of(&c), Some("upstream.sentinel.addrs"));
        c.upstream.sentinel.addrs.clear();
        assert_eq!(key_of(&c), Some("upstream.sentinel.addrs"));
        c.upstream.sentinel.addrs = vec!["127.0.0.1:26379".to_string()];
        c.upstream.sentinel.recheck_interval_ms = 0;
        assert_eq!(key_of(&c), Some("upstream.sentinel.recheck_interval_ms"));
        c.upstream.sentinel.recheck_interval_ms = 1_000;
        assert_eq!(key_of(&c), None);
        // Its TLS files are read where they are used: `crate::tls`'s tests.
    }

    #[test]
    fn the_shipped_file_parses_with_every_sentinel_key() {
        let text = include_str!("../../config/lockgate.toml");
        let c: Config = toml::from_str(text).expect("config/lockgate.toml parses");
        assert_eq!(c, Config::default());
    }
}
