//! What the matcher knows about a request: everything a rule reads of it,
//! gathered once by the caller (the proxy's `admit` phase, the decision
//! API, Envoy RLS) so that no rule touches HTTP types itself.

use std::net::IpAddr;

use http::{HeaderMap, Method};

/// What the matcher needs to know about a request.
pub struct RequestFacts<'a> {
    pub method: &'a Method,
    /// The canonical path ([`crate::wire::normalize::path`]).
    pub path: &'a str,
    pub query: Option<&'a str>,
    /// Lower-cased, without a port.
    pub host: Option<&'a str>,
    /// The name of the route the request takes, and its upstream's name.
    pub route: Option<(&'a str, &'a str)>,
    pub headers: &'a HeaderMap,
    /// The client address as keyed (an IPv6 client already reduced to its
    /// prefix).
    pub client: IpAddr,
    /// The full client address (for `exempt` and `[[deny]]` CIDRs).
    pub client_ip: IpAddr,
    /// Who the user is: the verified JWT claim when `[client] jwt` is set,
    /// else the user header's value; `None` when the request has neither.
    pub user: Option<&'a [u8]>,
    /// The API key header's value.
    pub api_key: Option<&'a [u8]>,
    /// The verified JWT's tier claim ([`RuleSet::tier_claim`](super::RuleSet::tier_claim)), if the
    /// request needed it and has it.
    pub tier_claim: Option<&'a [u8]>,
    /// The common name of the client certificate the connection's TLS
    /// handshake verified.
    pub client_cert: Option<&'a [u8]>,
}
