//! Guard records: with the locks on the quorum's masters and the data on
//! the primary, a guarded write cannot read the owner record in the same
//! step as it writes. So each acquisition of a guarded lock on the quorum
//! also leaves `lockgate:guard:{lock}` on the primary: the same token, for
//! the acquisition's validity (the lease less the time the vote took and
//! the clock drift), so it never outlives the lock on the masters. Guarded
//! writes check it instead of the owner record
//! ([`crate::script::GUARD`], same rule). It follows the lock: an
//! owner-checked release deletes it (if still its own), an extension moves
//! its expiry, a takeover gives it the new token.
//!
//! It is written before the acquisition is answered, on lockgate's own
//! connection to the primary, bounded by the call timeout; if that fails
//! the acquisition still stands (lease safety does not wait on it) and
//! the holder's guarded writes are refused as if its lease had ended,
//! until it acquires again (counted: `lock_guard_record_failures`). What a
//! failover of the primary does to it is in docs/guarded-writes.md.

use bytes::Bytes;

use super::super::lease::ConnLocks;
use super::super::ops::LockOp;
use super::super::{tagged, LockService};
use crate::metrics::ProxyMetrics;
use crate::protocol::encode;
use crate::protocol::encode::LocalReply;

/// Prefix of guard records: `lockgate:guard:{lock}`.
pub const GUARD_PREFIX: &[u8] = b"lockgate:guard:{";

/// `lockgate:guard:{lock}`, in the lock key's hash slot.
pub fn guard_key(lock: &[u8]) -> Bytes {
    tagged(GUARD_PREFIX, lock)
}

/// Deletes the record if it still holds this token.
const DROP: &str =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0";

/// Gives the record a new token, keeping its expiry; one that lapsed gets
/// `ARGV[2]` ms.
const RETOKEN: &str = "if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('SET', KEYS[1], ARGV[1], 'KEEPTTL') else redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) end return 1";

impl LockService {
    /// Whether `key` is the lock of some guard, with the locks on the
    /// quorum (where guard records are kept).
    pub(crate) fn keeps_guard_record(&self, key: &[u8]) -> bool {
        self.guards_on() && self.on_masters() && self.rules().guards.guards_lock(key)
    }

    /// A new acquisition of `key` by `token`, valid `ms`.
    pub(crate) async fn guard_record_acquired(&self, key: &[u8], token: &[u8], ms: u64) {
        let ms = ms.to_string();
        let cmd = encode::command(&[b"SET", &guard_key(key), token, b"PX", ms.as_bytes()]);
        self.guard_record_call(cmd).await;
    }

    /// `key`'s acquisition by `token` was released.
    pub(crate) async fn guard_record_released(&self, key: &[u8], token: &[u8]) {
        let cmd = encode::command(&[b"EVAL", DROP.as_bytes(), b"1", &guard_key(key), token]);
        self.guard_record_call(cmd).await;
    }

    /// `key`'s lease now ends in `ms`.
    pub(crate) async fn guard_record_extended(&self, key: &[u8], ms: u64) {
        let ms = ms.to_string();
        let cmd = encode::command(&[b"PEXPIRE", &guard_key(key), ms.as_bytes()]);
        self.guard_record_call(cmd).await;
    }

    /// `key` was taken over by `token` (its lease kept).
    pub(crate) async fn guard_record_taken_over(&self, key: &[u8], token: &[u8]) {
        let ms = self.lease_ms(key).to_string();
        let cmd = encode::command(&[
            b"EVAL",
            RETOKEN.as_bytes(),
            b"1",
            &guard_key(key),
            token,
            ms.as_bytes(),
        ]);
        self.guard_record_call(cmd).await;
    }

    /// What the guard records of `op`'s guarded lock keys must do once the
    /// quorum carried it out, for the connection whose records are `conn`
    /// (`None`: nothing guarded).
    pub(crate) fn guard_follow(&self, op: &LockOp, conn: &ConnLocks) -> Option<Follow> {
        match op {
            LockOp::Release { lock_keys, .. } => {
                let held: Vec<(Bytes, Bytes)> = (lock_keys.iter())
                    .filter(|k| self.keeps_guard_record(k))
                    .map(|k| (k.clone(), conn.token(k)))
                    .filter(|(_, t)| !t.is_empty())
                    .collect();
                (!held.is_empty()).then_some(Follow::Released(held))
            }
            LockOp::Extend { key, command, args } if self.keeps_guard_record(key) => {
                extended_ms(command, args).map(|ms| Follow::Extended(key.clone(), ms))
            }
            // GETDEL takes the lock away: nobody holds it after.
            LockOp::Takeover { key, command, .. } if self.keeps_guard_record(key) => {
                match *command == "GETDEL" {
                    true => Some(Follow::Deleted(key.clone())),
                    false => Some(Follow::TakenOver(key.clone())),
                }
            }
            _ => None,
        }
    }

    /// Carries out `follow` after the quorum answered `reply` (`took`: a
    /// takeover's new token).
    pub(crate) async fn guard_records_follow(
        &self,
        follow: Follow,
        reply: &LocalReply,
        took: Option<Bytes>,
    ) {
        let done = !matches!(reply, LocalReply::Error(_) | LocalReply::Integer(0));
        match follow {
            _ if !done => {}
            Follow::Released(held) => {
                for (key, token) in held {
                    self.guard_record_released(&key, &token).await;
                }
            }
            Follow::Extended(key, ms) => self.guard_record_extended(&key, ms).await,
            Follow::Deleted(key) => {
                let cmd = encode::command(&[b"DEL", &guard_key(&key)]);
                self.guard_record_call(cmd).await;
            }
            Follow::TakenOver(key) => {
                if let Some(token) = took {
                    self.guard_record_taken_over(&key, &token).await;
                }
            }
        }
    }

    async fn guard_record_call(&self, cmd: Bytes) {
        let store = self.store();
        let failed = match store.primary.call(cmd, store.timeout()).await {
            Ok(reply) if reply.first() == Some(&b'-') => {
                Some(String::from_utf8_lossy(&reply).trim_end().to_string())
            }
            Ok(_) => None,
            Err(e) => Some(e.to_string()),
        };
        if let Some(why) = failed {
            ProxyMetrics::inc(&self.metrics.guard_record_failures);
            if let Some(more) = self.guard_warn.check() {
                tracing::warn!(error = %why, suppressed = more, "guard record on the primary not written: that holder's guarded writes are refused until it acquires again");
            }
        }
    }
}

/// What a guard record follows after a lock command on the quorum.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Follow {
    /// These (lock, token) held by the releasing connection.
    Released(Vec<(Bytes, Bytes)>),
    /// The lock's lease now ends in this many ms.
    Extended(Bytes, u64),
    /// The lock was taken over.
    TakenOver(Bytes),
    /// The lock was taken and deleted (`GETDEL`).
    Deleted(Bytes),
}

/// When a lock's lease ends after `EXPIRE`/`PEXPIRE`/`EXPIREAT`/`PEXPIREAT`
/// with `args` (the value first), in ms from now; `None` if unreadable.
pub fn extended_ms(command: &str, args: &[Bytes]) -> Option<u64> {
    let n: i64 = std::str::from_utf8(args.first()?).ok()?.parse().ok()?;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_millis() as i64;
    let ms = match command {
        "EXPIRE" => n.checked_mul(1000)?,
        "PEXPIRE" => n,
        "EXPIREAT" => n.checked_mul(1000)? - now_ms,
        "PEXPIREAT" => n - now_ms,
        _ => return None,
    };
    u64::try_from(ms).ok().filter(|&ms| ms > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_extension_says_when_the_lease_ends() {
        let b = |s: &str| vec![Bytes::copy_from_slice(s.as_bytes())];
        assert_eq!(extended_ms("EXPIRE", &b("3")), Some(3000));
        assert_eq!(extended_ms("PEXPIRE", &b("250")), Some(250));
        assert_eq!(extended_ms("PEXPIRE", &b("-1")), None);
        assert_eq!(extended_ms("PEXPIRE", &b("x")), None);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let at = extended_ms("PEXPIREAT", &b(&(now + 5000).to_string())).unwrap();
        assert!((4000..=5000).contains(&at), "{at}");
        assert_eq!(extended_ms("EXPIREAT", &b("1")), None);
    }
}
