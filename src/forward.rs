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
use tokio::time::{Instant, Sleep};

use crate::client::Peer;
use crate::config::Upstream;
use crate::error::ProxyError;
use crate::pool::UpstreamBody;
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

/// What [`crate::upstream::UpstreamClient::forward`] needs to know about
/// the client side.
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
    /// The client connection's budget for bodies read ahead (HTTP/2
    /// only: an HTTP/1.1 connection has one request at a time).
    pub ahead_budget: Option<AheadBudget>,
    /// Where the body bytes read from the client are counted, for the
    /// access log; `None` when it is off.
    pub bytes_in: Option<Arc<AtomicU64>>,
    /// Where the index of the server the request went to is noted (it
    /// starts at `usize::MAX`: none), for the access log; `None` when it is
    /// off.
    pub chosen: Option<&'a std::sync::atomic::AtomicUsize>,
}

/// The request as the upstream gets it: origin-form target (with the
/// upstream's base path and the canonical path), hop-by-hop headers
/// stripped before tollgate's own are set (a header named in
/// `Connection` cannot remove `Host` or a header tollgate sets),
/// `X-Forwarded-*` and `Via`. Also says whether the request asks the
/// upstream to switch protocols.
pub(crate) fn prepare(
    req: Request<Incoming>,
    down: &mut Downstream<'_>,
    upstream: &Upstream,
) -> Result<(http::request::Parts, Incoming, bool), ProxyError> {
    let (mut parts, body) = req.into_parts();
    let invalid = || ProxyError::BadRequest("The request target is not a valid path.".into());
    let base = upstream.base_path.as_str();
    let pq = match (&down.path, parts.uri.query()) {
        (Some(path), Some(query)) => PathAndQuery::try_from(format!("{base}{path}?{query}")),
        (Some(path), None) => PathAndQuery::try_from(format!("{base}{path}")),
        // The client's target, parsed already: shared, not parsed again.
        (None, _) if base.is_empty() => {
            Ok(parts.uri.path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/")))
        }
        (None, _) => {
            let pq = parts.uri.path_and_query().map_or("/", |p| p.as_str());
            PathAndQuery::try_from(format!("{base}{pq}"))
        }
    }
    .map_err(|_| invalid())?;
    // Origin form, as an origin server expects it.
    parts.uri = Uri::from(pq);

    // A client that takes trailers gets the upstream's: tollgate relays
    // them (the codings `TE` may also name are hop-by-hop, not passed).
    if strip_hop_by_hop(&mut parts.headers, true) {
        parts.headers.insert(header::TE, HeaderValue::from_static("trailers"));
    }
    // HTTP/2 has no Upgrade: to an h2 upstream the request goes as a
    // plain one.
    let upgrade = down.upgrade.take().filter(|_| upstream.protocol == crate::config::Protocol::Http1);
    let upgrading = upgrade.is_some();
    if let Some(protocol) = upgrade {
        tunnel::ask_upstream(&mut parts.headers, protocol);
    }
    // The host that was matched goes to the upstream (virtual hosts
    // behind the proxy keep working): the client's Host, or the target's
    // authority (absolute form, HTTP/2's :authority).
    if let Some(h) = down.host_header.take() {
        parts.headers.insert(header::HOST, h);
    }
    set_forwarded(&mut parts.headers, down.peer, down.host);
    crate::via::append(&mut parts.headers, parts.version);
    // The pool speaks HTTP/1.1 to upstreams whatever the client spoke to
    // us.
    parts.version = Version::HTTP_11;
    Ok((parts, body, upgrading))
}

/// The upstream's response head as the client gets it: without its
/// hop-by-hop headers, except the `Upgrade` of a switch the client asked
/// for (`upgrading`). A switch nobody asked for is counted in `resets`
/// and answered 502.
pub(crate) fn response_head(
    mut resp: Response<UpstreamBody<RequestBody>>,
    upgrading: bool,
    upstream: &str,
    resets: &prometheus::IntCounter,
) -> Result<Response<UpstreamBody<RequestBody>>, ProxyError> {
    let version = resp.version();
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        strip_hop_by_hop(resp.headers_mut(), false);
        crate::via::append(resp.headers_mut(), version);
        return Ok(resp);
    }
    // A switch nobody asked for would leave the client reading a protocol
    // it does not speak.
    if !upgrading {
        resets.inc();
        tracing::warn!(upstream = %upstream, "upstream switched protocols unasked");
        return Err(ProxyError::BadGateway);
    }
    let protocol = resp.headers().get(header::UPGRADE).cloned();
    strip_hop_by_hop(resp.headers_mut(), false);
    crate::via::append(resp.headers_mut(), version);
    tunnel::answer_client(resp.headers_mut(), protocol);
    Ok(resp)
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

    pub(crate) fn failure(&self) -> Option<BodyFailure> {
        match self.failure.load(Ordering::Relaxed) {
            1 => Some(BodyFailure::TooLarge),
            2 => Some(BodyFailure::Malformed),
            3 => Some(BodyFailure::Timeout),
            _ => None,
        }
    }

    pub(crate) fn client_wait(&self, now: Instant) -> Duration {
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
    /// The connection's budget for bodies read ahead, and how much of it
    /// the frames in `ahead` hold (the first ones: the frame that did not
    /// fit ends the reading ahead).
    budget: Option<AheadBudget>,
    held: u64,
}

/// What one client connection's requests may hold of their bodies read
/// ahead, together (`[listen] connection_body_buffer`). `buffer_body`
/// bounds one request; an HTTP/2 connection carries up to 100 at once, and
/// without this bound 100 streams each sending just under `buffer_body`
/// would pin 100 times it. Past the budget a request stops reading ahead
/// and is streamed: the rest of its body waits in the client, under HTTP/2
/// flow control.
#[derive(Debug, Clone)]
pub struct AheadBudget(Arc<AtomicU64>);

impl AheadBudget {
    pub fn new(bytes: u64) -> AheadBudget {
        AheadBudget(Arc::new(AtomicU64::new(bytes)))
    }

    /// Takes `n` bytes of the budget, if that many are left.
    fn take(&self, n: u64) -> bool {
        self.0.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| left.checked_sub(n)).is_ok()
    }

    fn give(&self, n: u64) {
        if n > 0 {
            self.0.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Bytes left.
    pub fn left(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl Drop for RequestBody {
    fn drop(&mut self) {
        if let Some(b) = &self.budget {
            b.give(self.held);
        }
    }
}

/// The error a [`RequestBody`] ends with; [`BodyWatch`] says why.
#[derive(Debug, thiserror::Error)]
#[error("the client's request body failed: {0:?}")]
pub struct BodyFailed(BodyFailure);

impl RequestBody {
    pub(crate) fn new(inner: Incoming, down: &Downstream<'_>, watch: Arc<BodyWatch>) -> RequestBody {
        let rest = (!inner.is_end_stream()).then_some(inner);
        RequestBody {
            ahead: VecDeque::new(),
            rest,
            remaining: down.max_body,
            read_timeout: down.body_read_timeout,
            timer: None,
            watch,
            bytes_in: down.bytes_in.clone(),
            budget: down.ahead_budget.clone(),
            held: 0,
        }
    }

    /// A copy of a body that was read whole (see
    /// [`RequestBody::read_ahead`]), to send the request again; `None`
    /// while some of it is still to come from the client.
    pub(crate) fn replica(&self) -> Option<RequestBody> {
        if self.rest.is_some() {
            return None;
        }
        let copy = |f: &Frame<Bytes>| match (f.data_ref(), f.trailers_ref()) {
            (Some(d), _) => Frame::data(d.clone()),
            (None, Some(t)) => Frame::trailers(t.clone()),
            (None, None) => Frame::data(Bytes::new()),
        };
        Some(RequestBody {
            ahead: self.ahead.iter().map(copy).collect(),
            rest: None,
            remaining: None,
            read_timeout: Duration::ZERO,
            timer: None,
            watch: self.watch.clone(),
            bytes_in: None,
            budget: None,
            held: 0,
        })
    }

    /// Reads the body until it ends or more than `limit` bytes have arrived.
    /// A body that declares a larger length is not read ahead at all.
    pub(crate) async fn read_ahead(mut self, limit: u64) -> Result<RequestBody, BodyFailure> {
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
                    // The connection's budget: a frame that does not fit
                    // is the last one read ahead.
                    if let Some(budget) = &self.budget {
                        if !budget.take(len) {
                            break;
                        }
                        self.held += len;
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
            if self.held > 0 {
                let len = frame.data_ref().map_or(0, |d| d.len() as u64).min(self.held);
                self.held -= len;
                if let Some(b) = &self.budget {
                    b.give(len);
                }
            }
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
/// (the next hop may then be told that tollgate does too). A request's
/// (`request`) `Connection` cannot name `Host` or `X-Request-Id` away:
/// the upstream gets them whatever the client says.
fn strip_hop_by_hop(headers: &mut HeaderMap, request: bool) -> bool {
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
        .filter(|n| !request || (*n != header::HOST && *n != crate::request_id::X_REQUEST_ID))
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
