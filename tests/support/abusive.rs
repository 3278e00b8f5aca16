//! Helpers of `tests/serial/abusive_clients.rs` and `clients_gone.rs` (in
//! the serial binary: they measure the process), the proxy's
//! configuration, and what Redis and `/proc/self` say about connections,
//! buffers, memory and descriptors.

use std::sync::atomic::AtomicU64;

use lockgate::metrics::ProxyMetrics;
use lockgate::Config;

use super::resilience::client_list;
use super::resp::direct;
use super::RawClient;

pub fn config(upstream: &str) -> Config {
    let mut c = Config::default();
    c.upstream.addr = upstream.to_string();
    c.proxy.shutdown_grace_ms = 300;
    c
}

pub fn get(counter: &AtomicU64) -> u64 {
    ProxyMetrics::get(counter)
}

/// Whether a connection named `name` is on Redis now.
pub async fn on_redis(redis: &str, name: &str) -> bool {
    let needle = format!(" name={name} ");
    client_list(redis, None)
        .await
        .iter()
        .any(|l| l.contains(&needle))
}

/// Connects through lockgate and names the upstream connection, so the test
/// can find it in Redis's `CLIENT LIST`.
pub async fn named(addr: std::net::SocketAddr, name: &str) -> RawClient {
    let mut c = RawClient::connect(addr).await;
    assert_eq!(c.call_raw(&["CLIENT", "SETNAME", name]).await, b"+OK\r\n");
    c
}

/// lockgate's resident memory now (this process), in bytes.
pub fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|kb| kb.trim().parse::<u64>().ok())
        .expect("VmRSS")
        * 1024
}

/// The `omem` (output buffer bytes) of Redis's connection named `name`.
pub async fn omem(redis: &str, name: &str) -> Option<u64> {
    let needle = format!(" name={name} ");
    let lines = client_list(redis, None).await;
    let line = lines.iter().find(|l| l.contains(&needle))?;
    line.split(' ')
        .find_map(|f| f.strip_prefix("omem="))
        .and_then(|v| v.parse().ok())
}

/// Descriptors open in this process (lockgate's and the test's).
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").expect("fd dir").count()
}

/// Redis's `connected_clients`, asked on a connection of its own (counted).
pub async fn connected_clients(redis: &str) -> u64 {
    let info = direct(redis, &["INFO", "clients"]).await;
    info.lines()
        .find_map(|l| l.strip_prefix("connected_clients:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("connected_clients")
}
