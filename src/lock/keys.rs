//! Lock-key patterns: which keys lockgate treats as locks. Patterns use
//! Redis `KEYS` glob syntax (`*`, `?`, `[abc]`, `[^a-z]`, `\` escapes), and
//! matching depends only on the key and the configured patterns, never on
//! what one proxy saw earlier, so every sidecar routes a key the same way.

/// A compiled list of glob patterns.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyPatterns {
    patterns: Vec<Compiled>,
}

/// A pattern in the cheapest form that matches exactly the same keys: the
/// usual `lock:*`, `*:lock` and `*:lock:*` need one comparison, not a glob
/// walk (this runs for every `SET` and `DEL` that passes through).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Compiled {
    Exact(Vec<u8>),
    Prefix(Vec<u8>),
    Suffix(Vec<u8>),
    Contains(Vec<u8>),
    Glob(Vec<u8>),
}

impl Compiled {
    fn new(pattern: &[u8]) -> Compiled {
        let is_meta = |c: &u8| matches!(c, b'*' | b'?' | b'[' | b'\\');
        let literal = |s: &[u8]| !s.iter().any(is_meta);
        match pattern {
            [b'*', mid @ .., b'*'] if !mid.is_empty() && literal(mid) => {
                Compiled::Contains(mid.to_vec())
            }
            [b'*', rest @ ..] if literal(rest) => Compiled::Suffix(rest.to_vec()),
            [rest @ .., b'*'] if literal(rest) => Compiled::Prefix(rest.to_vec()),
            _ if literal(pattern) => Compiled::Exact(pattern.to_vec()),
            _ => Compiled::Glob(pattern.to_vec()),
        }
    }

    fn matches(&self, key: &[u8]) -> bool {
        match self {
            Compiled::Exact(p) => key == p.as_slice(),
            Compiled::Prefix(p) => key.starts_with(p),
            Compiled::Suffix(p) => key.ends_with(p),
            Compiled::Contains(p) => memchr::memmem::find(key, p).is_some(),
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
        KeyPatterns {
            patterns: patterns
                .into_iter()
                .map(|p| Compiled::new(p.as_ref()))
                .collect(),
        }
    }

    /// Index of the first pattern matching `key`.
    pub fn find(&self, key: &[u8]) -> Option<usize> {
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
        let keys = [
            "lock:a", "x:lock", "a:lock:b", "lock", "", "ab", "axb", "*", "a*", "hqx1", "lock:",
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
}
