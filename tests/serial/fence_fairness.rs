//! Fairness of fencing waits (`LOCKGATE LOCK key ttl WAIT ms`): eight
//! workers over two lockgates in front of the same lock store, each taking
//! `lock:fair` with `WAIT 3000`, holding it 20 ms, `UNLOCK`, and again.
//! Within an instance its waiters are served first come, first served;
//! on one Redis they also take turns across instances (the key's queue in
//! the store, bounded by `max_local_preference_ms`). Checked on one Redis
//! and on a 5-master quorum: no `WAIT` times out while others take the lock
//! again and again, every worker takes a fair share (on the quorum, among
//! its own lockgate's workers: turns across instances are not built there
//! yet), and no two workers ever hold it at once.
//!
//! df57308 (every waiter polled on its own): on one Redis 16–162
//! acquisitions per worker in 10 s (within one lockgate 16, 121, 66, 18)
//! and whole `WAIT`s of 3 s timed out; on the quorum 11–114, waits up to
//! 8.8 s.
//!
//! `FAIRNESS_SECS` [6] runs each workload longer.

use crate::support;
use crate::SERIAL;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockgate::Config;
use support::{eventually, Lockgate, RawClient, RedisServer};

const WORKERS: usize = 8;
const HOLD: Duration = Duration::from_millis(20);
const WAIT_MS: u64 = 3_000;

/// What one worker saw.
#[derive(Debug, Default, Clone)]
struct Worker {
    acquisitions: u64,
    timeouts: u64,
    longest_wait_ms: u64,
}

fn secs() -> u64 {
    std::env::var("FAIRNESS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(6)
}

/// `*2 :token :validity` → the token; nil → `None`; anything else fails.
fn token(reply: &str) -> Option<String> {
    if reply == "$-1\r\n" || reply == "_\r\n" {
        return None;
    }
    let mut lines = reply.split("\r\n");
    assert_eq!(lines.next(), Some("*2"), "a LOCKGATE LOCK reply: {reply:?}");
    let t = lines.next().and_then(|l| l.strip_prefix(':'));
    Some(
        t.unwrap_or_else(|| panic!("a token in {reply:?}"))
            .to_string(),
    )
}

async fn worker(
    lg: std::net::SocketAddr,
    until: Instant,
    holder: Arc<AtomicU64>,
    me: u64,
) -> Worker {
    let mut c = RawClient::connect(lg).await;
    let mut seen = Worker::default();
    let ttl = "2000";
    let wait = WAIT_MS.to_string();
    while Instant::now() < until {
        let asked = Instant::now();
        let reply = c
            .call_s(&["LOCKGATE", "LOCK", "lock:fair", ttl, "WAIT", &wait])
            .await;
        let waited = asked.elapsed().as_millis() as u64;
        seen.longest_wait_ms = seen.longest_wait_ms.max(waited);
        let Some(t) = token(&reply) else {
            seen.timeouts += 1;
            continue;
        };
        let before = holder.swap(me, Ordering::SeqCst);
        assert_eq!(
            before, 0,
            "worker {me} acquired while worker {before} held the lock"
        );
        seen.acquisitions += 1;
        tokio::time::sleep(HOLD).await;
        holder.store(0, Ordering::SeqCst);
        let released = c.call_s(&["LOCKGATE", "UNLOCK", "lock:fair", &t]).await;
        assert_eq!(released, ":1\r\n", "worker {me}'s release");
    }
    seen
}

async fn measure(quorum: bool) -> Vec<Worker> {
    let primary = RedisServer::start();
    let masters: Vec<RedisServer> = match quorum {
        true => (0..5).map(|_| RedisServer::start()).collect(),
        false => Vec::new(),
    };
    let mut gates = Vec::new();
    for i in 0..2 {
        let mut c = Config::default();
        c.upstream.addr = primary.addr();
        c.locks.instance_id = format!("lg{i}");
        c.locks.quorum.masters = masters.iter().map(|m| m.addr()).collect();
        c.locks.quorum.rejoin_delay_ms = 300;
        // Fairness, not latency, is measured: a master late on a loaded
        // box must not turn an attempt into "no quorum".
        c.locks.quorum.node_timeout_ms = 250;
        gates.push(Lockgate::start_with(c).await);
    }
    if quorum {
        for g in &gates {
            let q = g.ctx.locks.quorum().cloned().expect("quorum");
            eventually("every master up", || {
                q.masters
                    .iter()
                    .all(|m| m.state() == lockgate::lock::quorum::MasterState::Up)
            })
            .await;
        }
    }
    let until = Instant::now() + Duration::from_secs(secs());
    let holder = Arc::new(AtomicU64::new(0));
    let runs: Vec<_> = (0..WORKERS)
        .map(|i| {
            let lg = gates[i % 2].addr;
            tokio::spawn(worker(lg, until, holder.clone(), i as u64 + 1))
        })
        .collect();
    let mut out = Vec::new();
    for r in runs {
        out.push(r.await.expect("a worker"));
    }
    println!(
        "quorum={quorum}: per worker (acquisitions, timeouts, longest wait ms) {:?}; yields {:?}; load {}",
        out.iter()
            .map(|w| (w.acquisitions, w.timeouts, w.longest_wait_ms))
            .collect::<Vec<_>>(),
        gates
            .iter()
            .map(|g| g.ctx.locks.metrics.fairness_yields.load(Ordering::SeqCst))
            .collect::<Vec<_>>(),
        std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim()
    );
    out
}

/// `across`: shares are compared over every worker (one Redis: turns
/// across instances too), else within each lockgate (the quorum: fencing
/// waits take turns within an instance only, docs/faults.md).
fn check(what: &str, out: &[Worker], across: bool) {
    let total: u64 = out.iter().map(|w| w.acquisitions).sum();
    assert!(
        total >= WORKERS as u64 * 4,
        "{what}: the lock went round: {out:?}"
    );
    for (i, w) in out.iter().enumerate() {
        // Worker i went through lockgate i % 2.
        let most = out
            .iter()
            .enumerate()
            .filter(|(j, _)| across || j % 2 == i % 2)
            .map(|(_, w)| w.acquisitions)
            .max()
            .unwrap_or(0);
        assert_eq!(
            w.timeouts, 0,
            "{what}: worker {i}'s WAIT of {WAIT_MS} ms timed out while others took the lock {total} times: {out:?}"
        );
        // Equal shares would be total / 8; a loaded box's stalls move a
        // few. df57308: 16 against 162.
        assert!(
            w.acquisitions * 3 >= most,
            "{what}: worker {i} took the lock {} times, another {most}: {out:?}",
            w.acquisitions
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_waits_take_turns_on_one_redis() {
    let _serial = SERIAL.lock().await;
    let out = measure(false).await;
    check("one Redis", &out, true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_waits_take_turns_on_the_quorum() {
    let _serial = SERIAL.lock().await;
    let out = measure(true).await;
    check("the quorum", &out, false);
}
