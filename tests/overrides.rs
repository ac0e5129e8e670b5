//! Limits per key (`[[rule.override]]`) and per tier (`tier`, `tiers`),
//! through a real tollgate: on the memory store, on a real Redis Cluster
//! shared by two instances, and with leases that must never admit past an
//! override's lower limit. Overrides and tiers reload with the rules, keep
//! every other key's counter, and show in `/rules` and `tollgate explain`.

use crate::support;

use std::sync::OnceLock;

use jsonwebtoken::{Algorithm, EncodingKey, Header, encode};
use serde_json::json;

use support::redis::{RedisCluster, tollgate_config};
use support::{Tollgate, Upstream, config, statuses, write_atomic};

/// Per user, 2 a minute; alice 4, and a client without a user at
/// 192.0.2.9 (keyed by its address) 1.
const BY_USER: &str = "[[rule]]\nname = \"per-user\"\nkey = [\"user\"]\nalgorithm = \"fixed_window\"\nlimit = 2\nwindow = \"1h\"\n\
[[rule.override]]\nkey = \"user=alice\"\nlimit = 4\n\
[[rule.override]]\nkey = \"ip=192.0.2.9\"\nlimit = 1\n";

/// Per plan: free 2, pro 4, anything else 1.
const BY_PLAN: &str = "[[rule]]\nname = \"per-plan\"\nkey = [\"user\"]\nalgorithm = \"fixed_window\"\nlimit = 3\nwindow = \"1h\"\n\
tier = \"header:x-plan\"\ntiers = { free = 2, pro = 4, default = 1 }\n";

#[tokio::test]
async fn an_override_key_gets_its_limit_and_other_keys_keep_the_rules() {
    let up = Upstream::start().await;
    let tg = Tollgate::start(&up, BY_USER).await;
    let tg = &tg;
    let alice = || tg.get("/").header("x-user-id", "alice");
    assert_eq!(statuses(5, alice).await, [200, 200, 200, 200, 429]);
    assert_eq!(statuses(3, || tg.get("/").header("x-user-id", "bob")).await, [200, 200, 429]);
    assert_eq!(statuses(2, || tg.get("/").from_ip("192.0.2.9")).await, [200, 429]);
    assert_eq!(statuses(3, || tg.get("/").from_ip("192.0.2.10")).await, [200, 200, 429]);

    // The headers and the 429 body tell each client its own limit.
    let r = tg.get("/").header("x-user-id", "carol").send().await;
    assert_eq!(r.header("x-ratelimit-limit"), Some("2"));
    assert_eq!(r.header("ratelimit-policy"), Some("\"per-user\";q=2;w=3600"));
    let r = alice().send().await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-ratelimit-limit"), Some("4"));
    assert_eq!(r.header("ratelimit-policy"), Some("\"per-user\";q=4;w=3600"));
    assert_eq!(r.json()["limit"], 4);
}

#[tokio::test]
async fn an_api_key_override_is_written_as_its_sha256_not_the_secret() {
    use sha2::Digest as _;
    let up = Upstream::start().await;
    let hex: String = sha2::Sha256::digest(b"sk-live-gold").iter().map(|b| format!("{b:02x}")).collect();
    let rules = format!(
        "[[rule]]\nname = \"per-key\"\nkey = [\"api_key\"]\nalgorithm = \"fixed_window\"\nlimit = 1\nwindow = \"1h\"\n\
         [[rule.override]]\nkey = \"api_key=sha256:{hex}\"\nlimit = 3\n"
    );
    let tg = Tollgate::start(&up, &rules).await;
    assert_eq!(statuses(4, || tg.get("/").header("x-api-key", "sk-live-gold")).await, [200, 200, 200, 429]);
    assert_eq!(statuses(2, || tg.get("/").header("x-api-key", "sk-live-other")).await, [200, 429]);
    assert!(!tg.rules().await.to_string().contains("sk-live-gold"));
}

#[tokio::test]
async fn tiers_by_header_with_default_for_unknown_or_missing() {
    let up = Upstream::start().await;
    let tg = Tollgate::start(&up, BY_PLAN).await;
    let tg = &tg;
    let plan =
        |user: &'static str, plan: &'static str| move || tg.get("/").header("x-user-id", user).header("x-plan", plan);
    assert_eq!(statuses(5, plan("a", "pro")).await, [200, 200, 200, 200, 429]);
    assert_eq!(statuses(3, plan("b", "free")).await, [200, 200, 429]);
    assert_eq!(statuses(2, plan("c", "platinum")).await, [200, 429], "unknown: default");
    assert_eq!(statuses(2, || tg.get("/").header("x-user-id", "d")).await, [200, 429], "missing: default");
    let r = tg.get("/").header("x-user-id", "e").header("x-plan", "pro").send().await;
    assert_eq!(r.header("x-ratelimit-limit"), Some("4"));
    assert_eq!(r.header("ratelimit-policy"), Some("\"per-plan\";q=4;w=3600"));
    // A client cannot offer two plans and hope the upstream reads the other.
    let r = tg.get("/").header("x-user-id", "f").header("x-plan", "free").header("x-plan", "pro").send().await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("x-plan"), "{}", r.text());
}

#[tokio::test]
async fn a_tier_change_keeps_the_keys_counter() {
    let up = Upstream::start().await;
    let tg = Tollgate::start(&up, BY_PLAN).await;
    let tg = &tg;
    let as_plan = |plan: &'static str| move || tg.get("/").header("x-user-id", "u").header("x-plan", plan);
    assert_eq!(statuses(2, as_plan("free")).await, [200, 200]);
    // Upgraded: the two already counted stay counted against the new 4.
    assert_eq!(statuses(3, as_plan("pro")).await, [200, 200, 429]);
    // Downgraded: 4 counted, over free's 2.
    assert_eq!(statuses(1, as_plan("free")).await, [429]);
}

const SECRET: &[u8] = b"integration-test-secret-at-least-32-bytes";

fn token(sub: &str, plan: Option<&str>) -> String {
    let exp = jsonwebtoken::get_current_timestamp() + 300;
    let mut claims = json!({"sub": sub, "exp": exp});
    if let Some(p) = plan {
        claims["plan"] = json!(p);
    }
    let t = encode(&Header::new(Algorithm::HS256), &claims, &EncodingKey::from_secret(SECRET)).expect("token encodes");
    format!("Bearer {t}")
}

#[tokio::test]
async fn tiers_by_verified_jwt_claim() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("jwt.secret"), SECRET).expect("write secret");
    std::fs::create_dir(dir.path().join("rules")).expect("rules dir");
    let rules = BY_PLAN.replace("header:x-plan", "claim:plan");
    std::fs::write(dir.path().join("rules/r.toml"), rules).expect("write rules");
    let cfg = config(up.addr).replace(
        "[client]\n",
        "[client]\njwt = { key_file = \"jwt.secret\", algorithms = [\"HS256\"], leeway = \"0s\" }\n",
    );
    let tg = Tollgate::start_in(dir, &cfg).await;
    let tg = &tg;
    let with = |t: String| move || tg.get("/").header("authorization", &t).header("x-plan", "pro");
    assert_eq!(statuses(5, with(token("a", Some("pro")))).await, [200, 200, 200, 200, 429]);
    assert_eq!(statuses(3, with(token("b", Some("free")))).await, [200, 200, 429]);
    // The header is not the claim: without one, the default.
    assert_eq!(statuses(2, with(token("c", None))).await, [200, 429]);
    assert_eq!(statuses(2, with(token("d", Some("gold")))).await, [200, 429]);
    // A remembered token answers with its claim too.
    assert_eq!(statuses(1, with(token("a", Some("pro")))).await, [429]);
}

#[tokio::test]
async fn overrides_reload_with_the_rules_and_keep_every_counter() {
    let up = Upstream::start().await;
    let tg = Tollgate::start(&up, BY_USER).await;
    let tg = &tg;
    let user = |u: &'static str| move || tg.get("/").header("x-user-id", u);
    assert_eq!(statuses(2, user("alice")).await, [200, 200]);
    assert_eq!(statuses(1, user("bob")).await, [200]);
    // alice up to 3, bob given 5.
    let file = tg.rules_dir().join("rules.toml");
    write_atomic(
        &file,
        &BY_USER.replace("limit = 4", "limit = 3").replace(
            "[[rule.override]]\nkey = \"ip=192.0.2.9\"",
            "[[rule.override]]\nkey = \"user=bob\"\nlimit = 5\n[[rule.override]]\nkey = \"ip=192.0.2.9\"",
        ),
    );
    tg.reloader.reload().expect("reload");
    assert_eq!(statuses(2, user("alice")).await, [200, 429], "2 of 3 were counted before");
    assert_eq!(statuses(5, user("bob")).await, [200, 200, 200, 200, 429], "1 of 5 was counted before");
    assert_eq!(statuses(3, user("carol")).await, [200, 200, 429]);
    let rules = tg.rules().await;
    let overrides = &rules["rules"][0]["overrides"];
    assert_eq!(overrides[0], json!({"key": "user=alice", "limit": 3, "burst": 3, "line": 7}));
    assert_eq!(overrides[1]["key"], "user=bob");
    assert_eq!(overrides[2]["key"], "ip=192.0.2.9");
}

#[tokio::test]
async fn rules_endpoint_shows_tiers() {
    let up = Upstream::start().await;
    let tg = Tollgate::start(&up, BY_PLAN).await;
    let tg = &tg;
    let rules = tg.rules().await;
    let rule = &rules["rules"][0];
    assert_eq!(rule["tier"], "header:x-plan");
    assert_eq!(
        rule["tiers"],
        json!({"free": {"limit": 2, "burst": 2}, "pro": {"limit": 4, "burst": 4}, "default": {"limit": 1, "burst": 1}})
    );
    assert!(rule.get("overrides").is_none());
}

#[test]
fn explain_shows_the_override_and_tier_a_request_gets() {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::create_dir(dir.path().join("rules")).expect("rules dir");
    std::fs::write(
        dir.path().join("rules/a.toml"),
        format!("{BY_USER}{}", BY_PLAN.replace("key = [\"user\"]", "key = [\"ip\"]")),
    )
    .expect("write rules");
    std::fs::write(dir.path().join("tollgate.toml"), config("127.0.0.1:9".parse().expect("addr")))
        .expect("write config");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["explain", "--path", "/", "--header", "x-user-id: alice", "--header", "x-plan: pro", "--config"])
        .arg(dir.path().join("tollgate.toml"))
        .env_remove("RUST_LOG")
        .output()
        .expect("run tollgate");
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{report}{}", String::from_utf8_lossy(&out.stderr));
    for line in [
        "    override user=alice (line 7): limit 4, burst 4",
        "    override ip=192.0.2.9 (line 10): limit 1, burst 1",
        "    key [user] -> bucket per-user|user=alice",
        "    limits of this request: override user=alice: 4 per 3600s, burst 4",
        "    remaining after this request: 3 of 4 (memory store: each process counts on its own; a new process starts full)",
        "    tier from header:x-plan: free = 2/2, pro = 4/4, default = 1/1 (limit/burst)",
        "    limits of this request: tier \"pro\": 4 per 3600s, burst 4",
    ] {
        assert!(report.lines().any(|l| l == line), "missing {line:?} in:\n{report}");
    }
}

// ---------------------------------------------------------------------------
// Redis Cluster
// ---------------------------------------------------------------------------

fn cluster() -> &'static RedisCluster {
    static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
    CLUSTER.get_or_init(RedisCluster::start)
}

/// Two instances on the shared cluster, keys under `prefix`.
async fn pair(up: &Upstream, prefix: &str, rules: &str) -> (Tollgate, Tollgate) {
    let store = format!("key_prefix = \"{prefix}\"\non_error = \"deny\"\nlease_idle = \"1h\"");
    let config = tollgate_config(up.addr, &cluster().url(), &store);
    let a = Tollgate::with(&config, &[("rules.toml", rules)]).await;
    let b = Tollgate::with(&config, &[("rules.toml", rules)]).await;
    (a, b)
}

async fn lease_hits(tg: &Tollgate) -> f64 {
    support::metric(&tg.metrics().await, "tollgate_lease_hits_total", &[]).unwrap_or(0.0)
}

/// `n` requests alternating between the instances; the statuses.
async fn alternate(a: &Tollgate, b: &Tollgate, n: usize, call: impl Fn(&Tollgate) -> support::Call) -> Vec<u16> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        out.push(call(if i % 2 == 0 { a } else { b }).send().await.status.as_u16());
    }
    out
}

#[tokio::test]
async fn overrides_and_tiers_on_a_redis_cluster() {
    let up = Upstream::start().await;
    let (a, b) = pair(&up, "t-overrides:", BY_USER).await;
    let user = |u: &'static str| move |tg: &Tollgate| tg.get("/").header("x-user-id", u);
    assert_eq!(alternate(&a, &b, 5, user("alice")).await, [200, 200, 200, 200, 429]);
    assert_eq!(alternate(&a, &b, 3, user("bob")).await, [200, 200, 429]);

    let (a, b) = pair(&up, "t-tiers:", BY_PLAN).await;
    let plan = |u: &'static str, plan: &'static str| {
        move |tg: &Tollgate| tg.get("/").header("x-user-id", u).header("x-plan", plan)
    };
    assert_eq!(alternate(&a, &b, 5, plan("a", "pro")).await, [200, 200, 200, 200, 429]);
    assert_eq!(alternate(&a, &b, 3, plan("b", "free")).await, [200, 200, 429]);
    assert_eq!(alternate(&a, &b, 2, plan("c", "gold")).await, [200, 429]);
    // Downgraded, the key keeps its count in Redis: 4 counted, over free's 2.
    assert_eq!(alternate(&a, &b, 1, plan("a", "free")).await, [429]);
}

#[tokio::test]
async fn a_lease_never_admits_past_an_overrides_lower_limit() {
    let up = Upstream::start().await;
    // 100,000 a day: 1% is a lease of 1,000 units, taken by the first
    // request of a key.
    let big =
        "[[rule]]\nname = \"big\"\nkey = [\"ip\"]\nalgorithm = \"fixed_window\"\nlimit = 100000\nwindow = \"1d\"\n";
    let with_override = |ip: &str, limit: u32| format!("{big}[[rule.override]]\nkey = \"ip={ip}\"\nlimit = {limit}\n");
    for algorithm in ["fixed_window", "sliding_window_counter", "token_bucket"] {
        let rules = with_override("192.0.2.20", 5).replace("fixed_window", algorithm);
        let (a, b) = pair(&up, &format!("t-override-lease-{algorithm}:"), &rules).await;
        // The override key is exact, however many units the rule would lease.
        let from = |ip: &'static str| move |tg: &Tollgate| tg.get("/").from_ip(ip);
        let s = alternate(&a, &b, 12, from("192.0.2.20")).await;
        assert_eq!(s.iter().filter(|&&s| s == 200).count(), 5, "{algorithm}: {s:?}");
        // Another key leases as the rule says: answered here, no 429.
        let s = alternate(&a, &b, 40, from("192.0.2.21")).await;
        assert!(s.iter().all(|&s| s == 200), "{algorithm}: {s:?}");
        let hits = lease_hits(&a).await + lease_hits(&b).await;
        assert!(hits >= 30.0, "{algorithm}: leases in use: {hits} of 40 served from them");

        // A key that holds a lease under the rule's limits, then gets an
        // override of 5: the lease is not spent under the new limits, and
        // the 1,000 units it counted in Redis stand against them.
        let s = alternate(&a, &b, 4, from("192.0.2.22")).await;
        assert_eq!(s, [200; 4], "{algorithm}");
        for tg in [&a, &b] {
            write_atomic(
                &tg.rules_dir().join("rules.toml"),
                &format!("{rules}[[rule.override]]\nkey = \"ip=192.0.2.22\"\nlimit = 5\n"),
            );
            tg.reloader.reload().expect("reload");
        }
        let s = alternate(&a, &b, 12, from("192.0.2.22")).await;
        let admitted = s.iter().filter(|&&s| s == 200).count();
        assert!(admitted + 4 <= 5, "{algorithm}: {admitted} more admitted past the override's 5: {s:?}");
    }
}

/// Issue 29: any 64-hex value was taken for an already-hashed key, so an
/// override written with an API key that happens to be 64 hex digits never
/// applied (on 2eaccb2: 200, 200, 429 under an override of 5). A hash is
/// written `sha256:HEX`; anything else is the key itself.
#[tokio::test]
async fn an_api_key_of_64_hex_digits_is_the_key_itself() {
    use sha2::Digest as _;
    let up = Upstream::start().await;
    let raw = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
    let other = "sk-live-silver";
    let hex: String = sha2::Sha256::digest(other.as_bytes()).iter().map(|b| format!("{b:02x}")).collect();
    let rules = format!(
        "[[rule]]\nname = \"per-key\"\nkey = [\"api_key\"]\nalgorithm = \"fixed_window\"\nlimit = 2\nwindow = \"1h\"\n\
         [[rule.override]]\nkey = \"api_key={raw}\"\nlimit = 5\n\
         [[rule.override]]\nkey = \"api_key=sha256:{hex}\"\nlimit = 3\n"
    );
    let tg = Tollgate::start(&up, &rules).await;
    assert_eq!(statuses(6, || tg.get("/").header("x-api-key", raw)).await, [200, 200, 200, 200, 200, 429]);
    assert_eq!(statuses(4, || tg.get("/").header("x-api-key", other)).await, [200, 200, 200, 429]);
    // What /top shows is what an override is written as.
    let top = tg.admin("/top?rule=per-key").await.text().to_string();
    assert!(top.contains(&format!("per-key|api_key=sha256:{hex}")), "{top}");
}
