-- Fixed window: a counter per window `[origin + k * window, origin + (k + 1) * window)`,
-- aligned to the epoch (origin 0) or to a calendar window's start.
-- The same arithmetic as `fixed_window` in src/limiter.rs, on the server's clock.
--
-- key      the counter: two little-endian doubles, the window's start (µs)
--          and its count (decimal text cost the server more to parse and
--          format than the rest of a check, see bucket.lua)
-- values   those of prelude.lua; for a refund, `extra` is the window start
--          the consume returned as its token
-- Returns  allowed, remaining, reset_after_ns, retry_after_ns, delay_ns, token,
--          granted, lease_ttl_ns where token is the window start the request
--          was counted in; a lease (prelude.lua) lasts until that window ends
--
-- The window start is kept in the value rather than left to the key's
-- expiry: expiry runs on a clock frozen at the script's start and with
-- millisecond resolution, TIME does not, and the two must never disagree
-- about which window a request falls in.
--
-- The values, `now` (server clock, µs), slack and ns_ceil come from
-- prelude.lua, which Rust prepends.

-- Stores what a give-back leaves of the window starting `start`, its
-- time to live kept (and its box, if it is in one).
local function give_back(start, count)
  if box_tail then
    if count == 0 then return put_boxed(nil, nil) end
    return put_boxed(pack('<dd', start, count), nil)
  end
  if count == 0 then
    call('DEL', key)
  else
    call('SET', key, pack('<dd', start, count), 'KEEPTTL')
  end
end

local function decide()
  local stored_start, stored_count = -1, 0
  local state = call('GET', key)
  -- 16 bytes: an odd length holds a box (box.lua).
  if state and #state % 2 == 1 then
    local left
    state, left = unbox(state)
    if left > 0 and mode <= 1 then return IN_BOX, 0, left * 1000, left * 1000, 0, 0 end
  else
    box_tail = nil
  end
  if state then
    -- Under 16 bytes is no window's state: unpack's error fails the check.
    stored_start, stored_count = unpack('<dd', state)
  end

  if mode == 4 then
    -- Settle (`cost_response_header`), as `settle` in src/limiter/reservation.rs:
    -- `extra` is the sign and how long ago (µs) the reservation was
    -- counted. A charge goes to the current window and may take its count
    -- past the limit (a debt the next requests wait out); a refund reaches
    -- the reservation's window only while it is the current one.
    local sign, since = match(extra, '^([+-])(%d+)$')
    local start = max(now - fmod(now - origin, window), stored_start)
    if sign == '+' then
      local count = cost
      if stored_start == start then count = stored_count + cost end
      local ttl_ms = max(ceil((start + window - now) / 1000), 1)
      if box_tail then
        put_boxed(pack('<dd', start, count), ttl_ms)
      else
        call('SET', key, pack('<dd', start, count), 'PX', format('%d', ttl_ms))
      end
    elseif sign == '-' then
      local at = now - tonum(since)
      if stored_start == start and stored_start == at - fmod(at - origin, window) then
        give_back(stored_start, max(stored_count - cost, 0))
      end
    end
    return 1, 0, 0, 0, 0, 0
  end

  if mode == 2 then
    -- Refund, only if the window it was counted in is still the stored one.
    if stored_start == tonum(extra) then
      give_back(stored_start, max(stored_count - cost, 0))
    end
    return 1, 0, 0, 0, 0, 0
  end

  -- A clock behind the stored window (a failover to a node whose clock is
  -- behind) counts in the stored window instead of wiping it with an older one.
  -- Windows are aligned to `origin`; a server clock behind a calendar
  -- window's start (fmod of a negative is negative) counts in that window.
  local start = max(now - fmod(now - origin, window), stored_start)
  local count = 0
  if stored_start == start then count = stored_count end
  local reset_us = start + window - now

  if count + cost <= limit then
    local granted = lease(limit - count - cost)
    count = count + cost + granted
    if mode == 1 then
      -- The key lives until its window ends.
      local ttl_ms = max(ceil(reset_us / 1000), 1)
      call('SET', key, pack('<dd', start, count), 'PX', format('%d', ttl_ms))
    end
    return 1, limit - count, reset_us * 1000, 0, 0, start, granted, reset_us * 1000
  end
  return 0, 0, reset_us * 1000, max(reset_us * 1000, 1), 0, 0
end
