//! The client's request body on its way upstream: read ahead within
//! `buffer_body` and the connection's `connection_body_buffer`, then
//! streamed; bounded by `max_body` and `body_read_timeout`, its failures
//! told to the forwarding side.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use parking_lot::Mutex;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use tokio::time::{Instant, Sleep};

use super::downstream::{AheadBudget, Downstream};

/// Why a request body failed on the client's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFailure {
    /// More than the route's `max_body`.
    TooLarge,
    /// Bad chunked framing, or the client closed the connection mid-body.
    Malformed,
    /// Nothing arrived for `listen.body_read_timeout`.
    Timeout,
}

/// What the forwarding side learns about a [`RequestBody`] it handed to the
/// pool: how it failed, and how long it waited on the client.
#[derive(Debug, Default)]
pub struct BodyWatch {
    failure: AtomicU8,
    /// Time spent waiting on the client so far, and since when it has been
    /// waiting now.
    waiting: Mutex<(Duration, Option<Instant>)>,
}

impl BodyWatch {
    fn fail(&self, f: BodyFailure) {
        let code = match f {
            BodyFailure::TooLarge => 1,
            BodyFailure::Malformed => 2,
            BodyFailure::Timeout => 3,
        };
        self.failure.store(code, Ordering::Relaxed);
    }

    pub(crate) fn failure(&self) -> Option<BodyFailure> {
        match self.failure.load(Ordering::Relaxed) {
            1 => Some(BodyFailure::TooLarge),
            2 => Some(BodyFailure::Malformed),
            3 => Some(BodyFailure::Timeout),
            _ => None,
        }
    }

    pub(crate) fn client_wait(&self, now: Instant) -> Duration {
        let w = self.waiting.lock();
        w.0 + w.1.map_or(Duration::ZERO, |since| now.saturating_duration_since(since))
    }

    fn start_waiting(&self) {
        let mut w = self.waiting.lock();
        if w.1.is_none() {
            w.1 = Some(Instant::now());
        }
    }

    fn stop_waiting(&self) {
        let mut w = self.waiting.lock();
        if let Some(since) = w.1.take() {
            w.0 += since.elapsed();
        }
    }
}

/// The client's request body on its way upstream: frames read ahead
/// first, then the rest of the client's body as it arrives (if any). Fails
/// once the body exceeds the route's `max_body`, when its framing is
/// broken, or when the client sends nothing for `body_read_timeout`;
/// [`BodyWatch`] tells the forwarding side which.
pub struct RequestBody {
    ahead: VecDeque<Frame<Bytes>>,
    /// `None` once the client's body has ended.
    rest: Option<Incoming>,
    remaining: Option<u64>,
    read_timeout: Duration,
    /// Armed while waiting for the client.
    timer: Option<Pin<Box<Sleep>>>,
    watch: Arc<BodyWatch>,
    /// See [`Downstream::bytes_in`].
    bytes_in: Option<Arc<AtomicU64>>,
    /// The connection's budget for bodies read ahead, and how much of it
    /// the frames in `ahead` hold.
    held: Held,
}

/// The part of a connection's [`AheadBudget`] a body's frames read ahead
/// hold (the first ones: the frame that did not fit ends the reading
/// ahead), given back as they go upstream or when the body is dropped.
/// Its own type, so that [`RequestBody`] has no `Drop` of its own.
#[derive(Debug, Default)]
struct Held {
    budget: Option<AheadBudget>,
    bytes: u64,
}

impl Held {
    /// Takes `n` more bytes of the budget; false when they do not fit (or
    /// there is no budget: nothing to take).
    fn take(&mut self, n: u64) -> bool {
        let Some(b) = &self.budget else { return true };
        if !b.take(n) {
            return false;
        }
        self.bytes += n;
        true
    }

    /// Gives back what a frame of `len` bytes held.
    fn release(&mut self, len: u64) {
        if self.bytes > 0 {
            let len = len.min(self.bytes);
            self.bytes -= len;
            if let Some(b) = &self.budget {
                b.give(len);
            }
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(b) = &self.budget {
            b.give(self.bytes);
        }
    }
}

/// The error a [`RequestBody`] ends with; [`BodyWatch`] says why.
#[derive(Debug, thiserror::Error)]
#[error("the client's request body failed: {0:?}")]
pub struct BodyFailed(BodyFailure);

impl RequestBody {
    pub(crate) fn new(inner: Incoming, down: &Downstream<'_>, watch: Arc<BodyWatch>) -> RequestBody {
        let rest = (!inner.is_end_stream()).then_some(inner);
        RequestBody {
            ahead: VecDeque::new(),
            rest,
            remaining: down.max_body,
            read_timeout: down.body_read_timeout,
            timer: None,
            watch,
            bytes_in: down.bytes_in.clone(),
            held: Held { budget: down.ahead_budget.clone(), bytes: 0 },
        }
    }

    /// A copy of a body that was read whole (see
    /// [`RequestBody::read_ahead`]), to send the request again; `None`
    /// while some of it is still to come from the client.
    pub(crate) fn replica(&self) -> Option<RequestBody> {
        if self.rest.is_some() {
            return None;
        }
        let copy = |f: &Frame<Bytes>| match (f.data_ref(), f.trailers_ref()) {
            (Some(d), _) => Frame::data(d.clone()),
            (None, Some(t)) => Frame::trailers(t.clone()),
            (None, None) => Frame::data(Bytes::new()),
        };
        Some(RequestBody {
            ahead: self.ahead.iter().map(copy).collect(),
            rest: None,
            remaining: None,
            read_timeout: Duration::ZERO,
            timer: None,
            watch: self.watch.clone(),
            bytes_in: None,
            held: Held::default(),
        })
    }

    /// Reads the body until it ends or more than `limit` bytes have arrived.
    /// A body that declares a larger length is not read ahead at all.
    pub(crate) async fn read_ahead(mut self, limit: u64) -> Result<RequestBody, BodyFailure> {
        let mut total: u64 = 0;
        while limit > 0 && total <= limit {
            let Some(rest) = self.rest.as_mut() else { break };
            if rest.size_hint().lower().saturating_add(total) > limit {
                break;
            }
            match tokio::time::timeout(self.read_timeout, rest.frame()).await {
                Err(_) => return Err(BodyFailure::Timeout),
                Ok(None) => self.rest = None,
                Ok(Some(Err(_))) => return Err(BodyFailure::Malformed),
                Ok(Some(Ok(frame))) => {
                    let len = frame.data_ref().map_or(0, |d| d.len() as u64);
                    self.take(len)?;
                    total += len;
                    self.ahead.push_back(frame);
                    if self.rest.as_ref().is_some_and(Incoming::is_end_stream) {
                        self.rest = None;
                    }
                    // The connection's budget: a frame that does not fit
                    // is the last one read ahead.
                    if !self.held.take(len) {
                        break;
                    }
                }
            }
        }
        Ok(self)
    }

    /// Counts `len` bytes against `max_body`.
    fn take(&mut self, len: u64) -> Result<(), BodyFailure> {
        if let Some(n) = &self.bytes_in {
            n.fetch_add(len, Ordering::Relaxed);
        }
        if let Some(remaining) = self.remaining {
            if len > remaining {
                return Err(BodyFailure::TooLarge);
            }
            self.remaining = Some(remaining - len);
        }
        Ok(())
    }

    fn failed(&mut self, f: BodyFailure) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.watch.stop_waiting();
        self.watch.fail(f);
        self.rest = None;
        self.timer = None;
        Poll::Ready(Some(Err(Box::new(BodyFailed(f)))))
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl Body for RequestBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(frame) = self.ahead.pop_front() {
            self.held.release(frame.data_ref().map_or(0, |d| d.len() as u64));
            return Poll::Ready(Some(Ok(frame)));
        }
        let Some(rest) = self.rest.as_mut() else { return Poll::Ready(None) };
        match Pin::new(rest).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                self.watch.stop_waiting();
                self.timer = None;
                if let Err(f) = self.take(frame.data_ref().map_or(0, |d| d.len() as u64)) {
                    return self.failed(f);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(_))) => self.failed(BodyFailure::Malformed),
            Poll::Ready(None) => {
                self.watch.stop_waiting();
                self.rest = None;
                self.timer = None;
                Poll::Ready(None)
            }
            Poll::Pending => {
                self.watch.start_waiting();
                let timeout = self.read_timeout;
                let timer = self.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                if timer.as_mut().poll(cx).is_ready() {
                    return self.failed(BodyFailure::Timeout);
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ahead.is_empty() && self.rest.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        let ahead: u64 = self.ahead.iter().filter_map(|f| f.data_ref()).map(|d| d.len() as u64).sum();
        match &self.rest {
            // Read whole, with trailers: chunked, the only framing that
            // carries them.
            None if self.ahead.back().is_some_and(Frame::is_trailers) => {
                let mut hint = SizeHint::new();
                hint.set_lower(ahead);
                hint
            }
            // Read whole: the upstream gets a Content-Length.
            None => SizeHint::with_exact(ahead),
            Some(rest) => {
                let r = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(r.lower().saturating_add(ahead));
                if let Some(upper) = r.upper() {
                    hint.set_upper(upper.saturating_add(ahead));
                }
                hint
            }
        }
    }
}
