//! A session's upstream, whichever way it reaches Redis: its own
//! connection ([`SessionStream::Direct`], plain or TLS), commands over the
//! shared connections (`proxy.upstream = "shared"`, [`super::shared`]), or
//! commands routed by slot to a cluster's nodes ([`super::cluster`]). The
//! session reads replies from one half and writes commands into the other
//! without knowing which; a client's connection is a [`tls::Stream`]
//! only, which names none of these.
//!
//! Writers must `flush` after writing (TLS keeps records until then; the
//! shared and cluster halves send a batch on flush).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::cluster::{ClusterRead, ClusterStream, ClusterWrite};
use super::shared::{SharedRead, SharedStream, SharedWrite};
use crate::protocol::frames::Frames;
use crate::tls::{self, ReadPart, WritePart};

/// A session's upstream.
#[derive(Debug)]
pub enum SessionStream {
    /// A connection of the session's own (`proxy.upstream = "dedicated"`).
    Direct(tls::Stream),
    /// Commands over a shared connection until the session moves to its
    /// own (see [`super::shared`]).
    Shared(Box<SharedStream>),
    /// Commands routed by slot to a cluster's nodes (see
    /// [`super::cluster`]).
    Cluster(Box<ClusterStream>),
}

/// The reading half of a [`SessionStream`]: replies.
#[derive(Debug)]
pub enum SessionRead<'a> {
    /// The own connection's half.
    Direct(ReadPart<'a>),
    /// A shared-mode upstream's replies.
    Shared(&'a mut SharedRead),
    /// A cluster upstream's replies.
    Cluster(&'a mut ClusterRead),
}

/// The writing half of a [`SessionStream`]: commands.
#[derive(Debug)]
pub enum SessionWrite<'a> {
    /// The own connection's half.
    Direct(WritePart<'a>),
    /// A shared-mode upstream's commands.
    Shared(&'a mut SharedWrite),
    /// A cluster upstream's commands.
    Cluster(&'a mut ClusterWrite),
}

impl SessionStream {
    /// Whether the session has a connection of its own (counted while it
    /// lives; a shared-mode stream counts its own when it moves to one).
    pub fn is_direct(&self) -> bool {
        matches!(self, SessionStream::Direct(_))
    }

    /// Borrowed halves, to read and write at once in one task.
    pub fn split(&mut self) -> (SessionRead<'_>, SessionWrite<'_>) {
        match self {
            SessionStream::Direct(s) => {
                let (r, w) = s.split();
                (SessionRead::Direct(r), SessionWrite::Direct(w))
            }
            SessionStream::Shared(s) => (
                SessionRead::Shared(&mut s.read),
                SessionWrite::Shared(&mut s.write),
            ),
            SessionStream::Cluster(s) => (
                SessionRead::Cluster(&mut s.read),
                SessionWrite::Cluster(&mut s.write),
            ),
        }
    }
}

impl SessionWrite<'_> {
    /// Whether this upstream frames the commands written to it again
    /// (shared connections, a cluster) and so takes [`Self::frames`].
    pub fn wants_frames(&self) -> bool {
        !matches!(self, SessionWrite::Direct(_))
    }

    /// What the dispatcher found of the commands at the front of the next
    /// write (see [`crate::protocol::frames`]); written bytes that do not
    /// line up with them are framed again, as without.
    pub fn frames(&mut self, frames: Frames) {
        match self {
            SessionWrite::Direct(_) => {}
            SessionWrite::Shared(s) => s.frames(frames),
            SessionWrite::Cluster(s) => s.frames(frames),
        }
    }
}

impl AsyncRead for SessionRead<'_> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            SessionRead::Direct(s) => Pin::new(s).poll_read(cx, buf),
            SessionRead::Shared(s) => Pin::new(&mut **s).poll_read(cx, buf),
            SessionRead::Cluster(s) => Pin::new(&mut **s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for SessionWrite<'_> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            SessionWrite::Direct(s) => Pin::new(s).poll_write(cx, buf),
            SessionWrite::Shared(s) => Pin::new(&mut **s).poll_write(cx, buf),
            SessionWrite::Cluster(s) => Pin::new(&mut **s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            SessionWrite::Direct(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            SessionWrite::Shared(s) => Pin::new(&mut **s).poll_write_vectored(cx, bufs),
            SessionWrite::Cluster(s) => Pin::new(&mut **s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            SessionWrite::Direct(s) => s.is_write_vectored(),
            SessionWrite::Shared(_) | SessionWrite::Cluster(_) => false,
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            SessionWrite::Direct(s) => Pin::new(s).poll_flush(cx),
            SessionWrite::Shared(s) => Pin::new(&mut **s).poll_flush(cx),
            SessionWrite::Cluster(s) => Pin::new(&mut **s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            SessionWrite::Direct(s) => Pin::new(s).poll_shutdown(cx),
            SessionWrite::Shared(s) => Pin::new(&mut **s).poll_shutdown(cx),
            SessionWrite::Cluster(s) => Pin::new(&mut **s).poll_shutdown(cx),
        }
    }
}
