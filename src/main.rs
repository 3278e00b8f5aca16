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
#[derive(Debug, Parser)]
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
    /// Validate the configuration and exit: 0 if valid, 64 if not.
    #[arg(long)]
    check: bool,
    /// Runtime worker threads (default: one per core).
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
}

fn load(cli: &Cli) -> Result<Config, lockgate::config::ConfigError> {
    let mut config = match &cli.config {
        Some(path) => Config::from_file(path)?,
        None => Config::default(),
    };
    if let Some(listen) = &cli.listen {
        config.proxy.listen = listen.clone();
    }
    if let Some(upstream) = &cli.upstream {
        config.upstream.addr = upstream.clone();
    }
    if let Some(masters) = &cli.lock_masters {
        config.locks.quorum.masters = masters.clone();
    }
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
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    match serve(config, cli.threads) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}

fn serve(config: Config, threads: Option<usize>) -> anyhow::Result<()> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    if let Some(n) = threads {
        builder.worker_threads(n.max(1));
    }
    let runtime = builder.build().context("starting the runtime")?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(&config.proxy.listen)
            .await
            .with_context(|| format!("binding {}", config.proxy.listen))?;
        tracing::info!(
            listen = %listener.local_addr()?,
            upstream = %config.upstream.addr,
            "lockgate ready"
        );
        lockgate::run(config, listener, lockgate::shutdown::signal()).await;
        tracing::info!("lockgate stopped");
        Ok(())
    })
}
