//! `tollgate-floor`, the bench target with nothing between tollgate's server
//! and its upstream pool: the binary as edge-bench runs it, with tollgate's
//! own config file, in front of a real upstream.

use crate::support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use support::{Call, Upstream, config};

/// A `tollgate-floor` process; killed on drop.
struct Floor {
    child: Child,
    proxy: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Drop for Floor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the binary with the config tollgate's tests use (rules, store and
/// all) and reads its address from its JSON log line.
fn spawn(cfg: &str) -> Floor {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("tollgate.toml"), cfg).expect("config");
    let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate-floor"))
        .arg("--config")
        .arg(dir.path().join("tollgate.toml"))
        .args(["--log-format", "json"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tollgate-floor starts");
    let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
    let deadline = Instant::now() + Duration::from_secs(20);
    let proxy = loop {
        assert!(Instant::now() < deadline, "no listening line from tollgate-floor");
        let line = lines.next().expect("tollgate-floor exited before listening").expect("log line");
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else { continue };
        if v["fields"]["message"] == "tollgate-floor listening" {
            break v["fields"]["proxy"].as_str().and_then(|s| s.parse().ok()).expect("address in log");
        }
    };
    std::thread::spawn(move || lines.map_while(Result::ok).for_each(drop));
    Floor { child, proxy, _dir: dir }
}

#[tokio::test]
async fn forwards_to_the_first_routes_upstream_over_pooled_connections() {
    let upstream = Upstream::start().await;
    let floor = spawn(&config(upstream.addr));
    let r = Call::new("GET", floor.proxy, "/a/b?c=d").header("x-user-id", "u1").send().await;
    assert_eq!(r.status, 200);
    let echo = r.echo();
    assert_eq!((echo.method.as_str(), echo.path.as_str(), echo.query.as_deref()), ("GET", "/a/b", Some("c=d")));
    assert_eq!(echo.header("x-user-id"), Some("u1"));
    assert_eq!(echo.header("host"), Some(floor.proxy.to_string().as_str()));

    let r = Call::new("POST", floor.proxy, "/upload").body("payload").h2().send().await;
    assert_eq!((r.status.as_u16(), r.version), (200, http::Version::HTTP_2));
    assert_eq!((r.echo().body.as_str(), r.echo().version.as_str()), ("payload", "HTTP/1.1"));

    for _ in 0..5 {
        assert_eq!(Call::new("GET", floor.proxy, "/").send().await.status, 200);
    }
    // No rules: nothing is limited, nothing is added.
    assert!(r.ratelimit_headers().is_empty());
    assert_eq!((upstream.hits(), upstream.connections()), (7, 1));
}

#[tokio::test]
async fn an_unreachable_upstream_is_a_502() {
    let down = Upstream::refusing_addr().await;
    let floor = spawn(&config(down));
    assert_eq!(Call::new("GET", floor.proxy, "/").send().await.status, 502);
}
