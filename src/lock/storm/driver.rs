//! The driver: one task per key with parked attempts, started by the first
//! park and ended when the queue is empty. It feeds [`Event::Tick`] to the
//! key's state machine ([`super::key`]) and carries out what comes back:
//! acquire for the front of the queue through the [`Acquirer`] (the only
//! Redis work, so tests give it a scripted fake), answer attempts, sleep
//! until the next time something is due or a wake.

use std::sync::Arc;

use bytes::Bytes;
use tokio::time::Instant;

use super::event::{Acquisition, Action, Event};
use super::{shaped, Acquirer, KeyState, Storm};

impl Storm {
    /// Hands the lock on `key` to its queued attempts, oldest first, until
    /// none is left (see [`super::key::Key::step`] for the rules).
    pub(super) async fn drive(
        self: Arc<Self>,
        acquirer: Arc<dyn Acquirer>,
        key: Bytes,
        state: Arc<KeyState>,
    ) {
        let mut event = Event::Tick;
        loop {
            let Some(actions) = self.on(&state, event, Instant::now()) else {
                return;
            };
            event = Event::Tick;
            let mut sleep = None;
            for action in actions {
                match action {
                    Action::Acquire { id, ask } => {
                        let lease_ms = ask.lease_ms;
                        let tried = acquirer.acquire(ask).await;
                        event = Event::Acquired(Acquisition {
                            id,
                            acquired: tried.acquired,
                            pttl: tried.pttl,
                            lease_ms,
                            behind_ms: tried.behind_ms,
                        });
                    }
                    Action::Handoff { id, reply, shape } => {
                        let delivered = reply.map(|r| r.send(shaped(shape, true)).is_ok());
                        if delivered != Some(true) {
                            // Its park ended (or it went away) while the
                            // lock was being taken for it: the lease runs
                            // out unless it releases.
                            tracing::debug!(key = %String::from_utf8_lossy(&key), waiter = id, "handoff to an attempt no longer waiting");
                        }
                    }
                    Action::SleepUntil(at) => sleep = Some(at),
                    Action::Exit => return,
                    _ => {}
                }
            }
            let Some(at) = sleep else {
                continue;
            };
            tokio::select! {
                _ = state.wake.notified() => {}
                _ = tokio::time::sleep_until(at) => {}
                _ = acquirer.stopped() => {
                    self.on(&state, Event::Stopped, Instant::now());
                    return;
                }
            }
        }
    }
}
