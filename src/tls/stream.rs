//! A connection that is plain TCP or TLS over TCP, for clients and for
//! Redis alike. The plain variant costs one `match` per poll and no copy:
//! [`Stream::split`] gives TCP's own borrowed halves; only TLS goes through
//! `tokio::io::split` (one session shared by both halves).
//!
//! Writers must `flush` after writing: TLS keeps records that the socket
//! did not take yet until the next write or flush (a no-op on plain TCP).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
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
    Tls(tokio::io::ReadHalf<&'a mut TlsStream>),
}

/// The writing half of a [`Stream`].
#[derive(Debug)]
pub enum WritePart<'a> {
    /// Plain TCP's own half.
    Plain(tcp::WriteHalf<'a>),
    /// TLS's half.
    Tls(tokio::io::WriteHalf<&'a mut TlsStream>),
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
                let (r, w) = tokio::io::split(&mut **s);
                (ReadPart::Tls(r), WritePart::Tls(w))
            }
        }
    }

    /// The TCP socket underneath.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => s.get_ref().0,
        }
    }
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
