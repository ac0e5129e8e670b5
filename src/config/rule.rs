//! One `[[rule]]`, validated into a [`RuleSpec`]: its algorithm and limits,
//! its window (or calendar, or a concurrency rule's slot TTL), throttle and
//! cost; which requests it counts and how it keys them are read in
//! [`super::rule_match`], its overrides and tiers in [`super::overrides`].

use std::time::Duration;

use http::HeaderName;
use toml::Spanned;

use super::main_file::Config;
use super::overrides::Base;
use super::raw::RawRule;
use super::spec::{
    CalendarSpec, ClientSet, Cost, DEFAULT_MAX_COST, DEFAULT_SLOT_TTL, KeyPart, MAX_COUNT, MAX_SLOT_TTL, MIN_SLOT_TTL,
    MatchSpec, RuleSpec, Throttle,
};
use super::validate::Validator;
use crate::limiter::Algorithm;

/// The shortest and longest `penalty`: under a second it would end
/// before `Retry-After` (whole seconds) could say so.
const MIN_PENALTY: Duration = Duration::from_secs(1);
const MAX_PENALTY: Duration = Duration::from_secs(366 * 86_400);
/// The most refusals `penalty_after` may wait for.
const MAX_PENALTY_AFTER: i64 = 1_000_000;

impl Validator<'_> {
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

    pub(super) fn rule(&mut self, mut r: RawRule, line: usize, config: &Config) -> Option<RuleSpec> {
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
        let count_status = self.count_status(r.count_status.as_ref(), algorithm);
        let quota_unit = self.quota_unit(&r);
        let penalty = self.penalty(&r, algorithm);
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
            count_status,
            quota_unit,
            on_error: r.on_error,
            exempt,
            on_invalid_token: r.on_invalid_token.unwrap_or_default(),
            overrides,
            tiers,
            penalty,
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

    /// `penalty` and `penalty_after`. Not for concurrency rules (a slot
    /// comes back when a request ends, there is no window to refuse in)
    /// nor shadow rules (they never refuse, so the box would refuse
    /// nothing either).
    fn penalty(&mut self, r: &RawRule, algorithm: Algorithm) -> Option<crate::limiter::Penalty> {
        let Some(raw) = &r.penalty else {
            if let Some(a) = &r.penalty_after {
                self.error(
                    a.span(),
                    "penalty_after counts refusals before a penalty: set penalty too (such as \"15m\")",
                );
            }
            return None;
        };
        let duration = self.duration(raw, "penalty")?;
        if !(MIN_PENALTY..=MAX_PENALTY).contains(&duration) {
            self.error(raw.span(), "penalty must be between 1s and 366d");
        }
        if algorithm == Algorithm::Concurrency {
            self.error(raw.span(), "a concurrency rule has no penalty: its slots come back as requests end");
        }
        if r.mode == Some(super::RuleMode::Shadow) {
            self.error(
                raw.span(),
                "a shadow rule has no penalty: it never refuses, so its penalty box would refuse nothing",
            );
        }
        let after = match &r.penalty_after {
            None => 1,
            Some(a) if *a.get_ref() > MAX_PENALTY_AFTER => {
                self.error(a.span(), format!("penalty_after must be at most {MAX_PENALTY_AFTER}"));
                1
            }
            Some(a) => self.count(a, "penalty_after")? as u32,
        };
        Some(crate::limiter::Penalty { duration: crate::limiter::Nanos::try_from(duration.as_nanos()).ok()?, after })
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
}
