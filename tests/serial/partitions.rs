//! Network partitions between real processes: every lockgate reaches each
//! lock master through its own relay (`tests/support/relay.rs`), so a test
//! cuts, blackholes and heals one lockgate's paths while the other's stay
//! as they are. Workers of the three kinds (legacy `SETNX`/`EXPIRE`/`DEL`,
//! `SET NX PX` with the compare-and-delete release, `LOCKGATE LOCK … WAIT`
//! with a fenced store) run through both lockgates the whole time, and the
//! one checker over histories (`tests/support/history.rs`) judges
//! everything that happened: no two valid sections overlap, no lost
//! update, tokens grow and the fenced store never takes an old one, and
//! after the last heal every worker acquires within a bound. `WAIT`s that
//! ran out while others took the lock again and again are counted and
//! shown, not failed: on the quorum, fencing waits take turns within an
//! instance but not yet across instances. What each case
//! promises is in docs/faults.md, "Partitions".
//!
//! `PARTITION_SEED` picks the schedule (which masters, blackhole or cut);
//! the bench script `bench/chaos.sh` runs many seeds, also with the CPU
//! saturated.

use crate::chaos;
use crate::support;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chaos::checks::{judge, Journal, Kind};
use chaos::clients::{worker, ClientReport, Shared};
use chaos::{LockgateProc, Tuning};
use support::relay::{Mode, Relay};
use support::rng::{env_u64, XorShift};
use support::RedisServer;

/// Five masters, two lockgates, each lockgate's path to each master a relay.
struct Net {
    _primary: RedisServer,
    _masters: Vec<RedisServer>,
    /// `relays[lg][master]`.
    relays: Vec<Vec<Relay>>,
    lgs: Vec<LockgateProc>,
}

impl Net {
    async fn start(t: &Tuning) -> Net {
        let primary = RedisServer::start();
        let masters: Vec<RedisServer> = (0..5).map(|_| RedisServer::start()).collect();
        let mut relays = Vec::new();
        let mut lgs = Vec::new();
        for k in 0..2 {
            let mut mine = Vec::new();
            for m in &masters {
                mine.push(Relay::to(&m.addr()).await);
            }
            let addrs: Vec<String> = mine.iter().map(|r| r.host_port()).collect();
            lgs.push(LockgateProc::start(&format!("lg{k}"), &primary.addr(), &addrs, t).await);
            relays.push(mine);
        }
        for lg in &lgs {
            lg.all_up(5).await;
        }
        Net {
            _primary: primary,
            _masters: masters,
            relays,
            lgs,
        }
    }

    /// Lockgate `lg`'s paths to `masters` set to `mode`, the others healed.
    fn only(&self, lg: usize, masters: &[usize], mode: Mode) {
        for (m, r) in self.relays[lg].iter().enumerate() {
            match masters.contains(&m) {
                true => r.set(mode),
                false => r.heal(),
            }
        }
    }

    fn heal_all(&self) {
        self.relays.iter().flatten().for_each(Relay::heal);
    }
}

fn tuning() -> Tuning {
    let lease_ms = 1_000;
    Tuning {
        lease_ms,
        rejoin_ms: lease_ms + 200,
        node_timeout_ms: 200,
        drift_ms: 150,
    }
}

fn shuffle(rng: &mut XorShift, v: &mut [usize]) {
    for i in (1..v.len()).rev() {
        v.swap(i, rng.range(0, i as u64) as usize);
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Starts two workers of each kind (one through each lockgate), runs
/// `schedule` on the net (it records its faults in the journal and returns
/// when the last one healed), then a quiet stretch of `quiet`, and judges.
async fn run<F, Fut>(name: &str, seed: u64, quiet: Duration, schedule: F)
where
    F: FnOnce(Arc<Net>, Arc<Shared>, XorShift) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let began = Instant::now();
    let t = tuning();
    let net = Arc::new(Net::start(&t).await);
    let sh = Arc::new(Shared {
        journal: Journal::new(),
        tuning: t,
        lgs: net.lgs.iter().map(|l| l.addr).collect(),
        // Set for real once the schedule is done.
        until: Instant::now() + Duration::from_secs(600),
        stop: AtomicBool::new(false),
        next_id: AtomicU64::new(0),
        inside: AtomicUsize::new(0),
        entered: tokio::sync::Notify::new(),
        // No deliberate pauses: the faults are the network's.
        pause_one_in: u64::MAX,
    });
    let mut tasks = Vec::new();
    for (n, kind) in [Kind::Legacy, Kind::SetNx, Kind::Fence]
        .into_iter()
        .enumerate()
    {
        for lg in 0..2 {
            let id = n * 2 + lg;
            tasks.push(tokio::spawn(worker(id, kind, lg, sh.clone(), seed)));
        }
    }
    schedule(net.clone(), sh.clone(), XorShift::new(seed)).await;
    net.heal_all();
    sh.journal.note("healed".to_string());
    let healed = sh.journal.t(Instant::now());
    tokio::time::sleep(quiet).await;
    sh.stop.store(true, Ordering::SeqCst);
    let mut reports: Vec<ClientReport> = Vec::new();
    for task in tasks {
        reports.push(task.await.expect("worker"));
    }
    let mut records = std::mem::take(&mut *sh.journal.r.lock().expect("journal"));
    records.healed = Some(healed);
    // After a heal a master sits out its rejoin delay (the lease + 200
    // ms); the quorum is whole again then, plus a loaded box's slack.
    records.live_within = Duration::from_millis(t.rejoin_ms) + Duration::from_secs(3);
    let v = judge(&records);
    let acquired: Vec<u64> = reports.iter().map(|r| r.acquired).collect();
    let errors: Vec<usize> = reports
        .iter()
        .map(|r| r.errors.values().sum::<u64>() as usize)
        .collect();
    println!(
        "partitions {name} seed {seed}: acquisitions per worker {acquired:?}; errors per worker \
         {errors:?}; faults {:?}; overlaps {}; lost {} (+{} past validity); fencing refusals of \
         valid holders {} (late refused {}); old tokens {}; token order {}; starved {} (+{} near \
         faults); not live {}; \
         took {:?}; load {}",
        records.fault_counts,
        v.overlaps.len(),
        v.lost.len(),
        v.lost_benign,
        v.fence_refused_valid.len(),
        v.fence_refused_late,
        v.old_token_accepted.len(),
        v.token_order.len(),
        v.starved.len(),
        v.starved_in_faults.len(),
        v.unlive.len(),
        began.elapsed(),
        load_average()
    );
    // Starved WAITs near a fault are reported; away from faults they fail.
    for s in v.starved.iter().chain(&v.starved_in_faults).take(3) {
        println!("partitions {name}: {s}");
    }
    if !v.clean() || !v.live() {
        let logs: Vec<String> = net
            .lgs
            .iter()
            .map(|l| format!("{}:\n{}", l.name, l.log_tail()))
            .collect();
        panic!(
            "partitions {name} failed with PARTITION_SEED={seed}:\n{}\n\nfaults: {:?}\n\nlockgate logs:\n{}",
            v.first(6),
            records.faults,
            logs.join("\n")
        );
    }
    for (i, r) in reports.iter().enumerate() {
        assert!(
            r.acquired >= 1,
            "worker {i} ({:?}) never acquired: {reports:?}",
            r.kind
        );
    }
}

/// Two masters of five out of one lockgate's reach (a minority): both
/// lockgates keep granting; then three (a majority): that lockgate refuses
/// with an error, bounded in time, while the other keeps granting; healed,
/// both grant again without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lockgate_cut_from_a_minority_then_a_majority_of_masters() {
    let _one = crate::SERIAL.lock().await;
    let seed = env_u64("PARTITION_SEED", 0x9a27);
    run(
        "minority-majority",
        seed,
        Duration::from_secs(4),
        |net, sh, mut rng| async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            let lg = rng.range(0, 1) as usize;
            let mut order: Vec<usize> = (0..5).collect();
            shuffle(&mut rng, &mut order);
            for (cut, what) in [(2, "minority"), (3, "majority")] {
                let mode = match rng.one_in(2) {
                    true => Mode::Blackhole,
                    false => Mode::Cut,
                };
                let masters = &order[..cut];
                sh.journal
                    .fault(what, format!("lg{lg} {mode:?} from masters {masters:?}"));
                net.only(lg, masters, mode);
                tokio::time::sleep(Duration::from_secs(3)).await;
                net.heal_all();
                sh.journal.note(format!("lg{lg} healed"));
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        },
    )
    .await;
}

/// Each lockgate sees a different majority, the two overlapping in one
/// master, and in turn the sides swap (which master they share, blackhole
/// or cut, by the seed): a lock is granted by at most one of them at a
/// time, tokens grow across the swaps, and all is well after the heal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_lockgates_each_seeing_a_different_majority_in_turn() {
    let _one = crate::SERIAL.lock().await;
    let seed = env_u64("PARTITION_SEED", 0x5b1d);
    run("split-majorities", seed, Duration::from_secs(4), |net, sh, mut rng| async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        for turn in 0..4 {
            let mut order: Vec<usize> = (0..5).collect();
            shuffle(&mut rng, &mut order);
            // order[0] is shared; lg0 also sees order[1..3], lg1 order[3..5].
            let (a, b) = ([order[3], order[4]], [order[1], order[2]]);
            let mode = match rng.one_in(2) {
                true => Mode::Blackhole,
                false => Mode::Cut,
            };
            let (first, second) = match turn % 2 {
                0 => (a, b),
                _ => (b, a),
            };
            sh.journal.fault(
                "split",
                format!("{mode:?}: lg0 cut from {first:?}, lg1 cut from {second:?}, shared master {}", order[0]),
            );
            net.only(0, &first, mode);
            net.only(1, &second, mode);
            tokio::time::sleep(Duration::from_millis(rng.range(1_500, 3_000))).await;
        }
    })
    .await;
}
