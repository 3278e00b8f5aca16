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
use super::{Go, LockService, Park};
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
    /// describes; nothing sent before it on the connection that may free
    /// lock keys still unanswered). `parkable`: also nothing is pipelined
    /// behind it, so it may wait. `acquirer` is asked for only if the attempt parks (the
    /// driver acquires through it).
    pub(crate) fn admit(
        &self,
        op: &LockOp,
        conn: &Arc<Mutex<ConnLocks>>,
        tracked: bool,
        parkable: bool,
        acquirer: impl FnOnce() -> Arc<dyn Acquirer>,
    ) -> Result<Go, Early> {
        if tracked {
            if let Some(early) = self.release_of_a_lost_value(op) {
                return Err(early);
            }
        }
        let LockOp::Acquire {
            key,
            value,
            ttl,
            shape,
        } = op
        else {
            return Ok(Go::default());
        };
        if !tracked || *shape == Shape::SetGet {
            return Ok(Go::default());
        }
        let (probe_ms, park_ms) = self.retry_for(key);
        let Ok(lease_ms) = super::quorum::ops::lease_of(ttl, self.lease_ms(key)) else {
            return Ok(Go::default());
        };
        let park = Park {
            value: value.clone(),
            shape: *shape,
            lease_ms,
            park_ms,
            probe_ms,
        };
        // Parking is for spin loops: only a connection whose previous
        // attempt on the key came moments ago and lost waits. A try-lock is
        // answered at once, and a holder's own re-entrant attempt never
        // waits for itself; nor does an attempt of a connection that has
        // another attempt on the key on its way (it pipelines), or that was
        // seen carrying several callers (a pool's or a multiplexed
        // connection: see `LockService::hurry`).
        let rules = self.rules();
        let (spinning, shared, conn_id) = {
            let mut c = sync::lock(conn);
            let now = std::time::Instant::now();
            let window = Duration::from_millis(rules.spin_window_ms());
            // An attempt on a key its own connection holds is another
            // caller's (a LIFO pool lends the winner's connection to the
            // next thread first) or a re-entrant one: either way that
            // connection is not parked for a while, else the next thread
            // holds a pooled connection for park_ms while the holder may
            // wait for one to release (tests/serial/shared_fairness.rs: a
            // pool of 4 for 6 workers on one Redis, 7 acquisitions in 6 s),
            // and its `DEL` goes by the instance rule (`release_token`).
            // Until a lock library's release by value ends the holding
            // (`ConnLocks::holder_until`): else a pool's every connection,
            // each the winner's in turn, stops parking (redis-py's `Lock`
            // polling from 8 threads on a pool of 4: 216-250 acquisitions
            // in 3 s, against 568, every one a handoff, when it parks
            // again; bench/library_storm.py).
            // (Not after a client script on the key since it acquired: a
            // compare-and-delete `EVAL` may have released it.)
            // (Nor once the lease it held the key by ran out: see
            // `Acquisition::lapsed`.)
            let holds = |a: &super::lease::Acquisition| {
                a.standing == Standing::Held && a.after_script.is_none() && a.lapsed(now).is_none()
            };
            if c.get(key).is_some_and(holds) {
                c.holder_until = Some(now + window);
            }
            let shared = c.shared_at(now);
            (c.spinning(key, window), shared, c.id)
        };
        // Whoever asks, the holder's own connection or one carrying the
        // holder and its rivals, an attempt on a key known held is
        // answered from the view: "not acquired" is what Redis would say.
        // Not when something this connection sent before it that may free
        // lock keys (a release, an extension, a flush, a script, a
        // transaction) is not answered yet: Redis runs that first (the
        // session fuzzer's SETNX, DEL, SETNX got 0 here and 1 from Redis),
        // and the caller saw to that (`tracked`).
        let keep = Duration::from_millis(park_ms.max(probe_ms));
        let park_ms = if parkable && spinning && !shared {
            park_ms
        } else {
            0
        };
        match self.storm.admit(key, probe_ms, conn_id) {
            admission @ (Admission::Probe | Admission::Check) => Ok(Go {
                park: (park_ms > 0).then_some(Park { park_ms, ..park }),
                check: admission == Admission::Check,
            }),
            Admission::Absorb => {
                // An attempt on a held key, answered without asking Redis.
                ProxyMetrics::inc(&self.metrics.attempts);
                ProxyMetrics::inc(&self.metrics.contended);
                self.hot.record(key, Event::Absorbed);
                // Recorded as lost, so an EXPIRE that follows cannot move
                // the holder's lease.
                let token = self.next_token();
                let (since_last, first_try) = {
                    let mut c = sync::lock(conn);
                    (c.lost(key.clone(), token, value.clone()), c.first_try(key))
                };
                self.storm.lost_value(key, value);
                // A shared connection's callers never park, so without a
                // place they never came before anyone: fencing waits and
                // parked attempts took every release (one multiplexed
                // connection's SETNX and SET NX workers, 0-2 acquisitions
                // against 6-16 for the fencing ones, same file).
                if let (true, true, Some(since)) = (shared, spinning, first_try) {
                    self.storm
                        .spun(ask_for(key.clone(), &park, conn, conn_id), since, keep);
                }
                if park_ms > 0 {
                    if let Some(rx) = self.park(key.clone(), park, conn, acquirer()) {
                        self.hot.record(key, Event::Parked);
                        return Err(Early::Parked(rx));
                    }
                }
                // Smoothing: a connection hammering one key faster than
                // max_attempts_per_sec waits out the rest of its interval.
                // Not one seen carrying several callers: the next one's
                // command would end the wait at once (`LockService::hurry`).
                let rate = if shared {
                    0
                } else {
                    rules.max_attempts_per_sec()
                };
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

    /// An acquisition pipelined behind another on the same key, both sent
    /// after everything on the connection that may free lock keys (see
    /// [`super::Seat::ahead`]): Redis runs the other first, which either
    /// takes the lock or finds it held, so this one fails whatever the view
    /// says (a release by another connection in between is the staleness
    /// every local answer has). Answered "not acquired" now, counted as
    /// absorbed; never parked (the connection pipelines). `None` for
    /// anything else.
    pub(crate) fn behind_attempt(
        &self,
        op: &LockOp,
        conn: &Arc<Mutex<ConnLocks>>,
    ) -> Option<Early> {
        let LockOp::Acquire {
            key, shape, value, ..
        } = op
        else {
            return None;
        };
        if *shape == Shape::SetGet {
            return None;
        }
        ProxyMetrics::inc(&self.metrics.attempts);
        ProxyMetrics::inc(&self.metrics.contended);
        ProxyMetrics::inc(&self.storm.metrics.absorbed);
        self.hot.record(key, Event::Absorbed);
        let token = self.next_token();
        sync::lock(conn).lost(key.clone(), token, value.clone());
        self.storm.lost_value(key, value);
        Some(Early::Now(shaped(*shape, false)))
    }

    /// A lock library's release by value (`router::library`) of the very
    /// value this connection's latest attempt on the key lost with, the
    /// key still known held by another since: the library's script would
    /// find another value there and answer 0, so lockgate answers 0 now,
    /// without Redis. pottery's `Redlock` releases after every attempt it
    /// lost (the Redlock algorithm's clean-up), so without this each poll
    /// parked and answered here still cost Redis a script
    /// (`bench/library_storm.py --library pottery`: 47 commands per
    /// acquisition, more than straight on Redis).
    ///
    /// Its value is that attempt's own random token: only the attempt
    /// itself could have set it, and it lost. The attempt may have been
    /// made on another connection of this instance (a pool lends pottery's
    /// clean-up whichever connection it has), so the lost values are the
    /// key's (`Storm::lost_value`), and every connection's records are
    /// asked whether one holds the key with it (O(connections), only for
    /// such a release). The staleness is the view's (a holder known until
    /// its lease ends, or a release seen here); `None` for anything else:
    /// another value, several keys, an attempt with the value whose outcome
    /// is not known, a connection holding the key with it, a key not known
    /// held.
    fn release_of_a_lost_value(&self, op: &LockOp) -> Option<Early> {
        let LockOp::Release {
            lock_keys,
            plain,
            by_value: Some(value),
            ..
        } = op
        else {
            return None;
        };
        let ([key], true) = (&lock_keys[..], plain.is_empty()) else {
            return None;
        };
        // An attempt with the value lost here, none won with it since,
        // and the key is known held; and no connection holds it with the
        // value or waits to learn whether an attempt with it won.
        if !self.storm.lost_while_held(key, value) || self.conns.with_value(key, value) {
            return None;
        }
        ProxyMetrics::inc(&self.metrics.library_releases);
        ProxyMetrics::inc(&self.metrics.library_releases_answered);
        Some(Early::Now(LocalReply::Integer(0)))
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
        let (since, conn_id, hurry) = {
            let c = sync::lock(conn);
            if c.shared_at(std::time::Instant::now()) {
                return None;
            }
            (c.first_try(&key)?, c.id, c.hurry.clone())
        };
        let ask = ask_for(key, &park, conn, conn_id);
        let rx = (self.storm).park(acquirer, ask.clone(), since, park.park_ms, park.probe_ms)?;
        sync::lock(conn).parked = Some(ask.key);
        hurry.arm();
        Some(rx)
    }

    /// `conn` sent more behind something of its own that waits: its
    /// parked attempt, if one is, is answered "not acquired" now, its
    /// place in the key's queue kept; a smoothed reply is ended by the
    /// session ([`super::lease::Hurry::cut_now`]). A connection that does
    /// so carries several callers (a pool's connection lent on, or one
    /// multiplexed connection), so none of its attempts parks for
    /// `spin_window_ms`: a parked attempt there would hold up the other
    /// callers' commands behind it.
    pub(crate) fn hurry(&self, conn: &Arc<Mutex<ConnLocks>>) {
        let (parked, id, hurry) = {
            let mut c = sync::lock(conn);
            (c.parked.take(), c.id, c.hurry.clone())
        };
        let cut = parked.is_some_and(|key| self.storm.hurry(&key, id));
        // Both, whatever the first found.
        if hurry.cut_now() | cut {
            let window = Duration::from_millis(self.rules().spin_window_ms());
            sync::lock(conn).shared_until = Some(std::time::Instant::now() + window);
        }
    }
}

/// What the storm room keeps for `conn_id`'s attempt on `key` with
/// `park`'s settings: a parked attempt's, or a shared connection's kept
/// place's.
fn ask_for(
    key: Bytes,
    park: &Park,
    conn: &Arc<Mutex<ConnLocks>>,
    conn_id: super::lease::ConnId,
) -> Ask {
    Ask {
        key,
        value: park.value.clone(),
        shape: park.shape,
        lease_ms: park.lease_ms,
        conn: conn.clone(),
        conn_id,
        check: false,
    }
}

#[cfg(test)]
mod tests {
    //! The decision alone, on a key the storm room already knows held: no
    //! attempt here parks, so no driver (and no Redis) is involved.

    use super::*;
    use crate::config::Config;
    use crate::lock::lease::Standing;
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
        assert!(matches!(untracked, Ok(Go { park: None, .. })));
        let get = locks.admit(
            &setnx("lock:a", Shape::SetGet),
            &conn,
            true,
            true,
            no_parking,
        );
        assert!(matches!(get, Ok(Go { park: None, .. })));
        let fresh = locks.admit(
            &setnx("lock:b", Shape::SetNx),
            &conn,
            true,
            true,
            no_parking,
        );
        assert!(
            matches!(fresh, Ok(Go { park: None, .. })),
            "a try-lock does not park"
        );
        assert_eq!(ProxyMetrics::get(&locks.metrics.attempts), 0);
    }

    /// Whoever asks, an attempt on a key known held is answered "not
    /// acquired" from the view, as Redis would answer it: the holder's own
    /// connection (a pool lends it to the next thread; a multiplexed one
    /// carries the holder and its rivals) and one whose earlier attempt is
    /// still on its way. Neither ever parks: the holder would wait for
    /// itself, and a pipelining connection has callers behind it. (Not
    /// tracked, as behind a release not answered yet, it goes to Redis:
    /// `goes_to_redis_when_it_must`.)
    #[test]
    fn the_holders_and_pipelined_attempts_are_answered_from_the_view_never_parked() {
        let mut config = Config::default();
        config.locks.retry.max_attempts_per_sec = 0;
        let locks = LockService::new(&config);
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
        assert!(
            matches!(own, Err(Early::Now(LocalReply::Integer(0)))),
            "{own:?}"
        );
        let held = sync::lock(&conn).get(b"lock:h").map(|a| a.standing);
        assert_eq!(held, Some(Standing::Held), "still the holder");
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
            matches!(next, Err(Early::Now(LocalReply::Integer(0)))),
            "an attempt behind one not answered yet: {next:?}"
        );
        let other = Arc::new(Mutex::new(locks.conn_locks()));
        let theirs = locks.admit(&op, &other, true, false, no_parking);
        assert!(
            matches!(theirs, Err(Early::Now(LocalReply::Integer(0)))),
            "another connection's attempt is absorbed too: {theirs:?}"
        );
    }
}
