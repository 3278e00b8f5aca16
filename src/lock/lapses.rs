//! The latest leases that ran out before their holder released or
//! extended them ("lease expired before release": the app's critical
//! section outlived its lease), kept for operators: which key, whose
//! client, by how much. `lock_lease_expired_before_release` counts them
//! all; the status page (`/status.json` `lapses`) and `LOCKGATE LAPSES`
//! show the latest `admin.recent_lapses`, newest first. Never a value or a
//! token.

use std::collections::VecDeque;
use std::sync::Mutex;

use bytes::Bytes;

use super::conns::Client;
use crate::sync;

/// One lease that ran out before its holder's release or extension.
#[derive(Debug, Clone)]
pub struct Lapse {
    /// The lock key.
    pub key: Bytes,
    /// The holder's connection (address, client name), if still known.
    pub client: Option<Client>,
    /// How long the holder had held it when it released or extended, ms.
    pub held_ms: u64,
    /// The lease it was granted, ms.
    pub lease_ms: u64,
    /// By how much the holding outlived the lease, ms.
    pub overrun_ms: u64,
    /// What found the lease gone: `release` or `extend`.
    pub during: &'static str,
    /// When, in Unix milliseconds.
    pub at_unix_ms: u64,
}

/// The latest lapses, at most `max` (the oldest dropped).
#[derive(Debug)]
pub struct Lapses {
    ring: Mutex<VecDeque<Lapse>>,
    max: usize,
}

impl Lapses {
    /// Keeps the latest `max` (0: none).
    pub fn new(max: usize) -> Lapses {
        Lapses {
            ring: Mutex::new(VecDeque::new()),
            max,
        }
    }

    /// Keeps `lapse`, dropping the oldest past `max`.
    pub fn record(&self, lapse: Lapse) {
        if self.max == 0 {
            return;
        }
        let mut ring = sync::lock(&self.ring);
        while ring.len() >= self.max {
            ring.pop_front();
        }
        ring.push_back(lapse);
    }

    /// The lapses kept, newest first.
    pub fn recent(&self) -> Vec<Lapse> {
        sync::lock(&self.ring).iter().rev().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lapse(key: &'static str) -> Lapse {
        Lapse {
            key: Bytes::from_static(key.as_bytes()),
            client: None,
            held_ms: 300,
            lease_ms: 200,
            overrun_ms: 100,
            during: "release",
            at_unix_ms: 1,
        }
    }

    #[test]
    fn keeps_the_latest_newest_first_and_none_at_zero() {
        let l = Lapses::new(2);
        for key in ["lock:a", "lock:b", "lock:c"] {
            l.record(lapse(key));
        }
        let keys: Vec<Bytes> = l.recent().into_iter().map(|x| x.key).collect();
        assert_eq!(keys, [&b"lock:c"[..], &b"lock:b"[..]]);
        let none = Lapses::new(0);
        none.record(lapse("lock:a"));
        assert!(none.recent().is_empty());
    }
}
