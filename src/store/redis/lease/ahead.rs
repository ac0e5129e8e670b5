//! Renewing a lease ahead: when a take leaves it low, a top-up no request
//! waits for (see the module notes of [`lease`](super)).

use std::time::{Duration, Instant};

use super::entry::Lease;
use super::size::Sizing;
use crate::limiter::Limits;
use crate::store::redis::scripts::{LeaseArgs, Settle};

/// A lease spent down to an [`AHEAD`]th of its size (or [`LEAD`]'s worth)
/// is renewed ahead:
/// the next requests need not wait for a round trip, and the renewal,
/// which no request waits for, goes in whatever call to its node leaves
/// next (see `batch`).
pub(super) const AHEAD: u64 = 8;
/// ... or when what is left would last less than this at the key's rate
/// here, if that is less: how long a renewal may take to come back (a lazy
/// check's wait, a round trip under load).
pub(super) const LEAD: Duration = Duration::from_millis(25);

/// A renewal ahead: a consume of nothing that tops the lease up to its
/// size, settling a token bucket's lease with its unspent units carried
/// into the new grant's slot (`bucket.lua`), which the holder goes on
/// spending meanwhile.
#[derive(Debug)]
pub struct Ahead {
    pub key: String,
    pub limits: Limits,
    pub args: LeaseArgs,
    /// The lease's slot (a window's start) when it was sent: the lease
    /// renewed, unless it has ended or been replaced since.
    pub token: i64,
}

/// The renewal `lease` is due once a take leaves it at what the key
/// spends here in [`LEAD`], at most an eighth of its size: a top-up to its size (granted only where a whole
/// lease of that size would be: `lease` in prelude.lua), with a token bucket's
/// lease settled and its units carried into the new slot. None while a
/// lease request is in flight, for a key no longer
/// worth a lease, or for a bucket lease whose settle is not known
/// (after a failed call: it ends with its slot, and the request that
/// finds it spent asks again).
pub fn due(
    sizing: &Sizing,
    lease: &mut Lease,
    key: &str,
    limits: &Limits,
    now: Instant,
    timeout: Duration,
) -> Option<Ahead> {
    if lease.asking_until.is_some_and(|t| t > now) {
        return None;
    }
    let share = sizing.share(limits);
    let size = if share > 0 { share } else { sizing.by_use(lease, limits, now) };
    // What the key spends here while a renewal is out, at most an eighth
    // of the lease: a key used a few times a second renews as it spends
    // its last unit, a whole lease per call.
    if size == 0 || lease.units > size / AHEAD {
        return None;
    }
    let lead = u128::from(sizing.rate(lease, now)) * LEAD.as_nanos() / sizing.horizon().as_nanos();
    if u128::from(lease.units) > lead {
        return None;
    }
    let bucket = lease.is_bucket();
    if bucket && lease.taken == 0 {
        return None;
    }
    let (period_us, phase_us) = sizing.escrow(key, limits);
    let settle = bucket.then_some(Settle {
        slot: lease.token,
        taken: lease.taken,
        unspent: lease.units.min(lease.taken),
        carry: true,
    });
    lease.asking_until = Some(now + timeout);
    if bucket {
        // Settled by this renewal, if it runs: nothing else may settle
        // it meanwhile (a sweep, the drain), or the slot would give up
        // its units twice. Its units stay spendable until it ends.
        lease.taken = 0;
    }
    Some(Ahead {
        key: key.to_string(),
        limits: *limits,
        args: LeaseArgs {
            want: size - lease.units.min(size),
            period_us,
            phase_us,
            settle,
            held: if bucket { 0 } else { lease.units },
        },
        token: lease.token,
    })
}
