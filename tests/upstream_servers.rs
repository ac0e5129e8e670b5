//! Upstreams with several servers (`servers`, `balance`, `hash_key`,
//! `health_check`): balancing, passive and active health, retries on
//! another server, and their metrics, against real servers that can be
//! killed and started again on the same port.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use support::{Tollgate, Upstream, eventually, metric};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tollgate::config::Config;

/// A server of an upstream: answers `{"server": name}` to everything, and
/// `/healthz` with 200 or, while `sick`, 503. Killing it closes its listener
/// and every connection it has; it can start again on the same address.
struct Backend {
    name: &'static str,
    addr: SocketAddr,
    state: Arc<BackendState>,
    task: JoinHandle<()>,
}

struct BackendState {
    /// Requests received, health checks aside.
    hits: AtomicUsize,
    /// Requests waiting for `release` (while `holding`).
    held: AtomicUsize,
    holding: AtomicBool,
    gate: Semaphore,
    /// Close the connection without answering (the request reached it).
    resetting: AtomicBool,
    /// `/healthz` answers 503.
    sick: AtomicBool,
}

impl Default for BackendState {
    fn default() -> Self {
        BackendState {
            hits: AtomicUsize::new(0),
            held: AtomicUsize::new(0),
            holding: AtomicBool::new(false),
            gate: Semaphore::new(0),
            resetting: AtomicBool::new(false),
            sick: AtomicBool::new(false),
        }
    }
}

impl Backend {
    async fn start(name: &'static str) -> Backend {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        Backend::serve(name, listener, Arc::new(BackendState::default()))
    }

    fn serve(name: &'static str, listener: TcpListener, state: Arc<BackendState>) -> Backend {
        let addr = listener.local_addr().expect("address");
        let task = tokio::spawn({
            let state = state.clone();
            async move {
                // Owned by this task: aborting it aborts every connection.
                let mut conns = tokio::task::JoinSet::new();
                loop {
                    let Ok((stream, _)) = listener.accept().await else { continue };
                    let state = state.clone();
                    conns.spawn(async move {
                        let svc = service_fn(move |req| answer(name, req, state.clone()));
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), svc)
                            .await;
                    });
                }
            }
        });
        Backend { name, addr, state, task }
    }

    /// Closes the listener and every connection, as a crashed process would.
    async fn kill(&self) {
        self.task.abort();
        // Until the task is gone, its listener still accepts.
        while !self.task.is_finished() {
            tokio::task::yield_now().await;
        }
    }

    /// Starts again on the same address, with the same counters.
    async fn restart(&mut self) {
        let listener = TcpListener::bind(self.addr).await.expect("bind the same address again");
        *self = Backend::serve(self.name, listener, self.state.clone());
    }

    fn hits(&self) -> usize {
        self.state.hits.load(Ordering::SeqCst)
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn answer(
    name: &'static str,
    req: Request<Incoming>,
    state: Arc<BackendState>,
) -> Result<Response<Full<Bytes>>, std::io::Error> {
    if req.uri().path() == "/healthz" {
        let status = if state.sick.load(Ordering::SeqCst) { 503 } else { 200 };
        let mut resp = Response::new(Full::new(Bytes::new()));
        *resp.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
        return Ok(resp);
    }
    state.hits.fetch_add(1, Ordering::SeqCst);
    let _ = req.into_body().collect().await;
    if state.holding.load(Ordering::SeqCst) {
        state.held.fetch_add(1, Ordering::SeqCst);
        if let Ok(p) = state.gate.acquire().await {
            p.forget();
        }
        state.held.fetch_sub(1, Ordering::SeqCst);
    }
    if state.resetting.load(Ordering::SeqCst) {
        return Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "told to reset"));
    }
    Ok(Response::new(Full::new(Bytes::from(format!("{{\"server\":\"{name}\"}}")))))
}

/// The main config with one upstream `svc` made of `servers`, and `extra`
/// lines in its table.
fn config(servers: &[String], extra: &str) -> String {
    let list: Vec<String> = servers.iter().map(|s| format!("{s:?}")).collect();
    support::upstream_config(&format!("servers = [{}]", list.join(", ")), extra)
}

async fn tollgate(servers: &[&Backend], extra: &str) -> Tollgate {
    let urls: Vec<String> = servers.iter().map(|b| b.url()).collect();
    Tollgate::with(&config(&urls, extra), &[]).await
}

/// Which server answered.
fn server_of(reply: &support::Reply) -> String {
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply.json()["server"].as_str().expect("a server name").to_string()
}

fn server_metric(text: &str, name: &str, b: &Backend) -> f64 {
    metric(text, name, &[("upstream", "svc"), ("server", &b.url())]).unwrap_or(-1.0)
}

const FAST_CHECKS: &str =
    r#"health_check = { path = "/healthz", interval = "100ms", timeout = "100ms", healthy = 2, unhealthy = 2 }"#;

#[tokio::test]
async fn round_robin_spreads_requests_evenly() {
    let (a, b, c) = (Backend::start("a").await, Backend::start("b").await, Backend::start("c").await);
    let tg = tollgate(&[&a, &b, &c], "").await;
    for _ in 0..30 {
        assert_eq!(tg.get("/").send().await.status, 200);
    }
    assert_eq!((a.hits(), b.hits(), c.hits()), (10, 10, 10));
    let m = tg.metrics().await;
    for s in [&a, &b, &c] {
        assert_eq!(server_metric(&m, "tollgate_upstream_server_requests_total", s), 10.0);
        assert_eq!(server_metric(&m, "tollgate_upstream_server_failures_total", s), 0.0);
        assert_eq!(server_metric(&m, "tollgate_upstream_server_inflight", s), 0.0);
        assert_eq!(server_metric(&m, "tollgate_upstream_server_healthy", s), 1.0);
    }
}

#[tokio::test]
async fn least_request_prefers_the_idle_server() {
    let (busy, idle) = (Backend::start("busy").await, Backend::start("idle").await);
    busy.state.holding.store(true, Ordering::SeqCst);
    let tg = tollgate(&[&busy, &idle], r#"balance = "least_request""#).await;
    let mut pending = Vec::new();
    for i in 1..=20 {
        let call = tg.get("/");
        pending.push(tokio::spawn(call.send()));
        // One at a time: each request sees the previous ones' in-flight
        // counts.
        eventually("the request reached a server", || async {
            busy.state.held.load(Ordering::SeqCst) + idle.hits() == i
        })
        .await;
    }
    // Only a tie (nothing in flight anywhere) can go to the busy server.
    assert!(busy.hits() <= 1, "{} requests went to the busy server", busy.hits());
    let held = busy.state.held.load(Ordering::SeqCst) as f64;
    let m = tg.metrics().await;
    assert_eq!(server_metric(&m, "tollgate_upstream_server_inflight", &busy), held);
    assert_eq!(server_metric(&m, "tollgate_upstream_server_inflight", &idle), 0.0);
    busy.state.gate.add_permits(20);
    for p in pending {
        assert_eq!(p.await.expect("request task").status, 200);
    }
}

#[tokio::test]
async fn hash_keeps_a_key_on_one_server() {
    let (a, b, c) = (Backend::start("a").await, Backend::start("b").await, Backend::start("c").await);
    let tg = tollgate(&[&a, &b, &c], "balance = \"hash\"\nhash_key = \"header:x-user\"").await;
    let mut owner: BTreeMap<String, String> = BTreeMap::new();
    for round in 0..4 {
        for user in 0..12 {
            let user = format!("user-{user}");
            let s = server_of(&tg.get("/").header("x-user", &user).send().await);
            if round == 0 {
                owner.insert(user, s);
            } else {
                assert_eq!(owner[&user], s, "{user} moved");
            }
        }
    }
    let used: BTreeSet<&String> = owner.values().collect();
    assert!(used.len() >= 2, "12 keys all on one server: {owner:?}");
    // Without the header there is no key: balanced round robin, not all
    // on one server.
    let none: BTreeSet<String> = futures_all(&tg, 6).await;
    assert_eq!(none.len(), 3, "{none:?}");

    // By client address too.
    let tg = tollgate(&[&a, &b, &c], "balance = \"hash\"\nhash_key = \"ip\"").await;
    for ip in ["10.0.0.1", "10.0.0.2", "2001:db8::1"] {
        let first = server_of(&tg.get("/").from_ip(ip).send().await);
        for _ in 0..3 {
            assert_eq!(server_of(&tg.get("/").from_ip(ip).send().await), first);
        }
    }
}

async fn futures_all(tg: &Tollgate, n: usize) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for _ in 0..n {
        out.insert(server_of(&tg.get("/").send().await));
    }
    out
}

#[tokio::test]
async fn a_killed_server_fails_no_request_and_is_back_in_when_it_returns() {
    let (a, mut b, c) = (Backend::start("a").await, Backend::start("b").await, Backend::start("c").await);
    let tg = Arc::new(tollgate(&[&a, &b, &c], FAST_CHECKS).await);
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for _ in 0..4 {
        let (tg, stop, sent) = (tg.clone(), stop.clone(), sent.clone());
        workers.push(tokio::spawn(async move {
            let mut statuses = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                statuses.push(tg.get("/").send().await.status.as_u16());
                sent.fetch_add(1, Ordering::SeqCst);
            }
            statuses
        }));
    }
    eventually("load reaches b", || async { b.hits() >= 20 }).await;
    b.kill().await;
    let at_kill = sent.load(Ordering::SeqCst);
    eventually("the load goes on", || async { sent.load(Ordering::SeqCst) >= at_kill + 100 }).await;
    stop.store(true, Ordering::SeqCst);
    let mut statuses = Vec::new();
    for w in workers {
        statuses.extend(w.await.expect("worker"));
    }
    // GETs that were in flight on b when it died are sent again to another
    // server: not one request fails.
    let failed: Vec<&u16> = statuses.iter().filter(|s| **s != 200).collect();
    assert!(failed.is_empty(), "{} of {} requests failed: {failed:?}", failed.len(), statuses.len());

    // Taken out: it gets no more requests.
    eventually("b is taken out", || async {
        server_metric(&tg.metrics().await, "tollgate_upstream_server_healthy", &b) == 0.0
    })
    .await;
    let before = server_metric(&tg.metrics().await, "tollgate_upstream_server_requests_total", &b);
    for _ in 0..20 {
        assert_eq!(tg.get("/").send().await.status, 200);
    }
    let m = tg.metrics().await;
    assert_eq!(server_metric(&m, "tollgate_upstream_server_requests_total", &b), before);
    assert!(server_metric(&m, "tollgate_upstream_server_failures_total", &b) >= 1.0);

    // Back: two good checks in a row bring it back in.
    let hits = b.hits();
    b.restart().await;
    eventually("b is back in", || async {
        server_metric(&tg.metrics().await, "tollgate_upstream_server_healthy", &b) == 1.0
    })
    .await;
    for _ in 0..9 {
        assert_eq!(tg.get("/").send().await.status, 200);
    }
    assert_eq!(b.hits(), hits + 3, "round robin over three servers again");
}

#[tokio::test]
async fn posts_in_flight_on_a_killed_server_are_the_only_requests_that_fail() {
    let (a, b, c) = (Backend::start("a").await, Backend::start("b").await, Backend::start("c").await);
    // b holds every request it gets: the workers end up waiting on it, one
    // request each.
    b.state.holding.store(true, Ordering::SeqCst);
    let tg = Arc::new(tollgate(&[&a, &b, &c], "").await);
    const WORKERS: usize = 4;
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for w in 0..WORKERS {
        let (tg, stop, sent) = (tg.clone(), stop.clone(), sent.clone());
        workers.push(tokio::spawn(async move {
            let mut statuses = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let reply = tg.call("POST", "/orders").body(format!("worker={w}")).send().await;
                statuses.push(reply.status.as_u16());
                sent.fetch_add(1, Ordering::SeqCst);
            }
            statuses
        }));
    }
    eventually("every worker waits on b", || async { b.state.held.load(Ordering::SeqCst) == WORKERS }).await;
    let at_kill = sent.load(Ordering::SeqCst);
    b.kill().await;
    eventually("the load goes on", || async { sent.load(Ordering::SeqCst) >= at_kill + 100 }).await;
    stop.store(true, Ordering::SeqCst);
    let mut statuses = Vec::new();
    for w in workers {
        statuses.extend(w.await.expect("worker"));
    }
    // Their bytes reached b: not sent again, 502. Every other POST, before
    // and after (b is out once they failed), succeeds.
    let failed: Vec<&u16> = statuses.iter().filter(|s| **s != 200).collect();
    assert_eq!(failed, [&502; WORKERS], "of {} requests", statuses.len());
    assert_eq!(b.hits(), WORKERS);
}

#[tokio::test]
async fn a_server_failing_its_health_check_is_taken_out_and_back_in() {
    let (a, b) = (Backend::start("a").await, Backend::start("b").await);
    let tg = tollgate(&[&a, &b], FAST_CHECKS).await;
    // It still answers requests: only the check takes it out.
    b.state.sick.store(true, Ordering::SeqCst);
    eventually("b is taken out", || async {
        server_metric(&tg.metrics().await, "tollgate_upstream_server_healthy", &b) == 0.0
    })
    .await;
    let before = b.hits();
    for _ in 0..10 {
        assert_eq!(server_of(&tg.get("/").send().await), "a");
    }
    assert_eq!(b.hits(), before);
    b.state.sick.store(false, Ordering::SeqCst);
    eventually("b is back in", || async {
        server_metric(&tg.metrics().await, "tollgate_upstream_server_healthy", &b) == 1.0
    })
    .await;
    let served: BTreeSet<String> = futures_all(&tg, 4).await;
    assert!(served.contains("b"), "{served:?}");
}

#[tokio::test]
async fn a_post_whose_bytes_reached_a_server_is_not_retried_a_get_is() {
    // Round robin starts at the first server: the resetting one.
    let (bad, good) = (Backend::start("bad").await, Backend::start("good").await);
    bad.state.resetting.store(true, Ordering::SeqCst);

    let tg = tollgate(&[&bad, &good], "").await;
    let reply = tg.call("POST", "/").body("order=1").send().await;
    assert_eq!(reply.status, 502, "{}", reply.text());
    assert_eq!((bad.hits(), good.hits()), (1, 0), "the POST went to one server only");

    let tg = tollgate(&[&bad, &good], "").await;
    let reply = tg.get("/").send().await;
    assert_eq!(server_of(&reply), "good");
    assert_eq!((bad.hits(), good.hits()), (2, 1), "the GET went to both");

    // A bodiless request with a non-idempotent method is not sent twice
    // either.
    let tg = tollgate(&[&bad, &good], "").await;
    assert_eq!(tg.call("POST", "/").send().await.status, 502);
    assert_eq!((bad.hits(), good.hits()), (3, 1));
}

#[tokio::test]
async fn a_request_that_failed_to_connect_is_retried_whatever_its_method() {
    let good = Backend::start("good").await;
    let refusing = format!("http://{}", Upstream::refusing_addr().await);
    let tg = Tollgate::with(&config(&[refusing.clone(), good.url()], ""), &[]).await;
    let reply = tg.call("POST", "/").body("order=1").send().await;
    assert_eq!(server_of(&reply), "good");
    let m = tg.metrics().await;
    let labels = [("upstream", "svc"), ("server", refusing.as_str())];
    assert_eq!(metric(&m, "tollgate_upstream_server_failures_total", &labels), Some(1.0));
    // One failure is not enough to take it out (eject_after, default 5).
    assert_eq!(metric(&m, "tollgate_upstream_server_healthy", &labels), Some(1.0));
    assert_eq!(metric(&m, "tollgate_upstream_retries_total", &[("upstream", "svc")]), Some(1.0));
}

#[tokio::test]
async fn every_server_down_is_a_502_in_json_after_trying_each_and_counted() {
    let servers =
        [format!("http://{}", Upstream::refusing_addr().await), format!("http://{}", Upstream::refusing_addr().await)];
    let tg = Tollgate::with(&config(&servers, "eject_after = 1"), &[]).await;
    // Both refuse: the first request tries one, then the other. Passive
    // health takes out at most half of them (one): the other stays in and
    // keeps getting requests, answered 502; never a 503 that stops trying.
    for _ in 0..6 {
        let reply = tg.get("/").send().await;
        assert_eq!(reply.status, 502);
        assert_eq!(reply.header("content-type"), Some("application/json"));
        assert_eq!(reply.json()["error"], "bad_gateway");
    }
    let m = tg.metrics().await;
    let total: f64 = servers
        .iter()
        .map(|s| metric(&m, "tollgate_upstream_server_requests_total", &[("upstream", "svc"), ("server", s)]))
        .map(|v| v.unwrap_or(0.0))
        .sum();
    let retries = metric(&m, "tollgate_upstream_retries_total", &[("upstream", "svc")]).unwrap_or(0.0);
    assert!(retries >= 1.0, "the first request was tried on both");
    assert_eq!(total, 6.0 + retries, "a try per request, and one per retry");
    let healthy: f64 = servers
        .iter()
        .map(|s| metric(&m, "tollgate_upstream_server_healthy", &[("upstream", "svc"), ("server", s)]))
        .map(|v| v.unwrap_or(-1.0))
        .sum();
    assert_eq!(healthy, 1.0, "one of the two taken out, never both");
}

fn errors(upstream: &str) -> Vec<String> {
    let text = format!("[[upstream]]\n{upstream}\n");
    match Config::parse(Path::new("t.toml"), &text) {
        Ok(_) => Vec::new(),
        Err(e) => e.0.iter().map(ToString::to_string).collect(),
    }
}

#[test]
fn config_errors_point_at_the_place() {
    assert_eq!(
        errors("name = \"a\"\nurl = \"http://a\"\nservers = [\"http://b\"]"),
        ["t.toml:4:11: an upstream has either url or servers, not both"]
    );
    assert_eq!(errors("name = \"a\""), ["t.toml:1:1: upstream \"a\" needs url = \"...\" or servers = [\"...\", ...]"]);
    assert_eq!(
        errors("name = \"a\"\nservers = [\"http://b\", \"http://c\"]\nbalance = \"hash\""),
        ["t.toml:4:11: balance = \"hash\" needs hash_key = \"ip\" or \"header:NAME\""]
    );
    assert_eq!(
        errors("name = \"a\"\nservers = [\"http://b\"]\nbalance = \"hash\"\nhash_key = \"cookie\""),
        ["t.toml:5:12: hash_key \"cookie\" must be \"ip\" or \"header:NAME\""]
    );
    assert_eq!(
        errors("name = \"a\"\nservers = [\"http://b\"]\nbalance = \"random\""),
        ["t.toml:4:11: balance \"random\" must be \"round_robin\", \"least_request\" or \"hash\""]
    );
    assert_eq!(
        errors("name = \"a\"\nservers = [\"http://b\", \"ftp://c\"]"),
        ["t.toml:3:24: upstream servers are http:// or https://"]
    );
    assert_eq!(
        errors("name = \"a\"\nservers = [\"http://b\", \"https://c\"]"),
        ["t.toml:3:24: every server of an upstream must use the same scheme"]
    );
    assert_eq!(
        errors("name = \"a\"\nurl = \"http://b\"\ntls_ca_file = \"ca.pem\""),
        ["t.toml:4:15: tls_* keys are for https:// upstream servers"]
    );
    assert_eq!(
        errors("name = \"a\"\nurl = \"https://b\"\ntls_cert_file = \"c.pem\""),
        ["t.toml:4:17: tls_cert_file and tls_key_file go together"]
    );
    assert_eq!(
        errors("name = \"a\"\nurl = \"http://b\"\nprotocol = \"h3\""),
        ["t.toml:4:12: upstream protocol \"h3\" is not \"http/1.1\" or \"h2\""]
    );
    assert_eq!(
        errors("name = \"a\"\nservers = [\"http://b\"]\nhealth_check = { path = \"healthz\", healthy = 0 }"),
        [
            "t.toml:4:25: health_check path \"healthz\" must start with '/'",
            "t.toml:4:46: health_check.healthy must be between 1 and 100",
        ]
    );
    let interval = errors("name = \"a\"\nurl = \"http://b\"\nhealth_check = { path = \"/h\", interval = \"soon\" }");
    assert!(
        interval.len() == 1 && interval[0].starts_with("t.toml:4:42: health_check.interval \"soon\" is not a duration"),
        "{interval:?}"
    );
    assert_eq!(
        errors("name = \"a\"\nservers = [\"http://b\"]\nhealth_check = { path = \"/h\", retries = 1 }"),
        [
            "t.toml:4:31: unknown field `retries`, expected one of `path`, `interval`, `timeout`, `healthy`, `unhealthy`, `host`, `expect_status`"
        ]
    );
    assert!(errors("name = \"a\"\nservers = [\"http://b:1\", \"http://c:2\"]\nbalance = \"least_request\"").is_empty());
}
