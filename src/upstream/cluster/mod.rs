//! A Redis Cluster behind lockgate (`[upstream.cluster]`): sessions'
//! commands routed by hash slot to the node that serves them, with the
//! order of replies kept (see `docs/cluster.md`).
//!
//! A session gets a [`ClusterStream`] where it would get a socket of its
//! own, and uses it the same way ([`stream`]). Its write side asks
//! [`crate::cluster::route::route`] where each command goes and sends it
//! as a [`lane::Job`] to that node's shared connection (a [`lane`],
//! `proxy.shared_upstream_connections` per node), or, for a blocking
//! command, a script or a transaction, to a connection of the session's
//! own to that node; its read side hands the replies back in the order of
//! the commands, whichever node answered first. Commands split across
//! slots (`MGET`, `DEL`, …) and keyspace-wide ones (`DBSIZE`, `KEYS`,
//! `FLUSHALL`, `SCRIPT LOAD`, `SCAN`) are sent to each node concerned and
//! their replies merged into one ([`merge`]).
//!
//! Which node serves a slot is a hint with bounded staleness: the slot
//! map read from the nodes ([`topology`]) at start, every
//! `upstream.cluster.refresh_interval_ms`, and soon after a node
//! redirected a command (`MOVED`) or was lost, never twice within
//! `upstream.cluster.refresh_min_gap_ms`. A node's `MOVED` and `ASK` are
//! followed by the lane that read them, at most
//! `upstream.cluster.max_redirects` times per command: the client never
//! sees one.
//!
//! Beside the map lockgate follows, every node's own view is read and
//! compared ([`disputes`]): slots two nodes claim are named.

mod disputes;
mod lane;
mod merge;
mod pin;
mod stream;
pub mod topology;

pub use disputes::Dispute;
pub use stream::{ClusterRead, ClusterStream, ClusterWrite};

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use smallvec::smallvec;
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;

use crate::cluster::facade::Facade;
use crate::cluster::keys::KeyTable;
use crate::cluster::map::SlotMap;
use crate::cluster::redirect::Redirect;
use crate::cluster::topology::refresh_due;
use crate::config::Config;
use crate::metrics::{counters, ProxyMetrics, RateLimit};
use crate::protocol::encode;
use crate::sync;
use crate::tls::Stream;
use crate::upstream::node::{connect_authenticated, request, NodeConfig, NodeError, Request};
use crate::upstream::Connector;
use lane::{Job, Part};
use topology::fetch_from;

/// The name lockgate's connections to the nodes give themselves
/// (`CLIENT LIST`): shared ones and a session's own.
pub const SHARED_NAME: &str = "lockgate-cluster";
/// The name of a session's own connection to a node.
pub const OWN_NAME: &str = "lockgate-cluster-own";

counters! {
    /// Counters of lockgate's connections to a cluster's nodes and of the
    /// routing over them.
    pub struct ClusterMetrics {
        /// Shared connections to the nodes open now.
        shared_open: Gauge "cluster_shared_connections", "Shared connections to cluster nodes open now";
        /// Sessions' own connections to the nodes open now.
        own_open: Gauge "cluster_own_connections", "Sessions' own connections to cluster nodes open now (blocking commands, scripts, transactions, subscriptions)";
        /// Connections to the nodes opened.
        node_connects: Counter "cluster_node_connects", "Connections to cluster nodes opened";
        /// Attempts to open a connection to a node that failed.
        node_connect_errors: Counter "cluster_node_connect_errors", "Attempts to open a connection to a cluster node that failed";
        /// Connections to the nodes lost.
        node_lost: Counter "cluster_node_connections_lost", "Connections to cluster nodes lost";
        /// Connections to the nodes given up because a lock command went
        /// unanswered past `upstream.lock_reply_timeout_ms`
        /// (counted in `node_lost` too).
        lock_reply_timeouts: Counter "cluster_lock_reply_timeouts", "Connections to cluster nodes given up because a lock command went unanswered past upstream.lock_reply_timeout_ms";
        /// Replies answered upstream-unavailable for a node down or lost.
        error_replies: Counter "cluster_error_replies", "Replies answered upstream-unavailable because a cluster node was down or its connection lost";
        /// Malformed or unowed replies from a node (its connection is dropped).
        bad_replies: Counter "cluster_bad_replies", "Malformed or unowed replies from a cluster node";
        /// MOVED redirections followed.
        moved: Counter "cluster_redirects_moved", "MOVED redirections followed";
        /// ASK redirections followed.
        ask: Counter "cluster_redirects_ask", "ASK redirections followed";
        /// Redirections answered -TRYAGAIN (past max_redirects, or on a session's own connection).
        redirects_refused: Counter "cluster_redirects_refused", "Redirections not followed, answered -TRYAGAIN (past upstream.cluster.max_redirects, or on a session's own connection)";
        /// Slot map readings that found a map.
        refreshes: Counter "cluster_map_refreshes", "Slot map readings";
        /// Slot map readings that changed the map.
        map_changes: Counter "cluster_map_changes", "Slot map readings that found a change";
        /// Slot map readings that failed on every node asked.
        refresh_errors: Counter "cluster_map_refresh_errors", "Slot map readings that failed on every node asked";
        /// Commands split per slot.
        splits: Counter "cluster_split_commands", "Commands split per slot (MGET, DEL, UNLINK, EXISTS, TOUCH, MSET across slots)";
        /// Commands sent to every primary.
        fanouts: Counter "cluster_fanout_commands", "Commands sent to every primary and merged (DBSIZE, KEYS, FLUSHALL, FLUSHDB, SCRIPT LOAD, SCAN, …)";
        /// Commands refused with CROSSSLOT.
        crossslot: Counter "cluster_crossslot_refused", "Commands refused with CROSSSLOT (keys in more than one slot, not splittable)";
        /// Commands answered by lockgate (facade, refusals).
        local: Counter "cluster_local_replies", "Commands answered by lockgate in front of a cluster (CLUSTER SLOTS and kin, refusals)";
        /// Clients closed: past half of proxy.shared_session_reply_bytes of replies waited for them and they took none for proxy.shared_reply_stall_ms.
        output_limit: Counter "cluster_session_output_limit", "Clients closed in front of a cluster: more than half of proxy.shared_session_reply_bytes of replies waited for them and they took none for proxy.shared_reply_stall_ms";
        /// Replicas seen promoted (shard failovers).
        failovers: Counter "cluster_failovers", "Shard failovers seen (a replica promoted): lock acquisitions in its slots held back for the failover delay";
        /// Lock acquisitions answered not acquired during a shard's failover delay.
        failover_held: Counter "cluster_failover_held_acquisitions", "Lock acquisitions answered not acquired during a shard's failover delay";
        /// Slots no node serves in the map in force.
        unserved: Gauge "cluster_slots_unserved", "Slots no node serves in the slot map in force";
        /// Primaries in the map in force.
        primaries: Gauge "cluster_primaries", "Primaries in the slot map in force";
        /// Slots nodes disagree about ([`disputes`]).
        disputed: Gauge "cluster_disputed_slots", "Slots the cluster's nodes name different primaries for, two checks in a row (upstream.cluster.views_check_ms)";
        /// Nodes not asked their view: past `disputes::MAX_ASKED`.
        views_unasked: Counter "cluster_views_unasked", "Nodes not asked their own slot map in a check: more than 64 known (upstream.cluster.views_check_ms)";
    }
}

/// Shared lanes per node address and protocol (RESP3: true).
type LaneMap = HashMap<(Arc<str>, bool), Vec<mpsc::Sender<Job>>>;

/// What the lanes, the sessions and the map's reader share.
pub(crate) struct Common {
    /// The slot map in force (`None`: none read yet) and when it was read.
    map: RwLock<(Option<Arc<SlotMap>>, Instant)>,
    /// Bumped at every change of the map (sessions drop their lanes then).
    generation: AtomicU64,
    /// Every command's keys, from a node's `COMMAND`.
    keys: RwLock<Arc<KeyTable>>,
    /// lockgate as the one node cluster-aware clients see (its address
    /// set once the listener is bound).
    pub(crate) facade: RwLock<Facade>,
    /// Shared lanes per node address and protocol (RESP3: true).
    lanes: Mutex<LaneMap>,
    /// The nodes' server version (`INFO server`), for `HELLO`'s reply.
    pub(crate) version: RwLock<String>,
    /// How lockgate connects to the nodes (timeout, credentials, TLS).
    node: NodeConfig,
    seeds: Vec<String>,
    lanes_per_node: usize,
    queue: usize,
    pub(crate) reconnect_interval: Duration,
    pub(crate) read_chunk: usize,
    /// Half of `proxy.shared_session_reply_bytes`: past it a session sends
    /// no more commands until its client reads ([`lane::Unread`]).
    pub(crate) reply_half: u64,
    /// `proxy.shared_reply_stall_ms`: how long a session past
    /// `reply_half` waits for its client to take any reply before it is
    /// closed.
    pub(crate) reply_stall: Duration,
    pub(crate) max_redirects: u32,
    /// `upstream.lock_reply_timeout_ms` (`None`: no bound).
    pub(crate) lock_reply_timeout: Option<Duration>,
    refresh_interval: Duration,
    refresh_gap: Duration,
    /// Replicas seen promoted to primary (a shard failover), and when:
    /// their slots' lock acquisitions are held back for the failover
    /// delay ([`ClusterPool::hold_left`]). Pruned at each change of the map.
    promoted: Mutex<Vec<(String, Instant)>>,
    /// Nodes whose last connection attempt from a shared lane failed
    /// (`/readyz`, `LOCKGATE NODES`); cleared by the next that succeeds.
    down: Mutex<std::collections::HashSet<Arc<str>>>,
    /// One `Arc` per node address sessions use ([`Common::intern`]), so
    /// they compare and hash lanes by pointer; entries no session holds
    /// are pruned at each change of the map.
    names: Mutex<std::collections::HashSet<Arc<str>>>,
    /// Wakes the map's reader early (a redirection, a node lost).
    refresh: Notify,
    /// Slots the nodes disagree about ([`disputes`]).
    pub(crate) disputes: disputes::Watch,
    /// `upstream.cluster.views_check_ms` (zero: off).
    views_check: Duration,
    pub(crate) metrics: Arc<ClusterMetrics>,
    pub(crate) warn: RateLimit,
    stop: CancellationToken,
}

impl std::fmt::Debug for Common {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Common")
            .field("seeds", &self.seeds)
            .finish()
    }
}

impl Common {
    /// The shared state of `config`'s cluster upstream, with no map read
    /// and no lane started yet ([`ClusterPool::start`] starts the map's
    /// reader; the stream's tests set a map and lanes of their own).
    fn new(config: &Config, connector: Connector, stop: &CancellationToken) -> Common {
        let c = &config.upstream.cluster;
        Common {
            map: RwLock::new((None, Instant::now())),
            generation: AtomicU64::new(0),
            keys: RwLock::new(Arc::new(KeyTable::default())),
            facade: RwLock::new(Facade::new("lockgate", "127.0.0.1", 6379)),
            lanes: Mutex::new(HashMap::new()),
            version: RwLock::new(String::new()),
            node: NodeConfig::for_addr(config, &config.upstream.addr, connector),
            seeds: c.seeds.clone(),
            lanes_per_node: config.proxy.shared_upstream_connections.max(1),
            queue: config.proxy.shared_upstream_queue_batches.max(1),
            reconnect_interval: Duration::from_millis(config.upstream.reconnect_interval_ms),
            read_chunk: config.proxy.read_chunk_bytes,
            reply_half: config.proxy.shared_session_reply_bytes / 2,
            reply_stall: Duration::from_millis(config.proxy.shared_reply_stall_ms),
            max_redirects: c.max_redirects,
            lock_reply_timeout: config.upstream.lock_reply_timeout(),
            refresh_interval: Duration::from_millis(c.refresh_interval_ms),
            refresh_gap: Duration::from_millis(c.refresh_min_gap_ms),
            refresh: Notify::new(),
            disputes: disputes::Watch::default(),
            views_check: Duration::from_millis(c.views_check_ms),
            promoted: Mutex::new(Vec::new()),
            down: Mutex::new(std::collections::HashSet::new()),
            names: Mutex::new(std::collections::HashSet::new()),
            metrics: Arc::default(),
            warn: RateLimit::new(Duration::from_secs(10)),
            stop: stop.clone(),
        }
    }

    /// A connection to the node `addr`, authenticated as lockgate's own
    /// (`upstream.username`/`password`), named, speaking RESP3 when
    /// `resp3` (after `HELLO 3`).
    pub(crate) async fn open(
        &self,
        addr: &str,
        shared: bool,
        resp3: bool,
    ) -> Result<Stream, String> {
        let config = NodeConfig {
            addr: addr.to_string(),
            ..self.node.clone()
        };
        let mut stream = connect_authenticated(&config).await?;
        let name = match shared {
            true => SHARED_NAME,
            false => OWN_NAME,
        };
        let setname = encode::command(&[b"CLIENT", b"SETNAME", name.as_bytes()]);
        request(&mut stream, &setname, config.connect_timeout).await?;
        if resp3 {
            let hello = request(
                &mut stream,
                &encode::command(&[b"HELLO", b"3"]),
                config.connect_timeout,
            )
            .await?;
            if hello.first() == Some(&b'-') {
                return Err(String::from_utf8_lossy(&hello).trim().to_string());
            }
        }
        Ok(stream)
    }

    /// The slot map in force, if one was read.
    pub(crate) fn map(&self) -> Option<Arc<SlotMap>> {
        sync::read(&self.map).0.clone()
    }

    /// The generation of the map in force.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The key table in force.
    pub(crate) fn keys(&self) -> Arc<KeyTable> {
        sync::read(&self.keys).clone()
    }

    /// Notes whether the node `addr` could be connected to (shared lanes).
    pub(crate) fn node_state(&self, addr: &Arc<str>, up: bool) {
        let mut down = sync::lock(&self.down);
        match up {
            true => down.remove(addr),
            false => down.insert(addr.clone()),
        };
    }

    /// Asks the map's reader to read it again soon (within its gap).
    pub(crate) fn refresh_soon(&self) {
        self.refresh.notify_one();
    }

    /// The shared lane `n` (of `proxy.shared_upstream_connections`) to the
    /// node `addr` speaking RESP3 or RESP2, started on first use.
    /// The one `Arc` for the node address `addr` while any is held: two
    /// names of one node are the same pointer (sessions compare lanes so).
    pub(crate) fn intern(&self, addr: &str) -> Arc<str> {
        let mut names = sync::lock(&self.names);
        if let Some(name) = names.get(addr) {
            return name.clone();
        }
        let name: Arc<str> = Arc::from(addr);
        names.insert(name.clone());
        name
    }

    pub(crate) fn lane(self: &Arc<Self>, addr: &str, n: usize, resp3: bool) -> mpsc::Sender<Job> {
        let mut lanes = sync::lock(&self.lanes);
        let addr: Arc<str> = Arc::from(addr);
        let key = (addr, resp3);
        if let Some(senders) = lanes.get(&key) {
            return senders[n % senders.len()].clone();
        }
        let senders: Vec<mpsc::Sender<Job>> = (0..self.lanes_per_node)
            .map(|_| self.spawn_lane(key.0.clone(), true, resp3).0)
            .collect();
        let sender = senders[n % senders.len()].clone();
        lanes.insert(key, senders);
        sender
    }

    /// Starts a lane to `addr` (shared, or a session's own) speaking
    /// RESP3 or RESP2, stopping with lockgate or once every sender is gone.
    pub(crate) fn spawn_lane(
        self: &Arc<Self>,
        addr: Arc<str>,
        shared: bool,
        resp3: bool,
    ) -> (mpsc::Sender<Job>, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(self.queue);
        let handle = tokio::spawn(lane::run(
            self.clone(),
            addr,
            rx,
            self.stop.clone(),
            (shared, resp3),
        ));
        (tx, handle)
    }

    /// Sends `command` again where `to` says (after `ASKING` for `ASK`),
    /// on that node's shared lane of the protocol `resp3`; its replies are
    /// the part returned.
    pub(crate) fn redirect(
        self: &Arc<Self>,
        command: Bytes,
        to: Redirect,
        (hops, unread): (u32, Option<Arc<lane::Unread>>),
        resp3: bool,
    ) -> Part {
        let (commands, skip) = match to.ask {
            true => {
                ProxyMetrics::inc(&self.metrics.ask);
                (smallvec![encode::command(&[b"ASKING"]), command], 1)
            }
            false => {
                ProxyMetrics::inc(&self.metrics.moved);
                self.refresh_soon();
                (smallvec![command], 0)
            }
        };
        let (mut job, rx) = Job::new(commands, true);
        job.skip_front = skip;
        job.hops = hops;
        job.unread = unread;
        let lane = self.lane(&to.addr, 0, resp3);
        match lane.try_send(job) {
            Ok(()) => {}
            // A full queue: waited for away from the lane reading the
            // redirection (which must go on reading).
            Err(mpsc::error::TrySendError::Full(job)) => {
                tokio::spawn(async move {
                    let _ = lane.send(job).await;
                });
            }
            // Shutting down: the part's sender is dropped, answered so.
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
        Part::Later(rx)
    }

    /// Reads the slot map (and, the first time, the key table) from the
    /// seeds and the nodes of the last map; true when a map was read.
    async fn read_map(&self) -> bool {
        let mut asked: Vec<String> = self.seeds.clone();
        if let Some(map) = self.map() {
            for shard in map.shards() {
                if !asked.contains(&shard.primary) {
                    asked.push(shard.primary.clone());
                }
            }
        }
        let (map, from) = match fetch_from(&self.node, &asked).await {
            Ok(found) => found,
            Err(e) => {
                ProxyMetrics::inc(&self.metrics.refresh_errors);
                if let Some(more) = self.warn.check() {
                    tracing::warn!(error = %e, suppressed = more, "cannot read the cluster's slot map");
                }
                sync::write(&self.map).1 = Instant::now();
                return false;
            }
        };
        ProxyMetrics::inc(&self.metrics.refreshes);
        if self.keys().is_empty() {
            match self.read_keys(&from).await {
                Ok(table) => {
                    *sync::write(&self.keys) = Arc::new(table);
                    // Sessions take the table with the next generation.
                    self.generation.fetch_add(1, Ordering::AcqRel);
                }
                Err(e) => {
                    if let Some(more) = self.warn.check() {
                        tracing::warn!(node = %from, error = %e, suppressed = more, "cannot read the nodes' key specifications");
                    }
                }
            }
        }
        self.metrics
            .unserved
            .store(map.unserved() as u64, Ordering::Relaxed);
        self.metrics
            .primaries
            .store(map.shards().len() as u64, Ordering::Relaxed);
        let mut slot = sync::write(&self.map);
        slot.1 = Instant::now();
        if slot.0.as_deref() != Some(&map) {
            if let Some(old) = &slot.0 {
                ProxyMetrics::inc(&self.metrics.map_changes);
                tracing::info!(
                    primaries = map.shards().len(),
                    unserved = map.unserved(),
                    "the cluster's slot map changed"
                );
                // Lanes to nodes no longer in the map end (once no
                // session holds their sender), and so do their retries.
                let known = |addr: &str| {
                    (map.shards().iter())
                        .any(|s| s.primary == addr || s.replicas.iter().any(|r| r == addr))
                };
                sync::lock(&self.lanes).retain(|(addr, _), _| known(addr));
                sync::lock(&self.down).retain(|addr| known(addr));
                let mut held = sync::lock(&self.promoted);
                held.retain(|(p, _)| map.shards().iter().any(|s| &s.primary == p));
                for primary in promotions(old, &map) {
                    ProxyMetrics::inc(&self.metrics.failovers);
                    tracing::warn!(primary = %primary, "a replica of the cluster was promoted: lock acquisitions in its slots are held back for the failover delay");
                    held.retain(|(p, _)| *p != primary);
                    held.push((primary, Instant::now()));
                }
            }
            slot.0 = Some(Arc::new(map));
            self.generation.fetch_add(1, Ordering::AcqRel);
            // Addresses held only here name nodes no session uses.
            sync::lock(&self.names).retain(|n| Arc::strong_count(n) > 1);
        }
        true
    }

    /// The node serving the keys of `command` (RESP), by the map in force;
    /// its first primary when it names no key.
    fn node_of_command(&self, command: &[u8]) -> Result<String, NodeError> {
        let none = || NodeError::Down("(no slot map of the cluster yet)".to_string());
        let map = self.map().ok_or_else(none)?;
        let mut parser = crate::upstream::shared::framing_parser();
        let slot = match parser.parse(command) {
            Ok(Some(_)) => {
                let args: Vec<&[u8]> = (0..parser.argc()).map(|i| parser.arg(command, i)).collect();
                // Keys the specs cannot place: the first primary answers.
                self.keys().routing_slot(&args).ok().flatten()
            }
            _ => None,
        };
        let shard = match slot {
            Some(s) => map.shard_of_slot(s),
            None => map.shards().first(),
        };
        shard
            .map(|s| s.primary.clone())
            .ok_or_else(|| NodeError::Down(format!("(no node serves slot {slot:?})")))
    }

    /// `COMMAND` from the node `addr`: every command's keys.
    async fn read_keys(&self, addr: &str) -> Result<KeyTable, String> {
        let config = NodeConfig {
            addr: addr.to_string(),
            ..self.node.clone()
        };
        let mut stream = connect_authenticated(&config).await?;
        let reply = request(
            &mut stream,
            &encode::command(&[b"COMMAND"]),
            config.connect_timeout,
        )
        .await?;
        let info = request(
            &mut stream,
            &encode::command(&[b"INFO", b"server"]),
            config.connect_timeout,
        )
        .await?;
        let info = String::from_utf8_lossy(&info);
        if let Some(v) = info
            .lines()
            .find_map(|l| l.trim().strip_prefix("redis_version:"))
        {
            *sync::write(&self.version) = v.to_string();
        }
        KeyTable::from_command(&reply).map_err(|e| e.to_string())
    }
}

/// One primary as `LOCKGATE NODES` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeView {
    /// `HOST:PORT`.
    pub addr: String,
    /// Its slot ranges, `first-last,…`.
    pub slots: String,
    /// Its replicas, `HOST:PORT,…`.
    pub replicas: String,
    /// lockgate's last connection attempt to it succeeded.
    pub up: bool,
    /// Lock acquisitions in its slots held back this much longer (ms)
    /// after a failover promoted it.
    pub held_ms: u64,
    /// The disputes named now that it is party to (asked, or named as a
    /// slot's primary), each [`Dispute::describe`]d, `; `-separated.
    pub disputes: String,
}

/// The connections to a cluster's nodes and the way sessions get a
/// [`ClusterStream`] over them.
pub struct ClusterPool {
    common: Arc<Common>,
    next: AtomicU64,
}

impl std::fmt::Debug for ClusterPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterPool").finish()
    }
}

impl ClusterPool {
    /// The key table read from the nodes' `COMMAND` (empty until read):
    /// what guarded writes know a write by in front of a cluster.
    pub fn key_table(&self) -> Arc<KeyTable> {
        self.common.keys()
    }

    /// Starts reading the slot map from `upstream.cluster.seeds` (at once,
    /// then as the module doc says) until `stop`. What lockgate tells
    /// cluster-aware clients about itself is set by
    /// [`ClusterPool::set_listen`]. Must run inside a Tokio runtime.
    pub fn start(
        config: &Config,
        connector: Connector,
        stop: &CancellationToken,
    ) -> Arc<ClusterPool> {
        let common = Arc::new(Common::new(config, connector, stop));
        tokio::spawn(refresher(common.clone()));
        if !common.views_check.is_zero() {
            tokio::spawn(disputes::run(common.clone(), common.views_check));
        }
        Arc::new(ClusterPool {
            common,
            next: AtomicU64::new(0),
        })
    }

    /// The address cluster-aware clients are told to use: the client
    /// listener's, `127.0.0.1` (or `::1`) for an unspecified IP (a
    /// sidecar's app reaches it there); the node id lockgate gives them
    /// comes from `instance` (the lock room's instance id).
    pub fn set_listen(&self, addr: std::net::SocketAddr, instance: &str) {
        let host = match addr.ip() {
            ip if ip.is_unspecified() && ip.is_ipv4() => "127.0.0.1".to_string(),
            ip if ip.is_unspecified() => "::1".to_string(),
            ip => ip.to_string(),
        };
        *sync::write(&self.common.facade) = Facade::new(instance, &host, addr.port());
        self.common.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// The generation of the slot map in force: it changes with the map
    /// (a grant waiting for its shard's replicas is not acknowledged
    /// across a change, `crate::lock::replicas`).
    pub fn map_generation(&self) -> u64 {
        self.common.generation()
    }

    /// `HOST:PORT` of the primary serving `key`'s slot in the map in force.
    pub fn primary_of(&self, key: &[u8]) -> Option<String> {
        Some(self.common.map()?.shard_of_key(key)?.primary.clone())
    }

    /// A stream for one new session.
    pub fn session(&self, dedicated: bool) -> ClusterStream {
        let n = self.next.fetch_add(1, Ordering::Relaxed) as usize;
        ClusterStream::new(self.common.clone(), n, dedicated)
    }

    /// The counters, for `/metrics` and `LOCKGATE STATS`.
    pub fn metrics(&self) -> &Arc<ClusterMetrics> {
        &self.common.metrics
    }

    /// The slot map in force, if one was read.
    pub fn map(&self) -> Option<Arc<SlotMap>> {
        self.common.map()
    }

    /// True once a slot map and the nodes' key specifications were read
    /// (before, commands are answered `-CLUSTERDOWN` or sent to a node
    /// that redirects them).
    pub fn ready(&self) -> bool {
        self.common.map().is_some() && !self.common.keys().is_empty()
    }

    /// How much longer acquisitions of `key` are held back after a shard
    /// failover (`None`: not held): the node serving its slot was a
    /// replica promoted less than `delay` ago, and a lock granted on the
    /// old primary may not have reached it (as after a Sentinel switch:
    /// `locks.failover_delay_ms`).
    pub fn hold_left(&self, key: &[u8], delay: Duration) -> Option<Duration> {
        let map = self.common.map()?;
        let at = self.promoted_at(&map.shard_of_key(key)?.primary)?;
        delay
            .checked_sub(at.elapsed())
            .filter(|left| !left.is_zero())
    }

    /// The slot ranges the nodes disagree about now ([`disputes`]).
    pub fn disputes(&self) -> Vec<Dispute> {
        self.common.disputes.named()
    }

    /// The dispute over `key`'s slot named now, if any.
    pub fn disputed(&self, key: &[u8]) -> Option<Dispute> {
        self.common.disputes.of_key(key)
    }

    /// When the primary `node` (`HOST:PORT`) was seen promoted from a
    /// replica (`None`: it was not, or the map no longer names it).
    pub fn promoted_at(&self, node: &str) -> Option<Instant> {
        let held = sync::lock(&self.common.promoted);
        held.iter().find(|(p, _)| p == node).map(|(_, at)| *at)
    }

    /// Sends lockgate's own `request` (a lock script, a read) to the
    /// node serving its keys' slot (any node when it names none) over the
    /// node's shared lane, redirections followed, and waits up to
    /// `timeout` for its reply; after `-NOSCRIPT` its fallback goes the
    /// same way, once. The lock room's calls go this way in front of a
    /// cluster (`crate::lock::txn::OnPrimary`).
    pub async fn call(&self, request: Request, timeout: Duration) -> Result<Bytes, NodeError> {
        let reply = self.call_once(request.command, timeout).await?;
        match request.fallback {
            Some(fallback) if reply.starts_with(b"-NOSCRIPT") => {
                self.call_once(fallback, timeout).await
            }
            _ => Ok(reply),
        }
    }

    async fn call_once(&self, command: Bytes, timeout: Duration) -> Result<Bytes, NodeError> {
        let node = self.common.node_of_command(&command)?;
        let (job, rx) = Job::new(smallvec![command], true);
        let lane = self.common.lane(&node, 0, false);
        let sent = async {
            lane.send(job)
                .await
                .map_err(|_| NodeError::Down(node.clone()))?;
            Ok(merge::flatten(rx)
                .await
                .into_iter()
                .next()
                .unwrap_or_else(merge::gone))
        };
        match tokio::time::timeout(timeout, sent).await {
            Ok(reply) => reply,
            Err(_) => Err(NodeError::Timeout(node)),
        }
    }

    /// Why the cluster cannot serve every slot now, if it cannot: no map
    /// read yet, slots no node serves, or a primary lockgate cannot reach
    /// (`/readyz`).
    pub fn not_ready(&self) -> Option<String> {
        let Some(map) = self.common.map() else {
            return Some("no slot map of the cluster read yet".to_string());
        };
        if map.unserved() > 0 {
            return Some(format!("{} hash slots served by no node", map.unserved()));
        }
        let down = sync::lock(&self.common.down);
        let unreachable: Vec<&str> = (map.shards().iter())
            .map(|s| s.primary.as_str())
            .filter(|p| down.contains(*p))
            .collect();
        match unreachable.is_empty() {
            true => None,
            false => Some(format!(
                "cluster primary {} unreachable",
                unreachable.join(", ")
            )),
        }
    }

    /// Each primary of the map in force: its address, its slot ranges
    /// (`first-last`), its replicas, whether lockgate reaches it, and how
    /// long its slots' acquisitions are still held back after a failover
    /// (ms, 0: not held) for `delay` (`LOCKGATE NODES`, the status page).
    pub fn nodes(&self, delay: Duration) -> Vec<NodeView> {
        let Some(map) = self.common.map() else {
            return Vec::new();
        };
        let down = sync::lock(&self.common.down).clone();
        let promoted = sync::lock(&self.common.promoted).clone();
        let disputes = self.common.disputes.named();
        let ranges = map.ranges();
        (map.shards().iter())
            .map(|shard| {
                let slots: Vec<String> = (ranges.iter())
                    .filter(|(_, _, s)| s.primary == shard.primary)
                    .map(|(a, b, _)| format!("{a}-{b}"))
                    .collect();
                let held_ms = (promoted.iter())
                    .find(|(p, _)| *p == shard.primary)
                    .and_then(|(_, at)| delay.checked_sub(at.elapsed()))
                    .map_or(0, |left| left.as_micros().div_ceil(1000) as u64);
                let party = |d: &&Dispute| {
                    (d.claims.iter()).any(|(n, p)| *n == shard.primary || *p == shard.primary)
                };
                let disputes: Vec<String> = disputes
                    .iter()
                    .filter(party)
                    .map(Dispute::describe)
                    .collect();
                NodeView {
                    addr: shard.primary.clone(),
                    slots: slots.join(","),
                    replicas: shard.replicas.join(","),
                    up: !down.contains(shard.primary.as_str()),
                    held_ms,
                    disputes: disputes.join("; "),
                }
            })
            .collect()
    }
}

/// The primaries of `new` that were replicas in `old`: promoted by a
/// failover (a node new to the map that takes slots was not, its keys
/// came with `MIGRATE`).
fn promotions(old: &SlotMap, new: &SlotMap) -> Vec<String> {
    let was_primary = |addr: &str| old.shards().iter().any(|s| s.primary == addr);
    let was_replica = |addr: &str| {
        old.shards()
            .iter()
            .any(|s| s.replicas.iter().any(|r| r == addr))
    };
    (new.shards().iter())
        .map(|s| s.primary.clone())
        .filter(|p| !was_primary(p) && was_replica(p))
        .collect()
}

/// Reads the map at once, then whenever [`refresh_due`] says (without a
/// map, every `refresh_min_gap_ms` until one is read).
async fn refresher(common: Arc<Common>) {
    let mut asked_early = false;
    loop {
        let last = sync::read(&common.map).1;
        let now = Instant::now();
        let have = common.map().is_some();
        if !have
            || refresh_due(
                last,
                now,
                common.refresh_interval,
                common.refresh_gap,
                asked_early,
            )
        {
            common.read_map().await;
            asked_early = false;
        }
        let last = sync::read(&common.map).1;
        let now = Instant::now();
        let wait = match (common.map().is_some(), asked_early) {
            (false, _) => common.refresh_gap,
            (true, true) => (last + common.refresh_gap).saturating_duration_since(now),
            (true, false) => (last + common.refresh_interval).saturating_duration_since(now),
        };
        tokio::select! {
            _ = common.stop.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
            _ = common.refresh.notified() => asked_early = true,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::protocol::encode::LocalReply;

    /// A map from `(first slot, last slot, primary, replicas)` rows, read
    /// back from a `CLUSTER SLOTS` reply as a node would give it.
    pub(crate) fn map(rows: &[(u16, u16, &str, &[&str])]) -> SlotMap {
        let node = |addr: &str| {
            let (host, port) = addr.rsplit_once(':').expect("HOST:PORT");
            LocalReply::Array(vec![
                LocalReply::Bulk(Bytes::copy_from_slice(host.as_bytes())),
                LocalReply::Integer(port.parse().expect("a port")),
                LocalReply::Bulk(Bytes::from(format!("id-{addr}"))),
            ])
        };
        let reply = LocalReply::Array(
            rows.iter()
                .map(|(first, last, primary, replicas)| {
                    let mut row = vec![
                        LocalReply::Integer(i64::from(*first)),
                        LocalReply::Integer(i64::from(*last)),
                        node(primary),
                    ];
                    row.extend(replicas.iter().map(|r| node(r)));
                    LocalReply::Array(row)
                })
                .collect(),
        );
        SlotMap::from_slots(&reply.to_bytes(false), "x:1").expect("a slot map")
    }

    /// Only a replica that became a primary is a failover: a slot moved
    /// between primaries, or to a node new to the map, is a migration
    /// (its keys came with it).
    #[test]
    fn a_promoted_replica_is_told_from_a_migration() {
        let before = map(&[
            (0, 8_000, "a:1", &["ra:1"]),
            (8_001, 16_383, "b:1", &["rb:1"]),
        ]);
        // (after, promoted)
        let rows: Vec<(SlotMap, Vec<&str>)> = vec![
            (before.clone(), vec![]),
            (
                map(&[
                    (0, 8_000, "ra:1", &["a:1"]),
                    (8_001, 16_383, "b:1", &["rb:1"]),
                ]),
                vec!["ra:1"],
            ),
            (
                map(&[(0, 8_000, "ra:1", &[]), (8_001, 16_383, "rb:1", &[])]),
                vec!["ra:1", "rb:1"],
            ),
            (
                map(&[
                    (0, 100, "b:1", &["rb:1"]),
                    (101, 8_000, "a:1", &["ra:1"]),
                    (8_001, 16_383, "b:1", &["rb:1"]),
                ]),
                vec![],
            ),
            (
                map(&[
                    (0, 100, "c:1", &[]),
                    (101, 8_000, "a:1", &["ra:1"]),
                    (8_001, 16_383, "b:1", &["rb:1"]),
                ]),
                vec![],
            ),
        ];
        for (i, (after, want)) in rows.into_iter().enumerate() {
            let mut got = promotions(&before, &after);
            got.sort();
            assert_eq!(got, want, "row {i}");
        }
    }
}
