//! This instance's client connections as operators see them in the lock
//! room: who each is (address, `CLIENT SETNAME` name) and where its lock
//! records are, so `LOCKGATE LOCKS` names the connection holding a lock
//! and `LOCKGATE WAITERS` the ones parked on it.
//!
//! One entry per connection, added when its session starts and removed
//! when it ends (bounded by `proxy.max_clients`); nothing here is touched
//! per command but a `CLIENT SETNAME`. The records themselves stay the
//! session's ([`ConnLocks`]): they are read only when an operator asks.

use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use bytes::Bytes;
use dashmap::DashMap;

use super::lease::{ConnId, ConnLocks, Standing};
use crate::sync;

/// The acquisition id operators see for a token: the first 16 hex digits
/// of its SHA1. It names one acquisition (what `LOCKGATE RELEASE` takes)
/// without showing the token, which would let its reader act as the
/// holder; the release script computes the same from the owner record.
pub fn acquisition_id(token: &[u8]) -> String {
    let mut hex = sha1_smol::Sha1::from(token).digest().to_string();
    hex.truncate(ACQUISITION_HEX);
    hex
}

/// Hex digits of an acquisition id.
pub const ACQUISITION_HEX: usize = 16;

/// Who a connection is.
#[derive(Debug, Clone, Default)]
pub struct Client {
    /// The peer address, `ip:port`.
    pub addr: String,
    /// Its last `CLIENT SETNAME` (or `HELLO … SETNAME`) seen going to
    /// Redis; empty: none.
    pub name: Bytes,
}

#[derive(Debug)]
struct Entry {
    client: Client,
    locks: Weak<Mutex<ConnLocks>>,
}

/// A lock this instance's connection holds, as its records say.
#[derive(Debug, Clone)]
pub struct Hold {
    /// The lock key.
    pub key: Bytes,
    /// [`acquisition_id`] of the token.
    pub acquisition: String,
    /// The connection.
    pub client: Client,
    /// When it was acquired.
    pub since: Instant,
}

/// The registry (see the module doc).
#[derive(Debug, Default)]
pub struct Conns {
    map: DashMap<ConnId, Entry>,
}

impl Conns {
    /// A session started for `addr`, its records `locks`.
    pub fn add(&self, locks: &Arc<Mutex<ConnLocks>>, addr: String) {
        let id = sync::lock(locks).id;
        let client = Client {
            addr,
            name: Bytes::new(),
        };
        let locks = Arc::downgrade(locks);
        self.map.insert(id, Entry { client, locks });
    }

    /// The session of `id` ended.
    pub fn remove(&self, id: ConnId) {
        self.map.remove(&id);
    }

    /// The connection `id` named itself `name` (empty: unnamed).
    pub fn named(&self, id: ConnId, name: &[u8]) {
        if let Some(mut e) = self.map.get_mut(&id) {
            e.client.name = Bytes::copy_from_slice(name);
        }
    }

    /// Who `id` is, while its session lives.
    pub fn client(&self, id: ConnId) -> Option<Client> {
        self.map.get(&id).map(|e| e.client.clone())
    }

    /// [`Conns::client`] for a caller that holds a connection's records:
    /// never waits for the registry (its scans lock each connection's
    /// records while they hold a part of it, so waiting here could wait
    /// for ever); `None` when that part is busy at this moment.
    pub fn client_now(&self, id: ConnId) -> Option<Client> {
        self.map.try_get(&id).try_unwrap().map(|e| e.client.clone())
    }

    /// Who `id` is and when it first tried for `key` in its current run
    /// of attempts, while its session lives and it has not tried for the
    /// key since `since` nor holds it: it still waits as it did then.
    pub fn listening(&self, id: ConnId, key: &[u8], since: Instant) -> Option<(Client, Instant)> {
        let e = self.map.get(&id)?;
        let locks = e.locks.upgrade()?;
        let locks = sync::lock(&locks);
        let a = locks.get(key)?;
        (a.last_try <= since && a.standing != Standing::Held)
            .then(|| (e.client.clone(), a.first_try))
    }

    /// Ends the holdings of `key` acquired with `value` (before the token
    /// numbered `upto`) on every connection: a lock library released it by
    /// value on another connection (a pool's). Returns what each held. Each
    /// connection's records are locked one at a time (none is held across
    /// another); O(connections), so called only for a release by value
    /// that its own connection did not hold.
    pub fn end_by_value(
        &self,
        key: &[u8],
        value: &[u8],
        upto: u64,
    ) -> Vec<super::lease::Acquisition> {
        let mut out = Vec::new();
        for e in self.map.iter() {
            let Some(locks) = e.locks.upgrade() else {
                continue;
            };
            let mut locks = sync::lock(&locks);
            let held = locks
                .get(key)
                .is_some_and(|a| a.standing == Standing::Held && a.value == value);
            if held {
                if let Some(rec) = locks.released(key, upto) {
                    // Its holder's release is known: it may park again.
                    locks.holder_until = None;
                    out.push(rec);
                }
            }
        }
        out
    }

    /// Some connection holds `key` with `value`, or has an attempt with it
    /// whose outcome is not known: a release by that value may be real
    /// (see `LockService::release_of_a_lost_value`). Each connection's
    /// records are locked one at a time; O(connections), so asked only
    /// for a release by a value an attempt on the key lost with.
    pub fn with_value(&self, key: &[u8], value: &[u8]) -> bool {
        self.map.iter().any(|e| {
            let Some(locks) = e.locks.upgrade() else {
                return false;
            };
            let locks = sync::lock(&locks);
            // A holding whose value is not known (an earlier pipelined
            // attempt won: `ConnLocks::settle`) may be by this value; so
            // may any attempt whose outcome was never learned (only its
            // token is kept, not its value).
            locks.get(key).is_some_and(|a| {
                let maybe = a.value == value || a.value.is_empty();
                (maybe && a.standing != Standing::Lost)
                    || a.retry.as_ref().is_some_and(|r| r.value == value)
                    || !a.unsettled.is_empty()
            })
        })
    }

    /// Connections registered now.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when none is.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The locks held by this instance's connections whose key `matches`,
    /// at most `max`. Reads each connection's records under its lock, one
    /// at a time (none is held across another).
    pub fn holds(&self, matches: impl Fn(&[u8]) -> bool, max: usize) -> Vec<Hold> {
        let mut out = Vec::new();
        for e in self.map.iter() {
            let Some(locks) = e.locks.upgrade() else {
                continue;
            };
            let locks = sync::lock(&locks);
            for (key, a) in locks.held() {
                if out.len() >= max {
                    return out;
                }
                if a.standing != Standing::Held || !matches(key) {
                    continue;
                }
                out.push(Hold {
                    key: key.clone(),
                    acquisition: acquisition_id(&a.token),
                    client: e.client.clone(),
                    since: a.since,
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_acquisition_id_is_the_tokens_sha1_prefix() {
        // SHA1("abc") = a9993e364706816aba3e25717850c26c9cd0d89d
        assert_eq!(acquisition_id(b"abc"), "a9993e364706816a");
        assert_eq!(acquisition_id(b"i:1").len(), ACQUISITION_HEX);
        assert_ne!(acquisition_id(b"i:1"), acquisition_id(b"i:2"));
    }

    #[test]
    fn a_connection_is_listed_while_its_session_lives() {
        let conns = Conns::default();
        let locks = Arc::new(Mutex::new(ConnLocks::new(4)));
        let id = sync::lock(&locks).id;
        conns.add(&locks, "127.0.0.1:5000".into());
        conns.named(id, b"worker-1");
        let c = conns.client(id).expect("listed");
        assert_eq!(
            (c.addr.as_str(), &c.name[..]),
            ("127.0.0.1:5000", &b"worker-1"[..])
        );
        conns.remove(id);
        assert!(conns.client(id).is_none());
        assert!(conns.is_empty());
    }
}
