//! One master of a real 3-master Redis Cluster stops answering for 10 s
//! (`CLIENT PAUSE 10000 ALL`: its connections and its cluster bus stay up,
//! as in a long GC stall or a partition to that node alone, so no replica
//! takes over): only the keys it holds follow their rule's `on_error`. The
//! keys on the other masters stay exact, their nodes are never reported
//! down, and the paused master is probed on its own and taken back when
//! it answers.
//!
//! This file starts its own cluster: the paused node must not disturb the
//! tests of other files.

use crate::support;

use std::time::{Duration, Instant};

use support::redis::{OwnCluster, RedisServer, hourly_rule, ip_on_master, tollgate_config, window};
use support::{Tollgate, Upstream, eventually, metric};

/// `/exact` fails open (`allow`), `/strict` closed (`deny`), `/local`
/// counts in this instance's memory (`local`); each allows 10 per hour per
/// client address.
fn rules() -> String {
    [("exact", "allow"), ("strict", "deny"), ("local", "local")]
        .map(|(name, on_error)| hourly_rule(name, "fixed_window", 10, &format!("on_error = \"{on_error}\"")))
        .concat()
}

const PAUSE: Duration = Duration::from_secs(10);

fn node(port: u16) -> String {
    format!("127.0.0.1:{port}")
}

async fn node_up(tg: &Tollgate, port: u16) -> Option<f64> {
    metric(&tg.metrics().await, "tollgate_store_node_up", &[("node", &node(port))])
}

fn admitted(statuses: &[u16]) -> usize {
    statuses.iter().filter(|&&s| s == 200).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_master_fails_only_its_own_keys() {
    let own = OwnCluster::start().await;
    let cluster = own.cluster.clone();
    // No leases: every request asks its key's master.
    let tg = own.tollgate("on_error = \"allow\"\nlease_percent = 0", &rules()).await;
    // An idle instance failing closed by default: it sees the paused master
    // only through its admin endpoints' probes.
    let closed = own.tollgate("on_error = \"deny\"\nlease_percent = 0", &rules()).await;

    let masters = cluster.masters();
    let (victim, healthy) = (masters[0], masters[1..].to_vec());
    let on = |rule: &str, port: u16, nth: usize| ip_on_master(&cluster, rule, port, nth);
    let (exact_ok, strict_ok) = (on("exact", healthy[0], 0), on("strict", healthy[1], 0));
    let (exact_paused, strict_paused) = (on("exact", victim, 7), on("strict", victim, 7));
    // Every master known and answering before the pause (these addresses
    // are not the ones spent below).
    for &m in &masters {
        for rule in ["exact", "strict"] {
            let ip = on(rule, m, 5);
            assert_eq!(tg.get(&format!("/{rule}")).from_ip(&ip).send().await.status, 200);
        }
    }
    let local_ip = on("local", victim, 0);
    let victim_ips: Vec<(String, String)> = (0..4).map(|n| (on("exact", victim, n), on("strict", victim, n))).collect();
    let mut up_before = Vec::new();
    for &m in &masters {
        up_before.push(node_up(&tg, m).await);
    }

    assert_eq!(cluster.cli(victim, &["CLIENT", "PAUSE", &PAUSE.as_millis().to_string(), "ALL"]).trim(), "OK");
    let paused_at = Instant::now();
    // Until shortly before the pause ends; three loops at once, so that
    // the slow answers of the paused master do not hold up the others.
    let pausing = || paused_at.elapsed() < PAUSE - Duration::from_millis(2500);
    let spend = |a: String, b: String, spacing: Duration| {
        let tg = &tg;
        async move {
            let (mut first, mut second) = (Vec::new(), Vec::new());
            while pausing() {
                first.push(tg.get("/exact").from_ip(&a).send().await.status.as_u16());
                second.push(tg.get("/strict").from_ip(&b).send().await.status.as_u16());
                tokio::time::sleep(spacing).await;
            }
            (first, second)
        }
    };
    // Several clients of the paused master at once, as under real load.
    let load = futures::future::join_all(victim_ips.into_iter().map(|(a, b)| spend(a, b, Duration::from_millis(1))));
    let watch = async {
        let (mut healthy_seen_down, mut victim_seen_down) = (Vec::new(), false);
        while pausing() {
            for &m in &healthy {
                if node_up(&tg, m).await != Some(1.0) {
                    healthy_seen_down.push(m);
                }
            }
            victim_seen_down |= node_up(&tg, victim).await == Some(0.0);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        (healthy_seen_down, victim_seen_down)
    };
    let ((ok, strict), load, (healthy_seen_down, victim_seen_down)) =
        tokio::join!(spend(exact_ok.clone(), strict_ok.clone(), Duration::from_millis(250)), load, watch);
    let paused: Vec<u16> = load.iter().flat_map(|(p, _)| p.clone()).collect();
    let strict_down: Vec<u16> = load.iter().flat_map(|(_, s)| s.clone()).collect();
    let metrics = tg.metrics().await;
    let to_local =
        metric(&metrics, "tollgate_store_fallback_transitions_total", &[("direction", "to_local")]).unwrap_or(0.0);

    println!(
        "healthy master: {} of {} admitted by allow, {} of {} by deny; paused master: {} requests; {to_local} switches to local",
        admitted(&ok),
        ok.len(),
        admitted(&strict),
        strict.len(),
        paused.len() + strict_down.len()
    );
    assert!(ok.len() > 10, "more requests than the limit: {ok:?}");
    assert_eq!(admitted(&ok), 10, "a key on a healthy master is exact: {ok:?}");
    assert!(ok[10..].iter().all(|&s| s == 429), "{ok:?}");
    assert_eq!(admitted(&strict), 10, "deny does not refuse keys on healthy masters: {strict:?}");
    assert!(strict[10..].iter().all(|&s| s == 429), "{strict:?}");
    assert_eq!(up_before, vec![Some(1.0); 3], "every master is up before the pause");
    assert!(healthy_seen_down.is_empty(), "healthy masters reported down: {healthy_seen_down:?}");
    assert!(victim_seen_down, "the paused master is reported down");
    assert_eq!(to_local, 1.0, "one switch, for the paused master alone (no flapping)");
    assert_eq!(metric(&metrics, "tollgate_store_degraded", &[]), Some(1.0), "a node is down");
    // The paused master's keys follow their policy.
    assert!(paused.iter().all(|&s| s == 200), "allow: {paused:?}");
    assert!(strict_down.iter().all(|&s| s == 503), "deny: {strict_down:?}");

    // Once it is down, its keys are answered without a call to Redis.
    let calls = || async { metric(&tg.metrics().await, "tollgate_redis_calls_total", &[]).unwrap_or(0.0) };
    let before = calls().await;
    for _ in 0..3 {
        assert_eq!(tg.get("/exact").from_ip(&exact_paused).send().await.status, 200);
        assert_eq!(tg.get("/strict").from_ip(&strict_paused).send().await.status, 503);
    }
    // `local`: the limit, counted in this instance's memory.
    let local = support::statuses(12, || tg.get("/local").from_ip(&local_ip)).await;
    assert_eq!(local, support::expect_statuses(10, 200, 2, 429), "local");
    assert_eq!(calls().await, before, "no call to the paused master while it is down");
    let health = tg.admin("/healthz/store").await;
    assert_eq!(health.status, 503, "{}", health.text());
    assert_eq!(health.json()["nodes_down"], serde_json::json!([node(victim)]), "{}", health.text());
    assert_eq!(tg.admin("/readyz").await.status, 200, "on_error = allow: ready");
    // With deny, still ready: the other masters answer, and every replica
    // sees the same master down (taking them all out would refuse every key).
    let ready = closed.admin("/readyz").await;
    assert_eq!(ready.status, 200, "{}", ready.text());
    assert_eq!(ready.json()["nodes_down"], serde_json::json!([node(victim)]), "{}", ready.text());
    let health = closed.admin("/healthz/store").await;
    assert_eq!((health.status.as_u16(), health.json()["status"].clone()), (503, "partial".into()), "{}", health.text());

    // The pause ends: the probe takes the master back, its keys count in
    // Redis again.
    eventually("the paused master back up", || async { node_up(&tg, victim).await == Some(1.0) }).await;
    let metrics = tg.metrics().await;
    assert_eq!(metric(&metrics, "tollgate_store_degraded", &[]), Some(0.0));
    assert_eq!(metric(&metrics, "tollgate_store_fallback_transitions_total", &[("direction", "to_store")]), Some(1.0));
    assert_eq!(tg.admin("/healthz/store").await.status, 200);
    let fresh = on("exact", victim, 9);
    for _ in 0..3 {
        assert_eq!(tg.get("/exact").from_ip(&fresh).send().await.status, 200);
    }
    let key = format!("tollgate:{{exact|ip={fresh}}}:fw2");
    let count = cluster.cli(victim, &window(&key));
    let errors = metric(&tg.metrics().await, "tollgate_store_errors_total", &[("backend", "redis")]);
    assert!(count.trim().ends_with(":3"), "counted on the master again: {count:?}, errors {errors:?}");
}

/// A concurrency slot's renewal that fails (its node paused across it) is
/// tried again at the next tick of the renewal task, not a third of the
/// slot TTL later: a pause across two renewals must not lose the slot of a
/// request still running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_slot_renewal_is_retried_at_the_next_tick() {
    // Renewed every 2 s; the pause below spans the renewals due at 2 s and
    // 4 s after the take, and ends 1.5 s before the slot would expire.
    const TTL: Duration = Duration::from_secs(6);
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let rules =
        "[[rule]]\nname = \"held\"\nkey = [\"ip\"]\nalgorithm = \"concurrency\"\nlimit = 1\nslot_ttl = \"6s\"\n";
    let store = "timeout = \"300ms\"\non_error = \"deny\"";
    let tg = Tollgate::with(&tollgate_config(up.addr, &redis.url(), store), &[("rules.toml", rules)]).await;
    let ip = "203.0.113.30";
    let running = tokio::spawn(tg.get("/").from_ip(ip).header("x-echo-hold", "1").send());
    up.wait_held(1).await;
    let taken = Instant::now();

    tokio::time::sleep_until((taken + Duration::from_millis(1500)).into()).await;
    assert_eq!(redis.cli(&["CLIENT", "PAUSE", "3000", "ALL"]).trim(), "OK");
    // Past the moment the slot would have expired without a renewal.
    tokio::time::sleep_until((taken + TTL + Duration::from_secs(1)).into()).await;
    let reply = tg.get("/").from_ip(ip).send().await;
    assert_eq!(reply.status, 429, "the running request still holds its slot: {}", reply.text());
    let lost = metric(&tg.metrics().await, "tollgate_concurrency_slots_lost_total", &[]);
    assert_eq!(lost, Some(0.0), "no slot lost");
    let key = format!("tollgate:{{held|ip={ip}}}:cc");
    assert_eq!(redis.cli(&["ZCARD", &key]).trim(), "1");

    up.release(1);
    assert_eq!(running.await.expect("request task").status, 200);
}
