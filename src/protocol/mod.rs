//! RESP framing, pure and without I/O: where a client request ends and what
//! its arguments are ([`request`]), where a Redis reply ends ([`reply`]), and
//! the replies lockgate writes itself ([`encode`]).
//!
//! [`request`] parses client commands, multibulk and inline, with limits
//! checked on headers; [`reply`] is a resumable frame scanner for RESP2 and
//! RESP3 replies (its property test against `redis-protocol` is
//! `reply_props`; [`reply::simple_frames`] counts a run of plain replies in
//! one pass for the writer); [`frames`] carries the commands the
//! dispatcher framed to an upstream that would frame them again.

pub mod encode;
pub mod frames;
pub mod reply;
pub mod request;

#[cfg(test)]
mod reply_props;

use crate::error::ErrorSource;

/// Malformed RESP. Client-side variants carry Redis's own wording, so a
/// client sees the same `-ERR Protocol error: …` it would get from Redis.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// `*N` header that is not a number or exceeds `limits.max_multibulk_len`.
    #[error("Protocol error: invalid multibulk length")]
    InvalidMultibulkLength,
    /// `$N` header that is not a number, negative, or over `limits.max_bulk_bytes`.
    #[error("Protocol error: invalid bulk length")]
    InvalidBulkLength,
    /// A multibulk element that is not a bulk string (nesting, wrong type).
    #[error("Protocol error: expected '$', got '{}'", char::from(*.0))]
    ExpectedBulk(u8),
    /// A `*` header line longer than 64 KiB.
    #[error("Protocol error: too big mbulk count string")]
    TooBigMultibulkCount,
    /// A `$` header line longer than 64 KiB.
    #[error("Protocol error: too big bulk count string")]
    TooBigBulkCount,
    /// An inline command longer than `limits.max_inline_bytes`.
    #[error("Protocol error: too big inline request")]
    TooBigInline,
    /// An inline command whose quotes do not close.
    #[error("Protocol error: unbalanced quotes in request")]
    UnbalancedQuotes,
    /// A header or bulk payload not followed by CRLF.
    #[error("Protocol error: expected CRLF")]
    MissingCrlf,
    /// A command larger in all than `limits.max_request_bytes`.
    #[error("Protocol error: request larger than limits.max_request_bytes ({0} bytes)")]
    RequestTooLarge(u64),
    /// Redis sent something that is not RESP: the upstream is broken.
    #[error("malformed reply from upstream: {0}")]
    BadReply(&'static str),
}

impl ProtocolError {
    /// Who caused it: a bad reply is the upstream's fault, the rest the client's.
    pub fn source_kind(&self) -> ErrorSource {
        match self {
            ProtocolError::BadReply(_) => ErrorSource::Upstream,
            _ => ErrorSource::Client,
        }
    }

    /// Short stable name for the metric label.
    pub fn label(&self) -> &'static str {
        match self {
            ProtocolError::InvalidMultibulkLength => "invalid_multibulk_length",
            ProtocolError::InvalidBulkLength => "invalid_bulk_length",
            ProtocolError::ExpectedBulk(_) => "expected_bulk",
            ProtocolError::TooBigMultibulkCount | ProtocolError::TooBigBulkCount => {
                "header_too_long"
            }
            ProtocolError::TooBigInline => "inline_too_big",
            ProtocolError::UnbalancedQuotes => "unbalanced_quotes",
            ProtocolError::MissingCrlf => "missing_crlf",
            ProtocolError::RequestTooLarge(_) => "request_too_large",
            ProtocolError::BadReply(_) => "bad_reply",
        }
    }
}
