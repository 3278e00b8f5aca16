//! `--threads N`: N event loops, each accepting on its own SO_REUSEPORT
//! listener (lockgate::loops). The binary itself, in front of a real Redis:
//! connections land on every loop and each is served in full, lock
//! commands included; `proxy.max_clients` is one limit across the loops;
//! SIGTERM drains every loop.

use crate::support;

use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use support::binary::{self, Conn, Running};
use support::process::signal;
use support::{cmd, free_port, RedisServer, WAIT};

/// lockgate with `loops` event loops and `max_clients`; returns it and the
/// address it listens on.
fn start(redis: &RedisServer, loops: usize, max_clients: usize) -> (Running, String) {
    let dir = std::env::temp_dir().join(format!("lockgate-loops-{}", free_port()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let config = dir.join("lockgate.toml");
    std::fs::write(&config, format!("[proxy]\nmax_clients = {max_clients}\n")).expect("config");
    let config = config.to_str().expect("utf-8 path").to_string();
    let loops = loops.to_string();
    binary::start(&[
        "--config",
        &config,
        "--upstream",
        &redis.addr(),
        "--threads",
        &loops,
    ])
}

/// CPU ticks (utime + stime) of each thread of `pid`, by thread name (the
/// main thread's is named "main").
fn thread_ticks(pid: u32) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).expect("tasks") {
        let task = task.expect("task");
        let main = task.file_name().to_str() == Some(&pid.to_string());
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let name = match main {
            true => "main".to_string(),
            false => stat[open + 1..close].to_string(),
        };
        let fields: Vec<&str> = stat[close + 2..].split(' ').collect();
        let ticks = fields[11].parse::<u64>().unwrap_or(0) + fields[12].parse::<u64>().unwrap_or(0);
        out.push((name, ticks));
    }
    out
}

#[test]
fn every_loop_serves_connections_and_locks() {
    let redis = RedisServer::start();
    let (child, listen) = start(&redis, 2, 1000);
    let pid = child.0.id();
    // The listener accepts (into its backlog) a moment before the other
    // loops' threads start.
    let started = Instant::now();
    let before = loop {
        let ticks = thread_ticks(pid);
        if ticks.iter().any(|(name, _)| name == "lockgate-loop-1") {
            break ticks;
        }
        assert!(started.elapsed() < WAIT, "no second loop thread: {ticks:?}");
        std::thread::sleep(Duration::from_millis(20));
    };
    // 64 connections: SO_REUSEPORT hashes each to a loop, so both loops
    // get some (all on one: odds 2^-63). Each does enough work that a loop
    // serving any of them shows CPU time.
    let mut conns: Vec<Conn> = (0..64).map(|_| Conn::open(&listen)).collect();
    for round in 0..300 {
        for (i, c) in conns.iter_mut().enumerate() {
            let key = format!("k:{i}");
            assert_eq!(c.call(&["SET", &key, &round.to_string()]), "+OK");
            assert_eq!(c.call(&["GET", &key]), round.to_string());
        }
    }
    for (i, c) in conns.iter_mut().enumerate() {
        let lock = format!("lock:loops:{i}");
        assert_eq!(c.call(&["SETNX", &lock, "me"]), ":1");
        assert_eq!(c.call(&["SETNX", &lock, "me"]), ":0");
        // The lease the lock room gives a bare SETNX, whichever loop ran it.
        let mut direct = Conn::open(&redis.addr());
        let pttl: i64 = direct.call(&["PTTL", &lock])[1..].parse().expect("pttl");
        assert!(pttl > 0, "{lock} has no lease: {pttl}");
        assert_eq!(c.call(&["DEL", &lock]), ":1");
    }
    let after = thread_ticks(pid);
    let busy = |name: &str| {
        let b = before
            .iter()
            .find(|(n, _)| n == name)
            .map_or(0, |(_, t)| *t);
        let a = after.iter().find(|(n, _)| n == name).map_or(0, |(_, t)| *t);
        a.saturating_sub(b)
    };
    assert!(busy("main") > 0, "the main loop served nothing: {after:?}");
    assert!(
        busy("lockgate-loop-1") > 0,
        "the second loop served nothing: {after:?}"
    );
}

#[test]
fn max_clients_is_one_limit_across_loops() {
    let redis = RedisServer::start();
    let (_child, listen) = start(&redis, 2, 4);
    let mut held: Vec<Conn> = Vec::new();
    for _ in 0..4 {
        let mut c = Conn::open(&listen);
        assert_eq!(c.call(&["PING"]), "+PONG");
        held.push(c);
    }
    // Whichever loop the fifth lands on, the slots are gone.
    for _ in 0..6 {
        let mut c = Conn::open(&listen);
        assert_eq!(c.call(&["PING"]), "-ERR max number of clients reached");
    }
    drop(held.pop());
    // The freed slot is anyone's, on either loop.
    let deadline = Instant::now() + WAIT;
    loop {
        let mut c = Conn::open(&listen);
        let mut line = String::new();
        c.w.write_all(&cmd(&["PING"])).expect("write");
        let _ = c.r.read_line(&mut line);
        if line.trim_end() == "+PONG" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the freed slot never came back: {line}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sigterm_drains_every_loop() {
    let redis = RedisServer::start();
    let (mut child, listen) = start(&redis, 3, 1000);
    let mut conns: Vec<Conn> = (0..12).map(|_| Conn::open(&listen)).collect();
    for c in &mut conns {
        assert_eq!(c.call(&["PING"]), "+PONG");
    }
    signal(child.0.id(), "-TERM");
    // Each loop's clients see their connection closed (drained: nothing
    // was owed), and the process exits.
    for c in &mut conns {
        let mut line = String::new();
        assert_eq!(
            c.r.read_line(&mut line).expect("read at drain"),
            0,
            "{line}"
        );
    }
    let started = Instant::now();
    loop {
        if let Some(status) = child.0.try_wait().expect("try_wait") {
            assert!(status.success(), "exit status {status}");
            break;
        }
        assert!(
            started.elapsed() < WAIT,
            "lockgate did not exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
