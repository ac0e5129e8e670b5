//! `tollgate-floor`: the floor of tollgate's stack as a bench target (see
//! `tollgate::cli::floor`). Takes tollgate's own `--config` file and reads
//! `[listen]` and the first `[[route]]` and its upstream from it.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use tollgate::cli::EXIT_CONFIG;
use tollgate::cli::floor::Floor;
use tollgate::config::Config;
use tollgate::edge::process;

#[path = "../cli/allocator.rs"]
mod allocator;

/// The same allocator as tollgate's: the floor is only a floor if it
/// allocates the same way.
#[global_allocator]
static GLOBAL: allocator::Mimalloc = allocator::Mimalloc;

#[derive(Debug, Parser)]
#[command(name = "tollgate-floor", version, about = "tollgate's server and upstream pool with nothing between them")]
struct Cli {
    /// tollgate's main config file.
    #[arg(long, short, default_value = "tollgate.toml")]
    config: PathBuf,
    /// Log format: text (default) or json. Also TOLLGATE_LOG_FORMAT.
    #[arg(long, env = "TOLLGATE_LOG_FORMAT", default_value = "text")]
    log_format: String,
}

fn main() -> ExitCode {
    allocator::without_huge_pages();
    let cli = Cli::parse();
    process::init_logging(&cli.log_format);
    let config = match Config::load(&cli.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(EXIT_CONFIG as u8);
        }
    };
    let runtime = match process::runtime() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let floor = match Floor::bind(&config).await {
            Ok(f) => f,
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
        };
        if let Some(addr) = floor.proxy_addr() {
            tracing::info!(proxy = %addr, "tollgate-floor listening");
        }
        floor.run(process::shutdown_signal()).await;
        ExitCode::SUCCESS
    })
}
