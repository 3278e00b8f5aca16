//! Work a session does itself for its commands (quorum operations,
//! `LOCKGATE` fencing calls): one job at a time, in command order, so a
//! pipelined `UNLOCK` never overtakes its `LOCK`. The replies go to the
//! writer half as deferred entries; the runner is part of the session's own
//! task, so it ends with the session and needs no shutdown of its own.

use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::admin::Work;
use crate::protocol::encode::LocalReply;

type Job = (Work, oneshot::Sender<LocalReply>);

/// The reader half's end: queues work.
#[derive(Clone)]
pub struct Jobs {
    tx: mpsc::Sender<Job>,
}

/// The runner's end.
pub struct Runner {
    rx: mpsc::Receiver<Job>,
}

/// A queue of at most `bound` jobs not yet started.
pub fn queue(bound: usize) -> (Jobs, Runner) {
    let (tx, rx) = mpsc::channel(bound.max(1));
    (Jobs { tx }, Runner { rx })
}

impl Jobs {
    /// Queues `work`; its reply arrives on the returned channel. A full
    /// queue is answered at once with an error (never waited on: the reader
    /// must not stall behind a slow job).
    pub fn defer(&self, work: Work) -> Result<oneshot::Receiver<LocalReply>, LocalReply> {
        let (tx, rx) = oneshot::channel();
        self.tx.try_send((work, tx)).map_err(|_| {
            LocalReply::err("lockgate: too many lockgate operations in flight on this connection")
        })?;
        Ok(rx)
    }
}

impl Runner {
    /// Runs jobs in order until the queue closes and is empty, or `gone`
    /// fires (the client connection is over: nobody waits for replies).
    pub async fn run(mut self, gone: &CancellationToken) {
        let run = async {
            while let Some((work, reply)) = self.rx.recv().await {
                let _ = reply.send(work.await);
            }
        };
        tokio::select! {
            _ = run => {}
            _ = gone.cancelled() => {}
        }
    }
}
