//! Keep-alive HTTP/1.1 connections to one upstream, reused request after
//! request.
//!
//! hyper-util's pooled `Client` serves any number of origins, and pays for
//! it on every request: it hashes the origin (SipHash, one byte at a time)
//! to check a connection out and again to put it back, boxes the request
//! future, copies connection details into the response, and spawns a task
//! to return the connection. An upstream has one origin, so its idle
//! connections are one stack: a request takes the most recently used one,
//! and its response body puts it back when it ends.
//!
//! What the pooled `Client` did is kept: the connector (connect timeout,
//! `TCP_NODELAY`, keepalive probes, name resolution), origin-form targets
//! and a `Host` header for requests without one, a request retried on
//! another connection when a reused one closed before it was sent, idle
//! connections closed after the upstream's `pool_idle_timeout` and at most
//! [`MAX_IDLE`] of them. Beyond it: a request that failed on a reused
//! connection before any answer came (the server closed it as the request
//! arrived) is sent once more on a new connection when the caller gave a
//! copy of it (nginx does so for idempotent requests), and the TLS
//! handshake counts against `connect_timeout` as the TCP connect does.
//!
//! An `https://` server is reached over TLS (rustls: the upstream's CA
//! file or the system's roots, SNI, an optional client certificate). With
//! `protocol = "h2"` a server gets one HTTP/2 connection that carries every
//! request at once (ALPN `h2` over TLS, prior knowledge over cleartext),
//! opened again when it closes.

use std::sync::Arc;

use parking_lot::Mutex;
use std::time::Duration;

use http::header::{HOST, HeaderValue};
use http::{Request, Response, Uri};
use hyper::body::Body;
use hyper::client::conn::{http1, http2};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use prometheus::IntCounter;
use rustls::pki_types::ServerName;
use tokio_rustls::TlsConnector;
use tower_service::Service;

use crate::config::{Server, Upstream};

mod body;
mod shared;

use body::BoxError;
pub use body::{Answered, UpstreamBody};
pub use shared::MAX_IDLE;
use shared::{Sender, Shared, reap};

/// TCP keepalive probes on upstream connections start after this long idle.
const KEEPALIVE: Duration = Duration::from_secs(60);

/// Why a request got no response from the upstream.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// No connection could be opened.
    #[error("{0}")]
    Connect(#[source] BoxError),
    /// The connection failed while the request was sent or answered.
    #[error("{0}")]
    Request(#[source] hyper::Error),
    /// No answer within the upstream's `try_timeout` (the caller's
    /// deadline for one try; the pool itself never gives it).
    #[error("no answer within try_timeout")]
    TryTimeout,
}

impl PoolError {
    /// Whether connecting (TCP or TLS) timed out.
    pub fn is_timeout(&self) -> bool {
        self.chain().any(|err| {
            err.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
                || err.to_string().contains("timed out")
        })
    }

    /// Whether a connect failed for want of tollgate's own resources: file
    /// descriptors (`EMFILE`, `ENFILE`), ephemeral ports
    /// (`EADDRNOTAVAIL`) or kernel buffers (`ENOBUFS`, `ENOMEM`).
    pub fn is_local(&self) -> bool {
        matches!(self, PoolError::Connect(_))
            && self.chain().any(|err| {
                err.downcast_ref::<std::io::Error>()
                    .is_some_and(|io| matches!(io.raw_os_error(), Some(24 | 23 | 99 | 105 | 12)))
            })
    }

    /// This error and its sources.
    fn chain(&self) -> impl Iterator<Item = &(dyn std::error::Error + 'static)> {
        std::iter::successors(Some(self as &(dyn std::error::Error + 'static)), |e| e.source())
    }
}

/// One upstream's connections, carrying request bodies of type `B`.
pub struct Pool<B> {
    shared: Arc<Shared<B>>,
}

impl<B> Pool<B>
where
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    /// Connections to one of `upstream`'s servers, each reading at most
    /// `max_buf_size` ahead of the client.
    pub fn for_server(upstream: &Upstream, server: &Server, max_buf_size: usize) -> Pool<B> {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(upstream.connect_timeout));
        connector.set_nodelay(true);
        connector.set_keepalive(Some(KEEPALIVE));
        let https = server.scheme == http::uri::Scheme::HTTPS;
        // The connector opens TCP; TLS is done here, on top.
        connector.enforce_http(!https);
        let mut origin = http::uri::Parts::default();
        origin.scheme = Some(server.scheme.clone());
        origin.authority = Some(server.authority.clone());
        origin.path_and_query = Some(http::uri::PathAndQuery::from_static("/"));
        // Made of a validated scheme and authority.
        let origin = Uri::from_parts(origin).unwrap_or_default();
        let host = server.authority.host().trim_start_matches('[').trim_end_matches(']');
        let tls = upstream.tls.as_ref().and_then(|t| {
            let name = t.server_name.clone().or_else(|| ServerName::try_from(host.to_string()).ok())?;
            Some((TlsConnector::from(t.client.clone()), name))
        });
        let h2 = (upstream.protocol == crate::config::Protocol::H2).then(|| Mutex::new(None));
        let mut pool = Pool::new(connector, origin, max_buf_size, tls, h2);
        if let Some(shared) = Arc::get_mut(&mut pool.shared) {
            shared.connect_timeout = upstream.connect_timeout;
            shared.idle_timeout = upstream.pool_idle_timeout;
            shared.h2_keepalive = upstream.h2_keepalive_interval;
        }
        pool
    }

    /// Connections to `origin` (an `http://` or `https://` URI with an
    /// authority), opened by `connector`, each reading at most
    /// `max_buf_size` ahead.
    fn new(
        connector: HttpConnector,
        origin: Uri,
        max_buf_size: usize,
        tls: Option<(TlsConnector, ServerName<'static>)>,
        h2: Option<Mutex<Option<http2::SendRequest<B>>>>,
    ) -> Pool<B> {
        let default_port = if tls.is_some() { 443 } else { 80 };
        let host = match (origin.host(), origin.port_u16()) {
            (Some(h), Some(p)) if p != default_port => HeaderValue::try_from(format!("{h}:{p}")),
            (h, _) => HeaderValue::try_from(h.unwrap_or_default()),
        }
        // An authority's host and port are always a valid value.
        .unwrap_or(HeaderValue::from_static("localhost"));
        Pool {
            shared: Arc::new(Shared {
                connector,
                origin,
                host,
                max_buf_size,
                connect_timeout: Duration::from_secs(1),
                idle_timeout: crate::config::POOL_IDLE_TIMEOUT,
                h2_keepalive: Duration::from_secs(30),
                idle: Mutex::new(Vec::new()),
                reaping: std::sync::Once::new(),
                silence: None,
                tls,
                h2,
            }),
        }
    }

    /// Whether requests go over HTTP/1.1 (not HTTP/2).
    pub fn speaks_http1(&self) -> bool {
        self.shared.h2.is_none()
    }

    /// A response body whose upstream sends nothing for `timeout` fails
    /// (the client's response is cut, its connection closed with it) and
    /// counts in `timeouts`: a streaming response (server-sent events, a
    /// long poll) lives as long as its upstream keeps it moving, and no
    /// longer than `timeout` past its last bytes.
    pub fn limit_silence(mut self, timeout: Duration, timeouts: IntCounter) -> Pool<B> {
        // Only at construction, before the pool is shared.
        if let Some(shared) = Arc::get_mut(&mut self.shared) {
            shared.silence = Some((timeout, timeouts));
        }
        self
    }

    /// Sends `req` (its target in origin form) on an idle connection, or a
    /// new one, and returns the response head, its body still streaming.
    pub async fn send(&self, req: Request<B>) -> Result<Response<UpstreamBody<B>>, PoolError> {
        self.try_send(req, || None).await.map_err(|(e, _)| e)
    }

    /// [`Pool::send`], which also gives the request back when none of it
    /// was sent (no connection could be opened, or hyper returned it
    /// unsent), so that it can go to another server. `again` makes the
    /// request once more (`None` for one that may not be sent twice): asked
    /// for only when a reused connection failed before any answer came, and
    /// then sent on a new connection.
    pub async fn try_send(
        &self,
        mut req: Request<B>,
        again: impl FnOnce() -> Option<Request<B>>,
    ) -> Result<Response<UpstreamBody<B>>, (PoolError, Option<Box<Request<B>>>)> {
        let add_host = !req.headers().contains_key(HOST);
        if add_host {
            req.headers_mut().insert(HOST, self.shared.host.clone());
        }
        // A request given back goes to another server: without this one's
        // host.
        // Boxed: it is seldom given back, and the result (moved a few
        // times on every request) stays the size of a response.
        let give_back = |mut req: Request<B>| {
            if add_host {
                req.headers_mut().remove(HOST);
            }
            Box::new(req)
        };
        let mut again = Some(again);
        let mut fresh = false;
        loop {
            let checked_out = if fresh { None } else { self.shared.checkout() };
            let (mut sender, reused) = match checked_out {
                Some(s) => (s, true),
                // Boxed: a connection is opened seldom, and its future (TCP,
                // TLS and the HTTP handshake, several KiB) would otherwise
                // sit in every request's future, copied with it.
                None => match Box::pin(self.connect()).await {
                    Ok(s) => (s, false),
                    Err(e) => return Err((e, Some(give_back(req)))),
                },
            };
            let sent = match &mut sender {
                Sender::H1(s) => s.try_send_request(req).await,
                Sender::H2(s) => s.try_send_request(req).await,
            };
            match sent {
                Ok(resp) => {
                    // An HTTP/2 connection stays shared: nothing to give
                    // back when the body ends.
                    let sender = match sender {
                        Sender::H1(s) => Some(s),
                        Sender::H2(_) => None,
                    };
                    let shared = self.shared.clone();
                    return Ok(resp.map(|body| UpstreamBody::new(body, shared, sender)));
                }
                Err(mut e) => match e.take_message() {
                    // Not sent: the idle connection closed under it. A new
                    // connection cannot have that excuse.
                    Some(unsent) if reused => req = unsent,
                    unsent => {
                        let e = e.into_error();
                        // Sent on a reused connection that the server
                        // closed instead of answering: once more, on a new
                        // connection (never a second time).
                        if reused
                            && unsent.is_none()
                            && stale(&e)
                            && let Some(mut again) = again.take().and_then(|again| again())
                        {
                            tracing::debug!(error = %e, "a reused upstream connection failed: sending again on a new one");
                            if add_host {
                                again.headers_mut().insert(HOST, self.shared.host.clone());
                            }
                            (req, fresh) = (again, true);
                            continue;
                        }
                        return Err((PoolError::Request(e), unsent.map(give_back)));
                    }
                },
            }
        }
    }

    /// Forgets the HTTP/2 connection (a request on it timed out): the next
    /// request opens a new one, and the old one closes once its streams
    /// end.
    pub fn discard_h2(&self) {
        if let Some(h2) = &self.shared.h2 {
            *h2.lock() = None;
        }
    }

    /// A new connection, its TLS handshake included, within the upstream's
    /// `connect_timeout`.
    async fn connect(&self) -> Result<Sender<B>, PoolError> {
        match tokio::time::timeout(self.shared.connect_timeout, self.open()).await {
            Ok(r) => r,
            Err(_) => Err(PoolError::Connect(Box::new(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "connecting (TCP and TLS) timed out",
            )))),
        }
    }

    async fn open(&self) -> Result<Sender<B>, PoolError> {
        let io = self.shared.connector.clone().call(self.shared.origin.clone()).await;
        let io = io.map_err(|e| PoolError::Connect(e.into()))?;
        match &self.shared.tls {
            None => self.handshake(io).await,
            Some((tls, name)) => {
                let tls = tls.connect(name.clone(), io.into_inner()).await;
                let tls = tls.map_err(|e| PoolError::Connect(e.into()))?;
                self.handshake(TokioIo::new(tls)).await
            }
        }
    }

    /// HTTP/1.1 or HTTP/2 on a connection just opened.
    async fn handshake<I>(&self, io: I) -> Result<Sender<B>, PoolError>
    where
        I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        if let Some(shared) = &self.shared.h2 {
            // PINGed while open: a connection whose server stopped
            // answering is closed, and the next request opens another.
            let (sender, conn) = http2::Builder::new(TokioExecutor::new())
                .timer(hyper_util::rt::TokioTimer::new())
                .keep_alive_interval(self.shared.h2_keepalive)
                .keep_alive_timeout(self.shared.h2_keepalive.min(Duration::from_secs(20)))
                .keep_alive_while_idle(true)
                .handshake::<_, B>(io)
                .await
                .map_err(|e| PoolError::Connect(e.into()))?;
            tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!(error = %e, "upstream HTTP/2 connection ended with an error");
                }
            });
            *shared.lock() = Some(sender.clone());
            return Ok(Sender::H2(sender));
        }
        let (sender, conn) = http1::Builder::new()
            .max_buf_size(self.shared.max_buf_size)
            .handshake::<_, B>(io)
            .await
            .map_err(|e| PoolError::Connect(e.into()))?;
        // With upgrades: a 101 hands the connection over to a tunnel
        // (crate::upstream::tunnel) instead of ending it.
        tokio::spawn(async move {
            if let Err(e) = conn.with_upgrades().await {
                tracing::debug!(error = %e, "upstream connection ended with an error");
            }
        });
        self.shared.reaping.call_once(|| {
            tokio::spawn(reap(Arc::downgrade(&self.shared)));
        });
        Ok(Sender::H1(sender))
    }
}

/// Whether a request failed the way a connection the server closed as it
/// arrived fails: closed before the answer, or reset.
fn stale(e: &hyper::Error) -> bool {
    if e.is_incomplete_message() || e.is_canceled() {
        return true;
    }
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset};
            return matches!(io.kind(), ConnectionReset | BrokenPipe | ConnectionAborted);
        }
        cur = err.source();
    }
    false
}
