//! The tests' seeded randomness, so a seed printed by a failing run
//! replays its workload or fault schedule. Two generators, because the
//! seeds already recorded for each kind of test must keep meaning the same
//! run: [`Rng`] (xorshift64*) drives traffic and payloads, [`XorShift`]
//! (xorshift64) the fault tests' schedules.

/// A deterministic xorshift64* generator, so two runs of a workload send the
/// same bytes.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from a non-zero seed.
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    /// The next 64 pseudo-random bits.
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// Fills `out` with pseudo-random bytes.
    pub fn fill(&mut self, out: &mut [u8]) {
        for chunk in out.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

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
    /// A generator for `seed` (any value, 0 included). The seed goes
    /// through splitmix64's mixer first: neighbouring seeds (1, 2, 3…)
    /// start far apart, and distinct seeds start apart (forcing the low bit
    /// on, as a bare `| 1` did, made seeds 2k and 2k + 1 one schedule).
    pub fn new(seed: u64) -> XorShift {
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        // xorshift never leaves 0; the mixer is a bijection, so one seed
        // in 2^64 lands there and takes another seed's start.
        XorShift(if z == 0 { 0x9e37_79b9_7f4a_7c15 } else { z })
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
