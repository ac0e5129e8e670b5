//! Forwarding to upstreams: pooled clients, hop-by-hop headers,
//! `X-Forwarded-*`, timeouts, and the request body limit.
//!
//! Bodies stream both ways: the client's body goes to the upstream as it
//! arrives (through [`LimitedBody`], which only counts bytes), and the
//! upstream's response body goes back untouched.

use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{PathAndQuery, Uri};
use http::{Request, Response, Version};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use prometheus::IntCounter;

use crate::config::Upstream;
use crate::error::ProxyError;
use crate::metrics::Metrics;

/// Headers that describe one connection, not the message (RFC 9110 7.6.1):
/// never forwarded in either direction.
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    // tollgate does not tunnel protocol upgrades.
    header::UPGRADE,
];
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");

/// One upstream: its pooled client, in-flight count and error counters.
pub struct UpstreamClient {
    pub config: Upstream,
    client: Client<HttpConnector, LimitedBody>,
    inflight: AtomicUsize,
    connect_errors: IntCounter,
    timeouts: IntCounter,
    resets: IntCounter,
}

/// Keeps an upstream's in-flight count while a request is being forwarded.
struct InflightGuard<'a>(&'a AtomicUsize);

impl Drop for InflightGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What [`UpstreamClient::forward`] needs to know about the client side.
pub struct Downstream<'a> {
    /// The socket peer.
    pub peer: IpAddr,
    /// Whether the peer is one of `trusted_proxies`.
    pub trusted: bool,
    /// The host the client asked for, for `X-Forwarded-Host`.
    pub host: Option<&'a str>,
    /// The route's body limit.
    pub max_body: Option<u64>,
}

impl UpstreamClient {
    pub fn new(config: &Upstream, metrics: &Metrics) -> UpstreamClient {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(config.connect_timeout));
        connector.set_nodelay(true);
        connector.set_keepalive(Some(Duration::from_secs(60)));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(1024)
            .build(connector);
        let err = |kind: &str| metrics.upstream_errors_total.with_label_values(&[config.name.as_str(), kind]);
        UpstreamClient {
            config: config.clone(),
            client,
            inflight: AtomicUsize::new(0),
            connect_errors: err("connect"),
            timeouts: err("timeout"),
            resets: err("reset"),
        }
    }

    /// Requests being forwarded to this upstream right now (elastic
    /// throttling reads it).
    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::Relaxed)
    }

    /// Sends `req` to this upstream and returns its response head with the
    /// body still streaming.
    pub async fn forward(
        &self,
        req: Request<Incoming>,
        down: Downstream<'_>,
    ) -> Result<Response<Incoming>, ProxyError> {
        let (mut parts, body) = req.into_parts();
        let invalid = || ProxyError::BadRequest("The request target is not a valid path.".into());
        let pq = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let pq = if self.config.base_path.is_empty() {
            PathAndQuery::try_from(pq)
        } else {
            PathAndQuery::try_from(format!("{}{}", self.config.base_path, pq))
        }
        .map_err(|_| invalid())?;
        let original_authority = parts.uri.authority().cloned();
        let mut uri = http::uri::Parts::default();
        uri.scheme = Some(self.config.scheme.clone());
        uri.authority = Some(self.config.authority.clone());
        uri.path_and_query = Some(pq);
        parts.uri = Uri::from_parts(uri).map_err(|_| invalid())?;

        strip_hop_by_hop(&mut parts.headers);
        // The Host the client asked for goes to the upstream (virtual hosts
        // behind the proxy keep working); HTTP/2 clients send it as the
        // :authority instead.
        if !parts.headers.contains_key(header::HOST)
            && let Some(a) = &original_authority
            && let Ok(v) = HeaderValue::from_str(a.as_str())
        {
            parts.headers.insert(header::HOST, v);
        }
        set_forwarded(&mut parts.headers, down.peer, down.trusted, down.host);
        // The pooled client speaks HTTP/1.1 to upstreams whatever the client
        // spoke to us.
        parts.version = Version::HTTP_11;

        let tripped = Arc::new(AtomicBool::new(false));
        let body = LimitedBody { inner: body, remaining: down.max_body, tripped: tripped.clone() };
        let req = Request::from_parts(parts, body);
        self.inflight.fetch_add(1, Ordering::Relaxed);
        let _guard = InflightGuard(&self.inflight);
        let result = tokio::time::timeout(self.config.timeout, self.client.request(req)).await;
        let name = &self.config.name;
        match result {
            Ok(Ok(mut resp)) => {
                strip_hop_by_hop(resp.headers_mut());
                Ok(resp)
            }
            // The body outgrew the route's limit before the upstream
            // answered: the client's fault, not the upstream's.
            Ok(Err(_)) if tripped.load(Ordering::Relaxed) => Err(ProxyError::PayloadTooLarge),
            Ok(Err(e)) if e.is_connect() && is_timeout(&e) => {
                self.timeouts.inc();
                tracing::warn!(upstream = %name, "upstream connect timed out");
                Err(ProxyError::GatewayTimeout)
            }
            Ok(Err(e)) if e.is_connect() => {
                self.connect_errors.inc();
                tracing::warn!(upstream = %name, error = %e, "upstream connect failed");
                Err(ProxyError::BadGateway)
            }
            Ok(Err(e)) => {
                self.resets.inc();
                tracing::warn!(upstream = %name, error = %e, "upstream request failed");
                Err(ProxyError::BadGateway)
            }
            Err(_) => {
                self.timeouts.inc();
                tracing::warn!(upstream = %name, "upstream timed out");
                Err(ProxyError::GatewayTimeout)
            }
        }
    }
}

/// The client's request body on its way upstream, cut off with an error once
/// it exceeds the route's `max_body`. Nothing is buffered.
pub struct LimitedBody {
    inner: Incoming,
    remaining: Option<u64>,
    tripped: Arc<AtomicBool>,
}

/// The error a [`LimitedBody`] ends with.
#[derive(Debug, thiserror::Error)]
#[error("request body larger than the route's max_body")]
pub struct BodyTooLarge;

impl Body for LimitedBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let frame = match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => frame,
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => return Poll::Pending,
        };
        if let (Some(remaining), Some(data)) = (self.remaining, frame.data_ref()) {
            let len = data.len() as u64;
            if len > remaining {
                self.tripped.store(true, Ordering::Relaxed);
                return Poll::Ready(Some(Err(Box::new(BodyTooLarge))));
            }
            self.remaining = Some(remaining - len);
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

fn strip_hop_by_hop(headers: &mut HeaderMap) {
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
}

/// `X-Forwarded-For` gets the peer appended when the peer is a trusted
/// proxy, and is replaced by the peer otherwise: an untrusted client's claim
/// about who it is must not reach the upstream either, so its `Forwarded`
/// and `X-Real-IP` are dropped too. Likewise for `-Proto` and `-Host`.
fn set_forwarded(headers: &mut HeaderMap, peer: IpAddr, trusted_peer: bool, host: Option<&str>) {
    let peer_s = peer.to_string();
    let xff = match (trusted_peer, headers.get(&X_FORWARDED_FOR).and_then(|v| v.to_str().ok())) {
        (true, Some(prev)) if !prev.trim().is_empty() => format!("{prev}, {peer_s}"),
        _ => peer_s,
    };
    headers.remove(&X_FORWARDED_FOR);
    if let Ok(v) = HeaderValue::from_str(&xff) {
        headers.insert(X_FORWARDED_FOR, v);
    }
    if !trusted_peer {
        headers.remove(header::FORWARDED);
        headers.remove(&X_REAL_IP);
    }
    if !trusted_peer || !headers.contains_key(&X_FORWARDED_PROTO) {
        headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
    }
    if !trusted_peer || !headers.contains_key(&X_FORWARDED_HOST) {
        headers.remove(&X_FORWARDED_HOST);
        if let Some(v) = host.and_then(|h| HeaderValue::from_str(h).ok()) {
            headers.insert(X_FORWARDED_HOST, v);
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
