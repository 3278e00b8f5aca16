//! The Redlock quorum: lock keys on N independent masters. Every operation
//! goes to all masters in parallel, each bounded by `node_timeout_ms`, and
//! the answer is the majority's. A master that restarted (new `run_id`) or
//! was unreachable sits out acquisitions for `rejoin_delay` (counting as
//! "no") while still receiving releases, so a restart without persistence
//! cannot hand a lock out twice; so does one lockgate first sees less than
//! `rejoin_delay` after it started. Nothing else holds a master back: a
//! fencing token is never below the median clock of its voters (see
//! [`fence::fence_token`]), so no counter needs copying
//! before a master votes again, and once a majority is up and past its
//! delay, acquisitions succeed whatever happened before.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio_util::sync::CancellationToken;

mod ask;
pub mod clock;
pub mod fence;
pub mod kinds;
mod master;
pub mod ops;
pub mod scripts;

pub use master::{Master, MasterState, SitOut};

use super::eviction::{Eviction, Memory, Role};
use super::metrics::RejoinMetrics;
use crate::config::{Config, QuorumConfig, QuorumLoss};
use crate::protocol::encode::LocalReply;
use crate::upstream::node::{Node, NodeConfig};

/// How often the masters' connections are checked for restarts.
const WATCH_INTERVAL: Duration = Duration::from_millis(50);

/// The quorum of lock masters.
#[derive(Debug)]
pub struct Quorum {
    /// The masters, in configuration order.
    pub masters: Vec<Arc<Master>>,
    config: QuorumConfig,
    default_lease_ms: u64,
    /// Longest lease granted so far, in ms (the default rejoin delay).
    max_lease_ms: AtomicU64,
    /// The rejoin delay in force, in ms, as the masters read it.
    rejoin_ms: Arc<AtomicU64>,
    /// Script bodies seen (EVAL, SCRIPT LOAD) by SHA1, for NOSCRIPT.
    pub scripts: dashmap::DashMap<String, Bytes>,
    /// Fence counter copies and sit-outs by reason (shared with the
    /// masters).
    pub rejoin: Arc<RejoinMetrics>,
    /// Scripts a master answered `NOSCRIPT` and ran again as `EVAL` (see
    /// [`crate::upstream::node::Request`]): lockgate's after its script
    /// cache was flushed, or a client's it never loaded.
    pub noscript_reruns: Arc<AtomicU64>,
    /// The masters' clock offsets (jumps sit a master out).
    pub clock: clock::ClockWatch,
}

/// What the masters answered to one command.
#[derive(Debug, Clone, Default)]
pub struct Answers {
    /// One entry per master that answered: its raw reply.
    pub replies: Vec<Bytes>,
    /// Masters asked.
    pub asked: usize,
}

impl Quorum {
    /// The quorum for `config`, or `None` without masters. Starts one
    /// connection task per master (and a watcher), stopped by `stop`.
    /// `connector`: how to reach the masters (plain TCP or TLS).
    pub fn start(
        config: &Config,
        stop: &CancellationToken,
        connector: &crate::upstream::Connector,
        eviction: &Arc<Eviction>,
    ) -> Option<Arc<Quorum>> {
        let noscript_reruns = Arc::new(AtomicU64::new(0));
        let node = |addr: &str, memory: &Arc<Memory>| {
            let node = NodeConfig {
                scripts: &crate::script::BODIES,
                noscript_reruns: Some(noscript_reruns.clone()),
                observer: Some(memory.clone()),
                ..NodeConfig::for_addr(config, addr, connector.clone())
            };
            Node::spawn(node, stop.clone())
        };
        let quorum = Quorum::of(config, eviction, node, noscript_reruns.clone())?;
        let sampled = quorum.clone();
        let sample_stop = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = sample_stop.cancelled() => {}
                _ = sampled.sample_clocks() => {}
            }
        });
        let watched = quorum.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = watched.watch() => {}
            }
        });
        Some(quorum)
    }

    /// The quorum for `config` (`None` without masters) whose masters are
    /// never connected and nothing watched: for a lock room looked at
    /// without Redis (see [`crate::lock::Store::offline`]).
    pub fn offline(config: &Config, eviction: &Arc<Eviction>) -> Option<Arc<Quorum>> {
        let reruns = Arc::new(AtomicU64::new(0));
        Quorum::of(config, eviction, |addr, _| Node::detached(addr), reruns)
    }

    fn of(
        config: &Config,
        eviction: &Arc<Eviction>,
        node: impl Fn(&str, &Arc<Memory>) -> Node,
        noscript_reruns: Arc<AtomicU64>,
    ) -> Option<Arc<Quorum>> {
        let q = &config.locks.quorum;
        if q.masters.is_empty() {
            return None;
        }
        let rejoin_ms = Arc::new(AtomicU64::new(match q.rejoin_delay_ms {
            0 => config.locks.default_lease_ms,
            ms => ms,
        }));
        let metrics = Arc::new(RejoinMetrics::default());
        let masters = (q.masters.iter())
            .map(|addr| {
                let memory = Arc::new(Memory::new(Role::Master));
                Arc::new(Master::new(
                    node(addr, &memory),
                    memory,
                    rejoin_ms.clone(),
                    metrics.clone(),
                    eviction.clone(),
                ))
            })
            .collect();
        Some(Arc::new(Quorum {
            masters,
            config: q.clone(),
            default_lease_ms: config.locks.default_lease_ms,
            max_lease_ms: AtomicU64::new(config.locks.default_lease_ms),
            rejoin_ms,
            scripts: dashmap::DashMap::new(),
            rejoin: metrics,
            noscript_reruns,
            clock: clock::ClockWatch::new(config),
        }))
    }

    /// N/2 + 1.
    pub fn majority(&self) -> usize {
        self.masters.len() / 2 + 1
    }

    /// The per-master timeout.
    pub fn node_timeout(&self) -> Duration {
        Duration::from_millis(self.config.node_timeout_ms)
    }

    /// How long a returning master sits out.
    pub fn rejoin_delay(&self) -> Duration {
        let ms = match self.config.rejoin_delay_ms {
            0 => self
                .max_lease_ms
                .load(Ordering::Relaxed)
                .max(self.default_lease_ms),
            ms => ms,
        };
        Duration::from_millis(ms)
    }

    /// Records a granted lease (for the default rejoin delay).
    pub fn granted(&self, lease_ms: u64) {
        self.max_lease_ms.fetch_max(lease_ms, Ordering::Relaxed);
        self.rejoin_ms
            .store(self.rejoin_delay().as_millis() as u64, Ordering::Relaxed);
    }

    /// Validity left of a lease of `lease_ms` acquired in `elapsed`, in ms.
    pub fn validity_ms(&self, lease_ms: u64, elapsed: Duration) -> i64 {
        let drift = (lease_ms as f64 * self.config.clock_drift_factor) as i64 + 2;
        lease_ms as i64 - elapsed.as_millis() as i64 - drift
    }

    /// What an acquisition answers when fewer than a majority can take part.
    pub fn loss_reply(&self, not_acquired: LocalReply) -> LocalReply {
        match self.config.on_quorum_loss {
            QuorumLoss::NotAcquired => not_acquired,
            QuorumLoss::Error => LocalReply::err(format!(
                "lockgate: lock quorum unavailable: {}",
                self.availability()
            )),
        }
    }

    /// How many masters vote, sit out (why, and until when) and are down,
    /// as clients and operators read it: `2 of 5 masters vote, 3 sit out
    /// (restarted, 0.8 s left)`. The time is until enough sit-outs end for
    /// the votes an acquisition needs, rounded up to a tenth of a second
    /// (down masters may still keep it unavailable after that).
    pub fn availability(&self) -> String {
        let (mut vote, mut down) = (0, 0);
        let mut timed: Vec<Duration> = Vec::new();
        let mut reasons: Vec<String> = Vec::new();
        let mut out = 0;
        for m in &self.masters {
            match m.state() {
                MasterState::Up => vote += 1,
                MasterState::SittingOut(left, why) => {
                    out += 1;
                    if why != SitOut::Evicting {
                        timed.push(left);
                    }
                    let reason = m.reason_text(why);
                    if !reasons.contains(&reason) {
                        reasons.push(reason);
                    }
                }
                MasterState::Down => down += 1,
            }
        }
        let mut text = format!("{vote} of {} masters vote", self.masters.len());
        if out > 0 {
            let mut until = String::new();
            if !timed.is_empty() {
                // Time-bound sit-outs only: a policy has no end of its own.
                timed.sort();
                let wanted = self
                    .votes_needed()
                    .saturating_sub(vote)
                    .clamp(1, timed.len());
                let left = timed[wanted - 1].as_millis().div_ceil(100);
                until = format!(", {}.{} s left", left / 10, left % 10);
            }
            text.push_str(&format!(", {out} sit out ({}{until})", reasons.join(", ")));
        }
        if down > 0 {
            text.push_str(&format!(", {down} down"));
        }
        text
    }

    /// Whether an acquisition that got `granted` yes out of `answered`
    /// answers, with `eligible` masters asked, lost the quorum rather than
    /// the race: fewer than the votes needed ([`Quorum::votes_needed`], a
    /// majority by default) answered in time, and the missing answers could
    /// still have made them (masters sitting out count as "no"). A majority that answered with a split vote (a master
    /// killed mid-attempt while another sits out, a holder's lease seen on
    /// some masters only) lost the race: the client is told "not acquired"
    /// and retries, as on contention.
    pub fn lost_quorum(&self, granted: usize, answered: usize, eligible: usize) -> bool {
        let (n, majority) = (self.masters.len(), self.votes_needed());
        let refused = answered.saturating_sub(granted) + n.saturating_sub(eligible);
        answered < majority && refused <= n - majority
    }

    /// What an acquisition answers when enough masters were up but fewer
    /// than a majority answered within the node timeout.
    pub fn late_reply(&self, answered: usize, not_acquired: LocalReply) -> LocalReply {
        match self.config.on_quorum_loss {
            QuorumLoss::NotAcquired => not_acquired,
            QuorumLoss::Error => self.no_quorum(answered),
        }
    }

    /// The error for a command fewer than a majority answered.
    pub fn no_quorum(&self, answered: usize) -> LocalReply {
        LocalReply::err(format!(
            "lockgate: no quorum ({answered} of {} lock masters answered)",
            self.masters.len()
        ))
    }

    /// Masters that may take part in an acquisition now ([`Master::state`]
    /// takes note of each one's connection first).
    pub fn eligible(&self) -> Vec<Arc<Master>> {
        self.masters
            .iter()
            .filter(|m| m.state() == MasterState::Up)
            .cloned()
            .collect()
    }

    /// Notices restarts (a new connection whose `run_id` changed) and
    /// outages (a lost connection), and sits those masters out.
    async fn watch(&self) {
        loop {
            let delay = self.rejoin_delay();
            for m in &self.masters {
                m.observe(delay);
            }
            tokio::time::sleep(WATCH_INTERVAL).await;
        }
    }
}

/// How much of `rejoin_delay` a master that reported `uptime_in_seconds`
/// = `secs` has left to sit out from when its reply arrived (`None`:
/// none).
// `uptime_in_seconds` is the difference of two whole-second clock readings
// (now and the start, both rounded down), so a master reporting s seconds
// may have run for just over s - 1: it is taken to have run max(s - 1, 0),
// never older than it is.
pub fn young_left(rejoin_delay: Duration, secs: u64) -> Option<Duration> {
    let ran = Duration::from_secs(secs.saturating_sub(1));
    rejoin_delay.checked_sub(ran).filter(|left| !left.is_zero())
}

/// Merges integer answers the Redlock way: the largest value a majority
/// reports at least (for TTLs, the smallest within the majority).
pub fn majority_integer(values: &[i64], majority: usize) -> Option<i64> {
    if values.len() < majority {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    sorted.get(majority - 1).copied()
}

/// The reply at least `majority` masters gave byte for byte, if any.
pub fn majority_identical(replies: &[Bytes], majority: usize) -> Option<&Bytes> {
    replies
        .iter()
        .find(|r| replies.iter().filter(|o| o == r).count() >= majority)
}

/// The integer of a `:n` reply.
pub fn integer(reply: &[u8]) -> Option<i64> {
    let digits = reply.strip_prefix(b":")?.strip_suffix(b"\r\n")?;
    crate::protocol::request::parse_int(digits)
}

/// Milliseconds since the Unix epoch, for `EXAT`/`PXAT` leases.
pub fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reported_uptime_is_taken_a_second_short() {
        let delay = Duration::from_millis(3_000);
        // 0 or 1 reported: it may have started just now.
        assert_eq!(young_left(delay, 0), Some(delay));
        assert_eq!(young_left(delay, 1), Some(delay));
        assert_eq!(young_left(delay, 2), Some(Duration::from_secs(2)));
        // 4 reported: more than 3 s run.
        assert_eq!(young_left(delay, 3), Some(Duration::from_secs(1)));
        assert_eq!(young_left(delay, 4), None);
        assert_eq!(young_left(Duration::from_millis(300), 2), None);
        assert_eq!(
            young_left(Duration::from_millis(300), 1),
            Some(Duration::from_millis(300))
        );
    }

    #[test]
    fn integers_merge_to_what_a_majority_reports() {
        assert_eq!(majority_integer(&[100, 98, 99, -2, -2], 3), Some(98));
        assert_eq!(majority_integer(&[1, 1, 0], 2), Some(1));
        assert_eq!(majority_integer(&[1, 0, 0], 2), Some(0));
        assert_eq!(majority_integer(&[5, 5], 3), None);
    }

    #[test]
    fn identical_majority() {
        let r = |s: &'static str| Bytes::from_static(s.as_bytes());
        let replies = [r("$1\r\na\r\n"), r("$1\r\nb\r\n"), r("$1\r\na\r\n")];
        assert_eq!(majority_identical(&replies, 2), Some(&replies[0]));
        assert_eq!(majority_identical(&replies[..2], 2), None);
    }
}
