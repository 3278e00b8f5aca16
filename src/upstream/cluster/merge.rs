//! Commands that go to several nodes and make one reply: a command split
//! per slot ([`crate::cluster::split`]), a keyspace-wide one sent to every
//! primary ([`crate::cluster::fanout`]), and `SCAN`'s walk over the
//! primaries ([`crate::cluster::scan`]). The session's write side sends
//! the parts over the nodes' shared lanes itself, in its order (so a
//! command after a split one on the same node runs after it); a task of
//! the merge's own waits for every reply (redirections followed there)
//! and answers the session's place in the order with the merged reply
//! (RESP2: lockgate speaks RESP2 to the nodes and its clients in front of
//! a cluster).

use bytes::{Bytes, BytesMut};
use tokio::sync::oneshot;

use super::lane::Part;
use crate::cluster::fanout::Fanout;
use crate::cluster::map::SlotMap;
use crate::cluster::scan::{next_cursor, place};
use crate::cluster::split::Split;
use crate::protocol::encode::{self, LocalReply};

/// Every reply of `rx`, redirected ones where they stood.
pub(super) fn flatten(
    rx: oneshot::Receiver<Vec<Part>>,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Vec<Bytes>> + Send>> {
    Box::pin(async move {
        let mut out = Vec::new();
        match rx.await {
            Ok(parts) => {
                for part in parts {
                    match part {
                        Part::Reply(b) => out.push(b),
                        Part::Run(run) => out.extend(run.replies()),
                        Part::Later(rx) => out.extend(flatten(rx).await),
                    }
                }
            }
            Err(_) => out.push(gone()),
        }
        out
    })
}

/// The reply standing for one whose lane ended before answering.
pub(super) fn gone() -> Bytes {
    super::lane::error_line("the connection to the cluster node ended (shutting down)")
}

/// The one reply of `rx`.
async fn one(rx: oneshot::Receiver<Vec<Part>>) -> Bytes {
    flatten(rx).await.into_iter().next().unwrap_or_else(gone)
}

/// The error when no map is in force.
pub(super) fn no_map() -> LocalReply {
    LocalReply::Error(Bytes::from_static(
        b"CLUSTERDOWN lockgate: the cluster's slot map could not be read yet",
    ))
}

/// The error for a slot no node serves.
pub(super) fn unserved() -> LocalReply {
    LocalReply::Error(Bytes::from_static(b"CLUSTERDOWN Hash slot not served"))
}

/// Where each part of a split command goes: its node's address and the
/// part, in [`Split::parts`] order; or the error for a slot no node
/// serves.
pub(super) fn split_plan(map: &SlotMap, split: &Split) -> Result<Vec<(String, Bytes)>, LocalReply> {
    (split.parts.iter())
        .map(|part| match map.shard_of_slot(part.slot) {
            Some(shard) => Ok((shard.primary.clone(), part.command.clone())),
            None => Err(unserved()),
        })
        .collect()
}

/// The client's reply to a split command, from its parts' replies.
pub(super) async fn split_reply(
    split: Split,
    parts: Vec<oneshot::Receiver<Vec<Part>>>,
    resp3: bool,
) -> Bytes {
    let replies = futures_util::future::join_all(parts.into_iter().map(one)).await;
    let replies: Vec<LocalReply> = replies.iter().map(|b| parse(b)).collect();
    encode_as(&split.merge(&replies), resp3)
}

/// The primaries of `map`, in address order (the fan-out's and `SCAN`'s
/// walk).
pub(super) fn primaries(map: &SlotMap) -> Vec<String> {
    let mut all: Vec<String> = map.shards().iter().map(|s| s.primary.clone()).collect();
    all.sort();
    all
}

/// The client's reply to a keyspace-wide command, from every primary's.
pub(super) async fn fanout_reply(
    how: Fanout,
    parts: Vec<oneshot::Receiver<Vec<Part>>>,
    resp3: bool,
) -> Bytes {
    let replies = futures_util::future::join_all(parts.into_iter().map(one)).await;
    encode_as(
        &how.merge(replies.iter().map(|b| parse(b)).collect()),
        resp3,
    )
}

/// Where `SCAN cursor [options]` (`args`) goes: the primary its cursor
/// names (its place in `primaries`) and the command with that primary's
/// own cursor; or the client's error.
pub(super) fn scan_plan(args: &[&[u8]], primaries: &[String]) -> Result<(usize, Bytes), Bytes> {
    let invalid = || encode_as(&LocalReply::err("invalid cursor"), false);
    let cursor = args
        .get(1)
        .and_then(|c| std::str::from_utf8(c).ok()?.parse::<u64>().ok())
        .ok_or_else(invalid)?;
    let at = place(cursor, primaries.len()).ok_or_else(invalid)?;
    let inner = at.cursor.to_string();
    let mut sent: Vec<&[u8]> = args.to_vec();
    sent[1] = inner.as_bytes();
    Ok((at.primary, encode::command(&sent)))
}

/// The client's reply to `SCAN` from the reply of the primary at `at` of
/// `primaries`: its cursor rewritten to say where the walk is.
pub(super) async fn scan_reply(
    rx: oneshot::Receiver<Vec<Part>>,
    at: usize,
    primaries: usize,
    resp3: bool,
) -> Bytes {
    let reply = one(rx).await;
    let LocalReply::Array(mut items) = parse(&reply) else {
        // An error (a bad option): the node's own words.
        return reply;
    };
    let next = match items.first() {
        Some(LocalReply::Bulk(c)) => std::str::from_utf8(c).ok().and_then(|c| c.parse().ok()),
        _ => None,
    };
    let Some(next) = next.and_then(|c| next_cursor(at, c, primaries)) else {
        return encode_as(
            &LocalReply::err(
                "lockgate: a node's SCAN reply could not be carried (cursor too large, or not a SCAN reply)",
            ),
            resp3,
        );
    };
    items[0] = LocalReply::Bulk(Bytes::from(next.to_string()));
    encode_as(&LocalReply::Array(items), resp3)
}

/// `reply` in RESP3 or RESP2.
pub(super) fn encode_as(reply: &LocalReply, resp3: bool) -> Bytes {
    let mut out = BytesMut::new();
    reply.encode(resp3, &mut out);
    out.freeze()
}

/// A node's RESP2 reply as a [`LocalReply`]: arrays, bulk strings, nulls,
/// integers and errors read; a status kept as it came.
pub(super) fn parse(reply: &[u8]) -> LocalReply {
    use redis_protocol::resp2::types::OwnedFrame;
    fn local(frame: OwnedFrame) -> LocalReply {
        match frame {
            OwnedFrame::Null => LocalReply::Null,
            OwnedFrame::Integer(n) => LocalReply::Integer(n),
            OwnedFrame::BulkString(b) => LocalReply::Bulk(Bytes::from(b)),
            OwnedFrame::Error(e) => LocalReply::Error(Bytes::from(e.into_bytes())),
            OwnedFrame::SimpleString(s) => {
                let mut out = b"+".to_vec();
                out.extend_from_slice(&s);
                out.extend_from_slice(b"\r\n");
                LocalReply::Raw(Bytes::from(out))
            }
            OwnedFrame::Array(items) => LocalReply::Array(items.into_iter().map(local).collect()),
        }
    }
    match redis_protocol::resp2::decode::decode(reply) {
        Ok(Some((frame, _))) => local(frame),
        _ => LocalReply::Raw(Bytes::copy_from_slice(reply)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_replies_read_back_as_they_encode() {
        for reply in [
            &b"*3\r\n$1\r\na\r\n$-1\r\n:4\r\n"[..],
            b"-ERR no\r\n",
            b"+OK\r\n",
            b"*2\r\n$1\r\n0\r\n*0\r\n",
            b"$-1\r\n",
        ] {
            assert_eq!(
                encode_as(&parse(reply), false),
                Bytes::copy_from_slice(reply)
            );
        }
        assert_eq!(parse(b":7\r\n"), LocalReply::Integer(7));
    }
}
