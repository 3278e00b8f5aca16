//! Helpers shared by the auth/RESP3, fault, binary and client tests (on top
//! of `tests/support` and its `RawClient`): a raw exchange read until the
//! server closes, `CLIENT LIST` queries on the real Redis, and a listener
//! that never completes a connection.

use std::time::Duration;

use tokio::net::{TcpSocket, TcpStream};

use crate::support::{show, RawClient};

/// Connects to `addr`, writes `bytes` and returns everything read until the
/// server closes the connection (see `RawClient::read_to_eof`).
pub async fn exchange_to_close(addr: impl tokio::net::ToSocketAddrs, bytes: &[u8]) -> Vec<u8> {
    let mut c = RawClient::connect(addr).await;
    c.send(bytes).await;
    c.read_to_eof().await
}

/// `CLIENT LIST` on a direct connection to Redis, as lines, without the line
/// of the connection that asked. `auth` is sent first when given.
pub async fn client_list(redis_addr: &str, auth: Option<&str>) -> Vec<String> {
    let mut d = RawClient::connect(redis_addr).await;
    if let Some(pw) = auth {
        assert_eq!(d.call_raw(&["AUTH", pw]).await, b"+OK\r\n");
    }
    let reply = d.call_raw(&["CLIENT", "LIST"]).await;
    let text = show(&reply);
    let body = text
        .split_once("\r\n")
        .map(|(_, rest)| rest)
        .unwrap_or_default();
    body.lines()
        .map(str::trim)
        .filter(|l| l.starts_with("id="))
        .filter(|l| !l.contains("cmd=client|list"))
        // lockgate's own shared connection is not a client session.
        .filter(|l| !l.contains(" name=lockgate-internal "))
        .map(str::to_string)
        .collect()
}

/// Waits until some connection on Redis is blocked in `command` (e.g.
/// `blpop`), so a test knows the command reached Redis.
pub async fn wait_blocked(redis_addr: &str, command: &str) {
    let needle = format!("cmd={command}");
    crate::until!(
        format!("a client blocked in {command} on Redis"),
        client_list(redis_addr, None)
            .await
            .iter()
            .any(|l| l.contains(&needle) && l.contains("flags=b"))
    );
}

/// A `HOST:PORT` that accepts TCP connections at the kernel level for no one:
/// the listener has a backlog of 0 and is filled by one connection that is
/// never accepted, so further SYNs are dropped and connects hang until the
/// connector's own timeout. Keep the returned value alive while it is used.
pub struct Blackhole {
    /// The address whose connects hang.
    pub addr: String,
    _listener: tokio::net::TcpListener,
    _fillers: Vec<TcpStream>,
}

impl Blackhole {
    /// Binds on loopback and fills the accept queue.
    pub async fn new() -> Blackhole {
        let socket = TcpSocket::new_v4().expect("socket");
        socket
            .bind("127.0.0.1:0".parse().expect("addr"))
            .expect("bind");
        let listener = socket.listen(0).expect("listen");
        let addr = listener.local_addr().expect("addr");
        let mut fillers = Vec::new();
        for _ in 0..8 {
            match tokio::time::timeout(Duration::from_millis(200), TcpStream::connect(addr)).await {
                Ok(Ok(s)) => fillers.push(s),
                Ok(Err(e)) => panic!("filling the backlog of {addr}: {e}"),
                Err(_) => {
                    return Blackhole {
                        addr: addr.to_string(),
                        _listener: listener,
                        _fillers: fillers,
                    }
                }
            }
        }
        panic!("the accept queue of {addr} never filled: connects would not hang");
    }
}

/// Decodes one whole RESP3 frame (RESP2 nulls excepted) for structural checks.
pub fn decode3(raw: &[u8]) -> redis_protocol::resp3::types::OwnedFrame {
    redis_protocol::resp3::decode::complete::decode(raw)
        .unwrap_or_else(|e| panic!("not RESP3: {e:?}: {:?}", show(raw)))
        .unwrap_or_else(|| panic!("not a whole frame: {:?}", show(raw)))
        .0
}
