//! A subscription on a connection of lockgate's own: `SUBSCRIBE` to one
//! channel, then each message's payload handed over as it comes (the
//! lock room's wake-ups between instances, Sentinel's `+switch-master`).

use tokio::io::AsyncWriteExt;

use super::FrameReader;
use crate::protocol::encode;
use crate::tls::Stream;
use crate::upstream::backoff::Backoff;

/// Subscribes `stream` to `channel` and hands each message's payload to
/// `on` until the connection fails (the error says why); `subscribed` runs
/// once the subscription is confirmed. Once subscribed, `backoff` goes
/// back to its shortest, so the caller's next reconnection after a
/// long-lived subscription is prompt.
pub(crate) async fn messages(
    mut stream: Stream,
    channel: &[u8],
    backoff: &mut Backoff,
    subscribed: impl FnOnce(),
    mut on: impl FnMut(&[u8]),
) -> Result<(), String> {
    stream
        .write_all(&encode::command(&[b"SUBSCRIBE", channel]))
        .await
        .map_err(|e| e.to_string())?;
    stream.flush().await.map_err(|e| e.to_string())?;
    backoff.reset();
    let mut frames = FrameReader::new();
    let mut subscribed = Some(subscribed);
    loop {
        let frame = frames.next(&mut stream).await?;
        if let Some(payload) = message_payload(&frame) {
            on(payload);
        } else if let Some(confirmed) = subscribed.take() {
            confirmed();
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
        let m = b"*3\r\n$7\r\nmessage\r\n$16\r\nlockgate:wake:a:\r\n$6\r\nlock:a\r\n";
        assert_eq!(message_payload(m), Some(&b"lock:a"[..]));
        let s = b"*3\r\n$9\r\nsubscribe\r\n$16\r\nlockgate:wake:a:\r\n:1\r\n";
        assert_eq!(message_payload(s), None);
    }
}
