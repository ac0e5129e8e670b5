//! Closing connections that sit idle.
//!
//! [`IdleIo`] wraps a connection's socket: when no request on it has been in
//! flight for the idle timeout, its next read reports end-of-file, which
//! hyper treats as the client closing an idle connection, the cleanest way
//! out for both HTTP/1.1 and HTTP/2. Bytes alone do not keep a connection
//! open: an HTTP/2 client sending a PING (or a SETTINGS, or a
//! WINDOW_UPDATE) every few seconds would hold its place under
//! `max_connections` forever. Bytes count only while a request is in
//! flight, or when one has ended since the last bytes (its response's last
//! bytes may leave just after it ends).
//!
//! The same timer bounds how long a client may take to send a request head
//! (slowloris), `listen.header_read_timeout`: from the connection's start
//! (the HTTP/2 preface included: a client that trickles it is not let in)
//! until its first request, and on HTTP/1.1 from the end of each request
//! until the next one's head is read (the wait for the next request is
//! part of it, as it was with hyper's own timer). An HTTP/2 connection that
//! has sent a request waits for the next up to the idle timeout. hyper's
//! timer is off: it took a timer and an allocation per request, this one
//! takes none (one timer per connection, moved lazily).
//!
//! A request waiting on a slow upstream moves no bytes but is not idle: the
//! service holds an [`InflightGuard`] while it works.
//!
//! A client that stops reading its response is another matter: writes to it
//! stay blocked, and everything queued for it stays in memory. When a write
//! has been blocked for the send timeout without a byte going out, the
//! write fails with `TimedOut` and hyper closes the connection (and drops
//! the upstream response it was relaying).
//!
//! An idle HTTP/1.1 connection can also be parked ([`park`]): once it
//! has moved no byte for a moment, with nothing in flight and everything
//! written flushed, its driver is told to take the socket back from hyper,
//! whose buffers and state are then freed until the next request's bytes
//! arrive (read here, and read again by a new hyper connection).
//!
//! An HTTP/2 client can also stall without blocking a write: it grants no
//! flow-control credit, so h2 writes nothing and waits. The connection's
//! [`SendBudget`] knows since when it has held response data with none of
//! it leaving; past the send timeout, the next read fails with `TimedOut`
//! and hyper closes the connection. (h2 reads whenever it is not blocked
//! writing, so the read side is always being polled in that state.)

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

use crate::edge::send_budget::SendBudget;

pub use inflight::{Inflight, InflightBody, InflightGuard};

/// What bytes moved since [`IdleIo`]'s timestamps were last set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Moved {
    Bytes,
    /// Some for a request in flight, or since one ended.
    ForRequest,
}

/// What a connection speaks, as far as its first bytes tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    /// So many bytes of the HTTP/2 preface seen, and nothing else.
    Undecided(usize),
    Http1,
    Http2,
}

/// How an HTTP/2 connection starts (RFC 9113 3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A socket that reads as closed once it has been idle for `timeout`, or
/// has taken longer than its header timeout to send a request head.
pub struct IdleIo<T> {
    inner: T,
    timeout: Duration,
    inflight: Inflight,
    /// The last bytes moved: where a wait for a request head starts.
    last_activity: Instant,
    /// The last bytes moved for a request: where the idle timeout starts.
    last_request: Instant,
    /// Requests ended as of `last_request`.
    ended_seen: usize,
    /// Bytes moved since the timestamps were last set, and whether they
    /// moved for a request: the clock is read once the next read waits
    /// (what the timestamps are for), not on every read and write.
    unstamped: Option<Moved>,
    /// `listen.header_read_timeout`; `None`: heads are not timed.
    header_timeout: Option<Duration>,
    protocol: Protocol,
    /// Since when the connection has waited for a request head, and how
    /// many requests had started then (a later start ends that wait).
    waiting: Option<(usize, Instant)>,
    /// Moved lazily: armed no later than the earliest deadline that can
    /// come before it fires, re-armed from the real deadlines when it does.
    timer: Pin<Box<Sleep>>,
    /// The waker `timer` was last polled with.
    timer_waker: Option<Waker>,
    send_timeout: Duration,
    /// Armed while a write is blocked.
    send_timer: Option<Pin<Box<Sleep>>>,
    budget: SendBudget,
    /// Armed while the connection holds response data none of which leaves.
    stall_timer: Option<Pin<Box<Sleep>>>,
    /// Bytes read and handed back ([`IdleIo::unread`]): read again first.
    unread: Option<Bytes>,
    /// No write since the last flush that completed: whoever writes
    /// through this holds nothing unwritten.
    flushed: bool,
    /// [`IdleIo::park_when_idle`]'s delay; `None`: never parked.
    park_after: Option<Duration>,
    /// Whether the connection was told it may be parked since it last
    /// moved bytes.
    park_told: bool,
}

impl<T> IdleIo<T> {
    /// Wraps `inner`: idle after `timeout` without traffic or a request in
    /// flight; writes fail after `send_timeout` without progress, and reads
    /// fail once `budget` has held response data for `send_timeout` without
    /// any of it leaving.
    pub fn new(inner: T, timeout: Duration, send_timeout: Duration, inflight: Inflight, budget: SendBudget) -> Self {
        let now = Instant::now();
        IdleIo {
            inner,
            timeout,
            inflight,
            last_activity: now,
            last_request: now,
            ended_seen: 0,
            unstamped: None,
            header_timeout: None,
            protocol: Protocol::Undecided(0),
            waiting: None,
            timer: Box::pin(tokio::time::sleep_until(now + timeout)),
            timer_waker: None,
            send_timeout,
            send_timer: None,
            budget,
            stall_timer: None,
            unread: None,
            flushed: true,
            park_after: None,
            park_told: false,
        }
    }

    /// Also reads as closed once a request head has taken longer than
    /// `timeout` (see the module's documentation for when that clock runs).
    pub fn with_header_timeout(mut self, timeout: Duration) -> Self {
        self.header_timeout = Some(timeout);
        let now = Instant::now();
        let first = self.timer.deadline().min(now + timeout);
        self.timer.as_mut().reset(first);
        self
    }

    /// Whether the connection speaks HTTP/2 (with prior knowledge), as far
    /// as the bytes read so far tell: `None` until they do.
    pub fn speaks_h2(&self) -> Option<bool> {
        match self.protocol {
            Protocol::Undecided(_) => None,
            p => Some(p == Protocol::Http2),
        }
    }

    /// Notes what the first bytes of the connection say about its protocol.
    fn classify(&mut self, bytes: &[u8]) {
        let Protocol::Undecided(seen) = self.protocol else { return };
        let want = &H2_PREFACE[seen..];
        let n = bytes.len().min(want.len());
        self.protocol = if bytes[..n] != want[..n] {
            Protocol::Http1
        } else if seen + n == H2_PREFACE.len() {
            Protocol::Http2
        } else {
            Protocol::Undecided(seen + n)
        };
    }

    /// Whether a request head is being waited for, and so timed: nothing is
    /// in flight, and either no request has started yet or the connection
    /// is not HTTP/2. Notes since when, the first time it is asked in a wait.
    fn head_deadline(&mut self) -> Option<Instant> {
        let timeout = self.header_timeout?;
        if self.inflight.busy() || !self.heads_may_be_timed() {
            return None;
        }
        let started = self.inflight.started();
        match self.waiting {
            Some((n, since)) if n == started => Some(since + timeout),
            _ => {
                // The wait began with the last byte moved: the end of the
                // previous response (or the connection's start), unless
                // bytes of the next head came in first.
                self.waiting = Some((started, self.last_activity));
                Some(self.last_activity + timeout)
            }
        }
    }

    /// Whether a wait for a request head can still come on this
    /// connection: not once an HTTP/2 connection has sent a request.
    fn heads_may_be_timed(&self) -> bool {
        self.header_timeout.is_some() && (self.protocol != Protocol::Http2 || self.inflight.started() == 0)
    }

    /// Whether the connection has held response data for the send timeout
    /// without any of it leaving. Registers the waker with the timer when
    /// it holds some but not for that long yet.
    fn send_stalled(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(since) = self.budget.stalled_since() else {
            self.stall_timer = None;
            return false;
        };
        let deadline = since + self.send_timeout;
        let timer = self.stall_timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if timer.deadline() != deadline {
            timer.as_mut().reset(deadline);
        }
        timer.as_mut().poll(cx).is_ready()
    }

    /// A write returned `poll`: progress disarms the send timer, a blocked
    /// write arms it, and a write blocked past the send timeout fails.
    fn check_send<R>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        if poll.is_ready() {
            self.send_timer = None;
            return poll;
        }
        let timeout = self.send_timeout;
        let timer = self.send_timer.get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        if timer.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client read nothing for listen.send_timeout",
            )));
        }
        Poll::Pending
    }

    fn touch(&mut self) {
        // Only what moved is noted here; the timestamps are set when the
        // next read waits ([`IdleIo::stamp`]), and the timer is re-armed
        // lazily when it fires, so busy connections neither read the clock
        // nor reset a timer on every read and write.
        // `ended` first: it never passes `started`.
        let ended = self.inflight.ended();
        let for_request = ended != self.ended_seen || self.inflight.started() != ended;
        self.ended_seen = ended;
        let moved = self.unstamped.get_or_insert(Moved::Bytes);
        if for_request {
            *moved = Moved::ForRequest;
        }
        if self.park_told {
            let now = self.stamp();
            self.unparked(now);
        }
    }

    /// Sets the timestamps of the bytes moved since they were last set
    /// (now: a read waits right after the bytes it follows); returns now.
    fn stamp(&mut self) -> Instant {
        let now = Instant::now();
        if let Some(moved) = self.unstamped.take() {
            self.last_activity = now;
            if moved == Moved::ForRequest {
                self.last_request = now;
            }
        }
        now
    }

    /// Whether the connection has been idle for the timeout. Registers the
    /// waker with the timer when it has not.
    fn idle_expired(&mut self, cx: &mut Context<'_>) -> bool {
        // A connection with a request in flight cannot expire: while its
        // timer is armed for this task and has not fired, it is not polled
        // again (each poll registers the waker anew, on every read that
        // waits). Once it fires, the loop below moves it on as before.
        if self.inflight.busy()
            && !self.timer.is_elapsed()
            && self.timer_waker.as_ref().is_some_and(|w| w.will_wake(cx.waker()))
        {
            return false;
        }
        if !self.timer_waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            self.timer_waker = Some(cx.waker().clone());
        }
        if self.unstamped.is_some() {
            self.stamp();
        }
        // A wait for a head that began since the timer was armed may end
        // before it: the timer is moved to it (once per wait, and only
        // earlier when the idle timeout is the longer one).
        let head = self.head_deadline();
        if let Some(head) = head
            && head < self.timer.deadline()
        {
            self.timer.as_mut().reset(head);
        }
        // Armed no later than a head wait beginning now would end, so that
        // the next wait (after this request, say) need not move it earlier;
        // the same for a parking connection's next idle moment.
        let heads_later = self.header_timeout.filter(|_| head.is_none() && self.heads_may_be_timed());
        let park_later = self.park_after.filter(|_| !self.park_told);
        loop {
            if self.timer.as_mut().poll(cx).is_pending() {
                return false;
            }
            let now = Instant::now();
            self.maybe_park(now);
            let park_later = park_later.filter(|_| !self.park_told);
            let idle = self.last_request + self.timeout;
            let deadline = head.map_or(idle, |h| h.min(idle));
            let soonest = |d: Instant| {
                let d = heads_later.map_or(d, |h| d.min(now + h));
                park_later.map_or(d, |p| d.min(now + p))
            };
            if deadline > now {
                self.timer.as_mut().reset(soonest(deadline));
                continue;
            }
            // In flight, or ended with no bytes since (a stream the client
            // reset, say): the idle time starts now at the earliest.
            let ended = self.inflight.ended();
            if head.is_none() && (self.inflight.busy() || ended != self.ended_seen) {
                self.ended_seen = ended;
                (self.last_activity, self.last_request) = (now, now);
                self.timer.as_mut().reset(soonest(now + self.timeout));
                continue;
            }
            return true;
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for IdleIo<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if self.unread.is_some() {
            self.read_unread(buf);
            return Poll::Ready(Ok(()));
        }
        // Checked before reading: a client that keeps sending (pings, say)
        // while taking none of its responses is stalled all the same.
        if self.send_stalled(cx) {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client took none of its responses for listen.send_timeout",
            )));
        }
        let before = buf.filled().len();
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before {
                    if matches!(self.protocol, Protocol::Undecided(_)) {
                        self.classify(&buf.filled()[before..]);
                    }
                    self.touch();
                }
                Poll::Ready(r)
            }
            Poll::Pending => {
                if self.idle_expired(cx) {
                    // End of file: the peer "closed" an idle connection.
                    Poll::Ready(Ok(()))
                } else {
                    Poll::Pending
                }
            }
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for IdleIo<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        self.flushed = false;
        let polled = Pin::new(&mut self.inner).poll_write(cx, data);
        let n = ready!(self.check_send(cx, polled))?;
        if n > 0 {
            self.touch();
        }
        Poll::Ready(Ok(n))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.flushed = false;
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        let n = ready!(self.check_send(cx, polled))?;
        if n > 0 {
            self.touch();
        }
        Poll::Ready(Ok(n))
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        let flushed = ready!(self.check_send(cx, polled));
        self.flushed = flushed.is_ok();
        Poll::Ready(flushed)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

mod inflight;
pub mod park;
#[cfg(test)]
mod tests;
