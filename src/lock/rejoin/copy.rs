//! One copy of fence counters from a source master to a returning one:
//! `SCAN` the source's counters page by page, `MGET` them, and raise each
//! on the target with [`RAISE`], over connections that must not change
//! meanwhile (a reconnection may be another run of the master).

use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;

use super::RejoinError;
use crate::lock::node::Node;
use crate::lock::quorum::integer;
use crate::protocol::encode;

/// Keys a `SCAN` page asks for at once (`COUNT`): bounds each call's work
/// on a master and the memory of a copy (one page per source at a time).
pub const SCAN_COUNT: usize = 500;
/// The counters' key pattern.
const COUNTER_PATTERN: &[u8] = b"lockgate:fence:{*}";

/// Raises counters on the returning master, never lowers one. KEYS: the
/// counters; ARGV: their values on a source, in the same order. A key that
/// is not a number there is left alone. Reply: how many were raised.
pub const RAISE: &str = r#"
local n = 0
for i = 1, #KEYS do
  local v = tonumber(ARGV[i])
  local cur = redis.pcall('GET', KEYS[i])
  if v and type(cur) ~= 'table' then
    local c = tonumber(cur or '0')
    if c and c < v then
      redis.call('SET', KEYS[i], ARGV[i])
      n = n + 1
    end
  end
end
return n
"#;

/// A master's connection as of the start of a copy.
#[derive(Clone, Copy)]
pub(super) struct Endpoint<'a> {
    /// The master.
    pub(super) node: &'a Node,
    /// Its connection number then.
    pub(super) connects: u64,
}

impl Endpoint<'_> {
    /// Still the same connection: every reply so far came over it.
    pub(super) fn same(&self) -> Result<(), RejoinError> {
        match self.node.state.connects.load(Ordering::Relaxed) == self.connects {
            true => Ok(()),
            false => Err(RejoinError::Reconnected(self.node.addr().to_string())),
        }
    }

    async fn call(&self, command: Bytes, timeout: Duration) -> Result<Bytes, RejoinError> {
        let reply = self.node.call(command, timeout).await?;
        self.same()?;
        if reply.first() == Some(&b'-') {
            let text = String::from_utf8_lossy(&reply).trim_end().to_string();
            return Err(RejoinError::Reply(self.node.addr().to_string(), text));
        }
        Ok(reply)
    }
}

/// SCANs `src`'s counters page by page and raises each on `dst`.
pub(super) async fn copy_from(
    src: Endpoint<'_>,
    dst: Endpoint<'_>,
    timeout: Duration,
) -> Result<u64, RejoinError> {
    let count = SCAN_COUNT.to_string();
    let bad = |node: &Node, what: &str| RejoinError::Reply(node.addr().to_string(), what.into());
    let mut cursor = Bytes::from_static(b"0");
    let mut copied = 0u64;
    loop {
        let scan = encode::command(&[
            b"SCAN",
            &cursor,
            b"MATCH",
            COUNTER_PATTERN,
            b"COUNT",
            count.as_bytes(),
        ]);
        let reply = src.call(scan, timeout).await?;
        let (next, keys) =
            parse_scan(&reply).ok_or_else(|| bad(src.node, "a malformed SCAN reply"))?;
        if !keys.is_empty() {
            let mut mget: Vec<&[u8]> = vec![b"MGET"];
            mget.extend(keys.iter().map(|k| k.as_ref()));
            let reply = src.call(encode::command(&mget), timeout).await?;
            let values = parse_bulks(&reply)
                .filter(|v| v.len() == keys.len())
                .ok_or_else(|| bad(src.node, "a malformed MGET reply"))?;
            let pairs: Vec<(&Bytes, Bytes)> = keys
                .iter()
                .zip(values)
                .filter_map(|(k, v)| v.map(|v| (k, v)))
                .collect();
            if !pairs.is_empty() {
                let n = pairs.len().to_string();
                let mut eval: Vec<&[u8]> = vec![b"EVAL", RAISE.as_bytes(), n.as_bytes()];
                eval.extend(pairs.iter().map(|(k, _)| k.as_ref()));
                eval.extend(pairs.iter().map(|(_, v)| v.as_ref()));
                let raised = dst.call(encode::command(&eval), timeout).await?;
                copied += integer(&raised)
                    .and_then(|n| u64::try_from(n).ok())
                    .ok_or_else(|| bad(dst.node, "a malformed RAISE reply"))?;
            }
        }
        if next.as_ref() == b"0" {
            return Ok(copied);
        }
        cursor = next;
    }
}

/// `*2 $cursor *n $key…` → (cursor, keys).
fn parse_scan(reply: &[u8]) -> Option<(Bytes, Vec<Bytes>)> {
    let mut p = Parser { buf: reply, pos: 0 };
    if p.header(b'*')? != 2 {
        return None;
    }
    let cursor = p.bulk()??;
    let n = p.header(b'*')?;
    let keys = (0..n).map(|_| p.bulk()?).collect::<Option<Vec<_>>>()?;
    Some((cursor, keys))
}

/// `*n ($v | $-1)…` → the values (`None`: nil).
fn parse_bulks(reply: &[u8]) -> Option<Vec<Option<Bytes>>> {
    let mut p = Parser { buf: reply, pos: 0 };
    let n = p.header(b'*')?;
    (0..n).map(|_| p.bulk()).collect()
}

/// Reads RESP2 headers and bulk strings off a whole reply.
struct Parser<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl Parser<'_> {
    /// The length after `kind` up to CRLF (`-1` as a nil bulk: `None` from
    /// [`Parser::bulk`]).
    fn line(&mut self, kind: u8) -> Option<i64> {
        let rest = self.buf.get(self.pos..)?;
        let (&first, rest) = rest.split_first()?;
        if first != kind {
            return None;
        }
        let end = rest.windows(2).position(|w| w == b"\r\n")?;
        let n = crate::protocol::request::parse_int(&rest[..end])?;
        self.pos += 1 + end + 2;
        Some(n)
    }

    fn header(&mut self, kind: u8) -> Option<usize> {
        usize::try_from(self.line(kind)?).ok()
    }

    /// `Some(None)` for a nil bulk.
    fn bulk(&mut self) -> Option<Option<Bytes>> {
        let n = self.line(b'$')?;
        let Ok(len) = usize::try_from(n) else {
            return Some(None);
        };
        let body = self.buf.get(self.pos..self.pos + len)?;
        if self.buf.get(self.pos + len..self.pos + len + 2)? != b"\r\n" {
            return None;
        }
        self.pos += len + 2;
        Some(Some(Bytes::copy_from_slice(body)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scan_replies_parse() {
        let r = b"*2\r\n$2\r\n17\r\n*2\r\n$4\r\na\r\nb\r\n$0\r\n\r\n";
        let (cursor, keys) = parse_scan(r).expect("parses");
        assert_eq!(cursor.as_ref(), b"17");
        assert_eq!(keys, vec![Bytes::from_static(b"a\r\nb"), Bytes::new()]);
        assert_eq!(
            parse_scan(b"*2\r\n$1\r\n0\r\n*0\r\n").map(|s| s.1.len()),
            Some(0)
        );
        assert!(parse_scan(b"*2\r\n$1\r\n0\r\n").is_none());
        assert!(parse_scan(b"-ERR no\r\n").is_none());
    }

    #[test]
    fn mget_replies_parse() {
        let r = b"*3\r\n$1\r\n5\r\n$-1\r\n$2\r\n12\r\n";
        let v = parse_bulks(r).expect("parses");
        assert_eq!(
            v,
            vec![
                Some(Bytes::from_static(b"5")),
                None,
                Some(Bytes::from_static(b"12"))
            ]
        );
        assert!(parse_bulks(b"*2\r\n$1\r\n5\r\n").is_none());
    }
}
