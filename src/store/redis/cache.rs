//! The local over-limit cache: keys Redis has just rejected, answered here
//! until their retry-after moment without a round trip.
//!
//! This is what keeps a flood away from Redis (envoy's ratelimit does the
//! same): a client hammering a key it has exhausted costs this instance a
//! hash lookup per request instead of a script call per request. It can only
//! reject earlier than Redis would by the round trip that brought the
//! rejection, never admit: an entry is a promise Redis made ("not before
//! `retry_at`"), kept on this instance's monotonic clock so that wall-clock
//! steps cannot stretch or shorten it.
//!
//! An entry applies only to requests with the same effective limits (soft or
//! elastic throttling may lift them) and at least the same cost (a cheaper
//! request may fit sooner).

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::limiter::{Limits, Verdict};

const SHARDS: usize = 16;
/// Entries kept per shard at most: a bound on memory under a flood of
/// distinct rejected keys (160k entries of roughly 100 bytes). Past it,
/// new rejections are simply not cached.
const MAX_PER_SHARD: usize = 10_000;

/// Rejected keys and when Redis said to come back.
pub(super) struct OverLimitCache {
    shards: Box<[Mutex<HashMap<String, Entry>>]>,
    hasher: foldhash::quality::RandomState,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    retry_at: Instant,
    reset_at: Instant,
    limits: Limits,
    cost: u64,
}

impl OverLimitCache {
    pub fn new() -> OverLimitCache {
        OverLimitCache {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: foldhash::quality::RandomState::default(),
        }
    }

    fn shard(&self, key: &str) -> MutexGuard<'_, HashMap<String, Entry>> {
        let i = self.hasher.hash_one(key) as usize % SHARDS;
        // A panic while holding the lock cannot leave an entry half-written
        // (entries are `Copy` values inserted whole), so a poisoned lock is
        // safe to keep using.
        self.shards[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Remembers that Redis rejected `key` with `verdict` at `now`.
    pub fn remember(&self, key: &str, limits: Limits, cost: u64, verdict: &Verdict, now: Instant) {
        let entry = Entry {
            retry_at: now + Duration::from_nanos(verdict.retry_after),
            reset_at: now + Duration::from_nanos(verdict.reset_after),
            limits,
            cost,
        };
        let mut shard = self.shard(key);
        if shard.len() >= MAX_PER_SHARD && !shard.contains_key(key) {
            shard.retain(|_, e| e.retry_at > now);
            if shard.len() >= MAX_PER_SHARD {
                return;
            }
        }
        shard.insert(key.to_string(), entry);
    }

    /// The rejection Redis would give `key` now, if it is still promised.
    pub fn rejection(&self, key: &str, limits: &Limits, cost: u64, now: Instant) -> Option<Verdict> {
        let mut shard = self.shard(key);
        let entry = *shard.get(key)?;
        if entry.retry_at <= now {
            shard.remove(key);
            return None;
        }
        if entry.limits != *limits || cost < entry.cost {
            return None;
        }
        Some(Verdict {
            allowed: false,
            remaining: 0,
            reset_after: nanos(entry.reset_at.saturating_duration_since(now)),
            retry_after: nanos(entry.retry_at - now).max(1),
            delay: 0,
        })
    }

    /// Drops every entry whose moment has passed. Returns how many.
    pub fn sweep(&self, now: Instant) -> usize {
        let mut dropped = 0;
        for shard in self.shards.iter() {
            let mut s = shard.lock().unwrap_or_else(|p| p.into_inner());
            let before = s.len();
            s.retain(|_, e| e.retry_at > now);
            dropped += before - s.len();
        }
        dropped
    }

    /// Entries held now, expired or not.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).len()).sum()
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::{Algorithm, NANOS_PER_SEC};

    const LIMITS: Limits = Limits { algorithm: Algorithm::FixedWindow, limit: 5, window: NANOS_PER_SEC, burst: 5 };

    fn rejected(retry_ms: u64) -> Verdict {
        Verdict {
            allowed: false,
            remaining: 0,
            reset_after: retry_ms * 2_000_000,
            retry_after: retry_ms * 1_000_000,
            delay: 0,
        }
    }

    #[test]
    fn a_rejection_is_answered_until_its_retry_moment_and_no_longer() {
        let cache = OverLimitCache::new();
        let t0 = Instant::now();
        cache.remember("k", LIMITS, 1, &rejected(100), t0);
        let v = cache.rejection("k", &LIMITS, 1, t0 + Duration::from_millis(40)).expect("still rejected");
        assert!(!v.allowed);
        assert_eq!(v.retry_after, 60_000_000);
        assert_eq!(v.reset_after, 160_000_000);
        assert!(cache.rejection("k", &LIMITS, 1, t0 + Duration::from_millis(100)).is_none());
        assert_eq!(cache.len(), 0, "an expired entry is dropped when met");
    }

    #[test]
    fn other_limits_or_a_cheaper_request_are_not_answered_from_the_cache() {
        let cache = OverLimitCache::new();
        let t0 = Instant::now();
        cache.remember("k", LIMITS, 3, &rejected(100), t0);
        let lifted = Limits { limit: 10, ..LIMITS };
        assert!(cache.rejection("k", &lifted, 3, t0).is_none());
        assert!(cache.rejection("k", &LIMITS, 2, t0).is_none());
        assert!(cache.rejection("k", &LIMITS, 4, t0).is_some());
        assert!(cache.rejection("other", &LIMITS, 3, t0).is_none());
    }

    #[test]
    fn sweep_drops_what_has_expired() {
        let cache = OverLimitCache::new();
        let t0 = Instant::now();
        cache.remember("a", LIMITS, 1, &rejected(10), t0);
        cache.remember("b", LIMITS, 1, &rejected(1_000), t0);
        assert_eq!(cache.sweep(t0 + Duration::from_millis(20)), 1);
        assert_eq!(cache.len(), 1);
    }
}
