//! Rules files: reading the rules path (one file, or every `*.toml` in a
//! directory, in name order) and validating each `[[rule]]` into a
//! [`RuleSpec`].

use std::path::{Path, PathBuf};
use std::time::Duration;

use http::{HeaderName, Method};
use toml::Spanned;

use super::envoy::EnvoyMapping;
use super::error::{ConfigError, ConfigErrors, line_col};
use super::main_file::Config;
use super::overrides::Base;
use super::raw::{RawEnvoy, RawMatch, RawRule, RawRulesFile};
use super::spec::{
    CalendarSpec, ClientSet, Cost, DEFAULT_MAX_COST, DEFAULT_SLOT_TTL, DenySpec, KeyPart, MAX_COUNT, MAX_SLOT_TTL,
    MIN_SLOT_TTL, MatchSpec, PathPattern, RuleSpec, Throttle, TierSource,
};
use super::validate::{Validator, canonical_host, parse_net};
use crate::limiter::Algorithm;

/// Everything the rules path holds, validated.
#[derive(Debug, Clone, Default)]
pub struct LoadedRules {
    pub rules: Vec<RuleSpec>,
    pub denies: Vec<DenySpec>,
    /// The files read, in order.
    pub files: Vec<PathBuf>,
    /// `[[envoy]]` entries, in file order.
    pub envoy: Vec<EnvoyMapping>,
}

/// One rules file, validated: each rule with the span of its name (for
/// duplicate-name errors across files), and its deny entries.
#[derive(Debug, Clone, Default)]
pub struct RulesFile {
    pub rules: Vec<(RuleSpec, std::ops::Range<usize>)>,
    pub denies: Vec<DenySpec>,
    /// `[[envoy]]` entries, checked against the rules by [`load_rules`].
    pub envoy: Vec<Spanned<RawEnvoy>>,
}

/// The files a rules path stands for: itself, or the `*.toml` files in it
/// (hidden files, such as a Kubernetes ConfigMap's `..data`, are skipped).
pub fn rule_files(path: &Path) -> Result<Vec<PathBuf>, ConfigError> {
    let meta =
        std::fs::metadata(path).map_err(|e| ConfigError::file(path, format!("cannot read the rules path: {e}")))?;
    if !meta.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let entries = std::fs::read_dir(path)
        .map_err(|e| ConfigError::file(path, format!("cannot list the rules directory: {e}")))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            !name.starts_with('.') && p.extension().is_some_and(|x| x == "toml") && p.is_file()
        })
        .collect();
    files.sort();
    Ok(files)
}

/// Reads and validates every rule and deny entry under `path`. Rule names
/// must be unique across files. Returns them with the files read, or every
/// problem.
pub fn load_rules(path: &Path, config: &Config) -> Result<LoadedRules, ConfigErrors> {
    let files = rule_files(path)?;
    let mut specs: Vec<RuleSpec> = Vec::new();
    let mut denies: Vec<DenySpec> = Vec::new();
    let mut envoy = Vec::new();
    let mut errors = Vec::new();
    for file in &files {
        let source = match std::fs::read_to_string(file) {
            Ok(s) => s,
            Err(e) => {
                errors.push(ConfigError::file(file, format!("cannot read the rules file: {e}")));
                continue;
            }
        };
        // A file's valid rules take part in the duplicate check even when
        // other rules of it are broken: `tollgate check` lists every problem.
        let (parsed, mut file_errors) = validate_rules_file(file, &source, config);
        denies.extend(parsed.denies);
        for (rule, span) in parsed.rules {
            if let Some(why) = claim_conflict(specs.iter(), &rule) {
                file_errors.push(ConfigError::at(file, &source, Some(span), why));
            } else if let Some(first) = specs.iter().find(|s| s.name == rule.name) {
                file_errors.push(ConfigError::at(
                    file,
                    &source,
                    Some(span),
                    format!("rule name {:?} is already used at {}:{}", rule.name, first.source.display(), first.line),
                ));
            } else {
                specs.push(rule);
            }
        }
        let (mappings, mut envoy_errors) = super::envoy::resolve(file, &source, parsed.envoy, &specs);
        envoy.extend(mappings);
        file_errors.append(&mut envoy_errors);
        file_errors.sort_by_key(|e| (e.line, e.column));
        errors.append(&mut file_errors);
    }
    if errors.is_empty() { Ok(LoadedRules { rules: specs, denies, files, envoy }) } else { Err(ConfigErrors(errors)) }
}

/// Validates the text of one rules file: its rules alone (see
/// [`parse_rules_file`] for the deny entries too).
pub fn parse_rules(
    file: &Path,
    source: &str,
    config: &Config,
) -> Result<Vec<(RuleSpec, std::ops::Range<usize>)>, ConfigErrors> {
    parse_rules_file(file, source, config).map(|f| f.rules)
}

/// Validates the text of one rules file.
pub fn parse_rules_file(file: &Path, source: &str, config: &Config) -> Result<RulesFile, ConfigErrors> {
    let (parsed, mut errors) = validate_rules_file(file, source, config);
    if errors.is_empty() {
        Ok(parsed)
    } else {
        errors.sort_by_key(|e| (e.line, e.column));
        Err(ConfigErrors(errors))
    }
}

/// Validates one rules file: what is valid in it, and every problem.
fn validate_rules_file(file: &Path, source: &str, config: &Config) -> (RulesFile, Vec<ConfigError>) {
    let raw: RawRulesFile = match toml::from_str(source) {
        Ok(raw) => raw,
        Err(e) => return (RulesFile::default(), vec![ConfigError::from_toml(file, source, &e)]),
    };
    let mut v = Validator { file, source, errors: Vec::new() };
    let mut denies = Vec::new();
    for d in raw.deny {
        let line = line_col(source, d.span().start).0;
        let d = d.into_inner();
        let clients = v.clients(d.ips.as_deref(), d.users, d.api_keys);
        if clients.is_empty() {
            v.error(d.name.span(), "a [[deny]] entry needs at least one of ips, users, api_keys");
        }
        denies.push(DenySpec { name: d.name.into_inner(), source: file.to_path_buf(), line, clients });
    }
    let mut out: Vec<(RuleSpec, std::ops::Range<usize>)> = Vec::new();
    for r in raw.rule {
        let line = line_col(source, r.span().start).0;
        let r = r.into_inner();
        let name_span = r.name.span();
        // Compared as validated: names are trimmed.
        if let Some((first, _)) = out.iter().find(|(s, _)| s.name == r.name.get_ref().trim()) {
            v.error(name_span.clone(), format!("rule name {:?} is already used at line {}", first.name, first.line));
            continue;
        }
        if let Some(spec) = v.rule(r, line, config) {
            if let Some(why) = claim_conflict(out.iter().map(|(s, _)| s), &spec) {
                v.error(name_span, why);
                continue;
            }
            out.push((spec, name_span));
        }
    }
    (RulesFile { rules: out, denies, envoy: raw.envoy }, v.errors)
}

/// Why `rule` cannot join `earlier`, if it cannot: its tier reads another
/// JWT claim than theirs. One claim is kept of each verified token, so that
/// remembering a token costs one more string, not a copy of its claims.
fn claim_conflict<'a>(mut earlier: impl Iterator<Item = &'a RuleSpec>, rule: &RuleSpec) -> Option<String> {
    let claim = |s: &RuleSpec| match s.tiers.as_ref().map(|t| &t.source) {
        Some(TierSource::Claim(c)) => Some(c.clone()),
        _ => None,
    };
    let mine = claim(rule)?;
    let other = earlier.find(|s| claim(s).is_some_and(|c| c != mine))?;
    Some(format!(
        "tier \"claim:{mine}\": rule {:?} ({}:{}) reads tiers from claim {:?}, and all rules must read the same claim",
        other.name,
        other.source.display(),
        other.line,
        claim(other).unwrap_or_default()
    ))
}

impl Validator<'_> {
    /// Addresses/CIDRs, user ids and API keys of a deny entry or exemption.
    fn clients(
        &mut self,
        ips: Option<&[Spanned<String>]>,
        users: Option<Vec<String>>,
        api_keys: Option<Vec<String>>,
    ) -> ClientSet {
        let mut nets = Vec::new();
        for ip in ips.unwrap_or_default() {
            match parse_net(ip.get_ref()) {
                Some(n) => nets.push(n),
                None => self.error(
                    ip.span(),
                    format!("{:?} is not an IP address or CIDR such as \"10.0.0.0/8\"", ip.get_ref()),
                ),
            }
        }
        ClientSet { nets, users: users.unwrap_or_default(), api_keys: api_keys.unwrap_or_default() }
    }

    pub(super) fn count(&mut self, value: &Spanned<i64>, what: &str) -> Option<u64> {
        let n = *value.get_ref();
        if n < 1 {
            self.error(value.span(), format!("{what} must be at least 1, not {n}"));
            None
        } else if n > MAX_COUNT {
            self.error(value.span(), format!("{what} must be at most {MAX_COUNT}"));
            None
        } else {
            Some(n as u64)
        }
    }

    fn percent(&mut self, value: Option<&Spanned<i64>>, what: &str, default: u32) -> u32 {
        match value {
            None => default,
            Some(p) if !(0..=1000).contains(p.get_ref()) => {
                self.error(p.span(), format!("{what} must be between 0 and 1000"));
                default
            }
            Some(p) => *p.get_ref() as u32,
        }
    }

    fn rule(&mut self, mut r: RawRule, line: usize, config: &Config) -> Option<RuleSpec> {
        let errors_before = self.errors.len();
        let name = self.rule_name(&r);
        let calendar = self.calendar(&r);
        // A calendar quota counts in fixed windows unless told otherwise
        // (and `calendar` refuses every other algorithm).
        let algorithm =
            r.algorithm.unwrap_or(if r.calendar.is_some() { Algorithm::FixedWindow } else { Algorithm::default() });
        let limit = self.count(&r.limit, "limit");
        let window = self.rule_window(&r, calendar.as_ref(), algorithm);
        let matcher = match r.matcher.take() {
            Some(m) => self.matcher(m.into_inner(), config),
            None => MatchSpec::default(),
        };
        let key = match &r.key {
            None => vec![KeyPart::Ip],
            Some(parts) => parts.get_ref().iter().filter_map(|p| self.key_part(p)).collect(),
        };
        let burst = match &r.burst {
            Some(b) => self.count(b, "burst"),
            None => limit,
        };
        let throttle = self.throttle(&r);
        let capacity = if matches!(algorithm, Algorithm::TokenBucket | Algorithm::LeakyBucket) { burst } else { limit };
        let exempt = r.exempt.take().map_or_else(ClientSet::default, |e| {
            let e = e.into_inner();
            self.clients(e.ips.as_deref(), e.users, e.api_keys)
        });
        let (cost, max_cost) = self.cost(&r, capacity);
        let cost_response_header = self.cost_response_header(&r, algorithm);
        let quota_unit = self.quota_unit(&r);
        let (mut overrides, mut tiers) = (Vec::new(), None);
        if let (Some(limit), Some(burst)) = (limit, burst) {
            let base = Base {
                name: &name,
                key: &key,
                algorithm,
                limit,
                burst,
                cost: &cost,
                max_cost: r.max_cost.is_some().then_some(max_cost),
                ipv6_prefix: config.client.ipv6_prefix,
            };
            overrides = self.overrides(r.overrides.unwrap_or_default(), &base);
            tiers = self.tiers(r.tier.as_ref(), r.tiers.as_ref(), &base, config.client.jwt.is_some());
        }
        if self.errors.len() > errors_before {
            return None;
        }
        Some(RuleSpec {
            name,
            source: self.file.to_path_buf(),
            line,
            matcher,
            key,
            algorithm,
            limit: limit?,
            window: window?,
            calendar,
            burst: burst?,
            mode: r.mode.unwrap_or_default(),
            throttle,
            cost,
            max_cost,
            cost_response_header,
            quota_unit,
            on_error: r.on_error,
            exempt,
            on_invalid_token: r.on_invalid_token.unwrap_or_default(),
            overrides,
            tiers,
        })
    }

    /// A rule's `name`, trimmed. It goes into `RateLimit-Policy` and
    /// `RateLimit` as a structured-field string, which holds printable ASCII
    /// only, with `"` and `\` escaped: allow exactly what needs no escaping.
    fn rule_name(&mut self, r: &RawRule) -> String {
        let name = r.name.get_ref().trim().to_string();
        if name.is_empty()
            || name.len() > 128
            || !name.bytes().all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\')
        {
            self.error(
                r.name.span(),
                "rule name must be 1 to 128 printable ASCII characters, without quotes or backslashes",
            );
        }
        name
    }

    /// `throttle`, with `soft_percent` or the `elastic_*` keys.
    fn throttle(&mut self, r: &RawRule) -> Throttle {
        match r.throttle.as_ref().map(|t| t.get_ref().as_str()) {
            None | Some("hard") => Throttle::Hard,
            Some("soft") => Throttle::Soft { percent: self.percent(r.soft_percent.as_ref(), "soft_percent", 10) },
            Some("elastic") => {
                let percent = self.percent(r.elastic_percent.as_ref(), "elastic_percent", 50);
                let inflight_below = match &r.elastic_when_inflight_below {
                    None => 100,
                    Some(n) => self.count(n, "elastic_when_inflight_below").unwrap_or(100).min(u32::MAX as u64) as u32,
                };
                Throttle::Elastic { percent, inflight_below }
            }
            Some(other) => {
                if let Some(t) = &r.throttle {
                    self.error(t.span(), format!("throttle {other:?} is not one of hard, soft, elastic"));
                }
                Throttle::Hard
            }
        }
    }

    /// `cost` or `cost_header`, and `max_cost`: neither may exceed the
    /// bucket's `capacity`, or no request could ever pass.
    fn cost(&mut self, r: &RawRule, capacity: Option<u64>) -> (Cost, u64) {
        let cost = match (&r.cost, &r.cost_header) {
            (Some(c), Some(h)) => {
                self.error(h.span(), "set either cost or cost_header, not both");
                let _ = c;
                Cost::Fixed(1)
            }
            (Some(c), None) => {
                let n = self.count(c, "cost").unwrap_or(1);
                if let Some(cap) = capacity
                    && n > cap
                {
                    self.error(
                        c.span(),
                        format!("cost {n} is larger than the bucket ({cap}): no request could ever pass"),
                    );
                }
                Cost::Fixed(n)
            }
            (None, Some(h)) => {
                Cost::Header(self.header_name(h, "cost_header").unwrap_or(HeaderName::from_static("x-cost")))
            }
            (None, None) => Cost::Fixed(1),
        };
        let max_cost = match (&cost, &r.max_cost) {
            (Cost::Fixed(n), None) => *n,
            (Cost::Fixed(_), Some(m)) => {
                self.error(m.span(), "max_cost bounds cost_header: set cost_header too, or leave max_cost out");
                1
            }
            (Cost::Header(_), Some(m)) => {
                let n = self.count(m, "max_cost").unwrap_or(1);
                if let Some(cap) = capacity
                    && n > cap
                {
                    self.error(
                        m.span(),
                        format!("max_cost {n} is larger than the bucket ({cap}): no request could ever pass"),
                    );
                }
                n
            }
            (Cost::Header(_), None) => capacity.unwrap_or(1).min(DEFAULT_MAX_COST),
        };
        (cost, max_cost)
    }

    /// `cost_response_header`: only for the algorithms that can settle.
    fn cost_response_header(&mut self, r: &RawRule, algorithm: Algorithm) -> Option<HeaderName> {
        r.cost_response_header.as_ref().and_then(|h| {
            if !crate::limiter::settles(algorithm) {
                self.error(
                    h.span(),
                    format!(
                        "cost_response_header settles token_bucket, fixed_window and sliding_window_counter rules only: {} cannot correct a cost once counted",
                        algorithm.as_str()
                    ),
                );
            }
            self.header_name(h, "cost_response_header")
        })
    }

    fn quota_unit(&mut self, r: &RawRule) -> Option<String> {
        r.quota_unit.as_ref().map(|u| {
            let unit = u.get_ref();
            let ok = (1..=32).contains(&unit.len())
                && unit.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
            if !ok {
                self.error(
                    u.span(),
                    format!("quota_unit {unit:?} must be 1 to 32 lower-case letters, digits, '-' or '_' (such as \"tokens\")"),
                );
            }
            unit.clone()
        })
    }

    /// The window a rule counts in: its calendar period's longest, a
    /// concurrency rule's `slot_ttl`, or a rate rule's `window`.
    fn rule_window(&mut self, r: &RawRule, calendar: Option<&CalendarSpec>, algorithm: Algorithm) -> Option<Duration> {
        match calendar {
            Some(c) => Some(Duration::from_nanos(c.period.longest())),
            None if algorithm == Algorithm::Concurrency => self.concurrency(r),
            None if r.calendar.is_some() => None,
            None => self.window(r),
        }
    }

    /// A rate rule's `window`: required, 1ms to 366d; `slot_ttl` is not
    /// one of its keys.
    fn window(&mut self, r: &RawRule) -> Option<Duration> {
        if let Some(t) = &r.slot_ttl {
            self.error(t.span(), "slot_ttl applies to algorithm = \"concurrency\" only");
        }
        let Some(raw) = &r.window else {
            self.error(r.name.span(), "window is required, or calendar (algorithm = \"concurrency\" has neither)");
            return None;
        };
        let w = self.duration(raw, "window")?;
        if w < Duration::from_millis(1) {
            self.error(raw.span(), "window must be at least 1ms");
        }
        if w > Duration::from_nanos(crate::limiter::MAX_WINDOW) {
            self.error(raw.span(), "window must be at most 366d");
        }
        Some(w)
    }

    /// `calendar` and `timezone`, which stand in a rule's `window`. Only a
    /// fixed window is counted per calendar window: a sliding counter
    /// weighs the previous window by a length that calendar windows do not
    /// share, and a bucket or a log has no window start to align.
    fn calendar(&mut self, r: &RawRule) -> Option<CalendarSpec> {
        let Some(raw) = &r.calendar else {
            if let Some(tz) = &r.timezone {
                self.error(
                    tz.span(),
                    "timezone applies to calendar rules only: set calendar = \"day\", \"week\" or \"month\"",
                );
            }
            return None;
        };
        let mut ok = true;
        if let Some(w) = &r.window {
            self.error(w.span(), "set either window or calendar, not both");
            ok = false;
        }
        if let Some(a) = r.algorithm.filter(|a| *a != Algorithm::FixedWindow) {
            self.error(
                raw.span(),
                format!("calendar counts with algorithm = \"fixed_window\" (its default), not {:?}", a.as_str()),
            );
            ok = false;
        }
        if let Some(b) = &r.burst {
            self.error(b.span(), "a calendar rule has no burst: limit is the quota of each window");
            ok = false;
        }
        if let Some(t) = &r.slot_ttl {
            self.error(t.span(), "slot_ttl applies to algorithm = \"concurrency\" only");
            ok = false;
        }
        let period = crate::limiter::calendar::Period::parse(raw.get_ref().trim());
        if period.is_none() {
            self.error(raw.span(), format!("calendar {:?} is not one of day, week, month", raw.get_ref()));
        }
        let timezone = r.timezone.as_ref().map_or("UTC", |t| t.get_ref().trim()).to_string();
        let zone = match jiff::tz::TimeZone::get(&timezone) {
            Ok(z) => Some(z),
            Err(_) => {
                if let Some(t) = &r.timezone {
                    self.error(
                        t.span(),
                        format!(
                            "timezone {timezone:?} is not an IANA time zone name such as \"Europe/Berlin\" or \"UTC\""
                        ),
                    );
                }
                None
            }
        };
        if !ok {
            return None;
        }
        Some(CalendarSpec { period: period?, timezone, zone: zone? })
    }

    /// A concurrency rule's slot TTL, which stands in its `window`: keys
    /// that mean nothing for requests in flight are refused rather than
    /// silently ignored.
    fn concurrency(&mut self, r: &RawRule) -> Option<Duration> {
        if let Some(w) = &r.window {
            self.error(
                w.span(),
                "a concurrency rule has no window: it counts requests in flight (slot_ttl bounds how long a crashed instance's slots stay counted)",
            );
        }
        if let Some(b) = &r.burst {
            self.error(b.span(), "a concurrency rule has no burst: limit is the number of requests in flight");
        }
        if let Some(c) = &r.cost {
            self.error(c.span(), "a concurrency rule has no cost: every request in flight holds one slot");
        }
        if let Some(c) = &r.cost_header {
            self.error(c.span(), "a concurrency rule has no cost_header: every request in flight holds one slot");
        }
        let Some(raw) = &r.slot_ttl else { return Some(DEFAULT_SLOT_TTL) };
        let ttl = self.duration(raw, "slot_ttl")?;
        if !(MIN_SLOT_TTL..=MAX_SLOT_TTL).contains(&ttl) {
            self.error(raw.span(), "slot_ttl must be between 1s and 1h");
        }
        Some(ttl)
    }

    fn matcher(&mut self, m: RawMatch, config: &Config) -> MatchSpec {
        let mut spec = MatchSpec::default();
        for method in m.methods.iter().flatten() {
            match Method::from_bytes(method.get_ref().to_ascii_uppercase().as_bytes()) {
                Ok(x) => spec.methods.push(x),
                Err(_) => self.error(method.span(), format!("{:?} is not an HTTP method", method.get_ref())),
            }
        }
        if let Some(p) = &m.path {
            let s = p.get_ref();
            if !s.starts_with('/') {
                self.error(p.span(), format!("match.path {s:?} must start with '/'"));
            } else {
                let (text, prefix) = match s.strip_suffix('*') {
                    Some(prefix) => (prefix, true),
                    None => (s.as_str(), false),
                };
                // Requests are matched by their canonical path (see
                // crate::wire::normalize), so rule paths are written in it too;
                // an exact path ignores a trailing '/', as requests' do.
                let canonical = toml::Spanned::new(p.span(), text.to_string());
                if text.contains('*') {
                    self.error(p.span(), format!("match.path {s:?}: '*' is allowed only at the end (a prefix match)"));
                } else if let Some(c) = self.canonical_path(&canonical, "match.path", &config.listen.normalization) {
                    spec.path = Some(if prefix {
                        PathPattern::Prefix(c)
                    } else {
                        PathPattern::Exact(crate::wire::normalize::match_path(&c).to_string())
                    });
                }
            }
        }
        spec.host = m.host.map(|h| canonical_host(&h));
        if let Some(route) = &m.route {
            if config.upstream_index(route.get_ref()).is_none()
                && !config.routes.iter().any(|r| r.name == *route.get_ref())
            {
                self.error(
                    route.span(),
                    format!(
                        "match.route {:?} is not the name of any upstream or route in {}",
                        route.get_ref(),
                        config.path.display()
                    ),
                );
            } else {
                spec.route = Some(route.get_ref().clone());
            }
        }
        if let Some(h) = &m.header
            && let Some(name) = self.header_name(&h.name, "match.header.name")
        {
            spec.header = Some((name, h.value.clone()));
        }
        spec
    }

    fn key_part(&mut self, part: &Spanned<String>) -> Option<KeyPart> {
        let s = part.get_ref().trim();
        let parsed = match s {
            "ip" => Some(KeyPart::Ip),
            "user" => Some(KeyPart::User),
            "api_key" => Some(KeyPart::ApiKey),
            "route" => Some(KeyPart::Route),
            "method" => Some(KeyPart::Method),
            "path" => Some(KeyPart::Path),
            "client_cert" => Some(KeyPart::ClientCert),
            _ => match s.strip_prefix("header:") {
                Some(h) => HeaderName::from_bytes(h.trim().as_bytes()).ok().map(KeyPart::Header),
                None => s.strip_prefix("query:").filter(|q| !q.is_empty()).map(|q| KeyPart::Query(q.to_string())),
            },
        };
        if parsed.is_none() {
            self.error(part.span(), format!("key part {s:?} is not one of ip, user, api_key, route, method, path, client_cert, \"header:NAME\", \"query:NAME\""));
        }
        parsed
    }
}

/// [`rule_files`], or none when the path cannot be read (for change
/// detection, where an unreadable path is simply a state to compare).
pub fn rule_files_or_empty(path: &Path) -> Vec<PathBuf> {
    rule_files(path).unwrap_or_default()
}
