//! `tollgate top --admin 127.0.0.1:9090`: the heaviest keys of each rule
//! from a running tollgate's `/top`, redrawn every second like top(1).
//!
//! On a terminal the screen is cleared before each table; otherwise (a
//! pipe, a file, a test) each table is printed after the last, without
//! escape codes. The admin endpoint is asked over a plain HTTP/1.1
//! connection per refresh: one small GET a second needs no client library.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use serde_json::Value;

/// How often the table is redrawn.
const REFRESH: Duration = Duration::from_secs(1);
/// How long the admin listener may take to connect or answer.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(3);
/// Largest `/top` answer read (10,000 keys of a few hundred bytes fit).
const MAX_REPLY_BYTES: u64 = 16 << 20;

#[derive(Debug, clap::Args)]
pub struct TopArgs {
    /// The admin address of the running tollgate.
    #[arg(long, default_value = "127.0.0.1:9090")]
    pub admin: String,
    /// Only this rule (default: every rule in force).
    #[arg(long)]
    pub rule: Option<String>,
    /// Rank keys by the requests over the limit, or by all requests.
    #[arg(long, default_value = "limited", value_parser = ["limited", "requests"])]
    pub by: String,
    /// Keys shown per rule (at most `[admin] top_keys`; default 20).
    #[arg(short = 'n', long)]
    pub n: Option<usize>,
    /// Stop after this many tables (default: until interrupted).
    #[arg(long)]
    pub count: Option<u64>,
}

/// Polls `/top` and draws it to `out` until `--count` tables are drawn.
/// `Err` when the tollgate cannot be reached at first, or refuses the
/// question (an unknown rule, `n` too large, `/top` off): nothing a retry
/// would fix. Once it answered, a failed refresh is shown and retried.
pub fn run(args: &TopArgs, out: &mut impl Write, terminal: bool) -> Result<(), String> {
    let path = query_path(args);
    let mut answered = false;
    let mut drawn = 0;
    let mut next = Instant::now();
    while args.count.is_none_or(|c| drawn < c) {
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
        next += REFRESH;
        let screen = match get(&args.admin, &path) {
            Ok((200, body)) => {
                answered = true;
                let value: Value = serde_json::from_str(&body)
                    .map_err(|_| format!("{} did not answer /top with JSON (an older tollgate?)", args.admin))?;
                render(&args.admin, &value)
            }
            Ok((status, body)) => {
                let message = serde_json::from_str::<Value>(&body)
                    .ok()
                    .and_then(|v| v["message"].as_str().map(String::from))
                    .unwrap_or_else(|| format!("/top answered {status} (an older tollgate?)"));
                return Err(format!("{}: {message}", args.admin));
            }
            Err(e) if !answered => return Err(e),
            Err(e) => format!("tollgate top  {}  {e}; retrying\n", args.admin),
        };
        let written = if terminal {
            // Home, clear screen, then the table.
            write!(out, "\x1b[H\x1b[2J{screen}")
        } else {
            writeln!(out, "{screen}")
        };
        written.and_then(|()| out.flush()).map_err(|e| format!("cannot write the table: {e}"))?;
        drawn += 1;
    }
    Ok(())
}

/// `/top?by=...` with the rule and `n`, percent-encoded.
fn query_path(args: &TopArgs) -> String {
    let mut path = format!("/top?by={}", args.by);
    if let Some(rule) = &args.rule {
        path.push_str("&rule=");
        for b in rule.bytes() {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
                path.push(b as char);
            } else {
                path.push_str(&format!("%{b:02X}"));
            }
        }
    }
    if let Some(n) = args.n {
        path.push_str(&format!("&n={n}"));
    }
    path
}

/// One GET to the admin listener: its status and body.
fn get(admin: &str, path: &str) -> Result<(u16, String), String> {
    request(admin, "GET", path, None)
}

/// One request to the admin listener (a JSON body, if any): its status
/// and body.
pub(super) fn request(admin: &str, method: &str, path: &str, body: Option<&str>) -> Result<(u16, String), String> {
    let unreachable = |e: &dyn std::fmt::Display| format!("cannot reach the tollgate admin listener at {admin}: {e}");
    let addr = admin
        .to_socket_addrs()
        .map_err(|_| format!("--admin {admin:?} is not an address such as 127.0.0.1:9090"))?
        .next()
        .ok_or_else(|| format!("--admin {admin:?} resolves to no address"))?;
    let mut stream = TcpStream::connect_timeout(&addr, ADMIN_TIMEOUT).map_err(|e| unreachable(&e))?;
    stream.set_read_timeout(Some(ADMIN_TIMEOUT)).map_err(|e| unreachable(&e))?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: {admin}\r\nconnection: close\r\n");
    if let Some(body) = body {
        head.push_str(&format!("content-type: application/json\r\ncontent-length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    head.push_str(body.unwrap_or(""));
    stream.write_all(head.as_bytes()).map_err(|e| unreachable(&e))?;
    let mut reply = Vec::new();
    stream.take(MAX_REPLY_BYTES).read_to_end(&mut reply).map_err(|e| unreachable(&e))?;
    let reply = String::from_utf8_lossy(&reply);
    let (head, body) = reply.split_once("\r\n\r\n").ok_or_else(|| unreachable(&"an incomplete answer"))?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| unreachable(&"an answer that is not HTTP"))?;
    Ok((status, body.to_string()))
}

/// The table of one `/top` answer (one rule, or every rule).
pub fn render(admin: &str, top: &Value) -> String {
    let reports: Vec<&Value> = match top["rules"].as_array() {
        Some(rules) => rules.iter().collect(),
        None => vec![top],
    };
    let by = top["by"].as_str().unwrap_or("?");
    let window = reports.first().and_then(|r| r["window_seconds"].as_u64()).unwrap_or(0);
    let mut s = format!("tollgate top  {admin}  by {by}  last {window} s\n");
    if reports.is_empty() {
        s.push_str("\nno rules in force\n");
    }
    for report in reports {
        let rule = report["rule"].as_str().unwrap_or("?");
        let total = report["total"].as_u64().unwrap_or(0);
        let counted = if by == "limited" { "limited" } else { "requests" };
        s.push_str(&format!("\nrule {rule}: {total} {counted}\n"));
        let keys = report["keys"].as_array().map_or(&[][..], Vec::as_slice);
        render_box(&mut s, report);
        if keys.is_empty() {
            s.push_str("  (no keys)\n");
            continue;
        }
        s.push_str(&format!("  {:>10}  {:>8}  KEY\n", "COUNT", "±ERROR"));
        for k in keys {
            s.push_str(&format!(
                "  {:>10}  {:>8}  {}\n",
                k["count"].as_u64().unwrap_or(0),
                k["error"].as_u64().unwrap_or(0),
                k["key"].as_str().unwrap_or("?"),
            ));
        }
    }
    s
}

/// The keys of a rule in the penalty box, when it holds any.
fn render_box(s: &mut String, report: &Value) {
    let boxed = report["penalty_box"].as_array().map_or(&[][..], Vec::as_slice);
    if boxed.is_empty() {
        return;
    }
    s.push_str(&format!("  in the penalty box: {}\n", boxed.len()));
    for b in boxed {
        s.push_str(&format!(
            "  {:>9}s  {:>8}  {}  ({})\n",
            b["expires_in_seconds"].as_u64().unwrap_or(0),
            b["source"].as_str().unwrap_or("?"),
            b["key"].as_str().unwrap_or("?"),
            b["reason"].as_str().unwrap_or(""),
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(rule: Option<&str>, n: Option<usize>) -> TopArgs {
        TopArgs { admin: "127.0.0.1:9".into(), rule: rule.map(String::from), by: "limited".into(), n, count: None }
    }

    #[test]
    fn the_rule_is_percent_encoded() {
        assert_eq!(query_path(&args(None, None)), "/top?by=limited");
        assert_eq!(
            query_path(&args(Some("login (v2) /api/*"), Some(5))),
            "/top?by=limited&rule=login%20%28v2%29%20%2Fapi%2F%2A&n=5"
        );
    }

    #[test]
    fn a_table_per_rule_heaviest_first() {
        let top = serde_json::json!({"by": "limited", "capacity": 64, "rules": [
            {"rule": "per-key", "window_seconds": 42, "total": 12, "keys": [
                {"key": "per-key|api_key=ab", "count": 10, "error": 0},
                {"key": "per-key|api_key=cd", "count": 2, "error": 1}]},
            {"rule": "per-ip", "window_seconds": 42, "total": 0, "keys": []}]});
        assert_eq!(
            render("127.0.0.1:9090", &top),
            "tollgate top  127.0.0.1:9090  by limited  last 42 s\n\
             \nrule per-key: 12 limited\n       COUNT    ±ERROR  KEY\n\
             \x20         10         0  per-key|api_key=ab\n\
             \x20          2         1  per-key|api_key=cd\n\
             \nrule per-ip: 0 limited\n  (no keys)\n"
        );
    }
}
