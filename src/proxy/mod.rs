//! The request path, in phases over one per-request [`Exchange`]:
//!
//! - [`Proxy::handle`] gives the request its id and access-log entry, runs
//!   `Proxy::serve`, then the log step, once for every request;
//! - `admit`: one spelling of the request, its route, size limits, client
//!   address and identity;
//! - the [`Decider`] ([`crate::limit::decide`]): deny list, rules, one store
//!   round, verdicts;
//! - `reject` (429) or `refuse` (anything else tollgate answers itself),
//!   or `forward` to the upstream and `answered`: tunnel, settle, headers.
//!
//! Forwarding itself (streaming bodies, hop-by-hop and `X-Forwarded-*`
//! headers) is in [`crate::upstream::forward`]. Anything tollgate answers itself goes
//! through [`ProxyError`], which alone decides statuses and bodies.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{HeaderValue, Request, Response, header};
use http_body_util::{Either, Full};
use hyper::body::Incoming;

use crate::config::{ClientConfig, Config, Normalization, OnError, PathPattern, Route};
use crate::limit::decide::{Decider, Decision, Ruling};
use crate::limit::path_index::PathIndex;
use crate::limit::rules::RuleSet;
use crate::limit::top::TopKeys;
use crate::obs::access_log::{AccessLog, Logged, Note};
use crate::obs::metrics::{Metrics, RouteCounters};
use crate::obs::trace::Tracer;
use crate::proxy::held::Holding;
use crate::proxy::settle::OnTrailers;
use crate::store::{AnyStore, Held};
use crate::upstream::UpstreamClient;
use crate::upstream::forward::RequestBody;
use crate::upstream::pool::UpstreamBody;
use crate::upstream::tunnel;
use crate::wire::client::{self, Peer};
use crate::wire::error::ProxyError;
use crate::wire::headers;
use crate::wire::identity::{Identity, JwtVerifier};
use crate::wire::normalize::Host;
use crate::wire::request_id;

mod admit;
pub mod held;
mod respond;
pub mod settle;

/// The body of every response tollgate sends: the upstream's, streamed, or
/// one tollgate wrote.
pub type ProxyBody = Either<UpstreamBody<RequestBody>, Full<Bytes>>;

/// [`ProxyBody`] as it leaves [`Proxy::handle`]: holding the request's
/// concurrency slots until it ends (see [`crate::proxy::held`]), counted for the
/// access log when there is one.
pub type LoggedBody = Logged<Holding<ProxyBody>>;

/// Everything the request path shares: built once at start-up, the rules
/// swapped on reload.
pub struct Proxy {
    /// The rules, the store and their verdicts, shared with the decision
    /// API and Envoy RLS.
    decider: Arc<Decider>,
    pub metrics: Arc<Metrics>,
    client: ClientConfig,
    max_uri_bytes: usize,
    max_header_bytes: usize,
    normalization: Normalization,
    /// Identity headers read whatever the rules: the user and API key
    /// headers, and `Authorization` with `[client] jwt`. Like the rules'
    /// own headers, each may come at most once.
    identity_headers: Vec<http::HeaderName>,
    body_read_timeout: Duration,
    jwt: Option<JwtVerifier>,
    /// Routes and upstreams, swapped when the main file changes; a request
    /// keeps the ones it started with to its end.
    routing: ArcSwap<Routing>,
    no_route: RouteCounters,
    /// `[log] access`, and the spans of sampled requests; `None` when
    /// neither is on.
    access_log: Option<AccessLog>,
    /// `[tracing]`; `None` when off.
    tracer: Option<Arc<Tracer>>,
}

/// One request on its way through the phases of [`Proxy::serve`]: what
/// each phase learns, for the phases after it and the log step.
struct Exchange<'a> {
    peer: &'a Peer,
    request_id: HeaderValue,
    /// The request's access-log entry (goes nowhere when the log is off).
    note: Note<'a>,
    /// The routes and upstreams in force when the request came.
    routing: Arc<Routing>,
    /// The request's route in `routing`; `None` before `admit` finds it,
    /// or when none matches.
    route: Option<usize>,
    host: Option<Host>,
    /// The canonical path, when the client spelled it otherwise: the
    /// rules match it and the upstream receives it.
    path: Option<String>,
    /// The client's address, after trusted proxies.
    client_ip: IpAddr,
    /// With `[client] jwt`: who the token proves the client is.
    identity: Option<Identity>,
    /// The token's tier claim, when a rule uses one.
    tier_claim: Option<String>,
    /// The concurrency slots the request holds until its response ends.
    held: Option<Held>,
    /// Reservations whose real cost comes with the response's trailers.
    on_trailers: Option<OnTrailers>,
}

/// What the access log and the request's span keep of its decision: the
/// rule, the verdict and, for a span (`asked`: when the store was asked),
/// the store's time and the route.
fn note_decision(x: &mut Exchange<'_>, d: &Decision<'_>, asked: Option<Instant>) {
    if let Some(rule) = d.rule_to_note() {
        x.note.rule(rule);
    }
    if let Some(asked) = asked {
        x.note.store_time(asked.elapsed());
        if let Some(r) = x.route {
            x.note.route(&x.routing.routes[r].0.path_prefix);
        }
    }
    x.note.decision(match d.ruling {
        Ruling::Admitted { .. } => "allowed",
        Ruling::Limited { .. } => "limited",
        Ruling::Unavailable => "store_unavailable",
    });
}

/// The routes and the upstreams they lead to.
pub struct Routing {
    upstreams: Vec<UpstreamClient>,
    /// Routes sorted by descending prefix length, host-specific first.
    routes: Vec<(Route, RouteCounters)>,
    /// The routes by their prefixes: a request looks only at those that
    /// can match its path, whatever the number of routes.
    paths: PathIndex,
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
        let prefixes: Vec<_> = routes.iter().map(|(r, _)| PathPattern::Prefix(r.path_prefix.clone())).collect();
        let paths = PathIndex::new(prefixes.iter().map(Some));
        Routing { upstreams, routes, paths }
    }

    fn route(&self, host: Option<&str>, path: &str) -> Option<usize> {
        self.paths.candidates(path).find(|&i| {
            let r = &self.routes[i].0;
            path.starts_with(r.path_prefix.as_str()) && r.host.as_deref().is_none_or(|h| Some(h) == host)
        })
    }
}

impl Proxy {
    /// Builds the request path for `config` with `rules` in force; `top`
    /// counts their keys for `/top` (`None`: `[admin] top_keys = 0`).
    pub fn new(config: &Config, rules: RuleSet, store: AnyStore, metrics: Arc<Metrics>, top: Option<TopKeys>) -> Proxy {
        let routing = Routing::new(config, &metrics);
        let tracer = Tracer::start(config.tracing.as_ref(), &metrics);
        let access_log = AccessLog::start(&config.log.access, metrics.access_log_dropped_total.clone(), tracer.clone())
            .unwrap_or_else(|e| {
                tracing::error!(error = %e, "cannot start the access log writer; requests are not logged");
                None
            });
        Proxy {
            tracer,
            decider: Arc::new(Decider::new(config, rules, store, metrics.clone(), top)),
            access_log,
            no_route: metrics.route_counters("none"),
            metrics,
            client: config.client.clone(),
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
            routing: ArcSwap::from_pointee(routing),
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

    /// Puts a new rule set in force ([`Decider::swap_rules`]); returns
    /// the rules replaced.
    pub fn swap_rules(&self, rules: RuleSet) -> Arc<RuleSet> {
        self.decider.swap_rules(rules)
    }

    /// The rules, the store and their verdicts: what the decision API and
    /// Envoy RLS share with the proxy.
    pub fn decider(&self) -> &Arc<Decider> {
        &self.decider
    }

    /// The rules in force.
    pub fn rules(&self) -> &ArcSwap<RuleSet> {
        self.decider.rules()
    }

    pub fn store(&self) -> &AnyStore {
        self.decider.store()
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
        let trace = self.tracer.as_ref().map(|t| t.begin(req.headers_mut(), peer.trusted));
        let mut entry =
            self.access_log.as_ref().and_then(|log| log.begin_request(&req, peer.ip, &request_id, peer.tls, trace));
        let mut x = Exchange {
            peer,
            request_id,
            note: entry.as_mut().map_or_else(Note::off, crate::obs::access_log::Pending::note),
            routing: self.routing.load_full(),
            route: None,
            host: None,
            path: None,
            client_ip: peer.ip,
            identity: None,
            tier_claim: None,
            held: None,
            on_trailers: None,
        };
        let mut resp = self.serve(req, &mut x).await;
        // The log step: every response goes through it once. Its entry is
        // sent when the body ends, or when it is dropped (so is a request
        // whose future is dropped before it has an answer).
        let Exchange { request_id, held, on_trailers, .. } = x;
        if self.client.request_id_in_response && matches!(resp.body(), Either::Left(_)) {
            // Replaces an upstream's own: one id for the client, the
            // upstream and the access log. tollgate's own answers (the
            // other side of the `Either`) were made with it: inserting it
            // again would hash its name once more on every refusal.
            resp.headers_mut().insert(request_id::X_REQUEST_ID, request_id);
        }
        self.metrics.request_duration_seconds.observe(started.elapsed().as_secs_f64());
        if let Some(e) = &mut entry {
            e.respond(resp.status().as_u16());
        }
        resp.map(|body| Logged::new(Holding::new(body, held, on_trailers), entry))
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
        self.access_log.as_ref()?.begin_raw(head, client::canonical(peer), request_id)
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

    /// The phases of one request, from its head to the head of its
    /// response. Only the store round, a shaping delay and the upstream
    /// wait: the rest is plain functions, and the upstream's future is
    /// awaited here rather than in a phase of its own, so that it is not
    /// copied once more on its way into the connection's future.
    async fn serve(&self, mut req: Request<Incoming>, x: &mut Exchange<'_>) -> Response<ProxyBody> {
        let rules = self.decider.rules().load();
        if let Err(e) = self.admit(&mut req, &rules, x) {
            return self.refuse(&req, x, e);
        }
        let mut d = Decision::new();
        if let Err(e) = self.decider.prepare(&rules, &self.facts(&req, &rules, x), self.asked(x), &mut d) {
            return self.refuse(&req, x, e);
        }
        // No clock read unless the request's span is recorded.
        let asked = x.note.traced().then(Instant::now);
        self.decider.decide(&mut d, &mut x.held).await;
        if x.note.enabled() {
            note_decision(x, &d, asked);
        }
        let delay = match d.ruling {
            Ruling::Admitted { delay } => delay,
            Ruling::Limited { .. } => return self.reject(&req, x, &d),
            Ruling::Unavailable => {
                return self.refuse(&req, x, ProxyError::StoreUnavailable { retry_after_seconds: 1 });
            }
        };
        let settling = d.stamp.map_or_else(Vec::new, |at| self.settling(&d, at));
        let Some(route) = x.route else {
            settle::own_answer(settling, ProxyError::NoRoute.status(), self.decider.store());
            let mut resp = self.refuse(&req, x, ProxyError::NoRoute);
            headers::write(resp.headers_mut(), &d.reports, headers::most_restrictive(&d.reports));
            return resp;
        };
        self.counters(x).allowed.inc();
        if delay > 0 {
            // Leaky bucket shaping: wait for this request's turn.
            tokio::time::sleep(Duration::from_nanos(delay)).await;
        }

        // Forward.
        let upstream = &x.routing.upstreams[x.routing.routes[route].0.upstream];
        let version = req.version();
        // For an answer of tollgate's own once the request has gone.
        let grpc = crate::wire::grpc::content_type(req.method(), req.headers()).cloned();
        // Taken before the request moves on: hyper completes the client's
        // side once the 101 has been written.
        let upgrade = tunnel::requested(&req).map(|protocol| (protocol, hyper::upgrade::on(&mut req)));
        let (upgrade, client_upgrade) = upgrade.unzip();
        // Noted before the request leaves, so that a client that goes away
        // while it is out still has its server logged; with several
        // servers, the one picked is noted once forwarding returns.
        let chosen = AtomicUsize::new(usize::MAX);
        if x.note.enabled()
            && upstream.servers() == 1
            && let Some(server) = upstream.server_authority(0)
        {
            x.note.upstream(server);
        }
        let (path, bytes_in) = (x.path.take(), x.note.bytes_in());
        let chosen_at = x.note.enabled().then_some(&chosen);
        let down = self.downstream(x, &x.routing.routes[route].0, version, path, upgrade, bytes_in, chosen_at);
        // No clock read for the access log when it is off.
        let sent = x.note.enabled().then(Instant::now);
        let result = upstream.forward(req, &down).await;
        if let Some(sent) = sent {
            x.note.upstream_answer(result.as_ref().ok().map(|r| r.status().as_u16()), sent.elapsed());
        }
        if let Some(server) = upstream.server_authority(chosen.load(Ordering::Relaxed)) {
            x.note.upstream(server);
        }
        let mut resp = match result {
            Ok(mut resp) => {
                self.answered(&mut resp, x, version, client_upgrade, settling);
                resp.map(Either::Left)
            }
            Err(e) => {
                settle::own_answer(settling, e.status(), self.decider.store());
                respond::own_answer(e, &x.request_id, grpc)
            }
        };
        headers::write(resp.headers_mut(), &d.reports, headers::most_restrictive(&d.reports));
        resp
    }

    /// `[client]`: how client addresses are keyed (the redirect listener
    /// reads its trusted proxies).
    pub fn client_config(&self) -> &ClientConfig {
        &self.client
    }

    /// The `/top` sketches, unless `[admin] top_keys = 0`.
    pub fn top(&self) -> Option<&TopKeys> {
        self.decider.top()
    }

    /// `[store] on_error`: what rules without their own policy do when the
    /// store fails.
    pub fn default_on_error(&self) -> OnError {
        self.decider.default_on_error()
    }

    /// The JWT verifier, when `[client] jwt` is set.
    pub fn jwt(&self) -> Option<&JwtVerifier> {
        self.jwt.as_ref()
    }

    /// In-flight requests to an upstream, by name (for tests and `explain`).
    pub fn upstream_inflight(&self, name: &str) -> Option<usize> {
        self.routing.load().upstreams.iter().find(|u| u.config.name == name).map(UpstreamClient::inflight)
    }

    /// Every upstream's name and its servers' states, in config order.
    pub fn upstream_states(&self) -> Vec<(String, Vec<crate::upstream::ServerState>)> {
        let routing = self.routing.load();
        routing.upstreams.iter().map(|u| (u.config.name.clone(), u.server_states())).collect()
    }

    /// Brings the gauges the request path does not set itself up to date,
    /// before metrics are rendered.
    pub fn refresh_gauges(&self) {
        self.routing.load().upstreams.iter().for_each(UpstreamClient::refresh_gauges);
    }
}
