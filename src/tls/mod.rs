//! TLS with rustls (the `ring` provider; no OpenSSL): the TLS listener's
//! server configuration, the client configurations for the primary and the
//! lock masters, and [`TlsStore`], which holds them and swaps them on
//! reload. Handshakes already done keep their session; new ones use the
//! certificates in force.
//!
//! [`load`] reads every file the configuration names and checks it (PEM
//! readable, at least one certificate, the key matching the certificate);
//! [`crate::config::Config::validate`] runs it, so `--check`, start-up and
//! reload refuse a bad file with the key that names it.

pub mod stream;

use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::config::{ClientTlsConfig, ClientTlsKeys, Config, ConfigError};
use crate::config::{QUORUM_TLS_KEYS, UPSTREAM_TLS_KEYS};
use crate::error::ErrorSource;
use crate::metrics::{ProxyMetrics, RateLimit};
pub use stream::{ReadPart, Stream, WritePart};

/// Why a TLS handshake with a client failed.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The client did not finish its handshake in time.
    #[error("TLS handshake timed out after {0} ms")]
    Timeout(u64),
    /// The handshake failed: not TLS, no or a bad certificate, a protocol
    /// error, or the connection closed.
    #[error("TLS handshake failed: {0}")]
    Handshake(std::io::Error),
    /// No server certificate is loaded (it failed to load at start-up).
    #[error("no TLS certificate loaded")]
    NoCertificate,
}

impl TlsError {
    /// A failed or stalled handshake is the client's; a missing
    /// certificate is lockgate's.
    pub fn source_kind(&self) -> ErrorSource {
        match self {
            TlsError::Timeout(_) | TlsError::Handshake(_) => ErrorSource::Client,
            TlsError::NoCertificate => ErrorSource::Internal,
        }
    }
}

/// Which Redis a client configuration is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The primary (`[upstream.tls]`).
    Upstream,
    /// The lock masters (`[locks.quorum.tls]`, else `[upstream.tls]`).
    Quorum,
    /// The sentinels (`[upstream.sentinel.tls]`, else `[upstream.tls]`).
    Sentinel,
}

/// lockgate as a TLS client of one kind of Redis.
#[derive(Debug, Clone)]
pub struct ClientSide {
    /// The rustls configuration (roots, client certificate).
    pub config: Arc<ClientConfig>,
    /// `server_name` when set; otherwise the host of each address.
    pub server_name: Option<ServerName<'static>>,
}

/// How lockgate connects to one kind of Redis: `Ok(None)` plain TCP,
/// `Ok(Some)` TLS, `Err` TLS whose files failed to load at start-up (they
/// were valid at validation): those connections fail with the reason.
pub type ClientTls = Result<Option<ClientSide>, String>;

/// Everything TLS loaded from one configuration.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The TLS listener's configuration (`None`: no listener, or its files
    /// failed to load at start-up).
    pub listener: Option<Arc<ServerConfig>>,
    /// TLS to the primary.
    pub upstream: ClientTls,
    /// TLS to the lock masters.
    pub quorum: ClientTls,
    /// TLS to the sentinels.
    pub sentinel: ClientTls,
    /// Longest client handshake.
    pub handshake_timeout: Duration,
}

/// The crypto provider: ring, built in, no system library.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn invalid(key: &'static str, reason: String) -> ConfigError {
    ConfigError::Invalid { key, reason }
}

fn certs(key: &'static str, path: &str) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let iter = CertificateDer::pem_file_iter(path)
        .map_err(|e| invalid(key, format!("cannot read `{path}`: {e}")))?;
    let certs = iter
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(key, format!("`{path}` is not valid PEM: {e}")))?;
    if certs.is_empty() {
        return Err(invalid(key, format!("`{path}` holds no certificate")));
    }
    Ok(certs)
}

fn private_key(key: &'static str, path: &str) -> Result<PrivateKeyDer<'static>, ConfigError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| {
        invalid(
            key,
            format!("cannot read a PEM private key from `{path}`: {e}"),
        )
    })
}

fn roots(key: &'static str, path: &str) -> Result<RootCertStore, ConfigError> {
    let mut store = RootCertStore::empty();
    for cert in certs(key, path)? {
        store
            .add(cert)
            .map_err(|e| invalid(key, format!("`{path}`: {e}")))?;
    }
    Ok(store)
}

/// The key does not belong to the certificate, or is not usable.
fn key_error(key: &'static str, path: &str, e: rustls::Error) -> ConfigError {
    invalid(
        key,
        format!("`{path}` cannot be used with its certificate: {e}"),
    )
}

fn listener(config: &Config) -> Result<Option<Arc<ServerConfig>>, ConfigError> {
    let t = &config.proxy.tls;
    if t.listen.is_empty() {
        return Ok(None);
    }
    for (key, value) in [
        ("proxy.tls.cert_file", &t.cert_file),
        ("proxy.tls.key_file", &t.key_file),
    ] {
        if value.is_empty() {
            return Err(invalid(key, "required with proxy.tls.listen".to_string()));
        }
    }
    let chain = certs("proxy.tls.cert_file", &t.cert_file)?;
    let key = private_key("proxy.tls.key_file", &t.key_file)?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid("proxy.tls", e.to_string()))?;
    let builder = match t.client_ca_file.as_str() {
        "" => builder.with_no_client_auth(),
        ca => {
            let roots = roots("proxy.tls.client_ca_file", ca)?;
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                roots.into(),
                provider(),
            )
            .build()
            .map_err(|e| invalid("proxy.tls.client_ca_file", e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let server = builder
        .with_single_cert(chain, key)
        .map_err(|e| key_error("proxy.tls.key_file", &t.key_file, e))?;
    Ok(Some(Arc::new(server)))
}

fn client(t: &ClientTlsConfig, keys: ClientTlsKeys) -> Result<Option<ClientSide>, ConfigError> {
    if !t.enabled {
        return Ok(None);
    }
    let roots = match t.ca_file.as_str() {
        "" => {
            let found = rustls_native_certs::load_native_certs();
            let mut store = RootCertStore::empty();
            let (added, _) = store.add_parsable_certificates(found.certs);
            if added == 0 {
                return Err(invalid(
                    keys.ca_file,
                    "empty, and no system root certificates were found".to_string(),
                ));
            }
            store
        }
        path => roots(keys.ca_file, path)?,
    };
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid(keys.ca_file, e.to_string()))?
        .with_root_certificates(roots);
    let config = match (t.cert_file.as_str(), t.key_file.as_str()) {
        ("", "") => builder.with_no_client_auth(),
        ("", _) => {
            return Err(invalid(
                keys.cert_file,
                "required with key_file".to_string(),
            ))
        }
        (_, "") => {
            return Err(invalid(
                keys.key_file,
                "required with cert_file".to_string(),
            ))
        }
        (cert, key) => {
            let chain = certs(keys.cert_file, cert)?;
            let der = private_key(keys.key_file, key)?;
            builder
                .with_client_auth_cert(chain, der)
                .map_err(|e| key_error(keys.key_file, key, e))?
        }
    };
    let server_name = match t.server_name.as_str() {
        "" => None,
        name => Some(
            ServerName::try_from(name.to_string())
                .map_err(|e| invalid(keys.server_name, format!("`{name}`: {e}")))?,
        ),
    };
    Ok(Some(ClientSide {
        config: Arc::new(config),
        server_name,
    }))
}

fn quorum_client(config: &Config) -> Result<Option<ClientSide>, ConfigError> {
    match &config.locks.quorum.tls {
        Some(t) => client(t, QUORUM_TLS_KEYS),
        None => client(&config.upstream.tls, UPSTREAM_TLS_KEYS),
    }
}

fn sentinel_client(config: &Config) -> Result<Option<ClientSide>, ConfigError> {
    match &config.upstream.sentinel.tls {
        Some(t) => client(t, crate::config::SENTINEL_TLS_KEYS),
        None => client(&config.upstream.tls, UPSTREAM_TLS_KEYS),
    }
}

/// Reads and checks every TLS file `config` names; errors name the key.
pub fn load(config: &Config) -> Result<Loaded, ConfigError> {
    Ok(Loaded {
        upstream: Ok(client(&config.upstream.tls, UPSTREAM_TLS_KEYS)?),
        quorum: Ok(quorum_client(config)?),
        sentinel: Ok(sentinel_client(config)?),
        listener: listener(config)?,
        handshake_timeout: Duration::from_millis(config.proxy.tls.handshake_timeout_ms),
    })
}

/// Like [`load`], part by part: a part that fails is logged and left
/// failing (see [`ClientTls`]), the others load.
fn load_parts(config: &Config) -> Loaded {
    let logged = |e: ConfigError| {
        tracing::error!(error = %e, "TLS files failed to load; those TLS connections will fail");
        e.to_string()
    };
    Loaded {
        upstream: client(&config.upstream.tls, UPSTREAM_TLS_KEYS).map_err(logged),
        quorum: quorum_client(config).map_err(logged),
        sentinel: sentinel_client(config).map_err(logged),
        listener: listener(config).map_err(logged).ok().flatten(),
        handshake_timeout: Duration::from_millis(config.proxy.tls.handshake_timeout_ms),
    }
}

/// The TLS configurations in force, shared by the listener and every
/// connector, swapped whole on reload.
#[derive(Debug)]
pub struct TlsStore {
    current: RwLock<Arc<Loaded>>,
    /// Limits the warnings about failed client handshakes.
    pub warn: RateLimit,
}

impl TlsStore {
    /// The store for `config` (already validated). Should a file have
    /// become unreadable since, the error is logged and the TLS connections
    /// that need it fail; the others are unaffected.
    pub fn new(config: &Config) -> TlsStore {
        TlsStore {
            current: RwLock::new(Arc::new(load_parts(config))),
            warn: RateLimit::new(Duration::from_secs(10)),
        }
    }

    /// What is in force now.
    pub fn current(&self) -> Arc<Loaded> {
        match self.current.read() {
            Ok(c) => c.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Puts `loaded` in force for every later handshake and connection.
    pub fn replace(&self, loaded: Loaded) {
        match self.current.write() {
            Ok(mut c) => *c = Arc::new(loaded),
            Err(poisoned) => *poisoned.into_inner() = Arc::new(loaded),
        }
    }

    /// How to connect to `side`'s Redis now.
    pub fn client(&self, side: Side) -> ClientTls {
        let c = self.current();
        match side {
            Side::Upstream => c.upstream.clone(),
            Side::Quorum => c.quorum.clone(),
            Side::Sentinel => c.sentinel.clone(),
        }
    }

    /// Runs the server side of a client's handshake, bounded by
    /// `proxy.tls.handshake_timeout_ms` and `shutdown`; counts the outcome
    /// and logs a failure (rate-limited). `None`: the connection is closed.
    pub async fn accept(
        &self,
        tcp: TcpStream,
        peer: SocketAddr,
        metrics: &ProxyMetrics,
        shutdown: &CancellationToken,
    ) -> Option<Stream> {
        let loaded = self.current();
        let result = match &loaded.listener {
            None => Err(TlsError::NoCertificate),
            Some(server) => {
                let acceptor = tokio_rustls::TlsAcceptor::from(server.clone());
                let timeout = loaded.handshake_timeout;
                tokio::select! {
                    _ = shutdown.cancelled() => return None,
                    done = tokio::time::timeout(timeout, acceptor.accept(tcp)) => match done {
                        Err(_) => Err(TlsError::Timeout(timeout.as_millis() as u64)),
                        Ok(Err(e)) => Err(TlsError::Handshake(e)),
                        Ok(Ok(tls)) => Ok(tls),
                    },
                }
            }
        };
        match result {
            Ok(tls) => {
                ProxyMetrics::inc(&metrics.tls_handshakes);
                Some(Stream::Tls(Box::new(tokio_rustls::TlsStream::Server(tls))))
            }
            Err(e) => {
                ProxyMetrics::inc(match e {
                    TlsError::Timeout(_) => &metrics.tls_handshake_timeouts,
                    _ => &metrics.tls_handshake_failures,
                });
                metrics.error(e.source_kind());
                if let Some(more) = self.warn.check() {
                    tracing::warn!(%peer, error = %e, suppressed = more, "TLS client refused; connection closed");
                }
                None
            }
        }
    }
}

/// The name to verify for `addr` (`HOST:PORT`, `[v6]:PORT`): `server_name`
/// when set, else the host.
pub fn server_name(side: &ClientSide, addr: &str) -> Result<ServerName<'static>, String> {
    if let Some(name) = &side.server_name {
        return Ok(name.clone());
    }
    let host = match addr.rsplit_once(':') {
        Some((host, _)) => host,
        None => addr,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(host.to_string()).map_err(|e| format!("server name `{host}`: {e}"))
}

#[cfg(test)]
mod tests {
    use crate::config::{ClientTlsConfig, Config, ConfigError};

    /// A TLS file that cannot be read is refused before anything starts,
    /// naming its key (the Sentinel's own section here).
    #[test]
    fn a_missing_file_names_its_key() {
        let mut c = Config::default();
        c.upstream.sentinel.addrs = vec!["127.0.0.1:26379".to_string()];
        c.upstream.sentinel.master_name = "m".to_string();
        assert!(super::load(&c).is_ok());
        c.upstream.sentinel.tls = Some(ClientTlsConfig {
            enabled: true,
            ca_file: "/nonexistent/ca.pem".to_string(),
            ..Default::default()
        });
        assert!(c.validate().is_ok(), "the files are not config's to read");
        match super::load(&c) {
            Err(ConfigError::Invalid { key, .. }) => {
                assert_eq!(key, "upstream.sentinel.tls.ca_file")
            }
            other => panic!("{:?}", other.map(|_| ())),
        }
    }
}
