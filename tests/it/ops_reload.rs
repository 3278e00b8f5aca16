//! Hot reload, against a real redis-server: `LOCKGATE RELOAD`
//! changes a lock pattern while a client keeps a pipelined `SET`/`GET`
//! stream going (every reply checked, none lost or reordered, no
//! connection dropped), the new pattern applies to the next command of an
//! open connection, invalid configurations are refused and the old rules
//! kept; and SIGHUP does the same for the built binary.

use crate::support;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use lockgate::context::ReloadHook;
use lockgate::Config;
use support::binary::Captured as Binary;
use support::locks::pttl;
use support::ops::{call, try_http_get, Ops};
use support::{cmd, frame_len, free_port, show, RawClient, RedisServer, WAIT};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{watch, Semaphore};

/// A config file's text: `keys` as the lock patterns, `filter` as the log
/// filter, and `extra` appended.
fn config_text(keys: &[&str], filter: &str, extra: &str) -> String {
    let keys: Vec<String> = keys.iter().map(|k| format!("\"{k}\"")).collect();
    format!(
        "[locks]\ninstance_id = \"ops-reload\"\nkeys = [{}]\n\n[log]\nfilter = \"{filter}\"\n{extra}",
        keys.join(", ")
    )
}

/// The command-line overrides of these tests: the upstream.
fn overrides(upstream: &str) -> impl Fn(Config) -> Config + Clone + Send + Sync + 'static {
    let upstream = upstream.to_string();
    move |mut c: Config| {
        c.upstream.addr = upstream.clone();
        c
    }
}

/// Writes `text` to `path` whole (a rename, as editors and config
/// managers do).
fn write_config(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write config");
    std::fs::rename(&tmp, path).expect("rename config");
}

/// The pairs per batch of the stream.
const PAIRS: u64 = 100;
/// Batches in flight at most.
const IN_FLIGHT: usize = 4;
/// The streamed key.
const STREAM_KEY: &str = "ops:stream:x";

/// A client that keeps pipelined batches of `SET x i` / `GET x` going on
/// one connection, and checks every reply in order on the other half.
struct Stream {
    verified: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    writer: tokio::task::JoinHandle<u64>,
    reader: tokio::task::JoinHandle<u64>,
}

impl Stream {
    async fn start(addr: std::net::SocketAddr) -> Stream {
        let stream = TcpStream::connect(addr).await.expect("connect stream");
        stream.set_nodelay(true).expect("nodelay");
        let (mut rd, mut wr) = stream.into_split();
        let verified = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let slots = Arc::new(Semaphore::new(IN_FLIGHT));
        // (batches sent, writer done)
        let (sent_tx, mut sent_rx) = watch::channel((0u64, false));
        let writer = {
            let (stop, slots) = (stop.clone(), slots.clone());
            tokio::spawn(async move {
                let limit = Instant::now() + Duration::from_secs(120);
                let mut b = 0u64;
                while !stop.load(Ordering::Relaxed) && Instant::now() < limit {
                    let permit = tokio::time::timeout(WAIT, slots.clone().acquire_owned())
                        .await
                        .expect("replies keep coming back")
                        .expect("semaphore");
                    permit.forget();
                    let mut bytes = Vec::new();
                    for j in 0..PAIRS {
                        let i = (b * PAIRS + j).to_string();
                        bytes.extend_from_slice(&cmd(&["SET", STREAM_KEY, &i]));
                        bytes.extend_from_slice(&cmd(&["GET", STREAM_KEY]));
                    }
                    wr.write_all(&bytes).await.expect("stream write");
                    b += 1;
                    sent_tx.send_replace((b, false));
                }
                sent_tx.send_replace((b, true));
                // Keep the write half (and so the connection) open until
                // the reader is done.
                let _ = sent_tx.closed().await;
                drop(wr);
                b
            })
        };
        let reader = {
            let verified = verified.clone();
            tokio::spawn(async move {
                let mut buf = BytesMut::new();
                let mut b = 0u64;
                loop {
                    let (sent, done) = *tokio::time::timeout(
                        WAIT,
                        sent_rx.wait_for(|&(sent, done)| sent > b || done),
                    )
                    .await
                    .expect("the writer goes on")
                    .expect("writer alive");
                    if sent == b && done {
                        return b;
                    }
                    for j in 0..PAIRS {
                        let i = b * PAIRS + j;
                        let want_get = format!("${}\r\n{i}\r\n", i.to_string().len());
                        for want in ["+OK\r\n", want_get.as_str()] {
                            let frame = loop {
                                if let Some(n) = frame_len(&buf) {
                                    break buf.split_to(n);
                                }
                                let read = tokio::time::timeout(WAIT, rd.read_buf(&mut buf)).await;
                                match read {
                                    Ok(Ok(n)) if n > 0 => {}
                                    other => panic!(
                                        "stream: no reply for pair {i} of batch {b} ({other:?})"
                                    ),
                                }
                            };
                            assert_eq!(show(&frame), want, "stream reply for pair {i}");
                        }
                    }
                    b += 1;
                    verified.store(b, Ordering::Relaxed);
                    slots.add_permits(1);
                }
            })
        };
        Stream {
            verified,
            stop,
            writer,
            reader,
        }
    }

    fn verified(&self) -> u64 {
        self.verified.load(Ordering::Relaxed)
    }

    /// Waits until `n` batches have been checked.
    async fn until_verified(&self, n: u64) {
        let deadline = Instant::now() + WAIT;
        while self.verified() < n {
            assert!(
                !self.reader.is_finished() && !self.writer.is_finished(),
                "the stream stopped early"
            );
            assert!(
                Instant::now() < deadline,
                "stream stuck at {} batches (waiting for {n})",
                self.verified()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Stops the writer; returns (sent, checked) once the reader has
    /// checked every reply of every batch sent.
    async fn finish(self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        let checked = tokio::time::timeout(WAIT, self.reader)
            .await
            .expect("reader finishes")
            .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
        let sent = tokio::time::timeout(WAIT, self.writer)
            .await
            .expect("writer finishes")
            .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
        (sent, checked)
    }
}

/// `LOCKGATE RELOAD` through `c`.
async fn reload(c: &mut RawClient) -> String {
    show(&c.call_raw(&["LOCKGATE", "RELOAD"]).await)
}

/// A passed-through SETNX leaves no TTL; a lock gets the default lease.
async fn is_lock(c: &mut RawClient, key: &str) -> bool {
    assert_eq!(
        c.call_s(&["SETNX", key, "v"]).await,
        ":1\r\n",
        "SETNX {key}"
    );
    let t = pttl(c, key).await;
    assert!(t == -1 || (1..=30_000).contains(&t), "PTTL {key} = {t}");
    t > 0
}

/// lockgate started from a config file (plus [`overrides`]) with a
/// reload hook on that file whose log-filter setter records what it is
/// given (and refuses filters containing `[`).
struct Reloadable {
    lg: Ops,
    path: PathBuf,
    filters: Arc<Mutex<Vec<String>>>,
    _dir: tempfile::TempDir,
}

impl Reloadable {
    async fn start(upstream: &str, text: &str) -> Reloadable {
        let dir = tempfile::tempdir().expect("tempdir");
        let path: PathBuf = dir.path().join("lockgate.toml");
        write_config(&path, text);
        let effective = overrides(upstream);
        let config = effective(Config::from_file(&path).expect("config file"));
        let lg = Ops::start(config).await;
        let filters: Arc<Mutex<Vec<String>>> = Arc::default();
        let recorded = filters.clone();
        *lockgate::sync::lock(&lg.ctx.reload) = Some(ReloadHook {
            path: path.clone(),
            effective: Box::new(effective),
            set_log_filter: Box::new(move |f: &str| {
                if f.contains('[') {
                    return Err(format!("invalid log.filter `{f}`"));
                }
                recorded.lock().expect("filters").push(f.to_string());
                Ok(())
            }),
        });
        Reloadable {
            lg,
            path,
            filters,
            _dir: dir,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_changes_a_lock_pattern_under_a_pipelined_stream_and_refuses_bad_configs() {
    let redis = RedisServer::start();
    let r = Reloadable::start(&redis.addr(), &config_text(&["lock:*"], "info", "")).await;
    let (lg, path, filters) = (&r.lg, &r.path, &r.filters);
    let filters_seen = || filters.lock().expect("filters").clone();

    // A connection opened before the reload, and the admin one.
    let mut c = lg.client().await;
    let mut admin = lg.client().await;
    assert!(
        !is_lock(&mut c, "app:job:0").await,
        "app:job:0 a lock before the reload"
    );

    let stream = Stream::start(lg.addr).await;
    stream.until_verified(3).await;
    let connections = lg.ctx.metrics.connections_total.load(Ordering::Relaxed);

    // The new pattern.
    write_config(
        path,
        &config_text(&["lock:*", "app:job:*"], "lockgate=debug", ""),
    );
    let at = stream.verified();
    assert_eq!(reload(&mut admin).await, "$8\r\nreloaded\r\n");
    assert_eq!(filters_seen(), ["lockgate=debug"]);
    // The next command of the open connection sees it.
    assert!(
        is_lock(&mut c, "app:job:1").await,
        "app:job:1 not a lock after the reload"
    );
    let mut fresh = lg.client().await;
    assert!(is_lock(&mut fresh, "app:job:2").await);
    let shown = call(&mut admin, &["LOCKGATE", "CONFIG", "TOML"]).await;
    let shown = Config::from_toml(shown.text()).expect("CONFIG is TOML");
    assert_eq!(shown.locks.keys, ["lock:*", "app:job:*"]);
    assert_eq!(shown.log.filter, "lockgate=debug");
    stream.until_verified(at + 5).await;

    // Invalid configurations: refused, naming why; the old rules stay.
    let refusals = [
        ("[locks\nkeys = [\n".to_string(), "invalid config file"),
        ("[locks]\nkeyz = [\"x:*\"]\n".to_string(), "keyz"),
        (
            "[locks]\nkeys = [\"lock:*\"]\ndefault_lease_ms = 0\n".to_string(),
            "locks.default_lease_ms",
        ),
        (
            config_text(&["lock:*", "app:job2:*"], "lockgate=[", ""),
            "invalid log.filter",
        ),
    ];
    for (text, why) in &refusals {
        write_config(path, text);
        let r = reload(&mut admin).await;
        assert!(
            r.starts_with("-ERR lockgate: reload refused, old configuration kept: ")
                && r.contains(why),
            "reload of {text:?} answered {r:?} (expected a refusal naming {why:?})"
        );
    }
    assert_eq!(
        filters_seen(),
        ["lockgate=debug"],
        "a refused config changed the log filter"
    );
    assert!(
        is_lock(&mut c, "app:job:3").await,
        "old rules lost after a refused reload"
    );
    assert!(
        !is_lock(&mut c, "app:job2:1").await,
        "a refused config's pattern applied"
    );
    let shown = call(&mut admin, &["LOCKGATE", "CONFIG", "TOML"]).await;
    let shown = Config::from_toml(shown.text()).expect("CONFIG is TOML");
    assert_eq!(shown.locks.keys, ["lock:*", "app:job:*"]);
    assert_eq!(shown.locks.default_lease_ms, 30_000);

    // What cannot change without a restart is named.
    write_config(
        path,
        &config_text(
            &["lock:*", "app:job:*"],
            "lockgate=debug",
            "\n[proxy]\nmax_clients = 5\n",
        ),
    );
    let want = "reloaded; needs a restart to change: proxy";
    assert_eq!(
        reload(&mut admin).await,
        format!("${}\r\n{want}\r\n", want.len())
    );
    assert!(lg.get("/healthz").await.status == 200);

    stream.until_verified(stream.verified() + 3).await;
    let (sent, checked) = stream.finish().await;
    assert_eq!(sent, checked, "every batch's replies checked");
    assert!(
        checked >= at + 8,
        "stream: {checked} batches, {at} before the reload"
    );
    eprintln!("stream: {checked} batches of {PAIRS} SET/GET pairs checked, {at} before the reload");
    // No connection was dropped or replaced meanwhile.
    assert_eq!(
        lg.ctx.metrics.connections_total.load(Ordering::Relaxed),
        connections + 1,
        "only `fresh` connected since"
    );
    let last = (checked * PAIRS - 1).to_string();
    assert_eq!(
        c.call_s(&["GET", STREAM_KEY]).await,
        format!("${}\r\n{last}\r\n", last.len())
    );
    assert_eq!(c.call_s(&["PING"]).await, "+PONG\r\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_on_the_binary_applies_a_changed_pattern_and_keeps_connections() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("lockgate.toml");
    write_config(&path, &config_text(&["lock:*"], "info", ""));
    let (port, admin_port) = (free_port(), free_port());
    let listen = format!("127.0.0.1:{port}");
    let admin: std::net::SocketAddr = format!("127.0.0.1:{admin_port}").parse().expect("addr");
    let mut bin = Binary::spawn(&[
        "--config",
        path.to_str().expect("utf-8 path"),
        "--listen",
        &listen,
        "--upstream",
        &redis.addr(),
        "--admin-listen",
        &admin.to_string(),
    ]);
    // Ready: the admin listener answers and lockgate serves clients.
    let deadline = Instant::now() + WAIT;
    loop {
        if try_http_get(admin, "/healthz")
            .await
            .is_some_and(|r| r.status == 200)
        {
            break;
        }
        if let Some(status) = bin.child.try_wait().expect("try_wait") {
            panic!("lockgate exited at start ({status}):\n{}", bin.output());
        }
        assert!(
            Instant::now() < deadline,
            "lockgate never became healthy:\n{}",
            bin.output()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut c = RawClient::connect(&listen).await;
    assert_eq!(c.call_s(&["PING"]).await, "+PONG\r\n");
    bin.until_logged("lockgate ready", 1).await;
    assert!(!is_lock(&mut c, "app:job:a").await, "a lock before SIGHUP");

    write_config(&path, &config_text(&["lock:*", "app:job:*"], "info", ""));
    bin.signal("-HUP");
    bin.until_logged("SIGHUP: configuration reloaded", 1).await;
    // The same connection, next command: the new pattern.
    assert!(
        is_lock(&mut c, "app:job:b").await,
        "not a lock after SIGHUP"
    );

    // An invalid file: refused with a log line, the old rules kept.
    write_config(
        &path,
        "[locks]\nkeys = [\"lock:*\"]\ndefault_lease_ms = 0\n",
    );
    bin.signal("-HUP");
    bin.until_logged("SIGHUP: new configuration refused", 1)
        .await;
    assert!(
        bin.output().contains("locks.default_lease_ms"),
        "the refusal names the key:\n{}",
        bin.output()
    );
    assert!(
        is_lock(&mut c, "app:job:c").await,
        "old rules lost after a refused SIGHUP"
    );
    assert_eq!(c.call_s(&["PING"]).await, "+PONG\r\n");

    // SIGTERM still drains and exits cleanly.
    drop(c);
    bin.signal("-TERM");
    let deadline = Instant::now() + WAIT;
    let status = loop {
        if let Some(status) = bin.child.try_wait().expect("try_wait") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "lockgate did not exit on SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(status.success(), "exit {status}:\n{}", bin.output());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_applies_lease_and_storm_settings() {
    let redis = RedisServer::start();
    // A lease and storm settings; spins on a held key are absorbed (one
    // probe a minute) and answered at once (no parking).
    let file = |lease: u64, rate: u64| {
        format!(
            "[locks]\ninstance_id = \"ops-reload\"\nkeys = [\"lock:*\"]\n\
             default_lease_ms = {lease}\n\n[locks.retry]\npark_ms = 0\n\
             probe_interval_ms = 60000\nmax_attempts_per_sec = {rate}\n"
        )
    };
    let r = Reloadable::start(&redis.addr(), &file(30_000, 0)).await;
    let mut holder = r.lg.client().await;
    let mut spinner = r.lg.client().await;
    let mut admin = r.lg.client().await;
    assert_eq!(
        holder.call_s(&["SETNX", "lock:r:held", "h"]).await,
        ":1\r\n"
    );
    let smoothed = || {
        r.lg.ctx
            .locks
            .storm
            .metrics
            .smoothed
            .load(Ordering::Relaxed)
    };
    for _ in 0..5 {
        assert_eq!(
            spinner.call_s(&["SETNX", "lock:r:held", "s"]).await,
            ":0\r\n"
        );
    }
    assert_eq!(smoothed(), 0, "no smoothing with max_attempts_per_sec = 0");

    write_config(&r.path, &file(5_000, 10));
    assert_eq!(reload(&mut admin).await, "$8\r\nreloaded\r\n");
    // The lease: the next acquisition gets the new default.
    assert_eq!(holder.call_s(&["SETNX", "lock:r:new", "h"]).await, ":1\r\n");
    let t = pttl(&mut holder, "lock:r:new").await;
    assert!((1..=5_000).contains(&t), "lease after reload: PTTL {t}");
    // The smoothing rate: 10 attempts/s, so of back-to-back spins at
    // least every other one is delayed (a delayed reply makes the next
    // spin come an interval later).
    let started = Instant::now();
    for _ in 0..4 {
        assert_eq!(
            spinner.call_s(&["SETNX", "lock:r:held", "s"]).await,
            ":0\r\n"
        );
    }
    assert!(
        smoothed() >= 1,
        "locks.retry.max_attempts_per_sec reloaded to 10 but no reply was smoothed \
         (4 spins in {:?})",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_of_the_admin_password_takes_effect_or_is_named() {
    let redis = RedisServer::start();
    let r = Reloadable::start(&redis.addr(), &config_text(&["lock:*"], "info", "")).await;
    let mut admin = r.lg.client().await;
    write_config(
        &r.path,
        &config_text(&["lock:*"], "info", "\n[admin]\npassword = \"pw\"\n"),
    );
    let answer = reload(&mut admin).await;
    let shown = call(&mut admin, &["LOCKGATE", "CONFIG", "TOML"]).await;
    let shown = shown.text().to_string();
    // [admin] needs a restart: CONFIG shows what is in force (no password
    // yet), and the reload said so.
    assert!(!shown.contains("password = \"********\""), "{shown}");
    assert!(
        answer.contains("needs a restart to change: admin"),
        "{answer}"
    );
    let mut fresh = r.lg.client().await;
    let stats = fresh.call_s(&["LOCKGATE", "STATS"]).await;
    assert!(
        answer.contains("admin") || stats.starts_with("-NOPERM"),
        "reload answered {answer:?}, LOCKGATE CONFIG shows a password, yet a new \
         connection runs LOCKGATE STATS without one: {}",
        &stats[..stats.len().min(40)]
    );
}
