//! Request bodies: small ones are read whole before the upstream is
//! touched, slow clients are cut off with 408 after `body_read_timeout`, and
//! a client's slowness never counts against the upstream.

use crate::support;

use std::time::Duration;

use support::{DEADLINE, Tollgate, Upstream, metric};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Two routes to `svc` (upstream timeout `timeout`): `/buffered/` with the
/// default `buffer_body`, `/streamed/` with `buffer_body = 0`; `[listen]`
/// gets `listen` extra.
fn two_routes(upstream: &Upstream, timeout: &str, listen: &str) -> String {
    format!(
        r#"[listen]
proxy = "127.0.0.1:0"
admin = "127.0.0.1:0"
{listen}

[rules]
path = "rules"

[[upstream]]
name = "svc"
url = "http://{}"
timeout = "{timeout}"

[[route]]
path_prefix = "/buffered/"
upstream = "svc"

[[route]]
path_prefix = "/streamed/"
upstream = "svc"
buffer_body = 0
"#,
        upstream.addr
    )
}

/// Writes a request head announcing `len` body bytes.
async fn post_head(tg: &Tollgate, path: &str, len: usize) -> TcpStream {
    let mut s = TcpStream::connect(tg.proxy_addr).await.expect("connect");
    let head = format!("POST {path} HTTP/1.1\r\nhost: t\r\ncontent-length: {len}\r\n\r\n");
    s.write_all(head.as_bytes()).await.expect("head");
    s
}

/// Reads the response head (and whatever body came with it) as text.
async fn read_answer(s: &mut TcpStream) -> String {
    let mut buf = vec![0u8; 8192];
    let n = tokio::time::timeout(DEADLINE, s.read(&mut buf)).await.expect("answer in time").expect("read");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

fn upstream_errors(metrics: &str) -> f64 {
    ["connect", "timeout", "reset"]
        .iter()
        .map(|k| metric(metrics, "tollgate_upstream_errors_total", &[("upstream", "svc"), ("kind", k)]).unwrap_or(0.0))
        .sum()
}

#[tokio::test]
async fn a_trickled_upload_reaches_the_upstream_only_when_complete() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::with(&two_routes(&upstream, "10s", ""), &[]).await;
    let mut s = post_head(&tg, "/buffered/x", 8).await;
    for b in b"1234567" {
        s.write_all(&[*b]).await.expect("byte");
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    // Seven of eight bytes in: the upstream has not been touched.
    assert_eq!(upstream.connections(), 0, "a connection to the upstream was taken for a partial body");
    assert_eq!(upstream.hits(), 0);
    s.write_all(b"8").await.expect("last byte");
    let answer = read_answer(&mut s).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains(r#""body":"12345678""#), "{answer}");
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test]
async fn an_upload_slower_than_the_upstream_timeout_is_not_a_504() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::with(&two_routes(&upstream, "1s", ""), &[]).await;
    for path in ["/buffered/x", "/streamed/x"] {
        let mut s = post_head(&tg, path, 6).await;
        // 1.5 s of upload against a 1 s upstream timeout.
        for b in b"abcdef" {
            tokio::time::sleep(Duration::from_millis(250)).await;
            s.write_all(&[*b]).await.expect("byte");
        }
        let answer = read_answer(&mut s).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{path}: {answer}");
        assert!(answer.contains(r#""body":"abcdef""#), "{path}: {answer}");
    }
    assert_eq!(upstream_errors(&tg.metrics().await), 0.0);
}

#[tokio::test]
async fn a_body_that_stalls_gets_408_and_is_no_upstream_error() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::with(&two_routes(&upstream, "10s", "body_read_timeout = \"1s\""), &[]).await;
    for path in ["/buffered/x", "/streamed/x"] {
        let mut s = post_head(&tg, path, 10).await;
        s.write_all(b"abc").await.expect("part of the body");
        let answer = read_answer(&mut s).await;
        assert!(answer.starts_with("HTTP/1.1 408"), "{path}: {answer}");
        assert!(answer.contains("request_timeout"), "{path}: {answer}");
    }
    let metrics = tg.metrics().await;
    assert_eq!(upstream_errors(&metrics), 0.0, "{metrics}");
    assert_eq!(
        metric(&metrics, "tollgate_client_errors_total", &[("kind", "body_read_timeout")]),
        Some(2.0),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_malformed_chunked_body_is_a_400_and_a_client_error() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::with(&two_routes(&upstream, "10s", ""), &[]).await;
    for path in ["/buffered/x", "/streamed/x"] {
        let mut s = TcpStream::connect(tg.proxy_addr).await.expect("connect");
        let head = format!("POST {path} HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n");
        s.write_all(head.as_bytes()).await.expect("head");
        s.write_all(b"3\r\nabc\r\n").await.expect("good chunk");
        tokio::time::sleep(Duration::from_millis(50)).await;
        s.write_all(b"zz\r\nnot a chunk\r\n").await.expect("bad chunk");
        let answer = read_answer(&mut s).await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{path}: {answer}");
        assert!(answer.contains("bad_request"), "{path}: {answer}");
    }
    let metrics = tg.metrics().await;
    assert_eq!(upstream_errors(&metrics), 0.0, "{metrics}");
    assert_eq!(metric(&metrics, "tollgate_client_errors_total", &[("kind", "bad_body")]), Some(2.0), "{metrics}");
}

#[tokio::test]
async fn a_transfer_coding_tollgate_cannot_decode_is_a_501() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::with(&two_routes(&upstream, "10s", ""), &[]).await;
    for te in ["gzip, chunked", "deflate,chunked", "x-custom, chunked"] {
        let mut s = TcpStream::connect(tg.proxy_addr).await.expect("connect");
        let req =
            format!("POST /streamed/x HTTP/1.1\r\nhost: t\r\ntransfer-encoding: {te}\r\n\r\n3\r\nabc\r\n0\r\n\r\n");
        s.write_all(req.as_bytes()).await.expect("request");
        let answer = read_answer(&mut s).await;
        assert!(answer.starts_with("HTTP/1.1 501"), "{te}: {answer}");
        assert!(answer.contains("unsupported_transfer_encoding"), "{te}: {answer}");
    }
    assert_eq!(upstream.hits(), 0);
    // Plain chunked still passes.
    let mut s = TcpStream::connect(tg.proxy_addr).await.expect("connect");
    s.write_all(b"POST /streamed/x HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
        .await
        .expect("request");
    let answer = read_answer(&mut s).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains(r#""body":"abc""#), "{answer}");
}
