//! Arbitrary text as a rules file, validated against a fixed, valid main
//! config.
//!
//! `parse_rules_file` must never panic and its errors must render. When the
//! text parses, the rules and `[[deny]]` entries must compile
//! (`RuleSet::from_loaded`, which calls `RuleSet::build`), and deny checks,
//! matching, key building, costs and throttled limits on a fixed request
//! must not panic.

#![no_main]

use std::net::IpAddr;
use std::path::Path;
use std::sync::OnceLock;

use http::{HeaderMap, HeaderName, HeaderValue, Method};
use libfuzzer_sys::fuzz_target;
use tollgate::config::{Config, LoadedRules, parse_rules_file};
use tollgate::obs::metrics::Metrics;
use tollgate::limit::rules::{RequestFacts, RuleSet};

/// One upstream behind a named route, so `match.route` has names to hit.
const MAIN: &str = r#"
[[upstream]]
name = "orders"
url = "http://127.0.0.1:9001"

[[route]]
name = "orders-api"
path_prefix = "/orders"
upstream = "orders"
"#;

fn config() -> &'static Config {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    CONFIG.get_or_init(|| match Config::parse(Path::new("tollgate.toml"), MAIN) {
        Ok(c) => c,
        Err(e) => panic!("the fixed main config is invalid:\n{e}"),
    })
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let loaded = match parse_rules_file(Path::new("rules.toml"), &text, config()) {
        Ok(file) => LoadedRules {
            rules: file.rules.into_iter().map(|(spec, _)| spec).collect(),
            denies: file.denies,
            files: vec!["rules.toml".into()],
        },
        Err(errors) => {
            assert!(!errors.0.is_empty(), "an error result carries at least one error");
            let _ = errors.to_string();
            return;
        }
    };
    // A registry per input: rule names are label values, and one shared
    // registry would grow with every name the fuzzer invents.
    let metrics = Metrics::new();
    let set = RuleSet::from_loaded(loaded, &metrics);

    let mut headers = HeaderMap::new();
    for (name, value) in
        [("x-user-id", "alice"), ("x-api-key", "k-123"), ("x-tier", "free"), ("x-cost", "3"), ("cost", "1000000000000")]
    {
        headers.append(HeaderName::from_static(name), HeaderValue::from_static(value));
    }
    let client: IpAddr = [203, 0, 113, 7].into();
    let facts = RequestFacts {
        method: &Method::POST,
        path: "/orders/42",
        query: Some("page=2&tenant=acme&tenant=other"),
        host: Some("api.example.com"),
        route: Some(("orders-api", "orders")),
        headers: &headers,
        client,
        client_ip: client,
        user: Some(b"alice"),
        api_key: Some(b"k-123"),
    };
    let _ = set.denied(&facts);
    let mut key = String::new();
    for rule in set.matching(&facts) {
        let _ = rule.key(&facts, &mut key);
        assert!(
            !key.bytes().any(|b| b == b'{' || b == b'}' || b.is_ascii_control()),
            "key {key:?} of rule {:?} holds a brace or a control byte",
            rule.name()
        );
        let _ = rule.cost(&headers);
        for inflight in [0, 1, usize::MAX] {
            let _ = rule.effective_limits(inflight);
        }
    }
});
