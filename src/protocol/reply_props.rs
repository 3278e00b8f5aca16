//! Property test: the reply scanner finds the same frame boundaries as
//! `redis-protocol`'s decoder, on seeded random RESP2 and RESP3 frames
//! encoded by `redis-protocol` itself and cut at every byte boundary.
//!
//! The scanner reports a RESP3 attribute as a frame of its own (it is not a
//! reply to a command); `redis-protocol` folds it into the frame it
//! annotates. So an attribute's length is added to the frame after it
//! before the two are compared.

use redis_protocol::resp2::types::{OwnedFrame as Frame2, Resp2Frame};
use redis_protocol::resp3::types::{OwnedFrame as Frame3, Resp3Frame, VerbatimStringFormat};

use super::reply::{simple_frames, FrameKind, ReplyScanner};

/// Cases per protocol; each is cut at every byte boundary.
const CASES: u64 = 300;

/// xorshift64*: seeded, so a failure names a case that can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn bytes(&mut self) -> Vec<u8> {
        // Payloads may hold CR, LF and '$': a scanner that looked inside
        // a bulk payload would be caught.
        const ALPHABET: &[u8] = b"ab\r\n$*:+-_%~>|0123456789";
        let len = match self.below(4) {
            0 => 0,
            1 => self.below(4),
            2 => self.below(40),
            _ => 200 + self.below(600),
        };
        (0..len)
            .map(|_| ALPHABET[self.below(ALPHABET.len() as u64) as usize])
            .collect()
    }
    fn line(&mut self) -> Vec<u8> {
        self.bytes()
            .into_iter()
            .filter(|b| *b != b'\r' && *b != b'\n')
            .collect()
    }
}

fn gen2(rng: &mut Rng, depth: u32) -> Frame2 {
    let pick = if depth == 0 {
        rng.below(5)
    } else {
        rng.below(7)
    };
    match pick {
        0 => Frame2::SimpleString(rng.line()),
        1 => Frame2::Error(String::from_utf8_lossy(&rng.line()).into_owned()),
        2 => Frame2::Integer(rng.next() as i64),
        3 => Frame2::BulkString(rng.bytes()),
        4 => Frame2::Null,
        _ => Frame2::Array((0..rng.below(5)).map(|_| gen2(rng, depth - 1)).collect()),
    }
}

fn attrs(rng: &mut Rng, depth: u32) -> Option<redis_protocol::resp3::types::OwnedAttributes> {
    if depth == 0 || rng.below(8) != 0 {
        return None;
    }
    let mut map = redis_protocol::resp3::types::OwnedAttributes::default();
    for i in 0..=rng.below(2) {
        let key = Frame3::BlobString {
            data: format!("k{i}").into_bytes(),
            attributes: None,
        };
        map.insert(key, gen3(rng, depth - 1));
    }
    Some(map)
}

fn gen3(rng: &mut Rng, depth: u32) -> Frame3 {
    let pick = if depth == 0 {
        rng.below(10)
    } else {
        rng.below(14)
    };
    let attributes = attrs(rng, depth);
    let data = |rng: &mut Rng, depth: u32| -> Vec<Frame3> {
        (0..rng.below(4)).map(|_| gen3(rng, depth - 1)).collect()
    };
    match pick {
        0 => Frame3::BlobString {
            data: rng.bytes(),
            attributes,
        },
        1 => Frame3::BlobError {
            data: rng.bytes(),
            attributes,
        },
        2 => Frame3::SimpleString {
            data: rng.line(),
            attributes,
        },
        3 => Frame3::SimpleError {
            data: String::from_utf8_lossy(&rng.line()).into_owned(),
            attributes,
        },
        4 => Frame3::Boolean {
            data: rng.below(2) == 0,
            attributes,
        },
        5 => Frame3::Null,
        6 => Frame3::Number {
            data: rng.next() as i64,
            attributes,
        },
        7 => Frame3::Double {
            data: rng.below(1_000_000) as f64 / 7.0,
            attributes,
        },
        8 => Frame3::BigNumber {
            data: rng.below(u64::MAX).to_string().into_bytes(),
            attributes,
        },
        9 => Frame3::VerbatimString {
            data: rng.bytes(),
            format: VerbatimStringFormat::Text,
            attributes,
        },
        10 => Frame3::Array {
            data: data(rng, depth),
            attributes,
        },
        11 => Frame3::Push {
            data: data(rng, depth),
            attributes,
        },
        12 => {
            let mut map = redis_protocol::resp3::types::FrameMap::default();
            for (i, v) in data(rng, depth).into_iter().enumerate() {
                map.insert(
                    Frame3::Number {
                        data: i as i64,
                        attributes: None,
                    },
                    v,
                );
            }
            Frame3::Map {
                data: map,
                attributes,
            }
        }
        _ => {
            let mut set = redis_protocol::resp3::types::FrameSet::default();
            for i in 0..rng.below(4) {
                set.insert(Frame3::Number {
                    data: i as i64,
                    attributes: None,
                });
            }
            Frame3::Set {
                data: set,
                attributes,
            }
        }
    }
}

/// The scanner's frames over `input` fed as `input[..cut]` then the rest,
/// an attribute's length added to the frame after it; with each frame's
/// kind (push or not).
fn scan(input: &[u8], cut: usize) -> Vec<(bool, u64)> {
    let mut s = ReplyScanner::new();
    let mut out = Vec::new();
    let mut carried = 0;
    let mut pending: Vec<u8> = Vec::new();
    for piece in [&input[..cut], &input[cut..]] {
        pending.extend_from_slice(piece);
        loop {
            let (used, end) = s
                .advance(&pending)
                .unwrap_or_else(|e| panic!("cut {cut}: {e}"));
            pending.drain(..used);
            match end {
                Some(e) if e.kind == FrameKind::Attribute => carried += e.len,
                Some(e) => {
                    out.push((e.kind == FrameKind::Push, e.len + carried));
                    carried = 0;
                }
                None => break,
            }
        }
    }
    assert!(
        pending.is_empty() && s.at_boundary(),
        "cut {cut}: frame left open"
    );
    out
}

/// Checks the scanner against the encoded frames at every cut of their
/// concatenation, and `redis-protocol`'s decoder against the same bytes.
fn agree(case: u64, frames: &[(bool, Vec<u8>)], decode: impl Fn(&[u8]) -> Option<(bool, usize)>) {
    let input: Vec<u8> = frames.iter().flat_map(|(_, b)| b.clone()).collect();
    let want: Vec<(bool, u64)> = frames.iter().map(|(p, b)| (*p, b.len() as u64)).collect();
    let mut at = 0;
    for (push, len) in &want {
        assert_eq!(
            decode(&input[at..]),
            Some((*push, *len as usize)),
            "case {case}: decoder"
        );
        at += *len as usize;
    }
    for cut in 0..=input.len() {
        assert_eq!(scan(&input, cut), want, "case {case}, cut {cut}");
        // The writer's pass over plain replies, on what has come so far:
        // whole frames the scanner reports too, none of them a push.
        let (used, n) = simple_frames(&input[..cut], usize::MAX);
        let taken = &want[..n.min(want.len())];
        assert_eq!(taken.len(), n, "case {case}, cut {cut}: simple_frames");
        assert!(taken.iter().all(|f| !f.0), "case {case}, cut {cut}: a push");
        let bytes: u64 = taken.iter().map(|f| f.1).sum();
        assert_eq!(used as u64, bytes, "case {case}, cut {cut}: simple_frames");
    }
}

#[test]
fn scanner_agrees_with_redis_protocol_on_resp2() {
    let mut rng = Rng(0x5eed_0002);
    for case in 0..CASES {
        let frames: Vec<(bool, Vec<u8>)> = (0..1 + rng.below(3))
            .map(|_| {
                let frame = gen2(&mut rng, 3);
                let mut buf = vec![0; frame.encode_len(false)];
                let n =
                    redis_protocol::resp2::encode::encode(&mut buf, &frame, false).expect("encode");
                buf.truncate(n);
                (false, buf)
            })
            .collect();
        agree(case, &frames, |b| {
            redis_protocol::resp2::decode::decode(b)
                .expect("decode")
                .map(|(_, n)| (false, n))
        });
    }
}

#[test]
fn scanner_agrees_with_redis_protocol_on_resp3() {
    let mut rng = Rng(0x5eed_0003);
    for case in 0..CASES {
        let frames: Vec<(bool, Vec<u8>)> = (0..1 + rng.below(3))
            .map(|_| {
                let frame = gen3(&mut rng, 3);
                let push = matches!(frame, Frame3::Push { .. });
                let mut buf = vec![0; frame.encode_len(false)];
                let n = redis_protocol::resp3::encode::complete::encode(&mut buf, &frame, false)
                    .expect("encode");
                buf.truncate(n);
                (push, buf)
            })
            .collect();
        agree(case, &frames, |b| {
            redis_protocol::resp3::decode::complete::decode(b)
                .expect("decode")
                .map(|(f, n)| (matches!(f, Frame3::Push { .. }), n))
        });
    }
}
