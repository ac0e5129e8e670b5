//! Reading and validating configuration: the only module that reads files.
//!
//! Two steps, as pingora and envoy's ratelimit do it: serde reads the TOML
//! into raw structs that reject unknown keys, then `validate` turns them into
//! typed values ([`Config`], [`RuleSpec`]) and collects every problem with
//! its file:line:column. Nothing downstream ever sees an unvalidated value.
//!
//! The main file (`tollgate.toml`) is read once at start-up; the rules path
//! (one file or a directory of `*.toml`) is read at start-up and again on
//! every reload.

mod admin;
mod client;
mod count_status;
pub(crate) mod der;
mod envoy;
mod error;
pub mod key;
mod listen;
mod log;
mod machine;
mod main_file;
mod otel;
mod overrides;
pub mod pem;
mod raw;
mod routes;
mod rule;
mod rule_match;
mod rules_cache;
mod rules_file;
mod spec;
mod status_set;
mod store;
mod tls;
mod upstream;
mod upstream_tls;
mod validate;
pub mod watch;

pub use crate::wire::normalize::{EncodedSlashes, Normalization};

pub use admin::{AdminConfig, MAX_TOP_KEYS};
pub use client::ClientConfig;
pub use envoy::EnvoyMapping;
pub use error::{ConfigError, ConfigErrors};
pub use listen::Listen;
pub use log::{AccessLogTarget, LogConfig};
pub use main_file::Config;
pub use otel::{AcceptTraceparent, DEFAULT_SAMPLE_RATIO, TracingConfig};
pub use pem::{Certificate, ClientAuth};
pub use raw::Backend;
pub use routes::Route;
pub use rules_cache::RulesCache;
pub use rules_file::{
    LoadedRules, RulesFile, load_rules, load_rules_cached, parse_rules, parse_rules_file, rule_files,
    rule_files_or_empty,
};
pub use spec::{
    CalendarSpec, ClientSet, Cost, DenySpec, InvalidToken, KeyPart, MatchSpec, OnError, OverrideSpec, PathPattern,
    RuleMode, RuleSpec, Throttle, TierSource, TiersSpec,
};
pub use status_set::StatusSet;
pub use store::{StoreConfig, TlsClientFiles};
pub use upstream::{Balance, HashKey, HealthCheck, MIN_RETRY_CONCURRENCY, POOL_IDLE_TIMEOUT, Server, Upstream};
pub use upstream_tls::{Protocol, UpstreamTls};
pub use validate::{canonical_host, parse_duration, parse_net};

#[cfg(test)]
mod tests;
