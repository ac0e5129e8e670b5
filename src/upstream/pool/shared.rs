//! What a pool shares with the response bodies it hands out: how to reach
//! the server, and the idle connections, taken by the next request and
//! given back by a body that ends (closed after `pool_idle_timeout`).

use std::sync::{Arc, Weak};
use std::time::Duration;

use http::Uri;
use http::header::HeaderValue;
use hyper::client::conn::{http1, http2};
use hyper_util::client::legacy::connect::HttpConnector;
use parking_lot::Mutex;
use prometheus::IntCounter;
use rustls::pki_types::ServerName;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;

/// The most idle connections kept per upstream; more are closed as they
/// come back.
pub const MAX_IDLE: usize = 1024;

/// What a pool's handles and its response bodies share: how to reach the
/// server, and the connections kept for the next request.
pub(super) struct Shared<B> {
    pub(super) connector: HttpConnector,
    /// `scheme://authority`, what the connector dials.
    pub(super) origin: Uri,
    /// The `Host` for requests that carry none: the authority, without
    /// port 80.
    pub(super) host: HeaderValue,
    /// Read buffer of each connection (`http1_max_buf_size`).
    pub(super) max_buf_size: usize,
    /// The TCP connect and the TLS handshake together.
    pub(super) connect_timeout: Duration,
    /// `pool_idle_timeout`.
    pub(super) idle_timeout: Duration,
    /// `h2_keepalive_interval`.
    pub(super) h2_keepalive: Duration,
    /// Most recently returned last.
    pub(super) idle: Mutex<Vec<Idle<B>>>,
    /// Whether the task that closes idle connections runs.
    pub(super) reaping: std::sync::Once,
    /// The longest a response body may wait for the upstream's next bytes,
    /// and where such a timeout is counted (see [`Pool::limit_silence`]).
    pub(super) silence: Option<(Duration, IntCounter)>,
    /// For an `https://` server: the connector and the name to ask for.
    pub(super) tls: Option<(TlsConnector, ServerName<'static>)>,
    /// `protocol = "h2"`: the one connection, shared by every request.
    pub(super) h2: Option<Mutex<Option<http2::SendRequest<B>>>>,
}

/// A connection's sending half: HTTP/1.1 (one request at a time, pooled)
/// or HTTP/2 (shared).
pub(super) enum Sender<B> {
    H1(http1::SendRequest<B>),
    H2(http2::SendRequest<B>),
}

/// An idle HTTP/1.1 connection, and since when it has been idle.
pub(super) struct Idle<B> {
    pub(super) sender: http1::SendRequest<B>,
    pub(super) since: Instant,
}

impl<B: Send + 'static> Shared<B> {
    fn idle(&self) -> parking_lot::MutexGuard<'_, Vec<Idle<B>>> {
        self.idle.lock()
    }

    /// The most recently used idle connection that can take a request (or
    /// the HTTP/2 connection, while it is open).
    pub(super) fn checkout(&self) -> Option<Sender<B>> {
        if let Some(h2) = &self.h2 {
            let shared = h2.lock();
            return shared.as_ref().filter(|s| s.is_ready()).map(|s| Sender::H2(s.clone()));
        }
        let mut idle = self.idle();
        while let Some(Idle { sender, since }) = idle.pop() {
            if since.elapsed() >= self.idle_timeout {
                // Everything below it has been idle longer.
                idle.clear();
                return None;
            }
            // Not ready: the upstream closed it while it was idle.
            if sender.is_ready() {
                return Some(Sender::H1(sender));
            }
        }
        None
    }

    /// Takes back a connection whose response has ended.
    pub(super) fn put(self: &Arc<Self>, sender: http1::SendRequest<B>) {
        if sender.is_ready() {
            let mut idle = self.idle();
            if idle.len() < MAX_IDLE {
                idle.push(Idle { sender, since: Instant::now() });
            }
            return;
        }
        if sender.is_closed() {
            return;
        }
        // Still finishing the exchange (writing the rest of a request body
        // the upstream answered early): pooled once it is done.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let mut sender = sender;
            let shared = self.clone();
            rt.spawn(async move {
                if sender.ready().await.is_ok() {
                    let mut idle = shared.idle();
                    if idle.len() < MAX_IDLE {
                        idle.push(Idle { sender, since: Instant::now() });
                    }
                }
            });
        }
    }
}

/// Closes connections idle for `pool_idle_timeout`, until the pool is
/// gone.
pub(super) async fn reap<B: Send + 'static>(shared: Weak<Shared<B>>) {
    let Some(timeout) = shared.upgrade().map(|s| s.idle_timeout) else { return };
    let mut every = tokio::time::interval(timeout / 4);
    loop {
        every.tick().await;
        let Some(shared) = shared.upgrade() else { return };
        shared.idle().retain(|i| i.since.elapsed() < timeout);
    }
}
