//! A reference point for `bench/passthrough.sh`, not part of lockgate: the
//! least a proxy built on tokio can do. One current-thread runtime (as
//! lockgate's default single event loop), one task per client connection,
//! `copy_bidirectional` between the client and its own upstream
//! connection: no parsing, no routing, no reply matching. What lockgate
//! costs over this row is lockgate's own work; what this row costs over
//! HAProxy is the runtime's.
//!
//! `cargo run --release --example tokio_copy -- LISTEN_ADDR UPSTREAM_ADDR`

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpStream};

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(listen), Some(upstream)) = (args.next(), args.next()) else {
        eprintln!("usage: tokio_copy LISTEN_ADDR UPSTREAM_ADDR");
        std::process::exit(2);
    };
    let upstream: SocketAddr = upstream
        .parse()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(async move {
            let listener = TcpListener::bind(&listen).await?;
            loop {
                let (mut client, _) = listener.accept().await?;
                tokio::spawn(async move {
                    let Ok(mut server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                });
            }
        })
}
