//! The leases this instance holds, one entry per key it uses: taken from
//! by requests, granted and renewed by script calls, given back, swept.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::ahead::{self, Ahead};
use super::entry::{Lease, Unused};
use super::size::Sizing;
use crate::limiter::shards::Shards;
use crate::limiter::{Algorithm, Boxed, Limits, Verdict};
use crate::store::redis::scripts::{LeaseArgs, Reply, Settle, nanos};

const SHARDS: usize = 64;
/// Keys tracked per shard at most: 128k in all, at roughly 220 bytes each
/// (the key, the lease, the table's slack), so under 30 MB. Past it, new
/// keys are simply not leased until idle ones are dropped.
const MAX_PER_SHARD: usize = 2_000;

/// The leases this instance holds.
pub struct Leases {
    shards: Shards<HashMap<String, Lease>>,
    sizing: Sizing,
    idle: Duration,
    /// Set by [`drain`](Leases::drain): no new leases, and grants that
    /// arrive later are given straight back.
    closing: AtomicBool,
}

/// What [`Leases::take`] spent, and the renewal it made due.
pub struct Taken {
    pub verdict: Verdict,
    pub ahead: Option<Ahead>,
    /// The lease spent from (its window, or a bucket's escrow slot): a
    /// [`give_back`](Leases::give_back) returns the units to it only.
    pub token: i64,
}

/// What a sweep does with a key's entry.
enum Fate {
    Keep,
    /// Its lease is over; the key stays tracked.
    End {
        give_back: bool,
    },
    /// The key is forgotten.
    Forget {
        give_back: bool,
    },
}

impl Leases {
    pub fn new(percent: u8, idle: Duration, lifetime: Duration) -> Leases {
        Leases {
            shards: Shards::new(SHARDS, HashMap::new),
            sizing: Sizing::new(percent, lifetime),
            idle,
            closing: AtomicBool::new(false),
        }
    }

    pub fn enabled(&self) -> bool {
        self.sizing.enabled()
    }

    /// Spends `cost` units of a valid lease on `key`, if one holds enough;
    /// with them, the renewal ahead to send when that leaves the lease low
    /// (see [`Ahead`]). The caller reports the renewal's outcome to
    /// [`renewed`](Self::renewed) or [`renew_failed`](Self::renew_failed).
    pub fn take(&self, key: &str, limits: &Limits, cost: u64, now: Instant, timeout: Duration) -> Option<Taken> {
        let mut shard = self.shards.lock_key(key);
        let lease = shard.get_mut(key)?;
        self.sizing.roll(lease, now);
        lease.seen = lease.seen.saturating_add(cost);
        if lease.limits != *limits || lease.units < cost.max(1) || lease.expired(now) {
            return None;
        }
        lease.units -= cost;
        lease.last_used = now;
        lease.used = true;
        let verdict = Verdict {
            allowed: true,
            remaining: lease.remaining.saturating_add(lease.units),
            reset_after: nanos(lease.reset_at.saturating_duration_since(now)),
            retry_after: 0,
            delay: 0,
            fallback: false,
            boxed: Boxed::No,
        };
        let token = lease.token;
        // No renewal after the drain.
        let ahead = if self.closing.load(Ordering::Relaxed) {
            None
        } else {
            ahead::due(&self.sizing, lease, key, limits, now, timeout)
        };
        Some(Taken { verdict, ahead, token })
    }

    /// Records the outcome of a renewal ahead. A window's grant is recorded
    /// as any grant; a token bucket's renewed lease holds what it carried
    /// (less what was spent since) and what it was granted, in the slot the
    /// answer names. Returns units nobody here holds any more, to give back
    /// (the lease ended while the renewal was out).
    pub fn renewed(&self, ahead: &Ahead, reply: &Reply, sent: Instant, now: Instant) -> Option<Unused> {
        let Some(settle) = ahead.args.settle else {
            return self.granted(&ahead.key, &ahead.limits, reply, sent, now);
        };
        let expires_at = (reply.lease_ttl > 0).then(|| sent + Duration::from_nanos(reply.lease_ttl));
        let mut shard = self.shards.lock_key(&ahead.key);
        let lease = shard.get_mut(&ahead.key);
        let current = lease.as_ref().is_some_and(|l| l.limits == ahead.limits && l.token == ahead.token);
        if !current || self.closing.load(Ordering::Relaxed) {
            if let Some(lease) = lease {
                lease.asking_until = None;
            }
            // What it carried counts as spent; what it was granted goes back.
            return (reply.token != 0 && reply.granted > 0).then(|| Unused {
                key: ahead.key.clone(),
                limits: ahead.limits,
                units: reply.granted,
                taken: settle.unspent + reply.granted,
                token: reply.token,
                expires_at,
            });
        }
        // (`current` holds only for an entry.)
        let lease = lease?;
        lease.asking_until = None;
        if reply.token == 0 {
            // Nothing carried, nothing granted: the lease was settled whole.
            lease.end();
            return None;
        }
        // Units handed back by a rejected request since the renewal left
        // were settled as spent: only those carried are spendable.
        lease.units = lease.units.min(settle.unspent) + reply.granted;
        lease.taken = settle.unspent + reply.granted;
        lease.token = reply.token;
        lease.expires_at = expires_at;
        lease.remaining = reply.verdict.remaining;
        lease.reset_at = sent + Duration::from_nanos(reply.verdict.reset_after);
        None
    }

    /// A renewal ahead was never sent: the lease is as it was before it.
    pub fn unsent(&self, ahead: &Ahead) {
        if let Some(lease) = self.shards.lock_key(&ahead.key).get_mut(&ahead.key) {
            lease.asking_until = None;
            if let Some(settle) = ahead.args.settle
                && lease.token == ahead.token
            {
                lease.taken = settle.taken;
            }
        }
    }

    /// A renewal ahead failed. Whether a bucket's settle ran is not known:
    /// the lease is never settled (its units count until its slot ends, or
    /// the new one if it ran, which ends later) and is spent until it ends.
    pub fn renew_failed(&self, ahead: &Ahead) {
        if let Some(lease) = self.shards.lock_key(&ahead.key).get_mut(&ahead.key) {
            lease.asking_until = None;
            if ahead.args.settle.is_some() && lease.token == ahead.token {
                lease.taken = 0;
            }
        }
    }

    /// Undoes a [`take`](Self::take) from the lease named `token`: the
    /// request was rejected by another rule and counts nowhere. Units
    /// taken from a lease that has ended or been replaced since (the next
    /// window's) stay spent: they were counted where that lease was, and
    /// would let the new one spend more than Redis counted for it.
    pub fn give_back(&self, key: &str, limits: &Limits, cost: u64, token: i64) {
        if let Some(lease) = self.shards.lock_key(key).get_mut(key)
            && lease.limits == *limits
            && lease.token == token
            // (An ended lease holds nothing and never expires: not this one.)
            && (lease.units > 0 || lease.taken > 0 || lease.expires_at.is_some())
        {
            lease.units += cost;
            if lease.is_bucket() {
                // Settled meanwhile: the unit was reported spent, and
                // stays counted as such.
                lease.units = lease.units.min(lease.taken);
            }
        }
    }

    /// What to say about leases with the call deciding `key` now: the
    /// units to ask for ahead (0 while another lease request for it is in
    /// flight, where leasing does not apply, or when too many keys are
    /// tracked already) and, for a token bucket, the lease held here to
    /// settle in the same call, whose units stop being spendable here now.
    /// When it asks for units, the caller must report the call's outcome to
    /// [`granted`](Self::granted) or [`failed`](Self::failed).
    pub fn want(&self, key: &str, limits: &Limits, cost: u64, now: Instant, timeout: Duration) -> LeaseArgs {
        if !Sizing::leasable(limits) || self.closing.load(Ordering::Relaxed) {
            return LeaseArgs::default();
        }
        let share = self.sizing.share(limits);
        let (period_us, phase_us) = self.sizing.escrow(key, limits);
        let mut shard = self.shards.lock_key(key);
        if let Some(lease) = shard.get_mut(key) {
            // In use, leased or not: its history is kept.
            lease.last_used = now;
            if lease.asking_until.is_some_and(|t| t > now) {
                return LeaseArgs::default();
            }
            // A key big enough for a share keeps it, so that what any
            // instance holds of it stays that share.
            let size = if share > 0 { share } else { self.sizing.by_use(lease, limits, now) };
            if size < cost.max(1) {
                return LeaseArgs::default();
            }
            lease.asking_until = Some(now + timeout);
            // Settled whatever the call's fate: if it fails, the slot ends
            // with these units counted as spent (never twice, never short).
            let settle = if lease.is_bucket() && lease.taken > 0 && !lease.expired(now) {
                let unspent = lease.units.min(lease.taken);
                Some(Settle { slot: lease.token, taken: lease.taken, unspent, carry: false })
            } else {
                None
            };
            if lease.is_bucket() {
                lease.units = 0;
                lease.taken = 0;
            }
            return LeaseArgs { want: size, period_us, phase_us, settle, held: 0 };
        }
        if shard.len() >= MAX_PER_SHARD {
            return LeaseArgs::default();
        }
        // Tracked from its first request, leased by share at once or by
        // use once it has earned it.
        let asking = share >= cost.max(1);
        shard.insert(
            key.to_string(),
            Lease {
                limits: *limits,
                units: 0,
                taken: 0,
                token: 0,
                expires_at: None,
                last_used: now,
                remaining: 0,
                reset_at: now,
                asking_until: asking.then(|| now + timeout),
                used: false,
                seen: cost,
                before: 0,
                since: now,
                born: now,
            },
        );
        if !asking {
            return LeaseArgs::default();
        }
        LeaseArgs { want: share, period_us, phase_us, settle: None, held: 0 }
    }

    /// Records what a call that asked for a lease was granted. `sent` is
    /// when the call left: validity is counted from there, so it can only
    /// end early. Returns the units of a lease it replaces, which are to be
    /// given back (they were counted under other limits or another window).
    pub fn granted(&self, key: &str, limits: &Limits, reply: &Reply, sent: Instant, now: Instant) -> Option<Unused> {
        let expires_at = (reply.lease_ttl > 0).then(|| sent + Duration::from_nanos(reply.lease_ttl));
        if self.closing.load(Ordering::Relaxed) && reply.granted > 0 {
            // Granted after the drain: nobody here will spend it.
            let units = reply.granted;
            return Some(Unused {
                key: key.to_string(),
                limits: *limits,
                units,
                taken: units,
                token: reply.token,
                expires_at,
            });
        }
        let mut shard = self.shards.lock_key(key);
        let lease = shard.get_mut(key)?;
        lease.asking_until = None;
        if reply.granted == 0 {
            return None;
        }
        // Counted under the same limits in the same window (or escrow
        // slot): the units add up, valid until the earlier of the two
        // estimates of its end.
        let same = lease.limits == *limits && lease.token == reply.token && !lease.expired(now);
        let expires_at = match (same, lease.expires_at, expires_at) {
            (true, Some(a), Some(b)) => Some(a.min(b)),
            _ => expires_at,
        };
        let replaced = if same { None } else { lease.unused(key, now) };
        let (units, taken) = if same {
            (lease.units + reply.granted, lease.taken + reply.granted)
        } else {
            (reply.granted, reply.granted)
        };
        let bucket = limits.algorithm == Algorithm::TokenBucket;
        let used = same && lease.used;
        *lease = Lease {
            limits: *limits,
            units,
            taken: if bucket { taken } else { 0 },
            token: reply.token,
            expires_at,
            last_used: now,
            remaining: reply.verdict.remaining,
            reset_at: sent + Duration::from_nanos(reply.verdict.reset_after),
            asking_until: None,
            used,
            seen: lease.seen,
            before: lease.before,
            since: lease.since,
            born: lease.born,
        };
        replaced
    }

    /// The call that asked for a lease on `key` failed: let the next one ask.
    pub fn failed(&self, key: &str) {
        if let Some(lease) = self.shards.lock_key(key).get_mut(key) {
            lease.asking_until = None;
        }
    }

    /// Forgets keys idle for `lease_idle`, and ends leases whose window or
    /// slot has ended; returns what Redis should get back of them: the
    /// leases that were used (see the module notes). A key still in use
    /// keeps its history when its lease ends (its rate, and how long it has
    /// been seen here), so that a lease by use follows at once instead of
    /// after a new horizon: with windows of a second or less, every lease
    /// would otherwise end before the key had earned the next.
    pub fn expire(&self, now: Instant) -> Vec<Unused> {
        self.sweep(now, |lease| {
            if now.saturating_duration_since(lease.last_used) >= self.idle {
                Fate::Forget { give_back: lease.used }
            } else if lease.expired(now) {
                Fate::End { give_back: lease.used }
            } else {
                Fate::Keep
            }
        })
    }

    /// Every lease held, for giving back on shutdown; no lease is granted
    /// after it.
    pub fn drain(&self, now: Instant) -> Vec<Unused> {
        self.closing.store(true, Ordering::Relaxed);
        self.sweep(now, |_| Fate::Forget { give_back: true })
    }

    /// Applies `fate` to every key tracked, returning the units of the
    /// leases it ends or forgets with `give_back`.
    fn sweep(&self, now: Instant, mut fate: impl FnMut(&Lease) -> Fate) -> Vec<Unused> {
        let mut unused = Vec::new();
        for mut shard in self.shards.each() {
            shard.retain(|key, lease| {
                let (forget, give_back) = match fate(lease) {
                    Fate::Keep => return true,
                    Fate::End { give_back } => (false, give_back),
                    Fate::Forget { give_back } => (true, give_back),
                };
                // A fixed window's count ends with its window, so units of an
                // ended window need no refund; a sliding counter's still
                // weigh on the next window; a bucket's slot, once ended,
                // counted them all (`Unused::worth_sending`).
                let ended = lease.limits.algorithm == Algorithm::FixedWindow && lease.expired(now);
                if give_back
                    && !ended
                    && let Some(u) = lease.unused(key, now)
                {
                    unused.push(u);
                }
                if forget {
                    return false;
                }
                lease.end();
                true
            });
        }
        unused
    }

    /// Keys tracked now.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.shards.sum(HashMap::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::NANOS_PER_SEC;

    const BUCKET: Limits =
        Limits { algorithm: Algorithm::TokenBucket, limit: 1_000, window: NANOS_PER_SEC, burst: 1_000, origin: 0 };
    const TIMEOUT: Duration = Duration::from_millis(20);

    fn reply(granted: u64, remaining: u64, token: i64, lease_ttl: u64) -> Reply {
        Reply {
            verdict: Verdict {
                allowed: true,
                remaining,
                reset_after: 500_000_000,
                retry_after: 0,
                delay: 0,
                fallback: false,
                boxed: Boxed::No,
            },
            token,
            granted,
            lease_ttl,
            fresh: false,
        }
    }

    #[test]
    fn a_key_is_leased_from_its_first_call_and_then_spent_locally() {
        let leases = Leases::new(1, Duration::from_secs(5), Duration::from_secs(5));
        let t0 = Instant::now();
        assert!(leases.take("k", &BUCKET, 1, t0, TIMEOUT).is_none());
        assert_eq!(leases.want("k", &BUCKET, 1, t0, TIMEOUT).want, 10, "1% of 1,000");
        assert_eq!(leases.want("k", &BUCKET, 1, t0, TIMEOUT).want, 0, "one lease request in flight per key");
        assert!(leases.granted("k", &BUCKET, &reply(10, 980, 0, 0), t0, t0).is_none());
        for left in (0..10).rev() {
            let taken = leases.take("k", &BUCKET, 1, t0, TIMEOUT).expect("served from the lease");
            assert!(taken.verdict.allowed);
            assert_eq!(taken.verdict.remaining, 980 + left);
            // Renewed ahead as its last unit is spent, at this key's rate
            // (see the test below); here the renewal fails.
            assert_eq!(taken.ahead.is_some(), left == 0, "{left} left");
            if let Some(ahead) = taken.ahead {
                leases.renew_failed(&ahead);
            }
        }
        assert!(leases.take("k", &BUCKET, 1, t0, TIMEOUT).is_none(), "spent: back to Redis");
        assert_eq!(leases.want("k", &BUCKET, 1, t0, TIMEOUT).want, 10);
    }

    #[test]
    fn small_keys_and_per_request_algorithms_are_never_leased() {
        let leases = Leases::new(1, Duration::from_secs(5), Duration::from_secs(5));
        let t0 = Instant::now();
        let small = Limits { limit: 150, burst: 150, ..BUCKET };
        let log = Limits { algorithm: Algorithm::SlidingWindowLog, ..BUCKET };
        let leaky = Limits { algorithm: Algorithm::LeakyBucket, ..BUCKET };
        for limits in [log, leaky] {
            assert_eq!(leases.want("k", &limits, 1, t0, TIMEOUT).want, 0, "{limits:?}");
        }
        assert_eq!(leases.len(), 0, "per-request algorithms are not even tracked");
        // A small key is tracked, to be leased by use later (see below).
        assert_eq!(leases.want("s", &small, 1, t0, TIMEOUT).want, 0);
        assert_eq!(leases.len(), 1);
        assert_eq!(leases.want("k", &BUCKET, 11, t0, TIMEOUT).want, 0, "a request costing more than a lease");
        assert_eq!(
            Leases::new(0, Duration::from_secs(5), Duration::from_secs(5)).want("k", &BUCKET, 1, t0, TIMEOUT).want,
            0
        );
    }

    /// A token bucket's lease lives in an escrow slot of one to two
    /// lifetimes, a window's ends with its window: by use, a bucket is
    /// leased as many seconds of use as a lifetime holds (two to four), a
    /// window two.
    #[test]
    fn a_bucket_is_leased_up_to_four_seconds_of_use_and_a_window_two() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        // 190: 1% is under two units, a tenth is 19.
        let bucket = Limits { limit: 190, burst: 190, ..BUCKET };
        let window = Limits { algorithm: Algorithm::FixedWindow, ..bucket };
        let asked = |lifetime: Duration, limits: &Limits| {
            let leases = Leases::new(1, Duration::from_secs(5), lifetime);
            // Three requests in the first second, and the one asking:
            // four in the last second.
            for i in 0..3 {
                leases.take("k", limits, 1, t0 + ms(333 * i), TIMEOUT);
                leases.want("k", limits, 1, t0 + ms(333 * i), TIMEOUT);
            }
            let at = t0 + ms(1_000);
            leases.take("k", limits, 1, at, TIMEOUT);
            leases.want("k", limits, 1, at, TIMEOUT).want
        };
        assert_eq!(asked(Duration::from_secs(5), &bucket), 16, "four seconds at four a second");
        assert_eq!(asked(Duration::from_secs(3), &bucket), 12, "as many seconds as a lifetime holds");
        assert_eq!(asked(Duration::from_secs(1), &bucket), 8, "at least two");
        assert_eq!(asked(Duration::from_secs(5), &window), 8, "a window's: two seconds");
    }

    #[test]
    fn a_key_too_small_for_a_share_is_leased_what_it_used_in_the_last_second() {
        let leases = Leases::new(1, Duration::from_secs(5), Duration::from_secs(5));
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        // 100 a second: 1% is one unit, too small for a share.
        let small = Limits { limit: 100, burst: 100, ..BUCKET };
        // A request every 100 ms: ten a second, none leased during the
        // first half second (a burst is decided request by request).
        for i in 0..5 {
            let at = t0 + ms(100 * i);
            assert!(leases.take("k", &small, 1, at, TIMEOUT).is_none());
            assert_eq!(leases.want("k", &small, 1, at, TIMEOUT).want, 0, "request {i}");
        }
        let at = t0 + ms(500);
        assert!(leases.take("k", &small, 1, at, TIMEOUT).is_none());
        let asked = leases.want("k", &small, 1, at, TIMEOUT);
        assert_eq!(asked.want, 10, "four times the six units used so far, capped at a tenth of 100");
        assert!(asked.period_us > 0, "held in escrow like any bucket lease");
        leases.granted("k", &small, &reply(10, 80, 9, 6 * NANOS_PER_SEC), at, at);
        for i in 1..=10 {
            assert!(leases.take("k", &small, 1, at + ms(100 * i), TIMEOUT).is_some(), "served here");
        }
        // Faster than a tenth of the capacity: capped there.
        let busy = t0 + ms(2_100);
        for _ in 0..50 {
            leases.take("k", &small, 1, busy, TIMEOUT);
        }
        assert_eq!(leases.want("k", &small, 1, busy, TIMEOUT).want, 10, "a tenth of 100");
        leases.failed("k");
        // Quiet again: older use fades, and a key used once in a while is
        // not leased.
        let quiet = busy + ms(10_000);
        assert!(leases.take("k", &small, 1, quiet, TIMEOUT).is_none());
        assert_eq!(leases.want("k", &small, 1, quiet, TIMEOUT).want, 0);
        // A crowd: a hundred requests in its first half second, none
        // leased.
        for i in 0..100 {
            let at = t0 + Duration::from_micros(4_990 * i);
            assert!(leases.take("crowd", &small, 1, at, TIMEOUT).is_none());
            assert_eq!(leases.want("crowd", &small, 1, at, TIMEOUT).want, 0, "crowd request {i}");
        }
        // A key under ten units is never leased by use.
        let tiny = Limits { limit: 9, burst: 9, ..BUCKET };
        for i in 0..30 {
            leases.take("t", &tiny, 1, t0 + ms(100 * i), TIMEOUT);
            assert_eq!(leases.want("t", &tiny, 1, t0 + ms(100 * i), TIMEOUT).want, 0);
        }
    }

    #[test]
    fn a_key_in_use_whose_lease_ended_is_leased_again_at_once() {
        let leases = Leases::new(1, Duration::from_secs(5), Duration::from_secs(5));
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        // A one-second window of 100, used ten times a second.
        let window = Limits { algorithm: Algorithm::FixedWindow, limit: 100, burst: 100, ..BUCKET };
        for i in 0..=10 {
            let at = t0 + ms(100 * i);
            assert!(leases.take("w", &window, 1, at, TIMEOUT).is_none());
            let asked = leases.want("w", &window, 1, at, TIMEOUT);
            if i < 10 {
                leases.failed("w");
                continue;
            }
            assert_eq!(asked.want, 10);
            // Granted until its window ends, 50 ms from now.
            leases.granted("w", &window, &reply(10, 80, 7, 50_000_000), at, at);
        }
        // The window ends and the periodic sweep drops the lease: the key's
        // use is still known, so the next call asks for a lease again rather
        // than waiting for a new second of history.
        let after = t0 + ms(1_100);
        // (A fixed window's units end with it: nothing to give back.)
        assert!(leases.expire(after).is_empty());
        assert!(leases.take("w", &window, 1, after, TIMEOUT).is_none(), "nothing left to spend");
        assert_eq!(leases.want("w", &window, 1, after, TIMEOUT).want, 10);
        // Idle for `lease_idle`, it is forgotten.
        leases.failed("w");
        assert!(leases.expire(after + Duration::from_secs(5)).is_empty());
        assert_eq!(leases.len(), 0);
    }

    #[test]
    fn a_lease_serves_only_its_limits_and_its_window() {
        let leases = Leases::new(1, Duration::from_secs(5), Duration::from_secs(5));
        let t0 = Instant::now();
        let window = Limits { algorithm: Algorithm::FixedWindow, ..BUCKET };
        assert_eq!(leases.want("k", &window, 1, t0, TIMEOUT).want, 10);
        leases.granted("k", &window, &reply(10, 980, 7, 100_000_000), t0, t0);
        assert!(leases.take("k", &Limits { limit: 2_000, ..window }, 1, t0, TIMEOUT).is_none(), "limits lifted");
        assert!(leases.take("k", &window, 1, t0 + Duration::from_millis(99), TIMEOUT).is_some());
        assert!(leases.take("k", &window, 1, t0 + Duration::from_millis(100), TIMEOUT).is_none(), "the window ended");
        // The window's count ended with it: nothing to give back. The key
        // stays tracked, with no lease.
        assert!(leases.expire(t0 + Duration::from_millis(100)).is_empty());
        assert_eq!(leases.len(), 1);
        assert!(leases.take("k", &window, 1, t0 + Duration::from_millis(100), TIMEOUT).is_none());
    }

    #[test]
    fn idle_leases_that_were_used_are_returned_and_taken_units_can_be_given_back() {
        let leases = Leases::new(1, Duration::from_secs(5), Duration::from_secs(5));
        let t0 = Instant::now();
        // Escrowed for 8 s: valid past the idle sweep.
        let slot = reply(10, 980, 77, 8 * NANOS_PER_SEC);
        for key in ["k", "one-off"] {
            assert_eq!(leases.want(key, &BUCKET, 1, t0, TIMEOUT).want, 10);
            leases.granted(key, &BUCKET, &slot, t0, t0);
        }
        let taken = leases.take("k", &BUCKET, 3, t0, TIMEOUT).expect("served");
        leases.give_back("k", &BUCKET, 3, taken.token);
        leases.take("k", &BUCKET, 2, t0, TIMEOUT).expect("served");
        assert!(leases.expire(t0 + Duration::from_secs(4)).is_empty(), "not idle yet");
        // The one-off key's lease was never spent: not worth a call.
        let back = leases.expire(t0 + Duration::from_secs(5));
        assert_eq!(back.len(), 1);
        assert_eq!(back[0].key, "k");
        assert_eq!(back[0].settle(), Some(Settle { slot: 77, taken: 10, unspent: 8, carry: false }));
        assert_eq!(leases.len(), 0);
    }

    /// A request served from a window's lease and then rejected by another
    /// rule gives its units back to that lease only: once the lease of the
    /// next window has replaced it, the units were counted in a window
    /// that is over, and joining them to the new lease would let this
    /// instance spend more than Redis counted for it.
    #[test]
    fn units_given_back_after_their_lease_was_replaced_do_not_join_the_next_one() {
        let leases = Leases::new(1, Duration::from_secs(5), Duration::from_secs(5));
        let t0 = Instant::now();
        let window = Limits { algorithm: Algorithm::FixedWindow, ..BUCKET };
        assert_eq!(leases.want("w", &window, 1, t0, TIMEOUT).want, 10);
        leases.granted("w", &window, &reply(10, 980, 7, NANOS_PER_SEC), t0, t0);
        // Given back to the lease it was taken from, the units are spent again.
        let taken = leases.take("w", &window, 2, t0, TIMEOUT).expect("served from the lease");
        leases.give_back("w", &window, 2, taken.token);
        let taken = leases.take("w", &window, 3, t0, TIMEOUT).expect("served from the lease");
        // Meanwhile the next window's lease (token 8) replaces it.
        assert_eq!(leases.want("w", &window, 1, t0, TIMEOUT).want, 10);
        let old = leases.granted("w", &window, &reply(10, 980, 8, NANOS_PER_SEC), t0, t0).expect("the old lease");
        assert_eq!((old.units, old.token), (7, 7));
        leases.give_back("w", &window, 3, taken.token);
        assert_eq!(
            (0..20).filter(|_| leases.take("w", &window, 1, t0, TIMEOUT).is_some()).count(),
            10,
            "the new lease holds what Redis granted it, no more"
        );
    }

    #[test]
    fn a_failed_lease_request_lets_the_next_call_ask_and_replaced_leases_are_returned() {
        let leases = Leases::new(1, Duration::from_secs(5), Duration::from_secs(5));
        let t0 = Instant::now();
        assert_eq!(leases.want("k", &BUCKET, 1, t0, TIMEOUT).want, 10);
        assert_eq!(leases.want("k", &BUCKET, 1, t0, TIMEOUT).want, 0, "in flight");
        leases.failed("k");
        assert_eq!(leases.want("k", &BUCKET, 1, t0, TIMEOUT).want, 10);
        leases.granted("k", &BUCKET, &reply(10, 980, 3, NANOS_PER_SEC), t0, t0);
        // An in-flight request that never reports stops blocking after the timeout.
        assert_eq!(leases.want("k", &BUCKET, 1, t0, TIMEOUT).want, 10);
        assert_eq!(leases.want("k", &BUCKET, 1, t0, TIMEOUT).want, 0);
        assert_eq!(leases.want("k", &BUCKET, 1, t0 + TIMEOUT, TIMEOUT).want, 10);
        // A reload changed the limits: a bucket's old lease was settled by
        // the call that asked, a window's goes back.
        let lifted = Limits { limit: 2_000, burst: 2_000, ..BUCKET };
        assert!(leases.granted("k", &lifted, &reply(20, 1_900, 4, NANOS_PER_SEC), t0, t0).is_none());
        let window = Limits { algorithm: Algorithm::FixedWindow, ..BUCKET };
        leases.want("w", &window, 1, t0, TIMEOUT);
        leases.granted("w", &window, &reply(10, 980, 0, NANOS_PER_SEC), t0, t0);
        leases.want("w", &window, 1, t0, TIMEOUT);
        let lifted = Limits { limit: 2_000, ..window };
        let old =
            leases.granted("w", &lifted, &reply(20, 1_900, 0, NANOS_PER_SEC), t0, t0).expect("old lease returned");
        assert_eq!((old.units, old.limits), (10, window));
        assert_eq!(leases.drain(t0).len(), 2);
    }

    #[test]
    fn a_bucket_lease_lasts_until_its_slot_ends_and_is_settled_by_the_next_call() {
        let leases = Leases::new(1, Duration::from_secs(5), Duration::from_secs(5));
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        // However fast the bucket refills, the escrowed units stay valid
        // until their slot ends, 6 s from now.
        let slot = reply(10, 985, 5_000, 6 * NANOS_PER_SEC);
        let asked = leases.want("k", &BUCKET, 1, t0, TIMEOUT);
        assert_eq!((asked.want, asked.settle), (10, None));
        assert!(asked.period_us == 5_000_000 && asked.phase_us < 5_000_000);
        leases.granted("k", &BUCKET, &slot, t0, t0);
        for _ in 0..4 {
            assert!(leases.take("k", &BUCKET, 1, t0 + ms(5_999), TIMEOUT).is_some());
        }
        assert!(leases.take("k", &BUCKET, 1, t0 + ms(6_000), TIMEOUT).is_none(), "the slot ended");
        // Before it ends, the call that asks again settles it: 10 taken, 6
        // of them unspent, and nothing is spendable here until the reply.
        let asked = leases.want("k", &BUCKET, 7, t0 + ms(10), TIMEOUT);
        assert_eq!(asked.settle, Some(Settle { slot: 5_000, taken: 10, unspent: 6, carry: false }));
        assert!(leases.take("k", &BUCKET, 1, t0 + ms(10), TIMEOUT).is_none());
        assert!(leases.drain(t0 + ms(10)).is_empty(), "settled: nothing more to give back");

        // A slot that has ended counted everything: nothing to settle.
        let leases = Leases::new(1, Duration::from_secs(5), Duration::from_secs(5));
        leases.want("k", &BUCKET, 1, t0, TIMEOUT);
        leases.granted("k", &BUCKET, &slot, t0, t0);
        assert_eq!(leases.want("k", &BUCKET, 1, t0 + ms(6_000), TIMEOUT).settle, None);
        leases.granted("k", &BUCKET, &slot, t0, t0);
        assert!(leases.drain(t0 + ms(6_000)).is_empty());
    }

    /// Requests for `key` before its lease comes: 400 in the last second
    /// here, so that a unit lasts 2.5 ms and a lease renews with an eighth
    /// left (it would spend 10 in the 25 ms a renewal may take).
    fn busy(leases: &Leases, key: &str, limits: &Limits) {
        for _ in 0..400 {
            assert!(leases.take(key, limits, 1, Instant::now(), TIMEOUT).is_none(), "not leased yet");
        }
    }

    /// A busy key granted `lease` (of 10) and spent until it renews ahead,
    /// with one unit left; the renewal made due.
    fn renewing(key: &str, limits: &Limits, lease: &Reply, t0: Instant) -> (Leases, Ahead) {
        let leases = Leases::new(1, Duration::from_secs(5), Duration::from_secs(5));
        leases.want(key, limits, 1, t0, TIMEOUT);
        busy(&leases, key, limits);
        leases.granted(key, limits, lease, t0, t0);
        let ahead = (0..9).find_map(|_| leases.take(key, limits, 1, t0, TIMEOUT).and_then(|t| t.ahead));
        (leases, ahead.expect("renewed ahead"))
    }

    #[test]
    fn a_lease_running_low_is_renewed_ahead_with_its_unspent_units_carried() {
        let leases = Leases::new(1, Duration::from_secs(5), Duration::from_secs(5));
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        // 1% of 1,000: a lease of 10 in the slot ending at 5,000 (6 s), of
        // a busy key.
        leases.want("k", &BUCKET, 1, t0, TIMEOUT);
        busy(&leases, "k", &BUCKET);
        leases.granted("k", &BUCKET, &reply(10, 985, 5_000, 6 * NANOS_PER_SEC), t0, t0);
        for _ in 0..8 {
            assert!(leases.take("k", &BUCKET, 1, t0, TIMEOUT).expect("served").ahead.is_none());
        }
        // Nine spent, one left: an eighth of 10 or less.
        let ahead = leases.take("k", &BUCKET, 1, t0 + ms(1), TIMEOUT).expect("served").ahead.expect("renewed ahead");
        assert_eq!(ahead.args.want, 9, "topped up to its size");
        assert_eq!(ahead.args.settle, Some(Settle { slot: 5_000, taken: 10, unspent: 1, carry: true }));
        // One renewal at a time; the carried unit is still spent meanwhile.
        let last = leases.take("k", &BUCKET, 1, t0 + ms(2), TIMEOUT).expect("the carried unit");
        assert!(last.ahead.is_none(), "one renewal in flight");
        assert!(leases.take("k", &BUCKET, 1, t0 + ms(2), TIMEOUT).is_none(), "spent");
        // The answer: the unit carried and 9 granted, in the slot ending at
        // 10,000, 9 s from when the renewal left.
        let renewed = reply(9, 975, 10_000, 9 * NANOS_PER_SEC);
        assert!(leases.renewed(&ahead, &renewed, t0 + ms(1), t0 + ms(3)).is_none());
        let mut next = None;
        for _ in 0..9 {
            let taken = leases.take("k", &BUCKET, 1, t0 + ms(9_000), TIMEOUT).expect("the granted units");
            next = next.or(taken.ahead);
        }
        assert!(leases.take("k", &BUCKET, 1, t0 + ms(9_001), TIMEOUT).is_none(), "its slot ended");
        // The next renewal quotes what it holds in the new slot: the
        // carried unit (spent while the first was out) and the 9 granted;
        // used slowly by then (nine requests in 9 s), the key renews as it
        // spends its last unit.
        let next = next.expect("renewed ahead again");
        assert_eq!(next.args.settle, Some(Settle { slot: 10_000, taken: 10, unspent: 0, carry: true }));
        assert!(leases.drain(t0 + ms(9_000)).is_empty(), "settled by the renewal out");

        // A renewal that fails may have settled the lease or not: it is
        // never settled again, and spent until its own slot ends.
        let (leases, ahead) = renewing("k", &BUCKET, &reply(10, 985, 5_000, 6 * NANOS_PER_SEC), t0);
        leases.renew_failed(&ahead);
        assert!(leases.take("k", &BUCKET, 1, t0 + ms(5_999), TIMEOUT).expect("the last unit").ahead.is_none());
        assert_eq!(leases.want("k", &BUCKET, 1, t0 + ms(5_999), TIMEOUT).settle, None, "nothing to settle");

        // A renewal never sent (the store was degraded): the lease is as
        // it was, and the next take makes the same renewal due.
        let (leases, ahead) = renewing("k", &BUCKET, &reply(10, 985, 5_000, 6 * NANOS_PER_SEC), t0);
        leases.unsent(&ahead);
        let again = leases.take("k", &BUCKET, 0, t0, TIMEOUT).expect("the last unit").ahead.expect("due again");
        assert_eq!(again.args.settle, ahead.args.settle);

        // Shutting down while a renewal is out: the lease it settles is not
        // settled again, and what the renewal brings back is handed back.
        let (leases, ahead) = renewing("k", &BUCKET, &reply(10, 985, 5_000, 6 * NANOS_PER_SEC), t0);
        assert!(leases.drain(t0 + ms(1)).is_empty(), "settled by the renewal out");
        let back = leases.renewed(&ahead, &renewed, t0, t0 + ms(2)).expect("given back");
        assert_eq!(back.settle(), Some(Settle { slot: 10_000, taken: 10, unspent: 9, carry: false }));

        // A lease that ended while its renewal was out: what was granted
        // goes back, and what was carried counts as spent.
        let (leases, ahead) = renewing("k", &BUCKET, &reply(10, 985, 5_000, 6 * NANOS_PER_SEC), t0);
        assert!(leases.expire(t0 + ms(6_000)).is_empty(), "its slot ended: nothing to settle");
        let back = leases.renewed(&ahead, &renewed, t0, t0 + ms(6_000)).expect("given back");
        assert_eq!(back.settle(), Some(Settle { slot: 10_000, taken: 10, unspent: 9, carry: false }));

        // A window's renewal adds to the lease of its window.
        let window = Limits { algorithm: Algorithm::FixedWindow, ..BUCKET };
        let (leases, ahead) = renewing("w", &window, &reply(10, 980, 7, NANOS_PER_SEC), t0);
        assert_eq!((ahead.args.want, ahead.args.settle, ahead.args.held), (9, None, 1));
        assert!(leases.renewed(&ahead, &reply(9, 970, 7, NANOS_PER_SEC), t0, t0).is_none());
        assert_eq!((0..20).filter(|_| leases.take("w", &window, 1, t0, TIMEOUT).is_some()).count(), 10);
    }

    #[test]
    fn every_instance_gives_a_key_the_same_escrow_phase() {
        let a = Leases::new(1, Duration::from_secs(5), Duration::from_secs(5));
        let b = Leases::new(1, Duration::from_secs(5), Duration::from_secs(5));
        let t0 = Instant::now();
        let phases: Vec<u64> = (0..20).map(|i| a.want(&format!("k{i}"), &BUCKET, 1, t0, TIMEOUT).phase_us).collect();
        assert_eq!(
            phases,
            (0..20).map(|i| b.want(&format!("k{i}"), &BUCKET, 1, t0, TIMEOUT).phase_us).collect::<Vec<_>>()
        );
        assert!(phases.iter().any(|&p| p != phases[0]), "keys are spread over the period");
        let window = Limits { algorithm: Algorithm::FixedWindow, ..BUCKET };
        assert_eq!(a.want("w", &window, 1, t0, TIMEOUT).period_us, 0, "windows end with their window");
    }

    #[test]
    fn after_the_drain_no_lease_is_asked_for_and_a_late_grant_is_handed_back() {
        let leases = Leases::new(1, Duration::from_secs(5), Duration::from_secs(5));
        let t0 = Instant::now();
        assert_eq!(leases.want("k", &BUCKET, 1, t0, TIMEOUT).want, 10);
        assert!(leases.drain(t0).is_empty());
        // The call in flight during the drain comes back with its grant.
        let late = leases.granted("k", &BUCKET, &reply(10, 980, 9, NANOS_PER_SEC), t0, t0).expect("handed back");
        assert_eq!(late.key, "k");
        assert_eq!(late.settle(), Some(Settle { slot: 9, taken: 10, unspent: 10, carry: false }));
        assert!(leases.take("k", &BUCKET, 1, t0, TIMEOUT).is_none());
        assert_eq!(leases.want("k", &BUCKET, 1, t0, TIMEOUT).want, 0, "closing: no new lease");
    }
}
