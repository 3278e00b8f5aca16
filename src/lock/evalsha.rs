//! Lock scripts by SHA1 on a client's own connection. `EVAL` makes Redis
//! hash the whole body (~2 KB) on every call, which cost more than the
//! script's work; `EVALSHA` does not. Each session remembers which scripts
//! its upstream connection has loaded ([`Loaded`]); the first use on a
//! connection goes up as `SCRIPT LOAD <body>` + `EVALSHA` in the same
//! write, the load's reply swallowed by the writer.
//!
//! Redis may still answer `NOSCRIPT` (a `SCRIPT FLUSH` sent straight to
//! it, or through lockgate on another connection while this one had an
//! `EVALSHA` on its way): the call is then run again as `EVAL` on
//! lockgate's own connection to the primary, in the client's database
//! ([`super::LockService::in_place`]), and its reply takes the command's place. The
//! client never sees `NOSCRIPT` for a lock command; commands it pipelined
//! after it have then run first (`docs/behaviour.md`), counted as
//! `lock_noscript_reruns`. Any `NOSCRIPT` or `SCRIPT FLUSH` moves the
//! cache [`Epoch`] on, so every connection loads its scripts again.
//!
//! Inside `MULTI`, under `CLIENT REPLY OFF|SKIP` and on a connection that
//! ever subscribed the scripts go up as `EVAL`, as before: a `NOSCRIPT`
//! inside `EXEC`'s array could not be rerun in its place, a load whose
//! reply is skipped would shift the skip onto it, and Redis refuses a load
//! while a RESP2 connection is subscribed.

use std::sync::atomic::{AtomicU64, Ordering};

use bytes::{BufMut, Bytes, BytesMut};

use crate::protocol::encode::{self, LocalReply};
use crate::script::Script;
use crate::upstream::node::Request;

/// A call of a lock script: which one, and its `numkeys keys… argv…`
/// already in RESP, so that it can go up as `EVALSHA` or, when Redis lost
/// the script, as `EVAL` without planning it again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    script: Script,
    /// Arguments after the script (numkeys included).
    args: usize,
    tail: Bytes,
}

impl Call {
    /// The call of `script` on `keys` with `argv`.
    pub fn new(script: Script, keys: &[&[u8]], argv: &[&[u8]]) -> Call {
        let len: usize = keys.iter().chain(argv).map(|a| a.len() + 16).sum();
        let mut tail = BytesMut::with_capacity(len + 16);
        encode::bulk_decimal(&mut tail, keys.len() as u64);
        for a in keys.iter().chain(argv) {
            encode::bulk(&mut tail, a);
        }
        Call {
            script,
            args: 1 + keys.len() + argv.len(),
            tail: tail.freeze(),
        }
    }

    /// Which script.
    pub fn script(&self) -> Script {
        self.script
    }

    /// `EVAL <body> …`: for lockgate's own connections, transactions, and
    /// a rerun after `NOSCRIPT`.
    pub fn eval(&self) -> Bytes {
        self.with(b"EVAL", self.script.body().as_bytes())
    }

    /// `EVALSHA <sha1> …`.
    pub fn evalsha(&self) -> Bytes {
        self.with(b"EVALSHA", self.script.sha().as_bytes())
    }

    /// The call for lockgate's own connection to a node: as `EVALSHA`,
    /// with its `EVAL` as the fallback should the node answer `NOSCRIPT`
    /// (see [`Request`]).
    pub fn request(&self) -> Request {
        Request {
            command: self.evalsha(),
            fallback: Some(self.eval()),
        }
    }

    /// `SCRIPT LOAD <body>`, sent ahead of the first `EVALSHA` of this
    /// script on a connection.
    pub fn load(&self) -> Bytes {
        encode::command(&[b"SCRIPT", b"LOAD", self.script.body().as_bytes()])
    }

    /// `EVAL` of the call in database `db`: for a rerun on lockgate's own
    /// connection (database 0) of a call a client made after `SELECT`.
    /// The script selects the database first; since Redis 2.8.12 a script's
    /// `SELECT` does not change the connection's database.
    pub fn eval_in(&self, db: u64) -> Bytes {
        if db == 0 {
            return self.eval();
        }
        let body = format!("redis.call('SELECT', {db})\n{}", self.script.body());
        self.with(b"EVAL", body.as_bytes())
    }

    fn with(&self, verb: &[u8], first: &[u8]) -> Bytes {
        let mut out = BytesMut::with_capacity(32 + first.len() + self.tail.len());
        out.put_u8(b'*');
        encode::decimal(&mut out, (self.args + 2) as u64);
        out.put_slice(b"\r\n");
        encode::bulk(&mut out, verb);
        encode::bulk(&mut out, first);
        out.put_slice(&self.tail);
        out.freeze()
    }
}

/// Which scripts a session's upstream connection has loaded, as of which
/// cache [`Epoch`] (a newer epoch: Redis may have lost them all).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Loaded {
    /// One bit per [`Script::index`] (17 scripts: `script::COUNT`).
    bits: u32,
    epoch: u64,
    off: bool,
}

impl Loaded {
    /// The connection subscribed: in RESP2 Redis then refuses `SCRIPT
    /// LOAD`, unseen (its reply is swallowed), so a script would count as
    /// loaded when it is not; such a connection sends `EVAL` from now on.
    pub fn subscribed(&mut self) {
        self.off = true;
    }

    /// False once the connection subscribed (see [`Loaded::subscribed`]).
    pub fn by_sha(&self) -> bool {
        !self.off
    }

    /// True when `script` must be loaded on this connection before its
    /// `EVALSHA` (the caller sends [`Call::load`] first); from then on it
    /// counts as loaded. `epoch`: the cache epoch now.
    pub fn load_first(&mut self, script: Script, epoch: u64) -> bool {
        if self.epoch != epoch {
            self.bits = 0;
            self.epoch = epoch;
        }
        let bit = 1u32 << script.index();
        let first = self.bits & bit == 0;
        self.bits |= bit;
        first
    }
}

/// The script cache's epoch, shared by every session: it moves on when
/// Redis's script cache may have been emptied (`SCRIPT FLUSH` through
/// lockgate, or a `NOSCRIPT` answer), so every connection loads again.
#[derive(Debug, Default)]
pub struct Epoch(AtomicU64);

impl Epoch {
    /// The epoch now.
    pub fn now(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    /// Redis's cache was emptied (`SCRIPT FLUSH` seen).
    pub fn flushed(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    /// A call sent at epoch `seen` was answered `NOSCRIPT`: moves the
    /// epoch on once for all the calls of that epoch.
    pub(super) fn lost(&self, seen: u64) {
        let _ = self
            .0
            .compare_exchange(seen, seen + 1, Ordering::Relaxed, Ordering::Relaxed);
    }
}

/// `EVAL script` on `key`, its owner record and the `extra` keys, with
/// `argv`: the shape of every script lockgate runs on one lock.
pub fn eval_on(script: &str, key: &[u8], extra: &[&[u8]], argv: &[&[u8]]) -> Bytes {
    let owner = super::owner_key(key);
    let mut keys: Vec<&[u8]> = vec![key, &owner];
    keys.extend_from_slice(extra);
    eval(script, &keys, argv)
}

/// [`eval_on`] for a script that wakes the key's queue
/// ([`crate::script::RELEASE_TOKEN`], [`crate::script::FENCE_UNLOCK`]):
/// KEYS lock, owner record, queue, places.
pub fn eval_queued(script: &str, key: &[u8], argv: &[&[u8]]) -> Bytes {
    let (queue, places) = (super::queue_key(key), super::places_key(key));
    eval_on(script, key, &[&queue, &places], argv)
}

/// `EVAL script numkeys keys… argv…` as RESP, every key given.
pub fn eval_keys(script: &str, keys: &[&[u8]], argv: &[&[u8]]) -> Bytes {
    eval(script, keys, argv)
}

/// `EVAL script numkeys keys… argv…` as RESP.
fn eval(script: &str, keys: &[&[u8]], argv: &[&[u8]]) -> Bytes {
    let numkeys = keys.len().to_string();
    let mut args: Vec<&[u8]> = Vec::with_capacity(3 + keys.len() + argv.len());
    args.push(b"EVAL");
    args.push(script.as_bytes());
    args.push(numkeys.as_bytes());
    args.extend_from_slice(keys);
    args.extend_from_slice(argv);
    encode::command(&args)
}

/// True for `SCRIPT FLUSH` (`name`, `sub`: the command's first two words).
pub fn is_flush(name: &[u8], sub: &[u8]) -> bool {
    name.eq_ignore_ascii_case(b"SCRIPT") && sub.eq_ignore_ascii_case(b"FLUSH")
}

/// What a lock command sent as `EVALSHA` needs to run again if Redis lost
/// the script: the call, the client's database, and the epoch it went at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rerun {
    /// The call.
    pub call: Call,
    /// The database the client had `SELECT`ed.
    pub db: u64,
    /// The cache epoch when it was sent.
    pub epoch: u64,
}

/// True when `frame` is Redis's `NOSCRIPT` error.
pub fn is_noscript(frame: &[u8]) -> bool {
    frame.starts_with(b"-NOSCRIPT")
}

/// A reply read on lockgate's own (RESP2) connection, for a client that
/// may speak RESP3: the null is the one reply of a lock script whose form
/// differs, so it is written in the client's protocol.
pub(super) fn own_reply(reply: Bytes) -> LocalReply {
    match &reply[..] {
        b"$-1\r\n" | b"*-1\r\n" => LocalReply::Null,
        _ => LocalReply::Raw(reply),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evalsha_and_eval_carry_the_same_arguments() {
        let call = Call::new(Script::Extend, &[b"lock:a", b"o"], &[b"1", b""]);
        let sha = Script::Extend.sha();
        let want = encode::command(&[b"EVALSHA", sha.as_bytes(), b"2", b"lock:a", b"o", b"1", b""]);
        assert_eq!(call.evalsha(), want);
        let body = crate::script::EXTEND.as_bytes();
        let want = encode::command(&[b"EVAL", body, b"2", b"lock:a", b"o", b"1", b""]);
        assert_eq!(call.eval(), want);
        assert_eq!(call.eval_in(0), want);
        let request = call.request();
        assert_eq!(request.command, call.evalsha());
        assert_eq!(request.fallback, Some(want));
        assert!(call
            .eval_in(3)
            .windows(24)
            .any(|w| w == b"redis.call('SELECT', 3)\n"));
    }

    #[test]
    fn a_script_is_loaded_once_per_epoch() {
        let mut loaded = Loaded::default();
        assert!(loaded.load_first(Script::Acquire, 0));
        assert!(!loaded.load_first(Script::Acquire, 0));
        assert!(loaded.load_first(Script::Release, 0));
        assert!(loaded.load_first(Script::Acquire, 1));
        assert!(loaded.load_first(Script::Release, 1));
    }

    #[test]
    fn a_lost_epoch_moves_on_once() {
        let epoch = Epoch::default();
        epoch.lost(0);
        epoch.lost(0);
        assert_eq!(epoch.now(), 1);
        epoch.flushed();
        assert_eq!(epoch.now(), 2);
    }

    #[test]
    fn nulls_take_the_clients_protocol() {
        assert_eq!(own_reply(Bytes::from_static(b"$-1\r\n")), LocalReply::Null);
        assert_eq!(
            own_reply(Bytes::from_static(b":1\r\n")),
            LocalReply::Raw(Bytes::from_static(b":1\r\n"))
        );
    }
}
