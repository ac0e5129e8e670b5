//! OpenTelemetry tracing (`[tracing]`): each request joins the trace its
//! `traceparent` names (when `accept_traceparent` trusts whoever sent it)
//! or starts one; the upstream receives a `traceparent` naming this
//! request's span; a sampled request's span is exported over OTLP/HTTP
//! once its response ends ([`export`]).
//!
//! The span is built from the request's access log entry (the same facts:
//! method, path, status, client, upstream, rule), with the route, the
//! decision and the time the store took. Without `[tracing]` nothing here
//! runs; with it, an unsampled request costs its ids and one header.

use std::sync::Arc;

use http::header::{HeaderMap, HeaderName, HeaderValue};

use crate::config::{AcceptTraceparent, TracingConfig};
use crate::obs::metrics::Metrics;

mod context;
pub mod export;
mod span;

pub use context::{SpanContext, parse as parse_traceparent};
pub use export::Exporter;
pub use span::SpanRecord;

pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
pub const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// Sampling, propagation and the exporter.
pub struct Tracer {
    ratio: f64,
    accept: AcceptTraceparent,
    exporter: Exporter,
}

/// A request's trace, from its arrival on.
#[derive(Debug, Clone)]
pub struct Trace {
    pub context: SpanContext,
    /// The incoming `tracestate`, passed on unchanged with an accepted
    /// `traceparent`.
    pub tracestate: Option<String>,
}

impl Tracer {
    /// `[tracing]`'s tracer and its export task; `None` when it is off or
    /// the task cannot start.
    pub fn start(config: Option<&TracingConfig>, metrics: &Metrics) -> Option<Arc<Tracer>> {
        let c = config?;
        let exporter = Exporter::start(&c.otlp_endpoint, &c.service_name, &metrics.tracing_spans_total)?;
        Some(Arc::new(Tracer { ratio: c.sample_ratio, accept: c.accept_traceparent, exporter }))
    }

    /// Joins the trace the request came with, when its sender is trusted
    /// for it, or starts one; decides whether it is sampled (a sampled
    /// incoming trace always is; otherwise by the trace id at
    /// `sample_ratio`); and sets the `traceparent` the upstream receives.
    /// A `tracestate` not accepted is removed with its `traceparent`.
    pub fn begin(&self, headers: &mut HeaderMap, from_trusted_proxy: bool) -> Trace {
        let accepted = match self.accept {
            AcceptTraceparent::Always => true,
            AcceptTraceparent::Never => false,
            AcceptTraceparent::TrustedProxies => from_trusted_proxy,
        };
        let incoming =
            if accepted { only(headers, &TRACEPARENT).and_then(|v| context::parse(v.as_bytes())) } else { None };
        let tracestate = match incoming {
            Some(_) => join(headers, &TRACESTATE),
            None => {
                headers.remove(TRACESTATE);
                None
            }
        };
        let trace_id = incoming.map_or_else(context::new_trace_id, |i| i.trace_id);
        let sampled = incoming.is_some_and(|i| i.sampled) || context::sampled_at(trace_id, self.ratio);
        let context =
            SpanContext { trace_id, span_id: context::new_span_id(), parent: incoming.map(|i| i.parent), sampled };
        headers.insert(TRACEPARENT, context.header());
        Trace { context, tracestate }
    }

    /// Hands a finished span to the exporter (dropped when its queue is full).
    pub fn export(&self, span: SpanRecord) {
        self.exporter.send(span);
    }
}

/// The header's value when it came exactly once.
fn only<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Option<&'a HeaderValue> {
    let mut all = headers.get_all(name).iter();
    let first = all.next()?;
    all.next().is_none().then_some(first)
}

/// Every value of a list header, joined as one (`tracestate` may be split).
fn join(headers: &HeaderMap, name: &HeaderName) -> Option<String> {
    let parts: Vec<&str> = headers.get_all(name).iter().filter_map(|v| v.to_str().ok()).collect();
    (!parts.is_empty()).then(|| parts.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracer(accept: AcceptTraceparent, ratio: f64) -> Tracer {
        let (queue, _rx) = tokio::sync::mpsc::channel(1);
        let exporter = Exporter::for_test(queue);
        Tracer { ratio, accept, exporter }
    }

    const SAMPLED: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn headers(traceparent: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in traceparent {
            h.append(TRACEPARENT, HeaderValue::from_str(v).expect("value"));
        }
        h.insert(TRACESTATE, HeaderValue::from_static("vendor=x"));
        h
    }

    #[test]
    fn a_trusted_sampled_traceparent_is_joined_and_passed_on_as_our_child() {
        let t = tracer(AcceptTraceparent::TrustedProxies, 0.0);
        let mut h = headers(&[SAMPLED]);
        let trace = t.begin(&mut h, true);
        let c = trace.context;
        assert_eq!(
            (c.trace_id, c.parent, c.sampled),
            (0x4bf92f3577b34da6a3ce929d0e0e4736, Some(0x00f067aa0ba902b7), true)
        );
        let sent = context::parse(h[TRACEPARENT].as_bytes()).expect("a valid traceparent upstream");
        assert_eq!((sent.trace_id, sent.parent, sent.sampled), (c.trace_id, c.span_id, true));
        assert_eq!(
            (trace.tracestate.as_deref(), h.get(TRACESTATE)),
            (Some("vendor=x"), Some(&HeaderValue::from_static("vendor=x")))
        );
    }

    #[test]
    fn an_untrusted_or_duplicated_traceparent_starts_a_new_unsampled_trace() {
        let t = tracer(AcceptTraceparent::TrustedProxies, 0.0);
        for (h, trusted) in [(headers(&[SAMPLED]), false), (headers(&[SAMPLED, SAMPLED]), true)] {
            let mut h = h;
            let trace = t.begin(&mut h, trusted);
            assert_ne!(trace.context.trace_id, 0x4bf92f3577b34da6a3ce929d0e0e4736);
            assert_eq!((trace.context.parent, trace.context.sampled), (None, false));
            assert_eq!(h.get_all(TRACEPARENT).iter().count(), 1);
            assert!(h.get(TRACESTATE).is_none());
        }
        let never = tracer(AcceptTraceparent::Never, 0.0);
        assert_eq!(never.begin(&mut headers(&[SAMPLED]), true).context.parent, None);
        let always = tracer(AcceptTraceparent::Always, 0.0);
        assert!(always.begin(&mut headers(&[SAMPLED]), false).context.sampled);
    }

    #[test]
    fn with_no_traceparent_the_ratio_samples() {
        assert!(tracer(AcceptTraceparent::Always, 1.0).begin(&mut HeaderMap::new(), true).context.sampled);
        assert!(!tracer(AcceptTraceparent::Always, 0.0).begin(&mut HeaderMap::new(), true).context.sampled);
    }
}
