//! `[[upstream]]` tables: one `url` or several `servers`, how requests are
//! balanced over them, and their health check.

use std::time::Duration;

use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderName, HeaderValue};
use toml::Spanned;

use super::raw::{RawHealthCheck, RawUpstream};
use super::upstream_tls::{Protocol, UpstreamTls};
use super::validate::Validator;

/// `[[upstream]]`
#[derive(Debug, Clone)]
pub struct Upstream {
    pub name: String,
    /// At least one; a `url` is one server.
    pub servers: Vec<Server>,
    /// A path prefix from the URL (`http://h/base` -> `/base`), without the
    /// trailing slash; empty for none. The same for every server.
    pub base_path: String,
    pub connect_timeout: Duration,
    pub timeout: Duration,
    pub balance: Balance,
    pub health_check: Option<HealthCheck>,
    pub protocol: Protocol,
    /// For `https://` servers.
    pub tls: Option<UpstreamTls>,
    /// Failures in a row that take a server out (passive health).
    pub eject_after: u32,
    /// The most of an upstream's servers passive health takes out at once.
    pub max_ejected_percent: u8,
    /// Further tries on other servers after a failed one.
    pub retries: u32,
    /// Retries in flight never exceed this share of requests in flight
    /// (with a floor of [`MIN_RETRY_CONCURRENCY`]).
    pub retry_budget_percent: u8,
    /// How long a pooled keep-alive connection may sit unused.
    pub pool_idle_timeout: Duration,
    /// HTTP/2 upstream connections are PINGed this often.
    pub h2_keepalive_interval: Duration,
    /// Requests in flight per server past which it takes no more.
    pub max_inflight: Option<u64>,
    /// The most one try of a request that may be sent again waits for its
    /// answer before the next server is tried (Envoy's `per_try_timeout`);
    /// every try still shares `timeout`.
    pub try_timeout: Option<Duration>,
}

/// Retries an upstream may always have in flight, whatever its budget
/// (Envoy's `min_retry_concurrency`): a quiet upstream can still retry.
pub const MIN_RETRY_CONCURRENCY: u64 = 3;

/// The default `pool_idle_timeout`: below the 5 s keep-alive of Node.js,
/// Apache httpd and uvicorn, so that tollgate, not the server, closes an
/// idle connection, and never sends a request on one the server is
/// closing at that moment.
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(4);

/// One server of an upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Server {
    /// As configured: the `server` label of its metrics.
    pub address: String,
    pub scheme: Scheme,
    pub authority: Authority,
    /// Its share of requests against the others' (`round_robin`,
    /// `least_request`, `hash`); 1 unless configured.
    pub weight: u32,
    /// Takes requests only while every other server is out.
    pub backup: bool,
}

impl Upstream {
    /// Whether a server of `self` and the same server of `other` would be
    /// reached the same way (its connections, health checks and timeouts):
    /// a reload keeps such a server's health and connection pool.
    pub fn same_server(&self, other: &Upstream, address: &str) -> bool {
        fn find<'u>(u: &'u Upstream, address: &str) -> Option<(&'u Scheme, &'u Authority)> {
            u.servers.iter().find(|s| s.address == address).map(|s| (&s.scheme, &s.authority))
        }
        find(self, address).is_some()
            && find(self, address) == find(other, address)
            && self.connect_timeout == other.connect_timeout
            && self.timeout == other.timeout
            && self.health_check == other.health_check
            && self.protocol == other.protocol
            && self.tls.as_ref().map(|t| t.fingerprint) == other.tls.as_ref().map(|t| t.fingerprint)
            && self.pool_idle_timeout == other.pool_idle_timeout
            && self.h2_keepalive_interval == other.h2_keepalive_interval
    }
}

/// `balance`: how a request picks one of an upstream's servers.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Balance {
    /// Each server in turn.
    #[default]
    RoundRobin,
    /// The less busy of two servers picked at random (fewer requests in
    /// flight).
    LeastRequest,
    /// The same server for the same key, for as long as it is up.
    Hash(HashKey),
}

/// `hash_key`: what `balance = "hash"` hashes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HashKey {
    /// The client's address (after trusted proxies).
    Ip,
    /// A request header's value; a missing header hashes as empty.
    Header(HeaderName),
}

/// `health_check`: a GET to each server every `interval`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheck {
    pub path: PathAndQuery,
    pub interval: Duration,
    pub timeout: Duration,
    /// Good checks in a row that bring a server back.
    pub healthy: u32,
    /// Failed checks in a row that take a server out.
    pub unhealthy: u32,
    /// The `Host` sent; the server's own authority when `None`.
    pub host: Option<HeaderValue>,
    /// Statuses that count as passing, as inclusive ranges.
    pub expect_status: Vec<(u16, u16)>,
}

impl HealthCheck {
    /// Whether a check answered `status` passes.
    pub fn passes(&self, status: u16) -> bool {
        self.expect_status.iter().any(|(lo, hi)| (*lo..=*hi).contains(&status))
    }
}

const URL_EXAMPLE: &str = "such as \"http://127.0.0.1:9001\"";

impl Validator<'_> {
    /// One `[[upstream]]` table; `None` (with errors recorded) when it is
    /// unusable.
    pub(super) fn upstream(&mut self, raw: Spanned<RawUpstream>) -> Option<Upstream> {
        let table = raw.span();
        let u = raw.into_inner();
        let connect_timeout =
            self.opt_duration(u.connect_timeout.as_ref(), "upstream.connect_timeout", Duration::from_secs(1));
        let timeout = self.opt_duration(u.timeout.as_ref(), "upstream.timeout", Duration::from_secs(30));
        let entries = self.server_entries(&u, table)?;
        let (servers, base_path) = self.servers(&entries)?;
        let https = servers[0].scheme == Scheme::HTTPS;
        let protocol = self.protocol(&u)?;
        let tls = self.upstream_tls(&u, https, protocol)?;
        let balance = self.balance(&u)?;
        let health_check = match &u.health_check {
            Some(h) => Some(self.health_check(h)?),
            None => None,
        };
        let before = self.errors.len();
        let eject_after = self.ranged(u.eject_after.as_ref(), "upstream.eject_after", 1..=1000, 5) as u32;
        let max_ejected_percent =
            self.ranged(u.max_ejected_percent.as_ref(), "upstream.max_ejected_percent", 0..=100, 50) as u8;
        let retries = self.ranged(u.retries.as_ref(), "upstream.retries", 0..=10, 1) as u32;
        let retry_budget_percent =
            self.ranged(u.retry_budget_percent.as_ref(), "upstream.retry_budget_percent", 0..=100, 20) as u8;
        let max_inflight = u
            .max_inflight
            .as_ref()
            .map(|_| self.ranged(u.max_inflight.as_ref(), "upstream.max_inflight", 1..=1_000_000, 1) as u64);
        let pool_idle_timeout =
            self.opt_duration(u.pool_idle_timeout.as_ref(), "upstream.pool_idle_timeout", POOL_IDLE_TIMEOUT);
        let h2_keepalive_interval = self.opt_duration(
            u.h2_keepalive_interval.as_ref(),
            "upstream.h2_keepalive_interval",
            Duration::from_secs(30),
        );
        let try_timeout = u.try_timeout.as_ref().and_then(|t| self.duration(t, "upstream.try_timeout"));
        if let Some(t) = &u.try_timeout
            && try_timeout.is_some_and(|d| d >= timeout)
        {
            self.error(t.span(), "upstream.try_timeout must be shorter than upstream.timeout");
        }
        if self.errors.len() > before {
            return None;
        }
        Some(Upstream {
            name: u.name.into_inner(),
            servers,
            base_path,
            connect_timeout,
            timeout,
            balance,
            health_check,
            protocol,
            tls,
            eject_after,
            max_ejected_percent,
            retries,
            retry_budget_percent,
            pool_idle_timeout,
            h2_keepalive_interval,
            max_inflight,
            try_timeout,
        })
    }

    /// `url`, or the `servers` entries (with their weights and backup
    /// flags): exactly one of the two.
    fn server_entries(
        &mut self,
        u: &RawUpstream,
        table: std::ops::Range<usize>,
    ) -> Option<Vec<(Spanned<String>, u32, bool)>> {
        let entries = match (&u.url, &u.servers) {
            (Some(url), None) => vec![(url.clone(), 1, false)],
            (None, Some(servers)) if servers.get_ref().is_empty() => {
                self.error(servers.span(), "upstream servers must list at least one URL");
                return None;
            }
            (None, Some(servers)) => {
                let mut out = Vec::new();
                for entry in servers.get_ref() {
                    out.push(self.server_entry(entry)?);
                }
                out
            }
            (Some(_), Some(servers)) => {
                self.error(servers.span(), "an upstream has either url or servers, not both");
                return None;
            }
            (None, None) => {
                self.error(
                    table,
                    format!("upstream {:?} needs url = \"...\" or servers = [\"...\", ...]", u.name.get_ref()),
                );
                return None;
            }
        };
        Some(entries)
    }

    /// The servers of `entries`, and the path after their address, which
    /// they share, as they share their scheme; one at least is not a backup.
    fn servers(&mut self, entries: &[(Spanned<String>, u32, bool)]) -> Option<(Vec<Server>, String)> {
        let mut servers: Vec<Server> = Vec::new();
        let mut base_path: Option<String> = None;
        for (url, weight, backup) in entries {
            let (mut server, path) = self.server_url(url)?;
            if servers.iter().any(|s| s.scheme == server.scheme && s.authority == server.authority) {
                self.error(url.span(), format!("upstream server {:?} is listed twice", url.get_ref()));
                return None;
            }
            match &base_path {
                Some(p) if *p != path => {
                    self.error(url.span(), "every server of an upstream must have the same path after its address");
                    return None;
                }
                _ => base_path = Some(path),
            }
            (server.weight, server.backup) = (*weight, *backup);
            servers.push(server);
        }
        if servers.iter().all(|s| s.backup) {
            // Entries exist: the error points at the first.
            self.error(entries[0].0.span(), "an upstream needs at least one server that is not a backup");
            return None;
        }
        let https = servers[0].scheme == Scheme::HTTPS;
        if let Some((_, (url, _, _))) = servers.iter().zip(entries).find(|(s, _)| (s.scheme == Scheme::HTTPS) != https)
        {
            self.error(url.span(), "every server of an upstream must use the same scheme");
            return None;
        }
        Some((servers, base_path.unwrap_or_default()))
    }

    /// An integer setting within `range`, `default` when absent (and, with
    /// an error recorded, when out of range).
    fn ranged(
        &mut self,
        v: Option<&Spanned<i64>>,
        what: &str,
        range: std::ops::RangeInclusive<i64>,
        default: i64,
    ) -> i64 {
        match v {
            Some(n) if !range.contains(n.get_ref()) => {
                self.error(n.span(), format!("{what} must be between {} and {}", range.start(), range.end()));
                default
            }
            Some(n) => *n.get_ref(),
            None => default,
        }
    }

    /// One entry of `servers`: `"http://..."` or `{ url = "http://...",
    /// weight = N, backup = true }`.
    fn server_entry(&mut self, entry: &Spanned<toml::Value>) -> Option<(Spanned<String>, u32, bool)> {
        const SHAPE: &str =
            "an upstream server is \"http://host:port\" or { url = \"http://host:port\", weight = 2, backup = true }";
        let span = entry.span();
        let table = match entry.get_ref() {
            toml::Value::String(url) => return Some((Spanned::new(span, url.clone()), 1, false)),
            toml::Value::Table(t) => t,
            _ => {
                self.error(span, SHAPE);
                return None;
            }
        };
        if let Some(k) = table.keys().find(|k| !["url", "weight", "backup"].contains(&k.as_str())) {
            self.error(span, format!("unknown key {k:?} in an upstream server: {SHAPE}"));
            return None;
        }
        let Some(toml::Value::String(url)) = table.get("url") else {
            self.error(span, SHAPE);
            return None;
        };
        let weight = match table.get("weight") {
            None => 1,
            Some(toml::Value::Integer(w)) if (1..=1000).contains(w) => *w as u32,
            Some(_) => {
                self.error(span, "an upstream server's weight must be a whole number between 1 and 1000");
                return None;
            }
        };
        let backup = match table.get("backup") {
            None => false,
            Some(toml::Value::Boolean(b)) => *b,
            Some(_) => {
                self.error(span, "an upstream server's backup must be true or false");
                return None;
            }
        };
        Some((Spanned::new(span, url.clone()), weight, backup))
    }

    /// A server URL and the path after its address.
    fn server_url(&mut self, url: &Spanned<String>) -> Option<(Server, String)> {
        let Ok(uri) = url.get_ref().parse::<http::Uri>() else {
            self.error(url.span(), format!("upstream url {:?} is not a URL {URL_EXAMPLE}", url.get_ref()));
            return None;
        };
        let (Some(scheme), Some(authority)) = (uri.scheme().cloned(), uri.authority().cloned()) else {
            self.error(
                url.span(),
                format!("upstream url {:?} needs a scheme and a host, {URL_EXAMPLE}", url.get_ref()),
            );
            return None;
        };
        if scheme != Scheme::HTTP && scheme != Scheme::HTTPS {
            self.error(url.span(), "upstream servers are http:// or https://");
            return None;
        }
        let path = uri.path().trim_end_matches('/').to_string();
        Some((Server { address: url.get_ref().clone(), scheme, authority, weight: 1, backup: false }, path))
    }

    fn balance(&mut self, u: &RawUpstream) -> Option<Balance> {
        let name = u.balance.as_ref().map_or("round_robin", |b| b.get_ref().as_str());
        let balance = match name {
            "round_robin" => Balance::RoundRobin,
            "least_request" => Balance::LeastRequest,
            "hash" => {
                let Some(key) = &u.hash_key else {
                    // Present: the name came from it.
                    let span = u.balance.as_ref().map_or(0..0, Spanned::span);
                    self.error(span, "balance = \"hash\" needs hash_key = \"ip\" or \"header:NAME\"");
                    return None;
                };
                let k = key.get_ref();
                if k == "ip" {
                    Balance::Hash(HashKey::Ip)
                } else if let Some(h) = k.strip_prefix("header:") {
                    let h = Spanned::new(key.span(), h.to_string());
                    Balance::Hash(HashKey::Header(self.header_name(&h, "upstream hash_key header")?))
                } else {
                    self.error(key.span(), format!("hash_key {k:?} must be \"ip\" or \"header:NAME\""));
                    return None;
                }
            }
            other => {
                let span = u.balance.as_ref().map_or(0..0, Spanned::span);
                self.error(span, format!("balance {other:?} must be \"round_robin\", \"least_request\" or \"hash\""));
                return None;
            }
        };
        if let Some(key) = &u.hash_key
            && !matches!(balance, Balance::Hash(_))
        {
            self.error(key.span(), "hash_key only applies with balance = \"hash\"");
            return None;
        }
        Some(balance)
    }

    fn health_check(&mut self, raw: &Spanned<RawHealthCheck>) -> Option<HealthCheck> {
        let h = raw.get_ref();
        let before = self.errors.len();
        let path = match &h.path {
            Some(p) if p.get_ref().starts_with('/') => match PathAndQuery::try_from(p.get_ref().as_str()) {
                Ok(pq) => Some(pq),
                Err(_) => {
                    self.error(p.span(), format!("health_check path {:?} is not a valid path", p.get_ref()));
                    None
                }
            },
            Some(p) => {
                self.error(p.span(), format!("health_check path {:?} must start with '/'", p.get_ref()));
                None
            }
            None => {
                self.error(raw.span(), "health_check needs a path, such as path = \"/healthz\"");
                None
            }
        };
        let interval = self.opt_duration(h.interval.as_ref(), "health_check.interval", Duration::from_secs(2));
        let timeout = self.opt_duration(h.timeout.as_ref(), "health_check.timeout", Duration::from_secs(1));
        if let Some(t) = &h.timeout
            && timeout > interval
        {
            self.error(t.span(), "health_check.timeout must not be longer than health_check.interval");
        }
        let mut count = |v: &Option<Spanned<i64>>, what: &str, default: u32| match v {
            Some(n) if !(1..=100).contains(n.get_ref()) => {
                self.error(n.span(), format!("health_check.{what} must be between 1 and 100"));
                default
            }
            Some(n) => *n.get_ref() as u32,
            None => default,
        };
        let healthy = count(&h.healthy, "healthy", 2);
        let unhealthy = count(&h.unhealthy, "unhealthy", 3);
        let host = h.host.as_ref().and_then(|v| match HeaderValue::from_str(v.get_ref()) {
            Ok(host) if !v.get_ref().is_empty() && v.get_ref().parse::<Authority>().is_ok() => Some(host),
            _ => {
                self.error(v.span(), format!("health_check.host {:?} is not a host name", v.get_ref()));
                None
            }
        });
        let expect_status = match &h.expect_status {
            Some(v) => self.statuses(v).unwrap_or_default(),
            None => vec![(200, 399)],
        };
        if self.errors.len() > before {
            return None;
        }
        Some(HealthCheck { path: path?, interval, timeout, healthy, unhealthy, host, expect_status })
    }

    /// `expect_status`: a status (`200`), a class (`"2xx"`), a range
    /// (`"200-299"`), or a list of those.
    fn statuses(&mut self, v: &Spanned<toml::Value>) -> Option<Vec<(u16, u16)>> {
        const SHAPE: &str =
            "health_check.expect_status is a status (200), a class (\"2xx\"), a range (\"200-299\") or a list of those";
        let one = |item: &toml::Value| -> Option<(u16, u16)> {
            let (lo, hi) = match item {
                toml::Value::Integer(n) => (*n, *n),
                toml::Value::String(t) => {
                    let t = t.trim();
                    if let Some(class) = t.strip_suffix("xx").and_then(|c| c.parse::<i64>().ok()) {
                        (class * 100, class * 100 + 99)
                    } else if let Some((a, b)) = t.split_once('-') {
                        (a.trim().parse().ok()?, b.trim().parse().ok()?)
                    } else {
                        let n = t.parse().ok()?;
                        (n, n)
                    }
                }
                _ => return None,
            };
            ((100..=599).contains(&lo) && (lo..=599).contains(&hi)).then_some((lo as u16, hi as u16))
        };
        let parsed: Option<Vec<(u16, u16)>> = match v.get_ref() {
            toml::Value::Array(items) if !items.is_empty() => items.iter().map(one).collect(),
            toml::Value::Array(_) => None,
            item => one(item).map(|r| vec![r]),
        };
        if parsed.is_none() {
            self.error(v.span(), SHAPE);
        }
        parsed
    }
}
