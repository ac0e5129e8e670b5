//! One spelling per request: the path, host, method and header names are
//! brought to one canonical form, or refused, once, before routing and rule
//! matching.
//!
//! A rule is only as strong as its matcher's agreement with the upstream:
//! `/api/login/`, `//api/login`, `/api/./login`, `/api/%6Cogin` and
//! `/api/login;x=1` are all `/api/login` to common upstream frameworks, so
//! they must be to tollgate too. The upstream then receives exactly the
//! canonical path that was matched (see README, "Request normalisation"),
//! so the two can never disagree about what was asked for.

use std::borrow::Cow;

use http::header::{HOST, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Version};
use serde::Deserialize;

/// `[listen] encoded_slashes`: what a `%2F` or `%5C` (or a raw `\`) in a
/// request path means. Upstreams disagree (some decode it to a separator,
/// some keep it as a character), so by default such a path is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum EncodedSlashes {
    /// 400 Bad Request.
    #[default]
    Reject,
    /// Kept encoded: part of a segment, never a separator.
    Keep,
    /// Decoded to `/`, a separator, before dot segments are resolved.
    Decode,
}

/// How requests are brought to one spelling before matching
/// (see [`crate::wire::normalize`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Normalization {
    /// `[listen] merge_slashes` (default true): `//a///b` is `/a/b`.
    pub merge_slashes: bool,
    /// `[listen] encoded_slashes` (default `reject`).
    pub encoded_slashes: EncodedSlashes,
    /// `[listen] underscores_in_headers` (default false: header names with
    /// `_` are dropped).
    pub underscores_in_headers: bool,
}

impl Default for Normalization {
    fn default() -> Normalization {
        Normalization { merge_slashes: true, encoded_slashes: EncodedSlashes::Reject, underscores_in_headers: false }
    }
}

/// Bytes kept as they are in a canonical path segment: RFC 3986's unreserved
/// characters and the sub-delimiters, `:` and `@`, except `;` (the path
/// parameter delimiter, which is stripped). Every other byte is written as
/// `%XX` with upper-case hex, and `%XX` of one of these is decoded, so that
/// every spelling of a segment has one canonical form.
fn plain(b: u8) -> bool {
    b.is_ascii_alphanumeric()
        || matches!(b, b'-' | b'.' | b'_' | b'~' | b'!' | b'$' | b'&' | b'\'' | b'(' | b')' | b'*' | b'+' | b',')
        || matches!(b, b'=' | b':' | b'@')
}

/// Why a path has no canonical form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathError {
    /// A `%` not followed by two hex digits.
    BadEscape,
    /// `%2F`, `%5C` or a raw `\` with `encoded_slashes = "reject"`.
    EncodedSlash,
}

impl PathError {
    /// The sentence for the 400 answer, or for a config error.
    pub fn reason(self) -> &'static str {
        match self {
            PathError::BadEscape => "The request path has a '%' that is not followed by two hex digits.",
            PathError::EncodedSlash => "The request path contains an encoded '/' or '\\', which this proxy refuses.",
        }
    }
}

/// The canonical form of an origin-form path (one starting with `/`):
/// percent-encodings decoded where the byte needs none and upper-cased where
/// it does, `;parameters` removed from every segment, `.` and `..` segments
/// resolved (never above the root), and runs of `/` merged unless
/// `merge_slashes` is off. A trailing `/` is kept. Any other target (`*`) is
/// returned as it is. Borrows when the path is already canonical, the common
/// case, so it costs one scan.
pub fn path<'a>(raw: &'a str, opts: &Normalization) -> Result<Cow<'a, str>, PathError> {
    if !raw.starts_with('/') || is_canonical(raw.as_bytes(), opts) {
        return Ok(Cow::Borrowed(raw));
    }
    let bytes = raw.as_bytes();
    let mut out = String::with_capacity(raw.len());
    let mut seg = String::new();
    let mut in_params = false;
    let mut i = 1;
    while i < bytes.len() {
        let b = bytes[i];
        i += 1;
        match b {
            b'/' => {
                end_segment(&mut out, &mut seg, opts.merge_slashes);
                in_params = false;
            }
            _ if in_params => {}
            b';' => in_params = true,
            b'%' => {
                let hex = |k: usize| bytes.get(k).and_then(|c| (*c as char).to_digit(16));
                let (Some(hi), Some(lo)) = (hex(i), hex(i + 1)) else { return Err(PathError::BadEscape) };
                i += 2;
                let d = (hi * 16 + lo) as u8;
                if d == b'/' || d == b'\\' {
                    slash(d, opts.encoded_slashes, &mut out, &mut seg, opts.merge_slashes)?;
                } else {
                    push_canonical(&mut seg, d);
                }
            }
            b'\\' => slash(b, opts.encoded_slashes, &mut out, &mut seg, opts.merge_slashes)?,
            _ => push_canonical(&mut seg, b),
        }
    }
    // The last segment: "/a/b/" ends with an empty one, kept as the
    // trailing slash; "/a/." and "/a/.." end in a directory too.
    let trailing = matches!(seg.as_str(), "" | "." | "..");
    end_segment(&mut out, &mut seg, true);
    if out.is_empty() || (trailing && !out.ends_with('/')) {
        out.push('/');
    }
    Ok(Cow::Owned(out))
}

/// An encoded (or, for `\`, raw) slash, handled by the setting.
fn slash(
    d: u8,
    mode: EncodedSlashes,
    out: &mut String,
    seg: &mut String,
    merge_slashes: bool,
) -> Result<(), PathError> {
    match mode {
        EncodedSlashes::Reject => return Err(PathError::EncodedSlash),
        EncodedSlashes::Keep => seg.push_str(if d == b'/' { "%2F" } else { "%5C" }),
        EncodedSlashes::Decode => end_segment(out, seg, merge_slashes),
    }
    Ok(())
}

fn push_canonical(seg: &mut String, b: u8) {
    if plain(b) {
        seg.push(b as char);
    } else {
        const HEX: &[u8; 16] = b"0123456789ABCDEF";
        seg.push('%');
        seg.push(HEX[(b >> 4) as usize] as char);
        seg.push(HEX[(b & 15) as usize] as char);
    }
}

/// Appends the finished segment `seg` to `out` (as `/seg`), resolving dot
/// segments, and clears it.
fn end_segment(out: &mut String, seg: &mut String, merge_slashes: bool) {
    match seg.as_str() {
        "." => {}
        ".." => {
            // Up one segment; never above the root.
            let cut = out.rfind('/').unwrap_or(0);
            out.truncate(cut);
        }
        "" if merge_slashes => {}
        s => {
            out.push('/');
            out.push_str(s);
        }
    }
    seg.clear();
}

/// Whether `path` (starting with `/`) is already canonical: only plain
/// bytes, `/` and upper-case escapes of bytes that need one, no dot segment,
/// no empty segment except a trailing one (or any, with `merge_slashes`
/// off).
fn is_canonical(path: &[u8], opts: &Normalization) -> bool {
    let upper_hex = |b: Option<&u8>| b.and_then(|b| (b.is_ascii_digit() || (b'A'..=b'F').contains(b)).then_some(*b));
    let mut seg_start = 1;
    let mut i = 1;
    while i <= path.len() {
        let at_end = match path.get(i) {
            Some(b'%') => {
                let (Some(hi), Some(lo)) = (upper_hex(path.get(i + 1)), upper_hex(path.get(i + 2))) else {
                    return false;
                };
                let digit = |c: u8| if c.is_ascii_digit() { c - b'0' } else { c - b'A' + 10 };
                let d = digit(hi) * 16 + digit(lo);
                let slash_kept = opts.encoded_slashes == EncodedSlashes::Keep;
                if plain(d) || ((d == b'/' || d == b'\\') && !slash_kept) {
                    return false;
                }
                i += 3;
                continue;
            }
            Some(&b) if b != b'/' => {
                if !plain(b) {
                    return false;
                }
                i += 1;
                continue;
            }
            b => b.is_none(),
        };
        let seg = &path[seg_start..i];
        if seg == b"." || seg == b".." || (seg.is_empty() && opts.merge_slashes && !at_end) {
            return false;
        }
        seg_start = i + 1;
        i += 1;
    }
    true
}

/// The path rules compare and key on: the canonical path without its
/// trailing `/`, so `/api/login/` counts as `/api/login`, as most upstream
/// routers treat it.
pub fn match_path(canonical: &str) -> &str {
    match canonical.strip_suffix('/') {
        Some(p) if !p.is_empty() => p,
        _ => canonical,
    }
}

/// The host a request is for, checked as RFC 9112 §3.2 and RFC 9113
/// §8.3.1 ask.
pub struct Host {
    /// Lower-cased, without port or trailing dot: what routes and
    /// `match.host` compare.
    pub name: String,
    /// The `Host` header the upstream must receive when it differs from the
    /// client's (the authority came from the request target, or was
    /// spelled differently from its canonical form); `None`: keep the
    /// client's.
    pub rewrite: Option<HeaderValue>,
}

/// The request's host: the target's authority (absolute form, or HTTP/2's
/// `:authority`) when it has one, else the `Host` header. Refused with 400:
/// an HTTP/1.1 request without `Host`, any request with more than one, a
/// `Host` that is not a valid authority or carries user information, and an
/// HTTP/2 request whose `Host` names another host than `:authority`.
/// `Err` carries the sentence for the 400 answer.
pub fn host<B>(req: &Request<B>) -> Result<Option<Host>, &'static str> {
    let mut values = req.headers().get_all(HOST).iter();
    let header = values.next();
    if values.next().is_some() {
        return Err("The request has more than one Host header.");
    }
    let header = match header {
        Some(v) => Some(split_authority(v.as_bytes()).ok_or("The Host header is not a valid host.")?),
        None => None,
    };
    let target = match req.uri().authority() {
        Some(a) => Some(split_authority(a.as_str().as_bytes()).ok_or("The request target's host is not valid.")?),
        None => None,
    };
    if req.version() == Version::HTTP_11 && header.is_none() {
        return Err("An HTTP/1.1 request must have a Host header.");
    }
    if req.version() == Version::HTTP_2
        && let (Some(t), Some(h)) = (target, header)
        && !same_host(t.0, h.0)
    {
        return Err("The Host header names another host than :authority.");
    }
    // Absolute form: the target's authority wins and the Host header is
    // replaced (RFC 9112 §3.2.2).
    let ((raw, port), from_target) = match (target, header) {
        (Some(t), _) => (t, true),
        (None, Some(h)) => (h, false),
        (None, None) => return Ok(None),
    };
    let name = canonical_host(raw);
    // The client's Host stays as it is unless it was spelled otherwise
    // (the common case costs no allocation beyond `name`).
    let rewrite = if from_target || name != raw {
        let host = if name.contains(':') { format!("[{name}]") } else { name.clone() };
        let spelled = match port {
            Some(p) => format!("{host}:{p}"),
            None => host,
        };
        HeaderValue::from_str(&spelled).ok()
    } else {
        None
    };
    Ok(Some(Host { name, rewrite }))
}

/// A host as routes and rules compare it: lower-cased, without a trailing
/// dot (`Example.COM.` is `example.com` to DNS and to virtual hosting).
/// Configured hosts are written the same way at load.
pub fn canonical_host(host: &str) -> String {
    host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase()
}

/// `host[:port]` or `[v6]:port`, checked: the host (brackets removed) and
/// the port if one was given. `None` for anything else, `user@` included.
fn split_authority(value: &[u8]) -> Option<(&str, Option<&str>)> {
    let value = std::str::from_utf8(value).ok()?;
    let (host, port) = if let Some(rest) = value.strip_prefix('[') {
        let (v6, after) = rest.split_once(']')?;
        v6.parse::<std::net::Ipv6Addr>().ok()?;
        (v6, after)
    } else {
        // One pass on every request: the host runs to the first byte a
        // reg-name cannot hold, which can only be the port's colon.
        let end = value.bytes().position(|b| !REG_NAME[usize::from(b)]).unwrap_or(value.len());
        if end == 0 {
            return None;
        }
        value.split_at(end)
    };
    if port.is_empty() {
        return Some((host, None));
    }
    let port = port.strip_prefix(':')?;
    let port_ok = !port.is_empty() && port.len() <= 5 && port.bytes().all(|b| b.is_ascii_digit());
    port_ok.then_some((host, Some(port)))
}

/// The bytes of an RFC 3986 reg-name that a host may hold here: letters,
/// digits, `-`, `.`, `_` and `~` (percent-encoding and sub-delims are
/// refused), by byte value.
static REG_NAME: [bool; 256] = {
    let mut t = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        t[b] = c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~');
        b += 1;
    }
    t
};

/// Whether two hosts name the same one (case and a trailing dot aside).
fn same_host(a: &str, b: &str) -> bool {
    a.strip_suffix('.').unwrap_or(a).eq_ignore_ascii_case(b.strip_suffix('.').unwrap_or(b))
}

/// Methods are case-sensitive tokens, but some upstream servers (gunicorn,
/// for one) upper-case what they receive: `post` would run as POST while
/// missing every `methods = ["POST"]` rule. A method with a lower-case
/// letter is refused, as nginx does; upper-case extension methods
/// (`PROPFIND`) pass as they are.
pub fn method(m: &Method) -> Result<(), &'static str> {
    if m.as_str().bytes().any(|b| b.is_ascii_lowercase()) {
        return Err("The request method must be upper case.");
    }
    Ok(())
}

/// The headers with which frameworks (Rack, Express's method-override,
/// Symfony, many API gateways) let a request run as another method: a
/// `POST` carrying `X-HTTP-Method-Override: DELETE` is a DELETE to them.
pub const METHOD_OVERRIDES: [HeaderName; 3] = [
    HeaderName::from_static("x-http-method-override"),
    HeaderName::from_static("x-http-method"),
    HeaderName::from_static("x-method-override"),
];

/// The method a method-override header asks for, if the request carries
/// one (checked by [`method_override`] first).
pub fn overriding_method(headers: &HeaderMap) -> Option<&[u8]> {
    METHOD_OVERRIDES.iter().find_map(|n| headers.get(n)).map(|v| v.as_bytes())
}

/// The methods an override may name: RFC 9110's and PATCH. Any other token
/// would be a fresh `method` key part for each spelling a client makes up.
const OVERRIDABLE: [&[u8]; 9] =
    [b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"CONNECT", b"OPTIONS", b"TRACE", b"PATCH"];

/// Refuses method-override headers that could be read two ways: given more
/// than once or under two names with different values (frameworks read
/// different ones), or not a standard method in upper case (some frameworks
/// upper-case it; a made-up token is a bucket per token).
pub fn method_override(headers: &HeaderMap) -> Result<(), &'static str> {
    let mut seen: Option<&[u8]> = None;
    for name in &METHOD_OVERRIDES {
        let mut values = headers.get_all(name).iter();
        let Some(v) = values.next() else { continue };
        if values.next().is_some() || seen.is_some_and(|s| s != v.as_bytes()) {
            return Err("The request names its method override more than once.");
        }
        if !OVERRIDABLE.contains(&v.as_bytes()) {
            return Err(
                "A method override must name a standard method in upper case (GET, HEAD, POST, PUT, DELETE, CONNECT, OPTIONS, TRACE or PATCH).",
            );
        }
        seen = Some(v.as_bytes());
    }
    Ok(())
}

/// Drops every header whose name contains `_`: WSGI and CGI upstreams read
/// `X_User_Id` as `X-User-Id`, a header tollgate never looked at under that
/// name (nginx's `underscores_in_headers off`).
pub fn drop_underscored(headers: &mut HeaderMap) {
    if !headers.keys().any(underscored) {
        return;
    }
    let names: Vec<HeaderName> = headers.keys().filter(|k| underscored(k)).cloned().collect();
    for name in names {
        headers.remove(&name);
    }
}

/// Whether a header name holds `_`: eight bytes at a time (a byte whose
/// XOR with `_` is zero), since every request's names are checked.
fn underscored(name: &HeaderName) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const UNDERSCORES: u64 = ONES * b'_' as u64;
    let bytes = name.as_str().as_bytes();
    let mut words = bytes.chunks_exact(8);
    let zero_byte = |w: u64| (w.wrapping_sub(ONES) & !w & (ONES << 7)) != 0;
    words.by_ref().any(|w| zero_byte(u64::from_le_bytes(std::array::from_fn(|i| w[i])) ^ UNDERSCORES))
        || words.remainder().contains(&b'_')
}

/// The first of `names` that the request carries more than once: the
/// headers some rule reads, which upstream frameworks may read as the last
/// value or all values joined while tollgate reads one.
pub fn repeated<'n>(headers: &HeaderMap, names: &'n [HeaderName]) -> Option<&'n HeaderName> {
    // No name appears twice (the common case): nothing to look up.
    if headers.len() == headers.keys_len() {
        return None;
    }
    names.iter().find(|n| {
        let mut values = headers.get_all(*n).iter();
        values.next().is_some() && values.next().is_some()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(merge_slashes: bool, encoded_slashes: EncodedSlashes) -> Normalization {
        Normalization { merge_slashes, encoded_slashes, underscores_in_headers: false }
    }

    fn norm(p: &str) -> Result<String, PathError> {
        path(p, &opts(true, EncodedSlashes::Reject)).map(Cow::into_owned)
    }

    #[test]
    fn every_spelling_of_a_path_is_one_path() {
        for p in [
            "/api/login",
            "//api/login",
            "/api//login",
            "/api/./login",
            "/./api/login",
            "/api/x/../login",
            "/../api/login",
            "/api/%6Cogin",
            "/api/%6cogin",
            "/%61pi/login",
            "/api/login;jsessionid=1",
            "/api;v=2/login",
            "/api/%2E/login",
            "/api/x/%2e%2E/login",
            "/api/login;a/../login",
        ] {
            assert_eq!(norm(p).as_deref(), Ok("/api/login"), "{p}");
        }
        assert_eq!(norm("/api/login/").as_deref(), Ok("/api/login/"));
        assert_eq!(norm("/api/login/.").as_deref(), Ok("/api/login/"));
        assert_eq!(norm("/api/login/x/..").as_deref(), Ok("/api/login/"));
        assert_eq!(norm("/..").as_deref(), Ok("/"));
        assert_eq!(norm("//").as_deref(), Ok("/"));
        assert_eq!(norm("/").as_deref(), Ok("/"));
        assert_eq!(norm("*").as_deref(), Ok("*"));
    }

    #[test]
    fn reserved_and_unsafe_bytes_keep_one_encoding() {
        assert_eq!(norm("/a%3bb").as_deref(), Ok("/a%3Bb"));
        assert_eq!(norm("/a%3Fb%23").as_deref(), Ok("/a%3Fb%23"));
        assert_eq!(norm("/a%25").as_deref(), Ok("/a%25"));
        assert_eq!(norm("/caf%c3%a9").as_deref(), Ok("/caf%C3%A9"));
        assert_eq!(norm("/a%3a%40%21").as_deref(), Ok("/a:@!"));
        assert_eq!(norm("/a\"{b}|").as_deref(), Ok("/a%22%7Bb%7D%7C"));
        assert_eq!(norm("/a%20b").as_deref(), Ok("/a%20b"));
    }

    #[test]
    fn bad_escapes_and_encoded_slashes() {
        for p in ["/a%", "/a%4", "/a%zz", "/a%4g"] {
            assert_eq!(norm(p), Err(PathError::BadEscape), "{p}");
        }
        for p in ["/a%2Fb", "/a%2fb", "/a%5Cb", "/a\\b"] {
            assert_eq!(norm(p), Err(PathError::EncodedSlash), "{p}");
        }
        let keep = opts(true, EncodedSlashes::Keep);
        assert_eq!(path("/a%2fb\\c", &keep).as_deref(), Ok("/a%2Fb%5Cc"));
        let decode = opts(true, EncodedSlashes::Decode);
        assert_eq!(path("/api%2Flogin", &decode).as_deref(), Ok("/api/login"));
        assert_eq!(path("/api%2F..%2Fadmin", &decode).as_deref(), Ok("/admin"));
        assert_eq!(path("/api\\login", &decode).as_deref(), Ok("/api/login"));
    }

    #[test]
    fn slashes_can_be_kept() {
        let o = opts(false, EncodedSlashes::Reject);
        assert_eq!(path("//api//login", &o).as_deref(), Ok("//api//login"));
        assert_eq!(path("/api//./login", &o).as_deref(), Ok("/api//login"));
        assert_eq!(path("/api//../login", &o).as_deref(), Ok("/api/login"));
    }

    #[test]
    fn canonical_paths_are_borrowed() {
        let o = opts(true, EncodedSlashes::Reject);
        for p in ["/", "/api/login", "/api/login/", "/a.b/c..d/.e", "/a:b@c!$&'()*+,=~-_", "/caf%C3%A9/%25"] {
            assert!(matches!(path(p, &o), Ok(Cow::Borrowed(_))), "{p}");
        }
    }

    /// Every canonical form is its own canonical form, and the fast path
    /// (`is_canonical`) agrees with the slow one, over every path of up to
    /// five pieces from an alphabet of the tricky ones.
    #[test]
    fn the_canonical_form_is_a_fixed_point() {
        const PIECES: [&str; 11] = ["/", ".", "..", "%2e", "%2F", "a", ";x", "%41", "%", "\\", "%7e"];
        for merge in [true, false] {
            for mode in [EncodedSlashes::Reject, EncodedSlashes::Keep, EncodedSlashes::Decode] {
                let o = opts(merge, mode);
                for n in 0..PIECES.len().pow(5) {
                    let mut p = String::from("/");
                    let mut k = n;
                    for _ in 0..5 {
                        p.push_str(PIECES[k % PIECES.len()]);
                        k /= PIECES.len();
                    }
                    let Ok(once) = path(&p, &o) else { continue };
                    match path(&once, &o) {
                        Ok(Cow::Borrowed(twice)) => assert_eq!(twice, once, "{p}"),
                        other => panic!("{p} -> {once} -> {other:?}"),
                    }
                }
            }
        }
    }

    #[test]
    fn match_path_drops_one_trailing_slash() {
        assert_eq!(match_path("/api/login/"), "/api/login");
        assert_eq!(match_path("/api/login"), "/api/login");
        assert_eq!(match_path("/"), "/");
    }

    fn req(version: Version, uri: &str, hosts: &[&str]) -> Request<()> {
        let mut b = Request::builder().version(version).uri(uri);
        for h in hosts {
            b = b.header(HOST, *h);
        }
        b.body(()).expect("request")
    }

    #[test]
    fn hosts_follow_rfc_9112() {
        let h = host(&req(Version::HTTP_11, "/", &["Example.COM.:8080"])).expect("ok").expect("host");
        assert_eq!(h.name, "example.com");
        assert_eq!(h.rewrite.as_ref().map(|v| v.to_str().expect("ascii")), Some("example.com:8080"));
        let h = host(&req(Version::HTTP_11, "/", &["example.com"])).expect("ok").expect("host");
        assert!(h.rewrite.is_none());
        // Absolute form: the target's host wins and is sent upstream.
        let h = host(&req(Version::HTTP_11, "http://other.test/x", &["example.com"])).expect("ok").expect("host");
        assert_eq!(h.name, "other.test");
        assert_eq!(h.rewrite.as_ref().map(|v| v.to_str().expect("ascii")), Some("other.test"));
        let h = host(&req(Version::HTTP_11, "/", &["[::1]:80"])).expect("ok").expect("host");
        assert_eq!(h.name, "::1");
        assert!(host(&req(Version::HTTP_10, "/", &[])).expect("ok").is_none());
        for bad in [
            req(Version::HTTP_11, "/", &[]),
            req(Version::HTTP_11, "/", &["a.test", "b.test"]),
            req(Version::HTTP_10, "/", &["a.test", "a.test"]),
            req(Version::HTTP_11, "/", &["a b"]),
            req(Version::HTTP_11, "/", &["user@a.test"]),
            req(Version::HTTP_11, "http://u@a.test/", &["a.test"]),
            req(Version::HTTP_2, "http://a.test/", &["b.test"]),
        ] {
            assert!(host(&bad).is_err(), "{:?}", bad);
        }
        assert!(host(&req(Version::HTTP_2, "http://a.test/", &["A.test"])).is_ok());
    }

    #[test]
    fn authorities_split_into_host_and_port() {
        let ok: [(&str, (&str, Option<&str>)); 6] = [
            ("a.test", ("a.test", None)),
            ("a.test:8080", ("a.test", Some("8080"))),
            ("127.0.0.1:1", ("127.0.0.1", Some("1"))),
            ("[::1]", ("::1", None)),
            ("[::1]:443", ("::1", Some("443"))),
            ("A_b~c-d.", ("A_b~c-d.", None)),
        ];
        for (raw, want) in ok {
            assert_eq!(split_authority(raw.as_bytes()), Some(want), "{raw}");
        }
        let bad = [
            "",
            ":80",
            "a:b:80",
            "a.test:",
            "a.test:123456",
            "a.test:8a",
            "[::1",
            "[::1]x",
            "[::1]:",
            "[zz]",
            "é.test",
            "a b",
        ];
        for raw in bad {
            assert_eq!(split_authority(raw.as_bytes()), None, "{raw}");
        }
        assert_eq!(split_authority(b"a\xff.test"), None);
    }

    #[test]
    fn lower_case_methods_are_refused() {
        assert!(method(&Method::POST).is_ok());
        assert!(method(&Method::from_bytes(b"PROPFIND").expect("method")).is_ok());
        for m in ["post", "Get", "propfind"] {
            assert!(method(&Method::from_bytes(m.as_bytes()).expect("method")).is_err(), "{m}");
        }
    }

    #[test]
    fn underscored_names_are_dropped_and_repeats_found() {
        let mut h = HeaderMap::new();
        h.append("x-user-id", HeaderValue::from_static("alice"));
        h.append(HeaderName::from_static("x_user_id"), HeaderValue::from_static("admin"));
        drop_underscored(&mut h);
        assert_eq!(h.len(), 1);
        let names = [HeaderName::from_static("x-api-key"), HeaderName::from_static("x-user-id")];
        assert!(repeated(&h, &names).is_none());
        h.append("x-user-id", HeaderValue::from_static("bob"));
        assert_eq!(repeated(&h, &names), Some(&names[1]));
    }

    /// The word-at-a-time check finds `_` at every position of names of
    /// every length up to three words, and nothing in names without one
    /// (`^` and `` ` `` are the bytes either side of it).
    #[test]
    fn an_underscore_is_found_anywhere_in_a_name() {
        for len in 1..=24 {
            let plain: Vec<u8> = (0..len).map(|i| [b'a', b'^', b'`', b'-', b'9'][i % 5]).collect();
            let name = HeaderName::from_bytes(&plain).expect("a token");
            assert!(!underscored(&name), "{name}");
            for at in 0..len {
                let mut with = plain.clone();
                with[at] = b'_';
                let name = HeaderName::from_bytes(&with).expect("a token");
                assert!(underscored(&name), "{name}");
            }
        }
    }
}
