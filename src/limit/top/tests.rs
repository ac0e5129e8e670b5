//! Unit tests of the per-rule sketches: the window, `by`, merging shards
//! with their error bounds, and reloads. Time is a [`ManualClock`].

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use super::*;
use crate::config::{Config, parse_rules};
use crate::limit::rules::RuleSet;
use crate::limiter::NANOS_PER_SEC;
use crate::limiter::clock::ManualClock;
use crate::obs::metrics::Metrics;

/// An instant at the start of a period, far from the epoch.
const T0: Nanos = 1_000 * PERIOD_NANOS;

fn top(capacity: usize, clock: &ManualClock) -> TopKeys {
    TopKeys::with_shards(capacity, 1, Arc::new(clock.clone())).expect("capacity above 0")
}

fn rules(names: &[&str]) -> RuleSet {
    let main = "[[upstream]]\nname = \"u\"\nurl = \"http://127.0.0.1:9001\"\n\n[[route]]\npath_prefix = \"/\"\nupstream = \"u\"\n";
    let config = Config::parse(Path::new("tollgate.toml"), main).expect("valid main file");
    let source: String =
        names.iter().map(|n| format!("[[rule]]\nname = \"{n}\"\nlimit = 1\nwindow = \"1s\"\n\n")).collect();
    let specs = parse_rules(Path::new("r.toml"), &source, &config).expect("valid rules");
    RuleSet::build(specs.into_iter().map(|(s, _)| s).collect(), vec![], &Metrics::new())
}

/// `names` as a rule set attached to `t`, each rule's sketches having
/// counted the key `k` once.
fn attached_and_counted(t: &TopKeys, names: &[&str]) -> RuleSet {
    let mut set = rules(names);
    t.attach(&mut set);
    let p = t.period_now();
    for rule in &set.rules {
        rule.top.as_ref().expect("attached").record(p, "k", false);
    }
    set
}

fn keys(report: &Report) -> Vec<(&str, u64, u64)> {
    report.keys.iter().map(|k| (k.key.as_str(), k.count, k.error)).collect()
}

#[test]
fn zero_top_keys_is_off() {
    assert!(TopKeys::new(0, Arc::new(ManualClock::new(T0))).is_none());
}

#[test]
fn requests_and_limited_rank_keys_apart() {
    let clock = ManualClock::new(T0);
    let t = top(8, &clock);
    let r = RuleTop::new(8, 1);
    let p = t.period_now();
    for _ in 0..5 {
        r.record(p, "a", false);
    }
    for _ in 0..3 {
        r.record(p, "b", true);
    }
    let by_requests = t.report(&r, By::Requests, 10);
    assert_eq!(keys(&by_requests), [("a", 5, 0), ("b", 3, 0)]);
    assert_eq!(by_requests.total, 8);
    let by_limited = t.report(&r, By::Limited, 10);
    assert_eq!(keys(&by_limited), [("b", 3, 0)]);
    assert_eq!(by_limited.total, 3);
    assert_eq!(keys(&t.report(&r, By::Requests, 1)), [("a", 5, 0)]);
}

#[test]
fn the_window_is_this_half_minute_and_the_one_before() {
    let clock = ManualClock::new(T0 + 10 * NANOS_PER_SEC);
    let t = top(8, &clock);
    let r = RuleTop::new(8, 1);
    r.record(t.period_now(), "old", false);
    assert_eq!(t.report(&r, By::Requests, 10).window, Duration::from_secs(40));
    // Next period: still shown, from the sketch not yet rotated...
    clock.advance(Duration::from_secs(30));
    t.tick();
    assert_eq!(keys(&t.report(&r, By::Requests, 10)), [("old", 1, 0)]);
    // ...and after it rotated.
    r.record(t.period_now(), "new", false);
    assert_eq!(keys(&t.report(&r, By::Requests, 10)), [("new", 1, 0), ("old", 1, 0)]);
    // Two periods on, "old" is gone whether or not anything rotates.
    clock.advance(Duration::from_secs(30));
    t.tick();
    assert_eq!(keys(&t.report(&r, By::Requests, 10)), [("new", 1, 0)]);
    clock.advance(Duration::from_secs(30));
    t.tick();
    assert!(t.report(&r, By::Requests, 10).keys.is_empty());
    r.record(t.period_now(), "later", false);
    assert_eq!(keys(&t.report(&r, By::Requests, 10)), [("later", 1, 0)]);
}

#[test]
fn the_request_path_sees_a_new_period_once_ticked() {
    let clock = ManualClock::new(T0 + 29 * NANOS_PER_SEC);
    let t = top(8, &clock);
    let before = t.period_now();
    clock.advance(Duration::from_secs(2));
    assert_eq!(t.period_now(), before, "no clock read on the request path");
    t.tick();
    assert_eq!(t.period_now(), before + 1);
}

#[test]
fn merged_shards_keep_the_bounds_of_one_sketch() {
    // A stream dealt over four shards of 16 slots: heavy keys k0..k3 and a
    // long tail, interleaved differently per shard.
    let mut truth: HashMap<String, u64> = HashMap::new();
    let mut shards: Vec<SpaceSaving> = (0..4).map(|_| SpaceSaving::new(16)).collect();
    let mut x: u64 = 12345;
    for i in 0..100_000u64 {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let key = match (x >> 33) % 10 {
            0..=3 => format!("k{}", (x >> 40) % 4),
            _ => format!("tail{}", (x >> 20) % 20_000),
        };
        *truth.entry(key.clone()).or_default() += 1;
        shards[(i % 4) as usize].record(&key);
    }
    let parts: Vec<Summary> = shards.iter().map(Summary::of).collect();
    let n: u64 = truth.values().sum();
    let merged = merge(&parts, 16);
    assert_eq!(merged.len(), 16);
    for k in &merged {
        let t = truth[&k.key];
        assert!(
            k.count - k.error <= t && t <= k.count,
            "{}: true {t} outside [{}, {}]",
            k.key,
            k.count - k.error,
            k.count
        );
        assert!(k.error <= n / 16, "{}: error {} over N/k {}", k.key, k.error, n / 16);
    }
    let shown: Vec<&str> = merged.iter().map(|k| k.key.as_str()).collect();
    for (key, t) in &truth {
        if *t > n / 16 {
            assert!(shown.contains(&key.as_str()), "{key} seen {t} times (> N/k) is not shown");
        }
    }
    assert_eq!(&shown[..4].iter().all(|k| k.starts_with('k')), &true, "{shown:?}");
}

#[test]
fn a_busy_shard_sends_the_count_to_another() {
    let clock = ManualClock::new(T0);
    let t = TopKeys::with_shards(4, 2, Arc::new(clock.clone())).expect("on");
    let r = RuleTop::new(4, 2);
    let p = t.period_now();
    let held = r.shards.lock(thread_slot() % 2);
    r.record(p, "a", false);
    drop(held);
    r.record(p, "a", false);
    assert_eq!(keys(&t.report(&r, By::Requests, 4)), [("a", 2, 0)]);
}

#[test]
fn a_reload_keeps_the_counts_of_rules_kept_and_drops_the_others() {
    let clock = ManualClock::new(T0);
    let t = top(4, &clock);
    let _first = attached_and_counted(&t, &["kept", "gone"]);
    let mut second = rules(&["kept", "new"]);
    t.attach(&mut second);
    let report = |set: &RuleSet, i: usize| t.report(set.rules[i].top.as_ref().expect("attached"), By::Requests, 4);
    assert_eq!(keys(&report(&second, 0)), [("k", 1, 0)]);
    assert!(report(&second, 1).keys.is_empty());
    assert_eq!(t.by_rule.lock().len(), 2);
    assert!(!t.by_rule.lock().contains_key("gone"));
}

#[test]
fn a_rule_a_reload_shares_keeps_its_sketch() {
    let clock = ManualClock::new(T0);
    let t = top(4, &clock);
    let mut first = rules(&["kept", "gone"]);
    t.attach(&mut first);
    let specs = first.rules.iter().map(|r| r.spec.clone()).take(1).collect();
    let loaded = crate::config::LoadedRules { rules: specs, ..Default::default() };
    let mut second = RuleSet::from_loaded_reusing(loaded, &Metrics::new(), Some(&first));
    assert!(Arc::ptr_eq(&first.rules[0], &second.rules[0]), "the rule is shared");
    t.attach(&mut second);
    let (a, b) = (first.rules[0].top.as_ref().expect("attached"), second.rules[0].top.as_ref().expect("attached"));
    assert!(Arc::ptr_eq(a, b));
    assert!(Arc::ptr_eq(b, &t.by_rule.lock()["kept"]));
    assert_eq!(t.by_rule.lock().len(), 1);
}

/// A reload that edits rules and keeps every name where it was attaches
/// only the rules compiled anew, each to the sketches of its name, and
/// gives the same sketches as a full attach would.
#[test]
fn a_reload_with_the_same_names_attaches_only_the_rules_compiled_anew() {
    let clock = ManualClock::new(T0);
    let t = top(4, &clock);
    let first = attached_and_counted(&t, &["a", "b"]);
    // a kept, b edited: compiled anew, under the same name.
    let mut edited = (*first.rules[1].spec).clone();
    edited.limit = 2;
    let specs = vec![first.rules[0].spec.clone(), Arc::new(edited)];
    let loaded = crate::config::LoadedRules { rules: specs, ..Default::default() };
    let mut second = RuleSet::from_loaded_reusing(loaded, &Metrics::new(), Some(&first));
    assert!(second.same_names(&first) && !Arc::ptr_eq(&first.rules[1], &second.rules[1]));
    assert!(second.rules[1].top.is_none(), "b is compiled anew");
    t.attach_fresh(&mut second);
    for i in 0..2 {
        let (was, now) =
            (first.rules[i].top.as_ref().expect("attached"), second.rules[i].top.as_ref().expect("attached"));
        assert!(Arc::ptr_eq(was, now), "rule {i}");
    }
    let report = t.report(second.rules[1].top.as_ref().expect("attached"), By::Requests, 4);
    assert_eq!(keys(&report), [("k", 1, 0)]);
    assert_eq!(t.by_rule.lock().len(), 2);
}
