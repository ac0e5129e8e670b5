//! The access log: one JSON object per line and per request, written by a
//! dedicated thread so that no request ever waits on the disk.
//!
//! A request's [`Entry`] is filled in as the request goes ([`Note`]) and
//! handed over, through a bounded queue, when its response body ends or
//! the client goes away ([`Logged`] and [`Pending`] send it when dropped).
//! A full queue drops the line and counts it in
//! `tollgate_access_log_dropped_total`: a slow disk costs log lines, never
//! latency. The writer ([`writer`]) renders the lines, writes what is
//! queued in one go, leaves no torn line when a write is cut short, and
//! reopens its file after a SIGHUP, so logrotate can move the file away
//! and the next lines land in a new one at the configured path.
//!
//! With `[log] access = "off"` there is no [`AccessLog`]: the request path
//! allocates nothing and pays one `None` check per hook.

use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::header::{HOST, HeaderValue, REFERER, USER_AGENT};
use http::uri::Authority;
use http::{Method, Request, Uri, Version};
use hyper::body::{Body, Frame, SizeHint};
use prometheus::IntCounter;

use crate::config::AccessLogTarget;
use crate::obs::trace::{Trace, Tracer};

mod entry;
mod line;
mod writer;

pub use entry::Entry;
use entry::Message;
use writer::Writer;

/// Lines waiting for the writer at most. At 50 000 requests a second this
/// is some 80 ms of disk stall absorbed before lines are dropped; each
/// waiting line holds a few hundred bytes.
pub const QUEUE: usize = 4096;

/// The status logged for a request whose client went away before its
/// response head was sent (nginx's 499, "client closed request").
pub const CLIENT_GONE: u16 = 499;

/// The request path's handle on the access log.
pub struct AccessLog {
    shared: Arc<Shared>,
}

struct Shared {
    /// The writer's queue; `None` when only spans are recorded (`[log]
    /// access = "off"` with `[tracing]`).
    queue: Option<SyncSender<Message>>,
    tracer: Option<Arc<Tracer>>,
    /// Set by SIGHUP; the writer reopens its file before its next write.
    reopen: Arc<AtomicBool>,
    dropped: IntCounter,
}

impl AccessLog {
    /// Starts the writer thread for `target`; `None` when the log is off
    /// and no span is recorded either. With `tracer`, the entries of
    /// sampled requests also become spans, whether or not the log is on.
    pub fn start(
        target: &AccessLogTarget,
        dropped: IntCounter,
        tracer: Option<Arc<Tracer>>,
    ) -> std::io::Result<Option<AccessLog>> {
        let reopen = Arc::new(AtomicBool::new(false));
        let queue = if *target == AccessLogTarget::Off {
            if tracer.is_none() {
                return Ok(None);
            }
            None
        } else {
            let (queue, rx) = sync_channel(QUEUE);
            let writer = Writer {
                target: target.clone(),
                reopen: reopen.clone(),
                dropped: dropped.clone(),
                out: None,
                torn: false,
            };
            std::thread::Builder::new().name("access-log".into()).spawn(move || writer.run(rx))?;
            Some(queue)
        };
        Ok(Some(AccessLog { shared: Arc::new(Shared { queue, tracer, reopen, dropped }) }))
    }

    /// Opens an entry for a request that has just arrived, when it is
    /// logged or traced. Until the response is known its status says the
    /// client went away.
    pub fn begin(
        &self,
        method: &Method,
        uri: &Uri,
        client: IpAddr,
        request_id: &HeaderValue,
        trace: Option<Trace>,
    ) -> Option<Pending> {
        if self.shared.queue.is_none() && !trace.as_ref().is_some_and(|t| t.context.sampled) {
            return None;
        }
        Some(Pending {
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
                host: None,
                version: None,
                user_agent: None,
                referer: None,
                upstream_answer: None,
                tls: None,
                trace,
                route: None,
                decision: None,
                store: None,
            })),
        })
    }

    /// [`AccessLog::begin`] for a request hyper parsed: its protocol, host
    /// (the `Host` header, or HTTP/2's `:authority`), user agent and
    /// referer too; `tls` is the connection's TLS version, if any.
    pub fn begin_request<B>(
        &self,
        req: &Request<B>,
        client: IpAddr,
        request_id: &HeaderValue,
        tls: Option<&'static str>,
        trace: Option<Trace>,
    ) -> Option<Pending> {
        let mut pending = self.begin(req.method(), req.uri(), client, request_id, trace)?;
        if let Some(e) = &mut pending.entry {
            let h = req.headers();
            e.host = h
                .get(HOST)
                .cloned()
                .or_else(|| req.uri().authority().and_then(|a| HeaderValue::from_str(a.as_str()).ok()));
            e.version = Some(req.version());
            e.user_agent = h.get(USER_AGENT).cloned();
            e.referer = h.get(REFERER).cloned();
            e.tls = tls;
        }
        Some(pending)
    }

    /// [`AccessLog::begin`] for a request answered before hyper parsed it,
    /// from the first bytes of its connection (`head`, HTTP/1): its request
    /// line, `Host`, `User-Agent` and `Referer` as far as they arrived.
    pub fn begin_raw(&self, head: &[u8], client: IpAddr, request_id: &HeaderValue) -> Option<Pending> {
        let (method, uri) = request_line(head);
        let mut pending = self.begin(&method, &uri, client, request_id, None)?;
        if let Some(e) = &mut pending.entry {
            let mut lines = head.split(|&b| b == b'\n').map(|l| l.strip_suffix(b"\r").unwrap_or(l));
            e.version = match lines.next().and_then(|l| l.rsplit(|&b| b == b' ').next()) {
                Some(b"HTTP/1.1") => Some(Version::HTTP_11),
                Some(b"HTTP/1.0") => Some(Version::HTTP_10),
                _ => None,
            };
            // Up to the blank line; a header cut off by the read is left out.
            for line in lines.take_while(|l| !l.is_empty()) {
                let Some(colon) = line.iter().position(|&b| b == b':') else { continue };
                let Ok(value) = HeaderValue::from_bytes(line[colon + 1..].trim_ascii()) else { continue };
                let name = &line[..colon];
                let field = match () {
                    _ if name.eq_ignore_ascii_case(b"host") => &mut e.host,
                    _ if name.eq_ignore_ascii_case(b"user-agent") => &mut e.user_agent,
                    _ if name.eq_ignore_ascii_case(b"referer") => &mut e.referer,
                    _ => continue,
                };
                field.get_or_insert(value);
            }
        }
        Some(pending)
    }

    /// Makes the writer reopen its file before the next line (SIGHUP).
    pub fn reopen(&self) {
        self.shared.reopen.store(true, Ordering::Relaxed);
    }

    /// Waits, up to `within`, until every line queued so far is written:
    /// at shutdown, after the last request.
    pub async fn flush(&self, within: Duration) {
        let Some(queue) = &self.shared.queue else { return };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let deadline = tokio::time::Instant::now() + within;
        let mut msg = Message::Flush(tx);
        loop {
            match queue.try_send(msg) {
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

    /// The response head is known: its status. A request answered with
    /// no decision noted was refused before the rules were asked (a bad
    /// request, the deny list, a missing token).
    pub fn respond(&mut self, status: u16) {
        if let Some(e) = &mut self.entry {
            e.status = status;
            e.decision.get_or_insert("refused");
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let Some(mut entry) = self.entry.take() else { return };
        entry.duration = entry.started.elapsed();
        if let Some(tracer) = &self.shared.tracer
            && let Some(span) = entry.span()
        {
            tracer.export(span);
        }
        if let Some(queue) = &self.shared.queue
            && let Err(TrySendError::Full(_)) = queue.try_send(Message::Line(entry))
        {
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

    /// The client address as tollgate resolved it (see [`crate::wire::client`]).
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

    /// What the upstream answered (its status, or `None` when it gave no
    /// response head) and how long it took.
    pub fn upstream_answer(&mut self, status: Option<u16>, took: Duration) {
        if let Some(e) = &mut self.0 {
            e.upstream_answer = Some((status, took));
        }
    }

    /// Whether the request's span is being recorded (it is sampled): the
    /// notes only a span needs are taken then only.
    pub fn traced(&self) -> bool {
        self.0.as_ref().is_some_and(|e| e.sampled())
    }

    /// The route the request took (its path prefix), for its span.
    pub fn route(&mut self, prefix: &str) {
        if let Some(e) = &mut self.0 {
            e.route = Some(prefix.to_string());
        }
    }

    /// What the rules decided: `allowed`, `limited`, `refused` (before the
    /// store was asked) or `store_unavailable`.
    pub fn decision(&mut self, decision: &'static str) {
        if let Some(e) = &mut self.0 {
            e.decision = Some(decision);
        }
    }

    /// How long the store round took.
    pub fn store_time(&mut self, took: Duration) {
        if let Some(e) = &mut self.0 {
            e.store = Some(took);
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
    fn a_raw_head_gives_its_protocol_host_agent_and_referer() {
        let (tx, _rx) = sync_channel(1);
        let log = AccessLog {
            shared: Arc::new(Shared {
                queue: Some(tx),
                tracer: None,
                reopen: Arc::new(AtomicBool::new(false)),
                dropped: IntCounter::new("t", "t").expect("counter"),
            }),
        };
        let id = HeaderValue::from_static("id");
        let ip = IpAddr::from([192, 0, 2, 1]);
        let mut p = log
            .begin_raw(b"GET /x HTTP/1.0\r\nHOST: a.test\r\nUser-Agent:  ua/1 \r\nX: y\r\n\r\nReferer: body", ip, &id)
            .expect("logged");
        let e = p.entry.take().expect("an entry");
        assert_eq!(
            (e.version, e.host, e.user_agent, e.referer),
            (
                Some(Version::HTTP_10),
                Some(HeaderValue::from_static("a.test")),
                Some(HeaderValue::from_static("ua/1")),
                None
            )
        );
        let mut p = log.begin_raw(b"GET / HTTP/1.1\r\nreferer: https://r.test/\r\nho", ip, &id).expect("logged");
        let e = p.entry.take().expect("an entry");
        assert_eq!(
            (e.version, e.host, e.referer),
            (Some(Version::HTTP_11), None, Some(HeaderValue::from_static("https://r.test/")))
        );
    }
}
