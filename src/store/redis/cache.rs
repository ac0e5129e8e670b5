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
//!
//! When the retry moment comes, one request (the probe) asks Redis and the
//! others keep being answered from the entry until its reply: otherwise
//! every client connection of a flood would reach Redis at once each time a
//! token came back, only for all but one to be rejected. The price is that
//! requests arriving during the probe's round trip are rejected even when
//! Redis could have admitted more than one of them; the probe's admission
//! clears the entry, its rejection renews it, and a probe that never
//! reports stops counting after the store timeout.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::scripts::nanos;
use crate::limiter::shards::Shards;
use crate::limiter::{Boxed, Limits, Verdict};

const SHARDS: usize = 16;
/// Entries kept per shard at most: a bound on memory under a flood of
/// distinct rejected keys (160k entries of roughly 100 bytes). Past it,
/// new rejections are simply not cached.
const MAX_PER_SHARD: usize = 10_000;
/// How long a refusal by the penalty box is answered here before Redis is
/// asked again: a block lifted through another instance reaches this one
/// within it, while a boxed client's flood still costs Redis one call a
/// second. Clients are told the time left in the box all along.
const BOX_RECHECK: Duration = Duration::from_secs(1);

/// Rejected keys and when Redis said to come back.
pub(super) struct OverLimitCache {
    shards: Shards<HashMap<String, Entry>>,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// When to ask Redis again.
    retry_at: Instant,
    /// When Redis said the key may come back: `retry_at`, or for a key in
    /// the penalty box the end of its time there.
    told_at: Instant,
    reset_at: Instant,
    limits: Limits,
    cost: u64,
    /// A probe is asking Redis until then.
    probing_until: Option<Instant>,
}

/// What the cache says about one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lookup {
    /// Rejected: Redis's answer is still promised, or another request is
    /// asking it again.
    Rejected(Verdict),
    /// The retry moment has come and this request is the one to ask Redis;
    /// report its outcome with [`OverLimitCache::forget`] if admitted (a
    /// rejection is remembered anew).
    Probe,
    /// Nothing known: ask Redis.
    Unknown,
}

impl OverLimitCache {
    pub fn new() -> OverLimitCache {
        OverLimitCache { shards: Shards::new(SHARDS, HashMap::new) }
    }

    /// Remembers that Redis rejected `key` with `verdict` at `now`.
    pub fn remember(&self, key: &str, limits: Limits, cost: u64, verdict: &Verdict, now: Instant) {
        let told_at = now + Duration::from_nanos(verdict.retry_after);
        let retry_at = if verdict.boxed == Boxed::No { told_at } else { told_at.min(now + BOX_RECHECK) };
        let entry = Entry {
            retry_at,
            told_at,
            reset_at: now + Duration::from_nanos(verdict.reset_after),
            limits,
            cost,
            probing_until: None,
        };
        let mut shard = self.shards.lock_key(key);
        if shard.len() >= MAX_PER_SHARD && !shard.contains_key(key) {
            shard.retain(|_, e| e.retry_at > now);
            if shard.len() >= MAX_PER_SHARD {
                return;
            }
        }
        shard.insert(key.to_string(), entry);
    }

    /// Remembers that Redis admitted a request for `key` with nothing left
    /// for another of the same cost: the next request is a probe, and the
    /// ones behind it wait for its answer instead of all asking Redis.
    pub fn exhausted(&self, key: &str, limits: Limits, cost: u64, verdict: &Verdict, now: Instant) {
        let rejection = Verdict { allowed: false, remaining: 0, retry_after: 0, ..*verdict };
        self.remember(key, limits, cost, &rejection, now);
    }

    /// What to do about `key` now (see [`Lookup`]). `probe_for` bounds how
    /// long a probe may take to report.
    pub fn lookup(&self, key: &str, limits: &Limits, cost: u64, now: Instant, probe_for: Duration) -> Lookup {
        let mut shard = self.shards.lock_key(key);
        let Some(entry) = shard.get_mut(key) else { return Lookup::Unknown };
        if entry.limits != *limits || cost < entry.cost {
            return Lookup::Unknown;
        }
        if entry.retry_at > now {
            return Lookup::Rejected(Verdict {
                allowed: false,
                remaining: 0,
                reset_after: nanos(entry.reset_at.saturating_duration_since(now)),
                retry_after: nanos(entry.told_at - now).max(1),
                delay: 0,
                fallback: false,
                boxed: Boxed::No,
            });
        }
        match entry.probing_until {
            Some(until) if until > now => Lookup::Rejected(Verdict {
                allowed: false,
                remaining: 0,
                reset_after: nanos(entry.reset_at.saturating_duration_since(now)),
                // Try again right away: the probe's answer is on its way
                // (unless the key was in the penalty box for longer).
                retry_after: nanos(entry.told_at.saturating_duration_since(now)).max(1),
                delay: 0,
                fallback: false,
                boxed: Boxed::No,
            }),
            _ => {
                entry.probing_until = Some(now + probe_for);
                Lookup::Probe
            }
        }
    }

    /// The probe for `key` was admitted, or not sent after all: the entry
    /// no longer holds.
    pub fn forget(&self, key: &str) {
        self.shards.lock_key(key).remove(key);
    }

    /// Drops every entry whose moment has passed. Returns how many.
    pub fn sweep(&self, now: Instant) -> usize {
        let mut dropped = 0;
        for mut s in self.shards.each() {
            let before = s.len();
            s.retain(|_, e| e.retry_at > now || e.probing_until.is_some_and(|t| t > now));
            dropped += before - s.len();
        }
        dropped
    }

    /// Entries held now, expired or not.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.shards.sum(HashMap::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::{Algorithm, NANOS_PER_SEC};

    const LIMITS: Limits =
        Limits { algorithm: Algorithm::FixedWindow, limit: 5, window: NANOS_PER_SEC, burst: 5, origin: 0 };

    fn rejected(retry_ms: u64) -> Verdict {
        Verdict {
            allowed: false,
            remaining: 0,
            reset_after: retry_ms * 2_000_000,
            retry_after: retry_ms * 1_000_000,
            delay: 0,
            fallback: false,
            boxed: Boxed::No,
        }
    }

    const PROBE: Duration = Duration::from_millis(20);

    fn lookup(cache: &OverLimitCache, key: &str, limits: &Limits, cost: u64, at: Instant) -> Lookup {
        cache.lookup(key, limits, cost, at, PROBE)
    }

    #[test]
    fn a_rejection_is_answered_until_its_retry_moment_then_one_request_probes() {
        let cache = OverLimitCache::new();
        let t0 = Instant::now();
        cache.remember("k", LIMITS, 1, &rejected(100), t0);
        let Lookup::Rejected(v) = lookup(&cache, "k", &LIMITS, 1, t0 + Duration::from_millis(40)) else {
            panic!("still rejected")
        };
        assert!(!v.allowed);
        assert_eq!(v.retry_after, 60_000_000);
        assert_eq!(v.reset_after, 160_000_000);
        let t1 = t0 + Duration::from_millis(100);
        assert_eq!(lookup(&cache, "k", &LIMITS, 1, t1), Lookup::Probe, "the first request after the moment asks");
        let Lookup::Rejected(v) = lookup(&cache, "k", &LIMITS, 1, t1) else { panic!("the others wait for it") };
        assert_eq!(v.retry_after, 1);
        // A probe that never reports stops holding the others back.
        assert_eq!(lookup(&cache, "k", &LIMITS, 1, t1 + PROBE), Lookup::Probe);
        // Its admission clears the entry; a rejection would have renewed it.
        cache.forget("k");
        assert_eq!(lookup(&cache, "k", &LIMITS, 1, t1 + PROBE), Lookup::Unknown);
        // Admitted with nothing left: the next request probes, the rest wait.
        let last = Verdict {
            allowed: true,
            remaining: 0,
            reset_after: 1_000_000,
            retry_after: 0,
            delay: 0,
            fallback: false,
            boxed: Boxed::No,
        };
        cache.exhausted("k", LIMITS, 1, &last, t1);
        assert_eq!(lookup(&cache, "k", &LIMITS, 1, t1), Lookup::Probe);
        assert!(matches!(lookup(&cache, "k", &LIMITS, 1, t1), Lookup::Rejected(_)));
        cache.forget("k");
        assert_eq!(lookup(&cache, "k", &LIMITS, 1, t1 + PROBE), Lookup::Unknown);
        assert_eq!(cache.len(), 0);
    }

    #[test]
    fn other_limits_or_a_cheaper_request_are_not_answered_from_the_cache() {
        let cache = OverLimitCache::new();
        let t0 = Instant::now();
        cache.remember("k", LIMITS, 3, &rejected(100), t0);
        let lifted = Limits { limit: 10, ..LIMITS };
        assert_eq!(lookup(&cache, "k", &lifted, 3, t0), Lookup::Unknown);
        assert_eq!(lookup(&cache, "k", &LIMITS, 2, t0), Lookup::Unknown);
        assert!(matches!(lookup(&cache, "k", &LIMITS, 4, t0), Lookup::Rejected(_)));
        assert_eq!(lookup(&cache, "other", &LIMITS, 3, t0), Lookup::Unknown);
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
