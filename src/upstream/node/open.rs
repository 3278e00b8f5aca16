//! Opening a connection of lockgate's own to a node: connect, authenticate,
//! name it, read what the node is (`run_id`, uptime, eviction policy,
//! whether it knows `MSETEX` and `EVALSHA`), and
//! load the scripts it is given ([`NodeConfig::scripts`]); and the
//! one-reply-at-a-time exchanges used before a connection is pipelined.

use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::report::{self, Report, Sample};
use super::{NodeConfig, INTERNAL_NAME};
use crate::protocol::encode;
use crate::protocol::reply::ReplyScanner;
use crate::tls::Stream;

/// A connection just opened, and what the node said as it opened.
pub(super) struct Opened {
    /// The connection, ready to be pipelined.
    pub stream: Stream,
    /// What the node said about itself.
    pub report: Report,
}

/// Connects, authenticates, reads the node's `run_id`, uptime and eviction
/// policy, and loads the scripts of [`NodeConfig::scripts`].
pub(super) async fn open(config: &NodeConfig) -> Result<Opened, String> {
    let mut stream = handshake(config).await?;
    // One round trip. An error reply (CONFIG renamed or refused, INFO
    // refused by an ACL) is an answer, never a failure of the connection:
    // the policy is then read from INFO memory, or "unknown".
    let mut asked = BytesMut::new();
    for command in [
        encode::command(&[b"INFO", b"server"]),
        report::config_get(),
        report::info_memory(),
        report::info_stats(),
        report::command_info_msetex(),
        report::command_info_evalsha(),
        report::info_replication(),
        report::info_persistence(),
    ] {
        asked.extend_from_slice(&command);
    }
    let replies = requests(&mut stream, &asked, 8, config.connect_timeout).await?;
    let read_at = Instant::now();
    let [info, config_get, memory, stats, msetex, evalsha, replication, persistence] = &replies[..]
    else {
        return Err("INFO and CONFIG GET: replies missing".to_string());
    };
    let memory = Sample::from_replies(Some(config_get), Some(memory), stats)
        .with_safety(replication, persistence);
    let info = String::from_utf8_lossy(info);
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_string()))
    };
    let run_id = field("run_id:").unwrap_or_default();
    let uptime = field("uptime_in_seconds:")
        .and_then(|v| v.parse().ok())
        .map(|secs| (read_at, secs));
    // The scripts, so their `EVALSHA`s find them (see
    // [`super::Request`]). A refusal (an ACL without `SCRIPT`) is no
    // failure: those calls then run as `EVAL` after one `NOSCRIPT` each.
    // All in one write: one round trip at every (re)connection.
    let scripts = config.scripts;
    if !scripts.is_empty() {
        let mut loads = BytesMut::new();
        for body in scripts {
            loads.extend_from_slice(&encode::command(&[b"SCRIPT", b"LOAD", body.as_bytes()]));
        }
        requests(&mut stream, &loads, scripts.len(), config.connect_timeout).await?;
    }
    Ok(Opened {
        stream,
        report: Report {
            run_id,
            uptime,
            memory,
            msetex: report::describes(msetex),
            scripts_unknown: report::unknown(evalsha),
        },
    })
}

/// A new connection of lockgate's own to `config.addr`: connected,
/// authenticated with `upstream.username/password`, and named
/// [`INTERNAL_NAME`] so operators (and `CLIENT LIST`) can tell it from
/// client sessions.
pub(crate) async fn handshake(config: &NodeConfig) -> Result<Stream, String> {
    let mut stream = connect_authenticated(config).await?;
    let setname = encode::command(&[b"CLIENT", b"SETNAME", INTERNAL_NAME.as_bytes()]);
    request(&mut stream, &setname, config.connect_timeout).await?;
    Ok(stream)
}

/// A new connection to `config.addr`, authenticated when a password is
/// set; nothing else is sent (a sentinel may not take `CLIENT SETNAME`).
pub(crate) async fn connect_authenticated(config: &NodeConfig) -> Result<Stream, String> {
    let mut stream = config
        .connector
        .connect(&config.addr, config.connect_timeout)
        .await
        .map_err(|e| e.to_string())?;
    if !config.password.is_empty() {
        let mut args: Vec<&[u8]> = vec![b"AUTH"];
        if !config.username.is_empty() {
            args.push(config.username.as_bytes());
        }
        args.push(config.password.as_bytes());
        let reply = request(&mut stream, &encode::command(&args), config.connect_timeout).await?;
        if reply.first() == Some(&b'-') {
            return Err(String::from_utf8_lossy(&reply).trim().to_string());
        }
    }
    Ok(stream)
}

/// Reads whole replies off a connection of lockgate's own, one at a time.
pub(crate) struct FrameReader {
    buf: BytesMut,
    scanner: ReplyScanner,
    pos: usize,
}

impl FrameReader {
    /// A reader at the start of a connection's replies.
    pub(crate) fn new() -> FrameReader {
        FrameReader {
            buf: BytesMut::with_capacity(4096),
            scanner: ReplyScanner::new(),
            pos: 0,
        }
    }

    /// The next complete top-level frame (reply or push), as its bytes.
    pub(crate) async fn next(
        &mut self,
        stream: &mut (impl AsyncRead + Unpin),
    ) -> Result<BytesMut, String> {
        loop {
            loop {
                let (used, end) = self
                    .scanner
                    .advance(&self.buf[self.pos..])
                    .map_err(|e| e.to_string())?;
                self.pos += used;
                if end.is_some() {
                    let frame = self.buf.split_to(self.pos);
                    self.pos = 0;
                    return Ok(frame);
                }
                if used == 0 {
                    break;
                }
            }
            if stream
                .read_buf(&mut self.buf)
                .await
                .map_err(|e| e.to_string())?
                == 0
            {
                return Err("connection closed".to_string());
            }
        }
    }
}

/// One request/reply exchange on a fresh connection (before pipelining).
pub(crate) async fn request(
    stream: &mut (impl AsyncRead + AsyncWrite + Unpin),
    command: &[u8],
    timeout: Duration,
) -> Result<Vec<u8>, String> {
    let mut replies = requests(stream, command, 1, timeout).await?;
    Ok(replies.pop().map(|f| f.to_vec()).unwrap_or_default())
}

/// `n` commands, `commands` in one write, and their `n` replies in order,
/// all within `timeout`: one round trip where [`request`] takes `n`.
async fn requests(
    stream: &mut (impl AsyncRead + AsyncWrite + Unpin),
    commands: &[u8],
    n: usize,
    timeout: Duration,
) -> Result<Vec<BytesMut>, String> {
    let io = async {
        stream
            .write_all(commands)
            .await
            .map_err(|e| e.to_string())?;
        stream.flush().await.map_err(|e| e.to_string())?;
        let mut reader = FrameReader::new();
        let mut replies = Vec::with_capacity(n);
        for _ in 0..n {
            replies.push(reader.next(stream).await?);
        }
        Ok(replies)
    };
    tokio::time::timeout(timeout, io)
        .await
        .unwrap_or_else(|_| Err("timed out".to_string()))
}
