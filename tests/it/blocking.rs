//! Pass-through of blocking commands against real redis-server: replies
//! that come late, while other clients of the same lockgate carry on.

use crate::support;

use std::time::{Duration, Instant};

use support::passthrough::{pipeline, wait_blocked_clients};
use support::{cmd, encode, show, Lockgate, RawClient, RedisServer};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blpop_is_woken_by_another_clients_lpush() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut blocked = RawClient::connect(lg.addr).await;
    let mut other = RawClient::connect(lg.addr).await;
    blocked.send(&cmd(&["BLPOP", "q1", "q2", "0"])).await;
    wait_blocked_clients(&redis.addr(), 1).await;
    // A blocked client does not hold up other lockgate clients.
    assert_eq!(other.call_raw(&["SET", "x", "1"]).await, b"+OK\r\n");
    assert_eq!(other.call_raw(&["GET", "x"]).await, b"$1\r\n1\r\n");
    let mut third = RawClient::connect(lg.addr).await;
    assert_eq!(third.call_raw(&["PING"]).await, b"+PONG\r\n");
    assert_eq!(other.call_raw(&["LPUSH", "q2", "job"]).await, b":1\r\n");
    assert_eq!(
        show(&blocked.read_raw().await),
        "*2\r\n$2\r\nq2\r\n$3\r\njob\r\n"
    );
    // The woken connection carries on normally.
    assert_eq!(blocked.call_raw(&["LLEN", "q2"]).await, b":0\r\n");
    wait_blocked_clients(&redis.addr(), 0).await;
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blpop_timeout_returns_nil() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut c = RawClient::connect(lg.addr).await;
    let start = Instant::now();
    assert_eq!(c.call_raw(&["BLPOP", "empty", "0.2"]).await, b"*-1\r\n");
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(150),
        "returned after {took:?}"
    );
    // A pipeline around the timeout keeps its order.
    let mut req = cmd(&["SET", "k", "1"]);
    req.extend_from_slice(&cmd(&["BLPOP", "empty", "0.2"]));
    req.extend_from_slice(&cmd(&["GET", "k"]));
    c.send(&req).await;
    assert_eq!(
        show(&c.read_raw_frames(3).await),
        "+OK\r\n*-1\r\n$1\r\n1\r\n"
    );
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blmove_is_woken_by_a_push() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut blocked = RawClient::connect(lg.addr).await;
    let mut other = RawClient::connect(lg.addr).await;
    blocked
        .send(&cmd(&["BLMOVE", "src", "dst", "LEFT", "RIGHT", "0"]))
        .await;
    wait_blocked_clients(&redis.addr(), 1).await;
    assert_eq!(other.call_raw(&["RPUSH", "src", "a", "b"]).await, b":2\r\n");
    assert_eq!(blocked.read_raw().await, b"$1\r\na\r\n");
    assert_eq!(
        show(&other.call_raw(&["LRANGE", "dst", "0", "-1"]).await),
        "*1\r\n$1\r\na\r\n"
    );
    assert_eq!(
        show(&blocked.call_raw(&["LRANGE", "src", "0", "-1"]).await),
        "*1\r\n$1\r\nb\r\n"
    );
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xread_block_is_woken_by_xadd() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut blocked = RawClient::connect(lg.addr).await;
    let mut other = RawClient::connect(lg.addr).await;
    assert_eq!(
        other.call_raw(&["XADD", "s", "1-1", "f", "old"]).await,
        b"$3\r\n1-1\r\n"
    );
    blocked
        .send(&cmd(&["XREAD", "BLOCK", "0", "STREAMS", "s", "$"]))
        .await;
    wait_blocked_clients(&redis.addr(), 1).await;
    assert_eq!(
        other
            .call_bin(&[b"XADD", b"s", b"2-1", b"f", b"new\r\nline"])
            .await,
        b"$3\r\n2-1\r\n"
    );
    assert_eq!(
        show(&blocked.read_raw().await),
        "*1\r\n*2\r\n$1\r\ns\r\n*1\r\n*2\r\n$3\r\n2-1\r\n*2\r\n$1\r\nf\r\n$9\r\nnew\r\nline\r\n"
    );
    // XREAD BLOCK with a timeout and nothing new: a nil array.
    assert_eq!(
        blocked
            .call_raw(&["XREAD", "BLOCK", "100", "STREAMS", "s", "$"])
            .await,
        b"*-1\r\n"
    );
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_blocked_clients_do_not_block_the_rest() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut waiters = Vec::new();
    for i in 0..20 {
        let mut c = RawClient::connect(lg.addr).await;
        c.send(&cmd(&["BLPOP", &format!("wq{i}"), "0"])).await;
        waiters.push(c);
    }
    wait_blocked_clients(&redis.addr(), 20).await;
    // Meanwhile a pipeline on another connection is answered in full.
    let mut req = Vec::new();
    for i in 0..1000 {
        req.extend_from_slice(&encode(&[b"SET", format!("k{i}").as_bytes(), b"v"]));
    }
    req.extend_from_slice(&cmd(&["DBSIZE"]));
    let replies = pipeline(lg.addr, req, None, 1001).await;
    assert!(replies.ends_with(b":1000\r\n"));
    // Wake them in reverse order; each gets its own key.
    let mut pusher = RawClient::connect(lg.addr).await;
    for i in (0..20).rev() {
        let key = format!("wq{i}");
        assert_eq!(
            pusher.call_raw(&["RPUSH", &key, &i.to_string()]).await,
            b":1\r\n"
        );
        let got = waiters[i].read_raw().await;
        let val = i.to_string();
        assert_eq!(
            show(&got),
            format!(
                "*2\r\n${}\r\n{key}\r\n${}\r\n{val}\r\n",
                key.len(),
                val.len()
            )
        );
    }
    wait_blocked_clients(&redis.addr(), 0).await;
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_hanging_up_while_blocked_releases_its_upstream() {
    // Redis unblocks a blocked client the moment it hangs up, so the next
    // element pushed stays in the list for a live consumer. Through
    // lockgate the upstream connection must go too; while it stays blocked,
    // the next push is popped for a client that is gone, and lost. The long
    // grace period makes "released only at the end of the grace period"
    // fail here instead of passing slowly.
    let redis = RedisServer::start();
    let mut config = lockgate::Config::default();
    config.upstream.addr = redis.addr();
    config.proxy.shutdown_grace_ms = 60_000;
    let lg = Lockgate::start_with(config).await;
    let mut blocked = RawClient::connect(lg.addr).await;
    blocked.send(&cmd(&["BLPOP", "jobs", "0"])).await;
    wait_blocked_clients(&redis.addr(), 1).await;
    drop(blocked);
    wait_blocked_clients(&redis.addr(), 0).await;
    let mut producer = RawClient::connect(redis.addr()).await;
    assert_eq!(producer.call_raw(&["LPUSH", "jobs", "j1"]).await, b":1\r\n");
    assert_eq!(
        producer.call_raw(&["LLEN", "jobs"]).await,
        b":1\r\n",
        "the job was popped for a client that had hung up"
    );
    drop(lg);
}
