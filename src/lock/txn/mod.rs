//! Locks on a server that refuses scripts (`EVAL`, `EVALSHA`, `FUNCTION`
//! and `FCALL` renamed away, or denied by an ACL), as some managed
//! services do. Every lock operation lockgate carries out is one of its
//! scripts ([`crate::script`]); on such a server each is carried out
//! instead as an optimistic transaction ([`emulate`]) on a connection of
//! lockgate's own ([`pool`]): `WATCH` the lock key and its owner record,
//! read, decide, then `MULTI` … `EXEC`, which Redis applies only if no
//! watched key changed in between, else it is tried again (up to
//! `locks.transaction_retries`). The owner record stays the truth, written
//! in the same atomic step as the lock.
//!
//! Detected once per connection of lockgate's own to the primary
//! (`COMMAND INFO EVALSHA` answers nil for a renamed command) and at the
//! first script a server refuses (an ACL); counted and logged once. The
//! client's lock command then runs away from its connection, as on the
//! quorum: nothing it pipelined behind it goes to Redis before it is done.
//! [`OnPrimary`] is lockgate's own connection to the primary as the lock
//! room sees it: scripts go as transactions when the server refuses them.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::metrics::counters;
use crate::metrics::ProxyMetrics;
use crate::metrics::RateLimit;
use crate::script::Script;
use crate::upstream::cluster::ClusterPool;
use crate::upstream::node::{Node, NodeConfig, NodeError, Request};

pub mod emulate;
mod pool;
pub(crate) mod resp;

use emulate::{Decision, Job};

/// How often the warning that the server refuses scripts may repeat.
const WARN_INTERVAL: Duration = Duration::from_secs(60);

/// Why a lock transaction failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TxnError {
    /// Upstream: every connection for lock transactions was in use for
    /// the whole wait.
    #[error(
        "all {0} connections for lock transactions are in use (locks.transaction_connections)"
    )]
    Busy(usize),
    /// Upstream: the connection failed or could not be opened.
    #[error("lock transaction connection: {0}")]
    Upstream(String),
    /// Upstream: no reply in time.
    #[error("lock transaction timed out")]
    Timeout,
    /// Upstream: a watched key changed at every try.
    #[error("the lock's keys changed during each of {0} tries")]
    Conflict(u32),
    /// Internal: a call lockgate made that is not one of its scripts.
    #[error("not a lock script lockgate can carry out without scripts")]
    Unknown,
}

counters! {
    /// What lock transactions did.
    pub struct TxnMetrics {
        /// Lock scripts carried out as transactions.
        runs: Counter "lock_transactions",
            "Lock operations carried out as WATCH/MULTI/EXEC transactions (the server refuses scripts)";
        /// Transactions tried again: a watched key changed.
        conflicts: Counter "lock_transaction_conflicts",
            "Lock transactions tried again because a watched key changed";
        /// Transactions that failed (busy, connection, retries exhausted).
        failures: Counter "lock_transaction_failures",
            "Lock transactions that failed: connections busy, upstream error, or retries exhausted";
    }
}

/// Lock scripts carried out as transactions (see the module doc).
pub struct Transactions {
    pool: pool::Pool,
    retries: u32,
    /// The server refuses scripts, as last seen.
    refused: AtomicBool,
    warn: RateLimit,
    /// The counters.
    pub metrics: TxnMetrics,
}

impl std::fmt::Debug for Transactions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transactions")
            .field("refused", &self.refused)
            .finish_non_exhaustive()
    }
}

impl Transactions {
    /// Transactions on connections opened with `config` (lockgate's own
    /// connection settings for the primary, following it), at most
    /// `max_connections` at once, each tried up to `retries` times.
    pub fn new(config: NodeConfig, max_connections: usize, retries: u32) -> Transactions {
        Transactions {
            pool: pool::Pool::new(config, max_connections),
            retries: retries.max(1),
            refused: AtomicBool::new(false),
            warn: RateLimit::new(WARN_INTERVAL),
            metrics: TxnMetrics::default(),
        }
    }

    /// The server refuses scripts: lock operations go as transactions.
    pub fn scriptless(&self) -> bool {
        self.refused.load(Ordering::Relaxed)
    }

    /// What a connection to the primary found as it opened (`refused`:
    /// `EVALSHA` unknown there), or a script it refused (`refused`: true):
    /// logged when it changes, at most once a minute.
    pub fn observed(&self, refused: bool) {
        let was = self.refused.swap(refused, Ordering::Relaxed);
        if refused && !was {
            if let Some(more) = self.warn.check() {
                tracing::warn!(
                    suppressed = more,
                    "the server refuses scripts: lock operations are carried out as WATCH/MULTI/EXEC transactions"
                );
            }
        }
    }

    /// Carries out `job` in database `db`, and answers as its script
    /// would have.
    async fn run_job(&self, job: &Job, db: u64, timeout: Duration) -> Result<Bytes, TxnError> {
        let (watch, reads) = (job.watch(), job.reads());
        if watch.is_empty() && reads.is_empty() {
            return match job.decide(&[]) {
                Decision::Answer(reply) => Ok(reply),
                Decision::Write { .. } => Err(TxnError::Unknown),
            };
        }
        let mut conn = self.pool.checkout(timeout).await?;
        let mut tries = 0;
        while tries < self.retries {
            tries += 1;
            let mut ask = Vec::with_capacity(3 + reads.len());
            if conn.watching {
                ask.push(resp::cmd(&[b"UNWATCH"]));
            }
            if conn.db != db {
                ask.push(resp::cmd(&[b"SELECT", db.to_string().as_bytes()]));
            }
            let mut w: Vec<&[u8]> = vec![b"WATCH"];
            w.extend(watch.iter().map(|k| &k[..]));
            ask.push(resp::cmd(&w));
            let skip = ask.len();
            ask.extend(reads.iter().cloned());
            // A failed exchange leaves the connection mid-reply: dropped.
            // On a connection kept idle, Redis may have closed it (a
            // restart): the reads change nothing, so they go again on a
            // new connection, once.
            let replies = match conn.ask(&ask, timeout).await {
                Ok(replies) => replies,
                Err(TxnError::Upstream(_)) if conn.reused => {
                    drop(conn);
                    self.pool.clear_idle();
                    conn = self.pool.checkout(timeout).await?;
                    tries -= 1;
                    continue;
                }
                Err(e) => return Err(e),
            };
            if let Some(e) = replies[..skip].iter().find(|r| resp::is_err(r)) {
                return Ok(e.clone());
            }
            conn.db = db;
            conn.watching = true;
            let (commands, memo) = match job.decide(&replies[skip..]) {
                Decision::Answer(reply) => {
                    self.pool.checkin(conn);
                    return Ok(reply);
                }
                Decision::Write { commands, memo } => (commands, memo),
            };
            let mut tx = Vec::with_capacity(commands.len() + 2);
            tx.push(resp::cmd(&[b"MULTI"]));
            tx.extend(commands);
            tx.push(resp::cmd(&[b"EXEC"]));
            let replies = conn.ask(&tx, timeout).await?;
            conn.watching = false;
            let exec = replies.last().cloned().unwrap_or_default();
            if resp::is_nil_array(&exec) {
                ProxyMetrics::inc(&self.metrics.conflicts);
                continue;
            }
            self.pool.checkin(conn);
            // Refused as it was queued (`EXECABORT`): nothing ran; the
            // first refusal says why.
            if resp::is_err(&exec) {
                let refused = replies[1..replies.len() - 1]
                    .iter()
                    .find(|r| resp::is_err(r));
                return Ok(refused.cloned().unwrap_or(exec));
            }
            let done = resp::elements(&exec).unwrap_or_default();
            return Ok(job.finish(&memo, &done));
        }
        self.pool.checkin(conn);
        Err(TxnError::Conflict(self.retries))
    }
}

#[cfg(test)]
mod tests;

impl crate::upstream::node::Observer for Transactions {
    fn connected(&self, _connection: u64, _addr: &str, report: &crate::upstream::node::Report) {
        self.observed(report.scripts_unknown);
    }
}

/// Whether `frame` is the server refusing a script call: `EVAL` or
/// `EVALSHA` unknown (renamed away) or denied by an ACL.
pub(crate) fn refuses_scripts(frame: &[u8]) -> bool {
    let lower = |p: &[u8]| frame.len() >= p.len() && frame[..p.len()].eq_ignore_ascii_case(p);
    lower(b"-ERR unknown command 'eval")
        || (lower(b"-NOPERM")
            && memchr::memmem::find(&frame.to_ascii_lowercase(), b"eval").is_some())
}

/// The script call `command` (`EVAL`/`EVALSHA`) as a [`Job`] and the
/// database it runs in: `db`, or the one a rerun's body selects first
/// (`redis.call('SELECT', n)`, see `evalsha::Call::eval_in`).
fn job_of(command: &[u8], db: u64) -> Option<(Job, u64)> {
    let args = resp::args(command)?;
    let name = args.first()?;
    let by_sha = name.eq_ignore_ascii_case(b"EVALSHA");
    if !by_sha && !name.eq_ignore_ascii_case(b"EVAL") {
        return None;
    }
    let mut first = *args.get(1)?;
    let mut db = db;
    const SELECT: &[u8] = b"redis.call('SELECT', ";
    if let Some(rest) = first.strip_prefix(SELECT).filter(|_| !by_sha) {
        let close = memchr::memchr(b')', rest)?;
        db = std::str::from_utf8(&rest[..close]).ok()?.parse().ok()?;
        first = rest.get(close + 2..)?;
    }
    // Guarded writes are never planned without scripts (their checks
    // need Lua's atomicity): their bodies are not carried out here.
    let kind = Script::of(by_sha, first)
        .filter(|s| !matches!(s, Script::Guard | Script::GuardTx | Script::Reconcile))?;
    let n: usize = std::str::from_utf8(args.get(2)?).ok()?.parse().ok()?;
    let rest = args.get(3..)?;
    let keys = rest
        .get(..n)?
        .iter()
        .map(|k| Bytes::copy_from_slice(k))
        .collect();
    let argv = rest[n..]
        .iter()
        .map(|a| Bytes::copy_from_slice(a))
        .collect();
    Some((Job { kind, keys, argv }, db))
}

/// lockgate's own connection to the primary as the lock room uses it:
/// the node, and the transactions its scripts become when the server
/// refuses scripts.
#[derive(Debug, Clone)]
pub struct OnPrimary {
    /// The pipelined connection.
    pub node: Node,
    /// Scripts as transactions (`None`: a store that reaches nothing).
    pub txn: Option<Arc<Transactions>>,
    /// In front of a Redis Cluster, the nodes: every call goes to the node
    /// serving its keys' slot instead of `node` (see
    /// [`ClusterPool::call`]).
    pub cluster: Option<Arc<ClusterPool>>,
}

/// A reply on its way from the primary.
pub type Reply = Pin<Box<dyn Future<Output = Result<Bytes, NodeError>> + Send + 'static>>;

impl OnPrimary {
    /// The primary's node with transactions `txn`.
    pub fn new(node: Node, txn: Option<Arc<Transactions>>) -> OnPrimary {
        OnPrimary {
            node,
            txn,
            cluster: None,
        }
    }

    /// The same, its calls routed by slot over `cluster`'s nodes.
    pub fn on_cluster(self, cluster: Option<Arc<ClusterPool>>) -> OnPrimary {
        OnPrimary { cluster, ..self }
    }

    /// The node's address.
    pub fn addr(&self) -> &str {
        self.node.addr()
    }

    /// The server refuses scripts, as last seen.
    pub fn scriptless(&self) -> bool {
        self.txn.as_ref().is_some_and(|t| t.scriptless())
    }

    /// Sends one command and waits up to `timeout` for its raw reply; a
    /// lock script goes as a transaction when the server refuses scripts.
    pub async fn call(&self, command: Bytes, timeout: Duration) -> Result<Bytes, NodeError> {
        self.send(command.into(), timeout).await
    }

    /// As [`Node::send`] (queued now), or, when the server refuses
    /// scripts and `request` is a lock script, carried out as a
    /// transaction in database 0. A lock script the server refuses (before
    /// lockgate knew it would: an ACL, or a call made before lockgate's own
    /// connection opened) is carried out as a transaction in its place.
    pub fn send(&self, request: Request, timeout: Duration) -> Reply {
        if let Some(cluster) = self.cluster.clone() {
            return Box::pin(async move { cluster.call(request, timeout).await });
        }
        let Some(txn) = self.txn.clone() else {
            return Box::pin(self.node.send(request, timeout));
        };
        if txn.scriptless() {
            if let Some(job) = job_of(&request.command, 0) {
                return self.as_transaction(txn, job, timeout);
            }
        }
        let command = request.command.clone();
        let sent = self.node.send(request, timeout);
        let me = self.clone();
        Box::pin(async move {
            let reply = sent.await?;
            if !refuses_scripts(&reply) {
                return Ok(reply);
            }
            let Some(job) = job_of(&command, 0) else {
                return Ok(reply);
            };
            txn.observed(true);
            me.as_transaction(txn, job, timeout).await
        })
    }

    /// `command`, a lock script's call, carried out as a transaction in
    /// database `db` (whether or not the server refuses scripts).
    pub fn transaction(&self, command: Bytes, db: u64, timeout: Duration) -> Reply {
        match (&self.txn, job_of(&command, db)) {
            (Some(txn), Some(job)) => self.as_transaction(txn.clone(), job, timeout),
            _ => {
                let e = resp::err(&format!("ERR lockgate: {}", TxnError::Unknown));
                Box::pin(async move { Ok(e) })
            }
        }
    }

    fn as_transaction(
        &self,
        txn: Arc<Transactions>,
        (job, db): (Job, u64),
        timeout: Duration,
    ) -> Reply {
        let addr = self.addr().to_string();
        Box::pin(async move {
            ProxyMetrics::inc(&txn.metrics.runs);
            let out = txn.run_job(&job, db, timeout).await;
            if out.is_err() {
                ProxyMetrics::inc(&txn.metrics.failures);
            }
            match out {
                Ok(reply) => Ok(reply),
                Err(TxnError::Timeout) => Err(NodeError::Timeout(addr)),
                Err(TxnError::Upstream(e)) => {
                    tracing::debug!(error = %e, "lock transaction failed");
                    Err(NodeError::Down(addr))
                }
                Err(e) => Ok(resp::err(&format!("ERR lockgate: {e}"))),
            }
        })
    }
}
