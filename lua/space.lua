-- space.lua: the call-time spacing guard. Stamps a call on the Redis clock just before it is
-- made, and keeps consecutive calls of a limit (and key) at least the limit's spacing apart,
-- however late each caller reached its slot: late starts cannot bunch.
--
-- KEYS[1..n]   per guarded limit (and key): when its next call may come, when the last
--              call was stamped and the limit's spacing per unit of cost then (STRING, us
--              packed '<ddd'; '<d' by an older version: the next call alone); then the
--              fence marker when ARGV[2] is not ''
-- ARGV[1]      now_us        '' = read Redis TIME (always, outside tests)
-- ARGV[2]      fence_us      the restart fence (prelude.lua); '' = none
-- ARGV[3..2+n] spacing_us    per key: period / count * cost of this call, in us
-- ARGV[3+n..]  unit_us       per key: period / count now, in us. A rate raised since the
--                            last call (celery throttle set) shortens the wait after it in
--                            proportion: the guard keeps the spacing of the rate in force,
--                            not of the one the last call was made under.
--
-- Returns the us to wait before calling (an integer, 0 when no previous call is too
-- close): the call is stamped at now + wait, and each key's next call may come its spacing
-- after that. A key lost with the Redis's data reads as a call at the fence's end.

local now = clock_us(ARGV[1])
local n = (#ARGV - 2) / 2
if ARGV[2] ~= '' then
  FENCE = fence_of(n + 1, now, tonumber(ARGV[2]))
end
local at = now
for i = 1, n do
  local s = redis.call('GET', KEYS[i])
  if s then
    local next_at, stamped, unit = struct.unpack('<d', s), nil, nil
    if #s == 24 then
      next_at, stamped, unit = struct.unpack('<ddd', s)
      local unit_now = tonumber(ARGV[n + i + 2])
      if unit_now < unit then
        next_at = stamped + (next_at - stamped) * unit_now / unit
      end
    end
    at = math.max(at, next_at)
  else
    at = math.max(at, FENCE + tonumber(ARGV[i + 2]))
  end
end
for i = 1, n do
  local next_at = at + tonumber(ARGV[i + 2])
  redis.call('SET', KEYS[i], struct.pack('<ddd', next_at, at, tonumber(ARGV[n + i + 2])),
             'PX', ttl_ms(next_at - now))
end
return ceil_us(at - now)
