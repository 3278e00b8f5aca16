//! Work on locks that no client command carries: the watchdog renewing the
//! leases of opted-in locks while their connection lives, and the release
//! of locks whose connection closed (`release_on_disconnect`). Both go over
//! lockgate's own shared connection to the primary
//! ([`crate::upstream::node::Node`]), never over a client's, whose state
//! (MULTI, blocking commands) must not be disturbed.

use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;

use super::lease::{ConnLocks, Standing};
use super::LockService;
use crate::metrics::ProxyMetrics;
use crate::script;
use crate::sync;

/// Longest wait for one renewal or release on lockgate's own connection.
const CALL_TIMEOUT: Duration = Duration::from_secs(1);

/// Renews, every tick, the held locks of one connection whose pattern has
/// `watchdog = true`, each until `max_hold_ms` after it was acquired.
/// Returns never; the session drops it when the connection ends.
pub async fn run(service: &LockService, conn: &Mutex<ConnLocks>) {
    let primary = &service.store().primary;
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
            let cmd = super::eval_on(
                script::RENEW,
                &key,
                &[],
                &[&token, lease_s.as_bytes(), &value],
            );
            match primary.call(cmd, CALL_TIMEOUT).await {
                Ok(reply) if reply.as_ref() == b":1\r\n" => {
                    ProxyMetrics::inc(&service.metrics.watchdog_renewals);
                    // The record's lease moves with it: a renewed holding
                    // has not lapsed (`Acquisition::lapsed`).
                    sync::lock(conn).extended(&key, lease_ms as i64);
                }
                Ok(_) => {
                    sync::lock(conn).settle(&key, &token, Standing::Lost, None);
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
    let c = sync::lock(conn);
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
pub async fn release_on_disconnect(service: &LockService, conn: &Mutex<ConnLocks>) {
    let primary = &service.store().primary;
    let due: Vec<Due> = sync::lock(conn)
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
        .collect();
    for Due {
        key, token, value, ..
    } in due
    {
        let cmd = super::evalsha::eval_queued(script::RELEASE_TOKEN, &key, &[&token, &value]);
        match primary.call(cmd, CALL_TIMEOUT).await {
            Ok(reply) if reply.as_ref() == b":1\r\n" => {
                ProxyMetrics::inc(&service.metrics.released_on_disconnect);
                // This instance's view follows at once (the store wakes
                // only the queue's head).
                service.storm.released(&key);
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, key = %String::from_utf8_lossy(&key), "release on disconnect failed; the lease will expire")
            }
        }
    }
}
