//! A cluster node cut off from lockgate, between real processes: a
//! 3-primary cluster (`tests/support/cluster.rs`) whose third primary
//! announces a relay's port (`cluster-announce-port`, its bus port kept
//! as it is with `cluster-announce-bus-port`), so every client that
//! follows the cluster's map, lockgate included, reaches that node's data
//! port through the relay, while the nodes' bus stays direct: the cluster
//! sees the node healthy (no failover), only lockgate's path is cut. What
//! is promised (docs/faults.md, "Partitions"): commands and locks for
//! keys on the other nodes keep working; commands for keys on the cut node
//! fail with a clear `-ERR` naming the node within the connect timeout,
//! never hang and never crash lockgate; a lock held there is not granted
//! to anyone else through lockgate while cut; after the heal every command
//! works again on the same session, without a restart. The error latency
//! and the recovery time are printed.
//!
//! The cut is [`Mode::Cut`] (every connection closed, new ones closed on
//! accept). A blackholed node ([`Mode::Blackhole`]: accepted, never
//! answered) is the "node that hangs" of docs/cluster.md: the clients' own
//! commands for its slots wait, with no reply timeout of lockgate's, but
//! lock commands are answered within `upstream.lock_reply_timeout_ms`
//! and the connect timeout.

use crate::support;

use std::time::{Duration, Instant};

use lockgate::config::UpstreamMode;
use support::cluster::Cluster;
use support::recorder::Recorder;
use support::relay::{Mode, Relay};
use support::resp::{call, cmd, direct};
use support::{RawClient, WAIT};

/// How long a command for the cut node may take to be refused: the
/// connect timeout (500 ms below) and a loaded box's margin.
const ERROR_BOUND: Duration = Duration::from_secs(5);

/// `CLUSTER SLOTS` of `addr` names `port` as a primary's port.
async fn map_names(addr: &str, port: u16) -> bool {
    direct(addr, &["CLUSTER", "SLOTS"])
        .await
        .contains(&format!("\r\n:{port}\r\n"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_off_from_lockgate_fails_its_slots_only_and_comes_back() {
    cut_off(UpstreamMode::Dedicated).await;
}

/// The same over the nodes' shared connections (`proxy.upstream =
/// "shared"`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_off_from_shared_connections_fails_its_slots_only_and_comes_back() {
    cut_off(UpstreamMode::Shared).await;
}

/// A 3-primary cluster whose third primary lockgate reaches through a
/// relay (see the module doc), and lockgate in front of it.
struct Relayed {
    cluster: Cluster,
    relay: Relay,
    /// The third primary's own address.
    node: String,
    /// The address the cluster announces for it: the relay's.
    through: String,
    lg: support::Lockgate,
    /// A key and a lock key on the relayed node.
    key: String,
    lock: String,
    /// A key and a lock key on each other node.
    others: Vec<(String, String)>,
}

async fn relayed(mode: UpstreamMode, tune: impl FnOnce(&mut lockgate::config::Config)) -> Relayed {
    relayed_with(0, mode, tune).await
}

/// [`relayed`], each primary with `replicas` replicas (the third node is
/// a primary: `redis-cli --cluster create` makes the first three so).
async fn relayed_with(
    replicas: usize,
    mode: UpstreamMode,
    tune: impl FnOnce(&mut lockgate::config::Config),
) -> Relayed {
    let cluster = Cluster::start(3, replicas);
    let node = cluster.nodes[2].addr();
    let relay = Relay::to(&node).await;
    let (relay_port, bus_port) = (relay.addr.port(), cluster.nodes[2].port + 10_000);
    for (name, value) in [
        ("cluster-announce-bus-port", bus_port),
        ("cluster-announce-port", relay_port),
    ] {
        let set = ["CONFIG", "SET", name, &value.to_string()];
        assert_eq!(direct(&node, &set).await, "+OK\r\n");
    }
    // The nodes learn the announced port from the node's bus messages.
    for n in &cluster.nodes {
        until!(
            "every node's map to name the relay's port",
            map_names(&n.addr(), relay_port).await
        );
    }
    let lg = cluster
        .lockgate(|c| {
            c.proxy.upstream = mode;
            c.upstream.connect_timeout_ms = 500;
            c.upstream.reconnect_interval_ms = 50;
            c.locks.retry.probe_interval_ms = 0;
            c.locks.retry.park_ms = 0;
            tune(c);
        })
        .await;
    let map = cluster.map().await;
    let through = relay.host_port();
    let key_on = |node: &str, prefix: &str| {
        (0..10_000)
            .map(|i| format!("{prefix}:{i}"))
            .find(|k| map.shard_of_key(k.as_bytes()).map(|s| s.primary.as_str()) == Some(node))
            .expect("a key on the node")
    };
    let (key, lock) = (key_on(&through, "key"), key_on(&through, "lock"));
    let others = [0, 1]
        .iter()
        .map(|&i| {
            let n = cluster.nodes[i].addr();
            (key_on(&n, "key"), key_on(&n, "lock"))
        })
        .collect();
    Relayed {
        cluster,
        relay,
        node,
        through,
        lg,
        key,
        lock,
        others,
    }
}

async fn cut_off(mode: UpstreamMode) {
    let started = Instant::now();
    let Relayed {
        cluster: _cluster,
        relay,
        node: cut_node,
        through,
        lg,
        key: cut_key,
        lock: cut_lock,
        others,
    } = relayed(mode, |_| {}).await;
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(call(&mut c, &["SET", &cut_key, "v0"]).await, "+OK\r\n");
    // Through the relay: the relay carries lockgate's connection.
    assert!(
        relay.open() >= 1,
        "lockgate does not reach {cut_node} through the relay"
    );
    assert_eq!(direct(&cut_node, &["GET", &cut_key]).await, "$2\r\nv0\r\n");
    // Every lock command is recorded, one recorder per session, and the
    // checker judges each key's history at the end.
    let mut rec = Recorder::new(WAIT);
    let (mut rec_holder, mut rec_other) = (rec.for_client(1), rec.for_client(2));
    let mut holder = RawClient::connect(lg.addr).await;
    assert_eq!(
        rec_holder
            .call(&mut holder, &["SET", &cut_lock, "h", "NX", "PX", "60000"])
            .await,
        "+OK\r\n"
    );
    assert_eq!(lockgate::http::not_ready(&lg.ctx), None);

    relay.set(Mode::Cut);
    rec.cannot_grant(&cut_lock, "its node cut off");
    let cut = Instant::now();
    // Commands for the cut node: a clear error naming it, in bounded time,
    // again and again (the session stays usable).
    let mut latencies = Vec::new();
    for i in 0..20 {
        let asked = Instant::now();
        let reply = tokio::time::timeout(ERROR_BOUND, call(&mut c, &["GET", &cut_key]))
            .await
            .unwrap_or_else(|_| panic!("GET for the cut node unanswered after {ERROR_BOUND:?}"));
        latencies.push(asked.elapsed());
        assert!(
            reply.starts_with("-ERR lockgate: ") && reply.contains(&through),
            "reply {i} for the cut node: {reply:?}"
        );
    }
    // A lock held on the cut node is granted to nobody else meanwhile, in
    // any of the lock shapes.
    let mut other = RawClient::connect(lg.addr).await;
    for attempt in [
        vec!["SETNX", cut_lock.as_str(), "o"],
        vec!["SET", cut_lock.as_str(), "o", "NX", "PX", "5000"],
        vec!["LOCKGATE", "LOCK", cut_lock.as_str(), "5000"],
    ] {
        let reply = tokio::time::timeout(ERROR_BOUND, rec_other.call(&mut other, &attempt))
            .await
            .unwrap_or_else(|_| panic!("{attempt:?} unanswered after {ERROR_BOUND:?}"));
        assert!(
            reply.starts_with('-'),
            "{attempt:?} on the cut node's lock answered {reply:?}"
        );
    }
    // The other nodes serve commands and locks as before, on the same
    // session and on new ones.
    for (n, (key, lock)) in others.iter().enumerate() {
        assert_eq!(call(&mut c, &["SET", key, "live"]).await, "+OK\r\n");
        assert_eq!(call(&mut c, &["GET", key]).await, "$4\r\nlive\r\n");
        let mut l = RawClient::connect(lg.addr).await;
        let mut rec_l = rec.for_client(3 + n);
        assert_eq!(
            rec_l.call(&mut l, &["SETNX", lock, "x"]).await,
            ":1\r\n",
            "node {n}"
        );
        rec.merge(rec_l);
        let refused = rec_other.call(&mut other, &["SETNX", lock, "y"]).await;
        assert_eq!(refused, ":0\r\n");
        let fenced = rec_other
            .call(
                &mut other,
                &["LOCKGATE", "LOCK", &format!("{lock}:f"), "2000"],
            )
            .await;
        assert!(
            fenced.starts_with("*2\r\n:"),
            "fencing on node {n}: {fenced}"
        );
    }
    until!("/readyz to name the cut node", {
        lockgate::http::not_ready(&lg.ctx).is_some_and(|why| why.contains(&through))
    });
    assert!(
        cut.elapsed() < Duration::from_secs(30),
        "the cut phase took {:?}",
        cut.elapsed()
    );
    // The lock is still the holder's on the node itself.
    assert_eq!(direct(&cut_node, &["GET", &cut_lock]).await, "$1\r\nh\r\n");

    relay.heal();
    rec.can_grant(&cut_lock);
    let healed = Instant::now();
    let (recovered, errors_c) = until_served(&mut c, &["GET", &cut_key], "$2\r\nv0\r\n").await;
    assert_eq!(call(&mut c, &["SET", &cut_key, "v1"]).await, "+OK\r\n");
    assert_eq!(direct(&cut_node, &["GET", &cut_key]).await, "$2\r\nv1\r\n");
    // Every session that used the node during the cut is served again.
    let (_, errors_other) = until_served(&mut other, &["GET", &cut_key], "$2\r\nv1\r\n").await;
    let mut fresh = RawClient::connect(lg.addr).await;
    assert_eq!(call(&mut fresh, &["GET", &cut_key]).await, "$2\r\nv1\r\n");
    // The holder's lock was kept: still refused to others, released by
    // its holder, then granted.
    let take = ["SETNX", cut_lock.as_str(), "o"];
    assert_eq!(rec_other.call(&mut other, &take).await, ":0\r\n");
    let release = ["DEL", cut_lock.as_str()];
    assert_eq!(rec_holder.call(&mut holder, &release).await, ":1\r\n");
    assert_eq!(rec_other.call(&mut other, &take).await, ":1\r\n");
    rec.merge(rec_holder);
    rec.merge(rec_other);
    rec.judge(&format!("cluster node cut off ({mode:?})"), 5);
    until!(
        "/readyz to be ready again",
        lockgate::http::not_ready(&lg.ctx).is_none()
    );
    let ready_after = healed.elapsed();
    let first = latencies[0];
    latencies.sort();
    println!(
        "cluster node cut off ({mode:?}): errors for its slots after {:.1} ms (first), {:.1}–{:.1} ms (min–max of 20), \
         median {:.1} ms; after the heal its slots served again after {} ms ({} and {} errors \
         first on two sessions that used it during the cut, none on a new one), /readyz ready after {} ms; \
         total {} ms",
        first.as_micros() as f64 / 1000.0,
        latencies[0].as_micros() as f64 / 1000.0,
        latencies[19].as_micros() as f64 / 1000.0,
        latencies[10].as_micros() as f64 / 1000.0,
        recovered.as_millis(),
        errors_c,
        errors_other,
        ready_after.as_millis(),
        started.elapsed().as_millis()
    );
    lg.stop().await;
}

/// Sends `args` on `c` until the reply is `ok` (each other reply a
/// lockgate error), within [`WAIT`]: the time it took and the errors seen.
async fn until_served(c: &mut RawClient, args: &[&str], ok: &str) -> (Duration, usize) {
    let since = Instant::now();
    let mut errors = 0;
    loop {
        let reply = call(c, args).await;
        if reply == ok {
            return (since.elapsed(), errors);
        }
        assert!(reply.starts_with("-ERR lockgate: "), "{args:?}: {reply:?}");
        errors += 1;
        assert!(
            since.elapsed() < WAIT,
            "{args:?} not served {WAIT:?} after the heal ({errors} errors): {reply:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A node blackholed (accepted, never answered): lock commands for its
/// keys are answered `-ERR lockgate: upstream … unavailable` naming the
/// node within `upstream.lock_reply_timeout_ms` (500 ms here) and
/// the connect timeout, never held as long as the path is silent, on a
/// session opened before the blackhole and on one opened during it; a
/// plain command pipelined behind a lock command is answered with it, in
/// order; the other nodes keep serving locks; after the heal the slots are
/// served again without a restart, the lock held there still its holder's.
/// Before `lock_reply_timeout_ms` (474e944) `SETNX` and `SET NX PX` went
/// unanswered for as long as the blackhole lasted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_node_answers_lock_commands_in_bounded_time() {
    blackholed(UpstreamMode::Dedicated).await;
}

/// The same over the nodes' shared connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_node_answers_lock_commands_in_bounded_time_when_shared() {
    blackholed(UpstreamMode::Shared).await;
}

async fn blackholed(mode: UpstreamMode) {
    let r = relayed(mode, |c| c.upstream.lock_reply_timeout_ms = 500).await;
    let mut rec = Recorder::new(WAIT);
    let mut rec_holder = rec.for_client(1);
    let (mut rec_before, mut rec_during) = (rec.for_client(2), rec.for_client(3));
    let mut before = RawClient::connect(r.lg.addr).await;
    assert_eq!(call(&mut before, &["SET", &r.key, "v0"]).await, "+OK\r\n");
    let mut holder = RawClient::connect(r.lg.addr).await;
    let take = ["SET", &r.lock, "h", "NX", "PX", "60000"];
    assert_eq!(rec_holder.call(&mut holder, &take).await, "+OK\r\n");

    r.relay.set(Mode::Blackhole);
    let free = format!("lock:{{{}}}", r.lock);
    for key in [&r.lock, &free] {
        rec.cannot_grant(key, "its node blackholed");
    }
    let is_error = |reply: &str| reply.starts_with("-ERR lockgate: ") && reply.contains(&r.through);
    // A lock command and a plain command pipelined on a connection opened
    // before: both answered, in order. (The lock is free, in the held
    // one's slot, so the attempt goes to the node. A lock command behind
    // a plain one waits for it, as on a node that hangs.)
    let asked = Instant::now();
    let pipeline = [cmd(&["SETNX", &free, "b"]), cmd(&["GET", &r.key])].concat();
    before.send(&pipeline).await;
    let replies = tokio::time::timeout(ERROR_BOUND, async {
        [before.read_s().await, before.read_s().await]
    })
    .await
    .unwrap_or_else(|_| panic!("a pipelined SETNX + GET unanswered after {ERROR_BOUND:?}"));
    let mut latencies = vec![asked.elapsed()];
    assert!(replies.iter().all(|r| is_error(r)), "{replies:?}");
    // Every lock shape, on that session and on one opened now.
    let mut during = RawClient::connect(r.lg.addr).await;
    for (who, c, rec) in [
        ("before", &mut before, &mut rec_before),
        ("during", &mut during, &mut rec_during),
    ] {
        for attempt in [
            vec!["SETNX", r.lock.as_str(), "o"],
            vec!["SET", r.lock.as_str(), "o", "NX", "PX", "5000"],
            vec!["LOCKGATE", "LOCK", r.lock.as_str(), "5000"],
        ] {
            let asked = Instant::now();
            let reply = tokio::time::timeout(ERROR_BOUND, rec.call(c, &attempt))
                .await
                .unwrap_or_else(|_| panic!("{attempt:?} ({who}) unanswered after {ERROR_BOUND:?}"));
            latencies.push(asked.elapsed());
            assert!(is_error(&reply), "{attempt:?} ({who}): {reply:?}");
        }
    }
    // The other nodes serve locks meanwhile.
    for (key, lock) in &r.others {
        assert_eq!(call(&mut during, &["SET", key, "live"]).await, "+OK\r\n");
        let (take, release) = (["SETNX", lock, "x"], ["DEL", lock]);
        assert_eq!(rec_during.call(&mut during, &take).await, ":1\r\n");
        assert_eq!(rec_before.call(&mut before, &take).await, ":0\r\n");
        assert_eq!(rec_during.call(&mut during, &release).await, ":1\r\n");
    }
    let text = lockgate::exposition::render(&r.lg.ctx).expect("metrics");
    let timeouts = support::ops::Metrics::parse(&text)
        .value("lockgate_cluster_lock_reply_timeouts_total", &[]);
    assert!(timeouts >= 1.0, "no lock reply timeout counted");

    r.relay.heal();
    for key in [&r.lock, &free] {
        rec.can_grant(key);
    }
    let (recovered, errors) = until_served(&mut before, &["GET", &r.key], "$2\r\nv0\r\n").await;
    let (_, _) = until_served(&mut during, &["GET", &r.key], "$2\r\nv0\r\n").await;
    // What was sent into the blackhole may arrive now (as after a slow
    // path): the holder's lease refuses it, so the lock is still the
    // holder's, released by it, then granted.
    assert_eq!(direct(&r.node, &["GET", &r.lock]).await, "$1\r\nh\r\n");
    let (take, release) = (["SETNX", r.lock.as_str(), "o"], ["DEL", r.lock.as_str()]);
    assert_eq!(rec_during.call(&mut during, &take).await, ":0\r\n");
    assert_eq!(rec_holder.call(&mut holder, &release).await, ":1\r\n");
    assert_eq!(rec_during.call(&mut during, &take).await, ":1\r\n");
    for other in [rec_holder, rec_before, rec_during] {
        rec.merge(other);
    }
    rec.judge(&format!("cluster node blackholed ({mode:?})"), 4);
    latencies.sort();
    println!(
        "cluster node blackholed ({mode:?}): lock commands answered with errors after \
         {:.0}–{:.0} ms ({} asked, lock_reply_timeout_ms 500, connect_timeout_ms 500); \
         {timeouts} connections given up; after the heal served again after {} ms \
         ({errors} errors first)",
        latencies[0].as_secs_f64() * 1000.0,
        latencies[latencies.len() - 1].as_secs_f64() * 1000.0,
        latencies.len(),
        recovered.as_millis(),
    );
    r.lg.stop().await;
}

/// A shard failed over while lockgate is cut from its old primary (the
/// relay blackholes lockgate's path only; the cluster's bus and the
/// replication link are direct, so `CLUSTER FAILOVER` on the replica runs
/// as usual): before the failover the shard's lock commands are answered
/// with errors in bounded time; lockgate follows the new map (read from
/// the nodes it still reaches) and serves the slots on the promoted
/// replica without a restart; acquisitions there are held back for
/// `locks.failover_delay_ms`, then granted; the lock taken before the cut,
/// replicated with its owner record, is still its holder's: refused to
/// others, released by its holder. After the heal the old primary, now a
/// replica, is not written through lockgate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_failed_over_while_cut_off_is_followed_and_its_locks_kept() {
    let r = relayed_with(1, UpstreamMode::Dedicated, |c| {
        c.upstream.lock_reply_timeout_ms = 500;
        c.upstream.cluster.refresh_interval_ms = 200;
        c.locks.failover_delay_ms = Some(4_000);
    })
    .await;
    let pool = r.lg.ctx.cluster.clone().expect("a cluster pool");
    let mut rec = Recorder::new(WAIT);
    let (mut rec_holder, mut rec_c) = (rec.for_client(1), rec.for_client(2));
    let mut holder = RawClient::connect(r.lg.addr).await;
    let take = ["SET", &r.lock, "h", "NX", "PX", "60000"];
    assert_eq!(rec_holder.call(&mut holder, &take).await, "+OK\r\n");
    let mut c = RawClient::connect(r.lg.addr).await;
    assert_eq!(call(&mut c, &["SET", &r.key, "v0"]).await, "+OK\r\n");
    // The replica of the relayed primary, as the map names it.
    let shard = || {
        pool.map()
            .and_then(|m| m.shard_of_key(r.lock.as_bytes()).cloned())
            .filter(|s| !s.replicas.is_empty())
    };
    until!("the shard's replica in the map", shard().is_some());
    let replica = shard().expect("a shard").replicas[0].clone();
    let mut at_replica = RawClient::connect(&replica).await;
    // Reads on a replica of a cluster need `READONLY`.
    assert_eq!(call(&mut at_replica, &["READONLY"]).await, "+OK\r\n");
    until!("the replica's link up and the lock replicated", {
        let info = call(&mut at_replica, &["INFO", "replication"]).await;
        info.contains("master_link_status:up")
            && call(&mut at_replica, &["GET", &r.lock]).await == "$1\r\nh\r\n"
    });

    r.relay.set(Mode::Blackhole);
    rec.cannot_grant(
        &r.lock,
        "its primary blackholed, then held back after the failover",
    );
    let asked = Instant::now();
    let attempt = ["SETNX", r.lock.as_str(), "o"];
    let reply = tokio::time::timeout(ERROR_BOUND, rec_c.call(&mut c, &attempt))
        .await
        .unwrap_or_else(|_| panic!("SETNX on the cut shard unanswered after {ERROR_BOUND:?}"));
    let refused_in = asked.elapsed();
    assert!(reply.starts_with('-'), "SETNX on the cut shard: {reply:?}");

    assert_eq!(
        call(&mut at_replica, &["CLUSTER", "FAILOVER"]).await,
        "+OK\r\n"
    );
    let failed_over = Instant::now();
    until!("lockgate to follow the failover", {
        pool.map()
            .and_then(|m| m.shard_of_key(r.lock.as_bytes()).map(|s| s.primary.clone()))
            == Some(replica.clone())
    });
    let followed_at = Instant::now();
    let followed_in = followed_at - failed_over;
    // The slots are served on the promoted replica, on the same session.
    let (served_in, errors) = until_served(&mut c, &["GET", &r.key], "$2\r\nv0\r\n").await;
    // Held back for the failover delay: not acquired, never granted over
    // the holder; then the holder's lock is still its own.
    assert_eq!(rec_c.call(&mut c, &attempt).await, ":0\r\n");
    let free = format!("lock:{{{}}}", r.lock);
    // The hold: from when lockgate saw the promotion, 4 s (less a margin
    // for seeing it before the test did).
    let hold = (followed_at, followed_at + Duration::from_millis(3_800));
    rec.cannot_grant_between(&free, hold.0, hold.1, "the failover hold");
    let free_take = ["SETNX", free.as_str(), "o"];
    assert_eq!(rec_c.call(&mut c, &free_take).await, ":0\r\n", "held back");
    until!("the failover delay to end", {
        rec_c.call(&mut c, &free_take).await == ":1\r\n"
    });
    rec.can_grant(&r.lock);
    let held_for = failed_over.elapsed();
    assert_eq!(rec_c.call(&mut c, &attempt).await, ":0\r\n");
    let release = ["DEL", r.lock.as_str()];
    assert_eq!(rec_holder.call(&mut holder, &release).await, ":1\r\n");
    assert_eq!(rec_c.call(&mut c, &attempt).await, ":1\r\n");
    rec.merge(rec_holder);
    rec.merge(rec_c);
    rec.judge("shard failed over while cut off", 3);
    assert_eq!(direct(&replica, &["GET", &r.lock]).await, "$1\r\no\r\n");

    r.relay.heal();
    assert_eq!(call(&mut c, &["SET", &r.key, "v1"]).await, "+OK\r\n");
    assert_eq!(direct(&replica, &["GET", &r.key]).await, "$2\r\nv1\r\n");
    let mut at_old = RawClient::connect(&r.node).await;
    assert_eq!(call(&mut at_old, &["READONLY"]).await, "+OK\r\n");
    until!("the old primary to replicate from the new one", {
        call(&mut at_old, &["GET", &r.key]).await == "$2\r\nv1\r\n"
    });
    println!(
        "shard failed over while cut off: SETNX refused after {} ms; the map followed {} ms \
         after CLUSTER FAILOVER, the slots served after {} ms more ({errors} errors first), \
         acquisitions held back until {} ms after it (failover_delay_ms 4000)",
        refused_in.as_millis(),
        followed_in.as_millis(),
        served_in.as_millis(),
        held_for.as_millis()
    );
    r.lg.stop().await;
}
