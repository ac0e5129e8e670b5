//! Forwarding to upstreams (over [`crate::pool`]'s connections): hop-by-hop
//! headers, `X-Forwarded-*`, timeouts, and the request body limit.
//!
//! A request body up to the route's `buffer_body` is read whole before a
//! connection to the upstream is taken, so a slow client never holds one of
//! the upstream's workers; a larger body is streamed once that much has
//! arrived. Either way [`RequestBody`] enforces `max_body` and
//! `listen.body_read_timeout`, and time spent waiting on the client never
//! counts against the upstream's `timeout`. The upstream's response body goes
//! back untouched.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{PathAndQuery, Uri};
use http::{Request, Response, StatusCode, Version};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use prometheus::{IntCounter, IntGauge};
use tokio::time::{Instant, Sleep};

use crate::balance::Balancer;
use crate::client::Peer;
use crate::config::Upstream;
use crate::error::ProxyError;
use crate::health::Health;
use crate::metrics::Metrics;
use crate::pool::{Pool, PoolError, UpstreamBody};
use crate::tunnel;

/// Headers that describe one connection, not the message (RFC 9110 7.6.1):
/// never forwarded in either direction.
/// `Trailer` is not among them: it names the trailer fields of a message,
/// which pass through end to end (hyper writes only the trailer fields a
/// message declares).
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRANSFER_ENCODING,
    // An upgrade tollgate tunnels is asked for again (crate::tunnel).
    header::UPGRADE,
];
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");

/// The upstream connection's read buffer: the most read from the upstream
/// ahead of a client that is slow to take it (hyper's default grows to
/// about 400 KiB), and the largest response head accepted from an upstream
/// (nginx's default is 4 or 8 KiB).
pub const UPSTREAM_READ_BUFFER: usize = 16 * 1024;

/// One upstream: its servers, each with its own connection pool, health
/// and counters, and the error counters of the upstream as a whole.
pub struct UpstreamClient {
    pub config: Upstream,
    servers: Box<[UpstreamServer]>,
    /// One server and no health check: nothing to choose and nothing to
    /// watch, so requests take the path they took before upstreams had
    /// several servers, with no balancing or health work.
    single: bool,
    balancer: Balancer,
    unavailable: IntCounter,
    connect_errors: IntCounter,
    timeouts: IntCounter,
    resets: IntCounter,
    bad_bodies: IntCounter,
    body_timeouts: IntCounter,
    too_large: IntCounter,
}

/// One server of an upstream.
struct UpstreamServer {
    address: String,
    pool: Pool<RequestBody>,
    health: Arc<Health>,
    /// Requests sent to it; with `answered`, what it has in flight.
    requests: IntCounter,
    /// Requests that got their answer (or failed, or were abandoned).
    answered: AtomicU64,
    failures: IntCounter,
    /// `tollgate_upstream_server_inflight`, set from `requests` and
    /// `answered` when metrics are read ([`UpstreamClient::refresh_gauges`]):
    /// the request path pays two atomic additions per request either way,
    /// as it did for the in-flight count alone before there were
    /// per-server metrics.
    inflight_gauge: IntGauge,
}

impl UpstreamServer {
    /// Requests sent and not yet answered.
    fn inflight(&self) -> u64 {
        // `answered` first, so that it is seldom ahead of the `requests`
        // read after it; saturating for when it is.
        let answered = self.answered.load(Ordering::Relaxed);
        self.requests.get().saturating_sub(answered)
    }

    /// Counts a request sent to this server until the guard is dropped.
    fn start(&self) -> Answered<'_> {
        self.requests.inc();
        Answered(&self.answered)
    }
}

/// Counts a request as answered when dropped (whatever ended it).
struct Answered<'a>(&'a AtomicU64);

impl Drop for Answered<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

/// What [`UpstreamClient::forward`] needs to know about the client side.
pub struct Downstream<'a> {
    /// The socket peer.
    pub peer: &'a Peer,
    /// The client's address (after trusted proxies), which `hash_key =
    /// "ip"` hashes.
    pub client_ip: std::net::IpAddr,
    /// The host the client asked for, for `X-Forwarded-Host`.
    pub host: Option<&'a str>,
    /// The `Host` header to send instead of the client's: the host that was
    /// matched, when it came from the request target or was spelled
    /// differently (see [`crate::normalize::host`]).
    pub host_header: Option<HeaderValue>,
    /// The canonical path, when the client spelled it otherwise: the
    /// upstream receives the path the rules matched.
    pub path: Option<String>,
    /// The route's body limit.
    pub max_body: Option<u64>,
    /// The route's `buffer_body`.
    pub buffer_body: u64,
    /// `listen.body_read_timeout`.
    pub body_read_timeout: Duration,
    /// The protocol the client asked to switch to, when tollgate will
    /// tunnel it (see [`crate::tunnel::requested`]).
    pub upgrade: Option<HeaderValue>,
    /// Where the body bytes read from the client are counted, for the
    /// access log; `None` when it is off.
    pub bytes_in: Option<Arc<AtomicU64>>,
    /// Where the index of the server the request went to is noted (it
    /// starts at `usize::MAX`: none), for the access log; `None` when it is
    /// off.
    pub chosen: Option<&'a std::sync::atomic::AtomicUsize>,
}

impl UpstreamClient {
    /// Builds the pools and resolves every metric handle of `config`, and
    /// starts its servers' health checks.
    pub fn new(config: &Upstream, metrics: &Metrics) -> UpstreamClient {
        let name = config.name.as_str();
        let err = |kind: &str| metrics.upstream_errors_total.with_label_values(&[name, kind]);
        let client_err = |kind: &str| metrics.client_errors_total.with_label_values(&[kind]);
        let epoch = tokio::time::Instant::now();
        let servers: Box<[UpstreamServer]> = config
            .servers
            .iter()
            .map(|s| {
                let labels = [name, s.address.as_str()];
                let health = Arc::new(Health::new(metrics.upstream_server_healthy.with_label_values(&labels), epoch));
                if let Some(check) = &config.health_check {
                    crate::health::spawn_check(&health, s, check, config);
                }
                UpstreamServer {
                    address: s.address.clone(),
                    // A streaming body is bounded by the upstream's
                    // `timeout` between its pieces, like its head.
                    pool: Pool::for_server(config, s, UPSTREAM_READ_BUFFER)
                        .limit_silence(config.timeout, err("timeout")),
                    health,
                    requests: metrics.upstream_server_requests_total.with_label_values(&labels),
                    failures: metrics.upstream_server_failures_total.with_label_values(&labels),
                    answered: AtomicU64::new(0),
                    inflight_gauge: metrics.upstream_server_inflight.with_label_values(&labels),
                }
            })
            .collect();
        let single = servers.len() == 1 && config.health_check.is_none();
        let addresses: Vec<&str> = servers.iter().map(|s| s.address.as_str()).collect();
        UpstreamClient {
            balancer: Balancer::new(&config.balance, &addresses),
            config: config.clone(),
            servers,
            single,
            unavailable: metrics.upstream_unavailable_total.with_label_values(&[name]),
            connect_errors: err("connect"),
            timeouts: err("timeout"),
            resets: err("reset"),
            bad_bodies: client_err("bad_body"),
            body_timeouts: client_err("body_read_timeout"),
            too_large: client_err("body_too_large"),
        }
    }

    /// How many servers the upstream has.
    pub fn servers(&self) -> usize {
        self.servers.len()
    }

    /// The address (as the access log shows it) of server `i`.
    pub fn server_authority(&self, i: usize) -> Option<&http::uri::Authority> {
        self.config.servers.get(i).map(|s| &s.authority)
    }

    /// Requests being forwarded to this upstream right now (elastic
    /// throttling reads it).
    pub fn inflight(&self) -> usize {
        self.servers.iter().map(UpstreamServer::inflight).sum::<u64>() as usize
    }

    /// Sets each server's in-flight gauge, for a metrics scrape.
    pub fn refresh_gauges(&self) {
        for s in &self.servers {
            s.inflight_gauge.set(s.inflight() as i64);
        }
    }

    /// Sends `req` to this upstream and returns its response head with the
    /// body still streaming.
    pub async fn forward(
        &self,
        req: Request<Incoming>,
        mut down: Downstream<'_>,
    ) -> Result<Response<UpstreamBody<RequestBody>>, ProxyError> {
        let (mut parts, body) = req.into_parts();
        let invalid = || ProxyError::BadRequest("The request target is not a valid path.".into());
        let pq = match (&down.path, parts.uri.query()) {
            (Some(path), Some(query)) => PathAndQuery::try_from(format!("{}{path}?{query}", self.config.base_path)),
            (Some(path), None) => PathAndQuery::try_from(format!("{}{path}", self.config.base_path)),
            // The client's target, parsed already: shared, not parsed again.
            (None, _) if self.config.base_path.is_empty() => {
                Ok(parts.uri.path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/")))
            }
            (None, _) => {
                let pq = parts.uri.path_and_query().map_or("/", |p| p.as_str());
                PathAndQuery::try_from(format!("{}{}", self.config.base_path, pq))
            }
        }
        .map_err(|_| invalid())?;
        // Origin form, as an origin server expects it.
        parts.uri = Uri::from(pq);

        // A client that takes trailers gets the upstream's: tollgate relays
        // them (the codings `TE` may also name are hop-by-hop, not passed).
        if strip_hop_by_hop(&mut parts.headers) {
            parts.headers.insert(header::TE, HeaderValue::from_static("trailers"));
        }
        // HTTP/2 has no Upgrade: to an h2 upstream the request goes as a
        // plain one.
        let upgrade = down.upgrade.take().filter(|_| self.config.protocol == crate::config::Protocol::Http1);
        let upgrading = upgrade.is_some();
        if let Some(protocol) = upgrade {
            tunnel::ask_upstream(&mut parts.headers, protocol);
        }
        // The host that was matched goes to the upstream (virtual hosts
        // behind the proxy keep working): the client's Host, or the
        // target's authority (absolute form, HTTP/2's :authority).
        if let Some(h) = down.host_header.take() {
            parts.headers.insert(header::HOST, h);
        }
        set_forwarded(&mut parts.headers, down.peer, down.host);
        crate::via::append(&mut parts.headers, parts.version);
        // The pool speaks HTTP/1.1 to upstreams whatever the client
        // spoke to us.
        parts.version = Version::HTTP_11;

        let watch = Arc::new(BodyWatch::default());
        let body = RequestBody::new(body, &down, watch.clone());
        // Read ahead before anything is sent: a body that ends within
        // `buffer_body` reaches the upstream whole.
        let body = match body.read_ahead(down.buffer_body).await {
            Ok(b) => b,
            Err(e) => return Err(self.client_error(e)),
        };
        let req = Request::from_parts(parts, body);
        if !self.single {
            // Boxed: the single-server path's future stays as small as it
            // was before upstreams had several servers.
            return Box::pin(self.forward_balanced(req, &down, &watch, upgrading)).await;
        }
        let server = &self.servers[0];
        if let Some(chosen) = down.chosen {
            chosen.store(0, Ordering::Relaxed);
        }
        let _answered = server.start();
        let (mut timer, started) = request_timer(self.config.timeout);
        let result = tokio::select! {
            // The upstream first: no random draw per poll.
            biased;
            r = server.pool.send(req) => Some(r),
            () = upstream_deadline(&mut timer, started, self.config.timeout, &watch) => None,
        };
        match result {
            Some(Ok(mut resp)) => {
                resp.body_mut().keep_timer(timer);
                self.response_head(resp, upgrading)
            }
            // The client's body failed (too large, malformed, too slow)
            // before the upstream answered: the client's fault, not the
            // upstream's.
            Some(Err(_)) if watch.failure().is_some() => {
                Err(self.client_error(watch.failure().unwrap_or(BodyFailure::Malformed)))
            }
            Some(Err(e)) => Err(self.upstream_error(server, Some(&e))),
            None => Err(self.upstream_error(server, None)),
        }
    }

    /// [`UpstreamClient::forward`] over several servers, or with health
    /// checks: picks a server that is up, and tries a second one when the
    /// first could not take the request.
    async fn forward_balanced(
        &self,
        mut req: Request<RequestBody>,
        down: &Downstream<'_>,
        watch: &Arc<BodyWatch>,
        upgrading: bool,
    ) -> Result<Response<UpstreamBody<RequestBody>>, ProxyError> {
        let n = self.servers.len();
        // One clock reading for every server (they share an epoch).
        let now = self.servers[0].health.now_ms();
        let up = |i: usize| self.servers[i].health.is_up(now);
        let load = |i: usize| self.servers[i].inflight();
        let key = self.balancer.key(down.client_ip, req.headers());
        let Some(mut i) = self.balancer.pick(n, key, None, up, load) else {
            self.unavailable.inc();
            tracing::warn!(upstream = %self.config.name, "every server of the upstream is out");
            return Err(ProxyError::UpstreamUnavailable);
        };
        // What a request that may have reached a server is sent again
        // from: an idempotent request without a body (a streamed body
        // cannot be replayed, and a server may have acted on any body).
        let replay = (n > 1 && idempotent(req.method()) && req.body().is_end_stream())
            .then(|| (req.method().clone(), req.uri().clone(), req.headers().clone()));
        let mut retried = false;
        // One deadline for every try.
        let (mut timer, started) = request_timer(self.config.timeout);
        loop {
            let server = &self.servers[i];
            if let Some(chosen) = down.chosen {
                chosen.store(i, Ordering::Relaxed);
            }
            let result = {
                let _answered = server.start();
                tokio::select! {
                    biased;
                    r = server.pool.try_send(req) => Some(r),
                    () = upstream_deadline(&mut timer, started, self.config.timeout, watch) => None,
                }
            };
            let (e, unsent) = match result {
                Some(Ok(mut resp)) => {
                    server.health.succeeded();
                    resp.body_mut().keep_timer(timer);
                    return self.response_head(resp, upgrading);
                }
                Some(Err(_)) if watch.failure().is_some() => {
                    return Err(self.client_error(watch.failure().unwrap_or(BodyFailure::Malformed)));
                }
                // Out of time: no second try.
                None => return Err(self.upstream_error(server, None)),
                Some(Err((e, unsent))) => (e, unsent),
            };
            let answer = self.upstream_error(server, Some(&e));
            if retried {
                return Err(answer);
            }
            // Unsent (the connection failed first): any request may go
            // elsewhere. Sent: only one that can be replayed.
            let again = unsent.or_else(|| {
                replay.as_ref().map(|(method, uri, headers)| {
                    let mut r = Request::new(RequestBody::empty(watch.clone()));
                    *r.method_mut() = method.clone();
                    *r.uri_mut() = uri.clone();
                    *r.headers_mut() = headers.clone();
                    r
                })
            });
            let Some(again) = again else { return Err(answer) };
            let Some(next) = self.balancer.pick(n, key, Some(i), up, load) else { return Err(answer) };
            tracing::info!(upstream = %self.config.name, from = %server.address, to = %self.servers[next].address, "retrying on another server");
            (req, i, retried) = (again, next, true);
        }
    }

    /// The upstream's response head as the client gets it: without its
    /// hop-by-hop headers, except the `Upgrade` of a switch the client
    /// asked for (`upgrading`).
    fn response_head(
        &self,
        mut resp: Response<UpstreamBody<RequestBody>>,
        upgrading: bool,
    ) -> Result<Response<UpstreamBody<RequestBody>>, ProxyError> {
        let version = resp.version();
        if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
            strip_hop_by_hop(resp.headers_mut());
            crate::via::append(resp.headers_mut(), version);
            return Ok(resp);
        }
        // A switch nobody asked for would leave the client reading a
        // protocol it does not speak.
        if !upgrading {
            self.resets.inc();
            tracing::warn!(upstream = %self.config.name, "upstream switched protocols unasked");
            return Err(ProxyError::BadGateway);
        }
        let protocol = resp.headers().get(header::UPGRADE).cloned();
        strip_hop_by_hop(resp.headers_mut());
        crate::via::append(resp.headers_mut(), version);
        tunnel::answer_client(resp.headers_mut(), protocol);
        Ok(resp)
    }

    /// Counts and logs a failed upstream call (`None`: out of time) and
    /// names its answer; the server is taken out for a while, unless it is
    /// the only one and unchecked.
    fn upstream_error(&self, server: &UpstreamServer, e: Option<&PoolError>) -> ProxyError {
        server.failures.inc();
        if !self.single {
            server.health.failed();
        }
        let name = &self.config.name;
        let address = &server.address;
        match e {
            None => {
                self.timeouts.inc();
                tracing::warn!(upstream = %name, server = %address, "upstream timed out");
                ProxyError::GatewayTimeout
            }
            Some(e @ PoolError::Connect(_)) if is_timeout(e) => {
                self.timeouts.inc();
                tracing::warn!(upstream = %name, server = %address, "upstream connect timed out");
                ProxyError::GatewayTimeout
            }
            Some(e @ PoolError::Connect(_)) => {
                self.connect_errors.inc();
                tracing::warn!(upstream = %name, server = %address, error = %e, "upstream connect failed");
                ProxyError::BadGateway
            }
            Some(e) => {
                self.resets.inc();
                tracing::warn!(upstream = %name, server = %address, error = %e, "upstream request failed");
                ProxyError::BadGateway
            }
        }
    }

    /// Counts a request whose body failed on the client's side and names
    /// its answer.
    fn client_error(&self, failure: BodyFailure) -> ProxyError {
        match failure {
            BodyFailure::TooLarge => {
                self.too_large.inc();
                ProxyError::PayloadTooLarge
            }
            BodyFailure::Malformed => {
                self.bad_bodies.inc();
                ProxyError::BadRequest("The request body is malformed or was cut short.".into())
            }
            BodyFailure::Timeout => {
                self.body_timeouts.inc();
                ProxyError::RequestTimeout
            }
        }
    }
}

/// Methods whose request can be sent twice with the effect of once (RFC
/// 9110 9.2.2).
fn idempotent(method: &http::Method) -> bool {
    use http::Method;
    [Method::GET, Method::HEAD, Method::OPTIONS, Method::TRACE, Method::PUT, Method::DELETE].contains(method)
}

/// Completes once the upstream has had `timeout` to answer, not counting
/// the time spent waiting for the client's body.
///
/// `timer` is the request's one timer: armed here for the response head,
/// then handed to the response body as its silence timer
/// ([`UpstreamBody::keep_timer`]), so that a forwarded request registers
/// one timer with the runtime, not two (each registration and removal
/// takes the timer wheel's lock).
async fn upstream_deadline(timer: &mut Pin<Box<Sleep>>, started: Instant, timeout: Duration, watch: &BodyWatch) {
    // One clock read for the common case (the upstream answers before the
    // first deadline, read by the caller): a read costs tens of
    // nanoseconds on a virtual machine, and every forwarded request pays
    // it.
    let mut now = started;
    loop {
        let deadline = started + timeout + watch.client_wait(now);
        if deadline <= now {
            return;
        }
        if deadline != timer.deadline() {
            timer.as_mut().reset(deadline);
        }
        timer.as_mut().await;
        now = Instant::now();
    }
}

/// The timer [`upstream_deadline`] runs on, due at `started + timeout`.
fn request_timer(timeout: Duration) -> (Pin<Box<Sleep>>, Instant) {
    let started = Instant::now();
    (Box::pin(tokio::time::sleep_until(started + timeout)), started)
}

/// Why a request body failed on the client's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFailure {
    /// More than the route's `max_body`.
    TooLarge,
    /// Bad chunked framing, or the client closed the connection mid-body.
    Malformed,
    /// Nothing arrived for `listen.body_read_timeout`.
    Timeout,
}

/// What the forwarding side learns about a [`RequestBody`] it handed to the
/// pool: how it failed, and how long it waited on the client.
#[derive(Debug, Default)]
pub struct BodyWatch {
    failure: AtomicU8,
    /// Time spent waiting on the client so far, and since when it has been
    /// waiting now.
    waiting: Mutex<(Duration, Option<Instant>)>,
}

impl BodyWatch {
    fn fail(&self, f: BodyFailure) {
        let code = match f {
            BodyFailure::TooLarge => 1,
            BodyFailure::Malformed => 2,
            BodyFailure::Timeout => 3,
        };
        self.failure.store(code, Ordering::Relaxed);
    }

    fn failure(&self) -> Option<BodyFailure> {
        match self.failure.load(Ordering::Relaxed) {
            1 => Some(BodyFailure::TooLarge),
            2 => Some(BodyFailure::Malformed),
            3 => Some(BodyFailure::Timeout),
            _ => None,
        }
    }

    fn client_wait(&self, now: Instant) -> Duration {
        let w = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        w.0 + w.1.map_or(Duration::ZERO, |since| now.saturating_duration_since(since))
    }

    fn start_waiting(&self) {
        let mut w = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        if w.1.is_none() {
            w.1 = Some(Instant::now());
        }
    }

    fn stop_waiting(&self) {
        let mut w = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(since) = w.1.take() {
            w.0 += since.elapsed();
        }
    }
}

/// The client's request body on its way upstream: frames read ahead
/// first, then the rest of the client's body as it arrives (if any). Fails
/// once the body exceeds the route's `max_body`, when its framing is
/// broken, or when the client sends nothing for `body_read_timeout`;
/// [`BodyWatch`] tells the forwarding side which.
pub struct RequestBody {
    ahead: VecDeque<Frame<Bytes>>,
    /// `None` once the client's body has ended.
    rest: Option<Incoming>,
    remaining: Option<u64>,
    read_timeout: Duration,
    /// Armed while waiting for the client.
    timer: Option<Pin<Box<Sleep>>>,
    watch: Arc<BodyWatch>,
    /// See [`Downstream::bytes_in`].
    bytes_in: Option<Arc<AtomicU64>>,
}

/// The error a [`RequestBody`] ends with; [`BodyWatch`] says why.
#[derive(Debug, thiserror::Error)]
#[error("the client's request body failed: {0:?}")]
pub struct BodyFailed(BodyFailure);

impl RequestBody {
    fn new(inner: Incoming, down: &Downstream<'_>, watch: Arc<BodyWatch>) -> RequestBody {
        let rest = (!inner.is_end_stream()).then_some(inner);
        RequestBody {
            ahead: VecDeque::new(),
            rest,
            remaining: down.max_body,
            read_timeout: down.body_read_timeout,
            timer: None,
            watch,
            bytes_in: down.bytes_in.clone(),
        }
    }

    /// A body that has ended: what a request without a body is sent again
    /// with.
    fn empty(watch: Arc<BodyWatch>) -> RequestBody {
        RequestBody {
            ahead: VecDeque::new(),
            rest: None,
            remaining: None,
            read_timeout: Duration::ZERO,
            timer: None,
            watch,
            bytes_in: None,
        }
    }

    /// Reads the body until it ends or more than `limit` bytes have arrived.
    /// A body that declares a larger length is not read ahead at all.
    async fn read_ahead(mut self, limit: u64) -> Result<RequestBody, BodyFailure> {
        let mut total: u64 = 0;
        while limit > 0 && total <= limit {
            let Some(rest) = self.rest.as_mut() else { break };
            if rest.size_hint().lower().saturating_add(total) > limit {
                break;
            }
            match tokio::time::timeout(self.read_timeout, rest.frame()).await {
                Err(_) => return Err(BodyFailure::Timeout),
                Ok(None) => self.rest = None,
                Ok(Some(Err(_))) => return Err(BodyFailure::Malformed),
                Ok(Some(Ok(frame))) => {
                    let len = frame.data_ref().map_or(0, |d| d.len() as u64);
                    self.take(len)?;
                    total += len;
                    self.ahead.push_back(frame);
                    if self.rest.as_ref().is_some_and(Incoming::is_end_stream) {
                        self.rest = None;
                    }
                }
            }
        }
        Ok(self)
    }

    /// Counts `len` bytes against `max_body`.
    fn take(&mut self, len: u64) -> Result<(), BodyFailure> {
        if let Some(n) = &self.bytes_in {
            n.fetch_add(len, Ordering::Relaxed);
        }
        if let Some(remaining) = self.remaining {
            if len > remaining {
                return Err(BodyFailure::TooLarge);
            }
            self.remaining = Some(remaining - len);
        }
        Ok(())
    }

    fn failed(&mut self, f: BodyFailure) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.watch.stop_waiting();
        self.watch.fail(f);
        self.rest = None;
        self.timer = None;
        Poll::Ready(Some(Err(Box::new(BodyFailed(f)))))
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl Body for RequestBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(frame) = self.ahead.pop_front() {
            return Poll::Ready(Some(Ok(frame)));
        }
        let Some(rest) = self.rest.as_mut() else { return Poll::Ready(None) };
        match Pin::new(rest).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                self.watch.stop_waiting();
                self.timer = None;
                if let Err(f) = self.take(frame.data_ref().map_or(0, |d| d.len() as u64)) {
                    return self.failed(f);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(_))) => self.failed(BodyFailure::Malformed),
            Poll::Ready(None) => {
                self.watch.stop_waiting();
                self.rest = None;
                self.timer = None;
                Poll::Ready(None)
            }
            Poll::Pending => {
                self.watch.start_waiting();
                let timeout = self.read_timeout;
                let timer = self.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                if timer.as_mut().poll(cx).is_ready() {
                    return self.failed(BodyFailure::Timeout);
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ahead.is_empty() && self.rest.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        let ahead: u64 = self.ahead.iter().filter_map(|f| f.data_ref()).map(|d| d.len() as u64).sum();
        match &self.rest {
            // Read whole, with trailers: chunked, the only framing that
            // carries them.
            None if self.ahead.back().is_some_and(Frame::is_trailers) => {
                let mut hint = SizeHint::new();
                hint.set_lower(ahead);
                hint
            }
            // Read whole: the upstream gets a Content-Length.
            None => SizeHint::with_exact(ahead),
            Some(rest) => {
                let r = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(r.lower().saturating_add(ahead));
                if let Some(upper) = r.upper() {
                    hint.set_upper(upper.saturating_add(ahead));
                }
                hint
            }
        }
    }
}

/// Whether the request's `Transfer-Encoding` names a coding other than
/// `chunked`. hyper decodes only `chunked`, and the header is hop-by-hop:
/// forwarding such a body would silently drop its other codings (a gzip body
/// would reach the upstream as if it were plain), so it is refused instead.
pub fn undecodable_transfer_coding(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(<[u8]>::trim_ascii)
        .any(|coding| !coding.is_empty() && !coding.eq_ignore_ascii_case(b"chunked"))
}

/// Removes the hop-by-hop headers; says whether `TE` accepted `trailers`
/// (the next hop may then be told that tollgate does too).
fn strip_hop_by_hop(headers: &mut HeaderMap) -> bool {
    // Most messages carry none of these: one pass over the names they do
    // carry is much cheaper than looking each of ten names up (every
    // lookup hashes the name).
    if !headers.keys().any(|n| HOP_BY_HOP.contains(n)) {
        return false;
    }
    let trailers = headers
        .get_all(header::TE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.split(';').next().is_some_and(|t| t.trim().eq_ignore_ascii_case("trailers")));
    // Headers named in Connection are hop-by-hop too.
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for name in named.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(name);
    }
    trailers
}

/// `X-Forwarded-For` gets the peer appended when the peer is a trusted
/// proxy (all of its lines, joined in order, as the limiter reads them), and
/// is replaced by the peer otherwise: an untrusted client's claim about who
/// it is must not reach the upstream either, so its `Forwarded` and
/// `X-Real-IP` are dropped too. Likewise for `-Proto` and `-Host`.
fn set_forwarded(headers: &mut HeaderMap, peer: &Peer, host: Option<&str>) {
    // Which of the headers are there, in one pass over the names (as in
    // `strip_hop_by_hop`): removing a header that is not there costs a
    // lookup all the same.
    let (mut xff, mut forwarded, mut real_ip, mut proto, mut fhost) = (false, false, false, false, false);
    for name in headers.keys() {
        if *name == X_FORWARDED_FOR {
            xff = true;
        } else if *name == header::FORWARDED {
            forwarded = true;
        } else if *name == X_REAL_IP {
            real_ip = true;
        } else if *name == X_FORWARDED_PROTO {
            proto = true;
        } else if *name == X_FORWARDED_HOST {
            fhost = true;
        }
    }
    let trusted = peer.trusted;
    let mut joined: Vec<u8> = Vec::new();
    if trusted && xff {
        for line in headers.get_all(&X_FORWARDED_FOR) {
            let line = line.as_bytes().trim_ascii();
            if !line.is_empty() {
                if !joined.is_empty() {
                    joined.extend_from_slice(b", ");
                }
                joined.extend_from_slice(line);
            }
        }
    }
    let value = if joined.is_empty() {
        peer.forwarded_for.clone()
    } else {
        joined.extend_from_slice(b", ");
        joined.extend_from_slice(peer.forwarded_for.as_bytes());
        // Made of header values and an address: always a valid value.
        HeaderValue::from_bytes(&joined).unwrap_or_else(|_| peer.forwarded_for.clone())
    };
    // `insert` replaces every line already there.
    headers.insert(X_FORWARDED_FOR, value);
    if !trusted {
        if forwarded {
            headers.remove(header::FORWARDED);
        }
        if real_ip {
            headers.remove(&X_REAL_IP);
        }
    }
    if !trusted || !proto {
        headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static(if peer.https { "https" } else { "http" }));
    }
    if !trusted || !fhost {
        match host.and_then(|h| HeaderValue::from_str(h).ok()) {
            Some(v) => {
                headers.insert(X_FORWARDED_HOST, v);
            }
            None if fhost => {
                headers.remove(&X_FORWARDED_HOST);
            }
            None => {}
        }
    }
}

fn is_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::TimedOut
        {
            return true;
        }
        if err.to_string().contains("timed out") {
            return true;
        }
        cur = err.source();
    }
    false
}
