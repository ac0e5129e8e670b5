//! The access log as the tests read it: every line checked to be one JSON
//! object with exactly the documented fields.

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;

use super::{Upstream, config, eventually};

/// The fields of a line, in order.
pub const FIELDS: [&str; 18] = [
    "time",
    "client",
    "method",
    "host",
    "path",
    "protocol",
    "status",
    "bytes_in",
    "bytes_out",
    "duration_ms",
    "upstream",
    "upstream_status",
    "upstream_ms",
    "rule",
    "request_id",
    "user_agent",
    "referer",
    "tls",
];

/// The default test config writing its access log to `access`.
pub fn logging(upstream: &Upstream, access: &str) -> String {
    format!("{}\n[log]\naccess = {access:?}\n", config(upstream.addr))
}

/// Every line of the log at `path`, each checked to be one JSON object
/// with exactly the documented fields.
pub fn read_log(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .map(|line| {
            let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
            let keys: Vec<&str> = v.as_object().expect("an object").keys().map(String::as_str).collect();
            assert_eq!(keys, FIELDS, "{line}");
            let time = v["time"].as_str().expect("time");
            let b = time.as_bytes();
            assert!(
                b.len() == 24 && b[4] == b'-' && b[10] == b'T' && b[19] == b'.' && time.ends_with('Z'),
                "RFC 3339 UTC with milliseconds: {time}"
            );
            for n in ["status", "bytes_in", "bytes_out"] {
                assert!(v[n].is_u64(), "{n}: {line}");
            }
            assert!(v["duration_ms"].as_f64().is_some_and(|d| d >= 0.0), "{line}");
            v
        })
        .collect()
}

/// Waits until the log at `path` has `n` lines, and returns them by
/// request id (checking that no id is there twice).
pub async fn lines_by_id(path: &Path, n: usize) -> HashMap<String, Value> {
    eventually(&format!("{n} lines in {}", path.display()), || async { read_log(path).len() >= n }).await;
    let lines = read_log(path);
    assert_eq!(lines.len(), n, "exactly one line per request");
    let mut by_id = HashMap::new();
    for v in lines {
        let id = v["request_id"].as_str().expect("request_id").to_string();
        assert!(by_id.insert(id.clone(), v).is_none(), "request id {id} logged twice");
    }
    by_id
}
