-- Sliding window log: one sorted-set entry per unit admitted within the
-- window, scored by its time. Exact, at the price of memory per request.
-- The same arithmetic as `evaluate_log` in src/limiter.rs, on the server's clock.
--
-- KEYS[1]  the log, a sorted set of "<request id>:<unit>" scored by time in us
-- ARGV     mode (0 peek, 1 consume, 2 refund), limit, window_us, burst, cost,
--          request id (unique per request: the members it adds or refunds)
-- Returns  {allowed, remaining, reset_after_ns, retry_after_ns, delay_ns, token}
--
-- A request of cost n adds n entries, so ZCARD is the count and the entry
-- that must leave before a request fits is found by rank, both without
-- reading the whole log.
local id = ARGV[6]
--
-- The arguments, `now` (server clock, µs), EPSILON and ns_ceil come from
-- prelude.lua, which Rust prepends.

-- Sends `command key ...` with the items `item(1..n)` in batches: `unpack`
-- of a very large table would overflow the Lua stack.
local function batched(command, n, item)
  local args, len = {}, 0
  for i = 1, n do
    for _, v in ipairs(item(i)) do
      len = len + 1
      args[len] = v
    end
    if len >= 1000 or i == n then
      redis.call(command, key, unpack(args, 1, len))
      len = 0
    end
  end
end

if mode == 2 then
  batched('ZREM', cost, function(i) return {id .. ':' .. i} end)
  return {1, 0, 0, 0, 0, 0}
end

-- An entry at exactly `now - window` has left the window.
local cutoff = '(' .. string.format('%d', now - window)
if mode == 1 then
  -- Pruning never changes a decision; a peek leaves it to the next consume.
  redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%d', now - window))
end
local count = redis.call('ZCOUNT', key, cutoff, '+inf')
-- The newest entry still in the window, if any.
local last
if count > 0 then
  last = tonumber(redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2])
end

if count + cost <= limit then
  -- Timestamps never go backwards within a log, as in src/limiter.rs.
  local newest = math.max(now, last or 0)
  if mode == 1 then
    local at = string.format('%d', newest)
    batched('ZADD', cost, function(i) return {at, id .. ':' .. i} end)
    -- The key lives until its newest entry leaves the window.
    redis.call('PEXPIRE', key, math.max(math.ceil((newest + window - now) / 1000), 1))
  end
  return {1, limit - count - cost, (newest + window - now) * 1000, 0, 0, 0}
end

-- Free enough of the oldest entries in the window to make room for `cost`.
local need = count + cost - limit
local retry = window
if need <= count then
  local entry = redis.call('ZRANGEBYSCORE', key, cutoff, '+inf', 'WITHSCORES', 'LIMIT', need - 1, 1)
  if entry[2] then retry = tonumber(entry[2]) + window - now end
end
local newest = last or now
return {0, 0, (newest + window - now) * 1000, math.max(retry * 1000, 1), 0, 0}
