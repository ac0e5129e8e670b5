//! Parking an idle HTTP/1.1 connection: what an idle keep-alive connection
//! costs should be its socket, not hyper's.
//!
//! hyper keeps each HTTP/1.1 connection's read buffer (8 to 16 KiB), write
//! buffer (8 KiB), the last response's header map and its dispatcher for
//! the connection's whole life, idle or not: some 30 KiB a connection,
//! against nginx's 0.5 KiB (benches/idle_conns.py). hyper gives them all
//! back with the socket when asked (`into_parts`), and nothing of them
//! matters between two requests: what it had read of the next request
//! comes back with the socket, and nothing is left to write once a flush
//! has completed.
//!
//! So once a connection with nothing in flight and everything flushed has
//! moved no byte for [`IdleIo::park_when_idle`]'s delay, [`IdleIo`] says
//! so ([`Inflight::take_park`]) and the connection's driver takes the
//! socket back; it then reads the next request's first bytes itself,
//! [`IdleIo::unread`]s them and builds a new hyper connection. The delay
//! keeps busy connections from being rebuilt request after request: the
//! check rides on the idle timer, which fires at most once per delay.
//!
//! [`Inflight::take_park`]: super::Inflight::take_park

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::ReadBuf;
use tokio::time::Instant;

use super::IdleIo;

impl<T> IdleIo<T> {
    /// Says, through the connection's [`super::Inflight::take_park`], when
    /// the connection may be parked: `after` without a byte moved, nothing
    /// in flight, everything written flushed.
    pub fn park_when_idle(&mut self, after: Duration) {
        self.park_after = Some(after);
        let first = self.timer.deadline().min(self.last_activity + after);
        self.timer.as_mut().reset(first);
    }

    /// Puts `bytes` back, to be read before anything else (and before what
    /// was put back earlier and not read yet).
    pub fn unread(&mut self, bytes: Bytes) {
        if bytes.is_empty() {
            return;
        }
        self.unread = Some(match self.unread.take() {
            Some(rest) if !rest.is_empty() => {
                let mut all = BytesMut::with_capacity(bytes.len() + rest.len());
                all.extend_from_slice(&bytes);
                all.extend_from_slice(&rest);
                all.freeze()
            }
            _ => bytes,
        });
    }

    /// Whether bytes put back wait to be read.
    pub fn has_unread(&self) -> bool {
        self.unread.is_some()
    }

    /// Reads from what was put back.
    pub(super) fn read_unread(&mut self, buf: &mut ReadBuf<'_>) {
        let Some(bytes) = &mut self.unread else { return };
        let n = bytes.len().min(buf.remaining());
        buf.put_slice(&bytes.split_to(n));
        if bytes.is_empty() {
            self.unread = None;
        }
    }

    /// Says the connection may be parked, once, if it has been idle for
    /// the delay with nothing in flight and nothing left unflushed.
    pub(super) fn maybe_park(&mut self, now: Instant) {
        let Some(after) = self.park_after else { return };
        if self.park_told || !self.flushed || self.inflight.busy() || self.last_activity + after > now {
            return;
        }
        self.park_told = true;
        self.inflight.say_park();
    }

    /// Bytes moved on a connection told it may park: it may be again
    /// after the delay from now, and the timer is armed for it.
    pub(super) fn unparked(&mut self, now: Instant) {
        self.park_told = false;
        if let Some(after) = self.park_after
            && self.timer.deadline() > now + after
        {
            self.timer.as_mut().reset(now + after);
        }
    }
}
