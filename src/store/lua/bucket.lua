-- Token bucket and leaky bucket, which share their state: a level that rises
-- by `cost` per admitted request and falls at `limit` per `window`. The token
-- bucket's level is the tokens taken (capacity `burst`); the leaky bucket's is
-- the queue of `burst` requests, and an admitted request waits `delay` for the
-- queue ahead of it to drain (shaping). Rust prepends `local SHAPING = ...`
-- (false for the token bucket, true for the leaky bucket), which also gives
-- the two scripts distinct SHA1s.
-- The same arithmetic as `bucket` in src/limiter.rs, on the server's clock.
--
-- KEYS[1]  the bucket, a string "<updated_us>:<level>"
-- ARGV     mode (0 peek, 1 consume, 2 refund), limit, window_us, burst, cost
-- Returns  {allowed, remaining, reset_after_ns, retry_after_ns, delay_ns, token,
--           granted, lease_ttl_ns}: the token bucket leases (see prelude.lua)
--           with lease_ttl_ns 0: its units stay valid only while the level they
--           sit on has not drained, which the caller works out from
--           reset_after_ns (the level's drain time, granted units included; see
--           src/store/redis/lease.rs), and only units still in the level are
--           given back. The leaky bucket never leases, since its delay is
--           decided request by request.
--
-- The arguments, `now` (server clock, µs), EPSILON and ns_ceil come from
-- prelude.lua, which Rust prepends.

local rate = limit / window -- level drained per microsecond
local function drain_ns(tokens)
  return ns_ceil((tokens - EPSILON) / rate * 1000)
end

local stored_t, stored = now, 0
local state = redis.call('GET', key)
if state then
  local t, l = string.match(state, '^(%d+):(.+)$')
  if t then
    stored_t, stored = tonumber(t), tonumber(l)
  end
end
local level = math.max(stored - math.max(now - stored_t, 0) * rate, 0)
-- Keep the later timestamp so that a clock stepping back (a failover to a
-- node whose clock is behind) never drains the level twice.
local t = math.max(now, stored_t)

local function save(new_level)
  if new_level <= EPSILON then
    redis.call('DEL', key)
    return
  end
  -- The key lives until the bucket is full again: an idle key vanishes.
  local ttl_ms = math.max(math.ceil(drain_ns(new_level) / 1000000), 1) + 1
  redis.call('SET', key, string.format('%d:%.17g', t, new_level), 'PX', ttl_ms)
end

if mode == 2 then
  -- Refund: give back what an earlier call of this request took.
  if state then save(math.max(level - cost, 0)) end
  return {1, 0, 0, 0, 0, 0}
end

if level + cost <= capacity + EPSILON then
  local granted = 0
  if not SHAPING then granted = lease(math.floor(capacity - level - cost + EPSILON)) end
  local new_level = level + cost + granted
  if mode == 1 then save(new_level) end
  local remaining = math.floor(math.max(capacity - new_level + EPSILON, 0))
  local delay = 0
  if SHAPING then delay = drain_ns(level) end
  return {1, remaining, drain_ns(new_level), 0, delay, 0, granted, 0}
end
local retry = math.max(drain_ns(level + cost - capacity), 1)
return {0, 0, drain_ns(level), retry, 0, 0}
