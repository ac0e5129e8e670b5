//! How long a client connection lives: `idle_timeout` counts time with no
//! request in flight (an HTTP/2 client's PINGs do not keep a connection
//! open), and `max_requests_per_connection` and `max_connection_age` end a
//! connection gracefully: HTTP/1.1's last response says `Connection: close`,
//! HTTP/2 gets a GOAWAY and its streams in flight finish.
//!
//! The HTTP/2 client is Python's `h2` package over a raw socket
//! (tests/support/h2_client.py), driven line by line.

use crate::support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use support::{DEADLINE, Tollgate, Upstream, config};
use tokio::io::AsyncReadExt;

/// The test config in front of `upstream`, with `listen` added to `[listen]`.
fn with_listen(upstream: &Upstream, listen: &str) -> String {
    config(upstream.addr).replace("admin = \"127.0.0.1:0\"\n", &format!("admin = \"127.0.0.1:0\"\n{listen}"))
}

/// One run of tests/support/h2_client.py; it exits when dropped.
struct H2Client {
    child: Child,
    stdin: ChildStdin,
    lines: tokio::sync::mpsc::UnboundedReceiver<String>,
    /// Every event read so far, for failure messages.
    seen: Vec<String>,
}

impl H2Client {
    /// Connects to `proxy` and waits for the server's SETTINGS.
    async fn start(proxy: SocketAddr) -> H2Client {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/support/h2_client.py");
        let mut child = Command::new("python3")
            .arg(script)
            .arg(proxy.port().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 runs (scripts/test installs its h2 package)");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut client = H2Client { child, stdin, lines, seen: Vec::new() };
        client.expect("ready").await;
        client
    }

    fn send(&mut self, command: &str) {
        use std::io::Write;
        // The client may be gone already (it exits once the server closes).
        let _ = writeln!(self.stdin, "{command}");
    }

    /// The next event, if one comes within `wait`.
    async fn next_within(&mut self, wait: Duration) -> Option<String> {
        let line = tokio::time::timeout(wait, self.lines.recv()).await.ok().flatten()?;
        self.seen.push(line.clone());
        Some(line)
    }

    /// Reads events until one starts with `prefix` (within [`DEADLINE`]),
    /// and returns it.
    async fn expect(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next_within(left).await {
                Some(line) if line.starts_with(prefix) => return line,
                Some(_) => {}
                None => panic!("no {prefix:?} from the h2 client within {DEADLINE:?}; saw {:?}", self.seen),
            }
        }
    }
}

impl Drop for H2Client {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn an_h2_connection_that_only_pings_is_closed_after_the_idle_timeout() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::with(&with_listen(&upstream, "idle_timeout = \"1s\"\n"), &[("r.toml", "")]).await;
    let mut client = H2Client::start(tg.proxy_addr).await;
    client.send("get /first");
    assert_eq!(client.expect("response 1").await, "response 1 200");
    client.expect("end 1").await;
    // Bytes move both ways every 100 ms from now on, but no request does.
    let deadline = Instant::now() + DEADLINE;
    loop {
        client.send("ping");
        if let Some(line) = client.next_within(Duration::from_millis(100)).await
            && line == "closed"
        {
            break;
        }
        assert!(Instant::now() < deadline, "a connection sending only PINGs is still open; saw {:?}", client.seen);
    }
}

/// An HTTP/1.1 connection to `proxy`: the request sender, and the
/// connection task, which hands back the socket when the connection ends.
async fn http1(
    proxy: SocketAddr,
) -> (
    hyper::client::conn::http1::SendRequest<Empty<Bytes>>,
    tokio::task::JoinHandle<hyper::Result<hyper::client::conn::http1::Parts<TokioIo<tokio::net::TcpStream>>>>,
) {
    let stream = tokio::net::TcpStream::connect(proxy).await.expect("connect");
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.expect("handshake");
    (sender, tokio::spawn(conn.without_shutdown()))
}

fn get(path: &str) -> http::Request<Empty<Bytes>> {
    http::Request::get(path).header("host", "t").body(Empty::new()).expect("request")
}

/// The connection ended on the client's side, and then tollgate's: its
/// socket reads as closed.
async fn ends(
    conn: tokio::task::JoinHandle<hyper::Result<hyper::client::conn::http1::Parts<TokioIo<tokio::net::TcpStream>>>>,
) {
    let parts = tokio::time::timeout(DEADLINE, conn).await.expect("the connection ends").expect("task").expect("ok");
    let mut io = parts.io.into_inner();
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(DEADLINE, io.read(&mut byte)).await.expect("tollgate closes the connection");
    assert!(matches!(read, Ok(0) | Err(_)), "more bytes after the last response: {read:?}");
}

#[tokio::test]
async fn the_last_request_of_an_http1_connection_is_answered_with_connection_close() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::with(&with_listen(&upstream, "max_requests_per_connection = 3\n"), &[("r.toml", "")]).await;
    let (mut sender, conn) = http1(tg.proxy_addr).await;
    for n in 1..=3 {
        let resp = sender.send_request(get(&format!("/{n}"))).await.expect("response");
        assert_eq!(resp.status(), 200);
        let connection = resp.headers().get("connection").map(|v| v.to_str().unwrap_or("?").to_string());
        let want = if n == 3 { Some("close".to_string()) } else { None };
        assert_eq!(connection, want, "request {n}");
        resp.into_body().collect().await.expect("body");
    }
    ends(conn).await;
    assert_eq!(upstream.hits(), 3);
}

/// Three requests held at the upstream, then let go: all three answered
/// 200 and ended, none reset.
async fn held_streams_finish(client: &mut H2Client, upstream: &Upstream) {
    upstream.release(3);
    client.expect("closed").await;
    for sid in [1, 3, 5] {
        for event in [format!("response {sid} 200"), format!("end {sid}")] {
            assert!(client.seen.contains(&event), "no {event:?}: {:?}", client.seen);
        }
    }
    assert!(!client.seen.iter().any(|l| l.starts_with("reset")), "{:?}", client.seen);
}

#[tokio::test]
async fn an_h2_connection_gets_goaway_after_its_requests_and_finishes_them() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::with(&with_listen(&upstream, "max_requests_per_connection = 3\n"), &[("r.toml", "")]).await;
    let mut client = H2Client::start(tg.proxy_addr).await;
    for _ in 0..3 {
        client.send("get /held x-echo-hold=1");
    }
    upstream.wait_held(3).await;
    // Told while all three are in flight...
    client.expect("goaway").await;
    // ...which still finish.
    held_streams_finish(&mut client, &upstream).await;
}

#[tokio::test]
async fn an_h2_connection_gets_goaway_at_its_max_age_and_finishes_its_requests() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::with(&with_listen(&upstream, "max_connection_age = \"1s\"\n"), &[("r.toml", "")]).await;
    let mut client = H2Client::start(tg.proxy_addr).await;
    for _ in 0..3 {
        client.send("get /held x-echo-hold=1");
    }
    upstream.wait_held(3).await;
    client.expect("goaway").await;
    held_streams_finish(&mut client, &upstream).await;
}

#[tokio::test]
async fn an_http1_request_in_flight_at_the_max_age_is_answered_with_connection_close() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::with(&with_listen(&upstream, "max_connection_age = \"1s\"\n"), &[("r.toml", "")]).await;
    let (mut sender, conn) = http1(tg.proxy_addr).await;
    let resp = sender.send_request(get("/before")).await.expect("response");
    assert_eq!((resp.status(), resp.headers().get("connection")), (http::StatusCode::OK, None));
    resp.into_body().collect().await.expect("body");
    let mut held = get("/held");
    held.headers_mut().insert("x-echo-hold", http::HeaderValue::from_static("1"));
    let pending = tokio::spawn(sender.send_request(held));
    upstream.wait_held(1).await;
    // The connection is older than its age by the time this ends; the
    // request is answered all the same.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    upstream.release(1);
    let resp = pending.await.expect("task").expect("response");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers().get("connection").map(|v| v.as_bytes()), Some(&b"close"[..]));
    resp.into_body().collect().await.expect("body");
    ends(conn).await;
}
