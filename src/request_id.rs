//! `X-Request-Id`: one id per request, kept from a trusted proxy or made
//! here, sent upstream, written into every answer tollgate makes itself and
//! into the access log.
//!
//! A generated id is this process's random 64-bit prefix and a counter,
//! both as 16 hex digits (`"5f0c9a...-000000000000002a"`): unique across
//! instances and restarts without a random draw per request, and written
//! into a fixed buffer with no formatting machinery: this runs on every
//! request.

use std::hash::{BuildHasher, Hasher};
use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};

/// `X-Request-Id`.
pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The longest id accepted from a trusted proxy; a longer one is replaced.
pub const MAX_LEN: usize = 128;

/// Length of a generated id: 16 hex digits, `-`, 16 hex digits.
const GENERATED_LEN: usize = 33;

/// This process's prefix, as hex digits: drawn once from the random keys
/// the standard library seeds its hash maps with (from the OS), mixed with
/// the process id and the start time.
static PREFIX: LazyLock<[u8; 16]> = LazyLock::new(|| {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    h.write_u128(now.as_nanos());
    let mut out = [0u8; 16];
    hex(h.finish(), &mut out);
    out
});

/// Requests numbered by this process so far.
static COUNTER: AtomicU64 = AtomicU64::new(0);

/// `n` as 16 lower-case hex digits.
fn hex(n: u64, out: &mut [u8; 16]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (i, b) in out.iter_mut().enumerate() {
        *b = DIGITS[((n >> (60 - 4 * i)) & 0xf) as usize];
    }
}

/// A new id, never seen before from any tollgate process.
pub fn generate() -> HeaderValue {
    let mut buf = [0u8; GENERATED_LEN];
    buf[..16].copy_from_slice(&*PREFIX);
    buf[16] = b'-';
    let mut counter = [0u8; 16];
    hex(COUNTER.fetch_add(1, Ordering::Relaxed), &mut counter);
    buf[17..].copy_from_slice(&counter);
    // One allocation holding the bytes and their count of owners: the
    // copies for the upstream request, an error body and the access log
    // share it. Hex digits and '-': always a valid header value.
    HeaderValue::from_maybe_shared(Bytes::from_owner(buf)).unwrap_or(HeaderValue::from_static("-"))
}

/// Whether an id from a trusted proxy is kept: 1 to [`MAX_LEN`] bytes of
/// visible ASCII (no spaces, no control bytes), so that it is safe in logs
/// and headers wherever it goes next.
pub fn acceptable(v: &HeaderValue) -> bool {
    let b = v.as_bytes();
    !b.is_empty() && b.len() <= MAX_LEN && b.iter().all(|c| (b'!'..=b'~').contains(c))
}

/// The request's id: its `X-Request-Id` when a trusted proxy sent exactly one
/// acceptable value, otherwise a new one, which replaces whatever the
/// client sent. The request then carries it upstream.
pub fn assign(headers: &mut HeaderMap, trusted: bool) -> HeaderValue {
    if trusted {
        let mut given = headers.get_all(X_REQUEST_ID).iter();
        if let (Some(v), None) = (given.next(), given.next())
            && acceptable(v)
        {
            return v.clone();
        }
    }
    let id = generate();
    headers.insert(X_REQUEST_ID, id.clone());
    id
}

/// Appends `id` to `out` as the contents of a JSON string. An id is
/// visible ASCII ([`acceptable`] or generated), so only `"` and `\` need
/// escaping.
pub fn push_json(out: &mut String, id: &HeaderValue) {
    // The common case (a generated id: hex digits and '-'): one copy. The
    // check is a fold without an early exit, which the compiler vectorises
    // (a byte-by-byte `all` cost some 400 instructions per rejection).
    let bytes = id.as_bytes();
    let escaped = bytes.iter().fold(false, |acc, &b| acc | !(b'!'..=b'~').contains(&b) | (b == b'"') | (b == b'\\'));
    if !escaped && let Ok(plain) = std::str::from_utf8(bytes) {
        out.push_str(plain);
        return;
    }
    for &b in id.as_bytes() {
        match b {
            b'"' => out.push_str("\\\""),
            b'\\' => out.push_str("\\\\"),
            b'!'..=b'~' => out.push(b as char),
            // Not reachable for an assigned id; kept out of the JSON all the same.
            _ => out.push('?'),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_ids_are_distinct_and_well_formed() {
        let a = generate();
        let b = generate();
        assert_ne!(a, b);
        assert_eq!(a.len(), GENERATED_LEN);
        assert!(acceptable(&a));
        assert_eq!(&a.as_bytes()[..17], &b.as_bytes()[..17], "one prefix per process");
    }

    #[test]
    fn only_visible_ascii_ids_of_bounded_length_are_kept() {
        assert!(acceptable(&HeaderValue::from_static("abc-123_{x}")));
        assert!(!acceptable(&HeaderValue::from_static("")));
        assert!(!acceptable(&HeaderValue::from_static("a b")));
        assert!(!acceptable(&HeaderValue::from_bytes(&[b'a'; MAX_LEN + 1]).expect("value")));
        assert!(!acceptable(&HeaderValue::from_bytes("é".as_bytes()).expect("value")));
    }

    #[test]
    fn an_untrusted_id_is_replaced_and_a_trusted_one_kept() {
        let mut h = HeaderMap::new();
        h.insert(X_REQUEST_ID, HeaderValue::from_static("from-client"));
        let id = assign(&mut h, false);
        assert_ne!(id, "from-client");
        assert_eq!(h.get(X_REQUEST_ID), Some(&id));
        let mut h = HeaderMap::new();
        h.insert(X_REQUEST_ID, HeaderValue::from_static("from-proxy"));
        assert_eq!(assign(&mut h, true), "from-proxy");
        h.append(X_REQUEST_ID, HeaderValue::from_static("second"));
        assert_ne!(assign(&mut h, true), "from-proxy", "two ids: neither is kept");
        assert_eq!(h.get_all(X_REQUEST_ID).iter().count(), 1);
    }

    #[test]
    fn ids_are_escaped_in_json() {
        let mut s = String::new();
        push_json(&mut s, &HeaderValue::from_static(r#"a"b\c"#));
        assert_eq!(serde_json::from_str::<String>(&format!("\"{s}\"")).expect("json"), r#"a"b\c"#);
        let id = generate();
        let mut s = String::new();
        push_json(&mut s, &id);
        assert_eq!(s.as_bytes(), id.as_bytes());
        let mut s = String::new();
        push_json(&mut s, &HeaderValue::from_static("a b"));
        assert_eq!(s, "a?b");
    }
}
