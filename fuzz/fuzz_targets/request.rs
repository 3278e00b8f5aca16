//! `protocol::request::RequestParser` against a small reference parser that
//! follows Redis's own `processMultibulkBuffer`/`processInlineBuffer` and
//! `sdssplitargs` (networking.c, sds.c), with lockgate's documented limits.
//!
//! The first input byte picks the limits (small ones, so every limit is
//! reachable, or the defaults) and seeds the chunk splits; the rest is the
//! byte stream a client sends. Checked:
//! - fed whole, every request is framed exactly as the reference frames it
//!   (same end offset, kind, name and argument bytes), or both reject it;
//! - every rejection reads `Protocol error: …` with Redis's wording (or one
//!   of lockgate's two own limits);
//! - fed in random chunks, honouring `needed()`, the same requests and the
//!   same error come out; a parse below `needed()` would still be `None`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lockgate::protocol::request::{RequestKind, RequestLimits, RequestParser};
use lockgate::protocol::ProtocolError;

const MAX_HEADER_LINE: usize = 64 * 1024;

/// What one parse gives: a framed request (length, kind, arguments), not
/// enough bytes, or an error.
#[derive(Debug, PartialEq)]
enum Outcome {
    Framed(usize, RequestKind, Vec<Vec<u8>>),
    Incomplete,
    Rejected(ProtocolError),
}

fn limits(selector: u8) -> RequestLimits {
    if selector & 1 == 0 {
        RequestLimits {
            max_bulk_bytes: 16,
            max_multibulk_len: 4,
            max_inline_bytes: 24,
            max_request_bytes: 48,
        }
    } else {
        // config::LimitsConfig's defaults.
        let d = lockgate::config::Config::default().limits;
        RequestLimits {
            max_bulk_bytes: d.max_bulk_bytes,
            max_multibulk_len: d.max_multibulk_len,
            max_inline_bytes: d.max_inline_bytes,
            max_request_bytes: d.max_request_bytes,
        }
    }
}

/// Redis's `string2ll`: optional '-', then "0" or a digit 1-9 followed by
/// digits, fitting in an i64; no '+', spaces or leading zeros.
fn string2ll(s: &[u8]) -> Option<i64> {
    let (neg, digits) = match s {
        [b'-', rest @ ..] => (true, rest),
        _ => (false, s),
    };
    if digits.is_empty() || digits.iter().any(|c| !c.is_ascii_digit()) {
        return None;
    }
    if digits.len() > 1 && digits[0] == b'0' {
        return None;
    }
    if neg && digits == b"0" {
        return None;
    }
    let text = std::str::from_utf8(s).ok()?;
    text.parse::<i64>().ok()
}

/// C's `isspace` in the "C" locale, which `sdssplitargs` skips before a
/// word and wants after a closing quote.
fn c_isspace(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}

/// What ends an unquoted word in `sdssplitargs`'s switch (NUL aside).
fn ends_word(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\n' | b'\r')
}

/// `sdssplitargs` on a line without NUL bytes (checked against Redis 7.0:
/// `\x0bECHO \x0bx\x0c` is `ECHO`, `x\x0c`).
fn splitargs(line: &[u8]) -> Result<Vec<Vec<u8>>, ProtocolError> {
    let mut args = Vec::new();
    let mut i = 0;
    loop {
        while i < line.len() && c_isspace(line[i]) {
            i += 1;
        }
        if i == line.len() {
            return Ok(args);
        }
        let mut cur = Vec::new();
        let quote = match line[i] {
            b'"' | b'\'' => Some(line[i]),
            _ => None,
        };
        if quote.is_some() {
            i += 1;
        }
        loop {
            match quote {
                None => {
                    if i == line.len() || ends_word(line[i]) {
                        break;
                    }
                    cur.push(line[i]);
                    i += 1;
                }
                Some(q) => {
                    let Some(&c) = line.get(i) else {
                        return Err(ProtocolError::UnbalancedQuotes);
                    };
                    let at = |k: usize| line.get(i + k).copied();
                    if q == b'"'
                        && c == b'\\'
                        && at(1) == Some(b'x')
                        && at(2).is_some_and(|h| h.is_ascii_hexdigit())
                        && at(3).is_some_and(|h| h.is_ascii_hexdigit())
                    {
                        let hex = std::str::from_utf8(&line[i + 2..i + 4]).unwrap();
                        cur.push(u8::from_str_radix(hex, 16).unwrap());
                        i += 4;
                    } else if q == b'"' && c == b'\\' && at(1).is_some() {
                        cur.push(match at(1).unwrap() {
                            b'n' => b'\n',
                            b'r' => b'\r',
                            b't' => b'\t',
                            b'b' => 8,
                            b'a' => 7,
                            other => other,
                        });
                        i += 2;
                    } else if q == b'\'' && c == b'\\' && at(1) == Some(b'\'') {
                        cur.push(b'\'');
                        i += 2;
                    } else if c == q {
                        // A closing quote must be followed by a space or
                        // the end of the line.
                        if at(1).is_some_and(|n| !c_isspace(n)) {
                            return Err(ProtocolError::UnbalancedQuotes);
                        }
                        i += 1;
                        break;
                    } else {
                        cur.push(c);
                        i += 1;
                    }
                }
            }
        }
        args.push(cur);
    }
}

/// Finds the `\r\n` ending the header that starts at `start`; `Ok(None)`
/// when it has not arrived yet.
fn header(
    buf: &[u8],
    start: usize,
    too_big: ProtocolError,
) -> Result<Option<(&[u8], usize)>, ProtocolError> {
    match buf[start + 1..].iter().position(|&c| c == b'\r') {
        Some(off) if off <= MAX_HEADER_LINE - 1 => {
            let cr = start + 1 + off;
            match buf.get(cr + 1) {
                None => Ok(None),
                Some(b'\n') => Ok(Some((&buf[start + 1..cr], cr + 2))),
                Some(_) => Err(ProtocolError::MissingCrlf),
            }
        }
        _ if buf.len() - start > MAX_HEADER_LINE => Err(too_big),
        _ => Ok(None),
    }
}

/// The reference: one request at the front of `buf`.
fn reference(buf: &[u8], l: &RequestLimits) -> Result<Outcome, ProtocolError> {
    let Some(&first) = buf.first() else {
        return Ok(Outcome::Incomplete);
    };
    if first != b'*' {
        let Some(nl) = buf.iter().position(|&c| c == b'\n') else {
            if buf.len() > l.max_inline_bytes {
                return Err(ProtocolError::TooBigInline);
            }
            return Ok(Outcome::Incomplete);
        };
        if nl > l.max_inline_bytes {
            return Err(ProtocolError::TooBigInline);
        }
        let mut line = &buf[..nl];
        if line.last() == Some(&b'\r') {
            line = &line[..line.len() - 1];
        }
        let args = splitargs(line)?;
        let kind = if args.is_empty() {
            RequestKind::Empty
        } else {
            RequestKind::Inline
        };
        return Ok(Outcome::Framed(nl + 1, kind, args));
    }
    let Some((digits, mut pos)) = header(buf, 0, ProtocolError::TooBigMultibulkCount)? else {
        return Ok(Outcome::Incomplete);
    };
    let count = string2ll(digits).ok_or(ProtocolError::InvalidMultibulkLength)?;
    if count <= 0 {
        return Ok(Outcome::Framed(pos, RequestKind::Empty, Vec::new()));
    }
    if count as u64 > l.max_multibulk_len {
        return Err(ProtocolError::InvalidMultibulkLength);
    }
    let mut total = pos as u64;
    let mut args = Vec::new();
    for _ in 0..count {
        let Some(&t) = buf.get(pos) else {
            return Ok(Outcome::Incomplete);
        };
        if t != b'$' {
            return Err(ProtocolError::ExpectedBulk(t));
        }
        let Some((digits, data)) = header(buf, pos, ProtocolError::TooBigBulkCount)? else {
            return Ok(Outcome::Incomplete);
        };
        let len = string2ll(digits).ok_or(ProtocolError::InvalidBulkLength)?;
        if len < 0 || len as u64 > l.max_bulk_bytes {
            return Err(ProtocolError::InvalidBulkLength);
        }
        total += (data - pos) as u64 + len as u64 + 2;
        if total > l.max_request_bytes {
            return Err(ProtocolError::RequestTooLarge(l.max_request_bytes));
        }
        let end = data + len as usize;
        if buf.len() < end + 2 {
            return Ok(Outcome::Incomplete);
        }
        if &buf[end..end + 2] != b"\r\n" {
            return Err(ProtocolError::MissingCrlf);
        }
        args.push(buf[data..end].to_vec());
        pos = end + 2;
    }
    Ok(Outcome::Framed(pos, RequestKind::Multibulk, args))
}

fn parse(p: &mut RequestParser, buf: &[u8]) -> Outcome {
    match p.parse(buf) {
        Ok(Some(req)) => {
            let args = (0..p.argc()).map(|i| p.arg(buf, i).to_vec()).collect();
            Outcome::Framed(req.len, req.kind, args)
        }
        Ok(None) => Outcome::Incomplete,
        Err(e) => Outcome::Rejected(e),
    }
}

/// Redis's wording, or one of lockgate's own limits.
fn check_wording(e: &ProtocolError) {
    let text = e.to_string();
    assert!(text.starts_with("Protocol error: "), "{text}");
    let redis = [
        "Protocol error: invalid multibulk length",
        "Protocol error: invalid bulk length",
        "Protocol error: too big mbulk count string",
        "Protocol error: too big bulk count string",
        "Protocol error: too big inline request",
        "Protocol error: unbalanced quotes in request",
    ];
    let ok = redis.contains(&text.as_str())
        || text.starts_with("Protocol error: expected '$', got '")
        || text == "Protocol error: expected CRLF"
        || text.starts_with("Protocol error: request larger than limits.max_request_bytes");
    assert!(ok, "unexpected wording: {text}");
}

/// Parses requests off the front of the whole input until it runs out.
fn whole(data: &[u8], l: RequestLimits) -> (Vec<Outcome>, Outcome) {
    let mut p = RequestParser::new(l);
    let mut out = Vec::new();
    let mut at = 0;
    loop {
        let got = parse(&mut p, &data[at..]);
        // Redis stops an inline line at a NUL byte; lockgate keeps it.
        // That difference is documented, so such lines are not compared.
        let inline_nul = data.get(at).is_some_and(|&c| c != b'*')
            && data[at..]
                .iter()
                .take_while(|&&c| c != b'\n')
                .any(|&c| c == 0);
        if !inline_nul {
            let want = match reference(&data[at..], &l) {
                Ok(o) => o,
                Err(e) => Outcome::Rejected(e),
            };
            assert_eq!(got, want, "at offset {at} of {:?}", &data[at..]);
        }
        match got {
            Outcome::Framed(len, ..) => {
                assert!(len > 0 && at + len <= data.len());
                at += len;
                out.push(got);
            }
            Outcome::Rejected(ref e) => {
                check_wording(e);
                return (out, got);
            }
            Outcome::Incomplete => return (out, got),
        }
    }
}

/// The same stream arriving in chunks, parsed only once `needed()` bytes are
/// buffered, as the session does.
fn chunked(data: &[u8], l: RequestLimits, mut seed: u64) -> (Vec<Outcome>, Outcome) {
    let mut p = RequestParser::new(l);
    let mut out = Vec::new();
    let mut buf: Vec<u8> = Vec::new();
    let mut fed = 0;
    while fed < data.len() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let take = 1 + (seed % 17) as usize;
        let next = (fed + take).min(data.len());
        buf.extend_from_slice(&data[fed..next]);
        fed = next;
        loop {
            if buf.len() < p.needed() {
                // Below needed(), parsing would still find nothing.
                let mut probe = RequestParser::new(l);
                assert_eq!(parse(&mut probe, &buf), Outcome::Incomplete);
                break;
            }
            match parse(&mut p, &buf) {
                Outcome::Framed(len, kind, args) => {
                    buf.drain(..len);
                    out.push(Outcome::Framed(len, kind, args));
                }
                Outcome::Incomplete => {
                    assert!(p.needed() > buf.len(), "needed() must grow");
                    break;
                }
                rejected => return (out, rejected),
            }
        }
    }
    (out, Outcome::Incomplete)
}

fuzz_target!(|input: &[u8]| {
    let Some((&selector, data)) = input.split_first() else {
        return;
    };
    let l = limits(selector);
    let whole = whole(data, l);
    let chunked = chunked(data, l, u64::from(selector) | 0x9e37_79b9_0000_0000);
    assert_eq!(whole, chunked, "whole vs chunked");
});
