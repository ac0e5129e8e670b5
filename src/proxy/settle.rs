//! `cost_response_header`: a request reserves its estimated cost when it
//! is admitted, and its response says what it really cost (LLM tokens,
//! bytes, query work), which corrects the counters: the difference is
//! given back, or charged on top even past the limit (a debt the next
//! requests wait out; see `src/limiter/reservation.rs`).
//!
//! The real cost is read from the response head when the upstream sends
//! it there, or else from the body's trailers, which only come at its end:
//! [`OnTrailers`] then rides on the response body (see [`crate::proxy::held`]).
//! A cost that never arrives (no such header or trailer, a value that is
//! not a whole number, an upstream error, a client gone before the
//! trailers) leaves the reservation as it was counted.
//!
//! `count_status` rides the same path: a request answered with a status
//! its rule does not count gives its whole reservation back, at the
//! response head (or at tollgate's own answer after admission: no route, an
//! upstream failure); one with a counted status keeps it, corrected by
//! `cost_response_header` when the rule has that too. Each reservation is
//! corrected once at most: given back, or settled from a header or
//! trailer, never both.
//!
//! Nothing here runs for a rule set without such a rule: the request path
//! looks only when [`crate::limit::rules::RuleSet::any_settles`] is set.

use std::sync::Arc;

use http::{HeaderMap, HeaderName, StatusCode};

use crate::config::{OnError, StatusSet};
use crate::limiter::Limits;
use crate::obs::metrics::Metrics;
use crate::store::{AnyStore, Check, Settler, Stamp};

/// An admitted rule whose reservation waits for its request's real cost.
pub struct Settling {
    /// Where the real cost comes: the rule's `cost_response_header`.
    pub header: Option<HeaderName>,
    /// The rule's `count_status`: the statuses that keep the reservation.
    pub count_status: Option<StatusSet>,
    pub rule: String,
    pub key: String,
    pub limits: Limits,
    pub reserved: u64,
    pub enforced: bool,
    pub on_error: OnError,
    /// Taken before the reservation was sent to be counted: a window
    /// gives back only to the window it went to, and a token bucket only
    /// what has not drained since (see [`crate::limiter::refundable`]).
    pub at: Stamp,
    /// Admitted by the `on_error = "local"` fallback: counted in this
    /// process's memory, never in the shared store, which must not be given
    /// back units it did not count (that would let the key pass its limit
    /// there). Settled in the fallback's memory instead.
    pub fallback: bool,
}

impl Settling {
    /// Corrects the reservation to the real cost `found` in a header map
    /// (the response head or its trailers). `false` when the map does not
    /// carry it.
    fn apply(&self, found: &HeaderMap, store: Target<'_>, metrics: &Metrics) -> bool {
        let Some(value) = self.header.as_ref().and_then(|h| found.get(h)) else { return false };
        let Some(real) = value.to_str().ok().and_then(|v| v.trim().parse::<u64>().ok()) else {
            // Rare: the label lookup's lock is paid only here.
            metrics.cost_settle_invalid_total.with_label_values(&[&self.rule]).inc();
            return true;
        };
        // At most one bucket of debt, whatever the upstream says.
        let real = real.min(self.limits.capacity());
        let delta = i64::try_from(real).unwrap_or(i64::MAX) - i64::try_from(self.reserved).unwrap_or(i64::MAX);
        self.correct(delta, store);
        true
    }

    /// Whether a response with `status` gives the whole reservation back:
    /// the rule has `count_status`, and it does not list the status.
    fn uncounted(&self, status: StatusCode) -> bool {
        self.count_status.is_some_and(|counted| !counted.contains(status.as_u16()))
    }

    /// Gives the whole reservation back.
    fn give_back(&self, store: Target<'_>) {
        self.correct(-i64::try_from(self.reserved).unwrap_or(i64::MAX), store);
    }

    /// Corrects the reservation by `delta` units in the store.
    fn correct(&self, delta: i64, store: Target<'_>) {
        let check = Check {
            key: &self.key,
            limits: self.limits,
            cost: self.reserved,
            enforced: self.enforced,
            on_error: self.on_error,
            settles: true,
            penalty: None,
        };
        match store {
            Target::Store(s) => s.settle(&check, delta, self.at, self.fallback),
            Target::Settler(s) => s.settle(&check, delta, self.at, self.fallback),
        }
    }
}

enum Target<'a> {
    Store(&'a AnyStore),
    Settler(&'a Settler),
}

/// Settles what the response head carries: its status (`count_status`)
/// and its headers. Answers what is left for its trailers (`None` when
/// nothing is, which is always the case once the body has ended).
pub fn at_head(
    settling: Vec<Settling>,
    status: StatusCode,
    head: &HeaderMap,
    body_ended: bool,
    store: &AnyStore,
    metrics: &Arc<Metrics>,
) -> Option<OnTrailers> {
    let left: Vec<Settling> = settling
        .into_iter()
        .filter(|s| {
            if s.uncounted(status) {
                s.give_back(Target::Store(store));
                return false;
            }
            s.header.is_some() && !s.apply(head, Target::Store(store), metrics)
        })
        .collect();
    (!left.is_empty() && !body_ended).then(|| OnTrailers { left, store: store.settler(), metrics: metrics.clone() })
}

/// Settles for an answer tollgate gave itself, with `status`, to a request
/// it had admitted (no route, an upstream failure): a `count_status`
/// reservation the status does not count is given back; a real cost
/// never came, so every other reservation stands.
pub fn own_answer(settling: Vec<Settling>, status: StatusCode, store: &AnyStore) {
    for s in settling.iter().filter(|s| s.uncounted(status)) {
        s.give_back(Target::Store(store));
    }
}

/// Reservations waiting for the response body's trailers.
pub struct OnTrailers {
    left: Vec<Settling>,
    store: Settler,
    metrics: Arc<Metrics>,
}

impl OnTrailers {
    /// Settles what the trailers carry; the rest keep their reservation.
    pub fn trailers(self, trailers: &HeaderMap) {
        for s in &self.left {
            s.apply(trailers, Target::Settler(&self.store), &self.metrics);
        }
    }
}
