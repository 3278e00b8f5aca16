//! Seeded randomness and numeric knobs for the fault tests, so a seed
//! printed by a failing run reproduces its schedule.

/// A `u64` from the environment variable `name`, or `default`; a value that
/// is not a number fails the test (a typo must not silently run defaults).
pub fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
        Err(_) => default,
    }
}

/// xorshift64: a fixed seed gives the same fault schedule.
#[derive(Debug, Clone)]
pub struct XorShift(u64);

impl XorShift {
    /// A generator for `seed` (any value, 0 included).
    pub fn new(seed: u64) -> XorShift {
        XorShift((seed ^ 0x9e37_79b9_7f4a_7c15) | 1)
    }

    /// The next raw value.
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    /// True one time in `n`.
    pub fn one_in(&mut self, n: u64) -> bool {
        self.next() % n.max(1) == 0
    }
}
