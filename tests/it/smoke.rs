//! The harness itself and the simplest pass-through, against a real Redis.

use crate::support;

use support::{cmd, Lockgate, RawClient, RedisServer};

#[tokio::test]
async fn ping_set_get_through_lockgate() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(c.call_raw(&["PING"]).await, b"+PONG\r\n");
    assert_eq!(c.call_raw(&["SET", "k", "v"]).await, b"+OK\r\n");
    assert_eq!(c.call_raw(&["GET", "k"]).await, b"$1\r\nv\r\n");
    // The value really is on the upstream.
    let mut direct = RawClient::connect(redis.addr()).await;
    assert_eq!(direct.call_raw(&["GET", "k"]).await, b"$1\r\nv\r\n");
    c.send(b"PING\r\n").await;
    assert_eq!(c.read_raw().await, b"+PONG\r\n");
    c.send(&cmd(&["ECHO", "x"])).await;
    assert_eq!(c.read_raw().await, b"$1\r\nx\r\n");
    lg.stop().await;
}
