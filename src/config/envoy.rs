//! `[[envoy]]` entries of the rules files: which Envoy rate limit
//! descriptors (`[listen] envoy_rls`) a rule decides, and which descriptor
//! entry gives each of its key parts.
//!
//! ```toml
//! [[envoy]]
//! domain = "edge"                          # RateLimitRequest.domain
//! match = { generic_key = "checkout" }     # entries that must be there, with these values
//! key = { user = "user_id" }               # each key part of the rule: the entry holding its value
//! tier = "plan"                            # optional, for a rule with tiers: the entry naming the tier
//! rule = "per-user"
//! ```
//!
//! A descriptor is covered by an entry when the domain is the entry's and
//! its entries are exactly those of `match` (with their values), those
//! named in `key` (any value) and, if present, the `tier` entry, in any
//! order. Entries are tried in file order; the first that covers a
//! descriptor decides it.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};
use toml::Spanned;

use super::raw::RawEnvoy;
use super::{ConfigError, RuleSpec};

/// One validated `[[envoy]]` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvoyMapping {
    pub domain: String,
    /// The rule's name.
    pub rule: String,
    /// Descriptor entries that must be present with exactly these values.
    pub fixed: Vec<(String, String)>,
    /// For each part of the rule's key list, in order: the part as written
    /// there, and the descriptor entry whose value it takes.
    pub parts: Vec<(String, String)>,
    /// The descriptor entry whose value is the tier (a rule with `tiers`
    /// only); a descriptor without it gets the `default` tier.
    pub tier: Option<String>,
    pub source: PathBuf,
    pub line: usize,
}

impl EnvoyMapping {
    /// The values of the rule's key parts, named as in its key list (the
    /// decision API's `key` object), and the tier the descriptor states,
    /// when this entry covers a descriptor of `domain` with `entries`;
    /// `None` when it does not.
    pub fn key_of<'e>(
        &self,
        domain: &str,
        entries: impl Iterator<Item = (&'e str, &'e str)> + Clone,
    ) -> Option<(Map<String, Value>, Option<&'e str>)> {
        if domain != self.domain {
            return None;
        }
        let find = |key: &str| entries.clone().find(|(k, _)| *k == key).map(|(_, v)| v);
        let tier = self.tier.as_deref().and_then(find);
        // The tier entry is one more entry, unless a key part reads it too.
        let tier_alone = tier.is_some() && !self.parts.iter().any(|(_, e)| Some(e) == self.tier.as_ref());
        if entries.clone().count() != self.fixed.len() + self.parts.len() + usize::from(tier_alone) {
            return None;
        }
        if !self.fixed.iter().all(|(k, v)| find(k) == Some(v.as_str())) {
            return None;
        }
        let mut key = Map::new();
        for (part, entry) in &self.parts {
            key.insert(part.clone(), Value::String(find(entry)?.to_string()));
        }
        Some((key, tier))
    }
}

/// Checks a file's `[[envoy]]` entries against the rules known so far (this
/// file's and the files before it): the rule exists and every part of its
/// key, and nothing else, is mapped to a descriptor entry.
pub fn resolve(
    file: &Path,
    source: &str,
    raw: Vec<Spanned<RawEnvoy>>,
    rules: &[std::sync::Arc<RuleSpec>],
) -> (Vec<EnvoyMapping>, Vec<ConfigError>) {
    let mut out = Vec::with_capacity(raw.len());
    let mut errors = Vec::new();
    if raw.is_empty() {
        // No line table of a file of 10,000 rules for no mapping.
        return (out, errors);
    }
    let mut error = |span: Range<usize>, message: String| {
        errors.push(ConfigError::at(file, source, Some(span), message));
    };
    let lines = super::error::Lines::of(source);
    for e in raw {
        let line = lines.line(e.span().start);
        out.extend(mapping(file, line, e.into_inner(), rules, &mut error));
    }
    (out, errors)
}

/// One `[[envoy]]` entry, or `None` once `error` was told what is wrong
/// with it.
fn mapping(
    file: &Path,
    line: usize,
    e: RawEnvoy,
    rules: &[std::sync::Arc<RuleSpec>],
    error: &mut impl FnMut(Range<usize>, String),
) -> Option<EnvoyMapping> {
    if e.domain.get_ref().is_empty() {
        error(e.domain.span(), "[[envoy]] domain must not be empty".into());
        return None;
    }
    let Some(rule) = rules.iter().find(|r| r.name == *e.rule.get_ref()) else {
        error(
            e.rule.span(),
            format!(
                "[[envoy]] names rule {:?}, which is not defined in this file or a rules file before it",
                e.rule.get_ref()
            ),
        );
        return None;
    };
    if rule.algorithm.holds() {
        // Envoy never says when a request ends: a slot would never be
        // given back.
        error(
            e.rule.span(),
            format!(
                "[[envoy]] names rule {:?}, which limits requests in flight (algorithm = \"concurrency\"): Envoy's rate limit service cannot hold a slot",
                rule.name
            ),
        );
        return None;
    }
    let fixed: Vec<(String, String)> =
        e.matcher.as_ref().map(|m| m.get_ref().clone().into_iter().collect()).unwrap_or_default();
    let (key_span, key) = match &e.key {
        Some(k) => (k.span(), k.get_ref().clone()),
        None => (e.rule.span(), BTreeMap::new()),
    };
    let (parts, mut ok) = key_parts(rule, &key, &key_span, &fixed, error);
    let tier = e.tier.map(|t| (t.span(), t.into_inner()));
    if let Some((span, entry)) = &tier {
        if rule.tiers.is_none() {
            error(span.clone(), format!("[[envoy]] tier names an entry, but rule {:?} has no tiers", rule.name));
            ok = false;
        } else if fixed.iter().any(|(k, _)| k == entry) {
            error(span.clone(), format!("[[envoy]] descriptor entry {entry:?} is both in match and tier"));
            ok = false;
        }
    }
    if ok && fixed.is_empty() && parts.is_empty() {
        // Rule keyed on nothing and no `match`: would cover only a
        // descriptor without entries, which Envoy never sends.
        error(
            e.rule.span(),
            "[[envoy]] needs a match (e.g. match = { generic_key = \"checkout\" }): Envoy never sends a descriptor without entries".into(),
        );
        ok = false;
    }
    ok.then(|| EnvoyMapping {
        domain: e.domain.into_inner(),
        rule: rule.name.clone(),
        fixed,
        parts,
        tier: tier.map(|(_, t)| t),
        source: file.to_path_buf(),
        line,
    })
}

/// The descriptor entry of each part of `rule`'s key, as `key` maps them;
/// and whether every part, and nothing else, is mapped.
fn key_parts(
    rule: &RuleSpec,
    key: &BTreeMap<String, String>,
    key_span: &Range<usize>,
    fixed: &[(String, String)],
    error: &mut impl FnMut(Range<usize>, String),
) -> (Vec<(String, String)>, bool) {
    let spelled: Vec<String> = rule.key.iter().map(|p| p.describe()).collect();
    let mut ok = true;
    for name in key.keys() {
        if !spelled.contains(name) {
            error(
                key_span.clone(),
                format!(
                    "[[envoy]] key maps {name:?}, which is not a key part of rule {:?} (its key: {spelled:?})",
                    rule.name
                ),
            );
            ok = false;
        }
    }
    let mut parts = Vec::with_capacity(spelled.len());
    for part in &spelled {
        match key.get(part) {
            Some(entry) if fixed.iter().any(|(k, _)| k == entry) => {
                error(key_span.clone(), format!("[[envoy]] descriptor entry {entry:?} is both in match and in key"));
                ok = false;
            }
            Some(entry) => parts.push((part.clone(), entry.clone())),
            None => {
                error(
                    key_span.clone(),
                    format!(
                        "[[envoy]] key must name the descriptor entry for {part:?}, a key part of rule {:?}, e.g. key = {{ {part:?} = \"...\" }}",
                        rule.name
                    ),
                );
                ok = false;
            }
        }
    }
    (parts, ok)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::super::{Config, ConfigErrors, LoadedRules, load_rules};

    const RULES: &str = "[[rule]]\nname = \"per-user\"\nkey = [\"user\", \"header:x-tier\"]\nlimit = 5\nwindow = \"1m\"\n\n[[rule]]\nname = \"global\"\nkey = []\nlimit = 100\nwindow = \"1s\"\n\n";

    fn load(files: &[(&str, &str)]) -> Result<LoadedRules, ConfigErrors> {
        let dir = tempfile::tempdir().expect("tempdir");
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text).expect("write");
        }
        let config = Config::parse(Path::new("/etc/tollgate/tollgate.toml"), "").expect("empty main file");
        load_rules(dir.path(), &config).map_err(|mut e| {
            // Paths relative to the temporary directory, for exact messages.
            for err in &mut e.0 {
                err.file = err.file.strip_prefix(dir.path()).map(Path::to_path_buf).unwrap_or(err.file.clone());
            }
            e
        })
    }

    fn errors(envoy: &str) -> Vec<String> {
        match load(&[("r.toml", &format!("{RULES}{envoy}"))]) {
            Ok(_) => panic!("expected errors for:\n{envoy}"),
            Err(e) => e.0.iter().map(ToString::to_string).collect(),
        }
    }

    #[test]
    fn a_mapping_gives_each_key_part_its_entry_in_the_rules_order() {
        let loaded = load(&[(
            "r.toml",
            &format!(
                "{RULES}[[envoy]]\ndomain = \"edge\"\nmatch = {{ generic_key = \"checkout\" }}\nkey = {{ \"header:x-tier\" = \"tier\", user = \"user_id\" }}\nrule = \"per-user\"\n"
            ),
        )])
        .expect("valid");
        let m = &loaded.envoy[0];
        assert_eq!((m.domain.as_str(), m.rule.as_str(), m.line), ("edge", "per-user", 13));
        assert_eq!(m.fixed, [("generic_key".to_string(), "checkout".to_string())]);
        assert_eq!(
            m.parts,
            [("user".to_string(), "user_id".to_string()), ("header:x-tier".to_string(), "tier".to_string())]
        );
        // Exactly these entries, in any order.
        let key = m.key_of("edge", [("tier", "gold"), ("user_id", "alice"), ("generic_key", "checkout")].into_iter());
        assert_eq!(key.expect("covered").0.get("user").and_then(|v| v.as_str()), Some("alice"));
        assert!(
            m.key_of("other", [("tier", "gold"), ("user_id", "a"), ("generic_key", "checkout")].into_iter()).is_none()
        );
        assert!(m.key_of("edge", [("tier", "gold"), ("user_id", "a"), ("generic_key", "cart")].into_iter()).is_none());
        assert!(m.key_of("edge", [("user_id", "a"), ("generic_key", "checkout")].into_iter()).is_none());
        assert!(
            m.key_of("edge", [("tier", "g"), ("user_id", "a"), ("generic_key", "checkout"), ("x", "y")].into_iter())
                .is_none()
        );
        assert!(m.key_of("edge", [("tier", "g"), ("tier", "g"), ("generic_key", "checkout")].into_iter()).is_none());
    }

    #[test]
    fn a_tier_entry_is_optional_and_may_be_a_key_parts_entry() {
        let tiered = "[[rule]]\nname = \"tiered\"\nkey = [\"user\", \"header:x-plan\"]\nlimit = 5\nwindow = \"1m\"\ntier = \"header:x-plan\"\ntiers = { pro = 50, default = 5 }\n\n";
        let loaded = load(&[(
            "r.toml",
            &format!(
                "{tiered}[[envoy]]\ndomain = \"edge\"\nmatch = {{ generic_key = \"a\" }}\nkey = {{ user = \"u\", \"header:x-plan\" = \"p\" }}\ntier = \"plan\"\nrule = \"tiered\"\n\n[[envoy]]\ndomain = \"edge\"\nmatch = {{ generic_key = \"b\" }}\nkey = {{ user = \"u\", \"header:x-plan\" = \"p\" }}\ntier = \"p\"\nrule = \"tiered\"\n"
            ),
        )])
        .expect("valid");
        let (alone, shared) = (&loaded.envoy[0], &loaded.envoy[1]);
        let covered = |m: &super::EnvoyMapping, e: &[(&'static str, &'static str)]| {
            m.key_of("edge", e.iter().copied()).map(|(_, tier)| tier)
        };
        assert_eq!(covered(alone, &[("generic_key", "a"), ("u", "x"), ("p", "y"), ("plan", "pro")]), Some(Some("pro")));
        assert_eq!(covered(alone, &[("generic_key", "a"), ("u", "x"), ("p", "y")]), Some(None), "no tier: default");
        assert_eq!(covered(alone, &[("generic_key", "a"), ("u", "x"), ("p", "y"), ("other", "pro")]), None);
        assert_eq!(covered(shared, &[("generic_key", "b"), ("u", "x"), ("p", "pro")]), Some(Some("pro")));
        assert_eq!(covered(shared, &[("generic_key", "b"), ("u", "x"), ("p", "pro"), ("plan", "pro")]), None);
    }

    #[test]
    fn a_tier_entry_needs_a_rule_with_tiers_and_is_not_matched() {
        assert_eq!(
            errors("[[envoy]]\ndomain = \"edge\"\nmatch = { a = \"b\" }\ntier = \"plan\"\nrule = \"global\"\n"),
            ["r.toml:16:8: [[envoy]] tier names an entry, but rule \"global\" has no tiers"]
        );
        let tiered = "[[rule]]\nname = \"tiered\"\nkey = []\nlimit = 5\nwindow = \"1m\"\ntier = \"header:x-plan\"\ntiers = { pro = 50, default = 5 }\n\n";
        assert_eq!(
            errors(&format!(
                "{tiered}[[envoy]]\ndomain = \"edge\"\nmatch = {{ a = \"b\" }}\ntier = \"a\"\nrule = \"tiered\"\n"
            )),
            ["r.toml:24:8: [[envoy]] descriptor entry \"a\" is both in match and tier"]
        );
    }

    #[test]
    fn a_mapping_may_name_a_rule_of_an_earlier_file_only() {
        let envoy = "[[envoy]]\ndomain = \"edge\"\nmatch = { generic_key = \"all\" }\nrule = \"global\"\n";
        assert_eq!(load(&[("a.toml", RULES), ("b.toml", envoy)]).expect("valid").envoy.len(), 1);
        let e = load(&[("a.toml", envoy), ("b.toml", RULES)]).expect_err("rule comes later");
        assert_eq!(
            e.0.iter().map(ToString::to_string).collect::<Vec<_>>(),
            [
                "a.toml:4:8: [[envoy]] names rule \"global\", which is not defined in this file or a rules file before it"
            ]
        );
    }

    #[test]
    fn every_mistake_has_its_position() {
        assert_eq!(
            errors("[[envoy]]\ndomain = \"\"\nmatch = { a = \"b\" }\nrule = \"global\"\n"),
            ["r.toml:14:10: [[envoy]] domain must not be empty"]
        );
        assert_eq!(
            errors("[[envoy]]\ndomain = \"edge\"\nrule = \"global\"\n"),
            [
                "r.toml:15:8: [[envoy]] needs a match (e.g. match = { generic_key = \"checkout\" }): Envoy never sends a descriptor without entries"
            ]
        );
        assert_eq!(
            errors("[[envoy]]\ndomain = \"edge\"\nkey = { user = \"u\" }\nrule = \"per-user\"\n"),
            [
                "r.toml:15:7: [[envoy]] key must name the descriptor entry for \"header:x-tier\", a key part of rule \"per-user\", e.g. key = { \"header:x-tier\" = \"...\" }"
            ]
        );
        assert_eq!(
            errors(
                "[[envoy]]\ndomain = \"edge\"\nkey = { user = \"u\", \"header:x-tier\" = \"t\", ip = \"addr\" }\nrule = \"per-user\"\n"
            ),
            [
                "r.toml:15:7: [[envoy]] key maps \"ip\", which is not a key part of rule \"per-user\" (its key: [\"user\", \"header:x-tier\"])"
            ]
        );
        assert_eq!(
            errors(
                "[[envoy]]\ndomain = \"edge\"\nmatch = { u = \"x\" }\nkey = { user = \"u\", \"header:x-tier\" = \"t\" }\nrule = \"per-user\"\n"
            ),
            ["r.toml:16:7: [[envoy]] descriptor entry \"u\" is both in match and in key"]
        );
        assert_eq!(
            errors("[[envoy]]\ndomain = \"edge\"\nmatch = { a = \"b\" }\nrule = \"nope\"\n"),
            ["r.toml:16:8: [[envoy]] names rule \"nope\", which is not defined in this file or a rules file before it"]
        );
        assert_eq!(
            errors("[[envoy]]\ndomain = \"edge\"\nmatch = { a = \"b\" }\nrule = \"global\"\nlimit = 3\n"),
            ["r.toml:17:1: unknown field `limit`, expected one of `domain`, `rule`, `match`, `key`, `tier`"]
        );
        assert_eq!(
            errors(
                "[[rule]]\nname = \"in-flight\"\nalgorithm = \"concurrency\"\nkey = []\nlimit = 2\n\n[[envoy]]\ndomain = \"edge\"\nmatch = { a = \"b\" }\nrule = \"in-flight\"\n"
            ),
            [
                "r.toml:22:8: [[envoy]] names rule \"in-flight\", which limits requests in flight (algorithm = \"concurrency\"): Envoy's rate limit service cannot hold a slot"
            ]
        );
        assert_eq!(
            errors("[[envoy]]\nmatch = { a = \"b\" }\nrule = \"global\"\n"),
            ["r.toml:13:1: missing field `domain`"]
        );
        assert_eq!(
            errors("[[envoy]]\ndomain = \"edge\"\nmatch = { a = 1 }\nrule = \"global\"\n"),
            ["r.toml:15:15: invalid type: integer `1`, expected a string"]
        );
    }
}
