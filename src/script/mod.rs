//! lockgate's own Lua, in one registry: every script it sends to Redis,
//! by name ([`Script`]), body ([`lua`]), SHA1 and the slots of its `ARGV`
//! ([`argv`]). The script path (`crate::lock::evalsha`: `EVALSHA` on a
//! client's connection), the transaction path (`crate::lock::txn`: the
//! same scripts carried out without Lua on a server that refuses them)
//! and the connection-need table
//! ([`crate::command::connection::needs_own_connection`], by
//! [`is_own_call`]) all read it here, so a script added is known to each.
//!
//! Pure: bodies are constants, SHA1s computed once.

use std::sync::OnceLock;

pub mod argv;
#[macro_use]
pub mod lua;
#[macro_use]
pub mod kinds;
pub mod qkinds;

pub use lua::*;

/// A script lockgate calls by name, body or SHA1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Script {
    /// [`lua::ACQUIRE`].
    Acquire,
    /// [`lua::RELEASE`].
    Release,
    /// [`lua::RELEASE_HANDOFF`].
    ReleaseHandoff,
    /// [`lua::EXTEND`].
    Extend,
    /// [`lua::TAKEOVER`].
    Takeover,
    /// [`lua::PASS`].
    Pass,
    /// [`lua::RELEASE_FAST`].
    ReleaseFast,
    /// [`lua::EXTEND_FAST`].
    ExtendFast,
    /// [`lua::GUARD`].
    Guard,
    /// [`lua::GUARD_TX`].
    GuardTx,
    /// [`lua::RENEW`].
    Renew,
    /// [`lua::RELEASE_TOKEN`].
    ReleaseToken,
    /// [`lua::FENCE_LOCK`].
    FenceLock,
    /// [`lua::FENCE_UNLOCK`].
    FenceUnlock,
    /// [`lua::FENCE_EXTEND`].
    FenceExtend,
    /// [`lua::ERROR`].
    Error,
    /// [`lua::RECONCILE`].
    Reconcile,
}

/// How many [`Script`]s there are.
pub const COUNT: usize = 17;

/// Every [`Script`], in the order of [`Script::index`].
pub const ALL: [Script; COUNT] = [
    Script::Acquire,
    Script::Release,
    Script::ReleaseHandoff,
    Script::Extend,
    Script::Takeover,
    Script::Pass,
    Script::ReleaseFast,
    Script::ExtendFast,
    Script::Guard,
    Script::GuardTx,
    Script::Renew,
    Script::ReleaseToken,
    Script::FenceLock,
    Script::FenceUnlock,
    Script::FenceExtend,
    Script::Error,
    Script::Reconcile,
];

/// Every script's Lua body, in [`ALL`]'s order: what the quorum's masters
/// load as each connection opens
/// ([`crate::upstream::node::NodeConfig::scripts`]).
pub static BODIES: [&str; COUNT] = {
    let mut bodies = [""; COUNT];
    let mut i = 0;
    while i < COUNT {
        bodies[i] = ALL[i].body();
        i += 1;
    }
    bodies
};

/// The scripts a transaction sends for an acquisition held after a
/// failover (`crate::lock::failover::held_answer`): "not acquired" as
/// `SETNX` (0) and as `SET … NX` (nil) answer it. Not [`Script`]s: never
/// called by SHA1, never carried out without Lua.
pub const HELD: [&str; 2] = ["return 0", "return false"];

impl Script {
    /// Every script lockgate calls.
    pub fn all() -> [Script; COUNT] {
        ALL
    }

    /// Its position in [`ALL`] (a bit in a per-connection set, say).
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The Lua body.
    pub const fn body(self) -> &'static str {
        match self {
            Script::Acquire => lua::ACQUIRE,
            Script::Release => lua::RELEASE,
            Script::ReleaseHandoff => lua::RELEASE_HANDOFF,
            Script::Extend => lua::EXTEND,
            Script::Takeover => lua::TAKEOVER,
            Script::Pass => lua::PASS,
            Script::ReleaseFast => lua::RELEASE_FAST,
            Script::ExtendFast => lua::EXTEND_FAST,
            Script::Guard => lua::GUARD,
            Script::GuardTx => lua::GUARD_TX,
            Script::Renew => lua::RENEW,
            Script::ReleaseToken => lua::RELEASE_TOKEN,
            Script::FenceLock => lua::FENCE_LOCK,
            Script::FenceUnlock => lua::FENCE_UNLOCK,
            Script::FenceExtend => lua::FENCE_EXTEND,
            Script::Error => lua::ERROR,
            Script::Reconcile => lua::RECONCILE,
        }
    }

    /// The body's SHA1 in lowercase hex, as Redis names it (computed once).
    pub fn sha(self) -> &'static str {
        static SHAS: OnceLock<[String; COUNT]> = OnceLock::new();
        let shas =
            SHAS.get_or_init(|| ALL.map(|s| sha1_smol::Sha1::from(s.body()).digest().to_string()));
        &shas[self.index()]
    }

    /// The script a call names: `first`, the argument after `EVALSHA`
    /// (`by_sha`, any case) or `EVAL`, is its SHA1 or its body. The
    /// lengths are compared first, so a client's script costs a few length
    /// checks.
    pub fn of(by_sha: bool, first: &[u8]) -> Option<Script> {
        if by_sha {
            if first.len() != 40 {
                return None;
            }
            return ALL
                .into_iter()
                .find(|s| s.sha().as_bytes().eq_ignore_ascii_case(first));
        }
        ALL.into_iter()
            .find(|s| s.body().len() == first.len() && s.body().as_bytes() == first)
    }
}

/// Whether a script call is one lockgate itself writes into a session's
/// stream: `EVALSHA` (`by_sha`) of one of its scripts' SHA1s, or `EVAL` of
/// one of their bodies or of [`HELD`]. Such calls are short, so in
/// `proxy.upstream = "shared"` they stay on the shared connection where a
/// client's own script moves its session. `first`: the argument after the
/// command's name. Pure.
pub fn is_own_call(by_sha: bool, first: &[u8]) -> bool {
    Script::of(by_sha, first).is_some()
        || (!by_sha && HELD.iter().any(|body| body.as_bytes() == first))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shas_are_redis_names_of_the_bodies() {
        let sha = sha1_smol::Sha1::from(lua::ACQUIRE).digest().to_string();
        assert_eq!(Script::Acquire.sha(), sha);
        assert_eq!(Script::Takeover.sha().len(), 40);
        assert_ne!(Script::Release.sha(), Script::ReleaseHandoff.sha());
        // What the masters load is every script, each once.
        assert_eq!(BODIES, Script::all().map(Script::body));
        for (i, s) in ALL.iter().enumerate() {
            assert_eq!(s.index(), i);
        }
    }

    #[test]
    fn every_script_is_known_by_body_and_by_sha_and_bodies_differ() {
        for s in Script::all() {
            assert_eq!(Script::of(true, s.sha().as_bytes()), Some(s));
            assert_eq!(Script::of(true, s.sha().to_uppercase().as_bytes()), Some(s));
            assert_eq!(Script::of(false, s.body().as_bytes()), Some(s));
        }
        let mut shas: Vec<_> = ALL.iter().map(|s| s.sha()).collect();
        shas.sort();
        shas.dedup();
        assert_eq!(shas.len(), COUNT, "two scripts with one body");
    }

    #[test]
    fn own_calls_are_told_by_sha_and_by_body() {
        for s in Script::all() {
            assert!(is_own_call(true, s.sha().as_bytes()), "{s:?}");
            assert!(
                is_own_call(true, s.sha().to_uppercase().as_bytes()),
                "{s:?}"
            );
            assert!(is_own_call(false, s.body().as_bytes()), "{s:?}");
            // A body is no SHA, a SHA no body.
            assert!(!is_own_call(true, s.body().as_bytes()), "{s:?}");
            assert!(!is_own_call(false, s.sha().as_bytes()), "{s:?}");
        }
        assert!(is_own_call(false, lua::ERROR.as_bytes()));
        assert!(is_own_call(false, b"return 0"));
        assert!(is_own_call(false, b"return false"));
        let held = sha1_smol::Sha1::from("return 0").digest().to_string();
        assert!(!is_own_call(true, held.as_bytes()));
        let client = sha1_smol::Sha1::from("return 1").digest().to_string();
        assert!(!is_own_call(true, client.as_bytes()));
        assert!(!is_own_call(false, b"return 1"));
        let mut almost = lua::ACQUIRE.as_bytes().to_vec();
        almost[0] ^= 1;
        assert!(!is_own_call(false, &almost));
    }
}
