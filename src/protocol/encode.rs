//! Replies lockgate produces itself. They are rendered when they are written,
//! after every earlier reply, so the connection's protocol (RESP2 or RESP3,
//! settled by `HELLO`) is known by then.

use bytes::{BufMut, Bytes, BytesMut};

/// A reply made by lockgate rather than Redis.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocalReply {
    /// An error line; the text must start with its code (`ERR …`).
    Error(Bytes),
    /// An integer (`:n`).
    Integer(i64),
    /// A status line (`+OK`).
    Status(&'static str),
    /// Null: `$-1` in RESP2, `_` in RESP3.
    Null,
    /// A bulk string.
    Bulk(Bytes),
    /// An array of replies.
    Array(Vec<LocalReply>),
    /// A map: `%n` and its pairs in RESP3, a flat array of the pairs in
    /// RESP2 (as Redis answers `CONFIG GET`, `CLUSTER SHARDS`…).
    Map(Vec<(LocalReply, LocalReply)>),
    /// A complete reply as Redis sent it (from a lock master).
    Raw(Bytes),
}

impl LocalReply {
    /// An `ERR …` error with `message` after the code.
    pub fn err(message: impl std::fmt::Display) -> LocalReply {
        LocalReply::Error(Bytes::from(format!("ERR {message}")))
    }

    /// Appends the wire form to `out` for a connection speaking RESP3 or not.
    /// CR and LF inside an error text are replaced so the line stays one line.
    pub fn encode(&self, resp3: bool, out: &mut BytesMut) {
        match self {
            LocalReply::Error(text) => {
                out.put_u8(b'-');
                out.extend(
                    text.iter()
                        .map(|&c| if c == b'\r' || c == b'\n' { b' ' } else { c }),
                );
                out.put_slice(b"\r\n");
            }
            LocalReply::Integer(n) => {
                out.put_u8(b':');
                if *n < 0 {
                    out.put_u8(b'-');
                }
                decimal(out, n.unsigned_abs());
                out.put_slice(b"\r\n");
            }
            LocalReply::Status(s) => {
                out.put_u8(b'+');
                out.put_slice(s.as_bytes());
                out.put_slice(b"\r\n");
            }
            LocalReply::Null if resp3 => out.put_slice(b"_\r\n"),
            LocalReply::Null => out.put_slice(b"$-1\r\n"),
            LocalReply::Bulk(b) => bulk(out, b),
            LocalReply::Raw(bytes) => out.put_slice(bytes),
            LocalReply::Array(items) => {
                out.put_u8(b'*');
                decimal(out, items.len() as u64);
                out.put_slice(b"\r\n");
                for item in items {
                    item.encode(resp3, out);
                }
            }
            LocalReply::Map(pairs) => {
                match resp3 {
                    true => {
                        out.put_u8(b'%');
                        decimal(out, pairs.len() as u64);
                    }
                    false => {
                        out.put_u8(b'*');
                        decimal(out, 2 * pairs.len() as u64);
                    }
                }
                out.put_slice(b"\r\n");
                for (k, v) in pairs {
                    k.encode(resp3, out);
                    v.encode(resp3, out);
                }
            }
        }
    }

    /// The wire form as a new buffer.
    pub fn to_bytes(&self, resp3: bool) -> Bytes {
        let mut out = BytesMut::new();
        self.encode(resp3, &mut out);
        out.freeze()
    }
}

/// Appends `b` as a RESP bulk string (`$len\r\n…\r\n`): the one writer of
/// bulk headers for everything lockgate encodes.
pub fn bulk(out: &mut BytesMut, b: &[u8]) {
    out.put_u8(b'$');
    decimal(out, b.len() as u64);
    out.put_slice(b"\r\n");
    out.put_slice(b);
    out.put_slice(b"\r\n");
}

/// Appends `n` in decimal without allocating: every header of every
/// command lockgate encodes has one (`to_string` was a malloc and a free
/// per argument of a lock script call).
pub fn decimal(out: &mut BytesMut, n: u64) {
    // Most lengths lockgate writes are below 10: one byte.
    if n < 10 {
        out.put_u8(b'0' + n as u8);
        return;
    }
    let (digits, at) = digits(n);
    out.put_slice(&digits[at..]);
}

/// Appends `n` as a bulk string (`$2\r\n42\r\n`), as `numkeys` of a
/// script call is sent.
pub fn bulk_decimal(out: &mut BytesMut, n: u64) {
    let (digits, at) = digits(n);
    bulk(out, &digits[at..]);
}

/// `n`'s decimal digits in `digits[at..]`.
fn digits(mut n: u64) -> ([u8; 20], usize) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return (digits, at);
        }
    }
}

/// A command as a RESP multibulk, for commands lockgate sends itself.
pub fn command(args: &[&[u8]]) -> Bytes {
    let len: usize = args.iter().map(|a| a.len() + 16).sum();
    let mut out = BytesMut::with_capacity(len + 16);
    out.put_u8(b'*');
    decimal(&mut out, args.len() as u64);
    out.put_slice(b"\r\n");
    for a in args {
        bulk(&mut out, a);
    }
    out.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_forms() {
        assert_eq!(
            &LocalReply::err("x\r\ny").to_bytes(false)[..],
            b"-ERR x  y\r\n"
        );
        assert_eq!(&LocalReply::Null.to_bytes(false)[..], b"$-1\r\n");
        assert_eq!(&LocalReply::Null.to_bytes(true)[..], b"_\r\n");
        assert_eq!(&LocalReply::Integer(-3).to_bytes(true)[..], b":-3\r\n");
        for n in [0, 7, -10, 1234567890, i64::MIN, i64::MAX] {
            assert_eq!(
                LocalReply::Integer(n).to_bytes(false),
                format!(":{n}\r\n").as_bytes()
            );
        }
        let mut out = BytesMut::new();
        bulk_decimal(&mut out, 12);
        assert_eq!(&out[..], b"$2\r\n12\r\n");
        assert_eq!(
            &LocalReply::Bulk(Bytes::from_static(b"ab")).to_bytes(false)[..],
            b"$2\r\nab\r\n"
        );
        let map = LocalReply::Map(vec![(
            LocalReply::Bulk(Bytes::from_static(b"k")),
            LocalReply::Integer(1),
        )]);
        assert_eq!(&map.to_bytes(true)[..], b"%1\r\n$1\r\nk\r\n:1\r\n");
        assert_eq!(&map.to_bytes(false)[..], b"*2\r\n$1\r\nk\r\n:1\r\n");
    }
}
