//! Nodes of the cluster that disagree about a slot (issue 45, "unsafe
//! upstreams named"): lockgate follows one node's slot map at a time, and
//! a primary cut off from the cluster bus while its replica was promoted
//! (`CLUSTER FAILOVER TAKEOVER`, or a failover on the majority's side)
//! still answers its slots as their primary: two nodes accept writes for
//! one slot, and a lock granted on one is unknown to the other.
//!
//! Every `upstream.cluster.views_check_ms` each node lockgate knows (those
//! of the map in force, and those of earlier maps for [`FORGET_AFTER`],
//! at most [`MAX_ASKED`]) is asked its own map on a short connection of
//! lockgate's own, and the answers compared ([`disputed`]). A range of
//! slots is named disputed once two checks in a row find it so
//! ([`confirmed`]: a failover's or a migration's gossip settles within a
//! check), and is shown (`LOCKGATE NODES` `disputes`, `/status.json`, the
//! gauge `cluster_disputed_slots`, the log, rate-limited);
//! `locks.require_one_primary` refuses lock grants in its slots. It
//! clears at the first check that finds the nodes agreeing (the cut node
//! healed and told of the promotion), or once the node that disagreed is
//! forgotten. Both rules are pure functions of the answers, tested as
//! tables.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::Common;
use crate::cluster::map::SlotMap;
use crate::cluster::slot::key_slot;
use crate::metrics::RateLimit;
use crate::sync;
use crate::upstream::node::NodeConfig;

/// Most nodes asked per check (the map's first); past it the rest are
/// not asked (counted in `cluster_views_unasked`).
pub const MAX_ASKED: usize = 64;

/// A node out of the map this long is no longer asked.
pub const FORGET_AFTER: Duration = Duration::from_secs(600);

/// Slots `first..=last` that the nodes asked name different primaries
/// for: each claim is a node asked and the primary it names (a node that
/// names none is not among them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dispute {
    /// The range's first slot.
    pub first: u16,
    /// Its last slot.
    pub last: u16,
    /// What each node asked said of it: (node, the primary it names).
    pub claims: Vec<(String, String)>,
}

impl Dispute {
    /// `FIRST-LAST: NODE says PRIMARY, …` (the log, `LOCKGATE NODES`, the
    /// refusal).
    pub fn describe(&self) -> String {
        let claims: Vec<String> = (self.claims.iter())
            .map(|(node, said)| format!("{node} says {said}"))
            .collect();
        format!("{}-{}: {}", self.first, self.last, claims.join(", "))
    }

    /// Whether it holds `slot`.
    pub fn holds(&self, slot: u16) -> bool {
        self.first <= slot && slot <= self.last
    }
}

/// Each node asked and the map it answered.
pub type Views = Vec<(String, Arc<SlotMap>)>;

/// The slots the `views` (each node asked and the map it answered)
/// disagree about: those two of them name different primaries for,
/// merged into ranges of consecutive slots with the same claims. A node
/// that names no primary for a slot (it does not know one) disputes
/// nothing; views that agree, none.
pub fn disputed(views: &[(String, Arc<SlotMap>)]) -> Vec<Dispute> {
    let mut out: Vec<Dispute> = Vec::new();
    for slot in 0..crate::cluster::slot::SLOTS {
        let claims: Vec<(String, String)> = (views.iter())
            .filter_map(|(node, map)| {
                Some((node.clone(), map.shard_of_slot(slot)?.primary.clone()))
            })
            .collect();
        let Some((_, first)) = claims.first() else {
            continue;
        };
        if claims.iter().all(|(_, p)| p == first) {
            continue;
        }
        match out.last_mut() {
            Some(d) if d.last + 1 == slot && d.claims == claims => d.last = slot,
            _ => out.push(Dispute {
                first: slot,
                last: slot,
                claims,
            }),
        }
    }
    out
}

/// What is named after a check found `now`, the check before having
/// found `before`: the parts of `now`'s ranges that `before` found
/// disputed too (a disagreement seen once is gossip on its way).
pub fn confirmed(before: &[Dispute], now: &[Dispute]) -> Vec<Dispute> {
    let mut out = Vec::new();
    for d in now {
        for b in before {
            let (first, last) = (d.first.max(b.first), d.last.min(b.last));
            if first <= last {
                out.push(Dispute {
                    first,
                    last,
                    claims: d.claims.clone(),
                });
            }
        }
    }
    out
}

/// The nodes to ask: those of `map` (primaries, then replicas), then
/// those `remembered` that were seen within [`FORGET_AFTER`] of `now`; at
/// most [`MAX_ASKED`], and how many more there were. `remembered`
/// becomes what is known now: the map's nodes seen at `now`, the others
/// as they were, the forgotten dropped.
pub fn to_ask(
    map: Option<&SlotMap>,
    remembered: &mut Vec<(String, Instant)>,
    now: Instant,
) -> (Vec<String>, usize) {
    let mut in_map: Vec<String> = Vec::new();
    if let Some(map) = map {
        for s in map.shards() {
            in_map.push(s.primary.clone());
        }
        for s in map.shards() {
            in_map.extend(s.replicas.iter().cloned());
        }
    }
    remembered.retain(|(n, seen)| {
        !in_map.contains(n) && now.saturating_duration_since(*seen) < FORGET_AFTER
    });
    let mut asked = in_map.clone();
    asked.extend(remembered.iter().map(|(n, _)| n.clone()));
    remembered.extend(in_map.into_iter().map(|n| (n, now)));
    remembered.truncate(MAX_ASKED * 2);
    asked.dedup();
    let over = asked.len().saturating_sub(MAX_ASKED);
    asked.truncate(MAX_ASKED);
    (asked, over)
}

/// The check's state: the nodes known, what the last check found, and
/// what is named now.
#[derive(Debug)]
pub(crate) struct Watch {
    known: Mutex<Vec<(String, Instant)>>,
    found: Mutex<Vec<Dispute>>,
    named: Mutex<Vec<Dispute>>,
    /// Anything named (one relaxed load on a lock grant's path).
    any: AtomicBool,
    warn: RateLimit,
}

impl Default for Watch {
    fn default() -> Watch {
        Watch {
            known: Mutex::new(Vec::new()),
            found: Mutex::new(Vec::new()),
            named: Mutex::new(Vec::new()),
            any: AtomicBool::new(false),
            warn: RateLimit::new(Duration::from_secs(60)),
        }
    }
}

impl Watch {
    /// The disputes named now.
    pub fn named(&self) -> Vec<Dispute> {
        sync::lock(&self.named).clone()
    }

    /// The dispute named now over `key`'s slot, if any.
    pub fn of_key(&self, key: &[u8]) -> Option<Dispute> {
        if !self.any.load(Ordering::Relaxed) {
            return None;
        }
        let slot = key_slot(key);
        sync::lock(&self.named)
            .iter()
            .find(|d| d.holds(slot))
            .cloned()
    }

    /// Takes note of a check's `found` disputes: names those found by
    /// the check before too ([`confirmed`]).
    fn checked(&self, found: Vec<Dispute>) -> Vec<Dispute> {
        let mut before = sync::lock(&self.found);
        let named = confirmed(&before, &found);
        *before = found;
        drop(before);
        self.any.store(!named.is_empty(), Ordering::Relaxed);
        *sync::lock(&self.named) = named.clone();
        named
    }
}

/// Asks every node to ask its map every `every` until `common` stops, and
/// names what they disagree about.
pub(super) async fn run(common: Arc<Common>, every: Duration) {
    loop {
        tokio::select! {
            _ = common.stop.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let map = common.map();
        let (asked, over) = {
            let mut known = sync::lock(&common.disputes.known);
            to_ask(map.as_deref(), &mut known, Instant::now())
        };
        (common.metrics.views_unasked).fetch_add(over as u64, Ordering::Relaxed);
        let answers = asked.iter().map(|n| view_of(&common.node, n));
        let answers = futures_util::future::join_all(answers).await;
        let views: Views = (asked.into_iter().zip(answers))
            .filter_map(|(n, m)| Some((n, Arc::new(m?))))
            .collect();
        let named = common.disputes.checked(disputed(&views));
        let slots: u64 = named.iter().map(|d| u64::from(d.last - d.first) + 1).sum();
        (common.metrics.disputed).store(slots, Ordering::Relaxed);
        if let Some(first) = named.first() {
            if let Some(more) = common.disputes.warn.check() {
                tracing::warn!(
                    disputes = named.len(),
                    first = %first.describe(),
                    suppressed = more,
                    "nodes of the cluster disagree about who serves slots: two of them may accept writes for one slot (see locks.require_one_primary)"
                );
            }
        }
    }
}

/// The map node `addr` answers on a short connection made as `template`
/// says (`None`: no answer).
async fn view_of(template: &NodeConfig, addr: &str) -> Option<SlotMap> {
    let config = NodeConfig {
        addr: addr.to_string(),
        observer: None,
        follow: None,
        ..template.clone()
    };
    super::topology::fetch_one(&config).await.ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(ranges: &[(u16, u16, &str)]) -> Arc<SlotMap> {
        let ranges: Vec<(u16, u16, &str, &[&str])> = ranges
            .iter()
            .map(|(a, b, p)| (*a, *b, *p, &[][..]))
            .collect();
        Arc::new(SlotMap::from_ranges(&ranges))
    }

    fn views(v: &[(&str, &Arc<SlotMap>)]) -> Views {
        v.iter()
            .map(|(n, m)| (n.to_string(), (*m).clone()))
            .collect()
    }

    #[test]
    fn the_slots_two_nodes_name_different_primaries_for_are_disputed() {
        let healthy = map(&[(0, 8191, "a"), (8192, 16383, "b")]);
        let promoted = map(&[(0, 8191, "a"), (8192, 16383, "c")]);
        let partial = map(&[(0, 99, "a")]);
        let claims = |v: &[(&str, &str)]| -> Vec<(String, String)> {
            v.iter()
                .map(|(n, p)| (n.to_string(), p.to_string()))
                .collect()
        };
        #[rustfmt::skip]
        let cases: Vec<(&str, Views, Vec<Dispute>)> = vec![
            ("one view", views(&[("a", &healthy)]), vec![]),
            ("agreeing", views(&[("a", &healthy), ("b", &healthy)]), vec![]),
            ("a node that knows fewer slots disputes none",
             views(&[("a", &healthy), ("x", &partial)]), vec![]),
            ("a cut primary and the others",
             views(&[("a", &promoted), ("b", &healthy), ("c", &promoted)]),
             vec![Dispute { first: 8192, last: 16383,
                            claims: claims(&[("a", "c"), ("b", "b"), ("c", "c")]) }]),
        ];
        for (what, v, want) in cases {
            assert_eq!(disputed(&v), want, "{what}");
        }
    }

    #[test]
    fn a_dispute_is_named_once_two_checks_in_a_row_find_it() {
        let d = |first, last| Dispute {
            first,
            last,
            claims: vec![("a".into(), "a".into()), ("b".into(), "b".into())],
        };
        #[rustfmt::skip]
        let cases = [
            ("first seen", vec![], vec![d(10, 20)], vec![]),
            ("seen again", vec![d(10, 20)], vec![d(10, 20)], vec![d(10, 20)]),
            ("only the overlap", vec![d(0, 14)], vec![d(10, 20)], vec![d(10, 14)]),
            ("gone", vec![d(10, 20)], vec![], vec![]),
        ];
        for (what, before, now, want) in cases {
            assert_eq!(confirmed(&before, &now), want, "{what}");
        }
    }

    #[test]
    fn nodes_out_of_the_map_are_asked_until_forgotten() {
        let t0 = Instant::now();
        let first = SlotMap::from_ranges(&[(0, 16383, "a", &["b"])]);
        let after = SlotMap::from_ranges(&[(0, 16383, "b", &[])]);
        let mut known = Vec::new();
        assert_eq!(to_ask(Some(&first), &mut known, t0).0, ["a", "b"]);
        // `a` left the map: still asked.
        let soon = t0 + Duration::from_secs(1);
        assert_eq!(to_ask(Some(&after), &mut known, soon).0, ["b", "a"]);
        let late = t0 + FORGET_AFTER;
        assert_eq!(to_ask(Some(&after), &mut known, late).0, ["b"]);
        // Bounded: past `MAX_ASKED` the rest are counted, not asked.
        let replicas: Vec<String> = (0..MAX_ASKED + 5).map(|i| format!("r{i}")).collect();
        let refs: Vec<&str> = replicas.iter().map(String::as_str).collect();
        let big = SlotMap::from_ranges(&[(0, 16383, "p", &refs)]);
        let (asked, over) = to_ask(Some(&big), &mut Vec::new(), late);
        assert_eq!((asked.len(), over), (MAX_ASKED, 6));
    }
}
