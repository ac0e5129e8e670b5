-- The penalty box's admin side (src/store/redis/blocks.rs): lifting a box
-- and reading one for the listing. After box.lua, in the admin API's
-- script only: the check scripts never run these, and every function a
-- library holds is more for Redis's Lua to collect around each call.

-- The box of `k`: the value or member holding it (without the log's '!'),
-- or nil.
local function find_box(k)
  local t = call('TYPE', k)['ok']
  local v
  if t == 'string' then
    v = call('GET', k)
  elseif t == 'zset' then
    v = call('ZRANGEBYSCORE', k, 0, 0, 'LIMIT', 0, 1)[1]
    if v and byte(v, 1) == 33 then return sub(v, 2), v end
    return nil
  end
  if v and #v % 2 == 1 then return v end
  return nil
end

-- Takes `k` out of the box (its `layout` as in `enter_box`), its state
-- left as it was; whether the box was not over yet.
local function lift_box(k, layout)
  local v, member = find_box(k)
  if not v then return 0 end
  local state, _, ends = split_box(v)
  if member then
    call('ZREM', k, member)
  elseif layout == 'aside' then
    local held = k .. ':held'
    if call('EXISTS', held) == 1 then call('RENAME', held, k) else call('DEL', k) end
  elseif state == '' then
    call('DEL', k)
  else
    call('SET', k, state, 'KEEPTTL')
  end
  if ends > now then return 1 end
  return 0
end

-- `k`'s box as the listing shows it: {µs left, kind, reason}, or false
-- when there is none or it is over.
local function peek_box(k)
  local v = find_box(k)
  if not v then return false end
  local _, box, ends = split_box(v)
  if ends <= now then return false end
  local r = byte(v, #v - 1) + 256 * byte(v, #v)
  return {format('%d', ends - now), sub(box, 1, 1), sub(box, 2, 1 + r)}
end
