//! Micro-benchmarks of the per-request work, each beside a naive baseline so
//! a number always means something (pingora's `pingora-limits` benches do
//! the same): what would it cost if we had written the obvious thing?
//!
//! Run with `cargo bench --bench hot_path`. Timing thresholds never go into
//! `cargo test`; these figures go into docs/benchmarks.md.

use std::collections::HashMap;
use std::hint::black_box;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use http::{HeaderMap, HeaderValue, Method};
use parking_lot::Mutex;
use tollgate::config::{Config, parse_rules};
use tollgate::limit::rules::RuleReport;
use tollgate::limit::rules::{RequestFacts, RuleSet};
use tollgate::limiter::clock::{ManualClock, SystemClock};
use tollgate::limiter::{self, Algorithm, Cell, Limits, NANOS_PER_SEC};
use tollgate::obs::metrics::Metrics;
use tollgate::store::{Check, MemoryStore, Mode};
use tollgate::wire::headers;

const MAIN: &str = r#"
[[upstream]]
name = "api"
url = "http://127.0.0.1:9"
[[route]]
path_prefix = "/"
upstream = "api"
"#;

fn rule_set(toml: &str) -> RuleSet {
    let config = Config::parse(Path::new("bench.toml"), MAIN).expect("bench config is valid");
    let specs = parse_rules(Path::new("bench-rules.toml"), toml, &config).expect("bench rules are valid");
    RuleSet::build(specs.into_iter().map(|(s, _)| s).collect(), vec![], &Metrics::new())
}

/// 1,000 rules on distinct exact paths, the request matching the last one.
fn thousand_rules() -> String {
    let mut s = String::new();
    for i in 0..1000 {
        s.push_str(&format!(
            "[[rule]]\nname = \"r{i}\"\nmatch = {{ methods = [\"GET\"], path = \"/api/v1/resource{i}\" }}\nkey = [\"user\"]\nlimit = 100\nwindow = \"1m\"\n"
        ));
    }
    s
}

fn facts<'a>(
    method: &'a Method,
    path: &'a str,
    headers: &'a HeaderMap,
    names: &'a [http::HeaderName; 2],
) -> RequestFacts<'a> {
    RequestFacts {
        method,
        path,
        query: Some("page=2"),
        host: Some("api.example.com"),
        route: Some(("api", "api")),
        headers,
        client: IpAddr::from([203, 0, 113, 7]),
        client_ip: IpAddr::from([203, 0, 113, 7]),
        user: headers.get(&names[0]).map(|v| v.as_bytes()),
        api_key: headers.get(&names[1]).map(|v| v.as_bytes()),
        tier_claim: None,
        client_cert: None,
    }
}

fn matching(c: &mut Criterion) {
    let set = rule_set(&thousand_rules());
    let names = [http::HeaderName::from_static("x-user-id"), http::HeaderName::from_static("x-api-key")];
    let mut headers = HeaderMap::new();
    headers.insert("x-user-id", HeaderValue::from_static("user-42"));
    let method = Method::GET;
    let f = facts(&method, "/api/v1/resource999", &headers, &names);
    let mut g = c.benchmark_group("match_1000_rules");
    g.bench_function("tollgate", |b| b.iter(|| black_box(set.matching(black_box(&f)).count())));
    // Naive: every rule's pattern re-parsed from its text on each request.
    let patterns: Vec<String> = (0..1000).map(|i| format!("GET /api/v1/resource{i}")).collect();
    g.bench_function("naive_format_compare", |b| {
        b.iter(|| {
            let wanted = format!("{} {}", f.method, f.path);
            black_box(patterns.iter().filter(|p| **p == wanted).count())
        })
    });
    g.finish();
}

fn keys(c: &mut Criterion) {
    let set = rule_set("[[rule]]\nname = \"per-user\"\nkey = [\"user\", \"route\"]\nlimit = 10\nwindow = \"1s\"\n");
    let rule = &set.rules[0];
    let names = [http::HeaderName::from_static("x-user-id"), http::HeaderName::from_static("x-api-key")];
    let mut headers = HeaderMap::new();
    headers.insert("x-user-id", HeaderValue::from_static("user-4242"));
    let method = Method::GET;
    let f = facts(&method, "/api/items", &headers, &names);
    let mut g = c.benchmark_group("key");
    let mut buf = String::with_capacity(64);
    g.bench_function("tollgate_reused_buffer", |b| {
        b.iter(|| {
            let _ = rule.key(black_box(&f), &mut buf);
            black_box(buf.len())
        })
    });
    // Naive: format! a fresh string with no escaping (and so no injectivity).
    g.bench_function("naive_format", |b| {
        b.iter(|| {
            let user = f.headers.get("x-user-id").and_then(|v| v.to_str().ok()).unwrap_or("");
            black_box(format!("{}|user={}|route={}", rule.name(), user, "api"))
        })
    });
    g.finish();
}

fn limits(algorithm: Algorithm) -> Limits {
    Limits { algorithm, limit: 1_000_000, window: NANOS_PER_SEC, burst: 1_000_000, origin: 0 }
}

const ALGORITHMS: [Algorithm; 5] = [
    Algorithm::TokenBucket,
    Algorithm::LeakyBucket,
    Algorithm::FixedWindow,
    Algorithm::SlidingWindowLog,
    Algorithm::SlidingWindowCounter,
];

fn algorithms(c: &mut Criterion) {
    let mut g = c.benchmark_group("arithmetic");
    for alg in ALGORITHMS.into_iter().filter(|a| !a.uses_log()) {
        let l = limits(alg);
        let mut now = 1_000 * NANOS_PER_SEC;
        let mut cell = Cell::default();
        g.bench_function(alg.as_str(), |b| {
            b.iter(|| {
                now += 1_000;
                let (v, next) = limiter::evaluate(cell, now, &l, 1);
                cell = next;
                black_box(v)
            })
        });
    }
    g.finish();

    // The whole memory-store decision, 10,000 distinct users, against a
    // naive store: one global Mutex<HashMap<String, (u64, u64)>> fixed window.
    let mut g = c.benchmark_group("memory_store_10k_keys");
    let keys: Vec<String> = (0..10_000).map(|i| format!("per-user|user=user-{i}")).collect();
    for alg in ALGORITHMS {
        let store = MemoryStore::new(Arc::new(ManualClock::new(1_000 * NANOS_PER_SEC)));
        let l = limits(alg);
        let mut i = 0usize;
        g.bench_function(alg.as_str(), |b| {
            b.iter(|| {
                i = (i + 1) % keys.len();
                let check = Check {
                    key: &keys[i],
                    limits: l,
                    cost: 1,
                    enforced: true,
                    on_error: tollgate::config::OnError::Allow,
                    settles: false,
                    penalty: None,
                };
                black_box(store.check_now(std::slice::from_ref(&check), Mode::Consume))
            })
        });
    }
    let naive: Mutex<HashMap<String, (u64, u64)>> = Mutex::new(HashMap::new());
    let clock = SystemClock;
    let mut i = 0usize;
    g.bench_function("naive_global_mutex_fixed_window", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            let now = tollgate::limiter::clock::Clock::now(&clock);
            let window = now / NANOS_PER_SEC;
            let mut map = naive.lock();
            let e = map.entry(keys[i].clone()).or_insert((window, 0));
            if e.0 != window {
                *e = (window, 0);
            }
            e.1 += 1;
            black_box(e.1 <= 1_000_000)
        })
    });
    g.finish();
}

fn header_rendering(c: &mut Criterion) {
    let set = rule_set(
        "[[rule]]\nname = \"per-user\"\nkey = [\"user\"]\nlimit = 100\nwindow = \"1m\"\n\
         [[rule]]\nname = \"per-ip\"\nlimit = 1000\nwindow = \"1h\"\n",
    );
    let verdict =
        limiter::Verdict { allowed: true, remaining: 57, reset_after: 12 * NANOS_PER_SEC, ..Default::default() };
    let reports: Vec<RuleReport<'_>> =
        set.rules.iter().map(|r| RuleReport::new(r, &verdict, r.plan.nominal.capacity())).collect();
    let mut g = c.benchmark_group("headers_two_rules");
    g.bench_function("tollgate", |b| {
        b.iter(|| {
            let mut h = HeaderMap::new();
            headers::write(&mut h, black_box(&reports), 0);
            black_box(h)
        })
    });
    g.bench_function("naive_format_each", |b| {
        b.iter(|| {
            let mut h = HeaderMap::new();
            let r = &reports[0];
            h.insert(
                "x-ratelimit-limit",
                HeaderValue::from_str(&format!("{}", r.rule.spec.limit)).unwrap_or(HeaderValue::from_static("0")),
            );
            h.insert(
                "x-ratelimit-remaining",
                HeaderValue::from_str(&format!("{}", r.remaining)).unwrap_or(HeaderValue::from_static("0")),
            );
            h.insert(
                "x-ratelimit-reset",
                HeaderValue::from_str(&format!("{}", r.reset_secs)).unwrap_or(HeaderValue::from_static("0")),
            );
            let policy: Vec<String> = reports
                .iter()
                .map(|r| format!("\"{}\";q={};w={}", r.rule.name(), r.rule.spec.limit, r.rule.window_secs))
                .collect();
            let state: Vec<String> =
                reports.iter().map(|r| format!("\"{}\";r={};t={}", r.rule.name(), r.remaining, r.reset_secs)).collect();
            h.insert(
                "ratelimit-policy",
                HeaderValue::from_str(&policy.join(", ")).unwrap_or(HeaderValue::from_static("")),
            );
            h.insert("ratelimit", HeaderValue::from_str(&state.join(", ")).unwrap_or(HeaderValue::from_static("")));
            black_box(h)
        })
    });
    g.finish();
}

/// A `user` key from an RS256 JWT: the signature check on a token's first
/// request, against the remembered identity on the requests that follow.
fn jwt_identity(c: &mut Criterion) {
    use jsonwebtoken::{Algorithm as Jwa, EncodingKey, Header};
    use tollgate::wire::identity::{Identity, JwtConfig, JwtVerifier, KeySource};

    // A key pair made for this benchmark only (benches/fixtures/).
    let private = include_bytes!("fixtures/bench-rsa-private.pem");
    let public = include_bytes!("fixtures/bench-rsa-public.pem");
    let config = JwtConfig {
        header: http::header::AUTHORIZATION,
        algorithms: vec![Jwa::RS256],
        keys: KeySource::Key { path: "bench-rsa-public.pem".into(), bytes: public.to_vec() },
        issuer: None,
        audience: None,
        claim: "sub".into(),
        leeway: 0,
    };
    let claims = serde_json::json!({"sub": "user-42", "exp": jsonwebtoken::get_current_timestamp() + 3_600});
    let key = EncodingKey::from_rsa_pem(private).expect("the fixture is an RSA private key");
    let token = jsonwebtoken::encode(&Header::new(Jwa::RS256), &claims, &key).expect("signs");
    let mut headers = HeaderMap::new();
    headers.insert(http::header::AUTHORIZATION, HeaderValue::from_str(&format!("Bearer {token}")).expect("ascii"));
    let expected = Identity::Verified("user-42".into());

    let mut group = c.benchmark_group("jwt identity (RS256)");
    group.bench_function("first request: signature checked", |b| {
        b.iter_batched(
            || JwtVerifier::new(&config).expect("valid config"),
            |verifier| {
                assert_eq!(verifier.verify(black_box(&headers)), expected);
                verifier
            },
            criterion::BatchSize::SmallInput,
        )
    });
    let verifier = JwtVerifier::new(&config).expect("valid config");
    assert_eq!(verifier.verify(&headers), expected);
    group.bench_function("later requests: remembered", |b| b.iter(|| verifier.verify(black_box(&headers))));
    group.finish();
}

criterion_group!(benches, matching, keys, algorithms, header_rendering, jwt_identity);
criterion_main!(benches);
