//! What the binaries share around the library: the async runtime, logging
//! and the shutdown signal.

/// The async runtime: one worker thread per CPU this process may run on.
/// Pinned to a single CPU (`taskset`, a one-CPU container quota), a
/// current-thread runtime serves the same load without the multi-thread
/// scheduler's cross-thread wake-ups; `TOLLGATE_WORKERS` overrides.
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
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
pub async fn shutdown_signal() {
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

/// Logs to stderr at `RUST_LOG` (default `info`), as text or, with
/// `format` "json", one JSON object a line.
pub fn init_logging(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if format.eq_ignore_ascii_case("json") {
        builder.json().init();
    } else {
        builder.init();
    }
}
