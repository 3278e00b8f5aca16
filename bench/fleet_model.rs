//! A model of a fleet of lockgate instances on one hot key, for fleets too
//! large to run as processes on a small box (`bench/fleet.sh`, its model
//! table). Each of `--instances` lightweight instances is a task with one
//! spinning client, and follows the cross-instance protocol as lockgate's
//! storm room does, with lockgate's own Lua scripts
//! (`lockgate::script::{ACQUIRE, RELEASE}`) against a real Redis:
//!
//! - it attempts (`ACQUIRE`); acquired, it holds the lock `--hold-ms`,
//!   releases it (`RELEASE`, which wakes the queue's head) and attempts
//!   again at once;
//! - refused while first in the queue, it waits for its wake-up or one
//!   probe interval (`--probe-ms`), as lockgate's driver does;
//! - refused behind another instance (the script's "behind" fact, the
//!   place's scale s), it waits for its wake-up or s × `--ttl-ms` / 3, its
//!   renewal, as lockgate does.
//!
//! One client per instance is the worst case for the store: every handoff
//! crosses instances (no local handoff). After `--warmup-s` the counters,
//! `INFO commandstats` and Redis's own CPU (`INFO cpu`) are read, and again
//! at the end: the JSON line gives the measured window alone. Wake-ups
//! arrive on one
//! subscription connection subscribed to every instance's own channel
//! (`lockgate:wake:<prefix>`, one subscriber each, as in a real fleet);
//! commands go over `--connections` shared connections, so the model's
//! CPU stays small. What it does not model: several clients per instance,
//! parks ending, and the fleet's own CPU. One JSON line goes to stdout.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use lockgate::script;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{Mutex, Notify};
use tokio::time::Instant;

/// A model of a lockgate fleet on one key (see the file's doc).
#[derive(Debug, Parser)]
#[command(name = "fleet_model")]
struct Args {
    /// Redis port (127.0.0.1).
    #[arg(long)]
    port: u16,
    /// Instances, one spinning client each.
    #[arg(long, default_value_t = 1000)]
    instances: usize,
    /// Length of the measured run, seconds.
    #[arg(long, default_value_t = 8.0)]
    duration_s: f64,
    /// Seconds before it, not measured: every instance's first attempt
    /// (N places taken at once) is start-up, not the steady state.
    #[arg(long, default_value_t = 2.0)]
    warmup_s: f64,
    /// How long a winner holds the lock, ms.
    #[arg(long, default_value_t = 5)]
    hold_ms: u64,
    /// `locks.retry.queue_ttl_ms`.
    #[arg(long, default_value_t = 2000)]
    ttl_ms: u64,
    /// `locks.retry.probe_interval_ms`.
    #[arg(long, default_value_t = 100)]
    probe_ms: u64,
    /// `locks.retry.max_local_preference_ms`.
    #[arg(long, default_value_t = 500)]
    bound_ms: u64,
    /// Shared command connections.
    #[arg(long, default_value_t = 16)]
    connections: usize,
    /// The lock key.
    #[arg(long, default_value = "lock:model")]
    key: String,
}

/// A connection speaking raw RESP, one command at a time.
struct Conn {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
}

/// A reply: an integer, a bulk string, an array, or a status/error line.
#[derive(Debug)]
enum Reply {
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Vec<Reply>),
    Line,
}

impl Reply {
    fn int(&self, i: usize) -> i64 {
        match self {
            Reply::Array(items) => match items.get(i) {
                Some(Reply::Int(n)) => *n,
                _ => 0,
            },
            _ => 0,
        }
    }
}

impl Conn {
    async fn connect(port: u16) -> io::Result<Conn> {
        let stream = TcpStream::connect(("127.0.0.1", port)).await?;
        stream.set_nodelay(true)?;
        let (r, w) = stream.into_split();
        Ok(Conn {
            reader: BufReader::new(r),
            writer: w,
        })
    }

    async fn send(&mut self, args: &[&[u8]]) -> io::Result<()> {
        let request = lockgate::protocol::encode::command(args);
        self.writer.write_all(&request).await
    }

    async fn call(&mut self, args: &[&[u8]]) -> io::Result<Reply> {
        self.send(args).await?;
        self.read().await
    }

    async fn read(&mut self) -> io::Result<Reply> {
        let mut line = String::new();
        if self.reader.read_line(&mut line).await? == 0 {
            return Err(io::Error::other("connection closed"));
        }
        let line = line.trim_end();
        let (kind, rest) = line.split_at(1);
        let bad = || io::Error::other(format!("bad reply line {line:?}"));
        match kind {
            ":" => rest.parse().map(Reply::Int).map_err(|_| bad()),
            "$" => {
                let n: i64 = rest.parse().map_err(|_| bad())?;
                if n < 0 {
                    return Ok(Reply::Bulk(None));
                }
                let mut data = vec![0; n as usize + 2];
                self.reader.read_exact(&mut data).await?;
                data.truncate(n as usize);
                Ok(Reply::Bulk(Some(data)))
            }
            "*" | ">" => {
                let n: i64 = rest.parse().map_err(|_| bad())?;
                let mut items = Vec::new();
                for _ in 0..n.max(0) {
                    items.push(Box::pin(self.read()).await?);
                }
                Ok(Reply::Array(items))
            }
            "-" => Err(io::Error::other(line.to_string())),
            _ => Ok(Reply::Line),
        }
    }
}

/// `EVALSHA sha` on `keys` with `argv` over `conn`.
async fn evalsha(
    conn: &Mutex<Conn>,
    sha: &str,
    keys: &[&[u8]],
    argv: &[&[u8]],
) -> io::Result<Reply> {
    let numkeys = keys.len().to_string();
    let mut args: Vec<&[u8]> = vec![b"EVALSHA", sha.as_bytes(), numkeys.as_bytes()];
    args.extend_from_slice(keys);
    args.extend_from_slice(argv);
    conn.lock().await.call(&args).await
}

/// What the instances did, summed.
#[derive(Default)]
struct Counts {
    acquisitions: AtomicU64,
    /// Refused attempts while first in the queue (its probes).
    head_probes: AtomicU64,
    /// Refused attempts behind another instance (its renewals).
    renewals: AtomicU64,
    /// Wake-ups received.
    wakes: AtomicU64,
    /// Acquisitions per instance.
    per: Vec<AtomicU64>,
}

async fn instance(
    i: usize,
    args: Arc<Args>,
    pool: Arc<Vec<Mutex<Conn>>>,
    shas: Arc<(String, String)>,
    wake: Arc<Notify>,
    counts: Arc<Counts>,
    deadline: Instant,
) -> io::Result<()> {
    let prefix = format!("m{i}:");
    let value = format!("v{i}");
    let key = args.key.as_bytes();
    let (owner, queue, places) = (
        lockgate::lock::owner_key(key),
        lockgate::lock::queue_key(key),
        lockgate::lock::places_key(key),
    );
    let keys: [&[u8]; 4] = [key, &owner, &queue, &places];
    let (bound, ttl) = (args.bound_ms.to_string(), args.ttl_ms.to_string());
    let conn = &pool[i % pool.len()];
    let mut seq = 0u64;
    while Instant::now() < deadline {
        seq += 1;
        let token = format!("{prefix}{seq}");
        let argv: [&[u8]; 9] = [
            b"1",
            value.as_bytes(),
            token.as_bytes(),
            b"PX",
            b"30000",
            b"setnx",
            prefix.as_bytes(),
            bound.as_bytes(),
            ttl.as_bytes(),
        ];
        let reply = evalsha(conn, &shas.0, &keys, &argv).await?;
        // {reply, acquired, pttl, clock, yielded, behind, dropped}
        if reply.int(1) == 1 {
            counts.acquisitions.fetch_add(1, Ordering::Relaxed);
            counts.per[i].fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(args.hold_ms)).await;
            let argv: [&[u8]; 8] = [
                b"1",
                b"1",
                b"DEL",
                b"instance",
                prefix.as_bytes(),
                b"0",
                token.as_bytes(),
                b"",
            ];
            evalsha(conn, &shas.1, &keys, &argv).await?;
            continue;
        }
        let (pttl, scale) = (reply.int(2), reply.int(5));
        let wait = if scale > 0 {
            counts.renewals.fetch_add(1, Ordering::Relaxed);
            Duration::from_millis(args.ttl_ms / 3 * scale as u64)
        } else {
            counts.head_probes.fetch_add(1, Ordering::Relaxed);
            let probe = args.probe_ms;
            Duration::from_millis(if pttl > 0 {
                probe.min(pttl as u64)
            } else {
                probe
            })
        };
        let until = (Instant::now() + wait).min(deadline);
        tokio::select! {
            _ = wake.notified() => {}
            _ = tokio::time::sleep_until(until) => {}
        }
    }
    Ok(())
}

async fn run(args: Arc<Args>) -> anyhow::Result<String> {
    let mut admin = Conn::connect(args.port).await?;
    let acquire = load(&mut admin, script::ACQUIRE).await?;
    let release = load(&mut admin, script::RELEASE).await?;
    let shas = Arc::new((acquire, release));
    let mut pool = Vec::new();
    for _ in 0..args.connections.max(1) {
        pool.push(Mutex::new(Conn::connect(args.port).await?));
    }
    let pool = Arc::new(pool);

    // One subscription connection for every instance's channel.
    let mut sub = Conn::connect(args.port).await?;
    let mut wakes: HashMap<Vec<u8>, Arc<Notify>> = HashMap::new();
    for chunk in (0..args.instances).collect::<Vec<_>>().chunks(100) {
        let channels: Vec<String> = chunk
            .iter()
            .map(|i| format!("lockgate:wake:m{i}:"))
            .collect();
        let mut cmd: Vec<&[u8]> = vec![b"SUBSCRIBE"];
        cmd.extend(channels.iter().map(|c| c.as_bytes()));
        sub.send(&cmd).await?;
        for c in &channels {
            sub.read().await?;
            wakes.insert(c.as_bytes().to_vec(), Arc::new(Notify::new()));
        }
    }
    let counts = Arc::new(Counts {
        per: (0..args.instances).map(|_| AtomicU64::new(0)).collect(),
        ..Counts::default()
    });
    let listener = {
        let (wakes, counts) = (wakes.clone(), counts.clone());
        tokio::spawn(async move {
            while let Ok(Reply::Array(items)) = sub.read().await {
                if let Some(Reply::Bulk(Some(channel))) = items.get(1) {
                    if let Some(n) = wakes.get(channel) {
                        counts.wakes.fetch_add(1, Ordering::Relaxed);
                        n.notify_one();
                    }
                }
            }
        })
    };

    let begun = Instant::now();
    let deadline = begun + Duration::from_secs_f64(args.warmup_s + args.duration_s);
    let mut tasks = Vec::new();
    for i in 0..args.instances {
        let wake = wakes[format!("lockgate:wake:m{i}:").as_bytes()].clone();
        tasks.push(tokio::spawn(instance(
            i,
            args.clone(),
            pool.clone(),
            shas.clone(),
            wake,
            counts.clone(),
            deadline,
        )));
    }
    tokio::time::sleep_until(begun + Duration::from_secs_f64(args.warmup_s)).await;
    let start = Instant::now();
    let before = Snapshot::take(&counts, &mut admin).await?;
    tokio::time::sleep_until(deadline).await;
    let after = Snapshot::take(&counts, &mut admin).await?;
    let mut errors = 0;
    for t in tasks {
        if !matches!(t.await, Ok(Ok(()))) {
            errors += 1;
        }
    }
    let elapsed = after.at.duration_since(start).as_secs_f64();
    listener.abort();
    let per: Vec<u64> = (after.per.iter().zip(&before.per))
        .map(|(a, b)| a - b)
        .collect();
    let calls: Vec<String> = (after.calls.iter())
        .map(|(name, n)| (name, n - before.calls.get(name).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .map(|(name, n)| format!("\"{name}\":{n}"))
        .collect();
    Ok(format!(
        "{{\"instances\":{},\"elapsed_s\":{:.3},\"acquisitions\":{},\"head_probes\":{},\"renewals\":{},\
         \"wakes\":{},\"min_per_instance\":{},\"max_per_instance\":{},\"none\":{},\"errors\":{},\
         \"redis_ns\":{},\"calls\":{{{}}}}}",
        args.instances,
        elapsed,
        after.acquisitions - before.acquisitions,
        after.head_probes - before.head_probes,
        after.renewals - before.renewals,
        after.wakes - before.wakes,
        per.iter().min().copied().unwrap_or(0),
        per.iter().max().copied().unwrap_or(0),
        per.iter().filter(|&&n| n == 0).count(),
        errors,
        after.cpu_ns.saturating_sub(before.cpu_ns),
        calls.join(",")
    ))
}

/// The counters, Redis's commands and its CPU at one moment.
struct Snapshot {
    at: Instant,
    acquisitions: u64,
    head_probes: u64,
    renewals: u64,
    wakes: u64,
    per: Vec<u64>,
    calls: HashMap<String, u64>,
    cpu_ns: u64,
}

impl Snapshot {
    async fn take(counts: &Counts, admin: &mut Conn) -> anyhow::Result<Snapshot> {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let text = |r: Reply| match r {
            Reply::Bulk(Some(b)) => String::from_utf8_lossy(&b).into_owned(),
            _ => String::new(),
        };
        let stats = text(admin.call(&[b"INFO", b"commandstats"]).await?);
        let cpu = text(admin.call(&[b"INFO", b"cpu"]).await?);
        let calls = (stats.lines())
            .filter_map(|l| l.strip_prefix("cmdstat_"))
            .filter_map(|l| {
                let (name, rest) = l.split_once(':')?;
                let n = rest
                    .strip_prefix("calls=")?
                    .split(',')
                    .next()?
                    .parse()
                    .ok()?;
                Some((name.to_string(), n))
            })
            .filter(|(name, _)| !matches!(name.as_str(), "info" | "subscribe" | "script|load"))
            .collect();
        // used_cpu_sys and used_cpu_user: seconds, to the µs.
        let cpu_s: f64 = (cpu.lines())
            .filter(|l| l.starts_with("used_cpu_sys:") || l.starts_with("used_cpu_user:"))
            .filter_map(|l| l.split_once(':')?.1.trim().parse::<f64>().ok())
            .sum();
        Ok(Snapshot {
            at: Instant::now(),
            acquisitions: get(&counts.acquisitions),
            head_probes: get(&counts.head_probes),
            renewals: get(&counts.renewals),
            wakes: get(&counts.wakes),
            per: counts.per.iter().map(get).collect(),
            calls,
            cpu_ns: (cpu_s * 1e9) as u64,
        })
    }
}

/// `SCRIPT LOAD`s `body`; its SHA1.
async fn load(conn: &mut Conn, body: &str) -> anyhow::Result<String> {
    match conn.call(&[b"SCRIPT", b"LOAD", body.as_bytes()]).await? {
        Reply::Bulk(Some(sha)) => Ok(String::from_utf8(sha)?),
        other => anyhow::bail!("SCRIPT LOAD answered {other:?}"),
    }
}

fn main() -> anyhow::Result<()> {
    let args = Arc::new(Args::parse());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    println!("{}", runtime.block_on(run(args))?);
    Ok(())
}
