//! What the writer half tells the reader half for the idle timeout
//! (`proxy.client_idle_timeout_ms`): when it last wrote to the client, and
//! whether the client is exempt now. As on Redis (its `timeout`), a client
//! is idle only when nothing passed either way for the whole period, and
//! never while it waits for a reply (a blocking command such as `BLPOP`),
//! is subscribed or is in `MONITOR`. It also tells the reader when a
//! client's half-close may be passed on to Redis, and the writer when the
//! reader found the client gone (nothing more can reach it).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// One session's activity as the writer half records it; the reader half
/// reads it when its idle timer fires.
#[derive(Debug)]
pub struct Activity {
    epoch: Instant,
    /// When the writer last wrote to the client, in ms after `epoch`.
    last_write_ms: AtomicU64,
    /// Replies are owed, or the client is subscribed or in `MONITOR`.
    exempt: AtomicBool,
    /// The client half-closed and Redis owes no reply ahead of a blocking
    /// command: the close may go on to Redis.
    close_ready: AtomicBool,
    close_notify: Notify,
    /// The reader found the client's connection reset or broken.
    gone: AtomicBool,
    /// The reader waits for the writer's next write ([`Activity::watch_write`]).
    want_write: AtomicBool,
    /// The session's first command went alone and the rest of the client's
    /// pipeline waits for its reply's write ([`Activity::first_alone`]).
    alone: AtomicBool,
    write_notify: Notify,
}

/// What the reader does when its idle timer fires.
#[derive(Debug, PartialEq, Eq)]
pub enum IdleCheck {
    /// The client was idle the whole period: close it.
    Close,
    /// Not idle (or exempt): look again at this instant.
    Until(Instant),
}

impl Activity {
    /// A session's record, starting now.
    pub fn new() -> Activity {
        Activity {
            epoch: Instant::now(),
            last_write_ms: AtomicU64::new(0),
            exempt: AtomicBool::new(false),
            close_ready: AtomicBool::new(false),
            close_notify: Notify::new(),
            gone: AtomicBool::new(false),
            want_write: AtomicBool::new(false),
            alone: AtomicBool::new(false),
            write_notify: Notify::new(),
        }
    }

    /// The reader found the client's connection reset (or reading it
    /// failed): no reply can reach the client any more. Set before the
    /// reader ends, so the writer sees it when the reader's channel closes.
    pub fn client_gone(&self) {
        self.gone.store(true, Ordering::Release);
    }

    /// Whether [`Activity::client_gone`] was called.
    pub fn is_client_gone(&self) -> bool {
        self.gone.load(Ordering::Acquire)
    }

    /// The writer saw the client's half-close and every reply Redis owes
    /// before it (but for blocking commands'): Redis drops replies it has
    /// not sent when it sees a close, so the reader passes it on only now.
    pub fn close_may_pass(&self) {
        if !self.close_ready.swap(true, Ordering::AcqRel) {
            self.close_notify.notify_one();
        }
    }

    /// Waits for [`Activity::close_may_pass`].
    pub async fn until_close_may_pass(&self) {
        if !self.close_ready.load(Ordering::Acquire) {
            // notify_one leaves a permit when no one waits yet.
            self.close_notify.notified().await;
        }
    }

    /// The writer wrote to the client.
    pub fn wrote(&self) {
        let ms = self.epoch.elapsed().as_millis() as u64;
        self.last_write_ms.store(ms, Ordering::Relaxed);
        // A plain load first: set only while a departed-looking client's
        // first command is answered (see `reader`), so once per session.
        if self.want_write.load(Ordering::Relaxed) && self.want_write.swap(false, Ordering::AcqRel)
        {
            self.write_notify.notify_one();
        }
    }

    /// From now, the writer's next write is told to
    /// [`Activity::until_written`]; called before the command whose reply
    /// is waited for is sent, so a reply written at once is not missed.
    pub fn watch_write(&self) {
        self.want_write.store(true, Ordering::Release);
    }

    /// While `on`, the client's first command went alone and the rest of
    /// its pipeline is held back: a session that ends meanwhile because
    /// the client is gone never sent the rest (`clients_gone_unserved`).
    pub fn first_alone(&self, on: bool) {
        self.alone.store(on, Ordering::Release);
    }

    /// Whether [`Activity::first_alone`] is on.
    pub fn is_first_alone(&self) -> bool {
        self.alone.load(Ordering::Acquire)
    }

    /// Waits for the first write after [`Activity::watch_write`].
    pub async fn until_written(&self) {
        // notify_one leaves a permit when no one waits yet.
        self.write_notify.notified().await;
    }

    /// Whether the idle timer is suspended (replies owed, subscribed,
    /// `MONITOR`); the writer sets it after every step.
    pub fn set_exempt(&self, exempt: bool) {
        // Read first: a store on every reply would bounce the cache line for
        // nothing when nothing changes.
        if self.exempt.load(Ordering::Relaxed) != exempt {
            self.exempt.store(exempt, Ordering::Relaxed);
        }
    }

    /// At `now`, with the last client read at `last_read`: close the client,
    /// or look again later.
    pub fn check(&self, now: Instant, last_read: Instant, idle: Duration) -> IdleCheck {
        if self.exempt.load(Ordering::Relaxed) {
            return IdleCheck::Until(now + idle);
        }
        let wrote = self.epoch + Duration::from_millis(self.last_write_ms.load(Ordering::Relaxed));
        let last = last_read.max(wrote);
        if now >= last + idle {
            IdleCheck::Close
        } else {
            IdleCheck::Until(last + idle)
        }
    }
}

impl Default for Activity {
    fn default() -> Self {
        Activity::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IDLE: Duration = Duration::from_secs(10);

    #[tokio::test(start_paused = true)]
    async fn silent_client_is_closed_after_the_period() {
        let a = Activity::new();
        let read = Instant::now();
        tokio::time::advance(Duration::from_secs(9)).await;
        assert_eq!(
            a.check(Instant::now(), read, IDLE),
            IdleCheck::Until(read + IDLE)
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(a.check(Instant::now(), read, IDLE), IdleCheck::Close);
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_restarts_the_period() {
        let a = Activity::new();
        let read = Instant::now();
        tokio::time::advance(Duration::from_secs(6)).await;
        a.wrote();
        let wrote = Instant::now();
        tokio::time::advance(Duration::from_secs(4)).await;
        assert_eq!(
            a.check(Instant::now(), read, IDLE),
            IdleCheck::Until(wrote + IDLE)
        );
        tokio::time::advance(Duration::from_secs(6)).await;
        assert_eq!(a.check(Instant::now(), read, IDLE), IdleCheck::Close);
    }

    #[tokio::test(start_paused = true)]
    async fn exempt_client_is_never_closed() {
        // A BLPOP waiting longer than the period, then its reply: the
        // period runs from the reply, as on Redis.
        let a = Activity::new();
        let read = Instant::now();
        a.set_exempt(true);
        tokio::time::advance(Duration::from_secs(25)).await;
        let now = Instant::now();
        assert_eq!(a.check(now, read, IDLE), IdleCheck::Until(now + IDLE));
        a.wrote();
        a.set_exempt(false);
        let wrote = Instant::now();
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(
            a.check(Instant::now(), read, IDLE),
            IdleCheck::Until(wrote + IDLE)
        );
    }
}
