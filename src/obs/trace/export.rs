//! Sending finished spans to the collector: a bounded queue off the
//! request path, and one task that batches the spans and POSTs them as
//! OTLP/HTTP protobuf (`opentelemetry-proto`'s messages) to `/v1/traces`.
//!
//! The request path only ever `try_send`s: a full queue (a slow or absent
//! collector) drops the span and counts it, it never waits. A batch the
//! collector refuses, or does not take within [`EXPORT_TIMEOUT`], is
//! counted as failed and not sent again: a trace is a sample, and a
//! backlog of retries would grow while the collector is down.

use std::time::{Duration, Instant, UNIX_EPOCH};

use bytes::Bytes;
use http::{Request, Uri};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{AnyValue, InstrumentationScope, KeyValue, any_value};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span, Status, span, status};
use prometheus::{IntCounter, IntCounterVec};
use prost::Message;
use tokio::sync::mpsc;

use super::span::SpanRecord;

/// Spans waiting for the exporter at most: at 100% sampling and 20,000
/// requests a second, a tenth of a second of them; each is a few hundred
/// bytes.
pub const QUEUE: usize = 2048;
/// Spans in one export request at most (the OpenTelemetry SDK's default).
pub const MAX_BATCH: usize = 512;
/// How long the first span of a batch waits for others.
pub const BATCH_DELAY: Duration = Duration::from_secs(1);
/// How long the collector has to take a batch.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// The request path's end of the queue.
pub struct Exporter {
    queue: mpsc::Sender<SpanRecord>,
    dropped: IntCounter,
}

impl Exporter {
    /// Starts the export task on the current runtime; `None` (logged) when
    /// there is none.
    pub fn start(endpoint: &Uri, service_name: &str, counts: &IntCounterVec) -> Option<Exporter> {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::error!("tracing: no async runtime to export spans from; spans are not exported");
            return None;
        };
        let (queue, rx) = mpsc::channel(QUEUE);
        let url = traces_url(endpoint);
        let task = Task {
            url,
            service_name: service_name.to_string(),
            exported: counts.with_label_values(&["exported"]),
            failed: counts.with_label_values(&["failed"]),
            client: Client::builder(TokioExecutor::new()).build_http(),
            last_warning: None,
        };
        rt.spawn(task.run(rx));
        Some(Exporter { queue, dropped: counts.with_label_values(&["dropped"]) })
    }

    #[cfg(test)]
    pub(super) fn for_test(queue: mpsc::Sender<SpanRecord>) -> Exporter {
        Exporter { queue, dropped: IntCounter::new("t", "t").expect("counter") }
    }

    /// Queues a finished span, or drops and counts it when the queue is full.
    pub fn send(&self, span: SpanRecord) {
        if self.queue.try_send(span).is_err() {
            self.dropped.inc();
        }
    }
}

/// `endpoint` with `/v1/traces` after its path, as OTLP/HTTP's exporters
/// build it from `OTEL_EXPORTER_OTLP_ENDPOINT`.
fn traces_url(endpoint: &Uri) -> String {
    let base = endpoint.to_string();
    format!("{}/v1/traces", base.trim_end_matches('/'))
}

struct Task {
    url: String,
    service_name: String,
    exported: IntCounter,
    failed: IntCounter,
    client: Client<HttpConnector, Full<Bytes>>,
    /// When a failed export was last logged: at most one line a minute.
    last_warning: Option<Instant>,
}

impl Task {
    async fn run(mut self, mut rx: mpsc::Receiver<SpanRecord>) {
        let mut batch = Vec::with_capacity(MAX_BATCH);
        while let Some(first) = rx.recv().await {
            batch.push(first);
            let deadline = tokio::time::Instant::now() + BATCH_DELAY;
            while batch.len() < MAX_BATCH {
                match tokio::time::timeout_at(deadline, rx.recv()).await {
                    Ok(Some(span)) => batch.push(span),
                    Ok(None) | Err(_) => break,
                }
            }
            self.export(&batch).await;
            batch.clear();
        }
    }

    async fn export(&mut self, spans: &[SpanRecord]) {
        let body = encode(spans, &self.service_name);
        let request = Request::post(&self.url)
            .header(http::header::CONTENT_TYPE, "application/x-protobuf")
            .body(Full::new(Bytes::from(body)));
        let outcome = match request {
            Ok(req) => match tokio::time::timeout(EXPORT_TIMEOUT, self.client.request(req)).await {
                Ok(Ok(resp)) if resp.status().is_success() => Ok(()),
                Ok(Ok(resp)) => Err(format!("the collector answered {}", resp.status())),
                Ok(Err(e)) => Err(format!("cannot reach the collector: {e}")),
                Err(_) => Err(format!("the collector did not answer within {EXPORT_TIMEOUT:?}")),
            },
            Err(e) => Err(e.to_string()),
        };
        let n = spans.len() as u64;
        match outcome {
            Ok(()) => self.exported.inc_by(n),
            Err(e) => {
                self.failed.inc_by(n);
                if self.last_warning.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                    self.last_warning = Some(Instant::now());
                    tracing::warn!(url = %self.url, spans = n, "tracing: spans not exported: {e}");
                }
            }
        }
    }
}

/// One OTLP export request holding `spans`, protobuf-encoded.
pub fn encode(spans: &[SpanRecord], service_name: &str) -> Vec<u8> {
    let request = ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(Resource { attributes: vec![attr("service.name", service_name)], ..Default::default() }),
            scope_spans: vec![ScopeSpans {
                scope: Some(InstrumentationScope {
                    name: "tollgate".into(),
                    version: env!("CARGO_PKG_VERSION").into(),
                    ..Default::default()
                }),
                spans: spans.iter().map(span).collect(),
                ..Default::default()
            }],
            ..Default::default()
        }],
    };
    request.encode_to_vec()
}

fn span(s: &SpanRecord) -> Span {
    let c = &s.context;
    let start = s.start.duration_since(UNIX_EPOCH).unwrap_or_default();
    let end = start + s.duration;
    let route = s.route.as_deref();
    let mut attributes = vec![
        attr("http.request.method", s.method.as_str()),
        attr("url.path", &s.path),
        int("http.response.status_code", i64::from(s.status)),
        attr("client.address", &s.client.to_string()),
    ];
    if let Some(r) = route {
        attributes.push(attr("http.route", r));
    }
    if let Some(u) = &s.upstream {
        attributes.push(attr("server.address", u.host()));
        if let Some(port) = u.port_u16() {
            attributes.push(int("server.port", i64::from(port)));
        }
    }
    if let Some(rule) = &s.rule {
        attributes.push(attr("tollgate.rule", rule));
    }
    if let Some(decision) = s.decision {
        attributes.push(attr("tollgate.decision", decision));
    }
    if let Some(store) = s.store {
        attributes.push(KeyValue {
            key: "tollgate.store_ms".into(),
            value: Some(AnyValue { value: Some(any_value::Value::DoubleValue(store.as_secs_f64() * 1000.0)) }),
            ..Default::default()
        });
    }
    Span {
        trace_id: c.trace_id.to_be_bytes().to_vec(),
        span_id: c.span_id.to_be_bytes().to_vec(),
        parent_span_id: c.parent.map_or_else(Vec::new, |p| p.to_be_bytes().to_vec()),
        trace_state: s.tracestate.clone().unwrap_or_default(),
        flags: u32::from(c.sampled),
        name: match route {
            Some(r) => format!("{} {r}", s.method),
            None => s.method.to_string(),
        },
        kind: span::SpanKind::Server as i32,
        start_time_unix_nano: start.as_nanos() as u64,
        end_time_unix_nano: end.as_nanos() as u64,
        attributes,
        // OpenTelemetry's HTTP conventions: a server span is an error for
        // a 5xx only (a 4xx is the client's).
        status: Some(Status {
            code: if s.status >= 500 { status::StatusCode::Error } else { status::StatusCode::Unset } as i32,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn attr(key: &str, value: &str) -> KeyValue {
    KeyValue {
        key: key.into(),
        value: Some(AnyValue { value: Some(any_value::Value::StringValue(value.into())) }),
        ..Default::default()
    }
}

fn int(key: &str, value: i64) -> KeyValue {
    KeyValue {
        key: key.into(),
        value: Some(AnyValue { value: Some(any_value::Value::IntValue(value)) }),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_traces_path_follows_the_endpoints_own() {
        assert_eq!(traces_url(&"http://c:4318".parse().expect("uri")), "http://c:4318/v1/traces");
        assert_eq!(traces_url(&"http://c:4318/otlp/".parse().expect("uri")), "http://c:4318/otlp/v1/traces");
    }
}
