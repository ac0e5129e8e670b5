//! A reservation corrected to its real cost (the arithmetic of settlement;
//! reading the cost from the response is `crate::proxy::settle`'s): a request
//! reserved its estimated cost when it was admitted, and its real cost
//! arrives with its response (`cost_response_header`).
//! The difference is given back or charged on top, unconditionally: a
//! request whose real cost exceeds what was left is counted in full, and
//! the bucket goes into debt (a token bucket's level above its burst, a
//! window's count above its limit). The arithmetic of [`evaluate`] already
//! reads such a state right: the next requests are refused, `remaining` is
//! 0, never negative, and `Retry-After` is the time the debt takes to clear.
//!
//! [`evaluate`]: super::evaluate

use super::{Algorithm, Cell, Limits, Nanos};

/// Whether an algorithm can be settled. The leaky bucket has already told
/// each request how long to wait from the queue ahead of it, the sliding
/// log stamps one entry per request and the concurrency limiter counts
/// requests, not units: none has a cost to correct after the fact.
pub fn settles(algorithm: Algorithm) -> bool {
    matches!(algorithm, Algorithm::TokenBucket | Algorithm::FixedWindow | Algorithm::SlidingWindowCounter)
}

/// What of a correction by `delta` units may be applied to a reservation
/// of `reserved` units counted `since` ago: all of a charge, and all of a
/// refund except a token bucket's, which gives back only what its level can
/// still hold of the reservation. The level drains as a whole, and by
/// `since` it may have drained the reservation away and taken other
/// requests in its place (10 reserved, answered 12 s later at 1 a second
/// with a real cost of 0: giving 10 back would let 20 through in 2 s
/// against a ceiling of 12). A level that had held `reserved - delta`
/// instead drains no sooner, and from then on at most `rate` a second
/// faster, so at least `reserved - rate * since` of the difference is still
/// in the level (when it is less than the difference), rounded down: never
/// more given back than a bucket charged the real cost would hold less.
///
/// Both stores correct by this (the Redis one sends it as the settle's
/// cost: the server knows no more of the reservation than this process).
pub fn refundable(limits: &Limits, reserved: u64, delta: i64, since: Nanos) -> i64 {
    if delta >= 0 || limits.algorithm != Algorithm::TokenBucket {
        return delta;
    }
    let limits = &limits.bounded();
    let drained = since as f64 * limits.rate();
    let left = (reserved as f64 - drained).floor();
    if left <= 0.0 {
        return 0;
    }
    let back = delta.unsigned_abs().min(left as u64);
    -i64::try_from(back).unwrap_or(i64::MAX)
}

/// The cell after a request's reservation is corrected by `delta` units
/// (the real cost minus the reserved one: negative gives back; a token
/// bucket's bounded by [`refundable`] first). `since` is
/// how long ago the reservation was counted: a window gives back only to
/// the window the reservation went to, and only while that window is still
/// stored (afterwards it no longer counts anyway). An extra charge goes to
/// the current window. `None`: nothing to change.
pub fn settle(cell: Cell, now: Nanos, limits: &Limits, delta: i64, since: Nanos) -> Option<Cell> {
    if delta == 0 || !settles(limits.algorithm) {
        return None;
    }
    let limits = &limits.bounded();
    let units = delta.unsigned_abs();
    let w = limits.window;
    // Window starts, aligned to the origin (a calendar window's start, or
    // the epoch) as `fixed_window` aligns them.
    let align = |t: Nanos| {
        let into = t.saturating_sub(limits.origin);
        limits.origin + into - into % w
    };
    let reserved_in = align(now.saturating_sub(since));
    match limits.algorithm {
        Algorithm::TokenBucket => {
            let elapsed = now.saturating_sub(cell.t) as f64;
            let level = (f64::from_bits(cell.v) - elapsed * limits.rate()).max(0.0);
            let level = if delta > 0 { level + units as f64 } else { (level - units as f64).max(0.0) };
            Some(Cell { t: now.max(cell.t), v: level.to_bits() })
        }
        Algorithm::FixedWindow => {
            let start = align(now).max(cell.t);
            if delta > 0 {
                let count = if cell.t == start { cell.v } else { 0 };
                Some(Cell { t: start, v: count.saturating_add(units) })
            } else if cell.t == reserved_in && reserved_in == start && cell.v > 0 {
                Some(Cell { t: cell.t, v: cell.v.saturating_sub(units) })
            } else {
                None
            }
        }
        Algorithm::SlidingWindowCounter => {
            let cell = super::regrid(cell, w);
            let start = (now - now % w).max(cell.t);
            let (prev, curr) = if cell.t == start {
                (cell.v >> 32, cell.v & 0xffff_ffff)
            } else if cell.t + w == start {
                (cell.v & 0xffff_ffff, 0)
            } else {
                (0, 0)
            };
            let (prev, curr) = if delta > 0 {
                (prev, curr.saturating_add(units).min(u32::MAX as u64))
            } else if reserved_in == start {
                (prev, curr.saturating_sub(units))
            } else if reserved_in + w == start {
                (prev.saturating_sub(units), curr)
            } else {
                return None;
            };
            Some(Cell { t: start, v: (prev << 32) | curr })
        }
        _ => None,
    }
}
