//! Tokens and what one client connection has acquired.
//!
//! A token is `instance_id:seq`. `seq` starts at the process start time in
//! microseconds and only grows, so tokens do not repeat across restarts of
//! the same instance (an old owner record can never match a new token).

use crate::lock::keys::KeyHasher;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;

/// Issues acquisition tokens for one lockgate instance.
#[derive(Debug)]
pub struct Tokens {
    prefix: String,
    seq: AtomicU64,
}

impl Tokens {
    /// Tokens `instance_id:seq`.
    pub fn new(instance_id: &str) -> Tokens {
        let start = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(1);
        Tokens {
            prefix: format!("{instance_id}:"),
            seq: AtomicU64::new(start),
        }
    }

    /// `instance_id:` — what every token of this instance starts with.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The number the next token will carry: every token numbered below
    /// it was issued before this call.
    pub fn issued(&self) -> u64 {
        self.seq.load(Ordering::Relaxed)
    }

    /// A token never issued before by this instance.
    pub fn next(&self) -> Bytes {
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        Bytes::from(format!("{}{n}", self.prefix))
    }
}

/// Where one connection stands with one lock key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// Acquisition sent, reply not seen yet.
    Trying,
    /// Acquired (or taken over) by this connection.
    Held,
    /// This connection's acquisition failed: someone else held the key.
    Lost,
}

/// One connection's record of one lock key.
#[derive(Debug, Clone)]
pub struct Acquisition {
    /// The token of the connection's latest attempt on the key.
    pub token: Bytes,
    /// Trying, held or lost.
    pub standing: Standing,
    /// When it was acquired (or attempted).
    pub since: Instant,
    /// The lease it was granted, in milliseconds (0 if unknown).
    pub lease_ms: u64,
    /// The value it was acquired with (empty if not known, e.g. `GETEX`):
    /// background renewal and release check it is still the lock's.
    pub value: Bytes,
    /// When this connection first tried for the key in its current run of
    /// attempts (kept while it keeps losing): parked attempts are handed
    /// the lock in this order.
    pub first_try: Instant,
    /// When this connection last tried for the key.
    pub last_try: Instant,
    /// A newer attempt by this connection while it holds the key (a
    /// re-entrant `SETNX`), not settled yet: if it wins (the old lease had
    /// run out), the record moves to it; if it loses, the connection still
    /// holds the key by `token`, and the owner record decides.
    pub retry: Option<Retry>,
    /// Earlier attempts of this connection whose outcome was never learned
    /// (queued in `MULTI`, or pipelined), newest last: any of them may be
    /// the one the owner record holds. At most [`MAX_UNSETTLED`].
    pub unsettled: Vec<Bytes>,
    /// The record was made by a takeover (`GETSET`, `SET` without `NX`…),
    /// which belongs to the instance for releases (see [`ConnLocks::token`]).
    pub takeover: bool,
    /// Held, and a script of this connection's on the key (`EVAL`) was
    /// acknowledged then: it may have released the lock (the
    /// compare-and-delete release of `SET NX PX`), which lockgate cannot
    /// tell, so the record stays held (the owner record still decides) but
    /// the connection's attempts after the script count as a new run of
    /// attempts (see [`ConnLocks::scripted`]).
    pub after_script: Option<Instant>,
    /// Until when an extension through this connection moved the lease
    /// (`EXPIRE` family, `LOCKGATE EXTEND`, a watchdog renewal), as this
    /// instance's clock reads the remaining time it was given: see
    /// [`Acquisition::lapsed`].
    pub extended_until: Option<Instant>,
}

impl Acquisition {
    /// When the lease this connection holds the key by ran out, if it
    /// has by this instance's clock (`since + lease_ms`, or the last
    /// extension's end, whichever is later); `None` while it may still
    /// run, for a lease of unknown length and for a record not held.
    ///
    /// A hint with bounded staleness, never the truth (the owner record
    /// decides who holds the lock): a holder whose release never reached
    /// Redis (an error in an outage) stays `Held` here, and its attempts
    /// after the lease ran out are a loser's spin, not a holder's
    /// re-entrant ones. Before, such a connection's attempts were taken
    /// for another caller's on a pooled holder connection, never parked
    /// and never placed, and lost every turn to parked spinners for as
    /// long as the key stayed contended (tests/serial/quorum_recovery.rs,
    /// seeds 4 and 9: a `SETNX` worker granted nothing for 6 s while the
    /// lock went round 190 times).
    pub fn lapsed(&self, now: Instant) -> Option<Instant> {
        if self.standing != Standing::Held || self.lease_ms == 0 {
            return None;
        }
        let ends = self.since + std::time::Duration::from_millis(self.lease_ms);
        let ends = self.extended_until.map_or(ends, |e| e.max(ends));
        (now >= ends).then_some(ends)
    }

    /// The connection tries for the key again now: the first attempt
    /// after its holding lapsed begins a new run of attempts (a loser's
    /// place in line counts from there, not from before it acquired, nor
    /// from the lapse itself, when it was not asking yet).
    fn tried(&mut self) {
        let now = Instant::now();
        if self.lapsed(now).is_some_and(|t| self.last_try <= t) {
            self.first_try = now;
        }
        self.last_try = now;
    }
}

/// The number a token ends with (`instance_id:seq`); 0 if none.
fn token_seq(token: &[u8]) -> u64 {
    let digits = token
        .iter()
        .rposition(|c| !c.is_ascii_digit())
        .map_or(token, |at| &token[at + 1..]);
    std::str::from_utf8(digits)
        .ok()
        .and_then(|d| d.parse().ok())
        .unwrap_or(0)
}

/// Most unsettled earlier attempts remembered per key.
pub const MAX_UNSETTLED: usize = 8;

/// A connection's newer attempt on a key it already holds.
#[derive(Debug, Clone)]
pub struct Retry {
    /// The attempt's token.
    pub token: Bytes,
    /// The value it tries to set.
    pub value: Bytes,
    /// The lease it asks for, ms.
    pub lease_ms: u64,
}

/// The lock keys one client connection has tried, acquired or lost;
/// bounded, the oldest record dropped first when full.
#[derive(Debug)]
pub struct ConnLocks {
    /// The connection's id: from a process-wide counter, never reused, so
    /// a place kept for a closed connection is never taken for a new one.
    pub id: ConnId,
    map: HashMap<Bytes, Acquisition, KeyHasher>,
    /// Every `(key, since)` a record was given, oldest first: the record to
    /// drop when the table is full is the first entry still current (the
    /// others are stale and skipped), without scanning the table for the
    /// oldest on every new key.
    order: VecDeque<(Bytes, Instant)>,
    max: usize,
    /// Records dropped because the table was full.
    pub evicted: u64,
    /// The number of the first token the instance issued after this
    /// connection opened: acquisitions numbered below it were made before
    /// it existed, so not by it (the pooled rule of `script::owner_check`).
    pub born: u64,
    /// The lock key of this connection's attempt parked now (retry
    /// storms), if one is: what [`Hurry`] cuts short when the connection
    /// sends more behind it.
    pub parked: Option<Bytes>,
    /// The connection was seen carrying several callers (a command came
    /// behind a parked attempt): until then its attempts are answered at
    /// once, never parked, so none waits in front of another caller's
    /// command.
    pub shared_until: Option<Instant>,
    /// An attempt came on the connection while it held the key (a LIFO
    /// pool lent the winner's connection to the next thread, or the holder
    /// retried): until then it counts as carrying several callers, as with
    /// `shared_until`. Ended early when a lock library's release by value
    /// ended the holding (`LockService::released_by_value`): the holder's
    /// release is then known, so the connection may park again.
    pub holder_until: Option<Instant>,
    /// Shared with the connection's session: set when one of its attempts
    /// waits (parked, or a smoothed reply), so the session's next read
    /// answers it at once.
    pub hurry: std::sync::Arc<Hurry>,
}

/// A connection's word that something of its own waits in front of what
/// it sends next: a parked attempt or a smoothed reply. Lock-free to look
/// at, since the session looks at every read batch. The session answers
/// what waits when more arrives behind it ([`Hurry::take`], then
/// `LockService::hurry`); a smoothed reply listens on [`Hurry::cut`].
#[derive(Debug)]
pub struct Hurry {
    armed: std::sync::atomic::AtomicBool,
    cut: tokio::sync::watch::Sender<u64>,
    /// Smoothed replies of the connection waiting now.
    delayed: std::sync::atomic::AtomicU32,
}

impl Default for Hurry {
    fn default() -> Hurry {
        Hurry {
            armed: std::sync::atomic::AtomicBool::new(false),
            cut: tokio::sync::watch::Sender::new(0),
            delayed: std::sync::atomic::AtomicU32::new(0),
        }
    }
}

impl Hurry {
    /// Something of the connection's waits now.
    pub fn arm(&self) {
        self.armed.store(true, Ordering::Release);
    }

    /// Whether something waited, cleared; one relaxed load when nothing
    /// does (the common case, on every read batch).
    pub fn take(&self) -> bool {
        self.armed.load(Ordering::Relaxed) && self.armed.swap(false, Ordering::AcqRel)
    }

    /// Ends every smoothed reply waiting now (see [`Hurry::delay`]);
    /// whether one was.
    pub fn cut_now(&self) -> bool {
        let waiting = self.delayed.load(Ordering::Acquire) > 0;
        if waiting {
            self.cut.send_modify(|n| *n += 1);
        }
        waiting
    }

    /// `reply` after `wait`, or at once when the connection sends more
    /// before then ([`Hurry::cut_now`]): a smoothed reply never holds up
    /// another caller's command behind it.
    pub fn delay<T>(
        self: &std::sync::Arc<Self>,
        reply: T,
        wait: std::time::Duration,
    ) -> impl std::future::Future<Output = T> {
        /// Counts the reply as waiting while it lives (also when the
        /// session drops it unfinished).
        struct Waiting(std::sync::Arc<Hurry>);
        impl Drop for Waiting {
            fn drop(&mut self) {
                self.0.delayed.fetch_sub(1, Ordering::AcqRel);
            }
        }
        let mut cut = self.cut.subscribe();
        self.delayed.fetch_add(1, Ordering::AcqRel);
        let waiting = Waiting(self.clone());
        self.arm();
        async move {
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = cut.changed() => {}
            }
            drop(waiting);
            reply
        }
    }
}

/// A client connection's identity in the lock room (see [`ConnLocks::id`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnId(u64);

impl ConnId {
    /// A new id, never handed out before in this process.
    fn next() -> ConnId {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        ConnId(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }
}

impl ConnLocks {
    /// A table holding at most `max` keys.
    pub fn new(max: usize) -> ConnLocks {
        ConnLocks::opened(max, 0)
    }

    /// A table holding at most `max` keys for a connection opened when the
    /// instance's next token was numbered `born`.
    pub fn opened(max: usize, born: u64) -> ConnLocks {
        ConnLocks {
            id: ConnId::next(),
            map: HashMap::default(),
            order: VecDeque::new(),
            max: max.max(1),
            evicted: 0,
            born,
            parked: None,
            shared_until: None,
            holder_until: None,
            hurry: std::sync::Arc::default(),
        }
    }

    /// The token of this connection's acquisition of `key` if it holds it,
    /// else empty: the scripts take an empty token as "this connection never
    /// acquired it" (the instance rule). An attempt still in flight counts
    /// as not acquired: if it succeeds, its owner record has this instance's
    /// prefix and the instance rule lets it go; if it lost, this connection
    /// is like any other pooled connection of the instance.
    /// A takeover's record gives no token: in the GETSET-timestamp recipe
    /// several clients take over and only the one that read the stale value
    /// holds the lock, so the release follows the instance rule.
    pub fn token(&self, key: &[u8]) -> Bytes {
        self.map
            .get(key)
            .filter(|a| a.standing == Standing::Held && !a.takeover)
            .map(|a| a.token.clone())
            .unwrap_or_default()
    }

    /// The token a release of `key` by this connection carries: its
    /// [`ConnLocks::token`], or empty (the instance rule) while the
    /// connection is seen carrying several callers (`shared_until`). There
    /// the record may be another caller's earlier acquisition, released
    /// since through another connection: a LIFO pool lends connections in
    /// turn, so the holder's `DEL` often travels on one that won an older
    /// lease, and its stale token refused the release, leaving the lock
    /// held for its whole lease (tests/serial/shared_fairness.rs: 2 s
    /// gaps, waits of 2-5 s). Which caller sends what cannot be told on
    /// such a connection; the instance rule is what any pooled connection
    /// that never acquired the key gets.
    pub fn release_token(&self, key: &[u8]) -> Bytes {
        if self.shared_at(Instant::now()) {
            return Bytes::new();
        }
        self.token(key)
    }

    /// Whether the connection counts as carrying several callers at `now`
    /// (`shared_until` or `holder_until` not passed).
    pub fn shared_at(&self, now: Instant) -> bool {
        self.shared_until.is_some_and(|t| t > now) || self.holder_until.is_some_and(|t| t > now)
    }

    /// The tokens by which this connection may hold `key`, for extensions:
    /// its acquisition or takeover and a newer attempt still unsettled
    /// (empty strings where there is none; both empty when the connection
    /// never tried the key, which the scripts take as the instance rule).
    /// Extensions check them exactly: a connection whose `SETNX` lost must
    /// not move the holder's lease with the `EXPIRE` that follows it, but a
    /// holder whose re-entrant `SETNX` answered 0 still holds the lock and
    /// may move its lease. The second is a newline-separated list: the newer attempt and the
    /// earlier unsettled ones.
    pub fn attempt_tokens(&self, key: &[u8]) -> (Bytes, Bytes) {
        match self.map.get(key) {
            None => (Bytes::new(), Bytes::new()),
            Some(a) => {
                let others: Vec<&[u8]> = a
                    .retry
                    .iter()
                    .map(|r| &r.token[..])
                    .chain(a.unsettled.iter().map(|t| &t[..]))
                    .collect();
                (a.token.clone(), Bytes::from(others.join(&b'\n')))
            }
        }
    }

    /// Records a takeover of `key` with `token`: the connection holds the
    /// lock by it (for extensions) until its next release or attempt.
    pub fn took_over(&mut self, key: Bytes, token: Bytes, lease_ms: u64) {
        self.attempt(key.clone(), token, Bytes::new(), Standing::Held, lease_ms);
        if let Some(a) = self.map.get_mut(&key) {
            a.takeover = true;
        }
    }

    /// Records an attempt with `value` answered "not acquired" without
    /// asking Redis; returns the time since this connection's previous
    /// attempt on `key`. A loser's record takes the attempt's value (the
    /// value its latest attempt lost with: see
    /// [`LockService::release_of_a_lost_value`](super::LockService)).
    pub fn lost(&mut self, key: Bytes, token: Bytes, value: Bytes) -> Option<std::time::Duration> {
        if let Some(a) = self.map.get_mut(&key) {
            // A holder's own attempt answered "not acquired" leaves it the
            // holder; a loser stays a loser.
            if a.standing != Standing::Held {
                a.standing = Standing::Lost;
                a.value = value;
            }
            let gap = a.last_try.elapsed();
            a.tried();
            return Some(gap);
        }
        self.attempt(key, token, value, Standing::Lost, 0);
        None
    }

    /// A script of this connection's on `key` was acknowledged. A held
    /// record keeps its token (an extension script leaves the holder the
    /// holder), but its run of attempts begins now and an attempt after
    /// the first one counts as a spinner's, so it parks and is served in
    /// order. Before, a connection that released by script stayed the
    /// holder to the storm room: its attempts were never parked, and `SET
    /// NX PX` spinners with the compare-and-delete release lost nearly
    /// every handoff to `SETNX` ones (one lockgate, 4 and 4 workers on one
    /// key: 1–4 grants each against 58–77; alone, waits up to 2.4 s for
    /// 20 ms holds).
    pub fn scripted(&mut self, key: &[u8]) {
        if let Some(a) = self.map.get_mut(key) {
            if a.standing == Standing::Held {
                let now = Instant::now();
                a.after_script = Some(now);
                a.first_try = now;
            }
        }
    }

    /// Whether this connection's previous attempt on `key` lost (or came
    /// after a script of its own on the key it held, see
    /// [`ConnLocks::scripted`], or after the lease it held the key by ran
    /// out, see [`Acquisition::lapsed`]) less than `window` ago: it spins.
    pub fn spinning(&self, key: &[u8], window: std::time::Duration) -> bool {
        self.map.get(key).is_some_and(|a| {
            let lost = match a.standing {
                Standing::Lost => true,
                Standing::Held => {
                    a.after_script.is_some_and(|t| a.last_try > t)
                        || a.lapsed(Instant::now()).is_some_and(|t| a.last_try > t)
                }
                Standing::Trying => false,
            };
            lost && a.last_try.elapsed() < window
        })
    }

    /// When this connection's current run of attempts on `key` began (for
    /// a holding that lapsed, at its first attempt after that).
    pub fn first_try(&self, key: &[u8]) -> Option<std::time::Instant> {
        self.map.get(key).map(|a| a.first_try)
    }

    /// An extension through this connection gave the lease it holds
    /// `key` by `pttl_ms` more from now (see [`Acquisition::lapsed`]).
    pub fn extended(&mut self, key: &[u8], pttl_ms: i64) {
        if let Some(a) = self.map.get_mut(key) {
            if a.standing == Standing::Held && pttl_ms > 0 {
                let until = Instant::now() + std::time::Duration::from_millis(pttl_ms as u64);
                a.extended_until = Some(until);
            }
        }
    }

    /// The record for `key`.
    pub fn get(&self, key: &[u8]) -> Option<&Acquisition> {
        self.map.get(key)
    }

    /// Records a new attempt (or takeover) on `key` with `token`.
    pub fn attempt(
        &mut self,
        key: Bytes,
        token: Bytes,
        value: Bytes,
        standing: Standing,
        lease_ms: u64,
    ) {
        if !self.map.contains_key(&key) && self.map.len() >= self.max {
            self.evict_oldest();
        }
        if let Some(a) = self.map.get_mut(&key) {
            if a.standing == Standing::Held && standing == Standing::Trying {
                // A re-entrant attempt: the connection keeps holding the key
                // by its current token until this one is settled; an
                // earlier one still unanswered stays a candidate.
                let earlier = a.retry.replace(Retry {
                    token,
                    value,
                    lease_ms,
                });
                if let Some(earlier) = earlier {
                    a.unsettled.push(earlier.token);
                    if a.unsettled.len() > MAX_UNSETTLED {
                        a.unsettled.remove(0);
                    }
                }
                a.tried();
                return;
            }
        }
        let first_try = match self.map.get(&key) {
            Some(a) if a.standing != Standing::Held => a.first_try,
            _ => Instant::now(),
        };
        // An attempt replaced before its outcome was learned may still be
        // the one that won.
        let unsettled = match self.map.get(&key) {
            Some(a) if a.standing != Standing::Held => {
                let mut u = a.unsettled.clone();
                if a.standing == Standing::Trying {
                    u.push(a.token.clone());
                }
                if u.len() > MAX_UNSETTLED {
                    u.remove(0);
                }
                u
            }
            _ => Vec::new(),
        };
        let since = Instant::now();
        self.aged(key.clone(), since);
        self.map.insert(
            key,
            Acquisition {
                first_try,
                last_try: Instant::now(),
                token,
                standing,
                since,
                lease_ms,
                value,
                retry: None,
                unsettled,
                takeover: false,
                after_script: None,
                extended_until: None,
            },
        );
    }

    /// Sets the standing of `key` if its record still carries `token`.
    /// A re-entrant attempt (see [`Acquisition::retry`]) that won takes
    /// the record over; one that lost leaves the holder's record as it was.
    pub fn settle(&mut self, key: &[u8], token: &[u8], standing: Standing, lease_ms: Option<u64>) {
        if let Some(a) = self.map.get_mut(key) {
            if a.retry.as_ref().is_some_and(|r| r.token == token) {
                let Some(retry) = a.retry.take() else {
                    return;
                };
                if standing == Standing::Held {
                    a.token = retry.token;
                    a.value = retry.value;
                    a.lease_ms = lease_ms.unwrap_or(retry.lease_ms);
                    a.since = Instant::now();
                    a.takeover = false;
                    a.after_script = None;
                    let since = a.since;
                    self.aged(Bytes::copy_from_slice(key), since);
                }
                return;
            }
            if let Some(at) = a.unsettled.iter().position(|t| t == token) {
                let t = a.unsettled.remove(at);
                // An earlier attempt won while a newer one is unanswered:
                // the connection holds the key by it, and the newer one is
                // its retry. (A newer takeover ran after it and holds.)
                if standing == Standing::Held && a.standing == Standing::Trying {
                    let newer = std::mem::replace(&mut a.token, t);
                    a.retry = Some(Retry {
                        token: newer,
                        value: std::mem::take(&mut a.value),
                        lease_ms: a.lease_ms,
                    });
                    a.standing = Standing::Held;
                    a.since = Instant::now();
                    let since = a.since;
                    self.aged(Bytes::copy_from_slice(key), since);
                } else if standing == Standing::Held && token_seq(&t) > token_seq(&a.token) {
                    // A re-entrant attempt pipelined behind another won: the
                    // key was free, so the owner record is this attempt's
                    // now, not the older holding's (its value is not kept).
                    // A holding newer than the attempt (a takeover pipelined
                    // after it: SETNX, GETSET) ran later on Redis and keeps
                    // the owner record.
                    a.token = t;
                    a.value = Bytes::new();
                    a.lease_ms = lease_ms.unwrap_or(a.lease_ms);
                    a.since = Instant::now();
                    a.takeover = false;
                    let since = a.since;
                    self.aged(Bytes::copy_from_slice(key), since);
                }
                return;
            }
            if a.token == token {
                a.standing = standing;
                if let Some(ms) = lease_ms {
                    a.lease_ms = ms;
                }
                if standing == Standing::Held {
                    a.since = Instant::now();
                    let since = a.since;
                    self.aged(Bytes::copy_from_slice(key), since);
                }
            }
        }
    }

    /// The key of this connection's latest attempt, if it lost less than
    /// `window` ago (and none since): a blocking pop it sends now is its
    /// library's wait for that key (see `lock::wake`).
    pub fn last_lost(&self, window: std::time::Duration) -> Option<Bytes> {
        let (key, a) = self.map.iter().max_by_key(|(_, a)| a.last_try)?;
        (a.standing == Standing::Lost && a.last_try.elapsed() < window).then(|| key.clone())
    }

    /// A client script released `key`, which this connection held by
    /// `token` (lockgate read so in Redis after the script, see
    /// `lock::reconcile`): the holding is over. Unlike a release of its
    /// own, the record stays, as a lost one: the connection's next attempt
    /// goes on with its run (as after [`ConnLocks::scripted`]), and a
    /// place it keeps in the key's queue is still found and left when it
    /// closes (`LockService::connection_closed`). Found removed, a shared
    /// connection's kept place outlived it and held a new connection's
    /// attempt back (redis-py's `test_competing_locks`, then
    /// `test_timeout`, answered "not acquired" on a free key). An attempt
    /// already on its way (the reconciliation runs in the background)
    /// becomes the record's, to be settled by its reply. Returns the
    /// holding that ended, if the record still carried it.
    pub fn script_released(&mut self, key: &[u8], token: &[u8]) -> Option<Acquisition> {
        let a = self.map.get_mut(key)?;
        if a.token != token || a.standing != Standing::Held {
            return None;
        }
        let ended = a.clone();
        a.takeover = false;
        match a.retry.take() {
            Some(retry) => {
                a.token = retry.token;
                a.value = retry.value;
                a.lease_ms = retry.lease_ms;
                a.standing = Standing::Trying;
            }
            None => a.standing = Standing::Lost,
        }
        Some(ended)
    }

    /// A release planned when tokens below `upto` had been issued has been
    /// answered: the attempts on `key` made before it are over (released
    /// or refused); one pipelined after it stays, as the connection's next
    /// attempt. Returns the record the release ended, if it did.
    pub fn released(&mut self, key: &[u8], upto: u64) -> Option<Acquisition> {
        let before = |t: &Bytes| token_seq(t) < upto;
        let a = self.map.get_mut(key)?;
        a.unsettled.retain(|t| !before(t));
        if a.retry.as_ref().is_some_and(|r| before(&r.token)) {
            a.retry = None;
        }
        if !before(&a.token) {
            return None;
        }
        let ended = a.clone();
        let next = a
            .retry
            .take()
            .map(|r| r.token)
            .or_else(|| a.unsettled.pop());
        match next {
            Some(token) => {
                a.token = token;
                a.standing = Standing::Trying;
                a.takeover = false;
                Some(ended)
            }
            None => self.map.remove(key),
        }
    }

    /// Drops the record given its `since` longest ago (the table is full).
    fn evict_oldest(&mut self) {
        while let Some((key, since)) = self.order.pop_front() {
            if self.map.get(&key).is_some_and(|a| a.since == since) {
                self.map.remove(&key);
                self.evicted += 1;
                return;
            }
        }
    }

    /// Notes that `key`'s record was given `since` (now): see
    /// [`ConnLocks::order`]. Stale entries are dropped once they outnumber
    /// the table twice over, so the queue stays within a few times `max`.
    fn aged(&mut self, key: Bytes, since: Instant) {
        self.order.push_back((key, since));
        if self.order.len() > 2 * self.max.max(self.map.len()) + 64 {
            let map = &self.map;
            self.order
                .retain(|(k, t)| map.get(k).is_some_and(|a| a.since == *t));
        }
    }

    /// Forgets `key` (after a release).
    pub fn remove(&mut self, key: &[u8]) -> Option<Acquisition> {
        self.map.remove(key)
    }

    /// Every key this connection has a record of.
    pub fn keys(&self) -> impl Iterator<Item = &Bytes> {
        self.map.keys()
    }

    /// Keys this connection holds now, with their tokens.
    pub fn held(&self) -> impl Iterator<Item = (&Bytes, &Acquisition)> {
        self.map
            .iter()
            .filter(|(_, a)| a.standing == Standing::Held)
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when no key is recorded.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests;
