//! lockgate's own connections for lock transactions: `WATCH` is a
//! connection's state, so each transaction has a connection to itself from
//! its `WATCH` to its `EXEC`. At most `locks.transaction_connections` are
//! in use at once; one more waits for a free one up to the call's timeout,
//! then fails (counted). Idle connections are kept for the next
//! transaction, dropped when the primary changed (Sentinel) or when an
//! exchange on them failed: a connection that lost its place in its
//! replies is never used again.

use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::AsyncWriteExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::TxnError;
use crate::sync;
use crate::tls::Stream;
use crate::upstream::node::{handshake, FrameReader, NodeConfig};

/// One connection of the pool, checked out by one transaction.
pub(super) struct Conn {
    stream: Stream,
    reader: FrameReader,
    /// The database `SELECT`ed on it.
    pub db: u64,
    /// A `WATCH` may be left on it (a transaction that decided without
    /// writing): the next one starts with `UNWATCH`.
    pub watching: bool,
    /// The primary's generation it was opened to (Sentinel).
    generation: Option<u64>,
    /// Kept idle since an earlier transaction (it may have been closed
    /// by Redis since: a restart).
    pub reused: bool,
    _permit: OwnedSemaphorePermit,
}

/// The pool (see the module doc).
pub(super) struct Pool {
    config: NodeConfig,
    idle: Mutex<Vec<Idle>>,
    permits: Arc<Semaphore>,
    max: usize,
}

struct Idle {
    stream: Stream,
    reader: FrameReader,
    db: u64,
    watching: bool,
    generation: Option<u64>,
}

impl Pool {
    /// A pool of at most `max` connections opened with `config` (which
    /// follows the primary when Sentinel finds it).
    pub fn new(config: NodeConfig, max: usize) -> Pool {
        Pool {
            config,
            idle: Mutex::new(Vec::new()),
            permits: Arc::new(Semaphore::new(max.max(1))),
            max: max.max(1),
        }
    }

    /// A connection for one transaction, waiting up to `timeout` for a
    /// free one and for it to open.
    pub async fn checkout(&self, timeout: Duration) -> Result<Conn, TxnError> {
        let permits = self.permits.clone();
        let permit = tokio::time::timeout(timeout, permits.acquire_owned())
            .await
            .map_err(|_| TxnError::Busy(self.max))?
            .map_err(|_| TxnError::Busy(self.max))?;
        let (config, generation) = tokio::time::timeout(timeout, self.config.resolve())
            .await
            .map_err(|_| TxnError::Upstream("no primary confirmed".to_string()))?;
        let reused = {
            let mut idle = sync::lock(&self.idle);
            // Connections to a primary that was replaced are closed.
            idle.retain(|c| c.generation == generation);
            idle.pop()
        };
        if let Some(c) = reused {
            return Ok(Conn {
                stream: c.stream,
                reader: c.reader,
                db: c.db,
                watching: c.watching,
                generation: c.generation,
                reused: true,
                _permit: permit,
            });
        }
        let stream = handshake(&config).await.map_err(TxnError::Upstream)?;
        Ok(Conn {
            stream,
            reader: FrameReader::new(),
            db: 0,
            watching: false,
            generation,
            reused: false,
            _permit: permit,
        })
    }

    /// Closes every idle connection (one was found closed by Redis: the
    /// others, opened before the same restart, are too).
    pub fn clear_idle(&self) {
        sync::lock(&self.idle).clear();
    }

    /// Gives back a connection whose every reply was read.
    pub fn checkin(&self, c: Conn) {
        let mut idle = sync::lock(&self.idle);
        if idle.len() < self.max {
            idle.push(Idle {
                stream: c.stream,
                reader: c.reader,
                db: c.db,
                watching: c.watching,
                generation: c.generation,
            });
        }
    }
}

impl Conn {
    /// Writes `commands` in one write and reads one reply for each, all
    /// within `timeout`. On an error the connection must be dropped.
    pub async fn ask(
        &mut self,
        commands: &[Bytes],
        timeout: Duration,
    ) -> Result<Vec<Bytes>, TxnError> {
        let io = async {
            let mut out = BytesMut::with_capacity(commands.iter().map(|c| c.len()).sum());
            for c in commands {
                out.extend_from_slice(c);
            }
            self.stream
                .write_all(&out)
                .await
                .map_err(|e| TxnError::Upstream(e.to_string()))?;
            self.stream
                .flush()
                .await
                .map_err(|e| TxnError::Upstream(e.to_string()))?;
            let mut replies = Vec::with_capacity(commands.len());
            for _ in commands {
                let frame = self
                    .reader
                    .next(&mut self.stream)
                    .await
                    .map_err(TxnError::Upstream)?;
                replies.push(frame.freeze());
            }
            Ok(replies)
        };
        tokio::time::timeout(timeout, io)
            .await
            .unwrap_or(Err(TxnError::Timeout))
    }
}
