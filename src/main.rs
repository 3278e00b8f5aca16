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
    /// The primary Redis (overrides upstream.addr).
    #[arg(long, value_name = "HOST:PORT")]
    upstream: Option<String>,
    /// Lock masters for the Redlock quorum, comma-separated HOST:PORT
    /// (overrides locks.quorum.masters).
    #[arg(long, value_name = "HOST:PORT,…", value_delimiter = ',')]
    lock_masters: Option<Vec<String>>,
    /// HTTP admin listener, HOST:PORT (overrides admin.listen; "" disables).
    #[arg(long, value_name = "HOST:PORT")]
    admin_listen: Option<String>,
    /// Validate the configuration and exit: 0 if valid, 64 if not.
    #[arg(long)]
    check: bool,
    /// Runtime threads (default 1: one event loop, which keeps the order in
    /// which commands of different connections arrive, as Redis does). N ≥ 2
    /// runs N workers, which do not keep that order.
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
    config.validate()?;
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
    // just after it on another. The multi-thread scheduler does not keep that
    // order: it runs the task woken last first (its LIFO slot) and other
    // workers steal the rest.
    // It is the default: measured on two cores, one event loop served as
    // many commands as two workers at -P1 and more at -P16, with less CPU.
    let mut builder = match threads {
        Some(n) if n >= 2 => tokio::runtime::Builder::new_multi_thread(),
        _ => tokio::runtime::Builder::new_current_thread(),
    };
    builder.enable_all();
    if let Some(n) = threads.filter(|&n| n > 1) {
        builder.worker_threads(n);
    }
    let runtime = builder.build().context("starting the runtime")?;
    runtime.block_on(async {
        // Taken over before any port is bound, so an early SIGHUP never
        // kills the process.
        let hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
        let listener = bind(&config.proxy.listen).with_context(|| format!("binding {}", config.proxy.listen))?;
        tracing::info!(
            listen = %listener.local_addr()?,
            upstream = %config.upstream.addr,
            "lockgate ready"
        );
        let tls = match config.proxy.tls.listen.as_str() {
            "" => None,
            addr => {
                let l = bind(addr).with_context(|| format!("binding the TLS listener {addr}"))?;
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
        let ctx = std::sync::Arc::new(lockgate::ServerContext::new(config));
        *lockgate::sync::lock(&ctx.reload) = hook;
        tokio::spawn(reload_on_sighup(ctx.clone(), hup));
        lockgate::run_with_tls(ctx, listener, tls, admin, lockgate::shutdown::signal()).await;
        tracing::info!("lockgate stopped");
        Ok(())
    })
}

/// A listener with a backlog of 1024 (std's default of 128 makes a burst of
/// connecting clients wait for SYN retries), as Redis uses 511.
fn bind(addr: &str) -> anyhow::Result<tokio::net::TcpListener> {
    let addr: std::net::SocketAddr = addr.parse()?;
    let socket = match addr {
        std::net::SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        std::net::SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
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
