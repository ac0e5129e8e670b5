//! Graceful shutdown of client connections, at no cost per request.
//!
//! hyper-util's `GracefulShutdown` does the same job, but its connection
//! future polls the shutdown signal (a `watch` channel's `changed()`) every
//! time the connection is polled: a few hundred instructions per request
//! (callgrind), for a signal that comes once in the process's life. Here
//! the signal is polled once, to register the connection task's waker, and
//! again only after a second receiver sees that it was sent (an atomic
//! load).
//!
//! That is sound because a connection future is polled by one task only
//! (it is spawned, and never moved between tasks), whose waker stays the
//! one the signal registered first.
//!
//! A connection can also be asked to close the same way on its own
//! ([`Retire`]): its last request under `listen.max_requests_per_connection`
//! has come, or it is `listen.max_connection_age` old. That costs a poll
//! one atomic load.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use futures::task::AtomicWaker;

use tokio::sync::watch;

/// What [`Drain::shutdown`] tells every connection.
pub struct Drain {
    tx: watch::Sender<()>,
}

/// One connection's end of a [`Drain`].
pub struct Watcher {
    rx: watch::Receiver<()>,
}

/// One connection's own request to close gracefully, apart from the drain:
/// any clone may [`Retire::ask`], from any task.
#[derive(Debug, Clone, Default)]
pub struct Retire(Arc<RetireState>);

#[derive(Debug, Default)]
struct RetireState {
    asked: AtomicBool,
    /// The connection task's, registered on its first poll.
    waker: AtomicWaker,
}

impl Retire {
    /// Asks the connection to finish the requests it has and close: an
    /// HTTP/2 GOAWAY, or HTTP/1.1 closing after the response under way.
    pub fn ask(&self) {
        if !self.0.asked.swap(true, Ordering::AcqRel) {
            self.0.waker.wake();
        }
    }

    fn asked(&self) -> bool {
        self.0.asked.load(Ordering::Acquire)
    }
}

/// A connection that can be asked to finish what it is doing and close.
pub trait Graceful: Future {
    fn graceful_shutdown(self: Pin<&mut Self>);
}

impl<I, S, E, B> Graceful for hyper::server::conn::http2::Connection<I, S, E>
where
    Self: Future,
    S: hyper::service::HttpService<hyper::body::Incoming, ResBody = B>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin,
    B: hyper::body::Body + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    E: hyper::rt::bounds::Http2ServerConnExec<S::Future, B>,
{
    fn graceful_shutdown(self: Pin<&mut Self>) {
        hyper::server::conn::http2::Connection::graceful_shutdown(self);
    }
}

impl Drain {
    pub fn new() -> Drain {
        Drain { tx: watch::channel(()).0 }
    }

    /// A watcher for one more connection.
    pub fn watcher(&self) -> Watcher {
        Watcher { rx: self.tx.subscribe() }
    }

    /// Asks every watched connection to close once its requests are done,
    /// and completes when all have (none is watched any more).
    pub async fn shutdown(self) {
        let _ = self.tx.send(());
        self.tx.closed().await;
    }
}

impl Default for Drain {
    fn default() -> Drain {
        Drain::new()
    }
}

impl Watcher {
    /// `conn`, shut down gracefully once the drain is signalled.
    pub fn watch<C: Graceful>(self, conn: C) -> Watched<C> {
        Watched { conn: Box::pin(conn), watch: self.signal(None) }
    }

    /// `conn`, shut down gracefully once the drain is signalled or `retire`
    /// is asked, whichever comes first.
    pub fn watch_retiring<C: Graceful>(self, conn: C, retire: Retire) -> Watched<C> {
        Watched { conn: Box::pin(conn), watch: self.signal(Some(retire)) }
    }

    /// The drain's signal and `retire`, for a connection driven by hand
    /// (one whose hyper connection is rebuilt, see `edge::connection`).
    pub fn signal(self, retire: Option<Retire>) -> Signal {
        let mut rx = self.rx.clone();
        let signal: Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(async move {
            let _ = rx.changed().await;
        });
        Signal {
            signal: Some(signal),
            registered: false,
            probe: self.rx,
            retire: retire.map(|r| (r, false)),
            told: false,
        }
    }
}

/// When a connection is to finish what it is doing and close: the drain
/// was signalled, or its [`Retire`] asked.
pub struct Signal {
    /// Completes when the drain is signalled (or dropped); `None` once it
    /// has (the connection was told).
    signal: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    /// Whether `signal` has been polled once (the task's waker is
    /// registered).
    registered: bool,
    /// A second receiver: whether the signal was sent, read without
    /// polling `signal`. Held to the connection's end, so that
    /// [`Drain::shutdown`] waits for it.
    probe: watch::Receiver<()>,
    /// The connection's own [`Retire`], and whether the task's waker is
    /// registered with it; `None` once the connection was told (or when
    /// there is none).
    retire: Option<(Retire, bool)>,
    /// Whether [`Signal::poll_told`] has said so.
    told: bool,
}

impl Signal {
    /// Whether the connection is to shut down gracefully now: true once,
    /// the first time either the drain or its retirement is seen. Registers
    /// the task's waker with both until then.
    pub fn poll_told(&mut self, cx: &mut Context<'_>) -> bool {
        let told = self.poll_signals(cx);
        self.told |= told;
        told
    }

    fn poll_signals(&mut self, cx: &mut Context<'_>) -> bool {
        if let Some(signal) = &mut self.signal
            && (!self.registered || self.probe.has_changed().unwrap_or(true))
        {
            self.registered = true;
            if signal.as_mut().poll(cx).is_ready() {
                self.signal = None;
                self.retire = None;
                return true;
            }
        }
        if let Some((retire, registered)) = &mut self.retire {
            if !*registered {
                retire.0.waker.register(cx.waker());
                *registered = true;
            }
            if retire.asked() {
                self.retire = None;
                return self.signal.is_some();
            }
        }
        false
    }

    /// Whether [`Signal::poll_told`] has said so.
    pub fn told(&self) -> bool {
        self.told
    }
}

/// A connection under a [`Drain`]; completes with the connection.
pub struct Watched<C> {
    conn: Pin<Box<C>>,
    watch: Signal,
}

impl<C: Graceful> Future for Watched<C> {
    type Output = C::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<C::Output> {
        let this = &mut *self;
        if this.watch.poll_told(cx) {
            this.conn.as_mut().graceful_shutdown();
        }
        this.conn.as_mut().poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// What a test waits at most for something that should be immediate: a
    /// regression fails the test instead of hanging the run.
    const BOUND: Duration = Duration::from_secs(5);

    /// A connection that counts its polls and ends once told to shut down.
    struct Conn {
        told: bool,
        polls: Arc<AtomicUsize>,
    }

    impl Future for Conn {
        type Output = ();
        fn poll(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<()> {
            self.polls.fetch_add(1, Ordering::Relaxed);
            if self.told { Poll::Ready(()) } else { Poll::Pending }
        }
    }

    impl Graceful for Conn {
        fn graceful_shutdown(mut self: Pin<&mut Self>) {
            self.told = true;
        }
    }

    #[tokio::test]
    async fn a_connection_polled_long_before_the_drain_is_still_told() {
        let drain = Drain::new();
        let polls = Arc::new(AtomicUsize::new(0));
        let conn = drain.watcher().watch(Conn { told: false, polls: polls.clone() });
        let task = tokio::spawn(conn);
        tokio::task::yield_now().await;
        assert!(!task.is_finished());
        // Done within the test's time: the signal woke the connection.
        tokio::time::timeout(BOUND, drain.shutdown()).await.expect("drained");
        tokio::time::timeout(BOUND, task).await.expect("the connection ended in time").expect("the connection ended");
        assert!(polls.load(Ordering::Relaxed) >= 2);
    }

    #[tokio::test]
    async fn a_connection_asked_to_retire_is_told_while_others_are_not() {
        let drain = Drain::new();
        let retire = Retire::default();
        let polls = Arc::new(AtomicUsize::new(0));
        let retiring =
            tokio::spawn(drain.watcher().watch_retiring(Conn { told: false, polls: polls.clone() }, retire.clone()));
        let other = tokio::spawn(drain.watcher().watch(Conn { told: false, polls: polls.clone() }));
        tokio::task::yield_now().await;
        assert!(!retiring.is_finished());
        // Asked from another task, as the age timer does.
        tokio::spawn(async move { retire.ask() });
        tokio::time::timeout(BOUND, retiring).await.expect("told").expect("ended");
        assert!(!other.is_finished());
        tokio::time::timeout(BOUND, drain.shutdown()).await.expect("drained");
        tokio::time::timeout(BOUND, other).await.expect("the other was told by the drain").expect("ended");
    }

    #[tokio::test]
    async fn a_connection_watched_after_the_drain_is_told_at_once() {
        let drain = Drain::new();
        let watcher = drain.watcher();
        let shutdown = tokio::spawn(drain.shutdown());
        tokio::task::yield_now().await;
        let conn = watcher.watch(Conn { told: false, polls: Arc::new(AtomicUsize::new(0)) });
        // A connection that missed the signal would stay pending: the bound
        // fails the test instead of hanging the run.
        tokio::time::timeout(BOUND, conn).await.expect("the connection was told of the drain");
        tokio::time::timeout(BOUND, shutdown).await.expect("drained").expect("the drain task");
    }
}
