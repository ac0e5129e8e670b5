//! WebSockets through tollgate, with a real client and server (Python's
//! `websockets` package, installed by scripts/test): messages both ways, the
//! upgrade counted and refused with 429 over the limit, the tunnel's own
//! idle timeout and `max_connections` slot, its concurrency slot held until
//! it closes, `send_timeout` closing it when its client stops reading,
//! shutdown closing it, and
//! upgrades that would carry HTTP past the limiter never tunnelled.

use crate::support;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use support::{Tollgate, Upstream, config, eventually, metric};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/support/ws_peer.py")
}

/// A Python process and the lines it prints.
struct Peer {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Peer {
    fn spawn(args: &[&str]) -> Peer {
        let mut child = Command::new("python3")
            .arg(script())
            .args(args)
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 runs (scripts/test installs its websockets package)");
        let lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
        Peer { child, lines }
    }

    async fn line(&mut self) -> String {
        tokio::time::timeout(Duration::from_secs(40), self.lines.next_line())
            .await
            .expect("the peer prints in time")
            .expect("stdout readable")
            .unwrap_or_else(|| "exited".into())
    }
}

/// The echo server: the upstream.
async fn ws_upstream() -> (Peer, String) {
    let mut server = Peer::spawn(&["server"]);
    let line = server.line().await;
    let port = line.strip_prefix("port ").unwrap_or_else(|| panic!("server said {line}")).to_string();
    (server, port)
}

fn ws_config(port: &str, listen: &str) -> String {
    // The test Upstream's address is replaced by the WebSocket server's.
    let placeholder: std::net::SocketAddr = "127.0.0.1:9".parse().expect("an address");
    config(placeholder)
        .replace("http://127.0.0.1:9", &format!("http://127.0.0.1:{port}"))
        .replace("admin = \"127.0.0.1:0\"\n", &format!("admin = \"127.0.0.1:0\"\n{listen}"))
}

const TWO_PER_USER: &str = "[[rule]]\nname = \"sockets\"\nkey = [\"header:x-user\"]\nalgorithm = \"fixed_window\"\nlimit = 2\nwindow = \"1h\"\n";

#[tokio::test]
async fn messages_cross_both_ways_and_the_upgrade_counts_against_the_limit() {
    let (_server, port) = ws_upstream().await;
    let tg = Tollgate::with(&ws_config(&port, ""), &[("r.toml", TWO_PER_USER)]).await;
    let url = format!("ws://{}/chat", tg.proxy_addr);

    let mut first = Peer::spawn(&["client", &url, "send:hello", "recv", "send:again", "recv"]);
    assert_eq!(first.line().await, "open");
    assert_eq!(first.line().await, "recv hello");
    assert_eq!(first.line().await, "recv again");
    let _ = first.child.wait().await;

    let mut second = Peer::spawn(&["client", &url, "send:x", "recv"]);
    assert_eq!(second.line().await, "open");
    assert_eq!(second.line().await, "recv x");
    let _ = second.child.wait().await;

    // Two upgrades were two requests; the third is over the limit. The
    // messages inside a tunnel count nothing.
    let mut third = Peer::spawn(&["client", &url]);
    assert_eq!(third.line().await, "refused 429");
    let m = tg.metrics().await;
    assert_eq!(support::decisions(&m, "sockets", "allowed"), 2.0);
    assert_eq!(support::decisions(&m, "sockets", "limited"), 1.0);
}

#[tokio::test]
async fn an_open_tunnel_holds_a_connection_slot_and_shows_in_the_gauge() {
    let (_server, port) = ws_upstream().await;
    let tg = Tollgate::with(&ws_config(&port, "max_connections = 1\n"), &[("r.toml", TWO_PER_USER)]).await;
    let url = format!("ws://{}/chat", tg.proxy_addr);

    let mut open = Peer::spawn(&["client", &url, "send:a", "recv", "wait-close"]);
    assert_eq!(open.line().await, "open");
    assert_eq!(open.line().await, "recv a");
    let m = tg.metrics().await;
    assert_eq!(metric(&m, "tollgate_tunnels_active", &[]), Some(1.0));
    assert_eq!(metric(&m, "tollgate_connections_active", &[]), Some(1.0));

    // The only slot is the tunnel's: a second client is turned away.
    let r = tg.get("/").send().await;
    assert_eq!(r.status, 503, "{}", r.text());
    drop(open);
    eventually("the tunnel closes and frees its slot", || async {
        let m = tg.metrics().await;
        metric(&m, "tollgate_tunnels_active", &[]) == Some(0.0)
    })
    .await;
}

#[tokio::test]
async fn a_silent_tunnel_is_closed_after_the_tunnel_idle_timeout_not_the_connection_one() {
    let (_server, port) = ws_upstream().await;
    // The connection's idle timeout is shorter than the tunnel's: a tunnel
    // lives by its own.
    let listen = "idle_timeout = \"1s\"\ntunnel_idle_timeout = \"3s\"\n";
    let tg = Tollgate::with(&ws_config(&port, listen), &[("r.toml", TWO_PER_USER)]).await;
    let url = format!("ws://{}/chat", tg.proxy_addr);

    let mut client = Peer::spawn(&["client", &url, "send:a", "recv", "wait-close"]);
    assert_eq!(client.line().await, "open");
    assert_eq!(client.line().await, "recv a");
    let closed = client.line().await;
    let secs: f64 = closed
        .strip_prefix("closed ")
        .and_then(|r| r.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("the client saw {closed}"));
    assert!(secs >= 2.5, "closed after {secs} s, before the tunnel idle timeout");
}

#[tokio::test]
async fn shutdown_closes_open_tunnels() {
    let (_server, port) = ws_upstream().await;
    let tg = Tollgate::with(&ws_config(&port, "drain_timeout = \"2s\"\n"), &[("r.toml", TWO_PER_USER)]).await;
    let url = format!("ws://{}/chat", tg.proxy_addr);

    let mut client = Peer::spawn(&["client", &url, "send:a", "recv", "wait-close"]);
    assert_eq!(client.line().await, "open");
    assert_eq!(client.line().await, "recv a");
    tokio::time::timeout(Duration::from_secs(10), tg.stop()).await.expect("tollgate stops with a tunnel open");
    let closed = client.line().await;
    assert!(closed.starts_with("closed "), "the client saw {closed}");
}

/// A tunnel is not cut at the shutdown's start: it gets the drain time, as
/// requests do, and is then closed with a WebSocket close frame saying 1001
/// (going away), so the client knows to reconnect elsewhere, rather than a
/// bare TCP close (1006 to the client).
#[tokio::test]
async fn a_tunnel_open_at_shutdown_is_closed_with_going_away_after_the_drain() {
    let (_server, port) = ws_upstream().await;
    let tg = Tollgate::with(&ws_config(&port, "drain_timeout = \"2s\"\n"), &[("r.toml", TWO_PER_USER)]).await;
    let url = format!("ws://{}/chat", tg.proxy_addr);
    let mut client = Peer::spawn(&["client", &url, "send:a", "recv", "wait-close"]);
    assert_eq!(client.line().await, "open");
    assert_eq!(client.line().await, "recv a");
    tokio::time::timeout(Duration::from_secs(10), tg.stop()).await.expect("tollgate stops with a tunnel open");
    let closed = client.line().await;
    let words: Vec<&str> = closed.split(' ').collect();
    assert_eq!(words.get(1), Some(&"1001"), "the client saw {closed}");
    // Not before the drain's end: the client's clock started before the
    // shutdown did.
    let after: f64 = words.get(2).and_then(|s| s.parse().ok()).unwrap_or(0.0);
    assert!(after >= 1.9, "closed {after} s after the shutdown began; the drain is 2 s");
}

/// A raw HTTP/1.1 exchange: the status line and headers of the answer.
async fn raw(addr: std::net::SocketAddr, request: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(request.as_bytes()).await.expect("write");
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(5), tokio::io::AsyncReadExt::read(&mut s, &mut buf))
            .await
            .expect("an answer in time")
            .expect("read");
        out.extend_from_slice(&buf[..n]);
        if n == 0 || out.windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn upgrades_that_would_carry_http_past_the_limiter_are_not_asked_of_the_upstream() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, TWO_PER_USER).await;
    for protocol in ["h2c", "HTTP/2.0", "TLS/1.2", "websocket, h2c"] {
        let r = tg
            .get("/x")
            .header("x-user", protocol)
            .header("connection", "upgrade")
            .header("upgrade", protocol)
            .send()
            .await;
        // Counted, then forwarded as a plain request.
        assert_eq!(r.status, 200, "{protocol}: {}", r.text());
        let echo = r.echo();
        assert_eq!(echo.header("upgrade"), None, "{protocol} reached the upstream");
        assert_eq!(echo.header("connection"), None, "{protocol}");
    }
    // A WebSocket upgrade is asked of the upstream; this one answers 200,
    // which the client gets as it is.
    let r = tg
        .get("/x")
        .header("x-user", "carol")
        .header("connection", "Upgrade")
        .header("upgrade", "websocket")
        .header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==")
        .header("sec-websocket-version", "13")
        .send()
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.echo().header("upgrade"), Some("websocket"));
    assert_eq!(r.echo().header("connection"), Some("upgrade"));
}

#[tokio::test]
async fn an_upstream_that_switches_protocols_unasked_is_a_bad_gateway() {
    // A raw upstream answering every request with 101.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = tokio::io::AsyncReadExt::read(&mut s, &mut buf).await;
                let _ = s
                    .write_all(b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n")
                    .await;
                tokio::time::sleep(Duration::from_secs(5)).await;
            });
        }
    });
    let cfg = config(addr);
    let tg = Tollgate::with(&cfg, &[("r.toml", TWO_PER_USER)]).await;
    let head = raw(tg.proxy_addr, "GET /x HTTP/1.1\r\nhost: a\r\nx-user: dan\r\n\r\n").await;
    assert!(head.starts_with("HTTP/1.1 502"), "{head}");
}

/// A WebSocket is one request in flight until its tunnel closes: under a
/// concurrency rule it holds its slot that long, and gives it back when it
/// closes.
#[tokio::test]
async fn an_open_tunnel_holds_its_concurrency_slot_until_it_closes() {
    let (_server, port) = ws_upstream().await;
    let one = "[[rule]]\nname = \"sockets-open\"\nkey = [\"header:x-user\"]\nalgorithm = \"concurrency\"\nlimit = 1\n";
    let tg = Tollgate::with(&ws_config(&port, ""), &[("r.toml", one)]).await;
    let url = format!("ws://{}/chat", tg.proxy_addr);

    let mut open = Peer::spawn(&["client", &url, "send:a", "recv", "wait-close"]);
    assert_eq!(open.line().await, "open");
    assert_eq!(open.line().await, "recv a");
    let mut second = Peer::spawn(&["client", &url]);
    assert_eq!(second.line().await, "refused 429", "the open tunnel holds the only slot");

    // The client goes away: the tunnel closes and its slot comes back.
    drop(open);
    eventually("the closed tunnel's slot to come back", || async {
        let mut next = Peer::spawn(&["client", &url, "send:b", "recv"]);
        next.line().await == "open"
    })
    .await;
}

/// A tunnel whose client stops reading is closed after `send_timeout`,
/// as a plain response's connection is: the upstream below writes without
/// end into a tunnel whose client reads nothing, and finds its connection
/// closed once tollgate gives up on the client.
#[tokio::test]
async fn a_tunnel_whose_client_stops_reading_is_closed_after_send_timeout() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::io::AsyncReadExt;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let broken = Arc::new(AtomicBool::new(false));
    tokio::spawn({
        let broken = broken.clone();
        async move {
            let Ok((mut s, _)) = listener.accept().await else { return };
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf).await;
            let head = "HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n";
            if s.write_all(head.as_bytes()).await.is_err() {
                return;
            }
            let piece = [b'x'; 16 * 1024];
            while s.write_all(&piece).await.is_ok() {}
            broken.store(true, Ordering::SeqCst);
        }
    });
    let tg = Tollgate::with(
        &config(addr).replace("admin = \"127.0.0.1:0\"\n", "admin = \"127.0.0.1:0\"\nsend_timeout = \"1s\"\n"),
        &[("r.toml", TWO_PER_USER)],
    )
    .await;
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(16 * 1024).expect("receive buffer");
    let mut client = socket.connect(tg.proxy_addr).await.expect("connect");
    client
        .write_all(
            b"GET /chat HTTP/1.1\r\nhost: a\r\nx-user: erin\r\nconnection: upgrade\r\nupgrade: websocket\r\n\
              sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n",
        )
        .await
        .expect("upgrade request");
    eventually("the tunnel opens", || async {
        metric(&tg.metrics().await, "tollgate_tunnels_active", &[]) == Some(1.0)
    })
    .await;
    // The client reads nothing from here on; the default tunnel idle
    // timeout (an hour) is not what ends it.
    eventually("the upstream's connection is closed", || async { broken.load(Ordering::SeqCst) }).await;
    eventually("the tunnel is gone", || async {
        metric(&tg.metrics().await, "tollgate_tunnels_active", &[]) == Some(0.0)
    })
    .await;
    drop(client);
}
