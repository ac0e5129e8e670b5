//! `/blocks` on the admin listener: an operator blocks a key now, lifts a
//! block, and lists the penalty box, without editing a rules file.
//!
//! - `POST /blocks` `{"rule": "login", "key": "login|ip=203.0.113.7",
//!   "for": "1h", "reason": "credential stuffing"}`: the key (as `explain`
//!   and `/top` show it; the rule's name and `|` may be left out) is
//!   refused by that rule, on every instance sharing the store, until the
//!   time is up, whatever its counters say; the rule need not have a
//!   `penalty`, but must be enforced (a shadow rule never refuses).
//!   Blocking a key already in the box sets its time anew.
//! - `DELETE /blocks?rule=&key=[&reason=]`: the key is let out (a penalty
//!   too), its refusals towards a penalty forgotten.
//! - `GET /blocks[?rule=&n=]`: what is in the box, penalties and blocks.
//!
//! Every change is logged at `warn` with its reason. The admin listener
//! has no authentication: anyone who reaches it can block any key, which
//! is why it must listen on a private address (docs/operations.md).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Method, Response, StatusCode};
use http_body_util::Full;
use serde::Deserialize;
use serde_json::json;

use super::admin::Admin;
use crate::limit::rules::{Rule, form_decode};
use crate::limiter::ceil_secs;
use crate::store::Store as _;
use crate::wire::error::{AdminError, json_response};

/// The shortest and longest block.
const MIN_BLOCK: Duration = Duration::from_secs(1);
const MAX_BLOCK: Duration = Duration::from_secs(366 * 86_400);
/// The longest reason kept: it is stored with the entry on every instance.
const MAX_REASON: usize = 500;
/// Keys listed per rule unless `n` says otherwise.
const DEFAULT_LISTED: usize = 100;

/// `POST /blocks`' body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BlockRequest {
    rule: String,
    key: String,
    #[serde(rename = "for")]
    duration: String,
    reason: String,
}

impl Admin {
    /// `/blocks`, by method.
    pub(super) async fn blocks(&self, method: &Method, query: Option<&str>, body: Bytes) -> Response<Full<Bytes>> {
        let answer = match *method {
            Method::POST => self.block(&body).await,
            Method::DELETE => self.unblock(query).await,
            _ => self.list_blocks(query).await,
        };
        answer.unwrap_or_else(AdminError::into_response)
    }

    async fn block(&self, body: &[u8]) -> Result<Response<Full<Bytes>>, AdminError> {
        let req: BlockRequest = serde_json::from_slice(body).map_err(|e| {
            AdminError::BadBlock(format!(
                "the body must be {{\"rule\": ..., \"key\": ..., \"for\": \"1h\", \"reason\": ...}}: {e}"
            ))
        })?;
        let ttl = crate::config::parse_duration(&req.duration)
            .map_err(|e| AdminError::BadBlock(format!("for {:?} is not a duration ({e})", req.duration)))?;
        if !(MIN_BLOCK..=MAX_BLOCK).contains(&ttl) {
            return Err(AdminError::BadBlock("for must be between 1s and 366d".into()));
        }
        let reason = req.reason.trim();
        if reason.is_empty() || reason.len() > MAX_REASON {
            return Err(AdminError::BadBlock(format!("reason must say why, in 1 to {MAX_REASON} bytes")));
        }
        let set = self.proxy.rules().load();
        let rule = find_rule(&set.rules, &req.rule)?;
        if !rule.enforced() {
            return Err(AdminError::BadBlock(format!(
                "rule {:?} is in shadow mode: it never refuses, so a block there would refuse nothing",
                rule.name()
            )));
        }
        let key = bucket_key(rule, &req.key)?;
        self.proxy
            .store()
            .block(rule.key_prefix(), &key, rule.spec.algorithm, ttl, reason)
            .await
            .map_err(store_failed)?;
        tracing::warn!(rule = %rule.name(), key, duration = %req.duration, reason, "key blocked through the admin API");
        let expires_at = epoch_secs(SystemTime::now() + ttl);
        Ok(json_response(
            StatusCode::OK,
            &json!({"rule": rule.name(), "key": key, "expires_in_seconds": ttl.as_secs(), "expires_at": expires_at, "reason": reason, "source": "api"}),
        ))
    }

    async fn unblock(&self, query: Option<&str>) -> Result<Response<Full<Bytes>>, AdminError> {
        let params = params(query);
        let rule = params.get("rule").ok_or_else(|| AdminError::BadBlock("rule= is required".into()))?;
        let key = params.get("key").ok_or_else(|| AdminError::BadBlock("key= is required".into()))?;
        let reason = params.get("reason").map_or("(none given)", String::as_str);
        let set = self.proxy.rules().load();
        let rule = find_rule(&set.rules, rule)?;
        let key = bucket_key(rule, key)?;
        let was_in =
            self.proxy.store().unblock(rule.key_prefix(), &key, rule.spec.algorithm).await.map_err(store_failed)?;
        if !was_in {
            return Err(AdminError::NotBlocked { rule: rule.name().to_string(), key });
        }
        tracing::warn!(rule = %rule.name(), key, reason, "key let out of the penalty box through the admin API");
        Ok(json_response(StatusCode::OK, &json!({"rule": rule.name(), "key": key, "lifted": true})))
    }

    async fn list_blocks(&self, query: Option<&str>) -> Result<Response<Full<Bytes>>, AdminError> {
        let params = params(query);
        let n = match params.get("n") {
            None => DEFAULT_LISTED,
            Some(given) => match given.parse::<usize>() {
                Ok(n) if (1..=crate::store::redis::MAX_LISTED).contains(&n) => n,
                _ => return Err(AdminError::BadCount { given: given.clone(), max: crate::store::redis::MAX_LISTED }),
            },
        };
        let set = self.proxy.rules().load();
        let rules: Vec<&Rule> = match params.get("rule") {
            Some(name) => vec![find_rule(&set.rules, name)?],
            None => set.rules.iter().map(|r| &**r).collect(),
        };
        let (blocks, totals) = self.boxed(&rules, n).await?;
        Ok(json_response(
            StatusCode::OK,
            &json!({"store": self.proxy.store().backend(), "blocks": blocks, "rules": totals, "max_listed_per_rule": n}),
        ))
    }

    /// The penalty box of each of `rules`, at most `n` keys each: the
    /// entries, and each rule's total.
    pub(super) async fn boxed(
        &self,
        rules: &[&Rule],
        n: usize,
    ) -> Result<(Vec<serde_json::Value>, Vec<serde_json::Value>), AdminError> {
        let now = SystemTime::now();
        let (mut blocks, mut totals) = (Vec::new(), Vec::new());
        for rule in rules {
            let (listed, total) =
                self.proxy.store().boxed(rule.key_prefix(), rule.spec.algorithm, n).await.map_err(store_failed)?;
            totals.push(json!({"rule": rule.name(), "listed": listed.len(), "total": total}));
            blocks.extend(listed.into_iter().map(|e| {
                let left = Duration::from_nanos(e.left);
                json!({
                    "rule": rule.name(),
                    "key": e.key,
                    "expires_in_seconds": ceil_secs(e.left),
                    "expires_at": epoch_secs(now + left),
                    "reason": e.source.reason(),
                    "source": e.source.as_str(),
                })
            }));
        }
        Ok((blocks, totals))
    }
}

fn find_rule<'r>(rules: &'r [std::sync::Arc<Rule>], name: &str) -> Result<&'r Rule, AdminError> {
    rules.iter().map(|r| &**r).find(|r| r.name() == name).ok_or_else(|| AdminError::UnknownRule(name.to_string()))
}

/// The bucket key `key` names in `rule`: as `explain` and `/top` show it,
/// or without the rule's name and `|` in front.
fn bucket_key(rule: &Rule, key: &str) -> Result<String, AdminError> {
    if key.is_empty() || key.len() > 4096 || key.contains(['{', '}']) {
        return Err(AdminError::BadBlock(format!(
            "key {key:?} is not a bucket key: write it as tollgate explain and /top show it"
        )));
    }
    Ok(if key.starts_with(rule.key_prefix()) { key.to_string() } else { format!("{}{key}", rule.key_prefix()) })
}

fn store_failed(e: crate::store::StoreError) -> AdminError {
    AdminError::StoreFailed(e.to_string())
}

/// A query's parameters, decoded as forms are.
fn params(query: Option<&str>) -> std::collections::HashMap<String, String> {
    let decode = |s: &str| String::from_utf8_lossy(&form_decode(s)).into_owned();
    query
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (decode(k), decode(v))
        })
        .collect()
}

fn epoch_secs(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}
