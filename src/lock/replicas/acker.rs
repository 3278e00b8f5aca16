//! The acker: one connection of lockgate's own to the primary that asks
//! how many replicas hold what was written (`WAIT`), for every grant
//! waiting at once (a group commit).
//!
//! `WAIT` counts the replicas that hold everything the asking connection
//! wrote, and a grant was written on another connection (the client's).
//! So each round first writes on this one: it sets this process's marker
//! key (`lockgate:acked:{<run>}`, its value the round's number), which
//! Redis runs after every grant whose reply lockgate already read; `WAIT`
//! then covers them all. The marker stays (an hour): after a switch, the
//! round it names on the new primary says which grants the promoted
//! replica holds ([`super::switch`]). Should this connection have followed
//! a switch to another primary meanwhile, the primary's generation says so
//! ([`super::judge`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::{judge, AckError, AckMetrics, Round, Verdict};
use crate::lock::txn::resp::as_int;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode;
use crate::upstream::cluster::ClusterPool;
use crate::upstream::node::Node;
use crate::upstream::Primary;

/// Where a round reads the generation its grants are judged by: the
/// primary lockgate follows, or, in front of a cluster, the slot map (a
/// shard's acker asks one fixed node).
#[derive(Clone)]
pub(super) enum Generation {
    /// The primary's switches ([`super::generation`]).
    Primary(Arc<Primary>),
    /// The slot map's changes.
    Cluster(Arc<ClusterPool>),
}

impl Generation {
    /// Now, truncated.
    pub fn now(&self) -> u32 {
        match self {
            Generation::Primary(p) => super::generation(p),
            Generation::Cluster(c) => c.map_generation() as u32,
        }
    }
}

/// The pause after a round that could not ask, before the next.
const RETRY_PAUSE: Duration = Duration::from_millis(20);

/// How long the marker lives after the last round, ms (longer than any
/// lease it vouches for in practice; gone, the check after a switch
/// refutes, as for a grant it cannot vouch for).
pub const MARKER_LIFE_MS: &[u8] = b"3600000";

/// One grant waiting for its acknowledgement.
#[derive(Debug)]
pub(super) struct Waiter {
    /// Replicas wanted.
    pub replicas: u32,
    /// When it stops waiting.
    pub deadline: Instant,
    /// The primary's generation when the grant was planned, truncated.
    pub generation: u32,
    /// Its outcome: the round that acknowledged it.
    pub done: oneshot::Sender<Result<u64, AckError>>,
}

/// How rounds ask.
pub(super) struct Asks {
    /// This process's marker key.
    pub marker: Bytes,
    /// `WAITAOF 1 N` in place of `WAIT N` (`locks.replicas_ack_fsync`).
    pub fsync: Arc<AtomicBool>,
    /// How much longer than its wait a round's calls may take
    /// (`upstream.connect_timeout_ms`).
    pub slack: Duration,
    /// The last round's number, shared by every acker of the lock room:
    /// a shard's new acker after a failover sets the same marker key as
    /// the one before it (its tag lands in the same slots), and the
    /// marker's rounds must keep increasing for the check after a switch
    /// ([`super::switch`]).
    pub rounds: Arc<AtomicU64>,
}

/// Runs rounds for the waiters `rx` brings until `stop`: each round asks
/// for the fewest replicas any waiter wants, for as long as the nearest
/// deadline allows; the waiters it settles are answered, the others wait
/// for the next round.
pub(super) async fn run(
    node: Node,
    asks: Asks,
    primary: Generation,
    mut rx: mpsc::Receiver<Waiter>,
    metrics: Arc<AckMetrics>,
    stop: CancellationToken,
) {
    let mut waiting: Vec<Waiter> = Vec::new();
    loop {
        if waiting.is_empty() {
            tokio::select! {
                w = rx.recv() => match w {
                    Some(w) => waiting.push(w),
                    None => return,
                },
                _ = stop.cancelled() => return,
            }
        }
        // Bounded by the queue (`MAX_WAITING`).
        while let Ok(w) = rx.try_recv() {
            waiting.push(w);
        }
        ProxyMetrics::inc(&metrics.rounds);
        let number = asks.rounds.fetch_add(1, Ordering::Relaxed) + 1;
        let round = tokio::select! {
            round = ask(&node, &primary, &waiting, &asks, number) => round,
            // The waiters' senders drop: each is told lockgate stopped.
            _ = stop.cancelled() => return,
        };
        // A round that could not ask is not repeated at once: its
        // connection is reopening, or the primary refused.
        if round.acked.is_err() {
            tokio::select! {
                _ = tokio::time::sleep(RETRY_PAUSE) => {}
                _ = stop.cancelled() => return,
            }
        }
        let mut left = Vec::with_capacity(waiting.len());
        for w in waiting {
            match judge(&round, w.replicas, w.generation, w.deadline) {
                Verdict::Wait => left.push(w),
                Verdict::Done(outcome) => {
                    let _ = w.done.send(outcome.map(|()| number));
                }
            }
        }
        waiting = left;
    }
}

/// Round `number` for `waiting`: the marker set to it, then `WAIT` (or
/// `WAITAOF 1`), pipelined.
async fn ask(
    node: &Node,
    primary: &Generation,
    waiting: &[Waiter],
    asks: &Asks,
    number: u64,
) -> Round {
    let (marker, slack) = (&asks.marker[..], asks.slack);
    let fsync = asks.fsync.load(Ordering::Relaxed);
    let now = Instant::now();
    let wanted = waiting.iter().map(|w| w.replicas).min().unwrap_or(1);
    let nearest = (waiting.iter().map(|w| w.deadline))
        .min()
        .map_or(Duration::ZERO, |d| d.saturating_duration_since(now));
    // `WAIT n 0` would wait for ever: never less than 1 ms.
    let wait_ms = (nearest.as_millis() as u64).max(1);
    let wait_ms_s = wait_ms.to_string();
    let wanted_s = wanted.to_string();
    let before = primary.now();
    let timeout = Duration::from_millis(wait_ms) + slack;
    // Queued in this order at once: Redis runs them in it.
    let number = number.to_string();
    let set: [&[u8]; 5] = [b"SET", marker, number.as_bytes(), b"PX", MARKER_LIFE_MS];
    let published = node.send(encode::command(&set).into(), timeout);
    let (wanted, ms) = (wanted_s.as_bytes(), wait_ms_s.as_bytes());
    let wait = match fsync {
        true => encode::command(&[b"WAITAOF", b"1", wanted, ms]),
        false => encode::command(&[b"WAIT", wanted, ms]),
    };
    let waited = node.send(wait.into(), timeout);
    let (published, waited) = tokio::join!(published, waited);
    let acked = match (published, waited) {
        (Ok(_), Ok(reply)) if fsync => parse_fsynced(&reply).ok_or_else(|| said(&reply)),
        (Ok(_), Ok(reply)) => as_int(&reply).ok_or_else(|| said(&reply)),
        (Err(e), _) | (_, Err(e)) => Err(e.to_string()),
    };
    Round {
        acked,
        before,
        after: primary.now(),
        now: Instant::now(),
    }
}

/// What Redis said instead of a count, for the error.
fn said(reply: &[u8]) -> String {
    let text = String::from_utf8_lossy(reply.strip_prefix(b"-").unwrap_or(reply));
    text.trim_end().to_string()
}

/// `WAITAOF`'s `*2 :local :replicas`: the replicas that fsynced, or 0
/// when the primary's own fsync is not done (the round then acknowledges
/// nobody: every rule asks at least one replica).
fn parse_fsynced(reply: &[u8]) -> Option<i64> {
    let text = std::str::from_utf8(reply.strip_prefix(b"*2\r\n")?).ok()?;
    let mut n = (text.split("\r\n")).filter_map(|l| l.strip_prefix(':')?.parse::<i64>().ok());
    let (local, replicas) = (n.next()?, n.next()?);
    Some(if local >= 1 { replicas } else { 0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waitaof_counts_replicas_only_once_the_primary_fsynced() {
        assert_eq!(parse_fsynced(b"*2\r\n:1\r\n:2\r\n"), Some(2));
        assert_eq!(parse_fsynced(b"*2\r\n:0\r\n:2\r\n"), Some(0));
        let refused =
            b"-ERR WAITAOF cannot be used when numlocal is set but appendonly is disabled.\r\n";
        assert_eq!(parse_fsynced(refused), None);
    }

    #[test]
    fn the_count_is_an_integer_reply() {
        assert_eq!(as_int(b":2\r\n"), Some(2));
        assert_eq!(
            as_int(b"-ERR WAIT cannot be used with replica instances\r\n"),
            None
        );
        assert_eq!(
            said(b"-ERR WAIT cannot be used with replica instances\r\n"),
            "ERR WAIT cannot be used with replica instances"
        );
    }
}
