//! The compiled rule set: which rules a request matches, and the bucket key
//! each of them counts it under. Immutable and free of IO; a reload builds a
//! new [`RuleSet`] and swaps it in whole.
//!
//! Everything a rule needs per request that does not depend on the request
//! is computed here, once per reload: the encoded key prefix, the metric
//! handles, and a [`Plan`] for each set of limits the rule applies (its own,
//! each `[[rule.override]]`'s, each tier's) with its `RateLimit-Policy` item
//! and `X-RateLimit-Limit` value.
//!
//! By responsibility: [`RuleSet`] (`set.rs`) holds the rules in force and
//! finds those a request matches; each [`Rule`] (`rule.rs`) knows its
//! limits and costs, and (`request.rs`) whether a request matches it and
//! its bucket key, reading [`RequestFacts`] (`facts.rs`); a [`Plan`]
//! (`plan.rs`) is one set of limits with its rendered headers; a
//! [`RuleReport`] (`report.rs`) is what one rule tells the client.

mod facts;
mod plan;
mod report;
mod request;
mod rule;
mod set;

pub use facts::RequestFacts;
pub use plan::{Plan, PlanSource};
pub use report::RuleReport;
pub(crate) use request::form_decode;
pub use rule::{NO_UPSTREAM, Rule, whole_secs};
pub use set::RuleSet;

#[cfg(test)]
mod tests;
