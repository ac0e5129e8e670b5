//! The admin listener: `/metrics`, `/healthz`, `/healthz/store`, `/readyz`,
//! `/rules`.
//!
//! `/readyz` says whether this instance should get traffic: it answers 503
//! on a store outage only when `[store] on_error` is `deny`. With `allow` or
//! `local` tollgate still serves without its store, and a readiness probe
//! failing on every replica at once would take them all out of a Kubernetes
//! Service and stop all traffic. `/healthz/store` reports the store itself,
//! for dashboards and alerts.
//!
//! Keep it on a private address: `/rules` shows the whole rule set.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use serde_json::json;

use crate::config::OnError;
use crate::error::json_response;
use crate::proxy::Proxy;
use crate::reload::Reloader;
use crate::store::Store;

/// How long `/readyz` waits for the store to answer a ping.
const READY_PING_TIMEOUT: Duration = Duration::from_millis(500);

/// What the admin endpoints read.
pub struct Admin {
    pub proxy: Arc<Proxy>,
    pub reloader: Arc<Reloader>,
}

impl Admin {
    /// Answers one admin request.
    pub async fn handle<B>(&self, req: Request<B>) -> Response<Full<Bytes>> {
        if req.method() != Method::GET && req.method() != Method::HEAD {
            return json_response(
                StatusCode::METHOD_NOT_ALLOWED,
                &json!({"error": "method_not_allowed", "message": "The admin endpoints answer GET only."}),
            );
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
            // What `tollgate check --running` compares a new main file with.
            "/config" => {
                let sections: serde_json::Map<String, serde_json::Value> =
                    crate::reload::restart_fingerprints(&self.reloader.running())
                        .into_iter()
                        .map(|(name, print)| (name.to_string(), print.into()))
                        .collect();
                json_response(StatusCode::OK, &json!({ "restart_sections": sections }))
            }
            _ => json_response(
                StatusCode::NOT_FOUND,
                &json!({"error": "not_found", "message": "Admin endpoints: /metrics /healthz /healthz/store /readyz /rules /config."}),
            ),
        }
    }

    /// Pings the store: `Err` carries why it did not answer.
    async fn ping(&self) -> Result<(), String> {
        match tokio::time::timeout(READY_PING_TIMEOUT, self.proxy.store.ping()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("the store did not answer a ping within {READY_PING_TIMEOUT:?}")),
        }
    }

    /// `/healthz/store`: 200 while the store answers, 503 when it does not.
    async fn store_health(&self) -> Response<Full<Bytes>> {
        let backend = self.proxy.store.backend();
        match self.ping().await {
            Ok(()) => json_response(StatusCode::OK, &json!({"status": "up", "store": backend})),
            Err(reason) => json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                &json!({"status": "down", "store": backend, "reason": reason}),
            ),
        }
    }

    /// `/readyz`: not ready only when the store is down and requests
    /// would be refused for it (`on_error = "deny"`).
    async fn ready(&self) -> Response<Full<Bytes>> {
        let backend = self.proxy.store.backend();
        let policy = self.proxy.default_on_error();
        match self.ping().await {
            Ok(()) => json_response(StatusCode::OK, &json!({"status": "ready", "store": backend})),
            Err(reason) if policy == OnError::Deny => json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                &json!({"status": "not_ready", "store": backend, "reason": reason}),
            ),
            Err(reason) => json_response(
                StatusCode::OK,
                &json!({"status": "ready", "store": backend, "store_down": reason, "on_error": format!("{policy:?}").to_lowercase()}),
            ),
        }
    }

    fn rules(&self) -> Response<Full<Bytes>> {
        let set = self.proxy.rules.load();
        let status = self.reloader.status.lock().map(|s| s.clone()).unwrap_or_else(|p| p.into_inner().clone());
        let rules: Vec<_> = set
            .rules
            .iter()
            .map(|r| {
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
                });
                // Only for rules that have them: the common rule stays as it was.
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
                if let Some(t) = &s.tiers {
                    let mut tiers = serde_json::Map::new();
                    for (name, limit, burst) in &t.tiers {
                        tiers.insert(name.clone(), json!({"limit": limit, "burst": burst}));
                    }
                    tiers.insert("default".into(), json!({"limit": t.default.0, "burst": t.default.1}));
                    rule["tier"] = t.source.describe().into();
                    rule["tiers"] = tiers.into();
                }
                rule
            })
            .collect();
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

fn epoch_secs(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}
