//! One upstream's servers and the tries a request makes on them: which
//! servers are in service, when a failing one is taken out (and when it
//! may not be), retries on other servers within one deadline and a retry
//! budget, per-server limits, and what each failure is answered with.
//!
//! Servers stay in service unless they are really down, as Envoy's
//! outlier detection keeps them:
//! - a server is taken out only after `eject_after` failures in a row, and
//!   never more than `max_ejected_percent` of the servers (of the primaries,
//!   or of the backups) at once; a lone server, or the last one in, never
//!   ([`UpstreamClient::may_eject`]);
//! - when fewer servers are in than that cap allows (active health checks
//!   took them out), requests go to all of them: panic mode, because a
//!   guess that leaves some servers overloaded serves more than a refusal;
//! - backup servers take requests only while every other server is out;
//! - a failure of tollgate's own (out of file descriptors or ports) is
//!   never held against a server.
//!
//! An upstream with one server and no health check or limit takes a short
//! path ([`UpstreamClient::forward`]) with no health or balancing work.

pub mod balance;
pub mod forward;
pub mod health;
pub mod pool;
pub mod tunnel;

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use prometheus::{IntCounter, IntGauge};
use tokio::time::{Instant, Sleep};

use crate::config::Upstream;
use crate::obs::metrics::Metrics;
use crate::upstream::balance::Balancer;
use crate::upstream::forward::{BodyFailure, BodyWatch, Downstream, RequestBody, UPSTREAM_READ_BUFFER};
use crate::upstream::health::Health;
use crate::upstream::pool::{Answered, Pool, PoolError, UpstreamBody};
use crate::wire::error::ProxyError;

mod choice;
use choice::{NoServer, RetryGuard, Tried};

/// One upstream: its servers, each with its own connection pool, health
/// and counters, and the error counters of the upstream as a whole.
pub struct UpstreamClient {
    pub config: Upstream,
    servers: Box<[Arc<UpstreamServer>]>,
    /// One server, no health check and no `max_inflight`: nothing to
    /// choose and nothing to watch.
    single: bool,
    balancer: Balancer,
    /// Taken while deciding whether a server may go out, so that two
    /// failures at once cannot both pass the cap.
    ejecting: Mutex<()>,
    /// Retries in flight, against the retry budget.
    retrying: AtomicU64,
    counters: Counters,
}

/// The upstream's own counters (its servers have theirs).
struct Counters {
    unavailable: IntCounter,
    busy: IntCounter,
    panic: IntCounter,
    retries: IntCounter,
    budget_exhausted: IntCounter,
    connect_errors: IntCounter,
    timeouts: IntCounter,
    resets: IntCounter,
    local: IntCounter,
    bad_bodies: IntCounter,
    body_timeouts: IntCounter,
    too_large: IntCounter,
}

/// One server of an upstream; shared with the next configuration when a
/// reload leaves the server as it was, so its health, backoff and pooled
/// connections carry over.
struct UpstreamServer {
    address: String,
    pool: Pool<RequestBody>,
    health: Arc<Health>,
    /// Requests sent to it; with `answered`, what it has in flight.
    requests: IntCounter,
    /// Requests whose response has ended (or failed, or was abandoned).
    answered: Arc<AtomicU64>,
    failures: IntCounter,
    /// `tollgate_upstream_server_inflight`, set from `requests` and
    /// `answered` when metrics are read ([`UpstreamClient::refresh_gauges`]).
    inflight_gauge: IntGauge,
}

impl UpstreamServer {
    fn new(config: &Upstream, i: usize, metrics: &Metrics, epoch: Instant) -> UpstreamServer {
        let s = &config.servers[i];
        let labels = [config.name.as_str(), s.address.as_str()];
        let health = Arc::new(Health::new(metrics.upstream_server_healthy.with_label_values(&labels), epoch));
        if let Some(check) = &config.health_check {
            crate::upstream::health::spawn_check(&health, s, check, config);
        }
        let timeouts = metrics.upstream_errors_total.with_label_values(&[config.name.as_str(), "timeout"]);
        UpstreamServer {
            address: s.address.clone(),
            // A streaming body is bounded by the upstream's `timeout`
            // between its pieces, like its head.
            pool: Pool::for_server(config, s, UPSTREAM_READ_BUFFER).limit_silence(config.timeout, timeouts),
            health,
            requests: metrics.upstream_server_requests_total.with_label_values(&labels),
            failures: metrics.upstream_server_failures_total.with_label_values(&labels),
            answered: Arc::new(AtomicU64::new(0)),
            inflight_gauge: metrics.upstream_server_inflight.with_label_values(&labels),
        }
    }

    /// Requests sent and not yet answered.
    fn inflight(&self) -> u64 {
        // `answered` first, so that it is seldom ahead of the `requests`
        // read after it; saturating for when it is.
        let answered = self.answered.load(Ordering::Relaxed);
        self.requests.get().saturating_sub(answered)
    }

    /// Counts a request sent to this server until the guard is dropped.
    fn start(&self) -> Answered {
        self.requests.inc();
        Answered(self.answered.clone())
    }
}

impl UpstreamClient {
    /// Builds the pools and resolves every metric handle of `config`, and
    /// starts its servers' health checks. Servers that `previous` (the
    /// configuration being replaced) had with the same definition are
    /// taken over as they are.
    pub fn new(config: &Upstream, metrics: &Metrics, ipv6_prefix: u8, previous: Option<&UpstreamClient>) -> Self {
        let name = config.name.as_str();
        let err = |kind: &str| metrics.upstream_errors_total.with_label_values(&[name, kind]);
        let client_err = |kind: &str| metrics.client_errors_total.with_label_values(&[kind]);
        let up = |m: &prometheus::IntCounterVec| m.with_label_values(&[name]);
        // Every server of an upstream shares one epoch, so one clock read
        // serves them all: kept servers keep theirs.
        let epoch = previous.and_then(|p| p.servers.first()).map_or_else(Instant::now, |s| s.health.epoch());
        let servers: Box<[Arc<UpstreamServer>]> = (0..config.servers.len())
            .map(|i| {
                let address = &config.servers[i].address;
                let kept = previous.filter(|p| p.config.same_server(config, address)).and_then(|p| {
                    p.servers.iter().find(|s| s.address == *address && s.health.epoch() == epoch).cloned()
                });
                kept.unwrap_or_else(|| Arc::new(UpstreamServer::new(config, i, metrics, epoch)))
            })
            .collect();
        let single = servers.len() == 1 && config.health_check.is_none() && config.max_inflight.is_none();
        UpstreamClient {
            balancer: Balancer::new(&config.balance, &config.servers, ipv6_prefix),
            config: config.clone(),
            servers,
            single,
            ejecting: Mutex::new(()),
            retrying: AtomicU64::new(0),
            counters: Counters {
                unavailable: up(&metrics.upstream_unavailable_total),
                busy: up(&metrics.upstream_busy_total),
                panic: up(&metrics.upstream_panic_total),
                retries: up(&metrics.upstream_retries_total),
                budget_exhausted: up(&metrics.upstream_retry_budget_exhausted_total),
                connect_errors: err("connect"),
                timeouts: err("timeout"),
                resets: err("reset"),
                local: err("local"),
                bad_bodies: client_err("bad_body"),
                body_timeouts: client_err("body_read_timeout"),
                too_large: client_err("body_too_large"),
            },
        }
    }

    /// How many servers the upstream has.
    pub fn servers(&self) -> usize {
        self.servers.len()
    }

    /// The configured addresses of its servers (their metric labels).
    pub fn addresses(&self) -> impl Iterator<Item = &str> {
        self.servers.iter().map(|s| s.address.as_str())
    }

    /// The address (as the access log shows it) of server `i`.
    pub fn server_authority(&self, i: usize) -> Option<&http::uri::Authority> {
        self.config.servers.get(i).map(|s| &s.authority)
    }

    /// Requests being forwarded to this upstream right now, their response
    /// bodies included (elastic throttling reads it).
    pub fn inflight(&self) -> usize {
        self.servers.iter().map(|s| s.inflight()).sum::<u64>() as usize
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
        down: &Downstream<'_>,
    ) -> Result<Response<UpstreamBody<RequestBody>>, ProxyError> {
        let (mut parts, body) = req.into_parts();
        // Copied before `prepare` adds tollgate's headers: the client's
        // head is the smaller one, and it is prepared again only when sent
        // again.
        let client_head = idempotent(&parts.method).then(|| ClientHead::of(&parts));
        let upgrading = forward::prepare(&mut parts, down, &self.config)?;
        let watch = Arc::new(BodyWatch::default());
        let body = RequestBody::new(body, down, watch.clone());
        // Read ahead before anything is sent: a body that ends within
        // `buffer_body` reaches the upstream whole.
        let body = match body.read_ahead(down.buffer_body).await {
            Ok(b) => b,
            Err(e) => return Err(self.client_error(e)),
        };
        let mut replay = client_head.and_then(|head| Some(Replay { head, body: body.replica()? }));
        let req = Request::from_parts(parts, body);
        if !self.single {
            // Boxed: the single-server path's future stays small.
            return Box::pin(self.forward_balanced(req, replay, down, &watch, upgrading)).await;
        }
        let server = &self.servers[0];
        if let Some(chosen) = down.chosen {
            chosen.store(0, Ordering::Relaxed);
        }
        let answered = server.start();
        let (mut timer, started) = request_timer(self.config.timeout);
        let result = tokio::select! {
            // The upstream first: no random draw per poll.
            biased;
            r = server.pool.try_send(req, || replay.take().and_then(|r| r.request(down, &self.config))) => Some(r),
            () = upstream_deadline(&mut timer, started, self.config.timeout, &watch) => None,
        };
        match result {
            Some(Ok(mut resp)) => {
                resp.body_mut().keep_timer(timer);
                resp.body_mut().count_until_end(answered);
                forward::response_head(resp, upgrading, &self.config.name, &self.counters.resets)
            }
            // The client's body failed (too large, malformed, too slow)
            // before the upstream answered: the client's fault, not the
            // upstream's.
            Some(Err(_)) if watch.failure().is_some() => {
                Err(self.client_error(watch.failure().unwrap_or(BodyFailure::Malformed)))
            }
            Some(Err((e, _))) => Err(self.upstream_error_at(0, Some(&e))),
            None => {
                server.pool.discard_h2();
                Err(self.upstream_error_at(0, None))
            }
        }
    }

    /// [`UpstreamClient::forward`] over several servers, or with health
    /// checks or limits: picks a server in service, and tries others (up
    /// to `retries`) when one could not take the request, all within the
    /// request's one deadline.
    async fn forward_balanced(
        &self,
        mut req: Request<RequestBody>,
        replay: Option<Replay>,
        down: &Downstream<'_>,
        watch: &Arc<BodyWatch>,
        upgrading: bool,
    ) -> Result<Response<UpstreamBody<RequestBody>>, ProxyError> {
        let key = self.balancer.key(down.client_ip, req.headers());
        let mut tried = Tried::default();
        let mut i = match self.pick(key, &tried) {
            Ok(i) => i,
            Err(NoServer::Busy) => {
                self.counters.busy.inc();
                return Err(ProxyError::UpstreamBusy);
            }
            Err(NoServer::None) => {
                self.counters.unavailable.inc();
                tracing::warn!(upstream = %self.config.name, "no server of the upstream can take requests");
                return Err(ProxyError::UpstreamUnavailable);
            }
        };
        let mut retry: Option<RetryGuard<'_>> = None;
        // One deadline for every try.
        let (mut timer, started) = request_timer(self.config.timeout);
        loop {
            tried.push(i);
            let server = &self.servers[i];
            if let Some(chosen) = down.chosen {
                chosen.store(i, Ordering::Relaxed);
            }
            let answered = server.start();
            // A try of a request that can be sent again ends at
            // `try_timeout`, leaving the rest of the deadline to others.
            let try_ends = self.config.try_timeout.filter(|_| replay.is_some()).map(|t| Instant::now() + t);
            let result = tokio::select! {
                biased;
                r = server.pool.try_send(req, || replay.as_ref().and_then(Replay::copy).and_then(|r| r.request(down, &self.config))) => Some(r),
                () = upstream_deadline(&mut timer, started, self.config.timeout, watch) => None,
                () = until(try_ends) => Some(Err((PoolError::TryTimeout, None))),
            };
            let (e, unsent) = match result {
                Some(Ok(mut resp)) => {
                    // A 502-504 of the server's own is a failure of it,
                    // relayed as it is.
                    if is_server_failure(resp.status()) {
                        self.failed(i);
                    } else {
                        server.health.succeeded();
                    }
                    resp.body_mut().keep_timer(timer);
                    resp.body_mut().count_until_end(answered);
                    return forward::response_head(resp, upgrading, &self.config.name, &self.counters.resets);
                }
                Some(Err(_)) if watch.failure().is_some() => {
                    return Err(self.client_error(watch.failure().unwrap_or(BodyFailure::Malformed)));
                }
                // Out of time: the deadline is spent for every server.
                None => {
                    server.pool.discard_h2();
                    return Err(self.upstream_error_at(i, None));
                }
                Some(Err((e, unsent))) => (e, unsent),
            };
            let answer = self.upstream_error_at(i, Some(&e));
            drop(retry.take());
            if tried.len > self.config.retries as usize {
                return Err(answer);
            }
            // Unsent (the connection failed first): any request may go
            // elsewhere. Sent: only one that can be replayed.
            let again = match unsent {
                Some(unsent) => Some(*unsent),
                None => replay.as_ref().and_then(Replay::copy).and_then(|r| r.request(down, &self.config)),
            };
            let Some(again) = again else { return Err(answer) };
            // When every server in service has been tried, those out of
            // service are the last resort: a health check's verdict is
            // seconds old, the answer of a server that may be up beats an
            // error that is certain.
            let next = self.pick(key, &tried).or_else(|_| self.pick_among(key, &tried, &|_| true));
            let Ok(next) = next else { return Err(answer) };
            let Some(guard) = self.retry_budget() else {
                self.counters.budget_exhausted.inc();
                tracing::debug!(upstream = %self.config.name, "retry budget spent: no retry");
                return Err(answer);
            };
            self.counters.retries.inc();
            tracing::info!(upstream = %self.config.name, from = %server.address, to = %self.servers[next].address, "retrying on another server");
            (req, i, retry) = (again, next, Some(guard));
        }
    }

    /// Counts and logs a failed call to server `i` (`e` `None`: out of
    /// time) and names its answer. A failure of tollgate's own resources
    /// is not the server's.
    fn upstream_error_at(&self, i: usize, e: Option<&PoolError>) -> ProxyError {
        let name = &self.config.name;
        let address = &self.servers[i].address;
        if let Some(e) = e
            && e.is_local()
        {
            self.counters.local.inc();
            tracing::error!(upstream = %name, server = %address, error = %e, "out of local resources (file descriptors or ports) connecting upstream");
            return ProxyError::ProxyOverloaded;
        }
        self.failed(i);
        match e {
            None => {
                self.counters.timeouts.inc();
                tracing::warn!(upstream = %name, server = %address, "upstream timed out");
                ProxyError::GatewayTimeout
            }
            Some(PoolError::TryTimeout) => {
                self.counters.timeouts.inc();
                self.servers[i].pool.discard_h2();
                tracing::warn!(upstream = %name, server = %address, "upstream try timed out (try_timeout)");
                ProxyError::GatewayTimeout
            }
            Some(e @ PoolError::Connect(_)) if e.is_timeout() => {
                self.counters.timeouts.inc();
                tracing::warn!(upstream = %name, server = %address, "upstream connect timed out");
                ProxyError::GatewayTimeout
            }
            Some(e @ PoolError::Connect(_)) => {
                self.counters.connect_errors.inc();
                tracing::warn!(upstream = %name, server = %address, error = %e, "upstream connect failed");
                ProxyError::BadGateway
            }
            Some(e) => {
                self.counters.resets.inc();
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
                self.counters.too_large.inc();
                ProxyError::PayloadTooLarge
            }
            BodyFailure::Malformed => {
                self.counters.bad_bodies.inc();
                ProxyError::BadRequest("The request body is malformed or was cut short.".into())
            }
            BodyFailure::Timeout => {
                self.counters.body_timeouts.inc();
                ProxyError::RequestTimeout
            }
        }
    }
}

/// What a request that may have reached a server is sent again from (an
/// idempotent one whose body was read whole): the client's head as it
/// came, prepared again only when it is sent again, and a copy of the body.
struct Replay {
    head: ClientHead,
    body: RequestBody,
}

impl Replay {
    /// The request to send again, prepared as the first one was.
    fn request(self, down: &Downstream<'_>, upstream: &Upstream) -> Option<Request<RequestBody>> {
        let mut parts = self.head.request()?.into_parts().0;
        forward::prepare(&mut parts, down, upstream).ok()?;
        Some(Request::from_parts(parts, self.body))
    }

    /// A copy, for one more server to try (`replica` is never `None` for
    /// a body that was read whole, but says so in its type).
    fn copy(&self) -> Option<Replay> {
        Some(Replay { head: self.head.clone(), body: self.body.replica()? })
    }
}

/// Whether a request may be sent twice (RFC 9110 9.2.2).
fn idempotent(method: &http::Method) -> bool {
    use http::Method;
    [Method::GET, Method::HEAD, Method::OPTIONS, Method::TRACE, Method::PUT, Method::DELETE].contains(method)
}

/// A copy of a request's head (its extensions left out) in one buffer:
/// the target, then each field as `name:value\n` (a name holds no `:`, a
/// value no `\n`). Copied on every forwarded idempotent request and parsed
/// back only for a resend, it is one allocation and plain byte copies:
/// cloning the fields instead costs a reference count taken and dropped
/// per field, and about twice the instructions (`benches/callgrind.sh`).
#[derive(Clone)]
struct ClientHead {
    method: http::Method,
    version: http::Version,
    /// Where the target ends and the fields begin in `bytes`.
    target: usize,
    bytes: Vec<u8>,
}

impl ClientHead {
    fn of(parts: &http::request::Parts) -> ClientHead {
        let uri = &parts.uri;
        let (scheme, authority) = (uri.scheme_str().unwrap_or(""), uri.authority().map_or("", |a| a.as_str()));
        let path = uri.path_and_query().map_or("", |p| p.as_str());
        let target = scheme.len() + if scheme.is_empty() { 0 } else { 3 } + authority.len() + path.len();
        let fields: usize = parts.headers.iter().map(|(n, v)| n.as_str().len() + v.len() + 2).sum();
        let mut bytes = Vec::with_capacity(target + fields);
        if !scheme.is_empty() {
            bytes.extend_from_slice(scheme.as_bytes());
            bytes.extend_from_slice(b"://");
        }
        bytes.extend_from_slice(authority.as_bytes());
        bytes.extend_from_slice(path.as_bytes());
        for (name, value) in &parts.headers {
            bytes.extend_from_slice(name.as_str().as_bytes());
            bytes.push(b':');
            bytes.extend_from_slice(value.as_bytes());
            bytes.push(b'\n');
        }
        ClientHead { method: parts.method.clone(), version: parts.version, target, bytes }
    }

    /// The head again; `None` only if a part no longer parses, which a
    /// head hyper parsed and `of` copied cannot do.
    fn request(&self) -> Option<Request<()>> {
        let (target, fields) = self.bytes.split_at(self.target);
        let mut r = Request::new(());
        *r.method_mut() = self.method.clone();
        *r.uri_mut() = http::Uri::try_from(target).ok()?;
        *r.version_mut() = self.version;
        let headers = r.headers_mut();
        for field in fields.split(|&b| b == b'\n').filter(|f| !f.is_empty()) {
            let colon = field.iter().position(|&b| b == b':')?;
            let name = http::HeaderName::from_bytes(&field[..colon]).ok()?;
            headers.append(name, http::HeaderValue::from_bytes(&field[colon + 1..]).ok()?);
        }
        Some(r)
    }
}

/// Completes at `at`; never when `None`.
async fn until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
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

/// Whether a response of the server's own counts against it (passive
/// health): 502, 503 and 504.
fn is_server_failure(status: StatusCode) -> bool {
    matches!(status.as_u16(), 502..=504)
}

#[cfg(test)]
mod tests {
    use super::ClientHead;
    use http::Request;

    /// A head copied and parsed back is the head it was: target, method,
    /// version and every field in order, duplicates and bytes past ASCII
    /// (obs-text) included.
    #[test]
    fn a_client_head_reads_back_as_it_was() {
        let targets = ["/", "/a/b?x=1&y=%20", "*", "http://example.com:8080/p?q", "https://h/"];
        for target in targets {
            let mut req = Request::builder()
                .method(if target == "*" { "OPTIONS" } else { "GET" })
                .uri(target)
                .version(http::Version::HTTP_10)
                .header("host", "example.com")
                .header("x-user", "alice")
                .header("accept", "a")
                .header("accept", "b")
                .header("x-empty", "")
                .body(())
                .expect("a valid request");
            req.headers_mut().append("x-bytes", http::HeaderValue::from_bytes(b"caf\xe9 \t:x").expect("obs-text"));
            let (parts, ()) = req.into_parts();
            let back = ClientHead::of(&parts).request().expect("parses back").into_parts().0;
            assert_eq!(back.uri, parts.uri, "{target}");
            assert_eq!(back.uri.to_string(), parts.uri.to_string(), "{target}");
            assert_eq!(back.method, parts.method);
            assert_eq!(back.version, parts.version);
            let fields = |h: &http::HeaderMap| h.iter().map(|(n, v)| (n.clone(), v.clone())).collect::<Vec<_>>();
            assert_eq!(fields(&back.headers), fields(&parts.headers), "{target}");
        }
    }
}
