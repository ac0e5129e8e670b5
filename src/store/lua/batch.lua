-- Appended by Rust to every script and function library, after the
-- algorithm's `decide`: `run` runs `decide` for each check of the call, so
-- that one call (one round trip, one TIME, one scripting entry on the
-- server) decides many checks. A script ends with `return run(ARGV)`; a
-- library registers `run` as a function (see scripts.rs).
--
-- KEYS[1]  the key of the first check: it routes the call to the node that
--          owns it. The other checks' keys travel in ARGV; in a cluster they
--          are on the same node as far as the caller knows, not in the same
--          slot, which the script's `allow-cross-slot-keys` flag permits.
-- ARGV     three values per check: its key; its
--          spec "mode:limit:window_us:burst:cost[:origin_us[:penalty_ms:after]]";
--          and its tail:
--          "", the extra value, or for a lease (which has no extra value)
--          "|" and want, period_us, phase_us, settle_at, taken and unspent
--          as little-endian doubles (48 bytes: decimal parsing costs more
--          than the rest of a call's reading; all are whole numbers below
--          2^53, exact in a double); any of them after "~" and the 32 hex
--          digits of an undo id (see `applied_before`)
-- Returns  per check, in order, eight values {allowed, remaining,
--          reset_after_ns, retry_after_ns, delay_ns, token, granted,
--          lease_ttl_ns} packed into one string of eight little-endian
--          doubles (the caller truncates them as Redis would), or, when the
--          last four are 0 (no delay and no lease: most checks), four
--          integers {10 + allowed, remaining, reset_after_ns,
--          retry_after_ns}, since every value costs the server a conversion
--          (allowed is IN_BOX or ENTERED for a refusal by the penalty box,
--          see below)
--          and a write; allowed is -1 when the key is not
--          on this node (the caller asks its owner on its own; nothing was
--          written) and -2 when the check failed, the second value then
--          being the error (eight values); or the single value 20 when
--          `decide` answered FRESH (see prelude.lua): the check was
--          admitted on a fresh key, and its answer follows from its spec.
--
-- Every value read and written costs the server more than the arithmetic
-- of a check: hence few values per check, and a spec (the same for every
-- check of a rule and cost) parsed once per call.
--
-- A check that fails does not fail the others: `decide` runs under pcall.
-- A key this node does not own fails on its first read, before any write
-- of its check.
-- The specs parsed, kept from call to call by a function library: a rule
-- sends the same spec in every call. Costs clients send make new specs, so
-- the table starts again once it holds SPECS of them.
local SPECS = 256
local specs, nspecs = {}, 0
-- The reply, kept from call to call by a function library: filled afresh,
-- a table rehashes several times as it grows check by check. A nil after
-- the call's last value ends the reply; what lies beyond it is left from a
-- bigger call (at most MAX_BATCH checks' worth, see batch.rs).
local out = {}
local function spec(text)
  local parsed = specs[text]
  if not parsed then
    if nspecs >= SPECS then specs, nspecs = {}, 0 end
    local m, l, w, b, c, o, p, f = match(text, '^(%d+):(%d+):(%d+):(%d+):(%d+):?(%d*):?(%d*):?(%d*)$')
    parsed = {tonum(m), tonum(l), tonum(w), tonum(b), tonum(c), tonum(o) or 0, tonum(p) or 0, tonum(f) or 1}
    specs[text], nspecs = parsed, nspecs + 1
  end
  return parsed
end
-- Undo ids: a call that takes back what an earlier one counted (a refund,
-- a settle, a lease given back or settled) names itself with a unique id,
-- and a second call with the same id (the same call sent again: after a
-- dropped connection the caller cannot know whether the first ran) takes
-- nothing back: the part that takes back is applied once. Each id applied
-- is a key of its own in the key's slot, `<key>:undo:<id>`, set with NX
-- (one command checks and records it) and expiring once the undo could no
-- longer change the key: a window's after UNDO_WINDOWS windows (the
-- window it names is over, or has slid out), which the script's first
-- line sets; a bucket's (UNDO_WINDOWS 0) once a full bucket has drained and
-- the escrow slot it settles has ended, but not before UNDO_FLOOR: a
-- bucket's level does not say which units are whose, and a call is sent
-- again within the store timeout of the first.
local UNDO_FLOOR = 1000000
local function applied_before(id)
  local span
  if UNDO_WINDOWS > 0 then
    span = UNDO_WINDOWS * window
  else
    span = 0
    if limit > 0 then span = window * capacity / limit end
    if span < UNDO_FLOOR then span = UNDO_FLOOR end
    local slot = abs(settle_at) - now
    if slot > span then span = slot end
  end
  local ms = ceil(span / 1000)
  if ms < 1 then ms = 1 end
  return not call('SET', key .. ':undo:' .. id, '', 'NX', 'PX', format('%d', ms))
end
-- A refusal of a rule with a penalty: whether it puts the key in the box
-- (see box.lua), the `after`-th time within one window, counted in
-- `<key's tag>:strikes` (TAG_CUT, set by the script's first line, cuts the
-- algorithm's suffix off the key, so that the count is the rule's and key's
-- whatever the algorithm).
local function strike()
  if after > 1 then
    local strikes = sub(key, 1, TAG_CUT) .. 'strikes'
    local n = call('INCR', strikes)
    if n == 1 then
      local ms = ceil(window / 1000)
      if ms < 1 then ms = 1 end
      call('PEXPIRE', strikes, format('%d', ms))
    end
    if n < after then return false end
    call('DEL', strikes)
  end
  enter_box(key, now + penalty * 1000, 'p', '', BOX_IN)
  return true
end
-- A concurrency check whose key turned out not to be a sorted set (see
-- box.lua): the key is in the box, its slots aside. Peeks and consumes are
-- refused while it lasts; give-backs and renewals reach the slots aside,
-- and the box lives as long as they do. Once it is over, the slots come
-- back and the check is decided as any other.
local function aside_box()
  local _, _, ends = split_box(call('GET', key))
  local held = key .. ':held'
  if ends > now then
    if mode <= 1 then return IN_BOX, 0, (ends - now) * 1000, (ends - now) * 1000, 0, 0 end
    local own = key
    key = held
    local a, b, d, r, y, k = decide()
    key = own
    local ms = call('PTTL', held)
    if ms > call('PTTL', key) then call('PEXPIRE', key, ms) end
    return a, b, d, r, y, k
  end
  if call('EXISTS', held) == 1 then call('RENAME', held, key) else call('DEL', key) end
  return decide()
end
local function wrong_type(e)
  if kind(e) == 'table' then e = e.err end
  return find(tostr(e), 'WRONGTYPE', 1, true)
end
-- One call: binds the library's names, reads the clock, and decides the
-- checks in `args` (ARGV).
local function run(args)
  if not call then
    max, min, floor, ceil, abs, fmod = math.max, math.min, math.floor, math.ceil, math.abs, math.fmod
    format, match, find, byte, sub = string.format, string.match, string.find, string.byte, string.sub
    unpack, pack = struct.unpack, struct.pack
    call, tonum, try, kind, tostr = redis.call, tonumber, pcall, type, tostring
    nx_get = (redis.REDIS_VERSION_NUM or 0) >= 0x070000
  end
  -- The clock line: tests/lua_matches_limiter.rs swaps the TIME call below
  -- for a time of its choosing, to drive these scripts and src/limiter.rs
  -- through the same instants. Production scripts always read the server,
  -- once per call: every check of a batch is decided at the same instant.
  local time = redis.call('TIME')
  -- The stamp as text first (seconds, then microseconds padded to six
  -- digits), then as a number: one conversion instead of two and a format.
  local us = time[2]
  if #us < 6 then us = sub('00000', #us) .. us end
  NOW = time[1] .. us
  now = tonum(NOW)
  -- Three values per check.
  local count = #args / 3
  -- The values of the previous check (of this call or, in a library, of
  -- the last one) stay bound when the next one shares them: the checks of
  -- one rule share a spec, and most have no tail.
  local leased, o = true, 0
  for c = 0, count - 1 do
    local at = 1 + c * 3
    key = args[at]
    local text = args[at + 1]
    local s = specs[text] or spec(text)
    if s ~= parsed_spec then
      mode, limit, window, capacity, cost, origin = s[1], s[2], s[3], s[4], s[5], s[6]
      penalty, after = s[7], s[8]
      parsed_spec = s
    end
    local tail = args[at + 2]
    local undo
    if byte(tail, 1) == 126 then
      -- '~' and an undo id.
      undo, tail = sub(tail, 2, 33), sub(tail, 34)
    end
    if tail ~= '' then
      if #tail == 49 and byte(tail, 1) == 124 then
        -- '|' and a lease's six values as doubles: no decimal parsing.
        extra = ''
        want, period, phase, settle_at, taken, unspent = unpack('<dddddd', tail, 2)
      else
        extra = tail
        want, period, phase, settle_at, taken, unspent = 0, 0, 0, 0, 0, 0
      end
      leased = true
    elseif leased then
      extra, want, period, phase, settle_at, taken, unspent = '', 0, 0, 0, 0, 0, 0
      leased = false
    end
    local ok, a, b, d, r, y, k, g, l = true, 1, 0, 0, 0, 0, 0
    local again = false
    if undo then ok, again = try(applied_before, undo) end
    if not ok then
      a = again
    elseif again and mode == 1 then
      -- A consume that also settled a lease: counted again (towards
      -- refusing), the settle not applied again.
      settle_at, taken, unspent, leased = 0, 0, 0, true
      ok, a, b, d, r, y, k, g, l = try(decide)
    elseif not again then
      ok, a, b, d, r, y, k, g, l = try(decide)
    end
    -- `decide` answers IN_BOX itself for a key whose read found a box, and
    -- counts nothing then (give-backs and renewals give back all the same).
    -- (`a == 0` first: an admitted check, the common case, asks no more.)
    if a == 0 and ok and penalty > 0 and mode == 1 and cost > 0 then
      local struck, entered = try(strike)
      if struck and entered then
        r = penalty * 1000000
        if d < r then d = r end
        a = ENTERED
      end
    elseif not ok and BOX_IN == 'aside' and wrong_type(a) then
      ok, a, b, d, r, y, k, g, l = try(aside_box)
    end
    if a == FRESH then
      out[o + 1] = 20
      o = o + 1
    elseif ok and y == 0 and k == 0 and (g or 0) == 0 and (l or 0) == 0 then
      out[o + 1], out[o + 2], out[o + 3], out[o + 4] = a + 10, b, d, r
      o = o + 4
    elseif ok then
      -- Eight values as one string of doubles: packing them costs the
      -- server less than sending eight integers.
      out[o + 1] = pack('<dddddddd', a, b, d, r, y, k, g or 0, l or 0)
      o = o + 1
    else
      local message = a
      if kind(a) == 'table' then message = a.err end
      message = tostr(message)
      local code = -2
      if find(message, 'non local key', 1, true) then code = -1 end
      out[o + 1], out[o + 2], out[o + 3], out[o + 4] = code, message, 0, 0
      out[o + 5], out[o + 6], out[o + 7], out[o + 8] = 0, 0, 0, 0
      o = o + 8
    end
  end
  out[o + 1] = nil
  return out
end
