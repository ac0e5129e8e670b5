//! The [`RuleSet`] in force: every compiled rule, the `[[deny]]` list, what
//! any rule reads, and the index that finds the rules a request matches.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use super::facts::RequestFacts;
use super::request::path_fits;
use super::rule::Rule;
use crate::config::watch::breathe;
use crate::config::{DenySpec, EnvoyMapping, LoadedRules, RuleSpec, TierSource};
use crate::limit::path_index::PathIndex;
use crate::limiter::Nanos;
use crate::obs::metrics::Metrics;

/// The rules in force.
pub struct RuleSet {
    /// Shared with the rule set a reload replaced where a rule's spec did
    /// not change (see [`RuleSet::from_loaded_reusing`]).
    pub rules: Vec<Arc<Rule>>,
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
    /// that can match its path. Shared with the set a reload replaced
    /// when every rule's path is what it was (see [`same_paths`]).
    pub(super) paths: Arc<PathIndex>,
}

impl RuleSet {
    /// Compiles validated specs, resolving their metric handles.
    pub fn build(specs: Vec<RuleSpec>, files: Vec<PathBuf>, metrics: &Metrics) -> RuleSet {
        RuleSet::build_reusing(specs.into_iter().map(Arc::new).collect(), files, metrics, None)
    }

    /// [`RuleSet::build`], taking from `previous` every rule whose spec is
    /// unchanged.
    fn build_reusing(
        specs: Vec<Arc<RuleSpec>>,
        files: Vec<PathBuf>,
        metrics: &Metrics,
        previous: Option<&RuleSet>,
    ) -> RuleSet {
        let mut kept = Kept::new(previous);
        let rules: Vec<Arc<Rule>> = specs
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                breathe();
                kept.take(i, &s).unwrap_or_else(|| Arc::new(Rule::build(s, metrics)))
            })
            .collect();
        // One pass over what each rule worked out when it was compiled.
        let (mut idle_horizon, mut read_headers) = (0, Vec::<http::HeaderName>::new());
        let (mut keys_on_user, mut any_needs_user, mut any_settles) = (false, false, false);
        let (mut any_reads_api_key, mut reads_method) = (false, false);
        for d in rules.iter().map(|r| &r.derived) {
            breathe();
            idle_horizon = idle_horizon.max(d.idle_horizon);
            keys_on_user |= d.keys_on_user;
            any_needs_user |= d.needs_user;
            any_settles |= d.settles;
            any_reads_api_key |= d.reads_api_key;
            reads_method |= d.reads_method;
            for h in &d.headers {
                if !read_headers.contains(h) {
                    read_headers.push(h.clone());
                }
            }
        }
        let paths = match previous {
            Some(p) if same_paths(&p.rules, &rules) => Arc::clone(&p.paths),
            _ => Arc::new(PathIndex::new(rules.iter().map(|r| r.spec.matcher.path.as_ref()))),
        };
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

    /// Whether this set's rules have the names of `other`'s, in the same
    /// order (the rules themselves may differ).
    pub fn same_names(&self, other: &RuleSet) -> bool {
        self.rules.len() == other.rules.len()
            && self.rules.iter().zip(&other.rules).all(|(a, b)| Arc::ptr_eq(a, b) || a.spec.name == b.spec.name)
    }

    /// Compiles everything a rules path held.
    pub fn from_loaded(loaded: LoadedRules, metrics: &Metrics) -> RuleSet {
        RuleSet::from_loaded_reusing(loaded, metrics, None)
    }

    /// [`RuleSet::from_loaded`] for a reload: a rule whose spec equals that
    /// of the rule of its name in `previous` (the set in force) is that
    /// rule, shared rather than compiled again. A spec is everything a rule
    /// is compiled from, and a rule's metric series and `/top` sketches go
    /// by its name whether it changed or not, so a kept rule is exactly
    /// what compiling it again would give; only it costs nothing, and
    /// freeing the replaced set frees only the rules that changed or went.
    /// A reload of 10,000 rules where one changed compiles one.
    pub fn from_loaded_reusing(loaded: LoadedRules, metrics: &Metrics, previous: Option<&RuleSet>) -> RuleSet {
        let mut set = RuleSet::build_reusing(loaded.rules, loaded.files, metrics, previous);
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
        self.paths.candidates(facts.path).map(|i| &*self.rules[i]).filter(move |r| r.matches(facts))
    }
}

/// Whether `new` has the `match.path` of `old` at every index, so that the
/// index of `old`'s paths is `new`'s too: the common reload (a limit
/// edited among thousands of rules) then neither files every path again nor
/// frees the old index, a third of the reload's instructions at 10,000
/// rules (`benches/reload_callgrind.sh`). A rule kept from `old` is
/// compared by pointer.
fn same_paths(old: &[Arc<Rule>], new: &[Arc<Rule>]) -> bool {
    old.len() == new.len()
        && old.iter().zip(new).all(|(o, n)| Arc::ptr_eq(o, n) || o.spec.matcher.path == n.spec.matcher.path)
}

/// The rules of the set a reload replaces, for [`RuleSet::from_loaded_reusing`].
struct Kept<'p> {
    previous: &'p [Arc<Rule>],
    /// By name, made on the first rule not found at its own place (rules
    /// added or removed before it).
    by_name: Option<std::collections::HashMap<&'p str, &'p Arc<Rule>, foldhash::fast::RandomState>>,
}

impl<'p> Kept<'p> {
    fn new(previous: Option<&'p RuleSet>) -> Kept<'p> {
        Kept { previous: previous.map_or(&[], |p| &p.rules[..]), by_name: None }
    }

    /// The previous rule named as `spec` is, at `index` in the new set, if
    /// its spec is the same.
    fn take(&mut self, index: usize, spec: &Arc<RuleSpec>) -> Option<Arc<Rule>> {
        let old = match self.previous.get(index) {
            Some(r) if r.spec.name == spec.name => r,
            _ if self.previous.is_empty() => return None,
            _ => {
                let previous = self.previous;
                let by_name =
                    self.by_name.get_or_insert_with(|| previous.iter().map(|r| (r.spec.name.as_str(), r)).collect());
                by_name.get(spec.name.as_str())?
            }
        };
        // The same spec (one the rules cache kept) is equal without a look.
        (Arc::ptr_eq(&old.spec, spec) || *old.spec == **spec).then(|| Arc::clone(old))
    }
}

impl crate::limit::top::Sketched for RuleSet {
    fn each_sketch(&mut self, f: &mut dyn FnMut(&str, &mut Option<std::sync::Arc<crate::limit::top::RuleTop>>)) {
        for rule in &mut self.rules {
            breathe();
            match Arc::get_mut(rule) {
                Some(fresh) => f(&fresh.spec.name, &mut fresh.top),
                // A rule kept from the set in force: its sketches are those
                // its name maps to, which `f` gives it again.
                None => f(&rule.spec.name, &mut rule.top.clone()),
            }
        }
    }

    fn each_fresh_sketch(&mut self, f: &mut dyn FnMut(&str, &mut Option<std::sync::Arc<crate::limit::top::RuleTop>>)) {
        for rule in &mut self.rules {
            breathe();
            // A rule kept from the set in force has its sketches (a plain
            // read, where `get_mut` is an atomic exchange).
            if rule.top.is_none()
                && let Some(fresh) = Arc::get_mut(rule)
            {
                f(&fresh.spec.name, &mut fresh.top);
            }
        }
    }
}
