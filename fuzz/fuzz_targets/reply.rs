//! `protocol::reply::ReplyScanner` over a reply stream cut at random points.
//!
//! The first input byte seeds the cuts and picks the reference decoder
//! (`redis-protocol`'s RESP2 or RESP3 `decode`); the rest is the stream
//! Redis sends. Checked:
//! - `advance` never reports more bytes used than it was given, and the
//!   frame lengths it reports add up to the bytes it consumed;
//! - cut anywhere, the scanner reports the same frames and the same error as
//!   when the stream arrives whole;
//! - on valid input (what the decoder decodes, in the canonical form Redis
//!   writes: it re-encodes to the same bytes, and no line element holds CR
//!   or LF) every frame ends where the decoder's frame ends. The scanner
//!   reports an attribute as a frame of its own; the decoder folds it into
//!   the frame it annotates, so their lengths are added up first;
//! - `simple_frames` (the writer's pass over a run of plain replies) takes
//!   exactly the frames the scanner reports first, all replies, and never
//!   more than it is allowed.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lockgate::protocol::reply::{simple_frames, FrameKind, ReplyScanner};
use lockgate::protocol::ProtocolError;
use redis_protocol::resp2::types::{OwnedFrame as Frame2, Resp2Frame};
use redis_protocol::resp3::types::{OwnedFrame as Frame3, Resp3Frame};

type Scan = (Vec<(FrameKind, u64)>, Option<ProtocolError>);

/// Feeds `data` to a scanner in pieces cut by `cuts` (None: whole).
fn scan(data: &[u8], mut cuts: Option<u64>) -> Scan {
    let mut s = ReplyScanner::new();
    let mut frames = Vec::new();
    let mut pending: Vec<u8> = Vec::new();
    let mut fed = 0;
    let mut since_frame = 0u64;
    while fed < data.len() {
        let take = match cuts.as_mut() {
            None => data.len(),
            Some(seed) => {
                *seed ^= *seed << 13;
                *seed ^= *seed >> 7;
                *seed ^= *seed << 17;
                1 + (*seed % 23) as usize
            }
        };
        let next = (fed + take).min(data.len());
        pending.extend_from_slice(&data[fed..next]);
        fed = next;
        loop {
            match s.advance(&pending) {
                Err(e) => return (frames, Some(e)),
                Ok((used, end)) => {
                    assert!(used <= pending.len(), "used {used} of {}", pending.len());
                    pending.drain(..used);
                    since_frame += used as u64;
                    match end {
                        Some(e) => {
                            assert_eq!(e.len, since_frame, "frame length vs bytes consumed");
                            since_frame = 0;
                            assert!(s.at_boundary(), "a frame ended mid-frame");
                            frames.push((e.kind, e.len));
                        }
                        None => break,
                    }
                }
            }
        }
    }
    (frames, None)
}

/// The attributes the decoder folded into a frame.
fn attributes(f: &Frame3) -> Option<&redis_protocol::resp3::types::OwnedAttributes> {
    match f {
        Frame3::BlobString { attributes, .. }
        | Frame3::BlobError { attributes, .. }
        | Frame3::SimpleString { attributes, .. }
        | Frame3::SimpleError { attributes, .. }
        | Frame3::Boolean { attributes, .. }
        | Frame3::Number { attributes, .. }
        | Frame3::Double { attributes, .. }
        | Frame3::BigNumber { attributes, .. }
        | Frame3::VerbatimString { attributes, .. }
        | Frame3::Array { attributes, .. }
        | Frame3::Map { attributes, .. }
        | Frame3::Set { attributes, .. }
        | Frame3::Push { attributes, .. } => attributes.as_ref(),
        Frame3::Null | Frame3::Hello { .. } | Frame3::ChunkedString(_) => None,
    }
}

/// True when no line element of the frame (or of its attributes) holds CR
/// or LF: Redis never writes one; `redis-protocol` reads a line up to CRLF
/// and accepts a bare LF inside it.
fn clean3(f: &Frame3) -> bool {
    let line_ok = |d: &[u8]| !d.contains(&b'\r') && !d.contains(&b'\n');
    let attrs_ok = attributes(f).is_none_or(|m| m.iter().all(|(k, v)| clean3(k) && clean3(v)));
    attrs_ok
        && match f {
            Frame3::SimpleString { data, .. } | Frame3::BigNumber { data, .. } => line_ok(data),
            Frame3::SimpleError { data, .. } => line_ok(data.as_bytes()),
            Frame3::Array { data, .. } | Frame3::Push { data, .. } => data.iter().all(clean3),
            Frame3::Set { data, .. } => data.iter().all(clean3),
            Frame3::Map { data, .. } => data.iter().all(|(k, v)| clean3(k) && clean3(v)),
            Frame3::Hello { .. } | Frame3::ChunkedString(_) => false,
            _ => true,
        }
}

fn clean2(f: &Frame2) -> bool {
    let line_ok = |d: &[u8]| !d.contains(&b'\r') && !d.contains(&b'\n');
    match f {
        Frame2::SimpleString(d) => line_ok(d),
        Frame2::Error(d) => line_ok(d.as_bytes()),
        Frame2::Array(a) => a.iter().all(clean2),
        _ => true,
    }
}

/// The frame ends `redis-protocol` finds in the canonical, valid prefix of
/// `data`.
fn reference(data: &[u8], resp3: bool) -> Vec<u64> {
    let mut ends = Vec::new();
    let mut at = 0;
    while at < data.len() {
        let rest = &data[at..];
        let len = if resp3 {
            let Ok(Some((frame, len))) = redis_protocol::resp3::decode::complete::decode(rest)
            else {
                break;
            };
            if !clean3(&frame) {
                break;
            }
            let mut buf = vec![0; frame.encode_len(false)];
            match redis_protocol::resp3::encode::complete::encode(&mut buf, &frame, false) {
                Ok(n) if buf[..n] == rest[..len] => len,
                _ => break,
            }
        } else {
            let Ok(Some((frame, len))) = redis_protocol::resp2::decode::decode(rest) else {
                break;
            };
            if !clean2(&frame) {
                break;
            }
            let mut buf = vec![0; frame.encode_len(false)];
            match redis_protocol::resp2::encode::encode(&mut buf, &frame, false) {
                Ok(n) if buf[..n] == rest[..len] => len,
                _ => break,
            }
        };
        ends.push(len as u64);
        at += len;
    }
    ends
}

fuzz_target!(|input: &[u8]| {
    let Some((&selector, data)) = input.split_first() else {
        return;
    };
    let whole = scan(data, None);
    let cut = scan(data, Some(u64::from(selector) | 0x5851_f42d_0000_0000));
    assert_eq!(whole, cut, "whole vs cut");

    let (used, n) = simple_frames(data, usize::MAX);
    assert!(n <= whole.0.len(), "simple_frames took {n} frames, the scanner {}", whole.0.len());
    let taken = &whole.0[..n];
    assert!(taken.iter().all(|f| f.0 == FrameKind::Reply), "simple_frames took a non-reply");
    assert_eq!(used as u64, taken.iter().map(|f| f.1).sum::<u64>(), "simple_frames' bytes");
    let max = usize::from(selector >> 5);
    let (used_max, n_max) = simple_frames(data, max);
    assert_eq!(n_max, n.min(max), "simple_frames past its limit");
    assert_eq!(used_max as u64, taken[..n_max].iter().map(|f| f.1).sum::<u64>());

    // Attributes folded into the frame they annotate, as the decoder does.
    let mut lengths = Vec::new();
    let mut carried = 0;
    for &(kind, len) in &whole.0 {
        if kind == FrameKind::Attribute {
            carried += len;
        } else {
            lengths.push(carried + len);
            carried = 0;
        }
    }
    let want = reference(data, selector & 1 == 1);
    let n = want.len().min(lengths.len());
    assert_eq!(lengths[..n], want[..n], "frame ends vs redis-protocol");
    if want.len() > lengths.len() {
        // The decoder framed more than the scanner reported: the scanner
        // must have stopped on an error, or on a trailing attribute.
        panic!(
            "redis-protocol frames {} replies, the scanner {} ({:?})",
            want.len(),
            lengths.len(),
            whole.1
        );
    }
});
