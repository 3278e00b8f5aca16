//! `LOCKGATE WATCH key token [TIMEOUT ms]`: a holder of a `LOCKGATE LOCK`
//! told when its lease is gone (issue 45): the call returns `:1` once the
//! lock `key` no longer holds `token` (released, run out, taken over, lost
//! in a failover), nil if it still does when `TIMEOUT` (at most a minute)
//! has passed. The holder runs it beside its work, on a connection of its
//! own, and stops writing when it returns.
//!
//! Who holds the lock is decided in Redis, not here: every
//! [`WATCH_STEP`] the lock is read where it lives (`GET key` on the
//! primary, or on every lock master: held while a majority hold the
//! token), so the holder hears of a loss within a step and a round trip.

use std::time::{Duration, Instant};

use bytes::Bytes;

use super::LockService;
use crate::protocol::encode::{self, LocalReply};

/// How often a watched lock is read.
pub const WATCH_STEP: Duration = Duration::from_millis(100);

impl LockService {
    /// `LOCKGATE WATCH`: `:1` once `key` no longer holds `token`, nil when
    /// `timeout` passed first, an error when the store cannot be read.
    pub(crate) async fn fence_watch(
        &self,
        key: Bytes,
        token: Bytes,
        timeout: Duration,
    ) -> LocalReply {
        let deadline = Instant::now() + timeout;
        loop {
            match self.held_by(&key, &token).await {
                Ok(false) => return LocalReply::Integer(1),
                Ok(true) => {}
                Err(e) => return e,
            }
            let now = Instant::now();
            if now >= deadline {
                return LocalReply::Null;
            }
            tokio::select! {
                _ = tokio::time::sleep(WATCH_STEP.min(deadline - now)) => {}
                _ = self.store().stopped() => return LocalReply::err("lockgate: shutting down"),
            }
        }
    }

    /// Whether `key` holds `token` where the locks live now.
    async fn held_by(&self, key: &[u8], token: &[u8]) -> Result<bool, LocalReply> {
        let get = encode::command(&[b"GET", key]);
        let want = bulk(token);
        let store = self.store();
        match self.quorum() {
            Some(q) => {
                let answers = q.ask_agreed(&get.into()).await;
                if answers.replies.len() < q.majority() {
                    return Err(q.no_quorum(answers.replies.len()));
                }
                let holding = answers.replies.iter().filter(|r| r[..] == want[..]).count();
                Ok(holding >= q.majority())
            }
            None => match store.primary.call(get, store.timeout()).await {
                Ok(reply) if reply.first() == Some(&b'-') => Err(LocalReply::Error(
                    reply.slice(1..reply.len().saturating_sub(2)),
                )),
                Ok(reply) => Ok(reply[..] == want[..]),
                Err(e) => Err(LocalReply::err(format!("lockgate: {e}"))),
            },
        }
    }
}

/// `token` as a RESP2 bulk string.
fn bulk(token: &[u8]) -> Vec<u8> {
    let mut out = format!("${}\r\n", token.len()).into_bytes();
    out.extend_from_slice(token);
    out.extend_from_slice(b"\r\n");
    out
}
