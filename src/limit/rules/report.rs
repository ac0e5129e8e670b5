//! What one matching rule reported for a request, as the client sees it:
//! built here from a store verdict, written by [`crate::wire::headers`] through
//! its [`Report`] trait.

use http::HeaderValue;

use super::{Plan, Rule};
use crate::limiter::{Verdict, ceil_secs};
use crate::wire::headers::Report;

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

impl Report for RuleReport<'_> {
    fn quoted_name(&self) -> &str {
        &self.rule.quoted_name
    }

    fn limit_value(&self) -> &HeaderValue {
        &self.plan.limit_value
    }

    fn policy(&self) -> &str {
        &self.plan.policy
    }

    fn policy_value(&self) -> Option<&HeaderValue> {
        self.plan.policy_value.as_ref()
    }

    fn calendar_window_secs(&self) -> Option<u64> {
        self.rule.calendar.as_ref().map(|c| c.window_secs())
    }

    fn remaining(&self) -> u64 {
        self.remaining
    }

    fn reset_secs(&self) -> u64 {
        self.reset_secs
    }
}
