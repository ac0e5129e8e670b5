//! Calendar quotas end to end: `calendar = "day" | "week" | "month"` with a
//! `timezone`. On the memory store, the injected clock stands just before a
//! boundary (a DST change in Berlin, the end of a leap February) and the 429's
//! `Retry-After` must land exactly on it; on a real Redis Cluster, where the
//! server's clock counts, two instances share the month's quota and the
//! `Retry-After` lands on the next first of the month in Berlin, computed
//! here with the time-zone database on the real clock.

use crate::support;

use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use http::StatusCode;
use jiff::tz::TimeZone;
use jiff::{Span, Timestamp};
use support::redis::{RedisCluster, tollgate_config};
use support::{Tollgate, Upstream, metric};

const QUOTA_EXCEEDED: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";

fn cluster() -> &'static RedisCluster {
    static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
    CLUSTER.get_or_init(RedisCluster::start)
}

fn at(text: &str) -> u64 {
    let ts: Timestamp = text.parse().expect("timestamp");
    ts.as_nanosecond() as u64
}

fn rule(name: &str, limit: u64, calendar: &str, timezone: Option<&str>) -> String {
    let tz = timezone.map(|z| format!("timezone = \"{z}\"\n")).unwrap_or_default();
    format!("[[rule]]\nname = \"{name}\"\nkey = [\"ip\"]\nlimit = {limit}\ncalendar = \"{calendar}\"\n{tz}")
}

fn secs(reply: &support::Reply, header: &str) -> u64 {
    reply.header(header).unwrap_or_else(|| panic!("{header} missing")).parse().expect("whole seconds")
}

#[tokio::test]
async fn a_berlin_day_that_lasts_23_hours_ends_at_local_midnight() {
    let up = Upstream::start().await;
    let tg = Tollgate::start(&up, &rule("daily", 3, "day", Some("Europe/Berlin"))).await;
    // 2026-03-29 23:59:00 CEST: the day the clocks went forward, 23 hours
    // long, ends in one minute.
    tg.clock.set(at("2026-03-29T21:59:00Z"));
    let ip = "198.51.100.7";
    for left in [2, 1, 0] {
        let r = tg.get("/").from_ip(ip).send().await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(secs(&r, "x-ratelimit-remaining"), left);
        assert_eq!(secs(&r, "x-ratelimit-reset"), 60);
        assert_eq!(r.header("ratelimit-policy"), Some("\"daily\";q=3;w=82800"));
        assert_eq!(r.header("ratelimit"), Some(format!("\"daily\";r={left};t=60").as_str()));
    }
    tg.advance(std::time::Duration::from_millis(20_500));
    let r = tg.get("/").from_ip(ip).header("accept", "application/problem+json").send().await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    // 39.5 s to midnight, rounded up.
    assert_eq!(secs(&r, "retry-after"), 40);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    let body = r.json();
    assert_eq!(body["type"], QUOTA_EXCEEDED);
    assert_eq!(body["violated-policies"], serde_json::json!(["daily"]));
    assert_eq!(body["retry_after_seconds"], 40);
    assert_eq!(body["window_seconds"], 82800);
    // The plain JSON body says the same.
    let plain = tg.get("/").from_ip(ip).send().await;
    assert_eq!(plain.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(plain.json()["retry_after_seconds"], 40);

    // Midnight in Berlin: a fresh quota, in a 24-hour day.
    tg.advance(std::time::Duration::from_millis(39_500));
    let r = tg.get("/").from_ip(ip).send().await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(secs(&r, "x-ratelimit-remaining"), 2);
    assert_eq!(secs(&r, "x-ratelimit-reset"), 24 * 3600);
    assert_eq!(r.header("ratelimit-policy"), Some("\"daily\";q=3;w=86400"));
    assert_eq!(tg.rules().await["rules"][0]["calendar"], "day");
}

#[tokio::test]
async fn a_leap_february_ends_on_the_first_of_march_in_utc_by_default() {
    let up = Upstream::start().await;
    let tg = Tollgate::start(&up, &rule("monthly", 2, "month", None)).await;
    tg.clock.set(at("2028-02-29T23:00:00Z"));
    for _ in 0..2 {
        let r = tg.get("/").from_ip("198.51.100.8").send().await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.header("ratelimit-policy"), Some("\"monthly\";q=2;w=2505600"), "29 days");
    }
    let r = tg.get("/").from_ip("198.51.100.8").send().await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(secs(&r, "retry-after"), 3600);
    // Another key has its own quota.
    assert_eq!(tg.get("/").from_ip("198.51.100.9").send().await.status, StatusCode::OK);
    tg.advance(std::time::Duration::from_secs(3600));
    let r = tg.get("/").from_ip("198.51.100.8").send().await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("ratelimit-policy"), Some("\"monthly\";q=2;w=2678400"), "March: 31 days");
}

#[tokio::test]
async fn a_week_starts_on_monday() {
    let up = Upstream::start().await;
    let tg = Tollgate::start(&up, &rule("weekly", 1, "week", Some("America/New_York"))).await;
    // Sunday 2026-11-29 23:00 EST; the week ends at Monday 00:00 EST.
    tg.clock.set(at("2026-11-30T04:00:00Z"));
    assert_eq!(tg.get("/").from_ip("198.51.100.10").send().await.status, StatusCode::OK);
    let r = tg.get("/").from_ip("198.51.100.10").send().await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(secs(&r, "retry-after"), 3600);
    tg.advance(std::time::Duration::from_secs(3600));
    let r = tg.get("/").from_ip("198.51.100.10").send().await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(secs(&r, "x-ratelimit-reset"), 7 * 24 * 3600);
}

/// The next first of the month in Berlin after `now` (ns since the epoch).
fn next_month_in_berlin(now: u64) -> u64 {
    let zone = TimeZone::get("Europe/Berlin").expect("zone");
    let local = Timestamp::from_nanosecond(now as i128).expect("now").to_zoned_datetime(zone.clone());
    let first = local.date().first_of_month().checked_add(Span::new().months(1)).expect("next month");
    let start = first.to_zoned_datetime(zone).expect("midnight").start_of_day().expect("start of day");
    start.timestamp().as_nanosecond() as u64
}

fn real_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("after 1970").as_nanos() as u64
}

#[tokio::test]
async fn two_instances_share_a_monthly_quota_in_redis_cluster() {
    support::redis::require();
    let up = Upstream::start().await;
    let config = tollgate_config(up.addr, &cluster().url(), "on_error = \"deny\"");
    let rules = rule("monthly-shared", 3, "month", Some("Europe/Berlin"));
    let a = Tollgate::with(&config, &[("rules.toml", &rules)]).await;
    let b = Tollgate::with(&config, &[("rules.toml", &rules)]).await;
    // Redis counts on its own clock, the real one: so do the instances.
    let now = real_now();
    a.clock.set(now);
    b.clock.set(now);
    let boundary = next_month_in_berlin(now);
    let ip = "198.51.100.11";
    let mut statuses = Vec::new();
    for i in 0..5 {
        let t = if i % 2 == 0 { &a } else { &b };
        statuses.push(t.get("/").from_ip(ip).send().await.status.as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    let r = b.get("/").from_ip(ip).header("accept", "application/problem+json").send().await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.json()["type"], QUOTA_EXCEEDED);
    // At the next first of the month, on the server's clock: a second or
    // two of test time may have passed since `now`.
    let expected = (boundary - now).div_ceil(1_000_000_000);
    let retry = secs(&r, "retry-after");
    assert!((expected.saturating_sub(3)..=expected).contains(&retry), "retry-after {retry}, boundary in {expected} s");
    let w = r.header("ratelimit-policy").expect("policy").to_string();
    let days: u64 = w.rsplit("w=").next().and_then(|s| s.parse().ok()).expect("w");
    assert!((28 * 86400 - 3600..=31 * 86400 + 3600).contains(&days), "{w}");
    // The counter lives until the month ends, and no longer.
    let key = "tollgate:{monthly-shared|ip=198.51.100.11}:fw2";
    let port = cluster().master_of(key).expect("the key's master");
    let ttl_ms: u64 = cluster().cli(port, &["PTTL", key]).trim().parse().expect("pttl");
    let ttl = ttl_ms.div_ceil(1000);
    assert!((expected.saturating_sub(3)..=expected).contains(&ttl), "ttl {ttl}, boundary in {expected} s");
    // Counted in the window that started on the first of this month in
    // Berlin (`window` reads the stored value as "<window start in µs>:<count>").
    let stored = cluster().cli(port, &support::redis::window(key));
    let start_us: u64 = stored.trim().split(':').next().and_then(|s| s.parse().ok()).expect("window start");
    assert_eq!(start_us, this_month_in_berlin(now) / 1_000, "{stored}");
}

/// The first of the month in Berlin holding `now`.
fn this_month_in_berlin(now: u64) -> u64 {
    let zone = TimeZone::get("Europe/Berlin").expect("zone");
    let local = Timestamp::from_nanosecond(now as i128).expect("now").to_zoned_datetime(zone.clone());
    let first = local.date().first_of_month();
    let start = first.to_zoned_datetime(zone).expect("midnight").start_of_day().expect("start of day");
    start.timestamp().as_nanosecond() as u64
}

/// The decision API (`POST /v1/check`) counts a calendar rule in the same
/// calendar window as the proxy: Berlin's 25-hour autumn day.
#[tokio::test]
async fn the_decision_api_counts_in_the_calendar_window() {
    let up = Upstream::start().await;
    let config = support::config(up.addr).replacen(
        "admin = \"127.0.0.1:0\"\n",
        "admin = \"127.0.0.1:0\"\ndecision = \"127.0.0.1:0\"\n",
        1,
    );
    let rules =
        "[[rule]]\nname = \"daily\"\nkey = [\"user\"]\nlimit = 2\ncalendar = \"day\"\ntimezone = \"Europe/Berlin\"\n";
    let tg = Tollgate::with(&config, &[("rules.toml", rules)]).await;
    // 2026-10-25 23:59 CET: the day the clocks went back, 25 hours long.
    tg.clock.set(at("2026-10-25T22:59:00Z"));
    let addr = tg.decision_addr.expect("the decision listener");
    let check = || {
        support::Call::new("POST", addr, "/v1/check")
            .header("content-type", "application/json")
            .body(r#"{"rule": "daily", "key": {"user": "alice"}}"#)
    };
    let first = check().send().await.json();
    assert_eq!(first["allowed"], true, "{first}");
    assert_eq!(first["headers"]["ratelimit-policy"], "\"daily\";q=2;w=90000", "{first}");
    // The proxy spends the same counter.
    let r = tg.get("/").header("x-user-id", "alice").send().await;
    assert_eq!(r.status, StatusCode::OK);
    let last = check().send().await.json();
    assert_eq!(last["allowed"], false, "{last}");
    assert_eq!(last["retry_after"], 60, "{last}");
}

/// Leases on a calendar rule never admit past the month's limit: two
/// instances drive a monthly quota of 1,000 (leased 1% = 10 units at a
/// time, counted in the month's window, which a lease ends with) to
/// exhaustion concurrently. At most the limit is admitted, and at least the
/// limit less one lease per instance (docs/redis.md: what an instance holds
/// back is one lease per key).
#[tokio::test]
async fn leases_never_admit_past_a_monthly_limit() {
    support::redis::require();
    const LIMIT: usize = 1_000;
    const LEASE: usize = LIMIT / 100;
    let up = Upstream::start().await;
    let config = tollgate_config(up.addr, &cluster().url(), "on_error = \"deny\"\ntimeout = \"5s\"");
    let rules = rule("monthly-leased", LIMIT as u64, "month", Some("Europe/Berlin"));
    let instances = [
        Tollgate::with(&config, &[("rules.toml", &rules)]).await,
        Tollgate::with(&config, &[("rules.toml", &rules)]).await,
    ];
    // Redis counts on its own clock, the real one: so do the instances.
    let now = real_now();
    for t in &instances {
        t.clock.set(now);
    }
    // 16 clients per instance, 44 requests each: 1,408 in all, enough to
    // spend every lease either instance holds.
    let mut set = tokio::task::JoinSet::new();
    for t in &instances {
        for _ in 0..16 {
            let calls: Vec<_> = (0..44).map(|_| t.get("/").from_ip("198.51.100.77")).collect();
            set.spawn(async move {
                let mut statuses = Vec::with_capacity(calls.len());
                for call in calls {
                    statuses.push(call.send().await.status.as_u16());
                }
                statuses
            });
        }
    }
    let mut by_status = std::collections::BTreeMap::new();
    while let Some(r) = set.join_next().await {
        for status in r.expect("client task") {
            *by_status.entry(status).or_insert(0usize) += 1;
        }
    }
    let admitted = by_status.get(&200).copied().unwrap_or(0);
    assert_eq!(by_status.keys().copied().collect::<Vec<_>>(), [200, 429], "{by_status:?}");
    assert!(admitted <= LIMIT, "{admitted} admitted past the limit of {LIMIT}: {by_status:?}");
    assert!(admitted >= LIMIT - instances.len() * LEASE, "{admitted} admitted of {LIMIT}: {by_status:?}");
    // Leases were in play: granted, and requests answered from them.
    let (mut granted, mut hits) = (0.0, 0.0);
    for t in &instances {
        let m = t.metrics().await;
        granted += metric(&m, "tollgate_leases_granted_total", &[]).unwrap_or(0.0);
        hits += metric(&m, "tollgate_lease_hits_total", &[]).unwrap_or(0.0);
    }
    assert!(granted >= 2.0 && hits >= 100.0, "{granted} leases granted, {hits} requests served from them");
    // And Redis counted no more than the limit in the month's window.
    let key = "tollgate:{monthly-leased|ip=198.51.100.77}:fw2";
    let port = cluster().master_of(key).expect("the key's master");
    let stored = cluster().cli(port, &support::redis::window(key));
    let count: usize = stored.trim().rsplit(':').next().and_then(|s| s.parse().ok()).expect("count");
    assert!(count <= LIMIT, "Redis counted {count}: {stored}");
    eprintln!("{admitted} admitted, Redis counted {count}, {granted} leases, {hits} lease hits: {by_status:?}");
}
