//! Load through a failover, for the failover tests (Sentinel's and a
//! cluster shard's): clients on their own connections take and release
//! one lock without pause ([`worker`]), each grant recorded; the history
//! is then judged for two holders at once ([`overlaps`]) and for how long
//! the key was refused after the kill ([`refused_ms`]).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::RawClient;

/// How long a holder stays inside its section.
pub const INSIDE: Duration = Duration::from_millis(60);
/// Longest wait for a reply before the connection is taken as lost.
pub const REPLY_WAIT: Duration = Duration::from_secs(3);

/// One grant: when its command was sent, when the grant came, when its
/// holder left (its release sent, or an error ended it).
#[derive(Debug, Clone, Copy)]
pub struct Held {
    sent: Instant,
    start: Instant,
    end: Instant,
}

/// Every grant of one key.
pub type History = Arc<Mutex<Vec<Held>>>;

/// Takes `key` (`SET key w<id> NX PX lease_ms`) and releases it (`DEL`)
/// through lockgate at `addr` until `until`, recording each grant in
/// `history`; a reply that does not come within [`REPLY_WAIT`] drops the
/// connection for a new one.
pub async fn worker(
    addr: std::net::SocketAddr,
    key: &'static str,
    id: usize,
    lease_ms: u64,
    until: Instant,
    history: History,
) {
    let mut conn: Option<RawClient> = None;
    let value = format!("w{id}");
    let lease = lease_ms.to_string();
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
/// `lease` (counted from its command's sending).
pub fn overlaps(history: &[Held], lease: Duration) -> Vec<(Held, Held)> {
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

/// How long the key went without a grant from `killed`: until the first
/// section of a command sent after the kill. A command sent before it may
/// be answered just after it by the primary then killed: that grant was
/// made before the kill (a clean-clone CI run counted one as refused for
/// 0 ms).
pub fn refused_ms(history: &[Held], killed: Instant) -> Option<u64> {
    let first = history
        .iter()
        .filter(|h| h.sent > killed)
        .map(|h| h.start)
        .min()?;
    Some(first.duration_since(killed).as_millis() as u64)
}

/// Starts `workers` [`worker`]s per key of `keys` through `addr` until
/// `until`: each key's history, and the tasks.
pub fn spawn(
    addr: std::net::SocketAddr,
    keys: &[&'static str],
    workers: usize,
    lease_ms: u64,
    until: Instant,
) -> (Vec<History>, Vec<tokio::task::JoinHandle<()>>) {
    let histories: Vec<History> = keys.iter().map(|_| History::default()).collect();
    let mut tasks = Vec::new();
    for (k, key) in keys.iter().enumerate() {
        for w in 0..workers {
            let history = histories[k].clone();
            let id = k * workers + w;
            tasks.push(tokio::spawn(worker(
                addr, key, id, lease_ms, until, history,
            )));
        }
    }
    (histories, tasks)
}

/// Grants so far of each history.
pub fn counts(histories: &[History]) -> Vec<usize> {
    (histories.iter())
        .map(|h| h.lock().expect("history").len())
        .collect()
}

/// Judges the histories of an acknowledged key and a plain one (in that
/// order) through a failover whose primary was killed at `killed`, with
/// `before` grants each before it: never two holders within a lease,
/// more than 10 grants each before the kill, the plain key refused for
/// at least `hold_ms` and the acknowledged one over a second less. Prints
/// the figures; returns how long each was refused after the kill (ms).
pub fn judge(
    keys: &[&str; 2],
    histories: &[History],
    before: &[usize],
    killed: Instant,
    lease_ms: u64,
    hold_ms: u64,
) -> (u64, u64) {
    let mut refused = Vec::new();
    for (k, key) in keys.iter().enumerate() {
        let history = histories[k].lock().expect("history").clone();
        let bad = overlaps(&history, Duration::from_millis(lease_ms));
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
            "{key}: {} grants before the kill, {} after; refused {ms:?} ms after the kill (failover_delay_ms {hold_ms})",
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
        plain_ms >= hold_ms,
        "the plain key granted within the hold: {plain_ms} ms"
    );
    assert!(
        ack_ms + 1_000 < plain_ms,
        "the acknowledged key refused {ack_ms} ms, the plain one {plain_ms} ms"
    );
    (ack_ms, plain_ms)
}
