//! What tollgate tells its operators: Prometheus metrics on an explicit
//! registry, the access log, and the periodic summary line.

pub mod access_log;
pub mod metrics;
pub mod summary;
pub mod trace;
