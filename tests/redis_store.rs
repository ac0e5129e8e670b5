//! The Redis store against one real `redis-server`: every algorithm's
//! windows rolling over and buckets refilling on the server's clock, the
//! multi-rule refund, the over-limit cache, `NOSCRIPT` recovery, key TTLs,
//! `tollgate explain` peeking at live counts, per-key memory, and the same
//! store found through Sentinel.
//!
//! One server is shared by the whole file (started on first use, stopped
//! when the test process exits); every test uses its own key prefix.

use crate::support;

use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use support::redis::{RedisSentinel, RedisServer, tollgate_config};
use support::{Tollgate, Upstream, burst, count, eventually, metric};

fn server() -> &'static RedisServer {
    static SERVER: OnceLock<RedisServer> = OnceLock::new();
    SERVER.get_or_init(RedisServer::start)
}

/// A tollgate on the shared server with `rules`, keys under `prefix`.
async fn tollgate(upstream: &Upstream, prefix: &str, rules: &str) -> Tollgate {
    let config =
        tollgate_config(upstream.addr, &server().url(), &format!("key_prefix = \"{prefix}\"\non_error = \"deny\""));
    Tollgate::with(&config, &[("rules.toml", rules)]).await
}

fn rule(name: &str, algorithm: &str, limit: u64, window: &str, burst: u64) -> String {
    format!(
        "[[rule]]\nname = \"{name}\"\nkey = [\"ip\"]\nalgorithm = \"{algorithm}\"\nlimit = {limit}\nwindow = \"{window}\"\nburst = {burst}\n"
    )
}

async fn status(tg: &Tollgate, ip: &str) -> u16 {
    tg.get("/").from_ip(ip).send().await.status.as_u16()
}

/// Sleeps until just after the next multiple of `window` on the wall clock
/// (the server runs on this machine, so its clock is this one): a test of a
/// fixed window then starts at the beginning of one.
async fn align_to(window: Duration) {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos();
    let w = window.as_nanos();
    let wait = w - now % w + 20_000_000;
    tokio::time::sleep(Duration::from_nanos(wait as u64)).await;
}

#[tokio::test]
async fn fixed_window_rolls_over_at_the_servers_window_boundary() {
    let up = Upstream::start().await;
    let tg = tollgate(&up, "t-fw-roll:", &rule("fw-roll", "fixed_window", 3, "1s", 3)).await;
    align_to(Duration::from_secs(1)).await;
    for _ in 0..3 {
        assert_eq!(status(&tg, "192.0.2.1").await, 200);
    }
    let limited = tg.get("/").from_ip("192.0.2.1").send().await;
    assert_eq!(limited.status, 429);
    assert_eq!(limited.header("retry-after"), Some("1"));
    align_to(Duration::from_secs(1)).await;
    assert_eq!(status(&tg, "192.0.2.1").await, 200, "a new window starts full");
}

#[tokio::test]
async fn token_bucket_refills_at_its_rate() {
    let up = Upstream::start().await;
    // One token a second, 2 at most. The sleep guarantees the first token
    // (it starts after both were spent); the second comes 2 s after the
    // first request: 0.9 s of slack for the requests around the sleep.
    let tg = tollgate(&up, "t-tb-refill:", &rule("tb-refill", "token_bucket", 1, "1s", 2)).await;
    assert_eq!(status(&tg, "192.0.2.2").await, 200);
    assert_eq!(status(&tg, "192.0.2.2").await, 200);
    assert_eq!(status(&tg, "192.0.2.2").await, 429);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(status(&tg, "192.0.2.2").await, 200, "one token refilled");
    assert_eq!(status(&tg, "192.0.2.2").await, 429, "and only one");
}

#[tokio::test]
async fn sliding_window_log_frees_the_oldest_request_first() {
    let up = Upstream::start().await;
    let tg = tollgate(&up, "t-swl-slide:", &rule("swl-slide", "sliding_window_log", 3, "2s", 3)).await;
    assert_eq!(status(&tg, "192.0.2.3").await, 200);
    // Admitted before its answer arrived.
    let first = Instant::now();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(status(&tg, "192.0.2.3").await, 200);
    assert_eq!(status(&tg, "192.0.2.3").await, 200);
    assert_eq!(status(&tg, "192.0.2.3").await, 429);
    // The first request leaves the window 2 s after it was admitted; the
    // other two 1 s later: the checks below have most of that second.
    tokio::time::sleep(Duration::from_millis(2050).saturating_sub(first.elapsed())).await;
    assert_eq!(status(&tg, "192.0.2.3").await, 200, "the oldest entry slid out");
    assert_eq!(status(&tg, "192.0.2.3").await, 429, "the other two are still in the window");
}

#[tokio::test]
async fn sliding_window_counter_weights_the_previous_window() {
    let up = Upstream::start().await;
    let tg = tollgate(&up, "t-swc-slide:", &rule("swc-slide", "sliding_window_counter", 2, "2s", 2)).await;
    align_to(Duration::from_secs(2)).await;
    for _ in 0..2 {
        assert_eq!(status(&tg, "192.0.2.4").await, 200);
    }
    assert_eq!(status(&tg, "192.0.2.4").await, 429);
    // In the next window the previous one weighs 2 * (1 - t / 2 s): no room
    // for one more until t = 1 s (the check below has about a second), room
    // for one from then, for a second only in the window after (at 2 s: the
    // check after the sleep has almost a second too).
    align_to(Duration::from_secs(2)).await;
    assert_eq!(status(&tg, "192.0.2.4").await, 429);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(status(&tg, "192.0.2.4").await, 200);
    assert_eq!(status(&tg, "192.0.2.4").await, 429);
}

#[tokio::test]
async fn leaky_bucket_spaces_the_requests_it_admits() {
    let up = Upstream::start().await;
    // Drains 2 per second: one request every 500 ms, 4 queued at most (the
    // burst's six requests have 500 ms to arrive before a fifth fits).
    let tg = tollgate(&up, "t-lb-space:", &rule("lb-space", "leaky_bucket", 2, "1s", 4)).await;
    let started = Instant::now();
    let replies = burst(6, |_| tg.get("/").from_ip("192.0.2.5")).await;
    let elapsed = started.elapsed();
    assert_eq!(count(&replies, 200), 4);
    assert_eq!(count(&replies, 429), 2);
    // The fourth admitted request waited for three ahead of it.
    assert!(elapsed >= Duration::from_millis(1450), "took {elapsed:?}");
}

#[tokio::test]
async fn a_request_one_rule_rejects_gives_back_what_the_others_counted() {
    let up = Upstream::start().await;
    let rules = format!(
        "{}\n{}",
        rule("refund-wide", "fixed_window", 100, "1h", 100),
        "[[rule]]\nname = \"refund-narrow\"\nkey = [\"ip\", \"path\"]\nalgorithm = \"token_bucket\"\nlimit = 2\nwindow = \"1m\"\n"
    );
    let tg = tollgate(&up, "t-refund:", &rules).await;
    let statuses: Vec<u16> = {
        let mut s = Vec::new();
        for _ in 0..6 {
            s.push(status(&tg, "192.0.2.6").await);
        }
        s
    };
    assert_eq!(statuses, [200, 200, 429, 429, 429, 429]);
    // The wide rule counted the two admitted requests only: the four
    // rejected ones were refunded (in the background, right after).
    let key = "t-refund:{refund-wide|ip=192.0.2.6}:fw2";
    eventually("the refunds land", || async { server().cli(&support::redis::window(key)).trim().ends_with(":2") })
        .await;
}

#[tokio::test]
async fn the_over_limit_cache_answers_a_flood_without_asking_redis() {
    let up = Upstream::start().await;
    let tg = tollgate(&up, "t-cache:", &rule("cache", "fixed_window", 2, "1h", 2)).await;
    let calls_before = evalsha_calls();
    let statuses = support::statuses(30, || tg.get("/").from_ip("192.0.2.7")).await;
    assert_eq!(statuses, support::expect_statuses(2, 200, 28, 429));
    let hits = metric(&tg.metrics().await, "tollgate_local_cache_hits_total", &[]).unwrap_or(0.0);
    assert_eq!(hits, 27.0, "every rejection after the first comes from the cache");
    // Other tests share the server, so only bound what this one added.
    let calls = evalsha_calls() - calls_before;
    assert!(calls >= 3, "{calls}");
    let limited = tg.get("/").from_ip("192.0.2.7").send().await;
    assert_eq!(limited.status, 429);
    assert!(limited.header("retry-after").is_some_and(|s| s.parse::<u64>().is_ok_and(|s| (1..=3_600).contains(&s))));
}

#[tokio::test]
async fn once_the_last_unit_is_admitted_a_concurrent_flood_sends_one_probe_to_redis() {
    let up = Upstream::start().await;
    let tg = tollgate(&up, "t-probe:", &rule("probe", "fixed_window", 3, "1h", 3)).await;
    let statuses = support::statuses(3, || tg.get("/").from_ip("192.0.2.8")).await;
    assert_eq!(statuses, [200, 200, 200]);
    // The third admission left nothing: of 100 requests at once, one asks
    // Redis and the others are answered here, instead of all 100 asking.
    let replies = burst(100, |_| tg.get("/").from_ip("192.0.2.8")).await;
    assert_eq!(count(&replies, 429), 100);
    let hits = metric(&tg.metrics().await, "tollgate_local_cache_hits_total", &[]).unwrap_or(0.0);
    assert_eq!(hits, 99.0);
}

fn evalsha_calls() -> u64 {
    calls_of(server(), &["fcall", "evalsha"])
}

/// How many times `server` ran the `commands` (lower case), summed.
fn calls_of(server: &RedisServer, commands: &[&str]) -> u64 {
    let stats = server.cli(&["INFO", "commandstats"]);
    commands
        .iter()
        .filter_map(|c| {
            stats
                .lines()
                .find(|l| l.starts_with(&format!("cmdstat_{c}:")))
                .and_then(|l| l.split("calls=").nth(1))
                .and_then(|s| s.split(',').next())
                .and_then(|n| n.parse::<u64>().ok())
        })
        .sum()
}

/// A check whose request was refused because Redis did not answer in time
/// never runs once Redis is back: the refused request counts nowhere. fred
/// holds commands while it reconnects and writes them after, unless the
/// command was marked timed out; a fred `Pipeline` is not marked (an
/// earlier, unlanded change sent checks that way, and this test failed on
/// it: the key existed once Redis came back).
#[tokio::test]
async fn a_check_for_a_request_refused_on_timeout_never_runs_later() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let store = "key_prefix = \"t-late:\"\non_error = \"deny\"\ntimeout = \"200ms\"\nlease_percent = 0";
    // An hour's window: whatever is written stays until the test reads it.
    let tg = Tollgate::with(
        &tollgate_config(up.addr, &redis.url(), store),
        &[("rules.toml", &rule("late", "token_bucket", 100, "1h", 100))],
    )
    .await;
    let ip = "192.0.2.70";
    let key = format!("t-late:{{late|ip={ip}}}:tb2");
    redis.kill();
    assert_eq!(status(&tg, ip).await, 503, "refused: Redis did not answer within the timeout");
    redis.restart();
    eventually("tollgate to reach redis again", || async { tg.admin("/healthz/store").await.status.as_u16() == 200 })
        .await;
    // Time for a check fred still held to reach the server.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(redis.cli(&["EXISTS", &key]).trim(), "0", "the refused request was counted");
    let next = tg.get("/").from_ip(ip).send().await;
    assert_eq!(next.status, 200);
    assert_eq!(next.header("x-ratelimit-remaining"), Some("99"));
}

#[tokio::test]
async fn checks_recover_from_a_flushed_script_cache() {
    let up = Upstream::start().await;
    let tg = tollgate(&up, "t-noscript:", &rule("noscript", "token_bucket", 100, "1s", 100)).await;
    assert_eq!(status(&tg, "192.0.2.8").await, 200);
    assert!(server().cli(&["FUNCTION", "LIST"]).contains("tollgate_"), "checks run as functions");
    // What a node restarted without persistence looks like: no functions,
    // no scripts.
    assert_eq!(server().cli(&["FUNCTION", "FLUSH"]).trim(), "OK");
    assert_eq!(server().cli(&["SCRIPT", "FLUSH"]).trim(), "OK");
    for _ in 0..3 {
        assert_eq!(status(&tg, "192.0.2.8").await, 200, "the functions are loaded again");
    }
    assert!(server().cli(&["FUNCTION", "LIST"]).contains("tollgate_"));
    let errors = metric(&tg.metrics().await, "tollgate_store_errors_total", &[("backend", "redis")]).unwrap_or(0.0);
    assert_eq!(errors, 0.0);
}

/// Before Redis 7 there are no functions (`FCALL` renamed away here to
/// stand for such a server): checks go as scripts, exact all the same.
#[tokio::test]
async fn a_server_without_functions_runs_the_checks_as_scripts() {
    let redis = RedisServer::start_with(&["--rename-command", "FCALL", ""]);
    let up = Upstream::start().await;
    let config = tollgate_config(up.addr, &redis.url(), "key_prefix = \"t-nofn:\"\non_error = \"deny\"");
    let tg = Tollgate::with(&config, &[("rules.toml", &rule("nofn", "token_bucket", 3, "1h", 3))]).await;
    let mut statuses = Vec::new();
    for _ in 0..5 {
        statuses.push(status(&tg, "192.0.2.11").await);
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    assert!(calls_of(&redis, &["evalsha", "eval"]) >= 2, "{}", redis.cli(&["INFO", "commandstats"]));
    let errors = metric(&tg.metrics().await, "tollgate_store_errors_total", &[("backend", "redis")]).unwrap_or(0.0);
    assert_eq!(errors, 0.0, "the call that found no FCALL went on as a script");
}

#[tokio::test]
async fn every_key_expires_once_it_is_equivalent_to_a_fresh_one() {
    let up = Upstream::start().await;
    let algorithms = ["token_bucket", "leaky_bucket", "fixed_window", "sliding_window_log", "sliding_window_counter"];
    // Windows long enough that a slow test run still finds every key (a
    // bucket's key of 1 s could be gone before it is read).
    let rules: String = algorithms.iter().map(|a| rule(&format!("ttl-{a}"), a, 10, "100s", 10)).collect();
    let tg = tollgate(&up, "t-ttl:", &rules).await;
    assert_eq!(status(&tg, "192.0.2.9").await, 200);
    for (alg, suffix, most_ms) in [
        // One token of ten refills in 10 s.
        ("token_bucket", "tb2", 10_002),
        ("leaky_bucket", "lb2", 10_002),
        // Until the window ends.
        ("fixed_window", "fw2", 100_000),
        // Until the request leaves the window.
        ("sliding_window_log", "swlw", 100_000),
        // Until both windows holding it have slid out.
        ("sliding_window_counter", "swc2", 200_000),
    ] {
        let key = format!("t-ttl:{{ttl-{alg}|ip=192.0.2.9}}:{suffix}");
        let ttl: i64 = server().cli(&["PTTL", &key]).trim().parse().unwrap_or(-3);
        assert!(ttl > 0 && ttl <= most_ms, "{key}: PTTL {ttl} ms, expected at most {most_ms}");
    }
}

#[tokio::test]
async fn explain_shows_the_shared_count_without_consuming() {
    let up = Upstream::start().await;
    let tg = tollgate(&up, "t-explain:", &rule("explain", "fixed_window", 5, "1h", 5)).await;
    for _ in 0..2 {
        assert_eq!(status(&tg, "192.0.2.10").await, 200);
    }
    let explain = || {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["explain", "--config"])
            .arg(tg.dir.path().join("tollgate.toml"))
            .args(["--path", "/", "--ip", "192.0.2.10"])
            .output()
            .expect("run tollgate explain");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let first = explain();
    assert!(first.contains("remaining after this request: 2 of 5 (redis"), "{first}");
    assert_eq!(explain(), first, "explain does not consume");
    assert_eq!(status(&tg, "192.0.2.10").await, 200, "the third request is still admitted");
}

/// Not an assertion of behaviour so much as a measurement: the per-key
/// memory of each algorithm, which `docs/redis.md` reports. Run with
/// `--nocapture` to see the table.
#[tokio::test]
async fn per_key_memory_stays_small() {
    let up = Upstream::start().await;
    let algorithms = ["token_bucket", "leaky_bucket", "fixed_window", "sliding_window_counter", "sliding_window_log"];
    // One path per algorithm: the leaky bucket would otherwise hold the
    // log's burst back (it drains one request per 1.8 s here).
    let rules: String = algorithms
        .iter()
        .map(|a| {
            let r = rule(&format!("mem-{a}"), a, 2_000, "1h", 2_000);
            format!("{r}match = {{ path = \"/{a}\" }}\n")
        })
        .collect();
    let tg = tollgate(&up, "tollgate:", &rules).await;
    let usage = |key: &str| -> u64 { server().cli(&["MEMORY", "USAGE", key]).trim().parse().unwrap_or(0) };
    let ip = "203.0.113.7";
    for alg in algorithms {
        // A second request turns the buckets' levels into fractions.
        for _ in 0..2 {
            assert_eq!(tg.get(&format!("/{alg}")).from_ip(ip).send().await.status, 200);
        }
    }
    for (alg, suffix) in
        [("token_bucket", "tb2"), ("leaky_bucket", "lb2"), ("fixed_window", "fw2"), ("sliding_window_counter", "swc2")]
    {
        let key = format!("tollgate:{{mem-{alg}|ip={ip}}}:{suffix}");
        let bytes = usage(&key);
        println!("MEMORY USAGE {alg:<24} {bytes:>6} B  ({key}, {} B of key name)", key.len());
        assert!((50..=200).contains(&bytes), "{key}: {bytes} B");
    }
    let log_key = format!("tollgate:{{mem-sliding_window_log|ip={ip}}}:swlw");
    let mut sent = 2;
    for n in [2usize, 100, 1_000] {
        let more = n - sent;
        for chunk in 0..more.div_ceil(50) {
            let k = 50.min(more - chunk * 50);
            let replies = burst(k, |_| tg.get("/sliding_window_log").from_ip(ip)).await;
            assert_eq!(count(&replies, 200), k);
        }
        sent = n;
        let bytes = usage(&log_key);
        println!("MEMORY USAGE sliding_window_log at {n:>5} entries: {bytes:>7} B ({} B per entry)", bytes / n as u64);
        assert!(bytes / (n as u64) < 200, "{bytes} B for {n} entries");
    }
}

#[tokio::test]
async fn the_master_is_found_through_sentinel() {
    let sentinel = tokio::task::spawn_blocking(RedisSentinel::start).await.expect("sentinel");
    let up = Upstream::start().await;
    let config = tollgate_config(up.addr, &sentinel.url(), "on_error = \"deny\"");
    let tg = Tollgate::with(&config, &[("rules.toml", &rule("sentinel", "fixed_window", 2, "1h", 2))]).await;
    assert_eq!(tg.admin("/readyz").await.status, 200);
    let statuses = support::statuses(3, || tg.get("/").from_ip("192.0.2.11")).await;
    assert_eq!(statuses, [200, 200, 429]);
    let key = "tollgate:{sentinel|ip=192.0.2.11}:fw2";
    assert!(
        support::redis::cli(sentinel.master, &support::redis::window(key)).trim().ends_with(":2"),
        "counted on the master"
    );
}

#[tokio::test]
async fn a_costly_request_is_one_log_entry_and_the_limit_still_holds() {
    let up = Upstream::start().await;
    let rules = format!("{}cost_header = \"x-cost\"\n", rule("swl-cost", "sliding_window_log", 100, "1m", 100));
    let tg = tollgate(&up, "t-swl-cost:", &rules).await;
    let send = |cost: &str| tg.get("/").from_ip("192.0.2.12").header("x-cost", cost).send();
    assert_eq!(send("60").await.status, 200);
    // Entries are scored by time (>= 0); a cost of 60 is one of them.
    let key = "t-swl-cost:{swl-cost|ip=192.0.2.12}:swlw";
    let entries = || server().cli(&["ZCOUNT", key, "0", "+inf"]).trim().to_string();
    assert_eq!(entries(), "1", "one member for a request of cost 60");
    assert_eq!(send("40").await.status, 200);
    let limited = send("1").await;
    assert_eq!(limited.status, 429, "60 + 40 used all 100");
    assert_eq!(entries(), "2");
}

#[tokio::test]
async fn api_keys_never_appear_in_redis_key_names() {
    let up = Upstream::start().await;
    let rules =
        "[[rule]]\nname = \"per-key\"\nkey = [\"api_key\"]\nalgorithm = \"fixed_window\"\nlimit = 2\nwindow = \"1h\"\n";
    let tg = tollgate(&up, "t-secret:", rules).await;
    let secret = "sk-live-2b8e4d6f0a";
    let statuses = support::statuses(3, || tg.get("/").header("x-api-key", secret)).await;
    assert_eq!(statuses, [200, 200, 429], "still one bucket per key");
    let keys = server().cli(&["--scan", "--pattern", "t-secret:*"]);
    assert!(!keys.trim().is_empty(), "the bucket exists");
    assert!(!keys.contains(secret), "the API key is in a Redis key name: {keys}");
    // Another key is another bucket.
    assert_eq!(tg.get("/").header("x-api-key", "sk-live-other").send().await.status, 200);
}
