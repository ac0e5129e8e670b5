//! What one check is counted against ([`Limits`], with the [`Algorithm`]
//! and its bounds) and what it answers ([`Verdict`]), in nanoseconds.

use serde::Deserialize;

/// Nanoseconds since the UNIX epoch. Fixed and sliding windows are aligned to
/// the epoch, so every tollgate instance agrees on where a window starts.
pub type Nanos = u64;

/// Nanoseconds in one second.
pub const NANOS_PER_SEC: u64 = 1_000_000_000;

/// The largest limit or burst a check counts against: a sliding counter's
/// cell packs its counts in 32 bits each. Soft and elastic headroom is
/// capped here (see `Rule::effective_limits`), and [`evaluate`](super::evaluate) bounds its
/// inputs to it.
pub const MAX_LIMIT: u64 = u32::MAX as u64;

/// The longest window: 366 days. `start + 2 * window` and the like stay far
/// inside `u64` nanoseconds; config validation refuses longer ones.
pub const MAX_WINDOW: Nanos = 366 * 24 * 3600 * NANOS_PER_SEC;

/// The algorithm a rule counts with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Capacity `burst`, refilled at `limit` per `window`: allows bursts up to
    /// the capacity, then a steady rate. Constant memory per key.
    #[default]
    TokenBucket,
    /// A queue of `burst` requests drained at `limit` per `window`: admitted
    /// requests are delayed until their turn (traffic shaping); a request that
    /// finds the queue full is rejected. Constant memory per key.
    LeakyBucket,
    /// A counter per epoch-aligned window: cheapest, but allows up to twice
    /// the limit across a window boundary.
    FixedWindow,
    /// Every admitted request's timestamp within the window: exact, but costs
    /// memory per request.
    SlidingWindowLog,
    /// Current window's count plus the previous window's, weighted by how
    /// much of it still overlaps the sliding window: constant memory, close to
    /// exact when requests are spread evenly.
    SlidingWindowCounter,
    /// At most `limit` requests of a key in flight at once: a slot is taken
    /// when a request is admitted and given back when its response ends or
    /// its client goes away. Not a rate: `window` is the slot TTL that
    /// bounds how long the slots of a crashed instance stay counted in a
    /// shared store (see `src/store/redis/slots.rs`).
    Concurrency,
}

impl Algorithm {
    /// The name used in config files, metrics and Redis key suffixes.
    pub fn as_str(self) -> &'static str {
        match self {
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::LeakyBucket => "leaky_bucket",
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingWindowLog => "sliding_window_log",
            Algorithm::SlidingWindowCounter => "sliding_window_counter",
            Algorithm::Concurrency => "concurrency",
        }
    }

    /// Whether the algorithm keeps a log (a variable-size state) rather than
    /// a fixed-size [`Cell`](super::Cell).
    pub fn uses_log(self) -> bool {
        matches!(self, Algorithm::SlidingWindowLog)
    }

    /// Whether each admitted request holds something that must be given
    /// back when it ends (a concurrency slot), rather than being counted
    /// once.
    pub fn holds(self) -> bool {
        matches!(self, Algorithm::Concurrency)
    }

    /// Whether the Redis store names each request's entry by a request id,
    /// so that a refund removes exactly that request's entry.
    pub fn names_requests(self) -> bool {
        matches!(self, Algorithm::SlidingWindowLog | Algorithm::Concurrency)
    }
}

/// The effective limits of one check. Soft and elastic throttling have
/// already been applied: `limit` and `burst` may be above the rule's nominal
/// values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub algorithm: Algorithm,
    /// Requests per window.
    pub limit: u64,
    /// Window length in nanoseconds (never zero: config validation refuses it).
    pub window: Nanos,
    /// Token bucket capacity, or leaky bucket queue length.
    pub burst: u64,
    /// Where a fixed window's windows are aligned: 0 (the epoch) for a rule
    /// with a `window`, the current window's start for a `calendar` rule,
    /// whose `window` is then that window's length (see
    /// [`crate::limiter::calendar`]).
    pub origin: Nanos,
}

impl Limits {
    /// The same limits within what the arithmetic counts exactly: limit and
    /// burst in `1..=MAX_LIMIT`, window in `1..=MAX_WINDOW`.
    pub fn bounded(&self) -> Limits {
        Limits {
            algorithm: self.algorithm,
            limit: self.limit.clamp(1, MAX_LIMIT),
            window: self.window.clamp(1, MAX_WINDOW),
            burst: self.burst.clamp(1, MAX_LIMIT),
            origin: self.origin,
        }
    }

    /// How many requests the bucket holds when it is untouched: what
    /// `remaining` counts down from.
    pub fn capacity(&self) -> u64 {
        match self.algorithm {
            Algorithm::TokenBucket | Algorithm::LeakyBucket => self.burst,
            _ => self.limit,
        }
    }

    /// How long an untouched key takes to become equivalent to a fresh one:
    /// after this much idle time its state can be forgotten.
    pub fn idle_horizon(&self) -> Nanos {
        match self.algorithm {
            Algorithm::TokenBucket | Algorithm::LeakyBucket => {
                // burst / rate, rounded up.
                let per = self.window as u128 * self.burst as u128;
                let t = per.div_ceil(self.limit.max(1) as u128);
                u64::try_from(t).unwrap_or(u64::MAX)
            }
            Algorithm::FixedWindow | Algorithm::SlidingWindowLog => self.window,
            Algorithm::SlidingWindowCounter => self.window.saturating_mul(2),
            // A held slot is never idle (its counter is dropped when the
            // last one is given back); the window is the slot TTL.
            Algorithm::Concurrency => self.window,
        }
    }

    /// Refill (token bucket) or drain (leaky bucket) rate in requests per ns.
    pub(super) fn rate(&self) -> f64 {
        self.limit as f64 / self.window as f64
    }
}

/// What one algorithm says about one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Verdict {
    pub allowed: bool,
    /// Requests still available after this one (0 when rejected).
    pub remaining: u64,
    /// Nanoseconds until the quota is fully available again.
    pub reset_after: Nanos,
    /// Nanoseconds until a request of the same cost could be admitted (0 when
    /// allowed).
    pub retry_after: Nanos,
    /// Nanoseconds the request must wait before it is forwarded (leaky bucket
    /// shaping; 0 otherwise).
    pub delay: Nanos,
    /// Decided by the `on_error = "local"` fallback while the shared store
    /// could not answer: counted in this process's memory only, so a
    /// settlement of its cost belongs there too (see [`crate::proxy::settle`]).
    pub fallback: bool,
    /// Refused by the penalty box rather than by the counters, and whether
    /// this very refusal put the key there (see [`Boxed`]).
    pub boxed: Boxed,
}

/// Whether a verdict comes from the penalty box: a key refused by a rule
/// with `penalty`, or blocked through the admin API, is refused by that
/// rule until its entry expires, whatever its counters say.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Boxed {
    /// Decided by the counters.
    #[default]
    No,
    /// Refused: the key was in the box already (`retry_after` is the time
    /// left there).
    In,
    /// Refused by the counters, and this refusal put the key in the box
    /// for the rule's `penalty` (`retry_after` is the penalty).
    Entered,
}

/// A rule's `penalty` and `penalty_after`: once a key has been refused
/// `after` times within one window, it is refused for `duration`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Penalty {
    pub duration: Nanos,
    pub after: u32,
}

/// Whole seconds, rounded up: what `Retry-After` and `X-RateLimit-Reset`
/// carry, so a client that waits that long is never early.
pub fn ceil_secs(ns: Nanos) -> u64 {
    ns.div_ceil(NANOS_PER_SEC)
}
