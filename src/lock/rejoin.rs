//! Rejoining the quorum with the fencing counters. A lock master that
//! returns (restarted, reconnected, or first seen by lockgate moments after
//! it started) may have lost the per-key token counters
//! `lockgate:fence:{key}`. Before it may vote in acquisitions again, the
//! counters of a majority of the other masters are copied to it, only ever
//! raising a counter. Otherwise a rolling restart (a sequence of minority
//! failures) could leave a majority of empty masters and hand out token 1
//! again. The safety argument is in `docs/quorum.md`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio_util::sync::CancellationToken;

use super::node::{Node, NodeError};
use super::quorum::{integer, Quorum};
use crate::metrics::ProxyMetrics;
use crate::protocol::encode;

/// Keys a `SCAN` page asks for at once (`COUNT`): bounds each call's work
/// on a master and the memory of a copy (one page per source at a time).
pub const SCAN_COUNT: usize = 500;
/// The counters' key pattern.
const COUNTER_PATTERN: &[u8] = b"lockgate:fence:{*}";
/// How often returning masters are looked at.
const TICK: Duration = Duration::from_millis(50);
/// Added to twice the node timeout before a copy may read (see
/// [`Admission::require_copy`]): room for a late timer on a loaded host.
const SETTLE_MARGIN: Duration = Duration::from_millis(100);
/// Least time one copy call may take (a page of counters is more work
/// than a lock call).
const MIN_CALL_TIMEOUT: Duration = Duration::from_millis(250);
/// Longest pause between two failed copy rounds for one master.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Raises counters on the returning master, never lowers one. KEYS: the
/// counters; ARGV: their values on a source, in the same order. A key that
/// is not a number there is left alone. Reply: how many were raised.
pub const RAISE: &str = r#"
local n = 0
for i = 1, #KEYS do
  local v = tonumber(ARGV[i])
  local cur = redis.pcall('GET', KEYS[i])
  if v and type(cur) ~= 'table' then
    local c = tonumber(cur or '0')
    if c and c < v then
      redis.call('SET', KEYS[i], ARGV[i])
      n = n + 1
    end
  end
end
return n
"#;

/// Why a copy round did not admit a master.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RejoinError {
    /// Fewer masters hold their counters than a copy needs.
    #[error("{have} of the other masters hold their fence counters, {need} needed")]
    TooFewSources {
        /// Masters connected and admitted (or all connected, at bootstrap).
        have: usize,
        /// The majority.
        need: usize,
    },
    /// A call to a master failed.
    #[error(transparent)]
    Node(#[from] NodeError),
    /// A master answered something else than expected.
    #[error("master {0} answered {1:?}")]
    Reply(String, String),
    /// A master's connection changed during the copy: what was read or
    /// written may belong to another run of it.
    #[error("master {0} reconnected during the copy")]
    Reconnected(String),
}

/// Counters of the rejoin copies, exported with the lock counters.
#[derive(Debug, Default)]
pub struct RejoinMetrics {
    /// Fence counters raised on a returning master by a copy.
    pub counters_copied: AtomicU64,
    /// Copy rounds that failed (the master keeps sitting out; retried).
    pub copy_failures: AtomicU64,
}

/// Whether a master's current connection holds the fence counters, and
/// when a copy to it is due.
#[derive(Debug)]
pub struct Admission {
    /// The connection (`NodeState::connects`) whose counters are known
    /// current; 0: none.
    admitted: AtomicU64,
    /// A copy owed: for which connection, not before when, failures so far.
    owed: Mutex<Option<(u64, Instant, u32)>>,
    /// How long after a return a copy may first read (see
    /// [`Admission::require_copy`]).
    settle: Duration,
}

impl Admission {
    /// Nothing admitted yet; copies settle `2 × node_timeout` + a margin.
    pub fn new(node_timeout: Duration) -> Admission {
        Admission {
            admitted: AtomicU64::new(0),
            owed: Mutex::new(None),
            settle: node_timeout * 2 + SETTLE_MARGIN,
        }
    }

    /// Trusts connection `connects` as it is (a master that has run longer
    /// than the rejoin delay when lockgate first sees it).
    pub fn trust(&self, connects: u64) {
        self.admitted.store(connects, Ordering::Relaxed);
        if let Ok(mut owed) = self.owed.lock() {
            *owed = None;
        }
    }

    /// Connection `connects` must get the counters copied before it votes.
    // The copy reads only `settle` after now: a commit lockgate counted was
    // acknowledged within node_timeout of being sent, and any commit the
    // lost run had acknowledged was sent before now, so every master that
    // acknowledged it did so before the copy reads (docs/quorum.md).
    pub fn require_copy(&self, connects: u64) {
        if let Ok(mut owed) = self.owed.lock() {
            *owed = Some((connects, Instant::now() + self.settle, 0));
        }
    }

    /// Whether connection `connects` holds the counters.
    pub fn is_admitted(&self, connects: u64) -> bool {
        connects > 0 && self.admitted.load(Ordering::Relaxed) == connects
    }

    /// Whether a copy to connection `connects` is due now.
    fn due(&self, connects: u64) -> bool {
        self.owed
            .lock()
            .ok()
            .and_then(|o| *o)
            .is_some_and(|(c, at, _)| c == connects && Instant::now() >= at)
    }

    /// A copy to connection `connects` completed.
    fn admit(&self, connects: u64) {
        if let Ok(mut owed) = self.owed.lock() {
            if owed.is_some_and(|(c, _, _)| c == connects) {
                *owed = None;
                self.admitted.store(connects, Ordering::Relaxed);
            }
        }
    }

    /// A copy to connection `connects` failed: try again later, backing off.
    fn failed(&self, connects: u64) {
        if let Ok(mut owed) = self.owed.lock() {
            if let Some((c, at, n)) = owed.as_mut().filter(|(c, _, _)| *c == connects) {
                let _ = c;
                let pause = (TICK * 2u32.saturating_pow(*n)).min(MAX_BACKOFF);
                *at = Instant::now() + pause;
                *n = n.saturating_add(1);
            }
        }
    }
}

/// Starts the task that copies the counters to returning masters; it stops
/// with `stop`.
pub fn spawn(quorum: Arc<Quorum>, stop: CancellationToken) {
    tokio::spawn(async move {
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = run(&quorum) => {}
        }
    });
}

async fn run(q: &Quorum) {
    // Until this lockgate has seen a majority of masters hold their
    // counters, it has granted nothing, and when the masters it found were
    // mostly young (a fresh deployment, a whole quorum restarted) nothing
    // a majority held survives anyway: copies then read from every
    // connected master, best effort, instead of waiting for ever.
    let mut bootstrap = true;
    loop {
        let connects = |m: usize| q.masters[m].node.state.connects.load(Ordering::Relaxed);
        let admitted = (0..q.masters.len())
            .filter(|&m| q.masters[m].admission.is_admitted(connects(m)))
            .count();
        if admitted >= q.majority() {
            bootstrap = false;
        }
        let due: Vec<usize> = (0..q.masters.len())
            .filter(|&m| {
                let master = &q.masters[m];
                master.node.state.up.load(Ordering::Relaxed)
                    && master.admission.due(connects(m))
            })
            .collect();
        let rounds = due.iter().map(|&m| round(q, m, bootstrap));
        futures_util::future::join_all(rounds).await;
        tokio::time::sleep(TICK).await;
    }
}

/// One copy round to master `target`; admits it on success.
async fn round(q: &Quorum, target: usize, bootstrap: bool) {
    let m = &q.masters[target];
    let connects = m.node.state.connects.load(Ordering::Relaxed);
    match copy(q, target, connects, bootstrap).await {
        Ok(copied) => {
            m.admission.admit(connects);
            q.rejoin
                .counters_copied
                .fetch_add(copied, Ordering::Relaxed);
            tracing::info!(
                master = m.node.addr(),
                copied,
                bootstrap,
                "lock master holds the fence counters again"
            );
        }
        Err(e) => {
            ProxyMetrics::inc(&q.rejoin.copy_failures);
            m.admission.failed(connects);
            tracing::warn!(
                master = m.node.addr(),
                error = %e,
                "fence counters not copied; the master keeps sitting out"
            );
        }
    }
}

/// Copies every counter of each source (the other masters holding theirs)
/// to `target`'s connection `connects`; succeeds once a majority of
/// sources were copied whole. Returns the counters raised.
async fn copy(q: &Quorum, target: usize, connects: u64, bootstrap: bool) -> Result<u64, RejoinError> {
    let need = q.majority();
    let sources: Vec<(usize, u64)> = (0..q.masters.len())
        .filter(|&s| s != target)
        .filter_map(|s| {
            let st = &q.masters[s].node.state;
            let c = st.connects.load(Ordering::Relaxed);
            let holds = bootstrap || q.masters[s].admission.is_admitted(c);
            (st.up.load(Ordering::Relaxed) && holds).then_some((s, c))
        })
        .collect();
    if sources.len() < need {
        return Err(RejoinError::TooFewSources {
            have: sources.len(),
            need,
        });
    }
    let timeout = q.node_timeout().max(MIN_CALL_TIMEOUT);
    let dst = Endpoint {
        node: &q.masters[target].node,
        connects,
    };
    let copies = sources.iter().map(|&(s, c)| {
        let src = Endpoint {
            node: &q.masters[s].node,
            connects: c,
        };
        copy_from(src, dst, timeout)
    });
    let results = futures_util::future::join_all(copies).await;
    dst.same()?;
    let mut copied = 0;
    let mut whole = 0;
    let mut error = None;
    for r in results {
        match r {
            Ok(n) => {
                copied += n;
                whole += 1;
            }
            Err(e) => error = Some(e),
        }
    }
    match (whole >= need, error) {
        (true, _) => Ok(copied),
        (false, Some(e)) => Err(e),
        (false, None) => Err(RejoinError::TooFewSources { have: whole, need }),
    }
}

/// A master's connection as of the start of a copy.
#[derive(Clone, Copy)]
struct Endpoint<'a> {
    node: &'a Node,
    connects: u64,
}

impl Endpoint<'_> {
    /// Still the same connection: every reply so far came over it.
    fn same(&self) -> Result<(), RejoinError> {
        match self.node.state.connects.load(Ordering::Relaxed) == self.connects {
            true => Ok(()),
            false => Err(RejoinError::Reconnected(self.node.addr().to_string())),
        }
    }

    async fn call(&self, command: Bytes, timeout: Duration) -> Result<Bytes, RejoinError> {
        let reply = self.node.call(command, timeout).await?;
        self.same()?;
        if reply.first() == Some(&b'-') {
            let text = String::from_utf8_lossy(&reply).trim_end().to_string();
            return Err(RejoinError::Reply(self.node.addr().to_string(), text));
        }
        Ok(reply)
    }
}

/// SCANs `src`'s counters page by page and raises each on `dst`.
async fn copy_from(src: Endpoint<'_>, dst: Endpoint<'_>, timeout: Duration) -> Result<u64, RejoinError> {
    let count = SCAN_COUNT.to_string();
    let bad = |node: &Node, what: &str| RejoinError::Reply(node.addr().to_string(), what.into());
    let mut cursor = Bytes::from_static(b"0");
    let mut copied = 0u64;
    loop {
        let scan = encode::command(&[
            b"SCAN",
            &cursor,
            b"MATCH",
            COUNTER_PATTERN,
            b"COUNT",
            count.as_bytes(),
        ]);
        let reply = src.call(scan, timeout).await?;
        let (next, keys) = parse_scan(&reply).ok_or_else(|| bad(src.node, "a malformed SCAN reply"))?;
        if !keys.is_empty() {
            let mut mget: Vec<&[u8]> = vec![b"MGET"];
            mget.extend(keys.iter().map(|k| k.as_ref()));
            let reply = src.call(encode::command(&mget), timeout).await?;
            let values = parse_bulks(&reply)
                .filter(|v| v.len() == keys.len())
                .ok_or_else(|| bad(src.node, "a malformed MGET reply"))?;
            let pairs: Vec<(&Bytes, Bytes)> = keys
                .iter()
                .zip(values)
                .filter_map(|(k, v)| v.map(|v| (k, v)))
                .collect();
            if !pairs.is_empty() {
                let n = pairs.len().to_string();
                let mut eval: Vec<&[u8]> = vec![b"EVAL", RAISE.as_bytes(), n.as_bytes()];
                eval.extend(pairs.iter().map(|(k, _)| k.as_ref()));
                eval.extend(pairs.iter().map(|(_, v)| v.as_ref()));
                let raised = dst.call(encode::command(&eval), timeout).await?;
                copied += integer(&raised)
                    .and_then(|n| u64::try_from(n).ok())
                    .ok_or_else(|| bad(dst.node, "a malformed RAISE reply"))?;
            }
        }
        if next.as_ref() == b"0" {
            return Ok(copied);
        }
        cursor = next;
    }
}

/// `*2 $cursor *n $key…` → (cursor, keys).
fn parse_scan(reply: &[u8]) -> Option<(Bytes, Vec<Bytes>)> {
    let mut p = Parser { buf: reply, pos: 0 };
    if p.header(b'*')? != 2 {
        return None;
    }
    let cursor = p.bulk()??;
    let n = p.header(b'*')?;
    let keys = (0..n).map(|_| p.bulk()?).collect::<Option<Vec<_>>>()?;
    Some((cursor, keys))
}

/// `*n ($v | $-1)…` → the values (`None`: nil).
fn parse_bulks(reply: &[u8]) -> Option<Vec<Option<Bytes>>> {
    let mut p = Parser { buf: reply, pos: 0 };
    let n = p.header(b'*')?;
    (0..n).map(|_| p.bulk()).collect()
}

/// Reads RESP2 headers and bulk strings off a whole reply.
struct Parser<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl Parser<'_> {
    /// The length after `kind` up to CRLF (`-1` as a nil bulk: `None` from
    /// [`Parser::bulk`]).
    fn line(&mut self, kind: u8) -> Option<i64> {
        let rest = self.buf.get(self.pos..)?;
        let (&first, rest) = rest.split_first()?;
        if first != kind {
            return None;
        }
        let end = rest.windows(2).position(|w| w == b"\r\n")?;
        let n = crate::protocol::request::parse_int(&rest[..end])?;
        self.pos += 1 + end + 2;
        Some(n)
    }

    fn header(&mut self, kind: u8) -> Option<usize> {
        usize::try_from(self.line(kind)?).ok()
    }

    /// `Some(None)` for a nil bulk.
    fn bulk(&mut self) -> Option<Option<Bytes>> {
        let n = self.line(b'$')?;
        let Ok(len) = usize::try_from(n) else {
            return Some(None);
        };
        let body = self.buf.get(self.pos..self.pos + len)?;
        if self.buf.get(self.pos + len..self.pos + len + 2)? != b"\r\n" {
            return None;
        }
        self.pos += len + 2;
        Some(Some(Bytes::copy_from_slice(body)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scan_replies_parse() {
        let r = b"*2\r\n$2\r\n17\r\n*2\r\n$3\r\na\r\nb\r\n$0\r\n\r\n";
        let (cursor, keys) = parse_scan(r).expect("parses");
        assert_eq!(cursor.as_ref(), b"17");
        assert_eq!(keys, vec![Bytes::from_static(b"a\r\nb"), Bytes::new()]);
        assert_eq!(parse_scan(b"*2\r\n$1\r\n0\r\n*0\r\n").map(|s| s.1.len()), Some(0));
        assert!(parse_scan(b"*2\r\n$1\r\n0\r\n").is_none());
        assert!(parse_scan(b"-ERR no\r\n").is_none());
    }

    #[test]
    fn mget_replies_parse() {
        let r = b"*3\r\n$1\r\n5\r\n$-1\r\n$2\r\n12\r\n";
        let v = parse_bulks(r).expect("parses");
        assert_eq!(
            v,
            vec![
                Some(Bytes::from_static(b"5")),
                None,
                Some(Bytes::from_static(b"12"))
            ]
        );
        assert!(parse_bulks(b"*2\r\n$1\r\n5\r\n").is_none());
    }

    #[test]
    fn failed_copies_back_off_and_a_new_connection_starts_over() {
        let a = Admission::new(Duration::ZERO);
        assert!(!a.is_admitted(0));
        a.require_copy(3);
        // settle is the margin alone here.
        assert!(!a.due(3));
        a.failed(3);
        assert!(!a.due(3));
        a.admit(2);
        assert!(!a.is_admitted(2), "a copy to an older connection admits nothing");
        a.admit(3);
        assert!(a.is_admitted(3));
        assert!(!a.is_admitted(4));
        a.trust(5);
        assert!(a.is_admitted(5));
    }
}
