//! Envoy's rate limit service (`[listen] envoy_rls`), asked by a Python gRPC
//! client that grpcio-tools generates at test time from the vendored
//! `proto/` files (tests/support/rls_client.py): not tollgate's own
//! generated code. Descriptors mapped by `[[envoy]]` are decided with the
//! proxy's rules and store, so the proxy, the decision API and Envoy spend
//! one counter; on a real Redis Cluster too.

use crate::support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::{Value, json};
use support::{Tollgate, Upstream, decisions, eventually, write_atomic};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

/// The Python modules generated from `proto/`, once per test binary.
fn generated() -> &'static Path {
    static GEN: OnceLock<PathBuf> = OnceLock::new();
    GEN.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let dir = tempfile::tempdir().expect("temp dir").keep();
        let protos = [
            "envoy/service/ratelimit/v3/rls.proto",
            "envoy/extensions/common/ratelimit/v3/ratelimit.proto",
            "envoy/config/core/v3/base.proto",
            "envoy/type/v3/ratelimit_unit.proto",
        ];
        let out = std::process::Command::new("python3")
            .args(["-m", "grpc_tools.protoc", "-I"])
            .arg(root.join("proto"))
            .arg(format!("--python_out={}", dir.display()))
            .arg(format!("--grpc_python_out={}", dir.display()))
            .args(protos)
            .current_dir(root.join("proto"))
            .output()
            .expect("python3 runs");
        assert!(
            out.status.success(),
            "grpc_tools.protoc failed (scripts/test installs grpcio-tools): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        dir
    })
}

/// One Python client process on one gRPC channel to `addr`.
struct Rls {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Rls {
    fn connect(addr: SocketAddr) -> Rls {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/rls_client.py");
        let mut child = Command::new("python3")
            .arg(script)
            .arg(generated())
            .arg(addr.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 runs");
        let stdin = child.stdin.take().expect("piped stdin");
        let lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
        Rls { child, stdin, lines }
    }

    /// `ShouldRateLimit(request)`: `Ok(response)` or `Err((code, details))`.
    async fn call(&mut self, request: Value) -> Result<Value, (String, String)> {
        self.stdin.write_all(format!("{request}\n").as_bytes()).await.expect("client stdin");
        let line = tokio::time::timeout(Duration::from_secs(20), self.lines.next_line())
            .await
            .expect("the client answers in time")
            .expect("client stdout");
        let Some(line) = line else {
            let status = self.child.wait().await;
            panic!("the Python client exited ({status:?}); grpcio is needed (scripts/test installs it)");
        };
        let v: Value = serde_json::from_str(&line).expect("client prints JSON");
        match v.get("ok") {
            Some(ok) => Ok(ok.clone()),
            None => Err((v["error"].as_str().unwrap_or("").into(), v["details"].as_str().unwrap_or("").into())),
        }
    }

    /// A call that must succeed.
    async fn ok(&mut self, request: Value) -> Value {
        match self.call(request.clone()).await {
            Ok(v) => v,
            Err(e) => panic!("{request} failed: {e:?}"),
        }
    }
}

/// A request of one descriptor of `entries` in domain `edge`.
fn one(entries: &[(&str, &str)]) -> Value {
    json!({"domain": "edge", "descriptors": [descriptor(entries)]})
}

fn descriptor(entries: &[(&str, &str)]) -> Value {
    json!({"entries": entries.iter().map(|(k, v)| json!({"key": k, "value": v})).collect::<Vec<_>>()})
}

fn code(status: &Value) -> &str {
    status["code"].as_str().unwrap_or_default()
}

fn remaining(status: &Value) -> u64 {
    status["limit_remaining"].as_u64().expect("limit_remaining")
}

/// The value of header `name` in `response_headers_to_add`.
fn header<'a>(response: &'a Value, name: &str) -> Option<&'a str> {
    response["response_headers_to_add"]
        .as_array()?
        .iter()
        .find(|h| h["key"].as_str().is_some_and(|k| k.eq_ignore_ascii_case(name)))?["value"]
        .as_str()
}

/// The default test config with the Envoy listener (and the decision API)
/// on free ports.
fn with_listeners(config: String) -> String {
    let with = config.replacen(
        "admin = \"127.0.0.1:0\"\n",
        "admin = \"127.0.0.1:0\"\nenvoy_rls = \"127.0.0.1:0\"\ndecision = \"127.0.0.1:0\"\n",
        1,
    );
    assert_ne!(with, config, "the test config has an admin listener line");
    with
}

async fn start(upstream: &Upstream, rules: &str) -> (Tollgate, Rls) {
    let t = Tollgate::with(&with_listeners(support::config(upstream.addr)), &[("rules.toml", rules)]).await;
    let rls = Rls::connect(t.envoy_rls_addr.expect("[listen] envoy_rls is configured"));
    (t, rls)
}

/// A per-user rule Envoy reaches as `(generic_key=checkout, user_id=...)`,
/// and a global rule as `(generic_key=all)`.
const RULES: &str = r#"
[[rule]]
name = "per-user"
key = ["user"]
limit = 3
window = "60s"

[[rule]]
name = "global"
key = []
limit = 100
window = "1s"

[[envoy]]
domain = "edge"
match = { generic_key = "checkout" }
key = { user = "user_id" }
rule = "per-user"

[[envoy]]
domain = "edge"
match = { generic_key = "all" }
rule = "global"
"#;

fn alice() -> Value {
    one(&[("generic_key", "checkout"), ("user_id", "alice")])
}

#[tokio::test]
async fn ok_under_the_limit_then_over_limit_with_nothing_remaining() {
    let upstream = Upstream::start().await;
    let (t, mut rls) = start(&upstream, RULES).await;
    for left in [2, 1, 0] {
        let r = rls.ok(alice()).await;
        assert_eq!(r["overall_code"], "OK", "{r}");
        let s = &r["statuses"][0];
        assert_eq!(code(s), "OK", "{r}");
        assert_eq!(remaining(s), left, "{r}");
        assert_eq!(s["current_limit"], json!({"name": "per-user", "requests_per_unit": 3, "unit": "MINUTE"}), "{r}");
        // A token bucket: each hit takes 20 s to refill, and the clock
        // stands still.
        assert_eq!(s["duration_until_reset"], format!("{}s", (3 - left) * 20), "{r}");
        assert_eq!(header(&r, "x-ratelimit-remaining"), Some(left.to_string().as_str()), "{r}");
        assert_eq!(header(&r, "retry-after"), None, "{r}");
    }
    let r = rls.ok(alice()).await;
    assert_eq!(r["overall_code"], "OVER_LIMIT", "{r}");
    assert_eq!(code(&r["statuses"][0]), "OVER_LIMIT", "{r}");
    assert_eq!(remaining(&r["statuses"][0]), 0, "{r}");
    assert_eq!(header(&r, "x-ratelimit-remaining"), Some("0"), "{r}");
    let retry: u64 = header(&r, "retry-after").expect("retry-after when over").parse().expect("seconds");
    assert!((1..=60).contains(&retry), "{r}");
    // Another user has a bucket of their own.
    let bob = rls.ok(one(&[("user_id", "bob"), ("generic_key", "checkout")])).await;
    assert_eq!((code(&bob["statuses"][0]), remaining(&bob["statuses"][0])), ("OK", 2), "{bob}");
    // Counted like proxied requests.
    let m = t.metrics().await;
    assert_eq!(decisions(&m, "per-user", "allowed"), 4.0);
    assert_eq!(decisions(&m, "per-user", "limited"), 1.0);
    // The window passes: admitted again.
    t.advance(Duration::from_secs(61));
    assert_eq!(rls.ok(alice()).await["overall_code"], "OK");
}

#[tokio::test]
async fn hits_addend_is_the_cost() {
    let upstream = Upstream::start().await;
    let (t, mut rls) = start(&upstream, RULES).await;
    // The request's hits_addend...
    let mut two = alice();
    two["hits_addend"] = json!(2);
    let r = rls.ok(two).await;
    assert_eq!((code(&r["statuses"][0]), remaining(&r["statuses"][0])), ("OK", 1), "{r}");
    // ...a descriptor's own overrides it...
    let mut own = one(&[("generic_key", "checkout"), ("user_id", "carol")]);
    own["hits_addend"] = json!(2);
    own["descriptors"][0]["hits_addend"] = json!(3);
    let r = rls.ok(own).await;
    assert_eq!((code(&r["statuses"][0]), remaining(&r["statuses"][0])), ("OK", 0), "{r}");
    // ...0 is one hit...
    let mut zero = alice();
    zero["hits_addend"] = json!(0);
    let r = rls.ok(zero).await;
    assert_eq!((code(&r["statuses"][0]), remaining(&r["statuses"][0])), ("OK", 0), "{r}");
    // ...and more than the rule ever admits is over the limit, not an
    // error Envoy would let through, and spends nothing.
    let mut huge = one(&[("generic_key", "checkout"), ("user_id", "dave")]);
    huge["hits_addend"] = json!(4);
    let r = rls.ok(huge).await;
    assert_eq!(r["overall_code"], "OVER_LIMIT", "{r}");
    let r = rls.ok(one(&[("generic_key", "checkout"), ("user_id", "dave")])).await;
    assert_eq!((code(&r["statuses"][0]), remaining(&r["statuses"][0])), ("OK", 2), "{r}");
    let m = t.metrics().await;
    assert_eq!(decisions(&m, "per-user", "allowed"), 4.0);
}

/// An exempt client is never limited by the rule, whatever it asks: as the
/// proxy, where the rule does not apply to it at all.
#[tokio::test]
async fn an_exempt_client_is_ok_even_past_what_the_rule_admits_at_once() {
    let upstream = Upstream::start().await;
    let rules = RULES.replace("limit = 3\n", "limit = 3\nexempt = { users = [\"monitor\"] }\n");
    let (t, mut rls) = start(&upstream, &rules).await;
    for hits in [1, 3, 4, 1_000] {
        let mut ask = one(&[("generic_key", "checkout"), ("user_id", "monitor")]);
        ask["hits_addend"] = json!(hits);
        let r = rls.ok(ask).await;
        assert_eq!(r["overall_code"], "OK", "{hits} hits: {r}");
    }
    // Nothing was counted for it.
    let m = t.metrics().await;
    assert_eq!(decisions(&m, "per-user", "limited"), 0.0);
    // Others are still limited.
    let mut huge = one(&[("generic_key", "checkout"), ("user_id", "erin")]);
    huge["hits_addend"] = json!(4);
    assert_eq!(rls.ok(huge).await["overall_code"], "OVER_LIMIT");
}

#[tokio::test]
async fn descriptors_no_entry_maps_are_ok_without_a_limit() {
    let upstream = Upstream::start().await;
    let (t, mut rls) = start(&upstream, RULES).await;
    let unmapped = [
        // Another domain.
        json!({"domain": "internal", "descriptors": [descriptor(&[("generic_key", "checkout"), ("user_id", "a")])]}),
        // Another value of a match entry.
        one(&[("generic_key", "cart"), ("user_id", "a")]),
        // An entry short, an entry too many.
        one(&[("generic_key", "checkout")]),
        one(&[("generic_key", "checkout"), ("user_id", "a"), ("remote_address", "10.0.0.1")]),
        one(&[("header_match", "x")]),
    ];
    for request in unmapped {
        for _ in 0..5 {
            let r = rls.ok(request.clone()).await;
            assert_eq!(r["overall_code"], "OK", "{request} -> {r}");
            let s = &r["statuses"][0];
            assert_eq!((code(s), remaining(s)), ("OK", 0), "{request} -> {r}");
            assert!(s["current_limit"].is_null(), "{request} -> {r}");
            assert_eq!(r["response_headers_to_add"], json!([]), "{r}");
        }
    }
    let m = t.metrics().await;
    assert_eq!(decisions(&m, "per-user", "allowed") + decisions(&m, "global", "allowed"), 0.0);
}

#[tokio::test]
async fn one_descriptor_over_makes_the_whole_answer_over_limit() {
    let upstream = Upstream::start().await;
    let (_t, mut rls) = start(&upstream, RULES).await;
    let mut spend = alice();
    spend["hits_addend"] = json!(3);
    assert_eq!(rls.ok(spend).await["overall_code"], "OK");
    let request = json!({"domain": "edge", "descriptors": [
        descriptor(&[("generic_key", "all")]),
        descriptor(&[("generic_key", "checkout"), ("user_id", "alice")]),
        descriptor(&[("generic_key", "unmapped")]),
        descriptor(&[("generic_key", "checkout"), ("user_id", "erin")]),
    ]});
    let r = rls.ok(request).await;
    assert_eq!(r["overall_code"], "OVER_LIMIT", "{r}");
    let statuses = r["statuses"].as_array().expect("statuses");
    let codes: Vec<&str> = statuses.iter().map(code).collect();
    assert_eq!(codes, ["OK", "OVER_LIMIT", "OK", "OK"], "{r}");
    assert_eq!(statuses.iter().map(remaining).collect::<Vec<_>>(), [99, 0, 0, 2], "{r}");
    assert_eq!(statuses[0]["current_limit"]["unit"], "SECOND", "{r}");
    // One set of headers for all of them, as the proxy sends for several
    // rules: the most restrictive in the X-RateLimit trio, all in RateLimit.
    assert_eq!(header(&r, "x-ratelimit-remaining"), Some("0"), "{r}");
    let state = header(&r, "ratelimit").expect("RateLimit");
    assert!(state.contains("\"global\";r=99") && state.contains("\"per-user\";r=0"), "{r}");
    // Each descriptor spent its own counter whatever the others answered.
    let r = rls.ok(one(&[("generic_key", "checkout"), ("user_id", "erin")])).await;
    assert_eq!(remaining(&r["statuses"][0]), 1, "{r}");
}

/// The proxy (`x-user-id`), the decision API (`{"user": ...}`) and Envoy
/// (`user_id`) name the same user of the same rule: one bucket.
#[tokio::test]
async fn the_proxy_the_decision_api_and_envoy_spend_one_counter() {
    let upstream = Upstream::start().await;
    let (t, mut rls) = start(&upstream, RULES).await;
    let api = t.decision_addr.expect("[listen] decision");
    assert_eq!(t.get("/").header("x-user-id", "frank").send().await.status, 200);
    let check = support::Call::new("POST", api, "/v1/check")
        .header("content-type", "application/json")
        .body(json!({"rule": "per-user", "key": {"user": "frank"}}).to_string())
        .send()
        .await;
    assert_eq!(check.json()["remaining"], 1, "{}", check.text());
    let frank = one(&[("generic_key", "checkout"), ("user_id", "frank")]);
    let r = rls.ok(frank.clone()).await;
    assert_eq!((code(&r["statuses"][0]), remaining(&r["statuses"][0])), ("OK", 0), "{r}");
    assert_eq!(t.get("/").header("x-user-id", "frank").send().await.status, 429);
    assert_eq!(rls.ok(frank).await["overall_code"], "OVER_LIMIT");
}

#[tokio::test]
async fn a_reloaded_rules_file_changes_limits_and_mappings() {
    let upstream = Upstream::start().await;
    let (t, mut rls) = start(&upstream, RULES).await;
    let tenant = one(&[("tenant", "acme")]);
    let r = rls.ok(tenant.clone()).await;
    assert!(r["statuses"][0]["current_limit"].is_null(), "not mapped yet: {r}");
    let rules = RULES.replace("limit = 3", "limit = 1")
        + "\n[[rule]]\nname = \"per-tenant\"\nkey = [\"header:x-tenant\"]\nlimit = 2\nwindow = \"1h\"\n\n\
           [[envoy]]\ndomain = \"edge\"\nkey = { \"header:x-tenant\" = \"tenant\" }\nrule = \"per-tenant\"\n";
    write_atomic(&t.rules_dir().join("rules.toml"), &rules);
    eventually("the new rules are in force", || async {
        t.rules().await["rules"].as_array().is_some_and(|r| r.len() == 3)
    })
    .await;
    let r = rls.ok(alice()).await;
    let s = &r["statuses"][0];
    assert_eq!((code(s), remaining(s), &s["current_limit"]["requests_per_unit"]), ("OK", 0, &json!(1)), "{r}");
    assert_eq!(rls.ok(alice()).await["overall_code"], "OVER_LIMIT");
    let r = rls.ok(tenant).await;
    let s = &r["statuses"][0];
    assert_eq!((remaining(s), &s["current_limit"]["unit"]), (1, &json!("HOUR")), "{r}");
    // A broken rules file keeps the running mappings.
    write_atomic(&t.rules_dir().join("rules.toml"), &format!("{rules}\n[[envoy]]\ndomain = \"edge\"\n"));
    eventually("the reload failed", || async {
        support::metric(&t.metrics().await, "tollgate_rules_reloads_total", &[("result", "failure")]) == Some(1.0)
    })
    .await;
    assert_eq!(rls.ok(one(&[("tenant", "acme")])).await["statuses"][0]["limit_remaining"], 0);
}

#[tokio::test]
async fn bad_requests_are_refused_and_bounded() {
    let upstream = Upstream::start().await;
    let (t, mut rls) = start(&upstream, RULES).await;
    let invalid = [
        json!({"domain": "", "descriptors": [descriptor(&[("generic_key", "all")])]}),
        json!({"domain": "edge", "descriptors": []}),
        json!({"domain": "edge", "descriptors": vec![descriptor(&[("generic_key", "all")]); 65]}),
        one(&(0..33).map(|_| ("k", "v")).collect::<Vec<_>>()),
    ];
    for request in invalid {
        let e = rls.call(request.clone()).await.expect_err("refused");
        assert_eq!(e.0, "INVALID_ARGUMENT", "{request}: {e:?}");
    }
    // A message over 64 KiB is not decoded.
    let big = "x".repeat(70 * 1024);
    let e = rls.call(one(&[("generic_key", "checkout"), ("user_id", &big)])).await.expect_err("too large");
    assert_eq!(e.0, "OUT_OF_RANGE", "{e:?}");
    // A value the rule cannot key on is refused, as the proxy would.
    let r = rls.ok(one(&[("generic_key", "checkout"), ("user_id", "")])).await;
    assert_eq!(r["overall_code"], "OVER_LIMIT", "{r}");
    // Nothing counted, and the service still answers.
    let m = t.metrics().await;
    assert_eq!(decisions(&m, "per-user", "allowed") + decisions(&m, "global", "allowed"), 0.0);
    assert_eq!(rls.ok(alice()).await["overall_code"], "OK");
    // 64 descriptors, the most, are served.
    let many = json!({"domain": "edge", "descriptors": vec![descriptor(&[("generic_key", "all")]); 64]});
    let r = rls.ok(many).await;
    assert_eq!(r["statuses"].as_array().map(Vec::len), Some(64), "{r}");
    assert_eq!(remaining(&r["statuses"][63]), 36, "{r}");
}

#[tokio::test]
async fn without_the_key_there_is_no_envoy_listener() {
    let upstream = Upstream::start().await;
    let t = Tollgate::start(&upstream, RULES).await;
    assert!(t.envoy_rls_addr.is_none());
}

#[tokio::test]
async fn on_a_redis_cluster_envoy_and_the_proxy_share_the_counter() {
    support::redis::require();
    let cluster = support::redis::RedisCluster::start();
    let upstream = Upstream::start().await;
    let config = support::redis::tollgate_config(upstream.addr, &cluster.url(), "on_error = \"deny\"");
    // Two instances: Envoy asks one, clients go through the other.
    let a = Tollgate::with(&with_listeners(config.clone()), &[("rules.toml", RULES)]).await;
    let b = Tollgate::with(&config, &[("rules.toml", RULES)]).await;
    let mut rls = Rls::connect(a.envoy_rls_addr.expect("[listen] envoy_rls"));
    for user in ["u1", "u2", "u3", "u4", "u5", "u6"] {
        let d = one(&[("generic_key", "checkout"), ("user_id", user)]);
        assert_eq!(b.get("/").header("x-user-id", user).send().await.status, 200);
        let r = rls.ok(d.clone()).await;
        let s = &r["statuses"][0];
        assert_eq!((code(s), remaining(s)), ("OK", 1), "{user}: {r}");
        assert!(s["duration_until_reset"].as_str().is_some_and(|d| d.ends_with('s')), "{r}");
        assert_eq!(b.get("/").header("x-user-id", user).send().await.status, 200);
        let r = rls.ok(d.clone()).await;
        assert_eq!((code(&r["statuses"][0]), remaining(&r["statuses"][0])), ("OVER_LIMIT", 0), "{user}: {r}");
        assert_eq!(b.get("/").header("x-user-id", user).send().await.status, 429, "{user}");
    }
    // Several descriptors, keys on different slots, in one request.
    let r = rls
        .ok(json!({"domain": "edge", "descriptors": [
            descriptor(&[("generic_key", "checkout"), ("user_id", "u1")]),
            descriptor(&[("generic_key", "checkout"), ("user_id", "v1")]),
            descriptor(&[("generic_key", "all")]),
        ]}))
        .await;
    assert_eq!(r["overall_code"], "OVER_LIMIT", "{r}");
    assert_eq!(
        r["statuses"].as_array().expect("statuses").iter().map(code).collect::<Vec<_>>(),
        ["OVER_LIMIT", "OK", "OK"]
    );
}

/// A key's `[[rule.override]]` applies to its descriptors as to its
/// proxied requests, and `current_limit` says so.
#[tokio::test]
async fn a_keys_override_is_its_limit_here_too() {
    let upstream = Upstream::start().await;
    let rules = RULES.replace(
        "limit = 3\nwindow = \"60s\"\n",
        "limit = 3\nwindow = \"60s\"\n\n[[rule.override]]\nkey = \"user=vip\"\nlimit = 10\n",
    );
    let (t, mut rls) = start(&upstream, &rules).await;
    let r = rls.ok(one(&[("generic_key", "checkout"), ("user_id", "vip")])).await;
    let s = &r["statuses"][0];
    assert_eq!((remaining(s), &s["current_limit"]["requests_per_unit"]), (9, &json!(10)), "{r}");
    assert_eq!(t.get("/").header("x-user-id", "vip").send().await.header("x-ratelimit-remaining"), Some("8"));
    let r = rls.ok(alice()).await;
    assert_eq!(r["statuses"][0]["current_limit"]["requests_per_unit"], 3, "{r}");
}

/// A rule with tiers Envoy names in a descriptor entry (`tier = "plan"`),
/// and a VIP whose override outranks any tier.
const TIERED: &str = r#"
[[rule]]
name = "by-plan"
key = ["user"]
algorithm = "fixed_window"
limit = 3
window = "1h"
tier = "header:x-plan"
tiers = { free = 2, pro = 5, default = 1 }

[[rule.override]]
key = "user=vip"
limit = 9

[[envoy]]
domain = "edge"
match = { generic_key = "api" }
key = { user = "user_id" }
tier = "plan"
rule = "by-plan"
"#;

#[tokio::test]
async fn a_descriptor_entry_states_the_tier() {
    let upstream = Upstream::start().await;
    let (t, mut rls) = start(&upstream, TIERED).await;
    let limit = |r: &Value| r["statuses"][0]["current_limit"]["requests_per_unit"].as_u64().expect("current_limit");
    let r = rls.ok(one(&[("generic_key", "api"), ("user_id", "alice"), ("plan", "pro")])).await;
    assert_eq!((limit(&r), remaining(&r["statuses"][0])), (5, 4), "{r}");
    assert_eq!(header(&r, "x-ratelimit-limit"), Some("5"), "{r}");
    let r = rls.ok(one(&[("plan", "free"), ("generic_key", "api"), ("user_id", "bob")])).await;
    assert_eq!(limit(&r), 2, "{r}");
    // An unknown tier, or no tier entry: `default`.
    let r = rls.ok(one(&[("generic_key", "api"), ("user_id", "carol"), ("plan", "gold")])).await;
    assert_eq!(limit(&r), 1, "{r}");
    let r = rls.ok(one(&[("generic_key", "api"), ("user_id", "dave")])).await;
    assert_eq!(limit(&r), 1, "{r}");
    // The key's override outranks the tier.
    let r = rls.ok(one(&[("generic_key", "api"), ("user_id", "vip"), ("plan", "pro")])).await;
    assert_eq!(limit(&r), 9, "{r}");
    // The proxy counts alice's pro tier on the same counter.
    let resp = t.get("/").header("x-user-id", "alice").header("x-plan", "pro").send().await;
    assert_eq!(resp.header("x-ratelimit-remaining"), Some("3"));
    // An entry the mapping does not know: not covered.
    let r = rls.ok(one(&[("generic_key", "api"), ("user_id", "erin"), ("tier", "pro")])).await;
    assert_eq!(r["statuses"][0]["current_limit"], Value::Null, "{r}");
}

/// A descriptor with Envoy's `limit` override (`requests_per_unit` per
/// `unit`).
fn with_limit(entries: &[(&str, &str)], requests_per_unit: u32, unit: &str) -> Value {
    let mut d = descriptor(entries);
    d["limit"] = json!({"requests_per_unit": requests_per_unit, "unit": unit});
    d
}

/// Envoy's per-descriptor `limit` replaces the rule's limit, on a counter
/// of its own per override (limit and unit): the rule's own counter for
/// the same key, and another override's, are not spent.
#[tokio::test]
async fn a_descriptors_limit_override_replaces_the_rules_limit() {
    let upstream = Upstream::start().await;
    let (_t, mut rls) = start(&upstream, RULES).await;
    let entries = [("generic_key", "checkout"), ("user_id", "alice")];
    let five = json!({"domain": "edge", "descriptors": [with_limit(&entries, 5, "MINUTE")]});
    for left in [4, 3, 2, 1, 0] {
        let r = rls.ok(five.clone()).await;
        let s = &r["statuses"][0];
        assert_eq!((code(s), remaining(s)), ("OK", left), "{r}");
        assert_eq!(s["current_limit"], json!({"name": "per-user", "requests_per_unit": 5, "unit": "MINUTE"}), "{r}");
        assert_eq!(header(&r, "x-ratelimit-limit"), Some("5"), "{r}");
        assert_eq!(header(&r, "ratelimit-policy"), Some("\"per-user\";q=5;w=60"), "{r}");
    }
    let r = rls.ok(five.clone()).await;
    assert_eq!((r["overall_code"].as_str(), code(&r["statuses"][0])), (Some("OVER_LIMIT"), "OVER_LIMIT"), "{r}");
    // The rule's own limit for alice (3 a minute) is untouched...
    let r = rls.ok(alice()).await;
    assert_eq!((code(&r["statuses"][0]), remaining(&r["statuses"][0])), ("OK", 2), "{r}");
    // ...and so is another override's counter: each counts on its own, so
    // no override's state is read with another's arithmetic.
    let one_a_second = json!({"domain": "edge", "descriptors": [with_limit(&entries, 1, "SECOND")]});
    let r = rls.ok(one_a_second.clone()).await;
    let s = &r["statuses"][0];
    assert_eq!((code(s), remaining(s)), ("OK", 0), "{r}");
    assert_eq!(s["current_limit"], json!({"name": "per-user", "requests_per_unit": 1, "unit": "SECOND"}), "{r}");
    assert_eq!(code(&rls.ok(one_a_second).await["statuses"][0]), "OVER_LIMIT");
    // The same override again finds its own counter still spent.
    assert_eq!(code(&rls.ok(five).await["statuses"][0]), "OVER_LIMIT");
}

/// An override of 0 requests is over the limit without spending (Envoy's
/// service refuses every hit of it); an override of unit UNKNOWN fails the
/// whole call before anything is spent (Envoy's service cannot convert the
/// unit and fails the call).
#[tokio::test]
async fn an_override_of_zero_is_over_and_an_unknown_unit_fails_the_call() {
    let upstream = Upstream::start().await;
    let (t, mut rls) = start(&upstream, RULES).await;
    let entries = [("generic_key", "checkout"), ("user_id", "alice")];
    let r = rls.ok(json!({"domain": "edge", "descriptors": [with_limit(&entries, 0, "HOUR")]})).await;
    let s = &r["statuses"][0];
    assert_eq!((r["overall_code"].as_str(), code(s)), (Some("OVER_LIMIT"), "OVER_LIMIT"), "{r}");
    assert_eq!(s["current_limit"], json!({"name": "per-user", "requests_per_unit": 0, "unit": "HOUR"}), "{r}");
    let unknown = json!({"domain": "edge", "descriptors": [
        descriptor(&[("generic_key", "all")]),
        with_limit(&entries, 10, "UNKNOWN"),
    ]});
    let (status, details) = rls.call(unknown).await.expect_err("an UNKNOWN unit fails the call");
    assert_eq!(status, "INVALID_ARGUMENT", "{details}");
    assert!(details.contains("descriptor 1"), "{details}");
    // Nothing was spent: not alice's own counter, nor the global one.
    let r = rls.ok(alice()).await;
    assert_eq!(remaining(&r["statuses"][0]), 2, "{r}");
    let m = t.metrics().await;
    assert_eq!(decisions(&m, "global", "allowed"), 0.0);
}

/// Keys in the memory store behind `t`.
fn stored_keys(t: &Tollgate) -> usize {
    match t.proxy.store() {
        tollgate::store::AnyStore::Memory(m) => m.len(),
        _ => panic!("the test's tollgate runs on the memory store"),
    }
}

/// A counter under an override longer than every rule's window is not
/// forgotten when the rules' keys would be: the memory store's sweep
/// (every 5 s) keeps it until it is fresh again. The control: before the
/// override raised the horizon, the sweep did forget a rule's key idle past
/// it, so a sweep that never ran would fail the test.
#[tokio::test]
async fn an_overrides_counter_outlives_the_rules_idle_horizon() {
    let upstream = Upstream::start().await;
    let (t, mut rls) = start(&upstream, RULES).await;
    assert_eq!(code(&rls.ok(alice()).await["statuses"][0]), "OK");
    assert_eq!(stored_keys(&t), 1, "alice's per-user counter");
    // Past every rule's idle horizon (per-user: 2 x 60 s): the server's own
    // sweep forgets alice's key.
    t.advance(Duration::from_secs(300));
    eventually("the server's sweep forgets the idle key", || async { stored_keys(&t) == 0 }).await;

    let hourly = json!({"domain": "edge", "descriptors": [with_limit(&[("generic_key", "all")], 2, "HOUR")]});
    for want in ["OK", "OK", "OVER_LIMIT"] {
        assert_eq!(code(&rls.ok(hourly.clone()).await["statuses"][0]), want);
    }
    assert_eq!(stored_keys(&t), 1, "the override's counter");
    // Past every rule's idle horizon again, far from the hour; then the
    // sweep runs (the server's, every 5 s, and this one, so that it surely
    // ran after the advance).
    t.advance(Duration::from_secs(300));
    t.proxy.store().sweep();
    assert_eq!(stored_keys(&t), 1, "the sweep kept the override's counter");
    let r = rls.ok(hourly).await;
    assert_eq!(code(&r["statuses"][0]), "OVER_LIMIT", "{r}");
}

/// On a calendar rule an override of the rule's period applies its number
/// to the calendar window; another unit fails the call.
#[tokio::test]
async fn a_calendar_rules_override_is_per_its_period() {
    let upstream = Upstream::start().await;
    let rules = "[[rule]]\nname = \"monthly\"\nkey = [\"user\"]\nlimit = 1000\ncalendar = \"month\"\n\n\
                 [[envoy]]\ndomain = \"edge\"\nmatch = { generic_key = \"m\" }\nkey = { user = \"user_id\" }\nrule = \"monthly\"\n";
    let (_t, mut rls) = start(&upstream, rules).await;
    let entries = [("generic_key", "m"), ("user_id", "alice")];
    let r = rls.ok(json!({"domain": "edge", "descriptors": [with_limit(&entries, 50, "MONTH")]})).await;
    let s = &r["statuses"][0];
    assert_eq!((code(s), remaining(s)), ("OK", 49), "{r}");
    assert_eq!(s["current_limit"], json!({"name": "monthly", "requests_per_unit": 50, "unit": "MONTH"}), "{r}");
    let (status, details) = rls
        .call(json!({"domain": "edge", "descriptors": [with_limit(&entries, 5, "HOUR")]}))
        .await
        .expect_err("an hourly override of a monthly rule fails the call");
    assert_eq!(status, "INVALID_ARGUMENT", "{details}");
    assert!(details.contains("per MONTH"), "{details}");
}
