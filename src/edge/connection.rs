//! One client connection, from its accept (or TLS handshake) to its close:
//! hyper's HTTP/1.1 and HTTP/2 server over [`IdleIo`], each request handed
//! to the [`Proxy`], and the limits on the connection's life: idle and send
//! timeouts, `max_requests_per_connection`, `max_connection_age`, the drain
//! at shutdown.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Either;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use prometheus::IntGauge;
use tokio::sync::OwnedSemaphorePermit;

use crate::config::Config;
use crate::edge::drain::{Retire, Watcher};
use crate::edge::idle::{IdleIo, Inflight, InflightBody};
use crate::edge::send_budget::{BudgetedBody, SendBudget};
use crate::proxy::{LoggedBody, Proxy};
use crate::upstream::tunnel::{self, Tunnels};
use crate::wire::client::Peer;

/// The most an HTTP/2 stream's response holds waiting for the client's
/// flow-control window. All streams of a connection together hold at most
/// [`crate::edge::send_budget::SEND_BUDGET`].
const H2_SEND_BUFFER: usize = 64 * 1024;

/// Streams one HTTP/2 client may have open at once (RFC 9113 recommends
/// no fewer than 100; nginx allows 128). What a stream holds beyond the
/// connection's shared budget is its own: its upstream connection, with
/// the up to 16 KiB read from it along with the response head. Measured
/// (debug build): a connection of 100 streams whose client takes nothing
/// grows tollgate by 4.6 to 6 MiB, against 15 to 38 MiB with 256 streams
/// and no shared budget (tests/h2_slow_readers.rs).
const H2_MAX_STREAMS: u32 = 100;

pub(crate) fn connection_builder(config: &Config) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // `listen.header_read_timeout` is kept by `IdleIo` (the preface of
        // an HTTP/2 connection too, which hyper's did not time), without
        // hyper's timer and allocation per request.
        .header_read_timeout(None::<Duration>)
        // Room for the request line and the headers: the exact limits are
        // checked by the proxy, which answers them with JSON; hyper's own
        // 431 only catches what does not fit at all.
        .max_buf_size((config.listen.max_header_bytes + config.listen.max_uri_bytes + 1024).max(8192))
        .keep_alive(true);
    // What waits for a slow reader is bounded per connection: HTTP/1.1
    // queues a response body only while less than `max_buf_size` is queued
    // (one response at a time), and HTTP/2 by `SendBudget` (its response
    // bodies are wrapped in `serve_proxy`), of which a stream holds at most
    // `H2_SEND_BUFFER`.
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(H2_MAX_STREAMS)
        .max_send_buf_size(H2_SEND_BUFFER)
        .max_header_list_size(h2_header_list_size(config));
    builder
}

/// HTTP/2's bound on a request's header list, above which h2 answers a
/// bare 431 itself. HTTP/2 counts a field as name + value + 32 bytes (RFC
/// 9113 §6.5.2), `max_header_bytes` as name + value + 4: the smallest field
/// (`x: `, 5 bytes) weighs 6.6 times more to HTTP/2. Seven times
/// `max_header_bytes`, and room for the pseudo-headers, lets every request
/// within `max_header_bytes` reach the proxy, whose JSON 431 then decides
/// as it does for HTTP/1.1; h2's own only catches what does not fit at all.
fn h2_header_list_size(config: &Config) -> u32 {
    let listen = &config.listen;
    let bytes = listen.max_header_bytes.saturating_mul(7).saturating_add(listen.max_uri_bytes + 1024);
    u32::try_from(bytes).unwrap_or(u32::MAX)
}

/// What every client connection is served with.
pub(crate) struct ConnectionSetup {
    builder: auto::Builder<TokioExecutor>,
    idle_timeout: Duration,
    header_read_timeout: Duration,
    send_timeout: Duration,
    /// `listen.max_requests_per_connection`.
    max_requests: usize,
    /// `listen.max_connection_age`.
    max_age: Option<Duration>,
    tunnels: Tunnels,
}

impl ConnectionSetup {
    pub(crate) fn new(config: &Config, tunnels: Tunnels) -> ConnectionSetup {
        ConnectionSetup {
            builder: connection_builder(config),
            idle_timeout: config.listen.idle_timeout,
            header_read_timeout: config.listen.header_read_timeout,
            send_timeout: config.listen.send_timeout,
            max_requests: config.listen.max_requests_per_connection,
            max_age: config.listen.max_connection_age,
            tunnels,
        }
    }
}

/// One client connection, as each of its requests sees it.
struct Conn {
    proxy: Arc<Proxy>,
    peer: Arc<Peer>,
    tunnels: Tunnels,
    slot: Arc<Slot>,
    inflight: Inflight,
    /// HTTP/2's response bodies' shared budget.
    budget: SendBudget,
    retire: Retire,
    /// `listen.max_requests_per_connection`.
    max_requests: usize,
}

/// A client connection's place under `max_connections`, held by the
/// connection and by a tunnel it turned into, until both are gone.
pub(crate) struct Slot {
    _permit: OwnedSemaphorePermit,
    active: IntGauge,
}

impl Slot {
    pub(crate) fn new(permit: OwnedSemaphorePermit, active: IntGauge) -> Slot {
        active.inc();
        Slot { _permit: permit, active }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.active.dec();
    }
}

/// Serves one client connection (plain TCP, or TLS once its handshake is
/// done) until it closes, or until shutdown closes it gracefully.
pub(crate) async fn serve_connection<IO>(
    stream: IO,
    peer: SocketAddr,
    proxy: Arc<Proxy>,
    client: Arc<Peer>,
    setup: &ConnectionSetup,
    watcher: Watcher,
    slot: Arc<Slot>,
) where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let inflight = Inflight::counting_gone(proxy.metrics.client_gone_total.clone());
    let budget = SendBudget::default();
    let io = IdleIo::new(stream, setup.idle_timeout, setup.send_timeout, inflight.clone(), budget.clone())
        .with_header_timeout(setup.header_read_timeout);
    let retire = Retire::default();
    // What a request of this connection needs: one shared value, so a
    // request clones one `Arc`, not each part.
    let conn = Arc::new(Conn {
        proxy,
        peer: client,
        tunnels: setup.tunnels.clone(),
        slot,
        inflight,
        budget,
        retire: retire.clone(),
        max_requests: setup.max_requests,
    });
    // A connection is asked to close at its age from a timer of its own:
    // nothing per request or per poll.
    let aging = setup.max_age.map(|age| {
        let retire = retire.clone();
        AbortOnDrop(tokio::spawn(async move {
            tokio::time::sleep(age).await;
            retire.ask();
        }))
    });
    // The closure stays this small so that hyper's dispatcher, inlining
    // it, builds the request's future in place: a larger one was called
    // out of line and its future (several KiB) copied on every request.
    let svc = service_fn(move |req| serve_request(conn.clone(), req));
    let conn = setup.builder.serve_connection_with_upgrades(TokioIo::new(io), svc).into_owned();
    if let Err(e) = watcher.watch_retiring(conn, retire).await {
        tracing::debug!(error = %e, %peer, "connection ended with an error");
    }
    drop(aging);
}

/// A response body as hyper sends it: HTTP/2's within the connection's
/// send budget, HTTP/1.1's (and a tunnel's) as it is.
type ConnBody = Either<BudgetedBody<InflightBody<LoggedBody>>, InflightBody<LoggedBody>>;

/// One request of a connection, from the proxy's answer to the body
/// hyper sends. Counted in flight from its first poll (hyper polls an
/// HTTP/1.1 request's future as it takes it, an HTTP/2 stream's as soon
/// as its task runs) until its response body ends.
async fn serve_request(
    conn: Arc<Conn>,
    req: hyper::Request<hyper::body::Incoming>,
) -> Result<hyper::Response<ConnBody>, Infallible> {
    // In flight until the response body ends: a streaming response is not
    // an idle connection (see `InflightBody`).
    let mut busy = conn.inflight.start();
    // The connection's last request: HTTP/2 gets a GOAWAY (streams
    // already open finish); HTTP/1.1 closes after this response, which
    // says so (hyper would say it only if told before its head).
    let last = conn.inflight.started() >= conn.max_requests;
    if last {
        conn.retire.ask();
    }
    let h2 = req.version() == hyper::Version::HTTP_2;
    let mut resp = conn.proxy.handle(req, &conn.peer).await;
    if resp.status() == hyper::StatusCode::SWITCHING_PROTOCOLS
        && let Some(pending) = resp.extensions_mut().remove::<tunnel::Pending>()
    {
        // The tunnel keeps the connection's slot, and its request stays in
        // flight so that the connection's own idle timeout leaves it to the
        // tunnel's.
        busy.answered();
        tokio::spawn(pending.run(conn.tunnels.clone(), (conn.slot.clone(), busy)));
        return Ok(resp.map(|body| Either::Right(InflightBody::untracked(body))));
    }
    if last && !h2 {
        resp.headers_mut().insert(hyper::header::CONNECTION, hyper::header::HeaderValue::from_static("close"));
    }
    // HTTP/1.1 sends one response at a time and hyper bounds what it
    // queues: only HTTP/2's streams share a budget (and the per-piece
    // count costs HTTP/1.1 nothing).
    Ok(resp.map(|body| match h2 {
        true => Either::Left(conn.budget.body(InflightBody::new(body, busy))),
        false => Either::Right(InflightBody::new(body, busy)),
    }))
}

/// A task that ends with its owner: a connection's age timer.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
