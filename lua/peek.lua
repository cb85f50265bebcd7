-- peek.lua: what an acquire would be told now, taking nothing (for status and gauges).
--
-- KEYS as acquire.lua without an acquisition: KEYS[1] the holds, then the state keys,
-- then (ARGV[2] = 1) the fence marker, read as the acquires read it but never written.
-- ARGV[1] now_us, ARGV[2] 1 when fenced, ARGV[3] n, then 5 per limit as text, as settle.lua's
-- (code, count, period_us, burst, cost: the cost to ask about), ARGV[4+5n], ARGV[5+5n]
-- unused, then 2 hold fields per limit.
--
-- Returns per limit ' allowed remaining retry_after_us reset_us' after a leading '0':
-- acquire.lua's per-limit fields, but for remaining, which is what is there now (before
-- any cost is taken). A held limit reads allowed 0, with retry_after_us at least
-- the time until its hold ends; remaining and reset are still its state's. Nothing is
-- written, but for a concurrency limit's sweep of expired leases.

local now = clock_us(ARGV[1])
if ARGV[2] == '1' then
  FENCE = tonumber(redis.call('GET', KEYS[#KEYS])) or 0
end
local n = tonumber(ARGV[3])
local fields = {}
for i = 1, 2 * n do
  fields[i] = ARGV[5 + 5 * n + i]
end
local held = redis.call('HMGET', KEYS[1], unpack(fields))
local reply = '0'
local k = 2
for i = 1, n do
  local l = limit_record(i, k)
  -- Twice: with no cost for what is there now, with the cost for when it could pass.
  local _, _, _, remaining, reset = l.algo.check(k, l.count, l.period_us, l.burst, now, 0, 0)
  local allowed, _, retry = l.algo.check(k, l.count, l.period_us, l.burst, now, l.cost, 0)
  local hold = math.max(tonumber(held[2 * i - 1]) or 0, tonumber(held[2 * i]) or 0)
  if hold > now then
    allowed, retry = 0, math.max(retry, ceil_us(hold - now))
  end
  reply = reply .. ' ' .. allowed .. ' ' .. fmt(remaining) .. ' ' .. retry .. ' ' .. reset
  k = k + l.algo.nkeys
end
return reply
