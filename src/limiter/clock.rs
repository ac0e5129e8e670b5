//! Where the memory store gets the time from.
//!
//! Production uses the system clock (epoch-aligned windows need wall-clock
//! time, not a monotonic instant); tests use [`ManualClock`] and move time by
//! hand, so no test sleeps to prove an algorithm right.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::limiter::Nanos;

/// A source of "now" in nanoseconds since the UNIX epoch.
pub trait Clock: Send + Sync + 'static {
    fn now(&self) -> Nanos;
}

/// The system's wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Nanos {
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
    }
}

/// A clock that only moves when told to. Shared by cloning.
#[derive(Debug, Clone, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock standing at `start` nanoseconds since the epoch.
    pub fn new(start: Nanos) -> Self {
        ManualClock(Arc::new(AtomicU64::new(start)))
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        self.0.fetch_add(by.as_nanos() as u64, Ordering::SeqCst);
    }

    /// Sets the clock to an absolute time.
    pub fn set(&self, at: Nanos) {
        self.0.store(at, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Nanos {
        self.0.load(Ordering::SeqCst)
    }
}

/// The clock type the server is built with.
pub type SharedClock = Arc<dyn Clock>;
