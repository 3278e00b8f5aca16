//! The writer half's bookkeeping, free of I/O: the entries not yet
//! settled, the stream's mode (RESP2/RESP3, raw, subscribed), and the rules
//! that attribute each reply frame to its entry and render lockgate's own
//! replies in their place.

use std::collections::VecDeque;

use bytes::BytesMut;

use super::super::pending::{Deferred, Entries, Pending};
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;
use crate::protocol::reply::{FrameEnd, FrameKind, ReplyScanner};

/// The writer half's state: the entries not yet settled and the stream mode.
pub(super) struct Replies {
    pub(super) queue: VecDeque<Pending>,
    pub(super) scanner: ReplyScanner,
    pub(super) resp3: bool,
    pub(super) raw: bool,
    pub(super) out: BytesMut,
    /// The lock-script (or barrier) reply being collected, if one is.
    pub(super) capture: Option<Vec<u8>>,
    /// The client half-closed and Redis was told: end at the upstream's EOF.
    pub(super) await_eof: bool,
    /// A deferred reply is awaited: later frames stay in the buffer.
    pub(super) blocked: bool,
    /// The deferred reply at the front, once everything before it is out.
    pub(super) deferred: Option<tokio::sync::oneshot::Receiver<LocalReply>>,
    /// The deferred reply is for a command whose reply the client
    /// suppressed: awaited, then dropped.
    pub(super) deferred_silent: bool,
    /// Subscriptions in force: channels, patterns, shard channels, as the
    /// confirmations Redis sent so far count them.
    pub(super) subs: [u64; 3],
    /// What the frame being scanned is, as its first element tells.
    pub(super) frame: FrameClass,
}

/// What a top-level frame is, when the session must look inside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FrameClass {
    /// Anything else: a reply, or a push as the scanner reports it.
    Other,
    /// A published message (`message`, `pmessage`, `smessage`): not a reply
    /// to any command, in RESP2 as in RESP3.
    Message,
    /// A subscription confirmation, for the `Sub` entry at the front.
    Confirm,
}

/// What the first element of the frame at the front of a buffer says.
enum Peek<'a> {
    /// Not enough bytes yet.
    More,
    /// An array or push whose first element is this bulk string.
    Name(&'a [u8]),
    /// Anything else.
    Other,
}

/// Reads the first element of an array (`*`) or push (`>`) frame, if it
/// is a short bulk string (the longest name looked for has 12 bytes).
fn peek_name(buf: &[u8]) -> Peek<'_> {
    let line = |from: usize| -> Option<usize> {
        let window = buf.get(from..)?;
        memchr::memchr(b'\n', &window[..window.len().min(24)]).map(|nl| from + nl + 1)
    };
    match buf.first() {
        None => return Peek::More,
        Some(b'*' | b'>') => {}
        Some(_) => return Peek::Other,
    }
    let Some(after_header) = line(0) else {
        return if buf.len() < 24 {
            Peek::More
        } else {
            Peek::Other
        };
    };
    match buf.get(after_header) {
        None => return Peek::More,
        Some(b'$') => {}
        Some(_) => return Peek::Other,
    }
    let Some(after_len) = line(after_header) else {
        return if buf.len() < after_header + 24 {
            Peek::More
        } else {
            Peek::Other
        };
    };
    let digits = &buf[after_header + 1..after_len.saturating_sub(2).max(after_header + 1)];
    let Some(n) = crate::protocol::request::parse_int(digits).filter(|n| (0..=12).contains(n))
    else {
        return Peek::Other;
    };
    match buf.get(after_len..after_len + n as usize) {
        Some(name) => Peek::Name(name),
        None => Peek::More,
    }
}

/// The subscription count a confirmation ends with (`…:N\r\n`).
fn confirmation_count(frame: &[u8]) -> Option<u64> {
    let body = frame.strip_suffix(b"\r\n")?;
    let at = memchr::memmem::rfind(body, b"\r\n:")?;
    crate::protocol::request::parse_int(&body[at + 3..]).and_then(|n| u64::try_from(n).ok())
}

impl Replies {
    /// The state at a session's start: RESP2, counted, nothing owed.
    pub(super) fn new() -> Replies {
        Replies {
            queue: VecDeque::new(),
            scanner: ReplyScanner::new(),
            resp3: false,
            raw: false,
            out: BytesMut::new(),
            capture: None,
            await_eof: false,
            blocked: false,
            deferred: None,
            deferred_silent: false,
            subs: [0; 3],
            frame: FrameClass::Other,
        }
    }

    /// Starts the deferred reply at the front once every reply before it
    /// is in (its gated work may start then), and says whether later
    /// frames wait behind one.
    pub(super) fn start_deferred(&mut self) {
        if self.deferred.is_none()
            && self.scanner.at_boundary()
            && self.capture.is_none()
            && matches!(
                self.queue.front(),
                Some(Pending::Deferred(_) | Pending::Silent(_))
            )
        {
            match self.queue.pop_front() {
                Some(Pending::Deferred(Deferred(rx, gate))) => {
                    gate.map(|g| g.send(()));
                    self.deferred = Some(rx);
                    self.deferred_silent = false;
                }
                Some(Pending::Silent(Deferred(rx, gate))) => {
                    gate.map(|g| g.send(()));
                    self.deferred = Some(rx);
                    self.deferred_silent = true;
                }
                _ => {}
            }
        }
        self.blocked = self.deferred.is_some();
    }

    /// Takes a batch of entries from the reader half.
    pub(super) fn accept(&mut self, entries: Entries) {
        for entry in entries {
            if entry == Pending::ClientEof {
                self.await_eof = true;
            } else {
                self.queue.push_back(entry);
            }
        }
    }

    /// True when the next frame must be collected rather than forwarded: a
    /// lock script's `{reply, facts}`, or anything while a barrier `RESET`
    /// is awaited.
    pub(super) fn captures_next(&self) -> bool {
        match self.queue.front() {
            Some(Pending::Lock(..)) => !self.raw,
            Some(Pending::Barrier | Pending::Swallow | Pending::Feed(_)) => true,
            _ => false,
        }
    }

    /// The frame after a reply that is followed by a local entry: push
    /// frames already buffered belong before lockgate's reply, as Redis sent
    /// them before it read the next command. Returns the bytes they take.
    pub(super) fn pushes_ahead(&self, buf: &[u8]) -> usize {
        let mut scanner = self.scanner.clone();
        let mut pos = 0;
        while let Ok((used, Some(end))) = scanner.advance(&buf[pos..]) {
            if end.kind == FrameKind::Reply {
                break;
            }
            pos += used;
        }
        pos
    }
    /// Handles the entries at the front that need no bytes from Redis:
    /// renders local replies into `out`, switches to raw mode. Returns true
    /// when a `Close` entry is reached.
    pub(super) fn settle(&mut self) -> bool {
        // Mid-frame (while replies are not counted), nothing of lockgate's
        // may be written into Redis's bytes.
        if !self.scanner.at_boundary() {
            return false;
        }
        loop {
            match self.queue.front() {
                Some(Pending::Local(reply)) => {
                    reply.encode(self.resp3, &mut self.out);
                }
                Some(Pending::EnterRaw) => self.raw = true,
                Some(Pending::Upstream(0)) => {}
                Some(Pending::Close) => return true,
                _ => return false,
            }
            self.queue.pop_front();
        }
    }

    /// Attributes one finished reply frame to the entry it answers.
    pub(super) fn attribute(&mut self, metrics: &ProxyMetrics, end: &FrameEnd) {
        if self.raw {
            if self.queue.front() == Some(&Pending::Reset) && end.is(b"+RESET\r\n") {
                self.queue.pop_front();
                self.raw = false;
                self.resp3 = false;
                self.subs = [0; 3];
            }
            return;
        }
        match self.queue.front_mut() {
            Some(Pending::Upstream(n)) => {
                *n -= 1;
                if *n > 0 {
                    return;
                }
            }
            Some(Pending::Hello) => match end.type_byte {
                b'%' => self.resp3 = true,
                b'*' => self.resp3 = false,
                _ => {}
            },
            Some(Pending::Reset) => {
                self.resp3 = false;
                self.subs = [0; 3];
            }
            Some(Pending::Blocking) => {}
            Some(Pending::Lock(..)) => {
                // Only in raw mode is a lock reply not captured; pass it on.
            }
            Some(Pending::Sub { .. }) => {
                // Not a confirmation (those are captured): an error, which
                // answers the whole command.
            }
            _ => {
                // A reply nobody asked for: pass it on, count it, keep going.
                ProxyMetrics::inc(&metrics.unexpected_replies);
                return;
            }
        }
        self.queue.pop_front();
    }

    /// Whether a reply is still owed to the client: an entry waits for
    /// its reply, a deferred reply is awaited, or a frame is half through.
    pub(super) fn owes_client(&self) -> bool {
        self.deferred.is_some()
            || !self.queue.is_empty()
            || !self.scanner.at_boundary()
            || self.capture.is_some()
    }

    /// Whether the reply to a lock command is still to come: its outcome
    /// decides what the lock room records for the connection, and so
    /// what it releases when the connection closes.
    pub(super) fn owes_lock_outcome(&self) -> bool {
        self.queue.iter().any(|p| matches!(p, Pending::Lock(_)))
    }

    /// Whether Redis owes a lock script's reply with nothing but its own
    /// silence before it: no blocking command ahead of it (its wait is
    /// the client's), no reply lockgate is working out ahead of it (Redis
    /// may have answered, read and held behind), not subscribed or raw.
    /// What the writer's stall watch asks (`upstream.lock_reply_timeout_ms`).
    pub(super) fn awaits_lock_reply(&self) -> bool {
        if self.raw || self.deferred.is_some() || self.subs != [0; 3] {
            return false;
        }
        for entry in &self.queue {
            match entry {
                Pending::Lock(_) => return true,
                Pending::Blocking
                | Pending::Deferred(_)
                | Pending::Silent(_)
                | Pending::EnterRaw
                | Pending::Sub { .. } => return false,
                _ => {}
            }
        }
        false
    }

    /// True while Redis owes a reply that a client's half-close must wait
    /// for: one ahead of the first blocking command, or one half read.
    /// Redis drops what it has not yet sent when it sees the close, so the
    /// close is passed on only once this is false.
    pub(super) fn owes_upstream(&self) -> bool {
        if self.raw {
            return false;
        }
        if !self.scanner.at_boundary() || self.capture.is_some() {
            return true;
        }
        for entry in &self.queue {
            match entry {
                Pending::Blocking => return false,
                Pending::Upstream(0)
                | Pending::Local(_)
                | Pending::Deferred(_)
                | Pending::Silent(_)
                | Pending::EnterRaw
                | Pending::Close
                | Pending::ClientEof => {}
                _ => return true,
            }
        }
        false
    }

    /// How many replies of a run of forwarded ones may be counted without
    /// a look inside each: all but the last that the `Upstream` entry at
    /// the front still owes, while replies are counted and no frame is
    /// half read. The last one takes the general path, which settles what
    /// follows the run (lockgate's own replies behind it).
    pub(super) fn plain_run(&self) -> usize {
        match self.queue.front() {
            Some(Pending::Upstream(n))
                if !self.raw && self.capture.is_none() && self.scanner.at_boundary() =>
            {
                (*n as usize).saturating_sub(1)
            }
            _ => 0,
        }
    }

    /// `frames` replies of the run at the front (at most
    /// [`Replies::plain_run`]) were forwarded.
    pub(super) fn counted(&mut self, frames: usize) {
        if let Some(Pending::Upstream(n)) = self.queue.front_mut() {
            *n = n.saturating_sub(u32::try_from(frames).unwrap_or(u32::MAX));
        }
    }

    /// True when the front entry is written by lockgate, not Redis.
    pub(super) fn front_is_local(&self) -> bool {
        matches!(
            self.queue.front(),
            Some(
                Pending::Local(_)
                    | Pending::EnterRaw
                    | Pending::Close
                    | Pending::Deferred(_)
                    | Pending::Silent(_)
            )
        )
    }

    /// True when the next frame's first element must be read: it may be a
    /// confirmation for the `Sub` entry at the front, or (RESP2, while
    /// subscribed) a published message, which is no reply.
    pub(super) fn peeks(&self) -> bool {
        matches!(self.queue.front(), Some(Pending::Sub { .. }))
            || (!self.resp3 && self.subs.iter().any(|&n| n > 0))
    }

    /// Classifies the frame starting `buf`; `None` until enough of it is in.
    pub(super) fn classify(&self, buf: &[u8]) -> Option<FrameClass> {
        let name = match peek_name(buf) {
            Peek::More => return None,
            Peek::Other => return Some(FrameClass::Other),
            Peek::Name(name) => name,
        };
        if matches!(name, b"message" | b"pmessage" | b"smessage")
            && (buf[0] == b'>' || self.subs.iter().any(|&n| n > 0))
        {
            return Some(FrameClass::Message);
        }
        let confirms = match self.queue.front() {
            Some(Pending::Sub { kind, .. }) => kind.confirmation() == name,
            _ => false,
        };
        Some(if confirms {
            FrameClass::Confirm
        } else {
            FrameClass::Other
        })
    }

    /// A confirmation for the `Sub` entry at the front: counts it and the
    /// subscriptions it reports, and settles the entry once all came.
    pub(super) fn confirmed(&mut self, frame: &[u8]) {
        let Some(Pending::Sub { kind, args, left }) = self.queue.front_mut() else {
            return;
        };
        let (kind, set) = (*kind, kind.set());
        let owed = left.get_or_insert_with(|| match *args {
            0 => self.subs[set].max(1),
            n => u64::from(n),
        });
        *owed = owed.saturating_sub(1);
        let done = *owed == 0;
        if let Some(count) = confirmation_count(frame) {
            if set == 2 {
                self.subs[2] = count;
            } else {
                // The count is channels and patterns together: the change
                // tells whether this one was new (or gone).
                let total = self.subs[0] + self.subs[1];
                if kind.adds() && count > total {
                    self.subs[set] += count - total;
                } else if !kind.adds() && count < total {
                    self.subs[set] = self.subs[set].saturating_sub(total - count);
                }
            }
        }
        if done {
            self.queue.pop_front();
        }
    }
}
