//! `[listen] http_redirect`: a plain-HTTP listener that sends every request
//! to the same URL over HTTPS with `308 Permanent Redirect` (which, unlike
//! 301, keeps the method and body).
//!
//! It forwards nothing and counts nothing; its connections share the proxy
//! listener's `max_connections` slots, answer one request each, and a
//! client gets `header_read_timeout` to send its request. Each request gets
//! its `X-Request-Id` (see [`crate::wire::request_id`]) and, when the access log
//! is on, its line there.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, HOST, LOCATION};
use http::uri::Authority;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::proxy::Proxy;
use crate::wire::error::ProxyError;

/// Serves redirects until the task is dropped. `https_port` is
/// `listen.redirect_port`, the HTTPS port clients reach: written into the
/// redirect unless it is 443.
pub async fn serve(
    listener: TcpListener,
    https_port: u16,
    slots: Arc<Semaphore>,
    header_read_timeout: Duration,
    proxy: Arc<Proxy>,
) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed on the redirect listener");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // Over max_connections: closed at once, as nothing is lost.
        let Ok(permit) = slots.clone().try_acquire_owned() else { continue };
        let (proxy, peer) = (proxy.clone(), proxy.peer(peer));
        tokio::spawn(async move {
            let svc = service_fn(move |mut req| {
                let request_id = crate::wire::request_id::assign(req.headers_mut(), peer.trusted);
                let pending = proxy.access_log().and_then(|log| {
                    // As the proxy resolves it; a forwarding header naming
                    // no client is not worth refusing a redirect for.
                    let trusted = &proxy.client_config().trusted_proxies;
                    let client = crate::wire::client::client_addr(peer.ip, req.headers(), trusted).unwrap_or(peer.ip);
                    log.begin_request(&req, client, &request_id, None, None)
                });
                let resp = redirect(&req, https_port, &request_id);
                if let Some(mut p) = pending {
                    p.respond(resp.status().as_u16());
                    p.sent(hyper::body::Body::size_hint(resp.body()).exact().unwrap_or(0));
                }
                async move { Ok::<_, Infallible>(resp) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_read_timeout)
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), svc)
                .await;
            drop(permit);
        });
    }
}

/// The 308 answer to `req`: `https://<host>[:port]<path and query>`, or 400
/// when the request names no usable host; with `X-Request-Id`.
pub fn redirect<B>(req: &Request<B>, https_port: u16, request_id: &HeaderValue) -> Response<Full<Bytes>> {
    let authority = req
        .uri()
        .authority()
        .cloned()
        .or_else(|| req.headers().get(HOST).and_then(|h| Authority::try_from(h.as_bytes()).ok()));
    let Some(host) = authority.as_ref().map(Authority::host).filter(|h| !h.is_empty()) else {
        return ProxyError::BadRequest("a Host header is needed to redirect to HTTPS".into()).into_response(request_id);
    };
    let target = req.uri().path_and_query().map_or("/", |pq| pq.as_str());
    let location = if https_port == 443 {
        format!("https://{host}{target}")
    } else {
        format!("https://{host}:{https_port}{target}")
    };
    // The host passed Authority's grammar and the target hyper's: a valid
    // value; a failure still gets an answer.
    let Ok(location) = HeaderValue::try_from(location) else {
        return ProxyError::BadRequest("the Host header cannot be redirected to".into()).into_response(request_id);
    };
    let mut resp = Response::new(Full::new(Bytes::new()));
    *resp.status_mut() = StatusCode::PERMANENT_REDIRECT;
    resp.headers_mut().insert(LOCATION, location);
    resp.headers_mut().insert(CONTENT_LENGTH, HeaderValue::from_static("0"));
    resp.headers_mut().insert(crate::wire::request_id::X_REQUEST_ID, request_id.clone());
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn location(host: Option<&str>, target: &str, port: u16) -> (StatusCode, Option<String>) {
        let mut req = Request::builder().uri(target);
        if let Some(h) = host {
            req = req.header(HOST, h);
        }
        let resp = redirect(&req.body(()).expect("request"), port, &HeaderValue::from_static("id"));
        let loc = resp.headers().get(LOCATION).map(|v| v.to_str().expect("text").to_string());
        (resp.status(), loc)
    }

    #[test]
    fn keeps_host_path_and_query_and_names_the_port_unless_443() {
        assert_eq!(
            location(Some("shop.example.com:8080"), "/a/b?x=1&y=2", 8443),
            (StatusCode::PERMANENT_REDIRECT, Some("https://shop.example.com:8443/a/b?x=1&y=2".into()))
        );
        assert_eq!(
            location(Some("shop.example.com"), "/", 443),
            (StatusCode::PERMANENT_REDIRECT, Some("https://shop.example.com/".into()))
        );
        assert_eq!(
            location(Some("[::1]:80"), "/x", 443),
            (StatusCode::PERMANENT_REDIRECT, Some("https://[::1]/x".into()))
        );
    }

    #[test]
    fn no_usable_host_is_a_bad_request() {
        assert_eq!(location(None, "/", 443).0, StatusCode::BAD_REQUEST);
        assert_eq!(location(Some("a b"), "/", 443).0, StatusCode::BAD_REQUEST);
        assert_eq!(location(Some("x/y"), "/", 443).0, StatusCode::BAD_REQUEST);
    }
}
