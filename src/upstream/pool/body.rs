//! The response body of a pooled connection: it gives the connection back
//! when it ends, bounds the upstream's silence, and counts the request
//! answered.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1;
use tokio::time::{Instant, Sleep};

use super::shared::Shared;

/// The error of a response body, and of a connection that could not be
/// opened.
pub(super) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Adds one to a server's count of answered requests when dropped: held
/// by a response body until it ends (or by the tunnel it turned into), so
/// that a server's requests in flight include the responses still
/// streaming.
#[derive(Debug)]
pub struct Answered(pub Arc<std::sync::atomic::AtomicU64>);

impl Drop for Answered {
    fn drop(&mut self) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// An upstream response body. Its connection goes back to the pool once
/// the body has been read to its end, and is closed if it never is (its
/// rest is unread on the wire).
pub struct UpstreamBody<B: Send + 'static> {
    pub(super) body: Incoming,
    pub(super) shared: Arc<Shared<B>>,
    /// `None` once released, or when the connection ends with the body.
    sender: Option<http1::SendRequest<B>>,
    /// Armed while the upstream sends nothing ([`Pool::limit_silence`]).
    silence: Option<Pin<Box<Sleep>>>,
    /// Bytes came since `silence` was armed: re-armed from now when next
    /// needed (one timer per body, reset, rather than one per wait).
    moved: bool,
    /// Dropped (counting the request answered) when the body ends.
    answered: Option<Answered>,
}

impl<B: Send + 'static> UpstreamBody<B> {
    pub(super) fn new(body: Incoming, shared: Arc<Shared<B>>, sender: Option<http1::SendRequest<B>>) -> Self {
        UpstreamBody { body, shared, sender, silence: None, moved: false, answered: None }
    }

    /// Takes the request's timer, registered with the runtime already, as
    /// the silence timer: moved to `now + timeout` when the body first
    /// waits (a later deadline only updates the registered one), rather
    /// than a second timer registered and removed per response.
    pub fn keep_timer(&mut self, timer: Pin<Box<Sleep>>) {
        self.silence = Some(timer);
        self.moved = true;
    }

    /// Counts the request answered once this body ends or is dropped.
    pub fn count_until_end(&mut self, answered: Answered) {
        self.answered = Some(answered);
    }

    /// The count of [`UpstreamBody::count_until_end`], for a tunnel that
    /// outlives the body.
    pub fn take_answered(&mut self) -> Option<Answered> {
        self.answered.take()
    }

    fn release(&mut self) {
        self.answered = None;
        if let Some(sender) = self.sender.take() {
            self.shared.put(sender);
        }
    }
}

impl<B: Send + 'static> Body for UpstreamBody<B> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let Poll::Ready(frame) = Pin::new(&mut this.body).poll_frame(cx) else {
            let Some((limit, timeouts)) = &this.shared.silence else { return Poll::Pending };
            let timer = match &mut this.silence {
                Some(timer) if this.moved => {
                    timer.as_mut().reset(Instant::now() + *limit);
                    timer
                }
                Some(timer) => timer,
                None => this.silence.insert(Box::pin(tokio::time::sleep(*limit))),
            };
            this.moved = false;
            if timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            timeouts.inc();
            this.silence = None;
            this.answered = None;
            // The connection ends with the body: its rest is unread.
            this.sender = None;
            let e = std::io::Error::new(std::io::ErrorKind::TimedOut, "the upstream sent nothing for its timeout");
            return Poll::Ready(Some(Err(e.into())));
        };
        this.moved = true;
        match &frame {
            None => this.release(),
            Some(Ok(_)) if this.body.is_end_stream() => this.release(),
            // An error ends the connection with it.
            Some(Err(_)) => (this.sender, this.answered) = (None, None),
            Some(Ok(_)) => {}
        }
        Poll::Ready(frame.map(|f| f.map_err(Into::into)))
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl<B: Send + 'static> Drop for UpstreamBody<B> {
    fn drop(&mut self) {
        // A body with nothing to read (HEAD, 204, 304, an empty one) may
        // never be polled.
        if self.body.is_end_stream() {
            self.release();
        }
    }
}
