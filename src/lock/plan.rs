//! Turning a lock operation into the Redis command that carries it out
//! ([`LockService::plan`]), and learning its outcome from the facts its
//! script returns ([`LockService::complete`]).

use bytes::Bytes;

use super::evalsha::Call;
use super::hotkeys::Event;
use super::lease::{self, ConnLocks, Standing};
use super::ops::{LockOp, Ttl};
use super::storm::HandedOver;
use super::{owner_key, places_key, queue_key, Database, LockPending, LockService, Planned};
use crate::metrics::ProxyMetrics;
use crate::script::argv::{AcquireArgv, ExtendArgv, ReleaseArgv, ReleaseHandoffArgv, TakeoverArgv};
use crate::script::{self, Script};

/// Whether Redis runs a planned command at once or queues it in a
/// `MULTI`: a queued command's reply must be the bare client reply (its
/// facts come back inside `EXEC`'s array, unseen).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Queueing {
    /// Runs now; the script returns `{reply, facts}`.
    Now,
    /// Queued by `MULTI`; the script returns the bare reply.
    InMulti,
}

/// Whether an acquisition is a client's attempt (counted) or one
/// lockgate makes on a parked client's behalf (counted when it arrived).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Attempt {
    Counted,
    OnBehalf,
}

/// Whether a release may hand the lock to an attempt parked here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Handoff {
    Offer,
    No,
}

/// What an acquisition's reply carries: the facts, the facts and the
/// master's clock (the quorum), or the compact reply of the uncontended
/// `SETNX` ([`script::ACQUIRE`]'s info `"3"`, see [`super::fast`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClockFact {
    Read,
    Skip,
    Compact,
}

impl LockService {
    /// Turns `op` into the Redis command that performs it, recording
    /// acquisitions in `conn`. `queueing`: whether Redis queues it in a
    /// `MULTI`.
    pub(crate) fn plan(&self, op: LockOp, conn: &mut ConnLocks, queueing: Queueing) -> Planned {
        self.plan_with(
            op,
            conn,
            queueing,
            Attempt::Counted,
            Handoff::No,
            ClockFact::Skip,
        )
    }

    /// [`LockService::plan`] of an acquisition on the quorum: its facts
    /// also carry the master's clock ([`script::ACQUIRE_CLOCK_FACT`]).
    /// `counted`: false for an attempt made on a parked client's behalf
    /// (as [`LockService::plan_for_handoff`]).
    pub(crate) fn plan_on_quorum(
        &self,
        op: LockOp,
        conn: &mut ConnLocks,
        counted: bool,
    ) -> Planned {
        let attempt = match counted {
            true => Attempt::Counted,
            false => Attempt::OnBehalf,
        };
        self.plan_with(
            op,
            conn,
            Queueing::Now,
            attempt,
            Handoff::No,
            ClockFact::Read,
        )
    }

    /// [`LockService::plan`] on one Redis (not the quorum), in the
    /// client's database `db`: in database 0, a release of one lock key
    /// that attempts of this instance are parked on also hands the lock to
    /// the oldest of them ([`script::RELEASE_HANDOFF`]); elsewhere it
    /// hands nothing over (they wait in database 0) and the outcome teaches
    /// the contention table nothing (see [`Database`]). The caller settles
    /// the handoff with [`LockService::finish_handoff`] when
    /// [`LockService::complete`] reports one.
    /// `compact`: an acquisition asks for the compact reply of the
    /// uncontended `SETNX` (see [`super::fast`]).
    pub(crate) fn plan_on_primary(
        &self,
        op: LockOp,
        conn: &mut ConnLocks,
        queueing: Queueing,
        db: Database,
        compact: bool,
    ) -> Planned {
        let offer = match db {
            Database::Zero => Handoff::Offer,
            Database::Other => Handoff::No,
        };
        let facts = match compact {
            true => ClockFact::Compact,
            false => ClockFact::Skip,
        };
        let mut planned = self.plan_with(op, conn, queueing, Attempt::Counted, offer, facts);
        if let Some(
            LockPending::Acquire { db: at, .. }
            | LockPending::Release { db: at, .. }
            | LockPending::Extend { db: at, .. },
        ) = &mut planned.pending
        {
            *at = db;
        }
        planned
    }

    /// [`LockService::plan`] for an acquisition lockgate makes on a parked
    /// client's behalf (a handoff or the driver's probe): the client's
    /// attempt was counted when it arrived, so this one is not.
    pub(crate) fn plan_for_handoff(&self, op: LockOp, conn: &mut ConnLocks) -> Planned {
        let (queueing, handoff) = (Queueing::Now, Handoff::No);
        self.plan_with(
            op,
            conn,
            queueing,
            Attempt::OnBehalf,
            handoff,
            ClockFact::Skip,
        )
    }

    fn plan_with(
        &self,
        op: LockOp,
        conn: &mut ConnLocks,
        queueing: Queueing,
        attempt: Attempt,
        offer: Handoff,
        clock: ClockFact,
    ) -> Planned {
        let in_multi = queueing == Queueing::InMulti;
        let info: &[u8] = if in_multi { b"0" } else { b"1" };
        // Only acquisitions read the master's clock (`"2"`).
        let acquire_info: &[u8] = match (clock, queueing) {
            (ClockFact::Read, Queueing::Now) => b"2",
            (ClockFact::Compact, Queueing::Now) => b"3",
            _ => info,
        };
        if in_multi {
            ProxyMetrics::inc(&self.metrics.in_transaction);
        }
        let ownership: &[u8] = if self.rules().any {
            b"any"
        } else {
            b"instance"
        };
        let prefix = self.tokens.prefix().as_bytes();
        let born = conn.born.to_string();
        let born = born.as_bytes();
        let evicted = conn.evicted;
        let (command, pending) = match op {
            LockOp::Acquire {
                key,
                value,
                ttl,
                shape,
            } => {
                if attempt == Attempt::Counted {
                    ProxyMetrics::inc(&self.metrics.attempts);
                    self.hot.record(&key, Event::Attempt);
                }
                let token = self.tokens.next();
                let lease = self.lease_ms(&key);
                self.granting(super::quorum::ops::lease_of(&ttl, lease).unwrap_or(lease));
                let (kind, amount) = match &ttl {
                    Ttl::Default => ("PX", Bytes::from(lease.to_string())),
                    Ttl::Given(kind, v) => (*kind, v.clone()),
                };
                conn.attempt(
                    key.clone(),
                    token.clone(),
                    value.clone(),
                    Standing::Trying,
                    lease,
                );
                let owner = owner_key(&key);
                let (queue, places) = (queue_key(&key), places_key(&key));
                let (bound, window) = self.fairness_for(&key);
                let (bound, window) = (bound.to_string(), window.to_string());
                // A probe of a held lock renews this instance's place in
                // the queue only when due (the quorum's masters: always).
                let fresh = !in_multi && clock != ClockFact::Read && self.storm.place_fresh(&key);
                let argv = AcquireArgv {
                    info: acquire_info,
                    value: &value,
                    token: &token,
                    ttl_kind: kind.as_bytes(),
                    ttl: &amount,
                    shape: shape.as_str().as_bytes(),
                    prefix,
                    bound_ms: bound.as_bytes(),
                    place_ms: window.as_bytes(),
                    renew: if fresh { b"0" } else { b"1" },
                };
                let cmd = Call::new(
                    Script::Acquire,
                    &[&key, &owner, &queue, &places],
                    &argv.slots(),
                );
                (
                    cmd,
                    LockPending::Acquire {
                        key,
                        token,
                        value,
                        shape,
                        primary_at: self.primary_at_if_acked(),
                        park: None,
                        db: Database::Zero,
                    },
                )
            }
            LockOp::Release {
                lock_keys,
                plain,
                unlink,
                by_value,
            } => {
                let n = lock_keys.len().to_string();
                let owners: Vec<Bytes> = lock_keys.iter().map(|k| owner_key(k)).collect();
                let queues: Vec<Bytes> = lock_keys.iter().map(|k| queue_key(k)).collect();
                let places: Vec<Bytes> = lock_keys.iter().map(|k| places_key(k)).collect();
                // By value (a library's release script), the scripts check
                // the key's value against the library's, not the owner
                // record against this connection's token.
                if by_value.is_some() {
                    ProxyMetrics::inc(&self.metrics.library_releases);
                }
                let (ownership, tokens, alts): (&[u8], Vec<Bytes>, Vec<Bytes>) = match &by_value {
                    Some(value) => (
                        b"value",
                        lock_keys.iter().map(|_| value.clone()).collect(),
                        lock_keys.iter().map(|_| Bytes::new()).collect(),
                    ),
                    None => (
                        ownership,
                        lock_keys.iter().map(|k| conn.release_token(k)).collect(),
                        lock_keys.iter().map(|k| conn.attempt_tokens(k).1).collect(),
                    ),
                };
                let mut keys: Vec<&[u8]> = Vec::new();
                for (((k, o), q), p) in lock_keys.iter().zip(&owners).zip(&queues).zip(&places) {
                    keys.push(k);
                    keys.push(o);
                    keys.push(q);
                    keys.push(p);
                }
                keys.extend(plain.iter().map(|k| &k[..]));
                let verb: &[u8] = if unlink { b"UNLINK" } else { b"DEL" };
                let claim = match (&lock_keys[..], &tokens[..], &alts[..]) {
                    ([key], [token], [alt])
                        if offer == Handoff::Offer && !in_multi && plain.is_empty() =>
                    {
                        self.storm
                            .claim(key, self.tokens.next(), self.handoff_within)
                            .map(|c| (c, token, alt))
                    }
                    _ => None,
                };
                let cmd = match (&claim, lock_keys.first()) {
                    (Some((c, token, alt)), Some(key)) => {
                        let lease = c.lease_ms.to_string();
                        let (bound, window) = self.fairness_for(key);
                        let (bound, window) = (bound.to_string(), window.to_string());
                        let argv = ReleaseHandoffArgv {
                            info,
                            verb,
                            ownership,
                            prefix,
                            token,
                            next_value: &c.value,
                            next_token: &c.token,
                            next_lease_ms: lease.as_bytes(),
                            alt,
                            born,
                            bound_ms: bound.as_bytes(),
                            place_ms: window.as_bytes(),
                        };
                        Call::new(
                            Script::ReleaseHandoff,
                            &[key, &owner_key(key), &queue_key(key), &places_key(key)],
                            &argv.slots(),
                        )
                    }
                    _ => {
                        let argv = ReleaseArgv {
                            info,
                            n: n.as_bytes(),
                            verb,
                            ownership,
                            prefix,
                            born,
                        };
                        Call::new(Script::Release, &keys, &argv.with(&tokens, &alts))
                    }
                };
                let handoff = claim.map(|(c, _, _)| c);
                (
                    cmd,
                    LockPending::Release {
                        keys: lock_keys,
                        handoff,
                        upto: self.tokens.issued(),
                        db: Database::Zero,
                        by_value,
                    },
                )
            }
            LockOp::Extend { key, command, args } => {
                let (token, alt) = conn.attempt_tokens(&key);
                let owner = owner_key(&key);
                let argv = ExtendArgv {
                    info,
                    ownership,
                    prefix,
                    token: &token,
                    alt: &alt,
                    born,
                    command: command.as_bytes(),
                };
                let cmd = Call::new(Script::Extend, &[&key, &owner], &argv.with(&args));
                let upto = self.tokens.issued();
                let db = Database::Zero;
                let primary_at = self.primary_at_if_acked();
                let pending = LockPending::Extend {
                    key,
                    upto,
                    db,
                    primary_at,
                };
                (cmd, pending)
            }
            LockOp::Takeover { key, command, args } => {
                self.plan_takeover(key, command, &args, conn, info)
            }
        };
        ProxyMetrics::add(&self.metrics.conn_table_evictions, conn.evicted - evicted);
        Planned {
            call: command,
            // Inside MULTI its reply comes in EXEC's array, passed as it
            // is: kept only for a grant the replicas must acknowledge.
            pending: (!in_multi || self.acks_asked()).then_some(pending),
        }
    }

    /// The call and pending outcome of a takeover of `key` by `command`
    /// (`GETSET`, `SET` without NX…) with `args` after the key.
    fn plan_takeover(
        &self,
        key: Bytes,
        command: &'static str,
        args: &[Bytes],
        conn: &mut ConnLocks,
        info: &[u8],
    ) -> (Call, LockPending) {
        ProxyMetrics::inc(&self.metrics.takeovers);
        let token = self.tokens.next();
        let lease = self.lease_ms(&key);
        self.granting(lease);
        // A takeover makes the lock this instance's for releases:
        // in the GETSET-timestamp recipe several clients GETSET and
        // only the one that read the stale value holds the lock, so
        // any of them may release it (the instance rule), as on
        // plain Redis. The connection that took it over holds it
        // for extensions (`SET k v` then `EXPIRE k`).
        conn.took_over(key.clone(), token.clone(), lease);
        let owner = owner_key(&key);
        let lease_s = lease.to_string();
        let argv = TakeoverArgv {
            info,
            token: &token,
            lease_ms: lease_s.as_bytes(),
            command: command.as_bytes(),
        };
        let cmd = Call::new(Script::Takeover, &[&key, &owner], &argv.with(args));
        let primary_at = self.primary_at_if_acked();
        (
            cmd,
            LockPending::Takeover {
                key,
                token,
                primary_at,
            },
        )
    }

    /// Learns the outcome of a planned command from the facts its script
    /// returned after the client's reply (see [`script`]), updating `conn`
    /// and the counters. A release that handed its lock over returns the
    /// handoff, for [`LockService::finish_handoff`] once `conn` is unlocked
    /// (the new holder's records are another connection's).
    pub(crate) fn complete(
        &self,
        pending: LockPending,
        facts: &[i64],
        conn: &mut ConnLocks,
    ) -> Option<HandedOver> {
        let mut handed_over = None;
        match pending {
            LockPending::Acquire {
                key,
                token,
                value,
                db,
                ..
            } => {
                // In another database the table neither probed nor learns.
                let storm = (db == Database::Zero).then_some(&*self.storm);
                let Some(&acquired) = facts.first() else {
                    // An error reply: nothing learned, and the next attempt
                    // must see the error too.
                    if let Some(storm) = storm {
                        storm.unprobe(&key);
                    }
                    return None;
                };
                let pttl = facts.get(1).copied().unwrap_or(-1);
                let dropped = fact(facts, script::ACQUIRE_DROPPED_FACT);
                ProxyMetrics::add(&self.metrics.queue_places_lapsed, dropped);
                if fact(facts, script::ACQUIRE_YIELD_FACT) == 1 {
                    ProxyMetrics::inc(&self.metrics.fairness_yields);
                }
                let scale = facts.get(script::ACQUIRE_BEHIND_FACT).copied();
                let behind_ms = self.behind_ms(&key, scale.unwrap_or(0));
                if let Some(storm) = storm {
                    storm.learned(&key, acquired == 1, pttl, behind_ms);
                    storm.placed(&key, fact(facts, script::ACQUIRE_PLACED_FACT));
                }
                if acquired == 1 {
                    ProxyMetrics::inc(&self.metrics.acquired);
                    self.hot.record(&key, Event::Acquired);
                    if let Some(first) = conn.first_try(&key) {
                        let wait = first.elapsed();
                        self.metrics.wait_seconds.observe(wait.as_secs_f64());
                        (self.metrics.wait_buckets).observe_ms(wait.as_secs_f64() * 1e3);
                        self.hot.record(
                            &key,
                            Event::Waited {
                                wait_ms: wait.as_millis() as u64,
                            },
                        );
                    }
                    conn.settle(
                        &key,
                        &token,
                        Standing::Held,
                        (pttl > 0).then_some(pttl as u64),
                    );
                    // A release by its value is real from now on.
                    self.storm.won_value(&key, &value);
                } else {
                    ProxyMetrics::inc(&self.metrics.contended);
                    conn.settle(&key, &token, Standing::Lost, None);
                    if let Some(storm) = storm {
                        storm.lost_value(&key, &value);
                    }
                }
            }
            LockPending::Release {
                keys,
                handoff,
                upto,
                db,
                by_value,
            } => {
                let (released, denied, lapsed) = (fact(facts, 0), fact(facts, 1), fact(facts, 2));
                ProxyMetrics::add(&self.metrics.released, released);
                ProxyMetrics::add(&self.metrics.release_denied, denied);
                ProxyMetrics::add(&self.metrics.stale_conn_denied, fact(facts, 4));
                ProxyMetrics::add(&self.metrics.fairness_yields, fact(facts, 5));
                let dropped = fact(facts, script::RELEASE_DROPPED_FACT);
                ProxyMetrics::add(&self.metrics.queue_places_lapsed, dropped);
                let handed = fact(facts, 3) == 1;
                let handoff_none = handoff.is_none();
                // Yielded to another instance first in the queue: the
                // waiter it was for took a place behind it (the script did).
                let scale = match fact(facts, 5) {
                    1 => facts.get(script::HANDOFF_BEHIND_FACT).copied().unwrap_or(0),
                    _ => 0,
                };
                match (handoff, keys.first()) {
                    (Some(claim), Some(key)) if handed => {
                        handed_over = self.storm.hand_over(key, claim);
                    }
                    (Some(claim), Some(key)) => self.storm.unclaim(key, &claim),
                    _ => {}
                }
                // A transaction's release also says which keys it freed
                // that had no owner record (no queue wakes this instance).
                let freed = match handoff_none {
                    true => fact(facts, script::RELEASE_FREED_FACT),
                    false => 0,
                };
                if (released > 0 || freed > 0) && !handed {
                    for key in &keys {
                        match (scale, db) {
                            // Another database's queue says nothing of
                            // database 0's: only the drop is kept.
                            (0, _) | (_, Database::Other) => self.storm.released(key),
                            (s, Database::Zero) => self.storm.yielded(key, self.behind_ms(key, s)),
                        }
                    }
                }
                let mut lapsed_left = lapsed;
                for key in &keys {
                    if let Some(rec) = conn.released(key, upto) {
                        if released > 0 && rec.standing == Standing::Held {
                            self.held(key, &rec);
                            // A library's release by value on the holder's
                            // own connection: it may park again
                            // (`ConnLocks::holder_until`).
                            if by_value.is_some() {
                                conn.holder_until = None;
                            }
                        }
                        if lapsed_left > 0 && rec.standing == Standing::Held {
                            lapsed_left -= 1;
                            self.lapsed(key, &rec, "release", conn.id);
                        }
                    }
                }
            }
            LockPending::Extend { key, upto, db, .. } => {
                let (allowed, lapsed) = (fact(facts, 0), fact(facts, 1));
                ProxyMetrics::add(&self.metrics.stale_conn_denied, fact(facts, 3));
                if allowed == 0 {
                    ProxyMetrics::inc(&self.metrics.extend_denied);
                } else if let (Some(&pttl), Database::Zero) = (facts.get(2), db) {
                    // The holder moved its lease: lockgate's view follows
                    // (a lease shortened to 1 s frees the lock in 1 s).
                    self.storm.extended(&key, pttl);
                    conn.extended(&key, pttl);
                }
                // The holding lapsed: the attempts made before the
                // extension are over, as after a release. One pipelined
                // after it (`EXPIRE`, then `SET NX` on the key now free)
                // stays on record, or the acquisition it makes would be
                // nobody's and its holder's next `EXPIRE` refused.
                if lapsed > 0 && conn.get(&key).is_some_and(|r| r.standing == Standing::Held) {
                    if let Some(rec) = conn.released(&key, upto) {
                        self.lapsed(&key, &rec, "extend", conn.id);
                    }
                }
            }
            // Learned before it, from the same reply (`on_reply`).
            LockPending::Takeover { .. } | LockPending::Guard(_) | LockPending::InTx { .. } => {}
            // Its reply is read before (`LockService::on_reply`): `facts`
            // are the general script's.
            LockPending::Fast { then, .. } => return self.complete(*then, facts, conn),
            LockPending::Script { keys, sent, .. } => {
                for key in &keys {
                    // An attempt answered "held" from what lockgate knew
                    // while the script was on its way may have been told
                    // so of a lock already free: its caller, a library's
                    // waiter, may now wait for a wake-up already taken.
                    let stale = self.storm.refused_since(key, sent);
                    self.storm.released(key);
                    conn.scripted(key);
                    if stale {
                        self.recheck_waiters(key);
                    }
                }
            }
            // Acknowledged (an error reply never gets here, see
            // `LockService::on_reply`).
            LockPending::Forget(what) => self.forget(&what),
        }
        handed_over
    }

    /// A lock library's release by value of `keys` ran: the
    /// holdings of this instance's connections acquired with `value`
    /// (before the token numbered `upto`) end too, as the releasing
    /// connection's would, wherever they are (a LIFO pool sends the
    /// release on whichever connection it lends the holder). Left held,
    /// `LOCKGATE LOCKS` would list the holding until the connection that
    /// acquired closed or tried the key again, and that connection's polls
    /// would be taken for a re-entrant holder's (never parked).
    pub(crate) fn released_by_value(&self, keys: &[Bytes], value: &[u8], upto: u64) {
        for key in keys {
            for rec in self.conns.end_by_value(key, value, upto) {
                self.held(key, &rec);
            }
        }
    }

    /// A holding of `key` ended by its release (lockgate's own, or a
    /// library's script): how long it lasted is counted in
    /// `lock_hold_seconds` and in the key's own histogram.
    pub(crate) fn held(&self, key: &[u8], rec: &super::lease::Acquisition) {
        let held = rec.since.elapsed();
        self.metrics.hold_seconds.observe(held.as_secs_f64());
        let held_ms = held.as_millis() as u64;
        self.hot.record(key, Event::Released { held_ms });
    }

    /// Settles a handoff a release made ([`LockService::complete`]): the
    /// new holder's connection records the acquisition (as if its own
    /// attempt had won), then its parked attempt is answered "acquired".
    /// Call it holding no connection's lock table.
    pub(crate) fn finish_handoff(&self, handed: HandedOver) {
        let claim = handed.claim.clone();
        {
            let mut c = crate::sync::lock(&handed.conn);
            c.attempt(
                handed.key.clone(),
                claim.token.clone(),
                claim.value.clone(),
                Standing::Trying,
                claim.lease_ms,
            );
            let pending = LockPending::Acquire {
                key: handed.key.clone(),
                token: claim.token.clone(),
                value: claim.value.clone(),
                shape: handed.shape,
                primary_at: 0,
                park: None,
                db: Database::Zero,
            };
            // An acquisition hands nothing over.
            let _ = self.complete(pending, &[1, claim.lease_ms as i64], &mut c);
        }
        let key = handed.key.clone();
        // The replicas must hold it before the waiter is told.
        // The release that handed it over was just answered: the primary
        // in force granted it.
        let won = self.acks_asked().then(|| super::replicas::Won {
            undo: true,
            primary_at: self.primary_at(),
            lease_ms: claim.lease_ms,
            key: key.clone(),
            token: claim.token.clone(),
            value: claim.value.clone(),
            no: super::replicas::not_acquired(handed.shape),
        });
        if let Some(won) = won {
            let yes = super::storm::shaped(handed.shape, true);
            if let Ok(rx) = self.gate(won, &handed.conn, yes) {
                if let Some(reply) = handed.reply {
                    tokio::spawn(async move {
                        if let Ok(answer) = rx.await {
                            let _ = reply.send(answer);
                        }
                    });
                }
                return;
            }
        }
        if !handed.deliver() {
            // It went away while the release was on its way: the lease runs
            // out, as after a handoff by the driver.
            tracing::debug!(key = %String::from_utf8_lossy(&key), "handoff to an attempt no longer waiting");
        }
    }

    /// Counts, keeps for operators ([`super::lapses`]) and (rate-limited)
    /// reports a lease that ran out before its holder (connection `id`)
    /// released or extended it. Never logs values or tokens.
    fn lapsed(
        &self,
        key: &[u8],
        rec: &lease::Acquisition,
        during: &'static str,
        id: lease::ConnId,
    ) {
        ProxyMetrics::inc(&self.metrics.lease_expired_before_release);
        let held_ms = rec.since.elapsed().as_millis() as u64;
        let overrun_ms = held_ms.saturating_sub(rec.lease_ms);
        self.lapses.record(super::lapses::Lapse {
            key: Bytes::copy_from_slice(key),
            // The holder's records are locked here: never wait for the
            // registry (`Conns::client_now`).
            client: self.conns.client_now(id),
            held_ms,
            lease_ms: rec.lease_ms,
            overrun_ms,
            during,
            at_unix_ms: crate::lock::quorum::now_unix_ms(),
        });
        if let Some(more) = self.lapse_warn.check() {
            tracing::warn!(
                key = %String::from_utf8_lossy(key),
                held_ms,
                lease_ms = rec.lease_ms,
                overrun_ms,
                during,
                suppressed = more,
                "lease expired before release: the critical section outlived its lease"
            );
        }
    }
}

fn fact(facts: &[i64], i: usize) -> u64 {
    facts.get(i).copied().unwrap_or(0).max(0) as u64
}
