//! The accept loop: a connection limit, back-off on accept errors, one
//! session task per client, and the drain on shutdown.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::lock::announce;
use crate::lock::node::{Node, NodeConfig};
use crate::lock::quorum::Quorum;
use crate::lock::LockService;
use crate::metrics::{ProxyMetrics, RateLimit};
use crate::protocol::request::RequestLimits;
use crate::tls::{Side, Stream, TlsStore};
use crate::upstream::{Connector, UpstreamError};

/// Interval between two repeats of the same warning.
const WARN_INTERVAL: Duration = Duration::from_secs(10);
/// Longest pause after repeated accept errors (e.g. out of file descriptors).
const MAX_ACCEPT_BACKOFF: Duration = Duration::from_secs(1);
/// How long a refused client may take to read its error before it is dropped.
const REJECT_WRITE_TIMEOUT: Duration = Duration::from_millis(100);

/// What every session shares: the configuration, the counters and the
/// rate limits of repeated warnings.
#[derive(Debug)]
pub struct ServerContext {
    /// The validated configuration.
    pub config: Config,
    /// Proxy counters.
    pub metrics: ProxyMetrics,
    /// Limits "upstream unavailable / dropped" warnings.
    pub upstream_warn: RateLimit,
    /// Limits accept-error warnings.
    pub accept_warn: RateLimit,
    /// The lock room.
    pub locks: LockService,
    /// lockgate's own shared connection to the primary (watchdog, release
    /// on disconnect, the `LOCKGATE LOCK` fencing API).
    pub primary: Node,
    /// Stops lockgate's own connections when the server has drained.
    pub stop: CancellationToken,
    /// The lock masters, when lock keys live on a quorum.
    pub quorum: Option<Arc<Quorum>>,
    /// Where to re-read the configuration on SIGHUP / `LOCKGATE RELOAD`,
    /// and how to change the log filter then (set by the binary).
    pub reload: std::sync::Mutex<Option<ReloadHook>>,
    /// The configuration in force, as `LOCKGATE CONFIG` shows it.
    pub current: std::sync::RwLock<Config>,
    /// The TLS certificates and settings in force (reloadable).
    pub tls: Arc<TlsStore>,
    /// How sessions reach the primary (plain TCP or TLS).
    pub upstream: Connector,
}

/// What a reload needs from the binary.
pub struct ReloadHook {
    /// The configuration file.
    pub path: std::path::PathBuf,
    /// Turns the file's config into the effective one (applies the
    /// command-line overrides).
    pub effective: Box<dyn Fn(Config) -> Config + Send + Sync>,
    /// Sets the log filter (`log.filter`); errors name the bad directive.
    pub set_log_filter: LogFilterSetter,
}

/// Sets the log filter; errors name the bad directive.
pub type LogFilterSetter = Box<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

impl std::fmt::Debug for ReloadHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReloadHook")
            .field("path", &self.path)
            .finish()
    }
}

impl ServerContext {
    /// A context for `config`, which must already be validated. Starts
    /// lockgate's own connection to the primary, so it must run inside a
    /// Tokio runtime.
    pub fn new(config: Config) -> ServerContext {
        let stop = CancellationToken::new();
        let tls = Arc::new(TlsStore::new(&config));
        let upstream = Connector::new(tls.clone(), Side::Upstream);
        let masters = Connector::new(tls.clone(), Side::Quorum);
        let primary = Node::spawn(
            NodeConfig::for_addr(&config, &config.upstream.addr, upstream.clone()),
            stop.clone(),
        );
        let locks = LockService::new(&config);
        // Releases are announced where the locks live.
        let (stores, connector) = match config.locks.quorum.masters.is_empty() {
            true => (vec![config.upstream.addr.clone()], &upstream),
            false => (config.locks.quorum.masters.clone(), &masters),
        };
        for addr in &stores {
            announce::spawn(
                NodeConfig::for_addr(&config, addr, connector.clone()),
                locks.storm.clone(),
                stop.clone(),
            );
        }
        ServerContext {
            reload: std::sync::Mutex::new(None),
            current: std::sync::RwLock::new(config.clone()),
            locks,
            quorum: Quorum::start(&config, &stop, &masters),
            tls,
            upstream,
            primary,
            stop,
            config,
            metrics: ProxyMetrics::default(),
            upstream_warn: RateLimit::new(WARN_INTERVAL),
            accept_warn: RateLimit::new(WARN_INTERVAL),
        }
    }

    /// Re-reads the configuration file and puts what may change at run
    /// time in force (lock patterns, leases, ownership, overrides, storm
    /// settings, log filter) without touching any connection. An invalid
    /// file is refused and the running configuration kept. Returns what
    /// was done, for the log and `LOCKGATE RELOAD`.
    pub fn reload(&self) -> Result<String, String> {
        let guard = self
            .reload
            .lock()
            .map_err(|_| "reload hook poisoned".to_string())?;
        let Some(hook) = guard.as_ref() else {
            return Err("no configuration file to reload (started without --config)".to_string());
        };
        let new = Config::from_file(&hook.path).map_err(|e| e.to_string())?;
        let new = (hook.effective)(new);
        new.validate().map_err(|e| e.to_string())?;
        let old = self
            .current
            .read()
            .map(|c| c.clone())
            .map_err(|_| "config lock poisoned".to_string())?;
        // The TLS sections apply to new handshakes and connections; only
        // the TLS listener's address needs a restart.
        let tls_in_force = crate::tls::load(&new).map_err(|e| e.to_string())?;
        let mut new_proxy = new.proxy.clone();
        new_proxy.tls.listen = old.proxy.tls.listen.clone();
        let proxy = crate::config::ProxyConfig {
            tls: new_proxy.tls.clone(),
            ..old.proxy.clone()
        };
        let upstream = crate::config::UpstreamConfig {
            tls: new.upstream.tls.clone(),
            ..old.upstream.clone()
        };
        let quorum = crate::config::QuorumConfig {
            tls: new.locks.quorum.tls.clone(),
            ..old.locks.quorum.clone()
        };
        let mut ignored = Vec::new();
        if new.proxy.tls.listen != old.proxy.tls.listen {
            ignored.push("proxy.tls.listen");
        }
        if new_proxy != proxy {
            ignored.push("proxy");
        }
        if new.upstream != upstream {
            ignored.push("upstream");
        }
        if new.limits != old.limits {
            ignored.push("limits");
        }
        if new.locks.quorum != quorum {
            ignored.push("locks.quorum");
        }
        if new.admin != old.admin {
            ignored.push("admin");
        }
        (hook.set_log_filter)(&new.log.filter)?;
        self.locks.reload(&new);
        self.tls.replace(tls_in_force);
        // What is in force: the reloadable sections from the file, the rest
        // as the process started with.
        let in_force = Config {
            proxy,
            upstream,
            limits: old.limits,
            admin: old.admin,
            locks: crate::config::LocksConfig {
                quorum,
                ..new.locks
            },
            log: new.log,
        };
        if let Ok(mut current) = self.current.write() {
            *current = in_force;
        }
        Ok(match ignored.is_empty() {
            true => "reloaded".to_string(),
            false => format!(
                "reloaded; needs a restart to change: {}",
                ignored.join(", ")
            ),
        })
    }

    /// The request limits from the configuration.
    pub fn limits(&self) -> RequestLimits {
        let l = &self.config.limits;
        RequestLimits {
            max_bulk_bytes: l.max_bulk_bytes,
            max_multibulk_len: l.max_multibulk_len,
            max_inline_bytes: l.max_inline_bytes,
            max_request_bytes: l.max_request_bytes,
        }
    }

    /// Opens a connection to the primary, counting and logging failures.
    pub async fn connect_upstream(&self) -> Result<Stream, UpstreamError> {
        let timeout = Duration::from_millis(self.config.upstream.connect_timeout_ms);
        let result = self
            .upstream
            .connect(&self.config.upstream.addr, timeout)
            .await;
        if let Err(e) = &result {
            ProxyMetrics::inc(&self.metrics.upstream_connect_errors);
            self.metrics.error(e.source_kind());
            if let Some(more) = self.upstream_warn.check() {
                tracing::warn!(error = %e, suppressed = more, "cannot reach the primary");
            }
        }
        result
    }
}

/// The next client of either listener, and whether it came to the TLS one.
async fn accept(
    plain: &TcpListener,
    tls: Option<&TcpListener>,
) -> (std::io::Result<(TcpStream, std::net::SocketAddr)>, bool) {
    match tls {
        None => (plain.accept().await, false),
        Some(tls) => tokio::select! {
            accepted = plain.accept() => (accepted, false),
            accepted = tls.accept() => (accepted, true),
        },
    }
}

/// Accepts clients on `listener` (and on `tls`, the TLS listener, when
/// given) until `shutdown` fires, then waits up to
/// `proxy.shutdown_grace_ms` for sessions to drain and cuts the rest. TLS
/// handshakes run in each client's own task, so a stalled one holds up
/// nobody else.
pub async fn serve(
    listener: TcpListener,
    tls: Option<TcpListener>,
    ctx: Arc<ServerContext>,
    shutdown: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(ctx.config.proxy.max_clients));
    let sessions = TaskTracker::new();
    let force = CancellationToken::new();
    let mut backoff = Duration::from_millis(1);
    loop {
        let (accepted, is_tls) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = accept(&listener, tls.as_ref()) => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(pair) => {
                backoff = Duration::from_millis(1);
                pair
            }
            Err(e) => {
                if let Some(more) = ctx.accept_warn.check() {
                    tracing::warn!(error = %e, suppressed = more, "accept failed; backing off");
                }
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(MAX_ACCEPT_BACKOFF);
                continue;
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            ProxyMetrics::inc(&ctx.metrics.connections_rejected);
            // A TLS client could not read a plain-text error: just closed.
            if !is_tls {
                sessions.spawn(reject(stream));
            }
            continue;
        };
        ProxyMetrics::inc(&ctx.metrics.connections_total);
        // The connection's lock records are made at accept, so its birth
        // (the pooled rule) is never later than the client's connect.
        let conn = ctx.locks.conn_locks();
        let ctx = ctx.clone();
        let shutdown = shutdown.clone();
        let force = force.clone();
        sessions.spawn(async move {
            ProxyMetrics::inc(&ctx.metrics.connections_active);
            let serve = async {
                // Nagle only adds latency; lockgate batches writes itself.
                let _ = stream.set_nodelay(true);
                let client = match is_tls {
                    false => Stream::Plain(stream),
                    true => match ctx.tls.accept(stream, peer, &ctx.metrics, &shutdown).await {
                        Some(client) => client,
                        None => return,
                    },
                };
                crate::session::run(ctx.clone(), client, peer, conn, shutdown.clone()).await
            };
            tokio::select! {
                _ = serve => {}
                _ = force.cancelled() => {}
            }
            ctx.metrics
                .connections_active
                .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            drop(permit);
        });
    }
    drop(listener);
    drop(tls);
    sessions.close();
    let grace = Duration::from_millis(ctx.config.proxy.shutdown_grace_ms);
    if tokio::time::timeout(grace, sessions.wait()).await.is_err() {
        tracing::warn!(
            remaining = sessions.len(),
            "grace period over; cutting connections"
        );
        force.cancel();
        sessions.wait().await;
    }
}

/// Tells a client over `proxy.max_clients` why it is refused, as Redis does.
async fn reject(mut stream: TcpStream) {
    let _ = tokio::time::timeout(
        REJECT_WRITE_TIMEOUT,
        stream.write_all(b"-ERR max number of clients reached\r\n"),
    )
    .await;
}

impl crate::lock::storm::Acquirer for ServerContext {
    fn acquire(
        &self,
        ask: crate::lock::storm::Ask,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = (bool, i64)> + Send + '_>> {
        Box::pin(async move {
            use crate::lock::ops::{LockOp, Ttl};
            let lease = ask.lease_ms;
            let op = LockOp::Acquire {
                key: ask.key.clone(),
                value: ask.value.clone(),
                ttl: Ttl::Given("PX", bytes::Bytes::from(lease.to_string())),
                shape: ask.shape,
            };
            if let Some(q) = &self.quorum {
                let out = self
                    .locks
                    .quorum_acquire(q, op, ask.shape, lease, ask.conn, true)
                    .await;
                return (out.acquired, out.pttl);
            }
            let planned = match ask.conn.lock() {
                Ok(mut c) => self.locks.plan_for_handoff(op, &mut c),
                Err(_) => return (false, 0),
            };
            let Some(pending) = planned.pending else {
                return (false, 0);
            };
            let timeout = Duration::from_millis(self.config.upstream.connect_timeout_ms);
            match self.primary.call(planned.command, timeout).await {
                Ok(reply) => {
                    let (_, facts) = crate::lock::split_reply(&reply);
                    if let Ok(mut c) = ask.conn.lock() {
                        self.locks.complete(pending, &facts, &mut c);
                    }
                    (
                        facts.first() == Some(&1),
                        facts.get(1).copied().unwrap_or(0),
                    )
                }
                Err(_) => (false, 0),
            }
        })
    }

    fn stopped(&self) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
        Box::pin(self.stop.cancelled())
    }
}
