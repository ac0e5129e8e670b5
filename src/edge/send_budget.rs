//! What one client connection may make tollgate hold of its responses.
//!
//! hyper bounds what it buffers per HTTP/1.1 connection, but HTTP/2
//! buffers per stream (the send buffer, plus the piece the stream has taken
//! from its body), so a client that opens many streams and then stops
//! reading, or never grants flow-control credit, multiplies it.
//! [`SendBudget`] is shared by every response of one connection: each
//! piece of response body taken from the upstream is counted until the
//! last copy of it is freed, which happens once hyper or h2 has written it
//! to the socket (or dropped it with a reset stream). A response takes its
//! next piece (at most [`MAX_PIECE`]) only while the connection holds at
//! most [`SEND_BUDGET`] minus one piece, so the connection never holds more
//! than [`SEND_BUDGET`] of response bodies, however many streams it has
//! open.
//!
//! Counting the pieces themselves, rather than bytes written to the socket,
//! keeps the count exact: data h2 discards for a reset stream is released
//! too, and nothing a client sends (pings, tiny windows) can make tollgate
//! believe data left that did not.
//!
//! The same count tells when the client takes nothing: while the
//! connection holds response data and none of it has been freed for
//! `listen.send_timeout`, [`SendBudget::stalled_since`] says since when,
//! and [`crate::edge::idle::IdleIo`] closes the connection. That catches an
//! HTTP/2 client that withholds WINDOW_UPDATE frames, which never blocks a
//! socket write.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::upstream::forward::UPSTREAM_READ_BUFFER;

/// The most response body one client connection holds in tollgate.
pub const SEND_BUDGET: usize = 128 * 1024;

/// The largest piece handed on at once: the upstream connection's read
/// buffer, which is what hyper usually hands over anyway. A larger chunk is
/// handed on in pieces; the rest of it waits, as part of what was read
/// ahead from the upstream.
pub const MAX_PIECE: usize = UPSTREAM_READ_BUFFER;

/// A response takes its next piece only while the connection holds at most
/// this much, so the total stays within [`SEND_BUDGET`].
const TAKE_BELOW: usize = SEND_BUDGET - MAX_PIECE;

/// One connection's count of held response bytes. Cloning shares it.
#[derive(Debug, Clone, Default)]
pub struct SendBudget(Arc<Mutex<Held>>);

#[derive(Debug, Default)]
struct Held {
    bytes: usize,
    /// Since when response data has been held without any of it being
    /// freed; `None` while nothing is held.
    stalled_since: Option<Instant>,
    /// Responses waiting for the count to fall.
    waiting: Vec<Waker>,
}

impl SendBudget {
    /// Response body bytes this connection holds now.
    pub fn held(&self) -> usize {
        self.0.lock().bytes
    }

    /// Since when the connection has held response data without any of it
    /// leaving; `None` while it holds none.
    pub fn stalled_since(&self) -> Option<Instant> {
        self.0.lock().stalled_since
    }

    /// Wraps a response body so its pieces count against this budget.
    pub fn body<B>(&self, inner: B) -> BudgetedBody<B> {
        BudgetedBody { inner, rest: Bytes::new(), budget: self.clone() }
    }

    /// Whether a response may take its next piece; when not, `cx` is woken
    /// once pieces are freed.
    fn poll_room(&self, cx: &mut Context<'_>) -> bool {
        let mut held = self.0.lock();
        if held.bytes <= TAKE_BELOW {
            return true;
        }
        if !held.waiting.iter().any(|w| w.will_wake(cx.waker())) {
            held.waiting.push(cx.waker().clone());
        }
        false
    }

    /// Counts a piece of `n` bytes taken from a response body.
    fn take(&self, n: usize) {
        let mut held = self.0.lock();
        if held.bytes == 0 {
            held.stalled_since = Some(Instant::now());
        }
        held.bytes += n;
    }

    /// A piece of `n` bytes was freed: written out, or dropped with its
    /// stream. Wakes the waiting responses once there is room.
    fn release(&self, n: usize) {
        let waiting = {
            let mut held = self.0.lock();
            held.bytes = held.bytes.saturating_sub(n);
            held.stalled_since = (held.bytes > 0).then(Instant::now);
            if held.bytes > TAKE_BELOW {
                return;
            }
            std::mem::take(&mut held.waiting)
        };
        for w in waiting {
            w.wake();
        }
    }
}

/// A response body whose pieces count against its connection's
/// [`SendBudget`] until they are freed.
pub struct BudgetedBody<B> {
    inner: B,
    /// What is left of a chunk larger than [`MAX_PIECE`].
    rest: Bytes,
    budget: SendBudget,
}

impl<B> BudgetedBody<B> {
    /// Counts the next piece of `data` and hands it on; keeps the rest.
    fn piece(&mut self, mut data: Bytes) -> Bytes {
        if data.len() > MAX_PIECE {
            self.rest = data.split_off(MAX_PIECE);
        }
        self.budget.take(data.len());
        Bytes::from_owner(Counted { data, budget: self.budget.clone() })
    }
}

/// A piece of a response body, owned by the `Bytes` handed to hyper: it
/// gives its bytes back to the budget when the last copy is dropped.
struct Counted {
    data: Bytes,
    budget: SendBudget,
}

impl AsRef<[u8]> for Counted {
    fn as_ref(&self) -> &[u8] {
        &self.data
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.budget.release(self.data.len());
    }
}

impl<B> Body for BudgetedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        if !self.budget.poll_room(cx) {
            return Poll::Pending;
        }
        if !self.rest.is_empty() {
            let rest = std::mem::take(&mut self.rest);
            return Poll::Ready(Some(Ok(Frame::data(self.piece(rest)))));
        }
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        polled.map(|frame| {
            frame.map(|frame| {
                frame.map(|frame| frame.map_data(|data| if data.is_empty() { data } else { self.piece(data) }))
            })
        })
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let inner = self.inner.size_hint();
        let rest = self.rest.len() as u64;
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower() + rest);
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper + rest);
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, StreamBody};
    use std::time::Duration;

    fn pieces(n: usize, len: usize) -> impl Body<Data = Bytes, Error = std::convert::Infallible> + Unpin {
        let frames = (0..n).map(move |_| Ok(Frame::data(Bytes::from(vec![b'x'; len]))));
        StreamBody::new(futures::stream::iter(frames))
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_holds_at_most_the_budget_across_its_responses() {
        let budget = SendBudget::default();
        // Four responses whose pieces nobody frees (a client that reads
        // nothing): together they take no more than the budget.
        let mut kept = Vec::new();
        let mut bodies: Vec<_> = (0..4).map(|_| budget.body(pieces(100, UPSTREAM_READ_BUFFER))).collect();
        for body in &mut bodies {
            while let Ok(Some(frame)) = tokio::time::timeout(Duration::from_millis(10), body.frame()).await {
                kept.push(frame.expect("frame").into_data().expect("data"));
            }
        }
        let total: usize = kept.iter().map(Bytes::len).sum();
        assert_eq!(budget.held(), total);
        assert!(total <= SEND_BUDGET && total > TAKE_BELOW, "held {total}");
        assert!(budget.stalled_since().is_some());
        // Freeing pieces lets a waiting response go on.
        let waiting = tokio::spawn(async move { bodies[3].frame().await });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        kept.truncate(kept.len() - 2);
        let piece = waiting.await.expect("task").expect("a frame").expect("ok");
        drop(kept);
        assert_eq!(budget.held(), UPSTREAM_READ_BUFFER, "only the piece taken after the wait is held");
        drop(piece);
        assert_eq!(budget.held(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_large_chunk_is_handed_on_in_pieces_within_the_budget() {
        let budget = SendBudget::default();
        let mut body = budget.body(pieces(1, 200 * 1024));
        let mut kept = Vec::new();
        while let Ok(Some(frame)) = tokio::time::timeout(Duration::from_millis(10), body.frame()).await {
            kept.push(frame.expect("frame").into_data().expect("data"));
        }
        assert!(kept.iter().all(|p| p.len() == MAX_PIECE));
        assert_eq!(budget.held(), SEND_BUDGET);
        assert!(!body.is_end_stream());
        kept.clear();
        let mut total = SEND_BUDGET;
        while let Some(frame) = body.frame().await {
            total += frame.expect("frame").into_data().expect("data").len();
        }
        assert_eq!(total, 200 * 1024);
        assert_eq!(budget.held(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_held_is_not_stalled() {
        let budget = SendBudget::default();
        let mut body = budget.body(pieces(1, 10));
        let piece = body.frame().await.expect("a frame").expect("ok");
        assert_eq!((budget.held(), budget.stalled_since().is_some()), (10, true));
        drop(piece);
        assert_eq!((budget.held(), budget.stalled_since()), (0, None));
    }
}
