//! The one checker over histories. Fault tests (the quorum's chaos and
//! recovery, the partitions, the loaded box) record every lock operation
//! and every fault in a [`Journal`], and [`judge`] decides over the whole
//! history: mutual exclusion within validity, no lost update on the
//! protected data, strictly increasing fencing tokens, no old token
//! accepted by the fenced store, and liveness: no `WAIT` that times out
//! while others take the lock again and again ([`STARVED_AFTER`]; during
//! faults reported apart, [`FAULT_SHADOW`]), and,
//! once the last fault healed ([`Records::healed`]), every worker still
//! trying acquires within [`Records::live_within`]; where a test bounds
//! every acquisition ([`Records::acquire_within`]), each worker's run of
//! attempts ends in a grant within it. Two rules model the faults and the
//! guards: no grant asked and answered while the test had left fewer than
//! a majority of the lock masters able to grant it
//! ([`Records::no_majority`]), and guarded writes ([`GuardedWrite`],
//! `[[locks.guards]]`) are judged against who validly held the lock when
//! they were sent: a write accepted from a holder that had lost the lock
//! to a later grant (refuse mode; counted in report mode), a write
//! refused within its holder's validity, or an accepted write missing
//! from the data ([`Records::data`]) is a failure.
//! A section is valid from the reply that granted it until the earlier of
//! its release and acquire-sent + lease − drift (or the validity lockgate
//! answered, for the fencing API); only valid sections are held to
//! anything, so a holder that outlives its lease is never a failure by
//! itself.
//!
//! One limit is lockgate's, documented (docs/behaviour.md, "Who may
//! release"): a `DEL` without a token on a connection that was already open
//! when a lock was acquired through the same lockgate may release it (the
//! pooled rule cannot tell that connection from the holder's pool). A
//! legacy holder's late `DEL` on such a connection therefore may delete a
//! later holder's lock, as on plain Redis. A section granted through that
//! lockgate after the connection opened and before the `DEL` was answered
//! is *exposed*: its validity ends when the `DEL` was sent, if later than
//! its grant. Everything else is held to the full checks, and exposed
//! sections are counted.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How a client takes the lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// `SETNX` / `EXPIRE` / `DEL` through a pool that reconnects.
    Legacy,
    /// `SET k uuid NX PX` + compare-and-delete `EVAL`.
    SetNx,
    /// `LOCKGATE LOCK … WAIT` / `UNLOCK` with a fencing token.
    Fence,
    /// `LOCKGATE LOCK … SHARED`: a read lock, held beside other readers,
    /// never beside an exclusive holder.
    Shared,
    /// `LOCKGATE ACQUIRE`: one of [`Records::permits`] permits.
    Permit,
}

/// One acquisition and what its holder did with it.
#[derive(Debug, Clone)]
pub struct Section {
    /// Unique across the run (also the tag its counter write carries).
    pub id: u64,
    /// The worker.
    pub client: usize,
    /// How it was taken.
    pub kind: Kind,
    /// Through which lockgate.
    pub lg: usize,
    /// The fencing token, for [`Kind::Fence`].
    pub token: Option<i64>,
    /// When the acquiring command was sent.
    pub sent: Duration,
    /// When the grant arrived.
    pub start: Duration,
    /// The end of its validity (counted from `sent`).
    pub valid_until: Duration,
    /// When its release was sent.
    pub released: Option<Duration>,
    /// It was paused past its lease (a deliberate fault).
    pub paused: bool,
    /// When its counter write was answered.
    pub write_done: Option<Duration>,
    /// When a legacy `DEL` allowed by the pooled rule may have deleted its
    /// lock (set by [`judge`]; see the module doc).
    pub exposed: Option<Duration>,
}

impl Section {
    /// The span in which it may rely on the lock (empty: never valid).
    pub fn window(&self) -> (Duration, Duration) {
        let end = self
            .released
            .map_or(self.valid_end(), |r| r.min(self.valid_end()));
        (self.start, end)
    }

    /// The end of its validity, or of what lockgate promises for it when
    /// it was exposed to a pooled late `DEL`.
    fn valid_end(&self) -> Duration {
        self.exposed
            .map_or(self.valid_until, |e| e.min(self.valid_until))
    }

    fn valid(&self) -> bool {
        let (a, b) = self.window();
        a < b
    }

    /// Its counter write was answered within its validity.
    fn wrote_validly(&self) -> bool {
        self.write_done.is_some_and(|w| w <= self.valid_end())
    }

    fn show(&self) -> String {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        format!(
            "section {} client {} {:?} via lg{} token {:?}: sent t+{:.1} granted t+{:.1} valid until \
             t+{:.1} released {} wrote {}{}{}",
            self.id,
            self.client,
            self.kind,
            self.lg,
            self.token,
            ms(self.sent),
            ms(self.start),
            ms(self.valid_until),
            self.released.map_or("never".into(), |r| format!("t+{:.1}", ms(r))),
            self.write_done.map_or("never".into(), |w| format!("t+{:.1}", ms(w))),
            if self.paused { " (paused past its lease)" } else { "" },
            self.exposed.map_or(String::new(), |e| format!(
                " (exposed to a pooled late DEL from t+{:.1})",
                ms(e)
            ))
        )
    }
}

/// One release attempt.
#[derive(Debug, Clone)]
pub struct Release {
    /// When it was sent.
    pub t: Duration,
    /// The section it ends.
    pub section: u64,
    /// On the connection that acquired (legacy pool: maybe not).
    pub acquiring_conn: bool,
    /// When the connection it went on opened (`None`: it failed).
    pub conn_opened: Option<Duration>,
    /// When its answer (or failure) came.
    pub answered: Duration,
    /// Sent after the section's validity ended.
    pub late: bool,
    /// What it answered (`1`, `0`, an error).
    pub result: String,
}

/// How one acquisition attempt ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The lock was granted (its [`Section`] is recorded too).
    Granted,
    /// Not acquired: held by someone else, or a `WAIT` that ran out.
    NotAcquired,
    /// An error reply or a failed connection.
    Failed(String),
}

/// One acquisition attempt, whatever its outcome.
#[derive(Debug, Clone)]
pub struct Attempt {
    /// The worker.
    pub client: usize,
    /// Through which lockgate.
    pub lg: usize,
    /// When it was sent.
    pub sent: Duration,
    /// When it was answered (or failed).
    pub answered: Duration,
    /// The `WAIT` it asked for (`None`: a try).
    pub wait: Option<Duration>,
    /// How it ended.
    pub outcome: Outcome,
}

/// A client whose `WAIT`s ran out back to back for at least
/// [`STARVED_SPAN`] while one other client was granted the lock at least
/// this many times meanwhile is a liveness failure (starved): served in
/// arrival order, with turns across instances of at most
/// `max_local_preference_ms` (500 ms by default), nobody goes round the
/// queue again and again while another waits that long. (Many clients
/// granted once each during one short `WAIT` is the queue working.)
pub const STARVED_AFTER: usize = 3;

/// See [`STARVED_AFTER`]: twice the default fairness bound and a loaded
/// box's second.
pub const STARVED_SPAN: Duration = Duration::from_secs(2);

/// A starved run with a fault injected (or healed) within it, or less than
/// this before it, is the fault's doing and is reported apart
/// ([`Verdict::starved_in_faults`]), not failed: while a lockgate is
/// stopped or a master sits out, turns are not promised, and an
/// instance's place in a key's queue lapses in `queue_ttl_ms` (2 s by
/// default); after that, and before any fault, waits take turns again.
pub const FAULT_SHADOW: Duration = Duration::from_secs(3);

/// What lockgate does with a guarded write from a holder that lost the
/// lock (`[[locks.guards]]`, docs/guarded-writes.md): the checker fails
/// such a write accepted in [`Guarding::Refuse`] and counts it in
/// [`Guarding::Report`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Guarding {
    /// `mode = "report"`: late writes applied and counted, none refused.
    Report,
    /// `mode = "refuse"`: late writes refused.
    Refuse,
}

/// One write to the data a lock protects, as its writer saw it.
#[derive(Debug, Clone)]
pub struct GuardedWrite {
    /// The section its writer was in (`None`: it held no lock).
    pub section: Option<u64>,
    /// The worker.
    pub client: usize,
    /// When it was sent.
    pub sent: Duration,
    /// When it was answered.
    pub answered: Duration,
    /// Applied (`false`: refused by the guard).
    pub accepted: bool,
    /// What it appended to the data's history ([`Records::data`]), if it
    /// did: unique across the run.
    pub tag: Option<String>,
}

/// Everything recorded in one run.
#[derive(Debug, Default, Clone)]
pub struct Records {
    /// Every acquisition attempt (workers that record them).
    pub attempts: Vec<Attempt>,
    /// When the last fault healed, if the run ends with a quiet stretch:
    /// liveness after it is judged.
    pub healed: Option<Duration>,
    /// After [`Records::healed`], every worker that still tries must be
    /// granted the lock within this long.
    pub live_within: Duration,
    /// Every acquisition.
    pub sections: Vec<Section>,
    /// Every release attempt.
    pub releases: Vec<Release>,
    /// `(mine, other, when)`: `other` wrote the counter between mine's read
    /// and its write.
    pub lost: Vec<(u64, u64, Duration)>,
    /// `(section, answered at, accepted, token there before)`.
    pub fence_writes: Vec<(u64, Duration, bool, i64)>,
    /// `(when, client, what)`: availability losses.
    pub errors: Vec<(Duration, usize, String)>,
    /// `(when, what)`: the faults injected.
    pub faults: Vec<(Duration, String)>,
    /// Faults by kind.
    pub fault_counts: BTreeMap<&'static str, u64>,
    /// Every run of one worker's attempts (from its first attempt to the
    /// grant that ends it, or to its last answer) must take at most this
    /// long, once outside [`Records::no_majority`]; `None`: not judged.
    pub acquire_within: Option<Duration>,
    /// `(from, to, why)`: spans in which the test left fewer than a
    /// majority of the lock masters able to grant the lock (killed, hung,
    /// sitting out, holding another's lease): no grant may be asked and
    /// answered within one.
    pub no_majority: Vec<(Duration, Duration, String)>,
    /// How the guard treats late writes; `None`: no guarded writes.
    pub guarding: Option<Guarding>,
    /// Every write to the guarded data.
    pub guarded: Vec<GuardedWrite>,
    /// The guarded data's history as Redis holds it at the end (the tags
    /// of the writes applied, in order); `None`: not read.
    pub data: Option<Vec<String>>,
    /// A semaphore's permits: at most this many [`Kind::Permit`] sections
    /// valid at once (`None`: one).
    pub permits: Option<usize>,
}

/// The shared journal, timed from one epoch.
pub struct Journal {
    /// t = 0.
    pub epoch: Instant,
    /// What happened.
    pub r: Mutex<Records>,
}

impl Journal {
    /// An empty journal starting now.
    pub fn new() -> Journal {
        Journal {
            epoch: Instant::now(),
            r: Mutex::new(Records::default()),
        }
    }

    /// Time since the epoch.
    pub fn t(&self, at: Instant) -> Duration {
        at.saturating_duration_since(self.epoch)
    }

    /// Runs `f` on the records.
    pub fn with<T>(&self, f: impl FnOnce(&mut Records) -> T) -> T {
        f(&mut self.r.lock().expect("journal"))
    }

    /// A fault of `kind`, described by `what`, now.
    pub fn fault(&self, kind: &'static str, what: String) {
        let t = self.t(Instant::now());
        self.with(|r| {
            *r.fault_counts.entry(kind).or_default() += 1;
            r.faults.push((t, what));
        });
    }

    /// A timeline line (no count), now.
    pub fn note(&self, what: String) {
        let t = self.t(Instant::now());
        self.with(|r| r.faults.push((t, what)));
    }
}

/// Every failure found, by check.
#[derive(Debug, Default)]
pub struct Verdict {
    /// Two valid sections overlapped (two readers may).
    pub overlaps: Vec<String>,
    /// More valid permit sections at once than the semaphore's permits.
    pub over_permits: Vec<String>,
    /// A lost update between two valid sections.
    pub lost: Vec<String>,
    /// Lost updates involving a section past its validity (expected).
    pub lost_benign: u64,
    /// The store refused a holder within its validity.
    pub fence_refused_valid: Vec<String>,
    /// The store refused a late ex-holder (expected: fencing at work).
    pub fence_refused_late: u64,
    /// A write accepted with a token older than an accepted one.
    pub old_token_accepted: Vec<String>,
    /// A grant whose token is not above one granted before it was asked.
    pub token_order: Vec<String>,
    /// Sections exposed to a legacy late `DEL` the pooled rule allows
    /// (judged only up to it; see the module doc).
    pub exposed: u64,
    /// Which `DEL` exposed which section, for the report.
    pub exposures: Vec<String>,
    /// `WAIT`s that ran out while others took the lock again and again,
    /// with no fault near (see [`FAULT_SHADOW`]): a liveness failure.
    pub starved: Vec<String>,
    /// The same, during faults or within [`FAULT_SHADOW`] after one:
    /// reported, not failed.
    pub starved_in_faults: Vec<String>,
    /// Workers not granted the lock within the bound after the heal, or
    /// runs of attempts longer than [`Records::acquire_within`].
    pub unlive: Vec<String>,
    /// Grants asked and answered while no majority could grant them.
    pub granted_without_majority: Vec<String>,
    /// Guarded writes refused although sent and answered within their
    /// holder's validity (in report mode: any refused).
    pub guard_refused_holder: Vec<String>,
    /// Guarded writes accepted in refuse mode from a holder that had lost
    /// the lock to a later grant, or from a writer holding none while a
    /// section was valid.
    pub guard_accepted_stale: Vec<String>,
    /// The same in report mode: applied, as promised, and counted here
    /// (lockgate must have counted at least these `reported_late`).
    pub guard_late_applied: u64,
    /// Guarded writes refused from a holder that had lost the lock to a
    /// later grant: the guard at work.
    pub guard_refused_late: u64,
    /// Guarded writes past their holder's validity with nobody granted
    /// since (the lease may still run in Redis): either answer is right.
    pub guard_unjudged: u64,
    /// The data disagrees with the writes: an accepted write missing or
    /// twice, a refused one present, one nobody recorded, or another's
    /// write between two of a section's writes within its validity.
    pub guard_data: Vec<String>,
    /// Late writes (report mode) between two of a valid section's writes
    /// in the data: what refuse mode keeps out, reported.
    pub guard_interleaved_late: u64,
}

impl Verdict {
    /// No liveness failure: no starved `WAIT`s, every worker granted
    /// within the bound after the heal.
    pub fn live(&self) -> bool {
        self.starved.is_empty() && self.unlive.is_empty()
    }

    /// No safety failure (liveness is [`Verdict::live`]).
    pub fn clean(&self) -> bool {
        self.overlaps.is_empty()
            && self.over_permits.is_empty()
            && self.lost.is_empty()
            && self.fence_refused_valid.is_empty()
            && self.old_token_accepted.is_empty()
            && self.token_order.is_empty()
            && self.granted_without_majority.is_empty()
            && self.guard_refused_holder.is_empty()
            && self.guard_accepted_stale.is_empty()
            && self.guard_data.is_empty()
    }

    /// The first `n` failures, of every kind, for a failing test's message.
    pub fn first(&self, n: usize) -> String {
        let all: Vec<&str> = self
            .overlaps
            .iter()
            .chain(&self.over_permits)
            .chain(&self.lost)
            .chain(&self.fence_refused_valid)
            .chain(&self.old_token_accepted)
            .chain(&self.token_order)
            .chain(&self.granted_without_majority)
            .chain(&self.guard_refused_holder)
            .chain(&self.guard_accepted_stale)
            .chain(&self.guard_data)
            .chain(&self.starved)
            .chain(&self.unlive)
            .take(n)
            .map(|s| s.as_str())
            .collect();
        all.join("\n\n")
    }
}

/// The two sections, the releases between them and the faults nearby.
fn timeline(r: &Records, a: &Section, b: &Section) -> String {
    let from = a.sent.min(b.sent);
    let to = a.window().1.max(b.window().1);
    let mut lines = vec![format!("  A: {}", a.show()), format!("  B: {}", b.show())];
    for rel in r
        .releases
        .iter()
        .filter(|x| x.t + Duration::from_secs(1) >= from && x.t <= to)
    {
        let owner = r.sections.iter().find(|s| s.id == rel.section);
        lines.push(format!(
            "  release t+{:.1} of section {} (client {:?}, {:?}, lg{:?}, connection opened {}, \
             answered t+{:.1}){}{} -> {}",
            rel.t.as_secs_f64() * 1e3,
            rel.section,
            owner.map(|s| s.client),
            owner.map(|s| s.kind),
            owner.map(|s| s.lg),
            rel.conn_opened
                .map_or("-".into(), |o| format!("t+{:.1}", o.as_secs_f64() * 1e3)),
            rel.answered.as_secs_f64() * 1e3,
            if rel.acquiring_conn {
                ""
            } else {
                " on another pooled connection"
            },
            if rel.late { " LATE" } else { "" },
            rel.result
        ));
    }
    let near = Duration::from_secs(4);
    for (t, what) in r
        .faults
        .iter()
        .filter(|(t, _)| *t + near >= from && *t <= to + near)
    {
        lines.push(format!("  fault t+{:.1} {what}", t.as_secs_f64() * 1e3));
    }
    lines.join("\n")
}

/// Marks the sections a legacy `DEL` answered 1 after its own section
/// had ended may have released under the pooled rule: granted through the
/// same lockgate after the `DEL`'s connection opened, asked for before the
/// `DEL` was answered. Its section ended at its validity's end, or earlier
/// when that section was itself exposed: its lock may already have been
/// deleted by another's `DEL`, and its holder's own `DEL`, on a connection
/// open before the next grant, is then the pooled rule's too (seen under
/// load, `bench/chaos.sh` seed 2 with every core busy: a paused holder's
/// late `DEL` took a lock, and that lock's holder's `DEL` took the next
/// one). Repeated until nothing more is exposed. (A `DEL` answered within
/// its own section found its own lock: there is one lock key.)
fn expose(r: &Records, sections: &mut [Section]) -> Vec<String> {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut why = Vec::new();
    for _round in 0..16 {
        let before = why.len();
        let by_id: BTreeMap<u64, (Kind, usize, Duration)> = sections
            .iter()
            .map(|s| (s.id, (s.kind, s.lg, s.valid_end())))
            .collect();
        for rel in &r.releases {
            let Some(&(kind, lg, own_end)) = by_id.get(&rel.section) else {
                continue;
            };
            let Some(opened) = rel.conn_opened else {
                continue;
            };
            if kind != Kind::Legacy || rel.result != ":1" || rel.answered <= own_end {
                continue;
            }
            for s in sections.iter_mut().filter(|s| {
                s.id != rel.section && s.lg == lg && s.start > opened && s.sent < rel.answered
            }) {
                let from = s.start.max(rel.t);
                if from >= s.window().1 {
                    // Over before the DEL was sent (or already exposed
                    // from earlier): nothing to cut.
                    continue;
                }
                s.exposed = Some(s.exposed.map_or(from, |e| e.min(from)));
                why.push(format!(
                    "section {} (lg{}, granted t+{:.1}) exposed to the DEL of section {} sent t+{:.1} \
                     on a connection opened t+{:.1}, answered t+{:.1} after its section ended \
                     (t+{:.1})",
                    s.id,
                    s.lg,
                    ms(s.start),
                    rel.section,
                    ms(rel.t),
                    ms(opened),
                    ms(rel.answered),
                    ms(own_end)
                ));
            }
        }
        if why.len() == before {
            break;
        }
    }
    why
}

/// Judges the records.
pub fn judge(r: &Records) -> Verdict {
    let mut v = Verdict::default();
    let mut sections = r.sections.clone();
    v.exposures = expose(r, &mut sections);
    v.exposed = sections.iter().filter(|s| s.exposed.is_some()).count() as u64;
    let r = &Records {
        sections,
        ..r.clone()
    };
    let by_id: BTreeMap<u64, &Section> = r.sections.iter().map(|s| (s.id, s)).collect();
    // Mutual exclusion: sweep the valid windows in start order.
    let mut valid: Vec<&Section> = r.sections.iter().filter(|s| s.valid()).collect();
    valid.sort_by_key(|s| s.start);
    // Readers may overlap each other, and permits each other up to the
    // semaphore's count; nothing else may.
    let mut open: Vec<&Section> = Vec::new();
    let permits = r.permits.unwrap_or(1);
    for s in valid {
        open.retain(|o| o.window().1 > s.start);
        for o in &open {
            let shares = matches!(
                (o.kind, s.kind),
                (Kind::Shared, Kind::Shared) | (Kind::Permit, Kind::Permit)
            );
            if !shares {
                v.overlaps.push(format!(
                    "OVERLAP of two valid sections:\n{}",
                    timeline(r, o, s)
                ));
            }
        }
        let holders: Vec<&&Section> = (open.iter()).filter(|o| o.kind == Kind::Permit).collect();
        if s.kind == Kind::Permit && holders.len() >= permits {
            v.over_permits.push(format!(
                "MORE HOLDERS THAN PERMITS ({} of {permits}):\n{}",
                holders.len() + 1,
                timeline(r, holders[0], s)
            ));
        }
        open.push(s);
    }
    for &(mine, other, _) in &r.lost {
        let (Some(m), Some(o)) = (by_id.get(&mine), by_id.get(&other)) else {
            continue;
        };
        if m.wrote_validly() && o.wrote_validly() {
            v.lost.push(format!(
                "LOST UPDATE between valid sections:\n{}",
                timeline(r, o, m)
            ));
        } else {
            v.lost_benign += 1;
        }
    }
    for &(id, at, accepted, prev) in &r.fence_writes {
        let Some(s) = by_id.get(&id) else { continue };
        if !accepted {
            if at <= s.valid_end() {
                let holder = r.sections.iter().find(|x| x.token == Some(prev));
                let msg = match holder {
                    Some(h) => timeline(r, h, s),
                    None => format!("  {} (store held token {prev})", s.show()),
                };
                v.fence_refused_valid
                    .push(format!("FENCING refused a valid holder:\n{msg}"));
            } else {
                v.fence_refused_late += 1;
            }
        } else if prev > 0 {
            // Accepted over `prev`: every holder of `prev` must have been
            // granted before this one, or an old token beat a newer one.
            for h in r
                .sections
                .iter()
                .filter(|x| x.token == Some(prev) && x.start > s.start)
            {
                v.old_token_accepted.push(format!(
                    "OLD TOKEN accepted (token {:?} over {prev}, granted later):\n{}",
                    s.token,
                    timeline(r, s, h)
                ));
            }
        }
    }
    // Token order: a grant must carry a token above every token granted
    // before it was even asked for.
    let mut granted: Vec<&Section> = r.sections.iter().filter(|s| s.token.is_some()).collect();
    let mut asked = granted.clone();
    granted.sort_by_key(|s| s.start);
    asked.sort_by_key(|s| s.sent);
    let (mut i, mut best): (usize, Option<&Section>) = (0, None);
    for b in asked {
        while i < granted.len() && granted[i].start < b.sent {
            if best.is_none_or(|x| granted[i].token > x.token) {
                best = Some(granted[i]);
            }
            i += 1;
        }
        if let Some(a) = best.filter(|a| a.token >= b.token) {
            v.token_order.push(format!(
                "TOKEN ORDER: granted {:?} after {:?} was granted:\n{}",
                b.token,
                a.token,
                timeline(r, a, b)
            ));
        }
    }
    for s in &r.sections {
        for (from, to, why) in &r.no_majority {
            if s.sent >= *from && s.start <= *to {
                v.granted_without_majority.push(format!(
                    "GRANTED WITHOUT A MAJORITY ({why}, t+{:.1}..t+{:.1}):\n  {}",
                    from.as_secs_f64() * 1e3,
                    to.as_secs_f64() * 1e3,
                    s.show()
                ));
            }
        }
    }
    guarded(r, &mut v);
    liveness(r, &mut v);
    v
}

/// The guarded writes: each judged against who validly held the lock when
/// it was sent, then the data against the writes.
fn guarded(r: &Records, v: &mut Verdict) {
    let Some(mode) = r.guarding else { return };
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let by_id: BTreeMap<u64, &Section> = r.sections.iter().map(|s| (s.id, s)).collect();
    let show = |w: &GuardedWrite| {
        format!(
            "write {:?} by client {} in section {:?}, sent t+{:.1} answered t+{:.1}, {}",
            w.tag,
            w.client,
            w.section,
            ms(w.sent),
            ms(w.answered),
            if w.accepted { "applied" } else { "refused" }
        )
    };
    // Whether `w` was sent and answered within its section's validity.
    let within = |w: &GuardedWrite| {
        let s = w.section.and_then(|id| by_id.get(&id))?;
        let (a, b) = s.window();
        Some((s, w.sent >= a && w.answered <= b))
    };
    for w in &r.guarded {
        let judged = within(w);
        // The lock was lost once another acquisition, asked after this
        // section's grant (so applied after it), was granted before the
        // write was sent; a writer holding none writes under another's
        // valid section.
        // (After its own release a writer holds nothing: not judged.)
        let stale = match judged {
            Some((s, _)) if s.released.is_some_and(|rel| w.sent >= rel) => None,
            Some((s, _)) => r
                .sections
                .iter()
                .find(|o| o.id != s.id && o.sent >= s.start && o.start <= w.sent)
                .map(|o| o.show()),
            None => r
                .sections
                .iter()
                .find(|o| {
                    let (a, b) = o.window();
                    o.client != w.client && a <= w.sent && w.answered <= b
                })
                .map(|o| o.show()),
        };
        let holder = judged.is_some_and(|(_, ok)| ok);
        if !w.accepted && (holder || mode == Guarding::Report) {
            let s = judged.map_or(String::new(), |(s, _)| s.show());
            v.guard_refused_holder.push(format!(
                "GUARDED WRITE of a valid holder refused ({mode:?} mode):\n  {}\n  {s}",
                show(w)
            ));
        } else if let (true, Some(other)) = (w.accepted, &stale) {
            match mode {
                Guarding::Refuse => {
                    let s = judged.map_or("no section".into(), |(s, _)| s.show());
                    v.guard_accepted_stale.push(format!(
                        "GUARDED WRITE accepted from a holder that had lost the lock:\n  {}\n  \
                         its section: {s}\n  granted since: {other}",
                        show(w)
                    ))
                }
                Guarding::Report => v.guard_late_applied += 1,
            }
        } else if !w.accepted && stale.is_some() {
            v.guard_refused_late += 1;
        } else if !holder && w.section.is_some() {
            v.guard_unjudged += 1;
        }
    }
    let Some(data) = &r.data else { return };
    let by_tag: BTreeMap<&str, &GuardedWrite> = (r.guarded.iter())
        .filter_map(|w| Some((w.tag.as_deref()?, w)))
        .collect();
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, t) in data.iter().enumerate() {
        match by_tag.get(t.as_str()) {
            None => v
                .guard_data
                .push(format!("GUARDED DATA holds {t:?}, which nobody wrote")),
            Some(w) if !w.accepted => v.guard_data.push(format!(
                "GUARDED DATA holds a refused write (position {i}): {}",
                show(w)
            )),
            Some(_) => *seen.entry(t).or_default() += 1,
        }
    }
    for (t, w) in &by_tag {
        match (w.accepted, seen.get(t).copied().unwrap_or(0)) {
            (true, 0) => v
                .guard_data
                .push(format!("GUARDED WRITE LOST from the data: {}", show(w))),
            (true, n) if n > 1 => v
                .guard_data
                .push(format!("GUARDED WRITE {n} times in the data: {}", show(w))),
            _ => {}
        }
    }
    // Between two of a section's writes made within its validity, nobody
    // else's may land: they were applied while it validly held the lock.
    let mut spans: BTreeMap<u64, (usize, usize)> = BTreeMap::new();
    for (i, t) in data.iter().enumerate() {
        let Some(w) = by_tag.get(t.as_str()) else {
            continue;
        };
        if let (Some(id), Some((_, true))) = (w.section, within(w)) {
            let e = spans.entry(id).or_insert((i, i));
            e.1 = i;
        }
    }
    for (id, (a, b)) in spans {
        for t in data.iter().take(b).skip(a + 1) {
            let Some(w) = by_tag.get(t.as_str()) else {
                continue;
            };
            if w.section == Some(id) || !w.accepted {
                // Its own, or a refused write already reported above.
                continue;
            }
            let late = !within(w).is_some_and(|(_, ok)| ok);
            if mode == Guarding::Report && late {
                v.guard_interleaved_late += 1;
            } else {
                v.guard_data.push(format!(
                    "GUARDED DATA: {} landed between section {id}'s writes {:?} and {:?}, \
                     made within its validity",
                    show(w),
                    data[a],
                    data[b]
                ));
            }
        }
    }
}

/// The liveness checks: starved `WAIT`s, and every worker granted within
/// `live_within` of the heal.
fn liveness(r: &Records, v: &mut Verdict) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    // Each client's runs of `WAIT`s that ran out with no grant between.
    let mut runs: BTreeMap<usize, Vec<(Duration, Duration, usize)>> = BTreeMap::new();
    let mut by_time: Vec<&Attempt> = r.attempts.iter().collect();
    by_time.sort_by_key(|a| a.sent);
    for a in by_time {
        let mine = runs.entry(a.client).or_default();
        let open = mine.last_mut().filter(|run| run.2 == usize::MAX);
        match (&a.outcome, a.wait.is_some(), open) {
            (Outcome::NotAcquired, true, Some(run)) => run.1 = a.answered,
            (Outcome::NotAcquired, true, None) => mine.push((a.sent, a.answered, usize::MAX)),
            // A grant, an error or a try ends the run.
            (_, _, Some(run)) => run.2 = a.lg,
            _ => {}
        }
    }
    for (client, list) in runs {
        for &(from, to, _) in list.iter().filter(|r| r.1 - r.0 >= STARVED_SPAN) {
            let mut by_client: BTreeMap<usize, usize> = BTreeMap::new();
            for s in r
                .sections
                .iter()
                .filter(|s| s.client != client && s.start >= from && s.start <= to)
            {
                *by_client.entry(s.client).or_default() += 1;
            }
            if let Some((&other, &n)) = by_client.iter().max_by_key(|(_, &n)| n) {
                if n >= STARVED_AFTER {
                    let faults: Vec<String> = (r.faults.iter())
                        .filter(|(t, _)| *t + FAULT_SHADOW >= from && *t <= to)
                        .map(|(t, what)| format!("t+{:.1} {what}", ms(*t)))
                        .collect();
                    let list = match faults.is_empty() {
                        true => &mut v.starved,
                        false => &mut v.starved_in_faults,
                    };
                    list.push(format!(
                        "STARVED: client {client}'s WAITs ran out from t+{:.1} to t+{:.1} while \
                         client {other} was granted the lock {n} times (grants by client \
                         meanwhile: {by_client:?}; faults: {faults:?})",
                        ms(from),
                        ms(to)
                    ));
                }
            }
        }
    }
    if let Some(bound) = r.acquire_within {
        acquire_runs(r, bound, v);
    }
    let Some(healed) = r.healed else { return };
    let deadline = healed + r.live_within;
    let mut clients: Vec<(usize, usize)> = r
        .attempts
        .iter()
        .filter(|a| a.sent >= healed)
        .map(|a| (a.client, a.lg))
        .collect();
    clients.sort_unstable();
    clients.dedup();
    for (client, lg) in clients {
        let first = r
            .sections
            .iter()
            .filter(|s| s.client == client && s.start >= healed)
            .map(|s| s.start)
            .min();
        // Still tried after the deadline, or never granted: judged.
        let tried_past = r
            .attempts
            .iter()
            .any(|a| a.client == client && a.answered >= deadline);
        match first {
            Some(t) if t <= deadline => {}
            _ if !tried_past && first.is_none() => {}
            other => v.unlive.push(format!(
                "NOT LIVE: client {client} (lg{lg}) first granted {} after the heal at t+{:.1}                  (bound {:?}); its attempts after the heal: {:?}",
                other.map_or("never".to_string(), |t| format!("t+{:.1}", ms(t))),
                ms(healed),
                r.live_within,
                r.attempts
                    .iter()
                    .filter(|a| a.client == client && a.sent >= healed)
                    .take(6)
                    .map(|a| (ms(a.sent) as u64, a.outcome.clone()))
                    .collect::<Vec<_>>()
            )),
        }
    }
}

/// Each worker's runs of attempts, from the first after a grant to the
/// next grant (or the last answer, if none came), counted from when the
/// run left every [`Records::no_majority`] span: longer than `bound` is
/// not live.
fn acquire_runs(r: &Records, bound: Duration, v: &mut Verdict) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut by_client: BTreeMap<usize, Vec<&Attempt>> = BTreeMap::new();
    for a in &r.attempts {
        by_client.entry(a.client).or_default().push(a);
    }
    for (client, mut list) in by_client {
        list.sort_by_key(|a| a.sent);
        let mut runs: Vec<(Duration, Duration, bool, usize)> = Vec::new();
        let mut open: Option<(Duration, Duration, usize)> = None;
        for a in list {
            let (from, _, n) = open.take().unwrap_or((a.sent, a.answered, 0));
            match a.outcome {
                Outcome::Granted => runs.push((from, a.answered, true, n + 1)),
                _ => open = Some((from, a.answered, n + 1)),
            }
        }
        if let Some((from, to, n)) = open {
            runs.push((from, to, false, n));
        }
        for (from, to, granted, n) in runs {
            // Out of every no-majority span it started in.
            let mut from = from;
            while let Some((_, end, _)) =
                (r.no_majority.iter()).find(|(a, b, _)| *a <= from && from < *b)
            {
                from = *end;
            }
            if to > from && to - from > bound {
                v.unlive.push(format!(
                    "NOT LIVE: client {client}'s run of {n} attempts from t+{:.1} {} t+{:.1} \
                     (bound {bound:?})",
                    ms(from),
                    if granted {
                        "was granted at"
                    } else {
                        "ended ungranted at"
                    },
                    ms(to)
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn section(id: u64, sent: u64, start: u64, valid: u64, released: u64) -> Section {
        Section {
            id,
            client: id as usize,
            kind: Kind::Legacy,
            lg: 0,
            token: None,
            sent: ms(sent),
            start: ms(start),
            valid_until: ms(valid),
            released: Some(ms(released)),
            paused: false,
            write_done: None,
            exposed: None,
        }
    }

    fn write(section: u64, sent: u64, accepted: bool, tag: &str) -> GuardedWrite {
        GuardedWrite {
            section: Some(section),
            client: section as usize,
            sent: ms(sent),
            answered: ms(sent + 2),
            accepted,
            tag: Some(tag.to_string()),
        }
    }

    /// Section 1 is paused past its validity (t+850) and writes `a1` at
    /// t+1150, after section 2 (asked t+1100) took the lock; 2 writes `b0`
    /// and `b1` within its validity. Whatever the writes' answers, the
    /// data holds the accepted ones in `order`.
    fn guarded_run(mode: Guarding, ws: Vec<GuardedWrite>, order: &[&str]) -> Verdict {
        judge(&Records {
            sections: vec![
                section(1, 0, 1, 850, 2_000),
                section(2, 1_100, 1_101, 1_950, 1_300),
            ],
            guarding: Some(mode),
            guarded: ws,
            data: Some(order.iter().map(|t| t.to_string()).collect()),
            ..Records::default()
        })
    }

    /// Readers overlap each other, never a writer; permits overlap up to
    /// their count.
    #[test]
    fn readers_share_writers_do_not_and_permits_count() {
        let of = |kind: Kind, s: Section| Section { kind, ..s };
        let run = |sections: Vec<Section>, permits: Option<usize>| {
            judge(&Records {
                sections,
                permits,
                ..Records::default()
            })
        };
        let readers = vec![
            of(Kind::Shared, section(1, 0, 1, 900, 500)),
            of(Kind::Shared, section(2, 0, 2, 900, 600)),
        ];
        assert!(run(readers.clone(), None).clean());
        let mut with_writer = readers;
        with_writer.push(of(Kind::Fence, section(3, 0, 400, 900, 800)));
        let v = run(with_writer, None);
        assert_eq!(v.overlaps.len(), 2, "{}", v.first(5));
        let permits: Vec<Section> = (1..=3)
            .map(|i| of(Kind::Permit, section(i, 0, i, 900, 500)))
            .collect();
        assert!(run(permits.clone(), Some(3)).clean());
        let v = run(permits, Some(2));
        assert_eq!(v.over_permits.len(), 1, "{}", v.first(5));
        assert!(v.overlaps.is_empty());
    }

    /// A guarded write is judged against who validly held the lock when
    /// it was sent: a late write accepted in refuse mode, a valid
    /// holder's write refused (or any refusal in report mode), and data
    /// that lost or gained a write are failures; a late write applied in
    /// report mode is counted, and one past its validity with nobody
    /// granted since is left alone.
    #[test]
    fn guarded_writes_are_judged_against_the_valid_holder() {
        use Guarding::{Refuse, Report};
        let ws = |a1: bool, b1: bool| {
            vec![
                write(1, 10, true, "a0"),
                write(2, 1_110, true, "b0"),
                write(1, 1_150, a1, "a1"),
                write(2, 1_200, b1, "b1"),
            ]
        };
        // (mode, a1 accepted, b1 accepted, the data) → (failures of each
        // kind: refused holder, accepted stale, data; late applied,
        // interleaved late).
        type Row<'a> = (Guarding, bool, bool, &'a [&'a str], [usize; 5]);
        let table: &[Row] = &[
            (Refuse, false, true, &["a0", "b0", "b1"], [0, 0, 0, 0, 0]),
            (
                Refuse,
                true,
                true,
                &["a0", "b0", "a1", "b1"],
                [0, 1, 1, 0, 0],
            ),
            (
                Refuse,
                true,
                true,
                &["a0", "b0", "b1", "a1"],
                [0, 1, 0, 0, 0],
            ),
            (Refuse, false, false, &["a0", "b0"], [1, 0, 0, 0, 0]),
            (Refuse, false, true, &["a0", "b0"], [0, 0, 1, 0, 0]),
            (
                Refuse,
                false,
                true,
                &["a0", "b0", "a1", "b1"],
                [0, 0, 1, 0, 0],
            ),
            (
                Refuse,
                false,
                true,
                &["a0", "b0", "b1", "x"],
                [0, 0, 1, 0, 0],
            ),
            (
                Report,
                true,
                true,
                &["a0", "b0", "a1", "b1"],
                [0, 0, 0, 1, 1],
            ),
            (Report, false, true, &["a0", "b0", "b1"], [1, 0, 0, 0, 0]),
        ];
        for (i, &(mode, a1, b1, data, want)) in table.iter().enumerate() {
            let v = guarded_run(mode, ws(a1, b1), data);
            let got = [
                v.guard_refused_holder.len(),
                v.guard_accepted_stale.len(),
                v.guard_data.len(),
                v.guard_late_applied as usize,
                v.guard_interleaved_late as usize,
            ];
            assert_eq!(got, want, "row {i}: {}", v.first(4));
            assert_eq!(v.clean(), want[..3] == [0, 0, 0], "row {i}");
        }
        // Past its validity (t+850) with nobody granted yet (2 asks at
        // t+1100): the lease may still run in Redis, either answer right.
        for accepted in [true, false] {
            let mut w = ws(false, true);
            w.push(write(1, 900, accepted, "late"));
            let data: &[&str] = match accepted {
                true => &["a0", "late", "b0", "b1"],
                false => &["a0", "b0", "b1"],
            };
            let v = guarded_run(Refuse, w, data);
            assert!(v.clean(), "{}", v.first(4));
            assert_eq!(v.guard_unjudged, 1, "the late write");
            assert_eq!(v.guard_refused_late, 1, "a1, refused");
        }
        // A writer holding no lock, applied while section 2 was valid.
        let mut w = ws(false, true);
        w.push(GuardedWrite {
            section: None,
            client: 9,
            ..write(0, 1_120, true, "n")
        });
        let v = guarded_run(Refuse, w, &["a0", "b0", "n", "b1"]);
        assert_eq!(v.guard_accepted_stale.len(), 1, "{}", v.first(4));
        assert_eq!(v.guard_data.len(), 1, "{}", v.first(4));
    }

    /// A grant asked and answered while the test left no majority able to
    /// grant is a failure; one asked before the span began, or answered
    /// after it ended, is not.
    #[test]
    fn no_grant_without_a_majority() {
        let run = |sent: u64, start: u64| {
            judge(&Records {
                sections: vec![section(1, sent, start, sent + 850, start + 10)],
                no_majority: vec![(ms(100), ms(500), "3 of 5 killed".into())],
                ..Records::default()
            })
        };
        for (sent, start, failed) in [(150, 160, 1), (90, 120, 0), (490, 495, 1), (490, 510, 0)] {
            let v = run(sent, start);
            assert_eq!(v.granted_without_majority.len(), failed, "{sent} {start}");
            assert_eq!(v.clean(), failed == 0);
        }
    }

    /// Each run of attempts must end in a grant within the bound, counted
    /// from when it left the no-majority spans it started in.
    #[test]
    fn every_run_of_attempts_ends_in_a_grant_within_the_bound() {
        let attempt = |sent: u64, outcome: Outcome| Attempt {
            client: 0,
            lg: 0,
            sent: ms(sent),
            answered: ms(sent + 5),
            wait: None,
            outcome,
        };
        let no = || Outcome::NotAcquired;
        let run = |bound: u64, attempts: Vec<Attempt>, spans: &[(u64, u64)]| {
            judge(&Records {
                attempts,
                acquire_within: Some(ms(bound)),
                no_majority: (spans.iter())
                    .map(|&(a, b)| (ms(a), ms(b), "down".into()))
                    .collect(),
                ..Records::default()
            })
            .unlive
            .len()
        };
        let granted_late = || {
            vec![
                attempt(0, no()),
                attempt(300, Outcome::Failed("-ERR".into())),
                attempt(600, Outcome::Granted),
                attempt(700, Outcome::Granted),
            ]
        };
        assert_eq!(run(1_000, granted_late(), &[]), 0);
        assert_eq!(run(500, granted_late(), &[]), 1);
        assert_eq!(run(500, granted_late(), &[(0, 400)]), 0);
        let never = vec![attempt(0, no()), attempt(2_000, no())];
        assert_eq!(run(1_000, never.clone(), &[]), 1);
        assert_eq!(run(1_000, never.clone(), &[(0, 3_000)]), 0);
        assert_eq!(run(3_000, never, &[]), 0);
    }
}
