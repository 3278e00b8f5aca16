//! Redis's own command table for guarded writes: `COMMAND`, read from the
//! primary on lockgate's own connection while guards are configured, again
//! after each reconnection (a failover may bring another version), so a
//! write is known by the server's `write` flag and its keys by the
//! server's key specifications ([`crate::cluster::keys::KeyTable`]), not
//! by a list built into lockgate. Until it is read, a command on a
//! guarded key cannot be told a read from a write: refused in `refuse`
//! mode, passed and counted in `report` mode (see
//! [`super::Uncheckable::NoTable`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::cluster::keys::KeyTable;
use crate::lock::LockService;
use crate::protocol::encode;
use crate::upstream::cluster::ClusterPool;
use crate::upstream::node::Node;

/// The command table in force (empty until read).
#[derive(Debug, Default)]
pub struct GuardTable {
    table: RwLock<Arc<KeyTable>>,
    /// The primary connection's `connects` count when it was read.
    read_at: AtomicU64,
    /// Told each time a table is put in force.
    loaded: tokio::sync::Notify,
}

impl GuardTable {
    /// The table in force.
    pub fn get(&self) -> Arc<KeyTable> {
        crate::sync::read(&self.table).clone()
    }

    /// Puts `table` in force.
    pub fn set(&self, table: KeyTable) {
        self.set_shared(Arc::new(table));
    }

    fn set_shared(&self, table: Arc<KeyTable>) {
        *crate::sync::write(&self.table) = table;
        self.loaded.notify_waiters();
    }

    /// Whether a table is in force.
    pub fn is_read(&self) -> bool {
        !self.get().is_empty()
    }

    /// Waits until a table is in force, at most `limit`; whether one is.
    pub async fn read_within(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let told = self.loaded.notified();
            tokio::pin!(told);
            // Registered before the look, so a table put in force between
            // the two is not missed.
            told.as_mut().enable();
            if self.is_read() {
                return true;
            }
            if tokio::time::timeout_at(deadline, told).await.is_err() {
                return self.is_read();
            }
        }
    }
}

/// Where the command table is read.
#[derive(Debug, Clone)]
pub enum Source {
    /// `COMMAND` on lockgate's own connection to the primary.
    Primary(Node),
    /// The table a cluster's pool read from its nodes (taken as it is).
    Cluster(Arc<ClusterPool>),
}

/// How often the loader looks again while the table is not read.
const RETRY: Duration = Duration::from_millis(200);

/// Starts the loader: while guards are configured, reads `COMMAND` from
/// the primary when the table is empty or the connection reopened since
/// (each call bounded by `timeout`), or takes a cluster pool's table; it
/// stops with `stop`.
pub fn spawn(locks: Arc<LockService>, source: Source, timeout: Duration, stop: CancellationToken) {
    tokio::spawn(async move {
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = async {
                match &source {
                    Source::Primary(primary) => run(&locks, primary, timeout).await,
                    Source::Cluster(pool) => follow(&locks, pool).await,
                }
            } => {}
        }
    });
}

/// In front of a cluster: the pool's table, taken again as it changes.
async fn follow(locks: &LockService, pool: &ClusterPool) {
    loop {
        let table = pool.key_table();
        if !Arc::ptr_eq(&table, &locks.guard_table.get()) && !table.is_empty() {
            locks.guard_table.set_shared(table);
        }
        let wait = match locks.guard_table.get().is_empty() {
            true => RETRY,
            false => locks.eviction_interval(),
        };
        tokio::time::sleep(wait).await;
    }
}

async fn run(locks: &LockService, primary: &Node, timeout: Duration) {
    let table = &locks.guard_table;
    loop {
        let connects = primary.state.connects.load(Ordering::Relaxed);
        let stale = table.get().is_empty() || table.read_at.load(Ordering::Relaxed) != connects;
        if locks.guards_on() && stale && primary.state.up.load(Ordering::Relaxed) {
            match primary.call(encode::command(&[b"COMMAND"]), timeout).await {
                Ok(reply) => match KeyTable::from_command(&reply) {
                    Ok(t) if !t.is_empty() => {
                        tracing::info!(commands = t.len(), "command table read for guarded writes");
                        table.set(t);
                        table.read_at.store(connects, Ordering::Relaxed);
                    }
                    Ok(_) | Err(_) => {
                        tracing::warn!("COMMAND gave no usable command table; guarded writes cannot be told from reads")
                    }
                },
                Err(e) => {
                    tracing::debug!(error = %e, "COMMAND for guarded writes failed; trying again")
                }
            }
        }
        let wait = match table.get().is_empty() {
            true => RETRY,
            false => locks.eviction_interval(),
        };
        tokio::time::sleep(wait).await;
    }
}
