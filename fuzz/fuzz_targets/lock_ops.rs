//! The lock command parser, `lock::ops`: `parse_set`, `parse_setnx` and
//! `keyed` on every request parsed from the input. Checked, besides "no
//! panic": what `parse_set` makes of `SET key value [options]` agrees with a
//! reference reading of the options that follows Redis's own
//! (`parseExtendedStringArgumentsOrReply` in t_string.c): options are
//! case-insensitive; NX and XX exclude each other; EX, PX, EXAT, PXAT and
//! KEEPTTL exclude each other but the same one may repeat (the last value
//! wins); an expiry option needs a value; anything else is a syntax error,
//! which lockgate leaves to Redis (None).
#![no_main]

use libfuzzer_sys::fuzz_target;
use lockgate::lock::ops::{keyed, parse_set, parse_setnx, LockOp, Shape, Ttl};
use lockgate::protocol::request::{RequestLimits, RequestParser};

/// Redis's reading of SET's options: `None` for a syntax error, else
/// (nx, get, expiry kind and value).
fn reference(args: &[&[u8]]) -> Option<(bool, bool, Option<(&'static str, Vec<u8>)>)> {
    if args.len() < 3 {
        return None;
    }
    let (mut nx, mut xx, mut get, mut keepttl) = (false, false, false, false);
    let mut ttl: Option<(&'static str, Vec<u8>)> = None;
    let mut i = 3;
    while i < args.len() {
        let opt = String::from_utf8_lossy(args[i]).to_ascii_uppercase();
        let next = args.get(i + 1);
        match opt.as_str() {
            "NX" if !xx => nx = true,
            "XX" if !nx => xx = true,
            "GET" => get = true,
            "KEEPTTL" if ttl.is_none() => keepttl = true,
            "EX" | "PX" | "EXAT" | "PXAT" if !keepttl && next.is_some() => {
                let kind = match opt.as_str() {
                    "EX" => "EX",
                    "PX" => "PX",
                    "EXAT" => "EXAT",
                    _ => "PXAT",
                };
                if ttl.as_ref().is_some_and(|(k, _)| *k != kind) {
                    return None;
                }
                ttl = Some((kind, next?.to_vec()));
                i += 1;
            }
            _ => return None,
        }
        i += 1;
    }
    Some((nx, get, ttl))
}

fn check_set(args: &[&[u8]]) {
    let got = parse_set(args);
    let want = reference(args);
    match (&got, &want) {
        (None, None) => {}
        (
            Some(LockOp::Acquire {
                key,
                value,
                ttl,
                shape,
            }),
            Some((true, get, want_ttl)),
        ) => {
            assert_eq!(&key[..], args[1]);
            assert_eq!(&value[..], args[2]);
            assert_eq!(*shape, if *get { Shape::SetGet } else { Shape::Set });
            match (ttl, want_ttl) {
                (Ttl::Default, None) => {}
                (Ttl::Given(k, v), Some((wk, wv))) => {
                    assert_eq!(k, wk);
                    assert_eq!(&v[..], &wv[..]);
                }
                other => panic!("ttl: {other:?}"),
            }
        }
        (
            Some(LockOp::Takeover {
                key,
                command,
                args: rest,
            }),
            Some((false, ..)),
        ) => {
            assert_eq!(*command, "SET");
            assert_eq!(&key[..], args[1]);
            assert_eq!(rest.len(), args.len() - 2);
            assert!(rest.iter().zip(&args[2..]).all(|(a, b)| &a[..] == *b));
        }
        _ => panic!("parse_set {got:?}, Redis reads {want:?}, args {args:?}"),
    }
}

fuzz_target!(|input: &[u8]| {
    let mut p = RequestParser::new(RequestLimits {
        max_bulk_bytes: 1 << 16,
        max_multibulk_len: 64,
        max_inline_bytes: 1 << 12,
        max_request_bytes: 1 << 18,
    });
    let mut at = 0;
    while let Ok(Some(req)) = p.parse(&input[at..]) {
        let buf = &input[at..];
        let args: Vec<&[u8]> = (0..p.argc()).map(|i| p.arg(buf, i)).collect();
        check_set(&args);
        match parse_setnx(&args) {
            Some(LockOp::Acquire {
                key,
                value,
                ttl: Ttl::Default,
                shape: Shape::SetNx,
            }) => {
                assert_eq!(args.len(), 3);
                assert_eq!((&key[..], &value[..]), (args[1], args[2]));
            }
            None => assert_ne!(args.len(), 3),
            other => panic!("parse_setnx: {other:?}"),
        }
        for extend in [false, true] {
            match keyed(&args, "EXPIRE", extend) {
                None => assert!(args.len() < 2),
                Some(
                    LockOp::Extend {
                        key, args: rest, ..
                    }
                    | LockOp::Takeover {
                        key, args: rest, ..
                    },
                ) => {
                    assert_eq!(&key[..], args[1]);
                    assert_eq!(rest.len(), args.len() - 2);
                }
                Some(other) => panic!("keyed: {other:?}"),
            }
        }
        at += req.len;
    }
});
