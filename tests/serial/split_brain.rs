//! A Sentinel split brain, between real processes: the old primary keeps
//! serving the lockgate cut off with it (A), while the sentinels, cut from
//! the old primary, promote the replica, which the other lockgate (B)
//! follows. What docs/sentinel.md promises and what it cannot, shown on
//! one run: each side has ONE lock store (asynchronous replication, no
//! quorum), so a lock granted on the old primary is granted again on the
//! new one once B's `locks.failover_delay_ms` is over (the documented
//! limit; the quorum is the remedy); B refuses acquisitions during that
//! delay; after the heal the sentinels demote the old primary, A follows
//! the new one without a restart (its sessions on the old one closed) and
//! holds its own delay; fencing tokens issued after the heal are above
//! every token issued on either side before. B names the old primary,
//! which still answers `ROLE` as a primary, as a second primary
//! (`second_primary`, issue 45) while the split lasts, and a third
//! lockgate beside B (C, `locks.require_one_primary`) refuses every grant
//! meanwhile, past its delay too, and serves again once the heal demoted
//! the old primary.
//!
//! How the paths are cut. lockgate A reaches each sentinel through its own
//! relay (`tests/support/relay.rs`), cut for the split: A sees neither
//! `+switch-master` nor any sentinel's answer, and keeps the primary in
//! force (a round of checks with no sentinel answering changes nothing).
//! The sentinels' path to the old primary cannot be a relay here: lockgate
//! connects to the address the sentinels name, so a relay they monitored
//! would carry A's sessions too, and cutting it would cut A from the old
//! primary (there is no address mapping in lockgate's Sentinel follower,
//! and `bind-source-addr` 127.0.0.2 left Redis 7.0's sentinel with no link
//! at all, so a relay cannot tell the sentinels' connections by source).
//! So the sentinels authenticate to the Redis servers as an ACL user of
//! their own (`sentinel auth-user`), and the split takes every command
//! from that user on the old primary (`ACL SETUSER … -@all`): the
//! sentinels' `PING`s and `INFO`s there are answered `-NOPERM`, so the old
//! primary is subjectively, then objectively down to them, while every
//! other client of it (lockgate A) is served as before. (Disabling the
//! user and killing its connections does not do it: a reconnect's failed
//! `AUTH` leaves the connection as the password-less default user, and its
//! `PING`s are answered.) The heal gives the user its commands back and
//! heals A's relays.

use crate::support;

use std::time::{Duration, Instant};

use support::relay::{Mode, Relay};
use support::resp::{call, direct};
use support::sentinel::{primary_field, sentinel_config, Group, MASTER};
use support::{Lockgate, RawClient, WAIT};

const SENTINEL_USER: &str = "lgsentinel";
const SENTINEL_PASS: &str = "lgsentinel-pass";
/// Each lockgate's `locks.failover_delay_ms`.
const DELAY_MS: u64 = 3_000;
/// Leases of the locks taken during the split: longer than the test's
/// split, so both holders are still within their leases at the heal.
const LEASE_MS: &str = "30000";

/// The token of a granted `LOCKGATE LOCK` reply (`*2\r\n:TOKEN…`).
fn token(reply: &str) -> u64 {
    assert!(reply.starts_with("*2\r\n:"), "not granted: {reply:?}");
    reply.split("\r\n").nth(1).expect("a token")[1..]
        .parse()
        .expect("an integer token")
}

fn primary_of(lg: &Lockgate) -> String {
    lg.ctx
        .primary_addr
        .addr()
        .map(|a| a.to_string())
        .unwrap_or_default()
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after the epoch")
        .as_millis() as u64
}

fn refused(lg: &Lockgate) -> u64 {
    lockgate::metrics::ProxyMetrics::get(&lg.ctx.primary_addr.metrics.failover_refused)
}

/// The group (the sentinels authenticating as their own ACL user), the
/// relays from A to each sentinel, A (through them), B and C (directly,
/// C with `locks.require_one_primary`), all following the primary.
async fn start() -> (Group, Vec<Relay>, Lockgate, Lockgate, Lockgate) {
    let (primary, replica) = Group::pair().await;
    let (old, new) = (primary.addr(), replica.addr());
    // The sentinels' own user, on both (the replica is promoted).
    for addr in [&old, &new] {
        let pass = format!(">{SENTINEL_PASS}");
        let setuser = [
            "ACL",
            "SETUSER",
            SENTINEL_USER,
            "on",
            &pass,
            "+@all",
            "allchannels",
        ];
        assert_eq!(direct(addr, &setuser).await, "+OK\r\n");
    }
    let extra = format!(
        "sentinel auth-user {MASTER} {SENTINEL_USER}\nsentinel auth-pass {MASTER} {SENTINEL_PASS}\n"
    );
    let group = Group::with_sentinels(primary, replica, &extra).await;

    // A reaches the sentinels through relays; B directly.
    let relays: Vec<Relay> = {
        let mut r = Vec::new();
        for s in group.addrs() {
            r.push(Relay::to(&s).await);
        }
        r
    };
    let tune = |mut c: lockgate::Config, id: &str| {
        c.locks.instance_id = id.to_string();
        c.locks.failover_delay_ms = Some(DELAY_MS);
        // Every attempt reaches the lock room's rules: a "not acquired"
        // below is the failover delay's, not a cached "known held".
        c.locks.retry.probe_interval_ms = 0;
        c.locks.retry.park_ms = 0;
        c
    };
    let relay_addrs: Vec<String> = relays.iter().map(|r| r.host_port()).collect();
    let lg_a = Lockgate::start_with(tune(sentinel_config(&relay_addrs), "split-a")).await;
    let lg_b = Lockgate::start_with(tune(sentinel_config(&group.addrs()), "split-b")).await;
    let mut one = tune(sentinel_config(&group.addrs()), "split-c");
    one.locks.require_one_primary = true;
    one.locks.eviction_check_ms = 100;
    let lg_c = Lockgate::start_with(one).await;
    for lg in [&lg_a, &lg_b, &lg_c] {
        until!(
            "each lockgate to confirm the primary",
            primary_of(lg) == old
        );
    }
    (group, relays, lg_a, lg_b, lg_c)
}
/// During the split B and C name the old primary as a second one; C,
/// which requires one primary, refuses grants past its delay.
async fn second_primary_named(lg_b: &Lockgate, lg_c: &Lockgate, old: &str, new: &str) {
    for lg in [lg_b, lg_c] {
        until!(
            "the old primary named a second primary",
            second_primaries(lg) == [old.to_string()]
        );
    }
    assert!(
        primary_field(&mut RawClient::connect(lg_b.addr).await, "unsafe")
            .await
            .contains("second_primary")
    );
    let mut c = RawClient::connect(lg_c.addr).await;
    let refused_c = call(&mut c, &["SET", "lock:c", "c", "NX", "PX", LEASE_MS]).await;
    assert_eq!(
        refused_c,
        format!("-ERR lockgate: locks refused on the primary {new}: the former primary {old} still accepts writes (locks.require_one_primary)\r\n")
    );
}

/// Once the heal demoted the old primary: no second primary, C grants.
async fn second_primary_cleared(lg_b: &Lockgate, lg_c: &Lockgate) {
    for lg in [lg_b, lg_c] {
        until!(
            "the second primary cleared",
            second_primaries(lg).is_empty()
        );
    }
    let mut c = RawClient::connect(lg_c.addr).await;
    assert_eq!(
        call(&mut c, &["SET", "lock:c", "c", "NX", "PX", LEASE_MS]).await,
        "+OK\r\n"
    );
}

/// The former primaries `lg` finds still answering as primaries.
fn second_primaries(lg: &Lockgate) -> Vec<String> {
    let formers = &lg.ctx.primary_memory.safety.formers;
    (formers.still_primaries().iter())
        .map(|a| a.to_string())
        .collect()
}

#[tokio::test]
async fn a_sentinel_split_brain_two_stores_one_per_side_then_one_again() {
    let _one = crate::SERIAL.lock().await;
    let started = Instant::now();
    let (group, relays, lg_a, lg_b, lg_c) = start().await;
    let (old, new) = (group.primary.addr(), group.replica.addr());
    let mut a = RawClient::connect(lg_a.addr).await;
    let mut b = RawClient::connect(lg_b.addr).await;
    let mut tokens_before: Vec<u64> = Vec::new();
    tokens_before.push(token(
        &call(&mut a, &["LOCKGATE", "LOCK", "lock:pre", "1000"]).await,
    ));
    tokens_before.push(token(
        &call(&mut b, &["LOCKGATE", "LOCK", "lock:pre2", "1000"]).await,
    ));
    // A session of B on the old primary, closed at B's switch.
    let mut b_session = RawClient::connect(lg_b.addr).await;
    assert_eq!(
        call(&mut b_session, &["SET", "before", "1"]).await,
        "+OK\r\n"
    );
    assert_eq!(direct(&old, &["WAIT", "1", "5000"]).await, ":1\r\n");

    // The split: the sentinels lose the old primary, A loses the sentinels.
    for r in &relays {
        r.set(Mode::Cut);
    }
    let cut = Instant::now();
    let off = ["ACL", "SETUSER", SENTINEL_USER, "-@all"];
    assert_eq!(direct(&old, &off).await, "+OK\r\n");
    let follow = Duration::from_secs(20);
    while Group::role(&new).await != "master" {
        assert!(
            cut.elapsed() < follow,
            "the sentinels did not promote {new}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let promoted = cut.elapsed();
    while primary_of(&lg_b) != new {
        assert!(
            cut.elapsed() < follow,
            "B did not follow the promoted {new}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let b_switched = Instant::now();
    let b_followed = cut.elapsed();
    assert!(
        b_session.closed_within(WAIT).await,
        "B's session on the old primary stays open after B's switch"
    );

    // Side A: the old primary is still a master to A, which grants on it.
    assert_eq!(Group::role(&old).await, "master");
    assert_eq!(primary_of(&lg_a), old, "A followed although cut off");
    let mut a_holder = RawClient::connect(lg_a.addr).await;
    assert_eq!(
        call(
            &mut a_holder,
            &["SET", "lock:split", "a", "NX", "PX", LEASE_MS]
        )
        .await,
        "+OK\r\n",
        "A grants on the old primary during the split"
    );
    let mut a_fencer = RawClient::connect(lg_a.addr).await;
    let t_a = token(
        &call(
            &mut a_fencer,
            &["LOCKGATE", "LOCK", "lock:fenced", LEASE_MS],
        )
        .await,
    );
    tokens_before.push(t_a);
    // The grant never reaches the new primary: it replicates nothing now.
    assert_eq!(direct(&new, &["EXISTS", "lock:split"]).await, ":0\r\n");

    // Side B: every acquisition refused during B's delay after its switch.
    let mut b2 = RawClient::connect(lg_b.addr).await;
    let mut refused_attempts = 0u64;
    while b_switched.elapsed() < Duration::from_millis(DELAY_MS - 1_000) {
        assert_eq!(
            call(&mut b2, &["SET", "lock:split", "b", "NX", "PX", LEASE_MS]).await,
            "$-1\r\n",
            "B granted lock:split {} ms after its switch, within its {DELAY_MS} ms delay",
            b_switched.elapsed().as_millis()
        );
        assert_eq!(
            call(&mut b2, &["LOCKGATE", "LOCK", "lock:fenced", "1000"]).await,
            "$-1\r\n",
            "B granted a fenced lock within its delay"
        );
        refused_attempts += 2;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(refused_attempts >= 4, "{refused_attempts}");
    assert!(refused(&lg_b) >= refused_attempts, "{}", refused(&lg_b));
    // Once B's delay is over, B grants the same lock on its side: two
    // holders, one per side (the documented limit of one primary).
    // B's switch as B recorded it (wall clock ms, taken before its delay
    // started): this test saw the switch a poll later.
    let switch_ms: u64 = primary_field(&mut b2, "last_switch_unix_ms")
        .await
        .parse()
        .expect("ms");
    let mut granted_b_at = None;
    while granted_b_at.is_none() {
        let r = call(&mut b2, &["SET", "lock:split", "b", "NX", "PX", LEASE_MS]).await;
        if r == "+OK\r\n" {
            granted_b_at = Some(unix_ms() - switch_ms);
        } else {
            assert_eq!(r, "$-1\r\n");
            assert!(b_switched.elapsed() < Duration::from_millis(DELAY_MS) + WAIT);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let granted_b_at = granted_b_at.expect("granted");
    assert!(
        granted_b_at >= DELAY_MS,
        "B granted {granted_b_at} ms after its switch"
    );
    let mut b_fencer = RawClient::connect(lg_b.addr).await;
    let t_b = token(
        &call(
            &mut b_fencer,
            &["LOCKGATE", "LOCK", "lock:fenced", LEASE_MS],
        )
        .await,
    );
    tokens_before.push(t_b);
    second_primary_named(&lg_b, &lg_c, &old, &new).await;
    assert_eq!(direct(&old, &["GET", "lock:split"]).await, "$1\r\na\r\n");
    assert_eq!(direct(&new, &["GET", "lock:split"]).await, "$1\r\nb\r\n");
    // Both are clock-based (max(counter, the server's clock in µs) + 1) and
    // both servers run on this box's clock: the later grant's token is the
    // higher, so a fenced store shared by both sides would refuse A's
    // writes once B wrote. Servers on different clocks promise no order.
    assert!(t_b > t_a, "B's token {t_b} not above A's earlier {t_a}");

    // The heal.
    let healed = Instant::now();
    let on = ["ACL", "SETUSER", SENTINEL_USER, "+@all"];
    assert_eq!(direct(&old, &on).await, "+OK\r\n");
    for r in &relays {
        r.heal();
    }
    // A follows as soon as its relays let the sentinels' answer through;
    // the sentinels demote the old primary only later (a sentinel waits
    // some seconds before reconfiguring a returning old master, so its new
    // configuration has spread first): watched side by side.
    let (mut a_followed, mut demoted, mut a_held) = (None, None, None);
    while a_followed.is_none() || demoted.is_none() {
        if a_followed.is_none() && primary_of(&lg_a) == new {
            let switched = Instant::now();
            a_followed = Some(healed.elapsed());
            // A holds its own delay after its switch.
            let mut c = RawClient::connect(lg_a.addr).await;
            let reply = call(&mut c, &["SETNX", "lock:after-heal", "a"]).await;
            a_held = Some((reply, switched.elapsed()));
        }
        if demoted.is_none() && Group::role(&old).await == "slave" {
            demoted = Some(healed.elapsed());
        }
        assert!(
            healed.elapsed() < follow,
            "after the heal: A followed {new} after {a_followed:?}, {old} demoted after {demoted:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (a_followed, demoted) = (a_followed.expect("followed"), demoted.expect("demoted"));
    let (held_reply, asked_after) = a_held.expect("asked");
    assert!(
        asked_after < Duration::from_millis(DELAY_MS - 500),
        "A's SETNX after its switch took {asked_after:?}: its delay not checked"
    );
    assert_eq!(
        held_reply, ":0\r\n",
        "A granted within its delay after its switch"
    );
    assert!(refused(&lg_a) >= 1);
    for (what, c) in [
        ("holder", &mut a_holder),
        ("fencer", &mut a_fencer),
        ("session", &mut a),
    ] {
        assert!(
            c.closed_within(WAIT).await,
            "A's {what} on the old primary stays open after A's switch"
        );
    }
    let mut a2 = RawClient::connect(lg_a.addr).await;
    assert_eq!(primary_field(&mut a2, "switches").await, "1");
    assert_eq!(primary_field(&mut a2, "last_switch_from").await, old);
    // The old primary resynchronised from the new one: A's grant is gone.
    until!(
        "the demoted primary to resynchronise",
        direct(&old, &["GET", "lock:split"]).await == "$1\r\nb\r\n"
    );
    second_primary_cleared(&lg_b, &lg_c).await;
    // Writes through A land on the new primary.
    assert_eq!(call(&mut a2, &["SET", "after", "a"]).await, "+OK\r\n");
    assert_eq!(direct(&new, &["GET", "after"]).await, "$1\r\na\r\n");

    // Tokens after the heal, through either lockgate, are above every
    // token issued on either side before it.
    let highest = *tokens_before.iter().max().expect("tokens");
    until!(
        "A's delay to end",
        primary_field(&mut a2, "failover_hold_ms").await == "0"
    );
    let after_a = token(&call(&mut a2, &["LOCKGATE", "LOCK", "lock:post", "1000"]).await);
    let mut b3 = RawClient::connect(lg_b.addr).await;
    let after_b = token(&call(&mut b3, &["LOCKGATE", "LOCK", "lock:post2", "1000"]).await);
    assert!(
        after_a > highest && after_b > highest,
        "tokens after the heal {after_a}, {after_b} not above {highest} ({tokens_before:?})"
    );
    // lock:fenced is still B's on the new primary (A's grant went with the
    // old primary's data): A's attempt on it is refused.
    assert_eq!(
        call(&mut a2, &["LOCKGATE", "LOCK", "lock:fenced", "1000"]).await,
        "$-1\r\n"
    );
    println!(
        "split brain: replica promoted {} ms after the cut, B followed after {} ms, \
         B refused {refused_attempts} attempts then granted lock:split {} ms after its switch \
         (delay {DELAY_MS} ms); tokens A {t_a} < B {t_b}; after the heal: old primary demoted \
         after {} ms, A followed after {} ms, tokens after {after_a}/{after_b} > {highest}; \
         total {} ms",
        promoted.as_millis(),
        b_followed.as_millis(),
        granted_b_at,
        demoted.as_millis(),
        a_followed.as_millis(),
        started.elapsed().as_millis()
    );
    lg_a.stop().await;
    lg_b.stop().await;
    lg_c.stop().await;
}
