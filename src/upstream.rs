//! The session's connection to the primary Redis: connect with a timeout and
//! say precisely why it failed.

use std::io;
use std::time::Duration;

use tokio::net::TcpStream;

use crate::error::ErrorSource;

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
}

impl UpstreamError {
    /// Always the upstream's side.
    pub fn source_kind(&self) -> ErrorSource {
        ErrorSource::Upstream
    }
}

/// Connects to `addr` within `timeout`, with Nagle off (replies are small and
/// latency-bound; lockgate batches writes itself).
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
