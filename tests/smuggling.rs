//! Request smuggling and HTTP/2 abuse, over raw sockets: ambiguous HTTP/1.1
//! framing is refused (400) or read one way only, so the upstream never sees
//! a second request hidden in the first; HTTP/2 rapid reset, CONTINUATION
//! floods and HPACK bombs end the abusive connection or are absorbed, and
//! tollgate keeps serving.

use crate::support;

use std::time::Duration;

use support::{DEADLINE, Tollgate, Upstream, eventually, statuses};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Each case hides `GET /smuggled` after an ambiguous body.
const SMUGGLED: &str = "GET /smuggled HTTP/1.1\r\nhost: t\r\n\r\n";

fn h1_cases() -> Vec<(&'static str, String)> {
    let s = SMUGGLED;
    vec![
        (
            "CL and TE",
            format!(
                "POST / HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n{s}"
            ),
        ),
        (
            "TE and CL",
            format!(
                "POST / HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\ncontent-length: 40\r\n\r\n0\r\n\r\n{s}"
            ),
        ),
        (
            "two different Content-Length",
            format!("POST / HTTP/1.1\r\nhost: t\r\ncontent-length: 0\r\ncontent-length: 40\r\n\r\n{s}"),
        ),
        ("Content-Length list", format!("POST / HTTP/1.1\r\nhost: t\r\ncontent-length: 0, 40\r\n\r\n{s}")),
        ("Content-Length with a sign", format!("POST / HTTP/1.1\r\nhost: t\r\ncontent-length: +40\r\n\r\n{s}")),
        ("negative Content-Length", format!("POST / HTTP/1.1\r\nhost: t\r\ncontent-length: -1\r\n\r\n{s}")),
        (
            "space before the colon",
            format!(
                "POST / HTTP/1.1\r\nhost: t\r\ntransfer-encoding : chunked\r\ncontent-length: 5\r\n\r\n0\r\n\r\n{s}"
            ),
        ),
        (
            "TE with obs-fold",
            format!(
                "POST / HTTP/1.1\r\nhost: t\r\ntransfer-encoding:\r\n chunked\r\ncontent-length: 5\r\n\r\n0\r\n\r\n{s}"
            ),
        ),
        (
            "TE chunked not last",
            format!("POST / HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked, identity\r\n\r\n0\r\n\r\n{s}"),
        ),
        (
            "TE xchunked",
            format!(
                "POST / HTTP/1.1\r\nhost: t\r\ntransfer-encoding: xchunked\r\ncontent-length: 5\r\n\r\n0\r\n\r\n{s}"
            ),
        ),
        (
            "TE twice",
            format!(
                "POST / HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\ntransfer-encoding: identity\r\n\r\n0\r\n\r\n{s}"
            ),
        ),
        ("TE in HTTP/1.0", format!("POST / HTTP/1.0\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n{s}")),
        (
            "chunk size overflow",
            format!(
                "POST / HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\nffffffffffffffff1\r\nx\r\n0\r\n\r\n{s}"
            ),
        ),
        (
            "chunk size with a sign",
            format!("POST / HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n+3\r\nabc\r\n0\r\n\r\n{s}"),
        ),
        (
            "bare LF in chunked",
            format!("POST / HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n3\nabc\n0\n\n{s}"),
        ),
        (
            "bare CR in a chunk extension",
            format!("POST / HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n3;x\ry\r\nabc\r\n0\r\n\r\n{s}"),
        ),
        (
            "chunk data longer than its size",
            format!("POST / HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabcdef\r\n0\r\n\r\n{s}"),
        ),
        ("bare LF in headers", format!("POST / HTTP/1.1\nhost: t\ncontent-length: 5\n\n0\r\n\r\n{s}")),
        ("NUL in a header", format!("POST / HTTP/1.1\r\nhost: t\r\nx-a: a\0b\r\ncontent-length: 0\r\n\r\n{s}")),
        ("space in the request line", format!("POST  / HTTP/1.1\r\nhost: t\r\ncontent-length: 0\r\n\r\n{s}")),
    ]
}

/// Everything the server writes until it closes the connection or falls
/// silent for a second.
async fn exchange(tg: &Tollgate, bytes: &[u8]) -> String {
    let mut s = TcpStream::connect(tg.proxy_addr).await.expect("connect");
    let _ = s.write_all(bytes).await;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match tokio::time::timeout(Duration::from_secs(1), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Err(_) => break,
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The status lines of the responses in `answer` (a response may follow
/// the previous body on the same line).
fn status_lines(answer: &str) -> Vec<&str> {
    answer
        .match_indices("HTTP/1.1 ")
        .filter_map(|(i, _)| answer[i..].lines().next())
        .filter(|l| l.as_bytes().get(9).is_some_and(u8::is_ascii_digit))
        .collect()
}

#[tokio::test]
async fn ambiguous_http1_framing_is_refused_or_read_one_way() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, "").await;
    for (name, bytes) in h1_cases() {
        let before = upstream.hits();
        let answer = exchange(&tg, bytes.as_bytes()).await;
        let reached = upstream.hits() - before;
        let lines = status_lines(&answer);
        match name {
            // Transfer-Encoding wins, the (empty) chunked body is the body,
            // and the connection is closed after the answer: the bytes after
            // it are never read as a request.
            "CL and TE" | "TE and CL" => {
                assert_eq!(lines, ["HTTP/1.1 200 OK"], "{name}: {answer}");
                assert!(answer.contains(r#""body":"""#), "{name}: {answer}");
                assert_eq!(reached, 1, "{name}");
            }
            // Bare LF ends header lines (RFC 9112 2.2 allows it) and
            // Content-Length frames the body: two pipelined requests, read
            // the same way by tollgate and the upstream, each answered.
            "bare LF in headers" => {
                assert_eq!(lines, ["HTTP/1.1 200 OK", "HTTP/1.1 200 OK"], "{name}: {answer}");
                assert!(answer.contains(r#""body":"0\r\n\r\n""#), "{name}: {answer}");
                assert_eq!(reached, 2, "{name}");
            }
            _ => {
                assert_eq!(lines.first().copied(), Some("HTTP/1.1 400 Bad Request"), "{name}: {answer}");
                assert_eq!(lines.len(), 1, "{name}: {answer}");
                assert_eq!(reached, 0, "{name}");
            }
        }
    }
    assert_eq!(statuses(1, || tg.get("/")).await, [200]);
}

// ---------------------------------------------------------------------------
// HTTP/2, frames written by hand
// ---------------------------------------------------------------------------

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// An HPACK integer with an `n`-bit prefix, `flags` in the first byte.
fn hpack_int(out: &mut Vec<u8>, flags: u8, n: u32, mut value: usize) {
    let max = (1usize << n) - 1;
    if value < max {
        out.push(flags | value as u8);
        return;
    }
    out.push(flags | max as u8);
    value -= max;
    while value >= 128 {
        out.push((value % 128) as u8 | 0x80);
        value /= 128;
    }
    out.push(value as u8);
}

/// `GET /` for authority `t`: the static table's `:method GET`, `:scheme
/// http`, `:path /`, and `:authority` as a literal.
fn get_block() -> Vec<u8> {
    vec![0x82, 0x86, 0x84, 0x01, 0x01, b't']
}

/// A literal header with incremental indexing and a new name.
fn indexed_literal(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0x40);
    hpack_int(out, 0, 7, name.len());
    out.extend_from_slice(name);
    hpack_int(out, 0, 7, value.len());
    out.extend_from_slice(value);
}

/// Opens an h2c connection with prior knowledge.
async fn h2_connect(tg: &Tollgate) -> TcpStream {
    let mut s = TcpStream::connect(tg.proxy_addr).await.expect("connect");
    let mut hello = PREFACE.to_vec();
    hello.extend(frame(SETTINGS, 0, 0, &[]));
    s.write_all(&hello).await.expect("preface");
    s
}

/// Writes `frames` until the server stops taking them; returns whether all
/// were written.
async fn write_until_refused(s: &mut TcpStream, frames: impl Iterator<Item = Vec<u8>>) -> bool {
    let write = async {
        for f in frames {
            if s.write_all(&f).await.is_err() {
                return false;
            }
        }
        true
    };
    // A server that stops reading without closing blocks the writes: that
    // is a refusal too (what it then sends tells the rest).
    tokio::time::timeout(DEADLINE, write).await.unwrap_or(false)
}

/// Reads frames until the server closes the connection or sends GOAWAY;
/// fails the test if neither happens within the deadline. Returns the frame
/// types seen.
async fn until_closed(s: &mut TcpStream) -> Vec<u8> {
    frames_until(s, &[GOAWAY]).await
}

/// Reads frames until one of the types in `stop` arrives or the connection
/// ends; fails the test if neither happens within the deadline. Returns the
/// frame types seen.
async fn frames_until(s: &mut TcpStream, stop: &[u8]) -> Vec<u8> {
    let mut kinds = Vec::new();
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    while !kinds.iter().any(|k| stop.contains(k)) {
        let n = match tokio::time::timeout(DEADLINE, s.read(&mut chunk))
            .await
            .expect("the server answers or ends the connection")
        {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        buf.extend_from_slice(&chunk[..n]);
        while buf.len() >= 9 {
            let len = (usize::from(buf[0]) << 16) | (usize::from(buf[1]) << 8) | usize::from(buf[2]);
            if buf.len() < 9 + len {
                break;
            }
            kinds.push(buf[3]);
            buf.drain(..9 + len);
        }
    }
    kinds
}

/// After an attack: nothing is left in flight to the upstream, and new
/// clients are served over both protocols.
async fn still_serving(tg: &Tollgate) {
    eventually("no request left in flight upstream", || async { tg.proxy.upstream_inflight("svc") == Some(0) }).await;
    assert_eq!(tg.get("/").send().await.status, 200);
    assert_eq!(tg.get("/").h2().send().await.status, 200);
}

#[tokio::test]
async fn http2_rapid_reset_ends_the_connection() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, "").await;
    let mut s = h2_connect(&tg).await;
    // 5000 streams, each opened and cancelled at once (CVE-2023-44487).
    let pairs = (0..5000u32).map(|i| {
        let id = 2 * i + 1;
        let mut f = frame(HEADERS, END_STREAM | END_HEADERS, id, &get_block());
        f.extend(frame(RST_STREAM, 0, id, &8u32.to_be_bytes()));
        f
    });
    write_until_refused(&mut s, pairs).await;
    // The server ends the connection (GOAWAY, or a close) rather than take
    // every cancellation (README: rapid reset ends the offending
    // connection); until_closed fails the test if it stays open.
    let kinds = until_closed(&mut s).await;
    let hits = upstream.hits();
    println!("rapid reset: {hits} of 5000 streams reached the upstream; frames seen: {}", kinds.len());
    // hyper's default: the connection ends after 20 streams reset before
    // they were taken up; a few more may have been forwarded by then.
    assert!(hits < 500, "{hits} of the 5000 cancelled streams reached the upstream");
    still_serving(&tg).await;
}

#[tokio::test]
async fn http2_continuation_flood_ends_the_connection() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, "").await;
    let mut s = h2_connect(&tg).await;
    // A header block that never ends: HEADERS without END_HEADERS, then
    // CONTINUATION frames of 16 KiB of headers each, 64 MiB in all.
    let mut piece = Vec::new();
    for i in 0..400 {
        indexed_literal(&mut piece, format!("x-{i:03}").as_bytes(), &[b'a'; 30]);
    }
    piece.truncate(16 * 1024);
    let frames = std::iter::once(frame(HEADERS, END_STREAM, 1, &get_block()))
        .chain((0..4096).map(|_| frame(CONTINUATION, 0, 1, &piece)));
    let all_written = write_until_refused(&mut s, frames).await;
    let kinds = if all_written { until_closed(&mut s).await } else { Vec::new() };
    assert!(!kinds.contains(&HEADERS), "the endless header block was answered as a request: {kinds:?}");
    assert_eq!(upstream.hits(), 0);
    still_serving(&tg).await;
}

#[tokio::test]
async fn http2_hpack_bomb_is_refused() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, "").await;
    let mut s = h2_connect(&tg).await;
    // One 4000-byte header enters the dynamic table, then 16000 one-byte
    // references to it (index 62) would decode to 64 MB of headers.
    let mut block = get_block();
    indexed_literal(&mut block, b"x-bomb", &[b'b'; 4000]);
    block.extend(std::iter::repeat_n(0xbe, 16_000));
    let mut frames = Vec::new();
    let mut chunks = block.chunks(16 * 1024).peekable();
    let mut first = true;
    while let Some(c) = chunks.next() {
        let last = chunks.peek().is_none();
        let kind = if first { HEADERS } else { CONTINUATION };
        let flags = if first { END_STREAM } else { 0 } | if last { END_HEADERS } else { 0 };
        frames.push(frame(kind, flags, 1, c));
        first = false;
    }
    write_until_refused(&mut s, frames.into_iter()).await;
    // The stream is refused (a 431, RST_STREAM) or the connection ended;
    // never forwarded.
    let kinds = frames_until(&mut s, &[HEADERS, RST_STREAM, GOAWAY]).await;
    assert_eq!(upstream.hits(), 0, "the bomb reached the upstream; frames seen: {kinds:?}");
    still_serving(&tg).await;
}
