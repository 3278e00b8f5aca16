//! Lock libraries' waiters woken when their own wake-up was lost.
//!
//! python-redis-lock's waiter, after a failed `SET NX`, blocks on the
//! key's signal list (`BLPOP lock-signal:<name> <timeout>`) until the
//! holder's release script pushes to it. A holder that crashed, or whose
//! lease ran out, pushes nothing: its waiters sleep out their timeout, and
//! with none asked (`BLPOP … 0`, a lock taken without `expire`) for ever,
//! though the lock is long free.
//!
//! lockgate learns who listens where from what connections do, not from
//! key names: a connection whose last attempt on a lock key lost, moments
//! ago, and that then blocks on a list, waits for that key on that list
//! ([`LockService::listening`]). Such a key is watched: every
//! `probe_interval_ms` one `PTTL` (and one `EXISTS` of the list) on
//! lockgate's own connection; once the lock key is gone and its list
//! empty, lockgate pushes the wake-up the library's release would have
//! pushed (`LPUSH <list> 1`, lapsing after `locks.wake.signal_expire_ms`),
//! counted in `lock_wake_pushes`. A waiter whose wake-up was lost wakes
//! within `probe_interval_ms` of the lock becoming free, then tries again
//! as its library does. A push nobody took (no waiter blocked any more)
//! ends the watch; so does `locks.wake.listen_max_ms` after the last wait
//! seen (or the wait's own timeout, if shorter).
//!
//! Bounded: at most `locks.wake.max_keys` keys watched (one more is not,
//! counted in `lock_wake_keys_full`). A spurious push costs a waiter one
//! more failed attempt, never a lock: who holds the key is still decided
//! by the acquisition in Redis. Not on the quorum (the lock keys live on
//! the masters, the lists on the primary).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dashmap::DashMap;
use tokio_util::sync::CancellationToken;

use super::keys::KeyHasher;
use super::LockService;
use crate::config::WakeConfig;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode;

/// One watched lock key.
#[derive(Debug, Clone)]
struct Watch {
    /// The list its waiters block on.
    list: Bytes,
    /// Watched until then (the last wait seen, plus its timeout or
    /// `listen_max_ms`).
    until: Instant,
    /// lockgate pushed a wake-up at the last probe: if the key is still
    /// free and the list still holds it, nobody is waiting.
    pushed: bool,
}

/// The keys watched for waiters (see the module doc).
#[derive(Debug)]
pub(crate) struct Watched {
    table: DashMap<Bytes, Watch, KeyHasher>,
    config: WakeConfig,
}

/// What one probe of a watched key found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Probe {
    /// The lock key is there: its waiters wait rightly.
    Held,
    /// The key is free and its list empty: push a wake-up.
    Push,
    /// The key is free and the list holds a wake-up not taken yet.
    Pending,
    /// The key is free and the wake-up lockgate pushed is still there:
    /// nobody waits; the watch ends.
    Idle,
}

impl Probe {
    /// The rule: from the lock key's `PTTL` reply, whether its list
    /// exists, and whether lockgate pushed at the last probe.
    pub(crate) fn of(pttl: i64, list_exists: bool, pushed: bool) -> Probe {
        match (pttl, list_exists, pushed) {
            (p, _, _) if p != -2 => Probe::Held,
            (_, false, _) => Probe::Push,
            (_, true, true) => Probe::Idle,
            (_, true, false) => Probe::Pending,
        }
    }
}

impl Watched {
    /// An empty table for `config`.
    pub(crate) fn new(config: &WakeConfig) -> Watched {
        Watched {
            table: DashMap::with_hasher(KeyHasher::new()),
            config: config.clone(),
        }
    }

    /// How many keys are watched now.
    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }
}

/// The timeout argument of a blocking pop, in seconds (`0`: none).
fn timeout_of(arg: &[u8]) -> Option<f64> {
    std::str::from_utf8(arg).ok()?.parse::<f64>().ok()
}

impl LockService {
    /// A connection whose records are `conn` sent a blocking pop
    /// (`BLPOP`/`BRPOP`, `args` as sent): if it waits on one list and its
    /// last attempt on a lock key lost within `spin_window_ms`, that key's
    /// waiters listen there, and the key is watched (see the module doc).
    pub(crate) fn listening(
        &self,
        conn: &std::sync::Mutex<super::lease::ConnLocks>,
        args: &[&[u8]],
    ) {
        let watched = &self.wake;
        if watched.config.max_keys == 0 || self.on_masters() {
            return;
        }
        let [name, list, timeout] = args else {
            return;
        };
        if !name.eq_ignore_ascii_case(b"BLPOP") && !name.eq_ignore_ascii_case(b"BRPOP") {
            return;
        }
        let Some(secs) = timeout_of(timeout) else {
            return;
        };
        let window = Duration::from_millis(self.rules().spin_window_ms());
        let Some(key) = crate::sync::lock(conn).last_lost(window) else {
            return;
        };
        let most = Duration::from_millis(watched.config.listen_max_ms);
        let asked = Duration::try_from_secs_f64(secs).unwrap_or(most);
        let listen = match asked.is_zero() {
            true => most,
            false => asked.min(most),
        };
        let watch = Watch {
            list: Bytes::copy_from_slice(list),
            until: Instant::now() + listen,
            pushed: false,
        };
        if let Some(mut w) = watched.table.get_mut(&key) {
            *w = watch;
            return;
        }
        if watched.table.len() >= watched.config.max_keys {
            ProxyMetrics::inc(&self.metrics.wake_keys_full);
            return;
        }
        watched.table.insert(key, watch);
    }

    /// One round over the watched keys: each probed, a wake-up pushed
    /// where the rule says so, lapsed watches dropped.
    async fn probe_watched(&self) {
        let now = Instant::now();
        self.wake.table.retain(|_, w| w.until > now);
        let due: Vec<(Bytes, Watch)> = (self.wake.table.iter())
            .map(|e| (e.key().clone(), e.value().clone()))
            .collect();
        let store = self.store();
        let timeout = store.timeout();
        for (key, watch) in due {
            let pttl = store
                .primary
                .send(encode::command(&[b"PTTL", &key]).into(), timeout);
            let exists = store
                .primary
                .send(encode::command(&[b"EXISTS", &watch.list]).into(), timeout);
            let (Ok(pttl), Ok(exists)) = tokio::join!(pttl, exists) else {
                continue;
            };
            let (Some(pttl), Some(exists)) = (integer(&pttl), integer(&exists)) else {
                continue;
            };
            let pushed = match Probe::of(pttl, exists == 1, watch.pushed) {
                Probe::Held | Probe::Pending => false,
                Probe::Idle => {
                    self.wake.table.remove(&key);
                    continue;
                }
                Probe::Push => {
                    let ms = self.wake.config.signal_expire_ms.to_string();
                    let push = encode::command(&[b"LPUSH", &watch.list, b"1"]);
                    let expire = encode::command(&[b"PEXPIRE", &watch.list, ms.as_bytes()]);
                    let pushed = store.primary.send(push.into(), timeout);
                    let lapses = store.primary.send(expire.into(), timeout);
                    let (pushed, _) = tokio::join!(pushed, lapses);
                    let ok = pushed.as_deref().ok().and_then(integer).is_some();
                    if ok {
                        ProxyMetrics::inc(&self.metrics.wake_pushes);
                    }
                    ok
                }
            };
            if let Some(mut w) = self.wake.table.get_mut(&key) {
                w.pushed = pushed;
            }
        }
    }
}

/// A RESP integer reply's value.
fn integer(frame: &[u8]) -> Option<i64> {
    let body = frame.strip_prefix(b":")?.strip_suffix(b"\r\n")?;
    std::str::from_utf8(body).ok()?.parse().ok()
}

/// Starts the watch loop: a round every `probe_interval_ms` (at least
/// 10 ms) while any key is watched, until `stop`.
pub(crate) fn spawn(locks: Arc<LockService>, stop: CancellationToken) {
    tokio::spawn(async move {
        loop {
            let every = Duration::from_millis(locks.rules().retry.probe_interval_ms.max(10));
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = stop.cancelled() => return,
            }
            if locks.wake.len() > 0 {
                tokio::select! {
                    _ = locks.probe_watched() => {}
                    _ = stop.cancelled() => return,
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_rule_as_a_table() {
        // (PTTL of the lock key, its list exists, pushed last time) → what.
        let table = [
            ((5_000, false, false), Probe::Held),
            ((-1, false, false), Probe::Held),
            ((5_000, true, true), Probe::Held),
            ((-2, false, false), Probe::Push),
            ((-2, false, true), Probe::Push),
            ((-2, true, false), Probe::Pending),
            ((-2, true, true), Probe::Idle),
        ];
        for ((pttl, exists, pushed), want) in table {
            assert_eq!(
                Probe::of(pttl, exists, pushed),
                want,
                "{pttl} {exists} {pushed}"
            );
        }
    }

    #[test]
    fn timeouts_and_integers_read_as_redis_writes_them() {
        assert_eq!(timeout_of(b"0"), Some(0.0));
        assert_eq!(timeout_of(b"1.5"), Some(1.5));
        assert_eq!(timeout_of(b"x"), None);
        assert_eq!(integer(b":-2\r\n"), Some(-2));
        assert_eq!(integer(b":1\r\n"), Some(1));
        assert_eq!(integer(b"-ERR no\r\n"), None);
    }
}
