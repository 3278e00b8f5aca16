//! The close after a protocol error (or a request not completed in time,
//! `proxy.partial_request_timeout_ms`). Redis answers a bad frame with an
//! error and closes; lockgate does the same, but it may stop reading in
//! the middle of what the client sent (an oversize line is refused after
//! 64 KiB). Closing a socket with unread bytes makes the kernel reset the
//! connection, and a reset discards the replies the client has not read
//! yet, the error among them. So the close is a lingering one: a FIN
//! first, then what the client still sends is read and dropped until it
//! closes too, for a bounded time and number of bytes.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

/// Longest a closed session waits for its client to stop sending.
pub const LINGER: Duration = Duration::from_secs(1);

/// Most bytes read and dropped while lingering.
pub const LINGER_BYTES: usize = 4 << 20;

/// Half-closes `w`, then drains `r` until EOF, an error, [`LINGER`],
/// [`LINGER_BYTES`] or shutdown, whichever comes first.
pub async fn linger<R, W>(r: &mut R, w: &mut W, stop: &CancellationToken)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    if w.shutdown().await.is_err() {
        return;
    }
    // On the heap: the session's future would carry a stack buffer for
    // the whole life of every connection.
    let mut sink = vec![0u8; 8192];
    let mut left = LINGER_BYTES;
    let deadline = tokio::time::sleep(LINGER);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            _ = &mut deadline => return,
            _ = stop.cancelled() => return,
            read = r.read(&mut sink) => match read {
                Ok(n) if n > 0 && n < left => left -= n,
                _ => return,
            },
        }
    }
}
