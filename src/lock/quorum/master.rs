//! One lock master: its connection, and whether it may vote. A master that
//! may have lost or missed locks sits out acquisitions for a while (see
//! [`SitOut`]); nothing but time (or, for an evicting policy, the policy
//! fixed) brings it back.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::young_left;
use crate::lock::eviction::{Eviction, Memory};
use crate::lock::metrics::RejoinMetrics;
use crate::metrics::ProxyMetrics;
use crate::sync;
use crate::upstream::node::Node;

/// One lock master and whether it may take part in acquisitions.
#[derive(Debug)]
pub struct Master {
    /// The shared connection.
    pub node: Node,
    /// Its eviction policy and the keys it was seen evicting, read as each
    /// connection opens and by the periodic check.
    pub memory: Arc<Memory>,
    /// Acquisitions skip this master until then, and why (the reason of
    /// the sit-out that ends last; see [`SitOut`]).
    sitting_out_until: Mutex<Option<(Instant, SitOut)>>,
    /// Its `run_id` when last seen, and the connection count then.
    seen: Mutex<(String, u64)>,
    /// The sit-out after a return, in ms (shared with the quorum, which
    /// raises it with the longest lease granted).
    rejoin_ms: Arc<AtomicU64>,
    /// The quorum's counters (sit-outs by reason).
    metrics: Arc<RejoinMetrics>,
    /// `locks.require_noeviction` in force (shared with the sessions).
    eviction: Arc<Eviction>,
    /// Sitting out for its eviction policy, as last observed.
    evicting: AtomicBool,
    /// Its `evicted_keys` growth as last observed.
    evicted_seen: AtomicU64,
}

/// Why a master sits out acquisitions for a while.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SitOut {
    /// A new `run_id`: it may have lost its locks.
    Restarted,
    /// The same `run_id` on a new connection: lockgate may have missed
    /// releases and commits while it was unreachable.
    Reconnected,
    /// lockgate's first sight of it, less than the rejoin delay after it
    /// started: it may have lost locks lockgate (or a predecessor) granted.
    Young,
    /// Its clock stepped: its keys may have expired early.
    ClockJump,
    /// With `locks.require_noeviction`: it was seen evicting keys, and a
    /// held lock key may have been among them.
    Evicted,
    /// With `locks.require_noeviction`: its `maxmemory-policy` may evict
    /// lock keys. No time bound: until the policy reads `noeviction` (or
    /// the key is turned off), which the periodic check reads again.
    Evicting,
}

impl SitOut {
    /// The reason as `LOCKGATE MASTERS`, the status page and errors name it.
    pub fn name(self) -> &'static str {
        match self {
            SitOut::Restarted => "restarted",
            SitOut::Reconnected => "reconnected",
            SitOut::Young => "started recently",
            SitOut::ClockJump => "clock jump",
            SitOut::Evicted => "evicted keys",
            SitOut::Evicting => "maxmemory-policy",
        }
    }
}

/// A master's state as operators see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MasterState {
    /// Connected and taking part.
    Up,
    /// Connected, sitting out acquisitions for this much longer, and why.
    SittingOut(Duration, SitOut),
    /// Not connected.
    Down,
}

impl Master {
    /// A master on `node`, not seen yet, whose readings go to `memory`;
    /// `rejoin_ms` and `metrics` are the quorum's, `eviction` the sessions'.
    pub fn new(
        node: Node,
        memory: Arc<Memory>,
        rejoin_ms: Arc<AtomicU64>,
        metrics: Arc<RejoinMetrics>,
        eviction: Arc<Eviction>,
    ) -> Master {
        Master {
            node,
            memory,
            sitting_out_until: Mutex::new(None),
            seen: Mutex::new((String::new(), 0)),
            rejoin_ms,
            metrics,
            eviction,
            evicting: AtomicBool::new(false),
            evicted_seen: AtomicU64::new(0),
        }
    }

    /// Up, sitting out, or down.
    pub fn state(&self) -> MasterState {
        // A new connection is noticed before anything is reported, so a
        // returning master never shows (or counts) as up before sitting out.
        self.observe(Duration::from_millis(
            self.rejoin_ms.load(Ordering::Relaxed),
        ));
        if !self.node.state.up.load(Ordering::Relaxed) {
            return MasterState::Down;
        }
        // No time bound: until its policy reads `noeviction` (or the key
        // is turned off), which the periodic check reads again.
        if self.eviction.master_refused(&self.memory) {
            return MasterState::SittingOut(Duration::ZERO, SitOut::Evicting);
        }
        let until = *sync::lock(&self.sitting_out_until);
        match until.map(|(u, why)| (u.saturating_duration_since(Instant::now()), why)) {
            Some((left, why)) if !left.is_zero() => MasterState::SittingOut(left, why),
            _ => MasterState::Up,
        }
    }

    /// Takes note of the connection as it is now: a connection newer than
    /// the one last seen (a restart, or a return after being unreachable)
    /// starts a sit-out of `rejoin_delay`. Called before every eligibility
    /// check, so a master can never count between reconnecting and being
    /// noticed.
    pub(super) fn observe(&self, rejoin_delay: Duration) {
        self.observe_eviction(rejoin_delay);
        let connects = self.node.state.connects.load(Ordering::Relaxed);
        let mut seen = sync::lock(&self.seen);
        if connects == seen.1 {
            return;
        }
        let run_id = sync::lock(&self.node.state.run_id).clone();
        // Only the very first connection may be trusted without a sit-out,
        // and only when the master had already run for the rejoin delay.
        if seen.1 == 0 && connects == 1 {
            if let Some(until) = self.young_until(rejoin_delay) {
                self.sit_out_until(until, SitOut::Young);
                tracing::warn!(
                    master = self.node.addr(),
                    sit_out_ms = until.saturating_duration_since(Instant::now()).as_millis() as u64,
                    "lock master started less than the rejoin delay ago: it sits out"
                );
            }
        } else {
            let (why, reason) = if run_id != seen.0 {
                ("restarted (new run_id)", SitOut::Restarted)
            } else {
                ("reconnected", SitOut::Reconnected)
            };
            self.sit_out_until(Instant::now() + rejoin_delay, reason);
            tracing::warn!(
                master = self.node.addr(),
                why,
                sit_out_ms = rejoin_delay.as_millis() as u64,
                "lock master sits out acquisitions before rejoining"
            );
        }
        *seen = (run_id, connects);
    }

    /// With `locks.require_noeviction`: notes a policy that may evict
    /// lock keys (the master sits out while it lasts, see
    /// [`Master::state`]) and evictions seen since the last look (it sits
    /// out `rejoin_delay` from now: every lock key it may have lost was
    /// granted before now, so its lease ends by then). The policy is read
    /// before the evictions: a reading's growth is written before its
    /// policy, so a master whose policy reads `noeviction` again never
    /// votes before the evictions of the same reading are seen.
    fn observe_eviction(&self, rejoin_delay: Duration) {
        let memory = &self.memory;
        let refused = self.eviction.master_refused(memory);
        let evicted = memory.evicted.load(Ordering::Relaxed);
        let grew = self.evicted_seen.swap(evicted, Ordering::Relaxed) < evicted;
        let required = self.eviction.required();
        if self.evicting.swap(refused, Ordering::Relaxed) != refused {
            if refused {
                ProxyMetrics::inc(&self.metrics.sit_outs_evicting);
            }
            tracing::warn!(
                master = self.node.addr(),
                policy = memory.policy_name(),
                sits_out = refused,
                "lock master's maxmemory-policy (locks.require_noeviction): {}",
                match refused {
                    true => "it sits out acquisitions until it reads noeviction",
                    false => "it may take part in acquisitions again",
                }
            );
        }
        if grew && required {
            self.sit_out_until(Instant::now() + rejoin_delay, SitOut::Evicted);
            tracing::warn!(
                master = self.node.addr(),
                policy = memory.policy_name(),
                sit_out_ms = rejoin_delay.as_millis() as u64,
                "lock master evicted keys (locks.require_noeviction): it sits out acquisitions until every lock it may have lost has expired"
            );
        }
    }

    /// Its state as the operators' views show it: `up`, `sitting out` or
    /// `down`, the ms until it votes again (0 unless it sits out, and 0
    /// for a policy, which has no end of its own), and why it sits out
    /// (empty unless it does).
    pub fn shown(&self) -> (&'static str, u64, String) {
        match self.state() {
            MasterState::Up => ("up", 0, String::new()),
            MasterState::SittingOut(left, why) => (
                "sitting out",
                left.as_millis() as u64,
                self.reason_text(why),
            ),
            MasterState::Down => ("down", 0, String::new()),
        }
    }

    /// Why it sits out, as operators and clients read it: the reason's
    /// name, and for [`SitOut::Evicting`] the policy too.
    pub fn reason_text(&self, why: SitOut) -> String {
        match why {
            SitOut::Evicting => self
                .sit_out_reason()
                .unwrap_or_else(|| why.name().to_string()),
            _ => why.name().to_string(),
        }
    }

    /// The reason a master sits out with no end yet, for the operators'
    /// views: its `maxmemory-policy` (`locks.require_noeviction`).
    pub fn sit_out_reason(&self) -> Option<String> {
        let memory = &self.memory;
        self.eviction
            .master_refused(memory)
            .then(|| format!("maxmemory-policy {}", memory.policy_name()))
    }

    /// When a master lockgate sees for the first time ends its sit-out, if
    /// it started less than `rejoin_delay` ago (`None`: it is older).
    /// Without an uptime it is taken as new.
    fn young_until(&self, rejoin_delay: Duration) -> Option<Instant> {
        let uptime = *sync::lock(&self.node.state.uptime);
        let (read_at, secs) = uptime.unwrap_or((Instant::now(), 0));
        let until = read_at + young_left(rejoin_delay, secs)?;
        (until > Instant::now()).then_some(until)
    }

    /// Sits the master out of acquisitions until `end` (or longer, if it
    /// already sits out longer), for `why`. The one sit-out of a master:
    /// restarts, reconnections, a young master at first sight and clock
    /// jumps all end up here, and it always ends: nothing but time brings a
    /// master back.
    pub fn sit_out_until(&self, end: Instant, why: SitOut) {
        {
            let mut until = sync::lock(&self.sitting_out_until);
            *until = match *until {
                Some((u, was)) if u >= end => Some((u, was)),
                _ => Some((end, why)),
            };
        }
        let counter = match why {
            SitOut::Restarted => &self.metrics.sit_outs_restarted,
            SitOut::Reconnected => &self.metrics.sit_outs_reconnected,
            SitOut::Young => &self.metrics.sit_outs_young,
            SitOut::Evicted => &self.metrics.sit_outs_evicted,
            // Counted as `lock_quorum_clock_jumps` by the clock watch, and
            // as `lock_quorum_sit_outs_evicting` where the policy is read.
            SitOut::ClockJump | SitOut::Evicting => return,
        };
        ProxyMetrics::inc(counter);
    }

    /// Sits the master out for `delay` from now because its clock jumped:
    /// its keys may have expired early (see [`super::clock`]).
    pub fn sit_out(&self, delay: Duration) {
        self.sit_out_until(Instant::now() + delay, SitOut::ClockJump);
    }
}
