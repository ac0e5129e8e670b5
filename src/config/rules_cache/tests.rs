//! The cache gives exactly what parsing the whole file gives, or falls
//! back to it: edits of many kinds, each compared with a full parse.

use super::*;
use crate::config::rules_file::validate_rules_file;

fn config() -> Config {
    let main = "[[upstream]]\nname = \"u\"\nurl = \"http://127.0.0.1:9001\"\n\n[[route]]\nname = \"api\"\npath_prefix = \"/\"\nupstream = \"u\"\n";
    Config::parse(Path::new("tollgate.toml"), main).expect("valid main file")
}

fn rule(i: usize) -> String {
    match i % 4 {
        0 => format!(
            "[[rule]]\nname = \"r{i}\"\nlimit = {}\nwindow = \"1s\"\nmatch = {{ path = \"/p{i}/*\" }}\n\n",
            10 + i
        ),
        1 => format!(
            "# rule {i}\n[[rule]]\nname = \"r{i}\"\nkey = [\"user\"]\nlimit = 5\nwindow = \"1m\"\n\n[[rule.override]]\nkey = \"user=u{i}\"\nlimit = 50\n\n"
        ),
        2 => format!(
            "[[rule]]\nname = \"r{i}\"\nkey = [\"user\"]\nlimit = 5\nwindow = \"1h\"\ntier = \"header:x-plan\"\ntiers = {{ pro = 100, default = 5 }}\n\n"
        ),
        _ => format!(
            "[[rule]]\r\nname = \"r{i}\"\r\nlimit = 3\r\ncalendar = \"day\"\r\ntimezone = \"Europe/Berlin\"\r\n\r\n"
        ),
    }
}

fn file(n: usize) -> String {
    "# rules\n\n".to_string() + &(0..n).map(rule).collect::<String>()
}

/// Full parse of `new` against a cache that saw `old`: equal results, and
/// whether the cache did it.
fn compare(old: &str, new: &str) -> bool {
    let (c, path) = (config(), Path::new("r.toml"));
    let mut cache = RulesCache::default();
    let (first, errors) = validate_rules_file(path, old, &c);
    assert!(errors.is_empty(), "the old text is valid: {errors:?}");
    cache.remember(path, old, &first.rules, true);
    let reused = cache.files.remove(path).and_then(|seen| seen.reuse(path, new, &c));
    let (full, errors) = validate_rules_file(path, new, &c);
    let Some(reused) = reused else { return false };
    assert!(errors.is_empty(), "the cache took a text with errors: {errors:?}\n{new}");
    let reused: Vec<_> = reused.into_iter().map(|k| (k.spec, k.name)).collect();
    assert_eq!(reused, full.rules, "for\n{new}");
    assert!(full.denies.is_empty() && full.envoy.is_empty());
    true
}

#[test]
fn one_changed_limit_is_parsed_alone_and_gives_the_full_parse() {
    let old = file(40);
    for i in [0, 1, 17, 39] {
        let new =
            old.replacen(&format!("name = \"r{i}\"\nlimit = {}", 10 + i), &format!("name = \"r{i}\"\nlimit = 7"), 1);
        let new = if new == old {
            old.replacen(&format!("key = \"user=u{i}\"\nlimit = 50"), "key = \"user=u1\"\nlimit = 51", 1)
        } else {
            new
        };
        assert!(compare(&old, &new), "rule {i}");
    }
}

#[test]
fn unchanged_text_and_trailing_comments_are_taken_whole() {
    let old = file(12);
    assert!(compare(&old, &old));
    assert!(compare(&old, &(old.clone() + "# touched 1\n")));
    assert!(compare(&old, &("# header\n".to_string() + &old)));
}

#[test]
fn rules_added_removed_and_moved_give_the_full_parse() {
    let old = file(12);
    let rules: Vec<String> = (0..12).map(rule).collect();
    let without = |j: usize| {
        "# rules\n\n".to_string()
            + &rules.iter().enumerate().filter(|(i, _)| *i != j).map(|(_, r)| r.as_str()).collect::<String>()
    };
    for j in 0..12 {
        assert!(compare(&old, &without(j)), "without {j}");
        assert!(compare(&without(j), &old), "with {j} again");
    }
    let added = old.clone() + &rule(12) + &rule(13);
    assert!(compare(&old, &added));
    let inserted = old.replacen("[[rule]]\nname = \"r4\"", &(rule(20) + "[[rule]]\nname = \"r4\""), 1);
    assert!(compare(&old, &inserted));
}

#[test]
fn texts_the_cache_cannot_take_fall_back_to_the_full_parse() {
    let old = file(12);
    let cases = [
        // Errors: the full parse reports them.
        old.replacen("limit = 14", "limit = 0", 1),
        old.replacen("name = \"r5\"", "name = \"r4\"", 1),
        old.replacen("limit = 3\r\n", "limit = \r\n", 1),
        old.replacen("[[rule]]\nname = \"r8\"", "[[rule]\nname = \"r8\"", 1),
        old.replacen("tier = \"header:x-plan\"", "tier = \"claim:other\"", 1),
        // Tables other than rules, a header that does not start a line, a
        // multi-line string.
        old.replacen(
            "[[rule]]\nname = \"r4\"",
            "[[deny]]\nname = \"d\"\nips = [\"10.0.0.1\"]\n\n[[rule]]\nname = \"r4\"",
            1,
        ),
        old.replacen(
            "\"Europe/Berlin\"\r\n\r\n[[rule]]\nname = \"r8\"",
            "\"Europe/Berlin\" [[rule]]\nname = \"r8\"",
            1,
        ),
        old.replacen("# rule 5", "quota_unit = \"\"\"\ntokens\"\"\"\n# rule 5", 1),
        old.replacen("# rules", "rule = 1", 1),
    ];
    for (i, new) in cases.iter().enumerate() {
        assert_ne!(new, &old, "case {i} is an edit");
        assert!(!compare(&old, new), "case {i} taken from the cache:\n{new}");
    }
}

/// Random edits of random places: whatever the cache takes equals the
/// full parse, and a one-character change of a digit is always taken.
#[test]
fn random_edits_never_differ_from_the_full_parse() {
    let old = file(16);
    let mut rng = fastrand::Rng::with_seed(7);
    let pieces =
        ["1", "\n", "# x\n", "[[rule]]\n", "name = \"z\"\n", "[[rule.override]]\n", " ", "\"", "]", "limit = 2\n"];
    let (mut taken, mut digits) = (0, 0);
    for _ in 0..400 {
        let mut new = old.clone().into_bytes();
        let at = rng.usize(..new.len());
        match rng.u8(..3) {
            0 => {
                let p = pieces[rng.usize(..pieces.len())];
                new.splice(at..at, p.bytes());
            }
            1 => {
                let end = (at + rng.usize(1..40)).min(new.len());
                new.drain(at..end);
            }
            _ => {
                if new[at].is_ascii_digit() && new[at] != b'0' {
                    new[at] = if new[at] == b'9' { b'8' } else { new[at] + 1 };
                    digits += 1;
                    let new = String::from_utf8(new).expect("ASCII");
                    assert!(
                        compare(&old, &new) || !validate_rules_file(Path::new("r.toml"), &new, &config()).1.is_empty()
                    );
                    continue;
                }
            }
        }
        let Ok(new) = String::from_utf8(new) else { continue };
        taken += usize::from(compare(&old, &new));
    }
    assert!(taken > 0 && digits > 0, "{taken} taken, {digits} digits");
}

/// A rule the edit did not touch, nor move to another line, comes back as
/// the very spec the last look gave (so that the rule set in force is kept
/// without comparing it, see `RuleSet::from_loaded_reusing`); one whose
/// lines moved is a spec of its own at its new line.
#[test]
fn untouched_rules_come_back_as_the_same_specs() {
    let (c, path) = (config(), Path::new("r.toml"));
    let old = file(40);
    let (first, _) = validate_rules_file(path, &old, &c);
    let mut cache = RulesCache::default();
    cache.remember(path, &old, &first.rules, true);
    let new = old.replacen("name = \"r16\"\nlimit = 26", "name = \"r16\"\nlimit = 7", 1);
    assert_ne!(new, old);
    let again = cache.reuse(path, &new, &c).expect("one limit edited is taken from the cache");
    for ((was, _), (now, _)) in first.rules.iter().zip(&again) {
        assert_eq!(Arc::ptr_eq(was, now), now.name != "r16", "{}", now.name);
    }
    // A line added before r17: the rules from r17 on are at other lines.
    let longer = new.replacen("# rule 17\n", "# rule 17\n# one more line\n", 1);
    let (full, _) = validate_rules_file(path, &longer, &c);
    let moved = cache.reuse(path, &longer, &c).expect("a comment added is taken from the cache");
    assert_eq!(moved, full.rules);
    let same = |name: &str| {
        let at = |rules: &[(Arc<RuleSpec>, Range<usize>)]| rules.iter().position(|(s, _)| s.name == name);
        Arc::ptr_eq(&again[at(&again).expect("in")].0, &moved[at(&moved).expect("in")].0)
    };
    assert!(same("r3") && !same("r20"));
}

/// The block-wise comparisons count what a byte-by-byte one counts, for
/// differences at every distance from either end of texts of any length.
#[test]
fn common_prefix_and_suffix_count_as_byte_by_byte() {
    let naive_prefix = |a: &[u8], b: &[u8]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let naive_suffix = |a: &[u8], b: &[u8]| a.iter().rev().zip(b.iter().rev()).take_while(|(x, y)| x == y).count();
    let mut rng = fastrand::Rng::with_seed(11);
    for _ in 0..2000 {
        let len = rng.usize(0..1200);
        let a: Vec<u8> = (0..len).map(|_| rng.u8(b'a'..b'c')).collect();
        let mut b = a.clone();
        match rng.u8(..3) {
            0 if len > 0 => b[rng.usize(..len)] ^= 1,
            1 => b.insert(rng.usize(..=len), b'x'),
            _ => b.truncate(rng.usize(..=len)),
        }
        assert_eq!(common_prefix(&a, &b), naive_prefix(&a, &b));
        assert_eq!(common_suffix(&a, &b), naive_suffix(&a, &b));
    }
}

/// On the background thread, taking a file of many rules from the cache
/// breathes at least once a rule (see [`crate::config::watch::breathe`]):
/// the work between two breaths stays short, whatever the file's size.
#[test]
fn a_cached_reload_breathes_at_least_once_a_rule() {
    let (c, path) = (config(), Path::new("r.toml"));
    let old = file(2_000);
    let new = old.replacen("limit = 10\n", "limit = 11\n", 1);
    let mut cache = RulesCache::default();
    let (first, errors) = validate_rules_file(path, &old, &c);
    assert!(errors.is_empty());
    cache.remember(path, &old, &first.rules, true);
    let (reused, calls) = crate::config::watch::breathing(|| cache.reuse(path, &new, &c));
    assert_eq!(reused.expect("taken from the cache").len(), 2_000);
    assert!(calls >= 2 * 2_000, "{calls} breaths for 2,000 rules");
}
