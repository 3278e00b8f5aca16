//! A Sentinel failover under load, with replica acknowledgement on one
//! pattern (issue 45): a primary, two replicas and three sentinels (real
//! processes); clients on their own connections take and release two
//! locks through lockgate without pause, one whose pattern asks
//! `replicas_ack = 1` and one whose pattern does not; the primary is
//! SIGKILLed while they run. Judged over the whole history: no grant of a
//! key while another holder of it was inside its section within its lease
//! (never two holders), for both keys; and how long each key was refused
//! after the kill, before (the plain key: the whole
//! `locks.failover_delay_ms`) and after acknowledgement (the acknowledged
//! key: once the promoted replica is vouched for, docs/sentinel.md "The
//! shorter hold after a switch"). The figures are printed.

use std::time::{Duration, Instant};

use crate::support;
use support::failover_load::{overlaps, refused_ms, worker, History};
use support::locks::m;
use support::sentinel::acked_with_two_replicas;

/// `locks.failover_delay_ms`.
const HOLD_MS: u64 = 6_000;
/// Each grant's lease: short, so a holder cut off by the switch (its
/// session closed before its release) keeps nobody out for long.
const LEASE_MS: u64 = 1_500;
/// Workers per key.
const WORKERS: usize = 3;
/// How long the load runs after the kill.
const AFTER_KILL: Duration = Duration::from_secs(11);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_under_load_never_makes_two_holders_and_acknowledged_keys_come_back_first() {
    let _serial = crate::SERIAL.lock().await;
    let (mut group, _second, lg, started) = acked_with_two_replicas(HOLD_MS).await;
    // Acknowledgement in force for the whole delay before the switch: the
    // load runs meanwhile.
    let killed_at = started + Duration::from_millis(HOLD_MS + 300);
    let until = killed_at + AFTER_KILL;
    let keys: [&'static str; 2] = ["lock:ack:k", "lock:plain:k"];
    let histories: Vec<History> = keys.iter().map(|_| History::default()).collect();
    let mut tasks = Vec::new();
    for (k, key) in keys.iter().enumerate() {
        for w in 0..WORKERS {
            let history = histories[k].clone();
            tasks.push(tokio::spawn(worker(
                lg.addr,
                key,
                k * WORKERS + w,
                LEASE_MS,
                until,
                history,
            )));
        }
    }
    tokio::time::sleep(killed_at.saturating_duration_since(Instant::now())).await;
    let killed = Instant::now();
    let before: Vec<usize> = (histories.iter())
        .map(|h| h.lock().expect("history").len())
        .collect();
    group.primary.stop();
    for t in tasks {
        t.await.expect("a worker panicked");
    }
    let acks = lg.ctx.locks.replica_acks();
    let mut refused = Vec::new();
    for (k, key) in keys.iter().enumerate() {
        let history = histories[k].lock().expect("history").clone();
        let bad = overlaps(&history, Duration::from_millis(LEASE_MS));
        assert!(
            bad.is_empty(),
            "{key}: two holders at once: {:?}",
            &bad[..1]
        );
        assert!(
            before[k] > 10,
            "{key}: only {} grants before the kill",
            before[k]
        );
        let ms = refused_ms(&history, killed);
        println!(
            "{key}: {} grants before the kill, {} after; refused {ms:?} ms after the kill (failover_delay_ms {HOLD_MS})",
            before[k],
            history.len() - before[k],
        );
        refused.push(ms);
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average: {}", load.trim());
    let (Some(ack_ms), Some(plain_ms)) = (refused[0], refused[1]) else {
        panic!("a key never granted after the kill: {refused:?}");
    };
    assert!(
        plain_ms >= HOLD_MS,
        "the plain key granted within the hold: {plain_ms} ms"
    );
    assert!(
        ack_ms + 1_000 < plain_ms,
        "the acknowledged key refused {ack_ms} ms, the plain one {plain_ms} ms"
    );
    assert!(m(&acks.unheld) > 0, "no acquisition skipped the hold");
    assert!(
        m(&acks.acknowledged) as usize >= before[0],
        "grants not acknowledged"
    );
    lg.stop().await;
}
