//! How hard a rule limits: shadow mode, soft and elastic throttling, and
//! requests that cost more than one unit.

use crate::support;

use support::{Tollgate, Upstream, burst, count, decisions, expect_statuses, metric, statuses};

#[tokio::test]
async fn shadow_rules_count_but_never_reject() {
    let upstream = Upstream::start().await;
    let rules = r#"
[[rule]]
name = "trial"
mode = "shadow"
algorithm = "fixed_window"
limit = 2
window = "1m"
"#;
    let tg = Tollgate::start(&upstream, rules).await;
    for _ in 0..5 {
        let r = tg.get("/").send().await;
        assert_eq!(r.status, 200);
        // Invisible to the client: no rate-limit headers at all.
        assert_eq!(r.ratelimit_headers(), Vec::<(String, String)>::new());
    }
    assert_eq!(upstream.hits(), 5);
    let m = tg.metrics().await;
    assert_eq!(decisions(&m, "trial", "allowed"), 2.0);
    assert_eq!(decisions(&m, "trial", "shadow_limited"), 3.0);
    assert_eq!(decisions(&m, "trial", "limited"), 0.0);
    assert_eq!(metric(&m, "tollgate_requests_total", &[("route", "svc"), ("decision", "allowed")]), Some(5.0));
    assert_eq!(metric(&m, "tollgate_requests_total", &[("route", "svc"), ("decision", "limited")]), Some(0.0));
}

#[tokio::test]
async fn a_shadow_rule_next_to_an_enforced_one() {
    let upstream = Upstream::start().await;
    let rules = r#"
[[rule]]
name = "trial"
mode = "shadow"
algorithm = "fixed_window"
limit = 1
window = "1m"

[[rule]]
name = "real"
algorithm = "fixed_window"
limit = 3
window = "1m"
"#;
    let tg = Tollgate::start(&upstream, rules).await;
    assert_eq!(statuses(5, || tg.get("/")).await, expect_statuses(3, 200, 2, 429));
    let m = tg.metrics().await;
    assert_eq!(decisions(&m, "real", "allowed"), 3.0);
    assert_eq!(decisions(&m, "real", "limited"), 2.0);
    assert_eq!(decisions(&m, "trial", "allowed"), 1.0);
    assert_eq!(decisions(&m, "trial", "shadow_limited"), 4.0);
}

#[tokio::test]
async fn a_shadow_rule_never_delays_nor_shows_in_the_headers() {
    let upstream = Upstream::start().await;
    // Shaping one request per hour: a delayed request would wait an hour.
    let rules = r#"
[[rule]]
name = "trial"
mode = "shadow"
algorithm = "leaky_bucket"
limit = 1
window = "1h"
burst = 5

[[rule]]
name = "real"
algorithm = "fixed_window"
limit = 100
window = "1m"
"#;
    let tg = Tollgate::start(&upstream, rules).await;
    // A request held for the hour fails `send`'s deadline.
    let mut replies = Vec::new();
    for _ in 0..3 {
        replies.push(tg.get("/").send().await);
    }
    for r in replies {
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-ratelimit-limit"), Some("100"), "the enforced rule's headers only");
        let state = r.header("ratelimit").unwrap_or_default();
        assert!(!state.contains("trial"), "the shadow rule is not shown: {state}");
    }
    assert_eq!(decisions(&tg.metrics().await, "trial", "allowed"), 3.0, "still counted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soft_throttling_admits_up_to_the_soft_limit() {
    let upstream = Upstream::start().await;
    let rules = r#"
[[rule]]
name = "soft"
throttle = "soft"
soft_percent = 50
algorithm = "fixed_window"
limit = 10
window = "1m"
"#;
    let tg = Tollgate::start(&upstream, rules).await;
    // 10 * (1 + 50/100) = 15.
    let replies = burst(40, |_| tg.get("/")).await;
    assert_eq!((count(&replies, 200), count(&replies, 429)), (15, 25));
    assert_eq!(upstream.hits(), 15);
    // The headroom is not advertised: clients see the nominal limit, used up.
    let mut admitted_remaining: Vec<&str> =
        replies.iter().filter(|r| r.status == 200).filter_map(|r| r.header("x-ratelimit-remaining")).collect();
    admitted_remaining.sort_by_key(|s| s.parse::<u64>().expect("number"));
    assert_eq!(admitted_remaining, ["0", "0", "0", "0", "0", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]);
    let rejected = replies.iter().find(|r| r.status == 429).expect("a rejection");
    assert_eq!(rejected.header("x-ratelimit-limit"), Some("10"));
    assert_eq!(rejected.json()["limit"], 10);
}

#[tokio::test]
async fn soft_percent_defaults_to_ten() {
    let upstream = Upstream::start().await;
    let rules = "[[rule]]\nname = \"s\"\nthrottle = \"soft\"\nalgorithm = \"sliding_window_log\"\nlimit = 20\nwindow = \"1m\"\n";
    let tg = Tollgate::start(&upstream, rules).await;
    assert_eq!(statuses(25, || tg.get("/")).await, expect_statuses(22, 200, 3, 429));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elastic_throttling_follows_the_upstream_load() {
    let upstream = Upstream::start().await;
    let rules = r#"
[[rule]]
name = "elastic"
key = ["user"]
match = { path = "/api*" }
throttle = "elastic"
elastic_percent = 50
elastic_when_inflight_below = 3
algorithm = "fixed_window"
limit = 10
window = "1m"
"#;
    let tg = Tollgate::start(&upstream, rules).await;
    let alice = || tg.get("/api").header("x-user-id", "alice");
    let bob = || tg.get("/api").header("x-user-id", "bob");

    // An idle upstream: alice may go 50 % over her limit.
    assert_eq!(statuses(20, alice).await, expect_statuses(15, 200, 5, 429));

    // Three slow requests (outside the rule) keep the upstream busy.
    let mut slow = Vec::new();
    for _ in 0..3 {
        let call = tg.get("/slow").header("x-echo-hold", "1");
        slow.push(tokio::spawn(call.send()));
    }
    upstream.wait_held(3).await;
    assert_eq!(tg.proxy.upstream_inflight("svc"), Some(3));
    // Busy: bob is held to the plain limit.
    assert_eq!(statuses(12, bob).await, expect_statuses(10, 200, 2, 429));

    // Idle again: bob gets his headroom back, on top of what he used.
    upstream.release(3);
    for s in slow {
        assert_eq!(s.await.expect("slow request").status, 200);
    }
    assert_eq!(tg.proxy.upstream_inflight("svc"), Some(0));
    assert_eq!(statuses(7, bob).await, expect_statuses(5, 200, 2, 429));
}

#[tokio::test]
async fn fixed_cost_takes_several_units() {
    let upstream = Upstream::start().await;
    let rules = r#"
[[rule]]
name = "export"
cost = 5
algorithm = "fixed_window"
limit = 20
window = "1m"
"#;
    let tg = Tollgate::start(&upstream, rules).await;
    let mut remaining = Vec::new();
    for _ in 0..5 {
        let r = tg.get("/").send().await;
        remaining.push((r.status.as_u16(), r.header("x-ratelimit-remaining").unwrap_or("-").to_string()));
    }
    let want: Vec<(u16, String)> =
        [(200, "15"), (200, "10"), (200, "5"), (200, "0"), (429, "0")].map(|(s, r)| (s, r.to_string())).into();
    assert_eq!(remaining, want);
}

#[tokio::test]
async fn cost_header_sets_the_cost_and_bad_values_get_400() {
    let upstream = Upstream::start().await;
    let rules = r#"
[[rule]]
name = "tokens"
cost_header = "x-cost"
limit = 20
window = "1m"
"#;
    let tg = Tollgate::start(&upstream, rules).await;
    let cost = |c: &str| tg.get("/").header("x-cost", c);

    for bad in ["0", "21", "-1", "1.5", "abc", "", "1e3", "99999999999999999999", "+3"] {
        let r = cost(bad).send().await;
        assert_eq!(r.status, 400, "x-cost: {bad:?}");
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(
            r.text_without_id(),
            r#"{"error":"bad_request","message":"header x-cost must be a whole number from 1 to 20"}"#
        );
    }
    assert_eq!(upstream.hits(), 0);

    let r = cost("15").send().await;
    assert_eq!((r.status.as_u16(), r.header("x-ratelimit-remaining")), (200, Some("5")));
    // Absent: one unit.
    let r = tg.get("/").send().await;
    assert_eq!((r.status.as_u16(), r.header("x-ratelimit-remaining")), (200, Some("4")));
    // Too expensive for what is left: refused, and nothing is taken.
    let r = cost(" 5 ").send().await;
    assert_eq!(r.status, 429);
    let r = cost("4").send().await;
    assert_eq!((r.status.as_u16(), r.header("x-ratelimit-remaining")), (200, Some("0")));
    assert_eq!(upstream.hits(), 3);
}
