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
    /// Each rule's `limited` and `shadow_limited` handles, for the
    /// periodic summary: reading them costs two loads a rule, where
    /// collecting the vector copies every series' labels (tens of
    /// thousands with thousands of rules).
    pub rule_series: parking_lot::Mutex<std::collections::BTreeMap<String, (IntCounter, IntCounter)>>,
    /// Responses of a `cost_response_header` rule whose real cost was not
    /// a whole number: their reservation stood.
    pub cost_settle_invalid_total: IntCounterVec,
    /// Keys a rule's `penalty` put in the penalty box.
    pub penalties_total: IntCounterVec,
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
    pub tracing_spans_total: IntCounterVec,
}

/// Per-rule decision counters, resolved once per rule per reload.
#[derive(Clone)]
pub struct RuleCounters {
    pub allowed: IntCounter,
    pub limited: IntCounter,
    pub shadow_limited: IntCounter,
    /// `tollgate_penalties_total` of a rule with `penalty` (see
    /// [`Metrics::penalty_counter`]).
    pub penalties: Option<IntCounter>,
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
        let r = &registry;
        let metrics = Metrics {
            requests_total: counter_vec(r, &REQUESTS_TOTAL),
            rule_decisions_total: counter_vec(r, &RULE_DECISIONS_TOTAL),
            rule_series: Default::default(),
            cost_settle_invalid_total: counter_vec(r, &COST_SETTLE_INVALID_TOTAL),
            penalties_total: counter_vec(r, &PENALTIES_TOTAL),
            request_duration_seconds: histogram(r, &REQUEST_DURATION_SECONDS),
            upstream_errors_total: counter_vec(r, &UPSTREAM_ERRORS_TOTAL),
            client_errors_total: counter_vec(r, &CLIENT_ERRORS_TOTAL),
            store_errors_total: counter_vec(r, &STORE_ERRORS_TOTAL),
            store_duration_seconds: histogram(r, &STORE_DURATION_SECONDS),
            rules_reloads_total: counter_vec(r, &RULES_RELOADS_TOTAL),
            config_reloads_total: counter_vec(r, &CONFIG_RELOADS_TOTAL),
            rules_active: gauge(r, &RULES_ACTIVE),
            store_degraded: gauge(r, &STORE_DEGRADED),
            store_node_up: gauge_vec(r, &STORE_NODE_UP),
            local_cache_hits_total: counter(r, &LOCAL_CACHE_HITS_TOTAL),
            lease_hits_total: counter(r, &LEASE_HITS_TOTAL),
            leases_granted_total: counter(r, &LEASES_GRANTED_TOTAL),
            lease_renewals_total: counter(r, &LEASE_RENEWALS_TOTAL),
            lease_give_backs_dropped_total: counter(r, &LEASE_GIVE_BACKS_DROPPED_TOTAL),
            concurrency_slots_held: gauge(r, &CONCURRENCY_SLOTS_HELD),
            concurrency_slots_lost_total: counter(r, &CONCURRENCY_SLOTS_LOST_TOTAL),
            store_fallback_transitions_total: counter_vec(r, &STORE_FALLBACK_TRANSITIONS_TOTAL),
            connections_active: gauge(r, &CONNECTIONS_ACTIVE),
            tunnels_active: gauge(r, &TUNNELS_ACTIVE),
            access_log_dropped_total: counter(r, &ACCESS_LOG_DROPPED_TOTAL),
            tracing_spans_total: counter_vec(r, &TRACING_SPANS_TOTAL),
            connections_refused_total: counter(r, &CONNECTIONS_REFUSED_TOTAL),
            client_gone_total: counter(r, &CLIENT_GONE_TOTAL),
            store_evictions_total: counter(r, &STORE_EVICTIONS_TOTAL),
            redis_calls_total: counter(r, &REDIS_CALLS_TOTAL),
            redis_call_checks_total: counter(r, &REDIS_CALL_CHECKS_TOTAL),
            redis_misrouted_total: counter(r, &REDIS_MISROUTED_TOTAL),
            redis_connection_restarts_total: counter(r, &REDIS_CONNECTION_RESTARTS_TOTAL),
            upstream_server_requests_total: counter_vec(r, &UPSTREAM_SERVER_REQUESTS_TOTAL),
            upstream_server_failures_total: counter_vec(r, &UPSTREAM_SERVER_FAILURES_TOTAL),
            upstream_server_inflight: gauge_vec(r, &UPSTREAM_SERVER_INFLIGHT),
            upstream_server_healthy: gauge_vec(r, &UPSTREAM_SERVER_HEALTHY),
            upstream_unavailable_total: counter_vec(r, &UPSTREAM_UNAVAILABLE_TOTAL),
            upstream_busy_total: counter_vec(r, &UPSTREAM_BUSY_TOTAL),
            upstream_panic_total: counter_vec(r, &UPSTREAM_PANIC_TOTAL),
            upstream_retries_total: counter_vec(r, &UPSTREAM_RETRIES_TOTAL),
            upstream_retry_budget_exhausted_total: counter_vec(r, &UPSTREAM_RETRY_BUDGET_EXHAUSTED_TOTAL),
            tls_reload_failures_total: counter(r, &TLS_RELOAD_FAILURES_TOTAL),
            tls_plain_http_total: counter(r, &TLS_PLAIN_HTTP_TOTAL),
            tls_certificate_expiry_timestamp_seconds: gauge_vec(r, &TLS_CERTIFICATE_EXPIRY_TIMESTAMP_SECONDS),
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
        let counters = RuleCounters {
            allowed: self.rule_decisions_total.with_label_values(&[rule, "allowed"]),
            limited: self.rule_decisions_total.with_label_values(&[rule, "limited"]),
            shadow_limited: self.rule_decisions_total.with_label_values(&[rule, "shadow_limited"]),
            penalties: None,
        };
        let mut series = self.rule_series.lock();
        if !series.contains_key(rule) {
            series.insert(rule.to_owned(), (counters.limited.clone(), counters.shadow_limited.clone()));
        }
        drop(series);
        counters
    }

    /// `tollgate_penalties_total` of a rule with `penalty`, at zero from
    /// the start; rules without one have no series.
    pub fn penalty_counter(&self, rule: &str) -> IntCounter {
        self.penalties_total.with_label_values(&[rule])
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

// Registration only fails for a duplicate or malformed name, and
// every name here is a distinct literal: a failure is a bug caught
// by the first test that builds a server.
fn reg<T: prometheus::core::Collector + Clone + 'static>(r: &Registry, m: T) -> T {
    r.register(Box::new(m.clone())).expect("metric names are distinct literals");
    m
}
fn counter(r: &Registry, s: &Spec) -> IntCounter {
    reg(r, IntCounter::new(s.name, s.help).expect("valid metric definition"))
}
fn counter_vec(r: &Registry, s: &Spec) -> IntCounterVec {
    reg(r, IntCounterVec::new(Opts::new(s.name, s.help), s.labels).expect("valid metric definition"))
}
fn gauge(r: &Registry, s: &Spec) -> IntGauge {
    reg(r, IntGauge::new(s.name, s.help).expect("valid metric definition"))
}
fn gauge_vec(r: &Registry, s: &Spec) -> IntGaugeVec {
    reg(r, IntGaugeVec::new(Opts::new(s.name, s.help), s.labels).expect("valid metric definition"))
}
fn histogram(r: &Registry, s: &Spec) -> Histogram {
    let opts = HistogramOpts::new(s.name, s.help).buckets(LATENCY_BUCKETS.to_vec());
    reg(r, Histogram::with_opts(opts).expect("valid metric definition"))
}

/// A metric's name, help text and labels (none for a plain counter, gauge
/// or histogram): the contract dashboards and alerts rely on, so kept
/// together in one table, field by field of [`Metrics`].
struct Spec {
    name: &'static str,
    help: &'static str,
    labels: &'static [&'static str],
}

const REQUESTS_TOTAL: Spec = Spec {
    name: "tollgate_requests_total",
    help: "Requests by route and rate-limit decision.",
    labels: &["route", "decision"],
};
const RULE_DECISIONS_TOTAL: Spec = Spec {
    name: "tollgate_rule_decisions_total",
    help: "Rule decisions (allowed, limited, shadow_limited) by rule.",
    labels: &["rule", "decision"],
};
const COST_SETTLE_INVALID_TOTAL: Spec = Spec {
    name: "tollgate_cost_settle_invalid_total",
    help: "Responses whose cost_response_header was not a whole number, by rule (the reserved cost stood).",
    labels: &["rule"],
};
const PENALTIES_TOTAL: Spec = Spec {
    name: "tollgate_penalties_total",
    help: "Keys put in the penalty box by a rule's penalty, by rule (blocks through the admin API are not counted).",
    labels: &["rule"],
};
const REQUEST_DURATION_SECONDS: Spec = Spec {
    name: "tollgate_request_duration_seconds",
    help: "Time from request received to response headers sent.",
    labels: &[],
};
const UPSTREAM_ERRORS_TOTAL: Spec = Spec {
    name: "tollgate_upstream_errors_total",
    help: "Failed upstream calls by upstream and kind (connect, timeout, reset).",
    labels: &["upstream", "kind"],
};
const CLIENT_ERRORS_TOTAL: Spec = Spec {
    name: "tollgate_client_errors_total",
    help: "Requests that failed on the client's side while being forwarded, by kind (bad_body, body_read_timeout, body_too_large).",
    labels: &["kind"],
};
const STORE_ERRORS_TOTAL: Spec = Spec {
    name: "tollgate_store_errors_total",
    help: "Store checks that failed or timed out, by backend.",
    labels: &["backend"],
};
const STORE_DURATION_SECONDS: Spec = Spec {
    name: "tollgate_store_duration_seconds",
    help: "Time of one store check (all rules of a request).",
    labels: &[],
};
const RULES_RELOADS_TOTAL: Spec = Spec {
    name: "tollgate_rules_reloads_total",
    help: "Rule reloads by result (success, failure).",
    labels: &["result"],
};
const CONFIG_RELOADS_TOTAL: Spec = Spec {
    name: "tollgate_config_reloads_total",
    help: "Reloads of the main file's routes and upstreams by result (success, failure).",
    labels: &["result"],
};
const RULES_ACTIVE: Spec = Spec { name: "tollgate_rules_active", help: "Rules currently in force.", labels: &[] };
const STORE_DEGRADED: Spec = Spec {
    name: "tollgate_store_degraded",
    help: "1 while the checks of some keys follow on_error because a store node did not answer (see tollgate_store_node_up).",
    labels: &[],
};
const STORE_NODE_UP: Spec = Spec {
    name: "tollgate_store_node_up",
    help: "1 while checks go to this Redis node, 0 while they follow on_error until a probe sees it answer.",
    labels: &["node"],
};
const LOCAL_CACHE_HITS_TOTAL: Spec = Spec {
    name: "tollgate_local_cache_hits_total",
    help: "Requests rejected from the local over-limit cache without asking the store.",
    labels: &[],
};
const LEASE_HITS_TOTAL: Spec = Spec {
    name: "tollgate_lease_hits_total",
    help: "Requests admitted from quota leased from the store, without asking it.",
    labels: &[],
};
const LEASES_GRANTED_TOTAL: Spec = Spec {
    name: "tollgate_leases_granted_total",
    help: "Leases of quota the store granted to this instance.",
    labels: &[],
};
const LEASE_RENEWALS_TOTAL: Spec = Spec {
    name: "tollgate_lease_renewals_total",
    help: "Leases renewed ahead: calls no request waited for, sent as a lease ran low.",
    labels: &[],
};
const LEASE_GIVE_BACKS_DROPPED_TOTAL: Spec = Spec {
    name: "tollgate_lease_give_backs_dropped_total",
    help: "Give-backs of leased units dropped (a failed call, which may have run, or a full backlog): their units stay counted in the store until their window or escrow slot ends.",
    labels: &[],
};
const CONCURRENCY_SLOTS_HELD: Spec = Spec {
    name: "tollgate_concurrency_slots_held",
    help: "Concurrency slots this instance holds in Redis now (requests in flight under concurrency rules), renewed while they run.",
    labels: &[],
};
const CONCURRENCY_SLOTS_LOST_TOTAL: Spec = Spec {
    name: "tollgate_concurrency_slots_lost_total",
    help: "Concurrency slots found expired when renewed (Redis unreachable for a whole slot_ttl): their requests went on without being counted.",
    labels: &[],
};
const STORE_FALLBACK_TRANSITIONS_TOTAL: Spec = Spec {
    name: "tollgate_store_fallback_transitions_total",
    help: "Switches between the shared store and local fallback, by direction (to_local, to_store).",
    labels: &["direction"],
};
const CONNECTIONS_ACTIVE: Spec =
    Spec { name: "tollgate_connections_active", help: "Client connections open now.", labels: &[] };
const TUNNELS_ACTIVE: Spec = Spec {
    name: "tollgate_tunnels_active",
    help: "WebSocket and other upgraded connections being relayed now (each also counts in tollgate_connections_active).",
    labels: &[],
};
const ACCESS_LOG_DROPPED_TOTAL: Spec = Spec {
    name: "tollgate_access_log_dropped_total",
    help: "Access log lines dropped: the writer's queue was full (a slow disk) or the write failed.",
    labels: &[],
};
const TRACING_SPANS_TOTAL: Spec = Spec {
    name: "tollgate_tracing_spans_total",
    help: "Spans of sampled requests by result: exported (the collector took them), dropped (the export queue was full) or failed (the collector refused them or did not answer).",
    labels: &["result"],
};
const CONNECTIONS_REFUSED_TOTAL: Spec = Spec {
    name: "tollgate_connections_refused_total",
    help: "Client connections closed at once because max_connections was reached.",
    labels: &[],
};
const CLIENT_GONE_TOTAL: Spec = Spec {
    name: "tollgate_client_gone_total",
    help: "Requests whose client went away before their response ended (not an upstream failure).",
    labels: &[],
};
const STORE_EVICTIONS_TOTAL: Spec = Spec {
    name: "tollgate_store_evictions_total",
    help: "Keys the memory store (or the Redis store's local state) forgot because [store] max_keys was reached.",
    labels: &[],
};
const REDIS_CALLS_TOTAL: Spec = Spec {
    name: "tollgate_redis_calls_total",
    help: "Script calls that decided requests' checks; each decides a batch of checks of concurrent requests.",
    labels: &[],
};
const REDIS_CALL_CHECKS_TOTAL: Spec = Spec {
    name: "tollgate_redis_call_checks_total",
    help: "Checks decided by those calls: divided by tollgate_redis_calls_total, the mean batch size.",
    labels: &[],
};
const REDIS_MISROUTED_TOTAL: Spec = Spec {
    name: "tollgate_redis_misrouted_total",
    help: "Checks a batch took to a Redis node that did not own their key (the cluster's layout changed), asked again of the owner.",
    labels: &[],
};
const REDIS_CONNECTION_RESTARTS_TOTAL: Spec = Spec {
    name: "tollgate_redis_connection_restarts_total",
    help: "Times fred's connection task to Redis ended on an error and was started again.",
    labels: &[],
};
const UPSTREAM_SERVER_REQUESTS_TOTAL: Spec = Spec {
    name: "tollgate_upstream_server_requests_total",
    help: "Requests sent to each upstream server (a retry counts again, on the server it went to).",
    labels: &["upstream", "server"],
};
const UPSTREAM_SERVER_FAILURES_TOTAL: Spec = Spec {
    name: "tollgate_upstream_server_failures_total",
    help: "Requests to each upstream server that were refused, reset or timed out.",
    labels: &["upstream", "server"],
};
const UPSTREAM_SERVER_INFLIGHT: Spec = Spec {
    name: "tollgate_upstream_server_inflight",
    help: "Requests sent to each upstream server and not yet answered.",
    labels: &["upstream", "server"],
};
const UPSTREAM_SERVER_HEALTHY: Spec = Spec {
    name: "tollgate_upstream_server_healthy",
    help: "1 while an upstream server takes requests, 0 while failures or health checks have taken it out.",
    labels: &["upstream", "server"],
};
const UPSTREAM_UNAVAILABLE_TOTAL: Spec = Spec {
    name: "tollgate_upstream_unavailable_total",
    help: "Requests answered 503 because no server of their upstream could be tried.",
    labels: &["upstream"],
};
const UPSTREAM_BUSY_TOTAL: Spec = Spec {
    name: "tollgate_upstream_busy_total",
    help: "Requests answered 503 upstream_busy because every server in service was at its max_inflight.",
    labels: &["upstream"],
};
const UPSTREAM_PANIC_TOTAL: Spec = Spec {
    name: "tollgate_upstream_panic_total",
    help: "Server choices made in panic mode: more servers out than max_ejected_percent allows, so all were candidates.",
    labels: &["upstream"],
};
const UPSTREAM_RETRIES_TOTAL: Spec = Spec {
    name: "tollgate_upstream_retries_total",
    help: "Requests sent again to another server of their upstream after a failed try.",
    labels: &["upstream"],
};
const UPSTREAM_RETRY_BUDGET_EXHAUSTED_TOTAL: Spec = Spec {
    name: "tollgate_upstream_retry_budget_exhausted_total",
    help: "Retries not made because retries in flight were at retry_budget_percent of the requests in flight.",
    labels: &["upstream"],
};
const TLS_RELOAD_FAILURES_TOTAL: Spec = Spec {
    name: "tollgate_tls_reload_failures_total",
    help: "Changed [[listen.tls]] certificate or key files that did not load; the previous certificate stays in force.",
    labels: &[],
};
const TLS_PLAIN_HTTP_TOTAL: Spec = Spec {
    name: "tollgate_tls_plain_http_total",
    help: "Connections to the TLS proxy listener that sent plain HTTP, answered 400 plain_http_to_https_port.",
    labels: &[],
};
const TLS_CERTIFICATE_EXPIRY_TIMESTAMP_SECONDS: Spec = Spec {
    name: "tollgate_tls_certificate_expiry_timestamp_seconds",
    help: "When each [[listen.tls]] certificate in force expires (notAfter), in seconds since the epoch, by its first DNS name.",
    labels: &["name"],
};

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
