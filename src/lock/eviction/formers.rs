//! Former primaries that still accept writes: after a switch (Sentinel's
//! `+switch-master`, or the address in force changing), the node lockgate
//! followed before is asked its `ROLE` every `locks.eviction_check_ms` on
//! a short connection of lockgate's own, until it answers as a replica.
//! While it answers `master`, two nodes of the set accept writes (a split
//! brain: the sentinels, cut from it, promoted a replica; or a demoted
//! primary not yet reconfigured): a lock granted on one is unknown to the
//! other, and clients still on the old one are granted locks the new one
//! does not know. Named `second_primary` (`LOCKGATE PRIMARY`, `/metrics`,
//! `/status.json`, the log); `locks.require_one_primary` refuses lock
//! grants meanwhile, served again once it answers as a replica, or once
//! it has been unreachable for [`FORGET_AFTER`] (what lockgate cannot
//! reach it cannot name; the failover delay covers the switch itself).
//!
//! [`step`] is the rule, a pure function of a former's state, what it
//! answered and the time, tested as a table.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::metrics::RateLimit;
use crate::protocol::encode;
use crate::sync;
use crate::upstream::node::{handshake, request, NodeConfig};

/// Most former primaries watched; the oldest is dropped past it.
pub const MAX_FORMERS: usize = 4;

/// A former primary unreachable this long is no longer watched.
pub const FORGET_AFTER: Duration = Duration::from_secs(600);

/// What a former primary answered to `ROLE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// `master`: it accepts writes.
    Master,
    /// `slave` (or `sentinel`): it does not.
    Replica,
    /// No answer (refused, timed out, unreadable).
    Unreachable,
}

/// One former primary's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Former {
    /// `HOST:PORT`.
    pub addr: Arc<str>,
    /// It last answered `master`.
    pub master: bool,
    /// Unreachable since then (`None`: it answered last time).
    pub unreachable_since: Option<Instant>,
}

/// `former` after it answered `answer` at `now`; `None` when it is no
/// longer watched (a replica now, or unreachable for [`FORGET_AFTER`]).
pub fn step(former: &Former, answer: Answer, now: Instant) -> Option<Former> {
    match answer {
        Answer::Replica => None,
        Answer::Master => Some(Former {
            master: true,
            unreachable_since: None,
            ..former.clone()
        }),
        Answer::Unreachable => {
            let since = former.unreachable_since.unwrap_or(now);
            (now.saturating_duration_since(since) < FORGET_AFTER).then(|| Former {
                master: false,
                unreachable_since: Some(since),
                ..former.clone()
            })
        }
    }
}

/// The former primaries of one node's set.
#[derive(Debug)]
pub struct Formers {
    list: Mutex<VecDeque<Former>>,
    /// Limits the warning of a former primary still accepting writes.
    pub warn: RateLimit,
}

impl Default for Formers {
    fn default() -> Formers {
        Formers {
            list: Mutex::new(VecDeque::new()),
            warn: RateLimit::new(Duration::from_secs(60)),
        }
    }
}

impl Formers {
    /// The primary in force moved from `old` to `new`: `old` is watched
    /// (its state unknown until asked), `new` is not.
    pub fn switched(&self, old: &Arc<str>, new: &str) {
        let mut list = sync::lock(&self.list);
        list.retain(|f| &*f.addr != new && f.addr != *old);
        if list.len() >= MAX_FORMERS {
            list.pop_front();
        }
        list.push_back(Former {
            addr: old.clone(),
            master: false,
            unreachable_since: None,
        });
    }

    /// The addresses watched now.
    pub fn addrs(&self) -> Vec<Arc<str>> {
        sync::lock(&self.list)
            .iter()
            .map(|f| f.addr.clone())
            .collect()
    }

    /// Takes note of what `addr` answered at `now` ([`step`]).
    pub fn answered(&self, addr: &str, answer: Answer, now: Instant) {
        let mut list = sync::lock(&self.list);
        let Some(i) = list.iter().position(|f| &*f.addr == addr) else {
            return;
        };
        match step(&list[i], answer, now) {
            Some(f) => list[i] = f,
            None => {
                list.remove(i);
            }
        }
    }

    /// The former primaries that last answered `master`.
    pub fn still_primaries(&self) -> Vec<Arc<str>> {
        (sync::lock(&self.list).iter())
            .filter(|f| f.master)
            .map(|f| f.addr.clone())
            .collect()
    }
}

/// Asks `addr` its `ROLE` on a new connection made as `template` says,
/// within its connect timeout for each step.
pub async fn ask(template: &NodeConfig, addr: &str) -> Answer {
    match ask_once(template, addr, &[b"ROLE"]).await {
        Some(reply) => read_role(&reply),
        None => Answer::Unreachable,
    }
}

/// `command`'s reply from `addr` on a new connection of lockgate's own
/// made as `template` says (credentials, TLS), within its connect timeout
/// for each step (`None`: no reply). The set's other nodes are asked
/// this way ([`super::writable`] too): rarely, and never on a session's
/// path.
pub async fn ask_once(template: &NodeConfig, addr: &str, command: &[&[u8]]) -> Option<Vec<u8>> {
    let config = NodeConfig {
        addr: addr.to_string(),
        observer: None,
        follow: None,
        ..template.clone()
    };
    let mut stream = handshake(&config).await.ok()?;
    let command = encode::command(command);
    request(&mut stream, &command, config.connect_timeout)
        .await
        .ok()
}

/// `ROLE`'s reply read: its first element names the role.
fn read_role(reply: &[u8]) -> Answer {
    let Some(rest) = reply.strip_prefix(b"*") else {
        return Answer::Unreachable;
    };
    let first = rest.split(|&b| b == b'\n').nth(2).unwrap_or_default();
    match first.strip_suffix(b"\r").unwrap_or(first) {
        b"master" => Answer::Master,
        b"slave" | b"sentinel" => Answer::Replica,
        _ => Answer::Unreachable,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_former_is_watched_until_it_is_a_replica_or_long_gone() {
        let t0 = Instant::now();
        let f = |master, since: Option<u64>| Former {
            addr: Arc::from("a:1"),
            master,
            unreachable_since: since.map(|s| t0 + Duration::from_secs(s)),
        };
        let at = |s: u64| t0 + Duration::from_secs(s);
        let forget = FORGET_AFTER.as_secs();
        let cases = [
            (
                "master",
                f(false, None),
                Answer::Master,
                at(1),
                Some(f(true, None)),
            ),
            ("a replica now", f(true, None), Answer::Replica, at(1), None),
            (
                "unreachable",
                f(true, None),
                Answer::Unreachable,
                at(5),
                Some(f(false, Some(5))),
            ),
            (
                "still",
                f(false, Some(5)),
                Answer::Unreachable,
                at(9),
                Some(f(false, Some(5))),
            ),
            (
                "gone long",
                f(false, Some(5)),
                Answer::Unreachable,
                at(5 + forget),
                None,
            ),
            (
                "back",
                f(false, Some(5)),
                Answer::Master,
                at(9),
                Some(f(true, None)),
            ),
        ];
        for (what, before, answer, now, want) in cases {
            assert_eq!(step(&before, answer, now), want, "{what}");
        }
    }

    #[test]
    fn role_replies_are_read() {
        let master = b"*3\r\n$6\r\nmaster\r\n:100\r\n*0\r\n";
        let slave = b"*5\r\n$5\r\nslave\r\n$9\r\n127.0.0.1\r\n:6379\r\n$9\r\nconnected\r\n:1\r\n";
        assert_eq!(read_role(master), Answer::Master);
        assert_eq!(read_role(slave), Answer::Replica);
        assert_eq!(read_role(b"-NOPERM no\r\n"), Answer::Unreachable);
    }

    #[test]
    fn the_new_primary_is_not_watched_and_the_list_is_bounded() {
        let formers = Formers::default();
        for i in 0..6 {
            formers.switched(&Arc::from(format!("n:{i}")), &format!("n:{}", i + 1));
        }
        let addrs = formers.addrs();
        assert_eq!(addrs.len(), MAX_FORMERS);
        assert!(!addrs.iter().any(|a| &**a == "n:6"));
        // Back to a former: it is the primary again, not watched.
        formers.switched(&Arc::from("n:6"), "n:4");
        assert!(!formers.addrs().iter().any(|a| &**a == "n:4"));
        formers.answered("n:5", Answer::Master, Instant::now());
        assert_eq!(formers.still_primaries(), vec![Arc::<str>::from("n:5")]);
    }
}
