//! How big a key's lease is: the `lease_percent` share of its capacity, or,
//! where that is under two units, what the key used here lately (see the
//! module notes of [`lease`](super)).

use std::time::{Duration, Instant};

use super::entry::Lease;
use crate::limiter::{Algorithm, Limits};

/// Cluster hash slots: a key's slot gives its escrow phase.
const SLOTS: u64 = 16_384;
/// How far back a key's use here is measured to size a lease by use
/// (shorter if `lease_lifetime` is).
pub(super) const HORIZON: Duration = Duration::from_secs(1);
/// How long this instance must have seen a key before leasing it by use
/// (at most a horizon): a crowd arriving at once is decided request by
/// request, since it is over well before. Half a horizon rather than a
/// whole one, because until then every request of a new client costs a
/// round trip: on edge-bench `spread` against a cluster, whose 10,000 keys
/// are all new in the first seconds, the defaults sent 0.17 to 0.18 checks
/// per request with a whole horizon and 0.11 to 0.13 with half.
pub(super) const YOUTH: Duration = Duration::from_millis(500);
/// A lease sized by use is what the last horizon asked, this many times:
/// it lasts this many horizons at the rate it was sized by.
pub(super) const BY_USE_SPAN: u64 = 2;
/// A token bucket's lease by use covers as many horizons as one
/// `lease_lifetime` holds (its escrow slot lives one to two), at least
/// [`BY_USE_SPAN`] and at most this many: fewer calls for keys far below
/// their limit, and never more held back than [`BY_USE_SHARE`] allows.
pub(super) const BY_USE_SPAN_BUCKET: u64 = 4;
/// A lease sized by use takes at most this fraction of the key's capacity.
pub(super) const BY_USE_SHARE: u64 = 10;

/// The sizes leases are given, from `lease_percent` and `lease_lifetime`.
pub struct Sizing {
    percent: u64,
    /// A token-bucket escrow slot's period, in µs (`lease_lifetime`).
    period_us: u64,
    /// [`HORIZON`], or `lease_lifetime` when that is shorter.
    horizon: Duration,
    /// [`YOUTH`], or the horizon when that is shorter.
    youth: Duration,
    /// How many horizons of use a token bucket's lease by use covers.
    bucket_span: u64,
}

impl Sizing {
    pub fn new(percent: u8, lifetime: Duration) -> Sizing {
        let horizon = HORIZON.min(lifetime).max(Duration::from_millis(1));
        Sizing {
            percent: u64::from(percent),
            period_us: u64::try_from(lifetime.as_micros()).unwrap_or(u64::MAX).max(1),
            horizon,
            youth: YOUTH.min(horizon),
            bucket_span: u64::try_from(lifetime.as_nanos() / horizon.as_nanos())
                .unwrap_or(u64::MAX)
                .clamp(BY_USE_SPAN, BY_USE_SPAN_BUCKET),
        }
    }

    pub fn enabled(&self) -> bool {
        self.percent > 0
    }

    /// The horizon use is measured over.
    pub fn horizon(&self) -> Duration {
        self.horizon
    }

    /// Whether `limits` can be leased at all (see the module notes).
    pub fn leasable(limits: &Limits) -> bool {
        matches!(limits.algorithm, Algorithm::TokenBucket | Algorithm::FixedWindow | Algorithm::SlidingWindowCounter)
    }

    /// The `lease_percent` share of the capacity, or 0 when under two units.
    pub fn share(&self, limits: &Limits) -> u64 {
        let size = limits.capacity().saturating_mul(self.percent) / 100;
        if size < 2 { 0 } else { size }
    }

    /// The lease `lease`'s key has earned by use here at `now` (see the
    /// module notes): twice the units asked in the last horizon (a sliding
    /// estimate over this horizon and the one before), a token bucket's up
    /// to four times, at most a tenth of
    /// the capacity; none when that use is under two units, nor until the
    /// key has been seen for [`YOUTH`].
    pub fn by_use(&self, lease: &mut Lease, limits: &Limits, now: Instant) -> u64 {
        self.roll(lease, now);
        if now.saturating_duration_since(lease.born) < self.youth {
            return 0;
        }
        let rate = self.rate(lease, now);
        let span = if limits.algorithm == Algorithm::TokenBucket { self.bucket_span } else { BY_USE_SPAN };
        let size = rate.saturating_mul(span).min(limits.capacity() / BY_USE_SHARE);
        if rate < 2 || size < 2 { 0 } else { size }
    }

    /// The units asked of `lease`'s key here over the last horizon: a
    /// sliding estimate over this horizon and the one before (`roll` first).
    pub fn rate(&self, lease: &Lease, now: Instant) -> u64 {
        let horizon = self.horizon.as_nanos();
        let into = now.saturating_duration_since(lease.since).as_nanos().min(horizon);
        let before = u128::from(lease.before) * (horizon - into) / horizon;
        u64::try_from(before).unwrap_or(u64::MAX).saturating_add(lease.seen)
    }

    /// Moves `lease`'s use count on to the horizon `now` falls in.
    pub fn roll(&self, lease: &mut Lease, now: Instant) {
        let elapsed = now.saturating_duration_since(lease.since);
        if elapsed >= 2 * self.horizon {
            (lease.before, lease.seen, lease.since) = (0, 0, now);
        } else if elapsed >= self.horizon {
            (lease.before, lease.seen, lease.since) = (lease.seen, 0, lease.since + self.horizon);
        }
    }

    /// A token bucket's escrow period and the phase its slots end on for
    /// `key`: from the key's cluster slot, so every instance agrees on it
    /// and the slots of different keys do not all end at once.
    pub fn escrow(&self, key: &str, limits: &Limits) -> (u64, u64) {
        if limits.algorithm != Algorithm::TokenBucket {
            return (0, 0);
        }
        let slot = u64::from(fred::util::redis_keyslot(key.as_bytes()));
        let phase = u128::from(slot) * u128::from(self.period_us) / u128::from(SLOTS);
        (self.period_us, u64::try_from(phase).unwrap_or(0))
    }
}
