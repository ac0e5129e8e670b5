//! `X-Request-Id` and `Via`: an id from a trusted proxy is kept, anyone
//! else's replaced; the id reaches the upstream and every answer tollgate
//! writes itself; tollgate names itself in `Via` both ways, with the
//! protocol version of each hop.

use crate::support;

use std::collections::HashSet;

use support::{Tollgate, Upstream, config};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const LIMITED: &str = r#"
[[rule]]
name = "two-per-minute"
match = { path = "/limited" }
key = ["ip"]
limit = 2
window = "1m"
"#;

/// The default test config without trusted proxies: the test client at
/// 127.0.0.1 is then an ordinary client.
fn untrusted(upstream: &Upstream) -> String {
    config(upstream.addr).replace("trusted_proxies = [\"127.0.0.1/32\"]", "trusted_proxies = []")
}

/// Whether `id` is one tollgate made: 16 hex digits, '-', 16 hex digits.
fn generated(id: &str) -> bool {
    let b = id.as_bytes();
    b.len() == 33 && b[16] == b'-' && b.iter().enumerate().all(|(i, c)| i == 16 || c.is_ascii_hexdigit())
}

#[tokio::test]
async fn a_trusted_proxys_id_is_kept_and_reaches_the_upstream() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, "").await;
    let r = tg.get("/").header("x-request-id", "lb-7f3a/42:{x}").send().await;
    assert_eq!(r.status, 200);
    assert_eq!(r.echo().header("x-request-id"), Some("lb-7f3a/42:{x}"));
}

#[tokio::test]
async fn an_unacceptable_id_from_a_trusted_proxy_is_replaced() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, "").await;
    let long = "a".repeat(129);
    for bad in [long.as_str(), "has space", ""] {
        let echo = tg.get("/").header("x-request-id", bad).send().await.echo();
        let got = echo.header("x-request-id").expect("an id upstream");
        assert!(generated(got), "{bad:?} replaced by {got:?}");
    }
    // Two ids: neither is believed.
    let echo = tg.get("/").header("x-request-id", "one").header("x-request-id", "two").send().await.echo();
    assert!(generated(echo.header("x-request-id").expect("one id upstream")));
}

#[tokio::test]
async fn an_untrusted_clients_id_is_replaced_by_a_fresh_one() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::with(&untrusted(&upstream), &[("r.toml", "")]).await;
    let mut seen = HashSet::new();
    for _ in 0..20 {
        let echo = tg.get("/").header("x-request-id", "spoofed").send().await.echo();
        let id = echo.header("x-request-id").expect("an id upstream").to_string();
        assert!(generated(&id), "{id}");
        assert!(seen.insert(id), "ids are unique");
    }
    // Without any id, one is made too.
    let echo = tg.get("/").send().await.echo();
    assert!(generated(echo.header("x-request-id").expect("an id upstream")));
}

#[tokio::test]
async fn every_answer_tollgate_writes_carries_the_id_in_header_and_body() {
    let upstream = Upstream::start().await;
    let cfg = config(upstream.addr).replace("path_prefix = \"/\"", "path_prefix = \"/limited\"");
    let tg = Tollgate::with(&cfg, &[("r.toml", LIMITED)]).await;
    for _ in 0..2 {
        assert_eq!(tg.get("/limited").header("x-request-id", "ok-id").send().await.status, 200);
    }
    // A 429 (the fast path writes its body by hand) and a 404.
    for (path, status) in [("/limited", 429), ("/elsewhere", 404)] {
        let r = tg.get(path).header("x-request-id", "trusted-\"id\"").send().await;
        assert_eq!(r.status, status);
        // Once: tollgate's own answers are made with it, and nothing adds it again.
        let ids: Vec<_> = r.headers.get_all("x-request-id").iter().collect();
        assert_eq!(ids, ["trusted-\"id\""], "{path}");
        assert_eq!(r.json()["request_id"], "trusted-\"id\"", "{path}");
        // A generated one, for a request that brought none.
        let r = tg.get(path).send().await;
        let id = r.header("x-request-id").expect("id header").to_string();
        assert!(generated(&id));
        assert_eq!(r.json()["request_id"], id.as_str());
    }
    // A 400 tollgate writes before routing.
    let r = tg.get("/limited").header("x-forwarded-for", "not-an-ip").header("x-request-id", "bad-xff").send().await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["request_id"], "bad-xff");
}

#[tokio::test]
async fn via_names_tollgate_on_requests_and_responses() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, "").await;
    let r = tg.get("/").send().await;
    assert_eq!(r.echo().headers["via"], ["1.1 tollgate"]);
    // The upstream answered in HTTP/1.1.
    let via: Vec<_> = r.headers.get_all("via").iter().map(|v| v.to_str().expect("text")).collect();
    assert_eq!(via, ["1.1 tollgate"]);

    // After the hops already listed; HTTP/2 from the client.
    let r = tg.get("/").h2().header("via", "1.1 edge-lb").send().await;
    assert_eq!(r.echo().headers["via"], ["1.1 edge-lb", "2 tollgate"]);
    let via: Vec<_> = r.headers.get_all("via").iter().map(|v| v.to_str().expect("text")).collect();
    assert_eq!(via, ["1.1 tollgate"]);

    // HTTP/1.0, spoken by hand.
    let mut s = tokio::net::TcpStream::connect(tg.proxy_addr).await.expect("connect");
    s.write_all(b"GET /ten HTTP/1.0\r\nHost: example.test\r\n\r\n").await.expect("write");
    let mut raw = Vec::new();
    tokio::time::timeout(support::DEADLINE, s.read_to_end(&mut raw)).await.expect("in time").expect("read");
    let raw = String::from_utf8_lossy(&raw);
    let body = raw.split_once("\r\n\r\n").expect("head and body").1;
    let echo: serde_json::Value = serde_json::from_str(body).expect("echo JSON");
    assert_eq!(echo["headers"]["via"], serde_json::json!(["1.0 tollgate"]));
    assert!(raw.to_ascii_lowercase().contains("\r\nvia: 1.1 tollgate\r\n"), "{raw}");
}

#[tokio::test]
async fn relayed_responses_carry_the_request_id() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, "").await;
    // A trusted proxy's id, over HTTP/1.1 and HTTP/2.
    for h2 in [false, true] {
        let call = tg.get("/").header("x-request-id", "lb-7f3a");
        let r = if h2 { call.h2() } else { call }.send().await;
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-request-id"), Some("lb-7f3a"), "h2: {h2}");
    }
    // A generated one: the id the upstream received.
    let r = tg.get("/").send().await;
    let id = r.header("x-request-id").expect("an id on the relayed response").to_string();
    assert!(generated(&id), "{id}");
    assert_eq!(r.echo().header("x-request-id"), Some(id.as_str()));
    // An upstream's own id is replaced: the client, the upstream and the
    // access log see one id.
    let r = tg.get("/").header("x-request-id", "lb-1").header("x-echo-header", "x-request-id: svc-9").send().await;
    let ids: Vec<_> = r.headers.get_all("x-request-id").iter().map(|v| v.to_str().expect("text")).collect();
    assert_eq!(ids, ["lb-1"]);
}

#[tokio::test]
async fn request_id_in_response_false_leaves_relayed_responses_as_they_came() {
    let upstream = Upstream::start().await;
    let cfg = config(upstream.addr)
        .replace("[client]\n", "[client]\nrequest_id_in_response = false\n")
        .replace("path_prefix = \"/\"", "path_prefix = \"/routed\"");
    let tg = Tollgate::with(&cfg, &[("r.toml", "")]).await;
    let r = tg.get("/routed").send().await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-request-id"), None);
    let r = tg.get("/routed").header("x-echo-header", "x-request-id: svc-9").send().await;
    assert_eq!(r.header("x-request-id"), Some("svc-9"));
    // tollgate's own answers still carry theirs.
    let r = tg.get("/elsewhere").header("x-request-id", "lb-2").send().await;
    assert_eq!((r.status.as_u16(), r.header("x-request-id")), (404, Some("lb-2")));
}
