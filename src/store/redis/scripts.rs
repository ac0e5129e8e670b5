//! The Lua scripts, the keys they touch, and the wire format of their calls.
//!
//! One script per algorithm, in `src/store/lua/` (the token and leaky
//! buckets share `bucket.lua`, as they share `bucket` in `src/limiter.rs`;
//! every script starts with `prelude.lua`), each deciding one key
//! atomically on the server with the server's clock. All five take the same
//! arguments and answer the same six integers, so the Rust side treats them
//! alike.

use fred::types::Value;

use crate::limiter::{Algorithm, Limits, Verdict};
use crate::store::StoreError;

/// What a script call does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ScriptMode {
    /// Decide without writing (`tollgate explain`).
    Peek = 0,
    /// Decide, and count the request if it is admitted.
    Consume = 1,
    /// Give back what an earlier `Consume` of the same request counted.
    Refund = 2,
}

/// One script: its source and the SHA1 that `EVALSHA` names it by.
pub(super) struct Script {
    pub source: &'static str,
    pub sha: String,
}

impl Script {
    fn new(source: &'static str) -> Script {
        Script { source, sha: fred::util::sha1_hash(source) }
    }
}

/// The five scripts, hashed once at start-up.
pub(super) struct Scripts {
    token_bucket: Script,
    leaky_bucket: Script,
    fixed_window: Script,
    sliding_window_log: Script,
    sliding_window_counter: Script,
}

impl Scripts {
    pub fn new() -> Scripts {
        Scripts {
            token_bucket: Script::new(concat!(
                "local SHAPING = false\n",
                include_str!("../lua/prelude.lua"),
                include_str!("../lua/bucket.lua")
            )),
            leaky_bucket: Script::new(concat!(
                "local SHAPING = true\n",
                include_str!("../lua/prelude.lua"),
                include_str!("../lua/bucket.lua")
            )),
            fixed_window: Script::new(concat!(
                include_str!("../lua/prelude.lua"),
                include_str!("../lua/fixed_window.lua")
            )),
            sliding_window_log: Script::new(concat!(
                include_str!("../lua/prelude.lua"),
                include_str!("../lua/sliding_window_log.lua")
            )),
            sliding_window_counter: Script::new(concat!(
                include_str!("../lua/prelude.lua"),
                include_str!("../lua/sliding_window_counter.lua")
            )),
        }
    }

    pub fn get(&self, algorithm: Algorithm) -> &Script {
        match algorithm {
            Algorithm::TokenBucket => &self.token_bucket,
            Algorithm::LeakyBucket => &self.leaky_bucket,
            Algorithm::FixedWindow => &self.fixed_window,
            Algorithm::SlidingWindowLog => &self.sliding_window_log,
            Algorithm::SlidingWindowCounter => &self.sliding_window_counter,
        }
    }
}

/// The key suffix of each algorithm. Distinct suffixes keep a rule whose
/// algorithm changes on reload from meeting its old key of another type
/// (`WRONGTYPE`) or misreading another algorithm's state. The log's suffix
/// is `swlw` since its entries carry their cost (one entry per request):
/// the `swl` logs of earlier versions held one entry per unit and are left
/// to expire.
pub fn suffix(algorithm: Algorithm) -> &'static str {
    match algorithm {
        Algorithm::TokenBucket => "tb",
        Algorithm::LeakyBucket => "lb",
        Algorithm::FixedWindow => "fw",
        Algorithm::SlidingWindowCounter => "swc",
        Algorithm::SlidingWindowLog => "swlw",
    }
}

/// The Redis key of one bucket: `{prefix}{<rule and key>}:<suffix>`.
///
/// The braces are a cluster hash tag: only the rule-and-key part is hashed,
/// so everything one script touches sits in one slot, and different clients
/// and rules spread over the cluster. `Check::key` is percent-encoded by
/// `rules::key`, so it never contains a brace of its own that could move the
/// tag.
pub fn redis_key(prefix: &str, key: &str, algorithm: Algorithm) -> String {
    let suffix = suffix(algorithm);
    let mut out = String::with_capacity(prefix.len() + key.len() + suffix.len() + 3);
    out.push_str(prefix);
    out.push('{');
    out.push_str(key);
    out.push_str("}:");
    out.push_str(suffix);
    out
}

/// A window in whole microseconds, the resolution of the server's clock
/// (`TIME`). Rounded up, and at least 1.
pub fn window_us(limits: &Limits) -> u64 {
    limits.window.div_ceil(1_000).max(1)
}

/// How many values a script call takes after its key.
pub const ARGS: usize = 12;

/// What a call says about leases: the units it wants, and for a token
/// bucket the escrow period and phase its slots end on, and a lease of this
/// instance to settle in the same call (see `bucket.lua`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseArgs {
    pub want: u64,
    pub period_us: u64,
    pub phase_us: u64,
    pub settle: Option<Settle>,
}

/// A token-bucket lease handed back: the escrow slot it was granted in
/// (the reply's token), the units granted there, and how many of them
/// were not spent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settle {
    pub slot: i64,
    pub taken: u64,
    pub unspent: u64,
}

/// The `ARGV` of one call: mode, limit, window in µs, burst, cost, the
/// refund token or request id, the units wanted as a lease (see `lease`),
/// the escrow period and phase, and the lease settled (slot, taken,
/// unspent; a slot of 0 settles nothing).
pub fn args(mode: ScriptMode, limits: &Limits, cost: u64, extra: &str, lease: LeaseArgs) -> [Value; ARGS] {
    // The same bounds as the in-process arithmetic (`Limits::bounded`).
    let limits = &limits.bounded();
    let settle = lease.settle.unwrap_or(Settle { slot: 0, taken: 0, unspent: 0 });
    [
        Value::Integer(mode as i64),
        int(limits.limit),
        int(window_us(limits)),
        int(limits.burst),
        int(cost),
        Value::String(extra.into()),
        int(lease.want),
        int(lease.period_us),
        int(lease.phase_us),
        Value::Integer(settle.slot.max(0)),
        int(settle.taken),
        int(settle.unspent),
    ]
}

fn int(n: u64) -> Value {
    Value::Integer(i64::try_from(n).unwrap_or(i64::MAX))
}

/// A script's answer: the verdict, the token a refund must quote (the
/// window start a fixed window or sliding counter counted the request in),
/// and the lease it granted.
#[derive(Debug, Clone, Copy)]
pub struct Reply {
    /// As Redis decided it; `remaining` does not include `granted`.
    pub verdict: Verdict,
    pub token: i64,
    /// Units taken ahead for this instance to spend locally.
    pub granted: u64,
    /// How long those units stay valid, in nanoseconds (0: until given
    /// back or, for a window, until the window ends).
    pub lease_ttl: u64,
}

/// Reads `{allowed, remaining, reset_after_ns, retry_after_ns, delay_ns,
/// token}`, followed by `{granted, lease_ttl_ns}` from the scripts that lease.
pub fn parse_reply(value: Value) -> Result<Reply, StoreError> {
    let bad = |v: &Value| StoreError::Protocol(format!("a rate-limit script answered {v:?}"));
    let Value::Array(items) = &value else { return Err(bad(&value)) };
    let mut n = [0i64; 8];
    if items.len() != 6 && items.len() != 8 {
        return Err(bad(&value));
    }
    for (slot, item) in n.iter_mut().zip(items) {
        *slot = match item {
            Value::Integer(i) => *i,
            _ => return Err(bad(&value)),
        };
    }
    let ns = |i: i64| u64::try_from(i).unwrap_or(0);
    Ok(Reply {
        verdict: Verdict {
            allowed: n[0] == 1,
            remaining: ns(n[1]),
            reset_after: ns(n[2]),
            retry_after: ns(n[3]),
            delay: ns(n[4]),
        },
        token: n[5],
        granted: ns(n[6]),
        lease_ttl: ns(n[7]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::NANOS_PER_SEC;

    #[test]
    fn the_hash_tag_wraps_exactly_the_rule_and_key() {
        let key = redis_key("tollgate:", "login-by-ip|ip=203.0.113.7", Algorithm::FixedWindow);
        assert_eq!(key, "tollgate:{login-by-ip|ip=203.0.113.7}:fw");
        // Every algorithm's key of one bucket lands in the same slot, and the
        // prefix does not move it.
        let slot = fred::util::redis_keyslot(key.as_bytes());
        for alg in [Algorithm::TokenBucket, Algorithm::SlidingWindowLog] {
            let other = redis_key("other:", "login-by-ip|ip=203.0.113.7", alg);
            assert_eq!(fred::util::redis_keyslot(other.as_bytes()), slot);
        }
    }

    #[test]
    fn every_algorithm_has_its_own_suffix() {
        let all = [
            Algorithm::TokenBucket,
            Algorithm::LeakyBucket,
            Algorithm::FixedWindow,
            Algorithm::SlidingWindowLog,
            Algorithm::SlidingWindowCounter,
        ];
        let mut suffixes: Vec<_> = all.iter().map(|a| suffix(*a)).collect();
        suffixes.sort_unstable();
        suffixes.dedup();
        assert_eq!(suffixes.len(), all.len());
    }

    #[test]
    fn replies_parse_and_malformed_ones_are_errors() {
        let ok = Value::Array([1, 4, 2_000, 0, 7, 99].map(Value::Integer).to_vec());
        let r = parse_reply(ok).expect("parses");
        assert_eq!(r.verdict, Verdict { allowed: true, remaining: 4, reset_after: 2_000, retry_after: 0, delay: 7 });
        assert_eq!(r.token, 99);
        assert_eq!((r.granted, r.lease_ttl), (0, 0));
        let leased = Value::Array([1, 4, 2_000, 0, 0, 99, 10, 5_000].map(Value::Integer).to_vec());
        let r = parse_reply(leased).expect("parses");
        assert_eq!((r.granted, r.lease_ttl), (10, 5_000));
        assert!(parse_reply(Value::Array([1, 4, 2_000, 0, 0, 99, 10].map(Value::Integer).to_vec())).is_err());
        assert!(parse_reply(Value::Array(vec![Value::Integer(1)])).is_err());
        assert!(parse_reply(Value::String("OK".into())).is_err());
    }

    #[test]
    fn windows_go_to_whole_microseconds_rounded_up() {
        let limits = |window| Limits { algorithm: Algorithm::FixedWindow, limit: 1, window, burst: 1 };
        assert_eq!(window_us(&limits(NANOS_PER_SEC)), 1_000_000);
        assert_eq!(window_us(&limits(1_500)), 2);
        assert_eq!(window_us(&limits(1)), 1);
    }
}
