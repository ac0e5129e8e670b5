//! A rule's limits per key and per tier: `[[rule.override]]` tables, and
//! `tier` with `tiers`. Each gives some requests of the rule other limits
//! than the rule's own; the counters stay the rule's, one per key.

use std::collections::BTreeMap;

use http::HeaderName;
use toml::Spanned;

use super::raw::RawOverride;
use super::spec::{Cost, KeyPart, MAX_COUNT, OverrideSpec, TierSource, TiersSpec};
use super::validate::Validator;
use crate::limiter::Algorithm;

/// What an override's or tier's limits are checked against: the rule's.
pub(super) struct Base<'a> {
    pub name: &'a str,
    pub key: &'a [KeyPart],
    pub algorithm: Algorithm,
    pub limit: u64,
    pub burst: u64,
    pub cost: &'a Cost,
    /// `max_cost` as written, if it was.
    pub max_cost: Option<u64>,
    /// `client.ipv6_prefix`: an IPv6 override must name a prefix of it.
    pub ipv6_prefix: u8,
}

impl Base<'_> {
    /// The burst of limits without their own: the rule's burst-to-limit
    /// ratio kept (without a `burst` in the rule, the limit itself).
    fn scaled_burst(&self, limit: u64) -> u64 {
        let b = (u128::from(limit) * u128::from(self.burst)).div_ceil(u128::from(self.limit.max(1)));
        u64::try_from(b).unwrap_or(u64::MAX).min(MAX_COUNT as u64)
    }
}

impl Validator<'_> {
    /// `[[rule.override]]` tables, with their keys in the form the rule
    /// builds them.
    pub(super) fn overrides(&mut self, raw: Vec<Spanned<RawOverride>>, base: &Base<'_>) -> Vec<OverrideSpec> {
        let mut out: Vec<OverrideSpec> = Vec::new();
        for o in raw {
            let line = self.lines.line(o.span().start);
            let span = o.span();
            let o = o.into_inner();
            let Some(key) = &o.key else {
                self.error(span, "an override needs a key (the key as `tollgate explain` shows it)");
                continue;
            };
            let Some(limit) = &o.limit else {
                self.error(span, "an override needs a limit");
                continue;
            };
            let canonical = match override_key(key.get_ref(), base) {
                Ok(k) => Some(k),
                Err(why) => {
                    self.error(key.span(), format!("override key {:?}: {why}", key.get_ref()));
                    None
                }
            };
            let limits = self.variant(limit, o.burst.as_ref(), base, "override");
            let (Some(key_text), Some((limit, burst))) = (canonical, limits) else { continue };
            if let Some(first) = out.iter().find(|x| x.key == key_text) {
                self.error(key.span(), format!("override key {key_text:?} is already set at line {}", first.line));
                continue;
            }
            out.push(OverrideSpec { key: key_text, limit, burst, line });
        }
        out
    }

    /// `tier` and `tiers`, which come together. `jwt` says whether
    /// `[client] jwt` is configured (a `claim:` tier needs it).
    pub(super) fn tiers(
        &mut self,
        tier: Option<&Spanned<String>>,
        tiers: Option<&Spanned<BTreeMap<String, Spanned<toml::Value>>>>,
        base: &Base<'_>,
        jwt: bool,
    ) -> Option<TiersSpec> {
        let (tier, tiers) = match (tier, tiers) {
            (None, None) => return None,
            (Some(t), None) => {
                self.error(t.span(), "tier needs tiers = { NAME = LIMIT, ..., default = LIMIT }");
                return None;
            }
            (None, Some(t)) => {
                self.error(t.span(), "tiers needs tier = \"header:NAME\" or \"claim:NAME\" to choose one");
                return None;
            }
            (Some(a), Some(b)) => (a, b),
        };
        let source = self.tier_source(tier, jwt)?;
        let mut default = None;
        let mut list = Vec::new();
        let errors_before = self.errors.len();
        for (name, value) in tiers.get_ref() {
            let Some((limit, burst)) = self.tier_value(name, value) else { continue };
            let Some(limits) = self.variant(&limit, burst.as_ref(), base, &format!("tier {name:?}")) else { continue };
            if name == "default" {
                default = Some(limits);
            } else {
                list.push((name.clone(), limits.0, limits.1));
            }
        }
        if self.errors.len() > errors_before {
            return None;
        }
        let Some(default) = default else {
            self.error(
                tiers.span(),
                "tiers needs a default: the limit of requests without a tier or with an unknown one",
            );
            return None;
        };
        Some(TiersSpec { source, tiers: list, default })
    }

    /// `tier = "header:NAME"` or `"claim:NAME"` (a claim only with
    /// `[client] jwt`).
    fn tier_source(&mut self, tier: &Spanned<String>, jwt: bool) -> Option<TierSource> {
        let text = tier.get_ref().trim();
        let source = if let Some(h) = text.strip_prefix("header:") {
            HeaderName::from_bytes(h.trim().as_bytes()).ok().map(TierSource::Header)
        } else if let Some(c) = text.strip_prefix("claim:") {
            let c = c.trim();
            if c.is_empty() {
                None
            } else if !jwt {
                self.error(tier.span(), format!("tier {text:?} reads a JWT claim: configure [client] jwt first"));
                return None;
            } else {
                Some(TierSource::Claim(c.to_string()))
            }
        } else {
            None
        };
        if source.is_none() {
            self.error(tier.span(), format!("tier {text:?} is not \"header:NAME\" or \"claim:NAME\""));
        }
        source
    }

    /// One entry of `tiers`: a limit, or `{ limit, burst }`.
    #[allow(clippy::type_complexity)]
    fn tier_value(&mut self, name: &str, value: &Spanned<toml::Value>) -> Option<(Spanned<i64>, Option<Spanned<i64>>)> {
        match value.get_ref() {
            toml::Value::Integer(n) => Some((Spanned::new(value.span(), *n), None)),
            toml::Value::Table(t) => {
                if let Some(k) = t.keys().find(|k| *k != "limit" && *k != "burst") {
                    self.error(value.span(), format!("tier {name:?}: unknown key {k:?} (limit, burst)"));
                    return None;
                }
                let int = |k: &str| t.get(k).and_then(toml::Value::as_integer);
                let Some(limit) = int("limit") else {
                    self.error(value.span(), format!("tier {name:?} needs a whole-number limit"));
                    return None;
                };
                if t.contains_key("burst") && int("burst").is_none() {
                    self.error(value.span(), format!("tier {name:?}: burst must be a whole number"));
                    return None;
                }
                Some((Spanned::new(value.span(), limit), int("burst").map(|b| Spanned::new(value.span(), b))))
            }
            _ => {
                self.error(
                    value.span(),
                    format!("tier {name:?} must be a limit (a whole number) or {{ limit, burst }}"),
                );
                None
            }
        }
    }

    /// An override's or tier's limit and burst, within the rule's bounds.
    fn variant(
        &mut self,
        limit: &Spanned<i64>,
        burst: Option<&Spanned<i64>>,
        base: &Base<'_>,
        what: &str,
    ) -> Option<(u64, u64)> {
        let l = self.count(limit, &format!("{what} limit"));
        let b = match burst {
            Some(b) => self.count(b, &format!("{what} burst")),
            None => l.map(|l| base.scaled_burst(l)),
        };
        let (l, b) = (l?, b?);
        let capacity = if matches!(base.algorithm, Algorithm::TokenBucket | Algorithm::LeakyBucket) { b } else { l };
        let most = match base.cost {
            Cost::Fixed(n) => Some(("cost", *n)),
            Cost::Header(_) => base.max_cost.map(|m| ("max_cost", m)),
        };
        if let Some((name, n)) = most
            && n > capacity
        {
            let at = burst.filter(|_| capacity == b).unwrap_or(limit);
            self.error(
                at.span(),
                format!(
                    "{what}: the rule's {name} {n} is larger than its bucket ({capacity}): no request could ever pass"
                ),
            );
            return None;
        }
        Some((l, b))
    }
}

/// An override key in the form the rule builds keys (see
/// [`crate::limit::rules::Rule::key`]): one `tag=value` per key part, joined by
/// `|`, optionally after the rule's encoded name and a `|` (the whole
/// bucket as `explain` prints it). Values are accepted as `explain` shows
/// them (percent-encoded) or plain; an `api_key` value is its SHA-256 in hex,
/// or else the API key itself, hashed here; an `ip` value is any spelling of
/// the address. Any part may be `ip=ADDRESS`, the fallback of a request
/// that lacks the part.
/// An override's address as requests are keyed: an IPv4-mapped one as IPv4;
/// an IPv6 one must be the prefix clients are keyed by, or it would never
/// match.
fn override_ip(value: &str, ipv6_prefix: u8) -> Result<std::net::IpAddr, String> {
    let ip: std::net::IpAddr = value.parse().map_err(|_| format!("{value:?} is not an IP address"))?;
    let keyed = crate::wire::client::key_addr(ip, ipv6_prefix);
    if keyed.is_ipv6() && keyed != ip {
        return Err(format!(
            "{value} is an IPv6 address inside a /{ipv6_prefix}; IPv6 clients are keyed by their /{ipv6_prefix} \
             (`client.ipv6_prefix`), so write ip={keyed}"
        ));
    }
    Ok(keyed)
}

/// An override's `api_key` value: `sha256:` and 64 hex digits is the key's
/// hash (what `explain` and `/top` print); anything else is the key itself,
/// hashed here. One reading each: a key that happens to be 64 hex digits is
/// a key.
fn api_key_value(out: &mut String, value: &str) -> Result<(), String> {
    out.push_str("sha256:");
    match value.strip_prefix("sha256:") {
        Some(hex) if hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()) => {
            out.push_str(&hex.to_ascii_lowercase());
        }
        Some(_) => return Err("sha256: must be followed by the key's SHA-256 in 64 hex digits".into()),
        None if value.is_empty() => return Err("an api_key value must not be empty".into()),
        None => super::key::push_sha256_hex(out, value.as_bytes()),
    }
    Ok(())
}

fn override_key(text: &str, base: &Base<'_>) -> Result<String, String> {
    let text = text.trim();
    let mut segments: Vec<&str> = text.split('|').collect();
    // The rule's name cannot contain '=' once encoded, and every part does.
    if segments.len() > base.key.len() && !segments[0].contains('=') {
        let mut name = String::new();
        super::key::encode(&mut name, base.name.as_bytes());
        if segments[0] != name {
            return Err(format!("it names rule {:?}, not this rule", segments[0]));
        }
        segments.remove(0);
    }
    if segments.len() != base.key.len() {
        let parts: Vec<String> = base.key.iter().map(KeyPart::describe).collect();
        return Err(format!(
            "the rule's key [{}] has {} part(s), this has {}: write one tag=value per part, joined by '|'",
            parts.join(", "),
            base.key.len(),
            segments.len()
        ));
    }
    let mut out = String::new();
    for (i, (segment, part)) in segments.iter().zip(base.key).enumerate() {
        if i > 0 {
            out.push('|');
        }
        let want = super::key::tag(part);
        let Some((tag, value)) = segment.split_once('=') else {
            return Err(format!("{segment:?} is not {want}=VALUE"));
        };
        if tag == "ip" && matches!(part, KeyPart::Route | KeyPart::Method | KeyPart::Path) {
            return Err(format!("part {} ({}) is never keyed by ip: every request has one", i + 1, part.describe()));
        }
        if tag == "ip" || matches!(part, KeyPart::Ip) {
            if tag != "ip" {
                return Err(format!("part {} is keyed as ip=ADDRESS, not {tag}=", i + 1));
            }
            out.push_str("ip=");
            out.push_str(&override_ip(value, base.ipv6_prefix)?.to_string());
            continue;
        }
        if tag != want {
            return Err(format!(
                "part {} ({}) is keyed as {want}=VALUE (or ip=ADDRESS when a request lacks it), not {tag}=",
                i + 1,
                part.describe()
            ));
        }
        out.push_str(tag);
        out.push('=');
        if matches!(part, KeyPart::ApiKey) {
            api_key_value(&mut out, value)?;
        } else if value.is_empty() && !matches!(part, KeyPart::Route) {
            return Err(format!("part {} has an empty value, which requests key as ip=ADDRESS", i + 1));
        } else if value.starts_with('~') && value.len() > 33 && value[1..].bytes().all(|b| b.is_ascii_hexdigit()) {
            // A long value, shown by `explain` as its hash.
            out.push_str(value);
        } else {
            super::key::encode(&mut out, &percent_decode(value));
        }
    }
    Ok(out)
}

/// `%XX` escapes decoded; anything else kept as it is.
fn percent_decode(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |k: usize| b.get(k).and_then(|c| (*c as char).to_digit(16));
        if let (b'%', Some(hi), Some(lo)) = (b[i], hex(i + 1), hex(i + 2)) {
            out.push((hi * 16 + lo) as u8);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests;
