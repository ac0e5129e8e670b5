//! The upstream connection pool (`tollgate::upstream::pool`): what hyper-util's pooled
//! client did for us before, kept.

use crate::support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::Value;
use support::{Tollgate, Upstream, config};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const NO_RULES: &str = "";
const DEADLINE: Duration = Duration::from_secs(10);

/// Sends `request` as is on a new connection and reads until tollgate
/// closes it: the status and the body.
async fn raw(addr: SocketAddr, request: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(request).await.expect("write");
    let mut buf = Vec::new();
    tokio::time::timeout(DEADLINE, s.read_to_end(&mut buf)).await.expect("answer within the deadline").expect("read");
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text.get(9..12).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("no status line: {text:?}"));
    (status, text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default())
}

#[tokio::test]
async fn a_request_without_host_reaches_the_upstream_with_its_authority() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, NO_RULES).await;
    let (status, body) = raw(tg.proxy_addr, b"GET /x HTTP/1.0\r\n\r\n").await;
    assert_eq!(status, 200);
    let echo: Value = serde_json::from_str(&body).expect("echo");
    assert_eq!(echo["headers"]["host"][0], Value::from(upstream.addr.to_string()));
    assert_eq!(echo["path"], "/x");
}

#[tokio::test]
async fn responses_without_a_body_keep_their_connection() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, NO_RULES).await;
    for _ in 0..3 {
        assert_eq!(tg.call("HEAD", "/").send().await.status, 200);
        assert_eq!(tg.get("/").header("x-echo-status", "204").send().await.status, 204);
        assert_eq!(tg.get("/").header("x-echo-status", "304").send().await.status, 304);
    }
    assert_eq!((upstream.hits(), upstream.connections()), (9, 1));
}

/// An upstream that answers one request per connection, keeping it alive,
/// then closes it 50 ms later: idle connections die in the pool.
async fn closing_upstream() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    let connections = Arc::new(AtomicUsize::new(0));
    let counted = connections.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else { continue };
            counted.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    match s.read(&mut byte).await {
                        Ok(1) => head.push(byte[0]),
                        _ => return,
                    }
                }
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            });
        }
    });
    (addr, connections)
}

#[tokio::test]
async fn connections_the_upstream_closed_while_idle_are_not_used() {
    let (addr, connections) = closing_upstream().await;
    let tg = Tollgate::with(&config(addr), &[("rules.toml", NO_RULES)]).await;
    for i in 1..=3 {
        let r = tg.get("/").send().await;
        assert_eq!((r.status.as_u16(), r.text()), (200, "ok"), "request {i}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(connections.load(Ordering::SeqCst), 3);
}
