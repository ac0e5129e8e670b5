//! `[tracing]`: W3C trace context in and out, and spans exported over
//! OTLP/HTTP to a real receiver (tests/support/otlp_receiver.py, which
//! decodes them with the `opentelemetry-proto` package): a sampled
//! incoming trace is joined, the upstream's parent is the exported span,
//! the span carries the request's route, rule, decision and store time,
//! the access log line its trace id; an untrusted `traceparent` starts a
//! new trace; a collector that is down costs counted spans, not requests.

use crate::support;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use support::{Tollgate, Upstream, config, metric};
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

const RULES: &str = r#"
[[rule]]
name = "per-user"
key = ["header:x-user"]
limit = 2
window = "1h"
"#;

const INCOMING: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// The receiver and the spans it prints.
struct Receiver {
    _child: Child,
    lines: Lines<BufReader<ChildStdout>>,
    port: u16,
}

impl Receiver {
    async fn start() -> Receiver {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/support/otlp_receiver.py");
        let mut child = Command::new("python3")
            .arg(script)
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 runs (scripts/test installs opentelemetry-proto)");
        let mut lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
        let first = lines.next_line().await.expect("stdout").expect("the receiver starts");
        let port = first.strip_prefix("port ").and_then(|p| p.parse().ok()).unwrap_or_else(|| panic!("said {first}"));
        Receiver { _child: child, lines, port }
    }

    /// The next span the collector received.
    async fn span(&mut self) -> Value {
        let line = tokio::time::timeout(Duration::from_secs(20), self.lines.next_line())
            .await
            .expect("a span arrives in time")
            .expect("stdout")
            .expect("the receiver runs");
        serde_json::from_str(&line).expect("JSON")
    }
}

fn traced(upstream: &Upstream, tracing: &str) -> String {
    format!("{}\n[log]\naccess = \"access.log\"\n\n[tracing]\n{tracing}\n", config(upstream.addr))
}

#[tokio::test]
async fn a_sampled_incoming_trace_is_joined_exported_and_passed_on() {
    let mut rx = Receiver::start().await;
    let upstream = Upstream::start().await;
    let tracing =
        format!("otlp_endpoint = \"http://127.0.0.1:{}\"\nsample_ratio = 0.0\nservice_name = \"edge-eu\"", rx.port);
    let t = Tollgate::with(&traced(&upstream, &tracing), &[("rules.toml", RULES)]).await;

    // Not sampled (no traceparent, ratio 0): no span, but a trace id.
    let quiet = t.get("/quiet").header("x-user", "ann").send().await;
    let quiet_parent = quiet.echo().header("traceparent").expect("a traceparent upstream").to_string();
    assert!(quiet_parent.ends_with("-00"), "{quiet_parent}");

    let r = t
        .get("/api/orders?id=7")
        .header("x-user", "ann")
        .header("traceparent", INCOMING)
        .header("tracestate", "vendor=abc")
        .send()
        .await;
    assert_eq!(r.status, 200);
    let echo = r.echo();
    let sent = echo.header("traceparent").expect("traceparent upstream");
    assert_eq!(echo.header("tracestate"), Some("vendor=abc"));

    let span = rx.span().await;
    assert_eq!(span["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736", "{span}");
    assert_eq!(span["parent_span_id"], "00f067aa0ba902b7", "{span}");
    assert_eq!(sent, format!("00-4bf92f3577b34da6a3ce929d0e0e4736-{}-01", span["span_id"].as_str().expect("id")));
    assert_eq!(
        (span["service"].as_str(), span["kind"].as_i64(), span["trace_state"].as_str()),
        (Some("edge-eu"), Some(2), Some("vendor=abc"))
    );
    let a = &span["attributes"];
    assert_eq!(a["http.request.method"], "GET", "{span}");
    assert_eq!(a["url.path"], "/api/orders", "{span}");
    assert_eq!(a["http.route"], "/", "{span}");
    assert_eq!(a["http.response.status_code"], 200, "{span}");
    assert_eq!(a["client.address"], "127.0.0.1", "{span}");
    assert_eq!(a["server.address"], "127.0.0.1", "{span}");
    assert_eq!(a["tollgate.rule"], "per-user", "{span}");
    assert_eq!(a["tollgate.decision"], "allowed", "{span}");
    assert!(a["tollgate.store_ms"].as_f64().is_some_and(|ms| (0.0..1000.0).contains(&ms)), "{span}");
    assert!(span["end"].as_u64() >= span["start"].as_u64(), "{span}");

    // A limited request's span says so.
    for _ in 0..2 {
        t.get("/api/orders").header("x-user", "bob").header("traceparent", INCOMING).send().await;
    }
    let _ = rx.span().await;
    let _ = rx.span().await;
    let r = t.get("/api/orders").header("x-user", "bob").header("traceparent", INCOMING).send().await;
    assert_eq!(r.status, 429);
    let span = rx.span().await;
    assert_eq!(
        (span["attributes"]["tollgate.decision"].as_str(), span["attributes"]["http.response.status_code"].as_i64()),
        (Some("limited"), Some(429)),
        "{span}"
    );

    // The access log lines carry the trace ids, the unsampled one too.
    t.proxy.flush_access_log(Duration::from_secs(5)).await;
    let log = std::fs::read_to_string(t.dir.path().join("access.log")).expect("access log");
    let ids: Vec<String> = log
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("JSON")["trace_id"].as_str().expect("trace_id").to_string())
        .collect();
    assert_eq!(ids.len(), 5, "{log}");
    assert_eq!(ids[0], quiet_parent[3..35]);
    assert!(ids[1..].iter().all(|id| id == "4bf92f3577b34da6a3ce929d0e0e4736"), "{ids:?}");
    // Counted once the collector has answered, which is after it printed.
    support::eventually("four spans counted as exported", || async {
        metric(&t.metrics().await, "tollgate_tracing_spans_total", &[("result", "exported")]) == Some(4.0)
    })
    .await;
    t.stop().await;
}

#[tokio::test]
async fn an_untrusted_traceparent_starts_a_new_trace() {
    let mut rx = Receiver::start().await;
    let upstream = Upstream::start().await;
    let tracing = format!("otlp_endpoint = \"http://127.0.0.1:{}\"\nsample_ratio = 1.0", rx.port);
    let config = traced(&upstream, &tracing).replace("trusted_proxies = [\"127.0.0.1/32\"]", "trusted_proxies = []");
    let t = Tollgate::with(&config, &[("rules.toml", RULES)]).await;
    let r =
        t.get("/x").header("x-user", "eve").header("traceparent", INCOMING).header("tracestate", "a=b").send().await;
    let echo = r.echo();
    let sent = echo.header("traceparent").expect("traceparent").to_string();
    assert!(!sent.contains("4bf92f3577b34da6a3ce929d0e0e4736"), "{sent}");
    assert!(echo.header("tracestate").is_none(), "the untrusted tracestate goes with its traceparent");
    let span = rx.span().await;
    assert_eq!(span["parent_span_id"], "", "{span}");
    assert_eq!(
        sent,
        format!("00-{}-{}-01", span["trace_id"].as_str().expect("id"), span["span_id"].as_str().expect("id"))
    );
    t.stop().await;
}

#[tokio::test]
async fn a_collector_that_is_down_costs_counted_spans_not_requests() {
    let upstream = Upstream::start().await;
    let closed = Upstream::refusing_addr().await;
    let tracing = format!("otlp_endpoint = \"http://{closed}\"\nsample_ratio = 1.0");
    let t = Tollgate::with(&traced(&upstream, &tracing), &[("rules.toml", RULES)]).await;
    for user in ["a", "b"] {
        assert_eq!(t.get("/x").header("x-user", user).send().await.status, 200);
    }
    support::eventually("the failed export is counted", || async {
        metric(&t.metrics().await, "tollgate_tracing_spans_total", &[("result", "failed")]) == Some(2.0)
    })
    .await;
    t.stop().await;
}
