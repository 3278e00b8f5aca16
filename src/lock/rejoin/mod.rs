//! Rejoining the quorum with the fencing counters. A lock master that
//! returns (restarted, reconnected before it got them, or first seen by
//! lockgate moments after it started) may lack the per-key token counters
//! `lockgate:fence:{key}`. Before it may vote in acquisitions again, the
//! counters of a majority of the other masters are copied to it, only ever
//! raising a counter. Otherwise a rolling restart (a sequence of minority
//! failures) could leave a majority of empty masters and hand out token 1
//! again. The safety argument is in `docs/quorum.md`.

mod copy;

pub use self::copy::{RAISE, SCAN_COUNT};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use self::copy::{copy_from, Endpoint};
use super::node::NodeError;
use super::quorum::Quorum;
use crate::metrics::ProxyMetrics;
use crate::sync;

/// How often returning masters are looked at.
const TICK: Duration = Duration::from_millis(50);
/// Added to twice the node timeout before a copy may read (see
/// [`Admission::require_copy`]): room for a late timer on a loaded host.
const SETTLE_MARGIN: Duration = Duration::from_millis(100);
/// Least time one copy call may take (a page of counters is more work
/// than a lock call).
const MIN_CALL_TIMEOUT: Duration = Duration::from_millis(250);
/// Longest pause between two failed copy rounds for one master.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Why a copy round did not admit a master.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RejoinError {
    /// Fewer masters hold their counters than a copy needs.
    #[error("{have} of the other masters hold their fence counters, {need} needed")]
    TooFewSources {
        /// Masters connected and admitted (or all connected, best effort).
        have: usize,
        /// The majority.
        need: usize,
    },
    /// A call to a master failed.
    #[error(transparent)]
    Node(#[from] NodeError),
    /// A master answered something else than expected.
    #[error("master {0} answered {1:?}")]
    Reply(String, String),
    /// A master's connection changed during the copy: what was read or
    /// written may belong to another run of it.
    #[error("master {0} reconnected during the copy")]
    Reconnected(String),
}

/// Whether a master's current connection holds the fence counters, and
/// when a copy to it is due.
#[derive(Debug)]
pub struct Admission {
    /// The connection (`NodeState::connects`) whose counters are known
    /// current; 0: none.
    admitted: AtomicU64,
    /// A copy owed: for which connection, not before when, failures so far.
    owed: Mutex<Option<(u64, Instant, u32)>>,
    /// How long after a return a copy may first read (see
    /// [`Admission::require_copy`]).
    settle: Duration,
}

impl Admission {
    /// Nothing admitted yet; copies settle `2 × node_timeout` + a margin.
    pub fn new(node_timeout: Duration) -> Admission {
        Admission {
            admitted: AtomicU64::new(0),
            owed: Mutex::new(None),
            settle: node_timeout * 2 + SETTLE_MARGIN,
        }
    }

    /// Trusts connection `connects` as it is (a master that has run longer
    /// than the rejoin delay when lockgate first sees it).
    pub fn trust(&self, connects: u64) {
        self.admitted.store(connects, Ordering::Relaxed);
        *sync::lock(&self.owed) = None;
    }

    /// Connection `connects` must get the counters copied before it votes.
    // The copy reads only `settle` after now: a commit lockgate counted was
    // acknowledged within node_timeout of being sent, and any commit the
    // lost run had acknowledged was sent before now, so every master that
    // acknowledged it did so before the copy reads (docs/quorum.md).
    pub fn require_copy(&self, connects: u64) {
        *sync::lock(&self.owed) = Some((connects, Instant::now() + self.settle, 0));
    }

    /// Whether connection `connects` holds the counters.
    pub fn is_admitted(&self, connects: u64) -> bool {
        connects > 0 && self.admitted.load(Ordering::Relaxed) == connects
    }

    /// Whether a copy to connection `connects` is due now.
    fn due(&self, connects: u64) -> bool {
        sync::lock(&self.owed).is_some_and(|(c, at, _)| c == connects && Instant::now() >= at)
    }

    /// A copy to connection `connects` completed.
    fn admit(&self, connects: u64) {
        let mut owed = sync::lock(&self.owed);
        if owed.is_some_and(|(c, _, _)| c == connects) {
            *owed = None;
            self.admitted.store(connects, Ordering::Relaxed);
        }
    }

    /// A copy to connection `connects` failed: try again later, backing off.
    fn failed(&self, connects: u64) {
        let mut owed = sync::lock(&self.owed);
        if let Some((_, at, n)) = owed.as_mut().filter(|(c, _, _)| *c == connects) {
            let pause = (TICK * 2u32.saturating_pow(*n)).min(MAX_BACKOFF);
            *at = Instant::now() + pause;
            *n = n.saturating_add(1);
        }
    }
}

/// Starts the task that copies the counters to returning masters; it stops
/// with `stop`.
pub fn spawn(quorum: Arc<Quorum>, stop: CancellationToken) {
    tokio::spawn(async move {
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = run(&quorum) => {}
        }
    });
}

async fn run(q: &Quorum) {
    // Copies normally read from a majority of the other masters, each
    // holding its counters. One case cannot wait for that: until this
    // lockgate has seen a majority of masters hold their counters it has
    // granted nothing, and when a majority of the masters were young at
    // first sight (a fresh deployment, a whole quorum restarted) nothing a
    // majority held survived anyway (a failure beyond the model). Copies
    // then read from the connected masters whatever their state, best
    // effort, once they and the returning one make a majority, instead of
    // waiting for ever. A minority of young masters never takes this path,
    // so a slow connection to an old master cannot make it skip the copy.
    let mut bootstrap = true;
    loop {
        let connects = |m: usize| q.masters[m].node.state.connects.load(Ordering::Relaxed);
        let admitted = (0..q.masters.len())
            .filter(|&m| q.masters[m].admission.is_admitted(connects(m)))
            .count();
        if admitted >= q.majority() {
            bootstrap = false;
        }
        let young = q
            .masters
            .iter()
            .filter(|m| m.young_at_first_sight())
            .count();
        let best_effort = bootstrap && young >= q.majority();
        let due: Vec<usize> = (0..q.masters.len())
            .filter(|&m| {
                let master = &q.masters[m];
                master.node.state.up.load(Ordering::Relaxed) && master.admission.due(connects(m))
            })
            .collect();
        let rounds = due.iter().map(|&m| round(q, m, best_effort));
        futures_util::future::join_all(rounds).await;
        tokio::time::sleep(TICK).await;
    }
}

/// One copy round to master `target`; admits it on success.
async fn round(q: &Quorum, target: usize, best_effort: bool) {
    let m = &q.masters[target];
    let connects = m.node.state.connects.load(Ordering::Relaxed);
    match copy(q, target, connects, best_effort).await {
        Ok(copied) => {
            m.admission.admit(connects);
            ProxyMetrics::inc(&q.rejoin.copies);
            q.rejoin
                .counters_copied
                .fetch_add(copied, Ordering::Relaxed);
            tracing::info!(
                master = m.node.addr(),
                copied,
                best_effort,
                "lock master holds the fence counters again"
            );
        }
        Err(e) => {
            ProxyMetrics::inc(&q.rejoin.copy_failures);
            m.admission.failed(connects);
            tracing::warn!(
                master = m.node.addr(),
                error = %e,
                "fence counters not copied; the master keeps sitting out"
            );
        }
    }
}

/// Copies every counter of each source (the other masters holding theirs;
/// `best_effort`: every other connected one) to `target`'s connection
/// `connects`; succeeds once a majority of the masters were copied whole
/// (not counting `target`, unless `best_effort`). Returns the counters
/// raised.
async fn copy(
    q: &Quorum,
    target: usize,
    connects: u64,
    best_effort: bool,
) -> Result<u64, RejoinError> {
    // Any majority of masters holding their counters includes one that
    // acknowledged each committed token (docs/quorum.md).
    let need = match best_effort {
        false => q.majority(),
        true => q.majority() - 1,
    };
    let sources: Vec<(usize, u64)> = (0..q.masters.len())
        .filter(|&s| s != target)
        .filter_map(|s| {
            let st = &q.masters[s].node.state;
            let c = st.connects.load(Ordering::Relaxed);
            let holds = best_effort || q.masters[s].admission.is_admitted(c);
            (st.up.load(Ordering::Relaxed) && holds).then_some((s, c))
        })
        .collect();
    if sources.len() < need {
        return Err(RejoinError::TooFewSources {
            have: sources.len(),
            need,
        });
    }
    let timeout = q.node_timeout().max(MIN_CALL_TIMEOUT);
    let dst = Endpoint {
        node: &q.masters[target].node,
        connects,
    };
    let copies = sources.iter().map(|&(s, c)| {
        let src = Endpoint {
            node: &q.masters[s].node,
            connects: c,
        };
        copy_from(src, dst, timeout)
    });
    let results = futures_util::future::join_all(copies).await;
    dst.same()?;
    let mut copied = 0;
    let mut whole = 0;
    let mut error = None;
    for r in results {
        match r {
            Ok(n) => {
                copied += n;
                whole += 1;
            }
            Err(e) => error = Some(e),
        }
    }
    match (whole >= need, error) {
        (true, _) => Ok(copied),
        (false, Some(e)) => Err(e),
        (false, None) => Err(RejoinError::TooFewSources { have: whole, need }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_copies_back_off_and_a_new_connection_starts_over() {
        let a = Admission::new(Duration::ZERO);
        assert!(!a.is_admitted(0));
        a.require_copy(3);
        // settle is the margin alone here.
        assert!(!a.due(3));
        a.failed(3);
        assert!(!a.due(3));
        a.admit(2);
        assert!(
            !a.is_admitted(2),
            "a copy to an older connection admits nothing"
        );
        a.admit(3);
        assert!(a.is_admitted(3));
        assert!(!a.is_admitted(4));
        a.trust(5);
        assert!(a.is_admitted(5));
    }
}
