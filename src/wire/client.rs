//! Who the client is: the address a request is keyed by.
//!
//! The socket peer is the client unless it is one of `trusted_proxies`; only
//! then are `X-Forwarded-For` (or, without it, the standard `Forwarded`
//! header's `for=` parameters, or, without either, `X-Real-IP`) consulted,
//! walked from the right, skipping trusted hops: the right-most untrusted
//! address is the client, because every hop to its left was written by
//! someone we do not trust. Hops are split and parsed one by one, so garbage
//! to the left of the client (a non-ASCII byte, a name) is never read. When
//! only trusted hops stand to the right of an unparseable one, the left-most
//! of those is the client; when the right-most hop itself does not parse,
//! the request is refused ([`BadForwarding`], a 400): a trusted proxy's
//! request is never keyed on the proxy because its header was garbled.
//!
//! IPv6 clients are keyed by their prefix (`ipv6_prefix`, /64 by default):
//! one host commonly owns a whole /64 and could otherwise rotate addresses
//! to escape a per-IP limit.

use std::net::{IpAddr, Ipv6Addr};

use http::{HeaderMap, HeaderValue};
use ipnet::IpNet;

const X_FORWARDED_FOR: &str = "x-forwarded-for";
const FORWARDED: &str = "forwarded";
const X_REAL_IP: &str = "x-real-ip";

/// At most this many `X-Forwarded-For` hops are examined; a longer chain is
/// treated as garbage.
const MAX_HOPS: usize = 32;

/// Reads the address of one hop of a forwarding header.
type HopParser = fn(&[u8]) -> Option<IpAddr>;

/// A trusted peer's forwarding headers name no client: the right-most hop
/// does not parse, or `X-Real-IP` is garbage or repeated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the forwarding headers from a trusted proxy name no client address")]
pub struct BadForwarding;

/// A connection's socket peer, worked out once when the connection is
/// accepted rather than on each of its requests: rendering an address as
/// text costs more than all the other forwarding headers together.
#[derive(Debug, Clone)]
pub struct Peer {
    /// The peer's address, IPv4-mapped IPv6 already read as IPv4.
    pub ip: IpAddr,
    /// Whether it is one of `trusted_proxies`.
    pub trusted: bool,
    /// The address as the `X-Forwarded-For` hop it adds.
    pub forwarded_for: HeaderValue,
    /// Whether it reached tollgate over TLS (`X-Forwarded-Proto: https`).
    pub https: bool,
    /// The TLS version its connection negotiated (`"TLSv1.3"`), for the
    /// access log; `None` over plain TCP.
    pub tls: Option<&'static str>,
    /// The common name of the client certificate its TLS handshake
    /// verified (the `client_cert` key part); `None` without one.
    pub client_cert: Option<std::sync::Arc<[u8]>>,
    /// What the connection's HTTP/2 requests may hold of their bodies read
    /// ahead, together (`listen.connection_body_buffer`; see
    /// [`crate::upstream::forward::AheadBudget`]): per connection, so here.
    pub body_budget: Option<std::sync::Arc<std::sync::atomic::AtomicU64>>,
}

impl Peer {
    /// The peer at `addr`, trusted when it is in `trusted`.
    pub fn new(addr: IpAddr, trusted: &[IpNet]) -> Peer {
        let ip = canonical(addr);
        // An address's text is always a valid header value.
        let forwarded_for = HeaderValue::try_from(ip.to_string()).unwrap_or(HeaderValue::from_static("unknown"));
        Peer {
            ip,
            trusted: is_trusted(ip, trusted),
            forwarded_for,
            https: false,
            tls: None,
            client_cert: None,
            body_budget: None,
        }
    }
}

/// Whether a socket peer is one of `trusted_proxies`: the one test for the
/// limiter's client address and for the forwarding headers sent upstream,
/// on IPv4 and IPv6 (dual-stack) listeners alike.
pub fn is_trusted_peer(peer: IpAddr, trusted: &[IpNet]) -> bool {
    is_trusted(canonical(peer), trusted)
}

/// The client address of a request from `peer`, not yet reduced to a prefix.
pub fn client_addr(peer: IpAddr, headers: &HeaderMap, trusted: &[IpNet]) -> Result<IpAddr, BadForwarding> {
    let peer = canonical(peer);
    if !is_trusted(peer, trusted) {
        return Ok(peer);
    }
    let (name, parse): (&str, HopParser) = if headers.contains_key(X_FORWARDED_FOR) {
        (X_FORWARDED_FOR, parse_hop)
    } else {
        (FORWARDED, parse_forwarded_element)
    };
    let mut hops = 0;
    // The left-most trusted hop seen so far: the client if no untrusted
    // hop stands to its left.
    let mut leftmost = None;
    let mut any = false;
    'lines: for value in headers.get_all(name).iter().rev() {
        any = true;
        for hop in value.as_bytes().rsplit(|&b| b == b',') {
            hops += 1;
            let parsed = if hops > MAX_HOPS { None } else { parse(hop) };
            let Some(ip) = parsed else {
                // Garbage, or a chain too long to be real, with only
                // trusted hops to its right.
                break 'lines;
            };
            if !is_trusted(ip, trusted) {
                return Ok(ip);
            }
            leftmost = Some(ip);
        }
    }
    if let Some(ip) = leftmost {
        // Every hop read was a trusted proxy: the first of them is the client.
        return Ok(ip);
    }
    if any {
        return Err(BadForwarding);
    }
    let mut real = headers.get_all(X_REAL_IP).iter();
    match (real.next(), real.next()) {
        (None, _) => Ok(peer),
        (Some(v), None) => parse_hop(v.as_bytes()).ok_or(BadForwarding),
        (Some(_), Some(_)) => Err(BadForwarding),
    }
}

/// The address a rule keys on: IPv4 as is (an IPv4-mapped IPv6 address
/// read as the IPv4 one), IPv6 reduced to `ipv6_prefix` bits. The proxy, the
/// decision API, Envoy RLS, `explain` and override keys all key through it.
pub fn key_addr(addr: IpAddr, ipv6_prefix: u8) -> IpAddr {
    match canonical(addr) {
        v4 @ IpAddr::V4(_) => v4,
        IpAddr::V6(v6) => {
            let bits = u128::from(v6);
            let mask = if ipv6_prefix >= 128 { u128::MAX } else { !(u128::MAX >> ipv6_prefix) };
            IpAddr::V6(Ipv6Addr::from(bits & mask))
        }
    }
}

fn is_trusted(ip: IpAddr, trusted: &[IpNet]) -> bool {
    trusted.iter().any(|n| n.contains(&ip))
}

/// An IPv4-mapped IPv6 address (`::ffff:1.2.3.4`, what a dual-stack socket
/// reports) is the IPv4 client it stands for.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// The `for=` address of one `Forwarded` element (RFC 7239):
/// `for=192.0.2.60;proto=http`, `for="[2001:db8::17]:4711"`. An element
/// without `for=`, or with an obfuscated identifier (`for=unknown`,
/// `for=_hidden`), names no address: garbage, as far as keying goes.
fn parse_forwarded_element(element: &[u8]) -> Option<IpAddr> {
    let element = std::str::from_utf8(element).ok()?;
    element.split(';').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        if !k.trim().eq_ignore_ascii_case("for") {
            return None;
        }
        parse_hop(v.trim().trim_matches('"').as_bytes())
    })
}

/// One hop: `1.2.3.4`, `1.2.3.4:5678`, `2001:db8::1` or `[2001:db8::1]:443`.
fn parse_hop(hop: &[u8]) -> Option<IpAddr> {
    let hop = std::str::from_utf8(hop).ok()?.trim();
    if hop.is_empty() || hop.len() > 64 {
        return None;
    }
    if let Ok(ip) = hop.parse::<IpAddr>() {
        return Some(canonical(ip));
    }
    if let Some(rest) = hop.strip_prefix('[') {
        let (ip, _) = rest.split_once(']')?;
        return ip.parse::<IpAddr>().ok().map(canonical);
    }
    let (ip, port) = hop.rsplit_once(':')?;
    port.parse::<u16>().ok()?;
    ip.parse::<std::net::Ipv4Addr>().ok().map(IpAddr::V4)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn nets(s: &[&str]) -> Vec<IpNet> {
        s.iter().map(|n| n.parse().expect("test CIDR")).collect()
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(http::HeaderName::from_bytes(k.as_bytes()).expect("name"), v.parse().expect("value"));
        }
        h
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test address")
    }

    #[test]
    fn untrusted_peers_cannot_spoof() {
        let h = headers(&[("x-forwarded-for", "1.1.1.1"), ("x-real-ip", "2.2.2.2")]);
        assert_eq!(client_addr(ip("9.9.9.9"), &h, &nets(&["10.0.0.0/8"])), Ok(ip("9.9.9.9")));
    }

    #[test]
    fn rightmost_untrusted_hop_is_the_client() {
        let h = headers(&[("x-forwarded-for", "6.6.6.6, 5.5.5.5, 10.0.0.2"), ("x-forwarded-for", "10.0.0.3")]);
        assert_eq!(client_addr(ip("10.0.0.1"), &h, &nets(&["10.0.0.0/8"])), Ok(ip("5.5.5.5")));
    }

    #[test]
    fn garbage_is_refused_never_keyed_on_the_proxy() {
        let t = nets(&["10.0.0.0/8"]);
        for bad in ["not-an-ip", "1.2.3.4, ,", "999.1.1.1", "1.2.3.4:99999"] {
            let h = headers(&[("x-forwarded-for", bad)]);
            assert_eq!(client_addr(ip("10.0.0.1"), &h, &t), Err(BadForwarding), "{bad}");
        }
        // Garbage to the left of the client is never read.
        let mut h = HeaderMap::new();
        h.append("x-forwarded-for", HeaderValue::from_bytes(b"\xff\xfe, 5.5.5.5, 10.0.0.2").expect("obs-text"));
        assert_eq!(client_addr(ip("10.0.0.1"), &h, &t), Ok(ip("5.5.5.5")));
        // Only trusted hops to the right of garbage: the left-most of them.
        let h = headers(&[("x-forwarded-for", "junk, 10.0.0.7, 10.0.0.2")]);
        assert_eq!(client_addr(ip("10.0.0.1"), &h, &t), Ok(ip("10.0.0.7")));
        // Too many hops, all trusted: the left-most of the ones read.
        let long = vec!["10.0.0.9"; 40].join(", ");
        assert_eq!(client_addr(ip("10.0.0.1"), &headers(&[("x-forwarded-for", &long)]), &t), Ok(ip("10.0.0.9")));
        for real in [&[("x-real-ip", "junk")][..], &[("x-real-ip", "1.1.1.1"), ("x-real-ip", "2.2.2.2")]] {
            assert_eq!(client_addr(ip("10.0.0.1"), &headers(real), &t), Err(BadForwarding));
        }
    }

    #[test]
    fn real_ip_and_ports_and_mapped_addresses() {
        let t = nets(&["127.0.0.1/32"]);
        assert_eq!(client_addr(ip("127.0.0.1"), &headers(&[("x-real-ip", "7.7.7.7")]), &t), Ok(ip("7.7.7.7")));
        assert_eq!(
            client_addr(ip("127.0.0.1"), &headers(&[("x-forwarded-for", "[2001:db8::5]:443")]), &t),
            Ok(ip("2001:db8::5"))
        );
        assert_eq!(
            client_addr(ip("127.0.0.1"), &headers(&[("x-forwarded-for", "8.8.8.8:1234")]), &t),
            Ok(ip("8.8.8.8"))
        );
        assert_eq!(client_addr(ip("::ffff:3.3.3.3"), &HeaderMap::new(), &t), Ok(ip("3.3.3.3")));
    }

    #[test]
    fn forwarded_header_is_read_like_x_forwarded_for() {
        let t = nets(&["10.0.0.0/8"]);
        let h =
            headers(&[("forwarded", "for=6.6.6.6, for=\"[2001:db8::17]:4711\";proto=https, for=10.0.0.9;by=10.0.0.1")]);
        assert_eq!(client_addr(ip("10.0.0.1"), &h, &t), Ok(ip("2001:db8::17")));
        // From an untrusted peer it is ignored.
        assert_eq!(client_addr(ip("9.9.9.9"), &h, &t), Ok(ip("9.9.9.9")));
        // X-Forwarded-For wins when both are present.
        let both = headers(&[("forwarded", "for=6.6.6.6"), ("x-forwarded-for", "5.5.5.5")]);
        assert_eq!(client_addr(ip("10.0.0.1"), &both, &t), Ok(ip("5.5.5.5")));
        // Obfuscated or missing `for=`: no client named, refused.
        for bad in ["for=unknown", "for=_hidden", "proto=http", "for=\"[::1\""] {
            assert_eq!(client_addr(ip("10.0.0.1"), &headers(&[("forwarded", bad)]), &t), Err(BadForwarding), "{bad}");
        }
    }

    #[test]
    fn trust_is_one_decision_on_ipv4_and_dual_stack_listeners() {
        // A dual-stack listener reports an IPv4 peer as ::ffff:a.b.c.d: it is
        // trusted (for the limiter and for the headers sent upstream) exactly
        // when a.b.c.d is.
        let t = nets(&["10.0.0.0/8"]);
        assert!(is_trusted_peer(ip("10.0.0.1"), &t));
        assert!(is_trusted_peer(ip("::ffff:10.0.0.1"), &t));
        assert!(!is_trusted_peer(ip("::ffff:11.0.0.1"), &t));
        let peer = Peer::new(ip("::ffff:10.0.0.1"), &t);
        assert!(peer.trusted);
        assert_eq!((peer.ip, peer.forwarded_for.as_bytes()), (ip("10.0.0.1"), &b"10.0.0.1"[..]));
        assert_eq!(Peer::new(ip("2001:db8::1"), &t).forwarded_for, "2001:db8::1");
        let h = headers(&[("x-forwarded-for", "5.5.5.5")]);
        assert_eq!(client_addr(ip("::ffff:10.0.0.1"), &h, &t), Ok(ip("5.5.5.5")));
    }

    #[test]
    fn ipv6_is_keyed_by_prefix() {
        assert_eq!(key_addr(ip("2001:db8:1:2:aaaa::1"), 64), ip("2001:db8:1:2::"));
        assert_eq!(key_addr(ip("2001:db8:1:2:aaaa::1"), 128), ip("2001:db8:1:2:aaaa::1"));
        assert_eq!(key_addr(ip("1.2.3.4"), 64), ip("1.2.3.4"));
    }
}
