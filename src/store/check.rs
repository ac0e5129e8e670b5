//! What the store is asked and answers: one rule's [`Check`], its
//! [`Answer`], and the [`Store`] trait every backend implements.

use std::future::Future;

use crate::config::OnError;
use crate::limiter::{Limits, Penalty, Verdict};
use crate::store::error::StoreError;

/// One rule's question about one request.
#[derive(Debug, Clone)]
pub struct Check<'a> {
    /// The bucket: rule name and key parts, already encoded so that distinct
    /// rules or key values never collide (see `rules::key`).
    pub key: &'a str,
    /// Effective limits for this request (soft/elastic already applied).
    pub limits: Limits,
    /// Units this request takes (1 unless the rule sets `cost`/`cost_header`).
    pub cost: u64,
    /// Shadow rules are counted but cannot reject: their refusal does not
    /// stop the other rules from committing.
    pub enforced: bool,
    /// What to do when the store cannot decide this check.
    pub on_error: OnError,
    /// Whether the cost is corrected once the response tells the real one
    /// (`cost_response_header`): such a check is never answered from a
    /// lease, so that every unit it reserves and settles is counted where
    /// the other instances see it.
    pub settles: bool,
    /// The rule's `penalty`: a refusal (the `after`-th in one window)
    /// puts the key in the penalty box. Whatever this says, a key in the
    /// box (a penalty, or a block through the admin API) is refused.
    pub penalty: Option<Penalty>,
}

/// One check's answer: the verdict, or why the store could not decide it.
pub type Answer = Result<Verdict, StoreError>;

/// Whether a check may change the counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Admit and count (the request path).
    Consume,
    /// Answer what would happen without counting (`tollgate explain`).
    Peek,
}

/// A backend that keeps rate-limit counters.
pub trait Store: Send + Sync + 'static {
    /// Decides every check of one request at once, answering each in the
    /// order given.
    ///
    /// A check the store could not decide is answered with its error, after
    /// its own `on_error`: `local` ones are decided by the store's
    /// in-process fallback instead, where it has one. With
    /// [`Mode::Consume`], the request is counted (in the shared store and
    /// the fallback alike) only if no enforced check rejected it and no
    /// enforced check that failed says `deny`; otherwise nothing is counted.
    fn check(&self, checks: &[Check<'_>], mode: Mode) -> impl Future<Output = Vec<Answer>> + Send;

    /// Whether the store answers right now (for `/readyz`).
    fn ping(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The `backend` label of the store's metrics.
    fn backend(&self) -> &'static str;

    /// Told after every rules reload: the longest time an idle key must be
    /// kept before its state is equivalent to a fresh one.
    fn set_idle_horizon(&self, _horizon: crate::limiter::Nanos) {}
}
