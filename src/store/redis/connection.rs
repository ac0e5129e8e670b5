//! The connection to Redis: fred's client pool and its settings, the TLS
//! configuration of `rediss://` URLs, and the log of connection errors.

use std::time::{Duration, Instant};

use fred::clients::{Client, Pool};
use fred::interfaces::ClientLike;
use fred::types::Builder;
use fred::types::config::{
    ClusterDiscoveryPolicy, Config as FredConfig, ReconnectPolicy, ServerConfig, UnresponsiveConfig,
};
use prometheus::IntCounter;

use crate::config::StoreConfig;
use crate::config::pem::{client_identity, roots};

/// How long fred may take to open a connection (TCP and TLS) or to run its
/// own commands (`CLUSTER SLOTS`, `AUTH`...). fred's defaults are 10 s, which
/// would stall every check that long behind a dead node.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// Delay between reconnection attempts: constant and short. An exponential
/// policy measured here delayed recovery after a failover by seconds; with
/// 100 ms checks resumed about 120 ms after the replica's promotion.
const RECONNECT_DELAY_MS: u32 = 100;
/// A connection whose oldest command has waited this long is closed and
/// reopened (a frozen node, a black-holed network): checks give up after the
/// store timeout, but the connection would otherwise stay wedged.
const UNRESPONSIVE_AFTER: Duration = Duration::from_secs(1);
/// How long start-up waits for the first connection before going on
/// degraded (serving by policy) and connecting in the background.
pub(super) const START_WAIT: Duration = Duration::from_secs(1);

/// Builds fred's pool from `[store]` (not connected yet), whether it
/// talks to a cluster, and the name of the one node it talks to when it
/// does not (`host:port`, or Sentinel's service name). A URL fred cannot
/// parse is an error.
pub(super) fn pool(config: &StoreConfig, url: &str) -> Result<(Pool, bool, String), String> {
    let mut fred_config =
        FredConfig::from_url(url).map_err(|e| format!("store.url {:?}: {}", redact(url), e.details()))?;
    if config.tls_ca.is_some() || config.tls_client.is_some() {
        fred_config.tls = Some(tls_config(config)?.into());
    }
    let clustered = matches!(fred_config.server, ServerConfig::Clustered { .. });
    let node = match &fred_config.server {
        ServerConfig::Centralized { server } => server.to_string(),
        ServerConfig::Sentinel { service_name, .. } => format!("sentinel:{service_name}"),
        _ => super::health::WHOLE_CLUSTER.to_string(),
    };
    if let ServerConfig::Clustered { policy, .. } = &mut fred_config.server {
        // Rediscover the topology through any known node, not only the
        // seeds in the URL: a dead seed must not block recovery.
        *policy = ClusterDiscoveryPolicy::UseCache;
    }
    // Keep reconnecting when the first connection fails.
    fred_config.fail_fast = false;
    let timeout = config.timeout;
    let pool = Builder::from_config(fred_config)
        .with_connection_config(|c| {
            c.connection_timeout = CONNECT_TIMEOUT;
            c.internal_command_timeout = CONNECT_TIMEOUT;
            c.max_command_attempts = 1;
            // A redirected command comes back to tollgate instead of being
            // followed (see `call`). fred follows `ASK` only with a command
            // attempt to spare: with one attempt it gave up with "Max
            // attempts reached." and ended its connection task.
            c.max_redirections = 0;
            c.tcp.nodelay = Some(true);
            c.unresponsive =
                UnresponsiveConfig { max_timeout: Some(UNRESPONSIVE_AFTER), interval: UNRESPONSIVE_AFTER / 4 };
        })
        .with_performance_config(|p| p.default_command_timeout = timeout)
        .set_policy(ReconnectPolicy::new_constant(0, RECONNECT_DELAY_MS))
        .build_pool(config.pool_size.max(1))
        .map_err(|e| format!("cannot build the redis client: {}", e.details()))?;
    Ok((pool, clustered, node))
}

/// The pause before fred's connection task is started again after it
/// ended: short and constant, like [`RECONNECT_DELAY_MS`].
const RESTART_DELAY: Duration = Duration::from_millis(100);

/// Runs fred's connection task of `client` for as long as tollgate runs.
/// fred ends that task for good on some routing errors (it did on an `ASK`
/// it had no attempt left to follow); without a new one every later check
/// would fail until tollgate restarts. It ends without an error only when
/// the client is closed (`QUIT` at shutdown).
pub(super) async fn keep_connected(client: Client, restarts: IntCounter) {
    loop {
        let error = match client.connect().await {
            Ok(Ok(())) => return,
            Ok(Err(e)) => e.to_string(),
            Err(e) => format!("the task failed: {e}"),
        };
        restarts.inc();
        tracing::error!(%error, delay = ?RESTART_DELAY, "the redis connection task ended; starting it again");
        tokio::time::sleep(RESTART_DELAY).await;
    }
}

/// How often the same connection error is logged again while it lasts.
const ERROR_LOG_EVERY: Duration = Duration::from_secs(10);

/// Logs what fred reports about its connections (refused, reset, a TLS
/// certificate it does not trust...): the store's own errors only say that
/// Redis did not answer, and this is the why. The same error is repeated
/// at most every [`ERROR_LOG_EVERY`] while the client keeps reconnecting.
pub(super) async fn log_errors(
    mut errors: tokio::sync::broadcast::Receiver<(fred::error::Error, Option<fred::types::config::Server>)>,
) {
    use tokio::sync::broadcast::error::RecvError;
    let mut last: Option<(String, Instant)> = None;
    loop {
        match errors.recv().await {
            Ok((error, server)) => {
                let message = error.to_string();
                let repeat = last.as_ref().is_some_and(|(m, at)| *m == message && at.elapsed() < ERROR_LOG_EVERY);
                if !repeat {
                    let server = server.map_or_else(|| "-".to_string(), |s| s.to_string());
                    tracing::warn!(%server, error = %message, "redis connection error");
                    last = Some((message, Instant::now()));
                }
            }
            Err(RecvError::Lagged(_)) => {}
            Err(RecvError::Closed) => return,
        }
    }
}

/// The TLS settings of `[store]`: the roots (`tls_ca_file`, else the
/// system's) and the client identity (`tls_cert_file`, `tls_key_file`).
fn tls_config(config: &StoreConfig) -> Result<fred::rustls::ClientConfig, String> {
    let roots = match &config.tls_ca {
        Some((path, pem)) => roots(pem).map_err(|e| format!("{}: {e}", path.display()))?,
        None => {
            let mut roots = fred::rustls::RootCertStore::empty();
            let system = fred::rustls_native_certs::load_native_certs();
            for cert in system.certs {
                // A system certificate rustls cannot use is skipped, as
                // every TLS client does.
                let _ = roots.add(cert);
            }
            roots
        }
    };
    let builder = fred::rustls::ClientConfig::builder().with_root_certificates(roots);
    match &config.tls_client {
        Some(files) => {
            let (chain, key) = client_identity(&files.cert, &files.key)
                .map_err(|e| format!("{} and {}: {e}", files.cert_path.display(), files.key_path.display()))?;
            builder.with_client_auth_cert(chain, key).map_err(|e| format!("the client certificate cannot be used: {e}"))
        }
        None => Ok(builder.with_no_client_auth()),
    }
}

/// The URL without its password, for logs and errors.
pub(super) fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            format!("{}{user}:***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(redact("redis://:secret@h:6379"), "redis://:***@h:6379");
        assert_eq!(redact("rediss://user:secret@h:6379/0"), "rediss://user:***@h:6379/0");
        assert_eq!(redact("redis-cluster://h:7000?node=h:7001"), "redis-cluster://h:7000?node=h:7001");
    }
}
