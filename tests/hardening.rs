//! The edge holds: oversized requests get their own status before any rule
//! counts them, slow and idle clients are cut off, garbage gets a 400, one
//! dead upstream leaves the others alone, and rules rewritten under load
//! never fail a request.

use crate::support;

use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use support::{DEADLINE, Tollgate, Upstream, config, eventually, statuses};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The default test config with extra `[listen]` keys and `max_body` on the
/// route.
fn hardened(upstream: &Upstream, listen: &str, max_body: &str) -> String {
    config(upstream.addr)
        .replace("admin = \"127.0.0.1:0\"\n", &format!("admin = \"127.0.0.1:0\"\n{listen}"))
        .replace("upstream = \"svc\"\n", &format!("upstream = \"svc\"\n{max_body}"))
}

const ONE_PER_MINUTE: &str =
    "[[rule]]\nname = \"tight\"\nkey = []\nalgorithm = \"fixed_window\"\nlimit = 1\nwindow = \"1m\"\n";

#[tokio::test]
async fn oversized_requests_get_414_431_413_and_count_nothing() {
    let upstream = Upstream::start().await;
    let cfg = hardened(&upstream, "max_uri_bytes = 1024\nmax_header_bytes = 2048\n", "max_body = 100\n");
    let tg = Tollgate::with(&cfg, &[("r.toml", ONE_PER_MINUTE)]).await;

    let long = format!("/{}", "a".repeat(1100));
    let r = tg.get(&long).send().await;
    assert_eq!(r.status, 414, "{}", r.text());
    assert_eq!(r.json()["error"], "uri_too_long");

    let r = tg.get("/").header("x-padding", &"p".repeat(2100)).send().await;
    assert_eq!(r.status, 431, "{}", r.text());
    assert_eq!(r.json()["error"], "request_header_fields_too_large");

    let r = tg.call("POST", "/").body(vec![b'x'; 101]).send().await;
    assert_eq!(r.status, 413, "{}", r.text());
    assert_eq!(r.json()["error"], "payload_too_large");

    // A body of exactly the limit passes, and it is the first request the
    // one-per-minute rule counted.
    let r = tg.call("POST", "/").body(vec![b'x'; 100]).send().await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.echo().body.len(), 100);
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test]
async fn a_streamed_body_over_the_limit_is_cut_off_with_413() {
    let upstream = Upstream::start().await;
    let cfg = hardened(&upstream, "", "max_body = \"1KiB\"\n");
    let tg = Tollgate::with(&cfg, &[]).await;
    // Chunked, no Content-Length: the limit can only be found while streaming.
    let mut s = TcpStream::connect(tg.proxy_addr).await.expect("connect");
    s.write_all(b"POST / HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n").await.expect("head");
    for _ in 0..2 {
        s.write_all(format!("258\r\n{}\r\n", "y".repeat(600)).as_bytes()).await.expect("chunk");
    }
    s.write_all(b"0\r\n\r\n").await.expect("end");
    let mut buf = vec![0u8; 4096];
    let n =
        tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await.expect("answer in time").expect("read");
    let head = String::from_utf8_lossy(&buf[..n]);
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    assert!(head.contains("payload_too_large"), "{head}");
}

#[tokio::test]
async fn malformed_requests_get_400() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, "").await;
    for garbage in [&b"GARBAGE\r\n\r\n"[..], b"GET / HTTP/1.1\r\nbad header line\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n"] {
        let mut s = TcpStream::connect(tg.proxy_addr).await.expect("connect");
        s.write_all(garbage).await.expect("write");
        let mut buf = vec![0u8; 1024];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await.expect("in time").expect("read");
        let head = String::from_utf8_lossy(&buf[..n]);
        assert!(
            head.starts_with("HTTP/1.1 400") || head.starts_with("HTTP/1.1 505"),
            "{:?}: {head}",
            String::from_utf8_lossy(garbage)
        );
    }
    assert_eq!(upstream.hits(), 0);
    // The server is still fine.
    assert_eq!(statuses(1, || tg.get("/")).await, [200]);
}

/// Reads until the server closes the connection; returns how long it took.
async fn time_to_close(s: &mut TcpStream, limit: Duration) -> Duration {
    let started = tokio::time::Instant::now();
    let mut buf = vec![0u8; 4096];
    loop {
        match tokio::time::timeout(limit, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return started.elapsed(),
            Ok(Ok(_)) => continue,
            Err(_) => panic!("the connection was still open after {limit:?}"),
        }
    }
}

#[tokio::test]
async fn slow_headers_are_cut_off() {
    let upstream = Upstream::start().await;
    let cfg = hardened(&upstream, "header_read_timeout = \"300ms\"\n", "");
    let tg = Tollgate::with(&cfg, &[]).await;
    let mut slow = TcpStream::connect(tg.proxy_addr).await.expect("connect");
    slow.write_all(b"GET / HTTP/1.1\r\nhost: t\r\nx-one: 1\r\n").await.expect("partial head");
    let took = time_to_close(&mut slow, Duration::from_secs(5)).await;
    assert!(took >= Duration::from_millis(250), "closed after {took:?}, before the timeout");
    // Others are served meanwhile and after.
    assert_eq!(statuses(2, || tg.get("/")).await, [200, 200]);
}

/// Sends `bytes` one at a time, `every` apart, until they run out or the
/// server closes; then reads until it closes. How long until it did.
async fn trickle_until_closed(s: &mut TcpStream, bytes: &[u8], every: Duration, limit: Duration) -> Duration {
    let started = tokio::time::Instant::now();
    for b in bytes {
        if s.write_all(&[*b]).await.is_err() {
            return started.elapsed();
        }
        tokio::time::sleep(every).await;
    }
    let rest = limit.saturating_sub(started.elapsed());
    started.elapsed() + time_to_close(s, rest).await
}

#[tokio::test]
async fn a_head_trickled_byte_by_byte_is_cut_off_at_header_read_timeout() {
    let upstream = Upstream::start().await;
    let cfg = hardened(&upstream, "header_read_timeout = \"400ms\"\n", "");
    let tg = Tollgate::with(&cfg, &[]).await;
    // Each byte moves the connection, so the idle timeout never comes: only
    // the header read timeout bounds it. Over HTTP/1.1, and in the HTTP/2
    // connection preface (which is read before either protocol takes the
    // connection).
    for head in [&b"GET / HTTP/1.1\r\nhost: t\r\nx-a: 1\r\n"[..], b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"] {
        let mut s = TcpStream::connect(tg.proxy_addr).await.expect("connect");
        let took = trickle_until_closed(&mut s, head, Duration::from_millis(150), Duration::from_secs(6)).await;
        let what = String::from_utf8_lossy(head);
        assert!(took >= Duration::from_millis(350), "{what:?}: closed after {took:?}, before the timeout");
        assert!(took < Duration::from_millis(1500), "{what:?}: closed after {took:?}, long past the timeout");
    }
}

#[tokio::test]
async fn header_read_timeout_bounds_http1_keep_alive_but_not_an_h2_connection_between_requests() {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let upstream = Upstream::start().await;
    let cfg = hardened(&upstream, "header_read_timeout = \"300ms\"\nidle_timeout = \"30s\"\n", "");
    let tg = Tollgate::with(&cfg, &[]).await;

    // HTTP/1.1: the wait for the next request is part of reading its head.
    let mut s = TcpStream::connect(tg.proxy_addr).await.expect("connect");
    s.write_all(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n").await.expect("request");
    let mut buf = vec![0u8; 8192];
    let n = tokio::time::timeout(DEADLINE, s.read(&mut buf)).await.expect("a response in time").expect("response");
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let took = time_to_close(&mut s, Duration::from_secs(5)).await;
    assert!(took >= Duration::from_millis(250), "closed after {took:?}, before the timeout");
    assert!(took < Duration::from_secs(2), "closed after {took:?}");

    // HTTP/2: a connection that has sent a request waits for the next one
    // up to the idle timeout (streams have no head to time).
    let io = TokioIo::new(TcpStream::connect(tg.proxy_addr).await.expect("connect"));
    let (mut send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await.expect("h2 handshake");
    tokio::spawn(conn);
    for _ in 0..2 {
        let req = hyper::Request::get(format!("http://{}/", tg.proxy_addr))
            .body(http_body_util::Empty::<Bytes>::new())
            .expect("request");
        let resp = send.send_request(req).await.expect("an h2 request on the open connection");
        assert_eq!(resp.status(), 200);
        resp.into_body().collect().await.expect("body");
        tokio::time::sleep(Duration::from_millis(900)).await;
    }
}

#[tokio::test]
async fn idle_keep_alive_connections_are_closed() {
    let upstream = Upstream::start().await;
    let cfg = hardened(&upstream, "idle_timeout = \"400ms\"\n", "");
    let tg = Tollgate::with(&cfg, &[]).await;
    let mut s = TcpStream::connect(tg.proxy_addr).await.expect("connect");
    s.write_all(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n").await.expect("request");
    let mut buf = vec![0u8; 8192];
    let n = tokio::time::timeout(DEADLINE, s.read(&mut buf)).await.expect("a response in time").expect("response");
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let took = time_to_close(&mut s, Duration::from_secs(5)).await;
    assert!(took >= Duration::from_millis(300), "closed after {took:?}, before the idle timeout");

    // A request that waits on a slow upstream is not idle.
    let mut s = TcpStream::connect(tg.proxy_addr).await.expect("connect");
    s.write_all(b"GET / HTTP/1.1\r\nhost: t\r\nx-echo-delay-ms: 1200\r\n\r\n").await.expect("request");
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await.expect("in time").expect("read");
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"), "{}", String::from_utf8_lossy(&buf[..n]));
}

#[tokio::test]
async fn one_dead_upstream_leaves_other_routes_alone() {
    let upstream = Upstream::start().await;
    let dead = Upstream::refusing_addr().await;
    let cfg = format!(
        "{}\n[[upstream]]\nname = \"dead\"\nurl = \"http://{dead}\"\n\n[[route]]\npath_prefix = \"/dead\"\nupstream = \"dead\"\n",
        config(upstream.addr)
    );
    let tg = Tollgate::with(&cfg, &[]).await;
    let replies = support::burst(40, |i| if i % 2 == 0 { tg.get("/dead/x") } else { tg.get("/alive") }).await;
    // Replies come back in completion order: count them.
    assert_eq!(support::count(&replies, 502), 20);
    assert_eq!(support::count(&replies, 200), 20);
    assert!(replies.iter().filter(|r| r.status == 200).all(|r| r.echo().path == "/alive"));
    let m = tg.metrics().await;
    assert_eq!(
        support::metric(&m, "tollgate_upstream_errors_total", &[("upstream", "dead"), ("kind", "connect")]),
        Some(20.0)
    );
}

#[tokio::test]
async fn rules_rewritten_50_times_under_load_never_fail_a_request() {
    let upstream = Upstream::start().await;
    let rule = |limit: u64| {
        format!(
            "[[rule]]\nname = \"churn\"\nkey = [\"ip\"]\nalgorithm = \"token_bucket\"\nlimit = {limit}\nwindow = \"1s\"\n"
        )
    };
    let tg = Tollgate::with(&config(upstream.addr), &[("r.toml", &rule(1_000_000))]).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let failures = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let served = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // 50 clients on their own keep-alive connections, each its own IP.
    let mut clients = Vec::new();
    for c in 0..50 {
        let (addr, stop, failures, served) = (tg.proxy_addr, stop.clone(), failures.clone(), served.clone());
        clients.push(tokio::spawn(async move {
            let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<http_body_util::Empty<Bytes>>();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let req = http::Request::get(format!("http://{addr}/load"))
                    .header("x-forwarded-for", format!("198.51.100.{c}"))
                    .body(http_body_util::Empty::new())
                    .expect("request");
                match client.request(req).await {
                    Ok(resp) if resp.status() == 200 => {
                        let _ = resp.into_body().collect().await;
                        served.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    _ => {
                        failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    let file = tg.rules_dir().join("r.toml");
    for i in 0..50u64 {
        let limit = 1_000_000 + i + 1;
        support::write_atomic(&file, &rule(limit));
        eventually(&format!("limit {limit} in force"), || async {
            tg.get("/probe").send().await.header("x-ratelimit-limit") == Some(limit.to_string().as_str())
        })
        .await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for c in clients {
        c.await.expect("client task");
    }
    assert_eq!(failures.load(std::sync::atomic::Ordering::Relaxed), 0, "failed requests while reloading");
    assert!(served.load(std::sync::atomic::Ordering::Relaxed) > 50, "the clients were actually busy");
    let m = tg.metrics().await;
    assert_eq!(support::metric(&m, "tollgate_rules_reloads_total", &[("result", "failure")]), Some(0.0));
}
