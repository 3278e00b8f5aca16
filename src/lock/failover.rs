//! The failover delay of lock acquisitions on the primary
//! (`locks.failover_delay_ms`): how long after a switch of the primary
//! (Redis Sentinel, [`crate::sentinel`]) acquisitions are answered "not
//! acquired", and the longest lease granted that it defaults to.

use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;

use super::ops::Shape;
use super::LockService;
use crate::protocol::encode::{self, LocalReply};

impl LockService {
    /// Records a lease about to be granted (acquisition, takeover,
    /// fencing lock), for the default failover delay.
    pub(crate) fn granting(&self, lease_ms: u64) {
        self.max_lease_ms.fetch_max(lease_ms, Ordering::Relaxed);
    }

    /// `locks.failover_delay_ms` in force: how long after a switch of the
    /// primary its lock acquisitions are answered "not acquired". Absent:
    /// the longest lease granted, never less than `default_lease_ms` (as
    /// the quorum's `rejoin_delay_ms`); 0: off.
    pub(crate) fn failover_delay(&self) -> Duration {
        let rules = self.rules();
        let ms = match rules.failover_delay_ms {
            Some(ms) => ms,
            None => self
                .max_lease_ms
                .load(Ordering::Relaxed)
                .max(rules.default_lease_ms),
        };
        Duration::from_millis(ms)
    }
}

/// What an acquisition held after a switch gets: `Ok` a local "not
/// acquired" in the command's shape, or `Err` a command to send upstream in
/// its place inside `MULTI` (Redis must queue it and answer it in `EXEC`).
/// `SET … NX GET` answers nil when it acquired, so it gets an error.
pub fn held_answer(shape: Shape, in_multi: bool) -> Result<LocalReply, Bytes> {
    const HELD: &str = "ERR lockgate: lock acquisitions are held after the primary changed (locks.failover_delay_ms)";
    match (shape, in_multi) {
        (Shape::SetGet, false) => Ok(LocalReply::Error(Bytes::from_static(HELD.as_bytes()))),
        (_, false) => Ok(super::storm::shaped(shape, false)),
        (Shape::SetNx, true) => Err(encode::command(&[
            b"EVAL",
            crate::script::HELD[0].as_bytes(),
            b"0",
        ])),
        (Shape::Set, true) => Err(encode::command(&[
            b"EVAL",
            crate::script::HELD[1].as_bytes(),
            b"0",
        ])),
        (Shape::SetGet, true) => Err(encode::command(&[
            b"EVAL",
            crate::script::ERROR.as_bytes(),
            b"0",
            HELD.as_bytes(),
        ])),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn the_default_delay_is_the_longest_lease_granted() {
        let mut config = Config::default();
        config.locks.default_lease_ms = 2_000;
        let locks = LockService::new(&config);
        assert_eq!(locks.failover_delay(), Duration::from_millis(2_000));
        locks.granting(500);
        assert_eq!(locks.failover_delay(), Duration::from_millis(2_000));
        locks.granting(6_000);
        assert_eq!(locks.failover_delay(), Duration::from_millis(6_000));
        config.locks.failover_delay_ms = Some(0);
        locks.reload(&config);
        assert_eq!(locks.failover_delay(), Duration::ZERO, "0: off");
    }
}
