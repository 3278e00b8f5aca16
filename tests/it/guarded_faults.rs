//! The fault workload with guarded data (docs/guarded-writes.md): legacy
//! holders (`SETNX`, `PEXPIRE`, `DEL`) write the data their lock protects
//! inside their section, and some are paused past their lease, waking
//! while the next holder is inside. In `refuse` mode no write from a
//! holder outside its validity reaches the data: the data's history shows
//! each section's writes together, never another holder's between them;
//! in `report` mode every late write is applied and counted. Seeded: a
//! failing run prints its seed, which replays its schedule of pauses.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::guarded_writes::{counts, guarded, orders};
use crate::support;

use lockgate::config::{GuardMode, UnlockedWriters};
use support::history::{
    judge, Attempt, GuardedWrite, Guarding, Journal, Kind, Outcome, Release, Section, Verdict,
};
use support::locks::*;
use support::quorum;
use support::rng::Rng;
use support::RawClient;

/// The lease the holders get (ms): sections take a few ms, so only the
/// paused ones outlive it, even on a loaded machine.
const LEASE_MS: u64 = 1_000;
/// What a holder takes off its lease for its validity (ms): above
/// lockgate's own drift on the quorum (1 % of the lease + 2 ms), so a
/// section the checker holds valid is one lockgate still counts held.
const DRIFT_MS: u64 = 50;
/// How long a paused holder sleeps inside its section (ms).
const PAUSE_MS: u64 = 1_600;
const HOLDERS: usize = 4;
const ROUNDS: usize = 5;
/// Every acquisition within this (the checker's liveness bound); a
/// holder gives up a second past it, so a stuck one fails the verdict.
const ACQUIRE_WITHIN: Duration = support::WAIT;

/// What one holder saw: its writes applied and refused, and the sections
/// it was paused in.
#[derive(Debug, Default)]
struct Seen {
    applied: u64,
    refused: u64,
    paused: u64,
}

/// One holder's connection and what it records in the run's journal.
struct Holder {
    c: RawClient,
    /// When its connection opened (the pooled rule compares it).
    opened: Duration,
    h: usize,
    j: Arc<Journal>,
    ids: Arc<AtomicU64>,
    seen: Seen,
}

impl Holder {
    /// The legacy spin: `SETNX` every 5 ms until it answers 1, each
    /// attempt recorded; the granted section (its validity counted from
    /// the granting `SETNX`'s send, the lease lockgate gives a bare
    /// `SETNX`), or `None` if it gave up past [`ACQUIRE_WITHIN`].
    async fn acquire(&mut self) -> Option<Section> {
        let give_up = Instant::now() + ACQUIRE_WITHIN + Duration::from_secs(1);
        let me = format!("h{}", self.h);
        loop {
            let sent = self.j.t(Instant::now());
            let reply = self.c.call(&["SETNX", "lock:order:1", &me]).await;
            let answered = self.j.t(Instant::now());
            let outcome = match reply.as_str() {
                ":1\r\n" => Outcome::Granted,
                ":0\r\n" => Outcome::NotAcquired,
                other => Outcome::Failed(other.to_string()),
            };
            let granted = outcome == Outcome::Granted;
            self.j.with(|r| {
                r.attempts.push(Attempt {
                    client: self.h,
                    lg: 0,
                    sent,
                    answered,
                    wait: None,
                    outcome,
                })
            });
            if granted {
                return Some(Section {
                    id: self.ids.fetch_add(1, Ordering::Relaxed),
                    client: self.h,
                    kind: Kind::Legacy,
                    lg: 0,
                    token: None,
                    sent,
                    start: answered,
                    valid_until: sent + Duration::from_millis(LEASE_MS - DRIFT_MS),
                    released: None,
                    paused: false,
                    write_done: None,
                    exposed: None,
                });
            }
            if Instant::now() > give_up {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Sends the write `args` in section `s`, recorded with `tag` (what it
    /// appends to the data's history, if it does), and notes whether it
    /// was applied or refused (anything else fails the test).
    async fn write(&mut self, s: &Section, args: &[&str], tag: Option<&str>) {
        let sent = self.j.t(Instant::now());
        let reply = self.c.call(args).await;
        let answered = self.j.t(Instant::now());
        let accepted = !reply.starts_with("-ERR lockgate: write refused");
        if accepted {
            assert!(
                reply.starts_with(':') || reply == "+OK\r\n",
                "{args:?}: {reply}"
            );
            self.seen.applied += 1;
        } else {
            self.seen.refused += 1;
        }
        self.j.with(|r| {
            r.guarded.push(GuardedWrite {
                section: Some(s.id),
                client: self.h,
                sent,
                answered,
                accepted,
                tag: tag.map(str::to_string),
            })
        });
    }

    /// The release (`DEL` on its own connection), recorded with the
    /// section.
    async fn release(&mut self, mut s: Section) {
        let t = self.j.t(Instant::now());
        let result = self.c.call(&["DEL", "lock:order:1"]).await;
        let answered = self.j.t(Instant::now());
        s.released = Some(t);
        self.j.with(|r| {
            r.releases.push(Release {
                t,
                section: s.id,
                acquiring_conn: true,
                conn_opened: Some(self.opened),
                answered,
                late: t > s.valid_until,
                result: result.trim_end().to_string(),
            });
            r.sections.push(s);
        });
    }
}

/// One holder: `ROUNDS` sections on `lock:order:1`, each writing
/// `h:k:begin` and, after a pause if the schedule says so, `h:k:end` to
/// the history and the order itself, then releasing; every attempt,
/// section, write and release recorded in `j`. On a slow machine a
/// section that was not paused may outlive its lease too: its writes are
/// then refused like a paused one's, and counted the same.
async fn holder(
    addr: std::net::SocketAddr,
    h: usize,
    pauses: Vec<bool>,
    j: Arc<Journal>,
    ids: Arc<AtomicU64>,
) -> Seen {
    let opened = j.t(Instant::now());
    let c = RawClient::connect(addr).await;
    let mut me = Holder {
        c,
        opened,
        h,
        j,
        ids,
        seen: Seen::default(),
    };
    for (k, pause) in pauses.into_iter().enumerate() {
        let Some(mut s) = me.acquire().await else {
            // Not live: the checker says so (a run past its bound).
            break;
        };
        let lease = LEASE_MS.to_string();
        me.c.call(&["PEXPIRE", "lock:order:1", &lease]).await;
        let begin = format!("h{h}:{k}:begin");
        me.write(&s, &["RPUSH", "order:1:history", &begin], Some(&begin))
            .await;
        if pause {
            me.seen.paused += 1;
            s.paused = true;
            me.j.fault(
                "pause",
                format!("h{h} paused {PAUSE_MS} ms in section {}", s.id),
            );
            tokio::time::sleep(Duration::from_millis(PAUSE_MS)).await;
        }
        let end = format!("h{h}:{k}:end");
        me.write(&s, &["RPUSH", "order:1:history", &end], Some(&end))
            .await;
        me.write(&s, &["SET", "order:1", &end], None).await;
        me.release(s).await;
    }
    me.seen
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

/// One run: the holders' sightings summed, the guard's counters, the
/// history the run recorded and the checker's verdict on it.
struct Run {
    seen: Seen,
    counted: [u64; 5],
    records: support::history::Records,
    v: Verdict,
}

impl Run {
    /// Prints the figures, and fails the test on any failure the checker
    /// found (safety or liveness).
    fn judged(&self, seed: u64, mode: GuardMode, store: Store) {
        let r = &self.records;
        let v = &self.v;
        let applied = r.guarded.iter().filter(|w| w.accepted).count();
        println!(
            "guarded_faults seed {seed:#x} {mode:?} {store:?}: acquisitions {} of {} attempts; \
             paused {}; overlaps {}; exposed {}; guarded writes {} applied, {} refused; late \
             refused {}, applied {} (interleaved {}); unjudged {}; stale accepted {}; valid refused {}; \
             data failures {}; not live {}; guard counters {:?}",
            r.sections.len(),
            r.attempts.len(),
            self.seen.paused,
            v.overlaps.len(),
            v.exposed,
            applied,
            r.guarded.len() - applied,
            v.guard_refused_late,
            v.guard_late_applied,
            v.guard_interleaved_late,
            v.guard_unjudged,
            v.guard_accepted_stale.len(),
            v.guard_refused_holder.len(),
            v.guard_data.len(),
            v.unlive.len(),
            self.counted
        );
        assert!(
            v.clean() && v.live(),
            "seed {seed:#x} {mode:?} {store:?}:\n{}\n\ndata: {:?}",
            v.first(6),
            r.data
        );
    }
}

/// Runs the workload for `seed` in `mode` with the locks on `store`, and
/// judges it.
async fn workload(seed: u64, mode: GuardMode, store: Store) -> Run {
    match store {
        Store::Primary => {
            let (_redis, lg, mut r) = guarded(mode, UnlockedWriters::Allow, LEASE_MS).await;
            run(seed, mode, &lg, &mut r).await
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
            run(seed, mode, &q.lg, &mut r).await
        }
    }
}

/// The workload for `seed` through `lg`, the data read with `r` (on the
/// primary): every lock operation and guarded write recorded, the data's
/// history read at the end, all of it judged by the checker.
async fn run(seed: u64, mode: GuardMode, lg: &support::Lockgate, r: &mut RawClient) -> Run {
    let mut rng = Rng::new(seed);
    // At least one pause, at most one per holder.
    let schedule: Vec<Vec<bool>> = (0..HOLDERS)
        .map(|h| {
            let at = rng.below(ROUNDS as u64 * 2) as usize;
            (0..ROUNDS).map(|k| k == at || (h == 0 && k == 1)).collect()
        })
        .collect();
    let j = Arc::new(Journal::new());
    let ids = Arc::new(AtomicU64::new(1));
    let addr = lg.addr;
    let tasks: Vec<_> = (schedule.into_iter().enumerate())
        .map(|(h, pauses)| tokio::spawn(holder(addr, h, pauses, j.clone(), ids.clone())))
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
    let data = raw
        .split("\r\n")
        .filter(|l| l.starts_with('h'))
        .map(str::to_string)
        .collect();
    let mut records = j.with(std::mem::take);
    records.guarding = Some(match mode {
        GuardMode::Refuse => Guarding::Refuse,
        GuardMode::Report => Guarding::Report,
    });
    records.data = Some(data);
    records.acquire_within = Some(ACQUIRE_WITHIN);
    let v = judge(&records);
    Run {
        seen,
        counted: counts(lg),
        records,
        v,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuse_mode_keeps_every_late_write_out_of_the_data() {
    for (seed, store) in [
        (0x5eed_0001, Store::Primary),
        (0x5eed_0002, Store::Primary),
        (0x5eed_0005, Store::Quorum),
    ] {
        let run = workload(seed, GuardMode::Refuse, store).await;
        // The checker: no two valid sections overlap, no late write in
        // the data nor a valid holder's refused or lost, every
        // acquisition within its bound.
        run.judged(seed, GuardMode::Refuse, store);
        let (seen, [applied, refused, late, unlocked, unchecked]) = (&run.seen, run.counted);
        // Every paused holder woke past its lease: its two last writes
        // refused (at least), some of them after another's grant.
        assert!(
            seen.paused >= 1 && seen.refused >= 2 * seen.paused && run.v.guard_refused_late >= 1,
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
        let run = workload(seed, GuardMode::Report, store).await;
        // The checker: no overlap, nothing refused, every write in the
        // data, every acquisition within its bound.
        run.judged(seed, GuardMode::Report, store);
        let (seen, [applied, refused, late, _, _]) = (&run.seen, run.counted);
        assert_eq!((refused, seen.refused), (0, 0), "seed {seed:#x} {store:?}");
        // Every write applied; each paused section's two late writes
        // counted late (at least); and every write the checker saw
        // applied after another holder's grant (what refuse mode would
        // have kept out) counted late by lockgate.
        assert_eq!(applied + late, seen.applied, "seed {seed:#x} {store:?}");
        assert!(
            late >= 2 * seen.paused,
            "seed {seed:#x} {store:?}: {late} late, {seen:?}"
        );
        assert!(
            run.v.guard_late_applied >= 1 && run.v.guard_late_applied <= late,
            "seed {seed:#x} {store:?}: checker {} late, lockgate {late}",
            run.v.guard_late_applied
        );
    }
}
