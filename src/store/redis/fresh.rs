//! Fresh buckets written with a plain `SET NX`: no script call for the
//! common case of a key far below its limit.
//!
//! A token bucket whose key has expired is full, and a consume admitted on
//! it with no lease writes a state that follows from the rule and the cost
//! alone (`fresh_answer` in bucket.lua). Deciding that in a script costs a
//! Redis node some 5 µs per check of Lua around one `SET`; the same `SET`
//! sent as a plain command, `SET key <state> NX PX <ttl>`, costs it about a
//! microsecond, and `NX` keeps it exact: it writes only if there is no key,
//! which is the one case where the answer is known without reading. When
//! the key exists the `SET` writes nothing and the check goes to the script
//! as before (see `batch`), one round trip later.
//!
//! A plain write cannot stamp the state with the server's clock (`TIME` is
//! read only by scripts), so it stores the level and the TTL it was written
//! with instead (12 bytes: a little-endian double and a 32-bit count of
//! milliseconds), and bucket.lua recovers when it was written from the
//! key's absolute expiry (`PEXPIRETIME`): expiry minus TTL, plus the
//! millisecond the server's expiry clock may lag `TIME` by. That is never
//! earlier than the write, so the level drains from no earlier than it
//! should: at most a millisecond's refill is lost, never a unit gained.
//!
//! Which keys are worth a plain `SET` is a guess kept here: [`Recent`]
//! remembers, per key hash, until when the last answer said the key would
//! live. A wrong guess costs time, never exactness: a key thought gone that
//! exists costs the `SET` and then the script; one thought alive that is
//! gone is decided by the script, as every check was before.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use fred::bytes::Bytes;

use crate::limiter::Limits;

use super::scripts::fresh_bucket;

/// A plain write of a fresh bucket: the state, and its TTL.
#[derive(Debug, Clone)]
pub(super) struct Plain {
    /// The level (the cost, a little-endian double) and `ttl_ms` (a
    /// little-endian `u32`): what bucket.lua reads as a state written
    /// without a stamp.
    pub value: Bytes,
    pub ttl_ms: u32,
}

/// What a consume of `cost` admitted on a fresh token bucket with no lease
/// writes, as a plain `SET`: the state bucket.lua's fresh path would write,
/// with the TTL in place of the stamp. `None` when such a request is not
/// admitted on a full bucket (it costs more than the burst, or nothing),
/// or its TTL does not fit the state's 32 bits (a window of weeks): those
/// go to the script.
pub(super) fn plain(limits: &Limits, cost: u64) -> Option<Plain> {
    let bounded = limits.bounded();
    let capacity = bounded.burst as f64;
    let tol = crate::limiter::slack(capacity);
    let level = cost as f64;
    if !(level > tol && level <= capacity + tol) {
        return None;
    }
    // The same drain as the script's, in whole milliseconds rounded up,
    // plus one: the key outlives the moment the bucket is full again.
    let drain_ns = fresh_bucket(limits, cost).reset_after;
    let ttl_ms = u32::try_from(drain_ns.div_ceil(1_000_000).checked_add(1)?).ok()?;
    let mut value = Vec::with_capacity(STATE_LEN);
    value.extend_from_slice(&level.to_le_bytes());
    value.extend_from_slice(&ttl_ms.to_le_bytes());
    Some(Plain { value: value.into(), ttl_ms })
}

/// The length of a state written by a plain `SET` (bucket.lua tells it from
/// the stamped states, 16, 32 or 48 bytes, by this length).
pub(super) const STATE_LEN: usize = 12;

/// Slots of the guess table: 4 bytes each, 512 KiB in all. Keys that share
/// a slot share a guess; with more live keys than slots, some keys thought
/// alive are gone, which only sends their checks to the script.
const SLOTS: usize = 1 << 17;

/// Until when each key, by hash, was last said to live: milliseconds since
/// `epoch`, wrapping (compared as a signed difference, so a guess stays
/// meaningful for 24 days; an older one may read as alive, which only sends
/// a check to the script).
pub(super) struct Recent {
    slots: Box<[AtomicU32]>,
    epoch: Instant,
    hasher: foldhash::fast::RandomState,
}

impl Recent {
    pub(super) fn new(epoch: Instant) -> Recent {
        Recent {
            slots: (0..SLOTS).map(|_| AtomicU32::new(0)).collect(),
            epoch,
            hasher: foldhash::fast::RandomState::default(),
        }
    }

    fn slot(&self, key: &str) -> &AtomicU32 {
        // SLOTS is a power of two: the mask keeps the index in bounds.
        &self.slots[(self.hasher.hash_one(key) as usize) & (SLOTS - 1)]
    }

    fn millis(&self, at: Instant) -> u32 {
        // Wraps after 49 days, as the slots' values do.
        at.saturating_duration_since(self.epoch).as_millis() as u32
    }

    /// Whether `key` is probably gone from Redis at `now`: no answer said
    /// it would live past now.
    pub(super) fn gone(&self, key: &str, now: Instant) -> bool {
        let until = self.slot(key).load(Ordering::Relaxed);
        (until.wrapping_sub(self.millis(now)) as i32) <= 0
    }

    /// An answer said `key` lives `left` from `now` (its bucket full again
    /// and its escrow ended), rounded up to the next millisecond.
    pub(super) fn lives(&self, key: &str, now: Instant, left: Duration) {
        let until = self.millis(now + left).wrapping_add(1);
        self.slot(key).store(until, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Algorithm;

    fn limits(limit: u64, burst: u64) -> Limits {
        Limits { algorithm: Algorithm::TokenBucket, limit, window: 1_000_000_000, burst, origin: 0 }
    }

    #[test]
    fn a_plain_write_holds_the_cost_and_the_scripts_ttl() {
        // 100 a second: a unit drains in 10 ms, and the key lives a
        // millisecond more, as bucket.lua's `fresh_answer` writes it.
        let p = plain(&limits(100, 100), 1).expect("admitted on a full bucket");
        assert_eq!(p.ttl_ms, 11);
        assert_eq!(p.value.len(), STATE_LEN);
        assert_eq!(f64::from_le_bytes(p.value[..8].try_into().unwrap()), 1.0);
        assert_eq!(u32::from_le_bytes(p.value[8..].try_into().unwrap()), 11);
        // 3 a second: a unit drains in 333.33.. ms, rounded up.
        assert_eq!(plain(&limits(3, 10), 2).map(|p| p.ttl_ms), Some(668));
    }

    #[test]
    fn what_a_full_bucket_would_not_admit_is_never_written_plain() {
        assert!(plain(&limits(100, 5), 6).is_none());
        assert!(plain(&limits(100, 5), 0).is_none());
        assert!(plain(&limits(100, 5), 5).is_some());
        // A unit a week drains in more milliseconds than 32 bits hold.
        let slow = Limits { window: 7 * 86_400 * 1_000_000_000 * 10, ..limits(1, 1) };
        assert!(plain(&slow, 1).is_none());
    }

    #[test]
    fn a_key_is_gone_once_its_last_answer_says_so() {
        let epoch = Instant::now();
        let recent = Recent::new(epoch);
        let at = epoch + Duration::from_secs(5);
        assert!(recent.gone("k", at), "never seen");
        recent.lives("k", at, Duration::from_millis(10));
        assert!(!recent.gone("k", at));
        assert!(!recent.gone("k", at + Duration::from_millis(10)));
        assert!(recent.gone("k", at + Duration::from_millis(12)));
        // Past the wrap of the millisecond counter (49.7 days) it still
        // compares right.
        let late = epoch + Duration::from_millis(u64::from(u32::MAX) + 5_000);
        recent.lives("k", late, Duration::from_millis(10));
        assert!(!recent.gone("k", late + Duration::from_millis(5)));
        assert!(recent.gone("k", late + Duration::from_millis(20)));
    }
}
