//! The admin listener: `/` (the dashboard), `/metrics`, `/healthz`,
//! `/healthz/store`, `/readyz`, `/rules`, `/upstreams`, `/config`, `/top`,
//! and `/blocks` (see [`super::blocks`]).
//!
//! `/readyz` says whether this instance should get traffic: it answers 503
//! on a store outage only when `[store] on_error` is `deny` and no node of
//! the store answers. With `allow` or `local` tollgate still serves without
//! its store, and a readiness probe failing on every replica at once would
//! take them all out of a Kubernetes Service and stop all traffic. With
//! `deny` and one Redis node down, only the keys that node holds are
//! refused, and every replica sees the same node down: taking them all out
//! would refuse every key instead. `/healthz/store` reports the store
//! itself, for dashboards and alerts: 503 when any node does not answer,
//! with the nodes in `nodes_down`. From SIGTERM on it answers 503 whatever the
//! store (lame duck): load balancers take the instance out while its
//! listeners still serve for `listen.shutdown_delay`.
//!
//! Keep it on a private address: `/rules` shows the whole rule set, and
//! `/blocks` blocks any key, with no authentication.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use serde_json::json;

use crate::config::{Cost, OnError};
use crate::ops::reload::Reloader;
use crate::proxy::Proxy;
use crate::store::Store;
use crate::wire::error::{AdminError, json_response};

/// The largest body the admin listener reads (a `/blocks` request).
const MAX_BODY: usize = 64 * 1024;

/// How long `/readyz` waits for the store to answer a ping.
const READY_PING_TIMEOUT: Duration = Duration::from_millis(500);

/// Why the store did not answer a ping.
struct Outage {
    reason: String,
    /// The nodes that did not answer (none named for the memory store, or
    /// when the whole ping timed out).
    nodes_down: Vec<String>,
    /// The nodes that did answer.
    nodes_up: NodesUp,
    /// No node answered.
    whole: bool,
}

/// The nodes that answered a ping (none named for the memory store).
type NodesUp = Vec<String>;

/// What the admin endpoints read.
pub struct Admin {
    pub proxy: Arc<Proxy>,
    pub reloader: Arc<Reloader>,
    /// Set when the shutdown begins: `/readyz` answers 503 from then on.
    pub stopping: Arc<AtomicBool>,
}

impl Admin {
    /// Answers one admin request.
    pub async fn handle<B>(&self, req: Request<B>) -> Response<Full<Bytes>>
    where
        B: hyper::body::Body,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let blocks = req.uri().path() == "/blocks";
        let changes = blocks && (req.method() == Method::POST || req.method() == Method::DELETE);
        if req.method() != Method::GET && req.method() != Method::HEAD && !changes {
            return json_response(
                StatusCode::METHOD_NOT_ALLOWED,
                &json!({"error": "method_not_allowed", "message": "The admin endpoints answer GET only (and /blocks POST and DELETE)."}),
            );
        }
        if blocks {
            let (parts, body) = req.into_parts();
            let body = match http_body_util::BodyExt::collect(http_body_util::Limited::new(body, MAX_BODY)).await {
                Ok(collected) => collected.to_bytes(),
                Err(_) => {
                    return AdminError::BadBlock(format!("the body could not be read, or is over {MAX_BODY} bytes"))
                        .into_response();
                }
            };
            return self.blocks(&parts.method, parts.uri.query(), body).await;
        }
        match req.uri().path() {
            "/metrics" => {
                self.proxy.refresh_gauges();
                let mut resp = Response::new(Full::new(Bytes::from(self.proxy.metrics.render())));
                resp.headers_mut()
                    .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
                resp
            }
            "/healthz" => json_response(StatusCode::OK, &json!({"status": "ok"})),
            "/healthz/store" => self.store_health().await,
            "/readyz" => self.ready().await,
            "/rules" => self.rules(),
            "/upstreams" => self.upstreams(),
            "/" | "/dashboard" => crate::ops::dashboard::page(),
            "/top" => self.top(req.uri().query()).await.unwrap_or_else(AdminError::into_response),
            // What `tollgate check --running` compares a new main file with.
            "/config" => {
                let sections: serde_json::Map<String, serde_json::Value> =
                    crate::ops::reload::restart_fingerprints(&self.reloader.running())
                        .into_iter()
                        .map(|(name, print)| (name.to_string(), print.into()))
                        .collect();
                json_response(StatusCode::OK, &json!({ "restart_sections": sections }))
            }
            _ => json_response(
                StatusCode::NOT_FOUND,
                &json!({"error": "not_found", "message": "Admin endpoints: / (the dashboard) /metrics /healthz /healthz/store /readyz /rules /upstreams /config /top /blocks."}),
            ),
        }
    }

    /// Pings the store, node by node: the nodes that answered, or `Err`
    /// saying why (some of) it did not answer.
    async fn ping(&self) -> Result<NodesUp, Outage> {
        let whole = |reason: String| Outage { reason, nodes_down: Vec::new(), nodes_up: Vec::new(), whole: true };
        let store = self.proxy.store();
        let survey = async {
            match store.survey().await {
                None => store.ping().await.map(|()| Vec::new()).map_err(|e| whole(e.to_string())),
                Some((up, down)) if down.is_empty() => Ok(up),
                Some((up, down)) => Err(Outage {
                    reason: down.iter().map(|(node, e)| format!("{node}: {e}")).collect::<Vec<_>>().join("; "),
                    nodes_down: down.into_iter().map(|(node, _)| node).collect(),
                    whole: up.is_empty(),
                    nodes_up: up,
                }),
            }
        };
        match tokio::time::timeout(READY_PING_TIMEOUT, survey).await {
            Ok(answer) => answer,
            Err(_) => Err(whole(format!("the store did not answer a ping within {READY_PING_TIMEOUT:?}"))),
        }
    }

    /// `/healthz/store`: 200 while every node of the store answers, 503
    /// when one does not (`partial`: some do) or none does (`down`).
    async fn store_health(&self) -> Response<Full<Bytes>> {
        let backend = self.proxy.store().backend();
        match self.ping().await {
            Ok(up) => json_response(StatusCode::OK, &json!({"status": "up", "store": backend, "nodes_up": up})),
            Err(o) => json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                &json!({"status": if o.whole { "down" } else { "partial" }, "store": backend, "reason": o.reason, "nodes_down": o.nodes_down, "nodes_up": o.nodes_up}),
            ),
        }
    }

    /// `/readyz`: not ready only when no node of the store answers and
    /// requests would be refused for it (`on_error = "deny"`).
    async fn ready(&self) -> Response<Full<Bytes>> {
        let backend = self.proxy.store().backend();
        if self.stopping.load(Ordering::Relaxed) {
            return json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                &json!({"status": "not_ready", "store": backend, "reason": "shutting down"}),
            );
        }
        let policy = self.proxy.default_on_error();
        match self.ping().await {
            Ok(_) => json_response(StatusCode::OK, &json!({"status": "ready", "store": backend})),
            Err(o) if o.whole && policy == OnError::Deny => json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                &json!({"status": "not_ready", "store": backend, "reason": o.reason}),
            ),
            Err(o) => json_response(
                StatusCode::OK,
                &json!({"status": "ready", "store": backend, "store_down": o.reason, "nodes_down": o.nodes_down, "on_error": format!("{policy:?}").to_lowercase()}),
            ),
        }
    }

    fn rules(&self) -> Response<Full<Bytes>> {
        let set = self.proxy.rules().load();
        let status = self.reloader.status.lock().clone();
        let rules: Vec<_> = set.rules.iter().map(|r| rule_json(r)).collect();
        json_response(
            StatusCode::OK,
            &json!({
                "rules": rules,
                "files": set.files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>(),
                "loaded_at": epoch_secs(set.loaded_at),
                "reloads": status.reloads,
                "reload_failures": status.failures,
                "last_reload_error": status.last_error,
                "last_reload_error_at": status.last_error_at.map(epoch_secs),
            }),
        )
    }
}

impl Admin {
    /// `/upstreams`: each upstream's servers, in service or not, with what
    /// they have in flight and their counters.
    fn upstreams(&self) -> Response<Full<Bytes>> {
        let upstreams: Vec<_> = self
            .proxy
            .upstream_states()
            .into_iter()
            .map(|(name, servers)| json!({"name": name, "servers": servers}))
            .collect();
        json_response(StatusCode::OK, &json!({ "upstreams": upstreams }))
    }

    /// `/top?rule=NAME&n=20&by=limited`: the `n` heaviest keys of a rule
    /// over the last 30 to 60 seconds, and up to `n` of its keys in the
    /// penalty box; without `rule`, of every rule.
    async fn top(&self, query: Option<&str>) -> Result<Response<Full<Bytes>>, AdminError> {
        let top = self.proxy.top().ok_or(AdminError::TopOff)?;
        let (mut rule, mut n, mut by) = (None, None, None);
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = String::from_utf8_lossy(&crate::limit::rules::form_decode(v)).into_owned();
            match crate::limit::rules::form_decode(k).as_slice() {
                b"rule" => rule = Some(v),
                b"n" => n = Some(v),
                b"by" => by = Some(v),
                _ => {}
            }
        }
        let max = top.capacity();
        let n = match n {
            None => max.min(20),
            Some(given) => match given.parse::<usize>() {
                Ok(n) if (1..=max).contains(&n) => n,
                _ => return Err(AdminError::BadCount { given, max }),
            },
        };
        let by = match by {
            None => crate::limit::top::By::Limited,
            Some(given) => crate::limit::top::By::parse(&given).ok_or(AdminError::BadBy(given))?,
        };
        let set = self.proxy.rules().load();
        let report = |r: &crate::limit::rules::Rule| {
            let report = r.top.as_ref().map(|t| top.report(t, by, n)).unwrap_or_default();
            let keys: Vec<_> =
                report.keys.iter().map(|k| json!({"key": k.key, "count": k.count, "error": k.error})).collect();
            json!({"rule": r.name(), "by": by.as_str(), "window_seconds": report.window.as_secs(), "total": report.total, "capacity": max, "keys": keys})
        };
        let rules: Vec<&crate::limit::rules::Rule> = match &rule {
            Some(name) => {
                vec![
                    set.rules
                        .iter()
                        .map(|r| &**r)
                        .find(|r| r.name() == name)
                        .ok_or(AdminError::UnknownRule(name.clone()))?,
                ]
            }
            None => set.rules.iter().map(|r| &**r).collect(),
        };
        let mut reports: Vec<serde_json::Value> = rules.iter().map(|r| report(r)).collect();
        for (r, report) in rules.iter().zip(&mut reports) {
            // Best effort: a store that does not answer leaves the box out.
            let boxed = self.boxed(std::slice::from_ref(r), n).await.map(|(b, _)| b).unwrap_or_default();
            report["penalty_box"] = boxed.into();
        }
        let body = match rule {
            Some(_) => reports.swap_remove(0),
            None => json!({
                "by": by.as_str(),
                "capacity": max,
                "rules": reports,
            }),
        };
        Ok(json_response(StatusCode::OK, &body))
    }
}

/// One rule as `/rules` shows it.
fn rule_json(r: &crate::limit::rules::Rule) -> serde_json::Value {
    let s = &r.spec;
    let mut rule = json!({
        "name": s.name,
        "source": format!("{}:{}", s.source.display(), s.line),
        "algorithm": s.algorithm.as_str(),
        "limit": s.limit,
        "window_seconds": s.window.as_secs_f64(),
        "burst": s.burst,
        "key": s.key.iter().map(|k| k.describe()).collect::<Vec<_>>(),
        "mode": format!("{:?}", s.mode).to_lowercase(),
        "throttle": format!("{:?}", s.throttle),
        // Decisions since start (or since the rule was first
        // loaded under this name): the dashboard's rates.
        "allowed": r.counters.allowed.get(),
        "limited": r.counters.limited.get(),
    });
    rule_extras(r, &mut rule);
    rule
}

/// What only some rules have: the common rule's answer stays as it was.
fn rule_extras(r: &crate::limit::rules::Rule, rule: &mut serde_json::Value) {
    let s = &r.spec;
    if let Some(c) = &s.calendar {
        rule["calendar"] = c.period.as_str().into();
        rule["timezone"] = c.timezone.clone().into();
        rule["window_seconds"] = r.window_secs_now().into();
    }
    if !s.overrides.is_empty() {
        rule["overrides"] = s
            .overrides
            .iter()
            .map(|o| json!({"key": o.key, "limit": o.limit, "burst": o.burst, "line": o.line}))
            .collect();
    }
    if let Some(counted) = &s.count_status {
        // As written: numbers, and whole classes as "4xx".
        rule["count_status"] =
            counted.written().into_iter().map(|w| w.parse::<u16>().map_or_else(|_| json!(w), |n| json!(n))).collect();
    }
    if let Some(h) = &s.cost_response_header {
        // What a request reserves until its response says.
        rule["cost_response_header"] = h.as_str().into();
        match &s.cost {
            Cost::Fixed(n) => rule["cost"] = (*n).into(),
            Cost::Header(h) => {
                rule["cost_header"] = h.as_str().into();
                rule["max_cost"] = s.max_cost.into();
            }
        }
    }
    if let Some(u) = &s.quota_unit {
        rule["quota_unit"] = u.as_str().into();
    }
    if let Some(p) = &s.penalty {
        rule["penalty_seconds"] = (p.duration as f64 / 1e9).into();
        rule["penalty_after"] = p.after.into();
    }
    if let Some(t) = &s.tiers {
        let mut tiers = serde_json::Map::new();
        for (name, limit, burst) in &t.tiers {
            tiers.insert(name.clone(), json!({"limit": limit, "burst": burst}));
        }
        tiers.insert("default".into(), json!({"limit": t.default.0, "burst": t.default.1}));
        rule["tier"] = t.source.describe().into();
        rule["tiers"] = tiers.into();
    }
}

fn epoch_secs(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}
