//! Tests of the hot-key sketch: its bounds under a storm of one-off keys,
//! the Space-Saving guarantees, the histogram and the stored key form.

use super::*;
use std::sync::Arc;
use std::time::Duration;

use super::sketch::MsHistogram;

const HOT: [&[u8]; 3] = [b"lock:hot:a", b"lock:hot:b", b"lock:hot:c"];

/// 100k one-off keys with the 3 hot keys' 2,000 attempts each spread
/// evenly among them. Checks the bound after every record.
fn storm(hk: &HotKeys) -> Duration {
    let start = Instant::now();
    for i in 0..100_000u32 {
        hk.record(format!("lock:cold:{i}").as_bytes(), Event::Attempt);
        if i % 50 == 0 {
            for h in HOT {
                hk.record(h, Event::Attempt);
            }
        }
        assert!(hk.len() <= hk.capacity());
    }
    start.elapsed()
}

#[test]
fn capacity_is_ten_per_k_with_a_floor() {
    assert_eq!(HotKeys::new(0).capacity(), 64);
    assert_eq!(HotKeys::new(3).capacity(), 64);
    assert_eq!(HotKeys::new(20).capacity(), 200);
    assert_eq!(HotKeys::new(usize::MAX).capacity(), MAX_CAPACITY);
}

#[test]
fn three_hot_keys_among_100k_cold_ones_come_first() {
    for k in [3, 20] {
        let hk = HotKeys::new(k);
        let took = storm(&hk);
        eprintln!(
            "k={k} capacity={}: 106,000 records in {took:?} ({:.0} ns each, \
             incl. formatting the key and the len check)",
            hk.capacity(),
            took.as_nanos() as f64 / 106_000.0
        );
        assert_eq!(hk.len(), hk.capacity());
        assert_eq!(hk.total(), 106_000);
        let top = hk.top(3);
        let mut keys: Vec<&[u8]> = top.iter().map(|h| &h.key[..]).collect();
        keys.sort();
        assert_eq!(keys, HOT.to_vec(), "top(3) = {top:?}");
        let bound = hk.total() / hk.capacity() as u64;
        for h in &top {
            // Space-Saving: count - error <= true count <= count.
            assert!(h.count >= 2_000, "{h:?}");
            assert!(h.count - h.error <= 2_000, "{h:?}");
            assert!(h.error <= bound, "{h:?}");
            assert!(h.attempts <= 2_000);
        }
        // Sorted by count, and the cold keys trail the hot ones.
        let all = hk.top(usize::MAX);
        assert_eq!(all.len(), hk.capacity());
        assert!(all.windows(2).all(|w| w[0].count >= w[1].count));
        assert!(all[3..].iter().all(|h| h.count <= bound + 1));
        assert!(all.iter().all(|h| h.error <= bound));
    }
}

#[test]
fn exact_below_capacity_and_ties_by_key() {
    let hk = HotKeys::new(1);
    assert!(hk.is_empty());
    assert!(hk.top(5).is_empty());
    for _ in 0..5 {
        hk.record(b"b", Event::Attempt);
        hk.record(b"a", Event::Absorbed);
    }
    hk.record(b"c", Event::Attempt);
    hk.record(b"a", Event::Acquired);
    hk.record(b"a", Event::Parked);
    hk.record(b"a", Event::Released { held_ms: 42 });
    // Events that carry no hotness do not admit a key.
    hk.record(b"zzz", Event::Acquired);
    hk.record(b"zzz", Event::Waited { wait_ms: 3 });
    assert_eq!(hk.len(), 3);
    let top = hk.top(2);
    assert_eq!(top.len(), 2);
    assert_eq!(&top[0].key[..], b"a");
    assert_eq!(&top[1].key[..], b"b");
    let a = &top[0];
    assert_eq!((a.count, a.error, a.attempts), (5, 0, 5));
    assert_eq!((a.absorbed, a.acquired, a.parked), (5, 1, 1));
    assert_eq!(a.hold_ms_last, Some(42));
    assert_eq!(a.wait_p99_ms, None);
    // Fewer than a second since first seen: divided by one second.
    assert!((a.rate_per_sec - 5.0).abs() < 1e-9);
    assert_eq!(top[1].absorbed, 0);
    assert_eq!(top[1].hold_ms_last, None);
    assert_eq!(hk.top(0).len(), 0);
    assert_eq!(hk.top(10).len(), 3);
}

#[test]
fn replacement_inherits_the_minimum_as_error() {
    let hk = HotKeys::new(0);
    for i in 0..64u32 {
        for _ in 0..=i {
            hk.record(format!("k{i:02}").as_bytes(), Event::Attempt);
        }
    }
    // k00 has the minimum (1): the newcomer takes its slot with error 1.
    hk.record(b"new", Event::Attempt);
    assert_eq!(hk.len(), 64);
    let all = hk.top(64);
    assert!(all.iter().all(|h| &h.key[..] != b"k00"));
    let new = all.iter().find(|h| &h.key[..] == b"new");
    let new = new.map(|h| (h.count, h.error, h.attempts));
    assert_eq!(new, Some((2, 1, 1)));
    // Next the newcomer ties with k01 at 2; one of them goes.
    hk.record(b"newer", Event::Attempt);
    let all = hk.top(64);
    let gone = [&b"new"[..], b"k01"]
        .iter()
        .filter(|k| !all.iter().any(|h| &h.key[..] == **k))
        .count();
    assert_eq!(gone, 1);
    let newer = all.iter().find(|h| &h.key[..] == b"newer");
    assert_eq!(newer.map(|h| (h.count, h.error)), Some((3, 2)));
}

#[test]
fn wait_p99_is_close_for_known_distributions() {
    let hk = HotKeys::new(1);
    hk.record(b"uniform", Event::Attempt);
    hk.record(b"tail", Event::Attempt);
    hk.record(b"mostly_fast", Event::Attempt);
    hk.record(b"huge", Event::Attempt);
    // Uniform 0..=999 ms: true p99 (nearest rank) is 989.
    for ms in 0..1_000 {
        hk.record(b"uniform", Event::Waited { wait_ms: ms });
    }
    // 98% at 5 ms, 2% at 300 ms: p99 is 300.
    for i in 0..1_000 {
        let wait_ms = if i % 50 == 0 || i % 50 == 1 { 300 } else { 5 };
        hk.record(b"tail", Event::Waited { wait_ms });
    }
    // 99.5% at 5 ms: p99 is 5 (bucket 4..=7).
    for i in 0..1_000 {
        let wait_ms = if i % 200 == 0 { 300 } else { 5 };
        hk.record(b"mostly_fast", Event::Waited { wait_ms });
    }
    // Beyond the last bucket: capped by the longest wait.
    for _ in 0..10 {
        hk.record(b"huge", Event::Waited { wait_ms: 60_000 });
    }
    let p99 = |key: &[u8]| {
        hk.top(10)
            .into_iter()
            .find(|h| &h.key[..] == key)
            .and_then(|h| h.wait_p99_ms)
    };
    let uniform = p99(b"uniform").unwrap_or(0);
    assert!((989..=2 * 989).contains(&uniform), "{uniform}");
    assert_eq!(p99(b"tail"), Some(300));
    assert_eq!(p99(b"mostly_fast"), Some(7));
    assert_eq!(p99(b"huge"), Some(60_000));
}

#[test]
fn histogram_buckets_and_halving() {
    assert_eq!(MsHistogram::bucket(0), 0);
    assert_eq!(MsHistogram::bucket(1), 1);
    assert_eq!(MsHistogram::bucket(3), 2);
    assert_eq!(MsHistogram::bucket(4), 3);
    assert_eq!(MsHistogram::bucket(16_383), 14);
    assert_eq!(MsHistogram::bucket(16_384), 15);
    assert_eq!(MsHistogram::bucket(u64::MAX), 15);
    for i in 1..WAIT_BUCKETS - 1 {
        assert_eq!(MsHistogram::bucket(MsHistogram::upper(i)), i);
        assert_eq!(MsHistogram::bucket(MsHistogram::upper(i) + 1), i + 1);
    }
    let mut h = MsHistogram::default();
    h.buckets[3] = u32::MAX;
    h.buckets[9] = 1_000;
    h.add(5);
    assert_eq!(h.buckets[3], u32::MAX / 2 + 1);
    assert_eq!(h.buckets[9], 500);
}

#[test]
fn long_keys_are_shortened_and_stay_distinct() {
    let hk = HotKeys::new(1);
    let a = vec![b'x'; 10_000];
    let mut b = a.clone();
    b[9_999] = b'y';
    hk.record(&a, Event::Attempt);
    hk.record(&a, Event::Attempt);
    hk.record(&b, Event::Attempt);
    let exact = vec![b'z'; MAX_KEY_BYTES];
    hk.record(&exact, Event::Attempt);
    let top = hk.top(3);
    assert_eq!(top.len(), 3);
    assert_eq!(top[0].count, 2);
    assert!(top.iter().all(|h| h.key.len() == MAX_KEY_BYTES));
    assert_ne!(top[0].key, top[1].key);
    assert!(top[0].key.starts_with(&a[..MAX_KEY_BYTES - 20]));
    assert!(top.iter().any(|h| h.key[..] == exact[..]));
}

#[test]
fn four_threads_share_one_sketch() {
    let hk = Arc::new(HotKeys::new(5));
    let threads: Vec<_> = (0..4u32)
        .map(|t| {
            let hk = Arc::clone(&hk);
            std::thread::spawn(move || {
                for i in 0..25_000u32 {
                    hk.record(format!("lock:{t}:{i}").as_bytes(), Event::Attempt);
                    if i % 25 == 0 {
                        hk.record(b"lock:shared", Event::Absorbed);
                        hk.record(b"lock:shared", Event::Waited { wait_ms: 10 });
                    }
                    if i % 1_000 == 0 {
                        assert!(hk.len() <= hk.capacity());
                        assert!(hk.top(5).len() <= 5);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        assert!(t.join().is_ok());
    }
    assert_eq!(hk.total(), 4 * 25_000 + 4 * 1_000);
    assert!(hk.len() <= hk.capacity());
    let top = hk.top(1);
    assert_eq!(top.len(), 1);
    let h = &top[0];
    assert_eq!(&h.key[..], b"lock:shared");
    assert!(h.count - h.error <= 4_000 && 4_000 <= h.count, "{h:?}");
    assert_eq!(h.wait_p99_ms, Some(10));
}

#[test]
fn shareable_between_tasks() {
    fn is_send_sync<T: Send + Sync>() {}
    is_send_sync::<HotKeys>();
}
