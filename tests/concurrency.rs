//! `algorithm = "concurrency"` end to end: at most `limit` requests of a
//! key in flight, a slot given back when the response body ends, when the
//! client goes away (mid-body or before the answer), after an upstream
//! timeout, and when another rule rejects the request; on the memory store
//! and on a real Redis Cluster shared by two instances, where the slots of
//! an instance killed with requests in flight come back within the slot TTL
//! (and not before); with Redis down, `on_error = "local"` holds the slots
//! in memory, and a shutdown gives back the slots of the requests its drain
//! cuts.

use crate::support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::StatusCode;
use http_body_util::BodyExt;
use support::redis::{RedisCluster, RedisServer, tollgate_config};
use support::{Call, Reply, Tollgate, Upstream, config, eventually};
use tokio::task::JoinHandle;

fn rules(limit: u64, extra: &str) -> String {
    format!("[[rule]]\nname = \"in-flight\"\nkey = [\"ip\"]\nalgorithm = \"concurrency\"\nlimit = {limit}\n{extra}")
}

/// A request from `ip` that the upstream holds until released.
fn held(addr: SocketAddr, ip: &str) -> JoinHandle<Reply> {
    let call = Call::new("GET", addr, "/").from_ip(ip).header("x-echo-hold", "1");
    tokio::spawn(call.send())
}

async fn status(addr: SocketAddr, ip: &str) -> StatusCode {
    Call::new("GET", addr, "/").from_ip(ip).send().await.status
}

/// Waits until a request from `ip` through `addr` is admitted.
async fn admitted_again(addr: SocketAddr, ip: &str) {
    eventually("a slot to come back", || async { status(addr, ip).await == StatusCode::OK }).await;
}

#[tokio::test]
async fn at_most_limit_in_flight_then_429_with_retry_after_1() {
    let up = Upstream::start().await;
    let tg = Tollgate::start(&up, &rules(2, "")).await;
    let ip = "198.51.100.1";
    let first = held(tg.proxy_addr, ip);
    let second = held(tg.proxy_addr, ip);
    up.wait_held(2).await;

    let refused = tg.get("/").from_ip(ip).send().await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(refused.header("ratelimit-policy"), Some(r#""in-flight";q=2;qu="concurrent-requests""#));
    assert_eq!(refused.header("x-ratelimit-limit"), Some("2"));
    assert_eq!(refused.header("x-ratelimit-remaining"), Some("0"));
    let body = refused.json();
    assert_eq!(body["error"], "too_many_requests");
    assert_eq!(body["concurrent"], true);
    assert_eq!(body["retry_after_seconds"], 1);
    assert_eq!(refused.header("x-ratelimit-reset"), Some("1"), "none left: the same hint as Retry-After");
    assert_eq!(up.hits(), 2, "the refused request never reached the upstream");
    let problem = tg.get("/").from_ip(ip).header("accept", "application/problem+json").send().await;
    assert_eq!(problem.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(problem.header("content-type"), Some("application/problem+json"));
    assert_eq!(problem.json()["violated-policies"], serde_json::json!(["in-flight"]));
    assert_eq!(problem.json()["concurrent"], true);

    // Another client has its own slots.
    let other = tg.get("/").from_ip("198.51.100.2").send().await;
    assert_eq!(other.status, StatusCode::OK);
    assert_eq!(other.header("x-ratelimit-remaining"), Some("1"));
    assert_eq!(other.header("x-ratelimit-reset"), Some("0"), "slots left: nothing to wait for");
    assert_eq!(other.header("ratelimit").map(|v| v.starts_with(r#""in-flight";r=1;"#)), Some(true));

    // One ends: its slot is back as soon as its body has ended.
    up.release(1);
    let done = tokio::time::timeout(support::DEADLINE, async {
        tokio::select! {
            r = first => r,
            r = second => r,
        }
    })
    .await
    .expect("a released request ends")
    .expect("request task");
    assert_eq!(done.status, StatusCode::OK);
    let again = tg.get("/").from_ip(ip).send().await;
    assert_eq!(again.status, StatusCode::OK);
    assert_eq!(again.header("x-ratelimit-remaining"), Some("0"), "one still in flight");
    up.release(1);
}

#[tokio::test]
async fn a_client_gone_mid_body_gives_its_slot_back() {
    let up = Upstream::start().await;
    // Request bodies streamed, not read ahead: the upstream streams the
    // request body back, so the response is under way for as long as the
    // client keeps sending.
    let cfg = config(up.addr).replace("upstream = \"svc\"\n", "upstream = \"svc\"\nbuffer_body = 0\n");
    let tg = Tollgate::with(&cfg, &[("rules.toml", &rules(1, ""))]).await;
    let ip = "198.51.100.3";
    let (tx, resp) = tg.call("POST", "/").from_ip(ip).header("x-echo-stream", "1").send_streaming().await;
    assert_eq!(resp.status(), StatusCode::OK);
    tx.send(Bytes::from_static(b"first frame")).await.expect("body frame");
    let mut body = resp.into_body();
    let frame = tokio::time::timeout(support::DEADLINE, body.frame()).await.expect("a frame back");
    assert!(frame.is_some_and(|f| f.is_ok()), "the response body is under way");
    assert_eq!(status(tg.proxy_addr, ip).await, StatusCode::TOO_MANY_REQUESTS, "the stream holds the slot");
    // The client goes away mid-body.
    drop(body);
    drop(tx);
    admitted_again(tg.proxy_addr, ip).await;
}

#[tokio::test]
async fn a_client_gone_before_the_answer_gives_its_slot_back() {
    let up = Upstream::start().await;
    let tg = Tollgate::start(&up, &rules(1, "")).await;
    let ip = "198.51.100.4";
    let waiting = held(tg.proxy_addr, ip);
    up.wait_held(1).await;
    assert_eq!(status(tg.proxy_addr, ip).await, StatusCode::TOO_MANY_REQUESTS);
    waiting.abort();
    admitted_again(tg.proxy_addr, ip).await;
    up.release(1);
}

#[tokio::test]
async fn an_upstream_timeout_gives_its_slot_back() {
    let up = Upstream::start().await;
    let cfg = config(up.addr).replace("timeout = \"10s\"", "timeout = \"300ms\"");
    let tg = Tollgate::with(&cfg, &[("rules.toml", &rules(1, ""))]).await;
    let ip = "198.51.100.5";
    let late = tg.get("/").from_ip(ip).header("x-echo-delay-ms", "5000").send().await;
    assert_eq!(late.status, StatusCode::GATEWAY_TIMEOUT);
    // The upstream is still sleeping on it; the slot is free.
    assert_eq!(status(tg.proxy_addr, ip).await, StatusCode::OK);
}

// ---------------------------------------------------------------------------
// Redis Cluster
// ---------------------------------------------------------------------------

fn cluster() -> &'static RedisCluster {
    static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
    CLUSTER.get_or_init(RedisCluster::start)
}

fn cluster_config(upstream: SocketAddr) -> String {
    tollgate_config(upstream, &cluster().url(), "on_error = \"deny\"")
}

/// Waits until no slot of `ip` under the "in-flight" rule is held in the
/// cluster: a slot is given back by a call this instance makes after the
/// response ended, which may reach Redis after the client saw the end.
async fn slots_given_back(ip: &str) {
    let key = format!("tollgate:{{in-flight|ip={ip}}}:cc");
    eventually("the slots to be given back", || async {
        let Some(port) = cluster().master_of(&key) else { return false };
        cluster().cli(port, &["ZCARD", &key]).trim() == "0"
    })
    .await;
}

#[tokio::test]
async fn two_instances_on_a_cluster_share_the_slots() {
    let up = Upstream::start().await;
    let window = "[[rule]]\nname = \"free-plan\"\nkey = [\"ip\"]\nmatch = { header = { name = \"x-plan\", value = \"free\" } }\nalgorithm = \"fixed_window\"\nlimit = 1\nwindow = \"1h\"\n";
    let rules = format!("{}{window}", rules(3, ""));
    let cfg = cluster_config(up.addr);
    let a = Tollgate::with(&cfg, &[("rules.toml", &rules)]).await;
    let b = Tollgate::with(&cfg, &[("rules.toml", &rules)]).await;
    let ip = "203.0.113.10";
    let mut held_requests = vec![held(a.proxy_addr, ip), held(a.proxy_addr, ip), held(b.proxy_addr, ip)];
    up.wait_held(3).await;
    for tg in [&a, &b] {
        let refused = tg.get("/").from_ip(ip).send().await;
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS, "{:?}", refused.text());
        assert_eq!(refused.header("retry-after"), Some("1"));
    }
    up.release(3);
    for h in held_requests.drain(..) {
        assert_eq!(h.await.expect("request task").status, StatusCode::OK);
    }
    // Given back: three fit again.
    slots_given_back(ip).await;
    held_requests.extend([held(b.proxy_addr, ip), held(b.proxy_addr, ip), held(a.proxy_addr, ip)]);
    up.wait_held(3).await;
    up.release(3);
    for h in held_requests.drain(..) {
        assert_eq!(h.await.expect("request task").status, StatusCode::OK);
    }

    // A request another rule rejects gives back the slot it took: the
    // free plan's one request an hour is spent, and every rejected free
    // request must leave the three slots free.
    let ip = "203.0.113.11";
    assert_eq!(a.get("/").from_ip(ip).header("x-plan", "free").send().await.status, StatusCode::OK);
    for tg in [&a, &b, &a, &b] {
        let refused = tg.get("/").from_ip(ip).header("x-plan", "free").send().await;
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(refused.json()["rule"], "free-plan");
    }
    slots_given_back(ip).await;
    let three = [held(a.proxy_addr, ip), held(b.proxy_addr, ip), held(a.proxy_addr, ip)];
    up.wait_held(3).await;
    up.release(3);
    for h in three {
        assert_eq!(h.await.expect("request task").status, StatusCode::OK);
    }
}

#[tokio::test]
async fn with_redis_down_on_error_local_holds_slots_in_memory() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    let cfg = tollgate_config(up.addr, &redis.url(), "on_error = \"local\"");
    let tg = Tollgate::with(&cfg, &[("rules.toml", &rules(1, ""))]).await;
    let ip = "203.0.113.30";
    assert_eq!(status(tg.proxy_addr, ip).await, StatusCode::OK, "decided by Redis");
    redis.kill();
    let waiting = held(tg.proxy_addr, ip);
    up.wait_held(1).await;
    assert_eq!(status(tg.proxy_addr, ip).await, StatusCode::TOO_MANY_REQUESTS, "the fallback counts in flight");
    up.release(1);
    assert_eq!(waiting.await.expect("request task").status, StatusCode::OK);
    assert_eq!(status(tg.proxy_addr, ip).await, StatusCode::OK, "and gives the slot back there");
}

#[tokio::test]
async fn a_shutdown_gives_back_the_slots_of_the_requests_it_cuts() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    let cfg = tollgate_config(up.addr, &redis.url(), "on_error = \"deny\"")
        .replace("admin = \"127.0.0.1:0\"\n", "admin = \"127.0.0.1:0\"\ndrain_timeout = \"300ms\"\n");
    let rules = rules(1, "");
    let stopping = Tollgate::with(&cfg, &[("rules.toml", &rules)]).await;
    let other = Tollgate::with(&cfg, &[("rules.toml", &rules)]).await;
    let ip = "203.0.113.40";
    let _cut = held(stopping.proxy_addr, ip);
    up.wait_held(1).await;
    assert_eq!(status(other.proxy_addr, ip).await, StatusCode::TOO_MANY_REQUESTS);
    // The drain ends with the request still held at the upstream: it is
    // cut, and its slot goes back at once, not after slot_ttl (10 s).
    let at = Instant::now();
    stopping.stop().await;
    assert_eq!(status(other.proxy_addr, ip).await, StatusCode::OK);
    assert!(at.elapsed() < Duration::from_secs(5), "{:?}", at.elapsed());
    up.release(1);
}

/// A tollgate process; killed on drop if still running.
struct Process {
    child: Child,
    proxy: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The binary with `config` and `rules`, its proxy address read from its
/// JSON log line.
fn spawn(config: &str, rules: &str) -> Process {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::create_dir(dir.path().join("rules")).expect("rules dir");
    std::fs::write(dir.path().join("rules/r.toml"), rules).expect("rules");
    std::fs::write(dir.path().join("tollgate.toml"), config).expect("config");
    let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("--config")
        .arg(dir.path().join("tollgate.toml"))
        .args(["--log-format", "json"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tollgate starts");
    let stderr = child.stderr.take().expect("stderr");
    let mut lines = BufReader::new(stderr).lines();
    let deadline = Instant::now() + Duration::from_secs(20);
    let proxy = loop {
        assert!(Instant::now() < deadline, "no listening line from tollgate");
        let line = lines.next().expect("tollgate exited before listening").expect("log line");
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else { continue };
        if v["fields"]["message"] == "tollgate listening" {
            break v["fields"]["proxy"].as_str().and_then(|s| s.parse().ok()).expect("address in log");
        }
    };
    // Keep draining the log so the process never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines.map_while(Result::ok) {});
    Process { child, proxy, _dir: dir }
}

#[tokio::test]
async fn the_slots_of_a_killed_instance_come_back_within_the_slot_ttl() {
    // Short enough for a test, long enough that a loaded machine still
    // renews in time (every third of it).
    const TTL: Duration = Duration::from_secs(3);
    let up = Upstream::start().await;
    let rules = rules(2, "slot_ttl = \"3s\"\n").replace("in-flight", "survives-crash");
    let cfg = cluster_config(up.addr);
    let doomed = spawn(&cfg, &rules);
    let survivor = Tollgate::with(&cfg, &[("rules.toml", &rules)]).await;
    let ip = "203.0.113.20";
    let _in_flight = [held(doomed.proxy, ip), held(doomed.proxy, ip)];
    up.wait_held(2).await;
    assert_eq!(status(survivor.proxy_addr, ip).await, StatusCode::TOO_MANY_REQUESTS);

    // Renewed while the requests run: well past the TTL, still held.
    tokio::time::sleep(TTL * 2).await;
    assert_eq!(
        status(survivor.proxy_addr, ip).await,
        StatusCode::TOO_MANY_REQUESTS,
        "the slots of running requests must not expire"
    );

    // Killed with both requests in flight: nothing gives the slots back
    // but their expiry.
    let killed = Command::new("kill").args(["-s", "KILL", &doomed.child.id().to_string()]).status();
    assert!(killed.expect("kill runs").success());
    let at = Instant::now();
    eventually("the killed instance's slots to expire", || async {
        status(survivor.proxy_addr, ip).await == StatusCode::OK
    })
    .await;
    let took = at.elapsed();
    assert!(took <= TTL + Duration::from_secs(2), "slots came back after {took:?}, TTL {TTL:?}");
    // By their expiry, not at once: renewed a third of a TTL before the
    // kill at most, they had most of a TTL left.
    assert!(took >= TTL / 3, "slots came back after only {took:?}");
    // Both of them.
    let two = [held(survivor.proxy_addr, ip), held(survivor.proxy_addr, ip)];
    up.wait_held(4).await;
    assert_eq!(status(survivor.proxy_addr, ip).await, StatusCode::TOO_MANY_REQUESTS);
    up.release(4);
    for h in two {
        assert_eq!(h.await.expect("request task").status, StatusCode::OK);
    }
}

/// A renewal that finds its slot gone (as after Redis was unreachable for a
/// whole `slot_ttl`; here the key is deleted) counts in
/// `tollgate_concurrency_slots_lost_total`, and the request goes on
/// uncounted: its key has room again while it still runs.
#[tokio::test]
async fn a_slot_found_gone_at_its_renewal_is_counted_as_lost() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    let cfg = tollgate_config(up.addr, &redis.url(), "on_error = \"deny\"");
    // Renewed every second; the TTL leaves a loaded machine time to renew.
    let tg = Tollgate::with(&cfg, &[("rules.toml", &rules(1, "slot_ttl = \"3s\"\n"))]).await;
    let ip = "203.0.113.40";
    let lost = || async { support::metric(&tg.metrics().await, "tollgate_concurrency_slots_lost_total", &[]) };
    let waiting = held(tg.proxy_addr, ip);
    up.wait_held(1).await;
    assert_eq!(status(tg.proxy_addr, ip).await, StatusCode::TOO_MANY_REQUESTS, "the slot is held");
    assert_eq!(lost().await, Some(0.0));
    assert_eq!(redis.cli(&["DEL", &format!("tollgate:{{in-flight|ip={ip}}}:cc")]).trim(), "1", "the slot's key");
    eventually("the lost slot is counted", || async { lost().await == Some(1.0) }).await;
    // The request goes on, uncounted: another fits beside it.
    assert_eq!(status(tg.proxy_addr, ip).await, StatusCode::OK);
    up.release(1);
    assert_eq!(waiting.await.expect("request task").status, StatusCode::OK);
    assert_eq!(lost().await, Some(1.0), "counted once");
}
