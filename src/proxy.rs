//! The request path: route, match rules, ask the store once, then answer
//! 429 or forward to the upstream with rate-limit headers.
//!
//! Forwarding itself (streaming bodies, hop-by-hop and
//! `X-Forwarded-*` headers) is in [`crate::upstream::forward`]. Anything tollgate
//! answers itself goes through [`ProxyError`], which alone decides statuses
//! and bodies.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::header;
use http::{Request, Response};
use http_body_util::{Either, Full};
use hyper::body::Incoming;

use crate::config::{ClientConfig, Config, InvalidToken, KeyPart, Normalization, OnError, Route};
use crate::held::Holding;
use crate::limit::rules::RuleReport;
use crate::limit::rules::{Plan, RequestFacts, Rule, RuleSet};
use crate::limit::top::TopKeys;
use crate::limiter::{Verdict, ceil_secs};
use crate::obs::access_log::{AccessLog, Logged, Note};
use crate::obs::metrics::{Metrics, RouteCounters};
use crate::settle::{self, OnTrailers, Settling};
use crate::store::{Answer, AnyStore, Check, Held, Mode, Stamp, Store, StoreError};
use crate::upstream::UpstreamClient;
use crate::upstream::forward::{Downstream, RequestBody};
use crate::upstream::pool::UpstreamBody;
use crate::upstream::tunnel;
use crate::wire::client::{self, Peer};
use crate::wire::error::{self, ProxyError};
use crate::wire::headers;
use crate::wire::identity::{Identity, JwtVerifier};
use crate::wire::normalize;
use crate::wire::request_id;

/// The body of every response tollgate sends: the upstream's, streamed, or
/// one tollgate wrote.
pub type ProxyBody = Either<UpstreamBody<RequestBody>, Full<Bytes>>;

/// [`ProxyBody`] as it leaves [`Proxy::handle`]: holding the request's
/// concurrency slots until it ends (see [`crate::held`]), counted for the
/// access log when there is one.
pub type LoggedBody = Logged<Holding<ProxyBody>>;

/// Everything the request path shares: built once at start-up, the rules
/// swapped on reload.
pub struct Proxy {
    pub rules: ArcSwap<RuleSet>,
    pub store: AnyStore,
    /// The longest idle horizon of limits no rule states (Envoy's
    /// per-descriptor overrides), kept across reloads: the store's horizon
    /// is the larger of it and the rules'. The lock orders a reload's
    /// update of the store's horizon with [`Proxy::cover_idle_horizon`]'s.
    extra_idle_horizon: parking_lot::Mutex<crate::limiter::Nanos>,
    pub metrics: Arc<Metrics>,
    client: ClientConfig,
    store_timeout: Duration,
    max_uri_bytes: usize,
    max_header_bytes: usize,
    normalization: Normalization,
    /// Identity headers read whatever the rules: the user and API key
    /// headers, and `Authorization` with `[client] jwt`. Like the rules'
    /// own headers, each may come at most once.
    identity_headers: Vec<http::HeaderName>,
    body_read_timeout: Duration,
    jwt: Option<JwtVerifier>,
    default_on_error: OnError,
    /// Routes and upstreams, swapped when the main file changes; a request
    /// keeps the ones it started with to its end.
    routing: ArcSwap<Routing>,
    no_route: RouteCounters,
    /// `[log] access`; `None` when off.
    access_log: Option<AccessLog>,
    /// The `/top` sketches; `None` with `[admin] top_keys = 0`.
    top: Option<TopKeys>,
}

/// How far past the store timeout the proxy's own bound on a store check
/// lies (see [`Proxy::decide`]).
const STORE_TIMEOUT_BACKSTOP: Duration = Duration::from_millis(5);

/// One matching rule while a request is being decided.
struct Pending<'r> {
    rule: &'r Rule,
    /// The rule's limits for this request (its own, an override's or a
    /// tier's).
    plan: &'r Plan,
    key: String,
    check_limits: crate::limiter::Limits,
    cost: u64,
}

/// The routes and the upstreams they lead to.
pub struct Routing {
    upstreams: Vec<UpstreamClient>,
    /// Routes sorted by descending prefix length, host-specific first.
    routes: Vec<(Route, RouteCounters)>,
}

impl Routing {
    /// Builds the upstreams of `config` (their connection pools, health
    /// checks and metric handles) and its routes.
    pub fn new(config: &Config, metrics: &Metrics) -> Routing {
        Routing::replacing(config, metrics, None)
    }

    /// [`Routing::new`], keeping from `previous` every upstream server
    /// whose definition did not change (its health, backoff and
    /// connections), and removing the metric series of those that are
    /// gone.
    pub fn replacing(config: &Config, metrics: &Metrics, previous: Option<&Routing>) -> Routing {
        let before = |name: &str| previous.and_then(|p| p.upstreams.iter().find(|u| u.config.name == name));
        let prefix = config.client.ipv6_prefix;
        let upstreams: Vec<UpstreamClient> =
            config.upstreams.iter().map(|u| UpstreamClient::new(u, metrics, prefix, before(&u.name))).collect();
        for old in previous.iter().flat_map(|p| &p.upstreams) {
            let name = old.config.name.as_str();
            let new = upstreams.iter().find(|u| u.config.name == name);
            for address in old.addresses() {
                if new.is_none_or(|u| u.addresses().all(|a| a != address)) {
                    metrics.forget_upstream_server(name, address);
                }
            }
        }
        let mut routes: Vec<(Route, RouteCounters)> =
            config.routes.iter().map(|r| (r.clone(), metrics.route_counters(&r.name))).collect();
        routes.sort_by_key(|(r, _)| (std::cmp::Reverse(r.path_prefix.len()), r.host.is_none()));
        Routing { upstreams, routes }
    }

    fn route(&self, host: Option<&str>, path: &str) -> Option<usize> {
        self.routes.iter().position(|(r, _)| {
            path.starts_with(r.path_prefix.as_str()) && r.host.as_deref().is_none_or(|h| Some(h) == host)
        })
    }
}

impl Proxy {
    /// Builds the request path for `config` with `rules` in force; `top`
    /// counts their keys for `/top` (`None`: `[admin] top_keys = 0`).
    pub fn new(
        config: &Config,
        mut rules: RuleSet,
        store: AnyStore,
        metrics: Arc<Metrics>,
        top: Option<TopKeys>,
    ) -> Proxy {
        if let Some(t) = &top {
            t.attach(&mut rules);
        }
        let routing = Routing::new(config, &metrics);
        store.set_idle_horizon(rules.idle_horizon);
        metrics.rules_active.set(rules.rules.len() as i64);
        // At zero from the start, like every counter whose labels are known.
        metrics.store_errors_total.with_label_values(&[store.backend()]);
        let access_log =
            AccessLog::start(&config.log.access, metrics.access_log_dropped_total.clone()).unwrap_or_else(|e| {
                tracing::error!(error = %e, "cannot start the access log writer; requests are not logged");
                None
            });
        Proxy {
            access_log,
            rules: ArcSwap::from_pointee(rules),
            extra_idle_horizon: parking_lot::Mutex::new(0),
            store,
            no_route: metrics.route_counters("none"),
            metrics,
            client: config.client.clone(),
            store_timeout: config.store.timeout,
            max_uri_bytes: config.listen.max_uri_bytes,
            max_header_bytes: config.listen.max_header_bytes,
            normalization: config.listen.normalization,
            identity_headers: {
                let mut h = vec![config.client.user_header.clone(), config.client.api_key_header.clone()];
                if config.client.jwt.is_some() {
                    h.push(header::AUTHORIZATION);
                }
                h
            },
            body_read_timeout: config.listen.body_read_timeout,
            jwt: config.client.jwt.as_ref().and_then(|j| match JwtVerifier::new(j) {
                Ok(v) => Some(v),
                Err(e) => {
                    // Config validation built this verifier once already;
                    // only a key file changed in between can get here.
                    tracing::error!("client.jwt: {e}; requests keyed on user fall back to the client IP");
                    None
                }
            }),
            default_on_error: config.store.on_error,
            routing: ArcSwap::from_pointee(routing),
            top,
        }
    }

    /// Puts new routes and upstreams in force (the main file changed).
    /// Requests under way finish on the old ones, which close their
    /// connections and stop their health checks once the last is done.
    pub fn swap_routing(&self, routing: Routing) {
        self.routing.store(Arc::new(routing));
    }

    /// Puts the routes and upstreams of `config` in force, keeping what
    /// the running ones have of servers that did not change
    /// ([`Routing::replacing`]).
    pub fn reroute(&self, config: &Config) {
        let previous = self.routing.load_full();
        self.swap_routing(Routing::replacing(config, &self.metrics, Some(&previous)));
    }

    /// Puts a new rule set in force. Existing buckets keep their counts: the
    /// store is keyed by rule name and key, not by rule set.
    pub fn swap_rules(&self, mut rules: RuleSet) {
        if let Some(t) = &self.top {
            t.attach(&mut rules);
        }
        let extra = self.extra_idle_horizon.lock();
        self.store.set_idle_horizon(rules.idle_horizon.max(*extra));
        self.metrics.rules_active.set(rules.rules.len() as i64);
        self.rules.store(Arc::new(rules));
    }

    /// Keeps the store from forgetting keys checked under `limits`, which
    /// no rule states (Envoy's overrides), before they are fresh again: the
    /// store forgets a key idle for longer than the rules' longest idle
    /// horizon, which a longer override would outlast. The horizon only
    /// grows (to twice a year at most: Envoy's longest unit); the store is
    /// told only when it does.
    pub fn cover_idle_horizon(&self, limits: &crate::limiter::Limits) {
        let h = limits.idle_horizon().saturating_mul(2);
        let mut extra = self.extra_idle_horizon.lock();
        if h > *extra {
            *extra = h;
            self.store.set_idle_horizon(self.rules.load().idle_horizon.max(h));
        }
    }

    /// The peer of a connection just accepted from `addr`, for every
    /// request on it.
    pub fn peer(&self, addr: SocketAddr) -> Peer {
        Peer::new(addr.ip(), &self.client.trusted_proxies)
    }

    /// Serves one request from `peer`; never fails (every failure is an
    /// answer). The request gets its id first (see [`crate::wire::request_id`]);
    /// with an access log, its line is sent when the response body ends or
    /// the client goes away, this future dropped before an answer included.
    pub async fn handle(&self, mut req: Request<Incoming>, peer: &Peer) -> Response<LoggedBody> {
        let started = Instant::now();
        let request_id = request_id::assign(req.headers_mut(), peer.trusted);
        let mut pending = self.access_log.as_ref().map(|log| log.begin_request(&req, peer.ip, &request_id, peer.tls));
        let note = match &mut pending {
            Some(p) => p.note(),
            None => Note::off(),
        };
        let (mut held, mut on_trailers) = (None, None);
        let mut resp = self.serve(req, peer, &request_id, note, &mut held, &mut on_trailers).await;
        if self.client.request_id_in_response {
            // Replaces an upstream's own: one id for the client, the
            // upstream and the access log. tollgate's answers have it already.
            resp.headers_mut().insert(request_id::X_REQUEST_ID, request_id.clone());
        }
        self.metrics.request_duration_seconds.observe(started.elapsed().as_secs_f64());
        if let Some(p) = &mut pending {
            p.respond(resp.status().as_u16());
        }
        resp.map(|body| Logged::new(Holding::new(body, held, on_trailers), pending))
    }

    /// The access log entry of a request refused before the request path
    /// (over `max_connections`, or plain HTTP to the TLS port), read from
    /// the first bytes of its connection; `None` when the log is off.
    pub fn log_refused(
        &self,
        head: &[u8],
        peer: std::net::IpAddr,
        request_id: &http::HeaderValue,
    ) -> Option<crate::obs::access_log::Pending> {
        Some(self.access_log.as_ref()?.begin_raw(head, client::canonical(peer), request_id))
    }

    /// The access log, unless `[log] access = "off"`: for the listeners
    /// outside the request path (the redirect listener).
    pub fn access_log(&self) -> Option<&AccessLog> {
        self.access_log.as_ref()
    }

    /// Makes the access log reopen its file (SIGHUP).
    pub fn reopen_access_log(&self) {
        if let Some(log) = &self.access_log {
            log.reopen();
        }
    }

    /// Waits, up to `within`, for the access log lines queued so far to be
    /// written (at shutdown).
    pub async fn flush_access_log(&self, within: Duration) {
        if let Some(log) = &self.access_log {
            log.flush(within).await;
        }
    }

    async fn serve(
        &self,
        mut req: Request<Incoming>,
        peer: &Peer,
        request_id: &http::HeaderValue,
        mut note: Note<'_>,
        held: &mut Option<Held>,
        on_trailers: &mut Option<OnTrailers>,
    ) -> Response<ProxyBody> {
        let routing = self.routing.load_full();
        // One spelling of the request before anything reads it (see
        // crate::wire::normalize): what is refused here is refused before routing
        // and counts as a rejection of no route.
        let bad = |counters: &RouteCounters, why: String| {
            counters.rejected.inc();
            ProxyError::BadRequest(why).into_response(request_id).map(Either::Right)
        };
        if !self.normalization.underscores_in_headers {
            normalize::drop_underscored(req.headers_mut());
        }
        let host = match normalize::method(req.method()).and_then(|()| normalize::host(&req)) {
            Ok(h) => h,
            Err(why) => return bad(&self.no_route, why.to_string()),
        };
        // Owned only when the client's spelling was not canonical; the
        // upstream then receives the canonical path.
        let canonical_path = match normalize::path(req.uri().path(), &self.normalization) {
            Ok(std::borrow::Cow::Borrowed(_)) => None,
            Ok(std::borrow::Cow::Owned(p)) => Some(p),
            Err(e) => return bad(&self.no_route, e.reason().to_string()),
        };
        let path = canonical_path.as_deref().unwrap_or(req.uri().path());
        let host_name = host.as_ref().map(|h| h.name.as_str());
        let route = routing.route(host_name, path);
        let counters = route.map_or(&self.no_route, |i| &routing.routes[i].1);
        if let Some(e) = self.oversized(&req, route.map(|i| &routing.routes[i].0)) {
            counters.rejected.inc();
            return e.into_response(request_id).map(Either::Right);
        }
        let client_ip = match client::client_addr(peer.ip, req.headers(), &self.client.trusted_proxies) {
            Ok(ip) => ip,
            Err(client::BadForwarding) => {
                return bad(counters, "The forwarding headers from a trusted proxy name no client address.".into());
            }
        };
        note.client(client_ip);
        let rules = self.rules.load();
        if rules.reads_method
            && let Err(why) = normalize::method_override(req.headers())
        {
            return bad(counters, why.to_string());
        }
        if let Some(name) = normalize::repeated(req.headers(), &self.identity_headers)
            .or_else(|| normalize::repeated(req.headers(), &rules.read_headers))
        {
            return bad(counters, format!("The header {name} must not be given more than once."));
        }
        // With `[client] jwt`, the user is whoever the token proves, and the
        // user header is never read; the token is verified only if the rules
        // need the user.
        // A tier claim is read from the same token, when a rule uses one.
        let mut tier_claim = None;
        let identity = self.jwt.as_ref().map(|j| {
            if !rules.needs_user(path) {
                Identity::Missing
            } else if let Some(claim) = &rules.tier_claim {
                let (identity, tier) = j.verify_with_claim(req.headers(), claim);
                tier_claim = tier;
                identity
            } else {
                j.verify(req.headers())
            }
        });

        // Decide.
        let mut reports: Vec<RuleReport<'_>> = Vec::new();
        // Admitted rules whose cost the response corrects (empty, and no
        // allocation, without `cost_response_header` rules).
        let mut settling: Vec<Settling> = Vec::new();
        let mut delay = 0;
        {
            let facts = RequestFacts {
                method: req.method(),
                path,
                query: req.uri().query(),
                host: host_name,
                route: route.map(|i| {
                    let r = &routing.routes[i].0;
                    (r.name.as_str(), routing.upstreams[r.upstream].config.name.as_str())
                }),
                headers: req.headers(),
                client: client::key_addr(client_ip, self.client.ipv6_prefix),
                client_ip,
                // Looked up only when some rule or deny entry reads them
                // (each lookup hashes the header's name).
                user: match &identity {
                    Some(Identity::Verified(id)) => Some(id.as_bytes()),
                    Some(_) => None,
                    None if rules.any_needs_user => req.headers().get(&self.client.user_header).map(|v| v.as_bytes()),
                    None => None,
                },
                api_key: if rules.any_reads_api_key {
                    req.headers().get(&self.client.api_key_header).map(|v| v.as_bytes())
                } else {
                    None
                },
                tier_claim: tier_claim.as_deref().map(str::as_bytes),
                client_cert: peer.client_cert.as_deref(),
            };
            if let Some(deny) = rules.denied(&facts) {
                counters.denied.inc();
                tracing::debug!(deny = %deny.name, client = %client_ip, "denied");
                return ProxyError::Forbidden.into_response(request_id).map(Either::Right);
            }
            let inflight = route.map_or(0, |i| routing.upstreams[routing.routes[i].0.upstream].inflight());
            let mut pending: Vec<Pending<'_>> = Vec::new();
            for rule in rules.matching(&facts) {
                if let Some(Identity::Invalid(reason)) = &identity
                    && rule.spec.on_invalid_token == InvalidToken::Reject
                    && rule.spec.key.contains(&KeyPart::User)
                {
                    counters.rejected.inc();
                    return ProxyError::Unauthorized(reason).into_response(request_id).map(Either::Right);
                }
                let cost = match rule.cost(req.headers()) {
                    Ok(c) => c,
                    Err(reason) => {
                        counters.rejected.inc();
                        return ProxyError::BadRequest(reason).into_response(request_id).map(Either::Right);
                    }
                };
                let mut key = String::with_capacity(64);
                if let Err(reason) = rule.key(&facts, &mut key) {
                    counters.rejected.inc();
                    return ProxyError::BadRequest(reason).into_response(request_id).map(Either::Right);
                }
                let plan = rule.plan_for(&key, &facts);
                pending.push(Pending {
                    rule,
                    plan,
                    key,
                    check_limits: rule.limits_of(plan, inflight, self.store.clock()),
                    cost,
                });
            }

            if !pending.is_empty() {
                // Stamped before the check is sent: a reservation is
                // counted at or after its stamp, so a settle that aims at
                // the stamp's window misses (gives nothing back) rather
                // than reaching a window that never counted it.
                // (No clock read for a request none of whose rules settle.)
                let settles = rules.any_settles && pending.iter().any(|p| p.rule.spec.cost_response_header.is_some());
                let stamp = settles.then(|| self.store.stamp());
                let answers = self.decide(&pending, held).await;
                let answers = self.decide_locally(answers, &pending, held);
                // Each rule's own answer: a verdict, or its store error and
                // its own `on_error`. A rule that answered and rejects
                // decides (429) whatever the others' errors; then a failed
                // enforced rule that says `deny` (503); failed `allow` rules
                // are open and report nothing.
                let mut rejected: Option<(usize, u64)> = None;
                let mut denied = false;
                let mut failed = None;
                let mut report_of: Vec<Option<usize>> = Vec::with_capacity(pending.len());
                let top_period = self.top.as_ref().map(TopKeys::period_now);
                for (i, (p, answer)) in pending.iter().zip(&answers).enumerate() {
                    if let (Some(top), Some(period)) = (&p.rule.top, top_period) {
                        top.record(period, &p.key, matches!(answer, Ok(v) if !v.allowed));
                    }
                    let v = match answer {
                        Ok(v) => v,
                        Err(e) => {
                            failed = Some(e);
                            denied |= p.rule.enforced() && self.on_error(p) == OnError::Deny;
                            report_of.push(None);
                            continue;
                        }
                    };
                    // Shadow rules are invisible to the client: counted
                    // and measured, but no headers and no shaping delay.
                    if p.rule.enforced() {
                        report_of.push(Some(reports.len()));
                        reports.push(RuleReport::of(p.rule, p.plan, v, p.check_limits.capacity()));
                    } else {
                        report_of.push(None);
                    }
                    if v.allowed {
                        p.rule.counters.allowed.inc();
                        if p.rule.enforced() {
                            delay = delay.max(v.delay);
                        }
                    } else if p.rule.enforced() {
                        p.rule.counters.limited.inc();
                        let secs = ceil_secs(v.retry_after).max(1);
                        if rejected.is_none_or(|(_, s)| secs > s) {
                            rejected = Some((i, secs));
                        }
                    } else {
                        p.rule.counters.shadow_limited.inc();
                    }
                }
                if let Some(e) = failed {
                    // Counted in `tollgate_store_errors_total` by the store
                    // (or by `decide`'s backstop).
                    tracing::debug!(error = %e, "store check failed");
                }
                if note.enabled() {
                    match rejected {
                        Some((i, _)) => note.rule(pending[i].rule.name()),
                        None if !reports.is_empty() => {
                            note.rule(reports[headers::most_restrictive(&reports)].rule.name())
                        }
                        None => {}
                    }
                }
                if let Some((i, secs)) = rejected {
                    // The store counted nothing for a rejected request:
                    // rules that would have admitted it still have its cost
                    // left, not what would remain after it.
                    for ((at, p), answer) in report_of.iter().zip(&pending).zip(&answers) {
                        if let (Some(at), Ok(v)) = (at, answer)
                            && v.allowed
                        {
                            let unspent = Verdict { remaining: v.remaining + p.cost, ..*v };
                            reports[*at] = RuleReport::of(p.rule, p.plan, &unspent, p.check_limits.capacity());
                        }
                    }
                    counters.limited.inc();
                    tracing::debug!(rule = pending[i].rule.name(), key = %pending[i].key, client = %client_ip, "rate limited");
                    let rule = pending[i].rule;
                    let err = if rule.plan.nominal.algorithm.holds() {
                        ProxyError::TooManyInFlight {
                            rule: rule.name().to_string(),
                            limit: pending[i].plan.nominal.limit,
                        }
                    } else {
                        ProxyError::Limited {
                            rule: rule.name().to_string(),
                            limit: pending[i].plan.nominal.limit,
                            window_seconds: rule.window_secs_now(),
                            retry_after_seconds: secs,
                        }
                    };
                    let problem = error::accepts_problem(req.headers());
                    if let [only] = reports.as_slice()
                        && let Some(head) = &only.plan.reject_head
                        && !problem
                    {
                        // The flood's case: one rule, a head prebuilt for it.
                        return err.into_limited_response(request_id, head, only).map(Either::Right);
                    }
                    let mut resp = if problem {
                        // Every enforced rule this request is over.
                        let violated: Vec<&str> = pending
                            .iter()
                            .zip(&answers)
                            .filter(|(p, a)| p.rule.enforced() && matches!(a, Ok(v) if !v.allowed))
                            .map(|(p, _)| p.rule.name())
                            .collect();
                        err.into_problem_response(request_id, &violated)
                    } else {
                        err.into_response(request_id)
                    }
                    .map(Either::Right);
                    let primary = report_of[i].unwrap_or(0);
                    headers::write(resp.headers_mut(), &reports, primary);
                    return resp;
                }
                if denied {
                    counters.store_unavailable.inc();
                    return ProxyError::StoreUnavailable { retry_after_seconds: 1 }
                        .into_response(request_id)
                        .map(Either::Right);
                }
                if let Some(stamp) = stamp {
                    settling = self.settling(&pending, &answers, stamp);
                }
            }
        }

        let Some(route) = route else {
            counters.rejected.inc();
            let mut resp = ProxyError::NoRoute.into_response(request_id).map(Either::Right);
            let primary = headers::most_restrictive(&reports);
            headers::write(resp.headers_mut(), &reports, primary);
            return resp;
        };
        counters.allowed.inc();
        if delay > 0 {
            // Leaky bucket shaping: wait for this request's turn.
            tokio::time::sleep(Duration::from_nanos(delay)).await;
        }
        let primary = headers::most_restrictive(&reports);
        let upstream = &routing.upstreams[routing.routes[route].0.upstream];
        let version = req.version();
        // Taken before the request moves on: hyper completes the client's
        // side once the 101 has been written.
        let upgrade = tunnel::requested(&req).map(|protocol| (protocol, hyper::upgrade::on(&mut req)));
        let (upgrade, client_upgrade) = upgrade.unzip();
        // Noted before the request leaves, so that a client that goes away
        // while it is out still has its server logged; with several
        // servers, the one picked is noted once forwarding returns.
        let chosen = std::sync::atomic::AtomicUsize::new(usize::MAX);
        if note.enabled()
            && upstream.servers() == 1
            && let Some(server) = upstream.server_authority(0)
        {
            note.upstream(server);
        }
        let down = Downstream {
            peer,
            client_ip,
            host: host.as_ref().map(|h| h.name.as_str()),
            host_header: host.as_ref().and_then(|h| h.rewrite.clone()),
            path: canonical_path,
            max_body: routing.routes[route].0.max_body,
            buffer_body: routing.routes[route].0.buffer_body,
            body_read_timeout: self.body_read_timeout,
            // HTTP/2's streams share their connection's budget; an
            // HTTP/1.1 connection has one request at a time.
            ahead_budget: (version == http::Version::HTTP_2)
                .then(|| peer.body_budget.clone().map(crate::upstream::forward::AheadBudget::shared))
                .flatten(),
            upgrade,
            bytes_in: note.bytes_in(),
            chosen: note.enabled().then_some(&chosen),
        };
        // No clock read for the access log when it is off.
        let sent = note.enabled().then(Instant::now);
        let result = upstream.forward(req, down).await;
        if let Some(sent) = sent {
            note.upstream_answer(result.as_ref().ok().map(|r| r.status().as_u16()), sent.elapsed());
        }
        if let Some(server) = upstream.server_authority(chosen.load(std::sync::atomic::Ordering::Relaxed)) {
            note.upstream(server);
        }
        let mut resp = match result {
            Ok(mut resp) => {
                // Answer in the client's protocol, not the upstream's.
                *resp.version_mut() = version;
                if let Some(client) = client_upgrade
                    && resp.status() == http::StatusCode::SWITCHING_PROTOCOLS
                {
                    let upstream = hyper::upgrade::on(&mut resp);
                    // The tunnel is the request in flight until it closes.
                    let held = held.take().map(Arc::new);
                    let answered = resp.body_mut().take_answered().map(Arc::new);
                    let websocket = resp
                        .headers()
                        .get(http::header::UPGRADE)
                        .is_some_and(|p| p.as_bytes().eq_ignore_ascii_case(b"websocket"));
                    resp.extensions_mut().insert(tunnel::Pending { client, upstream, held, answered, websocket });
                }
                if !settling.is_empty() {
                    let ended = hyper::body::Body::is_end_stream(resp.body());
                    *on_trailers = settle::at_head(settling, resp.headers(), ended, &self.store, &self.metrics);
                }
                resp.map(Either::Left)
            }
            Err(e) => e.into_response(request_id).map(Either::Right),
        };
        headers::write(resp.headers_mut(), &reports, primary);
        resp
    }

    /// Requests over a size limit are refused before any rule counts them:
    /// 414 for the target, 431 for the headers, 501 for a body in a transfer
    /// coding tollgate cannot decode, 413 for a declared body
    /// length (a chunked body is cut off while it is read instead, see
    /// [`crate::upstream::forward::RequestBody`]).
    fn oversized(&self, req: &Request<Incoming>, route: Option<&Route>) -> Option<ProxyError> {
        if req.uri().path_and_query().map_or(0, |p| p.as_str().len()) > self.max_uri_bytes {
            return Some(ProxyError::UriTooLong);
        }
        // Counted the way they travel in HTTP/1.1: "name: value\r\n".
        let header_bytes: usize = req.headers().iter().map(|(k, v)| k.as_str().len() + v.len() + 4).sum();
        if header_bytes > self.max_header_bytes {
            return Some(ProxyError::HeadersTooLarge);
        }
        if crate::upstream::forward::undecodable_transfer_coding(req.headers()) {
            return Some(ProxyError::UnsupportedTransferEncoding);
        }
        let max_body = route.and_then(|r| r.max_body)?;
        let declared = req.headers().get(header::CONTENT_LENGTH)?.to_str().ok()?.trim().parse::<u64>().ok()?;
        (declared > max_body).then_some(ProxyError::PayloadTooLarge)
    }

    /// The `on_error` policy of a pending rule.
    fn on_error(&self, p: &Pending<'_>) -> OnError {
        p.rule.spec.on_error.unwrap_or(self.default_on_error)
    }

    /// One store round trip for all matching rules, bounded by the store
    /// timeout. Each rule gets its own answer; the concurrency slots an
    /// admitted request takes go to `held`.
    async fn decide(&self, pending: &[Pending<'_>], held: &mut Option<Held>) -> Vec<Answer> {
        let checks: Vec<Check<'_>> = pending.iter().map(|p| self.check_of(p)).collect();
        let started = Instant::now();
        let result = match &self.store {
            // The memory store answers synchronously: no timer needed.
            AnyStore::Memory(m) => {
                let (verdicts, slots) = m.check_holding(&checks, Mode::Consume);
                *held = slots.map(Held::Memory);
                verdicts.into_iter().map(Ok).collect()
            }
            // The Redis store bounds each of its calls by the store timeout
            // itself, with fred's timer, which also keeps a timed-out check
            // from being sent later; this outer bound is only a backstop and
            // must not fire first.
            other => {
                let backstop = self.store_timeout + STORE_TIMEOUT_BACKSTOP;
                // Slots taken by a check this cuts off are never renewed:
                // they expire within their TTL.
                match tokio::time::timeout(backstop, other.check_holding(&checks, Mode::Consume)).await {
                    Ok((answers, slots)) => {
                        *held = slots;
                        answers
                    }
                    Err(_) => {
                        self.metrics.store_errors_total.with_label_values(&[self.store.backend()]).inc();
                        checks.iter().map(|_| Err(StoreError::Timeout(self.store_timeout))).collect()
                    }
                }
            }
        };
        self.metrics.store_duration_seconds.observe(started.elapsed().as_secs_f64());
        result
    }

    /// The admitted rules of `pending` whose cost their response settles,
    /// counted no earlier than `at`.
    fn settling(&self, pending: &[Pending<'_>], answers: &[Answer], at: Stamp) -> Vec<Settling> {
        pending
            .iter()
            .zip(answers)
            .filter_map(|(p, a)| match a {
                Ok(v) if v.allowed => Some((p, v.fallback)),
                _ => None,
            })
            .filter_map(|(p, fallback)| {
                Some(Settling {
                    header: p.rule.spec.cost_response_header.clone()?,
                    rule: p.rule.name().to_string(),
                    key: p.key.clone(),
                    limits: p.check_limits,
                    reserved: p.cost,
                    enforced: p.rule.enforced(),
                    on_error: self.on_error(p),
                    at,
                    fallback,
                })
            })
            .collect()
    }

    fn check_of<'p>(&self, p: &'p Pending<'_>) -> Check<'p> {
        Check {
            key: &p.key,
            limits: p.check_limits,
            cost: p.cost,
            enforced: p.rule.enforced(),
            on_error: self.on_error(p),
            settles: p.rule.spec.cost_response_header.is_some(),
        }
    }

    /// `on_error = "local"` when the store gave up on a whole request (the
    /// backstop timeout): the failed rules whose policy is `local` are
    /// decided by the store's in-process fallback, with the same limits.
    /// The store applies the fallback itself to the rules it could not
    /// decide, so this only acts when every rule failed, and not when an
    /// enforced rule says `deny` (deny wins) or the store has no fallback.
    fn decide_locally(
        &self,
        mut answers: Vec<Answer>,
        pending: &[Pending<'_>],
        held: &mut Option<Held>,
    ) -> Vec<Answer> {
        let all_failed = answers.iter().all(Result::is_err);
        let deny = pending.iter().any(|p| p.rule.enforced() && self.on_error(p) == OnError::Deny);
        let local: Vec<usize> = (0..pending.len()).filter(|&i| self.on_error(&pending[i]) == OnError::Local).collect();
        if !all_failed || deny || local.is_empty() {
            return answers;
        }
        let checks: Vec<Check<'_>> = local.iter().map(|&i| self.check_of(&pending[i])).collect();
        let Some((verdicts, slots)) = self.store.check_local_holding(&checks, Mode::Consume) else { return answers };
        *held = slots;
        for (&i, v) in local.iter().zip(verdicts) {
            answers[i] = Ok(Verdict { fallback: true, ..v });
        }
        answers
    }

    /// One rule's decision for a caller outside the request path (the
    /// decision API, [`crate::decision`]): the same store round trip,
    /// store timeout and `on_error` fallback as a proxied request, so both
    /// spend one counter. Returns the answer and the limits it was checked
    /// against (soft throttling applied; elastic none: there is no upstream
    /// whose in-flight count could show it idle, so the rule's own limit). Not for
    /// concurrency rules: a slot taken here would be given back at once.
    pub async fn decide_one(
        &self,
        rule: &Rule,
        plan: &Plan,
        key: String,
        cost: u64,
    ) -> (Answer, crate::limiter::Limits) {
        let check_limits = rule.limits_of(plan, crate::limit::rules::NO_UPSTREAM, self.store.clock());
        let pending = [Pending { rule, plan, key, check_limits, cost }];
        let mut held = None;
        let answers = self.decide(&pending, &mut held).await;
        let mut answers = self.decide_locally(answers, &pending, &mut held);
        let limits = pending[0].check_limits;
        // One check in, one answer out; an empty vector cannot happen, but
        // would read as a store that gave no answer.
        (answers.pop().unwrap_or(Err(StoreError::Timeout(self.store_timeout))), limits)
    }

    /// The `on_error` policy of `rule`.
    pub fn on_error_of(&self, rule: &Rule) -> OnError {
        rule.spec.on_error.unwrap_or(self.default_on_error)
    }

    /// `[client]`: how client addresses are keyed (the decision API keys
    /// an `ip` the way the proxy keys a client).
    pub fn client_config(&self) -> &ClientConfig {
        &self.client
    }

    /// `[listen]` path normalisation, for paths given to the decision API.
    pub fn normalization(&self) -> &Normalization {
        &self.normalization
    }

    /// The `/top` sketches, unless `[admin] top_keys = 0`.
    pub fn top(&self) -> Option<&TopKeys> {
        self.top.as_ref()
    }

    /// `[store] on_error`: what rules without their own policy do when the
    /// store fails.
    pub fn default_on_error(&self) -> OnError {
        self.default_on_error
    }

    /// The JWT verifier, when `[client] jwt` is set.
    pub fn jwt(&self) -> Option<&JwtVerifier> {
        self.jwt.as_ref()
    }

    /// In-flight requests to an upstream, by name (for tests and `explain`).
    pub fn upstream_inflight(&self, name: &str) -> Option<usize> {
        self.routing.load().upstreams.iter().find(|u| u.config.name == name).map(UpstreamClient::inflight)
    }

    /// Brings the gauges the request path does not set itself up to date,
    /// before metrics are rendered.
    pub fn refresh_gauges(&self) {
        self.routing.load().upstreams.iter().for_each(UpstreamClient::refresh_gauges);
    }
}
