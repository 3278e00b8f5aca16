//! The few RESP2 shapes a lock transaction reads and writes: lockgate's
//! own connections speak RESP2, and a transaction answers exactly as the
//! script it stands for would have (arrays of integers, a bulk, a nil).

use bytes::{BufMut, Bytes, BytesMut};

use crate::protocol::encode;
use crate::protocol::reply::ReplyScanner;

/// The nil bulk string a script's `false` becomes.
pub const NIL: &[u8] = b"$-1\r\n";

/// `+OK`.
pub const OK: &[u8] = b"+OK\r\n";

/// A command as RESP.
pub fn cmd(args: &[&[u8]]) -> Bytes {
    encode::command(args)
}

/// `:n`.
pub fn int(n: i64) -> Bytes {
    Bytes::from(format!(":{n}\r\n"))
}

/// An error reply `-text`.
pub fn err(text: &str) -> Bytes {
    Bytes::from(format!("-{text}\r\n"))
}

/// An array of whole frames.
pub fn array(items: &[Bytes]) -> Bytes {
    let mut out = BytesMut::with_capacity(16 + items.iter().map(|i| i.len()).sum::<usize>());
    out.put_u8(b'*');
    encode::decimal(&mut out, items.len() as u64);
    out.put_slice(b"\r\n");
    for i in items {
        out.put_slice(i);
    }
    out.freeze()
}

/// `*n` then `first` and the integers `rest`: a script's `{reply, facts…}`.
pub fn facts(first: Bytes, rest: &[i64]) -> Bytes {
    let mut items = vec![first];
    items.extend(rest.iter().map(|&n| int(n)));
    array(&items)
}

/// The integer of `:n`.
pub fn as_int(frame: &[u8]) -> Option<i64> {
    let digits = frame.strip_prefix(b":")?.strip_suffix(b"\r\n")?;
    crate::protocol::request::parse_int(digits)
}

/// A bulk string's bytes (`Some(None)`: nil); `None` for another shape.
pub fn as_bulk(frame: &[u8]) -> Option<Option<&[u8]>> {
    if frame == NIL {
        return Some(None);
    }
    let rest = frame.strip_prefix(b"$")?;
    let nl = memchr::memchr(b'\n', rest)?;
    Some(Some(rest.get(nl + 1..rest.len().checked_sub(2)?)?))
}

/// A simple string's text (`+string` → `string`).
pub fn as_simple(frame: &[u8]) -> Option<&[u8]> {
    frame.strip_prefix(b"+")?.strip_suffix(b"\r\n")
}

/// True for an error reply.
pub fn is_err(frame: &[u8]) -> bool {
    frame.first() == Some(&b'-')
}

/// True for the nil array `EXEC` answers when a watched key changed.
pub fn is_nil_array(frame: &[u8]) -> bool {
    frame == b"*-1\r\n"
}

/// The count of a `kind` header (`*n\r\n`, `$n\r\n`) at the start of
/// `frame`, and the header's length.
fn header(frame: &[u8], kind: u8) -> Option<(usize, usize)> {
    let rest = frame.strip_prefix(&[kind])?;
    let nl = memchr::memchr(b'\n', rest)?;
    let n = std::str::from_utf8(rest.get(..nl.checked_sub(1)?)?)
        .ok()?
        .parse()
        .ok()?;
    Some((n, 1 + nl + 1))
}

/// The elements of an array reply, each a whole frame; `None` for
/// another shape.
pub fn elements(frame: &Bytes) -> Option<Vec<Bytes>> {
    let (n, mut pos) = header(frame, b'*')?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let mut scanner = ReplyScanner::new();
        let (used, end) = scanner.advance(frame.get(pos..)?).ok()?;
        end?;
        out.push(frame.slice(pos..pos + used));
        pos += used;
    }
    Some(out)
}

/// The arguments of a command lockgate wrote (a RESP array of bulks).
pub fn args(command: &[u8]) -> Option<Vec<&[u8]>> {
    let (n, mut pos) = header(command, b'*')?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let (len, used) = header(command.get(pos..)?, b'$')?;
        let start = pos + used;
        out.push(command.get(start..start + len)?);
        pos = start + len + 2;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_read_and_written() {
        assert_eq!(as_int(b":-12\r\n"), Some(-12));
        assert_eq!(as_int(b"$1\r\n1\r\n"), None);
        assert_eq!(as_bulk(b"$3\r\nabc\r\n"), Some(Some(&b"abc"[..])));
        assert_eq!(as_bulk(b"$0\r\n\r\n"), Some(Some(&b""[..])));
        assert_eq!(as_bulk(NIL), Some(None));
        assert_eq!(as_bulk(b":1\r\n"), None);
        assert_eq!(as_simple(b"+none\r\n"), Some(&b"none"[..]));
        let exec = Bytes::from_static(b"*3\r\n+OK\r\n$-1\r\n*2\r\n:1\r\n$1\r\nx\r\n");
        let items = elements(&exec).unwrap();
        assert_eq!(items.len(), 3);
        assert_eq!(&items[2][..], b"*2\r\n:1\r\n$1\r\nx\r\n");
        assert_eq!(elements(&Bytes::from_static(b"*0\r\n")).unwrap().len(), 0);
        assert_eq!(&facts(int(1), &[0, -2])[..], b"*3\r\n:1\r\n:0\r\n:-2\r\n");
        let c = cmd(&[b"SET", b"k", b"v\r\n"]);
        assert_eq!(args(&c).unwrap(), vec![&b"SET"[..], b"k", b"v\r\n"]);
    }
}
