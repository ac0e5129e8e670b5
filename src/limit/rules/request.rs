//! What a rule reads of a request: whether its `match` holds, and the
//! bucket key the request counts under.

use std::fmt::Write as _;

use super::facts::RequestFacts;
use super::rule::Rule;
use crate::config::key::{encode, push_sha256_hex, tag};
use crate::config::{KeyPart, PathPattern};

impl Rule {
    /// The `method` key part: the method the upstream runs (an override's,
    /// if given), except that a rule listing `methods` keys on the listed
    /// method it matched, so that an override the rule does not list cannot
    /// move a request into a bucket of its own.
    fn keyed_method<'f>(&self, f: &RequestFacts<'f>) -> &'f [u8] {
        let real = f.method.as_str().as_bytes();
        let Some(o) = crate::wire::normalize::overriding_method(f.headers) else { return real };
        let listed = &self.spec.matcher.methods;
        if listed.is_empty() || listed.iter().any(|x| x.as_str().as_bytes() == o) { o } else { real }
    }

    /// Whether every condition of the rule's `match` holds.
    pub fn matches(&self, f: &RequestFacts<'_>) -> bool {
        let m = &self.spec.matcher;
        if !self.spec.exempt.is_empty() && self.spec.exempt.contains(f.client_ip, f.user, f.api_key) {
            return false;
        }
        // A method override counts as the method it names, as well as the
        // method it came with: whichever the upstream runs, the rule holds.
        if !m.methods.is_empty()
            && !m.methods.iter().any(|x| x == f.method)
            && !crate::wire::normalize::overriding_method(f.headers)
                .is_some_and(|o| m.methods.iter().any(|x| x.as_str().as_bytes() == o))
        {
            return false;
        }
        if !path_fits(m.path.as_ref(), f.path) {
            return false;
        }
        if let Some(h) = &m.host
            && f.host != Some(h.as_str())
        {
            return false;
        }
        if let Some(route) = &m.route
            && !f.route.is_some_and(|(name, upstream)| name == route || upstream == route)
        {
            return false;
        }
        if let Some((name, value)) = &m.header
            && f.headers.get(name).is_none_or(|v| v.as_bytes() != value.as_bytes())
        {
            return false;
        }
        true
    }

    /// Writes this request's bucket key into `out` (cleared first).
    ///
    /// The key is the encoded rule name followed by one `tag=value` per key
    /// part, separated by `|`. Values are percent-encoded, so no value can
    /// contain a `|` and two different requests can never produce the same
    /// key by shifting text between parts (user "a|b" vs user "a" + path
    /// "b"). A part the request lacks (no user header for `user`) falls back
    /// to the client IP under the tag `ip`, so leaving a header out never
    /// escapes a limit and never shares a bucket with a real user id. An
    /// API key is a secret and appears as `sha256:` and its SHA-256 in hex.
    ///
    /// `Err` (the sentence for a 400 answer) when a query parameter the key
    /// reads comes more than once: which of its values the upstream reads
    /// is not ours to guess.
    pub fn key(&self, f: &RequestFacts<'_>, out: &mut String) -> Result<(), String> {
        out.clear();
        out.push_str(&self.key_prefix);
        for (i, part) in self.spec.key.iter().enumerate() {
            if i > 0 {
                out.push('|');
            }
            let query;
            let value: Option<&[u8]> = match part {
                KeyPart::Ip => None,
                KeyPart::User => f.user,
                KeyPart::ApiKey => f.api_key,
                KeyPart::Route => Some(f.route.map_or("", |r| r.0).as_bytes()),
                KeyPart::Method => Some(self.keyed_method(f)),
                KeyPart::Path => Some(crate::wire::normalize::match_path(f.path).as_bytes()),
                KeyPart::ClientCert => f.client_cert,
                KeyPart::Header(h) => f.headers.get(h).map(|v| v.as_bytes()),
                KeyPart::Query(q) => {
                    query = query_param(f.query, q)
                        .map_err(|()| format!("query parameter {q:?} must not be given more than once"))?;
                    query.as_deref()
                }
            };
            match value.filter(|v| !v.is_empty() || matches!(part, KeyPart::Route)) {
                Some(v) if matches!(part, KeyPart::ApiKey) => {
                    // A secret: keys end up in Redis key names and debug
                    // logs, so they carry its SHA-256, never the key itself,
                    // spelled as an override names it.
                    out.push_str("api_key=sha256:");
                    push_sha256_hex(out, v);
                }
                Some(v) => {
                    out.push_str(tag(part));
                    out.push('=');
                    encode(out, v);
                }
                None => {
                    // `write!` to a String cannot fail.
                    let _ = write!(out, "ip={}", f.client);
                }
            }
        }
        Ok(())
    }
}

/// Whether a canonical request path fits a rule's `match.path`: an exact
/// path ignores one trailing `/`, and `"/api/*"` covers `/api` too, as most
/// routers treat them.
pub(super) fn path_fits(pattern: Option<&PathPattern>, path: &str) -> bool {
    match pattern {
        None => true,
        Some(PathPattern::Exact(p)) => p == crate::wire::normalize::match_path(path),
        Some(PathPattern::Prefix(p)) => path.starts_with(p.as_str()) || p.strip_suffix('/') == Some(path),
    }
}

/// The value of query parameter `name`, decoded as upstream frameworks
/// decode form-encoded queries (`%XX`, and `+` for a space), so that
/// `?user=%62ob` and `?user=bob` are one key. `Err` when the parameter
/// comes more than once (under any spelling of its name).
fn query_param(query: Option<&str>, name: &str) -> Result<Option<Vec<u8>>, ()> {
    let Some(query) = query else { return Ok(None) };
    let mut found = None;
    for pair in query.split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if form_decode(k) == name.as_bytes() {
            if found.is_some() {
                return Err(());
            }
            found = Some(form_decode(v));
        }
    }
    Ok(found)
}

/// `application/x-www-form-urlencoded` decoding; an invalid `%` escape is
/// kept as it is, as common frameworks do.
pub(crate) fn form_decode(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |k: usize| b.get(k).and_then(|c| (*c as char).to_digit(16));
        match (b[i], hex(i + 1), hex(i + 2)) {
            (b'%', Some(hi), Some(lo)) => {
                out.push((hi * 16 + lo) as u8);
                i += 3;
                continue;
            }
            (b'+', _, _) => out.push(b' '),
            (c, _, _) => out.push(c),
        }
        i += 1;
    }
    out
}
