-- acquire.lua: take `cost` from one or more limits, all or nothing.
--
-- KEYS         the state keys of each limit in order (ALGO[code].nkeys each), then, when
--              an acquisition id is given, its lease record (a HASH)
-- ARGV[1]      now_us        '' = read Redis TIME (always, outside tests)
-- ARGV[2]      max_wait_us   reserve a future slot up to this far ahead (token bucket, GCRA)
-- ARGV[3]      n             number of limits
-- ARGV[4..]    5 per limit:  code ('tb'|'gcra'|'fw'|'sw'|'conc'), count, period_us, burst,
--              cost (burst = the capacity: bucket size, or count for windows and
--              concurrency; cost = tokens taken from this limit, >= 0, fractions allowed:
--              one call may cost 1 request and 2000 tokens)
-- then, optionally:
-- ARGV[4+5n]   acquisition   id of the lease record; also the concurrency holder
-- ARGV[5+5n]   lease_us      how long the record and concurrency units live after the slot
--
-- Returns one string of space-separated numbers (one bulk reply is cheaper to parse than
-- many): remaining as '%.17g'; durations are whole us, written exactly below 1e14 us
-- (3 years), to 14 significant digits beyond.
--   'status allowed wait_us retry_after_us' then per limit
--   ' allowed remaining retry_after_us reset_us'
--   status 0 = decided now;
--          1 = the acquisition id already holds a live lease on these same keys (a
--              redelivery): allowed, nothing taken again, wait_us = time until its reserved
--              slot, retry_after_us = how long ago the slot passed (0 if it has not), then
--              the cost it reserved from each limit instead of per-limit fields;
--          2 = cost exceeds the capacity of limit number `allowed` (never satisfiable);
--          3 = the acquisition id holds a live lease on other limits or keys: nothing done.
--   On denial nothing is taken from any limit (the only writes are a concurrency limit's
--   sweep of expired leases), and retry_after_us is the largest wait among the limits that
--   could not admit the cost now.

local now = clock_us(ARGV[1])
local max_wait = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local acq = ARGV[4 + 5 * n]

if acq then
  local lease = KEYS[#KEYS]
  local held = redis.call('HMGET', lease, 's', 'at', 'n')
  if held[1] == '1' then
    -- Taken already (a redelivered task): nothing again, if it is the same limits and keys.
    if tonumber(held[3]) ~= n then
      return '3'
    end
    local fields = {}
    for i = 1, n do
      fields[i] = 'k' .. i
    end
    for i = 1, n do
      fields[n + i] = 'c' .. i
    end
    local recorded = redis.call('HMGET', lease, unpack(fields))
    local k = 1
    local at = tonumber(held[2])
    local reply = '1 1 ' .. ceil_us(at - now) .. ' ' .. ceil_us(now - at)
    for i = 1, n do
      if recorded[i] ~= KEYS[k] then
        return '3'
      end
      k = k + ALGO[ARGV[5 * i - 1]].nkeys
      reply = reply .. ' ' .. recorded[n + i]
    end
    return reply
  end
end

local limits = {}
local allowed, wait, retry = 1, 0, 0
local k = 1
for i = 1, n do
  local l = limit_record(i, k)
  local algo = l.algo
  if l.cost > l.burst then
    return '2 ' .. i
  end
  l.allowed, l.wait, l.retry, l.remaining, l.reset, l.s1, l.s2, l.s3 =
    algo.check(k, l.count, l.period_us, l.burst, now, l.cost, max_wait)
  limits[i] = l
  k = k + algo.nkeys
  if l.allowed == 0 then
    allowed = 0
  end
  wait = math.max(wait, l.wait)
  retry = math.max(retry, l.retry, l.wait)
end

local head
if allowed == 1 then
  head = '0 1 ' .. wait .. ' 0'
  local slot = now + wait
  local expiry, record
  if acq then
    expiry = slot + tonumber(ARGV[5 + 5 * n])
    record = {'s', '1', 'at', slot, 'n', n}
  end
  for i = 1, n do
    local l = limits[i]
    local mark, reset = l.algo.commit(l.k, l.count, l.period_us, l.burst, now, l.cost, acq,
                                      expiry, l.s1, l.s2, l.s3)
    if reset then
      l.reset = reset
    end
    if acq then
      record[#record + 1] = 'k' .. i
      record[#record + 1] = KEYS[l.k]
      record[#record + 1] = 'm' .. i
      record[#record + 1] = mark
      record[#record + 1] = 'c' .. i
      record[#record + 1] = l.cost
    end
  end
  if acq then
    redis.call('HSET', KEYS[#KEYS], unpack(record))
    redis.call('PEXPIRE', KEYS[#KEYS], ttl_ms(expiry - now) - 1000)
  end
else
  head = '0 0 0 ' .. retry
end
-- Built by concatenation, not table.concat: for the usual one or two limits that makes
-- fewer objects on the server.
for i = 1, n do
  local l = limits[i]
  head = head .. ' ' .. l.allowed .. ' ' .. fmt(l.remaining) .. ' ' .. l.retry .. ' ' .. l.reset
end
return head
