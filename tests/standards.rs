//! The current standards: a rejection as RFC 9457 problem details with the
//! IETF quota-exceeded type for clients that ask for it (today's JSON for
//! the others), and the rate-limit draft's rule for intermediaries: an
//! upstream's own `RateLimit` / `RateLimit-Policy` items are kept beside
//! tollgate's, and its `X-RateLimit-*` never become more permissive.

use crate::support;

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::Value;
use support::{Tollgate, Upstream, config};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const TWO: &str = "[[rule]]\nname = \"per-ip\"\nkey = [\"ip\"]\nalgorithm = \"fixed_window\"\nlimit = 2\nwindow = \"1m\"\n\n\
     [[rule]]\nname = \"global\"\nkey = []\nalgorithm = \"fixed_window\"\nlimit = 2\nwindow = \"1m\"\n";

#[tokio::test]
async fn a_client_that_accepts_problem_details_gets_them_with_every_violated_policy() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, TWO).await;
    for _ in 0..2 {
        assert_eq!(tg.get("/").send().await.status, 200);
    }
    let r = tg.get("/").header("accept", "application/json, application/problem+json;q=0.9").send().await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    let p: Value = r.json();
    assert_eq!(p["type"], "https://iana.org/assignments/http-problem-types#quota-exceeded");
    assert_eq!(p["status"], 429);
    assert_eq!(p["violated-policies"], serde_json::json!(["per-ip", "global"]));
    assert_eq!(p["request_id"].as_str(), r.header("x-request-id"));
    assert!(r.header("retry-after").is_some());
    assert!(r.header("ratelimit").is_some());

    // Not asked for (or refused with q=0): today's body.
    for accept in [None, Some("application/problem+json;q=0")] {
        let call = tg.get("/");
        let r = match accept {
            Some(a) => call.header("accept", a).send().await,
            None => call.send().await,
        };
        assert_eq!(r.status, 429);
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(r.json()["error"], "too_many_requests");
    }
}

/// An upstream that answers every request with `headers`.
async fn upstream_with(headers: &'static str) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                loop {
                    match tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await {
                        Ok(Ok(n)) if n > 0 => {}
                        _ => return,
                    }
                    let head = format!("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n{headers}\r\n");
                    if s.write_all(head.as_bytes()).await.is_err() || s.write_all(b"ok").await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

#[tokio::test]
async fn an_upstreams_own_rate_limit_headers_are_kept_and_never_made_more_permissive() {
    let stricter = upstream_with(
        "ratelimit-policy: \"app\";q=10;w=1\r\nratelimit: \"app\";r=0;t=1\r\n\
         x-ratelimit-limit: 10\r\nx-ratelimit-remaining: 0\r\nx-ratelimit-reset: 1\r\n",
    )
    .await;
    let tg = Tollgate::with(&config(stricter), &[("r.toml", TWO)]).await;
    let r = tg.get("/").send().await;
    assert_eq!(r.status, 200);
    let all =
        |name: &str| r.headers.get_all(name).iter().map(|v| v.to_str().expect("text").to_string()).collect::<Vec<_>>();
    // Both lists, the upstream's items first.
    assert_eq!(all("ratelimit-policy"), ["\"app\";q=10;w=1", "\"per-ip\";q=2;w=60, \"global\";q=2;w=60"]);
    assert_eq!(all("ratelimit"), ["\"app\";r=0;t=1", "\"per-ip\";r=1;t=60, \"global\";r=1;t=60"]);
    // The upstream's trio says less remains than tollgate's: it stays.
    assert_eq!((r.header("x-ratelimit-limit"), r.header("x-ratelimit-remaining")), (Some("10"), Some("0")));

    // An upstream with more left than tollgate: tollgate's trio, which is
    // the stricter.
    let looser =
        upstream_with("x-ratelimit-limit: 1000\r\nx-ratelimit-remaining: 999\r\nx-ratelimit-reset: 1\r\n").await;
    let tg = Tollgate::with(&config(looser), &[("r.toml", TWO)]).await;
    let r = tg.get("/").send().await;
    assert_eq!(r.status, 200);
    assert_eq!((r.header("x-ratelimit-limit"), r.header("x-ratelimit-remaining")), (Some("2"), Some("1")));
    assert_eq!(r.headers.get_all("x-ratelimit-remaining").iter().count(), 1);
}
