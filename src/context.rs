//! What every session shares: [`ServerContext`] (the configuration, the
//! counters, the lock room, lockgate's own connections) and the reload of
//! the configuration file. Sessions, the admin side and the HTTP side all
//! read it; none of them needs the accept loop in [`crate::server`].

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::UpstreamMode;
use crate::config::{
    AdminConfig, Config, ConfigError, LimitsConfig, ProxyConfig, QuorumConfig, UpstreamConfig,
};
use crate::lock::announce;
use crate::lock::eviction::{self, Eviction, Memory, Role};
use crate::lock::fast::Natives;
use crate::lock::quorum::Quorum;
use crate::lock::txn::{OnPrimary, Transactions};
use crate::lock::{LockService, Store};
use crate::metrics::{Counter, ProxyMetrics, RateLimit};
use crate::protocol::request::RequestLimits;
use crate::sentinel;
use crate::sync;
use crate::tls::{Side, TlsStore};
use crate::upstream::cluster::ClusterPool;
use crate::upstream::node::{Node, NodeConfig, Observers};
use crate::upstream::shared::{SharedPool, UpstreamConnMetrics};
use crate::upstream::stream::SessionStream;
use crate::upstream::{Connector, Primary, UpstreamError};

/// The whole check of a configuration, before any port is bound (start-up,
/// `lockgate --check`, a reload): every value ([`Config::validate`]), the
/// guards as the lock room compiles them ([`crate::lock::guard::validate`])
/// and the TLS files as [`crate::tls::load`] reads them, which it returns
/// (a reload puts them in force without reading the files twice). Here,
/// above the rooms that own those checks, so that `config` imports none
/// of them.
pub fn validate(config: &Config) -> Result<crate::tls::Loaded, ConfigError> {
    config.validate()?;
    crate::lock::guard::validate(config)?;
    crate::tls::load(config)
}
/// Interval between two repeats of the same warning.
const WARN_INTERVAL: Duration = Duration::from_secs(10);

/// The sections of the configuration a reload does not change (they need
/// a restart), so a read from here is never stale (except their TLS
/// parts, which a reload puts in [`ServerContext::tls`]: read them there). What a reload changes
/// (lock patterns, leases, ownership, storm settings, the log filter) is
/// not here: the lock room reads its rules in force
/// ([`LockService::rules`]), and [`ServerContext::in_force`] is the whole
/// configuration in force.
#[derive(Debug, Clone, PartialEq)]
pub struct StartConfig {
    /// The client-facing RESP listener.
    pub proxy: ProxyConfig,
    /// The primary Redis.
    pub upstream: UpstreamConfig,
    /// Protocol limits on client input.
    pub limits: LimitsConfig,
    /// The operators' side.
    pub admin: AdminConfig,
    /// The lock masters (`locks.quorum`).
    pub quorum: QuorumConfig,
}

impl StartConfig {
    fn of(config: &Config) -> StartConfig {
        StartConfig {
            proxy: config.proxy.clone(),
            upstream: config.upstream.clone(),
            limits: config.limits.clone(),
            admin: config.admin.clone(),
            quorum: config.locks.quorum.clone(),
        }
    }
}

/// What every session shares: the configuration, the counters and the
/// rate limits of repeated warnings.
#[derive(Debug)]
pub struct ServerContext {
    /// The sections of the validated configuration that need a restart
    /// to change.
    pub config: StartConfig,
    /// Proxy counters.
    pub metrics: ProxyMetrics,
    /// Limits "upstream unavailable / dropped" warnings.
    pub upstream_warn: RateLimit,
    /// Limits accept-error warnings.
    pub accept_warn: RateLimit,
    /// The lock room, and the store where the locks live.
    pub locks: Arc<LockService>,
    /// The status page's history (`admin.history_seconds`).
    pub history: crate::history::History,
    /// lockgate's own shared connection to the primary (watchdog, release
    /// on disconnect, the `LOCKGATE LOCK` fencing API).
    pub primary: Node,
    /// The primary's eviction policy and the keys it was seen evicting,
    /// as lockgate's own connection to it reads them (see
    /// [`crate::lock::eviction`]).
    pub primary_memory: Arc<Memory>,
    /// Stops lockgate's own connections when the server has drained.
    pub stop: CancellationToken,
    /// `locks.require_noeviction` in force, the eviction checks' interval
    /// and counters (see [`crate::lock::eviction`]).
    pub eviction: Arc<Eviction>,
    /// Where to re-read the configuration on SIGHUP / `LOCKGATE RELOAD`,
    /// and how to change the log filter then (set by the binary).
    pub reload: std::sync::Mutex<Option<ReloadHook>>,
    /// The configuration in force, as `LOCKGATE CONFIG` shows it (see
    /// [`ServerContext::in_force`]).
    current: std::sync::RwLock<Config>,
    /// The TLS certificates and settings in force (reloadable).
    pub tls: Arc<TlsStore>,
    /// How sessions reach the primary (plain TCP or TLS).
    pub upstream: Connector,
    /// Which Redis is the primary now (`upstream.addr`, or followed
    /// through Sentinel), its switches and the failover delay.
    pub primary_addr: Arc<Primary>,
    /// The shared connections sessions use with `proxy.upstream =
    /// "shared"` (`None` in dedicated mode).
    pub shared: Option<Arc<SharedPool>>,
    /// The connections to a Redis Cluster's nodes (`[upstream.cluster]`;
    /// `None` in front of one primary).
    pub cluster: Option<Arc<ClusterPool>>,
    /// Counters of the sessions' upstream connections, shared and
    /// dedicated.
    pub upstream_conns: Arc<UpstreamConnMetrics>,
    /// Client slots, `proxy.max_clients` in all: one pool shared by every
    /// event loop's accept loop.
    pub client_slots: Arc<tokio::sync::Semaphore>,
    /// Sessions whose dedicated upstream connection has not answered yet,
    /// `upstream.max_connecting` in all (see [`crate::session::opening`]);
    /// `None` without a bound, in shared mode and in front of a cluster.
    pub opening: Option<Arc<tokio::sync::Semaphore>>,
    /// The event loops' runtimes (the one this context was made on, and
    /// each extra `--threads` loop's, registered when it starts), for
    /// [`ServerContext::tasks_alive`].
    pub runtimes: std::sync::Mutex<Vec<tokio::runtime::Handle>>,
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
        let primary_addr = match config.upstream.sentinel.enabled() {
            true => {
                let followed = Primary::followed();
                let sentinels = Connector::new(tls.clone(), Side::Sentinel);
                sentinel::spawn(
                    &config,
                    followed.clone(),
                    sentinels,
                    upstream.clone(),
                    stop.clone(),
                );
                followed
            }
            // In front of a cluster lockgate's own connection goes to the
            // first seed (policy readings, wake-ups: pub/sub reaches every
            // node); sessions go by slot (`ClusterPool`).
            false if config.upstream.cluster.enabled() => {
                Primary::fixed(&config.upstream.cluster.seeds[0])
            }
            false => Primary::fixed(&config.upstream.addr),
        };
        let primary_memory = Arc::new(Memory::new(match config.locks.quorum.masters.is_empty() {
            true => Role::Primary,
            false => Role::PrimaryBesideQuorum,
        }));
        let natives = Arc::new(Natives::default());
        // Lock transactions open connections of their own, as lockgate's
        // own connection to the primary is opened (following it).
        let txn = Arc::new(Transactions::new(
            NodeConfig::for_addr(&config, &config.upstream.addr, upstream.clone())
                .following(&primary_addr),
            config.locks.transaction_connections,
            config.locks.transaction_retries,
        ));
        let observers = Observers(vec![primary_memory.clone(), natives.clone(), txn.clone()]);
        let on_primary = NodeConfig {
            observer: Some(Arc::new(observers)),
            ..NodeConfig::for_addr(&config, &config.upstream.addr, upstream.clone())
        }
        .following(&primary_addr);
        // A parked attempt's driver and a passed turn go by SHA1 (the
        // sessions load the scripts, and a `NOSCRIPT` reruns as `EVAL`,
        // which caches it): not loaded at each (re)connection, which a
        // primary paused for a failover would hold up.
        let primary = Node::spawn(on_primary.clone(), stop.clone());
        let eviction = Arc::new(Eviction::new(&config));
        let quorum = Quorum::start(&config, &stop, &masters, &eviction);
        // In front of a cluster the lock room's calls go by slot.
        let cluster = (config.upstream.cluster.enabled())
            .then(|| ClusterPool::start(&config, upstream.clone(), &stop));
        let store = Store::new(
            OnPrimary::new(primary.clone(), Some(txn)).on_cluster(cluster.clone()),
            primary_memory.clone(),
            primary_addr.clone(),
            eviction.clone(),
            quorum.clone(),
            stop.clone(),
            Duration::from_millis(config.upstream.connect_timeout_ms),
        )
        .with_natives(natives)
        // Replica acknowledgement asks on a connection of its own (its
        // `WAIT` blocks it), following the primary; opened on first use.
        .with_replicas(
            NodeConfig::for_addr(&config, &config.upstream.addr, upstream.clone())
                .following(&primary_addr),
        );
        let locks = Arc::new(LockService::with_store(&config, store));
        // Policies are read again periodically (and as each connection
        // opens): the primary's, and the masters' where the locks live.
        let mut checked = vec![(primary.clone(), primary_memory.clone())];
        if let Some(q) = &quorum {
            checked.extend(q.masters.iter().map(|m| (m.node.clone(), m.memory.clone())));
        }
        // Former primaries are asked only where a switch can happen: with
        // the locks on the primary, outside a cluster (whose failovers the
        // slot map follows).
        let formers = (quorum.is_none() && cluster.is_none()).then(|| {
            let template = NodeConfig::for_addr(&config, &config.upstream.addr, upstream.clone());
            (template, primary_memory.clone())
        });
        eviction::watch::spawn(
            checked,
            formers,
            eviction.clone(),
            Duration::from_millis(config.upstream.connect_timeout_ms),
            stop.clone(),
        );
        // Guarded writes know a write by Redis's own command table.
        let source = match &cluster {
            Some(pool) => crate::lock::guard::table::Source::Cluster(pool.clone()),
            None => crate::lock::guard::table::Source::Primary(primary.clone()),
        };
        crate::lock::guard::table::spawn(
            locks.clone(),
            source,
            Duration::from_millis(config.upstream.connect_timeout_ms),
            stop.clone(),
        );
        // Wake-ups come from where the locks live.
        let stores: Vec<(NodeConfig, Node)> = match &quorum {
            None => vec![(on_primary, primary.clone())],
            Some(q) => (config.locks.quorum.masters.iter())
                .zip(&q.masters)
                .map(|(addr, m)| {
                    let on_master = NodeConfig::for_addr(&config, addr, masters.clone());
                    (on_master, m.node.clone())
                })
                .collect(),
        };
        for (on_store, node) in stores {
            let store = announce::Store {
                config: on_store,
                node,
                prefix: locks.instance_prefix().to_string(),
            };
            announce::spawn(store, locks.storm.clone(), stop.clone());
        }
        crate::lock::wake::spawn(locks.clone(), stop.clone());
        let runtimes = tokio::runtime::Handle::try_current().into_iter().collect();
        let mut ctx = ServerContext::assemble(&config, locks, tls, upstream, runtimes);
        if cluster.is_some() {
            ctx.cluster = cluster;
        } else if config.proxy.upstream == UpstreamMode::Shared {
            ctx.shared = Some(SharedPool::start(
                &config,
                ctx.upstream.clone(),
                ctx.primary_addr.clone(),
                ctx.upstream_conns.clone(),
                &ctx.stop,
            ));
        }
        ctx
    }

    /// A context for `config` that reaches nothing and starts nothing: its
    /// lock store is [`Store::offline`] (the primary and the masters never
    /// connected), no task runs. For tests of what a session decides and
    /// sends, without sockets.
    #[cfg(test)]
    pub(crate) fn offline(config: Config) -> ServerContext {
        let tls = Arc::new(TlsStore::new(&config));
        let store = Store::offline(&config);
        let locks = Arc::new(LockService::with_store(&config, store));
        let upstream = Connector::new(tls.clone(), Side::Upstream);
        ServerContext::assemble(&config, locks, tls, upstream, Vec::new())
    }

    /// The context around `locks`: the primary's connection, address and
    /// eviction readings, the eviction checks and the stop token are its
    /// store's own (one of each, shared).
    fn assemble(
        config: &Config,
        locks: Arc<LockService>,
        tls: Arc<TlsStore>,
        upstream: Connector,
        runtimes: Vec<tokio::runtime::Handle>,
    ) -> ServerContext {
        let store = locks.store();
        ServerContext {
            reload: std::sync::Mutex::new(None),
            current: std::sync::RwLock::new(config.clone()),
            primary: store.primary.node.clone(),
            primary_memory: store.primary_memory.clone(),
            primary_addr: store.primary_addr().clone(),
            eviction: store.eviction().clone(),
            stop: store.stop().clone(),
            locks,
            tls,
            upstream,
            config: StartConfig::of(config),
            metrics: ProxyMetrics::default(),
            upstream_warn: RateLimit::new(WARN_INTERVAL),
            accept_warn: RateLimit::new(WARN_INTERVAL),
            client_slots: Arc::new(tokio::sync::Semaphore::new(config.proxy.max_clients)),
            opening: (config.upstream.max_connecting > 0
                && config.proxy.upstream == UpstreamMode::Dedicated
                && !config.upstream.cluster.enabled())
            .then(|| Arc::new(tokio::sync::Semaphore::new(config.upstream.max_connecting))),
            runtimes: std::sync::Mutex::new(runtimes),
            shared: None,
            cluster: None,
            upstream_conns: Arc::default(),
            history: crate::history::History::new(
                config.admin.history_seconds,
                config.admin.history_interval_ms,
            ),
        }
    }

    /// Tasks alive now, summed over every event loop's runtime (sessions,
    /// lockgate's own connections, the admin side): a number that keeps
    /// growing under steady traffic is a leak.
    pub fn tasks_alive(&self) -> usize {
        (sync::lock(&self.runtimes).iter())
            .map(|h| h.metrics().num_alive_tasks())
            .sum()
    }

    /// Re-reads the configuration file and puts what may change at run
    /// time in force (lock patterns, leases, ownership, overrides, storm
    /// settings, log filter) without touching any connection. An invalid
    /// file is refused and the running configuration kept. Returns what
    /// was done, for the log and `LOCKGATE RELOAD`.
    pub fn reload(&self) -> Result<String, String> {
        let guard = sync::lock(&self.reload);
        let Some(hook) = guard.as_ref() else {
            return Err("no configuration file to reload (started without --config)".to_string());
        };
        let new = Config::from_file(&hook.path).map_err(|e| e.to_string())?;
        let new = (hook.effective)(new);
        // The TLS sections apply to new handshakes and connections; only
        // the TLS listener's address needs a restart.
        let tls_in_force = validate(&new).map_err(|e| e.to_string())?;
        let old = self.in_force();
        let mut new_proxy = new.proxy.clone();
        new_proxy.tls.listen = old.proxy.tls.listen.clone();
        let proxy = ProxyConfig {
            tls: new_proxy.tls.clone(),
            ..old.proxy.clone()
        };
        let upstream = UpstreamConfig {
            tls: new.upstream.tls.clone(),
            sentinel: crate::config::SentinelConfig {
                tls: new.upstream.sentinel.tls.clone(),
                ..old.upstream.sentinel.clone()
            },
            ..old.upstream.clone()
        };
        let quorum = QuorumConfig {
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
        self.eviction.reload(&new);
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
        *sync::write(&self.current) = in_force;
        Ok(match ignored.is_empty() {
            true => "reloaded".to_string(),
            false => format!(
                "reloaded; needs a restart to change: {}",
                ignored.join(", ")
            ),
        })
    }

    /// The whole configuration in force: the reloadable sections as last
    /// reloaded, the rest as the process started with.
    pub fn in_force(&self) -> Config {
        sync::read(&self.current).clone()
    }

    /// Every counter of every room, the one list `/metrics` exports and
    /// `LOCKGATE STATS` shows: the proxy's, the primary's, and the lock
    /// room's (with its store's: see [`LockService::each_counter`]).
    pub fn each_counter(&self, mut f: impl FnMut(Counter<'_>)) {
        let rooms = [
            self.metrics.counters(),
            self.primary_addr.metrics.counters(),
            self.upstream_conns.counters(),
            (self.cluster.iter())
                .flat_map(|c| c.metrics().counters())
                .collect(),
        ];
        rooms.into_iter().flatten().for_each(&mut f);
        self.locks.each_counter(f);
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

    /// Opens a connection to the primary in force, counting and logging
    /// failures; with the primary's generation, so the session can be
    /// closed when that primary is replaced
    /// ([`Primary::changed_from`]). In shared mode a stream over a shared
    /// connection, at once (a shared connection that is down answers each
    /// command upstream-unavailable).
    pub async fn connect_upstream(&self) -> Result<(SessionStream, u64), UpstreamError> {
        if let Some(pool) = &self.cluster {
            let dedicated = self.config.proxy.upstream == UpstreamMode::Dedicated;
            return Ok((SessionStream::Cluster(Box::new(pool.session(dedicated))), 0));
        }
        if let Some(pool) = &self.shared {
            let generation = self.primary_addr.current().generation;
            return Ok((SessionStream::Shared(Box::new(pool.session())), generation));
        }
        let timeout = Duration::from_millis(self.config.upstream.connect_timeout_ms);
        let current = self.primary_addr.current();
        let result = match &current.addr {
            Some(addr) => self.upstream.connect(addr, timeout).await,
            None => Err(UpstreamError::NoPrimary {
                master: self.config.upstream.sentinel.master_name.clone(),
            }),
        };
        if let Err(e) = &result {
            ProxyMetrics::inc(&self.metrics.upstream_connect_errors);
            self.metrics.error(e.source_kind());
            if let Some(more) = self.upstream_warn.check() {
                tracing::warn!(error = %e, suppressed = more, "cannot reach the primary");
            }
        }
        result.map(|stream| (SessionStream::Direct(stream), current.generation))
    }
}
