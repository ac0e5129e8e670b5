-- Token bucket and leaky bucket, which share their state: a level that rises
-- by `cost` per admitted request and falls at `limit` per `window`. The token
-- bucket's level is the tokens taken (capacity `burst`); the leaky bucket's is
-- the queue of `burst` requests, and an admitted request waits `delay` for the
-- queue ahead of it to drain (shaping). Rust prepends `local SHAPING = ...`
-- (false for the token bucket, true for the leaky bucket), which also gives
-- the two scripts distinct SHA1s.
-- The same arithmetic as `bucket` in src/limiter.rs, on the server's clock.
--
-- key      the bucket: little-endian doubles, the time it was updated (µs)
--          and its level, then up to two escrow slots, each its end (µs)
--          and its units (see below): 16, 32 or 48 bytes. Decimal text cost
--          the server more to parse and to format than the rest of a check
--          (a 16-digit stamp is strtod's slow path, a level `%.17g`); every
--          value is a whole number of µs below 2^53 or a level, exact in a
--          double either way.
-- values   those of prelude.lua; `extra` is unused, and a lease comes with
--          its escrow period and phase and may settle an earlier one
-- Returns  allowed, remaining, reset_after_ns, retry_after_ns, delay_ns, token,
--          granted, lease_ttl_ns: a lease (see prelude.lua) is held in the
--          escrow slot ending `token` µs, valid for lease_ttl_ns. The leaky
--          bucket never leases, since its delay is decided request by request.
--          A fresh bucket's admitted consume with no lease answers FRESH
--          alone (see prelude.lua).
--
-- Escrow: leased units do not sit on the level, which refills; they sit in
-- a slot that does not drain until it ends, so a lease stays valid for its
-- whole life however fast the bucket refills, and never lets the bucket
-- admit past its burst: every leased unit is counted at full weight from
-- the grant until it is settled, which is at least as much as the unit
-- weighs when it is spent at any moment in between. A lease is settled by
-- the holder (the slot gives up the units granted and the level takes the
-- ones spent, as if spent now) or, if the holder never comes back (a
-- crash), when its slot ends: the slot's units then join the level as if
-- all were spent at that moment. Slots end on lease-period boundaries
-- shifted by a per-key phase, between one and two periods after the grant,
-- so at most two are live at a time.
--
-- The values, `now` (server clock, µs), slack and ns_ceil come from
-- prelude.lua, which Rust prepends.

-- Of the check being decided: the level drained per microsecond, and the
-- slack of its capacity.
local rate, tol
local function drain_ns(tokens)
  return ns_ceil((tokens - tol) / rate * 1000)
end

-- The call's clock as stored: packed once per call, by its first check
-- that writes.
local stamp_at, STAMP = nil, ''

-- Escrow slots, reused from check to check: ends (µs) and units as stored,
-- then those still live, in order of their ends.
local ends, units, live_ends, live_units = {}, {}, {}, {}
local function clear(t)
  for i = #t, 1, -1 do t[i] = nil end
end

-- Stores the level at `t` and the live slots holding units; `escrow` is
-- their total and `drain` the nanoseconds until level and escrow are gone.
local function save(t, new_level, escrow, drain)
  local slots, last = '', now
  for i = 1, #live_ends do
    if live_units[i] > 0 then
      slots = slots .. pack('<dd', live_ends[i], live_units[i])
      last = live_ends[i]
    end
  end
  if new_level <= tol and slots == '' then
    call('DEL', key)
    return
  end
  -- The key lives until the bucket is full again, escrow included: an idle
  -- key vanishes.
  local ttl_ms = ceil((drain / 1000 + (last - now)) / 1000) + 1
  call('SET', key, pack('<dd', t, new_level) .. slots, 'PX', format('%d', ttl_ms))
end

-- What a fresh bucket admitting `cost` with no lease writes, from the
-- spec alone: the general path below with level, escrow and slots all
-- zero. Kept in the parsed spec as {value after the stamp (the level),
-- TTL (ms, as text)}, or false when such a request would not be admitted (or costs
-- nothing). Its answer is not sent: the caller derives the same one
-- (`fresh_bucket` in scripts.rs).
local function fresh_answer()
  if not (cost > tol and cost <= capacity + tol) then return false end
  return {pack('<d', cost), format('%d', ceil(drain_ns(cost) / 1000 / 1000) + 1)}
end

local function decide()
  local state
  if mode == 1 and period == 0 and not SHAPING then
    -- A fresh bucket admitting a request with no lease asked: the common
    -- case by far for keys far below their limit, whose bucket is full
    -- again (its key gone) before their next request. Its answer follows
    -- from the spec, so the caller derives it (FRESH).
    local fresh = parsed_spec.fresh
    if fresh == nil then
      rate, tol = limit / window, slack(capacity)
      fresh = fresh_answer()
      parsed_spec.fresh = fresh
    end
    if fresh and stamp_at ~= now then stamp_at, STAMP = now, pack('<d', now) end
    if fresh and nx_get then
      -- Written only if there is no key (NX), and otherwise what the key
      -- holds read back (GET), with nothing written: one command where a
      -- fresh key took a GET and a SET.
      state = call('SET', key, STAMP .. fresh[1], 'NX', 'PX', fresh[2], 'GET')
      if not state then return FRESH end
    elseif fresh then
      state = call('GET', key)
      if not state then
        call('SET', key, STAMP .. fresh[1], 'PX', fresh[2])
        return FRESH
      end
    end
  end
  if state == nil then state = call('GET', key) end
  rate, tol = limit / window, slack(capacity)
  local stored_t, stored = now, 0
  if #ends > 0 then
    clear(ends)
    clear(units)
  end
  if #live_ends > 0 then
    clear(live_ends)
    clear(live_units)
  end
  if state then
    -- Under 16 bytes is no bucket's state: unpack's error fails the check.
    local n = #state
    stored_t, stored = unpack('<dd', state)
    if n >= 32 then
      ends[1], units[1] = unpack('<dd', state, 17)
      if n >= 48 then ends[2], units[2] = unpack('<dd', state, 33) end
    end
  end
  if #ends == 2 and ends[1] > ends[2] then
    ends[1], ends[2], units[1], units[2] = ends[2], ends[1], units[2], units[1]
  end

  -- Keep the later timestamp so that a clock stepping back (a failover to a
  -- node whose clock is behind) never drains the level twice.
  local t = stored_t
  local level = stored
  -- Slots that have ended join the level at their end, as if all their
  -- units were spent then, and drain from there.
  for i = 1, #ends do
    if ends[i] <= now then
      level = max(level - max(ends[i] - t, 0) * rate, 0) + units[i]
      t = max(t, ends[i])
    else
      live_ends[#live_ends + 1], live_units[#live_units + 1] = ends[i], units[i]
    end
  end
  -- As max(level - max(now - t, 0) * rate, 0) and t = max(now, t), with
  -- comparisons (what math.max does: the first unless a later one is
  -- greater) instead of library calls, which cost more on every check.
  if now > t then
    local drained = level - (now - t) * rate
    if drained > 0 then level = drained else level = 0 end
    t = now
  elseif level < 0 then
    level = 0
  end

  -- A holder settles its lease: the slot gives up what it granted, and the
  -- units spent join the level now (later than they were spent, so they
  -- weigh at least as much as they should). A slot that has ended already
  -- counted them all.
  if settle_at > 0 and mode ~= 0 then
    for i = 1, #live_ends do
      if live_ends[i] == settle_at then
        local left, spent = live_units[i] - taken, taken - unspent
        if left < 0 then left = 0 end
        if spent < 0 then spent = 0 end
        live_units[i] = left
        level = level + spent
      end
    end
  end

  local escrow = 0
  for i = 1, #live_units do escrow = escrow + live_units[i] end

  if mode == 4 then
    -- Settle (`cost_response_header`): the real cost minus the reserved
    -- one, given back (`extra` starts with '-') or charged on top. A
    -- charge may take the level above the capacity: a debt that the next
    -- requests wait out, as `settle` in src/limiter/settle.rs.
    local new_level
    if match(extra, '^%-') then
      new_level = max(level - cost, 0)
    else
      new_level = level + cost
    end
    if state or new_level > tol then save(t, new_level, escrow, drain_ns(new_level + escrow)) end
    return 1, 0, 0, 0, 0, 0
  end

  if mode == 2 then
    -- Refund: give back what an earlier call of this request took.
    if state then
      local new_level = max(level - cost, 0)
      save(t, new_level, escrow, drain_ns(new_level + escrow))
    end
    return 1, 0, 0, 0, 0, 0
  end

  local used = level + escrow
  if used + cost <= capacity + tol then
    local granted, token, ttl = 0, 0, 0
    if not SHAPING and period > 0 then granted = lease(floor(capacity - used - cost + tol)) end
    if granted > 0 then
      -- The slot ending between one and two periods from now.
      token = floor((now - phase) / period + 2) * period + phase
      local at = 0
      for i = 1, #live_ends do
        if live_ends[i] == token then at = i end
      end
      if at == 0 and #live_ends < 2 then
        at = #live_ends + 1
        live_ends[at], live_units[at] = token, 0
      elseif at == 0 then
        -- Holders that disagree on the period: join the slot that ends
        -- last, which then lasts as long as both (longer only holds more
        -- back).
        at = 2
        live_ends[2] = max(live_ends[2], token)
        token = live_ends[2]
      end
      live_units[at] = live_units[at] + granted
      escrow = escrow + granted
      ttl = (token - now) * 1000
    end
    local new_level = level + cost
    local drain = drain_ns(new_level + escrow)
    if mode == 1 then save(t, new_level, escrow, drain) end
    local remaining = capacity - new_level - escrow + tol
    if remaining > 0 then remaining = floor(remaining) else remaining = 0 end
    local delay = 0
    if SHAPING then delay = drain_ns(level) end
    return 1, remaining, drain, 0, delay, token, granted, ttl
  end
  -- Counting escrow as if it drained: the earliest the request could fit,
  -- if its holders settle what they did not spend.
  local retry = max(drain_ns(used + cost - capacity), 1)
  local drain = drain_ns(used)
  if mode == 1 and settle_at > 0 then save(t, level, escrow, drain) end
  return 0, 0, drain, retry, 0, 0
end
