//! Concurrency slots kept for as long as a request is in flight.
//!
//! A request admitted under a concurrency rule holds its slots
//! ([`store::Held`]) until its response body ends or its client goes away:
//! [`Holding`] wraps the body and drops the slots at its last frame, at an
//! error, or when hyper drops the body unfinished (client gone, shutdown).
//! Everything the proxy answers itself has such a body too, so a 502, 504
//! or 404 after admission gives its slots back the same way. A request
//! whose future is dropped before it has a response (the client went away
//! while the upstream was thinking) drops its slots with it. A WebSocket or
//! other tunnel holds them until it closes (see [`crate::upstream::tunnel::Pending`]).
//!
//! The same ride carries the reservations of `cost_response_header` rules
//! whose real cost comes in the body's trailers ([`OnTrailers`]): settled
//! when the trailers pass, kept as reserved if the body ends without them.
//!
//! Without a concurrency rule nothing is held: the wrapper is a `None`
//! pointer beside the body (the slots are boxed, so the body of every
//! response does not grow by their size), and each frame costs one check
//! of it.
//!
//! [`store::Held`]: crate::store::Held

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use hyper::body::{Body, Frame, SizeHint};

use crate::proxy::settle::OnTrailers;
use crate::store::Held;

/// A response body holding its request's concurrency slots until it ends.
pub struct Holding<B> {
    body: B,
    riding: Option<Box<Riding>>,
}

/// What rides on a response body until it ends: concurrency slots, and
/// reservations settled by its trailers (see [`crate::proxy::settle`]).
struct Riding {
    /// Kept for its `Drop`, which gives the slots back.
    _held: Option<Held>,
    on_trailers: Option<OnTrailers>,
}

impl<B> Holding<B> {
    pub fn new(body: B, held: Option<Held>, on_trailers: Option<OnTrailers>) -> Holding<B> {
        let riding = (held.is_some() || on_trailers.is_some()).then(|| Box::new(Riding { _held: held, on_trailers }));
        Holding { body, riding }
    }
}

impl<B: Body + Unpin> Body for Holding<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let frame = ready!(Pin::new(&mut self.body).poll_frame(cx));
        if let Some(riding) = &mut self.riding {
            if let Some(Ok(f)) = &frame
                && let Some(trailers) = f.trailers_ref()
                && let Some(on) = riding.on_trailers.take()
            {
                on.trailers(trailers);
            }
            // Ended, or failed: the request is no longer in flight.
            if !matches!(frame, Some(Ok(_))) || self.body.is_end_stream() {
                self.riding = None;
            }
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
