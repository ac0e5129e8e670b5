//! Forwarding to upstreams (over [`crate::upstream::pool`]'s connections): hop-by-hop
//! headers, `X-Forwarded-*`, timeouts, and the request body limit.
//!
//! A request body up to the route's `buffer_body` is read whole before a
//! connection to the upstream is taken, so a slow client never holds one of
//! the upstream's workers; a larger body is streamed once that much has
//! arrived. Either way [`RequestBody`] enforces `max_body` and
//! `listen.body_read_timeout`, and time spent waiting on the client never
//! counts against the upstream's `timeout`. The upstream's response body goes
//! back untouched.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{PathAndQuery, Uri};
use http::{Response, StatusCode, Version};

use crate::config::Upstream;
use crate::upstream::pool::UpstreamBody;
use crate::upstream::tunnel;
use crate::wire::client::Peer;
use crate::wire::error::ProxyError;

mod body;
mod downstream;
pub use body::{BodyFailed, BodyFailure, BodyWatch, RequestBody};
pub use downstream::{AheadBudget, Downstream};

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
    // An upgrade tollgate tunnels is asked for again (crate::upstream::tunnel).
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

/// The request as the upstream gets it: origin-form target (with the
/// upstream's base path and the canonical path), hop-by-hop headers
/// stripped before tollgate's own are set (a header named in
/// `Connection` cannot remove `Host` or a header tollgate sets),
/// `X-Forwarded-*` and `Via`. Also says whether the request asks the
/// upstream to switch protocols.
///
/// It works on the head alone, leaving `down` as it was, so that a request
/// sent again is prepared again from the client's head (see
/// `Replay` in upstream/tries.rs).
pub(crate) fn prepare(
    parts: &mut http::request::Parts,
    down: &Downstream<'_>,
    upstream: &Upstream,
) -> Result<bool, ProxyError> {
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
    let upgrade = down.upgrade.clone().filter(|_| upstream.protocol == crate::config::Protocol::Http1);
    let upgrading = upgrade.is_some();
    if let Some(protocol) = upgrade {
        tunnel::ask_upstream(&mut parts.headers, protocol);
    }
    // The host that was matched goes to the upstream (virtual hosts
    // behind the proxy keep working): the client's Host, or the target's
    // authority (absolute form, HTTP/2's :authority).
    if let Some(h) = &down.host_header {
        parts.headers.insert(header::HOST, h.clone());
    }
    set_forwarded(&mut parts.headers, down.peer, down.host);
    crate::wire::via::append(&mut parts.headers, parts.version);
    // The pool speaks HTTP/1.1 to upstreams whatever the client spoke to
    // us.
    parts.version = Version::HTTP_11;
    Ok(upgrading)
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
        crate::wire::via::append(resp.headers_mut(), version);
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
    crate::wire::via::append(resp.headers_mut(), version);
    tunnel::answer_client(resp.headers_mut(), protocol);
    Ok(resp)
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
        .filter(|n| !request || (*n != header::HOST && *n != crate::wire::request_id::X_REQUEST_ID))
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
