//! The `admit` phase of [`Proxy::serve`](super::Proxy): what a request
//! must be before any rule reads it (one spelling, a route, within the
//! size limits, a client address, an identity), and the facts the
//! [`Decider`](crate::limit::decide::Decider) reads of it.

use http::{Request, header};
use hyper::body::Incoming;

use super::{Exchange, Proxy};
use crate::config::Route;
use crate::limit::decide::Asked;
use crate::limit::rules::{RequestFacts, RuleSet};
use crate::wire::client;
use crate::wire::error::ProxyError;
use crate::wire::identity::Identity;
use crate::wire::normalize;

impl Proxy {
    /// The first phase: one spelling of the request before anything reads
    /// it (see [`crate::wire::normalize`]), its route, the size limits, the
    /// client's address and identity. A request refused before its route
    /// is known counts as a rejection of no route.
    pub(super) fn admit(
        &self,
        req: &mut Request<Incoming>,
        rules: &RuleSet,
        x: &mut Exchange<'_>,
    ) -> Result<(), ProxyError> {
        if !self.normalization.underscores_in_headers {
            normalize::drop_underscored(req.headers_mut());
        }
        let bad = |why: &str| ProxyError::BadRequest(why.to_string());
        x.host = normalize::method(req.method()).and_then(|()| normalize::host(req)).map_err(bad)?;
        // Owned only when the client's spelling was not canonical; the
        // upstream then receives the canonical path.
        x.path = match normalize::path(req.uri().path(), &self.normalization) {
            Ok(std::borrow::Cow::Borrowed(_)) => None,
            Ok(std::borrow::Cow::Owned(p)) => Some(p),
            Err(e) => return Err(bad(e.reason())),
        };
        let path = x.path.as_deref().unwrap_or(req.uri().path());
        x.route = x.routing.route(x.host.as_ref().map(|h| h.name.as_str()), path);
        if let Some(e) = self.oversized(req, x.route.map(|i| &x.routing.routes[i].0)) {
            return Err(e);
        }
        x.client_ip = client::client_addr(x.peer.ip, req.headers(), &self.client.trusted_proxies).map_err(
            |client::BadForwarding| bad("The forwarding headers from a trusted proxy name no client address."),
        )?;
        x.note.client(x.client_ip);
        if rules.reads_method {
            normalize::method_override(req.headers()).map_err(bad)?;
        }
        if let Some(name) = normalize::repeated(req.headers(), &self.identity_headers)
            .or_else(|| normalize::repeated(req.headers(), &rules.read_headers))
        {
            return Err(ProxyError::BadRequest(format!("The header {name} must not be given more than once.")));
        }
        self.identify(req, rules, x);
        Ok(())
    }

    /// With `[client] jwt`, the user is whoever the token proves, and the
    /// user header is never read; the token is verified only if the rules
    /// need the user. A tier claim is read from the same token, when a rule
    /// uses one.
    pub(super) fn identify(&self, req: &Request<Incoming>, rules: &RuleSet, x: &mut Exchange<'_>) {
        let Some(jwt) = &self.jwt else { return };
        let path = x.path.as_deref().unwrap_or(req.uri().path());
        x.identity = Some(if !rules.needs_user(path) {
            Identity::Missing
        } else if let Some(claim) = &rules.tier_claim {
            let (identity, tier) = jwt.verify_with_claim(req.headers(), claim);
            x.tier_claim = tier;
            identity
        } else {
            jwt.verify(req.headers())
        });
    }

    /// What the rules read of an admitted request.
    pub(super) fn facts<'x>(
        &self,
        req: &'x Request<Incoming>,
        rules: &RuleSet,
        x: &'x Exchange<'_>,
    ) -> RequestFacts<'x> {
        let routing = &*x.routing;
        RequestFacts {
            method: req.method(),
            path: x.path.as_deref().unwrap_or(req.uri().path()),
            query: req.uri().query(),
            host: x.host.as_ref().map(|h| h.name.as_str()),
            route: x.route.map(|i| {
                let r = &routing.routes[i].0;
                (r.name.as_str(), routing.upstreams[r.upstream].config.name.as_str())
            }),
            headers: req.headers(),
            client: client::key_addr(x.client_ip, self.client.ipv6_prefix),
            client_ip: x.client_ip,
            // Looked up only when some rule or deny entry reads them
            // (each lookup hashes the header's name).
            user: match &x.identity {
                Some(Identity::Verified(id)) => Some(id.as_bytes()),
                Some(_) => None,
                None if rules.any_needs_user => req.headers().get(&self.client.user_header).map(|v| v.as_bytes()),
                None => None,
            },
            api_key: if rules.any_reads_api_key {
                req.headers().get(&self.client.api_key_header).map(|v| v.as_bytes())
            } else {
                None
            },
            tier_claim: x.tier_claim.as_deref().map(str::as_bytes),
            client_cert: x.peer.client_cert.as_deref(),
        }
    }

    /// What the Decider needs of the request besides its facts.
    pub(super) fn asked(&self, x: &Exchange<'_>) -> Asked {
        let routing = &*x.routing;
        Asked {
            inflight: x.route.map_or(0, |i| routing.upstreams[routing.routes[i].0.upstream].inflight()),
            invalid_token: match &x.identity {
                Some(Identity::Invalid(reason)) => Some(reason),
                _ => None,
            },
        }
    }

    /// Requests over a size limit are refused before any rule counts them:
    /// 414 for the target, 431 for the headers, 501 for a body in a transfer
    /// coding tollgate cannot decode, 413 for a declared body
    /// length (a chunked body is cut off while it is read instead, see
    /// [`crate::upstream::forward::RequestBody`]).
    pub(super) fn oversized(&self, req: &Request<Incoming>, route: Option<&Route>) -> Option<ProxyError> {
        if req.uri().path_and_query().map_or(0, |p| p.as_str().len()) > self.max_uri_bytes {
            return Some(ProxyError::UriTooLong);
        }
        // Counted the way they travel in HTTP/1.1: "name: value\r\n".
        let header_bytes: usize = req.headers().iter().map(|(k, v)| k.as_str().len() + v.len() + 4).sum();
        if header_bytes > self.max_header_bytes {
            return Some(ProxyError::HeadersTooLarge);
        }
        if crate::upstream::forward::undecodable_transfer_coding(req.headers()) {
            return Some(ProxyError::UnsupportedTransferEncoding);
        }
        let max_body = route.and_then(|r| r.max_body)?;
        let declared = req.headers().get(header::CONTENT_LENGTH)?.to_str().ok()?.trim().parse::<u64>().ok()?;
        (declared > max_body).then_some(ProxyError::PayloadTooLarge)
    }
}
