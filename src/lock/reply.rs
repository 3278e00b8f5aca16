//! The outcome of a lock script's reply, decided in the lock room: the
//! facts are learned ([`LockService::complete`]), a handoff the release
//! made is settled, and a failed attempt that may wait is parked. The
//! session's writer only hands the reply over and writes what it is told.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::oneshot;

use super::evalsha::{self, Rerun};
use super::lease::{ConnLocks, Standing};
use super::replicas::Won;
use super::storm::Acquirer;
use super::txn::refuses_scripts;
use super::{split_reply, LockPending, LockService, Park};
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;
use crate::sync;

/// What the client gets for a lock script's reply.
#[derive(Debug)]
pub enum ReplyOutcome {
    /// These bytes, now: the client's reply with its command's shape.
    Reply(Bytes),
    /// This reply, now, in the connection's protocol (a plain probe's
    /// "not acquired": `SET … NX` answers nil, `_` in RESP3).
    Local(LocalReply),
    /// A failed attempt was parked: its reply comes when the lock is
    /// handed to it or its wait ends, and every later reply waits for it.
    Parked(oneshot::Receiver<LocalReply>),
    /// Redis had lost the script (`NOSCRIPT`): it runs again elsewhere
    /// ([`LockService::in_place`]), and every later reply waits for its reply.
    Rerun(oneshot::Receiver<LocalReply>),
}

impl LockService {
    /// The outcome of `frame`, Redis's whole reply to the lock call planned
    /// for `pending` on the client's own connection `conn`: when Redis lost
    /// the script (`NOSCRIPT`) and `rerun` says how, it runs again on
    /// lockgate's own connection and its reply takes this one's place
    /// (never waited for past the server's drain); otherwise as
    /// [`LockService::on_reply`], a parked attempt's driver acquiring
    /// through this lock room's store. `behind`: the connection has sent
    /// more since (something waits for its reply behind this one), so a
    /// failed attempt is answered at once, never parked: parked, it would
    /// hold up the replies behind it.
    pub(crate) fn outcome(
        self: &Arc<Self>,
        pending: LockPending,
        rerun: Option<Rerun>,
        frame: Bytes,
        conn: &Arc<Mutex<ConnLocks>>,
        behind: bool,
    ) -> ReplyOutcome {
        let mut pending = pending;
        if behind {
            unparkable(&mut pending);
        }
        if let Some(outcome) = self.checked(&pending, &rerun, &frame, conn, behind) {
            return outcome;
        }
        if let Some(outcome) = self.native_missed(&pending, &rerun, &frame, conn) {
            return outcome;
        }
        // The server refuses scripts (an ACL without `EVALSHA`, or renamed
        // since lockgate's own connection opened): from now on lock
        // operations go as transactions, this one first, in its place.
        if let (Some(rerun), Some(txn)) = (&rerun, &self.store().primary.txn) {
            if refuses_scripts(&frame) {
                txn.observed(true);
                // A guarded write has no transaction form: refused, and
                // from now on not checkable (`guard::Uncheckable::Scriptless`).
                if matches!(pending, LockPending::Guard(_)) {
                    return ReplyOutcome::Reply(self.scripts_refused(frame));
                }
                let failed = "the server refuses scripts and the lock transaction failed";
                let call = rerun.call.eval_in(rerun.db);
                return self.in_place(pending, call, failed, conn);
            }
        }
        let Some(rerun) = rerun.filter(|_| evalsha::is_noscript(&frame)) else {
            // A client's own script (a lock library's release or
            // extension) ran: owner records follow what it did.
            if let LockPending::Script {
                keys,
                values,
                db: crate::lock::Database::Zero,
                ..
            } = &pending
            {
                if !super::forget::is_error(&frame) {
                    self.reconcile(keys, values, conn);
                }
            }
            let acquirer = || -> Arc<dyn Acquirer> { self.clone() };
            return self.on_reply(pending, frame, conn, acquirer);
        };
        self.script_epoch.lost(rerun.epoch);
        ProxyMetrics::inc(&self.metrics.noscript_reruns);
        let failed = "Redis lost the lock script (NOSCRIPT) and running it again failed";
        self.in_place(pending, rerun.call.eval_in(rerun.db), failed, conn)
    }

    /// Runs `call`, the lock call planned for `pending` as RESP (`EVAL` in
    /// the client's database), on lockgate's own connection in the place
    /// of the client's command, and learns its outcome as
    /// [`LockService::on_reply`] would have; its reply, waiting for a
    /// handoff if the attempt parks but never past the server's drain, is
    /// the client's. Commands the client pipelined after it ran before it.
    /// `failed` says what could not be done, should lockgate's own call
    /// fail: the client's error and the outcome learned.
    pub(crate) fn in_place(
        self: &Arc<Self>,
        pending: LockPending,
        call: Bytes,
        failed: &'static str,
        conn: &Arc<Mutex<ConnLocks>>,
    ) -> ReplyOutcome {
        let (tx, rx) = oneshot::channel();
        let (me, conn) = (self.clone(), conn.clone());
        tokio::spawn(async move {
            let store = me.store();
            let acquirer = || -> Arc<dyn Acquirer> { me.clone() };
            let run = async {
                match store.primary.call(call, store.timeout()).await {
                    Ok(frame) => me.own_outcome(pending, frame, &conn, acquirer).await,
                    Err(e) => {
                        // Nothing learned: the attempt settles as after an
                        // error.
                        let text = format!("ERR lockgate: {failed}: {e}");
                        let frame = LocalReply::Error(Bytes::from(text.clone())).to_bytes(false);
                        let _ = me.on_reply(pending, frame, &conn, acquirer);
                        LocalReply::Error(Bytes::from(text))
                    }
                }
            };
            // A rerun that parked may wait for a handoff: never past the
            // server's drain.
            let reply = tokio::select! {
                reply = run => reply,
                _ = store.stopped() => LocalReply::err("lockgate: shutting down"),
            };
            let _ = tx.send(reply);
        });
        ReplyOutcome::Rerun(rx)
    }

    /// The client's reply to a lock call lockgate ran on its own (RESP2)
    /// connection, `frame` being Redis's reply: learned as
    /// [`LockService::on_reply`] would, waiting for a handoff if the attempt
    /// parks (a `NOSCRIPT` rerun, a transaction's lock command run by
    /// lockgate on one Redis).
    pub(crate) async fn own_outcome(
        &self,
        pending: LockPending,
        frame: Bytes,
        conn: &Arc<Mutex<ConnLocks>>,
        acquirer: impl FnOnce() -> Arc<dyn Acquirer>,
    ) -> LocalReply {
        match self.on_reply(pending, frame, conn, acquirer) {
            ReplyOutcome::Reply(reply) => evalsha::own_reply(reply),
            ReplyOutcome::Local(reply) => reply,
            ReplyOutcome::Parked(rx) | ReplyOutcome::Rerun(rx) => rx
                .await
                .unwrap_or_else(|_| LocalReply::err("lockgate: internal error (reply lost)")),
        }
    }

    /// Learns the outcome of `frame`, Redis's whole reply to the script
    /// planned for `pending` on `conn`'s behalf, and says what the client
    /// gets. `acquirer` acquires for a parked attempt when the lock frees.
    pub(crate) fn on_reply(
        &self,
        pending: LockPending,
        frame: Bytes,
        conn: &Arc<Mutex<ConnLocks>>,
        acquirer: impl FnOnce() -> Arc<dyn Acquirer>,
    ) -> ReplyOutcome {
        let frame = match &pending {
            LockPending::Script { .. } | LockPending::Forget(_) | LockPending::InTx { .. } => frame,
            _ => self.scripts_refused(frame),
        };
        if let LockPending::Guard(g) = pending {
            return ReplyOutcome::Reply(self.guard_reply(g, frame));
        }
        if let LockPending::InTx {
            grants,
            slots,
            then,
        } = pending
        {
            // What else the transaction did (a release) is learned first;
            // what it answers (a guarded transaction's array) is EXEC's.
            let frame = match then.map(|t| self.on_reply(*t, frame.clone(), conn, acquirer)) {
                Some(ReplyOutcome::Reply(reply)) => reply,
                _ => frame,
            };
            return self.exec_acked(grants, slots, frame, conn);
        }
        let (reply, facts, pending) = match pending {
            LockPending::Fast { read, then } => {
                let (reply, facts) = super::fast::read(read, &frame);
                (reply, facts, *then)
            }
            p => {
                let (reply, facts) = general(&p, &frame);
                (reply, facts, p)
            }
        };
        // Refused: it changed nothing, so nothing is dropped.
        if matches!(pending, LockPending::Forget(_)) && super::forget::is_error(&frame) {
            return ReplyOutcome::Reply(frame);
        }
        let park = failed_attempt(&pending, &facts);
        // A grant the replicas must hold before it is answered.
        let won = match self.acks_asked() {
            true => Won::of(&pending, &facts),
            false => None,
        };
        let by_value = by_value_elsewhere(&pending, &facts, &sync::lock(conn));
        let handed = self.complete(pending, &facts, &mut sync::lock(conn));
        // The release gave the lock to a parked attempt of another
        // connection: settled with this one unlocked.
        if let Some(handed) = handed {
            self.finish_handoff(handed);
        }
        // A library's release sent on another connection than the one that
        // acquired (a pool's): that one's holding ends too, with this one
        // unlocked.
        if let Some((keys, value, upto)) = by_value {
            self.released_by_value(&keys, &value, upto);
        }
        if let Some(won) = won {
            return match self.gate(won, conn, evalsha::own_reply(reply)) {
                Ok(rx) => ReplyOutcome::Parked(rx),
                Err(yes) => ReplyOutcome::Local(yes),
            };
        }
        match park.and_then(|(key, park)| self.park(key, park, conn, acquirer())) {
            Some(rx) => ReplyOutcome::Parked(rx),
            None => ReplyOutcome::Reply(reply),
        }
    }
}

impl LockService {
    /// A plain probe found the lock held for `pttl` more (see
    /// [`LockService::checked`]): the attempt planned as `pending` failed,
    /// learned as the general script's failure would be, and parked when
    /// it may wait (`behind`: something waits behind its reply; it may
    /// not), else answered "not acquired" in `shape`.
    pub(crate) fn check_failed(
        self: &Arc<Self>,
        pending: LockPending,
        shape: super::ops::Shape,
        pttl: i64,
        conn: &Arc<Mutex<ConnLocks>>,
        behind: bool,
    ) -> ReplyOutcome {
        let facts = [0, pttl];
        let park = failed_attempt(&pending, &facts).filter(|_| !behind);
        // An acquisition hands nothing over.
        let _ = self.complete(pending, &facts, &mut sync::lock(conn));
        let acquirer = || -> Arc<dyn Acquirer> { self.clone() };
        match park.and_then(|(key, park)| self.park(key, park, conn, acquirer())) {
            Some(rx) => ReplyOutcome::Parked(rx),
            None => ReplyOutcome::Local(super::storm::shaped(shape, false)),
        }
    }

    /// `frame`, or, when it says the server refuses lockgate's script
    /// (`EVAL`/`EVALSHA` renamed away: `unknown command`; an ACL without
    /// them: `NOPERM`), an error that says what is true: the lock command
    /// was not carried out, and why; counted and logged (rate-limited).
    /// A lock command is never passed on without its script, so it is
    /// refused (docs/faults.md, "Scripts refused").
    fn scripts_refused(&self, frame: Bytes) -> Bytes {
        if !refuses_scripts(&frame) {
            return frame;
        }
        ProxyMetrics::inc(&self.metrics.scripts_refused);
        let said = String::from_utf8_lossy(frame.strip_prefix(b"-").unwrap_or(&frame));
        let said = said.trim_end();
        if let Some(more) = self.scripts_warn.check() {
            tracing::warn!(
                server_said = %said,
                suppressed = more,
                "the server refuses lockgate's scripts: lock commands are refused"
            );
        }
        let text = format!(
            "ERR lockgate: lock command refused: the server refuses the script that carries it out ({said})"
        );
        LocalReply::Error(Bytes::from(text)).to_bytes(false)
    }
}

/// The client's reply and the facts in `frame`, the reply to the general
/// plan of `pending`.
fn general(pending: &LockPending, frame: &Bytes) -> (Bytes, Vec<i64>) {
    match pending {
        // A client script's reply is the client's, whole; so is a
        // forwarded command's.
        LockPending::Script { .. } | LockPending::Forget(_) | LockPending::InTx { .. } => {
            (frame.clone(), Vec::new())
        }
        _ => {
            let (reply, facts) = split_reply(frame);
            (frame.slice_ref(reply), facts)
        }
    }
}

/// The keys, value and token bound of a release by value that ran (its
/// script answered with facts), when `conn` (the connection that sent it)
/// did not hold each key with that value itself: whether it deleted the
/// key, handed it over or found another value there, no holding by that
/// value is left, so another connection's ends
/// ([`LockService::released_by_value`]).
pub(crate) fn by_value_elsewhere(
    pending: &LockPending,
    facts: &[i64],
    conn: &ConnLocks,
) -> Option<(Vec<Bytes>, Bytes, u64)> {
    match pending {
        LockPending::Fast { then, .. } => by_value_elsewhere(then, facts, conn),
        LockPending::Release {
            keys,
            upto,
            by_value: Some(value),
            ..
        } => {
            let own = |k: &Bytes| {
                conn.get(k)
                    .is_some_and(|a| a.standing == Standing::Held && a.value == *value)
            };
            (!facts.is_empty() && !keys.iter().all(own))
                .then(|| (keys.clone(), value.clone(), *upto))
        }
        _ => None,
    }
}

/// `pending` with no park settings: its attempt, if it fails, is answered
/// at once.
fn unparkable(pending: &mut LockPending) {
    match pending {
        LockPending::Acquire { park, .. } => *park = None,
        LockPending::Fast { then, .. } => unparkable(then),
        _ => {}
    }
}

/// The key and park settings of a failed acquisition that may be parked.
fn failed_attempt(pending: &LockPending, facts: &[i64]) -> Option<(Bytes, Park)> {
    match pending {
        LockPending::Acquire {
            key,
            park: Some(park),
            ..
        } if facts.first() == Some(&0) => Some((key.clone(), park.clone())),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;
    use crate::config::Config;
    use crate::lock::lease::Standing;
    use crate::lock::ops::{LockOp, Shape, Ttl};
    use crate::lock::storm::Ask;
    use crate::lock::Queueing;

    /// Acquires nothing: the tests below never park.
    struct NoAcquirer;

    impl Acquirer for NoAcquirer {
        fn acquire(
            &self,
            _: Ask,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = crate::lock::storm::Tried> + Send + '_>,
        > {
            Box::pin(async { crate::lock::storm::Tried::FAILED })
        }

        fn stopped(&self) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
            Box::pin(std::future::pending())
        }
    }

    /// A SETNX on `lock:a` planned on `conn` (recorded as trying).
    fn attempt(locks: &LockService, conn: &Arc<Mutex<ConnLocks>>) -> LockPending {
        let op = LockOp::Acquire {
            key: Bytes::from_static(b"lock:a"),
            value: Bytes::from_static(b"v"),
            ttl: Ttl::Default,
            shape: Shape::SetNx,
        };
        let planned = locks.plan(op, &mut sync::lock(conn), Queueing::Now);
        planned
            .pending
            .expect("an acquisition outside MULTI has facts")
    }

    fn outcome(
        locks: &LockService,
        pending: LockPending,
        frame: &'static [u8],
        conn: &Arc<Mutex<ConnLocks>>,
    ) -> (Bytes, u32) {
        let asked = Cell::new(0);
        let acquirer = || -> Arc<dyn Acquirer> {
            asked.set(asked.get() + 1);
            Arc::new(NoAcquirer)
        };
        match locks.on_reply(pending, Bytes::from_static(frame), conn, acquirer) {
            ReplyOutcome::Reply(reply) => (reply, asked.get()),
            ReplyOutcome::Local(reply) => (reply.to_bytes(false), asked.get()),
            ReplyOutcome::Parked(_) | ReplyOutcome::Rerun(_) => {
                panic!("parked without park settings")
            }
        }
    }

    #[tokio::test]
    async fn a_won_attempt_answers_the_bare_reply_and_is_recorded_held() {
        let locks = LockService::new(&Config::default());
        let conn = Arc::new(Mutex::new(locks.conn_locks()));
        let pending = attempt(&locks, &conn);
        let (reply, asked) = outcome(&locks, pending, b"*3\r\n:1\r\n:1\r\n:30000\r\n", &conn);
        assert_eq!(&reply[..], b":1\r\n");
        assert_eq!(asked, 0);
        let standing = sync::lock(&conn).get(b"lock:a").map(|a| a.standing);
        assert_eq!(standing, Some(Standing::Held));
    }

    #[tokio::test]
    async fn a_lost_attempt_without_park_settings_is_answered_at_once() {
        let locks = LockService::new(&Config::default());
        let conn = Arc::new(Mutex::new(locks.conn_locks()));
        let pending = attempt(&locks, &conn);
        let (reply, asked) = outcome(&locks, pending, b"*3\r\n:0\r\n:0\r\n:2500\r\n", &conn);
        assert_eq!(&reply[..], b":0\r\n");
        assert_eq!(asked, 0);
        let standing = sync::lock(&conn).get(b"lock:a").map(|a| a.standing);
        assert_eq!(standing, Some(Standing::Lost));
    }

    #[tokio::test]
    async fn a_client_script_reply_passes_whole() {
        let locks = LockService::new(&Config::default());
        let conn = Arc::new(Mutex::new(locks.conn_locks()));
        let pending = LockPending::Script {
            keys: vec![Bytes::from_static(b"lock:a")],
            values: Vec::new(),
            db: crate::lock::Database::Zero,
            sent: std::time::Instant::now(),
        };
        let (reply, _) = outcome(&locks, pending, b"*2\r\n:1\r\n:5\r\n", &conn);
        assert_eq!(&reply[..], b"*2\r\n:1\r\n:5\r\n");
    }
}
