-- The penalty box (src/store/redis/blocks.rs): a key refused by its rule
-- until a moment, whatever its counters say. Included after prelude.lua in
-- every script, and in the admin API's script (blocks.rs, with
-- box_admin.lua), which binds the same names (`call`, `now`, ...) first.
--
-- A box is kept in the bucket's own key, so that the read a check does
-- anyway finds it and a check with nothing in the box costs no command
-- more than it did before there was a box:
--
-- string states (the buckets, the windows): the box follows the state in
--          the value. States are whole doubles, so a value of odd length
--          holds a box; a block on a key with no state is a value of the
--          box alone. The key lives as long as the longer of the two.
-- the sliding log: the member "!" and the box, scored 0, which the read of
--          the entries that have left the window (scores 0 to now - window)
--          returns first; pruned with them once the box is over.
-- concurrency: its reads return counts, which cannot tell a box from a
--          slot: the key becomes a string holding the box alone, its slots
--          kept aside in `<key>:held` (same slot of the cluster). The
--          check's first command then fails (WRONGTYPE), and batch.lua
--          looks in the box (`aside_box`). Penalties never box these keys
--          (config refuses them), blocks through the API may.
--
-- The box: its kind ('p' a rule's penalty, 'a' a block through the API),
-- the reason (a block's; none for a penalty), a zero byte when the reason's
-- length is odd (so that the box's length is odd), the end (µs, server
-- clock, a little-endian double) and the reason's length (2 bytes).

-- `allowed` of a refusal by the box: the key was there (IN_BOX), or this
-- refusal put it there (ENTERED).
local IN_BOX, ENTERED = 3, 4

local function box_of(kind, reason, ends)
  local pad = ''
  if #reason % 2 == 1 then pad = '\0' end
  return kind .. reason .. pad .. pack('<d', ends) .. pack('<H', #reason)
end

-- A value (or a log member after its '!') holding a box: the state before
-- the box ('' for none), the box, and the box's end.
local function split_box(v)
  local n = #v
  local r = byte(v, n - 1) + 256 * byte(v, n)
  local start = n - 10 - r % 2 - r
  local ends = unpack('<d', v, n - 9)
  return sub(v, 1, start - 1), sub(v, start), ends
end

-- Milliseconds from now to `ends` (µs), at least 1.
local function ms_to(ends)
  local ms = ceil((ends - now) / 1000)
  if ms < 1 then ms = 1 end
  return ms
end

-- Puts the key `k` in the box until `ends`, whatever it held. `layout`:
-- how its algorithm keeps a box (see above): 'value' (string states),
-- 'member' (the log) or 'aside' (concurrency).
local function enter_box(k, ends, kind, reason, layout)
  local box = box_of(kind, reason, ends)
  local ms = ms_to(ends)
  -- The state's own time to live, which the box must not cut short.
  local keep = call('PTTL', k)
  if layout == 'member' then
    call('ZREMRANGEBYSCORE', k, 0, 0)
    call('ZADD', k, 0, '!' .. box)
    call('PEXPIRE', k, format('%d', max(ms, keep)))
    return
  end
  if layout == 'aside' then
    local held = k .. ':held'
    if call('TYPE', k)['ok'] == 'zset' then
      call('RENAME', k, held)
    end
    keep = call('PTTL', held)
  elseif keep ~= -2 then
    local v = call('GET', k)
    if #v % 2 == 1 then v = split_box(v) end
    box = v .. box
  end
  call('SET', k, box, 'PX', format('%d', max(ms, keep)))
end

-- Of the check being decided (check scripts only): the box its string
-- state holds while it lasts, and how long it has left (ms), for what a
-- give-back writes to keep; nil for none (set or cleared where the
-- algorithm reads its state, before any write).
local box_tail, box_ms

-- The state of a string value of odd length (one holding a box), nil when
-- there is none but the box, and how long the box has left (µs; 0 or less
-- when it is over, and then the next write drops it).
local function unbox(value)
  local state, box, ends = split_box(value)
  local left = ends - now
  if left > 0 then box_tail, box_ms = box, ms_to(ends) else box_tail = nil end
  if state == '' then state = nil end
  return state, left
end

-- Writes the string state `value` (nil: none left) of a key whose box
-- lasts, keeping the box: for `ms` or the box's time if longer, or with
-- the key's time to live (which the box already extended) when `ms` is nil.
local function put_boxed(value, ms)
  value = (value or '') .. box_tail
  if not ms then return call('SET', key, value, 'KEEPTTL') end
  if ms < box_ms then ms = box_ms end
  call('SET', key, value, 'PX', format('%d', ms))
end
