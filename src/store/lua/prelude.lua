-- Prepended by Rust (src/store/redis/scripts.rs) to every script and
-- function library: the values each check takes, the server's clock, and
-- the rounding rules of src/limiter.rs, written once. Then comes the
-- algorithm's `decide`, then batch.lua, whose `run` decides the checks of
-- one call.
--
-- A call decides a batch of checks on keys of one node (see batch.lua for
-- the layout of ARGV and of the reply). The values below are those of the
-- check being decided; batch.lua sets them before each `decide`:
--
-- key      the check's key
-- mode     0 peek, 1 consume, 2 refund
-- limit, window (µs), capacity (the burst)
-- origin   the fixed window's alignment (µs), see below
-- cost     units of this request
-- extra    an algorithm-specific string: the refund token of a window, the
--          request id of the sliding log
-- want     units the caller would like to take ahead of need (0 for none),
--          and for token-bucket leases the escrow `period` and `phase`
--          (µs) and a lease to settle: `settle_at` (its slot end, 0 for
--          none, negated when the holder renews ahead and carries its
--          unspent units over: see bucket.lua), the units `taken` and the
--          units of those `unspent`
--
-- Time is read from the server (TIME), never passed in: every proxy
-- instance agrees on it whatever its own clock says. Microseconds since the
-- epoch (~1.7e15) are exact in a Lua double; nanoseconds would not be.
-- The library functions the scripts use, as locals: a global lookup
-- costs a table access (and, in a script, a metatable's) on every call.
-- Bound by the first call (`run` in batch.lua): a function library cannot
-- read them while it loads, and keeps them from call to call after (a
-- script binds them in every call). Named apart from the globals they
-- hold, so that binding them can read those.
local max, min, floor, ceil, abs, fmod
local format, match, find, byte, sub, unpack, pack
local call, tonum, try, kind, tostr
-- Whether SET takes NX and GET together (Redis 7 and later).
local nx_get

-- What `decide` answers first for a check it admitted on a fresh key
-- whose answer follows from the spec alone, which the caller then derives
-- itself: one value to send instead of four (see batch.lua).
local FRESH = 2

-- The server's clock at the start of the call, in µs and as stored in keys.
local now, NOW

local key, mode, limit, window, capacity, cost, extra
-- The parsed spec these values come from (batch.lua), kept from call to
-- call: an algorithm may keep there what it derives from the spec alone.
local parsed_spec
-- Where fixed windows are aligned (µs): 0, the epoch, except for a calendar
-- window, whose start the proxy computed (`Limits::origin`).
local origin = 0
local want, period, phase, settle_at, taken, unspent = 0, 0, 0, 0, 0, 0
-- The rule's `penalty` (ms, 0 for none) and `penalty_after` (see batch.lua).
local penalty, after = 0, 1

-- Scripts that lease answer two more values, {..., granted, lease_ttl_ns}:
-- the units taken ahead for the caller to spend locally, and how long they
-- stay valid (0: until given back). A lease is granted only on an admitted
-- consume that leaves at least as much again for everyone else, so leases
-- stop well before the limit and the last units are decided one by one.
-- A renewal ahead tops up what the caller still holds (`unspent`: a
-- bucket's carried units, a window's units, whose tail settles nothing):
-- granted only where a whole lease of that size would be, so renewing
-- ahead leases no nearer the limit than asking when spent.
local function lease(room)
  if mode ~= 1 or want <= 0 then return 0 end
  local held = 0
  -- (A settle of a spent lease, a positive slot, gives its unspent up.)
  if settle_at <= 0 then held = unspent end
  if room < 2 * (want + held) then return 0 end
  return want
end

-- Floating point slack when comparing levels of up to `capacity`, as
-- `slack` in src/limiter.rs: EPSILON, or 1e-12 of the capacity when that is
-- more, since rounding errors grow with the magnitude.
local EPSILON = 1e-9
local function slack(capacity)
  local tol = capacity * 1e-12
  if tol < EPSILON then return EPSILON end
  return tol
end

-- Rounds nanoseconds up, except that rounding noise just above a whole
-- number does not add one (`ns_ceil` in src/limiter.rs).
-- (Comparisons instead of abs and max: each library call costs more than
-- the arithmetic around it, and this runs for every check.)
local function ns_ceil(x)
  local whole = floor(x + 0.5)
  local off, scale = x - whole, x * 1e-14
  if off < 0 then off = -off end
  if scale < 0 then scale = -scale end
  if scale < 1e-6 then scale = 1e-6 end
  if off <= scale then x = whole end
  if x <= 0 then return 0 end
  return ceil(x)
end
