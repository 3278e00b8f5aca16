//! Which of Redis Cluster's 16 384 hash slots a key belongs to, as Redis
//! computes it (`keyHashSlot` in Redis's `cluster.c`): CRC16 (XMODEM) of
//! the key modulo 16 384, or of its hash tag, the part between the first
//! `{` and the first `}` after it, when that part is not empty. Keys that
//! share a tag share a slot, which is how a lock key and lockgate's own
//! keys for it (`lockgate:owner:{key}`) land on the same node.

use crc::{Crc, Table, CRC_16_XMODEM};

/// Hash slots in a cluster.
pub const SLOTS: u16 = 16_384;

// Slice-by-16 tables (8 KiB, built at compile time): every command routed
// hashes its key, and byte-at-a-time CRC16 of a 16-byte key was most of
// the router's time (`perf` at `-P 16`, 4.8 % of lockgate's CPU).
const CRC16: Crc<u16, Table<16>> = Crc::<u16, Table<16>>::new(&CRC_16_XMODEM);

/// The part of `key` its slot is computed from: its hash tag when it has
/// a non-empty one, else the whole key.
pub fn hashed_part(key: &[u8]) -> &[u8] {
    let Some(open) = memchr::memchr(b'{', key) else {
        return key;
    };
    match memchr::memchr(b'}', &key[open + 1..]) {
        Some(len) if len > 0 => &key[open + 1..open + 1 + len],
        _ => key,
    }
}

/// The hash slot of `key`, 0 to 16 383.
pub fn key_slot(key: &[u8]) -> u16 {
    CRC16.checksum(hashed_part(key)) & (SLOTS - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Slots as `CLUSTER KEYSLOT` gives them (Redis 7.0), and the hash tag
    /// rules of the cluster specification.
    #[test]
    fn slots_are_redis_clusters() {
        for (key, slot) in [
            (&b"foo"[..], 12_182),
            (b"bar", 5_061),
            (b"123456789", 12_739),
            (b"", 0),
            (b"{user1000}.following", 3_443),
            (b"{user1000}.followers", 3_443),
            (b"user1000", 3_443),
            // Only the first `{` counts, up to the first `}` after it.
            (b"foo{}{bar}", 8_363),
            (b"foo{{bar}}zap", 4_015),
            (b"foo{bar}{zap}", 5_061),
            (b"{bar", 4_015),
        ] {
            assert_eq!(key_slot(key), slot, "{}", String::from_utf8_lossy(key));
        }
        assert_eq!(hashed_part(b"lockgate:owner:{lock:a}"), b"lock:a");
        assert_eq!(hashed_part(b"x{}y"), b"x{}y");
    }
}
