//! Release announcements between lockgate instances: every release made
//! through lockgate is PUBLISHed on `lockgate:released` (by the release
//! scripts themselves, on the store that holds the lock), and every
//! instance subscribes there, so a waiter parked on one instance is woken
//! by a release through another. A lost announcement only delays a handoff
//! until the next probe.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

use super::node::{handshake, FrameReader, NodeConfig};
use super::storm::{Storm, RELEASED_CHANNEL};
use crate::protocol::encode;

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
        if let Err(e) = subscribed(&node, &storm, &mut backoff).await {
            tracing::debug!(node = %node.addr, error = %e, "release announcements interrupted");
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

async fn subscribed(
    node: &NodeConfig,
    storm: &Storm,
    backoff: &mut Duration,
) -> Result<(), String> {
    let mut stream = handshake(node).await?;
    stream
        .write_all(&encode::command(&[
            b"SUBSCRIBE",
            RELEASED_CHANNEL.as_bytes(),
        ]))
        .await
        .map_err(|e| e.to_string())?;
    stream.flush().await.map_err(|e| e.to_string())?;
    *backoff = Duration::from_millis(10);
    let mut frames = FrameReader::new();
    loop {
        let frame = frames.next(&mut stream).await?;
        if let Some(key) = message_payload(&frame) {
            storm.announced(key);
        }
    }
}

/// The payload of a `message` push (`*3 message channel payload`).
fn message_payload(frame: &[u8]) -> Option<&[u8]> {
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
