//! Guard patterns (`[[locks.guards]]`): a lock-key pattern with named
//! parts (`lock:order:{id}`) and the data-key patterns it guards
//! (`order:{id}`, `order:{id}:*`). Pure: parsing, matching a data key
//! (with the named parts it binds), rendering the lock key from them, and
//! whether two data patterns could match one key.
//!
//! The syntax is small on purpose, so that matching is one left-to-right
//! scan and overlap is decidable:
//!
//! - `{name}` (letters, digits, `_`) is a named part: one or more bytes
//!   other than `:`, `{` and `}`.
//! - `{{` and `}}` are a literal `{` and `}` (a hash tag: `lock:{{{id}}}`
//!   names keys like `lock:{42}`).
//! - `*` (data patterns only, and only last) is any run of bytes.
//! - A named part is followed by the end, `*`, or a literal that starts
//!   with `:`, `{` or `}`: where it ends is then never a choice.
//! - Every other byte is itself.

use bytes::{BufMut, Bytes, BytesMut};

/// Why a guard pattern was refused: the text says what, for `--check`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PatternError(pub String);

/// One piece of a pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Atom {
    /// These bytes, exactly.
    Literal(Vec<u8>),
    /// A named part (its name).
    Named(String),
    /// Any run of bytes (last only).
    Star,
}

/// A parsed pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    /// The pattern as written (for messages and labels).
    pub text: String,
    atoms: Vec<Atom>,
}

/// The bytes a named part may not contain.
fn separator(b: u8) -> bool {
    matches!(b, b':' | b'{' | b'}')
}

impl Pattern {
    /// Parses `text`; `star`: whether a trailing `*` is allowed (data
    /// patterns).
    pub fn parse(text: &str, star: bool) -> Result<Pattern, PatternError> {
        let bad = |why: &str| PatternError(format!("`{text}`: {why}"));
        if text.is_empty() {
            return Err(bad("must not be empty"));
        }
        let b = text.as_bytes();
        let mut atoms: Vec<Atom> = Vec::new();
        let mut lit = Vec::new();
        let mut i = 0;
        while i < b.len() {
            match b[i] {
                b'{' if b.get(i + 1) == Some(&b'{') => {
                    lit.push(b'{');
                    i += 2;
                }
                b'}' if b.get(i + 1) == Some(&b'}') => {
                    lit.push(b'}');
                    i += 2;
                }
                b'{' => {
                    let end = (i + 1..b.len()).find(|&j| b[j] == b'}').ok_or_else(|| {
                        bad("a `{` opens a named part that never closes (write `{{` for a brace)")
                    })?;
                    let name = &text[i + 1..end];
                    if name.is_empty()
                        || !name.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_')
                    {
                        return Err(bad(&format!(
                            "`{{{name}}}` is not a named part (letters, digits and `_`; write `{{{{` for a brace)"
                        )));
                    }
                    if let Some(Atom::Named(_)) = atoms.last().filter(|_| lit.is_empty()) {
                        return Err(bad(
                            "two named parts side by side: where one ends would be a guess",
                        ));
                    }
                    if !lit.is_empty() {
                        atoms.push(Atom::Literal(std::mem::take(&mut lit)));
                    }
                    atoms.push(Atom::Named(name.to_string()));
                    i = end + 1;
                }
                b'}' => return Err(bad("a lone `}` (write `}}` for a brace)")),
                b'*' if star => {
                    if i + 1 != b.len() {
                        return Err(bad("`*` may only end a data pattern"));
                    }
                    if !lit.is_empty() {
                        atoms.push(Atom::Literal(std::mem::take(&mut lit)));
                    }
                    atoms.push(Atom::Star);
                    i += 1;
                }
                b'*' => return Err(bad("a lock pattern names one key: no `*`")),
                c => {
                    lit.push(c);
                    i += 1;
                }
            }
        }
        if !lit.is_empty() {
            atoms.push(Atom::Literal(lit));
        }
        // A named part ends where a separator begins: never a choice.
        for pair in atoms.windows(2) {
            if let [Atom::Named(n), Atom::Literal(l)] = pair {
                if !separator(l[0]) {
                    return Err(bad(&format!(
                        "`{{{n}}}` must be followed by `:`, a brace, `*` or the end (it stops at the first of those)"
                    )));
                }
            }
        }
        Ok(Pattern {
            text: text.to_string(),
            atoms,
        })
    }

    /// The names of its named parts, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.atoms.iter().filter_map(|a| match a {
            Atom::Named(n) => Some(n.as_str()),
            _ => None,
        })
    }

    /// Its hash tag, as Redis Cluster finds it in every key it matches:
    /// what lies between the first `{` and the next `}`, as a sequence of
    /// literal bytes and named parts (which hold no brace, so the tag is
    /// fixed by the pattern); `None` when a key's tag is not fixed by it
    /// (no tag, an empty one, or a `*` before its end).
    pub fn hash_tag(&self) -> Option<Vec<TagPiece>> {
        let mut pieces: Vec<TagPiece> = Vec::new();
        let mut open = false;
        for atom in &self.atoms {
            match atom {
                Atom::Star => return None,
                Atom::Named(n) if open => pieces.push(TagPiece::Named(n.clone())),
                Atom::Named(_) => {}
                Atom::Literal(l) => {
                    for &c in l {
                        match (open, c) {
                            (false, b'{') => open = true,
                            (true, b'}') => return (!pieces.is_empty()).then_some(pieces),
                            (true, c) => pieces.push(TagPiece::Byte(c)),
                            (false, _) => {}
                        }
                    }
                }
            }
        }
        None
    }

    /// The literal bytes it starts with (empty if it starts with a named
    /// part): a key without them cannot match.
    pub fn prefix(&self) -> &[u8] {
        match self.atoms.first() {
            Some(Atom::Literal(l)) => l,
            _ => &[],
        }
    }

    /// Whether `key` matches; the named parts it binds are pushed on
    /// `bound` as (name, value) in order.
    pub fn matches<'p, 'k>(&'p self, key: &'k [u8], bound: &mut Vec<(&'p str, &'k [u8])>) -> bool {
        let start = bound.len();
        let mut at = 0;
        for atom in &self.atoms {
            match atom {
                Atom::Literal(l) => {
                    if !key[at..].starts_with(l) {
                        bound.truncate(start);
                        return false;
                    }
                    at += l.len();
                }
                Atom::Named(n) => {
                    let len = key[at..].iter().take_while(|&&c| !separator(c)).count();
                    if len == 0 {
                        bound.truncate(start);
                        return false;
                    }
                    bound.push((n.as_str(), &key[at..at + len]));
                    at += len;
                }
                Atom::Star => return true,
            }
        }
        if at != key.len() {
            bound.truncate(start);
        }
        at == key.len()
    }

    /// The key this pattern names with `bound`'s values; `None` if a name
    /// is unbound.
    pub fn render(&self, bound: &[(&str, &[u8])]) -> Option<Bytes> {
        let mut out = BytesMut::new();
        for atom in &self.atoms {
            match atom {
                Atom::Literal(l) => out.put_slice(l),
                Atom::Named(n) => out.put_slice(bound.iter().find(|(k, _)| k == n)?.1),
                Atom::Star => return None,
            }
        }
        Some(out.freeze())
    }

    /// Whether some key matches both `self` and `other`: a search of the
    /// pair of patterns read side by side, over one byte of every kind
    /// that either treats apart (their literal bytes, the separators, and
    /// one byte neither names).
    pub fn overlaps(&self, other: &Pattern) -> bool {
        let (a, b) = (self.steps(), other.steps());
        let mut alphabet: Vec<u8> = b":{}".to_vec();
        for s in a.iter().chain(&b) {
            if let Step::Byte(c) = s {
                alphabet.push(*c);
            }
        }
        if let Some(free) = (b'a'..=b'z')
            .chain(b'0'..=b'9')
            .find(|c| !alphabet.contains(c))
        {
            alphabet.push(free);
        }
        alphabet.sort_unstable();
        alphabet.dedup();
        let mut seen = std::collections::HashSet::new();
        let mut todo = vec![(0usize, 0usize)];
        while let Some(state) = todo.pop() {
            if !seen.insert(state) {
                continue;
            }
            let (ea, eb) = (closure(&a, state.0), closure(&b, state.1));
            if ea.contains(&a.len()) && eb.contains(&b.len()) {
                return true;
            }
            for &c in &alphabet {
                for &i in &ea {
                    for &j in &eb {
                        if let (Some(ni), Some(nj)) = (consume(&a, i, c), consume(&b, j, c)) {
                            todo.push((ni, nj));
                        }
                    }
                }
            }
        }
        false
    }

    /// The atoms as single-byte steps.
    fn steps(&self) -> Vec<Step> {
        let mut steps = Vec::new();
        for atom in &self.atoms {
            match atom {
                Atom::Literal(l) => steps.extend(l.iter().map(|&c| Step::Byte(c))),
                // One byte of the class, then any number more.
                Atom::Named(_) => steps.extend([Step::Class, Step::ClassLoop]),
                Atom::Star => steps.push(Step::AnyLoop),
            }
        }
        steps
    }
}

/// A piece of a hash tag ([`Pattern::hash_tag`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TagPiece {
    /// A literal byte.
    Byte(u8),
    /// A named part.
    Named(String),
}

/// One position's test in [`Pattern::overlaps`]'s search.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Byte(u8),
    Class,
    ClassLoop,
    AnyLoop,
}

/// The positions reachable from `i` without reading a byte (past loops).
fn closure(steps: &[Step], mut i: usize) -> Vec<usize> {
    let mut out = vec![i];
    while i < steps.len() && matches!(steps[i], Step::ClassLoop | Step::AnyLoop) {
        i += 1;
        out.push(i);
    }
    out
}

/// Where reading `c` at position `i` leads, if anywhere.
fn consume(steps: &[Step], i: usize, c: u8) -> Option<usize> {
    match steps.get(i)? {
        Step::Byte(b) if *b == c => Some(i + 1),
        Step::Class if !separator(c) => Some(i + 1),
        Step::ClassLoop if !separator(c) => Some(i),
        Step::AnyLoop => Some(i),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(p: &str) -> Pattern {
        Pattern::parse(p, true).unwrap()
    }

    #[test]
    fn patterns_parse_or_say_why_not() {
        for (text, star, why) in [
            ("", true, "must not be empty"),
            ("order:{id", true, "never closes"),
            ("order:{i-d}", true, "is not a named part"),
            ("order:{}", true, "is not a named part"),
            ("a}b", true, "a lone `}`"),
            ("order:*:x", true, "may only end"),
            ("lock:*", false, "no `*`"),
            ("{a}{b}", true, "side by side"),
            ("{id}_x", true, "must be followed by"),
        ] {
            let e = Pattern::parse(text, star).unwrap_err();
            assert!(e.0.contains(why), "{text}: {e}");
        }
        let p = data("lock:{{{id}}}:{part}");
        assert_eq!(p.names().collect::<Vec<_>>(), ["id", "part"]);
        assert_eq!(p.prefix(), b"lock:{");
    }

    #[test]
    fn keys_match_bind_and_render() {
        let lock = Pattern::parse("lock:order:{id}", false).unwrap();
        for (pattern, key, want) in [
            ("order:{id}", "order:42", Some("lock:order:42")),
            ("order:{id}", "order:42:items", None),
            ("order:{id}:*", "order:42:items", Some("lock:order:42")),
            ("order:{id}:*", "order:42:", Some("lock:order:42")),
            ("order:{id}:*", "order:42", None),
            ("order:{id}", "order:", None),
            ("order:{id}", "orders:1", None),
            ("{id}:order", "7:order", Some("lock:order:7")),
            ("cart{{{id}}}", "cart{9}", Some("lock:order:9")),
        ] {
            let mut bound = Vec::new();
            let p = data(pattern);
            let hit = p.matches(key.as_bytes(), &mut bound);
            let got = hit.then(|| lock.render(&bound).unwrap());
            assert_eq!(got.as_deref(), want.map(str::as_bytes), "{pattern} {key}");
            if !hit {
                assert!(bound.is_empty(), "{pattern} {key}: nothing bound");
            }
        }
    }

    #[test]
    fn hash_tags_are_read_from_the_pattern() {
        let tag = |p: &str| data(p).hash_tag();
        let named = |n: &str| Some(vec![TagPiece::Named(n.to_string())]);
        assert_eq!(tag("lock:{{{id}}}"), named("id"));
        assert_eq!(tag("order:{{{id}}}:*"), named("id"));
        assert_eq!(tag("order:{id}"), None);
        assert_eq!(tag("order:{{}}:{id}"), None);
        assert_eq!(tag("a{{*"), None);
        assert_eq!(tag("a{{{id}"), None);
        assert_eq!(tag("o{{{id}}}"), tag("lock:{{{id}}}:x"));
        assert_eq!(
            tag("a{{x{id}}}"),
            Some(vec![
                TagPiece::Byte(b'x'),
                TagPiece::Named("id".to_string())
            ])
        );
    }

    #[test]
    fn overlaps_are_found_exactly() {
        for (a, b, want) in [
            ("order:{id}", "order:{id}:*", false),
            ("order:{id}", "order:*", true),
            ("order:{id}", "order:{x}", true),
            ("order:{id}", "order:1", true),
            ("order:{id}", "order:", false),
            ("order:{id}:*", "order:1:*", true),
            ("user:{u}", "order:{id}", false),
            ("{a}:x", "y:{b}", true),
            ("{a}:x", "y:z", false),
            ("*", "anything", true),
            ("a{{{id}}}", "a{{1}}", true),
            ("a{{{id}}}", "a{{:}}", false),
            // `{1}` is a named part, which holds no brace.
            ("a{{{id}}}", "a{1}", false),
        ] {
            assert_eq!(data(a).overlaps(&data(b)), want, "{a} ~ {b}");
            assert_eq!(data(b).overlaps(&data(a)), want, "{b} ~ {a}");
        }
    }
}
