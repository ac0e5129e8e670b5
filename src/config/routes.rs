//! `[[upstream]]` and `[[route]]`: the upstreams by name, and the routes
//! naming them.

use toml::Spanned;

use super::raw::{RawRoute, RawUpstream};
use super::upstream::Upstream;
use super::validate::{Validator, canonical_host, parse_size};
use crate::wire::normalize::Normalization;

/// `[[route]]`
#[derive(Debug, Clone)]
pub struct Route {
    /// Label in metrics: the `name` key, or the upstream's name.
    pub name: String,
    pub path_prefix: String,
    pub host: Option<String>,
    /// Index into [`super::Config::upstreams`].
    pub upstream: usize,
    /// Largest request body forwarded (413 above it); `None`: unlimited.
    pub max_body: Option<u64>,
    /// Bodies up to this size are read whole before the upstream is
    /// contacted; larger ones stream (0: every body streams).
    pub buffer_body: u64,
}

/// `buffer_body` when a route does not set it.
const DEFAULT_BUFFER_BODY: u64 = 1024 * 1024;
/// The largest `buffer_body`: each request in flight may hold this much.
pub(super) const MAX_BUFFER_BODY: u64 = 64 * 1024 * 1024;

impl Validator<'_> {
    /// Every `[[upstream]]` and every `[[route]]`.
    pub(super) fn upstreams_and_routes(
        &mut self,
        raw_upstreams: Vec<Spanned<RawUpstream>>,
        raw_routes: Vec<Spanned<RawRoute>>,
        normalization: &Normalization,
    ) -> (Vec<Upstream>, Vec<Route>) {
        let mut upstreams: Vec<Upstream> = Vec::new();
        // Every name an [[upstream]] defines, valid or not: an upstream with
        // a bad URL has its own error, and a route naming it needs no second
        // one claiming it is undefined.
        let mut defined: Vec<String> = Vec::new();
        for u in raw_upstreams {
            let name = &u.get_ref().name;
            if defined.contains(name.get_ref()) {
                self.error(name.span(), format!("upstream {:?} is defined twice", name.get_ref()));
                continue;
            }
            defined.push(name.get_ref().clone());
            if let Some(u) = self.upstream(u) {
                upstreams.push(u);
            }
        }
        let routes = raw_routes
            .into_iter()
            .filter_map(|r| self.route(r.into_inner(), &upstreams, &defined, normalization))
            .collect();
        (upstreams, routes)
    }

    /// One `[[route]]`; `defined` names every `[[upstream]]`, valid or not.
    fn route(
        &mut self,
        r: RawRoute,
        upstreams: &[Upstream],
        defined: &[String],
        normalization: &Normalization,
    ) -> Option<Route> {
        let Some(upstream) = upstreams.iter().position(|u| u.name == *r.upstream.get_ref()) else {
            if !defined.contains(r.upstream.get_ref()) {
                self.error(
                    r.upstream.span(),
                    format!("route names upstream {:?}, which no [[upstream]] defines", r.upstream.get_ref()),
                );
            }
            return None;
        };
        let prefix = r.path_prefix.get_ref();
        if !prefix.starts_with('/') {
            self.error(r.path_prefix.span(), format!("route path_prefix {prefix:?} must start with '/'"));
            return None;
        }
        // Requests are routed by their canonical path, so prefixes are
        // written in that form too.
        let prefix = self.canonical_path(&r.path_prefix, "route path_prefix", normalization)?;
        let max_body = r.max_body.as_ref().and_then(|s| match parse_size(s.get_ref()) {
            Some(n) => Some(n),
            None => {
                self.error(
                    s.span(),
                    "route max_body must be a size in bytes: a whole number, or a string such as \"512KiB\", \"10MB\"",
                );
                None
            }
        });
        let buffer_body = match r.buffer_body.as_ref().map(|s| (s, parse_size(s.get_ref()))) {
            None => DEFAULT_BUFFER_BODY,
            Some((_, Some(n))) if n <= MAX_BUFFER_BODY => n,
            Some((s, _)) => {
                self.error(s.span(), "route buffer_body must be a size from 0 to 64MiB: a whole number of bytes, or a string such as \"256KiB\", \"1MiB\"");
                DEFAULT_BUFFER_BODY
            }
        };
        Some(Route {
            max_body,
            buffer_body,
            name: r.name.unwrap_or_else(|| upstreams[upstream].name.clone()),
            path_prefix: prefix,
            host: r.host.map(|h| canonical_host(&h)),
            upstream,
        })
    }
}
