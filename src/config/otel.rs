//! `[tracing]`: OpenTelemetry spans of sampled requests, exported over
//! OTLP/HTTP, and W3C trace context propagated to the upstream.

use http::Uri;
use toml::Spanned;

use super::raw::RawTracing;
use super::validate::Validator;

/// `[tracing]`, validated; absent when the table is.
#[derive(Debug, Clone, PartialEq)]
pub struct TracingConfig {
    /// The collector's base URL (`http://collector:4318`); spans are
    /// POSTed to its `/v1/traces`.
    pub otlp_endpoint: Uri,
    /// The share of requests traced that came with no sampled
    /// `traceparent` to follow.
    pub sample_ratio: f64,
    pub service_name: String,
    pub accept_traceparent: AcceptTraceparent,
}

/// `[tracing] sample_ratio` when not given: one request in a hundred.
pub const DEFAULT_SAMPLE_RATIO: f64 = 0.01;

/// `[tracing] accept_traceparent`: whose `traceparent` (and `tracestate`)
/// a request's span joins. Any other request starts a new trace, and the
/// incoming headers are replaced before the request goes upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AcceptTraceparent {
    /// From `[client] trusted_proxies` only (the default): a client on the
    /// internet cannot choose its trace id, nor have every one of its
    /// requests sampled by sending the sampled flag.
    #[default]
    TrustedProxies,
    /// From anyone: tollgate is behind another proxy that sets them.
    Always,
    /// From nobody: every request starts a trace here.
    Never,
}

impl AcceptTraceparent {
    pub fn as_str(self) -> &'static str {
        match self {
            AcceptTraceparent::TrustedProxies => "trusted_proxies",
            AcceptTraceparent::Always => "always",
            AcceptTraceparent::Never => "never",
        }
    }
}

impl Validator<'_> {
    /// `[tracing]`: `otlp_endpoint` is required (an `http://` URL; the path
    /// `/v1/traces` is added), `sample_ratio` from 0 to 1,
    /// `accept_traceparent` one of three words.
    pub(super) fn tracing(&mut self, raw: Option<Spanned<RawTracing>>) -> Option<TracingConfig> {
        let raw = raw?;
        let span = raw.span();
        let raw = raw.into_inner();
        let Some(endpoint) = raw.otlp_endpoint else {
            self.error(
                span,
                "[tracing] needs otlp_endpoint, the collector's OTLP/HTTP address (\"http://collector:4318\")",
            );
            return None;
        };
        let otlp_endpoint = match endpoint.get_ref().parse::<Uri>() {
            Ok(u) if u.scheme_str() == Some("http") && u.authority().is_some() && u.query().is_none() => u,
            _ => {
                self.error(
                    endpoint.span(),
                    "tracing.otlp_endpoint must be an http:// URL with a host, such as \"http://collector:4318\"",
                );
                return None;
            }
        };
        let sample_ratio = match raw.sample_ratio {
            None => DEFAULT_SAMPLE_RATIO,
            Some(r) if (0.0..=1.0).contains(r.get_ref()) => *r.get_ref(),
            Some(r) => {
                self.error(
                    r.span(),
                    "tracing.sample_ratio must be between 0 (only sampled incoming traces) and 1 (every request)",
                );
                DEFAULT_SAMPLE_RATIO
            }
        };
        let service_name = match raw.service_name {
            None => "tollgate".to_string(),
            Some(n) if !n.get_ref().trim().is_empty() => n.into_inner(),
            Some(n) => {
                self.error(n.span(), "tracing.service_name must not be empty");
                String::new()
            }
        };
        let accept_traceparent = match raw.accept_traceparent.as_ref().map(|a| (a.get_ref().as_str(), a.span())) {
            None | Some(("trusted_proxies", _)) => AcceptTraceparent::TrustedProxies,
            Some(("always", _)) => AcceptTraceparent::Always,
            Some(("never", _)) => AcceptTraceparent::Never,
            Some((_, span)) => {
                self.error(span, "tracing.accept_traceparent must be \"trusted_proxies\", \"always\" or \"never\"");
                AcceptTraceparent::default()
            }
        };
        Some(TracingConfig { otlp_endpoint, sample_ratio, service_name, accept_traceparent })
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::Config;

    fn tracing(source: &str) -> Result<Option<TracingConfig>, String> {
        Config::parse(Path::new("/t.toml"), source).map(|c| c.tracing).map_err(|e| e.to_string())
    }

    #[test]
    fn off_without_the_table_and_defaults_with_it() {
        assert_eq!(tracing(""), Ok(None));
        let t = tracing("[tracing]\notlp_endpoint = \"http://collector:4318\"\n").expect("valid").expect("on");
        assert_eq!(t.otlp_endpoint, "http://collector:4318/");
        assert_eq!((t.sample_ratio, t.service_name.as_str()), (0.01, "tollgate"));
        assert_eq!(t.accept_traceparent, AcceptTraceparent::TrustedProxies);
    }

    #[test]
    fn each_bad_value_is_pointed_at() {
        let err = tracing("[tracing]\nsample_ratio = 0.5\n").expect_err("no endpoint");
        assert!(err.starts_with("/t.toml:1:1: [tracing] needs otlp_endpoint"), "{err}");
        let err = tracing("[tracing]\notlp_endpoint = \"https://c:4318\"\n").expect_err("https");
        assert!(err.starts_with("/t.toml:2:17: tracing.otlp_endpoint must be an http:// URL"), "{err}");
        let err = tracing("[tracing]\notlp_endpoint = \"http://c:4318\"\nsample_ratio = 1.5\n").expect_err("ratio");
        assert!(err.starts_with("/t.toml:3:16: tracing.sample_ratio must be between 0"), "{err}");
        let err =
            tracing("[tracing]\notlp_endpoint = \"http://c:4318\"\naccept_traceparent = \"yes\"\n").expect_err("word");
        assert!(err.starts_with("/t.toml:3:22: tracing.accept_traceparent must be"), "{err}");
        let err = tracing("[tracing]\notlp_endpoint = \"http://c:4318\"\nsample = 1\n").expect_err("unknown");
        assert!(err.contains("unknown field `sample`"), "{err}");
    }
}
