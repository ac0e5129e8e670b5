//! What the [`Decider`](super::Decider) answers a caller outside the
//! request path about one rule (`/v1/check`, Envoy's `ShouldRateLimit`).

use http::HeaderMap;

use crate::limit::rules::RuleReport;
use crate::limiter::Nanos;
use crate::wire::headers;

/// One rule's decision for a caller outside the request path
/// (`/v1/check` or Envoy's `ShouldRateLimit`).
pub struct Outcome<'r> {
    pub allowed: bool,
    /// What the client is told remains (`None`: exempt, or the store
    /// failed).
    pub remaining: Option<u64>,
    /// Whole seconds until a retry can pass; 0 when allowed.
    pub retry_after: u64,
    /// Nanoseconds until the quota is whole again.
    pub reset_after: Nanos,
    /// Leaky-bucket shaping: how long the proxy would hold the request.
    pub delay: Nanos,
    /// What the proxy's rate-limit headers would say (none for shadow
    /// rules, exempt clients and store failures). Kept as a report rather
    /// than rendered, so that `ShouldRateLimit` renders one set of headers
    /// for all its descriptors, as the proxy does for all its rules.
    pub report: Option<RuleReport<'r>>,
    pub exempt: bool,
    pub store_unavailable: bool,
}

impl Outcome<'_> {
    /// The outcome of a client the rule exempts: admitted, nothing counted.
    pub fn exempt() -> Outcome<'static> {
        Outcome { exempt: true, ..Outcome::open() }
    }

    pub(super) fn open() -> Outcome<'static> {
        Outcome {
            allowed: true,
            remaining: None,
            retry_after: 0,
            reset_after: 0,
            delay: 0,
            report: None,
            exempt: false,
            store_unavailable: false,
        }
    }

    /// The rate-limit headers the proxy would send for this one rule.
    pub fn headers(&self) -> HeaderMap {
        let mut map = HeaderMap::new();
        if let Some(report) = self.report {
            headers::write(&mut map, &[report], 0);
            if !self.allowed {
                headers::write_retry_after(&mut map, self.retry_after);
            }
        }
        map
    }
}
