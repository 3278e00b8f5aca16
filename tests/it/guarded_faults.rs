//! The fault workload with guarded data (docs/guarded-writes.md): legacy
//! holders (`SETNX`, `PEXPIRE`, `DEL`) write the data their lock protects
//! inside their section, and some are paused past their lease, waking
//! while the next holder is inside. In `refuse` mode no write from a
//! holder outside its validity reaches the data: the data's history shows
//! each section's writes together, never another holder's between them;
//! in `report` mode every late write is applied and counted. Seeded: a
//! failing run prints its seed, which replays its schedule of pauses.

use std::time::Duration;

use crate::guarded_writes::{counts, guarded, orders};
use crate::support;

use lockgate::config::{GuardMode, UnlockedWriters};
use support::locks::*;
use support::quorum;
use support::rng::Rng;
use support::RawClient;

/// The lease the holders get (ms): sections take a few ms, so only the
/// paused ones outlive it, even on a loaded machine.
const LEASE_MS: u64 = 1_000;
/// How long a paused holder sleeps inside its section (ms).
const PAUSE_MS: u64 = 1_600;
const HOLDERS: usize = 4;
const ROUNDS: usize = 5;

/// What one holder saw: its writes applied and refused, and the sections
/// it was paused in.
#[derive(Debug, Default)]
struct Seen {
    applied: u64,
    refused: u64,
    paused: u64,
}

impl Seen {
    /// Sends the write `args` on `c` and notes whether it was applied or
    /// refused (anything else fails the test).
    async fn write(&mut self, c: &mut RawClient, args: &[&str]) {
        let reply = c.call(args).await;
        if reply.starts_with("-ERR lockgate: write refused") {
            self.refused += 1;
        } else {
            assert!(
                reply.starts_with(':') || reply == "+OK\r\n",
                "{args:?}: {reply}"
            );
            self.applied += 1;
        }
    }
}

/// One holder: `ROUNDS` sections on `lock:order:1`, each writing
/// `h:k:begin` and, after a pause if the schedule says so, `h:k:end` to
/// the history and the order itself, then releasing. On a slow machine a
/// section that was not paused may outlive its lease too: its writes are
/// then refused like a paused one's, and counted the same.
async fn holder(addr: std::net::SocketAddr, h: usize, pauses: Vec<bool>) -> Seen {
    let mut c = RawClient::connect(addr).await;
    let mut seen = Seen::default();
    for (k, pause) in pauses.into_iter().enumerate() {
        // The legacy spin: SETNX until it answers 1.
        let deadline = std::time::Instant::now() + support::WAIT;
        while c.call(&["SETNX", "lock:order:1", &format!("h{h}")]).await != ":1\r\n" {
            assert!(
                std::time::Instant::now() < deadline,
                "holder {h} never acquired"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let lease = LEASE_MS.to_string();
        c.call(&["PEXPIRE", "lock:order:1", &lease]).await;
        let begin = format!("h{h}:{k}:begin");
        seen.write(&mut c, &["RPUSH", "order:1:history", &begin])
            .await;
        if pause {
            seen.paused += 1;
            tokio::time::sleep(Duration::from_millis(PAUSE_MS)).await;
        }
        let end = format!("h{h}:{k}:end");
        seen.write(&mut c, &["RPUSH", "order:1:history", &end])
            .await;
        seen.write(&mut c, &["SET", "order:1", &end]).await;
        c.call(&["DEL", "lock:order:1"]).await;
    }
    seen
}

/// Where the locks live for a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Store {
    /// On the primary, beside the data.
    Primary,
    /// On three masters (Redlock), the data on the primary: guarded writes
    /// check the guard record each acquisition leaves there.
    Quorum,
}

/// Runs the workload for `seed` in `mode` with the locks on `store`;
/// returns the history, the holders' sightings summed, and the guard's
/// counters.
async fn workload(seed: u64, mode: GuardMode, store: Store) -> (Vec<String>, Seen, [u64; 5]) {
    match store {
        Store::Primary => {
            let (_redis, lg, mut r) = guarded(mode, UnlockedWriters::Allow, LEASE_MS).await;
            run(seed, &lg, &mut r).await
        }
        Store::Quorum => {
            let q = quorum::Cluster::start(3, |c| {
                c.locks.default_lease_ms = LEASE_MS;
                c.locks.guards = vec![orders(mode, UnlockedWriters::Allow)];
            })
            .await;
            until!(
                "the command table",
                !q.lg.ctx.locks.guard_table.get().is_empty()
            );
            let mut r = RawClient::connect(q.primary.addr()).await;
            run(seed, &q.lg, &mut r).await
        }
    }
}

/// The workload for `seed` through `lg`, the data read with `r` (on the
/// primary).
async fn run(
    seed: u64,
    lg: &support::Lockgate,
    r: &mut RawClient,
) -> (Vec<String>, Seen, [u64; 5]) {
    let mut rng = Rng::new(seed);
    // At least one pause, at most one per holder.
    let schedule: Vec<Vec<bool>> = (0..HOLDERS)
        .map(|h| {
            let at = rng.below(ROUNDS as u64 * 2) as usize;
            (0..ROUNDS).map(|k| k == at || (h == 0 && k == 1)).collect()
        })
        .collect();
    let addr = lg.addr;
    let tasks: Vec<_> = (schedule.into_iter().enumerate())
        .map(|(h, pauses)| tokio::spawn(holder(addr, h, pauses)))
        .collect();
    let mut seen = Seen::default();
    for t in tasks {
        let s = t.await.expect("holder");
        seen.applied += s.applied;
        seen.refused += s.refused;
        seen.paused += s.paused;
    }
    // The history as Redis holds it: `h<holder>:<round>:<begin|end>`.
    let raw = r.call(&["LRANGE", "order:1:history", "0", "-1"]).await;
    let history = raw
        .split("\r\n")
        .filter(|l| l.starts_with('h'))
        .map(str::to_string)
        .collect();
    (history, seen, counts(lg))
}

/// The `end` entries of `history` written by a holder whose section was
/// not the last one to begin: someone else's write came between.
fn interleaved(history: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    for (i, e) in history.iter().enumerate() {
        if let Some(section) = e.strip_suffix(":end") {
            let before = i.checked_sub(1).map(|j| history[j].as_str());
            if before != Some(&format!("{section}:begin")) {
                out.push(e.clone());
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuse_mode_keeps_every_late_write_out_of_the_data() {
    for (seed, store) in [
        (0x5eed_0001, Store::Primary),
        (0x5eed_0002, Store::Primary),
        (0x5eed_0005, Store::Quorum),
    ] {
        let (history, seen, counted) = workload(seed, GuardMode::Refuse, store).await;
        let [applied, refused, late, unlocked, unchecked] = counted;
        // The data's history: every section's writes together, never
        // another holder's between them.
        assert!(
            interleaved(&history).is_empty(),
            "seed {seed:#x} {store:?}: {history:?}"
        );
        // Every paused holder woke past its lease: its two last writes
        // refused (at least).
        assert!(
            seen.paused >= 1 && seen.refused >= 2 * seen.paused,
            "seed {seed:#x} {store:?}: {seen:?}"
        );
        // Each write counted once, as the holders saw it; all of them.
        assert_eq!(
            (applied, refused),
            (seen.applied, seen.refused),
            "seed {seed:#x} {store:?}"
        );
        assert_eq!(seen.applied + seen.refused, 3 * (HOLDERS * ROUNDS) as u64);
        assert_eq!(
            (late, unlocked, unchecked),
            (0, 0, 0),
            "seed {seed:#x} {store:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_mode_applies_and_counts_every_late_write() {
    for (seed, store) in [
        (0x5eed_0003, Store::Primary),
        (0x5eed_0004, Store::Primary),
        (0x5eed_0006, Store::Quorum),
    ] {
        let (history, seen, counted) = workload(seed, GuardMode::Report, store).await;
        let [applied, refused, late, _, _] = counted;
        assert_eq!((refused, seen.refused), (0, 0), "seed {seed:#x} {store:?}");
        // Every write applied; each paused section's two late writes
        // counted late (at least); and the history shows what refuse
        // mode would have kept out.
        assert_eq!(applied + late, seen.applied, "seed {seed:#x} {store:?}");
        assert!(
            late >= 2 * seen.paused,
            "seed {seed:#x} {store:?}: {late} late, {seen:?}"
        );
        assert!(
            interleaved(&history).len() as u64 <= late,
            "seed {seed:#x} {store:?}: {history:?}"
        );
    }
}
