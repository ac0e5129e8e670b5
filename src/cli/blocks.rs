//! `tollgate block` and `tollgate unblock`: a key put in, or let out of,
//! a rule's penalty box through a running tollgate's admin listener
//! (`POST /blocks`, `DELETE /blocks`), from an incident channel's shell.
//! With Redis, the block holds on every instance sharing it.

use serde_json::{Value, json};

use super::top::request;

#[derive(Debug, clap::Args)]
pub struct BlockArgs {
    /// The admin address of the running tollgate.
    #[arg(long, default_value = "127.0.0.1:9090")]
    pub admin: String,
    /// The rule whose penalty box the key goes in.
    #[arg(long)]
    pub rule: String,
    /// The key as `tollgate explain` and `tollgate top` show it
    /// (`login|ip=203.0.113.7`; the rule's name and `|` may be left out).
    #[arg(long)]
    pub key: String,
    /// How long (`90s`, `15m`, `1h`, `7d`).
    #[arg(long = "for")]
    pub duration: String,
    /// Why: logged by the tollgate, and listed by `GET /blocks`.
    #[arg(long)]
    pub reason: String,
}

#[derive(Debug, clap::Args)]
pub struct UnblockArgs {
    /// The admin address of the running tollgate.
    #[arg(long, default_value = "127.0.0.1:9090")]
    pub admin: String,
    #[arg(long)]
    pub rule: String,
    #[arg(long)]
    pub key: String,
    /// Why: logged by the tollgate.
    #[arg(long)]
    pub reason: Option<String>,
}

/// `tollgate block`: the line to print, or why the tollgate refused.
pub fn block(args: &BlockArgs) -> Result<String, String> {
    let body = json!({"rule": args.rule, "key": args.key, "for": args.duration, "reason": args.reason}).to_string();
    let answer = answered(&args.admin, request(&args.admin, "POST", "/blocks", Some(&body))?)?;
    Ok(format!(
        "blocked {} for rule {} for {} s ({})",
        answer["key"].as_str().unwrap_or(&args.key),
        args.rule,
        answer["expires_in_seconds"].as_u64().unwrap_or(0),
        args.reason
    ))
}

/// `tollgate unblock`: the line to print, or why the tollgate refused.
pub fn unblock(args: &UnblockArgs) -> Result<String, String> {
    let mut path = format!("/blocks?rule={}&key={}", encode(&args.rule), encode(&args.key));
    if let Some(r) = &args.reason {
        path.push_str("&reason=");
        path.push_str(&encode(r));
    }
    let answer = answered(&args.admin, request(&args.admin, "DELETE", &path, None)?)?;
    Ok(format!("let {} out of rule {}'s penalty box", answer["key"].as_str().unwrap_or(&args.key), args.rule))
}

/// The JSON of a 200 answer, or the tollgate's message.
fn answered(admin: &str, (status, body): (u16, String)) -> Result<Value, String> {
    let value: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    if status == 200 {
        return Ok(value);
    }
    let message = value["message"].as_str().map_or_else(|| format!("/blocks answered {status}"), String::from);
    Err(format!("{admin}: {message}"))
}

/// Percent-encodes a query value (everything but unreserved characters).
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn keys_are_percent_encoded_in_the_query() {
        assert_eq!(super::encode("login|ip=203.0.113.7"), "login%7Cip%3D203.0.113.7");
    }
}
