//! The access log: one JSON object per line and per request, written by a
//! dedicated thread so that no request ever waits on the disk.
//!
//! A request's [`Entry`] is filled in as the request goes ([`Note`]) and
//! handed over, through a bounded queue, when its response body ends or
//! the client goes away ([`Logged`] and [`Pending`] send it when dropped).
//! A full queue drops the line and counts it in
//! `tollgate_access_log_dropped_total`: a slow disk costs log lines, never
//! latency. The writer renders the lines, writes what is queued in one go,
//! and reopens its file after a SIGHUP, so logrotate can move the file away
//! and the next lines land in a new one at the configured path.
//!
//! With `[log] access = "off"` there is no [`AccessLog`]: the request path
//! allocates nothing and pays one `None` check per hook.

use std::fs::OpenOptions;
use std::io::Write;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::header::HeaderValue;
use http::uri::Authority;
use http::{Method, Uri};
use hyper::body::{Body, Frame, SizeHint};
use prometheus::IntCounter;

use crate::config::AccessLogTarget;

/// Lines waiting for the writer at most. At 50 000 requests a second this
/// is some 80 ms of disk stall absorbed before lines are dropped; each
/// waiting line holds a few hundred bytes.
pub const QUEUE: usize = 4096;

/// The writer hands this much rendered text to the file at once, at most.
const BATCH_BYTES: usize = 64 * 1024;

/// The status logged for a request whose client went away before its
/// response head was sent (nginx's 499, "client closed request").
pub const CLIENT_GONE: u16 = 499;

/// What the writer thread receives.
enum Message {
    Line(Box<Entry>),
    /// Write out everything queued before this, then answer.
    Flush(tokio::sync::oneshot::Sender<()>),
}

/// The request path's handle on the access log.
pub struct AccessLog {
    shared: Arc<Shared>,
}

struct Shared {
    queue: SyncSender<Message>,
    /// Set by SIGHUP; the writer reopens its file before its next write.
    reopen: Arc<AtomicBool>,
    dropped: IntCounter,
}

impl AccessLog {
    /// Starts the writer thread for `target`; `None` when the log is off.
    /// The file is opened by the writer, not here: opening a FIFO waits for
    /// its reader, and start-up must not.
    pub fn start(target: &AccessLogTarget, dropped: IntCounter) -> std::io::Result<Option<AccessLog>> {
        if *target == AccessLogTarget::Off {
            return Ok(None);
        }
        let (queue, rx) = sync_channel(QUEUE);
        let reopen = Arc::new(AtomicBool::new(false));
        let writer = Writer { target: target.clone(), reopen: reopen.clone(), dropped: dropped.clone(), out: None };
        std::thread::Builder::new().name("access-log".into()).spawn(move || writer.run(rx))?;
        Ok(Some(AccessLog { shared: Arc::new(Shared { queue, reopen, dropped }) }))
    }

    /// Opens an entry for a request that has just arrived. Until the
    /// response is known its status says the client went away.
    pub fn begin(&self, method: &Method, uri: &Uri, client: IpAddr, request_id: &HeaderValue) -> Pending {
        Pending {
            shared: self.shared.clone(),
            entry: Some(Box::new(Entry {
                time: SystemTime::now(),
                started: Instant::now(),
                client,
                method: method.clone(),
                uri: uri.clone(),
                status: CLIENT_GONE,
                bytes_in: None,
                bytes_out: 0,
                duration: Duration::ZERO,
                upstream: None,
                rule: None,
                request_id: request_id.clone(),
            })),
        }
    }

    /// Makes the writer reopen its file before the next line (SIGHUP).
    pub fn reopen(&self) {
        self.shared.reopen.store(true, Ordering::Relaxed);
    }

    /// Waits, up to `within`, until every line queued so far is written:
    /// at shutdown, after the last request.
    pub async fn flush(&self, within: Duration) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let deadline = tokio::time::Instant::now() + within;
        let mut msg = Message::Flush(tx);
        loop {
            match self.shared.queue.try_send(msg) {
                Ok(()) => break,
                Err(TrySendError::Full(m)) if tokio::time::Instant::now() < deadline => {
                    msg = m;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(_) => return,
            }
        }
        let _ = tokio::time::timeout_at(deadline, rx).await;
    }
}

/// One request's line, as it is being filled in.
pub struct Entry {
    time: SystemTime,
    started: Instant,
    client: IpAddr,
    method: Method,
    uri: Uri,
    status: u16,
    /// Request body bytes read from the client so far, counted by the
    /// forwarding side (see [`crate::forward::Downstream`]).
    bytes_in: Option<Arc<AtomicU64>>,
    bytes_out: u64,
    duration: Duration,
    upstream: Option<Authority>,
    rule: Option<String>,
    request_id: HeaderValue,
}

/// A line not yet sent to the writer: sent when dropped, whether the
/// response completed or the client went away.
pub struct Pending {
    shared: Arc<Shared>,
    entry: Option<Box<Entry>>,
}

impl Pending {
    /// What the request path notes into this entry.
    pub fn note(&mut self) -> Note<'_> {
        Note(self.entry.as_deref_mut())
    }

    /// Response body bytes sent outside a [`Logged`] body.
    pub fn sent(&mut self, bytes: u64) {
        if let Some(e) = &mut self.entry {
            e.bytes_out += bytes;
        }
    }

    /// The response head is known: its status.
    pub fn respond(&mut self, status: u16) {
        if let Some(e) = &mut self.entry {
            e.status = status;
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let Some(mut entry) = self.entry.take() else { return };
        entry.duration = entry.started.elapsed();
        if let Err(TrySendError::Full(_)) = self.shared.queue.try_send(Message::Line(entry)) {
            self.shared.dropped.inc();
        }
    }
}

/// Where the request path writes what it learns about a request; does
/// nothing when the access log is off.
pub struct Note<'a>(Option<&'a mut Entry>);

impl Note<'_> {
    /// A note that goes nowhere: the access log is off.
    pub fn off<'a>() -> Note<'a> {
        Note(None)
    }

    /// Whether notes are kept: the access log is on.
    pub fn enabled(&self) -> bool {
        self.0.is_some()
    }

    /// The client address as tollgate resolved it (see [`crate::client`]).
    pub fn client(&mut self, ip: IpAddr) {
        if let Some(e) = &mut self.0 {
            e.client = ip;
        }
    }

    /// The rule that limited the request, or the most restrictive one.
    pub fn rule(&mut self, name: &str) {
        if let Some(e) = &mut self.0 {
            e.rule = Some(name.to_string());
        }
    }

    /// The upstream server the request is sent to.
    pub fn upstream(&mut self, server: &Authority) {
        if let Some(e) = &mut self.0 {
            e.upstream = Some(server.clone());
        }
    }

    /// A counter of the request body bytes read from the client, for the
    /// forwarding side to add to; `None` when the log is off.
    pub fn bytes_in(&mut self) -> Option<Arc<AtomicU64>> {
        let e = self.0.as_mut()?;
        Some(e.bytes_in.get_or_insert_with(Default::default).clone())
    }
}

/// A response body that counts the bytes it hands to the connection and
/// sends its request's line when dropped: at its end, or when the client
/// goes away.
pub struct Logged<B> {
    inner: B,
    pending: Option<Pending>,
}

impl<B> Logged<B> {
    /// `inner`, logged through `pending` (or not at all).
    pub fn new(inner: B, pending: Option<Pending>) -> Logged<B> {
        Logged { inner, pending }
    }
}

impl<B> Body for Logged<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(Some(e)) = self.pending.as_mut().map(|p| p.entry.as_mut())
        {
            e.bytes_out += frame.data_ref().map_or(0, |d| d.len() as u64);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The method and target of the HTTP/1 request line at the start of
/// `head`, for a request answered before hyper parsed it; `-` and `/` for
/// what does not parse.
pub fn request_line(head: &[u8]) -> (Method, Uri) {
    let line = head.split(|&b| b == b'\r' || b == b'\n').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    // "-" is a valid method token: `from_bytes` accepts it.
    let method = parts
        .next()
        .and_then(|m| Method::from_bytes(m).ok())
        .unwrap_or_else(|| Method::from_bytes(b"-").unwrap_or_default());
    let uri = parts
        .next()
        .and_then(|t| Uri::try_from(t).ok())
        .filter(|u| u.path().starts_with('/'))
        .unwrap_or_else(|| Uri::from_static("/"));
    (method, uri)
}

/// The writer thread's state.
struct Writer {
    target: AccessLogTarget,
    reopen: Arc<AtomicBool>,
    dropped: IntCounter,
    /// `None` until opened, and after a failed open or write.
    out: Option<Box<dyn Write + Send>>,
}

impl Writer {
    /// Writes until every [`AccessLog`] and [`Pending`] is gone.
    fn run(mut self, rx: Receiver<Message>) {
        let mut buf: Vec<u8> = Vec::with_capacity(BATCH_BYTES + 4096);
        let mut failing = false;
        while let Ok(first) = rx.recv() {
            buf.clear();
            let mut lines = 0u64;
            let mut acks = Vec::new();
            let mut next = Some(first);
            while let Some(msg) = next.take() {
                match msg {
                    Message::Line(entry) => {
                        render(&entry, &mut buf);
                        lines += 1;
                    }
                    Message::Flush(ack) => acks.push(ack),
                }
                if buf.len() < BATCH_BYTES {
                    next = rx.try_recv().ok();
                }
            }
            if lines > 0 {
                match self.write(&buf) {
                    Ok(()) => {
                        if failing {
                            tracing::info!("access log: writing again");
                        }
                        failing = false;
                    }
                    Err(e) => {
                        // Said once per failure, not once per line.
                        if !failing {
                            tracing::error!(error = %e, "access log: cannot write; lines are dropped and counted");
                        }
                        failing = true;
                        self.dropped.inc_by(lines);
                    }
                }
            }
            for ack in acks {
                let _ = ack.send(());
            }
        }
    }

    /// Writes one batch, (re)opening the output first when it is not open
    /// or SIGHUP asked for it.
    fn write(&mut self, buf: &[u8]) -> std::io::Result<()> {
        if self.reopen.swap(false, Ordering::Relaxed) {
            self.out = None;
        }
        if self.out.is_none() {
            self.out = Some(match &self.target {
                AccessLogTarget::File(path) => Box::new(OpenOptions::new().append(true).create(true).open(path)?),
                _ => Box::new(std::io::stdout()),
            });
        }
        let Some(out) = self.out.as_mut() else { return Ok(()) };
        let written = out.write_all(buf).and_then(|()| out.flush());
        if written.is_err() {
            // Opened again for the next batch: the file may have been
            // replaced, or the disk freed.
            self.out = None;
        }
        written
    }
}

/// Appends `e` as one JSON line.
fn render(e: &Entry, out: &mut Vec<u8>) {
    let mut num = itoa::Buffer::new();
    out.extend_from_slice(b"{\"time\":\"");
    rfc3339_millis(e.time, out);
    out.extend_from_slice(b"\",\"client\":\"");
    out.extend_from_slice(e.client.to_string().as_bytes());
    out.extend_from_slice(b"\",\"method\":");
    json_string(e.method.as_str().as_bytes(), out);
    out.extend_from_slice(b",\"path\":");
    json_string(e.uri.path().as_bytes(), out);
    out.extend_from_slice(b",\"status\":");
    out.extend_from_slice(num.format(e.status).as_bytes());
    out.extend_from_slice(b",\"bytes_in\":");
    let bytes_in = e.bytes_in.as_ref().map_or(0, |b| b.load(Ordering::Relaxed));
    out.extend_from_slice(num.format(bytes_in).as_bytes());
    out.extend_from_slice(b",\"bytes_out\":");
    out.extend_from_slice(num.format(e.bytes_out).as_bytes());
    out.extend_from_slice(b",\"duration_ms\":");
    let micros = e.duration.as_micros();
    out.extend_from_slice(num.format(micros / 1000).as_bytes());
    out.push(b'.');
    let frac = (micros % 1000) as u16;
    out.extend_from_slice(&[b'0' + (frac / 100) as u8, b'0' + (frac / 10 % 10) as u8, b'0' + (frac % 10) as u8]);
    out.extend_from_slice(b",\"upstream\":");
    match &e.upstream {
        Some(a) => json_string(a.as_str().as_bytes(), out),
        None => out.extend_from_slice(b"null"),
    }
    out.extend_from_slice(b",\"rule\":");
    match &e.rule {
        Some(r) => json_string(r.as_bytes(), out),
        None => out.extend_from_slice(b"null"),
    }
    out.extend_from_slice(b",\"request_id\":");
    json_string(e.request_id.as_bytes(), out);
    out.extend_from_slice(b"}\n");
}

/// `s` as a JSON string: quotes, backslashes and control bytes escaped,
/// UTF-8 kept, and any byte that is not UTF-8 written as U+FFFD (a path
/// can hold anything).
fn json_string(s: &[u8], out: &mut Vec<u8>) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    for chunk in s.utf8_chunks() {
        for &b in chunk.valid().as_bytes() {
            match b {
                b'"' => out.extend_from_slice(b"\\\""),
                b'\\' => out.extend_from_slice(b"\\\\"),
                b'\n' => out.extend_from_slice(b"\\n"),
                b'\r' => out.extend_from_slice(b"\\r"),
                b'\t' => out.extend_from_slice(b"\\t"),
                0..0x20 | 0x7f => {
                    out.extend_from_slice(b"\\u00");
                    out.push(HEX[(b >> 4) as usize]);
                    out.push(HEX[(b & 0xf) as usize]);
                }
                _ => out.push(b),
            }
        }
        if !chunk.invalid().is_empty() {
            out.extend_from_slice("\u{fffd}".as_bytes());
        }
    }
    out.push(b'"');
}

/// `t` as RFC 3339 in UTC with milliseconds: `2026-11-24T12:15:53.123Z`.
fn rfc3339_millis(t: SystemTime, out: &mut Vec<u8>) {
    let since = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    let two = |n: u64, out: &mut Vec<u8>| out.extend_from_slice(&[b'0' + (n / 10) as u8, b'0' + (n % 10) as u8]);
    let mut year = itoa::Buffer::new();
    out.extend_from_slice(year.format(y).as_bytes());
    out.push(b'-');
    two(m as u64, out);
    out.push(b'-');
    two(d as u64, out);
    out.push(b'T');
    two(rem / 3600, out);
    out.push(b':');
    two(rem / 60 % 60, out);
    out.push(b':');
    two(rem % 60, out);
    out.push(b'.');
    let ms = since.subsec_millis();
    out.extend_from_slice(&[b'0' + (ms / 100) as u8, b'0' + (ms / 10 % 10) as u8, b'0' + (ms % 10) as u8]);
    out.push(b'Z');
}

/// The proleptic Gregorian date of a day number counted from 1970-01-01
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_raw_request_line_gives_its_method_and_path() {
        let (m, u) = request_line(b"POST /a/b?x=1 HTTP/1.1\r\nHost: h\r\n\r\n");
        assert_eq!((m.as_str(), u.path()), ("POST", "/a/b"));
        let (m, u) = request_line(b"\x16\x03\x01 garbage");
        assert_eq!((m.as_str(), u.path()), ("-", "/"));
        let (m, u) = request_line(b"");
        assert_eq!((m.as_str(), u.path()), ("-", "/"));
    }

    #[test]
    fn times_are_rfc3339_utc_with_milliseconds() {
        let mut out = Vec::new();
        rfc3339_millis(SystemTime::UNIX_EPOCH + Duration::from_millis(1_795_954_553_123), &mut out);
        assert_eq!(String::from_utf8(out).expect("ascii"), "2026-11-29T12:15:53.123Z");
        let mut out = Vec::new();
        rfc3339_millis(SystemTime::UNIX_EPOCH + Duration::from_secs(951_782_400), &mut out);
        assert_eq!(String::from_utf8(out).expect("ascii"), "2000-02-29T00:00:00.000Z");
    }

    #[test]
    fn any_bytes_become_a_valid_json_string() {
        let raw: &[u8] = b"/a\"b\\c\n\x01\x7f\xff/\xc3\xa9";
        let mut out = Vec::new();
        json_string(raw, &mut out);
        let back: String = serde_json::from_slice(&out).expect("valid JSON");
        assert_eq!(back, "/a\"b\\c\n\u{1}\u{7f}\u{fffd}/é");
    }

    #[test]
    fn a_line_is_one_json_object_with_every_field() {
        let entry = Entry {
            time: SystemTime::UNIX_EPOCH,
            started: Instant::now(),
            client: "2001:db8::1".parse().expect("ip"),
            method: Method::GET,
            uri: "/x%22y?q=1".parse().expect("uri"),
            status: 429,
            bytes_in: Some(Arc::new(AtomicU64::new(7))),
            bytes_out: 12,
            duration: Duration::from_micros(1_234_567),
            upstream: None,
            rule: Some("per-ip".into()),
            request_id: HeaderValue::from_static("abc"),
        };
        let mut out = Vec::new();
        render(&entry, &mut out);
        assert_eq!(out.last(), Some(&b'\n'));
        let v: serde_json::Value = serde_json::from_slice(&out).expect("JSON");
        assert_eq!(
            v,
            serde_json::json!({"time": "1970-01-01T00:00:00.000Z", "client": "2001:db8::1", "method": "GET",
                "path": "/x%22y", "status": 429, "bytes_in": 7, "bytes_out": 12, "duration_ms": 1234.567,
                "upstream": null, "rule": "per-ip", "request_id": "abc"})
        );
    }
}
