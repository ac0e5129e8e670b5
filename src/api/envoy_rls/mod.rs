//! `[listen] envoy_rls`: Envoy's rate limit service
//! (`envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`) over
//! gRPC, so Envoy's and Istio's ratelimit filters can use tollgate's rules
//! and store.
//!
//! Each descriptor of a request is mapped to a rule by the `[[envoy]]`
//! entries of the rules files ([`crate::config::EnvoyMapping`]) and decided
//! as the decision API decides a check ([`crate::api::decision::decide`]): the
//! same bucket key as the proxy, the same store, metrics and `on_error`.
//! Descriptors are decided one after the other, each spending its own
//! counter whatever the others answer (as Envoy's own ratelimit service
//! does). A descriptor no entry covers is `OK` with no limit. A covered
//! descriptor's `limit` (Envoy's override) replaces the rule's limits, on a
//! counter of its own per override ([`crate::api::decision::Ask::limit`]).
//!
//! The gRPC server is tonic's generated service run on hyper's HTTP/2
//! server (the one the proxy uses), not tonic's transport: no second HTTP
//! stack.

pub mod proto;

use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::api::decision::Ask;
use crate::limit::decide::Decider;
use crate::limit::rules::RuleReport;
use crate::limit::rules::{Plan, Rule, RuleSet};
use proto::envoy::config::core::v3::HeaderValue;
use proto::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus, RateLimit, rate_limit::Unit};
use proto::envoy::service::ratelimit::v3::rate_limit_service_server::{RateLimitService, RateLimitServiceServer};
use proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};

/// Connections the listener serves at once (Envoy keeps a few per worker).
const MAX_CONNECTIONS: usize = 1024;

/// Descriptors decided per request: Envoy sends one per rate limit action,
/// a handful; more is a misuse, refused rather than served at length.
const MAX_DESCRIPTORS: usize = 64;

/// Entries per descriptor: Envoy's actions make one entry each, a handful.
/// With [`MAX_DESCRIPTORS`] this bounds the matching work of one request.
const MAX_ENTRIES: usize = 32;

/// The largest request message: a request at both bounds above with long
/// values fits; tonic's default (4 MiB) would let one request hold that
/// much memory per stream.
const MAX_MESSAGE_BYTES: usize = 64 * 1024;

/// The rate limit service: the proxy's rules and store.
pub struct Rls {
    decider: Arc<Decider>,
}

/// Accepts gRPC connections until the task is aborted (at shutdown).
pub async fn serve(listener: TcpListener, decider: Arc<Decider>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let service = RateLimitServiceServer::new(Rls { decider }).max_decoding_message_size(MAX_MESSAGE_BYTES);
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    // Pings free the slot of an Envoy that went away without closing.
    builder
        .timer(TokioTimer::new())
        .max_concurrent_streams(256)
        .keep_alive_interval(Some(Duration::from_secs(30)))
        .keep_alive_timeout(Duration::from_secs(10));
    loop {
        // Over the bound, the connection is closed: Envoy counts the
        // failure and applies its `failure_mode_deny`.
        let (stream, permit) = crate::api::accept::next(&listener, &slots).await;
        let svc = TowerToHyperService::new(service.clone());
        let conn = builder.serve_connection(TokioIo::new(stream), svc);
        tokio::spawn(async move {
            let _ = conn.await;
            drop(permit);
        });
    }
}

#[tonic::async_trait]
impl RateLimitService for Rls {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        let req = request.into_inner();
        within_bounds(&req)?;
        let rules = self.decider.rules().load();
        let found = find(&rules, &req)?;
        let mut answer =
            Answer { over: false, statuses: Vec::with_capacity(found.len()), reports: Vec::new(), retry_after: 0 };
        for (d, found) in req.descriptors.iter().zip(&found) {
            // 0 is proto3's "not set": one hit. A descriptor's own
            // hits_addend overrides the request's.
            let cost = d.hits_addend.unwrap_or(u64::from(req.hits_addend)).max(1);
            let status = match found {
                // As Envoy's own service answers a descriptor it has no
                // limit for.
                None => DescriptorStatus { code: Code::Ok as i32, ..Default::default() },
                Some(found) => self.decide(found, cost, &mut answer).await,
            };
            answer.statuses.push(status);
        }
        Ok(tonic::Response::new(RateLimitResponse {
            overall_code: if answer.over { Code::OverLimit } else { Code::Ok } as i32,
            statuses: answer.statuses,
            response_headers_to_add: response_headers(&answer.reports, answer.retry_after),
            ..Default::default()
        }))
    }
}

/// A descriptor's rule, its key values, tier and limit override.
type Found<'r> = (&'r Rule, serde_json::Map<String, serde_json::Value>, Option<&'r str>, Option<Plan>);

/// What a request's descriptors add up to.
struct Answer<'r> {
    /// An enforced rule refuses one of them.
    over: bool,
    statuses: Vec<DescriptorStatus>,
    reports: Vec<RuleReport<'r>>,
    retry_after: u64,
}

/// Envoy's own service refuses these requests the same way.
fn within_bounds(req: &RateLimitRequest) -> Result<(), tonic::Status> {
    if req.domain.is_empty() {
        return Err(tonic::Status::invalid_argument("domain must not be empty"));
    }
    if req.descriptors.is_empty() || req.descriptors.len() > MAX_DESCRIPTORS {
        return Err(tonic::Status::invalid_argument(format!("a request needs 1 to {MAX_DESCRIPTORS} descriptors")));
    }
    if req.descriptors.iter().any(|d| d.entries.len() > MAX_ENTRIES) {
        return Err(tonic::Status::invalid_argument(format!("a descriptor has at most {MAX_ENTRIES} entries")));
    }
    Ok(())
}

/// Each descriptor's rule, key values, tier and limit override (`None`:
/// no `[[envoy]]` entry covers it), found before anything is spent: an
/// override that cannot be applied fails the whole call, as it fails
/// Envoy's own service.
fn find<'r>(rules: &'r RuleSet, req: &'r RateLimitRequest) -> Result<Vec<Option<Found<'r>>>, tonic::Status> {
    let mut found = Vec::with_capacity(req.descriptors.len());
    for (i, d) in req.descriptors.iter().enumerate() {
        let unit = match &d.limit {
            Some(o) => Some(unit_of(o.unit).ok_or_else(|| {
                tonic::Status::invalid_argument(format!(
                    "descriptor {i}: the limit override's unit {} is none of SECOND to YEAR",
                    o.unit
                ))
            })?),
            None => None,
        };
        let covered = rules.envoy.iter().find_map(|m| {
            let (key, tier) = m.key_of(&req.domain, d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str())))?;
            Some((&**rules.rules.iter().find(|r| r.name() == m.rule)?, key, tier))
        });
        let Some((rule, key, tier)) = covered else {
            found.push(None);
            continue;
        };
        let limit = match (d.limit, unit) {
            (Some(o), Some((secs, unit))) => {
                if let Some(c) = &rule.spec.calendar
                    && per_period(1, c.period).1 != unit
                {
                    return Err(tonic::Status::invalid_argument(format!(
                        "descriptor {i}: rule {:?} counts per calendar {}: a limit override must be per {}",
                        rule.name(),
                        c.period.as_str(),
                        per_period(1, c.period).1.as_str_name(),
                    )));
                }
                Some(rule.envoy_plan(u64::from(o.requests_per_unit), secs))
            }
            _ => None,
        };
        found.push(Some((rule, key, tier, limit)));
    }
    Ok(found)
}

impl Rls {
    /// Decides `cost` units of one covered descriptor: its status, and
    /// what it adds to `answer`.
    async fn decide<'r>(&self, found: &'r Found<'r>, cost: u64, answer: &mut Answer<'r>) -> DescriptorStatus {
        let (rule, key, tier, limit) = (found.0, &found.1, found.2, found.3.as_ref());
        if cost > crate::api::decision::max_cost_under(rule, limit)
            && !crate::api::decision::exempts(&self.decider, rule, key)
        {
            // More than the rule ever admits at once (with an override of 0
            // requests, anything): over the limit, without spending. Not an
            // error, which Envoy's default `failure_mode_deny = false` would
            // let through.
            answer.over |= rule.enforced();
            return DescriptorStatus {
                code: if rule.enforced() { Code::OverLimit } else { Code::Ok } as i32,
                current_limit: Some(current_limit(rule, limit.unwrap_or(&rule.plan))),
                ..Default::default()
            };
        }
        let o = match crate::api::decision::decide(&self.decider, rule, key, Ask { cost, tier, limit }).await {
            Ok(o) => o,
            Err(why) => {
                // A value the rule cannot key on (empty, an `ip` that is no
                // address): refused, as the proxy answers such a request
                // 400. Not an error, which Envoy's default failure mode
                // would let through.
                tracing::debug!(rule = rule.name(), why, "envoy_rls: descriptor refused");
                answer.over = true;
                return DescriptorStatus { code: Code::OverLimit as i32, ..Default::default() };
            }
        };
        answer.over |= !o.allowed;
        if !o.allowed {
            answer.retry_after = answer.retry_after.max(o.retry_after);
        }
        answer.reports.extend(o.report);
        let code = if o.allowed { Code::Ok } else { Code::OverLimit } as i32;
        let Some(remaining) = o.remaining else {
            // Exempt, or the store failed: no limit was counted.
            return DescriptorStatus { code, ..Default::default() };
        };
        DescriptorStatus {
            code,
            current_limit: Some(current_limit(rule, o.report.map_or(&rule.plan, |r| r.plan))),
            limit_remaining: remaining.min(u64::from(u32::MAX)) as u32,
            // Whole seconds, rounded up as the reset headers are: Envoy's
            // own x-ratelimit-reset reads only the seconds.
            duration_until_reset: Some(prost_types::Duration {
                seconds: crate::limiter::ceil_secs(o.reset_after).min(i64::MAX as u64) as i64,
                nanos: 0,
            }),
            quota: None,
        }
    }
}

/// The rate-limit headers the proxy would send for these rules (its most
/// restrictive one in the `X-RateLimit-*` trio, every one in `RateLimit`),
/// for Envoy to add to the client's response.
fn response_headers(reports: &[RuleReport<'_>], retry_after: u64) -> Vec<HeaderValue> {
    if reports.is_empty() {
        return Vec::new();
    }
    let mut headers = http::HeaderMap::new();
    crate::wire::headers::write(&mut headers, reports, crate::wire::headers::most_restrictive(reports));
    if retry_after > 0 {
        crate::wire::headers::write_retry_after(&mut headers, retry_after);
    }
    headers
        .iter()
        .filter_map(|(k, v)| {
            Some(HeaderValue {
                key: k.as_str().to_string(),
                value: v.to_str().ok()?.to_string(),
                raw_value: Vec::new(),
            })
        })
        .collect()
}

/// The rule's limit as Envoy states limits: requests per second, minute,
/// hour, day, week, month (30 days) or year (365 days). A window that is
/// one of those units is reported as is; another window as the rate over
/// the smallest unit that holds it, rounded down but at least 1 (5 per
/// 10 s: 30 per minute; 1 per 366 days: 1 per year).
/// `plan` is the rule's own limits, or the override's or tier's the
/// descriptor was checked against.
/// A calendar rule's limit is per its calendar period, which is Envoy's
/// unit of the same name (its window in nanoseconds is only the longest
/// such period).
fn current_limit(rule: &Rule, plan: &Plan) -> RateLimit {
    let (requests_per_unit, unit) = match rule.spec.calendar.as_ref().map(|c| c.period) {
        Some(period) => per_period(plan.nominal.limit, period),
        None => per_unit(plan.nominal.limit, Duration::from_nanos(plan.nominal.window)),
    };
    RateLimit { name: rule.name().to_string(), requests_per_unit, unit: unit as i32 }
}

/// The length in seconds of a limit override's unit (Envoy's `RateLimitUnit`,
/// whose numbers are those of the response's `Unit`), and that unit; `None`
/// for `UNKNOWN` or a number no unit has.
fn unit_of(unit: i32) -> Option<(u64, Unit)> {
    let unit = Unit::try_from(unit).ok()?;
    let secs = match unit {
        Unit::Unknown => return None,
        Unit::Second => 1,
        Unit::Minute => 60,
        Unit::Hour => 3600,
        Unit::Day => 86_400,
        Unit::Week => 7 * 86_400,
        Unit::Month => 30 * 86_400,
        Unit::Year => 365 * 86_400,
    };
    Some((secs, unit))
}

fn per_period(limit: u64, period: crate::limiter::calendar::Period) -> (u32, Unit) {
    let unit = match period {
        crate::limiter::calendar::Period::Day => Unit::Day,
        crate::limiter::calendar::Period::Week => Unit::Week,
        crate::limiter::calendar::Period::Month => Unit::Month,
    };
    // 0 only for an override of 0 requests.
    (limit.min(u64::from(u32::MAX)) as u32, unit)
}

fn per_unit(limit: u64, window: Duration) -> (u32, Unit) {
    const UNITS: [(u64, Unit); 7] = [
        (1, Unit::Second),
        (60, Unit::Minute),
        (3600, Unit::Hour),
        (86_400, Unit::Day),
        (7 * 86_400, Unit::Week),
        (30 * 86_400, Unit::Month),
        (365 * 86_400, Unit::Year),
    ];
    let window = window.as_nanos().max(1);
    let (secs, unit) =
        UNITS.iter().copied().find(|(s, _)| u128::from(*s) * 1_000_000_000 >= window).unwrap_or(UNITS[6]);
    let n = u128::from(limit) * u128::from(secs) * 1_000_000_000 / window;
    // At least 1 for a rate that rounds down to nothing; 0 only for an
    // override of 0 requests.
    let floor = u128::from(limit > 0);
    (n.clamp(floor, u128::from(u32::MAX)) as u32, unit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_stated_in_envoys_units() {
        let s = Duration::from_secs;
        assert_eq!(per_unit(100, s(1)), (100, Unit::Second));
        assert_eq!(per_unit(3, s(60)), (3, Unit::Minute));
        assert_eq!(per_unit(5, s(10)), (30, Unit::Minute));
        assert_eq!(per_unit(5, Duration::from_millis(250)), (20, Unit::Second));
        assert_eq!(per_unit(7, s(90)), (280, Unit::Hour));
        assert_eq!(per_unit(1000, s(86_400)), (1000, Unit::Day));
        assert_eq!(per_unit(2, s(3 * 86_400)), (4, Unit::Week));
        assert_eq!(per_unit(1, s(366 * 86_400)), (1, Unit::Year));
        assert_eq!(per_unit(1_000_000_000, Duration::from_millis(1)), (u32::MAX, Unit::Second));
    }

    #[test]
    fn override_units_are_envoys_and_unknown_is_none() {
        assert_eq!(unit_of(Unit::Second as i32), Some((1, Unit::Second)));
        assert_eq!(unit_of(Unit::Week as i32), Some((7 * 86_400, Unit::Week)));
        assert_eq!(unit_of(Unit::Month as i32), Some((30 * 86_400, Unit::Month)));
        assert_eq!(unit_of(Unit::Year as i32), Some((365 * 86_400, Unit::Year)));
        assert_eq!(unit_of(Unit::Unknown as i32), None);
        assert_eq!(unit_of(8), None);
        assert_eq!(unit_of(-1), None);
        // Each unit is stated back as itself; 0 requests as 0.
        assert_eq!(per_unit(7, Duration::from_secs(3600)), (7, Unit::Hour));
        assert_eq!(per_unit(0, Duration::from_secs(60)), (0, Unit::Minute));
    }

    #[test]
    fn calendar_limits_are_per_their_period() {
        use crate::limiter::calendar::Period;
        assert_eq!(per_period(1000, Period::Month), (1000, Unit::Month));
        assert_eq!(per_period(70, Period::Week), (70, Unit::Week));
        assert_eq!(per_period(10, Period::Day), (10, Unit::Day));
    }
}
