//! Owner records made true to what a client's own script did to its lock
//! keys. A lock library releases and extends with its own scripts (redis-py's
//! `Lock`, python-redis-lock, pottery, node-redlock): lockgate took their
//! `SET … NX PX` over and wrote an owner record beside the key, which their
//! scripts know nothing of. Left alone, a key a library deleted keeps its
//! owner record until that lapses (`LOCKGATE LOCKS` shows it held by this
//! instance), and a key a library extended outlives its owner record,
//! after which nothing says it is held through lockgate and its owner
//! check no longer guards it.
//!
//! So once such a script has run (its reply passed to the client as it
//! came), lockgate looks at what it did, in one atomic step on its own
//! connection ([`crate::script::RECONCILE`]): a key gone takes its owner
//! record with it and wakes the key's queue, as a release does; a key
//! extended by its holder's script carries its owner record along. What
//! the script did is read from Redis, not guessed from its text, so any
//! library's script is served the same. The connection's own record of
//! the acquisition (its token and value) only says which acquisition an
//! extension may carry along; without one (the script ran on another
//! connection of a pool) a deletion is still followed, an extension not.
//! With one, a holding found over (its key gone, or held by an
//! acquisition made since) ends there too: it leaves `LOCKGATE LOCKS`
//! and its hold is counted (`lock_hold_seconds`, the hot keys' own).
//!
//! Deliberately not here: the quorum (a client script on lock keys runs on
//! every master; a reconciliation would have to as well) and a server
//! that refuses scripts (no client script runs there to reconcile).
//! Commands the client pipelined after its script may run before the
//! reconciliation: each rule checks the keys as they are then.

use std::sync::{Arc, Mutex};

use bytes::Bytes;

use super::evalsha::Call;
use super::lease::{ConnLocks, Standing};
use super::{owner_key, places_key, queue_key, LockService};
use crate::metrics::ProxyMetrics;
use crate::script::Script;
use crate::sync;
use crate::upstream::node::Request;

/// What one reconciliation found (the script's reply).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reconciled {
    /// The key is gone and so is its owner record.
    Released,
    /// The key is gone, its owner record was already: the holding the
    /// call named is over.
    Gone,
    /// The key is held by another acquisition: the holding the call named
    /// is over (the key was acquired again before the call ran).
    Superseded,
    /// The owner record's expiry moved to the key's lease.
    Extended,
    /// Nothing to change.
    Unchanged,
}

impl Reconciled {
    /// [`crate::script::RECONCILE`]'s reply; `None` for anything else (an
    /// error).
    pub(crate) fn of(frame: &[u8]) -> Option<Reconciled> {
        match frame {
            b":-2\r\n" => Some(Reconciled::Released),
            b":-3\r\n" => Some(Reconciled::Gone),
            b":-1\r\n" => Some(Reconciled::Superseded),
            b":1\r\n" => Some(Reconciled::Extended),
            b":0\r\n" => Some(Reconciled::Unchanged),
            _ => None,
        }
    }

    /// Whether the holding the call named (if it named one) is over.
    fn ends_holding(self) -> bool {
        matches!(
            self,
            Reconciled::Released | Reconciled::Gone | Reconciled::Superseded
        )
    }
}

impl LockService {
    /// After a client's own script (or a transaction) on `keys`, which
    /// Redis ran without an error on the connection whose records are
    /// `conn`, in database 0: each key's owner record is reconciled with
    /// what it did (see the module doc), on lockgate's own connection, in
    /// the background; the client's reply does not wait for it.
    pub(crate) fn reconcile(self: &Arc<Self>, keys: &[Bytes], conn: &Arc<Mutex<ConnLocks>>) {
        // "On masters": a client's command never reaches the masters, so
        // "a client script on lock keys" means one on the primary's data.
        if self.on_masters() || self.scriptless() {
            return;
        }
        // By SHA1, its body the fallback should Redis not have it yet
        // (`EVAL` of the body costs Redis four times the call).
        let calls: Vec<(Bytes, Bytes, Request)> = {
            let c = sync::lock(conn);
            keys.iter()
                .map(|key| {
                    let held = c.get(key).filter(|a| a.standing == Standing::Held);
                    let (token, value) = match held {
                        Some(a) if !a.value.is_empty() => (a.token.clone(), a.value.clone()),
                        _ => (Bytes::new(), Bytes::new()),
                    };
                    let all: [&[u8]; 4] = [key, &owner_key(key), &queue_key(key), &places_key(key)];
                    let call = Call::new(Script::Reconcile, &all, &[&token, &value]);
                    (key.clone(), token, call.request())
                })
                .collect()
        };
        let (me, conn) = (self.clone(), conn.clone());
        tokio::spawn(async move {
            let store = me.store();
            for (key, token, call) in calls {
                let reply = tokio::select! {
                    reply = store.primary.send(call, store.timeout()) => reply,
                    _ = store.stopped() => return,
                };
                let found = reply.ok().as_deref().and_then(Reconciled::of);
                if found.is_some() {
                    ProxyMetrics::inc(&me.metrics.script_reconciles);
                }
                if found.is_some_and(Reconciled::ends_holding) {
                    me.script_released(&key, &token, &conn);
                }
                match found {
                    Some(Reconciled::Released) => ProxyMetrics::inc(&me.metrics.script_releases),
                    Some(Reconciled::Extended) => ProxyMetrics::inc(&me.metrics.script_extensions),
                    Some(_) => {}
                    None => ProxyMetrics::inc(&me.metrics.script_reconcile_failures),
                }
            }
        });
    }
}

impl LockService {
    /// A client's script released `key`, which the connection whose records
    /// are `conn` held by `token` when the script was sent (empty: it held
    /// none with a known value). If it still holds the key by that token,
    /// the holding is over ([`ConnLocks::script_released`]) and counted
    /// (`lock_hold_seconds`, the hot keys).
    fn script_released(&self, key: &Bytes, token: &Bytes, conn: &Mutex<ConnLocks>) {
        if token.is_empty() {
            return;
        }
        let ended = sync::lock(conn).script_released(key, token);
        if let Some(rec) = ended {
            self.held(key, &rec);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_read_as_the_script_answers() {
        let table: [(&[u8], Option<Reconciled>); 7] = [
            (b":-2\r\n", Some(Reconciled::Released)),
            (b":-3\r\n", Some(Reconciled::Gone)),
            (b":-1\r\n", Some(Reconciled::Superseded)),
            (b":1\r\n", Some(Reconciled::Extended)),
            (b":0\r\n", Some(Reconciled::Unchanged)),
            (b"-ERR no\r\n", None),
            (b"$-1\r\n", None),
        ];
        for (frame, want) in table {
            assert_eq!(Reconciled::of(frame), want, "{frame:?}");
        }
    }
}
