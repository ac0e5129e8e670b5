//! The admin listener: `/metrics` (every metric the issue names, valid for
//! `promtool check metrics`, no per-client labels), `/healthz`, `/readyz`,
//! `/rules`.

use crate::support;

use std::io::Write as _;
use std::process::{Command, Stdio};

use serde_json::json;
use support::{Call, Tollgate, Upstream, config, decisions, metric, statuses};

const RULES: &str = r#"
[[rule]]
name = "per-ip"
key = ["ip"]
algorithm = "sliding_window_log"
limit = 2
window = "90s"

[[rule]]
name = "trial"
match = { methods = ["GET"], path = "/api/*" }
key = ["user", "header:x-tier"]
mode = "shadow"
throttle = "soft"
soft_percent = 20
limit = 1
window = "1s"
burst = 3
"#;

/// Some traffic of every kind: allowed, limited, shadow-limited, an
/// upstream error.
async fn traffic(tg: &Tollgate) {
    assert_eq!(statuses(3, || tg.get("/api/x").from_ip("203.0.113.50")).await, [200, 200, 429]);
    assert_eq!(statuses(1, || tg.get("/").from_ip("203.0.113.51").header("x-echo-reset", "1")).await, [502]);
}

#[tokio::test]
async fn metrics_name_everything_and_pass_promtool() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, RULES).await;
    traffic(&tg).await;
    let reply = tg.admin("/metrics").await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("content-type"), Some("text/plain; version=0.0.4; charset=utf-8"));
    let m = reply.text();

    for (name, kind) in [
        ("tollgate_requests_total", "counter"),
        ("tollgate_rule_decisions_total", "counter"),
        ("tollgate_request_duration_seconds", "histogram"),
        ("tollgate_upstream_errors_total", "counter"),
        ("tollgate_store_errors_total", "counter"),
        ("tollgate_store_evictions_total", "counter"),
        ("tollgate_store_duration_seconds", "histogram"),
        ("tollgate_rules_reloads_total", "counter"),
        ("tollgate_rules_active", "gauge"),
    ] {
        assert!(m.contains(&format!("\n# TYPE {name} {kind}\n")), "no {kind} {name} in:\n{m}");
    }
    assert_eq!(metric(m, "tollgate_requests_total", &[("route", "svc"), ("decision", "allowed")]), Some(3.0));
    assert_eq!(metric(m, "tollgate_requests_total", &[("route", "svc"), ("decision", "limited")]), Some(1.0));
    assert_eq!(decisions(m, "per-ip", "allowed"), 3.0);
    assert_eq!(decisions(m, "per-ip", "limited"), 1.0);
    // trial: soft 1 * 1.2 = 1 of a bucket of 3 * 1.2 = 3; all 3 fit.
    assert_eq!(decisions(m, "trial", "allowed"), 3.0);
    assert_eq!(decisions(m, "trial", "shadow_limited"), 0.0);
    assert_eq!(metric(m, "tollgate_upstream_errors_total", &[("upstream", "svc"), ("kind", "reset")]), Some(1.0));
    assert_eq!(metric(m, "tollgate_rules_active", &[]), Some(2.0));
    // Series whose labels are known exist at zero before the first event.
    assert_eq!(metric(m, "tollgate_store_errors_total", &[("backend", "memory")]), Some(0.0));
    assert_eq!(metric(m, "tollgate_rules_reloads_total", &[("result", "success")]), Some(0.0));
    assert_eq!(metric(m, "tollgate_rules_reloads_total", &[("result", "failure")]), Some(0.0));
    assert_eq!(metric(m, "tollgate_upstream_errors_total", &[("upstream", "svc"), ("kind", "timeout")]), Some(0.0));
    // Every request is timed; every request that matched a rule asked the
    // store once.
    assert_eq!(metric(m, "tollgate_request_duration_seconds_count", &[]), Some(4.0));
    assert_eq!(metric(m, "tollgate_store_duration_seconds_count", &[]), Some(4.0));
    // No label carries a client value. (The upstream server's configured
    // address, in the per-server series, is on 127.0.0.1 too.)
    let client_labels: String =
        m.lines().filter(|l| !l.starts_with("tollgate_upstream_server_")).collect::<Vec<_>>().join("\n");
    for client_value in ["203.0.113.50", "203.0.113.51", "127.0.0.1"] {
        assert!(!client_labels.contains(client_value), "{client_value} appears in /metrics");
    }
    let server = format!("http://{}", upstream.addr);
    for (name, value) in [
        ("tollgate_upstream_server_requests_total", 3.0),
        ("tollgate_upstream_server_failures_total", 1.0),
        ("tollgate_upstream_server_inflight", 0.0),
        ("tollgate_upstream_server_healthy", 1.0),
    ] {
        assert_eq!(metric(m, name, &[("upstream", "svc"), ("server", &server)]), Some(value), "{name}");
    }

    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool is installed (scripts/test installs it)");
    promtool.stdin.take().expect("stdin").write_all(m.as_bytes()).expect("write to promtool");
    let out = promtool.wait_with_output().expect("promtool runs");
    assert!(
        out.status.success() && out.stdout.is_empty() && out.stderr.is_empty(),
        "promtool check metrics: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn health_and_readiness() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, RULES).await;
    let r = tg.admin("/healthz").await;
    assert_eq!((r.status.as_u16(), r.json()), (200, json!({"status": "ok"})));
    let r = tg.admin("/readyz").await;
    assert_eq!((r.status.as_u16(), r.json()), (200, json!({"status": "ready", "store": "memory"})));
    assert_eq!(r.header("content-type"), Some("application/json"));

    let r = tg.admin("/nope").await;
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"], "not_found");
    let r = Call::new("POST", tg.admin_addr, "/rules").send().await;
    assert_eq!(r.status, 405);
    assert_eq!(r.json()["error"], "method_not_allowed");
    // The admin endpoints are not on the proxy listener: there, /metrics is
    // an ordinary path forwarded to the upstream.
    let r = tg.get("/metrics").send().await;
    assert_eq!(r.echo().path, "/metrics");
}

#[tokio::test]
async fn rules_shows_what_is_in_force() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, RULES).await;
    let file = tg.rules_dir().join("rules.toml").display().to_string();
    let mut rules = tg.rules().await;
    let loaded_at = rules["loaded_at"].as_f64().expect("loaded_at");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs_f64();
    assert!(loaded_at <= now && loaded_at > now - 600.0, "loaded_at {loaded_at} vs now {now}");
    rules["loaded_at"] = json!(0);
    assert_eq!(
        rules,
        json!({
            "rules": [
                {
                    "name": "per-ip",
                    "source": format!("{file}:2"),
                    "algorithm": "sliding_window_log",
                    "limit": 2,
                    "window_seconds": 90.0,
                    "burst": 2,
                    "key": ["ip"],
                    "mode": "enforce",
                    "throttle": "Hard",
                    "allowed": 0,
                    "limited": 0,
                },
                {
                    "name": "trial",
                    "source": format!("{file}:9"),
                    "algorithm": "token_bucket",
                    "limit": 1,
                    "window_seconds": 1.0,
                    "burst": 3,
                    "key": ["user", "header:x-tier"],
                    "mode": "shadow",
                    "throttle": "Soft { percent: 20 }",
                    "allowed": 0,
                    "limited": 0,
                },
            ],
            "files": [file],
            "loaded_at": 0,
            "reloads": 0,
            "reload_failures": 0,
            "last_reload_error": null,
            "last_reload_error_at": null,
        })
    );
}

#[tokio::test]
async fn readyz_and_healthz_answer_with_no_rules_at_all() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::with(&config(upstream.addr), &[]).await;
    assert_eq!(tg.admin("/healthz").await.status, 200);
    assert_eq!(tg.admin("/readyz").await.status, 200);
    assert_eq!(tg.admin("/healthz/store").await.status, 200, "the memory store is always up");
    let rules = tg.rules().await;
    assert_eq!(rules["rules"], json!([]));
    assert_eq!(rules["files"], json!([]));
    assert_eq!(metric(&tg.metrics().await, "tollgate_rules_active", &[]), Some(0.0));
}
