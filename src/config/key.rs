//! How a bucket key is spelled: the tag of each key part and the encoding
//! of its value. One spelling, used by the rules per request and by
//! `[[rule.override]]` at load time, whose keys must match exactly.

use std::fmt::Write as _;

use super::KeyPart;

/// The tag of a key part in bucket keys.
pub fn tag(part: &KeyPart) -> &'static str {
    match part {
        KeyPart::Ip => "ip",
        KeyPart::User => "user",
        KeyPart::ApiKey => "api_key",
        KeyPart::Route => "route",
        KeyPart::Method => "method",
        KeyPart::Path => "path",
        KeyPart::ClientCert => "client_cert",
        KeyPart::Header(_) => "h",
        KeyPart::Query(_) => "q",
    }
}

/// Appends the SHA-256 of `value` as 64 lower-case hex digits.
pub fn push_sha256_hex(out: &mut String, value: &[u8]) {
    use sha2::Digest as _;
    for b in sha2::Sha256::digest(value) {
        let _ = write!(out, "{b:02x}");
    }
}

/// Longest key value kept as text; longer values (a client stuffing a
/// megabyte into its user header) are replaced by a hash of themselves, so a
/// key stays small and still distinct.
const MAX_VALUE_BYTES: usize = 128;

/// Appends `value`, percent-encoding every byte outside a small safe set:
/// an injective encoding that keeps `|`, `{`, `}` and control bytes out of
/// keys (the Redis store puts keys inside a `{hash tag}`).
pub fn encode(out: &mut String, value: &[u8]) {
    if value.len() > MAX_VALUE_BYTES {
        // Every instance must derive the same key, and no client may craft
        // a value whose key is a victim's: a cryptographic hash with no
        // secret, its first 128 bits (a seeded 64-bit hash was collidable
        // by anyone who read the seed).
        use sha2::Digest as _;
        out.push('~');
        for b in &sha2::Sha256::digest(value)[..16] {
            let _ = write!(out, "{b:02x}");
        }
        let _ = write!(out, "{:x}", value.len());
        return;
    }
    for &b in value {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b':' | b'/' | b'@' | b'+' | b',') {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
}
