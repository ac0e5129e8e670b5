//! Overrides and tiers: which limits a request gets, and the headers that
//! report them.

use super::*;
use crate::limit::rules::PlanSource;

/// Rule "r" keyed on `user`, 10 per second, with `extra` lines.
fn by_user(extra: &str) -> RuleSet {
    set(&format!("[[rule]]\nname = \"r\"\nkey = [\"user\"]\nlimit = 10\nwindow = \"1s\"\n{extra}"))
}

/// The limit and where it came from, for request `r` of the set's rule.
fn plan(set: &RuleSet, r: &Req) -> (u64, u64, PlanSource) {
    let rule = &set.rules[0];
    let facts = r.facts();
    let mut k = String::new();
    rule.key(&facts, &mut k).expect("key");
    let p = rule.plan_for(&k, &facts);
    (p.nominal.limit, p.nominal.burst, p.source.clone())
}

fn user(name: &str) -> Req {
    get("/").header("x-user-id", name.as_bytes())
}

#[test]
fn an_override_gives_its_key_its_limits_and_no_other_key() {
    let s = by_user(
        "[[rule.override]]\nkey = \"user=alice\"\nlimit = 50\n[[rule.override]]\nkey = \"ip=9.9.9.9\"\nlimit = 2\nburst = 3\n",
    );
    assert_eq!(plan(&s, &user("alice")), (50, 50, PlanSource::Override("user=alice".into())));
    assert_eq!(plan(&s, &user("bob")), (10, 10, PlanSource::Rule));
    // A request without a user is keyed by its address: that override.
    assert_eq!(plan(&s, &get("/").client("9.9.9.9")), (2, 3, PlanSource::Override("ip=9.9.9.9".into())));
    assert_eq!(plan(&s, &get("/").client("9.9.9.8")).2, PlanSource::Rule);
}

#[test]
fn an_api_key_override_written_in_clear_or_as_its_hash_matches_the_key() {
    let mut hex = String::new();
    push_sha256_hex(&mut hex, b"sk-gold");
    let s = set(&format!(
        "[[rule]]\nname = \"r\"\nkey = [\"api_key\"]\nlimit = 10\nwindow = \"1s\"\n\
         [[rule.override]]\nkey = \"api_key=sha256:{hex}\"\nlimit = 70\n\
         [[rule.override]]\nkey = \"api_key=sk-silver\"\nlimit = 30\n"
    ));
    let with_key = |k: &str| get("/").header("x-api-key", k.as_bytes());
    assert_eq!(plan(&s, &with_key("sk-gold")).0, 70);
    assert_eq!(plan(&s, &with_key("sk-silver")).0, 30);
    assert_eq!(plan(&s, &with_key("sk-bronze")).0, 10);
}

#[test]
fn tiers_by_header_with_default_for_unknown_or_missing() {
    let s = by_user(
        "tier = \"header:x-plan\"\ntiers = { free = 100, pro = { limit = 1000, burst = 2000 }, default = 5 }\n\
         [[rule.override]]\nkey = \"user=vip\"\nlimit = 7\n",
    );
    assert_eq!(plan(&s, &user("a").header("x-plan", b"pro")), (1000, 2000, PlanSource::Tier("pro".into())));
    assert_eq!(plan(&s, &user("a").header("x-plan", b"free")), (100, 100, PlanSource::Tier("free".into())));
    assert_eq!(plan(&s, &user("a").header("x-plan", b"Pro")), (5, 5, PlanSource::DefaultTier), "exact names");
    assert_eq!(plan(&s, &user("a")), (5, 5, PlanSource::DefaultTier));
    // An override is about one key, and wins over its tier.
    assert_eq!(plan(&s, &user("vip").header("x-plan", b"pro")).0, 7);
    // The tier header is read by the rule, so it may come only once.
    assert!(s.read_headers.contains(&HeaderName::from_static("x-plan")));
    assert_eq!(s.tier_claim, None);
}

#[test]
fn tiers_by_claim_read_the_verified_claim_not_a_header() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("secret"), "0123456789abcdef0123456789abcdef-secret").expect("write");
    let main = "[client]\njwt = { key_file = \"secret\", algorithms = [\"HS256\"] }\n";
    let config = Config::parse(&dir.path().join("tollgate.toml"), main).expect("valid main file");
    let source = "[[rule]]\nname = \"r\"\nlimit = 10\nwindow = \"1s\"\ntier = \"claim:plan\"\ntiers = { pro = 100, default = 1 }\n";
    let specs = parse_rules(Path::new("r.toml"), source, &config).expect("valid").into_iter().map(|(s, _)| s);
    let s = RuleSet::build(specs.collect(), vec![], &Metrics::new());
    assert_eq!(s.tier_claim.as_deref(), Some("plan"));
    assert!(s.needs_user("/"), "the token is verified for its claim");
    let mut r = get("/").header("plan", b"pro");
    assert_eq!(plan(&s, &r).0, 1);
    r.tier_claim = Some("pro".into());
    assert_eq!(plan(&s, &r).0, 100);
}

#[test]
fn a_rule_without_overrides_or_tiers_has_only_its_own_plan() {
    let s = by_user("");
    assert!(s.rules[0].variants.is_none());
    assert_eq!(s.rules[0].plans().count(), 1);
}

#[test]
fn the_idle_horizon_covers_the_slowest_plan() {
    // The rule's bucket (10, refilled at 10/s) is fresh after 1 s; the slow
    // tier's (10, refilled at 1/s) after 10 s. Twice that, as for any rule.
    let s = by_user("tier = \"header:x-plan\"\ntiers = { slow = { limit = 1, burst = 10 }, default = 10 }\n");
    assert_eq!(s.idle_horizon, 2 * 10 * SEC);
    assert_eq!(by_user("").idle_horizon, 2 * SEC);
}

#[test]
fn headers_report_the_limits_the_request_was_checked_against() {
    let s = by_user("throttle = \"soft\"\nsoft_percent = 50\n[[rule.override]]\nkey = \"user=alice\"\nlimit = 40\n");
    let r = &s.rules[0];
    let req = user("alice");
    let facts = req.facts();
    let mut k = String::new();
    r.key(&facts, &mut k).expect("key");
    let p = r.plan_for(&k, &facts);
    // Soft headroom applies to an override's limits as to the rule's.
    let limits = r.limits_of(p, 0, &crate::limiter::clock::SystemClock);
    assert_eq!((limits.limit, limits.burst), (60, 60));
    let reports = [RuleReport::of(r, p, &verdict(true, 50, 1_000), limits.capacity())];
    let mut h = HeaderMap::new();
    headers::write(&mut h, &reports, 0);
    assert_eq!(
        header_pairs(&h),
        pairs(&[
            ("x-ratelimit-limit", "40"),
            ("x-ratelimit-remaining", "30"),
            ("x-ratelimit-reset", "1"),
            ("ratelimit-policy", "\"r\";q=40;w=1"),
            ("ratelimit", "\"r\";r=30;t=1"),
        ])
    );
    // Two rules: the policy list carries the override's quota too.
    let two = [reports[0], RuleReport::new(r, &verdict(true, 3, 1_000), 15)];
    let mut h = HeaderMap::new();
    headers::write(&mut h, &two, 0);
    assert_eq!(h.get("ratelimit-policy").expect("policy"), "\"r\";q=40;w=1, \"r\";q=10;w=1");
}

/// A response's status, headers in wire order and body.
fn wire(resp: http::Response<http_body_util::Full<bytes::Bytes>>) -> (u16, Vec<(String, String)>, bytes::Bytes) {
    use http_body_util::BodyExt;
    let status = resp.status().as_u16();
    let headers = resp
        .headers()
        .iter()
        .map(|(k, v)| (k.as_str().to_string(), v.to_str().expect("ascii header").to_string()))
        .collect();
    let body = futures::executor::block_on(resp.into_body().collect()).expect("body").to_bytes();
    (status, headers, body)
}

#[test]
fn a_prebuilt_429_head_is_the_response_built_header_by_header() {
    use crate::wire::error::ProxyError;
    let s = by_user("[[rule.override]]\nkey = \"user=alice\"\nlimit = 50\n");
    let rule = &s.rules[0];
    let id = HeaderValue::from_static("5f0c9a1e2b7d4c38-000000000000002a");
    for who in ["alice", "bob"] {
        let facts = user(who);
        let facts = facts.facts();
        let mut k = String::new();
        rule.key(&facts, &mut k).expect("key");
        let plan = rule.plan_for(&k, &facts);
        let head = plan.reject_head.as_ref().expect("a head for a rule with a fixed window");
        for (reset_ms, retry) in [(500, 1), (39_200, 12), (3_600_000, 3_600), (0, 0)] {
            let report = RuleReport::of(rule, plan, &verdict(false, 0, reset_ms), plan.nominal.capacity());
            let errors = [
                ProxyError::Limited {
                    rule: "r".into(),
                    limit: plan.nominal.limit,
                    window_seconds: 1,
                    retry_after_seconds: retry,
                },
                ProxyError::TooManyInFlight { rule: "r".into(), limit: plan.nominal.limit },
            ];
            for err in errors {
                let fast = wire(err.clone().into_limited_response(&id, head, &report));
                let mut slow = err.into_response(&id);
                headers::write(slow.headers_mut(), &[report], 0);
                assert_eq!(fast, wire(slow), "{who}, reset {reset_ms} ms, retry {retry} s");
            }
        }
    }
    let calendar = set("[[rule]]\nname = \"c\"\nlimit = 10\ncalendar = \"day\"\n");
    assert!(calendar.rules[0].plan.reject_head.is_none(), "a calendar window's w changes: no prebuilt head");
}
