//! Chaos against the Redlock quorum with lockgate run as it runs in
//! production: two lockgate subprocesses (SIGKILLed and restarted,
//! SIGSTOPped) in front of 5 real redis-server lock masters (SIGSTOPped,
//! SIGKILLed and restarted empty, restarted all in a row, one with its wall
//! clock stepped forward and back under libfaketime) and a primary, while
//! 12 workers take one lock key three ways: the legacy `SETNX` / `EXPIRE`
//! / `DEL` pattern through pools that reconnect silently, `SET k uuid NX
//! PX` with the compare-and-delete release, and `LOCKGATE LOCK`/`UNLOCK`
//! with fencing tokens. Some holders are paused past their lease and woken
//! while another holder is inside, then finish late.
//!
//! Checked (see `tests/serial/chaos/checks.rs`): no two valid sections overlap (a
//! section is valid from its grant until its release or acquire-sent +
//! lease − drift), no lost update on the counter between two valid
//! sections, the store that refuses lower tokens never refuses a valid
//! holder nor accepts an older acquisition's token over a newer one, and
//! tokens grow in grant order. Errors ("no quorum", a lockgate down) are
//! availability losses, counted; an outage of one client longer than
//! `QUORUM_CHAOS_OUTAGE_MS` fails, since a majority always stays up.
//!
//! Knobs (defaults in brackets): `QUORUM_CHAOS_SEED` [a fixed seed],
//! `QUORUM_CHAOS_SECS` [35 s of workload], `QUORUM_CHAOS_LEASE_MS` [1000],
//! `QUORUM_CHAOS_DRIFT_MS` [150, what a client takes off its lease],
//! `QUORUM_CHAOS_NODE_TIMEOUT_MS` [200], `QUORUM_CHAOS_PAUSE_ONE_IN` [30:
//! one section in that many is paused], `QUORUM_CHAOS_OUTAGE_MS` [10000],
//! `QUORUM_CHAOS_MONITOR` [unset; a directory: every master's `MONITOR`
//! stream is written there, timed like the failure report, for a
//! post-mortem].

use crate::chaos;
use crate::support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chaos::checks::{judge, Journal, Kind, Records};
use chaos::clients::{worker, ClientReport, Shared};
use chaos::faults::{self, Cluster};
use chaos::Tuning;
use support::quorum::fake_clock::FakeClock;
use support::rng::env_u64;
use support::RedisServer;

/// Workers of each kind (half through each lockgate).
const PER_KIND: usize = 4;

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Starts the primary, 5 masters (one under a fake clock) and two lockgate
/// subprocesses, and waits until both count every master.
async fn start(t: &Tuning) -> Cluster {
    assert!(
        FakeClock::available(),
        "libfaketime is needed for the clock step: apt-get install faketime"
    );
    let primary = RedisServer::start();
    let clock = FakeClock::new();
    let clock_master = 3;
    let masters: Vec<RedisServer> = (0..5)
        .map(|i| match i == clock_master {
            true => clock.start_redis(),
            false => RedisServer::start(),
        })
        .collect();
    let addrs: Vec<String> = masters.iter().map(|m| m.addr()).collect();
    let lgs = chaos::two_lockgates(&primary.addr(), &addrs, t).await;
    Cluster {
        primary,
        masters,
        clock,
        clock_master,
        lgs,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_stay_exclusive_and_fenced_under_chaos() {
    let _one = crate::SERIAL.lock().await;
    let began = Instant::now();
    let seed = env_u64("QUORUM_CHAOS_SEED", 0xc4a0_5eed);
    let secs = env_u64("QUORUM_CHAOS_SECS", 35);
    let lease_ms = env_u64("QUORUM_CHAOS_LEASE_MS", 1000);
    let tuning = Tuning {
        lease_ms,
        rejoin_ms: lease_ms + 200,
        node_timeout_ms: env_u64("QUORUM_CHAOS_NODE_TIMEOUT_MS", 200),
        drift_ms: env_u64("QUORUM_CHAOS_DRIFT_MS", 150),
    };
    let outage_limit = Duration::from_millis(env_u64("QUORUM_CHAOS_OUTAGE_MS", 10_000));
    let pause_one_in = env_u64("QUORUM_CHAOS_PAUSE_ONE_IN", 30);
    println!(
        "quorum_chaos: QUORUM_CHAOS_SEED={seed} secs={secs} {tuning:?} pause 1 in {pause_one_in}"
    );
    let mut cluster = start(&tuning).await;
    let until = Instant::now() + Duration::from_secs(secs);
    let sh = Arc::new(Shared {
        journal: Journal::new(),
        tuning,
        lgs: cluster.lgs.iter().map(|l| l.addr).collect(),
        until,
        stop: AtomicBool::new(false),
        next_id: AtomicU64::new(0),
        inside: AtomicUsize::new(0),
        entered: tokio::sync::Notify::new(),
        pause_one_in,
    });
    let _monitors = std::env::var_os("QUORUM_CHAOS_MONITOR").map(|dir| {
        let addrs: Vec<String> = cluster.masters.iter().map(|m| m.addr()).collect();
        chaos::monitor::start(&addrs, std::path::Path::new(&dir), sh.journal.epoch)
    });
    let mut tasks = Vec::new();
    for (n, kind) in [Kind::Legacy, Kind::SetNx, Kind::Fence]
        .into_iter()
        .enumerate()
    {
        for k in 0..PER_KIND {
            let id = n * PER_KIND + k;
            tasks.push(tokio::spawn(worker(id, kind, id % 2, sh.clone(), seed)));
        }
    }
    let rejoin = Duration::from_millis(tuning.rejoin_ms);
    let summary = faults::run(&mut cluster, &sh.journal, seed, until, rejoin).await;
    let mut reports: Vec<ClientReport> = Vec::new();
    for t in tasks {
        reports.push(t.await.expect("worker"));
    }
    let records = std::mem::take(&mut *sh.journal.r.lock().expect("journal"));
    let v = judge(&records);

    // Figures.
    let mut by_kind: BTreeMap<Kind, (u64, u64, u64)> = BTreeMap::new();
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    let mut outage = Duration::ZERO;
    for r in &reports {
        let e = by_kind.entry(r.kind.expect("kind")).or_default();
        e.0 += r.acquired;
        e.1 += r.not_acquired;
        e.2 += r.release_refused;
        for (k, n) in &r.errors {
            *errors.entry(k.clone()).or_default() += n;
        }
        outage = outage.max(r.longest_outage);
    }
    let tokens: Vec<i64> = records.sections.iter().filter_map(|s| s.token).collect();
    let paused = records.sections.iter().filter(|s| s.paused).count();
    println!(
        "quorum_chaos seed {seed}: acquisitions {by_kind:?} (acquired, not acquired, releases \
         refused); faults {:?}; most masters disturbed at once {}; rolling restarts took {:?}; \
         overlaps {}; lost updates {} (+{} involving a section past its validity); fencing \
         refusals of valid holders {} (late ex-holders refused: {}); old tokens accepted {}; \
         token order {}; sections exposed to a pooled late DEL {}; token range {:?}..{:?}; paused holders {paused}; availability errors \
         {errors:?}; longest outage of one client {outage:?}; took {:?}; load average {}",
        records.fault_counts,
        summary.most_disturbed,
        summary.rolling,
        v.overlaps.len(),
        v.lost.len(),
        v.lost_benign,
        v.fence_refused_valid.len(),
        v.fence_refused_late,
        v.old_token_accepted.len(),
        v.token_order.len(),
        v.exposed,
        tokens.iter().min(),
        tokens.iter().max(),
        began.elapsed(),
        load_average()
    );
    for e in &v.exposures {
        println!("quorum_chaos: {e}");
    }
    println!(
        "quorum_chaos seed {seed}: liveness: {} starved WAIT runs away from faults, {} during \
         them (>= {:?}, reported)",
        v.starved.len(),
        v.starved_in_faults.len(),
        chaos::checks::STARVED_SPAN
    );
    for s in v.starved.iter().chain(&v.starved_in_faults).take(4) {
        println!("quorum_chaos: {s}");
    }
    if !v.clean() || !v.starved.is_empty() {
        let logs: Vec<String> = cluster
            .lgs
            .iter()
            .map(|l| format!("{}:\n{}", l.name, l.log_tail()))
            .collect();
        panic!(
            "SAFETY failure with QUORUM_CHAOS_SEED={seed}:\n{}\n\nlockgate logs:\n{}",
            v.first(6),
            logs.join("\n")
        );
    }
    assert!(
        outage <= outage_limit,
        "a client saw only errors for {outage:?} although a majority of masters was always up \
         (seed {seed}); errors: {:?}",
        records.errors.iter().rev().take(20).collect::<Vec<_>>()
    );
    for (kind, (acquired, _, _)) in &by_kind {
        assert!(
            *acquired >= 20,
            "only {acquired} {kind:?} acquisitions (seed {seed})"
        );
    }
    assert!(
        !summary.rolling.is_empty(),
        "no rolling restart completed (seed {seed})"
    );
}

/// A seed is a schedule: seeds next to each other (the 1..10 a soak runs)
/// must not replay one another's faults and workload.
#[test]
fn neighbouring_seeds_give_different_schedules() {
    use support::rng::XorShift;
    let starts: std::collections::BTreeSet<Vec<u64>> = (0..256u64)
        .map(|seed| {
            let mut rng = XorShift::new(seed);
            (0..4).map(|_| rng.next()).collect()
        })
        .collect();
    assert_eq!(starts.len(), 256, "two seeds of 0..256 share a schedule");
}

/// The judge exempts only what lockgate does not promise: a legacy `DEL`
/// answered after its section's validity may release a lock granted
/// through the same lockgate after its connection opened (the pooled
/// rule), never one granted before, nor one granted through the other
/// lockgate.
#[test]
fn judge_exempts_only_what_the_pooled_rule_allows() {
    use chaos::checks::{Release, Section};
    let ms = Duration::from_millis;
    let section = |id, kind, lg, sent: u64, start: u64, valid: u64, released: u64| Section {
        id,
        client: id as usize,
        kind,
        lg,
        token: None,
        sent: ms(sent),
        start: ms(start),
        valid_until: ms(valid),
        released: Some(ms(released)),
        paused: false,
        write_done: None,
        exposed: None,
    };
    let late_del = |opened: u64| Release {
        t: ms(2_000),
        section: 1,
        acquiring_conn: false,
        conn_opened: Some(ms(opened)),
        answered: ms(2_010),
        late: true,
        result: ":1".to_string(),
    };
    // Section 1: the paused legacy holder (lg0), valid until t+850. Its DEL
    // goes on a connection opened at `opened` and deletes section 2's lock
    // (lg0, granted t+2005); section 3 (lg1) then takes the free lock.
    let verdict = |opened: u64, lg2: usize| {
        judge(&Records {
            sections: vec![
                section(1, Kind::Legacy, 0, 0, 1, 850, 2_000),
                section(2, Kind::SetNx, lg2, 2_004, 2_005, 2_854, 2_100),
                section(3, Kind::SetNx, 1, 2_006, 2_012, 2_856, 2_200),
            ],
            releases: vec![late_del(opened)],
            ..Records::default()
        })
    };
    let allowed = verdict(1_999, 0);
    assert!(allowed.clean(), "{:?}", allowed.overlaps);
    assert_eq!(allowed.exposed, 1);
    // The connection opened after section 2's grant: lockgate promises
    // that such a DEL never releases it, so the overlap is a failure.
    let after = verdict(2_006, 0);
    assert_eq!(after.overlaps.len(), 1);
    assert_eq!(after.exposed, 0);
    // Section 2 through the other lockgate: never releasable.
    assert_eq!(verdict(1_999, 1).overlaps.len(), 1);

    // The cascade (seen under load): section 1's late DEL deletes section
    // 2's lock (lg0); section 3 takes the free lock through lg0; section
    // 2's holder, its lock gone, sends its DEL on its own connection (open
    // since t+100, before section 3's grant) and deletes section 3's lock;
    // section 4 takes it. Every DEL is the pooled rule's: clean, three
    // sections exposed. Without the cascade, 3 and 4 would overlap.
    let legacy = |id, sent: u64, start: u64, released: u64| {
        section(id, Kind::Legacy, 0, sent, start, start + 850, released)
    };
    let del = |section: u64, opened: u64, t: u64, late: bool| Release {
        t: ms(t),
        section,
        acquiring_conn: !late,
        conn_opened: Some(ms(opened)),
        answered: ms(t + 2),
        late,
        result: ":1".to_string(),
    };
    let cascade = judge(&Records {
        sections: vec![
            section(1, Kind::Legacy, 0, 0, 1, 850, 2_000),
            legacy(2, 1_990, 1_995, 2_030),
            legacy(3, 2_015, 2_020, 2_100),
            legacy(4, 2_035, 2_040, 2_090),
        ],
        releases: vec![
            del(1, 1_980, 2_000, true),
            del(2, 100, 2_030, false),
            del(3, 150, 2_100, false),
            del(4, 160, 2_090, false),
        ],
        ..Records::default()
    });
    assert!(cascade.clean(), "{}", cascade.first(3));
    assert!(cascade.exposed >= 2, "{:?}", cascade.exposures);
    // The same without section 1's late DEL: section 2 held its lock to
    // its DEL, which then found its own; 3 and 4 overlap, a failure.
    let held = judge(&Records {
        sections: vec![
            legacy(3, 2_015, 2_020, 2_100),
            legacy(4, 2_035, 2_040, 2_090),
        ],
        releases: vec![del(3, 150, 2_100, false), del(4, 160, 2_090, false)],
        ..Records::default()
    });
    assert_eq!(held.overlaps.len(), 1);
}
