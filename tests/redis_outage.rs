//! Redis down from the start, and Redis going away and coming back, for
//! each `on_error` policy: what clients get, `/readyz` (not ready only when
//! the policy is `deny`), `/healthz/store` (the store itself), and the store
//! metrics. Each test runs its own `redis-server`, killed with `kill -9`.

use crate::support;

use support::redis::{RedisServer, tollgate_config};
use support::{Tollgate, Upstream, eventually, metric};

/// Fixed window of 2 per hour, keyed by client address: no window boundary
/// falls inside a test (all but certainly).
const RULES: &str = r#"
[[rule]]
name = "outage"
key = ["ip"]
algorithm = "fixed_window"
limit = 2
window = "1h"
"#;

async fn tollgate(up: &Upstream, url: &str, policy: &str) -> Tollgate {
    let store = format!("timeout = \"50ms\"\non_error = \"{policy}\"\nkey_prefix = \"t-outage-{policy}:\"");
    Tollgate::with(&tollgate_config(up.addr, url, &store), &[("rules.toml", RULES)]).await
}

async fn statuses(tg: &Tollgate, ip: &str, n: usize) -> Vec<u16> {
    support::statuses(n, || tg.get("/").from_ip(ip)).await
}

async fn ready(tg: &Tollgate) -> u16 {
    tg.admin("/readyz").await.status.as_u16()
}

async fn store_health(tg: &Tollgate) -> u16 {
    tg.admin("/healthz/store").await.status.as_u16()
}

/// `/readyz` while Redis is unreachable: only a tollgate that refuses
/// requests without its store (`deny`) leaves the load balancer; with
/// `allow` or `local` it still serves, and every replica leaving a
/// Kubernetes Service at once would stop all traffic.
fn ready_while_down(policy: &str) -> u16 {
    if policy == "deny" { 503 } else { 200 }
}

async fn gauge(tg: &Tollgate, name: &str, labels: &[(&str, &str)]) -> f64 {
    metric(&tg.metrics().await, name, labels).unwrap_or(0.0)
}

async fn store_errors(tg: &Tollgate) -> f64 {
    gauge(tg, "tollgate_store_errors_total", &[("backend", "redis")]).await
}

/// What a policy answers while Redis is unreachable, to a fresh client
/// making four requests against a limit of 2.
fn while_down(policy: &str) -> Vec<u16> {
    match policy {
        "allow" => vec![200; 4],
        "deny" => vec![503; 4],
        // Counted in this process's memory with the same rule.
        "local" => vec![200, 200, 429, 429],
        other => panic!("unknown policy {other}"),
    }
}

async fn redis_down_from_the_start(policy: &str) {
    let up = Upstream::start().await;
    let port = RedisServer::unused_port();
    let tg = tollgate(&up, &format!("redis://127.0.0.1:{port}"), policy).await;

    assert_eq!(ready(&tg).await, ready_while_down(policy), "readiness while redis is down");
    assert_eq!(store_health(&tg).await, 503, "the store is down");
    assert_eq!(statuses(&tg, "203.0.113.1", 4).await, while_down(policy));
    assert!(store_errors(&tg).await >= 4.0, "every failed check is counted");
    assert_eq!(gauge(&tg, "tollgate_store_degraded", &[]).await, 1.0);
    if policy == "deny" {
        let reply = tg.get("/").from_ip("203.0.113.1").send().await;
        assert_eq!(reply.header("retry-after"), Some("1"));
    }

    // Redis comes up: tollgate finds it by itself and counts there again.
    let server = RedisServer::start_on(port);
    eventually("the store healthy once redis is up", || async { store_health(&tg).await == 200 }).await;
    assert_eq!(ready(&tg).await, 200);
    eventually("back to the store", || async { gauge(&tg, "tollgate_store_degraded", &[]).await == 0.0 }).await;
    assert_eq!(gauge(&tg, "tollgate_store_fallback_transitions_total", &[("direction", "to_store")]).await, 1.0);
    let errors = store_errors(&tg).await;
    assert_eq!(statuses(&tg, "203.0.113.2", 3).await, [200, 200, 429], "counted in redis");
    assert_eq!(store_errors(&tg).await, errors, "no store error once redis answers");
    let key = format!("t-outage-{policy}:{{outage|ip=203.0.113.2}}:fw2");
    assert!(server.cli(&support::redis::window(&key)).trim().ends_with(":2"), "the count is in redis");
}

async fn redis_going_away_and_coming_back(policy: &str) {
    let up = Upstream::start().await;
    let server = RedisServer::start();
    let tg = tollgate(&up, &server.url(), policy).await;
    assert_eq!(ready(&tg).await, 200);
    assert_eq!(store_health(&tg).await, 200);
    assert_eq!(statuses(&tg, "203.0.113.3", 1).await, [200]);

    server.kill();
    assert_eq!(statuses(&tg, "203.0.113.4", 4).await, while_down(policy));
    assert_eq!(ready(&tg).await, ready_while_down(policy));
    assert_eq!(store_health(&tg).await, 503);
    assert!(store_errors(&tg).await >= 3.0);
    let to_local = ("direction", "to_local");
    assert_eq!(gauge(&tg, "tollgate_store_fallback_transitions_total", &[to_local]).await, 1.0);
    assert_eq!(gauge(&tg, "tollgate_store_degraded", &[]).await, 1.0);

    // Back, empty (nothing is persisted): counting resumes in redis.
    server.restart();
    eventually("the store healthy once redis is back", || async { store_health(&tg).await == 200 }).await;
    assert_eq!(ready(&tg).await, 200);
    eventually("back to the store", || async { gauge(&tg, "tollgate_store_degraded", &[]).await == 0.0 }).await;
    assert_eq!(statuses(&tg, "203.0.113.5", 3).await, [200, 200, 429]);
    let key = format!("t-outage-{policy}:{{outage|ip=203.0.113.5}}:fw2");
    assert!(server.cli(&support::redis::window(&key)).trim().ends_with(":2"), "the count is in redis");
}

#[tokio::test]
async fn redis_down_from_the_start_with_allow() {
    redis_down_from_the_start("allow").await;
}

#[tokio::test]
async fn redis_down_from_the_start_with_deny() {
    redis_down_from_the_start("deny").await;
}

#[tokio::test]
async fn redis_down_from_the_start_with_local() {
    redis_down_from_the_start("local").await;
}

#[tokio::test]
async fn redis_going_away_and_coming_back_with_allow() {
    redis_going_away_and_coming_back("allow").await;
}

#[tokio::test]
async fn redis_going_away_and_coming_back_with_deny() {
    redis_going_away_and_coming_back("deny").await;
}

#[tokio::test]
async fn redis_going_away_and_coming_back_with_local() {
    redis_going_away_and_coming_back("local").await;
}

/// A rule can override the store-wide policy: here the store says `allow`
/// and one rule says `deny`.
#[tokio::test]
async fn a_rules_own_policy_overrides_the_stores() {
    let up = Upstream::start().await;
    let port = RedisServer::unused_port();
    let rules = format!(
        "{RULES}\n[[rule]]\nname = \"strict\"\nmatch = {{ path = \"/strict\" }}\nlimit = 5\nwindow = \"1m\"\non_error = \"deny\"\n"
    );
    let store = "timeout = \"50ms\"\non_error = \"allow\"";
    let tg = Tollgate::with(
        &tollgate_config(up.addr, &format!("redis://127.0.0.1:{port}"), store),
        &[("rules.toml", &rules)],
    )
    .await;
    assert_eq!(tg.get("/").from_ip("203.0.113.6").send().await.status, 200);
    assert_eq!(tg.get("/strict").from_ip("203.0.113.6").send().await.status, 503);
}

/// `allow` lets a request through without the failed rule's rate-limit
/// headers (no quota is known), while a rule that still answers (here
/// `local`, counting in this instance) reports its own. `tight` would be
/// the one reported if it answered: it has the least left.
#[tokio::test]
async fn fail_open_leaves_out_the_failed_rules_headers() {
    let up = Upstream::start().await;
    let port = RedisServer::unused_port();
    let rules = "[[rule]]\nname = \"tight\"\nkey = [\"ip\"]\nlimit = 5\nwindow = \"1h\"\non_error = \"allow\"\n\n\
                 [[rule]]\nname = \"local\"\nkey = [\"ip\"]\nlimit = 100\nwindow = \"1h\"\non_error = \"local\"\n";
    let store = "timeout = \"50ms\"\non_error = \"allow\"";
    let tg = Tollgate::with(
        &tollgate_config(up.addr, &format!("redis://127.0.0.1:{port}"), store),
        &[("rules.toml", rules)],
    )
    .await;
    let r = tg.get("/").from_ip("203.0.113.7").send().await;
    assert_eq!(r.status, 200);
    let shown = r.ratelimit_headers();
    assert_eq!(r.header("x-ratelimit-limit"), Some("100"), "only local's quota is known: {shown:?}");
    assert_eq!(r.header("x-ratelimit-remaining"), Some("99"), "{shown:?}");
    assert!(!format!("{shown:?}").contains("tight"), "the failed rule shows in the headers: {shown:?}");

    // With only the failed rule: no rate-limit header at all.
    let only = "[[rule]]\nname = \"tight\"\nkey = [\"ip\"]\nlimit = 5\nwindow = \"1h\"\non_error = \"allow\"\n";
    let tg =
        Tollgate::with(&tollgate_config(up.addr, &format!("redis://127.0.0.1:{port}"), store), &[("rules.toml", only)])
            .await;
    let r = tg.get("/").from_ip("203.0.113.8").send().await;
    assert_eq!(r.status, 200);
    assert_eq!(r.ratelimit_headers(), Vec::<(String, String)>::new(), "no quota is known");
}
