//! The chaos test's fault loop: seeded faults on the lock masters (SIGSTOP,
//! SIGKILL and restart empty, a rolling restart of every master, a step of
//! one master's wall clock forward and back) and on the two lockgate
//! subprocesses (SIGKILL and restart, SIGSTOP). Never a majority of masters
//! down: a master counts as disturbed from its fault until every lockgate
//! reports it up again in a look taken after its rejoin delay (a lockgate
//! that is down or stopped cannot report, so the master stays disturbed).

use std::time::{Duration, Instant};

use super::checks::Journal;
use super::LockgateProc;
use crate::support::process::signal;
use crate::support::quorum::fake_clock::FakeClock;
use crate::support::rng::XorShift;
use crate::support::RedisServer;

/// Most masters disturbed at once (of 5: three always count).
const MAX_DISTURBED: usize = 2;
/// How often the fault loop looks.
const TICK: Duration = Duration::from_millis(20);

/// The processes the faults hit.
pub struct Cluster {
    /// Where data keys live (never faulted).
    pub primary: RedisServer,
    /// The lock masters.
    pub masters: Vec<RedisServer>,
    /// The faked clock of master `clock_master`.
    pub clock: FakeClock,
    /// Which master runs under libfaketime.
    pub clock_master: usize,
    /// The lockgate instances.
    pub lgs: Vec<LockgateProc>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    None,
    Paused(Instant),
    Down(Instant),
    Stepped(Instant),
}

struct Master {
    fault: Fault,
    /// Per lockgate: an "up" from a look sent at or after this instant is
    /// still owed.
    owed: Vec<Option<Instant>>,
}

impl Master {
    fn disturbed(&self) -> bool {
        self.fault != Fault::None || self.owed.iter().any(Option::is_some)
    }
}

/// What the loop saw, beyond the journal's fault counts.
#[derive(Debug, Default)]
pub struct Summary {
    /// Most masters disturbed at once.
    pub most_disturbed: usize,
    /// How long each rolling restart took, first restart to last.
    pub rolling: Vec<Duration>,
}

/// Runs faults until `until`, then undoes what is still in force (without
/// waiting for rejoins).
pub async fn run(
    c: &mut Cluster,
    j: &Journal,
    seed: u64,
    until: Instant,
    rejoin: Duration,
) -> Summary {
    let mut rng = XorShift::new(seed ^ 0xfa_u64.rotate_left(56));
    let n = c.masters.len();
    let g = c.lgs.len();
    let mut ms: Vec<Master> = (0..n)
        .map(|_| Master {
            fault: Fault::None,
            owed: vec![None; g],
        })
        .collect();
    let mut lgs: Vec<Fault> = vec![Fault::None; g];
    let mut sum = Summary::default();
    let mut next = Instant::now() + Duration::from_millis(500);
    let mut next_look = Instant::now();
    // A rolling restart: the pairs still to go, and when it began.
    let mut rolling: Option<(Vec<[usize; 2]>, Instant)> = None;
    let total = until.saturating_duration_since(Instant::now());
    let mut rolling_due = vec![Instant::now() + total / 4, Instant::now() + total * 3 / 5];
    loop {
        let now = Instant::now();
        let ending = now >= until;
        for (k, lg) in c.lgs.iter_mut().enumerate() {
            if matches!(lgs[k], Fault::Down(_)) {
                continue;
            }
            if let Some(status) = lg.exited() {
                panic!(
                    "lockgate {} exited by itself ({status}):\n{}",
                    lg.name,
                    lg.log_tail()
                );
            }
        }
        // Move the faults in force along.
        for (i, m) in ms.iter_mut().enumerate() {
            match m.fault {
                Fault::Paused(t) if ending || now >= t => {
                    signal(c.masters[i].pid(), "-CONT");
                    j.note(format!("SIGCONT m{i}"));
                    m.fault = Fault::None;
                    m.owed = vec![Some(Instant::now() + Duration::from_millis(300)); g];
                }
                Fault::Down(t) if ending || now >= t => {
                    tokio::task::block_in_place(|| c.masters[i].restart());
                    j.note(format!("m{i} restarted (empty)"));
                    m.fault = Fault::None;
                    m.owed = vec![Some(Instant::now() + rejoin); g];
                }
                Fault::Stepped(t) if ending || now >= t => {
                    c.clock.set_offset_secs(0);
                    j.note(format!("m{i}'s clock stepped back to real time"));
                    m.fault = Fault::None;
                    m.owed = vec![Some(Instant::now() + rejoin); g];
                }
                _ => {}
            }
        }
        for (k, state) in lgs.iter_mut().enumerate() {
            match *state {
                Fault::Paused(t) if ending || now >= t => {
                    signal(c.lgs[k].pid(), "-CONT");
                    j.note(format!("SIGCONT lg{k}"));
                    *state = Fault::None;
                }
                Fault::Down(t) if ending || now >= t => {
                    c.lgs[k].restart().await;
                    j.note(format!("lg{k} restarted"));
                    *state = Fault::None;
                }
                _ => {}
            }
        }
        if ending {
            break;
        }
        // Ask the running lockgates which masters count.
        if now >= next_look {
            next_look = now + Duration::from_millis(100);
            for (k, state) in lgs.iter().enumerate() {
                if *state != Fault::None || ms.iter().all(|m| m.owed[k].is_none()) {
                    continue;
                }
                let asked = Instant::now();
                let Some(states) = c.lgs[k].masters(Duration::from_millis(500)).await else {
                    continue;
                };
                for (i, m) in ms.iter_mut().enumerate() {
                    if m.owed[k].is_some_and(|t| asked >= t)
                        && states.get(i).is_some_and(|s| s == "up")
                    {
                        m.owed[k] = None;
                        if !m.disturbed() {
                            j.note(format!("m{i} counts again on every lockgate"));
                        }
                    }
                }
            }
        }
        let disturbed = ms.iter().filter(|m| m.disturbed()).count();
        sum.most_disturbed = sum.most_disturbed.max(disturbed);
        // A rolling restart goes on as soon as its last pair counts again.
        if let Some((pairs, began)) = rolling.as_mut() {
            if disturbed == 0 {
                match pairs.pop() {
                    Some([a, b]) => {
                        for i in [a, b] {
                            c.masters[i].stop();
                            ms[i].fault = Fault::Down(now);
                        }
                        j.note(format!(
                            "rolling restart: SIGKILL m{a} and m{b}, restart both at once"
                        ));
                        if pairs.is_empty() {
                            let took = began.elapsed();
                            sum.rolling.push(took);
                            j.note(format!(
                                "rolling restart: every master restarted within {took:?}"
                            ));
                        }
                    }
                    None => rolling = None,
                }
            }
            tokio::time::sleep(TICK).await;
            continue;
        }
        if now >= next {
            let lg_free = lgs.iter().all(|f| *f == Fault::None);
            if rolling_due.first().is_some_and(|t| now >= *t) {
                // Wait for a quiet moment: nothing disturbed, both lockgates up.
                if disturbed == 0 && lg_free {
                    rolling_due.remove(0);
                    let mut order: Vec<usize> = (0..n).collect();
                    for i in (1..n).rev() {
                        order.swap(i, rng.range(0, i as u64) as usize);
                    }
                    // Every master, two at a time, the first one twice.
                    let pairs = vec![
                        [order[4], order[0]],
                        [order[2], order[3]],
                        [order[0], order[1]],
                    ];
                    j.fault(
                        "rolling restart",
                        format!("rolling restart of every master begins: {pairs:?} in reverse"),
                    );
                    rolling = Some((pairs, now));
                }
                tokio::time::sleep(TICK).await;
                continue;
            }
            let free: Vec<usize> = (0..n).filter(|&i| !ms[i].disturbed()).collect();
            let kind = rng.range(0, 9);
            let master_ok = disturbed < MAX_DISTURBED && !free.is_empty();
            match kind {
                0 | 1 if master_ok => {
                    let i = free[rng.range(0, free.len() as u64 - 1) as usize];
                    let d = rng.range(100, 1200);
                    signal(c.masters[i].pid(), "-STOP");
                    ms[i].fault = Fault::Paused(now + Duration::from_millis(d));
                    j.fault("master SIGSTOP", format!("SIGSTOP m{i} for {d} ms"));
                }
                2 if master_ok => {
                    let i = free[rng.range(0, free.len() as u64 - 1) as usize];
                    let d = rng.range(50, 1500);
                    c.masters[i].stop();
                    ms[i].fault = Fault::Down(now + Duration::from_millis(d));
                    j.fault(
                        "master SIGKILL, restart later",
                        format!("SIGKILL m{i}, down {d} ms"),
                    );
                }
                3 if master_ok => {
                    let i = free[rng.range(0, free.len() as u64 - 1) as usize];
                    c.masters[i].stop();
                    ms[i].fault = Fault::Down(now);
                    j.fault(
                        "master SIGKILL, restart at once",
                        format!("SIGKILL m{i}, restart at once"),
                    );
                }
                4 | 5 if master_ok && free.contains(&c.clock_master) => {
                    let i = c.clock_master;
                    let step = rng.range(3, 60) as i64;
                    let d = rng.range(1200, 3000);
                    c.clock.set_offset_secs(step);
                    ms[i].fault = Fault::Stepped(now + Duration::from_millis(d));
                    j.fault(
                        "master clock step",
                        format!("m{i}'s clock steps +{step} s for {d} ms"),
                    );
                }
                6 | 7 if lg_free => {
                    let k = rng.range(0, g as u64 - 1) as usize;
                    let d = rng.range(100, 1500);
                    c.lgs[k].kill();
                    lgs[k] = Fault::Down(now + Duration::from_millis(d));
                    j.fault(
                        "lockgate SIGKILL, restart",
                        format!("SIGKILL lg{k}, restart in {d} ms"),
                    );
                }
                8 | 9 if lg_free => {
                    let k = rng.range(0, g as u64 - 1) as usize;
                    let d = rng.range(100, 1500);
                    signal(c.lgs[k].pid(), "-STOP");
                    lgs[k] = Fault::Paused(now + Duration::from_millis(d));
                    j.fault("lockgate SIGSTOP", format!("SIGSTOP lg{k} for {d} ms"));
                }
                _ => {}
            }
            next = Instant::now() + Duration::from_millis(rng.range(100, 700));
        }
        tokio::time::sleep(TICK).await;
    }
    sum
}
