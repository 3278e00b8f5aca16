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
use support::failover_load;
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
    let (histories, tasks) = failover_load::spawn(lg.addr, &keys, WORKERS, LEASE_MS, until);
    tokio::time::sleep(killed_at.saturating_duration_since(Instant::now())).await;
    let killed = Instant::now();
    let before = failover_load::counts(&histories);
    group.primary.stop();
    for t in tasks {
        t.await.expect("a worker panicked");
    }
    let acks = lg.ctx.locks.replica_acks();
    failover_load::judge(&keys, &histories, &before, killed, LEASE_MS, HOLD_MS);
    assert!(m(&acks.unheld) > 0, "no acquisition skipped the hold");
    assert!(
        m(&acks.acknowledged) as usize >= before[0],
        "grants not acknowledged"
    );
    lg.stop().await;
}
