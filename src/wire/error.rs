//! Every answer tollgate gives instead of the upstream's, mapped to its
//! status and JSON body in one place.
//!
//! Bodies are short JSON objects with a stable `error` code, a sentence
//! for humans and the request's `request_id` (also sent as `X-Request-Id`,
//! see [`crate::wire::request_id`]); they never carry internal detail (addresses, store errors,
//! stack traces): those go to the logs and metrics.

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderMap, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::Full;
use serde_json::json;

use crate::wire::headers;
use crate::wire::request_id;

/// Why tollgate answers a request itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProxyError {
    /// A rule rejected the request.
    Limited { rule: String, limit: u64, window_seconds: u64, retry_after_seconds: u64 },
    /// A concurrency rule's slots are all held by requests in flight.
    TooManyInFlight { rule: String, limit: u64 },
    /// No route matches the host and path.
    NoRoute,
    /// A `[[deny]]` entry names the client.
    Forbidden,
    /// The request's JWT failed verification (the reason is safe to show).
    Unauthorized(&'static str),
    /// The request is malformed in a way only tollgate checks (e.g. a bad
    /// `cost_header` value).
    BadRequest(String),
    /// Plain HTTP sent to the proxy listener, which speaks TLS only
    /// (nginx's "plain HTTP request was sent to HTTPS port").
    PlainHttpToTls,
    /// The body is larger than the route allows.
    PayloadTooLarge,
    /// The client stopped sending its body for `listen.body_read_timeout`.
    RequestTimeout,
    /// The request's `Transfer-Encoding` names a coding tollgate cannot
    /// decode (anything but `chunked`).
    UnsupportedTransferEncoding,
    /// The request target is longer than `listen.max_uri_bytes`.
    UriTooLong,
    /// The header section is larger than `listen.max_header_bytes`.
    HeadersTooLarge,
    /// The store failed and the rule's policy is `deny`.
    StoreUnavailable { retry_after_seconds: u64 },
    /// The upstream refused, reset or broke the connection.
    BadGateway,
    /// The upstream did not answer within its timeout.
    GatewayTimeout,
    /// No server of the upstream could be tried.
    UpstreamUnavailable,
    /// Every server in service is at its `max_inflight`.
    UpstreamBusy,
    /// tollgate itself is out of file descriptors or ports.
    ProxyOverloaded,
}

impl ProxyError {
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::Limited { .. } | ProxyError::TooManyInFlight { .. } => StatusCode::TOO_MANY_REQUESTS,
            ProxyError::NoRoute => StatusCode::NOT_FOUND,
            ProxyError::Forbidden => StatusCode::FORBIDDEN,
            ProxyError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ProxyError::BadRequest(_) | ProxyError::PlainHttpToTls => StatusCode::BAD_REQUEST,
            ProxyError::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            ProxyError::UnsupportedTransferEncoding => StatusCode::NOT_IMPLEMENTED,
            ProxyError::UriTooLong => StatusCode::URI_TOO_LONG,
            ProxyError::HeadersTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ProxyError::StoreUnavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::BadGateway => StatusCode::BAD_GATEWAY,
            ProxyError::GatewayTimeout => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::UpstreamUnavailable | ProxyError::UpstreamBusy | ProxyError::ProxyOverloaded => {
                StatusCode::SERVICE_UNAVAILABLE
            }
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        match self {
            ProxyError::Limited { rule, limit, window_seconds, retry_after_seconds } => json!({
                "error": "too_many_requests",
                "rule": rule,
                "limit": limit,
                "window_seconds": window_seconds,
                "retry_after_seconds": retry_after_seconds,
                "message": format!("Rate limit exceeded: at most {limit} requests per {window_seconds} s under rule {rule:?}. Retry in {retry_after_seconds} s."),
            }),
            ProxyError::TooManyInFlight { rule, limit } => json!({
                "error": "too_many_requests",
                "rule": rule,
                "limit": limit,
                "concurrent": true,
                "retry_after_seconds": CONCURRENCY_RETRY_SECS,
                "message": in_flight_message(rule, *limit),
            }),
            ProxyError::NoRoute => json!({"error": "not_found", "message": "No route matches this host and path."}),
            ProxyError::Forbidden => json!({"error": "forbidden", "message": "This client is not allowed."}),
            ProxyError::Unauthorized(reason) => {
                json!({"error": "invalid_token", "message": format!("The bearer token was refused: {reason}.")})
            }
            ProxyError::BadRequest(reason) => json!({"error": "bad_request", "message": reason}),
            ProxyError::PlainHttpToTls => json!({
                "error": "plain_http_to_https_port",
                "message": "A plain HTTP request was sent to this HTTPS port; use an https:// URL."
            }),
            ProxyError::UriTooLong => {
                json!({"error": "uri_too_long", "message": "The request target is longer than this proxy accepts."})
            }
            ProxyError::HeadersTooLarge => json!({
                "error": "request_header_fields_too_large",
                "message": "The request headers are larger than this proxy accepts."
            }),
            ProxyError::PayloadTooLarge => {
                json!({"error": "payload_too_large", "message": "The request body is larger than this route accepts."})
            }
            ProxyError::RequestTimeout => json!({
                "error": "request_timeout",
                "message": "The request body stopped arriving before it was complete."
            }),
            ProxyError::UnsupportedTransferEncoding => json!({
                "error": "unsupported_transfer_encoding",
                "message": "This proxy only accepts Transfer-Encoding: chunked."
            }),
            ProxyError::StoreUnavailable { retry_after_seconds } => json!({
                "error": "rate_limiter_unavailable",
                "retry_after_seconds": retry_after_seconds,
                "message": "The rate limiter cannot decide right now; this route fails closed. Retry shortly.",
            }),
            ProxyError::BadGateway => {
                json!({"error": "bad_gateway", "message": "The upstream service could not be reached or broke the connection."})
            }
            ProxyError::GatewayTimeout => {
                json!({"error": "gateway_timeout", "message": "The upstream service did not answer in time."})
            }
            ProxyError::UpstreamUnavailable => json!({
                "error": "upstream_unavailable",
                "message": "Every server of the upstream service is down. Retry shortly."
            }),
            ProxyError::UpstreamBusy => json!({
                "error": "upstream_busy",
                "message": "Every server of the upstream service is at its limit of requests in flight. Retry shortly."
            }),
            ProxyError::ProxyOverloaded => json!({
                "error": "proxy_overloaded",
                "message": "This proxy is out of connections to the upstream service. Retry shortly."
            }),
        }
    }

    /// `Retry-After` of this answer, in seconds; `None` for answers that
    /// have none.
    pub fn retry_after(&self) -> Option<u64> {
        match self {
            ProxyError::Limited { retry_after_seconds, .. } | ProxyError::StoreUnavailable { retry_after_seconds } => {
                Some(*retry_after_seconds)
            }
            ProxyError::TooManyInFlight { .. } => Some(CONCURRENCY_RETRY_SECS),
            ProxyError::UpstreamBusy | ProxyError::ProxyOverloaded => Some(1),
            _ => None,
        }
    }

    /// The JSON body with the request's id, rendered.
    fn body_bytes(&self, request_id: &HeaderValue) -> Bytes {
        match self {
            // The flood path: written directly instead of through a JSON
            // tree (a handful of allocations fewer per rejection).
            ProxyError::Limited { rule, limit, window_seconds, retry_after_seconds } => {
                limited_body(rule, *limit, *window_seconds, *retry_after_seconds, request_id)
            }
            _ => {
                let mut body = self.body();
                if let Some(fields) = body.as_object_mut() {
                    // Visible ASCII (see `request_id::acceptable`): `to_str` cannot fail.
                    fields.insert("request_id".into(), request_id.to_str().unwrap_or_default().into());
                }
                Bytes::from(body.to_string())
            }
        }
    }

    /// The 429 of a request whose only matching rule (`report`) rejected
    /// it, with the headers prebuilt for the rule's plan (see
    /// [`headers::RejectHead`]): the same response as
    /// [`ProxyError::into_response`] followed by [`headers::write`], for a
    /// clone instead of nine map insertions.
    pub fn into_limited_response(
        self,
        request_id: &HeaderValue,
        head: &headers::RejectHead,
        report: &impl headers::Report,
    ) -> Response<Full<Bytes>> {
        let Some(retry) = self.retry_after().filter(|_| self.status() == StatusCode::TOO_MANY_REQUESTS) else {
            let mut resp = self.into_response(request_id);
            headers::write(resp.headers_mut(), std::slice::from_ref(report), 0);
            return resp;
        };
        let mut resp = Response::new(Full::new(self.body_bytes(request_id)));
        *resp.status_mut() = StatusCode::TOO_MANY_REQUESTS;
        *resp.headers_mut() = head.render(request_id, retry, report);
        resp
    }

    /// The full response, without rate-limit headers (the proxy adds those),
    /// for the request `request_id`.
    pub fn into_response(self, request_id: &HeaderValue) -> Response<Full<Bytes>> {
        let retry = self.retry_after();
        let body = self.body_bytes(request_id);
        let mut resp = Response::new(Full::new(body));
        if let ProxyError::Limited { .. } | ProxyError::TooManyInFlight { .. } = self {
            // Room for the headers of a 429 (the proxy adds the rate-limit
            // ones): the map is allocated once instead of grown twice.
            *resp.headers_mut() = HeaderMap::with_capacity(LIMITED_HEADERS);
        }
        *resp.status_mut() = self.status();
        resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        resp.headers_mut().insert(request_id::X_REQUEST_ID, request_id.clone());
        if let Some(secs) = retry {
            headers::write_retry_after(resp.headers_mut(), secs);
        }
        if matches!(
            self,
            ProxyError::RequestTimeout | ProxyError::UnsupportedTransferEncoding | ProxyError::PlainHttpToTls
        ) {
            // The rest of the body was not read: the connection cannot carry
            // another request.
            resp.headers_mut().insert(http::header::CONNECTION, HeaderValue::from_static("close"));
        }
        if matches!(self, ProxyError::Unauthorized(_)) {
            resp.headers_mut()
                .insert(http::header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer error=\"invalid_token\""));
        }
        resp
    }
}

/// The problem type of a quota exceeded (the IETF rate-limit headers
/// draft, registered with IANA).
pub const QUOTA_EXCEEDED: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// Whether the client's `Accept` asks for RFC 9457 problem details
/// (`application/problem+json`, not at `q=0`).
pub fn accepts_problem(headers: &HeaderMap) -> bool {
    // Most clients send `*/*` or a short list: a value shorter than the
    // media type cannot name it, and is not split at all.
    const MEDIA_TYPE_LEN: usize = "application/problem+json".len();
    headers
        .get_all(http::header::ACCEPT)
        .iter()
        .filter(|v| v.len() >= MEDIA_TYPE_LEN)
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|range| {
            let mut parts = range.split(';').map(str::trim);
            parts.next().is_some_and(|t| t.eq_ignore_ascii_case("application/problem+json"))
                && !parts.any(|p| {
                    p.split_once('=')
                        .is_some_and(|(k, v)| k.trim().eq_ignore_ascii_case("q") && v.trim().parse::<f32>() == Ok(0.0))
                })
        })
}

impl ProxyError {
    /// A rejection as RFC 9457 problem details (`application/problem+json`)
    /// with the quota-exceeded type and its `violated-policies` (the rules
    /// the request is over), for clients that ask for them; the other
    /// answers keep their JSON body. Also carries the fields of the plain
    /// JSON body, so a client reads the same facts either way.
    pub fn into_problem_response(self, request_id: &HeaderValue, violated: &[&str]) -> Response<Full<Bytes>> {
        let (body, retry) = match &self {
            ProxyError::Limited { rule, limit, window_seconds, retry_after_seconds } => (
                json!({
                    "type": QUOTA_EXCEEDED,
                    "title": "Request cannot be satisfied as assigned quota has been exceeded",
                    "status": 429,
                    "detail": format!("Rate limit exceeded: at most {limit} requests per {window_seconds} s under rule {rule:?}. Retry in {retry_after_seconds} s."),
                    "violated-policies": violated,
                    "rule": rule,
                    "limit": limit,
                    "window_seconds": window_seconds,
                    "retry_after_seconds": retry_after_seconds,
                    "request_id": request_id.to_str().unwrap_or_default(),
                }),
                *retry_after_seconds,
            ),
            ProxyError::TooManyInFlight { rule, limit } => (
                json!({
                    "type": QUOTA_EXCEEDED,
                    "title": "Request cannot be satisfied as assigned quota has been exceeded",
                    "status": 429,
                    "detail": in_flight_message(rule, *limit),
                    "violated-policies": violated,
                    "rule": rule,
                    "limit": limit,
                    "concurrent": true,
                    "retry_after_seconds": CONCURRENCY_RETRY_SECS,
                    "request_id": request_id.to_str().unwrap_or_default(),
                }),
                CONCURRENCY_RETRY_SECS,
            ),
            _ => return self.into_response(request_id),
        };
        let mut resp = Response::new(Full::new(Bytes::from(body.to_string())));
        *resp.headers_mut() = HeaderMap::with_capacity(LIMITED_HEADERS);
        *resp.status_mut() = StatusCode::TOO_MANY_REQUESTS;
        resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        resp.headers_mut().insert(request_id::X_REQUEST_ID, request_id.clone());
        headers::write_retry_after(resp.headers_mut(), retry);
        resp
    }
}

/// `Retry-After` of a concurrency rejection: a slot comes back when some
/// request ends, which may be any moment.
const CONCURRENCY_RETRY_SECS: u64 = crate::limiter::CONCURRENCY_RETRY / crate::limiter::NANOS_PER_SEC;

fn in_flight_message(rule: &str, limit: u64) -> String {
    format!(
        "Too many requests in flight: at most {limit} at once under rule {rule:?}. Retry in {CONCURRENCY_RETRY_SECS} s."
    )
}

/// The headers of a 429: `Content-Type`, `X-Request-Id`, `Retry-After` and
/// `X-RateLimit-Retry-After`, the `X-RateLimit-*` trio, `RateLimit-Policy`
/// and `RateLimit`.
const LIMITED_HEADERS: usize = 9;

/// The 429 body, byte for byte what `serde_json` renders for
/// [`ProxyError::body`]. Rule names are validated to printable ASCII without
/// `"` or `\`, so they need no JSON escaping (checked in debug builds).
fn limited_body(rule: &str, limit: u64, window: u64, retry: u64, request_id: &HeaderValue) -> Bytes {
    debug_assert!(rule.bytes().all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\'));
    // Pieces and itoa digits rather than `write!`, which made this body
    // cost some 1,800 instructions per rejection; written at its exact
    // length, the buffer becomes the body without another allocation.
    let (mut l, mut w, mut r) = (itoa::Buffer::new(), itoa::Buffer::new(), itoa::Buffer::new());
    let (limit, window, retry) = (l.format(limit), w.format(window), r.format(retry));
    let pieces = [
        r#"{"error":"too_many_requests","rule":""#,
        rule,
        r#"","limit":"#,
        limit,
        r#","window_seconds":"#,
        window,
        r#","retry_after_seconds":"#,
        retry,
        r#","message":"Rate limit exceeded: at most "#,
        limit,
        " requests per ",
        window,
        r#" s under rule \""#,
        rule,
        r#"\". Retry in "#,
        retry,
        r#" s.","request_id":""#,
    ];
    // The id's escapes (rare: `"` or `\` from a trusted proxy) may need a
    // few more bytes than its length.
    let len = pieces.iter().map(|p| p.len()).sum::<usize>() + request_id.len() + 2;
    let mut s = Vec::with_capacity(len);
    for piece in pieces {
        s.extend_from_slice(piece.as_bytes());
    }
    request_id::push_json(&mut s, request_id);
    s.extend_from_slice(br#""}"#);
    Bytes::from(s)
}

/// Why the admin listener refuses a request it understood.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdminError {
    /// `/top` with `[admin] top_keys = 0`.
    TopOff,
    /// `/top?rule=` names no rule in force.
    UnknownRule(String),
    /// `/top?n=` is not a whole number from 1 to `[admin] top_keys`.
    BadCount { given: String, max: usize },
    /// `/top?by=` is neither `requests` nor `limited`.
    BadBy(String),
    /// A `/blocks` request that does not say what to block or lift.
    BadBlock(String),
    /// `DELETE /blocks` of a key that is not in the penalty box.
    NotBlocked { rule: String, key: String },
    /// The store did not take or answer a `/blocks` request.
    StoreFailed(String),
}

impl AdminError {
    pub fn status(&self) -> StatusCode {
        match self {
            AdminError::TopOff | AdminError::NotBlocked { .. } => StatusCode::NOT_FOUND,
            AdminError::UnknownRule(_)
            | AdminError::BadCount { .. }
            | AdminError::BadBy(_)
            | AdminError::BadBlock(_) => StatusCode::BAD_REQUEST,
            AdminError::StoreFailed(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        match self {
            AdminError::TopOff => json!({
                "error": "top_off",
                "message": "/top is off: [admin] top_keys = 0 in the config file."
            }),
            AdminError::UnknownRule(rule) => json!({
                "error": "unknown_rule",
                "message": format!("No rule named {rule:?} is in force; /rules lists them."),
            }),
            AdminError::BadCount { given, max } => json!({
                "error": "bad_n",
                "message": format!("n must be a whole number from 1 to {max} ([admin] top_keys), not {given:?}."),
            }),
            AdminError::BadBy(given) => json!({
                "error": "bad_by",
                "message": format!("by must be \"requests\" or \"limited\", not {given:?}."),
            }),
            AdminError::BadBlock(why) => json!({"error": "bad_block", "message": why}),
            AdminError::NotBlocked { rule, key } => json!({
                "error": "not_blocked",
                "message": format!("{key:?} is not in the penalty box of rule {rule:?}."),
            }),
            AdminError::StoreFailed(why) => json!({
                "error": "store_unavailable",
                "message": format!("The store did not answer: {why}"),
            }),
        }
    }

    pub fn into_response(self) -> Response<Full<Bytes>> {
        json_response(self.status(), &self.body())
    }
}

/// A JSON response for the admin listener and other internal answers.
pub fn json_response(status: StatusCode, value: &serde_json::Value) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(value.to_string())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fast_429_body_is_what_serde_json_writes() {
        let e = ProxyError::Limited {
            rule: "login-by-ip (v2) /api/*".into(),
            limit: 5,
            window_seconds: 60,
            retry_after_seconds: 12,
        };
        let id = HeaderValue::from_static("req-\"1\"");
        let fast = limited_body("login-by-ip (v2) /api/*", 5, 60, 12, &id);
        let mut slow = e.body();
        slow["request_id"] = "req-\"1\"".into();
        assert_eq!(std::str::from_utf8(&fast).expect("utf-8"), slow.to_string());
    }
}
