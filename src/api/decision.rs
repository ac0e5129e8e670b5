//! The decision API (`[listen] decision`): `POST /v1/check` lets a service
//! that is not behind the proxy ask for the same decision the proxy makes.
//!
//! The request names a rule and gives the values of its key parts; the
//! bucket key is built by the rule's own key function ([`Rule::key`]) from
//! facts assembled out of those values, so a user limited through the proxy
//! is limited through the API and the other way round: both spend one
//! counter, in the same store, under the same (hot-reloaded) rules, counted
//! in the same per-rule metrics.
//!
//! ```text
//! POST /v1/check  {"rule": "per-user", "key": {"user": "alice"}, "cost": 1}
//! 200             {"allowed": true, "remaining": 4, "retry_after": 0,
//!                  "headers": {"ratelimit": "\"per-user\";r=4;t=60", ...}}
//! ```
//!
//! An optional `"tier"` states the client's tier for a rule with `tiers`
//! (the caller is trusted: the listener is operator-only).
//!
//! A rejection is still a 200 with `"allowed": false`: the call succeeded,
//! its answer is "no". 400 (JSON) for what the caller got wrong.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{ALLOW, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use serde_json::{Map, Value, json};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::config::{Cost, KeyPart, TierSource};
use crate::limit::decide::{Decider, Outcome};
use crate::limit::rules::{Plan, RequestFacts, Rule};
use crate::limiter::NANOS_PER_SEC;
use crate::wire::error::json_response;

/// The largest request body read: a check is a few hundred bytes; anything
/// far larger is a mistake or an attack, answered 413 without reading on.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// Connections the decision listener serves at once.
const MAX_CONNECTIONS: usize = 1024;

/// The one path this listener serves.
pub const CHECK_PATH: &str = "/v1/check";

/// Accepts decision API connections until the task is aborted (at
/// shutdown, like the admin listener).
pub async fn serve(listener: TcpListener, decider: Arc<Decider>, header_read_timeout: Duration) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(header_read_timeout);
    builder.http2().timer(TokioTimer::new());
    let builder = Arc::new(builder);
    loop {
        let (stream, permit) = super::accept::next(&listener, &slots).await;
        let (decider, builder) = (decider.clone(), builder.clone());
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let decider = decider.clone();
                async move { Ok::<_, Infallible>(handle(&decider, req).await) }
            });
            let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
            drop(permit);
        });
    }
}

/// Answers one request to the decision listener.
pub async fn handle<B>(decider: &Decider, req: Request<B>) -> Response<Full<Bytes>>
where
    B: hyper::body::Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    if req.uri().path() != CHECK_PATH {
        return json_response(
            StatusCode::NOT_FOUND,
            &json!({"error": "not_found", "message": "The decision API answers POST /v1/check only."}),
        );
    }
    if req.method() != Method::POST {
        let mut resp = json_response(
            StatusCode::METHOD_NOT_ALLOWED,
            &json!({"error": "method_not_allowed", "message": "/v1/check answers POST only."}),
        );
        resp.headers_mut().insert(ALLOW, HeaderValue::from_static("POST"));
        return resp;
    }
    let body = match Limited::new(req.into_body(), MAX_BODY_BYTES).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return json_response(
                StatusCode::PAYLOAD_TOO_LARGE,
                &json!({"error": "payload_too_large", "message": format!("The body must be at most {MAX_BODY_BYTES} bytes.")}),
            );
        }
        Err(_) => return bad("The request body could not be read.".into()),
    };
    match check(decider, &body).await {
        Ok(v) => json_response(StatusCode::OK, &v),
        Err(why) => bad(why),
    }
}

fn bad(message: String) -> Response<Full<Bytes>> {
    json_response(StatusCode::BAD_REQUEST, &json!({"error": "bad_request", "message": message}))
}

/// Decides one check. `Err` carries the sentence of the 400 answer.
async fn check(decider: &Decider, body: &[u8]) -> Result<Value, String> {
    let req: Value = serde_json::from_slice(body).map_err(|e| format!("The body is not valid JSON: {e}."))?;
    let Value::Object(mut req) = req else { return Err("The body must be a JSON object.".into()) };
    let name = match req.remove("rule") {
        Some(Value::String(s)) => s,
        Some(_) => return Err("\"rule\" must be a string.".into()),
        None => return Err("\"rule\" is missing: the name of the rule to check.".into()),
    };
    let key = match req.remove("key") {
        Some(Value::Object(m)) => m,
        None => Map::new(),
        Some(_) => return Err("\"key\" must be an object mapping the rule's key parts to strings.".into()),
    };
    let cost = req.remove("cost");
    let tier = match req.remove("tier") {
        Some(Value::String(s)) => Some(s),
        None => None,
        Some(_) => return Err("\"tier\" must be a string: the name of one of the rule's tiers.".into()),
    };
    if let Some(other) = req.keys().next() {
        return Err(format!("Unknown field {other:?}: a check has \"rule\", \"key\", \"cost\" and \"tier\"."));
    }

    let rules = decider.rules().load();
    let Some(rule) = rules.rules.iter().find(|r| r.name() == name) else {
        return Err(format!("No rule is named {name:?}."));
    };
    if rule.spec.algorithm.holds() {
        return Err(format!(
            "Rule {name:?} limits requests in flight (algorithm = \"concurrency\"): a check cannot hold a slot."
        ));
    }
    let max_cost = max_cost(rule);
    let cost = match cost {
        None => 1,
        Some(v) => match v.as_u64() {
            Some(n) if (1..=max_cost).contains(&n) => n,
            _ => return Err(format!("\"cost\" must be a whole number from 1 to {max_cost}.")),
        },
    };
    let o = decide(decider, rule, &key, Ask { cost, tier: tier.as_deref(), limit: None }).await?;
    let headers: Map<String, Value> = o
        .headers()
        .iter()
        .map(|(k, v)| (k.as_str().to_string(), Value::String(v.to_str().unwrap_or("").to_string())))
        .collect();
    let mut body = json!({
        "allowed": o.allowed,
        "remaining": o.remaining,
        "retry_after": o.retry_after,
        "headers": headers,
    });
    if o.delay > 0 {
        // Leaky bucket shaping: the proxy would hold the request this long.
        body["delay_ms"] = json!(o.delay.div_ceil(1_000_000));
    }
    if o.exempt {
        body["exempt"] = json!(true);
    }
    if o.store_unavailable {
        body["store_unavailable"] = json!(true);
    }
    Ok(body)
}

/// The largest cost one check may ask for: a `cost_header` rule's
/// `max_cost`, as for the header; otherwise the bucket (more could never
/// be admitted).
pub fn max_cost(rule: &Rule) -> u64 {
    match rule.spec.cost {
        Cost::Header(_) => rule.spec.max_cost,
        Cost::Fixed(_) => rule.plans().map(|p| p.nominal.capacity()).max().unwrap_or(1).max(rule.spec.max_cost),
    }
}

/// [`max_cost`] for a check under `limit`, Envoy's override of the rule's
/// limits, when there is one: its bucket, or the rule's `max_cost` for a
/// `cost_header` rule; 0 for an override of 0 requests.
pub fn max_cost_under(rule: &Rule, limit: Option<&Plan>) -> u64 {
    match limit {
        None => max_cost(rule),
        Some(p) if p.nominal.capacity() == 0 => 0,
        Some(p) => match rule.spec.cost {
            Cost::Header(_) => rule.spec.max_cost,
            Cost::Fixed(_) => p.nominal.capacity(),
        },
    }
}

/// Whether `rule`'s `exempt` names the client the key parts in `key`
/// describe: the rule never applies to it, whatever it asks (Envoy's
/// `ShouldRateLimit` asks this before refusing a cost past what the rule
/// admits at once). `false` for key parts that do not parse ([`decide`]
/// refuses those).
pub fn exempts(decider: &Decider, rule: &Rule, key: &Map<String, Value>) -> bool {
    if rule.spec.exempt.is_empty() {
        return false;
    }
    KeyValues::parse(decider, rule, key).is_ok_and(|given| {
        let facts = given.facts();
        rule.spec.exempt.contains(facts.client_ip, facts.user, facts.api_key)
    })
}

/// What a caller asks of one rule besides its key.
pub struct Ask<'a> {
    /// Units to spend.
    pub cost: u64,
    /// The tier the caller states for a rule with `tiers` (ignored by a
    /// rule without). `None`: a `header:` tier is read from the key part
    /// of that header, if the rule keys on it; otherwise `default`.
    pub tier: Option<&'a str>,
    /// Limits that replace the rule's, its overrides' and tiers' (Envoy's
    /// per-descriptor `limit`, from [`Rule::envoy_plan`]). They count on a
    /// counter of their own, apart from the rule's for the same key: the
    /// store's state of one set of limits is no state for another.
    pub limit: Option<&'a Plan>,
}

/// Decides `ask.cost` units of `rule` for the key parts in `key` (named as
/// in the rule's key list), counting in the store and the rule's metrics as
/// a proxied request does ([`Decider::decide_one`]). `Err` carries the
/// sentence for the caller.
pub async fn decide<'r>(
    decider: &Decider,
    rule: &'r Rule,
    key: &Map<String, Value>,
    ask: Ask<'r>,
) -> Result<Outcome<'r>, String> {
    let given = KeyValues::parse(decider, rule, key)?;
    let facts = given.facts();
    if !rule.spec.exempt.is_empty() && rule.spec.exempt.contains(facts.client_ip, facts.user, facts.api_key) {
        // The proxy would not count this client under this rule either.
        return Ok(Outcome::exempt());
    }
    let mut bucket = String::with_capacity(64);
    rule.key(&facts, &mut bucket)?;
    let plan = plan_of(decider, rule, &facts, &mut bucket, &ask)?;
    // Bounded by the plan that applies, not the rule's largest: a cost past
    // this key's bucket could never be admitted, whatever `retry_after` said.
    let most = rule.capacity_of(plan);
    if ask.cost > most {
        return Err(format!(
            "\"cost\" must be a whole number from 1 to {most}: the most rule {:?} admits at once for this key.",
            rule.name()
        ));
    }
    Ok(decider.decide_one(rule, plan, bucket, ask.cost).await)
}

/// The limits a check counts under. An override or tier applies as for a
/// proxied request: the key's override first, then the tier the caller
/// states, else the one its tier header's key part gives. Envoy's `limit`
/// replaces them all, on a bucket of its own (`bucket` grows a suffix).
fn plan_of<'r>(
    decider: &Decider,
    rule: &'r Rule,
    facts: &RequestFacts<'_>,
    bucket: &mut String,
    ask: &Ask<'r>,
) -> Result<&'r Plan, String> {
    Ok(match (ask.limit, ask.tier) {
        (Some(plan), _) => {
            // `|` ends the key parts, and `envoy` is no part's tag: no
            // request's key is this one.
            let _ = write!(bucket, "|envoy={}/{}s", plan.nominal.limit, plan.nominal.window / NANOS_PER_SEC);
            decider.cover_idle_horizon(&plan.nominal);
            plan
        }
        (None, Some(tier)) => {
            if let Some(TierSource::Header(h)) = rule.spec.tiers.as_ref().map(|t| &t.source)
                && let Some(keyed) = facts.headers.get(h)
                && keyed.as_bytes() != tier.as_bytes()
            {
                // The proxy reads both from one header: they never differ.
                return Err(format!(
                    "The tier {tier:?} contradicts key part \"header:{h}\", which gives rule {:?} its tier.",
                    rule.name()
                ));
            }
            rule.plan_stated(bucket, Some(tier.as_bytes()))
        }
        (None, None) => rule.plan_for(bucket, facts),
    })
}

/// The values a check gave for its rule's key parts, owned, from which
/// the [`RequestFacts`] the rule's key function reads are borrowed.
struct KeyValues {
    method: Method,
    path: String,
    query: Option<String>,
    route: Option<String>,
    headers: HeaderMap,
    client: IpAddr,
    client_ip: IpAddr,
    user: Option<Vec<u8>>,
    api_key: Option<Vec<u8>>,
    client_cert: Option<Vec<u8>>,
}

impl KeyValues {
    /// Reads one value per key part of `rule` from `given`, spelled as in
    /// the rule's `key` list. `Err` for a part without a value, a value the
    /// proxy could never see (an empty one, an invalid header value), or a
    /// name the rule does not key on.
    fn parse(decider: &Decider, rule: &Rule, given: &Map<String, Value>) -> Result<KeyValues, String> {
        let unspecified = IpAddr::from([0, 0, 0, 0]);
        let mut v = KeyValues {
            method: Method::GET,
            path: "/".into(),
            query: None,
            route: None,
            headers: HeaderMap::new(),
            client: unspecified,
            client_ip: unspecified,
            user: None,
            api_key: None,
            client_cert: None,
        };
        for name in given.keys() {
            if !rule.spec.key.iter().any(|p| part_named(p, name)) {
                return Err(format!(
                    "Rule {:?} does not key on {name:?}; its key parts are {}.",
                    rule.name(),
                    parts_list(rule)
                ));
            }
        }
        for part in &rule.spec.key {
            let spelled = part.describe();
            let value = given.iter().find(|(k, _)| part_named(part, k)).map(|(_, v)| v);
            let value = match value {
                Some(Value::String(s)) if !s.is_empty() || *part == KeyPart::Route => s.as_str(),
                Some(Value::String(_)) => return Err(format!("Key part {spelled:?} must not be empty.")),
                Some(_) => return Err(format!("Key part {spelled:?} must be a string.")),
                None => {
                    return Err(format!(
                        "Key part {spelled:?} is missing: rule {:?} keys on {}.",
                        rule.name(),
                        parts_list(rule)
                    ));
                }
            };
            v.set(decider, part, value)?;
        }
        Ok(v)
    }

    /// Sets the value of one key part, as the proxy would see it.
    fn set(&mut self, decider: &Decider, part: &KeyPart, value: &str) -> Result<(), String> {
        match part {
            KeyPart::Ip => {
                let ip: IpAddr =
                    value.parse().map_err(|_| format!("Key part \"ip\": {value:?} is not an IP address."))?;
                // `exempt` compares the client as the proxy sees it.
                let ip = crate::wire::client::canonical(ip);
                self.client_ip = ip;
                self.client = crate::wire::client::key_addr(ip, decider.ipv6_prefix());
            }
            KeyPart::User => self.user = Some(value.as_bytes().to_vec()),
            KeyPart::ApiKey => self.api_key = Some(value.as_bytes().to_vec()),
            KeyPart::ClientCert => self.client_cert = Some(value.as_bytes().to_vec()),
            KeyPart::Route => self.route = Some(value.to_string()),
            KeyPart::Method => {
                self.method = Method::from_bytes(value.as_bytes())
                    .map_err(|_| format!("Key part \"method\": {value:?} is not an HTTP method."))?;
            }
            KeyPart::Path => {
                // Canonical, as the proxy keys a request's path.
                self.path = crate::wire::normalize::path(value, decider.normalization())
                    .map_err(|e| format!("Key part \"path\": {}", e.reason()))?
                    .into_owned();
            }
            KeyPart::Header(h) => {
                let hv = HeaderValue::from_str(value)
                    .map_err(|_| format!("Key part {:?}: the value is not a valid header value.", part.describe()))?;
                self.headers.insert(HeaderName::clone(h), hv);
            }
            KeyPart::Query(q) => {
                // Encoded so that the key function's form decoding gives
                // back exactly the value given.
                let query = self.query.get_or_insert_with(String::new);
                if !query.is_empty() {
                    query.push('&');
                }
                form_encode(query, q.as_bytes());
                query.push('=');
                form_encode(query, value.as_bytes());
            }
        }
        Ok(())
    }

    fn facts(&self) -> RequestFacts<'_> {
        RequestFacts {
            method: &self.method,
            path: &self.path,
            query: self.query.as_deref(),
            host: None,
            route: self.route.as_deref().map(|r| (r, "")),
            headers: &self.headers,
            client: self.client,
            client_ip: self.client_ip,
            user: self.user.as_deref(),
            api_key: self.api_key.as_deref(),
            // JWT claims are the proxy's: a check carries no token.
            tier_claim: None,
            client_cert: self.client_cert.as_deref(),
        }
    }
}

/// Whether `name` (from a check's `key` object) names `part`: its spelling
/// in the rules file; a header's name in any case.
fn part_named(part: &KeyPart, name: &str) -> bool {
    match part {
        KeyPart::Header(h) => name.get(..7).zip(name.get(7..)).is_some_and(|(tag, header)| {
            tag.eq_ignore_ascii_case("header:") && header.eq_ignore_ascii_case(h.as_str())
        }),
        other => other.describe() == name,
    }
}

fn parts_list(rule: &Rule) -> String {
    rule.spec.key.iter().map(|p| format!("{:?}", p.describe())).collect::<Vec<_>>().join(", ")
}

/// Percent-encodes every byte but ASCII letters and digits.
fn form_encode(out: &mut String, value: &[u8]) {
    for &b in value {
        if b.is_ascii_alphanumeric() {
            out.push(b as char);
        } else {
            // `write!` to a String cannot fail.
            let _ = write!(out, "%{b:02X}");
        }
    }
}
