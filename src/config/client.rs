//! `[client]`: who a client is (trusted proxies, IPv6 prefixes, the user
//! and API key headers) and `[client] jwt`.

use http::HeaderName;
use ipnet::IpNet;
use toml::Spanned;

use super::raw::{RawClient, RawJwt};
use super::validate::{Validator, parse_duration, parse_net};

/// `[client]`: how the client behind a request is identified.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Verified identity: when set, `user` keys come from a checked JWT and
    /// the user header is ignored.
    pub jwt: Option<crate::wire::identity::JwtConfig>,
    pub trusted_proxies: Vec<IpNet>,
    pub ipv6_prefix: u8,
    pub user_header: HeaderName,
    pub api_key_header: HeaderName,
    /// Responses relayed from upstreams carry the request's `X-Request-Id`
    /// (Envoy's `always_set_request_id_in_response`), so that a client
    /// can quote the id the access log and the upstream saw.
    pub request_id_in_response: bool,
}

impl Validator<'_> {
    /// `[client]`.
    pub(super) fn client(&mut self, client: RawClient) -> ClientConfig {
        let mut trusted = Vec::new();
        for p in client.trusted_proxies.iter().flatten() {
            match parse_net(p.get_ref()) {
                Some(n) => trusted.push(n),
                None => self.error(
                    p.span(),
                    format!(
                        "client.trusted_proxies entry {:?} is not an IP address or CIDR such as \"10.0.0.0/8\"",
                        p.get_ref()
                    ),
                ),
            }
        }
        let ipv6_prefix = match &client.ipv6_prefix {
            Some(n) if !(1..=128).contains(n.get_ref()) => {
                self.error(n.span(), "client.ipv6_prefix must be between 1 and 128");
                64
            }
            Some(n) => *n.get_ref() as u8,
            None => 64,
        };
        let user_header = client
            .user_header
            .as_ref()
            .map_or(Some(HeaderName::from_static("x-user-id")), |h| self.header_name(h, "client.user_header"));
        let api_key_header = client
            .api_key_header
            .as_ref()
            .map_or(Some(HeaderName::from_static("x-api-key")), |h| self.header_name(h, "client.api_key_header"));
        let jwt = client.jwt.as_ref().and_then(|j| self.jwt(j));
        ClientConfig {
            jwt,
            trusted_proxies: trusted,
            ipv6_prefix,
            user_header: user_header.unwrap_or(HeaderName::from_static("x-user-id")),
            api_key_header: api_key_header.unwrap_or(HeaderName::from_static("x-api-key")),
            request_id_in_response: client.request_id_in_response.unwrap_or(true),
        }
    }

    /// `[client] jwt`: reads the key file (relative to the config file) and
    /// checks that it can verify at least one configured algorithm.
    fn jwt(&mut self, raw: &Spanned<RawJwt>) -> Option<crate::wire::identity::JwtConfig> {
        use crate::wire::identity::{JwtConfig, JwtVerifier, KeySource};
        let j = raw.get_ref();
        let header = match &j.header {
            Some(h) => self.header_name(h, "client.jwt.header")?,
            None => HeaderName::from_static("authorization"),
        };
        let mut algorithms = Vec::new();
        match &j.algorithms {
            None => algorithms.push(jsonwebtoken::Algorithm::RS256),
            Some(list) => {
                for a in list {
                    match a.get_ref().parse::<jsonwebtoken::Algorithm>() {
                        Ok(alg) => algorithms.push(alg),
                        Err(_) => self.error(
                            a.span(),
                            format!(
                                "{:?} is not a JWT algorithm such as \"RS256\", \"ES256\" or \"HS256\"",
                                a.get_ref()
                            ),
                        ),
                    }
                }
            }
        }
        let keys = match (&j.key_file, &j.jwks_file) {
            (Some(k), None) => self.read_relative(k).map(|(path, bytes)| KeySource::Key { path, bytes }),
            (None, Some(k)) => self.read_relative(k).map(|(path, bytes)| KeySource::Jwks { path, bytes }),
            _ => {
                self.error(
                    raw.span(),
                    "client.jwt needs exactly one of key_file (a PEM public key or an HMAC secret) and jwks_file",
                );
                None
            }
        }?;
        let leeway = match &j.leeway {
            Some(l) => match parse_duration(l.get_ref()) {
                Ok(d) => d.as_secs(),
                Err(e) => {
                    self.error(l.span(), format!("client.jwt.leeway {:?} is not a duration ({e})", l.get_ref()));
                    0
                }
            },
            None => 30,
        };
        let config = JwtConfig {
            header,
            algorithms,
            keys,
            issuer: j.issuer.clone(),
            audience: j.audience.clone(),
            claim: j.claim.clone().unwrap_or_else(|| "sub".to_string()),
            leeway,
        };
        if let Err(e) = JwtVerifier::new(&config) {
            let span = j.key_file.as_ref().or(j.jwks_file.as_ref()).map_or(raw.span(), |s| s.span());
            self.error(span, format!("client.jwt: {e}"));
            return None;
        }
        Some(config)
    }
}
