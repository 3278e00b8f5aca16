//! The one reconnect back-off of every connection lockgate keeps to a
//! Redis: lockgate's own (`node`), the subscriptions (wake-ups, Sentinel's
//! `+switch-master`), the shared connections and their spares, and the
//! lanes to a cluster's nodes. Each had its own, with a ceiling of 1 s in
//! three places and 2 s in three (issue 42): a Redis back after a restart
//! was found again after up to 1 s by some and 2 s by others.
//!
//! Pure: the caller sleeps for what [`Backoff::next`] says.

use std::time::Duration;

/// The longest wait between two attempts, unless the first wait asked for
/// is longer (`upstream.reconnect_interval_ms` above it): a Redis that
/// comes back is found within this.
pub const MAX: Duration = Duration::from_secs(1);

/// The first wait of lockgate's own connections and subscriptions, which
/// no setting names: short, as a failed attempt is usually a restart in
/// progress.
pub const OWN_FIRST: Duration = Duration::from_millis(10);

/// Waits between attempts: `first`, doubling each time, up to [`MAX`] (or
/// `first`, when longer); back to `first` after a success.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    first: Duration,
    next: Duration,
}

impl Backoff {
    /// A back-off whose first wait is `first`.
    pub fn new(first: Duration) -> Backoff {
        Backoff { first, next: first }
    }

    /// The wait before the next attempt; the one after is twice as long,
    /// up to the ceiling.
    pub fn next(&mut self) -> Duration {
        let wait = self.next;
        self.next = (wait * 2).clamp(self.first, MAX.max(self.first));
        wait
    }

    /// An attempt succeeded (a connection made, a subscription confirmed):
    /// the next wait is `first` again.
    pub fn reset(&mut self) {
        self.next = self.first;
    }

    /// The next attempt without waiting (the address changed: nothing
    /// says the new one is down); the one after waits `first`.
    pub fn at_once(&mut self) {
        self.next = Duration::ZERO;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn waits(mut b: Backoff, n: usize) -> Vec<u64> {
        (0..n).map(|_| b.next().as_millis() as u64).collect()
    }

    #[test]
    fn waits_double_up_to_the_ceiling() {
        // (first, the waits that follow)
        let table: [(u64, &[u64]); 4] = [
            (10, &[10, 20, 40, 80, 160, 320, 640, 1000, 1000]),
            (100, &[100, 200, 400, 800, 1000, 1000]),
            (1000, &[1000, 1000, 1000]),
            // A first wait above the ceiling is the ceiling.
            (3000, &[3000, 3000]),
        ];
        for (first, want) in table {
            assert_eq!(waits(Backoff::new(ms(first)), want.len()), want, "{first}");
        }
    }

    #[test]
    fn a_success_starts_again_and_a_new_address_is_tried_at_once() {
        let mut b = Backoff::new(ms(10));
        assert_eq!(waits(b, 0), Vec::<u64>::new());
        for _ in 0..5 {
            b.next();
        }
        b.reset();
        assert_eq!(waits(b, 3), [10, 20, 40]);
        b.at_once();
        assert_eq!(waits(b, 3), [0, 10, 20]);
    }

    #[test]
    fn a_zero_first_wait_retries_at_once_every_time() {
        assert_eq!(waits(Backoff::new(Duration::ZERO), 3), [0, 0, 0]);
    }
}
