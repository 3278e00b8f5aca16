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

/// How long the key went without a grant from `killed`: until its first
/// section starting after the kill.
pub fn refused_ms(history: &[Held], killed: Instant) -> Option<u64> {
    let first = history
        .iter()
        .map(|h| h.start)
        .filter(|s| *s > killed)
        .min()?;
    Some(first.duration_since(killed).as_millis() as u64)
}
