//! Which entries (rules, routes) can match a request path, found without
//! looking at the others: a gateway carries thousands of per-endpoint rules
//! and routes, and a request must cost a few hash lookups, not a
//! comparison per entry.
//!
//! An entry is filed by its path pattern:
//! - an exact path, under that path (looked up with the request's
//!   [`match_path`]);
//! - a prefix, under its directory: the prefix up to and including its
//!   last `/` (`/api/v1/*` under `/api/v1/`, `/api*` under `/`). A path can
//!   start with the prefix only if it starts with that directory, so a
//!   request looks up each of its own directories (one per `/`);
//! - a prefix ending in `/` also under itself without that `/`, since
//!   `/api/*` matches the path `/api` as well;
//! - no path, or a prefix without any `/`: looked at by every request.
//!
//! The lookups give candidates, a superset of the entries that match: the
//! caller still checks each one's own conditions. Candidates come in
//! ascending index order (file order for rules, precedence for routes).

use std::collections::HashMap;

use crate::config::PathPattern;
use crate::wire::normalize::match_path;

/// Entry lists by key, and which key lengths occur: a lookup for a
/// length no key has is skipped without hashing (most of a request's
/// directories are of lengths no filed directory has).
#[derive(Debug, Default)]
struct Filed {
    map: HashMap<String, Vec<usize>, foldhash::fast::RandomState>,
    /// Bit `n` set: some key is `n` bytes long (bit 63: 63 or more).
    lengths: u64,
}

impl Filed {
    fn file(&mut self, key: &str, i: usize) {
        self.lengths |= 1 << key.len().min(63);
        self.map.entry(key.to_owned()).or_default().push(i);
    }

    fn get(&self, key: &str) -> Option<&[usize]> {
        if self.lengths & (1 << key.len().min(63)) == 0 {
            return None;
        }
        self.map.get(key).map(Vec::as_slice)
    }
}

/// Entries by the paths they can match.
#[derive(Debug, Default)]
pub struct PathIndex {
    exact: Filed,
    /// Prefixes by their directory.
    dirs: Filed,
    /// Prefixes ending in `/`, by the prefix without it.
    roots: Filed,
    /// Entries every path must look at.
    rest: Vec<usize>,
    /// How many entries there are: up to [`SMALL`], every one is a
    /// candidate (comparing a few patterns costs less than hashing).
    len: usize,
}

/// Up to this many entries, a request looks at them all.
const SMALL: usize = 8;

/// How many lists a request merges without allocating: the exact path's,
/// the roots', the rest, and up to five of its directories.
const INLINE: usize = 8;

impl PathIndex {
    /// Files entry `i` under each pattern of `patterns` (in index order).
    pub fn new<'p>(patterns: impl IntoIterator<Item = Option<&'p PathPattern>>) -> PathIndex {
        let mut index = PathIndex::default();
        for (i, pattern) in patterns.into_iter().enumerate() {
            index.len = i + 1;
            match pattern {
                Some(PathPattern::Exact(p)) => index.exact.file(p, i),
                Some(PathPattern::Prefix(p)) => match p.rfind('/') {
                    Some(last) => {
                        index.dirs.file(&p[..=last], i);
                        if let Some(root) = p.strip_suffix('/').filter(|r| !r.is_empty()) {
                            index.roots.file(root, i);
                        }
                    }
                    None => index.rest.push(i),
                },
                None => index.rest.push(i),
            }
        }
        index
    }

    /// The entries that may match `path` (canonical), ascending.
    pub fn candidates<'a>(&'a self, path: &'a str) -> Candidates<'a> {
        if self.len <= SMALL {
            return Candidates::All(0..self.len);
        }
        let mut m = Merge { lists: [&[]; INLINE], n: 0 };
        m.push(self.exact.get(match_path(path)));
        m.push(Some(&self.rest));
        if self.dirs.lengths == 0 {
            return Candidates::Merge(m);
        }
        m.push(self.roots.get(path));
        let mut spilled = Vec::new();
        for (i, _) in path.bytes().enumerate().filter(|&(_, b)| b == b'/') {
            let Some(list) = self.dirs.get(&path[..=i]) else { continue };
            if m.n < INLINE {
                m.push(Some(list));
            } else {
                spilled.extend_from_slice(list);
            }
        }
        if spilled.is_empty() {
            return Candidates::Merge(m);
        }
        // A path with more filed directories than fit inline: rare enough
        // to pay for one sort.
        for list in &m.lists[..m.n] {
            spilled.extend_from_slice(list);
        }
        spilled.sort_unstable();
        Candidates::Spill(spilled.into_iter())
    }
}

/// [`PathIndex::candidates`], ascending: every entry of a small index, or
/// the lists a path reaches merged (an entry is filed in one list a path
/// can reach, so nothing comes twice).
pub enum Candidates<'a> {
    All(std::ops::Range<usize>),
    Merge(Merge<'a>),
    Spill(std::vec::IntoIter<usize>),
}

/// Sorted lists, merged.
pub struct Merge<'a> {
    lists: [&'a [usize]; INLINE],
    n: usize,
}

impl<'a> Merge<'a> {
    /// Adds a list; the caller keeps `n` under [`INLINE`].
    fn push(&mut self, list: Option<&'a [usize]>) {
        if let Some(list) = list.filter(|l| !l.is_empty()) {
            self.lists[self.n] = list;
            self.n += 1;
        }
    }
}

impl Iterator for Candidates<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        match self {
            Candidates::All(range) => range.next(),
            Candidates::Spill(spill) => spill.next(),
            Candidates::Merge(m) => {
                let lists = &mut m.lists[..m.n];
                let (at, _) =
                    lists.iter().enumerate().filter_map(|(k, l)| Some((k, *l.first()?))).min_by_key(|&(_, v)| v)?;
                let (first, rest) = lists[at].split_first()?;
                lists[at] = rest;
                Some(*first)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `match.path`'s meaning, as the rules check it.
    fn fits(pattern: Option<&PathPattern>, path: &str) -> bool {
        match pattern {
            None => true,
            Some(PathPattern::Exact(p)) => p == match_path(path),
            Some(PathPattern::Prefix(p)) => path.starts_with(p.as_str()) || p.strip_suffix('/') == Some(path),
        }
    }

    fn pattern() -> impl Strategy<Value = Option<PathPattern>> {
        // Few segment names, so that patterns and paths meet often.
        let path = prop::collection::vec(prop::sample::select(vec!["a", "b", "ab", ""]), 0..4)
            .prop_map(|segments| format!("/{}", segments.join("/")));
        prop_oneof![
            Just(None),
            path.clone().prop_map(|p| Some(PathPattern::Exact(p))),
            path.clone().prop_map(|p| Some(PathPattern::Prefix(p))),
            path.prop_map(|p| Some(PathPattern::Prefix(format!("{p}/")))),
            Just(Some(PathPattern::Prefix(String::new()))),
        ]
    }

    proptest! {
        /// Every entry whose pattern fits the path is a candidate, and the
        /// candidates come once each, ascending.
        #[test]
        fn candidates_hold_every_entry_that_fits(
            patterns in prop::collection::vec(pattern(), 0..40),
            segments in prop::collection::vec(prop::sample::select(vec!["a", "b", "ab", "x", ""]), 0..12),
        ) {
            let path = format!("/{}", segments.join("/"));
            let index = PathIndex::new(patterns.iter().map(Option::as_ref));
            let got: Vec<usize> = index.candidates(&path).collect();
            prop_assert!(got.windows(2).all(|w| w[0] < w[1]), "ascending, once each: {got:?}");
            for (i, p) in patterns.iter().enumerate() {
                if fits(p.as_ref(), &path) {
                    prop_assert!(got.contains(&i), "{p:?} fits {path} but is not a candidate: {got:?}");
                }
            }
        }
    }

    /// A thousand prefixes elsewhere leave a request with the few that can
    /// match it: the lookups, not the rule count, set the cost.
    #[test]
    fn unrelated_prefixes_are_not_candidates() {
        let mut patterns: Vec<Option<PathPattern>> =
            (0..1_000).map(|i| Some(PathPattern::Prefix(format!("/decoy{i}/")))).collect();
        patterns.push(Some(PathPattern::Prefix("/api/".into())));
        patterns.push(None);
        let index = PathIndex::new(patterns.iter().map(Option::as_ref));
        assert_eq!(index.candidates("/api/users/7").collect::<Vec<_>>(), [1_000, 1_001]);
        assert_eq!(index.candidates("/api").collect::<Vec<_>>(), [1_000, 1_001]);
        assert_eq!(index.candidates("/decoy7").collect::<Vec<_>>(), [7, 1_001]);
        assert_eq!(index.candidates("/decoy7/x").collect::<Vec<_>>(), [7, 1_001]);
    }

    /// A path deeper than the inline lists reach still finds every prefix.
    #[test]
    fn a_deep_path_finds_every_prefix_of_it() {
        let path = "/a/b/c/d/e/f/g/h/i/j";
        let dirs: Vec<String> = path.match_indices('/').map(|(i, _)| path[..=i].to_owned()).collect();
        let patterns: Vec<Option<PathPattern>> = dirs.iter().map(|d| Some(PathPattern::Prefix(d.clone()))).collect();
        let index = PathIndex::new(patterns.iter().map(Option::as_ref));
        assert_eq!(index.candidates(path).collect::<Vec<_>>(), (0..dirs.len()).collect::<Vec<_>>());
    }
}
