//! The matcher and bucket keys, on rules from a small grammar and arbitrary
//! requests.
//!
//! Input: up to four rules and two `[[deny]]` entries (written as TOML and
//! read by the real parser, so every rule is one an operator could write;
//! the parser must accept them), a request with arbitrary method, path,
//! query, host, route, header bytes and client address, and edits that turn
//! it into a second request. Asserted:
//! - nothing panics (parsing, building, deny checks, matching, keys, costs,
//!   limits), a rule without conditions matches, a cost is within 1..=the
//!   bucket;
//! - a key never holds `{`, `}` (the Redis store wraps keys in a hash tag)
//!   or a control byte, has exactly one `|` per separator, and stays short;
//! - keys are injective: two requests get the same key from a rule exactly
//!   when every keyed value is the same (a missing or empty value counts as
//!   the client address, as documented on `Rule::key`). Checked for the
//!   edited request, and for each keyed value changed on its own: extended
//!   by a byte, or replaced by its own `%XX`-escaped spelling.

#![no_main]

use std::fmt::Write as _;
use std::net::IpAddr;
use std::path::Path;
use std::sync::OnceLock;

use arbitrary::Arbitrary;
use http::{HeaderMap, HeaderName, HeaderValue, Method};
use libfuzzer_sys::fuzz_target;
use tollgate::wire::client::key_addr;
use tollgate::config::{Config, Cost, KeyPart, LoadedRules, parse_rules_file};
use tollgate::obs::metrics::Metrics;
use tollgate::limit::rules::{RequestFacts, Rule, RuleSet};

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

const MAX_RULES: usize = 4;
const MAX_KEY_PARTS: usize = 4;

#[derive(Arbitrary, Debug)]
struct Input {
    rules: Vec<RuleGen>,
    denies: Vec<ClientsGen>,
    request: RequestGen,
    edits: Vec<Edit>,
}

#[derive(Arbitrary, Debug)]
struct RuleGen {
    name: String,
    methods: Vec<MethodGen>,
    path: Option<(bool, String)>,
    host: Option<String>,
    route: Option<bool>,
    header: Option<(NameGen, String)>,
    key: Option<Vec<KeyGen>>,
    algorithm: u8,
    limit: u32,
    window: WindowGen,
    burst: Option<u32>,
    throttle: u8,
    percent: u16,
    shadow: bool,
    cost: CostGen,
    exempt: Option<ClientsGen>,
}

/// A rule's `exempt`, or a `[[deny]]` entry.
#[derive(Arbitrary, Debug)]
struct ClientsGen {
    ips: Vec<(IpAddr, u8)>,
    users: Vec<String>,
    api_keys: Vec<String>,
}

#[derive(Arbitrary, Debug, Clone)]
enum MethodGen {
    Get,
    Post,
    Delete,
    Other(String),
}

/// A header name: the configured identity headers, one a rule might match
/// on, or anything.
#[derive(Arbitrary, Debug, Clone)]
enum NameGen {
    User,
    ApiKey,
    Tier,
    Cost,
    Other(String),
}

#[derive(Arbitrary, Debug)]
enum KeyGen {
    Ip,
    User,
    ApiKey,
    Route,
    Method,
    Path,
    Header(NameGen),
    Query(QueryGen),
}

#[derive(Arbitrary, Debug)]
enum QueryGen {
    Tenant,
    Page,
    Other(String),
}

#[derive(Arbitrary, Debug)]
enum WindowGen {
    Millis(u32),
    Second,
    Minute,
    Day,
}

#[derive(Arbitrary, Debug)]
enum CostGen {
    Default,
    Fixed(u32),
    Header(NameGen),
}

#[derive(Arbitrary, Debug, Clone)]
struct RequestGen {
    method: MethodGen,
    path: String,
    query: Option<String>,
    host: Option<String>,
    /// Some(true): the orders route; Some(false): another one.
    route: Option<bool>,
    headers: Vec<(NameGen, Vec<u8>)>,
    client: IpAddr,
}

/// How the second request differs from the first.
#[derive(Arbitrary, Debug)]
enum Edit {
    Method(MethodGen),
    Path(String),
    Query(Option<String>),
    Host(Option<String>),
    Route(Option<bool>),
    SetHeader(NameGen, Vec<u8>),
    AppendHeader(NameGen, Vec<u8>),
    RemoveHeader(NameGen),
    Client(IpAddr),
}

/// A TOML basic string.
fn quoted(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{:04X}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn method(m: &MethodGen) -> Method {
    match m {
        MethodGen::Get => Method::GET,
        MethodGen::Post => Method::POST,
        MethodGen::Delete => Method::DELETE,
        MethodGen::Other(s) => Method::from_bytes(s.as_bytes()).unwrap_or(Method::GET),
    }
}

const USER: &str = "x-user-id";
const API_KEY: &str = "x-api-key";

fn header_name(n: &NameGen) -> Option<HeaderName> {
    match n {
        NameGen::User => Some(HeaderName::from_static(USER)),
        NameGen::ApiKey => Some(HeaderName::from_static(API_KEY)),
        NameGen::Tier => Some(HeaderName::from_static("x-tier")),
        NameGen::Cost => Some(HeaderName::from_static("x-cost")),
        NameGen::Other(s) => HeaderName::from_bytes(s.trim().as_bytes()).ok(),
    }
}

/// Header bytes as a value: bytes a `HeaderValue` cannot hold (controls
/// other than tab) become `?`; everything else, obs-text included, stays.
fn header_value(bytes: &[u8]) -> HeaderValue {
    let clean: Vec<u8> = bytes.iter().map(|&b| if (b < b' ' && b != b'\t') || b == 0x7f { b'?' } else { b }).collect();
    HeaderValue::from_bytes(&clean).unwrap_or(HeaderValue::from_static(""))
}

/// The `ips`, `users` and `api_keys` entries of a `ClientsGen`, or `None`
/// when it names nobody.
fn clients_toml(c: &ClientsGen) -> Option<[String; 3]> {
    let list = |items: Vec<String>| items.iter().map(|s| quoted(s)).collect::<Vec<_>>().join(", ");
    let ips: Vec<String> = c
        .ips
        .iter()
        .take(3)
        .map(|(ip, prefix)| format!("{ip}/{}", prefix % if ip.is_ipv4() { 33 } else { 129 }))
        .collect();
    let users: Vec<String> = c.users.iter().take(3).cloned().collect();
    let api_keys: Vec<String> = c.api_keys.iter().take(3).cloned().collect();
    if ips.is_empty() && users.is_empty() && api_keys.is_empty() {
        return None;
    }
    Some([
        format!("ips = [{}]", list(ips)),
        format!("users = [{}]", list(users)),
        format!("api_keys = [{}]", list(api_keys)),
    ])
}

/// One `[[rule]]` table, valid by construction.
fn rule_toml(i: usize, r: &RuleGen) -> String {
    let mut t = String::from("[[rule]]\n");
    // Names: printable ASCII without quotes or backslashes, made unique by
    // the index; everything else allowed (`{`, `|`, spaces) stays in.
    let name: String =
        r.name.chars().filter(|c| (' '..='~').contains(c) && *c != '"' && *c != '\\').take(100).collect();
    let _ = writeln!(t, "name = {}", quoted(&format!("r{i}{name}")));

    let mut conditions = Vec::new();
    let methods: Vec<String> = r
        .methods
        .iter()
        .take(3)
        .map(|m| method(m).as_str().to_string())
        .filter(|m| Method::from_bytes(m.to_ascii_uppercase().as_bytes()).is_ok())
        .map(|m| quoted(&m))
        .collect();
    if !methods.is_empty() {
        conditions.push(format!("methods = [{}]", methods.join(", ")));
    }
    if let Some((prefix, p)) = &r.path {
        let p = format!("/{}{}", p.replace('*', ""), if *prefix { "*" } else { "" });
        conditions.push(format!("path = {}", quoted(&p)));
    }
    if let Some(h) = &r.host {
        conditions.push(format!("host = {}", quoted(h)));
    }
    if let Some(by_route_name) = r.route {
        conditions.push(format!("route = {}", quoted(if by_route_name { "orders-api" } else { "orders" })));
    }
    if let Some((n, v)) = &r.header
        && let Some(name) = header_name(n)
    {
        conditions.push(format!("header = {{ name = {}, value = {} }}", quoted(name.as_str()), quoted(v)));
    }
    if !conditions.is_empty() {
        let _ = writeln!(t, "match = {{ {} }}", conditions.join(", "));
    }

    if let Some(parts) = &r.key {
        let parts: Vec<String> = parts
            .iter()
            .take(MAX_KEY_PARTS)
            .map(|k| match k {
                KeyGen::Ip => "ip".to_string(),
                KeyGen::User => "user".to_string(),
                KeyGen::ApiKey => "api_key".to_string(),
                KeyGen::Route => "route".to_string(),
                KeyGen::Method => "method".to_string(),
                KeyGen::Path => "path".to_string(),
                KeyGen::Header(n) => header_name(n).map_or("ip".to_string(), |h| format!("header:{h}")),
                KeyGen::Query(QueryGen::Tenant) => "query:tenant".to_string(),
                KeyGen::Query(QueryGen::Page) => "query:page".to_string(),
                KeyGen::Query(QueryGen::Other(q)) if !q.trim().is_empty() => format!("query:{q}"),
                KeyGen::Query(QueryGen::Other(_)) => "ip".to_string(),
            })
            .map(|p| quoted(&p))
            .collect();
        let _ = writeln!(t, "key = [{}]", parts.join(", "));
    }

    let algorithms = ["token_bucket", "leaky_bucket", "fixed_window", "sliding_window_log", "sliding_window_counter"];
    let algorithm = algorithms[r.algorithm as usize % algorithms.len()];
    let _ = writeln!(t, "algorithm = {}", quoted(algorithm));
    let limit = u64::from(r.limit) % 1_000_000_000 + 1;
    let _ = writeln!(t, "limit = {limit}");
    let window = match r.window {
        WindowGen::Millis(ms) => format!("{}ms", u64::from(ms) + 1),
        WindowGen::Second => "1s".to_string(),
        WindowGen::Minute => "1m".to_string(),
        WindowGen::Day => "1d".to_string(),
    };
    let _ = writeln!(t, "window = {}", quoted(&window));
    let burst = r.burst.map(|b| u64::from(b) % 1_000_000_000 + 1);
    if let Some(b) = burst {
        let _ = writeln!(t, "burst = {b}");
    }
    let percent = r.percent % 1001;
    match r.throttle % 3 {
        0 => {}
        1 => {
            let _ = writeln!(t, "throttle = \"soft\"\nsoft_percent = {percent}");
        }
        _ => {
            let _ = writeln!(
                t,
                "throttle = \"elastic\"\nelastic_percent = {percent}\nelastic_when_inflight_below = {}",
                limit.min(1000)
            );
        }
    }
    if r.shadow {
        t.push_str("mode = \"shadow\"\n");
    }
    let capacity = if algorithm.ends_with("bucket") { burst.unwrap_or(limit) } else { limit };
    match &r.cost {
        CostGen::Default => {}
        CostGen::Fixed(n) => {
            let _ = writeln!(t, "cost = {}", u64::from(*n) % capacity + 1);
        }
        CostGen::Header(n) => {
            if let Some(h) = header_name(n) {
                let _ = writeln!(t, "cost_header = {}", quoted(h.as_str()));
            }
        }
    }
    if let Some(e) = r.exempt.as_ref().and_then(clients_toml) {
        let _ = writeln!(t, "exempt = {{ {} }}", e.join(", "));
    }
    t
}

/// A request, owning what [`RequestFacts`] borrows.
#[derive(Clone)]
struct Request {
    method: Method,
    path: String,
    query: Option<String>,
    host: Option<String>,
    route: Option<(&'static str, &'static str)>,
    headers: HeaderMap,
    /// The full client address.
    client_ip: IpAddr,
}

fn route(r: Option<bool>) -> Option<(&'static str, &'static str)> {
    r.map(|orders| if orders { ("orders-api", "orders") } else { ("billing", "billing") })
}

impl Request {
    fn new(g: &RequestGen) -> Request {
        let mut headers = HeaderMap::new();
        for (n, v) in g.headers.iter().take(16) {
            if let Some(name) = header_name(n) {
                headers.append(name, header_value(v));
            }
        }
        Request {
            method: method(&g.method),
            path: g.path.clone(),
            query: g.query.clone(),
            host: g.host.clone(),
            route: route(g.route),
            headers,
            client_ip: g.client,
        }
    }

    fn edit(&mut self, e: &Edit) {
        match e {
            Edit::Method(m) => self.method = method(m),
            Edit::Path(p) => self.path = p.clone(),
            Edit::Query(q) => self.query = q.clone(),
            Edit::Host(h) => self.host = h.clone(),
            Edit::Route(r) => self.route = route(*r),
            Edit::SetHeader(n, v) => {
                if let Some(name) = header_name(n) {
                    self.headers.insert(name, header_value(v));
                }
            }
            Edit::AppendHeader(n, v) => {
                if let Some(name) = header_name(n) {
                    self.headers.append(name, header_value(v));
                }
            }
            Edit::RemoveHeader(n) => {
                if let Some(name) = header_name(n) {
                    self.headers.remove(name);
                }
            }
            Edit::Client(ip) => self.client_ip = *ip,
        }
    }

    /// A copy with the value `part` keys on replaced by `change(value)`
    /// (the empty value when it has none), and nothing else unless a value
    /// is shared (a `header` part naming the user header). The client
    /// address and the route are flipped instead.
    fn vary(&self, part: &KeyPart, change: fn(&[u8]) -> Vec<u8>) -> Request {
        let mut r = self.clone();
        let set_header = |r: &mut Request, name: HeaderName| {
            let new = change(r.headers.get(&name).map_or(&[][..], |v| v.as_bytes()));
            r.headers.insert(name, header_value(&new));
        };
        match part {
            KeyPart::Ip => {
                // The lowest bit the key keeps: IPv4 whole, IPv6 by its /64.
                r.client_ip = match r.client_ip {
                    IpAddr::V4(v4) => IpAddr::V4((u32::from(v4) ^ 1).into()),
                    IpAddr::V6(v6) => IpAddr::V6((u128::from(v6) ^ (1 << 64)).into()),
                };
            }
            KeyPart::User => set_header(&mut r, HeaderName::from_static(USER)),
            KeyPart::ApiKey => set_header(&mut r, HeaderName::from_static(API_KEY)),
            KeyPart::Header(h) => set_header(&mut r, h.clone()),
            KeyPart::Route => r.route = if r.route.is_some() { None } else { route(Some(true)) },
            KeyPart::Method => {
                let toggled = if r.method == Method::GET { Method::POST } else { Method::GET };
                r.method = Method::from_bytes(&change(r.method.as_str().as_bytes())).unwrap_or(toggled);
            }
            KeyPart::Path => r.path = String::from_utf8_lossy(&change(r.path.as_bytes())).into_owned(),
            KeyPart::Query(q) => {
                let new = change(keyed_query(self.query.as_deref(), q).unwrap_or_default());
                let rest = r.query.take().map_or(String::new(), |q| format!("&{q}"));
                r.query = Some(format!("{q}={}{rest}", String::from_utf8_lossy(&new)));
            }
        }
        r
    }

    /// The address rules key on: IPv6 by its /64, as the proxy does.
    fn client(&self) -> IpAddr {
        key_addr(self.client_ip, 64)
    }

    /// The user and API key: the first value of their headers (no JWT).
    fn user(&self) -> Option<&[u8]> {
        self.headers.get(USER).map(|v| v.as_bytes())
    }

    fn api_key(&self) -> Option<&[u8]> {
        self.headers.get(API_KEY).map(|v| v.as_bytes())
    }

    fn facts(&self) -> RequestFacts<'_> {
        RequestFacts {
            method: &self.method,
            path: &self.path,
            query: self.query.as_deref(),
            host: self.host.as_deref(),
            route: self.route,
            headers: &self.headers,
            client: self.client(),
            client_ip: self.client_ip,
            user: self.user(),
            api_key: self.api_key(),
        }
    }
}

/// What one key part stands for, decided independently of `Rule::key`.
#[derive(Debug, PartialEq, Eq)]
enum Keyed<'a> {
    Value(&'a [u8]),
    Client(IpAddr),
}

/// The keyed values of a request under a rule, in key order.
fn keyed<'a>(rule: &Rule, r: &'a Request) -> Vec<Keyed<'a>> {
    let header = |name: &HeaderName| r.headers.get(name).map(|v| v.as_bytes());
    rule.spec
        .key
        .iter()
        .map(|part| {
            let value = match part {
                KeyPart::Ip => None,
                KeyPart::User => r.user(),
                KeyPart::ApiKey => r.api_key(),
                // A request outside any route has the empty route name.
                KeyPart::Route => return Keyed::Value(r.route.map_or("", |(name, _)| name).as_bytes()),
                KeyPart::Method => Some(r.method.as_str().as_bytes()),
                KeyPart::Path => Some(r.path.as_bytes()),
                KeyPart::Header(h) => header(h),
                KeyPart::Query(q) => keyed_query(r.query.as_deref(), q),
            };
            match value {
                Some(v) if !v.is_empty() => Keyed::Value(v),
                _ => Keyed::Client(r.client()),
            }
        })
        .collect()
}

/// Keys `a` and `b` under `rule`: both well formed, and equal exactly when
/// every keyed value is.
fn same_key_iff_same_values(rule: &Rule, a: &Request, b: &Request) {
    let (mut ka, mut kb) = (String::new(), String::new());
    let _ = rule.key(&a.facts(), &mut ka);
    let _ = rule.key(&b.facts(), &mut kb);
    check_key(rule, &ka);
    check_key(rule, &kb);
    let same_values = keyed(rule, a) == keyed(rule, b);
    assert_eq!(
        same_values,
        ka == kb,
        "rule {:?}: keyed values {} but keys {ka:?} and {kb:?}",
        rule.name(),
        if same_values { "equal" } else { "differ" }
    );
}

fn with_x(value: &[u8]) -> Vec<u8> {
    let mut v = value.to_vec();
    v.push(b'x');
    v
}

/// `value` with every byte but letters and digits written `%XX`.
fn escaped(value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(value.len() * 3);
    for &b in value {
        if b.is_ascii_alphanumeric() {
            out.push(b);
        } else {
            out.extend_from_slice(format!("%{b:02X}").as_bytes());
        }
    }
    out
}

/// The first `name=value` pair's value, undecoded; `name` alone has the
/// empty value.
fn keyed_query<'q>(query: Option<&'q str>, name: &str) -> Option<&'q [u8]> {
    query?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == name).then_some(v.as_bytes())
    })
}

fn check_key(rule: &Rule, key: &str) {
    assert!(
        !key.bytes().any(|b| b == b'{' || b == b'}' || b.is_ascii_control()),
        "key {key:?} of rule {:?} holds a brace or a control byte",
        rule.name()
    );
    let parts = rule.spec.key.len();
    assert_eq!(key.matches('|').count(), parts.max(1), "key {key:?}: one `|` after the name and between parts");
    // Name and values are each at most 128 bytes before encoding (3 after);
    // a tag, `=` and an IPv6 address fit in 64.
    let bound = 3 * 128 + 1 + parts * (64 + 3 * 128 + 1);
    assert!(key.len() <= bound, "key of {} bytes is over {bound}: {key:?}", key.len());
}

fuzz_target!(|input: Input| {
    let mut text = String::new();
    for (i, r) in input.rules.iter().take(MAX_RULES).enumerate() {
        text.push_str(&rule_toml(i, r));
        text.push('\n');
    }
    for (i, d) in input.denies.iter().take(2).enumerate() {
        if let Some(clients) = clients_toml(d) {
            let _ = writeln!(text, "[[deny]]\nname = \"d{i}\"\n{}\n", clients.join("\n"));
        }
    }
    let loaded = match parse_rules_file(Path::new("rules.toml"), &text, config()) {
        Ok(file) => LoadedRules {
            rules: file.rules.into_iter().map(|(spec, _)| spec).collect(),
            denies: file.denies,
            files: vec!["rules.toml".into()],
        },
        Err(e) => panic!("a rule from the grammar was rejected:\n{e}\n---\n{text}"),
    };
    let set = RuleSet::from_loaded(loaded, &Metrics::new());

    let a = Request::new(&input.request);
    let mut b = a.clone();
    for e in input.edits.iter().take(8) {
        b.edit(e);
    }
    for facts in [&a.facts(), &b.facts()] {
        let _ = set.denied(facts);
        let matched: Vec<&str> = set.matching(facts).map(|r| r.name()).collect();
        for rule in &set.rules {
            let m = &rule.spec.matcher;
            let unconditional = m.methods.is_empty()
                && m.path.is_none()
                && m.host.is_none()
                && m.route.is_none()
                && m.header.is_none()
                && rule.spec.exempt.is_empty();
            if unconditional {
                assert!(matched.contains(&rule.name()), "rule {:?} has no conditions but did not match", rule.name());
            }
            let capacity = rule.nominal.capacity();
            match (&rule.spec.cost, rule.cost(facts.headers)) {
                (_, Ok(n)) => assert!((1..=capacity).contains(&n), "cost {n} outside 1..={capacity}"),
                (Cost::Header(_), Err(_)) => {}
                (Cost::Fixed(n), Err(e)) => panic!("fixed cost {n} failed: {e}"),
            }
            for inflight in [0, 1, usize::MAX] {
                let _ = rule.effective_limits(inflight);
            }
        }
    }

    for rule in &set.rules {
        same_key_iff_same_values(rule, &a, &b);
        // And every single keyed value changed on its own.
        for part in &rule.spec.key {
            same_key_iff_same_values(rule, &a, &a.vary(part, with_x));
            // A value spelled as another value's escaped form must not
            // share its key ("a b" and "a%20b").
            same_key_iff_same_values(rule, &a, &a.vary(part, escaped));
        }
    }
});
