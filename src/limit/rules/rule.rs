//! One compiled [`Rule`]: its plans (own, overrides, tiers), the limits it
//! applies now (soft and elastic throttling, calendar windows) and what a
//! request costs under it. Whether a request matches it and its bucket key
//! are in `request.rs`.

use http::HeaderMap;

use super::facts::RequestFacts;
use super::plan::{Plan, PlanSource, Tiers, Variants, build_plan};
use crate::config::key::encode;
use crate::config::{Cost, KeyPart, RuleMode, RuleSpec, Throttle, TierSource};
use crate::limiter::{Limits, NANOS_PER_SEC, Nanos};
use crate::obs::metrics::{Metrics, RuleCounters};

/// One compiled rule.
pub struct Rule {
    /// Shared with the rules cache: see [`super::RuleSet::from_loaded_reusing`].
    pub spec: std::sync::Arc<RuleSpec>,
    /// The rule's own limits, for every request no override or tier
    /// changes.
    pub plan: Plan,
    /// Overrides and tiers; `None` for a rule without them, which then
    /// costs a request nothing more.
    pub(super) variants: Option<Box<Variants>>,
    /// The name, quoted as a structured-field string: `"name"`.
    pub quoted_name: String,
    /// The window in whole seconds (at least 1), for headers and bodies;
    /// a calendar rule's longest window (see [`Rule::window_secs_now`]).
    pub window_secs: u64,
    /// A `calendar` rule's current window; `None` for every other rule,
    /// which then never reads the clock here.
    pub calendar: Option<Box<crate::limiter::calendar::Calendar>>,
    /// The start of every key of this rule: the encoded name and a `|`.
    pub(super) key_prefix: String,
    pub counters: RuleCounters,
    /// Where `/top` counts this rule's keys; `None` with `[admin]
    /// top_keys = 0` (set by [`crate::limit::top::TopKeys::attach`]).
    pub top: Option<std::sync::Arc<crate::limit::top::RuleTop>>,
    /// What its rule set derives from it (see [`Derived`]).
    pub(super) derived: Derived,
}

/// What a rule set derives from each of its rules, worked out once, when
/// the rule is compiled: a reload keeps the rules that did not change, and
/// with them these, rather than working them out again over every rule
/// (at 10,000 rules, 5 M instructions a reload).
#[derive(Default)]
pub(super) struct Derived {
    /// The longest idle time after which a bucket of any of its plans is
    /// fresh again, doubled (soft and elastic throttling raise limit and
    /// burst together, which keeps the horizon; the 2x covers them anyway).
    pub idle_horizon: Nanos,
    pub keys_on_user: bool,
    pub needs_user: bool,
    /// It keys on the API key or `exempt` names keys.
    pub reads_api_key: bool,
    /// `match.methods` or a `method` key part.
    pub reads_method: bool,
    pub settles: bool,
    /// The headers it reads: `header:` key parts, `cost_header`, a tier
    /// header, `match.header`.
    pub headers: Vec<http::HeaderName>,
}

impl Derived {
    fn of(rule: &Rule) -> Derived {
        let spec = &rule.spec;
        let keyed = spec.key.iter().filter_map(|k| match k {
            KeyPart::Header(h) => Some(h),
            _ => None,
        });
        let cost = match &spec.cost {
            Cost::Header(h) => Some(h),
            Cost::Fixed(_) => None,
        };
        let tier = match spec.tiers.as_ref().map(|t| &t.source) {
            Some(TierSource::Header(h)) => Some(h),
            _ => None,
        };
        let mut headers: Vec<http::HeaderName> = Vec::new();
        for h in keyed.chain(cost).chain(tier).chain(spec.matcher.header.as_ref().map(|(h, _)| h)) {
            if !headers.contains(h) {
                headers.push(h.clone());
            }
        }
        Derived {
            idle_horizon: rule.plans().map(|p| p.nominal.idle_horizon().saturating_mul(2)).max().unwrap_or(0),
            keys_on_user: spec.key.contains(&KeyPart::User),
            needs_user: rule.needs_user(),
            reads_api_key: spec.key.contains(&KeyPart::ApiKey) || !spec.exempt.api_keys.is_empty(),
            reads_method: !spec.matcher.methods.is_empty() || spec.key.contains(&KeyPart::Method),
            settles: spec.settles_from_response(),
            headers,
        }
    }
}

/// The in-flight count for a decision with no upstream behind it (the
/// decision API, Envoy RLS): elastic throttling's headroom is for an
/// upstream measured idle, and there is none to measure.
pub const NO_UPSTREAM: usize = usize::MAX;

impl Rule {
    pub(super) fn build(spec: std::sync::Arc<RuleSpec>, metrics: &Metrics) -> Rule {
        let window = spec.window.as_nanos().min(u64::MAX as u128) as u64;
        let window_secs = crate::limiter::ceil_secs(window).max(1);
        let quoted_name = format!("\"{}\"", spec.name);
        let plan = |limit: u64, burst: u64, source: PlanSource| {
            build_plan(&spec, &quoted_name, window, window_secs, limit, burst, source)
        };
        let own = plan(spec.limit, spec.burst, PlanSource::Rule);
        let variants = (!spec.overrides.is_empty() || spec.tiers.is_some()).then(|| {
            let overrides = spec
                .overrides
                .iter()
                .map(|o| (o.key.as_str().into(), plan(o.limit, o.burst, PlanSource::Override(o.key.clone()))))
                .collect();
            let tiers = spec.tiers.as_ref().map(|t| Tiers {
                source: t.source.clone(),
                by_name: t
                    .tiers
                    .iter()
                    .map(|(name, limit, burst)| {
                        (name.as_bytes().into(), plan(*limit, *burst, PlanSource::Tier(name.clone())))
                    })
                    .collect(),
                default: plan(t.default.0, t.default.1, PlanSource::DefaultTier),
            });
            Box::new(Variants { overrides, tiers })
        });
        let mut key_prefix = String::with_capacity(spec.name.len() + 1);
        encode(&mut key_prefix, spec.name.as_bytes());
        key_prefix.push('|');
        let mut counters = metrics.rule_counters(&spec.name);
        if spec.penalty.is_some() {
            counters.penalties = Some(metrics.penalty_counter(&spec.name));
        }
        let calendar =
            spec.calendar.as_ref().map(|c| Box::new(crate::limiter::calendar::Calendar::new(c.period, c.zone.clone())));
        let mut rule = Rule {
            spec,
            plan: own,
            variants,
            quoted_name,
            window_secs,
            calendar,
            key_prefix,
            counters,
            top: None,
            derived: Derived::default(),
        };
        rule.derived = Derived::of(&rule);
        rule
    }

    /// The limits of Envoy's `limit` override of a descriptor:
    /// `requests_per_unit` per `unit_secs`, the rule's algorithm, and a
    /// burst in the rule's burst-to-limit ratio (as for a tier given as a
    /// number). Built per descriptor, never kept: Envoy's configuration
    /// chooses the numbers. For a calendar rule the window stays its
    /// calendar period (the caller checks that the unit is that period).
    pub fn envoy_plan(&self, requests_per_unit: u64, unit_secs: u64) -> Plan {
        let limit = requests_per_unit.min(crate::limiter::MAX_LIMIT);
        let burst = (u128::from(limit) * u128::from(self.spec.burst)).div_ceil(u128::from(self.spec.limit.max(1)));
        let burst = u64::try_from(burst).unwrap_or(u64::MAX).min(crate::limiter::MAX_LIMIT);
        let (window, window_secs) = if self.calendar.is_some() {
            (self.plan.nominal.window, self.window_secs)
        } else {
            (unit_secs.saturating_mul(NANOS_PER_SEC), unit_secs)
        };
        build_plan(&self.spec, &self.quoted_name, window, window_secs, limit, burst, PlanSource::Envoy)
    }

    /// Every set of limits the rule may apply: its own, its overrides', its
    /// tiers'.
    pub fn plans(&self) -> impl Iterator<Item = &Plan> {
        let v = self.variants.as_deref();
        let overrides = v.into_iter().flat_map(|v| v.overrides.values());
        let tiers = v.and_then(|v| v.tiers.as_ref()).into_iter().flat_map(|t| t.by_name.values().chain([&t.default]));
        std::iter::once(&self.plan).chain(overrides).chain(tiers)
    }

    /// The limits of a request whose bucket key is `key` (as
    /// [`key`](Self::key) wrote it): its key's override, else its tier's,
    /// else the rule's own. One hash lookup each, and none for a rule
    /// without overrides or tiers.
    pub fn plan_for(&self, key: &str, f: &RequestFacts<'_>) -> &Plan {
        self.plan_with(key, |source| match source {
            TierSource::Header(h) => f.headers.get(h).map(http::HeaderValue::as_bytes),
            TierSource::Claim(_) => f.tier_claim,
        })
    }

    /// [`plan_for`](Self::plan_for) for a caller that states the tier
    /// itself (`/v1/check`'s `tier`, an `[[envoy]]` `tier` entry): the
    /// key's override first, then the tier `tier` names (`None` or one not
    /// listed: `default`), else the rule's own.
    pub fn plan_stated(&self, key: &str, tier: Option<&[u8]>) -> &Plan {
        self.plan_with(key, |_| tier)
    }

    /// Whether the rule has `tiers`.
    pub fn has_tiers(&self) -> bool {
        self.spec.tiers.is_some()
    }

    /// The plan of `key`, its tier read by `tier` from where the rule's
    /// `tier` says (called only for a rule with tiers and no override for
    /// the key).
    fn plan_with<'t>(&self, key: &str, tier: impl FnOnce(&TierSource) -> Option<&'t [u8]>) -> &Plan {
        let Some(v) = self.variants.as_deref() else { return &self.plan };
        if !v.overrides.is_empty()
            && let Some(p) = key.get(self.key_prefix.len()..).and_then(|k| v.overrides.get(k))
        {
            return p;
        }
        let Some(t) = &v.tiers else { return &self.plan };
        tier(&t.source).and_then(|v| t.by_name.get(v)).unwrap_or(&t.default)
    }

    /// Whether the rule reads the user: it keys on it, or `exempt` names
    /// users.
    pub(super) fn needs_user(&self) -> bool {
        self.spec.key.contains(&KeyPart::User)
            || !self.spec.exempt.users.is_empty()
            || matches!(self.spec.tiers.as_ref().map(|t| &t.source), Some(TierSource::Claim(_)))
    }

    /// The start of every bucket key of this rule (its encoded name and
    /// `|`): what names its keys in the penalty box.
    pub fn key_prefix(&self) -> &str {
        &self.key_prefix
    }

    pub fn name(&self) -> &str {
        &self.spec.name
    }

    pub fn enforced(&self) -> bool {
        self.spec.mode == RuleMode::Enforce
    }

    /// The rule's own limits with soft or elastic throttling applied.
    /// `inflight` [`NO_UPSTREAM`] gives elastic no headroom.
    /// `inflight` is the route's upstream's in-flight count (elastic only).
    pub fn effective_limits(&self, inflight: usize) -> Limits {
        self.throttled(&self.plan, inflight)
    }

    /// The most units one decision under `plan` can ever admit at once,
    /// with no upstream behind it ([`NO_UPSTREAM`]).
    pub fn capacity_of(&self, plan: &Plan) -> u64 {
        self.throttled(plan, NO_UPSTREAM).capacity()
    }

    /// `plan`'s limits (one of this rule's) with soft or elastic throttling
    /// applied, and for a calendar rule the current calendar window.
    /// `clock` is read for calendar rules only (the store's clock, so the
    /// memory store counts in the window computed here).
    pub fn limits_of(&self, plan: &Plan, inflight: usize, clock: &dyn crate::limiter::clock::Clock) -> Limits {
        self.in_calendar(self.throttled(plan, inflight), clock)
    }

    /// `limits` in the current calendar window, for a calendar rule.
    pub fn in_calendar(&self, limits: Limits, clock: &dyn crate::limiter::clock::Clock) -> Limits {
        match &self.calendar {
            None => limits,
            Some(c) => {
                let w = c.window(clock.now());
                Limits { origin: w.start, window: w.len(), ..limits }
            }
        }
    }

    /// The length of the window requests are counted in now, in whole
    /// seconds: a calendar rule's current window, else `window`.
    pub fn window_secs_now(&self) -> u64 {
        self.calendar.as_ref().map_or(self.window_secs, |c| c.window_secs())
    }

    fn throttled(&self, plan: &Plan, inflight: usize) -> Limits {
        let percent = match self.spec.throttle {
            Throttle::Hard => 0,
            Throttle::Soft { percent } => percent,
            Throttle::Elastic { percent, inflight_below } => {
                if inflight < inflight_below as usize {
                    percent
                } else {
                    0
                }
            }
        };
        if percent == 0 {
            return plan.nominal;
        }
        // Headroom is rounded up: 10 % of 5 is one more request, not none.
        // Capped where every store still counts exactly.
        let scale = |n: u64| {
            let extra = n.saturating_mul(u64::from(percent)).div_ceil(100);
            n.saturating_add(extra).min(crate::limiter::MAX_LIMIT)
        };
        Limits { limit: scale(plan.nominal.limit), burst: scale(plan.nominal.burst), ..plan.nominal }
    }

    /// The cost of a request: the fixed cost, or the `cost_header` value
    /// (absent: 1, at most `max_cost`). `Err` carries the sentence for the
    /// 400 answer.
    pub fn cost(&self, headers: &HeaderMap) -> Result<u64, String> {
        match &self.spec.cost {
            Cost::Fixed(n) => Ok(*n),
            Cost::Header(name) => {
                let Some(raw) = headers.get(name) else { return Ok(1) };
                let capacity = self.spec.max_cost;
                let parsed = raw.to_str().ok().map(str::trim).and_then(|s| {
                    // Digits only: no sign, no exponent, no wrap-around.
                    if s.is_empty() || s.len() > 12 || !s.bytes().all(|b| b.is_ascii_digit()) {
                        None
                    } else {
                        s.parse::<u64>().ok()
                    }
                });
                match parsed {
                    Some(n) if (1..=capacity).contains(&n) => Ok(n),
                    _ => Err(format!("header {name} must be a whole number from 1 to {capacity}")),
                }
            }
        }
    }
}

/// Window length in nanoseconds as whole seconds, at least 1.
pub fn whole_secs(ns: Nanos) -> u64 {
    ns.div_ceil(NANOS_PER_SEC).max(1)
}
