//! The five algorithms end to end: a concurrent burst admits exactly the
//! limit, rejected requests never reach the upstream, and quota comes back
//! exactly when the injected clock says it should.

use crate::support;

use std::time::{Duration, Instant};

use support::{Tollgate, Upstream, burst, count, decisions, expect_statuses, metric, statuses};

/// One rule named `r` over every request, keyed by client IP.
fn rule(algorithm: &str, limit: u64, window: &str, extra: &str) -> String {
    format!("[[rule]]\nname = \"r\"\nalgorithm = \"{algorithm}\"\nlimit = {limit}\nwindow = \"{window}\"\n{extra}")
}

/// 60 concurrent requests against a limit of 20: exactly 20 are forwarded,
/// 40 answered 429, and the upstream sees only the 20.
async fn burst_admits_exactly_the_limit(tg: &Tollgate, upstream: &Upstream) {
    let replies = burst(60, |_| tg.get("/burst")).await;
    assert_eq!((count(&replies, 200), count(&replies, 429)), (20, 40));
    assert_eq!(upstream.hits(), 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_bucket_burst_then_refill() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, &rule("token_bucket", 20, "60s", "")).await;
    burst_admits_exactly_the_limit(&tg, &upstream).await;

    let m = tg.metrics().await;
    assert_eq!(decisions(&m, "r", "allowed"), 20.0);
    assert_eq!(decisions(&m, "r", "limited"), 40.0);
    assert_eq!(metric(&m, "tollgate_requests_total", &[("route", "svc"), ("decision", "allowed")]), Some(20.0));
    assert_eq!(metric(&m, "tollgate_requests_total", &[("route", "svc"), ("decision", "limited")]), Some(40.0));

    // 20 per 60 s refills one token every 3 s.
    tg.advance(Duration::from_millis(2999));
    assert_eq!(statuses(1, || tg.get("/")).await, [429]);
    tg.advance(Duration::from_millis(1));
    assert_eq!(statuses(3, || tg.get("/")).await, [200, 429, 429]);
    // A full window refills the bucket to its capacity, no further.
    tg.advance(Duration::from_secs(600));
    assert_eq!(statuses(25, || tg.get("/")).await, expect_statuses(20, 200, 5, 429));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_bucket_burst_is_the_capacity() {
    let upstream = Upstream::start().await;
    // Capacity 5, refilled at 20 per 60 s.
    let tg = Tollgate::start(&upstream, &rule("token_bucket", 20, "60s", "burst = 5")).await;
    let replies = burst(12, |_| tg.get("/")).await;
    assert_eq!((count(&replies, 200), count(&replies, 429)), (5, 7));
    tg.advance(Duration::from_secs(6));
    assert_eq!(statuses(3, || tg.get("/")).await, [200, 200, 429]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaky_bucket_burst_then_drain() {
    let upstream = Upstream::start().await;
    // A queue of 20 drained at 20 per 200 ms: the admitted requests of the
    // burst are spread over 190 ms of real time.
    let tg = Tollgate::start(&upstream, &rule("leaky_bucket", 20, "200ms", "")).await;
    burst_admits_exactly_the_limit(&tg, &upstream).await;
    // Half the window drains half the queue.
    tg.advance(Duration::from_millis(100));
    let replies = burst(15, |_| tg.get("/")).await;
    assert_eq!((count(&replies, 200), count(&replies, 429)), (10, 5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaky_bucket_delays_admitted_requests_and_rejects_a_full_queue() {
    let upstream = Upstream::start().await;
    // One request leaves the queue every 100 ms; the queue holds 4.
    let tg = Tollgate::start(&upstream, &rule("leaky_bucket", 10, "1s", "burst = 4")).await;
    let started = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..6 {
        let call = tg.get("/shaped");
        set.spawn(async move {
            let reply = call.send().await;
            (reply, started.elapsed())
        });
    }
    let mut admitted = Vec::new();
    let mut rejected = Vec::new();
    while let Some(r) = set.join_next().await {
        let (reply, took) = r.expect("request task");
        match reply.status.as_u16() {
            200 => admitted.push(took),
            429 => rejected.push(reply),
            other => panic!("unexpected status {other}"),
        }
    }
    assert_eq!((admitted.len(), rejected.len()), (4, 2));
    // The injected clock stands still, so the queue does not drain while the
    // burst arrives: the admitted requests wait 0, 100, 200 and 300 ms of
    // real time for their turns (tokio never wakes a sleep early).
    admitted.sort();
    for (i, took) in admitted.iter().enumerate() {
        let turn = Duration::from_millis(100 * i as u64);
        assert!(*took >= turn, "request {i} was forwarded after {took:?}, before its turn at {turn:?}");
        assert!(*took < turn + Duration::from_secs(10), "request {i} took {took:?}");
    }
    // The one that found the queue full may retry once one slot drained.
    for r in &rejected {
        assert_eq!(r.header("retry-after"), Some("1"));
        assert_eq!(r.json()["retry_after_seconds"], 1);
    }
    assert_eq!(upstream.hits(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixed_window_burst_then_roll_over() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, &rule("fixed_window", 20, "60s", "")).await;
    burst_admits_exactly_the_limit(&tg, &upstream).await;
    // The window is aligned to the epoch; its last second still counts.
    tg.advance(Duration::from_secs(59));
    let last = tg.get("/").send().await;
    assert_eq!(last.status, 429);
    assert_eq!(last.header("retry-after"), Some("1"));
    tg.advance(Duration::from_secs(1));
    assert_eq!(statuses(25, || tg.get("/")).await, expect_statuses(20, 200, 5, 429));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_window_log_burst_then_slide() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, &rule("sliding_window_log", 20, "60s", "")).await;
    burst_admits_exactly_the_limit(&tg, &upstream).await;
    tg.advance(Duration::from_secs(30));
    let r = tg.get("/").send().await;
    assert_eq!((r.status.as_u16(), r.header("retry-after")), (429, Some("30")));
    // The burst's entries leave the window exactly 60 s after they entered.
    tg.advance(Duration::from_secs(30));
    assert_eq!(statuses(10, || tg.get("/")).await, expect_statuses(10, 200, 0, 0));
    // 30 s later the 10 just admitted are still in the window: 10 more fit.
    tg.advance(Duration::from_secs(30));
    assert_eq!(statuses(15, || tg.get("/")).await, expect_statuses(10, 200, 5, 429));
    // Rejected requests were not logged: 30 s on, the first 10 leave and
    // exactly 10 fit again.
    tg.advance(Duration::from_secs(30));
    assert_eq!(statuses(15, || tg.get("/")).await, expect_statuses(10, 200, 5, 429));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_window_counter_burst_then_weighted_slide() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, &rule("sliding_window_counter", 20, "60s", "")).await;
    burst_admits_exactly_the_limit(&tg, &upstream).await;
    // At the start of the next window the previous one still weighs fully:
    // 20 * (1 - 0) = 20. It has slid out enough for one request after 3 s.
    tg.advance(Duration::from_secs(60));
    let r = tg.get("/").send().await;
    assert_eq!((r.status.as_u16(), r.header("retry-after")), (429, Some("3")));
    // Halfway through, the previous window weighs 20 * 0.5 = 10.
    tg.advance(Duration::from_secs(30));
    assert_eq!(statuses(15, || tg.get("/")).await, expect_statuses(10, 200, 5, 429));
    // Two windows later nothing weighs any more.
    tg.advance(Duration::from_secs(120));
    let replies = burst(30, |_| tg.get("/")).await;
    assert_eq!((count(&replies, 200), count(&replies, 429)), (20, 10));
}
