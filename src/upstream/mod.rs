//! One upstream's servers and the tries a request makes on them: which
//! servers are in service, when a failing one is taken out (and when it
//! may not be), retries on other servers within one deadline and a retry
//! budget, per-server limits, and what each failure is answered with.
//!
//! Servers stay in service unless they are really down, as Envoy's
//! outlier detection keeps them:
//! - a server is taken out only after `eject_after` failures in a row, and
//!   never more than `max_ejected_percent` of the servers (of the primaries,
//!   or of the backups) at once; a lone server, or the last one in, never
//!   ([`UpstreamClient::may_eject`]);
//! - when fewer servers are in than that cap allows (active health checks
//!   took them out), requests go to all of them: panic mode, because a
//!   guess that leaves some servers overloaded serves more than a refusal;
//! - backup servers take requests only while every other server is out;
//! - a failure of tollgate's own (out of file descriptors or ports) is
//!   never held against a server.
//!
//! An upstream with one server and no health check or limit takes a short
//! path ([`UpstreamClient::forward`]) with no health or balancing work.

pub mod balance;
mod choice;
mod client;
mod failure;
pub mod forward;
pub mod health;
pub mod pool;
mod tries;
pub mod tunnel;

pub use client::{ServerState, UpstreamClient};
