//! The store the server runs with ([`AnyStore`]), and what a request
//! keeps of it past the request path: its concurrency slots ([`Held`]) and
//! a handle that settles its reservations ([`Settler`]).

use std::time::Duration;

use crate::limiter::{Algorithm, Verdict};
use crate::store::check::{Answer, Check, Mode, Store};
use crate::store::error::StoreError;
use crate::store::memory::{self, MemoryStore};
use crate::store::penalty_box::{Listed, Source};
use crate::store::redis::{self, RedisStore};

/// Concurrency slots a request holds until it ends: given back when
/// dropped (see `memory::Slots` and `redis::Slots`). Only a request
/// admitted under a concurrency rule holds any.
pub enum Held {
    Memory(memory::Slots),
    Redis(redis::Slots),
}

/// A handle on the store that settles reservations after the request path
/// has returned (from a response body's trailers, see [`crate::proxy::settle`]).
pub enum Settler {
    Memory(MemoryStore),
    Redis(redis::Settler),
}

impl Settler {
    /// [`AnyStore::settle`].
    pub fn settle(&self, check: &Check<'_>, delta: i64, stamp: Stamp, fallback: bool) {
        match self {
            Settler::Memory(s) => s.settle(check, delta, s.now().saturating_sub(stamp.store)),
            Settler::Redis(s) if fallback => s.settle_local(check, delta, stamp.at.elapsed()),
            Settler::Redis(s) => s.settle(check, delta, stamp.at.elapsed()),
        }
    }
}

/// When a reservation was counted (see [`AnyStore::stamp`]).
#[derive(Debug, Clone, Copy)]
pub struct Stamp {
    at: std::time::Instant,
    store: crate::limiter::Nanos,
}

/// The store the server runs with, chosen by `[store] backend`.
///
/// An enum rather than `Box<dyn Store>`: `Store::check` returns an
/// `impl Future`, and dispatching here keeps the request path free of a boxed
/// future per request.
pub enum AnyStore {
    Memory(MemoryStore),
    Redis(RedisStore),
}

impl AnyStore {
    /// The clock the store was built with: calendar rules compute their
    /// current window on it.
    pub fn clock(&self) -> &dyn crate::limiter::clock::Clock {
        match self {
            AnyStore::Memory(s) => s.clock(),
            AnyStore::Redis(s) => s.clock(),
        }
    }

    /// The `on_error = "local"` fallback: decides `checks` in this process's
    /// memory with the same rules. `None` for a store that has no fallback
    /// (the memory store never fails).
    pub fn check_local(&self, checks: &[Check<'_>], mode: Mode) -> Option<Vec<Verdict>> {
        match self {
            AnyStore::Memory(_) => None,
            AnyStore::Redis(s) => Some(s.check_local(checks, mode)),
        }
    }

    /// [`Store::check`] for a request that holds the concurrency slots it
    /// takes until it ends.
    pub async fn check_holding(&self, checks: &[Check<'_>], mode: Mode) -> (Vec<Answer>, Option<Held>) {
        match self {
            AnyStore::Memory(s) => {
                let (verdicts, held) = s.check_holding(checks, mode);
                (verdicts.into_iter().map(Ok).collect(), held.map(Held::Memory))
            }
            AnyStore::Redis(s) => {
                let (answers, held) = s.check_holding(checks, mode).await;
                (answers, held.map(Held::Redis))
            }
        }
    }

    /// [`AnyStore::check_local`] for a request that holds the concurrency
    /// slots it takes until it ends.
    pub fn check_local_holding(&self, checks: &[Check<'_>], mode: Mode) -> Option<(Vec<Verdict>, Option<Held>)> {
        match self {
            AnyStore::Memory(_) => None,
            AnyStore::Redis(s) => {
                let (verdicts, held) = s.check_local_holding(checks, mode);
                Some((verdicts, held.map(Held::Memory)))
            }
        }
    }

    /// A handle that settles from wherever a response body ends (a few
    /// reference counts).
    pub fn settler(&self) -> Settler {
        match self {
            AnyStore::Memory(s) => Settler::Memory(s.clone()),
            AnyStore::Redis(s) => Settler::Redis(s.settler()),
        }
    }

    /// When a reservation is counted, for [`AnyStore::settle`]: the
    /// memory store's own clock (a test's may stand still while real time
    /// passes) and this process's monotonic one (Redis counts on its
    /// server's clock, so only the time since matters). Taken before the
    /// check is sent, never after its answer: the store counts the
    /// reservation at or after the stamp, so a settle that misplaces it
    /// aims at an earlier window, finds another one stored and gives
    /// nothing back, instead of giving back to a window that never counted
    /// it.
    pub fn stamp(&self) -> Stamp {
        let store = match self {
            AnyStore::Memory(s) => s.now(),
            AnyStore::Redis(_) => 0,
        };
        Stamp { at: std::time::Instant::now(), store }
    }

    /// Corrects the reservation a check made at `stamp` by `delta` units
    /// (real cost minus reserved) in one atomic step: under the shard lock
    /// here, in one script call in the background for Redis (the response
    /// is not held for it). A correction Redis does not take is lost: the
    /// reservation stands. A reservation the `on_error = "local"` fallback
    /// counted (`fallback`) is corrected where it was counted, in this
    /// process's memory, never in Redis.
    pub fn settle(&self, check: &Check<'_>, delta: i64, stamp: Stamp, fallback: bool) {
        match self {
            AnyStore::Memory(s) => s.settle(check, delta, s.now().saturating_sub(stamp.store)),
            AnyStore::Redis(s) if fallback => s.settle_local(check, delta, stamp.at.elapsed()),
            AnyStore::Redis(s) => s.settle(check, delta, stamp.at.elapsed()),
        }
    }

    /// Hands back what this process holds of the shared store (leased
    /// quota, concurrency slots); the server calls it after draining.
    pub async fn close(&self) {
        if let AnyStore::Redis(s) = self {
            s.close().await;
        }
    }

    /// Which of the store's nodes answer and which do not (with why), for
    /// `/healthz/store` and `/readyz`; `None` for the memory store, which
    /// has no nodes (see [`Store::ping`]).
    pub async fn survey(&self) -> Option<(Vec<String>, Vec<(String, StoreError)>)> {
        match self {
            AnyStore::Memory(_) => None,
            AnyStore::Redis(s) => Some(s.survey().await),
        }
    }

    /// Drops idle state kept in this process; the server calls it
    /// periodically.
    pub fn sweep(&self) {
        match self {
            AnyStore::Memory(s) => {
                s.sweep();
            }
            AnyStore::Redis(s) => s.sweep(),
        }
    }
}

/// The penalty box: blocks and lifts through the admin API, and what it
/// holds. In Redis for every instance; the memory store's is this
/// process's own.
impl AnyStore {
    /// Puts `key`, a bucket key of the rule whose keys start with
    /// `rule_prefix` (and whose algorithm is `algorithm`: Redis keeps the
    /// box in the bucket), in the penalty box for `ttl`, whatever its
    /// counters say, with the operator's `reason`.
    pub async fn block(
        &self,
        rule_prefix: &str,
        key: &str,
        algorithm: Algorithm,
        ttl: Duration,
        reason: &str,
    ) -> Result<(), StoreError> {
        match self {
            AnyStore::Memory(s) => {
                let until = s.now().saturating_add(u64::try_from(ttl.as_nanos()).unwrap_or(u64::MAX));
                s.penalty_box().block(key, until, Source::Api(reason.to_string()));
                Ok(())
            }
            AnyStore::Redis(s) => s.block(rule_prefix, key, algorithm, ttl, reason).await,
        }
    }

    /// Takes `key` out of the penalty box; whether it was in.
    pub async fn unblock(&self, rule_prefix: &str, key: &str, algorithm: Algorithm) -> Result<bool, StoreError> {
        match self {
            AnyStore::Memory(s) => Ok(s.penalty_box().lift(key, s.now())),
            AnyStore::Redis(s) => s.unblock(rule_prefix, key, algorithm).await,
        }
    }

    /// The keys of the rule whose keys start with `rule_prefix` in the
    /// penalty box, those that stay longest first, at most `max`; and how
    /// many there are (with Redis, as many as its registry lists: see
    /// [`redis::MAX_LISTED`]).
    pub async fn boxed(
        &self,
        rule_prefix: &str,
        algorithm: Algorithm,
        max: usize,
    ) -> Result<(Vec<Listed>, usize), StoreError> {
        match self {
            AnyStore::Memory(s) => Ok(s.penalty_box().list(rule_prefix, s.now(), max)),
            AnyStore::Redis(s) => s.boxed(rule_prefix, algorithm, max).await,
        }
    }
}

impl Store for AnyStore {
    async fn check(&self, checks: &[Check<'_>], mode: Mode) -> Vec<Answer> {
        match self {
            AnyStore::Memory(s) => s.check(checks, mode).await,
            AnyStore::Redis(s) => s.check(checks, mode).await,
        }
    }

    async fn ping(&self) -> Result<(), StoreError> {
        match self {
            AnyStore::Memory(s) => s.ping().await,
            AnyStore::Redis(s) => s.ping().await,
        }
    }

    fn backend(&self) -> &'static str {
        match self {
            AnyStore::Memory(s) => s.backend(),
            AnyStore::Redis(s) => s.backend(),
        }
    }

    fn set_idle_horizon(&self, horizon: crate::limiter::Nanos) {
        match self {
            AnyStore::Memory(s) => s.set_idle_horizon(horizon),
            AnyStore::Redis(s) => s.set_idle_horizon(horizon),
        }
    }
}
