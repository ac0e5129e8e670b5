-- Prepended by Rust (src/store/redis/scripts.rs) to every script: the
-- arguments they all take, the server's clock, and the rounding rules of
-- src/limiter.rs, written once.
--
-- KEYS[1]  the bucket's key
-- ARGV     mode (0 peek, 1 consume, 2 refund), limit, window_us, burst,
--          cost, a script-specific sixth value, and the lease wanted: units
--          the caller would like to take ahead of need (0 for none)
--
-- Time is read from the server (TIME), never passed in: every proxy
-- instance agrees on it whatever its own clock says. Microseconds since the
-- epoch (~1.7e15) are exact in a Lua double; nanoseconds would not be.
local key = KEYS[1]
local mode = tonumber(ARGV[1])
local limit = tonumber(ARGV[2])
local window = tonumber(ARGV[3])
local capacity = tonumber(ARGV[4])
local cost = tonumber(ARGV[5])
local want = tonumber(ARGV[7]) or 0

-- Scripts that lease answer two more values, {..., granted, lease_ttl_ns}:
-- the units taken ahead for the caller to spend locally, and how long they
-- stay valid (0: until given back). A lease is granted only on an admitted
-- consume that leaves at least as much again for everyone else, so leases
-- stop well before the limit and the last units are decided one by one.
local function lease(room)
  if mode ~= 1 or want <= 0 or room < 2 * want then return 0 end
  return want
end

-- The clock line: tests/lua_matches_limiter.rs swaps the TIME call below
-- for a time of its choosing, to drive these scripts and src/limiter.rs
-- through the same instants. Production scripts always read the server.
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])

-- Floating point slack when comparing levels, as in src/limiter.rs.
local EPSILON = 1e-9

-- Rounds nanoseconds up, except that rounding noise just above a whole
-- number does not add one (`ns_ceil` in src/limiter.rs).
local function ns_ceil(x)
  local whole = math.floor(x + 0.5)
  if math.abs(x - whole) <= math.max(math.abs(x) * 1e-14, 1e-6) then x = whole end
  if x <= 0 then return 0 end
  return math.ceil(x)
end

