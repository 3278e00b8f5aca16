//! The lock masters' clocks. Redis expires keys by its wall clock, so a
//! master whose clock steps forward drops every lock it holds at once and
//! may vote "yes" for the next client while the holder's validity lasts.
//! lockgate reads each master's clock (`TIME`) inside every acquisition
//! script and once a second, and tracks the master's offset against its
//! own monotonic clock. A master whose offset moves by more than the
//! allowance between two observations sits out acquisitions for its rejoin
//! delay, as after a restart, and its vote in the acquisition that saw the
//! step does not count. What this detects and what it cannot is in
//! `docs/clocks.md`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::stream::{FuturesUnordered, StreamExt};

use super::{Master, MasterState, Quorum};
use crate::config::Config;
use crate::metrics::{ProxyMetrics, RateLimit};

/// How often every master's clock is read outside acquisitions, so a step
/// is usually seen before the next vote.
pub const SAMPLE_INTERVAL: Duration = Duration::from_secs(1);

/// Added to `clock_drift_factor × default_lease_ms` for the derived step
/// allowance: the resolution of the clocks involved and a margin.
const STEP_SLACK_MS: u64 = 5;

/// Interval between two clock-jump warnings.
const WARN_INTERVAL: Duration = Duration::from_secs(10);

/// What can be wrong with a master's clock reading.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ClockError {
    /// The `TIME` reply was not `[seconds, microseconds]`.
    #[error("lock master answered TIME with something else")]
    BadTime,
}

/// One reading of a master's clock: the offset (master µs − lockgate µs
/// since its baseline) lies in `[lo, hi]`, because the master read its
/// clock somewhere between lockgate sending the command and receiving the
/// answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Reading {
    lo: i64,
    hi: i64,
    /// When lockgate sent the command (µs since its baseline).
    sent: i64,
}

/// What lockgate knows of one master's clock.
#[derive(Debug, Default)]
struct Seen {
    /// The connection the readings were taken on (a new one starts over).
    connects: u64,
    /// The latest reading.
    last: Option<Reading>,
    /// The reading every later one is also held to (slow drift adds up).
    anchor: Option<Reading>,
}

/// A reading judged against the master's earlier ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The first reading on this connection: nothing to compare with.
    First,
    /// Within the allowance.
    Steady,
    /// The offset moved by at least this many µs (negative: backwards)
    /// beyond what the allowance explains.
    Jumped(i64),
    /// An older reading (sent before the latest one) that disagrees with
    /// it: not trusted, not counted as a new jump.
    Stale,
}

impl Verdict {
    /// Whether a vote carrying this reading may count.
    pub fn trusted(self) -> bool {
        matches!(self, Verdict::First | Verdict::Steady)
    }
}

/// Every master's clock offset, and the stricter quorum setting.
#[derive(Debug)]
pub struct ClockWatch {
    base: Instant,
    masters: Vec<Mutex<Seen>>,
    /// Largest step between two readings not taken for a jump, µs.
    step_us: i64,
    /// How far two clocks' rates may differ (`clock_drift_factor`).
    drift: f64,
    /// `locks.quorum.clock_faults`.
    faults: usize,
    /// Clock jumps seen, all masters (`lock_quorum_clock_jumps`).
    pub jumps: AtomicU64,
    warn: RateLimit,
}

impl ClockWatch {
    /// The watch for `config`'s masters.
    pub fn new(config: &Config) -> ClockWatch {
        let q = &config.locks.quorum;
        let step_ms = match q.max_clock_step_ms {
            0 => {
                (q.clock_drift_factor * config.locks.default_lease_ms as f64) as u64 + STEP_SLACK_MS
            }
            ms => ms,
        };
        ClockWatch {
            base: Instant::now(),
            masters: q.masters.iter().map(|_| Mutex::default()).collect(),
            step_us: step_ms.saturating_mul(1000).min(i64::MAX as u64) as i64,
            drift: q.clock_drift_factor,
            faults: q.clock_faults,
            jumps: AtomicU64::new(0),
            warn: RateLimit::new(WARN_INTERVAL),
        }
    }

    /// The step allowance in ms (for operators and the docs' examples).
    pub fn step_allowance_ms(&self) -> u64 {
        (self.step_us / 1000) as u64
    }

    fn micros(&self, at: Instant) -> i64 {
        at.saturating_duration_since(self.base).as_micros() as i64
    }

    /// Judges master `i`'s clock reading `master_us` (µs since the Unix
    /// epoch), taken between `sent` and `received` on its connection
    /// number `connects`, and remembers it.
    pub fn judge(
        &self,
        i: usize,
        connects: u64,
        master_us: i64,
        sent: Instant,
        received: Instant,
    ) -> Verdict {
        let (s, r) = (self.micros(sent), self.micros(received));
        let new = Reading {
            lo: master_us - r,
            hi: master_us - s,
            sent: s,
        };
        let Some(mut seen) = self.masters.get(i).map(crate::sync::lock) else {
            return Verdict::First;
        };
        let (Some(last), Some(anchor)) = (seen.last, seen.anchor) else {
            *seen = Seen {
                connects,
                last: Some(new),
                anchor: Some(new),
            };
            return Verdict::First;
        };
        if seen.connects != connects {
            // Another connection (a restart sits the master out anyway):
            // its clock may be another host's.
            *seen = Seen {
                connects,
                last: Some(new),
                anchor: Some(new),
            };
            return Verdict::First;
        }
        let moved = [last, anchor]
            .into_iter()
            .map(|old| (self.beyond(old, new), old))
            .find(|(by, _)| *by != 0);
        match moved {
            None => {
                if new.sent >= last.sent {
                    seen.last = Some(new);
                }
                Verdict::Steady
            }
            Some(_) if new.sent < last.sent => Verdict::Stale,
            Some((by, _)) => {
                // The new clock is the one to watch from now on.
                seen.last = Some(new);
                seen.anchor = Some(new);
                Verdict::Jumped(by)
            }
        }
    }

    /// How far (µs, signed) `new`'s offset is from `old`'s beyond the step
    /// allowance plus the drift their distance in time allows; 0 within.
    fn beyond(&self, old: Reading, new: Reading) -> i64 {
        let elapsed = (new.sent - old.sent).unsigned_abs() as f64;
        let allowed = self.step_us.saturating_add((elapsed * self.drift) as i64);
        if new.lo - old.hi > allowed {
            new.lo - old.hi
        } else if old.lo - new.hi > allowed {
            new.hi - old.lo
        } else {
            0
        }
    }

    /// Counts and reports (rate-limited) a jump of `master`'s clock, which
    /// then sits out for `sit_out`. Never logs lock keys or values.
    fn jumped(&self, master: &Master, by_us: i64, sit_out: Duration) {
        ProxyMetrics::inc(&self.jumps);
        master.sit_out(sit_out);
        if let Some(suppressed) = self.warn.check() {
            tracing::warn!(
                master = master.node.addr(),
                step_ms = by_us / 1000,
                allowance_ms = self.step_allowance_ms(),
                sit_out_ms = sit_out.as_millis() as u64,
                suppressed,
                "lock master's clock jumped: it may have expired locks early; it sits out acquisitions"
            );
        }
    }
}

/// `[seconds, microseconds]` (a `TIME` reply) as µs since the epoch.
pub fn parse_time(reply: &[u8]) -> Result<i64, ClockError> {
    let mut parts = reply
        .split(|&c| c == b'\n')
        .skip(1)
        .filter(|l| !l.starts_with(b"$"))
        .filter_map(|l| l.strip_suffix(b"\r"))
        .map(crate::protocol::request::parse_int);
    match (parts.next(), parts.next()) {
        (Some(Some(secs)), Some(Some(micros))) if reply.starts_with(b"*2\r\n") => secs
            .checked_mul(1_000_000)
            .and_then(|us| us.checked_add(micros))
            .ok_or(ClockError::BadTime),
        _ => Err(ClockError::BadTime),
    }
}

/// What the masters asked in an acquisition answered.
#[derive(Debug, Default)]
pub struct Ballot {
    /// Every answer that came in time, in the order they came.
    pub replies: Vec<Bytes>,
    /// "Yes" votes that count: the master's clock steady and the master
    /// still taking part when its answer came.
    pub yes: usize,
    /// "Yes" votes not counted because the master's clock jumped.
    pub distrusted: usize,
    /// The masters whose "yes" counted.
    pub yes_from: Vec<Arc<Master>>,
    /// Their facts, in the same order as `yes_from`.
    pub yes_facts: Vec<Vec<i64>>,
}

impl Quorum {
    /// "Yes" votes an acquisition needs: more than (N + clock_faults) / 2,
    /// so that two acquisitions share more than `clock_faults` masters and
    /// one master with a wrong clock cannot hand a lock out twice.
    pub fn votes_needed(&self) -> usize {
        (self.masters.len() + self.clock.faults) / 2 + 1
    }

    /// Sends an acquisition script to the masters `to` in parallel and
    /// counts its votes. `facts` reads a reply's facts: the first is 1 for
    /// "yes", the one at `clock_at` the master's clock (µs). A "yes" counts
    /// only if the clock reading is steady and the master still takes
    /// part. `enough(yes, answered)` may end the wait early.
    pub async fn ballot(
        &self,
        to: &[Arc<Master>],
        command: &crate::upstream::node::Request,
        clock_at: usize,
        facts: impl Fn(&[u8]) -> Vec<i64>,
        mut enough: impl FnMut(usize, usize) -> bool,
    ) -> Ballot {
        let timeout = self.node_timeout();
        let mut pending: FuturesUnordered<_> = to
            .iter()
            .map(|m| {
                // Queued now, to every master, before any answer is awaited.
                let (sent, reply) = (Instant::now(), m.node.send(command.clone(), timeout));
                let m = m.clone();
                async move {
                    let reply = reply.await;
                    (m, sent, Instant::now(), reply)
                }
            })
            .collect();
        let mut ballot = Ballot::default();
        while let Some((m, sent, received, reply)) = pending.next().await {
            let Ok(reply) = reply else { continue };
            let f = facts(&reply);
            let verdict = f
                .get(clock_at)
                .map(|&us| self.judge(&m, us, sent, received));
            if f.first() == Some(&1) {
                // A reading without a clock (cannot happen with lockgate's
                // scripts) is taken as before: on the master's word.
                if !verdict.is_none_or(Verdict::trusted) {
                    ballot.distrusted += 1;
                } else if m.state() == MasterState::Up {
                    ballot.yes += 1;
                    ballot.yes_from.push(m);
                    ballot.yes_facts.push(f);
                }
            }
            ballot.replies.push(reply);
            if enough(ballot.yes, ballot.replies.len()) {
                break;
            }
        }
        ballot
    }

    /// Judges `m`'s clock reading, sitting the master out on a jump.
    fn judge(&self, m: &Master, master_us: i64, sent: Instant, received: Instant) -> Verdict {
        let Some(i) = self.masters.iter().position(|x| std::ptr::eq(&**x, m)) else {
            return Verdict::First;
        };
        let connects = m.node.state.connects.load(Ordering::Relaxed);
        let verdict = self.clock.judge(i, connects, master_us, sent, received);
        if let Verdict::Jumped(by) = verdict {
            self.clock.jumped(m, by, self.rejoin_delay());
        }
        verdict
    }

    /// Reads every connected master's clock each [`SAMPLE_INTERVAL`]
    /// (a `TIME`, bounded by the node timeout), until dropped.
    pub async fn sample_clocks(&self) {
        let time = crate::protocol::encode::command(&[b"TIME"]);
        loop {
            let reads = self.masters.iter().map(|m| {
                let time = time.clone();
                async move {
                    if !m.node.state.up.load(Ordering::Relaxed) {
                        return;
                    }
                    let sent = Instant::now();
                    let Ok(reply) = m.node.call(time, self.node_timeout()).await else {
                        return;
                    };
                    if let Ok(us) = parse_time(&reply) {
                        self.judge(m, us, sent, Instant::now());
                    }
                }
            });
            futures_util::future::join_all(reads).await;
            tokio::time::sleep(SAMPLE_INTERVAL).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch(step_ms: u64) -> ClockWatch {
        let mut c = Config::default();
        c.locks.quorum.masters = vec!["a:1".into(), "b:1".into(), "c:1".into()];
        c.locks.quorum.max_clock_step_ms = step_ms;
        ClockWatch::new(&c)
    }

    /// A reading of `offset_ms` taken at `at_ms` with a round trip of `rtt_ms`.
    fn read(w: &ClockWatch, at_ms: u64, offset_ms: i64, rtt_ms: u64) -> Verdict {
        let sent = w.base + Duration::from_millis(at_ms);
        let received = sent + Duration::from_millis(rtt_ms);
        let master_us = (at_ms as i64 + offset_ms) * 1000;
        w.judge(0, 1, master_us, sent, received)
    }

    #[test]
    fn a_step_beyond_the_allowance_is_a_jump() {
        let w = watch(50);
        assert_eq!(read(&w, 0, 1_000, 1), Verdict::First);
        assert_eq!(read(&w, 1_000, 1_010, 1), Verdict::Steady);
        assert!(matches!(read(&w, 2_000, 61_010, 1), Verdict::Jumped(by) if by > 59_000_000));
        // The new clock is watched from there on.
        assert_eq!(read(&w, 3_000, 61_010, 1), Verdict::Steady);
        assert!(matches!(read(&w, 4_000, 1_010, 1), Verdict::Jumped(by) if by < 0));
    }

    #[test]
    fn round_trips_are_never_taken_for_a_jump() {
        let w = watch(5);
        assert_eq!(read(&w, 0, 0, 40), Verdict::First);
        // The master read its clock late in a slow round trip.
        let sent = w.base + Duration::from_millis(1_000);
        let received = sent + Duration::from_millis(45);
        assert_eq!(
            w.judge(0, 1, 1_044_000, sent, received),
            Verdict::Steady,
            "a clock read 44 ms into a 45 ms round trip is on time"
        );
    }

    #[test]
    fn slow_drift_adds_up_against_the_anchor() {
        // 1 % drift allowed; this clock runs 5 % fast, 40 ms per reading.
        let w = watch(50);
        let mut verdicts = Vec::new();
        for k in 0..10u64 {
            verdicts.push(read(&w, k * 800, (k * 40) as i64, 1));
        }
        assert!(
            verdicts.iter().any(|v| matches!(v, Verdict::Jumped(_))),
            "{verdicts:?}"
        );
    }

    #[test]
    fn an_older_reading_that_disagrees_is_stale() {
        let w = watch(50);
        read(&w, 0, 0, 1);
        assert!(matches!(read(&w, 2_000, 60_000, 1), Verdict::Jumped(_)));
        assert_eq!(read(&w, 1_500, 0, 1), Verdict::Stale);
        assert_eq!(w.judge(0, 2, 5_000_000, w.base, w.base), Verdict::First);
    }

    #[test]
    fn time_replies() {
        assert_eq!(
            parse_time(b"*2\r\n$10\r\n1700000000\r\n$6\r\n000042\r\n"),
            Ok(1_700_000_000_000_042)
        );
        assert_eq!(parse_time(b"-ERR no\r\n"), Err(ClockError::BadTime));
    }
}
