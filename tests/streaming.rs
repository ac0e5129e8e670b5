//! Streaming stays whole: a response that streams (server-sent events, long
//! polls) lives by its upstream's timeout, not the client connection's idle
//! timeout; an upstream that goes silent mid-body past its timeout is cut
//! and counted as an upstream timeout; trailers pass both ways; a client
//! that goes away is counted as such, not as an upstream failure.

use crate::support;

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use support::{DEADLINE, Tollgate, config, eventually, metric};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A raw HTTP/1.1 upstream: reads each request's head (and a chunked body
/// to its end) and hands the request text and the socket to `answer`.
async fn raw_upstream<F, Fut>(answer: F) -> SocketAddr
where
    F: Fn(String, TcpStream) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let answer = std::sync::Arc::new(answer);
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let answer = answer.clone();
            tokio::spawn(async move {
                let request = read_message(&mut s).await;
                answer(request, s).await;
            });
        }
    });
    addr
}

/// Reads a message head, and a chunked body through its last chunk and
/// trailers.
async fn read_message(s: &mut TcpStream) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&got).to_lowercase();
        if let Some(end) = text.find("\r\n\r\n") {
            let chunked = text[..end].contains("transfer-encoding: chunked");
            if !chunked || text[end + 4..].contains("0\r\n") && text.ends_with("\r\n\r\n") && text.len() > end + 4 {
                return String::from_utf8_lossy(&got).into_owned();
            }
        }
        match tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
            _ => return String::from_utf8_lossy(&got).into_owned(),
        }
    }
}

/// Everything the server sends until it closes (or 15 s pass).
async fn read_to_close(s: &mut TcpStream) -> String {
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(15), s.read_to_end(&mut got)).await;
    String::from_utf8_lossy(&got).into_owned()
}

const EVENT_STREAM_HEAD: &[u8] =
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";

fn chunk(data: &str) -> Vec<u8> {
    format!("{:x}\r\n{data}\r\n", data.len()).into_bytes()
}

fn with(config: String, listen: &str, upstream_timeout: &str) -> String {
    config
        .replace("admin = \"127.0.0.1:0\"\n", &format!("admin = \"127.0.0.1:0\"\n{listen}"))
        .replace("timeout = \"10s\"", &format!("timeout = \"{upstream_timeout}\""))
}

#[tokio::test]
async fn an_event_stream_silent_longer_than_the_idle_timeout_arrives_whole() {
    let upstream = raw_upstream(|_, mut s| async move {
        let _ = s.write_all(EVENT_STREAM_HEAD).await;
        let _ = s.write_all(&chunk("data: 1\n\n")).await;
        // Silent for longer than the client connection's idle timeout,
        // well within the upstream's.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let _ = s.write_all(&chunk("data: 2\n\n")).await;
        let _ = s.write_all(b"0\r\n\r\n").await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    })
    .await;
    let tg = Tollgate::with(&with(config(upstream), "idle_timeout = \"1s\"\n", "10s"), &[]).await;
    let r = tg.get("/events").send().await;
    assert_eq!(r.status, 200);
    assert_eq!(r.text(), "data: 1\n\ndata: 2\n\n");
    let m = tg.metrics().await;
    assert_eq!(metric(&m, "tollgate_client_gone_total", &[]), Some(0.0));
}

#[tokio::test]
async fn an_upstream_silent_mid_body_past_its_timeout_is_cut_and_counted() {
    let upstream = raw_upstream(|_, mut s| async move {
        let _ = s.write_all(EVENT_STREAM_HEAD).await;
        let _ = s.write_all(&chunk("data: 1\n\n")).await;
        tokio::time::sleep(Duration::from_secs(6)).await;
        let _ = s.write_all(&chunk("data: 2\n\n")).await;
        let _ = s.write_all(b"0\r\n\r\n").await;
    })
    .await;
    let tg = Tollgate::with(&with(config(upstream), "", "1s"), &[]).await;
    let mut c = TcpStream::connect(tg.proxy_addr).await.expect("connect");
    c.write_all(b"GET /events HTTP/1.1\r\nhost: a\r\n\r\n").await.expect("write");
    let got = read_to_close(&mut c).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(got.contains("data: 1"), "{got}");
    // Cut after the upstream's timeout: the second event, and the end of
    // the chunked body, never came.
    assert!(!got.contains("data: 2"), "{got}");
    assert!(!got.ends_with("0\r\n\r\n"), "{got}");
    let m = tg.metrics().await;
    assert_eq!(metric(&m, "tollgate_upstream_errors_total", &[("upstream", "svc"), ("kind", "timeout")]), Some(1.0));
    assert_eq!(metric(&m, "tollgate_client_gone_total", &[]), Some(0.0));
}

#[tokio::test]
async fn trailers_pass_both_ways() {
    let upstream = raw_upstream(|request, mut s| async move {
        // The client's trailer, and what announced it, reached us; the
        // answer carries a trailer of its own, naming what it saw.
        let lower = request.to_lowercase();
        let saw = lower.contains("trailer: x-checksum") && lower.contains("\r\nx-checksum: abc\r\n");
        let te = lower.contains("\r\nte: trailers\r\n");
        let head = "HTTP/1.1 200 OK\r\ntrailer: x-result\r\ntransfer-encoding: chunked\r\n\r\n";
        let _ = s.write_all(head.as_bytes()).await;
        let _ = s.write_all(&chunk("body")).await;
        let _ = s.write_all(format!("0\r\nx-result: saw={saw} te={te}\r\n\r\n").as_bytes()).await;
    })
    .await;
    let tg = Tollgate::with(&config(upstream), &[]).await;
    let mut c = TcpStream::connect(tg.proxy_addr).await.expect("connect");
    let request = "POST /up HTTP/1.1\r\nhost: a\r\nte: trailers\r\ntrailer: x-checksum\r\n\
                   transfer-encoding: chunked\r\nconnection: close\r\n\r\n4\r\ndata\r\n0\r\nx-checksum: abc\r\n\r\n";
    c.write_all(request.as_bytes()).await.expect("write");
    let got = read_to_close(&mut c).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(got.to_lowercase().contains("\r\nx-result: saw=true te=true\r\n"), "{got}");
}

#[tokio::test]
async fn a_client_that_goes_away_mid_stream_is_counted_as_gone_not_as_an_upstream_failure() {
    let upstream = raw_upstream(|_, mut s| async move {
        let _ = s.write_all(EVENT_STREAM_HEAD).await;
        for i in 0..100 {
            if s.write_all(&chunk(&format!("data: {i}\n\n"))).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let tg = Tollgate::with(&config(upstream), &[]).await;
    let mut c = TcpStream::connect(tg.proxy_addr).await.expect("connect");
    c.write_all(b"GET /events HTTP/1.1\r\nhost: a\r\n\r\n").await.expect("write");
    let mut buf = [0u8; 1024];
    let n = tokio::time::timeout(DEADLINE, c.read(&mut buf)).await.expect("an answer in time").expect("read");
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    drop(c);
    eventually("the client's leaving is counted", || async {
        metric(&tg.metrics().await, "tollgate_client_gone_total", &[]) == Some(1.0)
    })
    .await;
    let m = tg.metrics().await;
    for kind in ["reset", "timeout", "connect"] {
        assert_eq!(metric(&m, "tollgate_upstream_errors_total", &[("upstream", "svc"), ("kind", kind)]), Some(0.0));
    }
}
