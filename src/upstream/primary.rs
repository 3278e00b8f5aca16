//! Which Redis is the primary now. Without Sentinel it is `upstream.addr`,
//! fixed. With `[upstream.sentinel]` it is the address the sentinels give
//! for the master, confirmed with `ROLE` ([`crate::sentinel`]); until one is
//! confirmed there is none (sessions get "unavailable", `/readyz` is 503).
//!
//! Every user of the primary follows [`Primary`]: sessions are closed when
//! the primary they connected to is no longer it (their clients reconnect,
//! as after a failover of a Redis they talked to directly); lockgate's own
//! connection and the release announcements reconnect to the new one. After
//! a switch, acquisitions of lock keys on the primary are answered "not
//! acquired" for `locks.failover_delay_ms` ([`Primary::hold_left`]): a lock
//! granted on the old primary may not have been replicated.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;

use crate::metrics::{counters, RateLimit};
use crate::sync;

counters! {
    /// Counters of the primary and its Sentinel followers.
    pub struct PrimaryMetrics {
        /// 1 while a primary is confirmed, 0 otherwise.
        confirmed: Gauge "primary_confirmed", "1 while a primary is confirmed (Sentinel: by ROLE)";
        /// Times the primary changed (Sentinel failovers followed).
        switches: Counter "primary_switches", "Times the primary changed (Sentinel failovers followed)";
        /// When the primary last changed, in ms since the Unix epoch (0: never).
        last_switch_ms: TimestampMs "primary_last_switch_timestamp_seconds" as "primary_last_switch_unix_ms", "When the primary last changed (seconds since the Unix epoch, 0: never)";
        /// Client sessions closed because their primary was replaced.
        sessions_closed: Counter "primary_switch_sessions_closed", "Client sessions closed because their primary was replaced";
        /// Lock acquisitions answered "not acquired" during the failover delay.
        failover_refused: Counter "lock_failover_refused", "Lock acquisitions answered 'not acquired' during locks.failover_delay_ms after a switch";
        /// Failed exchanges with a sentinel (unreachable, error, no answer).
        sentinel_errors: Counter "sentinel_errors", "Failed exchanges with a sentinel";
        /// `+switch-master` messages received for our master.
        switch_messages: Counter "sentinel_switch_messages", "+switch-master messages received for the followed master";
    }
}

/// The primary in force: its address (`None`: none confirmed) and a
/// generation that changes whenever the address does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Current {
    /// `HOST:PORT`, or `None` while no primary is confirmed.
    pub addr: Option<Arc<str>>,
    /// Bumped at every change of `addr`.
    pub generation: u64,
}

/// The last change of primary, for the operators' views.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Switch {
    /// The primary before (`None`: none was confirmed).
    pub from: Option<Arc<str>>,
    /// The primary after.
    pub to: Arc<str>,
    /// When, as wall-clock ms since the Unix epoch.
    pub at_unix_ms: u64,
}

/// Which Redis is the primary now; shared by everything that connects to it.
#[derive(Debug)]
pub struct Primary {
    current: watch::Sender<Current>,
    /// Counters (exported with the others).
    pub metrics: PrimaryMetrics,
    last: Mutex<Option<Switch>>,
    /// When the latest switch happened (the failover delay runs from it).
    switched_at: Mutex<Option<Instant>>,
    /// Sentinel is in use (the primary can change).
    pub followed: bool,
    /// Limits the failover-delay and sentinel warnings.
    pub warn: RateLimit,
}

impl Primary {
    /// A fixed primary at `addr` (no Sentinel): confirmed from the start.
    pub fn fixed(addr: &str) -> Arc<Primary> {
        let p = Primary::new(false, Some(Arc::from(addr)));
        p.metrics.confirmed.store(1, Ordering::Relaxed);
        Arc::new(p)
    }

    /// A primary to be found through the sentinels: none confirmed yet.
    pub fn followed() -> Arc<Primary> {
        Arc::new(Primary::new(true, None))
    }

    fn new(followed: bool, addr: Option<Arc<str>>) -> Primary {
        Primary {
            current: watch::Sender::new(Current {
                addr,
                generation: 0,
            }),
            metrics: PrimaryMetrics::default(),
            last: Mutex::new(None),
            switched_at: Mutex::new(None),
            followed,
            warn: RateLimit::new(Duration::from_secs(10)),
        }
    }

    /// The primary in force.
    pub fn current(&self) -> Current {
        self.current.borrow().clone()
    }

    /// Its address, if one is confirmed.
    pub fn addr(&self) -> Option<Arc<str>> {
        self.current.borrow().addr.clone()
    }

    /// Times the primary changed.
    pub fn switches(&self) -> u64 {
        self.metrics.switches.load(Ordering::Relaxed)
    }

    /// The last switch, if any (the first confirmation included).
    pub fn last_switch(&self) -> Option<Switch> {
        sync::lock(&self.last).clone()
    }

    /// Resolves once the primary is no longer the one of `generation`.
    pub async fn changed_from(&self, generation: u64) {
        let mut rx = self.current.subscribe();
        // The sender lives as long as `self`; an error cannot happen while
        // we borrow it, and would mean "changed" anyway.
        let _ = rx.wait_for(|c| c.generation != generation).await;
    }

    /// Resolves with the primary once one is confirmed.
    pub async fn confirmed(&self) -> Current {
        let mut rx = self.current.subscribe();
        let found = rx.wait_for(|c| c.addr.is_some()).await.map(|c| c.clone());
        found.unwrap_or_else(|_| self.current())
    }

    /// `addr` was confirmed as the primary (by `ROLE`). A change of
    /// address is a switch: counted, logged, and the failover delay starts.
    pub fn confirm(&self, addr: &str) {
        let mut switch = None;
        self.current.send_if_modified(|c| {
            if c.addr.as_deref() == Some(addr) {
                return false;
            }
            let to: Arc<str> = Arc::from(addr);
            switch = Some(Switch {
                from: c.addr.clone().or_else(|| self.last_known()),
                to: to.clone(),
                at_unix_ms: unix_ms(),
            });
            c.addr = Some(to);
            c.generation += 1;
            true
        });
        self.metrics.confirmed.store(1, Ordering::Relaxed);
        let Some(switch) = switch else { return };
        // The first primary found is no switch; one that differs from the
        // last confirmed one is.
        if let Some(from) = &switch.from {
            if **from != *switch.to {
                self.metrics.switches.fetch_add(1, Ordering::Relaxed);
                self.metrics
                    .last_switch_ms
                    .store(switch.at_unix_ms, Ordering::Relaxed);
                *sync::lock(&self.switched_at) = Some(Instant::now());
                tracing::warn!(from = %from, to = %switch.to, "the primary changed; sessions on the old one are closed");
                *sync::lock(&self.last) = Some(switch);
                return;
            }
        }
        tracing::info!(primary = %switch.to, "primary confirmed");
        *sync::lock(&self.last) = Some(switch);
    }

    /// `addr` is not (or no longer) the primary: if it was in force, none
    /// is until another is confirmed, and sessions on it are closed.
    pub fn withdraw(&self, addr: &str, why: &str) {
        let withdrawn = self.current.send_if_modified(|c| {
            if c.addr.as_deref() != Some(addr) {
                return false;
            }
            c.addr = None;
            c.generation += 1;
            true
        });
        if withdrawn {
            self.metrics.confirmed.store(0, Ordering::Relaxed);
            tracing::warn!(primary = %addr, reason = why, "the primary is no longer confirmed");
        }
    }

    /// The last confirmed primary, for telling a switch from a re-confirmation
    /// after a withdrawal.
    fn last_known(&self) -> Option<Arc<str>> {
        sync::lock(&self.last).as_ref().map(|s| s.to.clone())
    }

    /// When the latest switch happened (`None`: none yet).
    pub fn switched_at(&self) -> Option<Instant> {
        *sync::lock(&self.switched_at)
    }

    /// How much of a failover delay of `delay` is left since the latest
    /// switch (`None`: no switch, or the delay is over).
    pub fn hold_left(&self, delay: Duration) -> Option<Duration> {
        let at = (*sync::lock(&self.switched_at))?;
        delay.checked_sub(at.elapsed()).filter(|d| !d.is_zero())
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_changed_address_is_a_switch_and_starts_the_hold() {
        let p = Primary::followed();
        assert_eq!(p.addr(), None);
        p.confirm("127.0.0.1:1");
        assert_eq!(p.metrics.switches.load(Ordering::Relaxed), 0);
        assert!(p.hold_left(Duration::from_secs(5)).is_none());
        let g = p.current().generation;
        p.confirm("127.0.0.1:1");
        assert_eq!(p.current().generation, g, "the same address is no change");
        p.withdraw("127.0.0.1:1", "test");
        assert_eq!(p.addr(), None);
        p.confirm("127.0.0.1:2");
        assert_eq!(p.metrics.switches.load(Ordering::Relaxed), 1);
        assert!(p.hold_left(Duration::from_secs(5)).is_some());
        assert!(p.hold_left(Duration::ZERO).is_none());
        let last = p.last_switch().expect("a switch");
        assert_eq!(last.from.as_deref(), Some("127.0.0.1:1"));
        assert_eq!(&*last.to, "127.0.0.1:2");
    }
}
