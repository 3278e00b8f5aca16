//! Safety of the Redlock quorum under faults, against real `redis-server`
//! lock masters and two lockgate instances sharing them.
//!
//! * Mutual exclusion with the fencing API: 16 clients (8 per lockgate)
//!   take `lock:x` with `LOCKGATE LOCK … WAIT` thousands of times while a
//!   fault loop kills, restarts and pauses (SIGSTOP/SIGCONT) a random
//!   minority of the 5 masters; every acquisition, critical section and
//!   release is recorded, and the one checker over histories
//!   (`tests/support/history.rs`) judges the whole run: no two valid
//!   sections overlap, no lost update between them, fencing tokens grow in
//!   acquisition order (starved `WAIT` runs are printed), and
//!   no client may see an error (never more than 2 masters are disturbed,
//!   counting a restarted master as disturbed until both lockgates have
//!   sat it out and counted it again). Besides random single faults, the
//!   loop now and then restarts two masters together and, the moment both
//!   count again, restarts a third: holders that took the lock while the
//!   two sat out hold it on exactly 3 masters then, the case a restarted
//!   master voting too early turns into two holders (some critical
//!   sections last 50–300 ms so that holds span those moments).
//! * The same with plain `SET k uuid NX PX` and the compare-and-delete
//!   `EVAL` release of the redis.io pattern.
//! * A restarted master must not take part in an acquisition before it has
//!   sat out its rejoin delay, not even for the moment between lockgate's
//!   reconnection and its noticing the restart, nor when it restarts right
//!   after lockgate first connected to it.
//! * redis-py's `Lock` and pottery's `Redlock` through the quorum
//!   (`tests/py/quorum_clients.py`).
//!
//! Each fault test runs its workload for a fixed time, and longer if the
//! minimum number of acquisitions is not reached yet (up to 30 s more).
//! Knobs for a longer soak (defaults in brackets): `QUORUM_SAFETY_SEED`,
//! `QUORUM_SAFETY_SECS` [25 s of `LOCKGATE LOCK` workload],
//! `QUORUM_SAFETY_ACQUISITIONS` [2000, the least it must reach],
//! `QUORUM_SAFETY_SET_SECS` [20 s of `SET NX` workload],
//! `QUORUM_SAFETY_SET_ACQUISITIONS` [500], `QUORUM_SAFETY_FAULTS` [most
//! faults injected per test, 400], `QUORUM_SAFETY_NODE_TIMEOUT_MS` [200:
//! lockgate's per-master timeout in the fault tests; its default of 50 ms
//! turns any 50 ms stall of a shared, loaded test machine into
//! "lock quorum unavailable" while 3 masters are up].

use crate::support;
use crate::SERIAL;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lockgate::lock::quorum::MasterState;
use lockgate::{Config, ServerContext};
use support::history::{self, Attempt, Outcome, Release, Section};
use support::process::signal;
use support::rng::{env_u64, XorShift};
use support::{eventually, Lockgate, RawClient, RedisServer, WAIT};

// The tests here each drive several redis-servers hard on a small machine:
// each takes `SERIAL` (tests/serial/main.rs) first.

/// Lease of every acquisition in the fault tests, ms.
const LEASE_MS: u64 = 2000;
/// How long a returning master sits out: twice the lease.
const REJOIN_MS: u64 = 2 * LEASE_MS;
/// `WAIT` of each `LOCKGATE LOCK`, ms.
const LOCK_WAIT_MS: u64 = 5000;
/// Most masters disturbed at once (of 5: a majority always stays).
const MAX_DISTURBED: usize = 2;
/// The compare-and-delete release every Redis lock tutorial uses.
const RELEASE: &str = r#"if redis.call("get",KEYS[1]) == ARGV[1] then return redis.call("del",KEYS[1]) else return 0 end"#;

/// The run's parameters (environment, or defaults that fit in ~60 s).
#[derive(Debug, Clone, Copy)]
struct Plan {
    seed: u64,
    acquisitions: u64,
    set_acquisitions: u64,
    faults: u64,
    secs: u64,
    set_secs: u64,
    node_timeout_ms: u64,
}

impl Plan {
    fn from_env() -> Plan {
        let plan = Plan {
            seed: env_u64("QUORUM_SAFETY_SEED", 0x10c6_a7e5_eed5),
            acquisitions: env_u64("QUORUM_SAFETY_ACQUISITIONS", 2000),
            set_acquisitions: env_u64("QUORUM_SAFETY_SET_ACQUISITIONS", 500),
            faults: env_u64("QUORUM_SAFETY_FAULTS", 400),
            secs: env_u64("QUORUM_SAFETY_SECS", 25),
            set_secs: env_u64("QUORUM_SAFETY_SET_SECS", 20),
            node_timeout_ms: env_u64("QUORUM_SAFETY_NODE_TIMEOUT_MS", 200),
        };
        println!(
            "quorum_safety plan: {plan:?} (QUORUM_SAFETY_SEED={})",
            plan.seed
        );
        plan
    }
}

// ---------------------------------------------------------------- cluster

/// A primary, N lock masters and lockgates with the quorum over them.
struct Cluster {
    primary: RedisServer,
    masters: Vec<RedisServer>,
    lockgates: Vec<Lockgate>,
}

fn quorum_config(primary: &RedisServer, masters: &[RedisServer], instance: &str) -> Config {
    let mut c = Config::default();
    c.upstream.addr = primary.addr();
    c.locks.instance_id = instance.to_string();
    c.locks.quorum.masters = masters.iter().map(|m| m.addr()).collect();
    c.locks.quorum.rejoin_delay_ms = REJOIN_MS;
    c
}

impl Cluster {
    async fn start(masters: usize, lockgates: usize, rejoin_ms: u64) -> Cluster {
        Cluster::start_with(masters, lockgates, rejoin_ms, 50).await
    }

    async fn start_with(
        masters: usize,
        lockgates: usize,
        rejoin_ms: u64,
        node_timeout_ms: u64,
    ) -> Cluster {
        let primary = RedisServer::start();
        let masters: Vec<RedisServer> = (0..masters).map(|_| RedisServer::start()).collect();
        let mut gates = Vec::new();
        for i in 0..lockgates {
            let mut config = quorum_config(&primary, &masters, &format!("lg{i}"));
            config.locks.quorum.rejoin_delay_ms = rejoin_ms;
            config.locks.quorum.node_timeout_ms = node_timeout_ms;
            gates.push(Lockgate::start_with(config).await);
        }
        let cluster = Cluster {
            primary,
            masters,
            lockgates: gates,
        };
        let ctxs = cluster.ctxs();
        eventually("every lockgate connected to every master", || {
            ctxs.iter()
                .all(|c| states(c).iter().all(|s| *s == MasterState::Up))
        })
        .await;
        cluster
    }

    fn ctxs(&self) -> Vec<Arc<ServerContext>> {
        self.lockgates.iter().map(|l| l.ctx.clone()).collect()
    }
}

/// Each master's state as one lockgate sees it.
fn states(ctx: &ServerContext) -> Vec<MasterState> {
    ctx.locks
        .quorum()
        .expect("lockgate runs with the quorum")
        .masters
        .iter()
        .map(|m| m.state())
        .collect()
}

// ------------------------------------------------------------ fault loop

/// Sends SIGCONT to every process it still lists when dropped, so no
/// master stays stopped whatever happens to the test.
#[derive(Default)]
struct ResumeGuard(Vec<u32>);

impl ResumeGuard {
    fn stop(&mut self, pid: u32) {
        self.0.push(pid);
        signal(pid, "-STOP");
    }

    fn resume(&mut self, pid: u32) {
        self.0.retain(|&p| p != pid);
        signal(pid, "-CONT");
    }
}

impl Drop for ResumeGuard {
    fn drop(&mut self) {
        for pid in self.0.drain(..) {
            let _ = Command::new("kill")
                .arg("-CONT")
                .arg(pid.to_string())
                .status();
        }
    }
}

/// What is being done to one master.
#[derive(Debug)]
enum Fault {
    /// SIGSTOPped (pid) until then.
    Paused(u32, Instant),
    /// Killed; restarted (empty) then.
    Down(Instant),
    /// Restarted: disturbed until every lockgate has sat it out (seen
    /// `SittingOut`) and counted it again (`Up`).
    Rejoining {
        since: Instant,
        sat_out: Vec<bool>,
        back: Vec<bool>,
    },
}

/// What the fault loop did.
#[derive(Debug, Default)]
struct FaultReport {
    pauses: u64,
    kills: u64,
    restarts_in_place: u64,
    most_disturbed_at_once: usize,
    /// `t+ms event` lines, for failure messages.
    timeline: Vec<String>,
}

impl FaultReport {
    fn injected(&self) -> u64 {
        self.pauses + self.kills + self.restarts_in_place
    }
}

/// Disturbs a random minority (at most [`MAX_DISTURBED`] at once) of
/// `masters` until `stop` is set, `plan.faults` faults were injected or
/// `deadline` passed; then resumes and restarts what it disturbed (without
/// waiting for rejoins) and hands the masters back.
fn fault_loop(
    mut masters: Vec<RedisServer>,
    ctxs: Vec<Arc<ServerContext>>,
    plan: Plan,
    epoch: Instant,
    deadline: Instant,
    stop: Arc<AtomicBool>,
) -> (Vec<RedisServer>, FaultReport) {
    let mut rng = XorShift::new(plan.seed);
    let mut guard = ResumeGuard::default();
    let mut report = FaultReport::default();
    let mut active: BTreeMap<usize, Fault> = BTreeMap::new();
    let mut next_fault = Instant::now() + Duration::from_millis(200);
    // Two masters restarted together: nothing else happens until both are
    // back, then a third one is restarted at once (a holder that took the
    // lock while the two sat out then holds it on exactly 3 masters).
    let mut pair: Option<[usize; 2]> = None;
    // A pair restart is due once nothing is disturbed any more.
    let mut want_pair = false;
    let rejoin_bound = Duration::from_millis(REJOIN_MS) + WAIT;
    let at = |epoch: Instant| epoch.elapsed().as_millis();
    loop {
        let now = Instant::now();
        let ending =
            stop.load(Ordering::SeqCst) || now >= deadline || report.injected() >= plan.faults;
        // Move every fault along.
        let mut done = Vec::new();
        for (&i, fault) in active.iter_mut() {
            match fault {
                Fault::Paused(pid, until) if ending || now >= *until => {
                    guard.resume(*pid);
                    report
                        .timeline
                        .push(format!("t+{} SIGCONT m{i}", at(epoch)));
                    done.push(i);
                }
                Fault::Down(until) if ending || now >= *until => {
                    masters[i].restart();
                    report
                        .timeline
                        .push(format!("t+{} restarted m{i} (empty)", at(epoch)));
                    *fault = Fault::Rejoining {
                        since: Instant::now(),
                        sat_out: vec![false; ctxs.len()],
                        back: vec![false; ctxs.len()],
                    };
                }
                Fault::Rejoining {
                    since,
                    sat_out,
                    back,
                } => {
                    for (g, ctx) in ctxs.iter().enumerate() {
                        match states(ctx)[i] {
                            MasterState::SittingOut(..) => sat_out[g] = true,
                            MasterState::Up if sat_out[g] => back[g] = true,
                            _ => {}
                        }
                    }
                    if back.iter().all(|&b| b) {
                        report
                            .timeline
                            .push(format!("t+{} m{i} rejoined on every lockgate", at(epoch)));
                        done.push(i);
                        // The moment a master counts again is when holders
                        // that took the lock without it are most exposed:
                        // disturb another one right away.
                        next_fault = now;
                    } else if since.elapsed() > rejoin_bound {
                        let seen: Vec<_> = ctxs.iter().map(|c| states(c)[i].clone()).collect();
                        panic!(
                            "master {i} restarted {:?} ago and has not rejoined on every lockgate \
                             (sat out: {sat_out:?}, back: {back:?}, states now: {seen:?})\n{}",
                            since.elapsed(),
                            report.timeline.join("\n")
                        );
                    }
                }
                _ => {}
            }
        }
        for i in done {
            active.remove(&i);
        }
        if ending {
            // Paused and killed masters are back; only rejoins may be left.
            if active
                .values()
                .all(|f| matches!(f, Fault::Rejoining { .. }))
            {
                break;
            }
        } else if active.len() < MAX_DISTURBED
            && now >= next_fault
            && !pair.is_some_and(|p| p.iter().any(|i| active.contains_key(i)))
            && (!want_pair || active.is_empty())
        {
            let free: Vec<usize> = (0..masters.len())
                .filter(|i| !active.contains_key(i) && !pair.is_some_and(|p| p.contains(i)))
                .collect();
            let i = free[rng.range(0, free.len() as u64 - 1) as usize];
            // 0, 1: pause; 2: kill, restart later; 3: restart at once;
            // 4: (once nothing else is disturbed) restart a pair.
            let kind = match (pair.take(), want_pair, rng.range(0, 4)) {
                (Some(_), _, _) => 3,
                (None, true, _) => 4,
                (None, false, 4) => {
                    want_pair = true;
                    continue;
                }
                (None, false, k) => k,
            };
            want_pair = false;
            if kind == 4 {
                // Two at once: they sit out, and come back, together.
                let j = loop {
                    let j = free[rng.range(0, free.len() as u64 - 1) as usize];
                    if j != i {
                        break j;
                    }
                };
                masters[i].stop();
                masters[j].stop();
                report.restarts_in_place += 2;
                report.timeline.push(format!(
                    "t+{} SIGKILL m{i} and m{j}, restart both at once",
                    at(epoch)
                ));
                active.insert(i, Fault::Down(now));
                active.insert(j, Fault::Down(now));
                pair = Some([i, j]);
                report.most_disturbed_at_once = report.most_disturbed_at_once.max(active.len());
                next_fault = Instant::now() + Duration::from_millis(rng.range(50, 700));
                continue;
            }
            let fault = match kind {
                0 | 1 => {
                    let pid = masters[i].pid();
                    let ms = rng.range(100, 1200);
                    guard.stop(pid);
                    report.pauses += 1;
                    report
                        .timeline
                        .push(format!("t+{} SIGSTOP m{i} for {ms} ms", at(epoch)));
                    Fault::Paused(pid, now + Duration::from_millis(ms))
                }
                2 => {
                    let ms = rng.range(50, 1500);
                    masters[i].stop();
                    report.kills += 1;
                    report
                        .timeline
                        .push(format!("t+{} SIGKILL m{i}, down {ms} ms", at(epoch)));
                    Fault::Down(now + Duration::from_millis(ms))
                }
                _ => {
                    masters[i].stop();
                    report.restarts_in_place += 1;
                    report
                        .timeline
                        .push(format!("t+{} SIGKILL m{i}, restart at once", at(epoch)));
                    Fault::Down(now)
                }
            };
            active.insert(i, fault);
            report.most_disturbed_at_once = report.most_disturbed_at_once.max(active.len());
            // The pause between two faults is part of the workload.
            next_fault = Instant::now() + Duration::from_millis(rng.range(50, 700));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(guard);
    (masters, report)
}

/// Sets the stop flag when dropped, so a failing test ends its fault loop.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

// ------------------------------------------------------------ the history

/// The data the locks protect: a counter and the section that wrote it
/// last. Each section reads it, yields (and may hold on), and writes it
/// back one higher; a write that finds another section's in between is a
/// lost update, which the checker judges ([`history::judge`]).
#[derive(Default)]
struct Resource(Mutex<(u64, u64)>);

/// A grant, its critical section on the resource, recorded as a
/// [`Section`] in the journal (its release is recorded by the caller,
/// which sends it): `sent` when the acquiring command went, `valid_until`
/// the lease's end as the client computes it. Returns the section.
async fn critical_section(
    w: &Workload,
    (client, kind, token): (usize, history::Kind, Option<i64>),
    sent: Instant,
    valid_until: Instant,
    hold: Duration,
) -> Section {
    let j = &w.journal;
    let id = w.next_id.fetch_add(1, Ordering::SeqCst) + 1;
    let start = j.t(Instant::now());
    let (v, last) = *w.resource.0.lock().expect("resource");
    tokio::task::yield_now().await;
    if !hold.is_zero() {
        tokio::time::sleep(hold).await;
    }
    {
        let mut r = w.resource.0.lock().expect("resource");
        if r.1 != last {
            let (other, at) = (r.1, j.t(Instant::now()));
            j.with(|rec| rec.lost.push((id, other, at)));
        }
        *r = (v + 1, id);
    }
    Section {
        id,
        client,
        kind,
        lg: client % 2,
        token,
        sent: j.t(sent),
        start,
        valid_until: j.t(valid_until),
        released: None,
        paused: false,
        write_done: Some(j.t(Instant::now())),
        exposed: None,
    }
}

/// Records `s`, released by a command sent at `sent` on the acquiring
/// connection and answered `result`, and the acquisition attempt before.
fn record(w: &Workload, mut s: Section, sent: Instant, result: &[u8]) {
    let j = &w.journal;
    s.released = Some(j.t(sent));
    let release = Release {
        t: j.t(sent),
        section: s.id,
        acquiring_conn: true,
        conn_opened: Some(Duration::ZERO),
        answered: j.t(Instant::now()),
        late: j.t(sent) > s.valid_until,
        result: text(result).trim().to_string(),
    };
    j.with(|r| {
        r.sections.push(s);
        r.releases.push(release);
    });
}

/// Records an acquisition attempt of `client` sent at `sent`.
fn attempt(w: &Workload, client: usize, sent: Instant, wait: Option<Duration>, outcome: Outcome) {
    let j = &w.journal;
    let a = Attempt {
        client,
        lg: client % 2,
        sent: j.t(sent),
        answered: j.t(Instant::now()),
        wait,
        outcome,
    };
    j.with(|r| r.attempts.push(a));
}

// ----------------------------------------------------------------- clients

/// What one client saw.
#[derive(Debug, Default)]
struct ClientReport {
    acquired: u64,
    not_acquired: u64,
    release_refused: u64,
    errors: Vec<String>,
}

#[derive(Debug)]
enum LockReply {
    Granted(i64, i64),
    Nil,
    Error(String),
}

fn text(raw: &[u8]) -> String {
    String::from_utf8_lossy(raw).into_owned()
}

fn is_nil(raw: &[u8]) -> bool {
    matches!(raw, b"$-1\r\n" | b"*-1\r\n" | b"_\r\n")
}

/// The payload of a bulk reply, `None` for nil (or anything else).
fn bulk(raw: &[u8]) -> Option<String> {
    let t = text(raw);
    let (head, rest) = t.strip_prefix('$')?.split_once("\r\n")?;
    let n: usize = head.parse().ok()?;
    rest.get(..n).map(str::to_string)
}

fn ints(raw: &[u8]) -> Vec<i64> {
    text(raw)
        .split("\r\n")
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|n| n.parse().ok())
        .collect()
}

fn parse_lock(raw: &[u8]) -> LockReply {
    if is_nil(raw) {
        return LockReply::Nil;
    }
    if raw.starts_with(b"*2\r\n") {
        if let [token, validity] = ints(raw)[..] {
            return LockReply::Granted(token, validity);
        }
    }
    LockReply::Error(text(raw))
}

/// Shared by the clients of one test.
struct Workload {
    journal: history::Journal,
    resource: Resource,
    next_id: AtomicU64,
    acquired: AtomicU64,
    target: u64,
    /// Run at least until then…
    until: Instant,
    /// …and on until `target` is reached, but never past this.
    hard: Instant,
    /// The lockgates (client `id` uses `id % 2`), for error context.
    ctxs: Vec<Arc<ServerContext>>,
}

impl Workload {
    fn more(&self) -> bool {
        let now = Instant::now();
        now < self.hard && (now < self.until || self.acquired.load(Ordering::SeqCst) < self.target)
    }

    /// An error line: when, who, what, and the masters as the client's
    /// lockgate saw them then (state, calls timed out so far).
    fn error(&self, id: usize, what: String) -> String {
        let g = id % self.ctxs.len();
        let ctx = &self.ctxs[g];
        let masters: Vec<String> = ctx
            .locks
            .quorum()
            .map(|q| {
                q.masters
                    .iter()
                    .enumerate()
                    .map(|(i, m)| {
                        let state = match m.state() {
                            MasterState::SittingOut(..) => "sitting out".to_string(),
                            s => format!("{s:?}"),
                        };
                        let timeouts = m.node.state.timeouts.load(Ordering::Relaxed);
                        format!("m{i} {state} ({timeouts} timeouts)")
                    })
                    .collect()
            })
            .unwrap_or_default();
        format!(
            "t+{} client {id} via lg{g}: {what} [lg{g} now: {}]",
            self.journal.epoch.elapsed().as_millis(),
            masters.join(", ")
        )
    }
}

/// How long a critical section holds on: mostly not at all, one in 20
/// for 50–300 ms (so some holds span a fault's moments).
fn hold(rng: &mut XorShift) -> Duration {
    match rng.range(0, 19) {
        0 => Duration::from_millis(rng.range(50, 300)),
        _ => Duration::ZERO,
    }
}

/// `LOCKGATE LOCK lock:x … WAIT`, critical section, `LOCKGATE UNLOCK`.
async fn fence_client(
    id: usize,
    lg: std::net::SocketAddr,
    w: Arc<Workload>,
    seed: u64,
) -> ClientReport {
    let mut c = RawClient::connect(lg).await;
    let mut r = ClientReport::default();
    let mut rng = XorShift::new(seed ^ ((id as u64) << 32));
    let (lease, wait) = (LEASE_MS.to_string(), LOCK_WAIT_MS.to_string());
    while w.more() {
        let sent = Instant::now();
        let reply = c
            .call_raw(&["LOCKGATE", "LOCK", "lock:x", &lease, "WAIT", &wait])
            .await;
        let waited = Some(Duration::from_millis(LOCK_WAIT_MS));
        match parse_lock(&reply) {
            LockReply::Granted(token, validity) => {
                attempt(&w, id, sent, waited, Outcome::Granted);
                w.acquired.fetch_add(1, Ordering::SeqCst);
                r.acquired += 1;
                let valid_until = sent + Duration::from_millis(validity.max(0) as u64);
                let who = (id, history::Kind::Fence, Some(token));
                let section = critical_section(&w, who, sent, valid_until, hold(&mut rng)).await;
                let t = token.to_string();
                let released = Instant::now();
                let reply = c.call_raw(&["LOCKGATE", "UNLOCK", "lock:x", &t]).await;
                record(&w, section, released, &reply);
                match reply.as_slice() {
                    b":1\r\n" => {}
                    b":0\r\n" => r.release_refused += 1,
                    other => r
                        .errors
                        .push(w.error(id, format!("UNLOCK {t} -> {}", text(other).trim()))),
                }
            }
            LockReply::Nil => {
                attempt(&w, id, sent, waited, Outcome::NotAcquired);
                r.not_acquired += 1
            }
            LockReply::Error(e) => {
                attempt(&w, id, sent, waited, Outcome::Failed(e.trim().to_string()));
                r.errors.push(w.error(id, format!("LOCK -> {}", e.trim())))
            }
        }
    }
    r
}

/// `SET lock:y <uuid> NX PX`, critical section, compare-and-delete `EVAL`.
async fn set_client(
    id: usize,
    lg: std::net::SocketAddr,
    w: Arc<Workload>,
    seed: u64,
) -> ClientReport {
    let mut c = RawClient::connect(lg).await;
    let mut r = ClientReport::default();
    let mut rng = XorShift::new(seed ^ ((id as u64) << 32));
    let lease = LEASE_MS.to_string();
    // What Redlock subtracts for drift, and a round trip's worth of slack.
    let drift = Duration::from_millis(LEASE_MS / 100 + 2);
    let lease_d = Duration::from_millis(LEASE_MS);
    while w.more() {
        let value = format!("{:016x}{:016x}", rng.next(), rng.next());
        let sent = Instant::now();
        let reply = c
            .call_raw(&["SET", "lock:y", &value, "NX", "PX", &lease])
            .await;
        if reply == b"+OK\r\n" {
            attempt(&w, id, sent, None, Outcome::Granted);
            w.acquired.fetch_add(1, Ordering::SeqCst);
            r.acquired += 1;
            let valid_until = sent + lease_d - drift;
            let who = (id, history::Kind::SetNx, None);
            let section = critical_section(&w, who, sent, valid_until, hold(&mut rng)).await;
            let released = Instant::now();
            let reply = c.call_raw(&["EVAL", RELEASE, "1", "lock:y", &value]).await;
            record(&w, section, released, &reply);
            match reply.as_slice() {
                b":1\r\n" => {}
                b":0\r\n" => r.release_refused += 1,
                other => r
                    .errors
                    .push(w.error(id, format!("EVAL release -> {}", text(other).trim()))),
            }
        } else if is_nil(&reply) {
            attempt(&w, id, sent, None, Outcome::NotAcquired);
            r.not_acquired += 1;
            // Redlock's random retry delay (the workload, not a wait).
            tokio::time::sleep(Duration::from_millis(rng.range(1, 6))).await;
        } else {
            let e = text(&reply).trim().to_string();
            attempt(&w, id, sent, None, Outcome::Failed(e.clone()));
            r.errors.push(w.error(id, format!("SET NX -> {e}")));
        }
    }
    r
}

#[derive(Clone, Copy)]
enum Kind {
    Fence,
    Set,
}

/// Runs 16 clients (8 per lockgate) of `kind` against a 5-master quorum
/// while the fault loop runs, then checks the detector's findings.
async fn under_faults(kind: Kind, plan: Plan, secs: u64, target: u64) {
    let cluster = Cluster::start_with(5, 2, REJOIN_MS, plan.node_timeout_ms).await;
    let epoch = Instant::now();
    let workload = Arc::new(Workload {
        journal: history::Journal::new(),
        resource: Resource::default(),
        next_id: AtomicU64::new(0),
        acquired: AtomicU64::new(0),
        target,
        until: epoch + Duration::from_secs(secs),
        hard: epoch + Duration::from_secs(secs + 30),
        ctxs: cluster.ctxs(),
    });
    let hard = workload.hard;
    let Cluster {
        primary,
        masters,
        lockgates,
    } = cluster;
    let ctxs: Vec<_> = lockgates.iter().map(|l| l.ctx.clone()).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let _stop_guard = StopOnDrop(stop.clone());
    let faults = {
        let stop = stop.clone();
        std::thread::spawn(move || fault_loop(masters, ctxs, plan, epoch, hard, stop))
    };
    let mut tasks = Vec::new();
    for id in 0..16 {
        let lg = lockgates[id % 2].addr;
        let w = workload.clone();
        tasks.push(tokio::spawn(async move {
            match kind {
                Kind::Fence => fence_client(id, lg, w, plan.seed).await,
                Kind::Set => set_client(id, lg, w, plan.seed).await,
            }
        }));
    }
    let mut reports = Vec::new();
    for t in tasks {
        reports.push(t.await.expect("client task"));
    }
    let elapsed = epoch.elapsed();
    stop.store(true, Ordering::SeqCst);
    let joined = tokio::task::spawn_blocking(move || faults.join())
        .await
        .expect("join the fault loop");
    let (masters, faults) = match joined {
        Ok(done) => done,
        Err(panic) => std::panic::resume_unwind(panic),
    };

    let mut records = workload.journal.with(std::mem::take);
    // The fault loop's timeline (lines "t+<ms> …", from the same start),
    // for the checker's liveness rule: a starved run near a fault is the
    // fault's doing.
    records
        .faults
        .extend(faults.timeline.iter().filter_map(|line| {
            let ms: u64 = line.strip_prefix("t+")?.split(' ').next()?.parse().ok()?;
            Some((Duration::from_millis(ms), line.clone()))
        }));
    let verdict = history::judge(&records);
    let max_token = records.sections.iter().filter_map(|s| s.token).max();
    // Holders whose write came after their lease (not a lock failure: the
    // checker holds only valid sections to anything).
    let outlived = records
        .sections
        .iter()
        .filter(|s| s.write_done.is_some_and(|w| w > s.valid_until))
        .count();
    let acquired: u64 = reports.iter().map(|r| r.acquired).sum();
    let not_acquired: u64 = reports.iter().map(|r| r.not_acquired).sum();
    let refused: u64 = reports.iter().map(|r| r.release_refused).sum();
    let errors: Vec<&String> = reports.iter().flat_map(|r| &r.errors).collect();
    let name = match kind {
        Kind::Fence => "LOCKGATE LOCK/UNLOCK",
        Kind::Set => "SET NX PX / EVAL release",
    };
    println!(
        "{name}: {acquired} acquisitions in {:.1} s ({not_acquired} not acquired, {refused} releases \
         refused, {} errors); faults: {} injected ({} SIGSTOP, {} kill+restart later, {} restart at \
         once), at most {} masters disturbed at once; max token {}; {} sections; {} lease(s) \
         outlived by their holder; seed {}",
        elapsed.as_secs_f64(),
        errors.len(),
        faults.injected(),
        faults.pauses,
        faults.kills,
        faults.restarts_in_place,
        faults.most_disturbed_at_once,
        match kind {
            Kind::Fence => format!("{max_token:?}"),
            Kind::Set => "n/a".to_string(),
        },
        records.sections.len(),
        outlived,
        plan.seed
    );
    let timeline = faults.timeline.join("\n");
    println!("fault timeline:\n{timeline}");
    // Starved runs near a fault are reported; away from faults they fail.
    let starved: Vec<&String> = verdict
        .starved
        .iter()
        .chain(&verdict.starved_in_faults)
        .collect();
    if !starved.is_empty() {
        println!(
            "{name}: liveness: {} starved WAIT runs away from faults, {} near them (>= {:?}):\n{}",
            verdict.starved.len(),
            verdict.starved_in_faults.len(),
            history::STARVED_SPAN,
            starved[..starved.len().min(5)]
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    assert!(
        verdict.starved.is_empty(),
        "WAITs starved away from faults (seed {}):\n{}\nfault timeline:\n{timeline}",
        plan.seed,
        verdict.starved.join("\n")
    );
    assert!(
        verdict.clean(),
        "safety violation(s) (seed {}):\n{}\nfault timeline:\n{timeline}",
        plan.seed,
        verdict.first(20)
    );
    assert!(
        errors.is_empty(),
        "{} client error(s) although at most {MAX_DISTURBED} of 5 masters were ever disturbed \
         (seed {}):\n{}\nfault timeline:\n{timeline}",
        errors.len(),
        plan.seed,
        errors
            .iter()
            .take(20)
            .map(|e| e.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
    // Lost updates are the checker's (between valid sections a failure,
    // else excused); every grant is in the history it judged.
    assert_eq!(
        records.sections.len() as u64,
        acquired,
        "every grant recorded as a section"
    );
    assert!(
        acquired >= target,
        "only {acquired} of {target} acquisitions in {:?} (seed {})\nfault timeline:\n{timeline}",
        elapsed,
        plan.seed
    );
    assert!(
        faults.injected() >= 5,
        "the fault loop injected only {} faults\n{timeline}",
        faults.injected()
    );
    for lg in lockgates {
        lg.stop().await;
    }
    drop((masters, primary));
}

/// 16 clients through 2 lockgates, ≥ 2000 `LOCKGATE LOCK` acquisitions of
/// one key while a random minority of 5 masters is killed, restarted and
/// paused: never two holders, tokens strictly increasing, no client error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fencing_locks_stay_exclusive_and_ordered_under_minority_faults() {
    let _serial = SERIAL.lock().await;
    let plan = Plan::from_env();
    under_faults(Kind::Fence, plan, plan.secs, plan.acquisitions).await;
}

/// The redis.io pattern (`SET k uuid NX PX`, compare-and-delete `EVAL`)
/// through 2 lockgates under the same faults: never two holders.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn set_nx_locks_stay_exclusive_under_minority_faults() {
    let _serial = SERIAL.lock().await;
    let plan = Plan::from_env();
    under_faults(Kind::Set, plan, plan.set_secs, plan.set_acquisitions).await;
}

// ------------------------------------------------------------ rejoin race

/// The keys a master holds of `key`'s lock and fence counter, for messages.
async fn on_master(m: &RedisServer, key: &str) -> String {
    let mut d = RawClient::connect(m.addr()).await;
    let v = d.call_raw(&["GET", key]).await;
    let counter = format!("lockgate:fence:{{{key}}}");
    let c = d.call_raw(&["GET", &counter]).await;
    format!("{}: {key}={:?} counter={:?}", m.addr(), bulk(&v), bulk(&c))
}

/// A master restarted empty must sit out acquisitions from the moment
/// lockgate reconnects to it: a holder's lock lives on masters A and B of 3
/// (C was sitting out when it was taken; C has rejoined since); A is then
/// restarted empty. Counting A before the watcher has marked it would give
/// a second client A + C, a majority, while the first one still holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn restarted_master_never_votes_before_sitting_out() {
    let _serial = SERIAL.lock().await;
    const LEASE: u64 = 3000;
    let Cluster {
        primary,
        mut masters,
        lockgates,
    } = Cluster::start(3, 1, LEASE).await;
    let ctx = lockgates[0].ctx.clone();
    let lg = lockgates[0].addr;
    let key = "lock:rejoin";
    let lease = LEASE.to_string();

    // Not the moment right after startup (that is
    // master_restarted_right_after_lockgate_connected_still_sits_out's).
    tokio::time::sleep(Duration::from_millis(200)).await;
    // C (index 2) restarts and sits out.
    masters[2].restart();
    eventually("C sits out after its restart", || {
        matches!(states(&ctx)[2], MasterState::SittingOut(..))
    })
    .await;
    let sat_out_at = Instant::now();
    // A second into C's sit-out, the holder takes the lock on A and B: its
    // lease then ends a second after C is back.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let mut holder = RawClient::connect(lg).await;
    let sent = Instant::now();
    let reply = holder.call_raw(&["LOCKGATE", "LOCK", key, &lease]).await;
    let LockReply::Granted(token, validity) = parse_lock(&reply) else {
        panic!("the holder's LOCK failed: {}", text(&reply));
    };
    let valid_until = sent + Duration::from_millis(validity as u64);
    let c_state = on_master(&masters[2], key).await;
    assert!(
        c_state.contains(&format!("{key}=None")),
        "C took part while sitting out: {c_state}"
    );
    eventually("C counted again after its sit-out", || {
        states(&ctx)[2] == MasterState::Up
    })
    .await;
    assert!(
        sat_out_at.elapsed() >= Duration::from_millis(LEASE - 100),
        "C came back after {:?}, before its {LEASE} ms rejoin delay",
        sat_out_at.elapsed()
    );
    assert!(
        Instant::now() + Duration::from_millis(500) < valid_until,
        "the holder's lease is too close to its end for the check"
    );

    // Contenders try all the while A restarts, until lockgate has A sitting
    // out (or the holder's lease nears its end). A contender that gets the
    // lock keeps it (an UNLOCK with a duplicate token would delete the
    // holder's lock too and blur what happened).
    let done = Arc::new(AtomicBool::new(false));
    let mut contenders = Vec::new();
    for _ in 0..4 {
        let (done, lease, ctx) = (done.clone(), lease.clone(), ctx.clone());
        contenders.push(tokio::spawn(async move {
            let mut c = RawClient::connect(lg).await;
            let mut attempts = 0u64;
            while !done.load(Ordering::SeqCst) {
                attempts += 1;
                let reply = c.call_raw(&["LOCKGATE", "LOCK", key, &lease]).await;
                if let LockReply::Granted(t, _) = parse_lock(&reply) {
                    let a_seen = states(&ctx)[0].clone();
                    return (attempts, Some((t, Instant::now(), a_seen)));
                }
                // Nil, or an error while A is down a moment: not the point.
            }
            (attempts, None)
        }));
    }
    let restart_at = Instant::now();
    let mut a = masters.remove(0);
    let a = tokio::task::spawn_blocking(move || {
        a.restart();
        a
    })
    .await
    .expect("restart A");
    masters.insert(0, a);
    let marked = {
        let deadline = valid_until - Duration::from_millis(200);
        loop {
            if matches!(states(&ctx)[0], MasterState::SittingOut(..)) {
                break true;
            }
            if Instant::now() >= deadline {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    // A few more attempts with A marked, then stop.
    tokio::time::sleep(Duration::from_millis(50)).await;
    done.store(true, Ordering::SeqCst);
    let mut attempts = 0;
    let mut grants = Vec::new();
    for c in contenders {
        let (n, g) = c.await.expect("contender");
        attempts += n;
        if let Some((t, when, a_seen)) = g {
            if when < valid_until {
                grants.push(format!(
                    "token {t} at {} ms after A's restart began (lockgate saw A as {a_seen:?})",
                    (when - restart_at).as_millis()
                ));
            }
        }
    }
    let mut stores = Vec::new();
    for m in &masters {
        stores.push(on_master(m, key).await);
    }
    println!(
        "rejoin race: holder token {token}; {attempts} contending attempts while A restarted; \
         A marked sitting out: {marked}; grants during the holder's lease: {grants:?}"
    );
    assert!(
        marked,
        "lockgate never marked the restarted master A as sitting out"
    );
    assert!(
        grants.is_empty(),
        "SAFETY: {} acquisition(s) granted while the holder (token {token}) still had {} ms of \
         its lease: the restarted, empty master A voted before lockgate marked it sitting out \
         (A + C are a majority of 3):\n{}\nmasters now (A, B, C):\n{}",
        grants.len(),
        valid_until
            .saturating_duration_since(Instant::now())
            .as_millis(),
        grants.join("\n"),
        stores.join("\n")
    );
    for lg in lockgates {
        lg.stop().await;
    }
    drop((masters, primary));
}

/// Only a master's very first connection is trusted without a sit-out: a
/// master that restarts right after lockgate first connected to it (before
/// any periodic look at the masters) must sit out too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn master_restarted_right_after_lockgate_connected_still_sits_out() {
    let _serial = SERIAL.lock().await;
    let Cluster {
        primary,
        mut masters,
        lockgates,
    } = Cluster::start(3, 1, 3000).await;
    let ctx = lockgates[0].ctx.clone();
    let restarting = Instant::now();
    masters[0].restart();
    let restarted_in = restarting.elapsed();
    let m = ctx.locks.quorum().expect("quorum").masters[0].clone();
    eventually("lockgate reconnected to the restarted master", || {
        m.node.state.connects.load(Ordering::SeqCst) >= 2 && m.node.state.up.load(Ordering::SeqCst)
    })
    .await;
    // Noticing may take lockgate a moment; counting it meanwhile is
    // restarted_master_never_votes_before_sitting_out's concern.
    let deadline = Instant::now() + Duration::from_millis(500);
    let state = loop {
        let s = m.state();
        if matches!(s, MasterState::SittingOut(..)) || Instant::now() >= deadline {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    assert!(
        matches!(state, MasterState::SittingOut(..)),
        "SAFETY: master 0, restarted empty right after lockgate had connected to every master \
         (kill + start took {} ms), was reconnected and counted at once without sitting out \
         its rejoin delay: state {state:?} 500 ms after the reconnection",
        restarted_in.as_millis()
    );
    for lg in lockgates {
        lg.stop().await;
    }
    drop((masters, primary));
}

// ------------------------------------------------------- Python clients

/// redis-py `Lock` and pottery `Redlock` through lockgate with 3 masters
/// (`tests/py/quorum_clients.py`). Missing python3, redis-py or pottery is
/// a failure with the command that installs them, never a skip.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_py_and_pottery_locks_through_the_quorum() {
    let _serial = SERIAL.lock().await;
    let Cluster {
        primary,
        masters,
        lockgates,
    } = Cluster::start(3, 1, LEASE_MS).await;
    let lg = lockgates[0].addr;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/py/quorum_clients.py");
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
    let ports: Vec<String> = masters.iter().map(|m| m.port.to_string()).collect();
    let child = Command::new(&python)
        .arg(&script)
        .arg(lg.ip().to_string())
        .arg(lg.port().to_string())
        .arg(primary.port.to_string())
        .arg(ports.join(","))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run `{python}` (set PYTHON to a Python 3 with redis-py 8 and pottery: \
                 python3 -m pip install -q 'redis>=8,<9' 'pottery==3.0.1'): {e}"
            )
        });
    let pid = child.id();
    // lockgate runs on this runtime: wait for the script off it.
    let waited = tokio::time::timeout(
        Duration::from_secs(90),
        tokio::task::spawn_blocking(move || child.wait_with_output()),
    )
    .await;
    let output = match waited {
        Ok(joined) => joined.expect("join").expect("python output"),
        Err(_) => {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            panic!("{} still running after 90 s", script.display());
        }
    };
    let (out, err) = (text(&output.stdout), text(&output.stderr));
    print!("{out}");
    assert!(
        output.status.success(),
        "quorum_clients.py failed with {} (exit 2: redis-py 8 or pottery missing; install with \
         python3 -m pip install -q 'redis>=8,<9' 'pottery==3.0.1')\nstdout:\n{out}\nstderr:\n{err}",
        output.status
    );
    assert!(
        out.contains("checks passed"),
        "the script said nothing about its checks:\n{out}\n{err}"
    );
    for lg in lockgates {
        lg.stop().await;
    }
    drop((masters, primary));
}
