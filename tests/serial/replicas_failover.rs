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

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support;
use support::locks::m;
use support::sentinel::acked_with_two_replicas;
use support::RawClient;

/// `locks.failover_delay_ms`.
const HOLD_MS: u64 = 6_000;
/// Each grant's lease: short, so a holder cut off by the switch (its
/// session closed before its release) keeps nobody out for long.
const LEASE_MS: u64 = 1_500;
/// How long a holder stays inside its section.
const INSIDE: Duration = Duration::from_millis(60);
/// Workers per key.
const WORKERS: usize = 3;
/// Longest wait for a reply before the connection is taken as lost.
const REPLY_WAIT: Duration = Duration::from_secs(3);
/// How long the load runs after the kill.
const AFTER_KILL: Duration = Duration::from_secs(11);

/// One grant: when its command was sent, when the grant came, when its
/// holder left (its release sent, or an error ended it).
#[derive(Debug, Clone, Copy)]
struct Held {
    sent: Instant,
    start: Instant,
    end: Instant,
}

/// Every grant of one key.
type History = Arc<Mutex<Vec<Held>>>;

async fn worker(
    addr: std::net::SocketAddr,
    key: &'static str,
    id: usize,
    until: Instant,
    history: History,
) {
    let mut conn: Option<RawClient> = None;
    let value = format!("w{id}");
    let lease = LEASE_MS.to_string();
    while Instant::now() < until {
        let c = match &mut conn {
            Some(c) => c,
            None => conn.insert(RawClient::connect(addr).await),
        };
        let sent = Instant::now();
        let Some(reply) = c
            .try_call_s(&["SET", key, &value, "NX", "PX", &lease], REPLY_WAIT)
            .await
        else {
            conn = None;
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        if reply != "+OK\r\n" {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        let start = Instant::now();
        tokio::time::sleep(INSIDE).await;
        let end = Instant::now();
        history
            .lock()
            .expect("history")
            .push(Held { sent, start, end });
        if c.try_call_s(&["DEL", key], REPLY_WAIT).await.is_none() {
            conn = None;
        }
    }
}

/// Pairs of grants of one key whose sections overlapped, each within its
/// lease (counted from its command's sending).
fn overlaps(history: &[Held]) -> Vec<(Held, Held)> {
    let lease = Duration::from_millis(LEASE_MS);
    let mut sorted = history.to_vec();
    sorted.sort_by_key(|h| h.start);
    let mut bad = Vec::new();
    for (i, a) in sorted.iter().enumerate() {
        let a_until = a.end.min(a.sent + lease);
        for b in &sorted[i + 1..] {
            if b.start >= a_until {
                break;
            }
            bad.push((*a, *b));
        }
    }
    bad
}

/// How long `key` went without a grant from `killed`: until its first
/// section starting after the kill.
fn refused_ms(history: &[Held], killed: Instant) -> Option<u64> {
    let first = history
        .iter()
        .map(|h| h.start)
        .filter(|s| *s > killed)
        .min()?;
    Some(first.duration_since(killed).as_millis() as u64)
}

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
        let bad = overlaps(&history);
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
