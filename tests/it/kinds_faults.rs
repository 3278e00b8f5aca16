//! Shared and counted locks under the quorum's faults, judged by the one
//! history checker (`support::history`): readers, writers and permit
//! holders on two lockgates in front of five masters, while a seeded
//! schedule kills two masters, restarts them empty (they sit out their
//! rejoin delay) and hangs a third. The checker holds every history to:
//! no writer beside a reader or another writer, never more permit
//! holders than permits, tokens increasing over every grant, no writer's
//! `WAIT` running out while readers take the lock again and again, every
//! run of attempts granted within the bound outside the spans the test
//! declares (a permit of two needs four of the five masters: none while
//! two are down).

use crate::support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lockgate::lock::quorum::MasterState;
use support::process::Paused;
use support::quorum::{quorum_config, Cluster};
use support::recorder::Recorder;
use support::rng::{env_u64, XorShift};
use support::{Lockgate, RawClient};

const RW: &str = "lock:kf:rw";
const SEM: &str = "lock:kf:sem";

/// Outside the declared spans every run of attempts is granted within
/// this (a loaded box's slack over several holds and a node timeout).
const ACQUIRE_WITHIN: Duration = Duration::from_secs(4);

/// One worker: until `stop`, takes `args` (an acquisition with a `WAIT`),
/// holds it `hold`, releases it; every call recorded.
async fn worker(
    mut rec: Recorder,
    addr: std::net::SocketAddr,
    args: Vec<&'static str>,
    key: &'static str,
    hold: Duration,
    stop: Arc<AtomicBool>,
) -> Recorder {
    let mut c = RawClient::connect(addr).await;
    while !stop.load(Ordering::Relaxed) {
        let reply = rec.call(&mut c, &args).await;
        let token = (reply.starts_with("*2\r\n"))
            .then(|| reply.split("\r\n").nth(1))
            .flatten()
            .and_then(|t| t.strip_prefix(':'))
            .map(str::to_string);
        match token {
            Some(t) => {
                tokio::time::sleep(hold).await;
                rec.call(&mut c, &["LOCKGATE", "UNLOCK", key, &t]).await;
            }
            // Not granted within the wait, or the quorum unavailable (a
            // declared span): a short pause, then again.
            None => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
    rec
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_writers_and_permits_stay_safe_under_master_faults() {
    let seed = env_u64("LOCKGATE_SEED", 46);
    let mut rng = XorShift::new(seed);
    let mut cl = Cluster::start(5, |_| {}).await;
    let mut config_b = quorum_config(&cl.primary.addr(), &cl.config.locks.quorum.masters);
    config_b.locks.instance_id = "quorum-test-b".to_string();
    let b = Lockgate::start_with(config_b).await;
    let mut rec = Recorder::new(ACQUIRE_WITHIN);
    let stop = Arc::new(AtomicBool::new(false));
    let rw_read = vec!["LOCKGATE", "LOCK", RW, "2000", "WAIT", "3000", "SHARED"];
    let rw_write = vec!["LOCKGATE", "LOCK", RW, "2000", "WAIT", "3000"];
    let permit = vec!["LOCKGATE", "ACQUIRE", SEM, "2", "2000", "WAIT", "3000"];
    let mut tasks = Vec::new();
    let plan: [(Vec<&'static str>, &'static str, u64); 9] = [
        (rw_read.clone(), RW, 15),
        (rw_read.clone(), RW, 10),
        (rw_read, RW, 20),
        (rw_write.clone(), RW, 5),
        (rw_write, RW, 5),
        (permit.clone(), SEM, 10),
        (permit.clone(), SEM, 15),
        (permit.clone(), SEM, 10),
        (permit, SEM, 5),
    ];
    for (i, (args, key, hold)) in plan.into_iter().enumerate() {
        // Alternate lockgates, so turns are also taken across instances.
        let addr = if i % 2 == 0 { cl.lg.addr } else { b.addr };
        let w = worker(
            rec.for_client(i + 1),
            addr,
            args,
            key,
            Duration::from_millis(hold),
            stop.clone(),
        );
        tasks.push(tokio::spawn(w));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Two masters killed: the locks go on with three; permits of two
    // need four.
    let first = rng.range(0, 4) as usize;
    let second = (first + 1 + rng.range(0, 3) as usize) % 5;
    // The span is declared once both are dead (an attempt asked before
    // may still be answered yes) and ends as they are restarted (they
    // vote again after their rejoin delay, whenever either lockgate sees
    // them back).
    for i in [first, second] {
        cl.masters[i].stop();
    }
    rec.cannot_grant(SEM, "2 of 5 masters down: a permit of 2 needs 4");
    for i in [first, second] {
        cl.wait_state(i, "Down", |s| *s == MasterState::Down).await;
    }
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    // Restarted empty: they sit out the rejoin delay, then vote again.
    rec.can_grant(SEM);
    for i in [first, second] {
        tokio::task::block_in_place(|| cl.masters[i].restart());
    }
    for i in [first, second] {
        cl.wait_state(i, "Up", |s| *s == MasterState::Up).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    // A third hangs for a second: four still answer.
    let others: Vec<usize> = (0..5).filter(|i| ![first, second].contains(i)).collect();
    let hung = others[rng.range(0, 2) as usize];
    let paused = Paused::stop(cl.masters[hung].pid()).await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    paused.resume();
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        rec.merge(t.await.expect("a worker"));
    }
    println!("seed {seed}: killed {first} and {second}, hung {hung}");
    rec.judge("shared and counted locks under master faults", 30);
    b.stop().await;
}
