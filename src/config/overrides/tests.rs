//! Validation of `[[rule.override]]`, `tier` and `tiers`: the forms keys
//! may be written in, and every error with its place.

use std::path::Path;

use crate::config::{Config, RuleSpec, TierSource, parse_rules};

fn config() -> Config {
    Config::parse(Path::new("tollgate.toml"), "[[upstream]]\nname = \"u\"\nurl = \"http://127.0.0.1:9001\"\n")
        .expect("valid main file")
}

/// A main file with `[client] jwt`, its secret in a directory kept alive
/// by the caller.
fn jwt_config(dir: &tempfile::TempDir) -> Config {
    std::fs::write(dir.path().join("secret"), "0123456789abcdef0123456789abcdef-secret").expect("write secret");
    let main = "[client]\njwt = { key_file = \"secret\", algorithms = [\"HS256\"] }\n";
    Config::parse(&dir.path().join("tollgate.toml"), main).expect("valid main file")
}

fn rule_with(config: &Config, source: &str) -> Result<RuleSpec, Vec<String>> {
    match parse_rules(Path::new("r.toml"), source, config) {
        Ok(mut r) => Ok(r.remove(0).0),
        Err(e) => Err(e.0.iter().map(ToString::to_string).collect()),
    }
}

/// Rule "r": 10 per minute keyed on `key`, then `extra`.
fn source(key: &str, extra: &str) -> String {
    format!("[[rule]]\nname = \"r\"\nkey = {key}\nlimit = 10\nwindow = \"1m\"\n{extra}")
}

fn valid(key: &str, extra: &str) -> RuleSpec {
    rule_with(&config(), &source(key, extra)).unwrap_or_else(|e| panic!("expected a valid rule: {e:?}"))
}

fn errors(key: &str, extra: &str) -> Vec<String> {
    rule_with(&config(), &source(key, extra)).expect_err("expected errors")
}

fn override_keys(key: &str, keys: &[&str]) -> Vec<String> {
    let extra: String = keys.iter().map(|k| format!("[[rule.override]]\nkey = {k:?}\nlimit = 5\n")).collect();
    valid(key, &extra).overrides.into_iter().map(|o| o.key).collect()
}

#[test]
fn override_keys_are_read_as_the_rule_builds_them() {
    assert_eq!(
        override_keys("[\"user\"]", &["user=alice", "r|user=bob", "user=a%20b"]),
        ["user=alice", "user=bob", "user=a%20b"]
    );
    // Written plainly, a value is encoded as requests' values are.
    assert_eq!(override_keys("[\"user\"]", &["user=a b"]), ["user=a%20b"]);
}

#[test]
fn api_keys_are_written_as_their_sha256_or_in_clear() {
    // Some SHA-256, in hex.
    let hex = "0f7b1e4b3d1d0c0fc5de4c6d06d4b8a6b2ef6d95ff0f1cd1fae1ef70a3bd2e8a";
    let mut clear = String::new();
    crate::config::key::push_sha256_hex(&mut clear, b"sk-live-1");
    let keys = override_keys(
        "[\"api_key\"]",
        &["api_key=sk-live-1", &format!("api_key=sha256:{}", hex.to_uppercase()), &format!("api_key={hex}")],
    );
    let mut raw_hex = String::new();
    crate::config::key::push_sha256_hex(&mut raw_hex, hex.as_bytes());
    assert_eq!(
        keys,
        [format!("api_key=sha256:{clear}"), format!("api_key=sha256:{hex}"), format!("api_key=sha256:{raw_hex}")]
    );
    // A hash that is not one can never match.
    for bad in ["sha256:abc", "sha256:"] {
        let e = errors("[\"api_key\"]", &format!("[[rule.override]]\nkey = \"api_key={bad}\"\nlimit = 5\n"));
        assert!(e.len() == 1 && e[0].contains("64 hex digits"), "{bad}: {e:?}");
    }
}

#[test]
fn any_part_may_be_the_ip_a_request_without_it_falls_back_to() {
    assert_eq!(
        override_keys("[\"ip\", \"user\"]", &["ip=2001:DB8:0:1::|user=alice", "ip=203.0.113.7|ip=203.0.113.7"]),
        ["ip=2001:db8:0:1::|user=alice", "ip=203.0.113.7|ip=203.0.113.7"]
    );
}

#[test]
fn an_override_without_burst_keeps_the_rules_burst_ratio() {
    let r = valid(
        "[\"user\"]",
        "burst = 20\n[[rule.override]]\nkey = \"user=a\"\nlimit = 3\n[[rule.override]]\nkey = \"user=b\"\nlimit = 3\nburst = 4\n",
    );
    let limits: Vec<(u64, u64)> = r.overrides.iter().map(|o| (o.limit, o.burst)).collect();
    assert_eq!(limits, [(3, 6), (3, 4)]);
    assert_eq!(r.overrides[0].line, 7);
    let r = valid("[\"user\"]", "[[rule.override]]\nkey = \"user=a\"\nlimit = 1000\n");
    assert_eq!((r.overrides[0].limit, r.overrides[0].burst), (1000, 1000));
}

#[test]
fn override_errors_point_at_the_override() {
    let key = "[\"user\"]";
    assert_eq!(
        errors(key, "[[rule.override]]\nlimit = 5\n"),
        ["r.toml:6:1: an override needs a key (the key as `tollgate explain` shows it)"]
    );
    assert_eq!(errors(key, "[[rule.override]]\nkey = \"user=a\"\n"), ["r.toml:6:1: an override needs a limit"]);
    assert_eq!(
        errors(key, "[[rule.override]]\nkey = \"user=a\"\nlimit = 0\n"),
        ["r.toml:8:9: override limit must be at least 1, not 0"]
    );
    assert_eq!(
        errors(key, "[[rule.override]]\nkey = \"user=a\"\nlimit = 5\nburst = 1000000001\n"),
        ["r.toml:9:9: override burst must be at most 1000000000"]
    );
    assert_eq!(
        errors(
            key,
            "[[rule.override]]\nkey = \"user=a\"\nlimit = 5\n[[rule.override]]\nkey = \"r|user=%61\"\nlimit = 6\n"
        ),
        ["r.toml:10:7: override key \"user=a\" is already set at line 6"]
    );
    assert_eq!(
        errors(
            key,
            "[[rule.override]]\nkey = \"path=/x\"\nlimit = 5\n[[rule.override]]\nkey = \"user=a|path=/x\"\nlimit = 5\n[[rule.override]]\nkey = \"other|user=a\"\nlimit = 5\n[[rule.override]]\nkey = \"ip=not-an-ip\"\nlimit = 5\n[[rule.override]]\nkey = \"alice\"\nlimit = 5\n"
        ),
        [
            "r.toml:7:7: override key \"path=/x\": part 1 (user) is keyed as user=VALUE (or ip=ADDRESS when a request lacks it), not path=",
            "r.toml:10:7: override key \"user=a|path=/x\": the rule's key [user] has 1 part(s), this has 2: write one tag=value per part, joined by '|'",
            "r.toml:13:7: override key \"other|user=a\": it names rule \"other\", not this rule",
            "r.toml:16:7: override key \"ip=not-an-ip\": \"not-an-ip\" is not an IP address",
            "r.toml:19:7: override key \"alice\": \"alice\" is not user=VALUE",
        ]
    );
    assert_eq!(
        errors("[\"path\"]", "[[rule.override]]\nkey = \"ip=192.0.2.1\"\nlimit = 5\n"),
        ["r.toml:7:7: override key \"ip=192.0.2.1\": part 1 (path) is never keyed by ip: every request has one"]
    );
    assert_eq!(
        errors("[\"ip\"]", "[[rule.override]]\nkey = \"user=a\"\nlimit = 5\n"),
        ["r.toml:7:7: override key \"user=a\": part 1 is keyed as ip=ADDRESS, not user="]
    );
    assert_eq!(
        errors("[\"header:x-team\"]", "[[rule.override]]\nkey = \"h=\"\nlimit = 5\n"),
        ["r.toml:7:7: override key \"h=\": part 1 has an empty value, which requests key as ip=ADDRESS"]
    );
    assert_eq!(
        errors(key, "[[rule.override]]\nkey = \"user=a\"\nlimit = 5\nnote = \"x\"\n")[0].split(',').next(),
        Some("r.toml:9:1: unknown field `note`")
    );
}

#[test]
fn an_override_too_small_for_the_rules_cost_is_refused() {
    assert_eq!(
        errors("[\"user\"]", "cost = 4\n[[rule.override]]\nkey = \"user=a\"\nlimit = 3\n"),
        ["r.toml:9:9: override: the rule's cost 4 is larger than its bucket (3): no request could ever pass"]
    );
}

#[test]
fn tiers_by_header_or_claim() {
    let r = valid(
        "[\"user\"]",
        "tier = \"header:X-Plan\"\ntiers = { free = 100, pro = { limit = 1000, burst = 1500 }, default = 10 }\n",
    );
    let t = r.tiers.expect("tiers");
    assert_eq!(t.source, TierSource::Header(http::HeaderName::from_static("x-plan")));
    assert_eq!(t.tiers, [("free".to_string(), 100, 100), ("pro".to_string(), 1000, 1500)]);
    assert_eq!(t.default, (10, 10));

    let dir = tempfile::tempdir().expect("tempdir");
    let jwt = jwt_config(&dir);
    let r = rule_with(&jwt, &source("[\"user\"]", "tier = \"claim:plan\"\ntiers = { default = 1 }\n")).expect("valid");
    assert_eq!(r.tiers.expect("tiers").source, TierSource::Claim("plan".into()));
}

#[test]
fn tier_errors_point_at_tier_or_tiers() {
    let key = "[\"user\"]";
    assert_eq!(
        errors(key, "tier = \"header:x-plan\"\n"),
        ["r.toml:6:8: tier needs tiers = { NAME = LIMIT, ..., default = LIMIT }"]
    );
    assert_eq!(
        errors(key, "tiers = { default = 1 }\n"),
        ["r.toml:6:9: tiers needs tier = \"header:NAME\" or \"claim:NAME\" to choose one"]
    );
    assert_eq!(
        errors(key, "tier = \"query:plan\"\ntiers = { default = 1 }\n"),
        ["r.toml:6:8: tier \"query:plan\" is not \"header:NAME\" or \"claim:NAME\""]
    );
    assert_eq!(
        errors(key, "tier = \"header:x plan\"\ntiers = { default = 1 }\n"),
        ["r.toml:6:8: tier \"header:x plan\" is not \"header:NAME\" or \"claim:NAME\""]
    );
    assert_eq!(
        errors(key, "tier = \"claim:plan\"\ntiers = { default = 1 }\n"),
        ["r.toml:6:8: tier \"claim:plan\" reads a JWT claim: configure [client] jwt first"]
    );
    assert_eq!(
        errors(key, "tier = \"header:x-plan\"\ntiers = { pro = 100 }\n"),
        ["r.toml:7:9: tiers needs a default: the limit of requests without a tier or with an unknown one"]
    );
    assert_eq!(
        errors(
            key,
            "tier = \"header:x-plan\"\ntiers = { pro = 0, free = \"many\", gold = { limit = 5, cap = 2 }, default = 1 }\n"
        ),
        [
            "r.toml:7:17: tier \"pro\" limit must be at least 1, not 0",
            "r.toml:7:27: tier \"free\" must be a limit (a whole number) or { limit, burst }",
            "r.toml:7:42: tier \"gold\": unknown key \"cap\" (limit, burst)",
        ]
    );
}

#[test]
fn all_claim_tiers_read_one_claim() {
    let dir = tempfile::tempdir().expect("tempdir");
    let jwt = jwt_config(&dir);
    let two = "[[rule]]\nname = \"a\"\nlimit = 1\nwindow = \"1s\"\ntier = \"claim:plan\"\ntiers = { default = 1 }\n\
               [[rule]]\nname = \"b\"\nlimit = 1\nwindow = \"1s\"\ntier = \"claim:tier\"\ntiers = { default = 1 }\n";
    let e = parse_rules(Path::new("r.toml"), two, &jwt).expect_err("errors");
    assert_eq!(
        e.to_string(),
        "r.toml:8:8: tier \"claim:tier\": rule \"a\" (r.toml:1) reads tiers from claim \"plan\", and all rules must read the same claim"
    );
}

#[test]
fn claim_tiers_across_files_are_checked_against_the_first_rule_that_reads_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let jwt = jwt_config(&dir);
    let rules = dir.path().join("rules");
    std::fs::create_dir(&rules).expect("rules dir");
    let claim = |name: &str, claim: &str| {
        format!(
            "[[rule]]\nname = \"{name}\"\nlimit = 1\nwindow = \"1s\"\ntier = \"claim:{claim}\"\ntiers = {{ default = 1 }}\n"
        )
    };
    let plain = "[[rule]]\nname = \"p\"\nlimit = 1\nwindow = \"1s\"\n";
    std::fs::write(rules.join("a.toml"), format!("{plain}{}", claim("a", "plan"))).expect("write");
    std::fs::write(rules.join("b.toml"), claim("c", "tier")).expect("write");
    let e = crate::config::load_rules(&rules, &jwt).expect_err("two claims");
    let lines: Vec<String> = e.0.iter().map(ToString::to_string).collect();
    assert_eq!(
        lines,
        [format!(
            "{}:2:8: tier \"claim:tier\": rule \"a\" ({}:5) reads tiers from claim \"plan\", and all rules must read the same claim",
            rules.join("b.toml").display(),
            rules.join("a.toml").display()
        )]
    );
}

/// Issue 29: `ip=::ffff:127.0.0.1` and `ip=2001:db8:1::5` were accepted and
/// never applied: requests are keyed by the IPv4 address and by the /64.
#[test]
fn override_addresses_are_read_as_clients_are_keyed() {
    assert_eq!(
        override_keys("[\"ip\"]", &["ip=::ffff:127.0.0.1", "ip=2001:db8:1::", "ip=2001:db8:2:0:0::"]),
        ["ip=127.0.0.1", "ip=2001:db8:1::", "ip=2001:db8:2::"]
    );
    let e = errors("[\"ip\"]", "[[rule.override]]\nkey = \"ip=2001:db8:1::5\"\nlimit = 5\n");
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(e[0].contains("inside a /64") && e[0].contains("write ip=2001:db8:1::"), "{e:?}");
}

#[test]
fn an_ipv4_mapped_exempt_network_is_the_ipv4_one() {
    let r = valid("[\"ip\"]", "exempt = { ips = [\"::ffff:198.51.100.9\", \"::ffff:10.0.0.0/104\"] }\n");
    for (ip, exempt) in [("198.51.100.9", true), ("10.1.2.3", true), ("198.51.100.8", false)] {
        let ip: std::net::IpAddr = ip.parse().expect("address");
        assert_eq!(r.exempt.contains(ip, None, None), exempt, "{ip}");
    }
}
