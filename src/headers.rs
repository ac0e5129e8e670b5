//! Rate-limit response headers: the names as constants and the renderers.
//!
//! Two families are sent together, because clients in the wild read both:
//! the de facto `X-RateLimit-*` trio for the most restrictive rule, and the
//! IETF draft-10 `RateLimit-Policy` / `RateLimit` structured fields with one
//! item per matching rule.

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};

use crate::limiter::{Verdict, ceil_secs};
use crate::rules::{Plan, Rule};

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
    /// The limits the request was checked against: the rule's own, an
    /// override's or a tier's.
    pub plan: &'r Plan,
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
        RuleReport::of(rule, &rule.plan, verdict, effective_capacity)
    }

    /// [`new`](Self::new) for a request checked against `plan`, one of
    /// the rule's.
    pub fn of(rule: &'r Rule, plan: &'r Plan, verdict: &Verdict, effective_capacity: u64) -> Self {
        let headroom = effective_capacity.saturating_sub(plan.nominal.capacity());
        let remaining = if verdict.allowed { verdict.remaining.saturating_sub(headroom) } else { 0 };
        RuleReport { rule, plan, remaining, reset_secs: ceil_secs(verdict.reset_after) }
    }
}

fn number(n: u64) -> HeaderValue {
    // Digits are always a valid header value. Copied from the stack:
    // `HeaderValue::from(u64)` grows a `BytesMut` for them, which costs
    // more than the digits do.
    HeaderValue::from_bytes(itoa::Buffer::new().format(n).as_bytes()).unwrap_or(HeaderValue::from_static("0"))
}

/// A header value that is a whole number.
fn parse_u64(v: &HeaderValue) -> Option<u64> {
    std::str::from_utf8(v.as_bytes()).ok()?.trim().parse().ok()
}

/// How many decimal digits `n` takes.
fn digits(n: u64) -> usize {
    n.checked_ilog10().map_or(1, |d| d as usize + 1)
}

/// Adds the rate-limit headers for `reports` (the matching enforced rules,
/// in rule order: shadow rules never show) to `headers`. `primary` is the
/// index of the rule the `X-RateLimit-*` trio describes. Nothing is added
/// when no rule matched.
///
/// An upstream's own rate-limit headers are kept, never made more
/// permissive (the IETF draft's rule for intermediaries): `RateLimit` and
/// `RateLimit-Policy` get tollgate's items as further field lines (a list
/// split over lines is one list), and an `X-RateLimit-*` trio whose
/// remaining is lower than tollgate's stays as the upstream sent it. With no
/// upstream headers (the common case) this costs nothing more than writing
/// tollgate's own.
pub fn write(headers: &mut HeaderMap, reports: &[RuleReport<'_>], primary: usize) {
    let Some(p) = reports.get(primary) else { return };
    match headers.insert(X_RATELIMIT_REMAINING, number(p.remaining)) {
        Some(theirs) if parse_u64(&theirs).is_some_and(|t| t < p.remaining) => {
            headers.insert(X_RATELIMIT_REMAINING, theirs);
        }
        _ => {
            headers.insert(X_RATELIMIT_LIMIT, p.plan.limit_value.clone());
            headers.insert(X_RATELIMIT_RESET, number(p.reset_secs));
        }
    }

    // `RateLimit` is written on every response: into a buffer of its exact
    // length, which then becomes the header value without another copy.
    let len = reports
        .iter()
        .map(|r| r.rule.quoted_name.len() + 6 + digits(r.remaining) + digits(r.reset_secs))
        .sum::<usize>()
        + 2 * (reports.len() - 1);
    let mut state = Vec::with_capacity(len);
    let mut policy = String::new();
    let mut buffer = itoa::Buffer::new();
    for (i, r) in reports.iter().enumerate() {
        if i > 0 {
            policy.push_str(", ");
            state.extend_from_slice(b", ");
        }
        if reports.len() > 1 || r.plan.policy_value.is_none() {
            policy.push_str(&r.plan.policy);
            if let Some(c) = &r.rule.calendar {
                // The current calendar window's length.
                policy.push_str(";w=");
                policy.push_str(buffer.format(c.window_secs()));
            }
        }
        state.extend_from_slice(r.rule.quoted_name.as_bytes());
        state.extend_from_slice(b";r=");
        state.extend_from_slice(buffer.format(r.remaining).as_bytes());
        state.extend_from_slice(b";t=");
        state.extend_from_slice(buffer.format(r.reset_secs).as_bytes());
    }
    // One rule, the common case: its policy value was rendered at reload.
    if let [only] = reports
        && let Some(v) = &only.plan.policy_value
    {
        headers.append(RATELIMIT_POLICY, v.clone());
    }
    // Rule names are validated to printable ASCII without quotes or
    // backslashes (the sf-string alphabet, nothing to escape), so
    // these are valid header values; skip the header rather than panic if
    // that ever changes.
    if !policy.is_empty()
        && let Ok(v) = HeaderValue::from_str(&policy)
    {
        headers.append(RATELIMIT_POLICY, v);
    }
    if let Ok(v) = HeaderValue::from_maybe_shared(Bytes::from(state)) {
        headers.append(RATELIMIT, v);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digits_counts_what_itoa_writes() {
        for n in [0, 1, 9, 10, 99, 100, 999_999, 1_000_000, u64::MAX] {
            assert_eq!(digits(n), itoa::Buffer::new().format(n).len(), "{n}");
        }
        assert_eq!(number(1_000_000_000), "1000000000");
    }
}
