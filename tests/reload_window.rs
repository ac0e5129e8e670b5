//! A reload that changes a rule's `window` keeps each key's counts, on the
//! memory store as on Redis: the state is read with the new window from
//! then on (see "Counters" in the README), never started afresh.

use crate::support;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use support::redis::{RedisServer, tollgate_config};
use support::{Tollgate, Upstream, eventually, statuses, write_atomic};

fn rule(algorithm: &str, window: &str) -> String {
    format!("[[rule]]\nname = \"r\"\nalgorithm = \"{algorithm}\"\nlimit = 5\nwindow = \"{window}\"\n")
}

async fn reload(tg: &Tollgate, algorithm: &str, window: &str, seconds: f64) {
    write_atomic(&tg.rules_dir().join("rules.toml"), &rule(algorithm, window));
    eventually(&format!("window {window} in force"), || async {
        let rules: Value = tg.rules().await;
        rules["rules"][0]["window_seconds"].as_f64() == Some(seconds)
    })
    .await;
}

fn wall() -> Duration {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default()
}

/// Sleeps until `offset` past the start of the next `period` of the wall
/// clock (the Redis server runs on this machine: its windows are these).
async fn at_offset(period: Duration, offset: Duration) {
    let (now, p) = (wall().as_nanos(), period.as_nanos());
    let mut target = now - now % p + offset.as_nanos();
    if target <= now {
        target += p;
    }
    tokio::time::sleep(Duration::from_nanos((target - now) as u64)).await;
}

/// The case: 5 of 5 spent, then `window = "2m"`. The memory store
/// used to start every key of the rule afresh (200, 4 remaining) while
/// Redis kept the counts (429).
#[tokio::test]
async fn a_changed_window_keeps_the_counts_in_memory() {
    let up = Upstream::start().await;
    for algorithm in ["fixed_window", "sliding_window_counter", "sliding_window_log", "token_bucket"] {
        let tg = Tollgate::start(&up, &rule(algorithm, "1m")).await;
        assert_eq!(statuses(6, || tg.get("/")).await, [200, 200, 200, 200, 200, 429], "{algorithm}");
        reload(&tg, algorithm, "2m", 120.0).await;
        let r = tg.get("/").send().await;
        assert_eq!(r.status, 429, "{algorithm} started afresh: {r:?}");
        tg.stop().await;
    }
}

#[tokio::test]
async fn a_changed_window_keeps_the_counts_on_redis() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    for algorithm in ["fixed_window", "sliding_window_counter", "sliding_window_log", "token_bucket"] {
        let cfg = tollgate_config(up.addr, &redis.url(), "on_error = \"deny\"\nlease_percent = 0");
        let cfg = cfg.replace("timeout = \"500ms\"", &format!("timeout = \"500ms\"\nkey_prefix = \"{algorithm}:\""));
        let tg = Tollgate::with(&cfg, &[("rules.toml", &rule(algorithm, "1m"))]).await;
        // Not within the last seconds of a minute: all of it in one window.
        if wall().as_secs() % 60 > 50 {
            at_offset(Duration::from_secs(60), Duration::from_millis(100)).await;
        }
        assert_eq!(statuses(6, || tg.get("/")).await, [200, 200, 200, 200, 200, 429], "{algorithm}");
        reload(&tg, algorithm, "2m", 120.0).await;
        let r = tg.get("/").send().await;
        assert_eq!(r.status, 429, "{algorithm} started afresh: {r:?}");
        tg.stop().await;
    }
}

/// A sliding counter counted in the second minute of what becomes a
/// two-minute window: its window start (a whole minute) is none of the new
/// length's. Its counts used to be kept until the next two-minute window
/// began and then forgotten at once (neither its current nor its previous
/// window), so the 5 spent a moment before did not weigh at all.
#[tokio::test]
async fn a_sliding_counter_keeps_weighing_across_a_longer_window_in_memory() {
    let up = Upstream::start().await;
    let tg = Tollgate::start(&up, &rule("sliding_window_counter", "1m")).await;
    // T0 starts a two-minute window: count in its second minute.
    tg.advance(Duration::from_secs(60));
    assert_eq!(statuses(6, || tg.get("/")).await, [200, 200, 200, 200, 200, 429]);
    reload(&tg, "sliding_window_counter", "2m", 120.0).await;
    assert_eq!(tg.get("/").send().await.status, 429);
    // The next two-minute window: the 5 came at most a minute ago.
    tg.advance(Duration::from_secs(60));
    let r = tg.get("/").send().await;
    assert_eq!(r.status, 429, "the counts were forgotten at the window boundary: {r:?}");
    // Slid out once two whole windows have passed.
    tg.advance(Duration::from_secs(120));
    assert_eq!(tg.get("/").send().await.status, 200);
}

/// The same on Redis, with windows of 3 s made 6 s: counted in the second
/// half of a 6 s window, then asked 100 ms into the next.
#[tokio::test]
async fn a_sliding_counter_keeps_weighing_across_a_longer_window_on_redis() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    let cfg = tollgate_config(up.addr, &redis.url(), "on_error = \"deny\"\nlease_percent = 0");
    let tg = Tollgate::with(&cfg, &[("rules.toml", &rule("sliding_window_counter", "3s"))]).await;
    let six = Duration::from_secs(6);
    at_offset(six, Duration::from_millis(3_020)).await;
    let counted_in = wall().as_secs() / 6;
    assert_eq!(statuses(6, || tg.get("/")).await, [200, 200, 200, 200, 200, 429]);
    reload(&tg, "sliding_window_counter", "6s", 6.0).await;
    // (Not asked now: a refusal would be kept by the over-limit cache past
    // the boundary, and Redis not asked there.)
    assert_eq!(wall().as_secs() / 6, counted_in, "the reload took past the window: too slow to tell");
    at_offset(six, Duration::from_millis(100)).await;
    let r = tg.get("/").send().await;
    assert_eq!(r.status, 429, "the counts were forgotten at the window boundary: {r:?}");
}
