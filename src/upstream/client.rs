//! One upstream and its servers, as requests find them: each server with
//! its connection pool, health and counters (taken over by the next
//! configuration when a reload leaves the server as it was), and the
//! upstream's own counters.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use prometheus::{IntCounter, IntGauge};
use tokio::time::Instant;

use super::balance::Balancer;
use super::forward::{RequestBody, UPSTREAM_READ_BUFFER};
use super::health::{Health, spawn_check};
use super::pool::{Answered, Pool};
use crate::config::Upstream;
use crate::obs::metrics::Metrics;

/// One upstream: its servers, each with its own connection pool, health
/// and counters, and the error counters of the upstream as a whole.
pub struct UpstreamClient {
    pub config: Upstream,
    pub(super) servers: Box<[Arc<UpstreamServer>]>,
    /// One server, no health check and no `max_inflight`: nothing to
    /// choose and nothing to watch.
    pub(super) single: bool,
    pub(super) balancer: Balancer,
    /// Taken while deciding whether a server may go out, so that two
    /// failures at once cannot both pass the cap.
    pub(super) ejecting: Mutex<()>,
    /// Retries in flight, against the retry budget.
    pub(super) retrying: AtomicU64,
    pub(super) counters: Counters,
}

/// The upstream's own counters (its servers have theirs).
pub(super) struct Counters {
    pub(super) unavailable: IntCounter,
    pub(super) busy: IntCounter,
    pub(super) panic: IntCounter,
    pub(super) retries: IntCounter,
    pub(super) budget_exhausted: IntCounter,
    pub(super) connect_errors: IntCounter,
    pub(super) timeouts: IntCounter,
    pub(super) resets: IntCounter,
    pub(super) local: IntCounter,
    pub(super) bad_bodies: IntCounter,
    pub(super) body_timeouts: IntCounter,
    pub(super) too_large: IntCounter,
}

/// One server of an upstream; shared with the next configuration when a
/// reload leaves the server as it was, so its health, backoff and pooled
/// connections carry over.
pub(super) struct UpstreamServer {
    pub(super) address: String,
    pub(super) pool: Pool<RequestBody>,
    pub(super) health: Arc<Health>,
    /// Requests sent to it; with `answered`, what it has in flight.
    pub(super) requests: IntCounter,
    /// Requests whose response has ended (or failed, or was abandoned).
    pub(super) answered: Arc<AtomicU64>,
    pub(super) failures: IntCounter,
    /// `tollgate_upstream_server_inflight`, set from `requests` and
    /// `answered` when metrics are read ([`UpstreamClient::refresh_gauges`]).
    pub(super) inflight_gauge: IntGauge,
}

impl UpstreamServer {
    fn new(config: &Upstream, i: usize, metrics: &Metrics, epoch: Instant) -> UpstreamServer {
        let s = &config.servers[i];
        let labels = [config.name.as_str(), s.address.as_str()];
        let health = Arc::new(Health::new(metrics.upstream_server_healthy.with_label_values(&labels), epoch));
        if let Some(check) = &config.health_check {
            spawn_check(&health, s, check, config);
        }
        let timeouts = metrics.upstream_errors_total.with_label_values(&[config.name.as_str(), "timeout"]);
        UpstreamServer {
            address: s.address.clone(),
            // A streaming body is bounded by the upstream's `timeout`
            // between its pieces, like its head.
            pool: Pool::for_server(config, s, UPSTREAM_READ_BUFFER).limit_silence(config.timeout, timeouts),
            health,
            requests: metrics.upstream_server_requests_total.with_label_values(&labels),
            failures: metrics.upstream_server_failures_total.with_label_values(&labels),
            answered: Arc::new(AtomicU64::new(0)),
            inflight_gauge: metrics.upstream_server_inflight.with_label_values(&labels),
        }
    }

    /// Requests sent and not yet answered.
    pub(super) fn inflight(&self) -> u64 {
        // `answered` first, so that it is seldom ahead of the `requests`
        // read after it; saturating for when it is.
        let answered = self.answered.load(Ordering::Relaxed);
        self.requests.get().saturating_sub(answered)
    }

    /// Counts a request sent to this server until the guard is dropped.
    pub(super) fn start(&self) -> Answered {
        self.requests.inc();
        Answered(self.answered.clone())
    }
}

impl UpstreamClient {
    /// Builds the pools and resolves every metric handle of `config`, and
    /// starts its servers' health checks. Servers that `previous` (the
    /// configuration being replaced) had with the same definition are
    /// taken over as they are.
    pub fn new(config: &Upstream, metrics: &Metrics, ipv6_prefix: u8, previous: Option<&UpstreamClient>) -> Self {
        let name = config.name.as_str();
        let err = |kind: &str| metrics.upstream_errors_total.with_label_values(&[name, kind]);
        let client_err = |kind: &str| metrics.client_errors_total.with_label_values(&[kind]);
        let up = |m: &prometheus::IntCounterVec| m.with_label_values(&[name]);
        // Every server of an upstream shares one epoch, so one clock read
        // serves them all: kept servers keep theirs.
        let epoch = previous.and_then(|p| p.servers.first()).map_or_else(Instant::now, |s| s.health.epoch());
        let servers: Box<[Arc<UpstreamServer>]> = (0..config.servers.len())
            .map(|i| {
                let address = &config.servers[i].address;
                let kept = previous.filter(|p| p.config.same_server(config, address)).and_then(|p| {
                    p.servers.iter().find(|s| s.address == *address && s.health.epoch() == epoch).cloned()
                });
                kept.unwrap_or_else(|| Arc::new(UpstreamServer::new(config, i, metrics, epoch)))
            })
            .collect();
        let single = servers.len() == 1 && config.health_check.is_none() && config.max_inflight.is_none();
        UpstreamClient {
            balancer: Balancer::new(&config.balance, &config.servers, ipv6_prefix),
            config: config.clone(),
            servers,
            single,
            ejecting: Mutex::new(()),
            retrying: AtomicU64::new(0),
            counters: Counters {
                unavailable: up(&metrics.upstream_unavailable_total),
                busy: up(&metrics.upstream_busy_total),
                panic: up(&metrics.upstream_panic_total),
                retries: up(&metrics.upstream_retries_total),
                budget_exhausted: up(&metrics.upstream_retry_budget_exhausted_total),
                connect_errors: err("connect"),
                timeouts: err("timeout"),
                resets: err("reset"),
                local: err("local"),
                bad_bodies: client_err("bad_body"),
                body_timeouts: client_err("body_read_timeout"),
                too_large: client_err("body_too_large"),
            },
        }
    }

    /// How many servers the upstream has.
    pub fn servers(&self) -> usize {
        self.servers.len()
    }

    /// The configured addresses of its servers (their metric labels).
    pub fn addresses(&self) -> impl Iterator<Item = &str> {
        self.servers.iter().map(|s| s.address.as_str())
    }

    /// The address (as the access log shows it) of server `i`.
    pub fn server_authority(&self, i: usize) -> Option<&http::uri::Authority> {
        self.config.servers.get(i).map(|s| &s.authority)
    }

    /// Requests being forwarded to this upstream right now, their response
    /// bodies included (elastic throttling reads it).
    pub fn inflight(&self) -> usize {
        self.servers.iter().map(|s| s.inflight()).sum::<u64>() as usize
    }

    /// Each server's state as the admin listener shows it (`/upstreams`).
    pub fn server_states(&self) -> Vec<ServerState> {
        self.servers
            .iter()
            .map(|s| ServerState {
                address: s.address.clone(),
                up: s.health.is_up(s.health.now_ms()),
                ejected: s.health.ejected(),
                inflight: s.inflight(),
                requests: s.requests.get(),
                failures: s.failures.get(),
            })
            .collect()
    }

    /// Sets each server's in-flight gauge, for a metrics scrape.
    pub fn refresh_gauges(&self) {
        for s in &self.servers {
            s.inflight_gauge.set(s.inflight() as i64);
        }
    }
}

/// One upstream server at the moment it was looked at.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ServerState {
    pub address: String,
    /// In service: not taken out by its health check or passive health
    /// (a server whose backoff has run out is in service again).
    pub up: bool,
    /// Passive health has taken it out at least once since it last
    /// answered well.
    pub ejected: bool,
    pub inflight: u64,
    pub requests: u64,
    pub failures: u64,
}
