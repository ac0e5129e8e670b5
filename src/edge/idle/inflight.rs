//! Requests in flight on one connection, counted from their first poll to
//! the end of their response body: what [`super::IdleIo`] asks before it
//! calls a connection idle.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};

use hyper::body::{Body, Frame, SizeHint};
use prometheus::IntCounter;

/// Requests in flight on one connection.
#[derive(Debug, Clone, Default)]
pub struct Inflight(Arc<InflightState>);

/// Two counters rather than one count in flight: the requests started also
/// tell [`IdleIo`] that a request head has been read, at the same cost (one
/// atomic addition when a request starts, one when it ends).
#[derive(Debug, Default)]
struct InflightState {
    started: AtomicUsize,
    ended: AtomicUsize,
    /// Where requests whose client went away are counted.
    gone: Option<IntCounter>,
    /// Set by [`super::IdleIo`] when its connection may be parked (see [`super::park`]),
    /// taken by the connection's driver.
    park: AtomicBool,
}

impl Inflight {
    /// Requests in flight, those whose client goes away counted in `gone`.
    pub fn counting_gone(gone: IntCounter) -> Inflight {
        Inflight(Arc::new(InflightState { gone: Some(gone), ..InflightState::default() }))
    }

    /// Marks a request in flight until the guard is dropped. A guard
    /// dropped before [`InflightGuard::answered`] is a client that went
    /// away (hyper drops a request's future and body when its client does).
    pub fn start(&self) -> InflightGuard {
        self.0.started.fetch_add(1, Ordering::Relaxed);
        InflightGuard { state: self.0.clone(), answered: false }
    }

    /// Requests started on the connection so far.
    pub fn started(&self) -> usize {
        self.0.started.load(Ordering::Relaxed)
    }

    /// Requests ended on the connection so far.
    pub(super) fn ended(&self) -> usize {
        self.0.ended.load(Ordering::Relaxed)
    }

    /// Says the connection may be parked (see [`super::park`]).
    pub(super) fn say_park(&self) {
        self.0.park.store(true, Ordering::Relaxed);
    }

    /// Whether the connection's [`super::IdleIo`] has said it may be parked since
    /// this was last asked (see [`super::park`]).
    pub fn take_park(&self) -> bool {
        // A plain load first: the flag is seldom set, and the swap is a
        // locked instruction.
        self.0.park.load(Ordering::Relaxed) && self.0.park.swap(false, Ordering::Relaxed)
    }

    pub(super) fn busy(&self) -> bool {
        // `ended` never passes `started`: read it first.
        let ended = self.0.ended.load(Ordering::Relaxed);
        self.0.started.load(Ordering::Relaxed) != ended
    }
}

/// See [`Inflight::start`].
pub struct InflightGuard {
    state: Arc<InflightState>,
    answered: bool,
}

impl InflightGuard {
    /// The client got its whole answer (or the connection became a
    /// tunnel): dropping the guard is no longer a client going away.
    pub fn answered(&mut self) {
        self.answered = true;
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.state.ended.fetch_add(1, Ordering::Relaxed);
        if !self.answered
            && let Some(gone) = &self.state.gone
        {
            gone.inc();
        }
    }
}

/// A response body that keeps its request in flight until it ends: a
/// streaming response (server-sent events, a long poll) whose upstream is
/// silent for a while is not an idle connection. How long the upstream may
/// stay silent is its own `timeout` (see [`crate::upstream::pool::Pool::limit_silence`]);
/// a client that stops reading meets the send timeout. A body dropped
/// before its end is a client that went away, and is counted as such.
pub struct InflightBody<B: Body> {
    body: B,
    /// Until the body ends or fails.
    guard: Option<InflightGuard>,
}

impl<B: Body> InflightBody<B> {
    pub fn new(body: B, guard: InflightGuard) -> InflightBody<B> {
        InflightBody { body, guard: Some(guard) }
    }

    /// A body whose request is tracked elsewhere (a tunnel's 101).
    pub fn untracked(body: B) -> InflightBody<B> {
        InflightBody { body, guard: None }
    }
}

impl<B: Body + Unpin> Body for InflightBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let frame = ready!(Pin::new(&mut self.body).poll_frame(cx));
        // Ended, or failed on the upstream's side: neither is the client's
        // doing.
        if (!matches!(frame, Some(Ok(_))) || self.body.is_end_stream())
            && let Some(mut guard) = self.guard.take()
        {
            guard.answered();
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl<B: Body> Drop for InflightBody<B> {
    fn drop(&mut self) {
        // A body with nothing to send (HEAD, 204, 304) may be dropped
        // unpolled; any other dropped before its end lost its client.
        if let Some(guard) = &mut self.guard
            && self.body.is_end_stream()
        {
            guard.answered();
        }
    }
}
