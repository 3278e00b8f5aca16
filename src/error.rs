//! Error sources. Each module has its own error enum; every variant says
//! whose fault it is, because that decides what happens next: a client error
//! is answered `-ERR …` (and, for broken framing, the connection closed), an
//! upstream error is reported to the client and logged, an internal error is
//! a bug. The same tag labels the error metrics.

/// Whose fault an error is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorSource {
    /// The client sent something wrong (bad RESP, over a limit).
    Client,
    /// Redis (or the network to it) failed.
    Upstream,
    /// lockgate itself failed.
    Internal,
}

impl ErrorSource {
    /// The metric label: `client`, `upstream` or `internal`.
    pub fn label(self) -> &'static str {
        match self {
            ErrorSource::Client => "client",
            ErrorSource::Upstream => "upstream",
            ErrorSource::Internal => "internal",
        }
    }
}
