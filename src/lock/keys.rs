//! Lock-key patterns: which keys lockgate treats as locks. Patterns use
//! Redis `KEYS` glob syntax (`*`, `?`, `[abc]`, `[^a-z]`, `\` escapes), and
//! matching depends only on the key and the configured patterns, never on
//! what one proxy saw earlier, so every sidecar routes a key the same way.

/// The hasher of every table keyed by a client's key (lease, contention,
/// hot-key and unmatched-prefix tables): several lookups per lock command,
/// where SipHash cost more than the rest of the bookkeeping. Seeded at
/// random per process, so a client cannot choose colliding keys offline.
pub type KeyHasher = ahash::RandomState;

/// A compiled list of glob patterns.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyPatterns {
    patterns: Vec<Compiled>,
    /// `None` when some pattern is a glob or an empty literal.
    filter: Option<Prefilter>,
}

/// A byte-level test that rules a key out of every literal pattern at once:
/// a key can only match when its first byte starts an exact or prefix
/// literal, its last byte ends a suffix literal, or it holds the first two
/// bytes of a contained literal. Almost every key passing through is not a
/// lock key, so this is what most keys cost (one table lookup per byte).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Prefilter {
    firsts: ByteSet,
    lasts: ByteSet,
    singles: ByteSet,
    /// Bit `a * 256 + b`: a contained literal starts with bytes `a b`.
    pairs: Box<[u64; 1024]>,
    /// The distinct first bytes of those pairs (the defaults have one,
    /// `:`): with at most three, a key is searched for them with `memchr`
    /// instead of testing every pair of bytes in it.
    pair_starts: Vec<u8>,
}

/// A set of bytes as a 256-bit map.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct ByteSet([u64; 4]);

impl ByteSet {
    fn insert(&mut self, b: u8) {
        self.0[usize::from(b >> 6)] |= 1 << (b & 63);
    }

    fn has(&self, b: u8) -> bool {
        self.0[usize::from(b >> 6)] & (1 << (b & 63)) != 0
    }

    fn is_empty(&self) -> bool {
        self.0 == [0; 4]
    }
}

impl Prefilter {
    fn new(patterns: &[Compiled]) -> Option<Prefilter> {
        let mut f = Prefilter {
            firsts: ByteSet::default(),
            lasts: ByteSet::default(),
            singles: ByteSet::default(),
            pairs: Box::new([0; 1024]),
            pair_starts: Vec::new(),
        };
        for p in patterns {
            match p {
                Compiled::Exact(l) | Compiled::Prefix(l) => f.firsts.insert(*l.first()?),
                Compiled::Suffix(l) => f.lasts.insert(*l.last()?),
                Compiled::Contains(n) => match n.finder.needle() {
                    [] => return None,
                    [b] => f.singles.insert(*b),
                    [a, b, ..] => {
                        let bit = usize::from(*a) << 8 | usize::from(*b);
                        f.pairs[bit >> 6] |= 1 << (bit & 63);
                        if !f.pair_starts.contains(a) {
                            f.pair_starts.push(*a);
                        }
                    }
                },
                Compiled::Glob(_) => return None,
            }
        }
        Some(f)
    }

    fn may_match(&self, key: &[u8]) -> bool {
        let (Some(&first), Some(&last)) = (key.first(), key.last()) else {
            return false;
        };
        if self.firsts.has(first) || self.lasts.has(last) {
            return true;
        }
        if !self.singles.is_empty() && key.iter().any(|&b| self.singles.has(b)) {
            return true;
        }
        self.any_pair(key)
    }

    /// True when `key` (at least one byte) holds the first two bytes of a
    /// contained literal. With at most four distinct first bytes (the
    /// defaults have one, `:`), eight key bytes at a time are tested for
    /// them at once (SWAR), and only the positions found are looked up.
    fn any_pair(&self, key: &[u8]) -> bool {
        let pair_at = |i: usize| {
            let bit = usize::from(key[i]) << 8 | usize::from(key[i + 1]);
            self.pairs[bit >> 6] & (1 << (bit & 63)) != 0
        };
        // Where a pair may start: every byte but the last.
        let starts = key.len() - 1;
        if self.pair_starts.is_empty() {
            return false;
        }
        if self.pair_starts.len() > 4 {
            return (0..starts).any(pair_at);
        }
        const ONES: u64 = 0x0101_0101_0101_0101;
        const HIGHS: u64 = 0x8080_8080_8080_8080;
        if key.len() < 8 {
            return (0..starts).any(pair_at);
        }
        let mut at = 0;
        while at < starts {
            // Whole words only (one load, not a copy of a variable length):
            // the last one is the key's last eight bytes, overlapping the
            // word before, whose positions are masked off.
            let base = at.min(key.len() - 8);
            let w = word(&key[base..]);
            // The high bit of each byte of `w` equal to a start byte (and
            // maybe of a byte above one: every candidate is checked).
            let mut found = self.pair_starts.iter().fold(0, |m, &b| {
                let x = w ^ (u64::from(b) * ONES);
                m | (x.wrapping_sub(ONES) & !x & HIGHS)
            });
            found &= u64::MAX << ((at - base) * 8);
            while found != 0 {
                let i = base + (found.trailing_zeros() / 8) as usize;
                if i < starts && pair_at(i) {
                    return true;
                }
                found &= found - 1;
            }
            at = base + 8;
        }
        false
    }
}

/// The first eight bytes of `bytes` (at least eight long), little-endian.
fn word(bytes: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&bytes[..8]);
    u64::from_le_bytes(w)
}

/// A pattern in the cheapest form that matches exactly the same keys: the
/// usual `lock:*`, `*:lock` and `*:lock:*` need one comparison, not a glob
/// walk (this runs for every `SET` and `DEL` that passes through).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Compiled {
    Exact(Vec<u8>),
    Prefix(Vec<u8>),
    Suffix(Vec<u8>),
    Contains(Box<Needle>),
    Glob(Vec<u8>),
}

/// A substring searcher built once: `memmem::find` builds one per call,
/// which cost more than the search itself for a key of a few bytes.
#[derive(Debug, Clone)]
struct Needle {
    finder: memchr::memmem::Finder<'static>,
}

impl Needle {
    /// Keys shorter than this are searched with a plain loop: for a key of
    /// a few bytes the finder (Rabin-Karp there) and even `memchr` cost
    /// several times more.
    const SHORT: usize = 64;

    fn new(needle: &[u8]) -> Needle {
        Needle {
            finder: memchr::memmem::Finder::new(needle).into_owned(),
        }
    }

    fn is_in(&self, key: &[u8]) -> bool {
        let needle = self.finder.needle();
        let Some(&first) = needle.first() else {
            return true;
        };
        if key.len() >= Self::SHORT {
            return self.finder.find(key).is_some();
        }
        let Some(last_start) = key.len().checked_sub(needle.len()) else {
            return false;
        };
        (0..=last_start).any(|at| key[at] == first && key[at..].starts_with(needle))
    }
}

impl PartialEq for Needle {
    fn eq(&self, other: &Needle) -> bool {
        self.finder.needle() == other.finder.needle()
    }
}

impl Eq for Needle {}

impl Compiled {
    fn new(pattern: &[u8]) -> Compiled {
        let is_meta = |c: &u8| matches!(c, b'*' | b'?' | b'[' | b'\\');
        let literal = |s: &[u8]| !s.iter().any(is_meta);
        match pattern {
            [b'*', mid @ .., b'*'] if !mid.is_empty() && literal(mid) => {
                Compiled::Contains(Box::new(Needle::new(mid)))
            }
            [b'*', rest @ ..] if literal(rest) => Compiled::Suffix(rest.to_vec()),
            [rest @ .., b'*'] if literal(rest) => Compiled::Prefix(rest.to_vec()),
            _ if literal(pattern) => Compiled::Exact(pattern.to_vec()),
            _ => Compiled::Glob(pattern.to_vec()),
        }
    }

    // Every key of every SET and DEL meets every pattern, and almost none
    // match: one byte compared inline rejects most of them before a memcmp
    // call (callgrind: the 9 default patterns cost more than parsing the
    // request).
    fn matches(&self, key: &[u8]) -> bool {
        match self {
            Compiled::Exact(p) => key.first() == p.first() && key == p.as_slice(),
            Compiled::Prefix(p) => p.is_empty() || (key.first() == p.first() && key.starts_with(p)),
            Compiled::Suffix(p) => p.is_empty() || (key.last() == p.last() && key.ends_with(p)),
            Compiled::Contains(n) => n.is_in(key),
            Compiled::Glob(p) => glob_match(p, key),
        }
    }
}

impl KeyPatterns {
    /// The patterns, in configuration order.
    pub fn new<I, S>(patterns: I) -> KeyPatterns
    where
        I: IntoIterator<Item = S>,
        S: AsRef<[u8]>,
    {
        let patterns: Vec<Compiled> = patterns
            .into_iter()
            .map(|p| Compiled::new(p.as_ref()))
            .collect();
        KeyPatterns {
            filter: Prefilter::new(&patterns),
            patterns,
        }
    }

    /// Index of the first pattern matching `key`.
    pub fn find(&self, key: &[u8]) -> Option<usize> {
        if self.filter.as_ref().is_some_and(|f| !f.may_match(key)) {
            return None;
        }
        self.patterns.iter().position(|p| p.matches(key))
    }

    /// True when `key` is a lock key.
    pub fn matches(&self, key: &[u8]) -> bool {
        self.find(key).is_some()
    }
}

/// Redis-style glob match of `pattern` against `text`.
pub fn glob_match(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0usize, 0usize);
    // Where to resume after the last `*`: (pattern pos after it, text pos).
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        if p < pattern.len() {
            match pattern[p] {
                b'*' => {
                    while p < pattern.len() && pattern[p] == b'*' {
                        p += 1;
                    }
                    if p == pattern.len() {
                        return true;
                    }
                    star = Some((p, t));
                    continue;
                }
                b'?' => {
                    p += 1;
                    t += 1;
                    continue;
                }
                b'[' => {
                    if let Some((matched, next)) = class_match(pattern, p, text[t]) {
                        if matched {
                            p = next;
                            t += 1;
                            continue;
                        }
                    }
                }
                b'\\' if p + 1 < pattern.len() && pattern[p + 1] == text[t] => {
                    p += 2;
                    t += 1;
                    continue;
                }
                b'\\' if p + 1 < pattern.len() => {}
                c if c == text[t] => {
                    p += 1;
                    t += 1;
                    continue;
                }
                _ => {}
            }
        }
        match star {
            Some((sp, st)) => {
                p = sp;
                t = st + 1;
                star = Some((sp, st + 1));
            }
            None => return false,
        }
    }
    pattern[p..].iter().all(|&c| c == b'*')
}

/// Matches `c` against the class starting at `pattern[open] == b'['`.
/// Returns (matched, position after the class), or `None` if unclosed (then
/// Redis treats the class as running to the end of the pattern).
fn class_match(pattern: &[u8], open: usize, c: u8) -> Option<(bool, usize)> {
    let mut i = open + 1;
    let negate = pattern.get(i) == Some(&b'^');
    if negate {
        i += 1;
    }
    let mut matched = false;
    while i < pattern.len() && pattern[i] != b']' {
        if pattern[i] == b'\\' && i + 1 < pattern.len() {
            matched |= pattern[i + 1] == c;
            i += 2;
        } else if i + 2 < pattern.len() && pattern[i + 1] == b'-' && pattern[i + 2] != b']' {
            let (lo, hi) = (
                pattern[i].min(pattern[i + 2]),
                pattern[i].max(pattern[i + 2]),
            );
            matched |= (lo..=hi).contains(&c);
            i += 3;
        } else {
            matched |= pattern[i] == c;
            i += 1;
        }
    }
    let next = (i + 1).min(pattern.len());
    Some((matched != negate, next))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_like_redis() {
        let cases: &[(&str, &str, bool)] = &[
            ("lock:*", "lock:a", true),
            ("lock:*", "lock:", true),
            ("lock:*", "locks:a", false),
            ("*:lock", "order:7:lock", true),
            ("*:lock:*", "a:lock:b", true),
            ("*:lock:*", "a:lock", false),
            ("h?llo", "hello", true),
            ("h[ae]llo", "hallo", true),
            ("h[^e]llo", "hello", false),
            ("h[a-c]llo", "hbllo", true),
            ("a\\*b", "a*b", true),
            ("a\\*b", "axb", false),
            ("*a*b", "xxaxxb", true),
            ("*a*b", "xxaxxbc", false),
            ("", "", true),
            ("*", "", true),
        ];
        for (p, t, want) in cases {
            assert_eq!(glob_match(p.as_bytes(), t.as_bytes()), *want, "{p} ~ {t}");
        }
    }

    #[test]
    fn compiled_forms_agree_with_the_glob() {
        let patterns = [
            "lock:*", "*:lock", "*:lock:*", "lock", "*", "**", "a*b", "*\\*", "h?x*",
        ];
        // Repeated first bytes and keys on both sides of Needle::SHORT.
        let long_hit = format!("{}:lock:{}", ":lo".repeat(30), "y");
        let long_miss = ":loc".repeat(30);
        let keys = [
            "lock:a",
            "x:lock",
            "a:lock:b",
            "lock",
            "",
            "ab",
            "axb",
            "*",
            "a*",
            "hqx1",
            "lock:",
            "a::lock:b",
            ":l:lock:",
            ":lock",
            &long_hit,
            &long_miss,
        ];
        for p in patterns {
            let compiled = Compiled::new(p.as_bytes());
            for k in keys {
                assert_eq!(
                    compiled.matches(k.as_bytes()),
                    glob_match(p.as_bytes(), k.as_bytes()),
                    "{p} ~ {k}"
                );
            }
        }
    }

    #[test]
    fn first_matching_pattern_wins() {
        let k = KeyPatterns::new(["lock:*", "*:lock"]);
        assert_eq!(k.find(b"lock:x"), Some(0));
        assert_eq!(k.find(b"x:lock"), Some(1));
        assert_eq!(k.find(b"user:1:visits"), None);
    }

    #[test]
    fn the_prefilter_never_hides_a_match() {
        let defaults = crate::config::LocksConfig::default().keys;
        let defaults: Vec<&str> = defaults.iter().map(String::as_str).collect();
        let sets: [&[&str]; 8] = [
            &defaults,
            &["*x*", "a", "*:lock:*"],
            &["lock:*", "h?x*"],
            &["", "*:lock"],
            &["*ab*", "*cd*"],
            &["*ab*", "*cd*", "*ef*"],
            &["*ab*", "*cd*", "*ef*", "*gh*"],
            &["*ab*", "*cd*", "*ef*", "*gh*", "*:lock:*"],
        ];
        let keys = [
            "",
            "a",
            "x",
            "lock:1",
            "lock_1",
            "a:lock",
            "a_lock",
            "a:lock:b",
            "a:locks:b",
            "mutex:1",
            "b:mutex",
            "key:__rand_int__",
            "user:1:visits",
            ":lock",
            "lock",
            "hqx1",
            "ax",
            ":l:lock:x",
            "mutex",
            "a:lockx",
            "ab",
            "xxcd",
            "xefx",
            "a:gh",
            "gxh",
            "aab",
            "ccd:",
            "e",
            "0123456789ab",
            "01234567ab",
            "0123456ab",
            "xxxxxxxxxxxxxxxxxcd",
            "aaaaaaaaaaaaaaaaaaaa",
            "\u{1}\u{1}\u{1}\u{1}\u{1}\u{1}\u{1}ef",
            "aaaaaaaa:lock:bbbb",
            "key:000000012345",
            "user:0000000000001:lock:x",
        ];
        for set in sets {
            let k = KeyPatterns::new(set.iter().copied());
            for key in keys {
                let naive = set
                    .iter()
                    .position(|p| glob_match(p.as_bytes(), key.as_bytes()));
                assert_eq!(k.find(key.as_bytes()), naive, "{set:?} ~ {key}");
            }
        }
    }

    /// A contained literal is found at every position of keys of every
    /// length around the prefilter's 8-byte words (whole, overlapping
    /// last, and shorter than one).
    #[test]
    fn the_prefilter_finds_a_pair_at_every_position() {
        for set in [
            &["*ab*"][..],
            &["*ab*", "*:lock:*"],
            &["*ab*", "*cd*", "*ef*"],
        ] {
            let k = KeyPatterns::new(set.iter().copied());
            for len in 2..=26 {
                for at in 0..len - 1 {
                    let mut key = vec![b'a'; len];
                    key[at + 1] = b'b';
                    // Every other position holds `a` (a start byte) not
                    // followed by `b`: candidates that must be rejected.
                    assert_eq!(k.find(&key), Some(0), "{set:?} len {len} at {at}");
                    key[at + 1] = b'x';
                    assert_eq!(k.find(&key), None, "{set:?} len {len} without");
                }
            }
        }
    }
}
