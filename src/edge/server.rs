//! Listeners, connections and shutdown.
//!
//! [`Server::bind`] validates everything and binds every listener before
//! anything is served, so a bad config or a taken port fails the start, not
//! the first request. [`Server::run`] serves until the shutdown future
//! completes, then answers `/readyz` 503 while it still serves for
//! `listen.shutdown_delay`, then stops accepting, lets in-flight requests
//! and tunnels finish (up to `listen.drain_timeout`), closes the tunnels
//! left, and returns.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::{Backend, Config, ConfigErrors, Listen, RulesCache, load_rules_cached};
use crate::edge::connection::{ConnectionSetup, Slot, serve_connection};
use crate::edge::drain::Drain;
use crate::edge::process::Stop;
use crate::edge::tls::{CertWatcher, Tls};
use crate::limit::rules::RuleSet;
use crate::limiter::clock::SharedClock;
use crate::obs::metrics::Metrics;
use crate::ops::admin::Admin;
use crate::ops::reload::Reloader;
use crate::proxy::Proxy;
use crate::store::{AnyStore, MemoryStore, RedisStore};
use crate::upstream::tunnel;

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{0}")]
    Config(#[from] ConfigErrors),
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error("cannot set up the store: {0}")]
    Store(String),
    #[error("{0}")]
    Tls(String),
}

/// A bound, not yet serving, tollgate.
pub struct Server {
    config: Config,
    proxy: Arc<Proxy>,
    reloader: Arc<Reloader>,
    listeners: Listeners,
    /// `[[listen.tls]]`: the proxy listener speaks TLS only.
    tls: Option<Tls>,
    /// SIGHUP, caught from `bind` on: reopens the access log and reloads
    /// the rules.
    hangup: Option<crate::edge::process::Caught>,
    /// SIGUSR1, caught from `bind` on: reopens the access log only.
    reopen: Option<crate::edge::process::Caught>,
}

/// Every listener tollgate serves on, bound before anything is served.
struct Listeners {
    proxy: TcpListener,
    admin: TcpListener,
    /// `[listen] http_redirect`.
    redirect: Option<TcpListener>,
    /// `[listen] decision`.
    decision: Option<TcpListener>,
    /// `[listen] envoy_rls`.
    envoy_rls: Option<TcpListener>,
}

impl Listeners {
    /// Binds every listener `listen` names, in this order; the first that
    /// cannot be bound fails the start.
    async fn bind(listen: &Listen) -> Result<Listeners, StartError> {
        Ok(Listeners {
            proxy: bind(listen.proxy).await?,
            admin: bind(listen.admin).await?,
            redirect: bind_if(listen.http_redirect).await?,
            decision: bind_if(listen.decision).await?,
            envoy_rls: bind_if(listen.envoy_rls).await?,
        })
    }
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr).await.map_err(|source| StartError::Bind { addr, source })
}

/// [`bind`] for a listener the configuration may leave out.
async fn bind_if(addr: Option<SocketAddr>) -> Result<Option<TcpListener>, StartError> {
    match addr {
        Some(addr) => bind(addr).await.map(Some),
        None => Ok(None),
    }
}

/// How often idle keys are swept from the memory store (and from the Redis
/// store's local fallback and over-limit cache).
const SWEEP_EVERY: Duration = Duration::from_secs(5);

impl Server {
    /// Loads the rules, builds the store and binds every listener.
    pub async fn bind(config: Config, clock: SharedClock) -> Result<Server, StartError> {
        let metrics = Arc::new(Metrics::new());
        // What start-up reads of the rules files is what the first reload
        // compares them with.
        let mut cache = RulesCache::default();
        let loaded = load_rules_cached(&config.rules_path, &config, Some(&mut cache))?;
        let rules = RuleSet::from_loaded(loaded, &metrics);
        let top = crate::limit::top::TopKeys::new(config.admin.top_keys, clock.clone());
        let store = match config.store.backend {
            Backend::Memory => AnyStore::Memory(
                MemoryStore::new(clock).bounded(config.store.max_keys, Some(metrics.store_evictions_total.clone())),
            ),
            Backend::Redis => AnyStore::Redis(
                RedisStore::connect(&config.store, clock, metrics.clone()).await.map_err(StartError::Store)?,
            ),
        };
        let proxy = Arc::new(Proxy::new(&config, rules, store, metrics, top));
        let reloader = Arc::new(Reloader::new(config.clone(), proxy.clone(), cache));
        let tls = match config.listen.tls.is_empty() {
            true => None,
            false => {
                Some(Tls::new(config.listen.tls.clone(), config.listen.client_auth.as_ref()).map_err(StartError::Tls)?)
            }
        };
        let listeners = Listeners::bind(&config.listen).await?;
        let hangup = crate::edge::process::hangup_signal();
        let reopen = crate::edge::process::reopen_signal();
        Ok(Server { config, proxy, reloader, listeners, tls, hangup, reopen })
    }

    /// The address clients connect to (useful when the config said port 0).
    pub fn proxy_addr(&self) -> SocketAddr {
        self.listeners.proxy.local_addr().unwrap_or(self.config.listen.proxy)
    }

    /// The admin listener's address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.listeners.admin.local_addr().unwrap_or(self.config.listen.admin)
    }

    /// The redirect listener's address, when there is one.
    pub fn redirect_addr(&self) -> Option<SocketAddr> {
        self.listeners.redirect.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// The decision API listener's address, when there is one.
    pub fn decision_addr(&self) -> Option<SocketAddr> {
        self.listeners.decision.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// The Envoy rate limit service's address, when there is one.
    pub fn envoy_rls_addr(&self) -> Option<SocketAddr> {
        self.listeners.envoy_rls.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// The request path, for tests that inspect it.
    pub fn proxy(&self) -> Arc<Proxy> {
        self.proxy.clone()
    }

    /// The rules reloader, for tests that trigger a reload by hand.
    pub fn reloader(&self) -> Arc<Reloader> {
        self.reloader.clone()
    }

    /// Serves until `shutdown` completes, then drains as SIGTERM asks
    /// (lame duck first).
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) {
        self.run_until(async {
            shutdown.await;
            Stop::LameDuck
        })
        .await;
    }

    /// Serves until `stop` completes, then drains the way it says.
    pub async fn run_until(self, stop: impl Future<Output = Stop> + Send) {
        let Server { config, proxy, reloader, listeners, tls, hangup, reopen } = self;
        let watch = tokio::spawn(reloader.clone().watch());
        let hangups = hangup.map(|h| tokio::spawn(h.each(on_hangup(proxy.clone(), reloader.clone()))));
        let reopens = reopen.map(|r| tokio::spawn(r.each(on_reopen(proxy.clone()))));
        let _summary = crate::obs::summary::spawn(&proxy.metrics);
        let housekeeping = housekeeping(&proxy);
        let stopping = Arc::new(AtomicBool::new(false));
        let admin = Arc::new(Admin { proxy: proxy.clone(), reloader, stopping: stopping.clone() });
        let admin_task = tokio::spawn(serve_admin(listeners.admin, admin));

        let slots = Arc::new(Semaphore::new(config.listen.max_connections));
        if let Some(tls) = &tls {
            let names: Vec<Vec<String>> = tls.resolver.current().iter().map(|c| c.names.clone()).collect();
            let client_auth =
                config.listen.client_auth.as_ref().map(|a| if a.required { "required" } else { "optional" });
            tracing::info!(certificates = ?names, client_auth, http_redirect = ?config.listen.http_redirect, "the proxy listener speaks TLS");
        }
        let cert_watch = tls.as_ref().map(|tls| {
            let watcher = CertWatcher::new(tls.resolver.clone(), &proxy.metrics);
            tokio::spawn(Arc::new(watcher).watch())
        });
        let redirect_task = listeners.redirect.map(|l| {
            let port = config.listen.redirect_port;
            tokio::spawn(crate::edge::redirect::serve(
                l,
                port,
                slots.clone(),
                config.listen.header_read_timeout,
                proxy.clone(),
            ))
        });
        let decision_task = listeners.decision.map(|l| {
            tokio::spawn(crate::api::decision::serve(l, proxy.decider().clone(), config.listen.header_read_timeout))
        });
        let envoy_rls_task =
            listeners.envoy_rls.map(|l| tokio::spawn(crate::api::envoy_rls::serve(l, proxy.decider().clone())));

        let shutdown = lame_duck(stop, stopping, config.listen.shutdown_delay);
        serve_proxy(listeners.proxy, proxy.clone(), &config, tls, slots, shutdown).await;
        proxy.store().close().await;
        proxy.flush_access_log(ACCESS_LOG_FLUSH).await;
        let tasks = [hangups, reopens, cert_watch, redirect_task, decision_task, envoy_rls_task];
        for task in tasks.into_iter().flatten().chain(housekeeping).chain([watch, admin_task]) {
            task.abort();
        }
    }
}

/// The periodic tasks: idle keys swept from the store, and `/top`'s period
/// kept current for the request path (see crate::limit::top).
fn housekeeping(proxy: &Arc<Proxy>) -> Vec<tokio::task::JoinHandle<()>> {
    let sweep = tokio::spawn({
        let proxy = proxy.clone();
        async move {
            let mut every = tokio::time::interval(SWEEP_EVERY);
            loop {
                every.tick().await;
                proxy.store().sweep();
            }
        }
    });
    let top_tick = proxy.top().is_some().then(|| {
        let proxy = proxy.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(crate::limit::top::TICK);
            loop {
                every.tick().await;
                if let Some(top) = proxy.top() {
                    top.tick();
                }
            }
        })
    });
    std::iter::once(sweep).chain(top_tick).collect()
}

/// `stop`, then `/readyz` answering 503 for `delay` while the listeners
/// still serve: a load balancer (or kube-proxy, which drops a terminating
/// pod's endpoints a moment after SIGTERM) keeps sending new connections
/// for a while, and they should be answered, not refused. No delay when
/// `stop` says [`Stop::Now`].
async fn lame_duck(stop: impl Future<Output = Stop>, stopping: Arc<AtomicBool>, delay: Duration) {
    let how = stop.await;
    stopping.store(true, Ordering::Relaxed);
    if how == Stop::LameDuck && !delay.is_zero() {
        tracing::info!(?delay, "shutting down: /readyz answers 503; serving for listen.shutdown_delay first");
        tokio::time::sleep(delay).await;
    }
}

/// How long shutdown waits for the access log's last lines to be written.
const ACCESS_LOG_FLUSH: Duration = Duration::from_secs(2);

/// What a SIGUSR1 does: the access log's file is reopened (logrotate has
/// moved it away), and nothing else, as nginx does: rotating a log must not
/// put an edited main file or rules in force.
fn on_reopen(proxy: Arc<Proxy>) -> impl FnMut() {
    move || {
        tracing::info!("SIGUSR1: reopening the access log");
        proxy.reopen_access_log();
    }
}

/// What a SIGHUP does: the access log's file is reopened (logrotate has
/// moved it away), and the main file and the rules are reloaded as a change
/// to their files would, on a background thread (file IO, parsing).
fn on_hangup(proxy: Arc<Proxy>, reloader: Arc<Reloader>) -> impl FnMut() {
    move || {
        tracing::info!(
            "SIGHUP: reopening the access log, reloading the main file's routes and upstreams and the rules"
        );
        proxy.reopen_access_log();
        let reloader = reloader.clone();
        drop(crate::config::watch::background(move || {
            // Reloads the rules too, against the new routes; a broken main
            // file still leaves the rules to be reloaded.
            if reloader.reload_config().is_err() {
                let _ = reloader.reload();
            }
        }));
    }
}

async fn serve_proxy(
    listener: TcpListener,
    proxy: Arc<Proxy>,
    config: &Config,
    tls: Option<Tls>,
    slots: Arc<Semaphore>,
    shutdown: impl Future<Output = ()>,
) {
    let (tunnels, close_tunnels) =
        tunnel::tunnels(config.listen.tunnel_idle_timeout, proxy.metrics.tunnels_active.clone());
    let setup = Arc::new(ConnectionSetup::new(config, tunnels));
    let graceful = Drain::new();
    let refusals = Arc::new(Semaphore::new(REFUSALS));
    let handshake_timeout = config.listen.header_read_timeout;
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = accept(&listener) => accepted,
            _ = &mut shutdown => break,
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            proxy.metrics.connections_refused_total.inc();
            // A TLS client cannot read a plain-text answer, and a handshake
            // is the work an overloaded server must not take on: closed.
            // So is a connection past the refusals already under way.
            if tls.is_none()
                && let Ok(refusing) = refusals.clone().try_acquire_owned()
            {
                tokio::spawn(refuse(stream, proxy.clone(), peer, refusing));
            }
            continue;
        };
        let _ = stream.set_nodelay(true);
        let mut client = proxy.peer(peer);
        client.https = tls.is_some();
        client.body_budget = Some(Arc::new(std::sync::atomic::AtomicU64::new(config.listen.connection_body_buffer)));
        let watcher = graceful.watcher();
        let slot = Arc::new(Slot::new(permit, proxy.metrics.connections_active.clone()));
        let proxy = proxy.clone();
        let setup = setup.clone();
        match &tls {
            None => {
                tokio::spawn(async move {
                    serve_connection(stream, peer, proxy, Arc::new(client), &setup, watcher, slot).await;
                });
            }
            Some(tls) => {
                let acceptor = tls.acceptor.clone();
                tokio::spawn(async move {
                    // The handshake holds a connection slot: bounded like the
                    // request headers that follow it. Plain HTTP is answered
                    // 400 there.
                    let accepted =
                        crate::edge::handshake::accept(stream, &acceptor, &proxy, peer, handshake_timeout).await;
                    if let Some(stream) = accepted {
                        let client = Arc::new(crate::wire::client::Peer {
                            tls: crate::edge::handshake::version(&stream),
                            client_cert: crate::edge::tls::client_subject(stream.get_ref().1),
                            ..client
                        });
                        serve_connection(stream, peer, proxy, client, &setup, watcher, slot).await;
                    }
                });
            }
        }
    }
    drop(listener);
    // Its `Tunnels`: the drain below waits for the tunnels themselves.
    drop(setup);
    drain(graceful, close_tunnels, config.listen.drain_timeout).await;
}

/// The next connection. An error (out of file descriptors and the like)
/// is logged and followed by a pause instead of spinning.
async fn accept(listener: &TcpListener) -> (TcpStream, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(accepted) => return accepted,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Waits up to `timeout` for the connections and the tunnels to end.
async fn drain(graceful: Drain, mut close_tunnels: tunnel::Closer, timeout: Duration) {
    tracing::info!("shutting down: draining in-flight requests and tunnels");
    let drained = async {
        graceful.shutdown().await;
        close_tunnels.ended().await;
    };
    if tokio::time::timeout(timeout, drained).await.is_err() {
        tracing::warn!("drain timeout reached; closing the remaining connections and tunnels");
    }
    // Tunnels seldom end by themselves: those still open are closed with a
    // WebSocket close frame, going away.
    close_tunnels.close(Duration::from_secs(1)).await;
}

/// Refusals under way at once, each holding its connection's descriptor for
/// up to two seconds (see [`refuse`]). A flood over `max_connections` costs
/// at most this many descriptors more: the connections past them are closed
/// at once, without the 503. Measured without the bound: 2,000 connections
/// that sent nothing held 1,055 descriptors (tests/process.rs).
pub const REFUSALS: usize = 256;

/// Answers a connection over `max_connections` with a short 503 and closes
/// it, so the client learns why instead of seeing a reset. `_refusing` is
/// its place under [`REFUSALS`].
///
/// The request is read (one read, bounded in time and size) before the
/// answer is written: a response that arrives before the request is an
/// error to clients such as hyper's, and closing a socket with the request
/// still unread makes the kernel send a reset that can destroy the response
/// on its way.
async fn refuse(mut stream: TcpStream, proxy: Arc<Proxy>, peer: SocketAddr, _refusing: OwnedSemaphorePermit) {
    // A generated id is hex digits and '-': no JSON escaping needed.
    let request_id = crate::wire::request_id::generate();
    let id = String::from_utf8_lossy(request_id.as_bytes());
    let body =
        format!(r#"{{"error":"overloaded","message":"Too many connections; retry shortly.","request_id":"{id}"}}"#);
    let resp = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nx-request-id: {id}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut request = [0u8; 8192];
    let read = tokio::time::timeout(Duration::from_secs(1), stream.read(&mut request)).await;
    let head = &request[..read.ok().and_then(Result::ok).unwrap_or(0)];
    let pending = proxy.log_refused(head, peer.ip(), &request_id);
    let sent = tokio::time::timeout(Duration::from_secs(1), stream.write_all(resp.as_bytes())).await;
    if let Some(mut p) = pending {
        p.respond(503);
        if matches!(sent, Ok(Ok(()))) {
            p.sent(body.len() as u64);
        }
    }
    let _ = stream.shutdown().await;
}

async fn serve_admin(listener: TcpListener, admin: Arc<Admin>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let admin = admin.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let admin = admin.clone();
                async move { Ok::<_, Infallible>(admin.handle(req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(10))
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}
