//! One key's entry: its lease, if any, and its recent use here; and what
//! giving a lease back returns.

use std::time::Instant;

use crate::limiter::{Algorithm, Limits};
use crate::store::redis::scripts::Settle;

/// One key's entry: the lease held here (none while `units`, `taken` and
/// `expires_at` are all empty), and how the key was used here lately, which
/// a lease by use is sized from.
#[derive(Debug, Clone, Copy)]
pub struct Lease {
    pub limits: Limits,
    /// Units held here, counted in Redis and not spent yet.
    pub units: u64,
    /// A token bucket's: the units granted into its escrow slot and not
    /// settled yet, spent or not (what a settle quotes).
    pub taken: u64,
    /// The window they were counted in, or a token bucket's escrow slot
    /// (what a refund or a settle quotes).
    pub token: i64,
    /// When they stop being valid (the end of their window or escrow
    /// slot), if ever.
    pub expires_at: Option<Instant>,
    pub last_used: Instant,
    /// What Redis had left after the grant, and when the key would be full
    /// again: for the headers of requests served here.
    pub remaining: u64,
    pub reset_at: Instant,
    /// A lease request for this key is in flight until then.
    pub asking_until: Option<Instant>,
    /// Whether a request spent some of it since it was granted.
    pub used: bool,
    /// Units requests asked of this key here since `since` (the start of
    /// the current horizon), served from the lease or not, and in the
    /// horizon before: its rate here, which sizes a lease by use.
    pub seen: u64,
    pub before: u64,
    pub since: Instant,
    /// When this instance began tracking the key.
    pub born: Instant,
}

impl Lease {
    pub fn is_bucket(&self) -> bool {
        self.limits.algorithm == Algorithm::TokenBucket
    }

    pub fn expired(&self, now: Instant) -> bool {
        self.expires_at.is_some_and(|t| t <= now)
    }

    /// Drops the lease itself (given back or ended), keeping the key's
    /// history.
    pub fn end(&mut self) {
        (self.units, self.taken, self.token, self.expires_at, self.used) = (0, 0, 0, None, false);
    }

    /// What giving this lease back at `now` returns: a window's unspent
    /// units, or a token bucket's settle (nothing once its slot has ended,
    /// which counted all of it already).
    pub fn unused(&self, key: &str, now: Instant) -> Option<Unused> {
        let unused = Unused {
            key: key.to_string(),
            limits: self.limits,
            units: self.units,
            taken: self.taken,
            token: self.token,
            expires_at: self.expires_at,
        };
        unused.worth_sending(now).then_some(unused)
    }
}

/// Units to give back to Redis: a lease nobody here uses any more.
#[derive(Debug)]
pub struct Unused {
    pub key: String,
    pub limits: Limits,
    /// Units held and not spent.
    pub units: u64,
    /// A token bucket's units granted into its slot (see [`Lease::taken`]).
    pub taken: u64,
    pub token: i64,
    /// A token bucket's slot end, as estimated here.
    pub expires_at: Option<Instant>,
}

impl Unused {
    pub fn is_bucket(&self) -> bool {
        self.limits.algorithm == Algorithm::TokenBucket
    }

    /// Whether a give-back at `now` still changes anything in Redis: a
    /// window's units, or a bucket's slot before it ends.
    pub fn worth_sending(&self, now: Instant) -> bool {
        if self.is_bucket() { self.taken > 0 && self.expires_at.is_none_or(|t| t > now) } else { self.units > 0 }
    }

    /// The settle a token bucket's give-back sends.
    pub fn settle(&self) -> Option<Settle> {
        self.is_bucket().then_some(Settle {
            slot: self.token,
            taken: self.taken,
            unspent: self.units.min(self.taken),
            carry: false,
        })
    }
}
