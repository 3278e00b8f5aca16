//! What the lock room's view follows besides lock commands: commands
//! lockgate forwards as they are that change lock keys behind its back
//! (`FLUSHDB`, `FLUSHALL`, `SWAPDB`, `RENAME`, `RENAMENX`, `COPY`, `MOVE`)
//! or Redis's script cache (`SCRIPT FLUSH`). The router names what such a
//! command changes ([`Forget`]); once Redis acknowledges it, the lock room
//! drops what it knew ([`LockService::forget`]), so the next attempt on an
//! affected key asks Redis instead of being answered from a stale view.
//! And which database a lock command ran in ([`Database`]): the contention
//! table describes database 0 only, keyed by key alone.
//!
//! Dropping is always safe: the view is a hint, and an attempt it does not
//! answer goes to Redis. What changes lock keys without passing through this
//! instance (other clients straight on Redis, other lockgate instances, a
//! lease running out) stays bounded by `locks.retry.probe_interval_ms`.

use bytes::Bytes;

use super::LockService;
use crate::metrics::ProxyMetrics;

/// What a forwarded command changed behind the lock room's back, to drop
/// once Redis acknowledged it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Forget {
    /// These lock keys: a value left them or arrived at them (`RENAME`,
    /// `RENAMENX`, `COPY`, `MOVE`, of a lock key or onto one).
    Keys(Vec<Bytes>),
    /// Every key of a database (`FLUSHDB`, `FLUSHALL`, `SWAPDB`): the
    /// whole view, whatever database the client selected (`SELECT` as
    /// sent may not be the database Redis kept, and a drop costs only one
    /// attempt per key going to Redis).
    Database,
    /// Redis's script cache (`SCRIPT FLUSH`): every connection loads the
    /// lock scripts again before its next `EVALSHA`.
    Scripts,
    /// The `EXEC` of a transaction that queued any of the above: all of
    /// them (a transaction's commands run at its `EXEC`, and which keys
    /// they named is not kept).
    Everything,
}

/// Where a lock command ran, as far as the contention table
/// ([`super::storm`]) is concerned. The table is keyed by key alone and
/// describes lock keys in database 0: where lockgate's own connection
/// acquires for parked attempts, and where the quorum's masters keep them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Database {
    /// Database 0: the table learns the command's outcome, and a release
    /// may hand the lock to an attempt parked here.
    #[default]
    Zero,
    /// Another database (`SELECT n`), or one lockgate could not read: the
    /// table learns nothing from it and a release there hands nothing over
    /// (an attempt parked on the key waits in database 0). A release still
    /// drops what the table knew of the key: never wrong, and right when
    /// the `SELECT` was refused and the command ran in database 0 after
    /// all.
    Other,
}

impl Database {
    /// The database a session has selected (`u64::MAX`: unreadable).
    pub fn of(selected: u64) -> Database {
        match selected {
            0 => Database::Zero,
            _ => Database::Other,
        }
    }
}

/// True when `frame` is an error reply (RESP2 `-`, RESP3 `!`): the
/// command was refused and changed nothing.
pub fn is_error(frame: &[u8]) -> bool {
    matches!(frame.first(), Some(b'-' | b'!'))
}

impl LockService {
    /// Drops what the lock room knew that `what` changed: Redis
    /// acknowledged a forwarded command (or, where no reply can be matched
    /// to it, the command was sent). Attempts parked on a dropped key are
    /// woken: their driver asks Redis, as after a release. Counted in
    /// `lock_view_forgets`.
    pub(crate) fn forget(&self, what: &Forget) {
        ProxyMetrics::inc(&self.metrics.view_forgets);
        match what {
            Forget::Keys(keys) => {
                for key in keys {
                    self.storm.released(key);
                }
            }
            Forget::Database => self.storm.forget_all(),
            Forget::Scripts => self.script_epoch.flushed(),
            Forget::Everything => {
                self.storm.forget_all();
                self.script_epoch.flushed();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::lock::storm::Admission;

    /// A key learned held for a minute is absorbed; once forgotten (by
    /// name, or with the whole database) the next attempt asks Redis.
    #[tokio::test]
    async fn a_forgotten_key_is_asked_again() {
        let locks = LockService::new(&Config::default());
        let anyone = locks.conn_locks().id;
        let learn_held = |key: &[u8]| {
            locks.storm.admit(key, 60_000, anyone);
            locks.storm.learn(key, false, 60_000);
            assert_eq!(locks.storm.admit(key, 60_000, anyone), Admission::Absorb);
        };
        learn_held(b"lock:a");
        learn_held(b"lock:b");
        locks.forget(&Forget::Keys(vec![Bytes::from_static(b"lock:a")]));
        assert_eq!(
            locks.storm.admit(b"lock:a", 60_000, anyone),
            Admission::Probe
        );
        assert_eq!(
            locks.storm.admit(b"lock:b", 60_000, anyone),
            Admission::Absorb
        );
        learn_held(b"lock:a");
        locks.forget(&Forget::Database);
        assert_eq!(
            locks.storm.admit(b"lock:a", 60_000, anyone),
            Admission::Probe
        );
        assert_eq!(
            locks.storm.admit(b"lock:b", 60_000, anyone),
            Admission::Probe
        );
        assert_eq!(ProxyMetrics::get(&locks.metrics.view_forgets), 2);
    }

    #[test]
    fn scripts_and_everything_move_the_script_epoch_on() {
        let locks = LockService::new(&Config::default());
        locks.forget(&Forget::Scripts);
        assert_eq!(locks.script_epoch.now(), 1);
        locks.forget(&Forget::Everything);
        assert_eq!(locks.script_epoch.now(), 2);
        locks.forget(&Forget::Database);
        assert_eq!(locks.script_epoch.now(), 2);
    }

    #[test]
    fn errors_in_either_protocol_are_refusals() {
        assert!(is_error(b"-ERR no\r\n"));
        assert!(is_error(b"!3\r\nERR\r\n"));
        assert!(!is_error(b"+OK\r\n"));
        assert!(!is_error(b"*-1\r\n"));
        assert!(!is_error(b""));
    }
}
