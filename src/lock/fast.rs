//! The uncontended lock cycle at a few Redis commands' cost: a lock
//! operation that nothing says is contended runs as a small script with
//! few arguments and an integer reply ([`crate::script::RELEASE_FAST`],
//! [`crate::script::EXTEND_FAST`]; a `SETNX` runs [`crate::script::ACQUIRE`] asking for
//! its compact reply, which takes its short way when the key has no
//! queue) instead of the general ones, whose queue, fairness and facts it
//! does not need.
//!
//! Why scripts at all: Redis 7.0 has no command that deletes one key on
//! the value of another, so an owner-checked release of a legacy lock
//! (whose value, often `1`, says nothing of who holds it) is atomic only
//! in a script or a `WATCH`ed transaction, which costs Redis more (five
//! commands and two round trips). What a Lua call costs Redis grows with
//! its arguments and the size of its reply, not with the length of its
//! body: these take two or three arguments and answer one integer on the
//! common path (`docs/performance.md` has the figures).
//!
//! The truth stays in Redis: each fast script makes the same owner check,
//! in the same atomic step, as the general one. What lockgate knows
//! locally only picks the script: a key this instance has seen contended
//! (attempts parked or queued, a holder elsewhere known, behind another
//! instance) takes the general path, and a fast attempt's refusal teaches
//! the contention table, so the next attempt on that key takes it too.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use super::evalsha::{Call, Rerun};
use super::lease::{ConnLocks, Standing};
use super::ops::{LockOp, Shape, Ttl};
use super::{owner_key, places_key, queue_key, LockPending, LockService, Planned};
use super::{Attempt, ReplyOutcome};
use crate::script::Script;

/// What the primary's server offers lock operations besides scripts, as
/// lockgate's own connection to it saw when it last opened (`COMMAND INFO
/// MSETEX`, see [`crate::upstream::node::Report`]): a hint. A switch of
/// the primary is seen when that connection opens again; meanwhile a
/// native call the server refuses runs again as the general script
/// ([`LockService::native_missed`]) and the hint is dropped.
#[derive(Debug, Default)]
pub struct Natives {
    msetex: AtomicBool,
}

impl Natives {
    /// `MSETEX` (Valkey 9.1, Redis 8.4): both keys of an acquisition set in
    /// one command, only if neither exists.
    pub fn msetex(&self) -> bool {
        self.msetex.load(Ordering::Relaxed)
    }

    /// The server refused a native command: scripts until its next
    /// connection says otherwise.
    pub fn refused(&self) {
        self.msetex.store(false, Ordering::Relaxed);
    }
}

impl crate::upstream::node::Observer for Natives {
    fn connected(&self, _connection: u64, _addr: &str, report: &crate::upstream::node::Report) {
        self.msetex.store(report.msetex, Ordering::Relaxed);
    }
}

/// Which fast script a planned call was rewritten to, so its reply is
/// read as that script answers ([`read`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fast {
    /// [`crate::script::ACQUIRE`]'s compact reply, for a `SETNX`.
    Acquire {
        /// The lease given, ms.
        lease_ms: i64,
    },
    /// [`crate::script::RELEASE_FAST`].
    Release,
    /// `MSETEX` of a `SETNX` ([`LockService::native`]): `1`, acquired with
    /// this lease (ms); anything else runs the general script.
    Native {
        /// The lease given, ms.
        lease_ms: i64,
    },
    /// [`crate::script::EXTEND_FAST`], the lease the command gives in ms (`<= 0`:
    /// the key goes).
    Extend {
        /// The lease the command sets, ms.
        lease_ms: i64,
    },
    /// A plain `PTTL` standing for an attempt on a lock known held
    /// ([`LockService::check`]): held (anything but `-2`), not acquired
    /// with that PTTL learned; free, or an error, the general script runs
    /// in its place ([`LockService::checked`]).
    Probe {
        /// What the client expects back.
        shape: Shape,
    },
}

/// What [`LockService::fast_path`] saw before planning: enough to rewrite
/// the general plan into the fast script's call.
#[derive(Debug)]
pub(crate) enum Before {
    /// A `SETNX` on a quiet key.
    Acquire,
    /// A `SETNX` on a quiet key, as `MSETEX` (the server has it).
    Native,
    /// The release of one key this connection holds by `token`.
    Release {
        /// The connection's acquisition token.
        token: Bytes,
        /// A release by value (a library's release script): the key's
        /// value must be this too.
        value: Option<Bytes>,
    },
    /// A relative extension (`EXPIRE`/`PEXPIRE k n`) by the holder.
    Extend {
        /// The holder's token.
        token: Bytes,
        /// The amount, as the client wrote it.
        amount: Bytes,
        /// The lease it sets, ms.
        lease_ms: i64,
    },
}

impl LockService {
    /// Whether `op`, about to be planned on one Redis outside `MULTI`, can
    /// take a fast script, and what that needs: a `SETNX` (the legacy
    /// lock: its reply is an integer) on a key nothing here says is
    /// contended; the release of exactly one lock key that this connection
    /// holds by its own token, with no other attempt of it unsettled; its
    /// relative `EXPIRE`/`PEXPIRE` without options. Under ownership `any`
    /// releases and extensions check nothing of the token, so they keep the
    /// general script (its `any` branch).
    /// `native`: a native command may be sent (its reply is read, and the
    /// client's database is known for its fallback).
    pub(crate) fn fast_path(&self, op: &LockOp, conn: &ConnLocks, native: bool) -> Option<Before> {
        // One read of the rules (a lock and an Arc clone each).
        let rules = self.rules();
        if !rules.fast_path {
            return None;
        }
        let any = rules.any;
        match op {
            LockOp::Acquire {
                key,
                shape: Shape::SetNx,
                ttl: Ttl::Default,
                ..
            } if self.retry_for(key).0 > 0 && self.storm.quiet(key) => {
                match native && self.store().natives.msetex() {
                    true => Some(Before::Native),
                    false => Some(Before::Acquire),
                }
            }
            LockOp::Release {
                lock_keys,
                plain,
                by_value,
                ..
            } if (!any || by_value.is_some()) && lock_keys.len() == 1 && plain.is_empty() => {
                let key = &lock_keys[0];
                let (token, alt) = holding(conn, key, true)?;
                let value = by_value.clone();
                alt.is_empty().then_some(Before::Release { token, value })
            }
            LockOp::Extend { key, command, args } if !any && args.len() == 1 => {
                let unit: i64 = match *command {
                    "EXPIRE" => 1000,
                    "PEXPIRE" => 1,
                    _ => return None,
                };
                let amount = crate::protocol::request::parse_int(&args[0])?;
                let (token, alt) = holding(conn, key, false)?;
                alt.is_empty().then_some(Before::Extend {
                    token,
                    amount: args[0].clone(),
                    lease_ms: amount.saturating_mul(unit),
                })
            }
            _ => None,
        }
    }

    /// `planned`, the general plan of `op`, as the fast script's call when
    /// the plan kept to what [`LockService::fast_path`] saw (a release that
    /// hands the lock to an attempt parked here keeps the general script:
    /// the handoff is its work).
    pub(crate) fn fast(&self, op: &LockOp, before: Before, planned: Planned) -> Planned {
        let Some(pending) = planned.pending else {
            return planned;
        };
        let (call, read) = match (op, before, &pending) {
            // The general script, asked for its compact reply when planned.
            (LockOp::Acquire { key, .. }, Before::Acquire, LockPending::Acquire { .. }) => {
                let lease_ms = i64::try_from(self.lease_ms(key)).unwrap_or(i64::MAX);
                (planned.call, Fast::Acquire { lease_ms })
            }
            (
                LockOp::Release {
                    lock_keys, unlink, ..
                },
                Before::Release { token, value },
                LockPending::Release { handoff: None, .. },
            ) => {
                let key = &lock_keys[0];
                let verb: &[u8] = if *unlink { b"UNLINK" } else { b"DEL" };
                let keys: [&[u8]; 4] = [key, &owner_key(key), &queue_key(key), &places_key(key)];
                let call = match value {
                    Some(value) => Call::new(Script::ReleaseFast, &keys, &[&token, verb, &value]),
                    None => Call::new(Script::ReleaseFast, &keys, &[&token, verb]),
                };
                (call, Fast::Release)
            }
            (
                LockOp::Extend { key, command, .. },
                Before::Extend {
                    token,
                    amount,
                    lease_ms,
                },
                LockPending::Extend { .. },
            ) => {
                let argv: [&[u8]; 3] = [&token, command.as_bytes(), &amount];
                let call = Call::new(Script::ExtendFast, &[key, &owner_key(key)], &argv);
                (call, Fast::Extend { lease_ms })
            }
            _ => {
                return Planned {
                    call: planned.call,
                    pending: Some(pending),
                }
            }
        };
        crate::metrics::ProxyMetrics::inc(&self.metrics.fast_calls);
        Planned {
            call,
            pending: Some(LockPending::Fast {
                read,
                then: Box::new(pending),
            }),
        }
    }
}

impl LockService {
    /// The `SETNX` planned as `planned` (the general script, its fallback)
    /// as `MSETEX 2 key value owner token NX PX lease`: both keys set in one
    /// command, only if neither exists. Its `0` (the lock held, or an owner
    /// record left behind lockgate's back) decides nothing: the general
    /// script runs in its place ([`LockService::native_missed`]), so the
    /// answer, the record and the queue are the general script's.
    /// `Err(planned)` when the plan is not an acquisition (boxed: it is
    /// large, and the path is never taken for a `SETNX`).
    pub(crate) fn native(&self, op: &LockOp, planned: Planned) -> Result<Attempt, Box<Planned>> {
        let (LockOp::Acquire { key, value, .. }, Some(LockPending::Acquire { token, .. })) =
            (op, &planned.pending)
        else {
            return Err(Box::new(planned));
        };
        let lease = self.lease_ms(key);
        let lease_s = lease.to_string();
        let command = crate::protocol::encode::command(&[
            b"MSETEX",
            b"2",
            key,
            value,
            &owner_key(key),
            token,
            b"NX",
            b"PX",
            lease_s.as_bytes(),
        ]);
        let Some(then) = planned.pending else {
            return Err(Box::new(planned));
        };
        crate::metrics::ProxyMetrics::inc(&self.metrics.native_calls);
        let lease_ms = i64::try_from(lease).unwrap_or(i64::MAX);
        Ok(Attempt::Native {
            command,
            pending: LockPending::Fast {
                read: Fast::Native { lease_ms },
                then: Box::new(then),
            },
            fallback: planned.call,
        })
    }

    /// When `frame` answers a native acquisition without deciding it
    /// (`MSETEX`'s `0`, or an error: the server refused the command), the
    /// general script runs in its place on lockgate's own connection, in
    /// the client's database, and its reply takes the command's (as after
    /// `NOSCRIPT`: commands pipelined behind it ran before it). `None`:
    /// `frame` decided it.
    pub(crate) fn native_missed(
        self: &Arc<Self>,
        pending: &LockPending,
        rerun: &Option<Rerun>,
        frame: &[u8],
        conn: &Arc<Mutex<ConnLocks>>,
    ) -> Option<ReplyOutcome> {
        let LockPending::Fast {
            read: Fast::Native { .. },
            then,
        } = pending
        else {
            return None;
        };
        let rerun = rerun.as_ref()?;
        if frame == b":1\r\n" {
            return None;
        }
        if frame.first() == Some(&b'-') {
            // Refused (renamed, unknown after a switch of the primary):
            // scripts until the next connection says otherwise.
            self.store().natives.refused();
        }
        crate::metrics::ProxyMetrics::inc(&self.metrics.native_reruns);
        let call = rerun.call.eval_in(rerun.db);
        let failed = "the lock script could not run";
        Some(self.in_place((**then).clone(), call, failed, conn))
    }
}

impl LockService {
    /// An attempt on a lock known held whose probe is due (see
    /// [`super::storm::Admission::Check`]), as a plain `PTTL` of the key in
    /// its place: all a probe of a held lock can learn is whether it still
    /// is, and a plain command costs Redis a fraction of a script call.
    /// `planned` is the general plan (the attempt recorded, its token
    /// taken): it runs in the attempt's place if the lock turns out free.
    pub(crate) fn check(&self, op: &LockOp, planned: Planned) -> Result<Attempt, Box<Planned>> {
        let (LockOp::Acquire { key, shape, .. }, Some(then)) = (op, &planned.pending) else {
            return Err(Box::new(planned));
        };
        if *shape == Shape::SetGet {
            return Err(Box::new(planned));
        }
        crate::metrics::ProxyMetrics::inc(&self.metrics.checks);
        Ok(Attempt::Native {
            command: crate::protocol::encode::command(&[b"PTTL", key]),
            pending: LockPending::Fast {
                read: Fast::Probe { shape: *shape },
                then: Box::new(then.clone()),
            },
            fallback: planned.call,
        })
    }

    /// The reply to a plain probe ([`LockService::check`]), if `pending`
    /// is one: the lock still held (an integer but `-2`), the attempt
    /// failed, learned and answered (or parked) as the general script's
    /// failure would be; free, or an error, the general script runs in the
    /// attempt's place on lockgate's own connection, its answer the
    /// client's (as after `NOSCRIPT`: commands pipelined behind it ran
    /// before it). `behind`: something waits behind the reply, so the
    /// attempt is not parked.
    pub(crate) fn checked(
        self: &Arc<Self>,
        pending: &LockPending,
        rerun: &Option<Rerun>,
        frame: &[u8],
        conn: &Arc<Mutex<ConnLocks>>,
        behind: bool,
    ) -> Option<ReplyOutcome> {
        let LockPending::Fast {
            read: Fast::Probe { shape },
            then,
        } = pending
        else {
            return None;
        };
        let pttl = match (frame.first(), integers(frame).first()) {
            (Some(b':'), Some(&n)) => n,
            _ => -2,
        };
        if pttl != -2 {
            return Some(self.check_failed((**then).clone(), *shape, pttl, conn, behind));
        }
        crate::metrics::ProxyMetrics::inc(&self.metrics.check_reruns);
        let rerun = rerun.as_ref()?;
        let call = rerun.call.eval_in(rerun.db);
        let failed = "the lock script could not run";
        Some(self.in_place((**then).clone(), call, failed, conn))
    }
}

/// The token this connection holds `key` by and its other unsettled
/// attempts, if it holds it: for a release its own acquisition's (a
/// takeover releases by the instance rule, see `ConnLocks::token`), for an
/// extension its acquisition's or takeover's (`ConnLocks::attempt_tokens`).
fn holding(conn: &ConnLocks, key: &[u8], release: bool) -> Option<(Bytes, Bytes)> {
    let rec = conn.get(key)?;
    if rec.standing != Standing::Held {
        return None;
    }
    let (token, alt) = conn.attempt_tokens(key);
    let token = if release {
        conn.release_token(key)
    } else {
        token
    };
    (!token.is_empty()).then_some((token, alt))
}

/// The client's reply and the facts the general script would have given
/// (see [`crate::script`]) for `frame`, a fast script's whole reply. An
/// error (Redis's own: `OOM`, `NOSCRIPT`, a key of another type) passes to
/// the client as it is, with no facts, as the general script's would.
pub fn read(fast: Fast, frame: &Bytes) -> (Bytes, Vec<i64>) {
    let ints = integers(frame);
    let Some(&first) = ints.first() else {
        return (frame.clone(), Vec::new());
    };
    let zero = Bytes::from_static(b":0\r\n");
    match fast {
        // Acquired the short way: `1`, facts acquired and the lease given.
        // A failed attempt, or one on a key with a queue, took the general
        // way: the general reply.
        Fast::Acquire { lease_ms } if first == 1 && frame.first() == Some(&b':') => {
            (Bytes::from_static(b":1\r\n"), vec![1, lease_ms])
        }
        Fast::Acquire { .. } => {
            let (reply, facts) = super::split_reply(frame);
            (frame.slice_ref(reply), facts)
        }
        // Acquired (anything else ran the general script instead, see
        // `LockService::native_missed`).
        Fast::Native { lease_ms } => (Bytes::from_static(b":1\r\n"), vec![first.min(1), lease_ms]),
        // Held (anything else ran the general script instead, see
        // `LockService::checked`); its reply is made by the writer, in
        // the connection's protocol.
        Fast::Probe { .. } => (zero, vec![0, first]),
        // Facts: released, denied, lapsed, handed, stale, yielded,
        // lapsed places dropped.
        Fast::Release => match first {
            -1 => (zero, vec![0, 1, 1, 0, 0, 0, 0]),
            d => {
                let dropped = ints.get(1).copied().unwrap_or(0);
                let reply = Bytes::from(format!(":{d}\r\n"));
                (reply, vec![d, 0, 0, 0, 0, 0, dropped])
            }
        },
        // Facts: allowed, lapsed, PTTL afterwards, stale.
        Fast::Extend { lease_ms } => match first {
            -1 => (zero, vec![0, 1, -3, 0]),
            1 if lease_ms > 0 => (frame.clone(), vec![1, 0, lease_ms, 0]),
            _ => (frame.clone(), vec![1, 0, -2, 0]),
        },
    }
}

/// The integers of `frame`: itself when it is one (`:n`), its elements
/// when it is an array of integers; empty otherwise (an error).
fn integers(frame: &[u8]) -> Vec<i64> {
    let parse = |line: &[u8]| {
        line.strip_prefix(b":")
            .and_then(|l| l.strip_suffix(b"\r"))
            .and_then(crate::protocol::request::parse_int)
    };
    match frame.first() {
        Some(b':') => frame
            .split(|&c| c == b'\n')
            .next()
            .and_then(parse)
            .into_iter()
            .collect(),
        Some(b'*') => frame
            .split(|&c| c == b'\n')
            .skip(1)
            .filter_map(parse)
            .collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fast reply, the client's reply and the facts read from it.
    type Row = (Fast, &'static [u8], &'static [u8], Vec<i64>);

    fn read_of(fast: Fast, frame: &'static [u8]) -> (Vec<u8>, Vec<i64>) {
        let (reply, facts) = read(fast, &Bytes::from_static(frame));
        (reply.to_vec(), facts)
    }

    #[test]
    fn fast_replies_read_as_the_general_scripts_facts() {
        let acquire = Fast::Acquire { lease_ms: 30000 };
        let extend = Fast::Extend { lease_ms: 5000 };
        let gone = Fast::Extend { lease_ms: 0 };
        let table: [Row; 10] = [
            (acquire, b":1\r\n", b":1\r\n", vec![1, 30000]),
            (acquire, b"-OOM no\r\n", b"-OOM no\r\n", vec![]),
            (
                acquire,
                b"*7\r\n:0\r\n:0\r\n:900\r\n:0\r\n:1\r\n:2\r\n:0\r\n",
                b":0\r\n",
                vec![0, 900, 0, 1, 2, 0],
            ),
            (
                Fast::Release,
                b":1\r\n",
                b":1\r\n",
                vec![1, 0, 0, 0, 0, 0, 0],
            ),
            (
                Fast::Release,
                b":0\r\n",
                b":0\r\n",
                vec![0, 0, 0, 0, 0, 0, 0],
            ),
            (
                Fast::Release,
                b":-1\r\n",
                b":0\r\n",
                vec![0, 1, 1, 0, 0, 0, 0],
            ),
            (
                Fast::Release,
                b"*2\r\n:1\r\n:3\r\n",
                b":1\r\n",
                vec![1, 0, 0, 0, 0, 0, 3],
            ),
            (extend, b":1\r\n", b":1\r\n", vec![1, 0, 5000, 0]),
            (extend, b":-1\r\n", b":0\r\n", vec![0, 1, -3, 0]),
            (gone, b":1\r\n", b":1\r\n", vec![1, 0, -2, 0]),
        ];
        for (fast, frame, reply, facts) in table {
            assert_eq!(
                read_of(fast, frame),
                (reply.to_vec(), facts),
                "{fast:?} {frame:?}"
            );
        }
        // The key was gone: Redis's 0, the lease gone.
        assert_eq!(
            read_of(extend, b":0\r\n"),
            (b":0\r\n".to_vec(), vec![1, 0, -2, 0])
        );
    }
}
