//! What a client is told: `X-RateLimit-*` for the most restrictive rule,
//! `RateLimit-Policy` / `RateLimit` for every matching rule, and the 429
//! answer with `Retry-After` that is never early.

use crate::support;

use std::time::Duration;

use support::{Reply, Tollgate, Upstream, statuses};

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

#[tokio::test]
async fn forwarded_responses_carry_the_quota() {
    let upstream = Upstream::start().await;
    let rules = r#"
[[rule]]
name = "api"
limit = 5
window = "1m"
"#;
    let tg = Tollgate::start(&upstream, rules).await;
    // Token bucket, 5 per 60 s: one token comes back every 12 s.
    let r = tg.get("/x").send().await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-upstream"), Some("echo"));
    assert_eq!(
        r.ratelimit_headers(),
        pairs(&[
            ("x-ratelimit-limit", "5"),
            ("x-ratelimit-remaining", "4"),
            ("x-ratelimit-reset", "12"),
            ("ratelimit-policy", "\"api\";q=5;w=60"),
            ("ratelimit", "\"api\";r=4;t=12"),
        ])
    );
    tg.get("/x").send().await;
    let r = tg.get("/x").send().await;
    assert_eq!(r.header("x-ratelimit-remaining"), Some("2"));
    assert_eq!(r.header("x-ratelimit-reset"), Some("36"));
    assert_eq!(r.header("ratelimit"), Some("\"api\";r=2;t=36"));
}

/// The issue's own example: 2 of 5 used, 20 s into a 60 s window.
#[tokio::test]
async fn the_login_example() {
    let upstream = Upstream::start().await;
    let rules = r#"
[[rule]]
name = "login-by-ip"
match = { methods = ["POST"], path = "/api/login" }
key = ["ip"]
algorithm = "fixed_window"
limit = 5
window = "1m"
"#;
    let tg = Tollgate::start(&upstream, rules).await;
    tg.advance(Duration::from_secs(20));
    let login = || tg.call("POST", "/api/login").body("user=a");
    login().send().await;
    let r = login().send().await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.ratelimit_headers(),
        pairs(&[
            ("x-ratelimit-limit", "5"),
            ("x-ratelimit-remaining", "3"),
            ("x-ratelimit-reset", "40"),
            ("ratelimit-policy", "\"login-by-ip\";q=5;w=60"),
            ("ratelimit", "\"login-by-ip\";r=3;t=40"),
        ])
    );
    assert_eq!(statuses(3, login).await, [200, 200, 200]);

    let r = login().send().await;
    assert_rejected(&r, "login-by-ip", 5, 60, 40);
    assert_eq!(
        r.ratelimit_headers(),
        pairs(&[
            ("x-ratelimit-limit", "5"),
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "40"),
            ("x-ratelimit-retry-after", "40"),
            ("retry-after", "40"),
            ("ratelimit-policy", "\"login-by-ip\";q=5;w=60"),
            ("ratelimit", "\"login-by-ip\";r=0;t=40"),
        ])
    );
    assert_eq!(
        r.text_without_id(),
        r#"{"error":"too_many_requests","rule":"login-by-ip","limit":5,"window_seconds":60,"retry_after_seconds":40,"message":"Rate limit exceeded: at most 5 requests per 60 s under rule \"login-by-ip\". Retry in 40 s."}"#
    );
    assert_eq!(upstream.hits(), 5);

    // Other methods and paths are not counted by the rule and get no headers.
    let r = tg.get("/api/login").send().await;
    assert_eq!(r.status, 200);
    assert_eq!(r.ratelimit_headers(), []);

    // One second before the window ends: still limited, told to wait 1 s.
    tg.advance(Duration::from_secs(39));
    let r = login().send().await;
    assert_rejected(&r, "login-by-ip", 5, 60, 1);
    tg.advance(Duration::from_secs(1));
    let r = login().send().await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("ratelimit"), Some("\"login-by-ip\";r=4;t=60"));
}

fn assert_rejected(r: &Reply, rule: &str, limit: u64, window: u64, retry: u64) {
    assert_eq!(r.status, 429, "{:?}", r.text());
    assert_eq!(r.header("content-type"), Some("application/json"));
    let retry_s = retry.to_string();
    assert_eq!(r.header("retry-after"), Some(retry_s.as_str()));
    assert_eq!(r.header("x-ratelimit-retry-after"), Some(retry_s.as_str()));
    assert_eq!(r.header("x-ratelimit-remaining"), Some("0"));
    let body = r.json();
    assert_eq!(body["error"], "too_many_requests");
    assert_eq!(body["rule"], rule);
    assert_eq!(body["limit"], limit);
    assert_eq!(body["window_seconds"], window);
    assert_eq!(body["retry_after_seconds"], retry);
    assert_eq!(
        body["message"],
        format!(
            "Rate limit exceeded: at most {limit} requests per {window} s under rule \"{rule}\". Retry in {retry} s."
        )
    );
}

/// For every algorithm: `Retry-After: N` is the first whole second at which
/// the same request passes. One second earlier it is still refused (so N is
/// not generous), at N it passes (so N is never early).
#[tokio::test]
async fn retry_after_is_the_first_whole_second_that_passes() {
    // (algorithm, limit, window, Retry-After once 'limit' requests are in at T0)
    let cases = [
        // One token every 10/3 s.
        ("token_bucket", "10s", 4),
        // One queue slot drains every 100 ms (the 3 admitted requests wait
        // 0, 100 and 200 ms of real time for their turns).
        ("leaky_bucket", "300ms", 1),
        ("fixed_window", "10s", 10),
        ("sliding_window_log", "10s", 10),
        // 3 in the current window cannot fit 1 more until the window is
        // previous and weighs 3 * (1 - f) <= 2: f = 1/3, at 13.33 s.
        ("sliding_window_counter", "10s", 14),
    ];
    for (algorithm, window, retry) in cases {
        let upstream = Upstream::start().await;
        let rules = format!(
            "[[rule]]\nname = \"{algorithm}\"\nalgorithm = \"{algorithm}\"\nlimit = 3\nwindow = \"{window}\"\n"
        );
        let tg = Tollgate::start(&upstream, &rules).await;
        assert_eq!(statuses(3, || tg.get("/")).await, [200, 200, 200], "{algorithm}");
        let window_secs = if window == "300ms" { 1 } else { 10 };
        let r = tg.get("/").send().await;
        assert_rejected(&r, algorithm, 3, window_secs, retry);
        if retry > 1 {
            tg.advance(Duration::from_secs(retry - 1));
            let r = tg.get("/").send().await;
            assert_eq!(r.status, 429, "{algorithm} passed a second before its Retry-After");
            assert_eq!(r.header("retry-after"), Some("1"), "{algorithm}");
            tg.advance(Duration::from_secs(1));
        } else {
            tg.advance(Duration::from_secs(retry));
        }
        let r = tg.get("/").send().await;
        assert_eq!(r.status, 200, "{algorithm} still refused at its Retry-After");
        assert_eq!(upstream.hits(), 4, "{algorithm}");
    }
}

#[tokio::test]
async fn the_most_restrictive_rule_fills_the_x_headers() {
    let upstream = Upstream::start().await;
    let rules = r#"
[[rule]]
name = "wide"
algorithm = "fixed_window"
limit = 10
window = "1m"

[[rule]]
name = "narrow"
algorithm = "fixed_window"
limit = 3
window = "10s"

[[rule]]
name = "other-path"
match = { path = "/admin*" }
limit = 1
window = "1s"
"#;
    let tg = Tollgate::start(&upstream, rules).await;
    let r = tg.get("/x").send().await;
    assert_eq!(
        r.ratelimit_headers(),
        pairs(&[
            ("x-ratelimit-limit", "3"),
            ("x-ratelimit-remaining", "2"),
            ("x-ratelimit-reset", "10"),
            ("ratelimit-policy", "\"wide\";q=10;w=60, \"narrow\";q=3;w=10"),
            ("ratelimit", "\"wide\";r=9;t=60, \"narrow\";r=2;t=10"),
        ])
    );
    assert_eq!(statuses(2, || tg.get("/x")).await, [200, 200]);
    // `narrow` rejects; `wide` would still admit, but a rejected request
    // consumes nothing from any rule.
    let r = tg.get("/x").send().await;
    assert_rejected(&r, "narrow", 3, 10, 10);
    assert_eq!(r.header("x-ratelimit-limit"), Some("3"));
    assert_eq!(r.header("ratelimit"), Some("\"wide\";r=7;t=60, \"narrow\";r=0;t=10"));
    tg.get("/x").send().await;

    tg.advance(Duration::from_secs(10));
    let r = tg.get("/x").send().await;
    assert_eq!(r.status, 200);
    // `wide` counted the 3 admitted requests and this one, not the 2
    // rejected ones: 6 remain.
    assert_eq!(r.header("ratelimit"), Some("\"wide\";r=6;t=50, \"narrow\";r=2;t=10"));
    assert_eq!(r.header("x-ratelimit-limit"), Some("3"));
    assert_eq!(r.header("x-ratelimit-remaining"), Some("2"));
}

#[tokio::test]
async fn no_headers_when_no_rule_matches() {
    let upstream = Upstream::start().await;
    let rules = r#"
[[rule]]
name = "only-post"
match = { methods = ["POST"] }
limit = 1
window = "1s"
"#;
    let tg = Tollgate::start(&upstream, rules).await;
    for _ in 0..3 {
        let r = tg.get("/x").send().await;
        assert_eq!(r.status, 200);
        assert_eq!(r.ratelimit_headers(), []);
    }
}
