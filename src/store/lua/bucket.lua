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
-- The parsed spec `rate` and `tol` were derived from.
local rate_spec
local function drain_ns(tokens)
  return ns_ceil((tokens - tol) / rate * 1000)
end

-- The call's clock as stored: packed once per call, by its first check
-- that writes.
local stamp_at, STAMP = nil, ''

-- The live escrow slots of the check being decided, in order of their
-- ends: `nlive` of them (0 to 2), the first ending `ea` holding `ua` units,
-- the second `eb` and `ub`. Plain values rather than tables: a table costs
-- the server a lookup or a store per use.
local nlive, ea, ua, eb, ub = 0, 0, 0, 0, 0

-- A slot that ended at `ends` joins the level at `t` with its `units`,
-- as if all were spent then: the level drains until `ends`, then takes
-- them. (Comparisons instead of max: each library call costs more than the
-- arithmetic.)
local function join(level, t, ends, units)
  if ends > t then
    level = level - (ends - t) * rate
    if level < 0 then level = 0 end
    t = ends
  elseif level < 0 then
    level = 0
  end
  return level + units, t
end

-- Stores the level at `t` and the live slots holding units; `drain` is the
-- nanoseconds until level and escrow are gone.
local function save(t, new_level, drain)
  local a, b = nlive >= 1 and ua > 0, nlive == 2 and ub > 0
  if new_level <= tol and not a and not b then
    if box_tail then return put_boxed(nil, nil) end
    call('DEL', key)
    return
  end
  -- The key lives until the bucket is full again and the last slot holding
  -- units has ended: an idle key vanishes, escrow never before its slot.
  local last = now
  if b then last = eb elseif a then last = ea end
  local ttl_ms = ceil((drain / 1000 + (last - now)) / 1000) + 1
  local value
  if a and b then
    value = pack('<dddddd', t, new_level, ea, ua, eb, ub)
  elseif a then
    value = pack('<dddd', t, new_level, ea, ua)
  elseif b then
    value = pack('<dddd', t, new_level, eb, ub)
  else
    value = pack('<dd', t, new_level)
  end
  if box_tail then return put_boxed(value, ttl_ms) end
  call('SET', key, value, 'PX', format('%d', ttl_ms))
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

-- Puts `units` into the live slot ending at `token` (the slot ending
-- between one and two periods from now), or opens it; returns the end of
-- the slot they went to.
local function escrow_in(token, units)
  if nlive >= 1 and ea == token then
    ua = ua + units
  elseif nlive == 2 and eb == token then
    ub = ub + units
  elseif nlive == 0 then
    nlive, ea, ua = 1, token, units
  elseif nlive == 1 then
    -- Kept in order of their ends: holders whose periods differ grant
    -- into slots that end in either order.
    if token < ea then
      nlive, ea, ua, eb, ub = 2, token, units, ea, ua
    else
      nlive, eb, ub = 2, token, units
    end
  else
    -- Holders that disagree on the period: join the slot that ends last,
    -- which then lasts as long as both (longer only holds more back).
    if token > eb then eb = token end
    token = eb
    ub = ub + units
  end
  return token
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
      rate, tol, rate_spec = limit / window, slack(capacity), parsed_spec
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
  -- States are 16, 32 or 48 bytes: an odd length holds a box (box.lua).
  if state and #state % 2 == 1 then
    local left
    state, left = unbox(state)
    if left > 0 and mode <= 1 then return IN_BOX, 0, left * 1000, left * 1000, 0, 0 end
  else
    box_tail = nil
  end
  if rate_spec ~= parsed_spec then
    rate, tol, rate_spec = limit / window, slack(capacity), parsed_spec
  end
  -- Keep the later timestamp so that a clock stepping back (a failover to a
  -- node whose clock is behind) never drains the level twice.
  local t, level = now, 0
  nlive = 0
  if state then
    -- Under 16 bytes is no bucket's state: unpack's error fails the check.
    -- One unpack for as many values as the state holds.
    local n = #state
    if n < 32 then
      t, level = unpack('<dd', state)
    else
      local e1, u1, e2, u2
      if n >= 48 then
        t, level, e1, u1, e2, u2 = unpack('<dddddd', state)
        if e1 > e2 then e1, e2, u1, u2 = e2, e1, u2, u1 end
      else
        t, level, e1, u1 = unpack('<dddd', state)
      end
      -- Slots that have ended join the level at their end (the later
      -- one only after the first has ended too).
      if e1 <= now then
        level, t = join(level, t, e1, u1)
      else
        nlive, ea, ua = 1, e1, u1
      end
      if e2 and e2 <= now then
        level, t = join(level, t, e2, u2)
      elseif e2 and nlive == 1 then
        nlive, eb, ub = 2, e2, u2
      elseif e2 then
        nlive, ea, ua = 1, e2, u2
      end
    end
  end
  -- As max(level - max(now - t, 0) * rate, 0) and t = max(now, t).
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
  -- counted them all. A negative `settle_at` renews ahead: the holder goes
  -- on spending the units it calls unspent, which are carried into the
  -- slot of this call's grant (below), so every unit stays counted at full
  -- weight until it is settled as spent.
  local settled, carry = settle_at, 0
  if settled < 0 then
    settled, carry = -settled, unspent
  end
  if settled > 0 and mode ~= 0 and nlive > 0 then
    local spent = taken - unspent
    if spent < 0 then spent = 0 end
    if ea == settled then
      ua = ua - taken
      if ua < 0 then ua = 0 end
      level = level + spent
    elseif nlive == 2 and eb == settled then
      ub = ub - taken
      if ub < 0 then ub = 0 end
      level = level + spent
    end
  end

  -- The slot a grant goes to, and the carried units put there (whether or
  -- not the settled slot was found: carried units count, never fewer).
  local token = 0
  if period > 0 and mode ~= 0 then
    token = floor((now - phase) / period + 2) * period + phase
    if carry > 0 then token = escrow_in(token, carry) end
  end

  local escrow = 0
  if nlive >= 1 then escrow = ua end
  if nlive == 2 then escrow = escrow + ub end

  if mode == 4 then
    -- Settle (`cost_response_header`): the real cost minus the reserved
    -- one, given back (`extra` starts with '-') or charged on top. A
    -- charge may take the level above the capacity: a debt that the next
    -- requests wait out, as `settle` in src/limiter/reservation.rs.
    local new_level
    if match(extra, '^%-') then
      new_level = max(level - cost, 0)
    else
      new_level = level + cost
    end
    if state or new_level > tol then save(t, new_level, drain_ns(new_level + escrow)) end
    return 1, 0, 0, 0, 0, 0
  end

  if mode == 2 then
    -- Refund: give back what an earlier call of this request took.
    if state then
      local new_level = max(level - cost, 0)
      save(t, new_level, drain_ns(new_level + escrow))
    end
    return 1, 0, 0, 0, 0, 0
  end

  local used = level + escrow
  if used + cost <= capacity + tol then
    local granted, ttl = 0, 0
    if not SHAPING and period > 0 then granted = lease(floor(capacity - used - cost + tol)) end
    if granted > 0 then
      token = escrow_in(token, granted)
      escrow = escrow + granted
    end
    if granted > 0 or carry > 0 then
      ttl = (token - now) * 1000
    else
      token = 0
    end
    local new_level = level + cost
    local drain = drain_ns(new_level + escrow)
    if mode == 1 then save(t, new_level, drain) end
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
  if mode == 1 and settled > 0 then save(t, level, drain) end
  if carry > 0 then
    -- Nothing granted, but the carried units' slot is the holder's now.
    return 0, 0, drain, retry, 0, token, 0, (token - now) * 1000
  end
  return 0, 0, drain, retry, 0, 0
end
