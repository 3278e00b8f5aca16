//! Retry-storm load generator for `bench/storm.sh`: N clients contend for
//! one lock key the way legacy apps do, and one JSON line of results goes
//! to stdout.
//!
//! ```sh
//! cargo run --release --example storm -- --port 6380 --clients 150 \
//!     --sleep-us 1000 --hold-ms 200 --duration-s 10
//! ```
//!
//! Each client is the 'Redis in Action' loop: `SETNX key <id>` until it
//! returns 1, sleeping `--sleep-us` between attempts (0: spin). The winner
//! holds the lock `--hold-ms`, `DEL`s it on the same connection and starts
//! trying again at once. A client waits for every reply before it sends the
//! next command, like a real spin loop, so a target that answers slowly gets
//! fewer attempts. Only SETNX and DEL are ever sent (nutcracker closes the
//! connection on HELLO, CLIENT, SELECT, …), as raw RESP over one TCP
//! connection per client.
//!
//! The run starts once every client is connected and lasts `--duration-s`.
//! Then nobody starts another attempt; one in flight (a parked one can take
//! a while) still gets its answer. The holder at the end keeps the lock
//! until every other client has stopped, then releases it, so the proxy
//! cannot hand it down a chain of parked attempts whose upstream commands
//! would be charged to the counted acquisitions; a lock won after the end
//! (`acquired_late`) is released the same way and not counted.
//!
//! Wait times run from a client's first attempt of a round to the reply
//! that acquired; handoff times from the moment the previous holder sent its
//! DEL to the next holder's acquiring reply. `unfinished` counts the clients
//! that attempted but never acquired, `waiting_at_end` every round still
//! open at the end. `overlaps` counts acquisitions while another client of
//! this run still held the lock (before sending its DEL): it must be 0 on
//! every target.
//!
//! With `--try-every-ms N` it measures try-locks instead: an extra holder
//! connection takes the lock before the run (its `SETNX` must return 1) and
//! keeps it until every client has stopped, then `DEL`s it. Each of the
//! `--clients` sends one `SETNX` every N ms, the clients staggered evenly
//! over the first N ms, and never retries sooner: a lock held for the whole
//! run, tried now and then (cron de-duplication), never spun on. The JSON
//! line (`"mode":"try"`) gives the reply latency of every try-lock, how many
//! acquired (must be 0: the lock was held) and the shortest gap between two
//! attempts of one client (at least N ms by construction, so a proxy that
//! tells spinners by their retry interval sees none). `--sleep-us` and
//! `--hold-ms` do not apply.
//!
//! `--sleep-us` uses tokio's timer, which has 1 ms granularity: 1000 sleeps
//! 1–2 ms (Python's `time.sleep(.001)` a little over 1 ms), so the polling
//! clients here try somewhat less often than the book's loop.

use std::fmt::Write as _;
use std::io;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Parser;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// Retry-storm load generator (see the file's doc).
#[derive(Debug, Parser)]
#[command(name = "storm")]
struct Args {
    /// Target host (Redis, or a proxy in front of it).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Target port.
    #[arg(long, required_unless_present = "ports")]
    port: Option<u16>,
    /// Several targets (a fleet of sidecars in front of one Redis), comma
    /// separated: client i connects to the (i mod n)-th; the JSON line then
    /// gives acquisitions per target (`per_target`). Overrides `--port`.
    #[arg(long, value_delimiter = ',')]
    ports: Vec<u16>,
    /// After a won SETNX, send `EXPIRE key N` as the incident's app did
    /// (0: none, the default).
    #[arg(long, default_value_t = 0)]
    expire_s: u64,
    /// Contending clients, one connection each.
    #[arg(long, default_value_t = 50)]
    clients: usize,
    /// Sleep between two failed attempts of a client, µs (0: spin).
    #[arg(long, default_value_t = 0)]
    sleep_us: u64,
    /// How long a winner holds the lock before its DEL, ms.
    #[arg(long, default_value_t = 200)]
    hold_ms: u64,
    /// Length of the run, seconds.
    #[arg(long, default_value_t = 10.0)]
    duration_s: f64,
    /// The lock key.
    #[arg(long, default_value = "lock:storm")]
    key: String,
    /// Runtime threads. One keeps the generator to one core of a small box.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Try-lock mode: while a holder keeps the lock for the whole run, every
    /// client sends one SETNX every this many ms, staggered, never spinning
    /// (see the file's doc). 0: the contention loop.
    #[arg(long, default_value_t = 0)]
    try_every_ms: u64,
}

/// One reply, as far as SETNX and DEL need it.
#[derive(Debug)]
enum Reply {
    Integer(i64),
    /// Anything else, as its first line (an error, a status, a bulk header).
    Other(String),
}

impl std::fmt::Display for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Integer(n) => write!(f, ":{n}"),
            Self::Other(line) => f.write_str(line),
        }
    }
}

/// One client connection speaking raw RESP, one command at a time.
struct Conn {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    line: String,
    request: Vec<u8>,
}

impl Conn {
    async fn connect(addr: &str) -> io::Result<Self> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (read, writer) = stream.into_split();
        Ok(Self {
            reader: BufReader::new(read),
            writer,
            line: String::new(),
            request: Vec::new(),
        })
    }

    /// Sends one command and waits for its reply.
    async fn call(&mut self, args: &[&[u8]]) -> io::Result<Reply> {
        self.request.clear();
        self.request
            .extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
        for arg in args {
            self.request
                .extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
            self.request.extend_from_slice(arg);
            self.request.extend_from_slice(b"\r\n");
        }
        self.writer.write_all(&self.request).await?;
        self.read_reply().await
    }

    async fn read_reply(&mut self) -> io::Result<Reply> {
        self.line.clear();
        if self.reader.read_line(&mut self.line).await? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed by the target",
            ));
        }
        let line = self.line.trim_end();
        if let Some(n) = line.strip_prefix(':') {
            return n
                .parse()
                .map(Reply::Integer)
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, line.to_string()));
        }
        // A bulk string's payload follows its header; skip it so the next
        // reply starts where it should.
        if let Some(len) = line.strip_prefix('$').and_then(|n| n.parse::<i64>().ok()) {
            let what = line.to_string();
            if len >= 0 {
                let mut skip = vec![0; len as usize + 2];
                self.reader.read_exact(&mut skip).await?;
            }
            return Ok(Reply::Other(what));
        }
        Ok(Reply::Other(line.to_string()))
    }
}

/// What all clients share.
#[derive(Default)]
struct Shared {
    /// Clients holding the lock right now (by their own account).
    holders: AtomicI64,
    /// Acquisitions made while another client held the lock.
    overlaps: AtomicU64,
    /// When the last holder sent its DEL, until the next acquisition.
    released_at: Mutex<Option<Instant>>,
    /// Clients still in their loop.
    running: AtomicUsize,
}

/// One client's results.
#[derive(Debug, Default)]
struct ClientResult {
    attempts: u64,
    acquisitions: u64,
    /// A lock won after the end of the run (released, not counted).
    late: u64,
    /// DELs that answered 0: the lock was no longer there.
    del_missed: u64,
    waits_us: Vec<u64>,
    handoffs_us: Vec<u64>,
    /// From acquisition to sending DEL, µs, summed.
    held_us: u64,
    /// The first acquisition of this client.
    first_acquired: Option<Instant>,
    /// Start of the round still open at the end, if any.
    open_since: Option<Instant>,
    attempted: bool,
    error: Option<String>,
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// The contention loop of one client until `deadline`.
async fn run_client(
    conn: &mut Conn,
    id: &[u8],
    key: &[u8],
    args: &Args,
    deadline: Instant,
    shared: &Shared,
    out: &mut ClientResult,
) -> io::Result<()> {
    let hold = Duration::from_millis(args.hold_ms);
    let pause = Duration::from_micros(args.sleep_us);
    while Instant::now() < deadline {
        let sent = Instant::now();
        let round = *out.open_since.get_or_insert(sent);
        out.attempted = true;
        out.attempts += 1;
        let reply = conn.call(&[b"SETNX", key, id]).await?;
        let got = Instant::now();
        match reply {
            Reply::Integer(1) if got > deadline => {
                out.late += 1;
                wait_for_the_others(shared).await;
                release(conn, key, out).await?;
                break;
            }
            Reply::Integer(1) => {
                if shared.holders.fetch_add(1, Ordering::SeqCst) > 0 {
                    shared.overlaps.fetch_add(1, Ordering::SeqCst);
                }
                out.acquisitions += 1;
                out.first_acquired.get_or_insert(got);
                out.waits_us.push(micros(got - round));
                if args.expire_s > 0 {
                    let secs = args.expire_s.to_string();
                    conn.call(&[b"EXPIRE", key, secs.as_bytes()]).await?;
                }
                out.open_since = None;
                let released = shared
                    .released_at
                    .lock()
                    .map_err(|_| io::Error::other("poisoned"))?
                    .take();
                if let Some(at) = released {
                    out.handoffs_us
                        .push(micros(got.saturating_duration_since(at)));
                }
                tokio::time::sleep_until((got + hold).min(deadline)).await;
                if Instant::now() >= deadline {
                    wait_for_the_others(shared).await;
                }
                shared.holders.fetch_sub(1, Ordering::SeqCst);
                let now = Instant::now();
                out.held_us += micros(now - got);
                *shared
                    .released_at
                    .lock()
                    .map_err(|_| io::Error::other("poisoned"))? = Some(now);
                release(conn, key, out).await?;
            }
            Reply::Integer(0) => {
                if !pause.is_zero() {
                    tokio::time::sleep(pause).await;
                }
            }
            other => return Err(io::Error::other(format!("SETNX answered {other}"))),
        }
    }
    Ok(())
}

/// At the end of the run a holder keeps the lock until every other client
/// has had the answer to its last attempt and stopped. Releasing earlier
/// would hand the lock to attempts still parked in a proxy, one after the
/// other, and the commands of those uncounted acquisitions would be charged
/// to the counted ones.
async fn wait_for_the_others(shared: &Shared) {
    let give_up = Instant::now() + Duration::from_secs(10);
    while shared.running.load(Ordering::SeqCst) > 1 && Instant::now() < give_up {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn release(conn: &mut Conn, key: &[u8], out: &mut ClientResult) -> io::Result<()> {
    match conn.call(&[b"DEL", key]).await? {
        Reply::Integer(1) => Ok(()),
        Reply::Integer(0) => {
            out.del_missed += 1;
            Ok(())
        }
        other => Err(io::Error::other(format!("DEL answered {other}"))),
    }
}

/// Nearest-rank percentile of sorted values, in ms; 0 when empty.
fn pct_ms(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1] as f64 / 1000.0
}

fn summary_json(values: &mut [u64]) -> String {
    values.sort_unstable();
    format!(
        "{{\"n\":{},\"p50\":{:.3},\"p99\":{:.3},\"max\":{:.3}}}",
        values.len(),
        pct_ms(values, 0.50),
        pct_ms(values, 0.99),
        pct_ms(values, 1.0)
    )
}

fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The `HOST:PORT`s clients connect to: `--ports`, else `--port`.
fn targets(args: &Args) -> Vec<String> {
    let ports = match (args.ports.is_empty(), args.port) {
        (false, _) => args.ports.clone(),
        (true, Some(p)) => vec![p],
        (true, None) => vec![6379],
    };
    ports
        .iter()
        .map(|p| format!("{}:{}", args.host, p))
        .collect()
}

/// One connection, its failure naming the address.
async fn connect(addr: &str) -> anyhow::Result<Conn> {
    Conn::connect(addr)
        .await
        .map_err(|e| anyhow::anyhow!("connecting to {addr}: {e}"))
}

async fn run(args: Arc<Args>) -> anyhow::Result<String> {
    anyhow::ensure!(args.clients > 0, "--clients must be at least 1");
    anyhow::ensure!(
        args.duration_s > 0.0 && args.duration_s.is_finite(),
        "--duration-s must be positive"
    );
    if args.try_every_ms > 0 {
        return run_try(args).await;
    }
    let targets = targets(&args);
    let connecting = Instant::now();
    let mut conns = Vec::with_capacity(args.clients);
    for i in 0..args.clients {
        conns.push(connect(&targets[i % targets.len()]).await?);
    }

    let connect_ms = micros(connecting.elapsed()) as f64 / 1000.0;
    let shared = Arc::new(Shared {
        running: AtomicUsize::new(args.clients),
        ..Shared::default()
    });
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(args.duration_s);
    let pid = std::process::id();
    let mut tasks = Vec::with_capacity(args.clients);
    for (i, mut conn) in conns.into_iter().enumerate() {
        let args = Arc::clone(&args);
        let shared = Arc::clone(&shared);
        tasks.push(tokio::spawn(async move {
            let id = format!("storm-{pid}-{i}");
            let mut out = ClientResult::default();
            let key = args.key.clone();
            if let Err(e) = run_client(
                &mut conn,
                id.as_bytes(),
                key.as_bytes(),
                &args,
                deadline,
                &shared,
                &mut out,
            )
            .await
            {
                out.error = Some(format!("client {i}: {e}"));
            }
            shared.running.fetch_sub(1, Ordering::SeqCst);
            out
        }));
    }
    let mut results = Vec::with_capacity(tasks.len());
    for task in tasks {
        results.push(task.await?);
    }
    let elapsed = start.elapsed().as_secs_f64();

    let attempts: u64 = results.iter().map(|r| r.attempts).sum();
    let acquisitions: u64 = results.iter().map(|r| r.acquisitions).sum();
    let late: u64 = results.iter().map(|r| r.late).sum();
    let del_missed: u64 = results.iter().map(|r| r.del_missed).sum();
    let per_client: Vec<u64> = results.iter().map(|r| r.acquisitions).collect();
    let mut per_target = vec![0u64; targets.len()];
    for (i, n) in per_client.iter().enumerate() {
        per_target[i % targets.len()] += n;
    }
    let distinct = per_client.iter().filter(|&&n| n > 0).count();
    let never = results
        .iter()
        .filter(|r| r.attempted && r.acquisitions == 0)
        .count();
    let waiting = results.iter().filter(|r| r.open_since.is_some()).count();
    let oldest_open = results
        .iter()
        .filter_map(|r| r.open_since)
        .map(|since| micros(deadline.saturating_duration_since(since)))
        .max()
        .unwrap_or(0);
    let mut waits: Vec<u64> = results.iter().flat_map(|r| r.waits_us.clone()).collect();
    let mut handoffs: Vec<u64> = results.iter().flat_map(|r| r.handoffs_us.clone()).collect();
    let first_acquired = results
        .iter()
        .filter_map(|r| r.first_acquired)
        .min()
        .map_or(-1.0, |t| micros(t - start) as f64 / 1000.0);
    let held_avg = if acquisitions > 0 {
        results.iter().map(|r| r.held_us).sum::<u64>() as f64 / acquisitions as f64 / 1000.0
    } else {
        0.0
    };
    let errors: Vec<&String> = results.iter().filter_map(|r| r.error.as_ref()).collect();

    let mut json = String::new();
    let _ = write!(
        json,
        "{{\"clients\":{},\"sleep_us\":{},\"hold_ms\":{},\"duration_s\":{},\"connect_ms\":{:.3},\"elapsed_s\":{:.3},\
         \"attempts\":{},\"acquisitions\":{},\"acquired_late\":{},\"del_missed\":{},\
         \"per_client\":[{}],\"per_target\":[{}],\"distinct_acquirers\":{},\"unfinished\":{},\
         \"waiting_at_end\":{},\"oldest_open_wait_ms\":{:.3},\
         \"first_acquired_ms\":{:.3},\"held_avg_ms\":{:.3},\"wait_ms\":{},\"handoff_ms\":{},\"overlaps\":{},\"errors\":{},\"first_error\":{}}}",
        args.clients,
        args.sleep_us,
        args.hold_ms,
        args.duration_s,
        connect_ms,
        elapsed,
        attempts,
        acquisitions,
        late,
        del_missed,
        per_client
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(","),
        per_target
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(","),
        distinct,
        never,
        waiting,
        oldest_open as f64 / 1000.0,
        first_acquired,
        held_avg,
        summary_json(&mut waits),
        summary_json(&mut handoffs),
        shared.overlaps.load(Ordering::SeqCst),
        errors.len(),
        errors
            .first()
            .map_or_else(|| "null".to_string(), |e| json_str(e)),
    );
    Ok(json)
}

/// One try-lock client's results.
#[derive(Debug, Default)]
struct TryResult {
    attempts: u64,
    /// Try-locks answered 1: the held lock was acquired (must stay 0).
    acquired: u64,
    /// Reply latency of every try-lock, from sending to the reply, µs.
    latencies_us: Vec<u64>,
    /// Shortest time between two attempts of this client, µs.
    min_gap_us: Option<u64>,
    error: Option<String>,
}

/// The try-lock loop of one client: its first `SETNX` at `first`, then one
/// every `every` after the previous one was sent, until `deadline`. A lock
/// it acquired after all (the holder lost it) is released at the end.
async fn run_try_client(
    conn: &mut Conn,
    id: &[u8],
    key: &[u8],
    first: Instant,
    every: Duration,
    deadline: Instant,
    out: &mut TryResult,
) -> io::Result<()> {
    let mut next = first;
    let mut last_sent: Option<Instant> = None;
    while next < deadline {
        tokio::time::sleep_until(next).await;
        let sent = Instant::now();
        if let Some(prev) = last_sent {
            let gap = micros(sent - prev);
            out.min_gap_us = Some(out.min_gap_us.map_or(gap, |g| g.min(gap)));
        }
        last_sent = Some(sent);
        out.attempts += 1;
        let reply = conn.call(&[b"SETNX", key, id]).await?;
        out.latencies_us.push(micros(sent.elapsed()));
        match reply {
            Reply::Integer(0) => {}
            Reply::Integer(1) => out.acquired += 1,
            other => return Err(io::Error::other(format!("SETNX answered {other}"))),
        }
        next = sent + every;
    }
    if out.acquired > 0 {
        conn.call(&[b"DEL", key]).await?;
    }
    Ok(())
}

/// Try-lock mode (`--try-every-ms`): a holder keeps the lock for the whole
/// run while the clients try it now and then; one JSON line of results.
async fn run_try(args: Arc<Args>) -> anyhow::Result<String> {
    let addr = targets(&args).swap_remove(0);
    let key = args.key.as_bytes();
    let pid = std::process::id();
    let connecting = Instant::now();
    let mut holder = connect(&addr).await?;
    let mut conns = Vec::with_capacity(args.clients);
    for _ in 0..args.clients {
        conns.push(connect(&addr).await?);
    }
    let connect_ms = micros(connecting.elapsed()) as f64 / 1000.0;
    let holder_id = format!("storm-{pid}-holder");
    match holder.call(&[b"SETNX", key, holder_id.as_bytes()]).await? {
        Reply::Integer(1) => {}
        other => anyhow::bail!(
            "the holder's SETNX {} answered {other}: the lock must be free at the start",
            args.key
        ),
    }

    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(args.duration_s);
    let every = Duration::from_millis(args.try_every_ms);
    let mut tasks = Vec::with_capacity(args.clients);
    for (i, mut conn) in conns.into_iter().enumerate() {
        let key = args.key.clone();
        let first = start + every.mul_f64(i as f64 / args.clients as f64);
        tasks.push(tokio::spawn(async move {
            let id = format!("storm-{pid}-{i}");
            let mut out = TryResult::default();
            if let Err(e) = run_try_client(
                &mut conn,
                id.as_bytes(),
                key.as_bytes(),
                first,
                every,
                deadline,
                &mut out,
            )
            .await
            {
                out.error = Some(format!("client {i}: {e}"));
            }
            out
        }));
    }
    let mut results = Vec::with_capacity(tasks.len());
    for task in tasks {
        results.push(task.await?);
    }
    let elapsed = start.elapsed().as_secs_f64();
    // The holder releases only now, so no try-lock could have found it free.
    let holder_released = matches!(holder.call(&[b"DEL", key]).await?, Reply::Integer(1));

    let attempts: u64 = results.iter().map(|r| r.attempts).sum();
    let acquired: u64 = results.iter().map(|r| r.acquired).sum();
    let mut latencies: Vec<u64> = results
        .iter()
        .flat_map(|r| r.latencies_us.clone())
        .collect();
    let min_gap = results.iter().filter_map(|r| r.min_gap_us).min();
    let errors: Vec<&String> = results.iter().filter_map(|r| r.error.as_ref()).collect();

    let mut json = String::new();
    let _ = write!(
        json,
        "{{\"mode\":\"try\",\"clients\":{},\"try_every_ms\":{},\"duration_s\":{},\"connect_ms\":{:.3},\
         \"elapsed_s\":{:.3},\"attempts\":{},\"acquired\":{},\"latency_ms\":{},\"min_gap_ms\":{},\
         \"holder_released\":{},\"errors\":{},\"first_error\":{}}}",
        args.clients,
        args.try_every_ms,
        args.duration_s,
        connect_ms,
        elapsed,
        attempts,
        acquired,
        summary_json(&mut latencies),
        min_gap.map_or_else(|| "null".to_string(), |g| format!("{:.3}", g as f64 / 1000.0)),
        holder_released,
        errors.len(),
        errors
            .first()
            .map_or_else(|| "null".to_string(), |e| json_str(e)),
    );
    Ok(json)
}

fn main() -> anyhow::Result<()> {
    let args = Arc::new(Args::parse());
    let runtime = if args.threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(args.threads)
            .enable_all()
            .build()?
    };
    let json = runtime.block_on(run(args))?;
    println!("{json}");
    Ok(())
}
