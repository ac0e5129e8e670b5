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
    // Eight digits at a time in one u64, a byte per digit, instead of a
    // table look-up per digit (this runs on every request).
    out[..8].copy_from_slice(&hex8((n >> 32) as u32));
    out[8..].copy_from_slice(&hex8(n as u32));
}

/// `n` as 8 lower-case hex digits.
fn hex8(n: u32) -> [u8; 8] {
    // Spread the nibbles apart, the most significant into the highest
    // byte: 0x1234abcd becomes 0x010203040a0b0c0d.
    let x = n as u64;
    let x = ((x & 0xffff_0000) << 16) | (x & 0xffff);
    let x = ((x & 0x0000_ff00_0000_ff00) << 8) | (x & 0x0000_00ff_0000_00ff);
    let x = ((x & 0x00f0_00f0_00f0_00f0) << 4) | (x & 0x000f_000f_000f_000f);
    // '0' + d for every digit, and 'a' - '0' - 10 more where d > 9 (where
    // d + 6 carries into the byte's high nibble).
    let letters = ((x + 0x0606_0606_0606_0606) >> 4) & 0x0101_0101_0101_0101;
    (x + 0x3030_3030_3030_3030 + letters * (b'a' - b'0' - 10) as u64).to_be_bytes()
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
    let mut id = HeaderValue::from_maybe_shared(Bytes::from_owner(buf)).unwrap_or(HeaderValue::from_static("-"));
    // Never indexed by HPACK: a value no later message repeats would only
    // push useful entries out of an HTTP/2 connection's table, and cost an
    // insertion per response (the same bytes on the wire otherwise).
    id.set_sensitive(true);
    id
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
pub fn push_json(out: &mut Vec<u8>, id: &HeaderValue) {
    // The common case (a generated id: hex digits and '-'): one copy, no
    // UTF-8 check (bytes, not a `String`). The check is a fold without an
    // early exit, which the compiler vectorises (a byte-by-byte `all` cost
    // some 400 instructions per rejection).
    let bytes = id.as_bytes();
    let escaped = bytes.iter().fold(false, |acc, &b| acc | !(b'!'..=b'~').contains(&b) | (b == b'"') | (b == b'\\'));
    if !escaped {
        out.extend_from_slice(bytes);
        return;
    }
    for &b in bytes {
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'!'..=b'~' => out.push(b),
            // Not reachable for an assigned id; kept out of the JSON all the same.
            _ => out.push(b'?'),
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
    fn hex_digits_are_what_fmt_writes() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let samples = [0, 1, 9, 10, 15, 16, 0xa, 0xf0, 0x0123_4567_89ab_cdef, u64::MAX, u64::MAX - 1, 1 << 63];
        for n in samples.into_iter().chain((0..10_000).map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        })) {
            let mut out = [0u8; 16];
            hex(n, &mut out);
            assert_eq!(std::str::from_utf8(&out).expect("ascii"), format!("{n:016x}"));
        }
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
        let mut s = b"\"".to_vec();
        push_json(&mut s, &HeaderValue::from_static(r#"a"b\c"#));
        s.push(b'"');
        assert_eq!(serde_json::from_slice::<String>(&s).expect("json"), r#"a"b\c"#);
        let id = generate();
        let mut s = Vec::new();
        push_json(&mut s, &id);
        assert_eq!(s, id.as_bytes());
        let mut s = Vec::new();
        push_json(&mut s, &HeaderValue::from_static("a b"));
        assert_eq!(s, b"a?b");
    }
}
