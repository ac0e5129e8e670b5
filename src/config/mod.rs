//! Reading and validating configuration: the only module that reads files.
//!
//! Two steps, as pingora and envoy's ratelimit do it: serde reads the TOML
//! into raw structs that reject unknown keys, then `validate` turns them into
//! typed values ([`Config`], [`RuleSpec`]) and collects every problem with
//! its file:line:column. Nothing downstream ever sees an unvalidated value.
//!
//! The main file (`tollgate.toml`) is read once at start-up; the rules path
//! (one file or a directory of `*.toml`) is read at start-up and again on
//! every reload.

mod admin;
mod client;
pub(crate) mod der;
mod envoy;
mod error;
pub mod key;
mod listen;
mod log;
mod machine;
mod overrides;
pub mod pem;
mod raw;
mod routes;
mod rules_file;
mod spec;
mod store;
mod tls;
mod upstream;
mod upstream_tls;
pub mod watch;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::HeaderName;
use ipnet::IpNet;
use serde::Deserialize;
use toml::Spanned;

pub use crate::wire::normalize::{EncodedSlashes, Normalization};

pub use admin::{AdminConfig, MAX_TOP_KEYS};
pub use envoy::EnvoyMapping;
pub use error::{ConfigError, ConfigErrors, line_col};
pub use log::{AccessLogTarget, LogConfig};
pub use pem::{Certificate, ClientAuth};
pub use rules_file::{
    LoadedRules, RulesFile, load_rules, parse_rules, parse_rules_file, rule_files, rule_files_or_empty,
};
pub use spec::{
    CalendarSpec, ClientSet, Cost, DenySpec, InvalidToken, KeyPart, MatchSpec, OverrideSpec, PathPattern, RuleMode,
    RuleSpec, Throttle, TierSource, TiersSpec,
};
pub use upstream::{
    Balance, HashKey, HealthCheck, MIN_RETRY_CONCURRENCY, POOL_IDLE_TIMEOUT, Protocol, Server, Upstream, UpstreamTls,
};

/// What a check does when the store cannot answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OnError {
    /// Fail open: forward the request as if the rule allowed it.
    #[default]
    Allow,
    /// Fail closed: answer 503 with Retry-After.
    Deny,
    /// Count in this process's memory with the same rules until the store
    /// is back.
    Local,
}

/// Which store keeps the counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    #[default]
    Memory,
    Redis,
}

/// The validated main configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The file it was read from.
    pub path: PathBuf,
    pub listen: Listen,
    /// The rules file or directory, resolved against the config file's
    /// directory.
    pub rules_path: PathBuf,
    pub store: StoreConfig,
    pub client: ClientConfig,
    pub upstreams: Vec<Upstream>,
    pub routes: Vec<Route>,
    /// `[log]`: the access log.
    pub log: LogConfig,
    /// `[admin]`: the heavy-hitter sketches behind `/top`.
    pub admin: AdminConfig,
}

/// `[listen]`
#[derive(Debug, Clone)]
pub struct Listen {
    pub proxy: SocketAddr,
    pub admin: SocketAddr,
    /// How long a client may take to send its request headers.
    pub header_read_timeout: Duration,
    /// How long an idle keep-alive connection stays open.
    pub idle_timeout: Duration,
    /// Connections served at once; further ones wait in the kernel backlog.
    pub max_connections: usize,
    /// How long shutdown waits for in-flight requests.
    pub drain_timeout: Duration,
    /// Largest request header section accepted (431 above it).
    pub max_header_bytes: usize,
    /// Longest request target (path and query) accepted (414 above it).
    pub max_uri_bytes: usize,
    /// Path, header-name and host normalisation.
    pub normalization: Normalization,
    /// Longest wait for the next piece of a request body (408 after it).
    pub body_read_timeout: Duration,
    /// The most request body bytes one client connection's requests hold
    /// read ahead together (`buffer_body` is per request; an HTTP/2
    /// connection carries many).
    pub connection_body_buffer: u64,
    /// A client that takes none of the response's bytes for this long is
    /// disconnected.
    pub send_timeout: Duration,
    /// A WebSocket (or other upgraded) tunnel that moves no byte for this
    /// long is closed.
    pub tunnel_idle_timeout: Duration,
    /// Requests one client connection may carry; its last is answered with
    /// `Connection: close` (HTTP/1.1) or followed by a GOAWAY (HTTP/2).
    pub max_requests_per_connection: usize,
    /// How long one client connection may live before it is closed the
    /// same graceful way; none when not set.
    pub max_connection_age: Option<Duration>,
    /// On SIGTERM, how long the listeners keep serving (with `/readyz`
    /// answering 503) before they stop accepting and drain.
    pub shutdown_delay: Duration,
    /// `[[listen.tls]]`, read and checked: when not empty the proxy
    /// listener speaks TLS only, and the first is the default certificate.
    pub tls: Vec<Certificate>,
    /// A plain-HTTP listener answering 308 to the `https://` URL.
    pub http_redirect: Option<SocketAddr>,
    /// The public HTTPS port the redirects name (left out when 443): the
    /// proxy listener's own port is often not the one clients reach, behind
    /// a load balancer or a port mapping.
    pub redirect_port: u16,
    /// `client_ca_file` and `client_auth`: client certificates asked for
    /// in the TLS handshake; none when `client_ca_file` is not set.
    pub client_auth: Option<ClientAuth>,
    /// `[listen] decision`: the decision API's listener (`POST /v1/check`,
    /// see [`crate::api::decision`]); none when not set.
    pub decision: Option<SocketAddr>,
    /// `[listen] envoy_rls`: Envoy's rate limit service over gRPC; none
    /// when not set.
    pub envoy_rls: Option<SocketAddr>,
}

/// `[store]`
#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub backend: Backend,
    pub url: Option<String>,
    pub timeout: Duration,
    pub on_error: OnError,
    pub pool_size: usize,
    pub key_prefix: String,
    /// Share of a key's capacity, in percent, that one instance may take
    /// ahead in a round trip and spend locally (0: every check asks Redis).
    pub lease_percent: u8,
    /// How long leased quota nobody here uses is kept before it is given
    /// back to Redis.
    pub lease_idle: Duration,
    /// How long a token-bucket lease lives: between this and twice this,
    /// which bounds what a crashed instance's leases hold back.
    pub lease_lifetime: Duration,
    /// CA certificates (PEM) trusted for a `rediss://` store instead of the
    /// system's roots: the file and its contents.
    pub tls_ca: Option<(PathBuf, Vec<u8>)>,
    /// A client certificate chain and its private key (PEM), for a Redis
    /// that asks for one (`tls-auth-clients yes`).
    pub tls_client: Option<TlsClientFiles>,
    /// The most keys the memory store (or the Redis store's local state)
    /// tracks; beyond it, the keys nearest to their full quota are forgotten.
    pub max_keys: usize,
}

/// `[store] tls_cert_file` and `tls_key_file`, read.
#[derive(Debug, Clone)]
pub struct TlsClientFiles {
    pub cert_path: PathBuf,
    pub cert: Vec<u8>,
    pub key_path: PathBuf,
    pub key: Vec<u8>,
}

/// `[client]`: how the client behind a request is identified.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Verified identity: when set, `user` keys come from a checked JWT and
    /// the user header is ignored.
    pub jwt: Option<crate::wire::identity::JwtConfig>,
    pub trusted_proxies: Vec<IpNet>,
    pub ipv6_prefix: u8,
    pub user_header: HeaderName,
    pub api_key_header: HeaderName,
    /// Responses relayed from upstreams carry the request's `X-Request-Id`
    /// (Envoy's `always_set_request_id_in_response`), so that a client
    /// can quote the id the access log and the upstream saw.
    pub request_id_in_response: bool,
}

/// `[[route]]`
#[derive(Debug, Clone)]
pub struct Route {
    /// Label in metrics: the `name` key, or the upstream's name.
    pub name: String,
    pub path_prefix: String,
    pub host: Option<String>,
    /// Index into [`Config::upstreams`].
    pub upstream: usize,
    /// Largest request body forwarded (413 above it); `None`: unlimited.
    pub max_body: Option<u64>,
    /// Bodies up to this size are read whole before the upstream is
    /// contacted; larger ones stream (0: every body streams).
    pub buffer_body: u64,
}

/// A configured host, written as requests' hosts are compared
/// ([`crate::wire::normalize::canonical_host`]).
pub fn canonical_host(host: &str) -> String {
    crate::wire::normalize::canonical_host(host.trim())
}

impl Config {
    /// Reads and validates the main file.
    pub fn load(path: &Path) -> Result<Config, ConfigErrors> {
        let source = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::file(path, format!("cannot read the config file: {e}")))?;
        Config::parse(path, &source)
    }

    /// Validates the text of a main file; `path` names it in errors and
    /// anchors a relative rules path.
    pub fn parse(path: &Path, source: &str) -> Result<Config, ConfigErrors> {
        let raw: raw::RawConfig = toml::from_str(source).map_err(|e| ConfigError::from_toml(path, source, &e))?;
        let mut v = Validator { file: path, source, errors: Vec::new() };
        let config = v.config(raw);
        v.finish(config)
    }

    /// The upstream a rule's `match.route` names, by name.
    pub fn upstream_index(&self, name: &str) -> Option<usize> {
        self.upstreams.iter().position(|u| u.name == name)
    }
}

/// Collects errors while validating one file.
pub(crate) struct Validator<'a> {
    pub file: &'a Path,
    pub source: &'a str,
    pub errors: Vec<ConfigError>,
}

impl Validator<'_> {
    /// `value` if no problem was recorded, else every problem in file order
    /// (validation visits keys in its own order, not the file's).
    pub fn finish<T>(mut self, value: T) -> Result<T, ConfigErrors> {
        if self.errors.is_empty() {
            Ok(value)
        } else {
            self.errors.sort_by_key(|e| (e.line, e.column));
            Err(ConfigErrors(self.errors))
        }
    }

    pub fn error(&mut self, span: std::ops::Range<usize>, message: impl Into<String>) {
        self.errors.push(ConfigError::at(self.file, self.source, Some(span), message));
    }

    /// A duration such as "250ms", "1s", "90s", "5m", "1h", "1d".
    pub fn duration(&mut self, value: &Spanned<String>, what: &str) -> Option<Duration> {
        match parse_duration(value.get_ref()) {
            Ok(d) if !d.is_zero() => Some(d),
            Ok(_) => {
                self.error(value.span(), format!("{what} must be longer than zero"));
                None
            }
            Err(e) => {
                self.error(
                    value.span(),
                    format!(
                        "{what} {:?} is not a duration ({e}); write e.g. \"250ms\", \"1s\", \"5m\", \"1h\", \"1d\"",
                        value.get_ref()
                    ),
                );
                None
            }
        }
    }

    /// Reads a file named in the config, relative to the config file's
    /// directory unless absolute.
    fn read_relative(&mut self, p: &Spanned<String>) -> Option<(PathBuf, Vec<u8>)> {
        let path = PathBuf::from(p.get_ref());
        let path = if path.is_absolute() { path } else { self.file.parent().unwrap_or(Path::new(".")).join(path) };
        match std::fs::read(&path) {
            Ok(bytes) => Some((path, bytes)),
            Err(e) => {
                self.error(p.span(), format!("cannot read {}: {e}", path.display()));
                None
            }
        }
    }

    /// A configured path in the canonical form requests are matched in
    /// (see [`crate::wire::normalize::path`]).
    pub fn canonical_path(&mut self, value: &Spanned<String>, what: &str, n: &Normalization) -> Option<String> {
        match crate::wire::normalize::path(value.get_ref(), n) {
            Ok(p) => Some(p.into_owned()),
            Err(e) => {
                self.error(value.span(), format!("{what} {:?}: {}", value.get_ref(), e.reason()));
                None
            }
        }
    }

    fn opt_duration(&mut self, value: Option<&Spanned<String>>, what: &str, default: Duration) -> Duration {
        value.and_then(|v| self.duration(v, what)).unwrap_or(default)
    }

    pub fn header_name(&mut self, value: &Spanned<String>, what: &str) -> Option<HeaderName> {
        match HeaderName::from_bytes(value.get_ref().trim().as_bytes()) {
            Ok(h) => Some(h),
            Err(_) => {
                self.error(value.span(), format!("{what} {:?} is not a valid HTTP header name", value.get_ref()));
                None
            }
        }
    }

    fn socket_addr(&mut self, value: &Spanned<String>, what: &str) -> Option<SocketAddr> {
        match value.get_ref().parse() {
            Ok(a) => Some(a),
            Err(_) => {
                self.error(
                    value.span(),
                    format!(
                        "{what} {:?} is not an address such as \"0.0.0.0:8080\" or \"[::1]:8080\"",
                        value.get_ref()
                    ),
                );
                None
            }
        }
    }

    /// Validates the main file. A value with an error gets a placeholder so
    /// that validation goes on and reports every problem; the caller discards
    /// the result when any error was recorded.
    fn config(&mut self, raw: raw::RawConfig) -> Config {
        let listen = self.listen(&raw.listen.unwrap_or_default());
        let rules_path = self.rules_path(raw.rules.unwrap_or_default());
        let store = self.store(raw.store.unwrap_or_default());
        let client = self.client(raw.client.unwrap_or_default());
        let (upstreams, routes) = self.upstreams_and_routes(raw.upstream, raw.route, &listen.normalization);
        let log = self.log(raw.log);
        let admin = self.admin(raw.admin);
        Config { path: self.file.to_path_buf(), listen, rules_path, store, client, upstreams, routes, log, admin }
    }

    /// `[rules] path`, relative to the config file's directory unless absolute.
    fn rules_path(&mut self, rules: raw::RawRules) -> PathBuf {
        if let Some(p) = &rules.path
            && p.get_ref().trim().is_empty()
        {
            // An empty path would resolve to the config file's own directory.
            self.error(p.span(), "rules.path must name a rules file or directory");
        }
        let rules_path = PathBuf::from(rules.path.as_ref().map_or("rules", |p| p.get_ref().as_str()));
        if rules_path.is_absolute() {
            rules_path
        } else {
            self.file.parent().unwrap_or(Path::new(".")).join(rules_path)
        }
    }
}

/// `buffer_body` when a route does not set it.
const DEFAULT_BUFFER_BODY: u64 = 1024 * 1024;
/// `connection_body_buffer` when not set: four requests' default
/// `buffer_body` at once.
const DEFAULT_CONNECTION_BODY_BUFFER: u64 = 4 * 1024 * 1024;
/// The largest `buffer_body`: each request in flight may hold this much.
const MAX_BUFFER_BODY: u64 = 64 * 1024 * 1024;

/// Parses "250ms", "1s", "90s", "5m", "1h", "1d" and combinations such as
/// "1h30m".
pub fn parse_duration(s: &str) -> Result<Duration, humantime::DurationError> {
    humantime::parse_duration(s.trim())
}

/// A size: bytes as a number, or a string with a unit (B, KB, KiB, MB, MiB,
/// GB, GiB; decimal units are powers of 1000, binary ones of 1024).
fn parse_size(raw: &raw::RawSize) -> Option<u64> {
    match raw {
        raw::RawSize::Bytes(n) => u64::try_from(*n).ok(),
        raw::RawSize::Text(s) => {
            let s = s.trim();
            let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
            let (digits, unit) = s.split_at(split);
            let n: u64 = digits.parse().ok()?;
            let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
                "" | "b" => 1,
                "kb" => 1000,
                "kib" | "k" => 1024,
                "mb" => 1000 * 1000,
                "mib" | "m" => 1024 * 1024,
                "gb" => 1000 * 1000 * 1000,
                "gib" | "g" => 1024 * 1024 * 1024,
                _ => return None,
            };
            n.checked_mul(scale)
        }
    }
}

/// An address or a CIDR; a bare address is a /32 or /128. An IPv4-mapped
/// network (`::ffff:10.0.0.0/104`) is the IPv4 one it stands for, as the
/// clients it is compared with are ([`crate::wire::client::canonical`]).
pub fn parse_net(s: &str) -> Option<IpNet> {
    let s = s.trim();
    let net = s.parse::<IpNet>().ok().or_else(|| s.parse::<std::net::IpAddr>().ok().map(IpNet::from))?;
    if let IpNet::V6(v6) = net
        && let Some(v4) = v6.addr().to_ipv4_mapped()
        && v6.prefix_len() >= 96
    {
        return ipnet::Ipv4Net::new(v4, v6.prefix_len() - 96).ok().map(IpNet::V4);
    }
    Some(net)
}

#[cfg(test)]
mod tests;
