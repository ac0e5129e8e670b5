//! Which requests a rule counts and how it keys them: `[rule.match]`,
//! `key`, and the client sets of `exempt` and `[[deny]]`.

use http::{HeaderName, Method};
use toml::Spanned;

use super::main_file::Config;
use super::raw::RawMatch;
use super::spec::{ClientSet, KeyPart, MatchSpec, PathPattern};
use super::validate::{Validator, canonical_host, parse_net};

impl Validator<'_> {
    /// Addresses/CIDRs, user ids and API keys of a deny entry or exemption.
    pub(super) fn clients(
        &mut self,
        ips: Option<&[Spanned<String>]>,
        users: Option<Vec<String>>,
        api_keys: Option<Vec<String>>,
    ) -> ClientSet {
        let mut nets = Vec::new();
        for ip in ips.unwrap_or_default() {
            match parse_net(ip.get_ref()) {
                Some(n) => nets.push(n),
                None => self.error(
                    ip.span(),
                    format!("{:?} is not an IP address or CIDR such as \"10.0.0.0/8\"", ip.get_ref()),
                ),
            }
        }
        ClientSet { nets, users: users.unwrap_or_default(), api_keys: api_keys.unwrap_or_default() }
    }

    /// `[rule.match]`: methods, a path (written in the canonical form
    /// requests are matched in), a host, a route and a header.
    pub(super) fn matcher(&mut self, m: RawMatch, config: &Config) -> MatchSpec {
        let mut spec = MatchSpec::default();
        for method in m.methods.iter().flatten() {
            match Method::from_bytes(method.get_ref().to_ascii_uppercase().as_bytes()) {
                Ok(x) => spec.methods.push(x),
                Err(_) => self.error(method.span(), format!("{:?} is not an HTTP method", method.get_ref())),
            }
        }
        if let Some(p) = &m.path {
            let s = p.get_ref();
            if !s.starts_with('/') {
                self.error(p.span(), format!("match.path {s:?} must start with '/'"));
            } else {
                let (text, prefix) = match s.strip_suffix('*') {
                    Some(prefix) => (prefix, true),
                    None => (s.as_str(), false),
                };
                // Requests are matched by their canonical path (see
                // crate::wire::normalize), so rule paths are written in it too;
                // an exact path ignores a trailing '/', as requests' do.
                let canonical = toml::Spanned::new(p.span(), text.to_string());
                if text.contains('*') {
                    self.error(p.span(), format!("match.path {s:?}: '*' is allowed only at the end (a prefix match)"));
                } else if let Some(c) = self.canonical_path(&canonical, "match.path", &config.listen.normalization) {
                    spec.path = Some(if prefix {
                        PathPattern::Prefix(c)
                    } else {
                        PathPattern::Exact(crate::wire::normalize::match_path(&c).to_string())
                    });
                }
            }
        }
        spec.host = m.host.map(|h| canonical_host(&h));
        if let Some(route) = &m.route {
            if config.upstream_index(route.get_ref()).is_none()
                && !config.routes.iter().any(|r| r.name == *route.get_ref())
            {
                self.error(
                    route.span(),
                    format!(
                        "match.route {:?} is not the name of any upstream or route in {}",
                        route.get_ref(),
                        config.path.display()
                    ),
                );
            } else {
                spec.route = Some(route.get_ref().clone());
            }
        }
        if let Some(h) = &m.header
            && let Some(name) = self.header_name(&h.name, "match.header.name")
        {
            spec.header = Some((name, h.value.clone()));
        }
        spec
    }

    /// One part of a rule's `key`.
    pub(super) fn key_part(&mut self, part: &Spanned<String>) -> Option<KeyPart> {
        let s = part.get_ref().trim();
        let parsed = match s {
            "ip" => Some(KeyPart::Ip),
            "user" => Some(KeyPart::User),
            "api_key" => Some(KeyPart::ApiKey),
            "route" => Some(KeyPart::Route),
            "method" => Some(KeyPart::Method),
            "path" => Some(KeyPart::Path),
            "client_cert" => Some(KeyPart::ClientCert),
            _ => match s.strip_prefix("header:") {
                Some(h) => HeaderName::from_bytes(h.trim().as_bytes()).ok().map(KeyPart::Header),
                None => s.strip_prefix("query:").filter(|q| !q.is_empty()).map(|q| KeyPart::Query(q.to_string())),
            },
        };
        if parsed.is_none() {
            self.error(part.span(), format!("key part {s:?} is not one of ip, user, api_key, route, method, path, client_cert, \"header:NAME\", \"query:NAME\""));
        }
        parsed
    }
}
