//! Who may pass at all, and who a `user` is: `[[deny]]` answers 403 before
//! any counting, a rule's `exempt` list skips it, and with `[client] jwt`
//! the user is the verified token's subject, never a header the client
//! chose.

use crate::support;

use jsonwebtoken::{Algorithm, EncodingKey, Header, encode};
use serde_json::json;
use support::{Tollgate, Upstream, config, statuses};

const RULES: &str = r#"
[[deny]]
name = "abusers"
ips = ["192.0.2.0/24", "2001:db8:bad::/48"]
users = ["mallory"]
api_keys = ["leaked-key"]

[[rule]]
name = "per-ip"
key = ["ip"]
algorithm = "fixed_window"
limit = 2
window = "1m"
exempt = { ips = ["10.0.0.0/8"], users = ["monitor"] }
"#;

#[tokio::test]
async fn deny_lists_answer_403_before_counting() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, RULES).await;
    for call in [
        tg.get("/").from_ip("192.0.2.77"),
        tg.get("/").from_ip("2001:db8:bad:1::5"),
        tg.get("/").from_ip("198.51.100.1").header("x-user-id", "mallory"),
        tg.get("/").from_ip("198.51.100.1").header("x-api-key", "leaked-key"),
    ] {
        let r = call.send().await;
        assert_eq!(r.status, 403, "{}", r.text());
        assert_eq!(r.json()["error"], "forbidden");
        assert!(r.ratelimit_headers().is_empty(), "no rule was counted");
    }
    assert_eq!(upstream.hits(), 0);
    // 198.51.100.1 was denied twice above, yet its quota is untouched.
    assert_eq!(statuses(3, || tg.get("/").from_ip("198.51.100.1")).await, [200, 200, 429]);
    let m = tg.metrics().await;
    assert_eq!(support::metric(&m, "tollgate_requests_total", &[("route", "svc"), ("decision", "denied")]), Some(4.0));
}

#[tokio::test]
async fn exempt_clients_skip_the_rule() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, RULES).await;
    assert_eq!(statuses(4, || tg.get("/").from_ip("10.1.2.3")).await, [200; 4]);
    let r = tg.get("/").from_ip("10.1.2.3").send().await;
    assert!(r.ratelimit_headers().is_empty(), "an exempt client matches no rule");
    assert_eq!(statuses(4, || tg.get("/").from_ip("203.0.113.9").header("x-user-id", "monitor")).await, [200; 4]);
    assert_eq!(statuses(3, || tg.get("/").from_ip("203.0.113.9")).await, [200, 200, 429]);
}

const SECRET: &[u8] = b"integration-test-secret-at-least-32-bytes";

fn token(sub: &str, exp_offset: i64, secret: &[u8]) -> String {
    let exp = jsonwebtoken::get_current_timestamp() as i64 + exp_offset;
    let claims = json!({"sub": sub, "exp": exp, "iss": "https://issuer.test", "aud": "tollgate"});
    encode(&Header::new(Algorithm::HS256), &claims, &EncodingKey::from_secret(secret)).expect("token encodes")
}

async fn jwt_tollgate(upstream: &Upstream, on_invalid: &str) -> Tollgate {
    let rules = format!(
        "[[rule]]\nname = \"per-user\"\nkey = [\"user\"]\nalgorithm = \"fixed_window\"\nlimit = 2\nwindow = \"1m\"\non_invalid_token = \"{on_invalid}\"\n"
    );
    jwt_tollgate_with(upstream, &rules).await
}

async fn jwt_tollgate_with(upstream: &Upstream, rules: &str) -> Tollgate {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("jwt.secret"), SECRET).expect("write secret");
    std::fs::create_dir(dir.path().join("rules")).expect("rules dir");
    std::fs::write(dir.path().join("rules/r.toml"), rules).expect("write rules");
    let cfg = config(upstream.addr).replace(
        "[client]\n",
        "[client]\njwt = { key_file = \"jwt.secret\", algorithms = [\"HS256\"], issuer = \"https://issuer.test\", audience = \"tollgate\", leeway = \"0s\" }\n",
    );
    Tollgate::start_in(dir, &cfg).await
}

#[tokio::test]
async fn users_are_the_verified_token_subject() {
    let upstream = Upstream::start().await;
    let tg = jwt_tollgate(&upstream, "reject").await;
    let alice = format!("Bearer {}", token("alice", 300, SECRET));
    // Alice cannot escape her bucket by claiming another user in the header,
    // nor from another address.
    assert_eq!(statuses(1, || tg.get("/").header("authorization", &alice).header("x-user-id", "bob")).await, [200]);
    let from_elsewhere = || tg.get("/").header("authorization", &alice).from_ip("203.0.113.50");
    assert_eq!(statuses(2, from_elsewhere).await, [200, 429]);
    // The header alone proves nothing: no token, keyed by IP.
    assert_eq!(statuses(3, || tg.get("/").header("x-user-id", "alice").from_ip("203.0.113.60")).await, [200, 200, 429]);
}

#[tokio::test]
async fn invalid_tokens_get_401_or_fall_back_to_the_ip() {
    let upstream = Upstream::start().await;
    let tg = jwt_tollgate(&upstream, "reject").await;
    for (bad, reason) in [
        (token("alice", -120, SECRET), "expired"),
        (token("alice", 300, b"another-secret-that-is-long-enough-xx"), "signature"),
        ("not.a.token".to_string(), "malformed"),
    ] {
        let r = tg.get("/").header("authorization", &format!("Bearer {bad}")).send().await;
        assert_eq!(r.status, 401, "{reason}: {}", r.text());
        assert_eq!(r.json()["error"], "invalid_token");
        assert!(r.json()["message"].as_str().is_some_and(|m| m.contains(reason)), "{reason}: {}", r.text());
        assert_eq!(r.header("www-authenticate"), Some("Bearer error=\"invalid_token\""));
    }
    assert_eq!(upstream.hits(), 0);

    let lenient = jwt_tollgate(&upstream, "ip").await;
    let expired = format!("Bearer {}", token("alice", -120, SECRET));
    let call = || lenient.get("/").header("authorization", &expired).from_ip("203.0.113.70");
    assert_eq!(statuses(3, call).await, [200, 200, 429]);
    // ...and that bucket is the IP's: a tokenless request from it is out too.
    assert_eq!(statuses(1, || lenient.get("/").from_ip("203.0.113.70")).await, [429]);
}

#[tokio::test]
async fn tokens_are_verified_only_for_rules_that_need_the_user_and_failures_once() {
    let upstream = Upstream::start().await;
    let forged = format!("Bearer {}", token("alice", 300, b"another-secret-that-is-long-enough-xx"));
    // Keyed on the IP: the token is never checked.
    let by_ip = jwt_tollgate_with(&upstream, "[[rule]]\nname = \"ip\"\nlimit = 100\nwindow = \"1m\"\n").await;
    assert_eq!(statuses(3, || by_ip.get("/").header("authorization", &forged)).await, [200, 200, 200]);
    let checks = |tg: &Tollgate| tg.proxy.jwt().expect("jwt configured").signature_checks();
    assert_eq!(checks(&by_ip), 0);
    // A rule keyed on the user for /api only: other paths never check.
    let rules = "[[rule]]\nname = \"api\"\nmatch = { path = \"/api\" }\nkey = [\"user\"]\nlimit = 100\nwindow = \"1m\"\non_invalid_token = \"ip\"\n[[rule]]\nname = \"ip\"\nlimit = 100\nwindow = \"1m\"\n";
    let mixed = jwt_tollgate_with(&upstream, rules).await;
    assert_eq!(statuses(2, || mixed.get("/other").header("authorization", &forged)).await, [200, 200]);
    assert_eq!(checks(&mixed), 0);
    assert_eq!(statuses(2, || mixed.get("/api").header("authorization", &forged)).await, [200, 200]);
    assert_eq!(checks(&mixed), 1);
    // Keyed on the user: checked once, then the failure is remembered.
    let by_user = jwt_tollgate(&upstream, "reject").await;
    assert_eq!(statuses(3, || by_user.get("/").header("authorization", &forged)).await, [401, 401, 401]);
    assert_eq!(checks(&by_user), 1);
}

#[tokio::test]
async fn a_changed_jwks_file_is_picked_up() {
    use base64::Engine as _;
    let upstream = Upstream::start().await;
    let jwks = |kid: &str| {
        let k = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(SECRET);
        format!(r#"{{"keys":[{{"kty":"oct","kid":"{kid}","alg":"HS256","k":"{k}"}}]}}"#)
    };
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("jwks.json"), jwks("one")).expect("write jwks");
    std::fs::create_dir(dir.path().join("rules")).expect("rules dir");
    let rules = "[[rule]]\nname = \"per-user\"\nkey = [\"user\"]\nlimit = 100\nwindow = \"1m\"\n";
    std::fs::write(dir.path().join("rules/r.toml"), rules).expect("write rules");
    let cfg = config(upstream.addr).replace(
        "[client]\n",
        "[client]\njwt = { jwks_file = \"jwks.json\", algorithms = [\"HS256\"], leeway = \"0s\" }\n",
    );
    let tg = Tollgate::start_in(dir, &cfg).await;
    let claims = json!({"sub": "alice", "exp": jsonwebtoken::get_current_timestamp() + 300});
    let mut header = Header::new(Algorithm::HS256);
    header.kid = Some("one".into());
    let t = format!("Bearer {}", encode(&header, &claims, &EncodingKey::from_secret(SECRET)).expect("encodes"));
    assert_eq!(statuses(1, || tg.get("/").header("authorization", &t)).await, [200]);

    support::write_atomic(&tg.dir.path().join("jwks.json"), &jwks("two"));
    tg.reloader.reload_jwks_if_changed();
    let r = tg.get("/").header("authorization", &t).send().await;
    assert_eq!(r.status, 401, "{}", r.text());
    // A broken file keeps the keys in force.
    support::write_atomic(&tg.dir.path().join("jwks.json"), "not json");
    tg.reloader.reload_jwks_if_changed();
    assert_eq!(statuses(1, || tg.get("/").header("authorization", &t)).await, [401]);
}

/// Algorithm confusion (README, Verified identity): with an RSA public key
/// configured, a token that says HS256 and is signed with that public key's
/// PEM text as the HMAC secret (which anyone can read) never verifies. A
/// token signed with the private key does, so the key is in use.
#[tokio::test]
async fn an_rsa_key_never_verifies_a_forged_hs256_token() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let openssl = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir.path())
            .output()
            .expect("openssl runs (scripts/test installs curl, which brings it)");
        assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    openssl(&["genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "jwt.key"]);
    openssl(&["pkey", "-in", "jwt.key", "-pubout", "-out", "jwt.pub"]);
    let private = std::fs::read(dir.path().join("jwt.key")).expect("private key");
    let public = std::fs::read(dir.path().join("jwt.pub")).expect("public key");
    std::fs::create_dir(dir.path().join("rules")).expect("rules dir");
    let rules = "[[rule]]\nname = \"per-user\"\nkey = [\"user\"]\nlimit = 100\nwindow = \"1m\"\non_invalid_token = \"reject\"\n";
    std::fs::write(dir.path().join("rules/r.toml"), rules).expect("write rules");
    let cfg = config(upstream.addr).replace(
        "[client]\n",
        "[client]\njwt = { key_file = \"jwt.pub\", algorithms = [\"RS256\"], leeway = \"0s\" }\n",
    );
    let tg = Tollgate::start_in(dir, &cfg).await;
    let claims = json!({"sub": "alice", "exp": jsonwebtoken::get_current_timestamp() + 300});
    let signed = |alg: Algorithm, key: &EncodingKey| {
        format!("Bearer {}", encode(&Header::new(alg), &claims, key).expect("token encodes"))
    };

    let genuine = signed(Algorithm::RS256, &EncodingKey::from_rsa_pem(&private).expect("RSA private key"));
    let r = tg.get("/").header("authorization", &genuine).send().await;
    assert_eq!(r.status, 200, "the RS256 token: {}", r.text());
    let trimmed = public.trim_ascii_end();
    for secret in [&public[..], trimmed] {
        let forged = signed(Algorithm::HS256, &EncodingKey::from_secret(secret));
        let r = tg.get("/").header("authorization", &forged).send().await;
        assert_eq!(r.status, 401, "an HS256 token keyed with the public key was accepted: {}", r.text());
        assert_eq!(r.json()["error"], "invalid_token");
    }
    assert_eq!(upstream.hits(), 1, "only the genuine token's request was forwarded");
}
