//! Command names folded to integers, so that classifying a command and
//! finding its metrics label are each one `match` on a `u128` instead of
//! comparisons of byte strings: this runs for every
//! request (callgrind, SET -P16: the two lookups by byte strings cost
//! about 110 instructions per request, mostly `memcmp` calls and the
//! linear search of the labels).

#[cfg(test)]
use super::LABELS;

/// A name folded: its bytes uppercased (ASCII), little-endian, and its
/// length in the top byte; 0 for an empty name or one longer than 15
/// bytes, which no known command has. Two names fold alike exactly when
/// they are equal but for ASCII case.
pub const fn key(name: &[u8]) -> u128 {
    if name.is_empty() || name.len() > 15 {
        return 0;
    }
    // Two 64-bit halves: cheaper to shift than one 128-bit value.
    let (mut low, mut high) = (0u64, 0u64);
    let mut i = 0;
    while i < name.len() {
        let byte = name[i].to_ascii_uppercase() as u64;
        if i < 8 {
            low |= byte << (8 * i);
        } else {
            high |= byte << (8 * (i - 8));
        }
        i += 1;
    }
    high |= (name.len() as u64) << 56;
    (high as u128) << 64 | low as u128
}

/// Named keys of commands, for `match`.
macro_rules! names {
    ($($name:ident),* $(,)?) => {
        $(pub const $name: u128 = key(stringify!($name).as_bytes());)*
    };
}

names!(
    MULTI,
    EXEC,
    DISCARD,
    HELLO,
    RESET,
    QUIT,
    SUBSCRIBE,
    PSUBSCRIBE,
    SSUBSCRIBE,
    UNSUBSCRIBE,
    PUNSUBSCRIBE,
    SUNSUBSCRIBE,
    MONITOR,
    SYNC,
    PSYNC,
    BLPOP,
    BRPOP,
    BRPOPLPUSH,
    BLMOVE,
    BLMPOP,
    BZPOPMIN,
    BZPOPMAX,
    BZMPOP,
    XREAD,
    XREADGROUP,
    WAIT,
    WAITAOF,
    SETNX,
    SET,
    GETSET,
    GETDEL,
    GETEX,
    DEL,
    UNLINK,
    EXPIRE,
    PEXPIRE,
    EXPIREAT,
    PEXPIREAT,
    PERSIST,
    LOCKGATE,
    SELECT,
    GET,
    TTL,
    PTTL,
    TYPE,
    EXISTS,
    EVAL,
    EVALSHA,
    EVAL_RO,
    EVALSHA_RO,
    SCRIPT,
    MGET,
    TOUCH,
    WATCH,
    RENAME,
    RENAMENX,
    COPY,
    MSET,
    MSETNX,
    CLIENT,
    FLUSHDB,
    FLUSHALL,
    SWAPDB,
    MOVE,
);

/// Index in [`LABELS`](super::LABELS) of the name folded to `key` (0, `other`, when it
/// has no label of its own). In the order of [`LABELS`](super::LABELS); the test below
/// holds the two together.
#[inline(always)]
pub fn label_of(folded: u128) -> usize {
    names!(
        INCR, DECR, HGET, HSET, HGETALL, LPUSH, RPUSH, LPOP, RPOP, SADD, ZADD, PUBLISH, PING, AUTH,
    );
    match folded {
        GET => 1,
        SET => 2,
        SETNX => 3,
        DEL => 4,
        UNLINK => 5,
        EXPIRE => 6,
        PEXPIRE => 7,
        TTL => 8,
        PTTL => 9,
        EXISTS => 10,
        GETSET => 11,
        INCR => 12,
        DECR => 13,
        MGET => 14,
        MSET => 15,
        HGET => 16,
        HSET => 17,
        HGETALL => 18,
        LPUSH => 19,
        RPUSH => 20,
        LPOP => 21,
        RPOP => 22,
        BLPOP => 23,
        BRPOP => 24,
        SADD => 25,
        ZADD => 26,
        PUBLISH => 27,
        SUBSCRIBE => 28,
        EVAL => 29,
        EVALSHA => 30,
        MULTI => 31,
        EXEC => 32,
        WATCH => 33,
        PING => 34,
        SELECT => 35,
        AUTH => 36,
        HELLO => 37,
        CLIENT => 38,
        LOCKGATE => 39,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_fold_case_and_keep_length() {
        assert_eq!(key(b"get"), key(b"GET"));
        assert_eq!(key(b"gEt"), GET);
        assert_ne!(key(b"GET"), key(b"GET\0"));
        assert_ne!(key(b"GETS"), GET);
        assert_eq!(key(b""), 0);
        assert_eq!(key(&[b'A'; 16]), 0);
        assert_ne!(key(&[b'A'; 15]), 0);
        // Only ASCII letters fold: `{` is not `[` uppercased.
        assert_ne!(key(b"{"), key(b"["));
    }

    #[test]
    fn every_label_is_found_by_its_name_in_any_case() {
        for (i, label) in LABELS.iter().enumerate() {
            assert_eq!(label_of(key(label.as_bytes())), i, "{label}");
            let upper = label.to_ascii_uppercase();
            assert_eq!(label_of(key(upper.as_bytes())), i, "{upper}");
        }
        assert_eq!(label_of(key(b"hgetallx")), 0);
        assert_eq!(label_of(0), 0);
    }
}
