//! Calls: a batch of checks in one `FCALL` (or `EVALSHA`) on the node
//! owning the first check's key, after loading the function (or as `EVAL`)
//! when that node does not know it, bounded by a deadline with fred's own
//! timer, and re-sent only after a cluster redirection (until the
//! deadline, while a slot migration redirects it with `ASK`).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use fred::bytes_utils::Str;
use fred::clients::Client;
use fred::error::{Error as FredError, ErrorKind};
use fred::interfaces::ClientLike;
use fred::types::config::Options;
use fred::types::{ClusterHash, CustomCommand, Value};

use super::scripts::{self, Outcome, Reply, Script};
use crate::store::StoreError;

/// One check of a call: its key and the values after it. The key is
/// fred's shared string, so that building a call copies no key.
pub(super) type Job<'a> = (&'a Str, &'a [Value; scripts::ARGS]);

/// One check in a call of its own, routed by its key.
pub(super) async fn run(
    client: &Client,
    script: &Script,
    key: &str,
    args: [Value; scripts::ARGS],
    deadline: Instant,
    timeout: Duration,
) -> Result<Reply, Failure> {
    let slot = fred::util::redis_keyslot(key.as_bytes());
    let outcome = run_batch(client, script, slot, &[(&Str::from(key), &args)], deadline, timeout).await?.pop();
    match outcome {
        Some(Outcome::Decided(reply)) => Ok(reply),
        // Routed by this very key: its node is moving (a slot migration).
        Some(Outcome::NotHere) => Err(Failure {
            error: StoreError::Unavailable(format!("{key} is moving between cluster nodes")),
            outage: false,
        }),
        Some(Outcome::Failed(error)) => Err(Failure { error: StoreError::Protocol(error), outage: false }),
        None => Err(Failure { error: StoreError::Protocol("a script answered no check".into()), outage: false }),
    }
}

/// The checks of `jobs` in one call of `script` (at least one check), on
/// the node owning the first one's key (in `slot`, hashed by the caller,
/// which routed by it already): its function (`FCALL`), loaded on
/// that node first if the node does not know it (first use, a restart
/// without persistence, a node added), or on a server without functions
/// the script by SHA, then by source if that node does not know it.
pub(super) async fn run_batch(
    client: &Client,
    script: &Script,
    slot: u16,
    jobs: &[Job<'_>],
    deadline: Instant,
    timeout: Duration,
) -> Result<Vec<Outcome>, Failure> {
    let mut result = Err(FredError::new(ErrorKind::Unknown, "no call made"));
    if script.functions.load(Ordering::Relaxed) {
        result = eval(client, "FCALL", &script.function, slot, jobs, deadline).await;
        if result.as_ref().is_err_and(|e| e.details().contains("Function not found")) {
            match load(client, script, slot, jobs, deadline).await {
                Ok(()) => result = eval(client, "FCALL", &script.function, slot, jobs, deadline).await,
                Err(e) => result = Err(e),
            }
        }
        if result.as_ref().is_err_and(|e| e.details().contains("unknown command")) {
            tracing::info!("redis has no functions (before 7.0): calling scripts instead");
            script.functions.store(false, Ordering::Relaxed);
        }
    }
    if !script.functions.load(Ordering::Relaxed) {
        result = eval(client, "EVALSHA", &script.sha, slot, jobs, deadline).await;
        if result.as_ref().is_err_and(|e| e.details().starts_with("NOSCRIPT")) {
            result = eval(client, "EVAL", &script.source, slot, jobs, deadline).await;
        }
    }
    match result {
        Ok(value) => scripts::parse_batch(value, jobs.len()).map_err(|error| Failure { error, outage: false }),
        Err(e) => Err(Failure { error: store_error(&e, timeout), outage: is_outage(e.kind()) }),
    }
}

/// `FUNCTION LOAD REPLACE` of `script`'s library on the node owning the
/// first job's key (`REPLACE`: another instance may load it at the same
/// time).
async fn load(
    client: &Client,
    script: &Script,
    slot: u16,
    jobs: &[Job<'_>],
    deadline: Instant,
) -> Result<(), FredError> {
    if jobs.is_empty() {
        return Ok(());
    }
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(FredError::new(ErrorKind::Timeout, "store timeout"));
    }
    let options = Options { timeout: Some(left), max_attempts: Some(1), ..Default::default() };
    let cmd = CustomCommand::new_static("FUNCTION", ClusterHash::Custom(slot), false);
    let args = vec![Value::from("LOAD"), Value::from("REPLACE"), Value::String(script.library.as_str().into())];
    let _: Value = client.with_options(&options).custom(cmd, args).await?;
    tracing::debug!(function = %script.function, "loaded the rate-limit functions on a redis node");
    Ok(())
}

/// Sends `FCALL function 1 <first key> <key args...>...` (or
/// `EVALSHA sha ...`, `EVAL source ...`) to the node owning the first key's
/// slot, bounded by `deadline`.
async fn eval(
    client: &Client,
    command: &'static str,
    script: &str,
    slot: u16,
    jobs: &[Job<'_>],
    deadline: Instant,
) -> Result<Value, FredError> {
    let Some(&(first, _)) = jobs.first() else { return Ok(Value::Array(Vec::new())) };
    let first: &str = first;
    let argv = || {
        let mut argv: Vec<Value> = Vec::with_capacity(3 + jobs.len() * (1 + scripts::ARGS));
        argv.push(Value::String(script.into()));
        argv.push(Value::Integer(1));
        argv.push(Value::String(jobs[0].0.clone()));
        for (key, args) in jobs {
            argv.push(Value::String((*key).clone()));
            argv.extend(args.iter().cloned());
        }
        argv
    };
    // Re-sent after a redirection, which proves the script did not run
    // (see `is_redirect`): at once the first time (after a `MOVED` fred
    // has re-read the cluster's layout), then every `REDIRECT_PAUSE` until
    // the deadline (an `ASK`: the key went ahead of its slot, whose owner
    // changes when the migration ends, and the old one answers `MOVED`).
    let mut redirects = 0u32;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(FredError::new(ErrorKind::Timeout, "store timeout"));
        }
        // `ClusterHash::Custom`: fred would otherwise hash the first
        // argument (the SHA) instead of the key.
        let options = Options { timeout: Some(left), max_attempts: Some(1), ..Default::default() };
        let cmd = CustomCommand::new_static(command, ClusterHash::Custom(slot), false);
        let result: Result<Value, FredError> = client.with_options(&options).custom(cmd, argv()).await;
        match result {
            Err(e) if is_redirect(&e) => {
                tracing::debug!(key = first, redirects, "re-sending a script after a cluster redirection");
                if redirects > 0 {
                    tokio::time::sleep(REDIRECT_PAUSE.min(left)).await;
                }
                redirects += 1;
            }
            other => return other,
        }
    }
}

/// The pause between re-sends of a script redirected again: a slot
/// migration in progress (`ASK`) is waited out at this pace.
const REDIRECT_PAUSE: Duration = Duration::from_millis(10);

/// The store's view of a fred error: a timeout, or Redis unavailable.
pub(super) fn store_error(e: &FredError, timeout: Duration) -> StoreError {
    match e.kind() {
        ErrorKind::Timeout => StoreError::Timeout(timeout),
        kind => StoreError::Unavailable(format!("{kind:?}: {}", e.details())),
    }
}

/// A failed script call: the error, and whether it means Redis is not
/// answering (as opposed to answering something unexpected about one key,
/// such as `WRONGTYPE`), which is what counts towards degrading.
#[derive(Debug, Clone)]
pub(super) struct Failure {
    pub error: StoreError,
    pub outage: bool,
}

fn is_outage(kind: &ErrorKind) -> bool {
    matches!(
        kind,
        ErrorKind::Timeout
            | ErrorKind::IO
            | ErrorKind::Canceled
            | ErrorKind::Routing
            | ErrorKind::Cluster
            | ErrorKind::Tls
            | ErrorKind::Backpressure
    )
}

/// With `max_redirections = 0` (see `connection`), fred answers a
/// command redirected by `MOVED` or `ASK` (a failover or a slot migration)
/// with this error instead of following it, and nothing else gives it: the
/// node that redirected the command did not run it, so sending it again
/// cannot count anything twice. A command fred wrote and lost with its
/// connection fails otherwise ("Too many failed write attempts", an IO
/// error): it may have run, and is never sent again.
fn is_redirect(e: &FredError) -> bool {
    e.details().contains("Too many redirections")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_outage_errors_count_towards_degrading() {
        assert!(is_outage(&ErrorKind::Timeout));
        assert!(is_outage(&ErrorKind::IO));
        assert!(is_outage(&ErrorKind::Cluster));
        assert!(!is_outage(&ErrorKind::InvalidArgument));
        assert!(!is_outage(&ErrorKind::Unknown));
    }
}
