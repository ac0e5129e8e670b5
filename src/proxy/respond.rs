//! The answering phases of [`Proxy::serve`](super::Proxy): `refuse` and
//! `reject` for what tollgate answers itself (every one counted here,
//! under its route), `answered` for the upstream's answer (tunnel, settle,
//! rate-limit headers).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize};

use http::{HeaderValue, Request, Response};
use http_body_util::Either;
use hyper::body::Incoming;
use hyper::upgrade::OnUpgrade;

use super::{Exchange, Proxy, ProxyBody};
use crate::config::Route;
use crate::limit::decide::{Decision, Ruling};
use crate::obs::metrics::RouteCounters;
use crate::proxy::settle::{self, Settling};
use crate::store::{Held, Stamp};
use crate::upstream::forward::{Downstream, RequestBody};
use crate::upstream::pool::UpstreamBody;
use crate::upstream::tunnel;
use crate::wire::error::{self, ProxyError};
use crate::wire::{grpc, headers};

impl Proxy {
    /// The request's route's counters (`none`'s before it has one).
    pub(super) fn counters<'x>(&'x self, x: &'x Exchange<'_>) -> &'x RouteCounters {
        x.route.map_or(&self.no_route, |i| &x.routing.routes[i].1)
    }

    /// Counts a request tollgate answers itself under its route, by
    /// outcome: every refusal is counted here.
    pub(super) fn count(&self, x: &Exchange<'_>, e: &ProxyError) {
        let c = self.counters(x);
        match e {
            ProxyError::Forbidden => &c.denied,
            ProxyError::Limited { .. } | ProxyError::TooManyInFlight { .. } => &c.limited,
            ProxyError::StoreUnavailable { .. } => &c.store_unavailable,
            _ => &c.rejected,
        }
        .inc();
    }

    /// Answers a request tollgate refuses itself (in gRPC's form to a gRPC
    /// request).
    pub(super) fn refuse(&self, req: &Request<Incoming>, x: &Exchange<'_>, e: ProxyError) -> Response<ProxyBody> {
        self.count(x, &e);
        own_answer(e, &x.request_id, grpc::content_type(req.method(), req.headers()).cloned())
    }

    /// Answers a request a rule rejects: 429, or problem+json when the
    /// client asks for it, with the rate-limit headers.
    pub(super) fn reject(&self, req: &Request<Incoming>, x: &Exchange<'_>, d: &Decision<'_>) -> Response<ProxyBody> {
        let Ruling::Limited { rule: at, report, retry_after_secs } = d.ruling else {
            return self.refuse(req, x, ProxyError::StoreUnavailable { retry_after_seconds: 1 });
        };
        let (rule, limit) = (d.pending[at].rule, d.pending[at].plan.nominal.limit);
        tracing::debug!(rule = rule.name(), key = %d.pending[at].key, client = %x.client_ip, "rate limited");
        let err = if rule.plan.nominal.algorithm.holds() {
            ProxyError::TooManyInFlight { rule: rule.name().to_string(), limit }
        } else {
            ProxyError::Limited {
                rule: rule.name().to_string(),
                limit,
                window_seconds: rule.window_secs_now(),
                retry_after_seconds: retry_after_secs,
            }
        };
        self.count(x, &err);
        if let Some(content_type) = grpc::content_type(req.method(), req.headers()) {
            let mut resp = err.into_grpc_response(&x.request_id, content_type.clone()).map(Either::Right);
            headers::write(resp.headers_mut(), &d.reports, report);
            return resp;
        }
        let problem = error::accepts_problem(req.headers());
        if let [only] = d.reports.as_slice()
            && let Some(head) = &only.plan.reject_head
            && !problem
        {
            // The flood's case: one rule, a head prebuilt for it.
            return err.into_limited_response(&x.request_id, head, only).map(Either::Right);
        }
        let mut resp = if problem {
            // Every enforced rule this request is over.
            let violated: Vec<&str> = d.violated().collect();
            err.into_problem_response(&x.request_id, &violated)
        } else {
            err.into_response(&x.request_id)
        }
        .map(Either::Right);
        headers::write(resp.headers_mut(), &d.reports, report);
        resp
    }

    /// What [`UpstreamClient::forward`] needs to know of the client and
    /// the route.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn downstream<'x>(
        &self,
        x: &'x Exchange<'_>,
        route: &Route,
        version: http::Version,
        path: Option<String>,
        upgrade: Option<HeaderValue>,
        bytes_in: Option<Arc<AtomicU64>>,
        chosen: Option<&'x AtomicUsize>,
    ) -> Downstream<'x> {
        Downstream {
            peer: x.peer,
            client_ip: x.client_ip,
            host: x.host.as_ref().map(|h| h.name.as_str()),
            host_header: x.host.as_ref().and_then(|h| h.rewrite.clone()),
            path,
            max_body: route.max_body,
            buffer_body: route.buffer_body,
            body_read_timeout: self.body_read_timeout,
            // HTTP/2's streams share their connection's budget; an
            // HTTP/1.1 connection has one request at a time.
            ahead_budget: (version == http::Version::HTTP_2)
                .then(|| x.peer.body_budget.clone().map(crate::upstream::forward::AheadBudget::shared))
                .flatten(),
            upgrade,
            bytes_in,
            chosen,
        }
    }

    /// The upstream's answer as the client gets it: in the client's
    /// protocol, a 101 turned into a tunnel, the cost its head carries
    /// settled (the rate-limit headers are added after, as to tollgate's
    /// own answers).
    pub(super) fn answered(
        &self,
        resp: &mut Response<UpstreamBody<RequestBody>>,
        x: &mut Exchange<'_>,
        version: http::Version,
        client_upgrade: Option<OnUpgrade>,
        settling: Vec<Settling>,
    ) {
        *resp.version_mut() = version;
        if let Some(client) = client_upgrade
            && resp.status() == http::StatusCode::SWITCHING_PROTOCOLS
        {
            tunnel_on(resp, client, x.held.take());
        }
        if !settling.is_empty() {
            let ended = hyper::body::Body::is_end_stream(resp.body());
            let status = resp.status();
            x.on_trailers =
                settle::at_head(settling, status, resp.headers(), ended, self.decider.store(), &self.metrics);
        }
    }

    /// The admitted rules whose cost their response settles, counted no
    /// earlier than `at`.
    pub(super) fn settling(&self, d: &Decision<'_>, at: Stamp) -> Vec<Settling> {
        d.pending
            .iter()
            .zip(&d.answers)
            .filter_map(|(p, a)| match a {
                Ok(v) if v.allowed => Some((p, v.fallback)),
                _ => None,
            })
            .filter(|(p, _)| p.rule.spec.settles_from_response())
            .map(|(p, fallback)| Settling {
                header: p.rule.spec.cost_response_header.clone(),
                count_status: p.rule.spec.count_status,
                rule: p.rule.name().to_string(),
                key: p.key.clone(),
                limits: p.check_limits,
                reserved: p.cost,
                enforced: p.rule.enforced(),
                on_error: self.decider.on_error_of(p.rule),
                at,
                fallback,
            })
            .collect()
    }
}

/// tollgate's own answer to `e`, in gRPC's form when `grpc` (the
/// request's gRPC content type) says so.
pub(super) fn own_answer(e: ProxyError, request_id: &HeaderValue, grpc: Option<HeaderValue>) -> Response<ProxyBody> {
    match grpc {
        Some(content_type) => e.into_grpc_response(request_id, content_type),
        None => e.into_response(request_id),
    }
    .map(Either::Right)
}

/// Hands a 101's two sides to the tunnel ([`crate::upstream::tunnel`]), which is the
/// request in flight until it closes: it holds the request's slots and its
/// server's count of answered requests that long.
fn tunnel_on(resp: &mut Response<UpstreamBody<RequestBody>>, client: OnUpgrade, held: Option<Held>) {
    let upstream = hyper::upgrade::on(&mut *resp);
    let held = held.map(tunnel::Guard::new);
    let answered = resp.body_mut().take_answered().map(Arc::new);
    let websocket =
        resp.headers().get(http::header::UPGRADE).is_some_and(|p| p.as_bytes().eq_ignore_ascii_case(b"websocket"));
    resp.extensions_mut().insert(tunnel::Pending { client, upstream, held, answered, websocket });
}
