//! The in-memory store: this process's counters, sharded, no global lock.
//!
//! Keys are hashed once, together with the rule's algorithm
//! (SipHash-quality foldhash with a per-process random seed, so a client
//! cannot craft colliding keys) and the 64-bit hash is the
//! map key: a tracked key costs its 8-byte hash plus a 16-byte [`Cell`] plus
//! 8 bytes of eviction facts ([`Meta`], padded) plus the hash table's
//! control byte and slack, about 33-66 bytes, instead of a
//! heap-allocated string. Two distinct keys share a bucket only if their
//! 64-bit hashes collide: about one chance in 10^7 among a million keys.
//!
//! The keys are split over 64 [`Shards`], each two hash maps behind a
//! blocking mutex: a check holds it for a few arithmetic operations and
//! never across an `.await`, and two requests rarely meet on the same lock. A request with several checks locks
//! the shards it needs in ascending order (no deadlock), decides all checks,
//! and writes back only if every enforced check admitted it.
//!
//! Idle keys are dropped by [`MemoryStore::sweep`], which the server calls
//! periodically: a key untouched for longer than the longest
//! [`Limits::idle_horizon`] of the active rules is equivalent to a fresh one.
//!
//! A concurrency key is a cell counting its requests in flight: a request
//! it admits holds [`Slots`], which give the slot back when dropped, and
//! the cell is removed when its count returns to zero. Its `t` is
//! [`limiter::HELD`], so a sweep never takes it while slots are held.
//!
//! Keys are chosen by clients (a user header, a path, a query parameter), so
//! the store is also bounded in size: `[store] max_keys`, split evenly over
//! the shards. A shard that is full when a new key arrives forgets its keys
//! nearest to their full quota first (see [`Meta`]): a key that is already
//! fresh costs nothing to forget, a key that used one unit of a hundred gives
//! its client one unit back, and the key of a client at its limit is the
//! last to go. The shard frees a quarter of its room at once, so the scan
//! that ranks its keys is paid once per that many new keys, not per request.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::MutexGuard;
use prometheus::IntCounter;

use crate::limiter::clock::SharedClock;
use crate::limiter::shards::Shards;
use crate::limiter::{self, Cell, Limits, Log, Nanos, Verdict};
use crate::store::penalty_box::PenaltyBox;
use crate::store::{Answer, Check, Mode, Store, StoreError};

const SHARDS: usize = 64;

/// The in-memory [`Store`]. A clone is another handle on the same
/// counters.
#[derive(Clone)]
pub struct MemoryStore {
    /// Shared with the [`Slots`] of requests in flight, which give their
    /// concurrency slots back from wherever they are dropped.
    shards: Shards<Shard>,
    clock: SharedClock,
    idle_horizon: Arc<AtomicU64>,
    /// The most keys one shard holds (`max_keys / SHARDS`, at least 1).
    shard_capacity: usize,
    /// Where [`Meta::fresh_at`] counts its seconds from.
    epoch: Nanos,
    /// `tollgate_store_evictions_total`, when the store reports to metrics.
    evictions: Option<IntCounter>,
    /// Keys refused whatever their counters say (see [`PenaltyBox`]).
    penalties: PenaltyBox,
}

#[derive(Default)]
struct Shard {
    cells: HashMap<u64, (Cell, Meta), BuildHasherDefault<IdentityHasher>>,
    logs: HashMap<u64, (Log, Meta), BuildHasherDefault<IdentityHasher>>,
}

impl Shard {
    fn len(&self) -> usize {
        self.cells.len() + self.logs.len()
    }
}

/// What eviction needs to know about a key, written with its state: 6 bytes
/// (8 with padding), so a cell's map entry is 32 bytes instead of 24.
#[derive(Debug, Clone, Copy, Default)]
struct Meta {
    /// When the key's state becomes equivalent to a fresh one, in whole
    /// seconds (rounded up) since the store's epoch.
    fresh_at: u32,
    /// The share of the key's capacity in use after its last admitted
    /// request, in 1/65535ths.
    used: u16,
}

impl Meta {
    /// Eviction order, lowest first: keys already fresh, then the least used
    /// share of their capacity, then the nearest to becoming fresh.
    fn rank(self, now_secs: u32) -> u64 {
        if self.fresh_at <= now_secs {
            return 0;
        }
        ((self.used as u64 + 1) << 32) | (self.fresh_at - now_secs) as u64
    }
}

/// The store's context for one decision: the time, and how full a shard may
/// get.
struct Ctx<'a> {
    now: Nanos,
    now_secs: u32,
    store: &'a MemoryStore,
}

/// The map keys are already hashes: hashing them again would only cost time.
#[derive(Default)]
struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used by the maps; fold anything else in.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ b as u64;
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

impl MemoryStore {
    /// The clock it reads: a calendar rule's window is computed on it (see
    /// [`crate::limit::rules::Rule::limits_of`]), so that both agree on the time.
    pub fn clock(&self) -> &dyn crate::limiter::clock::Clock {
        &*self.clock
    }

    /// An empty store reading time from `clock`.
    ///
    /// Unbounded until [`MemoryStore::bounded`] says otherwise.
    pub fn new(clock: SharedClock) -> Self {
        let shards = Shards::new(SHARDS, Shard::default);
        let epoch = clock.now();
        MemoryStore {
            shards,
            clock,
            idle_horizon: Arc::new(AtomicU64::new(0)),
            shard_capacity: usize::MAX,
            epoch,
            evictions: None,
            penalties: PenaltyBox::new(usize::MAX),
        }
    }

    /// Holds at most `max_keys` keys (rounded down to a multiple of the
    /// shard count, at least one per shard), counting what it forgets in
    /// `evictions`.
    pub fn bounded(mut self, max_keys: usize, evictions: Option<IntCounter>) -> Self {
        self.shard_capacity = (max_keys / SHARDS).max(1);
        self.evictions = evictions;
        self.penalties = PenaltyBox::new(max_keys);
        self
    }

    /// Keys refused whatever their counters say (penalties, blocks).
    pub fn penalty_box(&self) -> &PenaltyBox {
        &self.penalties
    }

    /// The most keys the store holds.
    pub fn max_keys(&self) -> usize {
        self.shard_capacity.saturating_mul(SHARDS)
    }

    /// The store's time.
    pub fn now(&self) -> Nanos {
        self.clock.now()
    }

    fn ctx(&self) -> Ctx<'_> {
        let now = self.clock.now();
        Ctx { now, now_secs: secs_since(self.epoch, now), store: self }
    }

    /// The number of keys tracked right now.
    pub fn len(&self) -> usize {
        self.shards.sum(Shard::len)
    }

    /// Whether no key is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every key idle for longer than the idle horizon. Returns how
    /// many were dropped. Locks one shard at a time.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now();
        let horizon = self.idle_horizon.load(Ordering::Relaxed);
        let mut dropped = 0;
        for mut s in self.shards.each() {
            let before = s.len();
            s.cells.retain(|_, (c, _)| c.t.saturating_add(horizon) > now);
            s.logs.retain(|_, (l, _)| l.back().is_some_and(|&(t, _)| t.saturating_add(horizon) > now));
            dropped += before - s.len();
        }
        self.penalties.sweep(now);
        dropped
    }

    /// The map key of a check's state: its bucket key and algorithm. A
    /// rule whose algorithm changes on reload starts from a fresh state
    /// instead of reading the old one with the new arithmetic (a token
    /// bucket's level is no fixed window's count), as the Redis store's
    /// per-algorithm key suffix does. One whose window changes keeps its
    /// state, read with the new window (see [`limiter::regrid`] for the
    /// sliding counter), as Redis keeps it: the two stores answer alike.
    fn hash_of(&self, check: &Check<'_>) -> u64 {
        self.shards.hash(&(check.key, check.limits.algorithm))
    }

    /// Decides `checks` synchronously; the `Store` impl wraps this. A
    /// concurrency slot it takes is given back at once (see
    /// [`MemoryStore::check_holding`] for callers with a request to hold
    /// it for).
    pub fn check_now(&self, checks: &[Check<'_>], mode: Mode) -> Vec<Verdict> {
        self.check_holding(checks, mode).0
    }

    /// Decides `checks` synchronously, and answers the concurrency slots
    /// the request now holds: `Some` only when it was admitted with a
    /// concurrency check, given back when dropped.
    pub fn check_holding(&self, checks: &[Check<'_>], mode: Mode) -> (Vec<Verdict>, Option<Slots>) {
        let ctx = self.ctx();
        let commit = mode == Mode::Consume;
        if self.penalties.is_active()
            && let Some(answer) = self.answer_from_box(checks, &ctx)
        {
            return (answer, None);
        }
        if let [one] = checks {
            // The common case: one rule, one lock, no bookkeeping.
            let hash = self.hash_of(one);
            let mut v = {
                let mut shard = self.shards.lock_hash(hash);
                decide(&mut shard, hash, one, &ctx, commit)
            };
            if !v.allowed && commit && one.enforced {
                v = self.strike(one, v, &ctx);
            }
            let held =
                (commit && v.allowed && one.limits.algorithm.holds()).then(|| self.slots(vec![(hash, one.cost)]));
            return (vec![v], held);
        }

        let hashes: Vec<u64> = checks.iter().map(|c| self.hash_of(c)).collect();
        let mut order: Vec<usize> = hashes.iter().map(|&h| self.shards.index(h)).collect();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<(usize, MutexGuard<'_, Shard>)> = order.iter().map(|&i| (i, self.shards.lock(i))).collect();
        let guard_for = |hash: u64| -> usize {
            let idx = self.shards.index(hash);
            // `order` holds every shard index of `hashes`, so the search
            // always finds it.
            guards.iter().position(|(i, _)| *i == idx).unwrap_or(0)
        };
        let slots: Vec<usize> = hashes.iter().map(|&h| guard_for(h)).collect();

        // First pass: decide without writing.
        let mut verdicts: Vec<Verdict> = checks
            .iter()
            .zip(&hashes)
            .zip(&slots)
            .map(|((c, &h), &g)| decide(&mut guards[g].1, h, c, &ctx, false))
            .collect();
        let admitted = checks.iter().zip(&verdicts).all(|(c, v)| v.allowed || !c.enforced);
        let mut held = Vec::new();
        if commit && admitted {
            // Second pass, same locks still held: write what was admitted.
            for ((c, &h), (&g, v)) in checks.iter().zip(&hashes).zip(slots.iter().zip(&verdicts)) {
                if v.allowed {
                    decide(&mut guards[g].1, h, c, &ctx, true);
                    if c.limits.algorithm.holds() {
                        held.push((h, c.cost));
                    }
                }
            }
        }
        drop(guards);
        if commit && !admitted {
            for (c, v) in checks.iter().zip(verdicts.iter_mut()) {
                if !v.allowed && c.enforced {
                    *v = self.strike(c, *v, &ctx);
                }
            }
        }
        let held = (!held.is_empty()).then(|| self.slots(held));
        (verdicts, held)
    }

    /// A request with an enforced check whose key is in the penalty box:
    /// those refused by the box, the others answered without counting (a
    /// refused request counts nowhere). `None`: the box refuses none.
    fn answer_from_box(&self, checks: &[Check<'_>], ctx: &Ctx<'_>) -> Option<Vec<Verdict>> {
        let boxed: Vec<Option<Verdict>> = checks.iter().map(|c| self.penalties.verdict(c.key, ctx.now)).collect();
        if !checks.iter().zip(&boxed).any(|(c, b)| c.enforced && b.is_some()) {
            return None;
        }
        let free: Vec<Check<'_>> =
            checks.iter().zip(&boxed).filter(|(_, b)| b.is_none()).map(|(c, _)| c.clone()).collect();
        let mut peeked = self.check_holding(&free, Mode::Peek).0.into_iter();
        Some(boxed.into_iter().map(|b| b.or_else(|| peeked.next()).unwrap_or_default()).collect())
    }

    /// A refusal of `check` counted towards its rule's penalty: the
    /// verdict as the box answers it if the key now enters it.
    fn strike(&self, check: &Check<'_>, verdict: Verdict, ctx: &Ctx<'_>) -> Verdict {
        match check.penalty {
            Some(p) => self.penalties.strike(check.key, p, check.limits.window, verdict, ctx.now),
            None => verdict,
        }
    }

    /// Corrects a check's reservation by `delta` units once its request's
    /// real cost is known (see [`limiter::settle`]; `check.cost` is what it
    /// reserved), counted `since` ago; under the key's shard lock, so no
    /// decision sees half of it.
    pub fn settle(&self, check: &Check<'_>, delta: i64, since: Nanos) {
        let delta = limiter::refundable(&check.limits, check.cost, delta, since);
        let ctx = self.ctx();
        let hash = self.hash_of(check);
        let limits = &check.limits;
        let mut shard = self.shards.lock_hash(hash);
        let cell = shard.cells.get(&hash).map(|e| e.0);
        // A key forgotten since (evicted or idle) has nothing to give back;
        // an extra charge starts it again.
        if cell.is_none() && delta < 0 {
            return;
        }
        let Some(next) = limiter::settle(cell.unwrap_or_default(), ctx.now, limits, delta, since) else { return };
        // Eviction facts as a request would leave them: a key in debt is
        // fully used and fresh only once its debt is paid.
        let (verdict, _) = limiter::evaluate(next, ctx.now, limits, 1);
        let meta = Meta::after(&verdict, limits, &ctx);
        if cell.is_none() {
            make_room(&mut shard, &ctx);
        }
        shard.cells.insert(hash, (next, meta));
    }

    fn slots(&self, held: Vec<(u64, u64)>) -> Slots {
        Slots { shards: self.shards.clone(), held }
    }
}

/// Concurrency slots a request holds in a [`MemoryStore`] (map key and
/// count of each): given back when dropped, whatever ended the request.
pub struct Slots {
    shards: Shards<Shard>,
    held: Vec<(u64, u64)>,
}

impl Drop for Slots {
    fn drop(&mut self) {
        for &(hash, cost) in &self.held {
            let mut shard = self.shards.lock_hash(hash);
            // Gone only if the shard was full and forgot it (see
            // `make_room`): nothing left to give back.
            if let Some(entry) = shard.cells.get_mut(&hash) {
                match limiter::release(entry.0, cost) {
                    Some(cell) => entry.0 = cell,
                    None => {
                        shard.cells.remove(&hash);
                    }
                }
            }
        }
    }
}

/// Evaluates one check against its shard; writes the new state when
/// `commit` is set and the check is admitted.
fn decide(shard: &mut Shard, hash: u64, check: &Check<'_>, ctx: &Ctx<'_>, commit: bool) -> Verdict {
    let limits: &Limits = &check.limits;
    let now = ctx.now;
    if limits.algorithm.uses_log() {
        if commit {
            if !shard.logs.contains_key(&hash) {
                make_room(shard, ctx);
            }
            let (log, meta) = shard.logs.entry(hash).or_default();
            let v = limiter::evaluate_log(log, now, limits, check.cost, true);
            if log.is_empty() {
                shard.logs.remove(&hash);
            } else if v.allowed {
                *meta = Meta::after(&v, limits, ctx);
            }
            return v;
        }
        return match shard.logs.get_mut(&hash) {
            Some((log, _)) => limiter::evaluate_log(log, now, limits, check.cost, false),
            None => limiter::evaluate_log(&mut Log::new(), now, limits, check.cost, false),
        };
    }
    if let Some(entry) = shard.cells.get_mut(&hash) {
        let (verdict, next) = limiter::evaluate(entry.0, now, limits, check.cost);
        if commit && verdict.allowed {
            *entry = (next, Meta::after(&verdict, limits, ctx));
        }
        return verdict;
    }
    let (verdict, next) = limiter::evaluate(Cell::default(), now, limits, check.cost);
    if commit && verdict.allowed {
        make_room(shard, ctx);
        shard.cells.insert(hash, (next, Meta::after(&verdict, limits, ctx)));
    }
    verdict
}

impl Meta {
    /// A key with requests in flight: never fresh, fully used, so the last
    /// to be forgotten (forgetting it would admit more than its limit).
    const HELD: Meta = Meta { fresh_at: u32::MAX, used: u16::MAX };

    /// The eviction facts of a key just admitted with `verdict`.
    fn after(verdict: &Verdict, limits: &Limits, ctx: &Ctx<'_>) -> Meta {
        if limits.algorithm.holds() {
            return Meta::HELD;
        }
        let capacity = limits.capacity().max(1) as u128;
        let used = capacity.saturating_sub(verdict.remaining as u128) * u16::MAX as u128 / capacity;
        let fresh_at = secs_since(ctx.store.epoch, ctx.now.saturating_add(verdict.reset_after)).saturating_add(1);
        Meta { fresh_at, used: used.min(u16::MAX as u128) as u16 }
    }
}

/// Whole seconds from `epoch` to `t` (0 before it), saturating.
fn secs_since(epoch: Nanos, t: Nanos) -> u32 {
    u32::try_from(t.saturating_sub(epoch) / limiter::NANOS_PER_SEC).unwrap_or(u32::MAX)
}

/// Makes room for one new key in a full shard: forgets a quarter of the
/// shard's capacity (at least one key), lowest [`Meta::rank`] first. One
/// pass ranks every key of the shard, so the cost per new key is about
/// four rank computations, whatever the shard's size.
fn make_room(shard: &mut Shard, ctx: &Ctx<'_>) {
    let capacity = ctx.store.shard_capacity;
    let len = shard.len();
    if len < capacity {
        return;
    }
    let keep = (capacity - 1).saturating_sub(capacity / 4);
    let evict = len - keep;
    let now = ctx.now_secs;
    let mut ranks: Vec<u64> = shard.cells.values().map(|e| e.1.rank(now)).collect();
    ranks.extend(shard.logs.values().map(|e| e.1.rank(now)));
    // `evict` is at least 1 and at most `len`, the length of `ranks`.
    let (_, &mut threshold, _) = ranks.select_nth_unstable(evict - 1);
    let below = ranks.iter().filter(|&&r| r < threshold).count();
    let mut ties = evict - below;
    let mut forget = |meta: &Meta| {
        let r = meta.rank(now);
        if r < threshold {
            return true;
        }
        if r == threshold && ties > 0 {
            ties -= 1;
            return true;
        }
        false
    };
    shard.cells.retain(|_, e| !forget(&e.1));
    shard.logs.retain(|_, e| !forget(&e.1));
    if let Some(counter) = &ctx.store.evictions {
        counter.inc_by((len - shard.len()) as u64);
    }
}

impl Store for MemoryStore {
    async fn check(&self, checks: &[Check<'_>], mode: Mode) -> Vec<Answer> {
        self.check_now(checks, mode).into_iter().map(Ok).collect()
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn backend(&self) -> &'static str {
        "memory"
    }

    fn set_idle_horizon(&self, horizon: Nanos) {
        self.idle_horizon.store(horizon, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::limiter::clock::ManualClock;
    use crate::limiter::{Algorithm, NANOS_PER_SEC};

    fn limits(algorithm: Algorithm, limit: u64) -> Limits {
        Limits { algorithm, limit, window: NANOS_PER_SEC, burst: limit, origin: 0 }
    }

    fn check(key: &str, algorithm: Algorithm, limit: u64, enforced: bool) -> Check<'_> {
        Check {
            key,
            limits: limits(algorithm, limit),
            cost: 1,
            enforced,
            on_error: crate::config::OnError::Allow,
            settles: false,
            penalty: None,
        }
    }

    fn store() -> (MemoryStore, ManualClock) {
        let clock = ManualClock::new(1_000 * NANOS_PER_SEC);
        (MemoryStore::new(Arc::new(clock.clone())), clock)
    }

    #[test]
    fn a_rejected_request_consumes_no_quota_from_other_rules() {
        let (s, _) = store();
        let wide = check("wide", Algorithm::FixedWindow, 10, true);
        let narrow = check("narrow", Algorithm::FixedWindow, 2, true);
        let both = [wide.clone(), narrow.clone()];
        let admitted = (0..5).filter(|_| s.check_now(&both, Mode::Consume).iter().all(|v| v.allowed)).count();
        assert_eq!(admitted, 2);
        // `wide` counted only the two admitted requests: 8 remain.
        let v = s.check_now(&[wide], Mode::Peek);
        assert_eq!(v[0].remaining, 7, "peek reports what would remain after one more");
    }

    #[test]
    fn shadow_rejections_do_not_block_enforced_rules() {
        let (s, _) = store();
        let enforced = check("e", Algorithm::TokenBucket, 5, true);
        let shadow = check("s", Algorithm::TokenBucket, 1, false);
        let both = [enforced.clone(), shadow];
        for _ in 0..3 {
            s.check_now(&both, Mode::Consume);
        }
        assert_eq!(s.check_now(&[enforced], Mode::Peek)[0].remaining, 1);
    }

    #[test]
    fn peek_never_counts() {
        let (s, _) = store();
        for alg in [
            Algorithm::TokenBucket,
            Algorithm::LeakyBucket,
            Algorithm::FixedWindow,
            Algorithm::SlidingWindowLog,
            Algorithm::SlidingWindowCounter,
        ] {
            let c = check("k", alg, 3, true);
            for _ in 0..10 {
                assert!(s.check_now(std::slice::from_ref(&c), Mode::Peek)[0].allowed, "{alg:?}");
            }
        }
        assert!(s.is_empty());
    }

    #[test]
    fn sweep_drops_idle_keys_only() {
        let (s, clock) = store();
        s.set_idle_horizon(2 * NANOS_PER_SEC);
        s.check_now(&[check("old", Algorithm::TokenBucket, 5, true)], Mode::Consume);
        s.check_now(&[check("log", Algorithm::SlidingWindowLog, 5, true)], Mode::Consume);
        clock.advance(Duration::from_millis(1500));
        s.check_now(&[check("new", Algorithm::FixedWindow, 5, true)], Mode::Consume);
        assert_eq!(s.len(), 3);
        clock.advance(Duration::from_millis(1000));
        assert_eq!(s.sweep(), 2);
        assert_eq!(s.len(), 1);
    }

    const ALGORITHMS: [Algorithm; 5] = [
        Algorithm::TokenBucket,
        Algorithm::LeakyBucket,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindowLog,
        Algorithm::SlidingWindowCounter,
    ];

    /// How many of `n` requests at one instant `c` admits.
    fn admitted(s: &MemoryStore, c: &Check<'_>, n: usize) -> usize {
        (0..n).filter(|_| s.check_now(std::slice::from_ref(c), Mode::Consume)[0].allowed).count()
    }

    #[test]
    fn a_rule_that_changes_algorithm_starts_from_a_fresh_state() {
        // Every ordered pair: the old algorithm leaves the key part used,
        // the reloaded rule (same key) counts with another and must neither
        // misread the old state nor admit more than its own limit.
        for from in ALGORITHMS {
            for to in ALGORITHMS.into_iter().filter(|&a| a != from) {
                let (s, clock) = store();
                // Mid-window, so that a window start is not `now`.
                clock.advance(Duration::from_millis(300));
                assert_eq!(admitted(&s, &check("k", from, 7, true), 5), 5, "{from:?}");
                let after = check("k", to, 4, true);
                assert_eq!(admitted(&s, &after, 10), 4, "{from:?} -> {to:?}");
            }
        }
    }

    #[test]
    fn a_rule_that_changes_window_keeps_its_counts() {
        let (s, clock) = store();
        clock.advance(Duration::from_millis(300));
        let short = check("k", Algorithm::FixedWindow, 3, true);
        assert_eq!(admitted(&s, &short, 3), 3);
        // The second's 3 lie within the minute that holds it, as Redis
        // reads them.
        let long = Check { limits: Limits { window: 60 * NANOS_PER_SEC, ..short.limits }, ..short.clone() };
        assert_eq!(admitted(&s, &long, 5), 0);
    }

    #[test]
    fn five_million_distinct_keys_stay_under_max_keys() {
        use std::fmt::Write as _;
        let (s, clock) = store();
        let evictions = IntCounter::new("evictions", "test").expect("valid counter");
        let s = s.bounded(16 * 1024, Some(evictions.clone()));
        // A client at its limit before the flood of one-request keys.
        let heavy = check("heavy", Algorithm::FixedWindow, 100, true);
        assert_eq!(admitted(&s, &heavy, 100), 100);
        let mut key = String::new();
        let mut peak = 0;
        for i in 0..5_000_000u32 {
            key.clear();
            let _ = write!(key, "u{i}");
            let c = Check {
                key: &key,
                limits: limits(Algorithm::FixedWindow, 100),
                cost: 1,
                enforced: true,
                on_error: crate::config::OnError::Allow,
                settles: false,
                penalty: None,
            };
            assert!(s.check_now(std::slice::from_ref(&c), Mode::Consume)[0].allowed);
            if i % 100_000 == 0 {
                peak = peak.max(s.len());
                // A little time passes: the window stays the same.
                clock.advance(Duration::from_micros(1));
            }
        }
        let len = s.len();
        assert!(peak.max(len) <= s.max_keys(), "{} keys, bound {}", peak.max(len), s.max_keys());
        assert!(len > s.max_keys() / 2, "eviction frees a slice, not everything: {len}");
        assert_eq!(evictions.get() as usize, 5_000_001 - len);
        // The key nearest to its full quota went first: the client at its
        // limit is still refused.
        assert_eq!(admitted(&s, &heavy, 1), 0);
    }

    #[test]
    fn eviction_forgets_the_least_used_keys_first() {
        let (s, _) = store();
        // 64 keys per shard; 256 busy keys take about 4 of each shard's 64.
        let s = s.bounded(SHARDS * 64, None);
        let busy: Vec<String> = (0..256).map(|i| format!("busy{i}")).collect();
        for k in &busy {
            assert_eq!(admitted(&s, &check(k, Algorithm::TokenBucket, 10, true), 9), 9);
        }
        // Five times the bound in newcomers, one request each.
        for i in 0..SHARDS * 64 * 5 {
            let k = format!("new{i}");
            assert_eq!(admitted(&s, &check(&k, Algorithm::SlidingWindowLog, 10, true), 1), 1);
            assert!(s.len() <= s.max_keys());
        }
        // No busy key was forgotten: each has one request left, not ten.
        for k in &busy {
            assert_eq!(admitted(&s, &check(k, Algorithm::TokenBucket, 10, true), 3), 1, "{k} was forgotten");
        }
    }

    fn slot(key: &str, limit: u64) -> Check<'_> {
        check(key, Algorithm::Concurrency, limit, true)
    }

    #[test]
    fn a_concurrency_slot_is_held_until_dropped() {
        let (s, clock) = store();
        let c = slot("k", 2);
        let (v1, a) = s.check_holding(std::slice::from_ref(&c), Mode::Consume);
        let (v2, b) = s.check_holding(std::slice::from_ref(&c), Mode::Consume);
        assert_eq!((v1[0].remaining, v2[0].remaining), (1, 0));
        let (v3, none) = s.check_holding(std::slice::from_ref(&c), Mode::Consume);
        assert!(!v3[0].allowed && none.is_none(), "a refused request holds nothing");
        // Time and sweeps do not free a held slot.
        s.set_idle_horizon(NANOS_PER_SEC);
        clock.advance(Duration::from_secs(3600));
        s.sweep();
        assert!(!s.check_now(std::slice::from_ref(&c), Mode::Peek)[0].allowed);
        drop(a);
        assert!(s.check_now(std::slice::from_ref(&c), Mode::Peek)[0].allowed, "dropped: its slot is back");
        drop(b);
        assert!(s.is_empty(), "no slot held: the key is forgotten");
    }

    #[test]
    fn check_now_gives_a_slot_back_at_once() {
        let (s, _) = store();
        let c = slot("k", 1);
        for _ in 0..3 {
            assert!(s.check_now(std::slice::from_ref(&c), Mode::Consume)[0].allowed);
        }
        assert!(s.is_empty());
    }

    #[test]
    fn a_request_another_rule_rejects_takes_no_slot() {
        let (s, _) = store();
        let narrow = check("narrow", Algorithm::FixedWindow, 1, true);
        let both = [slot("k", 1), narrow.clone()];
        let (v, held) = s.check_holding(&both, Mode::Consume);
        assert!(v.iter().all(|v| v.allowed));
        assert!(held.is_some());
        drop(held);
        // The fixed window now rejects: the slot must stay free.
        let (v, held) = s.check_holding(&both, Mode::Consume);
        assert!(v[0].allowed && !v[1].allowed && held.is_none());
        let (v, held) = s.check_holding(&[slot("k", 1)], Mode::Consume);
        assert!(v[0].allowed && held.is_some(), "the rejected request left the slot free");
    }

    #[test]
    fn held_slots_are_the_last_keys_forgotten() {
        let (s, _) = store();
        // Sixteen keys a shard, of which a full shard keeps eleven: the 64
        // held slots, spread over 64 shards by a random hash, never fill
        // that many in one (with eight a shard, of which five are kept, a
        // shard got six in about one run in thirty, and one had to go).
        let s = s.bounded(SHARDS * 16, None);
        let held: Vec<_> = (0..64)
            .map(|i| {
                let k = format!("slot{i}");
                s.check_holding(&[slot(&k, 1)], Mode::Consume).1.expect("admitted")
            })
            .collect();
        for i in 0..SHARDS * 16 * 4 {
            let k = format!("new{i}");
            s.check_now(&[check(&k, Algorithm::FixedWindow, 10, true)], Mode::Consume);
        }
        for i in 0..64 {
            let k = format!("slot{i}");
            assert!(!s.check_now(&[slot(&k, 1)], Mode::Peek)[0].allowed, "{k} was forgotten while held");
        }
        drop(held);
    }

    #[test]
    fn a_refusal_of_a_rule_with_a_penalty_boxes_its_key_and_the_box_counts_nothing() {
        let (s, clock) = store();
        let s = s.bounded(SHARDS * 64, None);
        let penalty = crate::limiter::Penalty { duration: 30 * NANOS_PER_SEC, after: 1 };
        let login = Check { penalty: Some(penalty), ..check("login|ip=1", Algorithm::FixedWindow, 1, true) };
        let wide = check("wide|ip=1", Algorithm::FixedWindow, 100, true);
        let both = [login.clone(), wide.clone()];
        assert!(s.check_now(&both, Mode::Consume).iter().all(|v| v.allowed));
        let v = s.check_now(&both, Mode::Consume);
        assert_eq!(
            (v[0].allowed, v[0].retry_after, v[0].boxed),
            (false, 30 * NANOS_PER_SEC, crate::limiter::Boxed::Entered)
        );
        // A new window: the box still refuses, and the other rule counts
        // none of the refused requests.
        clock.advance(Duration::from_secs(5));
        for _ in 0..3 {
            let v = s.check_now(&both, Mode::Consume);
            assert_eq!((v[0].allowed, v[0].boxed), (false, crate::limiter::Boxed::In));
            assert_eq!(v[0].retry_after, 25 * NANOS_PER_SEC);
            assert!(v[1].allowed);
        }
        // (Its window is new: none of the boxed requests counted there.)
        assert_eq!(s.check_now(std::slice::from_ref(&wide), Mode::Peek)[0].remaining, 99);
        // A rule without penalty refuses by its window alone.
        let plain = check("plain|ip=1", Algorithm::FixedWindow, 1, true);
        assert_eq!(admitted(&s, &plain, 3), 1);
        assert_eq!(s.check_now(std::slice::from_ref(&plain), Mode::Consume)[0].boxed, crate::limiter::Boxed::No);
        clock.advance(Duration::from_secs(25));
        assert!(s.check_now(std::slice::from_ref(&login), Mode::Consume)[0].allowed, "the penalty is over");
        s.sweep();
        assert!(!s.penalty_box().is_active());
    }

    #[test]
    fn concurrent_threads_admit_exactly_the_limit() {
        let (s, _) = store();
        let s = Arc::new(s);
        let admitted = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (s, admitted) = (s.clone(), admitted.clone());
                std::thread::spawn(move || {
                    for _ in 0..100 {
                        let c = [
                            check("hot", Algorithm::TokenBucket, 50, true),
                            check("x", Algorithm::FixedWindow, 1000, true),
                        ];
                        if s.check_now(&c, Mode::Consume).iter().all(|v| v.allowed) {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("thread panicked");
        }
        assert_eq!(admitted.load(Ordering::Relaxed), 50);
    }
}
