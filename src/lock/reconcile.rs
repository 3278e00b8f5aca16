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
//! A script may also acquire (node-redlock's multi-key acquisition: `SET
//! key value PX ms` for each of its keys, inside its script; Redisson's
//! hash lock: a holder field): a lock key found after it with a lease, no
//! owner record and a value (a hash: a field) the script was given among
//! its arguments ([`candidates`]) was taken by it. The key gets an owner
//! record with a token of this instance's, and the connection holds the
//! key by it: it is listed in `LOCKGATE LOCKS`, its owner check guards it
//! (a `DEL` from a connection opened after it is refused, as for any lock
//! taken through lockgate), and its library's own release and
//! extension scripts are followed from then on (`lock_script_adoptions`).
//! Only values of 8 to 512 bytes count, so a short value that happens to
//! equal an argument (`1`, a lease in ms) is not taken for a token.
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
    /// is over (the key was acquired again before the call ran, or, a
    /// shared hash lock, its holder field left while others hold it; its
    /// owner record then went).
    Superseded,
    /// The owner record's expiry moved to the key's lease.
    Extended,
    /// The script acquired the key with the value at this place among
    /// those the call named (from 0); an owner record was made for it,
    /// lapsing with the key's lease, whose milliseconds left follow.
    Adopted(usize, u64),
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
            _ if frame.starts_with(b"*3\r\n") && frame.ends_with(b"\r\n") => {
                match super::fence::integers(frame)[..] {
                    [2, place, pttl] => Some(Reconciled::Adopted(
                        usize::try_from(place).ok()?.checked_sub(1)?,
                        u64::try_from(pttl).ok()?,
                    )),
                    _ => None,
                }
            }
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

/// Most of a script's arguments offered as the value it may have
/// acquired a lock key with.
pub const MAX_CANDIDATES: usize = 4;

/// The values among a client script's arguments (`args`: the whole
/// `EVAL`/`EVALSHA`) that may be the value it acquired a lock key with:
/// the first [`MAX_CANDIDATES`] of its `ARGV` of 8 to 512 bytes (a library's
/// random token, Redisson's `uuid:thread`; not a count or a lease).
pub(crate) fn candidates(args: &[&[u8]]) -> Vec<Bytes> {
    let Some(n) = args
        .get(2)
        .and_then(|n| std::str::from_utf8(n).ok())
        .and_then(|n| n.parse::<usize>().ok())
    else {
        return Vec::new();
    };
    args.iter()
        .skip(3usize.saturating_add(n))
        .filter(|v| (8..=512).contains(&v.len()))
        .take(MAX_CANDIDATES)
        .map(|v| Bytes::copy_from_slice(v))
        .collect()
}

impl LockService {
    /// After a client's own script (or a transaction) on `keys`, which
    /// Redis ran without an error on the connection whose records are
    /// `conn`, in database 0: each key's owner record is reconciled with
    /// what it did (see the module doc), on lockgate's own connection, in
    /// the background; the client's reply does not wait for it.
    pub(crate) fn reconcile(
        self: &Arc<Self>,
        keys: &[Bytes],
        values: &[Bytes],
        conn: &Arc<Mutex<ConnLocks>>,
    ) {
        // "On masters": a client's command never reaches the masters, so
        // "a client script on lock keys" means one on the primary's data.
        if self.on_masters() || self.scriptless() {
            return;
        }
        let (me, conn, keys, values) = (self.clone(), conn.clone(), keys.to_vec(), values.to_vec());
        tokio::spawn(async move {
            let store = me.store();
            for key in keys {
                // What the connection holds is read as each call is made,
                // not when the script was sent: an acquisition by an
                // earlier script, adopted in between, is this one's to
                // follow.
                let (call, token, adopt) = me.reconcile_call(&key, &values, &conn);
                let sent = std::time::Instant::now();
                let reply = tokio::select! {
                    reply = store.primary.send(call, store.timeout()) => reply,
                    _ = store.stopped() => return,
                };
                let found = reply.ok().as_deref().and_then(Reconciled::of);
                if found.is_some() {
                    ProxyMetrics::inc(&me.metrics.script_reconciles);
                }
                if found.is_some_and(Reconciled::ends_holding) {
                    me.script_released(&key, &token, sent, &conn);
                }
                match found {
                    Some(Reconciled::Released) => ProxyMetrics::inc(&me.metrics.script_releases),
                    Some(Reconciled::Extended) => ProxyMetrics::inc(&me.metrics.script_extensions),
                    Some(Reconciled::Adopted(place, pttl)) => {
                        if let Some(value) = values.get(place) {
                            sync::lock(&conn).attempt(
                                key.clone(),
                                adopt,
                                value.clone(),
                                Standing::Held,
                                pttl,
                            );
                            ProxyMetrics::inc(&me.metrics.script_adoptions);
                        }
                    }
                    Some(_) => {}
                    None => ProxyMetrics::inc(&me.metrics.script_reconcile_failures),
                }
            }
        });
    }

    /// The reconciliation of `key` for the connection whose records are
    /// `conn`, as it holds the key now: the call, the token it holds the
    /// key by (empty: none with a known value) and, when it holds none,
    /// the new token an acquisition by the script among `values` is
    /// adopted with. By SHA1, its body the fallback should Redis not have
    /// it yet (`EVAL` of the body costs Redis four times the call).
    fn reconcile_call(
        &self,
        key: &Bytes,
        values: &[Bytes],
        conn: &Mutex<ConnLocks>,
    ) -> (Request, Bytes, Bytes) {
        let held = {
            let c = sync::lock(conn);
            c.get(key)
                .filter(|a| a.standing == Standing::Held && !a.value.is_empty())
                .map(|a| (a.token.clone(), a.value.clone()))
        };
        let all: [&[u8]; 4] = [key, &owner_key(key), &queue_key(key), &places_key(key)];
        match held {
            Some((token, value)) => {
                let call = Call::new(Script::Reconcile, &all, &[&token, &value]);
                (call.request(), token, Bytes::new())
            }
            None if values.is_empty() => {
                let call = Call::new(Script::Reconcile, &all, &[b"", b""]);
                (call.request(), Bytes::new(), Bytes::new())
            }
            None => {
                let adopt = self.tokens.next();
                let mut args: Vec<&[u8]> = vec![b"", b"", &adopt];
                args.extend(values.iter().map(|v| &v[..]));
                let call = Call::new(Script::Reconcile, &all, &args);
                (call.request(), Bytes::new(), adopt)
            }
        }
    }
}

impl LockService {
    /// A client's script released `key`, which the connection whose records
    /// are `conn` held by `token` when the script was sent (empty: it held
    /// none with a known value). If it still holds the key by that token,
    /// the holding is over ([`ConnLocks::script_released`]) and counted
    /// (`lock_hold_seconds`, the hot keys).
    ///
    /// With no token named, a holding made before the call was `sent`
    /// ends as well: the key it holds is gone or another's (an acquisition
    /// adopted after the call read the connection's records).
    fn script_released(
        &self,
        key: &Bytes,
        token: &Bytes,
        sent: std::time::Instant,
        conn: &Mutex<ConnLocks>,
    ) {
        let mut c = sync::lock(conn);
        let token = match token.is_empty() {
            false => token.clone(),
            true => match c.get(key) {
                Some(a) if a.standing == Standing::Held && a.since < sent => a.token.clone(),
                _ => return,
            },
        };
        let ended = c.script_released(key, &token);
        drop(c);
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
        let table: [(&[u8], Option<Reconciled>); 12] = [
            (
                b"*3\r\n:2\r\n:1\r\n:950\r\n",
                Some(Reconciled::Adopted(0, 950)),
            ),
            (b"*3\r\n:2\r\n:4\r\n:0\r\n", Some(Reconciled::Adopted(3, 0))),
            (b"*3\r\n:2\r\n:0\r\n:950\r\n", None),
            (b"*3\r\n:2\r\n:1\r\n:-1\r\n", None),
            (b"*3\r\n:2\r\n:1\r\n:9\r\nx", None),
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

    /// A script's arguments after its keys, of 8 to 512 bytes, the first
    /// four: what its acquisition's value may be.
    #[test]
    fn candidates_are_long_enough_arguments_after_the_keys() {
        let long = "v".repeat(513);
        let table: &[(&[&str], &[&str])] = &[
            // node-redlock: KEYS, then value and lease.
            (
                &[
                    "EVALSHA",
                    "sha",
                    "2",
                    "lock:a",
                    "lock:b",
                    "0123456789abcdef",
                    "1000",
                ],
                &["0123456789abcdef"],
            ),
            // Redisson: lease, then `uuid:thread`.
            (
                &[
                    "EVAL",
                    "body",
                    "1",
                    "lock:r",
                    "30000",
                    "8743c9c0-0795-4907:1",
                ],
                &["8743c9c0-0795-4907:1"],
            ),
            // A key is never a candidate, however long.
            (&["EVAL", "body", "1", "lock:a-very-long-name"], &[]),
            (
                &[
                    "EVAL", "body", "0", "12345678", &long, "a", "22222222", "33333333",
                    "44444444", "55555555",
                ],
                &["12345678", "22222222", "33333333", "44444444"],
            ),
            (&["EVAL", "body", "x", "12345678"], &[]),
            (&["EVAL"], &[]),
        ];
        for (args, want) in table {
            let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
            let got = candidates(&args);
            let want: Vec<Bytes> = want
                .iter()
                .map(|w| Bytes::copy_from_slice(w.as_bytes()))
                .collect();
            assert_eq!(got, want, "{args:?}");
        }
    }
}
