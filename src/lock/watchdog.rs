//! Work on locks that no client command carries: the watchdog renewing the
//! leases of opted-in locks while their connection lives, and the release
//! of locks whose connection closed (`release_on_disconnect`). Both go over
//! one connection of lockgate's own to the primary ([`Background`]), never
//! over a client's, whose state (MULTI, blocking commands) must not be
//! disturbed.

use std::sync::Mutex;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::lease::{ConnLocks, Standing};
use super::{owner_key, script, LockService};
use crate::config::UpstreamConfig;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode;
use crate::protocol::reply::ReplyScanner;
use crate::upstream;

/// Why a background call failed.
#[derive(Debug, thiserror::Error)]
pub enum BackgroundError {
    /// The primary could not be reached.
    #[error(transparent)]
    Connect(#[from] upstream::UpstreamError),
    /// The connection failed mid-call or timed out.
    #[error("background connection: {0}")]
    Io(String),
    /// Redis answered with an error.
    #[error("background call refused: {0}")]
    Refused(String),
}

/// lockgate's own connection to the primary: one request at a time,
/// reconnected on demand, authenticated with `upstream.username/password`.
#[derive(Debug)]
pub struct Background {
    config: UpstreamConfig,
    conn: tokio::sync::Mutex<Option<TcpStream>>,
}

impl Background {
    /// A background client for the primary in `config` (not connected yet).
    pub fn new(config: &UpstreamConfig) -> Background {
        Background {
            config: config.clone(),
            conn: tokio::sync::Mutex::new(None),
        }
    }

    /// Sends one command and returns its raw reply; the connection is
    /// dropped after any failure so the next call starts clean.
    pub async fn call(&self, command: &[u8]) -> Result<Vec<u8>, BackgroundError> {
        let timeout = Duration::from_millis(self.config.connect_timeout_ms.max(1000));
        let mut guard = self.conn.lock().await;
        if guard.is_none() {
            let mut stream = upstream::connect(&self.config.addr, timeout).await?;
            if !self.config.password.is_empty() {
                let mut args: Vec<&[u8]> = vec![b"AUTH"];
                if !self.config.username.is_empty() {
                    args.push(self.config.username.as_bytes());
                }
                args.push(self.config.password.as_bytes());
                let reply = exchange(&mut stream, &encode::command(&args), timeout).await?;
                if reply.first() == Some(&b'-') {
                    return Err(BackgroundError::Refused(
                        String::from_utf8_lossy(&reply).trim().to_string(),
                    ));
                }
            }
            *guard = Some(stream);
        }
        let Some(stream) = guard.as_mut() else {
            return Err(BackgroundError::Io("not connected".to_string()));
        };
        match exchange(stream, command, timeout).await {
            Ok(reply) => Ok(reply),
            Err(e) => {
                *guard = None;
                Err(e)
            }
        }
    }
}

async fn exchange(
    stream: &mut TcpStream,
    command: &[u8],
    timeout: Duration,
) -> Result<Vec<u8>, BackgroundError> {
    let io = async {
        stream.write_all(command).await?;
        let mut buf = BytesMut::with_capacity(256);
        let mut scanner = ReplyScanner::new(64);
        let mut pos = 0;
        loop {
            if stream.read_buf(&mut buf).await? == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
            }
            loop {
                let (used, end) = scanner
                    .advance(&buf[pos..])
                    .map_err(|e| std::io::Error::other(e.to_string()))?;
                pos += used;
                match end {
                    Some(_) => return Ok(buf[..pos].to_vec()),
                    None if used == 0 => break,
                    None => {}
                }
            }
        }
    };
    match tokio::time::timeout(timeout, io).await {
        Ok(Ok(reply)) => Ok(reply),
        Ok(Err(e)) => Err(BackgroundError::Io(e.to_string())),
        Err(_) => Err(BackgroundError::Io("timed out".to_string())),
    }
}

/// Renews, every tick, the held locks of one connection whose pattern has
/// `watchdog = true`, each until `max_hold_ms` after it was acquired.
/// Returns never; the session drops it when the connection ends.
pub async fn run(service: &LockService, background: &Background, conn: &Mutex<ConnLocks>) {
    loop {
        let due = renewals(service, conn);
        let tick = due
            .iter()
            .map(|r| Duration::from_millis((r.lease_ms / 3).max(10)))
            .min()
            .unwrap_or(Duration::from_millis(service.tick_ms()));
        for Due {
            key,
            token,
            value,
            lease_ms,
        } in due
        {
            let lease_s = lease_ms.to_string();
            let owner = owner_key(&key);
            let cmd = encode::command(&[
                b"EVAL",
                script::RENEW.as_bytes(),
                b"2",
                &key,
                &owner,
                &token,
                lease_s.as_bytes(),
                &value,
            ]);
            match background.call(&cmd).await {
                Ok(reply) if reply.as_slice() == b":1\r\n" => {
                    ProxyMetrics::inc(&service.metrics.watchdog_renewals);
                }
                Ok(_) => {
                    if let Ok(mut c) = conn.lock() {
                        c.settle(&key, &token, Standing::Lost, None);
                    }
                }
                Err(e) => tracing::debug!(error = %e, "watchdog renewal failed"),
            }
        }
        tokio::time::sleep(tick).await;
    }
}

/// A held lock due for background work.
struct Due {
    key: Bytes,
    token: Bytes,
    value: Bytes,
    lease_ms: u64,
}

/// Held watchdog locks still within their `max_hold_ms`.
fn renewals(service: &LockService, conn: &Mutex<ConnLocks>) -> Vec<Due> {
    let Ok(c) = conn.lock() else {
        return Vec::new();
    };
    c.held()
        .filter_map(|(key, a)| {
            let o = service.override_for(key)?;
            (o.watchdog && (a.since.elapsed().as_millis() as u64) < o.max_hold_ms).then(|| Due {
                key: key.clone(),
                token: a.token.clone(),
                value: a.value.clone(),
                lease_ms: service.lease_ms(key),
            })
        })
        .collect()
}

/// Releases, by exact token, the held locks of a closed connection whose
/// pattern has `release_on_disconnect = true`.
pub async fn release_on_disconnect(
    service: &LockService,
    background: &Background,
    conn: &Mutex<ConnLocks>,
) {
    let due: Vec<Due> = match conn.lock() {
        Ok(c) => c
            .held()
            .filter(|(key, _)| {
                service
                    .override_for(key)
                    .is_some_and(|o| o.release_on_disconnect)
            })
            .map(|(k, a)| Due {
                key: k.clone(),
                token: a.token.clone(),
                value: a.value.clone(),
                lease_ms: a.lease_ms,
            })
            .collect(),
        Err(_) => return,
    };
    for Due {
        key, token, value, ..
    } in due
    {
        let owner = owner_key(&key);
        let cmd = encode::command(&[
            b"EVAL",
            script::RELEASE_TOKEN.as_bytes(),
            b"2",
            &key,
            &owner,
            &token,
            &value,
        ]);
        match background.call(&cmd).await {
            Ok(reply) if reply.as_slice() == b":1\r\n" => {
                ProxyMetrics::inc(&service.metrics.released_on_disconnect);
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, key = %String::from_utf8_lossy(&key), "release on disconnect failed; the lease will expire")
            }
        }
    }
}
