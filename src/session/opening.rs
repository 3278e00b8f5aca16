//! A session's place among those whose upstream connection has not
//! answered yet (`upstream.max_connecting`). Redis answers a connection
//! only once it has accepted it, and while it is busy its listen queue
//! fills: when lockgate accepts clients faster than Redis takes their
//! connections, every connect past Redis's `tcp-backlog` fails and the
//! rest wait there. With a bound, the accept loop waits instead (the
//! clients wait in lockgate's listen queue, as they would in Redis's), and
//! the permit goes back as soon as the upstream has answered.
//!
//! A permit is held at most `upstream.connect_timeout_ms` after the
//! session started, and only while the upstream owes a reply: a client
//! that asks nothing (a pool's idle connection) or only lock commands
//! (answered over lockgate's own connections) gives it back after
//! [`IDLE_MS`]. So the accept loop never waits longer than the connect
//! timeout, whatever the clients do.

use std::time::Duration;

use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

/// How long a session that owes no upstream reply keeps its permit: long
/// enough for the requests a client sent with its connect to be read.
pub const IDLE_MS: u64 = 10;

/// One session's permit, and until when it may hold it.
#[derive(Debug)]
pub struct Opening {
    _permit: OwnedSemaphorePermit,
    started: Instant,
    until: Instant,
}

impl Opening {
    /// A permit held from now, at most `bound` (`connect_timeout_ms`).
    pub fn new(permit: OwnedSemaphorePermit, bound: Duration) -> Opening {
        let started = Instant::now();
        Opening {
            _permit: permit,
            started,
            until: started + bound,
        }
    }

    /// When to give the permit back unless the upstream answers first:
    /// `owes` whether the upstream owes a reply now.
    pub fn release_at(&self, owes: bool) -> Instant {
        match owes {
            true => self.until,
            false => (self.started + Duration::from_millis(IDLE_MS)).min(self.until),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use tokio::sync::Semaphore;

    #[tokio::test(start_paused = true)]
    async fn a_permit_is_held_while_a_reply_is_owed_and_never_past_the_bound() {
        let permits = Arc::new(Semaphore::new(1));
        let bound = Duration::from_millis(1_000);
        let opening = Opening::new(permits.clone().acquire_owned().await.unwrap(), bound);
        let t0 = Instant::now();
        // Nothing owed: the idle grace only.
        assert_eq!(
            opening.release_at(false) - t0,
            Duration::from_millis(IDLE_MS)
        );
        // Owed: until the bound.
        assert_eq!(opening.release_at(true) - t0, bound);
        // A bound shorter than the idle grace wins.
        let short = Opening::new(
            Arc::new(Semaphore::new(1)).acquire_owned().await.unwrap(),
            Duration::from_millis(3),
        );
        assert_eq!(short.release_at(false) - t0, Duration::from_millis(3));
        assert_eq!(permits.available_permits(), 0);
        drop(opening);
        assert_eq!(
            permits.available_permits(),
            1,
            "dropped, the permit is back"
        );
    }
}
