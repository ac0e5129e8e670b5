//! gRPC through tollgate, with a real client and server (Python's grpcio,
//! installed by scripts/test, without generated code: see
//! tests/support/grpc_peer.py). Calls within the limit, unary and
//! streaming, go to the upstream over HTTP/2 (`protocol = "h2"`) and back
//! with the rate-limit headers as metadata; what tollgate refuses itself
//! reaches the client as a gRPC status it can act on: a limit is
//! `RESOURCE_EXHAUSTED` with its retry delay in a `google.rpc.RetryInfo`
//! (decoded by grpcio-status), never the `UNAVAILABLE` a client retries.

use crate::support;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};
use support::{Tollgate, Upstream, decisions};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

fn peer(args: &[&str]) -> (Child, Lines<BufReader<ChildStdout>>) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/grpc_peer.py");
    let mut child = Command::new("python3")
        .arg(script)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python3 runs (scripts/test installs grpcio and grpcio-status)");
    let lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
    (child, lines)
}

async fn next(lines: &mut Lines<BufReader<ChildStdout>>) -> String {
    tokio::time::timeout(Duration::from_secs(20), lines.next_line())
        .await
        .expect("the peer answers in time")
        .expect("peer stdout")
        .expect("the peer runs (scripts/test installs grpcio and grpcio-status)")
}

/// The gRPC echo server: the upstream. Killed when dropped.
struct Server {
    _child: Child,
    port: String,
}

async fn server() -> Server {
    let (child, mut lines) = peer(&["server"]);
    let line = next(&mut lines).await;
    let port = line.strip_prefix("port ").unwrap_or_else(|| panic!("server said {line}")).to_string();
    Server { _child: child, port }
}

/// One gRPC channel to `addr`.
struct Client {
    _child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Client {
    fn connect(addr: SocketAddr) -> Client {
        let (mut child, lines) = peer(&["client", &addr.to_string()]);
        let stdin = child.stdin.take().expect("piped stdin");
        Client { _child: child, stdin, lines }
    }

    async fn call(&mut self, call: &str, user: &str, messages: &[&str]) -> Value {
        let line = json!({"call": call, "user": user, "messages": messages});
        self.stdin.write_all(format!("{line}\n").as_bytes()).await.expect("client stdin");
        serde_json::from_str(&next(&mut self.lines).await).expect("the client prints JSON")
    }

    async fn unary(&mut self, user: &str) -> Value {
        self.call("unary", user, &["hello"]).await
    }
}

/// The default test config with its upstream the gRPC server over h2c.
fn grpc_config(server: &Server) -> String {
    support::upstream_config(&format!("url = \"http://127.0.0.1:{}\"", server.port), "protocol = \"h2\"\n")
}

const THREE_PER_USER: &str = "[[rule]]\nname = \"grpc-per-user\"\nkey = [\"user\"]\nalgorithm = \"fixed_window\"\n\
                              limit = 3\nwindow = \"1h\"\n\n[[deny]]\nname = \"abusers\"\nusers = [\"mallory\"]\n";

#[tokio::test]
async fn calls_within_the_limit_work_and_the_limited_one_is_resource_exhausted_with_its_retry_delay() {
    let server = server().await;
    let tg = Tollgate::with(&grpc_config(&server), &[("r.toml", THREE_PER_USER)]).await;
    let mut client = Client::connect(tg.proxy_addr);

    let first = client.unary("alice").await;
    assert_eq!(first["ok"], json!(["hello"]), "{first}");
    assert_eq!(first["initial"]["x-ratelimit-limit"], "3", "{first}");
    assert_eq!(first["initial"]["x-ratelimit-remaining"], "2", "{first}");
    let chat = client.call("stream", "alice", &["one", "two", "three"]).await;
    assert_eq!(chat["ok"], json!(["ONE", "TWO", "THREE"]), "{chat}");
    assert_eq!(chat["initial"]["x-ratelimit-remaining"], "1", "{chat}");
    assert_eq!(client.unary("alice").await["ok"], json!(["hello"]));

    // The fourth call is over the limit, unary or streaming alike.
    for call in ["unary", "stream"] {
        let limited = client.call(call, "alice", &["again"]).await;
        assert_eq!(limited["error"], "RESOURCE_EXHAUSTED", "{limited}");
        let details = limited["details"].as_str().unwrap_or_default();
        assert!(details.contains("under rule \"grpc-per-user\""), "{limited}");
        let trailing = &limited["trailing"];
        assert_eq!(trailing["x-ratelimit-limit"], "3", "{limited}");
        assert_eq!(trailing["x-ratelimit-remaining"], "0", "{limited}");
        let retry_after: f64 = trailing["retry-after"].as_str().and_then(|s| s.parse().ok()).expect("retry-after");
        assert!(retry_after > 0.0 && retry_after <= 3600.0, "{limited}");
        // grpcio-status decoded grpc-status-details-bin (it checks that its
        // code and message are the call's).
        let status = &limited["status"];
        assert_eq!(status["code"], 8, "{limited}");
        assert_eq!(status["retry_delay"].as_f64(), Some(retry_after), "{limited}");
    }
    // Another user has its own quota.
    assert_eq!(client.unary("bob").await["ok"], json!(["hello"]));
    let m = tg.metrics().await;
    assert_eq!(decisions(&m, "grpc-per-user", "allowed"), 4.0);
    assert_eq!(decisions(&m, "grpc-per-user", "limited"), 2.0);
}

#[tokio::test]
async fn tollgates_other_refusals_map_to_their_grpc_codes() {
    let server = server().await;
    let tg = Tollgate::with(&grpc_config(&server), &[("r.toml", THREE_PER_USER)]).await;
    let mut client = Client::connect(tg.proxy_addr);
    // A [[deny]] entry: PERMISSION_DENIED, not retried.
    let denied = client.unary("mallory").await;
    assert_eq!(denied["error"], "PERMISSION_DENIED", "{denied}");
    assert_eq!(denied["status"]["code"], 7, "{denied}");
    assert_eq!(denied["status"]["retry_delay"], Value::Null, "{denied}");
    drop(tg);

    // The upstream refusing connections (answered once the request has
    // gone to it): UNAVAILABLE, which gRPC clients may retry.
    let down = Upstream::refusing_addr().await;
    let config = support::upstream_config(&format!("url = \"http://{down}\""), "protocol = \"h2\"\n");
    let tg = Tollgate::with(&config, &[("r.toml", THREE_PER_USER)]).await;
    let mut client = Client::connect(tg.proxy_addr);
    let unavailable = client.unary("alice").await;
    assert_eq!(unavailable["error"], "UNAVAILABLE", "{unavailable}");
    assert_eq!(unavailable["status"]["code"], 14, "{unavailable}");
    assert!(unavailable["details"].as_str().is_some_and(|d| d.contains("upstream")), "{unavailable}");
}

#[tokio::test]
async fn the_store_unavailable_under_on_error_deny_is_unavailable_with_a_retry_delay() {
    let server = server().await;
    let redis = Upstream::refusing_addr().await;
    let config = format!(
        "{}\n[store]\nbackend = \"redis\"\nurl = \"redis://{redis}\"\ntimeout = \"50ms\"\non_error = \"deny\"\n",
        grpc_config(&server)
    );
    let tg = Tollgate::with(&config, &[("r.toml", THREE_PER_USER)]).await;
    let mut client = Client::connect(tg.proxy_addr);
    let refused = client.unary("alice").await;
    assert_eq!(refused["error"], "UNAVAILABLE", "{refused}");
    assert_eq!(refused["status"]["code"], 14, "{refused}");
    assert_eq!(refused["status"]["retry_delay"].as_f64(), Some(1.0), "{refused}");
    assert_eq!(refused["trailing"]["retry-after"], "1", "{refused}");
}
