//! The penalty box in Redis, outside the request path: blocks and lifts
//! from the admin API, and the registry that lists what is in the box.
//!
//! A key's box is kept in its bucket, the key the rule's script reads
//! anyway (see `src/store/lua/box.lua` for how each algorithm holds it):
//! a check with nothing in the box costs Redis nothing more, and the box
//! expires by itself, in the bucket's slot. A block therefore lands in the
//! bucket of the rule's algorithm as it is now; a reload that changes the
//! algorithm starts the key afresh, box and counters alike. Redis cannot
//! list keys by pattern without a scan of every node, so each rule also
//! has a registry, `{prefix}boxes:<rule>`, a sorted set of its keys in the
//! box by the moment they come out (server time, ms). Keys are chosen by
//! clients, and every key a flood makes the rule refuse may enter the box:
//! the registry keeps at most [`MAX_LISTED`] keys, those that stay longest
//! (the box itself holds every key; only listing is bounded), and expires
//! with its last entry. A penalty is registered in the background by the
//! instance whose check put the key in the box.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use fred::interfaces::ClientLike;
use fred::types::config::Options;
use fred::types::{ClusterHash, CustomCommand, Value};

use super::call;
use super::scripts;
use super::shared::Shared;
use crate::limiter::{Algorithm, Nanos};
use crate::store::StoreError;
use crate::store::penalty_box::{Listed, Source};

/// The most keys a rule's registry lists (and `GET /blocks` shows).
pub const MAX_LISTED: usize = 1_000;

/// The shortest an admin command may wait for Redis: the store timeout
/// is sized for the request path, an operator can wait longer.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(2);

/// Registers `ARGV[1]` in the registry `KEYS[1]` for `ARGV[2]` ms from
/// the server's now, drops what has come out, keeps the `ARGV[3]` that
/// stay longest, and lets the registry expire with its last entry.
const REGISTER: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], string.format('%d', now + tonumber(ARGV[2])), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', now))
local n = redis.call('ZCARD', KEYS[1])
local keep = tonumber(ARGV[3])
if n > keep then redis.call('ZREMRANGEBYRANK', KEYS[1], 0, n - keep - 1) end
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if last[2] then redis.call('PEXPIREAT', KEYS[1], last[2]) end
return n
";

/// What the admin API runs on a bucket's key, `KEYS[1]`: `ARGV[1]` is
/// `block` (for `ARGV[2]` ms, the reason `ARGV[3]`), `lift` (answers 1 if
/// the box was not over) or `peek` (`{µs left, kind, reason}`, or nil);
/// the last value is how the key holds its box (`layout` in box.lua,
/// [`box_layout`]). box.lua's and box_admin.lua's functions, with the
/// names they use bound as the check scripts bind them.
static BOX_SCRIPT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "local max, ceil = math.max, math.ceil\n\
         local format, sub, byte = string.format, string.sub, string.byte\n\
         local unpack, pack, call = struct.unpack, struct.pack, redis.call\n\
         local key\n\
         local t = call('TIME')\n\
         local now = tonumber(t[1]) * 1000000 + tonumber(t[2])\n\
         {}{}\n\
         local op, layout = ARGV[1], ARGV[#ARGV]\n\
         if op == 'block' then\n\
           enter_box(KEYS[1], now + tonumber(ARGV[2]) * 1000, 'a', ARGV[3], layout)\n\
           return 1\n\
         elseif op == 'lift' then\n\
           return lift_box(KEYS[1], layout)\n\
         end\n\
         return peek_box(KEYS[1])\n",
        include_str!("../lua/box.lua"),
        include_str!("../lua/box_admin.lua")
    )
});

/// `{total, now_ms, {key, until_ms, ...}}`: the registry's keys still in
/// the box, those that stay longest first, at most `ARGV[1]`.
const LIST: &str = r"
local t = redis.call('TIME')
local now = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
local total = redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
local keys = redis.call('ZREVRANGEBYSCORE', KEYS[1], '+inf', '(' .. now, 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[1]))
return {total, now, keys}
";

impl Shared {
    /// The registry of the rule whose keys start with `rule_prefix` (its
    /// encoded name and `|`).
    fn registry_key(&self, rule_prefix: &str) -> String {
        format!("{}boxes:{}", self.key_prefix, rule_prefix.trim_end_matches('|'))
    }

    /// One command on the node owning `key`, bounded.
    async fn admin_command(&self, name: &'static str, key: &str, args: Vec<Value>) -> Result<Value, StoreError> {
        let timeout = ADMIN_TIMEOUT.max(self.timeout);
        let options = Options { timeout: Some(timeout), max_attempts: Some(1), ..Default::default() };
        let slot = fred::util::redis_keyslot(key.as_bytes());
        // A redirection (a failover, a slot migration) proves the command
        // did not run: sent again a few times.
        let mut last = None;
        for _ in 0..3 {
            let cmd = CustomCommand::new_static(name, ClusterHash::Custom(slot), false);
            match self.pool.next().with_options(&options).custom(cmd, args.clone()).await {
                Ok(v) => return Ok(v),
                Err(e) if e.details().contains("Too many redirections") => {
                    last = Some(e);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(call::store_error(&e, timeout)),
            }
        }
        Err(last.map_or(StoreError::Timeout(timeout), |e| call::store_error(&e, timeout)))
    }

    /// Puts `key` (a bucket key, of the rule `rule_prefix` starts, whose
    /// algorithm is `algorithm`) in the box for `ttl`, whatever it held.
    pub(super) async fn block(
        &self,
        rule_prefix: &str,
        key: &str,
        algorithm: Algorithm,
        ttl: Duration,
        reason: &str,
    ) -> Result<(), StoreError> {
        let ms = ttl.as_millis().max(1).to_string();
        self.box_script(key, algorithm, &["block", &ms, reason]).await?;
        self.register(rule_prefix, key, &ms).await
    }

    /// Runs [`BOX_SCRIPT`] on the bucket of `key` and `algorithm`.
    async fn box_script(&self, key: &str, algorithm: Algorithm, args: &[&str]) -> Result<Value, StoreError> {
        let bucket = scripts::redis_key(&self.key_prefix, key, algorithm);
        let layout = box_layout(algorithm);
        let mut values: Vec<Value> = vec![BOX_SCRIPT.as_str().into(), 1.into(), bucket.as_str().into()];
        values.extend(args.iter().map(|a| Value::from(*a)));
        values.push(layout.into());
        self.admin_command("EVAL", &bucket, values).await
    }

    /// Registers a key a penalty put in the box, in the background.
    pub(super) fn register_penalty(self: &Arc<Self>, key: &str, penalty: Nanos) {
        let Some(rule_end) = key.find('|') else { return };
        let (shared, key) = (self.clone(), key.to_string());
        let ms = penalty.div_ceil(1_000_000).max(1).to_string();
        tokio::spawn(async move {
            if let Err(e) = shared.register(&key[..=rule_end], &key, &ms).await {
                tracing::debug!(error = %e, key, "could not list a key put in the penalty box");
            }
        });
    }

    async fn register(&self, rule_prefix: &str, key: &str, ms: &str) -> Result<(), StoreError> {
        let registry = self.registry_key(rule_prefix);
        let args: Vec<Value> = vec![
            REGISTER.into(),
            1.into(),
            registry.as_str().into(),
            key.into(),
            ms.into(),
            MAX_LISTED.to_string().into(),
        ];
        self.admin_command("EVAL", &registry, args).await.map(drop)
    }

    /// Takes `key` out of the box, and its refusals towards a penalty;
    /// whether it was in. Requests of the key this instance answered
    /// from its over-limit cache ask Redis again; other instances do
    /// within a second (see `cache`).
    pub(super) async fn unblock(&self, rule_prefix: &str, key: &str, algorithm: Algorithm) -> Result<bool, StoreError> {
        let lifted = self.box_script(key, algorithm, &["lift"]).await?;
        let strikes = format!("{}{{{key}}}:strikes", self.key_prefix);
        self.admin_command("DEL", &strikes, vec![strikes.as_str().into()]).await?;
        let registry = self.registry_key(rule_prefix);
        self.admin_command("ZREM", &registry, vec![registry.as_str().into(), key.into()]).await?;
        for algorithm in ALGORITHMS {
            self.cache.forget(&scripts::redis_key(&self.key_prefix, key, algorithm));
        }
        Ok(matches!(lifted, Value::Integer(n) if n > 0))
    }

    /// The keys of the rule `rule_prefix` starts (whose algorithm is
    /// `algorithm`) in the box, at most `max` (and [`MAX_LISTED`]), those
    /// that stay longest first, and how many its registry holds.
    pub(super) async fn boxed(
        &self,
        rule_prefix: &str,
        algorithm: Algorithm,
        max: usize,
    ) -> Result<(Vec<Listed>, usize), StoreError> {
        let registry = self.registry_key(rule_prefix);
        let max = max.min(MAX_LISTED);
        let args: Vec<Value> = vec![LIST.into(), 1.into(), registry.as_str().into(), max.to_string().into()];
        let reply = self.admin_command("EVAL", &registry, args).await?;
        let bad = || StoreError::Protocol(format!("the penalty box registry answered {reply:?}"));
        let Value::Array(parts) = &reply else { return Err(bad()) };
        let [total, _now, keys] = parts.as_slice() else { return Err(bad()) };
        let (Some(total), Value::Array(keys)) = (integer(total), keys) else {
            return Err(bad());
        };
        let mut listed = Vec::with_capacity(keys.len() / 2);
        for pair in keys.chunks_exact(2) {
            let Some(key) = pair[0].as_string() else { return Err(bad()) };
            // Gone if lifted, or if it ended before its registered moment
            // (a block set anew, shorter): not listed.
            let entry = self.box_script(&key, algorithm, &["peek"]).await?;
            let Value::Array(entry) = entry else { continue };
            let [left, kind, reason] = entry.as_slice() else { return Err(bad()) };
            let Some(left) = integer(left) else { return Err(bad()) };
            let source = match kind.as_string().as_deref() {
                Some("a") => Source::Api(reason.as_string().unwrap_or_default()),
                _ => Source::Penalty,
            };
            let left = u64::try_from(left).unwrap_or(0).saturating_mul(1_000);
            listed.push(Listed { key, left, source });
        }
        Ok((listed, usize::try_from(total).unwrap_or(0)))
    }
}

const ALGORITHMS: [Algorithm; 6] = [
    Algorithm::TokenBucket,
    Algorithm::LeakyBucket,
    Algorithm::FixedWindow,
    Algorithm::SlidingWindowLog,
    Algorithm::SlidingWindowCounter,
    Algorithm::Concurrency,
];

/// How `algorithm`'s key holds a penalty box (`layout` in box.lua, and
/// `BOX_IN` in the scripts' first lines): in its string state, as a member
/// of its log, or with its slots aside.
fn box_layout(algorithm: Algorithm) -> &'static str {
    match algorithm {
        Algorithm::SlidingWindowLog => "member",
        Algorithm::Concurrency => "aside",
        _ => "value",
    }
}

/// An integer Redis answered, as an integer or as its text (a score).
fn integer(v: &Value) -> Option<i64> {
    match v {
        Value::Integer(i) => Some(*i),
        other => other.as_string()?.parse::<f64>().ok().map(|f| f as i64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The admin API writes a box the way the rule's own script reads it.
    #[test]
    fn every_script_holds_the_box_as_the_admin_api_writes_it() {
        for algorithm in ALGORITHMS {
            let first = format!("local BOX_IN = '{}'\n", box_layout(algorithm));
            assert!(scripts::source(algorithm).contains(&first), "{algorithm:?}");
        }
    }
}
