//! Liveness of the Redlock quorum after any restart sequence of its
//! masters, against real processes: two lockgate subprocesses in front of
//! 5 redis-server lock masters and a primary, while workers take one lock
//! key three ways (legacy `SETNX` / `EXPIRE` / `DEL`, `SET NX PX` with the
//! compare-and-delete release, `LOCKGATE LOCK` with fencing tokens; the
//! workers of `tests/serial/chaos/`). Each seed runs one schedule:
//!
//! 1. a majority of the masters (3, 4 or all 5, drawn) SIGKILLed at once
//!    and restarted empty;
//! 2. while they still sit out, overlapping minorities: masters SIGKILLed
//!    and restarted empty one after another, at most two down at a time but
//!    each new one going down before the last one votes again, so for a
//!    while no majority has kept its data;
//! 3. on half the seeds one lockgate SIGKILLed and restarted in between.
//!
//! Checked, per seed: some worker acquires within `rejoin_delay + 2 ×
//! lease + 1 s` of the last restart (Redlock's liveness: a majority up
//! acquires, whatever happened before, without restarting lockgate), every
//! worker within that and [`TURN_MS`] more (its turn among six on one
//! key; who goes first is not FIFO across instances), no
//! two sections overlapped within their validity, no update was lost, and
//! fencing tokens grew in grant order throughout (after every master lost
//! every counter, too: `docs/quorum.md`). Before tokens carried the
//! masters' clock, step 1 left the masters sitting out for good waiting
//! for counter copies and no worker acquired again.
//!
//! Knobs (defaults in brackets): `QUORUM_RECOVERY_SEED` [1, the first
//! seed], `QUORUM_RECOVERY_SEEDS` [10 seeds in a row].

use crate::chaos;
use crate::support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chaos::checks::{judge, Journal, Kind};
use chaos::clients::{worker, ClientReport, Shared};
use chaos::{LockgateProc, Tuning};
use support::rng::{env_u64, XorShift};
use support::RedisServer;

/// Every lease, ms (the legacy workers' `EXPIRE` is in whole seconds).
const LEASE_MS: u64 = 1_000;
/// How long a returning master sits out, ms (longer than the lease).
const REJOIN_MS: u64 = 1_200;
/// Workers of each kind (one through each lockgate).
const PER_KIND: usize = 2;
/// Most masters down at once in the overlapping minorities.
const MINORITY: usize = 2;

/// What the first grant (any worker's) must come within, after the last
/// restart: the quorum's liveness.
fn recovery_bound() -> Duration {
    Duration::from_millis(REJOIN_MS + 2 * LEASE_MS + 1_000)
}

/// What each worker's own first grant may take on top of
/// [`recovery_bound`], ms: its turn among six workers on one key
/// (sections up to 150 ms, a `LOCKGATE LOCK … WAIT` of 400 ms per try,
/// spinners on the other instance racing a parked waiter here). CI saw a
/// fencing worker take 4.27 s on a loaded box while the quorum had granted
/// others 1.2 s after the last restart (seed 5); an unrecovered quorum
/// grants nobody, so this weakens nothing about recovery.
const TURN_MS: u64 = 2_000;

/// The processes of one seed.
struct Run {
    _primary: RedisServer,
    masters: Vec<RedisServer>,
    lgs: Vec<LockgateProc>,
}

/// Starts the primary, 5 masters and two lockgates, and waits until both
/// count every master (masters started moments ago sit out first).
async fn start(t: &Tuning) -> Run {
    let primary = RedisServer::start();
    let masters: Vec<RedisServer> = (0..5).map(|_| RedisServer::start()).collect();
    let addrs: Vec<String> = masters.iter().map(|m| m.addr()).collect();
    let lgs = chaos::two_lockgates(&primary.addr(), &addrs, t).await;
    Run {
        _primary: primary,
        masters,
        lgs,
    }
}

/// One step of a schedule, after a pause.
#[derive(Debug, Clone, Copy)]
enum Step {
    Kill(usize),
    Restart(usize),
    RestartLockgate(usize),
}

/// The seed's schedule: `(pause before, step)`.
fn schedule(seed: u64) -> Vec<(Duration, Step)> {
    let mut rng = XorShift::new(seed ^ 0x7ec0_7e21);
    let ms = Duration::from_millis;
    let mut order: Vec<usize> = (0..5).collect();
    for i in (1..5).rev() {
        order.swap(i, rng.range(0, i as u64) as usize);
    }
    let mut steps = Vec::new();
    // 1. A majority at once, down a while, back one after another.
    let k = rng.range(3, 5) as usize;
    for &m in &order[..k] {
        steps.push((ms(0), Step::Kill(m)));
    }
    let down = rng.range(0, 600);
    for (n, &m) in order[..k].iter().enumerate() {
        let pause = if n == 0 { down } else { rng.range(0, 150) };
        steps.push((ms(pause), Step::Restart(m)));
    }
    // 2. Overlapping minorities, inside the sit-outs of step 1.
    let mut out: Vec<usize> = Vec::new();
    let mut first = true;
    for _ in 0..4 {
        let candidates: Vec<usize> = (0..5).filter(|m| !out.contains(m)).collect();
        let m = candidates[rng.range(0, candidates.len() as u64 - 1) as usize];
        let pause = if first {
            rng.range(0, REJOIN_MS / 2)
        } else {
            rng.range(50, 400)
        };
        first = false;
        if out.len() == MINORITY {
            steps.push((ms(pause), Step::Restart(out.remove(0))));
            steps.push((ms(0), Step::Kill(m)));
        } else {
            steps.push((ms(pause), Step::Kill(m)));
        }
        out.push(m);
    }
    for m in out {
        steps.push((ms(rng.range(50, 400)), Step::Restart(m)));
    }
    // 3. A lockgate restarted somewhere in between, on half the seeds.
    if rng.one_in(2) {
        let at = rng.range(k as u64, steps.len() as u64 - 1) as usize;
        let lg = rng.range(0, 1) as usize;
        steps.insert(at, (ms(rng.range(0, 200)), Step::RestartLockgate(lg)));
    }
    steps
}

/// What one seed showed.
#[derive(Debug)]
struct Outcome {
    /// Per worker, how long after the last restart it first acquired.
    recovered: Vec<Option<Duration>>,
    took: Duration,
}

async fn run_seed(seed: u64) -> Outcome {
    let began = Instant::now();
    let tuning = Tuning {
        lease_ms: LEASE_MS,
        rejoin_ms: REJOIN_MS,
        node_timeout_ms: 200,
        drift_ms: 150,
    };
    let steps = schedule(seed);
    println!("quorum_recovery: seed {seed}: {steps:?}");
    let mut run = start(&tuning).await;
    let sh = Arc::new(Shared {
        journal: Journal::new(),
        tuning,
        lgs: run.lgs.iter().map(|l| l.addr).collect(),
        // The workers stop on `stop`; this is only a backstop.
        until: Instant::now() + Duration::from_secs(120),
        stop: AtomicBool::new(false),
        next_id: AtomicU64::new(0),
        inside: AtomicUsize::new(0),
        entered: tokio::sync::Notify::new(),
        // No holder pauses past its lease: recovery is what is measured.
        pause_one_in: u64::MAX,
    });
    let mut tasks = Vec::new();
    let mut kinds = Vec::new();
    for (n, kind) in [Kind::Legacy, Kind::SetNx, Kind::Fence]
        .into_iter()
        .enumerate()
    {
        for k in 0..PER_KIND {
            let id = n * PER_KIND + k;
            kinds.push(kind);
            tasks.push(tokio::spawn(worker(id, kind, id % 2, sh.clone(), seed)));
        }
    }
    let j = &sh.journal;
    // Some grants before the faults.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let mut last_restart = Instant::now();
    for (pause, step) in &steps {
        tokio::time::sleep(*pause).await;
        match *step {
            Step::Kill(m) => {
                tokio::task::block_in_place(|| run.masters[m].stop());
                j.fault("master SIGKILL", format!("SIGKILL m{m}"));
            }
            Step::Restart(m) => {
                tokio::task::block_in_place(|| run.masters[m].restart());
                last_restart = Instant::now();
                j.note(format!("m{m} restarted (empty)"));
            }
            Step::RestartLockgate(k) => {
                run.lgs[k].restart().await;
                last_restart = Instant::now();
                j.fault("lockgate SIGKILL, restart", format!("lg{k} restarted"));
            }
        }
    }
    let since = j.t(last_restart);
    let bound = recovery_bound();
    let turn_bound = bound + Duration::from_millis(TURN_MS);
    let deadline = last_restart + turn_bound;
    let workers = kinds.len();
    let recovered = |j: &Journal| -> Vec<Option<Duration>> {
        j.with(|r| {
            (0..workers)
                .map(|w| {
                    r.sections
                        .iter()
                        .filter(|s| s.client == w && s.start >= since)
                        .map(|s| s.start - since)
                        .min()
                })
                .collect()
        })
    };
    while Instant::now() < deadline && recovered(j).iter().any(Option::is_none) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sh.stop.store(true, Ordering::Relaxed);
    let mut reports: Vec<ClientReport> = Vec::new();
    for t in tasks {
        reports.push(t.await.expect("worker"));
    }
    let outcome = Outcome {
        recovered: recovered(j),
        took: began.elapsed(),
    };
    let records = std::mem::take(&mut *sh.journal.r.lock().expect("journal"));
    let v = judge(&records);
    let tokens: Vec<i64> = records.sections.iter().filter_map(|s| s.token).collect();
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    for r in &reports {
        for (k, n) in &r.errors {
            *errors.entry(k.clone()).or_default() += n;
        }
    }
    let acquired: Vec<u64> = reports.iter().map(|r| r.acquired).collect();
    let failed: Vec<u64> = (reports.iter())
        .map(|r| r.errors.values().sum::<u64>())
        .collect();
    println!(
        "quorum_recovery: seed {seed}: acquired per worker {acquired:?}, errors per worker \
         {failed:?}; first grant after the last restart {:?} (bound {bound:?}); tokens {}..{} ({} grants); overlaps {}, lost \
         updates {}, token order {}; errors {errors:?}; took {:?}",
        outcome.recovered,
        tokens.iter().min().unwrap_or(&0),
        tokens.iter().max().unwrap_or(&0),
        tokens.len(),
        v.overlaps.len(),
        v.lost.len(),
        v.token_order.len(),
        outcome.took
    );
    let timeline = || {
        let logs: Vec<String> = run
            .lgs
            .iter()
            .map(|l| format!("{}:\n{}", l.name, l.log_tail()))
            .collect();
        let faults: Vec<String> = records
            .faults
            .iter()
            .map(|(t, w)| format!("{t:?} {w}"))
            .collect();
        format!(
            "timeline:\n{}\n\nlockgate logs:\n{}",
            faults.join("\n"),
            logs.join("\n")
        )
    };
    for s in v.starved.iter().chain(&v.starved_in_faults).take(3) {
        println!("quorum_recovery: {s}");
    }
    if !v.clean() || !v.starved.is_empty() {
        panic!(
            "SAFETY or liveness failure with QUORUM_RECOVERY_SEED={seed}:\n{}\n\n{}",
            v.first(6),
            timeline()
        );
    }
    let first = outcome.recovered.iter().flatten().min().copied();
    assert!(
        first.is_some_and(|d| d <= bound),
        "QUORUM_RECOVERY_SEED={seed}: no worker acquired within {bound:?} of the last restart \
         (first grant after it: {first:?}); errors {errors:?}\n{}",
        timeline()
    );
    for (w, r) in outcome.recovered.iter().enumerate() {
        assert!(
            r.is_some_and(|d| d <= turn_bound),
            "QUORUM_RECOVERY_SEED={seed}: worker {w} ({:?}) did not acquire within {turn_bound:?} of \
             the last restart (first grant after it: {r:?}); errors {errors:?}; its attempts after \
             it: {}\n{}",
            kinds[w],
            attempts_since(&records, w, since),
            timeline()
        );
    }
    outcome
}

/// What worker `w` was told after `since`: its attempts counted by
/// outcome, with the last few, so a failure says whether it was refused,
/// errored or never answered.
fn attempts_since(records: &chaos::checks::Records, w: usize, since: Duration) -> String {
    use support::history::Outcome;
    let mine: Vec<_> = (records.attempts.iter())
        .filter(|a| a.client == w && a.sent >= since)
        .collect();
    let (mut not, mut failed) = (0, BTreeMap::<String, u64>::new());
    for a in &mine {
        match &a.outcome {
            Outcome::NotAcquired => not += 1,
            Outcome::Failed(e) => *failed.entry(e.chars().take(80).collect()).or_default() += 1,
            Outcome::Granted => {}
        }
    }
    let last: Vec<String> = (mine.iter().rev().take(4).rev())
        .map(|a| format!("t+{:?}..{:?} {:?}", a.sent, a.answered, a.outcome))
        .collect();
    format!(
        "{} ({not} not acquired, failed {failed:?}; last {last:?})",
        mine.len()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_worker_acquires_again_after_any_restart_of_the_masters() {
    let _one = crate::SERIAL.lock().await;
    let first = env_u64("QUORUM_RECOVERY_SEED", 1);
    let seeds = env_u64("QUORUM_RECOVERY_SEEDS", 10);
    let mut slowest = Duration::ZERO;
    for seed in first..first + seeds {
        let o = run_seed(seed).await;
        slowest = slowest.max(
            o.recovered
                .iter()
                .flatten()
                .copied()
                .max()
                .unwrap_or_default(),
        );
    }
    println!(
        "quorum_recovery: {seeds} seeds from {first}: every worker acquired again within \
         {slowest:?} of the last restart (rejoin delay {REJOIN_MS} ms, lease {LEASE_MS} ms)"
    );
}

/// The schedules do what the module doc says: a majority down at once,
/// then never more than two down in the minorities, every master back at
/// the end.
#[test]
fn schedules_kill_a_majority_then_overlapping_minorities() {
    for seed in 1..=50 {
        let steps = schedule(seed);
        let mut down: Vec<usize> = Vec::new();
        let mut most = 0;
        let mut majority_seen = false;
        for (_, step) in &steps {
            match *step {
                Step::Kill(m) => {
                    assert!(!down.contains(&m), "seed {seed}: m{m} killed twice");
                    down.push(m);
                }
                Step::Restart(m) => {
                    assert!(down.contains(&m), "seed {seed}: m{m} restarted while up");
                    down.retain(|&d| d != m);
                }
                Step::RestartLockgate(_) => {}
            }
            if down.len() >= 3 {
                majority_seen = true;
            } else if majority_seen {
                most = most.max(down.len());
            }
        }
        assert!(majority_seen, "seed {seed}: no majority down at once");
        assert!(
            most <= MINORITY,
            "seed {seed}: {most} down in the minorities"
        );
        assert!(down.is_empty(), "seed {seed}: left down: {down:?}");
    }
}
