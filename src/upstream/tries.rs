//! A request's tries on an upstream: the short path of a lone server, and
//! over several servers (or with health checks or limits) a server in
//! service, then others when one could not take the request, within the
//! request's one deadline and the retry budget; what an idempotent request
//! is sent again from.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use tokio::time::{Instant, Sleep};

use super::choice::{NoServer, RetryGuard, Tried};
use super::client::UpstreamClient;
use super::failure::is_server_failure;
use super::forward::{self, BodyFailure, BodyWatch, Downstream, RequestBody};
use super::pool::{PoolError, UpstreamBody};
use crate::config::Upstream;
use crate::wire::error::ProxyError;

impl UpstreamClient {
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
        let mut i = self.pick_first(key, &tried)?;
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
            let Some((again, next, guard)) = self.next_try(key, &tried, i, unsent, replay.as_ref(), down) else {
                return Err(answer);
            };
            (req, i, retry) = (again, next, Some(guard));
        }
    }

    /// The first server for a request with `key`, or the answer when none
    /// can take it.
    fn pick_first(&self, key: Option<u64>, tried: &Tried) -> Result<usize, ProxyError> {
        self.pick(key, tried).map_err(|no| match no {
            NoServer::Busy => {
                self.counters.busy.inc();
                ProxyError::UpstreamBusy
            }
            NoServer::None => {
                self.counters.unavailable.inc();
                tracing::warn!(upstream = %self.config.name, "no server of the upstream can take requests");
                ProxyError::UpstreamUnavailable
            }
        })
    }

    /// After a failed try on server `from`: the request to send again, the
    /// server to send it to and the retry's place in the budget; `None`
    /// when the request is not tried again (retries spent, a sent request
    /// that cannot be replayed, no server left, the budget spent).
    fn next_try(
        &self,
        key: Option<u64>,
        tried: &Tried,
        from: usize,
        unsent: Option<Box<Request<RequestBody>>>,
        replay: Option<&Replay>,
        down: &Downstream<'_>,
    ) -> Option<(Request<RequestBody>, usize, RetryGuard<'_>)> {
        if tried.len > self.config.retries as usize {
            return None;
        }
        // Unsent (the connection failed first): any request may go
        // elsewhere. Sent: only one that can be replayed.
        let again = match unsent {
            Some(unsent) => *unsent,
            None => replay.and_then(Replay::copy).and_then(|r| r.request(down, &self.config))?,
        };
        // When every server in service has been tried, those out of
        // service are the last resort: a health check's verdict is
        // seconds old, the answer of a server that may be up beats an
        // error that is certain.
        let next = self.pick(key, tried).or_else(|_| self.pick_among(key, tried, &|_| true)).ok()?;
        let Some(guard) = self.retry_budget() else {
            self.counters.budget_exhausted.inc();
            tracing::debug!(upstream = %self.config.name, "retry budget spent: no retry");
            return None;
        };
        self.counters.retries.inc();
        tracing::info!(upstream = %self.config.name, from = %self.servers[from].address, to = %self.servers[next].address, "retrying on another server");
        Some((again, next, guard))
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

/// Bytes set aside per field in [`ClientHead::of`]'s buffer.
const FIELD_ROOM: usize = 48;

impl ClientHead {
    fn of(parts: &http::request::Parts) -> ClientHead {
        let uri = &parts.uri;
        let (scheme, authority) = (uri.scheme_str().unwrap_or(""), uri.authority().map_or("", |a| a.as_str()));
        let path = uri.path_and_query().map_or("", |p| p.as_str());
        let target = scheme.len() + if scheme.is_empty() { 0 } else { 3 } + authority.len() + path.len();
        // Room for typical fields without walking them twice to measure
        // them; a head with longer ones grows the buffer once or twice.
        let mut bytes = Vec::with_capacity(target + FIELD_ROOM * parts.headers.len());
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
