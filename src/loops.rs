//! More event loops (`--threads N`, N ≥ 2): thread-per-core. Each extra
//! thread runs its own current-thread runtime and accepts on its own
//! listener, bound with `SO_REUSEPORT` to the same address as the main
//! one, so the kernel spreads new connections across the loops and a
//! session stays on the loop that accepted it: no work stealing and no
//! hand-off between threads per command, unlike a multi-thread runtime.
//!
//! The price, and why one loop is the default: two commands sent one just
//! after the other on connections served by different loops may reach
//! Redis in either order (one loop forwards them in the order their
//! sockets became readable, as Redis itself serves them). Everything the
//! loops share (the context, the lock room, `proxy.max_clients`) is in
//! [`ServerContext`] and already `Send + Sync`.

use std::net::TcpListener;
use std::sync::Arc;

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::context::ServerContext;
use crate::sync;

/// One extra loop's listeners, bound (with `SO_REUSEPORT`) by the caller
/// on its own runtime and handed over as std sockets in non-blocking mode.
#[derive(Debug)]
pub struct LoopListeners {
    /// The plain listener.
    pub plain: TcpListener,
    /// The TLS listener, when `proxy.tls.listen` is set.
    pub tls: Option<TcpListener>,
}

/// Starts one thread per entry of `extra`, each serving its listeners
/// until `shutdown` fires and its sessions have drained (the same accept
/// loop and grace period as the main loop). Each returned receiver fires
/// when its loop is done (also when it could not start: that is logged).
pub fn spawn(
    extra: Vec<LoopListeners>,
    ctx: &Arc<ServerContext>,
    shutdown: &CancellationToken,
) -> Vec<oneshot::Receiver<()>> {
    let mut done = Vec::with_capacity(extra.len());
    for (i, listeners) in extra.into_iter().enumerate() {
        let (tx, rx) = oneshot::channel();
        done.push(rx);
        let ctx = ctx.clone();
        let shutdown = shutdown.clone();
        let started = std::thread::Builder::new()
            .name(format!("lockgate-loop-{}", i + 1))
            .spawn(move || {
                run_one(listeners, ctx, shutdown);
                let _ = tx.send(());
            });
        if let Err(e) = started {
            tracing::error!(error = %e, "cannot start an event loop thread; serving with fewer");
        }
    }
    done
}

fn run_one(listeners: LoopListeners, ctx: Arc<ServerContext>, shutdown: CancellationToken) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            tracing::error!(error = %e, "cannot start an event loop's runtime; serving with fewer");
            return;
        }
    };
    sync::lock(&ctx.runtimes).push(runtime.handle().clone());
    runtime.block_on(async move {
        let plain = match tokio::net::TcpListener::from_std(listeners.plain) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "an event loop cannot take its listener; serving with fewer");
                return;
            }
        };
        let tls = match listeners.tls.map(tokio::net::TcpListener::from_std) {
            None => None,
            Some(Ok(l)) => Some(l),
            Some(Err(e)) => {
                tracing::error!(error = %e, "an event loop cannot take its TLS listener; serving with fewer");
                return;
            }
        };
        crate::server::serve(plain, tls, ctx, shutdown).await;
    });
}
