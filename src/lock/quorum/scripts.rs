//! Client script bodies on the quorum: lockgate remembers the bodies it
//! sees (`EVAL`, `SCRIPT LOAD`) so that an `EVALSHA` a master answers
//! `NOSCRIPT` (it restarted, or never saw the load) can be resent as
//! `EVAL`, and loads `SCRIPT LOAD`ed bodies on every master. The session
//! only says which body it saw.

use std::sync::Arc;

use bytes::Bytes;
use tokio_util::sync::CancellationToken;

use super::Quorum;
use crate::protocol::encode;

/// Most script bodies remembered for masters that lost them.
const MAX_REMEMBERED_SCRIPTS: usize = 10_000;

impl Quorum {
    /// Remembers `body` under its SHA1 (up to 10 000 bodies; one already
    /// known is always refreshed).
    pub fn remember_script(&self, body: &[u8]) {
        let sha = sha1_smol::Sha1::from(body).digest().to_string();
        if self.scripts.len() < MAX_REMEMBERED_SCRIPTS || self.scripts.contains_key(&sha) {
            self.scripts.insert(sha, Bytes::copy_from_slice(body));
        }
    }

    /// Loads `body` on every master in the background (a client's
    /// `SCRIPT LOAD`, so a later `EVALSHA` finds it), giving up at `stop`.
    pub fn load_script_everywhere(self: &Arc<Self>, body: &[u8], stop: &CancellationToken) {
        let load = encode::command(&[b"SCRIPT", b"LOAD", body]).into();
        let (q, stop) = (self.clone(), stop.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = q.ask_all(&load) => {}
                _ = stop.cancelled() => {}
            }
        });
    }

    /// For an `EVALSHA` (`args`: the whole command) on the quorum: the same
    /// call as `EVAL` with the body lockgate has seen, for masters that
    /// answer `NOSCRIPT`. `None` for any other command or an unknown SHA1.
    pub fn eval_fallback(&self, args: &[&[u8]]) -> Option<Bytes> {
        let name = args.first()?.to_ascii_uppercase();
        if !name.starts_with(b"EVALSHA") {
            return None;
        }
        let sha = String::from_utf8_lossy(args.get(1)?).to_ascii_lowercase();
        let body = self.scripts.get(&sha)?.clone();
        let mut all = args.to_vec();
        all[0] = if name == b"EVALSHA_RO" {
            b"EVAL_RO"
        } else {
            b"EVAL"
        };
        all[1] = &body;
        Some(encode::command(&all))
    }
}
