-- acquire.lua: take `cost` from one or more limits, all or nothing.
--
-- KEYS[1]      lease record of this acquisition (HASH; used only when ARGV[4] ~= '')
-- KEYS[2..]    state keys of each limit in order; a limit takes ALGO[algo].nkeys keys
-- ARGV[1]      now_us        '' = read Redis TIME (always, outside tests)
-- ARGV[2]      cost          tokens taken from every limit, >= 0, fractions allowed
-- ARGV[3]      max_wait_us   reserve a future slot up to this far ahead (token bucket, GCRA)
-- ARGV[4]      acquisition   id of the lease record ('' = none); also the concurrency holder
-- ARGV[5]      lease_us      how long the record and concurrency units live after the slot
-- ARGV[6]      n             number of limits
-- ARGV[7..]    4 per limit:  algo ('tb'|'gcra'|'fw'|'sw'|'conc'), count, period_us, burst
--              (burst = the capacity: bucket size, or count for windows and concurrency)
--
-- Returns {status, allowed, wait_us, retry_after_us, n, then 4 per limit:
--          allowed, remaining (string), retry_after_us, reset_us}
--   status 0 = decided now; 1 = the acquisition already holds a live lease (a redelivery):
--              allowed, nothing taken again, wait_us = time until its reserved slot;
--          2 = cost exceeds the capacity of limit number `allowed` (never satisfiable).
--   allowed 1/0. All times are integers in us; remaining is tokens left after this call.
--   On denial nothing is written anywhere, and retry_after_us is the largest wait among the
--   limits that could not admit the cost now.

local now = clock_us(ARGV[1])
local cost = tonumber(ARGV[2])
local max_wait = tonumber(ARGV[3])
local acq = ARGV[4]
local lease_us = tonumber(ARGV[5])
local n = tonumber(ARGV[6])

if acq ~= '' then
  local held = redis.call('HMGET', KEYS[1], 's', 'at')
  if held[1] == '1' then
    return {1, 1, ceil_us(tonumber(held[2]) - now), 0, 0}
  end
end

local limits = {}
local ki = 2
for i = 1, n do
  local a = 6 + (i - 1) * 4
  local algo = ALGO[ARGV[a + 1]]
  local p = {count = tonumber(ARGV[a + 2]), period_us = tonumber(ARGV[a + 3]),
             burst = tonumber(ARGV[a + 4])}
  if cost > p.burst then
    return {2, i, 0, 0, 0}
  end
  local keys = {}
  for j = 1, algo.nkeys do
    keys[j] = KEYS[ki]
    ki = ki + 1
  end
  limits[i] = {algo = algo, p = p, keys = keys}
end

local allowed, wait, retry = 1, 0, 0
for i = 1, n do
  local l = limits[i]
  l.r = l.algo.check(l.keys, l.p, now, cost, max_wait)
  if l.r.allowed == 0 then
    allowed = 0
  end
  wait = math.max(wait, l.r.wait)
  retry = math.max(retry, l.r.retry, l.r.wait)
end

local out = {0, allowed, 0, 0, n}
if allowed == 1 then
  out[3] = wait
  local slot = now + wait
  local expiry = slot + lease_us
  local record = {}
  for i = 1, n do
    local l = limits[i]
    local mark = l.algo.commit(l.keys, l.p, now, cost, l.r, acq, expiry)
    record[#record + 1] = 'k' .. i
    record[#record + 1] = l.keys[1]
    record[#record + 1] = 'm' .. i
    record[#record + 1] = mark
  end
  if acq ~= '' then
    redis.call('HSET', KEYS[1], 's', '1', 'c', fmt(cost), 'at', fmt(slot), 'n', n,
               unpack(record))
    redis.call('PEXPIRE', KEYS[1], ttl_ms(expiry - now) - 1000)
  end
else
  out[4] = retry
end
for i = 1, n do
  local r = limits[i].r
  out[#out + 1] = r.allowed
  out[#out + 1] = fmt(r.remaining)
  out[#out + 1] = r.retry
  out[#out + 1] = r.reset
end
return out
