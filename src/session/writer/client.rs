//! The client side of the writer half: every byte to the client goes
//! through [`Client::write`], which counts it, records it for the idle
//! timeout, and bounds what a client that stops reading can cost:
//! `proxy.client_write_timeout_ms` ends the session when a write makes no
//! progress that long, and with `proxy.max_client_output_bytes` the writer
//! keeps reading Redis while a write waits (so Redis does not hold the
//! replies), up to that many bytes, then ends the session.

use std::io;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::Instant;

use super::super::activity::Activity;
use super::super::SessionError;
use crate::metrics::ProxyMetrics;

/// The client side of the writer: the stream, what counts its bytes, and
/// the replies read ahead from Redis while a write to the client waited.
pub(super) struct Client<'a, 's, W, R, L> {
    pub(super) stream: &'s mut W,
    /// Redis's side: the writer reads it here, and so does a waiting write.
    pub(super) upstream: &'s mut R,
    pub(super) metrics: &'a ProxyMetrics,
    pub(super) locks: &'a L,
    pub(super) activity: &'a Activity,
    pub(super) write_timeout: Option<Duration>,
    /// Most bytes read ahead (`proxy.max_client_output_bytes`); 0: none,
    /// Redis holds the replies while the client does not read.
    pub(super) max_output: usize,
    /// Replies read from Redis while a write waited; they come after every
    /// byte of the writer's buffer, and are forwarded next.
    pub(super) ahead: BytesMut,
    /// Redis's side ended (EOF: `Ok`) while reading ahead; acted on once
    /// `ahead` is forwarded.
    pub(super) upstream_end: Option<io::Result<()>>,
    /// The client is gone: writes are dropped, while the writer reads on
    /// only for the outcome of a lock command.
    pub(super) discard: bool,
}

/// What ended one wait of a blocked write.
enum Waited {
    Wrote(io::Result<usize>),
    Read(io::Result<usize>),
    TimedOut,
}

impl<W: AsyncWrite + Unpin, R: AsyncRead + Unpin, L> Client<'_, '_, W, R, L> {
    /// Writes the local replies rendered in `out`, if any, and empties it.
    pub(super) async fn flush_out(&mut self, out: &mut BytesMut) -> Result<(), SessionError> {
        if out.is_empty() {
            return Ok(());
        }
        self.write(out).await?;
        out.clear();
        Ok(())
    }

    /// Writes `bytes` to the client and flushes (TLS holds records until
    /// then); with a write timeout, each step must make progress within it.
    pub(super) async fn write(&mut self, bytes: &[u8]) -> Result<(), SessionError> {
        if self.discard {
            return Ok(());
        }
        if self.write_timeout.is_none() && self.max_output == 0 {
            self.stream
                .write_all(bytes)
                .await
                .map_err(SessionError::ClientIo)?;
            self.stream.flush().await.map_err(SessionError::ClientIo)?;
        } else {
            self.write_bounded(bytes).await?;
        }
        self.activity.wrote();
        ProxyMetrics::add(&self.metrics.client_bytes_out, bytes.len() as u64);
        Ok(())
    }

    /// [`Client::write`] with the limits: every write must make progress
    /// within the write timeout, and while one waits Redis is read ahead up
    /// to `max_output`. Ending the session closes the upstream connection,
    /// which frees whatever Redis still holds for it.
    async fn write_bounded(&mut self, mut bytes: &[u8]) -> Result<(), SessionError> {
        while !bytes.is_empty() {
            // Tried once without waiting first: a client that reads never
            // pays for a timer.
            let n = match poll_once(self.stream.write(bytes)).await {
                Some(written) => written.map_err(SessionError::ClientIo)?,
                None => self.write_waiting(bytes).await?,
            };
            if n == 0 {
                return Err(SessionError::ClientIo(io::ErrorKind::WriteZero.into()));
            }
            bytes = &bytes[n..];
        }
        let flushed = match (poll_once(self.stream.flush()).await, self.write_timeout) {
            (Some(flushed), _) => flushed,
            (None, None) => self.stream.flush().await,
            (None, Some(limit)) => tokio::time::timeout(limit, self.stream.flush())
                .await
                .map_err(|_| self.timed_out(limit))?,
        };
        flushed.map_err(SessionError::ClientIo)
    }

    /// Waits until the client takes some of `bytes` (how many), reading
    /// Redis ahead meanwhile.
    async fn write_waiting(&mut self, bytes: &[u8]) -> Result<usize, SessionError> {
        let deadline = self.write_timeout.map(|limit| Instant::now() + limit);
        loop {
            let read_ahead = self.max_output > 0 && self.upstream_end.is_none();
            if read_ahead && self.ahead.capacity() - self.ahead.len() < 4096 {
                self.ahead.reserve(64 * 1024);
            }
            let waited = tokio::select! {
                biased;
                written = self.stream.write(bytes) => Waited::Wrote(written),
                read = self.upstream.read_buf(&mut self.ahead), if read_ahead => Waited::Read(read),
                // In a block, so the timer is made only when one is set.
                _ = async {
                    if let Some(at) = deadline {
                        tokio::time::sleep_until(at).await;
                    }
                }, if deadline.is_some() => Waited::TimedOut,
            };
            match waited {
                Waited::Wrote(written) => return written.map_err(SessionError::ClientIo),
                Waited::Read(Ok(0)) => self.upstream_end = Some(Ok(())),
                Waited::Read(Ok(_)) if self.ahead.len() > self.max_output => {
                    ProxyMetrics::inc(&self.metrics.clients_closed_output_limit);
                    return Err(SessionError::ClientOutputLimit(self.max_output as u64));
                }
                Waited::Read(Ok(_)) => {}
                Waited::Read(Err(e)) => self.upstream_end = Some(Err(e)),
                Waited::TimedOut => {
                    let limit = self.write_timeout.unwrap_or_default();
                    return Err(self.timed_out(limit));
                }
            }
        }
    }

    fn timed_out(&self, limit: Duration) -> SessionError {
        ProxyMetrics::inc(&self.metrics.clients_closed_write_timeout);
        SessionError::ClientWriteTimeout(limit.as_millis() as u64)
    }

    /// Moves the replies read ahead behind what `buf` holds; true if there
    /// were any.
    pub(super) fn take_ahead(&mut self, buf: &mut BytesMut) -> bool {
        if self.ahead.is_empty() {
            return false;
        }
        if buf.is_empty() {
            std::mem::swap(buf, &mut self.ahead);
        } else {
            buf.extend_from_slice(&self.ahead);
            self.ahead.clear();
        }
        true
    }
}

/// Polls `fut` once: its output if it is ready now, `None` if it would
/// wait. Only for futures that do nothing until ready (a socket write).
async fn poll_once<F: std::future::Future>(fut: F) -> Option<F::Output> {
    let mut fut = std::pin::pin!(fut);
    std::future::poll_fn(|cx| match fut.as_mut().poll(cx) {
        std::task::Poll::Ready(out) => std::task::Poll::Ready(Some(out)),
        std::task::Poll::Pending => std::task::Poll::Ready(None),
    })
    .await
}

#[cfg(test)]
mod tests {
    use tokio::io::{duplex, AsyncReadExt, AsyncWriteExt};

    use super::*;

    const LIMIT: Duration = Duration::from_secs(5);

    #[tokio::test(start_paused = true)]
    async fn a_client_that_never_reads_times_out_and_is_counted() {
        let started = tokio::time::Instant::now();
        let end = write_through(4, b"0123456789", false).await;
        assert!(
            matches!(end, Err(SessionError::ClientWriteTimeout(5000))),
            "{end:?}"
        );
        assert_eq!(started.elapsed(), LIMIT);
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_reader_making_progress_is_not_cut() {
        // Ten seconds in all, twice the limit, but never stalled for it.
        let started = tokio::time::Instant::now();
        write_through(1, b"0123456789", true).await.unwrap();
        assert!(started.elapsed() > LIMIT, "{:?}", started.elapsed());
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_that_fits_needs_no_timer() {
        write_through(64, b"0123456789", false).await.unwrap();
    }

    /// A client whose pipe is full and never read, a Redis that sends
    /// `from_redis` then closes, reading ahead up to `max_output`: how the
    /// write ended, what was read ahead, whether Redis's end was seen.
    async fn read_ahead_while_stuck(
        max_output: usize,
        from_redis: &[u8],
    ) -> (Result<(), SessionError>, BytesMut, bool, u64) {
        let metrics = ProxyMetrics::default();
        let activity = Activity::new();
        let (_far, mut near) = duplex(4);
        let (mut redis_far, mut redis) = duplex(1 << 16);
        redis_far.write_all(from_redis).await.unwrap();
        drop(redis_far);
        let mut client = Client {
            stream: &mut near,
            upstream: &mut redis,
            max_output,
            ahead: BytesMut::new(),
            upstream_end: None,
            discard: false,
            metrics: &metrics,
            locks: &(),
            activity: &activity,
            write_timeout: Some(LIMIT),
        };
        let written = client.write(b"0123456789").await;
        let ended = client.upstream_end.is_some();
        let ahead = std::mem::take(&mut client.ahead);
        let cut = ProxyMetrics::get(&metrics.clients_closed_output_limit);
        (written, ahead, ended, cut)
    }

    #[tokio::test(start_paused = true)]
    async fn replies_are_read_ahead_while_the_client_is_stuck() {
        // Under the bound: Redis's replies and its close wait in lockgate,
        // and the stuck write still ends at the write timeout.
        let (written, ahead, ended, cut) = read_ahead_while_stuck(64, b"+OK\r\n:1\r\n").await;
        assert!(
            matches!(written, Err(SessionError::ClientWriteTimeout(_))),
            "{written:?}"
        );
        assert_eq!(&ahead[..], b"+OK\r\n:1\r\n");
        assert!(ended, "Redis's close is kept for after the replies");
        assert_eq!(cut, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn past_the_output_bound_the_client_is_cut_and_counted() {
        let started = tokio::time::Instant::now();
        let (written, _, _, cut) = read_ahead_while_stuck(64, &[b'x'; 1000]).await;
        assert!(
            matches!(written, Err(SessionError::ClientOutputLimit(64))),
            "{written:?}"
        );
        assert_eq!(cut, 1);
        assert!(started.elapsed() < LIMIT, "cut at once, not at the timeout");
    }

    async fn write_through(
        pipe: usize,
        bytes: &[u8],
        read_slowly: bool,
    ) -> Result<(), SessionError> {
        let metrics = ProxyMetrics::default();
        let activity = Activity::new();
        let (mut far, mut near) = duplex(pipe);
        let reader = async {
            if read_slowly {
                // A byte every second: slow, but never stalled for the limit.
                let mut byte = [0u8; 1];
                while far.read(&mut byte).await.is_ok_and(|n| n > 0) {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            } else {
                std::future::pending::<()>().await;
            }
        };
        let mut redis = tokio::io::empty();
        let mut client = Client {
            stream: &mut near,
            upstream: &mut redis,
            max_output: 0,
            ahead: BytesMut::new(),
            upstream_end: None,
            discard: false,
            metrics: &metrics,
            locks: &(),
            activity: &activity,
            write_timeout: Some(LIMIT),
        };
        let written = tokio::select! {
            written = client.write(bytes) => written,
            _ = reader => unreachable!("the reader never ends first"),
        };
        let timeouts = ProxyMetrics::get(&metrics.clients_closed_write_timeout);
        assert_eq!(timeouts, u64::from(written.is_err()));
        written
    }
}
