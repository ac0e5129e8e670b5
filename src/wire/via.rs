//! `Via` (RFC 9110 §7.6.3): tollgate names itself on every message it
//! forwards, requests to upstreams and responses to clients, after any hops
//! already listed, with the protocol version it received the message in.
//!
//! The values are static: appending one costs a header insert, no
//! allocation.

use http::Version;
use http::header::{HeaderMap, HeaderValue, VIA};

const VIA_10: HeaderValue = HeaderValue::from_static("1.0 tollgate");
const VIA_11: HeaderValue = HeaderValue::from_static("1.1 tollgate");
const VIA_2: HeaderValue = HeaderValue::from_static("2 tollgate");
const VIA_3: HeaderValue = HeaderValue::from_static("3 tollgate");
const VIA_09: HeaderValue = HeaderValue::from_static("0.9 tollgate");

/// Adds tollgate's hop to `headers`, a message received in `version`. An
/// existing `Via` keeps its lines; ours is a new line after them, which is
/// the same list as one joined line (RFC 9110 §5.3).
pub fn append(headers: &mut HeaderMap, version: Version) {
    let value = match version {
        Version::HTTP_10 => VIA_10,
        Version::HTTP_2 => VIA_2,
        Version::HTTP_3 => VIA_3,
        Version::HTTP_09 => VIA_09,
        _ => VIA_11,
    };
    headers.append(VIA, value);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_hop_follows_the_existing_ones() {
        let mut h = HeaderMap::new();
        h.insert(VIA, HeaderValue::from_static("1.1 lb"));
        append(&mut h, Version::HTTP_2);
        let lines: Vec<_> = h.get_all(VIA).iter().map(|v| v.to_str().expect("text")).collect();
        assert_eq!(lines, ["1.1 lb", "2 tollgate"]);
    }
}
