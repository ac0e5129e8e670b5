//! The six algorithms' arithmetic: [`evaluate`] for those keeping a
//! [`Cell`], [`evaluate_log`] for the sliding window log. Pure: the caller
//! gives the time and writes the new state back, or not.

use super::limits::{Algorithm, Boxed, Limits, MAX_LIMIT, NANOS_PER_SEC, Nanos, Verdict};
use super::state::{Cell, Log};

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
            boxed: Boxed::No,
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
            boxed: Boxed::No,
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
            boxed: Boxed::No,
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
            boxed: Boxed::No,
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
            boxed: Boxed::No,
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
        let verdict = Verdict {
            allowed: false,
            remaining: 0,
            reset_after,
            retry_after,
            delay: 0,
            fallback: false,
            boxed: Boxed::No,
        };
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
        let verdict = Verdict {
            allowed: true,
            remaining,
            reset_after,
            retry_after: 0,
            delay: 0,
            fallback: false,
            boxed: Boxed::No,
        };
        (verdict, Cell { t: HELD, v: held + cost })
    } else {
        let verdict = Verdict {
            allowed: false,
            remaining: 0,
            reset_after: CONCURRENCY_RETRY,
            retry_after: CONCURRENCY_RETRY,
            delay: 0,
            fallback: false,
            boxed: Boxed::No,
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
            boxed: Boxed::No,
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
            boxed: Boxed::No,
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
