//! W3C Trace Context (`traceparent`): reading the one a request came with,
//! and writing the one it leaves with.
//!
//! `traceparent: 00-<trace id: 32 hex>-<parent span id: 16 hex>-<flags: 2 hex>`.
//! A header that is not exactly one well-formed value (two headers, upper
//! case hex, an all-zero id, version `ff`) is ignored, as the
//! recommendation says: the request then starts a new trace.

use http::HeaderValue;

/// The sampled flag of `traceparent`'s flags.
const SAMPLED: u8 = 0x01;

/// A request's place in a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpanContext {
    pub trace_id: u128,
    /// This request's span at tollgate: the parent of the upstream's.
    pub span_id: u64,
    /// The span it came from: the client's or the proxy's before tollgate.
    pub parent: Option<u64>,
    pub sampled: bool,
}

/// What an incoming `traceparent` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Incoming {
    pub trace_id: u128,
    pub parent: u64,
    pub sampled: bool,
}

/// Reads one `traceparent` value; `None` when it is malformed.
pub fn parse(value: &[u8]) -> Option<Incoming> {
    // version "-" trace "-" parent "-" flags: 2 + 1 + 32 + 1 + 16 + 1 + 2.
    if value.len() < 55 || value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
        return None;
    }
    let version = hex(&value[..2])? as u8;
    // Version ff is forbidden; version 00 is exactly 55 bytes; a later
    // version may append fields after a dash.
    if version == 0xff || (version == 0 && value.len() != 55) || (version != 0 && value.len() > 55 && value[55] != b'-')
    {
        return None;
    }
    let trace_id = hex(&value[3..35])?;
    let parent = hex(&value[36..52])? as u64;
    let flags = hex(&value[53..55])? as u8;
    if trace_id == 0 || parent == 0 {
        return None;
    }
    Some(Incoming { trace_id, parent, sampled: flags & SAMPLED != 0 })
}

/// Lower-case hex only, as the recommendation requires.
fn hex(digits: &[u8]) -> Option<u128> {
    digits.iter().try_fold(0u128, |n, &d| {
        let v = match d {
            b'0'..=b'9' => d - b'0',
            b'a'..=b'f' => d - b'a' + 10,
            _ => return None,
        };
        Some(n << 4 | u128::from(v))
    })
}

impl SpanContext {
    /// The `traceparent` the upstream receives: this span as its parent.
    pub fn header(&self) -> HeaderValue {
        let mut out = [0u8; 55];
        out[..3].copy_from_slice(b"00-");
        write_hex(self.trace_id, &mut out[3..35]);
        out[35] = b'-';
        write_hex(u128::from(self.span_id), &mut out[36..52]);
        out[52] = b'-';
        out[53] = b'0';
        out[54] = if self.sampled { b'1' } else { b'0' };
        // Hex digits and dashes only: always a valid header value.
        HeaderValue::from_bytes(&out).unwrap_or_else(|_| HeaderValue::from_static(""))
    }

    /// The trace id as 32 hex digits (the access log's `trace_id`).
    pub fn trace_hex(&self) -> [u8; 32] {
        let mut out = [0u8; 32];
        write_hex(self.trace_id, &mut out);
        out
    }
}

/// `n`'s low `out.len() / 2` bytes as lower-case hex, most significant first.
fn write_hex(mut n: u128, out: &mut [u8]) {
    for d in out.iter_mut().rev() {
        *d = b"0123456789abcdef"[(n & 0xf) as usize];
        n >>= 4;
    }
}

/// Whether a trace is sampled at `ratio`, decided by its id (as
/// OpenTelemetry's `TraceIdRatioBased`): every instance that sees the same
/// trace decides the same way.
pub fn sampled_at(trace_id: u128, ratio: f64) -> bool {
    if ratio >= 1.0 {
        return true;
    }
    // The low 64 bits of a random trace id are uniform.
    let threshold = (ratio * u64::MAX as f64) as u64;
    (trace_id as u64) < threshold
}

/// A random id that is not zero (zero means "none" in the protocol).
pub fn new_trace_id() -> u128 {
    loop {
        let id = fastrand::u128(..);
        if id != 0 {
            return id;
        }
    }
}

/// A random span id that is not zero.
pub fn new_span_id() -> u64 {
    loop {
        let id = fastrand::u64(..);
        if id != 0 {
            return id;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_recommendations_example_reads_and_writes_back() {
        let v = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let i = parse(v).expect("valid");
        assert_eq!(
            i,
            Incoming { trace_id: 0x4bf92f3577b34da6a3ce929d0e0e4736, parent: 0x00f067aa0ba902b7, sampled: true }
        );
        let c = SpanContext { trace_id: i.trace_id, span_id: i.parent, parent: None, sampled: true };
        assert_eq!(c.header().as_bytes(), v);
        assert_eq!(&c.trace_hex(), b"4bf92f3577b34da6a3ce929d0e0e4736");
        let unsampled = SpanContext { sampled: false, ..c };
        assert!(unsampled.header().as_bytes().ends_with(b"-00"));
    }

    #[test]
    fn malformed_values_are_ignored() {
        for bad in [
            &b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"[..],
            b"00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            b"00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
            b"00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
            b"",
        ] {
            assert_eq!(parse(bad), None, "{}", String::from_utf8_lossy(bad));
        }
        // A later version may carry more fields.
        assert!(parse(b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-later").is_some());
    }

    #[test]
    fn sampling_follows_the_trace_id_and_the_ratio() {
        assert!(sampled_at(new_trace_id(), 1.0));
        assert!(!sampled_at(new_trace_id(), 0.0));
        let hits = (0..100_000).filter(|_| sampled_at(new_trace_id(), 0.1)).count();
        assert!((9_000..11_000).contains(&hits), "{hits}");
        let id = new_trace_id();
        assert_eq!(sampled_at(id, 0.5), sampled_at(id, 0.5));
    }
}
