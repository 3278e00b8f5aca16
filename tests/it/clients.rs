//! Real, unmodified clients through lockgate against a real Redis: redis-py
//! (RESP2 and RESP3, pipelines, transactions, pub/sub; recent versions send
//! HELLO 3 and CLIENT SETINFO on connect) and `redis-cli`.
//!
//! Needs `python3` with the `redis` package and `redis-cli`; when one is
//! missing the test fails and says how to install it (scripts/test.sh does).

use crate::support;

use std::process::Command;
use std::time::Duration;

use support::{run_limited_async, show, Lockgate, RedisServer};

const PIP_INSTALL: &str = "python3 -m pip install -q redis";

fn require_redis_py() {
    let probe = Command::new("python3")
        .args(["-c", "import redis, sys; print(redis.__version__)"])
        .output();
    match probe {
        Err(e) => panic!(
            "python3 is not available ({e}): install Python 3 and then `{PIP_INSTALL}` \
             (scripts/test.sh should do both)"
        ),
        Ok(out) if !out.status.success() => panic!(
            "the Python `redis` package is missing: run `{PIP_INSTALL}` \
             (scripts/test.sh should do it)\n{}",
            show(&out.stderr)
        ),
        Ok(_) => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_py_works_through_lockgate() {
    require_redis_py();
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/py/redis_py_smoke.py");
    let mut command = Command::new("python3");
    command
        .arg(script)
        .arg(lg.addr.ip().to_string())
        .arg(lg.addr.port().to_string());
    let out = run_limited_async(command, None, Duration::from_secs(120)).await;
    let stdout = show(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("redis-py smoke OK"),
        "redis-py through lockgate failed ({}).\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        show(&out.stderr)
    );
    // It really went through lockgate to this Redis.
    assert!(
        lockgate::metrics::ProxyMetrics::get(&lg.ctx.metrics.commands_total) > 200,
        "lockgate saw too few commands"
    );
    let direct = support::resp::direct(&redis.addr(), &["GET", "py:n:199"]).await;
    assert_eq!(direct, "$3\r\n199\r\n");
    lg.stop().await;
}

/// Runs `redis-cli` with `args` against `port` (stdin from `input`).
async fn redis_cli(port: u16, args: &[&str], input: Option<&str>) -> String {
    let mut command = Command::new("redis-cli");
    command
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args);
    // With input, stdin is closed after it: redis-cli runs the lines and exits.
    let input = input.map(|text| text.as_bytes().to_vec());
    let out = run_limited_async(command, input, Duration::from_secs(30)).await;
    assert!(
        out.status.success(),
        "redis-cli {args:?} failed: {}\n{}",
        out.status,
        show(&out.stderr)
    );
    show(&out.stdout)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cli_works_through_lockgate() {
    assert!(
        Command::new("redis-cli").arg("--version").output().is_ok(),
        "redis-cli is not installed (apt-get install redis-tools)"
    );
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let (via, to) = (lg.addr.port(), redis.port);

    assert_eq!(redis_cli(via, &["ping"], None).await, "PONG\n");
    assert_eq!(
        redis_cli(via, &["set", "cli:k", "hello"], None).await,
        "OK\n"
    );
    assert_eq!(redis_cli(via, &["get", "cli:k"], None).await, "hello\n");
    assert_eq!(redis_cli(to, &["get", "cli:k"], None).await, "hello\n");

    // The same output as against Redis directly, for a spread of replies.
    let script = "SET cli:a 1\nINCR cli:a\nGET cli:a\nGET cli:none\n\
                  HSET cli:h f v\nHGETALL cli:h\nLPUSH cli:l x y\nLRANGE cli:l 0 -1\n\
                  NOSUCHCOMMAND\nLPUSH cli:a z\nDEL cli:a cli:h cli:l\n";
    let through = redis_cli(via, &[], Some(script)).await;
    let reference = redis_cli(to, &[], Some(script)).await;
    assert_eq!(through, reference, "stdin script");
    assert!(through.starts_with("OK\n2\n2\n\n"), "{through}");
    for args in [
        &["-3", "hgetall", "cli:none"][..],
        &["-3", "hello", "3"][..],
        &["--no-raw", "mget", "cli:k", "cli:none"][..],
        &["-r", "3", "incr", "cli:n"][..],
        &["client", "setinfo", "lib-name", "x"][..],
    ] {
        let through = redis_cli(via, args, None).await;
        let reference = redis_cli(to, args, None).await;
        if args[1] == "hello" {
            // The connection id differs; the rest must not.
            let strip = |s: &str| {
                s.lines()
                    .filter(|l| !l.starts_with("id "))
                    .collect::<Vec<_>>()
                    .join("\n")
            };
            assert!(through.contains("proto 3"), "{through}");
            assert_eq!(strip(&through), strip(&reference), "{args:?}");
        } else if args[0] == "-r" {
            assert_eq!(through, "1\n2\n3\n", "{args:?}");
            assert_eq!(reference, "4\n5\n6\n", "{args:?}");
        } else {
            assert_eq!(through, reference, "{args:?}");
        }
    }
    lg.stop().await;
}
