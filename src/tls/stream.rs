//! A connection that is plain TCP or TLS over TCP, for clients and for
//! Redis alike. The plain variant costs one `match` per poll and no copy:
//! [`Stream::split`] gives TCP's own borrowed halves; only TLS shares one
//! session between its halves ([`TlsHalf`], a lock per poll, as
//! `tokio::io::split`).
//!
//! Writers must `flush` after writing: TLS keeps records that the socket
//! did not take yet until the next write or flush (a no-op on plain TCP).

use std::io;
use std::os::fd::AsFd;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::tcp;
use tokio::net::TcpStream;

/// TLS over TCP, as a server (clients of the TLS listener) or as a client
/// (to Redis).
pub type TlsStream = tokio_rustls::TlsStream<TcpStream>;

/// Plain TCP or TLS.
#[derive(Debug)]
pub enum Stream {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS over TCP (boxed: a TLS session is large).
    Tls(Box<TlsStream>),
}

/// The reading half of a [`Stream`].
#[derive(Debug)]
pub enum ReadPart<'a> {
    /// Plain TCP's own half.
    Plain(tcp::ReadHalf<'a>),
    /// TLS's half.
    Tls(TlsHalf<'a>),
}

/// The writing half of a [`Stream`].
#[derive(Debug)]
pub enum WritePart<'a> {
    /// Plain TCP's own half.
    Plain(tcp::WriteHalf<'a>),
    /// TLS's half.
    Tls(TlsHalf<'a>),
}

/// One half of a TLS stream. Both halves share the session (reading may
/// write, a key update, and writing may read), each taking the lock for
/// one poll: as `tokio::io::split` does, never contended in a session,
/// whose halves are polled by its one task. Unlike `tokio::io::split`'s
/// halves, this one reaches the socket underneath ([`ReadPart::reset`]).
#[derive(Debug, Clone)]
pub struct TlsHalf<'a>(Arc<Mutex<&'a mut TlsStream>>);

impl TlsHalf<'_> {
    fn with<R>(&self, f: impl FnOnce(Pin<&mut TlsStream>) -> R) -> R {
        // A panic inside a poll leaves the session as any error would.
        let mut stream = crate::sync::lock(&self.0);
        f(Pin::new(&mut **stream))
    }

    /// A second handle on the TCP socket, registered with the runtime on
    /// its own (a duplicated descriptor, closed when dropped): it waits on
    /// the socket's state without holding the session. `None` if the
    /// descriptor cannot be duplicated (out of descriptors).
    fn second_socket(&self) -> Option<TcpStream> {
        let fd = self
            .with(|s| s.get_ref().0.as_fd().try_clone_to_owned())
            .ok()?;
        // The copy shares the original's non-blocking mode (one open file).
        TcpStream::from_std(std::net::TcpStream::from(fd)).ok()
    }
}

impl AsyncRead for TlsHalf<'_> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.with(|s| s.poll_read(cx, buf))
    }
}

impl AsyncWrite for TlsHalf<'_> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.with(|s| s.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.with(|s| s.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.with(|s| s.is_write_vectored())
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.with(|s| s.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.with(|s| s.poll_shutdown(cx))
    }
}

impl Stream {
    /// Borrowed halves, to read and write at once in one task.
    pub fn split(&mut self) -> (ReadPart<'_>, WritePart<'_>) {
        match self {
            Stream::Plain(s) => {
                let (r, w) = s.split();
                (ReadPart::Plain(r), WritePart::Plain(w))
            }
            Stream::Tls(s) => {
                let half = TlsHalf(Arc::new(Mutex::new(&mut **s)));
                (ReadPart::Tls(half.clone()), WritePart::Tls(half))
            }
        }
    }
}

impl ReadPart<'_> {
    /// Waits until the connection is reset or broken (an error is pending
    /// on the socket: the peer's RST, a keepalive timeout), for a reader
    /// that has seen the peer's half-close and reads no more: after the
    /// FIN every read returns 0 at once, so only the socket's error
    /// readiness tells a peer that is gone from one that still reads.
    ///
    /// TLS: the socket under the session is watched through a second
    /// descriptor for it, made only here (the session is shared with the
    /// writing half); without one (out of descriptors) a reset is seen at
    /// the next write instead.
    pub async fn reset(&self) {
        match self {
            ReadPart::Plain(r) => error_on(r.as_ref()).await,
            ReadPart::Tls(half) => match half.second_socket() {
                Some(socket) => error_on(&socket).await,
                None => std::future::pending().await,
            },
        }
    }

    /// Whether the peer's FIN has reached this socket already, as the
    /// runtime last saw it (no system call): a hint, since a FIN that came
    /// after the runtime's last look is not seen. False for TLS (its own
    /// close is inside the stream).
    pub fn read_closed(&self) -> bool {
        let ReadPart::Plain(r) = self else {
            return false;
        };
        use std::future::Future;
        let ready = std::pin::pin!(r.as_ref().ready(Interest::READABLE));
        let mut cx = Context::from_waker(std::task::Waker::noop());
        matches!(ready.poll(&mut cx), Poll::Ready(Ok(r)) if r.is_read_closed())
    }

    /// Whether an error is pending on the socket now (the peer's reset
    /// after a write reached a closed socket), asked of the kernel
    /// (`SO_ERROR`, one system call): on loopback the reset is in by the
    /// time the write that caused it returns. False for TLS.
    pub fn failed_now(&self) -> bool {
        match self {
            ReadPart::Plain(r) => !matches!(r.as_ref().take_error(), Ok(None)),
            ReadPart::Tls(_) => false,
        }
    }
}

/// Ready once an error is pending on `socket`.
async fn error_on(socket: &TcpStream) {
    if socket.ready(Interest::ERROR).await.is_ok() {
        return;
    }
    // Only when the runtime is going away: not a reset.
    std::future::pending().await
}

/// A TLS peer that closes TCP without `close_notify` (many Redis clients
/// do) has ended the stream as far as RESP is concerned: an end of file,
/// as on plain TCP, so the half-close is passed on as usual.
fn eof_is_eof(polled: Poll<io::Result<()>>) -> Poll<io::Result<()>> {
    match polled {
        Poll::Ready(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => Poll::Ready(Ok(())),
        other => other,
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => eof_is_eof(Pin::new(&mut **s).poll_read(cx, buf)),
        }
    }
}

impl AsyncRead for ReadPart<'_> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ReadPart::Plain(s) => Pin::new(s).poll_read(cx, buf),
            ReadPart::Tls(s) => eof_is_eof(Pin::new(s).poll_read(cx, buf)),
        }
    }
}

macro_rules! delegate_write {
    ($ty:ty, $plain:path, $tls:path) => {
        impl AsyncWrite for $ty {
            fn poll_write(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &[u8],
            ) -> Poll<io::Result<usize>> {
                match self.get_mut() {
                    $plain(s) => Pin::new(s).poll_write(cx, buf),
                    $tls(s) => Pin::new(s).poll_write(cx, buf),
                }
            }

            fn poll_write_vectored(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                bufs: &[io::IoSlice<'_>],
            ) -> Poll<io::Result<usize>> {
                match self.get_mut() {
                    $plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
                    $tls(s) => Pin::new(s).poll_write_vectored(cx, bufs),
                }
            }

            fn is_write_vectored(&self) -> bool {
                match self {
                    $plain(s) => s.is_write_vectored(),
                    $tls(s) => s.is_write_vectored(),
                }
            }

            fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    $plain(s) => Pin::new(s).poll_flush(cx),
                    $tls(s) => Pin::new(s).poll_flush(cx),
                }
            }

            fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    $plain(s) => Pin::new(s).poll_shutdown(cx),
                    $tls(s) => Pin::new(s).poll_shutdown(cx),
                }
            }
        }
    };
}

delegate_write!(Stream, Stream::Plain, Stream::Tls);
delegate_write!(WritePart<'_>, WritePart::Plain, WritePart::Tls);
