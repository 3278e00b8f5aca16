//! Helpers shared by the pass-through tests (`passthrough.rs`,
//! `passthrough_payloads.rs`, `pubsub.rs`, `blocking.rs`). The including
//! test crate must also declare `mod support;`.
//!
//! [`Conn`] reads whole RESP2/RESP3 frames as raw bytes, nil replies
//! (`$-1`, `*-1`) included: the harness's `RawClient` decodes with
//! `redis_protocol`'s RESP3 decoder, which rejects RESP2 nils ("Expected
//! complete frame"), and these tests need nils everywhere.

#![allow(dead_code)]

use std::time::Duration;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, ToSocketAddrs};
use tokio::time::Instant;

use crate::support::WAIT;

pub use crate::support::frame_len;

/// Splits a byte stream of complete frames into its frames.
pub fn split_frames(mut stream: &[u8]) -> Vec<&[u8]> {
    let mut frames = Vec::new();
    while !stream.is_empty() {
        let len = frame_len(stream).expect("stream ends with an incomplete frame");
        frames.push(&stream[..len]);
        stream = &stream[len..];
    }
    frames
}

/// Shows a byte string readably in assertion messages.
pub fn show(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A raw client socket that reads whole frames, nils included.
pub struct Conn {
    /// The socket.
    pub stream: TcpStream,
    buf: BytesMut,
}

impl Conn {
    /// Connects to `addr` (within [`WAIT`]).
    pub async fn connect(addr: impl ToSocketAddrs) -> Conn {
        let stream = tokio::time::timeout(WAIT, TcpStream::connect(addr))
            .await
            .expect("connect in time")
            .expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        Conn {
            stream,
            buf: BytesMut::new(),
        }
    }

    /// Writes raw bytes.
    pub async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.expect("write");
    }

    /// One whole frame, or `None` on timeout or EOF.
    pub async fn try_frame(&mut self, wait: Duration) -> Option<Vec<u8>> {
        let deadline = Instant::now() + wait;
        loop {
            if let Some(len) = frame_len(&self.buf) {
                return Some(self.buf.split_to(len).to_vec());
            }
            let read = tokio::time::timeout_at(deadline, self.stream.read_buf(&mut self.buf)).await;
            match read {
                Ok(Ok(0)) | Err(_) => return None,
                Ok(Ok(_)) => {}
                Ok(Err(e)) => panic!("read: {e}"),
            }
        }
    }

    /// One whole frame (within [`WAIT`]).
    pub async fn frame(&mut self) -> Vec<u8> {
        match self.try_frame(WAIT).await {
            Some(f) => f,
            None => panic!(
                "no whole reply within {WAIT:?}; buffered: {:?}",
                show(&self.buf[..self.buf.len().min(200)])
            ),
        }
    }

    /// `n` whole frames, concatenated as they came.
    pub async fn frames(&mut self, n: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for _ in 0..n {
            out.extend_from_slice(&self.frame().await);
        }
        out
    }

    /// Sends a command given as strings, reads its reply.
    pub async fn call(&mut self, args: &[&str]) -> Vec<u8> {
        self.send(&crate::support::cmd(args)).await;
        self.frame().await
    }

    /// Sends a command given as byte strings, reads its reply.
    pub async fn call_bin(&mut self, args: &[&[u8]]) -> Vec<u8> {
        self.send(&crate::support::encode(args)).await;
        self.frame().await
    }

    /// Reads exactly `n` raw bytes of the stream.
    pub async fn read_exact(&mut self, n: usize) -> Vec<u8> {
        while self.buf.len() < n {
            let read = tokio::time::timeout(WAIT, self.stream.read_buf(&mut self.buf))
                .await
                .expect("bytes in time")
                .expect("read");
            assert!(read > 0, "EOF after {} of {n} bytes", self.buf.len());
        }
        self.buf.split_to(n).to_vec()
    }

    /// Reads the stream until EOF (within [`WAIT`]); returns what came.
    pub async fn read_to_eof(&mut self) -> Vec<u8> {
        let deadline = Instant::now() + WAIT;
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
}

/// Sends `request` on a new connection to `addr`, in one write or in pieces
/// of the given sizes, while reading concurrently; returns the first
/// `replies` frames as one byte stream. Panics if bytes beyond them were
/// already received, so end the pipeline with a marker command to make
/// "no extra replies" part of what is compared.
pub async fn pipeline(
    addr: impl ToSocketAddrs,
    request: Vec<u8>,
    pieces: Option<Vec<usize>>,
    replies: usize,
) -> Vec<u8> {
    let conn = Conn::connect(addr).await;
    let (mut rd, mut wr) = conn.stream.into_split();
    let writer = tokio::spawn(async move {
        match pieces {
            None => wr.write_all(&request).await.expect("write pipeline"),
            Some(sizes) => {
                let mut rest = &request[..];
                for size in sizes.into_iter().cycle() {
                    if rest.is_empty() {
                        break;
                    }
                    let n = size.clamp(1, rest.len());
                    wr.write_all(&rest[..n]).await.expect("write piece");
                    rest = &rest[n..];
                }
            }
        }
        wr
    });
    let mut buf = BytesMut::with_capacity(1 << 16);
    let mut out = Vec::new();
    let mut got = 0;
    while got < replies {
        while got < replies {
            let Some(len) = frame_len(&buf) else { break };
            out.extend_from_slice(&buf.split_to(len));
            got += 1;
        }
        if got == replies {
            break;
        }
        buf.reserve(1 << 16);
        let read = tokio::time::timeout(WAIT, rd.read_buf(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("stalled after {got} of {replies} replies"))
            .expect("read");
        assert!(read > 0, "EOF after {got} of {replies} replies");
    }
    assert!(
        buf.is_empty(),
        "bytes after the last expected reply: {:?}",
        show(&buf[..buf.len().min(200)])
    );
    let _wr = tokio::time::timeout(WAIT, writer)
        .await
        .expect("writer done in time")
        .expect("writer task");
    out
}

/// Waits (bounded by [`WAIT`]) until Redis at `redis_addr` reports exactly
/// `n` blocked clients in `INFO clients`.
pub async fn wait_blocked_clients(redis_addr: &str, n: u64) {
    let mut c = Conn::connect(redis_addr).await;
    let deadline = Instant::now() + WAIT;
    loop {
        let info = c.call(&["INFO", "clients"]).await;
        let text = String::from_utf8_lossy(&info);
        let blocked: u64 = text
            .lines()
            .find_map(|l| l.strip_prefix("blocked_clients:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("INFO clients has blocked_clients");
        if blocked == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {n} blocked clients (have {blocked})"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A deterministic xorshift64* generator, so two runs of a workload send the
/// same bytes.
pub struct Rng(u64);

impl Rng {
    /// A generator from a non-zero seed.
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    /// The next 64 pseudo-random bits.
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// Fills `out` with pseudo-random bytes.
    pub fn fill(&mut self, out: &mut [u8]) {
        for chunk in out.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// FNV-1a 64 over a byte stream fed in any pieces.
pub struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    /// Adds bytes.
    pub fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }

    /// The hash so far.
    pub fn finish(&self) -> u64 {
        self.0
    }
}
