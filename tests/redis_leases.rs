//! Leases against one real `redis-server`: a busy key is answered from
//! quota leased to the instance, two instances together never admit past the
//! limit (exactly the limit when requests keep coming to both), idle leases
//! and every lease at shutdown go back to Redis (once: a give-back that
//! timed out is not sent again), units taken for a request another rule
//! rejects are returned, and `lease_percent = 0` asks Redis for every
//! request.
//!
//! One server is shared by the whole file; every test uses its own key
//! prefix.

use crate::support;

use std::sync::OnceLock;

use support::redis::{RedisServer, tollgate_config};
use support::{Tollgate, Upstream, burst, count, eventually, metric};

fn server() -> &'static RedisServer {
    static SERVER: OnceLock<RedisServer> = OnceLock::new();
    SERVER.get_or_init(RedisServer::start)
}

/// A tollgate on the shared server, keys under `prefix`, with `store`
/// settings added and `rules`.
async fn tollgate(upstream: &Upstream, prefix: &str, store: &str, rules: &str) -> Tollgate {
    let store = format!("key_prefix = \"{prefix}\"\non_error = \"deny\"\n{store}");
    Tollgate::with(&tollgate_config(upstream.addr, &server().url(), &store), &[("rules.toml", rules)]).await
}

/// One rule keyed by IP. A day-long window: no window boundary falls inside
/// a test (all but certainly), and a token bucket refills one token in 86 s.
fn rule(name: &str, algorithm: &str, limit: u64) -> String {
    format!(
        "[[rule]]\nname = \"{name}\"\nkey = [\"ip\"]\nalgorithm = \"{algorithm}\"\nlimit = {limit}\nwindow = \"1d\"\n"
    )
}

async fn lease_hits(tg: &Tollgate) -> f64 {
    metric(&tg.metrics().await, "tollgate_lease_hits_total", &[]).unwrap_or(0.0)
}

#[tokio::test]
async fn two_instances_serve_a_busy_key_from_leases_and_admit_exactly_the_limit() {
    let up = Upstream::start().await;
    for algorithm in ["fixed_window", "sliding_window_counter", "token_bucket"] {
        let prefix = format!("t-lease-exact-{algorithm}:");
        let rules = rule("busy", algorithm, 1_000);
        let a = tollgate(&up, &prefix, "lease_idle = \"1h\"", &rules).await;
        let b = tollgate(&up, &prefix, "lease_idle = \"1h\"", &rules).await;
        let mut admitted = 0;
        let mut statuses = Vec::new();
        for i in 0..1_100 {
            let tg = if i % 2 == 0 { &a } else { &b };
            let status = tg.get("/").from_ip("192.0.2.10").send().await.status.as_u16();
            admitted += usize::from(status == 200);
            statuses.push(status);
        }
        assert_eq!(admitted, 1_000, "{algorithm}: {statuses:?}");
        assert!(
            statuses[..1_000].iter().all(|&s| s == 200),
            "{algorithm}: the first 1,000 are admitted: {:?}",
            statuses.iter().enumerate().filter(|(_, s)| **s != 200).map(|(i, s)| (i, *s)).take(30).collect::<Vec<_>>()
        );
        // Each instance asks Redis with a lease of 10 every 11 requests, then
        // one by one for the last 20.
        let hits = lease_hits(&a).await + lease_hits(&b).await;
        assert!(hits >= 800.0, "{algorithm}: only {hits} of 1,100 requests were served from leases");
    }
}

#[tokio::test]
async fn concurrent_instances_stay_within_the_limit_and_idle_leases_come_back() {
    let up = Upstream::start().await;
    let prefix = "t-lease-concurrent:";
    let rules = rule("shared", "fixed_window", 1_000);
    let a = tollgate(&up, prefix, "lease_idle = \"300ms\"", &rules).await;
    let b = tollgate(&up, prefix, "lease_idle = \"300ms\"", &rules).await;
    let mut admitted = 0;
    for _ in 0..12 {
        let replies = burst(100, |i| (if i % 2 == 0 { &a } else { &b }).get("/").from_ip("192.0.2.11")).await;
        admitted += count(&replies, 200);
    }
    // Never past the limit; short of it by at most the two leases (10 each)
    // the instances may still hold when their requests stop.
    assert!((980..=1_000).contains(&admitted), "admitted {admitted} of 1,200");

    // Idle leases go back to Redis: a third instance (whose over-limit
    // cache is empty) then gets exactly what was held back.
    let c = tollgate(&up, prefix, "lease_percent = 0", &rules).await;
    let held_back = 1_000 - admitted;
    eventually("the idle leases are given back", || async {
        let key = format!("{prefix}{{shared|ip=192.0.2.11}}:fw2");
        let value = server().cli(&support::redis::window(&key));
        value.trim().ends_with(&format!(":{admitted}"))
    })
    .await;
    let statuses = support::statuses(held_back + 5, || c.get("/").from_ip("192.0.2.11")).await;
    assert_eq!(statuses, support::expect_statuses(held_back, 200, 5, 429));
}

#[tokio::test]
async fn units_taken_from_a_lease_for_a_request_another_rule_rejects_are_given_back() {
    let up = Upstream::start().await;
    let prefix = "t-lease-multi:";
    // Every request matches both: a big leased limit and a small one.
    let rules = format!("{}{}", rule("big", "fixed_window", 1_000), rule("small", "fixed_window", 2));
    let tg = tollgate(&up, prefix, "lease_idle = \"1h\"", &rules).await;
    let statuses = support::statuses(6, || tg.get("/").from_ip("192.0.2.13")).await;
    assert_eq!(statuses, support::expect_statuses(2, 200, 4, 429));
    let big =
        || server().cli(&support::redis::window(&format!("{prefix}{{big|ip=192.0.2.13}}:fw2"))).trim().to_string();
    // One call for the big rule: the first request and its lease of 10.
    // The second and third took from the lease, and the third gave its
    // unit back when the small rule rejected it.
    assert!(big().ends_with(":11"), "{}", big());
    tg.stop().await;
    // Only the two admitted requests count once the lease is back.
    assert!(big().ends_with(":2"), "{}", big());
}

#[tokio::test]
async fn leases_are_given_back_at_shutdown_and_can_be_turned_off() {
    let up = Upstream::start().await;
    let prefix = "t-lease-stop:";
    let rules = rule("stop", "fixed_window", 1_000);
    let key = format!("{prefix}{{stop|ip=192.0.2.12}}:fw2");
    let count_in_redis = || {
        let value = server().cli(&support::redis::window(&key));
        value.trim().rsplit(':').next().and_then(|n| n.parse::<u64>().ok()).unwrap_or(0)
    };

    let a = tollgate(&up, prefix, "lease_idle = \"1h\"", &rules).await;
    let first = a.get("/").from_ip("192.0.2.12").send().await;
    assert_eq!(first.status, 200);
    // The first request leased 1% of 1,000 on top of itself.
    assert_eq!(count_in_redis(), 11);
    assert_eq!(first.header("x-ratelimit-remaining"), Some("999"), "989 left in Redis and 10 held here");
    let second = a.get("/").from_ip("192.0.2.12").send().await;
    assert_eq!(second.header("x-ratelimit-remaining"), Some("998"), "989 left in Redis and 9 held here");
    assert_eq!(count_in_redis(), 11, "served from the lease");
    a.stop().await;
    assert_eq!(count_in_redis(), 2, "the unspent 9 went back at shutdown");

    // Turned off: every request is a script call, none is leased.
    let off = tollgate(&up, prefix, "lease_percent = 0", &rules).await;
    for _ in 0..30 {
        assert_eq!(off.get("/").from_ip("192.0.2.12").send().await.status, 200);
    }
    assert_eq!(count_in_redis(), 32);
    assert_eq!(lease_hits(&off).await, 0.0);
}

/// The server's clock (`TIME`), in microseconds.
fn server_time_us() -> u64 {
    let out = server().cli(&["TIME"]);
    let mut parts = out.split_whitespace().map(|p| p.parse::<u64>().expect("TIME answers two integers"));
    let (secs, micros) = (parts.next().expect("seconds"), parts.next().expect("microseconds"));
    secs * 1_000_000 + micros
}

#[tokio::test]
async fn a_token_bucket_lease_does_not_outlive_the_units_it_holds() {
    let up = Upstream::start().await;
    let prefix = "t-lease-refill:";
    // 200 per second into a bucket of 1,000: a lease is 10% of it, 100 units.
    let rules = "[[rule]]\nname = \"refill\"\nkey = [\"ip\"]\nalgorithm = \"token_bucket\"\nlimit = 200\n\
                 window = \"1s\"\nburst = 1000\n";
    let store = "lease_idle = \"1h\"\nlease_percent = 10";
    let a = tollgate(&up, prefix, store, rules).await;
    let b = tollgate(&up, prefix, store, rules).await;
    let ip = "192.0.2.14";
    // Each instance takes a lease (1 unit spent, 99 held), and the bucket
    // then refills completely (202 units at 200/s) while they are held.
    for tg in [&a, &b] {
        assert_eq!(tg.get("/").from_ip(ip).send().await.status, 200);
    }
    tokio::time::sleep(std::time::Duration::from_millis(1_500)).await;

    // Both instances under concurrent load for a few seconds: whatever they
    // admit in that time, the bucket allows at most its burst plus what
    // refills meanwhile, by the server's clock. At least 3 s, and on until
    // some request was refused (the load has passed the bucket: a loaded
    // machine sends slower and needs longer), up to 20 s.
    let started = server_time_us();
    let mut admitted = 0;
    let mut sent = 0;
    loop {
        let elapsed_us = server_time_us() - started;
        if elapsed_us >= 20_000_000 || (elapsed_us >= 3_000_000 && sent > admitted) {
            break;
        }
        let replies = burst(40, |i| (if i % 2 == 0 { &a } else { &b }).get("/").from_ip(ip)).await;
        admitted += count(&replies, 200);
        sent += replies.len();
    }
    let elapsed_us = server_time_us() - started;
    let allowed = 1_000 + 200 * elapsed_us / 1_000_000;
    assert!(
        admitted as u64 <= allowed,
        "admitted {admitted} of {sent} in {elapsed_us} us; the bucket allows {allowed}"
    );
    assert!(sent > admitted, "the load must exceed the bucket to test it");
}

/// A Redis of its own, which a test stops (saving its data) and restarts.
fn own_server() -> RedisServer {
    RedisServer::start()
}

/// Stops `redis` with its data saved to disk; [`RedisServer::restart`]
/// loads it again.
fn stop_saving(redis: &RedisServer) {
    redis.cli(&["SHUTDOWN", "SAVE"]);
    support::redis::wait_until("redis is down", || redis.cli(&["PING"]).trim() != "PONG");
}

#[tokio::test]
async fn leases_idle_or_drained_at_shutdown_while_redis_is_down_are_given_back_when_it_returns() {
    let up = Upstream::start().await;
    let redis = own_server();
    let rules = rule("back", "fixed_window", 1_000);
    let config = |idle: &str| {
        let store = format!("on_error = \"allow\"\nlease_idle = \"{idle}\"");
        tollgate_config(up.addr, &redis.url(), &store)
    };
    let count_of = |ip: &str| {
        let value = redis.cli(&support::redis::window(&format!("tollgate:{{back|ip={ip}}}:fw2")));
        value.trim().rsplit(':').next().and_then(|n| n.parse::<u64>().ok()).unwrap_or(0)
    };

    // An idle lease expires while Redis is down.
    let idle = Tollgate::with(&config("300ms"), &[("rules.toml", &rules)]).await;
    // And one is held at shutdown.
    let stopping = Tollgate::with(&config("1h"), &[("rules.toml", &rules)]).await;
    for (tg, ip) in [(&idle, "192.0.2.20"), (&stopping, "192.0.2.21")] {
        for _ in 0..2 {
            assert_eq!(tg.get("/").from_ip(ip).send().await.status, 200);
        }
        assert_eq!(count_of(ip), 11, "one request and a lease of 10, one of them spent");
    }

    stop_saving(&redis);
    // Long enough for the idle lease to be swept.
    tokio::time::sleep(std::time::Duration::from_millis(1_000)).await;
    let stopped = tokio::spawn(stopping.stop());
    // Longer than the store timeout (500 ms): a give-back tried once is lost.
    tokio::time::sleep(std::time::Duration::from_millis(1_500)).await;
    redis.restart();
    assert_eq!(count_of("192.0.2.20"), 11, "the saved count is back");
    stopped.await.expect("tollgate stops");
    assert_eq!(count_of("192.0.2.21"), 2, "the 9 units held at shutdown went back once Redis returned");
    eventually("the idle lease's 9 units come back", || async { count_of("192.0.2.20") == 2 }).await;
    drop(idle);
}

#[tokio::test]
async fn a_window_give_back_that_timed_out_is_not_sent_again_since_it_may_have_run() {
    let up = Upstream::start().await;
    let redis = own_server();
    let ip = "192.0.2.22";
    for algorithm in ["fixed_window", "sliding_window_counter"] {
        let rules = rule("once", algorithm, 200);
        let config = |store: &str| {
            let store =
                format!("key_prefix = \"t-once-{algorithm}:\"\non_error = \"deny\"\ntimeout = \"200ms\"\n{store}");
            tollgate_config(up.addr, &redis.url(), &store)
        };
        // 10% of 200: the first request leases 20 units, the second spends one.
        let holder =
            Tollgate::with(&config("lease_idle = \"1h\"\nlease_percent = 10"), &[("rules.toml", &rules)]).await;
        for _ in 0..2 {
            assert_eq!(holder.get("/").from_ip(ip).send().await.status, 200, "{algorithm}");
        }
        // Redis holds every script for 700 ms, then runs them: the give-back
        // of the 19 units at shutdown is written, times out after 200 ms
        // (Redis is connected and answers pings all along), and runs later.
        let paused = std::time::Instant::now();
        assert_eq!(redis.cli(&["CLIENT", "PAUSE", "700", "WRITE"]).trim(), "OK");
        holder.stop().await;
        // Past the pause, with time for what it held and any re-send to run.
        tokio::time::sleep(std::time::Duration::from_millis(1_500).saturating_sub(paused.elapsed())).await;

        // Two requests were admitted: 198 are left, whatever became of the
        // give-back. One that ran twice gives 19 units more.
        let other = Tollgate::with(&config("lease_percent = 0"), &[("rules.toml", &rules)]).await;
        let statuses = support::statuses(205, || other.get("/").from_ip(ip)).await;
        let admitted = statuses.iter().filter(|&&s| s == 200).count();
        assert!(admitted <= 198, "{algorithm}: 2 + {admitted} admitted past the limit of 200");
        assert_eq!(admitted, 198, "{algorithm}: the give-back ran once");
    }
}

#[tokio::test]
async fn an_idle_window_lease_whose_give_back_timed_out_is_dropped_and_counted() {
    let up = Upstream::start().await;
    let redis = own_server();
    let ip = "192.0.2.23";
    let rules = rule("idle-once", "fixed_window", 200);
    let store = |more: &str| format!("on_error = \"deny\"\ntimeout = \"200ms\"\n{more}");
    let holder = Tollgate::with(
        &tollgate_config(up.addr, &redis.url(), &store("lease_idle = \"200ms\"\nlease_percent = 10")),
        &[("rules.toml", &rules)],
    )
    .await;
    for _ in 0..2 {
        assert_eq!(holder.get("/").from_ip(ip).send().await.status, 200);
    }
    // The lease goes idle 200 ms from now and its give-back is written
    // while Redis holds scripts (until 900 ms): it times out, then runs.
    let paused = std::time::Instant::now();
    assert_eq!(redis.cli(&["CLIENT", "PAUSE", "900", "WRITE"]).trim(), "OK");
    tokio::time::sleep(std::time::Duration::from_millis(1_700).saturating_sub(paused.elapsed())).await;
    let key = "tollgate:{idle-once|ip=192.0.2.23}:fw2";
    assert!(
        redis.cli(&support::redis::window(key)).trim().ends_with(":2"),
        "given back once: {}",
        redis.cli(&support::redis::window(key))
    );
    let dropped = metric(&holder.metrics().await, "tollgate_lease_give_backs_dropped_total", &[]);
    assert_eq!(dropped, Some(1.0), "the timed-out give-back is counted, not queued");
}

#[tokio::test]
async fn a_token_bucket_lease_stays_valid_while_its_bucket_refills_and_is_settled_as_it_is_renewed() {
    let up = Upstream::start().await;
    let prefix = "t-lease-escrow:";
    // 1,000 per 10 ms into a bucket of 1,000: a lease (1%, 10 units) would
    // refill in 0.1 ms, far sooner than the next request comes.
    let rules = "[[rule]]\nname = \"fast\"\nkey = [\"ip\"]\nalgorithm = \"token_bucket\"\nlimit = 1000\n\
                 window = \"10ms\"\nburst = 1000\n";
    let tg = tollgate(&up, prefix, "lease_idle = \"1h\"", rules).await;
    for i in 0..1_500 {
        let status = tg.get("/").from_ip("192.0.2.30").send().await.status;
        assert_eq!(status, 200, "request {i}: the key is far below its limit");
    }
    // Served from leases: one call per lease of 10. Leases left in their
    // escrow slot unsettled would have filled the bucket after 100 of them.
    let hits = lease_hits(&tg).await;
    assert!(hits >= 1_300.0, "{hits} of 1,500 requests were served from leases");
}

/// A key in steady use has its lease renewed ahead, in the background:
/// after the first request, none waits for Redis. (Each renewal leaves
/// with one unit left, which lasts the 20 ms until the next request.)
#[tokio::test]
async fn a_lease_in_steady_use_is_renewed_ahead_and_no_request_waits_for_redis() {
    let up = Upstream::start().await;
    for algorithm in ["token_bucket", "fixed_window", "sliding_window_counter"] {
        let prefix = format!("t-lease-ahead-{algorithm}:");
        // 1% of 1,000: leases of 10.
        let tg = tollgate(&up, &prefix, "lease_idle = \"1h\"", &rule("steady", algorithm, 1_000)).await;
        for i in 0..100 {
            let status = tg.get("/").from_ip("192.0.2.40").send().await.status;
            assert_eq!(status, 200, "{algorithm}: request {i}");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let m = tg.metrics().await;
        let checks = metric(&m, "tollgate_redis_call_checks_total", &[]).unwrap_or(0.0);
        let renewals = metric(&m, "tollgate_lease_renewals_total", &[]).unwrap_or(0.0);
        let hits = lease_hits(&tg).await;
        assert!(renewals >= 9.0, "{algorithm}: {renewals} renewals ahead");
        // The first request asks Redis; a slow machine may let a renewal
        // arrive after the unit it left was spent, now and then.
        assert!(checks - renewals <= 3.0, "{algorithm}: {} requests waited for Redis", checks - renewals);
        assert!(hits >= 97.0, "{algorithm}: {hits} of 100 requests served from leases");
        // What Redis had left at the last grant and what is leased here: 899
        // after 101 requests, none lost or counted twice by the renewals.
        let last = tg.get("/").from_ip("192.0.2.40").send().await;
        let remaining: u64 = last.header("x-ratelimit-remaining").and_then(|v| v.parse().ok()).expect("remaining");
        assert!((880..=899).contains(&remaining), "{algorithm}: {remaining} remaining after 101 requests");
    }
}

#[tokio::test]
async fn the_escrow_of_an_instance_that_died_holding_a_lease_comes_back_when_its_slot_ends() {
    let up = Upstream::start().await;
    let prefix = "t-lease-crash:";
    // 100 per second into a bucket of 400: a lease of 25% is 100 units.
    let rules = "[[rule]]\nname = \"crash\"\nkey = [\"ip\"]\nalgorithm = \"token_bucket\"\nlimit = 100\n\
                 window = \"1s\"\nburst = 400\n";
    let store = "lease_idle = \"1h\"\nlease_percent = 25\nlease_lifetime = \"300ms\"";
    let ip = "192.0.2.31";
    let dead = tollgate(&up, prefix, store, rules).await;
    assert_eq!(dead.get("/").from_ip(ip).send().await.status, 200, "takes a lease of 100");
    // Gone without giving it back (the task is aborted: no drain).
    drop(dead);

    // The state is doubles (bucket.lua): stamp and level, then each
    // escrow slot's end and units.
    let key = format!("{prefix}{{crash|ip={ip}}}:tb2");
    let bytes = server().cli(&["STRLEN", &key]);
    assert_eq!(bytes.trim(), "32", "level and one escrow slot: {bytes:?} bytes");
    let read = "return tostring(struct.unpack('<d', redis.call('GET', KEYS[1]), 25))";
    let units = server().cli(&["EVAL", read, "1", &key]);
    assert_eq!(units.trim(), "100", "the lease sits in escrow: {units:?}");
    // Between one and two lifetimes after the grant (under 600 ms) the slot
    // ends and its units count as spent then; the level they join drains
    // in a second from there. A slot that never ended would keep the 100
    // units from everyone for good.
    tokio::time::sleep(std::time::Duration::from_millis(1_800)).await;
    let other = tollgate(&up, prefix, "lease_idle = \"1h\"\nlease_percent = 0", rules).await;
    let started = std::time::Instant::now();
    let replies = burst(500, |_| other.get("/").from_ip(ip)).await;
    let refill = 100 * started.elapsed().as_millis() as usize / 1_000 + 1;
    let admitted = count(&replies, 200);
    assert!(
        (395..=400 + refill).contains(&admitted),
        "admitted {admitted} of a full bucket of 400 (+{refill} refilled)"
    );
}

/// Instances whose `lease_lifetime`s differ (a config rolled out to some
/// of them) grant into escrow slots that end in either order: the key must
/// live until the last of them ends, or the escrow of the longer lease
/// vanishes with the key while its holder is still spending it.
#[tokio::test]
async fn a_bucket_lives_until_its_last_escrow_slot_ends_whatever_order_they_were_granted_in() {
    let up = Upstream::start().await;
    let prefix = "t-lease-order:";
    // 100 per second into a bucket of 400: a lease of 25% is 100 units.
    let rules = "[[rule]]\nname = \"order\"\nkey = [\"ip\"]\nalgorithm = \"token_bucket\"\nlimit = 100\n\
                 window = \"1s\"\nburst = 400\n";
    let ip = "192.0.2.32";
    let key = format!("{prefix}{{order|ip={ip}}}:tb2");
    let long = tollgate(&up, prefix, "lease_idle = \"1h\"\nlease_percent = 25\nlease_lifetime = \"30s\"", rules).await;
    assert_eq!(long.get("/").from_ip(ip).send().await.status, 200, "takes a lease ending 30 to 60 s from now");
    let short =
        tollgate(&up, prefix, "lease_idle = \"1h\"\nlease_percent = 25\nlease_lifetime = \"300ms\"", rules).await;
    assert_eq!(short.get("/").from_ip(ip).send().await.status, 200, "takes a lease ending within 600 ms");
    let bytes = server().cli(&["STRLEN", &key]);
    assert_eq!(bytes.trim(), "48", "level and two escrow slots: {bytes:?} bytes");
    let ttl: i64 = server().cli(&["PTTL", &key]).trim().parse().unwrap_or(-3);
    assert!(ttl > 29_000, "the key lives {ttl} ms, less than the 30 s lease it escrows");
}

#[tokio::test]
async fn a_key_far_below_its_limit_is_leased_what_it_uses() {
    let up = Upstream::start().await;
    for algorithm in ["token_bucket", "fixed_window", "sliding_window_counter"] {
        let prefix = format!("t-lease-by-use-{algorithm}:");
        // 100 a second: a 1% share is one unit, too small to lease.
        let rules = format!(
            "[[rule]]\nname = \"small\"\nkey = [\"ip\"]\nalgorithm = \"{algorithm}\"\nlimit = 100\nwindow = \"1s\"\n"
        );
        let tg = tollgate(&up, &prefix, "", &rules).await;
        // Forty a second for 2.5 s: the first second is asked request by
        // request, then leases of what the last second used (capped at a
        // tenth of the limit) answer most of the rest here.
        let mut statuses = Vec::new();
        for _ in 0..100 {
            statuses.push(tg.get("/").from_ip("192.0.2.20").send().await.status.as_u16());
            tokio::time::sleep(std::time::Duration::from_millis(25)).await;
        }
        assert!(statuses.iter().all(|&s| s == 200), "{algorithm}: {statuses:?}");
        let hits = lease_hits(&tg).await;
        assert!(hits >= 40.0, "{algorithm}: only {hits} of 100 requests were answered from leases");
        let m = tg.metrics().await;
        let checks = metric(&m, "tollgate_redis_call_checks_total", &[]).unwrap_or(0.0);
        assert!(checks <= 60.0, "{algorithm}: {checks} checks in Redis for 100 requests");
    }
}

#[tokio::test]
async fn leases_sized_by_use_never_admit_past_a_token_bucket() {
    let up = Upstream::start().await;
    let prefix = "t-lease-by-use-bound:";
    let rules = "[[rule]]\nname = \"small\"\nkey = [\"ip\"]\nalgorithm = \"token_bucket\"\nlimit = 100\n\
                 window = \"1s\"\n";
    let store = "lease_idle = \"1h\"";
    let instances = [
        tollgate(&up, prefix, store, rules).await,
        tollgate(&up, prefix, store, rules).await,
        tollgate(&up, prefix, store, rules).await,
    ];
    let ip = "192.0.2.21";
    // Each instance uses the key well below its limit long enough to hold
    // a lease sized by that use...
    for _ in 0..15 {
        for tg in &instances {
            assert_eq!(tg.get("/").from_ip(ip).send().await.status, 200);
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let mut granted = 0.0;
    for tg in &instances {
        granted += metric(&tg.metrics().await, "tollgate_leases_granted_total", &[]).unwrap_or(0.0);
    }
    assert!(granted >= 3.0, "each instance holds a lease ({granted} granted)");
    // ...then all three flood it: whatever they admit, the bucket allows at
    // most its burst plus what refills meanwhile, by the server's clock.
    let started = server_time_us();
    let (mut admitted, mut sent) = (0, 0);
    while server_time_us() - started < 2_000_000 {
        let replies = burst(60, |i| instances[i % 3].get("/").from_ip(ip)).await;
        admitted += count(&replies, 200);
        sent += replies.len();
    }
    let elapsed_us = server_time_us() - started;
    let allowed = 100 + 100 * elapsed_us / 1_000_000;
    assert!(
        admitted as u64 <= allowed,
        "admitted {admitted} of {sent} in {elapsed_us} us; the bucket allows {allowed}"
    );
    assert!(sent > admitted, "the load must exceed the bucket to test it");
}
