//! A fault-injecting TCP relay: one network path between two real
//! processes that a test can cut and heal. Put between lockgate and a lock
//! master (lockgate is given the relay's address), between lockgate and
//! its primary, or between a client and lockgate. Modes:
//!
//! - [`Mode::Pass`]: bytes flow both ways.
//! - [`Mode::Blackhole`]: nothing flows, nothing closes: bytes sent either
//!   way wait (as in the kernels' buffers of a path that drops every
//!   packet), new connections are accepted and wait for their far side.
//!   A heal within the peers' timeouts delivers what waited, as TCP's
//!   retransmission does; a peer's own timeout is what ends it.
//! - [`Mode::Delay`]: every chunk is held this long before it goes on.
//! - [`Mode::Cut`]: the path is gone: every connection through it is
//!   closed at once (both sides see the close), new ones are closed on
//!   accept.
//!
//! [`Relay::half_close`] sends a FIN towards the side that connected (its
//! reads end; its writes still go through). The relay is a scripted part
//! only in the sense that a network is: both ends are real processes.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The connections a relay carries, each with its peer's address.
type Conns = Arc<Mutex<Vec<(IpAddr, JoinHandle<()>)>>>;

/// What the path does now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Bytes flow.
    Pass,
    /// Nothing flows and nothing closes.
    Blackhole,
    /// Each chunk waits this long.
    Delay(Duration),
    /// Every connection is closed; new ones too.
    Cut,
}

/// One relay: listens on a free loopback port, forwards to `target`.
pub struct Relay {
    /// Where to connect instead of `target`.
    pub addr: SocketAddr,
    /// The far side.
    pub target: SocketAddr,
    mode: watch::Sender<Mode>,
    /// Per connection: a FIN towards the connecting side.
    half_close: watch::Sender<u64>,
    accept: JoinHandle<()>,
    conns: Conns,
    /// Connections from this address are refused ([`Relay::refuse_from`]).
    refused: Arc<Mutex<Option<IpAddr>>>,
}

impl Relay {
    /// A relay to `target`, passing.
    pub async fn start(target: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind relay");
        let addr = listener.local_addr().expect("relay addr");
        let (mode, _) = watch::channel(Mode::Pass);
        let (half_close, _) = watch::channel(0u64);
        let conns: Conns = Arc::default();
        let refused: Arc<Mutex<Option<IpAddr>>> = Arc::default();
        let accept = {
            let (mode, half, conns) = (mode.subscribe(), half_close.subscribe(), conns.clone());
            let refused = refused.clone();
            tokio::spawn(async move {
                loop {
                    let Ok((client, peer)) = listener.accept().await else {
                        continue;
                    };
                    let from_refused = *refused.lock().expect("relay refused") == Some(peer.ip());
                    if *mode.borrow() == Mode::Cut || from_refused {
                        drop(client);
                        continue;
                    }
                    let task = tokio::spawn(carry(client, target, mode.clone(), half.clone()));
                    let mut c = conns.lock().expect("relay conns");
                    c.retain(|(_, t)| !t.is_finished());
                    c.push((peer.ip(), task));
                }
            })
        };
        Relay {
            addr,
            target,
            mode,
            half_close,
            accept,
            conns,
            refused,
        }
    }

    /// Closes every connection from `ip` and refuses new ones (`None`:
    /// none refused): a path cut for one peer only, told by the source
    /// address it connects from (a redis-server's `bind-source-addr`).
    pub fn refuse_from(&self, ip: Option<IpAddr>) {
        *self.refused.lock().expect("relay refused") = ip;
        if let Some(ip) = ip {
            let mut conns = self.conns.lock().expect("relay conns");
            for (_, t) in conns.iter().filter(|(from, _)| *from == ip) {
                t.abort();
            }
            conns.retain(|(from, _)| *from != ip);
        }
    }

    /// A relay to `target` given as `HOST:PORT`.
    pub async fn to(target: &str) -> Relay {
        Relay::start(target.parse().expect("a HOST:PORT")).await
    }

    /// The relay's address as `HOST:PORT`.
    pub fn host_port(&self) -> String {
        self.addr.to_string()
    }

    /// Sets the mode; [`Mode::Cut`] closes every connection now.
    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
        if mode == Mode::Cut {
            for (_, t) in self.conns.lock().expect("relay conns").drain(..) {
                t.abort();
            }
        }
    }

    /// Back to [`Mode::Pass`].
    pub fn heal(&self) {
        self.set(Mode::Pass);
    }

    /// The mode now.
    pub fn mode(&self) -> Mode {
        *self.mode.borrow()
    }

    /// A FIN towards the connecting side of every connection now open.
    pub fn half_close(&self) {
        self.half_close.send_modify(|n| *n += 1);
    }

    /// Connections carried now.
    pub fn open(&self) -> usize {
        let mut c = self.conns.lock().expect("relay conns");
        c.retain(|(_, t)| !t.is_finished());
        c.len()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.accept.abort();
        for (_, t) in self.conns.lock().expect("relay conns").drain(..) {
            t.abort();
        }
    }
}

/// Waits until the path lets bytes through; `false` once it is cut.
async fn flowing(mode: &mut watch::Receiver<Mode>) -> bool {
    loop {
        match *mode.borrow_and_update() {
            Mode::Pass | Mode::Delay(_) => return true,
            Mode::Cut => return false,
            Mode::Blackhole => {}
        }
        if mode.changed().await.is_err() {
            return false;
        }
    }
}

async fn carry(
    client: TcpStream,
    target: SocketAddr,
    mut mode: watch::Receiver<Mode>,
    half: watch::Receiver<u64>,
) {
    let _ = client.set_nodelay(true);
    // A blackholed path: the connection waits for its far side.
    if !flowing(&mut mode).await {
        return;
    }
    let Ok(server) = TcpStream::connect(target).await else {
        return;
    };
    let _ = server.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let up = pump(cr, sw, mode.clone(), None);
    let down = pump(sr, cw, mode, Some(half));
    // Either way's end (a close, the path cut) ends the other once it is
    // done with what it carries; a cut ends both.
    tokio::join!(up, down);
}

async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut mode: watch::Receiver<Mode>,
    mut half: Option<watch::Receiver<u64>>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    let mut fin_sent = false;
    loop {
        if !flowing(&mut mode).await {
            return;
        }
        let read = async {
            loop {
                tokio::select! {
                    r = from.read(&mut buf) => return Some(r),
                    changed = mode.changed() => {
                        // Blackholed or cut while idle: stop reading.
                        if changed.is_err() || !matches!(*mode.borrow(), Mode::Pass | Mode::Delay(_)) {
                            return None;
                        }
                    }
                    _ = async {
                        match half.as_mut() {
                            Some(h) => { let _ = h.changed().await; }
                            None => std::future::pending::<()>().await,
                        }
                    }, if !fin_sent => {
                        let _ = to.shutdown().await;
                        fin_sent = true;
                    }
                }
            }
        };
        let n = match read.await {
            None => continue,
            Some(Ok(0)) | Some(Err(_)) => {
                let _ = to.shutdown().await;
                return;
            }
            Some(Ok(n)) => n,
        };
        let delay = match *mode.borrow() {
            Mode::Delay(d) => Some(d),
            _ => None,
        };
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        // Read before a blackhole began: held until it heals.
        if !flowing(&mut mode).await {
            return;
        }
        if fin_sent || to.write_all(&buf[..n]).await.is_err() {
            if fin_sent {
                continue;
            }
            return;
        }
    }
}
