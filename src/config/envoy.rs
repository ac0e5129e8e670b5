//! `[[envoy]]` entries of the rules files: which Envoy rate limit
//! descriptors (`[listen] envoy_rls`) a rule decides, and which descriptor
//! entry gives each of its key parts.
//!
//! ```toml
//! [[envoy]]
//! domain = "edge"                          # RateLimitRequest.domain
//! match = { generic_key = "checkout" }     # entries that must be there, with these values
//! key = { user = "user_id" }               # each key part of the rule: the entry holding its value
//! rule = "per-user"
//! ```
//!
//! A descriptor is covered by an entry when the domain is the entry's and
//! its entries are exactly those of `match` (with their values) and those
//! named in `key` (any value), in any order. Entries are tried in file
//! order; the first that covers a descriptor decides it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::{Map, Value};
use toml::Spanned;

use super::{ConfigError, RuleSpec};

/// `[[envoy]]` as serde reads it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawEnvoy {
    pub domain: Spanned<String>,
    pub rule: Spanned<String>,
    #[serde(rename = "match")]
    pub matcher: Option<Spanned<BTreeMap<String, String>>>,
    pub key: Option<Spanned<BTreeMap<String, String>>>,
}

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
    pub source: PathBuf,
    pub line: usize,
}

impl EnvoyMapping {
    /// The values of the rule's key parts, named as in its key list (the
    /// decision API's `key` object), when this entry covers a descriptor of
    /// `domain` with `entries`; `None` when it does not.
    pub fn key_of<'e>(
        &self,
        domain: &str,
        entries: impl Iterator<Item = (&'e str, &'e str)> + Clone,
    ) -> Option<Map<String, Value>> {
        if domain != self.domain || entries.clone().count() != self.fixed.len() + self.parts.len() {
            return None;
        }
        let find = |key: &str| entries.clone().find(|(k, _)| *k == key).map(|(_, v)| v);
        if !self.fixed.iter().all(|(k, v)| find(k) == Some(v.as_str())) {
            return None;
        }
        let mut key = Map::new();
        for (part, entry) in &self.parts {
            key.insert(part.clone(), Value::String(find(entry)?.to_string()));
        }
        Some(key)
    }
}

/// Checks a file's `[[envoy]]` entries against the rules known so far (this
/// file's and the files before it): the rule exists and every part of its
/// key, and nothing else, is mapped to a descriptor entry.
pub fn resolve(
    file: &Path,
    source: &str,
    raw: Vec<Spanned<RawEnvoy>>,
    rules: &[RuleSpec],
) -> (Vec<EnvoyMapping>, Vec<ConfigError>) {
    let mut out = Vec::with_capacity(raw.len());
    let mut errors = Vec::new();
    let mut error = |span: std::ops::Range<usize>, message: String| {
        errors.push(ConfigError::at(file, source, Some(span), message));
    };
    for e in raw {
        let line = super::line_col(source, e.span().start).0;
        let e = e.into_inner();
        if e.domain.get_ref().is_empty() {
            error(e.domain.span(), "[[envoy]] domain must not be empty".into());
            continue;
        }
        let Some(rule) = rules.iter().find(|r| r.name == *e.rule.get_ref()) else {
            error(
                e.rule.span(),
                format!(
                    "[[envoy]] names rule {:?}, which is not defined in this file or a rules file before it",
                    e.rule.get_ref()
                ),
            );
            continue;
        };
        let fixed: Vec<(String, String)> =
            e.matcher.as_ref().map(|m| m.get_ref().clone().into_iter().collect()).unwrap_or_default();
        let (key_span, key) = match &e.key {
            Some(k) => (k.span(), k.get_ref().clone()),
            None => (e.rule.span(), BTreeMap::new()),
        };
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
                    error(
                        key_span.clone(),
                        format!("[[envoy]] descriptor entry {entry:?} is both in match and in key"),
                    );
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
        if ok {
            out.push(EnvoyMapping {
                domain: e.domain.into_inner(),
                rule: rule.name.clone(),
                fixed,
                parts,
                source: file.to_path_buf(),
                line,
            });
        }
    }
    (out, errors)
}
