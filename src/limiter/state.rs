//! What a key keeps between two checks: a fixed-size [`Cell`] for every
//! algorithm but the sliding window log, whose [`Log`] grows with the
//! requests inside its window.

use std::collections::VecDeque;

use super::limits::Nanos;

/// The fixed-size state of one key for every algorithm except the log:
/// 16 bytes, so a million tracked keys fit in a few tens of megabytes.
///
/// | algorithm | `t` | `v` |
/// |---|---|---|
/// | token bucket | last update | `f64` bits: tokens taken (0 = full) |
/// | leaky bucket | last update | `f64` bits: requests queued |
/// | fixed window | window start | count |
/// | sliding window counter | current window start | previous count << 32, current count |
/// | concurrency | [`HELD`](super::HELD) | requests in flight |
///
/// A zero cell is a fresh key for every algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cell {
    pub t: Nanos,
    pub v: u64,
}

/// The state of a sliding window log: the time and cost of every admitted
/// request still inside the window, oldest first, and their total cost (kept
/// as entries come and go, so a check costs the entries it expires, not a
/// walk over the whole window).
#[derive(Debug, Clone, Default)]
pub struct Log {
    entries: VecDeque<(Nanos, u32)>,
    pub(super) total: u64,
}

impl Log {
    pub fn new() -> Log {
        Log::default()
    }

    pub(super) fn push_back(&mut self, entry: (Nanos, u32)) {
        self.total += entry.1 as u64;
        self.entries.push_back(entry);
    }

    pub(super) fn pop_front(&mut self) {
        if let Some((_, c)) = self.entries.pop_front() {
            self.total -= c as u64;
        }
    }
}

/// Read access to the entries (`len`, `back`, `iter`, ...).
impl std::ops::Deref for Log {
    type Target = VecDeque<(Nanos, u32)>;
    fn deref(&self) -> &Self::Target {
        &self.entries
    }
}

impl PartialEq for Log {
    fn eq(&self, other: &Log) -> bool {
        self.entries == other.entries
    }
}

impl<const N: usize> PartialEq<[(Nanos, u32); N]> for Log {
    fn eq(&self, other: &[(Nanos, u32); N]) -> bool {
        self.entries == *other
    }
}

impl FromIterator<(Nanos, u32)> for Log {
    fn from_iter<I: IntoIterator<Item = (Nanos, u32)>>(iter: I) -> Log {
        let mut log = Log::new();
        for e in iter {
            log.push_back(e);
        }
        log
    }
}
