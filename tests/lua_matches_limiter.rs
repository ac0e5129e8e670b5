//! The Lua scripts (`src/store/lua/`) and `src/limiter.rs` implement the
//! same algorithms twice, once on Redis' clock and once in this process.
//! This property test runs both on random sequences of requests, costs and
//! times against a real `redis-server`, and requires the same decision and
//! the same `remaining` (and delay, for the leaky bucket) at every step.
//! The concurrency script is driven through a fixed sequence instead: its
//! slots also expire, which the limiter (whose slots are given back, never
//! lost) has no notion of.
//!
//! Time is injected: the scripts are run by source with their clock line
//! (`redis.call('TIME')` in prelude.lua) replaced by the test's instant, in
//! whole microseconds, the server clock's resolution.

use crate::support;

use fred::clients::Client;
use fred::interfaces::ClientLike;
use fred::types::config::Config;
use fred::types::{Builder, ClusterHash, CustomCommand, Value};
use proptest::prelude::*;

use support::redis::RedisServer;
use tollgate::limiter::{Algorithm, Cell, Limits, Log, evaluate, evaluate_log, refundable, settle};
use tollgate::store::redis::{Outcome, Reply, parse_batch, script_source};

/// 2023-11-14T22:13:20Z in microseconds: a realistic epoch time.
const T0_US: u64 = 1_700_000_000_000_000;

/// The script of `algorithm` as tollgate sends it to a single server, with
/// the clock taken from its last two arguments (seconds, microseconds)
/// instead of `TIME`.
fn script(algorithm: Algorithm) -> String {
    let clock = "redis.call('TIME')";
    let source = script_source(algorithm);
    assert_eq!(source.matches(clock).count(), 1, "the script reads the clock once");
    // The two values of the clock follow the checks' values, which the
    // script counts from the length of ARGV.
    let count = "local count = #args / 3";
    assert_eq!(source.matches(count).count(), 1, "the script counts the checks once");
    source.replace(clock, "{ARGV[#ARGV - 1], ARGV[#ARGV]}").replace(count, "local count = (#args - 2) / 3")
}

/// `source` with keys that never expire. The test drives the scripts' clock
/// (`script`), but Redis expires keys on its own: a key whose TTL is a
/// 1 ms window would vanish whenever the test takes a real millisecond
/// between two steps (a loaded machine), though on the test's clock it
/// still holds the current window. The scripts keep what a decision needs
/// (window start, bucket time) in the value, so a key kept past its TTL
/// reads as an expired one would: both sides see the same state.
fn without_expiry(source: &str) -> String {
    let bind = "call, tonum, try, kind, tostr = redis.call,";
    assert_eq!(source.matches(bind).count(), 1, "the script binds redis.call once");
    let call = "call, tonum, try, kind, tostr = function(...) \
        local a, b = {...}, {} \
        if a[1] == 'PEXPIRE' then return 1 end \
        if a[1] ~= 'SET' then return redis.call(...) end \
        local i = 1 \
        while i <= #a do \
          if a[i] == 'PX' then i = i + 2 else b[#b + 1] = a[i]; i = i + 1 end \
        end \
        if #b == 3 then return redis.call(b[1], b[2], b[3]) end \
        if #b == 4 then return redis.call(b[1], b[2], b[3], b[4]) end \
        return redis.call(b[1], b[2], b[3], b[4], b[5]) \
      end,";
    source.replace(bind, call)
}

/// `source` as it runs on a server older than Redis 7, whose `SET` does
/// not take `NX` and `GET` together.
fn before_redis_7(source: &str) -> String {
    let check = "(redis.REDIS_VERSION_NUM or 0) >= 0x070000";
    assert_eq!(source.matches(check).count(), 1, "the script asks for the server's version once");
    source.replace(check, "false")
}

/// A server of its own, a runtime to drive calls from a synchronous test,
/// and a client connected to the server (kept alive with it).
fn connected() -> (RedisServer, tokio::runtime::Runtime, Client) {
    let server = RedisServer::start();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let client = runtime.block_on(async {
        let client = Builder::from_config(Config::from_url(&server.url()).expect("url")).build().expect("client");
        client.init().await.expect("connects");
        client
    });
    (server, runtime, client)
}

/// What both sides answer, compared.
#[derive(Debug, PartialEq, Eq)]
struct Decision {
    allowed: bool,
    remaining: u64,
    delay_us: u64,
    /// When the quota is whole again: `X-RateLimit-Reset`, and how long the
    /// key lives in Redis.
    reset_us: u64,
}

async fn lua(client: &Client, source: &str, key: &str, limits: &Limits, cost: u64, id: &str, now_us: u64) -> Decision {
    let args: Vec<Value> = vec![
        source.into(),
        1i64.into(),
        key.into(),
        key.into(),
        // As `scripts::args` sends them (consume; within what a check
        // counts exactly), and the request id with no lease.
        format!(
            "1:{}:{}:{}:{cost}{}",
            limits.limit.min(u32::MAX as u64),
            limits.window / 1_000,
            limits.burst.min(u32::MAX as u64),
            // A calendar window's start, when there is one.
            if limits.origin == 0 { String::new() } else { format!(":{}", limits.origin / 1_000) }
        )
        .into(),
        id.into(),
        ((now_us / 1_000_000) as i64).into(),
        ((now_us % 1_000_000) as i64).into(),
    ];
    let cmd = CustomCommand::new_static("EVAL", ClusterHash::Random, false);
    let reply: Value = client.custom(cmd, args).await.expect("the script runs");
    let v = answer(reply).complete(limits, cost).verdict;
    Decision {
        allowed: v.allowed,
        remaining: v.remaining,
        delay_us: v.delay.div_ceil(1_000),
        reset_us: v.reset_after.div_ceil(1_000),
    }
}

/// A call's one answer, read as the proxy reads it (`parse_batch`).
fn answer(reply: Value) -> Reply {
    match parse_batch(reply, 1).expect("one answer").remove(0) {
        Outcome::Decided(reply) => reply,
        other => panic!("the check was not decided: {other:?}"),
    }
}

fn algorithm() -> impl Strategy<Value = Algorithm> {
    prop_oneof![
        Just(Algorithm::TokenBucket),
        Just(Algorithm::LeakyBucket),
        Just(Algorithm::FixedWindow),
        Just(Algorithm::SlidingWindowCounter),
        Just(Algorithm::SlidingWindowLog),
    ]
}

#[test]
fn the_lua_scripts_and_the_limiter_agree() {
    let (_server, runtime, client) = connected();
    let cases = std::sync::atomic::AtomicU64::new(0);
    // Fixed seeds: the same cases on every run, so that CI is
    // repeatable; LML_SEED=<n> explores another seed instead. Seeds 8 and 33
    // meet buckets of billions whose `remaining` the two sides' rounding put
    // one apart while the slack was a fixed 1e-9 (Lua 1994342295, Rust
    // 1994342294: a bucket of 5e9 at 1e9 per 2.536 s); random seeds met
    // such a case in about one run of 3,000 cases in three.
    let seeds: Vec<u64> = match std::env::var("LML_SEED").ok().and_then(|s| s.parse().ok()) {
        Some(seed) => vec![seed],
        None => vec![0x7011_6a7e, 8, 33],
    };
    for seed in seeds {
        let config = ProptestConfig {
            cases: 256,
            failure_persistence: None,
            rng_seed: proptest::test_runner::RngSeed::Fixed(seed),
            ..ProptestConfig::default()
        };
        proptest!(config, |(
            algorithm in algorithm(),
            limit in 1u64..40,
            burst in 1u64..40,
            window_ms in 1u64..3_000,
            // Microseconds since the previous request (up to about two
            // windows), and the request's cost.
            steps in prop::collection::vec((0u64..6_000_000, 1u64..4), 1..40),
            // Small counts, or counts in billions: limits past 2^32 included.
            scale in prop_oneof![Just(1u64), Just(1_000_000_000u64)],
        )| {
            let case = cases.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            // The log's script adds one entry per unit: billions would fill the
            // server, so the log stays small.
            let scale = if algorithm == Algorithm::SlidingWindowLog { 1 } else { scale };
            let (limit, burst) = (limit * scale, burst * scale);
            let limits = Limits { algorithm, limit, window: window_ms * 1_000_000, burst, origin: 0 };
            // Every other case as a server before Redis 7 runs it: a
            // fresh bucket's key read and then written, not `SET NX GET`.
            let source = without_expiry(&script(algorithm));
            let source = if case % 2 == 1 { before_redis_7(&source) } else { source };
            let key = format!("prop:{case}");
            let mut cell = Cell::default();
            let mut log = Log::new();
            let mut now_us = T0_US;
            for (i, &(gap, cost)) in steps.iter().enumerate() {
                let cost = cost * scale;
                now_us += gap % (2 * window_ms * 1_000 + 1);
                let now = now_us * 1_000;
                let rust = if algorithm == Algorithm::SlidingWindowLog {
                    let v = evaluate_log(&mut log, now, &limits, cost, true);
                    Decision {
                        allowed: v.allowed,
                        remaining: v.remaining,
                        delay_us: v.delay.div_ceil(1_000),
                        reset_us: v.reset_after.div_ceil(1_000),
                    }
                } else {
                    let (v, next) = evaluate(cell, now, &limits, cost);
                    if v.allowed {
                        cell = next;
                    }
                    Decision {
                        allowed: v.allowed,
                        remaining: v.remaining,
                        delay_us: v.delay.div_ceil(1_000),
                        reset_us: v.reset_after.div_ceil(1_000),
                    }
                };
                let id = format!("{case}-{i}");
                let redis = runtime.block_on(lua(&client, &source, &key, &limits, cost, &id, now_us));
                prop_assert_eq!(&redis, &rust, "step {} of {:?} at +{} us", i, limits, now_us - T0_US);
            }
        });
    }
}

/// A window changed by a reload: the state counted under one length is
/// read under another, alike on both sides (a sliding counter whose stored
/// start is none of the new length's counts it all in the window that holds
/// that start: `regrid`), for windows made longer and shorter.
#[test]
fn a_changed_window_reads_alike_in_the_lua_scripts_and_the_limiter() {
    let (_server, runtime, client) = connected();
    let lengths = [(60_000u64, 120_000u64), (120_000, 60_000), (3_000, 4_000), (4_000, 3_000), (1_000, 60_000)];
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindowCounter, Algorithm::TokenBucket] {
        for (case, &(from_ms, to_ms)) in lengths.iter().enumerate() {
            let source = script(algorithm);
            let key = format!("rewindow:{algorithm:?}:{case}");
            let mut cell = Cell::default();
            // Counted at 1.5 of the old windows past T0 (a whole minute),
            // then asked at times spread over three new windows.
            let first = T0_US + from_ms * 1_500;
            let asked = (0..12).map(|i| (T0_US + from_ms * 1_500 + i * to_ms * 250, to_ms));
            for (i, (now_us, window_ms)) in (0..4).map(|i| (first + i * 10, from_ms)).chain(asked).enumerate() {
                let limits = Limits { algorithm, limit: 6, window: window_ms * 1_000_000, burst: 6, origin: 0 };
                let (v, next) = evaluate(cell, now_us * 1_000, &limits, 1);
                if v.allowed {
                    cell = next;
                }
                let rust = Decision {
                    allowed: v.allowed,
                    remaining: v.remaining,
                    delay_us: 0,
                    reset_us: v.reset_after.div_ceil(1_000),
                };
                let redis = runtime.block_on(lua(&client, &source, &key, &limits, 1, "", now_us));
                assert_eq!(redis, rust, "{algorithm:?} {from_ms} ms -> {to_ms} ms, step {i}");
            }
        }
    }
}

/// One settle call (mode 4) of `units` given back (`back`) or charged, for
/// a reservation counted `since_us` ago.
#[allow(clippy::too_many_arguments)]
async fn lua_settle(
    client: &Client,
    source: &str,
    key: &str,
    limits: &Limits,
    units: u64,
    back: bool,
    since_us: u64,
    now_us: u64,
) {
    let sign = if back { '-' } else { '+' };
    let args: Vec<Value> = vec![
        source.into(),
        1i64.into(),
        key.into(),
        key.into(),
        format!(
            "4:{}:{}:{}:{units}{}",
            limits.limit,
            limits.window / 1_000,
            limits.burst,
            if limits.origin == 0 { String::new() } else { format!(":{}", limits.origin / 1_000) }
        )
        .into(),
        format!("{sign}{since_us}").into(),
        ((now_us / 1_000_000) as i64).into(),
        ((now_us % 1_000_000) as i64).into(),
    ];
    let cmd = CustomCommand::new_static("EVAL", ClusterHash::Random, false);
    let _: Value = client.custom(cmd, args).await.expect("the settle script runs");
}

/// Settlement (`cost_response_header`) on both sides: every admitted
/// request is corrected a while later by a random difference, refunds and
/// charges into debt alike, and the decisions that follow must agree.
#[test]
fn settling_agrees_between_the_lua_scripts_and_the_limiter() {
    let (_server, runtime, client) = connected();
    let cases = std::sync::atomic::AtomicU64::new(0);
    let config = ProptestConfig {
        cases: 256,
        failure_persistence: None,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x005e_771e),
        ..ProptestConfig::default()
    };
    proptest!(config, |(
        algorithm in prop_oneof![
            Just(Algorithm::TokenBucket),
            Just(Algorithm::FixedWindow),
            Just(Algorithm::SlidingWindowCounter),
        ],
        limit in 1u64..40,
        burst in 1u64..40,
        window_ms in 1u64..3_000,
        // Gap before the request, its reserved cost, how long after it
        // the correction comes, and the real cost's difference.
        steps in prop::collection::vec((0u64..6_000_000, 1u64..4, 0u64..3_000_000, -4i64..12), 1..40),
    )| {
        let case = cases.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let limits = Limits { algorithm, limit, window: window_ms * 1_000_000, burst, origin: 0 };
        let source = without_expiry(&script(algorithm));
        let key = format!("settle:{case}");
        let mut cell = Cell::default();
        let mut now_us = T0_US;
        for (i, &(gap, cost, lag, delta)) in steps.iter().enumerate() {
            now_us += gap % (2 * window_ms * 1_000 + 1);
            let (v, next) = evaluate(cell, now_us * 1_000, &limits, cost);
            if v.allowed {
                cell = next;
            }
            let rust = Decision { allowed: v.allowed, remaining: v.remaining, delay_us: 0, reset_us: v.reset_after.div_ceil(1_000) };
            let id = format!("{case}-{i}");
            let redis = runtime.block_on(lua(&client, &source, &key, &limits, cost, &id, now_us));
            prop_assert_eq!(&redis, &rust, "step {} of {:?} at +{} us", i, limits, now_us - T0_US);
            if !v.allowed || delta == 0 {
                continue;
            }
            let lag = lag % (window_ms * 1_000 + 1);
            now_us += lag;
            // Never more back than was reserved, nor than a bucket still
            // holds of it (as both stores bound it, `refundable`).
            let delta = refundable(&limits, cost, delta.max(-(cost as i64)), lag * 1_000);
            if delta == 0 {
                continue;
            }
            if let Some(c) = settle(cell, now_us * 1_000, &limits, delta, lag * 1_000) {
                cell = c;
            }
            runtime.block_on(lua_settle(
                &client, &source, &key, &limits, delta.unsigned_abs(), delta < 0, lag, now_us,
            ));
        }
    });
}

/// A lease an instance holds in the escrow test below: the units it may
/// still spend here, those it was granted (what its settle quotes), its
/// slot's end (µs), after which it spends nothing more.
#[derive(Debug, Clone, Copy)]
struct Held {
    units: u64,
    taken: u64,
    slot: u64,
}

/// Token-bucket leases (bucket.lua's escrow), driven as three instances
/// would drive them (`store/redis/lease/`): each spends its lease locally until it
/// runs out or its slot ends, then asks the script, settling the lease it
/// held in the same call, with escrow periods that differ between the
/// instances (a `lease_lifetime` rolled out to some of them). Whatever the
/// order, the units admitted in any span of time never pass the bucket's
/// burst plus what refills in that span, and the key never expires before
/// the last escrow slot holding units has ended.
#[test]
fn escrowed_leases_never_admit_past_the_bucket() {
    let (_server, runtime, client) = connected();
    let source = script(Algorithm::TokenBucket);
    let cases = std::sync::atomic::AtomicU64::new(0);
    let config = ProptestConfig {
        cases: 200,
        failure_persistence: None,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x0e5c_0000),
        ..ProptestConfig::default()
    };
    proptest!(config, |(
        limit in 2u64..20,
        burst in 2u64..60,
        window_ms in 1_000u64..3_000,
        want in 1u64..8,
        // Each instance's escrow period (µs), and its phase.
        periods in prop::collection::vec(prop_oneof![Just(300_000u64), Just(1_000_000), Just(4_000_000)], 3),
        phase in 0u64..300_000,
        // Which instance, the microseconds before its request, its cost,
        // and whether it renews its lease ahead first.
        steps in prop::collection::vec((0usize..3, 0u64..400_000, 1u64..3, prop::bool::weighted(0.3)), 1..80),
    )| {
        let case = cases.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let key = format!("escrow:{case}");
        let spec = format!("1:{limit}:{}:{burst}", window_ms * 1_000);
        let rate = limit as f64 / (window_ms * 1_000) as f64; // units per µs
        let mut held: [Option<Held>; 3] = [None; 3];
        let mut admitted: Vec<(u64, u64)> = Vec::new();
        let mut now_us = T0_US;
        let call = |cost: u64, tail: Vec<u8>, now_us: u64| {
            let args: Vec<Value> = vec![
                source.as_str().into(),
                1i64.into(),
                key.as_str().into(),
                key.as_str().into(),
                format!("{spec}:{cost}").into(),
                Value::Bytes(tail.into()),
                ((now_us / 1_000_000) as i64).into(),
                ((now_us % 1_000_000) as i64).into(),
            ];
            let cmd = CustomCommand::new_static("EVAL", ClusterHash::Random, false);
            let reply: Value = runtime.block_on(client.custom(cmd, args)).expect("the script runs");
            answer(reply)
        };
        for (i, &(at, gap, cost, renew)) in steps.iter().enumerate() {
            now_us += gap;
            if renew && let Some(h) = held[at].filter(|h| now_us < h.slot) {
                // As a renewal ahead (`Leases::take`): the lease is settled
                // with its unspent units carried (a negative slot) into the
                // slot of a new grant, and the holder goes on spending them.
                let mut tail = vec![b'|'];
                let unspent = h.units.min(h.taken);
                for v in [want as f64, periods[at] as f64, phase as f64, -(h.slot as f64), h.taken as f64, unspent as f64] {
                    tail.extend_from_slice(&v.to_le_bytes());
                }
                let reply = call(0, tail, now_us);
                held[at] = None;
                if reply.token != 0 {
                    let slot = now_us + reply.lease_ttl / 1_000;
                    prop_assert_eq!(slot, reply.token as u64, "step {}: the renewed lease lasts until its slot ends", i);
                    let units = unspent + reply.granted;
                    held[at] = Some(Held { units, taken: units, slot });
                } else {
                    prop_assert_eq!(unspent + reply.granted, 0, "step {}: units carried or granted name their slot", i);
                }
            }
            if let Some(h) = held[at].as_mut()
                && h.units >= cost
                && now_us < h.slot
            {
                h.units -= cost;
                admitted.push((now_us, cost));
                continue;
            }
            // As `Leases::want`: a lease whose slot has not ended is settled
            // (what was granted given up, what was spent counted now); one
            // whose slot has ended was counted whole when it ended.
            let settle = held[at].take().filter(|h| now_us < h.slot);
            let (slot, taken, unspent) = settle.map_or((0, 0, 0), |h| (h.slot, h.taken, h.units.min(h.taken)));
            let mut tail = vec![b'|'];
            for v in [want, periods[at], phase, slot, taken, unspent] {
                tail.extend_from_slice(&(v as f64).to_le_bytes());
            }
            let reply = call(cost, tail, now_us);
            if reply.verdict.allowed {
                admitted.push((now_us, cost));
            }
            if reply.granted > 0 {
                // Valid until its slot ends: `lease_ttl` counts from the call.
                let slot = now_us + reply.lease_ttl / 1_000;
                prop_assert_eq!(slot, reply.token as u64, "step {}: the lease lasts until its slot ends", i);
                held[at] = Some(Held { units: reply.granted, taken: reply.granted, slot });
            }
            // The stored slots (doubles after the stamp and level): the key
            // must outlive the last of them.
            let on_key = |command: &'static str| {
                let cmd = CustomCommand::new_static(command, ClusterHash::Random, false);
                runtime.block_on(client.custom::<Value, Value>(cmd, vec![key.as_str().into()])).expect(command)
            };
            let state = match on_key("GET") {
                Value::Bytes(b) => Some(b.to_vec()),
                Value::String(s) => Some(s.as_bytes().to_vec()),
                _ => None,
            };
            let last_end = state
                .as_deref()
                .map(|s| s.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes"))).collect::<Vec<_>>())
                .and_then(|v| v.get(2..).map(|slots| slots.chunks(2).map(|p| p[0] as u64).max().unwrap_or(0)))
                .unwrap_or(0);
            // (-1: not written by this step's call; persisted below.)
            let ttl_ms = on_key("PTTL").as_i64().expect("PTTL is an integer");
            if last_end > now_us && ttl_ms != -1 {
                prop_assert!(
                    ttl_ms * 1_000 + 50_000 >= (last_end - now_us) as i64,
                    "step {}: the key lives {} ms, its last slot ends in {} us", i, ttl_ms, last_end - now_us
                );
            }
            // The TTL is counted on the server's clock, not the injected
            // one: kept, the key could expire before the injected clock
            // says its level has drained. A key past its TTL holds what a
            // fresh one would, so keeping it changes no decision.
            on_key("PERSIST");
        }
        // Any span from one admission to a later one holds at most the
        // burst plus what refilled in it.
        for (a, &(start, _)) in admitted.iter().enumerate() {
            let mut sum = 0;
            for &(end, units) in &admitted[a..] {
                sum += units;
                let most = burst as f64 + rate * (end - start) as f64 + 1e-6;
                prop_assert!(
                    sum as f64 <= most,
                    "{} units admitted in {} us, at most {:.2}: {:?}", sum, end - start, most, admitted
                );
            }
        }
    });
}

/// A fixed window aligned to a calendar window's start (`Limits::origin`)
/// counts alike on both sides: inside the window, from a clock behind its
/// start, past its end (an instance that has not seen the boundary yet), and
/// then under the next window's origin and length.
#[test]
fn the_fixed_window_script_and_the_limiter_agree_on_calendar_windows() {
    let (_server, runtime, client) = connected();
    let source = script(Algorithm::FixedWindow);
    const HOUR_US: u64 = 3_600_000_000;
    // A 23-hour day whose start is no multiple of 23 hours since the epoch.
    let origin_us = T0_US - 5 * HOUR_US - 7_000_000;
    let day = Limits {
        algorithm: Algorithm::FixedWindow,
        limit: 3,
        window: 23 * HOUR_US * 1_000,
        burst: 3,
        origin: origin_us * 1_000,
    };
    let next = Limits { window: 24 * HOUR_US * 1_000, origin: (origin_us + 23 * HOUR_US) * 1_000, ..day };
    let steps: [(&Limits, u64); 9] = [
        (&day, origin_us - 2_000_000),
        (&day, T0_US),
        (&day, T0_US + 1),
        (&day, T0_US + 2),
        (&day, origin_us + 23 * HOUR_US - 1),
        (&day, origin_us + 23 * HOUR_US + 5_000),
        (&next, origin_us + 23 * HOUR_US + 6_000),
        (&next, origin_us + 23 * HOUR_US - 3_000),
        (&next, origin_us + 23 * HOUR_US + 7_000),
    ];
    let mut cell = Cell::default();
    for (i, (limits, now_us)) in steps.into_iter().enumerate() {
        let (v, after) = evaluate(cell, now_us * 1_000, limits, 1);
        if v.allowed {
            cell = after;
        }
        let rust = Decision {
            allowed: v.allowed,
            remaining: v.remaining,
            delay_us: 0,
            reset_us: v.reset_after.div_ceil(1_000),
        };
        let redis = runtime.block_on(lua(&client, &source, "calendar:{day}", limits, 1, "", now_us));
        assert_eq!(redis, rust, "step {i}");
    }
    // Settled (`cost_response_header`) in a calendar window: a refund within
    // the day, a charge into debt, a refund that comes after midnight (the
    // day it was reserved in is over); the decisions that follow agree.
    let key = "calendar:{settled}";
    let mut cell = Cell::default();
    let midnight_us = origin_us + 23 * HOUR_US;
    let steps: [(u64, i64, u64); 4] = [
        (T0_US, -1, 1_000_000),
        (T0_US + 5_000_000, 4, 0),
        (midnight_us - 1_000_000, -1, 2_000_000),
        (midnight_us + 3_000_000, 2, 0),
    ];
    for (i, (reserved_us, delta, lag_us)) in steps.into_iter().enumerate() {
        let (v, after) = evaluate(cell, reserved_us * 1_000, &day, 1);
        if v.allowed {
            cell = after;
        }
        let rust = Decision {
            allowed: v.allowed,
            remaining: v.remaining,
            delay_us: 0,
            reset_us: v.reset_after.div_ceil(1_000),
        };
        let redis = runtime.block_on(lua(&client, &source, key, &day, 1, "", reserved_us));
        assert_eq!(redis, rust, "settle step {i}");
        if !v.allowed {
            continue;
        }
        let now_us = reserved_us + lag_us;
        if let Some(c) = settle(cell, now_us * 1_000, &day, delta, lag_us * 1_000) {
            cell = c;
        }
        runtime.block_on(lua_settle(&client, &source, key, &day, delta.unsigned_abs(), delta < 0, lag_us, now_us));
        for peek_us in [now_us, midnight_us + 4_000_000] {
            let (v, _) = evaluate(cell, peek_us * 1_000, &day, 1);
            let rust = Decision {
                allowed: v.allowed,
                remaining: v.remaining,
                delay_us: 0,
                reset_us: v.reset_after.div_ceil(1_000),
            };
            let redis = runtime.block_on(lua_peek(&client, &source, key, &day, peek_us));
            assert_eq!(redis, rust, "after settle step {i}, at +{} us", peek_us - T0_US);
        }
    }
}

/// What the fixed window script would answer at `now_us`, without counting.
async fn lua_peek(client: &Client, source: &str, key: &str, limits: &Limits, now_us: u64) -> Decision {
    let args: Vec<Value> = vec![
        source.into(),
        1i64.into(),
        key.into(),
        key.into(),
        format!("0:{}:{}:{}:1:{}", limits.limit, limits.window / 1_000, limits.burst, limits.origin / 1_000).into(),
        "".into(),
        ((now_us / 1_000_000) as i64).into(),
        ((now_us % 1_000_000) as i64).into(),
    ];
    let cmd = CustomCommand::new_static("EVAL", ClusterHash::Random, false);
    let reply: Value = client.custom(cmd, args).await.expect("the script runs");
    let v = answer(reply).verdict;
    Decision { allowed: v.allowed, remaining: v.remaining, delay_us: 0, reset_us: v.reset_after.div_ceil(1_000) }
}

/// One call of the concurrency script in `mode` (0 peek, 1 take, 2 give
/// back, 3 renew) for slot `id` at `now_us`: (allowed, remaining).
async fn slot_call(
    client: &Client,
    source: &str,
    limit: u64,
    ttl_us: u64,
    mode: u8,
    id: &str,
    now_us: u64,
) -> (bool, u64) {
    let key = "slots:{concurrency}";
    let args: Vec<Value> = vec![
        source.into(),
        1i64.into(),
        key.into(),
        key.into(),
        format!("{mode}:{limit}:{ttl_us}:{limit}:1").into(),
        id.into(),
        ((now_us / 1_000_000) as i64).into(),
        ((now_us % 1_000_000) as i64).into(),
    ];
    let cmd = CustomCommand::new_static("EVAL", ClusterHash::Random, false);
    let reply: Value = client.custom(cmd, args).await.expect("the script runs");
    let v = answer(reply).verdict;
    (v.allowed, v.remaining)
}

/// The concurrency script counts as `src/limiter.rs` does while slots are
/// held and given back, and on top of it a slot nobody renews expires
/// exactly `slot_ttl` after it was taken or last renewed (the crash
/// bound), by the script's clock.
#[test]
fn the_concurrency_script_expires_slots_nobody_renews() {
    let (_server, runtime, client) = connected();
    let source = script(Algorithm::Concurrency);
    const TTL: u64 = 2_000_000;
    let at = |mode: u8, id: &str, offset_us: u64| {
        runtime.block_on(slot_call(&client, &source, 2, TTL, mode, id, T0_US + offset_us))
    };
    // Taken while free, refused when both are held, as the limiter says.
    let limits = Limits { algorithm: Algorithm::Concurrency, limit: 2, window: TTL * 1_000, burst: 2, origin: 0 };
    let mut cell = Cell::default();
    for id in ["a", "b", "c"] {
        let (v, next) = evaluate(cell, T0_US * 1_000, &limits, 1);
        if v.allowed {
            cell = next;
        }
        assert_eq!(at(1, id, 0), (v.allowed, v.remaining), "taking {id}");
    }
    assert_eq!(at(0, "peek", TTL - 1), (false, 0), "both still held a microsecond before they expire");
    // `a` is renewed; `b` is not, and expires at exactly TTL.
    assert_eq!(at(3, "a", TTL / 2), (true, 0));
    assert_eq!(at(0, "peek", TTL), (true, 0), "b has expired: one free");
    assert_eq!(at(1, "c", TTL), (true, 0), "c takes b's slot");
    assert_eq!(at(3, "b", TTL + 1), (false, 0), "a renewal finds b gone");
    // Given back: free at once, whatever the time.
    assert_eq!(at(2, "a", TTL + 2), (true, 0));
    assert_eq!(at(1, "d", TTL + 2), (true, 0));
    assert_eq!(at(1, "e", TTL + 3), (false, 0));
    // c (taken at TTL) and d (at TTL + 2) are never renewed.
    assert_eq!(at(0, "peek", 2 * TTL - 1), (false, 0), "c and d held");
    assert_eq!(at(0, "peek", 2 * TTL), (true, 0), "c expired, d still held");
    assert_eq!(at(0, "peek", 2 * TTL + 2), (true, 1), "both expired");
}
