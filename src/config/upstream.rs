//! `[[upstream]]` tables: one `url` or several `servers`, how requests are
//! balanced over them, and their health check.

use std::time::Duration;

use http::HeaderName;
use http::uri::{Authority, PathAndQuery, Scheme};
use toml::Spanned;

use super::Validator;
use super::raw::{RawHealthCheck, RawUpstream};
pub use super::upstream_tls::{Protocol, UpstreamTls};

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
}

/// One server of an upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Server {
    /// As configured: the `server` label of its metrics.
    pub address: String,
    pub scheme: Scheme,
    pub authority: Authority,
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
        let urls: Vec<&Spanned<String>> = match (&u.url, &u.servers) {
            (Some(url), None) => vec![url],
            (None, Some(servers)) if servers.get_ref().is_empty() => {
                self.error(servers.span(), "upstream servers must list at least one URL");
                return None;
            }
            (None, Some(servers)) => servers.get_ref().iter().collect(),
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
        let mut servers: Vec<Server> = Vec::new();
        let mut base_path: Option<String> = None;
        let u_urls: Vec<Spanned<String>> = urls.iter().map(|s| (*s).clone()).collect();
        for url in urls {
            let (server, path) = self.server_url(url)?;
            if servers.contains(&server) {
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
            servers.push(server);
        }
        let https = servers[0].scheme == Scheme::HTTPS;
        if let Some((_, url)) = servers.iter().zip(&u_urls).find(|(s, _)| (s.scheme == Scheme::HTTPS) != https) {
            self.error(url.span(), "every server of an upstream must use the same scheme");
            return None;
        }
        let protocol = self.protocol(&u)?;
        let tls = self.upstream_tls(&u, https, protocol)?;
        let balance = self.balance(&u)?;
        let health_check = match &u.health_check {
            Some(h) => Some(self.health_check(h)?),
            None => None,
        };
        Some(Upstream {
            name: u.name.into_inner(),
            servers,
            base_path: base_path.unwrap_or_default(),
            connect_timeout,
            timeout,
            balance,
            health_check,
            protocol,
            tls,
        })
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
        Some((Server { address: url.get_ref().clone(), scheme, authority }, path))
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
        if self.errors.len() > before {
            return None;
        }
        Some(HealthCheck { path: path?, interval, timeout, healthy, unhealthy })
    }
}
