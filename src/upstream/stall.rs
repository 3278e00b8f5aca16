//! When a pipelined connection lockgate carries many commands on (a
//! cluster node's lane, a shared connection to the primary) is taken for
//! lost although it is open: a lock command waits on it and no byte of
//! reply has come for `upstream.lock_reply_timeout_ms`. A server behind a
//! blackholed path accepts and never answers, and TCP says nothing for
//! minutes; a lock command must not wait that long (docs/faults.md,
//! "Partitions"), so the connection is given up, every reply owed on it
//! answered as when a connection dies, and another opened.
//!
//! Only a lock command starts the clock: the clients' own commands wait
//! as they would on a connection to that node, and a blocking command at
//! the front of a session's own connection (`BLPOP`, `WAIT`, `XREAD
//! BLOCK`) is allowed its wait, whatever is pipelined behind it.

use std::time::{Duration, Instant};

use crate::command::connection::{needs_own_connection, OwnReason};
use crate::upstream::shared::framing_parser;

/// A connection's progress as its watch last saw it: the rule
/// ([`Watch::step`]) is a pure function of what is seen and `now`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Watch {
    /// Bytes of reply read when last seen to change.
    read: u64,
    /// Since when nothing was read while replies were owed (or the last
    /// look, while none were).
    since: Instant,
}

impl Watch {
    /// A watch started at `now`.
    pub(crate) fn new(now: Instant) -> Watch {
        Watch {
            read: 0,
            since: now,
        }
    }

    /// Looks at the connection at `now`: `read` bytes of reply read so
    /// far, `owed` whether any reply is owed. True once it has been
    /// `limit` without a byte while replies were owed all along. A look
    /// with nothing owed restarts the clock, so the stall is measured from
    /// at most one look before the first owed command was written.
    pub(crate) fn step(&mut self, now: Instant, read: u64, owed: bool, limit: Duration) -> bool {
        if read != self.read || !owed {
            *self = Watch { read, since: now };
            return false;
        }
        now.saturating_duration_since(self.since) >= limit
    }
}

/// How often a watch with bound `limit` looks: every quarter of it, at
/// least 10 ms apart (a stall is seen at most a quarter late).
pub(crate) fn look_every(limit: Duration) -> Duration {
    (limit / 4).max(Duration::from_millis(10))
}

/// Looks at a connection every quarter of `limit` (at least 10 ms apart)
/// until `look` says it has stalled with a lock command waiting (given
/// the watch, `now` and `limit`); then the reason the connection is given
/// up for. Never ends when `limit` is `None` (no bound).
pub(crate) async fn watch(
    limit: Option<Duration>,
    mut look: impl FnMut(&mut Watch, Instant, Duration) -> bool,
) -> String {
    let Some(limit) = limit else {
        return std::future::pending().await;
    };
    let tick = look_every(limit);
    let mut watch = Watch::new(Instant::now());
    loop {
        tokio::time::sleep(tick).await;
        if look(&mut watch, Instant::now(), limit) {
            return format!("a lock command unanswered for {} ms", limit.as_millis());
        }
    }
}

/// Whether a stalled connection's owed commands include lockgate's own
/// lock call and are not led by a command that blocks by design (see the
/// module doc). `owed`: buffers of whole commands, oldest first (one
/// command each, or a batch of several), each with how many commands at
/// its start are answered already. Parses them; runs only on a stall.
pub(crate) fn lock_call_waits<'a>(owed: impl Iterator<Item = (&'a [u8], u64)>) -> bool {
    let mut parser = framing_parser();
    let mut front = true;
    for (mut buf, mut answered) in owed {
        while let Ok(Some(request)) = parser.parse(buf) {
            let rest = buf.get(request.len.max(1)..);
            if answered > 0 {
                answered -= 1;
                match rest {
                    Some(rest) => buf = rest,
                    None => break,
                }
                continue;
            }
            let args: smallvec::SmallVec<[&[u8]; 8]> =
                (0..parser.argc()).map(|a| parser.arg(buf, a)).collect();
            let blocks = matches!(
                needs_own_connection(&args),
                Some(OwnReason::Blocking | OwnReason::Wait)
            );
            if std::mem::replace(&mut front, false) && blocks {
                // Nothing behind a blocking command is answered before it.
                return false;
            }
            if is_lock_call(&args) {
                return true;
            }
            match rest {
                Some(rest) => buf = rest,
                None => break,
            }
        }
    }
    false
}

/// Whether `args` (name first) is a call of one of lockgate's own lock
/// scripts, or the `SCRIPT LOAD` of one that a session sends before its
/// first call on a connection (part of the lock command it serves).
fn is_lock_call(args: &[&[u8]]) -> bool {
    let (Some(verb), Some(first)) = (args.first(), args.get(1)) else {
        return false;
    };
    if verb.eq_ignore_ascii_case(b"SCRIPT") {
        return first.eq_ignore_ascii_case(b"LOAD")
            && args
                .get(2)
                .is_some_and(|body| crate::script::is_own_call(false, body));
    }
    let by_sha = verb.eq_ignore_ascii_case(b"EVALSHA");
    (by_sha || verb.eq_ignore_ascii_case(b"EVAL")) && crate::script::is_own_call(by_sha, first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::encode::command;
    use crate::script::BODIES;
    use bytes::Bytes;

    #[test]
    fn a_stall_is_time_without_a_byte_while_replies_are_owed() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let limit = ms(100);
        // (at, bytes read, owed, stalled)
        let table = [
            (0, 0, false, false),
            (50, 0, true, false),
            // Nothing owed at 0: the clock starts at the look before.
            (100, 0, true, true),
            // A byte read: the clock starts again.
            (150, 10, true, false),
            (240, 10, true, false),
            (250, 10, true, true),
            (300, 10, true, true),
            // Nothing owed: no stall, whatever was read.
            (400, 10, false, false),
            (450, 10, true, false),
            (550, 10, true, true),
        ];
        let mut watch = Watch::new(t0);
        for (at, read, owed, want) in table {
            let got = watch.step(t0 + ms(at), read, owed, limit);
            assert_eq!(got, want, "at {at} ms, {read} bytes, owed {owed}");
        }
    }

    #[test]
    fn only_a_lock_call_not_behind_a_blocking_command_counts() {
        let lock = command(&[b"EVAL", BODIES[0].as_bytes(), b"1", b"lock:a"]);
        let client_script = command(&[b"EVALSHA", &[b'0'; 40], b"0"]);
        let load = command(&[b"SCRIPT", b"LOAD", BODIES[0].as_bytes()]);
        let client_load = command(&[b"SCRIPT", b"LOAD", b"return 1"]);
        let get = command(&[b"GET", b"k"]);
        let blpop = command(&[b"BLPOP", b"q", b"0"]);
        let xread = command(&[b"XREAD", b"BLOCK", b"0", b"STREAMS", b"s", b"$"]);
        let wait = command(&[b"WAIT", b"1", b"0"]);
        let table: [(&[&Bytes], bool); 11] = [
            (&[], false),
            (&[&get], false),
            (&[&client_script], false),
            (&[&lock], true),
            (&[&load], true),
            (&[&client_load], false),
            (&[&get, &get, &lock], true),
            // A blocking command's wait is its own, and what is behind it
            // waits for it.
            (&[&blpop, &lock], false),
            (&[&xread, &lock], false),
            (&[&wait, &lock], false),
            // Only at the front: one further back is answered by now.
            (&[&get, &blpop, &lock], true),
        ];
        for (owed, want) in table {
            let one_each = owed.iter().map(|c| (&c[..], 0));
            assert_eq!(lock_call_waits(one_each), want, "{owed:?}");
            // The same commands in one batch, and behind answered ones.
            let batch = owed.iter().map(|c| &c[..]).collect::<Vec<_>>().concat();
            let batched = lock_call_waits(std::iter::once((&batch[..], 0)));
            assert_eq!(batched, want, "batched {owed:?}");
            let behind = [&lock[..], &blpop[..], &batch[..]].concat();
            let after_answered = lock_call_waits(std::iter::once((&behind[..], 2)));
            assert_eq!(after_answered, want, "behind two answered {owed:?}");
        }
    }
}
