//! Fairness of retry storms across lockgate instances. Two lockgates in
//! front of the same lock store, six seeded clients each, all spinning on
//! one key: each holds it 1–10 ms, releases it, pauses 0–5 ms and wants it
//! again. A release hands the lock to the releasing instance's own parked
//! attempts first, and the other instance learns of it only at its next
//! probe, so without a bound one instance's clients could wait for the
//! whole run (8 s of 8 on one Redis with `SETNX`/`DEL`, before
//! `locks.retry.max_local_preference_ms`). Checked on a real redis-server
//! (legacy `SETNX`/`DEL`) and on a 5-master quorum (`SET NX PX` and the
//! compare-and-delete `EVAL`): no instance goes longer than the bound plus
//! a loaded machine's slack without an acquisition while one of its
//! clients wants the lock, no client waits unboundedly, both instances
//! take the lock often, and no two clients ever hold it at once.
//!
//! `FAIRNESS_SECS` [8] runs each workload longer.

use crate::support;
use crate::SERIAL;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockgate::Config;
use support::rng::XorShift;
use support::{eventually, Lockgate, RawClient, RedisServer};

/// The compare-and-delete release every Redis lock tutorial uses.
const RELEASE: &str = r#"if redis.call("get",KEYS[1]) == ARGV[1] then return redis.call("del",KEYS[1]) else return 0 end"#;

/// How clients take and release the lock.
#[derive(Debug, Clone, Copy)]
enum Style {
    /// `SET k uuid NX PX` and the compare-and-delete `EVAL`.
    SetEval,
    /// Legacy `SETNX` and `DEL`.
    SetnxDel,
}

/// What one instance's clients saw.
#[derive(Debug, Default)]
struct Seen {
    acquisitions: AtomicU64,
    longest_wait_ms: AtomicU64,
    /// Longest time the instance went without an acquisition while one of
    /// its clients wanted the lock.
    longest_gap_ms: AtomicU64,
    last_acquired: std::sync::Mutex<Option<Instant>>,
}

/// One client: wants the lock, waits for it (retrying), holds it 1–10 ms,
/// releases it, pauses 0–5 ms, and again, until `stop`.
async fn client(
    lg: std::net::SocketAddr,
    style: Style,
    seed: u64,
    seen: Arc<Seen>,
    busy: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
) {
    let mut c = RawClient::connect(lg).await;
    let mut rng = XorShift::new(seed);
    while !stop.load(Ordering::SeqCst) {
        let value = format!("{:016x}{:016x}", rng.next(), rng.next());
        let wanted = Instant::now();
        let acquired = loop {
            let reply = match style {
                Style::SetEval => {
                    c.call_raw(&["SET", "lock:f", &value, "NX", "PX", "2000"])
                        .await
                }
                Style::SetnxDel => c.call_raw(&["SETNX", "lock:f", &value]).await,
            };
            let waited = wanted.elapsed().as_millis() as u64;
            seen.longest_wait_ms.fetch_max(waited, Ordering::SeqCst);
            if reply == b"+OK\r\n" || reply == b":1\r\n" {
                break true;
            }
            assert!(
                reply == b"$-1\r\n" || reply == b":0\r\n",
                "attempt answered {}",
                support::show(&reply)
            );
            if stop.load(Ordering::SeqCst) {
                break false;
            }
            // A retry loop's pause (Redlock's random delay), not a wait.
            tokio::time::sleep(Duration::from_millis(rng.range(1, 6))).await;
        };
        if !acquired {
            break;
        }
        assert!(!busy.swap(true, Ordering::SeqCst), "two holders at once");
        seen.acquisitions.fetch_add(1, Ordering::SeqCst);
        {
            let mut last = seen.last_acquired.lock().expect("last");
            let from = last.map_or(wanted, |l| l.max(wanted));
            seen.longest_gap_ms
                .fetch_max(from.elapsed().as_millis() as u64, Ordering::SeqCst);
            *last = Some(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(rng.range(1, 10))).await;
        busy.store(false, Ordering::SeqCst);
        let reply = match style {
            Style::SetEval => c.call_raw(&["EVAL", RELEASE, "1", "lock:f", &value]).await,
            Style::SetnxDel => c.call_raw(&["DEL", "lock:f"]).await,
        };
        assert_eq!(reply, b":1\r\n", "release by the holder");
        tokio::time::sleep(Duration::from_millis(rng.range(0, 5))).await;
    }
}

/// Runs 6 clients on each of `gates` for `secs`; returns per instance
/// (acquisitions, longest wait ms).
async fn run(gates: &[Lockgate], style: Style, secs: u64, seed: u64) -> Vec<(u64, u64, u64)> {
    let stop = Arc::new(AtomicBool::new(false));
    let busy = Arc::new(AtomicBool::new(false));
    let seen: Vec<Arc<Seen>> = gates.iter().map(|_| Arc::new(Seen::default())).collect();
    let mut tasks = Vec::new();
    for (g, lg) in gates.iter().enumerate() {
        for i in 0..6u64 {
            tasks.push(tokio::spawn(client(
                lg.addr,
                style,
                seed ^ ((g as u64) << 40) ^ (i << 32),
                seen[g].clone(),
                busy.clone(),
                stop.clone(),
            )));
        }
    }
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(10), t)
            .await
            .expect("client stops in time")
            .expect("client task");
    }
    seen.iter()
        .map(|s| {
            (
                s.acquisitions.load(Ordering::SeqCst),
                s.longest_wait_ms.load(Ordering::SeqCst),
                s.longest_gap_ms.load(Ordering::SeqCst),
            )
        })
        .collect()
}

/// The load average, printed beside the figures.
fn load() -> String {
    std::fs::read_to_string("/proc/loadavg").unwrap_or_default()
}

fn secs() -> u64 {
    std::env::var("FAIRNESS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8)
}

async fn measure(quorum: bool, style: Style) -> Vec<(u64, u64, u64)> {
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
        c.locks.retry.max_local_preference_ms = BOUND_MS;
        // Fresh masters are young at lockgate's first sight and sit out the
        // rejoin delay (the longest lease by default): keep it short.
        c.locks.quorum.rejoin_delay_ms = 300;
        // Fairness, not latency, is measured: a master that answers late on
        // a loaded box must not turn an attempt into "no quorum" (50 ms by
        // default; at load 9-11 one in a few hundred did).
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
    let out = run(&gates, style, secs(), 0xfa1e).await;
    println!(
        "quorum={quorum} style={style:?}: (acquisitions, longest wait ms, longest gap ms) per instance {out:?}; yields {:?}; load {}",
        gates.iter().map(|g| g.ctx.locks.metrics.fairness_yields.load(Ordering::SeqCst)).collect::<Vec<_>>(),
        load().trim()
    );
    out
}

// The two tests each drive up to 7 redis-servers and 12 clients: each
// takes `SERIAL` (tests/serial/main.rs) first.

/// `locks.retry.max_local_preference_ms` (the default).
const BOUND_MS: u64 = 500;
/// What a loaded 2-core machine may add to the bound: the holder's
/// remaining hold, the other instance's wake-up and acquisition, stalls.
const SLACK_MS: u64 = 1_000;
/// Longest any client may wait: its instance's turn may come after the
/// other's (the bound), then its own instance's queue goes first.
const CLIENT_WAIT_MS: u64 = 3 * BOUND_MS + 2 * SLACK_MS;

fn check(what: &str, out: &[(u64, u64, u64)]) {
    let total: u64 = out.iter().map(|o| o.0).sum();
    for (i, &(acquisitions, wait, gap)) in out.iter().enumerate() {
        assert!(
            gap < BOUND_MS + SLACK_MS,
            "{what}: instance {i} went {gap} ms without the lock while its clients wanted it \
             (bound {BOUND_MS} ms + {SLACK_MS} ms slack); per instance {out:?}"
        );
        assert!(
            wait < CLIENT_WAIT_MS,
            "{what}: a client of instance {i} waited {wait} ms (at most {CLIENT_WAIT_MS}); {out:?}"
        );
        assert!(
            acquisitions * 5 >= total,
            "{what}: instance {i} got {acquisitions} of {total} acquisitions; {out:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_spinners_on_one_redis_take_turns_across_instances() {
    let _serial = SERIAL.lock().await;
    let out = measure(false, Style::SetnxDel).await;
    check("SETNX/DEL on one Redis", &out);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_nx_eval_clients_on_the_quorum_take_turns_across_instances() {
    let _serial = SERIAL.lock().await;
    let out = measure(true, Style::SetEval).await;
    check("SET NX + EVAL on the quorum", &out);
}
