//! The parts of a store round ([`Decider::decide`]) that need no
//! awaiting: each rule's check, the backstop on the store timeout, the
//! `on_error = "local"` fallback.

use std::time::Duration;

use super::{Decider, Pending};
use crate::config::OnError;
use crate::limiter::Verdict;
use crate::store::{Answer, Check, Held, Mode, Store, StoreError};

/// How far past the store timeout the Decider's own bound on a store
/// check lies (see [`Decider::decide`]).
const STORE_TIMEOUT_BACKSTOP: Duration = Duration::from_millis(5);

impl Decider {
    /// How long the store round may take: past the store timeout by
    /// [`STORE_TIMEOUT_BACKSTOP`].
    pub(super) fn backstop(&self) -> Duration {
        self.store_timeout + STORE_TIMEOUT_BACKSTOP
    }

    /// The answers of a round the backstop cut off: each check failed.
    pub(super) fn timed_out(&self, checks: &[Check<'_>]) -> Vec<Answer> {
        self.metrics.store_errors_total.with_label_values(&[self.store.backend()]).inc();
        checks.iter().map(|_| Err(StoreError::Timeout(self.store_timeout))).collect()
    }

    pub(super) fn check_of<'p>(&self, p: &'p Pending<'_>) -> Check<'p> {
        Check {
            key: &p.key,
            limits: p.check_limits,
            cost: p.cost,
            enforced: p.rule.enforced(),
            on_error: self.on_error_of(p.rule),
            settles: p.rule.spec.settles_from_response(),
            penalty: p.rule.spec.penalty,
        }
    }

    /// `on_error = "local"` when the store gave up on a whole request (the
    /// backstop timeout): the failed rules whose policy is `local` are
    /// decided by the store's in-process fallback, with the same limits.
    /// The store applies the fallback itself to the rules it could not
    /// decide, so this only acts when every rule failed, and not when an
    /// enforced rule says `deny` (deny wins) or the store has no fallback.
    pub(super) fn decide_locally(
        &self,
        mut answers: Vec<Answer>,
        pending: &[Pending<'_>],
        held: &mut Option<Held>,
    ) -> Vec<Answer> {
        let all_failed = answers.iter().all(Result::is_err);
        let deny = pending.iter().any(|p| p.rule.enforced() && self.on_error_of(p.rule) == OnError::Deny);
        let local: Vec<usize> =
            (0..pending.len()).filter(|&i| self.on_error_of(pending[i].rule) == OnError::Local).collect();
        if !all_failed || deny || local.is_empty() {
            return answers;
        }
        let checks: Vec<Check<'_>> = local.iter().map(|&i| self.check_of(&pending[i])).collect();
        let Some((verdicts, slots)) = self.store.check_local_holding(&checks, Mode::Consume) else { return answers };
        *held = slots;
        for (&i, v) in local.iter().zip(verdicts) {
            answers[i] = Ok(Verdict { fallback: true, ..v });
        }
        answers
    }
}
