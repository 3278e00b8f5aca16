//! Release announcements between lockgate instances: a release made
//! through lockgate of a key some instance waits for (the key has waiting
//! marks: that instance's attempts failed lately) is PUBLISHed on
//! `lockgate:released` (by the release scripts themselves, on the store
//! that holds the lock), and every instance subscribes there, so a waiter
//! parked on one instance is woken by a release through another. A lost
//! (or unsent) announcement only delays a handoff until the next probe.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

use super::node::{handshake, FrameReader, NodeConfig};
use super::storm::{Storm, RELEASED_CHANNEL};
use crate::protocol::encode;
use crate::tls::Stream;

/// Longest pause between two subscription attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Subscribes to `lockgate:released` on `node` until `stop`.
pub fn spawn(node: NodeConfig, storm: Arc<Storm>, stop: CancellationToken) {
    tokio::spawn(async move {
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = listen(node, storm) => {}
        }
    });
}

async fn listen(node: NodeConfig, storm: Arc<Storm>) {
    let mut backoff = Duration::from_millis(10);
    loop {
        let (now, generation) = node.resolve().await;
        tokio::select! {
            end = subscribed(&now, &storm, &mut backoff) => if let Err(e) = end {
                tracing::debug!(node = %now.addr, error = %e, "release announcements interrupted");
            },
            // The primary changed: subscribe on the new one.
            _ = node.replaced(generation) => backoff = Duration::ZERO,
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).clamp(Duration::from_millis(10), MAX_BACKOFF);
    }
}

async fn subscribed(
    node: &NodeConfig,
    storm: &Storm,
    backoff: &mut Duration,
) -> Result<(), String> {
    let stream = handshake(node).await?;
    messages(stream, RELEASED_CHANNEL.as_bytes(), backoff, |key| {
        storm.announced(key)
    })
    .await
}

/// Subscribes `stream` to `channel` and hands each message's payload to
/// `on` until the connection fails (the error says why). Once subscribed,
/// `backoff` goes back to its shortest, so the caller's next reconnection
/// after a long-lived subscription is prompt.
pub(crate) async fn messages(
    mut stream: Stream,
    channel: &[u8],
    backoff: &mut Duration,
    mut on: impl FnMut(&[u8]),
) -> Result<(), String> {
    stream
        .write_all(&encode::command(&[b"SUBSCRIBE", channel]))
        .await
        .map_err(|e| e.to_string())?;
    stream.flush().await.map_err(|e| e.to_string())?;
    *backoff = Duration::from_millis(10);
    let mut frames = FrameReader::new();
    loop {
        let frame = frames.next(&mut stream).await?;
        if let Some(payload) = message_payload(&frame) {
            on(payload);
        }
    }
}

/// The payload of a `message` push (`*3 message channel payload`).
pub(crate) fn message_payload(frame: &[u8]) -> Option<&[u8]> {
    let mut rest = frame
        .strip_prefix(b"*3\r\n")
        .or_else(|| frame.strip_prefix(b">3\r\n"))?;
    let mut parts = Vec::with_capacity(3);
    for _ in 0..3 {
        let body = rest.strip_prefix(b"$")?;
        let nl = memchr::memchr(b'\r', body)?;
        let len: usize = std::str::from_utf8(&body[..nl]).ok()?.parse().ok()?;
        let data = body.get(nl + 2..nl + 2 + len)?;
        parts.push(data);
        rest = body.get(nl + 2 + len + 2..)?;
    }
    (parts[0] == b"message").then_some(parts[2])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_of_a_message() {
        let m = b"*3\r\n$7\r\nmessage\r\n$17\r\nlockgate:released\r\n$6\r\nlock:a\r\n";
        assert_eq!(message_payload(m), Some(&b"lock:a"[..]));
        let s = b"*3\r\n$9\r\nsubscribe\r\n$17\r\nlockgate:released\r\n:1\r\n";
        assert_eq!(message_payload(s), None);
    }
}
