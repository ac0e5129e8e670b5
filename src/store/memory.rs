//! The in-memory store: this process's counters, sharded, no global lock.
//!
//! Keys are hashed once (SipHash-quality foldhash with a per-process random
//! seed, so a client cannot craft colliding keys) and the 64-bit hash is the
//! map key: a tracked key costs its 8-byte hash plus a 16-byte [`Cell`] plus
//! the hash table's control byte and slack, about 25-50 bytes, instead of a
//! heap-allocated string. Two distinct keys share a bucket only if their
//! 64-bit hashes collide: about one chance in 10^7 among a million keys.
//!
//! Each shard is a `std::sync::Mutex` around two hash maps. A check holds the
//! lock for a few arithmetic operations and never across an `.await`, so a
//! blocking mutex is cheaper than an async one, and with 64 shards two
//! requests rarely meet on the same lock. A request with several checks locks
//! the shards it needs in ascending order (no deadlock), decides all checks,
//! and writes back only if every enforced check admitted it.
//!
//! Idle keys are dropped by [`MemoryStore::sweep`], which the server calls
//! periodically: a key untouched for longer than the longest
//! [`Limits::idle_horizon`] of the active rules is equivalent to a fresh one.

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::clock::SharedClock;
use crate::limiter::{self, Cell, Limits, Log, Nanos, Verdict};
use crate::store::{Check, Mode, Store, StoreError};

const SHARDS: usize = 64;

/// The in-memory [`Store`].
pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    hasher: foldhash::quality::RandomState,
    clock: SharedClock,
    idle_horizon: AtomicU64,
}

#[derive(Default)]
struct Shard {
    cells: HashMap<u64, Cell, BuildHasherDefault<IdentityHasher>>,
    logs: HashMap<u64, Log, BuildHasherDefault<IdentityHasher>>,
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
    /// An empty store reading time from `clock`.
    pub fn new(clock: SharedClock) -> Self {
        let shards = (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect();
        MemoryStore {
            shards,
            hasher: foldhash::quality::RandomState::default(),
            clock,
            idle_horizon: AtomicU64::new(0),
        }
    }

    /// The number of keys tracked right now.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let s = lock(s);
                s.cells.len() + s.logs.len()
            })
            .sum()
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
        for shard in self.shards.iter() {
            let mut s = lock(shard);
            let before = s.cells.len() + s.logs.len();
            s.cells.retain(|_, c| c.t.saturating_add(horizon) > now);
            s.logs.retain(|_, l| l.back().is_some_and(|&(t, _)| t.saturating_add(horizon) > now));
            dropped += before - (s.cells.len() + s.logs.len());
        }
        dropped
    }

    fn shard_of(hash: u64) -> usize {
        // Not the low bits (the map's bucket index) nor the top seven (its
        // control tag): keys of one shard would otherwise crowd together.
        (hash >> 40) as usize & (SHARDS - 1)
    }

    /// Decides `checks` synchronously; the `Store` impl wraps this.
    pub fn check_now(&self, checks: &[Check<'_>], mode: Mode) -> Vec<Verdict> {
        let now = self.clock.now();
        if let [one] = checks {
            // The common case: one rule, one lock, no bookkeeping.
            let hash = self.hasher.hash_one(one.key);
            let mut shard = lock(&self.shards[Self::shard_of(hash)]);
            let commit = mode == Mode::Consume;
            return vec![decide(&mut shard, hash, one, now, commit)];
        }

        let hashes: Vec<u64> = checks.iter().map(|c| self.hasher.hash_one(c.key)).collect();
        let mut order: Vec<usize> = hashes.iter().map(|&h| Self::shard_of(h)).collect();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<(usize, MutexGuard<'_, Shard>)> =
            order.iter().map(|&i| (i, lock(&self.shards[i]))).collect();
        let guard_for = |hash: u64| -> usize {
            let idx = Self::shard_of(hash);
            // `order` holds every shard index of `hashes`, so the search
            // always finds it.
            guards.iter().position(|(i, _)| *i == idx).unwrap_or(0)
        };
        let slots: Vec<usize> = hashes.iter().map(|&h| guard_for(h)).collect();

        // First pass: decide without writing.
        let verdicts: Vec<Verdict> = checks
            .iter()
            .zip(&hashes)
            .zip(&slots)
            .map(|((c, &h), &g)| decide(&mut guards[g].1, h, c, now, false))
            .collect();
        let admitted = checks.iter().zip(&verdicts).all(|(c, v)| v.allowed || !c.enforced);
        if mode == Mode::Consume && admitted {
            // Second pass, same locks still held: write what was admitted.
            for ((c, &h), (&g, v)) in checks.iter().zip(&hashes).zip(slots.iter().zip(&verdicts)) {
                if v.allowed {
                    decide(&mut guards[g].1, h, c, now, true);
                }
            }
        }
        verdicts
    }
}

/// Evaluates one check against its shard; writes the new state when
/// `commit` is set and the check is admitted.
fn decide(shard: &mut Shard, hash: u64, check: &Check<'_>, now: Nanos, commit: bool) -> Verdict {
    let limits: &Limits = &check.limits;
    if limits.algorithm.uses_log() {
        if commit {
            let log = shard.logs.entry(hash).or_default();
            let v = limiter::evaluate_log(log, now, limits, check.cost, true);
            if log.is_empty() {
                shard.logs.remove(&hash);
            }
            return v;
        }
        return match shard.logs.get_mut(&hash) {
            Some(log) => limiter::evaluate_log(log, now, limits, check.cost, false),
            None => limiter::evaluate_log(&mut Log::new(), now, limits, check.cost, false),
        };
    }
    let cell = shard.cells.get(&hash).copied().unwrap_or_default();
    let (verdict, next) = limiter::evaluate(cell, now, limits, check.cost);
    if commit && verdict.allowed {
        shard.cells.insert(hash, next);
    }
    verdict
}

/// Locks a shard. A panic while the lock was held cannot leave a cell
/// half-written (cells are plain `Copy` values written in one assignment), so
/// a poisoned lock is safe to keep using.
fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    shard.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Store for MemoryStore {
    async fn check(&self, checks: &[Check<'_>], mode: Mode) -> Result<Vec<Verdict>, StoreError> {
        Ok(self.check_now(checks, mode))
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
    use crate::clock::ManualClock;
    use crate::limiter::{Algorithm, NANOS_PER_SEC};

    fn limits(algorithm: Algorithm, limit: u64) -> Limits {
        Limits { algorithm, limit, window: NANOS_PER_SEC, burst: limit }
    }

    fn check(key: &str, algorithm: Algorithm, limit: u64, enforced: bool) -> Check<'_> {
        Check { key, limits: limits(algorithm, limit), cost: 1, enforced }
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
