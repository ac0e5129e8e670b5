//! `/top` and `tollgate top`: the heaviest keys of each rule over the last
//! 30 to 60 seconds, by requests or by limited requests, with API keys
//! shown only hashed; on the memory store and on a real Redis Cluster;
//! 400s for bad questions; nothing counted with `[admin] top_keys = 0`.

use crate::support;

use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use support::redis::{RedisCluster, tollgate_config};
use support::{Tollgate, Upstream, config, metric};

/// Two API keys an hour: the keys below end over it at different rates.
const PER_KEY: &str = r#"
[[rule]]
name = "per-key"
key = ["api_key"]
limit = 2
window = "1h"

[[rule]]
name = "per-ip"
key = ["ip"]
limit = 1000
window = "1h"
"#;

/// Three clients with API keys: `heavy` sends 10 requests, `medium` 4 and
/// `light` 1, all from one address.
const TRAFFIC: [(&str, usize); 3] = [("sk-live-heavy-secret", 10), ("sk-live-medium-secret", 4), ("sk-live-light", 1)];

async fn send_traffic(t: &Tollgate) {
    for (key, n) in TRAFFIC {
        for _ in 0..n {
            let status = t.get("/").header("x-api-key", key).from_ip("203.0.113.9").send().await.status;
            assert!(status == 200 || status == 429, "{status}");
        }
    }
}

fn sha256_hex(s: &str) -> String {
    // The same digest the rules use, from the test's side: via `explain`'s
    // own code path would prove nothing, so ask sha256sum.
    let out = Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child.stdin.take().expect("stdin").write_all(s.as_bytes())?;
            child.wait_with_output()
        })
        .expect("sha256sum runs");
    String::from_utf8_lossy(&out.stdout).split_whitespace().next().expect("a digest").to_string()
}

/// The (key, count, error) rows of a `/top` answer.
fn rows(top: &Value) -> Vec<(String, u64, u64)> {
    top["keys"]
        .as_array()
        .expect("keys")
        .iter()
        .map(|k| {
            let s = k["key"].as_str().expect("key").to_string();
            (s, k["count"].as_u64().expect("count"), k["error"].as_u64().expect("error"))
        })
        .collect()
}

fn key_of(api_key: &str) -> String {
    format!("per-key|api_key=sha256:{}", sha256_hex(api_key))
}

async fn top(t: &Tollgate, query: &str) -> Value {
    let reply = t.admin(&format!("/top{query}")).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply.json()
}

/// What both stores must show for [`TRAFFIC`] under [`PER_KEY`].
async fn shows_the_heaviest_keys_hashed(t: &Tollgate) {
    let (heavy, medium, light) = (key_of(TRAFFIC[0].0), key_of(TRAFFIC[1].0), key_of(TRAFFIC[2].0));
    let by_requests = top(t, "?rule=per-key&by=requests").await;
    assert_eq!(by_requests["rule"], "per-key");
    assert_eq!(by_requests["total"], 15);
    assert_eq!(rows(&by_requests), [(heavy.clone(), 10, 0), (medium.clone(), 4, 0), (light, 1, 0)]);
    let by_limited = top(t, "?rule=per-key&by=limited&n=20").await;
    assert_eq!(by_limited["total"], 10);
    assert_eq!(rows(&by_limited), [(heavy.clone(), 8, 0), (medium, 2, 0)]);
    // `limited` is the default, and `n` cuts the list.
    assert_eq!(rows(&top(t, "?rule=per-key&n=1").await), [(heavy, 8, 0)]);
    // The other rule saw every request under one key and limited none.
    let per_ip = top(t, "?rule=per-ip&by=requests").await;
    assert_eq!(rows(&per_ip), [("per-ip|ip=203.0.113.9".to_string(), 15, 0)]);
    assert!(rows(&top(t, "?rule=per-ip").await).is_empty());
    // No API key in clear, anywhere.
    let everything = t.admin("/top?by=requests").await;
    for (secret, _) in TRAFFIC {
        assert!(!everything.text().contains(secret), "{secret} in clear: {}", everything.text());
    }
    let all = everything.json();
    let names: Vec<&str> =
        all["rules"].as_array().expect("rules").iter().map(|r| r["rule"].as_str().unwrap_or("")).collect();
    assert_eq!(names, ["per-key", "per-ip"]);
}

#[tokio::test]
async fn memory_store_ranks_keys_by_requests_and_by_limited() {
    let up = Upstream::start().await;
    let t = Tollgate::start(&up, PER_KEY).await;
    send_traffic(&t).await;
    shows_the_heaviest_keys_hashed(&t).await;
}

#[tokio::test]
async fn redis_cluster_store_ranks_keys_by_requests_and_by_limited() {
    support::redis::require();
    let cluster = RedisCluster::start();
    let up = Upstream::start().await;
    // No leases: every check is a script call on the cluster.
    let config = tollgate_config(up.addr, &cluster.url(), "on_error = \"deny\"\nlease_percent = 0");
    let t = Tollgate::with(&config, &[("rules.toml", PER_KEY)]).await;
    send_traffic(&t).await;
    let calls = metric(&t.metrics().await, "tollgate_redis_calls_total", &[]).unwrap_or(0.0);
    // Some 429s may come from the local cache of keys over their limit.
    assert!(calls >= 10.0, "the requests were decided in Redis: {calls} calls");
    shows_the_heaviest_keys_hashed(&t).await;
}

#[tokio::test]
async fn the_window_is_the_last_thirty_to_sixty_seconds() {
    let up = Upstream::start().await;
    let t = Tollgate::start(&up, PER_KEY).await;
    // The test clock stands at the start of a period.
    send_traffic(&t).await;
    t.advance(Duration::from_secs(45));
    let report = top(&t, "?rule=per-key&by=requests").await;
    assert_eq!(report["window_seconds"], 45);
    assert_eq!(report["total"], 15);
    // Requests in the new period count in it once the server's tick has
    // seen the clock move...
    let period = t.proxy.top().expect("on").period_now();
    support::eventually("the period turns", || async { t.proxy.top().expect("on").period_now() == period + 1 }).await;
    t.get("/").header("x-api-key", "sk-late").from_ip("203.0.113.9").send().await;
    // ...so they outlive the earlier ones.
    t.advance(Duration::from_secs(20));
    let report = top(&t, "?rule=per-key&by=requests").await;
    assert_eq!((report["window_seconds"].as_u64(), report["total"].as_u64()), (Some(35), Some(1)));
    assert_eq!(rows(&report), [(key_of("sk-late"), 1, 0)]);
}

#[tokio::test]
async fn bad_questions_get_a_400_with_a_json_error() {
    let up = Upstream::start().await;
    let t = Tollgate::start(&up, PER_KEY).await;
    for (query, error) in [
        ("?rule=nope", "unknown_rule"),
        ("?rule=per-key&n=0", "bad_n"),
        ("?rule=per-key&n=65", "bad_n"),
        ("?rule=per-key&n=ten", "bad_n"),
        ("?rule=per-key&by=bytes", "bad_by"),
    ] {
        let reply = t.admin(&format!("/top{query}")).await;
        assert_eq!(reply.status, 400, "{query}: {}", reply.text());
        assert_eq!(reply.json()["error"], error, "{query}");
        assert!(reply.json()["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
    let reply = t.admin("/top?rule=per-key&n=65").await;
    assert!(reply.text().contains("from 1 to 64"), "{}", reply.text());
    // The largest n is the configured capacity.
    assert_eq!(top(&t, "?rule=per-key&n=64").await["capacity"], 64);
}

#[tokio::test]
async fn top_keys_zero_counts_nothing_and_turns_top_off() {
    let up = Upstream::start().await;
    let config = format!("{}\n[admin]\ntop_keys = 0\n", config(up.addr));
    let t = Tollgate::with(&config, &[("rules.toml", PER_KEY)]).await;
    send_traffic(&t).await;
    assert!(t.proxy.top().is_none());
    assert!(t.proxy.rules().load().rules.iter().all(|r| r.top.is_none()), "no rule has a sketch");
    let reply = t.admin("/top?rule=per-key").await;
    assert_eq!(reply.status, 404, "{}", reply.text());
    assert_eq!(reply.json()["error"], "top_off");
}

#[tokio::test]
async fn counts_survive_a_reload_of_the_rules() {
    let up = Upstream::start().await;
    let t = Tollgate::start(&up, PER_KEY).await;
    send_traffic(&t).await;
    let raised = PER_KEY.replace("limit = 2\n", "limit = 3\n");
    support::write_atomic(&t.rules_dir().join("rules.toml"), &raised);
    t.reloader.reload().expect("the new rules load");
    assert_eq!(t.rules().await["rules"][0]["limit"], 3);
    assert_eq!(top(&t, "?rule=per-key&by=requests").await["total"], 15);
}

/// `tollgate top` (the real binary) against a running tollgate.
fn tollgate_top(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("top")
        .args(args)
        .env_remove("TOLLGATE_LOG_FORMAT")
        .output()
        .expect("the tollgate binary runs")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_prints_a_table_per_refresh_without_escape_codes_off_a_terminal() {
    let up = Upstream::start().await;
    let t = Tollgate::start(&up, PER_KEY).await;
    send_traffic(&t).await;
    let admin = t.admin_addr.to_string();
    let out = tokio::task::spawn_blocking(move || tollgate_top(&["--admin", &admin, "--count", "2"]))
        .await
        .expect("the CLI ran");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(!stdout.contains('\x1b'), "escape codes off a terminal: {stdout:?}");
    assert_eq!(stdout.matches("tollgate top  ").count(), 2, "{stdout}");
    assert!(stdout.contains("by limited"), "{stdout}");
    assert!(stdout.contains("rule per-key: 10 limited"), "{stdout}");
    let heavy = stdout.lines().find(|l| l.contains(&key_of(TRAFFIC[0].0))).expect("the heaviest key's line");
    assert_eq!(heavy.split_whitespace().take(2).collect::<Vec<_>>(), ["8", "0"], "{heavy}");
    // Heaviest first.
    let at = |k: &str| stdout.find(&key_of(k)).expect("key shown");
    assert!(at(TRAFFIC[0].0) < at(TRAFFIC[1].0), "{stdout}");
    assert!(!stdout.contains("sk-live"), "an API key in clear: {stdout}");

    // One rule, by requests.
    let admin = t.admin_addr.to_string();
    let out = tokio::task::spawn_blocking(move || {
        tollgate_top(&["--admin", &admin, "--rule", "per-ip", "--by", "requests", "--count", "1"])
    })
    .await
    .expect("the CLI ran");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("rule per-ip: 15 requests"), "{stdout}");
    assert!(!stdout.contains("per-key"), "{stdout}");

    // A question the tollgate refuses, and a tollgate that is not there.
    let admin = t.admin_addr.to_string();
    let out = tokio::task::spawn_blocking(move || tollgate_top(&["--admin", &admin, "--rule", "nope", "--count", "1"]))
        .await
        .expect("the CLI ran");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("No rule named \"nope\""), "{out:?}");
    let closed = Upstream::refusing_addr().await.to_string();
    let out = tokio::task::spawn_blocking(move || tollgate_top(&["--admin", &closed, "--count", "1"]))
        .await
        .expect("the CLI ran");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach the tollgate admin listener"), "{out:?}");
}
