//! Fencing waits in line: the `LOCKGATE LOCK … WAIT` callers of one
//! instance on one key are served first come, first served. Only the first
//! in line asks the store; the others wait their turn here, so a caller
//! that came later never takes the lock ahead of one that came earlier,
//! and one instance's callers cost the store one attempt at a time. The
//! turns across instances are the store's (the key's queue, which the
//! fencing script joins as the plain acquisitions do; see
//! `script::FENCE_LOCK`).
//!
//! A release of the key through this instance, or a wake-up from the
//! store (this instance first in the key's queue when the lock was freed),
//! lets the first in line try at once instead of at its next step. The
//! line is a hint: who gets the lock is still decided in the store.
//!
//! A caller whose `WAIT` ran out and that waits again at once (within
//! `spin_window_ms`, as a spin loop does) keeps its place in time: its
//! next place counts from its first `WAIT`, as a spinner's kept place
//! counts from its first attempt. Against attempts of other commands on
//! the key the first in line is served in that order (see
//! [`super::Storm::fence_first`]); counting from each `WAIT` instead, a
//! caller that waited again and again was always younger than the `SETNX`
//! spinners beside it and lost every release to them (tests/serial/
//! quorum_chaos.rs: one fencing client's `WAIT`s running out for 3.8 s
//! while a `SETNX` client was granted 10 times, 18 such runs).
//!
//! Before (df57308) every waiter polled on its own every 25 ms, and who
//! won was whoever polled first after a release: on one Redis, 8 workers
//! over two instances took the lock 16 to 162 times each in 10 s, and
//! whole `WAIT`s of 3 s timed out while others took it again and again.

use std::sync::Arc;

use bytes::Bytes;
use dashmap::DashMap;
use std::time::Instant;
use tokio::sync::{Mutex, MutexGuard, Notify};

use crate::lock::keys::KeyHasher;
use crate::lock::lease::ConnId;

/// One key's line.
#[derive(Debug, Default)]
pub struct Line {
    /// Held by the first in line; tokio's mutex is fair (FIFO).
    turn: Mutex<()>,
    /// Told when the lock may be free: a release here, or a wake-up.
    free: Notify,
    /// The first in line (its place's number) and since when it waits (it
    /// is served against parked attempts on the key in arrival order, see
    /// [`super::Storm::fence_first`]).
    head_since: std::sync::Mutex<Option<(u64, Instant, ConnId)>>,
}

/// Since when a caller whose `WAIT` ran out had waited, kept until `until`
/// for its connection's next `WAIT` on the key.
#[derive(Debug, Clone, Copy)]
struct Kept {
    since: Instant,
    until: Instant,
}

/// Every key's line on this instance, at most `max` keys (more waiters
/// wait without a line, as before, counted by the caller).
#[derive(Debug)]
pub struct Lines {
    lines: DashMap<Bytes, Arc<Line>, KeyHasher>,
    /// Per key and connection, the kept wait of a `WAIT` that ran out; at
    /// most `max` (more are not kept: those callers count from their next
    /// `WAIT`, as before).
    kept: DashMap<(Bytes, ConnId), Kept>,
    max: usize,
    /// How long a kept wait lasts (`spin_window_ms`).
    keep: std::time::Duration,
    next_id: std::sync::atomic::AtomicU64,
}

/// A caller's place in a key's line; leaving (dropped, also when the
/// caller's command is dropped) removes the line once nobody is in it.
#[derive(Debug)]
pub struct Place<'a> {
    lines: &'a Lines,
    key: Bytes,
    line: Arc<Line>,
    /// Its number, to tell it from the others as the head.
    id: u64,
    /// Its connection.
    owner: ConnId,
    /// Since when it waits: when it joined, or its connection's kept wait.
    joined: Instant,
}

impl Lines {
    /// No lines, at most `max` keys; a `WAIT` that ran out keeps its
    /// caller's wait for `keep` (see the module's doc).
    pub fn new(max: usize, keep: std::time::Duration) -> Lines {
        Lines {
            lines: DashMap::with_hasher(KeyHasher::new()),
            kept: DashMap::new(),
            max,
            keep,
            next_id: std::sync::atomic::AtomicU64::new(1),
        }
    }

    /// The keys whose lines `glob` matches, with how many callers wait in
    /// each, at most `max` keys (the operators' view).
    pub fn waiting(&self, glob: impl Fn(&[u8]) -> bool, max: usize) -> Vec<(Bytes, usize)> {
        (self.lines.iter())
            .filter(|e| glob(e.key()))
            .take(max)
            .map(|e| {
                (
                    e.key().clone(),
                    Arc::strong_count(e.value()).saturating_sub(1),
                )
            })
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    /// A place at the end of `key`'s line for a caller on connection
    /// `owner`; `None` when the table is full.
    pub fn join(&self, key: &Bytes, owner: ConnId) -> Option<Place<'_>> {
        if let Some(line) = self.lines.get(key) {
            return Some(self.place(key, owner, line.clone()));
        }
        if self.lines.len() >= self.max {
            return None;
        }
        let line = self.lines.entry(key.clone()).or_default().clone();
        Some(self.place(key, owner, line))
    }

    fn place(&self, key: &Bytes, owner: ConnId, line: Arc<Line>) -> Place<'_> {
        let now = Instant::now();
        let kept = match self.kept.is_empty() {
            true => None,
            false => self.kept.remove(&(key.clone(), owner)),
        };
        let joined = kept
            .map(|(_, k)| k)
            .filter(|k| k.until > now)
            .map_or(now, |k| k.since);
        Place {
            lines: self,
            key: key.clone(),
            line,
            id: self
                .next_id
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            owner,
            joined,
        }
    }

    /// Keeps `place`'s wait for its connection's next `WAIT` on the key;
    /// false when the table of kept waits is full (after dropping those
    /// that ended).
    fn keep(&self, place: &Place<'_>) -> bool {
        let now = Instant::now();
        if self.kept.len() >= self.max {
            self.kept.retain(|_, k| k.until > now);
            if self.kept.len() >= self.max {
                return false;
            }
        }
        let kept = Kept {
            since: place.joined,
            until: now + self.keep,
        };
        self.kept.insert((place.key.clone(), place.owner), kept);
        true
    }

    /// The lock on `key` may be free: the first in its line tries at once
    /// (told now, or at its next wait if it is asking the store). Whether
    /// anyone waits in line.
    pub fn free(&self, key: &[u8]) -> bool {
        match self.lines.get(key) {
            Some(line) => {
                line.free.notify_one();
                true
            }
            None => false,
        }
    }

    /// Whether anyone waits in `key`'s line.
    pub fn waits(&self, key: &[u8]) -> bool {
        self.lines.contains_key(key)
    }

    /// When the first in `key`'s line came, if anyone is first.
    pub fn head_since(&self, key: &[u8]) -> Option<Instant> {
        self.head(key).map(|(since, _)| since)
    }

    /// When the first in `key`'s line came and its connection, if anyone
    /// is first.
    pub fn head(&self, key: &[u8]) -> Option<(Instant, ConnId)> {
        let line = self.lines.get(key)?;
        let head = *crate::sync::lock(&line.head_since);
        head.map(|(_, since, owner)| (since, owner))
    }

    /// Keys with a line (for tests and status).
    pub fn len(&self) -> usize {
        self.lines.len()
    }

    /// Whether no key has a line.
    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }
}

impl Place<'_> {
    /// Waits to be first in line; then served against other attempts on
    /// the key in arrival order (see [`super::Storm::fence_first`]).
    pub async fn first(&self) -> MutexGuard<'_, ()> {
        let turn = self.line.turn.lock().await;
        *crate::sync::lock(&self.line.head_since) = Some((self.id, self.joined, self.owner));
        turn
    }

    /// Since when this caller waits (see the module's doc).
    pub fn since(&self) -> Instant {
        self.joined
    }

    /// The connection it came on.
    pub fn owner(&self) -> ConnId {
        self.owner
    }

    /// This caller's `WAIT` ran out: its connection's next `WAIT` on the
    /// key, if it comes within the keep, counts from this one's start.
    /// False when the table of kept waits was full (not kept).
    pub fn ran_out(&self) -> bool {
        self.lines.keep(self)
    }

    /// Callers in this line now, this one included.
    pub fn waiting(&self) -> usize {
        // The table holds one reference, each place one.
        Arc::strong_count(&self.line).saturating_sub(1)
    }

    /// Waits until the lock may be free (see [`Lines::free`]).
    pub async fn freed(&self) {
        self.line.free.notified().await
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        {
            let mut head = crate::sync::lock(&self.line.head_since);
            if head.is_some_and(|(id, _, _)| id == self.id) {
                *head = None;
            }
        }
        // Two: the table's and this place's. Checked under the shard's
        // lock, so a caller joining meanwhile (which clones under it) is
        // never left in a line the table forgot.
        self.lines
            .lines
            .remove_if(&self.key, |_, line| Arc::strong_count(line) <= 2);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lock::lease::ConnLocks;
    use std::time::Duration;

    fn conn() -> ConnId {
        ConnLocks::new(1).id
    }

    const KEEP: Duration = Duration::from_secs(1);

    #[tokio::test]
    async fn callers_are_served_in_the_order_they_came_and_lines_go_when_empty() {
        // 'static, as spawned waiters borrow it.
        let lines: &'static Lines = Box::leak(Box::new(Lines::new(8, KEEP)));
        let key = Bytes::from_static(b"lock:a");
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let first = lines.join(&key, conn()).expect("a place");
        let turn = first.first().await;
        let mut waiting = Vec::new();
        for i in 0..5 {
            let (order, k) = (order.clone(), key.clone());
            waiting.push(tokio::spawn(async move {
                let place = lines.join(&k, conn()).expect("a place");
                let _turn = place.first().await;
                order.lock().expect("order").push(i);
            }));
            // Each in line before the next comes (the table's, the first's,
            // the waiters' and this look's).
            while Arc::strong_count(&lines.lines.get(&key).expect("line").clone()) < 4 + i {
                tokio::task::yield_now().await;
            }
        }
        drop(turn);
        for w in waiting {
            w.await.expect("a waiter");
        }
        assert_eq!(*order.lock().expect("order"), vec![0, 1, 2, 3, 4]);
        drop(first);
        assert!(lines.is_empty(), "the line went with its last caller");
    }

    #[tokio::test]
    async fn a_release_while_the_first_asks_the_store_is_not_lost() {
        let lines = Lines::new(8, KEEP);
        let key = Bytes::from_static(b"lock:a");
        assert!(!lines.free(&key), "nobody in line");
        let place = lines.join(&key, conn()).expect("a place");
        assert!(lines.free(&key));
        // Told before it waited: its wait ends at once.
        tokio::time::timeout(std::time::Duration::from_secs(5), place.freed())
            .await
            .expect("the release kept for the next wait");
    }

    #[test]
    fn a_full_table_gives_no_place() {
        let lines = Lines::new(1, KEEP);
        let a = lines
            .join(&Bytes::from_static(b"a"), conn())
            .expect("a place");
        assert!(lines.join(&Bytes::from_static(b"b"), conn()).is_none());
        assert!(
            lines.join(&Bytes::from_static(b"a"), conn()).is_some(),
            "a line that exists"
        );
        drop(a);
        assert!(lines.join(&Bytes::from_static(b"b"), conn()).is_some());
    }

    #[tokio::test]
    async fn a_wait_that_ran_out_counts_from_its_first_wait_when_its_connection_waits_again() {
        let lines = Lines::new(8, KEEP);
        let key = Bytes::from_static(b"lock:a");
        let (me, other) = (conn(), conn());
        let first = lines.join(&key, me).expect("a place");
        let since = first.since();
        let turn = first.first().await;
        assert_eq!(lines.head_since(&key), Some(since));
        assert!(first.ran_out(), "kept");
        drop(turn);
        drop(first);
        assert_eq!(lines.head_since(&key), None, "the head left");
        std::thread::sleep(Duration::from_millis(2));
        // Another connection counts from now; this one from its first WAIT.
        let theirs = lines.join(&key, other).expect("a place");
        assert!(theirs.since() > since);
        let again = lines.join(&key, me).expect("a place");
        assert_eq!(again.since(), since, "the kept wait");
        drop(again);
        // Taken once: a third WAIT (nothing ran out) counts from itself.
        let third = lines.join(&key, me).expect("a place");
        assert!(third.since() > since);
        // A kept wait past its keep counts for nothing.
        let short = Lines::new(8, Duration::ZERO);
        let p = short.join(&key, me).expect("a place");
        assert!(p.ran_out());
        let since = p.since();
        drop(p);
        std::thread::sleep(Duration::from_millis(2));
        assert!(short.join(&key, me).expect("a place").since() > since);
    }

    #[test]
    fn a_full_table_of_kept_waits_keeps_no_more() {
        let lines = Lines::new(1, KEEP);
        let a = lines
            .join(&Bytes::from_static(b"a"), conn())
            .expect("a place");
        assert!(a.ran_out());
        let b = lines
            .join(&Bytes::from_static(b"a"), conn())
            .expect("a place");
        assert!(!b.ran_out(), "one kept wait at most");
    }
}
