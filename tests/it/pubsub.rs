//! Pass-through of the modes where replies stop being one per request,
//! against real redis-server: pub/sub (messages with no request, PING in
//! subscribed mode, RESP3 pushes), CLIENT REPLY OFF/SKIP and MONITOR, and
//! RESET back to request/reply. lockgate copies these streams uncounted
//! ("raw") until RESET.

use crate::support;

use support::passthrough::pipeline;
use support::{cmd, show, Lockgate, RawClient, RedisServer};

/// A subscriber and a publisher: every frame each of them receives, in the
/// order the scenario reads them. Each step waits for the frame it expects,
/// so the scenario is deterministic on any Redis.
async fn pubsub_scenario(sub_addr: &str, pub_addr: &str) -> Vec<Vec<u8>> {
    let mut sub = RawClient::connect(sub_addr).await;
    let mut publ = RawClient::connect(pub_addr).await;
    let mut log = Vec::new();
    sub.send(&cmd(&["SUBSCRIBE", "ch1", "ch2"])).await;
    log.push(sub.read_raw().await);
    log.push(sub.read_raw().await);
    log.push(sub.call_raw(&["PSUBSCRIBE", "news.*"]).await);
    log.push(sub.call_raw(&["SSUBSCRIBE", "shard:1"]).await);
    // Subscriptions are confirmed, so messages published now are delivered.
    log.push(publ.call_raw(&["PUBLISH", "ch1", "hello"]).await);
    log.push(sub.read_raw().await);
    log.push(
        publ.call_bin(&[b"PUBLISH", b"news.tech", b"a\r\n*1\r\n\0b"])
            .await,
    );
    log.push(sub.read_raw().await);
    log.push(publ.call_raw(&["SPUBLISH", "shard:1", "s"]).await);
    log.push(sub.read_raw().await);
    // PING and commands refused in subscribed mode.
    log.push(sub.call_raw(&["PING"]).await);
    log.push(sub.call_raw(&["PING", "hi"]).await);
    log.push(sub.call_raw(&["GET", "x"]).await);
    // Unsubscribed channels get nothing: the next message is ch2's.
    log.push(sub.call_raw(&["UNSUBSCRIBE", "ch1"]).await);
    log.push(publ.call_raw(&["PUBLISH", "ch1", "lost"]).await);
    log.push(publ.call_raw(&["PUBLISH", "ch2", "after"]).await);
    log.push(sub.read_raw().await);
    // A burst of messages arrives whole and in order.
    let mut burst = Vec::new();
    for i in 0..500 {
        burst.extend_from_slice(&cmd(&["PUBLISH", "ch2", &format!("m{i}")]));
    }
    publ.send(&burst).await;
    for _ in 0..500 {
        log.push(publ.read_raw().await);
    }
    for _ in 0..500 {
        log.push(sub.read_raw().await);
    }
    log.push(sub.call_raw(&["PUNSUBSCRIBE", "news.*"]).await);
    log.push(sub.call_raw(&["SUNSUBSCRIBE"]).await);
    // RESET leaves subscribed mode; request/reply works again.
    log.push(sub.call_raw(&["RESET"]).await);
    log.push(sub.call_raw(&["SET", "ps:k", "v"]).await);
    log.push(sub.call_raw(&["GET", "ps:k"]).await);
    log.push(sub.call_raw(&["GET", "ps:missing"]).await);
    log.push(publ.call_raw(&["PUBLISH", "ch2", "nobody"]).await);
    log.push(sub.call_raw(&["PING"]).await);
    log
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pubsub_messages_ping_and_reset_match_redis() {
    let redis = RedisServer::start();
    let twin = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let lga = lg.addr.to_string();
    let via = pubsub_scenario(&lga, &lga).await;
    let direct = pubsub_scenario(&twin.addr(), &twin.addr()).await;
    assert_eq!(via.len(), direct.len());
    for (i, (v, d)) in via.iter().zip(&direct).enumerate() {
        assert_eq!(show(v), show(d), "frame {i}");
    }
    // Publisher straight on Redis, subscriber through lockgate.
    let mixed = pubsub_scenario(&lga, &redis.addr()).await;
    assert_eq!(mixed, direct);

    let s = |i: usize| show(&via[i]);
    assert_eq!(s(0), "*3\r\n$9\r\nsubscribe\r\n$3\r\nch1\r\n:1\r\n");
    assert_eq!(s(1), "*3\r\n$9\r\nsubscribe\r\n$3\r\nch2\r\n:2\r\n");
    assert_eq!(s(2), "*3\r\n$10\r\npsubscribe\r\n$6\r\nnews.*\r\n:3\r\n");
    assert_eq!(s(4), ":1\r\n");
    assert_eq!(s(5), "*3\r\n$7\r\nmessage\r\n$3\r\nch1\r\n$5\r\nhello\r\n");
    assert_eq!(
        s(7),
        "*4\r\n$8\r\npmessage\r\n$6\r\nnews.*\r\n$9\r\nnews.tech\r\n$9\r\na\r\n*1\r\n\0b\r\n"
    );
    assert_eq!(s(9), "*3\r\n$8\r\nsmessage\r\n$7\r\nshard:1\r\n$1\r\ns\r\n");
    assert_eq!(s(10), "*2\r\n$4\r\npong\r\n$0\r\n\r\n");
    assert_eq!(s(11), "*2\r\n$4\r\npong\r\n$2\r\nhi\r\n");
    assert!(s(12).starts_with("-ERR Can't execute 'get'"), "{}", s(12));
    assert_eq!(s(14), ":0\r\n", "nobody listens on ch1 any more");
    assert_eq!(s(16), "*3\r\n$7\r\nmessage\r\n$3\r\nch2\r\n$5\r\nafter\r\n");
    assert_eq!(
        s(17 + 500 + 499),
        "*3\r\n$7\r\nmessage\r\n$3\r\nch2\r\n$4\r\nm499\r\n"
    );
    let n = via.len();
    assert_eq!(s(n - 6), "+RESET\r\n");
    assert_eq!(s(n - 5), "+OK\r\n");
    assert_eq!(s(n - 4), "$1\r\nv\r\n");
    assert_eq!(s(n - 3), "$-1\r\n");
    assert_eq!(s(n - 2), ":0\r\n", "RESET unsubscribed from ch2");
    assert_eq!(s(n - 1), "+PONG\r\n");
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribe_and_reset_pipelined_in_one_write() {
    let redis = RedisServer::start();
    let twin = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut request = Vec::new();
    for args in [
        &["SET", "a", "1"][..],
        &["SUBSCRIBE", "c"],
        &["PING"],
        &["PSUBSCRIBE", "p*"],
        &["RESET"],
        &["GET", "a"],
        &["SUBSCRIBE", "d"],
        &["RESET"],
        &["INCR", "a"],
        &["ECHO", "done"],
    ] {
        request.extend_from_slice(&cmd(args));
    }
    let expected = "+OK\r\n\
        *3\r\n$9\r\nsubscribe\r\n$1\r\nc\r\n:1\r\n\
        *2\r\n$4\r\npong\r\n$0\r\n\r\n\
        *3\r\n$10\r\npsubscribe\r\n$2\r\np*\r\n:2\r\n\
        +RESET\r\n\
        $1\r\n1\r\n\
        *3\r\n$9\r\nsubscribe\r\n$1\r\nd\r\n:1\r\n\
        +RESET\r\n\
        :2\r\n\
        $4\r\ndone\r\n";
    let direct = pipeline(twin.addr(), request.clone(), None, 10).await;
    assert_eq!(show(&direct), expected, "Redis itself");
    let via = pipeline(lg.addr, request.clone(), None, 10).await;
    assert_eq!(show(&via), expected);
    let via = pipeline(lg.addr, request, Some(vec![3, 1, 5]), 10).await;
    assert_eq!(show(&via), expected, "sent in pieces");
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resp3_pubsub_push_frames_and_reset_back_to_resp2() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut sub = RawClient::connect(lg.addr).await;
    let mut publ = RawClient::connect(lg.addr).await;
    let hello = sub.call_raw(&["HELLO", "3"]).await;
    assert!(hello.starts_with(b"%7\r\n"), "{}", show(&hello));
    assert_eq!(
        show(&sub.call_raw(&["SUBSCRIBE", "r3"]).await),
        ">3\r\n$9\r\nsubscribe\r\n$2\r\nr3\r\n:1\r\n"
    );
    // In RESP3 ordinary commands work while subscribed, and pushes come
    // between their replies.
    assert_eq!(sub.call_raw(&["SET", "k", "v"]).await, b"+OK\r\n");
    assert_eq!(publ.call_raw(&["PUBLISH", "r3", "m"]).await, b":1\r\n");
    sub.send(&cmd(&["GET", "nope"])).await;
    assert_eq!(
        show(&sub.read_raw().await),
        ">3\r\n$7\r\nmessage\r\n$2\r\nr3\r\n$1\r\nm\r\n"
    );
    assert_eq!(sub.read_raw().await, b"_\r\n");
    assert_eq!(sub.call_raw(&["PING"]).await, b"+PONG\r\n");
    assert_eq!(sub.call_raw(&["RESET"]).await, b"+RESET\r\n");
    // Back to RESP2, unsubscribed.
    assert_eq!(sub.call_raw(&["GET", "nope"]).await, b"$-1\r\n");
    assert_eq!(publ.call_raw(&["PUBLISH", "r3", "m"]).await, b":0\r\n");
    assert_eq!(sub.call_raw(&["GET", "k"]).await, b"$1\r\nv\r\n");
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_request_in_subscribed_mode_keeps_reply_order() {
    // Redis answers everything before a malformed request, then the error,
    // then closes. lockgate must do the same in subscribed mode, where it
    // does not count replies.
    let redis = RedisServer::start();
    let twin = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut request = cmd(&["PING"]);
    request.extend_from_slice(&cmd(&["PING", "second"]));
    request.extend_from_slice(b"*1\r\n$-5\r\n");
    let mut outputs = Vec::new();
    for addr in [twin.addr(), lg.addr.to_string()] {
        let mut c = RawClient::connect(addr).await;
        assert_eq!(
            show(&c.call_raw(&["SUBSCRIBE", "c"]).await),
            "*3\r\n$9\r\nsubscribe\r\n$1\r\nc\r\n:1\r\n"
        );
        c.send(&request).await;
        outputs.push(show(&c.read_to_eof().await));
    }
    let expected = "*2\r\n$4\r\npong\r\n$0\r\n\r\n\
        *2\r\n$4\r\npong\r\n$6\r\nsecond\r\n\
        -ERR Protocol error: invalid bulk length\r\n";
    assert_eq!(outputs[0], expected, "Redis itself");
    assert_eq!(outputs[1], expected, "through lockgate");
    lg.stop().await;
}

/// CLIENT REPLY OFF/SKIP and MONITOR, then RESET, on one connection; every
/// frame received, and what the stream holds after a final malformed request
/// (which shows whether replies are counted again after RESET).
async fn reply_mode_scenario(addr: &str) -> Vec<Vec<u8>> {
    let mut c = RawClient::connect(addr).await;
    let mut other = RawClient::connect(addr).await;
    let mut log = Vec::new();
    // OFF: nothing comes back until ON.
    c.send(&cmd(&["CLIENT", "REPLY", "OFF"])).await;
    c.send(&cmd(&["SET", "a", "1"])).await;
    c.send(&cmd(&["INCR", "a"])).await;
    log.push(c.call_raw(&["CLIENT", "REPLY", "ON"]).await);
    log.push(c.call_raw(&["GET", "a"]).await);
    // SKIP: only the next command's reply is dropped.
    c.send(&cmd(&["CLIENT", "REPLY", "SKIP"])).await;
    c.send(&cmd(&["INCR", "a"])).await;
    log.push(c.call_raw(&["GET", "a"]).await);
    // MONITOR streams other clients' commands until RESET.
    log.push(c.call_raw(&["MONITOR"]).await);
    assert_eq!(other.call_raw(&["SET", "mon", "x"]).await, b"+OK\r\n");
    let line = c.read_raw().await;
    assert!(
        line.starts_with(b"+") && line.ends_with(b"\"SET\" \"mon\" \"x\"\r\n"),
        "monitor line {:?}",
        show(&line)
    );
    log.push(c.call_raw(&["RESET"]).await);
    log.push(c.call_raw(&["GET", "mon"]).await);
    // Counting again: a malformed request is answered after the replies
    // before it.
    let mut req = cmd(&["GET", "a"]);
    req.extend_from_slice(&cmd(&["PING"]));
    req.extend_from_slice(b"*1\r\n$-5\r\n");
    c.send(&req).await;
    log.push(c.read_to_eof().await);
    log
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_reply_off_skip_and_monitor_until_reset() {
    let redis = RedisServer::start();
    let twin = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let direct = reply_mode_scenario(&twin.addr()).await;
    let via = reply_mode_scenario(&lg.addr.to_string()).await;
    let shown = |log: &[Vec<u8>]| log.iter().map(|r| show(r)).collect::<Vec<_>>();
    assert_eq!(
        shown(&direct),
        [
            "+OK\r\n",
            "$1\r\n2\r\n",
            "$1\r\n3\r\n",
            "+OK\r\n",
            "+RESET\r\n",
            "$1\r\nx\r\n",
            "$1\r\n3\r\n+PONG\r\n-ERR Protocol error: invalid bulk length\r\n",
        ],
        "Redis itself"
    );
    assert_eq!(shown(&via), shown(&direct));
    lg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsubscribing_from_everything_returns_to_request_reply() {
    // In RESP2 a client whose last subscription ends is no longer in
    // subscribed mode: Redis answers ordinary commands again without RESET.
    let redis = RedisServer::start();
    let twin = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut request = Vec::new();
    for args in [
        &["SUBSCRIBE", "c1", "c2"][..],
        &["UNSUBSCRIBE", "c1"],
        // Without arguments: from all that is left (one, so the order of
        // Redis's replies is known).
        &["UNSUBSCRIBE"],
        &["SET", "u", "1"],
        &["INCR", "u"],
        &["PSUBSCRIBE", "x*"],
        &["PUNSUBSCRIBE", "x*"],
        &["GET", "u"],
    ] {
        request.extend_from_slice(&cmd(args));
    }
    let expected = "*3\r\n$9\r\nsubscribe\r\n$2\r\nc1\r\n:1\r\n\
        *3\r\n$9\r\nsubscribe\r\n$2\r\nc2\r\n:2\r\n\
        *3\r\n$11\r\nunsubscribe\r\n$2\r\nc1\r\n:1\r\n\
        *3\r\n$11\r\nunsubscribe\r\n$2\r\nc2\r\n:0\r\n\
        +OK\r\n:2\r\n\
        *3\r\n$10\r\npsubscribe\r\n$2\r\nx*\r\n:1\r\n\
        *3\r\n$12\r\npunsubscribe\r\n$2\r\nx*\r\n:0\r\n\
        $1\r\n2\r\n";
    let direct = pipeline(twin.addr(), request.clone(), None, 9).await;
    assert_eq!(show(&direct), expected, "Redis itself");
    let mut c = RawClient::connect(lg.addr).await;
    c.send(&request).await;
    assert_eq!(show(&c.read_raw_frames(9).await), expected);
    // Request/reply on the same connection afterwards.
    assert_eq!(c.call_raw(&["GET", "u"]).await, b"$1\r\n2\r\n");
    assert_eq!(c.call_raw(&["PING"]).await, b"+PONG\r\n");
    lg.stop().await;
}
