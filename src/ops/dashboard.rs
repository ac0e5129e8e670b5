//! The dashboard: one HTML page on the admin listener (`/`), with its
//! style and script inline so that it works offline and behind any proxy.
//! It holds no state of its own: every few seconds it reads the admin JSON
//! endpoints (`/rules`, `/top`, `/upstreams`, `/healthz/store`, `/blocks`)
//! and computes rates from their counters, as an operator would with curl.

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderValue};
use http::{HeaderName, Response};
use http_body_util::Full;

const PAGE: &str = include_str!("dashboard.html");

/// What the page may do: run its own inline script and style, and fetch
/// from the listener that served it; nothing from elsewhere, and no
/// framing by another site.
const POLICY: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; frame-ancestors 'none'";

/// `/`: the dashboard page.
pub fn page() -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from_static(PAGE.as_bytes())));
    let h = resp.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8"));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(HeaderName::from_static("content-security-policy"), HeaderValue::from_static(POLICY));
    h.insert(HeaderName::from_static("x-content-type-options"), HeaderValue::from_static("nosniff"));
    resp
}
