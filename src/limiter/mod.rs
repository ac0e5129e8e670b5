//! The arithmetic of the six algorithms, as pure functions of
//! `(state, now, limits, cost)`.
//!
//! Nothing here reads a clock, takes a lock or does IO (but [`shards`], the
//! sharded map the stores keep their state in): the memory store
//! calls these under its shard lock with the time its [`Clock`] gives, and the
//! unit tests drive them with made-up timestamps. The Redis Lua scripts in
//! `src/store/lua/` implement the same arithmetic on the server, so the two
//! stores answer alike.
//!
//! Every evaluation is split in two: [`evaluate`] computes a [`Verdict`] and
//! the state the bucket would have if the request were admitted, and the
//! caller decides whether to write that state back. A request that matches
//! several rules is admitted only if all of its enforced rules admit it, and a
//! rejected request must never consume quota, so nothing is written until
//! every rule has answered.
//!
//! [`Clock`]: crate::limiter::clock::Clock
//!
//! By responsibility: `limits.rs` says what a check is counted against and
//! what it answers ([`Limits`], [`Verdict`]), `state.rs` what a key keeps
//! between checks ([`Cell`], [`Log`]), `algorithms.rs` the six algorithms'
//! arithmetic, `reservation.rs` a reservation corrected to its real cost.

mod algorithms;
pub mod calendar;
pub mod clock;
mod limits;
mod reservation;
pub mod shards;
mod state;

pub use algorithms::{CONCURRENCY_RETRY, HELD, evaluate, evaluate_log, release};
pub(crate) use algorithms::{ns_ceil, regrid, slack};
pub use limits::{Algorithm, Boxed, Limits, MAX_LIMIT, MAX_WINDOW, NANOS_PER_SEC, Nanos, Penalty, Verdict, ceil_secs};
pub use reservation::{refundable, settle, settles};
pub use state::{Cell, Log};

#[cfg(test)]
mod tests;
