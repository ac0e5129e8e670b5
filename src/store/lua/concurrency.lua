-- Concurrency: at most `limit` requests of a key in flight, across every
-- instance. The same arithmetic as `concurrency` in src/limiter.rs, with
-- slots that expire.
--
-- key      a sorted set of the slots held: one member per request in
--          flight, its request id, scored by when the slot expires (server
--          clock, µs)
-- values   those of prelude.lua; `window` is the slot TTL (µs), `extra`
--          the request id of the slot taken, given back or renewed;
--          `mode` 3 renews
-- Returns  allowed, remaining, reset_after_ns, retry_after_ns, delay_ns, token;
--          a renewal answers allowed 1 if the slot was still held, 0 if it
--          had expired and was gone
--
-- A slot lives `window` after it was taken or last renewed, and the
-- instance holding it renews it while its request runs: the slots of an
-- instance that died stop counting within one TTL, instead of leaking.
-- Expired slots are removed by the next request that takes one. Slots are
-- scored by expiry rather than kept in keys of their own so that counting
-- the live ones is one ZCARD after one ZREMRANGEBYSCORE, in one slot of the
-- cluster.
--
-- The values, `now` (server clock, µs) and the helpers come from
-- prelude.lua, which Rust prepends.

local RETRY_NS = 1000000000

-- The key lives as long as its latest slot: a TTL shortened by a reload
-- must not cut slots taken with the longer one.
local function keep_until_latest()
  local latest = tonum(call('ZRANGE', key, -1, -1, 'WITHSCORES')[2])
  if latest then
    call('PEXPIRE', key, max(ceil((latest - now) / 1000), 1))
  end
end

local function decide()
  local id = extra
  if mode == 2 then
    call('ZREM', key, id)
    return 1, 0, 0, 0, 0, 0
  end
  local expires = format('%d', now + window)
  if mode == 3 then
    if not call('ZSCORE', key, id) then
      return 0, 0, 0, 0, 0, 0
    end
    call('ZADD', key, expires, id)
    keep_until_latest()
    return 1, 0, 0, 0, 0, 0
  end

  -- A slot scored at exactly `now` has expired.
  local held
  if mode == 1 then
    call('ZREMRANGEBYSCORE', key, '-inf', NOW)
    held = call('ZCARD', key)
  else
    held = call('ZCOUNT', key, '(' .. NOW, '+inf')
  end
  if held + cost <= limit then
    local remaining = limit - held - cost
    if mode == 1 then
      call('ZADD', key, expires, id)
      keep_until_latest()
    end
    local reset = 0
    if remaining == 0 then reset = RETRY_NS end
    return 1, remaining, reset, 0, 0, 0
  end
  return 0, 0, RETRY_NS, RETRY_NS, 0, 0
end
