//! Forwarding: what passes through to the upstream and back, streaming,
//! HTTP/1.1 and h2c clients, routing, and the answers tollgate gives itself
//! when there is no route or the upstream fails.

use crate::support;

use bytes::Bytes;
use http::Version;
use http_body_util::BodyExt;
use support::{Call, DEADLINE, Tollgate, Upstream, config, eventually, metric};

const NO_RULES: &str = "";

#[tokio::test]
async fn method_path_query_headers_and_body_pass_through() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, NO_RULES).await;
    for method in ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"] {
        let body = if method == "GET" { String::new() } else { format!("{method} body \u{2713}") };
        let r = tg
            .call(method, "/api/items/42?x=1&y=a%20b&x=2")
            .header("x-custom", "one")
            .header("x-custom", "two")
            .header("authorization", "Bearer t0k3n")
            .body(body.clone())
            .send()
            .await;
        assert_eq!(r.status, 200, "{method}");
        let e = r.echo();
        assert_eq!(e.method, method);
        assert_eq!(e.path, "/api/items/42");
        assert_eq!(e.query.as_deref(), Some("x=1&y=a%20b&x=2"));
        assert_eq!(e.headers["x-custom"], ["one", "two"]);
        assert_eq!(e.header("authorization"), Some("Bearer t0k3n"));
        assert_eq!(e.body, body);
        assert_eq!(e.version, "HTTP/1.1");
    }
}

#[tokio::test]
async fn upstream_status_and_headers_pass_back() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, NO_RULES).await;
    for status in [201, 301, 404, 418, 500, 503] {
        let r = tg.get("/").header("x-echo-status", &status.to_string()).send().await;
        assert_eq!(r.status, status);
        assert_eq!(r.header("x-upstream"), Some("echo"));
        assert_eq!(r.header("content-type"), Some("application/json"));
    }
}

#[tokio::test]
async fn hop_by_hop_headers_stop_at_the_proxy() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, NO_RULES).await;
    let hop_headers = |call: Call| {
        call.header("connection", "keep-alive, x-client-hop")
            .header("x-client-hop", "secret")
            .header("keep-alive", "timeout=5")
            .header("proxy-authorization", "Basic Zm9vOmJhcg==")
            .header("proxy-connection", "keep-alive")
            .header("te", "gzip, trailers")
            .header("upgrade", "websocket")
            .header("x-end-to-end", "kept")
            .header("x-echo-hop", "1")
    };
    // Control: sent straight to the upstream, they all arrive.
    let direct = hop_headers(Call::new("GET", upstream.addr, "/")).send().await;
    let e = direct.echo();
    for h in ["connection", "x-client-hop", "keep-alive", "proxy-authorization", "proxy-connection", "te", "upgrade"] {
        assert!(e.headers.contains_key(h), "the test client did not send {h}");
    }
    for h in ["x-upstream-hop", "keep-alive", "proxy-authenticate"] {
        assert!(direct.header(h).is_some(), "the upstream did not send {h}");
    }

    let r = hop_headers(tg.get("/")).send().await;
    assert_eq!(r.status, 200);
    let e = r.echo();
    for h in ["connection", "x-client-hop", "keep-alive", "proxy-authorization", "proxy-connection", "upgrade"] {
        assert_eq!(e.headers.get(h), None, "{h} reached the upstream");
    }
    // tollgate takes trailers on this hop, as the client does; the
    // client's other transfer codings are its own hop's business.
    assert_eq!(e.header("te"), Some("trailers"));
    assert_eq!(e.header("x-end-to-end"), Some("kept"));
    // And on the way back.
    for h in ["x-upstream-hop", "keep-alive", "proxy-authenticate"] {
        assert_eq!(r.header(h), None, "{h} reached the client");
    }
    assert_eq!(r.header("x-upstream"), Some("echo"));
}

#[tokio::test]
async fn x_forwarded_headers_are_set() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, NO_RULES).await;
    let r = tg.get("/").header("host", "API.Example.com:8443").send().await;
    let e = r.echo();
    // The host as matched: lower-cased, its port kept.
    assert_eq!(e.header("host"), Some("api.example.com:8443"));
    assert_eq!(e.header("x-forwarded-for"), Some("127.0.0.1"));
    assert_eq!(e.header("x-forwarded-proto"), Some("http"));
    assert_eq!(e.header("x-forwarded-host"), Some("api.example.com"));

    // A trusted proxy's X-Forwarded-* are kept and extended.
    let r = tg
        .get("/")
        .header("x-forwarded-for", "198.51.100.1")
        .header("x-forwarded-proto", "https")
        .header("x-forwarded-host", "shop.example")
        .send()
        .await;
    let e = r.echo();
    assert_eq!(e.header("x-forwarded-for"), Some("198.51.100.1, 127.0.0.1"));
    assert_eq!(e.header("x-forwarded-proto"), Some("https"));
    assert_eq!(e.header("x-forwarded-host"), Some("shop.example"));
}

#[tokio::test]
async fn untrusted_clients_cannot_forge_x_forwarded_headers() {
    let upstream = Upstream::start().await;
    let cfg = config(upstream.addr).replace(r#"["127.0.0.1/32"]"#, "[]");
    let tg = Tollgate::with(&cfg, &[]).await;
    let r = tg
        .get("/")
        .header("host", "real.example")
        .header("x-forwarded-for", "198.51.100.1")
        .header("x-forwarded-proto", "https")
        .header("x-forwarded-host", "forged.example")
        .send()
        .await;
    let e = r.echo();
    assert_eq!(e.header("x-forwarded-for"), Some("127.0.0.1"));
    assert_eq!(e.header("x-forwarded-proto"), Some("http"));
    assert_eq!(e.header("x-forwarded-host"), Some("real.example"));
}

#[tokio::test]
async fn h2c_clients_work_and_are_answered_in_http2() {
    let upstream = Upstream::start().await;
    let rules = "[[rule]]\nname = \"r\"\nalgorithm = \"fixed_window\"\nlimit = 2\nwindow = \"1m\"\n";
    let tg = Tollgate::start(&upstream, rules).await;
    let r = tg.call("POST", "/h2/path?q=1").header("x-custom", "v").body("over h2").h2().send().await;
    assert_eq!(r.status, 200);
    assert_eq!(r.version, Version::HTTP_2);
    assert_eq!(r.header("x-ratelimit-remaining"), Some("1"));
    let e = r.echo();
    // The upstream is spoken to in HTTP/1.1, with the :authority as Host.
    assert_eq!(e.version, "HTTP/1.1");
    assert_eq!((e.method.as_str(), e.path.as_str(), e.query.as_deref()), ("POST", "/h2/path", Some("q=1")));
    assert_eq!(e.header("x-custom"), Some("v"));
    assert_eq!(e.body, "over h2");
    assert_eq!(e.header("host"), Some(tg.proxy_addr.to_string().as_str()));
    assert_eq!(e.header("x-forwarded-host"), Some("127.0.0.1"));

    // h2 and HTTP/1.1 count against the same bucket.
    let r = tg.get("/").send().await;
    assert_eq!((r.status.as_u16(), r.version), (200, Version::HTTP_11));
    let r = tg.get("/").h2().send().await;
    assert_eq!((r.status.as_u16(), r.version), (429, Version::HTTP_2));
    assert_eq!(r.json()["error"], "too_many_requests");
    assert_eq!(r.header("retry-after"), Some("60"));
}

/// Bodies stream both ways on a route with `buffer_body = 0`: the upstream
/// echoes each chunk back as it arrives, and the client sends the next chunk
/// only after the previous one came back. A proxy that buffered either body
/// would never finish.
async fn bodies_stream(h2: bool) {
    let upstream = Upstream::start().await;
    let cfg = config(upstream.addr).replace("upstream = \"svc\"\n", "upstream = \"svc\"\nbuffer_body = 0\n");
    let tg = Tollgate::with(&cfg, &[]).await;
    let mut call = tg.call("POST", "/stream").header("x-echo-stream", "1");
    if h2 {
        call = call.h2();
    }
    let (tx, resp) = call.send_streaming().await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers().get("x-upstream").map(|v| v.as_bytes()), Some(&b"echo"[..]));
    let mut body = resp.into_body();
    for i in 0..5 {
        let chunk = Bytes::from(format!("chunk {i};"));
        tx.send(chunk.clone()).await.expect("request body open");
        let mut got = Vec::new();
        while got.len() < chunk.len() {
            let frame = tokio::time::timeout(DEADLINE, body.frame())
                .await
                .unwrap_or_else(|_| panic!("chunk {i} did not come back: a body is buffered"))
                .expect("body open")
                .expect("body frame");
            if let Ok(data) = frame.into_data() {
                got.extend_from_slice(&data);
            }
        }
        assert_eq!(got, chunk);
    }
    drop(tx);
    let rest = tokio::time::timeout(DEADLINE, body.collect()).await.expect("end of body").expect("body");
    assert_eq!(rest.to_bytes(), Bytes::new());
}

#[tokio::test]
async fn bodies_stream_over_http1() {
    bodies_stream(false).await;
}

#[tokio::test]
async fn bodies_stream_over_h2c() {
    bodies_stream(true).await;
}

#[tokio::test]
async fn routes_pick_the_longest_prefix_and_the_host() {
    let (a, b, c) = (Upstream::start().await, Upstream::start().await, Upstream::start().await);
    let cfg = format!(
        r#"[listen]
proxy = "127.0.0.1:0"
admin = "127.0.0.1:0"

[[upstream]]
name = "a"
url = "http://{}"

[[upstream]]
name = "b"
url = "http://{}/base/"

[[upstream]]
name = "c"
url = "http://{}"

[[route]]
path_prefix = "/api"
upstream = "a"

[[route]]
path_prefix = "/api/v2"
upstream = "b"

[[route]]
path_prefix = "/api"
host = "c.example"
upstream = "c"
"#,
        a.addr, b.addr, c.addr
    );
    let tg = Tollgate::with(&cfg, &[]).await;
    let r = tg.get("/api/v1/x").send().await;
    assert_eq!(r.echo().path, "/api/v1/x");
    // The longer prefix wins, and the upstream's URL path is prepended.
    let r = tg.get("/api/v2/x?k=v").send().await;
    let e = r.echo();
    assert_eq!((e.path.as_str(), e.query.as_deref()), ("/base/api/v2/x", Some("k=v")));
    // A host-specific route wins over a host-less one of the same prefix.
    let r = tg.get("/api/v1/x").header("host", "C.Example:80").send().await;
    assert_eq!(r.echo().path, "/api/v1/x");
    assert_eq!((a.hits(), b.hits(), c.hits()), (1, 1, 1));

    // Nothing matches: 404 JSON, nothing forwarded.
    for path in ["/", "/ap", "/other/api"] {
        let r = tg.get(path).send().await;
        assert_eq!(r.status, 404, "{path}");
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(r.text_without_id(), r#"{"error":"not_found","message":"No route matches this host and path."}"#);
    }
    assert_eq!((a.hits(), b.hits(), c.hits()), (1, 1, 1));
    let m = tg.metrics().await;
    assert_eq!(metric(&m, "tollgate_requests_total", &[("route", "none"), ("decision", "rejected")]), Some(3.0));
}

#[tokio::test]
async fn a_refusing_upstream_is_a_502() {
    let down = Upstream::refusing_addr().await;
    let cfg =
        config(down).replace("name = \"svc\"", "name = \"down\"").replace("upstream = \"svc\"", "upstream = \"down\"");
    let tg = Tollgate::with(&cfg, &[]).await;
    for _ in 0..2 {
        let r = tg.get("/").send().await;
        assert_eq!(r.status, 502);
        assert_eq!(r.header("content-type"), Some("application/json"));
        // No address, no error text from the connector.
        assert_eq!(
            r.text_without_id(),
            r#"{"error":"bad_gateway","message":"The upstream service could not be reached or broke the connection."}"#
        );
    }
    let m = tg.metrics().await;
    assert_eq!(metric(&m, "tollgate_upstream_errors_total", &[("upstream", "down"), ("kind", "connect")]), Some(2.0));
}

#[tokio::test]
async fn an_upstream_that_resets_is_a_502() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, NO_RULES).await;
    let r = tg.call("POST", "/").header("x-echo-reset", "1").body("payload").send().await;
    assert_eq!(r.status, 502);
    assert_eq!(r.json()["error"], "bad_gateway");
    let m = tg.metrics().await;
    assert_eq!(metric(&m, "tollgate_upstream_errors_total", &[("upstream", "svc"), ("kind", "reset")]), Some(1.0));
    // The pool recovers: the next request is answered.
    assert_eq!(tg.get("/").send().await.status, 200);
}

/// The upstream's response head is read into a 16 KiB buffer (README,
/// Slow readers): a head that fits is served, a larger one is a 502.
#[tokio::test]
async fn an_upstream_response_head_over_16_kib_is_a_502() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, NO_RULES).await;
    let with_header_of = |bytes: usize| tg.get("/").header("x-echo-header", &format!("x-big: {}", "a".repeat(bytes)));
    let fits = with_header_of(12 * 1024).send().await;
    assert_eq!(fits.status, 200, "a 12 KiB head");
    assert_eq!(fits.header("x-big").map(str::len), Some(12 * 1024));
    let over = with_header_of(17 * 1024).send().await;
    assert_eq!(over.status, 502, "a 17 KiB head: {:?}", over.headers.get("x-big").map(|v| v.len()));
    assert_eq!(over.json()["error"], "bad_gateway");
    // The next request is answered.
    assert_eq!(tg.get("/").send().await.status, 200);
}

#[tokio::test]
async fn a_slow_upstream_is_a_504() {
    let upstream = Upstream::start().await;
    let cfg = config(upstream.addr).replace("timeout = \"10s\"", "timeout = \"200ms\"");
    let tg = Tollgate::with(&cfg, &[]).await;
    let r = tg.get("/").header("x-echo-delay-ms", "30000").send().await;
    assert_eq!(r.status, 504);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(
        r.text_without_id(),
        r#"{"error":"gateway_timeout","message":"The upstream service did not answer in time."}"#
    );
    let m = tg.metrics().await;
    assert_eq!(metric(&m, "tollgate_upstream_errors_total", &[("upstream", "svc"), ("kind", "timeout")]), Some(1.0));
    assert_eq!(tg.get("/").send().await.status, 200);
}

#[tokio::test]
async fn shutdown_lets_in_flight_requests_finish() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, NO_RULES).await;
    let addr = tg.proxy_addr;
    let in_flight = tokio::spawn(tg.get("/slow").header("x-echo-hold", "1").send());
    upstream.wait_held(1).await;
    let stopping = tokio::spawn(tg.stop());
    // The listener closes while the request is still held...
    support::eventually("the proxy listener to close", || async {
        tokio::net::TcpStream::connect(addr).await.is_err()
    })
    .await;
    assert!(!stopping.is_finished());
    // ...and the held request still gets its answer.
    upstream.release(1);
    let r = in_flight.await.expect("request task");
    assert_eq!(r.status, 200);
    tokio::time::timeout(DEADLINE, stopping).await.expect("server stops").expect("stop task");
}

#[tokio::test]
async fn upstream_connections_are_pooled() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, NO_RULES).await;
    for _ in 0..10 {
        // Each call is a new client connection to the proxy...
        assert_eq!(tg.get("/").send().await.status, 200);
    }
    for _ in 0..5 {
        assert_eq!(tg.get("/").h2().send().await.status, 200);
    }
    // ...but the proxy reuses one upstream connection for all of them.
    assert_eq!((upstream.hits(), upstream.connections()), (15, 1));
}

#[tokio::test]
async fn connections_over_the_limit_get_a_503() {
    let upstream = Upstream::start().await;
    let cfg =
        config(upstream.addr).replace("admin = \"127.0.0.1:0\"\n", "admin = \"127.0.0.1:0\"\nmax_connections = 1\n");
    let tg = Tollgate::with(&cfg, &[]).await;
    let held = tokio::spawn(tg.get("/").header("x-echo-hold", "1").send());
    upstream.wait_held(1).await;
    let r = tg.get("/").send().await;
    assert_eq!(r.status, 503);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.text_without_id(), r#"{"error":"overloaded","message":"Too many connections; retry shortly."}"#);
    upstream.release(1);
    assert_eq!(held.await.expect("held request").status, 200);
    // Once the first client has gone, there is room again.
    eventually("a free connection slot", || async { tg.get("/").send().await.status == 200 }).await;
    let m = tg.metrics().await;
    assert!(metric(&m, "tollgate_connections_refused_total", &[]) >= Some(1.0));
    assert_eq!(upstream.hits(), 2);
}
