//! A finished span as the request path hands it to the exporter.

use std::net::IpAddr;
use std::time::{Duration, SystemTime};

use http::Method;
use http::uri::Authority;

use super::context::SpanContext;

/// A finished span, on its way to the collector.
#[derive(Debug)]
pub struct SpanRecord {
    pub context: SpanContext,
    pub tracestate: Option<String>,
    pub start: SystemTime,
    pub duration: Duration,
    pub method: Method,
    pub path: String,
    pub route: Option<String>,
    pub status: u16,
    pub client: IpAddr,
    pub upstream: Option<Authority>,
    pub rule: Option<String>,
    pub decision: Option<&'static str>,
    pub store: Option<Duration>,
}
