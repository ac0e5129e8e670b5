//! The access log's fields about the request and its answer: host,
//! protocol, user agent, referer, the upstream's status and time, and the
//! TLS version, over plain HTTP/1.0, 1.1, h2c and TLS, and the redirect
//! listener's lines.

use crate::support;

use serde_json::Value;
use support::Tollgate;
use support::Upstream;
use support::access_log::{lines_by_id, logging};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const RULES: &str = r#"
[[rule]]
name = "five-per-minute"
match = { path = "/limited" }
key = ["ip"]
limit = 5
window = "1m"
"#;

#[tokio::test]
async fn each_line_tells_host_protocol_client_software_and_the_upstreams_answer() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::with(&logging(&upstream, "access.log"), &[("r.toml", RULES)]).await;
    let r = tg
        .get("/")
        .header("host", "shop.test:8080")
        .header("user-agent", "curl/8.0 \"quoted\"")
        .header("referer", "https://ref.test/a?b=1")
        .header("x-request-id", "plain-1")
        .send()
        .await;
    assert_eq!(r.status, 200);
    let r = tg.get("/").h2().header("x-request-id", "h2-1").header("x-echo-status", "503").send().await;
    assert_eq!(r.status, 503);
    for i in 0..6 {
        tg.get("/limited").header("x-request-id", &format!("lim-{i}")).send().await;
    }
    // HTTP/1.0, spoken by hand, with no Host.
    let mut s = tokio::net::TcpStream::connect(tg.proxy_addr).await.expect("connect");
    s.write_all(b"GET /ten HTTP/1.0\r\nx-request-id: ten-1\r\n\r\n").await.expect("write");
    let mut raw = Vec::new();
    tokio::time::timeout(support::DEADLINE, s.read_to_end(&mut raw)).await.expect("in time").expect("read");

    let log = lines_by_id(&tg.dir.path().join("access.log"), 9).await;
    let fields = |id: &str, names: &[&str]| -> Vec<Value> { names.iter().map(|n| log[id][*n].clone()).collect() };
    let names = ["host", "protocol", "user_agent", "referer", "upstream_status", "tls"];
    assert_eq!(
        fields("plain-1", &names),
        [
            Value::from("shop.test:8080"),
            "HTTP/1.1".into(),
            "curl/8.0 \"quoted\"".into(),
            "https://ref.test/a?b=1".into(),
            200.into(),
            Value::Null
        ]
    );
    // HTTP/2's :authority is its host; the upstream's 503 is relayed.
    let authority = tg.proxy_addr.to_string();
    assert_eq!(
        fields("h2-1", &names),
        [Value::from(authority), "HTTP/2".into(), Value::Null, Value::Null, 503.into(), Value::Null]
    );
    assert_eq!(fields("ten-1", &["host", "protocol", "upstream_status"]), [Value::Null, "HTTP/1.0".into(), 200.into()]);
    for id in ["plain-1", "h2-1", "ten-1", "lim-0"] {
        let ms = log[id]["upstream_ms"].as_f64().unwrap_or_else(|| panic!("{id}: upstream_ms {}", log[id]));
        assert!(ms >= 0.0 && ms <= log[id]["duration_ms"].as_f64().expect("duration_ms"), "{}", log[id]);
    }
    // A 429 never reached the upstream.
    assert_eq!(
        fields("lim-5", &["status", "upstream_status", "upstream_ms"]),
        [Value::from(429), Value::Null, Value::Null]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_connections_log_their_version_and_the_redirect_listener_logs_its_requests() {
    let site = support::tls::site("http_redirect = \"127.0.0.1:0\"\n[log]\naccess = \"access.log\"\n").await;
    let url = site.url("a.test", "/secure");
    for (args, id) in [(["--tlsv1.2", "--tls-max", "1.2"], "tls12"), (["--tlsv1.3", "--tls-max", "1.3"], "tls13")] {
        let header = format!("x-request-id: {id}");
        let out = site.curl(&[args[0], args[1], args[2], "--http1.1", "-o", "/dev/null", "-H", &header, &url]).await;
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let out = site.curl(&["--http2", "-o", "/dev/null", "-H", "x-request-id: tls-h2", &url]).await;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let redirect = site.tollgate.redirect_addr.expect("redirect listener");
    let out = site
        .curl(&[
            "-o",
            "/dev/null",
            "-D",
            "-",
            "-H",
            "host: a.test",
            "-A",
            "agent/1",
            // The test client is a trusted proxy: the client it names is logged.
            "-H",
            "x-forwarded-for: 203.0.113.9",
            &format!("http://{redirect}/cart?x=1"),
        ])
        .await;
    let head = String::from_utf8_lossy(&out.stdout).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 308"), "{head}");
    let id = head
        .lines()
        .find_map(|l| l.strip_prefix("x-request-id: "))
        .expect("the redirect carries its request id")
        .trim()
        .to_string();

    let log = lines_by_id(&site.dir().join("access.log"), 4).await;
    let pick = |id: &str, n: &str| log[id][n].clone();
    assert_eq!((pick("tls12", "tls"), pick("tls12", "protocol")), (Value::from("TLSv1.2"), Value::from("HTTP/1.1")));
    assert_eq!(
        (pick("tls13", "tls"), pick("tls13", "host")),
        (Value::from("TLSv1.3"), Value::from(format!("a.test:{}", site.port())))
    );
    assert_eq!((pick("tls-h2", "tls"), pick("tls-h2", "protocol")), (Value::from("TLSv1.3"), Value::from("HTTP/2")));
    let line = &log[&id];
    assert_eq!(
        [
            &line["status"],
            &line["client"],
            &line["method"],
            &line["path"],
            &line["host"],
            &line["user_agent"],
            &line["upstream"],
            &line["tls"]
        ],
        [
            &Value::from(308),
            &"203.0.113.9".into(),
            &"GET".into(),
            &"/cart".into(),
            &"a.test".into(),
            &"agent/1".into(),
            &Value::Null,
            &Value::Null
        ]
    );
}
