//! What an idle keep-alive client connection costs tollgate in memory: each
//! connection sends one request, reads its answer and stays open. The
//! process's resident memory, before and after, bounds the cost per
//! connection (benches/idle_conns.py measures the release build beside
//! nginx, docs/benchmarks.md has its figures).
//!
//! tollgate is the real binary (debug build, its own allocator), so that
//! the clients' memory is not counted; its RSS is read from /proc (Linux).

use crate::support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use support::Upstream;
use support::process::Process;

/// Connections each test opens: enough that the growth stands well above
/// the noise of a process of this size, few enough to take a second or two.
const CONNECTIONS: usize = 2_000;

/// The most one more idle connection may cost, in KiB. A parked HTTP/1.1
/// connection keeps its socket, its [`IdleIo`] state and its task: 3 to
/// 9 KiB in a release build, most of it what the allocator keeps
/// (docs/benchmarks.md). A debug build measured 0
/// to 12 KiB here (what the allocator keeps from the connections not yet
/// parked moves the figure); before HTTP/1.1 connections were parked, 35.
///
/// An idle HTTP/2 connection keeps its socket, its task (hyper's and h2's
/// state inline), h2's shared stream state, its HPACK tables and its
/// `IdleIo`: h2 gives back its buffers and stream storage once the
/// connection has idled for a second (vendor/h2/TOLLGATE-PATCH.md). 6.4
/// KiB in a debug build (1,000 connections); 47 before the patch, when h2
/// kept a 16 KiB write buffer, an 8 KiB read buffer, 4 KiB for HPACK and
/// 8 KiB of the upstream connection's read buffer (held by the HPACK
/// table's entries) for the connection's life.
///
/// [`IdleIo`]: tollgate::edge::idle::IdleIo
const H1_BOUND_KIB: usize = 20;
const H2_BOUND_KIB: usize = 16;

/// The binary in front of `upstream`, with timeouts long enough that no
/// idle connection is closed during the test.
fn start(upstream: SocketAddr) -> Process {
    let config = format!(
        "[listen]\nproxy = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\nidle_timeout = \"600s\"\n\
         header_read_timeout = \"600s\"\nmax_connections = {}\n\n[rules]\npath = \"rules\"\n\n\
         [[upstream]]\nname = \"svc\"\nurl = \"http://{upstream}\"\n\n\
         [[route]]\npath_prefix = \"/\"\nupstream = \"svc\"\n",
        CONNECTIONS * 2
    );
    let rules = "[[rule]]\nname = \"per-user\"\nkey = [\"header:x-user-id\"]\nlimit = 1000000000\nwindow = \"1s\"\n";
    Process::start(&config, rules, &[])
}

/// RSS once it stops moving for a moment (memory is returned lazily).
fn settled_rss_kib(tg: &Process) -> usize {
    let mut last = tg.rss_kib();
    for _ in 0..8 {
        std::thread::sleep(Duration::from_millis(150));
        let now = tg.rss_kib();
        if now == last {
            break;
        }
        last = now;
    }
    last
}

#[derive(Clone, Copy)]
enum Protocol {
    Http1,
    /// HTTP/2 with prior knowledge.
    Http2,
}

/// A connection that has sent one request and read its whole answer.
fn one_request(proxy: SocketAddr, protocol: Protocol) -> TcpStream {
    let mut s = TcpStream::connect(proxy).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    match protocol {
        Protocol::Http1 => {
            s.write_all(b"GET /idle HTTP/1.1\r\nHost: t\r\nX-User-Id: u1\r\n\r\n").expect("request");
            read_h1(&mut s);
        }
        Protocol::Http2 => {
            s.write_all(&h2_request()).expect("request");
            read_h2(&mut s);
        }
    }
    s
}

/// Reads one HTTP/1.1 response with a `Content-Length` body, and checks it
/// is a 200.
fn read_h1(s: &mut TcpStream) {
    let mut data = Vec::new();
    read_h1_from(s, &mut data);
    assert!(data.is_empty(), "bytes after the response");
}

/// [`read_h1`] with `data` read already; leaves in it what follows the
/// response.
fn read_h1_from(s: &mut TcpStream, data: &mut Vec<u8>) {
    let mut buf = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = data.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut buf).expect("read");
        assert!(n > 0, "closed before the response head");
        data.extend_from_slice(&buf[..n]);
    };
    let head = String::from_utf8_lossy(&data[..head_end]).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("content-length");
    while data.len() < head_end + length {
        let n = s.read(&mut buf).expect("read");
        assert!(n > 0, "closed in the response body");
        data.extend_from_slice(&buf[..n]);
    }
    data.drain(..head_end + length);
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).expect("small frame").to_be_bytes();
    let mut f = vec![len[1], len[2], len[3], kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// The preface, an empty SETTINGS and one GET on stream 1, its header
/// block in HPACK literals (no encoder state).
fn h2_request() -> Vec<u8> {
    let mut block = vec![0x82, 0x86]; // :method GET, :scheme http
    block.extend_from_slice(b"\x04\x05/idle"); // :path, literal value
    block.extend_from_slice(b"\x01\x01t"); // :authority
    block.extend_from_slice(b"\x00\x09x-user-id\x02u1");
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(frame(4, 0, 0, &[]));
    out.extend(frame(1, 0x5, 1, &block));
    out
}

/// Reads frames until stream 1 ends, acknowledging the server's SETTINGS.
fn read_h2(s: &mut TcpStream) {
    read_h2_streams(s, &[1]);
}

/// Reads frames until each of `streams` has ended with a 200, acknowledging
/// the server's SETTINGS.
fn read_h2_streams(s: &mut TcpStream, streams: &[u32]) {
    let mut open: Vec<u32> = streams.to_vec();
    while !open.is_empty() {
        let mut head = [0u8; 9];
        s.read_exact(&mut head).expect("frame head");
        let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
        let (kind, flags) = (head[3], head[4]);
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let mut payload = vec![0u8; len];
        s.read_exact(&mut payload).expect("frame payload");
        match kind {
            4 if flags & 1 == 0 => s.write_all(&frame(4, 1, 0, &[])).expect("settings ack"),
            7 => panic!("GOAWAY"),
            // `:status: 200` is HPACK's static entry 8.
            1 if streams.contains(&stream) => assert_eq!(payload.first(), Some(&0x88), "not a 200"),
            _ => {}
        }
        if (kind == 0 || kind == 1) && flags & 1 != 0 {
            open.retain(|&id| id != stream);
        }
    }
}

/// A request on `stream`: a GET, or a POST of `body` in DATA frames of at
/// most 16 KiB (HTTP/2's smallest frame size limit).
fn h2_stream(stream: u32, path: &str, body: &[u8]) -> Vec<u8> {
    let method = if body.is_empty() { 0x82 } else { 0x83 }; // GET, POST
    let mut block = vec![method, 0x86];
    block.push(0x04);
    block.push(u8::try_from(path.len()).expect("short path"));
    block.extend_from_slice(path.as_bytes());
    block.extend_from_slice(b"\x01\x01t\x00\x09x-user-id\x02u1");
    let mut out = frame(1, if body.is_empty() { 0x5 } else { 0x4 }, stream, &block);
    let chunks: Vec<&[u8]> = body.chunks(16 * 1024).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        out.extend(frame(0, u8::from(i + 1 == chunks.len()), stream, chunk));
    }
    out
}

/// KiB of tollgate's RSS per idle connection of `protocol`: what
/// `connections` more idle connections add to a tollgate already holding
/// as many. The first ones leave in the allocator what the requests of
/// connections not yet parked took (hyper's buffers, each request's
/// state), reused by the next: the figure is what one more idle connection
/// costs, not what the allocator keeps from the burst that opened them.
async fn kib_per_idle_connection(protocol: Protocol, connections: usize) -> f64 {
    let upstream = Upstream::start().await;
    let tg = start(upstream.addr);
    let proxy = tg.proxy;
    let (before, after) = tokio::task::spawn_blocking(move || {
        // An HTTP/1.1 connection gives back hyper's buffers after a second
        // of idling (`PARK_AFTER`), checked at most a second later; an
        // HTTP/2 connection h2's, woken by the same check.
        let settle = Duration::from_millis(2_500);
        let first: Vec<TcpStream> = (0..connections).map(|_| one_request(proxy, protocol)).collect();
        std::thread::sleep(settle);
        let before = settled_rss_kib(&tg);
        let idle: Vec<TcpStream> = (0..connections).map(|_| one_request(proxy, protocol)).collect();
        std::thread::sleep(settle);
        let after = settled_rss_kib(&tg);
        drop((first, idle));
        (before, after)
    })
    .await
    .expect("clients");
    let per = after.saturating_sub(before) as f64 / connections as f64;
    println!("{connections} more idle connections: RSS {before} -> {after} KiB, {per:.2} KiB each");
    per
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_http1_connection_costs_little() {
    let per = kib_per_idle_connection(Protocol::Http1, CONNECTIONS).await;
    assert!(per < H1_BOUND_KIB as f64, "{per:.2} KiB per idle HTTP/1.1 connection");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_http2_connection_costs_little() {
    let per = kib_per_idle_connection(Protocol::Http2, CONNECTIONS).await;
    assert!(per < H2_BOUND_KIB as f64, "{per:.2} KiB per idle HTTP/2 connection");
}

/// An HTTP/2 connection that has gone idle (h2 gave back its buffers, see
/// vendor/h2/TOLLGATE-PATCH.md) serves what comes next: two requests in one
/// write (both framed from the first read, before h2 reads again), and a
/// request larger than that first read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_http2_connection_serves_its_next_requests() {
    let upstream = Upstream::start().await;
    let tg = start(upstream.addr);
    let proxy = tg.proxy;
    tokio::task::spawn_blocking(move || {
        let mut s = one_request(proxy, Protocol::Http2);
        // Idle for a second, woken at most a second later.
        std::thread::sleep(Duration::from_millis(2_500));
        let mut two = h2_stream(3, "/a", b"");
        two.extend(h2_stream(5, "/b", b""));
        s.write_all(&two).expect("two requests");
        read_h2_streams(&mut s, &[3, 5]);
        std::thread::sleep(Duration::from_millis(2_500));
        s.write_all(&h2_stream(7, "/post", &[b'x'; 20_000])).expect("a large request");
        read_h2_streams(&mut s, &[7]);
        drop(tg);
    })
    .await
    .expect("client");
}

/// A parked HTTP/1.1 connection serves its next request as any other, and
/// so does one whose next request came in part before it was parked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_connection_serves_its_next_request() {
    let upstream = Upstream::start().await;
    let tg = start(upstream.addr);
    let proxy = tg.proxy;
    tokio::task::spawn_blocking(move || {
        let mut s = one_request(proxy, Protocol::Http1);
        // Parked after a second of idling, checked at most a second later.
        std::thread::sleep(Duration::from_millis(2_500));
        s.write_all(b"GET /after-park HTTP/1.1\r\nHost: t\r\nX-User-Id: u1\r\n\r\n").expect("request");
        read_h1(&mut s);
        // Half a head, a park, the rest: what hyper had read comes back.
        s.write_all(b"GET /split HTTP/1.1\r\nHost: t\r\n").expect("half a request");
        std::thread::sleep(Duration::from_millis(2_500));
        s.write_all(b"X-User-Id: u1\r\n\r\n").expect("the rest");
        read_h1(&mut s);
        // Two requests in one write, after a park: both answered.
        std::thread::sleep(Duration::from_millis(2_500));
        s.write_all(b"GET /a HTTP/1.1\r\nHost: t\r\n\r\nGET /b HTTP/1.1\r\nHost: t\r\n\r\n").expect("pipelined");
        let mut data = Vec::new();
        read_h1_from(&mut s, &mut data);
        read_h1_from(&mut s, &mut data);
        assert!(data.is_empty(), "bytes after the responses");
        drop(tg);
    })
    .await
    .expect("client");
}

/// A minimal config for [`huge_pages_are_off_unless_the_operator_asks`].
const THP_CONFIG: &str = "[listen]\nproxy = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n\n[rules]\npath = \"rules\"\n\n\
                      [[upstream]]\nname = \"svc\"\nurl = \"http://127.0.0.1:9\"\n\n\
                      [[route]]\npath_prefix = \"/\"\nupstream = \"svc\"\n";
const THP_RULES: &str = "[[rule]]\nname = \"per-ip\"\nkey = [\"ip\"]\nlimit = 10\nwindow = \"1s\"\n";

/// tollgate keeps transparent huge pages off for itself: a huge page holds
/// 2 MiB resident for what a few idle connections use of it (this file's
/// subject; docs/benchmarks.md). An operator who wants them sets
/// `MIMALLOC_ALLOW_THP`, which then decides.
#[test]
fn huge_pages_are_off_unless_the_operator_asks() {
    let plain = Process::start(THP_CONFIG, THP_RULES, &[]);
    // The kernel says whether THP is allowed for a process (Linux 5.0+).
    let Some(enabled) = plain.status("THP_enabled") else {
        eprintln!("this kernel does not report THP_enabled; nothing to check");
        return;
    };
    assert_eq!(enabled, "0", "tollgate must turn transparent huge pages off for itself");
    let asked = Process::start(THP_CONFIG, THP_RULES, &[("MIMALLOC_ALLOW_THP", "1")]);
    assert_eq!(asked.status("THP_enabled").as_deref(), Some("1"), "MIMALLOC_ALLOW_THP=1 leaves them on");
}
