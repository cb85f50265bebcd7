-- space.lua: the call-time spacing guard. Stamps a call on the Redis clock just before it is
-- made, and keeps consecutive calls of a limit (and key) at least the limit's spacing apart,
-- however late each caller reached its slot: late starts cannot bunch.
--
-- KEYS[1..n]   per guarded limit (and key): when its next call may come (STRING, us packed
--              '<d'); then the fence marker when ARGV[2] is not ''
-- ARGV[1]      now_us        '' = read Redis TIME (always, outside tests)
-- ARGV[2]      fence_us      the restart fence (prelude.lua); '' = none
-- ARGV[3..]    spacing_us    per key: period / count * cost of this call, in us
--
-- Returns the us to wait before calling (an integer, 0 when no previous call is too
-- close): the call is stamped at now + wait, and each key's next call may come its spacing
-- after that. A key lost with the Redis's data reads as a call at the fence's end.

local now = clock_us(ARGV[1])
local n = #ARGV - 2
if ARGV[2] ~= '' then
  FENCE = fence_of(n + 1, now, tonumber(ARGV[2]))
end
local at = now
for i = 1, n do
  local s = redis.call('GET', KEYS[i])
  if s then
    at = math.max(at, struct.unpack('<d', s))
  else
    at = math.max(at, FENCE + tonumber(ARGV[i + 2]))
  end
end
for i = 1, n do
  local next_at = at + tonumber(ARGV[i + 2])
  redis.call('SET', KEYS[i], struct.pack('<d', next_at), 'PX', ttl_ms(next_at - now))
end
return ceil_us(at - now)
