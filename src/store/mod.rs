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

mod any;
mod check;
mod error;
pub mod memory;
pub mod penalty_box;
pub mod redis;

pub use any::{AnyStore, Held, Settler, Stamp};
pub use check::{Answer, Check, Mode, Store};
pub use error::StoreError;
pub use memory::MemoryStore;
pub use redis::RedisStore;
