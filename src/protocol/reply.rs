//! Replies from Redis: find where each top-level frame ends, without
//! buffering it. The scanner is a resumable state machine over the byte
//! stream: bytes it has passed over may be forwarded to the client at once (a
//! 100 MB `GET` reply streams through), and it reports each top-level frame
//! end so the session can count replies and slot its own replies in between.
//!
//! It knows RESP2 and RESP3: push frames (`>`) and attributes (`|`) are
//! reported as such, because they are not replies to a command.

use super::request::parse_int;
use super::ProtocolError;

/// Longest number header accepted from Redis (`$123\r\n`, `*5\r\n`, …).
const MAX_NUMBER_LINE: usize = 32;

/// What a finished top-level frame was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// A reply to a command (any type but push and attribute).
    Reply,
    /// A RESP3 push frame (`>`): pub/sub message, tracking invalidation.
    Push,
    /// A RESP3 attribute (`|`): metadata before the reply it annotates.
    Attribute,
}

/// A top-level frame that just ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameEnd {
    /// Reply, push or attribute.
    pub kind: FrameKind,
    /// The frame's type byte (`+`, `%`, `*`, …).
    pub type_byte: u8,
    /// Whole length of the frame in bytes.
    pub len: u64,
    /// The frame's first bytes (up to 8), to recognise short replies such as
    /// `+RESET\r\n` even when the frame was split across reads.
    pub head: [u8; 8],
}

impl FrameEnd {
    /// True when the frame is exactly `bytes` (which must be ≤ 8 long).
    pub fn is(&self, bytes: &[u8]) -> bool {
        self.len == bytes.len() as u64 && self.head.get(..bytes.len()) == Some(bytes)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum State {
    /// At the start of an element: the type byte and header come next.
    #[default]
    Header,
    /// Inside a simple line element (`+`, `-`, `:`, …), until `\n`.
    Line,
    /// Inside a bulk payload: this many bytes (CRLF included) remain.
    Bulk(u64),
}

/// Resumable scanner for a stream of RESP2/RESP3 frames. See the module doc.
///
/// Replies come from Redis, which is trusted: they are scanned in constant
/// memory with no limit on nesting (a Lua script can return thousands of
/// nested arrays). One count of the element slots still to fill in the
/// current top-level frame replaces a stack of open aggregates: an
/// aggregate of `n` fills its own slot and opens `n`, an attribute opens
/// `2n` beside the slot it annotates, any other element fills one.
#[derive(Debug, Clone, Default)]
pub struct ReplyScanner {
    state: State,
    /// Element slots still to fill before the top-level frame ends.
    left: u64,
    top: Option<FrameEnd>,
}

/// A type byte whose element is one line (`+`, `-`, `:`, `,`, `#`, `_`,
/// `(`), ended by its `\n`.
fn is_line_type(type_byte: u8) -> bool {
    matches!(type_byte, b'+' | b'-' | b':' | b',' | b'#' | b'_' | b'(')
}

/// Where the first `\n` of `buf` is. Most lines are a few bytes (`+OK`,
/// `:1`): the first 16 are looked at one by one, which is cheaper than
/// setting up `memchr` for them.
fn line_end(buf: &[u8]) -> Option<usize> {
    const SHORT: usize = 16;
    let short = &buf[..buf.len().min(SHORT)];
    if let Some(nl) = short.iter().position(|&b| b == b'\n') {
        return Some(nl);
    }
    let rest = buf.get(SHORT..)?;
    memchr::memchr(b'\n', rest).map(|nl| nl + SHORT)
}

/// The frame end of `line`, a whole top-level line element (its `\n`
/// included).
fn line_frame(line: &[u8]) -> FrameEnd {
    let mut head = [0; 8];
    let n = line.len().min(8);
    head[..n].copy_from_slice(&line[..n]);
    FrameEnd {
        kind: FrameKind::Reply,
        type_byte: line[0],
        len: line.len() as u64,
        head,
    }
}

/// How many whole plain replies, at most `max`, `buf` starts with, and the
/// bytes they take: one-line replies (`+OK`, `:1`, errors, RESP3 scalars)
/// and bulk strings (`$3\r\nfoo\r\n`, `$-1\r\n`) that are all in. It stops
/// at anything else (an aggregate, a push, an attribute, a frame not all
/// in, a header it does not read in one pass), which
/// [`ReplyScanner::advance`] then reads: `buf` must start at a frame
/// boundary. On the frames it takes the two agree (the `reply` fuzz target
/// checks it); the writer counts a run of forwarded replies with it, without
/// the scanner's per-frame bookkeeping.
pub fn simple_frames(buf: &[u8], max: usize) -> (usize, usize) {
    let (mut pos, mut frames) = (0, 0);
    while frames < max {
        let Some(&type_byte) = buf.get(pos) else {
            break;
        };
        let rest = &buf[pos..];
        let len = if is_line_type(type_byte) {
            match line_end(rest) {
                Some(nl) => nl + 1,
                None => break,
            }
        } else if type_byte == b'$' {
            match whole_bulk(rest) {
                Some(len) => len,
                None => break,
            }
        } else {
            break;
        };
        pos += len;
        frames += 1;
    }
    (pos, frames)
}

/// The length of the bulk string `buf` starts with (`$` first) when its
/// header is `$-1` or up to 18 digits, then CRLF, and all its bytes are in.
/// [`ReplyScanner::advance`] reads these headers the same way (it also
/// takes the payload's CRLF on trust, counting `n + 2` bytes).
fn whole_bulk(buf: &[u8]) -> Option<usize> {
    if buf.get(1) == Some(&b'-') {
        return buf.starts_with(b"$-1\r\n").then_some(5);
    }
    let mut n: u64 = 0;
    let mut i = 1;
    while let Some(&d) = buf.get(i) {
        if !d.is_ascii_digit() || i > 18 {
            break;
        }
        n = n * 10 + u64::from(d - b'0');
        i += 1;
    }
    if i == 1 || buf.get(i..i + 2) != Some(b"\r\n") {
        return None;
    }
    let len = (i + 2)
        .checked_add(usize::try_from(n).ok()?)?
        .checked_add(2)?;
    (buf.len() >= len).then_some(len)
}

impl ReplyScanner {
    /// A scanner at the start of a stream.
    pub fn new() -> ReplyScanner {
        ReplyScanner::default()
    }

    /// True when the scanner sits between two top-level frames.
    pub fn at_boundary(&self) -> bool {
        self.top.is_none()
    }

    /// Scans `buf`, stopping right after the first top-level frame that ends
    /// in it. Returns the bytes consumed (safe to forward) and that frame, if
    /// any. An incomplete header is left unconsumed; call again with it and
    /// more bytes.
    pub fn advance(&mut self, buf: &[u8]) -> Result<(usize, Option<FrameEnd>), ProtocolError> {
        let mut pos = 0;
        while pos < buf.len() {
            match self.state {
                State::Bulk(left) => {
                    let take = left.min((buf.len() - pos) as u64);
                    self.grow_top(&buf[pos..pos + take as usize]);
                    pos += take as usize;
                    if take < left {
                        self.state = State::Bulk(left - take);
                        return Ok((pos, None));
                    }
                    self.state = State::Header;
                    if let Some(end) = self.element_done() {
                        return Ok((pos, Some(end)));
                    }
                }
                State::Line => match memchr::memchr(b'\n', &buf[pos..]) {
                    None => {
                        self.grow_top(&buf[pos..]);
                        return Ok((buf.len(), None));
                    }
                    Some(nl) => {
                        self.grow_top(&buf[pos..pos + nl + 1]);
                        pos += nl + 1;
                        self.state = State::Header;
                        if let Some(end) = self.element_done() {
                            return Ok((pos, Some(end)));
                        }
                    }
                },
                State::Header if self.top.is_none() && is_line_type(buf[pos]) => {
                    // The commonest reply by far (`+OK`, `:1`, an error) is
                    // one line: found whole in one search, its frame made
                    // at once.
                    match line_end(&buf[pos..]) {
                        Some(nl) => {
                            return Ok((pos + nl + 1, Some(line_frame(&buf[pos..=pos + nl]))))
                        }
                        None => {
                            self.start_element(buf[pos]);
                            self.grow_top(&buf[pos..]);
                            self.state = State::Line;
                            return Ok((buf.len(), None));
                        }
                    }
                }
                State::Header => match self.header(&buf[pos..])? {
                    None => return Ok((pos, None)),
                    Some((used, finished)) => {
                        pos += used;
                        if finished {
                            if let Some(end) = self.element_done() {
                                return Ok((pos, Some(end)));
                            }
                        }
                    }
                },
            }
        }
        Ok((pos, None))
    }

    /// Reads one element header. Returns the bytes used and whether the
    /// element is already complete (null, empty aggregate), or `None` if the
    /// header line is not complete yet.
    fn header(&mut self, buf: &[u8]) -> Result<Option<(usize, bool)>, ProtocolError> {
        let type_byte = buf[0];
        let top_level = self.top.is_none();
        match type_byte {
            t if is_line_type(t) => {
                self.start_element(type_byte);
                self.grow_top(&buf[..1]);
                self.state = State::Line;
                Ok(Some((1, false)))
            }
            b'$' | b'!' | b'=' | b'*' | b'~' | b'>' | b'%' | b'|' => {
                let window = &buf[..buf.len().min(MAX_NUMBER_LINE)];
                let Some(nl) = memchr::memchr(b'\n', window) else {
                    if buf.len() >= MAX_NUMBER_LINE {
                        return Err(ProtocolError::BadReply("header line too long"));
                    }
                    return Ok(None);
                };
                if nl < 2 || buf[nl - 1] != b'\r' {
                    return Err(ProtocolError::BadReply("header without CRLF"));
                }
                let n = parse_int(&buf[1..nl - 1])
                    .ok_or(ProtocolError::BadReply("header length is not a number"))?;
                let used = nl + 1;
                self.start_element(type_byte);
                self.grow_top(&buf[..used]);
                if n < 0 {
                    if n == -1 {
                        return Ok(Some((used, true)));
                    }
                    return Err(ProtocolError::BadReply("negative length"));
                }
                let n = n as u64;
                match type_byte {
                    b'$' | b'!' | b'=' => {
                        self.state = State::Bulk(n + 2);
                        Ok(Some((used, false)))
                    }
                    _ => {
                        let elements = if matches!(type_byte, b'%' | b'|') {
                            n * 2
                        } else {
                            n
                        };
                        if elements == 0 {
                            // An empty aggregate fills its slot; an empty
                            // attribute fills none (it annotates the element
                            // after it), unless it is a frame of its own.
                            return Ok(Some((used, type_byte != b'|' || top_level)));
                        }
                        if type_byte == b'|' {
                            // An attribute annotates the element after it: its
                            // slot stays open beside the attribute's own.
                            self.left = self.left.saturating_add(elements);
                        } else {
                            // The aggregate fills its slot and opens its own.
                            self.left = self.left.saturating_add(elements).saturating_sub(1);
                        }
                        Ok(Some((used, false)))
                    }
                }
            }
            _ => Err(ProtocolError::BadReply("unknown type byte")),
        }
    }

    fn start_element(&mut self, type_byte: u8) {
        if self.top.is_none() {
            // The frame itself is the one slot; a top-level attribute is a
            // frame of its own (the reply it annotates is the next one).
            self.left = u64::from(type_byte != b'|');
            let kind = match type_byte {
                b'>' => FrameKind::Push,
                b'|' => FrameKind::Attribute,
                _ => FrameKind::Reply,
            };
            self.top = Some(FrameEnd {
                kind,
                type_byte,
                len: 0,
                head: [0; 8],
            });
        }
    }

    /// Accounts `bytes` to the current top-level frame, keeping its first 8.
    fn grow_top(&mut self, bytes: &[u8]) {
        if let Some(top) = self.top.as_mut() {
            if top.len < 8 {
                let at = top.len as usize;
                let n = bytes.len().min(8 - at);
                top.head[at..at + n].copy_from_slice(&bytes[..n]);
            }
            top.len += bytes.len() as u64;
        }
    }

    /// One element finished: settle the aggregates it completes and report
    /// the top-level frame if that was the last of it.
    fn element_done(&mut self) -> Option<FrameEnd> {
        self.left = self.left.saturating_sub(1);
        if self.left > 0 {
            return None;
        }
        self.top.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(input: &[u8], chunk: usize) -> Vec<(FrameKind, u64)> {
        let mut s = ReplyScanner::new();
        let mut out = Vec::new();
        let mut pending: Vec<u8> = Vec::new();
        for piece in input.chunks(chunk) {
            pending.extend_from_slice(piece);
            loop {
                let (used, end) = s.advance(&pending).unwrap();
                pending.drain(..used);
                match end {
                    Some(e) => out.push((e.kind, e.len)),
                    None => break,
                }
            }
        }
        assert!(pending.is_empty() && s.at_boundary());
        out
    }

    #[test]
    fn finds_every_frame_whatever_the_chunking() {
        let input: &[u8] = b"+OK\r\n$5\r\nhello\r\n$-1\r\n*2\r\n:1\r\n*-1\r\n%1\r\n+k\r\n~0\r\n\
>3\r\n$7\r\nmessage\r\n$1\r\nc\r\n$1\r\nm\r\n|1\r\n+a\r\n:1\r\n_\r\n-ERR x\r\n*0\r\n";
        let want = vec![
            (FrameKind::Reply, 5),
            (FrameKind::Reply, 11),
            (FrameKind::Reply, 5),
            (FrameKind::Reply, 13),
            (FrameKind::Reply, 12),
            (FrameKind::Push, 31),
            (FrameKind::Attribute, 12),
            (FrameKind::Reply, 3),
            (FrameKind::Reply, 8),
            (FrameKind::Reply, 4),
        ];
        for chunk in 1..input.len() {
            assert_eq!(frames(input, chunk), want, "chunk {chunk}");
        }
    }

    #[test]
    fn recognises_short_frames_across_reads() {
        let mut s = ReplyScanner::new();
        assert_eq!(s.advance(b"+RE").unwrap(), (3, None));
        let (used, end) = s.advance(b"SET\r\n").unwrap();
        assert_eq!(used, 5);
        let end = end.unwrap();
        assert!(end.is(b"+RESET\r\n"));
        assert!(!end.is(b"+RESET"));
        assert_eq!(end.type_byte, b'+');
    }

    #[test]
    fn bad_input_is_an_error() {
        let mut s = ReplyScanner::new();
        assert!(s.advance(b"?x\r\n").is_err());
        let mut s = ReplyScanner::new();
        assert!(s.advance(b"$x\r\n").is_err());
    }

    #[test]
    fn nesting_has_no_limit_and_no_stack() {
        // What `EVAL "local a = {}; local b = {a}; a[1] = b; return a" 0`
        // makes Redis send: deep one-element arrays, then the error.
        let depth = 100_000;
        let mut input = b"*1\r\n".repeat(depth);
        input.extend_from_slice(b"-ERR reached lua stack limit\r\n+OK\r\n");
        let mut s = ReplyScanner::new();
        let (used, end) = s.advance(&input).unwrap();
        let end = end.unwrap();
        assert_eq!(end.kind, FrameKind::Reply);
        assert_eq!(used as u64, end.len);
        assert_eq!(
            s.advance(&input[used..]).unwrap(),
            (5, s.clone().advance(b"+OK\r\n").unwrap().1)
        );
        assert!(s.at_boundary());
    }

    #[test]
    fn nested_attributes_keep_their_slot() {
        let input: &[u8] = b"*2\r\n|1\r\n+a\r\n:1\r\n:5\r\n:6\r\n+OK\r\n";
        assert_eq!(
            frames(input, 1),
            vec![(FrameKind::Reply, 24), (FrameKind::Reply, 5)]
        );
    }

    /// Found by the `reply` fuzz target: an empty attribute (`|0`) inside an
    /// aggregate took the slot of the element it annotates, so the array
    /// `*2 |0 :1 :2` ended after `:1` and `:2` was read as the next reply.
    /// At the top level it stays a frame of its own.
    #[test]
    fn an_empty_attribute_fills_no_slot() {
        let input = b"*2\r\n|0\r\n:1\r\n:2\r\n+OK\r\n";
        for chunk in 1..=input.len() {
            assert_eq!(
                frames(input, chunk),
                vec![(FrameKind::Reply, 16), (FrameKind::Reply, 5)],
                "chunk {chunk}"
            );
        }
        assert_eq!(
            frames(b"|0\r\n+OK\r\n", 3),
            vec![(FrameKind::Attribute, 4), (FrameKind::Reply, 5)]
        );
    }

    /// `simple_frames` takes the plain replies the scanner reports as they
    /// are, stops where it must leave the rest to the scanner, and never
    /// takes more than asked.
    #[test]
    fn simple_frames_agree_with_the_scanner() {
        let plain: &[u8] =
            b"+OK\r\n$3\r\nfoo\r\n$-1\r\n:12\r\n-ERR x\r\n$0\r\n\r\n_\r\n#t\r\n$03\r\nbar\r\n";
        let (used, n) = simple_frames(plain, usize::MAX);
        assert_eq!((used, n), (plain.len(), 9));
        let lens: Vec<u64> = frames(plain, plain.len()).iter().map(|f| f.1).collect();
        assert_eq!(lens, [5, 9, 5, 5, 8, 6, 3, 4, 10]);
        assert_eq!(simple_frames(plain, 2), (14, 2));
        for stop in [
            &b"*1\r\n:1\r\n"[..],
            b">2\r\n",
            b"|1\r\n",
            b"%0\r\n",
            b"$3\r\nfo",
            b"$-2\r\n",
            b"$-01\r\n",
            b"$+3\r\nfoo\r\n",
            b"$3\rx",
            b"$\r\n",
            b"$1234567890123456789\r\n",
            b"+OK",
            b"",
        ] {
            let mut input = b"+A\r\n".to_vec();
            input.extend_from_slice(stop);
            assert_eq!(simple_frames(&input, 9), (4, 1), "{stop:?}");
        }
    }
}
