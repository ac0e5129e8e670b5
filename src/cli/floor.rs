//! The floor of tollgate's stack, as a bench target (`tollgate-floor`).
//!
//! The listener setup of [`crate::edge::server`] (hyper's HTTP/1.1 and h2c server,
//! configured from `[listen]`) and the upstream pool of [`crate::upstream::pool`],
//! joined by nothing: no normalisation, rules, store, rate-limit or
//! forwarding headers, metrics, connection limits or timeouts of tollgate's
//! own. Every request goes as it came to the upstream of the first
//! `[[route]]`. A proxy built from these crates costs at least this much per
//! request; what tollgate costs beyond it is what its features cost.
//! edge-bench runs the two side by side (docs/benchmarks.md).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{Request, Response, StatusCode, Uri, Version};
use http_body_util::{Either, Empty};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;

use crate::config::Config;
use crate::edge::connection::connection_builder;
use crate::upstream::forward::UPSTREAM_READ_BUFFER;
use crate::upstream::pool::{Pool, UpstreamBody};

/// Why the floor could not start.
#[derive(Debug, thiserror::Error)]
pub enum FloorError {
    #[error("the config has no [[route]] to take the upstream from")]
    NoRoute,
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
}

/// A bound, not yet serving, floor.
pub struct Floor {
    listener: TcpListener,
    builder: auto::Builder<TokioExecutor>,
    upstream: Arc<Upstream>,
}

struct Upstream {
    pool: Pool<Incoming>,
    /// The upstream URL's path, put before every request's.
    base_path: String,
}

/// What the floor answers: the upstream's response, or an empty 502.
type FloorBody = Either<UpstreamBody<Incoming>, Empty<Bytes>>;

impl Floor {
    /// Binds `[listen] proxy`, in front of the first route's upstream.
    pub async fn bind(config: &Config) -> Result<Floor, FloorError> {
        let route = config.routes.first().ok_or(FloorError::NoRoute)?;
        let upstream = config.upstreams.get(route.upstream).ok_or(FloorError::NoRoute)?;
        let addr = config.listen.proxy;
        let listener = TcpListener::bind(addr).await.map_err(|source| FloorError::Bind { addr, source })?;
        Ok(Floor {
            listener,
            builder: connection_builder(config),
            upstream: Arc::new(Upstream {
                pool: Pool::for_server(
                    upstream,
                    upstream.servers.first().ok_or(FloorError::NoRoute)?,
                    UPSTREAM_READ_BUFFER,
                ),
                base_path: upstream.base_path.clone(),
            }),
        })
    }

    /// The address clients connect to.
    pub fn proxy_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// Serves until `shutdown` completes; connections still open then are
    /// left to finish on their own.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let Floor { listener, builder, upstream } = self;
        tokio::pin!(shutdown);
        loop {
            let stream = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => stream,
                    Err(_) => continue,
                },
                () = &mut shutdown => return,
            };
            let _ = stream.set_nodelay(true);
            let upstream = upstream.clone();
            let svc = service_fn(move |req| {
                let upstream = upstream.clone();
                async move { Ok::<_, Infallible>(upstream.forward(req).await) }
            });
            let conn = builder.serve_connection(TokioIo::new(stream), svc).into_owned();
            tokio::spawn(conn);
        }
    }
}

impl Upstream {
    async fn forward(&self, req: Request<Incoming>) -> Response<FloorBody> {
        let version = req.version();
        let (mut parts, body) = req.into_parts();
        let target = match parts.uri.path_and_query() {
            Some(pq) if self.base_path.is_empty() => Ok(pq.clone()),
            pq => PathAndQuery::try_from(format!("{}{}", self.base_path, pq.map_or("/", |p| p.as_str()))),
        };
        let Ok(target) = target else { return bad_gateway() };
        parts.uri = Uri::from(target);
        parts.version = Version::HTTP_11;
        match self.pool.send(Request::from_parts(parts, body)).await {
            Ok(mut resp) => {
                *resp.version_mut() = version;
                resp.map(Either::Left)
            }
            Err(_) => bad_gateway(),
        }
    }
}

fn bad_gateway() -> Response<FloorBody> {
    let mut resp = Response::new(Either::Right(Empty::new()));
    *resp.status_mut() = StatusCode::BAD_GATEWAY;
    resp
}
