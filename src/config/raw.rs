//! The files as serde reads them: every table rejects unknown keys, and
//! values that are validated later keep their position (`Spanned`) so the
//! error can point at them.

use std::collections::BTreeMap;

use serde::Deserialize;
use toml::Spanned;

use super::spec::{InvalidToken, OnError, RuleMode};
use crate::wire::normalize::EncodedSlashes;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub listen: Option<RawListen>,
    pub rules: Option<RawRules>,
    pub store: Option<RawStore>,
    pub client: Option<RawClient>,
    #[serde(default)]
    pub upstream: Vec<Spanned<RawUpstream>>,
    #[serde(default)]
    pub route: Vec<Spanned<RawRoute>>,
    pub log: Option<RawLog>,
    pub admin: Option<RawAdmin>,
    pub tracing: Option<Spanned<RawTracing>>,
}

/// `[tracing]`: OpenTelemetry spans over OTLP/HTTP.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawTracing {
    pub otlp_endpoint: Option<Spanned<String>>,
    pub sample_ratio: Option<Spanned<f64>>,
    pub service_name: Option<Spanned<String>>,
    pub accept_traceparent: Option<Spanned<String>>,
}

/// `[log]` as serde reads it.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawLog {
    pub access: Option<Spanned<String>>,
}

/// `[admin]`: what the admin listener offers beyond its fixed endpoints.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawAdmin {
    pub top_keys: Option<Spanned<i64>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawListen {
    pub proxy: Option<Spanned<String>>,
    pub admin: Option<Spanned<String>>,
    pub header_read_timeout: Option<Spanned<String>>,
    pub idle_timeout: Option<Spanned<String>>,
    pub max_connections: Option<Spanned<i64>>,
    pub drain_timeout: Option<Spanned<String>>,
    pub max_header_bytes: Option<Spanned<i64>>,
    pub max_uri_bytes: Option<Spanned<i64>>,
    pub merge_slashes: Option<bool>,
    pub encoded_slashes: Option<EncodedSlashes>,
    pub underscores_in_headers: Option<bool>,
    pub body_read_timeout: Option<Spanned<String>>,
    pub send_timeout: Option<Spanned<String>>,
    pub tunnel_idle_timeout: Option<Spanned<String>>,
    pub connection_body_buffer: Option<Spanned<RawSize>>,
    pub max_requests_per_connection: Option<Spanned<i64>>,
    pub max_connection_age: Option<Spanned<String>>,
    pub shutdown_delay: Option<Spanned<String>>,
    pub tls: Option<Vec<Spanned<RawTls>>>,
    pub http_redirect: Option<Spanned<String>>,
    pub redirect_port: Option<Spanned<i64>>,
    pub client_ca_file: Option<Spanned<String>>,
    pub client_auth: Option<Spanned<String>>,
    pub decision: Option<Spanned<String>>,
    pub envoy_rls: Option<Spanned<String>>,
}

/// `[[listen.tls]]`: one certificate the proxy listener may present.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    pub cert_file: Spanned<String>,
    pub key_file: Spanned<String>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawRules {
    pub path: Option<Spanned<String>>,
}

/// `[store] backend`: which store keeps the counters (read as it is:
/// validation has nothing to add).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    #[default]
    Memory,
    Redis,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawStore {
    pub backend: Option<Spanned<Backend>>,
    pub url: Option<Spanned<String>>,
    pub timeout: Option<Spanned<String>>,
    pub on_error: Option<OnError>,
    pub pool_size: Option<Spanned<i64>>,
    pub key_prefix: Option<String>,
    pub lease_percent: Option<Spanned<i64>>,
    pub lease_idle: Option<Spanned<String>>,
    pub lease_lifetime: Option<Spanned<String>>,
    pub tls_ca_file: Option<Spanned<String>>,
    pub tls_cert_file: Option<Spanned<String>>,
    pub tls_key_file: Option<Spanned<String>>,
    pub max_keys: Option<Spanned<i64>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawClient {
    pub jwt: Option<Spanned<RawJwt>>,
    pub trusted_proxies: Option<Vec<Spanned<String>>>,
    pub ipv6_prefix: Option<Spanned<i64>>,
    pub user_header: Option<Spanned<String>>,
    pub api_key_header: Option<Spanned<String>>,
    pub request_id_in_response: Option<bool>,
}

/// `[[upstream]]` as serde reads it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawUpstream {
    pub name: Spanned<String>,
    pub url: Option<Spanned<String>>,
    /// Each a URL string or a table `{ url, weight, backup }`, read by
    /// the validator (an untagged enum would lose the spans).
    pub servers: Option<Spanned<Vec<Spanned<toml::Value>>>>,
    pub balance: Option<Spanned<String>>,
    pub hash_key: Option<Spanned<String>>,
    pub health_check: Option<Spanned<RawHealthCheck>>,
    pub connect_timeout: Option<Spanned<String>>,
    pub timeout: Option<Spanned<String>>,
    pub eject_after: Option<Spanned<i64>>,
    pub max_ejected_percent: Option<Spanned<i64>>,
    pub retries: Option<Spanned<i64>>,
    pub retry_budget_percent: Option<Spanned<i64>>,
    pub pool_idle_timeout: Option<Spanned<String>>,
    pub h2_keepalive_interval: Option<Spanned<String>>,
    pub max_inflight: Option<Spanned<i64>>,
    pub try_timeout: Option<Spanned<String>>,
    pub protocol: Option<Spanned<String>>,
    pub tls_ca_file: Option<Spanned<String>>,
    pub tls_cert_file: Option<Spanned<String>>,
    pub tls_key_file: Option<Spanned<String>>,
    pub tls_server_name: Option<Spanned<String>>,
}

/// `health_check = { ... }`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHealthCheck {
    pub path: Option<Spanned<String>>,
    pub interval: Option<Spanned<String>>,
    pub timeout: Option<Spanned<String>>,
    pub healthy: Option<Spanned<i64>>,
    pub unhealthy: Option<Spanned<i64>>,
    pub host: Option<Spanned<String>>,
    pub expect_status: Option<Spanned<toml::Value>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRoute {
    pub name: Option<String>,
    pub path_prefix: Spanned<String>,
    pub host: Option<String>,
    pub upstream: Spanned<String>,
    pub max_body: Option<Spanned<RawSize>>,
    pub buffer_body: Option<Spanned<RawSize>>,
}

/// A size in bytes: a number, or a string such as "10MiB".
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum RawSize {
    Bytes(i64),
    Text(String),
}

/// A rules file: `[[rule]]` tables and nothing else.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRulesFile {
    #[serde(default)]
    pub rule: Vec<Spanned<RawRule>>,
    #[serde(default)]
    pub deny: Vec<Spanned<RawDeny>>,
    #[serde(default)]
    pub envoy: Vec<Spanned<RawEnvoy>>,
}

/// Who a `[[deny]]` entry or a rule's `exempt` names.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawClients {
    pub ips: Option<Vec<Spanned<String>>>,
    pub users: Option<Vec<String>>,
    pub api_keys: Option<Vec<String>>,
}

/// `[[envoy]]`: Envoy rate limit descriptors a rule decides (see
/// [`super::envoy`]).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawEnvoy {
    pub domain: Spanned<String>,
    pub rule: Spanned<String>,
    #[serde(rename = "match")]
    pub matcher: Option<Spanned<BTreeMap<String, String>>>,
    pub key: Option<Spanned<BTreeMap<String, String>>>,
    pub tier: Option<Spanned<String>>,
}

/// `[[deny]]`: clients answered 403 before any counting.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDeny {
    pub name: Spanned<String>,
    pub ips: Option<Vec<Spanned<String>>>,
    pub users: Option<Vec<String>>,
    pub api_keys: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRule {
    pub name: Spanned<String>,
    #[serde(rename = "match")]
    pub matcher: Option<Spanned<RawMatch>>,
    pub key: Option<Spanned<Vec<Spanned<String>>>>,
    pub algorithm: Option<crate::limiter::Algorithm>,
    pub limit: Spanned<i64>,
    /// Required, except by `algorithm = "concurrency"`, which has none.
    pub window: Option<Spanned<String>>,
    pub burst: Option<Spanned<i64>>,
    /// `algorithm = "concurrency"` only.
    pub slot_ttl: Option<Spanned<String>>,
    /// `"day"`, `"week"` or `"month"`: a quota per calendar window, instead
    /// of `window`.
    pub calendar: Option<Spanned<String>>,
    /// The IANA zone of `calendar`'s boundaries (default UTC).
    pub timezone: Option<Spanned<String>>,
    pub mode: Option<RuleMode>,
    pub throttle: Option<Spanned<String>>,
    pub soft_percent: Option<Spanned<i64>>,
    pub elastic_percent: Option<Spanned<i64>>,
    pub elastic_when_inflight_below: Option<Spanned<i64>>,
    pub cost: Option<Spanned<i64>>,
    pub cost_header: Option<Spanned<String>>,
    pub max_cost: Option<Spanned<i64>>,
    /// The response header (or trailer) carrying the real cost.
    pub cost_response_header: Option<Spanned<String>>,
    /// The response statuses the rule counts; the others are given back.
    pub count_status: Option<Spanned<Vec<Spanned<toml::Value>>>>,
    /// What the quota counts, for `RateLimit-Policy`'s `qu`.
    pub quota_unit: Option<Spanned<String>>,
    pub on_error: Option<OnError>,
    pub exempt: Option<Spanned<RawClients>>,
    pub on_invalid_token: Option<InvalidToken>,
    /// `[[rule.override]]`: limits of single keys.
    #[serde(rename = "override")]
    pub overrides: Option<Vec<Spanned<RawOverride>>>,
    /// `"header:NAME"` or `"claim:NAME"`: where a request's tier comes from.
    pub tier: Option<Spanned<String>>,
    /// Tier name to a limit (`pro = 1000`) or `{ limit, burst }`.
    pub tiers: Option<Spanned<std::collections::BTreeMap<String, Spanned<toml::Value>>>>,
    /// How long a key the rule refuses stays refused (`"15m"`).
    pub penalty: Option<Spanned<String>>,
    /// Refusals within one window before the penalty starts (default 1).
    pub penalty_after: Option<Spanned<i64>>,
}

/// `[[rule.override]]`: every key optional here, so that a missing one gets
/// a sentence of ours rather than serde's.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawOverride {
    pub key: Option<Spanned<String>>,
    pub limit: Option<Spanned<i64>>,
    pub burst: Option<Spanned<i64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMatch {
    pub methods: Option<Vec<Spanned<String>>>,
    pub path: Option<Spanned<String>>,
    pub host: Option<String>,
    pub route: Option<Spanned<String>>,
    pub header: Option<RawHeaderMatch>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHeaderMatch {
    pub name: Spanned<String>,
    pub value: String,
}

/// `[client] jwt = { ... }`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawJwt {
    pub header: Option<Spanned<String>>,
    pub algorithms: Option<Vec<Spanned<String>>>,
    pub key_file: Option<Spanned<String>>,
    pub jwks_file: Option<Spanned<String>>,
    pub issuer: Option<String>,
    pub audience: Option<String>,
    pub claim: Option<String>,
    pub leeway: Option<Spanned<String>>,
}
