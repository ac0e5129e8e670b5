//! A reload keeps the compiled rules whose specs did not change
//! ([`RuleSet::from_loaded_reusing`]) and compiles the others.

use std::path::Path;
use std::sync::Arc;

use super::config;
use crate::config::{LoadedRules, parse_rules};
use crate::limit::rules::RuleSet;
use crate::obs::metrics::Metrics;

fn loaded(source: &str) -> LoadedRules {
    let rules = parse_rules(Path::new("r.toml"), source, &config()).expect("valid rules");
    LoadedRules { rules: rules.into_iter().map(|(s, _)| Arc::new(s)).collect(), ..Default::default() }
}

fn rule(name: &str, limit: u64) -> String {
    format!("[[rule]]\nname = \"{name}\"\nlimit = {limit}\nwindow = \"1s\"\n\n")
}

/// The rule named `name` in `set`.
fn named<'s>(set: &'s RuleSet, name: &str) -> &'s Arc<crate::limit::rules::Rule> {
    set.rules.iter().find(|r| r.name() == name).expect("rule in the set")
}

#[test]
fn a_reload_shares_unchanged_rules_and_compiles_changed_and_new_ones() {
    let m = Metrics::new();
    let first = RuleSet::from_loaded(loaded(&(rule("a", 1) + &rule("b", 2) + &rule("c", 3))), &m);
    // b's limit changes, c goes, d comes; the lines of a and b stay.
    let second =
        RuleSet::from_loaded_reusing(loaded(&(rule("a", 1) + &rule("b", 20) + &rule("d", 4))), &m, Some(&first));
    assert!(Arc::ptr_eq(named(&first, "a"), named(&second, "a")));
    assert!(!Arc::ptr_eq(named(&first, "b"), named(&second, "b")));
    assert_eq!(named(&second, "b").spec.limit, 20);
    assert_eq!(named(&second, "b").plan.policy, "\"b\";q=20;w=1");
    assert_eq!(second.rules.iter().map(|r| r.name()).collect::<Vec<_>>(), ["a", "b", "d"]);
    // Freeing the old set leaves the shared rule to the new one.
    drop(first);
    assert_eq!(Arc::strong_count(named(&second, "a")), 1);
}

#[test]
fn a_rule_is_found_by_name_when_others_go_and_rebuilt_when_its_line_moves() {
    let m = Metrics::new();
    let first = RuleSet::from_loaded(loaded(&(rule("a", 1) + &rule("b", 2) + &rule("c", 3))), &m);
    // a goes, its lines left blank: b and c are at other places in the set
    // but at the same lines.
    let blank = "\n".repeat(rule("a", 1).lines().count());
    let second = RuleSet::from_loaded_reusing(loaded(&(blank + &rule("b", 2) + &rule("c", 3))), &m, Some(&first));
    assert!(Arc::ptr_eq(named(&first, "b"), named(&second, "b")));
    assert!(Arc::ptr_eq(named(&first, "c"), named(&second, "c")));
    // A rule at another line is another spec (`/rules` shows the line).
    let swapped = RuleSet::from_loaded_reusing(loaded(&(rule("b", 2) + &rule("a", 1))), &m, Some(&first));
    assert_eq!(swapped.rules.iter().map(|r| r.name()).collect::<Vec<_>>(), ["b", "a"]);
    assert!(!Arc::ptr_eq(named(&first, "b"), named(&swapped, "b")));
    assert_eq!(named(&swapped, "b").spec.line, 1);
}

#[test]
fn the_set_wide_facts_follow_the_new_rules() {
    let m = Metrics::new();
    let first = RuleSet::from_loaded(loaded(&rule("a", 1)), &m);
    assert!(!first.keys_on_user);
    let keyed = "[[rule]]\nname = \"u\"\nkey = [\"header:x-user\"]\nlimit = 1\nwindow = \"1h\"\n";
    let second = RuleSet::from_loaded_reusing(loaded(&(rule("a", 1) + keyed)), &m, Some(&first));
    assert!(Arc::ptr_eq(named(&first, "a"), named(&second, "a")));
    assert_eq!(second.read_headers, [http::HeaderName::from_static("x-user")]);
    assert!(second.idle_horizon > first.idle_horizon);
}

#[test]
fn an_unchanged_calendar_rule_is_shared_and_a_new_time_zone_is_not() {
    let m = Metrics::new();
    let cal = |tz: &str| format!("[[rule]]\nname = \"c\"\nlimit = 5\ncalendar = \"day\"\ntimezone = \"{tz}\"\n");
    let first = RuleSet::from_loaded(loaded(&cal("Europe/Berlin")), &m);
    let same = RuleSet::from_loaded_reusing(loaded(&cal("Europe/Berlin")), &m, Some(&first));
    assert!(Arc::ptr_eq(&first.rules[0], &same.rules[0]));
    let other = RuleSet::from_loaded_reusing(loaded(&cal("Asia/Tokyo")), &m, Some(&first));
    assert!(!Arc::ptr_eq(&first.rules[0], &other.rules[0]));
}

#[test]
fn the_path_index_is_shared_while_every_path_stays_and_rebuilt_when_one_moves() {
    let m = Metrics::new();
    let at = |name: &str, path: &str, limit: u64| {
        format!("[[rule]]\nname = \"{name}\"\nlimit = {limit}\nwindow = \"1s\"\nmatch = {{ path = \"{path}\" }}\n\n")
    };
    // More rules than the index looks at all of (rules 0-8), then b at 9.
    let decoys: String = (0..9).map(|i| at(&format!("d{i}"), &format!("/d{i}/*"), 1)).collect();
    let load = |tail: &str| loaded(&(decoys.clone() + tail));
    let first = RuleSet::from_loaded(load(&at("b", "/b/*", 2)), &m);
    // A limit edited: every path where it was, one index for both sets.
    let limit = RuleSet::from_loaded_reusing(load(&at("b", "/b/*", 3)), &m, Some(&first));
    assert!(!Arc::ptr_eq(named(&first, "b"), named(&limit, "b")));
    assert!(Arc::ptr_eq(&first.paths, &limit.paths));
    // A path edited: a new index, which files the rule under its new path.
    let moved = RuleSet::from_loaded_reusing(load(&at("b", "/c/*", 3)), &m, Some(&limit));
    assert!(!Arc::ptr_eq(&limit.paths, &moved.paths));
    let candidates = |set: &RuleSet, path: &str| set.paths.candidates(path).collect::<Vec<_>>();
    assert_eq!(candidates(&limit, "/b/x"), [9]);
    assert_eq!(candidates(&moved, "/b/x"), Vec::<usize>::new());
    assert_eq!(candidates(&moved, "/c/x"), [9]);
    // A rule added: more entries than the index has.
    let added = RuleSet::from_loaded_reusing(load(&(at("b", "/c/*", 3) + &at("e", "/e/*", 4))), &m, Some(&moved));
    assert!(!Arc::ptr_eq(&moved.paths, &added.paths));
    assert_eq!(candidates(&added, "/e/x"), [10]);
}

/// A reload that changed no rule (a comment, a file written again) holds
/// the very rules in force, and the set's derived facts, read from what
/// each kept rule worked out when it was compiled, are those a full
/// compile of the same rules gives.
#[test]
fn a_reload_that_changed_no_rule_derives_what_a_full_compile_does() {
    let m = Metrics::new();
    let text = rule("a", 1)
        + "[[rule]]\nname = \"k\"\nkey = [\"header:x-api-key\"]\nlimit = 3\nwindow = \"1h\"\nmatch = { path = \"/k/*\", methods = [\"POST\"] }\n\n"
        + "[[rule]]\nname = \"s\"\nlimit = 100\nwindow = \"1m\"\ncost_response_header = \"x-cost\"\n";
    let first = RuleSet::from_loaded(loaded(&text), &m);
    let again = RuleSet::from_loaded_reusing(loaded(&(text.clone() + "# touched\n")), &m, Some(&first));
    let full = RuleSet::from_loaded(loaded(&text), &m);
    let same = |a: &RuleSet, b: &RuleSet| a.rules.iter().zip(&b.rules).all(|(x, y)| Arc::ptr_eq(x, y));
    assert!(same(&again, &first) && !same(&full, &first));
    let facts = |s: &RuleSet| {
        (
            s.keys_on_user,
            s.tier_claim.clone(),
            s.read_headers.clone(),
            s.reads_method,
            s.any_settles,
            s.any_needs_user,
            s.any_reads_api_key,
            s.idle_horizon,
        )
    };
    assert_eq!(facts(&again), facts(&full));
    assert!(again.reads_method && again.any_settles && !again.read_headers.is_empty());
    assert!(Arc::ptr_eq(&again.paths, &first.paths));
}

/// On the background thread, compiling a reload of many rules and giving
/// the new ones their `/top` sketches breathe at least once a rule (see
/// [`crate::config::watch::breathe`]).
#[test]
fn a_reload_of_many_rules_breathes_at_least_once_a_rule() {
    let m = Metrics::new();
    let text: String = (0..1_000).map(|i| rule(&format!("r{i}"), 1)).collect();
    let first = RuleSet::from_loaded(loaded(&text), &m);
    let top = crate::limit::top::TopKeys::new(8, Arc::new(crate::limiter::clock::SystemClock)).expect("top keys on");
    let mut first = first;
    top.attach(&mut first);
    let edited = loaded(&text.replacen("limit = 1\n", "limit = 2\n", 1));
    let (mut second, calls) =
        crate::config::watch::breathing(|| RuleSet::from_loaded_reusing(edited, &m, Some(&first)));
    assert!(calls >= 2 * 1_000, "{calls} breaths compiling 1,000 rules");
    let ((), calls) = crate::config::watch::breathing(|| top.attach_fresh(&mut second));
    assert!(calls >= 1_000, "{calls} breaths attaching sketches to 1,000 rules");
    assert!(second.rules.iter().all(|r| r.top.is_some()));
}
