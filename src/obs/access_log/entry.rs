//! One request's access log entry, and what the request path hands the
//! writer thread.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant, SystemTime};

use http::header::HeaderValue;
use http::uri::Authority;
use http::{Method, Uri, Version};

use crate::obs::trace::{SpanRecord, Trace};

/// One request's line, as it is being filled in.
pub struct Entry {
    pub(super) time: SystemTime,
    pub(super) started: Instant,
    pub(super) client: IpAddr,
    pub(super) method: Method,
    pub(super) uri: Uri,
    pub(super) status: u16,
    /// Request body bytes read from the client so far, counted by the
    /// forwarding side (see [`crate::upstream::forward::Downstream`]).
    pub(super) bytes_in: Option<Arc<AtomicU64>>,
    pub(super) bytes_out: u64,
    pub(super) duration: Duration,
    pub(super) upstream: Option<Authority>,
    pub(super) rule: Option<String>,
    pub(super) request_id: HeaderValue,
    /// What the client sent: `None` when it sent none, or for a request
    /// answered before hyper parsed it (over `max_connections`).
    pub(super) host: Option<HeaderValue>,
    pub(super) version: Option<Version>,
    pub(super) user_agent: Option<HeaderValue>,
    pub(super) referer: Option<HeaderValue>,
    /// The upstream's status (`None`: it gave no response head) and the
    /// time from sending the request to that head or to the failure;
    /// `None` for a request never sent upstream.
    pub(super) upstream_answer: Option<(Option<u16>, Duration)>,
    /// The connection's TLS version (`"TLSv1.3"`); `None` over plain TCP.
    pub(super) tls: Option<&'static str>,
    /// With `[tracing]`: the request's trace (its id goes into the line).
    pub(super) trace: Option<Trace>,
    /// For a sampled request's span: its route's prefix, its decision and
    /// the time its store round took.
    pub(super) route: Option<String>,
    pub(super) decision: Option<&'static str>,
    pub(super) store: Option<Duration>,
}

impl Entry {
    /// Whether this entry's request has a span to export.
    pub(super) fn sampled(&self) -> bool {
        self.trace.as_ref().is_some_and(|t| t.context.sampled)
    }

    /// The span of a sampled request, from what the entry holds.
    pub(super) fn span(&self) -> Option<SpanRecord> {
        let t = self.trace.as_ref().filter(|t| t.context.sampled)?;
        Some(SpanRecord {
            context: t.context,
            tracestate: t.tracestate.clone(),
            start: self.time,
            duration: self.duration,
            method: self.method.clone(),
            path: self.uri.path().to_string(),
            route: self.route.clone(),
            status: self.status,
            client: self.client,
            upstream: self.upstream.clone(),
            rule: self.rule.clone(),
            decision: self.decision,
            store: self.store,
        })
    }
}

/// What the writer thread receives.
pub(super) enum Message {
    Line(Box<Entry>),
    /// Write out everything queued before this, then answer.
    Flush(tokio::sync::oneshot::Sender<()>),
}
