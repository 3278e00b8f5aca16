//! Replicas that accept writes (`replica-read-only no`): besides the
//! primary, a node of the set takes writes that never reach the primary
//! nor the other replicas (a lock key written there by another client is
//! unknown to lockgate, and appears as held if that replica is promoted;
//! active-active setups are the same risk). The primary's replicas, as its
//! `INFO replication` lists them (at most [`MAX_ASKED`]), are asked
//! `CONFIG GET replica-read-only` every `locks.eviction_check_ms` on a
//! short connection of lockgate's own. Named `writable_replica`
//! (`LOCKGATE PRIMARY`, `/metrics`, `/status.json`, the log);
//! `locks.require_one_primary` refuses lock grants meanwhile, served again
//! at the first check that finds every replica read-only. A replica that
//! cannot be asked (down, `CONFIG` renamed or refused) is not named: what
//! lockgate cannot read it cannot name.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::metrics::RateLimit;
use crate::sync;
use crate::upstream::node::NodeConfig;

/// Most replicas asked per check; past it the rest are not asked (counted
/// in `upstream_replicas_unasked`).
pub const MAX_ASKED: usize = 16;

/// What a replica answered to `CONFIG GET replica-read-only`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadOnly {
    /// `yes`: it refuses writes from clients.
    Yes,
    /// `no`: it accepts them.
    No,
    /// No answer (down, refused, unreadable).
    Unknown,
}

/// The replicas of the primary and which of them accept writes.
#[derive(Debug)]
pub struct Writable {
    /// The replicas the primary's latest `INFO replication` listed.
    listed: Mutex<Vec<Arc<str>>>,
    /// Those that answered `no` at the latest check.
    writable: Mutex<Vec<Arc<str>>>,
    /// Limits the warning of a writable replica.
    pub warn: RateLimit,
}

impl Default for Writable {
    fn default() -> Writable {
        Writable {
            listed: Mutex::new(Vec::new()),
            writable: Mutex::new(Vec::new()),
            warn: RateLimit::new(Duration::from_secs(60)),
        }
    }
}

impl Writable {
    /// Takes note of the replicas a primary's `INFO replication` reply
    /// lists (none for a replica's or an unreadable reply); those past
    /// [`MAX_ASKED`] are counted in `unasked`.
    pub fn listed(&self, info_replication: &[u8], unasked: &AtomicU64) {
        let mut all = replicas_in(info_replication);
        if all.len() > MAX_ASKED {
            let over = (all.len() - MAX_ASKED) as u64;
            unasked.fetch_add(over, Ordering::Relaxed);
            all.truncate(MAX_ASKED);
        }
        *sync::lock(&self.listed) = all.into_iter().map(Arc::from).collect();
    }

    /// The replicas to ask now.
    pub fn addrs(&self) -> Vec<Arc<str>> {
        sync::lock(&self.listed).clone()
    }

    /// Takes note of what each of `asked` answered: the writable ones
    /// are those that said `no`.
    pub fn answered(&self, asked: &[Arc<str>], answers: &[ReadOnly]) {
        let writable = (asked.iter().zip(answers))
            .filter(|(_, a)| **a == ReadOnly::No)
            .map(|(addr, _)| addr.clone())
            .collect();
        *sync::lock(&self.writable) = writable;
    }

    /// The replicas that accept writes, as last asked.
    pub fn writable(&self) -> Vec<Arc<str>> {
        sync::lock(&self.writable).clone()
    }
}

/// `HOST:PORT` of each `slaveN:ip=…,port=…` line of an `INFO
/// replication` reply.
fn replicas_in(reply: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(reply);
    text.lines()
        .filter(|l| {
            l.strip_prefix("slave")
                .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
        })
        .filter_map(|l| {
            let fields = l.split_once(':')?.1;
            let field = |name: &str| {
                (fields.split(',')).find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
            };
            Some(format!("{}:{}", field("ip")?, field("port")?.trim()))
        })
        .collect()
}

/// Asks `addr` whether it refuses writes, on a new connection made as
/// `template` says, within its connect timeout for each step.
pub async fn ask(template: &NodeConfig, addr: &str) -> ReadOnly {
    let get: [&[u8]; 3] = [b"CONFIG", b"GET", b"replica-read-only"];
    match super::formers::ask_once(template, addr, &get).await {
        Some(reply) => read_only(&reply),
        None => ReadOnly::Unknown,
    }
}

/// `CONFIG GET replica-read-only`'s reply read: its value, the last line.
fn read_only(reply: &[u8]) -> ReadOnly {
    if !reply.starts_with(b"*2\r\n") {
        return ReadOnly::Unknown;
    }
    let text = String::from_utf8_lossy(reply);
    match text.trim_end().rsplit("\r\n").next() {
        Some("yes") => ReadOnly::Yes,
        Some("no") => ReadOnly::No,
        _ => ReadOnly::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_replicas_are_read_from_info_replication() {
        let info = b"# Replication\r\nrole:master\r\nconnected_slaves:2\r\nslave0:ip=127.0.0.1,port=6380,state=online,offset=42,lag=0\r\nslave1:ip=10.0.0.2,port=7000,state=wait_bgsave,offset=0,lag=1\r\nslave_read_repl_offset:1\r\nmaster_replid:abc\r\n";
        assert_eq!(replicas_in(info), ["127.0.0.1:6380", "10.0.0.2:7000"]);
        assert!(replicas_in(b"role:slave\r\nmaster_host:x\r\n").is_empty());
        assert!(replicas_in(b"-ERR no\r\n").is_empty());
    }

    #[test]
    fn the_answer_says_read_only_or_not() {
        let yes = b"*2\r\n$17\r\nreplica-read-only\r\n$3\r\nyes\r\n";
        let no = b"*2\r\n$17\r\nreplica-read-only\r\n$2\r\nno\r\n";
        assert_eq!(read_only(yes), ReadOnly::Yes);
        assert_eq!(read_only(no), ReadOnly::No);
        assert_eq!(read_only(b"*0\r\n"), ReadOnly::Unknown);
        assert_eq!(
            read_only(b"-ERR unknown command 'CONFIG'\r\n"),
            ReadOnly::Unknown
        );
    }

    #[test]
    fn only_those_that_said_no_are_writable_and_the_list_is_bounded() {
        let w = Writable::default();
        let lines: String = (0..20)
            .map(|i| format!("slave{i}:ip=h,port={i},state=online\r\n"))
            .collect();
        let unasked = AtomicU64::new(0);
        w.listed(lines.as_bytes(), &unasked);
        let addrs = w.addrs();
        assert_eq!(addrs.len(), MAX_ASKED);
        assert_eq!(unasked.load(Ordering::Relaxed), 4);
        let answers = [ReadOnly::No, ReadOnly::Yes, ReadOnly::Unknown];
        w.answered(&addrs[..3], &answers);
        assert_eq!(w.writable(), vec![Arc::<str>::from("h:0")]);
        w.answered(&addrs[..1], &[ReadOnly::Yes]);
        assert!(w.writable().is_empty());
    }
}
