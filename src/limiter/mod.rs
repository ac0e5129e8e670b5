//! The arithmetic of the six algorithms, as pure functions of
//! `(state, now, limits, cost)`.
//!
//! Nothing here reads a clock, takes a lock or does IO (but [`shards`], the
//! sharded map the stores keep their state in): the memory store
//! calls these under its shard lock with the time its [`Clock`] gives, and the
//! unit tests drive them with made-up timestamps. The Redis Lua scripts in
//! `src/store/lua/` implement the same arithmetic on the server, so the two
//! stores answer alike.
//!
//! Every evaluation is split in two: [`evaluate`] computes a [`Verdict`] and
//! the state the bucket would have if the request were admitted, and the
//! caller decides whether to write that state back. A request that matches
//! several rules is admitted only if all of its enforced rules admit it, and a
//! rejected request must never consume quota, so nothing is written until
//! every rule has answered.
//!
//! [`Clock`]: crate::limiter::clock::Clock

use std::collections::VecDeque;

use serde::Deserialize;

pub mod calendar;
pub mod clock;
mod reservation;
pub mod shards;

pub use reservation::{refundable, settle, settles};

/// Nanoseconds since the UNIX epoch. Fixed and sliding windows are aligned to
/// the epoch, so every tollgate instance agrees on where a window starts.
pub type Nanos = u64;

/// Nanoseconds in one second.
pub const NANOS_PER_SEC: u64 = 1_000_000_000;

/// The largest limit or burst a check counts against: a sliding counter's
/// cell packs its counts in 32 bits each. Soft and elastic headroom is
/// capped here (see `Rule::effective_limits`), and [`evaluate`] bounds its
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
    /// a fixed-size [`Cell`].
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
    fn rate(&self) -> f64 {
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
}

/// The fixed-size state of one key for every algorithm except the log:
/// 16 bytes, so a million tracked keys fit in a few tens of megabytes.
///
/// | algorithm | `t` | `v` |
/// |---|---|---|
/// | token bucket | last update | `f64` bits: tokens taken (0 = full) |
/// | leaky bucket | last update | `f64` bits: requests queued |
/// | fixed window | window start | count |
/// | sliding window counter | current window start | previous count << 32, current count |
/// | concurrency | [`HELD`] | requests in flight |
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
    total: u64,
}

impl Log {
    pub fn new() -> Log {
        Log::default()
    }

    fn push_back(&mut self, entry: (Nanos, u32)) {
        self.total += entry.1 as u64;
        self.entries.push_back(entry);
    }

    fn pop_front(&mut self) {
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

/// Evaluates a fixed-size-state algorithm. Returns the verdict and the state
/// to write back if the request is admitted (the unchanged state otherwise).
///
/// `cost` is at least 1; `limits.algorithm` must not be the log (use
/// [`evaluate_log`]).
pub fn evaluate(cell: Cell, now: Nanos, limits: &Limits, cost: u64) -> (Verdict, Cell) {
    let limits = &limits.bounded();
    let cost = cost.clamp(1, MAX_LIMIT + 1);
    match limits.algorithm {
        Algorithm::TokenBucket => bucket(cell, now, limits, cost, false),
        Algorithm::LeakyBucket => bucket(cell, now, limits, cost, true),
        Algorithm::FixedWindow => fixed_window(cell, now, limits, cost),
        Algorithm::SlidingWindowCounter => sliding_counter(cell, now, limits, cost),
        Algorithm::Concurrency => concurrency(cell, limits, cost),
        Algorithm::SlidingWindowLog => {
            debug_assert!(false, "the log is evaluated by evaluate_log");
            (Verdict::default(), cell)
        }
    }
}

/// Floating point slack when comparing token levels: keeps `1.0 + 1.0 + ...`
/// twenty times from missing `20.0` by a rounding error.
const EPSILON: f64 = 1e-9;

/// The slack for levels of up to `capacity`: EPSILON, or a millionth of a
/// millionth of the capacity when that is more. Rounding errors grow with
/// the magnitude (a bucket of five billion is off by ~1e-7 after a few
/// operations, and the Lua scripts, which compute in microseconds, by a
/// different ~1e-7), and a fixed slack would let them decide which whole
/// number a level rounds to. A relative one cannot admit a whole unit more.
/// `src/store/lua/prelude.lua` has the same function.
pub(crate) fn slack(capacity: f64) -> f64 {
    (capacity * 1e-12).max(EPSILON)
}

/// Token and leaky bucket share their state: a level that rises by `cost`
/// per admitted request and falls at `limit / window`. The token bucket's
/// level is the tokens taken; the leaky bucket's is the queue, and an
/// admitted request waits for the queue ahead of it to drain.
fn bucket(cell: Cell, now: Nanos, limits: &Limits, cost: u64, shaping: bool) -> (Verdict, Cell) {
    let rate = limits.rate();
    let elapsed = now.saturating_sub(cell.t) as f64;
    let stored = f64::from_bits(cell.v);
    let level = (stored - elapsed * rate).max(0.0);
    let capacity = limits.burst as f64;
    let cost_f = cost as f64;
    let tol = slack(capacity);
    // Keep the later of the two timestamps so that a clock that steps back
    // (another instance, NTP) never refills a bucket twice.
    let t = now.max(cell.t);
    // Time for `tokens` to drain, rounded up. Like the admission test below,
    // it ignores the slack of accumulated rounding error in the level,
    // so that a request at `now + retry_after` is admitted and one a
    // nanosecond earlier is not.
    let drain = |tokens: f64| ns_ceil((tokens - tol) / rate);

    if level + cost_f <= capacity + tol {
        let new_level = level + cost_f;
        let verdict = Verdict {
            allowed: true,
            remaining: (capacity - new_level + tol).max(0.0).floor() as u64,
            reset_after: drain(new_level),
            retry_after: 0,
            delay: if shaping { drain(level) } else { 0 },
            fallback: false,
        };
        let new_cell = Cell { t, v: new_level.to_bits() };
        (verdict, new_cell)
    } else {
        let verdict = Verdict {
            allowed: false,
            remaining: 0,
            reset_after: drain(level),
            retry_after: drain(level + cost_f - capacity).max(1),
            delay: 0,
            fallback: false,
        };
        (verdict, cell)
    }
}

/// Windows aligned to the origin: `[origin + k * window, origin + (k + 1) *
/// window)`. A clock behind the origin (another instance than the one that
/// computed a calendar window) counts in the origin's window.
fn fixed_window(cell: Cell, now: Nanos, limits: &Limits, cost: u64) -> (Verdict, Cell) {
    let since = now.saturating_sub(limits.origin);
    // A clock behind the stored window (another instance, NTP) counts in the
    // stored window instead of wiping it with an older one.
    let start = (limits.origin + since - since % limits.window).max(cell.t);
    let count = if cell.t == start { cell.v } else { 0 };
    let reset_after = start + limits.window - now;
    if count + cost <= limits.limit {
        let count = count + cost;
        let verdict = Verdict {
            allowed: true,
            remaining: limits.limit - count,
            reset_after,
            retry_after: 0,
            delay: 0,
            fallback: false,
        };
        (verdict, Cell { t: start, v: count })
    } else {
        let verdict = Verdict {
            allowed: false,
            remaining: 0,
            reset_after,
            retry_after: reset_after.max(1),
            delay: 0,
            fallback: false,
        };
        (verdict, cell)
    }
}

/// A sliding counter's cell as read on windows of `w`: as stored, unless
/// its window start is no multiple of `w`, which only a reload that changed
/// the window length leaves. Its counts cannot be split over the new
/// windows, so they all become the count of the new window that holds the
/// stored start, and slide out from there as usual. When the new length is
/// a multiple of the old one (1s to 1m, 1m to 2m, 1m to 1h), both old
/// windows lie within that new window (a start that is no multiple of the
/// new length is at least one old window past the new window's start), so
/// every count lands where it was made, as if counted with the new length
/// all along. (Read as stored, they were weighed as a window starting
/// mid-window, then forgotten at once at the next boundary.)
/// `src/store/lua/sliding_window_counter.lua` does the same.
pub(crate) fn regrid(cell: Cell, w: Nanos) -> Cell {
    if cell.t.is_multiple_of(w) {
        return cell;
    }
    let total = ((cell.v >> 32) + (cell.v & 0xffff_ffff)).min(u32::MAX as u64);
    Cell { t: cell.t - cell.t % w, v: total }
}

/// The current window's count plus the previous window's count weighted by
/// the share of the previous window the sliding window still covers.
fn sliding_counter(cell: Cell, now: Nanos, limits: &Limits, cost: u64) -> (Verdict, Cell) {
    let w = limits.window;
    let cell = regrid(cell, w);
    // As in `fixed_window`: a clock behind the stored window counts in it.
    let start = (now - now % w).max(cell.t);
    let (prev, curr) = if cell.t == start {
        (cell.v >> 32, cell.v & 0xffff_ffff)
    } else if cell.t + w == start {
        (cell.v & 0xffff_ffff, 0)
    } else {
        (0, 0)
    };
    let into = now.saturating_sub(start) as f64 / w as f64;
    let estimate = prev as f64 * (1.0 - into) + curr as f64;
    let limit = limits.limit as f64;
    let cost_f = cost as f64;
    let tol = slack(limit);

    if estimate + cost_f <= limit + tol {
        let curr = curr + cost;
        let verdict = Verdict {
            allowed: true,
            remaining: (limit - estimate - cost_f + tol).max(0.0).floor() as u64,
            // The estimate reaches zero once both windows holding requests
            // have slid out.
            reset_after: start + 2 * w - now,
            retry_after: 0,
            delay: 0,
            fallback: false,
        };
        let v = (prev << 32) | curr.min(u32::MAX as u64);
        (verdict, Cell { t: start, v })
    } else {
        // Solve for the earliest moment the estimate leaves room for `cost`,
        // as an offset from `start`: absolute times near 1.7e18 lose 256 ns
        // of precision as f64.
        let room = limit - cost_f;
        let at = if curr as f64 <= room && prev > 0 {
            // Within this window, as the previous one slides out:
            // prev * (1 - f) + curr <= room.
            let f = 1.0 - (room - curr as f64) / prev as f64;
            f * w as f64
        } else {
            // Only once this window has become the previous one:
            // curr * (1 - f) <= room.
            let f = if curr == 0 { 0.0 } else { 1.0 - room / curr as f64 };
            w as f64 + f.max(0.0) * w as f64
        };
        // `now` is before `start` if the clock stepped back (see above).
        let retry_after = ns_ceil(at - (now as i128 - start as i128) as f64).max(1);
        let reset_after = if curr > 0 { start + 2 * w - now } else { start + w - now };
        let verdict = Verdict { allowed: false, remaining: 0, reset_after, retry_after, delay: 0, fallback: false };
        (verdict, cell)
    }
}

/// The `t` of a concurrency cell: never idle, so a sweep keeps it for as
/// long as requests hold its slots (it is removed when the last is given
/// back, see [`release`]).
pub const HELD: Nanos = Nanos::MAX;

/// How long a client refused a concurrency slot is told to wait: slots come
/// back when other requests end, which nothing here can predict, so the
/// shortest whole `Retry-After`.
pub const CONCURRENCY_RETRY: Nanos = NANOS_PER_SEC;

/// Concurrency: admitted while fewer than `limit` requests hold a slot.
/// `reset_after` is 0 while slots remain and [`CONCURRENCY_RETRY`] once
/// none do: when one comes back is not a matter of time.
fn concurrency(cell: Cell, limits: &Limits, cost: u64) -> (Verdict, Cell) {
    let held = cell.v;
    if held.saturating_add(cost) <= limits.limit {
        let remaining = limits.limit - held - cost;
        let reset_after = if remaining == 0 { CONCURRENCY_RETRY } else { 0 };
        let verdict = Verdict { allowed: true, remaining, reset_after, retry_after: 0, delay: 0, fallback: false };
        (verdict, Cell { t: HELD, v: held + cost })
    } else {
        let verdict = Verdict {
            allowed: false,
            remaining: 0,
            reset_after: CONCURRENCY_RETRY,
            retry_after: CONCURRENCY_RETRY,
            delay: 0,
            fallback: false,
        };
        (verdict, cell)
    }
}

/// Gives back `cost` slots of a concurrency cell: `None` when none stay
/// held (the caller forgets the key).
pub fn release(cell: Cell, cost: u64) -> Option<Cell> {
    let held = cell.v.saturating_sub(cost);
    (held > 0).then_some(Cell { t: HELD, v: held })
}

/// Evaluates the sliding window log. Expired entries are pruned in place
/// (pruning never changes a decision); the new entry is appended only when
/// `commit` is set and the request is admitted.
pub fn evaluate_log(log: &mut Log, now: Nanos, limits: &Limits, cost: u64, commit: bool) -> Verdict {
    let limits = &limits.bounded();
    let cost = cost.clamp(1, MAX_LIMIT + 1);
    let w = limits.window;
    // An entry at exactly `now - window` has left the window.
    while let Some(&(t, _)) = log.front() {
        if t.saturating_add(w) <= now {
            log.pop_front();
        } else {
            break;
        }
    }
    let count = log.total;
    if count + cost <= limits.limit {
        if commit {
            log.push_back((now.max(log.back().map_or(0, |e| e.0)), cost as u32));
        }
        let newest = log.back().map_or(now, |e| e.0).max(now);
        Verdict {
            allowed: true,
            remaining: limits.limit - count - cost,
            reset_after: newest + w - now,
            retry_after: 0,
            delay: 0,
            fallback: false,
        }
    } else {
        // Free enough of the oldest entries to make room for `cost`.
        let need = count + cost - limits.limit;
        let mut freed = 0;
        let mut retry_after = w;
        for &(t, c) in log.iter() {
            freed += c as u64;
            if freed >= need {
                retry_after = t + w - now;
                break;
            }
        }
        let newest = log.back().map_or(now, |e| e.0);
        Verdict {
            allowed: false,
            remaining: 0,
            reset_after: newest + w - now,
            retry_after: retry_after.max(1),
            delay: 0,
            fallback: false,
        }
    }
}

/// Rounds a duration up to whole nanoseconds, except that rounding noise
/// just above a whole number (`0.58 / 1e-8 == 58000000.0000000075`) does not
/// add a nanosecond: the exact answer is that whole number.
pub(crate) fn ns_ceil(x: f64) -> Nanos {
    let whole = x.round();
    let x = if (x - whole).abs() <= (x.abs() * 1e-14).max(1e-6) { whole } else { x };
    if x <= 0.0 {
        0
    } else if x >= u64::MAX as f64 {
        u64::MAX
    } else {
        x.ceil() as u64
    }
}

/// Whole seconds, rounded up: what `Retry-After` and `X-RateLimit-Reset`
/// carry, so a client that waits that long is never early.
pub fn ceil_secs(ns: Nanos) -> u64 {
    ns.div_ceil(NANOS_PER_SEC)
}

#[cfg(test)]
mod tests;
