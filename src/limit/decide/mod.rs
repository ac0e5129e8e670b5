//! The one place where a request's facts become verdicts: the proxy
//! ([`Decider::prepare`], then [`Decider::decide`]), the decision API and
//! Envoy RLS ([`Decider::decide_one`]) all ask the [`Decider`], so that
//! they spend the same counters the same way: one store round for all the
//! rules a request matches, bounded by the store timeout, the `on_error`
//! fallback, then each rule's answer read once (its metrics, its report
//! for the rate-limit headers, which rule rejects).
//!
//! `prepare` (deny list, keys, costs, limits) is apart from `decide` (the
//! store round) so that the proxy awaits the store's future one layer
//! deep, as it did before there was a Decider: a future nested in another
//! is copied into it, and this one is on every request.
//!
//! It knows rules, keys and the store, not HTTP: what a verdict looks like
//! on the wire is the caller's (the proxy's 429 and headers, the API's
//! JSON, Envoy's descriptor statuses).

use std::sync::Arc;

use parking_lot::Mutex;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;

use crate::config::{Config, InvalidToken, KeyPart, Normalization, OnError};
use crate::limit::rules::RuleReport;
use crate::limit::rules::{Plan, RequestFacts, Rule, RuleSet};
use crate::limit::top::TopKeys;
use crate::limiter::{Boxed, Limits, Nanos, Verdict, ceil_secs};
use crate::obs::metrics::Metrics;
use crate::store::{Answer, AnyStore, Check, Held, Mode, Stamp, Store};
use crate::wire::error::ProxyError;
use crate::wire::headers;

mod outcome;
mod round;

/// A request's rules, checks or reports: nearly every request matches one
/// rule, kept inline instead of in an allocation of its own.
pub type PerRule<T> = smallvec::SmallVec<[T; 1]>;

pub use outcome::Outcome;

/// The rules in force, the store, and what reading a verdict needs: shared
/// by the proxy and the listeners that decide without proxying.
pub struct Decider {
    rules: ArcSwap<RuleSet>,
    store: AnyStore,
    /// The longest idle horizon of limits no rule states (Envoy's
    /// per-descriptor overrides), kept across reloads: the store's horizon
    /// is the larger of it and the rules'. The lock orders a reload's
    /// update of the store's horizon with [`Decider::cover_idle_horizon`]'s.
    extra_idle_horizon: Mutex<Nanos>,
    metrics: Arc<Metrics>,
    store_timeout: Duration,
    default_on_error: OnError,
    /// The `/top` sketches; `None` with `[admin] top_keys = 0`.
    top: Option<TopKeys>,
    /// `[client] ipv6_prefix` and `[listen]` normalisation: how the
    /// decision API keys an `ip` and a `path` the way the proxy does.
    ipv6_prefix: u8,
    normalization: Normalization,
}

/// One matching rule while a request is being decided.
pub struct Pending<'r> {
    pub rule: &'r Rule,
    /// The rule's limits for this request (its own, an override's or a
    /// tier's).
    pub plan: &'r Plan,
    pub key: String,
    pub check_limits: Limits,
    pub cost: u64,
}

/// What the proxy knows of a request besides its facts.
pub struct Asked {
    /// Requests in flight to the route's upstream (elastic throttling).
    pub inflight: usize,
    /// Why the request's JWT failed verification, if it did.
    pub invalid_token: Option<&'static str>,
}

/// What the answers of one store round say, all rules together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ruling {
    /// No enforced rule refuses: forward, after `delay` nanoseconds of
    /// leaky-bucket shaping.
    Admitted { delay: Nanos },
    /// An enforced rule that answered refuses (whatever the others' store
    /// errors): the one of `pending[rule]`, whose report is
    /// `reports[report]`, with the longest wait of them all.
    Limited { rule: usize, report: usize, retry_after_secs: u64 },
    /// The store failed for an enforced rule whose `on_error` is `deny`.
    Unavailable,
}

/// A request's matching rules, their answers from one store round, and
/// what those say.
pub struct Decision<'r> {
    pub pending: PerRule<Pending<'r>>,
    /// One per pending rule, in order.
    pub answers: Vec<Answer>,
    /// What the client is told, one per enforced rule that answered (shadow
    /// rules are counted and measured, never shown).
    pub reports: PerRule<RuleReport<'r>>,
    pub ruling: Ruling,
    /// When the reservations of rules that settle were sent (`None` when
    /// no matching rule settles).
    pub stamp: Option<Stamp>,
    /// Whether the answers count in `/top` (a proxied request's do).
    top: bool,
}

impl Default for Decision<'_> {
    fn default() -> Self {
        Decision::new()
    }
}

impl<'r> Decision<'r> {
    /// A decision yet to be made: no rules, admitted.
    pub fn new() -> Decision<'r> {
        Decision {
            pending: PerRule::new(),
            answers: Vec::new(),
            reports: PerRule::new(),
            ruling: Ruling::Admitted { delay: 0 },
            stamp: None,
            top: false,
        }
    }

    /// The names of every enforced rule the request is over.
    pub fn violated(&self) -> impl Iterator<Item = &'r str> + '_ {
        self.pending
            .iter()
            .zip(&self.answers)
            .filter(|(p, a)| p.rule.enforced() && matches!(a, Ok(v) if !v.allowed))
            .map(|(p, _)| p.rule.name())
    }

    /// The rule the access log names: the one that refuses, else the
    /// most restrictive one shown.
    pub fn rule_to_note(&self) -> Option<&'r str> {
        match self.ruling {
            Ruling::Limited { rule, .. } => Some(self.pending[rule].rule.name()),
            _ if self.reports.is_empty() => None,
            _ => Some(self.reports[headers::most_restrictive(&self.reports)].rule.name()),
        }
    }
}

impl Decider {
    /// The Decider for `config` with `rules` in force; `top` counts their
    /// keys for `/top` (`None`: `[admin] top_keys = 0`).
    pub fn new(
        config: &Config,
        mut rules: RuleSet,
        store: AnyStore,
        metrics: Arc<Metrics>,
        top: Option<TopKeys>,
    ) -> Decider {
        if let Some(t) = &top {
            t.attach(&mut rules);
        }
        store.set_idle_horizon(rules.idle_horizon);
        metrics.rules_active.set(rules.rules.len() as i64);
        // At zero from the start, like every counter whose labels are known.
        metrics.store_errors_total.with_label_values(&[store.backend()]);
        Decider {
            rules: ArcSwap::from_pointee(rules),
            store,
            extra_idle_horizon: Mutex::new(0),
            metrics,
            store_timeout: config.store.timeout,
            default_on_error: config.store.on_error,
            top,
            ipv6_prefix: config.client.ipv6_prefix,
            normalization: config.listen.normalization,
        }
    }

    /// The rules in force.
    pub fn rules(&self) -> &ArcSwap<RuleSet> {
        &self.rules
    }

    pub fn store(&self) -> &AnyStore {
        &self.store
    }

    /// The `/top` sketches, unless `[admin] top_keys = 0`.
    pub fn top(&self) -> Option<&TopKeys> {
        self.top.as_ref()
    }

    /// `[store] on_error`: what rules without their own policy do when the
    /// store fails.
    pub fn default_on_error(&self) -> OnError {
        self.default_on_error
    }

    /// The `on_error` policy of `rule`.
    pub fn on_error_of(&self, rule: &Rule) -> OnError {
        rule.spec.on_error.unwrap_or(self.default_on_error)
    }

    /// `[client] ipv6_prefix`: an IPv6 client is keyed by its prefix.
    pub fn ipv6_prefix(&self) -> u8 {
        self.ipv6_prefix
    }

    /// `[listen]` path normalisation, for paths given to the decision API.
    pub fn normalization(&self) -> &Normalization {
        &self.normalization
    }

    /// Puts a new rule set in force. Existing buckets keep their counts: the
    /// store is keyed by rule name and key, not by rule set.
    /// Returns the rules replaced, for the caller to free off the runtime
    /// (thousands of rules take milliseconds to drop).
    pub fn swap_rules(&self, mut rules: RuleSet) -> Arc<RuleSet> {
        if let Some(t) = &self.top {
            let old = self.rules.load();
            // Every name where it was: the rules kept have their sketches,
            // and no rule's sketches go.
            if rules.same_names(&old) {
                t.attach_fresh(&mut rules);
            } else {
                t.attach(&mut rules);
            }
        }
        let extra = self.extra_idle_horizon.lock();
        self.store.set_idle_horizon(rules.idle_horizon.max(*extra));
        self.metrics.rules_active.set(rules.rules.len() as i64);
        self.rules.swap(Arc::new(rules))
    }

    /// Keeps the store from forgetting keys checked under `limits`, which
    /// no rule states (Envoy's overrides), before they are fresh again: the
    /// store forgets a key idle for longer than the rules' longest idle
    /// horizon, which a longer override would outlast. The horizon only
    /// grows (to twice a year at most: Envoy's longest unit); the store is
    /// told only when it does.
    pub fn cover_idle_horizon(&self, limits: &Limits) {
        let h = limits.idle_horizon().saturating_mul(2);
        let mut extra = self.extra_idle_horizon.lock();
        if h > *extra {
            *extra = h;
            self.store.set_idle_horizon(self.rules.load().idle_horizon.max(h));
        }
    }

    /// The first half of a proxied request's decision, before any IO: the
    /// deny list, then each matching rule's key, cost and limits, into
    /// `d`. `Err` for a request refused before the store is asked (403 for
    /// the deny list, 401 for a bad token a rule needs, 400 for a bad cost
    /// or key). A request prepared here counts in `/top`.
    pub fn prepare<'r>(
        &self,
        rules: &'r RuleSet,
        facts: &RequestFacts<'_>,
        asked: Asked,
        d: &mut Decision<'r>,
    ) -> Result<(), ProxyError> {
        if let Some(deny) = rules.denied(facts) {
            tracing::debug!(deny = %deny.name, client = %facts.client_ip, "denied");
            return Err(ProxyError::Forbidden);
        }
        d.pending = self.pending(rules, facts, asked)?;
        d.top = self.top.is_some();
        // Stamped before the check is sent: a reservation is counted at or
        // after its stamp, so a settle that aims at the stamp's window
        // misses (gives nothing back) rather than reaching a window that
        // never counted it. (No clock read for a request none of whose
        // rules settle.)
        let settles = rules.any_settles && d.pending.iter().any(|p| p.rule.spec.settles_from_response());
        d.stamp = settles.then(|| self.store.stamp());
        Ok(())
    }

    /// The second half: one store round trip for all of `d`'s rules,
    /// bounded by the store timeout, then the `on_error = "local"`
    /// fallback, and the answers read. Each rule gets its own answer; the
    /// concurrency slots an admitted request takes go to `held`.
    ///
    /// The store's future is awaited here and nowhere deeper, so that it
    /// is built in place in the request's future rather than copied into
    /// one more layer of it.
    pub async fn decide(&self, d: &mut Decision<'_>, held: &mut Option<Held>) {
        if d.pending.is_empty() {
            return;
        }
        let checks: PerRule<Check<'_>> = d.pending.iter().map(|p| self.check_of(p)).collect();
        let started = Instant::now();
        let answers = match &self.store {
            // The memory store answers synchronously: no timer needed.
            AnyStore::Memory(m) => {
                let (verdicts, slots) = m.check_holding(&checks, Mode::Consume);
                *held = slots.map(Held::Memory);
                verdicts.into_iter().map(Ok).collect()
            }
            // The Redis store bounds each of its calls by the store timeout
            // itself, with fred's timer, which also keeps a timed-out check
            // from being sent later; this outer bound is only a backstop and
            // must not fire first.
            other => match tokio::time::timeout(self.backstop(), other.check_holding(&checks, Mode::Consume)).await {
                Ok((answers, slots)) => {
                    *held = slots;
                    answers
                }
                // Slots taken by a check this cuts off are never renewed:
                // they expire within their TTL.
                Err(_) => self.timed_out(&checks),
            },
        };
        self.metrics.store_duration_seconds.observe(started.elapsed().as_secs_f64());
        drop(checks);
        d.answers = self.decide_locally(answers, &d.pending, held);
        if d.top {
            self.record_top(d);
        }
        self.read(d);
    }

    /// Each matching rule's bucket key, cost and limits for this request.
    fn pending<'r>(
        &self,
        rules: &'r RuleSet,
        facts: &RequestFacts<'_>,
        asked: Asked,
    ) -> Result<PerRule<Pending<'r>>, ProxyError> {
        let mut pending: PerRule<Pending<'r>> = PerRule::new();
        for rule in rules.matching(facts) {
            if let Some(reason) = asked.invalid_token
                && rule.spec.on_invalid_token == InvalidToken::Reject
                && rule.spec.key.contains(&KeyPart::User)
            {
                return Err(ProxyError::Unauthorized(reason));
            }
            let cost = rule.cost(facts.headers).map_err(ProxyError::BadRequest)?;
            let mut key = String::with_capacity(64);
            rule.key(facts, &mut key).map_err(ProxyError::BadRequest)?;
            let plan = rule.plan_for(&key, facts);
            let check_limits = rule.limits_of(plan, asked.inflight, self.store.clock());
            pending.push(Pending { rule, plan, key, check_limits, cost });
        }
        Ok(pending)
    }

    /// One rule's decision for a caller outside the request path: the
    /// same store round, store timeout, `on_error` fallback and metrics as
    /// a proxied request, so both spend one counter. Checked against
    /// `rule`'s limits under `plan` with no upstream behind (soft
    /// throttling applied; elastic none: there is no upstream whose
    /// in-flight count could show it idle). Not for concurrency rules: a
    /// slot taken here would be given back at once.
    pub async fn decide_one<'r>(&self, rule: &'r Rule, plan: &'r Plan, key: String, cost: u64) -> Outcome<'r> {
        let check_limits = rule.limits_of(plan, crate::limit::rules::NO_UPSTREAM, self.store.clock());
        let mut d = Decision::new();
        d.pending.push(Pending { rule, plan, key, check_limits, cost });
        // A check holds no slot (concurrency rules are refused before).
        self.decide(&mut d, &mut None).await;
        let Some(Ok(verdict)) = d.answers.first() else {
            // `allow` and `local` (when even the local fallback could not
            // answer) admit; `deny` refuses, as the proxy's 503 does.
            let allowed = d.ruling != Ruling::Unavailable;
            let retry_after = if allowed { 0 } else { 1 };
            return Outcome { allowed, retry_after, store_unavailable: true, ..Outcome::open() };
        };
        let mut o = Outcome { reset_after: verdict.reset_after, ..Outcome::open() };
        match (d.reports.first(), d.ruling) {
            (Some(report), ruling) => {
                o.allowed = verdict.allowed;
                o.remaining = Some(report.remaining);
                o.report = Some(*report);
                match ruling {
                    Ruling::Admitted { delay } => o.delay = delay,
                    Ruling::Limited { retry_after_secs, .. } => o.retry_after = retry_after_secs,
                    Ruling::Unavailable => {}
                }
            }
            // A shadow rule: measured, never enforced nor shown.
            (None, _) => o.remaining = Some(verdict.remaining),
        }
        o
    }

    /// Counts each answer in the `/top` sketches.
    fn record_top(&self, d: &Decision<'_>) {
        let Some(period) = self.top.as_ref().map(TopKeys::period_now) else { return };
        for (p, answer) in d.pending.iter().zip(&d.answers) {
            if let Some(top) = &p.rule.top {
                top.record(period, &p.key, matches!(answer, Ok(v) if !v.allowed));
            }
        }
    }

    /// Reads each rule's own answer: a verdict, or its store error and its
    /// own `on_error`. A rule that answered and rejects decides (429)
    /// whatever the others' errors; then a failed enforced rule that says
    /// `deny` (503); failed `allow` rules are open and report nothing.
    fn read(&self, d: &mut Decision<'_>) {
        let mut rejected: Option<(usize, usize, u64)> = None;
        let (mut denied, mut failed, mut delay) = (false, None, 0);
        for (i, (p, answer)) in d.pending.iter().zip(&d.answers).enumerate() {
            let v = match answer {
                Ok(v) => v,
                Err(e) => {
                    failed = Some(e);
                    denied |= p.rule.enforced() && self.on_error_of(p.rule) == OnError::Deny;
                    continue;
                }
            };
            if p.rule.enforced() {
                d.reports.push(RuleReport::of(p.rule, p.plan, v, p.check_limits.capacity()));
            }
            if v.allowed {
                p.rule.counters.allowed.inc();
                if p.rule.enforced() {
                    delay = delay.max(v.delay);
                }
            } else if p.rule.enforced() {
                p.rule.counters.limited.inc();
                if v.boxed == Boxed::Entered {
                    penalized(p);
                }
                let secs = ceil_secs(v.retry_after).max(1);
                if rejected.is_none_or(|(_, _, s)| secs > s) {
                    rejected = Some((i, d.reports.len() - 1, secs));
                }
            } else {
                p.rule.counters.shadow_limited.inc();
            }
        }
        if let Some(e) = failed {
            // Counted in `tollgate_store_errors_total` by the store (or by
            // `decide`'s backstop).
            tracing::debug!(error = %e, "store check failed");
        }
        d.ruling = match rejected {
            Some((rule, report, retry_after_secs)) => {
                unspend(d);
                Ruling::Limited { rule, report, retry_after_secs }
            }
            None if denied => Ruling::Unavailable,
            None => Ruling::Admitted { delay },
        };
    }
}

/// A key a rule's `penalty` just put in the penalty box: counted, and
/// logged (a rare event, and one an operator may be asked about).
fn penalized(p: &Pending<'_>) {
    if let Some(c) = &p.rule.counters.penalties {
        c.inc();
    }
    let secs = p.rule.spec.penalty.map_or(0, |pen| ceil_secs(pen.duration));
    tracing::info!(rule = %p.rule.name(), key = %p.key, penalty_secs = secs, "key put in the penalty box");
}

/// The store counted nothing for a rejected request: rules that would have
/// admitted it still have its cost left, not what would remain after it.
fn unspend(d: &mut Decision<'_>) {
    let mut at = 0;
    for (p, answer) in d.pending.iter().zip(&d.answers) {
        let Ok(v) = answer else { continue };
        if !p.rule.enforced() {
            continue;
        }
        if v.allowed {
            let unspent = Verdict { remaining: v.remaining + p.cost, ..*v };
            d.reports[at] = RuleReport::of(p.rule, p.plan, &unspent, p.check_limits.capacity());
        }
        at += 1;
    }
}
