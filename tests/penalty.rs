//! The penalty box: a rule's `penalty` holds a key it refused out for a
//! time whatever its window allows (`penalty_after` refusals first), and
//! `/blocks` (or `tollgate block`) holds a key out now until the time is
//! up or the block is lifted; `Retry-After` and `X-RateLimit-Reset` give
//! the time left. On the memory store (the test clock moves) and on a
//! real Redis Cluster shared by two instances (real time passes).

use crate::support;

use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::{Value, json};
use support::redis::{RedisCluster, tollgate_config};
use support::{Call, Reply, Tollgate, Upstream, metric};

const LOGIN: &str = r#"
[[rule]]
name = "login"
key = ["ip"]
algorithm = "fixed_window"
limit = 2
window = "1s"
penalty = "10s"

[[rule]]
name = "api"
key = ["ip"]
limit = 1000
window = "1h"
"#;

async fn from(t: &Tollgate, ip: &str) -> Reply {
    t.get("/").from_ip(ip).send().await
}

fn secs(r: &Reply, header: &str) -> u64 {
    r.header(header).and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{header} in {:?}", r.headers))
}

async fn post_block(t: &Tollgate, body: Value) -> Reply {
    Call::new("POST", t.admin_addr, "/blocks")
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
}

async fn delete_block(t: &Tollgate, query: &str) -> Reply {
    Call::new("DELETE", t.admin_addr, &format!("/blocks?{query}")).send().await
}

async fn blocks(t: &Tollgate, query: &str) -> Value {
    let reply = t.admin(&format!("/blocks{query}")).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply.json()
}

fn penalties(text: &str, rule: &str) -> f64 {
    metric(text, "tollgate_penalties_total", &[("rule", rule)]).unwrap_or(0.0)
}

#[tokio::test]
async fn a_penalty_refuses_a_key_past_its_window_until_it_ends() {
    let up = Upstream::start().await;
    let t = Tollgate::start(&up, LOGIN).await;
    assert_eq!(penalties(&t.metrics().await, "login"), 0.0, "the rule's series exists at zero");
    assert_eq!(from(&t, "203.0.113.7").await.status, 200);
    assert_eq!(from(&t, "203.0.113.7").await.status, 200);
    let refused = from(&t, "203.0.113.7").await;
    assert_eq!(refused.status, 429);
    assert_eq!(secs(&refused, "retry-after"), 10, "the penalty, not the window's second");
    assert_eq!(secs(&refused, "x-ratelimit-reset"), 10);
    assert_eq!(penalties(&t.metrics().await, "login"), 1.0);

    // The window has refilled; the penalty holds, and says what is left.
    t.advance(Duration::from_secs(3));
    let still = from(&t, "203.0.113.7").await;
    assert_eq!(still.status, 429, "{}", still.text());
    assert_eq!((secs(&still, "retry-after"), secs(&still, "x-ratelimit-reset")), (7, 7));
    assert_eq!(from(&t, "203.0.113.8").await.status, 200, "another key is not in the box");
    // A refusal by the box counts nowhere: the key is not put in anew.
    assert_eq!(penalties(&t.metrics().await, "login"), 1.0);

    // `/top` and `/blocks` show it.
    let top = t.admin("/top?rule=login").await.json();
    assert_eq!(top["penalty_box"][0]["key"], "login|ip=203.0.113.7", "{top}");
    assert_eq!(top["penalty_box"][0]["source"], "penalty");
    let listed = blocks(&t, "").await;
    assert_eq!(listed["blocks"].as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!(listed["blocks"][0]["expires_in_seconds"], 7);

    t.advance(Duration::from_secs(7));
    assert_eq!(from(&t, "203.0.113.7").await.status, 200, "the penalty is over");
    assert_eq!(blocks(&t, "").await["blocks"].as_array().map(Vec::len), Some(0));
}

#[tokio::test]
async fn penalty_after_waits_for_that_many_refusals_in_one_window() {
    let up = Upstream::start().await;
    let rules = LOGIN
        .replace("limit = 2\n", "limit = 1\n")
        .replace("window = \"1s\"\n", "window = \"10s\"\n")
        .replace("penalty = \"10s\"\n", "penalty = \"1m\"\npenalty_after = 3\n");
    let t = Tollgate::start(&up, &rules).await;
    assert_eq!(from(&t, "203.0.113.7").await.status, 200);
    for n in 1..=2 {
        let r = from(&t, "203.0.113.7").await;
        assert_eq!(r.status, 429);
        assert!(secs(&r, "retry-after") <= 10, "refusal {n} is the window's: {:?}", r.headers);
    }
    let third = from(&t, "203.0.113.7").await;
    assert_eq!(secs(&third, "retry-after"), 60, "the third refusal starts the penalty");
    assert_eq!(penalties(&t.metrics().await, "login"), 1.0);
}

#[tokio::test]
async fn a_block_through_the_api_refuses_until_lifted() {
    let up = Upstream::start().await;
    // `api` has no penalty: a block holds on it all the same.
    let t = Tollgate::start(&up, LOGIN).await;
    let reply =
        post_block(&t, json!({"rule": "api", "key": "api|ip=203.0.113.7", "for": "1h", "reason": "INC-1"})).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.json()["expires_in_seconds"], 3600);
    let refused = from(&t, "203.0.113.7").await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.json()["rule"], "api", "{}", refused.text());
    assert_eq!(secs(&refused, "retry-after"), 3600);
    assert_eq!(from(&t, "203.0.113.8").await.status, 200);

    let listed = blocks(&t, "?rule=api").await;
    let entry = &listed["blocks"][0];
    assert_eq!((entry["rule"].as_str(), entry["key"].as_str()), (Some("api"), Some("api|ip=203.0.113.7")), "{listed}");
    assert_eq!((entry["source"].as_str(), entry["reason"].as_str()), (Some("api"), Some("INC-1")));
    assert_eq!(listed["rules"][0]["total"], 1);
    // Not a penalty: not counted as one.
    assert_eq!(penalties(&t.metrics().await, "api"), 0.0);

    // The key may be given without the rule's name.
    let lifted = delete_block(&t, "rule=api&key=ip%3D203.0.113.7&reason=false+positive").await;
    assert_eq!(lifted.status, 200, "{}", lifted.text());
    assert_eq!(from(&t, "203.0.113.7").await.status, 200);
    let again = delete_block(&t, "rule=api&key=api%7Cip%3D203.0.113.7").await;
    assert_eq!((again.status.as_u16(), again.json()["error"].as_str()), (404, Some("not_blocked")));
}

#[tokio::test]
async fn a_block_ends_by_itself() {
    let up = Upstream::start().await;
    let t = Tollgate::start(&up, LOGIN).await;
    let body = json!({"rule": "api", "key": "api|ip=203.0.113.7", "for": "2s", "reason": "cool down"});
    assert_eq!(post_block(&t, body).await.status, 200);
    assert_eq!(secs(&from(&t, "203.0.113.7").await, "retry-after"), 2);
    t.advance(Duration::from_secs(2));
    assert_eq!(from(&t, "203.0.113.7").await.status, 200);
}

#[tokio::test]
async fn bad_blocks_get_a_400_and_other_methods_a_405() {
    let up = Upstream::start().await;
    let shadow = "[[rule]]\nname = \"trial\"\nkey = [\"ip\"]\nlimit = 1\nwindow = \"1h\"\nmode = \"shadow\"\n";
    let t = Tollgate::start(&up, &format!("{LOGIN}{shadow}")).await;
    let ok = json!({"rule": "api", "key": "api|ip=1.2.3.4", "for": "1h", "reason": "x"});
    for (change, error, status) in [
        (json!({"rule": "nope"}), "unknown_rule", 400),
        (json!({"for": "soon"}), "bad_block", 400),
        (json!({"for": "0s"}), "bad_block", 400),
        (json!({"for": "400d"}), "bad_block", 400),
        (json!({"reason": " "}), "bad_block", 400),
        (json!({"key": "api|{ip=1}"}), "bad_block", 400),
        (json!({"extra": 1}), "bad_block", 400),
        (json!({"rule": "trial", "key": "trial|ip=1.2.3.4"}), "bad_block", 400),
    ] {
        let mut body = ok.clone();
        for (k, v) in change.as_object().expect("object") {
            body[k] = v.clone();
        }
        let reply = post_block(&t, body.clone()).await;
        assert_eq!((reply.status.as_u16(), reply.json()["error"].as_str()), (status, Some(error)), "{body}");
    }
    assert_eq!(delete_block(&t, "rule=api").await.status, 400, "DELETE needs a key");
    assert_eq!(Call::new("PUT", t.admin_addr, "/blocks").send().await.status, 405);
    assert_eq!(Call::new("POST", t.admin_addr, "/top").send().await.status, 405);
    assert_eq!(from(&t, "1.2.3.4").await.status, 200, "nothing was blocked");
}

fn tollgate_cli(args: Vec<String>) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
        .env_remove("TOLLGATE_LOG_FORMAT")
        .output()
        .expect("the tollgate binary runs")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tollgate_block_and_unblock_on_the_command_line() {
    let up = Upstream::start().await;
    let t = Tollgate::start(&up, LOGIN).await;
    let admin = t.admin_addr.to_string();
    let args = ["block", "--admin", &admin, "--rule", "login", "--key", "login|ip=203.0.113.9", "--for", "90s"];
    let mut block: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    block.extend(["--reason".into(), "INC-2 stuffing".into()]);
    let out = tokio::task::spawn_blocking(move || tollgate_cli(block)).await.expect("ran");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("blocked login|ip=203.0.113.9 for rule login for 90 s"), "{stdout}");
    assert_eq!(secs(&from(&t, "203.0.113.9").await, "retry-after"), 90);

    let unblock: Vec<String> = ["unblock", "--admin", &admin, "--rule", "login", "--key", "login|ip=203.0.113.9"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let again = unblock.clone();
    let out = tokio::task::spawn_blocking(move || tollgate_cli(unblock)).await.expect("ran");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(from(&t, "203.0.113.9").await.status, 200);
    // Nothing left to lift: the tollgate's refusal, exit 1.
    let out = tokio::task::spawn_blocking(move || tollgate_cli(again)).await.expect("ran");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not in the penalty box"), "{out:?}");
}

/// curl with `args` (scripts/test installs it): the status, the response
/// head (`-D -`) and body as text.
async fn curl(args: Vec<String>) -> (u16, String) {
    let out = tokio::task::spawn_blocking(move || {
        Command::new("curl")
            .args(["-sS", "--max-time", "10", "-D", "-", "-o", "-", "-w", "\n%{http_code}"])
            .args(&args)
            .output()
            .expect("curl runs")
    })
    .await
    .expect("curl task");
    assert!(out.status.success(), "curl failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (rest, status) = text.rsplit_once('\n').expect("status line");
    (status.trim().parse().expect("status"), rest.to_string())
}

fn cluster() -> &'static RedisCluster {
    static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
    CLUSTER.get_or_init(RedisCluster::start)
}

async fn pair(up: &Upstream, rules: &str) -> (Tollgate, Tollgate) {
    let config = tollgate_config(up.addr, &cluster().url(), "on_error = \"deny\"");
    let a = Tollgate::with(&config, &[("rules.toml", rules)]).await;
    let b = Tollgate::with(&config, &[("rules.toml", rules)]).await;
    (a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_share_a_penalty_on_a_redis_cluster() {
    support::redis::require();
    let up = Upstream::start().await;
    let rules = LOGIN.replace("\"login\"", "\"shared-login\"").replace("penalty = \"10s\"", "penalty = \"3s\"");
    let (a, b) = pair(&up, &rules).await;
    let ip = "198.51.100.41";
    assert_eq!(from(&a, ip).await.status, 200);
    assert_eq!(from(&a, ip).await.status, 200);
    let refused = from(&a, ip).await;
    assert_eq!((refused.status.as_u16(), secs(&refused, "retry-after")), (429, 3));
    let boxed_at = std::time::Instant::now();
    assert_eq!(penalties(&a.metrics().await, "shared-login"), 1.0);
    // The other instance never saw the key over its limit: the box is in
    // Redis.
    let on_b = from(&b, ip).await;
    assert_eq!(on_b.status, 429, "{}", on_b.text());
    assert!((2..=3).contains(&secs(&on_b, "retry-after")), "{:?}", on_b.headers);
    assert_eq!(penalties(&b.metrics().await, "shared-login"), 0.0, "put in the box by a, not by b");
    // Listed from either instance, through the rule's registry.
    support::eventually("b lists the penalty a gave", || async {
        blocks(&b, "?rule=shared-login").await["blocks"][0]["source"] == "penalty"
    })
    .await;

    // Past the window, within the penalty: still refused, on both.
    tokio::time::sleep(Duration::from_millis(1_500).saturating_sub(boxed_at.elapsed())).await;
    assert_eq!(from(&b, ip).await.status, 429);
    assert_eq!(from(&a, ip).await.status, 429);
    // It ends by itself.
    tokio::time::sleep(Duration::from_millis(3_300).saturating_sub(boxed_at.elapsed())).await;
    support::eventually("the penalty ends", || async { from(&b, ip).await.status == 200 }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_on_one_instance_holds_on_the_other_until_lifted_there() {
    support::redis::require();
    let up = Upstream::start().await;
    let rules = "[[rule]]\nname = \"shared-api\"\nkey = [\"ip\"]\nlimit = 1000\nwindow = \"1h\"\n";
    let (a, b) = pair(&up, rules).await;
    let (ip, key) = ("198.51.100.42", "shared-api|ip=198.51.100.42");
    assert_eq!(from(&b, ip).await.status, 200);
    // Blocked with curl, as an operator would.
    let body = json!({"rule": "shared-api", "key": key, "for": "1h", "reason": "INC-3"}).to_string();
    let url = format!("http://{}/blocks", a.admin_addr);
    let (status, answer) = curl(vec!["-X".into(), "POST".into(), "--data-binary".into(), body, url]).await;
    assert_eq!(status, 200, "{answer}");
    // b may hold a lease on the key from its first request: it spends
    // that (1% of the limit) before it asks Redis again.
    support::eventually("b refuses the key", || async { from(&b, ip).await.status == 429 }).await;
    let refused = from(&b, ip).await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert!((3_599..=3_600).contains(&secs(&refused, "retry-after")), "{:?}", refused.headers);
    let (status, head) =
        curl(vec!["-H".into(), format!("x-forwarded-for: {ip}"), format!("http://{}/", b.proxy_addr)]).await;
    assert_eq!(status, 429);
    assert!(
        head.to_ascii_lowercase().contains("retry-after: 3600")
            || head.to_ascii_lowercase().contains("retry-after: 3599"),
        "{head}"
    );
    assert_eq!(from(&a, ip).await.status, 429);
    let listed = blocks(&b, "?rule=shared-api").await;
    assert_eq!(listed["blocks"][0]["reason"], "INC-3", "{listed}");
    assert_eq!(listed["blocks"][0]["key"], key);

    // Lifted through b: a admits again within a second (its over-limit
    // cache holds a boxed key no longer).
    let lifted = delete_block(&b, &format!("rule=shared-api&key={}", key.replace('|', "%7C"))).await;
    assert_eq!(lifted.status, 200, "{}", lifted.text());
    assert_eq!(from(&b, ip).await.status, 200);
    support::eventually("a sees the lift", || async { from(&a, ip).await.status == 200 }).await;
    assert_eq!(blocks(&a, "?rule=shared-api").await["rules"][0]["total"], 0);

    // A short block ends by itself.
    let body = json!({"rule": "shared-api", "key": key, "for": "2s", "reason": "cool down"});
    assert_eq!(post_block(&b, body).await.status, 200);
    let blocked_at = std::time::Instant::now();
    support::eventually("a refuses the key", || async { from(&a, ip).await.status == 429 }).await;
    tokio::time::sleep(Duration::from_millis(2_100).saturating_sub(blocked_at.elapsed())).await;
    support::eventually("the block ends", || async { from(&a, ip).await.status == 200 }).await;
}

/// Each algorithm keeps its key's box in its own bucket (see
/// src/store/lua/box.lua): a block there refuses on the other instance,
/// is listed with its reason, and lifts with the bucket's counts as they
/// were; a penalty enters the buckets of a log and a token bucket alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_algorithm_keeps_the_box_in_its_bucket_on_a_redis_cluster() {
    support::redis::require();
    let up = Upstream::start().await;
    let algorithms =
        ["token_bucket", "leaky_bucket", "fixed_window", "sliding_window_counter", "sliding_window_log", "concurrency"];
    let mut rules = String::new();
    for alg in algorithms {
        let limits = match alg {
            "concurrency" => "limit = 1\n",
            // A leaky bucket spaces what it admits: a window this long
            // would hold the second request for minutes.
            "leaky_bucket" => "limit = 1000\nwindow = \"1s\"\n",
            _ => "limit = 2\nwindow = \"1d\"\n",
        };
        rules += &format!(
            "[[rule]]\nname = \"box-{alg}\"\nmatch = {{ path = \"/{alg}\" }}\nkey = [\"ip\"]\nalgorithm = \"{alg}\"\n{limits}"
        );
    }
    for alg in ["sliding_window_log", "token_bucket"] {
        rules += &format!(
            "[[rule]]\nname = \"pen-{alg}\"\nmatch = {{ path = \"/pen-{alg}\" }}\nkey = [\"ip\"]\nalgorithm = \"{alg}\"\nlimit = 1\nwindow = \"1s\"\npenalty = \"1h\"\n"
        );
    }
    let config = tollgate_config(up.addr, &cluster().url(), "on_error = \"deny\"\nlease_percent = 0");
    let a = Tollgate::with(&config, &[("rules.toml", &rules)]).await;
    let b = Tollgate::with(&config, &[("rules.toml", &rules)]).await;
    let ip = "198.51.100.43";
    let on = |t: &Tollgate, path: String| t.get(&path).from_ip(ip).send();
    for alg in algorithms {
        let (rule, key) = (format!("box-{alg}"), format!("box-{alg}|ip={ip}"));
        assert_eq!(on(&a, format!("/{alg}")).await.status, 200, "{alg}");
        let body = json!({"rule": rule, "key": key, "for": "1h", "reason": format!("INC-{alg}")});
        let blocked = post_block(&a, body).await;
        assert_eq!(blocked.status, 200, "{alg}: {}", blocked.text());
        let refused = on(&b, format!("/{alg}")).await;
        assert_eq!((refused.status.as_u16(), refused.json()["rule"].as_str()), (429, Some(rule.as_str())), "{alg}");
        // A concurrency refusal says to retry in a second whatever refused
        // it (slots come back as requests end); its reset is the box's.
        let header = if alg == "concurrency" { "x-ratelimit-reset" } else { "retry-after" };
        assert!((3_599..=3_600).contains(&secs(&refused, header)), "{alg}: {:?}", refused.headers);
        let listed = blocks(&b, &format!("?rule={rule}")).await;
        assert_eq!(listed["blocks"][0]["reason"], format!("INC-{alg}"), "{listed}");
        assert_eq!(listed["blocks"][0]["source"], "api", "{listed}");
        let lifted = delete_block(&b, &format!("rule={rule}&key={}", key.replace('|', "%7C"))).await;
        assert_eq!(lifted.status, 200, "{alg}: {}", lifted.text());
        assert_eq!(blocks(&a, &format!("?rule={rule}")).await["rules"][0]["total"], 0, "{alg}");
        assert_eq!(on(&b, format!("/{alg}")).await.status, 200, "{alg}: admitted once lifted");
        if !matches!(alg, "leaky_bucket" | "concurrency") {
            // The request before the block still counts: the third is refused.
            let third = on(&a, format!("/{alg}")).await;
            assert_eq!(third.status, 429, "{alg}: the counts outlived the box");
            assert!(secs(&third, "retry-after") > 60, "{alg}: refused by its window: {:?}", third.headers);
        }
    }
    for alg in ["sliding_window_log", "token_bucket"] {
        let (rule, path) = (format!("pen-{alg}"), format!("/pen-{alg}"));
        assert_eq!(on(&b, path.clone()).await.status, 200, "{alg}");
        let entered = on(&b, path.clone()).await;
        assert_eq!((entered.status.as_u16(), secs(&entered, "retry-after")), (429, 3_600), "{alg}");
        let on_a = on(&a, path.clone()).await;
        assert_eq!(on_a.status, 429, "{alg}");
        assert!((3_599..=3_600).contains(&secs(&on_a, "retry-after")), "{alg}: {:?}", on_a.headers);
        support::eventually("a lists the penalty b gave", || async {
            blocks(&a, &format!("?rule={rule}")).await["blocks"][0]["source"] == "penalty"
        })
        .await;
    }
}
