//! Servers stay in service unless they are really down: failures in a row
//! before a server is taken out, a cap on servers out, weights and backups,
//! retries, stale keep-alive connections, per-server limits, health check
//! settings and reloads that keep what they can. Real upstreams on
//! loopback, some of them misbehaving on purpose at the TCP level.

use crate::support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use support::{Tollgate, Upstream, eventually, metric, write_atomic};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// The main config with one upstream `svc` whose servers are `servers`
/// (TOML values: quoted URLs or tables), and `extra` lines in its table.
fn config(servers: &[String], extra: &str) -> String {
    support::upstream_config(&format!("servers = [{}]", servers.join(", ")), extra)
}

fn url(addr: SocketAddr) -> String {
    format!("\"http://{addr}\"")
}

fn server_metric(text: &str, name: &str, addr: SocketAddr) -> Option<f64> {
    metric(text, name, &[("upstream", "svc"), ("server", &format!("http://{addr}"))])
}

/// A server that answers the first request of each connection and closes
/// the connection when the next one arrives on it, without answering: a
/// server whose keep-alive timeout fired as the request came.
struct OneShot {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    answered: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl OneShot {
    async fn start() -> OneShot {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let (connections, answered) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let task = tokio::spawn({
            let (connections, answered) = (connections.clone(), answered.clone());
            async move {
                loop {
                    let Ok((mut stream, _)) = listener.accept().await else { continue };
                    connections.fetch_add(1, Ordering::SeqCst);
                    let answered = answered.clone();
                    tokio::spawn(async move {
                        if read_head(&mut stream).await {
                            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
                            answered.fetch_add(1, Ordering::SeqCst);
                        }
                        // The next request: read, then closed unanswered.
                        let _ = read_head(&mut stream).await;
                    });
                }
            }
        });
        OneShot { addr, connections, answered, task }
    }
}

impl Drop for OneShot {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Reads one request head (the tests send no bodies); false at EOF.
async fn read_head(stream: &mut TcpStream) -> bool {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    true
}

#[tokio::test]
async fn a_timeout_on_each_of_two_servers_takes_neither_out() {
    let (a, b) = (Upstream::start().await, Upstream::start().await);
    let text = config(&[url(a.addr), url(b.addr)], "timeout = \"1s\"");
    let tg = Tollgate::with(&text, &[]).await;
    // Two slow requests at once, one per server (round robin).
    let slow = || tg.get("/delay").header("x-echo-delay-ms", "3000").send();
    let (r1, r2) = tokio::join!(slow(), slow());
    assert_eq!((r1.status.as_u16(), r2.status.as_u16()), (504, 504));
    assert_eq!((a.hits(), b.hits()), (1, 1));
    // One timeout each is not a server down: both stay in.
    for _ in 0..5 {
        let reply = tg.get("/get").send().await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    let m = tg.metrics().await;
    assert_eq!(server_metric(&m, "tollgate_upstream_server_healthy", a.addr), Some(1.0));
    assert_eq!(server_metric(&m, "tollgate_upstream_server_healthy", b.addr), Some(1.0));
}

#[tokio::test]
async fn a_server_is_taken_out_after_eject_after_failures_in_a_row_and_never_the_last_one() {
    let good = Upstream::start().await;
    let refusing = Upstream::refusing_addr().await;
    let tg = Tollgate::with(&config(&[url(refusing), url(good.addr)], "eject_after = 3\nretries = 0"), &[]).await;
    // Round robin: every other request goes to the refusing server.
    let mut statuses = Vec::new();
    for _ in 0..6 {
        statuses.push(tg.get("/").send().await.status.as_u16());
    }
    // Its first three tries fail (no retries); the third takes it out.
    assert_eq!(statuses, [502, 200, 502, 200, 502, 200]);
    assert_eq!(server_metric(&tg.metrics().await, "tollgate_upstream_server_healthy", refusing), Some(0.0));
    for _ in 0..6 {
        assert_eq!(tg.get("/").send().await.status, 200);
    }

    // A lone server is never taken out by passive health, however often
    // it fails.
    let lone = Tollgate::with(&config(&[url(refusing)], "eject_after = 1\nmax_inflight = 100"), &[]).await;
    for _ in 0..4 {
        assert_eq!(lone.get("/").send().await.status, 502);
    }
    assert_eq!(server_metric(&lone.metrics().await, "tollgate_upstream_server_healthy", refusing), Some(1.0));
}

#[tokio::test]
async fn a_server_closing_a_keep_alive_connection_as_the_request_arrives_costs_no_request() {
    // One server: the second GET goes out on the pooled connection, which
    // the server closes; it is sent again on a new connection.
    let one = OneShot::start().await;
    let tg = Tollgate::with(&config(&[url(one.addr)], ""), &[]).await;
    for i in 0..2 {
        let reply = tg.get("/").send().await;
        assert_eq!(reply.status, 200, "GET {i}: {}", reply.text());
    }
    assert_eq!(one.answered.load(Ordering::SeqCst), 2);
    assert_eq!(one.connections.load(Ordering::SeqCst), 2);

    // Two such servers: no request fails and neither is taken out.
    let (a, b) = (OneShot::start().await, OneShot::start().await);
    let tg = Tollgate::with(&config(&[url(a.addr), url(b.addr)], ""), &[]).await;
    for i in 0..9 {
        let reply = tg.get("/").send().await;
        assert_eq!(reply.status, 200, "GET {i}: {}", reply.text());
    }
    let m = tg.metrics().await;
    assert_eq!(server_metric(&m, "tollgate_upstream_server_healthy", a.addr), Some(1.0));
    assert_eq!(server_metric(&m, "tollgate_upstream_server_healthy", b.addr), Some(1.0));

    // A POST is not sent twice: the server may have acted on it.
    let one = OneShot::start().await;
    let tg = Tollgate::with(&config(&[url(one.addr)], ""), &[]).await;
    assert_eq!(tg.call("POST", "/").body("x=1").send().await.status, 200);
    assert_eq!(tg.call("POST", "/").body("x=2").send().await.status, 502);
}

#[tokio::test]
async fn weights_share_requests_in_proportion_and_a_backup_waits_until_every_other_server_is_out() {
    let (a, b, backup) = (Upstream::start().await, Upstream::start().await, Upstream::start().await);
    let servers = [
        format!("{{ url = {}, weight = 3 }}", url(a.addr)),
        url(b.addr),
        format!("{{ url = {}, backup = true }}", url(backup.addr)),
    ];
    let tg = Tollgate::with(&config(&servers, ""), &[]).await;
    for _ in 0..40 {
        assert_eq!(tg.get("/").send().await.status, 200);
    }
    assert_eq!((a.hits(), b.hits(), backup.hits()), (30, 10, 0));

    // Both primaries refuse: with max_ejected_percent = 100 both may go
    // out, and then the backup takes the requests.
    let (r1, r2) = (Upstream::refusing_addr().await, Upstream::refusing_addr().await);
    let servers = [url(r1), url(r2), format!("{{ url = {}, backup = true }}", url(backup.addr))];
    let extra = "eject_after = 1\nmax_ejected_percent = 100";
    let tg = Tollgate::with(&config(&servers, extra), &[]).await;
    // The first request tries both primaries (one retry) and fails.
    assert_eq!(tg.get("/").send().await.status, 502);
    for _ in 0..5 {
        assert_eq!(tg.get("/").send().await.status, 200);
    }
    assert_eq!(backup.hits(), 5);
}

#[tokio::test]
async fn with_one_of_three_servers_out_the_other_two_share_its_requests_evenly() {
    let (a, c) = (Upstream::start().await, Upstream::start().await);
    let dead = Upstream::refusing_addr().await;
    let servers = [url(a.addr), url(dead), url(c.addr)];
    let tg = Tollgate::with(&config(&servers, "eject_after = 1\nretries = 0"), &[]).await;
    // a, then the dead server (taken out on its failure), then c.
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(tg.get("/").send().await.status.as_u16());
    }
    assert_eq!(statuses, [200, 502, 200]);
    let (a0, c0) = (a.hits(), c.hits());
    for _ in 0..20 {
        assert_eq!(tg.get("/").send().await.status, 200);
    }
    assert_eq!((a.hits() - a0, c.hits() - c0), (10, 10));
}

#[tokio::test]
async fn hash_by_ip_keeps_an_ipv6_prefix_on_one_server() {
    let (a, b, c) = (Upstream::start().await, Upstream::start().await, Upstream::start().await);
    let servers = [url(a.addr), url(b.addr), url(c.addr)];
    let tg = Tollgate::with(&config(&servers, "balance = \"hash\"\nhash_key = \"ip\""), &[]).await;
    // Twelve addresses of one /64: one client, one server.
    for i in 0..12 {
        let reply = tg.get("/").from_ip(&format!("2001:db8:7:7::{:x}", i * 4099 + 1)).send().await;
        assert_eq!(reply.status, 200);
    }
    let hits = [a.hits(), b.hits(), c.hits()];
    assert!(hits.contains(&12), "{hits:?}");
}

#[tokio::test]
async fn least_request_counts_a_request_until_its_response_body_ends() {
    let (a, b) = (Upstream::start().await, Upstream::start().await);
    let text = config(&[url(a.addr), url(b.addr)], "balance = \"least_request\"")
        .replace("upstream = \"svc\"\n", "upstream = \"svc\"\nbuffer_body = 0\n");
    let tg = Tollgate::with(&text, &[]).await;
    // A response that streams for as long as its request body does (not
    // read ahead: buffer_body = 0).
    let (tx, resp) = tg.call("POST", "/stream").header("x-echo-stream", "1").send_streaming().await;
    assert_eq!(resp.status(), 200);
    let streaming = if a.hits() == 1 { &a } else { &b };
    let idle = if a.hits() == 1 { &b } else { &a };
    let m = tg.metrics().await;
    assert_eq!(server_metric(&m, "tollgate_upstream_server_inflight", streaming.addr), Some(1.0));
    // While it streams, every other request goes to the idle server.
    for _ in 0..10 {
        assert_eq!(tg.get("/").send().await.status, 200);
    }
    assert_eq!((streaming.hits(), idle.hits()), (1, 10));
    drop(tx);
    drop(resp);
    eventually("the stream is answered", || async {
        server_metric(&tg.metrics().await, "tollgate_upstream_server_inflight", streaming.addr) == Some(0.0)
    })
    .await;
}

#[tokio::test]
async fn retries_go_to_further_servers_up_to_the_setting_and_are_counted() {
    let good = Upstream::start().await;
    let (r1, r2) = (Upstream::refusing_addr().await, Upstream::refusing_addr().await);
    let servers = [url(r1), url(r2), url(good.addr)];
    // Round robin starts at the first refusing server: one retry reaches
    // the second, two reach the good one.
    let tg = Tollgate::with(&config(&servers, "retries = 1"), &[]).await;
    assert_eq!(tg.call("POST", "/").body("x").send().await.status, 502);
    let tg = Tollgate::with(&config(&servers, "retries = 2"), &[]).await;
    assert_eq!(tg.call("POST", "/").body("x").send().await.status, 200);
    assert_eq!(good.hits(), 1);
    let m = tg.metrics().await;
    assert_eq!(metric(&m, "tollgate_upstream_retries_total", &[("upstream", "svc")]), Some(2.0));
    let tg = Tollgate::with(&config(&servers, "retries = 0"), &[]).await;
    assert_eq!(tg.call("POST", "/").body("x").send().await.status, 502);
    assert_eq!(metric(&tg.metrics().await, "tollgate_upstream_retries_total", &[("upstream", "svc")]), Some(0.0));
}

#[tokio::test]
async fn a_server_at_max_inflight_takes_no_more_and_then_the_answer_is_503_upstream_busy() {
    let (a, b) = (Upstream::start().await, Upstream::start().await);
    let tg = Arc::new(Tollgate::with(&config(&[url(a.addr), url(b.addr)], "max_inflight = 1"), &[]).await);
    let hold = |tg: Arc<Tollgate>| tokio::spawn(async move { tg.get("/").header("x-echo-hold", "1").send().await });
    let h1 = hold(tg.clone());
    let h2 = hold(tg.clone());
    eventually("both servers hold one", || async { a.held() + b.held() == 2 }).await;
    assert_eq!((a.held(), b.held()), (1, 1));
    let reply = tg.get("/").send().await;
    assert_eq!(reply.status, 503);
    assert_eq!(reply.json()["error"], "upstream_busy");
    assert_eq!(reply.header("retry-after"), Some("1"));
    assert_eq!(metric(&tg.metrics().await, "tollgate_upstream_busy_total", &[("upstream", "svc")]), Some(1.0));
    a.release(1);
    b.release(1);
    assert_eq!(h1.await.expect("held").status, 200);
    assert_eq!(h2.await.expect("held").status, 200);
    assert_eq!(tg.get("/").send().await.status, 200);
}

#[tokio::test]
async fn a_pooled_connection_idle_past_pool_idle_timeout_is_not_reused() {
    let a = Upstream::start().await;
    let tg = Tollgate::with(&config(&[url(a.addr)], "pool_idle_timeout = \"200ms\""), &[]).await;
    assert_eq!(tg.get("/").send().await.status, 200);
    assert_eq!(tg.get("/").send().await.status, 200);
    assert_eq!(a.connections(), 1, "reused while fresh");
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(tg.get("/").send().await.status, 200);
    assert_eq!(a.connections(), 2, "a new connection after the idle timeout");
}

#[tokio::test]
async fn connection_cannot_name_host_or_the_request_id_away() {
    let a = Upstream::start().await;
    let tg = Tollgate::with(&config(&[url(a.addr)], ""), &[]).await;
    let reply = tg
        .get("/")
        .header("host", "shop.example")
        .header("connection", "host, x-request-id, x-drop-me")
        .header("x-drop-me", "1")
        .send()
        .await;
    assert_eq!(reply.status, 200);
    let echo = reply.echo();
    assert_eq!(echo.header("host"), Some("shop.example"));
    assert!(echo.header("x-request-id").is_some_and(|id| !id.is_empty()), "{:?}", echo.headers);
    assert_eq!(echo.header("x-drop-me"), None);
}

#[tokio::test]
async fn an_upstream_tls_handshake_that_never_completes_falls_under_connect_timeout() {
    // Accepts TCP, never speaks TLS.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    let _silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            held.push(s);
        }
    });
    let extra = "connect_timeout = \"200ms\"\ntimeout = \"20s\"";
    let text = config(&[format!("\"https://{addr}\"")], extra);
    let tg = Tollgate::with(&text, &[]).await;
    let started = Instant::now();
    let reply = tg.get("/").send().await;
    assert_eq!(reply.status, 504, "{}", reply.text());
    // Far below the request timeout of 20 s.
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
}

/// A server whose `/healthz` answers `status` and notes the `Host` it got.
struct Checked {
    addr: SocketAddr,
    status: Arc<AtomicU16>,
    hosts: Arc<parking_lot::Mutex<Vec<String>>>,
    task: JoinHandle<()>,
}

impl Checked {
    async fn start(status: u16) -> Checked {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let (status, hosts) = (Arc::new(AtomicU16::new(status)), Arc::new(parking_lot::Mutex::new(Vec::new())));
        let task = tokio::spawn({
            let (status, hosts) = (status.clone(), hosts.clone());
            async move {
                loop {
                    let Ok((mut stream, _)) = listener.accept().await else { continue };
                    let (status, hosts) = (status.clone(), hosts.clone());
                    tokio::spawn(async move {
                        let mut head = Vec::new();
                        let mut buf = [0u8; 1024];
                        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                            match stream.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => head.extend_from_slice(&buf[..n]),
                            }
                        }
                        let text = String::from_utf8_lossy(&head).to_string();
                        let host = text
                            .lines()
                            .find_map(|l| l.strip_prefix("host: ").or_else(|| l.strip_prefix("Host: ")))
                            .unwrap_or("")
                            .to_string();
                        hosts.lock().push(host);
                        let code = status.load(Ordering::SeqCst);
                        let answer = format!("HTTP/1.1 {code} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                        let _ = stream.write_all(answer.as_bytes()).await;
                    });
                }
            }
        });
        Checked { addr, status, hosts, task }
    }
}

impl Drop for Checked {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test]
async fn health_checks_send_their_host_and_pass_on_the_expected_statuses() {
    let (a, b) = (Checked::start(204).await, Checked::start(204).await);
    let check = r#"health_check = { path = "/healthz", interval = "100ms", timeout = "100ms", healthy = 1, unhealthy = 1, host = "health.internal", expect_status = [204] }"#;
    let tg = Tollgate::with(&config(&[url(a.addr), url(b.addr)], check), &[]).await;
    eventually("checks ran", || async { a.hosts.lock().len() >= 3 }).await;
    assert!(a.hosts.lock().iter().all(|h| h == "health.internal"));
    let m = tg.metrics().await;
    assert_eq!(server_metric(&m, "tollgate_upstream_server_healthy", a.addr), Some(1.0));
    // 200 is not in the list: out.
    b.status.store(200, Ordering::SeqCst);
    eventually("b is out on a 200", || async {
        server_metric(&tg.metrics().await, "tollgate_upstream_server_healthy", b.addr) == Some(0.0)
    })
    .await;
}

#[tokio::test]
async fn a_reload_keeps_unchanged_servers_health_and_connections_and_drops_removed_servers_series() {
    let (a, b) = (Upstream::start().await, Upstream::start().await);
    let refusing = Upstream::refusing_addr().await;
    let extra = "eject_after = 1\nretries = 0";
    let tg = Tollgate::with(&config(&[url(a.addr), url(refusing), url(b.addr)], extra), &[]).await;
    let main = tg.dir.path().join("tollgate.toml");
    let mut statuses = BTreeMap::new();
    for _ in 0..3 {
        *statuses.entry(tg.get("/").send().await.status.as_u16()).or_insert(0) += 1;
    }
    assert_eq!(statuses, BTreeMap::from([(200, 2), (502, 1)]));
    assert_eq!(server_metric(&tg.metrics().await, "tollgate_upstream_server_healthy", refusing), Some(0.0));
    let connections = (a.connections(), b.connections());

    // b goes away from the config; a and the refusing server stay as they
    // were, and a new timeout line changes nothing about them.
    write_atomic(&main, &config(&[url(a.addr), url(refusing)], extra));
    tg.reloader.reload_config().expect("the new config loads");
    let m = tg.metrics().await;
    assert_eq!(server_metric(&m, "tollgate_upstream_server_healthy", b.addr), None, "b's series is gone");
    assert_eq!(server_metric(&m, "tollgate_upstream_server_healthy", refusing), Some(0.0), "still out");
    // Every request goes to a, over the connection it had.
    for _ in 0..4 {
        assert_eq!(tg.get("/").send().await.status, 200);
    }
    assert_eq!(a.connections(), connections.0);
}

fn errors(upstream: &str) -> Vec<String> {
    let text = format!("[[upstream]]\nname = \"a\"\n{upstream}\n");
    match tollgate::config::Config::parse(std::path::Path::new("t.toml"), &text) {
        Ok(_) => Vec::new(),
        Err(e) => e.0.iter().map(ToString::to_string).collect(),
    }
}

#[test]
fn new_upstream_settings_are_checked_with_the_place() {
    assert_eq!(
        errors("servers = [{ url = \"http://b\", weight = 0 }]"),
        ["t.toml:3:12: an upstream server's weight must be a whole number between 1 and 1000"]
    );
    assert_eq!(
        errors("servers = [{ url = \"http://b\", primary = true }]"),
        [
            "t.toml:3:12: unknown key \"primary\" in an upstream server: an upstream server is \"http://host:port\" or { url = \"http://host:port\", weight = 2, backup = true }"
        ]
    );
    assert_eq!(
        errors("servers = [{ url = \"http://b\", backup = true }]"),
        ["t.toml:3:12: an upstream needs at least one server that is not a backup"]
    );
    assert_eq!(
        errors("servers = [\"http://b\", 7]"),
        [
            "t.toml:3:24: an upstream server is \"http://host:port\" or { url = \"http://host:port\", weight = 2, backup = true }"
        ]
    );
    assert_eq!(
        errors(
            "url = \"http://b\"\neject_after = 0\nmax_ejected_percent = 101\nretries = 11\nretry_budget_percent = -1"
        ),
        [
            "t.toml:4:15: upstream.eject_after must be between 1 and 1000",
            "t.toml:5:23: upstream.max_ejected_percent must be between 0 and 100",
            "t.toml:6:11: upstream.retries must be between 0 and 10",
            "t.toml:7:24: upstream.retry_budget_percent must be between 0 and 100",
        ]
    );
    assert_eq!(
        errors("url = \"http://b\"\nmax_inflight = 0"),
        ["t.toml:4:16: upstream.max_inflight must be between 1 and 1000000"]
    );
    let idle = errors("url = \"http://b\"\npool_idle_timeout = \"0s\"");
    assert_eq!(idle, ["t.toml:4:21: upstream.pool_idle_timeout must be longer than zero"]);
    assert_eq!(
        errors("url = \"http://b\"\nhealth_check = { path = \"/h\", expect_status = \"2zz\" }"),
        [
            "t.toml:4:47: health_check.expect_status is a status (200), a class (\"2xx\"), a range (\"200-299\") or a list of those"
        ]
    );
    assert_eq!(
        errors("url = \"http://b\"\nhealth_check = { path = \"/h\", host = \"a b\" }"),
        ["t.toml:4:38: health_check.host \"a b\" is not a host name"]
    );
    assert!(
        errors(
            "servers = [{ url = \"http://b\", weight = 3 }, { url = \"http://c\", backup = true }]\nhealth_check = { path = \"/h\", expect_status = [200, \"3xx\", \"400-404\"], host = \"svc.internal\" }"
        )
        .is_empty()
    );
}

/// The open-files limits (soft, hard) of a process, from /proc (Linux).
fn open_files_limits(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("/proc limits");
    let line = limits.lines().find(|l| l.starts_with("Max open files")).expect("an open files line");
    let mut parts = line["Max open files".len()..].split_whitespace();
    (parts.next().unwrap_or_default().to_string(), parts.next().unwrap_or_default().to_string())
}

/// Starts the real binary under `sh` with `ulimit` arguments applied
/// first, and waits for its listening line; returns it and its log.
fn spawn_limited(ulimit: &str, upstream: SocketAddr) -> (std::process::Child, Vec<String>, tempfile::TempDir) {
    use std::io::BufRead;
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::create_dir(dir.path().join("rules")).expect("rules dir");
    std::fs::write(dir.path().join("tollgate.toml"), config(&[url(upstream)], "")).expect("config");
    let mut child = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit {ulimit} && exec \"$0\" --config \"$1\" --log-format json"))
        .arg(env!("CARGO_BIN_EXE_tollgate"))
        .arg(dir.path().join("tollgate.toml"))
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("sh starts tollgate");
    let stderr = child.stderr.take().expect("stderr");
    let mut log = Vec::new();
    for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
        let listening = line.contains("tollgate listening");
        log.push(line);
        if listening {
            break;
        }
    }
    (child, log, dir)
}

#[tokio::test]
async fn the_open_files_soft_limit_is_raised_to_the_hard_limit_and_a_low_hard_limit_is_warned_about() {
    let a = Upstream::start().await;
    let (mut child, _log, _dir) = spawn_limited("-Sn 256", a.addr);
    let (soft, hard) = open_files_limits(child.id());
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(soft, hard, "soft {soft}, hard {hard}");
    assert_ne!(soft, "256");

    // A hard limit below two per connection (max_connections defaults to
    // 10,000): a warning names the limit.
    let (mut child, log, _dir) = spawn_limited("-n 512", a.addr);
    let _ = child.kill();
    let _ = child.wait();
    assert!(log.iter().any(|l| l.contains("open files limit is below") && l.contains("512")), "no warning in {log:?}");
}

#[tokio::test]
async fn an_h2_upstream_connection_on_which_a_request_timed_out_is_replaced() {
    // An h2c server: `/hang` never answers, everything else does; it
    // counts the connections it accepts.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    let connections = Arc::new(AtomicUsize::new(0));
    let _server = tokio::spawn({
        let connections = connections.clone();
        async move {
            while let Ok((stream, _)) = listener.accept().await {
                connections.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(|req: http::Request<hyper::body::Incoming>| async move {
                        if req.uri().path() == "/hang" {
                            std::future::pending::<()>().await;
                        }
                        Ok::<_, std::io::Error>(http::Response::new(http_body_util::Full::new(
                            bytes::Bytes::from_static(b"ok"),
                        )))
                    });
                    let _ = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                        .await;
                });
            }
        }
    });
    let text = config(&[url(addr)], "protocol = \"h2\"\ntimeout = \"300ms\"");
    let tg = Tollgate::with(&text, &[]).await;
    assert_eq!(tg.get("/").send().await.status, 200);
    assert_eq!(tg.get("/").send().await.status, 200);
    assert_eq!(connections.load(Ordering::SeqCst), 1, "one connection carries every request");
    assert_eq!(tg.get("/hang").send().await.status, 504);
    // The connection a request timed out on is not trusted again.
    assert_eq!(tg.get("/").send().await.status, 200);
    assert_eq!(connections.load(Ordering::SeqCst), 2);
}

/// A TCP relay to `to` that can be frozen (it stops moving bytes either
/// way, as a partitioned network does) and counts connections.
struct Relay {
    addr: SocketAddr,
    frozen: Arc<std::sync::atomic::AtomicBool>,
    connections: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Relay {
    async fn start(to: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let frozen = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let connections = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn({
            let (frozen, connections) = (frozen.clone(), connections.clone());
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    connections.fetch_add(1, Ordering::SeqCst);
                    let Ok(server) = TcpStream::connect(to).await else { continue };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::spawn(Relay::pipe(cr, sw, frozen.clone()));
                    tokio::spawn(Relay::pipe(sr, cw, frozen.clone()));
                }
            }
        });
        Relay { addr, frozen, connections, task }
    }

    async fn pipe(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        frozen: Arc<std::sync::atomic::AtomicBool>,
    ) {
        let mut buf = [0u8; 16384];
        loop {
            let Ok(n) = from.read(&mut buf).await else { return };
            if n == 0 {
                return;
            }
            while frozen.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if to.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test]
async fn an_h2_upstream_connection_that_stops_answering_pings_is_replaced() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let server = listener.local_addr().expect("address");
    let _server = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|_req: http::Request<hyper::body::Incoming>| async move {
                    Ok::<_, std::io::Error>(http::Response::new(http_body_util::Full::new(bytes::Bytes::from_static(
                        b"ok",
                    ))))
                });
                let _ = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    let relay = Relay::start(server).await;
    let tg =
        Tollgate::with(&config(&[url(relay.addr)], "protocol = \"h2\"\nh2_keepalive_interval = \"200ms\""), &[]).await;
    assert_eq!(tg.get("/").send().await.status, 200);
    assert_eq!(relay.connections.load(Ordering::SeqCst), 1);
    // The path goes silent for longer than a PING may wait: the
    // connection is given up, and the next request opens another.
    relay.frozen.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    relay.frozen.store(false, Ordering::SeqCst);
    assert_eq!(tg.get("/").send().await.status, 200);
    assert_eq!(relay.connections.load(Ordering::SeqCst), 2);
}
