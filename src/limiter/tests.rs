//! Unit tests for the pure rate-limiting arithmetic. Time is only numbers
//! here: nothing sleeps, every timestamp is made up.
//!
//! Most tests run at a realistic "now" (`T0`, late 2023 in nanoseconds since
//! the epoch) rather than near zero, because at ~1.7e18 an `f64` cannot hold
//! a timestamp to the nanosecond (its spacing there is 256 ns), and any
//! arithmetic that converts absolute times to floating point shows up.

use super::*;

const MS: Nanos = 1_000_000;
const SEC: Nanos = NANOS_PER_SEC;
/// 2023-11-14T22:13:20Z: a whole second (and a whole 100 s), but not a whole
/// minute (`1_700_000_000 % 60 == 20`) nor a whole 7 s (`% 7 == 6`).
const T0: Nanos = 1_700_000_000 * SEC;

fn lim(algorithm: Algorithm, limit: u64, window_ms: u64, burst: u64) -> Limits {
    Limits { algorithm, limit, window: window_ms * MS, burst, origin: 0 }
}

fn tb(limit: u64, window_ms: u64, burst: u64) -> Limits {
    lim(Algorithm::TokenBucket, limit, window_ms, burst)
}

fn lb(limit: u64, window_ms: u64, burst: u64) -> Limits {
    lim(Algorithm::LeakyBucket, limit, window_ms, burst)
}

fn fw(limit: u64, window_ms: u64) -> Limits {
    lim(Algorithm::FixedWindow, limit, window_ms, 0)
}

fn swc(limit: u64, window_ms: u64) -> Limits {
    lim(Algorithm::SlidingWindowCounter, limit, window_ms, 0)
}

fn swl(limit: u64, window_ms: u64) -> Limits {
    lim(Algorithm::SlidingWindowLog, limit, window_ms, 0)
}

/// Evaluates one request and, like the store, writes the state back only if
/// it was admitted. Also checks that a rejection hands back the state
/// unchanged (a rejected request must never consume quota).
fn hit(cell: &mut Cell, now: Nanos, limits: &Limits, cost: u64) -> Verdict {
    let (verdict, next) = evaluate(*cell, now, limits, cost);
    if verdict.allowed {
        assert_eq!(verdict.retry_after, 0, "an admitted request has no retry_after");
        *cell = next;
    } else {
        assert_eq!(next, *cell, "a rejection must return the state unchanged");
        assert_eq!(verdict.remaining, 0, "a rejection has nothing remaining");
        assert_eq!(verdict.delay, 0, "a rejection is not delayed");
        assert!(verdict.retry_after >= 1, "a rejection must say when to retry");
    }
    verdict
}

/// What would happen, without writing anything back.
fn peek(cell: Cell, now: Nanos, limits: &Limits, cost: u64) -> Verdict {
    evaluate(cell, now, limits, cost).0
}

/// `n` admitted requests of cost 1 at `now`; returns the verdicts.
fn hit_n(cell: &mut Cell, now: Nanos, limits: &Limits, n: u64) -> Vec<Verdict> {
    (0..n)
        .map(|i| {
            let v = hit(cell, now, limits, 1);
            assert!(v.allowed, "request {i} of {n} at {now} should be admitted: {v:?}");
            v
        })
        .collect()
}

/// Admits requests at `now` until one is rejected; there must be exactly
/// `capacity` of them.
fn fill(cell: &mut Cell, now: Nanos, limits: &Limits) {
    let n = (0..=limits.capacity()).take_while(|_| hit(cell, now, limits, 1).allowed).count();
    assert_eq!(n as u64, limits.capacity(), "{limits:?}");
}

/// Asserts that a request of `cost` at `now` is rejected and that its
/// `retry_after` is exact: admitted at `now + retry_after`, rejected one
/// nanosecond earlier. Returns `retry_after`.
fn assert_retry_exact(cell: Cell, now: Nanos, limits: &Limits, cost: u64) -> Nanos {
    let v = peek(cell, now, limits, cost);
    assert!(!v.allowed, "expected a rejection at {now}: {v:?}");
    let r = v.retry_after;
    assert!(r >= 1);
    let at = peek(cell, now + r, limits, cost);
    assert!(at.allowed, "not admitted at now + retry_after ({r}): {at:?}");
    if r > 1 {
        let before = peek(cell, now + r - 1, limits, cost);
        assert!(!before.allowed, "admitted 1ns before now + retry_after ({r}): {before:?}");
    }
    r
}

/// The same for the log, which is pruned in place, so each probe gets a copy.
fn assert_log_retry_exact(log: &Log, now: Nanos, limits: &Limits, cost: u64) -> Nanos {
    let v = evaluate_log(&mut log.clone(), now, limits, cost, false);
    assert!(!v.allowed, "expected a rejection at {now}: {v:?}");
    let r = v.retry_after;
    assert!(r >= 1);
    let at = evaluate_log(&mut log.clone(), now + r, limits, cost, false);
    assert!(at.allowed, "not admitted at now + retry_after ({r}): {at:?}");
    if r > 1 {
        let before = evaluate_log(&mut log.clone(), now + r - 1, limits, cost, false);
        assert!(!before.allowed, "admitted 1ns before now + retry_after ({r}): {before:?}");
    }
    r
}

/// The token bucket's level as stored in the cell (tokens taken).
fn level(cell: Cell) -> f64 {
    f64::from_bits(cell.v)
}

/// A tiny deterministic PRNG (xorshift64), so property tests are repeatable.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// Uniform-ish in `0..n`.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Request times: clusters (gap 0) mixed with gaps of up to `max_gap_ms`,
/// whole milliseconds from `start`. Millisecond granularity keeps the exact
/// admission boundaries on whole nanoseconds (see `assert_retry_exact`).
fn arrivals(seed: u64, n: usize, start: Nanos, max_gap_ms: u64) -> Vec<Nanos> {
    let mut rng = XorShift(seed);
    let mut t = start;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        match rng.below(4) {
            0 => {}
            1 => t += rng.below(5) * MS,
            _ => t += rng.below(max_gap_ms + 1) * MS,
        }
        out.push(t);
    }
    out
}

// ---------------------------------------------------------------------------
// Algorithm, Limits, ceil_secs
// ---------------------------------------------------------------------------

#[test]
fn algorithm_names_and_kinds() {
    let all = [
        (Algorithm::TokenBucket, "token_bucket"),
        (Algorithm::LeakyBucket, "leaky_bucket"),
        (Algorithm::FixedWindow, "fixed_window"),
        (Algorithm::SlidingWindowLog, "sliding_window_log"),
        (Algorithm::SlidingWindowCounter, "sliding_window_counter"),
    ];
    for (alg, name) in all {
        assert_eq!(alg.as_str(), name);
        // The config name is the serde name.
        let parsed: Algorithm = serde_json::from_str(&format!("\"{name}\"")).unwrap();
        assert_eq!(parsed, alg);
        assert_eq!(alg.uses_log(), alg == Algorithm::SlidingWindowLog);
    }
    assert_eq!(Algorithm::default(), Algorithm::TokenBucket);
    assert!(serde_json::from_str::<Algorithm>("\"TokenBucket\"").is_err());
}

#[test]
fn ceil_secs_rounds_up() {
    assert_eq!(ceil_secs(0), 0);
    assert_eq!(ceil_secs(1), 1);
    assert_eq!(ceil_secs(SEC - 1), 1);
    assert_eq!(ceil_secs(SEC), 1);
    assert_eq!(ceil_secs(SEC + 1), 2);
    assert_eq!(ceil_secs(2_500 * MS), 3);
    assert_eq!(ceil_secs(60 * SEC), 60);
    assert_eq!(ceil_secs(u64::MAX), 18_446_744_074);
}

#[test]
fn capacity_is_burst_for_buckets_and_limit_for_windows() {
    assert_eq!(tb(10, 1000, 25).capacity(), 25);
    assert_eq!(lb(10, 1000, 3).capacity(), 3);
    assert_eq!(lim(Algorithm::FixedWindow, 10, 1000, 25).capacity(), 10);
    assert_eq!(lim(Algorithm::SlidingWindowLog, 10, 1000, 25).capacity(), 10);
    assert_eq!(lim(Algorithm::SlidingWindowCounter, 10, 1000, 25).capacity(), 10);
}

#[test]
fn idle_horizon() {
    // Buckets: burst / rate, rounded up.
    assert_eq!(tb(10, 1000, 20).idle_horizon(), 2 * SEC);
    assert_eq!(tb(10, 1000, 10).idle_horizon(), SEC);
    assert_eq!(lb(10, 1000, 5).idle_horizon(), 500 * MS);
    // 1 token per 1/3 s: 333_333_333.33 ns, rounded up.
    assert_eq!(tb(3, 1000, 1).idle_horizon(), 333_333_334);
    assert_eq!(tb(100, 60_000, 100).idle_horizon(), 60 * SEC);
    // A zero limit is treated as 1 rather than dividing by zero.
    assert_eq!(tb(0, 1000, 4).idle_horizon(), 4 * SEC);
    // Too long to represent: saturates instead of wrapping.
    let huge = Limits { algorithm: Algorithm::TokenBucket, limit: 1, window: u64::MAX, burst: 2, origin: 0 };
    assert_eq!(huge.idle_horizon(), u64::MAX);
    // Windows.
    assert_eq!(fw(10, 1500).idle_horizon(), 1500 * MS);
    assert_eq!(swl(10, 1500).idle_horizon(), 1500 * MS);
    assert_eq!(swc(10, 1500).idle_horizon(), 3000 * MS);
    let huge =
        Limits { algorithm: Algorithm::SlidingWindowCounter, limit: 1, window: u64::MAX / 2 + 1, burst: 0, origin: 0 };
    assert_eq!(huge.idle_horizon(), u64::MAX);
}

#[test]
fn idle_horizon_really_is_idle() {
    // After idle_horizon without requests, every algorithm answers exactly
    // as it does for a fresh key.
    for l in [tb(10, 1000, 7), lb(3, 1000, 4), fw(5, 1000), swc(5, 1000)] {
        let mut cell = Cell::default();
        let now = T0 + 300 * MS;
        fill(&mut cell, now, &l);
        let later = now + l.idle_horizon();
        assert_eq!(peek(cell, later, &l, 1), peek(Cell::default(), later, &l, 1), "{l:?}");
    }
    let l = swl(5, 1000);
    let mut log = Log::new();
    let now = T0 + 300 * MS;
    let admitted = (0..=l.limit).take_while(|_| evaluate_log(&mut log, now, &l, 1, true).allowed).count();
    assert_eq!(admitted as u64, l.limit);
    let later = now + l.idle_horizon();
    assert_eq!(evaluate_log(&mut log, later, &l, 1, false), evaluate_log(&mut Log::new(), later, &l, 1, false));
    assert!(log.is_empty(), "everything has expired by the idle horizon");
}

#[cfg(debug_assertions)]
#[test]
#[should_panic(expected = "evaluate_log")]
fn evaluate_refuses_the_log_in_debug_builds() {
    let _ = evaluate(Cell::default(), T0, &swl(1, 1000), 1);
}

// ---------------------------------------------------------------------------
// Token bucket
// ---------------------------------------------------------------------------

#[test]
fn token_bucket_burst_then_reject() {
    let l = tb(10, 1000, 10);
    let mut cell = Cell::default();
    let vs = hit_n(&mut cell, T0, &l, 10);
    let remaining: Vec<u64> = vs.iter().map(|v| v.remaining).collect();
    assert_eq!(remaining, [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]);
    assert!(vs.iter().all(|v| v.delay == 0), "the token bucket never delays");
    assert_eq!(cell.t, T0);
    assert_eq!(level(cell), 10.0);

    let v = hit(&mut cell, T0, &l, 1);
    assert!(!v.allowed);
    assert_eq!(v.retry_after, 100 * MS);
    assert_eq!(v.reset_after, SEC);
    // Rejections do not accumulate: still exactly one token per 100ms.
    for _ in 0..5 {
        assert!(!hit(&mut cell, T0, &l, 1).allowed);
    }
    assert_eq!(level(cell), 10.0);
}

#[test]
fn token_bucket_burst_differs_from_limit() {
    // 10 per second with room for 3: the burst, not the limit, caps a spike.
    let l = tb(10, 1000, 3);
    let mut cell = Cell::default();
    hit_n(&mut cell, T0, &l, 3);
    assert!(!hit(&mut cell, T0, &l, 1).allowed);
    // A long idle period refills only to the capacity.
    let later = T0 + 60 * SEC;
    let vs = hit_n(&mut cell, later, &l, 3);
    assert_eq!(vs[0].remaining, 2);
    assert!(!hit(&mut cell, later, &l, 1).allowed);
}

#[test]
fn token_bucket_refills_at_limit_per_window() {
    let l = tb(10, 1000, 10);
    let mut cell = Cell::default();
    hit_n(&mut cell, T0, &l, 10);

    // 100ms later: exactly one token back.
    let t = T0 + 100 * MS;
    let v = hit(&mut cell, t, &l, 1);
    assert!(v.allowed, "{v:?}");
    assert_eq!(v.remaining, 0);
    assert!(!hit(&mut cell, t, &l, 1).allowed);

    // 250ms after that: two and a half tokens, so two requests.
    let t = t + 250 * MS;
    hit_n(&mut cell, t, &l, 2);
    let v = hit(&mut cell, t, &l, 1);
    assert!(!v.allowed);
    // Half a token is left over: the next one comes 50ms later.
    assert_eq!(v.retry_after, 50 * MS);

    // A whole window later the bucket is full again, but no fuller.
    let t = t + SEC;
    let vs = hit_n(&mut cell, t, &l, 10);
    assert_eq!(vs[0].remaining, 9);
    assert!(!hit(&mut cell, t, &l, 1).allowed);
}

#[test]
fn token_bucket_refill_with_a_rate_that_is_not_a_whole_number_of_ns() {
    // 7 per second: one token every 142_857_142.86 ns.
    let l = tb(7, 1000, 7);
    let mut cell = Cell::default();
    hit_n(&mut cell, T0, &l, 7);
    let v = peek(cell, T0, &l, 1);
    assert_eq!(v.retry_after, 142_857_143);
    assert_eq!(v.reset_after, SEC);
    assert_eq!(assert_retry_exact(cell, T0, &l, 1), 142_857_143);
    // Two tokens: 285_714_285.71 ns.
    assert_eq!(assert_retry_exact(cell, T0, &l, 2), 285_714_286);
    // Seven sevenths make a whole: after exactly 1s, seven requests again.
    hit_n(&mut cell, T0 + SEC, &l, 7);
    assert!(!peek(cell, T0 + SEC, &l, 1).allowed);

    // 3 per second: 333_333_333.33 ns, where the 1e-9 token slack of the
    // admission test is exactly 1/3 ns, so whether 333_333_333 or
    // 333_333_334 is the first admitted nanosecond is down to rounding.
    // Whichever it is, retry_after must agree with the admission test.
    let l = tb(3, 1000, 3);
    let mut cell = Cell::default();
    hit_n(&mut cell, T0, &l, 3);
    let r = assert_retry_exact(cell, T0, &l, 1);
    assert!((333_333_333..=333_333_334).contains(&r), "{r}");
    hit_n(&mut cell, T0 + SEC, &l, 3);
}

#[test]
fn token_bucket_remaining_and_reset_after() {
    let l = tb(10, 1000, 10);
    let mut cell = Cell::default();
    // reset_after is the time until the bucket is full again: 100ms per
    // token taken.
    for taken in 1..=10u64 {
        let v = hit(&mut cell, T0, &l, 1);
        assert_eq!(v.remaining, 10 - taken);
        assert_eq!(v.reset_after, taken * 100 * MS);
    }
    // Rejected: still the time until full.
    assert_eq!(peek(cell, T0, &l, 1).reset_after, SEC);
    // 350ms later 3.5 tokens are back; taking one leaves 2.5 (remaining
    // floors to 2) and 7.5 taken (750ms until full).
    let v = hit(&mut cell, T0 + 350 * MS, &l, 1);
    assert!(v.allowed);
    assert_eq!(v.remaining, 2);
    assert_eq!(v.reset_after, 750 * MS);
}

#[test]
fn token_bucket_retry_after_is_exact() {
    let l = tb(10, 1000, 10);
    let mut cell = Cell::default();
    hit_n(&mut cell, T0, &l, 10);

    assert_eq!(assert_retry_exact(cell, T0, &l, 1), 100 * MS);
    // Part of the way to the next token: the rest of the way.
    assert_eq!(assert_retry_exact(cell, T0 + 30 * MS, &l, 1), 70 * MS);
    assert_eq!(assert_retry_exact(cell, T0 + 99 * MS, &l, 1), MS);
    // Spelled out: admitted at now + retry_after, not a nanosecond earlier.
    let now = T0 + 42 * MS;
    let r = peek(cell, now, &l, 1).retry_after;
    assert_eq!(r, 58 * MS);
    assert!(!peek(cell, now + r - 1, &l, 1).allowed);
    let v = hit(&mut cell, now + r, &l, 1);
    assert!(v.allowed);
    assert_eq!(v.remaining, 0);
}

#[test]
fn token_bucket_cost_greater_than_one() {
    let l = tb(10, 1000, 10);
    let mut cell = Cell::default();
    let v = hit(&mut cell, T0, &l, 4);
    assert!(v.allowed);
    assert_eq!(v.remaining, 6);
    assert_eq!(v.reset_after, 400 * MS);
    let v = hit(&mut cell, T0, &l, 4);
    assert!(v.allowed);
    assert_eq!(v.remaining, 2);

    // 4 more do not fit in 2: wait for 2 tokens.
    let v = hit(&mut cell, T0, &l, 4);
    assert!(!v.allowed);
    assert_eq!(v.retry_after, 200 * MS);
    assert_eq!(v.reset_after, 800 * MS);
    assert_eq!(assert_retry_exact(cell, T0, &l, 4), 200 * MS);
    // ... but 2 do fit, and the rejected 4 took nothing.
    let v = hit(&mut cell, T0, &l, 2);
    assert!(v.allowed);
    assert_eq!(v.remaining, 0);
    assert_eq!(assert_retry_exact(cell, T0, &l, 4), 400 * MS);

    // A cost of exactly the burst fits an untouched bucket.
    let mut fresh = Cell::default();
    let v = hit(&mut fresh, T0, &l, 10);
    assert!(v.allowed);
    assert_eq!(v.remaining, 0);
    assert_eq!(v.reset_after, SEC);
    // A cost above the burst never fits.
    assert!(!peek(Cell::default(), T0, &l, 11).allowed);
}

#[test]
fn token_bucket_clock_stepping_back_never_refills() {
    let l = tb(10, 1000, 10);
    let mut cell = Cell::default();
    let t1 = T0 + 5 * SEC;
    hit_n(&mut cell, t1, &l, 10);

    // The clock steps back by 2s: nothing is refilled (a wrapping or
    // absolute difference would refill the whole bucket).
    let back = t1 - 2 * SEC;
    let v = hit(&mut cell, back, &l, 1);
    assert!(!v.allowed, "{v:?}");
    assert_eq!(cell.t, t1);

    // And coming back to t1 + 100ms refills exactly one token, counted from
    // t1, not from the earlier reading.
    let v = hit(&mut cell, t1 + 100 * MS, &l, 1);
    assert!(v.allowed);
    assert!(!hit(&mut cell, t1 + 100 * MS, &l, 1).allowed);

    // A request admitted while the clock is behind keeps the later timestamp.
    let mut cell = Cell::default();
    hit_n(&mut cell, t1, &l, 5);
    let v = hit(&mut cell, t1 - SEC, &l, 1);
    assert!(v.allowed);
    assert_eq!(v.remaining, 4);
    assert_eq!(cell.t, t1, "the timestamp must not move backwards");
    assert_eq!(level(cell), 6.0);
    // So 100ms after t1 exactly one token is back.
    let v = hit(&mut cell, t1 + 100 * MS, &l, 1);
    assert_eq!(v.remaining, 4);
}

#[test]
fn token_bucket_changing_limits_keeps_the_count() {
    let l10 = tb(10, 1000, 10);
    let mut cell = Cell::default();
    hit_n(&mut cell, T0, &l10, 6);

    // Raising the burst (e.g. elastic throttling): the 6 taken stay taken.
    let l20 = tb(10, 1000, 20);
    let v = hit(&mut cell, T0, &l20, 1);
    assert!(v.allowed);
    assert_eq!(v.remaining, 13);
    assert_eq!(level(cell), 7.0);

    // Lowering the burst below what is taken: rejected, not reset to full.
    let l5 = tb(5, 1000, 5);
    let v = hit(&mut cell, T0, &l5, 1);
    assert!(!v.allowed, "{v:?}");
    // 7 taken, capacity 5, refilling at 5/s: 3 tokens to drain = 600ms.
    assert_eq!(v.retry_after, 600 * MS);
    assert_eq!(v.reset_after, 1400 * MS);
    assert_eq!(assert_retry_exact(cell, T0, &l5, 1), 600 * MS);

    // Back to the nominal limits: still 7 taken.
    let v = hit(&mut cell, T0, &l10, 1);
    assert!(v.allowed);
    assert_eq!(v.remaining, 2);

    // Raising the rate refills faster from the same level: 8 taken, 20/s.
    let fast = tb(20, 1000, 10);
    let v = peek(cell, T0 + 100 * MS, &fast, 1);
    assert!(v.allowed);
    assert_eq!(v.remaining, 3, "2 tokens back in 100ms at 20/s: 10 - 6 - 1");
}

#[test]
fn token_bucket_fresh_cell_is_full() {
    // A zero cell is a fresh key: elapsed since t = 0 refills everything.
    let l = tb(10, 1000, 10);
    let v = peek(Cell::default(), T0, &l, 1);
    assert_eq!(
        v,
        Verdict {
            allowed: true,
            remaining: 9,
            reset_after: 100 * MS,
            retry_after: 0,
            delay: 0,
            fallback: false,
            boxed: crate::limiter::Boxed::No
        }
    );
    // And works at t = 0 too.
    let v = peek(Cell::default(), 0, &l, 1);
    assert!(v.allowed);
    assert_eq!(v.remaining, 9);
}

#[test]
fn token_bucket_twenty_ones_make_twenty() {
    // The EPSILON case: summing 1.0 twenty times (and refills that are not
    // exact binary fractions) must not lose the last token.
    let l = tb(20, 3000, 20);
    let mut cell = Cell::default();
    hit_n(&mut cell, T0, &l, 20);
    assert!(!peek(cell, T0, &l, 1).allowed);
    // 1 token every 150ms; 3 partial refills of 50ms make one token.
    for i in 1..=3 {
        let t = T0 + i * 50 * MS;
        let v = peek(cell, t, &l, 1);
        assert_eq!(v.allowed, i == 3, "after {}ms: {v:?}", i * 50);
    }
}

// ---------------------------------------------------------------------------
// Leaky bucket (shaping)
// ---------------------------------------------------------------------------

#[test]
fn leaky_bucket_delays_requests_in_turn() {
    // Drains 10 per second (T = 100ms) with a queue of 5.
    let l = lb(10, 1000, 5);
    let mut cell = Cell::default();
    let vs = hit_n(&mut cell, T0, &l, 5);
    let delays: Vec<Nanos> = vs.iter().map(|v| v.delay).collect();
    assert_eq!(delays, [0, 100 * MS, 200 * MS, 300 * MS, 400 * MS]);
    let remaining: Vec<u64> = vs.iter().map(|v| v.remaining).collect();
    assert_eq!(remaining, [4, 3, 2, 1, 0]);
    // reset_after: until the queue has drained.
    assert_eq!(vs[4].reset_after, 500 * MS);

    // The queue is full: rejected, with room again when one has drained.
    let v = hit(&mut cell, T0, &l, 1);
    assert!(!v.allowed);
    assert_eq!(v.retry_after, 100 * MS);
    assert_eq!(v.reset_after, 500 * MS);
    assert_eq!(assert_retry_exact(cell, T0, &l, 1), 100 * MS);
    assert_eq!(assert_retry_exact(cell, T0 + 30 * MS, &l, 1), 70 * MS);
}

#[test]
fn leaky_bucket_drains_over_time() {
    let l = lb(10, 1000, 5);
    let mut cell = Cell::default();
    hit_n(&mut cell, T0, &l, 5);

    // 100ms later one has drained: admitted, queued behind the other four,
    // i.e. forwarded at T0 + 500ms.
    let v = hit(&mut cell, T0 + 100 * MS, &l, 1);
    assert!(v.allowed);
    assert_eq!(v.delay, 400 * MS);
    assert_eq!(v.remaining, 0);
    assert!(!hit(&mut cell, T0 + 100 * MS, &l, 1).allowed);

    // 250ms later 2.5 have drained: two more, forwarded at T0 + 600ms and
    // T0 + 700ms, each one turn behind the previous.
    let t = T0 + 350 * MS;
    let v = hit(&mut cell, t, &l, 1);
    assert_eq!((v.allowed, v.delay), (true, 250 * MS));
    let v = hit(&mut cell, t, &l, 1);
    assert_eq!((v.allowed, v.delay), (true, 350 * MS));
    assert_eq!(v.remaining, 0);
    assert_eq!(v.reset_after, 450 * MS);
    // Half a turn is left: the next slot in 50ms.
    assert_eq!(assert_retry_exact(cell, t, &l, 1), 50 * MS);

    // Once the queue has drained completely, no delay at all.
    let t = T0 + 800 * MS;
    let v = hit(&mut cell, t, &l, 1);
    assert_eq!((v.allowed, v.delay, v.remaining), (true, 0, 4));
    // Long after: a fresh queue.
    let vs = hit_n(&mut cell, t + 10 * SEC, &l, 5);
    assert_eq!(vs[0].delay, 0);
    assert_eq!(vs[4].delay, 400 * MS);
}

#[test]
fn leaky_bucket_cost_and_uneven_rate() {
    // 3 per second: T = 333_333_333.33ns, rounded up when waiting.
    let l = lb(3, 1000, 6);
    let mut cell = Cell::default();
    let v = hit(&mut cell, T0, &l, 2);
    assert_eq!((v.allowed, v.delay, v.remaining), (true, 0, 4));
    let v = hit(&mut cell, T0, &l, 1);
    assert_eq!((v.allowed, v.delay), (true, 666_666_667));
    let v = hit(&mut cell, T0, &l, 3);
    assert_eq!((v.allowed, v.delay, v.remaining), (true, SEC, 0));
    assert_eq!(v.reset_after, 2 * SEC);
    let v = hit(&mut cell, T0, &l, 2);
    assert!(!v.allowed);
    assert_eq!(v.retry_after, 666_666_667);
}

// ---------------------------------------------------------------------------
// Fixed window
// ---------------------------------------------------------------------------

#[test]
fn fixed_window_is_epoch_aligned() {
    // 7s windows: T0 is 6s into the window starting at 1_699_999_994s.
    let l = fw(5, 7000);
    let mut cell = Cell::default();
    let now = T0 + 500 * MS;
    let v = hit(&mut cell, now, &l, 1);
    assert!(v.allowed);
    assert_eq!(cell, Cell { t: 1_699_999_994 * SEC, v: 1 });
    assert_eq!(cell.t, now - now % l.window);
    assert_eq!(v.reset_after, 500 * MS);
    // 1 minute windows: T0 is 20s into its minute.
    let l = fw(5, 60_000);
    let mut cell = Cell::default();
    let v = hit(&mut cell, T0, &l, 1);
    assert_eq!(cell.t, T0 - 20 * SEC);
    assert_eq!(v.reset_after, 40 * SEC);
    // The window start is the same for every instant inside the window.
    let v = hit(&mut cell, T0 + 39 * SEC, &l, 1);
    assert_eq!(cell, Cell { t: T0 - 20 * SEC, v: 2 });
    assert_eq!((v.remaining, v.reset_after), (3, SEC));
}

#[test]
fn fixed_window_aligned_to_a_calendar_origin() {
    // A 23-hour day (a DST change) starting at a whole second that is no
    // multiple of the window: the window is [origin, origin + 23h).
    let hour = 3600 * SEC;
    let origin = T0 - 5 * hour - 7 * SEC;
    let l = Limits { origin, window: 23 * hour, ..fw(2, 1000) };
    let mut cell = Cell::default();
    let v = hit(&mut cell, T0, &l, 1);
    assert_eq!(cell, Cell { t: origin, v: 1 });
    assert_eq!(v.reset_after, origin + 23 * hour - T0);
    hit(&mut cell, T0 + SEC, &l, 1);
    let v = hit(&mut cell, T0 + 2 * SEC, &l, 1);
    assert!(!v.allowed);
    // Retry at the next boundary, exactly.
    assert_eq!(v.retry_after, origin + 23 * hour - T0 - 2 * SEC);
    // An instance whose clock already passed the boundary (before it learnt
    // the next window's origin) counts in the next window, where the next
    // origin counts too.
    let end = origin + 23 * hour;
    let v = hit(&mut cell, end + MS, &l, 1);
    assert_eq!((v.allowed, cell), (true, Cell { t: end, v: 1 }));
    let next = Limits { origin: end, window: 24 * hour, ..l };
    let v = hit(&mut cell, end + 2 * MS, &next, 1);
    assert_eq!((v.allowed, v.remaining, cell), (true, 0, Cell { t: end, v: 2 }));
    // A clock still behind the new origin counts in the new window.
    let v = peek(cell, end - MS, &next, 1);
    assert_eq!((v.allowed, v.retry_after), (false, 24 * hour + MS));
}

#[test]
fn fixed_window_admits_exactly_limit_per_window() {
    let l = fw(5, 1000);
    let start = T0 + 3 * SEC; // T0 is a whole second
    let mut cell = Cell::default();
    let mut remaining = vec![];
    for i in 0..5 {
        let v = hit(&mut cell, start + i * 100 * MS, &l, 1);
        assert!(v.allowed);
        assert_eq!(v.reset_after, SEC - i * 100 * MS);
        remaining.push(v.remaining);
    }
    assert_eq!(remaining, [4, 3, 2, 1, 0]);
    assert_eq!(cell, Cell { t: start, v: 5 });

    // Full: rejected until the window ends, however late in it we ask.
    let v = hit(&mut cell, start + 600 * MS, &l, 1);
    assert!(!v.allowed);
    assert_eq!(v.retry_after, 400 * MS);
    assert_eq!(v.reset_after, 400 * MS);
    assert_eq!(assert_retry_exact(cell, start + 600 * MS, &l, 1), 400 * MS);
    let last = start + SEC - 1;
    let v = hit(&mut cell, last, &l, 1);
    assert_eq!((v.allowed, v.retry_after, v.reset_after), (false, 1, 1));
    assert_eq!(cell, Cell { t: start, v: 5 }, "rejections are not counted");

    // The boundary belongs to the next window, which starts from zero.
    let v = hit(&mut cell, start + SEC, &l, 1);
    assert!(v.allowed);
    assert_eq!(v.remaining, 4);
    assert_eq!(v.reset_after, SEC);
    assert_eq!(cell, Cell { t: start + SEC, v: 1 });
}

#[test]
fn fixed_window_allows_twice_the_limit_across_the_boundary() {
    let l = fw(5, 1000);
    let boundary = T0 + 10 * SEC;
    let mut cell = Cell::default();
    // 5 in the last nanosecond of one window, 5 in the first of the next:
    // 10 requests within 2ns, the known weakness of fixed windows.
    hit_n(&mut cell, boundary - 1, &l, 5);
    assert!(!peek(cell, boundary - 1, &l, 1).allowed);
    hit_n(&mut cell, boundary, &l, 5);
    assert!(!peek(cell, boundary, &l, 1).allowed);
}

#[test]
fn fixed_window_cost_and_stale_windows() {
    let l = fw(10, 1000);
    let start = T0;
    let mut cell = Cell::default();
    let v = hit(&mut cell, start, &l, 7);
    assert_eq!((v.allowed, v.remaining), (true, 3));
    let v = hit(&mut cell, start, &l, 4);
    assert!(!v.allowed);
    assert_eq!(v.retry_after, SEC);
    let v = hit(&mut cell, start, &l, 3);
    assert_eq!((v.allowed, v.remaining), (true, 0));
    // A cell from a window long gone counts for nothing.
    let v = hit(&mut cell, start + 5 * SEC + 250 * MS, &l, 10);
    assert_eq!((v.allowed, v.remaining, v.reset_after), (true, 0, 750 * MS));
    assert_eq!(cell, Cell { t: start + 5 * SEC, v: 10 });
}

#[test]
fn fixed_window_clock_stepping_back_does_not_wipe_the_newer_window() {
    // Two instances a few ms apart around a boundary (or an NTP step): a
    // request stamped in the previous window must not erase the count of
    // the window the key has already moved to.
    let l = fw(5, 1000);
    let boundary = T0 + 10 * SEC;
    let mut cell = Cell::default();
    hit_n(&mut cell, boundary + 2 * MS, &l, 5);
    assert!(!hit(&mut cell, boundary + 3 * MS, &l, 1).allowed);

    // A straggler from a clock 5ms behind.
    let v = hit(&mut cell, boundary - 3 * MS, &l, 1);
    assert!(!v.allowed, "the newer window is full: {v:?}");
    assert_eq!(cell, Cell { t: boundary, v: 5 });
    // Its retry_after still points at the end of the (newer) window.
    assert_eq!(v.retry_after, SEC + 3 * MS);

    // And the newer window stays full.
    assert!(!hit(&mut cell, boundary + 4 * MS, &l, 1).allowed);
    // Until it really ends.
    assert!(hit(&mut cell, boundary + SEC, &l, 1).allowed);
}

// ---------------------------------------------------------------------------
// Sliding window counter
// ---------------------------------------------------------------------------

/// A cell whose previous window (starting at `start - w`) holds `prev` and
/// current window (starting at `start`) holds `curr`.
fn swc_cell(start: Nanos, prev: u64, curr: u64) -> Cell {
    Cell { t: start, v: (prev << 32) | curr }
}

#[test]
fn sliding_counter_weights_the_previous_window() {
    let l = swc(10, 1000);
    let w0 = T0;
    let w1 = T0 + SEC;
    let mut cell = Cell::default();
    // Fill the previous window.
    let vs = hit_n(&mut cell, w0 + 500 * MS, &l, 10);
    assert_eq!(vs[9].remaining, 0);
    assert_eq!(cell, swc_cell(w0, 0, 10));
    assert!(!hit(&mut cell, w0 + 999 * MS, &l, 1).allowed);

    // 30% into the next window, 70% of the previous one still counts:
    // estimate 7, so 3 more.
    let now = w1 + 300 * MS;
    let vs = hit_n(&mut cell, now, &l, 3);
    let remaining: Vec<u64> = vs.iter().map(|v| v.remaining).collect();
    assert_eq!(remaining, [2, 1, 0]);
    // reset_after: when both windows holding requests have slid out.
    assert_eq!(vs[0].reset_after, 2 * SEC - 300 * MS);
    assert_eq!(cell, swc_cell(w1, 10, 3));
    let v = hit(&mut cell, now, &l, 1);
    assert!(!v.allowed);
    assert_eq!(v.reset_after, 1700 * MS);

    // At 40% the estimate is 6 + 3 = 9: room for exactly one more, 100ms on.
    assert_eq!(v.retry_after, 100 * MS);
    let at = now + v.retry_after;
    assert!(peek(cell, at, &l, 1).allowed);
    assert!(!peek(cell, at - MS, &l, 1).allowed);
    assert!(!peek(cell, at - 1, &l, 1).allowed);
    assert_eq!(assert_retry_exact(cell, now, &l, 1), 100 * MS);
    let v = hit(&mut cell, at, &l, 1);
    assert_eq!(v.remaining, 0);
    assert!(!hit(&mut cell, at, &l, 1).allowed);
}

#[test]
fn sliding_counter_rolls_and_skips_windows() {
    let l = swc(10, 1000);
    let mut cell = swc_cell(T0, 4, 6);
    // Next window: the current count becomes the previous one.
    let v = hit(&mut cell, T0 + SEC, &l, 1);
    assert!(v.allowed);
    assert_eq!(cell, swc_cell(T0 + SEC, 6, 1));
    assert_eq!(v.remaining, 3, "10 - 6 (all of prev at 0%) - 1");

    // A whole window skipped: both counts are gone.
    let mut cell = swc_cell(T0, 10, 10);
    let v = hit(&mut cell, T0 + 2 * SEC, &l, 1);
    assert!(v.allowed);
    assert_eq!(v.remaining, 9);
    assert_eq!(cell, swc_cell(T0 + 2 * SEC, 0, 1));
    let mut cell = swc_cell(T0, 10, 10);
    hit_n(&mut cell, T0 + 7 * SEC + 999 * MS, &l, 10);
}

#[test]
fn sliding_counter_retry_after_once_the_current_window_slides_out() {
    // Everything in the current window: no waiting inside it helps; the
    // request fits once enough of this window has become "previous" and
    // slid out: 10 * (1 - f) <= 9 -> f = 10%.
    let l = swc(10, 1000);
    let mut cell = Cell::default();
    let now = T0 + 500 * MS;
    hit_n(&mut cell, now, &l, 10);
    let v = hit(&mut cell, now, &l, 1);
    assert!(!v.allowed);
    assert_eq!(v.retry_after, 600 * MS);
    assert_eq!(v.reset_after, 1500 * MS);
    let at = now + v.retry_after;
    assert!(peek(cell, at, &l, 1).allowed);
    assert!(!peek(cell, at - MS, &l, 1).allowed);
    assert_eq!(assert_retry_exact(cell, now, &l, 1), 600 * MS);
    // Cost 5: 10 * (1 - f) <= 5 -> f = 50%.
    assert_eq!(assert_retry_exact(cell, now, &l, 5), SEC);

    // Mixed: prev 4, curr 8 (limit 10) at 0%: 12 > 9; inside this window
    // the best is 8 < 10, so room = 9 is reached while prev slides out:
    // 4 * (1 - f) + 8 <= 9 -> f = 75%.
    let cell = swc_cell(T0, 4, 8);
    assert_eq!(assert_retry_exact(cell, T0, &l, 1), 750 * MS);
    // prev 4, curr 10: must wait for the next window, 10 * (1 - f) <= 9.
    let cell = swc_cell(T0, 4, 10);
    assert_eq!(assert_retry_exact(cell, T0 + 200 * MS, &l, 1), 900 * MS);
    // Only a previous window: prev 10 at 0%, cost 3 -> f = 30%.
    let cell = swc_cell(T0 - SEC, 0, 10);
    let v = peek(cell, T0, &l, 3);
    assert_eq!((v.allowed, v.reset_after), (false, SEC));
    assert_eq!(assert_retry_exact(cell, T0, &l, 3), 300 * MS);
}

#[test]
fn sliding_counter_retry_after_is_exact_at_real_timestamps() {
    // limit 7, previous window full, start of the next window: the request
    // fits when 7 * (1 - f) <= 6, f = 1/7 of a second = 142_857_142.86ns,
    // so retry_after must be 142_857_143ns, not something rounded to the
    // 256ns spacing of f64 near 1.7e18.
    let l = swc(7, 1000);
    let w1 = T0 + SEC;
    let cell = swc_cell(w1 - SEC, 0, 7);
    let v = peek(cell, w1, &l, 1);
    assert!(!v.allowed);
    assert_eq!(v.retry_after, 142_857_143);
    assert_eq!(assert_retry_exact(cell, w1, &l, 1), 142_857_143);
    // Asking a little later in the window: the same moment.
    assert_eq!(assert_retry_exact(cell, w1 + 12_345, &l, 1), 142_857_143 - 12_345);

    // Inside the window, with both counts: 7 * (1 - f) + 2 <= 6 -> f = 3/7.
    let cell = swc_cell(w1, 7, 2);
    assert_eq!(assert_retry_exact(cell, w1 + 777, &l, 1), 428_571_429 - 777);
    // Next window: 7 * (1 - f) <= 6 from w1 + 1s.
    let cell = swc_cell(w1, 0, 7);
    assert_eq!(assert_retry_exact(cell, w1 + 999, &l, 1), SEC + 142_857_143 - 999);
}

#[test]
fn sliding_counter_remaining_and_cost() {
    let l = swc(10, 1000);
    // prev 5 at 40%: estimate 3, cost 4 -> remaining 3.
    let mut cell = swc_cell(T0 - SEC, 0, 5);
    let v = hit(&mut cell, T0 + 400 * MS, &l, 4);
    assert_eq!((v.allowed, v.remaining), (true, 3));
    assert_eq!(cell, swc_cell(T0, 5, 4));
    // prev 5 at 50% (2.5) + 4 = 6.5: 3 more fit (9.5), a 4th does not.
    let v = hit(&mut cell, T0 + 500 * MS, &l, 4);
    assert!(!v.allowed);
    // 5 * (1 - f) + 4 <= 6 -> f = 60%.
    assert_eq!(v.retry_after, 100 * MS);
    let v = hit(&mut cell, T0 + 500 * MS, &l, 3);
    // 10 - 9.5 = 0.5 floors to 0.
    assert_eq!((v.allowed, v.remaining), (true, 0));
}

#[test]
fn sliding_counter_remaining_survives_rounding() {
    // 75 * (1 - 0.44) is 42 exactly, but 42.00000000000001 in f64: remaining
    // must still be 100 - 42 - 1 = 57, not 56.
    let l = swc(100, 1000);
    let cell = swc_cell(T0 - SEC, 0, 75);
    let v = peek(cell, T0 + 440 * MS, &l, 1);
    assert_eq!((v.allowed, v.remaining), (true, 57));
    let cell = swc_cell(T0, 75, 3);
    let v = peek(cell, T0 + 440 * MS, &l, 1);
    assert_eq!((v.allowed, v.remaining), (true, 54));
}

#[test]
fn sliding_counter_clock_stepping_back_does_not_wipe_the_newer_window() {
    let l = swc(5, 1000);
    let boundary = T0 + 10 * SEC;
    let mut cell = Cell::default();
    hit_n(&mut cell, boundary + 2 * MS, &l, 5);
    let before = cell;
    // A straggler stamped 3ms before the window the key has moved to.
    let v = hit(&mut cell, boundary - 3 * MS, &l, 1);
    assert!(!v.allowed, "{v:?}");
    assert_eq!(cell, before);
    // Counted from the stored window: 5 * (1 - f) <= 4 once it is the
    // previous one, f = 20%, i.e. boundary + 1.2s, 3ms further than usual.
    assert_eq!(v.retry_after, 1200 * MS + 3 * MS);
    assert_eq!(v.reset_after, 2 * SEC + 3 * MS);
    assert!(!hit(&mut cell, boundary + 4 * MS, &l, 1).allowed);
    assert!(!hit(&mut cell, boundary + 1200 * MS - 1, &l, 1).allowed);
    assert!(hit(&mut cell, boundary + 1200 * MS, &l, 1).allowed);
}

// ---------------------------------------------------------------------------
// Sliding window log
// ---------------------------------------------------------------------------

#[test]
fn sliding_log_counts_exactly() {
    let l = swl(3, 1000);
    let mut log = Log::new();
    let mut remaining = vec![];
    for i in 0..3 {
        let v = evaluate_log(&mut log, T0 + i * 100 * MS, &l, 1, true);
        assert!(v.allowed);
        assert_eq!(v.retry_after, 0);
        assert_eq!(v.reset_after, SEC, "the newest entry is the one just added");
        remaining.push(v.remaining);
    }
    assert_eq!(remaining, [2, 1, 0]);
    assert_eq!(log, [(T0, 1), (T0 + 100 * MS, 1), (T0 + 200 * MS, 1)]);

    // Full: rejected, and the rejection is not logged.
    let now = T0 + 300 * MS;
    let v = evaluate_log(&mut log, now, &l, 1, true);
    assert!(!v.allowed);
    assert_eq!(v.remaining, 0);
    // The oldest entry leaves at T0 + 1s.
    assert_eq!(v.retry_after, 700 * MS);
    // The newest leaves at T0 + 1.2s.
    assert_eq!(v.reset_after, 900 * MS);
    assert_eq!(log.len(), 3);
    assert_eq!(assert_log_retry_exact(&log, now, &l, 1), 700 * MS);

    // One nanosecond before the oldest entry expires: still full.
    let v = evaluate_log(&mut log, T0 + SEC - 1, &l, 1, true);
    assert_eq!((v.allowed, v.retry_after), (false, 1));
    assert_eq!(log.len(), 3);
    // Exactly at t + window the entry is gone.
    let v = evaluate_log(&mut log, T0 + SEC, &l, 1, true);
    assert!(v.allowed);
    assert_eq!(v.remaining, 0);
    assert_eq!(log, [(T0 + 100 * MS, 1), (T0 + 200 * MS, 1), (T0 + SEC, 1)]);
}

#[test]
fn sliding_log_retry_after_with_costs() {
    let l = swl(5, 1000);
    let mut log = Log::new();
    assert!(evaluate_log(&mut log, T0, &l, 2, true).allowed);
    assert!(evaluate_log(&mut log, T0 + 100 * MS, &l, 2, true).allowed);
    let v = evaluate_log(&mut log, T0 + 200 * MS, &l, 1, true);
    assert_eq!((v.allowed, v.remaining), (true, 0));
    assert_eq!(log, [(T0, 2), (T0 + 100 * MS, 2), (T0 + 200 * MS, 1)]);

    // Cost 3 needs 3 freed: the first entry frees 2, the second 2 more, so
    // the wait is until the *second* entry expires: T0 + 1.1s.
    let now = T0 + 300 * MS;
    let v = evaluate_log(&mut log, now, &l, 3, true);
    assert!(!v.allowed);
    assert_eq!(v.retry_after, 800 * MS);
    assert_eq!(v.reset_after, 900 * MS);
    assert_eq!(assert_log_retry_exact(&log, now, &l, 3), 800 * MS);
    // Cost 2 needs only the first entry to go.
    assert_eq!(assert_log_retry_exact(&log, now, &l, 2), 700 * MS);
    // Cost 5 needs all of them gone.
    assert_eq!(assert_log_retry_exact(&log, now, &l, 5), 900 * MS);
    assert_eq!(log.len(), 3);
}

#[test]
fn sliding_log_commit_false_does_not_append() {
    let l = swl(2, 1000);
    let mut log = Log::new();
    let v = evaluate_log(&mut log, T0, &l, 1, false);
    assert_eq!(
        v,
        Verdict {
            allowed: true,
            remaining: 1,
            reset_after: SEC,
            retry_after: 0,
            delay: 0,
            fallback: false,
            boxed: crate::limiter::Boxed::No
        }
    );
    assert!(log.is_empty());
    assert!(evaluate_log(&mut log, T0, &l, 1, true).allowed);
    let v = evaluate_log(&mut log, T0 + 400 * MS, &l, 1, false);
    assert_eq!((v.allowed, v.remaining, v.reset_after), (true, 0, SEC));
    assert_eq!(log, [(T0, 1)]);
    // Peeking does prune what has expired (that never changes a decision).
    let v = evaluate_log(&mut log, T0 + SEC, &l, 2, false);
    assert_eq!((v.allowed, v.remaining), (true, 0));
    assert!(log.is_empty());
}

#[test]
fn sliding_log_clock_stepping_back_keeps_the_log_ordered() {
    let l = swl(3, 1000);
    let mut log = Log::new();
    assert!(evaluate_log(&mut log, T0 + 500 * MS, &l, 1, true).allowed);
    // Stamped earlier than the newest entry: logged at the newest time, so
    // the log stays sorted and pruning from the front stays correct.
    assert!(evaluate_log(&mut log, T0 + 400 * MS, &l, 1, true).allowed);
    assert_eq!(log, [(T0 + 500 * MS, 1), (T0 + 500 * MS, 1)]);
    assert!(evaluate_log(&mut log, T0 + 600 * MS, &l, 1, true).allowed);
    let v = evaluate_log(&mut log, T0 + 450 * MS, &l, 1, true);
    assert!(!v.allowed);
    assert_eq!(v.retry_after, SEC + 50 * MS);
    // Both entries at T0 + 500ms expire together.
    let v = evaluate_log(&mut log, T0 + 1500 * MS, &l, 2, false);
    assert_eq!((v.allowed, v.remaining), (true, 0));
    assert_eq!(log, [(T0 + 600 * MS, 1)]);
}

// ---------------------------------------------------------------------------
// Property tests: deterministic pseudo-random arrivals
// ---------------------------------------------------------------------------

/// An exact (integer) token/leaky bucket to compare against: the level is
/// kept in units of 1/window of a request, and drains `limit` units per ns.
struct RefBucket {
    t: u128,
    level: u128,
}

impl RefBucket {
    fn admit(&mut self, now: Nanos, l: &Limits, cost: u64) -> (bool, u128) {
        let w = l.window as u128;
        let elapsed = (now as u128).saturating_sub(self.t);
        let level = self.level.saturating_sub(elapsed * l.limit as u128);
        if level + cost as u128 * w <= l.burst as u128 * w {
            self.level = level + cost as u128 * w;
            self.t = self.t.max(now as u128);
            (true, level)
        } else {
            (false, level)
        }
    }
}

#[test]
fn property_token_bucket() {
    for (seed, l) in [(1, tb(10, 1000, 5)), (2, tb(7, 700, 1)), (3, tb(50, 2000, 30)), (4, tb(10, 1000, 10))] {
        let mut rng = XorShift(seed * 7919);
        let mut cell = Cell::default();
        let mut reference = RefBucket { t: 0, level: 0 };
        let mut admitted: Vec<(Nanos, u64)> = vec![];
        for now in arrivals(seed, 3000, T0 + 123 * MS, 150) {
            // Costs up to 3, never above the burst (that could never fit).
            let cost = if rng.below(4) == 0 { 1 + rng.below(3.min(l.burst)) } else { 1 };
            let before = cell;
            let v = hit(&mut cell, now, &l, cost);
            let (ok, level) = reference.admit(now, &l, cost);
            assert_eq!(v.allowed, ok, "{l:?} at {now} cost {cost}: {v:?}");
            assert_eq!(v.delay, 0);
            if v.allowed {
                // Whole tokens left, exactly (rounding must not lose one).
                let w = l.window as u128;
                let left = l.burst as u128 * w - (level + cost as u128 * w);
                assert_eq!(v.remaining as u128, left / w, "{l:?} at {now}: {v:?}");
                admitted.push((now, cost));
            } else {
                assert_retry_exact(before, now, &l, cost);
            }
        }
        assert!(admitted.len() > 100, "the test should admit plenty");
        // Whatever interval [t_i, t_j] we look at, the admitted cost is at
        // most the burst plus what refilled in between.
        for i in 0..admitted.len() {
            let mut sum = 0u128;
            for j in i..admitted.len() {
                sum += admitted[j].1 as u128;
                let d = (admitted[j].0 - admitted[i].0) as u128;
                let bound = l.burst as u128 * l.window as u128 + l.limit as u128 * d;
                assert!(sum * l.window as u128 <= bound, "{l:?}: {sum} admitted within {d}ns from {}", admitted[i].0);
            }
        }
    }
}

#[test]
fn property_leaky_bucket() {
    for (seed, l) in [(5, lb(10, 1000, 5)), (6, lb(7, 700, 1)), (7, lb(50, 2000, 30))] {
        let turn = l.window / l.limit;
        let mut cell = Cell::default();
        let mut reference = RefBucket { t: 0, level: 0 };
        let mut last_forward: Option<Nanos> = None;
        let mut count = 0;
        for now in arrivals(seed, 3000, T0 + 77 * MS, 150) {
            let before = cell;
            let v = hit(&mut cell, now, &l, 1);
            let (ok, queued) = reference.admit(now, &l, 1);
            assert_eq!(v.allowed, ok, "{l:?} at {now}: {v:?}");
            if !v.allowed {
                assert_retry_exact(before, now, &l, 1);
                continue;
            }
            count += 1;
            // The delay is the time the queue ahead takes to drain.
            assert_eq!(v.delay as u128, queued.div_ceil(l.limit as u128), "{l:?} at {now}");
            assert!(v.delay <= (l.burst - 1) * turn, "{l:?}: delay {} too long", v.delay);
            // Requests leave one turn apart (or later, if the queue was empty).
            let forward = now + v.delay;
            if let Some(prev) = last_forward {
                assert!(forward >= prev + turn, "{l:?}: forwarded {}ns after the previous", forward - prev);
            }
            last_forward = Some(forward);
        }
        assert!(count > 100);
    }
}

#[test]
fn property_fixed_window() {
    for (seed, l) in [(8, fw(5, 1000)), (9, fw(1, 300)), (10, fw(40, 7000))] {
        let mut rng = XorShift(seed * 31);
        let mut cell = Cell::default();
        let mut per_window = std::collections::HashMap::<Nanos, u64>::new();
        for now in arrivals(seed, 3000, T0 + 5 * MS, 150) {
            let cost = if rng.below(5) == 0 { 2.min(l.limit) } else { 1 };
            let start = now - now % l.window;
            let used = per_window.get(&start).copied().unwrap_or(0);
            let before = cell;
            let v = hit(&mut cell, now, &l, cost);
            assert_eq!(v.allowed, used + cost <= l.limit, "{l:?} at {now}: {v:?}");
            assert_eq!(v.reset_after, start + l.window - now);
            if v.allowed {
                *per_window.entry(start).or_default() += cost;
                assert_eq!(v.remaining, l.limit - used - cost);
            } else {
                assert_eq!(assert_retry_exact(before, now, &l, cost), start + l.window - now);
            }
        }
        assert!(per_window.values().all(|&n| n <= l.limit));
        assert!(per_window.len() > 10);
    }
}

#[test]
fn property_sliding_window_counter() {
    // 2520 is divisible by every count up to 10, so the exact admission
    // moments fall on whole nanoseconds and retry_after can be checked to
    // the nanosecond.
    for (seed, l) in [(11, swc(10, 2520)), (12, swc(4, 2520)), (13, swc(10, 1000))] {
        let w = l.window;
        let mut cell = Cell::default();
        let mut per_window = std::collections::HashMap::<Nanos, u64>::new();
        let mut rejected = 0;
        for now in arrivals(seed, 3000, T0 + 9 * MS, 120) {
            let start = now - now % w;
            let prev = start.checked_sub(w).and_then(|p| per_window.get(&p)).copied().unwrap_or(0);
            let curr = per_window.get(&start).copied().unwrap_or(0);
            // Exact estimate, scaled by w: prev * (w - into) + curr * w.
            let est = prev as u128 * (w - (now - start)) as u128 + curr as u128 * w as u128;
            let ok = est + w as u128 <= l.limit as u128 * w as u128;
            let before = cell;
            let v = hit(&mut cell, now, &l, 1);
            assert_eq!(v.allowed, ok, "{l:?} at {now} (prev {prev}, curr {curr}): {v:?}");
            if v.allowed {
                *per_window.entry(start).or_default() += 1;
                assert_eq!(v.reset_after, start + 2 * w - now);
                let left = (l.limit as u128 * w as u128 - est - w as u128) / w as u128;
                assert_eq!(v.remaining as u128, left, "{l:?} at {now}: {v:?}");
            } else {
                rejected += 1;
                if l.window == 2520 * MS {
                    assert_retry_exact(before, now, &l, 1);
                }
            }
        }
        assert!(rejected > 100, "the test should hit the limit often");
        // Never more than the limit in one epoch window.
        assert!(per_window.values().all(|&n| n <= l.limit));
    }
}

#[test]
fn property_sliding_window_log() {
    for (seed, l) in [(14, swl(5, 1000)), (15, swl(1, 250)), (16, swl(30, 3000))] {
        let mut rng = XorShift(seed * 131);
        let mut log = Log::new();
        let mut admitted: Vec<(Nanos, u64)> = vec![];
        for now in arrivals(seed, 3000, T0 + 3 * MS, 150) {
            let cost = if rng.below(4) == 0 { 2.min(l.limit) } else { 1 };
            let in_window: u64 = admitted.iter().filter(|&&(t, _)| t + l.window > now).map(|&(_, c)| c).sum();
            let snapshot = log.clone();
            let v = evaluate_log(&mut log, now, &l, cost, true);
            assert_eq!(v.allowed, in_window + cost <= l.limit, "{l:?} at {now}: {v:?}");
            if v.allowed {
                admitted.push((now, cost));
                assert_eq!(v.remaining, l.limit - in_window - cost);
            } else {
                assert_eq!(log, snapshot.iter().copied().filter(|&(t, _)| t + l.window > now).collect::<Log>());
                assert_log_retry_exact(&snapshot, now, &l, cost);
            }
            // The log holds exactly the admitted requests still in the window.
            let expected: Log =
                admitted.iter().copied().filter(|&(t, _)| t + l.window > now).map(|(t, c)| (t, c as u32)).collect();
            assert_eq!(log, expected);
        }
        // In every sliding window (t - window, t], at most `limit`.
        for (j, &(tj, _)) in admitted.iter().enumerate() {
            let sum: u64 = admitted[..=j].iter().filter(|&&(t, _)| t + l.window > tj).map(|&(_, c)| c).sum();
            assert!(sum <= l.limit, "{l:?}: {sum} in the window ending at {tj}");
        }
        assert!(admitted.len() > 100);
    }
}

#[test]
fn a_limit_past_what_a_cell_counts_is_bounded_not_lifted() {
    // Ten billion per window: the sliding counter's packed count would
    // saturate at u32::MAX and let every later request through.
    let huge = swc(10_000_000_000, 60_000);
    let mut cell = Cell::default();
    let admitted: u64 = (0..10).filter(|_| hit(&mut cell, T0, &huge, 3_000_000_000).allowed).count() as u64;
    assert!(admitted * 3_000_000_000 <= huge.limit, "admitted {admitted} requests of 3e9");
    assert!(admitted * 3_000_000_000 <= MAX_LIMIT, "counted against the bounded limit");
}

#[test]
fn windows_past_the_bound_do_not_overflow() {
    for algorithm in
        [Algorithm::TokenBucket, Algorithm::LeakyBucket, Algorithm::FixedWindow, Algorithm::SlidingWindowCounter]
    {
        let limits = Limits { algorithm, limit: 5, window: u64::MAX, burst: 5, origin: 0 };
        let mut cell = Cell::default();
        for _ in 0..6 {
            hit(&mut cell, T0, &limits, 1);
        }
        assert!(!hit(&mut cell, T0, &limits, 1).allowed, "{algorithm:?}");
    }
    let mut log = Log::new();
    let limits = Limits { algorithm: Algorithm::SlidingWindowLog, limit: 5, window: u64::MAX, burst: 5, origin: 0 };
    let admitted = (0..6).filter(|_| evaluate_log(&mut log, T0, &limits, 1, true).allowed).count();
    assert_eq!(admitted, 5);
}

// ---------------------------------------------------------------------------
// Limits that change on a key (an override or a tier): the counter stays.
// The token bucket's case is `token_bucket_changing_limits_keeps_the_count`.
// ---------------------------------------------------------------------------

#[test]
fn a_lowered_leaky_bucket_still_drains_its_queue() {
    // Requests already queued wait their turn: the queue is not cut short.
    let fast = lb(100, 1000, 100);
    let slow = lb(10, 1000, 10);
    let mut cell = Cell::default();
    hit_n(&mut cell, T0, &fast, 50);
    let v = hit(&mut cell, T0, &slow, 1);
    assert!(!v.allowed);
    // 50 queued drain at the new 10/s to 9 queued: 4.1 s.
    assert_eq!(v.retry_after, 4_100 * MS);
}

#[test]
fn a_window_counted_under_other_limits_counts_against_the_new_ones() {
    for (high, low) in [(fw(100, 60_000), fw(5, 60_000)), (swc(100, 60_000), swc(5, 60_000))] {
        let mut cell = Cell::default();
        hit_n(&mut cell, T0, &high, 7);
        assert!(!hit(&mut cell, T0, &low, 1).allowed, "{:?}: 7 counted, limit 5", low.algorithm);
        assert_eq!(peek(cell, T0, &high, 1).remaining, 92, "{:?}", high.algorithm);
    }
    let mut log = Log::new();
    for _ in 0..7 {
        assert!(evaluate_log(&mut log, T0, &swl(100, 60_000), 1, true).allowed);
    }
    assert!(!evaluate_log(&mut log, T0, &swl(5, 60_000), 1, false).allowed);
}

// ---------------------------------------------------------------------------
// Concurrency
// ---------------------------------------------------------------------------

fn cc(limit: u64) -> Limits {
    lim(Algorithm::Concurrency, limit, 10_000, limit)
}

#[test]
fn concurrency_admits_up_to_its_limit_in_flight_whatever_the_time() {
    let limits = cc(3);
    let mut cell = Cell::default();
    for (i, now) in [T0, T0, T0 + 3_600 * SEC].into_iter().enumerate() {
        let (v, next) = evaluate(cell, now, &limits, 1);
        assert!(v.allowed, "request {i}");
        assert_eq!(v.remaining, 2 - i as u64);
        // Slots left: reset now; none left: the same hint as Retry-After.
        assert_eq!(v.reset_after, if i == 2 { CONCURRENCY_RETRY } else { 0 });
        assert_eq!(next.t, HELD, "a held cell is never idle");
        cell = next;
    }
    // Time does not free a slot; only a release does.
    let (v, same) = evaluate(cell, T0 + 86_400 * SEC, &limits, 1);
    assert_eq!(
        v,
        Verdict {
            allowed: false,
            remaining: 0,
            reset_after: CONCURRENCY_RETRY,
            retry_after: CONCURRENCY_RETRY,
            delay: 0,
            fallback: false,
            boxed: crate::limiter::Boxed::No
        }
    );
    assert_eq!(same, cell);
    let cell = release(cell, 1).expect("two still held");
    assert!(evaluate(cell, T0, &limits, 1).0.allowed);
}

#[test]
fn concurrency_release_forgets_the_cell_at_zero() {
    let (_, one) = evaluate(Cell::default(), T0, &cc(5), 1);
    assert_eq!(release(one, 1), None);
    // A release of a cell that is gone (or already at zero) never wraps.
    assert_eq!(release(Cell { t: HELD, v: 0 }, 1), None);
}

/// Admits `cost` at `now` and answers the cell it writes.
fn take(cell: Cell, now: Nanos, limits: &Limits, cost: u64) -> Cell {
    let (v, next) = evaluate(cell, now, limits, cost);
    assert!(v.allowed, "{v:?}");
    next
}

#[test]
fn settling_below_the_estimate_gives_the_difference_back() {
    // Token bucket of 100 per minute, burst 100: reserve 10, really 3.
    let l = tb(100, 60_000, 100);
    let c = take(Cell::default(), T0, &l, 10);
    let c = settle(c, T0, &l, 3 - 10, 0).expect("changed");
    assert_eq!(evaluate(c, T0, &l, 1).0.remaining, 96);
    for l in [fw(100, 60_000), swc(100, 60_000)] {
        let c = take(Cell::default(), T0, &l, 10);
        let c = settle(c, T0 + SEC, &l, -7, SEC).expect("changed");
        assert_eq!(evaluate(c, T0 + SEC, &l, 1).0.remaining, 96, "{l:?}");
    }
}

#[test]
fn settling_above_what_is_left_puts_the_bucket_in_debt() {
    // Burst 100 refilled at 100 per 100 s: one unit per second.
    let l = tb(100, 100_000, 100);
    let c = take(Cell::default(), T0, &l, 10);
    // Really 150: 60 units of debt.
    let c = settle(c, T0, &l, 140, 0).expect("changed");
    let (v, _) = evaluate(c, T0, &l, 1);
    assert!(!v.allowed);
    assert_eq!(v.remaining, 0);
    // The debt (50 over the burst) and one unit: 51 s.
    assert_eq!(ceil_secs(v.retry_after), 51);
    assert!(!evaluate(c, T0 + 50 * SEC, &l, 1).0.allowed);
    assert!(evaluate(c, T0 + v.retry_after, &l, 1).0.allowed);

    // A window over its limit waits for the window to end.
    let l = fw(100, 60_000);
    let c = take(Cell::default(), T0, &l, 10);
    let c = settle(c, T0, &l, 140, 0).expect("changed");
    let (v, _) = evaluate(c, T0, &l, 1);
    assert!(!v.allowed && v.remaining == 0);
    assert_eq!(v.retry_after, 40 * SEC); // T0 is 20 s into its minute.

    // The sliding counter waits until the debt has slid out far enough.
    let l = swc(100, 60_000);
    let c = take(Cell::default(), T0, &l, 10);
    let c = settle(c, T0, &l, 190, 0).expect("changed");
    let (v, _) = evaluate(c, T0, &l, 1);
    assert!(!v.allowed && v.remaining == 0 && v.retry_after > 40 * SEC, "{v:?}");
}

#[test]
fn a_refund_reaches_only_the_window_the_reservation_went_to() {
    let l = fw(100, 60_000);
    let c = take(Cell::default(), T0, &l, 10);
    // 40 s later the next minute has begun: the old count is gone anyway.
    assert_eq!(settle(c, T0 + 40 * SEC, &l, -7, 40 * SEC), None);
    // The sliding counter's previous window still weighs: it gives back there.
    let l = swc(100, 60_000);
    let c = take(Cell::default(), T0, &l, 10);
    let c = settle(c, T0 + 40 * SEC, &l, -10, 40 * SEC).expect("changed");
    assert_eq!(evaluate(c, T0 + 40 * SEC, &l, 1).0.remaining, 99);
}

#[test]
fn settling_a_calendar_window_uses_its_origin() {
    // A 23-hour day starting 7 s past a whole hour: no multiple of 23 h
    // since the epoch, so epoch-aligned arithmetic would miss its window.
    let hour = 3600 * SEC;
    let origin = T0 - 5 * hour - 7 * SEC;
    let l = Limits { origin, window: 23 * hour, ..fw(100, 1000) };
    let c = take(Cell::default(), T0, &l, 10);
    // Really 3: 7 back to this day's count.
    let c = settle(c, T0 + SEC, &l, -7, SEC).expect("changed");
    assert_eq!(c, Cell { t: origin, v: 3 });
    // Really 150: the day goes into debt, until the next local midnight.
    let c = settle(c, T0 + SEC, &l, 147, SEC).expect("changed");
    assert_eq!(c, Cell { t: origin, v: 150 });
    let (v, _) = evaluate(c, T0 + SEC, &l, 1);
    assert_eq!((v.allowed, v.retry_after), (false, origin + 23 * hour - T0 - SEC));
    // A reservation of the day's last second, settled after midnight with
    // the limits it was checked under: its day is over, nothing to give
    // back; a charge goes to the new day.
    let midnight = origin + 23 * hour;
    let c = take(Cell::default(), midnight - SEC, &l, 5);
    assert_eq!(c, Cell { t: origin, v: 5 });
    assert_eq!(settle(c, midnight + SEC, &l, -5, 2 * SEC), None);
    assert_eq!(settle(c, midnight + SEC, &l, 4, 2 * SEC), Some(Cell { t: midnight, v: 4 }));
}

#[test]
fn a_token_bucket_gives_back_only_what_its_level_still_holds_of_a_reservation() {
    // Burst 10 refilled at 10 per 10 s: one unit a second.
    let l = tb(10, 10_000, 10);
    // Reserved 10, really 0: all of it at once, 4 of it after 6 s, none
    // once the 10 have drained (12 s: the case).
    assert_eq!(refundable(&l, 10, -10, 0), -10);
    assert_eq!(refundable(&l, 10, -10, 6 * SEC), -4);
    assert_eq!(refundable(&l, 10, -10, 6 * SEC + 1), -3, "rounded down");
    assert_eq!(refundable(&l, 10, -10, 12 * SEC), 0);
    // Reserved 10, really 7: the 3 are the last to drain, back in full
    // until 7 s, then less.
    assert_eq!(refundable(&l, 10, -3, 7 * SEC), -3);
    assert_eq!(refundable(&l, 10, -3, 8 * SEC), -2);
    // Charges, and the windows' refunds, are not bounded here.
    assert_eq!(refundable(&l, 10, 5, 60 * SEC), 5);
    assert_eq!(refundable(&fw(10, 10_000), 10, -10, 12 * SEC), -10);

    // In the cell: 10 taken at T0 drained by T0 + 10 s, when 10 more are
    // taken; at T0 + 12 s the bucket holds 8, and the drained reservation
    // gives nothing back: 2 of room, not 12.
    let c = take(Cell::default(), T0, &l, 10);
    let c = take(c, T0 + 10 * SEC, &l, 10);
    let back = refundable(&l, 10, -10, 12 * SEC);
    assert_eq!(settle(c, T0 + 12 * SEC, &l, back, 12 * SEC), None);
    assert_eq!(evaluate(c, T0 + 12 * SEC, &l, 1).0.remaining, 1);
}

#[test]
fn only_the_counting_algorithms_settle() {
    for l in [lb(10, 1_000, 10), swl(10, 1_000), lim(Algorithm::Concurrency, 10, 1_000, 10)] {
        assert_eq!(settle(Cell::default(), T0, &l, 5, 0), None);
    }
}
