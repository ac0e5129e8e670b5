//! What every integration test shares: a real upstream, a real tollgate on
//! port 0 with an injected clock, and a small HTTP client.
//!
//! - [`Upstream`]: an in-process hyper 1 server on 127.0.0.1:0 that echoes the
//!   request it received as JSON ([`Echo`]). Request headers tell it to
//!   misbehave: `x-echo-delay-ms` (answer late), `x-echo-status` (answer that
//!   status), `x-echo-reset` (close the connection without answering),
//!   `x-echo-hold` (wait until the test calls [`Upstream::release`]),
//!   `x-echo-stream` (stream the request body back frame by frame) and
//!   `x-echo-hop` (answer with hop-by-hop headers).
//! - [`Tollgate`]: writes a config and rules into a temporary directory and
//!   runs [`Server`] in-process on a tokio task, with a [`ManualClock`]
//!   standing at [`T0`], so tests move time instead of sleeping.
//! - [`Call`]: one request over HTTP/1.1 or h2c (prior knowledge), and
//!   [`Reply`], the response read whole.
//! - [`big_upstream::BigUpstream`]: an upstream answering every request with
//!   one large body, for clients that do not read it.
//! - [`tls::TestCa`]: a certificate authority made in the test, and a TLS
//!   client that reports the certificate a server presented.
//! - [`relay::Relay`]: a fault-injecting TCP relay in front of one Redis
//!   node (holds replies, sends a command twice, resets connections).
//!
//! Some helpers are used by only some test files.
#![allow(dead_code)]

pub mod access_log;
pub mod big_upstream;
pub mod process;
pub mod redis;
pub mod relay;
pub mod tls;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};
use tempfile::TempDir;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio::task::JoinHandle;
use tollgate::config::Config;
use tollgate::edge::server::Server;
use tollgate::limiter::NANOS_PER_SEC;
use tollgate::limiter::clock::ManualClock;
use tollgate::ops::reload::Reloader;
use tollgate::proxy::Proxy;

/// Where every test's clock starts: a whole number of minutes and hours
/// since the epoch, so fixed and sliding windows of 1s, 10s, 60s and 1h all
/// start exactly here.
pub const T0: u64 = 1_800_000_000 * NANOS_PER_SEC;

/// How long a test waits for something that happens in the background (a
/// reload, requests reaching the upstream) before it fails. A bound, not a
/// pause: waits return as soon as the condition holds.
pub const DEADLINE: Duration = Duration::from_secs(15);

// ---------------------------------------------------------------------------
// The upstream
// ---------------------------------------------------------------------------

/// A running echo upstream. Stops when dropped.
pub struct Upstream {
    pub addr: SocketAddr,
    state: Arc<UpstreamState>,
    task: JoinHandle<()>,
}

struct UpstreamState {
    /// Connections accepted.
    connections: AtomicUsize,
    /// Requests received (headers read), whatever happened to them next.
    hits: AtomicUsize,
    /// Requests waiting on `x-echo-hold` right now.
    held: AtomicUsize,
    gate: Semaphore,
}

/// What the upstream received, as it echoes it.
#[derive(Debug, Clone)]
pub struct Echo {
    pub method: String,
    pub path: String,
    pub query: Option<String>,
    /// The HTTP version the upstream was spoken to in.
    pub version: String,
    /// Header name -> values in order received.
    pub headers: BTreeMap<String, Vec<String>>,
    pub body: String,
}

impl Echo {
    /// The single value of a header; panics if it came more than once.
    pub fn header(&self, name: &str) -> Option<&str> {
        let values = self.headers.get(name)?;
        assert_eq!(values.len(), 1, "header {name} arrived {} times: {values:?}", values.len());
        Some(values[0].as_str())
    }
}

impl Upstream {
    /// Starts an echo upstream on 127.0.0.1:0.
    pub async fn start() -> Upstream {
        // A backlog for the crowds the tests send (1,300 requests at once
        // through three proxies, each opening connections of its own):
        // tokio's default of 1024 overflowed, the kernel dropped a SYN, its
        // retry came a second later, and the proxy's connect timeout (1 s)
        // answered 504.
        let socket = tokio::net::TcpSocket::new_v4().expect("upstream socket");
        socket.bind("127.0.0.1:0".parse().expect("address")).expect("bind upstream");
        let listener = socket.listen(4096).expect("listen");
        let addr = listener.local_addr().expect("upstream address");
        let state = Arc::new(UpstreamState {
            connections: AtomicUsize::new(0),
            hits: AtomicUsize::new(0),
            held: AtomicUsize::new(0),
            gate: Semaphore::new(0),
        });
        let task = tokio::spawn({
            let state = state.clone();
            async move {
                loop {
                    let Ok((stream, _)) = listener.accept().await else { continue };
                    state.connections.fetch_add(1, Ordering::SeqCst);
                    let state = state.clone();
                    tokio::spawn(async move {
                        let svc = service_fn(move |req| echo(req, state.clone()));
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), svc)
                            .await;
                    });
                }
            }
        });
        Upstream { addr, state, task }
    }

    /// An address where nothing listens: connecting is refused.
    pub async fn refusing_addr() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        drop(listener);
        addr
    }

    /// Connections the upstream has accepted.
    pub fn connections(&self) -> usize {
        self.state.connections.load(Ordering::SeqCst)
    }

    /// Requests the upstream has received.
    pub fn hits(&self) -> usize {
        self.state.hits.load(Ordering::SeqCst)
    }

    /// Requests waiting on `x-echo-hold`.
    pub fn held(&self) -> usize {
        self.state.held.load(Ordering::SeqCst)
    }

    /// Lets `n` held requests (present or future) answer.
    pub fn release(&self, n: usize) {
        self.state.gate.add_permits(n);
    }

    /// Waits until exactly `n` requests are held.
    pub async fn wait_held(&self, n: usize) {
        eventually(&format!("{n} requests held at the upstream"), || async { self.held() == n }).await;
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type EchoBody = BoxBody<Bytes, hyper::Error>;

fn full<E>(b: impl Into<Bytes>) -> BoxBody<Bytes, E> {
    Full::new(b.into()).map_err(|never: Infallible| match never {}).boxed()
}

async fn echo(req: Request<Incoming>, state: Arc<UpstreamState>) -> Result<Response<EchoBody>, std::io::Error> {
    state.hits.fetch_add(1, Ordering::SeqCst);
    let flag = |name: &str| req.headers().contains_key(name);
    let number = |name: &str| -> Option<u64> { req.headers().get(name)?.to_str().ok()?.parse().ok() };
    if let Some(ms) = number("x-echo-delay-ms") {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if flag("x-echo-hold") {
        state.held.fetch_add(1, Ordering::SeqCst);
        state.gate.acquire().await.expect("gate never closes").forget();
        state.held.fetch_sub(1, Ordering::SeqCst);
    }
    if flag("x-echo-reset") {
        // An error from the service makes hyper drop the connection without
        // writing a response: the proxy sees the connection die mid-request.
        return Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "told to reset"));
    }
    let status = number("x-echo-status").and_then(|s| StatusCode::from_u16(s as u16).ok()).unwrap_or(StatusCode::OK);
    if flag("x-echo-stream") {
        // Every request body frame goes straight back as a response frame.
        let mut resp = Response::new(req.into_body().boxed());
        *resp.status_mut() = status;
        resp.headers_mut().insert("x-upstream", HeaderValue::from_static("echo"));
        return Ok(resp);
    }
    let hop = flag("x-echo-hop");
    let (parts, body) = req.into_parts();
    let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let mut headers = serde_json::Map::new();
    for name in parts.headers.keys() {
        let values: Vec<Value> =
            parts.headers.get_all(name).iter().map(|v| Value::from(String::from_utf8_lossy(v.as_bytes()))).collect();
        headers.insert(name.as_str().to_string(), Value::Array(values));
    }
    let echoed = json!({
        "method": parts.method.as_str(),
        "path": parts.uri.path(),
        "query": parts.uri.query(),
        "version": format!("{:?}", parts.version),
        "headers": headers,
        "body": String::from_utf8_lossy(&body),
    });
    let mut resp = Response::new(full(echoed.to_string()));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert("content-type", HeaderValue::from_static("application/json"));
    h.insert("x-upstream", HeaderValue::from_static("echo"));
    // `x-echo-header: name: value` comes back as a response header.
    for asked in parts.headers.get_all("x-echo-header") {
        if let Some((name, value)) = asked.to_str().ok().and_then(|a| a.split_once(':'))
            && let (Ok(name), Ok(value)) =
                (http::HeaderName::from_bytes(name.trim().as_bytes()), HeaderValue::from_str(value.trim()))
        {
            h.append(name, value);
        }
    }
    if hop {
        h.insert("connection", HeaderValue::from_static("x-upstream-hop"));
        h.insert("x-upstream-hop", HeaderValue::from_static("secret"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("proxy-authenticate", HeaderValue::from_static("Basic realm=\"upstream\""));
    }
    Ok(resp)
}

// ---------------------------------------------------------------------------
// tollgate
// ---------------------------------------------------------------------------

/// The main config most tests use: both listeners on 127.0.0.1:0, rules
/// from the `rules` directory, 127.0.0.1 a trusted proxy (so tests choose
/// the client address with `X-Forwarded-For`), one upstream `svc` at
/// `upstream`, routed from `/`.
pub fn config(upstream: SocketAddr) -> String {
    upstream_config(&format!("url = \"http://{upstream}\""), "")
}

/// [`config`] with the upstream's servers given by `servers` (a `url = ...`
/// or `servers = [...]` line) and `extra` lines in its table. A
/// `timeout` in `extra` replaces the default of 10 s.
pub fn upstream_config(servers: &str, extra: &str) -> String {
    let timeout = if extra.lines().any(|l| l.starts_with("timeout")) { "" } else { "timeout = \"10s\"\n" };
    format!(
        r#"[listen]
proxy = "127.0.0.1:0"
admin = "127.0.0.1:0"

[rules]
path = "rules"

[client]
trusted_proxies = ["127.0.0.1/32"]

[[upstream]]
name = "svc"
{servers}
{timeout}{extra}

[[route]]
path_prefix = "/"
upstream = "svc"
"#
    )
}

/// A tollgate running in-process. Stops when dropped.
pub struct Tollgate {
    /// The directory holding `tollgate.toml` and the rules; removed on drop.
    pub dir: TempDir,
    pub clock: ManualClock,
    pub proxy_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// `[listen] http_redirect`'s address, when configured.
    pub redirect_addr: Option<SocketAddr>,
    /// `[listen] decision`'s address, when configured.
    pub decision_addr: Option<SocketAddr>,
    /// `[listen] envoy_rls`'s address, when configured.
    pub envoy_rls_addr: Option<SocketAddr>,
    pub proxy: Arc<Proxy>,
    pub reloader: Arc<Reloader>,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Tollgate {
    /// The default [`config`] in front of `upstream`, with `rules` as
    /// `rules/rules.toml`.
    pub async fn start(upstream: &Upstream, rules: &str) -> Tollgate {
        Tollgate::with(&config(upstream.addr), &[("rules.toml", rules)]).await
    }

    /// `config` as `tollgate.toml`, and each `(name, text)` of `rules` as
    /// `rules/<name>`.
    pub async fn with(config: &str, rules: &[(&str, &str)]) -> Tollgate {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir(dir.path().join("rules")).expect("rules dir");
        for (name, text) in rules {
            std::fs::write(dir.path().join("rules").join(name), text).expect("write rules");
        }
        Tollgate::start_in(dir, config).await
    }

    /// Writes `config` as `tollgate.toml` into `dir` (already holding the
    /// rules, in whatever layout the test built) and starts.
    pub async fn start_in(dir: TempDir, config: &str) -> Tollgate {
        let path = dir.path().join("tollgate.toml");
        std::fs::write(&path, config).expect("write config");
        let lame_duck = config.contains("shutdown_delay");
        let config = Config::parse(&path, config).unwrap_or_else(|e| panic!("test config does not validate:\n{e}"));
        let clock = ManualClock::new(T0);
        let server = Server::bind(config, Arc::new(clock.clone())).await.unwrap_or_else(|e| panic!("bind: {e}"));
        let (tx, rx) = oneshot::channel::<()>();
        let (proxy_addr, admin_addr, redirect_addr, decision_addr, envoy_rls_addr) = (
            server.proxy_addr(),
            server.admin_addr(),
            server.redirect_addr(),
            server.decision_addr(),
            server.envoy_rls_addr(),
        );
        let (proxy, reloader) = (server.proxy(), server.reloader());
        // Stopping drains at once (as SIGINT does), without the lame-duck
        // delay of SIGTERM, unless the test is about it: the running config
        // stays as written (`tollgate check --running` compares it).
        let task = tokio::spawn(server.run_until(async move {
            let _ = rx.await;
            if lame_duck { tollgate::edge::process::Stop::LameDuck } else { tollgate::edge::process::Stop::Now }
        }));
        Tollgate {
            dir,
            clock,
            proxy_addr,
            admin_addr,
            redirect_addr,
            decision_addr,
            envoy_rls_addr,
            proxy,
            reloader,
            shutdown: Some(tx),
            task: Some(task),
        }
    }

    /// The rules directory of [`Tollgate::with`].
    pub fn rules_dir(&self) -> PathBuf {
        self.dir.path().join("rules")
    }

    /// Moves the injected clock forward.
    pub fn advance(&self, by: Duration) {
        self.clock.advance(by);
    }

    /// A request to the proxy listener.
    pub fn call(&self, method: &str, path: &str) -> Call {
        Call::new(method, self.proxy_addr, path)
    }

    /// A GET to the proxy listener.
    pub fn get(&self, path: &str) -> Call {
        self.call("GET", path)
    }

    /// A GET to the admin listener.
    pub async fn admin(&self, path: &str) -> Reply {
        Call::new("GET", self.admin_addr, path).send().await
    }

    /// `/metrics`, as text.
    pub async fn metrics(&self) -> String {
        let reply = self.admin("/metrics").await;
        assert_eq!(reply.status, StatusCode::OK);
        reply.text().to_string()
    }

    /// `/rules`, as JSON.
    pub async fn rules(&self) -> Value {
        let reply = self.admin("/rules").await;
        assert_eq!(reply.status, StatusCode::OK);
        reply.json()
    }

    /// Stops accepting, drains in-flight requests and waits for the server
    /// to return.
    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            tokio::time::timeout(DEADLINE, task).await.expect("server stops").expect("server task");
        }
    }
}

impl Drop for Tollgate {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Replaces a file the way editors and config tools do: write a hidden
/// temporary file next to it, then rename it over the old one, so a reader
/// never sees half a file.
pub fn write_atomic(path: &Path, text: &str) {
    let name = path.file_name().and_then(|n| n.to_str()).expect("file name");
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).expect("write temporary file");
    std::fs::rename(&tmp, path).expect("rename over the old file");
}

/// Polls `condition` every 25 ms until it holds; fails the test after
/// [`DEADLINE`].
pub async fn eventually<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let started = Instant::now();
    loop {
        if condition().await {
            return;
        }
        assert!(started.elapsed() < DEADLINE, "gave up after {DEADLINE:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// One series of a Prometheus text exposition: the value of `name` with
/// exactly the labels `labels` (in any order), if present.
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let want: BTreeMap<&str, &str> = labels.iter().copied().collect();
    text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()).find_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let (series_name, got) = match series.split_once('{') {
            Some((n, rest)) => (n, parse_labels(rest.strip_suffix('}')?)?),
            None => (series, BTreeMap::new()),
        };
        (series_name == name
            && got.iter().map(|(k, v)| (k.as_str(), v.as_str())).eq(want.iter().map(|(k, v)| (*k, *v))))
        .then(|| value.parse().ok())?
    })
}

fn parse_labels(s: &str) -> Option<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    let mut rest = s;
    while !rest.is_empty() {
        let (k, after) = rest.split_once("=\"")?;
        let end = after.find('"')?;
        out.insert(k.trim_start_matches(',').to_string(), after[..end].to_string());
        rest = &after[end + 1..];
    }
    Some(out)
}

/// A rule decision counter (`tollgate_rule_decisions_total`), 0 when absent.
pub fn decisions(text: &str, rule: &str, decision: &str) -> f64 {
    metric(text, "tollgate_rule_decisions_total", &[("rule", rule), ("decision", decision)]).unwrap_or(0.0)
}

// ---------------------------------------------------------------------------
// The client
// ---------------------------------------------------------------------------

/// The body type the test client sends: a whole buffer or a channel.
pub type ClientBody = BoxBody<Bytes, Infallible>;

/// One request to build and send.
pub struct Call {
    method: Method,
    addr: SocketAddr,
    path: String,
    headers: Vec<(HeaderName, HeaderValue)>,
    body: Bytes,
    h2: bool,
}

/// A response, read whole.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub version: Version,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Call {
    pub fn new(method: &str, addr: SocketAddr, path: &str) -> Call {
        Call {
            method: Method::from_bytes(method.as_bytes()).expect("method"),
            addr,
            path: path.to_string(),
            headers: Vec::new(),
            body: Bytes::new(),
            h2: false,
        }
    }

    pub fn header(mut self, name: &str, value: &str) -> Call {
        self.headers.push((
            HeaderName::from_bytes(name.as_bytes()).expect("header name"),
            HeaderValue::from_str(value).expect("header value"),
        ));
        self
    }

    /// Sets `X-Forwarded-For`: the client address tollgate keys on, since
    /// the test client connects from a trusted 127.0.0.1. (Reads as "a call
    /// from this IP", not a conversion.)
    #[allow(clippy::wrong_self_convention)]
    pub fn from_ip(self, ip: &str) -> Call {
        self.header("x-forwarded-for", ip)
    }

    pub fn body(mut self, body: impl Into<Bytes>) -> Call {
        self.body = body.into();
        self
    }

    /// Speak HTTP/2 over cleartext with prior knowledge instead of HTTP/1.1.
    pub fn h2(mut self) -> Call {
        self.h2 = true;
        self
    }

    fn request<B>(&self, body: B) -> Request<B> {
        let uri: Uri = format!("http://{}{}", self.addr, self.path).parse().expect("uri");
        let mut req = Request::builder().method(self.method.clone()).uri(uri).body(body).expect("request");
        for (k, v) in &self.headers {
            req.headers_mut().append(k.clone(), v.clone());
        }
        req
    }

    /// Sends the request and reads the whole response. A fresh client per
    /// call: no connection outlives the test's runtime.
    pub async fn send(self) -> Reply {
        let req = self.request(full(self.body.clone()));
        let resp = self.start(req).await;
        let (parts, body) = resp.into_parts();
        let body = tokio::time::timeout(DEADLINE, body.collect())
            .await
            .expect("response body within the deadline")
            .expect("response body")
            .to_bytes();
        Reply { status: parts.status, version: parts.version, headers: parts.headers, body }
    }

    /// Sends the request with a body the test feeds through the returned
    /// sender, and returns the response as soon as its head arrives.
    pub async fn send_streaming(self) -> (mpsc::Sender<Bytes>, Response<Incoming>) {
        let (tx, rx) = mpsc::channel(1);
        let req = self.request(ChannelBody(rx).boxed());
        (tx, self.start(req).await)
    }

    async fn start(&self, req: Request<ClientBody>) -> Response<Incoming> {
        let client: Client<_, ClientBody> = Client::builder(TokioExecutor::new()).http2_only(self.h2).build_http();
        tokio::time::timeout(DEADLINE, client.request(req))
            .await
            .expect("response head within the deadline")
            .expect("the proxy answers")
    }
}

/// A request body fed from a channel, one frame per message.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|chunk| chunk.map(|b| Ok(Frame::data(b))))
    }
}

impl Reply {
    /// A header's value; panics if it is not text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().expect("text header"))
    }

    pub fn text(&self) -> &str {
        std::str::from_utf8(&self.body).expect("UTF-8 body")
    }

    /// A body tollgate wrote, without the `request_id` it ends with, after
    /// checking that the id is the response's `X-Request-Id`: for comparing
    /// whole bodies with a fixed text.
    pub fn text_without_id(&self) -> String {
        let id = self.header("x-request-id").expect("tollgate's answers carry X-Request-Id");
        let tail = format!(r#","request_id":"{id}"}}"#);
        let body = self.text();
        let Some(rest) = body.strip_suffix(&tail) else { panic!("body does not end with {tail}: {body}") };
        format!("{rest}}}")
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", self.text()))
    }

    /// The upstream's echo of the request it received.
    pub fn echo(&self) -> Echo {
        assert_eq!(
            self.header("x-upstream"),
            Some("echo"),
            "not an upstream answer: {} {:?}",
            self.status,
            self.text()
        );
        let v = self.json();
        let s = |k: &str| v[k].as_str().map(str::to_string);
        let headers = v["headers"]
            .as_object()
            .expect("headers object")
            .iter()
            .map(|(k, vals)| {
                let vals = vals.as_array().expect("values").iter().map(|x| x.as_str().expect("text").to_string());
                (k.clone(), vals.collect())
            })
            .collect();
        Echo {
            method: s("method").expect("method"),
            path: s("path").expect("path"),
            query: s("query"),
            version: s("version").expect("version"),
            headers,
            body: s("body").expect("body"),
        }
    }

    /// The rate-limit headers as `(name, value)` pairs, for comparing whole
    /// sets at once.
    pub fn ratelimit_headers(&self) -> Vec<(String, String)> {
        let names = [
            "x-ratelimit-limit",
            "x-ratelimit-remaining",
            "x-ratelimit-reset",
            "x-ratelimit-retry-after",
            "retry-after",
            "ratelimit-policy",
            "ratelimit",
        ];
        names.iter().filter_map(|n| self.header(n).map(|v| (n.to_string(), v.to_string()))).collect()
    }
}

/// Sends `n` requests at once (each built by `make`) and returns the
/// replies in completion order.
pub async fn burst(n: usize, make: impl Fn(usize) -> Call) -> Vec<Reply> {
    let barrier = Arc::new(tokio::sync::Barrier::new(n));
    let mut set = tokio::task::JoinSet::new();
    for i in 0..n {
        let call = make(i);
        let barrier = barrier.clone();
        set.spawn(async move {
            barrier.wait().await;
            call.send().await
        });
    }
    let mut replies = Vec::with_capacity(n);
    while let Some(r) = set.join_next().await {
        replies.push(r.expect("request task"));
    }
    replies
}

/// How many replies have `status`.
pub fn count(replies: &[Reply], status: u16) -> usize {
    replies.iter().filter(|r| r.status.as_u16() == status).count()
}

/// Sends `n` requests one after another and returns their statuses.
pub async fn statuses(n: usize, make: impl Fn() -> Call) -> Vec<u16> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(make().send().await.status.as_u16());
    }
    out
}

/// `n` copies of `status` followed by `m` of `then`, for comparing with
/// [`statuses`].
pub fn expect_statuses(n: usize, status: u16, m: usize, then: u16) -> Vec<u16> {
    std::iter::repeat_n(status, n).chain(std::iter::repeat_n(then, m)).collect()
}
