//! The listeners that decide without proxying: the decision API
//! (`POST /v1/check`) and Envoy's rate limit service. Both ask the one
//! [`Decider`](crate::limit::decide::Decider) the proxy asks, so a key
//! spends the same counters whichever way it comes.

mod accept;
pub mod decision;
pub mod envoy_rls;
