//! A [`Plan`]: one set of limits a rule applies (its own, an override's, a
//! tier's, Envoy's), with the header values that say so, rendered once per
//! reload rather than per response.

use crate::config::{RuleSpec, TierSource};
use crate::limiter::{Limits, Nanos};

/// Limits a rule applies to some of its requests, with what the headers
/// say about them, rendered once per reload.
#[derive(Debug)]
pub struct Plan {
    /// The limits before soft or elastic throttling.
    pub nominal: Limits,
    /// The rule's part of `RateLimit-Policy`: `"name";q=5;w=60`.
    pub policy: String,
    /// The same as a header value, for the common one-rule response.
    pub policy_value: Option<http::HeaderValue>,
    /// The limit as the `X-RateLimit-Limit` value.
    pub limit_value: http::HeaderValue,
    /// The headers of a 429 under these limits when the rule is the
    /// request's only one; `None` for a calendar rule.
    pub reject_head: Option<crate::wire::headers::RejectHead>,
    /// Where these limits come from.
    pub source: PlanSource,
}

/// Which limits of a rule a request gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanSource {
    /// The rule's own.
    Rule,
    /// `[[rule.override]]` for this key.
    Override(String),
    /// The tier of this name.
    Tier(String),
    /// `default` of `tiers`: the request's tier is missing or not listed.
    DefaultTier,
    /// Envoy's `limit` override of a descriptor.
    Envoy,
}

impl std::fmt::Display for PlanSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PlanSource::Rule => write!(f, "the rule's own"),
            PlanSource::Override(k) => write!(f, "override {k}"),
            PlanSource::Tier(t) => write!(f, "tier {t:?}"),
            PlanSource::DefaultTier => write!(f, "tier default (no tier, or one not listed)"),
            PlanSource::Envoy => write!(f, "Envoy's limit override"),
        }
    }
}

/// A rule's overrides and tiers, looked up in one hash each.
pub(super) struct Variants {
    /// By key, without the rule's prefix (as [`crate::config::OverrideSpec`]
    /// holds it).
    pub(super) overrides: std::collections::HashMap<Box<str>, Plan, foldhash::fast::RandomState>,
    pub(super) tiers: Option<Tiers>,
}

pub(super) struct Tiers {
    pub(super) source: TierSource,
    pub(super) by_name: std::collections::HashMap<Box<[u8]>, Plan, foldhash::fast::RandomState>,
    pub(super) default: Plan,
}

/// One set of limits of a rule with its rendered header values.
pub(super) fn build_plan(
    spec: &RuleSpec,
    quoted_name: &str,
    window: Nanos,
    window_secs: u64,
    limit: u64,
    burst: u64,
    source: PlanSource,
) -> Plan {
    // A concurrency quota is not per window: the draft's quota unit
    // says what it counts instead. A quota of something else than
    // requests (tokens, bytes) says so too. A calendar window's
    // length changes from window to window: its `w` is added per
    // response (see `headers::write`).
    let unit = spec.quota_unit.as_ref().map(|u| format!(";qu=\"{u}\"")).unwrap_or_default();
    let policy = if spec.algorithm == crate::limiter::Algorithm::Concurrency {
        format!("{quoted_name};q={limit};qu=\"concurrent-requests\"")
    } else if spec.calendar.is_some() {
        format!("{quoted_name};q={limit}{unit}")
    } else {
        format!("{quoted_name};q={limit}{unit};w={window_secs}")
    };
    let policy_value = if spec.calendar.is_some() { None } else { http::HeaderValue::from_str(&policy).ok() };
    let limit_value = http::HeaderValue::from(limit);
    Plan {
        nominal: Limits { algorithm: spec.algorithm, limit, window, burst, origin: 0 },
        reject_head: crate::wire::headers::RejectHead::new(&limit_value, policy_value.as_ref()),
        policy_value,
        policy,
        limit_value,
        source,
    }
}
