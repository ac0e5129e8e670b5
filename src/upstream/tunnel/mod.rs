//! Protocol upgrades: WebSocket, and any other `Upgrade` an upstream
//! accepts over HTTP/1.1.
//!
//! The upgrade request is an ordinary request until the upstream answers
//! it: normalised, matched, counted and limited like any other (a 429
//! refuses the upgrade). [`requested`] says whether the client asked for one
//! tollgate will carry; the upstream gets the request with its `Upgrade`
//! and `Connection: upgrade`, and when it answers `101 Switching Protocols`
//! the client gets the 101 and a [`Pending`] tunnel rides along in the
//! response's extensions. The server takes it from there ([`Pending::run`]):
//! once hyper has written the 101, bytes are copied both ways until either
//! side closes, the tunnel has been silent for `listen.tunnel_idle_timeout`,
//! or the server's drain ends. A tunnel gets the drain time as requests
//! do; a WebSocket still open at its end is closed with a close frame, code
//! 1001 (going away), to both sides, so that the client reconnects rather
//! than reports an abnormal closure (1006).
//!
//! What a tunnel carries is not HTTP any more, so nothing in it is counted:
//! one WebSocket is one request. Upgrades to protocols that would carry
//! further HTTP requests past the limiter (`h2c`, `HTTP/*`, `TLS/*`) are
//! never tunnelled; their `Upgrade` header is dropped like any other
//! hop-by-hop header and the request goes on as a plain one.
//!
//! HTTP/2 has no `Upgrade` (RFC 9113 §8.6); WebSockets over HTTP/2's
//! extended CONNECT (RFC 8441) are not offered, so HTTP/2 clients open
//! WebSockets over HTTP/1.1, as browsers do when a server does not announce
//! `SETTINGS_ENABLE_CONNECT_PROTOCOL`.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use http::header::{CONNECTION, HeaderMap, HeaderValue, UPGRADE};
use http::{Request, Version};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use prometheus::IntGauge;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

mod frames;
use frames::FrameEdge;

/// The `Upgrade` value of a request tollgate will tunnel: HTTP/1.1, one
/// `Upgrade` header, `upgrade` among the `Connection` options, and a
/// protocol that cannot carry HTTP requests past the limiter.
pub fn requested<B>(req: &Request<B>) -> Option<HeaderValue> {
    if req.version() != Version::HTTP_11 {
        return None;
    }
    let headers = req.headers();
    let mut values = headers.get_all(UPGRADE).iter();
    let (value, None) = (values.next()?, values.next()) else {
        return None;
    };
    if !connection_has_upgrade(headers) {
        return None;
    }
    // A list of protocols in the client's order of preference (RFC 9110
    // §7.8): the upstream may pick any, so every one must be safe.
    let text = value.to_str().ok()?;
    let mut protocols = text.split(',').map(str::trim).filter(|p| !p.is_empty()).peekable();
    protocols.peek()?;
    protocols.all(tunnelable).then(|| value.clone())
}

fn connection_has_upgrade(headers: &HeaderMap) -> bool {
    headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|o| o.trim().eq_ignore_ascii_case("upgrade"))
}

/// Whether an upgrade to `protocol` (`name[/version]`) may be tunnelled.
/// `h2c` would turn the tunnel into an HTTP/2 connection whose requests
/// tollgate never sees; `HTTP/x` and `TLS/x` (RFC 2817) likewise carry
/// HTTP.
fn tunnelable(protocol: &str) -> bool {
    let name = protocol.split('/').next().unwrap_or(protocol).trim();
    !(name.eq_ignore_ascii_case("h2c") || name.eq_ignore_ascii_case("http") || name.eq_ignore_ascii_case("tls"))
}

/// Sets the headers that ask the upstream for the upgrade, after the
/// client's hop-by-hop headers were stripped.
pub fn ask_upstream(headers: &mut HeaderMap, protocol: HeaderValue) {
    headers.insert(CONNECTION, HeaderValue::from_static("upgrade"));
    headers.insert(UPGRADE, protocol);
}

/// Sets the headers of the 101 the client gets: the protocol the upstream
/// switched to.
pub fn answer_client(headers: &mut HeaderMap, protocol: Option<HeaderValue>) {
    headers.insert(CONNECTION, HeaderValue::from_static("upgrade"));
    if let Some(p) = protocol {
        headers.insert(UPGRADE, p);
    }
}

/// A tunnel agreed with the upstream, waiting for the client's side: put
/// in the 101 response's extensions by the proxy, taken out and run by the
/// server.
#[derive(Clone)]
pub struct Pending {
    pub client: OnUpgrade,
    pub upstream: OnUpgrade,
    /// The request's concurrency slots: a tunnel is one request in flight
    /// until it closes, and holds them that long.
    pub held: Option<Guard>,
    /// The upstream server's count of answered requests, added to when
    /// the tunnel closes: a tunnel is in flight on its server until then.
    pub answered: Option<Arc<crate::upstream::pool::Answered>>,
    /// The upstream switched to `websocket`: the tunnel carries WebSocket
    /// frames, and is closed at shutdown with a close frame.
    pub websocket: bool,
}

/// Whatever a tunnel keeps until it ends, then drops: the request's
/// concurrency slots, which the proxy hands over without upstream knowing
/// what they are (the store is a layer above). Shared only because
/// response extensions must be `Clone`; what it keeps is dropped with the
/// last clone (the tunnel's).
#[derive(Clone)]
pub struct Guard {
    _keep: Arc<dyn Send + Sync>,
}

impl Guard {
    pub fn new(keep: impl Send + Sync + 'static) -> Guard {
        Guard { _keep: Arc::new(keep) }
    }
}

/// What every tunnel of a server shares.
#[derive(Clone)]
pub struct Tunnels {
    idle_timeout: Duration,
    active: IntGauge,
    /// Turns true when the drain ends: every tunnel closes.
    closing: watch::Receiver<bool>,
    /// Held by each running tunnel; [`Closer::close`] waits until every
    /// clone is gone.
    running: mpsc::Sender<()>,
}

/// Closes a server's tunnels at the end of its drain.
pub struct Closer {
    closing: watch::Sender<bool>,
    running: mpsc::Receiver<()>,
}

/// The tunnels of one server and what closes them.
pub fn tunnels(idle_timeout: Duration, active: IntGauge) -> (Tunnels, Closer) {
    let (closing_tx, closing_rx) = watch::channel(false);
    let (running_tx, running_rx) = mpsc::channel(1);
    (
        Tunnels { idle_timeout, active, closing: closing_rx, running: running_tx },
        Closer { closing: closing_tx, running: running_rx },
    )
}

impl Closer {
    /// Completes when every tunnel has ended by itself, and every
    /// [`Tunnels`] that could start one is gone.
    pub async fn ended(&mut self) {
        let _ = self.running.recv().await;
    }

    /// Closes every tunnel and waits (at most `wait`) until their sockets
    /// are closed.
    pub async fn close(mut self, wait: Duration) {
        let _ = self.closing.send(true);
        let _ = tokio::time::timeout(wait, self.running.recv()).await;
    }
}

impl Pending {
    /// Waits for both sides to switch, then copies bytes both ways until
    /// either side closes, the tunnel is idle for the tunnel idle timeout,
    /// or the server closes its tunnels. `hold` stays alive as long as the
    /// tunnel does (the client connection's slot and its in-flight mark),
    /// and so do the request's concurrency slots.
    pub async fn run<H: Send>(self, tunnels: Tunnels, hold: H) {
        let Tunnels { idle_timeout, active, mut closing, running } = tunnels;
        let Pending { client, upstream, held, answered, websocket } = self;
        let (client, upstream) = match tokio::try_join!(client, upstream) {
            Ok(both) => both,
            Err(e) => {
                tracing::debug!(error = %e, "a tunnel did not open");
                return;
            }
        };
        active.inc();
        let last = Arc::new(Activity::new());
        let edge = || websocket.then(FrameEdge::default);
        let mut client = Watched { io: TokioIo::new(client), last: last.clone(), edge: edge() };
        let mut upstream = Watched { io: TokioIo::new(upstream), last: last.clone(), edge: edge() };
        let closed = async {
            if !*closing.borrow_and_update() {
                let _ = closing.changed().await;
            }
        };
        let shut_down = tokio::select! {
            r = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "a tunnel ended with an error");
                }
                false
            }
            () = last.idle_for(idle_timeout) => {
                tracing::debug!("a tunnel closed after its idle timeout");
                false
            }
            () = closed => true,
        };
        if shut_down {
            // Bounded: a peer that reads nothing gets a bare close.
            let _ = tokio::time::timeout(GOING_AWAY_WRITE, going_away(&mut client, &mut upstream)).await;
        }
        active.dec();
        drop((client, upstream, hold, held, answered, running));
    }
}

/// How long the close frames at shutdown may take to write.
const GOING_AWAY_WRITE: Duration = Duration::from_millis(500);

/// Sends each side of a WebSocket tunnel a close frame, 1001 (going away),
/// where the frames written to it so far end, and closes its write side.
/// A side in the middle of a frame gets no frame (it would corrupt the
/// one cut short), nor does a tunnel that is not a WebSocket.
async fn going_away<C, U>(client: &mut Watched<C>, upstream: &mut Watched<U>)
where
    C: AsyncWrite + Unpin,
    U: AsyncWrite + Unpin,
{
    use tokio::io::AsyncWriteExt;
    if client.edge.as_ref().is_some_and(FrameEdge::at_edge) {
        let _ = client.io.write_all(&frames::GOING_AWAY_TO_CLIENT).await;
        let _ = client.io.shutdown().await;
    }
    if upstream.edge.as_ref().is_some_and(FrameEdge::at_edge) {
        let _ = upstream.io.write_all(&frames::going_away_to_upstream()).await;
        let _ = upstream.io.shutdown().await;
    }
}

/// When a tunnel last moved a byte, in nanoseconds since it opened.
struct Activity {
    opened: Instant,
    last: AtomicU64,
}

impl Activity {
    fn new() -> Activity {
        Activity { opened: Instant::now(), last: AtomicU64::new(0) }
    }

    fn touch(&self) {
        let nanos = u64::try_from(self.opened.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.last.store(nanos, Ordering::Relaxed);
    }

    /// Completes once no byte has moved for `timeout`.
    async fn idle_for(&self, timeout: Duration) {
        loop {
            let deadline = self.opened + Duration::from_nanos(self.last.load(Ordering::Relaxed)) + timeout;
            if deadline <= Instant::now() {
                return;
            }
            tokio::time::sleep_until(deadline).await;
        }
    }
}

/// One side of a tunnel, noting each byte that moves, and (a WebSocket)
/// where the frames written to it end.
struct Watched<T> {
    io: T,
    last: Arc<Activity>,
    edge: Option<FrameEdge>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(poll, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.last.touch();
        }
        poll
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.io).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = poll
            && n > 0
        {
            self.last.touch();
            if let Some(edge) = &mut self.edge {
                edge.feed(&buf[..n]);
            }
        }
        poll
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(version: Version, headers: &[(&str, &str)]) -> Request<()> {
        let mut b = Request::builder().version(version).uri("/ws");
        for (n, v) in headers {
            b = b.header(*n, *v);
        }
        b.body(()).expect("a valid request")
    }

    #[test]
    fn a_websocket_upgrade_is_tunnelled() {
        let r = req(Version::HTTP_11, &[("connection", "keep-alive, Upgrade"), ("upgrade", "websocket")]);
        assert_eq!(requested(&r).as_ref().map(|v| v.to_str().ok()), Some(Some("websocket")));
    }

    #[test]
    fn upgrades_that_carry_http_are_not() {
        for p in ["h2c", "HTTP/2.0", "TLS/1.0", "websocket, h2c", "H2C"] {
            let r = req(Version::HTTP_11, &[("connection", "upgrade"), ("upgrade", p)]);
            assert_eq!(requested(&r), None, "{p}");
        }
    }

    #[test]
    fn an_upgrade_needs_its_connection_option_one_header_and_http_1_1() {
        assert_eq!(requested(&req(Version::HTTP_11, &[("upgrade", "websocket")])), None);
        let two = req(Version::HTTP_11, &[("connection", "upgrade"), ("upgrade", "websocket"), ("upgrade", "foo")]);
        assert_eq!(requested(&two), None);
        let h10 = req(Version::HTTP_10, &[("connection", "upgrade"), ("upgrade", "websocket")]);
        assert_eq!(requested(&h10), None);
        let empty = req(Version::HTTP_11, &[("connection", "upgrade"), ("upgrade", " , ")]);
        assert_eq!(requested(&empty), None);
    }
}
