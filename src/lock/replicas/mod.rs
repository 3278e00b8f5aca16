//! Replica acknowledgement (`locks.replicas_ack`): a grant on the primary
//! (an acquisition, a takeover) is answered only once enough of the
//! primary's replicas hold it, so that a failover right after it promotes
//! a replica that knows the lock instead of handing it out again (the
//! Redlock article's worry about a primary with replicas; Redisson checks
//! the same with `WAIT` before it reports a lock taken).
//!
//! Not acknowledged within the pattern's timeout, or the lease gone
//! meanwhile, or the primary changed, the grant is undone by its own token
//! (`RELEASE_TOKEN`: never another owner's lock) and the client told it
//! failed, as `locks.replicas_ack_refusal` says. The wait is the client's
//! reply's alone: its connection's later replies wait behind it in order,
//! every other connection goes on. Asking is [`acker`]'s.
//!
//! What a waiter is told is a pure function of a round's readings and the
//! time ([`judge`]), tested as a table.

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::lease::{ConnLocks, Standing};
use super::storm::Storm;
use super::txn::OnPrimary;
use crate::config::AckRefusal;
use crate::metrics::{counters, ProxyMetrics, RateLimit};
use crate::protocol::encode::LocalReply;
use crate::script;
use crate::sync;
use crate::upstream::cluster::ClusterPool;
use crate::upstream::node::{Node, NodeConfig};
use crate::upstream::Primary;

pub mod acker;
mod gate;
pub(crate) mod in_tx;
mod promoted;
mod shards;
pub mod switch;

pub(crate) use gate::{not_acquired, Won};

#[cfg(test)]
mod tests;

/// Most grants waiting for their acknowledgement at once; one more is
/// refused as not acknowledged (counted in `lock_replica_ack_full`).
pub const MAX_WAITING: usize = 4_096;

/// How a grant was acknowledged: by which round of which marker key's
/// acker (for the check after a switch, [`switch`]).
#[derive(Debug, Clone)]
pub struct Acked {
    /// The round's number.
    pub round: u64,
    /// The marker key that round set.
    pub marker: Bytes,
}

/// What one lock pattern asks of the replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AckRule {
    /// Replicas that must hold the grant (at least 1).
    pub replicas: u32,
    /// Longest wait for them.
    pub timeout: Duration,
    /// What the client gets when they do not in time.
    pub refusal: AckRefusal,
}

/// Why a grant was not acknowledged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AckError {
    /// Upstream: fewer replicas than wanted held it when the time was up.
    #[error("acknowledged by {got} of {wanted} replicas within {timeout_ms} ms")]
    Timeout {
        /// Replicas that did.
        got: i64,
        /// Replicas wanted.
        wanted: u32,
        /// The pattern's timeout.
        timeout_ms: u64,
    },
    /// Upstream: the primary changed while it waited.
    #[error("the primary changed before its replicas acknowledged the lock")]
    Moved,
    /// Upstream: the primary could not be asked (down, or it refused).
    #[error("the primary could not be asked for its replicas ({0})")]
    Upstream(String),
    /// Internal: too many grants waiting already ([`MAX_WAITING`]).
    #[error("too many locks waiting for their replicas")]
    Full,
    /// Internal: lockgate stopped before the answer came.
    #[error("lockgate is shutting down")]
    Stopped,
}

/// What one round read, for [`judge`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Round {
    /// Replicas that hold everything written before the round (`WAIT`'s
    /// count), or what went wrong.
    pub acked: Result<i64, String>,
    /// The primary's generation as the round was sent ([`generation`]).
    pub before: u32,
    /// The primary's generation as the round ended.
    pub after: u32,
    /// When the round ended.
    pub now: Instant,
}

/// What a waiter is told after a round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing yet: it waits for the next round.
    Wait,
    /// Its outcome.
    Done(Result<(), AckError>),
}

/// The verdict of `round` on a waiter that wants `replicas`, whose grant
/// was planned in the primary's `generation`, and that waits until
/// `deadline`. A grant counts as held by the replicas only if the primary
/// never changed from its planning to the round's end: the acker follows
/// the primary, and another primary's replicas know nothing of it. A
/// round that could not ask leaves it waiting while its time lasts. (A
/// grant's own lease, or the client's own pipelined release, ending it
/// meanwhile changes nothing: it was granted, and what the replicas hold
/// is its end too.)
pub fn judge(round: &Round, replicas: u32, generation: u32, deadline: Instant) -> Verdict {
    if generation != round.before || round.before != round.after {
        return Verdict::Done(Err(AckError::Moved));
    }
    let acked = match &round.acked {
        Ok(n) => *n,
        // Not asked (the acker's connection reopening after a switch, a
        // call refused): asked again while its time lasts.
        Err(_) if round.now < deadline => return Verdict::Wait,
        Err(e) => return Verdict::Done(Err(AckError::Upstream(e.clone()))),
    };
    if acked >= i64::from(replicas) {
        return Verdict::Done(Ok(()));
    }
    if round.now >= deadline {
        return Verdict::Done(Err(AckError::Timeout {
            got: acked,
            wanted: replicas,
            timeout_ms: 0,
        }));
    }
    Verdict::Wait
}

counters! {
    /// What replica acknowledgement did.
    pub struct AckMetrics {
        /// Grants acknowledged by their replicas in time.
        acknowledged: Counter "lock_replica_acks",
            "Lock grants acknowledged by the replicas locks.replicas_ack asks before they were answered";
        /// Grants not acknowledged in time (undone, the client told so).
        timeouts: Counter "lock_replica_ack_timeouts",
            "Lock grants the replicas did not acknowledge within locks.replicas_ack_timeout_ms (undone)";
        /// Grants not acknowledged for another reason: the primary changed,
        /// the lease ended, the primary could not be asked, too many waiting.
        failures: Counter "lock_replica_ack_failures",
            "Lock grants not acknowledged because the primary changed, the lease ended or the primary could not be asked (undone)";
        /// Grants refused at once: too many waiting (`MAX_WAITING`).
        full: Counter "lock_replica_ack_full",
            "Lock grants refused because too many were waiting for their replicas";
        /// Unacknowledged grants undone on the primary by their own token.
        undone: Counter "lock_replica_ack_undone",
            "Unacknowledged lock grants released on the primary by their own token";
        /// Acknowledged grants forgotten before their leases ended
        /// (`switch::MAX_RECENT`): not vouched for after a switch.
        forgotten: Counter "lock_replica_ack_forgotten",
            "Acknowledged lock grants forgotten before their leases ended (more than 1024 remembered)";
        /// Acquisitions let through during the failover hold: their
        /// pattern asks for acknowledgement and the promoted replica was
        /// vouched for (`switch::unheld`).
        unheld: Counter "lock_failover_unheld",
            "Acquisitions not held after a switch of the primary: their pattern asks for replica acknowledgement and the promoted replica holds every acknowledged grant";
        /// Rounds asked (the marker set, then `WAIT`); against
        /// `lock_replica_acks`: grants per round.
        rounds: Counter "lock_replica_ack_rounds",
            "Rounds of WAIT lockgate sent for replica acknowledgement";
    }
}

/// Replica acknowledgement for one lock room: the acker, opened on first
/// use (an instance that never asks opens no connection), and its counters.
#[derive(Debug)]
pub struct Replicas {
    /// How to reach the primary (`None`: a store that reaches nothing).
    node: Option<NodeConfig>,
    primary: Arc<Primary>,
    stop: CancellationToken,
    slack: Duration,
    acker: OnceLock<mpsc::Sender<acker::Waiter>>,
    /// In front of a cluster: each shard's acker ([`shards`]).
    shards: shards::Shards,
    /// This run's name (`<ms>-<pid>`), the marker keys' hash tag.
    run: String,
    /// This process's marker key, which each round sets ([`acker`]).
    marker: Bytes,
    /// Acknowledged grants whose leases may still run, for the check
    /// after a switch ([`switch`]).
    recent: Mutex<switch::Recent>,
    /// The check after the latest switch: its primary's generation and
    /// what it concluded.
    switch_check: Mutex<Option<(u64, switch::Vouch)>>,
    /// In front of a cluster: the check after each shard's failover
    /// ([`promoted`]).
    shard_checks: promoted::Checks,
    /// The last round's number, every acker's ([`acker::Asks::rounds`]).
    rounds: Arc<AtomicU64>,
    /// Since when the acknowledgement settings in force apply.
    acks_since: Mutex<Instant>,
    /// `locks.replicas_ack_fsync`: rounds ask `WAITAOF` ([`acker`]).
    fsync: Arc<AtomicBool>,
    /// Counters (the acker counts its rounds).
    pub metrics: Arc<AckMetrics>,
    warn: RateLimit,
}

impl Replicas {
    /// Acknowledgement through a connection of its own made by `node`,
    /// following `primary`, stopping with `stop`; a round's calls may take
    /// `slack` longer than its `WAIT`.
    pub fn new(
        node: Option<NodeConfig>,
        primary: Arc<Primary>,
        stop: CancellationToken,
        slack: Duration,
    ) -> Replicas {
        let run = run_name();
        Replicas {
            node,
            primary,
            stop,
            slack,
            acker: OnceLock::new(),
            shards: shards::Shards::default(),
            marker: Bytes::from(format!("lockgate:acked:{{{run}}}")),
            run,
            recent: Mutex::new(switch::Recent::new()),
            switch_check: Mutex::new(None),
            shard_checks: promoted::Checks::default(),
            rounds: Arc::new(AtomicU64::new(0)),
            acks_since: Mutex::new(Instant::now()),
            fsync: Arc::new(AtomicBool::new(false)),
            metrics: Arc::new(AckMetrics::default()),
            warn: RateLimit::new(Duration::from_secs(10)),
        }
    }

    /// Waits until `rule.replicas` replicas hold everything the primary
    /// ran so far (a grant whose reply was read), at most `rule.timeout`;
    /// the grant was planned in the primary's generation `generation`
    /// (in front of a `cluster`: the slot map's, and the primary is the
    /// one serving `key`). `Ok`: the round that acknowledged it.
    pub async fn acknowledged(
        &self,
        cluster: Option<&Arc<ClusterPool>>,
        key: &[u8],
        generation: u32,
        rule: AckRule,
    ) -> Result<Acked, AckError> {
        let (tx, marker) = match cluster {
            Some(cluster) => {
                let start = shards::Start {
                    node: (self.node.as_ref()).ok_or(AckError::Upstream("no node".into()))?,
                    run: &self.run,
                    fsync: self.fsync.clone(),
                    rounds: self.rounds.clone(),
                    slack: self.slack,
                    metrics: self.metrics.clone(),
                    stop: self.stop.clone(),
                };
                self.shards.queue(cluster, key, start)?
            }
            None => {
                let acker = self.acker();
                let tx = acker.ok_or(AckError::Upstream("no primary".into()))?;
                (tx.clone(), self.marker.clone())
            }
        };
        let (done, rx) = oneshot::channel();
        let waiter = acker::Waiter {
            replicas: rule.replicas,
            deadline: Instant::now() + rule.timeout,
            generation,
            done,
        };
        if tx.try_send(waiter).is_err() {
            ProxyMetrics::inc(&self.metrics.full);
            return Err(AckError::Full);
        }
        match rx.await.unwrap_or(Err(AckError::Stopped)) {
            Ok(round) => Ok(Acked { round, marker }),
            Err(AckError::Timeout { got, wanted, .. }) => Err(AckError::Timeout {
                got,
                wanted,
                timeout_ms: rule.timeout.as_millis() as u64,
            }),
            Err(e) => Err(e),
        }
    }

    /// Puts `locks.replicas_ack_fsync` in force (the next round asks so).
    pub fn set_fsync(&self, on: bool) {
        self.fsync.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// The acker's queue, its connection opened and task started on first
    /// use.
    fn acker(&self) -> Option<&mpsc::Sender<acker::Waiter>> {
        let node = self.node.as_ref()?;
        Some(self.acker.get_or_init(|| {
            let (tx, rx) = mpsc::channel(MAX_WAITING);
            let conn = Node::spawn(node.clone(), self.stop.clone());
            let (primary, stop) = (self.primary.clone(), self.stop.clone());
            let metrics = self.metrics.clone();
            let (marker, fsync) = (self.marker.clone(), self.fsync.clone());
            let asks = acker::Asks {
                marker,
                fsync,
                slack: self.slack,
                rounds: self.rounds.clone(),
            };
            let primary = acker::Generation::Primary(primary);
            tokio::spawn(acker::run(conn, asks, primary, rx, metrics, stop));
            tx
        }))
    }
}

/// `primary`'s generation, truncated to 32 bits: only ever compared with
/// another, and a grant's record stays small on the lock path.
pub fn generation(primary: &Primary) -> u32 {
    primary.current().generation as u32
}

/// This run's name, `<ms>-<pid>`: the marker key is
/// `lockgate:acked:{<ms>-<pid>}`, unique to this run (a restarted lockgate
/// vouches only for its own rounds).
fn run_name() -> String {
    let ms = crate::lock::quorum::now_unix_ms();
    format!("{ms}-{}", std::process::id())
}

/// A grant that waits for its replicas before its client is answered.
pub(crate) struct Grant {
    /// What was granted, and its "not acquired".
    pub won: Won,
    /// The connection whose records hold it (`None`: a fencing lock,
    /// which no connection's records hold).
    pub conn: Option<Arc<Mutex<ConnLocks>>>,
    /// What its pattern asks.
    pub rule: AckRule,
}

/// Waits for `grant`'s acknowledgement and says what its client gets:
/// `Ok(yes)`, or, not acknowledged, `Err` of the refusal, the
/// grant undone by its own token on `primary` first and dropped from the
/// connection's records and `storm`'s view. Bounded: the acker answers
/// every waiter by its deadline (or ends with the drain), and the undo is
/// one call bounded by `timeout`.
pub(crate) async fn settle(
    replicas: &Replicas,
    primary: &OnPrimary,
    storm: &Storm,
    grant: Grant,
    yes: LocalReply,
    timeout: Duration,
) -> Result<LocalReply, LocalReply> {
    let Grant { won, conn, rule } = grant;
    let cluster = primary.cluster.as_ref();
    let outcome = (replicas.acknowledged(cluster, &won.key, won.primary_at, rule)).await;
    let e = match outcome {
        Ok(acked) => {
            ProxyMetrics::inc(&replicas.metrics.acknowledged);
            replicas.remember(&won, acked);
            return Ok(yes);
        }
        Err(e) => e,
    };
    match e {
        AckError::Timeout { .. } => ProxyMetrics::inc(&replicas.metrics.timeouts),
        _ => ProxyMetrics::inc(&replicas.metrics.failures),
    }
    if let Some(more) = replicas.warn.check() {
        tracing::warn!(
            key = %String::from_utf8_lossy(&won.key),
            reason = %e,
            suppressed = more,
            "a lock grant was not acknowledged by the replicas: undone (locks.replicas_ack)"
        );
    }
    if !won.undo {
        // An extension: the lock was its holder's before; it is told the
        // lease did not move where the replicas are.
        return Err(match (won.no, rule.refusal) {
            (Some(no), AckRefusal::NotAcquired) => no,
            _ => LocalReply::err(format!(
                "lockgate: lease not extended: {e} (locks.replicas_ack)"
            )),
        });
    }
    // Undone by its own token: never another owner's lock.
    let cmd =
        super::evalsha::eval_queued(script::RELEASE_TOKEN, &won.key, &[&won.token, &won.value]);
    if let Ok(reply) = primary.call(cmd, timeout).await {
        if reply.as_ref() == b":1\r\n" {
            ProxyMetrics::inc(&replicas.metrics.undone);
        }
    }
    if let Some(conn) = &conn {
        sync::lock(conn).settle(&won.key, &won.token, Standing::Lost, None);
    }
    storm.released(&won.key);
    Err(match (won.no, rule.refusal) {
        (Some(no), AckRefusal::NotAcquired) => no,
        _ => LocalReply::err(format!(
            "lockgate: lock not granted: {e} (locks.replicas_ack)"
        )),
    })
}
