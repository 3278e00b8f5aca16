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

/// One key's line.
#[derive(Debug, Default)]
pub struct Line {
    /// Held by the first in line; tokio's mutex is fair (FIFO).
    turn: Mutex<()>,
    /// Told when the lock may be free: a release here, or a wake-up.
    free: Notify,
    /// When the first in line came (it is served against parked attempts
    /// on the key in arrival order, see [`super::Storm::fence_first`]).
    head_since: std::sync::Mutex<Option<Instant>>,
}

/// Every key's line on this instance, at most `max` keys (more waiters
/// wait without a line, as before, counted by the caller).
#[derive(Debug)]
pub struct Lines {
    lines: DashMap<Bytes, Arc<Line>, KeyHasher>,
    max: usize,
}

/// A caller's place in a key's line; leaving (dropped, also when the
/// caller's command is dropped) removes the line once nobody is in it.
#[derive(Debug)]
pub struct Place<'a> {
    lines: &'a Lines,
    key: Bytes,
    line: Arc<Line>,
    /// When it joined.
    joined: Instant,
}

impl Lines {
    /// No lines, at most `max` keys.
    pub fn new(max: usize) -> Lines {
        Lines {
            lines: DashMap::with_hasher(KeyHasher::new()),
            max,
        }
    }

    /// A place at the end of `key`'s line; `None` when the table is full.
    pub fn join(&self, key: &Bytes) -> Option<Place<'_>> {
        if let Some(line) = self.lines.get(key) {
            return Some(self.place(key, line.clone()));
        }
        if self.lines.len() >= self.max {
            return None;
        }
        let line = self.lines.entry(key.clone()).or_default().clone();
        Some(self.place(key, line))
    }

    fn place(&self, key: &Bytes, line: Arc<Line>) -> Place<'_> {
        Place {
            lines: self,
            key: key.clone(),
            line,
            joined: Instant::now(),
        }
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
        let line = self.lines.get(key)?;
        let since = *crate::sync::lock(&line.head_since);
        since
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
    /// Waits to be first in line, without going first against other
    /// attempts on the key (see [`super::Storm::fence_first`]): the first
    /// in line asks at its own pace, as every waiter did before lines.
    pub async fn first_quietly(&self) -> MutexGuard<'_, ()> {
        self.line.turn.lock().await
    }

    /// Waits to be first in line.
    pub async fn first(&self) -> MutexGuard<'_, ()> {
        let turn = self.line.turn.lock().await;
        *crate::sync::lock(&self.line.head_since) = Some(self.joined);
        turn
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
            if *head == Some(self.joined) {
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

    #[tokio::test]
    async fn callers_are_served_in_the_order_they_came_and_lines_go_when_empty() {
        // 'static, as spawned waiters borrow it.
        let lines: &'static Lines = Box::leak(Box::new(Lines::new(8)));
        let key = Bytes::from_static(b"lock:a");
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let first = lines.join(&key).expect("a place");
        let turn = first.first().await;
        let mut waiting = Vec::new();
        for i in 0..5 {
            let (order, k) = (order.clone(), key.clone());
            waiting.push(tokio::spawn(async move {
                let place = lines.join(&k).expect("a place");
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
        let lines = Lines::new(8);
        let key = Bytes::from_static(b"lock:a");
        assert!(!lines.free(&key), "nobody in line");
        let place = lines.join(&key).expect("a place");
        assert!(lines.free(&key));
        // Told before it waited: its wait ends at once.
        tokio::time::timeout(std::time::Duration::from_secs(5), place.freed())
            .await
            .expect("the release kept for the next wait");
    }

    #[test]
    fn a_full_table_gives_no_place() {
        let lines = Lines::new(1);
        let a = lines.join(&Bytes::from_static(b"a")).expect("a place");
        assert!(lines.join(&Bytes::from_static(b"b")).is_none());
        assert!(
            lines.join(&Bytes::from_static(b"a")).is_some(),
            "a line that exists"
        );
        drop(a);
        assert!(lines.join(&Bytes::from_static(b"b")).is_some());
    }
}
