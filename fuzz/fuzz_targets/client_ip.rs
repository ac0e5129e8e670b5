//! Client address extraction: arbitrary `X-Forwarded-For`, `Forwarded` and
//! `X-Real-IP` bytes from an arbitrary peer, behind arbitrary trusted
//! proxies.
//!
//! Asserted: `client_addr` never panics; from an untrusted peer it answers
//! the peer; otherwise the peer or an address written in one of those
//! headers (IPv4-mapped IPv6 read as IPv4 throughout). `key_addr` never
//! panics, leaves IPv4 alone and clears the bits past the IPv6 prefix.

#![no_main]

use std::net::{IpAddr, Ipv4Addr};

use arbitrary::Arbitrary;
use http::{HeaderMap, HeaderName, HeaderValue};
use ipnet::IpNet;
use libfuzzer_sys::fuzz_target;
use tollgate::wire::client::{client_addr, key_addr};

#[derive(Arbitrary, Debug)]
struct Input {
    peer: IpAddr,
    trusted: Vec<Trusted>,
    headers: Vec<(Which, Vec<Piece>)>,
    ipv6_prefix: u8,
}

#[derive(Arbitrary, Debug)]
enum Trusted {
    /// The peer's own network at some prefix length, so the headers are
    /// consulted often.
    Peer(u8),
    /// The network of the n-th address written in the headers, so that
    /// walking past trusted hops happens often too.
    Hop(u8, u8),
    Any,
    Net(IpAddr, u8),
}

/// A piece of a header value: mostly addresses in the forms proxies write,
/// separators, and arbitrary bytes.
#[derive(Arbitrary, Debug)]
enum Piece {
    Addr { ip: IpAddr, port: Option<u16>, form: Form },
    Comma,
    Semicolon,
    Space,
    Raw(Vec<u8>),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Form {
    /// `1.2.3.4`, `1.2.3.4:80`, `2001:db8::1`, `[2001:db8::1]:80`
    Plain,
    /// `[2001:db8::1]`, also for IPv4
    Bracketed,
    /// `for=...`
    For,
    /// `for="[...]:port"`
    ForQuoted,
}

fn render(pieces: &[Piece], addrs: &mut Vec<IpAddr>) -> Vec<u8> {
    let mut out = Vec::new();
    for p in pieces.iter().take(40) {
        match p {
            Piece::Addr { ip, port, form } => {
                addrs.push(*ip);
                let port = port.map_or(String::new(), |p| format!(":{p}"));
                let bracketed = format!("[{ip}]{port}");
                let plain = match ip {
                    IpAddr::V4(_) => format!("{ip}{port}"),
                    IpAddr::V6(_) if port.is_empty() => ip.to_string(),
                    IpAddr::V6(_) => bracketed.clone(),
                };
                let text = match form {
                    Form::Plain => plain,
                    Form::Bracketed => bracketed,
                    Form::For => format!("for={plain}"),
                    Form::ForQuoted => format!("for=\"{bracketed}\""),
                };
                out.extend_from_slice(text.as_bytes());
            }
            Piece::Comma => out.push(b','),
            Piece::Semicolon => out.push(b';'),
            Piece::Space => out.push(b' '),
            Piece::Raw(bytes) => out.extend_from_slice(bytes),
        }
    }
    out
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Which {
    XForwardedFor,
    Forwarded,
    XRealIp,
}

const NAMES: [&str; 3] = ["x-forwarded-for", "forwarded", "x-real-ip"];

fn net(ip: IpAddr, prefix: u8) -> IpNet {
    let max = if ip.is_ipv4() { 32 } else { 128 };
    // `new` fails only for a prefix over the maximum, which the modulo rules out.
    IpNet::new(ip, prefix % (max + 1)).map_or(IpNet::from(ip), |n| n.trunc())
}

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// Every address written in `text`: each maximal run of address characters
/// (hex digits, `.`, `:`), read whole, or as `IPv4:port`.
fn addresses_in(text: &[u8], out: &mut Vec<IpAddr>) {
    let is_addr_byte = |b: &u8| b.is_ascii_hexdigit() || *b == b'.' || *b == b':';
    for run in text.split(|b| !is_addr_byte(b)).filter(|r| !r.is_empty()) {
        // Address bytes are ASCII.
        let Ok(run) = std::str::from_utf8(run) else { continue };
        if let Ok(ip) = run.parse::<IpAddr>() {
            out.push(canonical(ip));
        } else if let Some((ip, _port)) = run.rsplit_once(':')
            && let Ok(v4) = ip.parse::<Ipv4Addr>()
        {
            out.push(IpAddr::V4(v4));
        }
    }
}

fuzz_target!(|input: Input| {
    let peer = canonical(input.peer);
    let mut headers = HeaderMap::new();
    let mut written = Vec::new();
    let mut generated = Vec::new();
    for (which, pieces) in input.headers.iter().take(8) {
        let bytes = render(pieces, &mut generated);
        // Bytes a header value cannot hold never reach tollgate (hyper
        // rejects them), so they are dropped here.
        let Ok(value) = HeaderValue::from_bytes(&bytes) else { continue };
        headers.append(HeaderName::from_static(NAMES[*which as usize]), value);
        addresses_in(&bytes, &mut written);
    }
    let trusted: Vec<IpNet> = input
        .trusted
        .iter()
        .take(8)
        .map(|t| match *t {
            Trusted::Peer(prefix) => net(peer, prefix),
            Trusted::Hop(i, prefix) => net(generated.get(usize::from(i)).copied().unwrap_or(peer), prefix),
            Trusted::Any => net(if peer.is_ipv4() { [0u8; 4].into() } else { [0u16; 8].into() }, 0),
            Trusted::Net(ip, prefix) => net(ip, prefix),
        })
        .collect();

    let Ok(client) = client_addr(input.peer, &headers, &trusted) else {
        // Refused (400): only a trusted peer's headers can be.
        assert!(trusted.iter().any(|n| n.contains(&peer)), "an untrusted peer's request was refused");
        return;
    };
    if !trusted.iter().any(|n| n.contains(&peer)) {
        assert_eq!(client, peer, "an untrusted peer's headers were believed");
    }
    assert!(
        client == peer || written.contains(&client),
        "client {client} is neither the peer {peer} nor written in the headers {headers:?}"
    );

    let keyed = key_addr(client, input.ipv6_prefix);
    match (client, keyed) {
        (IpAddr::V4(_), _) => assert_eq!(keyed, client),
        (IpAddr::V6(_), IpAddr::V6(k)) => {
            let prefix = u32::from(input.ipv6_prefix.min(128));
            let low = u128::from(k).checked_shl(prefix).unwrap_or(0);
            assert_eq!(low, 0, "{k} keeps bits past /{prefix}");
        }
        (IpAddr::V6(_), IpAddr::V4(_)) => panic!("key_addr turned {client} into IPv4"),
    }
});
