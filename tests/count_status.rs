//! `count_status` end to end: a login rule counting only failed logins
//! (401), 5 per 15 minutes. Every attempt reserves one; a success gives it
//! back when its response comes, so successes never count and the sixth
//! failure in a row is refused; on the memory store and on a real Redis
//! Cluster shared by two instances.

use crate::support;

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use support::redis::{RedisCluster, tollgate_config};
use support::{Call, Reply, Tollgate, Upstream, eventually};

fn login_rule(name: &str, algorithm: &str, counted: &str) -> String {
    format!(
        "[[rule]]\nname = \"{name}\"\nmatch = {{ methods = [\"POST\"], path = \"/login\" }}\nkey = [\"ip\"]\n\
         algorithm = \"{algorithm}\"\nlimit = 5\nwindow = \"15m\"\ncount_status = {counted}\n"
    )
}

/// A login attempt from `ip` that the upstream answers with `status`.
fn login(addr: SocketAddr, ip: &str, status: u16) -> Call {
    Call::new("POST", addr, "/login").from_ip(ip).header("x-echo-status", &status.to_string())
}

fn remaining(r: &Reply) -> u64 {
    r.header("x-ratelimit-remaining").and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{r:?}"))
}

#[tokio::test]
async fn successful_logins_never_count_and_the_sixth_failure_in_a_row_is_refused() {
    let up = Upstream::start().await;
    for algorithm in ["fixed_window", "sliding_window_counter"] {
        let tg = Tollgate::start(&up, &login_rule("failed-logins", algorithm, "[401]")).await;
        let ip = "198.51.100.1";
        // Twenty successes: each reserves one (4 left while it is under way)
        // and gives it back.
        for _ in 0..20 {
            let ok = login(tg.proxy_addr, ip, 200).send().await;
            assert_eq!(ok.status, 200, "{algorithm}");
            assert_eq!(remaining(&ok), 4, "{algorithm}: a success counted");
        }
        // Five failures count, one after another.
        for left in (0..5).rev() {
            let failed = login(tg.proxy_addr, ip, 401).send().await;
            assert_eq!(failed.status, 401, "{algorithm}");
            assert_eq!(remaining(&failed), left, "{algorithm}");
        }
        // The sixth attempt is refused, whatever it would have been.
        for status in [401, 200] {
            let refused = login(tg.proxy_addr, ip, status).send().await;
            assert_eq!(refused.status, 429, "{algorithm}: {}", refused.text());
            assert_eq!(refused.json()["rule"], "failed-logins");
        }
        // Another address, and requests the rule does not match, are free.
        assert_eq!(login(tg.proxy_addr, "198.51.100.2", 401).send().await.status, 401);
        assert_eq!(tg.get("/login").from_ip(ip).send().await.status, 200);
        tg.stop().await;
    }
}

#[tokio::test]
async fn classes_count_a_whole_class_and_tollgates_own_answers_by_their_status() {
    let up = Upstream::start().await;
    let rules = format!(
        "{}\n{}",
        login_rule("server-errors", "fixed_window", "[\"5xx\"]"),
        login_rule("client-errors", "sliding_window_counter", "[\"4xx\"]").replace("/login", "/signup")
    );
    let tg = Tollgate::start(&up, &rules).await;
    let shown = tg.rules().await;
    let counted: Vec<_> = shown["rules"].as_array().expect("rules").iter().map(|r| r["count_status"].clone()).collect();
    assert_eq!(counted, [serde_json::json!(["5xx"]), serde_json::json!(["4xx"])], "/rules: {shown}");
    let ip = "198.51.100.3";
    // 4xx of every kind count for "4xx"; 2xx and 3xx do not.
    for (status, left) in [(200, 4), (404, 4), (302, 3), (403, 3), (409, 2), (204, 1), (400, 1)] {
        let r = Call::new("POST", tg.proxy_addr, "/signup").from_ip(ip).header("x-echo-status", &status.to_string());
        assert_eq!(remaining(&r.send().await), left, "status {status}");
    }
    drop(tg);

    // An upstream that refuses connections: tollgate answers 502 itself,
    // which a "5xx" rule counts and a [401] rule gives back.
    let down = Upstream::refusing_addr().await;
    let config = support::upstream_config(&format!("url = \"http://{down}\""), "");
    // (The [401] rule allows fewer: were the 502s counted for it, it would
    // refuse first.)
    let rules = format!(
        "{}\n{}",
        login_rule("server-errors", "fixed_window", "[\"5xx\"]"),
        login_rule("bad", "fixed_window", "[401]").replace("limit = 5", "limit = 3")
    );
    let tg = Tollgate::with(&config, &[("rules.toml", &rules)]).await;
    let statuses = support::statuses(7, || login(tg.proxy_addr, ip, 200)).await;
    assert_eq!(statuses, [502, 502, 502, 502, 502, 429, 429]);
    let refused = login(tg.proxy_addr, ip, 200).send().await;
    assert_eq!(refused.json()["rule"], "server-errors", "{}", refused.text());
}

fn cluster() -> &'static RedisCluster {
    static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
    CLUSTER.get_or_init(RedisCluster::start)
}

#[tokio::test]
async fn two_instances_on_a_cluster_share_the_count_of_failures_exactly() {
    let up = Upstream::start().await;
    let cfg = tollgate_config(up.addr, &cluster().url(), "on_error = \"deny\"");
    for algorithm in ["fixed_window", "sliding_window_counter"] {
        let rules = login_rule(&format!("cluster-logins-{algorithm}"), algorithm, "[401]");
        let a = Tollgate::with(&cfg, &[("rules.toml", &rules)]).await;
        let b = Tollgate::with(&cfg, &[("rules.toml", &rules)]).await;
        let ip = "198.51.100.5";
        for i in 0..10 {
            let tg = if i % 2 == 0 { &a } else { &b };
            assert_eq!(login(tg.proxy_addr, ip, 200).send().await.status, 200, "{algorithm}");
        }
        // Successes are given back in the background: once they have
        // reached Redis, a success still finds the key whole.
        eventually("the successes' give-backs to reach redis", || async {
            remaining(&login(b.proxy_addr, ip, 200).send().await) == 4
        })
        .await;
        // The last probe's own give-back.
        tokio::time::sleep(Duration::from_millis(300)).await;
        // Failures alternate between the instances and count exactly.
        for (i, left) in (0..5).rev().enumerate() {
            let tg = if i % 2 == 0 { &a } else { &b };
            let failed = login(tg.proxy_addr, ip, 401).send().await;
            assert_eq!((failed.status.as_u16(), remaining(&failed)), (401, left), "{algorithm}, failure {}", i + 1);
        }
        for tg in [&a, &b] {
            let refused = login(tg.proxy_addr, ip, 401).send().await;
            assert_eq!(refused.status, 429, "{algorithm}: {}", refused.text());
        }
        a.stop().await;
        b.stop().await;
    }
}
