//! The first bytes of a connection to the TLS proxy listener: a TLS
//! handshake, or plain HTTP answered `400 plain_http_to_https_port`.
//!
//! A client that speaks plain HTTP to the HTTPS port (an `http://` URL with
//! the HTTPS port in it) would otherwise get a TLS alert, which curl reports
//! as "HTTP/0.9 when not allowed" and browsers as a broken connection.
//! nginx answers it 400 ("The plain HTTP request was sent to HTTPS port"),
//! and so does tollgate, with its JSON body. The first byte decides before
//! anything is read: a TLS connection starts with 0x16 (a handshake record),
//! an HTTP/1 request with a method's capital letter; anything else goes to
//! the TLS handshake, which refuses it as before.
//!
//! Everything here falls under the handshake's bound (`header_read_timeout`)
//! and holds the connection's `max_connections` slot; the plain request's
//! head is read up to [`MAX_HEAD`] bytes, and what follows it is read and
//! thrown away for at most [`LINGER`] (nginx's lingering close), so that
//! closing a socket with unread bytes does not reset the 400 away.

use std::net::SocketAddr;
use std::time::Duration;

use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{Instant, timeout_at};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::proxy::Proxy;
use crate::wire::error::ProxyError;

/// The most of a plain request's head read before it is answered: its
/// request line is all the answer and the access log need.
pub const MAX_HEAD: usize = 8 * 1024;

/// How long, and how many bytes, the rest of a plain request is read and
/// dropped after the 400 is written.
pub const LINGER: Duration = Duration::from_secs(1);
const LINGER_BYTES: usize = 1024 * 1024;

/// The TLS stream of a connection just accepted, once its handshake is done
/// within `within`; `None` when it failed, timed out, or was plain HTTP
/// (answered 400 here).
pub async fn accept(
    stream: TcpStream,
    acceptor: &TlsAcceptor,
    proxy: &Proxy,
    peer: SocketAddr,
    within: Duration,
) -> Option<TlsStream<TcpStream>> {
    let deadline = Instant::now() + within;
    let mut first = [0u8; 1];
    match timeout_at(deadline, stream.peek(&mut first)).await {
        // 0x16 is no letter: a TLS client always goes on to the handshake.
        Ok(Ok(1)) if first[0].is_ascii_uppercase() => {
            answer_plain(stream, proxy, peer, deadline).await;
            return None;
        }
        Ok(Ok(1)) => {}
        Ok(_) => return None,
        Err(_) => {
            tracing::debug!(%peer, "TLS handshake timed out");
            return None;
        }
    }
    match timeout_at(deadline, acceptor.accept(stream)).await {
        Ok(Ok(stream)) => Some(stream),
        Ok(Err(e)) => {
            tracing::debug!(error = %e, %peer, "TLS handshake failed");
            None
        }
        Err(_) => {
            tracing::debug!(%peer, "TLS handshake timed out");
            None
        }
    }
}

/// The TLS version `stream` negotiated, as OpenSSL and nginx's
/// `$ssl_protocol` name it.
pub fn version(stream: &TlsStream<TcpStream>) -> Option<&'static str> {
    match stream.get_ref().1.protocol_version()? {
        rustls::ProtocolVersion::TLSv1_3 => Some("TLSv1.3"),
        rustls::ProtocolVersion::TLSv1_2 => Some("TLSv1.2"),
        _ => None,
    }
}

/// Reads the plain request's head (until its blank line, [`MAX_HEAD`]
/// bytes or `deadline`), answers it 400, logs and counts it, and closes.
async fn answer_plain(mut stream: TcpStream, proxy: &Proxy, peer: SocketAddr, deadline: Instant) {
    proxy.metrics.tls_plain_http_total.inc();
    let mut head = Vec::with_capacity(1024);
    let _ = timeout_at(deadline, read_head(&mut stream, &mut head)).await;
    let request_id = crate::wire::request_id::generate();
    let mut pending = proxy.log_refused(&head, peer.ip(), &request_id);
    let resp = ProxyError::PlainHttpToTls.into_response(&request_id);
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let reason = parts.status.canonical_reason().unwrap_or("");
    let mut out = format!("HTTP/1.1 {} {reason}\r\n", parts.status.as_u16()).into_bytes();
    for (name, value) in &parts.headers {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(format!("content-length: {}\r\n\r\n", body.len()).as_bytes());
    out.extend_from_slice(&body);
    // Written even when the head's time ran out: the client, slow as it
    // is, learns why it is turned away.
    let sent = tokio::time::timeout(LINGER, stream.write_all(&out)).await;
    if let Some(p) = &mut pending {
        p.respond(parts.status.as_u16());
        if matches!(sent, Ok(Ok(()))) {
            p.sent(body.len() as u64);
        }
    }
    drop(pending);
    let _ = tokio::time::timeout(LINGER, stream.shutdown()).await;
    let _ = tokio::time::timeout(LINGER, drain(&mut stream)).await;
}

/// Appends what arrives to `head` until it holds a blank line or
/// [`MAX_HEAD`] bytes, or the client stops sending.
async fn read_head(stream: &mut TcpStream, head: &mut Vec<u8>) {
    let mut buf = [0u8; 2048];
    while head.len() < MAX_HEAD && !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n.min(MAX_HEAD - head.len())]),
        }
    }
}

/// Reads and drops up to [`LINGER_BYTES`] until the client closes.
async fn drain(stream: &mut TcpStream) {
    let mut buf = [0u8; 16 * 1024];
    let mut left = LINGER_BYTES;
    while left > 0 {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => left = left.saturating_sub(n),
        }
    }
}
