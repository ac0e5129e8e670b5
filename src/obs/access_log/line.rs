//! Rendering one access log line: JSON written by hand into the writer's
//! buffer (no intermediate tree), with the escaping any request path needs
//! and an RFC 3339 time without a date library.

use std::sync::atomic::Ordering;
use std::time::SystemTime;

use http::Version;
use http::header::HeaderValue;

use super::entry::Entry;

/// Appends `e` as one JSON line.
pub(super) fn render(e: &Entry, out: &mut Vec<u8>) {
    let mut num = itoa::Buffer::new();
    out.extend_from_slice(b"{\"time\":\"");
    rfc3339_millis(e.time, out);
    out.extend_from_slice(b"\",\"client\":\"");
    out.extend_from_slice(e.client.to_string().as_bytes());
    out.extend_from_slice(b"\",\"method\":");
    json_string(e.method.as_str().as_bytes(), out);
    out.extend_from_slice(b",\"host\":");
    json_or_null(e.host.as_ref().map(|h| h.as_bytes()), out);
    out.extend_from_slice(b",\"path\":");
    json_string(e.uri.path().as_bytes(), out);
    out.extend_from_slice(b",\"protocol\":");
    json_or_null(e.version.and_then(protocol).map(str::as_bytes), out);
    out.extend_from_slice(b",\"status\":");
    out.extend_from_slice(num.format(e.status).as_bytes());
    out.extend_from_slice(b",\"bytes_in\":");
    let bytes_in = e.bytes_in.as_ref().map_or(0, |b| b.load(Ordering::Relaxed));
    out.extend_from_slice(num.format(bytes_in).as_bytes());
    out.extend_from_slice(b",\"bytes_out\":");
    out.extend_from_slice(num.format(e.bytes_out).as_bytes());
    out.extend_from_slice(b",\"duration_ms\":");
    millis(e.duration, out);
    out.extend_from_slice(b",\"upstream\":");
    json_or_null(e.upstream.as_ref().map(|a| a.as_str().as_bytes()), out);
    out.extend_from_slice(b",\"upstream_status\":");
    match e.upstream_answer.and_then(|(status, _)| status) {
        Some(s) => out.extend_from_slice(num.format(s).as_bytes()),
        None => out.extend_from_slice(b"null"),
    }
    out.extend_from_slice(b",\"upstream_ms\":");
    match e.upstream_answer {
        Some((_, took)) => millis(took, out),
        None => out.extend_from_slice(b"null"),
    }
    out.extend_from_slice(b",\"rule\":");
    json_or_null(e.rule.as_ref().map(String::as_bytes), out);
    out.extend_from_slice(b",\"request_id\":");
    json_string(e.request_id.as_bytes(), out);
    out.extend_from_slice(b",\"user_agent\":");
    json_or_null(e.user_agent.as_ref().map(HeaderValue::as_bytes), out);
    out.extend_from_slice(b",\"referer\":");
    json_or_null(e.referer.as_ref().map(HeaderValue::as_bytes), out);
    out.extend_from_slice(b",\"tls\":");
    json_or_null(e.tls.map(str::as_bytes), out);
    // Only with `[tracing]`: lines stay as they were without it.
    if let Some(t) = &e.trace {
        out.extend_from_slice(b",\"trace_id\":\"");
        out.extend_from_slice(&t.context.trace_hex());
        out.push(b'"');
    }
    out.extend_from_slice(b"}\n");
}

/// `d` in milliseconds with three decimals: `1234.567`.
fn millis(d: std::time::Duration, out: &mut Vec<u8>) {
    let mut num = itoa::Buffer::new();
    let micros = d.as_micros();
    out.extend_from_slice(num.format(micros / 1000).as_bytes());
    out.push(b'.');
    let frac = (micros % 1000) as u16;
    out.extend_from_slice(&[b'0' + (frac / 100) as u8, b'0' + (frac / 10 % 10) as u8, b'0' + (frac % 10) as u8]);
}

/// The request's protocol as nginx's `$server_protocol` writes it.
fn protocol(v: Version) -> Option<&'static str> {
    Some(match v {
        Version::HTTP_09 => "HTTP/0.9",
        Version::HTTP_10 => "HTTP/1.0",
        Version::HTTP_11 => "HTTP/1.1",
        Version::HTTP_2 => "HTTP/2",
        Version::HTTP_3 => "HTTP/3",
        _ => return None,
    })
}

/// `s` as a JSON string, or `null`.
fn json_or_null(s: Option<&[u8]>, out: &mut Vec<u8>) {
    match s {
        Some(s) => json_string(s, out),
        None => out.extend_from_slice(b"null"),
    }
}

/// `s` as a JSON string: quotes, backslashes and control bytes escaped,
/// UTF-8 kept, and any byte that is not UTF-8 written as U+FFFD (a path
/// can hold anything).
fn json_string(s: &[u8], out: &mut Vec<u8>) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    for chunk in s.utf8_chunks() {
        for &b in chunk.valid().as_bytes() {
            match b {
                b'"' => out.extend_from_slice(b"\\\""),
                b'\\' => out.extend_from_slice(b"\\\\"),
                b'\n' => out.extend_from_slice(b"\\n"),
                b'\r' => out.extend_from_slice(b"\\r"),
                b'\t' => out.extend_from_slice(b"\\t"),
                0..0x20 | 0x7f => {
                    out.extend_from_slice(b"\\u00");
                    out.push(HEX[(b >> 4) as usize]);
                    out.push(HEX[(b & 0xf) as usize]);
                }
                _ => out.push(b),
            }
        }
        if !chunk.invalid().is_empty() {
            out.extend_from_slice("\u{fffd}".as_bytes());
        }
    }
    out.push(b'"');
}

/// `t` as RFC 3339 in UTC with milliseconds: `2026-11-24T12:15:53.123Z`.
fn rfc3339_millis(t: SystemTime, out: &mut Vec<u8>) {
    let since = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    let two = |n: u64, out: &mut Vec<u8>| out.extend_from_slice(&[b'0' + (n / 10) as u8, b'0' + (n % 10) as u8]);
    let mut year = itoa::Buffer::new();
    out.extend_from_slice(year.format(y).as_bytes());
    out.push(b'-');
    two(m as u64, out);
    out.push(b'-');
    two(d as u64, out);
    out.push(b'T');
    two(rem / 3600, out);
    out.push(b':');
    two(rem / 60 % 60, out);
    out.push(b':');
    two(rem % 60, out);
    out.push(b'.');
    let ms = since.subsec_millis();
    out.extend_from_slice(&[b'0' + (ms / 100) as u8, b'0' + (ms / 10 % 10) as u8, b'0' + (ms % 10) as u8]);
    out.push(b'Z');
}

/// The proleptic Gregorian date of a day number counted from 1970-01-01
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::AtomicU64;
    use std::time::{Duration, Instant};

    use http::Method;
    use http::header::HeaderValue;

    use super::*;

    #[test]
    fn times_are_rfc3339_utc_with_milliseconds() {
        let mut out = Vec::new();
        rfc3339_millis(SystemTime::UNIX_EPOCH + Duration::from_millis(1_795_954_553_123), &mut out);
        assert_eq!(String::from_utf8(out).expect("ascii"), "2026-11-29T12:15:53.123Z");
        let mut out = Vec::new();
        rfc3339_millis(SystemTime::UNIX_EPOCH + Duration::from_secs(951_782_400), &mut out);
        assert_eq!(String::from_utf8(out).expect("ascii"), "2000-02-29T00:00:00.000Z");
    }

    #[test]
    fn any_bytes_become_a_valid_json_string() {
        let raw: &[u8] = b"/a\"b\\c\n\x01\x7f\xff/\xc3\xa9";
        let mut out = Vec::new();
        json_string(raw, &mut out);
        let back: String = serde_json::from_slice(&out).expect("valid JSON");
        assert_eq!(back, "/a\"b\\c\n\u{1}\u{7f}\u{fffd}/é");
    }

    #[test]
    fn a_line_is_one_json_object_with_every_field() {
        let entry = Entry {
            time: SystemTime::UNIX_EPOCH,
            started: Instant::now(),
            client: "2001:db8::1".parse().expect("ip"),
            method: Method::GET,
            uri: "/x%22y?q=1".parse().expect("uri"),
            status: 429,
            bytes_in: Some(Arc::new(AtomicU64::new(7))),
            bytes_out: 12,
            duration: Duration::from_micros(1_234_567),
            upstream: None,
            rule: Some("per-ip".into()),
            request_id: HeaderValue::from_static("abc"),
            host: Some(HeaderValue::from_static("shop.test")),
            version: Some(http::Version::HTTP_2),
            user_agent: Some(HeaderValue::from_static("ua \"q\"")),
            referer: None,
            upstream_answer: Some((None, Duration::from_micros(2_500))),
            tls: Some("TLSv1.3"),
            trace: None,
            route: None,
            decision: None,
            store: None,
        };
        let mut out = Vec::new();
        render(&entry, &mut out);
        assert_eq!(out.last(), Some(&b'\n'));
        let v: serde_json::Value = serde_json::from_slice(&out).expect("JSON");
        assert_eq!(
            v,
            serde_json::json!({"time": "1970-01-01T00:00:00.000Z", "client": "2001:db8::1", "method": "GET",
                "host": "shop.test", "path": "/x%22y", "protocol": "HTTP/2", "status": 429, "bytes_in": 7,
                "bytes_out": 12, "duration_ms": 1234.567, "upstream": null, "upstream_status": null,
                "upstream_ms": 2.5, "rule": "per-ip", "request_id": "abc", "user_agent": "ua \"q\"",
                "referer": null, "tls": "TLSv1.3"})
        );
    }
}
