//! The [`RuleSet`] in force: every compiled rule, the `[[deny]]` list, what
//! any rule reads, and the index that finds the rules a request matches.

use std::path::PathBuf;
use std::time::SystemTime;

use super::facts::RequestFacts;
use super::request::path_fits;
use super::rule::Rule;
use crate::config::{Cost, DenySpec, EnvoyMapping, KeyPart, LoadedRules, RuleSpec, TierSource};
use crate::limit::path_index::PathIndex;
use crate::limiter::Nanos;
use crate::obs::metrics::Metrics;

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
    /// (`cost_response_header`, `count_status`): only then does the
    /// request path look.
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
        let any_settles = rules.iter().any(|r| r.spec.settles_from_response());
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

impl crate::limit::top::Sketched for RuleSet {
    fn each_sketch(&mut self, f: &mut dyn FnMut(&str, &mut Option<std::sync::Arc<crate::limit::top::RuleTop>>)) {
        for rule in &mut self.rules {
            f(&rule.spec.name, &mut rule.top);
        }
    }
}
