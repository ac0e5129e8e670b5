//! Where the counters live: the [`Store`] trait and its implementations.
//!
//! The proxy asks the store once per request, for all matching rules
//! together ([`Store::check`]), and never reads and then writes: each store
//! decides and updates atomically on its side (under a shard lock in
//! [`memory`], in one Lua script per key in the Redis store). A request that
//! any enforced rule rejects consumes no quota from any rule.
//!
//! Each rule gets its own answer: when the store cannot decide one rule (a
//! Redis node down), the others' answers still stand, and the failed rule's
//! own `on_error` applies to it alone (see [`Store::check`]).
//!
//! The backend is chosen at start-up from `[store] backend`; [`AnyStore`]
//! dispatches to it without boxing a future per request.
//!
//! A concurrency rule's check takes a slot that its request holds until it
//! ends: [`AnyStore::check_holding`] answers the [`Held`] slots with the
//! verdicts, and dropping them gives the slots back, whatever ended the
//! request. A caller of [`Store::check`] has no request to hold a slot
//! for: it is given back at once.

pub mod memory;
pub mod redis;

use std::future::Future;

use crate::config::OnError;
use crate::limiter::{Limits, Verdict};

pub use memory::MemoryStore;
pub use redis::RedisStore;

/// One rule's question about one request.
#[derive(Debug, Clone)]
pub struct Check<'a> {
    /// The bucket: rule name and key parts, already encoded so that distinct
    /// rules or key values never collide (see `rules::key`).
    pub key: &'a str,
    /// Effective limits for this request (soft/elastic already applied).
    pub limits: Limits,
    /// Units this request takes (1 unless the rule sets `cost`/`cost_header`).
    pub cost: u64,
    /// Shadow rules are counted but cannot reject: their refusal does not
    /// stop the other rules from committing.
    pub enforced: bool,
    /// What to do when the store cannot decide this check.
    pub on_error: OnError,
    /// Whether the cost is corrected once the response tells the real one
    /// (`cost_response_header`): such a check is never answered from a
    /// lease, so that every unit it reserves and settles is counted where
    /// the other instances see it.
    pub settles: bool,
}

/// One check's answer: the verdict, or why the store could not decide it.
pub type Answer = Result<Verdict, StoreError>;

/// Whether a check may change the counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Admit and count (the request path).
    Consume,
    /// Answer what would happen without counting (`tollgate explain`).
    Peek,
}

/// Why a store could not answer. Mapped to the rule's `on_error` policy by
/// the proxy; never shown to clients.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("store timed out after {0:?}")]
    Timeout(std::time::Duration),
    #[error("store unavailable: {0}")]
    Unavailable(String),
    #[error("store answered an unexpected reply: {0}")]
    Protocol(String),
}

/// A backend that keeps rate-limit counters.
pub trait Store: Send + Sync + 'static {
    /// Decides every check of one request at once, answering each in the
    /// order given.
    ///
    /// A check the store could not decide is answered with its error, after
    /// its own `on_error`: `local` ones are decided by the store's
    /// in-process fallback instead, where it has one. With
    /// [`Mode::Consume`], the request is counted (in the shared store and
    /// the fallback alike) only if no enforced check rejected it and no
    /// enforced check that failed says `deny`; otherwise nothing is counted.
    fn check(&self, checks: &[Check<'_>], mode: Mode) -> impl Future<Output = Vec<Answer>> + Send;

    /// Whether the store answers right now (for `/readyz`).
    fn ping(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The `backend` label of the store's metrics.
    fn backend(&self) -> &'static str;

    /// Told after every rules reload: the longest time an idle key must be
    /// kept before its state is equivalent to a fresh one.
    fn set_idle_horizon(&self, _horizon: crate::limiter::Nanos) {}
}

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
