//! The HTTP a request arrives as and an answer leaves as: one spelling of
//! each request, who its client is, its id, and the statuses and headers
//! tollgate answers with. Imports only [`crate::limiter`] (and nothing
//! above it), so every layer can use it.

pub mod client;
pub mod error;
pub mod grpc;
pub mod headers;
pub mod identity;
pub mod normalize;
pub mod request_id;
pub mod via;
