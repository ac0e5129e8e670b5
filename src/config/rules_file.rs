//! Rules files: reading the rules path (one file, or every `*.toml` in a
//! directory, in name order), validating each file's `[[deny]]` entries
//! and `[[rule]]`s (one rule's keys in [`super::rule`]), and the checks
//! across rules: unique names, one JWT claim for tiers, `[[envoy]]`.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use toml::Spanned;

use super::envoy::EnvoyMapping;
use super::error::{ConfigError, ConfigErrors};
use super::main_file::Config;
use super::raw::{RawEnvoy, RawRulesFile};
use super::rules_cache::RulesCache;
use super::spec::{DenySpec, RuleSpec};
use super::validate::Validator;
use super::watch::breathe_now;

/// Everything the rules path holds, validated.
#[derive(Debug, Clone, Default)]
pub struct LoadedRules {
    pub rules: Vec<Arc<RuleSpec>>,
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
    /// Shared (`Arc`): a reload keeps the rules that did not change, from
    /// the cache to the rule set in force, without copying them.
    pub rules: Vec<(Arc<RuleSpec>, std::ops::Range<usize>)>,
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
    load_rules_cached(path, config, None)
}

/// [`load_rules`] for a reload: with `cache`, a file's rules whose text did
/// not change since the last look are taken from it rather than parsed
/// again (see [`RulesCache`]).
pub fn load_rules_cached(
    path: &Path,
    config: &Config,
    mut cache: Option<&mut RulesCache>,
) -> Result<LoadedRules, ConfigErrors> {
    let files = rule_files(path)?;
    if let Some(c) = cache.as_deref_mut() {
        c.keep_only(&files);
    }
    let mut specs: Vec<Arc<RuleSpec>> = Vec::new();
    // Places in `specs` by their rule's name, across files: indices hashed
    // by the name they point at, rather than a copy of every name.
    let names = foldhash::fast::FixedState::default();
    let mut named: hashbrown::HashTable<usize> = hashbrown::HashTable::new();
    // The first rule in `specs` that reads tiers from a claim: every other
    // one there reads the same claim.
    let mut claimed: Option<usize> = None;
    let mut denies: Vec<DenySpec> = Vec::new();
    let mut envoy = Vec::new();
    let mut errors = Vec::new();
    for file in &files {
        let source = match read_text(file) {
            Ok(s) => s,
            Err(e) => {
                errors.push(ConfigError::file(file, format!("cannot read the rules file: {e}")));
                continue;
            }
        };
        // A file's valid rules take part in the duplicate check even when
        // other rules of it are broken: `tollgate check` lists every problem.
        let (parsed, mut file_errors) = match cache.as_deref_mut() {
            Some(c) => validate_cached(file, &source, config, c),
            None => validate_rules_file(file, &source, config),
        };
        denies.extend(parsed.denies);
        if files.len() == 1 {
            // One file: its names and claims were checked against each
            // other already (here, or by the cache), and there is no other.
            specs.extend(parsed.rules.into_iter().map(|(rule, _)| rule));
        } else {
            // Reserved once: a push past the capacity moves every spec.
            specs.reserve(parsed.rules.len());
            named.reserve(parsed.rules.len(), |&i| names.hash_one(&specs[i].name));
            for (rule, span) in parsed.rules {
                let hash = names.hash_one(&rule.name);
                if let Some(why) = claimed.and_then(|first| claim_conflict(&specs[first], &rule)) {
                    file_errors.push(ConfigError::at(file, &source, Some(span), why));
                } else if let Some(first) = named.find(hash, |&i| specs[i].name == rule.name).map(|&i| &specs[i]) {
                    file_errors.push(ConfigError::at(
                        file,
                        &source,
                        Some(span),
                        format!(
                            "rule name {:?} is already used at {}:{}",
                            rule.name,
                            first.source.display(),
                            first.line
                        ),
                    ));
                } else {
                    if claimed.is_none() && rule.claim().is_some() {
                        claimed = Some(specs.len());
                    }
                    named.insert_unique(hash, specs.len(), |&i| names.hash_one(&specs[i].name));
                    specs.push(rule);
                }
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

/// `fs::read_to_string`, 64 KiB at a time with a [`breathe_now`] between: a
/// file of 10,000 rules is a megabyte, and a reload reads it whole.
fn read_text(file: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut f = std::fs::File::open(file)?;
    let size = f.metadata().map_or(0, |m| usize::try_from(m.len()).unwrap_or(0));
    let mut bytes = Vec::with_capacity(size.saturating_add(1));
    loop {
        breathe_now();
        if (&mut f).take(1 << 16).read_to_end(&mut bytes)? == 0 {
            break;
        }
    }
    String::from_utf8(bytes)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "stream did not contain valid UTF-8"))
}

/// Validates the text of one rules file: its rules alone (see
/// [`parse_rules_file`] for the deny entries too).
pub fn parse_rules(
    file: &Path,
    source: &str,
    config: &Config,
) -> Result<Vec<(RuleSpec, std::ops::Range<usize>)>, ConfigErrors> {
    parse_rules_file(file, source, config)
        .map(|f| f.rules.into_iter().map(|(s, at)| (Arc::unwrap_or_clone(s), at)).collect())
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

/// [`validate_rules_file`], taking from `cache` what did not change since
/// the last look, and remembering what it read for the next.
fn validate_cached(
    file: &Path,
    source: &str,
    config: &Config,
    cache: &mut RulesCache,
) -> (RulesFile, Vec<ConfigError>) {
    if let Some(rules) = cache.reuse(file, source, config) {
        return (RulesFile { rules, ..RulesFile::default() }, Vec::new());
    }
    let (parsed, errors) = validate_rules_file(file, source, config);
    if errors.is_empty() {
        cache.remember(file, source, &parsed.rules, parsed.denies.is_empty() && parsed.envoy.is_empty());
    } else {
        cache.forget(file);
    }
    (parsed, errors)
}

/// Validates one rules file: what is valid in it, and every problem.
pub(super) fn validate_rules_file(file: &Path, source: &str, config: &Config) -> (RulesFile, Vec<ConfigError>) {
    let raw: RawRulesFile = match toml::from_str(source) {
        Ok(raw) => raw,
        Err(e) => return (RulesFile::default(), vec![ConfigError::from_toml(file, source, &e)]),
    };
    let mut v = Validator::new(file, source);
    let mut denies = Vec::new();
    for d in raw.deny {
        let line = v.lines.line(d.span().start);
        let d = d.into_inner();
        let clients = v.clients(d.ips.as_deref(), d.users, d.api_keys);
        if clients.is_empty() {
            v.error(d.name.span(), "a [[deny]] entry needs at least one of ips, users, api_keys");
        }
        denies.push(DenySpec { name: d.name.into_inner(), source: file.to_path_buf(), line, clients });
    }
    let mut out: Vec<(Arc<RuleSpec>, std::ops::Range<usize>)> = Vec::new();
    // Names seen so far, to their rule in `out`: a file of thousands of
    // rules is checked in one pass, not one per rule.
    let mut named: HashMap<String, usize> = HashMap::new();
    // The first rule in `out` that reads tiers from a claim (as in
    // `load_rules_cached`).
    let mut claimed: Option<usize> = None;
    for r in raw.rule {
        let line = v.lines.line(r.span().start);
        let r = r.into_inner();
        let name_span = r.name.span();
        // Compared as validated: names are trimmed.
        if let Some((first, _)) = named.get(r.name.get_ref().trim()).map(|&i| &out[i]) {
            v.error(name_span.clone(), format!("rule name {:?} is already used at line {}", first.name, first.line));
            continue;
        }
        if let Some(spec) = v.rule(r, line, config) {
            if let Some(why) = claimed.and_then(|first| claim_conflict(&out[first].0, &spec)) {
                v.error(name_span, why);
                continue;
            }
            if claimed.is_none() && spec.claim().is_some() {
                claimed = Some(out.len());
            }
            named.insert(spec.name.clone(), out.len());
            out.push((Arc::new(spec), name_span));
        }
    }
    (RulesFile { rules: out, denies, envoy: raw.envoy }, v.errors)
}

/// Why `rule` cannot join the rules before it, if it cannot: its tier reads
/// another JWT claim than theirs, all of which read `first`'s (a rule that
/// differs is refused, so comparing with the first that reads one is
/// comparing with them all, in constant time). One claim is kept of each
/// verified token, so that remembering a token costs one more string, not
/// a copy of its claims.
fn claim_conflict(first: &RuleSpec, rule: &RuleSpec) -> Option<String> {
    let (mine, theirs) = (rule.claim()?, first.claim()?);
    (mine != theirs).then(|| {
        format!(
            "tier \"claim:{mine}\": rule {:?} ({}:{}) reads tiers from claim {theirs:?}, and all rules must read the same claim",
            first.name,
            first.source.display(),
            first.line,
        )
    })
}

/// [`rule_files`], or none when the path cannot be read (for change
/// detection, where an unreadable path is simply a state to compare).
pub fn rule_files_or_empty(path: &Path) -> Vec<PathBuf> {
    rule_files(path).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::read_text;

    /// A file read 64 KiB at a time is the file; bytes that are not
    /// UTF-8 are an error, as with `fs::read_to_string`.
    #[test]
    fn a_rules_file_is_read_whole_a_piece_at_a_time() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("r.toml");
        let text: String = (0..20_000).map(|i| format!("# line {i} é\n")).collect();
        assert!(text.len() > 3 << 16);
        std::fs::write(&path, &text).expect("written");
        assert_eq!(read_text(&path).expect("read"), text);
        std::fs::write(&path, b"ok\xff").expect("written");
        assert_eq!(read_text(&path).expect_err("not UTF-8").kind(), std::io::ErrorKind::InvalidData);
        std::fs::write(&path, b"").expect("written");
        assert_eq!(read_text(&path).expect("read"), "");
    }
}
