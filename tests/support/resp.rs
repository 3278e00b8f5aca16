//! RESP on the wire: the one raw test client, command encoding and the
//! one frame scanner every test reads replies with.

use std::time::Duration;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::WAIT;

/// The one raw test client: writes raw bytes and reads whole RESP2/RESP3
/// frames (RESP2 nils `$-1`/`*-1` included) as raw bytes, framed by
/// [`frame_len`]. Every wait is bounded by [`WAIT`] or the caller's limit.
pub struct RawClient {
    /// The socket.
    pub stream: TcpStream,
    buf: BytesMut,
}

/// Encodes a command as a RESP multibulk.
pub fn encode(args: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// Encodes a command given as strings.
pub fn cmd(args: &[&str]) -> Vec<u8> {
    let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
    encode(&args)
}

/// Shows a byte string readably in assertion messages.
pub fn show(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

impl RawClient {
    /// Connects to `addr` (within [`WAIT`]).
    pub async fn connect(addr: impl tokio::net::ToSocketAddrs) -> RawClient {
        let stream = tokio::time::timeout(WAIT, TcpStream::connect(addr))
            .await
            .expect("connect in time")
            .expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        RawClient {
            stream,
            buf: BytesMut::new(),
        }
    }

    /// Writes raw bytes.
    pub async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.expect("write");
    }

    /// Reads one whole frame and returns its raw bytes (within [`WAIT`]).
    pub async fn read_raw(&mut self) -> Vec<u8> {
        match self.try_read_raw(WAIT).await {
            Some(frame) => frame,
            None => panic!(
                "no whole reply within {WAIT:?} (or EOF); buffered: {:?}",
                show(&self.buf[..self.buf.len().min(200)])
            ),
        }
    }

    /// Reads one whole frame, or `None` on timeout or EOF. Panics on a read
    /// error, so a reset is never taken for "no reply".
    pub async fn try_read_raw(&mut self, wait: Duration) -> Option<Vec<u8>> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if let Some(len) = frame_len(&self.buf) {
                return Some(self.buf.split_to(len).to_vec());
            }
            self.buf.reserve(16 * 1024);
            let read = tokio::time::timeout_at(deadline, self.stream.read_buf(&mut self.buf)).await;
            match read {
                Ok(Ok(0)) | Err(_) => return None,
                Ok(Ok(_)) => {}
                Ok(Err(e)) => panic!("read: {e}"),
            }
        }
    }

    /// Reads `n` whole frames (each within [`WAIT`]), concatenated as they
    /// came.
    pub async fn read_raw_frames(&mut self, n: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for _ in 0..n {
            out.extend_from_slice(&self.read_raw().await);
        }
        out
    }

    /// Reads one whole frame as text (`\r\n` kept); panics unless it is
    /// UTF-8.
    pub async fn read_s(&mut self) -> String {
        let raw = self.read_raw().await;
        String::from_utf8(raw)
            .unwrap_or_else(|e| panic!("not a UTF-8 reply: {:?}", show(e.as_bytes())))
    }

    /// Sends a command given as strings and reads its raw reply.
    pub async fn call_raw(&mut self, args: &[&str]) -> Vec<u8> {
        self.send(&cmd(args)).await;
        self.read_raw().await
    }

    /// Sends a command given as byte strings and reads its raw reply.
    pub async fn call_bin(&mut self, args: &[&[u8]]) -> Vec<u8> {
        self.send(&encode(args)).await;
        self.read_raw().await
    }

    /// Sends a command and reads its reply as text, or `None` when the
    /// connection failed (write or read error, EOF) or no whole reply
    /// came within `wait`: for clients that ride out a fault and
    /// reconnect.
    pub async fn try_call_s(&mut self, args: &[&str], wait: Duration) -> Option<String> {
        self.stream.write_all(&cmd(args)).await.ok()?;
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if let Some(len) = frame_len(&self.buf) {
                let frame = self.buf.split_to(len).to_vec();
                return Some(String::from_utf8_lossy(&frame).into_owned());
            }
            self.buf.reserve(16 * 1024);
            let read = tokio::time::timeout_at(deadline, self.stream.read_buf(&mut self.buf));
            match read.await {
                Ok(Ok(n)) if n > 0 => {}
                _ => return None,
            }
        }
    }

    /// Sends a command and reads its reply as text (see [`Self::read_s`]).
    pub async fn call_s(&mut self, args: &[&str]) -> String {
        self.send(&cmd(args)).await;
        self.read_s().await
    }

    /// Reads exactly `n` bytes of raw stream (for byte-for-byte comparisons).
    pub async fn read_exact_bytes(&mut self, n: usize) -> Vec<u8> {
        while self.buf.len() < n {
            let read = tokio::time::timeout(WAIT, self.stream.read_buf(&mut self.buf))
                .await
                .expect("bytes in time")
                .expect("read");
            assert!(read > 0, "EOF after {} of {n} bytes", self.buf.len());
        }
        self.buf.split_to(n).to_vec()
    }

    /// Feeds the next `n` raw bytes of the stream to `sink` as they arrive,
    /// without holding them all (for replies of hundreds of MB).
    pub async fn stream_bytes(&mut self, mut n: u64, mut sink: impl FnMut(&[u8])) {
        loop {
            let take = n.min(self.buf.len() as u64) as usize;
            sink(&self.buf[..take]);
            self.buf.advance(take);
            n -= take as u64;
            if n == 0 {
                return;
            }
            self.buf.reserve(1 << 20);
            let read = tokio::time::timeout(WAIT, self.stream.read_buf(&mut self.buf))
                .await
                .expect("bytes in time")
                .expect("read");
            assert!(read > 0, "EOF with {n} bytes still to come");
        }
    }

    /// Bytes already read but not yet returned.
    pub fn buffered(&self) -> &[u8] {
        &self.buf
    }

    /// Reads the stream until the server closes it (EOF, or a reset after
    /// the last bytes) within [`WAIT`]; returns everything not yet returned.
    pub async fn read_to_eof(&mut self) -> Vec<u8> {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            match tokio::time::timeout_at(deadline, self.stream.read_buf(&mut self.buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return self.buf.split().to_vec(),
                Ok(Ok(_)) => {}
                Err(_) => panic!(
                    "connection not closed within {WAIT:?}; got {:?}",
                    show(&self.buf)
                ),
            }
        }
    }

    /// Reads whole frames (as text) until the server closes the connection
    /// (EOF, or a reset after the last bytes); panics if it stays open and
    /// silent for [`WAIT`] or leaves a partial frame.
    pub async fn frames_to_close(&mut self) -> Vec<String> {
        let mut frames = Vec::new();
        let mut deadline = tokio::time::Instant::now() + WAIT;
        loop {
            if let Some(len) = frame_len(&self.buf) {
                frames.push(show(&self.buf.split_to(len)));
                deadline = tokio::time::Instant::now() + WAIT;
                continue;
            }
            match tokio::time::timeout_at(deadline, self.stream.read_buf(&mut self.buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break,
                Ok(Ok(_)) => {}
                Err(_) => panic!(
                    "connection neither closed nor sent anything for {WAIT:?}; frames so far: {frames:?}"
                ),
            }
        }
        assert!(
            self.buf.is_empty(),
            "partial frame before the close: {:?} (frames: {frames:?})",
            show(&self.buf)
        );
        frames
    }

    /// Waits until the server closes the connection (true) or `wait` passes.
    pub async fn closed_within(&mut self, wait: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            match tokio::time::timeout_at(deadline, self.stream.read_buf(&mut self.buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => continue,
                Err(_) => return false,
            }
        }
    }
}

/// Length of the complete RESP frame at the front of `buf`, or `None` while it
/// is incomplete. Panics on bytes that are not RESP, so a corrupted stream
/// fails the test where it happens.
pub fn frame_len(buf: &[u8]) -> Option<usize> {
    // Iterative, with a count of element slots still to fill, so a reply
    // nested thousands deep (a Lua script's) needs no stack.
    let (mut pos, mut left) = (0usize, 1u64);
    while left > 0 {
        let type_byte = *buf.get(pos)?;
        let rest = buf.get(pos + 1..)?;
        let line_len = rest.windows(2).position(|w| w == b"\r\n")?;
        let line = &rest[..line_len];
        let next = pos + 1 + line_len + 2;
        let number = || -> i64 {
            std::str::from_utf8(line)
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| panic!("bad RESP length {:?}", String::from_utf8_lossy(line)))
        };
        match type_byte {
            b'+' | b'-' | b':' | b'_' | b',' | b'#' | b'(' => {
                pos = next;
                left -= 1;
            }
            b'$' | b'!' | b'=' => {
                let n = number();
                pos = next;
                if n >= 0 {
                    let end = next + n as usize + 2;
                    if buf.len() < end {
                        return None;
                    }
                    assert_eq!(
                        &buf[end - 2..end],
                        b"\r\n",
                        "bulk payload not followed by CRLF"
                    );
                    pos = end;
                }
                left -= 1;
            }
            b'*' | b'~' | b'>' | b'%' | b'|' => {
                let n = number();
                pos = next;
                let count = if matches!(type_byte, b'%' | b'|') {
                    2 * n.max(0) as u64
                } else {
                    n.max(0) as u64
                };
                if type_byte == b'|' {
                    // An attribute is followed by the element it annotates,
                    // whose slot stays open.
                    left += count;
                } else {
                    left = left + count - 1;
                }
            }
            other => panic!(
                "not RESP: type byte {:?} in {:?}",
                char::from(other),
                String::from_utf8_lossy(&buf[pos..buf.len().min(pos + 64)])
            ),
        }
    }
    Some(pos)
}

/// The raw reply as text (`\r\n` kept).
pub fn text(raw: &[u8]) -> String {
    String::from_utf8_lossy(raw).into_owned()
}

/// Sends a command and reads its reply as text (`\r\n` kept).
pub async fn call(c: &mut RawClient, args: &[&str]) -> String {
    text(&c.call_raw(args).await)
}

/// `args` on the Redis at `addr`, over a fresh connection; the reply as
/// text.
pub async fn direct(addr: &str, args: &[&str]) -> String {
    let mut c = RawClient::connect(addr).await;
    call(&mut c, args).await
}

/// A RESP2 reply, decoded: the tests' one reply decoder (frames are found
/// by [`frame_len`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Resp {
    /// `+…`
    Status(String),
    /// `-…`
    Error(String),
    /// `:…`
    Int(i64),
    /// `$…` (nil as `None`).
    Bulk(Option<Vec<u8>>),
    /// `*…` (nil as `None`).
    Array(Option<Vec<Resp>>),
}

impl std::fmt::Display for Resp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Resp::Status(s) => write!(f, "+{s}"),
            Resp::Error(e) => write!(f, "-{e}"),
            Resp::Int(i) => write!(f, ":{i}"),
            Resp::Bulk(None) | Resp::Array(None) => write!(f, "nil"),
            Resp::Bulk(Some(b)) => write!(f, "{:?}", show(b)),
            Resp::Array(Some(items)) => {
                let items: Vec<String> = items.iter().map(|r| r.to_string()).collect();
                write!(f, "[{}]", items.join(", "))
            }
        }
    }
}

impl Resp {
    /// Decodes one whole frame; trailing bytes fail the test.
    pub fn parse(raw: &[u8]) -> Resp {
        let mut pos = 0;
        let r = Resp::decode(raw, &mut pos);
        assert_eq!(pos, raw.len(), "trailing bytes after {:?}", show(raw));
        r
    }

    /// Decodes the frame at `pos` of `buf` (a whole frame), moving `pos`
    /// past it. RESP2, and RESP3's push frames and sets (as arrays) and
    /// maps (as RESP2 gives them: an array of field/value pairs).
    pub fn decode(buf: &[u8], pos: &mut usize) -> Resp {
        let end = *pos
            + buf[*pos..]
                .windows(2)
                .position(|w| w == b"\r\n")
                .unwrap_or_else(|| panic!("no CRLF in {:?}", show(buf)));
        let line = show(&buf[*pos + 1..end]);
        let kind = buf[*pos];
        *pos = end + 2;
        let n = || line.parse::<i64>().expect("RESP length");
        match kind {
            b'+' => Resp::Status(line),
            b'-' => Resp::Error(line),
            b':' => Resp::Int(n()),
            b'$' if n() < 0 => Resp::Bulk(None),
            // RESP3's null reads as RESP2's nil.
            b'_' => Resp::Bulk(None),
            b'$' => {
                let data = buf[*pos..*pos + n() as usize].to_vec();
                *pos += n() as usize + 2;
                Resp::Bulk(Some(data))
            }
            b'*' if n() < 0 => Resp::Array(None),
            // RESP3's push frames and sets read as arrays.
            b'*' | b'>' | b'~' => {
                Resp::Array(Some((0..n()).map(|_| Resp::decode(buf, pos)).collect()))
            }
            b'%' => Resp::Array(Some((0..2 * n()).map(|_| Resp::decode(buf, pos)).collect())),
            other => panic!(
                "unexpected RESP type {:?} in {:?}",
                char::from(other),
                show(buf)
            ),
        }
    }

    /// The elements of an array, none for a nil array (panics otherwise).
    pub fn items(&self) -> &[Resp] {
        match self {
            Resp::Array(Some(v)) => v,
            Resp::Array(None) => &[],
            other => panic!("expected an array, got {other:?}"),
        }
    }

    /// The text of a bulk or status reply (panics otherwise).
    pub fn text(&self) -> &str {
        match self {
            Resp::Status(s) => s,
            Resp::Bulk(Some(b)) => std::str::from_utf8(b).expect("a UTF-8 bulk string"),
            other => panic!("expected a bulk string, got {other:?}"),
        }
    }

    /// The value of field `name` of a record (field/value pairs, or a
    /// RESP3 map); panics when it has none.
    pub fn field(&self, name: &str) -> &Resp {
        let items = self.items();
        assert!(items.len() % 2 == 0, "not field/value pairs: {self}");
        items
            .chunks(2)
            .find(|p| p[0].text() == name)
            .map(|p| &p[1])
            .unwrap_or_else(|| panic!("no field {name} in {self}"))
    }

    /// The field names of a record, in order.
    pub fn fields(&self) -> Vec<&str> {
        self.items().chunks(2).map(|p| p[0].text()).collect()
    }

    /// The value of an integer reply (panics otherwise).
    pub fn int(&self) -> i64 {
        match self {
            Resp::Int(n) => *n,
            other => panic!("expected an integer, got {other:?}"),
        }
    }
}
