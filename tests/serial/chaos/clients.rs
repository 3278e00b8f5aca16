//! The chaos test's client workers, all on one lock key: the legacy
//! `SETNX` / `EXPIRE` / `DEL` pattern through a pool that reconnects
//! silently, `SET k uuid NX PX` with the compare-and-delete release, and
//! `LOCKGATE LOCK`/`UNLOCK` whose token guards writes to a store that
//! refuses lower tokens. Each holder reads, increments and writes a counter
//! within its section; some are paused past their lease and woken while
//! another holder is inside, then finish late (late write, late release).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::checks::{Attempt, Journal, Kind, Outcome, Release, Section};
use super::{bulk, ints, text, Conn, Tuning};
use crate::support::rng::XorShift;

/// The one lock key every worker takes.
pub const LOCK: &str = "lock:chaos";
/// The counter each holder reads, increments and writes (`n:section`).
pub const COUNTER: &str = "chaos:counter";
/// The fenced store: the highest token accepted.
pub const FENCED: &str = "chaos:fenced";
/// Sets the counter and answers what it held, so a write that overwrote
/// someone else's is seen.
const WRITE_COUNTER: &str =
    "local p = redis.call('GET', KEYS[1]) redis.call('SET', KEYS[1], ARGV[1]) return p";
/// A per-key max-token register: a lower token than one accepted is refused.
const FENCED_WRITE: &str = "local cur = tonumber(redis.call('GET', KEYS[1]) or '0') \
     if tonumber(ARGV[1]) < cur then return {0, cur} end \
     redis.call('SET', KEYS[1], ARGV[1]) return {1, cur}";
/// The compare-and-delete release every Redis lock tutorial uses.
const RELEASE: &str =
    "if redis.call('get',KEYS[1]) == ARGV[1] then return redis.call('del',KEYS[1]) else return 0 end";
/// Longest wait for an ordinary reply (a stopped lockgate delays it).
const REPLY_WAIT: Duration = Duration::from_secs(4);
/// `WAIT` of `LOCKGATE LOCK`, ms: short, so a grant comes soon after the
/// request and its validity (counted from the request) is still ahead.
const LOCK_WAIT_MS: u64 = 400;
/// The legacy pool drops connections idle this long: after a pause the
/// next command goes on a new connection, as redis-py's pool does after
/// its connections went stale.
const POOL_IDLE: Duration = Duration::from_millis(400);

/// What the workers share.
pub struct Shared {
    /// The record.
    pub journal: Journal,
    /// Lease, drift.
    pub tuning: Tuning,
    /// The lockgates' addresses.
    pub lgs: Vec<SocketAddr>,
    /// Workers stop taking the lock then.
    pub until: Instant,
    /// Or once this is set.
    pub stop: std::sync::atomic::AtomicBool,
    /// Section ids.
    pub next_id: AtomicU64,
    /// Holders inside their section now (paused ones excluded).
    pub inside: AtomicUsize,
    /// Told whenever `inside` grows.
    pub entered: Notify,
    /// A section is paused one time in this many.
    pub pause_one_in: u64,
}

/// What one worker saw.
#[derive(Debug, Default)]
pub struct ClientReport {
    /// Its kind.
    pub kind: Option<Kind>,
    /// Grants.
    pub acquired: u64,
    /// "Not acquired" answers.
    pub not_acquired: u64,
    /// Releases answered 0.
    pub release_refused: u64,
    /// Availability losses by cause.
    pub errors: BTreeMap<String, u64>,
    /// Longest run of errors without a success in between.
    pub longest_outage: Duration,
}

/// Connections of one worker: LIFO like redis-py's pool; a broken one is
/// dropped, and with `idle`, so are connections unused that long.
struct Pool {
    addr: SocketAddr,
    conns: Vec<Conn>,
    idle: Option<Duration>,
}

impl Pool {
    async fn take(&mut self) -> Result<Conn, String> {
        if let Some(c) = self.conns.pop() {
            if self.idle.is_none_or(|i| c.used.elapsed() < i) {
                return Ok(c);
            }
            self.conns.clear();
        }
        Conn::connect(self.addr).await
    }

    /// `args` on the top connection; answers the reply and when that
    /// connection opened.
    async fn call(&mut self, args: &[&str], wait: Duration) -> Result<(Vec<u8>, Instant), String> {
        let mut c = self.take().await?;
        let reply = c.call(args, wait).await?;
        let opened = c.opened;
        self.conns.push(c);
        Ok((reply, opened))
    }

    /// `args` on a second connection while the top one is busy (the app's
    /// other thread): the pooled case, a command of the lock on a
    /// connection that did not acquire it.
    async fn call_second(
        &mut self,
        args: &[&str],
        wait: Duration,
    ) -> Result<(Vec<u8>, Instant), String> {
        let first = self.take().await;
        let reply = self.call(args, wait).await;
        if let Ok(c) = first {
            self.conns.push(c);
        }
        reply
    }
}

fn cause(e: &str) -> String {
    let e = e.to_ascii_lowercase();
    for k in [
        "no quorum",
        "unavailable",
        "timed out",
        "closed",
        "connect",
        "reset",
        "refused",
    ] {
        if e.contains(k) {
            return k.to_string();
        }
    }
    e.chars().take(60).collect()
}

/// One worker, taking `LOCK` by `kind` through lockgate `lg` until
/// `sh.until`.
pub async fn worker(id: usize, kind: Kind, lg: usize, sh: Arc<Shared>, seed: u64) -> ClientReport {
    let mut w = Worker {
        id,
        kind,
        lg,
        rng: XorShift::new(seed ^ ((id as u64 + 1) << 40)),
        pool: Pool {
            addr: sh.lgs[lg],
            conns: Vec::new(),
            idle: (kind == Kind::Legacy).then_some(POOL_IDLE),
        },
        report: ClientReport {
            kind: Some(kind),
            ..ClientReport::default()
        },
        outage: None,
        sh,
    };
    while Instant::now() < w.sh.until && !w.sh.stop.load(Ordering::Relaxed) {
        w.attempt().await;
    }
    w.report
}

struct Worker {
    id: usize,
    kind: Kind,
    lg: usize,
    rng: XorShift,
    pool: Pool,
    report: ClientReport,
    /// Since when every command failed.
    outage: Option<Instant>,
    sh: Arc<Shared>,
}

impl Worker {
    fn ok(&mut self) {
        if let Some(since) = self.outage.take() {
            self.report.longest_outage = self.report.longest_outage.max(since.elapsed());
        }
    }

    async fn error(&mut self, what: &str, e: String) {
        *self.report.errors.entry(cause(&e)).or_default() += 1;
        let now = Instant::now();
        self.outage.get_or_insert(now);
        let t = self.sh.journal.t(now);
        let line = format!("lg{} {what}: {e}", self.lg);
        self.sh.journal.with(|r| r.errors.push((t, self.id, line)));
        // Not a spin against a lockgate that is down.
        tokio::time::sleep(Duration::from_millis(self.rng.range(10, 40))).await;
    }

    async fn attempt(&mut self) {
        let t = self.sh.tuning;
        let lease = t.lease_ms.to_string();
        let value = format!("{:016x}{:016x}", self.rng.next(), self.rng.next());
        let sent = Instant::now();
        let wait = REPLY_WAIT + Duration::from_millis(LOCK_WAIT_MS);
        let wait_ms = LOCK_WAIT_MS.to_string();
        let args: Vec<&str> = match self.kind {
            Kind::Legacy => vec!["SETNX", LOCK, &value],
            Kind::SetNx => vec!["SET", LOCK, &value, "NX", "PX", &lease],
            Kind::Fence => vec!["LOCKGATE", "LOCK", LOCK, &lease, "WAIT", &wait_ms],
            // Each chaos client writes the counter under its lock: an
            // exclusive one (shared and counted locks under faults:
            // tests/it/kinds_faults.rs).
            Kind::Shared | Kind::Permit => unreachable!("chaos clients lock exclusively"),
        };
        let asked_wait = (self.kind == Kind::Fence).then(|| Duration::from_millis(LOCK_WAIT_MS));
        let (sh, client, lg) = (self.sh.clone(), self.id, self.lg);
        let record = move |outcome: Outcome| {
            let j = &sh.journal;
            let a = Attempt {
                client,
                lg,
                sent: j.t(sent),
                answered: j.t(Instant::now()),
                wait: asked_wait,
                outcome,
            };
            j.with(|r| r.attempts.push(a));
        };
        let (reply, opened) = match self.pool.call(&args, wait).await {
            Ok(r) => r,
            Err(e) => {
                record(Outcome::Failed(e.clone()));
                return self.error("acquire", e).await;
            }
        };
        let drift = Duration::from_millis(t.drift_ms);
        let grant = match (self.kind, reply.as_slice()) {
            (Kind::Legacy, b":1\r\n") | (Kind::SetNx, b"+OK\r\n") => {
                Some((None, sent + Duration::from_millis(t.lease_ms) - drift))
            }
            (Kind::Fence, r) if r.starts_with(b"*2\r\n") => match ints(r)[..] {
                [token, validity] => {
                    let v = Duration::from_millis(validity.max(0) as u64);
                    Some((Some(token), sent + v.saturating_sub(drift)))
                }
                _ => None,
            },
            _ => None,
        };
        if reply.starts_with(b"-") {
            record(Outcome::Failed(text(&reply)));
            return self.error("acquire", text(&reply)).await;
        }
        record(match grant {
            Some(_) => Outcome::Granted,
            None => Outcome::NotAcquired,
        });
        self.ok();
        let Some((token, valid_until)) = grant else {
            self.report.not_acquired += 1;
            if self.kind != Kind::Fence {
                // The app's retry delay (workload, not synchronisation).
                tokio::time::sleep(Duration::from_millis(self.rng.range(2, 20))).await;
            }
            return;
        };
        self.report.acquired += 1;
        let j = &self.sh.journal;
        let mut s = Section {
            id: self.sh.next_id.fetch_add(1, Ordering::SeqCst) + 1,
            client: self.id,
            kind: self.kind,
            lg: self.lg,
            token,
            sent: j.t(sent),
            start: j.t(Instant::now()),
            valid_until: j.t(valid_until),
            released: None,
            paused: false,
            write_done: None,
            exposed: None,
        };
        self.section(&mut s, opened, &value).await;
        self.sh.journal.with(|r| r.sections.push(s));
    }

    async fn call(&mut self, what: &str, args: &[&str]) -> Option<(Vec<u8>, Instant)> {
        match self.pool.call(args, REPLY_WAIT).await {
            Ok(r) if !r.0.starts_with(b"-") => {
                self.ok();
                Some(r)
            }
            Ok(r) => {
                self.error(what, text(&r.0)).await;
                None
            }
            Err(e) => {
                self.error(what, e).await;
                None
            }
        }
    }

    async fn section(&mut self, s: &mut Section, opened: Instant, value: &str) {
        let sh = self.sh.clone();
        sh.inside.fetch_add(1, Ordering::SeqCst);
        sh.entered.notify_waiters();
        let mut inside = true;
        if self.kind == Kind::Legacy {
            let secs = sh.tuning.lease_ms.div_ceil(1000).to_string();
            let args = ["EXPIRE", LOCK, &secs];
            // One time in three on another pooled connection.
            let r = match self.rng.one_in(3) {
                true => self.pool.call_second(&args, REPLY_WAIT).await,
                false => self.pool.call(&args, REPLY_WAIT).await,
            };
            if let Err(e) = r {
                self.error("EXPIRE", e).await;
            }
        }
        let read = self.call("GET counter", &["GET", COUNTER]).await;
        let (n, tag) = read
            .as_ref()
            .and_then(|(r, _)| bulk(r))
            .and_then(|v| {
                let (n, tag) = v.split_once(':')?;
                Some((n.parse::<u64>().ok()?, tag.to_string()))
            })
            .unwrap_or((0, "0".to_string()));
        if self.rng.one_in(sh.pause_one_in) {
            inside = false;
            sh.inside.fetch_sub(1, Ordering::SeqCst);
            self.pause(s).await;
        } else if self.rng.one_in(8) {
            // Work that takes a while, so holds span faults.
            tokio::time::sleep(Duration::from_millis(self.rng.range(10, 150))).await;
        }
        if read.is_some() {
            let v = format!("{}:{}", n + 1, s.id);
            let args = ["EVAL", WRITE_COUNTER, "1", COUNTER, &v];
            if let Some((r, _)) = self.call("write counter", &args).await {
                s.write_done = Some(sh.journal.t(Instant::now()));
                let before = bulk(&r).map_or("0".into(), |p| {
                    p.split_once(':').map_or(p.clone(), |x| x.1.to_string())
                });
                if before != tag {
                    let other = before.parse().unwrap_or(0);
                    let t = sh.journal.t(Instant::now());
                    sh.journal.with(|r| r.lost.push((s.id, other, t)));
                }
            }
        }
        if let Some(token) = s.token {
            let tk = token.to_string();
            if let Some((r, _)) = self
                .call("fenced write", &["EVAL", FENCED_WRITE, "1", FENCED, &tk])
                .await
            {
                let at = sh.journal.t(Instant::now());
                if let [accepted, prev] = ints(&r)[..] {
                    sh.journal
                        .with(|x| x.fence_writes.push((s.id, at, accepted == 1, prev)));
                }
            }
        }
        if inside {
            sh.inside.fetch_sub(1, Ordering::SeqCst);
        }
        self.release(s, opened, value).await;
    }

    /// Goes silent past the lease, then waits (bounded) until another
    /// holder is inside its section, so the late write and release land
    /// in someone else's section.
    async fn pause(&mut self, s: &mut Section) {
        let sh = self.sh.clone();
        s.paused = true;
        let ms = sh.tuning.lease_ms + self.rng.range(100, 900);
        sh.journal.fault(
            "holder paused",
            format!(
                "client {} ({:?}, section {}) pauses {ms} ms holding the lock",
                self.id, self.kind, s.id
            ),
        );
        tokio::time::sleep(Duration::from_millis(ms)).await;
        let deadline = tokio::time::Instant::now() + Duration::from_millis(2000);
        loop {
            let entered = sh.entered.notified();
            if sh.inside.load(Ordering::SeqCst) > 0 {
                break;
            }
            if tokio::time::timeout_at(deadline, entered).await.is_err() {
                break;
            }
        }
        let others = sh.inside.load(Ordering::SeqCst);
        sh.journal.note(format!(
            "client {} (section {}) wakes with {others} other holder(s) inside",
            self.id, s.id
        ));
    }

    async fn release(&mut self, s: &mut Section, opened: Instant, value: &str) {
        let sh = self.sh.clone();
        let at = Instant::now();
        s.released = Some(sh.journal.t(at));
        let tk = s.token.map(|t| t.to_string()).unwrap_or_default();
        let args: Vec<&str> = match self.kind {
            Kind::Legacy => vec!["DEL", LOCK],
            Kind::SetNx => vec!["EVAL", RELEASE, "1", LOCK, value],
            Kind::Fence => vec!["LOCKGATE", "UNLOCK", LOCK, &tk],
            Kind::Shared | Kind::Permit => unreachable!("chaos clients lock exclusively"),
        };
        let (result, acquiring_conn, conn_opened) = match self.pool.call(&args, REPLY_WAIT).await {
            Ok((r, o)) => {
                self.ok();
                if r == b":0\r\n" {
                    self.report.release_refused += 1;
                }
                (text(&r), o == opened, Some(sh.journal.t(o)))
            }
            Err(e) => {
                let shown = e.clone();
                self.error("release", e).await;
                (shown, false, None)
            }
        };
        let answered = sh.journal.t(Instant::now());
        let late = at > sh.journal.epoch + s.valid_until;
        sh.journal.with(|r| {
            r.releases.push(Release {
                t: s.released.unwrap_or_default(),
                section: s.id,
                acquiring_conn,
                conn_opened,
                answered,
                late,
                result,
            })
        });
    }
}
