//! The one checker over histories. Fault tests (the quorum's chaos and
//! recovery, the partitions, the loaded box) record every lock operation
//! and every fault in a [`Journal`], and [`judge`] decides over the whole
//! history: mutual exclusion within validity, no lost update on the
//! protected data, strictly increasing fencing tokens, no old token
//! accepted by the fenced store, and liveness: no `WAIT` that times out
//! while others take the lock again and again ([`STARVED_AFTER`]; during
//! faults reported apart, [`FAULT_SHADOW`]), and,
//! once the last fault healed ([`Records::healed`]), every worker still
//! trying acquires within [`Records::live_within`].
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
    /// Two valid sections overlapped.
    pub overlaps: Vec<String>,
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
    /// Workers not granted the lock within the bound after the heal.
    pub unlive: Vec<String>,
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
            && self.lost.is_empty()
            && self.fence_refused_valid.is_empty()
            && self.old_token_accepted.is_empty()
            && self.token_order.is_empty()
    }

    /// The first `n` failures, of every kind, for a failing test's message.
    pub fn first(&self, n: usize) -> String {
        let all: Vec<&str> = self
            .overlaps
            .iter()
            .chain(&self.lost)
            .chain(&self.fence_refused_valid)
            .chain(&self.old_token_accepted)
            .chain(&self.token_order)
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
    let mut open: Vec<&Section> = Vec::new();
    for s in valid {
        open.retain(|o| o.window().1 > s.start);
        for o in &open {
            v.overlaps.push(format!(
                "OVERLAP of two valid sections:\n{}",
                timeline(r, o, s)
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
    liveness(r, &mut v);
    v
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
