//! What a reload of a rules file can take from the last look at it: the
//! validated rules whose text did not change. Parsing and validating
//! 10,000 rules is most of a reload's CPU (the TOML parser alone about
//! 60%); an edit touches one rule or a few.
//!
//! The new text is compared with the old: the bytes both share at the
//! start and at the end hold rules that parse the same as before. What lies
//! between, widened to whole rules (from one `[[rule]]` header to the
//! next), is parsed and validated alone; the rules after it only moved by
//! some bytes and lines. The result is exactly what parsing the whole file
//! gives, because:
//!
//! - only a file made of `[[rule]]` tables is remembered (no `[[deny]]`,
//!   no `[[envoy]]`, nothing before its first header but comments and
//!   blank lines, no multi-line string, and no error), so every rule's
//!   text runs from its header, at the start of a line, to the next
//!   rule's header;
//! - the part parsed again starts at a header whose text before it is
//!   unchanged (so the parser is at the top level there, as before), and
//!   it must parse as a whole document of `[[rule]]` tables that ends at
//!   the start of a line: the parser is then at the top level at its end
//!   too, where the unchanged rules after it begin;
//! - a rule's validation reads its own text, its line and the main file
//!   only (no other file), and the checks across a file's rules (unique
//!   names, one tier claim) are made again over the whole list.
//!
//! Anything else (an error anywhere, a `[[deny]]` appearing, a header that
//! does not start a line) falls back to parsing the whole file, whose
//! errors are then reported as always. A changed main file clears the cache
//! (validation reads its routes and `[client]`).

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::main_file::Config;
use super::raw::RawRulesFile;
use super::spec::RuleSpec;
use super::validate::Validator;
use super::watch::{breathe, breathe_now};

/// The rules files as last read without error.
#[derive(Debug, Default)]
pub struct RulesCache {
    files: HashMap<PathBuf, Seen>,
}

/// One file's text and its rules.
#[derive(Debug)]
struct Seen {
    source: String,
    rules: Vec<Kept>,
}

/// A rule as read: validated, the span of its name in the file, and where
/// its `[[rule]]` header starts.
#[derive(Debug, Clone)]
struct Kept {
    spec: Arc<RuleSpec>,
    name: Range<usize>,
    header: usize,
}

const HEADER: &str = "[[rule]]";

impl RulesCache {
    /// Forgets every file (the main file changed).
    pub fn clear(&mut self) {
        self.files.clear();
    }

    /// `file`'s rules, validated, from its last look and the part of
    /// `source` that changed since; `None` when the whole file must be
    /// read. Each rule comes with the span of its name.
    pub(super) fn reuse(
        &mut self,
        file: &Path,
        source: &str,
        config: &Config,
    ) -> Option<Vec<(Arc<RuleSpec>, Range<usize>)>> {
        let rules = self.files.remove(file)?.reuse(file, source, config)?;
        let out = rules
            .iter()
            .map(|k| {
                breathe();
                (k.spec.clone(), k.name.clone())
            })
            .collect();
        self.files.insert(file.to_path_buf(), Seen { source: source.to_string(), rules });
        Some(out)
    }

    /// Remembers `rules`, the whole of `source` read without error, for
    /// the next look at `file`; `only_rules` is false when the file also
    /// had `[[deny]]` or `[[envoy]]` entries, which are never remembered.
    pub(super) fn remember(
        &mut self,
        file: &Path,
        source: &str,
        rules: &[(Arc<RuleSpec>, Range<usize>)],
        only_rules: bool,
    ) {
        match Seen::of(source, rules).filter(|_| only_rules) {
            Some(seen) => self.files.insert(file.to_path_buf(), seen),
            None => self.files.remove(file),
        };
    }

    /// Forgets `file` (it did not read without error).
    pub(super) fn forget(&mut self, file: &Path) {
        self.files.remove(file);
    }

    /// Forgets the files not in `files` (gone from the rules directory).
    pub(super) fn keep_only(&mut self, files: &[PathBuf]) {
        self.files.retain(|f, _| files.contains(f));
    }
}

impl Seen {
    fn of(source: &str, parsed: &[(Arc<RuleSpec>, Range<usize>)]) -> Option<Seen> {
        if multiline_strings(source) {
            return None;
        }
        let mut rules = Vec::with_capacity(parsed.len());
        let mut from = 0;
        for (spec, name) in parsed {
            let header = header_before(source, from, name.start)?;
            rules.push(Kept { spec: spec.clone(), name: name.clone(), header });
            from = name.end;
        }
        // Before the first header: nothing a parse of it would find.
        let first = rules.first().map_or(source.len(), |k| k.header);
        only_comments(&source[..first]).then(|| Seen { source: source.to_string(), rules })
    }

    fn reuse(self, file: &Path, new: &str, config: &Config) -> Option<Vec<Kept>> {
        let old = self.source.as_str();
        let prefix = common_prefix(old.as_bytes(), new.as_bytes());
        let room = old.len().min(new.len()) - prefix;
        let suffix = common_suffix(&old.as_bytes()[prefix..], &new.as_bytes()[prefix..]).min(room);
        // The old text had no multi-line string: a new one overlaps the
        // bytes that changed.
        let changed = new.as_bytes().get(prefix.saturating_sub(2)..(new.len() - suffix + 2).min(new.len()))?;
        if changed.windows(3).any(|w| w == b"\"\"\"" || w == b"'''") {
            return None;
        }
        let (old_end, delta) = (old.len() - suffix, new.len() as isize - old.len() as isize);
        let starts: Vec<usize> = self.rules.iter().map(|k| k.header).collect();
        // Rules whose text, and the next header's first byte, lie before
        // the first changed byte.
        let before = starts.windows(2).take_while(|w| w[1] < prefix).count();
        let from = if before == 0 { 0 } else { starts[before] };
        // Rules whose text lies after the last changed byte.
        let after = (before..starts.len()).find(|&j| starts[j] >= old_end && starts[j] > from).unwrap_or(starts.len());
        let (old_to, to) = match starts.get(after) {
            Some(&s) => (s, s.checked_add_signed(delta)?),
            None => (old.len(), new.len()),
        };
        let part = new.get(from..to)?;
        // Both ends at a `[[rule]]` header that starts a line (or the file's).
        if !(from == 0 || part.starts_with(HEADER)) || !(to == new.len() || starts_line(new, to)) {
            return None;
        }
        let lines_before = newlines(&new[..from]) as isize;
        let mut fresh = parse_part(file, part, config)?;
        for k in &mut fresh {
            shift(k, from as isize, lines_before);
        }
        let line_delta = newlines(part) as isize - newlines(&old[from..old_to]) as isize;
        let mut rules = self.rules;
        let mut kept_after = rules.split_off(after);
        rules.truncate(before);
        rules.append(&mut fresh);
        for k in &mut kept_after {
            breathe();
            shift(k, delta, line_delta);
        }
        rules.append(&mut kept_after);
        consistent(&rules).then_some(rules)
    }
}

/// Validates `part`, a run of whole `[[rule]]` tables; `None` if it is
/// anything else or has any error.
fn parse_part(file: &Path, part: &str, config: &Config) -> Option<Vec<Kept>> {
    let raw: RawRulesFile = toml::from_str(part).ok()?;
    if !raw.deny.is_empty() || !raw.envoy.is_empty() {
        return None;
    }
    let mut v = Validator::new(file, part);
    let mut out = Vec::with_capacity(raw.rule.len());
    let mut from = 0;
    for r in raw.rule {
        let line = v.lines.line(r.span().start);
        let r = r.into_inner();
        let name = r.name.span();
        let spec = Arc::new(v.rule(r, line, config)?);
        let header = header_before(part, from, name.start)?;
        from = name.end;
        out.push(Kept { spec, name, header });
    }
    let first = out.first().map_or(part.len(), |k| k.header);
    (v.errors.is_empty() && only_comments(&part[..first])).then_some(out)
}

/// Moves a rule `bytes` further in the file and `lines` lines down (or up,
/// when negative).
fn shift(k: &mut Kept, bytes: isize, lines: isize) {
    let at = |i: usize| i.saturating_add_signed(bytes);
    k.name = at(k.name.start)..at(k.name.end);
    k.header = at(k.header);
    if lines != 0 {
        // A rule whose lines did not move stays the very spec in force
        // (see `RuleSet::from_loaded_reusing`).
        let spec = Arc::make_mut(&mut k.spec);
        spec.line = spec.line.saturating_add_signed(lines);
        for o in &mut spec.overrides {
            o.line = o.line.saturating_add_signed(lines);
        }
    }
}

/// The checks a file's validation makes across its rules: no name twice,
/// and one JWT claim for every rule with tiers from a claim.
fn consistent(rules: &[Kept]) -> bool {
    let mut names: HashSet<&str, foldhash::fast::RandomState> =
        HashSet::with_capacity_and_hasher(rules.len(), Default::default());
    let mut claim = None;
    for k in rules {
        breathe();
        if !names.insert(k.spec.name.as_str()) {
            return false;
        }
        if let Some(c) = k.spec.claim() {
            if claim.is_some_and(|first| first != c) {
                return false;
            }
            claim = Some(c);
        }
    }
    true
}

/// Where the `[[rule]]` header of the rule whose name is at `name` starts:
/// the last header in `source[from..name]`, at the start of a line.
fn header_before(source: &str, from: usize, name: usize) -> Option<usize> {
    let at = from + source.get(from..name)?.rfind(HEADER)?;
    starts_line(source, at).then_some(at)
}

/// Whether only blanks stand between the line's start and `at`.
fn starts_line(source: &str, at: usize) -> bool {
    let line = &source.as_bytes()[..at];
    let blanks = line.iter().rev().take_while(|&&b| b == b' ' || b == b'\t').count();
    blanks == at || line[at - blanks - 1] == b'\n'
}

/// Whether `text` holds blank lines and comments only.
fn only_comments(text: &str) -> bool {
    text.lines().all(|l| {
        let l = l.trim_start_matches([' ', '\t']);
        l.is_empty() || l == "\r" || l.starts_with('#')
    })
}

/// Whether `text` may hold a multi-line string, inside which a line could
/// look like a `[[rule]]` header.
fn multiline_strings(text: &str) -> bool {
    text.contains("\"\"\"") || text.contains("'''")
}

/// How many bytes `a` and `b` share at their start: compared a block at a
/// time (a slice comparison, `memcmp`), then byte by byte in the block
/// that differs. A file of 10,000 rules is a megabyte, read on every
/// reload: [`breathe_now`] every 64 KiB.
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    const BLOCK: usize = 256;
    let n = a.len().min(b.len());
    let mut at = 0;
    while at + BLOCK <= n && a[at..at + BLOCK] == b[at..at + BLOCK] {
        at += BLOCK;
        if at.is_multiple_of(1 << 16) {
            breathe_now();
        }
    }
    at + a[at..n].iter().zip(&b[at..n]).take_while(|(x, y)| x == y).count()
}

/// How many bytes `a` and `b` share at their end (as [`common_prefix`]).
fn common_suffix(a: &[u8], b: &[u8]) -> usize {
    const BLOCK: usize = 256;
    let n = a.len().min(b.len());
    let (a, b) = (&a[a.len() - n..], &b[b.len() - n..]);
    let mut end = n;
    while end >= BLOCK && a[end - BLOCK..end] == b[end - BLOCK..end] {
        end -= BLOCK;
        if end.is_multiple_of(1 << 16) {
            breathe_now();
        }
    }
    n - end + a[..end].iter().rev().zip(b[..end].iter().rev()).take_while(|(x, y)| x == y).count()
}

/// A 64 KiB stretch at a time, [`breathe_now`] between them.
fn newlines(text: &str) -> usize {
    text.as_bytes()
        .chunks(1 << 16)
        .map(|c| {
            breathe_now();
            c.iter().filter(|&&b| b == b'\n').count()
        })
        .sum()
}

#[cfg(test)]
mod tests;
