-- Sliding window counter: the current window's count plus the previous
-- window's, weighted by how much of it the sliding window still covers.
-- The same arithmetic as `sliding_counter` in src/limiter.rs, on the server's clock.
--
-- key      the counters: three little-endian doubles, the current window's
--          start (µs), the previous window's count and the current one's
--          (decimal text cost the server more to parse and format than the
--          rest of a check, see bucket.lua)
-- values   those of prelude.lua; for a refund, `extra` is the window start
--          the consume returned as its token
-- Returns  allowed, remaining, reset_after_ns, retry_after_ns, delay_ns, token,
--          granted, lease_ttl_ns where token is the window start the request
--          was counted in; a lease (prelude.lua) lasts until that window ends:
--          spent within it, its units weigh on the estimate as if they had
--          come at the moment they were counted, which only over-counts
--
-- The values, `now` (server clock, µs), slack and ns_ceil come from
-- prelude.lua, which Rust prepends.

local function save(start, prev, curr, px)
  local value = pack('<ddd', start, prev, curr)
  if box_tail then return put_boxed(value, px) end
  if px then
    call('SET', key, value, 'PX', format('%d', px))
  else
    call('SET', key, value, 'KEEPTTL')
  end
end

local function decide()
  local stored_start, stored_prev, stored_curr = -1, 0, 0
  local state = call('GET', key)
  -- 24 bytes: an odd length holds a box (box.lua).
  if state and #state % 2 == 1 then
    local left
    state, left = unbox(state)
    if left > 0 and mode <= 1 then return IN_BOX, 0, left * 1000, left * 1000, 0, 0 end
  else
    box_tail = nil
  end
  if state then
    -- Under 24 bytes is no counter's state: unpack's error fails the check.
    stored_start, stored_prev, stored_curr = unpack('<ddd', state)
    -- A window start that is no multiple of the window: stored under
    -- another window length (a reload changed it). All its counts become
    -- the count of the window that holds that start, as `regrid` in
    -- src/limiter.rs.
    local off = fmod(stored_start, window)
    if off ~= 0 then
      stored_start = stored_start - off
      stored_prev, stored_curr = 0, min(stored_prev + stored_curr, 4294967295)
    end
  end

  if mode == 4 then
    -- Settle (`cost_response_header`), as `settle` in src/limiter/reservation.rs:
    -- `extra` is the sign and how long ago (µs) the reservation was
    -- counted. A charge goes to the current window (its count may pass the
    -- limit: a debt the next requests wait out); a refund to the window the
    -- reservation went to, current or previous.
    local sign, since = match(extra, '^([+-])(%d+)$')
    local start = max(now - fmod(now, window), stored_start)
    local prev, curr = 0, 0
    if stored_start == start then
      prev, curr = stored_prev, stored_curr
    elseif stored_start + window == start then
      prev, curr = stored_curr, 0
    end
    if sign == '+' then
      curr = min(curr + cost, 4294967295)
      save(start, prev, curr, max(ceil((start + 2 * window - now) / 1000), 1))
    elseif sign == '-' and state then
      local at = now - tonum(since)
      local reserved = at - fmod(at, window)
      if reserved == start then
        save(start, prev, max(curr - cost, 0), max(ceil((start + 2 * window - now) / 1000), 1))
      elseif reserved + window == start then
        save(start, max(prev - cost, 0), curr, max(ceil((start + 2 * window - now) / 1000), 1))
      end
    end
    return 1, 0, 0, 0, 0, 0
  end

  if mode == 2 then
    -- Refund from the window the request was counted in, which may have
    -- become the previous one since.
    local counted_in = tonum(extra)
    if stored_start == counted_in then
      save(stored_start, stored_prev, max(stored_curr - cost, 0))
    elseif stored_start == counted_in + window then
      save(stored_start, max(stored_prev - cost, 0), stored_curr)
    end
    return 1, 0, 0, 0, 0, 0
  end

  -- As in fixed_window.lua: a clock behind the stored window counts in it.
  local start = max(now - fmod(now, window), stored_start)
  local prev, curr = 0, 0
  if stored_start == start then
    prev, curr = stored_prev, stored_curr
  elseif stored_start + window == start then
    prev, curr = stored_curr, 0
  end
  local tol = slack(limit)
  local into = max(now - start, 0) / window
  local estimate = prev * (1 - into) + curr

  if estimate + cost <= limit + tol then
    local granted = lease(floor(limit - estimate - cost + tol))
    curr = curr + cost + granted
    local reset_us = start + 2 * window - now
    if mode == 1 then
      -- The key lives until both windows holding requests have slid out.
      save(start, prev, curr, max(ceil(reset_us / 1000), 1))
    end
    local remaining = floor(max(limit - estimate - cost - granted + tol, 0))
    return 1, remaining, reset_us * 1000, 0, 0, start, granted, (start + window - now) * 1000
  end

  -- The earliest moment the estimate leaves room for `cost`, as an offset
  -- from `start` in microseconds.
  local room = limit - cost
  local at
  if curr <= room and prev > 0 then
    at = (1 - (room - curr) / prev) * window
  else
    local f = 0
    if curr > 0 then f = 1 - room / curr end
    at = window + max(f, 0) * window
  end
  local retry = max(ns_ceil((at - (now - start)) * 1000), 1)
  local reset_us = start + window - now
  if curr > 0 then reset_us = start + 2 * window - now end
  return 0, 0, reset_us * 1000, retry, 0, 0
end
