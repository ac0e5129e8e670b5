//! What the binaries share around the library: the async runtime, logging,
//! the shutdown signal, SIGHUP and SIGUSR1.

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

/// How a shutdown goes, by the signal that asked for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// SIGTERM, an orchestrator's: `/readyz` fails and the listeners serve
    /// on for `listen.shutdown_delay` before the drain, because load
    /// balancers learn of the shutdown after the process does.
    LameDuck,
    /// SIGINT, a person's Ctrl-C: nothing routes by this instance's
    /// readiness that would need the delay; the drain starts at once.
    Now,
}

/// Completes on SIGTERM or SIGINT, saying which.
pub async fn stop_signal() -> Stop {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => Stop::Now,
                    _ = term.recv() => Stop::LameDuck,
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
                Stop::Now
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
        Stop::Now
    }
}

/// Completes on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    stop_signal().await;
}

/// SIGHUP, caught from now on (its default action ends the process):
/// registered when the server is bound, before anything could send it.
/// `None` when the platform has no SIGHUP or it cannot be caught.
pub fn hangup_signal() -> Option<Caught> {
    #[cfg(unix)]
    {
        catch(tokio::signal::unix::SignalKind::hangup(), "SIGHUP")
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// SIGUSR1, caught from now on, as [`hangup_signal`]: nginx's signal to
/// reopen log files, which logrotate recipes written for nginx send. Its
/// default action ends the process, so an uncaught one would take the
/// proxy down with the log rotation.
pub fn reopen_signal() -> Option<Caught> {
    #[cfg(unix)]
    {
        catch(tokio::signal::unix::SignalKind::user_defined1(), "SIGUSR1")
    }
    #[cfg(not(unix))]
    {
        None
    }
}

#[cfg(unix)]
fn catch(kind: tokio::signal::unix::SignalKind, name: &str) -> Option<Caught> {
    match tokio::signal::unix::signal(kind) {
        Ok(s) => Some(Caught(s)),
        Err(e) => {
            tracing::warn!(error = %e, "cannot catch {name}; the access log will not be reopened on it");
            None
        }
    }
}

/// A registered signal (see [`hangup_signal`] and [`reopen_signal`]).
pub struct Caught(#[cfg(unix)] tokio::signal::unix::Signal);

impl Caught {
    /// Calls `then` on every signal, until the task is dropped.
    pub async fn each(mut self, mut then: impl FnMut()) {
        #[cfg(unix)]
        while self.0.recv().await.is_some() {
            then();
        }
        #[cfg(not(unix))]
        {
            let _ = (&mut self, &mut then);
        }
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

/// Raises the soft limit on open files to the hard limit (systemd and
/// shells often start services at 1,024, far below what an edge proxy
/// holds), and warns when even the hard limit is below what
/// `max_connections` needs: a client connection and an upstream
/// connection each, and some for listeners, logs and Redis.
pub fn raise_open_files(max_connections: usize) {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        limit.current = limit.maximum;
        if let Err(e) = setrlimit(Resource::Nofile, limit) {
            tracing::warn!(error = %e, "cannot raise the open files limit (RLIMIT_NOFILE) to its hard limit");
        }
    }
    let now = getrlimit(Resource::Nofile).current;
    let needed = (max_connections as u64).saturating_mul(2).saturating_add(256);
    if let Some(n) = now
        && n < needed
    {
        tracing::warn!(
            open_files = n,
            needed,
            "the open files limit is below what listen.max_connections needs (two per connection); raise LimitNOFILE or ulimit -n"
        );
    }
}
