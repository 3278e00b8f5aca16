//! What a Redis node reports about itself: as each connection of
//! lockgate's own opens, `INFO server`'s `run_id` and uptime ([`Report`]);
//! then and at every periodic check, its eviction policy and
//! `evicted_keys` ([`Sample`]): `CONFIG GET maxmemory-policy`, else `INFO
//! memory`'s `maxmemory_policy`, and `INFO stats`' `evicted_keys`. Pure:
//! the replies in, the facts out; an error reply is an answer ("refused"),
//! never a failure. What the facts mean for locks is the lock room's
//! (`crate::lock::eviction`).

use std::time::Instant;

use bytes::Bytes;

use crate::protocol::encode;

/// What a node said about itself as a connection to it opened; handed to
/// the [`super::Observer`] of its [`super::NodeConfig`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// `INFO server`'s `run_id` (empty: not reported).
    pub run_id: String,
    /// When `INFO server` was read and its `uptime_in_seconds`.
    pub uptime: Option<(Instant, u64)>,
    /// Its eviction policy and `evicted_keys`.
    pub memory: Sample,
    /// It knows `MSETEX` (Valkey 9.1, Redis 8.4): `COMMAND INFO MSETEX`
    /// described it.
    pub msetex: bool,
    /// It does not know `EVALSHA` (renamed away: `COMMAND INFO EVALSHA`
    /// answered nil), so lock operations go as transactions
    /// (`crate::lock::txn`). An error (`COMMAND` refused) says nothing.
    pub scripts_unknown: bool,
}

/// `COMMAND INFO MSETEX`.
pub fn command_info_msetex() -> Bytes {
    encode::command(&[b"COMMAND", b"INFO", b"MSETEX"])
}

/// `COMMAND INFO EVALSHA`.
pub fn command_info_evalsha() -> Bytes {
    encode::command(&[b"COMMAND", b"INFO", b"EVALSHA"])
}

/// Whether `reply`, the reply to `COMMAND INFO` of one command, says the
/// command is unknown: an array of one nil (not an error: a refusal of
/// `COMMAND` says nothing of the command).
pub fn unknown(reply: &[u8]) -> bool {
    reply == b"*1\r\n*-1\r\n" || reply == b"*1\r\n$-1\r\n"
}

/// Whether `reply`, the reply to `COMMAND INFO` of one command, describes
/// it: an array of one description (`*1` then an array), not of one nil
/// (the command is unknown) nor an error (refused).
pub fn describes(reply: &[u8]) -> bool {
    reply
        .strip_prefix(b"*1\r\n*")
        .is_some_and(|rest| !rest.starts_with(b"-1") && !rest.starts_with(b"0\r\n"))
}

/// One reading of a node's eviction policy and `evicted_keys`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    /// The `maxmemory-policy` as Redis names it (`None`: neither source
    /// told it).
    pub policy: Option<String>,
    /// `INFO stats`' `evicted_keys`, when it answered.
    pub evicted_keys: Option<u64>,
    /// `CONFIG GET` was refused (renamed, an ACL, a managed Redis):
    /// later readings ask `INFO memory` instead.
    pub config_refused: bool,
    /// What `INFO replication` and `INFO persistence` said (`None`: not
    /// asked, or refused).
    pub safety: Option<Safety>,
}

/// What a node's `INFO replication` and `INFO persistence` say about how
/// safely it keeps locks across a crash and a failover.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Safety {
    /// `role:master`.
    pub master: bool,
    /// `connected_slaves`.
    pub replicas: u64,
    /// `min-replicas-to-write` is set (`INFO replication` shows
    /// `min_slaves_good_slaves` only then): a primary cut off from its
    /// replicas stops taking writes.
    pub min_replicas: bool,
    /// `aof_enabled:1`: an append-only file (a restart without it, on
    /// snapshots alone, loses the latest writes, a held lock among them).
    pub aof: bool,
}

impl Safety {
    /// The facts in the replies to `INFO replication` and `INFO
    /// persistence`; `None` when either is an error or lacks its fields.
    pub fn from_replies(replication: &[u8], persistence: &[u8]) -> Option<Safety> {
        let role = info_field(replication, "role")?;
        let replicas = info_field(replication, "connected_slaves")?.parse().ok()?;
        let aof = info_field(persistence, "aof_enabled")?;
        Some(Safety {
            master: role == "master",
            replicas,
            min_replicas: info_field(replication, "min_slaves_good_slaves").is_some(),
            aof: aof == "1",
        })
    }
}

/// `INFO replication`.
pub fn info_replication() -> Bytes {
    encode::command(&[b"INFO", b"replication"])
}

/// `INFO persistence`.
pub fn info_persistence() -> Bytes {
    encode::command(&[b"INFO", b"persistence"])
}

/// `CONFIG GET maxmemory-policy`.
pub fn config_get() -> Bytes {
    encode::command(&[b"CONFIG", b"GET", b"maxmemory-policy"])
}

/// `INFO memory`.
pub fn info_memory() -> Bytes {
    encode::command(&[b"INFO", b"memory"])
}

/// `INFO stats`.
pub fn info_stats() -> Bytes {
    encode::command(&[b"INFO", b"stats"])
}

impl Sample {
    /// What the replies say: `config` to `CONFIG GET maxmemory-policy`
    /// (`None`: not asked), `memory` to `INFO memory` (`None`: not asked),
    /// `stats` to `INFO stats`. CONFIG's answer wins when it has one.
    pub fn from_replies(config: Option<&[u8]>, memory: Option<&[u8]>, stats: &[u8]) -> Sample {
        let from_config = config.and_then(policy_from_config);
        let name = from_config
            .clone()
            .or_else(|| memory.and_then(|m| info_field(m, "maxmemory_policy")));
        Sample {
            policy: name,
            evicted_keys: info_field(stats, "evicted_keys").and_then(|v| v.parse().ok()),
            config_refused: config.is_some() && from_config.is_none(),
            safety: None,
        }
    }

    /// This sample with what `INFO replication` and `INFO persistence`
    /// answered.
    pub fn with_safety(self, replication: &[u8], persistence: &[u8]) -> Sample {
        Sample {
            safety: Safety::from_replies(replication, persistence),
            ..self
        }
    }
}

/// The policy named in a `CONFIG GET maxmemory-policy` reply (a RESP2
/// array or RESP3 map of one name/value pair); `None` for an error (an
/// unknown or refused command) or an empty answer.
pub fn policy_from_config(reply: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(reply).ok()?;
    let mut lines = text.split("\r\n");
    if !matches!(lines.next()?, "*2" | "%1") {
        return None;
    }
    let mut bulks = lines.filter(|l| !l.starts_with('$'));
    if !bulks.next()?.eq_ignore_ascii_case("maxmemory-policy") {
        return None;
    }
    let value = bulks.next()?.trim();
    (!value.is_empty()).then(|| value.to_string())
}

/// The value of `field` in an `INFO` reply (`field:value` lines); `None`
/// for an error reply or a missing field.
fn info_field(reply: &[u8], field: &str) -> Option<String> {
    if reply.first() == Some(&b'-') {
        return None;
    }
    let text = String::from_utf8_lossy(reply);
    text.lines().find_map(|l| {
        l.strip_prefix(field)?
            .strip_prefix(':')
            .map(|v| v.trim().to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_info_says_whether_a_command_is_known() {
        for (reply, known) in [
            (&b"*1\r\n*10\r\n$6\r\nmsetex\r\n:-4\r\n"[..], true),
            (b"*1\r\n$-1\r\n", false),
            (b"*1\r\n*-1\r\n", false),
            (b"-NOPERM this user has no permissions\r\n", false),
            (b"*0\r\n", false),
        ] {
            let refused = reply.starts_with(b"-") || reply == b"*0\r\n";
            assert_eq!(unknown(reply), !known && !refused, "{reply:?}");
            assert_eq!(
                describes(reply),
                known,
                "{:?}",
                String::from_utf8_lossy(reply)
            );
        }
    }

    const CONFIG: &[u8] = b"*2\r\n$16\r\nmaxmemory-policy\r\n$11\r\nallkeys-lru\r\n";
    const MEMORY: &[u8] =
        b"$60\r\n# Memory\r\nused_memory:1\r\nmaxmemory_policy:volatile-ttl\r\nx:1\r\n\r\n";
    const STATS: &[u8] = b"$40\r\n# Stats\r\nevicted_keys:17\r\nevicted_clients:0\r\n\r\n";

    #[test]
    fn replication_and_persistence_are_read() {
        let replication = b"$90\r\n# Replication\r\nrole:master\r\nconnected_slaves:2\r\nmin_slaves_good_slaves:2\r\nslave0:ip=x\r\n\r\n";
        let persistence = b"$40\r\n# Persistence\r\nloading:0\r\naof_enabled:0\r\n\r\n";
        let s = Safety::from_replies(replication, persistence).expect("read");
        assert_eq!(
            s,
            Safety {
                master: true,
                replicas: 2,
                min_replicas: true,
                aof: false
            }
        );
        let bare = b"$60\r\n# Replication\r\nrole:master\r\nconnected_slaves:0\r\n\r\n";
        let aof = b"$30\r\n# Persistence\r\naof_enabled:1\r\n\r\n";
        let s = Safety::from_replies(bare, aof).expect("read");
        assert!(!s.min_replicas && s.aof && s.replicas == 0);
        assert_eq!(Safety::from_replies(b"-NOPERM no\r\n", aof), None);
    }

    #[test]
    fn config_get_is_read_first() {
        let s = Sample::from_replies(Some(CONFIG), Some(MEMORY), STATS);
        assert_eq!(s.policy.as_deref(), Some("allkeys-lru"));
        assert_eq!(s.evicted_keys, Some(17), "evicted_clients is another field");
        assert!(!s.config_refused);
        let map = b"%1\r\n$16\r\nmaxmemory-policy\r\n$10\r\nnoeviction\r\n";
        assert_eq!(policy_from_config(map).as_deref(), Some("noeviction"));
    }

    #[test]
    fn a_refused_config_falls_back_to_info_memory_then_unknown() {
        for refused in [
            &b"-ERR unknown command 'CONFIG', with args beginning with: 'GET' \r\n"[..],
            b"-NOPERM this user has no permissions to run the 'config|get' command\r\n",
            b"*0\r\n",
        ] {
            let s = Sample::from_replies(Some(refused), Some(MEMORY), STATS);
            assert_eq!(s.policy.as_deref(), Some("volatile-ttl"));
            assert!(s.config_refused);
            let s = Sample::from_replies(Some(refused), Some(b"-NOPERM no\r\n"), b"-NOPERM\r\n");
            assert_eq!(s.policy, None);
            assert_eq!(s.evicted_keys, None);
        }
        // Not asked: not refused.
        let s = Sample::from_replies(None, Some(MEMORY), STATS);
        assert!(!s.config_refused);
        assert_eq!(s.policy.as_deref(), Some("volatile-ttl"));
    }
}
