-- Sliding window log: one sorted-set entry per admitted request within the
-- window, scored by its time and carrying its cost. Exact, at the price of
-- memory per request (not per unit: a request of cost 1000 is one entry).
-- The same arithmetic as `evaluate_log` in src/limiter.rs, on the server's clock.
--
-- key      the log, a sorted set of "<request id>:<cost>" scored by time in
--          us, plus the member "#" that keeps the total cost of the entries
--          in its score, as -1 - total (below every time, so no range by
--          time ever meets it)
-- values   those of prelude.lua; `extra` is the request id (unique per
--          request: the entry it adds or refunds)
-- Returns  allowed, remaining, reset_after_ns, retry_after_ns, delay_ns, token
--
-- The total makes a check cost the entries it expires, not a walk over the
-- window; the entry that must leave before a rejected request fits is found
-- by walking the oldest entries, at most WALK of them.
local TOTAL = '#'
local WALK = 1000
--
-- The values, `now` (server clock, µs), slack and ns_ceil come from
-- prelude.lua, which Rust prepends.

local function cost_of(member)
  return tonum(match(member, ':(%d+)$')) or 0
end

local function stored_total()
  local s = tonum(call('ZSCORE', key, TOTAL))
  if not s then return 0 end
  return max(-1 - s, 0)
end

local function store_total(total)
  if total > 0 then
    call('ZADD', key, -1 - total, TOTAL)
  else
    call('ZREM', key, TOTAL)
  end
end

local function decide()
  local id = extra
  if mode == 2 then
    -- The entry may already have left the window (and been pruned): then
    -- there is nothing to give back.
    if call('ZREM', key, id .. ':' .. cost) == 1 then
      store_total(stored_total() - cost)
    end
    return 1, 0, 0, 0, 0, 0
  end

  -- An entry at exactly `now - window` has left the window. Each entry
  -- expires once, so reading the expired ones is paid once per request.
  local edge = format('%d', now - window)
  local total = stored_total()
  local expired = call('ZRANGEBYSCORE', key, 0, edge)
  -- A box is the member '!' and the box, scored 0 (box.lua): first of
  -- these when there is one. Once over, it leaves with them (its cost 0:
  -- it never ends in ':' and digits).
  local first = expired[1]
  if first and byte(first, 1) == 33 then
    local _, _, ends = split_box(sub(first, 2))
    if ends > now then return IN_BOX, 0, (ends - now) * 1000, (ends - now) * 1000, 0, 0 end
  end
  for _, member in ipairs(expired) do
    total = total - cost_of(member)
  end
  total = max(total, 0)
  if mode == 1 and #expired > 0 then
    -- Pruning never changes a decision; a peek leaves it to the next consume.
    call('ZREMRANGEBYSCORE', key, 0, edge)
    store_total(total)
  end
  local cutoff = '(' .. edge
  -- The newest entry still in the window, if any.
  local last = tonum(call('ZREVRANGEBYSCORE', key, '+inf', cutoff, 'WITHSCORES', 'LIMIT', 0, 1)[2])

  if total + cost <= limit then
    -- Timestamps never go backwards within a log, as in src/limiter.rs.
    local newest = max(now, last or 0)
    if mode == 1 then
      call('ZADD', key, format('%d', newest), id .. ':' .. cost)
      store_total(total + cost)
      -- The key lives until its newest entry leaves the window.
      call('PEXPIRE', key, max(ceil((newest + window - now) / 1000), 1))
    end
    return 1, limit - total - cost, (newest + window - now) * 1000, 0, 0, 0
  end

  -- Free enough of the oldest entries in the window to make room for `cost`.
  -- Past WALK entries, the time the last one walked leaves is a lower bound:
  -- a client that retries then is answered again.
  local need = total + cost - limit
  local retry = window
  if need <= total then
    local freed, walked = 0, 0
    local found = false
    while not found and walked < WALK do
      local batch = call('ZRANGEBYSCORE', key, cutoff, '+inf', 'WITHSCORES', 'LIMIT', walked, 100)
      if #batch == 0 then break end
      for i = 1, #batch, 2 do
        freed = freed + cost_of(batch[i])
        retry = tonum(batch[i + 1]) + window - now
        if freed >= need then
          found = true
          break
        end
      end
      walked = walked + #batch / 2
    end
  end
  local newest = last or now
  return 0, 0, (newest + window - now) * 1000, max(retry * 1000, 1), 0, 0
end
