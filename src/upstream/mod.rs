//! How lockgate reaches Redis. Every connection it opens to Redis (the
//! sessions' to the primary, lockgate's own to the primary and to the lock
//! masters) goes through [`Connector::connect`]: TCP with a timeout, then
//! TLS when configured, and a precise reason when it fails. lockgate's own
//! connections are [`node`]: one shared, pipelined connection per Redis
//! (the primary, each lock master), re-established with back-off, every
//! call bounded. Which Redis is the primary now, its switches and the
//! failover hold are [`Primary`] ([`primary`]). With `proxy.upstream =
//! "shared"`, sessions' plain commands share a few connections
//! ([`shared`]). Every one of these pipelined connections (lockgate's
//! own, the shared ones, a cluster node's lanes) is served by one loop,
//! [`link`]: batched writes, one FIFO of owed replies, the owed answered
//! when it ends; each kind says only what a job is and where its replies
//! go. When a connection that carries lock commands has gone silent too
//! long is [`stall`]'s rule, shared by the cluster's lanes, the shared
//! connections and the sessions' own.

pub mod backoff;
pub mod cluster;
pub(crate) mod link;
pub mod node;
pub mod primary;
pub mod shared;
pub(crate) mod stall;
pub mod stream;
#[cfg(test)]
pub(crate) mod testing;
pub use primary::Primary;

use std::io;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpStream;

use crate::error::ErrorSource;
use crate::tls::{Side, Stream, TlsStore};

/// Why the primary could not be reached. Displayed inside the client's error:
/// `-ERR lockgate: upstream 127.0.0.1:6379 unavailable (connection refused)`.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// No connection within `upstream.connect_timeout_ms`.
    #[error("upstream {addr} unavailable (connect timed out after {ms} ms)")]
    Timeout {
        /// The configured upstream address.
        addr: String,
        /// The timeout that ran out.
        ms: u64,
    },
    /// The OS refused or failed the connection.
    #[error("upstream {addr} unavailable ({reason})")]
    Io {
        /// The configured upstream address.
        addr: String,
        /// Short lowercase reason, e.g. `connection refused`.
        reason: String,
    },
    /// Following Sentinel, and no primary is confirmed now.
    #[error("upstream unavailable (no primary confirmed by the sentinels for master `{master}`)")]
    NoPrimary {
        /// `upstream.sentinel.master_name`.
        master: String,
    },
    /// TCP connected but TLS failed (certificate, name, protocol).
    #[error("upstream {addr} unavailable (TLS: {reason})")]
    Tls {
        /// The configured upstream address.
        addr: String,
        /// What rustls or the certificate files said.
        reason: String,
    },
}

impl UpstreamError {
    /// Always the upstream's side.
    pub fn source_kind(&self) -> ErrorSource {
        ErrorSource::Upstream
    }
}

/// Opens connections to one kind of Redis (the primary or the lock
/// masters) with the TLS settings in force at each connect.
#[derive(Debug, Clone)]
pub struct Connector {
    tls: Arc<TlsStore>,
    side: Side,
}

impl Connector {
    /// A connector for `side`, reading its TLS settings from `tls`.
    pub fn new(tls: Arc<TlsStore>, side: Side) -> Connector {
        Connector { tls, side }
    }

    /// Connects to `addr`; TCP and the TLS handshake together within
    /// `timeout`.
    pub async fn connect(&self, addr: &str, timeout: Duration) -> Result<Stream, UpstreamError> {
        let tls_error = |reason: String| UpstreamError::Tls {
            addr: addr.to_string(),
            reason,
        };
        let side = self.tls.client(self.side).map_err(tls_error)?;
        let Some(side) = side else {
            return connect(addr, timeout).await.map(Stream::Plain);
        };
        let name = crate::tls::server_name(&side, addr).map_err(tls_error)?;
        let started = tokio::time::Instant::now();
        let tcp = connect(addr, timeout).await?;
        let connector = tokio_rustls::TlsConnector::from(side.config);
        match tokio::time::timeout_at(started + timeout, connector.connect(name, tcp)).await {
            Err(_) => Err(UpstreamError::Timeout {
                addr: addr.to_string(),
                ms: timeout.as_millis() as u64,
            }),
            Ok(Err(e)) => Err(tls_error(e.to_string())),
            Ok(Ok(tls)) => Ok(Stream::Tls(Box::new(tokio_rustls::TlsStream::Client(tls)))),
        }
    }
}

/// Connects to `addr` over plain TCP within `timeout`, with Nagle off
/// (replies are small and latency-bound; lockgate batches writes itself).
pub async fn connect(addr: &str, timeout: Duration) -> Result<TcpStream, UpstreamError> {
    let stream = match tokio::time::timeout(timeout, TcpStream::connect(addr)).await {
        Err(_) => {
            return Err(UpstreamError::Timeout {
                addr: addr.to_string(),
                ms: timeout.as_millis() as u64,
            })
        }
        Ok(Err(e)) => {
            return Err(UpstreamError::Io {
                addr: addr.to_string(),
                reason: reason(&e),
            })
        }
        Ok(Ok(stream)) => stream,
    };
    // Nagle only adds latency here; failure to turn it off is harmless.
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

fn reason(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::ConnectionRefused => "connection refused".to_string(),
        io::ErrorKind::TimedOut => "connect timed out".to_string(),
        _ => e.to_string().to_lowercase(),
    }
}
