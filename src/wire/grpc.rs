//! tollgate's own answers in gRPC's form, for gRPC clients.
//!
//! A gRPC client reads `grpc-status`, not the HTTP status: a 429 reaches
//! it as `UNAVAILABLE` ("Received http2 header with status: 429"), which
//! the default retry policies retry at once, so a limit would turn into a
//! retry storm against itself. A request whose `content-type` starts with
//! `application/grpc` (gRPC, and gRPC-Web, whose clients read the same
//! answer) gets a trailers-only response instead: HTTP 200, no body, one
//! header block carrying `grpc-status`, `grpc-message` (the JSON body's
//! `message`, which names the rule), the rate-limit headers and
//! `retry-after` as metadata, and, when there is a time to wait, a
//! `google.rpc.Status` with a `google.rpc.RetryInfo` in
//! `grpc-status-details-bin` (what `grpcio-status` and the other rich-error
//! libraries read).
//!
//! Every [`ProxyError`] maps to a code in one table, [`code`] (the
//! README's "gRPC clients" section repeats it): `RESOURCE_EXHAUSTED` for
//! a limit, `UNAVAILABLE` only for what is unavailable (the store under
//! `on_error = "deny"`, the upstream's servers, this proxy's connections),
//! since clients retry it.

use base64::Engine as _;
use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Response, StatusCode};
use http_body_util::Full;

use crate::wire::error::ProxyError;
use crate::wire::headers;
use crate::wire::request_id;

pub const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
pub const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
pub const GRPC_STATUS_DETAILS_BIN: HeaderName = HeaderName::from_static("grpc-status-details-bin");

/// The gRPC status codes tollgate answers with (the numbers are gRPC's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    InvalidArgument = 3,
    DeadlineExceeded = 4,
    PermissionDenied = 7,
    ResourceExhausted = 8,
    Unimplemented = 12,
    Unavailable = 14,
    Unauthenticated = 16,
}

/// The gRPC code of each answer: the one table.
pub fn code(e: &ProxyError) -> Code {
    match e {
        // A rate limit or a concurrency limit: the quota is exhausted. Not
        // retried by default policies; the client waits out RetryInfo.
        ProxyError::Limited { .. } | ProxyError::TooManyInFlight { .. } => Code::ResourceExhausted,
        // Sizes over this proxy's limits: gRPC's own answer to a message or
        // metadata over its receiver's limits.
        ProxyError::PayloadTooLarge | ProxyError::UriTooLong | ProxyError::HeadersTooLarge => Code::ResourceExhausted,
        // No route: gRPC's reading of a 404 (the method is not served here).
        ProxyError::NoRoute | ProxyError::UnsupportedTransferEncoding => Code::Unimplemented,
        ProxyError::Forbidden => Code::PermissionDenied,
        ProxyError::Unauthorized(_) => Code::Unauthenticated,
        ProxyError::BadRequest(_) | ProxyError::PlainHttpToTls => Code::InvalidArgument,
        ProxyError::RequestTimeout | ProxyError::GatewayTimeout => Code::DeadlineExceeded,
        // What is unavailable for now, and worth retrying.
        ProxyError::StoreUnavailable { .. }
        | ProxyError::BadGateway
        | ProxyError::UpstreamUnavailable
        | ProxyError::UpstreamBusy
        | ProxyError::ProxyOverloaded => Code::Unavailable,
    }
}

/// The request's `content-type` when it is gRPC's (`application/grpc`,
/// `application/grpc+proto`, `application/grpc-web`, ...): the answer
/// carries the same one. Every gRPC call is a POST: any other method is
/// answered without a header lookup (the GETs of most traffic).
pub fn content_type<'h>(method: &Method, headers: &'h HeaderMap) -> Option<&'h HeaderValue> {
    const GRPC: &[u8] = b"application/grpc";
    if method != Method::POST {
        return None;
    }
    headers.get(CONTENT_TYPE).filter(|v| v.as_bytes().get(..GRPC.len()).is_some_and(|p| p.eq_ignore_ascii_case(GRPC)))
}

impl ProxyError {
    /// The trailers-only gRPC answer (see the module's documentation),
    /// without the rate-limit headers (the proxy adds those, as to the
    /// JSON answer). `content_type` is the request's.
    pub fn into_grpc_response(self, request_id: &HeaderValue, content_type: HeaderValue) -> Response<Full<Bytes>> {
        let code = code(&self);
        let message = self.body().get("message").and_then(|m| m.as_str()).unwrap_or_default().to_string();
        let retry = self.retry_after();
        let mut resp = Response::new(Full::new(Bytes::new()));
        *resp.status_mut() = StatusCode::OK;
        let h = resp.headers_mut();
        h.insert(CONTENT_TYPE, content_type);
        h.insert(GRPC_STATUS, HeaderValue::from(code as u16));
        // Percent-encoded: always a valid header value.
        if let Ok(v) = HeaderValue::from_str(&percent_encode(&message)) {
            h.insert(GRPC_MESSAGE, v);
        }
        // Base64: always a valid header value.
        if let Ok(v) = HeaderValue::from_str(&status_details(code, &message, retry)) {
            h.insert(GRPC_STATUS_DETAILS_BIN, v);
        }
        h.insert(request_id::X_REQUEST_ID, request_id.clone());
        if let Some(secs) = retry {
            headers::write_retry_after(h, secs);
        }
        resp
    }
}

/// `grpc-message`'s encoding: UTF-8, with `%` and every byte outside
/// printable ASCII percent-encoded.
fn percent_encode(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for b in message.bytes() {
        if (b' '..=b'~').contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `google.rpc.Status` (google/rpc/status.proto).
#[derive(Clone, PartialEq, prost::Message)]
struct RpcStatus {
    #[prost(int32, tag = "1")]
    code: i32,
    #[prost(string, tag = "2")]
    message: String,
    #[prost(message, repeated, tag = "3")]
    details: Vec<prost_types::Any>,
}

/// `google.rpc.RetryInfo` (google/rpc/error_details.proto).
#[derive(Clone, PartialEq, prost::Message)]
struct RetryInfo {
    #[prost(message, optional, tag = "1")]
    retry_delay: Option<prost_types::Duration>,
}

const RETRY_INFO_TYPE: &str = "type.googleapis.com/google.rpc.RetryInfo";

/// `grpc-status-details-bin`: the status, with a `RetryInfo` when there is
/// a time to wait, as unpadded base64 (gRPC's `-bin` metadata).
fn status_details(code: Code, message: &str, retry_after_secs: Option<u64>) -> String {
    use prost::Message as _;
    let details = retry_after_secs
        .map(|secs| prost_types::Any {
            type_url: RETRY_INFO_TYPE.to_string(),
            value: RetryInfo {
                retry_delay: Some(prost_types::Duration {
                    seconds: i64::try_from(secs.max(1)).unwrap_or(i64::MAX),
                    nanos: 0,
                }),
            }
            .encode_to_vec(),
        })
        .into_iter()
        .collect();
    let status = RpcStatus { code: code as i32, message: message.to_string(), details };
    base64::engine::general_purpose::STANDARD_NO_PAD.encode(status.encode_to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_is_resource_exhausted_with_its_retry_delay() {
        let e = ProxyError::Limited { rule: "login".into(), limit: 5, window_seconds: 900, retry_after_seconds: 42 };
        let resp =
            e.into_grpc_response(&HeaderValue::from_static("id-1"), HeaderValue::from_static("application/grpc"));
        let h = resp.headers();
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(h["grpc-status"], "8");
        assert_eq!(h["content-type"], "application/grpc");
        assert_eq!(h["retry-after"], "42");
        let message = h["grpc-message"].to_str().expect("ascii");
        assert!(message.contains(r#"under rule "login""#), "{message}");
        let bin = base64::engine::general_purpose::STANDARD_NO_PAD
            .decode(h["grpc-status-details-bin"].as_bytes())
            .expect("base64");
        let status = <RpcStatus as prost::Message>::decode(bin.as_slice()).expect("a google.rpc.Status");
        assert_eq!(status.code, 8);
        assert_eq!(status.details[0].type_url, RETRY_INFO_TYPE);
        let retry = <RetryInfo as prost::Message>::decode(status.details[0].value.as_slice()).expect("RetryInfo");
        assert_eq!(retry.retry_delay.map(|d| d.seconds), Some(42));
    }

    #[test]
    fn grpc_content_types_are_recognised_and_others_are_not() {
        let mut h = HeaderMap::new();
        for (ct, grpc) in [
            ("application/grpc", true),
            ("application/grpc+proto", true),
            ("application/grpc-web-text", true),
            ("Application/GRPC", true),
            ("application/json", false),
            ("application/grp", false),
        ] {
            h.insert(CONTENT_TYPE, HeaderValue::from_static(ct));
            assert_eq!(content_type(&Method::POST, &h).is_some(), grpc, "{ct}");
        }
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        assert_eq!(content_type(&Method::GET, &h), None);
    }

    #[test]
    fn messages_are_percent_encoded() {
        assert_eq!(percent_encode("50% über"), "50%25 %C3%BCber");
    }
}
