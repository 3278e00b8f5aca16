//! Helpers shared by the pass-through tests (`passthrough.rs`,
//! `passthrough_payloads.rs`, `pubsub.rs`, `blocking.rs`), on top of the
//! harness's `RawClient`. The including test crate must also declare
//! `mod support;`.

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::ToSocketAddrs;

use crate::support::{frame_len, show, RawClient, WAIT};

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
    let conn = RawClient::connect(addr).await;
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
    let mut c = RawClient::connect(redis_addr).await;
    let mut blocked;
    crate::until!(format!("{n} blocked clients (have {blocked})"), {
        let info = c.call_raw(&["INFO", "clients"]).await;
        let text = String::from_utf8_lossy(&info);
        let have: u64 = text
            .lines()
            .find_map(|l| l.strip_prefix("blocked_clients:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("INFO clients has blocked_clients");
        blocked = have;
        have == n
    });
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
