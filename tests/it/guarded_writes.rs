//! Guarded writes (`[[locks.guards]]`, docs/guarded-writes.md) against a
//! real redis-server: a holder whose lease ran out cannot write the data
//! its lock protects (refuse), or is counted doing it (report); writes
//! from connections that never took the lock, the pooled rule, every
//! family of write, and reads, which are never guarded.

use crate::support;

use lockgate::config::{GuardConfig, GuardMode, UnlockedWriters};
use support::locks::*;
use support::{Lockgate, RawClient, RedisServer};

/// The order guard: `lock:order:{id}` protects `order:{id}` and
/// `order:{id}:*`.
pub fn orders(mode: GuardMode, unlocked: UnlockedWriters) -> GuardConfig {
    GuardConfig {
        lock: "lock:order:{id}".to_string(),
        data: vec!["order:{id}".to_string(), "order:{id}:*".to_string()],
        mode,
        unlocked_writers: unlocked,
    }
}

/// Redis, lockgate with the order guard and `lease_ms` leases (once it
/// has read Redis's command table), a connection straight to Redis.
pub async fn guarded(
    mode: GuardMode,
    unlocked: UnlockedWriters,
    lease_ms: u64,
) -> (RedisServer, Lockgate, RawClient) {
    let redis = RedisServer::start();
    let mut c = config(&redis.addr(), "a", lease_ms);
    c.locks.guards = vec![orders(mode, unlocked)];
    let lg = Lockgate::start_with_admin(c).await;
    let r = RawClient::connect(redis.addr()).await;
    until!(
        "the command table",
        !lg.ctx.locks.guard_table.get().is_empty()
    );
    (redis, lg, r)
}

/// The order guard's counters: applied, refused, reported_late,
/// unlocked_writer, unchecked.
pub fn counts(lg: &Lockgate) -> [u64; 5] {
    let all = lg.ctx.locks.guard_counts();
    let (_, _, c) = all.first().expect("the order guard");
    c.each().map(|(_, n)| n)
}

#[tokio::test]
async fn a_holder_whose_lease_ran_out_cannot_write_in_refuse_mode() {
    let (_redis, lg, mut r) = guarded(GuardMode::Refuse, UnlockedWriters::Allow, 1_000).await;
    let mut a = RawClient::connect(lg.addr).await;
    let mut b = RawClient::connect(lg.addr).await;
    assert_eq!(a.call(&["SETNX", "lock:order:1", "a"]).await, ":1\r\n");
    assert_eq!(a.call(&["SET", "order:1", "by-a"]).await, "+OK\r\n");
    until!("A's lease to end", !exists(&mut r, "lock:order:1").await);
    // Nobody holds it: A's lease ended.
    let refused = a.call(&["SET", "order:1", "late-a"]).await;
    assert!(
        refused.starts_with(
            "-ERR lockgate: write refused: lock:order:1 is no longer held by this connection (lease ended "
        ) && refused.ends_with(" s ago)\r\n"),
        "{refused}"
    );
    assert_eq!(b.call(&["SETNX", "lock:order:1", "b"]).await, ":1\r\n");
    assert_eq!(b.call(&["SET", "order:1", "by-b"]).await, "+OK\r\n");
    // Someone else holds it now; a sub-key is guarded too.
    let refused = a.call(&["HSET", "order:1:items", "f", "late"]).await;
    assert_eq!(
        refused,
        "-ERR lockgate: write refused: lock:order:1 is no longer held by this connection (another holder has it now)\r\n"
    );
    assert_eq!(get(&mut r, "order:1").await.as_deref(), Some("by-b"));
    assert!(!exists(&mut r, "order:1:items").await);
    // Reads are never guarded.
    assert_eq!(a.call(&["GET", "order:1"]).await, "$4\r\nby-b\r\n");
    // Unguarded keys pass as ever.
    assert_eq!(a.call(&["SET", "user:1", "x"]).await, "+OK\r\n");
    assert_eq!(counts(&lg), [2, 2, 0, 0, 0]);
}

#[tokio::test]
async fn report_mode_applies_late_writes_and_counts_them() {
    let (_redis, lg, mut r) = guarded(GuardMode::Report, UnlockedWriters::Allow, 1_000).await;
    let mut a = RawClient::connect(lg.addr).await;
    let mut b = RawClient::connect(lg.addr).await;
    assert_eq!(a.call(&["SETNX", "lock:order:1", "a"]).await, ":1\r\n");
    until!("A's lease to end", !exists(&mut r, "lock:order:1").await);
    assert_eq!(b.call(&["SETNX", "lock:order:1", "b"]).await, ":1\r\n");
    assert_eq!(a.call(&["SET", "order:1", "late-a"]).await, "+OK\r\n");
    assert_eq!(b.call(&["SET", "order:1", "by-b"]).await, "+OK\r\n");
    assert_eq!(get(&mut r, "order:1").await.as_deref(), Some("by-b"));
    assert_eq!(counts(&lg), [1, 0, 1, 0, 0]);
    let admin = lg.admin.expect("admin listener");
    // The status page's data: one row per guard.
    let status = support::ops::http_get(admin, "/status.json").await.body;
    let status: serde_json::Value = serde_json::from_str(&status).expect("JSON");
    let row = &status["guards"][0];
    assert_eq!(
        (
            row["lock"].as_str(),
            row["mode"].as_str(),
            row["reported_late"].as_u64(),
            row["applied"].as_u64()
        ),
        (Some("lock:order:{id}"), Some("report"), Some(1), Some(1)),
        "{row}"
    );
    let text = support::ops::http_get(admin, "/metrics").await.body;
    assert!(
        text.contains(
            "lockgate_guarded_writes_total{guard=\"lock:order:{id}\",outcome=\"reported_late\"} 1"
        ),
        "{text}"
    );
}

#[tokio::test]
async fn unlocked_writers_are_allowed_or_refused_as_configured() {
    for (unlocked, want) in [
        (UnlockedWriters::Allow, "+OK\r\n"),
        (
            UnlockedWriters::Refuse,
            "-ERR lockgate: write refused: order:7 is guarded by lock:order:7, which this connection does not hold (nobody holds it)\r\n",
        ),
    ] {
        let (_redis, lg, mut r) = guarded(GuardMode::Refuse, unlocked, 30_000).await;
        let mut c = RawClient::connect(lg.addr).await;
        assert_eq!(c.call(&["SET", "order:7", "x"]).await, want, "{unlocked:?}");
        assert_eq!(exists(&mut r, "order:7").await, want == "+OK\r\n");
        let [_, refused, _, unlocked_writer, _] = counts(&lg);
        assert_eq!((refused, unlocked_writer), match unlocked {
            UnlockedWriters::Allow => (0, 1),
            UnlockedWriters::Refuse => (1, 0),
        });
    }
}

/// The pooled rule: a connection that never took the lock may write while
/// an acquisition this instance made since it opened holds it; not one
/// made before it opened (that holder may be a connection it replaced).
#[tokio::test]
async fn the_pooled_rule_lets_the_pool_write_under_its_own_lock() {
    let (_redis, lg, _r) = guarded(GuardMode::Refuse, UnlockedWriters::Refuse, 30_000).await;
    let mut pool = RawClient::connect(lg.addr).await;
    let mut holder = RawClient::connect(lg.addr).await;
    assert_eq!(pool.call(&["PING"]).await, "+PONG\r\n");
    assert_eq!(holder.call(&["SETNX", "lock:order:3", "h"]).await, ":1\r\n");
    assert_eq!(pool.call(&["SET", "order:3", "by-pool"]).await, "+OK\r\n");
    let mut newer = RawClient::connect(lg.addr).await;
    let refused = newer.call(&["SET", "order:3", "by-newer"]).await;
    assert!(refused.contains("(another holder has it)"), "{refused}");
    assert_eq!(counts(&lg), [1, 1, 0, 0, 0]);
}

/// Every family of write: several keys of which some are guarded (each
/// lock checked), a write that fails in Redis (its error passes), and the
/// ones lockgate cannot check with the write (MULTI, a script), refused
/// whole in refuse mode and passed (counted) in report mode.
#[tokio::test]
async fn every_family_of_write_is_checked_or_refused_whole() {
    let (_redis, lg, mut r) = guarded(GuardMode::Refuse, UnlockedWriters::Refuse, 30_000).await;
    let mut a = RawClient::connect(lg.addr).await;
    assert_eq!(a.call(&["SETNX", "lock:order:1", "a"]).await, ":1\r\n");
    // Several keys: one lock held, one not.
    let refused = a
        .call(&["MSET", "user:1", "u", "order:1", "x", "order:2", "y"])
        .await;
    assert!(
        refused.contains("order:2 is guarded by lock:order:2"),
        "{refused}"
    );
    assert!(!exists(&mut r, "user:1").await && !exists(&mut r, "order:1").await);
    assert_eq!(a.call(&["SETNX", "lock:order:2", "a"]).await, ":1\r\n");
    assert_eq!(
        a.call(&["MSET", "user:1", "u", "order:1", "x", "order:2", "y"])
            .await,
        "+OK\r\n"
    );
    assert_eq!(a.call(&["DEL", "order:1", "order:2:z"]).await, ":1\r\n");
    // Redis's own error passes whole.
    assert_eq!(a.call(&["SET", "order:2:list", "s"]).await, "+OK\r\n");
    let wrong = a.call(&["LPUSH", "order:2:list", "v"]).await;
    assert!(wrong.starts_with("-WRONGTYPE"), "{wrong}");
    // MULTI: checked whole at EXEC. Held: applied whole, in order.
    assert_eq!(a.call(&["MULTI"]).await, "+OK\r\n");
    assert_eq!(a.call(&["SET", "user:2", "u"]).await, "+QUEUED\r\n");
    assert_eq!(a.call(&["SET", "order:1", "in-tx"]).await, "+QUEUED\r\n");
    assert_eq!(a.call(&["GET", "order:1"]).await, "+QUEUED\r\n");
    assert_eq!(a.call(&["LPUSH", "order:2:list", "v"]).await, "+QUEUED\r\n");
    let exec = a.call(&["EXEC"]).await;
    assert!(
        exec.starts_with("*4\r\n+OK\r\n+OK\r\n$5\r\nin-tx\r\n-WRONGTYPE"),
        "{exec}"
    );
    // One lock not held: refused whole, nothing applied.
    assert_eq!(a.call(&["MULTI"]).await, "+OK\r\n");
    assert_eq!(a.call(&["SET", "user:4", "u"]).await, "+QUEUED\r\n");
    assert_eq!(a.call(&["SET", "order:1", "x"]).await, "+QUEUED\r\n");
    assert_eq!(a.call(&["SET", "order:5", "x"]).await, "+QUEUED\r\n");
    let refused = a.call(&["EXEC"]).await;
    assert!(
        refused.contains("order:5 is guarded by lock:order:5")
            && refused.contains("the transaction was discarded"),
        "{refused}"
    );
    assert!(!exists(&mut r, "user:4").await);
    assert_eq!(get(&mut r, "order:1").await.as_deref(), Some("in-tx"));
    // A command Redis refuses to queue: Redis's own EXECABORT.
    assert_eq!(a.call(&["MULTI"]).await, "+OK\r\n");
    assert_eq!(a.call(&["SET", "order:1", "y"]).await, "+QUEUED\r\n");
    assert!(a
        .call(&["SET", "order:1"])
        .await
        .starts_with("-ERR wrong number"));
    assert!(a.call(&["EXEC"]).await.starts_with("-EXECABORT"));
    // Under WATCH: cannot be checked exactly, refused whole.
    assert_eq!(a.call(&["WATCH", "user:9"]).await, "+OK\r\n");
    assert_eq!(a.call(&["MULTI"]).await, "+OK\r\n");
    assert_eq!(a.call(&["SET", "order:1", "z"]).await, "+QUEUED\r\n");
    let refused = a.call(&["EXEC"]).await;
    assert!(
        refused.contains("under WATCH cannot be checked exactly"),
        "{refused}"
    );
    assert_eq!(get(&mut r, "order:1").await.as_deref(), Some("in-tx"));
    // UNWATCH lifts it.
    assert_eq!(a.call(&["WATCH", "user:9"]).await, "+OK\r\n");
    assert_eq!(a.call(&["UNWATCH"]).await, "+OK\r\n");
    assert_eq!(a.call(&["MULTI"]).await, "+OK\r\n");
    assert_eq!(a.call(&["SET", "order:1", "w"]).await, "+QUEUED\r\n");
    assert_eq!(a.call(&["EXEC"]).await, "*1\r\n+OK\r\n");
    // A function cannot be checked with its writes: refused.
    let refused = a.call(&["FCALL", "f", "1", "order:1"]).await;
    assert!(
        refused.contains("runs code lockgate cannot check"),
        "{refused}"
    );
    // A script inside MULTI neither: the transaction aborts.
    assert_eq!(a.call(&["MULTI"]).await, "+OK\r\n");
    let refused = a.call(&["EVAL", "return 1", "1", "order:1"]).await;
    assert!(
        refused.contains("runs code lockgate cannot check"),
        "{refused}"
    );
    assert!(a.call(&["EXEC"]).await.starts_with("-EXECABORT"));
    assert_eq!(get(&mut r, "order:1").await.as_deref(), Some("w"));
    // A script on other keys passes.
    assert_eq!(
        a.call(&[
            "EVAL",
            "return redis.call('SET', KEYS[1], 'x')",
            "1",
            "user:3"
        ])
        .await,
        "+OK\r\n"
    );
    // Applied, per lock: MSET 2, DEL 2, SET and LPUSH 1 each (whatever
    // Redis then answered), the first transaction 2, the last 1; the
    // transaction Redis aborted is not run, so not counted. Refused: MSET,
    // the transaction with order:5, the one under WATCH, the function, the
    // script inside MULTI.
    assert_eq!(counts(&lg), [9, 5, 0, 0, 0]);

    // Report mode: a transaction and a script from a connection that never
    // took the lock are applied and counted.
    let (_redis, lg, mut r) = guarded(GuardMode::Report, UnlockedWriters::Allow, 30_000).await;
    let mut a = RawClient::connect(lg.addr).await;
    assert_eq!(a.call(&["MULTI"]).await, "+OK\r\n");
    assert_eq!(a.call(&["SET", "order:1", "in-tx"]).await, "+QUEUED\r\n");
    assert_eq!(a.call(&["EXEC"]).await, "*1\r\n+OK\r\n");
    assert_eq!(
        a.call(&[
            "EVAL",
            "return redis.call('SET', KEYS[1], 'x')",
            "1",
            "order:1"
        ])
        .await,
        "+OK\r\n"
    );
    assert_eq!(get(&mut r, "order:1").await.as_deref(), Some("x"));
    assert_eq!(counts(&lg), [0, 0, 0, 2, 0]);
}

/// A reload adds, changes and removes guards without a restart.
#[tokio::test]
async fn guards_follow_a_reload() {
    let (redis, lg, _r) = guarded(GuardMode::Report, UnlockedWriters::Refuse, 30_000).await;
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(c.call(&["SET", "order:9", "x"]).await, "+OK\r\n");
    let mut next = config(&redis.addr(), "a", 30_000);
    next.locks.guards = vec![orders(GuardMode::Refuse, UnlockedWriters::Refuse)];
    lg.ctx.locks.reload(&next);
    assert!(c
        .call(&["SET", "order:9", "y"])
        .await
        .starts_with("-ERR lockgate: write refused"));
    next.locks.guards.clear();
    lg.ctx.locks.reload(&next);
    assert_eq!(c.call(&["SET", "order:9", "z"]).await, "+OK\r\n");
}

/// Client scripts whose declared keys are guarded run behind the lock
/// check, their body unchanged and seeing their own keys and arguments;
/// an `EVALSHA` of a body lockgate has not seen is answered `NOSCRIPT`
/// (refuse mode), so the client sends the body.
#[tokio::test]
async fn client_scripts_on_guarded_keys_run_behind_the_check() {
    let (_redis, lg, mut r) = guarded(GuardMode::Refuse, UnlockedWriters::Refuse, 30_000).await;
    let mut a = RawClient::connect(lg.addr).await;
    let body = "redis.call('SET', KEYS[1], ARGV[1]) return {KEYS[1], ARGV[1], #KEYS, #ARGV}";
    let shows = "*4\r\n$7\r\norder:1\r\n$1\r\nv\r\n:1\r\n:2\r\n";
    let refused = a.call(&["EVAL", body, "1", "order:1", "v", "w"]).await;
    assert!(
        refused.contains("order:1 is guarded by lock:order:1"),
        "{refused}"
    );
    assert!(!exists(&mut r, "order:1").await);
    assert_eq!(a.call(&["SETNX", "lock:order:1", "a"]).await, ":1\r\n");
    assert_eq!(
        a.call(&["EVAL", body, "1", "order:1", "v", "w"]).await,
        shows
    );
    assert_eq!(get(&mut r, "order:1").await.as_deref(), Some("v"));
    // A script's own error and nil reply pass as they are.
    let err = a
        .call(&[
            "EVAL",
            "return redis.call('LPUSH', KEYS[1], 'x')",
            "1",
            "order:1",
        ])
        .await;
    assert!(err.starts_with("-WRONGTYPE"), "{err}");
    assert_eq!(
        a.call(&["EVAL", "return nil", "1", "order:1:x"]).await,
        "$-1\r\n"
    );
    // EVALSHA: unseen, NOSCRIPT; once loaded through lockgate, guarded.
    let sha = sha1_smol::Sha1::from("return redis.call('SET', KEYS[1], 'z')")
        .digest()
        .to_string();
    assert!(direct_load(&mut r, "return redis.call('SET', KEYS[1], 'z')").await == sha);
    assert_eq!(
        a.call(&["EVALSHA", &sha, "1", "order:1"]).await,
        "-NOSCRIPT No matching script. Please use EVAL.\r\n"
    );
    assert_eq!(
        a.call(&["SCRIPT", "LOAD", "return redis.call('SET', KEYS[1], 'z')"])
            .await,
        format!("${}\r\n{sha}\r\n", sha.len())
    );
    assert_eq!(a.call(&["EVALSHA", &sha, "1", "order:1"]).await, "+OK\r\n");
    let mut b = RawClient::connect(lg.addr).await;
    assert!(b
        .call(&["EVALSHA", &sha, "1", "order:1"])
        .await
        .contains("write refused"));
    // A script that declares it writes nothing is not guarded.
    let ro = "#!lua flags=no-writes\nreturn redis.call('GET', KEYS[1])";
    assert_eq!(b.call(&["EVAL", ro, "1", "order:1"]).await, "$1\r\nz\r\n");
    // [applied, refused, ..]: the EVALs and EVALSHA that ran to their end
    // behind the check (3; a script that raised an error answers that
    // error alone, uncounted), the first EVAL and B's EVALSHA refused (2).
    assert_eq!(counts(&lg), [3, 2, 0, 0, 0]);
}

/// `SCRIPT LOAD` straight on Redis: the body's SHA1.
async fn direct_load(r: &mut RawClient, body: &str) -> String {
    let reply = r.call(&["SCRIPT", "LOAD", body]).await;
    reply.lines().nth(1).unwrap_or_default().to_string()
}

/// The PTTL of `key` on the quorum's primary, ms.
async fn pttl_on_primary(q: &support::quorum::Cluster, key: &str) -> i64 {
    let reply = q.on_primary(&["PTTL", key]).await;
    reply
        .trim_start_matches(':')
        .trim()
        .parse()
        .expect("an integer")
}

/// With the locks on the quorum's masters and the data on the primary,
/// each acquisition leaves a guard record on the primary that guarded
/// writes check; it follows the lock: extended, taken over, released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_quorum_a_guard_record_on_the_primary_follows_the_lock() {
    let q = support::quorum::Cluster::start(3, |c| {
        c.locks.default_lease_ms = 30_000;
        c.locks.guards = vec![orders(GuardMode::Refuse, UnlockedWriters::Refuse)];
    })
    .await;
    until!(
        "the command table",
        !q.lg.ctx.locks.guard_table.get().is_empty()
    );
    let record = "lockgate:guard:{lock:order:1}";
    let mut a = q.client().await;
    assert_eq!(a.call(&["SETNX", "lock:order:1", "a"]).await, ":1\r\n");
    // Opened after the acquisition: not the pool connection that made it.
    let mut b = q.client().await;
    let owner = q
        .on_master(0, &["GET", "lockgate:owner:{lock:order:1}"])
        .await;
    assert_eq!(q.on_primary(&["GET", record]).await, owner);
    let pttl = pttl_on_primary(&q, record).await;
    assert!((1..=30_000).contains(&pttl), "{pttl}");
    assert_eq!(a.call(&["SET", "order:1", "a"]).await, "+OK\r\n");
    let refused = b.call(&["SET", "order:1", "b"]).await;
    assert!(refused.contains("(another holder has it)"), "{refused}");
    // Extended: the record's expiry moves with the lease.
    assert_eq!(
        a.call(&["PEXPIRE", "lock:order:1", "90000"]).await,
        ":1\r\n"
    );
    let pttl = pttl_on_primary(&q, record).await;
    assert!(pttl > 60_000, "{pttl}");
    // Released: the record goes, and the old holder's writes with it.
    assert_eq!(a.call(&["DEL", "lock:order:1"]).await, ":1\r\n");
    assert_eq!(q.on_primary(&["EXISTS", record]).await, ":0\r\n");
    let refused = a.call(&["SET", "order:1", "late"]).await;
    assert!(refused.contains("(nobody holds it)"), "{refused}");
    // Taken over (GETSET): the taker writes, the holder it replaced not.
    assert_eq!(b.call(&["SETNX", "lock:order:1", "b"]).await, ":1\r\n");
    let mut c = q.client().await;
    assert_eq!(
        c.call(&["GETSET", "lock:order:1", "c"]).await,
        "$1\r\nb\r\n"
    );
    assert_eq!(c.call(&["SET", "order:1", "c"]).await, "+OK\r\n");
    let refused = b.call(&["SET", "order:1", "b"]).await;
    assert!(
        refused.contains("no longer held by this connection (another holder has it now)"),
        "{refused}"
    );
    assert_eq!(q.on_primary(&["GET", "order:1"]).await, "$1\r\nc\r\n");
    assert_eq!(m(&q.lg.ctx.locks.metrics.guard_record_failures), 0);
}

/// Unmodified redis-py, RESP2 and RESP3: a legacy holder's writes, a
/// transaction pipeline and a registered script pass while it holds the
/// lock and are refused once its lease ran out
/// (`tests/py/redis_py_guarded.py`).
#[tokio::test]
async fn redis_py_holders_write_while_they_hold_and_are_refused_after() {
    let script =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/py/redis_py_guarded.py");
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
    for protocol in ["2", "3"] {
        let (_redis, lg, _r) = guarded(GuardMode::Refuse, UnlockedWriters::Allow, 2_000).await;
        let mut command = std::process::Command::new(&python);
        command
            .arg(&script)
            .arg(lg.addr.ip().to_string())
            .arg(lg.addr.port().to_string())
            .arg(protocol)
            .arg("2000");
        let output =
            support::process::run_limited_async(command, None, std::time::Duration::from_secs(60))
                .await;
        let (out, err) = (
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr),
        );
        assert!(
            output.status.success() && out.contains("checks passed"),
            "RESP{protocol}: {}\nstdout:\n{out}\nstderr:\n{err}",
            output.status
        );
        let [applied, refused, ..] = counts(&lg);
        assert!(
            applied >= 5 && refused == 4,
            "RESP{protocol}: {:?}",
            counts(&lg)
        );
    }
}

/// A sidecar's app talks to localhost, with no readiness probe in between:
/// with guards in refuse mode, a holder's write sent the moment lockgate
/// listens is checked, not refused for want of Redis's command table
/// (df57308: `-ERR lockgate: write refused: cannot tell yet whether SET
/// writes a guarded key (Redis's command table is not loaded)`). Here the
/// table's read is held up by pausing Redis; the client waits in the
/// listen queue meanwhile, and `/readyz` says not ready until it is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_sent_as_lockgate_starts_waits_for_the_command_table() {
    let redis = RedisServer::start();
    let mut r = RawClient::connect(redis.addr()).await;
    assert_eq!(r.call(&["CLIENT", "PAUSE", "800", "ALL"]).await, "+OK\r\n");
    let mut c = config(&redis.addr(), "a", 30_000);
    c.locks.guards = vec![orders(GuardMode::Refuse, UnlockedWriters::Allow)];
    let lg = Lockgate::start_with_admin(c).await;
    let admin = lg.admin.expect("an admin listener");
    let ready = support::ops::http_get(admin, "/readyz").await;
    // Not ready: Redis does not answer yet, and the table is not read.
    assert_eq!(ready.status, 503, "{}", ready.body);
    let mut a = RawClient::connect(lg.addr).await;
    let pipeline = [
        support::cmd(&["SETNX", "lock:order:7", "a"]),
        support::cmd(&["SET", "order:7", "by-a"]),
    ]
    .concat();
    a.send(&pipeline).await;
    let replies = support::show(&a.read_raw_frames(2).await);
    assert_eq!(replies, ":1\r\n+OK\r\n");
    assert_eq!(counts(&lg)[0], 1, "the write was checked and applied");
    until!(
        "/readyz to say ready",
        support::ops::http_get(admin, "/readyz").await.status == 200
    );
    lg.stop().await;
}

/// The wait for the command table has a bound: on a Redis that never
/// gives `COMMAND` (renamed away), lockgate serves clients once
/// `locks.guard_table_wait_ms` is past, refuses what it cannot check with
/// an error that says why, and `/readyz` names the table meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_command_table_lockgate_serves_after_the_bound_and_says_why() {
    let redis = RedisServer::start_with(&["--rename-command", "COMMAND", ""]);
    let mut c = config(&redis.addr(), "a", 30_000);
    c.locks.guards = vec![orders(GuardMode::Refuse, UnlockedWriters::Allow)];
    c.locks.guard_table_wait_ms = 300;
    let lg = Lockgate::start_with_admin(c).await;
    let admin = lg.admin.expect("an admin listener");
    let mut a = RawClient::connect(lg.addr).await;
    let start = std::time::Instant::now();
    assert_eq!(a.call(&["SETNX", "lock:order:7", "a"]).await, ":1\r\n");
    let waited = start.elapsed();
    assert!(
        waited < std::time::Duration::from_secs(20),
        "served within the bound (and the box's slack): {waited:?}"
    );
    let refused = a.call(&["SET", "order:7", "by-a"]).await;
    assert!(
        refused.starts_with("-ERR") && refused.contains("command table"),
        "{refused}"
    );
    let ready = support::ops::http_get(admin, "/readyz").await;
    assert_eq!(ready.status, 503, "{}", ready.body);
    assert!(ready.body.contains("command table"), "{}", ready.body);
    let mut direct = RawClient::connect(redis.addr()).await;
    assert_eq!(
        direct.call(&["GET", "order:7"]).await,
        "$-1\r\n",
        "nothing written"
    );
    lg.stop().await;
}
