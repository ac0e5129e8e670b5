//! Prometheus metrics, registered once on an explicit registry.
//!
//! The `prometheus` crate's `with_label_values` hashes the labels and takes a
//! lock on every call, so nothing on the request path calls it: routes and
//! rules resolve their counter handles when they are built (start-up or
//! reload) and keep them. No label carries a per-client value, so the number
//! of series is bounded by the config.

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Every metric tollgate exports.
pub struct Metrics {
    pub registry: Registry,
    pub requests_total: IntCounterVec,
    pub rule_decisions_total: IntCounterVec,
    /// Responses of a `cost_response_header` rule whose real cost was not
    /// a whole number: their reservation stood.
    pub cost_settle_invalid_total: IntCounterVec,
    pub request_duration_seconds: Histogram,
    pub upstream_errors_total: IntCounterVec,
    pub client_errors_total: IntCounterVec,
    pub store_errors_total: IntCounterVec,
    pub store_duration_seconds: Histogram,
    pub rules_reloads_total: IntCounterVec,
    pub config_reloads_total: IntCounterVec,
    pub rules_active: IntGauge,
    pub store_degraded: IntGauge,
    pub store_node_up: IntGaugeVec,
    pub local_cache_hits_total: IntCounter,
    pub lease_hits_total: IntCounter,
    pub leases_granted_total: IntCounter,
    pub lease_renewals_total: IntCounter,
    pub lease_give_backs_dropped_total: IntCounter,
    pub concurrency_slots_held: IntGauge,
    pub concurrency_slots_lost_total: IntCounter,
    pub store_fallback_transitions_total: IntCounterVec,
    pub connections_active: IntGauge,
    pub tunnels_active: IntGauge,
    pub connections_refused_total: IntCounter,
    pub client_gone_total: IntCounter,
    pub store_evictions_total: IntCounter,
    pub redis_calls_total: IntCounter,
    pub redis_call_checks_total: IntCounter,
    pub redis_misrouted_total: IntCounter,
    pub redis_connection_restarts_total: IntCounter,
    pub upstream_server_requests_total: IntCounterVec,
    pub upstream_server_failures_total: IntCounterVec,
    pub upstream_server_inflight: IntGaugeVec,
    pub upstream_server_healthy: IntGaugeVec,
    pub upstream_unavailable_total: IntCounterVec,
    pub upstream_busy_total: IntCounterVec,
    pub upstream_panic_total: IntCounterVec,
    pub upstream_retries_total: IntCounterVec,
    pub upstream_retry_budget_exhausted_total: IntCounterVec,
    pub tls_reload_failures_total: IntCounter,
    pub tls_plain_http_total: IntCounter,
    pub tls_certificate_expiry_timestamp_seconds: IntGaugeVec,
    pub access_log_dropped_total: IntCounter,
}

/// Per-rule decision counters, resolved once per rule per reload.
#[derive(Clone)]
pub struct RuleCounters {
    pub allowed: IntCounter,
    pub limited: IntCounter,
    pub shadow_limited: IntCounter,
}

/// Per-route request counters, resolved once at start-up.
#[derive(Clone)]
pub struct RouteCounters {
    pub allowed: IntCounter,
    pub limited: IntCounter,
    pub store_unavailable: IntCounter,
    /// Answered 403 by a `[[deny]]` entry.
    pub denied: IntCounter,
    /// Answered by tollgate for any other reason (no route, bad request,
    /// invalid token).
    pub rejected: IntCounter,
}

/// Latency buckets for the whole request and for one store round trip:
/// from 50 µs (a memory-store check) to 10 s (a slow upstream).
const LATENCY_BUCKETS: &[f64] =
    &[0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Metrics {
        let registry = Registry::new();
        // Registration only fails for a duplicate or malformed name, and
        // every name here is a distinct literal: a failure is a bug caught
        // by the first test that builds a server.
        fn reg<T: prometheus::core::Collector + Clone + 'static>(r: &Registry, m: T) -> T {
            r.register(Box::new(m.clone())).expect("metric names are distinct literals");
            m
        }
        fn counter_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
            reg(r, IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric definition"))
        }
        fn gauge_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
            reg(r, IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric definition"))
        }
        fn gauge(r: &Registry, name: &str, help: &str) -> IntGauge {
            reg(r, IntGauge::new(name, help).expect("valid metric definition"))
        }
        fn histogram(r: &Registry, name: &str, help: &str) -> Histogram {
            let opts = HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec());
            reg(r, Histogram::with_opts(opts).expect("valid metric definition"))
        }
        let metrics = Metrics {
            requests_total: counter_vec(
                &registry,
                "tollgate_requests_total",
                "Requests by route and rate-limit decision.",
                &["route", "decision"],
            ),
            rule_decisions_total: counter_vec(
                &registry,
                "tollgate_rule_decisions_total",
                "Rule decisions (allowed, limited, shadow_limited) by rule.",
                &["rule", "decision"],
            ),
            cost_settle_invalid_total: counter_vec(
                &registry,
                "tollgate_cost_settle_invalid_total",
                "Responses whose cost_response_header was not a whole number, by rule (the reserved cost stood).",
                &["rule"],
            ),
            request_duration_seconds: histogram(
                &registry,
                "tollgate_request_duration_seconds",
                "Time from request received to response headers sent.",
            ),
            upstream_errors_total: counter_vec(
                &registry,
                "tollgate_upstream_errors_total",
                "Failed upstream calls by upstream and kind (connect, timeout, reset).",
                &["upstream", "kind"],
            ),
            client_errors_total: counter_vec(
                &registry,
                "tollgate_client_errors_total",
                "Requests that failed on the client's side while being forwarded, by kind (bad_body, body_read_timeout, body_too_large).",
                &["kind"],
            ),
            store_errors_total: counter_vec(
                &registry,
                "tollgate_store_errors_total",
                "Store checks that failed or timed out, by backend.",
                &["backend"],
            ),
            store_duration_seconds: histogram(
                &registry,
                "tollgate_store_duration_seconds",
                "Time of one store check (all rules of a request).",
            ),
            rules_reloads_total: counter_vec(
                &registry,
                "tollgate_rules_reloads_total",
                "Rule reloads by result (success, failure).",
                &["result"],
            ),
            config_reloads_total: counter_vec(
                &registry,
                "tollgate_config_reloads_total",
                "Reloads of the main file's routes and upstreams by result (success, failure).",
                &["result"],
            ),
            rules_active: gauge(&registry, "tollgate_rules_active", "Rules currently in force."),
            store_degraded: gauge(
                &registry,
                "tollgate_store_degraded",
                "1 while the checks of some keys follow on_error because a store node did not answer (see tollgate_store_node_up).",
            ),
            store_node_up: gauge_vec(
                &registry,
                "tollgate_store_node_up",
                "1 while checks go to this Redis node, 0 while they follow on_error until a probe sees it answer.",
                &["node"],
            ),
            local_cache_hits_total: reg(
                &registry,
                IntCounter::new(
                    "tollgate_local_cache_hits_total",
                    "Requests rejected from the local over-limit cache without asking the store.",
                )
                .expect("valid metric definition"),
            ),
            lease_hits_total: reg(
                &registry,
                IntCounter::new(
                    "tollgate_lease_hits_total",
                    "Requests admitted from quota leased from the store, without asking it.",
                )
                .expect("valid metric definition"),
            ),
            leases_granted_total: reg(
                &registry,
                IntCounter::new("tollgate_leases_granted_total", "Leases of quota the store granted to this instance.")
                    .expect("valid metric definition"),
            ),
            lease_renewals_total: reg(
                &registry,
                IntCounter::new(
                    "tollgate_lease_renewals_total",
                    "Leases renewed ahead: calls no request waited for, sent as a lease ran low.",
                )
                .expect("valid metric definition"),
            ),
            lease_give_backs_dropped_total: reg(
                &registry,
                IntCounter::new(
                    "tollgate_lease_give_backs_dropped_total",
                    "Give-backs of leased units dropped (a failed call, which may have run, or a full backlog): their units stay counted in the store until their window or escrow slot ends.",
                )
                .expect("valid metric definition"),
            ),
            concurrency_slots_held: gauge(
                &registry,
                "tollgate_concurrency_slots_held",
                "Concurrency slots this instance holds in Redis now (requests in flight under concurrency rules), renewed while they run.",
            ),
            concurrency_slots_lost_total: reg(
                &registry,
                IntCounter::new(
                    "tollgate_concurrency_slots_lost_total",
                    "Concurrency slots found expired when renewed (Redis unreachable for a whole slot_ttl): their requests went on without being counted.",
                )
                .expect("valid metric definition"),
            ),
            store_fallback_transitions_total: counter_vec(
                &registry,
                "tollgate_store_fallback_transitions_total",
                "Switches between the shared store and local fallback, by direction (to_local, to_store).",
                &["direction"],
            ),
            connections_active: gauge(&registry, "tollgate_connections_active", "Client connections open now."),
            tunnels_active: gauge(
                &registry,
                "tollgate_tunnels_active",
                "WebSocket and other upgraded connections being relayed now (each also counts in tollgate_connections_active).",
            ),
            access_log_dropped_total: reg(
                &registry,
                IntCounter::new(
                    "tollgate_access_log_dropped_total",
                    "Access log lines dropped: the writer's queue was full (a slow disk) or the write failed.",
                )
                .expect("valid metric definition"),
            ),
            connections_refused_total: reg(
                &registry,
                IntCounter::new(
                    "tollgate_connections_refused_total",
                    "Client connections closed at once because max_connections was reached.",
                )
                .expect("valid metric definition"),
            ),
            client_gone_total: reg(
                &registry,
                IntCounter::new(
                    "tollgate_client_gone_total",
                    "Requests whose client went away before their response ended (not an upstream failure).",
                )
                .expect("valid metric definition"),
            ),
            store_evictions_total: reg(
                &registry,
                IntCounter::new(
                    "tollgate_store_evictions_total",
                    "Keys the memory store (or the Redis store's local state) forgot because [store] max_keys was reached.",
                )
                .expect("valid metric definition"),
            ),
            redis_calls_total: reg(
                &registry,
                IntCounter::new(
                    "tollgate_redis_calls_total",
                    "Script calls that decided requests' checks; each decides a batch of checks of concurrent requests.",
                )
                .expect("valid metric definition"),
            ),
            redis_call_checks_total: reg(
                &registry,
                IntCounter::new(
                    "tollgate_redis_call_checks_total",
                    "Checks decided by those calls: divided by tollgate_redis_calls_total, the mean batch size.",
                )
                .expect("valid metric definition"),
            ),
            redis_misrouted_total: reg(
                &registry,
                IntCounter::new(
                    "tollgate_redis_misrouted_total",
                    "Checks a batch took to a Redis node that did not own their key (the cluster's layout changed), asked again of the owner.",
                )
                .expect("valid metric definition"),
            ),
            redis_connection_restarts_total: reg(
                &registry,
                IntCounter::new(
                    "tollgate_redis_connection_restarts_total",
                    "Times fred's connection task to Redis ended on an error and was started again.",
                )
                .expect("valid metric definition"),
            ),
            upstream_server_requests_total: counter_vec(
                &registry,
                "tollgate_upstream_server_requests_total",
                "Requests sent to each upstream server (a retry counts again, on the server it went to).",
                &["upstream", "server"],
            ),
            upstream_server_failures_total: counter_vec(
                &registry,
                "tollgate_upstream_server_failures_total",
                "Requests to each upstream server that were refused, reset or timed out.",
                &["upstream", "server"],
            ),
            upstream_server_inflight: gauge_vec(
                &registry,
                "tollgate_upstream_server_inflight",
                "Requests sent to each upstream server and not yet answered.",
                &["upstream", "server"],
            ),
            upstream_server_healthy: gauge_vec(
                &registry,
                "tollgate_upstream_server_healthy",
                "1 while an upstream server takes requests, 0 while failures or health checks have taken it out.",
                &["upstream", "server"],
            ),
            upstream_unavailable_total: counter_vec(
                &registry,
                "tollgate_upstream_unavailable_total",
                "Requests answered 503 because no server of their upstream could be tried.",
                &["upstream"],
            ),
            upstream_busy_total: counter_vec(
                &registry,
                "tollgate_upstream_busy_total",
                "Requests answered 503 upstream_busy because every server in service was at its max_inflight.",
                &["upstream"],
            ),
            upstream_panic_total: counter_vec(
                &registry,
                "tollgate_upstream_panic_total",
                "Server choices made in panic mode: more servers out than max_ejected_percent allows, so all were candidates.",
                &["upstream"],
            ),
            upstream_retries_total: counter_vec(
                &registry,
                "tollgate_upstream_retries_total",
                "Requests sent again to another server of their upstream after a failed try.",
                &["upstream"],
            ),
            upstream_retry_budget_exhausted_total: counter_vec(
                &registry,
                "tollgate_upstream_retry_budget_exhausted_total",
                "Retries not made because retries in flight were at retry_budget_percent of the requests in flight.",
                &["upstream"],
            ),
            tls_reload_failures_total: reg(
                &registry,
                IntCounter::new(
                    "tollgate_tls_reload_failures_total",
                    "Changed [[listen.tls]] certificate or key files that did not load; the previous certificate stays in force.",
                )
                .expect("valid metric definition"),
            ),
            tls_plain_http_total: reg(
                &registry,
                IntCounter::new(
                    "tollgate_tls_plain_http_total",
                    "Connections to the TLS proxy listener that sent plain HTTP, answered 400 plain_http_to_https_port.",
                )
                .expect("valid metric definition"),
            ),
            tls_certificate_expiry_timestamp_seconds: gauge_vec(
                &registry,
                "tollgate_tls_certificate_expiry_timestamp_seconds",
                "When each [[listen.tls]] certificate in force expires (notAfter), in seconds since the epoch, by its first DNS name.",
                &["name"],
            ),
            registry,
        };
        // A labelled counter is absent until its first increment, and an
        // absent series defeats `increase()` and alerts on it: the labels
        // known up front are created at zero (the store backend's by the
        // proxy, rules' and routes' when they are built).
        for result in ["success", "failure"] {
            metrics.rules_reloads_total.with_label_values(&[result]);
            metrics.config_reloads_total.with_label_values(&[result]);
        }
        metrics
    }

    /// The handles one rule updates.
    pub fn rule_counters(&self, rule: &str) -> RuleCounters {
        RuleCounters {
            allowed: self.rule_decisions_total.with_label_values(&[rule, "allowed"]),
            limited: self.rule_decisions_total.with_label_values(&[rule, "limited"]),
            shadow_limited: self.rule_decisions_total.with_label_values(&[rule, "shadow_limited"]),
        }
    }

    /// The handles one route (or "none", for requests no route matched)
    /// updates.
    pub fn route_counters(&self, route: &str) -> RouteCounters {
        RouteCounters {
            allowed: self.requests_total.with_label_values(&[route, "allowed"]),
            limited: self.requests_total.with_label_values(&[route, "limited"]),
            store_unavailable: self.requests_total.with_label_values(&[route, "store_unavailable"]),
            denied: self.requests_total.with_label_values(&[route, "denied"]),
            rejected: self.requests_total.with_label_values(&[route, "rejected"]),
        }
    }

    /// The text exposition format.
    /// Removes the series of an upstream server no longer configured, so
    /// that dashboards stop showing it (its counters start again from zero
    /// if it comes back).
    pub fn forget_upstream_server(&self, upstream: &str, server: &str) {
        let labels = [upstream, server];
        let _ = self.upstream_server_requests_total.remove_label_values(&labels);
        let _ = self.upstream_server_failures_total.remove_label_values(&labels);
        let _ = self.upstream_server_inflight.remove_label_values(&labels);
        let _ = self.upstream_server_healthy.remove_label_values(&labels);
    }

    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        // Encoding into a Vec cannot fail on IO; it fails only for metric
        // families with no metrics, which `gather` never returns.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
