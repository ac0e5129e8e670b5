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
mod rules_file;
mod spec;
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
    /// see [`crate::decision`]); none when not set.
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
        let listen = raw.listen.unwrap_or_default();
        let default_proxy = SocketAddr::from(([0, 0, 0, 0], 8080));
        let proxy = listen.proxy.as_ref().map_or(Some(default_proxy), |v| self.socket_addr(v, "listen.proxy"));
        let default_admin = SocketAddr::from(([127, 0, 0, 1], 9090));
        let admin = listen.admin.as_ref().map_or(Some(default_admin), |v| self.socket_addr(v, "listen.admin"));
        let max_connections = match &listen.max_connections {
            Some(n) if *n.get_ref() < 1 => {
                self.error(n.span(), "listen.max_connections must be at least 1");
                1
            }
            Some(n) => *n.get_ref() as usize,
            None => 10_000,
        };
        let max_header_bytes = match &listen.max_header_bytes {
            Some(n) if *n.get_ref() < 1024 => {
                self.error(n.span(), "listen.max_header_bytes must be at least 1024");
                1024
            }
            Some(n) => *n.get_ref() as usize,
            None => 64 * 1024,
        };
        let max_uri_bytes = match &listen.max_uri_bytes {
            Some(n) if !(256..=65_000).contains(n.get_ref()) => {
                self.error(n.span(), "listen.max_uri_bytes must be between 256 and 65000");
                16 * 1024
            }
            Some(n) => *n.get_ref() as usize,
            None => 16 * 1024,
        };
        let (tls, http_redirect, redirect_port) = self.listen_tls(&listen);
        let client_auth = self.client_auth(&listen);
        let decision = listen.decision.as_ref().and_then(|v| self.socket_addr(v, "listen.decision"));
        let envoy_rls = listen.envoy_rls.as_ref().and_then(|v| self.socket_addr(v, "listen.envoy_rls"));
        let (max_requests_per_connection, max_connection_age) = self.connection_lifetime(&listen);
        let shutdown_delay = self.shutdown_delay(&listen);
        let listen = Listen {
            shutdown_delay,
            max_requests_per_connection,
            max_connection_age,
            tls,
            http_redirect,
            redirect_port,
            client_auth,
            decision,
            envoy_rls,
            max_uri_bytes,
            proxy: proxy.unwrap_or(default_proxy),
            admin: admin.unwrap_or(default_admin),
            header_read_timeout: self.opt_duration(
                listen.header_read_timeout.as_ref(),
                "listen.header_read_timeout",
                Duration::from_secs(10),
            ),
            idle_timeout: self.opt_duration(
                listen.idle_timeout.as_ref(),
                "listen.idle_timeout",
                Duration::from_secs(60),
            ),
            max_connections,
            drain_timeout: self.opt_duration(
                listen.drain_timeout.as_ref(),
                "listen.drain_timeout",
                Duration::from_secs(30),
            ),
            max_header_bytes,
            normalization: Normalization {
                merge_slashes: listen.merge_slashes.unwrap_or(true),
                encoded_slashes: listen.encoded_slashes.unwrap_or_default(),
                underscores_in_headers: listen.underscores_in_headers.unwrap_or(false),
            },
            body_read_timeout: self.opt_duration(
                listen.body_read_timeout.as_ref(),
                "listen.body_read_timeout",
                Duration::from_secs(60),
            ),
            connection_body_buffer: match listen.connection_body_buffer.as_ref().map(|s| (s, parse_size(s.get_ref()))) {
                None => DEFAULT_CONNECTION_BODY_BUFFER,
                Some((_, Some(n))) if n <= MAX_BUFFER_BODY * 16 => n,
                Some((s, _)) => {
                    self.error(s.span(), "listen.connection_body_buffer must be a size from 0 to 1GiB: a whole number of bytes, or a string such as \"4MiB\"");
                    DEFAULT_CONNECTION_BODY_BUFFER
                }
            },
            send_timeout: self.opt_duration(
                listen.send_timeout.as_ref(),
                "listen.send_timeout",
                Duration::from_secs(60),
            ),
            tunnel_idle_timeout: self.opt_duration(
                listen.tunnel_idle_timeout.as_ref(),
                "listen.tunnel_idle_timeout",
                Duration::from_secs(3600),
            ),
        };

        let rules = raw.rules.unwrap_or_default();
        if let Some(p) = &rules.path
            && p.get_ref().trim().is_empty()
        {
            // An empty path would resolve to the config file's own directory.
            self.error(p.span(), "rules.path must name a rules file or directory");
        }
        let rules_path = PathBuf::from(rules.path.as_ref().map_or("rules", |p| p.get_ref().as_str()));
        let rules_path = if rules_path.is_absolute() {
            rules_path
        } else {
            self.file.parent().unwrap_or(Path::new(".")).join(rules_path)
        };

        let store = raw.store.unwrap_or_default();
        let backend = store.backend.as_ref().map_or(Backend::default(), |b| *b.get_ref());
        if let Some(b) = &store.backend
            && backend == Backend::Redis
            && store.url.is_none()
        {
            self.error(b.span(), "store.backend = \"redis\" needs store.url, e.g. \"redis://127.0.0.1:6379\" or \"redis-cluster://10.0.0.1:6379?node=10.0.0.2:6379\"");
        }
        let pool_size = match &store.pool_size {
            Some(n) if !(1..=64).contains(n.get_ref()) => {
                self.error(n.span(), "store.pool_size must be between 1 and 64");
                1
            }
            Some(n) => *n.get_ref() as usize,
            None => 1,
        };
        let max_keys = match &store.max_keys {
            Some(n) if !(1024..=1_000_000_000).contains(n.get_ref()) => {
                self.error(n.span(), "store.max_keys must be between 1024 and 1000000000");
                machine::default_max_keys()
            }
            Some(n) => *n.get_ref() as usize,
            None => machine::default_max_keys(),
        };
        let lease_percent = match &store.lease_percent {
            Some(n) if !(0..=25).contains(n.get_ref()) => {
                self.error(n.span(), "store.lease_percent must be between 0 (no leasing) and 25");
                0
            }
            Some(n) => *n.get_ref() as u8,
            None => 1,
        };
        let lease_lifetime =
            self.opt_duration(store.lease_lifetime.as_ref(), "store.lease_lifetime", Duration::from_secs(5));
        if let Some(v) = &store.lease_lifetime
            && !(Duration::from_millis(100)..=Duration::from_secs(3600)).contains(&lease_lifetime)
        {
            self.error(v.span(), "store.lease_lifetime must be between \"100ms\" and \"1h\"");
        }
        let tls_url = store.url.as_ref().is_some_and(|u| {
            let u = u.get_ref();
            u.starts_with("rediss") || u.starts_with("valkeys")
        });
        for key in [&store.tls_ca_file, &store.tls_cert_file, &store.tls_key_file].into_iter().flatten() {
            if !tls_url {
                self.error(
                    key.span(),
                    "TLS files need a TLS store.url (rediss://, rediss-cluster:// or rediss-sentinel://)",
                );
            }
        }
        let tls_ca = store.tls_ca_file.as_ref().filter(|_| tls_url).and_then(|f| {
            let (path, pem) = self.read_relative(f)?;
            if let Err(e) = pem::roots(&pem) {
                self.error(f.span(), format!("{}: {e}", path.display()));
                return None;
            }
            Some((path, pem))
        });
        let tls_client = match (&store.tls_cert_file, &store.tls_key_file) {
            (Some(c), Some(k)) if tls_url => {
                let cert = self.read_relative(c);
                let key = self.read_relative(k);
                match (cert, key) {
                    (Some((cert_path, cert)), Some((key_path, key))) => match pem::client_identity(&cert, &key) {
                        Ok(_) => Some(TlsClientFiles { cert_path, cert, key_path, key }),
                        Err(e) => {
                            self.error(c.span(), format!("{} and {}: {e}", cert_path.display(), key_path.display()));
                            None
                        }
                    },
                    _ => None,
                }
            }
            (Some(f), None) | (None, Some(f)) => {
                self.error(f.span(), "store.tls_cert_file and store.tls_key_file go together: give both or neither");
                None
            }
            _ => None,
        };
        let store = StoreConfig {
            backend,
            url: store.url.map(|u| u.into_inner()),
            timeout: self.opt_duration(store.timeout.as_ref(), "store.timeout", Duration::from_millis(20)),
            on_error: store.on_error.unwrap_or_default(),
            pool_size,
            key_prefix: store.key_prefix.unwrap_or_else(|| "tollgate:".to_string()),
            lease_percent,
            lease_idle: self.opt_duration(store.lease_idle.as_ref(), "store.lease_idle", Duration::from_secs(5)),
            lease_lifetime,
            tls_ca,
            tls_client,
            max_keys,
        };

        let client = raw.client.unwrap_or_default();
        let mut trusted = Vec::new();
        for p in client.trusted_proxies.iter().flatten() {
            match parse_net(p.get_ref()) {
                Some(n) => trusted.push(n),
                None => self.error(
                    p.span(),
                    format!(
                        "client.trusted_proxies entry {:?} is not an IP address or CIDR such as \"10.0.0.0/8\"",
                        p.get_ref()
                    ),
                ),
            }
        }
        let ipv6_prefix = match &client.ipv6_prefix {
            Some(n) if !(1..=128).contains(n.get_ref()) => {
                self.error(n.span(), "client.ipv6_prefix must be between 1 and 128");
                64
            }
            Some(n) => *n.get_ref() as u8,
            None => 64,
        };
        let user_header = client
            .user_header
            .as_ref()
            .map_or(Some(HeaderName::from_static("x-user-id")), |h| self.header_name(h, "client.user_header"));
        let api_key_header = client
            .api_key_header
            .as_ref()
            .map_or(Some(HeaderName::from_static("x-api-key")), |h| self.header_name(h, "client.api_key_header"));
        let jwt = client.jwt.as_ref().and_then(|j| self.jwt(j));
        let client = ClientConfig {
            jwt,
            trusted_proxies: trusted,
            ipv6_prefix,
            user_header: user_header.unwrap_or(HeaderName::from_static("x-user-id")),
            api_key_header: api_key_header.unwrap_or(HeaderName::from_static("x-api-key")),
            request_id_in_response: client.request_id_in_response.unwrap_or(true),
        };

        let mut upstreams: Vec<Upstream> = Vec::new();
        // Every name an [[upstream]] defines, valid or not: an upstream with
        // a bad URL has its own error, and a route naming it needs no second
        // one claiming it is undefined.
        let mut defined: Vec<String> = Vec::new();
        for u in raw.upstream {
            let name = &u.get_ref().name;
            if defined.contains(name.get_ref()) {
                self.error(name.span(), format!("upstream {:?} is defined twice", name.get_ref()));
                continue;
            }
            defined.push(name.get_ref().clone());
            if let Some(u) = self.upstream(u) {
                upstreams.push(u);
            }
        }

        let mut routes = Vec::new();
        for r in raw.route {
            let r = r.into_inner();
            let Some(upstream) = upstreams.iter().position(|u| u.name == *r.upstream.get_ref()) else {
                if !defined.contains(r.upstream.get_ref()) {
                    self.error(
                        r.upstream.span(),
                        format!("route names upstream {:?}, which no [[upstream]] defines", r.upstream.get_ref()),
                    );
                }
                continue;
            };
            let prefix = r.path_prefix.get_ref();
            if !prefix.starts_with('/') {
                self.error(r.path_prefix.span(), format!("route path_prefix {prefix:?} must start with '/'"));
                continue;
            }
            // Requests are routed by their canonical path, so prefixes are
            // written in that form too.
            let Some(prefix) = self.canonical_path(&r.path_prefix, "route path_prefix", &listen.normalization) else {
                continue;
            };
            let max_body = r.max_body.as_ref().and_then(|s| match parse_size(s.get_ref()) {
                Some(n) => Some(n),
                None => {
                    self.error(s.span(), "route max_body must be a size in bytes: a whole number, or a string such as \"512KiB\", \"10MB\"");
                    None
                }
            });
            let buffer_body = match r.buffer_body.as_ref().map(|s| (s, parse_size(s.get_ref()))) {
                None => DEFAULT_BUFFER_BODY,
                Some((_, Some(n))) if n <= MAX_BUFFER_BODY => n,
                Some((s, _)) => {
                    self.error(s.span(), "route buffer_body must be a size from 0 to 64MiB: a whole number of bytes, or a string such as \"256KiB\", \"1MiB\"");
                    DEFAULT_BUFFER_BODY
                }
            };
            routes.push(Route {
                max_body,
                buffer_body,
                name: r.name.unwrap_or_else(|| upstreams[upstream].name.clone()),
                path_prefix: prefix,
                host: r.host.map(|h| canonical_host(&h)),
                upstream,
            });
        }

        let log = self.log(raw.log);
        let admin = self.admin(raw.admin);
        Config { path: self.file.to_path_buf(), listen, rules_path, store, client, upstreams, routes, log, admin }
    }
}

impl Validator<'_> {
    /// `[client] jwt`: reads the key file (relative to the config file) and
    /// checks that it can verify at least one configured algorithm.
    fn jwt(&mut self, raw: &Spanned<raw::RawJwt>) -> Option<crate::wire::identity::JwtConfig> {
        use crate::wire::identity::{JwtConfig, JwtVerifier, KeySource};
        let j = raw.get_ref();
        let header = match &j.header {
            Some(h) => self.header_name(h, "client.jwt.header")?,
            None => HeaderName::from_static("authorization"),
        };
        let mut algorithms = Vec::new();
        match &j.algorithms {
            None => algorithms.push(jsonwebtoken::Algorithm::RS256),
            Some(list) => {
                for a in list {
                    match a.get_ref().parse::<jsonwebtoken::Algorithm>() {
                        Ok(alg) => algorithms.push(alg),
                        Err(_) => self.error(
                            a.span(),
                            format!(
                                "{:?} is not a JWT algorithm such as \"RS256\", \"ES256\" or \"HS256\"",
                                a.get_ref()
                            ),
                        ),
                    }
                }
            }
        }
        let keys = match (&j.key_file, &j.jwks_file) {
            (Some(k), None) => self.read_relative(k).map(|(path, bytes)| KeySource::Key { path, bytes }),
            (None, Some(k)) => self.read_relative(k).map(|(path, bytes)| KeySource::Jwks { path, bytes }),
            _ => {
                self.error(
                    raw.span(),
                    "client.jwt needs exactly one of key_file (a PEM public key or an HMAC secret) and jwks_file",
                );
                None
            }
        }?;
        let leeway = match &j.leeway {
            Some(l) => match parse_duration(l.get_ref()) {
                Ok(d) => d.as_secs(),
                Err(e) => {
                    self.error(l.span(), format!("client.jwt.leeway {:?} is not a duration ({e})", l.get_ref()));
                    0
                }
            },
            None => 30,
        };
        let config = JwtConfig {
            header,
            algorithms,
            keys,
            issuer: j.issuer.clone(),
            audience: j.audience.clone(),
            claim: j.claim.clone().unwrap_or_else(|| "sub".to_string()),
            leeway,
        };
        if let Err(e) = JwtVerifier::new(&config) {
            let span = j.key_file.as_ref().or(j.jwks_file.as_ref()).map_or(raw.span(), |s| s.span());
            self.error(span, format!("client.jwt: {e}"));
            return None;
        }
        Some(config)
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
