//! After a switch of the primary: which acquisitions the failover hold
//! (`locks.failover_delay_ms`) may let through at once.
//!
//! The hold exists because a lock granted on the old primary may be
//! missing on the promoted replica. A grant the replicas acknowledged is
//! not: Sentinel promotes the most up-to-date replica it can reach (equal
//! `replica-priority`), whose replication offset is then at least that of
//! any replica that acknowledged the grant. So keys whose pattern asks for
//! acknowledgement skip the hold, on two conditions checked here:
//!
//! - acknowledgement was in force for those patterns for the whole
//!   failover delay before the switch (a grant made before it was not
//!   acknowledged: [`Replicas::acks_changed`]);
//! - the promoted replica has every write up to the latest acknowledgement
//!   round that acknowledged a grant of this instance whose lease still
//!   runs: each round sets this process's marker key to its number after
//!   the grants it covers ([`super::acker`]), so the marker on the new
//!   primary, read once (`GET`) the first time an acquisition asks after
//!   the switch, names the last round it holds. An older round, or no
//!   marker, refutes the assumption: the hold applies to every key, as
//!   before. Until the answer, the hold applies.
//!
//! [`unheld`] is the rule, a pure function of the check's state and the
//! times, tested as a table.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::{Acked, Replicas, Won};
use crate::cluster::slot::key_slot;
use crate::lock::txn::OnPrimary;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode;
use crate::sync;

/// Most acknowledged grants remembered for the check after a switch; the
/// oldest is forgotten past it (counted in `lock_replica_ack_forgotten`).
pub const MAX_RECENT: usize = 1_024;

/// The pause between two tries of the check while lockgate's own
/// connection to the new primary opens.
const RETRY_PAUSE: Duration = Duration::from_millis(20);

/// An acknowledged grant whose lease may still run: the round that
/// acknowledged it, the marker key that round set, the grant's slot (in
/// front of a cluster: which shard it lives on) and when its lease ends.
#[derive(Debug, Clone)]
pub(super) struct Remembered {
    pub round: u64,
    pub marker: Bytes,
    pub slot: u16,
    pub until: Instant,
}

/// Marker keys and, for each, the round a node must hold.
pub(super) type Needed = Vec<(Bytes, u64)>;

/// The rounds a promoted node must hold for the `recent` grants still
/// running at `now` that it now serves (`serves` of their slot): for each
/// marker key, the latest round that acknowledged one of them. `None`
/// when one of those grants was acknowledged by a marker the node does
/// not serve (`serves_marker`): its marker says nothing there, so
/// nothing can be vouched for (in front of a cluster, a grant whose slot
/// moved to another shard since).
pub(super) fn needs(
    recent: &Recent,
    now: Instant,
    serves: impl Fn(u16) -> bool,
    serves_marker: impl Fn(&[u8]) -> bool,
) -> Option<Needed> {
    let mut needed: Needed = Vec::new();
    for r in recent.iter().filter(|r| r.until > now && serves(r.slot)) {
        if !serves_marker(&r.marker) {
            return None;
        }
        match needed.iter_mut().find(|(m, _)| *m == r.marker) {
            Some((_, round)) => *round = (*round).max(r.round),
            None => needed.push((r.marker.clone(), r.round)),
        }
    }
    Some(needed)
}

/// What the check after one switch concluded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vouch {
    /// Asked, no answer yet.
    Pending,
    /// The new primary holds every remembered grant's round.
    Vouched,
    /// It holds an older round (or none), or could not be asked.
    Refuted,
}

/// Whether an acquisition of a key whose pattern asks for acknowledgement
/// skips the failover hold: the check of this switch `vouch`ed for the
/// promoted replica, and acknowledgement was in force (`acks_since`) for
/// the whole `delay` before the switch (`switched_at`).
pub fn unheld(vouch: Vouch, acks_since: Instant, switched_at: Instant, delay: Duration) -> bool {
    vouch == Vouch::Vouched && switched_at.saturating_duration_since(acks_since) >= delay
}

impl Replicas {
    /// Remembers `grant`, acknowledged as `acked` says, for as long as
    /// its lease runs.
    pub(super) fn remember(&self, grant: &Won, acked: Acked) {
        let now = Instant::now();
        let mut recent = sync::lock(&self.recent);
        while recent.front().is_some_and(|r| r.until <= now) {
            recent.pop_front();
        }
        if recent.len() >= MAX_RECENT {
            recent.pop_front();
            ProxyMetrics::inc(&self.metrics.forgotten);
        }
        recent.push_back(Remembered {
            round: acked.round,
            marker: acked.marker,
            slot: key_slot(&grant.key),
            until: now + Duration::from_millis(grant.lease_ms),
        });
    }

    /// The acknowledgement settings changed (a reload): grants made
    /// before now were not acknowledged as they are now.
    pub fn acks_changed(&self) {
        *sync::lock(&self.acks_since) = Instant::now();
    }

    /// [`unheld`] for a check that concluded `vouch` about a switch at
    /// `at`, with the acknowledgement settings' age and the failover
    /// `delay`; counted when it lets an acquisition through.
    pub(super) fn let_through(&self, vouch: Vouch, at: Instant, delay: Duration) -> bool {
        let go = unheld(vouch, self.acks_since(), at, delay);
        if go {
            ProxyMetrics::inc(&self.metrics.unheld);
        }
        go
    }

    /// Since when the acknowledgement settings in force apply.
    pub fn acks_since(&self) -> Instant {
        *sync::lock(&self.acks_since)
    }

    /// The check's state for the primary of `generation`, and whether the
    /// caller must start it (the first to ask).
    pub(super) fn vouch_for(&self, generation: u64) -> (Vouch, bool) {
        let mut check = sync::lock(&self.switch_check);
        match *check {
            Some((g, vouch)) if g == generation => (vouch, false),
            _ => {
                *check = Some((generation, Vouch::Pending));
                (Vouch::Pending, true)
            }
        }
    }

    /// Records the check's conclusion for `generation`.
    pub(super) fn concluded(&self, generation: u64, vouch: Vouch) {
        let mut check = sync::lock(&self.switch_check);
        if check.is_some_and(|(g, _)| g == generation) {
            *check = Some((generation, vouch));
        }
    }

    /// The rounds the primary lockgate follows must hold: the grants
    /// whose leases still run, all acknowledged through its marker.
    pub(super) fn needed(&self) -> Option<Needed> {
        let recent = sync::lock(&self.recent);
        needs(&recent, Instant::now(), |_| true, |m| m == self.marker)
    }

    /// Whether the node `primary` reaches holds every round of `needed`
    /// (each marker's `GET` there names at least its round; `None`:
    /// refuted already), tried again while its connection opens, up to
    /// `within`.
    pub(super) async fn check(
        &self,
        primary: &OnPrimary,
        needed: Option<Needed>,
        within: Duration,
    ) -> Vouch {
        let Some(needed) = needed else {
            return Vouch::Refuted;
        };
        let deadline = Instant::now() + within;
        for (marker, needed) in needed {
            let get = encode::command(&[b"GET", &marker]);
            loop {
                if let Ok(reply) = primary.call(get.clone(), within).await {
                    let held = parse_round(&reply);
                    if held.is_some_and(|h| h >= needed) {
                        break;
                    }
                    tracing::warn!(
                        needed,
                        held = held.unwrap_or(0),
                        "the promoted replica lacks acknowledged lock grants: acquisitions it serves are held for locks.failover_delay_ms"
                    );
                    return Vouch::Refuted;
                }
                if Instant::now() >= deadline {
                    return Vouch::Refuted;
                }
                tokio::time::sleep(RETRY_PAUSE).await;
            }
        }
        Vouch::Vouched
    }
}

/// The round a `GET` of the marker answered (`$n` then its digits);
/// `None` for a nil, an error or anything else.
fn parse_round(reply: &[u8]) -> Option<u64> {
    let rest = reply.strip_prefix(b"$")?;
    let end = rest.windows(2).position(|w| w == b"\r\n")?;
    let body = rest.get(end + 2..)?.strip_suffix(b"\r\n")?;
    std::str::from_utf8(body).ok()?.parse().ok()
}

impl crate::lock::LockService {
    /// While the failover hold runs (`locks.failover_delay_ms`): whether
    /// an acquisition of `key` goes on all the same ([`unheld`]); counted.
    /// The first to ask after a switch starts the check of the promoted
    /// replica (bounded: twice `upstream.connect_timeout_ms`), and the
    /// hold applies until it concludes.
    pub(crate) fn unheld_after_switch(&self, key: &[u8]) -> bool {
        if self.ack_rule(key).is_none() {
            return false;
        }
        let store = self.store();
        let primary = store.primary_addr();
        let Some(switched_at) = primary.switched_at() else {
            return false;
        };
        let generation = primary.current().generation;
        let replicas = &store.replicas;
        let (vouch, start) = replicas.vouch_for(generation);
        if start {
            let (r, on, within) = (replicas.clone(), store.primary.clone(), store.timeout() * 2);
            let needed = r.needed();
            tokio::spawn(async move {
                let vouch = r.check(&on, needed, within).await;
                r.concluded(generation, vouch);
            });
        }
        replicas.let_through(vouch, switched_at, self.failover_delay())
    }
}

/// Remembered grants, oldest first.
pub(super) type Recent = VecDeque<Remembered>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hold_is_skipped_only_when_vouched_for_and_acknowledged_long_enough() {
        let t0 = Instant::now();
        let delay = Duration::from_secs(30);
        let long_after = t0 + Duration::from_secs(31);
        let soon_after = t0 + Duration::from_secs(29);
        #[rustfmt::skip]
        let cases = [
            ("vouched, acks long in force", Vouch::Vouched, long_after, true),
            ("vouched, acks turned on within the delay", Vouch::Vouched, soon_after, false),
            ("not answered yet", Vouch::Pending, long_after, false),
            ("a grant missing", Vouch::Refuted, long_after, false),
        ];
        for (what, vouch, switched_at, want) in cases {
            assert_eq!(unheld(vouch, t0, switched_at, delay), want, "{what}");
        }
    }

    #[test]
    fn the_rounds_needed_are_the_latest_per_marker_of_the_grants_served() {
        let now = Instant::now();
        let (later, gone) = (now + Duration::from_secs(5), now - Duration::from_secs(1));
        let r = |round, marker: &'static str, slot, until| Remembered {
            round,
            marker: Bytes::from_static(marker.as_bytes()),
            slot,
            until,
        };
        let b = |m: &'static str| Bytes::from_static(m.as_bytes());
        // The node serves slots below 100 and markers "a" and "b".
        let serves = |slot: u16| slot < 100;
        let on_node = |m: &[u8]| m == b"a" || m == b"b";
        #[rustfmt::skip]
        let cases: [(&str, Vec<Remembered>, Option<Needed>); 6] = [
            ("nothing remembered", vec![], Some(vec![])),
            ("leases ended", vec![r(3, "a", 1, gone)], Some(vec![])),
            ("the latest round per marker",
             vec![r(3, "a", 1, later), r(7, "a", 2, later), r(5, "b", 3, later)],
             Some(vec![(b("a"), 7), (b("b"), 5)])),
            ("another node's grants ask nothing of it",
             vec![r(3, "a", 1, later), r(9, "c", 200, later)],
             Some(vec![(b("a"), 3)])),
            ("a grant it serves acknowledged through a marker it does not",
             vec![r(3, "a", 1, later), r(9, "c", 50, later)], None),
            ("an ended one through such a marker is no matter",
             vec![r(3, "a", 1, later), r(9, "c", 50, gone)],
             Some(vec![(b("a"), 3)])),
        ];
        for (what, recent, want) in cases {
            let recent: Recent = recent.into_iter().collect();
            assert_eq!(needs(&recent, now, serves, on_node), want, "{what}");
        }
    }

    #[test]
    fn the_marker_names_a_round() {
        assert_eq!(parse_round(b"$2\r\n17\r\n"), Some(17));
        assert_eq!(parse_round(b"$-1\r\n"), None);
        assert_eq!(parse_round(b"-ERR x\r\n"), None);
        assert_eq!(parse_round(b"$3\r\nabc\r\n"), None);
    }
}
