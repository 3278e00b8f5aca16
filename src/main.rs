//! The `lockgate` binary: flags → configuration → logging → serve until a
//! signal.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use lockgate::Config;

/// Exit code for an invalid configuration (EX_USAGE, as linkerd does).
const EXIT_CONFIG: u8 = 64;

/// A Redis sidecar proxy that makes legacy SETNX locks safe.
///
/// Point your app at lockgate's port instead of Redis. Ordinary commands
/// pass through unchanged; see config/lockgate.toml for every setting.
#[derive(Debug, Clone, Parser)]
#[command(name = "lockgate", version, about, long_about)]
struct Cli {
    /// TOML configuration file; flags override it. Without it, defaults.
    #[arg(short, long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Client-facing listen address (overrides proxy.listen).
    #[arg(long, value_name = "HOST:PORT")]
    listen: Option<String>,
    /// The primary Redis (overrides upstream.addr; unused with
    /// upstream.sentinel.master_name).
    #[arg(long, value_name = "HOST:PORT")]
    upstream: Option<String>,
    /// A Redis Cluster behind lockgate: seed nodes, comma-separated
    /// HOST:PORT (overrides upstream.cluster.seeds).
    #[arg(long, value_name = "HOST:PORT,…", value_delimiter = ',')]
    upstream_cluster: Option<Vec<String>>,
    /// Lock masters for the Redlock quorum, comma-separated HOST:PORT
    /// (overrides locks.quorum.masters).
    #[arg(long, value_name = "HOST:PORT,…", value_delimiter = ',')]
    lock_masters: Option<Vec<String>>,
    /// How clients reach the primary: "dedicated" (a connection each) or
    /// "shared" (overrides proxy.upstream).
    #[arg(long, value_name = "MODE")]
    upstream_mode: Option<lockgate::config::UpstreamMode>,
    /// HTTP admin listener, HOST:PORT (overrides admin.listen; "" disables).
    #[arg(long, value_name = "HOST:PORT")]
    admin_listen: Option<String>,
    /// Validate the configuration and exit: 0 if valid, 64 if not.
    #[arg(long)]
    check: bool,
    /// Event loops, one thread each (default 1: one event loop, which keeps
    /// the order in which commands of different connections arrive, as
    /// Redis does). N ≥ 2 runs N loops, each accepting on its own
    /// SO_REUSEPORT listener; a connection stays on its loop, and commands
    /// of connections on different loops may reach Redis in either order.
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
}

/// The command-line overrides, applied to a configuration read from file.
fn overrides(cli: &Cli, mut config: Config) -> Config {
    if let Some(listen) = &cli.listen {
        config.proxy.listen = listen.clone();
    }
    if let Some(upstream) = &cli.upstream {
        config.upstream.addr = upstream.clone();
    }
    if let Some(seeds) = &cli.upstream_cluster {
        config.upstream.cluster.seeds = seeds.clone();
    }
    if let Some(mode) = cli.upstream_mode {
        config.proxy.upstream = mode;
    }
    if let Some(admin) = &cli.admin_listen {
        config.admin.listen = admin.clone();
    }
    if let Some(masters) = &cli.lock_masters {
        config.locks.quorum.masters = masters.clone();
    }
    config
}

fn load(cli: &Cli) -> Result<Config, lockgate::config::ConfigError> {
    let config = match &cli.config {
        Some(path) => Config::from_file(path)?,
        None => Config::default(),
    };
    let config = overrides(cli, config);
    lockgate::context::validate(&config)?;
    Ok(config)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = match load(&cli) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("lockgate: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if cli.check {
        println!("lockgate: configuration is valid");
        return ExitCode::SUCCESS;
    }
    use tracing_subscriber::prelude::*;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&config.log.filter));
    let (filter, filter_handle) = tracing_subscriber::reload::Layer::new(filter);
    tracing_subscriber::registry()
        .with(filter)
        .with(tracing_subscriber::fmt::layer())
        .init();
    let hook = cli.config.clone().map(|path| {
        let cli = cli.clone();
        lockgate::context::ReloadHook {
            path,
            effective: Box::new(move |c| overrides(&cli, c)),
            set_log_filter: Box::new(move |f| {
                let parsed = tracing_subscriber::EnvFilter::try_new(f)
                    .map_err(|e| format!("invalid log.filter `{f}`: {e}"))?;
                filter_handle.reload(parsed).map_err(|e| e.to_string())
            }),
        }
    });
    match serve(config, cli.threads, hook) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}

fn serve(
    config: Config,
    threads: Option<usize>,
    hook: Option<lockgate::context::ReloadHook>,
) -> anyhow::Result<()> {
    // One thread: a single event loop, as Redis and a byte copier have. The
    // sockets that became readable in one turn are served in the order they
    // did, so a command sent on one connection reaches Redis before one sent
    // just after it on another. More loops (`--threads`) are more threads
    // each with this same runtime (see lockgate::loops), never the
    // multi-thread scheduler: it does not keep that order even for one
    // loop's sockets (it runs the task woken last first, its LIFO slot, and
    // other workers steal the rest), and each command crossed threads.
    let loops = threads.unwrap_or(1).max(1);
    let mut builder = tokio::runtime::Builder::new_current_thread();
    builder.enable_all();
    let runtime = builder.build().context("starting the runtime")?;
    runtime.block_on(async {
        // Taken over before any port is bound, so an early SIGHUP never
        // kills the process.
        let hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
        let shared = loops > 1;
        let listener = bind(&config.proxy.listen, shared)
            .with_context(|| format!("binding {}", config.proxy.listen))?;
        tracing::info!(
            listen = %listener.local_addr()?,
            upstream = %config.upstream.addr,
            sentinel_master = %config.upstream.sentinel.master_name,
            cluster_seeds = %config.upstream.cluster.seeds.join(","),
            "lockgate ready"
        );
        let tls = match config.proxy.tls.listen.as_str() {
            "" => None,
            addr => {
                let l = bind(addr, shared).with_context(|| format!("binding the TLS listener {addr}"))?;
                tracing::info!(tls_listen = %l.local_addr()?, "TLS listener ready");
                Some(l)
            }
        };
        let admin = match config.admin.listen.as_str() {
            "" => None,
            addr => Some(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("binding the admin listener {addr}"))?,
            ),
        };
        if let Some(admin) = &admin {
            tracing::info!(admin = %admin.local_addr()?, "operators' endpoints: /metrics /healthz /readyz /");
        }
        // The other loops bind where the first ones did (an ephemeral port
        // included), before any client is served.
        let mut extra = Vec::with_capacity(loops - 1);
        for _ in 1..loops {
            let plain = bind(&listener.local_addr()?.to_string(), true)
                .context("binding another event loop's listener")?
                .into_std()?;
            let tls = match &tls {
                None => None,
                Some(l) => Some(
                    bind(&l.local_addr()?.to_string(), true)
                        .context("binding another event loop's TLS listener")?
                        .into_std()?,
                ),
            };
            extra.push(lockgate::loops::LoopListeners { plain, tls });
        }
        if loops > 1 {
            tracing::info!(loops, "event loops, one thread each");
        }
        let ctx = std::sync::Arc::new(lockgate::ServerContext::new(config));
        *lockgate::sync::lock(&ctx.reload) = hook;
        tokio::spawn(reload_on_sighup(ctx.clone(), hup));
        lockgate::run_loops(ctx, listener, tls, admin, lockgate::shutdown::signal(), extra).await;
        tracing::info!("lockgate stopped");
        Ok(())
    })
}

/// A listener with a backlog of 1024 (std's default of 128 makes a burst of
/// connecting clients wait for SYN retries), as Redis uses 511.
/// `shared`: with SO_REUSEPORT, so each event loop binds its own.
fn bind(addr: &str, shared: bool) -> anyhow::Result<tokio::net::TcpListener> {
    let addr: std::net::SocketAddr = addr.parse()?;
    let socket = match addr {
        std::net::SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        std::net::SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    if shared {
        socket.set_reuseport(true)?;
    }
    socket.bind(addr)?;
    Ok(socket.listen(1024)?)
}

/// SIGHUP re-reads the configuration file (see `ServerContext::reload`).
async fn reload_on_sighup(
    ctx: std::sync::Arc<lockgate::ServerContext>,
    hup: Option<tokio::signal::unix::Signal>,
) {
    let Some(mut hup) = hup else {
        tracing::warn!("cannot listen for SIGHUP; use LOCKGATE RELOAD");
        return;
    };
    loop {
        tokio::select! {
            _ = hup.recv() => match ctx.reload() {
                Ok(what) => tracing::info!(outcome = %what, "SIGHUP: configuration reloaded"),
                Err(e) => tracing::warn!(error = %e, "SIGHUP: new configuration refused; the old one stays"),
            },
            _ = ctx.stop.cancelled() => return,
        }
    }
}
