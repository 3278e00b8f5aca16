//! What the lock room's view follows besides lock commands: commands
//! lockgate forwards as they are that change lock keys behind its back
//! (`FLUSHDB`, `FLUSHALL`, `SWAPDB`, `RENAME`, `RENAMENX`, `COPY`, `MOVE`)
//! or Redis's script cache (`SCRIPT FLUSH`). The router names what such a
//! command changes ([`Forget`]); once Redis acknowledges it, the lock room
//! drops what it knew ([`LockService::forget`]), so the next attempt on an
//! affected key asks Redis instead of being answered from a stale view.
//! And which database a lock command ran in ([`Database`]): the contention
//! table describes database 0 only, keyed by key alone.
//!
//! A client script may change lock keys it does not name among its keys:
//! one that lists keys (`KEYS` or `SCAN` in its body, [`lists_keys`]) is
//! taken to, and drops the whole view once it ran, as a flush does.
//! python-redis-lock's `reset_all` deletes every `lock:*` so, and its
//! waiters then retry at once. Its body is read when sent (`EVAL`) or loaded
//! (`SCRIPT LOAD`, then `EVALSHA`: [`ListingScripts`] keeps which SHA1s list).
//!
//! Dropping is always safe: the view is a hint, and an attempt it does not
//! answer goes to Redis. What changes lock keys without passing through this
//! instance (other clients straight on Redis, other lockgate instances, a
//! lease running out) stays bounded by `locks.retry.probe_interval_ms`.

use std::collections::HashSet;
use std::sync::Mutex;

use bytes::Bytes;

use super::LockService;
use crate::metrics::ProxyMetrics;

/// What a forwarded command changed behind the lock room's back, to drop
/// once Redis acknowledged it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Forget {
    /// These lock keys: a value left them or arrived at them (`RENAME`,
    /// `RENAMENX`, `COPY`, `MOVE`, of a lock key or onto one).
    Keys(Vec<Bytes>),
    /// Every key of a database (`FLUSHDB`, `FLUSHALL`, `SWAPDB`): the
    /// whole view, whatever database the client selected (`SELECT` as
    /// sent may not be the database Redis kept, and a drop costs only one
    /// attempt per key going to Redis).
    Database,
    /// Redis's script cache (`SCRIPT FLUSH`): every connection loads the
    /// lock scripts again before its next `EVALSHA`.
    Scripts,
    /// The `EXEC` of a transaction that queued any of the above: all of
    /// them (a transaction's commands run at its `EXEC`, and which keys
    /// they named is not kept).
    Everything,
}

/// Where a lock command ran, as far as the contention table
/// ([`super::storm`]) is concerned. The table is keyed by key alone and
/// describes lock keys in database 0: where lockgate's own connection
/// acquires for parked attempts, and where the quorum's masters keep them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Database {
    /// Database 0: the table learns the command's outcome, and a release
    /// may hand the lock to an attempt parked here.
    #[default]
    Zero,
    /// Another database (`SELECT n`), or one lockgate could not read: the
    /// table learns nothing from it and a release there hands nothing over
    /// (an attempt parked on the key waits in database 0). A release still
    /// drops what the table knew of the key: never wrong, and right when
    /// the `SELECT` was refused and the command ran in database 0 after
    /// all.
    Other,
}

impl Database {
    /// The database a session has selected (`u64::MAX`: unreadable).
    pub fn of(selected: u64) -> Database {
        match selected {
            0 => Database::Zero,
            _ => Database::Other,
        }
    }
}

/// True when `frame` is an error reply (RESP2 `-`, RESP3 `!`): the
/// command was refused and changed nothing.
pub fn is_error(frame: &[u8]) -> bool {
    matches!(frame.first(), Some(b'-' | b'!'))
}

/// Most SHA1s of key-listing scripts remembered: past it, an `EVALSHA` of
/// another such script is not known to list keys (counted in
/// `lock_listing_scripts_full`), and what it changes is noticed within
/// `locks.retry.probe_interval_ms`, as any change behind lockgate's back.
pub const MAX_LISTING_SCRIPTS: usize = 256;

/// True when the Lua `body` calls `KEYS` or `SCAN` (`redis.call('keys', …)`,
/// `redis.pcall("SCAN", …)`, any case, spaces allowed around the
/// parenthesis): it may reach keys it was not given.
pub fn lists_keys(body: &[u8]) -> bool {
    let mut from = 0;
    while let Some(at) = memchr::memmem::find(&body[from..], b"call") {
        from += at + 4;
        let rest = &body[from..];
        let rest = &rest[rest.iter().take_while(|b| b.is_ascii_whitespace()).count()..];
        let Some(rest) = rest.strip_prefix(b"(") else {
            continue;
        };
        let rest = &rest[rest.iter().take_while(|b| b.is_ascii_whitespace()).count()..];
        let Some((&quote, name)) = rest.split_first() else {
            continue;
        };
        if quote != b'\'' && quote != b'"' {
            continue;
        }
        let name = &name[..name.iter().position(|&b| b == quote).unwrap_or(name.len())];
        if name.eq_ignore_ascii_case(b"keys") || name.eq_ignore_ascii_case(b"scan") {
            return true;
        }
    }
    false
}

/// The SHA1s (lower-case hex) of the key-listing scripts clients loaded
/// with `SCRIPT LOAD` or sent with `EVAL`, so an `EVALSHA` of one is known
/// to list keys. At most [`MAX_LISTING_SCRIPTS`].
#[derive(Debug, Default)]
pub struct ListingScripts(Mutex<HashSet<String>>);

impl ListingScripts {
    /// Remembers `body` if it lists keys; false when it does and the set
    /// was full.
    pub fn seen(&self, body: &[u8]) -> bool {
        if !lists_keys(body) {
            return true;
        }
        let sha = sha1_smol::Sha1::from(body).digest().to_string();
        let mut set = crate::sync::lock(&self.0);
        if set.len() >= MAX_LISTING_SCRIPTS && !set.contains(&sha) {
            return false;
        }
        set.insert(sha);
        true
    }

    /// True when the script `sha` (as sent, any case) was seen listing keys.
    pub fn lists(&self, sha: &[u8]) -> bool {
        let sha = String::from_utf8_lossy(sha).to_ascii_lowercase();
        crate::sync::lock(&self.0).contains(&sha)
    }
}

impl LockService {
    /// True when the client script `args` (`EVAL body …` or
    /// `EVALSHA sha …`, any case) lists keys: it may change lock keys it
    /// does not name, so the router drops the whole view once it ran.
    pub(crate) fn script_lists_keys(&self, name: &[u8], body_or_sha: &[u8]) -> bool {
        if name.eq_ignore_ascii_case(b"EVAL") || name.eq_ignore_ascii_case(b"EVAL_RO") {
            lists_keys(body_or_sha)
        } else {
            self.listing_scripts.lists(body_or_sha)
        }
    }

    /// Drops what the lock room knew that `what` changed: Redis
    /// acknowledged a forwarded command (or, where no reply can be matched
    /// to it, the command was sent). Attempts parked on a dropped key are
    /// woken: their driver asks Redis, as after a release. Counted in
    /// `lock_view_forgets`.
    pub(crate) fn forget(&self, what: &Forget) {
        ProxyMetrics::inc(&self.metrics.view_forgets);
        match what {
            Forget::Keys(keys) => {
                for key in keys {
                    self.storm.released(key);
                }
            }
            Forget::Database => self.storm.forget_all(),
            Forget::Scripts => self.script_epoch.flushed(),
            Forget::Everything => {
                self.storm.forget_all();
                self.script_epoch.flushed();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::lock::storm::Admission;

    /// A key learned held for a minute is absorbed; once forgotten (by
    /// name, or with the whole database) the next attempt asks Redis.
    #[tokio::test]
    async fn a_forgotten_key_is_asked_again() {
        let locks = LockService::new(&Config::default());
        let anyone = locks.conn_locks().id;
        let learn_held = |key: &[u8]| {
            locks.storm.admit(key, 60_000, anyone);
            locks.storm.learn(key, false, 60_000);
            assert_eq!(locks.storm.admit(key, 60_000, anyone), Admission::Absorb);
        };
        learn_held(b"lock:a");
        learn_held(b"lock:b");
        locks.forget(&Forget::Keys(vec![Bytes::from_static(b"lock:a")]));
        assert_eq!(
            locks.storm.admit(b"lock:a", 60_000, anyone),
            Admission::Probe
        );
        assert_eq!(
            locks.storm.admit(b"lock:b", 60_000, anyone),
            Admission::Absorb
        );
        learn_held(b"lock:a");
        locks.forget(&Forget::Database);
        assert_eq!(
            locks.storm.admit(b"lock:a", 60_000, anyone),
            Admission::Probe
        );
        assert_eq!(
            locks.storm.admit(b"lock:b", 60_000, anyone),
            Admission::Probe
        );
        assert_eq!(ProxyMetrics::get(&locks.metrics.view_forgets), 2);
    }

    #[test]
    fn scripts_and_everything_move_the_script_epoch_on() {
        let locks = LockService::new(&Config::default());
        locks.forget(&Forget::Scripts);
        assert_eq!(locks.script_epoch.now(), 1);
        locks.forget(&Forget::Everything);
        assert_eq!(locks.script_epoch.now(), 2);
        locks.forget(&Forget::Database);
        assert_eq!(locks.script_epoch.now(), 2);
    }

    /// Which bodies list keys: `KEYS` or `SCAN` called, in any case and
    /// spacing, with either quote; a key or value that merely contains the
    /// word does not.
    #[test]
    fn scripts_that_list_keys() {
        let table: &[(&str, bool)] = &[
            ("return redis.call('KEYS', 'lock:*')", true),
            ("local l = redis.call(\"keys\", ARGV[1])", true),
            ("redis.pcall ( 'Scan', 0, 'match', 'lock:*')", true),
            // python-redis-lock's reset_all, as its source has it.
            ("local locks = redis.call('keys', 'lock:*')\nfor _, lock in pairs(locks) do redis.call('del', lock) end", true),
            ("return redis.call('del', KEYS[1])", false),
            ("return redis.call('get', 'keys')", false),
            ("redis.call('set', KEYS[1], 'scan')", false),
            ("return redis.call(ARGV[1], KEYS[1])", false),
            ("-- redis.call", false),
            ("call(", false),
            ("", false),
        ];
        for (body, lists) in table {
            assert_eq!(lists_keys(body.as_bytes()), *lists, "{body}");
        }
    }

    /// `EVAL` is read from its body; `EVALSHA` is known once its body was
    /// seen (any case of the SHA1), and the table of them is bounded.
    #[test]
    fn evalsha_of_a_listing_script_is_known_once_seen() {
        let locks = LockService::new(&Config::default());
        let body = b"return redis.call('keys', 'lock:*')";
        let sha = sha1_smol::Sha1::from(&body[..]).digest().to_string();
        assert!(locks.script_lists_keys(b"eval", body));
        assert!(locks.script_lists_keys(b"EVAL_RO", body));
        assert!(!locks.script_lists_keys(b"EVALSHA", sha.as_bytes()));
        locks.script_seen(body, true);
        assert!(locks.script_lists_keys(b"evalsha", sha.to_uppercase().as_bytes()));
        assert!(locks.script_lists_keys(b"EVALSHA_RO", sha.as_bytes()));
        assert!(!locks.script_lists_keys(b"EVAL", b"return 1"));
        for n in 0..MAX_LISTING_SCRIPTS {
            locks.script_seen(format!("return redis.call('keys', '{n}')").as_bytes(), true);
        }
        assert_eq!(ProxyMetrics::get(&locks.metrics.listing_scripts_full), 1);
        assert!(locks.script_lists_keys(b"EVALSHA", sha.as_bytes()));
    }

    #[test]
    fn errors_in_either_protocol_are_refusals() {
        assert!(is_error(b"-ERR no\r\n"));
        assert!(is_error(b"!3\r\nERR\r\n"));
        assert!(!is_error(b"+OK\r\n"));
        assert!(!is_error(b"*-1\r\n"));
        assert!(!is_error(b""));
    }
}
