//! Client requests: find where one command ends, its arguments, and nothing
//! more. Redis requests are either a multibulk (`*N` then N `$len` bulks) or
//! an inline line (`PING\r\n`, as telnet and redis-cli's raw mode send).
//!
//! The parser never copies a multibulk: arguments are byte ranges into the
//! caller's buffer, so the session can forward the client's own bytes. Limits
//! are checked on each header before its payload is waited for, so a declared
//! 10 GB bulk is refused after a few bytes, not after 10 GB arrived.

use std::ops::Range;

use super::ProtocolError;

/// Longest `*N`/`$N` header line Redis accepts before it gives up (64 KiB).
const MAX_HEADER_LINE: usize = 64 * 1024;

/// Limits the parser enforces; copied from `config::LimitsConfig`.
#[derive(Debug, Clone, Copy)]
pub struct RequestLimits {
    /// Largest bulk argument in bytes.
    pub max_bulk_bytes: u64,
    /// Most arguments in one command.
    pub max_multibulk_len: u64,
    /// Largest inline line in bytes.
    pub max_inline_bytes: usize,
    /// Largest whole command in bytes.
    pub max_request_bytes: u64,
}

/// How a complete request was written by the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestKind {
    /// `*N` multibulk with at least one argument.
    Multibulk,
    /// An inline line with at least one word.
    Inline,
    /// `*0`, `*-1`, or a blank inline line: Redis skips it and sends no reply.
    Empty,
}

/// One complete request at the front of the buffer that was parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Bytes the request occupies at the front of the buffer.
    pub len: usize,
    /// Multibulk, inline or empty.
    pub kind: RequestKind,
}

/// Where an argument's bytes live: in the client's buffer (multibulk), or in
/// the parser's own scratch space (inline words, which may carry escapes).
#[derive(Debug, Clone)]
enum ArgSource {
    Buffer,
    Scratch,
}

/// A resumable request parser. Call [`RequestParser::parse`] with the unread
/// bytes; `Ok(None)` means "not enough bytes yet" and [`RequestParser::needed`]
/// says how many bytes must be buffered before trying again.
#[derive(Debug)]
pub struct RequestParser {
    limits: RequestLimits,
    args: Vec<Range<usize>>,
    source: ArgSource,
    scratch: Vec<u8>,
    needed: usize,
}

impl RequestParser {
    /// A parser enforcing `limits`.
    pub fn new(limits: RequestLimits) -> RequestParser {
        RequestParser {
            limits,
            args: Vec::with_capacity(8),
            source: ArgSource::Buffer,
            scratch: Vec::new(),
            needed: 0,
        }
    }

    /// Least buffer length worth parsing again after `Ok(None)`; 0 after a
    /// complete request.
    pub fn needed(&self) -> usize {
        self.needed
    }

    /// Number of arguments (name included) of the last complete request.
    pub fn argc(&self) -> usize {
        self.args.len()
    }

    /// Argument `i` of the last complete request; `buf` must be the buffer
    /// that was passed to `parse`. Out of range gives an empty slice.
    pub fn arg<'a>(&'a self, buf: &'a [u8], i: usize) -> &'a [u8] {
        let Some(range) = self.args.get(i) else {
            return &[];
        };
        match self.source {
            ArgSource::Buffer => buf.get(range.clone()).unwrap_or(&[]),
            ArgSource::Scratch => self.scratch.get(range.clone()).unwrap_or(&[]),
        }
    }

    /// Where the last complete request's arguments are in the buffer that
    /// was passed to `parse`: `None` for an inline request, whose words
    /// live in the parser's own space.
    pub fn arg_ranges(&self) -> Option<&[Range<usize>]> {
        match self.source {
            ArgSource::Buffer => Some(&self.args),
            ArgSource::Scratch => None,
        }
    }

    /// Parses the request at the front of `buf`.
    pub fn parse(&mut self, buf: &[u8]) -> Result<Option<Request>, ProtocolError> {
        self.args.clear();
        self.source = ArgSource::Buffer;
        let Some(&first) = buf.first() else {
            self.needed = 1;
            return Ok(None);
        };
        let parsed = if first == b'*' {
            self.parse_multibulk(buf)?
        } else {
            self.parse_inline(buf)?
        };
        if parsed.is_some() {
            self.needed = 0;
        }
        Ok(parsed)
    }

    fn parse_multibulk(&mut self, buf: &[u8]) -> Result<Option<Request>, ProtocolError> {
        let Some((count, mut pos)) = header_value(
            buf,
            0,
            ProtocolError::TooBigMultibulkCount,
            ProtocolError::InvalidMultibulkLength,
        )?
        else {
            self.needed = buf.len() + 1;
            return Ok(None);
        };
        if count <= 0 {
            return Ok(Some(Request {
                len: pos,
                kind: RequestKind::Empty,
            }));
        }
        if count as u64 > self.limits.max_multibulk_len {
            return Err(ProtocolError::InvalidMultibulkLength);
        }
        let mut declared = pos as u64;
        for _ in 0..count {
            let Some(&kind) = buf.get(pos) else {
                self.needed = pos + 1;
                return Ok(None);
            };
            if kind != b'$' {
                return Err(ProtocolError::ExpectedBulk(kind));
            }
            let Some((len, data)) = header_value(
                buf,
                pos,
                ProtocolError::TooBigBulkCount,
                ProtocolError::InvalidBulkLength,
            )?
            else {
                self.needed = buf.len() + 1;
                return Ok(None);
            };
            if len < 0 || len as u64 > self.limits.max_bulk_bytes {
                return Err(ProtocolError::InvalidBulkLength);
            }
            let end = data + len as usize;
            declared += (data - pos) as u64 + len as u64 + 2;
            if declared > self.limits.max_request_bytes {
                return Err(ProtocolError::RequestTooLarge(
                    self.limits.max_request_bytes,
                ));
            }
            if buf.len() < end + 2 {
                self.needed = end + 2;
                return Ok(None);
            }
            if &buf[end..end + 2] != b"\r\n" {
                return Err(ProtocolError::MissingCrlf);
            }
            self.args.push(data..end);
            pos = end + 2;
        }
        Ok(Some(Request {
            len: pos,
            kind: RequestKind::Multibulk,
        }))
    }

    fn parse_inline(&mut self, buf: &[u8]) -> Result<Option<Request>, ProtocolError> {
        let limit = buf.len().min(self.limits.max_inline_bytes + 1);
        let Some(nl) = memchr::memchr(b'\n', &buf[..limit]) else {
            if buf.len() > self.limits.max_inline_bytes {
                return Err(ProtocolError::TooBigInline);
            }
            self.needed = buf.len() + 1;
            return Ok(None);
        };
        let mut line = &buf[..nl];
        if let [rest @ .., b'\r'] = line {
            line = rest;
        }
        self.source = ArgSource::Scratch;
        self.scratch.clear();
        split_inline(line, &mut self.scratch, &mut self.args)?;
        let kind = if self.args.is_empty() {
            RequestKind::Empty
        } else {
            RequestKind::Inline
        };
        Ok(Some(Request { len: nl + 1, kind }))
    }
}

/// The number in the CRLF-terminated header starting at `start` (its type
/// byte included), read as `string2ll` reads it, and the position after the
/// CRLF; `too_big` when no CRLF comes within the line limit, `invalid` when
/// the number is not one Redis accepts.
#[inline(always)]
fn header_value(
    buf: &[u8],
    start: usize,
    too_big: ProtocolError,
    invalid: ProtocolError,
) -> Result<Option<(i64, usize)>, ProtocolError> {
    // The form every client sends, `0` or up to 18 digits without a
    // leading zero and then CRLF, read in one pass; anything else (a sign,
    // a leading zero, a long or cut line) takes the general path, which
    // gives the same answer for this form.
    let from = start + 1;
    let mut i = from;
    let mut value: i64 = 0;
    while let Some(&d) = buf.get(i) {
        if !d.is_ascii_digit() || i - from == 18 {
            break;
        }
        value = value * 10 + i64::from(d - b'0');
        i += 1;
    }
    let leading_zero = buf.get(from) == Some(&b'0') && i - from > 1;
    if i > from && !leading_zero && buf.get(i..i + 2) == Some(b"\r\n") {
        return Ok(Some((value, i + 2)));
    }
    header_value_slow(buf, start, too_big, invalid)
}

/// [`header_value`] for any other form: kept out of line, so the common
/// form's loop stays small where it is inlined.
#[cold]
#[inline(never)]
fn header_value_slow(
    buf: &[u8],
    start: usize,
    too_big: ProtocolError,
    invalid: ProtocolError,
) -> Result<Option<(i64, usize)>, ProtocolError> {
    let Some((digits, after)) = header_line(buf, start, too_big)? else {
        return Ok(None);
    };
    let value = string2ll(digits).ok_or(invalid)?;
    Ok(Some((value, after)))
}

/// Finds the CRLF-terminated header starting at `start` (its type byte
/// included); returns the digits and the position after the CRLF.
fn header_line(
    buf: &[u8],
    start: usize,
    too_big: ProtocolError,
) -> Result<Option<(&[u8], usize)>, ProtocolError> {
    let from = start + 1;
    let window_end = buf.len().min(from + MAX_HEADER_LINE);
    let Some(cr) = memchr::memchr(b'\r', &buf[from.min(window_end)..window_end]) else {
        if buf.len() - start > MAX_HEADER_LINE {
            return Err(too_big);
        }
        return Ok(None);
    };
    let cr = from + cr;
    match buf.get(cr + 1) {
        None => Ok(None),
        Some(b'\n') => Ok(Some((&buf[from..cr], cr + 2))),
        Some(_) => Err(ProtocolError::MissingCrlf),
    }
}

/// A decimal integer: optional '-', decimal digits, no '+', no spaces (a
/// leading zero is accepted: this reads Redis's replies and numbers in them;
/// requests use the stricter `string2ll`).
pub(crate) fn parse_int(digits: &[u8]) -> Option<i64> {
    let (negative, digits) = match digits {
        [b'-', rest @ ..] => (true, rest),
        _ => (false, digits),
    };
    if digits.is_empty() || digits.len() > 19 {
        return None;
    }
    let mut value: i64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return None;
        }
        value = value.checked_mul(10)?.checked_add(i64::from(d - b'0'))?;
    }
    Some(if negative { -value } else { value })
}

/// Redis's `string2ll` exactly, for the lengths of a request (and the
/// numbers in its arguments that lockgate reads as Redis would): optional '-',
/// then `0` or digits without a leading zero, fitting an i64; no '+', no
/// spaces, no `-0`. A length Redis refuses (`$04`) must be refused here too,
/// or the two would frame the stream differently.
pub(crate) fn string2ll(digits: &[u8]) -> Option<i64> {
    let (negative, digits) = match digits {
        [b'-', rest @ ..] => (true, rest),
        _ => (false, digits),
    };
    match digits {
        [] => return None,
        [b'0'] if !negative => return Some(0),
        [b'0', ..] => return None,
        _ if digits.len() > 19 => return None,
        _ => {}
    }
    // Accumulated as a negative number, so i64::MIN fits.
    let mut value: i64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return None;
        }
        value = value.checked_mul(10)?.checked_sub(i64::from(d - b'0'))?;
    }
    if negative {
        Some(value)
    } else {
        value.checked_neg()
    }
}

/// The blanks `sdssplitargs` skips between words: C's `isspace`.
fn is_blank(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}

/// The bytes that end an unquoted word in `sdssplitargs` (fewer than
/// [`is_blank`]: a vertical tab or form feed stays inside the word).
fn ends_word(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\n' | b'\r')
}

/// Splits an inline line into words the way Redis's `sdssplitargs` does:
/// blanks separate words ([`is_blank`] before a word, [`ends_word`] after
/// an unquoted one), "double quotes" understand `\n \r \t \b \a \\
/// \" \xHH`, 'single quotes' understand `\'`, and a closing quote must be
/// followed by whitespace or the end of the line.
fn split_inline(
    line: &[u8],
    out: &mut Vec<u8>,
    args: &mut Vec<Range<usize>>,
) -> Result<(), ProtocolError> {
    let mut i = 0;
    loop {
        while i < line.len() && is_blank(line[i]) {
            i += 1;
        }
        if i == line.len() {
            return Ok(());
        }
        let start = out.len();
        match line[i] {
            b'"' => i = double_quoted(line, i + 1, out)?,
            b'\'' => i = single_quoted(line, i + 1, out)?,
            _ => {
                while i < line.len() && !ends_word(line[i]) {
                    out.push(line[i]);
                    i += 1;
                }
            }
        }
        args.push(start..out.len());
    }
}

fn closing_ok(line: &[u8], after: usize) -> Result<usize, ProtocolError> {
    match line.get(after) {
        None => Ok(after),
        Some(&c) if is_blank(c) => Ok(after),
        Some(_) => Err(ProtocolError::UnbalancedQuotes),
    }
}

fn double_quoted(line: &[u8], mut i: usize, out: &mut Vec<u8>) -> Result<usize, ProtocolError> {
    while i < line.len() {
        match line[i] {
            b'"' => return closing_ok(line, i + 1),
            b'\\'
                if i + 3 < line.len()
                    && line[i + 1] == b'x'
                    && line[i + 2].is_ascii_hexdigit()
                    && line[i + 3].is_ascii_hexdigit() =>
            {
                let hex = |c: u8| (c as char).to_digit(16).unwrap_or(0) as u8;
                out.push(hex(line[i + 2]) * 16 + hex(line[i + 3]));
                i += 4;
            }
            b'\\' if i + 1 < line.len() => {
                out.push(match line[i + 1] {
                    b'n' => b'\n',
                    b'r' => b'\r',
                    b't' => b'\t',
                    b'b' => 8,
                    b'a' => 7,
                    other => other,
                });
                i += 2;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    Err(ProtocolError::UnbalancedQuotes)
}

fn single_quoted(line: &[u8], mut i: usize, out: &mut Vec<u8>) -> Result<usize, ProtocolError> {
    while i < line.len() {
        match line[i] {
            b'\'' => return closing_ok(line, i + 1),
            b'\\' if line.get(i + 1) == Some(&b'\'') => {
                out.push(b'\'');
                i += 2;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    Err(ProtocolError::UnbalancedQuotes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parser() -> RequestParser {
        RequestParser::new(RequestLimits {
            max_bulk_bytes: 1024,
            max_multibulk_len: 16,
            max_inline_bytes: 64,
            max_request_bytes: 4096,
        })
    }

    fn args(p: &RequestParser, buf: &[u8]) -> Vec<Vec<u8>> {
        (0..p.argc()).map(|i| p.arg(buf, i).to_vec()).collect()
    }

    #[test]
    fn multibulk_complete_and_partial() {
        let mut p = parser();
        let buf = b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n*1";
        let req = p.parse(buf).unwrap().unwrap();
        assert_eq!(req.len, 20);
        assert_eq!(args(&p, buf), vec![b"GET".to_vec(), b"k".to_vec()]);
        for cut in 0..20 {
            assert_eq!(p.parse(&buf[..cut]).unwrap(), None, "cut at {cut}");
            assert!(p.needed() > cut);
        }
    }

    #[test]
    fn needed_points_past_a_large_bulk() {
        let mut p = parser();
        assert_eq!(p.parse(b"*1\r\n$1000\r\nab").unwrap(), None);
        assert_eq!(p.needed(), 11 + 1000 + 2);
    }

    #[test]
    fn limits_are_checked_on_the_header() {
        let mut p = parser();
        assert_eq!(
            p.parse(b"*1\r\n$1025\r\n"),
            Err(ProtocolError::InvalidBulkLength)
        );
        assert_eq!(
            p.parse(b"*17\r\n"),
            Err(ProtocolError::InvalidMultibulkLength)
        );
        assert_eq!(
            p.parse(b"*1\r\n$-3\r\n"),
            Err(ProtocolError::InvalidBulkLength)
        );
        assert_eq!(
            p.parse(b"*x\r\n"),
            Err(ProtocolError::InvalidMultibulkLength)
        );
        assert_eq!(
            p.parse(b"*1\r\n*1\r\n"),
            Err(ProtocolError::ExpectedBulk(b'*'))
        );
        assert_eq!(p.parse(b"*1\r\n$1\r\nabc"), Err(ProtocolError::MissingCrlf));
        let mut many = b"*8\r\n$1000\r\n".to_vec();
        many.extend(std::iter::repeat_n(b'a', 1000));
        many.extend(b"\r\n");
        for _ in 0..4 {
            many.extend(b"$1000\r\n");
            many.extend(std::iter::repeat_n(b'a', 1000));
            many.extend(b"\r\n");
        }
        assert_eq!(p.parse(&many), Err(ProtocolError::RequestTooLarge(4096)));
    }

    #[test]
    fn empty_multibulk_is_skipped() {
        let mut p = parser();
        let req = p.parse(b"*0\r\n").unwrap().unwrap();
        assert_eq!((req.len, req.kind), (4, RequestKind::Empty));
        let req = p.parse(b"*-1\r\n").unwrap().unwrap();
        assert_eq!(req.kind, RequestKind::Empty);
    }

    #[test]
    fn inline_words_and_quotes() {
        let mut p = parser();
        let buf = b"SET \"a b\\x41\" 'it\\'s'\r\nPING";
        let req = p.parse(buf).unwrap().unwrap();
        assert_eq!(req.kind, RequestKind::Inline);
        assert_eq!(req.len, 23);
        assert_eq!(
            args(&p, buf),
            vec![b"SET".to_vec(), b"a bA".to_vec(), b"it's".to_vec()]
        );
        assert_eq!(p.parse(b"PING").unwrap(), None);
        assert_eq!(
            p.parse(b"  \r\n").unwrap().unwrap().kind,
            RequestKind::Empty
        );
        assert_eq!(
            p.parse(b"GET \"k\r\n"),
            Err(ProtocolError::UnbalancedQuotes)
        );
        assert_eq!(
            p.parse(b"GET \"k\"x\r\n"),
            Err(ProtocolError::UnbalancedQuotes)
        );
        assert_eq!(p.parse(&[b'A'; 65]), Err(ProtocolError::TooBigInline));
    }

    /// Found by the `request` fuzz target. Redis skips any C blank before a
    /// word (vertical tab and form feed included) but ends an unquoted word
    /// only at space, tab, CR or LF (checked against Redis 7.0). lockgate
    /// used Rust's ASCII whitespace: `\x0bSETNX lock:a 1` was one unknown
    /// word to it, passed through, and Redis set the lock unprotected.
    #[test]
    fn inline_blanks_are_redis_blanks() {
        let mut p = parser();
        let buf = b"\x0bSETNX \x0clock:a 1\x0c\r\n";
        p.parse(buf).unwrap().unwrap();
        assert_eq!(
            args(&p, buf),
            vec![b"SETNX".to_vec(), b"lock:a".to_vec(), b"1\x0c".to_vec()]
        );
        let buf = b"ECHO\x0cx \"y\"\x0b\r\n";
        p.parse(buf).unwrap().unwrap();
        assert_eq!(args(&p, buf), vec![b"ECHO\x0cx".to_vec(), b"y".to_vec()]);
    }

    /// Found writing the `request` fuzz target's reference: Redis's
    /// `string2ll` refuses a leading zero (`$04` is "invalid bulk length" in
    /// Redis 7.0) and `-0`, and takes i64::MIN (`*-9223372036854775808` is
    /// an empty request).
    #[test]
    fn lengths_are_read_like_string2ll() {
        let mut p = parser();
        assert_eq!(
            p.parse(b"*1\r\n$04\r\nPING\r\n"),
            Err(ProtocolError::InvalidBulkLength)
        );
        assert_eq!(
            p.parse(b"*01\r\n$4\r\nPING\r\n"),
            Err(ProtocolError::InvalidMultibulkLength)
        );
        assert_eq!(
            p.parse(b"*-0\r\n"),
            Err(ProtocolError::InvalidMultibulkLength)
        );
        let req = p.parse(b"*-9223372036854775808\r\n").unwrap().unwrap();
        assert_eq!(req.kind, RequestKind::Empty);
        assert_eq!(string2ll(b"0"), Some(0));
        assert_eq!(string2ll(b"-12"), Some(-12));
        assert_eq!(string2ll(b"9223372036854775807"), Some(i64::MAX));
        assert_eq!(string2ll(b"9223372036854775808"), None);
        assert_eq!(string2ll(b"+1"), None);
        // Replies keep the lenient reading.
        assert_eq!(parse_int(b"000042"), Some(42));
    }
}
