//! lockgate in the test's own process, on a port-0 listener.

use std::net::SocketAddr;
use std::sync::Arc;

use lockgate::{Config, ServerContext};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::WAIT;

/// lockgate running in this process on a port-0 listener.
pub struct Lockgate {
    /// Where clients connect.
    pub addr: SocketAddr,
    /// The operators' HTTP listener, when started with one.
    pub admin: Option<SocketAddr>,
    /// The TLS listener, when started with one.
    pub tls: Option<SocketAddr>,
    /// The shared context (metrics).
    pub ctx: Arc<ServerContext>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Lockgate {
    /// lockgate with default config in front of `upstream`.
    pub async fn start(upstream: &str) -> Lockgate {
        let mut config = Config::default();
        config.upstream.addr = upstream.to_string();
        Lockgate::start_with(config).await
    }

    /// lockgate with `config` (its listen address is ignored: port 0).
    pub async fn start_with(config: Config) -> Lockgate {
        Lockgate::start_inner(config, false, false).await
    }

    /// [`Lockgate::start_with`], also serving TLS clients on a port-0
    /// listener (its address in [`Lockgate::tls`]; `proxy.tls` must name
    /// the certificate files, and its `listen` is ignored).
    pub async fn start_with_tls(config: Config) -> Lockgate {
        Lockgate::start_inner(config, false, true).await
    }

    /// [`Lockgate::start_with`], also serving the operators' HTTP endpoints
    /// on a port-0 listener (its address in [`Lockgate::admin`]).
    pub async fn start_with_admin(config: Config) -> Lockgate {
        Lockgate::start_inner(config, true, false).await
    }

    async fn start_inner(config: Config, with_admin: bool, with_tls: bool) -> Lockgate {
        let tls_listener = match with_tls {
            true => Some(TcpListener::bind("127.0.0.1:0").await.expect("bind tls")),
            false => None,
        };
        let tls = tls_listener
            .as_ref()
            .map(|l| l.local_addr().expect("tls addr"));
        let mut config = config;
        // LOCKGATE_TEST_UPSTREAM=shared runs every lockgate the tests start
        // with the default upstream mode in shared mode instead (a whole
        // suite's run of the multiplexed mode).
        if std::env::var("LOCKGATE_TEST_UPSTREAM").as_deref() == Ok("shared")
            && config.proxy.upstream == lockgate::config::UpstreamMode::Dedicated
        {
            config.proxy.upstream = lockgate::config::UpstreamMode::Shared;
        }
        lockgate::context::validate(&config).expect("valid test config");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let admin_listener = match with_admin {
            true => Some(TcpListener::bind("127.0.0.1:0").await.expect("bind admin")),
            false => None,
        };
        let admin = admin_listener
            .as_ref()
            .map(|l| l.local_addr().expect("admin addr"));
        let ctx = Arc::new(ServerContext::new(config));
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(lockgate::run_with_tls(
            ctx.clone(),
            listener,
            tls_listener,
            admin_listener,
            async {
                let _ = rx.await;
            },
        ));
        // LOCKGATE_TEST_REDIS=noscript: the tests are about lockgate once
        // it has seen that the server refuses scripts (what comes before,
        // in the first milliseconds, is a rerun: docs/faults.md), so wait
        // for it; at most a second, for a test whose Redis is down.
        if std::env::var("LOCKGATE_TEST_REDIS").as_deref() == Ok("noscript") {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
            while !ctx.locks.transactions().is_some_and(|t| t.scriptless())
                && ctx.locks.quorum().is_none()
                && std::time::Instant::now() < deadline
            {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        }
        Lockgate {
            addr,
            admin,
            tls,
            ctx,
            stop: Some(tx),
            task: Some(task),
        }
    }

    /// Signals shutdown and waits (bounded) until `run` returned.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            tokio::time::timeout(WAIT, task)
                .await
                .expect("lockgate stops in time")
                .expect("lockgate task");
        }
    }
}

impl Drop for Lockgate {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
        // Stops the admin listener and lockgate's own connections.
        self.ctx.stop.cancel();
    }
}
