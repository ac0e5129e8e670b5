//! Leased quota: units a script took from a key ahead of need, for this
//! instance to spend without a round trip.
//!
//! A busy key costs one script call per request otherwise, and every call is
//! work for a Redis that all instances share. With a lease, the call that
//! admits a request also takes up to `lease_percent` of the key's capacity
//! for this instance; the requests that follow spend it here, and Redis
//! hears from this instance again when the lease runs out.
//!
//! What it keeps and what it gives up:
//!
//! - **Never more than the limit.** Leased units are counted in Redis when
//!   they are taken, and spent only while that count still stands: a window
//!   lease ends with the window it was counted in (a fixed window's count,
//!   or a sliding counter's current window, which only weighs less as it
//!   slides out). A token bucket's level falls as it refills, and the units
//!   of a lease sit on top of the level they were granted on: a lease holds
//!   at most what is left of that level by now (`level_left`), so its units
//!   expire as they would have refilled, and only those still counted are
//!   given back (a give-back of units already refilled would hand the
//!   bucket tokens it never lost). The estimate starts when the call was
//!   sent and uses the rule's own rate, both of which only make it lower.
//! - **Exact near the limit.** A script grants a lease only when at least as
//!   much again stays in Redis (`lease` in prelude.lua), so the last units of
//!   a key are decided one request at a time, and a key whose capacity is
//!   under 200 (at the default 1%) is never leased at all. What an instance
//!   can hold back from the others is one lease per key, and only for keys
//!   it is using: a lease left idle for `lease_idle` is given back (a refund
//!   script call), and so is every lease on shutdown.
//! - **From the first request, given back only if used.** A client's
//!   first request already takes a lease, so its next ones (a page and its
//!   assets, a retry loop) are answered here. A lease never spent before it
//!   goes idle is not given back: a scan of one-off clients then costs one
//!   call per client, as without leases, and what each leaves counted is a
//!   lease of a key nobody else is using, which refills (token bucket) or
//!   ends with its window. One lease request per key is in flight at a time.
//! - **Not for every algorithm.** The leaky bucket decides each request's
//!   delay from the queue ahead of it, and the sliding log stamps each entry
//!   with its own time (an entry stamped early would leave the window
//!   early), so both ask Redis for every request.
//!
//! Headers served from a lease show what Redis had left at the grant plus
//! the units still held here: an estimate, since other instances spend too.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::nanos;
use super::scripts::Reply;
use crate::limiter::{Algorithm, Limits, Verdict};

const SHARDS: usize = 64;
/// Keys tracked per shard at most: 128k in all, at roughly 220 bytes each
/// (the key, the lease, the table's slack), so under 30 MB. Past it, new
/// keys are simply not leased until idle ones are dropped.
const MAX_PER_SHARD: usize = 2_000;

/// The leases this instance holds.
pub(super) struct Leases {
    shards: Box<[Mutex<HashMap<String, Lease>>]>,
    hasher: foldhash::quality::RandomState,
    percent: u64,
    idle: Duration,
    /// Set by [`drain`](Leases::drain): no new leases, and grants that
    /// arrive later are given straight back.
    closing: AtomicBool,
}

#[derive(Debug, Clone, Copy)]
struct Lease {
    limits: Limits,
    /// Units held here, counted in Redis and not spent yet.
    units: u64,
    /// The window they were counted in (what a refund quotes).
    token: i64,
    /// When they stop being valid (the end of their window), if ever.
    expires_at: Option<Instant>,
    /// A token bucket's: when the level the lease was granted on (its own
    /// units included) will have drained away, at the latest.
    drained_at: Option<Instant>,
    last_used: Instant,
    /// What Redis had left after the grant, and when the key would be full
    /// again: for the headers of requests served here.
    remaining: u64,
    reset_at: Instant,
    /// A lease request for this key is in flight until then.
    asking_until: Option<Instant>,
    /// Whether a request spent some of it since it was granted.
    used: bool,
}

impl Lease {
    /// The units held that Redis still counts at `now`: a token bucket's
    /// are capped by what is left of the level they were granted on
    /// ([`level_left`]); a window's stand until the window ends.
    fn owed(&self, now: Instant) -> u64 {
        match self.drained_at {
            Some(drained_at) => self.units.min(level_left(&self.limits, drained_at, now)),
            None => self.units,
        }
    }
}

/// For a token bucket, when the level a grant left (its units included)
/// will have drained, at the latest: `reset_after` counted from when the
/// call was sent, less the nanosecond its rounding up may have added.
fn bucket_drained_at(limits: &Limits, reply: &Reply, sent: Instant) -> Option<Instant> {
    (limits.algorithm == Algorithm::TokenBucket).then(|| {
        let at = sent + Duration::from_nanos(reply.verdict.reset_after);
        at.checked_sub(Duration::from_nanos(1)).unwrap_or(sent)
    })
}

/// Whole units left at `now` of a token bucket's level that will have
/// drained at `drained_at`, at `limits`' rate.
fn level_left(limits: &Limits, drained_at: Instant, now: Instant) -> u64 {
    let left = drained_at.saturating_duration_since(now).as_nanos();
    let units = left * u128::from(limits.limit) / u128::from(limits.window.max(1));
    u64::try_from(units).unwrap_or(u64::MAX)
}

/// Units to give back to Redis: a lease nobody here uses any more.
#[derive(Debug)]
pub(super) struct Unused {
    pub key: String,
    pub limits: Limits,
    pub units: u64,
    pub token: i64,
    /// A token bucket's: when the level holding them will have drained.
    pub drained_at: Option<Instant>,
}

impl Unused {
    /// The units Redis still counts at `now` (see [`Lease::owed`]): what a
    /// give-back delayed by an outage may still return.
    pub fn owed(&self, now: Instant) -> u64 {
        match self.drained_at {
            Some(drained_at) => self.units.min(level_left(&self.limits, drained_at, now)),
            None => self.units,
        }
    }
}

impl Leases {
    pub fn new(percent: u8, idle: Duration) -> Leases {
        Leases {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: foldhash::quality::RandomState::default(),
            percent: u64::from(percent),
            idle,
            closing: AtomicBool::new(false),
        }
    }

    pub fn enabled(&self) -> bool {
        self.percent > 0
    }

    fn shard(&self, key: &str) -> MutexGuard<'_, HashMap<String, Lease>> {
        let i = self.hasher.hash_one(key) as usize % SHARDS;
        // Entries are `Copy` values replaced whole, so a panic while the
        // lock was held cannot have left one half-written.
        self.shards[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The lease size for `limits`, or 0 where leasing does not apply.
    fn size(&self, limits: &Limits) -> u64 {
        let leases = matches!(
            limits.algorithm,
            Algorithm::TokenBucket | Algorithm::FixedWindow | Algorithm::SlidingWindowCounter
        );
        if !leases {
            return 0;
        }
        let size = limits.capacity().saturating_mul(self.percent) / 100;
        if size < 2 { 0 } else { size }
    }

    /// Spends `cost` units of a valid lease on `key`, if one holds enough.
    pub fn take(&self, key: &str, limits: &Limits, cost: u64, now: Instant) -> Option<Verdict> {
        let mut shard = self.shard(key);
        let lease = shard.get_mut(key)?;
        lease.units = lease.owed(now);
        if lease.limits != *limits || lease.units < cost.max(1) || lease.expires_at.is_some_and(|t| t <= now) {
            return None;
        }
        lease.units -= cost;
        lease.last_used = now;
        lease.used = true;
        Some(Verdict {
            allowed: true,
            remaining: lease.remaining.saturating_add(lease.units),
            reset_after: nanos(lease.reset_at.saturating_duration_since(now)),
            retry_after: 0,
            delay: 0,
        })
    }

    /// Undoes a [`take`](Self::take): the request was rejected by another
    /// rule and counts nowhere.
    pub fn give_back(&self, key: &str, limits: &Limits, cost: u64) {
        if let Some(lease) = self.shard(key).get_mut(key)
            && lease.limits == *limits
        {
            lease.units += cost;
        }
    }

    /// How many units to ask for ahead with the call deciding `key` now: 0
    /// while another lease request for it is in flight, where leasing does
    /// not apply, or when too many keys are tracked already. Otherwise the
    /// caller must report the call's outcome to [`granted`](Self::granted)
    /// or [`failed`](Self::failed).
    pub fn want(&self, key: &str, limits: &Limits, cost: u64, now: Instant, timeout: Duration) -> u64 {
        let size = self.size(limits);
        if size < cost.max(1) || self.closing.load(Ordering::Relaxed) {
            return 0;
        }
        let mut shard = self.shard(key);
        if let Some(lease) = shard.get_mut(key) {
            if lease.asking_until.is_some_and(|t| t > now) {
                return 0;
            }
            lease.asking_until = Some(now + timeout);
            lease.last_used = now;
            return size;
        }
        if shard.len() >= MAX_PER_SHARD {
            return 0;
        }
        shard.insert(
            key.to_string(),
            Lease {
                limits: *limits,
                units: 0,
                token: 0,
                expires_at: None,
                drained_at: None,
                last_used: now,
                remaining: 0,
                reset_at: now,
                asking_until: Some(now + timeout),
                used: false,
            },
        );
        size
    }

    /// Records what a call that asked for a lease was granted. `sent` is
    /// when the call left: validity is counted from there, so it can only
    /// end early. Returns the units of a lease it replaces, which are to be
    /// given back (they were counted under other limits or another window).
    pub fn granted(&self, key: &str, limits: &Limits, reply: &Reply, sent: Instant, now: Instant) -> Option<Unused> {
        if self.closing.load(Ordering::Relaxed) && reply.granted > 0 {
            // Granted after the drain: nobody here will spend it.
            let drained_at = bucket_drained_at(limits, reply, sent);
            let units = reply.granted;
            return Some(Unused { key: key.to_string(), limits: *limits, units, token: reply.token, drained_at });
        }
        let mut shard = self.shard(key);
        let lease = shard.get_mut(key)?;
        lease.asking_until = None;
        if reply.granted == 0 {
            return None;
        }
        let mut expires_at = (reply.lease_ttl > 0).then(|| sent + Duration::from_nanos(reply.lease_ttl));
        // Counted under the same limits in the same window (or bucket): the
        // units add up, valid until the earlier of the two estimates of the
        // window's end.
        let same = lease.limits == *limits && lease.token == reply.token;
        if same && let (Some(a), Some(b)) = (lease.expires_at, expires_at) {
            expires_at = Some(a.min(b));
        }
        // The units still held were in the level this grant was made on,
        // so the new level covers them as well as the new units.
        let held = lease.owed(now);
        let replaced = if same || held == 0 {
            None
        } else {
            Some(Unused {
                key: key.to_string(),
                limits: lease.limits,
                units: held,
                token: lease.token,
                drained_at: lease.drained_at,
            })
        };
        let units = if same { held + reply.granted } else { reply.granted };
        let drained_at = bucket_drained_at(limits, reply, sent);
        let used = same && lease.used;
        *lease = Lease {
            limits: *limits,
            units,
            token: reply.token,
            expires_at,
            drained_at,
            last_used: now,
            remaining: reply.verdict.remaining,
            reset_at: sent + Duration::from_nanos(reply.verdict.reset_after),
            asking_until: None,
            used,
        };
        replaced
    }

    /// The call that asked for a lease on `key` failed: let the next one ask.
    pub fn failed(&self, key: &str) {
        if let Some(lease) = self.shard(key).get_mut(key) {
            lease.asking_until = None;
        }
    }

    /// Forgets keys idle for `lease_idle` and leases whose window has ended,
    /// and returns the units among them that Redis should get back: those of
    /// leases that were used (see the module notes).
    pub fn expire(&self, now: Instant) -> Vec<Unused> {
        self.remove_where(now, |lease| {
            let gone = now.saturating_duration_since(lease.last_used) >= self.idle
                || lease.expires_at.is_some_and(|t| t <= now);
            (gone, lease.used)
        })
    }

    /// Every lease held, for giving back on shutdown; no lease is granted
    /// after it.
    pub fn drain(&self, now: Instant) -> Vec<Unused> {
        self.closing.store(true, Ordering::Relaxed);
        self.remove_where(now, |_| (true, true))
    }

    /// Removes the leases `gone` says (first) are gone, returning the units
    /// of those it says (second) to give back.
    fn remove_where(&self, now: Instant, mut gone: impl FnMut(&Lease) -> (bool, bool)) -> Vec<Unused> {
        let mut unused = Vec::new();
        for shard in self.shards.iter() {
            let mut shard = shard.lock().unwrap_or_else(|p| p.into_inner());
            shard.retain(|key, lease| {
                let (gone, give_back) = gone(lease);
                if !gone {
                    return true;
                }
                // A fixed window's count ends with its window, so units of an
                // ended window need no refund; a sliding counter's still
                // weigh on the next window, and a bucket's on its level.
                let ended =
                    lease.limits.algorithm == Algorithm::FixedWindow && lease.expires_at.is_some_and(|t| t <= now);
                let units = lease.owed(now);
                if give_back && units > 0 && !ended {
                    unused.push(Unused {
                        key: key.clone(),
                        limits: lease.limits,
                        units,
                        token: lease.token,
                        drained_at: lease.drained_at,
                    });
                }
                false
            });
        }
        unused
    }

    /// Keys tracked now.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::NANOS_PER_SEC;

    const BUCKET: Limits =
        Limits { algorithm: Algorithm::TokenBucket, limit: 1_000, window: NANOS_PER_SEC, burst: 1_000 };
    const TIMEOUT: Duration = Duration::from_millis(20);

    fn reply(granted: u64, remaining: u64, token: i64, lease_ttl: u64) -> Reply {
        Reply {
            verdict: Verdict { allowed: true, remaining, reset_after: 500_000_000, retry_after: 0, delay: 0 },
            token,
            granted,
            lease_ttl,
        }
    }

    #[test]
    fn a_key_is_leased_from_its_first_call_and_then_spent_locally() {
        let leases = Leases::new(1, Duration::from_secs(5));
        let t0 = Instant::now();
        assert!(leases.take("k", &BUCKET, 1, t0).is_none());
        assert_eq!(leases.want("k", &BUCKET, 1, t0, TIMEOUT), 10, "1% of 1,000");
        assert_eq!(leases.want("k", &BUCKET, 1, t0, TIMEOUT), 0, "one lease request in flight per key");
        assert!(leases.granted("k", &BUCKET, &reply(10, 980, 0, 0), t0, t0).is_none());
        for left in (0..10).rev() {
            let v = leases.take("k", &BUCKET, 1, t0).expect("served from the lease");
            assert!(v.allowed);
            assert_eq!(v.remaining, 980 + left);
        }
        assert!(leases.take("k", &BUCKET, 1, t0).is_none(), "spent: back to Redis");
        assert_eq!(leases.want("k", &BUCKET, 1, t0, TIMEOUT), 10);
    }

    #[test]
    fn small_keys_and_per_request_algorithms_are_never_leased() {
        let leases = Leases::new(1, Duration::from_secs(5));
        let t0 = Instant::now();
        let small = Limits { limit: 150, burst: 150, ..BUCKET };
        let log = Limits { algorithm: Algorithm::SlidingWindowLog, ..BUCKET };
        let leaky = Limits { algorithm: Algorithm::LeakyBucket, ..BUCKET };
        for limits in [small, log, leaky] {
            assert_eq!(leases.want("k", &limits, 1, t0, TIMEOUT), 0, "{limits:?}");
        }
        assert_eq!(leases.len(), 0);
        assert_eq!(leases.want("k", &BUCKET, 11, t0, TIMEOUT), 0, "a request costing more than a lease");
        assert_eq!(Leases::new(0, Duration::from_secs(5)).want("k", &BUCKET, 1, t0, TIMEOUT), 0);
    }

    #[test]
    fn a_lease_serves_only_its_limits_and_its_window() {
        let leases = Leases::new(1, Duration::from_secs(5));
        let t0 = Instant::now();
        let window = Limits { algorithm: Algorithm::FixedWindow, ..BUCKET };
        assert_eq!(leases.want("k", &window, 1, t0, TIMEOUT), 10);
        leases.granted("k", &window, &reply(10, 980, 7, 100_000_000), t0, t0);
        assert!(leases.take("k", &Limits { limit: 2_000, ..window }, 1, t0).is_none(), "limits lifted");
        assert!(leases.take("k", &window, 1, t0 + Duration::from_millis(99)).is_some());
        assert!(leases.take("k", &window, 1, t0 + Duration::from_millis(100)).is_none(), "the window ended");
        // The window's count ended with it: nothing to give back.
        assert!(leases.expire(t0 + Duration::from_millis(100)).is_empty());
        assert_eq!(leases.len(), 0);
    }

    #[test]
    fn idle_leases_that_were_used_are_returned_and_taken_units_can_be_given_back() {
        let leases = Leases::new(1, Duration::from_secs(5));
        let t0 = Instant::now();
        // A level that takes 10 s to drain: the units are still counted.
        let mut slow = reply(10, 980, 0, 0);
        slow.verdict.reset_after = 10 * NANOS_PER_SEC;
        for key in ["k", "one-off"] {
            assert_eq!(leases.want(key, &BUCKET, 1, t0, TIMEOUT), 10);
            leases.granted(key, &BUCKET, &slow, t0, t0);
        }
        leases.take("k", &BUCKET, 3, t0).expect("served");
        leases.give_back("k", &BUCKET, 3);
        assert!(leases.expire(t0 + Duration::from_secs(4)).is_empty(), "not idle yet");
        // The one-off key's lease was never spent: not worth a call.
        let back = leases.expire(t0 + Duration::from_secs(5));
        assert_eq!(back.len(), 1);
        assert_eq!((back[0].key.as_str(), back[0].units), ("k", 10));
        assert_eq!(leases.len(), 0);
    }

    #[test]
    fn a_failed_lease_request_lets_the_next_call_ask_and_replaced_leases_are_returned() {
        let leases = Leases::new(1, Duration::from_secs(5));
        let t0 = Instant::now();
        assert_eq!(leases.want("k", &BUCKET, 1, t0, TIMEOUT), 10);
        assert_eq!(leases.want("k", &BUCKET, 1, t0, TIMEOUT), 0, "in flight");
        leases.failed("k");
        assert_eq!(leases.want("k", &BUCKET, 1, t0, TIMEOUT), 10);
        leases.granted("k", &BUCKET, &reply(10, 980, 0, 0), t0, t0);
        // An in-flight request that never reports stops blocking after the timeout.
        assert_eq!(leases.want("k", &BUCKET, 1, t0, TIMEOUT), 10);
        assert_eq!(leases.want("k", &BUCKET, 1, t0, TIMEOUT), 0);
        assert_eq!(leases.want("k", &BUCKET, 1, t0 + TIMEOUT, TIMEOUT), 10);
        // A reload changed the limits: the old units go back.
        let lifted = Limits { limit: 2_000, burst: 2_000, ..BUCKET };
        let old = leases.granted("k", &lifted, &reply(20, 1_900, 0, 0), t0, t0).expect("old lease returned");
        assert_eq!((old.units, old.limits), (10, BUCKET));
        assert_eq!(leases.drain(t0).len(), 1);
    }

    #[test]
    fn a_bucket_lease_holds_only_the_units_not_refilled_yet_and_gives_back_only_those() {
        let leases = Leases::new(1, Duration::from_secs(5));
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        // 1,000 per second. The grant left a level of 15 (the request, 4
        // taken before, and the lease of 10): it drains in 15 ms, the
        // lease's units last.
        let mut r = reply(10, 985, 0, 0);
        r.verdict.reset_after = 15_000_000;
        assert_eq!(leases.want("k", &BUCKET, 1, t0, TIMEOUT), 10);
        leases.granted("k", &BUCKET, &r, t0, t0);
        assert!(leases.take("k", &BUCKET, 1, t0 + ms(2)).is_some(), "13 of the level left: 9 units held");
        // At 8 ms just under 7 units of the level are left (the estimate
        // rounds down): the lease holds 6, not 9, and 5 after this request.
        assert_eq!(leases.take("k", &BUCKET, 1, t0 + ms(8)).map(|v| v.remaining), Some(985 + 5));
        // Just under 3 left at 12 ms: only 2 are owed back to Redis.
        let back = leases.drain(t0 + ms(12));
        assert_eq!(back.iter().map(|u| u.units).collect::<Vec<_>>(), vec![2]);

        // Once the level has drained, the lease is spent and owes nothing.
        leases.want("k", &BUCKET, 1, t0, TIMEOUT);
        leases.granted("k", &BUCKET, &r, t0, t0);
        assert!(leases.take("k", &BUCKET, 1, t0 + ms(15)).is_none());
        assert!(leases.drain(t0 + ms(15)).is_empty());
    }

    #[test]
    fn after_the_drain_no_lease_is_asked_for_and_a_late_grant_is_handed_back() {
        let leases = Leases::new(1, Duration::from_secs(5));
        let t0 = Instant::now();
        assert_eq!(leases.want("k", &BUCKET, 1, t0, TIMEOUT), 10);
        assert!(leases.drain(t0).is_empty());
        // The call in flight during the drain comes back with its grant.
        let late = leases.granted("k", &BUCKET, &reply(10, 980, 0, 0), t0, t0).expect("handed back");
        assert_eq!((late.key.as_str(), late.units, late.owed(t0)), ("k", 10, 10));
        assert!(leases.take("k", &BUCKET, 1, t0).is_none());
        assert_eq!(leases.want("k", &BUCKET, 1, t0, TIMEOUT), 0, "closing: no new lease");
    }
}
