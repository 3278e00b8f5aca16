//! The TLS sections: `[proxy.tls]` (a TLS listener beside the plain one),
//! `[upstream.tls]` (TLS to the primary, also for lockgate's own
//! connections) and `[locks.quorum.tls]` (TLS to the lock masters; absent:
//! the upstream's). The files are read and checked by
//! `crate::tls::load`, which `crate::context::validate` runs after
//! [`super::Config::validate`].

use serde::{Deserialize, Serialize};

/// `[proxy.tls]`: clients may connect with TLS on a second port.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ListenerTlsConfig {
    /// Address of the TLS listener (`IP:PORT`), served beside
    /// `proxy.listen`; empty: no TLS listener. Needs a restart to change.
    pub listen: String,
    /// PEM certificate chain presented to clients, leaf first. Re-read on
    /// reload.
    pub cert_file: String,
    /// PEM private key of the leaf certificate (PKCS#8, RSA or EC/SEC1).
    /// Re-read on reload.
    pub key_file: String,
    /// PEM CA certificates; set: every client must present a certificate
    /// signed by one of them (mutual TLS). Empty: no client certificates.
    pub client_ca_file: String,
    /// Longest time a client may take to finish its TLS handshake, in
    /// milliseconds; past it the connection is closed and counted.
    pub handshake_timeout_ms: u64,
}

impl Default for ListenerTlsConfig {
    fn default() -> Self {
        ListenerTlsConfig {
            listen: String::new(),
            cert_file: String::new(),
            key_file: String::new(),
            client_ca_file: String::new(),
            handshake_timeout_ms: 5_000,
        }
    }
}

/// `[upstream.tls]` and `[locks.quorum.tls]`: lockgate as a TLS client of
/// Redis.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ClientTlsConfig {
    /// Connect with TLS. The handshake counts within
    /// `upstream.connect_timeout_ms`.
    pub enabled: bool,
    /// PEM CA certificates Redis's certificate is verified against; empty:
    /// the system's root certificates.
    pub ca_file: String,
    /// PEM client certificate chain, for Redis's `tls-auth-clients`; empty:
    /// none. Set together with `key_file`.
    pub cert_file: String,
    /// PEM private key of `cert_file` (PKCS#8, RSA or EC/SEC1).
    pub key_file: String,
    /// Name verified in Redis's certificate and sent as SNI; empty: the host
    /// of the address (an IP address is verified as one).
    pub server_name: String,
}

/// The dotted names of one client TLS section's keys, for errors.
#[derive(Debug, Clone, Copy)]
pub struct ClientTlsKeys {
    /// `….tls.ca_file`.
    pub ca_file: &'static str,
    /// `….tls.cert_file`.
    pub cert_file: &'static str,
    /// `….tls.key_file`.
    pub key_file: &'static str,
    /// `….tls.server_name`.
    pub server_name: &'static str,
}

/// The keys of `[upstream.tls]`.
pub const UPSTREAM_TLS_KEYS: ClientTlsKeys = ClientTlsKeys {
    ca_file: "upstream.tls.ca_file",
    cert_file: "upstream.tls.cert_file",
    key_file: "upstream.tls.key_file",
    server_name: "upstream.tls.server_name",
};

/// The keys of `[locks.quorum.tls]`.
pub const QUORUM_TLS_KEYS: ClientTlsKeys = ClientTlsKeys {
    ca_file: "locks.quorum.tls.ca_file",
    cert_file: "locks.quorum.tls.cert_file",
    key_file: "locks.quorum.tls.key_file",
    server_name: "locks.quorum.tls.server_name",
};
