//! Wakers per branch for the session's poll loop. A session runs its
//! reader, writer and job runner, and the watchers beside them (the
//! watchdog, a change of primary), as branches of one task. `join!` and
//! `select!` poll every branch whenever any one of them is woken, and a
//! pending branch is not free to poll: the job runner's and the primary
//! watcher's waits each take a lock on every poll, twice per command at
//! `-P 1`. Here each branch polls with a waker of its own, which marks the
//! branch and wakes the task; the session polls only the branches marked
//! since its last poll (all of them the first time).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

/// The wakers of up to 32 branches of one task.
pub struct Branches {
    shared: Arc<Shared>,
    wakers: Vec<Waker>,
}

struct Shared {
    /// Bit `i`: branch `i` was woken since the task last took the set.
    woken: AtomicU32,
    /// The task's own waker, registered at every poll.
    task: AtomicWaker,
}

struct Branch {
    shared: Arc<Shared>,
    bit: u32,
}

impl Wake for Branch {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.shared.woken.fetch_or(self.bit, Ordering::AcqRel);
        self.shared.task.wake();
    }
}

impl Branches {
    /// Wakers for `n` branches (at most 32), every one marked woken.
    pub fn new(n: usize) -> Branches {
        let n = n.min(32);
        let all = if n == 32 { u32::MAX } else { (1u32 << n) - 1 };
        let shared = Arc::new(Shared {
            woken: AtomicU32::new(all),
            task: AtomicWaker::new(),
        });
        let wakers = (0..n)
            .map(|i| {
                Waker::from(Arc::new(Branch {
                    shared: shared.clone(),
                    bit: 1 << i,
                }))
            })
            .collect();
        Branches { shared, wakers }
    }

    /// At the start of the task's poll: registers its waker, then takes
    /// the set of branches woken since the last poll (bit `i` for branch
    /// `i`). A wake after this is for the next poll.
    pub fn woken(&self, cx: &Context<'_>) -> u32 {
        self.shared.task.register(cx.waker());
        self.shared.woken.swap(0, Ordering::AcqRel)
    }

    /// The context branch `i` is polled with.
    pub fn context(&self, i: usize) -> Context<'_> {
        Context::from_waker(&self.wakers[i])
    }

    /// Branch `i`'s waker, for a [`Stop`] of that branch.
    pub fn waker(&self, i: usize) -> Waker {
        self.wakers[i].clone()
    }
}

pin_project_lite::pin_project! {
    /// Runs `main` until it is ready (`Some` of its output) or `stop` is
    /// (`None`). `main` is polled at every poll of the task, as it would be
    /// on its own; `stop` only the first time and when its own waker fired.
    /// A `select!` over the two polled both at every wake: with `stop` a
    /// `CancellationToken`'s wait (the server's forced shutdown around
    /// every session), two locks per poll, about two polls per command at
    /// `-P 1`. A struct, not an `async fn`: the session's future is held
    /// in place, not copied into a second slot of a bigger state.
    pub struct Until<M, S> {
        #[pin]
        main: M,
        #[pin]
        stop: S,
        branches: Branches,
    }
}

impl<M: Future, S: Future> Until<M, S> {
    /// `main`, cut short by `stop`.
    pub fn new(main: M, stop: S) -> Until<M, S> {
        Until {
            main,
            stop,
            branches: Branches::new(1),
        }
    }
}

impl<M: Future, S: Future> Future for Until<M, S> {
    type Output = Option<M::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<M::Output>> {
        let this = self.project();
        if this.branches.woken(cx) != 0 && this.stop.poll(&mut this.branches.context(0)).is_ready()
        {
            return Poll::Ready(None);
        }
        this.main.poll(cx).map(Some)
    }
}

/// A stop flag for one branch, set from another branch of the task or
/// from a watcher of the server's shutdown. Setting it wakes that branch
/// through the waker it was made with, so the branch checks the flag with
/// a plain load and registers nothing: a `CancellationToken`'s wait takes
/// two locks at every poll (its state's and its waiters'), and the reader
/// polled its wait about four times per read batch.
///
/// Contract: [`Stop::stopped`] is polled only by the branch whose waker
/// the flag holds (any future inside that branch polls with that waker).
pub struct Stop {
    set: AtomicBool,
    branch: Waker,
}

impl Stop {
    /// A flag, not set, that wakes `branch` when set.
    pub fn new(branch: Waker) -> Stop {
        Stop {
            set: AtomicBool::new(false),
            branch,
        }
    }

    /// Sets the flag and wakes the branch (once: setting it again does
    /// nothing).
    pub fn stop(&self) {
        if !self.set.swap(true, Ordering::AcqRel) {
            self.branch.wake_by_ref();
        }
    }

    /// Ready once the flag is set; see the contract above.
    pub fn stopped(&self) -> Stopped<'_> {
        Stopped(self)
    }
}

/// [`Stop::stopped`]'s future.
pub struct Stopped<'a>(&'a Stop);

impl Future for Stopped<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
        // No waker to register: `stop` wakes the branch, which polls this
        // again.
        if self.0.set.load(Ordering::Acquire) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::pin::pin;
    use std::task::Poll;
    use tokio::sync::oneshot;

    /// Only woken branches are reported, each once; every branch the
    /// first time; a wake wakes the task.
    #[tokio::test]
    async fn reports_the_branches_woken_since_the_last_poll() {
        let b = Branches::new(3);
        let (tx0, rx0) = oneshot::channel::<u8>();
        let (tx2, rx2) = oneshot::channel::<u8>();
        let (mut rx0, mut rx2) = (pin!(rx0), pin!(rx2));
        let mut seen = Vec::new();
        let mut got = Vec::new();
        let mut senders = (Some(tx0), Some(tx2));
        std::future::poll_fn(|cx| {
            let woken = b.woken(cx);
            seen.push(woken);
            if woken & 1 != 0 {
                if let Poll::Ready(v) = rx0.as_mut().poll(&mut b.context(0)) {
                    got.push(v.unwrap_or(0));
                }
            }
            if woken & 4 != 0 {
                if let Poll::Ready(v) = rx2.as_mut().poll(&mut b.context(2)) {
                    got.push(v.unwrap_or(0));
                }
            }
            // Send from inside the poll, after the branches were polled:
            // each send wakes its branch, and so the task again.
            if let Some(tx) = senders.1.take() {
                let _ = tx.send(2);
            } else if let Some(tx) = senders.0.take() {
                let _ = tx.send(1);
            }
            if got.len() == 2 {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
        assert_eq!(seen, [0b111, 0b100, 0b001]);
        assert_eq!(got, [2, 1]);
    }

    /// `Until` ends with `main`'s output, or with `None` as soon as `stop`
    /// is ready, polling `stop` only when woken.
    #[tokio::test]
    async fn until_ends_with_main_or_at_stop() {
        let (tx, rx) = oneshot::channel::<u8>();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = tx.send(7);
        });
        assert_eq!(Until::new(rx, stop_rx).await, Some(Ok(7)));
        drop(stop_tx);

        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        tokio::spawn(async move {
            tokio::task::yield_now().await;
            let _ = stop_tx.send(());
        });
        assert_eq!(
            Until::new(std::future::pending::<u8>(), stop_rx).await,
            None
        );
    }

    /// A branch waiting on a [`Stop`] is woken, and only it, when another
    /// branch sets the flag; before that its wait is pending.
    #[tokio::test]
    async fn a_stop_wakes_its_branch_only() {
        let b = Branches::new(2);
        let stop = Stop::new(b.waker(0));
        let mut stopped = stop.stopped();
        let mut seen = Vec::new();
        let mut polls = 0;
        std::future::poll_fn(|cx| {
            let woken = b.woken(cx);
            seen.push(woken);
            polls += 1;
            if woken & 1 != 0 && Pin::new(&mut stopped).poll(&mut b.context(0)).is_ready() {
                return Poll::Ready(());
            }
            if woken & 2 != 0 {
                // The other branch stops the first, on its second poll.
                if polls == 2 {
                    stop.stop();
                    stop.stop();
                } else {
                    b.waker(1).wake_by_ref();
                }
            }
            Poll::Pending
        })
        .await;
        assert_eq!(seen, [0b11, 0b10, 0b01]);
    }
}
