//! One client connection, from its accept (or TLS handshake) to its close:
//! hyper's HTTP/1.1 and HTTP/2 server over [`IdleIo`], each request handed
//! to the [`Proxy`], and the limits on the connection's life: idle and send
//! timeouts, `max_requests_per_connection`, `max_connection_age`, the drain
//! at shutdown.

use std::convert::Infallible;
use std::future::{Future, poll_fn};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Either;
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper::service::{Service, service_fn};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use prometheus::IntGauge;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::OwnedSemaphorePermit;

use crate::config::Config;
use crate::edge::drain::{Retire, Signal, Watcher};
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

/// How long an HTTP/1.1 connection waits for its next request with
/// hyper's buffers and state before it gives them back (see
/// [`crate::edge::idle::park`]), and an HTTP/2 connection before h2 gives
/// back its buffers: long enough that a busy connection keeps them,
/// request after request.
const PARK_AFTER: Duration = Duration::from_secs(1);

/// The server setup of both protocols (`tollgate-floor`'s, whose
/// connections are not parked); tollgate's own connections take the same
/// settings from [`http1_builder`] and [`http2_builder`].
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

/// HTTP/1.1's server settings: those of [`connection_builder`].
fn http1_builder(config: &Config) -> http1::Builder {
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(None::<Duration>)
        .max_buf_size((config.listen.max_header_bytes + config.listen.max_uri_bytes + 1024).max(8192))
        .keep_alive(true);
    builder
}

/// HTTP/2's server settings: those of [`connection_builder`].
fn http2_builder(config: &Config) -> http2::Builder<TokioExecutor> {
    let mut builder = http2::Builder::new(TokioExecutor::new());
    builder
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
    h1: http1::Builder,
    h2: http2::Builder<TokioExecutor>,
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
            h1: http1_builder(config),
            h2: http2_builder(config),
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
    let mut io = IdleIo::new(stream, setup.idle_timeout, setup.send_timeout, inflight.clone(), budget.clone())
        .with_header_timeout(setup.header_read_timeout);
    let retire = Retire::default();
    // What a request of this connection needs: one shared value, so a
    // request clones one `Arc`, not each part.
    let conn = Arc::new(Conn {
        proxy,
        peer: client,
        tunnels: setup.tunnels.clone(),
        slot,
        inflight: inflight.clone(),
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
    let served = match first_bytes(&mut io).await {
        Some(true) => {
            // h2 gives back its buffers when a wake-up finds nothing to read
            // or write (vendor/h2/TOLLGATE-PATCH.md): the park timer's, once
            // the connection has idled for `PARK_AFTER`, is that wake-up.
            // Nothing takes the park itself: HTTP/2 is never parked.
            io.park_when_idle(PARK_AFTER);
            watcher.watch_retiring(setup.h2.serve_connection(TokioIo::new(io), svc), retire).await
        }
        Some(false) => serve_h1(io, svc, &setup.h1, &inflight, watcher.signal(Some(retire))).await,
        // Closed, or timed out, before saying anything: how its shutdown
        // goes is of no interest.
        None => {
            let _ = io.shutdown().await;
            Ok(())
        }
    };
    if let Err(e) = served {
        tracing::debug!(error = %e, %peer, "connection ended with an error");
    }
    drop(aging);
}

/// Reads until the connection's first bytes tell its protocol, and puts
/// them back: whether it speaks HTTP/2, `None` if it closed (or timed out)
/// first.
async fn first_bytes<T: AsyncRead + Unpin>(io: &mut IdleIo<T>) -> Option<bool> {
    // The HTTP/2 preface's length: any other protocol differs before.
    let mut first = [0u8; 24];
    let mut read = 0;
    while io.speaks_h2().is_none() {
        match io.read(&mut first[read..]).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => read += n,
        }
    }
    io.unread(Bytes::copy_from_slice(&first[..read]));
    io.speaks_h2()
}

/// An HTTP/1.1 connection, parked whenever it idles (see
/// [`crate::edge::idle::park`]): hyper's connection, with its buffers, is
/// built when a request's first bytes come and dropped once it has idled
/// for [`PARK_AFTER`], the socket kept.
async fn serve_h1<T, S>(
    mut io: IdleIo<T>,
    mut svc: S,
    builder: &http1::Builder,
    inflight: &Inflight,
    mut signal: Signal,
) -> Result<(), hyper::Error>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: Service<hyper::Request<Incoming>, Response = hyper::Response<ConnBody>, Error = Infallible> + Unpin,
    S::Future: Send + 'static,
{
    io.park_when_idle(PARK_AFTER);
    loop {
        // Boxed: while the connection is parked, its task holds a pointer's
        // worth of it.
        let mut conn = Box::new(builder.serve_connection(TokioIo::new(io), svc).with_upgrades());
        let parked = poll_fn(|cx| {
            if signal.poll_told(cx) {
                Pin::new(&mut *conn).graceful_shutdown();
            }
            match Pin::new(&mut *conn).poll(cx) {
                Poll::Ready(done) => Poll::Ready(Some(done)),
                Poll::Pending if !signal.told() && inflight.take_park() => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            }
        })
        .await;
        if let Some(done) = parked {
            return done;
        }
        // Idle, flushed, nothing in flight: hyper hands back the socket,
        // what it had read of the next request, and the service.
        let Some(parts) = conn.into_parts() else { return Ok(()) };
        (io, svc) = (parts.io.into_inner(), parts.service);
        io.unread(parts.read_buf);
        if io.has_unread() {
            continue;
        }
        match next_request(&mut io, &mut signal).await {
            Some(bytes) => io.unread(bytes),
            // Closed by the client, timed out, or told to close.
            None => {
                let _ = io.shutdown().await;
                return Ok(());
            }
        }
    }
}

/// A parked connection's wait: the next request's first bytes, or `None`
/// when the connection closes, times out or is told to close.
async fn next_request<T: AsyncRead + Unpin>(io: &mut IdleIo<T>, signal: &mut Signal) -> Option<Bytes> {
    poll_fn(|cx| {
        if signal.poll_told(cx) {
            return Poll::Ready(None);
        }
        // On the stack of this poll, not in the connection's task.
        let mut buf = [0u8; 1024];
        let mut read = ReadBuf::new(&mut buf);
        match Pin::new(&mut *io).poll_read(cx, &mut read) {
            Poll::Ready(Ok(())) if !read.filled().is_empty() => {
                Poll::Ready(Some(Bytes::copy_from_slice(read.filled())))
            }
            Poll::Ready(_) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    })
    .await
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
