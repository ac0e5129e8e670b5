-- Appended by Rust to every script, after the algorithm's `decide`: runs
-- `decide` for each check of the call, so that one call (one round trip,
-- one TIME, one scripting entry on the server) decides many checks.
--
-- KEYS[1]  the key of the first check: it routes the call to the node that
--          owns it. The other checks' keys travel in ARGV; in a cluster they
--          are on the same node as far as the caller knows, not in the same
--          slot, which the script's `allow-cross-slot-keys` flag permits.
-- ARGV[1]  the number of checks, then three values per check: its key; its
--          spec "mode:limit:window_us:burst:cost"; and its tail: "" or the
--          extra value, followed for a lease by "|want:period_us:phase_us:
--          settle_at:taken:unspent"
-- Returns  STRIDE integers per check, in order: {allowed, remaining,
--          reset_after_ns, retry_after_ns, delay_ns, token, granted,
--          lease_ttl_ns}; allowed is -1 when the key is not on this node
--          (the caller asks its owner on its own; nothing was written) and
--          -2 when the check failed, the second value then being the error.
--
-- Every value read and written costs the server more than the arithmetic
-- of a check: hence few values per check, and a spec (the same for every
-- check of a rule and cost) parsed once per call.
--
-- A check that fails does not fail the others: `decide` runs under pcall.
-- A key this node does not own fails on its first read, before any write
-- of its check.
local STRIDE = 8
local specs = {}
local function spec(text)
  local parsed = specs[text]
  if not parsed then
    local m, l, w, b, c = match(text, '^(%d+):(%d+):(%d+):(%d+):(%d+)$')
    parsed = {tonumber(m), tonumber(l), tonumber(w), tonumber(b), tonumber(c)}
    specs[text] = parsed
  end
  return parsed
end
local out = {}
local count = tonumber(ARGV[1])
for c = 0, count - 1 do
  local at = 2 + c * 3
  key = ARGV[at]
  local s = spec(ARGV[at + 1])
  mode, limit, window, capacity, cost = s[1], s[2], s[3], s[4], s[5]
  local tail = ARGV[at + 2]
  extra, want, period, phase, settle_at, taken, unspent = '', 0, 0, 0, 0, 0, 0
  if tail ~= '' then
    local leasing
    extra, leasing = match(tail, '^([^|]*)|?(.*)$')
    if leasing ~= '' then
      local w, p, f, t, u, n = match(leasing, '^(%d+):(%d+):(%d+):(%d+):(%d+):(%d+)$')
      want, period, phase = tonumber(w) or 0, tonumber(p) or 0, tonumber(f) or 0
      settle_at, taken, unspent = tonumber(t) or 0, tonumber(u) or 0, tonumber(n) or 0
    end
  end
  local ok, a, b, d, r, y, k, g, l = pcall(decide)
  local o = c * STRIDE
  if ok then
    out[o + 1], out[o + 2], out[o + 3], out[o + 4] = a, b, d, r
    out[o + 5], out[o + 6], out[o + 7], out[o + 8] = y, k, g or 0, l or 0
  else
    local message = a
    if type(a) == 'table' then message = a.err end
    message = tostring(message)
    local code = -2
    if find(message, 'non local key', 1, true) then code = -1 end
    out[o + 1], out[o + 2], out[o + 3], out[o + 4] = code, message, 0, 0
    out[o + 5], out[o + 6], out[o + 7], out[o + 8] = 0, 0, 0, 0
  end
end
return out
