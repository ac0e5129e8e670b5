//! The compiled rule set: which rules a request matches, and the bucket key
//! each of them counts it under. Immutable and free of IO; a reload builds a
//! new [`RuleSet`] and swaps it in whole.
//!
//! Everything a rule needs per request that does not depend on the request
//! is computed here, once per reload: the encoded key prefix, the metric
//! handles, and a [`Plan`] for each set of limits the rule applies (its own,
//! each `[[rule.override]]`'s, each tier's) with its `RateLimit-Policy` item
//! and `X-RateLimit-Limit` value.

mod report;

pub use report::RuleReport;

use std::fmt::Write as _;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::SystemTime;

use http::{HeaderMap, Method};

use crate::config::key::{encode, push_sha256_hex, tag};
use crate::config::{
    Cost, DenySpec, EnvoyMapping, KeyPart, LoadedRules, PathPattern, RuleMode, RuleSpec, Throttle, TierSource,
};
use crate::limit::path_index::PathIndex;
use crate::limiter::{Limits, NANOS_PER_SEC, Nanos};
use crate::obs::metrics::{Metrics, RuleCounters};

/// The rules in force.
pub struct RuleSet {
    pub rules: Vec<Rule>,
    /// `[[deny]]` entries: answered 403 before any rule counts.
    pub denies: Vec<DenySpec>,
    /// Whether any rule keys on `user`.
    pub keys_on_user: bool,
    /// The JWT claim tiers are read from, when a rule says `claim:NAME`
    /// (validation allows one such claim per rule set).
    pub tier_claim: Option<String>,
    /// Every header some rule reads (`match.header`, `header:` key parts,
    /// `cost_header`): a request carrying one of them twice is refused,
    /// since the upstream may read another of its values than tollgate.
    pub read_headers: Vec<http::HeaderName>,
    /// Whether any rule settles its cost from the response
    /// (`cost_response_header`): only then does the request path look.
    pub any_settles: bool,
    /// Whether any rule reads the method (`match.methods` or a `method`
    /// key part), and so its method-override headers (see
    /// [`crate::wire::normalize::METHOD_OVERRIDES`]).
    pub reads_method: bool,
    /// Whether the user matters to any rule or `[[deny]]` entry (a rule
    /// keys on it or reads a tier claim of its token, or a deny or `exempt`
    /// list names users); see
    /// [`RuleSet::needs_user`].
    pub any_needs_user: bool,
    /// Whether a `[[deny]]` entry names users.
    denies_name_users: bool,
    /// Whether any rule or `[[deny]]` entry reads the API key (a rule keys
    /// on it, or a deny or `exempt` list names keys): without one, a
    /// request's API key header is not looked up.
    pub any_reads_api_key: bool,
    /// `[[envoy]]`: Envoy rate limit descriptors mapped to rules.
    pub envoy: Vec<EnvoyMapping>,
    /// The files they were read from.
    pub files: Vec<PathBuf>,
    pub loaded_at: SystemTime,
    /// The longest idle time after which any rule's bucket is fresh again.
    pub idle_horizon: Nanos,
    /// The rules by their `match.path`: a request looks only at those
    /// that can match its path.
    paths: PathIndex,
}

/// One compiled rule.
pub struct Rule {
    pub spec: RuleSpec,
    /// The rule's own limits, for every request no override or tier
    /// changes.
    pub plan: Plan,
    /// Overrides and tiers; `None` for a rule without them, which then
    /// costs a request nothing more.
    variants: Option<Box<Variants>>,
    /// The name, quoted as a structured-field string: `"name"`.
    pub quoted_name: String,
    /// The window in whole seconds (at least 1), for headers and bodies;
    /// a calendar rule's longest window (see [`Rule::window_secs_now`]).
    pub window_secs: u64,
    /// A `calendar` rule's current window; `None` for every other rule,
    /// which then never reads the clock here.
    pub calendar: Option<Box<crate::limiter::calendar::Calendar>>,
    /// The start of every key of this rule: the encoded name and a `|`.
    key_prefix: String,
    pub counters: RuleCounters,
    /// Where `/top` counts this rule's keys; `None` with `[admin]
    /// top_keys = 0` (set by [`crate::limit::top::TopKeys::attach`]).
    pub top: Option<std::sync::Arc<crate::limit::top::RuleTop>>,
}

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
struct Variants {
    /// By key, without the rule's prefix (as [`crate::config::OverrideSpec`]
    /// holds it).
    overrides: std::collections::HashMap<Box<str>, Plan, foldhash::fast::RandomState>,
    tiers: Option<Tiers>,
}

struct Tiers {
    source: TierSource,
    by_name: std::collections::HashMap<Box<[u8]>, Plan, foldhash::fast::RandomState>,
    default: Plan,
}

/// What the matcher needs to know about a request.
pub struct RequestFacts<'a> {
    pub method: &'a Method,
    /// The canonical path ([`crate::wire::normalize::path`]).
    pub path: &'a str,
    pub query: Option<&'a str>,
    /// Lower-cased, without a port.
    pub host: Option<&'a str>,
    /// The name of the route the request takes, and its upstream's name.
    pub route: Option<(&'a str, &'a str)>,
    pub headers: &'a HeaderMap,
    /// The client address as keyed (an IPv6 client already reduced to its
    /// prefix).
    pub client: IpAddr,
    /// The full client address (for `exempt` and `[[deny]]` CIDRs).
    pub client_ip: IpAddr,
    /// Who the user is: the verified JWT claim when `[client] jwt` is set,
    /// else the user header's value; `None` when the request has neither.
    pub user: Option<&'a [u8]>,
    /// The API key header's value.
    pub api_key: Option<&'a [u8]>,
    /// The verified JWT's tier claim ([`RuleSet::tier_claim`]), if the
    /// request needed it and has it.
    pub tier_claim: Option<&'a [u8]>,
    /// The common name of the client certificate the connection's TLS
    /// handshake verified.
    pub client_cert: Option<&'a [u8]>,
}

/// The in-flight count for a decision with no upstream behind it (the
/// decision API, Envoy RLS): elastic throttling's headroom is for an
/// upstream measured idle, and there is none to measure.
pub const NO_UPSTREAM: usize = usize::MAX;

impl RuleSet {
    /// Compiles validated specs, resolving their metric handles.
    pub fn build(specs: Vec<RuleSpec>, files: Vec<PathBuf>, metrics: &Metrics) -> RuleSet {
        let rules: Vec<Rule> = specs.into_iter().map(|s| Rule::build(s, metrics)).collect();
        let idle_horizon = rules
            .iter()
            .flat_map(Rule::plans)
            .map(|p| {
                // Soft and elastic throttling raise limit and burst together,
                // which keeps the horizon; the 2x covers them anyway.
                p.nominal.idle_horizon().saturating_mul(2)
            })
            .max()
            .unwrap_or(0);
        let keys_on_user = rules.iter().any(|r| r.spec.key.contains(&KeyPart::User));
        let mut read_headers: Vec<http::HeaderName> = Vec::new();
        for r in &rules {
            let keyed = r.spec.key.iter().filter_map(|k| match k {
                KeyPart::Header(h) => Some(h),
                _ => None,
            });
            let cost = match &r.spec.cost {
                Cost::Header(h) => Some(h),
                Cost::Fixed(_) => None,
            };
            let tier = match r.spec.tiers.as_ref().map(|t| &t.source) {
                Some(TierSource::Header(h)) => Some(h),
                _ => None,
            };
            for h in keyed.chain(cost).chain(tier).chain(r.spec.matcher.header.as_ref().map(|(h, _)| h)) {
                if !read_headers.contains(h) {
                    read_headers.push(h.clone());
                }
            }
        }
        let any_needs_user = rules.iter().any(Rule::needs_user);
        let any_settles = rules.iter().any(|r| r.spec.cost_response_header.is_some());
        let any_reads_api_key =
            rules.iter().any(|r| r.spec.key.contains(&KeyPart::ApiKey) || !r.spec.exempt.api_keys.is_empty());
        let reads_method =
            rules.iter().any(|r| !r.spec.matcher.methods.is_empty() || r.spec.key.contains(&KeyPart::Method));
        let paths = PathIndex::new(rules.iter().map(|r| r.spec.matcher.path.as_ref()));
        let tier_claim = rules.iter().find_map(|r| match r.spec.tiers.as_ref().map(|t| &t.source) {
            Some(TierSource::Claim(c)) => Some(c.clone()),
            _ => None,
        });
        RuleSet {
            rules,
            denies: Vec::new(),
            envoy: Vec::new(),
            keys_on_user,
            tier_claim,
            read_headers,
            reads_method,
            any_settles,
            any_needs_user,
            denies_name_users: false,
            any_reads_api_key,
            files,
            loaded_at: SystemTime::now(),
            idle_horizon,
            paths,
        }
    }

    /// Compiles everything a rules path held.
    pub fn from_loaded(loaded: LoadedRules, metrics: &Metrics) -> RuleSet {
        let mut set = RuleSet::build(loaded.rules, loaded.files, metrics);
        set.denies = loaded.denies;
        set.envoy = loaded.envoy;
        set.denies_name_users = set.denies.iter().any(|d| !d.clients.users.is_empty());
        set.any_needs_user |= set.denies_name_users;
        set.any_reads_api_key |= set.denies.iter().any(|d| !d.clients.api_keys.is_empty());
        set
    }

    /// The `[[deny]]` entry that names this client, if any.
    pub fn denied(&self, facts: &RequestFacts<'_>) -> Option<&DenySpec> {
        self.denies.iter().find(|d| d.clients.contains(facts.client_ip, facts.user, facts.api_key))
    }

    /// Whether a request to `path` needs its user identity: a `[[deny]]`
    /// entry names users, or a rule that may match the path keys on the user
    /// or names users in `exempt`. Only then is its JWT verified, so rules
    /// keyed on other things never pay for a signature check.
    pub fn needs_user(&self, path: &str) -> bool {
        if !self.any_needs_user {
            return false;
        }
        if self.denies_name_users {
            return true;
        }
        self.paths.candidates(path).any(|i| {
            let r = &self.rules[i];
            r.needs_user() && path_fits(r.spec.matcher.path.as_ref(), path)
        })
    }

    /// The rules that apply to a request, in file order.
    ///
    /// Only the rules [`PathIndex`] finds for the request's path are
    /// examined, so a thousand per-endpoint rules (exact paths or
    /// prefixes) cost a few hash lookups, not a thousand comparisons.
    pub fn matching<'s: 'f, 'f>(&'s self, facts: &'f RequestFacts<'_>) -> impl Iterator<Item = &'s Rule> + 'f {
        self.paths.candidates(facts.path).map(|i| &self.rules[i]).filter(move |r| r.matches(facts))
    }
}

/// One set of limits of a rule with its rendered header values.
fn build_plan(
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

impl Rule {
    fn build(spec: RuleSpec, metrics: &Metrics) -> Rule {
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
        let counters = metrics.rule_counters(&spec.name);
        let calendar =
            spec.calendar.as_ref().map(|c| Box::new(crate::limiter::calendar::Calendar::new(c.period, c.zone.clone())));
        Rule { spec, plan: own, variants, quoted_name, window_secs, calendar, key_prefix, counters, top: None }
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
    fn needs_user(&self) -> bool {
        self.spec.key.contains(&KeyPart::User)
            || !self.spec.exempt.users.is_empty()
            || matches!(self.spec.tiers.as_ref().map(|t| &t.source), Some(TierSource::Claim(_)))
    }

    pub fn name(&self) -> &str {
        &self.spec.name
    }

    pub fn enforced(&self) -> bool {
        self.spec.mode == RuleMode::Enforce
    }

    /// The `method` key part: the method the upstream runs (an override's,
    /// if given), except that a rule listing `methods` keys on the listed
    /// method it matched, so that an override the rule does not list cannot
    /// move a request into a bucket of its own.
    fn keyed_method<'f>(&self, f: &RequestFacts<'f>) -> &'f [u8] {
        let real = f.method.as_str().as_bytes();
        let Some(o) = crate::wire::normalize::overriding_method(f.headers) else { return real };
        let listed = &self.spec.matcher.methods;
        if listed.is_empty() || listed.iter().any(|x| x.as_str().as_bytes() == o) { o } else { real }
    }

    /// Whether every condition of the rule's `match` holds.
    pub fn matches(&self, f: &RequestFacts<'_>) -> bool {
        let m = &self.spec.matcher;
        if !self.spec.exempt.is_empty() && self.spec.exempt.contains(f.client_ip, f.user, f.api_key) {
            return false;
        }
        // A method override counts as the method it names, as well as the
        // method it came with: whichever the upstream runs, the rule holds.
        if !m.methods.is_empty()
            && !m.methods.iter().any(|x| x == f.method)
            && !crate::wire::normalize::overriding_method(f.headers)
                .is_some_and(|o| m.methods.iter().any(|x| x.as_str().as_bytes() == o))
        {
            return false;
        }
        if !path_fits(m.path.as_ref(), f.path) {
            return false;
        }
        if let Some(h) = &m.host
            && f.host != Some(h.as_str())
        {
            return false;
        }
        if let Some(route) = &m.route
            && !f.route.is_some_and(|(name, upstream)| name == route || upstream == route)
        {
            return false;
        }
        if let Some((name, value)) = &m.header
            && f.headers.get(name).is_none_or(|v| v.as_bytes() != value.as_bytes())
        {
            return false;
        }
        true
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

    /// Writes this request's bucket key into `out` (cleared first).
    ///
    /// The key is the encoded rule name followed by one `tag=value` per key
    /// part, separated by `|`. Values are percent-encoded, so no value can
    /// contain a `|` and two different requests can never produce the same
    /// key by shifting text between parts (user "a|b" vs user "a" + path
    /// "b"). A part the request lacks (no user header for `user`) falls back
    /// to the client IP under the tag `ip`, so leaving a header out never
    /// escapes a limit and never shares a bucket with a real user id. An
    /// API key is a secret and appears as `sha256:` and its SHA-256 in hex.
    ///
    /// `Err` (the sentence for a 400 answer) when a query parameter the key
    /// reads comes more than once: which of its values the upstream reads
    /// is not ours to guess.
    pub fn key(&self, f: &RequestFacts<'_>, out: &mut String) -> Result<(), String> {
        out.clear();
        out.push_str(&self.key_prefix);
        for (i, part) in self.spec.key.iter().enumerate() {
            if i > 0 {
                out.push('|');
            }
            let query;
            let value: Option<&[u8]> = match part {
                KeyPart::Ip => None,
                KeyPart::User => f.user,
                KeyPart::ApiKey => f.api_key,
                KeyPart::Route => Some(f.route.map_or("", |r| r.0).as_bytes()),
                KeyPart::Method => Some(self.keyed_method(f)),
                KeyPart::Path => Some(crate::wire::normalize::match_path(f.path).as_bytes()),
                KeyPart::ClientCert => f.client_cert,
                KeyPart::Header(h) => f.headers.get(h).map(|v| v.as_bytes()),
                KeyPart::Query(q) => {
                    query = query_param(f.query, q)
                        .map_err(|()| format!("query parameter {q:?} must not be given more than once"))?;
                    query.as_deref()
                }
            };
            match value.filter(|v| !v.is_empty() || matches!(part, KeyPart::Route)) {
                Some(v) if matches!(part, KeyPart::ApiKey) => {
                    // A secret: keys end up in Redis key names and debug
                    // logs, so they carry its SHA-256, never the key itself,
                    // spelled as an override names it.
                    out.push_str("api_key=sha256:");
                    push_sha256_hex(out, v);
                }
                Some(v) => {
                    out.push_str(tag(part));
                    out.push('=');
                    encode(out, v);
                }
                None => {
                    // `write!` to a String cannot fail.
                    let _ = write!(out, "ip={}", f.client);
                }
            }
        }
        Ok(())
    }
}

/// Whether a canonical request path fits a rule's `match.path`: an exact
/// path ignores one trailing `/`, and `"/api/*"` covers `/api` too, as most
/// routers treat them.
fn path_fits(pattern: Option<&PathPattern>, path: &str) -> bool {
    match pattern {
        None => true,
        Some(PathPattern::Exact(p)) => p == crate::wire::normalize::match_path(path),
        Some(PathPattern::Prefix(p)) => path.starts_with(p.as_str()) || p.strip_suffix('/') == Some(path),
    }
}

/// The value of query parameter `name`, decoded as upstream frameworks
/// decode form-encoded queries (`%XX`, and `+` for a space), so that
/// `?user=%62ob` and `?user=bob` are one key. `Err` when the parameter
/// comes more than once (under any spelling of its name).
fn query_param(query: Option<&str>, name: &str) -> Result<Option<Vec<u8>>, ()> {
    let Some(query) = query else { return Ok(None) };
    let mut found = None;
    for pair in query.split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if form_decode(k) == name.as_bytes() {
            if found.is_some() {
                return Err(());
            }
            found = Some(form_decode(v));
        }
    }
    Ok(found)
}

/// `application/x-www-form-urlencoded` decoding; an invalid `%` escape is
/// kept as it is, as common frameworks do.
pub(crate) fn form_decode(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |k: usize| b.get(k).and_then(|c| (*c as char).to_digit(16));
        match (b[i], hex(i + 1), hex(i + 2)) {
            (b'%', Some(hi), Some(lo)) => {
                out.push((hi * 16 + lo) as u8);
                i += 3;
                continue;
            }
            (b'+', _, _) => out.push(b' '),
            (c, _, _) => out.push(c),
        }
        i += 1;
    }
    out
}

/// Window length in nanoseconds as whole seconds, at least 1.
pub fn whole_secs(ns: Nanos) -> u64 {
    ns.div_ceil(NANOS_PER_SEC).max(1)
}

impl crate::limit::top::Sketched for RuleSet {
    fn each_sketch(&mut self, f: &mut dyn FnMut(&str, &mut Option<std::sync::Arc<crate::limit::top::RuleTop>>)) {
        for rule in &mut self.rules {
            f(&rule.spec.name, &mut rule.top);
        }
    }
}

#[cfg(test)]
mod tests;
