//! Operating a running proxy: the admin listener (`/metrics`, `/healthz`,
//! `/readyz`, `/rules`, `/upstreams`, `/config`, `/top`, `/blocks`), its
//! dashboard page, and hot reload of the rules and the main file.

pub mod admin;
mod blocks;
pub mod dashboard;
pub mod reload;
