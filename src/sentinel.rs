//! Following the primary through Redis Sentinel: at start and every
//! `recheck_interval_ms` (at once on a `+switch-master` message), ask the
//! sentinels for the master's address (`SENTINEL get-master-addr-by-name`),
//! and confirm it with `ROLE` before putting it in force
//! ([`Primary::confirm`]; which Redis is the primary, its switches and the
//! failover hold are [`crate::upstream::Primary`]'s). Every sentinel is
//! subscribed to for `+switch-master`, so a switch is followed within a
//! round trip of the message, and a missed message costs at most the
//! recheck interval.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::protocol::encode;
use crate::upstream::backoff::{self, Backoff};
use crate::upstream::node::{connect_authenticated, handshake, messages, request, NodeConfig};
use crate::upstream::{Connector, Primary};

/// Why an exchange with a sentinel or a candidate primary failed: always
/// the upstream's side (logged, never shown to a client).
#[derive(Debug, thiserror::Error)]
pub enum SentinelError {
    /// The sentinel could not be reached or hung up.
    #[error("sentinel {addr}: {reason}")]
    Sentinel {
        /// The sentinel.
        addr: String,
        /// What failed.
        reason: String,
    },
    /// The sentinel does not know the master.
    #[error("sentinel {addr} does not know master `{name}`")]
    Unknown {
        /// The sentinel.
        addr: String,
        /// `master_name`.
        name: String,
    },
    /// The candidate could not be asked its role.
    #[error("candidate primary {addr}: {reason}")]
    Candidate {
        /// The address the sentinels gave.
        addr: String,
        /// What failed.
        reason: String,
    },
}

/// What the follower needs: the sentinels' settings and how to reach them
/// and the candidates.
#[derive(Debug, Clone)]
struct Follower {
    name: String,
    /// One `NodeConfig` per sentinel (their credentials and connector).
    sentinels: Vec<NodeConfig>,
    /// For `ROLE` on a candidate (the primary's credentials and connector).
    candidate: NodeConfig,
    recheck: Duration,
}

/// Starts following the master of `config.upstream.sentinel` for
/// `primary`, until `stop`.
pub fn spawn(
    config: &Config,
    primary: Arc<Primary>,
    sentinels: Connector,
    upstream: Connector,
    stop: CancellationToken,
) {
    let s = &config.upstream.sentinel;
    let follower = Arc::new(Follower {
        name: s.master_name.clone(),
        sentinels: s
            .addrs
            .iter()
            .map(|addr| NodeConfig {
                username: s.username.clone(),
                password: s.password.clone(),
                ..NodeConfig::for_addr(config, addr, sentinels.clone())
            })
            .collect(),
        candidate: NodeConfig::for_addr(config, "", upstream),
        recheck: Duration::from_millis(s.recheck_interval_ms),
    });
    let wake = Arc::new(Notify::new());
    for sentinel in &follower.sentinels {
        let (f, p, w, sentinel) = (
            follower.clone(),
            primary.clone(),
            wake.clone(),
            sentinel.clone(),
        );
        let stop = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = subscribe_loop(&f, &sentinel, &p, &w) => {}
            }
        });
    }
    tokio::spawn(async move {
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = check_loop(&follower, &primary, &wake) => {}
        }
    });
}

async fn check_loop(f: &Follower, primary: &Primary, wake: &Notify) {
    loop {
        check(f, primary).await;
        // A message arriving while checking is kept by Notify (one permit):
        // the next check then runs at once.
        let _ = tokio::time::timeout(f.recheck, wake.notified()).await;
    }
}

/// Asks every sentinel at once (each bounded by the connect timeout) and
/// tries the addresses they give, the one most of them name first (the
/// primary in force first among equals, so a lagging sentinel cannot make
/// lockgate flap); the first that `ROLE` confirms as a master is put in
/// force.
async fn check(f: &Follower, primary: &Primary) {
    let answers =
        futures_util::future::join_all(f.sentinels.iter().map(|s| master_addr(f, s))).await;
    let mut last_error = None;
    let mut named: Vec<(String, usize)> = Vec::new();
    for answer in answers {
        match answer {
            Ok(addr) => match named.iter_mut().find(|(a, _)| *a == addr) {
                Some((_, n)) => *n += 1,
                None => named.push((addr, 1)),
            },
            Err(e) => {
                primary
                    .metrics
                    .sentinel_errors
                    .fetch_add(1, Ordering::Relaxed);
                last_error = Some(e);
            }
        }
    }
    let current = primary.addr();
    named.sort_by_key(|(addr, n)| {
        (
            std::cmp::Reverse(*n),
            current.as_deref() != Some(addr.as_str()),
        )
    });
    for (addr, _) in named {
        match role(f, &addr).await {
            Ok(role) if role == "master" => {
                primary.confirm(&addr);
                return;
            }
            Ok(role) => {
                // A demoted primary must not keep taking writes.
                primary.withdraw(&addr, &format!("ROLE says {role}"));
                last_error = Some(SentinelError::Candidate {
                    addr,
                    reason: format!("ROLE says {role}, not master"),
                });
            }
            Err(e) => last_error = Some(e),
        }
    }
    if let Some(e) = last_error {
        if let Some(more) = primary.warn.check() {
            tracing::warn!(error = %e, suppressed = more, "no primary confirmed by this round of sentinel checks");
        }
    }
}

/// `SENTINEL get-master-addr-by-name` on one sentinel.
async fn master_addr(f: &Follower, sentinel: &NodeConfig) -> Result<String, SentinelError> {
    let failed = |reason: String| SentinelError::Sentinel {
        addr: sentinel.addr.clone(),
        reason,
    };
    let mut stream = connect_authenticated(sentinel).await.map_err(failed)?;
    let ask = encode::command(&[b"SENTINEL", b"get-master-addr-by-name", f.name.as_bytes()]);
    let reply = request(&mut stream, &ask, sentinel.connect_timeout)
        .await
        .map_err(failed)?;
    let parts = bulks(&reply);
    match parts.as_slice() {
        [host, port] => Ok(join(host, port)),
        _ if reply.first() == Some(&b'-') => {
            Err(failed(String::from_utf8_lossy(&reply).trim().to_string()))
        }
        _ => Err(SentinelError::Unknown {
            addr: sentinel.addr.clone(),
            name: f.name.clone(),
        }),
    }
}

/// The first element of `ROLE` on `addr` (`master`, `slave`, `sentinel`).
async fn role(f: &Follower, addr: &str) -> Result<String, SentinelError> {
    let config = NodeConfig {
        addr: addr.to_string(),
        ..f.candidate.clone()
    };
    let failed = |reason: String| SentinelError::Candidate {
        addr: addr.to_string(),
        reason,
    };
    let mut stream = handshake(&config).await.map_err(failed)?;
    let reply = request(
        &mut stream,
        &encode::command(&[b"ROLE"]),
        config.connect_timeout,
    )
    .await
    .map_err(failed)?;
    match bulks(&reply).into_iter().next() {
        Some(role) => Ok(String::from_utf8_lossy(&role).into_owned()),
        None => Err(failed(String::from_utf8_lossy(&reply).trim().to_string())),
    }
}

/// Subscribes to `+switch-master` on one sentinel, reconnecting with
/// back-off; a message for our master wakes the checker.
async fn subscribe_loop(f: &Follower, sentinel: &NodeConfig, primary: &Primary, wake: &Notify) {
    let mut backoff = Backoff::new(backoff::OWN_FIRST);
    loop {
        if let Err(e) = subscribed(f, sentinel, primary, wake, &mut backoff).await {
            primary
                .metrics
                .sentinel_errors
                .fetch_add(1, Ordering::Relaxed);
            tracing::debug!(sentinel = %sentinel.addr, error = %e, "sentinel subscription interrupted");
        }
        tokio::time::sleep(backoff.next()).await;
    }
}

async fn subscribed(
    f: &Follower,
    sentinel: &NodeConfig,
    primary: &Primary,
    wake: &Notify,
    backoff: &mut Backoff,
) -> Result<(), String> {
    let stream = connect_authenticated(sentinel).await?;
    messages(
        stream,
        b"+switch-master",
        backoff,
        || {},
        |payload| {
            // `<name> <old-ip> <old-port> <new-ip> <new-port>`
            let text = String::from_utf8_lossy(payload);
            if text.split(' ').next() == Some(f.name.as_str()) {
                primary
                    .metrics
                    .switch_messages
                    .fetch_add(1, Ordering::Relaxed);
                tracing::info!(sentinel = %sentinel.addr, message = %text, "+switch-master");
                wake.notify_one();
            }
        },
    )
    .await
}

/// The line at the start of `buf` (without CRLF) and what follows it.
fn line(buf: &[u8]) -> Option<(&[u8], &[u8])> {
    memchr::memchr(b'\n', buf).map(|nl| (&buf[..nl.saturating_sub(1)], &buf[nl + 1..]))
}

fn join(host: &[u8], port: &[u8]) -> String {
    let host = String::from_utf8_lossy(host);
    let port = String::from_utf8_lossy(port);
    match host.contains(':') {
        true => format!("[{host}]:{port}"),
        false => format!("{host}:{port}"),
    }
}

/// The bulk strings among the top-level elements of an array reply (other
/// elements and nested arrays are skipped); empty for anything else.
fn bulks(reply: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let Some(rest) = reply.strip_prefix(b"*") else {
        return out;
    };
    let Some((count, mut rest)) = line(rest) else {
        return out;
    };
    let Some(count) = std::str::from_utf8(count)
        .ok()
        .and_then(|c| c.parse::<i64>().ok())
    else {
        return out;
    };
    for _ in 0..count.max(0) {
        match rest.first() {
            Some(b'$') => {
                let Some((len, body)) = line(&rest[1..]) else {
                    return out;
                };
                let Some(len) = std::str::from_utf8(len)
                    .ok()
                    .and_then(|l| l.parse::<usize>().ok())
                else {
                    return out;
                };
                let Some(data) = body.get(..len) else {
                    return out;
                };
                out.push(data.to_vec());
                rest = body.get(len + 2..).unwrap_or_default();
            }
            Some(b':') | Some(b'+') => match line(rest) {
                Some((_, more)) => rest = more,
                None => return out,
            },
            // A nested array (ROLE's replica list) comes last: stop.
            _ => return out,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_of_sentinel_and_role() {
        let addr = b"*2\r\n$9\r\n127.0.0.1\r\n$4\r\n6379\r\n";
        assert_eq!(bulks(addr), vec![b"127.0.0.1".to_vec(), b"6379".to_vec()]);
        assert!(bulks(b"*-1\r\n").is_empty());
        assert!(bulks(b"$-1\r\n").is_empty());
        let master = b"*3\r\n$6\r\nmaster\r\n:42\r\n*1\r\n*3\r\n$9\r\n127.0.0.1\r\n$4\r\n6380\r\n$2\r\n42\r\n";
        assert_eq!(
            bulks(master).first().map(|r| r.as_slice()),
            Some(&b"master"[..])
        );
        let replica =
            b"*5\r\n$5\r\nslave\r\n$9\r\n127.0.0.1\r\n:6379\r\n$9\r\nconnected\r\n:42\r\n";
        assert_eq!(
            bulks(replica).first().map(|r| r.as_slice()),
            Some(&b"slave"[..])
        );
        assert_eq!(join(b"::1", b"6379"), "[::1]:6379");
    }
}
