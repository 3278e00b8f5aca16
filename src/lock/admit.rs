//! The lock room's decision on an acquisition before it goes upstream:
//! go to Redis (and park if refused), answer now (absorbed), answer after
//! a delay (smoothing a connection that hammers one key), or park until a
//! handoff. The attempt is counted and the hot-key sketch fed here; the
//! session only carries out the [`Early`] it gets back
//! (`session::parking`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::oneshot;

use super::hotkeys::Event;
use super::lease::{ConnLocks, Standing};
use super::ops::{LockOp, Shape};
use super::storm::{shaped, Acquirer, Admission, Ask};
use super::{LockService, Park};
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;
use crate::sync;

/// An attempt answered before it reached Redis.
#[derive(Debug)]
pub enum Early {
    /// Answered without Redis, now (absorbed: the lock is known held).
    Now(LocalReply),
    /// Parked: the reply comes later.
    Parked(oneshot::Receiver<LocalReply>),
    /// Answered without Redis, after this delay (smoothing).
    Delayed(LocalReply, Duration),
}

impl LockService {
    /// Decides an acquisition before it goes upstream: `Ok` to go to Redis
    /// (and, if it fails, park with these settings), or answered early.
    /// `tracked`: lockgate
    /// may answer for the connection (not inside MULTI, where Redis must
    /// queue the command; database 0, which the contention table
    /// describes). `parkable`: also nothing is pipelined behind it, so it
    /// may wait. `acquirer` is asked for only if the attempt parks (the
    /// driver acquires through it).
    pub(crate) fn admit(
        &self,
        op: &LockOp,
        conn: &Arc<Mutex<ConnLocks>>,
        tracked: bool,
        parkable: bool,
        acquirer: impl FnOnce() -> Arc<dyn Acquirer>,
    ) -> Result<Option<Park>, Early> {
        let LockOp::Acquire {
            key,
            value,
            ttl,
            shape,
        } = op
        else {
            return Ok(None);
        };
        if !tracked || *shape == Shape::SetGet {
            return Ok(None);
        }
        let (probe_ms, park_ms) = self.retry_for(key);
        let Ok(lease_ms) = super::quorum::ops::lease_of(ttl, self.lease_ms(key)) else {
            return Ok(None);
        };
        let park = Park {
            value: value.clone(),
            shape: *shape,
            lease_ms,
            park_ms,
            probe_ms,
        };
        // Parking is for spin loops: only a connection whose previous
        // attempt on the key came moments ago waits. A try-lock is answered
        // at once, and a holder's own re-entrant attempt never waits for
        // itself.
        let rules = self.rules();
        let (mine, spinning, conn_id) = {
            let c = sync::lock(conn);
            let (mine, spinning) = match c.get(key) {
                Some(a) if a.standing != Standing::Lost => (true, false),
                Some(a) => (
                    false,
                    a.last_try.elapsed().as_millis() < u128::from(rules.spin_window_ms()),
                ),
                None => (false, false),
            };
            (mine, spinning, c.id)
        };
        // An attempt of the holder, or of a connection whose earlier
        // attempt is not answered yet, goes to Redis: the table knows the
        // key held or probed (by this connection), but a release pipelined
        // in between may not be answered yet either, and Redis runs them
        // in order (the session fuzzer's SETNX, DEL, SETNX got 0 here and
        // 1 from Redis). A spin loop waits for each answer, so its
        // attempts stand `Lost` and are still absorbed.
        if mine {
            return Ok(None);
        }
        let park_ms = if parkable && spinning { park_ms } else { 0 };
        match self.storm.admit(key, probe_ms, conn_id) {
            Admission::Probe => Ok((park_ms > 0).then_some(Park { park_ms, ..park })),
            Admission::Absorb => {
                // An attempt on a held key, answered without asking Redis.
                ProxyMetrics::inc(&self.metrics.attempts);
                ProxyMetrics::inc(&self.metrics.contended);
                self.hot.record(key, Event::Absorbed);
                // Recorded as lost, so an EXPIRE that follows cannot move
                // the holder's lease.
                let token = self.next_token();
                let since_last = sync::lock(conn).lost(key.clone(), token);
                if park_ms > 0 {
                    if let Some(rx) = self.park(key.clone(), park, conn, acquirer()) {
                        self.hot.record(key, Event::Parked);
                        return Err(Early::Parked(rx));
                    }
                }
                // Smoothing: a connection hammering one key faster than
                // max_attempts_per_sec waits out the rest of its interval.
                let rate = rules.max_attempts_per_sec();
                let interval = Duration::from_micros(1_000_000 / rate.max(1));
                match since_last {
                    Some(gap) if rate > 0 && gap < interval => {
                        ProxyMetrics::inc(&self.storm.metrics.smoothed);
                        Err(Early::Delayed(shaped(*shape, false), interval - gap))
                    }
                    _ => Err(Early::Now(shaped(*shape, false))),
                }
            }
        }
    }

    /// Parks a failed attempt of `conn` on `key` with `park`'s settings,
    /// the driver acquiring through `acquirer`; `None` when it cannot wait
    /// (no attempt on record, the queue or the table full).
    pub(crate) fn park(
        &self,
        key: Bytes,
        park: Park,
        conn: &Arc<Mutex<ConnLocks>>,
        acquirer: Arc<dyn Acquirer>,
    ) -> Option<oneshot::Receiver<LocalReply>> {
        let (since, conn_id) = {
            let c = sync::lock(conn);
            (c.first_try(&key)?, c.id)
        };
        let ask = Ask {
            key,
            value: park.value,
            shape: park.shape,
            lease_ms: park.lease_ms,
            conn: conn.clone(),
            conn_id,
        };
        self.storm
            .park(acquirer, ask, since, park.park_ms, park.probe_ms)
    }
}

#[cfg(test)]
mod tests {
    //! The decision alone, on a key the storm room already knows held: no
    //! attempt here parks, so no driver (and no Redis) is involved.

    use super::*;
    use crate::config::Config;
    use crate::lock::ops::Ttl;

    fn setnx(key: &'static str, shape: Shape) -> LockOp {
        LockOp::Acquire {
            key: Bytes::from_static(key.as_bytes()),
            value: Bytes::from_static(b"v"),
            ttl: Ttl::Default,
            shape,
        }
    }

    /// A connection that is not the one under test.
    fn anyone() -> crate::lock::lease::ConnId {
        ConnLocks::new(1).id
    }

    fn no_parking() -> Arc<dyn Acquirer> {
        unreachable!("nothing parks in these tests")
    }

    /// An attempt on a held key is answered without Redis, counted as an
    /// attempt and a contended one, and fed to the hot keys as absorbed; a
    /// second one within 1 / max_attempts_per_sec is delayed (smoothing),
    /// counted.
    #[test]
    fn absorbs_counts_and_smooths() {
        let mut config = Config::default();
        config.locks.retry.max_attempts_per_sec = 1;
        let locks = LockService::new(&config);
        assert_eq!(
            locks.storm.admit(b"lock:a", 100, anyone()),
            Admission::Probe
        );
        locks.storm.learn(b"lock:a", false, 60_000);
        let conn = Arc::new(Mutex::new(locks.conn_locks()));
        let op = setnx("lock:a", Shape::SetNx);
        let first = locks.admit(&op, &conn, true, false, no_parking);
        assert!(
            matches!(first, Err(Early::Now(LocalReply::Integer(0)))),
            "{first:?}"
        );
        let second = locks.admit(&op, &conn, true, false, no_parking);
        let Err(Early::Delayed(reply, delay)) = second else {
            panic!("not delayed: {second:?}");
        };
        assert_eq!(reply, LocalReply::Integer(0));
        assert!(delay > Duration::ZERO && delay <= Duration::from_secs(1));
        assert_eq!(ProxyMetrics::get(&locks.metrics.attempts), 2);
        assert_eq!(ProxyMetrics::get(&locks.metrics.contended), 2);
        assert_eq!(ProxyMetrics::get(&locks.storm.metrics.smoothed), 1);
        let hot = locks.hot.top(1);
        assert_eq!(hot.first().map(|h| (h.absorbed, h.attempts)), Some((2, 2)));
    }

    /// What never is absorbed: attempts lockgate may not answer for
    /// (inside MULTI), `SET … NX GET` (its reply is the old value), and a
    /// key nothing is known of, which goes to Redis with no park settings
    /// when the attempt may not wait.
    #[test]
    fn goes_to_redis_when_it_must() {
        let locks = LockService::new(&Config::default());
        locks.storm.admit(b"lock:a", 100, anyone());
        locks.storm.learn(b"lock:a", false, 60_000);
        let conn = Arc::new(Mutex::new(locks.conn_locks()));
        let untracked = locks.admit(
            &setnx("lock:a", Shape::SetNx),
            &conn,
            false,
            true,
            no_parking,
        );
        assert!(matches!(untracked, Ok(None)));
        let get = locks.admit(
            &setnx("lock:a", Shape::SetGet),
            &conn,
            true,
            true,
            no_parking,
        );
        assert!(matches!(get, Ok(None)));
        let fresh = locks.admit(
            &setnx("lock:b", Shape::SetNx),
            &conn,
            true,
            true,
            no_parking,
        );
        assert!(matches!(fresh, Ok(None)), "a try-lock does not park");
        assert_eq!(ProxyMetrics::get(&locks.metrics.attempts), 0);
    }

    /// The holder's own attempt, or one pipelined behind an attempt not
    /// answered yet, goes to Redis: a `DEL` in between may not be answered
    /// yet (found by the session fuzzer: `DEL` then `SETNX` got 0, Redis 1).
    #[test]
    fn a_connections_own_pipelined_attempts_are_never_absorbed() {
        let locks = LockService::new(&Config::default());
        locks.storm.admit(b"lock:h", 100, anyone());
        locks.storm.learn(b"lock:h", true, 60_000);
        let conn = Arc::new(Mutex::new(locks.conn_locks()));
        sync::lock(&conn).attempt(
            Bytes::from_static(b"lock:h"),
            Bytes::from_static(b"t:1"),
            Bytes::from_static(b"v"),
            Standing::Held,
            60_000,
        );
        let op = setnx("lock:h", Shape::SetNx);
        let own = locks.admit(&op, &conn, true, true, no_parking);
        assert!(matches!(own, Ok(None)), "{own:?}");
        let pipelined = Arc::new(Mutex::new(locks.conn_locks()));
        sync::lock(&pipelined).attempt(
            Bytes::from_static(b"lock:h"),
            Bytes::from_static(b"t:2"),
            Bytes::from_static(b"v"),
            Standing::Trying,
            60_000,
        );
        let next = locks.admit(&op, &pipelined, true, true, no_parking);
        assert!(
            matches!(next, Ok(None)),
            "an attempt behind one not answered yet: {next:?}"
        );
        let other = Arc::new(Mutex::new(locks.conn_locks()));
        let theirs = locks.admit(&op, &other, true, false, no_parking);
        assert!(
            matches!(theirs, Err(Early::Now(LocalReply::Integer(0)))),
            "another connection's attempt is still absorbed: {theirs:?}"
        );
    }
}
