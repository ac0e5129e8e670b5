//! `cost_response_header` end to end: a request reserves its estimated
//! cost when it is admitted, and the real cost its upstream reports in a
//! response header corrects the counter (the difference given back, or
//! charged on top into debt that the next requests wait out); on the memory
//! store and on a real Redis Cluster shared by two instances.

use crate::support;

use std::sync::OnceLock;
use std::time::Duration;

use http::StatusCode;
use support::redis::{RedisCluster, tollgate_config};
use support::{Call, Reply, Tollgate, Upstream, eventually, metric};

/// An LLM-style rule: 100 tokens per 100 s (one a second), every request
/// reserving 10.
fn llm(algorithm: &str, window: &str, extra: &str) -> String {
    format!(
        "[[rule]]\nname = \"llm\"\nkey = [\"ip\"]\nalgorithm = \"{algorithm}\"\nlimit = 100\nwindow = \"{window}\"\ncost = 10\ncost_response_header = \"x-tokens-used\"\nquota_unit = \"tokens\"\n{extra}"
    )
}

/// A request from `ip` whose upstream answers `x-tokens-used: used`.
fn used(addr: std::net::SocketAddr, ip: &str, used: &str) -> Call {
    Call::new("GET", addr, "/").from_ip(ip).header("x-echo-header", &format!("x-tokens-used: {used}"))
}

fn remaining(r: &Reply) -> u64 {
    r.header("x-ratelimit-remaining").and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{r:?}"))
}

#[tokio::test]
async fn a_cheaper_response_gives_the_rest_of_the_reservation_back() {
    let up = Upstream::start().await;
    let tg = Tollgate::start(&up, &llm("token_bucket", "100s", "")).await;
    let first = used(tg.proxy_addr, "198.51.100.1", "3").send().await;
    assert_eq!(first.status, StatusCode::OK);
    // Decided on the reservation; the real cost is still unknown.
    assert_eq!(remaining(&first), 90);
    // The header reaches the client as the upstream sent it.
    assert_eq!(first.header("x-tokens-used"), Some("3"));
    assert_eq!(first.header("ratelimit-policy"), Some(r#""llm";q=100;qu="tokens";w=100"#));
    // 7 of the 10 came back: 100 - 3 - 10.
    let second = used(tg.proxy_addr, "198.51.100.1", "3").send().await;
    assert_eq!(remaining(&second), 87);
}

#[tokio::test]
async fn a_dearer_response_is_counted_in_full_and_the_next_requests_wait() {
    let up = Upstream::start().await;
    let tg = Tollgate::start(&up, &llm("token_bucket", "100s", "")).await;
    let ip = "198.51.100.2";
    for _ in 0..9 {
        assert_eq!(used(tg.proxy_addr, ip, "10").send().await.status, StatusCode::OK);
    }
    // The last 10 left are reserved, and the answer costs 60: 50 in debt.
    let last = used(tg.proxy_addr, ip, "60").send().await;
    assert_eq!(last.status, StatusCode::OK);
    let refused = used(tg.proxy_addr, ip, "10").send().await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.header("x-ratelimit-remaining"), Some("0"));
    // The debt and the next request's 10, at one token a second.
    assert_eq!(refused.header("retry-after"), Some("60"));
    tg.advance(Duration::from_secs(59));
    assert_eq!(used(tg.proxy_addr, ip, "10").send().await.status, StatusCode::TOO_MANY_REQUESTS);
    tg.advance(Duration::from_secs(1));
    assert_eq!(used(tg.proxy_addr, ip, "10").send().await.status, StatusCode::OK);
}

#[tokio::test]
async fn windows_settle_too() {
    let up = Upstream::start().await;
    for algorithm in ["fixed_window", "sliding_window_counter"] {
        let tg = Tollgate::start(&up, &llm(algorithm, "1h", "")).await;
        let ip = "198.51.100.3";
        assert_eq!(remaining(&used(tg.proxy_addr, ip, "1").send().await), 90, "{algorithm}");
        assert_eq!(remaining(&used(tg.proxy_addr, ip, "1").send().await), 89, "{algorithm}");
        // 89 - 10 + 100 (a real cost above the limit counts as the limit).
        assert_eq!(used(tg.proxy_addr, ip, "500").send().await.status, StatusCode::OK);
        let refused = used(tg.proxy_addr, ip, "1").send().await;
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS, "{algorithm}");
        assert_eq!(refused.header("x-ratelimit-remaining"), Some("0"));
        tg.stop().await;
    }
}

#[tokio::test]
async fn a_missing_or_invalid_cost_leaves_the_reservation() {
    let up = Upstream::start().await;
    let tg = Tollgate::start(&up, &llm("token_bucket", "100s", "")).await;
    let ip = "198.51.100.4";
    let first = Call::new("GET", tg.proxy_addr, "/").from_ip(ip).send().await;
    assert_eq!(remaining(&first), 90);
    assert_eq!(remaining(&used(tg.proxy_addr, ip, "-3").send().await), 80);
    assert_eq!(remaining(&used(tg.proxy_addr, ip, "lots").send().await), 70);
    assert_eq!(remaining(&used(tg.proxy_addr, ip, "0").send().await), 60);
    // The zero above gave its 10 back.
    assert_eq!(remaining(&used(tg.proxy_addr, ip, "0").send().await), 60);
    let metrics = tg.metrics().await;
    assert_eq!(metric(&metrics, "tollgate_cost_settle_invalid_total", &[("rule", "llm")]), Some(2.0));
}

// ---------------------------------------------------------------------------
// Redis Cluster
// ---------------------------------------------------------------------------

fn cluster() -> &'static RedisCluster {
    static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
    CLUSTER.get_or_init(RedisCluster::start)
}

#[tokio::test]
async fn two_instances_on_a_cluster_see_each_others_settlements() {
    let up = Upstream::start().await;
    let cfg = tollgate_config(up.addr, &cluster().url(), "on_error = \"deny\"");
    for (algorithm, window) in [("token_bucket", "1h"), ("fixed_window", "1h"), ("sliding_window_counter", "1h")] {
        // A rule of its own per algorithm: the instances share the cluster.
        let rules = llm(algorithm, window, "").replace("\"llm\"", &format!("\"llm-{algorithm}\""));
        let a = Tollgate::with(&cfg, &[("rules.toml", &rules)]).await;
        let b = Tollgate::with(&cfg, &[("rules.toml", &rules)]).await;
        let ip = "198.51.100.5";
        assert_eq!(remaining(&used(a.proxy_addr, ip, "3").send().await), 90, "{algorithm}");
        // Settled in the background: b sees the 7 given back.
        eventually("the refund to reach redis", || async {
            // Each probe reserves 10 and reports 0: it gives all 10 back.
            remaining(&used(b.proxy_addr, ip, "0").send().await) == 87
        })
        .await;
        // 500 counts as the limit, 100: the bucket is 3 + 100 deep, past
        // its 100.
        assert_eq!(used(a.proxy_addr, ip, "500").send().await.status, StatusCode::OK);
        eventually("the charge to reach redis", || async {
            let r = used(b.proxy_addr, ip, "0").send().await;
            r.status == StatusCode::TOO_MANY_REQUESTS && r.header("x-ratelimit-remaining") == Some("0")
        })
        .await;
        a.stop().await;
        b.stop().await;
    }
}

/// A request admitted by the `on_error = "local"` fallback was counted in
/// this process's memory, never in Redis: its settlement goes there too. A
/// refund sent to Redis would give back units Redis never counted, and let
/// the key pass its limit there.
#[tokio::test]
async fn a_request_the_local_fallback_admitted_settles_locally_not_in_redis() {
    let up = Upstream::start().await;
    let redis = support::redis::RedisServer::start();
    let ip = "198.51.100.8";
    let rules = llm("token_bucket", "1h", "");
    let store = |policy: &str| format!("on_error = \"{policy}\"\ntimeout = \"200ms\"\nlease_percent = 0");
    let a = Tollgate::with(&tollgate_config(up.addr, &redis.url(), &store("local")), &[("rules.toml", &rules)]).await;
    let b = Tollgate::with(&tollgate_config(up.addr, &redis.url(), &store("deny")), &[("rules.toml", &rules)]).await;

    // Redis is down: the fallback admits this request here, reserving 10.
    // Its upstream answers seconds later, when Redis is back, with a real
    // cost of 0.
    redis.kill();
    let fallback = used(a.proxy_addr, ip, "0").header("x-echo-delay-ms", "4000");
    let fallback = tokio::spawn(async move { fallback.send().await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    redis.restart();
    // Meanwhile, 90 of the 100 counted in Redis.
    eventually("redis to answer again", || async {
        used(b.proxy_addr, ip, "10").send().await.status == StatusCode::OK
    })
    .await;
    for _ in 0..8 {
        assert_eq!(used(b.proxy_addr, ip, "10").send().await.status, StatusCode::OK);
    }
    let fallback = fallback.await.expect("the request task");
    assert_eq!(fallback.status, StatusCode::OK);
    assert_eq!(remaining(&fallback), 90, "decided by the fallback: {fallback:?}");
    // Time for a settlement sent to Redis to run.
    tokio::time::sleep(Duration::from_millis(1_000)).await;

    // Redis still counts 90: one more request of 10 fits, not two.
    let admitted = support::statuses(3, || used(b.proxy_addr, ip, "10")).await;
    assert_eq!(admitted, vec![200, 429, 429], "the fallback's refund reached Redis, which never counted it");
}

// ---------------------------------------------------------------------------
// Trailers
// ---------------------------------------------------------------------------

/// An upstream that streams a body and then the real cost in a trailer
/// (as an LLM API knows its token count only once it has answered), the
/// value taken from the request's `x-cost-trailer`.
async fn trailer_upstream() -> std::net::SocketAddr {
    use std::convert::Infallible;

    use bytes::Bytes;
    use http_body_util::StreamBody;
    use hyper::body::Frame;
    use hyper_util::rt::TokioIo;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|req: http::Request<hyper::body::Incoming>| async move {
                    let cost = req.headers().get("x-cost-trailer").cloned();
                    let mut trailers = http::HeaderMap::new();
                    if let Some(c) = cost {
                        trailers.insert("x-tokens-used", c);
                    }
                    let frames = vec![
                        Ok::<_, Infallible>(Frame::data(Bytes::from_static(b"streamed "))),
                        Ok(Frame::data(Bytes::from_static(b"tokens"))),
                        Ok(Frame::trailers(trailers)),
                    ];
                    let mut resp = http::Response::new(StreamBody::new(futures::stream::iter(frames)));
                    resp.headers_mut().insert("trailer", http::HeaderValue::from_static("x-tokens-used"));
                    Ok::<_, Infallible>(resp)
                });
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn a_cost_in_the_trailers_settles_when_the_body_ends() {
    let up = trailer_upstream().await;
    let tg = Tollgate::with(&support::config(up), &[("rules.toml", &llm("token_bucket", "100s", ""))]).await;
    let ip = "198.51.100.6";
    let call = |cost: &str| {
        Call::new("GET", tg.proxy_addr, "/").from_ip(ip).header("te", "trailers").header("x-cost-trailer", cost)
    };
    let first = call("3").send().await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.text(), "streamed tokens");
    assert_eq!(remaining(&first), 90);
    // Settled once the body (and its trailers) went through: 7 back.
    assert_eq!(remaining(&call("3").send().await), 87);
    // Not a number: the reservation stands.
    assert_eq!(remaining(&call("many").send().await), 84);
    assert_eq!(remaining(&call("0").send().await), 74);
    // The zero gave its 10 back.
    assert_eq!(remaining(&call("0").send().await), 74);
}

#[tokio::test]
async fn a_settled_rule_is_never_leased() {
    let up = Upstream::start().await;
    let cfg = tollgate_config(up.addr, &cluster().url(), "on_error = \"deny\"\nlease_idle = \"1h\"");
    // Big enough to lease 1% of (100 units) at every call, were it leased.
    let rules = "[[rule]]\nname = \"llm-leased\"\nkey = [\"ip\"]\nlimit = 10000\nwindow = \"1d\"\ncost = 10\ncost_response_header = \"x-tokens-used\"\n";
    let a = Tollgate::with(&cfg, &[("rules.toml", rules)]).await;
    let b = Tollgate::with(&cfg, &[("rules.toml", rules)]).await;
    let ip = "198.51.100.7";
    for _ in 0..5 {
        assert_eq!(used(a.proxy_addr, ip, "1").send().await.status, StatusCode::OK);
    }
    let metrics = a.metrics().await;
    assert_eq!(metric(&metrics, "tollgate_leases_granted_total", &[]), Some(0.0));
    assert_eq!(metric(&metrics, "tollgate_lease_hits_total", &[]), Some(0.0));
    // Everything settled is in Redis, for the other instance to see: five
    // of 1 and this probe's 10.
    eventually("the settlements to reach redis", || async {
        remaining(&used(b.proxy_addr, ip, "0").send().await) == 9_985
    })
    .await;
}

/// `/rules` and `tollgate explain` show where a rule's cost is settled
/// from, what a request reserves meanwhile, and what the quota counts.
#[tokio::test]
async fn rules_and_explain_show_the_settled_cost_and_quota_unit() {
    let up = Upstream::start().await;
    let estimated = "[[rule]]\nname = \"estimated\"\nkey = [\"ip\"]\nlimit = 1000\nwindow = \"1h\"\n\
                     cost_header = \"x-estimate\"\nmax_cost = 200\ncost_response_header = \"x-tokens-used\"\n";
    let plain = "[[rule]]\nname = \"plain\"\nkey = [\"ip\"]\nlimit = 5\nwindow = \"1m\"\n";
    let rules = format!("{}\n{estimated}\n{plain}", llm("token_bucket", "100s", ""));
    let tg = Tollgate::start(&up, &rules).await;
    let listed = tg.rules().await;
    let rule = |name: &str| {
        listed["rules"].as_array().and_then(|r| r.iter().find(|r| r["name"] == name)).cloned().expect("listed")
    };
    let llm_rule = rule("llm");
    assert_eq!(llm_rule["cost_response_header"], "x-tokens-used", "{llm_rule}");
    assert_eq!(llm_rule["cost"], 10, "{llm_rule}");
    assert_eq!(llm_rule["quota_unit"], "tokens", "{llm_rule}");
    let est = rule("estimated");
    assert_eq!(est["cost_response_header"], "x-tokens-used", "{est}");
    assert_eq!((&est["cost_header"], &est["max_cost"]), (&serde_json::json!("x-estimate"), &serde_json::json!(200)));
    assert!(est.get("quota_unit").is_none(), "{est}");
    // A rule that settles nothing stays as it was.
    let plain = rule("plain");
    for k in ["cost_response_header", "cost", "cost_header", "quota_unit"] {
        assert!(plain.get(k).is_none(), "{plain}");
    }

    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::create_dir(dir.path().join("rules")).expect("rules dir");
    std::fs::write(dir.path().join("rules/a.toml"), &rules).expect("write rules");
    std::fs::write(dir.path().join("tollgate.toml"), support::config(up.addr)).expect("write config");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["explain", "--path", "/", "--ip", "198.51.100.1", "--config"])
        .arg(dir.path().join("tollgate.toml"))
        .env_remove("RUST_LOG")
        .output()
        .expect("run tollgate");
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{report}{}", String::from_utf8_lossy(&out.stderr));
    for line in [
        "    cost settled from response header x-tokens-used (or trailer): reserves 10 until the response says",
        "    quota unit: tokens",
        "    cost settled from response header x-tokens-used (or trailer): reserves the x-estimate header's value (absent: 1, at most 200) until the response says",
    ] {
        assert!(report.lines().any(|l| l == line), "missing {line:?} in:\n{report}");
    }
    assert_eq!(report.matches("quota unit").count(), 1, "{report}");
}
