//! The `tollgate` binary: parse the command line, set up logging, and hand
//! over to the library.

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use tollgate::cli::{self, Cli, Command};
use tollgate::clock::SystemClock;
use tollgate::config::Config;
use tollgate::server::{Server, StartError};

mod allocator;

/// mimalloc rather than glibc's malloc: the request path allocates and frees
/// many small buffers (headers, keys, bodies), which mimalloc's per-thread
/// free lists serve faster; measured with edge-bench, see docs/benchmarks.md.
#[global_allocator]
static GLOBAL: allocator::Mimalloc = allocator::Mimalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(&cli.log_format);
    match &cli.command {
        Some(Command::Check) => match cli::check(&cli.config) {
            Ok(summary) => {
                println!("{summary}");
                ExitCode::SUCCESS
            }
            Err(errors) => {
                eprintln!("{errors}");
                eprintln!("{} problem(s) found", errors.0.len());
                ExitCode::from(1)
            }
        },
        Some(Command::Explain(args)) => match cli::explain(&cli.config, args) {
            Ok(report) => {
                print!("{report}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::from(cli::EXIT_CONFIG as u8)
            }
        },
        Some(Command::Run) | None => run(&cli),
    }
}

fn run(cli: &Cli) -> ExitCode {
    let config = match Config::load(&cli.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(cli::EXIT_CONFIG as u8);
        }
    };
    let runtime = match runtime() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let server = match Server::bind(config, Arc::new(SystemClock)).await {
            Ok(s) => s,
            Err(e @ StartError::Config(_)) => {
                eprintln!("{e}");
                return ExitCode::from(cli::EXIT_CONFIG as u8);
            }
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
        };
        tracing::info!(proxy = %server.proxy_addr(), admin = %server.admin_addr(), "tollgate listening");
        server.run(shutdown_signal()).await;
        tracing::info!("stopped");
        ExitCode::SUCCESS
    })
}

/// The async runtime: one worker thread per CPU this process may run on.
/// Pinned to a single CPU (`taskset`, a one-CPU container quota), a
/// current-thread runtime serves the same load without the multi-thread
/// scheduler's cross-thread wake-ups; `TOLLGATE_WORKERS` overrides.
fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    let workers = std::env::var("TOLLGATE_WORKERS")
        .ok()
        .and_then(|w| w.parse::<usize>().ok())
        .filter(|&w| w > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    if workers == 1 {
        tokio::runtime::Builder::new_current_thread().enable_all().build()
    } else {
        tokio::runtime::Builder::new_multi_thread().worker_threads(workers).enable_all().build()
    }
}

/// Completes on SIGTERM or SIGINT.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

fn init_logging(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if format.eq_ignore_ascii_case("json") {
        builder.json().init();
    } else {
        builder.init();
    }
}
