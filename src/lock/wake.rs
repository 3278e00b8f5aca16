//! Lock libraries' waiters woken when their own wake-up was lost.
//!
//! python-redis-lock's waiter, after a failed `SET NX`, blocks on the
//! key's signal list (`BLPOP lock-signal:<name> <timeout>`) until the
//! holder's release script pushes to it. A holder that crashed, or whose
//! lease ran out, pushes nothing: its waiters sleep out their timeout, and
//! with none asked (`BLPOP … 0`, a lock taken without `expire`) for ever,
//! though the lock is long free. Redisson's waiter is subscribed to its
//! lock's channel (`redisson_lock__channel:{<name>}`) and waits for the
//! unlock message up to the lease left (30 s under its watchdog): a
//! message lost (published while its subscription was being made again)
//! leaves it waiting that long.
//!
//! Who listens where: a connection whose last attempt on a lock key lost,
//! moments ago, and that then blocks on one list, waits for that key on
//! that list ([`LockService::listening`]): learnt from what it does, not
//! from key names. A subscription to a channel named as Redisson names a
//! lock key's ([`LockService::subscribed_to`]) is where that key's waiters
//! listen (Redisson subscribes on another connection than the one it
//! locks on, so only the name ties them).
//!
//! Such a key is watched: every `probe_interval_ms` one `PTTL` of it and
//! one look at where its waiters listen (`EXISTS` of the list, `PUBSUB
//! NUMSUB` of the channel) on lockgate's own connection. A list is pushed
//! the wake-up the release would have pushed (`LPUSH <list> 1`, lapsing
//! after `locks.wake.signal_expire_ms`) once the key is gone and the list
//! empty; a channel is sent Redisson's unlock message (`0`) once the key
//! has been free a whole probe interval with subscribers (had the
//! library's own message come, they would have taken it by then). Both
//! counted in `lock_wake_pushes`. A push nobody took (no waiter any more)
//! ends the watch; so does `locks.wake.listen_max_ms` after the last wait
//! seen (or the wait's own timeout, if shorter).
//!
//! lockgate's own answers must not leave such a waiter asleep either
//! (python-redis-lock's `test_no_overlap`, with the probe interval at
//! 60 s, stalled up to a minute one run in ten, both ways below):
//!
//! - A watched key is looked at at once, out of turn
//!   ([`LockService::recheck_waiters`]), when a client's script released it
//!   while an attempt on it was answered "not acquired" from what lockgate
//!   knew. lockgate learns of such a release only from the script's reply:
//!   an attempt answered in between was told "held" of a lock already
//!   free, and its caller, woken by the release's own push, blocks again.
//!   So does a waiter that goes to sleep on a key lockgate does not know
//!   held. The rule is the probe's, with nothing pushed before it: a list
//!   gets a wake-up if the key is free and the list empty, a channel if
//!   the key is free and anyone is subscribed (counted in
//!   `lock_wake_rechecks`).
//! - A connection that blocks on a key's list leaves the key's queue in
//!   the storm room: the place a spinner keeps there after its park
//!   (max(park, probe)) would hold every other caller back from a free
//!   lock, and its next attempt comes only with a wake-up.
//!
//! Bounded: at most `locks.wake.max_keys` keys watched (one more is not,
//! counted in `lock_wake_keys_full`); the cost is per watched key and
//! interval, not per operation, and each instance watches only the keys
//! its own clients wait for. A spurious push costs a waiter one more
//! failed attempt, never a lock: who holds the key is still decided by the
//! acquisition in Redis. Not on the quorum (the lock keys live on the
//! masters, the lists and channels on the primary).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dashmap::DashMap;
use tokio_util::sync::CancellationToken;

use super::conns::Client;
use super::keys::KeyHasher;
use super::lease::ConnId;
use super::quorum::integer;
use super::LockService;
use crate::config::WakeConfig;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode;

/// Where a watched key's waiters listen.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    /// A list they block on (python-redis-lock's signal list): the
    /// wake-up is an element pushed to it.
    List(Bytes),
    /// A channel they are subscribed to (Redisson's
    /// `redisson_lock__channel:{<key>}`): the wake-up is a message, `0`,
    /// Redisson's unlock message.
    Channel(Bytes),
}

/// A connection seen blocking on a watched key's list.
#[derive(Debug, Clone)]
struct Listener {
    /// The connection.
    conn: ConnId,
    /// When it blocked.
    since: Instant,
    /// Its wait's end (its timeout, or `listen_max_ms`).
    until: Instant,
}

/// One watched lock key.
#[derive(Debug, Clone)]
struct Watch {
    /// Where its waiters listen.
    target: Target,
    /// Watched until then (the last wait seen, plus its timeout or
    /// `listen_max_ms`).
    until: Instant,
    /// lockgate pushed a wake-up at the last probe: if the key is still
    /// free and the list still holds it, nobody is waiting.
    pushed: bool,
    /// The last probe found the key free (a channel's waiters are woken
    /// only when it is still free a probe later: the library's own
    /// message, when it came, had them take it by then).
    free: bool,
    /// The connections seen blocking on its list, at most
    /// `locks.wake.max_listeners` (for `LOCKGATE WAITERS`).
    listeners: Vec<Listener>,
    /// To be looked at at once, out of turn
    /// ([`LockService::recheck_waiters`]).
    recheck: bool,
}

/// A connection blocked on a watched key's signal list, as
/// `LOCKGATE WAITERS` lists it.
#[derive(Debug, Clone)]
pub struct ListenerRow {
    /// The connection.
    pub client: Client,
    /// The list it blocks on.
    pub list: Bytes,
    /// Since its connection first tried for the key, ms.
    pub waited_ms: u64,
}

/// The keys watched for waiters (see the module doc).
#[derive(Debug)]
pub(crate) struct Watched {
    table: DashMap<Bytes, Watch, KeyHasher>,
    config: WakeConfig,
    /// The keys awaiting a look out of turn, each once (its watch's
    /// `recheck` set): at most as many as are watched.
    due: std::sync::Mutex<Vec<Bytes>>,
    /// Tells the watch loop a key awaits a look out of turn.
    recheck: tokio::sync::Notify,
}

/// What one probe of a watched key found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Probe {
    /// The lock key is there: its waiters wait rightly.
    Held,
    /// The key is free and its list empty: push a wake-up.
    Push,
    /// The key is free and the list holds a wake-up not taken yet.
    Pending,
    /// The key is free and the wake-up lockgate pushed is still there:
    /// nobody waits; the watch ends.
    Idle,
}

impl Probe {
    /// The rule: from the lock key's `PTTL` reply, whether its list
    /// exists, and whether lockgate pushed at the last probe.
    pub(crate) fn of(pttl: i64, list_exists: bool, pushed: bool) -> Probe {
        match (pttl, list_exists, pushed) {
            (p, _, _) if p != -2 => Probe::Held,
            (_, false, _) => Probe::Push,
            (_, true, true) => Probe::Idle,
            (_, true, false) => Probe::Pending,
        }
    }
}

impl Probe {
    /// The rule for a channel: from the lock key's `PTTL` reply, whether
    /// anyone is subscribed to the channel, whether the last probe found
    /// the key free, and whether lockgate published then. A message is
    /// sent only for a key free for a whole probe interval with
    /// subscribers (the library's own message was lost, or they would
    /// have taken it), never twice in a row.
    pub(crate) fn of_channel(pttl: i64, subscribers: bool, was_free: bool, pushed: bool) -> Probe {
        match (pttl, subscribers, was_free, pushed) {
            (p, _, _, _) if p != -2 => Probe::Held,
            (_, false, _, _) | (_, _, _, true) => Probe::Idle,
            (_, true, false, false) => Probe::Pending,
            (_, true, true, false) => Probe::Push,
        }
    }
}

impl Watched {
    /// An empty table for `config`.
    pub(crate) fn new(config: &WakeConfig) -> Watched {
        Watched {
            table: DashMap::with_hasher(KeyHasher::new()),
            config: config.clone(),
            due: std::sync::Mutex::new(Vec::new()),
            recheck: tokio::sync::Notify::new(),
        }
    }

    /// How many keys are watched now.
    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }
}

/// The timeout argument of a blocking pop, in seconds (`0`: none).
fn timeout_of(arg: &[u8]) -> Option<f64> {
    std::str::from_utf8(arg).ok()?.parse::<f64>().ok()
}

impl LockService {
    /// A connection whose records are `conn` sent a blocking pop
    /// (`BLPOP`/`BRPOP`, `args` as sent): if it waits on one list and its
    /// last attempt on a lock key lost within `spin_window_ms`, that key's
    /// waiters listen there, and the key is watched (see the module doc).
    pub(crate) fn listening(
        &self,
        conn: &std::sync::Mutex<super::lease::ConnLocks>,
        args: &[&[u8]],
    ) {
        let watched = &self.wake;
        if watched.config.max_keys == 0 || self.on_masters() {
            return;
        }
        let [name, list, timeout] = args else {
            return;
        };
        if !name.eq_ignore_ascii_case(b"BLPOP") && !name.eq_ignore_ascii_case(b"BRPOP") {
            return;
        }
        let Some(secs) = timeout_of(timeout) else {
            return;
        };
        let window = Duration::from_millis(self.rules().spin_window_ms());
        let (key, id) = {
            let c = crate::sync::lock(conn);
            (c.last_lost(window), c.id)
        };
        let Some(key) = key else {
            return;
        };
        let most = Duration::from_millis(watched.config.listen_max_ms);
        let asked = Duration::try_from_secs_f64(secs).unwrap_or(most);
        let listen = match asked.is_zero() {
            true => most,
            false => asked.min(most),
        };
        self.watch(
            key.clone(),
            Target::List(Bytes::copy_from_slice(list)),
            listen,
        );
        self.listener(&key, id, listen);
        // It waits in its library's line now, not in lockgate's: a place
        // kept for its next attempt (a spinner's, for max(park, probe))
        // would hold every other caller back from a free lock while it
        // sleeps, and its next attempt comes only with a wake-up. With the
        // probe interval at 60 s, python-redis-lock's `test_no_overlap`
        // stalled for a minute one run in ten that way.
        self.storm.leave(&key, id);
        // Going to sleep on a lock not known held: refused by the queue's
        // order, or by what lockgate knew before a release it has seen
        // since. Nothing may push its list again: looked at at once.
        if !self.storm.known_held(&key) {
            self.recheck_waiters(&key);
        }
    }

    /// The connection `id` blocks on `key`'s list for `listen`: listed by
    /// `LOCKGATE WAITERS` until then, until it tries for the key again or
    /// closes ([`LockService::listener_rows`]).
    fn listener(&self, key: &Bytes, id: ConnId, listen: Duration) {
        let Some(mut w) = self.wake.table.get_mut(key) else {
            return;
        };
        let now = Instant::now();
        let listener = Listener {
            conn: id,
            since: now,
            until: now + listen,
        };
        w.listeners.retain(|l| l.until > now);
        if let Some(l) = w.listeners.iter_mut().find(|l| l.conn == id) {
            *l = listener;
        } else if w.listeners.len() < self.wake.config.max_listeners {
            w.listeners.push(listener);
        } else {
            ProxyMetrics::inc(&self.metrics.wake_listeners_full);
        }
    }

    /// The connections blocked on `key`'s signal list now, the longest
    /// waiting first: seen blocking on it, their wait not over, open, and
    /// not trying for the key since (a woken waiter tries at once).
    pub fn listener_rows(&self, key: &[u8]) -> Vec<ListenerRow> {
        let Some(w) = self.wake.table.get(key).map(|w| w.value().clone()) else {
            return Vec::new();
        };
        let Target::List(list) = &w.target else {
            return Vec::new();
        };
        let now = Instant::now();
        let mut rows: Vec<ListenerRow> = (w.listeners.iter())
            .filter(|l| l.until > now)
            .filter_map(|l| {
                let (client, first_try) = self.conns.listening(l.conn, key, l.since)?;
                Some(ListenerRow {
                    client,
                    list: list.clone(),
                    waited_ms: now.saturating_duration_since(first_try).as_millis() as u64,
                })
            })
            .collect();
        rows.sort_by_key(|r| std::cmp::Reverse(r.waited_ms));
        rows
    }

    /// A connection subscribed to `channels`: one named as Redisson names
    /// a lock's (`redisson_lock__channel:{<key>}`, of a lock key here) is
    /// where that key's waiters listen, and the key is watched for
    /// `listen_max_ms`.
    pub(crate) fn subscribed_to<'a>(&self, channels: impl Iterator<Item = &'a [u8]>) {
        if self.wake.config.max_keys == 0 || self.on_masters() {
            return;
        }
        for channel in channels {
            let Some(key) = redisson_lock_of(channel) else {
                continue;
            };
            if self.is_lock_key(key) {
                let most = Duration::from_millis(self.wake.config.listen_max_ms);
                let target = Target::Channel(Bytes::copy_from_slice(channel));
                self.watch(Bytes::copy_from_slice(key), target, most);
            }
        }
    }

    /// Watches `key`, whose waiters listen at `target`, for `listen`.
    fn watch(&self, key: Bytes, target: Target, listen: Duration) {
        let watched = &self.wake;
        let watch = Watch {
            target,
            until: Instant::now() + listen,
            pushed: false,
            free: false,
            listeners: Vec::new(),
            recheck: false,
        };
        if let Some(mut w) = watched.table.get_mut(&key) {
            let listeners = std::mem::take(&mut w.listeners);
            let recheck = w.recheck;
            *w = Watch {
                listeners,
                recheck,
                ..watch
            };
            return;
        }
        if watched.table.len() >= watched.config.max_keys {
            ProxyMetrics::inc(&self.metrics.wake_keys_full);
            return;
        }
        watched.table.insert(key, watch);
    }

    /// Sends the wake-up `target`'s waiters listen for (a list: `LPUSH 1`
    /// lapsing after `signal_expire_ms`, sent together; a channel: `PUBLISH
    /// 0`); whether Redis took it.
    async fn push(&self, target: &Target) -> bool {
        let store = self.store();
        let timeout = store.timeout();
        let sent = match target {
            Target::List(list) => {
                let ms = self.wake.config.signal_expire_ms.to_string();
                let push = encode::command(&[b"LPUSH", list, b"1"]);
                let lapse = encode::command(&[b"PEXPIRE", list, ms.as_bytes()]);
                // Both queued before either is awaited (one round trip);
                // awaited in order, so a lazy send (a cluster's) runs the
                // push before its expiry.
                let pushed = store.primary.send(push.into(), timeout);
                let lapses = store.primary.send(lapse.into(), timeout);
                let pushed = pushed.await;
                let _ = lapses.await;
                pushed
            }
            Target::Channel(channel) => {
                let publish = encode::command(&[b"PUBLISH", channel, b"0"]);
                store.primary.send(publish.into(), timeout).await
            }
        };
        sent.as_deref().ok().and_then(integer).is_some()
    }

    /// One round over the watched keys: each probed, a wake-up pushed
    /// where the rule says so, lapsed watches dropped.
    async fn probe_watched(&self) {
        let now = Instant::now();
        self.wake.table.retain(|_, w| w.until > now);
        let due: Vec<(Bytes, Watch)> = (self.wake.table.iter())
            .map(|e| (e.key().clone(), e.value().clone()))
            .collect();
        for (key, watch) in due {
            self.probe_key(&key, &watch, false).await;
        }
    }

    /// A client's script released `key` while an attempt on it was
    /// answered "not acquired" from what this instance knew, maybe
    /// stale: if the key is watched, it is looked at at once, out of
    /// turn, by the watch loop (see the module doc). Nothing if it is not.
    pub(crate) fn recheck_waiters(&self, key: &[u8]) {
        let Some(mut w) = self.wake.table.get_mut(key) else {
            return;
        };
        ProxyMetrics::inc(&self.metrics.wake_rechecks);
        // Asked already and not looked at yet: that look serves this too.
        if std::mem::replace(&mut w.recheck, true) {
            return;
        }
        let key = w.key().clone();
        drop(w);
        crate::sync::lock(&self.wake.due).push(key);
        self.wake.recheck.notify_one();
    }

    /// The keys awaiting a look out of turn, each looked at once: the
    /// cost is per key asked for, not per key watched.
    async fn recheck_due(&self) {
        let keys = std::mem::take(&mut *crate::sync::lock(&self.wake.due));
        for key in keys {
            let watch = self.wake.table.get_mut(&key).map(|mut w| {
                w.recheck = false;
                w.clone()
            });
            if let Some(watch) = watch {
                self.probe_key(&key, &watch, true).await;
            }
        }
    }

    /// Probes watched `key` (one `PTTL`, one look where its waiters
    /// listen) and pushes a wake-up where the rule says so. `now`: a look
    /// out of turn, after a release that may have left a waiter told
    /// "held" of a free lock: the rule is the probe's as if nothing had
    /// been pushed, a channel's as if the key had been free a whole
    /// interval, and the watch never ends for it.
    async fn probe_key(&self, key: &Bytes, watch: &Watch, now: bool) {
        let store = self.store();
        let timeout = store.timeout();
        let ask = match &watch.target {
            Target::List(list) => encode::command(&[b"EXISTS", list]),
            Target::Channel(channel) => encode::command(&[b"PUBSUB", b"NUMSUB", channel]),
        };
        let pttl = store
            .primary
            .send(encode::command(&[b"PTTL", key]).into(), timeout);
        let asked = store.primary.send(ask.into(), timeout);
        let (Ok(pttl), Ok(asked)) = tokio::join!(pttl, asked) else {
            return;
        };
        let Some(pttl) = integer(&pttl) else {
            return;
        };
        let (was_free, pushed) = match now {
            true => (true, false),
            false => (watch.free, watch.pushed),
        };
        let probe = match &watch.target {
            Target::List(_) => match integer(&asked) {
                Some(exists) => Probe::of(pttl, exists == 1, pushed),
                None => return,
            },
            Target::Channel(_) => match numsub(&asked) {
                Some(n) => Probe::of_channel(pttl, n > 0, was_free, pushed),
                None => return,
            },
        };
        let pushed = match probe {
            Probe::Held | Probe::Pending => false,
            Probe::Idle if now => false,
            Probe::Idle => {
                self.wake.table.remove(key);
                return;
            }
            Probe::Push => {
                let ok = self.push(&watch.target).await;
                if ok {
                    ProxyMetrics::inc(&self.metrics.wake_pushes);
                }
                ok
            }
        };
        if let Some(mut w) = self.wake.table.get_mut(key) {
            w.pushed = pushed;
            w.free = pttl == -2;
        }
    }
}

/// The lock key a Redisson lock channel is named for
/// (`redisson_lock__channel:{<key>}`).
fn redisson_lock_of(channel: &[u8]) -> Option<&[u8]> {
    let rest = channel.strip_prefix(b"redisson_lock__channel:{")?;
    rest.strip_suffix(b"}")
}

/// `PUBSUB NUMSUB <channel>`'s count (`*2 $name :n`).
fn numsub(frame: &[u8]) -> Option<i64> {
    let last = frame.strip_suffix(b"\r\n")?;
    let at = last.iter().rposition(|&b| b == b':')?;
    std::str::from_utf8(&last[at + 1..]).ok()?.parse().ok()
}

/// Starts the watch loop: a round every `probe_interval_ms` (at least
/// 10 ms) while any key is watched, and a look at once at each key asked
/// for out of turn ([`LockService::recheck_waiters`]), until `stop`.
pub(crate) fn spawn(locks: Arc<LockService>, stop: CancellationToken) {
    tokio::spawn(async move {
        let every = || Duration::from_millis(locks.rules().retry.probe_interval_ms.max(10));
        let mut round = tokio::time::Instant::now() + every();
        loop {
            let due = tokio::select! {
                _ = tokio::time::sleep_until(round) => true,
                _ = locks.wake.recheck.notified() => false,
                _ = stop.cancelled() => return,
            };
            let work = async {
                match due {
                    true if locks.wake.len() > 0 => locks.probe_watched().await,
                    true => {}
                    false => locks.recheck_due().await,
                }
            };
            tokio::select! {
                _ = work => {}
                _ = stop.cancelled() => return,
            }
            if due {
                round = tokio::time::Instant::now() + every();
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_rule_as_a_table() {
        // (PTTL of the lock key, its list exists, pushed last time) → what.
        let table = [
            ((5_000, false, false), Probe::Held),
            ((-1, false, false), Probe::Held),
            ((5_000, true, true), Probe::Held),
            ((-2, false, false), Probe::Push),
            ((-2, false, true), Probe::Push),
            ((-2, true, false), Probe::Pending),
            ((-2, true, true), Probe::Idle),
        ];
        for ((pttl, exists, pushed), want) in table {
            assert_eq!(
                Probe::of(pttl, exists, pushed),
                want,
                "{pttl} {exists} {pushed}"
            );
        }
    }

    #[test]
    fn the_channel_rule_as_a_table() {
        // (PTTL, subscribers, free at the last probe, published then).
        let table = [
            ((5_000, true, false, false), Probe::Held),
            ((5_000, true, true, true), Probe::Held),
            ((-2, true, false, false), Probe::Pending),
            ((-2, true, true, false), Probe::Push),
            ((-2, true, true, true), Probe::Idle),
            ((-2, false, true, false), Probe::Idle),
        ];
        for ((pttl, subs, free, pushed), want) in table {
            let got = Probe::of_channel(pttl, subs, free, pushed);
            assert_eq!(got, want, "{pttl} {subs} {free} {pushed}");
        }
    }

    #[test]
    fn redisson_channels_and_numsub_read_as_sent() {
        assert_eq!(
            redisson_lock_of(b"redisson_lock__channel:{lock:a}"),
            Some(&b"lock:a"[..])
        );
        assert_eq!(redisson_lock_of(b"redisson_lock__channel:lock:a"), None);
        assert_eq!(redisson_lock_of(b"news"), None);
        assert_eq!(numsub(b"*2\r\n$1\r\nc\r\n:3\r\n"), Some(3));
        assert_eq!(numsub(b"-ERR x\r\n"), None);
    }

    #[test]
    fn timeouts_read_as_redis_reads_them() {
        assert_eq!(timeout_of(b"0"), Some(0.0));
        assert_eq!(timeout_of(b"1.5"), Some(1.5));
        assert_eq!(timeout_of(b"x"), None);
    }
}
