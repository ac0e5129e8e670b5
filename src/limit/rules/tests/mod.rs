//! Unit tests for the compiled rule set: matching, bucket keys, throttled
//! limits and request costs, and the headers rendered from them
//! ([`crate::wire::headers`]), with exact values throughout.

use std::net::IpAddr;
use std::path::Path;

use http::{HeaderMap, HeaderName, HeaderValue, Method};

use super::*;
use crate::config::key::{encode, push_sha256_hex};
use crate::config::{Config, parse_rules};
use crate::limit::rules::RuleReport;
use crate::limiter::{Algorithm, Limits, NANOS_PER_SEC, Nanos, Verdict};
use crate::obs::metrics::Metrics;
use crate::wire::headers;

const SEC: Nanos = NANOS_PER_SEC;

/// One upstream ("orders") behind a route named "orders-api".
fn config() -> Config {
    let main = r#"
[[upstream]]
name = "orders"
url = "http://127.0.0.1:9001"

[[route]]
name = "orders-api"
path_prefix = "/orders"
upstream = "orders"
"#;
    Config::parse(Path::new("tollgate.toml"), main).expect("valid main file")
}

/// Compiles a rules file.
fn set(source: &str) -> RuleSet {
    let specs = match parse_rules(Path::new("r.toml"), source, &config()) {
        Ok(r) => r.into_iter().map(|(s, _)| s).collect(),
        Err(e) => panic!("invalid rules:\n{e}"),
    };
    RuleSet::build(specs, vec!["r.toml".into()], &Metrics::new())
}

/// A set of one rule named "r", 10 requests per second, with `extra` lines.
fn one(extra: &str) -> RuleSet {
    set(&format!("[[rule]]\nname = \"r\"\nlimit = 10\nwindow = \"1s\"\n{extra}"))
}

/// A request, owning what [`RequestFacts`] borrows.
struct Req {
    method: Method,
    path: String,
    query: Option<String>,
    host: Option<String>,
    route: Option<(String, String)>,
    headers: HeaderMap,
    client: IpAddr,
    user_header: HeaderName,
    api_key_header: HeaderName,
    tier_claim: Option<String>,
}

fn req(method: Method, path: &str) -> Req {
    Req {
        method,
        path: path.to_string(),
        query: None,
        host: None,
        route: None,
        headers: HeaderMap::new(),
        client: "1.2.3.4".parse().expect("ip"),
        user_header: HeaderName::from_static("x-user-id"),
        api_key_header: HeaderName::from_static("x-api-key"),
        tier_claim: None,
    }
}

fn get(path: &str) -> Req {
    req(Method::GET, path)
}

impl Req {
    fn header(mut self, name: &str, value: &[u8]) -> Req {
        let name = HeaderName::from_bytes(name.as_bytes()).expect("test header name");
        self.headers.append(name, HeaderValue::from_bytes(value).expect("test header value"));
        self
    }
    fn user(self, id: &str) -> Req {
        self.header("x-user-id", id.as_bytes())
    }
    fn query(mut self, q: &str) -> Req {
        self.query = Some(q.to_string());
        self
    }
    fn host(mut self, h: &str) -> Req {
        self.host = Some(h.to_string());
        self
    }
    fn route(mut self, name: &str, upstream: &str) -> Req {
        self.route = Some((name.to_string(), upstream.to_string()));
        self
    }
    fn client(mut self, ip: &str) -> Req {
        self.client = ip.parse().expect("ip");
        self
    }
    fn facts(&self) -> RequestFacts<'_> {
        RequestFacts {
            method: &self.method,
            path: &self.path,
            query: self.query.as_deref(),
            host: self.host.as_deref(),
            route: self.route.as_ref().map(|(n, u)| (n.as_str(), u.as_str())),
            headers: &self.headers,
            client: self.client,
            client_ip: self.client,
            user: self.headers.get(&self.user_header).map(|v| v.as_bytes()),
            api_key: self.headers.get(&self.api_key_header).map(|v| v.as_bytes()),
            tier_claim: self.tier_claim.as_deref().map(str::as_bytes),
            client_cert: None,
        }
    }
}

/// The names of the rules `r` matches, in order.
fn matched(set: &RuleSet, r: &Req) -> Vec<String> {
    let facts = r.facts();
    set.matching(&facts).map(|rule| rule.name().to_string()).collect()
}

/// The key of the set's only rule for `r`.
fn key(set: &RuleSet, r: &Req) -> String {
    assert_eq!(set.rules.len(), 1);
    let mut out = String::from("left over from the previous request");
    set.rules[0].key(&r.facts(), &mut out).expect("key");
    out
}

fn keyed(parts: &str) -> RuleSet {
    one(&format!("key = {parts}\n"))
}

// ---------------------------------------------------------------------------
// Matching
// ---------------------------------------------------------------------------

#[test]
fn a_rule_without_match_applies_to_every_request() {
    let s = one("");
    assert_eq!(matched(&s, &get("/")), ["r"]);
    assert_eq!(matched(&s, &req(Method::DELETE, "/anything").host("x.example").route("a", "b")), ["r"]);
}

#[test]
fn methods() {
    let s = one("match = { methods = [\"POST\", \"put\"] }\n");
    assert_eq!(matched(&s, &req(Method::POST, "/")), ["r"]);
    assert_eq!(matched(&s, &req(Method::PUT, "/")), ["r"]);
    assert!(matched(&s, &get("/")).is_empty());
    assert!(matched(&s, &req(Method::PATCH, "/")).is_empty());
}

#[test]
fn exact_paths() {
    let s = one("match = { path = \"/api/login\" }\n");
    // Facts carry the canonical path; a trailing slash is the same path.
    assert_eq!(matched(&s, &get("/api/login")), ["r"]);
    assert_eq!(matched(&s, &get("/api/login/")), ["r"]);
    for other in ["/api/login/x", "/api/log", "/API/login", "/api"] {
        assert!(matched(&s, &get(other)).is_empty(), "{other}");
    }
}

#[test]
fn prefix_paths() {
    let s = one("match = { path = \"/api/*\" }\n");
    for hit in ["/api/", "/api", "/api/login", "/api/v1/orders/7"] {
        assert_eq!(matched(&s, &get(hit)), ["r"], "{hit}");
    }
    for miss in ["/apix", "/", "/v1/api/"] {
        assert!(matched(&s, &get(miss)).is_empty(), "{miss}");
    }
    // Without a slash before the star, the prefix is plain text.
    let s = one("match = { path = \"/api*\" }\n");
    assert_eq!(matched(&s, &get("/api")), ["r"]);
    assert_eq!(matched(&s, &get("/apix")), ["r"]);
    assert!(matched(&s, &get("/ap")).is_empty());
}

#[test]
fn hosts() {
    let s = one("match = { host = \"API.Example.com\" }\n");
    assert_eq!(matched(&s, &get("/").host("api.example.com")), ["r"]);
    assert!(matched(&s, &get("/").host("www.example.com")).is_empty());
    assert!(matched(&s, &get("/")).is_empty(), "a request without a host");
}

#[test]
fn routes_by_route_name_or_upstream_name() {
    let by_upstream = one("match = { route = \"orders\" }\n");
    let by_route = one("match = { route = \"orders-api\" }\n");
    let r = get("/orders/1").route("orders-api", "orders");
    assert_eq!(matched(&by_upstream, &r), ["r"]);
    assert_eq!(matched(&by_route, &r), ["r"]);
    let other = get("/users").route("users", "users");
    assert!(matched(&by_upstream, &other).is_empty());
    assert!(matched(&by_route, &other).is_empty());
    assert!(matched(&by_upstream, &get("/orders")).is_empty(), "no route");
}

#[test]
fn header_values() {
    let s = one("match = { header = { name = \"X-Tier\", value = \"free\" } }\n");
    assert_eq!(matched(&s, &get("/").header("x-tier", b"free")), ["r"]);
    assert!(matched(&s, &get("/").header("x-tier", b"Free")).is_empty(), "values compare exactly");
    assert!(matched(&s, &get("/").header("x-tier", b"free ")).is_empty());
    assert!(matched(&s, &get("/").header("x-tier", b"paid")).is_empty());
    assert!(matched(&s, &get("/")).is_empty(), "header absent");
}

#[test]
fn every_condition_must_hold() {
    let s = one(
        "match = { methods = [\"POST\"], path = \"/orders/*\", host = \"api.example.com\", route = \"orders\", header = { name = \"x-tier\", value = \"free\" } }\n",
    );
    let full = || {
        req(Method::POST, "/orders/7").host("api.example.com").route("orders-api", "orders").header("x-tier", b"free")
    };
    assert_eq!(matched(&s, &full()), ["r"]);
    let mut r = full();
    r.method = Method::GET;
    assert!(matched(&s, &r).is_empty(), "method");
    let mut r = full();
    r.path = "/users/7".into();
    assert!(matched(&s, &r).is_empty(), "path");
    assert!(matched(&s, &full().host("example.com")).is_empty(), "host");
    assert!(matched(&s, &full().route("users", "users")).is_empty(), "route");
    let mut r = full();
    r.headers.clear();
    assert!(matched(&s, &r).is_empty(), "header");
}

#[test]
fn matching_rules_come_in_file_order() {
    let s = set(r#"
[[rule]]
name = "all"
limit = 100
window = "1s"

[[rule]]
name = "login"
match = { methods = ["POST"], path = "/api/login" }
limit = 5
window = "1m"

[[rule]]
name = "api"
match = { path = "/api/*" }
limit = 50
window = "1s"
"#);
    assert_eq!(matched(&s, &req(Method::POST, "/api/login")), ["all", "login", "api"]);
    assert_eq!(matched(&s, &get("/api/login")), ["all", "api"]);
    assert_eq!(matched(&s, &get("/")), ["all"]);
}

#[test]
fn a_thousand_rules_compile_and_match() {
    let mut src = String::new();
    for i in 0..1000 {
        let method = if i % 2 == 0 { "GET" } else { "POST" };
        src.push_str(&format!(
            "[[rule]]\nname = \"svc-{i}\"\nmatch = {{ methods = [\"{method}\"], path = \"/svc/{i}/*\" }}\nkey = [\"user\"]\nlimit = {}\nwindow = \"1s\"\n\n",
            i + 1
        ));
    }
    src.push_str("[[rule]]\nname = \"exact-7\"\nmatch = { path = \"/svc/7\" }\nlimit = 1\nwindow = \"1s\"\n");
    let s = set(&src);
    assert_eq!(s.rules.len(), 1001);
    assert_eq!(s.rules[999].spec.limit, 1000);
    assert_eq!(s.rules[999].plan.policy, "\"svc-999\";q=1000;w=1");

    assert_eq!(matched(&s, &get("/svc/500/x")), ["svc-500"]);
    assert!(matched(&s, &req(Method::POST, "/svc/500/x")).is_empty(), "rule 500 is GET only");
    assert_eq!(matched(&s, &req(Method::POST, "/svc/999/")), ["svc-999"]);
    // "/svc/7/" must not match "/svc/70/" nor "/svc/700/".
    assert_eq!(matched(&s, &req(Method::POST, "/svc/7/a")), ["svc-7"]);
    assert_eq!(matched(&s, &get("/svc/70/a")), ["svc-70"]);
    assert_eq!(matched(&s, &get("/svc/7")), ["exact-7"]);
    assert!(matched(&s, &get("/svc/1000/a")).is_empty());
    for i in (0..1000).step_by(37) {
        let method = if i % 2 == 0 { Method::GET } else { Method::POST };
        let r = req(method, &format!("/svc/{i}/item")).user("u");
        assert_eq!(matched(&s, &r), [format!("svc-{i}")]);
        let rule = s.matching(&r.facts()).next().expect("one rule");
        let mut k = String::new();
        rule.key(&r.facts(), &mut k).expect("key");
        assert_eq!(k, format!("svc-{i}|user=u"));
    }
}

// ---------------------------------------------------------------------------
// Keys
// ---------------------------------------------------------------------------

#[test]
fn each_key_part() {
    let r = || {
        req(Method::POST, "/api/login")
            .query("a=1&page=%32&b=3")
            .route("orders-api", "orders")
            .user("alice")
            .header("x-api-key", b"k-123")
            .header("x-tenant", b"acme")
    };
    assert_eq!(key(&keyed("[\"ip\"]"), &r()), "r|ip=1.2.3.4");
    assert_eq!(key(&keyed("[\"ip\"]"), &r().client("2001:db8:1:2::")), "r|ip=2001:db8:1:2::");
    assert_eq!(key(&keyed("[\"user\"]"), &r()), "r|user=alice");
    // An API key is a secret: its SHA-256, never the key.
    assert_eq!(
        key(&keyed("[\"api_key\"]"), &r()),
        "r|api_key=sha256:3605a9e4358da4302f8acea41f0f52cef85d0e3f727c7b020fc7305aec8d56b4"
    );
    assert_eq!(key(&keyed("[\"route\"]"), &r()), "r|route=orders-api");
    assert_eq!(key(&keyed("[\"method\"]"), &r()), "r|method=POST");
    assert_eq!(key(&keyed("[\"path\"]"), &r()), "r|path=/api/login");
    assert_eq!(key(&keyed("[\"header:X-Tenant\"]"), &r()), "r|h=acme");
    assert_eq!(key(&keyed("[\"query:page\"]"), &r()), "r|q=2", "decoded, as upstreams read it");
    assert_eq!(key(&keyed("[\"query:a\"]"), &r()), "r|q=1");
    // The default key is the client address.
    assert_eq!(key(&one(""), &r()), "r|ip=1.2.3.4");
}

#[test]
fn a_query_parameter_given_twice_is_refused() {
    let s = keyed("[\"query:page\"]");
    let mut out = String::new();
    for q in ["page=2&page=3", "page=2&%70age=3", "p%61ge=1&page=1"] {
        let r = get("/").query(q);
        assert!(s.rules[0].key(&r.facts(), &mut out).is_err(), "{q}");
    }
    // Other parameters may repeat; `+` is a space, as in forms.
    assert_eq!(key(&s, &get("/").query("a=1&a=2&page=x+y")), "r|q=x%20y");
}

#[test]
fn identity_headers_are_the_configured_ones() {
    let s = keyed("[\"user\", \"api_key\"]");
    let mut r = get("/").header("x-auth", b"bob").header("authorization", b"secret");
    r.user_header = HeaderName::from_static("x-auth");
    r.api_key_header = HeaderName::from_static("authorization");
    assert_eq!(
        key(&s, &r),
        "r|user=bob|api_key=sha256:2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b"
    );
    assert!(!key(&s, &r).contains("secret"));
}

#[test]
fn multi_part_keys() {
    let s = keyed("[\"user\", \"method\", \"path\"]");
    assert_eq!(key(&s, &req(Method::PUT, "/orders/7").user("alice")), "r|user=alice|method=PUT|path=/orders/7");
    assert_ne!(key(&s, &get("/orders/7").user("alice")), key(&s, &req(Method::PUT, "/orders/7").user("alice")));
}

#[test]
fn an_empty_key_is_one_bucket_for_everyone() {
    let s = keyed("[]");
    assert_eq!(key(&s, &get("/")), "r|");
    assert_eq!(key(&s, &req(Method::POST, "/x").user("bob").client("9.9.9.9")), "r|");
}

#[test]
fn a_missing_identity_falls_back_to_the_client_ip() {
    let r = || get("/").client("5.6.7.8");
    assert_eq!(key(&keyed("[\"user\"]"), &r()), "r|ip=5.6.7.8");
    assert_eq!(key(&keyed("[\"user\"]"), &r().user("")), "r|ip=5.6.7.8", "an empty header is no identity");
    assert_eq!(key(&keyed("[\"api_key\"]"), &r()), "r|ip=5.6.7.8");
    assert_eq!(key(&keyed("[\"header:x-tenant\"]"), &r()), "r|ip=5.6.7.8");
    assert_eq!(key(&keyed("[\"query:page\"]"), &r()), "r|ip=5.6.7.8", "no query");
    assert_eq!(key(&keyed("[\"query:page\"]"), &r().query("pages=1&xpage=2")), "r|ip=5.6.7.8");
    assert_eq!(key(&keyed("[\"query:page\"]"), &r().query("page")), "r|ip=5.6.7.8", "no value");
    assert_eq!(key(&keyed("[\"query:page\"]"), &r().query("page=")), "r|ip=5.6.7.8");
    assert_eq!(
        key(&keyed("[\"user\", \"api_key\"]"), &r().header("x-api-key", b"k")),
        "r|ip=5.6.7.8|api_key=sha256:8254c329a92850f6d539dd376f4816ee2764517da5e0235514af433164480d7a"
    );
    assert_eq!(key(&keyed("[\"user\"]"), &r().client("2001:db8::")), "r|ip=2001:db8::");
    // A request outside any route keys `route` on the empty name, not the IP.
    assert_eq!(key(&keyed("[\"route\"]"), &r()), "r|route=");
    // A user whose id spells the fallback does not share the IP's bucket.
    assert_eq!(key(&keyed("[\"user\"]"), &r().user("ip=5.6.7.8")), "r|user=ip%3D5.6.7.8");
}

#[test]
fn keys_are_injective() {
    let s = keyed("[\"user\", \"path\"]");
    // user "a|b" vs user "a" with the rest moved into the path.
    let a = key(&s, &req(Method::GET, "/c").user("a|path=/b"));
    let b = key(&s, &req(Method::GET, "/b|path=/c").user("a"));
    assert_eq!(a, "r|user=a%7Cpath%3D/b|path=/c");
    assert_eq!(b, "r|user=a|path=/b%7Cpath%3D/c");
    assert_ne!(a, b);
    assert_eq!(key(&keyed("[\"user\"]"), &get("/").user("a|b")), "r|user=a%7Cb");

    // Braces (Redis hash tags), percent signs, spaces, tabs, quotes and
    // non-ASCII bytes are all encoded.
    assert_eq!(key(&keyed("[\"user\"]"), &get("/").user("{x} 100%\t\"")), "r|user=%7Bx%7D%20100%25%09%22");
    assert_eq!(key(&keyed("[\"header:x-name\"]"), &get("/").header("x-name", b"caf\xc3\xa9")), "r|h=caf%C3%A9");
    // Control bytes cannot reach a header, but a path could carry them.
    assert_eq!(key(&keyed("[\"path\"]"), &get("/a\u{1}\u{7f}\n")), "r|path=/a%01%7F%0A");
    // The encoding of "%" keeps an already-encoded value distinct.
    assert_ne!(key(&keyed("[\"user\"]"), &get("/").user("%7C")), key(&keyed("[\"user\"]"), &get("/").user("|")));
    // Safe characters pass as they are.
    assert_eq!(key(&keyed("[\"user\"]"), &get("/").user("Az09-._:/@+,")), "r|user=Az09-._:/@+,");
}

#[test]
fn long_values_are_replaced_by_a_bounded_hash() {
    let s = keyed("[\"user\"]");
    let at_limit = "u".repeat(128);
    assert_eq!(key(&s, &get("/").user(&at_limit)), format!("r|user={at_limit}"));

    let long_a = "a".repeat(129);
    let ka = key(&s, &get("/").user(&long_a));
    // "~", 32 hex digits of hash, then the length in hex (129 = 0x81).
    let hashed = ka.strip_prefix("r|user=~").expect("hashed value");
    assert_eq!(hashed.len(), 34, "{ka}");
    assert!(hashed.ends_with("81"), "{ka}");
    assert!(hashed.bytes().all(|b| b.is_ascii_hexdigit()), "{ka}");
    assert_eq!(key(&s, &get("/").user(&long_a)), ka, "the same value gives the same key");

    // Two different long values of the same length differ.
    let mut long_b = long_a.clone();
    long_b.replace_range(128.., "b");
    let kb = key(&s, &get("/").user(&long_b));
    assert_ne!(ka, kb);
    assert_eq!(kb.len(), ka.len());

    // A huge value stays small.
    let huge = "x".repeat(60_000);
    let kh = key(&s, &get("/").user(&huge));
    assert_eq!(kh.len(), "r|user=~".len() + 32 + "ea60".len(), "{kh}");
    assert!(kh.ends_with("ea60"), "{kh}");

    // A hash can never equal an encoded short value: '~' is always encoded.
    assert_eq!(key(&s, &get("/").user(kb.trim_start_matches("r|user="))), format!("r|user=%7E{}", &kb[8..]));
}

#[test]
fn the_hash_is_stable_across_processes() {
    // Every tollgate instance must derive the same key for the same value
    // (they share buckets through Redis), and no client may craft a value
    // whose key is another's (issue 29: a 64-bit hash with a public seed
    // could be collided): the first 128 bits of its SHA-256. This pins the
    // output, so a change of hash (which would split every hashed bucket
    // during a rolling upgrade) is noticed.
    let mut out = String::new();
    encode(&mut out, "z".repeat(200).as_bytes());
    let mut again = String::new();
    encode(&mut again, "z".repeat(200).as_bytes());
    assert_eq!(out, again);
    assert_eq!(out, "~983a71da81783dfb18f7617e411156a9c8");
}

#[test]
fn rule_names_with_special_characters() {
    let s = set("[[rule]]\nname = \"a|b {c} 100% x=y\"\nkey = [\"user\"]\nlimit = 5\nwindow = \"1s\"\n");
    let rule = &s.rules[0];
    assert_eq!(rule.name(), "a|b {c} 100% x=y");
    assert_eq!(rule.quoted_name, "\"a|b {c} 100% x=y\"");
    assert_eq!(rule.plan.policy, "\"a|b {c} 100% x=y\";q=5;w=1");
    assert_eq!(key(&s, &get("/").user("u")), "a%7Cb%20%7Bc%7D%20100%25%20x%3Dy|user=u");

    // Rule "x" keyed on user "y|user=z" and a rule named "x|user=y" keyed on
    // user "z" do not share a bucket.
    let s = set(
        "[[rule]]\nname = \"x\"\nkey = [\"user\"]\nlimit = 5\nwindow = \"1s\"\n\n[[rule]]\nname = \"x|user=y\"\nkey = [\"user\"]\nlimit = 5\nwindow = \"1s\"\n",
    );
    let (mut k1, mut k2) = (String::new(), String::new());
    s.rules[0].key(&get("/").user("y|user=z").facts(), &mut k1).expect("key");
    s.rules[1].key(&get("/").user("z").facts(), &mut k2).expect("key");
    assert_eq!(k1, "x|user=y%7Cuser%3Dz");
    assert_eq!(k2, "x%7Cuser%3Dy|user=z");
}

// ---------------------------------------------------------------------------
// Compiled values
// ---------------------------------------------------------------------------

#[test]
fn compiled_rule_values() {
    let s = set(r#"
[[rule]]
name = "login-by-ip"
algorithm = "sliding_window_log"
limit = 5
window = "1m"

[[rule]]
name = "fast"
limit = 10
window = "250ms"
burst = 20

[[rule]]
name = "odd"
algorithm = "fixed_window"
limit = 3
window = "1500ms"
"#);
    let [login, fast, odd] = &s.rules[..] else { panic!("three rules") };
    assert_eq!(login.plan.policy, "\"login-by-ip\";q=5;w=60");
    assert_eq!(login.quoted_name, "\"login-by-ip\"");
    assert_eq!(login.window_secs, 60);
    assert_eq!(
        login.plan.nominal,
        Limits { algorithm: Algorithm::SlidingWindowLog, limit: 5, window: 60 * SEC, burst: 5, origin: 0 }
    );
    assert_eq!(fast.plan.policy, "\"fast\";q=10;w=1");
    assert_eq!(fast.window_secs, 1);
    assert_eq!(
        fast.plan.nominal,
        Limits { algorithm: Algorithm::TokenBucket, limit: 10, window: SEC / 4, burst: 20, origin: 0 }
    );
    assert_eq!(odd.window_secs, 2, "whole seconds, rounded up");
    assert_eq!(odd.plan.policy, "\"odd\";q=3;w=2");
    assert!(login.enforced());
    assert_eq!(s.files, [std::path::PathBuf::from("r.toml")]);
    // The longest idle horizon, doubled: the log's 60 s window.
    assert_eq!(s.idle_horizon, 120 * SEC);
    assert!(!one("mode = \"shadow\"\n").rules[0].enforced());
    assert_eq!(whole_secs(1), 1);
    assert_eq!(whole_secs(0), 1);
    assert_eq!(whole_secs(SEC), 1);
    assert_eq!(whole_secs(SEC + 1), 2);
}

#[test]
fn an_empty_rule_set() {
    let s = set("");
    assert!(s.rules.is_empty());
    assert_eq!(s.idle_horizon, 0);
    assert!(matched(&s, &get("/")).is_empty());
}

// ---------------------------------------------------------------------------
// Throttling and cost
// ---------------------------------------------------------------------------

fn limits(l: &Limits) -> (u64, u64) {
    (l.limit, l.burst)
}

#[test]
fn hard_limits_are_the_nominal_ones() {
    let s = one("burst = 20\n");
    let r = &s.rules[0];
    assert_eq!(r.effective_limits(0), r.plan.nominal);
    assert_eq!(r.effective_limits(1_000_000), r.plan.nominal);
    assert_eq!(limits(&r.plan.nominal), (10, 20));
}

#[test]
fn soft_limits_always_add_the_percentage() {
    let s = one("burst = 20\nthrottle = \"soft\"\nsoft_percent = 25\n");
    let r = &s.rules[0];
    let l = r.effective_limits(0);
    assert_eq!(limits(&l), (13, 25), "10 + 2.5 rounds up; 20 + 5");
    assert_eq!((l.algorithm, l.window), (Algorithm::TokenBucket, SEC));
    assert_eq!(r.effective_limits(usize::MAX), l, "soft ignores load");
    // The default 10 %.
    assert_eq!(limits(&one("throttle = \"soft\"\n").rules[0].effective_limits(0)), (11, 11));
    // 0 % is hard.
    assert_eq!(limits(&one("throttle = \"soft\"\nsoft_percent = 0\n").rules[0].effective_limits(0)), (10, 10));
    // 1000 % is eleven times the limit.
    assert_eq!(limits(&one("throttle = \"soft\"\nsoft_percent = 1000\n").rules[0].effective_limits(0)), (110, 110));
}

#[test]
fn soft_and_elastic_headroom_is_never_rounded_away_and_never_unbounded() {
    // 10 % of 5 is half a request: rounded up, not down to nothing.
    let soft = set("[[rule]]\nname = \"r\"\nlimit = 5\nwindow = \"1s\"\nthrottle = \"soft\"\n");
    assert_eq!(limits(&soft.rules[0].effective_limits(0)), (6, 6));
    let elastic =
        set("[[rule]]\nname = \"r\"\nlimit = 3\nwindow = \"1s\"\nthrottle = \"elastic\"\nelastic_percent = 1\n");
    assert_eq!(limits(&elastic.rules[0].effective_limits(0)), (4, 4));
    // The largest limit at 1000 %: capped where every store counts exactly.
    let huge =
        set("[[rule]]\nname = \"r\"\nlimit = 1000000000\nwindow = \"1s\"\nthrottle = \"soft\"\nsoft_percent = 1000\n");
    let l = huge.rules[0].effective_limits(0);
    assert_eq!(limits(&l), (crate::limiter::MAX_LIMIT, crate::limiter::MAX_LIMIT));
}

#[test]
fn elastic_limits_depend_on_the_upstreams_load() {
    let s = one("throttle = \"elastic\"\nelastic_percent = 50\nelastic_when_inflight_below = 100\n");
    let r = &s.rules[0];
    assert_eq!(limits(&r.effective_limits(0)), (15, 15));
    assert_eq!(limits(&r.effective_limits(99)), (15, 15), "below the threshold");
    assert_eq!(limits(&r.effective_limits(100)), (10, 10), "at the threshold");
    assert_eq!(limits(&r.effective_limits(101)), (10, 10));
    assert_eq!(r.effective_limits(100), r.plan.nominal);
}

fn cost_rule(extra: &str) -> RuleSet {
    one(&format!("burst = 10\ncost_header = \"x-cost\"\n{extra}"))
}

fn cost(s: &RuleSet, value: Option<&[u8]>) -> Result<u64, String> {
    let mut h = HeaderMap::new();
    if let Some(v) = value {
        h.insert("x-cost", HeaderValue::from_bytes(v).expect("test header value"));
    }
    s.rules[0].cost(&h)
}

#[test]
fn cost_from_a_header() {
    let s = cost_rule("");
    let err = Err("header x-cost must be a whole number from 1 to 10".to_string());
    assert_eq!(cost(&s, None), Ok(1), "absent");
    assert_eq!(cost(&s, Some(b"3")), Ok(3));
    assert_eq!(cost(&s, Some(b" 5 ")), Ok(5));
    assert_eq!(cost(&s, Some(b"05")), Ok(5));
    assert_eq!(cost(&s, Some(b"10")), Ok(10), "the whole bucket");
    for bad in [
        &b"0"[..],
        b"-1",
        b"+5",
        b"abc",
        b"1e3",
        b"2.0",
        b"",
        b"11",
        b"99999999999999999999",
        b"18446744073709551617",
        b"1 2",
        b"\xff",
    ] {
        assert_eq!(cost(&s, Some(bad)), err, "{:?}", String::from_utf8_lossy(bad));
    }
}

#[test]
fn the_cost_bound_is_the_nominal_bucket() {
    // Fixed window: the bucket is the limit (10), not burst.
    let s = one("algorithm = \"fixed_window\"\nburst = 50\ncost_header = \"x-cost\"\n");
    assert_eq!(cost(&s, Some(b"10")), Ok(10));
    assert_eq!(cost(&s, Some(b"11")), Err("header x-cost must be a whole number from 1 to 10".to_string()));
    // Token bucket: burst.
    let s = one("burst = 1000\ncost_header = \"x-cost\"\n");
    assert_eq!(cost(&s, Some(b"1000")), Ok(1000));
    assert_eq!(cost(&s, Some(b"1001")), Err("header x-cost must be a whole number from 1 to 1000".to_string()));
}

#[test]
fn max_cost_caps_the_header_and_defaults_to_1000() {
    // A bucket of 100 000: the header may claim at most 1000 by default...
    let s = one("burst = 100000\ncost_header = \"x-cost\"\n");
    assert_eq!(cost(&s, Some(b"1000")), Ok(1000));
    assert_eq!(cost(&s, Some(b"1001")), Err("header x-cost must be a whole number from 1 to 1000".to_string()));
    // ...or what max_cost says.
    let s = one("burst = 100000\ncost_header = \"x-cost\"\nmax_cost = 50000\n");
    assert_eq!(cost(&s, Some(b"50000")), Ok(50000));
    assert_eq!(cost(&s, Some(b"50001")), Err("header x-cost must be a whole number from 1 to 50000".to_string()));
    let s = cost_rule("max_cost = 3\n");
    assert_eq!(cost(&s, Some(b"4")), Err("header x-cost must be a whole number from 1 to 3".to_string()));
}

#[test]
fn a_fixed_cost_ignores_the_header() {
    let s = one("cost = 4\n");
    assert_eq!(cost(&s, None), Ok(4));
    assert_eq!(cost(&s, Some(b"abc")), Ok(4));
    assert_eq!(cost(&one(""), Some(b"7")), Ok(1));
}

// ---------------------------------------------------------------------------
// Response headers
// ---------------------------------------------------------------------------

fn verdict(allowed: bool, remaining: u64, reset_ms: u64) -> Verdict {
    Verdict {
        allowed,
        remaining,
        reset_after: reset_ms * 1_000_000,
        retry_after: 0,
        delay: 0,
        fallback: false,
        boxed: crate::limiter::Boxed::No,
    }
}

fn header_pairs(h: &HeaderMap) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> =
        h.iter().map(|(k, v)| (k.as_str().to_string(), v.to_str().expect("ascii header").to_string())).collect();
    v.sort();
    v
}

fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = p.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    v.sort();
    v
}

#[test]
fn headers_for_one_rule() {
    let s = set("[[rule]]\nname = \"login-by-ip\"\nlimit = 5\nwindow = \"1m\"\n");
    let r = &s.rules[0];
    let reports = [RuleReport::new(r, &verdict(true, 3, 39_200), 5)];
    assert_eq!(reports[0].remaining, 3);
    assert_eq!(reports[0].reset_secs, 40, "rounded up");
    assert_eq!(headers::most_restrictive(&reports), 0);
    let mut h = HeaderMap::new();
    headers::write(&mut h, &reports, 0);
    assert_eq!(
        header_pairs(&h),
        pairs(&[
            ("x-ratelimit-limit", "5"),
            ("x-ratelimit-remaining", "3"),
            ("x-ratelimit-reset", "40"),
            ("ratelimit-policy", "\"login-by-ip\";q=5;w=60"),
            ("ratelimit", "\"login-by-ip\";r=3;t=40"),
        ])
    );
}

#[test]
fn headers_keep_what_the_upstream_sent_and_never_loosen_it() {
    let s = one("");
    let reports = [RuleReport::new(&s.rules[0], &verdict(true, 9, 100), 10)];
    // The upstream's structured items stay, tollgate's are added; an
    // X-RateLimit trio more permissive than tollgate's is replaced.
    let mut h = HeaderMap::new();
    h.insert("x-ratelimit-limit", HeaderValue::from_static("1000"));
    h.insert("x-ratelimit-remaining", HeaderValue::from_static("999"));
    h.append("ratelimit", HeaderValue::from_static("\"upstream\";r=1;t=1"));
    h.append("ratelimit", HeaderValue::from_static("\"upstream2\";r=1;t=1"));
    h.insert("content-type", HeaderValue::from_static("text/plain"));
    headers::write(&mut h, &reports, 0);
    assert_eq!(
        header_pairs(&h),
        pairs(&[
            ("content-type", "text/plain"),
            ("x-ratelimit-limit", "10"),
            ("x-ratelimit-remaining", "9"),
            ("x-ratelimit-reset", "1"),
            ("ratelimit-policy", "\"r\";q=10;w=1"),
            ("ratelimit", "\"upstream\";r=1;t=1"),
            ("ratelimit", "\"upstream2\";r=1;t=1"),
            ("ratelimit", "\"r\";r=9;t=1"),
        ])
    );
    // A stricter upstream trio is left as it was.
    let mut h = HeaderMap::new();
    h.insert("x-ratelimit-limit", HeaderValue::from_static("3"));
    h.insert("x-ratelimit-remaining", HeaderValue::from_static("2"));
    h.insert("x-ratelimit-reset", HeaderValue::from_static("30"));
    headers::write(&mut h, &reports, 0);
    assert_eq!(h["x-ratelimit-limit"], "3");
    assert_eq!(h["x-ratelimit-remaining"], "2");
    assert_eq!(h["x-ratelimit-reset"], "30");
}

#[test]
fn headers_for_several_rules() {
    let s = set(r#"
[[rule]]
name = "per-user"
limit = 100
window = "1m"

[[rule]]
name = "burst"
limit = 10
window = "1s"

[[rule]]
name = "daily"
algorithm = "fixed_window"
limit = 1000
window = "1d"
"#);
    let reports = [
        RuleReport::new(&s.rules[0], &verdict(true, 50, 30_000), 100),
        RuleReport::new(&s.rules[1], &verdict(true, 2, 800), 10),
        RuleReport::new(&s.rules[2], &verdict(true, 2, 3_600_000), 1000),
    ];
    let primary = headers::most_restrictive(&reports);
    assert_eq!(primary, 1, "least remaining, first on ties");
    let mut h = HeaderMap::new();
    headers::write(&mut h, &reports, primary);
    assert_eq!(
        header_pairs(&h),
        pairs(&[
            ("x-ratelimit-limit", "10"),
            ("x-ratelimit-remaining", "2"),
            ("x-ratelimit-reset", "1"),
            ("ratelimit-policy", "\"per-user\";q=100;w=60, \"burst\";q=10;w=1, \"daily\";q=1000;w=86400"),
            ("ratelimit", "\"per-user\";r=50;t=30, \"burst\";r=2;t=1, \"daily\";r=2;t=3600"),
        ])
    );

    // The trio follows `primary`, whichever it is.
    let mut h = HeaderMap::new();
    headers::write(&mut h, &reports, 2);
    assert_eq!(h["x-ratelimit-limit"], "1000");
    assert_eq!(h["x-ratelimit-reset"], "3600");
}

#[test]
fn a_rejected_rule_reports_zero_remaining() {
    let s = set(
        "[[rule]]\nname = \"a\"\nlimit = 100\nwindow = \"1m\"\n\n[[rule]]\nname = \"b\"\nlimit = 5\nwindow = \"1m\"\n",
    );
    // A store reports what is left even when it rejects (a cost of 3 with 2
    // tokens left): the client is told 0.
    let rejected = RuleReport::new(&s.rules[1], &verdict(false, 2, 12_000), 5);
    assert_eq!(rejected.remaining, 0);
    let reports = [RuleReport::new(&s.rules[0], &verdict(true, 1, 600), 100), rejected];
    assert_eq!(headers::most_restrictive(&reports), 1);
    let mut h = HeaderMap::new();
    headers::write(&mut h, &reports, 1);
    headers::write_retry_after(&mut h, 12);
    assert_eq!(
        header_pairs(&h),
        pairs(&[
            ("x-ratelimit-limit", "5"),
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "12"),
            ("ratelimit-policy", "\"a\";q=100;w=60, \"b\";q=5;w=60"),
            ("ratelimit", "\"a\";r=1;t=1, \"b\";r=0;t=12"),
            ("retry-after", "12"),
            ("x-ratelimit-retry-after", "12"),
        ])
    );
}

#[test]
fn ties_go_to_the_first_rule() {
    let s = set(
        "[[rule]]\nname = \"a\"\nlimit = 5\nwindow = \"1s\"\n\n[[rule]]\nname = \"b\"\nlimit = 5\nwindow = \"1s\"\n",
    );
    let reports = [
        RuleReport::new(&s.rules[0], &verdict(true, 4, 200), 5),
        RuleReport::new(&s.rules[1], &verdict(true, 4, 900), 5),
    ];
    assert_eq!(headers::most_restrictive(&reports), 0);
}

#[test]
fn no_rule_no_headers() {
    assert_eq!(headers::most_restrictive::<RuleReport<'_>>(&[]), 0);
    let mut h = HeaderMap::new();
    headers::write::<RuleReport<'_>>(&mut h, &[], 0);
    assert!(h.is_empty());
    // An out-of-range primary writes nothing rather than panicking.
    let s = one("");
    let reports = [RuleReport::new(&s.rules[0], &verdict(true, 1, 1), 10)];
    headers::write(&mut h, &reports, 1);
    assert!(h.is_empty());
}

#[test]
fn soft_headroom_is_not_advertised() {
    // limit 10, soft 50 %: the store counts against 15.
    let s = one("throttle = \"soft\"\nsoft_percent = 50\n");
    let r = &s.rules[0];
    let capacity = r.effective_limits(0).capacity();
    assert_eq!(capacity, 15);
    assert_eq!(RuleReport::new(r, &verdict(true, 14, 100), capacity).remaining, 9, "first request");
    assert_eq!(RuleReport::new(r, &verdict(true, 5, 1000), capacity).remaining, 0, "at the nominal limit");
    assert_eq!(RuleReport::new(r, &verdict(true, 1, 1000), capacity).remaining, 0, "inside the headroom");
    let report = RuleReport::new(r, &verdict(true, 7, 1000), capacity);
    let mut h = HeaderMap::new();
    headers::write(&mut h, &[report], 0);
    assert_eq!(h["x-ratelimit-limit"], "10");
    assert_eq!(h["x-ratelimit-remaining"], "2");
    assert_eq!(h["ratelimit"], "\"r\";r=2;t=1");
    assert_eq!(h["ratelimit-policy"], "\"r\";q=10;w=1");

    // Elastic under load has no headroom: remaining passes through.
    let s = one("throttle = \"elastic\"\nelastic_when_inflight_below = 4\n");
    let r = &s.rules[0];
    assert_eq!(RuleReport::new(r, &verdict(true, 7, 1), r.effective_limits(4).capacity()).remaining, 7);
    assert_eq!(RuleReport::new(r, &verdict(true, 7, 1), r.effective_limits(3).capacity()).remaining, 2);
}

#[test]
fn retry_after_is_whole_seconds_and_at_least_one() {
    for (secs, want) in [(0, "1"), (1, "1"), (12, "12"), (86_400, "86400")] {
        let mut h = HeaderMap::new();
        headers::write_retry_after(&mut h, secs);
        assert_eq!(header_pairs(&h), pairs(&[("retry-after", want), ("x-ratelimit-retry-after", want)]), "{secs}");
    }
}

#[test]
fn the_path_index_keeps_file_order_across_exact_prefix_and_pathless_rules() {
    let rule = |name: &str, m: &str| format!("[[rule]]\nname = \"{name}\"\n{m}limit = 1\nwindow = \"1s\"\n");
    let s = set(&[
        rule("exact-a", "match = { path = \"/a\" }\n"),
        rule("prefix-a", "match = { path = \"/a*\" }\n"),
        rule("exact-a-get", "match = { path = \"/a\", methods = [\"GET\"] }\n"),
        rule("any", ""),
        rule("exact-b", "match = { path = \"/b\" }\n"),
        rule("exact-a-post", "match = { path = \"/a\", methods = [\"POST\"] }\n"),
    ]
    .concat());
    assert_eq!(matched(&s, &get("/a")), ["exact-a", "prefix-a", "exact-a-get", "any"]);
    assert_eq!(matched(&s, &get("/b")), ["any", "exact-b"]);
    assert_eq!(matched(&s, &get("/ab")), ["prefix-a", "any"]);
    assert_eq!(matched(&s, &req(Method::POST, "/a")), ["exact-a", "prefix-a", "any", "exact-a-post"]);
}

#[test]
fn the_user_is_needed_under_every_spelling_of_a_rules_path() {
    let exact = one("match = { path = \"/api/login\" }\nkey = [\"user\"]\n");
    assert!(exact.needs_user("/api/login"));
    assert!(exact.needs_user("/api/login/"), "the trailing slash is the same path");
    assert!(!exact.needs_user("/api/other"));
    let prefix = one("match = { path = \"/api/*\" }\nkey = [\"user\"]\n");
    assert!(prefix.needs_user("/api"));
    assert!(prefix.needs_user("/api/x"));
    assert!(!prefix.needs_user("/apix"));
}

#[test]
fn the_user_and_api_key_are_read_only_when_something_reads_them() {
    let ip = one("key = [\"ip\"]\n");
    assert!(!ip.any_needs_user && !ip.any_reads_api_key);
    assert!(one("key = [\"user\"]\n").any_needs_user);
    assert!(one("key = [\"api_key\"]\n").any_reads_api_key);
    assert!(one("key = [\"ip\"]\nexempt = { api_keys = [\"k\"] }\n").any_reads_api_key);
    assert!(one("key = [\"ip\"]\nexempt = { users = [\"u\"] }\n").any_needs_user);
}

mod plans;
mod reuse;
