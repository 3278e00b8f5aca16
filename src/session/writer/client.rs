//! The client side of the writer half: every byte to the client goes
//! through [`Client::write`], which counts it, records it for the idle
//! timeout, and, with `proxy.client_write_timeout_ms`, ends the session
//! when the client stops reading.

use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncWrite, AsyncWriteExt};

use super::super::activity::Activity;
use super::super::SessionError;
use crate::metrics::ProxyMetrics;

/// The client side of the writer: the stream, and what counts its bytes.
pub(super) struct Client<'a, 's, W, L> {
    pub(super) stream: &'s mut W,
    pub(super) metrics: &'a ProxyMetrics,
    pub(super) locks: &'a L,
    pub(super) activity: &'a Activity,
    pub(super) write_timeout: Option<Duration>,
}

impl<W: AsyncWrite + Unpin, L> Client<'_, '_, W, L> {
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
        match self.write_timeout {
            None => {
                self.stream
                    .write_all(bytes)
                    .await
                    .map_err(SessionError::ClientIo)?;
                self.stream.flush().await.map_err(SessionError::ClientIo)?;
            }
            Some(limit) => self.write_bounded(bytes, limit).await?,
        }
        self.activity.wrote();
        ProxyMetrics::add(&self.metrics.client_bytes_out, bytes.len() as u64);
        Ok(())
    }

    /// [`Client::write`] where every write and the flush must make progress
    /// within `limit`. While a write waits, the writer reads nothing from
    /// Redis, so a client that does not read makes Redis buffer its replies;
    /// ending the session closes the upstream connection and frees them.
    async fn write_bounded(
        &mut self,
        mut bytes: &[u8],
        limit: Duration,
    ) -> Result<(), SessionError> {
        while !bytes.is_empty() {
            // Tried once without a timer first: a client that reads never
            // pays for one.
            let n = match poll_once(self.stream.write(bytes)).await {
                Some(written) => written,
                None => tokio::time::timeout(limit, self.stream.write(bytes))
                    .await
                    .map_err(|_| self.timed_out(limit))?,
            }
            .map_err(SessionError::ClientIo)?;
            if n == 0 {
                return Err(SessionError::ClientIo(std::io::ErrorKind::WriteZero.into()));
            }
            bytes = &bytes[n..];
        }
        match poll_once(self.stream.flush()).await {
            Some(flushed) => flushed,
            None => tokio::time::timeout(limit, self.stream.flush())
                .await
                .map_err(|_| self.timed_out(limit))?,
        }
        .map_err(SessionError::ClientIo)
    }

    fn timed_out(&self, limit: Duration) -> SessionError {
        ProxyMetrics::inc(&self.metrics.clients_closed_write_timeout);
        SessionError::ClientWriteTimeout(limit.as_millis() as u64)
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
    use tokio::io::{duplex, AsyncReadExt};

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
        let mut client = Client {
            stream: &mut near,
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
