//! Rate-limit response headers: the names as constants and the renderers.
//!
//! Two families are sent together, because clients in the wild read both:
//! the de facto `X-RateLimit-*` trio for the most restrictive rule, and the
//! IETF draft-10 `RateLimit-Policy` / `RateLimit` structured fields with one
//! item per matching rule.

use std::fmt::Write as _;

use http::header::{HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};

use crate::limiter::{Verdict, ceil_secs};
use crate::rules::Rule;

pub const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
pub const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
pub const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
pub const X_RATELIMIT_RETRY_AFTER: HeaderName = HeaderName::from_static("x-ratelimit-retry-after");
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// What one matching rule reported for this request, as the client sees it.
#[derive(Clone, Copy)]
pub struct RuleReport<'r> {
    pub rule: &'r Rule,
    /// Requests left, against the rule's nominal limit (soft and elastic
    /// headroom is not advertised).
    pub remaining: u64,
    /// Seconds until the quota is fully available again.
    pub reset_secs: u64,
}

impl<'r> RuleReport<'r> {
    /// Turns a store verdict into what the client is told. Throttling
    /// headroom above the nominal capacity is subtracted, so a soft rule
    /// shows remaining 0 at its nominal limit while it still admits.
    pub fn new(rule: &'r Rule, verdict: &Verdict, effective_capacity: u64) -> Self {
        let headroom = effective_capacity.saturating_sub(rule.nominal.capacity());
        let remaining = if verdict.allowed { verdict.remaining.saturating_sub(headroom) } else { 0 };
        RuleReport { rule, remaining, reset_secs: ceil_secs(verdict.reset_after) }
    }
}

fn number(n: u64) -> HeaderValue {
    // `itoa`-formatted digits are always a valid header value.
    HeaderValue::from(n)
}

/// Adds the rate-limit headers for `reports` (the matching enforced rules,
/// in rule order: shadow rules never show) to `headers`. `primary` is the index of the rule the `X-RateLimit-*`
/// trio describes. Nothing is added when no rule matched.
pub fn write(headers: &mut HeaderMap, reports: &[RuleReport<'_>], primary: usize) {
    let Some(p) = reports.get(primary) else { return };
    headers.insert(X_RATELIMIT_LIMIT, number(p.rule.spec.limit));
    headers.insert(X_RATELIMIT_REMAINING, number(p.remaining));
    headers.insert(X_RATELIMIT_RESET, number(p.reset_secs));

    let mut policy = String::new();
    let mut state = String::with_capacity(reports.len() * 32);
    for (i, r) in reports.iter().enumerate() {
        if i > 0 {
            policy.push_str(", ");
            state.push_str(", ");
        }
        if reports.len() > 1 {
            policy.push_str(&r.rule.policy);
        }
        // Writing to a String cannot fail.
        let _ = write!(state, "{};r={};t={}", r.rule.quoted_name, r.remaining, r.reset_secs);
    }
    // One rule, the common case: its policy value was rendered at reload.
    if let [only] = reports
        && let Some(v) = &only.rule.policy_value
    {
        headers.insert(RATELIMIT_POLICY, v.clone());
    }
    // Rule names are validated to printable ASCII without quotes or
    // backslashes (the sf-string alphabet, nothing to escape), so
    // these are valid header values; skip the header rather than panic if
    // that ever changes.
    if reports.len() > 1
        && let Ok(v) = HeaderValue::from_str(&policy)
    {
        headers.insert(RATELIMIT_POLICY, v);
    }
    if let Ok(v) = HeaderValue::from_str(&state) {
        headers.insert(RATELIMIT, v);
    }
}

/// Adds `Retry-After` and `X-RateLimit-Retry-After` (whole seconds, at least 1).
pub fn write_retry_after(headers: &mut HeaderMap, secs: u64) {
    let v = number(secs.max(1));
    headers.insert(RETRY_AFTER, v.clone());
    headers.insert(X_RATELIMIT_RETRY_AFTER, v);
}

/// The index of the most restrictive report: least remaining, first on ties.
pub fn most_restrictive(reports: &[RuleReport<'_>]) -> usize {
    reports.iter().enumerate().min_by_key(|(i, r)| (r.remaining, *i)).map_or(0, |(i, _)| i)
}
