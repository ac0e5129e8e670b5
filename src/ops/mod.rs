//! Operating a running proxy: the admin listener (`/metrics`, `/healthz`,
//! `/readyz`, `/rules`, `/config`, `/top`, `/blocks`) and hot reload of the rules and
//! the main file.

pub mod admin;
mod blocks;
pub mod reload;
