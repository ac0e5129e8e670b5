//! The Lua scripts, the keys they touch, and the wire format of their calls.
//!
//! One script per algorithm, in `src/store/lua/` (the token and leaky
//! buckets share `bucket.lua`, as they share `bucket` in `src/limiter.rs`;
//! every script starts with `prelude.lua` and `box.lua`, the penalty box,
//! and ends with `batch.lua`), each deciding a batch of keys atomically on
//! the server with the server's clock. All five take the same values per check and answer in the same
//! forms (eight values packed as doubles, four integers when the last
//! four are zero, or one for a fresh bucket: see `batch.lua`), so the Rust
//! side treats them alike.

use std::sync::atomic::AtomicBool;

use fred::types::Value;

use super::ids;
use crate::limiter::{Algorithm, Boxed, Limits, Penalty, Verdict};
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
    /// Keep a concurrency slot alive: its request is still in flight.
    Renew = 3,
    /// Correct what a `Consume` reserved once its request's real cost is
    /// known: the cost is the difference, the tail its sign and how long
    /// ago the reservation was counted (see `cost_response_header`).
    Settle = 4,
}

/// The shebang that lets one call of a script touch keys of several slots
/// of the node it runs on (Redis 7 or later): in a cluster, batches group
/// checks by node, not by slot. A single server needs no flag, so older
/// servers keep working there. Functions carry the same flag.
macro_rules! cross_slot {
    () => {
        "#!lua flags=allow-cross-slot-keys\n"
    };
}

/// An algorithm's code: its first lines (the buckets' `SHAPING`), the
/// prelude, the penalty box, the algorithm's `decide`, and the batch loop
/// `run`.
macro_rules! body {
    ($first:expr, $algorithm:literal) => {
        concat!(
            $first,
            include_str!("../lua/prelude.lua"),
            include_str!("../lua/box.lua"),
            include_str!(concat!("../lua/", $algorithm)),
            include_str!("../lua/batch.lua")
        )
    };
}

/// One algorithm's code on the server, in two forms: a function library
/// (Redis 7: `FUNCTION LOAD` once per node, then `FCALL`), and a script
/// (`EVALSHA`) for servers without functions. A function runs the
/// library's top level once, at load; a script runs it on every call
/// (its closures built, its garbage collected), which costs a call of one
/// check about 40% more instructions on the server (callgrind, Redis
/// 7.0.15: 126k against 77k for a token bucket; 55k against 48k per check
/// in calls of eight).
pub(super) struct Script {
    /// For `EVAL`, and what `EVALSHA` names by its SHA1.
    pub source: String,
    pub sha: String,
    /// For `FUNCTION LOAD`: a library of one function, both named after
    /// the hash of the code, so that instances running different versions
    /// each call their own.
    pub library: String,
    pub function: String,
    /// Whether to call the function: cleared for good once a server
    /// answers that it knows no `FCALL` (before Redis 7).
    pub functions: AtomicBool,
}

impl Script {
    fn new(body: &str, clustered: bool) -> Script {
        let source = format!("{}{body}return run(ARGV)\n", if clustered { cross_slot!() } else { "" });
        let function = format!("tollgate_{}", &fred::util::sha1_hash(body)[..16]);
        let library = format!(
            "#!lua name={function}\n{body}redis.register_function{{function_name = '{function}', \
             callback = function(_, args) return run(args) end, flags = {{'allow-cross-slot-keys'}}}}\n"
        );
        Script { sha: fred::util::sha1_hash(&source), source, library, function, functions: AtomicBool::new(true) }
    }
}

/// Every algorithm's code, in the order of [`index`].
/// `UNDO_WINDOWS`: for how many windows an undo can still change a key
/// (0: a bucket's level, see `applied_before` in batch.lua). `TAG_CUT`:
/// where the key's [`suffix`] starts, counted from its end (`-1 -
/// suffix.len()`), so that the script finds the key's penalty strikes
/// beside it (`strike` in batch.lua). `BOX_IN`: how the key holds its
/// penalty box (see box.lua and `box_layout` in `blocks`).
const BODIES: [&str; ALGORITHMS] = [
    body!("local SHAPING = false\nlocal UNDO_WINDOWS = 0\nlocal TAG_CUT = -4\nlocal BOX_IN = 'value'\n", "bucket.lua"),
    body!("local SHAPING = true\nlocal UNDO_WINDOWS = 0\nlocal TAG_CUT = -4\nlocal BOX_IN = 'value'\n", "bucket.lua"),
    body!("local UNDO_WINDOWS = 1\nlocal TAG_CUT = -4\nlocal BOX_IN = 'value'\n", "fixed_window.lua"),
    body!("local UNDO_WINDOWS = 1\nlocal TAG_CUT = -5\nlocal BOX_IN = 'member'\n", "sliding_window_log.lua"),
    body!("local UNDO_WINDOWS = 2\nlocal TAG_CUT = -5\nlocal BOX_IN = 'value'\n", "sliding_window_counter.lua"),
    body!("local UNDO_WINDOWS = 1\nlocal TAG_CUT = -3\nlocal BOX_IN = 'aside'\n", "concurrency.lua"),
];

/// How many algorithms have a script.
pub(super) const ALGORITHMS: usize = 6;

pub(super) fn index(algorithm: Algorithm) -> usize {
    match algorithm {
        Algorithm::TokenBucket => 0,
        Algorithm::LeakyBucket => 1,
        Algorithm::FixedWindow => 2,
        Algorithm::SlidingWindowLog => 3,
        Algorithm::SlidingWindowCounter => 4,
        Algorithm::Concurrency => 5,
    }
}

/// The source of `algorithm`'s script as a single server runs it with
/// `EVAL`, for tests that run it with a clock of their own.
pub fn source(algorithm: Algorithm) -> String {
    Script::new(BODIES[index(algorithm)], false).source
}

/// Every algorithm's code, built once at start-up.
pub(super) struct Scripts([Script; ALGORITHMS]);

impl Scripts {
    /// `clustered`: whether scripts may batch keys of several slots (see
    /// `cross_slot!`).
    pub fn new(clustered: bool) -> Scripts {
        Scripts(BODIES.map(|body| Script::new(body, clustered)))
    }

    pub fn get(&self, algorithm: Algorithm) -> &Script {
        &self.0[index(algorithm)]
    }
}

/// The key suffix of each algorithm. Distinct suffixes keep a rule whose
/// algorithm changes on reload from meeting its old key of another type
/// (`WRONGTYPE`) or misreading another algorithm's state. The log's suffix
/// is `swlw` since its entries carry their cost (one entry per request):
/// the `swl` logs of earlier versions held one entry per unit and are left
/// to expire. The buckets' are `tb2` and `lb2`, and the windows' `fw2`
/// and `swc2`, since their state is stored as doubles (`bucket.lua`,
/// `fixed_window.lua`, `sliding_window_counter.lua`): the text of earlier
/// versions' `tb`, `lb`, `fw` and `swc` keys is never misread, and is left
/// to expire.
pub fn suffix(algorithm: Algorithm) -> &'static str {
    match algorithm {
        Algorithm::TokenBucket => "tb2",
        Algorithm::LeakyBucket => "lb2",
        Algorithm::FixedWindow => "fw2",
        Algorithm::SlidingWindowCounter => "swc2",
        Algorithm::SlidingWindowLog => "swlw",
        Algorithm::Concurrency => "cc",
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

/// How many values a check takes after its key (see `batch.lua`).
pub const ARGS: usize = 2;

/// A lease's tail: '|' and six little-endian doubles.
const LEASE_TAIL: usize = 1 + 6 * 8;

/// How many values a script answers per check: all of them, or the first
/// four when the others are 0 (see `batch.lua`).
const STRIDE: usize = 8;
const SHORT: usize = 4;
/// What a short answer adds to its `allowed`.
const SHORT_MARK: i64 = 10;
/// `allowed` of a refusal by the penalty box: the key was there, or this
/// refusal put it there (`IN_BOX` and `ENTERED` in box.lua).
const IN_BOX: i64 = 3;
const ENTERED: i64 = 4;
/// A whole answer of one value: the script admitted a consume on a fresh
/// token bucket with no lease, whose answer follows from the check alone
/// ([`fresh_bucket`]), so the server did not send it.
const FRESH_MARK: i64 = 20;

/// What a call says about leases: the units it wants, and for a token
/// bucket the escrow period and phase its slots end on, and a lease of this
/// instance to settle in the same call (see `bucket.lua`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseArgs {
    pub want: u64,
    pub period_us: u64,
    pub phase_us: u64,
    pub settle: Option<Settle>,
    /// A window's renewal ahead: the units the caller still holds, which
    /// the script counts with `want` when deciding to grant (a bucket's
    /// carried units count alike).
    pub held: u64,
}

/// A token-bucket lease handed back: the escrow slot it was granted in
/// (the reply's token), the units granted there, and how many of them
/// were not spent. `carry`: the holder renews ahead and goes on spending
/// the unspent units, which move to the slot of the call's grant (sent as
/// a negative slot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settle {
    pub slot: i64,
    pub taken: u64,
    pub unspent: u64,
    pub carry: bool,
}

/// The values of one check after its key: its spec
/// `mode:limit:window_us:burst:cost` (and `:origin_us` for a calendar
/// window, see [`Limits::origin`]), and its tail: empty, or the refund
/// token or request id, followed for a lease by
/// `|want:period:phase:slot:taken:unspent` (the units wanted, the escrow
/// period and phase, and the lease settled; a slot of 0 settles nothing).
/// A call that takes back (see [`takes_back`]) starts its tail with `~`
/// and a fresh undo id (see [`ids::undo_id`]): sent twice, it is applied once.
/// Few values, and a spec the checks of one rule share: reading values is
/// most of what a check costs the server.
pub fn args(mode: ScriptMode, limits: &Limits, cost: u64, extra: &str, lease: LeaseArgs) -> [Value; ARGS] {
    args_with_penalty(mode, limits, cost, extra, lease, None)
}

/// [`args`] of a consume or peek of a rule with `penalty`, whose spec
/// also carries the penalty in milliseconds and `penalty_after`
/// (`:origin_us:penalty_ms:after`; the origin 0 when the window has none).
pub fn args_with_penalty(
    mode: ScriptMode,
    limits: &Limits,
    cost: u64,
    extra: &str,
    lease: LeaseArgs,
    penalty: Option<Penalty>,
) -> [Value; ARGS] {
    // The same bounds as the in-process arithmetic (`Limits::bounded`).
    let limits = &limits.bounded();
    // Written with `itoa`, not `format!`: a Redis check builds one spec,
    // and the formatting machinery cost 2,000 instructions of it.
    let mut spec = String::with_capacity(64);
    let mut push = |n: u64, colon: bool| {
        if colon {
            spec.push(':');
        }
        spec.push_str(itoa::Buffer::new().format(n));
    };
    push(mode as u64, false);
    for n in [limits.limit, window_us(limits), limits.burst, cost] {
        push(n, true);
    }
    if limits.origin != 0 || penalty.is_some() {
        // A calendar window: aligned to its start, which is a whole second.
        push(limits.origin / 1_000, true);
    }
    if let Some(p) = penalty {
        push(p.duration.div_ceil(1_000_000).max(1), true);
        push(u64::from(p.after.max(1)), true);
    }
    let undo = takes_back(mode, limits.algorithm, &lease);
    // A lease goes with checks that have no extra value (consumes of the
    // leasable algorithms, a bucket's give-back); were one to come with
    // both, the script would read the whole tail as the extra value and
    // grant no lease.
    let leased = lease != LeaseArgs::default() && extra.is_empty();
    if !undo && !leased {
        return [Value::String(spec.into()), Value::String(extra.into())];
    }
    let mut tail = Vec::with_capacity(1 + ids::UNDO_ID + LEASE_TAIL.max(extra.len()));
    if undo {
        tail.push(b'~');
        tail.extend_from_slice(&ids::undo_id());
    }
    if leased {
        let settle = lease.settle.unwrap_or(Settle { slot: 0, taken: 0, unspent: 0, carry: false });
        let slot = settle.slot.max(0) as f64;
        let values = [
            lease.want as f64,
            lease.period_us as f64,
            lease.phase_us as f64,
            if settle.carry { -slot } else { slot },
            settle.taken as f64,
            if lease.settle.is_some() { settle.unspent as f64 } else { lease.held as f64 },
        ];
        tail.push(b'|');
        for v in values {
            // Whole numbers below 2^53 (units of at most `MAX_LIMIT`,
            // microseconds since the epoch) are exact in a double.
            tail.extend_from_slice(&v.to_le_bytes());
        }
    } else {
        tail.extend_from_slice(extra.as_bytes());
    }
    [Value::String(spec.into()), Value::Bytes(tail.into())]
}

/// Whether a call takes back what an earlier one counted, and so must
/// carry an undo id (see `applied_before` in batch.lua): a call can reach
/// Redis twice (sent again after fred dropped a connection it was in
/// flight on, see `call`), and a refund, a settle or a lease settled twice
/// would let the key admit past its limit by what it gave back. The log
/// and the concurrency slots give back by removing the entry their
/// request id names, which a second call finds gone.
fn takes_back(mode: ScriptMode, algorithm: Algorithm, lease: &LeaseArgs) -> bool {
    let undoes = matches!(mode, ScriptMode::Refund | ScriptMode::Settle) && !algorithm.names_requests();
    undoes || lease.settle.is_some()
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
    /// Admitted on a fresh token bucket, the verdict's numbers left for
    /// [`Reply::complete`] to derive.
    pub fresh: bool,
}

impl Reply {
    /// The whole reply of a check on `limits` and `cost`: a fresh bucket's
    /// numbers filled in.
    pub fn complete(self, limits: &Limits, cost: u64) -> Reply {
        if !self.fresh {
            return self;
        }
        Reply { verdict: fresh_bucket(limits, cost), fresh: false, ..self }
    }
}

/// What a token bucket with no key (full) answers a consume of `cost`
/// admitted with no lease: `fresh_answer` in bucket.lua, with the same
/// arithmetic on the same values (those `args` puts in the spec), so that
/// it is the answer the script would have sent.
pub fn fresh_bucket(limits: &Limits, cost: u64) -> Verdict {
    let limits = limits.bounded();
    let capacity = limits.burst as f64;
    let rate = limits.limit as f64 / window_us(&limits) as f64;
    let tol = crate::limiter::slack(capacity);
    let cost = cost as f64;
    let remaining = capacity - cost + tol;
    Verdict {
        allowed: true,
        remaining: if remaining > 0.0 { remaining.floor() as u64 } else { 0 },
        reset_after: crate::limiter::ns_ceil((cost - tol) / rate * 1000.0),
        ..Verdict::default()
    }
}

/// What a script answered for one check of a call.
#[derive(Debug, Clone)]
pub enum Outcome {
    Decided(Reply),
    /// The key is not on the node the call went to (a batch grouped by a
    /// slot map that has changed since): nothing was written, its owner
    /// must be asked.
    NotHere,
    /// The check failed on the server (a key of another type, say); the
    /// other checks of the call stand.
    Failed(String),
}

/// Reads the answers of `count` checks: [`STRIDE`] values each,
/// `{allowed, remaining, reset_after_ns, retry_after_ns, delay_ns, token,
/// granted, lease_ttl_ns}`, as one string of that many little-endian
/// doubles, or [`SHORT`] integers when the rest are 0 (`allowed` then
/// carries [`SHORT_MARK`]), or a code of -1 (not here) or -2 (failed, then
/// the error) in place of `allowed`, with [`STRIDE`] values, or the single
/// value [`FRESH_MARK`].
pub fn parse_batch(value: Value, count: usize) -> Result<Vec<Outcome>, StoreError> {
    let bad = |v: &Value| StoreError::Protocol(format!("a rate-limit script answered {v:?}"));
    let Value::Array(items) = &value else { return Err(bad(&value)) };
    let mut outcomes = Vec::with_capacity(count);
    let mut rest = items.as_slice();
    while !rest.is_empty() {
        let (outcome, len) = match rest[0] {
            Value::Integer(-1) => (Outcome::NotHere, STRIDE),
            Value::Integer(-2) => (Outcome::Failed(rest.get(1).and_then(Value::as_string).unwrap_or_default()), STRIDE),
            Value::Integer(FRESH_MARK) => {
                let verdict = Verdict { allowed: true, ..Verdict::default() };
                (Outcome::Decided(Reply { verdict, token: 0, granted: 0, lease_ttl: 0, fresh: true }), 1)
            }
            Value::Bytes(ref packed) => (Outcome::Decided(reply(doubles(packed).ok_or_else(|| bad(&value))?)), 1),
            Value::String(ref packed) => {
                (Outcome::Decided(reply(doubles(packed.as_bytes()).ok_or_else(|| bad(&value))?)), 1)
            }
            Value::Integer(first) => {
                let len = if first >= SHORT_MARK { SHORT } else { STRIDE };
                let Some(check) = rest.get(..len) else { return Err(bad(&value)) };
                let mut n = [0i64; STRIDE];
                for (slot, item) in n.iter_mut().zip(check) {
                    *slot = match item {
                        Value::Integer(i) => *i,
                        _ => return Err(bad(&value)),
                    };
                }
                if len == SHORT {
                    n[0] -= SHORT_MARK;
                }
                (Outcome::Decided(reply(n)), len)
            }
            _ => return Err(bad(&value)),
        };
        if rest.len() < len || outcomes.len() == count {
            return Err(bad(&value));
        }
        outcomes.push(outcome);
        rest = &rest[len..];
    }
    if outcomes.len() != count {
        return Err(bad(&value));
    }
    Ok(outcomes)
}

/// A whole answer packed as [`STRIDE`] little-endian doubles, each
/// truncated to an integer as Redis truncates a number a script answers.
fn doubles(packed: &[u8]) -> Option<[i64; STRIDE]> {
    let (chunks, rest) = packed.as_chunks::<8>();
    if chunks.len() != STRIDE || !rest.is_empty() {
        return None;
    }
    let mut n = [0i64; STRIDE];
    for (slot, chunk) in n.iter_mut().zip(chunks) {
        // `as` saturates, and maps NaN to 0: never a panic.
        *slot = f64::from_le_bytes(*chunk) as i64;
    }
    Some(n)
}

fn reply(n: [i64; STRIDE]) -> Reply {
    let ns = |i: i64| u64::try_from(i).unwrap_or(0);
    let boxed = match n[0] {
        IN_BOX => Boxed::In,
        ENTERED => Boxed::Entered,
        _ => Boxed::No,
    };
    Reply {
        verdict: Verdict {
            allowed: n[0] == 1,
            remaining: ns(n[1]),
            reset_after: ns(n[2]),
            retry_after: ns(n[3]),
            delay: ns(n[4]),
            fallback: false,
            boxed,
        },
        token: n[5],
        granted: ns(n[6]),
        lease_ttl: ns(n[7]),
        fresh: false,
    }
}

/// A duration in the whole nanoseconds verdicts and replies count in.
pub(super) fn nanos(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::NANOS_PER_SEC;

    #[test]
    fn the_hash_tag_wraps_exactly_the_rule_and_key() {
        let key = redis_key("tollgate:", "login-by-ip|ip=203.0.113.7", Algorithm::FixedWindow);
        assert_eq!(key, "tollgate:{login-by-ip|ip=203.0.113.7}:fw2");
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
            Algorithm::Concurrency,
        ];
        let mut suffixes: Vec<_> = all.iter().map(|a| suffix(*a)).collect();
        suffixes.sort_unstable();
        suffixes.dedup();
        assert_eq!(suffixes.len(), all.len());
    }

    #[test]
    fn replies_parse_per_check_and_malformed_ones_are_errors() {
        let ints = |n: &[i64]| n.iter().copied().map(Value::Integer).collect::<Vec<_>>();
        let packed = |n: [f64; STRIDE]| Value::Bytes(n.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>().into());
        let mut items = vec![packed([1.0, 4.0, 2_000.0, 0.0, 7.0, 99.0, 0.0, 0.0])];
        items.push(packed([1.0, 4.0, 2_000.0, 0.0, 0.0, 99.0, 10.0, 5_000.0]));
        // Short: rejected, the rest 0.
        items.extend(ints(&[10, 0, 3_000, 1_000]));
        items.extend(ints(&[-1, 0, 0, 0, 0, 0, 0, 0]));
        items.push(Value::Integer(-2));
        items.push(Value::String("WRONGTYPE Operation against a key".into()));
        items.extend(ints(&[0, 0, 0, 0, 0, 0]));
        let outcomes = parse_batch(Value::Array(items.clone()), 5).expect("parses");
        let Outcome::Decided(r) = &outcomes[0] else { panic!("{outcomes:?}") };
        assert_eq!(
            r.verdict,
            Verdict {
                allowed: true,
                remaining: 4,
                reset_after: 2_000,
                retry_after: 0,
                delay: 7,
                fallback: false,
                boxed: crate::limiter::Boxed::No
            }
        );
        assert_eq!((r.token, r.granted, r.lease_ttl), (99, 0, 0));
        let Outcome::Decided(r) = &outcomes[1] else { panic!("{outcomes:?}") };
        assert_eq!((r.granted, r.lease_ttl), (10, 5_000));
        let Outcome::Decided(r) = &outcomes[2] else { panic!("{outcomes:?}") };
        assert_eq!(
            (r.verdict, r.token, r.granted, r.lease_ttl),
            (
                Verdict {
                    allowed: false,
                    remaining: 0,
                    reset_after: 3_000,
                    retry_after: 1_000,
                    delay: 0,
                    fallback: false,
                    boxed: crate::limiter::Boxed::No
                },
                0,
                0,
                0
            )
        );
        assert!(matches!(outcomes[3], Outcome::NotHere));
        assert!(matches!(&outcomes[4], Outcome::Failed(e) if e.starts_with("WRONGTYPE")));
        // A count that does not match, a short answer cut off, a packed one
        // of the wrong length, a value that is not an integer, not an array.
        assert!(parse_batch(Value::Array(items.clone()), 4).is_err());
        assert!(parse_batch(Value::Array(items.clone()), 6).is_err());
        assert!(parse_batch(Value::Array(ints(&[11, 4, 2_000])), 1).is_err());
        assert!(parse_batch(Value::Array(vec![Value::Bytes(vec![0; 63].into())]), 1).is_err());
        assert!(parse_batch(Value::Array(vec![Value::String("x".into())]), 1).is_err());
        items[3] = Value::String("x".into());
        assert!(parse_batch(Value::Array(items), 5).is_err());
        assert!(parse_batch(Value::String("OK".into()), 1).is_err());
    }

    #[test]
    fn a_fresh_bucket_answer_is_one_value_completed_from_the_check() {
        let limits =
            Limits { algorithm: Algorithm::TokenBucket, limit: 100, window: NANOS_PER_SEC, burst: 100, origin: 0 };
        let items = vec![
            Value::Integer(20),
            Value::Integer(10),
            Value::Integer(0),
            Value::Integer(3_000),
            Value::Integer(1_000),
        ];
        let outcomes = parse_batch(Value::Array(items), 2).expect("parses");
        let Outcome::Decided(r) = &outcomes[0] else { panic!("{outcomes:?}") };
        assert!(r.fresh && r.verdict.allowed);
        let r = r.complete(&limits, 3);
        assert!(!r.fresh);
        assert_eq!(
            r.verdict,
            Verdict {
                allowed: true,
                remaining: 97,
                reset_after: 30_000_000,
                retry_after: 0,
                delay: 0,
                fallback: false,
                boxed: crate::limiter::Boxed::No
            }
        );
        let Outcome::Decided(r) = &outcomes[1] else { panic!("{outcomes:?}") };
        assert_eq!(r.complete(&limits, 3).verdict.reset_after, 3_000);
    }

    /// What the proxy derives for a fresh bucket is what the limiter (and
    /// so the script's general path, see tests/lua_matches_limiter.rs)
    /// answers for a full bucket, rounding included.
    #[test]
    fn a_fresh_bucket_answers_as_the_limiter_does() {
        use crate::limiter::{Cell, evaluate};
        let cases: [(u64, u64, u64, u64); 7] = [
            (100, 1_000_000, 100, 1),
            (100, 1_000_000, 100, 100),
            (7, 60_000_000, 3, 2),
            (3, 1_000_000, 10, 1),
            (1_000_000, 1_000, 5_000_000, 4_999_999),
            (5_000_000_000, 3_600_000_000, 5_000_000_000, 1),
            (1, 86_400_000_000, 1, 1),
        ];
        for (limit, window_us, burst, cost) in cases {
            let limits =
                Limits { algorithm: Algorithm::TokenBucket, limit, window: window_us * 1_000, burst, origin: 0 };
            let (expected, _) = evaluate(Cell::default(), 1_700_000_000_000_000_000, &limits, cost);
            assert_eq!(fresh_bucket(&limits, cost), expected, "{limits:?} cost {cost}");
        }
    }

    #[test]
    fn a_lease_travels_as_six_doubles_after_a_bar() {
        let limits =
            Limits { algorithm: Algorithm::TokenBucket, limit: 100, window: NANOS_PER_SEC, burst: 100, origin: 0 };
        let lease = LeaseArgs {
            want: 8,
            period_us: 5_000_000,
            phase_us: 1_234_567,
            settle: Some(Settle { slot: 1_795_551_536_012_345, taken: 10, unspent: 3, carry: false }),
            held: 0,
        };
        let [spec, tail] = args(ScriptMode::Consume, &limits, 1, "", lease);
        assert_eq!(spec.as_str().as_deref(), Some("1:100:1000000:100:1"));
        let Value::Bytes(tail) = tail else { panic!("{tail:?}") };
        // It settles a lease: named by an undo id.
        let (undo, tail) = split_undo(&tail);
        assert!(undo.is_some());
        assert_eq!(tail.len(), LEASE_TAIL);
        assert_eq!(tail[0], b'|');
        let values: Vec<u64> =
            tail[1..].chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")) as u64).collect();
        assert_eq!(values, [8, 5_000_000, 1_234_567, 1_795_551_536_012_345, 10, 3]);
        // A renewal ahead: a bucket's settle carrying its unspent units
        // names its slot negated; a window's sends the units it holds.
        let doubles = |lease: LeaseArgs| {
            let [_, Value::Bytes(tail)] = args(ScriptMode::Consume, &limits, 0, "", lease) else { panic!() };
            let (undo, tail) = split_undo(&tail);
            let values = tail[1..].chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")));
            (undo.is_some(), values.collect::<Vec<_>>())
        };
        let carry = Settle { slot: 1_795_551_536_012_345, taken: 10, unspent: 1, carry: true };
        let (undo, ahead) = doubles(LeaseArgs { want: 9, settle: Some(carry), ..LeaseArgs::default() });
        assert!(undo);
        assert_eq!(ahead[3..], [-1_795_551_536_012_345.0, 10.0, 1.0]);
        let window = doubles(LeaseArgs { want: 9, held: 1, ..LeaseArgs::default() });
        assert_eq!(window, (false, vec![9.0, 0.0, 0.0, 0.0, 0.0, 1.0]), "it settles nothing: no undo id");
        // No lease: the extra value alone, as text, after an undo id for a
        // refund.
        let [_, tail] = args(ScriptMode::Refund, &limits, 1, "1700000000000000", LeaseArgs::default());
        let Value::Bytes(tail) = tail else { panic!("{tail:?}") };
        let (undo, extra) = split_undo(&tail);
        assert!(undo.is_some());
        assert_eq!(extra, b"1700000000000000");
        let log = Limits { algorithm: Algorithm::SlidingWindowLog, ..limits };
        let [_, tail] = args(ScriptMode::Refund, &log, 1, "5f0c9a", LeaseArgs::default());
        assert_eq!(tail.as_str().as_deref(), Some("5f0c9a"), "a refund removing a named entry needs no undo id");
    }

    /// The undo id at the head of `tail`, if any, and the rest.
    fn split_undo(tail: &[u8]) -> (Option<&[u8]>, &[u8]) {
        match tail.split_first() {
            Some((b'~', rest)) => (Some(&rest[..ids::UNDO_ID]), &rest[ids::UNDO_ID..]),
            _ => (None, tail),
        }
    }

    /// Every call that takes back names itself with an id no other call of
    /// any instance has: 64 random bits per process and a counter.
    #[test]
    fn every_call_that_takes_back_has_its_own_undo_id() {
        let limits =
            Limits { algorithm: Algorithm::FixedWindow, limit: 100, window: NANOS_PER_SEC, burst: 100, origin: 0 };
        let ids: std::collections::HashSet<Vec<u8>> = (0..100)
            .map(|_| {
                let [_, Value::Bytes(tail)] = args(ScriptMode::Settle, &limits, 3, "-1000", LeaseArgs::default())
                else {
                    panic!("a settle carries an undo id")
                };
                let (undo, rest) = split_undo(&tail);
                assert_eq!(rest, b"-1000");
                let undo = undo.expect("an undo id").to_vec();
                assert!(undo.iter().all(u8::is_ascii_hexdigit), "{undo:?}");
                undo
            })
            .collect();
        assert_eq!(ids.len(), 100);
        // A consume that settles nothing carries none.
        let [_, tail] = args(ScriptMode::Consume, &limits, 1, "", LeaseArgs::default());
        assert_eq!(tail.as_str().as_deref(), Some(""));
    }

    #[test]
    fn windows_go_to_whole_microseconds_rounded_up() {
        let limits = |window| Limits { algorithm: Algorithm::FixedWindow, limit: 1, window, burst: 1, origin: 0 };
        assert_eq!(window_us(&limits(NANOS_PER_SEC)), 1_000_000);
        assert_eq!(window_us(&limits(1_500)), 2);
        assert_eq!(window_us(&limits(1)), 1);
    }
}
