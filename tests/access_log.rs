//! The access log (`[log] access`): one valid JSON line per request under
//! concurrent load, whatever answered it (the upstream, a 429, an error
//! tollgate wrote, a client that went away); nothing waits on a log nobody
//! reads (lines are dropped and counted instead); SIGHUP reopens the
//! file, as logrotate needs; and a write cut short (a full disk) leaves no
//! torn line behind.

use crate::support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::access_log::{lines_by_id, logging, read_log};
use support::{Call, Reply, Tollgate, Upstream, eventually, metric};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const RULE: &str = "five-per-minute";
const RULES: &str = r#"
[[rule]]
name = "five-per-minute"
match = { path = "/limited" }
key = ["ip"]
limit = 5
window = "1m"
"#;

/// The id of a request: tollgate's answers carry it, the upstream echoes
/// the one it received.
fn id_of(r: &Reply) -> String {
    match r.header("x-request-id") {
        Some(id) => id.to_string(),
        None => r.echo().header("x-request-id").expect("id sent upstream").to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_request_under_load_gets_exactly_one_line() {
    const WORKERS: usize = 16;
    const EACH: usize = 125;
    let upstream = Upstream::start().await;
    let tg = Tollgate::with(&logging(&upstream, "access.log"), &[("r.toml", RULES)]).await;
    let addr = tg.proxy_addr;
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..WORKERS {
        tasks.spawn(async move {
            let ip = format!("10.0.0.{w}");
            let mut sent = Vec::with_capacity(EACH);
            for i in 0..EACH {
                let (call, path, body_len) = match i % 4 {
                    0 => (Call::new("GET", addr, "/limited"), "/limited".to_string(), 0),
                    1 => {
                        let body = vec![b'x'; i * 7];
                        (Call::new("POST", addr, "/upload").body(body), "/upload".to_string(), i * 7)
                    }
                    2 => (Call::new("GET", addr, "/odd%22path%20?q=1"), "/odd%22path%20".to_string(), 0),
                    _ => {
                        let path = format!("/plain/{w}/{i}");
                        (Call::new("GET", addr, &path), path, 0)
                    }
                };
                let r = call.from_ip(&ip).send().await;
                sent.push((id_of(&r), r.status.as_u16(), r.body.len(), path, body_len));
            }
            (ip, sent)
        });
    }
    let mut sent = Vec::new();
    while let Some(done) = tasks.join_next().await {
        let (ip, replies) = done.expect("worker");
        sent.extend(replies.into_iter().map(|r| (ip.clone(), r)));
    }
    assert_eq!(sent.len(), WORKERS * EACH);

    let log = lines_by_id(&tg.dir.path().join("access.log"), WORKERS * EACH).await;
    let (mut limited, mut forwarded) = (0, 0);
    for (ip, (id, status, body, path, bytes_in)) in sent {
        let line = log.get(&id).unwrap_or_else(|| panic!("no line for request {id}"));
        assert_eq!(line["status"], status, "{line}");
        assert_eq!(line["client"], ip.as_str(), "{line}");
        assert_eq!(line["path"], path.as_str());
        assert_eq!(line["method"], if path == "/upload" { "POST" } else { "GET" });
        assert_eq!(line["bytes_out"], body as u64, "{line}");
        assert_eq!(line["bytes_in"], bytes_in as u64, "{line}");
        if status == 429 {
            limited += 1;
            assert_eq!(line["upstream"], Value::Null);
        } else {
            forwarded += 1;
            assert_eq!((status, line["upstream"].as_str()), (200, Some(upstream.addr.to_string().as_str())));
        }
        let rule = if path == "/limited" { Value::from(RULE) } else { Value::Null };
        assert_eq!(line["rule"], rule, "{line}");
    }
    // 5 of each worker's 32 requests to /limited went through.
    assert_eq!((limited, forwarded), (WORKERS * (32 - 5), WORKERS * (EACH - 32 + 5)));
}

#[tokio::test]
async fn rejections_errors_and_clients_that_went_away_are_logged() {
    let upstream = Upstream::start().await;
    let cfg = logging(&upstream, "access.log").replace("timeout = \"10s\"", "timeout = \"10s\"\n\n[[upstream]]\nname = \"down\"\nurl = \"http://127.0.0.1:1\"\n\n[[route]]\npath_prefix = \"/down\"\nupstream = \"down\"");
    let tg = Tollgate::with(&cfg, &[("r.toml", RULES)]).await;
    let path = tg.dir.path().join("access.log");
    let mut expect: Vec<(String, u16, Value, Value)> = Vec::new();
    for i in 0..6 {
        let r = tg.get("/limited").from_ip("192.0.2.1").header("x-request-id", &format!("lim-{i}")).send().await;
        let status = if i < 5 { 200 } else { 429 };
        assert_eq!(r.status, status);
        let upstream = if i < 5 { Value::from(upstream.addr.to_string()) } else { Value::Null };
        expect.push((format!("lim-{i}"), status, Value::from(RULE), upstream));
    }
    // Errors tollgate writes itself: a 400 before routing, a 502.
    let r = tg.get("/").header("x-forwarded-for", "garbage").header("x-request-id", "bad-xff").send().await;
    assert_eq!(r.status, 400);
    expect.push(("bad-xff".into(), 400, Value::Null, Value::Null));
    let r = tg.get("/down").header("x-request-id", "down-1").send().await;
    assert_eq!(r.status, 502);
    expect.push(("down-1".into(), 502, Value::Null, Value::from("127.0.0.1:1")));
    // A client that goes away while the upstream holds its request.
    let gone = tokio::spawn(tg.get("/held").header("x-echo-hold", "1").header("x-request-id", "gone-1").send());
    upstream.wait_held(1).await;
    gone.abort();
    let _ = gone.await;
    expect.push(("gone-1".into(), 499, Value::Null, Value::from(upstream.addr.to_string())));

    let log = lines_by_id(&path, expect.len()).await;
    upstream.release(1);
    for (id, status, rule, up) in expect {
        let line = &log[&id];
        assert_eq!((&line["status"], &line["rule"], &line["upstream"]), (&Value::from(status), &rule, &up), "{line}");
    }
    assert_eq!(log["lim-5"]["client"], "192.0.2.1");
    // The client's address as tollgate resolved it: the peer, since the
    // forwarding header named none.
    assert_eq!(log["bad-xff"]["client"], "127.0.0.1");
}

#[tokio::test]
async fn a_path_holding_quotes_and_backslashes_is_escaped() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::with(&logging(&upstream, "access.log"), &[("r.toml", "")]).await;
    let mut s = tokio::net::TcpStream::connect(tg.proxy_addr).await.expect("connect");
    s.write_all(b"GET /a\"b\\c{d}|e HTTP/1.1\r\nHost: t\r\nx-request-id: raw-1\r\nConnection: close\r\n\r\n")
        .await
        .expect("write");
    let mut raw = Vec::new();
    tokio::time::timeout(support::DEADLINE, s.read_to_end(&mut raw)).await.expect("in time").expect("read");
    let log = lines_by_id(&tg.dir.path().join("access.log"), 1).await;
    assert_eq!(log["raw-1"]["path"], "/a\"b\\c{d}|e", "{}", String::from_utf8_lossy(&raw));
}

#[tokio::test]
async fn a_log_nobody_reads_drops_lines_and_requests_never_wait() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::create_dir(dir.path().join("rules")).expect("rules dir");
    let fifo = dir.path().join("access.fifo");
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo runs");
    assert!(made.success());
    // Opening a FIFO for writing waits for a reader, and none ever comes:
    // the writer is stuck as on a dead disk.
    let tg = Tollgate::start_in(dir, &logging(&upstream, "access.fifo")).await;
    // The queue holds QUEUE lines and the writer the batch it took before
    // it got stuck (at most 64 KiB of lines, a few hundred): the rest are
    // dropped.
    let total = tollgate::obs::access_log::QUEUE + 1000;
    let addr = tg.proxy_addr;
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..16 {
        tasks.spawn(async move {
            for _ in (w..total).step_by(16) {
                // Each call fails the test if it takes longer than the
                // support deadline.
                assert_eq!(Call::new("GET", addr, "/").send().await.status, 200);
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("worker");
    }
    let m = tg.metrics().await;
    let dropped = metric(&m, "tollgate_access_log_dropped_total", &[]).expect("the dropped counter");
    assert!(dropped >= 500.0, "{dropped} lines dropped");
    assert!(dropped <= (total - tollgate::obs::access_log::QUEUE) as f64, "{dropped} lines dropped");
}

/// A tollgate process; killed on drop.
struct Process {
    child: Child,
    proxy: SocketAddr,
    admin: SocketAddr,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the real binary on the config in `dir` and reads its listening
/// addresses from its JSON log.
fn spawn(dir: &Path) -> Process {
    spawn_via(dir, &[])
}

/// [`spawn`] through `wrapper`, a command that runs the one after it.
fn spawn_via(dir: &Path, wrapper: &[&str]) -> Process {
    let binary = env!("CARGO_BIN_EXE_tollgate");
    let mut command = match wrapper.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(binary);
            c
        }
        None => Command::new(binary),
    };
    let mut child = command
        .arg("--config")
        .arg(dir.join("tollgate.toml"))
        .args(["--log-format", "json"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tollgate starts");
    let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
    let deadline = Instant::now() + Duration::from_secs(20);
    let (proxy, admin) = loop {
        assert!(Instant::now() < deadline, "no listening line from tollgate");
        let line = lines.next().expect("tollgate exited before listening").expect("log line");
        let Ok(v) = serde_json::from_str::<Value>(&line) else { continue };
        if v["fields"]["message"] == "tollgate listening" {
            let addr = |k: &str| v["fields"][k].as_str().and_then(|s| s.parse().ok()).expect("address in log");
            break (addr("proxy"), addr("admin"));
        }
    };
    let stderr = Arc::new(Mutex::new(Vec::new()));
    let sink = stderr.clone();
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            sink.lock().push(line);
        }
    });
    Process { child, proxy, admin, stderr }
}

#[tokio::test]
async fn sighup_reopens_the_file_and_reloads_the_rules() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::create_dir(dir.path().join("rules")).expect("rules dir");
    std::fs::write(dir.path().join("rules/r.toml"), RULES).expect("rules");
    std::fs::write(dir.path().join("tollgate.toml"), logging(&upstream, "access.log")).expect("config");
    let p = spawn(dir.path());
    let log = dir.path().join("access.log");
    let rotated = dir.path().join("access.log.1");
    for i in 0..3 {
        let r = Call::new("GET", p.proxy, "/").header("x-request-id", &format!("before-{i}")).send().await;
        assert_eq!(r.status, 200);
    }
    lines_by_id(&log, 3).await;

    // What logrotate does: move the file away, then signal.
    std::fs::rename(&log, &rotated).expect("rotate");
    let ok = Command::new("kill").args(["-s", "HUP", &p.child.id().to_string()]).status().expect("kill runs");
    assert!(ok.success());
    let reloaded = |text: &str| metric(text, "tollgate_rules_reloads_total", &[("result", "success")]);
    eventually("the rules reloaded on SIGHUP", || async {
        reloaded(Call::new("GET", p.admin, "/metrics").send().await.text()) == Some(1.0)
    })
    .await;
    eventually("SIGHUP logged", || async { p.stderr.lock().iter().any(|l| l.contains("SIGHUP")) }).await;

    for i in 0..2 {
        let r = Call::new("GET", p.proxy, "/").header("x-request-id", &format!("after-{i}")).send().await;
        assert_eq!(r.status, 200);
    }
    let new = lines_by_id(&log, 2).await;
    assert!(new.contains_key("after-0") && new.contains_key("after-1"));
    let old = lines_by_id(&rotated, 3).await;
    assert!(old.contains_key("before-2"));
}

/// nginx's convention, and what the README's logrotate recipe sends:
/// SIGUSR1 reopens the access log and does nothing else (SIGHUP also
/// reloads the main file and the rules).
#[tokio::test]
async fn sigusr1_reopens_the_file_without_reloading() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::create_dir(dir.path().join("rules")).expect("rules dir");
    std::fs::write(dir.path().join("rules/r.toml"), RULES).expect("rules");
    std::fs::write(dir.path().join("tollgate.toml"), logging(&upstream, "access.log")).expect("config");
    let mut p = spawn(dir.path());
    let log = dir.path().join("access.log");
    let rotated = dir.path().join("access.log.1");
    let r = Call::new("GET", p.proxy, "/").header("x-request-id", "before-0").send().await;
    assert_eq!(r.status, 200);
    lines_by_id(&log, 1).await;

    std::fs::rename(&log, &rotated).expect("rotate");
    let signal = |name: &str, pid: u32| {
        let ok = Command::new("kill").args(["-s", name, &pid.to_string()]).status().expect("kill runs");
        assert!(ok.success(), "kill -s {name}");
    };
    signal("USR1", p.child.id());
    eventually("SIGUSR1 logged", || async { p.stderr.lock().iter().any(|l| l.contains("SIGUSR1")) }).await;
    assert!(p.child.try_wait().expect("wait").is_none(), "tollgate ended on SIGUSR1");
    let r = Call::new("GET", p.proxy, "/").header("x-request-id", "after-0").send().await;
    assert_eq!(r.status, 200);
    assert!(lines_by_id(&log, 1).await.contains_key("after-0"));
    assert!(lines_by_id(&rotated, 1).await.contains_key("before-0"));

    // Nothing was reloaded: a SIGHUP sent now is the first reload of each.
    let reloads = |text: &str| {
        let count = |name: &str| metric(text, name, &[("result", "success")]).unwrap_or(0.0);
        (count("tollgate_rules_reloads_total"), count("tollgate_config_reloads_total"))
    };
    let metrics = || async { Call::new("GET", p.admin, "/metrics").send().await.text().to_string() };
    assert_eq!(reloads(&metrics().await), (0.0, 0.0));
    signal("HUP", p.child.id());
    eventually("the main file reloaded on SIGHUP", || async { reloads(&metrics().await).1 >= 1.0 }).await;
    assert_eq!(reloads(&metrics().await).1, 1.0, "SIGUSR1 reloaded the main file");
    assert!(p.child.try_wait().expect("wait").is_none(), "tollgate ended");
}

#[tokio::test]
async fn a_connection_refused_over_max_connections_is_logged() {
    let upstream = Upstream::start().await;
    let cfg = logging(&upstream, "access.log")
        .replace("admin = \"127.0.0.1:0\"\n", "admin = \"127.0.0.1:0\"\nmax_connections = 1\n");
    let tg = Tollgate::with(&cfg, &[("r.toml", "")]).await;
    let held = tokio::spawn(tg.get("/held").header("x-echo-hold", "1").header("x-request-id", "held-1").send());
    upstream.wait_held(1).await;
    let r = tg.call("POST", "/refused?x=1").send().await;
    assert_eq!(r.status, 503);
    let id = r.header("x-request-id").expect("an id").to_string();
    assert_eq!(r.json()["request_id"], id.as_str());
    upstream.release(1);
    assert_eq!(held.await.expect("held request").status, 200);
    let log = lines_by_id(&tg.dir.path().join("access.log"), 2).await;
    let line = &log[&id];
    assert_eq!((&line["method"], &line["path"], &line["status"]), (&"POST".into(), &"/refused".into(), &503.into()));
    assert_eq!(line["bytes_out"], r.body.len() as u64);
    assert_eq!(log["held-1"]["status"], 200);
}

#[tokio::test]
async fn a_batch_cut_short_by_a_file_size_limit_leaves_no_torn_line() {
    // The file-size limit (RLIMIT_FSIZE) stands in for a full disk: a write
    // crossing it is cut short, the next fails with EFBIG (SIGXFSZ ignored,
    // so the process lives on, as on ENOSPC).
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::create_dir(dir.path().join("rules")).expect("rules dir");
    std::fs::write(dir.path().join("rules/r.toml"), "").expect("rules");
    std::fs::write(dir.path().join("tollgate.toml"), logging(&upstream, "access.log")).expect("config");
    let wrapper = ["sh", "-c", "trap '' XFSZ; exec prlimit --fsize=4000:unlimited -- \"$@\"", "sh"];
    let p = spawn_via(dir.path(), &wrapper);
    let log = dir.path().join("access.log");
    let dropped = || async {
        let m = Call::new("GET", p.admin, "/metrics").send().await;
        metric(m.text(), "tollgate_access_log_dropped_total", &[]).unwrap_or(0.0)
    };
    // Lines of uneven lengths until one does not fit.
    let mut sent = 0;
    while dropped().await == 0.0 {
        assert!(sent < 200, "4000 bytes of log never filled");
        let path = format!("/{}", "p".repeat(sent % 7 * 13));
        let r = Call::new("GET", p.proxy, &path).header("x-request-id", &format!("before-{sent}")).send().await;
        assert_eq!(r.status, 200);
        sent += 1;
        eventually("the line written or dropped", || async {
            dropped().await > 0.0
                || std::fs::read_to_string(&log).unwrap_or_default().contains(&format!("\"before-{}\"", sent - 1))
        })
        .await;
    }
    // Room again (the disk freed): later lines land whole, each on its own.
    let pid = p.child.id().to_string();
    let raised = Command::new("prlimit").args(["--pid", &pid, "--fsize=unlimited"]).status().expect("prlimit runs");
    assert!(raised.success());
    for i in 0..3 {
        let r = Call::new("GET", p.proxy, "/").header("x-request-id", &format!("after-{i}")).send().await;
        assert_eq!(r.status, 200);
    }
    eventually("the later lines", || async {
        std::fs::read_to_string(&log).unwrap_or_default().contains("\"after-2\"")
    })
    .await;
    let text = std::fs::read_to_string(&log).expect("log");
    assert!(text.ends_with('\n'), "{text}");
    // Every line one whole JSON object: none torn, none glued to another.
    let lines = read_log(&log);
    let ids: Vec<&str> = lines.iter().map(|v| v["request_id"].as_str().expect("id")).collect();
    assert!(ids.ends_with(&["after-0", "after-1", "after-2"]), "{ids:?}");
    assert_eq!(
        ids.len() as f64 + dropped().await,
        (sent + 3) as f64,
        "every line written or counted as dropped: {ids:?}"
    );
}
