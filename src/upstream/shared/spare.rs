//! Warm spare dedicated connections (`proxy.shared_spare_connections`): a
//! session that moves to a connection of its own takes one at once, so
//! the command that moved it reaches Redis as soon as it would have on a
//! connection opened with the client. Connecting at the move instead
//! costs a connect (and a TLS handshake) while the client's other
//! connections go on: Redis's suite sends `XREADGROUP … BLOCK 0` on a new
//! client and at once `FLUSHALL` on another, and the flush overtook it.
//!
//! A spare is opened exactly as a moving session's connection would be
//! (nothing sent on it), for the primary in force; one task keeps
//! the count up ([`run`]): it opens them at the start, after a move took
//! one (or found none) and for a new primary, with back-off after a
//! failure; it drops every spare when the primary changes, and watches
//! the spares so one closed while idle is dropped. That one is reopened
//! only at the next move: Redis closing idle connections (its `timeout`,
//! an operator's `CLIENT KILL`) is not fought, and at rest after such a
//! sweep Redis sees only the shared connections. A spare is checked again
//! as it is taken; none ready, the session connects as before.

use std::future::poll_fn;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use tokio::io::{AsyncRead, ReadBuf};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::{Common, UpstreamConnMetrics};
use crate::metrics::ProxyMetrics;
use crate::sync;
use crate::tls::Stream;
use crate::upstream::backoff::Backoff;

/// The spares ready now (see the module doc).
#[derive(Debug)]
pub(super) struct Spares {
    /// `proxy.shared_spare_connections`.
    target: usize,
    ready: Mutex<Ready>,
    /// A spare was taken or dropped: the task opens another.
    taken: Notify,
}

#[derive(Debug, Default)]
struct Ready {
    /// The primary's generation the spares were opened to.
    generation: u64,
    conns: Vec<Stream>,
}

impl Ready {
    /// Drops the spares if `generation` is newer than theirs (opened to
    /// another primary, they are of no use to anyone), counting them;
    /// whether they are `generation`'s now (generations only grow: an
    /// older one finds newer spares, of no use to it).
    fn retarget(&mut self, generation: u64, metrics: &UpstreamConnMetrics) -> bool {
        if generation > self.generation {
            ProxyMetrics::add(&metrics.spare_dropped, self.conns.len() as u64);
            self.conns.clear();
            self.generation = generation;
        }
        self.generation == generation
    }
}

impl Spares {
    /// No spares yet; `target` of them once [`run`] has opened them.
    pub(super) fn new(target: usize) -> Spares {
        Spares {
            target,
            ready: Mutex::new(Ready::default()),
            taken: Notify::new(),
        }
    }

    /// A spare to the primary of `generation`, alive as far as can be told
    /// without waiting; `None` (counted in `shared_spare_misses`) when none
    /// is ready: the caller connects.
    pub(super) fn take(&self, generation: u64, metrics: &UpstreamConnMetrics) -> Option<Stream> {
        if self.target == 0 {
            return None;
        }
        loop {
            let spare = {
                let mut ready = sync::lock(&self.ready);
                let spare = match ready.retarget(generation, metrics) {
                    true => ready.conns.pop(),
                    false => None,
                };
                metrics
                    .spare_open
                    .store(ready.conns.len() as u64, Ordering::Relaxed);
                spare
            };
            self.taken.notify_one();
            let Some(mut spare) = spare else {
                ProxyMetrics::inc(&metrics.spare_misses);
                return None;
            };
            let mut cx = Context::from_waker(Waker::noop());
            if closed(&mut spare, &mut cx).is_pending() {
                return Some(spare);
            }
            ProxyMetrics::inc(&metrics.spare_dropped);
        }
    }

    /// Keeps `spare`, opened to the primary of `generation`, unless the
    /// primary has changed since (then it is dropped, closing it).
    fn put(&self, generation: u64, spare: Stream, metrics: &UpstreamConnMetrics) {
        let mut ready = sync::lock(&self.ready);
        if ready.retarget(generation, metrics) {
            ready.conns.push(spare);
        } else {
            ProxyMetrics::inc(&metrics.spare_dropped);
        }
        metrics
            .spare_open
            .store(ready.conns.len() as u64, Ordering::Relaxed);
    }

    /// Drops the spares of a primary other than `generation`'s, and any
    /// that closed; how many are left.
    fn sweep(&self, generation: u64, metrics: &UpstreamConnMetrics) -> usize {
        let mut cx = Context::from_waker(Waker::noop());
        let mut ready = sync::lock(&self.ready);
        ready.retarget(generation, metrics);
        let before = ready.conns.len();
        ready.conns.retain_mut(|c| closed(c, &mut cx).is_pending());
        ProxyMetrics::add(&metrics.spare_dropped, (before - ready.conns.len()) as u64);
        metrics
            .spare_open
            .store(ready.conns.len() as u64, Ordering::Relaxed);
        ready.conns.len()
    }

    /// Ready once a spare has closed (its wakers are `cx`'s).
    fn poll_any_closed(&self, cx: &mut Context<'_>) -> Poll<()> {
        let mut ready = sync::lock(&self.ready);
        for conn in &mut ready.conns {
            if closed(conn, cx).is_ready() {
                return Poll::Ready(());
            }
        }
        Poll::Pending
    }

    /// Closes every spare (shutdown).
    fn clear(&self, metrics: &UpstreamConnMetrics) {
        sync::lock(&self.ready).conns.clear();
        metrics.spare_open.store(0, Ordering::Relaxed);
    }
}

/// Ready when an idle connection has closed: Redis sends nothing
/// unasked, so anything it reads (the end, an error, a byte) means the
/// connection is of no use. Pending: nothing came; `cx` is woken when
/// something does.
fn closed(conn: &mut Stream, cx: &mut Context<'_>) -> Poll<()> {
    let mut byte = [0u8; 1];
    let mut buf = ReadBuf::new(&mut byte);
    match Pin::new(conn).poll_read(cx, &mut buf) {
        Poll::Pending => Poll::Pending,
        Poll::Ready(Ok(()) | Err(_)) => Poll::Ready(()),
    }
}

/// Keeps `common.spares` at its target until `stop`, then closes them
/// (see the module doc).
pub(super) async fn run(common: Arc<Common>, stop: CancellationToken) {
    let spares = &common.spares;
    let first = common.reconnect_interval;
    let mut backoff = Backoff::new(first);
    // Spares follow demand: opened at the start, for a new primary and
    // after a move took one; one Redis closed while idle is not reopened
    // until then.
    let mut refill = true;
    loop {
        let current = common.primary.current();
        let ready = spares.sweep(current.generation, &common.metrics);
        if ready >= spares.target {
            refill = false;
        }
        if !refill {
            refill |= tokio::select! {
                _ = stop.cancelled() => break,
                _ = spares.taken.notified() => true,
                _ = poll_fn(|cx| spares.poll_any_closed(cx)) => false,
                _ = common.primary.changed_from(current.generation) => true,
            };
            continue;
        }
        let opened = tokio::select! {
            _ = stop.cancelled() => break,
            opened = common.open(&current, false) => opened,
        };
        match opened {
            Ok(spare) => {
                backoff.reset();
                spares.put(current.generation, spare, &common.metrics);
            }
            Err(err) => {
                if let Some(more) = common.warn.check() {
                    tracing::warn!(error = %err, suppressed = more, "could not open a spare upstream connection; retrying");
                }
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(backoff.next()) => {}
                    _ = common.primary.changed_from(current.generation) => {}
                }
            }
        }
    }
    spares.clear(&common.metrics);
}
