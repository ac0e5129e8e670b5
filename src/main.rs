//! The `tollgate` binary: parse the command line, set up logging, and hand
//! over to the library.

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use tollgate::cli::{self, Cli, Command};
use tollgate::config::Config;
use tollgate::edge::process;
use tollgate::edge::server::{Server, StartError};
use tollgate::limiter::clock::SystemClock;

#[path = "cli/allocator.rs"]
mod allocator;

/// mimalloc rather than glibc's malloc: the request path allocates and frees
/// many small buffers (headers, keys, bodies), which mimalloc's per-thread
/// free lists serve faster; measured with edge-bench, see docs/benchmarks.md.
#[global_allocator]
static GLOBAL: allocator::Mimalloc = allocator::Mimalloc;

fn main() -> ExitCode {
    allocator::without_huge_pages();
    let cli = Cli::parse();
    process::init_logging(&cli.log_format);
    match &cli.command {
        Some(Command::Check(args)) => match cli::check(&cli.config) {
            Ok(summary) => {
                println!("{summary}");
                let Some(admin) = &args.running else { return ExitCode::SUCCESS };
                match cli::check_running(&cli.config, admin) {
                    Ok(lines) if lines.is_empty() => {
                        println!("upstreams and routes reload by themselves; nothing else differs from {admin}");
                        ExitCode::SUCCESS
                    }
                    Ok(lines) => {
                        for line in lines {
                            println!("{line}");
                        }
                        ExitCode::SUCCESS
                    }
                    Err(e) => {
                        eprintln!("{e}");
                        ExitCode::from(1)
                    }
                }
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
        Some(Command::Top(args)) => {
            use std::io::IsTerminal as _;
            let stdout = std::io::stdout();
            let terminal = stdout.is_terminal();
            match cli::top::run(args, &mut stdout.lock(), terminal) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("{e}");
                    ExitCode::from(1)
                }
            }
        }
        Some(Command::Block(args)) => print_or_fail(cli::blocks::block(args)),
        Some(Command::Unblock(args)) => print_or_fail(cli::blocks::unblock(args)),
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
    let runtime = match process::runtime() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        process::raise_open_files(config.listen.max_connections);
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
        server.run_until(process::stop_signal()).await;
        tracing::info!("stopped");
        ExitCode::SUCCESS
    })
}

/// A command's line on stdout, or its error on stderr and exit code 1.
fn print_or_fail(result: Result<String, String>) -> ExitCode {
    match result {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(1)
        }
    }
}
